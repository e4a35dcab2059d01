// attn_ext: fused attention on the CPU, forward and backward.
//
// Included once per instruction set by attention_kernel_<isa>.cpp, which
// defines CPU_CAPABILITY (DEFAULT, AVX2, AVX512: at::vec's choice of code)
// before including it; every symbol lands in attn_ext::cpu::ATTN_EXT_KERNEL_NS,
// which is CPU_CAPABILITY unless the unit names another (the amx unit).
//
// Method (FlashAttention-2 on the CPU): an ISA-neutral driver over a small
// products class. The queries are cut into blocks of rows and the keys into
// blocks (BlockSizes, in kernels.h); one forward task is one (batch, head, query
// block). For each key block the products class computes the scores S, the
// driver masks them and updates the running row max and row sum (online
// softmax), and the products class adds P V into an output tile kept in the
// accumulation type. No L x S buffer exists. The backward recomputes
// P = exp(S - lse) tile by tile, one task per (batch, key/value head, chunk of
// key blocks), and accumulates dQ, dK, dV in the accumulation type.
// VecForwardProducts / VecBackwardProducts (below) compute with at::vec in
// float32 (float64 for float64), converting float16/bfloat16 rows a vector at
// a time; the amx unit adds bfloat16 products on AMX tiles.
#pragma once

#ifndef CPU_CAPABILITY
#error "define CPU_CAPABILITY before including attention_kernel_impl.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr: FlushSubnormals
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../attention_math.h"
#include "kernels.h"
#include "prefetch.h"
#if defined(CPU_CAPABILITY_AVX512)
#include "lane_sums.h"
#endif

#ifndef ATTN_EXT_KERNEL_NS
#define ATTN_EXT_KERNEL_NS CPU_CAPABILITY
#endif

namespace attn_ext::cpu::ATTN_EXT_KERNEL_NS {

using at::vec::Vectorized;


// Micro-kernel register blocking: kGemmRows rows x kGemmVecs vectors of
// accumulators, plus kGemmVecs vectors of B and one broadcast of A. AVX-512
// has 32 vector registers: 6 x 4 = 24 accumulators (64 columns, a head dim or
// a key tile); AVX2 16: 6 x 2 = 12. Six rows keep A's row pointers in general
// registers (twelve spilled them).
constexpr int kGemmRows = 6;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kGemmVecs = 4;
#else
constexpr int kGemmVecs = 2;
#endif

// Tile sizes: BlockSizes, forward_blocks and backward_blocks in kernels.h (build_info reports them).

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Row i of head h of batch b of a (B, H, rows, cols) tensor read through its strides.
template <typename T>
inline const T* row_at(const void* base, const int64_t (&stride)[4], int64_t b, int64_t h, int64_t i) {
  return static_cast<const T*>(base) + b * stride[0] + h * stride[1] + i * stride[2];
}

// The packed K^T / V panels a thread keeps of one (batch, kv head), one slot per
// key block, while they fit: slot() says where block blk goes and forgets the
// panels when the head changes; k / v say which slots hold packed panels.
// Uncached (too large), every block uses slot 0 and is packed each time.
struct PanelCache {
  bool on = false;
  int64_t blocks = 0, head = -1;
  std::vector<bool> k, v;

  int64_t slot(int64_t new_head, int64_t blk) {
    if (!on) return 0;
    if (new_head != head) {
      head = new_head;
      k.assign(blocks, false);
      v.assign(blocks, false);
    }
    return blk;
  }
  bool packed(const std::vector<bool>& which, int64_t slot) const { return on && which[slot]; }
  void mark(std::vector<bool>& which, int64_t slot) {
    if (on) which[slot] = true;
  }
};

// Tile buffers start on a cache line (an AMX tile row is one line when its width is).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* ptr, size_t) { ::operator delete(ptr, std::align_val_t(64)); }
  bool operator==(const CacheLineAllocator&) const { return true; }
  bool operator!=(const CacheLineAllocator&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, CacheLineAllocator<T>>;
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
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec(T(0));
  for (int64_t kk = 0; kk < K; ++kk) {
    const T* brow = b + kk * ldb;
    Vec bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = Vec::loadu(brow + v * VS);
    const T* acol = a + kk * a_cs;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const Vec av(acol[r * a_rs]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(av, bv[v], acc[r][v]);
    }
  }
  const Vec valpha(alpha);
#pragma GCC unroll 16
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

// The last M % kGemmRows rows of a strip: one micro-kernel of exactly that height.
template <typename T, int NV, int R>
inline void gemm_tail(int64_t rows, int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs, const T* b,
                      int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) return gemm_micro<T, R, NV>(K, alpha, a, a_rs, a_cs, b, ldb, accumulate, c, ldc);
    gemm_tail<T, NV, R - 1>(rows, K, alpha, a, a_rs, a_cs, b, ldb, accumulate, c, ldc);
  }
}

template <typename T, int NV>
inline void gemm_strip(int64_t M, int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs,
                       const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  int64_t m = 0;
  for (; m + kGemmRows <= M; m += kGemmRows)
    gemm_micro<T, kGemmRows, NV>(K, alpha, a + m * a_rs, a_rs, a_cs, b, ldb, accumulate, c + m * ldc, ldc);
  gemm_tail<T, NV, kGemmRows - 1>(M - m, K, alpha, a + m * a_rs, a_rs, a_cs, b, ldb, accumulate, c + m * ldc, ldc);
}

template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, T alpha, const T* a, int64_t a_rs, int64_t a_cs,
          const T* b, int64_t ldb, bool accumulate, T* c, int64_t ldc) {
  constexpr int64_t VS = Vectorized<T>::size();
  int64_t n = 0;
  for (; n + kGemmVecs * VS <= N; n += kGemmVecs * VS)
    gemm_strip<T, kGemmVecs>(M, K, alpha, a, a_rs, a_cs, b + n, ldb, accumulate, c + n, ldc);
  if constexpr (kGemmVecs > 2) {
    if (n + 2 * VS <= N) {
      gemm_strip<T, 2>(M, K, alpha, a, a_rs, a_cs, b + n, ldb, accumulate, c + n, ldc);
      n += 2 * VS;
    }
  }
  for (; n < N; n += VS) gemm_strip<T, 1>(M, K, alpha, a, a_rs, a_cs, b + n, ldb, accumulate, c + n, ldc);
}

// Products whose row r needs only columns [first + r, reach + r) (causal, a
// window's two sides), counted from column 0 of the product (either end may
// be negative or past the end; kOpenFirst leaves the left side open). `valid`
// of the N columns are real (the rest pad to the vector width); reach >= valid
// means every row needs every column up to N.
constexpr int64_t kOpenFirst = -(int64_t(1) << 60);

// The band's blocks. Row r of a tile sees columns [first + r, reach + r) of its n
// (first <= -r and reach >= n - r leave that side open; kOpenFirst and
// -kOpenFirst always do). Products over a band skip the blocks of rows and
// columns no row of theirs sees: band_columns gives the columns rows [r0, r1)
// see, band_rows the rows (of m) that see columns [c0, c1), both widened to
// multiples of `align` and kept within round_up(n or m, align); begin == end
// when there are none. The at::vec products take 6-row groups (align 1, or the
// vector width for score columns), the bfloat16 ones 16- and 32-row blocks.
inline KeyRange band_columns(int64_t first, int64_t reach, int64_t r0, int64_t r1, int64_t n, int64_t align = 1) {
  const int64_t begin = std::clamp<int64_t>(first + r0, 0, n) / align * align;
  const int64_t end = round_up(std::clamp<int64_t>(reach + r1 - 1, 0, n), align);
  return KeyRange{begin, std::max(begin, end)};
}

inline KeyRange band_rows(int64_t first, int64_t reach, int64_t c0, int64_t c1, int64_t m, int64_t align = 1) {
  const int64_t begin = std::clamp<int64_t>(c0 - reach + 1, 0, m) / align * align;
  const int64_t end = round_up(std::clamp<int64_t>(c1 - first, 0, m), align);
  return KeyRange{begin, std::max(begin, end)};
}

// C (M x N, ldc) = A (M x K, row-major, lda) B (K x N, ldb), row r written from
// whole vectors before first + r to whole vectors past its reach: without a
// left side the columns every row needs in whole gemm strips, then each
// micro-kernel row group's up to its last row's reach; with one, each row
// group's own columns. The rest of a row is left unwritten.
template <typename T>
void gemm_to_reach(int64_t M, int64_t N, int64_t valid, int64_t reach, int64_t K, const T* a, int64_t lda,
                   const T* b, int64_t ldb, T* c, int64_t ldc, int64_t first = kOpenFirst) {
  constexpr int64_t VS = Vectorized<T>::size();
  constexpr int64_t kStrip = kGemmVecs * VS;
  auto end_of = [&](int64_t r0, int64_t rows) {  // the columns rows [r0, r0 + rows) need end here
    return reach >= valid ? N : std::min(N, band_columns(first, reach, r0, r0 + rows, valid, VS).end);
  };
  if (first + (M - 1) >= VS) {  // some row group starts a vector or more in
    for (int64_t r0 = 0; r0 < M; r0 += kGemmRows) {
      const int64_t rows = std::min<int64_t>(kGemmRows, M - r0);
      const int64_t begin = band_columns(first, reach, r0, r0 + rows, valid, VS).begin, end = end_of(r0, rows);
      if (end > begin)
        gemm<T>(rows, end - begin, K, T(1), a + r0 * lda, lda, 1, b + begin, ldb, false, c + r0 * ldc + begin, ldc);
    }
    return;
  }
  const int64_t full = reach >= valid ? N : std::clamp<int64_t>(reach / kStrip * kStrip, 0, N);
  gemm<T>(M, full, K, T(1), a, lda, 1, b, ldb, false, c, ldc);
  for (int64_t r0 = 0; full < N && r0 < M; r0 += kGemmRows) {
    const int64_t rows = std::min<int64_t>(kGemmRows, M - r0);
    const int64_t cols = end_of(r0, rows);
    if (cols > full)
      gemm<T>(rows, cols - full, K, T(1), a + r0 * lda, lda, 1, b + full, ldb, false, c + r0 * ldc + full, ldc);
  }
}

// C (M x N, ldc) += alpha A (M x n, row-major, lda) B (n x N, ldb) where row r of A
// is 0 outside columns [first + r, reach + r): each micro-kernel row group sums
// only the rows of B from its first row's first to its last row's reach.
template <typename T>
void gemm_add_to_reach(int64_t M, int64_t N, int64_t n, int64_t reach, T alpha, const T* a, int64_t lda,
                       const T* b, int64_t ldb, T* c, int64_t ldc, int64_t first = kOpenFirst) {
  if (reach >= n && first + (M - 1) <= 0) return gemm<T>(M, N, n, alpha, a, lda, 1, b, ldb, true, c, ldc);
  for (int64_t r0 = 0; r0 < M; r0 += kGemmRows) {
    const int64_t rows = std::min<int64_t>(kGemmRows, M - r0);
    const KeyRange keys = band_columns(first, reach, r0, r0 + rows, n);
    if (keys.end > keys.begin)
      gemm<T>(rows, N, keys.end - keys.begin, alpha, a + r0 * lda + keys.begin, lda, 1, b + keys.begin * ldb, ldb,
              true, c + r0 * ldc, ldc);
  }
}

// ---------------------------------------------------------------------------
// Row helpers (n is a multiple of the vector width)
// ---------------------------------------------------------------------------
template <typename T>
inline T hsum(const Vectorized<T>& x) {
  return at::vec::vec_reduce_all<T>([](const auto& a, const auto& b) { return a + b; }, x);
}

// The exponential of the softmax, and a maximum for the row max, per ISA.
// FastExp<T>::apply(x) is e^x, or 2^x where base2 (the caller then scales its
// argument by log2(e)). On AVX-512 and AVX2 (float) it is 2^x: x = n + f with n
// an integer and |f| <= 1/2, 2^f by its degree-6 Taylor polynomial (relative
// error < 2e-7), times 2^n (vscalefps on AVX-512; the exponent bits on AVX2);
// x < -126 gives exactly 0, never a subnormal. -inf gives 0 and NaN stays NaN. About half
// the instructions of at::vec's exp_u20, which matters: the softmax's
// exponentials cost as much as the AMX products. Elsewhere (DEFAULT, float64)
// at::vec's exp. fast_max skips a NaN in x: the row max ignores NaN scores,
// which still reach the output through their exponentials (and a row of
// nothing but NaN is caught by the driver).
template <typename T>
struct FastExp {
  static constexpr bool base2 = false;
  static Vectorized<T> apply(const Vectorized<T>& x) {
    if constexpr (std::is_same_v<T, float>) return x.exp_u20();
    return x.exp();
  }
};
template <typename T>
inline Vectorized<T> fast_max(const Vectorized<T>& x, const Vectorized<T>& acc) {
  return Vectorized<T>::blendv(acc, x, x > acc);  // a NaN x compares false: acc stays
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#if defined(CPU_CAPABILITY_AVX512)
using SimdF = __m512;
#define ATTN_EXT_PS(op) _mm512_##op##_ps
#else
using SimdF = __m256;
#define ATTN_EXT_PS(op) _mm256_##op##_ps
#endif
template <>
struct FastExp<float> {
  static constexpr bool base2 = true;
  static Vectorized<float> apply(const Vectorized<float>& x) {
  // Clamped below at -126 (max(a, NaN) = NaN) and set to 0 under it, so that no
  // result is subnormal: a masked score (-inf) is common with windows, and
  // subnormal results and sums cost a microcode assist each (measured: a third
  // of a windowed forward's time when vscalefps went down to 2^-150).
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 normal = _mm512_cmp_ps_mask(SimdF(x), _mm512_set1_ps(-126.f), _CMP_NLT_UQ);  // or NaN
  const SimdF t = _mm512_max_ps(_mm512_set1_ps(-126.f), SimdF(x));
  const SimdF n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const SimdF under = _mm256_cmp_ps(SimdF(x), _mm256_set1_ps(-126.f), _CMP_LT_OQ);
  const SimdF t = _mm256_max_ps(_mm256_set1_ps(-126.f), SimdF(x));
  const SimdF n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  const SimdF f = ATTN_EXT_PS(sub)(t, n);
  SimdF q = ATTN_EXT_PS(set1)(1.5403486e-4f);                   // ln2^6 / 6!
  q = ATTN_EXT_PS(fmadd)(q, f, ATTN_EXT_PS(set1)(1.3333558e-3f));  // ln2^5 / 5!
  q = ATTN_EXT_PS(fmadd)(q, f, ATTN_EXT_PS(set1)(9.6181291e-3f));  // ln2^4 / 4!
  q = ATTN_EXT_PS(fmadd)(q, f, ATTN_EXT_PS(set1)(5.5504109e-2f));  // ln2^3 / 3!
  q = ATTN_EXT_PS(fmadd)(q, f, ATTN_EXT_PS(set1)(2.4022651e-1f));  // ln2^2 / 2!
  q = ATTN_EXT_PS(fmadd)(q, f, ATTN_EXT_PS(set1)(6.9314718e-1f));  // ln2
  q = ATTN_EXT_PS(fmadd)(q, f, ATTN_EXT_PS(set1)(1.f));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_scalef_ps(normal, q, n);
#else
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(q, _mm256_castsi256_ps(pow2n)));
#endif
  }
};
template <>
inline Vectorized<float> fast_max<float>(const Vectorized<float>& x, const Vectorized<float>& acc) {
  return ATTN_EXT_PS(max)(SimdF(x), SimdF(acc));
}
#undef ATTN_EXT_PS
#endif

// cap * tanh(y) for the softcap, with FastExp, in three tiers, each at most
// 1.2 ulp from tanh in float: below |y| = 0.25 an odd polynomial of degree 7
// fitted to tanh there (3 FMAs), below 0.55 one of degree 11 (5 FMAs), their
// coefficients times cap; above, cap (e - 1) / (e + 1) with e = exp(2|y|) and
// the sign restored (|y| clamped at 9, where tanh is 1 in float). A vector
// whose |y| are all below a tier's bound returns from it (AVX-512 and AVX2): with
// a softcap well above the scores (30 or 50 against scores of a few units) every
// vector stops at the first. The exponential and the division cost as much as
// the rest of the forward (Xeon, 4x8x1024x64 causal float32: softcap 0.52x ->
// 0.91x the plain kernel with the 0.55 tier). NaN stays NaN. Where FastExp is
// at::vec's exp (DEFAULT, float64), at::vec's tanh. CappedTanh(cap)(y) is cap tanh(y).
template <typename T>
class CappedTanh {
 public:
  using Vec = Vectorized<T>;
  // The coefficients times cap, broadcast once (the compiler does not hoist them out of a row loop).
  explicit CappedTanh(T cap) : cap_(cap) {
    for (int c = 0; c < 4; ++c) fit7_[c] = Vec(static_cast<T>(kFit7[c] * cap));
    for (int c = 0; c < 6; ++c) fit11_[c] = Vec(static_cast<T>(kFit11[c] * cap));
  }

  Vec operator()(const Vec& y) const {
    if constexpr (!FastExp<T>::base2) {
      return y.tanh() * cap_;
    } else {
      const Vec y2 = y * y;
      if (all_below(y2, 0.25f * 0.25f)) {
        Vec poly = fit7_[0];
        for (int c = 1; c < 4; ++c) poly = at::vec::fmadd(poly, y2, fit7_[c]);
        return y * poly;
      }
      Vec poly = fit11_[0];
      for (int c = 1; c < 6; ++c) poly = at::vec::fmadd(poly, y2, fit11_[c]);
      const Vec small = y * poly;
      if (all_below(y2, 0.55f * 0.55f)) return small;
      const Vec a = y.abs();
      const Vec e = FastExp<T>::apply(at::vec::minimum(a, Vec(T(9))) * Vec(T(2 * 1.4426950408889634)));
      const Vec big = (e - Vec(T(1))) / (e + Vec(T(1))) * cap_;
      const Vec signed_big = Vec::blendv(big, Vec(T(0)) - big, y < Vec(T(0)));
      return Vec::blendv(signed_big, small, a < Vec(T(0.55)));
    }
  }

 private:
  // cap tanh(y) / y in powers of y^2, highest first: fits to tanh on y^2 in [0, 0.0625] and [0, 0.3025]
  static constexpr double kFit7[] = {-5.132772405e-02, 1.332313281e-01, -3.333320644e-01, 9.999999975e-01};
  static constexpr double kFit11[] = {-6.332234959e-03, 2.110725775e-02,  -5.385908087e-02,
                                      1.333262065e-01,  -3.333331634e-01, 9.999999993e-01};

  // Every lane's y^2 below bound (NaN is not); without AVX: never (the whole formula runs).
  static bool all_below(const Vec& y2, float bound) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, float>)
      return _mm512_cmp_ps_mask(SimdF(y2), _mm512_set1_ps(bound), _CMP_NLT_UQ) == 0;
#elif defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, float>)
      return _mm256_movemask_ps(_mm256_cmp_ps(SimdF(y2), _mm256_set1_ps(bound), _CMP_NLT_UQ)) == 0;
#endif
    return false;
  }

  Vec cap_;
  Vec fit7_[4], fit11_[6];
};

// Subnormal results flush to zero while a kernel's thread runs (MXCSR.FTZ,
// restored on leaving; inputs are read as given). On x86 every subnormal
// result costs a microcode assist (~100+ cycles), and attention makes them
// itself: with an ALiBi bias the probabilities of far keys fall to 2^-120 or
// so, and a product P V whose accumulator starts at 0 is subnormal for key
// after key (measured on the Xeon, 4x8x1024x64 causal float32 with ALiBi:
// 38 ms against 21.5 without the bias; with this, 0.95-0.98x the plain
// kernel's speed). A result that small is below float's resolution of
// anything the row sums to (a row's probabilities sum to 1), so flushing it
// changes no figure that matters.
#if defined(__x86_64__) || defined(_M_X64)
class FlushSubnormals {
 public:
  FlushSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON); }
  ~FlushSubnormals() { _mm_setcsr(saved_); }
  FlushSubnormals(const FlushSubnormals&) = delete;
  FlushSubnormals& operator=(const FlushSubnormals&) = delete;

 private:
  unsigned saved_;
};
#else
struct FlushSubnormals {  // elsewhere: nothing to set
  FlushSubnormals() {}
};
#endif

// at::parallel_for over tasks [0, n) for the kernels: each thread's share runs
// with subnormal results flushed (FlushSubnormals), whatever the loop.
template <typename F>
inline void parallel_tasks(int64_t n, int64_t grain, const F& f) {
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    const FlushSubnormals ftz;
    f(begin, end);
  });
}

// parallel_tasks over tasks [0, cost.size()) in one contiguous share per
// thread, the shares of about equal cost (any unit). A packed batch's tasks
// cost as much as their sequence is long, so an even split by count would
// leave one thread the long sequences; contiguous shares of sequence-major
// tasks also keep each thread's output rows its own (the rows of a packed
// (total, H, E) output interleave the heads).
template <typename F>
inline void parallel_tasks_balanced(const std::vector<double>& cost, const F& f) {
  const int64_t n = static_cast<int64_t>(cost.size());
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) return parallel_tasks(n, std::max<int64_t>(n, 1), f);
  std::vector<double> prefix(n + 1, 0.0);  // prefix[t]: the cost of tasks [0, t)
  for (int64_t t = 0; t < n; ++t) prefix[t + 1] = prefix[t] + cost[t];
  std::vector<int64_t> bounds(threads + 1, n);  // share c is tasks [bounds[c], bounds[c + 1])
  bounds[0] = 0;
  for (int64_t c = 1; c < threads; ++c) {
    const double target = prefix[n] * double(c) / double(threads);
    bounds[c] = std::lower_bound(prefix.begin(), prefix.end(), target) - prefix.begin();
  }
  parallel_tasks(threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      if (bounds[c + 1] > bounds[c]) f(bounds[c], bounds[c + 1]);
  });
}

// The largest of s[0, n); four chains hide the max instruction's latency.
template <typename T>
inline T row_max(const T* s, int64_t n) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  Vec m0(-std::numeric_limits<T>::infinity()), m1 = m0, m2 = m0, m3 = m0;
  int64_t j = 0;
  for (; j + 4 * VS <= n; j += 4 * VS) {
    m0 = fast_max(Vec::loadu(s + j), m0);
    m1 = fast_max(Vec::loadu(s + j + VS), m1);
    m2 = fast_max(Vec::loadu(s + j + 2 * VS), m2);
    m3 = fast_max(Vec::loadu(s + j + 3 * VS), m3);
  }
  for (; j < n; j += VS) m0 = fast_max(Vec::loadu(s + j), m0);
  return at::vec::vec_reduce_all<T>([](const auto& a, const auto& b) { return fast_max(a, b); },
                                    fast_max(fast_max(m0, m1), fast_max(m2, m3)));
}

// A shift (a row's max or log-sum-exp) so far from 0 that its float's rounding
// would show in the probabilities: |shift| > 1024 (its ulp 2^-13 and up; a
// float mask of finfo.min on every key the row sees, as transformers' eager
// masks hide keys, or a huge bias).
template <typename T>
inline bool lse_inexact(T shift) {
  return std::abs(shift) > T(1024) && std::isfinite(shift);
}

// s = exp(s * mul - shift - offset); returns the sum. -inf entries become 0. Two
// chains: 2^(s * mul * log2(e) - shift * log2(e)) in one FMA. Where the shift is
// lse_inexact, the base-2 shift would lose its low bits (and overflow to -inf
// near finfo.min, making NaN), and where an offset is given (a row's log(sum)
// beside its max: exact_row_shift) it has a second part: then the shift is
// taken first, 2^((s * mul - shift - offset) * log2(e)), so that a row of
// finfo.min scores averages its keys as torch's softmax does.
template <typename T>
inline T exp_shift_sum(T* s, int64_t n, T shift, T mul = T(1), T offset = T(0)) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  using Exp = FastExp<T>;
  const T base = Exp::base2 ? T(1.4426950408889634) : T(1);  // log2(e) for 2^x
  if (offset != T(0) || lse_inexact(shift)) {
    const Vec a(mul), c(shift), o(offset), b(base);
    Vec acc(T(0));
    for (int64_t j = 0; j < n; j += VS) {
      const Vec e = Exp::apply((at::vec::fmsub(Vec::loadu(s + j), a, c) - o) * b);
      e.store(s + j);
      acc = acc + e;
    }
    return hsum(acc);
  }
  const Vec a(mul * base), c(shift * base);
  Vec acc0(T(0)), acc1(T(0));
  int64_t j = 0;
  for (; j + 2 * VS <= n; j += 2 * VS) {
    const Vec e0 = Exp::apply(at::vec::fmsub(Vec::loadu(s + j), a, c));
    const Vec e1 = Exp::apply(at::vec::fmsub(Vec::loadu(s + j + VS), a, c));
    e0.store(s + j);
    e1.store(s + j + VS);
    acc0 = acc0 + e0;
    acc1 = acc1 + e1;
  }
  for (; j < n; j += VS) {
    const Vec e = Exp::apply(at::vec::fmsub(Vec::loadu(s + j), a, c));
    e.store(s + j);
    acc0 = acc0 + e;
  }
  return hsum(acc0 + acc1);
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
    int64_t e = 0;
    if constexpr (std::is_same_v<T, float> && !std::is_same_v<scalar_t, float>) {
      // float16/bfloat16: whole vectors converted at once (F16C / AVX-512 conversions)
      using Vh = Vectorized<scalar_t>;
      using Vf = Vectorized<float>;
      const Vf vmul(mul);
      for (; e + Vh::size() <= n; e += Vh::size()) {
        auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vh::loadu(src + e));
        (lo * vmul).store(dst + e);
        (hi * vmul).store(dst + e + Vf::size());
      }
    } else if constexpr (std::is_same_v<T, scalar_t>) {  // a vector at a time (the compiler keeps this loop scalar)
      using Vec = Vectorized<T>;
      const Vec vmul(mul);
      for (; e + Vec::size() <= n; e += Vec::size()) (Vec::loadu(src + e) * vmul).store(dst + e);
    }
    for (; e < n; ++e) dst[e] = static_cast<T>(src[e]) * mul;
  } else {
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(src[e * stride]) * mul;
  }
  for (int64_t e = n; e < n_padded; ++e) dst[e] = T(0);
}

// dst[e * stride] = src[e] * mul for e < n.
template <typename scalar_t, typename T>
inline void store_row(scalar_t* dst, int64_t stride, const T* src, int64_t n, T mul) {
  int64_t e = 0;
  if (stride == 1) {
    using Vec = Vectorized<T>;
    const Vec vmul(mul);
    if constexpr (std::is_same_v<T, scalar_t>) {
      for (; e + Vec::size() <= n; e += Vec::size()) (Vec::loadu(src + e) * vmul).store(dst + e);
    } else if constexpr (std::is_same_v<T, float>) {  // float16/bfloat16: two float vectors rounded at once
      using Vh = Vectorized<scalar_t>;
      for (; e + Vh::size() <= n; e += Vh::size())
        at::vec::convert_from_float<scalar_t>(Vec::loadu(src + e) * vmul, Vec::loadu(src + e + Vec::size()) * vmul)
            .store(dst + e);
    }
  }
  for (; e < n; ++e) dst[e * stride] = static_cast<scalar_t>(src[e] * mul);
}

// Packs rows [j0, j0 + n) of a (rows, dim) matrix with strides (rs, cs)
// transposed: dst[d * ld + j] = src[j0 + j][d]; columns n..ld are zero.
template <typename scalar_t, typename T>
inline void pack_transposed(T* dst, int64_t ld, const scalar_t* src, int64_t rs, int64_t cs,
                            int64_t n, int64_t dim) {
  if constexpr (!std::is_same_v<scalar_t, T>) {
    if (cs == 1) {  // half types: convert rows a vector at a time
      constexpr int64_t kChunk = 256;
      int64_t j0 = 0;
      if constexpr (std::is_same_v<T, float>) {
        // 16 rows converted into a block, then 16 x 16 transposes through registers
        // (scattering each converted row took 6.6 % of a float16 forward, 4 x 8 x 1024 x 64 on the Xeon)
        constexpr int64_t kRows = 16;
        alignas(64) T block[kRows * kChunk];
        for (; j0 + kRows <= n; j0 += kRows) {
          for (int64_t d0 = 0; d0 < dim; d0 += kChunk) {
            const int64_t w = std::min(kChunk, dim - d0);
            for (int64_t r = 0; r < kRows; ++r) load_row(block + r * kChunk, src + (j0 + r) * rs + d0, w, 1, T(1), w);
            int64_t d = 0;
            for (; d + 16 <= w; d += 16)
              at::vec::transpose_mxn<float, 16, 16>(block + d, kChunk, dst + (d0 + d) * ld + j0, ld);
            for (; d < w; ++d)
              for (int64_t r = 0; r < kRows; ++r) dst[(d0 + d) * ld + j0 + r] = block[r * kChunk + d];
          }
        }
      }
      T row[kChunk];
      for (int64_t j = j0; j < n; ++j) {  // the rows left: convert a row, then scatter it
        for (int64_t d0 = 0; d0 < dim; d0 += kChunk) {
          const int64_t w = std::min(kChunk, dim - d0);
          load_row(row, src + j * rs + d0, w, 1, T(1), w);
          for (int64_t d = 0; d < w; ++d) dst[(d0 + d) * ld + j] = row[d];
        }
      }
      for (int64_t d = 0; d < dim; ++d)
        for (int64_t j = n; j < ld; ++j) dst[d * ld + j] = T(0);
      return;
    }
  }
  int64_t j0 = 0;
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<T, float>) {
    if (cs == 1) {  // 16 x 16 blocks through registers (a windowed backward packs a block per 5 query tiles)
      for (; j0 + 16 <= n; j0 += 16) {
        int64_t d = 0;
        for (; d + 16 <= dim; d += 16)
          at::vec::transpose_mxn<float, 16, 16>(src + j0 * rs + d, rs, dst + d * ld + j0, ld);
        for (; d < dim; ++d)
          for (int64_t j = j0; j < j0 + 16; ++j) dst[d * ld + j] = src[j * rs + d];
      }
    }
  }
  for (int64_t j = j0; j < n; ++j) {
    const scalar_t* row = src + j * rs;
    for (int64_t d = 0; d < dim; ++d) dst[d * ld + j] = static_cast<T>(row[d * cs]);
  }
  for (int64_t d = 0; d < dim; ++d)
    for (int64_t j = n; j < ld; ++j) dst[d * ld + j] = T(0);
}

// Query blocks of up to kDirectRows (float32, float64) or kDirectRowsConverted (float16,
// bfloat16) rows read each key row in place (kernels.h has the measurements).

// Lane t of the result is the sum of the lanes of parts[t] (VS vectors in):
// the dot products of VS keys at once (lane_sums.h: an add tree, about three
// instructions per key where a horizontal sum each takes eight or so, on a
// dependency chain; decoding's Q K^T was a third of a step's time before).
// Elsewhere (DEFAULT, float64) a horizontal sum each.
template <typename T>
inline Vectorized<T> lane_sums(const Vectorized<T>* parts) {
  constexpr int64_t VS = Vectorized<T>::size();
  T out[VS];
  for (int64_t t = 0; t < VS; ++t) out[t] = hsum(parts[t]);
  return Vectorized<T>::loadu(out);
}
#if defined(CPU_CAPABILITY_AVX512)
template <>
inline Vectorized<float> lane_sums<float>(const Vectorized<float>* parts) {
  __m512 v[16];
  for (int t = 0; t < 16; ++t) v[t] = parts[t];
  return lane_sums16(v);
}
#elif defined(CPU_CAPABILITY_AVX2)
template <>
inline Vectorized<float> lane_sums<float>(const Vectorized<float>* parts) {
  const __m256 a = _mm256_hadd_ps(parts[0], parts[1]), b = _mm256_hadd_ps(parts[2], parts[3]);
  const __m256 c = _mm256_hadd_ps(parts[4], parts[5]), d = _mm256_hadd_ps(parts[6], parts[7]);
  const __m256 lo = _mm256_hadd_ps(a, b), hi = _mm256_hadd_ps(c, d);  // each 128-bit lane: keys 0..3 / 4..7
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
#endif

// The partial sums of a . b over n elements, one per lane (hsum gives a . b).
template <typename T>
inline Vectorized<T> dot_parts(const T* a, const T* b, int64_t n) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  Vec acc(T(0));
  int64_t e = 0;
  for (; e + VS <= n; e += VS) acc = at::vec::fmadd(Vec::loadu(a + e), Vec::loadu(b + e), acc);
  if (e < n) acc = at::vec::fmadd(Vec::loadu(a + e, n - e), Vec::loadu(b + e, n - e), acc);
  return acc;
}

// sum_e a[e] * b[e].
template <typename T>
inline T dot_product(const T* a, const T* b, int64_t n) {
  return hsum(dot_parts(a, b, n));
}

// sum_e a[e * sa] * b[e * sb] for e < n, accumulated in T: dot_product for contiguous rows of T,
// float16/bfloat16 rows converted a vector at a time.
template <typename scalar_t, typename T>
inline T dot_rows(const scalar_t* a, int64_t sa, const scalar_t* b, int64_t sb, int64_t n) {
  int64_t e = 0;
  T sum = 0;
  if (sa == 1 && sb == 1) {
    if constexpr (std::is_same_v<T, scalar_t>) {
      return dot_product(a, b, n);
    } else if constexpr (std::is_same_v<T, float>) {
      using Vh = Vectorized<scalar_t>;
      Vectorized<T> acc(T(0));
      for (; e + Vh::size() <= n; e += Vh::size()) {
        auto [a0, a1] = at::vec::convert_to_float<scalar_t>(Vh::loadu(a + e));
        auto [b0, b1] = at::vec::convert_to_float<scalar_t>(Vh::loadu(b + e));
        acc = at::vec::fmadd(a1, b1, at::vec::fmadd(a0, b0, acc));
      }
      sum = hsum(acc);
    }
  }
  for (; e < n; ++e) sum += static_cast<T>(a[e * sa]) * static_cast<T>(b[e * sb]);
  return sum;
}

// O[r] += sum_j P[r][j] V[j] for a decoding step's rows, V's rows read in place
// (ldv apart, C columns, a multiple of the vector width): NV vectors of columns
// at a time, in registers, with consecutive keys in separate sums so that
// several FMA chains run per column vector (the micro-kernel's single row had
// one, and waited on it).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPvVecs = 8;
#else
constexpr int kPvVecs = 4;
#endif
template <typename T, int NV>
inline void add_pv_strip(T* o, const T* p, const T* v, int64_t ldv, int64_t n) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  // U keys a step, so that U x NV chains (at least 8) cover the FMA latency: with
  // two, a strip of one or two vectors (Ev up to 32 in float32) waited on them
  constexpr int U = NV >= 4 ? 2 : 8 / NV;
  Vec acc[U][NV];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[u][c] = Vec(T(0));
  int64_t j = 0;
  for (; j + U <= n; j += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const Vec pj(p[j + u]);
      const T* vj = v + (j + u) * ldv;
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) acc[u][c] = at::vec::fmadd(pj, Vec::loadu(vj + c * VS), acc[u][c]);
    }
  }
  for (; j < n; ++j) {  // into acc[0]: a variable index would keep acc in memory, not registers
    const Vec pj(p[j]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[0][c] = at::vec::fmadd(pj, Vec::loadu(v + j * ldv + c * VS), acc[0][c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) {
    Vec sum = acc[0][c];
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) sum = sum + acc[u][c];
    (Vec::loadu(o + c * VS) + sum).store(o + c * VS);
  }
}

template <typename T, int NV>
inline void add_pv_tail(int64_t nv, T* o, const T* p, const T* v, int64_t ldv, int64_t n) {
  if constexpr (NV > 0) {
    if (nv == NV) return add_pv_strip<T, NV>(o, p, v, ldv, n);
    add_pv_tail<T, NV - 1>(nv, o, p, v, ldv, n);
  }
}

template <typename T>
inline void add_pv_rows(T* o, int64_t ldo, const T* p, int64_t ldp, int64_t m, const T* v, int64_t ldv, int64_t n,
                        int64_t C) {
  constexpr int64_t VS = Vectorized<T>::size();
  for (int64_t r = 0; r < m; ++r) {
    int64_t c = 0;
    for (; c + kPvVecs * VS <= C; c += kPvVecs * VS)
      add_pv_strip<T, kPvVecs>(o + r * ldo + c, p + r * ldp, v + c, ldv, n);
    add_pv_tail<T, kPvVecs - 1>((C - c) / VS, o + r * ldo + c, p + r * ldp, v + c, ldv, n);
  }
}

// The row ranges of batch entry b's query rows (AttnParams::row_keys): row i
// sees no key outside [r[2 i], r[2 i + 1]). Only when p.row_keys is set.
inline const int64_t* row_ranges_of(const AttnParams& p, int64_t b) { return p.row_keys + b * p.row_keys_stride; }

// ---------------------------------------------------------------------------
// The scores of one row of a tile, as DESIGN.md orders them. Shared by forward
// and backward so that they cannot disagree: scores s[0, n) of query row i
// against keys j0 + j become softcap * tanh(s / softcap) (tanh_out, when given,
// keeps the tanh for the backward), get the ALiBi bias and the additive mask
// added, and -inf where the bool mask says no or the key is outside the row's
// visible range (causal, window, its row_keys); s[n, n_padded) become -inf.
//
// Products may leave the row unscaled (AMX keeps Q as bfloat16, unscaled):
// s * unscaled is the score. The softcap, the ALiBi bias and an additive mask
// need the score itself, so with one of them the first pass over the row
// applies the factor and 1 is returned; otherwise the factor is returned and
// rides in the exponent (masking to -inf does not care; see
// probabilities_row). A factor that is not positive is applied at once (the
// row max of s * f is not max(s) * f then).
// ---------------------------------------------------------------------------
template <typename scalar_t, typename T>
inline T score_row(const AttnParams& p, T* s, int64_t n, int64_t n_padded, int64_t b, int64_t h, int64_t i,
                   int64_t j0, T unscaled, T* tanh_out = nullptr) {
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  T pending = unscaled;  // the factor not yet applied to s
  if (!(pending > T(0))) {
    scale_row(s, n_padded, pending);
    pending = T(1);
  }
  if (p.softcap > 0.0) {
    // cap tanh(s / cap) in one polynomial; the backward's tanh (for its derivative) from it
    const CappedTanh<T> capped_tanh(static_cast<T>(p.softcap));
    const Vec in(static_cast<T>(pending / p.softcap)), inv_cap(static_cast<T>(1.0 / p.softcap));
    for (int64_t j = 0; j < n_padded; j += VS) {
      const Vec capped = capped_tanh(Vec::loadu(s + j) * in);
      capped.store(s + j);
      if (tanh_out != nullptr) (capped * inv_cap).store(tanh_out + j);
    }
    pending = T(1);
  }
  if (p.alibi != nullptr) {
    // s_j -= slope * |pos - (j0 + j)|: the distance of key j0 + j from the row's position
    // (the signed distances of a vector's keys step down by VS: whole numbers, exact in T below 2^24)
    const Vec slope(static_cast<T>(p.alibi[b * p.alibi_stride_b + h])), factor(pending), step(static_cast<T>(VS));
    Vec signed_dist = Vec(static_cast<T>(i + p.causal_offset - j0)) - Vec::arange(T(0), T(1));
    for (int64_t j = 0; j < n_padded; j += VS, signed_dist = signed_dist - step)
      at::vec::fmsub(Vec::loadu(s + j), factor, slope * signed_dist.abs()).store(s + j);
    pending = T(1);
  }
  if (p.mask_kind == MaskKind::Additive && pending != T(1)) {
    scale_row(s, n_padded, pending);
    pending = T(1);
  }
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
      int64_t j = 0;
      if (sj == 1) {
        // Eight keys at a time: a key-padding mask is long runs of true (one byte 1
        // each), which cost a load and a compare per word.
        constexpr uint64_t kAllKept = 0x0101010101010101ull;
        for (; j + 8 <= n; j += 8) {
          uint64_t word;
          std::memcpy(&word, m + j, sizeof(word));
          if (word == kAllKept) continue;
          for (int64_t t = j; t < j + 8; ++t)
            if (!m[t]) s[t] = kNegInf;
        }
      }
      for (; j < n; ++j)
        if (!m[j * sj]) s[j] = kNegInf;
    }
  }
  KeyRange keys = visible_key_range(p, i);
  if (p.row_keys != nullptr) {  // the row's own keys, of the mask (which may be dropped: they are all it held)
    const int64_t* own = row_ranges_of(p, b) + 2 * i;
    keys = KeyRange{std::max(keys.begin, own[0]), std::min(keys.end, own[1])};
  }
  const int64_t begin = std::clamp<int64_t>(keys.begin - j0, 0, n);
  const int64_t end = std::clamp<int64_t>(keys.end - j0, begin, n);
  std::fill(s, s + begin, kNegInf);
  std::fill(s + end, s + n_padded, kNegInf);
  return pending;
}

// The dropout rule of attention_math.h (keep test, 1 / (1 - p)).
template <typename T>
using Dropout = DropoutRule<T>;

// Row i of a score tile (keys j0 + j, already masked) to probabilities, given
// the row's log-sum-exp: s = exp(s * mul - lse) (mul: what score_row returned;
// lse as a shift and an offset, RowShift). With dropout, z = s * keep / (1 - p)
// (z may be s itself) and, when dz is given, dz *= keep / (1 - p) likewise.
// Shared by the backward and the explicit-probabilities forward.
template <typename T>
struct RowShift {
  T shift, offset;  // lse = shift + offset (offset 0 but for exact_row_shift's rows)
};
template <typename T>
inline void probabilities_row(const AttnParams& p, const Dropout<T>& drop, T* s, T* z, T* dz, int64_t n,
                              int64_t np, RowShift<T> lse, T mul, int64_t b, int64_t h, int64_t i, int64_t j0) {
  exp_shift_sum(s, np, lse.shift, mul, lse.offset);
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
// The forward's products, with at::vec (every ISA, every dtype): S = (scale Q) K^T
// and O += P V on one thread. A forward task is one (batch, head, query block);
// a thread's consecutive tasks mostly share their key/value head, so K^T is
// packed once per (batch, kv head) and kept while it fits (kKeyCacheBytes).
// The amx unit has a bfloat16 class with the same members on AMX tiles.
// ---------------------------------------------------------------------------
constexpr int64_t kKeyCacheBytes = int64_t(8) << 20;

template <typename scalar_t>
class VecForwardProducts {
 public:
  using T = acc_t<scalar_t>;
  static constexpr int64_t kCols = Vectorized<T>::size();  // S and O tile columns are padded to this
  static constexpr int64_t kKeyAlign = kCols;               // key blocks are a multiple of this
  static constexpr int64_t kRowAlign = kGemmRows;           // query blocks are a multiple of this
  static T unscaled(const AttnParams&) { return T(1); }     // scores() scales (Q is scaled)
  static constexpr int64_t kDirect = std::is_same_v<scalar_t, T> ? kDirectRows : kDirectRowsConverted;

  // Panels of `panel` keys (the packing and caching unit); a score tile spans up
  // to `cols` keys, whole panels from a panel boundary.
  VecForwardProducts(const AttnParams& p, int64_t q_block, int64_t panel, int64_t /*cols*/)
      : p_(&p), E_(p.E), Ev_(p.Ev), Evp_(round_up(p.Ev, kCols)), panel_(panel),
        blocks_(ceil_div(std::max<int64_t>(p.S, 1), panel)),
        v_rows_(p.probs == nullptr && std::is_same_v<scalar_t, T> && p.v_stride[3] == 1 && p.Ev % kCols == 0) {
    const int64_t E1 = std::max<int64_t>(E_, 1);
    auto fits = [&](int64_t panels) { return panels * blocks_ * int64_t(sizeof(T)) <= kKeyCacheBytes; };
    // V's rows go to the products in place when contiguous, or when packed V panels would not
    // fit beside K's (and K^T would be packed again for every query block)
    v_direct_ = v_rows_ && (p.v_stride[2] == p.Ev || !fits(E1 * panel + panel * Evp_));
    const bool pack_v = !v_direct_ && p.probs == nullptr;
    cache_.on = fits(E1 * panel + (pack_v ? panel * Evp_ : 0));
    cache_.blocks = blocks_;
    const int64_t slots = cache_.on ? blocks_ : 1;
    qt_.resize(q_block * E1);
    kt_size_ = E1 * panel * slots;  // allocated at the first packed panel: decoding reads keys in place
    krow_.resize(E1);
    if (pack_v) vt_size_ = panel * Evp_ * slots;  // likewise at the first packed panel
  }

  int64_t out_ld() const { return Evp_; }

  // The sequence the next calls read (sequence_view; the batch itself when dense).
  void bind(const AttnParams& p) { p_ = &p; }

  // Q rows [i0, i0 + m) of head h of batch b, times the scale.
  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    const scalar_t* q_rows = row_at<scalar_t>(p_->q, p_->q_stride, b, h, i0);
    m_ = m;
    // A few rows read keys in place, unless they are the last block of a longer
    // call whose earlier blocks left the panels packed in the cache.
    direct_ = m <= kDirect && (i0 == 0 || !cache_.on);
    for (int64_t r = 0; r < m; ++r)
      load_row(qt_.data() + r * E_, q_rows + r * p_->q_stride[2], E_, p_->q_stride[3], static_cast<T>(p_->scale), E_);
  }

  // S (m x round_up(n, kCols), row stride ld) = scale Q K[j0, j0 + n)^T, K of kv head hk;
  // j0 on a panel boundary, a product per panel. Row r needs only the scores of
  // keys [j0, j0 + reach + r) (causal or a window's right side; the driver
  // masks the rest): where a group of micro-kernel rows needs fewer columns
  // than the tile has, its product stops at whole vectors past its last row's
  // reach and leaves the rest of its rows unwritten; likewise before first + r
  // (a window's left side).
  void scores(T* st, int64_t ld, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t reach, int64_t first) {
    if (direct_) {  // decoding: read each key row in place
      score_rows_direct(st, ld, n, row_at<scalar_t>(p_->k, p_->k_stride, b, hk, j0));
      return;
    }
    for (int64_t c = 0; c < n; c += panel_) {
      const int64_t slot = cache_.slot(b * p_->Hkv + hk, (j0 + c) / panel_);
      if (kt_.empty()) kt_.resize(kt_size_);
      T* kt = kt_.data() + slot * E_ * panel_;
      if (!cache_.packed(cache_.k, slot)) {  // the whole panel: a cached panel serves every query block
        const scalar_t* k_tile = row_at<scalar_t>(p_->k, p_->k_stride, b, hk, j0 + c);
        pack_transposed(kt, panel_, k_tile, p_->k_stride[2], p_->k_stride[3], keys_in(j0 + c), E_);
        cache_.mark(cache_.k, slot);
      }
      const int64_t w = std::min(panel_, ld - c);  // the last panel's columns up to ld
      gemm_to_reach<T>(m_, w, std::min(panel_, n - c), reach - c, E_, qt_.data(), E_, kt, panel_, st + c, ld,
                       first - c);
    }
  }

  // Row r of P is final (add_pv follows once every row is): at::vec reads P in place.
  void take_p_row(int64_t, const T*, int64_t) {}

  // O (m x out_ld()) += P (m x round_up(n, kCols), row stride ld) V[j0, j0 + n); row r of P is 0
  // outside [first + r, reach + r) (scores()), so each row group's product runs over its band only.
  void add_pv(T* ot, const T* pt, int64_t ld, int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t reach,
              int64_t first) {
    const scalar_t* v_tile = row_at<scalar_t>(p_->v, p_->v_stride, b, hk, j0);
    if constexpr (std::is_same_v<scalar_t, T>) {
      if (v_rows_ && direct_) return add_pv_rows(ot, Evp_, pt, ld, m_, v_tile, p_->v_stride[2], n, Evp_);
      if (v_direct_)
        return gemm_add_to_reach<T>(m_, Evp_, n, reach, T(1), pt, ld, v_tile, p_->v_stride[2], ot, Evp_, first);
    }
    for (int64_t c = 0; c < n; c += panel_) {
      const int64_t slot = cache_.slot(b * p_->Hkv + hk, (j0 + c) / panel_);
      if (vt_.empty()) vt_.resize(vt_size_);
      T* vt = vt_.data() + slot * panel_ * Evp_;
      if (!cache_.packed(cache_.v, slot)) {
        for (int64_t j = 0; j < keys_in(j0 + c); ++j)
          load_row(vt + j * Evp_, v_tile + (c + j) * p_->v_stride[2], Ev_, p_->v_stride[3], T(1), Evp_);
        cache_.mark(cache_.v, slot);
      }
      gemm_add_to_reach<T>(m_, Evp_, std::min(panel_, n - c), reach - c, T(1), pt + c, ld, vt, Evp_, ot, Evp_,
                           first - c);
    }
  }

 private:
  int64_t keys_in(int64_t j0) const { return std::min(panel_, p_->S - j0); }

  // out[t] = q . k[t * ldk] for kCols keys, q's NE vectors (E = NE kCols) held in registers: per
  // key NE loads and FMAs, where dot_parts loads q again (1 x 4 x 1 x 100 x 32 float32, AMD EPYC
  // Zen 4: the scores took 0.93 us of a 5.3 us call).
  using KeysFn = void (*)(T*, const T*, const T*, int64_t);
  template <int NE>
  static void score_keys(T* out, const T* q, const T* k, int64_t ldk) {
    using Vec = Vectorized<T>;
    Vec qv[NE], parts[kCols];
#pragma GCC unroll 8
    for (int e = 0; e < NE; ++e) qv[e] = Vec::loadu(q + e * kCols);
#pragma GCC unroll 16
    for (int64_t t = 0; t < kCols; ++t) {
      const T* kt = k + t * ldk;
      Vec acc = qv[0] * Vec::loadu(kt);
#pragma GCC unroll 8
      for (int e = 1; e < NE; ++e) acc = at::vec::fmadd(qv[e], Vec::loadu(kt + e * kCols), acc);
      parts[t] = acc;
    }
    lane_sums(parts).store(out);
  }
  static KeysFn keys_in_registers(int64_t ne) {
    constexpr KeysFn table[] = {&score_keys<1>, &score_keys<2>, &score_keys<3>, &score_keys<4>,
                                &score_keys<5>, &score_keys<6>, &score_keys<7>, &score_keys<8>};
    return ne >= 1 && ne <= 8 ? table[ne - 1] : nullptr;
  }

  void score_rows_direct(T* st, int64_t ld, int64_t n, const scalar_t* k_tile) {
    int64_t j = 0;
    if constexpr (std::is_same_v<scalar_t, T>) {
      if (p_->k_stride[3] == 1) {  // key rows in place, kCols keys' dot products at a time
        const int64_t ldk = p_->k_stride[2];
        const KeysFn keys = E_ % kCols == 0 ? keys_in_registers(E_ / kCols) : nullptr;
        Vectorized<T> parts[kCols];
        for (; j + kCols <= n; j += kCols) {
          for (int64_t r = 0; r < m_; ++r) {
            if (keys != nullptr) {
              keys(st + r * ld + j, qt_.data() + r * E_, k_tile + j * ldk, ldk);
              continue;
            }
            for (int64_t t = 0; t < kCols; ++t) parts[t] = dot_parts(qt_.data() + r * E_, k_tile + (j + t) * ldk, E_);
            lane_sums(parts).store(st + r * ld + j);
          }
        }
      }
    }
    for (; j < n; ++j) {
      const T* kr = krow_.data();
      if constexpr (std::is_same_v<scalar_t, T>) {
        if (p_->k_stride[3] == 1) kr = k_tile + j * p_->k_stride[2];
      }
      if (kr == krow_.data()) load_row(krow_.data(), k_tile + j * p_->k_stride[2], E_, p_->k_stride[3], T(1), E_);
      for (int64_t r = 0; r < m_; ++r) st[r * ld + j] = dot_product(qt_.data() + r * E_, kr, E_);
    }
    for (int64_t r = 0; r < m_; ++r) std::fill(st + r * ld + n, st + (r + 1) * ld, T(0));
  }

  const AttnParams* p_;
  const int64_t E_, Ev_, Evp_, panel_, blocks_;
  // V's rows can be read in place (its dtype, unit column stride, whole vectors): by a few rows
  // (direct_) always; by the block products (v_direct_) where they are contiguous too, or the
  // panels would not stay cached. Rows of a (batch, tokens, heads, dims) layout, 2 KiB apart at
  // 8 x 64 float32, read in place by the products made the float32 forward 0.80-0.85x as fast as
  // on contiguous rows; packed once per head, 0.92-0.94x (causal 1 x 8 x 4096 x 64, Xeon model
  // 167, builds alternated: 70.2-73.8 -> 65.0-66.1 ms).
  const bool v_rows_;
  bool v_direct_ = false;
  PanelCache cache_;
  int64_t m_ = 0, kt_size_ = 0, vt_size_ = 0;
  bool direct_ = false;  // this block reads keys (and, same dtype, values) in place
  std::vector<T> qt_, kt_, krow_, vt_;
};

// ---------------------------------------------------------------------------
// Packed batches and windows: what the drivers share.
// ---------------------------------------------------------------------------
// One thread's view of the sequence its current task is in: the batch itself
// when dense, its entry's own keys when batch_keys are set (key_begin and S),
// and sequence_view when packed (rebuilt only when the batch entry changes).
template <typename scalar_t, typename Params>
class SequenceViews {
 public:
  explicit SequenceViews(const Params& p) : p_(p) {}
  const Params& of(int64_t b) {
    if (p_.cu_q == nullptr && p_.batch_keys == nullptr) return p_;
    if (b != b_) {
      if (p_.cu_q != nullptr) {
        view_ = sequence_view<scalar_t>(p_, b);
      } else {
        view_ = p_;
        view_.key_begin = p_.batch_keys[2 * b];
        view_.S = p_.batch_keys[2 * b + 1];
      }
      b_ = b;
    }
    return view_;
  }

 private:
  const Params& p_;
  Params view_;
  int64_t b_ = -1;
};

// The keys that query rows [i0, i0 + m) of batch entry b may see: the causal
// bound's and the window's (visible_key_range), narrowed by the rows' own
// ranges when a mask that varies by row gave them (row_keys).
// end <= begin: no row of the block sees a key.
inline KeyRange block_key_range(const AttnParams& p, int64_t b, int64_t i0, int64_t m) {
  KeyRange keys{visible_key_range(p, i0).begin, visible_key_range(p, i0 + m - 1).end};
  if (p.row_keys == nullptr) return keys;
  const int64_t* rows = row_ranges_of(p, b) + 2 * i0;
  int64_t lo = p.S, hi = 0;
  for (int64_t r = 0; r < m; ++r) {
    lo = std::min(lo, rows[2 * r]);
    hi = std::max(hi, rows[2 * r + 1]);
  }
  return KeyRange{std::max(keys.begin, lo), std::min(keys.end, hi)};
}

// The query rows among `rows` that see a key of [j0, j1) by their own ranges
// (row_keys, which must be set), as one range from the first to the last.
inline KeyRange rows_seeing(const AttnParams& p, int64_t b, KeyRange rows, int64_t j0, int64_t j1) {
  const int64_t* keys = row_ranges_of(p, b);
  int64_t first = -1, last = -1;
  for (int64_t i = rows.begin; i < rows.end; ++i) {
    if (keys[2 * i] < j1 && keys[2 * i + 1] > j0) {
      if (first < 0) first = i;
      last = i;
    }
  }
  return first < 0 ? KeyRange{rows.begin, rows.begin} : KeyRange{first, last + 1};
}

// A block's band on its left: row i0 + r of a query block sees no key of a
// tile starting at key j0 before first + r (relative to j0; a window's left
// side); -m, which bounds none of its m rows, without a window. The products
// may skip what lies before it (the driver masks it: score_row).
inline int64_t band_first(const AttnParams& p, int64_t i0, int64_t j0, int64_t m) {
  return p.window_left >= 0 ? std::max(i0 + p.causal_offset - p.window_left - j0, -m) : -m;
}

// Key blocks for a window that bounds both sides: the keys a query block sees
// are about span = left + right + q wide, and the blocks that cover them
// start on the kv grid, so up to a block is computed and masked in vain. A
// quarter of the span (a power of two, 64 to kv keys) keeps that waste small
// without making the blocks so short that their fixed costs dominate (a
// 256-key window at 64 queries: 64-key blocks, measured fastest on the Xeon
// for the forward).
inline int64_t windowed_kv_block(const AttnParams& p, int64_t kv, int64_t q) {
  const int64_t right = right_reach(p);
  if (p.window_left < 0 || right < 0) return kv;
  const int64_t quarter = (p.window_left + right + q) / 4;
  int64_t block = 64;
  while (block * 2 <= quarter && block * 2 <= kv) block *= 2;
  return std::min(block, kv);
}

// The backward's key blocks for such a window: twice the forward's (up to kv).
// Each (query block, key block) pair of the backward has larger fixed costs
// (Q and dO packed, and transposed for the dK/dV column sums, lse and D read)
// than the forward's, so its blocks pay off longer. Causal 1 x 8 x 8192 x 64,
// forward+backward, Xeon model 167, 2 threads, alternated in one process:
// windows of 127 and 255 keys, 128-key blocks against the forward's 64:
// bfloat16 0.90-0.91x the time, float16 0.91x, float32 0.97-0.98x; of 31 and
// 63 keys, likewise: bfloat16 0.95-0.97x, float32 1.00-1.05x; of 511 keys,
// 256 against the forward's 128: bfloat16 1.01x, float32 0.96x.
inline int64_t windowed_backward_kv_block(const AttnParams& p, int64_t kv, int64_t q) {
  return std::min(kv, 2 * windowed_kv_block(p, kv, q));
}

// Split-KV (flash-decoding): when the (batch, head, query block) tasks cannot
// keep every thread busy (decoding: one query row per head, few heads), each
// task's key tiles are split among `splits` threads; each split leaves its
// rows' running max, sum and output sum, and a second pass merges them through
// the log-sum-exp. Dense batches only (a packed batch has its sequences to
// share out); each split gets at least two key tiles. 1 = no split.
inline int64_t kv_splits(const AttnParams& p, int64_t tasks, int64_t kv_block) {
  const int64_t threads = at::get_num_threads();
  if (p.cu_q != nullptr || p.probs != nullptr || tasks >= threads) return 1;
  return std::max<int64_t>(1, std::min(ceil_div(threads, tasks), ceil_div(p.S, kv_block) / 2));
}

// Below this many multiply-adds (B Hq L S (E + Ev)) the forward runs on one thread.
constexpr int64_t kInlineMacs = int64_t(1) << 17;

// The sink's logit for head h, or nullptr.
template <typename T>
inline const T* sink_of(const AttnParams& p, int64_t h) {
  return p.sinks == nullptr ? nullptr : static_cast<const T*>(p.sinks) + h;
}

// A row whose log-sum-exp is too large for its float to keep log(sum) beside
// the max (at 3e38 lse rounds to the max): exp(s - lse) would lose the row's
// sum there (P summed to the key count). Such rows (lse_inexact) take their
// max and log(sum) from exact_row_shift, which computes the row's scores again,
// one key at a time (a row so biased is rare: a padding row).
template <typename scalar_t, typename T>
RowShift<T> exact_row_shift(const AttnParams& ps, int64_t b, int64_t h, int64_t i) {
  constexpr int64_t VS = Vectorized<T>::size();
  const int64_t E = std::max<int64_t>(ps.E, 1), hk = h / (ps.Hq / ps.Hkv);
  const int64_t j0 = ps.key_begin, n = std::max<int64_t>(ps.S - j0, 0), np = round_up(std::max<int64_t>(n, 1), VS);
  Buffer<T> q(E, T(0)), key(E, T(0)), s(np);
  load_row(q.data(), row_at<scalar_t>(ps.q, ps.q_stride, b, h, i), ps.E, ps.q_stride[3], static_cast<T>(ps.scale), E);
  for (int64_t j = 0; j < n; ++j) {
    load_row(key.data(), row_at<scalar_t>(ps.k, ps.k_stride, b, hk, j0 + j), ps.E, ps.k_stride[3], T(1), E);
    s[j] = dot_product(q.data(), key.data(), E);
  }
  score_row<scalar_t, T>(ps, s.data(), n, np, b, h, i, j0, T(1));  // scores scaled: returns 1
  const T* sink = sink_of<T>(ps, h);
  T mx = row_max(s.data(), np);
  if (sink != nullptr) mx = std::max(mx, *sink);
  T l = exp_shift_sum(s.data(), np, mx);
  if (sink != nullptr) l += std::exp(*sink - mx);
  return RowShift<T>{mx, std::log(l)};
}

// ---------------------------------------------------------------------------
// Forward (FlashAttention-2's loop; Products does the two matrix products).
// With p.probs set (the attention_probs op) there is no V: the first pass
// only finds each row's log-sum-exp and a second pass writes the probabilities.
// A query block visits only the key blocks its rows see (causal, window).
// ---------------------------------------------------------------------------
template <typename scalar_t, typename Products>
void forward_driver(const AttnParams& p) {
  using T = acc_t<scalar_t>;
  constexpr int64_t kCols = Products::kCols;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  const int64_t B = p.B, Hq = p.Hq, Ev = p.Ev;
  const int64_t group = Hq / p.Hkv;
  const BlockSizes tiles = forward_blocks(p.E, p.Ev);
  // whole micro-kernel row blocks (at::vec: 60 = 10 x 6) or whole AMX tiles (64 = 4 x 16)
  const int64_t q_block = tiles.q / Products::kRowAlign * Products::kRowAlign;
  // Query blocks of q_block rows; with row ranges (row_keys), a block also ends
  // before a row whose keys start at or past the previous row's end, when that
  // row sees keys (the next packed document): a block straddling two documents
  // would run its second document's rows over the first's keys. row_blocks[e]
  // lists mask entry e's block starts and its end (L).
  std::vector<std::vector<int64_t>> row_blocks;
  if (p.row_keys != nullptr) {
    row_blocks.resize(p.row_keys_stride != 0 ? B : 1);
    for (int64_t e = 0; e < int64_t(row_blocks.size()); ++e) {
      const int64_t* keys = row_ranges_of(p, e);
      std::vector<int64_t>& starts = row_blocks[e];
      starts.push_back(0);
      for (int64_t i = 1; i < p.L; ++i)
        if (i - starts.back() == q_block || (keys[2 * i - 2] < keys[2 * i - 1] && keys[2 * i] >= keys[2 * i - 1]))
          starts.push_back(i);
      starts.push_back(p.L);
    }
  }
  int64_t n_qblocks = ceil_div(p.L, q_block);  // of the longest sequence when packed
  for (const std::vector<int64_t>& starts : row_blocks) n_qblocks = std::max<int64_t>(n_qblocks, starts.size() - 1);
  // Query block qb of batch entry b: rows [i0, i0 + m) (m <= 0: none; past a shorter sequence's end).
  auto block_rows = [&](const AttnParams& ps, int64_t b, int64_t qb) {
    if (row_blocks.empty()) return KeyRange{qb * q_block, std::min(q_block * (qb + 1), ps.L)};
    const std::vector<int64_t>& starts = row_blocks[p.row_keys_stride != 0 ? b : 0];
    return qb + 1 < int64_t(starts.size()) ? KeyRange{starts[qb], starts[qb + 1]} : KeyRange{0, 0};
  };
  // Keys are packed (and cached) in panels of `panel`; a score tile spans up to
  // kv_block keys, whole panels: with a window, the few panels a query block
  // sees make one tile (one online-softmax step) instead of one each. With row
  // ranges (row_keys) a block's keys start anywhere: 64-key panels, so that its
  // first tile starts at most 63 keys before them.
  const int64_t panel_keys = p.row_keys != nullptr ? std::min<int64_t>(64, tiles.kv)
                                                   : windowed_kv_block(p, tiles.kv, q_block);
  const int64_t panel = round_up(std::min(panel_keys, std::max<int64_t>(p.S, 1)), Products::kKeyAlign);
  const int64_t kv_block = std::max(panel, std::min(tiles.kv, round_up(std::max<int64_t>(p.S, 1), panel)) /
                                               panel * panel);
  const Dropout<T> drop(p);
  const bool write_probs = p.probs != nullptr;
  // With a softcap and neither ALiBi nor a float mask every score lies in
  // [-cap, cap] (masked ones are -inf), and softmax does not depend on the
  // shift: cap stands for each row's running max, so the pass that finds the
  // max and the rescaling of O when it grows are skipped. exp(s - cap) >=
  // exp(-2 cap) stays a normal float (>= 2^-126) for cap <= 40. The argument
  // s - cap is then up to 2 cap from 0, and its rounding (|s - cap| float ulps)
  // becomes a relative error of each probability up to 80 x 2^-24 = 5e-6: far
  // below float16's and bfloat16's rounding of the output (and of P for the
  // AMX products), not below float32's, which keeps the row max.
  constexpr bool kHalfStorage = !std::is_same_v<scalar_t, T>;
  const bool cap_is_max = kHalfStorage && p.softcap > 0.0 && p.softcap <= 40.0 && p.alibi == nullptr &&
                          p.mask_kind != MaskKind::Additive;
  const int64_t n_tasks = B * Hq * n_qblocks;
  const int64_t splits = kv_splits(p, n_tasks, kv_block);
  // Split-KV partial results of item (task, split): rows' max, sum, output sum (Ev apart).
  Buffer<T> part_m(splits > 1 ? n_tasks * splits * q_block : 0);
  Buffer<T> part_l(part_m.size());
  Buffer<T> part_o(part_m.size() * Ev);

  // The rows [i0, i0 + m) of (b, h) from their running max and sum and their
  // output sum (relative to the max; rows ldo apart): the log-sum-exp, the
  // sink's logit joining the sum, and the output. l == 0 only when the row saw
  // no key (and there is no sink): output 0, log-sum-exp -inf. A NaN score makes
  // l NaN: output and log-sum-exp NaN, as in PyTorch.
  auto finish_rows = [&](const AttnParams& ps, int64_t b, int64_t h, int64_t i0, int64_t m, const T* row_m,
                         const T* row_l, const T* ot, int64_t ldo) {
    auto* lse = static_cast<T*>(ps.lse);
    const T* sink = sink_of<T>(ps, h);
    T o_mul[kMaxQTile];  // turns the row's output sum into the output
    for (int64_t r = 0; r < m; ++r) {
      T mx = row_m[r], l = row_l[r];
      if (sink != nullptr && !std::isnan(l)) {
        const T m_new = std::max(mx, *sink);
        if (m_new != kNegInf) {
          l = (l > T(0) ? l * std::exp(mx - m_new) : T(0)) + std::exp(*sink - m_new);
          mx = m_new;
        }
      }
      lse[lse_index(ps, b, h, i0 + r)] = l > T(0) ? mx + std::log(l) : (std::isnan(l) ? l : kNegInf);
      o_mul[r] = row_l[r] > T(0) ? drop.keep_scale * std::exp(row_m[r] - mx) / l : (std::isnan(l) ? l : T(0));
    }
    if (write_probs) return;
    scalar_t* o_bh = static_cast<scalar_t*>(ps.out) + b * ps.o_stride[0] + h * ps.o_stride[1];
    for (int64_t r = 0; r < m; ++r)
      store_row(o_bh + (i0 + r) * ps.o_stride[2], ps.o_stride[3], ot + r * ldo, Ev, o_mul[r]);
  };

  // Task t is query block qb of head h of batch b. The query heads that share
  // a key/value head are consecutive tasks (qb fastest, then the head within
  // its group), so a thread reads a kv head's keys and values (and packs its
  // panels) once for the whole group while they are in its cache. Dense:
  // kv-head-major (then the batch), a thread's share whole kv heads. Packed:
  // sequence-major (then the kv head), shared out by cost
  // (parallel_tasks_balanced), so that a thread writes whole rows of the
  // (total, H, Ev) output instead of every thread a few heads of each row.
  const bool packed = p.cu_q != nullptr;
  struct Task {
    int64_t b, h, qb;
  };
  auto task_of = [&](int64_t t) {
    const int64_t qb = t % n_qblocks, g = (t / n_qblocks) % group, outer = t / (n_qblocks * group);
    const int64_t b = packed ? outer / p.Hkv : outer % B, hk = packed ? outer % p.Hkv : outer / B;
    return Task{b, hk * group + g, qb};
  };

  // A call of a few tens of thousands of multiply-adds (a small decoding step)
  // runs on the calling thread: waking the pool would cost more than the work.
  const int64_t macs = B * Hq * p.L * std::max<int64_t>(p.S, 1) * (p.E + p.Ev);
  const int64_t grain = macs < kInlineMacs ? n_tasks * splits : 1;
  // Rows a tile buffer needs: a query block's, or fewer for short queries (a
  // decoding step: its buffers are zero-filled on every call). Whole 16-row
  // tiles, which AMX products write.
  const int64_t tile_rows = std::min(q_block, round_up(std::max<int64_t>(p.L, 1), 16));
  auto run_items = [&](int64_t begin, int64_t end) {
    Products products(p, tile_rows, panel, kv_block);
    SequenceViews<scalar_t, AttnParams> views(p);
    const int64_t ldo = products.out_ld();
    const T unscaled = Products::unscaled(p);  // scores() leaves S divided by this
    Buffer<T> st(tile_rows * kv_block);
    Buffer<T> ot(write_probs ? 0 : tile_rows * ldo);
    T row_m[kMaxQTile];
    T row_l[kMaxQTile];

    for (int64_t item = begin; item < end; ++item) {
      const int64_t task = item / splits, split = item % splits;
      const auto [b, h, qb] = task_of(task);
      const AttnParams& ps = views.of(b);
      const KeyRange rows = block_rows(ps, b, qb);
      if (rows.end <= rows.begin) continue;  // past a shorter sequence's end, or no such block
      products.bind(ps);
      const int64_t hk = h / group;
      const int64_t i0 = rows.begin, m = rows.end - rows.begin;
      // The block's rows see keys in [kv_begin, kv_end); tiles start on the panel grid (cached
      // panels), which starts at the first key run on (key_begin: keys before it are never read).
      const KeyRange keys = block_key_range(ps, b, i0, m);
      const int64_t kv_begin = ps.key_begin + (keys.begin - ps.key_begin) / panel * panel;
      const int64_t kv_end = keys.end;
      // This split's key tiles: [j_first, j_stop) (all of them without a split).
      const int64_t n_tiles = kv_end > kv_begin ? ceil_div(kv_end - kv_begin, kv_block) : 0;
      const int64_t j_first = kv_begin + n_tiles * split / splits * kv_block;
      const int64_t j_stop = std::min(kv_end, kv_begin + n_tiles * (split + 1) / splits * kv_block);

      products.load_q(b, h, i0, m);
      std::fill(ot.begin(), ot.end(), T(0));
      std::fill(row_m, row_m + m, kNegInf);
      std::fill(row_l, row_l + m, T(0));

      // Row i0 + r sees keys below i0 + r + right_end (causal, a window's right side); none of its own
      // past them is computed (the products' reach).
      const int64_t right = right_reach(ps);
      const int64_t right_end = right >= 0 ? ps.causal_offset + right + 1 : ps.S;
      for (int64_t j0 = j_first; j0 < j_stop; j0 += kv_block) {
        const int64_t n = std::min(kv_block, j_stop - j0);
        const int64_t np = round_up(n, kCols);
        const int64_t reach = right >= 0 ? std::min(n, i0 + right_end - j0) : n;
        const int64_t first = band_first(ps, i0, j0, m);  // and none before first + r
        products.scores(st.data(), np, b, hk, j0, n, reach, first);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          T* s = st.data() + r * np;
          // the row's keys end by its reach (reach + r): its columns past them are P = 0
          const int64_t nr = std::clamp<int64_t>(reach + r, 0, n), npr = round_up(nr, kCols);
          std::fill(s + npr, s + np, T(0));
          const T f = score_row<scalar_t, T>(ps, s, nr, npr, b, h, i, j0, unscaled);
          const T m_new = cap_is_max ? static_cast<T>(ps.softcap) : std::max(row_m[r], row_max(s, npr) * f);
          if (m_new == kNegInf) {  // no visible key yet in this row, or NaN scores only
            if (std::any_of(s, s + nr, [](T x) { return std::isnan(x); }))
              row_l[r] = std::numeric_limits<T>::quiet_NaN();  // the NaN reaches lse and the output
            std::fill(s, s + npr, T(0));
            products.take_p_row(r, s, n);
            continue;
          }
          const T correction = std::exp(row_m[r] - m_new);  // 0 when row_m was -inf
          row_l[r] = row_l[r] * correction + exp_shift_sum(s, npr, m_new, f);
          row_m[r] = m_new;
          if (write_probs) continue;
          if (correction != T(1)) scale_row(ot.data() + r * ldo, ldo, correction);
          if (drop.on) {
            DropoutRowStream rng(ps.seed, dropout_row(ps, b, h, i), j0);
            for (int64_t j = 0; j < n; ++j)
              if (rng.next() < drop.threshold) s[j] = T(0);
          }
          products.take_p_row(r, s, n);
        }
        if (!write_probs) products.add_pv(ot.data(), st.data(), np, b, hk, j0, n, reach, first);
      }

      if (splits > 1) {  // leave the partial results for the merge below
        const int64_t at = item * q_block;
        std::copy(row_m, row_m + m, part_m.data() + at);
        std::copy(row_l, row_l + m, part_l.data() + at);
        for (int64_t r = 0; r < m; ++r)
          std::copy(ot.data() + r * ldo, ot.data() + r * ldo + Ev, part_o.data() + (at + r) * Ev);
        continue;
      }
      finish_rows(ps, b, h, i0, m, row_m, row_l, ot.data(), ldo);
      if (!write_probs) continue;
      const auto* lse = static_cast<const T*>(ps.lse);

      // Second pass of attention_probs: P = exp(S - lse), dropped, written out; 0 outside [kv_begin, kv_end).
      scalar_t* p_bh = static_cast<scalar_t*>(ps.probs) + b * ps.probs_stride[0] + h * ps.probs_stride[1];
      RowShift<T> shifts[kMaxQTile];
      for (int64_t r = 0; r < m; ++r) {
        const T row_lse = lse[lse_index(ps, b, h, i0 + r)];
        shifts[r] = lse_inexact(row_lse) ? exact_row_shift<scalar_t, T>(ps, b, h, i0 + r)
                                         : RowShift<T>{row_lse, T(0)};
      }
      for (int64_t j0 = 0; j0 < ps.S; j0 += kv_block) {
        const int64_t n = std::min(kv_block, ps.S - j0);
        const int64_t np = round_up(n, kCols);
        const bool seen = j0 + n > kv_begin && j0 < kv_end;
        if (seen) products.scores(st.data(), np, b, hk, j0, n, n, -m);
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = i0 + r;
          T* s = st.data() + r * np;
          const T row_lse = lse[lse_index(ps, b, h, i)];
          if (!seen || row_lse == kNegInf) {
            std::fill(s, s + np, T(0));
          } else {
            const T f = score_row<scalar_t, T>(ps, s, n, np, b, h, i, j0, unscaled);
            probabilities_row(ps, drop, s, s, static_cast<T*>(nullptr), n, np, shifts[r], f, b, h, i, j0);
          }
          store_row(p_bh + i * ps.probs_stride[2] + j0 * ps.probs_stride[3], ps.probs_stride[3], s, n, T(1));
        }
      }
    }
  };
  if (packed && grain == 1) {
    // A task's cost: its rows times the keys they span, plus a per-row part (loading Q, writing O).
    std::vector<double> cost(n_tasks, 0.0);
    for (int64_t b = 0; b < B; ++b) {
      const AttnParams s = sequence_view<scalar_t>(p, b);
      for (int64_t qb = 0; qb * q_block < s.L; ++qb) {
        const int64_t i0 = qb * q_block, m = std::min(q_block, s.L - i0);
        const int64_t keys = std::max<int64_t>(visible_key_range(s, i0 + m - 1).end -
                                                   visible_key_range(s, i0).begin, 0);
        for (int64_t h = 0; h < Hq; ++h) cost[(b * Hq + h) * n_qblocks + qb] = double(m) * double(keys + 2 * Ev);
      }
    }
    parallel_tasks_balanced(cost, run_items);
  } else {
    parallel_tasks(n_tasks * splits, grain, run_items);
  }
  if (splits == 1) return;

  // Split-KV merge: each row's splits weighted by exp(m_s - max), a NaN in any split kept.
  parallel_tasks(n_tasks, 1, [&](int64_t begin, int64_t end) {
    Buffer<T> ot(q_block * Ev);
    T row_m[kMaxQTile];
    T row_l[kMaxQTile];
    for (int64_t task = begin; task < end; ++task) {
      const auto [b, h, qb] = task_of(task);
      const KeyRange rows = block_rows(p, b, qb);
      if (rows.end <= rows.begin) continue;
      const int64_t i0 = rows.begin, m = rows.end - rows.begin;
      std::fill(ot.begin(), ot.end(), T(0));
      for (int64_t r = 0; r < m; ++r) {
        T mx = kNegInf;
        bool nan = false;
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t at = (task * splits + sp) * q_block + r;
          mx = std::max(mx, part_m[at]);
          nan = nan || std::isnan(part_l[at]);
        }
        T l = T(0);
        if (mx != kNegInf) {
          for (int64_t sp = 0; sp < splits; ++sp) {
            const int64_t at = (task * splits + sp) * q_block + r;
            if (part_m[at] == kNegInf) continue;  // no visible key in this split
            const T w = std::exp(part_m[at] - mx);
            l += part_l[at] * w;
            const T* o = part_o.data() + at * Ev;
            for (int64_t e = 0; e < Ev; ++e) ot[r * Ev + e] += w * o[e];
          }
        }
        row_m[r] = mx;
        row_l[r] = nan ? std::numeric_limits<T>::quiet_NaN() : l;
      }
      finish_rows(p, b, h, i0, m, row_m, row_l, ot.data(), Ev);
    }
  });
}

template <typename scalar_t>
void forward_kernel(const AttnParams& p) {
  forward_driver<scalar_t, VecForwardProducts<scalar_t>>(p);
}

// ---------------------------------------------------------------------------
// The backward's products with at::vec, on one thread. Per key block it packs
// K^T, V^T and K; per query block scale Q and dO; then
//   S = (scale Q) K^T,  dP = dO V^T,
//   dV += Z^T dO,  dQ += scale dS K,  dK += dS^T (scale Q).
// dQ and dK come out final (dq_scale = dk_scale = 1). The amx unit has a
// bfloat16 class with the same members on AMX tiles.
// ---------------------------------------------------------------------------
template <typename scalar_t>
class VecBackwardProducts {
 public:
  using T = acc_t<scalar_t>;
  static constexpr int64_t kCols = Vectorized<T>::size();  // tile columns and accumulator rows pad to this
  static constexpr int64_t kKeyAlign = kCols;
  static T unscaled(const AttnParams&) { return T(1); }
  static T dq_scale(const AttnParams&) { return T(1); }
  static T dk_scale(const AttnParams&) { return T(1); }

  VecBackwardProducts(const AttnBwdParams& p, int64_t q_block, int64_t kv_block)
      : p_(&p), E_(p.E), Ev_(p.Ev), Ep_(round_up(std::max<int64_t>(p.E, 1), kCols)),
        Evp_(round_up(std::max<int64_t>(p.Ev, 1), kCols)), from_probs_(p.dprobs != nullptr),
        scale_(static_cast<T>(p.scale)) {
    qt_.resize(q_block * Ep_);
    dot_.resize(q_block * Evp_);
    kt_.resize(std::max<int64_t>(E_, 1) * kv_block);
    kn_.resize(kv_block * Ep_);
    vt_.resize(std::max<int64_t>(Ev_, 1) * kv_block);
  }

  // The sequence the next calls read (sequence_view; the batch itself when dense).
  void bind(const AttnBwdParams& p) { p_ = &p; }

  // Keys and values [j0, j0 + n) of kv head hk; the tiles' row stride is round_up(n, kCols).
  void load_kv(int64_t b, int64_t hk, int64_t j0, int64_t n) {
    n_ = n;
    np_ = ld_ = round_up(n, kCols);
    const scalar_t* k_tile = row_at<scalar_t>(p_->k, p_->k_stride, b, hk, j0);
    pack_transposed(kt_.data(), np_, k_tile, p_->k_stride[2], p_->k_stride[3], n, E_);
    for (int64_t j = 0; j < n; ++j)
      load_row(kn_.data() + j * Ep_, k_tile + j * p_->k_stride[2], E_, p_->k_stride[3], T(1), Ep_);
    if (from_probs_) return;
    const scalar_t* v_tile = row_at<scalar_t>(p_->v, p_->v_stride, b, hk, j0);
    pack_transposed(vt_.data(), np_, v_tile, p_->v_stride[2], p_->v_stride[3], n, Ev_);
  }

  // Query (and output gradient) rows [i0, i0 + m) of head h.
  void load_q(int64_t b, int64_t h, int64_t i0, int64_t m) {
    m_ = m;
    const scalar_t* q_rows = row_at<scalar_t>(p_->q, p_->q_stride, b, h, i0);
    for (int64_t r = 0; r < m; ++r)
      load_row(qt_.data() + r * Ep_, q_rows + r * p_->q_stride[2], E_, p_->q_stride[3], scale_, Ep_);
    if (from_probs_) return;
    const scalar_t* do_rows = row_at<scalar_t>(p_->dout, p_->do_stride, b, h, i0);
    for (int64_t r = 0; r < m; ++r)
      load_row(dot_.data() + r * Evp_, do_rows + r * p_->do_stride[2], Ev_, p_->do_stride[3], T(1), Evp_);
  }

  // The next products take only the first n keys of the loaded block, and row r of
  // the query block only keys [first + r, reach + r) (causal, a window's sides):
  // outside them S and dP are left unwritten and the driver makes P and dS 0.
  void narrow(int64_t n, int64_t reach, int64_t first) {
    n_ = n;
    np_ = round_up(n, kCols);
    reach_ = reach;
    first_ = first;
  }

  // st (m x np, row stride ld) = (scale Q) K^T.
  void scores(T* st) { row_products(st, qt_.data(), Ep_, E_, kt_.data()); }
  // dst (m x np) = dO V^T.
  void grad_probs(T* dst) { row_products(dst, dot_.data(), Evp_, Ev_, vt_.data()); }
  // dv (n x Evp) += Z^T dO, Z (m x np).
  void add_dv(T* dv, const T* z) { key_products(dv, Evp_, z, dot_.data(), T(1)); }
  // dq (m x Ep) += scale dS K.
  void add_dq(T* dq, const T* ds) {
    gemm_add_to_reach<T>(m_, Ep_, n_, reach_, scale_, ds, ld_, kn_.data(), Ep_, dq, Ep_, first_);
  }
  // dk (n x Ep) += dS^T (scale Q).
  void add_dk(T* dk, const T* ds) { key_products(dk, Ep_, ds, qt_.data(), T(1)); }
  // A key block's dK (or dV) rows, width apart, as add_dk (add_dv) sums them: acc itself.
  const T* key_rows(const T* acc, int64_t, int64_t) { return acc; }
  // Row r of the query block's Z and dS are final (the products read the tiles themselves).
  void finish_row(int64_t, const T*, const T*) {}

 private:
  // c (m x np, row stride ld) = a (m x K, row stride lda) b (K x np, row stride ld), each row over its band.
  void row_products(T* c, const T* a, int64_t lda, int64_t K, const T* b) {
    gemm_to_reach<T>(m_, np_, n_, reach_, K, a, lda, b, ld_, c, ld_, first_);
  }

  // c (n x N) += x^T y for x (m x np, row stride ld), y (m x N): each key group's sum
  // runs from the first row that sees its first key to the last that sees its last.
  void key_products(T* c, int64_t N, const T* x, const T* y, T alpha) {
    if (reach_ >= n_ && first_ + (m_ - 1) <= 0) return gemm<T>(n_, N, m_, alpha, x, 1, ld_, y, N, true, c, N);
    for (int64_t k0 = 0; k0 < n_; k0 += kGemmRows) {
      const int64_t keys = std::min<int64_t>(kGemmRows, n_ - k0);
      const KeyRange rows = band_rows(first_, reach_, k0, k0 + keys, m_);
      if (rows.end > rows.begin)
        gemm<T>(keys, N, rows.end - rows.begin, alpha, x + rows.begin * ld_ + k0, 1, ld_, y + rows.begin * N, N, true,
                c + k0 * N, N);
    }
  }

  const AttnBwdParams* p_;
  const int64_t E_, Ev_, Ep_, Evp_;
  const bool from_probs_;
  const T scale_;
  int64_t m_ = 0, n_ = 0, np_ = 0, ld_ = 0, reach_ = 0, first_ = kOpenFirst;
  std::vector<T> qt_, dot_, kt_, kn_, vt_;
};

// How many chunks the keys of one (batch, kv head) are split into, so that the
// backward has a task for every thread: 1 when there are as many heads as
// threads. Chunk c takes key blocks c, c + chunks, ... (round-robin keeps
// causal work even); each chunk sums its own dQ and the chunks are added after.
inline int64_t backward_key_chunks(int64_t heads, int64_t key_blocks) {
  const int64_t threads = at::get_num_threads();
  if (heads >= threads || key_blocks <= 1) return 1;
  return std::min(key_blocks, ceil_div(threads, heads));
}

// ---------------------------------------------------------------------------
// Backward
//   D_i  = sum_e dO_ie O_ie - dlse_i
//   P    = exp(S - lse),  Z = P * keep / (1 - p)
//   dV  += Z^T dO,  dP = (dO V^T) * keep / (1 - p),  dS = P * (dP - D)
//   dmask += dS;  through the softcap dS *= 1 - tanh^2
//   dQ  += scale dS K,  dK += scale dS^T Q
//   dsink = -sum_i exp(sink - lse_i) D_i   (the sink is a key with value 0)
// One task is one (batch, kv head, chunk of key blocks): it owns dK and dV of
// its key blocks and visits the query blocks of the head's query group that
// see them (causal, window).
// ---------------------------------------------------------------------------
template <typename scalar_t, typename Products>
void backward_driver(const AttnBwdParams& p) {
  using T = acc_t<scalar_t>;
  using Vec = Vectorized<T>;
  constexpr int64_t VS = Vec::size();
  constexpr int64_t kCols = Products::kCols;
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();

  const int64_t B = p.B, Hq = p.Hq, Hkv = p.Hkv, E = p.E, Ev = p.Ev;
  const int64_t L = p.L;  // the longest sequence's when packed: dQ partial sums are laid out by it
  const int64_t group = Hq / Hkv;
  const BlockSizes tiles = backward_blocks(E, Ev);
  const int64_t q_block = tiles.q;
  const int64_t kv_block = round_up(
      std::min(windowed_backward_kv_block(p, tiles.kv, q_block), std::max<int64_t>(p.S, 1)), Products::kKeyAlign);
  const int64_t key_blocks = ceil_div(p.S, kv_block);
  const int64_t Ep = round_up(std::max<int64_t>(E, 1), kCols);
  const int64_t Evp = round_up(std::max<int64_t>(Ev, 1), kCols);
  const Dropout<T> drop(p);
  const bool dropout = drop.on;
  const bool softcap = p.softcap > 0.0;
  // attention_probs' backward: the gradient comes for the probabilities.
  const bool from_probs = p.dprobs != nullptr;

  const auto* lse = static_cast<const T*>(p.lse);
  const auto* dlse = static_cast<const T*>(p.dlse);

  // D for every row (laid out as lse): rowsum(dO * O), which equals rowsum(dZ * Z)
  // for the explicit probabilities Z; and the sinks' gradient of each (b, h).
  std::vector<T> delta(p.cu_q != nullptr ? p.cu_q[B] * Hq : B * Hq * L);
  // The rows whose lse cannot hold their sum (lse_inexact) get their max and
  // log(sum) here, laid out as lse (none when no row needs them).
  const int64_t n_rows = static_cast<int64_t>(delta.size());
  std::vector<RowShift<T>> exact(std::any_of(lse, lse + n_rows, [](T x) { return lse_inexact(x); }) ? n_rows : 0);
  auto shift_of = [&](int64_t row) {
    return exact.empty() || !lse_inexact(lse[row]) ? RowShift<T>{lse[row], T(0)} : exact[row];
  };
  parallel_tasks(B * Hq, 1, [&](int64_t begin, int64_t end) {
    SequenceViews<scalar_t, AttnBwdParams> views(p);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hq, h = bh % Hq;
      const AttnBwdParams& ps = views.of(b);
      const T* sink = sink_of<T>(ps, h);
      T dsink = 0;
      for (int64_t i = 0; i < ps.L; ++i) {
        const int64_t row = lse_index(ps, b, h, i);
        T d = 0;
        if (from_probs) {
          const scalar_t* zrow = row_at<scalar_t>(ps.probs, ps.probs_stride, b, h, i);
          const scalar_t* drow = row_at<scalar_t>(ps.dprobs, ps.dprobs_stride, b, h, i);
          for (int64_t j = 0; j < ps.S; ++j)
            d += static_cast<T>(zrow[j * ps.probs_stride[3]]) * static_cast<T>(drow[j * ps.dprobs_stride[3]]);
        } else {
          if (ps.o_stride[3] == 1 && ps.do_stride[3] == 1) {  // rows far apart asked for ahead (prefetch.h):
            // a 1024-token packed bfloat16 batch's backward took 56.5-61.7 ms without, 53.8-54.3 with (Xeon)
            const int64_t ahead = i + kPrefetchRows, end = std::min(ahead + 1, ps.L), bytes = Ev * sizeof(scalar_t);
            prefetch_rows(row_at<scalar_t>(ps.out, ps.o_stride, b, h, 0), ps.o_stride[2] * sizeof(scalar_t), ahead,
                          end, bytes);
            prefetch_rows(row_at<scalar_t>(ps.dout, ps.do_stride, b, h, 0), ps.do_stride[2] * sizeof(scalar_t),
                          ahead, end, bytes);
          }
          d = dot_rows<scalar_t, T>(row_at<scalar_t>(ps.out, ps.o_stride, b, h, i), ps.o_stride[3],
                                    row_at<scalar_t>(ps.dout, ps.do_stride, b, h, i), ps.do_stride[3], Ev);
        }
        if (dlse != nullptr) d -= dlse[row];
        delta[row] = d;
        if (!exact.empty() && lse_inexact(lse[row])) exact[row] = exact_row_shift<scalar_t, T>(ps, b, h, i);
        const RowShift<T> shift = shift_of(row);
        if (sink != nullptr && lse[row] != kNegInf) dsink -= std::exp((*sink - shift.shift) - shift.offset) * d;
      }
      if (ps.dsinks != nullptr) static_cast<T*>(ps.dsinks)[bh] = dsink;
    }
  });

  const int64_t heads = B * Hkv;
  const int64_t chunks = backward_key_chunks(heads, key_blocks);
  // dQ of one task's query group, (group * L, Ep), plus a tile of rows that
  // tile-padded products may touch (they add zeros there).
  const int64_t dq_size = (group * L + kCols) * Ep;
  Buffer<T> dq_partial(chunks > 1 ? heads * chunks * dq_size : 0);
  const T dq_mul = Products::dq_scale(p), dk_mul = Products::dk_scale(p);

  // The query rows [begin, end) that see key block blk of batch entry b (its keys
  // from the entry's key_begin): the causal bound's and the window's, narrowed
  // by the rows' own ranges (row_keys) in a table of (B, key_blocks) when there
  // are such ranges, which hold for every kv head alike.
  std::vector<KeyRange> rows_of_block;
  if (p.row_keys != nullptr) {
    rows_of_block.resize(B * key_blocks);
    SequenceViews<scalar_t, AttnBwdParams> views(p);
    for (int64_t b = 0; b < B; ++b) {
      const AttnBwdParams& ps = views.of(b);
      for (int64_t blk = 0; ps.key_begin + blk * kv_block < ps.S; ++blk) {
        const int64_t j0 = ps.key_begin + blk * kv_block, j1 = std::min(j0 + kv_block, ps.S);
        rows_of_block[b * key_blocks + blk] = rows_seeing(ps, b, visible_row_range(ps, j0, j1), j0, j1);
      }
    }
  }

  // Task (b, hk, chunk): kv-head-major when dense (a thread's share whole kv
  // heads); sequence-major when packed, shared out by cost as the forward's.
  const bool packed = p.cu_q != nullptr && chunks == 1;
  auto run_tasks = [&](int64_t begin, int64_t end) {
    Products products(p, q_block, kv_block);
    SequenceViews<scalar_t, AttnBwdParams> views(p);
    const T unscaled = Products::unscaled(p);              // scores() leaves S divided by this
    Buffer<T> pt(q_block * kv_block);                     // P tile
    Buffer<T> zt(dropout ? q_block * kv_block : 0);       // dropped P tile
    Buffer<T> dst(q_block * kv_block);                    // dP, then dS
    Buffer<T> tt(softcap ? q_block * kv_block : 0);       // tanh(score / softcap)
    Buffer<T> dk_acc((kv_block + kCols) * Ep);  // as the products lay them out: rows of keys, or (amx)
    Buffer<T> dv_acc((kv_block + kCols) * Evp);  // Ep or Evp rows of kv_block + kCols keys
    Buffer<T> dq_own(chunks == 1 ? dq_size : 0);
    T* dmask = nullptr;
    if (p.dmask != nullptr)
      dmask = static_cast<T*>(p.dmask) + (p.dmask_per_thread ? at::get_thread_num() * p.dmask_numel : 0);

    for (int64_t task = begin; task < end; ++task) {
      const int64_t chunk = task % chunks;
      const int64_t b = packed ? task / Hkv : (task / chunks) % B;
      const int64_t hk = packed ? task % Hkv : task / (chunks * B);
      const AttnBwdParams& ps = views.of(b);
      products.bind(ps);
      T* dq_acc = chunks == 1 ? dq_own.data() : dq_partial.data() + task * dq_size;
      // the rows of this sequence's query group (L apart), and the tile of rows after them
      // that padded products may touch; the longest sequence's L when packed
      for (int64_t g = 0; g < group; ++g)
        std::fill(dq_acc + g * L * Ep, dq_acc + std::min(g * L + ps.L + kCols + q_block, group * L + kCols) * Ep,
                  T(0));

      // key blocks from the first key run on (key_begin: keys before it are never read)
      for (int64_t blk = chunk; ps.key_begin + blk * kv_block < ps.S; blk += chunks) {
        const int64_t j0 = ps.key_begin + blk * kv_block;
        const int64_t n = std::min(kv_block, ps.S - j0);
        const int64_t np = round_up(n, kCols);
        const KeyRange rows = rows_of_block.empty() ? visible_row_range(ps, j0, j0 + n)
                                                    : rows_of_block[b * key_blocks + blk];
        const int64_t right = right_reach(ps);
        const int64_t right_end = ps.causal_offset + right + 1;  // row i sees keys below i + right_end
        std::fill(dk_acc.begin(), dk_acc.end(), T(0));
        std::fill(dv_acc.begin(), dv_acc.end(), T(0));
        if (rows.end > rows.begin) products.load_kv(b, hk, j0, n);

        for (int64_t g = 0; g < group && rows.end > rows.begin; ++g) {
          const int64_t h = hk * group + g;
          for (int64_t i0 = rows.begin; i0 < rows.end; i0 += q_block) {  // the rows that see the keys, no more
            const int64_t m = std::min(q_block, rows.end - i0);
            // the keys the block's last row sees (causal, a window's right side): those past them
            // take no product; the tiles keep their row stride np
            const int64_t reach = right >= 0 ? i0 + right_end - j0 : n;  // row i0 + r sees keys below reach + r
            const int64_t first = band_first(ps, i0, j0, m);  // and none before first + r
            const int64_t nq = std::clamp<int64_t>(reach + m - 1, 1, n);
            const int64_t npq = round_up(nq, kCols);
            products.narrow(nq, reach, first);
            products.load_q(b, h, i0, m);
            // S = scale Q K^T, dZ = dO V^T (or the given gradient of the probabilities)
            products.scores(pt.data());
            if (from_probs) {
              for (int64_t r = 0; r < m; ++r)
                load_row(dst.data() + r * np,
                         row_at<scalar_t>(ps.dprobs, ps.dprobs_stride, b, h, i0 + r) + j0 * ps.dprobs_stride[3],
                         nq, ps.dprobs_stride[3], T(1), npq);
            } else {
              products.grad_probs(dst.data());
            }

            for (int64_t r = 0; r < m; ++r) {
              const int64_t i = i0 + r;
              T* s = pt.data() + r * np;
              T* ds = dst.data() + r * np;
              T* t = softcap ? tt.data() + r * np : nullptr;
              const int64_t row = lse_index(ps, b, h, i);
              const T row_lse = lse[row];
              T* z = dropout ? zt.data() + r * np : s;  // what dV's product takes
              if (row_lse == kNegInf) {  // fully masked row: no probability, no gradient
                std::fill(s, s + npq, T(0));
                std::fill(ds, ds + npq, T(0));
                if (dropout) std::fill(z, z + npq, T(0));
                products.finish_row(r, z, ds);
                continue;
              }
              // the row's keys end by its reach: past them P, Z and dS are 0 (S and dP may be unwritten)
              const int64_t nr = std::clamp<int64_t>(reach + r, 0, nq), npr = round_up(nr, kCols);
              std::fill(s + npr, s + npq, T(0));
              std::fill(ds + npr, ds + npq, T(0));
              // and start at first + r: before it too (score_row masks S there)
              const int64_t skipped = std::clamp<int64_t>(first + r, 0, nr);
              std::fill(s, s + skipped, T(0));
              std::fill(ds, ds + skipped, T(0));
              if (dropout) std::fill(zt.data() + r * np + npr, zt.data() + r * np + npq, T(0));
              const T f = score_row<scalar_t, T>(ps, s, nr, npr, b, h, i, j0, unscaled, t);
              probabilities_row(ps, drop, s, dropout ? zt.data() + r * np : nullptr, ds, nr, npr, shift_of(row), f, b,
                                h, i, j0);
              // dS = P (dP - D); through the softcap times d(softcap tanh(x / softcap)) / dx = 1 - tanh^2,
              // in the same pass unless the mask's gradient takes dS in between
              const Vec d(delta[row]), one(T(1));
              if (softcap && dmask == nullptr) {
                for (int64_t j = 0; j < npr; j += VS) {
                  const Vec tj = Vec::loadu(t + j);
                  (Vec::loadu(s + j) * (Vec::loadu(ds + j) - d) * (one - tj * tj)).store(ds + j);
                }
              } else {
                for (int64_t j = 0; j < npr; j += VS)
                  (Vec::loadu(s + j) * (Vec::loadu(ds + j) - d)).store(ds + j);
                if (dmask != nullptr) {
                  T* dm = dmask + b * ps.dmask_stride[0] + h * ps.dmask_stride[1] + i * ps.dmask_stride[2] +
                          j0 * ps.dmask_stride[3];
                  for (int64_t j = 0; j < nr; ++j) dm[j * ps.dmask_stride[3]] += ds[j];
                }
                for (int64_t j = 0; softcap && j < npr; j += VS) {
                  const Vec tj = Vec::loadu(t + j);
                  (Vec::loadu(ds + j) * (one - tj * tj)).store(ds + j);
                }
              }
              products.finish_row(r, z, ds);
            }
            if (!from_probs) products.add_dv(dv_acc.data(), dropout ? zt.data() : pt.data());
            products.add_dq(dq_acc + (g * L + i0) * Ep, dst.data());
            products.add_dk(dk_acc.data(), dst.data());
          }
        }

        scalar_t* dk_bh = static_cast<scalar_t*>(ps.dk) + b * ps.dk_stride[0] + hk * ps.dk_stride[1];
        const T* dk_rows = products.key_rows(dk_acc.data(), Ep, n);
        for (int64_t j = 0; j < n; ++j)
          store_row(dk_bh + (j0 + j) * ps.dk_stride[2], ps.dk_stride[3], dk_rows + j * Ep, E, dk_mul);
        if (!from_probs) {
          scalar_t* dv_bh = static_cast<scalar_t*>(ps.dv) + b * ps.dv_stride[0] + hk * ps.dv_stride[1];
          const T* dv_rows = products.key_rows(dv_acc.data(), Evp, n);
          for (int64_t j = 0; j < n; ++j)
            store_row(dv_bh + (j0 + j) * ps.dv_stride[2], ps.dv_stride[3], dv_rows + j * Evp, Ev, T(1));
        }
      }

      if (chunks > 1) continue;  // summed below
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dq_bh = static_cast<scalar_t*>(ps.dq) + b * ps.dq_stride[0] + (hk * group + g) * ps.dq_stride[1];
        for (int64_t i = 0; i < ps.L; ++i)
          store_row(dq_bh + i * ps.dq_stride[2], ps.dq_stride[3], dq_acc + (g * L + i) * Ep, E, dq_mul);
      }
    }
  };
  if (packed) {
    // A task's cost: the (query, key) pairs its query group sees, plus a per-row and per-key part.
    std::vector<double> cost(heads, 0.0);
    for (int64_t b = 0; b < B; ++b) {
      const AttnBwdParams s = sequence_view<scalar_t>(p, b);
      double pairs = 0;  // per block of rows, its middle row's keys (exact where they grow linearly)
      for (int64_t i0 = 0; i0 < s.L; i0 += kMaxQTile) {
        const int64_t m = std::min(kMaxQTile, s.L - i0);
        const KeyRange keys = visible_key_range(s, i0 + m / 2);
        pairs += double(m) * double(std::max<int64_t>(keys.end - keys.begin, 0));
      }
      const double c = double(group) * (pairs + 2.0 * double(s.L) * double(E + Ev)) + 2.0 * double(s.S) * double(E + Ev);
      for (int64_t hk = 0; hk < Hkv; ++hk) cost[b * Hkv + hk] = c;
    }
    parallel_tasks_balanced(cost, run_tasks);
  } else {
    parallel_tasks(heads * chunks, 1, run_tasks);
  }
  if (chunks == 1) return;

  // dQ = the sum of the chunks' partial sums, row by row.
  parallel_tasks(B * Hq * L, 64, [&](int64_t begin, int64_t end) {
    SequenceViews<scalar_t, AttnBwdParams> views(p);
    std::vector<T> row(Ep);
    for (int64_t bhi = begin; bhi < end; ++bhi) {
      const int64_t i = bhi % L, h = (bhi / L) % Hq, b = bhi / (L * Hq);
      const AttnBwdParams& ps = views.of(b);
      if (i >= ps.L) continue;
      const int64_t hk = h / group, g = h % group;
      const T* part = dq_partial.data() + (hk * B + b) * chunks * dq_size + (g * L + i) * Ep;
      std::fill(row.begin(), row.end(), T(0));
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t e = 0; e < Ep; e += VS)
          (Vec::loadu(row.data() + e) + Vec::loadu(part + c * dq_size + e)).store(row.data() + e);
      store_row(static_cast<scalar_t*>(ps.dq) + b * ps.dq_stride[0] + h * ps.dq_stride[1] + i * ps.dq_stride[2],
                ps.dq_stride[3], row.data(), E, dq_mul);
    }
  });
}

template <typename scalar_t>
void backward_kernel(const AttnBwdParams& p) {
  backward_driver<scalar_t, VecBackwardProducts<scalar_t>>(p);
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

#if !defined(ATTN_EXT_OWN_ENTRY_POINTS)  // the amx unit defines its own
void attention_forward(const AttnParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { forward_kernel<decltype(tag)>(params); });
}

void attention_backward(const AttnBwdParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { backward_kernel<decltype(tag)>(params); });
}
#endif

}  // namespace attn_ext::cpu::CPU_CAPABILITY
