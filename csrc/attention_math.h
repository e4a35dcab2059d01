// attn_ext: the small pieces of math that the forward, the backward and the
// probabilities kernels (CPU and CUDA) must agree on. Keep them here, once.
#pragma once

#include <cstdint>
#include <type_traits>

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
// (The tensor-core CUDA kernels' bound: they take no window.)
ATTN_HOST_DEVICE int64_t causal_key_end(const AttnParams& p, int64_t i) {
  if (!p.causal) return p.S;
  const int64_t end = i + p.causal_offset + 1;
  return end < 0 ? 0 : (end > p.S ? p.S : end);
}

ATTN_HOST_DEVICE int64_t clamp_to(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// The window's right side with the causal bound folded in: -1 when unbounded.
ATTN_HOST_DEVICE int64_t right_reach(const AttnParams& p) {
  if (p.causal) return 0;  // window_right >= 0 is validated, so min(window_right, 0) = 0
  return p.window_right;
}

// Row i sees keys [begin, end) (causal bound, window, and the keys before
// key_begin, which the mask hides from every row; an attn_mask may hide
// more of them). Both ends grow with i, so the keys of rows [i0, i1) lie in
// [range(i0).begin, range(i1 - 1).end). begin == end: the row sees no key.
struct KeyRange {
  int64_t begin, end;
};
ATTN_HOST_DEVICE KeyRange visible_key_range(const AttnParams& p, int64_t i) {
  const int64_t pos = i + p.causal_offset;
  const int64_t right = right_reach(p);
  const int64_t window_begin = p.window_left >= 0 ? pos - p.window_left : 0;
  const int64_t begin = clamp_to(window_begin > p.key_begin ? window_begin : p.key_begin, 0, p.S);
  const int64_t end = right >= 0 ? clamp_to(pos + right + 1, begin, p.S) : p.S;
  return KeyRange{begin, end};
}

// The query rows [begin, end) that see at least one key of [j0, j1): the
// backward visits only these for a key block.
ATTN_HOST_DEVICE KeyRange visible_row_range(const AttnParams& p, int64_t j0, int64_t j1) {
  const int64_t right = right_reach(p);
  const int64_t begin = right >= 0 ? clamp_to(j0 - right - p.causal_offset, 0, p.L) : 0;
  const int64_t end = p.window_left >= 0 ? clamp_to(j1 + p.window_left - p.causal_offset, begin, p.L) : p.L;
  return KeyRange{begin, end};
}

// Where row (b, h, i) keeps its log-sum-exp (and the backward its D).
ATTN_HOST_DEVICE int64_t lse_index(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return b * p.lse_stride[0] + h * p.lse_stride[1] + (p.row0 + i) * p.lse_stride[2];
}

// Sequence b of a packed batch (p.cu_q set) as a dense batch of one: its
// pointers start at the sequence's first query and key rows (the batch stride
// is 0, so b still indexes ALiBi slopes and nothing else), L and S are its
// lengths, the alignment offset its own, and row0 its first query row, for lse,
// D and the dropout stream. The CPU kernels read cu_q/cu_k in host memory, the
// CUDA kernels in device memory.
template <typename scalar_t>
ATTN_HOST_DEVICE const void* rows_from(const void* base, int64_t row, int64_t row_stride) {
  return base == nullptr ? nullptr : static_cast<const scalar_t*>(base) + row * row_stride;
}
template <typename scalar_t>
ATTN_HOST_DEVICE void* rows_from(void* base, int64_t row, int64_t row_stride) {
  return base == nullptr ? nullptr : static_cast<scalar_t*>(base) + row * row_stride;
}
template <typename scalar_t, typename Params>
ATTN_HOST_DEVICE Params sequence_view(const Params& p, int64_t b) {
  Params s = p;
  const int64_t q0 = p.cu_q[b], k0 = p.cu_k[b];
  s.L = p.cu_q[b + 1] - q0;
  s.S = p.cu_k[b + 1] - k0;
  s.causal_offset = p.bottom_right ? s.S - s.L : 0;
  s.row0 = q0;
  s.q = rows_from<scalar_t>(p.q, q0, p.q_stride[2]);
  s.k = rows_from<scalar_t>(p.k, k0, p.k_stride[2]);
  s.v = rows_from<scalar_t>(p.v, k0, p.v_stride[2]);
  s.out = rows_from<scalar_t>(p.out, q0, p.o_stride[2]);
  if constexpr (std::is_same_v<Params, AttnBwdParams>) {
    s.dout = rows_from<scalar_t>(p.dout, q0, p.do_stride[2]);
    s.dq = rows_from<scalar_t>(p.dq, q0, p.dq_stride[2]);
    s.dk = rows_from<scalar_t>(p.dk, k0, p.dk_stride[2]);
    s.dv = rows_from<scalar_t>(p.dv, k0, p.dv_stride[2]);
  }
  return s;
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

// The row index that keys Philox's subsequence: the row's place in lse, so
// (b * Hq + h) * L + i for a dense batch; (row0 + i) * Hq + h for a packed one.
ATTN_HOST_DEVICE uint64_t dropout_row(const AttnParams& p, int64_t b, int64_t h, int64_t i) {
  return static_cast<uint64_t>(lse_index(p, b, h, i));
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
