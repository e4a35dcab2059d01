// attn_ext: the CPU kernels with no extra instruction set (at::vec's portable
// code): the fallback every CPU runs.
#define CPU_CAPABILITY DEFAULT
#include "attention_kernel_impl.h"

ATTN_EXT_REGISTER_CPU_KERNELS("default", 0, DEFAULT)
