// attn_ext: the CPU kernels compiled for the AVX2 instruction set.
// setup.py and CMakeLists.txt add the compiler flags for files named *_avx2.cpp.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "attention_kernel_impl.h"
