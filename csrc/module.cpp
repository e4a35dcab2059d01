// attn_ext: the Python module attn_ext._C. It holds no Python functions:
// loading it runs the TORCH_LIBRARY registrations of the operators, which
// Python then reaches as torch.ops.attn_ext.*.
#include <Python.h>

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "attn_ext's operators (torch.ops.attn_ext)", -1, nullptr};
  return PyModule_Create(&module);
}
