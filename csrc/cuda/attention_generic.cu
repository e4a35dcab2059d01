// attn_ext: the generic CUDA kernels: forward, backward and the explicit
// probabilities for every dtype (float16/bfloat16 accumulate in float32,
// float64 in float64), any head dims (E, Ev = 0 included), any strides, every
// feature: additive/bool masks read through strides, causal, sliding windows,
// softcap, ALiBi, sinks, dropout, GQA and packed batches (varlen). They are
// the correctness kernels (gradcheck on the GPU runs on them) and the
// fallback of the tensor-core path.
//
// Method. Everything is built from one tile: a (kBlockM query rows) x
// (kBlockN keys) score tile, held in registers, 4 consecutive keys x kRows
// rows per thread (4 consecutive keys = one Philox block, so each thread draws
// its dropout randoms with one Philox call per row). The dot products behind
// a tile (Q K^T, dO V^T) run over the head dim in chunks of kChunkD staged in
// shared memory, so no register array depends on E or Ev; outputs are produced
// kChunkOut columns at a time for the same reason.
//
//   forward     one block per (b, h, query tile, chunk of Ev columns): online
//               softmax over the key tiles (FlashAttention), O chunk in
//               registers, P staged in shared memory for O += P V. A head dim
//               above kChunkOut costs a recomputation of Q K^T per chunk.
//               Split-KV (kernels.h): one block per (key range, b, h, query
//               tile, chunk), partial rows to the workspace, then one warp
//               per row merges them.
//   probs       the same block with one output chunk: pass 1 finds each row's
//               lse, pass 2 recomputes the scores and writes exp(S - lse),
//               dropped, to params.probs.
//   backward    (1) delta = rowsum(dO * O) - dlse, one warp per row, then
//                   the sinks' gradient, one block per (b, h);
//               (2) one block per (b, h, key tile) loops over the query tiles
//                   that see its keys, recomputes P from lse and adds Z^T dO
//                   into dV and scale dS^T Q into dK (the block owns those rows
//                   of the workspace, so plain read-modify-writes, no atomics);
//               (3) one block per (b, h, query tile) loops over the key tiles,
//                   recomputes dS and adds scale dS K into dQ (owned rows
//                   again) and dS into the mask gradient (atomicAdd: mask
//                   elements are shared across broadcast dims).
//   Key tiles that no row of a query tile sees (causal bound, window) are
//   never visited. A packed batch runs as B sequences of the longest one's
//   tiles; a task past its own sequence's length ends at once.
//   Every result is thus computed in one fixed order (deterministic) except
//   the mask gradient when the mask broadcasts (the host decides; see
//   attention_cuda.cpp).
//
// This file includes CUDA headers and attn_ext's torch-free headers only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../attention_math.h"
#include "kernels.h"

namespace attn_ext::cuda {
namespace {

// ---------------------------------------------------------------------------
// Types: scalar_t is what the tensors hold (__half, __nv_bfloat16, float,
// double), T = acc_t<scalar_t> (attention_math.h) is what the kernels compute in.
// ---------------------------------------------------------------------------

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(acc_t<scalar_t> x);
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_acc<double>(double x) { return x; }

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
// tanh through expm1: under --use_fast_math nvcc turns tanhf into the
// tanh.approx instruction (relative error about 2^-11, far above float32's
// roundoff; the float64-reference tests see it), and expm1f stays exact to an ulp.
__device__ __forceinline__ float acc_tanh(float x) {
  const float em = expm1f(-2.0f * fabsf(x));  // in [-1, 0]
  return copysignf(-em / (2.0f + em), x);
}
__device__ __forceinline__ double acc_tanh(double x) { return tanh(x); }

template <typename T>
__device__ __forceinline__ T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}

// ---------------------------------------------------------------------------
// Block sizes, in one place, per accumulation type.
// ---------------------------------------------------------------------------
template <typename T>
struct GenericTiles {
  static constexpr int kThreads = 128;
  static constexpr int kBlockM = 32;                          // query rows per tile
  static constexpr int kBlockN = sizeof(T) == 8 ? 32 : 64;    // keys per tile
  static constexpr int kChunkD = 32;                          // head-dim chunk of Q K^T and dO V^T
  static constexpr int kChunkOut = sizeof(T) == 8 ? 32 : 64;  // columns of O, dQ, dK, dV per pass
  // Blocks per SM the tile kernels are compiled for (__launch_bounds__): 4 caps
  // them at 128 registers a thread, spilling a few bytes at most (ptxas -v).
  // The variants' code (softcap, ALiBi, windows, packed views) would otherwise
  // take them to 160-255 registers and halve the blocks resident per SM.
  static constexpr int kMinBlocks = 4;

  // Score tile layout: thread (ty, tx) owns rows ty + kTy * a (a < kRows) and
  // keys 4 tx .. 4 tx + 3. The kTx threads of a row are adjacent lanes of one warp.
  static constexpr int kTx = kBlockN / 4;
  static constexpr int kTy = kThreads / kTx;
  static constexpr int kRows = kBlockM / kTy;
  // The forward's O chunk uses the score tile's rows and columns tx + kTx * c.
  static constexpr int kOutCols = kChunkOut / kTx;
  // The backward's (rows x kChunkOut) products: a kOutTy x kOutTx thread grid,
  // rows ty + kOutTy * a, columns tx + kOutTx * c.
  static constexpr int kOutTx = 16;
  static constexpr int kOutTy = kThreads / kOutTx;

  static_assert(kTx <= 32 && (kTx & (kTx - 1)) == 0, "a row's threads must be a power-of-two group of lanes");
  static_assert(kBlockM % kTy == 0 && kChunkOut % kTx == 0, "tile sizes must divide among the threads");
  static_assert(kBlockN % kChunkD == 0, "P V runs over the key tile in chunks of kChunkD");
  static_assert(kBlockM % kOutTy == 0 && kBlockN % kOutTy == 0 && kChunkOut % kOutTx == 0,
                "output chunks must divide among the threads");
};

// Grid size for `tasks` blocks' worth of work; kernels loop over tasks with a
// stride of gridDim.x, so any task count fits a 1-D grid.
inline unsigned task_grid(int64_t tasks) { return static_cast<unsigned>(std::min<int64_t>(tasks, INT_MAX)); }

__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One (batch, head) slice of a 4-D tensor seen as a matrix: element (r, c)
// is ptr[r * rs + c * cs].
template <typename scalar_t>
struct Mat {
  const scalar_t* ptr;
  int64_t rs, cs;
};

template <typename scalar_t>
__device__ __forceinline__ Mat<scalar_t> slice(const void* base, const int64_t (&stride)[4], int64_t b, int64_t h) {
  return {static_cast<const scalar_t*>(base) + b * stride[0] + h * stride[1], stride[2], stride[3]};
}

// ---------------------------------------------------------------------------
// Block-wide building blocks
// ---------------------------------------------------------------------------

// dst[r * ld + c] = src(r0 + r, c0 + c) for r < rows_valid, c < cols_valid,
// 0 elsewhere in the ROWS x COLS tile. Consecutive threads take consecutive
// columns (coalesced when src's columns are contiguous).
template <int ROWS, int COLS, int THREADS, typename T, typename scalar_t>
__device__ __forceinline__ void load_tile(T* dst, int ld, Mat<scalar_t> src, int64_t r0, int64_t c0,
                                          int64_t rows_valid, int64_t cols_valid) {
  for (int idx = threadIdx.x; idx < ROWS * COLS; idx += THREADS) {
    const int r = idx / COLS, c = idx % COLS;
    T x = T(0);
    if (r < rows_valid && c < cols_valid) x = to_acc(src.ptr[(r0 + r) * src.rs + (c0 + c) * src.cs]);
    dst[r * ld + c] = x;
  }
}

// acc[a][c] += sum_{k < K} A(row(a), k) * B(k, col(c)) on shared-memory
// operands A(r, k) = a[r * a_r + k * a_k] and B(k, c) = b[k * b_k + c * b_c],
// with row(a) = ty + TY * a and col(c) = QUAD ? NC * tx + c : tx + TX * c.
template <int TY, int TX, bool QUAD, int K, int NR, int NC, typename T>
__device__ __forceinline__ void smem_gemm(T (&acc)[NR][NC], const T* a, int a_r, int a_k, const T* b, int b_k,
                                          int b_c, int ty, int tx) {
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    T av[NR], bv[NC];
#pragma unroll
    for (int r = 0; r < NR; ++r) av[r] = a[(ty + TY * r) * a_r + k * a_k];
#pragma unroll
    for (int c = 0; c < NC; ++c) bv[c] = b[k * b_k + (QUAD ? NC * tx + c : tx + TX * c) * b_c];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[r][c] = fma(av[r], bv[c], acc[r][c]);
  }
}

// Max / sum over the kTx lanes that hold one row of a score tile. The xor
// butterfly leaves the same value (bit for bit) in every lane of the group.
template <int WIDTH, typename T>
__device__ __forceinline__ T group_max(T v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <int WIDTH, typename T>
__device__ __forceinline__ T group_sum(T v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// The staging buffers of the Q K^T / dO V^T products (+1: no bank conflicts).
template <typename T>
struct ProductSmem {
  T x[GenericTiles<T>::kBlockM][GenericTiles<T>::kChunkD + 1];  // rows of Q (or dO), one head-dim chunk
  T y[GenericTiles<T>::kBlockN][GenericTiles<T>::kChunkD + 1];  // rows of K (or V), one head-dim chunk
};

// acc = X[i0 : i0 + kBlockM] . Y[j0 : j0 + kBlockN]^T over D columns, in the
// score tile layout; rows/keys past m_valid/n_valid give 0.
//   X: (L, D) rows of query (or dO) of one (b, h); Y: (S, D) rows of key (or value).
template <typename T, typename scalar_t>
__device__ __forceinline__ void product_tile(T (&acc)[GenericTiles<T>::kRows][4], ProductSmem<T>& sm, Mat<scalar_t> x,
                                             int64_t i0, int64_t m_valid, Mat<scalar_t> y, int64_t j0,
                                             int64_t n_valid, int64_t D, int ty, int tx) {
  using C = GenericTiles<T>;
#pragma unroll
  for (int r = 0; r < C::kRows; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = T(0);
  for (int64_t d0 = 0; d0 < D; d0 += C::kChunkD) {
    const int64_t dn = D - d0;
    __syncthreads();  // the previous chunk (or the caller's last use) is done with sm
    load_tile<C::kBlockM, C::kChunkD, C::kThreads>(&sm.x[0][0], C::kChunkD + 1, x, i0, d0, m_valid, dn);
    load_tile<C::kBlockN, C::kChunkD, C::kThreads>(&sm.y[0][0], C::kChunkD + 1, y, j0, d0, n_valid, dn);
    __syncthreads();
    smem_gemm<C::kTy, C::kTx, true, C::kChunkD>(acc, &sm.x[0][0], C::kChunkD + 1, 1, &sm.y[0][0], 1,
                                                C::kChunkD + 1, ty, tx);
  }
}

// One raw dot product -> its score, in DESIGN.md's order: s * scale, then the
// softcap (cap * tanh(s / cap); t keeps the tanh for the backward), minus the
// ALiBi bias slope * |pos - j|, plus the additive mask; -inf where the bool
// mask says no and outside `keys`, row i's visible keys (causal bound, window,
// the keys that exist). mask_row: the mask's offset of row (b, h, i).
template <typename T, typename scalar_t>
__device__ __forceinline__ T score_at(const AttnParams& p, T raw, T& t, int64_t i, int64_t j, T slope,
                                      const KeyRange& keys, int64_t mask_row) {
  T x = raw * static_cast<T>(p.scale);
  t = T(0);
  if (p.softcap > 0.0) {
    t = acc_tanh(x * static_cast<T>(1.0 / p.softcap));
    x = static_cast<T>(p.softcap) * t;
  }
  if (p.alibi != nullptr) x -= slope * abs(static_cast<T>(i + p.causal_offset - j));
  if (j < keys.begin || j >= keys.end) return neg_inf<T>();
  if (p.mask_kind == MaskKind::Additive) return x + to_acc(static_cast<const scalar_t*>(p.mask)[mask_row + j * p.mask_stride[3]]);
  if (p.mask_kind == MaskKind::Bool && !static_cast<const bool*>(p.mask)[mask_row + j * p.mask_stride[3]])
    return neg_inf<T>();
  return x;
}

// The ALiBi slope of query head h of batch entry b (0 without ALiBi).
template <typename T>
__device__ __forceinline__ T alibi_slope(const AttnParams& p, int64_t b, int64_t h) {
  return p.alibi != nullptr ? static_cast<T>(p.alibi[b * p.alibi_stride_b + h]) : T(0);
}

// The score tile's raw dot products -> scores (score_at). Rows past L see no key.
template <typename T, typename scalar_t>
__device__ __forceinline__ void mask_scores(T (&s)[GenericTiles<T>::kRows][4], T (&t)[GenericTiles<T>::kRows][4],
                                            const AttnParams& p, int64_t b, int64_t h, int64_t i0, int64_t j0, int ty,
                                            int tx) {
  using C = GenericTiles<T>;
  const T slope = alibi_slope<T>(p, b, h);
#pragma unroll
  for (int r = 0; r < C::kRows; ++r) {
    const int64_t i = i0 + ty + C::kTy * r;
    const KeyRange keys = i < p.L ? visible_key_range(p, i) : KeyRange{0, 0};
    const int64_t mask_row = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2];
#pragma unroll
    for (int c = 0; c < 4; ++c) s[r][c] = score_at<T, scalar_t>(p, s[r][c], t[r][c], i, j0 + 4 * tx + c, slope, keys, mask_row);
  }
}

// The keys [begin, end) that some row of the query tile [i0, i0 + kBlockM) of
// `p` sees (causal bound, window), begin rounded down to a key tile. Key tiles
// outside are never visited.
template <typename T>
__device__ __forceinline__ KeyRange tile_key_range(const AttnParams& p, int64_t i0) {
  using C = GenericTiles<T>;
  const int64_t begin = visible_key_range(p, i0).begin;
  const int64_t end = visible_key_range(p, std::min<int64_t>(i0 + C::kBlockM, p.L) - 1).end;
  return KeyRange{begin / C::kBlockN * C::kBlockN, end};
}

// The parameters of the task's sequence: `p` itself for a dense batch, else
// sequence b of the packed batch as a dense batch of one (attention_math.h).
template <typename scalar_t, typename Params>
__device__ __forceinline__ Params view_of(const Params& p, int64_t b) {
  return p.cu_q == nullptr ? p : sequence_view<scalar_t>(p, b);
}

// The dropout decisions of keys j .. j + 3 (j % 4 == 0: one Philox block) in
// query row (b, h, i): bit c set = key j + c kept. attention_math.h defines
// which random number each element uses.
__device__ __forceinline__ unsigned keep_bits(const AttnParams& p, uint64_t seed, uint32_t threshold, int64_t b,
                                              int64_t h, int64_t i, int64_t j) {
  DropoutRowStream rng(seed, dropout_row(p, b, h, i), j);
  unsigned bits = 0;
#pragma unroll
  for (int c = 0; c < 4; ++c) bits |= (rng.next() >= threshold ? 1u : 0u) << c;
  return bits;
}

// The dropout of one call (attention_math.h's rule); the seed comes from device memory.
template <typename T>
struct Dropout : DropoutRule<T> {
  uint64_t seed;
  __device__ explicit Dropout(const AttnParams& p)
      : DropoutRule<T>(p), seed(p.dropout_p > 0.0 ? static_cast<uint64_t>(*p.seed_ptr) : 0) {}
};

// ---------------------------------------------------------------------------
// Forward (out and lse), or the explicit probabilities when params.probs is set.
// ---------------------------------------------------------------------------
template <typename T>
struct ForwardSmem {
  ProductSmem<T> prod;
  T p[GenericTiles<T>::kBlockM][GenericTiles<T>::kBlockN + 1];       // probabilities of the current key tile
  T v[GenericTiles<T>::kChunkD][GenericTiles<T>::kChunkOut];         // V rows (kChunkD keys) x one output chunk
};

// kSplit: the split-KV instance (its own kernel: clamping the key range costs
// the unsplit kernel 140 more bytes of register spills, ptxas -v). The split
// grid is sized for two blocks per SM, so that instance may take 255 registers.
template <typename scalar_t, bool kSplit>
__global__ void __launch_bounds__(GenericTiles<acc_t<scalar_t>>::kThreads,
                                  kSplit ? 2 : GenericTiles<acc_t<scalar_t>>::kMinBlocks)
    forward_kernel(const __grid_constant__ AttnParams params, const __grid_constant__ SplitKV split) {
  using T = acc_t<scalar_t>;
  using C = GenericTiles<T>;
  constexpr int R = C::kRows, NC = C::kOutCols;
  __shared__ ForwardSmem<T> sm;

  const int tx = threadIdx.x % C::kTx, ty = threadIdx.x / C::kTx;
  const bool write_probs = params.probs != nullptr;
  const Dropout<T> drop(params);
  const int64_t group = params.Hq / params.Hkv;
  const int64_t n_qtiles = ceil_div(params.L, C::kBlockM);  // the longest sequence's when packed
  const int64_t n_chunks = write_probs ? 1 : std::max<int64_t>(1, ceil_div(params.Ev, C::kChunkOut));
  const int64_t n_tasks = params.B * params.Hq * n_qtiles * n_chunks;
  const int64_t sp = kSplit ? blockIdx.y : 0;  // the split's key range (gridDim.y == split.n_splits)

  for (int64_t task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int64_t chunk = task % n_chunks;
    const int64_t qt = (task / n_chunks) % n_qtiles;
    const int64_t h = (task / (n_chunks * n_qtiles)) % params.Hq;
    const int64_t b = task / (n_chunks * n_qtiles * params.Hq);
    const AttnParams p = view_of<scalar_t>(params, b);
    const int64_t hk = h / group;
    const int64_t i0 = qt * C::kBlockM, c0 = chunk * C::kChunkOut;
    if (i0 >= p.L) continue;  // a shorter sequence of a packed batch
    KeyRange kv = tile_key_range<T>(p, i0);
    if constexpr (kSplit) {  // this split's keys: whole key tiles, so kv.begin stays on a tile
      kv.begin = std::max(kv.begin, sp * split.keys_per_split);
      kv.end = std::min(kv.end, (sp + 1) * split.keys_per_split);
    }
    const Mat<scalar_t> q = slice<scalar_t>(p.q, p.q_stride, b, h);
    const Mat<scalar_t> k = slice<scalar_t>(p.k, p.k_stride, b, hk);

    T row_m[R], row_l[R], o[R][NC];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      row_m[r] = neg_inf<T>();
      row_l[r] = T(0);
#pragma unroll
      for (int c = 0; c < NC; ++c) o[r][c] = T(0);
    }

    for (int64_t j0 = kv.begin; j0 < kv.end; j0 += C::kBlockN) {
      T s[R][4], unused_tanh[R][4];
      product_tile(s, sm.prod, q, i0, p.L - i0, k, j0, p.S - j0, p.E, ty, tx);
      mask_scores<T, scalar_t>(s, unused_tanh, p, b, h, i0, j0, ty, tx);

      // Online softmax: s becomes exp(s - m_new); O and l are rescaled.
#pragma unroll
      for (int r = 0; r < R; ++r) {
        T tile_max = max(max(s[r][0], s[r][1]), max(s[r][2], s[r][3]));
        tile_max = group_max<C::kTx>(tile_max);
        const T m_new = max(row_m[r], tile_max);
        T correction = T(1), sum = T(0);
        if (m_new == neg_inf<T>()) {  // no visible key in this row yet, or NaN scores only
          bool nan = false;
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            nan = nan || isnan(s[r][c]);
            s[r][c] = T(0);
          }
          if (nan) sum = std::numeric_limits<T>::quiet_NaN();  // the NaN reaches l, lse and the output
        } else {
          correction = acc_exp(row_m[r] - m_new);  // 0 while row_m is -inf
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            s[r][c] = acc_exp(s[r][c] - m_new);  // -inf scores give 0
            sum += s[r][c];
          }
        }
        sum = group_sum<C::kTx>(sum);
        row_l[r] = row_l[r] * correction + sum;
        row_m[r] = m_new;
#pragma unroll
        for (int c = 0; c < NC; ++c) o[r][c] *= correction;
      }
      if (write_probs) continue;  // pass 1 of the probabilities: the lse only

      // Dropout zeroes probabilities after they entered the row sum l.
      __syncthreads();  // the previous tile's P V is done with sm.p
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + ty + C::kTy * r;
        unsigned keep = 0xfu;
        if (drop.on && i < p.L && j0 + 4 * tx < p.S) keep = keep_bits(p, drop.seed, drop.threshold, b, h, i, j0 + 4 * tx);
#pragma unroll
        for (int c = 0; c < 4; ++c) sm.p[ty + C::kTy * r][4 * tx + c] = (keep >> c) & 1u ? s[r][c] : T(0);
      }

      // O += P V, kChunkD keys at a time. The tile's product is summed apart
      // and then added to O: one rounding of O per key tile, not one per key
      // (summing thousands of keys into O one by one loses ~sqrt(S) ulps).
      const Mat<scalar_t> v = slice<scalar_t>(p.v, p.v_stride, b, hk);
      T pv[R][NC];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) pv[r][c] = T(0);
      for (int kk = 0; kk < C::kBlockN; kk += C::kChunkD) {
        __syncthreads();
        load_tile<C::kChunkD, C::kChunkOut, C::kThreads>(&sm.v[0][0], C::kChunkOut, v, j0 + kk, c0,
                                                         p.S - j0 - kk, p.Ev - c0);
        __syncthreads();
        smem_gemm<C::kTy, C::kTx, false, C::kChunkD>(pv, &sm.p[0][kk], C::kBlockN + 1, 1, &sm.v[0][0],
                                                     C::kChunkOut, 1, ty, tx);
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < NC; ++c) o[r][c] += pv[r][c];
    }

    if constexpr (kSplit) {  // the split's rows, for split_kv_merge_kernel
      const int64_t n_rows = p.B * p.Hq * p.L;
      T* ml = static_cast<T*>(split.ml_part);
      T* o_part = static_cast<T*>(split.o_part);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + ty + C::kTy * r;
        if (i >= p.L) continue;
        const int64_t row = sp * n_rows + (b * p.Hq + h) * p.L + i;
        if (chunk == 0 && tx == 0) {
          ml[2 * row] = row_m[r];
          ml[2 * row + 1] = row_l[r];
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int64_t col = c0 + tx + C::kTx * c;
          if (col < p.Ev) o_part[row * p.Ev + col] = o[r][c];
        }
      }
      continue;
    }

    // The row's lse (natural log), the sink's logit joining the sum. l == 0
    // only when the row saw no key and there is no sink: output 0, lse -inf.
    // A NaN score makes l NaN: output and lse NaN, as in PyTorch. o_mul turns
    // the row's O (relative to row_m) into the output.
    T* lse = static_cast<T*>(p.lse);
    const T* sink = p.sinks != nullptr ? static_cast<const T*>(p.sinks) + h : nullptr;
    T row_lse[R], o_mul[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + ty + C::kTy * r;
      T mx = row_m[r], l = row_l[r];
      if (sink != nullptr && !isnan(l)) {
        const T m_new = max(mx, *sink);
        if (m_new != neg_inf<T>()) {
          l = (l > T(0) ? l * acc_exp(mx - m_new) : T(0)) + acc_exp(*sink - m_new);
          mx = m_new;
        }
      }
      row_lse[r] = l > T(0) ? mx + acc_log(l) : (isnan(l) ? l : neg_inf<T>());
      o_mul[r] = row_l[r] > T(0) ? drop.keep_scale * acc_exp(row_m[r] - mx) / l : (isnan(l) ? l : T(0));
      if (i < p.L && chunk == 0 && tx == 0) lse[lse_index(p, b, h, i)] = row_lse[r];
    }
    if (!write_probs) {
      scalar_t* out = static_cast<scalar_t*>(p.out) + b * p.o_stride[0] + h * p.o_stride[1];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + ty + C::kTy * r;
        if (i >= p.L) continue;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int64_t col = c0 + tx + C::kTx * c;
          if (col < p.Ev) out[i * p.o_stride[2] + col * p.o_stride[3]] = from_acc<scalar_t>(o[r][c] * o_mul[r]);
        }
      }
      continue;
    }

    // Pass 2 of the probabilities: P = exp(S - lse), dropped, over all S keys
    // (0 outside the visible ones).
    scalar_t* probs = static_cast<scalar_t*>(p.probs) + b * p.probs_stride[0] + h * p.probs_stride[1];
    for (int64_t j0 = 0; j0 < p.S; j0 += C::kBlockN) {
      T s[R][4], unused_tanh[R][4];
      if (j0 >= kv.begin && j0 < kv.end) {
        product_tile(s, sm.prod, q, i0, p.L - i0, k, j0, p.S - j0, p.E, ty, tx);
        mask_scores<T, scalar_t>(s, unused_tanh, p, b, h, i0, j0, ty, tx);
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int c = 0; c < 4; ++c) s[r][c] = neg_inf<T>();
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int64_t i = i0 + ty + C::kTy * r;
        const int64_t j = j0 + 4 * tx;
        if (i >= p.L || j >= p.S) continue;
        unsigned keep = 0xfu;
        if (drop.on) keep = keep_bits(p, drop.seed, drop.threshold, b, h, i, j);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          if (j + c >= p.S) break;
          T prob = row_lse[r] == neg_inf<T>() ? T(0) : acc_exp(s[r][c] - row_lse[r]);
          prob = (keep >> c) & 1u ? prob * drop.keep_scale : T(0);
          probs[i * p.probs_stride[2] + (j + c) * p.probs_stride[3]] = from_acc<scalar_t>(prob);
        }
      }
    }
  }
}

// Split-KV's second step: one warp per row joins the splits' partial rows,
// each weighted by exp(m_s - m), into l, lse and out, with the sink as in
// forward_kernel. A split whose rows saw no key (l_s == 0) adds nothing; a
// NaN in any split's sum makes the row's output and lse NaN, as unsplit.
template <typename scalar_t>
__global__ void __launch_bounds__(GenericTiles<acc_t<scalar_t>>::kThreads)
    split_kv_merge_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ SplitKV split) {
  using T = acc_t<scalar_t>;
  constexpr int kWarps = GenericTiles<T>::kThreads / 32;
  const int lane = threadIdx.x % 32;
  const int64_t n_rows = p.B * p.Hq * p.L;
  const T* ml = static_cast<const T*>(split.ml_part);
  const T* o_part = static_cast<const T*>(split.o_part);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < n_rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i = row % p.L, h = (row / p.L) % p.Hq, b = row / (p.L * p.Hq);
    T m = neg_inf<T>(), l = T(0);
    bool nan = false;
    for (int64_t s = 0; s < split.n_splits; ++s) {
      const T l_s = ml[2 * (s * n_rows + row) + 1];
      nan = nan || isnan(l_s);
      if (l_s > T(0)) m = max(m, ml[2 * (s * n_rows + row)]);
    }
    for (int64_t s = 0; s < split.n_splits; ++s) {
      const T l_s = ml[2 * (s * n_rows + row) + 1];
      if (l_s > T(0)) l += l_s * acc_exp(ml[2 * (s * n_rows + row)] - m);
    }
    if (nan) l = std::numeric_limits<T>::quiet_NaN();
    const T keys_l = l;  // the sum over the keys, without the sink
    T mx = m;
    if (p.sinks != nullptr && !nan) {
      const T sink = static_cast<const T*>(p.sinks)[h];
      const T m_new = max(mx, sink);
      if (m_new != neg_inf<T>()) {
        l = (l > T(0) ? l * acc_exp(mx - m_new) : T(0)) + acc_exp(sink - m_new);
        mx = m_new;
      }
    }
    if (lane == 0)
      static_cast<T*>(p.lse)[lse_index(p, b, h, i)] = l > T(0) ? mx + acc_log(l) : (isnan(l) ? l : neg_inf<T>());
    scalar_t* out = static_cast<scalar_t*>(p.out) + b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
    for (int64_t e = lane; e < p.Ev; e += 32) {
      T acc = T(0);
      for (int64_t s = 0; s < split.n_splits; ++s) {
        const int64_t at = s * n_rows + row;
        if (ml[2 * at + 1] > T(0)) acc += o_part[at * p.Ev + e] * acc_exp(ml[2 * at] - mx);
      }
      out[e * p.o_stride[3]] = from_acc<scalar_t>(keys_l > T(0) ? acc / l : (nan ? l : T(0)));
    }
  }
}

// ---------------------------------------------------------------------------
// Decode: split-KV for calls with a few query rows per key/value head (a
// decoding step; kernels.h: SplitKV::decode). The tile kernel above would
// spend a 32-row tile on each of them; here one block per (b, kv head, key
// range) takes the group's query heads x the L rows together (at most
// kDecodeRows), so each K and V row is read once for all of them.
//   Scores: each warp takes key tiles of 32, lane l key j0 + l: its K row is
//   read 16 bytes at a time (the head dim contiguous), the rows' Q broadcast
//   from shared memory; the online softmax then runs across the lanes.
//   P V: the lanes take the value columns lane + 32 c, each key's p reaches
//   them by a shuffle; a tile's products are summed apart, then added to O
//   (one rounding of O per tile, as in forward_kernel).
//   The four warps' (m, l, O) are joined through shared memory into the key
//   range's partial rows, which split_kv_merge_kernel joins into out and lse.
// ---------------------------------------------------------------------------
constexpr int kDecodeRows = 8, kDecodeWarps = 4, kDecodeMaxDim = 256;

struct DecodeSmem {
  float q[kDecodeRows][kDecodeMaxDim];                 // the rows' queries, float
  float m[kDecodeWarps][kDecodeRows], l[kDecodeWarps][kDecodeRows];
  float o[kDecodeWarps][kDecodeRows][kDecodeMaxDim];  // each warp's O rows, relative to its m
};

// 16 bytes of a contiguous row (16-byte aligned) as floats.
template <typename scalar_t>
__device__ __forceinline__ void load16(const scalar_t* ptr, float (&out)[16 / sizeof(scalar_t)]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(ptr));
  const scalar_t* e = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
  for (int t = 0; t < static_cast<int>(16 / sizeof(scalar_t)); ++t) out[t] = to_acc(e[t]);
}

// kCols: value columns per lane (Ev <= 32 kCols).
template <typename scalar_t, int kCols>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ SplitKV split) {
  static_assert(std::is_same_v<acc_t<scalar_t>, float>, "the decode kernel computes in float");
  constexpr int kVec = 16 / sizeof(scalar_t);  // K elements per load
  constexpr int R = kDecodeRows;
  __shared__ DecodeSmem sm;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t group = p.Hq / p.Hkv;
  const int rows = static_cast<int>(group * p.L);  // row r: query head hk * group + r / L, row r % L
  const int64_t n_rows = p.B * p.Hq * p.L, sp = blockIdx.y;
  const int64_t split_begin = sp * split.keys_per_split, split_end = std::min(p.S, split_begin + split.keys_per_split);

  for (int64_t task = blockIdx.x; task < p.B * p.Hkv; task += gridDim.x) {
    const int64_t b = task / p.Hkv, hk = task % p.Hkv;
    __syncthreads();  // the previous task is done with sm
    for (int idx = threadIdx.x; idx < rows * p.E; idx += kDecodeWarps * 32) {
      const int r = idx / static_cast<int>(p.E), d = idx % static_cast<int>(p.E);
      const int64_t h = hk * group + r / p.L, i = r % p.L;
      sm.q[r][d] = to_acc(static_cast<const scalar_t*>(p.q)[b * p.q_stride[0] + h * p.q_stride[1] +
                                                            i * p.q_stride[2] + d * p.q_stride[3]]);
    }
    __syncthreads();

    // The keys some row sees (both ends grow with the row), within this range.
    const int64_t lo = std::max(split_begin, visible_key_range(p, 0).begin);
    const int64_t hi = std::min(split_end, visible_key_range(p, p.L - 1).end);
    const scalar_t* k = static_cast<const scalar_t*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
    const scalar_t* v = static_cast<const scalar_t*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];

    float m[R], l[R], o[R][kCols];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      m[r] = neg_inf<float>();
      l[r] = 0.0f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[r][c] = 0.0f;
    }

    for (int64_t j0 = lo + 32 * warp; j0 < hi; j0 += 32 * kDecodeWarps) {
      const int64_t j = j0 + lane;
      float s[R];
#pragma unroll
      for (int r = 0; r < R; ++r) s[r] = 0.0f;
      if (j < hi) {
        const scalar_t* key = k + j * p.k_stride[2];
        for (int d0 = 0; d0 < p.E; d0 += kVec) {
          float kv[kVec];
          load16(key + d0, kv);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            if (r >= rows) break;
#pragma unroll
            for (int t = 0; t < kVec; ++t) s[r] = fmaf(sm.q[r][d0 + t], kv[t], s[r]);
          }
        }
      }

      // Scores and the online softmax of each row: s becomes the lane's key's p.
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const int64_t h = hk * group + r / p.L, i = r % p.L;
        float unused_tanh;
        const int64_t mask_row = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2];
        const float x = j < hi ? score_at<float, scalar_t>(p, s[r], unused_tanh, i, j, alibi_slope<float>(p, b, h),
                                                           visible_key_range(p, i), mask_row)
                               : neg_inf<float>();
        const float m_new = max(m[r], group_max<32>(x));
        float correction = 1.0f, sum;
        if (m_new == neg_inf<float>()) {  // no visible key in this row yet, or NaN scores only
          s[r] = 0.0f;
          sum = __any_sync(0xffffffffu, isnan(x)) ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
        } else {
          correction = acc_exp(m[r] - m_new);  // 0 while m is -inf
          s[r] = acc_exp(x - m_new);           // -inf scores give 0
          sum = group_sum<32>(s[r]);
        }
        l[r] = l[r] * correction + sum;
        m[r] = m_new;
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[r][c] *= correction;
      }

      // O += P V over the tile's keys, summed apart first.
      float pv[R][kCols];
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) pv[r][c] = 0.0f;
      const int n_keys = static_cast<int>(std::min<int64_t>(32, hi - j0));
#pragma unroll 4
      for (int kk = 0; kk < n_keys; ++kk) {
        const scalar_t* value = v + (j0 + kk) * p.v_stride[2];
        float vv[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int64_t col = lane + 32 * c;
          vv[c] = col < p.Ev ? to_acc(value[col * p.v_stride[3]]) : 0.0f;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          if (r >= rows) break;
          const float pk = __shfl_sync(0xffffffffu, s[r], kk);
#pragma unroll
          for (int c = 0; c < kCols; ++c) pv[r][c] = fmaf(pk, vv[c], pv[r][c]);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < kCols; ++c) o[r][c] += pv[r][c];
    }

    // Join the warps: each row's m is the largest of the warps that saw a key.
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      if (lane == 0) {
        sm.m[warp][r] = m[r];
        sm.l[warp][r] = l[r];
      }
#pragma unroll
      for (int c = 0; c < kCols; ++c)
        if (lane + 32 * c < p.Ev) sm.o[warp][r][lane + 32 * c] = o[r][c];
    }
    __syncthreads();
    float* ml = static_cast<float*>(split.ml_part);
    float* o_part = static_cast<float*>(split.o_part);
    const int64_t cols = std::max<int64_t>(p.Ev, 1);  // one thread per row writes m, l even when Ev == 0
    for (int64_t idx = threadIdx.x; idx < rows * cols; idx += kDecodeWarps * 32) {
      const int r = static_cast<int>(idx / cols), col = static_cast<int>(idx % cols);
      float mx = neg_inf<float>(), sum = 0.0f, acc = 0.0f;
      bool nan = false;
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        nan = nan || isnan(sm.l[w][r]);
        if (sm.l[w][r] > 0.0f) mx = max(mx, sm.m[w][r]);
      }
#pragma unroll
      for (int w = 0; w < kDecodeWarps; ++w) {
        if (sm.l[w][r] > 0.0f) {
          const float f = acc_exp(sm.m[w][r] - mx);
          sum += sm.l[w][r] * f;
          if (col < p.Ev) acc += sm.o[w][r][col] * f;
        }
      }
      const int64_t h = hk * group + r / p.L, i = r % p.L;
      const int64_t row = sp * n_rows + (b * p.Hq + h) * p.L + i;
      if (col == 0) {
        ml[2 * row] = mx;
        ml[2 * row + 1] = nan ? std::numeric_limits<float>::quiet_NaN() : sum;
      }
      if (col < p.Ev) o_part[row * p.Ev + col] = acc;
    }
  }
}

// ---------------------------------------------------------------------------
// Backward
//   delta_i = rowsum(dO * O) - dlse_i  (rowsum(dprobs * probs) - dlse_i for the probabilities)
//   P = exp(S - lse), Z = P * keep / (1 - p), dP = (dO V^T or dprobs) * keep / (1 - p)
//   dS = P * (dP - delta);  dV = Z^T dO, dK = scale dS^T Q, dQ = scale dS K, dmask += dS
// ---------------------------------------------------------------------------

// (1) delta, one warp per (b, h, i) row (i below the longest sequence's
// length when packed; the rows past a sequence's own length have no delta).
template <typename scalar_t>
__global__ void __launch_bounds__(GenericTiles<acc_t<scalar_t>>::kThreads)
    backward_delta_kernel(const __grid_constant__ AttnBwdParams params, BwdWorkspace ws) {
  using T = acc_t<scalar_t>;
  constexpr int kWarps = GenericTiles<T>::kThreads / 32;
  const int lane = threadIdx.x % 32;
  const bool from_probs = params.dprobs != nullptr;
  const int64_t n_rows = params.B * params.Hq * params.L;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; row < n_rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t i = row % params.L, h = (row / params.L) % params.Hq, b = row / (params.L * params.Hq);
    const AttnBwdParams p = view_of<scalar_t>(params, b);
    if (i >= p.L) continue;
    T d = T(0);
    if (from_probs) {
      const Mat<scalar_t> z = slice<scalar_t>(p.probs, p.probs_stride, b, h);
      const Mat<scalar_t> dz = slice<scalar_t>(p.dprobs, p.dprobs_stride, b, h);
      for (int64_t j = lane; j < p.S; j += 32) d += to_acc(z.ptr[i * z.rs + j * z.cs]) * to_acc(dz.ptr[i * dz.rs + j * dz.cs]);
    } else {
      const Mat<scalar_t> o = slice<scalar_t>(p.out, p.o_stride, b, h);
      const Mat<scalar_t> dout = slice<scalar_t>(p.dout, p.do_stride, b, h);
      for (int64_t e = lane; e < p.Ev; e += 32) d += to_acc(o.ptr[i * o.rs + e * o.cs]) * to_acc(dout.ptr[i * dout.rs + e * dout.cs]);
    }
    d = group_sum<32>(d);
    if (lane == 0) {
      const int64_t at = lse_index(p, b, h, i);
      if (p.dlse != nullptr) d -= static_cast<const T*>(p.dlse)[at];
      static_cast<T*>(ws.delta)[at] = d;
    }
  }
}

// (1b) The sinks' gradient: dsinks[b, h] = -sum_i exp(sink_h - lse_i) delta_i
// over the rows of (b, h) that saw something (the sink is a key whose value
// is 0). One block per (b, h), summed in a fixed order (deterministic).
template <typename scalar_t>
__global__ void __launch_bounds__(GenericTiles<acc_t<scalar_t>>::kThreads)
    backward_sinks_kernel(const __grid_constant__ AttnBwdParams params, BwdWorkspace ws) {
  using T = acc_t<scalar_t>;
  constexpr int kThreads = GenericTiles<T>::kThreads, kWarps = kThreads / 32;
  __shared__ T warp_sums[kWarps];
  for (int64_t bh = blockIdx.x; bh < params.B * params.Hq; bh += gridDim.x) {
    const int64_t b = bh / params.Hq, h = bh % params.Hq;
    const AttnBwdParams p = view_of<scalar_t>(params, b);
    const T sink = static_cast<const T*>(p.sinks)[h];
    const T* lse = static_cast<const T*>(p.lse);
    const T* delta = static_cast<const T*>(ws.delta);
    T sum = T(0);
    for (int64_t i = threadIdx.x; i < p.L; i += kThreads) {
      const int64_t at = lse_index(p, b, h, i);
      if (lse[at] != neg_inf<T>()) sum -= acc_exp(sink - lse[at]) * delta[at];
    }
    sum = group_sum<32>(sum);
    __syncthreads();  // the previous (b, h) is done with warp_sums
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      T total = T(0);
      for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
      static_cast<T*>(p.dsinks)[bh] = total;
    }
  }
}

// Z and dS of the (query tile i0, key tile j0) pair of head (b, h), in the
// score tile layout, given the rows' lse and delta (-inf / 0 past L). dS is
// the scores' gradient before the softcap: with add_dmask it is added to the
// mask's gradient here; what is returned has the softcap's derivative
// 1 - tanh^2 applied (the gradient of the dot products Q K^T * scale).
template <typename T, typename scalar_t>
__device__ __forceinline__ void backward_tile(const AttnBwdParams& p, const Dropout<T>& drop, ProductSmem<T>& sm,
                                              int64_t b, int64_t h, int64_t i0, int64_t j0,
                                              const T (&row_lse)[GenericTiles<T>::kRows],
                                              const T (&row_delta)[GenericTiles<T>::kRows], T (&z)[GenericTiles<T>::kRows][4],
                                              T (&ds)[GenericTiles<T>::kRows][4], bool add_dmask, int ty, int tx) {
  using C = GenericTiles<T>;
  constexpr int R = C::kRows;
  const int64_t hk = h / (p.Hq / p.Hkv);
  T s[R][4], dp[R][4], tanh_s[R][4];
  product_tile(s, sm, slice<scalar_t>(p.q, p.q_stride, b, h), i0, p.L - i0, slice<scalar_t>(p.k, p.k_stride, b, hk),
               j0, p.S - j0, p.E, ty, tx);
  mask_scores<T, scalar_t>(s, tanh_s, p, b, h, i0, j0, ty, tx);
  if (p.dprobs != nullptr) {  // the gradient of the explicit probabilities is given
    const Mat<scalar_t> dz = slice<scalar_t>(p.dprobs, p.dprobs_stride, b, h);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t i = i0 + ty + C::kTy * r;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t j = j0 + 4 * tx + c;
        dp[r][c] = i < p.L && j < p.S ? to_acc(dz.ptr[i * dz.rs + j * dz.cs]) : T(0);
      }
    }
  } else {  // dP = dO V^T
    product_tile(dp, sm, slice<scalar_t>(p.dout, p.do_stride, b, h), i0, p.L - i0,
                 slice<scalar_t>(p.v, p.v_stride, b, hk), j0, p.S - j0, p.Ev, ty, tx);
  }
  T* dmask = add_dmask ? static_cast<T*>(p.dmask) : nullptr;
  const bool softcap = p.softcap > 0.0;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + ty + C::kTy * r;
    unsigned keep = 0xfu;
    if (drop.on && i < p.L && j0 + 4 * tx < p.S) keep = keep_bits(p, drop.seed, drop.threshold, b, h, i, j0 + 4 * tx);
    T* dm = dmask != nullptr && i < p.L
                ? dmask + b * p.dmask_stride[0] + h * p.dmask_stride[1] + i * p.dmask_stride[2]
                : nullptr;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t j = j0 + 4 * tx + c;
      // A row with lse = -inf saw no key: no probability, no gradient.
      const T prob = row_lse[r] == neg_inf<T>() ? T(0) : acc_exp(s[r][c] - row_lse[r]);
      const bool kept = (keep >> c) & 1u;
      z[r][c] = kept ? prob * drop.keep_scale : T(0);
      const T dprob = kept ? dp[r][c] * drop.keep_scale : T(0);
      T g = prob == T(0) ? T(0) : prob * (dprob - row_delta[r]);
      if (dm != nullptr && j < p.S && g != T(0)) atomicAdd(dm + j * p.dmask_stride[3], g);
      if (softcap) g *= T(1) - tanh_s[r][c] * tanh_s[r][c];
      ds[r][c] = g;
    }
  }
}

// out[r * ld + c] += alpha * sum_{k < KDIM} A(r, k) X(x_r0 + k, c) for the
// ROWS rows of an owned (rows_valid, D) slice of a workspace accumulator (rows
// ld apart), kChunkOut columns at a time. A is a shared-memory tile
// (A(r, k) = a[r * a_r + k * a_k]); X rows come from global memory.
template <int ROWS, int KDIM, typename T, typename scalar_t>
__device__ __forceinline__ void accumulate_product(T* out, int64_t ld, int64_t rows_valid, int64_t D, T alpha,
                                                   const T* a, int a_r, int a_k, Mat<scalar_t> x, int64_t x_r0,
                                                   int64_t x_rows_valid, T* xs) {
  using C = GenericTiles<T>;
  constexpr int NR = ROWS / C::kOutTy, NC = C::kChunkOut / C::kOutTx;
  const int tx = threadIdx.x % C::kOutTx, ty = threadIdx.x / C::kOutTx;
  for (int64_t c0 = 0; c0 < D; c0 += C::kChunkOut) {
    __syncthreads();  // the previous chunk is done with xs
    load_tile<KDIM, C::kChunkOut, C::kThreads>(xs, C::kChunkOut, x, x_r0, c0, x_rows_valid, D - c0);
    __syncthreads();
    T acc[NR][NC];
#pragma unroll
    for (int r = 0; r < NR; ++r)
#pragma unroll
      for (int c = 0; c < NC; ++c) acc[r][c] = T(0);
    smem_gemm<C::kOutTy, C::kOutTx, false, KDIM>(acc, a, a_r, a_k, xs, C::kChunkOut, 1, ty, tx);
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const int64_t row = ty + C::kOutTy * r;
      if (row >= rows_valid) continue;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int64_t col = c0 + tx + C::kOutTx * c;
        if (col < D) out[row * ld + col] += alpha * acc[r][c];
      }
    }
  }
}

template <typename T>
struct BackwardSmem {
  ProductSmem<T> prod;
  T z[GenericTiles<T>::kBlockM][GenericTiles<T>::kBlockN + 1];   // Z of the current tile pair
  T ds[GenericTiles<T>::kBlockM][GenericTiles<T>::kBlockN + 1];  // dS of the current tile pair
  T x[std::max(GenericTiles<T>::kBlockM, GenericTiles<T>::kBlockN)][GenericTiles<T>::kChunkOut];  // Q / dO / K rows, one chunk
};

// Loads the lse and delta of the rows i0 + ty + kTy * r (-inf and 0 past L).
template <typename T>
__device__ __forceinline__ void load_row_stats(const AttnBwdParams& p, const BwdWorkspace& ws, int64_t b, int64_t h,
                                               int64_t i0, int ty, T (&row_lse)[GenericTiles<T>::kRows],
                                               T (&row_delta)[GenericTiles<T>::kRows]) {
  using C = GenericTiles<T>;
#pragma unroll
  for (int r = 0; r < C::kRows; ++r) {
    const int64_t i = i0 + ty + C::kTy * r;
    row_lse[r] = i < p.L ? static_cast<const T*>(p.lse)[lse_index(p, b, h, i)] : neg_inf<T>();
    row_delta[r] = i < p.L ? static_cast<const T*>(ws.delta)[lse_index(p, b, h, i)] : T(0);
  }
}

// Writes a score-layout tile into a (kBlockM, kBlockN + 1) shared-memory tile.
template <typename T>
__device__ __forceinline__ void store_score_tile(T (*dst)[GenericTiles<T>::kBlockN + 1], const T (&t)[GenericTiles<T>::kRows][4],
                                                 int ty, int tx) {
  using C = GenericTiles<T>;
#pragma unroll
  for (int r = 0; r < C::kRows; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) dst[ty + C::kTy * r][4 * tx + c] = t[r][c];
}

// (2) dK and dV: one block per (b, h, key tile), looping over the query tiles
// that see the keys (causal bound, window).
template <typename scalar_t>
__global__ void __launch_bounds__(GenericTiles<acc_t<scalar_t>>::kThreads, GenericTiles<acc_t<scalar_t>>::kMinBlocks)
    backward_dkdv_kernel(const __grid_constant__ AttnBwdParams params, BwdWorkspace ws) {
  using T = acc_t<scalar_t>;
  using C = GenericTiles<T>;
  constexpr int R = C::kRows;
  __shared__ BackwardSmem<T> sm;

  const int tx = threadIdx.x % C::kTx, ty = threadIdx.x / C::kTx;
  const bool from_probs = params.dprobs != nullptr;
  const Dropout<T> drop(params);
  const T scale = static_cast<T>(params.scale);
  const int64_t n_ktiles = ceil_div(params.S, C::kBlockN);  // the longest sequence's when packed
  const int64_t n_tasks = params.B * params.Hq * n_ktiles;
  const int64_t Hq = params.Hq;

  for (int64_t task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int64_t kt = task % n_ktiles;
    const int64_t h = (task / n_ktiles) % Hq;
    const int64_t b = task / (n_ktiles * Hq);
    const AttnBwdParams p = view_of<scalar_t>(params, b);
    const int64_t j0 = kt * C::kBlockN;
    if (j0 >= p.S) continue;  // a shorter sequence of a packed batch
    // This block owns rows [j0, j0 + kBlockN) of dk_accum / dv_accum for query
    // head h: (B, Hq, S, D) contiguous, or (total_k, Hq, D) when packed.
    const int64_t key_row = p.cu_k != nullptr ? (p.cu_k[b] + j0) * Hq + h : (b * Hq + h) * p.S + j0;
    const int64_t rows_apart = p.cu_k != nullptr ? Hq : 1;
    T* dk = static_cast<T*>(ws.dk_accum) + key_row * p.E;
    T* dv = from_probs ? nullptr : static_cast<T*>(ws.dv_accum) + key_row * p.Ev;
    const KeyRange rows = visible_row_range(p, j0, std::min<int64_t>(j0 + C::kBlockN, p.S));

    for (int64_t i0 = rows.begin / C::kBlockM * C::kBlockM; i0 < rows.end; i0 += C::kBlockM) {
      T row_lse[R], row_delta[R], z[R][4], ds[R][4];
      load_row_stats(p, ws, b, h, i0, ty, row_lse, row_delta);
      backward_tile<T, scalar_t>(p, drop, sm.prod, b, h, i0, j0, row_lse, row_delta, z, ds, false, ty, tx);
      __syncthreads();  // the previous query tile is done with sm.z / sm.ds
      store_score_tile(sm.z, z, ty, tx);
      store_score_tile(sm.ds, ds, ty, tx);
      // dV += Z^T dO ; dK += scale dS^T Q   (A(r = key, k = query) = tile[k][r])
      if (!from_probs)
        accumulate_product<C::kBlockN, C::kBlockM>(dv, rows_apart * p.Ev, p.S - j0, p.Ev, T(1), &sm.z[0][0], 1,
                                                   C::kBlockN + 1, slice<scalar_t>(p.dout, p.do_stride, b, h), i0,
                                                   p.L - i0, &sm.x[0][0]);
      accumulate_product<C::kBlockN, C::kBlockM>(dk, rows_apart * p.E, p.S - j0, p.E, scale, &sm.ds[0][0], 1,
                                                 C::kBlockN + 1, slice<scalar_t>(p.q, p.q_stride, b, h), i0,
                                                 p.L - i0, &sm.x[0][0]);
    }
  }
}

// (3) dQ and the mask's gradient: one block per (b, h, query tile), looping
// over the key tiles its rows see.
template <typename scalar_t>
__global__ void __launch_bounds__(GenericTiles<acc_t<scalar_t>>::kThreads, GenericTiles<acc_t<scalar_t>>::kMinBlocks)
    backward_dq_kernel(const __grid_constant__ AttnBwdParams params, BwdWorkspace ws) {
  using T = acc_t<scalar_t>;
  using C = GenericTiles<T>;
  constexpr int R = C::kRows;
  __shared__ BackwardSmem<T> sm;

  const int tx = threadIdx.x % C::kTx, ty = threadIdx.x / C::kTx;
  const Dropout<T> drop(params);
  const T scale = static_cast<T>(params.scale);
  const int64_t group = params.Hq / params.Hkv;
  const int64_t n_qtiles = ceil_div(params.L, C::kBlockM);
  const int64_t n_tasks = params.B * params.Hq * n_qtiles;

  for (int64_t task = blockIdx.x; task < n_tasks; task += gridDim.x) {
    const int64_t qt = task % n_qtiles;
    const int64_t h = (task / n_qtiles) % params.Hq;
    const int64_t b = task / (n_qtiles * params.Hq);
    const AttnBwdParams p = view_of<scalar_t>(params, b);
    const int64_t i0 = qt * C::kBlockM;
    if (i0 >= p.L) continue;
    const KeyRange kv = tile_key_range<T>(p, i0);
    // This block owns rows [i0, i0 + kBlockM) of dq_accum for head h, laid out as lse.
    T* dq = static_cast<T*>(ws.dq_accum) + lse_index(p, b, h, i0) * p.E;
    const int64_t dq_ld = p.lse_stride[2] * p.E;
    T row_lse[R], row_delta[R];
    load_row_stats(p, ws, b, h, i0, ty, row_lse, row_delta);

    for (int64_t j0 = kv.begin; j0 < kv.end; j0 += C::kBlockN) {
      T z[R][4], ds[R][4];
      backward_tile<T, scalar_t>(p, drop, sm.prod, b, h, i0, j0, row_lse, row_delta, z, ds, true, ty, tx);
      __syncthreads();  // the previous key tile is done with sm.ds
      store_score_tile(sm.ds, ds, ty, tx);
      // dQ += scale dS K   (A(r = query, k = key) = ds[r][k])
      accumulate_product<C::kBlockM, C::kBlockN>(dq, dq_ld, p.L - i0, p.E, scale, &sm.ds[0][0], C::kBlockN + 1, 1,
                                                 slice<scalar_t>(p.k, p.k_stride, b, h / group), j0, p.S - j0,
                                                 &sm.x[0][0]);
    }
  }
}

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float16: fn(__half{}); break;
    case DType::BFloat16: fn(__nv_bfloat16{}); break;
    case DType::Float32: fn(float{}); break;
    case DType::Float64: fn(double{}); break;
  }
}

// The forward's (b, h, query tile, chunk of Ev columns) tasks, for accumulation type T.
template <typename T>
int64_t forward_tasks(const AttnParams& p) {
  using C = GenericTiles<T>;
  const int64_t n_chunks = p.probs != nullptr ? 1 : std::max<int64_t>(1, ceil_div(p.Ev, C::kChunkOut));
  return p.B * p.Hq * ceil_div(p.L, C::kBlockM) * n_chunks;
}

template <typename scalar_t>
void launch_forward(const AttnParams& p, const SplitKV& split, cudaStream_t stream) {
  using C = GenericTiles<acc_t<scalar_t>>;
  const int64_t n_tasks = forward_tasks<acc_t<scalar_t>>(p);
  if constexpr (!std::is_same_v<scalar_t, double>) {  // split_kv_plan never splits float64
    const int64_t n_rows = p.B * p.Hq * p.L;
    if (split.decode) {
      const dim3 grid(task_grid(p.B * p.Hkv), static_cast<unsigned>(split.n_splits));
      if (p.Ev <= 64)
        decode_kernel<scalar_t, 2><<<grid, kDecodeWarps * 32, 0, stream>>>(p, split);
      else if (p.Ev <= 128)
        decode_kernel<scalar_t, 4><<<grid, kDecodeWarps * 32, 0, stream>>>(p, split);
      else
        decode_kernel<scalar_t, 8><<<grid, kDecodeWarps * 32, 0, stream>>>(p, split);
      split_kv_merge_kernel<scalar_t>
          <<<task_grid(ceil_div(n_rows, C::kThreads / 32)), C::kThreads, 0, stream>>>(p, split);
      return;
    }
    if (split.n_splits > 1) {
      const dim3 grid(task_grid(n_tasks), static_cast<unsigned>(split.n_splits));  // at most 128 splits
      forward_kernel<scalar_t, true><<<grid, C::kThreads, 0, stream>>>(p, split);
      split_kv_merge_kernel<scalar_t>
          <<<task_grid(ceil_div(n_rows, C::kThreads / 32)), C::kThreads, 0, stream>>>(p, split);
      return;
    }
  }
  forward_kernel<scalar_t, false><<<task_grid(n_tasks), C::kThreads, 0, stream>>>(p, split);
}

// The split's sizes for accumulation type T (its key tile): see kernels.h.
template <typename T>
SplitKV plan_split(const AttnParams& p, int num_sms) {
  using C = GenericTiles<T>;
  SplitKV split;
  const int64_t tasks = forward_tasks<T>(p);
  const int64_t min_keys = 4 * C::kBlockN;  // a split streams at least 4 key tiles
  // Split only when the tasks leave at least half the SMs idle; aim for two
  // blocks per SM, at most 128 splits.
  if (2 * tasks > num_sms || p.S < 2 * min_keys) return split;
  const int64_t n = std::min<int64_t>({ceil_div(2 * static_cast<int64_t>(num_sms), tasks), p.S / min_keys, 128});
  if (n < 2) return split;
  split.keys_per_split = ceil_div(ceil_div(p.S, n), C::kBlockN) * C::kBlockN;
  split.n_splits = ceil_div(p.S, split.keys_per_split);
  return split;
}

template <typename scalar_t>
void launch_backward(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  using C = GenericTiles<acc_t<scalar_t>>;
  const int64_t n_rows = p.B * p.Hq * p.L;
  backward_delta_kernel<scalar_t><<<task_grid(ceil_div(n_rows, C::kThreads / 32)), C::kThreads, 0, stream>>>(p, ws);
  if (p.sinks != nullptr && p.dsinks != nullptr)
    backward_sinks_kernel<scalar_t><<<task_grid(p.B * p.Hq), C::kThreads, 0, stream>>>(p, ws);
  if (p.S == 0) return;  // no key: every other gradient is 0 (the workspace is zeroed)
  backward_dkdv_kernel<scalar_t><<<task_grid(p.B * p.Hq * ceil_div(p.S, C::kBlockN)), C::kThreads, 0, stream>>>(p, ws);
  backward_dq_kernel<scalar_t><<<task_grid(p.B * p.Hq * ceil_div(p.L, C::kBlockM)), C::kThreads, 0, stream>>>(p, ws);
}

// Whether decode_kernel can run `p`: at most kDecodeRows rows per key/value
// head, head dims up to kDecodeMaxDim, and K rows it can read 16 bytes at a
// time (the head dim contiguous, every row and slice start 16-byte aligned).
bool decode_fits(const AttnParams& p) {
  const int64_t size = p.dtype == DType::Float32 ? 4 : 2, vec = 16 / size;
  const auto aligned = [&](int64_t elements) { return (elements * size) % 16 == 0; };
  return p.S > 0 && (p.Hq / p.Hkv) * p.L <= kDecodeRows && p.E <= kDecodeMaxDim && p.Ev <= kDecodeMaxDim &&
         p.E % vec == 0 && (p.E <= 1 || p.k_stride[3] == 1) && reinterpret_cast<uintptr_t>(p.k) % 16 == 0 &&
         aligned(p.k_stride[0]) && aligned(p.k_stride[1]) && aligned(p.k_stride[2]);
}

// decode_kernel's key ranges: about four blocks per SM, at least 256 keys (two
// tiles per warp) each, at most 128 ranges; whole 32-key tiles.
SplitKV plan_decode(const AttnParams& p, int num_sms) {
  SplitKV split;
  split.decode = true;
  const int64_t tasks = p.B * p.Hkv;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>({ceil_div(4 * static_cast<int64_t>(num_sms), tasks),
                                                            ceil_div(p.S, 256), 128}));
  split.keys_per_split = ceil_div(ceil_div(p.S, n), 32) * 32;
  split.n_splits = ceil_div(p.S, split.keys_per_split);
  return split;
}

}  // namespace

SplitKV split_kv_plan(const AttnParams& params, int num_sms) {
  // float64 (the gradcheck dtype) never splits: one instance of the kernels fewer.
  if (params.probs != nullptr || params.dropout_p > 0.0 || params.cu_q != nullptr || params.dtype == DType::Float64 ||
      params.B == 0 || params.Hq == 0 || params.L == 0)
    return SplitKV{};
  return decode_fits(params) ? plan_decode(params, num_sms) : plan_split<float>(params, num_sms);
}

void forward_generic(const AttnParams& params, cudaStream_t stream, const SplitKV& split) {
  if (params.B == 0 || params.Hq == 0 || params.L == 0) return;  // nothing to write
  dispatch_dtype(params.dtype, [&](auto tag) { launch_forward<decltype(tag)>(params, split, stream); });
}

void backward_generic(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  if (params.B == 0 || params.Hq == 0 || params.L == 0) return;  // the zeroed workspace is the answer
  dispatch_dtype(params.dtype, [&](auto tag) { launch_backward<decltype(tag)>(params, ws, stream); });
}

}  // namespace attn_ext::cuda
