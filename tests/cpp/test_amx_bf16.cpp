// attn_ext: standalone test and micro-benchmark of csrc/cpu/amx_bf16.h (no torch needed).
// Build:  g++ -O2 -std=c++17 tests/cpp/test_amx_bf16.cpp -o /tmp/test_amx_bf16
//         (no ISA flags: amx_bf16.h enables its own; CMake builds it too and ctest runs it)
// Run:    /tmp/test_amx_bf16 [--bench]   (prints "skipped: ..." and exits 0 without AVX512-BF16;
//         without AMX it tests and times everything but the tiles)
#include "../../csrc/cpu/amx_bf16.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }


namespace amx = attn_ext::cpu::amx;

int passed = 0, failed = 0;

void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }
// Scalar reference: round-to-nearest-even; NaN -> quiet NaN; denormals flushed to (signed) zero as
// vcvtneps2bf16 does.
uint16_t ref_bf16(float x) {
  uint32_t u = bits_of(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000);  // zero / denormal
  u += 0x7fffu + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
bool same_bf16(uint16_t got, uint16_t want) {
  if (std::isnan(bf16_to_float(want))) return std::isnan(bf16_to_float(got));
  return got == want;
}

std::mt19937 rng(12345);
float uniform(float lo = -1.f, float hi = 1.f) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int64_t rand_int(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
std::vector<uint16_t> random_bf16(size_t n) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = ref_bf16(uniform());
  return v;
}

constexpr uint16_t kSentinel = 0xdead;  // must survive where the helpers do not write

// Naive VNNI layout of B (K x N, row stride rs) into Kp/2 x 2*Np.
std::vector<uint16_t> ref_vnni(const uint16_t* B, int64_t rs, int64_t K, int64_t N, int64_t Kp, int64_t Np) {
  std::vector<uint16_t> v(Kp * Np, 0);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) v[(k / 2) * 2 * Np + 2 * n + (k % 2)] = B[k * rs + n];
  return v;
}

// |got - (init + sum_k a[k sa] b[k sb])| relative to |init| + sum_k |a[k sa] b[k sb]|, for bf16 a and b
// (the products are exact in double): the error of one fp32-accumulated dot product.
double dot_rel_err(float got, double init, const uint16_t* a, int64_t sa, const uint16_t* b, int64_t sb, int64_t n) {
  double ref = init, mag = std::fabs(init);
  for (int64_t k = 0; k < n; ++k) {
    const double p = double(bf16_to_float(a[k * sa])) * bf16_to_float(b[k * sb]);
    ref += p;
    mag += std::fabs(p);
  }
  return std::fabs(got - ref) / (mag + 1e-30);
}

// The two products of one interface: amx::gemm (tiles) and amx::gemm_dots (AVX512-BF16).
using GemmFn = void (*)(int64_t, int64_t, int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t,
                        bool);
struct Gemm {
  const char* name;
  GemmFn fn;
};
constexpr Gemm kTiles{"gemm", &amx::gemm}, kDots{"gemm_dots", &amx::gemm_dots};

// ------------------------------------------------------------------------------------------------
void test_gemm(Gemm g, int64_t M, int64_t N, int64_t K, bool accumulate, int64_t lda_extra, int64_t ldc_extra) {
  const int64_t lda = K + lda_extra, ldc = N + ldc_extra;
  std::vector<uint16_t> A = random_bf16(M * lda), B = random_bf16(K * N);
  std::vector<uint16_t> Bv = ref_vnni(B.data(), N, K, N, K, N);
  std::vector<float> C(M * ldc);
  for (auto& c : C) c = uniform(-4.f, 4.f);
  const std::vector<float> C0 = C;
  g.fn(M, N, K, A.data(), lda, Bv.data(), 2 * N, C.data(), ldc, accumulate);
  double worst = 0;
  bool untouched = true;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n)
      worst = std::max(worst, dot_rel_err(C[m * ldc + n], accumulate ? C0[m * ldc + n] : 0.0, &A[m * lda], 1,
                                          &B[n], N, K));
    for (int64_t n = N; n < ldc; ++n) untouched &= bits_of(C[m * ldc + n]) == bits_of(C0[m * ldc + n]);
  }
  char what[160];
  std::snprintf(what, sizeof what, "%s M=%lld N=%lld K=%lld lda=%lld ldc=%lld acc=%d (rel err %.2e)", g.name,
                (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldc, int(accumulate), worst);
  check(worst < 2e-6, what);  // fp32 accumulation of exact bf16 products
  check(untouched, std::string(what) + ": wrote past N");
}

void test_pack_vnni_from_rows(int64_t K, int64_t N, int64_t Kp, int64_t Np, int64_t rs) {
  const std::vector<uint16_t> src = random_bf16(K * rs + 64);
  std::vector<uint16_t> dst(Kp * Np + 64, kSentinel);
  amx::pack_vnni_from_rows(dst.data(), src.data(), rs, K, N, Kp, Np);
  const std::vector<uint16_t> ref = ref_vnni(src.data(), rs, K, N, Kp, Np);
  bool ok = std::memcmp(dst.data(), ref.data(), ref.size() * 2) == 0;
  for (size_t i = ref.size(); i < dst.size(); ++i) ok &= dst[i] == kSentinel;
  check(ok, "pack_vnni_from_rows K=" + std::to_string(K) + " N=" + std::to_string(N) + " Kp=" + std::to_string(Kp) +
                " Np=" + std::to_string(Np) + " rs=" + std::to_string(rs));
}

void test_pack_vnni_from_transposed(int64_t N, int64_t K, int64_t Kp, int64_t Np, int64_t rs) {
  const std::vector<uint16_t> X = random_bf16(N * rs + 64);
  std::vector<uint16_t> B(K * N);  // B = X^T
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) B[k * N + n] = X[n * rs + k];
  std::vector<uint16_t> dst(Kp * Np + 64, kSentinel);
  amx::pack_vnni_from_transposed(dst.data(), X.data(), rs, N, K, Kp, Np);
  const std::vector<uint16_t> ref = ref_vnni(B.data(), N, K, N, Kp, Np);
  bool ok = std::memcmp(dst.data(), ref.data(), ref.size() * 2) == 0;
  for (size_t i = ref.size(); i < dst.size(); ++i) ok &= dst[i] == kSentinel;
  check(ok, "pack_vnni_from_transposed N=" + std::to_string(N) + " K=" + std::to_string(K) + " Kp=" +
                std::to_string(Kp) + " Np=" + std::to_string(Np) + " rs=" + std::to_string(rs));
}

// Floats that exercise the rounding: random magnitudes, exact ties (even and odd), near-ties,
// overflow to inf, specials, denormals.
std::vector<float> rounding_inputs(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t hi = static_cast<uint32_t>(rand_int(0, 0xffff)) << 16;
    switch (i % 8) {
      case 0: v[i] = uniform(-1e3f, 1e3f); break;
      case 1: v[i] = float_of(hi | 0x8000u); break;  // exact tie
      case 2: v[i] = float_of(hi | 0x7fffu); break;  // just below a tie
      case 3: v[i] = float_of(hi | 0x8001u); break;  // just above a tie
      case 4: v[i] = float_of(hi | static_cast<uint32_t>(rand_int(0, 0xffff))); break;  // any bits
      default: v[i] = uniform() * std::ldexp(1.f, int(rand_int(-60, 60))); break;
    }
    if (std::isnan(v[i]) && (i % 3)) v[i] = 1.5f;  // keep a few NaNs only
  }
  const float specials[] = {0.f,
                            -0.f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(),  // rounds to inf
                            float_of(0x3f808000u),              // 1 + 2^-8: tie, rounds down to even 1.0
                            float_of(0x3f818000u),              // tie, rounds up to even
                            std::numeric_limits<float>::denorm_min(),
                            -float_of(0x007fffffu)};
  for (size_t i = 0; i < sizeof specials / sizeof specials[0] && i < n; ++i) v[i * 7 % n] = specials[i];
  return v;
}

void test_convert_rows(int64_t M, int64_t K, int64_t Kp, int64_t lds, int64_t ldd) {
  const std::vector<float> src = rounding_inputs(M * lds + 16);
  std::vector<uint16_t> dst(M * ldd + 64, kSentinel);
  amx::convert_rows_to_bf16(dst.data(), ldd, src.data(), lds, M, K, Kp);
  bool ok = true;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < ldd; ++k) {
      const uint16_t got = dst[m * ldd + k];
      ok &= k < K ? same_bf16(got, ref_bf16(src[m * lds + k])) : k < Kp ? got == 0 : got == kSentinel;
    }
  for (size_t i = M * ldd; i < dst.size(); ++i) ok &= dst[i] == kSentinel;
  check(ok, "convert_rows_to_bf16 M=" + std::to_string(M) + " K=" + std::to_string(K) + " Kp=" + std::to_string(Kp));
}

// The VNNI panel of M fp32 rows (N wide, row stride lds) built row by row with vnni_row_from_f32,
// its rows M..Mp zeroed by zero_vnni_rows: bf16(src) in pack_vnni_from_rows' layout, zero past M
// and N, nothing written past the panel's 2 Np words a row (row stride ldd).
void test_vnni_rows_from_f32(int64_t M, int64_t N, int64_t Mp, int64_t Np, int64_t lds, int64_t ldd) {
  const std::vector<float> src = rounding_inputs(M * lds + 16);
  std::vector<uint16_t> dst((Mp / 2) * ldd + 64, kSentinel);
  for (int64_t r = 0; r < M; ++r) amx::vnni_row_from_f32(dst.data() + (r / 2) * ldd, r, src.data() + r * lds, N, Np);
  amx::zero_vnni_rows(dst.data(), ldd, M, Mp, Np);
  bool ok = true;
  for (int64_t kk = 0; kk < Mp / 2; ++kk)
    for (int64_t w = 0; w < ldd; ++w) {
      const uint16_t got = dst[kk * ldd + w];
      const int64_t row = 2 * kk + w % 2, n = w / 2;
      ok &= w >= 2 * Np ? got == kSentinel : row < M && n < N ? same_bf16(got, ref_bf16(src[row * lds + n])) : got == 0;
    }
  for (size_t i = (Mp / 2) * ldd; i < dst.size(); ++i) ok &= dst[i] == kSentinel;
  check(ok, "vnni_row_from_f32 + zero_vnni_rows M=" + std::to_string(M) + " N=" + std::to_string(N) +
                " Mp=" + std::to_string(Mp) + " Np=" + std::to_string(Np));
}

// The split VNNI panels (hi, lo) of M fp32 rows built row by row with split_vnni_row_from_f32, rows
// M..Mp zeroed: hi = bf16(x) and lo = bf16(x - hi) (split_rows_from_f32's split) in
// pack_vnni_from_rows' layout, zero past M and N, nothing written past 2 Np words a row.
void test_split_vnni_rows_from_f32(int64_t M, int64_t N, int64_t Mp, int64_t Np, int64_t lds, int64_t ldd) {
  const std::vector<float> src = rounding_inputs(M * lds + 16);
  std::vector<uint16_t> hi((Mp / 2) * ldd + 64, kSentinel), lo(hi.size(), kSentinel);
  for (int64_t r = 0; r < M; ++r)
    amx::split_vnni_row_from_f32(hi.data() + (r / 2) * ldd, lo.data() + (r / 2) * ldd, r, src.data() + r * lds, N, Np);
  amx::zero_vnni_rows(hi.data(), ldd, M, Mp, Np);
  amx::zero_vnni_rows(lo.data(), ldd, M, Mp, Np);
  bool ok = true;
  for (int64_t kk = 0; kk < Mp / 2; ++kk)
    for (int64_t w = 0; w < ldd; ++w) {
      const uint16_t h = hi[kk * ldd + w], l = lo[kk * ldd + w];
      const int64_t row = 2 * kk + w % 2, n = w / 2;
      if (w >= 2 * Np) {
        ok &= h == kSentinel && l == kSentinel;
      } else if (row < M && n < N) {
        const float x = src[row * lds + n];
        const uint16_t want_hi = ref_bf16(x);
        ok &= same_bf16(h, want_hi);
        if (!std::isnan(x) && !std::isinf(bf16_to_float(want_hi)))
          ok &= same_bf16(l, ref_bf16(x - bf16_to_float(want_hi)));
      } else {
        ok &= h == 0 && l == 0;
      }
    }
  for (size_t i = (Mp / 2) * ldd; i < hi.size(); ++i) ok &= hi[i] == kSentinel && lo[i] == kSentinel;
  check(ok, "split_vnni_row_from_f32 + zero_vnni_rows M=" + std::to_string(M) + " N=" + std::to_string(N) +
                " Mp=" + std::to_string(Mp) + " Np=" + std::to_string(Np));
}

void test_transpose_f32(int64_t M, int64_t K, int64_t lds, int64_t ldd) {
  std::vector<float> src(M * lds + 16);
  for (auto& x : src) x = uniform();
  const float sentinel = -1234.5f;
  std::vector<float> dst(K * ldd + 16, sentinel);
  amx::transpose_f32(dst.data(), ldd, src.data(), lds, M, K);
  bool ok = true;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < ldd; ++m) ok &= dst[k * ldd + m] == (m < M ? src[m * lds + k] : sentinel);
  for (size_t i = K * ldd; i < dst.size(); ++i) ok &= dst[i] == sentinel;
  check(ok, "transpose_f32 M=" + std::to_string(M) + " K=" + std::to_string(K));
}

void test_copy_rows(int64_t M, int64_t K, int64_t Kp, int64_t lds, int64_t ldd) {
  const std::vector<uint16_t> src = random_bf16(M * lds + 16);
  std::vector<uint16_t> dst(M * ldd + 64, kSentinel);
  amx::copy_rows_bf16(dst.data(), ldd, src.data(), lds, M, K, Kp);
  bool ok = true;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < ldd; ++k) {
      const uint16_t got = dst[m * ldd + k];
      ok &= k < K ? got == src[m * lds + k] : k < Kp ? got == 0 : got == kSentinel;
    }
  check(ok, "copy_rows_bf16 M=" + std::to_string(M) + " K=" + std::to_string(K) + " Kp=" + std::to_string(Kp));
}

// The value of a float16 bit pattern (scalar, exact).
double half_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  const double mag = exp == 0 ? std::ldexp(double(man), -24) : std::ldexp(double(1024 + man), exp - 25);
  return sign ? -mag : mag;
}

// Split bfloat16 of float16 rows: every finite float16 value (all 63488 patterns, in rows of K
// with row stride lds) is exactly hi + lo, hi = bf16(x); zero in K..Kp; nothing written past.
void test_split_rows_from_f16(int64_t K, int64_t Kp, int64_t lds, int64_t ldd) {
  std::vector<uint16_t> all;
  for (uint32_t h = 0; h < 0x10000u; ++h)
    if (((h >> 10) & 0x1f) != 0x1f) all.push_back(static_cast<uint16_t>(h));  // finite
  const int64_t M = (int64_t(all.size()) + K - 1) / K;
  std::vector<uint16_t> src(M * lds, 0);
  for (size_t i = 0; i < all.size(); ++i) src[(i / K) * lds + i % K] = all[i];
  std::vector<uint16_t> hi(M * ldd + 64, kSentinel), lo(M * ldd + 64, kSentinel);
  amx::split_rows_from_f16(hi.data(), ldd, lo.data(), ldd, src.data(), lds, M, K, Kp);
  bool ok = true;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < ldd; ++k) {
      const uint16_t h = hi[m * ldd + k], l = lo[m * ldd + k];
      if (k < K) {
        const double x = half_value(src[m * lds + k]);
        ok &= same_bf16(h, ref_bf16(static_cast<float>(x))) &&
              double(bf16_to_float(h)) + double(bf16_to_float(l)) == x;
      } else {
        ok &= k < Kp ? h == 0 && l == 0 : h == kSentinel && l == kSentinel;
      }
    }
  for (size_t i = M * ldd; i < hi.size(); ++i) ok &= hi[i] == kSentinel && lo[i] == kSentinel;
  check(ok, "split_rows_from_f16 K=" + std::to_string(K) + " Kp=" + std::to_string(Kp));
}

// Split bfloat16 of fp32 rows: hi = bf16(x), lo = bf16(x - hi), |x - (hi + lo)| <= 2^-17 |x| for
// normal x (the rounding inputs: ties, extremes, denormals flushed as vcvtneps2bf16 does).
void test_split_rows_from_f32(int64_t M, int64_t K, int64_t Kp, int64_t lds, int64_t ldd) {
  const std::vector<float> src = rounding_inputs(M * lds + 16);
  std::vector<uint16_t> hi(M * ldd + 64, kSentinel), lo(M * ldd + 64, kSentinel);
  amx::split_rows_from_f32(hi.data(), ldd, lo.data(), ldd, src.data(), lds, M, K, Kp);
  bool ok = true;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < ldd; ++k) {
      const uint16_t h = hi[m * ldd + k], l = lo[m * ldd + k];
      if (k < K) {
        const float x = src[m * lds + k];
        const uint16_t want_hi = ref_bf16(x);
        ok &= same_bf16(h, want_hi);
        if (std::isnan(x) || std::isinf(bf16_to_float(want_hi))) continue;
        ok &= same_bf16(l, ref_bf16(x - bf16_to_float(want_hi)));
        if (std::fpclassify(x) == FP_NORMAL && std::fabs(x) > 1e-30f)
          ok &= std::fabs(double(x) - bf16_to_float(h) - bf16_to_float(l)) <= std::ldexp(std::fabs(double(x)), -17);
      } else {
        ok &= k < Kp ? h == 0 && l == 0 : h == kSentinel && l == kSentinel;
      }
    }
  check(ok, "split_rows_from_f32 M=" + std::to_string(M) + " K=" + std::to_string(K) + " Kp=" + std::to_string(Kp));
}

// The attention pattern end to end: S = Q K^T with fp32 Q converted + padded and K^T VNNI-packed from
// K's rows, then O = P^T-style product using the transposing conversion. Ragged sizes everywhere.
// Decoding's dot products: S = Q X^T (Q zero-padded to whole 32-column chunks), then O += P V.
void test_dot_rows(int64_t M, int64_t N, int64_t K, int64_t ldx_extra) {
  const int64_t Kp = round_up(K, 32), ldx = K + ldx_extra, lds = round_up(N, 16) + 16;
  std::vector<uint16_t> Q = random_bf16(M * Kp), X = random_bf16(N * ldx);
  for (int64_t m = 0; m < M; ++m) std::fill(Q.begin() + m * Kp + K, Q.begin() + (m + 1) * Kp, uint16_t(0));
  std::vector<float> S(M * lds, -7.f);
  amx::dot_rows_bf16(S.data(), lds, Q.data(), Kp, M, X.data(), ldx, N, K);
  double worst = 0;
  bool untouched = true;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t j = 0; j < N; ++j)
      worst = std::max(worst, dot_rel_err(S[m * lds + j], 0.0, &Q[m * Kp], 1, &X[j * ldx], 1, K));
    for (int64_t j = N; j < lds; ++j) untouched &= S[m * lds + j] == -7.f;
  }
  const std::string what = "dot_rows_bf16 M=" + std::to_string(M) + " N=" + std::to_string(N) +
                           " K=" + std::to_string(K) + " (rel err " + std::to_string(worst) + ")";
  check(worst < 2e-6, what);
  check(untouched, what + ": wrote past N");
}

void test_add_pv_rows(int64_t M, int64_t N, int64_t C, int64_t ldv_extra) {
  const int64_t ldp = round_up(N, 32), ldv = C + ldv_extra, ldo = round_up(C, 16) + 16;
  std::vector<uint16_t> P = random_bf16(M * ldp), V = random_bf16(N * ldv);
  for (int64_t m = 0; m < M; ++m) std::fill(P.begin() + m * ldp + N, P.begin() + (m + 1) * ldp, uint16_t(0));
  std::vector<float> O(M * ldo);
  for (auto& o : O) o = uniform(-4.f, 4.f);
  const std::vector<float> O0 = O;
  amx::add_pv_rows_bf16(O.data(), ldo, P.data(), ldp, M, V.data(), ldv, N, C);
  double worst = 0;
  bool untouched = true;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < C; ++c)
      worst = std::max(worst, dot_rel_err(O[m * ldo + c], O0[m * ldo + c], &P[m * ldp], 1, &V[c], ldv, N));
    for (int64_t c = C; c < ldo; ++c) untouched &= bits_of(O[m * ldo + c]) == bits_of(O0[m * ldo + c]);
  }
  const std::string what = "add_pv_rows_bf16 M=" + std::to_string(M) + " N=" + std::to_string(N) +
                           " C=" + std::to_string(C) + " (rel err " + std::to_string(worst) + ")";
  check(worst < 2e-6, what);
  check(untouched, what + ": wrote past C");
}

void test_pipeline(Gemm g, int64_t L, int64_t S, int64_t E) {
  const int64_t Lp = round_up(L, 32), Sp = round_up(S, 32), Ep = round_up(E, 32);
  std::vector<float> Q(L * E);
  for (auto& x : Q) x = uniform();
  const std::vector<uint16_t> Kt = random_bf16(S * E);  // K: S x E bf16
  // S = Q K^T: A = bf16(Q) (Lp x Ep), B = K^T (E x S) packed from K's rows.
  std::vector<uint16_t> Qb(Lp * Ep, 0), Kv(Ep * Sp);
  amx::convert_rows_to_bf16(Qb.data(), Ep, Q.data(), E, L, E, Ep);
  amx::pack_vnni_from_transposed(Kv.data(), Kt.data(), E, S, E, Ep, Sp);
  std::vector<float> Sc(Lp * Sp);
  g.fn(Lp, Sp, Ep, Qb.data(), Ep, Kv.data(), 2 * Sp, Sc.data(), Sp, false);
  // T = S^T Q' where Q' = bf16(Q) (L x E), as the backward sums dK: T^T = Q'^T bf16(S) with A = Q'^T
  // (Ep x Lp: Q' packed from rows, then its 32-bit words transposed) and B = bf16(S) as a VNNI panel
  // of its rows (row by row, vnni_row_from_f32), then T^T back to rows (transpose_f32).
  std::vector<uint16_t> Qv(Lp * Ep), Qt(Ep * Lp), Sv((Lp / 2) * (2 * Sp + 32));
  amx::pack_vnni_from_rows(Qv.data(), Qb.data(), Ep, L, E, Lp, Ep);
  amx::pack_vnni_from_transposed(Qt.data(), Qv.data(), 2 * Ep, Lp / 2, 2 * Ep, 2 * Ep, Lp / 2);
  const int64_t ldv = 2 * Sp + 32;
  for (int64_t l = 0; l < L; ++l) amx::vnni_row_from_f32(Sv.data() + (l / 2) * ldv, l, Sc.data() + l * Sp, S, Sp);
  amx::zero_vnni_rows(Sv.data(), ldv, L, Lp, Sp);
  std::vector<float> Tt(Ep * (Sp + 16)), T(Sp * Ep);
  g.fn(Ep, Sp, Lp, Qt.data(), Lp, Sv.data(), ldv, Tt.data(), Sp + 16, false);
  amx::transpose_f32(T.data(), Ep, Tt.data(), Sp + 16, Ep, Sp);
  double err = 0, norm = 0;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t e = 0; e < E; ++e) {
      double ref = 0;
      for (int64_t l = 0; l < L; ++l) {
        double sc = 0;
        for (int64_t k = 0; k < E; ++k) sc += double(bf16_to_float(ref_bf16(Q[l * E + k]))) * bf16_to_float(Kt[s * E + k]);
        ref += double(bf16_to_float(ref_bf16(float(sc)))) * bf16_to_float(ref_bf16(Q[l * E + e]));
      }
      err += (T[s * Ep + e] - ref) * (T[s * Ep + e] - ref);
      norm += ref * ref;
    }
  const double rel = std::sqrt(err / norm);
  check(rel < 1e-2, std::string(g.name) + " pipeline L=" + std::to_string(L) + " S=" + std::to_string(S) + " E=" + std::to_string(E) +
                        " rel err " + std::to_string(rel));  // bf16 rounding of S dominates
}

// ------------------------------------------------------------------------------------------------
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double tsc_ghz() {
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t c0 = __rdtsc();
  while (seconds_since(t0) < 0.05) {
  }
  return (__rdtsc() - c0) / seconds_since(t0) / 1e9;
}

// 64-byte aligned buffer (+ offset bytes, to show the cost of misaligned rows).
template <class T>
struct Buffer {
  explicit Buffer(size_t n, size_t offset = 0) : raw(new char[n * sizeof(T) + 128]) {
    const uintptr_t p = (reinterpret_cast<uintptr_t>(raw.get()) + 63) & ~uintptr_t(63);
    data = reinterpret_cast<T*>(p + offset);
  }
  std::unique_ptr<char[]> raw;
  T* data;
};

// peak: the product's FLOP/cycle on one core (AMX-BF16: 1024; vdpbf16ps: 64 per 512-bit port).
void bench_gemm(Gemm g, double peak, int64_t M, int64_t N, int64_t K, double ghz, size_t offset = 0) {
  Buffer<uint16_t> A(M * K, offset), Bv(K * N, offset);
  Buffer<float> C(M * N, offset);
  const std::vector<uint16_t> a = random_bf16(M * K), b = random_bf16(K * N);
  std::copy(a.begin(), a.end(), A.data);
  std::copy(b.begin(), b.end(), Bv.data);
  std::fill(C.data, C.data + M * N, 0.f);
  for (int acc = 0; acc < 2; ++acc) {
    for (int i = 0; i < 200; ++i) g.fn(M, N, K, A.data, K, Bv.data, 2 * N, C.data, N, acc);
    double best = 1e30;  // best of 20 rounds: the machine may be shared
    for (int r = 0; r < 20; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 200; ++i) g.fn(M, N, K, A.data, K, Bv.data, 2 * N, C.data, N, acc);
      best = std::min(best, seconds_since(t0) / 200);
    }
    const double gflops = 2.0 * M * N * K / best / 1e9;
    std::printf("%-9s M=%-4lld N=%-4lld K=%-4lld acc=%d%s: %7.1f GFLOP/s = %5.1f FLOP/cycle at %.2f GHz (%2.0f%% of %.0f)\n",
                g.name, (long long)M, (long long)N, (long long)K, acc, offset ? " rows misaligned" : "", gflops,
                gflops / ghz, ghz, 100.0 * gflops / ghz / peak, peak);
  }
}

template <class F>
void bench_helper(const char* what, F&& f) {
  for (int i = 0; i < 200; ++i) f();
  double best = 1e30;
  for (int r = 0; r < 20; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 100; ++i) f();
    best = std::min(best, seconds_since(t0) / 100);
  }
  std::printf("%-58s %8.0f ns\n", what, best * 1e9);
}

void bench(bool tiles) {
  const double ghz = tsc_ghz();  // the TSC rate; the core may run faster (turbo)
  std::printf("single thread, 64-byte aligned buffers unless said, lda = K, ldc = N, best of 20 rounds\n");
  for (Gemm g : {kTiles, kDots}) {
    if (g.fn == kTiles.fn && !tiles) continue;
    const double peak = g.fn == kTiles.fn ? 1024 : 128;  // vdpbf16ps: 2 ports x 64 (Intel; Zen 4: 1 x 64)
    if (g.fn == kTiles.fn) amx::configure_tiles();
    bench_gemm(g, peak, 256, 128, 64, ghz);
    bench_gemm(g, peak, 64, 256, 128, ghz);
    bench_gemm(g, peak, 256, 64, 256, ghz);
    bench_gemm(g, peak, 64, 64, 64, ghz);
    bench_gemm(g, peak, 256, 128, 64, ghz, 32);  // every row straddles two cache lines
    if (g.fn == kTiles.fn) amx::release_tiles();
  }
  // The helpers on a 64 x 128 (bf16 or fp32) block, the size of one attention tile.
  std::vector<uint16_t> src = random_bf16(128 * 128), dst(128 * 128);
  std::vector<float> srcf(128 * 128, 0.5f);
  bench_helper("pack_vnni_from_rows        K=64  N=128 (V, 64x128)",
               [&] { amx::pack_vnni_from_rows(dst.data(), src.data(), 128, 64, 128, 64, 128); });
  bench_helper("pack_vnni_from_transposed  N=64  K=128 (K^T, K 64x128)",
               [&] { amx::pack_vnni_from_transposed(dst.data(), src.data(), 128, 64, 128, 128, 64); });
  bench_helper("convert_rows_to_bf16       M=64  K=128",
               [&] { amx::convert_rows_to_bf16(dst.data(), 128, srcf.data(), 128, 64, 128, 128); });
  bench_helper("vnni_row_from_f32 x 64      N=128",
               [&] {
                 for (int64_t r = 0; r < 64; ++r)
                   amx::vnni_row_from_f32(dst.data() + (r / 2) * 256, r, srcf.data() + r * 128, 128, 128);
               });
  bench_helper("transpose_f32              M=64  K=128",
               [&] { amx::transpose_f32(srcf.data() + 64 * 128, 64, srcf.data(), 128, 64, 128); });
}

}  // namespace

int main(int argc, char** argv) {
  if (!amx::cpu_has_avx512_bf16()) {
    std::printf("skipped: CPU or OS lacks AVX512-BF16 / AVX-512\n");
    return 0;
  }
  bool tiles = amx::cpu_has_amx_bf16();
  if (!tiles) {
    std::printf("no AMX-BF16 here: the tile product is skipped, the rest runs\n");
  } else if (!amx::request_amx_permission()) {
    std::printf("the OS refused the AMX tile-data permission (arch_prctl): the tile product is skipped\n");
    tiles = false;
  }
  if (argc > 1 && std::string(argv[1]) == "--bench") {
    bench(tiles);
    return 0;
  }

  if (tiles) amx::configure_tiles();
  const int64_t sizes[] = {16, 32, 48, 64, 80, 112, 256};
  for (Gemm g : {kTiles, kDots}) {
    if (g.fn == kTiles.fn && !tiles) continue;
    for (int64_t M : sizes)
      for (int64_t N : sizes)
        for (int64_t K : {32, 64, 96, 256})
          for (bool acc : {false, true}) {
            if ((M * N * K) % 3 != 0 && M > 64 && N > 64) continue;  // thin the big cases out a little
            test_gemm(g, M, N, K, acc, (M + N) % 2 ? 0 : 40, (N + K) % 2 ? 0 : 24);
          }
    test_gemm(g, 32, 32, 32, true, 7, 3);  // odd leading dimensions (unaligned rows)
    test_gemm(g, 48, 80, 160, false, 1, 5);
    test_pipeline(g, 37, 53, 24);
    test_pipeline(g, 64, 128, 64);
    test_pipeline(g, 100, 30, 72);
  }
  for (int r = 0; r < 40; ++r) {
    const int64_t K = rand_int(1, 200), N = rand_int(1, 200);
    const int64_t Kp = round_up(K, 32) + 32 * rand_int(0, 1), Np = round_up(N, 16) + 16 * rand_int(0, 1);
    test_pack_vnni_from_rows(K, N, Kp, Np, N + rand_int(0, 9));
    test_pack_vnni_from_transposed(N, K, Kp, Np, K + rand_int(0, 9));
    const int64_t M = rand_int(1, 100), Kq = round_up(K, 32) + rand_int(0, 40);
    test_convert_rows(M, K, Kq, K + rand_int(0, 9), Kq + rand_int(0, 20));
    const int64_t Mp = round_up(M, 32) + 32 * rand_int(0, 1), Np16 = round_up(K, 16) + 16 * rand_int(0, 1);
    test_vnni_rows_from_f32(M, K, Mp, Np16, K + rand_int(0, 9), 2 * Np16 + 32 * rand_int(0, 2));
    test_split_vnni_rows_from_f32(M, K, Mp, Np16, K + rand_int(0, 9), 2 * Np16 + 32 * rand_int(0, 2));
    test_transpose_f32(M, K, K + rand_int(0, 9), M + rand_int(0, 20));
    test_copy_rows(M, K, Kq, K + rand_int(0, 9), Kq + rand_int(0, 20));
  }
  for (auto [K, Kp, lds, ldd] : {std::array<int64_t, 4>{64, 64, 64, 64}, {40, 64, 45, 80}, {200, 224, 203, 256},
                                  {17, 32, 17, 48}})
    test_split_rows_from_f16(K, Kp, lds, ldd);
  for (int r = 0; r < 10; ++r) {
    const int64_t K = rand_int(1, 200), Kp = round_up(K, 16) + 16 * rand_int(0, 1), M = rand_int(1, 40);
    test_split_rows_from_f32(M, K, Kp, K + rand_int(0, 9), Kp + rand_int(0, 20));
  }
  test_pack_vnni_from_rows(64, 128, 64, 128, 128);  // exact sizes, no padding
  test_pack_vnni_from_transposed(64, 128, 128, 64, 128);
  for (int64_t M : {1, 2})
    for (int64_t N : {1, 2, 15, 16, 17, 33, 100})
      for (int64_t K : {8, 24, 32, 64, 96, 128, 200, 256}) {
        test_dot_rows(M, N, K, (N + K) % 3 == 0 ? 0 : 5);
        test_add_pv_rows(M, N, K, (N + K) % 2 == 0 ? 0 : 3);
      }
  if (tiles) amx::release_tiles();

  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
