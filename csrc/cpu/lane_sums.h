// attn_ext: the sums of 16 float vectors' lanes at once (intrinsics only, no torch).
//
// lane_sums16(parts)[t] = the sum of the 16 lanes of parts[t]: the dot
// products of 16 keys from their partial-sum vectors, for a decoding step that
// reads key rows in place (float32 in attention_kernel_impl.h, bfloat16 in
// amx_bf16.h). An add tree that transposes as it goes: 45 instructions for 16
// keys, where a horizontal sum per key takes eight or so on a dependency chain
// and a 16 x 16 transpose plus 15 adds 79.
//
// AVX-512F code: include it where AVX-512F is enabled, by the unit's flags or
// inside a target pragma (amx_bf16.h's).
#pragma once

#include <immintrin.h>

namespace attn_ext {
namespace cpu {

inline __m512 lane_sums16(const __m512* parts) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // each 128-bit lane: partial sums of keys (2i, 2i + 1, 2i, 2i + 1)
    const __m512 a = parts[2 * i], b = parts[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // each 128-bit lane: partial sums of keys 4i .. 4i + 3
    const __m512d c = _mm512_castps_pd(pairs[2 * i]), d = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  // 128-bit lanes (0, 2) + (1, 3) of two vectors, twice: lane l ends with keys 4l .. 4l + 3, whole
  const auto halve = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  return halve(halve(quads[0], quads[1]), halve(quads[2], quads[3]));
}

}  // namespace cpu
}  // namespace attn_ext
