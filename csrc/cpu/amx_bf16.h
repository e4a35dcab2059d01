// attn_ext: hand-written AMX-BF16 and AVX512-BF16 primitives (header only, intrinsics only).
//
// The availability checks (request_amx_permission, cpu_has_amx_bf16, cpu_has_avx512_bf16) are
// plain code that any unit may call (dispatch.cpp does). Everything after them is compiled for
// AVX-512 + AVX512-BF16 + AMX through a target pragma, so the unit that runs it
// (attention_kernel_amx.cpp) keeps avx512's flags for the rest of its code; call the tile code
// (configure_tiles, gemm) only after cpu_has_amx_bf16() and request_amx_permission(), the rest
// after cpu_has_avx512_bf16().
// No torch/ATen/c10 here: bf16 values are raw bits in uint16_t.
//
// Usage per thread (the tile configuration is per-thread state):
//   configure_tiles();            // at the start of each parallel-region chunk
//   ... pack / convert / gemm ...  // any number of calls
//   release_tiles();              // at the end of the chunk
// gemm() assumes the configuration of configure_tiles() is loaded; gemm_dots() (the same product
// with AVX512-BF16 dot products, for CPUs without tiles), the packing and conversion helpers and
// the decoding products need none.
//
// Layouts (all row-major, strides in elements):
//   A  : M x K bf16, row stride lda.                       (the left operand)
//   Bv : B (K x N) in VNNI layout: K/2 rows of 2*N bf16, element (kk, 2n + t) = B[2kk + t][n];
//        i.e. the 32-bit word (kk, n) holds the pair B[2kk][n], B[2kk+1][n]. Row stride ldb >= 2*N.
//   C  : M x N float32, row stride ldc.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>

#include "prefetch.h"

#include <cpuid.h>
#include <immintrin.h>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace attn_ext {
namespace cpu {
namespace amx {

// ---------------------------------------------------------------------------------------------
// Availability.
// ---------------------------------------------------------------------------------------------

// Asks Linux (>= 5.16) for permission to use the AMX tile data state in this process, as oneDNN
// does. Without it ldtilecfg still works, but the first instruction touching tile data (tilezero,
// tileloadd, ...) raises SIGILL. The permission is process-wide (all threads, present and future),
// so one successful call from any thread suffices. Thread-safe, idempotent.
inline bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  static const bool granted = [] {
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
    unsigned long long bitmask = 0;  // double-check what the kernel now allows us
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bitmask) != 0) return false;
    return (bitmask & (1ULL << kXfeatureXtiledata)) != 0;
  }();
  return granted;
#else
  return false;
#endif
}

namespace detail {

// The CPUID and XCR0 checks: AVX-512 F/BW/VL/DQ, AVX512-BF16, FMA and F16C (which the including TU
// is compiled with), the OS's AVX-512 state, and with `tiles` AMX-TILE, AMX-BF16 and their state.
inline bool cpu_has_bf16_units(bool tiles) {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return false;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave || !fma || !f16c) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const unsigned max_subleaf = a;
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
  const bool amx = (d & (1u << 22)) && (d & (1u << 24));                                           // BF16, TILE
  if (!avx512 || (tiles && !amx) || max_subleaf < 1) return false;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;  // AVX512-BF16
  unsigned xcr0_lo, xcr0_hi;  // xgetbv by hand: _xgetbv() would need -mxsave
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM (+ XTILECFG, XTILEDATA).
  const unsigned need = (1u << 1) | (1u << 2) | (1u << 5) | (1u << 6) | (1u << 7) | (tiles ? (1u << 17) | (1u << 18) : 0u);
  return (xcr0_lo & need) == need;
}

}  // namespace detail

// True when the CPU has AMX-TILE, AMX-BF16, AVX512-BF16 and AVX-512 F/BW/VL/DQ (+ FMA, F16C) and the
// OS enabled the AVX-512 and AMX states in XCR0. Does not ask for the AMX permission: see
// request_amx_permission().
inline bool cpu_has_amx_bf16() {
  static const bool has = detail::cpu_has_bf16_units(true);
  return has;
}

// True when everything here but the tiles can run: AVX-512 F/BW/VL/DQ, AVX512-BF16 (+ FMA, F16C) and
// the OS's AVX-512 state (AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids and later):
// gemm_dots(), the packing and conversion helpers and the decoding products.
inline bool cpu_has_avx512_bf16() {
  static const bool has = detail::cpu_has_bf16_units(false);
  return has;
}

}  // namespace amx
}  // namespace cpu
}  // namespace attn_ext

// From here on: AVX-512, AVX512-BF16 and AMX code, whatever the unit's flags.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,fma,f16c")
#endif
#include "lane_sums.h"

namespace attn_ext {
namespace cpu {
namespace amx {

// ---------------------------------------------------------------------------------------------
// Tile configuration.
// ---------------------------------------------------------------------------------------------

// The 64-byte ldtilecfg operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of each tile
  uint8_t rows[16];    // rows of each tile
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg operand must be 64 bytes");

// Loads the configuration used by gemm(): all 8 tiles 16 rows x 64 bytes
// (C tiles: 16 x 16 fp32; A tiles: 16 x 32 bf16; B tiles: 16 VNNI rows x 16 pairs of bf16).
// Per-thread state: call once per thread at the start of each parallel-region chunk.
inline void configure_tiles() {
  static const TileConfig cfg = [] {
    TileConfig c;
    std::memset(&c, 0, sizeof(c));
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      c.colsb[t] = 64;
      c.rows[t] = 16;
    }
    return c;
  }();
  _tile_loadconfig(&cfg);
}

// Returns the tile state to init (tilerelease); call at the end of the chunk.
inline void release_tiles() { _tile_release(); }


// ---------------------------------------------------------------------------------------------
// The product.
// ---------------------------------------------------------------------------------------------

namespace detail {

// One register block of C: (TWO_M ? 32 : 16) x (TWO_N ? 32 : 16) outputs at C, over all of K.
// Tiles: 0..3 C (0 = top-left, 1 = top-right, 2 = bottom-left, 3 = bottom-right), 4-5 A, 6-7 B.
// Tile numbers must be literals (the intrinsics paste them into the asm), hence the if constexpr.
template <bool TWO_M, bool TWO_N>
inline void gemm_block(int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t ldb, float* C,
                       int64_t ldc, bool accumulate) {
  const long sa = lda * 2, sb = ldb * 2, sc = ldc * 4;  // byte strides
  if (accumulate) {
    _tile_loadd(0, C, sc);
    if constexpr (TWO_N) _tile_loadd(1, C + 16, sc);
    if constexpr (TWO_M) _tile_loadd(2, C + 16 * ldc, sc);
    if constexpr (TWO_M && TWO_N) _tile_loadd(3, C + 16 * ldc + 16, sc);
  } else {
    _tile_zero(0);
    if constexpr (TWO_N) _tile_zero(1);
    if constexpr (TWO_M) _tile_zero(2);
    if constexpr (TWO_M && TWO_N) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    const uint16_t* a = A + k;              // rows 0..15, columns k..k+31
    const uint16_t* b = Bv + (k / 2) * ldb;  // VNNI rows k/2..k/2+15, columns 2n..2n+31
    _tile_loadd(4, a, sa);
    _tile_loadd(6, b, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TWO_N) {
      _tile_loadd(7, b + 32, sb);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (TWO_M) {
      _tile_loadd(5, a + 16 * lda, sa);
      _tile_dpbf16ps(2, 5, 6);
    }
    if constexpr (TWO_M && TWO_N) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, C, sc);
  if constexpr (TWO_N) _tile_stored(1, C + 16, sc);
  if constexpr (TWO_M) _tile_stored(2, C + 16 * ldc, sc);
  if constexpr (TWO_M && TWO_N) _tile_stored(3, C + 16 * ldc + 16, sc);
}

}  // namespace detail

// C (M x N fp32, row stride ldc) = [C +] A (M x K bf16, row stride lda) * B (K x N),
// B given in VNNI layout Bv (K/2 rows of 2*N bf16, row stride ldb >= 2*N; see pack_vnni_*).
// Preconditions: M % 16 == 0, N % 16 == 0, K % 32 == 0 (callers zero-pad A's columns and Bv's rows),
// lda >= K, ldc >= N, configure_tiles() done on this thread. accumulate: add to C, else overwrite it.
// A is read straight from its rows (any lda works: tileloadd takes any stride).
// Speed: align A, Bv and C to 64 bytes and keep lda % 32 == 0, ldc % 16 == 0, so that every tile row
// is one cache line: measured ~1.3-2x faster than rows straddling lines. (With that, pre-packing A
// into contiguous tiles measured no faster, so A is not packed.)
inline void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t ldb,
                 float* C, int64_t ldc, bool accumulate) {
  assert(M % 16 == 0 && N % 16 == 0 && K % 32 == 0);
  assert(lda >= K && ldb >= 2 * N && ldc >= N);
  int64_t i = 0;
  for (; i + 32 <= M; i += 32) {
    const uint16_t* a = A + i * lda;
    float* c = C + i * ldc;
    int64_t j = 0;
    for (; j + 32 <= N; j += 32) detail::gemm_block<true, true>(K, a, lda, Bv + 2 * j, ldb, c + j, ldc, accumulate);
    if (j < N) detail::gemm_block<true, false>(K, a, lda, Bv + 2 * j, ldb, c + j, ldc, accumulate);
  }
  if (i < M) {  // 16 rows left
    const uint16_t* a = A + i * lda;
    float* c = C + i * ldc;
    int64_t j = 0;
    for (; j + 32 <= N; j += 32) detail::gemm_block<false, true>(K, a, lda, Bv + 2 * j, ldb, c + j, ldc, accumulate);
    if (j < N) detail::gemm_block<false, false>(K, a, lda, Bv + 2 * j, ldb, c + j, ldc, accumulate);
  }
}

// ---------------------------------------------------------------------------------------------
// The same product without tiles: AVX512-BF16 dot products (vdpbf16ps) on vector registers.
// ---------------------------------------------------------------------------------------------

namespace detail {

// One register block of C: 8 rows x 16 NV columns at C, over all of K. For each pair of depths
// (2kk, 2kk + 1), the word (kk, n) of Bv holds the pair B[2kk][n], B[2kk + 1][n] and the word kk of
// an A row the pair A[i][2kk], A[i][2kk + 1]: one vdpbf16ps per row and vector adds both products
// (exact in fp32) to the fp32 sum. 8 NV accumulators + NV of B + one broadcast of A: 19 of the 32
// registers at NV = 2.
template <int NV>
inline void dots_block(int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bv, int64_t ldb, float* C,
                       int64_t ldc, bool accumulate) {
  constexpr int kRows = 8;
  __m512 acc[kRows][NV];  // unrolled loops keep it in registers (at -O2 too)
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? _mm512_loadu_ps(C + i * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    const uint16_t* b = Bv + kk * ldb;
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + 32 * v);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      uint32_t pair;
      std::memcpy(&pair, A + i * lda + 2 * kk, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, bv[v]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + i * ldc + 16 * v, acc[i][v]);
}

}  // namespace detail

// gemm()'s product, preconditions and layouts (M % 16 == 0, N % 16 == 0, K % 32 == 0; B in VNNI
// layout) on AVX512-BF16 alone: no tile state, no configure_tiles(). The sums run in another order
// than the tiles' (both add exact products in fp32). Column blocks of 32 (16 at the end): blocks of
// 48 measured no faster on Zen 4, where this reaches ~85 FLOP per TSC cycle on one core.
inline void gemm_dots(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* Bv,
                      int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  assert(M % 16 == 0 && N % 16 == 0 && K % 32 == 0);
  assert(lda >= K && ldb >= 2 * N && ldc >= N);
  for (int64_t i = 0; i < M; i += 8) {
    const uint16_t* a = A + i * lda;
    float* c = C + i * ldc;
    int64_t j = 0;
    for (; N - j >= 32; j += 32) detail::dots_block<2>(K, a, lda, Bv + 2 * j, ldb, c + j, ldc, accumulate);
    if (j < N) detail::dots_block<1>(K, a, lda, Bv + 2 * j, ldb, c + j, ldc, accumulate);
  }
}

// ---------------------------------------------------------------------------------------------
// Packing and conversion helpers (AVX-512 + AVX512-BF16 only; no tile state needed).
// ---------------------------------------------------------------------------------------------

namespace detail {

inline __mmask32 mask32(int64_t n) {  // the first clamp(n, 0, 32) lanes
  return n <= 0 ? 0 : n >= 32 ? 0xffffffffu : static_cast<__mmask32>((1u << n) - 1);
}
inline __mmask16 mask16(int64_t n) {  // the first clamp(n, 0, 16) lanes
  return n <= 0 ? 0 : n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1);
}

// In-register transpose of a 16 x 16 matrix of 32-bit words: r[i] word j  ->  r[j] word i.
// (The all-ones masked forms avoid GCC 12's bogus -Wuninitialized on _mm512_undefined_epi32.)
inline void transpose16x16_epi32(__m512i r[16]) {
  const __mmask16 all16 = 0xffff;
  const __mmask8 all8 = 0xff;
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_mask_unpacklo_epi32(r[i], all16, r[i], r[i + 1]);
    t[i + 1] = _mm512_mask_unpackhi_epi32(r[i], all16, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_mask_unpacklo_epi64(t[i], all8, t[i], t[i + 2]);
    r[i + 1] = _mm512_mask_unpackhi_epi64(t[i], all8, t[i], t[i + 2]);
    r[i + 2] = _mm512_mask_unpacklo_epi64(t[i + 1], all8, t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_mask_unpackhi_epi64(t[i + 1], all8, t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_mask_shuffle_i32x4(r[h + i], all16, r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_mask_shuffle_i32x4(r[h + i], all16, r[h + i], r[h + i + 4], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_mask_shuffle_i32x4(t[i], all16, t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_mask_shuffle_i32x4(t[i], all16, t[i], t[i + 8], 0xdd);
  }
}

inline __m256i cvt_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
inline __m512i cvt2_bf16(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }  // lo -> words 0..15

}  // namespace detail

// VNNI-pack B from its rows. src: B as K rows x N columns bf16, row stride rs.
// dst: Kp/2 rows x 2*Np bf16 (row stride 2*Np), element (kk, 2n + t) = B[2kk + t][n], zero where
// 2kk + t >= K or n >= N. Needs Kp % 2 == 0 (gemm wants Kp % 32 == 0), Np % 16 == 0, Kp >= K, Np >= N.
inline void pack_vnni_from_rows(uint16_t* dst, const uint16_t* src, int64_t rs, int64_t K, int64_t N, int64_t Kp,
                                int64_t Np) {
  assert(Kp % 2 == 0 && Np % 16 == 0 && Kp >= K && Np >= N);
  // idx_lo interleaves words 0..15 of a and b, idx_hi words 16..31 (b's words are 32..63).
  alignas(64) static const uint16_t kIdx[64] = {
      0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
      11, 43, 12, 44, 13, 45, 14, 46, 15, 47, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
      22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(kIdx), idx_hi = _mm512_load_si512(kIdx + 32);
  const __m512i zero = _mm512_setzero_si512();
  // rows far apart are asked for ahead (prefetch.h): a packed batch of 256-token sequences (8 heads
  // of 64, causal, Xeon model 167) ran its forward at 0.81-0.88x the speed of the same batch
  // contiguous, 0.92-0.98x with this
  prefetch_rows(src, 2 * rs, 0, std::min(K, kPrefetchRows), 2 * N);
  for (int64_t kk = 0; kk < Kp / 2; ++kk) {
    const uint16_t* r0 = 2 * kk < K ? src + 2 * kk * rs : nullptr;
    const uint16_t* r1 = 2 * kk + 1 < K ? src + (2 * kk + 1) * rs : nullptr;
    const int64_t ahead = 2 * kk + kPrefetchRows;
    prefetch_rows(src, 2 * rs, ahead, std::min(K, ahead + 2), 2 * N);
    uint16_t* d = dst + kk * 2 * Np;
    for (int64_t n = 0; n < Np; n += 32) {
      const __mmask32 m = detail::mask32(N - n);
      const __m512i a = r0 ? _mm512_maskz_loadu_epi16(m, r0 + n) : zero;
      const __m512i b = r1 ? _mm512_maskz_loadu_epi16(m, r1 + n) : zero;
      _mm512_storeu_si512(d + 2 * n, _mm512_permutex2var_epi16(a, idx_lo, b));
      if (n + 16 < Np) _mm512_storeu_si512(d + 2 * n + 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

// VNNI-pack B = X^T. src: X as N rows x K columns bf16, row stride rs (B[k][n] = X[n][k]).
// dst as in pack_vnni_from_rows: element (kk, 2n + t) = X[n][2kk + t], i.e. the 32-bit word (kk, n)
// is the word (n, kk) of X: a transpose of 32-bit words. Zero where 2kk + t >= K or n >= N.
// Needs Kp % 2 == 0, Np % 16 == 0, Kp >= K, Np >= N. (Of a VNNI panel of rows as X, whose words
// are pairs of rows, this is the rows' transpose.)
inline void pack_vnni_from_transposed(uint16_t* dst, const uint16_t* src, int64_t rs, int64_t N, int64_t K,
                                      int64_t Kp, int64_t Np) {
  assert(Kp % 2 == 0 && Np % 16 == 0 && Kp >= K && Np >= N);
  const int64_t KK = Kp / 2;
  prefetch_rows(src, 2 * rs, 0, std::min(N, kPrefetchRows), 2 * K);  // as pack_vnni_from_rows
  for (int64_t n0 = 0; n0 < Np; n0 += 16) {
    prefetch_rows(src, 2 * rs, n0 + kPrefetchRows, std::min(N, n0 + 16 + kPrefetchRows), 2 * K);
    for (int64_t kk0 = 0; kk0 < KK; kk0 += 16) {  // 16 x 16 words: X rows n0.., columns 2kk0..2kk0+31
      const __mmask32 m = detail::mask32(K - 2 * kk0);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = n0 + i < N ? _mm512_maskz_loadu_epi16(m, src + (n0 + i) * rs + 2 * kk0) : _mm512_setzero_si512();
      detail::transpose16x16_epi32(r);
      const int64_t rows = KK - kk0 < 16 ? KK - kk0 : 16;
      for (int64_t j = 0; j < rows; ++j) _mm512_storeu_si512(dst + (kk0 + j) * 2 * Np + 2 * n0, r[j]);
    }
  }
}

// dst[m][k] = bf16(src[m][k]) for m < M, k < K; dst[m][k] = 0 for K <= k < Kp. Rows >= M are not written.
// src: M x K fp32, row stride lds; dst: row stride ldd >= Kp.
// Rounding: round-to-nearest-even (vcvtne2ps2bf16), NaN stays NaN; denormal inputs/outputs are flushed to 0.
inline void convert_rows_to_bf16(uint16_t* dst, int64_t ldd, const float* src, int64_t lds, int64_t M, int64_t K,
                                 int64_t Kp) {
  assert(Kp >= K && ldd >= Kp);
  for (int64_t m = 0; m < M; ++m) {
    const float* s = src + m * lds;
    uint16_t* d = dst + m * ldd;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(d + k, detail::cvt2_bf16(_mm512_loadu_ps(s + k), _mm512_loadu_ps(s + k + 16)));
    for (; k < Kp; k += 32) {
      const __m512 lo = _mm512_maskz_loadu_ps(detail::mask16(K - k), s + k);
      const __m512 hi = _mm512_maskz_loadu_ps(detail::mask16(K - k - 16), s + k + 16);
      _mm512_mask_storeu_epi16(d + k, detail::mask32(Kp - k), detail::cvt2_bf16(lo, hi));
    }
  }
}

namespace detail {

// 16 bf16 values (bits) into the words of parity r % 2 of a VNNI panel's row from column j on: the
// words (r / 2, 2 (j + i) + r % 2) of the panel of rows, the other parity's left as they are.
inline void store_vnni_words(uint16_t* panel_row, int64_t r, int64_t j, __m256i bits) {
  const bool odd = r % 2 != 0;
  const __m512i w = _mm512_cvtepu16_epi32(bits);
  _mm512_mask_storeu_epi16(panel_row + 2 * j, odd ? 0xaaaaaaaau : 0x55555555u, odd ? _mm512_slli_epi32(w, 16) : w);
}

}  // namespace detail

// Row r of an fp32 tile into the VNNI panel of the tile's rows (as pack_vnni_from_rows lays them
// out): bf16(x[j]) as element (r / 2, 2j + r % 2), i.e. the words of parity r % 2 of the panel's
// row `panel_row`, for j < n, zero for n <= j < np (np % 16 == 0). The other parity's words are
// left as they are. (For P and dS as the B operand of dV^T = dO^T P and dK^T = Q^T dS, written as
// each row is finished, while it is in L1.) Rounding as convert_rows_to_bf16.
inline void vnni_row_from_f32(uint16_t* panel_row, int64_t r, const float* x, int64_t n, int64_t np) {
  for (int64_t j = 0; j < np; j += 16)
    detail::store_vnni_words(panel_row, r, j, detail::cvt_bf16(_mm512_maskz_loadu_ps(detail::mask16(n - j), x + j)));
}

// Rows [m, mp) of a VNNI panel of rows (row stride ldd, 2 np words each) to zero: the panel's rows
// from m / 2 on, of which row m / 2 only its odd words when m is odd.
inline void zero_vnni_rows(uint16_t* panel, int64_t ldd, int64_t m, int64_t mp, int64_t np) {
  for (int64_t kk = m / 2; kk < mp / 2; ++kk) {
    const __mmask32 words = 2 * kk < m ? 0xaaaaaaaau : 0xffffffffu;
    for (int64_t j = 0; j < 2 * np; j += 32)
      _mm512_mask_storeu_epi16(panel + kk * ldd + j, words, _mm512_setzero_si512());
  }
}

// dst[k][m] = src[m][k] for m < M, k < K, fp32. src: M x K, row stride lds; dst: K rows, row stride
// ldd >= M. (For dK^T and dV^T summed by gemm as C, back to rows of keys.)
inline void transpose_f32(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t M, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const __mmask16 rows_in = detail::mask16(M - m0);
    for (int64_t k0 = 0; k0 < K; k0 += 16) {  // 16 x 16 block: src rows m0.., columns k0..
      const __mmask16 cols = detail::mask16(K - k0);
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = m0 + i < M ? _mm512_castps_si512(_mm512_maskz_loadu_ps(cols, src + (m0 + i) * lds + k0))
                          : _mm512_setzero_si512();
      detail::transpose16x16_epi32(r);
      for (int64_t j = 0; j < std::min<int64_t>(K - k0, 16); ++j)
        _mm512_mask_storeu_ps(dst + (k0 + j) * ldd + m0, rows_in, _mm512_castsi512_ps(r[j]));
    }
  }
}

// bf16 copy with column padding: dst[m][k] = src[m][k] for k < K, 0 for K <= k < Kp; rows >= M not written.
// (For an A operand already in bf16 whose width is not a multiple of 32.)
inline void copy_rows_bf16(uint16_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t M, int64_t K,
                           int64_t Kp) {
  assert(Kp >= K && ldd >= Kp);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < Kp; k += 32)
      _mm512_mask_storeu_epi16(dst + m * ldd + k, detail::mask32(Kp - k),
                               _mm512_maskz_loadu_epi16(detail::mask32(K - k), src + m * lds + k));
}

// Split bfloat16: x as hi = bf16(x) and lo = bf16(x - hi), for products of float16 (or float32)
// values on bfloat16 units. x - hi is exact in fp32, so hi + lo carries 16 significant bits: a
// float16 value (11 bits, exponents within bfloat16's) exactly, a float32 one to 2^-17 of itself.
// A product a b taken as a_hi b_hi + a_hi b_lo + a_lo b_hi (three bf16 products, each exact, summed
// in fp32) misses only a_lo b_lo, at most 2^-18 |a b|: far below float16's rounding (2^-11).
namespace detail {

inline void split_bf16(__m512 x, __m256i& hi, __m256i& lo) {
  hi = cvt_bf16(x);
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
  lo = cvt_bf16(_mm512_sub_ps(x, back));
}

// Rows [0, M) of src (K columns, row stride lds) split into hi (row stride ldh) and lo (row
// stride ldl), zero in columns K..Kp; load(row, k, mask) gives 16 values as fp32.
template <typename Load>
inline void split_rows(uint16_t* hi, int64_t ldh, uint16_t* lo, int64_t ldl, int64_t M, int64_t K, int64_t Kp,
                       Load&& load) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < Kp; k += 16) {
      __m256i h, l;
      split_bf16(load(m, k, mask16(K - k)), h, l);
      const __mmask16 keep = mask16(Kp - k);
      _mm256_mask_storeu_epi16(hi + m * ldh + k, keep, h);
      _mm256_mask_storeu_epi16(lo + m * ldl + k, keep, l);
    }
  }
}

}  // namespace detail

// Split bfloat16 of float16 rows: src M x K float16 (raw bits), row stride lds; hi and lo as above.
// Needs Kp >= K, Kp % 16 == 0.
inline void split_rows_from_f16(uint16_t* hi, int64_t ldh, uint16_t* lo, int64_t ldl, const uint16_t* src,
                                int64_t lds, int64_t M, int64_t K, int64_t Kp) {
  assert(Kp >= K && Kp % 16 == 0);
  detail::split_rows(hi, ldh, lo, ldl, M, K, Kp, [&](int64_t m, int64_t k, __mmask16 mask) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, src + m * lds + k));
  });
}

// Split bfloat16 of fp32 rows: src M x K, row stride lds. Needs Kp >= K, Kp % 16 == 0.
inline void split_rows_from_f32(uint16_t* hi, int64_t ldh, uint16_t* lo, int64_t ldl, const float* src,
                                int64_t lds, int64_t M, int64_t K, int64_t Kp) {
  assert(Kp >= K && Kp % 16 == 0);
  detail::split_rows(hi, ldh, lo, ldl, M, K, Kp, [&](int64_t m, int64_t k, __mmask16 mask) {
    return _mm512_maskz_loadu_ps(mask, src + m * lds + k);
  });
}

// Split bfloat16 of vnni_row_from_f32: row r of an fp32 tile as hi (bf16(x)) into the VNNI panel
// row hi_row and lo (bf16(x - hi), as split_rows) into lo_row, the words of parity r % 2 of each
// (float16's Z and dS as the B operands of dV^T and dK^T).
inline void split_vnni_row_from_f32(uint16_t* hi_row, uint16_t* lo_row, int64_t r, const float* x, int64_t n,
                                    int64_t np) {
  for (int64_t j = 0; j < np; j += 16) {
    __m256i h, l;
    detail::split_bf16(_mm512_maskz_loadu_ps(detail::mask16(n - j), x + j), h, l);
    detail::store_vnni_words(hi_row, r, j, h);
    detail::store_vnni_words(lo_row, r, j, l);
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding: a query row or two against every key, keys and values read in place as bf16 rows
// (AVX512-BF16's vdpbf16ps: pairs of exact bf16 products summed in fp32; no tile state needed).
// ---------------------------------------------------------------------------------------------

// S[r][j] = sum_k Q[r][k] X[j][k] for r < M, j < N. Q: M rows, row stride ldq, zero in columns K..Kp
// (Kp = K rounded up to 32); X: N rows of K bf16, row stride ldx; S: fp32, row stride lds.
// Sixteen keys at a time: their 16 partial-sum vectors summed by lane_sums16 (no horizontal sums).
namespace detail {

// The 16 partial sums of the dot product of a zero-padded row q (Kp = K rounded up to 32) and a row x of K.
inline __m512 dot_parts_bf16(const uint16_t* q, const uint16_t* x, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + k),
                           (__m512bh)_mm512_maskz_loadu_epi16(mask32(K - k), x + k));
  return acc;
}

}  // namespace detail

inline void dot_rows_bf16(float* S, int64_t lds, const uint16_t* Q, int64_t ldq, int64_t M, const uint16_t* X,
                          int64_t ldx, int64_t N, int64_t K) {
  using detail::dot_parts_bf16;
  for (int64_t r = 0; r < M; ++r) {
    const uint16_t* q = Q + r * ldq;
    float* s = S + r * lds;
    int64_t j = 0;
    for (; j + 16 <= N; j += 16) {
      __m512 part[16];
      for (int i = 0; i < 16; ++i) part[i] = dot_parts_bf16(q, X + (j + i) * ldx, K);
      _mm512_storeu_ps(s + j, lane_sums16(part));
    }
    for (; j < N; ++j) s[j] = _mm512_reduce_add_ps(dot_parts_bf16(q, X + j * ldx, K));
  }
}

namespace detail {

// O[c0 + c] += sum_j P[j] V[j][c0 + c] for c < min(32 NCH, C - c0), j < N, one row of P.
// Key pairs go through vdpbf16ps: word w of unpacklo_epi16(V[j], V[j + 1]) (per 128-bit lane)
// holds the pair of column 8 (w / 4) + w % 4, of unpackhi column 8 (w / 4) + 4 + w % 4; the
// columns are put back in order once, at the end.
template <int NCH>
inline void add_pv_row_bf16(float* O, const uint16_t* P, const uint16_t* V, int64_t ldv, int64_t N, int64_t C,
                            int64_t c0) {
  __m512 lo[NCH], hi[NCH];
  __mmask32 cols[NCH];
  for (int ch = 0; ch < NCH; ++ch) {
    lo[ch] = hi[ch] = _mm512_setzero_ps();
    cols[ch] = mask32(C - c0 - 32 * ch);
  }
  for (int64_t j = 0; j < N; j += 2) {
    uint32_t pair;  // P[j], P[j + 1] (0 past N: P is zero-padded to an even length)
    std::memcpy(&pair, P + j, sizeof(pair));
    const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
    const uint16_t* v0 = V + j * ldv + c0;
    const uint16_t* v1 = j + 1 < N ? v0 + ldv : nullptr;
    for (int ch = 0; ch < NCH; ++ch) {
      const __m512i a = _mm512_maskz_loadu_epi16(cols[ch], v0 + 32 * ch);
      const __m512i b = v1 ? _mm512_maskz_loadu_epi16(cols[ch], v1 + 32 * ch) : _mm512_setzero_si512();
      lo[ch] = _mm512_dpbf16_ps(lo[ch], (__m512bh)_mm512_unpacklo_epi16(a, b), pp);
      hi[ch] = _mm512_dpbf16_ps(hi[ch], (__m512bh)_mm512_unpackhi_epi16(a, b), pp);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int ch = 0; ch < NCH; ++ch) {
    const int64_t c = c0 + 32 * ch;
    float* o = O + c;
    const __mmask16 m0 = mask16(C - c), m1 = mask16(C - c - 16);
    _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), _mm512_permutex2var_ps(lo[ch], first, hi[ch])));
    _mm512_mask_storeu_ps(o + 16, m1,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), _mm512_permutex2var_ps(lo[ch], second, hi[ch])));
  }
}

}  // namespace detail

// O[r][c] += sum_j P[r][j] V[j][c] for r < M, j < N, c < C. P: M rows of bf16, row stride ldp, zero
// in column N when N is odd; V: N rows of C bf16, row stride ldv; O: fp32, row stride ldo. Up to
// 128 columns per pass over the keys (eight accumulators).
inline void add_pv_rows_bf16(float* O, int64_t ldo, const uint16_t* P, int64_t ldp, int64_t M, const uint16_t* V,
                             int64_t ldv, int64_t N, int64_t C) {
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t c0 = 0; c0 < C; c0 += 128) {
      float* o = O + r * ldo;
      const uint16_t* p = P + r * ldp;
      switch ((std::min<int64_t>(C - c0, 128) + 31) / 32) {
        case 1: detail::add_pv_row_bf16<1>(o, p, V, ldv, N, C, c0); break;
        case 2: detail::add_pv_row_bf16<2>(o, p, V, ldv, N, C, c0); break;
        case 3: detail::add_pv_row_bf16<3>(o, p, V, ldv, N, C, c0); break;
        default: detail::add_pv_row_bf16<4>(o, p, V, ldv, N, C, c0); break;
      }
    }
  }
}

}  // namespace amx
}  // namespace cpu
}  // namespace attn_ext

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
