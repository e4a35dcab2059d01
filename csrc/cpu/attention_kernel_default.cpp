// attn_ext: the CPU kernels compiled for the DEFAULT instruction set.
// setup.py and CMakeLists.txt add the compiler flags for files named *_avx2.cpp.
#define CPU_CAPABILITY DEFAULT

#include "attention_kernel_impl.h"
