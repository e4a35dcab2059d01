// attn_ext: the small pieces of math that the forward, the backward and the
// probabilities kernels (CPU and CUDA) must agree on. Keep them here, once.
#pragma once

#include <cstdint>

// at::philox_engine (host + device, c10 macros only). Its host-only randn
// uses AT_ASSERT under __CUDA_ARCH__ without including c10/util/Exception.h,
// which nvcc's device pass cannot parse; randn is never called here, so a
// stand-in for that one macro, scoped to the include, keeps .cu files free of
// c10's exception header.
#if defined(__CUDACC__) && !defined(AT_ASSERT)
#define AT_ASSERT(...) ((void)0)
#define ATTN_EXT_DEFINED_AT_ASSERT
#endif
#include <ATen/core/PhiloxRNGEngine.h>
#if defined(ATTN_EXT_DEFINED_AT_ASSERT)
#undef AT_ASSERT
#undef ATTN_EXT_DEFINED_AT_ASSERT
#endif

#include "attention.h"

#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTN_HOST_DEVICE inline
#endif

namespace attn_ext {

// The type a kernel computes in: float32 for float16/bfloat16/float32 inputs,
// float64 for float64 (so gradcheck stays exact). The log-sum-exp has it too.
template <typename scalar_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename scalar_t>
using acc_t = typename AccType<scalar_t>::type;

// Keys [0, causal_key_end(p, i)) are visible from query row i (all S keys
// when the attention is not causal). 0 means the row sees no key at all.
ATTN_HOST_DEVICE int64_t causal_key_end(const AttnParams& p, int64_t i) {
  if (!p.causal) return p.S;
  const int64_t end = i + p.causal_offset + 1;
  return end < 0 ? 0 : (end > p.S ? p.S : end);
}

// Dropout keeps element (row, j) iff its 32-bit random number u satisfies
// u >= dropout_threshold(p): P(keep) = 1 - p up to 2^-32.
ATTN_HOST_DEVICE uint32_t dropout_threshold(double dropout_p) {
  const double t = dropout_p * 4294967296.0;
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}

// The dropout of one call as every kernel applies it: keep an element iff its
// random number >= threshold, and scale what is kept by keep_scale = 1 / (1 - p).
template <typename T>
struct DropoutRule {
  bool on;
  uint32_t threshold;
  T keep_scale;
  ATTN_HOST_DEVICE explicit DropoutRule(const AttnParams& p)
      : on(p.dropout_p > 0.0),
        threshold(dropout_threshold(p.dropout_p)),
        keep_scale(p.dropout_p > 0.0 ? static_cast<T>(1.0 / (1.0 - p.dropout_p)) : T(1)) {}
};

// The row index that keys Philox's subsequence: (b, h, i) of the (B, Hq, L) rows.
ATTN_HOST_DEVICE uint64_t dropout_row(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<uint64_t>((b * p.Hq + h) * p.L + i);
}

// Element (row, j) takes output j % 4 of Philox block j / 4 in subsequence
// `row` under key `seed`. DropoutRowStream walks a row from column j0 (any j0)
// and yields the random numbers of j0, j0 + 1, ... in order.
class DropoutRowStream {
 public:
  ATTN_HOST_DEVICE DropoutRowStream(uint64_t seed, uint64_t row, int64_t j0)
      : engine_(seed, row, static_cast<uint64_t>(j0) >> 2) {
    for (int64_t s = 0; s < (j0 & 3); ++s) engine_();
  }
  ATTN_HOST_DEVICE uint32_t next() { return engine_(); }

 private:
  at::philox_engine engine_;
};

}  // namespace attn_ext
