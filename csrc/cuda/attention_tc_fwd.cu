// attn_ext: the tensor-core forward (FlashAttention-2 style, float16/bfloat16,
// sm_80+), and tensor_core_unsupported(), which says when these kernels apply.
//
// Method, fragment layouts and shared-memory layout: attention_tc.cuh.
#include <cstdio>

#include "attention_tc.cuh"

namespace attn_ext::cuda {
namespace tc {
namespace {

// One CTA: query rows [i0, i0 + kBlockM) of one (batch, query head); the key
// tiles that hold the keys its rows see (visible_key_range: all of them, the
// causal prefix, or a window's span), kBlockN keys each.
//
// Warp w, strip s (s < kStrips) owns the local rows s * 16 * kWarps + w * 16
// + [0, 16); its thread (g, t) holds rows r = base + g and base + g + 8 ("hi" =
// 0, 1) of that strip: score S[s][n][2 hi + e] is key j0 + 8 n + 2 t + e, and
// O[s][d][2 hi + e] is output column 8 d + 2 t + e.
template <typename T, int kHeadDim, bool kWindow>
__global__ void __launch_bounds__(FwdTraits<kHeadDim>::kThreads)
    attention_fwd_tc_kernel(const AttnParams p) {
  using Tr = FwdTraits<kHeadDim>;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int kWarps = Tr::kWarps, kThreads = Tr::kThreads;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kStrips = Tr::kStrips;
  constexpr int kScoreBlocks = kBlockN / 8;  // n-blocks of S
  constexpr int kOutBlocks = kHeadDim / 8;   // n-blocks of O
  constexpr int kHeadSteps = kHeadDim / 16;  // k-steps of S = Q K^T
  constexpr int kKeySteps = kBlockN / 16;    // k-steps of O += P V

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t bh = batch_head_index();
  if (bh >= p.B * p.Hq) return;
  const int64_t b = bh / p.Hq, h = bh % p.Hq, hk = h / (p.Hq / p.Hkv);
  // Causal: the last query tiles have the most keys; start them first.
  const int64_t m_block = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int64_t i0 = m_block * kBlockM;
  const int m_rows = static_cast<int>(p.L - i0 < kBlockM ? p.L - i0 : kBlockM);
  // Key tiles [first_tile, n_tiles) hold the keys some row of the tile sees (causal bound, window).
  int64_t kv_begin = 0, kv_end;
  if constexpr (kWindow) {
    kv_begin = visible_key_range(p, i0).begin;
    kv_end = visible_key_range(p, i0 + m_rows - 1).end;
  } else {
    kv_end = causal_key_end(p, i0 + m_rows - 1);
  }
  const int first_tile = static_cast<int>(kv_begin / kBlockN);
  const int n_tiles = static_cast<int>((kv_end + kBlockN - 1) / kBlockN);

  // Row-major views (row stride *_stride[2], unit column stride) of this (b, h):
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1] + i0 * p.q_stride[2];  // (m_rows, E)
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];                      // (S, E)
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];                      // (S, E)
  const int mask_elem_bytes = p.mask_kind == MaskKind::Bool ? 1 : static_cast<int>(sizeof(T));

  char* smem = dynamic_smem();
  const uint32_t s_q = smem_u32(smem + Tr::kSmemQ);
  const uint32_t s_k = smem_u32(smem + Tr::kSmemK);
  const uint32_t s_v = smem_u32(smem + Tr::kSmemV);

  auto load_kv = [&](int tile, int buf) {
    const int64_t j0 = static_cast<int64_t>(tile) * kBlockN;
    const int rows = static_cast<int>(p.S - j0 < kBlockN ? p.S - j0 : kBlockN);
    load_tile_async<KVTile, kThreads>(s_k + buf * KVTile::kBytes, k + j0 * p.k_stride[2], p.k_stride[2], rows, tid);
    load_tile_async<KVTile, kThreads>(s_v + buf * KVTile::kBytes, v + j0 * p.v_stride[2], p.v_stride[2], rows, tid);
  };
  load_tile_async<QTile, kThreads>(s_q, q, p.q_stride[2], m_rows, tid);
  if (first_tile < n_tiles) load_kv(first_tile, 0);
  cp_async_commit();

  // Local row of (strip s, half hi) for this thread.
  auto local_row = [&](int s, int hi) { return s * 16 * kWarps + warp * 16 + hi * 8 + g; };

  // Scalars are re-derived from `p` (kernel parameter space) where they are
  // used rather than held in registers across the key loop.
  const bool dropout = p.dropout_p > 0.0;

  float o[kStrips][kOutBlocks][4];
  float row_max[kStrips][2];  // running max of the scores (log2 units)
  float row_sum[kStrips][2];  // running sum of exp2(score - max), this thread's columns only
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int d = 0; d < kOutBlocks; ++d)
#pragma unroll
      for (int r = 0; r < 4; ++r) o[s][d][r] = 0.0f;
    row_max[s][0] = row_max[s][1] = -INFINITY;
    row_sum[s][0] = row_sum[s][1] = 0.0f;
  }
  uint32_t q_frag[Tr::kQInRegs ? kStrips : 1][Tr::kQInRegs ? kHeadSteps : 1][4];

  for (int it = first_tile; it < n_tiles; ++it) {
    const int buf = (it - first_tile) & 1;
    const int64_t j0 = static_cast<int64_t>(it) * kBlockN;
    cp_async_wait_all();
    __syncthreads();  // tile `it` is in; every warp is done with tile it - 1, whose buffer we refill now
    if (it + 1 < n_tiles) {
      load_kv(it + 1, buf ^ 1);
      cp_async_commit();
    }
    const uint32_t s_kb = s_k + buf * KVTile::kBytes;
    const uint32_t s_vb = s_v + buf * KVTile::kBytes;

    if constexpr (Tr::kQInRegs) {
      if (it == first_tile) {
#pragma unroll
        for (int s = 0; s < kStrips; ++s)
#pragma unroll
          for (int ks = 0; ks < kHeadSteps; ++ks) ldsm_a<QTile>(q_frag[s][ks], s_q, local_row(s, 0) - g, ks * 16, lane);
      }
    }

    // S = Q K^T
    float sc[kStrips][kScoreBlocks][4];
#pragma unroll
    for (int s = 0; s < kStrips; ++s)
#pragma unroll
      for (int n = 0; n < kScoreBlocks; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) sc[s][n][r] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kHeadSteps; ++ks) {
      uint32_t qa[kStrips][4];
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
        if constexpr (Tr::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) qa[s][r] = q_frag[s][ks][r];
        } else {
          ldsm_a<QTile>(qa[s], s_q, local_row(s, 0) - g, ks * 16, lane);
        }
      }
      mma_k_step<T>(sc, qa, [&](uint32_t(&kb)[4], int n) { ldsm_b<KVTile>(kb, s_kb, n * 8, ks * 16, lane); });
    }

    // Scale to log2 units and mask. Only tiles that hold a masked element
    // (attn_mask, the end of the keys, the causal diagonal) pay for masking.
    // The scores enter the softmax as x * factor: a whole tile with a
    // positive scale keeps the raw Q K^T (factor = scale * log2(e), folded
    // into the exp2's FMA, and max(x) * factor is the max of the scaled
    // scores); otherwise they are scaled (and masked) here and factor = 1.
    const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
    bool whole_tile;
    if constexpr (kWindow) {
      whole_tile = p.mask_kind == MaskKind::None && window_sees_whole_tile(p, i0, i0 + m_rows - 1, j0, kBlockN);
    } else {
      whole_tile = p.mask_kind == MaskKind::None && j0 + kBlockN <= p.S &&
                   (!p.causal || j0 + kBlockN <= causal_key_end(p, i0));
    }
    const float factor = whole_tile && scale_log2 > 0.0f ? scale_log2 : 1.0f;
    if (whole_tile) {
      if (scale_log2 <= 0.0f) {
#pragma unroll
        for (int s = 0; s < kStrips; ++s)
#pragma unroll
          for (int n = 0; n < kScoreBlocks; ++n)
#pragma unroll
            for (int r = 0; r < 4; ++r) sc[s][n][r] *= scale_log2;
      }
    } else {
      // One row at a time, in a rolled loop: unrolled, the compiler hoists the
      // mask loads (and addresses) of all rows at once, and the registers for
      // that are not there next to O and S.
      dispatch_mask_kind(p.mask_kind, [&](auto kind) {
#pragma unroll 1
        for (int rr = 0; rr < 2 * kStrips; ++rr) {
          const int row = local_row(rr / 2, rr % 2);
          const int64_t i = i0 + row;
          // Key j0 + 8n + 2t + e is visible iff 8n + e < visible_end (and right of a window's left edge, below).
          int visible_end;
          if constexpr (kWindow) {
            visible_end = window_cols_end(p, i, row < m_rows, j0 + 2 * t, kBlockN);
          } else {
            visible_end = visible_keys(p, i, row < m_rows, j0 + 2 * t, kBlockN);
          }
          const char* m = mask_ptr(p, mask_elem_bytes, b, h, i, j0 + 2 * t);
          const int64_t m_step = opaque(p.mask_stride[3] * mask_elem_bytes);  // bytes from key j to j + 1
#pragma unroll
          for (int s = 0; s < kStrips; ++s)
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
              if (rr != 2 * s + hi) continue;
#pragma unroll
              for (int n = 0; n < kScoreBlocks; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                  float& x = sc[s][n][2 * hi + e];
                  x = masked_score<decltype(kind)::value, T>(m + (n * 8 + e) * m_step, n * 8 + e < visible_end,
                                                             x * scale_log2);
                }
            }
        }
      });
      // A window's left edge: keys j0 + 8n + 2t + e with 8n + e < begin are outside.
      if constexpr (kWindow) {
        if (p.window_left >= 0 && j0 < visible_key_range(p, i0 + m_rows - 1).begin) {
#pragma unroll 1
          for (int rr = 0; rr < 2 * kStrips; ++rr) {
            const int row = local_row(rr / 2, rr % 2);
            const int begin = window_cols_begin(p, i0 + row, j0 + 2 * t, kBlockN);
#pragma unroll
            for (int s = 0; s < kStrips; ++s)
#pragma unroll
              for (int hi = 0; hi < 2; ++hi) {
                if (rr != 2 * s + hi) continue;
#pragma unroll
                for (int n = 0; n < kScoreBlocks; ++n)
#pragma unroll
                  for (int e = 0; e < 2; ++e)
                    if (n * 8 + e < begin) sc[s][n][2 * hi + e] = -INFINITY;
              }
          }
        }
      }
    }

    // Online softmax: new running max, rescale O and the running sum,
    // P = exp2(x * factor - max).
#pragma unroll
    for (int s = 0; s < kStrips; ++s) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < kScoreBlocks; ++n) mx = fmaxf(mx, fmaxf(sc[s][n][2 * hi], sc[s][n][2 * hi + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // the 4 threads of a row
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = fmaxf(row_max[s][hi], mx * factor);
        // A row that has seen no visible key yet keeps max -inf; shift by 0
        // then, so that exp2 gives 0 rather than NaN.
        const float shift = mx == -INFINITY ? 0.0f : mx;
        const float correction = exp2f(row_max[s][hi] - shift);
        row_max[s][hi] = mx;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < kScoreBlocks; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& x = sc[s][n][2 * hi + e];
            x = exp2f(fmaf(x, factor, -shift));
            sum += x;
          }
        row_sum[s][hi] = row_sum[s][hi] * correction + sum;
#pragma unroll
        for (int d = 0; d < kOutBlocks; ++d) {
          o[s][d][2 * hi] *= correction;
          o[s][d][2 * hi + 1] *= correction;
        }
      }
    }

    // Dropout (the sum above is taken before it, as on the CPU; the 1 / (1 - p)
    // is applied with 1 / sum at the end). Columns 8n + 4(t/2) .. + 3 of a row
    // are one Philox block, shared by the lanes t and t ^ 1: the even lane draws
    // the block of row g, the odd lane that of row g + 8, and they swap the
    // keep bits the other needs.
    if (dropout) {
      const int mine = t & 1;  // which half (row g or g + 8) this lane draws
      const uint64_t seed = static_cast<uint64_t>(*p.seed_ptr);
      const uint32_t drop_threshold = dropout_threshold(p.dropout_p);
#pragma unroll
      for (int s = 0; s < kStrips; ++s) {
        const uint64_t drow = dropout_row(p, b, h, i0 + local_row(s, mine));
#pragma unroll
        for (int n = 0; n < kScoreBlocks; ++n) {
          const int64_t block = (j0 + n * 8) / 4 + t / 2;
          uint32_t bits = dropout_keep_bits4(seed, drow, block, drop_threshold) << (4 * mine);
          bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
          // element (hi, e) is column 2t + e: output (2t + e) % 4 = 2 (t & 1) + e of block `hi`
#pragma unroll
          for (int hi = 0; hi < 2; ++hi)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (!((bits >> (4 * hi + 2 * mine + e)) & 1u)) sc[s][n][2 * hi + e] = 0.0f;
        }
      }
    }

    // O += P V, P from the S accumulators (see "Accumulator -> A operand"),
    // converted to 16 bits first: half the registers of the f32 scores.
    uint32_t pa[kKeySteps][kStrips][4];
#pragma unroll
    for (int s = 0; s < kStrips; ++s)
#pragma unroll
      for (int kk = 0; kk < kKeySteps; ++kk) acc_to_a<T>(pa[kk][s], sc[s], kk);
#pragma unroll
    for (int kk = 0; kk < kKeySteps; ++kk)
      mma_k_step<T>(o, pa[kk], [&](uint32_t(&vb)[4], int d) { ldsm_b_t<KVTile>(vb, s_vb, kk * 16, d * 8, lane); });
  }

  // Epilogue: out = O * keep_scale / sum (0 for a row without a visible key),
  // lse = max * ln 2 + ln(sum) (-inf for such a row). A NaN score makes the
  // sum NaN (fmaxf skips it in the max, exp2f does not): output and lse NaN,
  // as in PyTorch.
  float* lse = static_cast<float*>(p.lse) + bh * p.L + i0;  // (m_rows,) of the contiguous (B, Hq, L)
  const float keep_scale = dropout ? static_cast<float>(1.0 / (1.0 - p.dropout_p)) : 1.0f;
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float l = row_sum[s][hi];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.0f ? keep_scale / l : (isnan(l) ? l : 0.0f);
      const int row = local_row(s, hi);
      if (t == 0 && row < m_rows) lse[row] = l > 0.0f ? row_max[s][hi] * kLn2 + logf(l) : (isnan(l) ? l : -INFINITY);
#pragma unroll
      for (int d = 0; d < kOutBlocks; ++d) {
        o[s][d][2 * hi] *= inv;
        o[s][d][2 * hi + 1] *= inv;
      }
    }
  }

  // Stage the output tile in the Q tile (each warp overwrites only its own
  // rows, which only it has read), then write 16-byte chunks of whole rows.
  // Without a key tile, the Q copies (by all threads, into every warp's rows)
  // may still be in flight: wait for them everywhere first.
  cp_async_wait_all();
  __syncthreads();
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int row = local_row(s, hi);
#pragma unroll
      for (int d = 0; d < kOutBlocks; ++d) {
        const uint32_t packed = pack2<T>(o[s][d][2 * hi], o[s][d][2 * hi + 1]);
        memcpy(smem + Tr::kSmemQ + QTile::offset(row, d) + t * 4, &packed, 4);
      }
    }
  __syncwarp();
  T* out = static_cast<T*>(p.out) + b * p.o_stride[0] + h * p.o_stride[1] + i0 * p.o_stride[2];  // (m_rows, E), any strides
#pragma unroll
  for (int s = 0; s < kStrips; ++s) {
    const int row0 = s * 16 * kWarps + warp * 16;
#pragma unroll
    for (int it = 0; it < 16 * kOutBlocks / 32; ++it) {
      const int idx = it * 32 + lane;
      const int row = row0 + idx / kOutBlocks, chunk = idx % kOutBlocks;
      if (row >= m_rows) continue;
      const uint4 val = *reinterpret_cast<const uint4*>(smem + Tr::kSmemQ + QTile::offset(row, chunk));
      T* dst = out + row * p.o_stride[2] + chunk * 8 * p.o_stride[3];
      if (p.o_stride[3] == 1 && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = val;
      } else {
        T elems[8];
        memcpy(elems, &val, sizeof(val));
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e * p.o_stride[3]] = elems[e];
      }
    }
  }
}

template <typename T, int kHeadDim>
void launch_forward(const AttnParams& p, cudaStream_t stream) {
  using Tr = FwdTraits<kHeadDim>;
  const int64_t m_blocks = (p.L + Tr::kBlockM - 1) / Tr::kBlockM;
  const dim3 grid = tile_grid(m_blocks, p.B * p.Hq);
  if (has_window(p)) {
    launch_kernel<attention_fwd_tc_kernel<T, kHeadDim, true>>(grid, dim3(Tr::kThreads), Tr::kSmemBytes, stream, p);
  } else {
    launch_kernel<attention_fwd_tc_kernel<T, kHeadDim, false>>(grid, dim3(Tr::kThreads), Tr::kSmemBytes, stream, p);
  }
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// The strides of a (B, H, rows, E) operand allow 16-byte loads of its rows.
// A dim of size 1 never moves the pointer, so its stride does not matter.
bool rows_vectorizable(const void* ptr, const int64_t (&stride)[4], const int64_t (&size)[4]) {
  if (!aligned16(ptr) || stride[3] != 1) return false;
  for (int d = 0; d < 3; ++d)
    if (size[d] > 1 && stride[d] % 8 != 0) return false;
  return true;
}

}  // namespace
}  // namespace tc

const char* tensor_core_unsupported(const AttnParams& params, int sm_major, int sm_minor, int smem_per_block_optin) {
  // The reason, in words; it lives until this thread's next call.
  thread_local char reason[256];
  auto say = [&](auto... args) {
    snprintf(reason, sizeof(reason), args...);
    return static_cast<const char*>(reason);
  };
  if (params.dtype != DType::Float16 && params.dtype != DType::BFloat16)
    return "the tensor-core kernels take float16 and bfloat16 only";
  if (sm_major < 8) return say("the tensor-core kernels need compute capability 8.0 or newer, got %d.%d", sm_major, sm_minor);
  if (params.probs != nullptr) return "the explicit probabilities are computed by the generic kernels";
  if (params.cu_q != nullptr) return "packed batches (varlen) run on the generic kernels";
  if (params.softcap > 0.0 || params.alibi != nullptr || params.sinks != nullptr)
    return "a softcap, ALiBi slopes or sinks run on the generic kernels (a window runs on both)";
  if (params.Ev != params.E)
    return say("value head dim %lld differs from query head dim %lld", static_cast<long long>(params.Ev),
               static_cast<long long>(params.E));
  // These kernels count rows and tiles in 32 bits; their grids put tiles on x
  // (< 2**31), (batch, head) on y and z (< 2**16 each), and the backward's row
  // pass B Hq L / 8 blocks on x (up to 32 lanes a row, 256 a block). Sizes past
  // that (reachable with inputs expanded with stride 0) run on the generic
  // kernels, which count in 64 bits.
  const int64_t kInt32Max = (int64_t{1} << 31) - 1;
  if (params.L > kInt32Max || params.S > kInt32Max || params.B * params.Hq > int64_t{65535} * 65535 ||
      params.B * params.Hq * params.L > (int64_t{1} << 33))
    return say("B %lld, Hq %lld, L %lld, S %lld is past the tensor-core kernels' 32-bit row and tile counts",
               static_cast<long long>(params.B), static_cast<long long>(params.Hq), static_cast<long long>(params.L),
               static_cast<long long>(params.S));
  int fwd_smem = 0, bwd_smem = 0;
  const bool has_kernel = tc::dispatch_head_dim(params.E, [&](auto head_dim) {
    fwd_smem = tc::FwdTraits<decltype(head_dim)::value>::kSmemBytes;
    bwd_smem = tc::BwdTraits<decltype(head_dim)::value>::kSmemBytes;
  });
  if (!has_kernel) return say("head dim %lld is not one of 32, 64, 96, 128", static_cast<long long>(params.E));
  // One check for both directions (the backward needs more).
  const int smem = fwd_smem > bwd_smem ? fwd_smem : bwd_smem;
  if (smem > smem_per_block_optin)
    return say("head dim %lld needs %d KiB of shared memory per block, this device (compute capability %d.%d) "
               "allows %d KiB",
               static_cast<long long>(params.E), smem / 1024, sm_major, sm_minor, smem_per_block_optin / 1024);
  const int64_t q_size[4] = {params.B, params.Hq, params.L, params.E};
  const int64_t kv_size[4] = {params.B, params.Hkv, params.S, params.E};
  const char* names[3] = {"query", "key", "value"};
  const bool ok[3] = {tc::rows_vectorizable(params.q, params.q_stride, q_size),
                      tc::rows_vectorizable(params.k, params.k_stride, kv_size),
                      tc::rows_vectorizable(params.v, params.v_stride, kv_size)};
  for (int i = 0; i < 3; ++i)
    if (!ok[i])
      return say("%s needs a contiguous last dim, other strides a multiple of 8 elements and 16-byte aligned data",
                 names[i]);
  // out and grad_out may have any strides: the kernels store and load them
  // with 16-byte accesses where a row allows, element by element elsewhere.
  return nullptr;
}

void forward_tensor_core(const AttnParams& params, cudaStream_t stream) {
  if (params.B * params.Hq == 0 || params.L == 0) return;  // nothing to write (S == 0 still writes out = 0, lse = -inf)
  tc::dispatch_tc_dtype(params.dtype, [&](auto elem) {
    using T = decltype(elem);
    tc::dispatch_head_dim(params.E, [&](auto head_dim) { tc::launch_forward<T, decltype(head_dim)::value>(params, stream); });
  });
}

}  // namespace attn_ext::cuda
