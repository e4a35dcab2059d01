// attn_ext: what the tensor-core attention kernels (attention_tc_fwd.cu,
// attention_tc_bwd.cu) share: the tile sizes, the PTX wrappers, the
// shared-memory tile layout, and the masking and dropout of score fragments.
//
// Torch-free on purpose (see kernels.h): CUDA headers and our own headers only.
//
// =============================================================================
// Method (FlashAttention-2, written by hand with mma.sync)
// =============================================================================
// Forward: a CTA of 4 warps owns a tile of kBlockM = 128 query rows; warp w owns
// rows {s * 64 + w * 16 + [0, 16)} for strips s = 0, 1, so the softmax of a row never
// leaves its warp (no cross-warp reduction). K/V tiles of kBlockN keys stream
// through a cp.async double buffer. Per tile: S = Q K^T (mma, f32 accumulators
// in registers), scale, mask, online softmax in registers, dropout, then
// O += P V with P converted to f16/bf16 in registers: the S accumulator
// fragment of mma is exactly the A fragment layout P needs (see below), so P
// never touches shared memory. O, the row max and the row sum stay in
// registers for the whole key loop.
//
// Backward: a CTA owns kBlockN keys (16 per warp) of one query head and keeps
// K, V in shared memory and dK, dV in registers while it walks the query tiles
// that can see those keys. It works on the transposed tile S^T = K Q^T, so a
// warp's rows are its own keys: P^T and dS^T come out of the mma accumulators
// already in the A layout of dV += P^T dO and dK += dS^T Q. Only dQ = dS K
// needs the whole tile: dS^T goes through shared memory once per query tile
// and dQ is added to a float32 workspace with atomics.
//
// =============================================================================
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type" and "Warp-level matrix load instruction: ldmatrix").
// Notation: lane = %laneid, g = lane / 4 ("groupID"), t = lane % 4
// ("threadID_in_group"). A 32-bit register "x2(a, b)" holds two 16-bit
// elements, a in the low half, b in the high half.
// =============================================================================
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D (16x8) = A (16x16) B (16x8) + C
//   A, 4 registers:  a[0] = x2(A[g    ][2t], A[g    ][2t+1])
//                    a[1] = x2(A[g + 8][2t], A[g + 8][2t+1])
//                    a[2] = x2(A[g    ][2t+8], A[g    ][2t+9])
//                    a[3] = x2(A[g + 8][2t+8], A[g + 8][2t+9])
//   B, 2 registers:  b[0] = x2(B[2t    ][g], B[2t + 1][g])
//                    b[1] = x2(B[2t + 8][g], B[2t + 9][g])
//   C/D, 4 floats:   c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1]
//
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 {r0, r1, r2, r3}, [addr]:
//   lanes 8i .. 8i+7 give the addresses of rows 0..7 of matrix i (16 bytes
//   each); register ri receives matrix i:
//     plain:  ri = x2(M_i[g][2t], M_i[g][2t+1])
//     .trans: ri = x2(M_i[2t][g], M_i[2t+1][g])
//   Below, mi = lane / 8 is the matrix whose row lane (lane % 8) addresses.
//
// The four loads the kernels use (all on the swizzled tiles of SmemTile):
//   ldsm_a     A = X[m0 .. m0 + 16)[k0 .. k0 + 16) of a row-major tile X (Q in the forward,
//              K or V in the backward). Matrix mi = rows m0 + 8 (mi & 1),
//              columns k0 + 8 (mi >> 1), so r0..r3 = a[0..3] above.
//   ldsm_a_t   A = X^T for a tile X stored [k][m] (dS^T in the backward's dQ).
//              .trans; matrix mi = X rows k0 + 8 (mi >> 1), columns m0 + 8 (mi & 1):
//              r0 = x2(X[k0+2t][m0+g], X[k0+2t+1][m0+g]) = x2(A[g][2t], A[g][2t+1]) = a[0], etc.
//   ldsm_b     B = X^T for a tile X stored [n][k] (K in S = Q K^T: B[k][n] = K[n][k]),
//              two n-blocks at once. Matrix mi = X rows n0 + 8 (mi >> 1),
//              columns k0 + 8 (mi & 1): r0, r1 = b[0], b[1] of n-block n0,
//              r2, r3 = b[0], b[1] of n-block n0 + 8.
//   ldsm_b_t   B = X for a tile X stored [k][n] (V in O += P V: B[k][n] = V[k][n]),
//              two n-blocks at once. .trans; matrix mi = X rows k0 + 8 (mi & 1),
//              columns n0 + 8 (mi >> 1): r0 = x2(V[k0+2t][n0+g], V[k0+2t+1][n0+g]) = b[0]
//              of n-block n0, r1 = b[1] of n0, r2, r3 = b[0], b[1] of n0 + 8.
//
// Accumulator -> A operand, with no data movement (P in the forward, P^T and
// dS^T in the backward): the accumulators of two neighbouring n-blocks 2kk,
// 2kk + 1 of a 16-row strip are the A operand of k-step kk of the next product:
//   a[0] = x2(c[2kk][0], c[2kk][1])      a[1] = x2(c[2kk][2], c[2kk][3])
//   a[2] = x2(c[2kk+1][0], c[2kk+1][1])  a[3] = x2(c[2kk+1][2], c[2kk+1][3])
// (c[n][0..1] is row g, columns 8n + 2t, 8n + 2t + 1; c[n][2..3] is row g + 8.)
//
// Shared-memory layout (SmemTile): a tile of R rows x C 16-bit columns is
// stored row-major in 16-byte chunks, with a row pitch of a whole number of
// 128-byte lines (C rounded up to 64); chunk c of row r is stored at chunk
// c ^ (r % 8) of its row. An ldmatrix phase reads one chunk column of 8
// consecutive rows: the XOR sends them to 8 different 16-byte bank groups, so
// ldmatrix (plain and .trans) is free of bank conflicts, and so are the
// cp.async writes of 8 consecutive chunks of a row.
// =============================================================================
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../attention_math.h"
#include "kernels.h"

namespace attn_ext::cuda::tc {

// -----------------------------------------------------------------------------
// Tile sizes, per head dim, in one table.
//   fwd_block_m    query rows per forward CTA (fwd_warps warps x 16 rows x 2 strips)
//   fwd_block_n    keys per K/V tile of the forward
//   fwd_q_regs     the forward keeps Q's A fragments in registers (else re-reads
//                  them from shared memory for every K/V tile)
//   bwd            the backward's tiles:
//     block_n      keys per CTA (warps x 16 keys)
//     block_m      query rows per step
//     kv_regs      each warp keeps its K and V A fragments in registers
//   bwd_short      the backward's tiles for short sequences (block_n = 0: none)
//   short_rows     ... taken when the query rows a key sees on average (L, or
//                  L / 2 when causal) are at most this
// Registers per thread (f32 accumulators): forward O = E, S = fwd_block_n
// (2 strips); backward dK + dV = E, S^T + dP^T = bwd_block_m. With E = 128
// that is 192 of the 255 registers a thread may have, the rest is operands
// and addresses; the forward at E = 128 is the tightest kernel. So a backward
// CTA of 8 warps is alone on its multiprocessor, and its prologue (K, V and
// the first query tile) and epilogue (dK, dV) overlap nothing; a 4-warp CTA
// shares it with another one. That pays where the CTAs' query loops are short
// and costs where they are long, as the short tiles add dQ atomics (one per 64
// keys instead of 128). Measured on an H100 (bf16, 16k tokens, one run each,
// backward TFLOP/s, 8-warp tiles -> 4-warp tiles): E = 64, L = 512 causal
// 60 -> 89, L = 1024 74 -> 81 (91 causal -> 121), L = 2048 causal 134 -> 142,
// L = 2048 184 -> 177, L = 8192 216 -> 203; E = 128, L = 1024 causal 108 ->
// 124, L = 1024 176 -> 166, L = 2048 204 -> 184. Hence short_rows.
// -----------------------------------------------------------------------------
struct BwdTiles {
  int block_n, block_m, warps;
  bool kv_regs;
};

struct TileSizes {
  int head_dim;
  int fwd_block_m, fwd_block_n, fwd_warps;
  bool fwd_q_regs;
  BwdTiles bwd, bwd_short;
  int short_rows;
};

inline constexpr TileSizes kTileTable[] = {
    //  E  fwd: BM   BN  warps Q-regs  bwd: BN  BM  warps KV-regs  bwd_short           short_rows
    {32,      128,  64,  4,    true,      {64,  64, 4,    true},   {0, 0, 0, false},    0},
    {64,      128,  64,  4,    true,      {128, 64, 8,    true},   {64, 64, 4, true},   1024},
    {96,      128,  64,  4,    false,     {128, 64, 8,    false},  {0, 0, 0, false},    0},
    {128,     128,  64,  4,    false,     {128, 64, 8,    false},  {64, 64, 4, false},  512},
};

constexpr TileSizes tile_sizes(int head_dim) {
  for (const TileSizes& t : kTileTable)
    if (t.head_dim == head_dim) return t;
  return TileSizes{0, 0, 0, 0, false, {0, 0, 0, false}, {0, 0, 0, false}, 0};
}

// Whether head dim kHeadDim has short backward tiles.
template <int kHeadDim>
inline constexpr bool kHasShortBackward = tile_sizes(kHeadDim).bwd_short.block_n > 0;

// The head dims that have kernels; dispatch_head_dim() is the one switch over them.
template <typename Fn>
bool dispatch_head_dim(int64_t head_dim, Fn&& fn) {
  switch (head_dim) {
    case 32: fn(std::integral_constant<int, 32>{}); return true;
    case 64: fn(std::integral_constant<int, 64>{}); return true;
    case 96: fn(std::integral_constant<int, 96>{}); return true;
    case 128: fn(std::integral_constant<int, 128>{}); return true;
    default: return false;
  }
}

template <typename Fn>
void dispatch_tc_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::BFloat16) {
    fn(__nv_bfloat16{});
  } else {
    fn(__half{});
  }
}

// -----------------------------------------------------------------------------
// Shared-memory tile of kRows x kCols 16-bit elements (kCols a multiple of 8),
// swizzled as described at the top. Offsets are in bytes from the tile start.
// -----------------------------------------------------------------------------
template <int kRows, int kCols>
struct SmemTile {
  static_assert(kCols % 8 == 0, "rows are made of 16-byte chunks");
  static constexpr int kRowsN = kRows;
  static constexpr int kChunks = kCols / 8;                     // chunks of data per row
  static constexpr int kPitchChunks = (kChunks + 7) / 8 * 8;    // whole 128-byte lines
  static constexpr int kPitchBytes = kPitchChunks * 16;
  static constexpr int kBytes = kRows * kPitchBytes;
  __host__ __device__ static constexpr uint32_t offset(int row, int chunk) {
    return static_cast<uint32_t>((row * kPitchChunks + (chunk ^ (row & 7))) * 16);
  }
};

// The forward's and the backward's tile shapes and shared-memory plans, from
// the table. The smem sizes also decide tensor_core_unsupported().
template <int kHeadDim>
struct FwdTraits {
  static constexpr TileSizes kT = tile_sizes(kHeadDim);
  static_assert(kT.head_dim == kHeadDim, "no tile sizes for this head dim");
  static constexpr int kWarps = kT.fwd_warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kT.fwd_block_m;
  static constexpr int kBlockN = kT.fwd_block_n;
  static constexpr int kStrips = kBlockM / (16 * kWarps);  // 16-row strips per warp
  static constexpr bool kQInRegs = kT.fwd_q_regs;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  // Q, then K[2], then V[2] (double buffer).
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemK = kSmemQ + QTile::kBytes;
  static constexpr int kSmemV = kSmemK + 2 * KVTile::kBytes;
  static constexpr int kSmemBytes = kSmemV + 2 * KVTile::kBytes;
  static_assert(kBlockM % (16 * kWarps) == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0, "tile shapes");
};

template <int kHeadDim, bool kShort = false>
struct BwdTraits {
  static_assert(tile_sizes(kHeadDim).head_dim == kHeadDim, "no tile sizes for this head dim");
  static_assert(!kShort || kHasShortBackward<kHeadDim>, "no short backward tiles for this head dim");
  static constexpr BwdTiles kT = kShort ? tile_sizes(kHeadDim).bwd_short : tile_sizes(kHeadDim).bwd;
  static constexpr int kWarps = kT.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockN = kT.block_n;  // keys per CTA, 16 per warp
  static constexpr int kBlockM = kT.block_m;  // query rows per step
  static constexpr bool kKVInRegs = kT.kv_regs;
  // dQ = dS K is split over the warps: kBlockM / 16 row strips x kDqColGroups column groups.
  static constexpr int kDqColGroups = kWarps / (kBlockM / 16);
  static constexpr int kDqCols = kHeadDim / kDqColGroups;
  using KVTile = SmemTile<kBlockN, kHeadDim>;
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using DsTile = SmemTile<kBlockN, kBlockM>;  // dS^T, [key][query]
  // K, V, Q[2], dO[2], dS^T, then float lse * log2(e) [2][kBlockM] and delta [2][kBlockM].
  static constexpr int kSmemK = 0;
  static constexpr int kSmemV = kSmemK + KVTile::kBytes;
  static constexpr int kSmemQ = kSmemV + KVTile::kBytes;
  static constexpr int kSmemDo = kSmemQ + 2 * QTile::kBytes;
  static constexpr int kSmemDs = kSmemDo + 2 * QTile::kBytes;
  static constexpr int kSmemLse = kSmemDs + DsTile::kBytes;
  static constexpr int kSmemDelta = kSmemLse + 2 * kBlockM * 4;
  static constexpr int kSmemBytes = kSmemDelta + 2 * kBlockM * 4;
  static_assert(kBlockN == 16 * kWarps && kBlockM % 16 == 0 && kWarps % (kBlockM / 16) == 0 &&
                    kDqCols % 16 == 0,
                "tile shapes");
};

// =============================================================================
// PTX wrappers (sm_80+). Everything the kernels do that is not plain C++ goes
// through these few functions.
// =============================================================================

__device__ __forceinline__ char* dynamic_smem() {
  extern __shared__ __align__(128) char attn_tc_smem[];
  return attn_tc_smem;
}

// The shared-space address of a pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes 16 zero bytes
// (the global address is then not read, but must still be a valid pointer).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits for all of this thread's cp.async groups (pair it with __syncthreads()
// to see the other threads' copies).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// d += A B for one m16n8k16 step; see the fragment layouts at the top.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// *addr += (a, b) for two consecutive floats (8-byte aligned).
__device__ __forceinline__ void atomic_add_f32x2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(addr), make_float2(a, b));
#else
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
#endif
}

// Launches kKernel with `smem_bytes` of dynamic shared memory on `stream`.
// Above the default 48 KiB a kernel must opt in, once per device: done on its
// first launch there. If the opt-in fails, nothing is launched and its error
// stays for the host's launch check (C10_CUDA_KERNEL_LAUNCH_CHECK) to raise.
template <auto kKernel, typename... Args>
void launch_kernel(dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream, const Args&... args) {
  if (smem_bytes > 48 * 1024) {
    static std::atomic<uint64_t> opted_in{0};  // bit d: done on device d (devices 0..63)
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return;
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit == 0 || !(opted_in.load(std::memory_order_relaxed) & bit)) {
      if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes) != cudaSuccess)
        return;
      opted_in.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  kKernel<<<grid, block, smem_bytes, stream>>>(args...);
}

// =============================================================================
// End of the PTX wrappers.
// =============================================================================

// An opaque copy of x: the compiler cannot treat the result as loop-invariant,
// so values derived from it are not hoisted out of a loop (which would keep
// them alive, in registers, across the whole loop).
__device__ __forceinline__ int64_t opaque(int64_t x) {
  asm volatile("" : "+l"(x));
  return x;
}
__device__ __forceinline__ uint32_t opaque(uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// -----------------------------------------------------------------------------
// 16-bit element types: packing two floats into an mma operand register.
// -----------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  }
  return bits;
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

// -----------------------------------------------------------------------------
// Operand loads from SmemTile tiles (layouts: see the top of this file).
// `tile` is the tile's shared-space address; coordinates are in elements.
// -----------------------------------------------------------------------------

// Each lane addresses one 16-byte row piece: row row0 + lane_row, chunk
// chunk0 + lane_chunk, with row0 a multiple of 8 and chunk0 even (so that
// row & 7 = lane_row & 7 and chunk = chunk0 | lane_chunk). Then the swizzled
// offset splits into a compile-time part and a per-lane part:
//   offset = row0 * pitch + (chunk0 & ~7) * 16                       (constant)
//          + lane_row * pitch + ((lane_x * 16) ^ ((chunk0 & 7) * 16))  (per lane)
// with lane_x = lane_chunk ^ (lane_row & 7): one XOR and one add per load,
// instead of per-chunk offsets that the compiler would keep in registers.
// Two lane patterns cover the four loads (mi = lane / 8, r = lane % 8):
//   rows-first:    lane_row = 8 (mi & 1) + r, lane_chunk = mi >> 1   (ldsm_a, ldsm_b_t)
//   chunks-first:  lane_row = 8 (mi >> 1) + r, lane_chunk = mi & 1   (ldsm_a_t, ldsm_b)
template <class Tile, bool kRowsFirst>
__device__ __forceinline__ uint32_t ldsm_addr(uint32_t tile, int row0, int chunk0, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  const int lane_row = kRowsFirst ? (mi & 1) * 8 + r : (mi >> 1) * 8 + r;
  const int lane_chunk = kRowsFirst ? mi >> 1 : mi & 1;
  const uint32_t lane_x = static_cast<uint32_t>(lane_chunk ^ r);
  return tile + static_cast<uint32_t>(row0 * Tile::kPitchBytes + (chunk0 & ~7) * 16 + lane_row * Tile::kPitchBytes) +
         ((lane_x * 16) ^ static_cast<uint32_t>((chunk0 & 7) * 16));
}

// A = X[m0 .. m0 + 16)[k0 .. k0 + 16) of a row-major tile X.
template <class Tile>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], uint32_t tile, int m0, int k0, int lane) {
  ldmatrix_x4(a, ldsm_addr<Tile, true>(tile, m0, k0 / 8, lane));
}

// A = (X[k0 .. k0 + 16)[m0 .. m0 + 16))^T of a tile X stored [k][m].
template <class Tile>
__device__ __forceinline__ void ldsm_a_t(uint32_t (&a)[4], uint32_t tile, int m0, int k0, int lane) {
  ldmatrix_x4_trans(a, ldsm_addr<Tile, false>(tile, k0, m0 / 8, lane));
}

// B operands of n-blocks n0 (b[0], b[1]) and n0 + 8 (b[2], b[3]), k-step k0,
// for B[k][n] = X[n][k] of a tile X stored [n][k].
template <class Tile>
__device__ __forceinline__ void ldsm_b(uint32_t (&b)[4], uint32_t tile, int n0, int k0, int lane) {
  ldmatrix_x4(b, ldsm_addr<Tile, false>(tile, n0, k0 / 8, lane));
}

// The same for B[k][n] = X[k][n] of a tile X stored [k][n].
template <class Tile>
__device__ __forceinline__ void ldsm_b_t(uint32_t (&b)[4], uint32_t tile, int k0, int n0, int lane) {
  ldmatrix_x4_trans(b, ldsm_addr<Tile, true>(tile, k0, n0 / 8, lane));
}

// Accumulators of n-blocks 2kk, 2kk + 1 of a 16-row strip -> A operand of k-step kk.
template <typename T, int kN>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[kN][4], int kk) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// One k-step of D += A B across a row of n-blocks: acc[s][n] += A_s B_n for
// the kStrips 16-row strips A_s = a[s] and the n-blocks n = 0 .. kN - 1. The B
// operands come two n-blocks at a time, load_b(b, n) giving those of n and
// n + 1 (ldsm_b or ldsm_b_t), and each pair serves every strip.
template <typename T, int kStrips, int kN, typename LoadB>
__device__ __forceinline__ void mma_k_step(float (&acc)[kStrips][kN][4], const uint32_t (&a)[kStrips][4],
                                           LoadB&& load_b) {
  static_assert(kN % 2 == 0, "n-blocks come in pairs");
#pragma unroll
  for (int n = 0; n < kN; n += 2) {
    uint32_t b[4];
    load_b(b, n);
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
      mma_16816<T>(acc[s][n], a[s], b[0], b[1]);
      mma_16816<T>(acc[s][n + 1], a[s], b[2], b[3]);
    }
  }
}

// The same for a single strip.
template <typename T, int kN, typename LoadB>
__device__ __forceinline__ void mma_k_step(float (&acc)[kN][4], const uint32_t (&a)[4], LoadB&& load_b) {
  mma_k_step<T>(reinterpret_cast<float(&)[1][kN][4]>(acc), reinterpret_cast<const uint32_t(&)[1][4]>(a), load_b);
}

// -----------------------------------------------------------------------------
// Global -> shared tile copies.
// -----------------------------------------------------------------------------

// Thread tid copies 16-byte chunk c = tid % kSpan of rows tid / kSpan + k *
// kRowStep, k = 0, 1, ...: kRowStep is a multiple of 8, so all these rows
// share one swizzle and their shared-memory offsets differ by constants. The
// base addresses are opaque(): hoisted out of the caller's loop, one per k,
// they would pin registers that the kernels need for their accumulators.
template <class Tile, int kThreads>
struct TileCopy {
  static constexpr bool kEven = kThreads % Tile::kChunks == 0 && (kThreads / Tile::kChunks) % 8 == 0;
  static constexpr int kSpan = kEven ? Tile::kChunks : Tile::kPitchChunks;  // threads per row
  static constexpr int kRowStep = kThreads / kSpan;
  static constexpr int kSteps = Tile::kRowsN / kRowStep;
  static_assert(kThreads % kSpan == 0 && kRowStep % 8 == 0 && Tile::kRowsN % kRowStep == 0, "tile copy shape");
};

// Rows [0, n_rows) of a (rows, kCols) matrix at `src` (row stride `ld`
// elements, unit column stride, 16-byte aligned rows) into `Tile`, by cp.async;
// rows n_rows .. kRows are zero-filled. All kThreads threads call this.
template <class Tile, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(uint32_t tile, const T* src, int64_t ld, int n_rows, int tid) {
  using Copy = TileCopy<Tile, kThreads>;
  const int c = tid % Copy::kSpan, r0 = tid / Copy::kSpan;
  if (c >= Tile::kChunks) return;  // the pitch's padding chunks
  const uint32_t dst = opaque(tile + Tile::offset(r0, c));
  const int64_t step = opaque(ld * Copy::kRowStep * static_cast<int64_t>(sizeof(T)));
  const char* g = reinterpret_cast<const char*>(src + r0 * ld + c * 8);
#pragma unroll
  for (int k = 0; k < Copy::kSteps; ++k) {
    const bool valid = r0 + k * Copy::kRowStep < n_rows;
    cp_async_16(dst + k * Copy::kRowStep * Tile::kPitchBytes, valid ? static_cast<const void*>(g) : src,
                valid ? 16 : 0);
    g += step;
  }
}

// The same for a matrix of any strides (row stride rs, column stride cs):
// 16-byte aligned rows with cs == 1 go by cp.async, others element by element
// (plain stores, seen by the other threads after the next __syncthreads()).
template <class Tile, int kThreads, typename T>
__device__ __forceinline__ void load_tile_strided(char* tile_ptr, uint32_t tile, const T* src, int64_t rs, int64_t cs,
                                                  int n_rows, int tid) {
  using Copy = TileCopy<Tile, kThreads>;
  const int c = tid % Copy::kSpan, r0 = tid / Copy::kSpan;
  if (c >= Tile::kChunks) return;
  const uint32_t off = opaque(Tile::offset(r0, c));
  const int64_t step = opaque(rs * Copy::kRowStep);
  const T* g = src + r0 * rs + c * 8 * cs;
#pragma unroll
  for (int k = 0; k < Copy::kSteps; ++k) {
    const uint32_t o = off + k * Copy::kRowStep * Tile::kPitchBytes;
    if (r0 + k * Copy::kRowStep >= n_rows) {
      cp_async_16(tile + o, src, 0);
    } else if (cs == 1 && (reinterpret_cast<uintptr_t>(g) & 15) == 0) {
      cp_async_16(tile + o, g, 16);
    } else {
      T* d = reinterpret_cast<T*>(tile_ptr + o);
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = g[e * cs];
    }
    g += step;
  }
}

// -----------------------------------------------------------------------------
// Masking and dropout of score fragments: the rules come from attention_math.h.
// -----------------------------------------------------------------------------
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The masked score of one element, in log2 units: x = (q_i . k_j) * scale *
// log2(e), plus the additive mask m (times log2(e)); -inf where the bool mask
// says no or the key is not `visible` (outside visible_key_range(p, i): the
// causal bound, the window and the end of the keys; or i is a padding row of
// the tile). `m` points at the mask element (i, j) and is read only for
// visible elements. kKind is a template
// parameter so that callers switch on the mask kind once per tile.
template <MaskKind kKind, typename T>
__device__ __forceinline__ float masked_score(const char* m, bool visible, float x) {
  if constexpr (kKind == MaskKind::Additive) {
    const float add = visible ? to_float(*reinterpret_cast<const T*>(m)) : 0.0f;
    x = fmaf(add, kLog2e, x);
  } else if constexpr (kKind == MaskKind::Bool) {
    visible = visible && *reinterpret_cast<const bool*>(m);
  }
  return visible ? x : -INFINITY;
}

// Calls fn(std::integral_constant<MaskKind, kind>{}) for the runtime kind.
template <typename Fn>
__device__ __forceinline__ void dispatch_mask_kind(MaskKind kind, Fn&& fn) {
  switch (kind) {
    case MaskKind::None: fn(std::integral_constant<MaskKind, MaskKind::None>{}); break;
    case MaskKind::Bool: fn(std::integral_constant<MaskKind, MaskKind::Bool>{}); break;
    case MaskKind::Additive: fn(std::integral_constant<MaskKind, MaskKind::Additive>{}); break;
  }
}

// The mask element (b, h, i, j) as bytes (mask_bytes: the element size), or nullptr without a mask.
__device__ __forceinline__ const char* mask_ptr(const AttnParams& p, int mask_bytes, int64_t b, int64_t h, int64_t i,
                                                int64_t j) {
  if (p.mask_kind == MaskKind::None) return nullptr;
  const int64_t off = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] + j * p.mask_stride[3];
  return static_cast<const char*>(p.mask) + off * mask_bytes;
}

// Bit e (e = 0..3) set iff dropout keeps element (row, 4 * block + e): one
// Philox block gives the random numbers of these four columns
// (DropoutRowStream from column 4 * block).
__device__ __forceinline__ uint32_t dropout_keep_bits4(uint64_t seed, uint64_t row, int64_t block,
                                                       uint32_t threshold) {
  DropoutRowStream rng(seed, row, 4 * block);
  uint32_t bits = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) bits |= static_cast<uint32_t>(rng.next() >= threshold) << e;
  return bits;
}

// How many of the keys j0 .. j0 + n - 1 query row i sees: the causal rule
// and the end of the keys make them a prefix (causal_key_end); none for a
// padding row of the tile (row_valid false).
__device__ __forceinline__ int visible_keys(const AttnParams& p, int64_t i, bool row_valid, int64_t j0, int n) {
  const int64_t end = (row_valid ? causal_key_end(p, i) : 0) - j0;
  return static_cast<int>(end < 0 ? 0 : (end > n ? n : end));
}

// The first query row that sees key j (visible keys are a prefix [0,
// causal_key_end(p, i)) that grows with i), or L when no row does.
__device__ __forceinline__ int64_t first_row_seeing(const AttnParams& p, int64_t j) {
  int64_t lo = 0, hi = p.L;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (causal_key_end(p, mid) > j) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// The same rules with a sliding window, for the kernels instantiated with
// kWindow (the others keep the code above, register for register: at 255
// registers a thread, the window's extra bounds would spill there, and cost
// the backward 4-7 % without a window on an H100). Row i sees the keys of
// visible_key_range(p, i): of j0 .. j0 + n - 1, those j0 + c with
// window_cols_begin(...) <= c < window_cols_end(...). The forward masks the
// two ends in separate passes (one bound live at a time), the left one only
// in tiles that cross a window's left edge.
__device__ __forceinline__ int window_cols_end(const AttnParams& p, int64_t i, bool row_valid, int64_t j0, int n) {
  const int64_t end = (row_valid ? visible_key_range(p, i).end : 0) - j0;
  return static_cast<int>(end < 0 ? 0 : (end > n ? n : end));
}
__device__ __forceinline__ int window_cols_begin(const AttnParams& p, int64_t i, int64_t j0, int n) {
  const int64_t begin = visible_key_range(p, i).begin - j0;
  return static_cast<int>(begin < 0 ? 0 : (begin > n ? n : begin));
}
// The backward's pair of keys j and j + 8 for query row i: bit 0 set iff
// the row sees key j, bit 1 iff it sees key j + 8.
__device__ __forceinline__ int window_visible_pair(const AttnParams& p, int64_t i, bool row_valid, int64_t j) {
  if (!row_valid) return 0;
  const KeyRange keys = visible_key_range(p, i);
  const bool first = keys.begin <= j && j < keys.end, second = keys.begin <= j + 8 && j + 8 < keys.end;
  return static_cast<int>(first) | static_cast<int>(second) << 1;
}
// True when every query row of [i0, i_last] sees every key of [j0, j0 + n):
// the tile needs no masking but an attn_mask's.
__device__ __forceinline__ bool window_sees_whole_tile(const AttnParams& p, int64_t i0, int64_t i_last, int64_t j0,
                                                       int n) {
  return j0 + n <= visible_key_range(p, i0).end && j0 >= visible_key_range(p, i_last).begin;
}

// True when `p` has a sliding window (the kernels instantiated with kWindow run it).
inline bool has_window(const AttnParams& p) { return p.window_left >= 0 || p.window_right >= 0; }

// Grids put (batch, head) on y (and z past 65535).
inline dim3 tile_grid(int64_t tiles, int64_t batch_heads) {
  const int64_t y = batch_heads < 65535 ? batch_heads : 65535;
  return dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(y), static_cast<unsigned>((batch_heads + y - 1) / y));
}
__device__ __forceinline__ int64_t batch_head_index() {
  return static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y;
}

}  // namespace attn_ext::cuda::tc
