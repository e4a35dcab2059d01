// attn_ext: the CPU kernels compiled for AVX2 + FMA (flags: isa_flags.txt).
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "attention_kernel_impl.h"

ATTN_EXT_REGISTER_CPU_KERNELS("avx2", 1, AVX2)
