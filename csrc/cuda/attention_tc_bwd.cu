// attn_ext: the tensor-core backward (FlashAttention-2 style, float16/bfloat16,
// sm_80+).
//
//   delta_i = rowsum(dO_i * O_i) - dlse_i                  (attention_bwd_delta_kernel)
//   P = exp(S - lse), Z = P * keep / (1 - p)               (attention_bwd_tc_kernel, per tile)
//   dV += Z^T dO,  dP = (dO V^T) * keep / (1 - p),  dS = P * (dP - delta)
//   dK += scale dS^T Q,  dQ += scale dS K (atomics),  dmask += dS (atomics)
//
// Method, fragment layouts and shared-memory layout: attention_tc.cuh.
#include "attention_tc.cuh"

namespace attn_ext::cuda {
namespace tc {
namespace {

// delta = rowsum(dO * O) - dlse for every row (b, h, i). A group of `group`
// lanes (a power of two, 4 .. 32) takes one row: with unit column strides and
// 16-byte aligned rows, 8 elements per lane and load (the common case: a
// memory-bound pass over O and dO), else one element per lane and load (O and
// dO may have any strides).
template <typename T>
__global__ void __launch_bounds__(256) attention_bwd_delta_kernel(const AttnBwdParams p, int group,
                                                                  float* delta) {  // (B, Hq, L) contiguous
  const int sub = threadIdx.x % group;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) / group;  // (b * Hq + h) * L + i
  const bool valid = row < p.B * p.Hq * p.L;
  float acc = 0.0f;
  if (valid) {
    const int64_t i = row % p.L, bh = row / p.L, b = bh / p.Hq, h = bh % p.Hq;
    const T* o = static_cast<const T*>(p.out) + b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
    const T* d = static_cast<const T*>(p.dout) + b * p.do_stride[0] + h * p.do_stride[1] + i * p.do_stride[2];
    const bool vec = p.o_stride[3] == 1 && p.do_stride[3] == 1 && p.Ev % 8 == 0 &&
                     ((reinterpret_cast<uintptr_t>(o) | reinterpret_cast<uintptr_t>(d)) & 15) == 0;
    if (vec) {
      for (int64_t e = 8 * sub; e < p.Ev; e += 8 * group) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + e), dv = *reinterpret_cast<const uint4*>(d + e);
        T oe[8], de[8];
        memcpy(oe, &ov, sizeof(ov));
        memcpy(de, &dv, sizeof(dv));
#pragma unroll
        for (int k = 0; k < 8; ++k) acc = fmaf(to_float(oe[k]), to_float(de[k]), acc);
      }
    } else {
      for (int64_t e = sub; e < p.Ev; e += group) acc += to_float(o[e * p.o_stride[3]]) * to_float(d[e * p.do_stride[3]]);
    }
  }
  for (int offset = group / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (valid && sub == 0) delta[row] = acc - (p.dlse != nullptr ? static_cast<const float*>(p.dlse)[row] : 0.0f);
}

// One CTA: keys [k0, k0 + kBlockN) of one (batch, query head), all query
// tiles that can see them. Warp w owns keys k0 + 16 w + [0, 16) and works on
// S^T = K Q^T: its thread (g, t) holds keys k0 + 16 w + g + 8 hi (hi = 0, 1)
// and, in n-block n of a query tile, queries i0 + 8 n + 2 t + e: element
// S^T[n][2 hi + e]. dK and dV of the warp's keys stay in registers
// (columns 8 d + 2 t + e of n-block d).
template <typename T, int kHeadDim, bool kShort, bool kWindow>
__global__ void __launch_bounds__(BwdTraits<kHeadDim, kShort>::kThreads, 1)
    attention_bwd_tc_kernel(const AttnBwdParams p, const BwdWorkspace ws) {
  using Tr = BwdTraits<kHeadDim, kShort>;
  using KVTile = typename Tr::KVTile;
  using QTile = typename Tr::QTile;
  using DsTile = typename Tr::DsTile;
  constexpr int kThreads = Tr::kThreads, kBlockN = Tr::kBlockN, kBlockM = Tr::kBlockM;
  constexpr int kQueryBlocks = kBlockM / 8;   // n-blocks of S^T and dP^T
  constexpr int kHeadBlocks = kHeadDim / 8;   // n-blocks of dK, dV
  constexpr int kHeadSteps = kHeadDim / 16;   // k-steps of K Q^T and V dO^T
  constexpr int kQuerySteps = kBlockM / 16;   // k-steps of Z^T dO and dS^T Q
  constexpr int kKeySteps = kBlockN / 16;     // k-steps of dS K
  constexpr int kDqBlocks = Tr::kDqCols / 8;  // n-blocks of this warp's part of dQ
  static_assert(kThreads >= 2 * kBlockM, "one thread per lse and per delta value of a query tile");
  // The dropout keep bits of a query tile, 4 per n-block.
  using KeepBits = std::conditional_t<4 * kQueryBlocks <= 32, uint32_t, uint64_t>;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int64_t bh = batch_head_index();
  if (bh >= p.B * p.Hq) return;
  const int64_t b = bh / p.Hq, h = bh % p.Hq, hk = h / (p.Hq / p.Hkv);
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kBlockN;
  const int n_keys = static_cast<int>(p.S - k0 < kBlockN ? p.S - k0 : kBlockN);
  // Query tiles [first_qtile, n_qtiles) hold the rows that see some of our keys (causal bound, window).
  int64_t first_qtile, n_qtiles;
  if constexpr (kWindow) {
    const KeyRange rows_seeing = visible_row_range(p, k0, k0 + n_keys);
    first_qtile = rows_seeing.begin / kBlockM;
    n_qtiles = (rows_seeing.end + kBlockM - 1) / kBlockM;
  } else {
    n_qtiles = (p.L + kBlockM - 1) / kBlockM;
    // Causal: query rows before first_row_seeing(k0) see none of our keys.
    first_qtile = p.causal ? first_row_seeing(p, k0) / kBlockM : 0;
  }

  // Row-major views of this (b, h) (row stride *_stride[2]; unit column stride but for dO):
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1] + k0 * p.k_stride[2];  // (n_keys, E)
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1] + k0 * p.v_stride[2];  // (n_keys, E)
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];                        // (L, E)
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_stride[0] + h * p.do_stride[1];  // (L, E), any strides
  const float* lse = static_cast<const float*>(p.lse) + bh * p.L;                          // (L,)
  const float* delta = static_cast<const float*>(ws.delta) + bh * p.L;                     // (L,)
  float* dq = static_cast<float*>(ws.dq_accum) + bh * p.L * kHeadDim;                      // (L, E) contiguous

  char* smem = dynamic_smem();
  const uint32_t s_k = smem_u32(smem + Tr::kSmemK);
  const uint32_t s_v = smem_u32(smem + Tr::kSmemV);
  const uint32_t s_q = smem_u32(smem + Tr::kSmemQ);
  const uint32_t s_do = smem_u32(smem + Tr::kSmemDo);
  const uint32_t s_ds = smem_u32(smem + Tr::kSmemDs);
  float* s_lse = reinterpret_cast<float*>(smem + Tr::kSmemLse);      // [2][kBlockM], lse * log2(e)
  float* s_delta = reinterpret_cast<float*>(smem + Tr::kSmemDelta);  // [2][kBlockM]

  auto load_query_tile = [&](int64_t qt, int buf) {
    const int64_t i0 = qt * kBlockM;
    const int rows = static_cast<int>(p.L - i0 < kBlockM ? p.L - i0 : kBlockM);
    load_tile_async<QTile, kThreads>(s_q + buf * QTile::kBytes, q + i0 * p.q_stride[2], p.q_stride[2], rows, tid);
    load_tile_strided<QTile, kThreads>(smem + Tr::kSmemDo + buf * QTile::kBytes, s_do + buf * QTile::kBytes,
                                       dout + i0 * p.do_stride[2], p.do_stride[2], p.do_stride[3], rows, tid);
  };
  // Threads [0, kBlockM) fetch the lse of query tile qt, [kBlockM, 2 kBlockM)
  // its delta; stats_store puts them in shared memory. lse is kept as
  // lse * log2(e), +inf for rows that see no key (lse = -inf) and for the
  // padding rows, so that exp2(x - lse) is 0 there. The fetch only loads, and
  // the store (a whole query tile of work later) converts: nothing waits on
  // the load in between.
  auto stats_fetch = [&](int64_t qt) {
    const int64_t i = qt * kBlockM + (tid % kBlockM);
    if (tid < kBlockM) return i < p.L ? lse[i] : -INFINITY;
    return i < p.L && tid < 2 * kBlockM ? delta[i] : 0.0f;
  };
  auto stats_store = [&](float value, int buf) {
    if (tid < kBlockM) {
      s_lse[buf * kBlockM + tid] = value == -INFINITY ? INFINITY : value * kLog2e;
    } else if (tid < 2 * kBlockM) {
      s_delta[buf * kBlockM + tid - kBlockM] = value;
    }
  };

  load_tile_async<KVTile, kThreads>(s_k, k, p.k_stride[2], n_keys, tid);
  load_tile_async<KVTile, kThreads>(s_v, v, p.v_stride[2], n_keys, tid);
  if (first_qtile < n_qtiles) load_query_tile(first_qtile, 0);
  cp_async_commit();
  if (first_qtile < n_qtiles) stats_store(stats_fetch(first_qtile), 0);

  const bool dropout = p.dropout_p > 0.0;
  const int mask_elem_bytes = p.mask_kind == MaskKind::Bool ? 1 : static_cast<int>(sizeof(T));
  const int key_row = warp * 16 + g;  // local key of hi = 0; hi = 1 is key_row + 8

  float dk[kHeadBlocks][4], dv[kHeadBlocks][4];
#pragma unroll
  for (int d = 0; d < kHeadBlocks; ++d)
#pragma unroll
    for (int r = 0; r < 4; ++r) dk[d][r] = dv[d][r] = 0.0f;
  // The warp's K and V rows as A operands, when they fit in registers.
  uint32_t ka[Tr::kKVInRegs ? kHeadSteps : 1][4], va[Tr::kKVInRegs ? kHeadSteps : 1][4];
  // acc = X_w Y^T: X_w the warp's 16 rows of X = K or V (x_regs, when they
  // are kept in registers, else tile s_x), Y a query-side tile (Q or dO).
  auto warp_keys_times = [&](float(&acc)[kQueryBlocks][4], const uint32_t(&x_regs)[Tr::kKVInRegs ? kHeadSteps : 1][4],
                             uint32_t s_x, uint32_t s_y) {
#pragma unroll
    for (int n = 0; n < kQueryBlocks; ++n)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[n][r] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < kHeadSteps; ++ks) {
      uint32_t a[4];
      if constexpr (Tr::kKVInRegs) {
#pragma unroll
        for (int r = 0; r < 4; ++r) a[r] = x_regs[ks][r];
      } else {
        ldsm_a<KVTile>(a, s_x, warp * 16, ks * 16, lane);
      }
      mma_k_step<T>(acc, a, [&](uint32_t(&yb)[4], int n) { ldsm_b<QTile>(yb, s_y, n * 8, ks * 16, lane); });
    }
  };

  for (int64_t qt = first_qtile; qt < n_qtiles; ++qt) {
    const int buf = static_cast<int>((qt - first_qtile) & 1);
    const int64_t i0 = qt * kBlockM;
    cp_async_wait_all();
    __syncthreads();  // tile qt is in; every warp is done with tile qt - 1 (buffers buf ^ 1, dS^T)
    const bool has_next = qt + 1 < n_qtiles;
    float next_stat = 0.0f;
    if (has_next) {
      load_query_tile(qt + 1, buf ^ 1);
      cp_async_commit();
      next_stat = stats_fetch(qt + 1);
    }
    const uint32_t s_qb = s_q + buf * QTile::kBytes;
    const uint32_t s_dob = s_do + buf * QTile::kBytes;
    const float* lse2 = s_lse + buf * kBlockM;
    const float* delta_b = s_delta + buf * kBlockM;

    if constexpr (Tr::kKVInRegs) {
      if (qt == first_qtile) {
#pragma unroll
        for (int ks = 0; ks < kHeadSteps; ++ks) {
          ldsm_a<KVTile>(ka[ks], s_k, warp * 16, ks * 16, lane);
          ldsm_a<KVTile>(va[ks], s_v, warp * 16, ks * 16, lane);
        }
      }
    }

    // S^T = K Q^T, then dP^T = V dO^T at once: the second product needs
    // nothing of the first, so its mma instructions are in flight while the
    // exponentials and the masking below run (st and dpt are both live until
    // dS anyway: no extra registers).
    float st[kQueryBlocks][4];
    warp_keys_times(st, ka, s_k, s_qb);
    float dpt[kQueryBlocks][4];
    warp_keys_times(dpt, va, s_v, s_dob);

    // P^T = exp2(S^T * scale * log2(e) [+ mask] - lse * log2(e)). Only tiles
    // that hold a masked element (attn_mask, the end of the keys, the causal
    // diagonal) pay for masking.
    // Whole tiles fold the scale into the exp2's FMA (factor); masked tiles
    // are scaled and masked first (factor = 1).
    const float scale_log2 = static_cast<float>(p.scale) * kLog2e;
    bool whole_tile;
    if constexpr (kWindow) {
      whole_tile = p.mask_kind == MaskKind::None &&
                   window_sees_whole_tile(p, i0, (i0 + kBlockM < p.L ? i0 + kBlockM : p.L) - 1, k0, kBlockN);
    } else {
      whole_tile = p.mask_kind == MaskKind::None && k0 + kBlockN <= p.S &&
                   (!p.causal || k0 + kBlockN <= causal_key_end(p, i0));
    }
    const float factor = whole_tile ? scale_log2 : 1.0f;
    if (!whole_tile) {
      // Column by column (query by query) in a rolled loop, to keep the mask
      // loads of the whole tile from being hoisted at once.
      dispatch_mask_kind(p.mask_kind, [&](auto kind) {
#pragma unroll 1
        for (int cc = 0; cc < 2 * kQueryBlocks; ++cc) {
          const int col = (cc / 2) * 8 + 2 * t + cc % 2;
          const int64_t i = i0 + col;
          // Key k0 + key_row + 8 hi is visible iff key_row + 8 hi < visible; with a window, iff
          // bit hi of `visible` is set (one int live, not both ends of the window).
          int visible;
          if constexpr (kWindow) {
            visible = window_visible_pair(p, i, i < p.L, k0 + key_row);
          } else {
            visible = visible_keys(p, i, i < p.L, k0, kBlockN);
          }
          const char* m = mask_ptr(p, mask_elem_bytes, b, h, i, k0 + key_row);
          const int64_t m_step = opaque(p.mask_stride[3] * mask_elem_bytes);  // bytes from key j to j + 1
#pragma unroll
          for (int n = 0; n < kQueryBlocks; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (cc != 2 * n + e) continue;
#pragma unroll
              for (int hi = 0; hi < 2; ++hi) {
                float& x = st[n][2 * hi + e];
                bool key_visible;
                if constexpr (kWindow) {
                  key_visible = (visible >> hi) & 1;
                } else {
                  key_visible = key_row + 8 * hi < visible;
                }
                x = masked_score<decltype(kind)::value, T>(m + 8 * hi * m_step, key_visible, x * scale_log2);
              }
            }
        }
      });
    }
#pragma unroll
    for (int n = 0; n < kQueryBlocks; ++n) {
      const float2 l = *reinterpret_cast<const float2*>(lse2 + n * 8 + 2 * t);
      st[n][0] = exp2f(fmaf(st[n][0], factor, -l.x));
      st[n][1] = exp2f(fmaf(st[n][1], factor, -l.y));
      st[n][2] = exp2f(fmaf(st[n][2], factor, -l.x));
      st[n][3] = exp2f(fmaf(st[n][3], factor, -l.y));
    }

    // Dropout keep bits: bit 4 n + r for element st[n][r]. Keys k0 + 16 w +
    // 4 c .. + 3 (c = g / 4, plus 8 hi) of one query are one Philox block,
    // spread over the lanes g = 4 c .. 4 c + 3 (same t): each of these four
    // lanes draws one of the four blocks (hi, e) = (j' / 2, j' % 2), j' = g % 4,
    // that the group needs in n-block n, and two shuffles give every lane
    // the bits of all four; lane j' keeps output j' (its key) of each.
    KeepBits keep_bits = ~KeepBits{0};
    float keep_scale = 1.0f;
    if (dropout) {
      const uint64_t seed = static_cast<uint64_t>(*p.seed_ptr);
      const uint32_t threshold = dropout_threshold(p.dropout_p);
      keep_scale = static_cast<float>(1.0 / (1.0 - p.dropout_p));
      const int jq = g % 4;
      const int64_t block = (k0 + warp * 16) / 4 + g / 4 + 2 * (jq / 2);
      keep_bits = 0;
#pragma unroll
      for (int n = 0; n < kQueryBlocks; ++n) {
        const uint64_t row = dropout_row(p, b, h, i0 + n * 8 + 2 * t + jq % 2);
        uint32_t bits = dropout_keep_bits4(seed, row, block, threshold) << (4 * jq);
        bits |= __shfl_xor_sync(0xffffffffu, bits, 4);
        bits |= __shfl_xor_sync(0xffffffffu, bits, 8);
#pragma unroll
        for (int r = 0; r < 4; ++r) keep_bits |= static_cast<KeepBits>((bits >> (4 * r + jq)) & 1u) << (4 * n + r);
      }
    }
    auto keep_factor = [&](int n, int r) { return (keep_bits >> (4 * n + r)) & 1u ? keep_scale : 0.0f; };

    // dV += Z^T dO
#pragma unroll
    for (int kk = 0; kk < kQuerySteps; ++kk) {
      float z[2][4];
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) z[n][r] = st[2 * kk + n][r] * keep_factor(2 * kk + n, r);
      uint32_t za[4];
      acc_to_a<T>(za, z, 0);
      mma_k_step<T>(dv, za, [&](uint32_t(&ob)[4], int d) { ldsm_b_t<QTile>(ob, s_dob, kk * 16, d * 8, lane); });
    }

    // dS^T = P^T * (dP^T * keep / (1 - p) - delta), into dpt.
#pragma unroll
    for (int n = 0; n < kQueryBlocks; ++n) {
      const float2 dl = *reinterpret_cast<const float2*>(delta_b + n * 8 + 2 * t);
#pragma unroll
      for (int r = 0; r < 4; ++r) dpt[n][r] = st[n][r] * (dpt[n][r] * keep_factor(n, r) - (r % 2 ? dl.y : dl.x));
    }

    // dmask += dS (only here, with atomics: the mask may broadcast).
    if (p.dmask != nullptr) {
      float* dmask = static_cast<float*>(p.dmask) + b * p.dmask_stride[0] + h * p.dmask_stride[1];
#pragma unroll 1
      for (int cc = 0; cc < kQueryBlocks; ++cc) {
#pragma unroll
        for (int n = 0; n < kQueryBlocks; ++n) {
          if (cc != n) continue;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int64_t i = i0 + n * 8 + 2 * t + r % 2, j = k0 + key_row + 8 * (r / 2);
            if (i < p.L && j < p.S) atomicAdd(dmask + i * p.dmask_stride[2] + j * p.dmask_stride[3], dpt[n][r]);
          }
        }
      }
    }

    // dS^T to shared memory (16-bit) for dQ, and dK += dS^T Q from registers.
#pragma unroll
    for (int n = 0; n < kQueryBlocks; ++n)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const uint32_t packed = pack2<T>(dpt[n][2 * hi], dpt[n][2 * hi + 1]);
        memcpy(smem + Tr::kSmemDs + DsTile::offset(key_row + 8 * hi, n) + t * 4, &packed, 4);
      }
#pragma unroll
    for (int kk = 0; kk < kQuerySteps; ++kk) {
      uint32_t da[4];
      acc_to_a<T>(da, dpt, kk);
      mma_k_step<T>(dk, da, [&](uint32_t(&qb)[4], int d) { ldsm_b_t<QTile>(qb, s_qb, kk * 16, d * 8, lane); });
    }

    if (has_next) stats_store(next_stat, buf ^ 1);  // tile qt - 1 read that buffer; all are past it
    __syncthreads();  // dS^T is complete

    // dQ[i0 + 16 rg .. + 16][cols of group cg] += scale * dS K, with atomics.
    {
      const int rg = warp % (kBlockM / 16), cg = warp / (kBlockM / 16);
      const int col0 = cg * Tr::kDqCols;
      // With few n-blocks, k-steps alternate between two accumulator sets, so
      // that 8 independent mma instructions, not 4, follow one another.
      constexpr int kSets = kDqBlocks < 8 && kKeySteps % 2 == 0 ? 2 : 1;
      float acc_sets[kSets][kDqBlocks][4];
#pragma unroll
      for (int c = 0; c < kSets; ++c)
#pragma unroll
        for (int d = 0; d < kDqBlocks; ++d)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_sets[c][d][r] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < kKeySteps; ++ks) {
        uint32_t a[4];
        ldsm_a_t<DsTile>(a, s_ds, rg * 16, ks * 16, lane);
        mma_k_step<T>(acc_sets[ks % kSets], a,
                      [&](uint32_t(&kb)[4], int d) { ldsm_b_t<KVTile>(kb, s_k, ks * 16, col0 + d * 8, lane); });
      }
      float(&acc)[kDqBlocks][4] = acc_sets[0];
#pragma unroll
      for (int c = 1; c < kSets; ++c)
#pragma unroll
        for (int d = 0; d < kDqBlocks; ++d)
#pragma unroll
          for (int r = 0; r < 4; ++r) acc[d][r] += acc_sets[c][d][r];
      const float scale = static_cast<float>(p.scale);
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int64_t i = i0 + rg * 16 + g + 8 * hi;
        if (i >= p.L) continue;
        float* dq_row = dq + i * kHeadDim + col0 + 2 * t;
#pragma unroll
        for (int d = 0; d < kDqBlocks; ++d)
          atomic_add_f32x2(dq_row + d * 8, scale * acc[d][2 * hi], scale * acc[d][2 * hi + 1]);
      }
    }
  }

  // dK (times scale) and dV of this query head's keys: straight into the
  // results (input dtype, (B, Hkv = Hq, S, E)) when the host gave them, else
  // into the float32 accumulators (B, Hq, S, E). Both are contiguous.
  const float scale = static_cast<float>(p.scale);
  const int64_t first = (bh * p.S + k0) * kHeadDim;  // element (b, h, k0, 0)
  const bool direct = ws.dk_out != nullptr;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int row = key_row + 8 * hi;
    if (row >= n_keys) continue;
#pragma unroll
    for (int d = 0; d < kHeadBlocks; ++d) {
      const int64_t off = first + static_cast<int64_t>(row) * kHeadDim + d * 8 + 2 * t;
      const float dk0 = scale * dk[d][2 * hi], dk1 = scale * dk[d][2 * hi + 1];
      if (direct) {
        *reinterpret_cast<uint32_t*>(static_cast<T*>(ws.dk_out) + off) = pack2<T>(dk0, dk1);
        *reinterpret_cast<uint32_t*>(static_cast<T*>(ws.dv_out) + off) = pack2<T>(dv[d][2 * hi], dv[d][2 * hi + 1]);
      } else {
        *reinterpret_cast<float2*>(static_cast<float*>(ws.dk_accum) + off) = make_float2(dk0, dk1);
        *reinterpret_cast<float2*>(static_cast<float*>(ws.dv_accum) + off) = make_float2(dv[d][2 * hi], dv[d][2 * hi + 1]);
      }
    }
  }
}

template <typename T, int kHeadDim, bool kShort, bool kWindow>
void launch_backward_tiles(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  using Tr = BwdTraits<kHeadDim, kShort>;
  const int64_t n_blocks = (p.S + Tr::kBlockN - 1) / Tr::kBlockN;
  launch_kernel<attention_bwd_tc_kernel<T, kHeadDim, kShort, kWindow>>(
      tile_grid(n_blocks, p.B * p.Hq), dim3(Tr::kThreads), Tr::kSmemBytes, stream, p, ws);
}

template <typename T, int kHeadDim>
void launch_backward(const AttnBwdParams& p, const BwdWorkspace& ws, cudaStream_t stream) {
  int group = 4;  // lanes per row of the delta pass: 8 elements each
  while (group < 32 && 8 * group < p.Ev) group *= 2;
  const int64_t delta_threads = p.B * p.Hq * p.L * group;
  launch_kernel<attention_bwd_delta_kernel<T>>(dim3(static_cast<unsigned>((delta_threads + 255) / 256)), dim3(256), 0,
                                               stream, p, group, static_cast<float*>(ws.delta));
  if constexpr (kHasShortBackward<kHeadDim>) {
    // Query rows per key, on average: half of them when causal, at most the window's width.
    int64_t rows_per_key = p.causal ? (p.L + 1) / 2 : p.L;
    if (p.window_left >= 0 && p.window_left + 1 + (p.causal ? 0 : p.window_right) < rows_per_key &&
        (p.causal || p.window_right >= 0))
      rows_per_key = p.window_left + 1 + (p.causal ? 0 : p.window_right);
    if (rows_per_key <= tile_sizes(kHeadDim).short_rows) {
      if (has_window(p)) {
        launch_backward_tiles<T, kHeadDim, true, true>(p, ws, stream);
      } else {
        launch_backward_tiles<T, kHeadDim, true, false>(p, ws, stream);
      }
      return;
    }
  }
  if (has_window(p)) {
    launch_backward_tiles<T, kHeadDim, false, true>(p, ws, stream);
  } else {
    launch_backward_tiles<T, kHeadDim, false, false>(p, ws, stream);
  }
}

}  // namespace
}  // namespace tc

void backward_tensor_core(const AttnBwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  // Nothing to add: dq_accum, dk_accum, dv_accum arrive zeroed (dk_out, dv_out are written whole).
  if (params.B * params.Hq == 0 || params.L == 0 || params.S == 0) return;
  tc::dispatch_tc_dtype(params.dtype, [&](auto elem) {
    using T = decltype(elem);
    tc::dispatch_head_dim(params.E, [&](auto head_dim) { tc::launch_backward<T, decltype(head_dim)::value>(params, ws, stream); });
  });
}

}  // namespace attn_ext::cuda
