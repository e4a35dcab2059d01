// attn_ext: CPU kernel entry points and the table of instruction-set variants.
//
// attention_kernel_impl.h is compiled once per instruction set
// (attention_kernel_<isa>.cpp, flags in isa_flags.txt), each into its own
// namespace. Each unit adds its kernels to one table when the library loads
// (ATTN_EXT_REGISTER_CPU_KERNELS), as PyTorch's DispatchStub does;
// dispatch.cpp picks a variant per call: ATTN_EXT_CPU_ISA when set, else the
// widest one that this CPU runs and ATEN_CPU_CAPABILITY allows.
#pragma once

#include <cstdint>
#include <string>

#include "../attention.h"

namespace attn_ext::cpu {

// Tile sizes, in one place (every variant's driver; build_info reports the bounds). A forward
// task keeps a (q x kv) score tile, the packed K^T and V panels of its key block, and its Q and
// output rows in the core's L2; kv is the widest of kMaxForwardKeys, half that, ... down to
// kMinTileKeys keys whose working set takes at most half the L2 (this Xeon has 2 MiB per core:
// 512 keys; a Zen 3 EPYC 512 KiB: 256 keys at head dim 64). 64-row query blocks keep the causal
// diagonal's masked part small. The backward keeps more per key block (K, K^T, V^T, P, dS and
// the dK, dV sums): 64 x kMaxBackwardKeys, halved likewise.
struct BlockSizes {
  int64_t q;   // query rows per tile
  int64_t kv;  // keys per tile
};
constexpr int64_t kMaxQTile = 64;
constexpr int64_t kMaxForwardKeys = 512, kMaxBackwardKeys = 256, kMinTileKeys = 128;

// Query blocks of up to kDirectRows rows (decoding: L = 1; a grouped-query
// step's group as rows) read each key row in place: packing K^T for the
// micro-kernel would cost more than such a product. Measured (float32, 1 x 8
// heads x 4000 keys, 2 threads), in place against packed: on the Xeon 4 rows
// 0.95 ms against 1.33, 8 rows 1.55 against 1.38; on the AMD EPYC Zen 4 (three
// alternating rounds) 5 rows 0.50-0.56 against 0.65-0.76, 6 rows 0.60-0.64
// against 0.72-0.77, 8 rows 0.78-0.81 against 0.84-0.96. Six rows: faster on
// the Zen 4, and between the Xeon's two measured points.
constexpr int64_t kDirectRows = 6;
// float16 and bfloat16 on at::vec: packing converts every key to float32
// first, a cost per call that few rows do not repay. Measured on the Zen 4
// (float16, 1 x 8 heads x 4000 keys, 2 threads), in place against packed:
// 8 rows 0.93-0.96 ms against 3.13, 12 rows 1.05 against 2.12-2.15, 16 rows
// 1.35-1.37 against 2.29-2.37.
constexpr int64_t kDirectRowsConverted = 16;

// Calls of up to kDotRows query rows per block: decoding steps (a grouped-query
// step's group as rows, a few speculative tokens). See dots_suit (attention_kernel_amx.cpp).
constexpr int64_t kDotRows = 8;

// Forwards of fewer query rows than this keep avx512bf16's dot products on an Intel CPU
// (bf16_dot_products_pay).
constexpr int64_t kIntelDotForwardRows = 32;

// Defined in dispatch.cpp, compiled once without the variants' ISA flags (the variants' units
// call them; an inline definition here would be compiled under every unit's flags).
int64_t l2_cache_bytes();  // per core; 512 KiB where the OS does not say
BlockSizes forward_blocks(int64_t E, int64_t Ev);
BlockSizes backward_blocks(int64_t E, int64_t Ev);

// Whether avx512bf16's blocked bfloat16 products (more than kDotRows query rows; a backward
// when `backward`) run on its AVX512-BF16 dot products (gemm_dots) or on avx512's kernels,
// which convert the rows to float32 for FMA. The dot products pay on AMD's cores (Zen 4: a
// bfloat16 forward 1.6-2.0x faster than on avx512's kernels). On an Intel core without AMX
// tiles they do not: on a Xeon with AMX hidden (family 6 model 207, 2 threads) gemm_dots ran
// at 87-97 GFLOP/s on one core, where a whole float32 attention forward reached 245 on two,
// and avx512's kernels took 0.53-0.69x the dot products' forward time from 32 query rows on
// (4 x 8 heads x 1024 keys x 64, and 16 x 8 x 64 x 64) and 0.42-0.71x their backward's from
// 9 rows on; forwards of 9 and 16 rows were faster on the dot products (1.24 against 1.40 ms,
// 1.35 against 2.38: avx512's kernels convert every key for few rows). So on Intel the dot
// products keep the forwards of fewer than kIntelDotForwardRows rows (and the decoding rows,
// dots_suit, always); elsewhere, or with ATTN_EXT_CPU_ISA=avx512bf16 set (what that variant's
// tests run), all of them.
bool bf16_dot_products_pay(bool backward, int64_t rows);

using ForwardFn = void (*)(const AttnParams& params);
using BackwardFn = void (*)(const AttnBwdParams& params);

struct CpuKernels {
  const char* isa;  // "default", "avx2", "avx512", "avx512bf16" or "amx": the ATTN_EXT_CPU_ISA name
  int rank;         // wider is higher; the default choice is the highest usable one
  ForwardFn forward;
  BackwardFn backward;
};

// Adds one variant to the table; called by each kernel unit at load time.
bool register_cpu_kernels(const CpuKernels& kernels);

// Defines ISA_NS::attention_forward/backward's registration in a kernel unit. The entry is
// constant-initialised data, so that the unit's code run at load time (on every CPU, before any
// check of what it supports) is one call with its address: built at load time, the entry had
// been assembled with the unit's vector instructions (AVX's in the avx512 unit).
#define ATTN_EXT_REGISTER_CPU_KERNELS(NAME, RANK, ISA_NS)                       \
  namespace attn_ext::cpu {                                                     \
  namespace {                                                                   \
  constexpr CpuKernels kernels_##ISA_NS{NAME, RANK, &ISA_NS::attention_forward, \
                                        &ISA_NS::attention_backward};           \
  const bool registered_##ISA_NS = register_cpu_kernels(kernels_##ISA_NS);      \
  }                                                                             \
  }

// The variants' kernels, for units that hand some cases to another variant
// (amx and avx512bf16 run everything but their bfloat16 products, and amx its float16
// products, on avx512's kernels).
#define ATTN_EXT_DECLARE_CPU_KERNELS(ISA_NS)             \
  namespace ISA_NS {                                     \
  void attention_forward(const AttnParams& params);      \
  void attention_backward(const AttnBwdParams& params);  \
  }
ATTN_EXT_DECLARE_CPU_KERNELS(DEFAULT)
ATTN_EXT_DECLARE_CPU_KERNELS(AVX2)
ATTN_EXT_DECLARE_CPU_KERNELS(AVX512)
ATTN_EXT_DECLARE_CPU_KERNELS(AVX512BF16)
ATTN_EXT_DECLARE_CPU_KERNELS(AMX)
#undef ATTN_EXT_DECLARE_CPU_KERNELS

// Whether this CPU (and its operating system) can run a variant's code.
bool cpu_supports(const std::string& isa);

// The variant the next call runs (throws a c10::Error naming ATTN_EXT_CPU_ISA
// when that names a variant this build lacks or this CPU cannot run).
const CpuKernels& active_kernels();

// "cpu_isas=...;cpu_isas_supported=...;cpu_isa_active=...;cpu_l2_bytes=...;cpu_tile_rows=64;
// cpu_forward_tile_keys=128..512;cpu_backward_tile_keys=128..256;cpu_direct_rows=6;
// cpu_direct_rows_converted=16;cpu_dot_rows=8": for build_info.
std::string kernel_info();

void attention_forward(const AttnParams& params);
void attention_backward(const AttnBwdParams& params);

}  // namespace attn_ext::cpu
