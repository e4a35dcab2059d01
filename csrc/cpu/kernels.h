// attn_ext: CPU kernel entry points.
//
// attention_kernel_impl.h is compiled once per instruction set
// (attention_kernel_default.cpp, attention_kernel_avx2.cpp), each into its own
// namespace; dispatch.cpp picks one at run time from the CPU's capability, as
// PyTorch's DispatchStub does.
#pragma once

#include "../attention.h"

namespace attn_ext::cpu {

#define ATTN_EXT_DECLARE_CPU_KERNELS(ISA)                    \
  namespace ISA {                                            \
  void attention_forward(const AttnParams& params);          \
  void attention_backward(const AttnBwdParams& params);      \
  }

ATTN_EXT_DECLARE_CPU_KERNELS(DEFAULT)
#if defined(ATTN_EXT_HAVE_AVX2)
ATTN_EXT_DECLARE_CPU_KERNELS(AVX2)
#endif
#undef ATTN_EXT_DECLARE_CPU_KERNELS

// The instruction set whose kernels run here: "AVX2" or "DEFAULT". Honours
// ATEN_CPU_CAPABILITY=default like the rest of PyTorch.
const char* active_isa();
// The instruction sets this build compiled kernels for, e.g. "DEFAULT AVX2".
const char* compiled_isas();

void attention_forward(const AttnParams& params);
void attention_backward(const AttnBwdParams& params);

}  // namespace attn_ext::cpu
