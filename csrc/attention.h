// attn_ext: the parameter structs that every attention kernel reads.
//
// This header is plain C++ (no torch headers) so that CUDA translation units
// can include it cheaply. The host code in ops.cpp validates the tensors once
// and fills these structs; the CPU kernels (csrc/cpu/) and the CUDA kernels
// (csrc/cuda/) read nothing else.
#pragma once

#include <cstdint>

namespace attn_ext {

enum class DType : int32_t { Float16 = 0, BFloat16 = 1, Float32 = 2, Float64 = 3 };

enum class MaskKind : int32_t {
  None = 0,
  Bool = 1,      // true = the query may attend to the key
  Additive = 2,  // added to the scaled scores; same dtype as the query
};

// Tensor dims are (batch, head, row, col); strides are in elements. A dim that
// the tensor broadcasts over has stride 0.
struct AttnParams {
  int64_t B = 0, Hq = 0, Hkv = 0;  // batch, query heads, key/value heads (Hq % Hkv == 0)
  int64_t L = 0, S = 0;            // query length, key length
  int64_t E = 0, Ev = 0;           // query/key head dim, value head dim
  DType dtype = DType::Float32;    // of q, k, v, out (and of an additive mask)

  const void* q = nullptr;    // (B, Hq, L, E)
  const void* k = nullptr;    // (B, Hkv, S, E)
  const void* v = nullptr;    // (B, Hkv, S, Ev)
  void* out = nullptr;        // (B, Hq, L, Ev)
  void* lse = nullptr;        // (B, Hq, L) contiguous; float32, or float64 for float64 inputs
  int64_t q_stride[4] = {0, 0, 0, 0};
  int64_t k_stride[4] = {0, 0, 0, 0};
  int64_t v_stride[4] = {0, 0, 0, 0};
  int64_t o_stride[4] = {0, 0, 0, 0};

  MaskKind mask_kind = MaskKind::None;
  const void* mask = nullptr;         // broadcast to (B, Hq, L, S) through its strides
  int64_t mask_stride[4] = {0, 0, 0, 0};

  // Causal: key j is visible from query row i iff j <= i + causal_offset
  // (0: top-left alignment as in PyTorch; S - L: bottom-right as in FlashAttention).
  bool causal = false;
  int64_t causal_offset = 0;

  double scale = 1.0;

  // Dropout on the probabilities, drawn by Philox keyed with `seed`; see
  // attention_math.h for which random number each element uses. CUDA
  // kernels read the seed from device memory (seed_ptr) instead, so that the
  // host never waits for the device.
  double dropout_p = 0.0;
  uint64_t seed = 0;
  const int64_t* seed_ptr = nullptr;

  // Explicit probabilities (the attention_probs op): when set, the forward
  // writes softmax * keep / (1 - p) here instead of computing out.
  void* probs = nullptr;  // (B, Hq, L, S)
  int64_t probs_stride[4] = {0, 0, 0, 0};
};

struct AttnBwdParams : AttnParams {
  // The gradient arrives either for out (dout, the fused op) or for the
  // explicit probabilities (dprobs, the attention_probs op; then there is no
  // value, no out, no dv).
  const void* dout = nullptr;  // (B, Hq, L, Ev)
  const void* dprobs = nullptr;  // (B, Hq, L, S); `probs` holds the forward's probabilities
  int64_t dprobs_stride[4] = {0, 0, 0, 0};
  const void* dlse = nullptr;  // (B, Hq, L) contiguous, lse's dtype; nullptr when lse got no gradient
  void* dq = nullptr;          // (B, Hq, L, E)
  void* dk = nullptr;          // (B, Hkv, S, E)
  void* dv = nullptr;          // (B, Hkv, S, Ev)
  int64_t do_stride[4] = {0, 0, 0, 0};
  int64_t dq_stride[4] = {0, 0, 0, 0};
  int64_t dk_stride[4] = {0, 0, 0, 0};
  int64_t dv_stride[4] = {0, 0, 0, 0};

  // Gradient of an additive mask, accumulated in lse's dtype into a buffer of
  // the mask's own shape, read through dmask_stride (0 on broadcast dims).
  // When several threads may hit the same element, each thread t owns the
  // copy at dmask + t * dmask_numel and the host sums them.
  void* dmask = nullptr;
  int64_t dmask_stride[4] = {0, 0, 0, 0};
  int64_t dmask_numel = 0;
  bool dmask_per_thread = false;
};

}  // namespace attn_ext
