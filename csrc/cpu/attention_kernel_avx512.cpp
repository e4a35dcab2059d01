// attn_ext: the CPU kernels compiled for AVX-512 F/BW/VL/DQ (flags: isa_flags.txt):
// 16 float lanes and 32 vector registers.
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "attention_kernel_impl.h"

ATTN_EXT_REGISTER_CPU_KERNELS("avx512", 2, AVX512)
