// attn_ext: fused attention on the CPU, forward and backward.
//
// Included once per instruction set by attention_kernel_<isa>.cpp, which
// defines CPU_CAPABILITY (DEFAULT, AVX2) before including it; every symbol
// lands in attn_ext::cpu::CPU_CAPABILITY.
//
// Method (FlashAttention-2 on the CPU): the queries are cut into blocks of
// rows and the keys into tiles (see Tiles below); one forward task is one
// (batch, head, query block). For each key block the task computes the score
// tile S = (scale Q) K^T with a register-blocked at::vec micro-kernel, masks
// it, updates the running row max and row sum (online softmax) and adds P V
// into an output tile kept in the accumulation type. No L x S buffer exists.
// The backward recomputes P = exp(S - lse) tile by tile, one task per
// (batch, key/value head), and accumulates dQ, dK, dV in the accumulation
// type. float16/bfloat16 tiles are converted to float32 once per tile, so the
// half types run at float32 speed.
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY before including attention_kernel_impl.h"
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../attention_math.h"
#include "kernels.h"

namespace attn_ext::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

// float32 accumulation for float16/bfloat16/float32, float64 for float64.
template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

constexpr int kGemmRows = 6;  // micro-kernel: 6 rows x 2 vectors = 12 accumulators

// Tile sizes, in one place. The forward keeps a (q x kv) score tile, the
// scaled Q tile, the K^T and V tiles and the output tile in the core's L2;
// long queries take tall tiles so each packed K^T tile serves many rows.
struct Tiles {
  int64_t q;   // query rows per tile
  int64_t kv;  // keys per tile
};
constexpr int64_t kMaxQTile = 256;
inline Tiles forward_tiles(int64_t L) { return L >= 768 ? Tiles{256, 128} : Tiles{64, 256}; }
inline Tiles backward_tiles() { return Tiles{64, 256}; }

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// ---------------------------------------------------------------------------
// GEMM on tiles: C (M x N, row-major, ldc) = [C +] alpha * A (M x K) * B (K x N)
// A's element (m, k) is a[m * a_rs + k * a_cs], so A may be read transposed.
// B is row-major (ldb) and contiguous along N; N is a multiple of the vector
// width (callers pad their buffers).
// ---------------------------------------------------------------------------
template <typename T, int MR, int NV>
inline void gemm_micro(int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs,
                       const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  using Vec = Vectorized<T>;
  constexpr int VS = Vec::size();
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(T(0));
  for (int64_t kk = 0; kk < K; ++kk) {
    const T* brow = b + kk * ldb;
    Vec bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = Vec::loadu(brow + v * VS);
    const T* acol = a + kk * a_cs;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const Vec av(acol[r * a_rs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(av, bv[v], acc[r][v]);
    }
  }
  const Vec valpha(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      T* cp = c + r * ldc + v * VS;
      Vec out = acc[r][v] * valpha;
      if (accumulate) out = out + Vec::loadu(cp);
      out.store(cp);
    }
  }
}

template <typename T, int NV>
inline void gemm_strip(int64_t M, int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs,
                       const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  int64_t m = 0;
  for (; m + kGemmRows <= M; m += kGemmRows)
    gemm_micro<T, kGemmRows, NV>(K, alpha, a + m * a_rs, a_rs, a_cs, b, ldb, accumulate, c + m * ldc, ldc);
  const T* at = a + m * a_rs;
  T* ct = c + m * ldc;
  switch (M - m) {
    case 0: break;
    case 1: gemm_micro<T, 1, NV>(K, alpha, at, a_rs, a_cs, b, ldb, accumulate, ct, ldc); break;
    case 2: gemm_micro<T, 2, NV>(K, alpha, at, a_rs, a_cs, b, ldb, accumulate, ct, ldc); break;
    case 3: gemm_micro<T, 3, NV>(K, alpha, at, a_rs, a_cs, b, ldb, accumulate, ct, ldc); break;
    case 4: gemm_micro<T, 4, NV>(K, alpha, at, a_rs, a_cs, b, ldb, accumulate, ct, ldc); break;
    default: gemm_micro<T, 5, NV>(K, alpha, at, a_rs, a_cs, b, ldb, accumulate, ct, ldc); break;
  }
}

template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs,
          const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  constexpr int64_t VS = Vectorized<T>::size();
  int64_t n = 0;
  for (; n + 2 * VS <= N; n += 2 * VS)
    gemm_strip<T, 2>(M, K, alpha, a, a_rs, a_cs, b + n, ldb, accumulate, c + n, ldc);
  if (n < N) gemm_strip<T, 1>(M, K, alpha, a, a_rs, a_cs, b + n, ldb, accumulate, c + n, ldc);
}

// ---------------------------------------------------------------------------
// Row helpers (n is a multiple of the vector width)
// ---------------------------------------------------------------------------
template <typename T>
inline Vectorized<T> vexp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

template <typename T>
inline T row_max(const T* s, int64_t n) {
  using Vec = Vectorized<T>;
  Vec acc(-std::numeric_limits<T>::infinity());
  for (int64_t j = 0; j < n; j += Vec::size()) acc = at::vec::maximum(acc, Vec::loadu(s + j));
  T buf[Vec::size()];
  acc.store(buf);
  T m = buf[0];
  for (int i = 1; i < Vec::size(); ++i) m = std::max(m, buf[i]);
  return m;
}

// s = exp(s - shift); returns the sum. -inf entries become 0.
template <typename T>
inline T exp_shift_sum(T* s, int64_t n, T shift) {
  using Vec = Vectorized<T>;
  const Vec vshift(shift);
  Vec acc(T(0));
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const Vec e = vexp(Vec::loadu(s + j) - vshift);
    e.store(s + j);
    acc = acc + e;
  }
  T buf[Vec::size()];
  acc.store(buf);
  T sum = 0;
  for (int i = 0; i < Vec::size(); ++i) sum += buf[i];
  return sum;
}

template <typename T>
inline void scale_row(T* x, int64_t n, T factor) {
  using Vec = Vectorized<T>;
  const Vec f(factor);
  for (int64_t j = 0; j < n; j += Vec::size()) (Vec::loadu(x + j) * f).store(x + j);
}

// dst[e] = src[e * stride] * mul for e < n, 0 for n <= e < n_padded.
template <typename scalar_t, typename T>
inline void load_row(T* dst, const scalar_t* src, int64_t n, int64_t stride, T mul, int64_t n_padded) {
  if (stride == 1) {
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(src[e]) * mul;
  } else {
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(src[e * stride]) * mul;
  }
  for (int64_t e = n; e < n_padded; ++e) dst[e] = T(0);
}

// dst[e * stride] = src[e] * mul for e < n.
template <typename scalar_t, typename T>
inline void store_row(scalar_t* dst, int64_t stride, const T* src, int64_t n, T mul) {
  for (int64_t e = 0; e < n; ++e) dst[e * stride] = static_cast<scalar_t>(src[e] * mul);
}

// Packs rows [j0, j0 + n) of a (rows, dim) matrix with strides (rs, cs)
// transposed: dst[d * ld + j] = src[j0 + j][d]; columns n..ld are zero.
template <typename scalar_t, typename T>
inline void pack_transposed(T* dst, int64_t ld, const scalar_t* src, int64_t rs, int64_t cs,
                            int64_t n, int64_t dim) {
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* row = src + j * rs;
    for (int64_t d = 0; d < dim; ++d) dst[d * ld + j] = static_cast<T>(row[d * cs]);
  }
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t j = n; j < ld; ++j) dst[d * ld + j] = T(0);
}

// sum_e a[e] * b[e].
template <typename T>
inline T dot_product(const T* a, const T* b, int64_t n) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  Vec acc0(T(0)), acc1(T(0));
  int64_t e = 0;
  for (; e + 2 * VS <= n; e += 2 * VS) {
    acc0 = at::vec::fmadd(Vec::loadu(a + e), Vec::loadu(b + e), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + e + VS), Vec::loadu(b + e + VS), acc1);
  }
  for (; e + VS <= n; e += VS) acc0 = at::vec::fmadd(Vec::loadu(a + e), Vec::loadu(b + e), acc0);
  T buf[VS];
  (acc0 + acc1).store(buf);
  T sum = 0;
  for (int64_t i = 0; i < VS; ++i) sum += buf[i];
  for (; e < n; ++e) sum += a[e] * b[e];
  return sum;
}

// The score tile st (m, ld) = qt (m, E) K[j0 : j0 + n]^T, K rows at k with strides (rs, cs).
// Up to kDirectRows query rows (decoding: L = 1) read each key row in place (converted
// through krow (E) when it is not a contiguous row of T): packing K^T for the
// micro-kernel would cost more than such a product. More rows pack K^T into kt (E, ld).
constexpr int64_t kDirectRows = 2;

template <typename scalar_t, typename T>
inline void score_tile(T* st, int64_t ld, const T* qt, int64_t m, int64_t E, const scalar_t* k, int64_t rs,
                       int64_t cs, int64_t n, T* kt, T* krow) {
  if (m > kDirectRows) {
    pack_transposed(kt, ld, k, rs, cs, n, E);
    gemm<T>(m, ld, E, T(1), qt, E, 1, kt, ld, false, st, ld);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = krow;
    if constexpr (std::is_same_v<scalar_t, T>) {
      if (cs == 1) kr = k + j * rs;
    }
    if (kr == krow) load_row(krow, k + j * rs, E, cs, T(1), E);
    for (int64_t r = 0; r < m; ++r) st[r * ld + j] = dot_product(qt + r * E, kr, E);
  }
}

// ---------------------------------------------------------------------------
// Masking of one row of a score tile. Shared by forward and backward so that
// they cannot disagree: scores s[0, n) of query row i against keys j0 + j get
// the additive mask added, or -inf where the bool mask says no or the key is
// past the causal bound; s[n, n_padded) become -inf.
// ---------------------------------------------------------------------------
template <typename scalar_t, typename T>
inline void mask_score_row(const AttnParams& p, T* s, int64_t n, int64_t n_padded,
                           int64_t b, int64_t h, int64_t i, int64_t j0) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  if (p.mask_kind != MaskKind::None) {
    const int64_t offset = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] +
                           j0 * p.mask_stride[3];
    const int64_t sj = p.mask_stride[3];
    if (p.mask_kind == MaskKind::Additive) {
      const scalar_t* m = static_cast<const scalar_t*>(p.mask) + offset;
      if (sj == 1) {
        for (int64_t j = 0; j < n; ++j) s[j] += static_cast<T>(m[j]);
      } else {
        for (int64_t j = 0; j < n; ++j) s[j] += static_cast<T>(m[j * sj]);
      }
    } else {
      const bool* m = static_cast<const bool*>(p.mask) + offset;
      for (int64_t j = 0; j < n; ++j)
        if (!m[j * sj]) s[j] = kNegInf;
    }
  }
  if (p.causal) {
    const int64_t visible = causal_key_end(p, i) - j0;
    for (int64_t j = std::max<int64_t>(visible, 0); j < n; ++j) s[j] = kNegInf;
  }
  for (int64_t j = n; j < n_padded; ++j) s[j] = kNegInf;
}

// The dropout of one call: keep iff the element's random number >= threshold.
template <typename T>
struct Dropout {
  bool on;
  uint32_t threshold;
  T keep_scale;  // 1 / (1 - p)
  explicit Dropout(const AttnParams& p)
      : on(p.dropout_p > 0.0),
        threshold(dropout_threshold(p.dropout_p)),
        keep_scale(on ? static_cast<T>(1.0 / (1.0 - p.dropout_p)) : T(1)) {}
};

// Row i of a score tile (keys j0 + j, already masked) to probabilities, given
// the row's log-sum-exp: s = exp(s - lse). With dropout, z = s * keep / (1 - p)
// (z may be s itself) and, when dz is given, dz *= keep / (1 - p) likewise.
// Shared by the backward and the explicit-probabilities forward.
template <typename T>
inline void probabilities_row(const AttnParams& p, const Dropout<T>& drop, T* s, T* z, T* dz, int64_t n,
                              int64_t np, T row_lse, int64_t b, int64_t h, int64_t i, int64_t j0) {
  exp_shift_sum(s, np, row_lse);
  if (!drop.on) return;
  DropoutRowStream rng(p.seed, dropout_row(p, b, h, i), j0);
  for (int64_t j = 0; j < n; ++j) {
    const bool keep = rng.next() >= drop.threshold;
    z[j] = keep ? s[j] * drop.keep_scale : T(0);
    if (dz != nullptr) dz[j] = keep ? dz[j] * drop.keep_scale : T(0);
  }
  for (int64_t j = n; j < np; ++j) z[j] = T(0);
}

// ---------------------------------------------------------------------------
// Forward. With p.probs set (the attention_probs op) there is no V: the first
// pass only finds each row's log-sum-exp and a second pass writes the
// probabilities.
// ---------------------------------------------------------------------------
template <typename scalar_t>
void forward_kernel(const AttnParams& p) {
  using T = acc_t<scalar_t>;
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  const int64_t B = p.B, Hq = p.Hq, L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const int64_t group = Hq / p.Hkv;
  const Tiles tiles = forward_tiles(L);
  const int64_t q_block = tiles.q;
  const int64_t n_qblocks = ceil_div(L, q_block);
  const int64_t kv_block = std::min(tiles.kv, round_up(std::max<int64_t>(S, 1), VS));
  const int64_t Evp = round_up(Ev, VS);
  const T scale = static_cast<T>(p.scale);
  const Dropout<T> drop(p);
  const bool write_probs = p.probs != nullptr;

  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  auto* out = static_cast<scalar_t*>(p.out);
  auto* lse = static_cast<T*>(p.lse);
  auto* probs = static_cast<scalar_t*>(p.probs);
  // V can be read in place when it already is the tile the micro-kernel wants.
  const bool v_direct = !write_probs && std::is_same_v<scalar_t, T> && p.v_stride[3] == 1 && Ev % VS == 0;

  at::parallel_for(0, B * Hq * n_qblocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> qt(q_block * std::max<int64_t>(E, 1));
    std::vector<T> kt(std::max<int64_t>(E, 1) * kv_block);
    std::vector<T> vt(v_direct || write_probs ? 0 : kv_block * Evp);
    std::vector<T> st(q_block * kv_block);
    std::vector<T> ot(write_probs ? 0 : q_block * Evp);
    std::vector<T> krow(std::max<int64_t>(E, 1));
    T row_m[kMaxQTile];
    T row_l[kMaxQTile];

    for (int64_t task = begin; task < end; ++task) {
      const int64_t qb = task % n_qblocks;
      const int64_t h = (task / n_qblocks) % Hq;
      const int64_t b = task / (n_qblocks * Hq);
      const int64_t hk = h / group;
      const int64_t i0 = qb * q_block;
      const int64_t m = std::min(q_block, L - i0);
      // Rows see keys [0, causal_key_end(row)), which grows with the row.
      const int64_t kv_end = causal_key_end(p, i0 + m - 1);

      const scalar_t* q_bh = q + b * p.q_stride[0] + h * p.q_stride[1];
      const scalar_t* k_bh = k + b * p.k_stride[0] + hk * p.k_stride[1];
      const scalar_t* v_bh = write_probs ? nullptr : v + b * p.v_stride[0] + hk * p.v_stride[1];
      for (int64_t r = 0; r < m; ++r)
        load_row(qt.data() + r * E, q_bh + (i0 + r) * p.q_stride[2], E, p.q_stride[3], scale, E);
      std::fill(ot.begin(), ot.end(), T(0));
      std::fill(row_m, row_m + m, kNegInf);
      std::fill(row_l, row_l + m, T(0));

      for (int64_t j0 = 0; j0 < kv_end; j0 += kv_block) {
        const int64_t n = std::min(kv_block, kv_end - j0);
        const int64_t np = round_up(n, VS);
        // S = (scale Q) K^T
        score_tile(st.data(), np, qt.data(), m, E, k_bh + j0 * p.k_stride[2], p.k_stride[2], p.k_stride[3], n,
                   kt.data(), krow.data());
        const T* vtile = vt.data();
        int64_t ldv = Evp;
        if constexpr (std::is_same_v<scalar_t, T>) {
          if (v_direct) {
            vtile = v_bh + j0 * p.v_stride[2];
            ldv = p.v_stride[2];
          }
        }
        if (!v_direct && !write_probs) {
          for (int64_t j = 0; j < n; ++j)
            load_row(vt.data() + j * Evp, v_bh + (j0 + j) * p.v_stride[2], Ev, p.v_stride[3], T(1), Evp);
        }

        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          T* s = st.data() + r * np;
          mask_score_row<scalar_t, T>(p, s, n, np, b, h, i, j0);
          const T m_new = std::max(row_m[r], row_max(s, np));
          if (m_new == kNegInf) {  // no visible key yet in this row
            std::fill(s, s + np, T(0));
            continue;
          }
          const T correction = std::exp(row_m[r] - m_new);  // 0 when row_m was -inf
          row_l[r] = row_l[r] * correction + exp_shift_sum(s, np, m_new);
          row_m[r] = m_new;
          if (write_probs) continue;
          if (correction != T(1)) scale_row(ot.data() + r * Evp, Evp, correction);
          if (drop.on) {
            DropoutRowStream rng(p.seed, dropout_row(p, b, h, i), j0);
            for (int64_t j = 0; j < n; ++j)
              if (rng.next() < drop.threshold) s[j] = T(0);
          }
        }
        // O += P V
        if (!write_probs) gemm<T>(m, Evp, n, T(1), st.data(), np, 1, vtile, ldv, true, ot.data(), Evp);
      }

      T* lse_bh = lse + (b * Hq + h) * L;
      for (int64_t r = 0; r < m; ++r) {
        // l == 0 only when the row saw no key: output 0, log-sum-exp -inf.
        const T l = row_l[r];
        lse_bh[i0 + r] = l > T(0) ? row_m[r] + std::log(l) : kNegInf;
      }
      if (!write_probs) {
        scalar_t* o_bh = out + b * p.o_stride[0] + h * p.o_stride[1];
        for (int64_t r = 0; r < m; ++r) {
          const T l = row_l[r];
          const T inv = l > T(0) ? drop.keep_scale / l : T(0);
          store_row(o_bh + (i0 + r) * p.o_stride[2], p.o_stride[3], ot.data() + r * Evp, Ev, inv);
        }
        continue;
      }

      // Second pass of attention_probs: P = exp(S - lse), dropped, written out.
      scalar_t* p_bh = probs + b * p.probs_stride[0] + h * p.probs_stride[1];
      for (int64_t j0 = 0; j0 < S; j0 += kv_block) {
        const int64_t n = std::min(kv_block, S - j0);
        const int64_t np = round_up(n, VS);
        if (j0 < kv_end) {
          score_tile(st.data(), np, qt.data(), m, E, k_bh + j0 * p.k_stride[2], p.k_stride[2], p.k_stride[3], n,
                     kt.data(), krow.data());
        }
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          T* s = st.data() + r * np;
          if (j0 >= kv_end || lse_bh[i] == kNegInf) {
            std::fill(s, s + np, T(0));
          } else {
            mask_score_row<scalar_t, T>(p, s, n, np, b, h, i, j0);
            probabilities_row(p, drop, s, s, static_cast<T*>(nullptr), n, np, lse_bh[i], b, h, i, j0);
          }
          store_row(p_bh + i * p.probs_stride[2] + j0 * p.probs_stride[3], p.probs_stride[3], s, n, T(1));
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Backward
//   D_i  = sum_e dO_ie O_ie - dlse_i
//   P    = exp(S - lse),  Z = P * keep / (1 - p)
//   dV  += Z^T dO,  dP = (dO V^T) * keep / (1 - p),  dS = P * (dP - D)
//   dQ  += scale dS K,  dK += scale dS^T Q,  dmask += dS
// ---------------------------------------------------------------------------
template <typename scalar_t>
void backward_kernel(const AttnBwdParams& p) {
  using T = acc_t<scalar_t>;
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  const int64_t B = p.B, Hq = p.Hq, Hkv = p.Hkv, L = p.L, S = p.S, E = p.E, Ev = p.Ev;
  const int64_t group = Hq / Hkv;
  const Tiles tiles = backward_tiles();
  const int64_t q_block = tiles.q;
  const int64_t kv_block = std::min(tiles.kv, round_up(std::max<int64_t>(S, 1), VS));
  const int64_t Ep = round_up(std::max<int64_t>(E, 1), VS);
  const int64_t Evp = round_up(std::max<int64_t>(Ev, 1), VS);
  const T scale = static_cast<T>(p.scale);
  const Dropout<T> drop(p);
  const bool dropout = drop.on;
  // attention_probs' backward: the gradient comes for the probabilities.
  const bool from_probs = p.dprobs != nullptr;

  const auto* q = static_cast<const scalar_t*>(p.q);
  const auto* k = static_cast<const scalar_t*>(p.k);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* o = static_cast<const scalar_t*>(p.out);
  const auto* dout = static_cast<const scalar_t*>(p.dout);
  const auto* probs = static_cast<const scalar_t*>(p.probs);
  const auto* dprobs = static_cast<const scalar_t*>(p.dprobs);
  const auto* lse = static_cast<const T*>(p.lse);
  const auto* dlse = static_cast<const T*>(p.dlse);
  auto* dq = static_cast<scalar_t*>(p.dq);
  auto* dk = static_cast<scalar_t*>(p.dk);
  auto* dv = static_cast<scalar_t*>(p.dv);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> qt(q_block * Ep);       // scale Q tile, (m, Ep)
    std::vector<T> dot(q_block * Evp);     // dO tile, (m, Evp)
    std::vector<T> kt(E * kv_block);       // K^T tile, (E, np)
    std::vector<T> kn(kv_block * Ep);      // K tile, (n, Ep)
    std::vector<T> vt(Ev * kv_block);      // V^T tile, (Ev, np)
    std::vector<T> pt(q_block * kv_block); // P tile
    std::vector<T> zt(dropout ? q_block * kv_block : 0);  // dropped P tile
    std::vector<T> dst(q_block * kv_block);  // dP, then dS
    std::vector<T> dk_acc(kv_block * Ep);
    std::vector<T> dv_acc(kv_block * Evp);
    std::vector<T> dq_acc(group * L * Ep);
    std::vector<T> delta(group * L);
    T* dmask = nullptr;
    if (p.dmask != nullptr)
      dmask = static_cast<T*>(p.dmask) + (p.dmask_per_thread ? at::get_thread_num() * p.dmask_numel : 0);

    for (int64_t task = begin; task < end; ++task) {
      const int64_t hk = task % Hkv;
      const int64_t b = task / Hkv;
      const scalar_t* k_bh = k + b * p.k_stride[0] + hk * p.k_stride[1];
      const scalar_t* v_bh = from_probs ? nullptr : v + b * p.v_stride[0] + hk * p.v_stride[1];

      // D for every row of the group's query heads: rowsum(dO * O), which
      // equals rowsum(dZ * Z) for the explicit probabilities Z.
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        for (int64_t i = 0; i < L; ++i) {
          T d = 0;
          if (from_probs) {
            const scalar_t* zrow = probs + b * p.probs_stride[0] + h * p.probs_stride[1] + i * p.probs_stride[2];
            const scalar_t* drow = dprobs + b * p.dprobs_stride[0] + h * p.dprobs_stride[1] + i * p.dprobs_stride[2];
            for (int64_t j = 0; j < S; ++j)
              d += static_cast<T>(zrow[j * p.probs_stride[3]]) * static_cast<T>(drow[j * p.dprobs_stride[3]]);
          } else {
            const scalar_t* orow = o + b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
            const scalar_t* drow = dout + b * p.do_stride[0] + h * p.do_stride[1] + i * p.do_stride[2];
            for (int64_t e = 0; e < Ev; ++e)
              d += static_cast<T>(orow[e * p.o_stride[3]]) * static_cast<T>(drow[e * p.do_stride[3]]);
          }
          if (dlse != nullptr) d -= dlse[(b * Hq + h) * L + i];
          delta[g * L + i] = d;
        }
      }
      std::fill(dq_acc.begin(), dq_acc.end(), T(0));

      for (int64_t j0 = 0; j0 < S; j0 += kv_block) {
        const int64_t n = std::min(kv_block, S - j0);
        const int64_t np = round_up(n, VS);
        const scalar_t* k_tile = k_bh + j0 * p.k_stride[2];
        pack_transposed(kt.data(), np, k_tile, p.k_stride[2], p.k_stride[3], n, E);
        if (!from_probs)
          pack_transposed(vt.data(), np, v_bh + j0 * p.v_stride[2], p.v_stride[2], p.v_stride[3], n, Ev);
        for (int64_t j = 0; j < n; ++j)
          load_row(kn.data() + j * Ep, k_tile + j * p.k_stride[2], E, p.k_stride[3], T(1), Ep);
        std::fill(dk_acc.begin(), dk_acc.begin() + n * Ep, T(0));
        std::fill(dv_acc.begin(), dv_acc.begin() + n * Evp, T(0));

        for (int64_t g = 0; g < group; ++g) {
          const int64_t h = hk * group + g;
          const scalar_t* q_bh = q + b * p.q_stride[0] + h * p.q_stride[1];
          const scalar_t* do_bh = from_probs ? nullptr : dout + b * p.do_stride[0] + h * p.do_stride[1];
          const T* lse_bh = lse + (b * Hq + h) * L;
          for (int64_t i0 = 0; i0 < L; i0 += q_block) {
            const int64_t m = std::min(q_block, L - i0);
            if (causal_key_end(p, i0 + m - 1) <= j0) continue;  // no row of this block sees these keys
            for (int64_t r = 0; r < m; ++r)
              load_row(qt.data() + r * Ep, q_bh + (i0 + r) * p.q_stride[2], E, p.q_stride[3], scale, Ep);
            // S = (scale Q) K^T, dZ = dO V^T (or the given gradient of the probabilities)
            gemm<T>(m, np, E, T(1), qt.data(), Ep, 1, kt.data(), np, false, pt.data(), np);
            if (from_probs) {
              for (int64_t r = 0; r < m; ++r)
                load_row(dst.data() + r * np,
                         dprobs + b * p.dprobs_stride[0] + h * p.dprobs_stride[1] + (i0 + r) * p.dprobs_stride[2] +
                             j0 * p.dprobs_stride[3],
                         n, p.dprobs_stride[3], T(1), np);
            } else {
              for (int64_t r = 0; r < m; ++r)
                load_row(dot.data() + r * Evp, do_bh + (i0 + r) * p.do_stride[2], Ev, p.do_stride[3], T(1), Evp);
              gemm<T>(m, np, Ev, T(1), dot.data(), Evp, 1, vt.data(), np, false, dst.data(), np);
            }

            for (int64_t r = 0; r < m; ++r) {
              const int64_t i = i0 + r;
              T* s = pt.data() + r * np;
              T* ds = dst.data() + r * np;
              const T row_lse = lse_bh[i];
              if (row_lse == kNegInf) {  // fully masked row: no probability, no gradient
                std::fill(s, s + np, T(0));
                std::fill(ds, ds + np, T(0));
                if (dropout) std::fill(zt.data() + r * np, zt.data() + (r + 1) * np, T(0));
                continue;
              }
              mask_score_row<scalar_t, T>(p, s, n, np, b, h, i, j0);
              probabilities_row(p, drop, s, dropout ? zt.data() + r * np : nullptr, ds, n, np, row_lse, b, h, i, j0);
              const Vec d(delta[g * L + i]);
              for (int64_t j = 0; j < np; j += VS)
                (Vec::loadu(s + j) * (Vec::loadu(ds + j) - d)).store(ds + j);
              if (dmask != nullptr) {
                T* dm = dmask + b * p.dmask_stride[0] + h * p.dmask_stride[1] + i * p.dmask_stride[2] +
                        j0 * p.dmask_stride[3];
                for (int64_t j = 0; j < n; ++j) dm[j * p.dmask_stride[3]] += ds[j];
              }
            }
            const T* z = dropout ? zt.data() : pt.data();
            // dV += Z^T dO ; dQ += scale dS K ; dK += dS^T (scale Q)
            if (!from_probs) gemm<T>(n, Evp, m, T(1), z, 1, np, dot.data(), Evp, true, dv_acc.data(), Evp);
            gemm<T>(m, Ep, n, scale, dst.data(), np, 1, kn.data(), Ep, true,
                    dq_acc.data() + (g * L + i0) * Ep, Ep);
            gemm<T>(n, Ep, m, T(1), dst.data(), 1, np, qt.data(), Ep, true, dk_acc.data(), Ep);
          }
        }

        scalar_t* dk_bh = dk + b * p.dk_stride[0] + hk * p.dk_stride[1];
        for (int64_t j = 0; j < n; ++j)
          store_row(dk_bh + (j0 + j) * p.dk_stride[2], p.dk_stride[3], dk_acc.data() + j * Ep, E, T(1));
        if (!from_probs) {
          scalar_t* dv_bh = dv + b * p.dv_stride[0] + hk * p.dv_stride[1];
          for (int64_t j = 0; j < n; ++j)
            store_row(dv_bh + (j0 + j) * p.dv_stride[2], p.dv_stride[3], dv_acc.data() + j * Evp, Ev, T(1));
        }
      }

      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = hk * group + g;
        scalar_t* dq_bh = dq + b * p.dq_stride[0] + h * p.dq_stride[1];
        for (int64_t i = 0; i < L; ++i)
          store_row(dq_bh + i * p.dq_stride[2], p.dq_stride[3], dq_acc.data() + (g * L + i) * Ep, E, T(1));
      }
    }
  });
}

template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float32: fn(float{}); break;
    case DType::Float64: fn(double{}); break;
    case DType::BFloat16: fn(c10::BFloat16{}); break;
    case DType::Float16: fn(c10::Half{}); break;
  }
}

void attention_forward(const AttnParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { forward_kernel<decltype(tag)>(params); });
}

void attention_backward(const AttnBwdParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { backward_kernel<decltype(tag)>(params); });
}

}  // namespace attn_ext::cpu::CPU_CAPABILITY
