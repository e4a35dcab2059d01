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
  void* lse = nullptr;        // (B, Hq, L) or (total_q, Hq) (lse_stride); float32, or float64 for float64 inputs
  int64_t q_stride[4] = {0, 0, 0, 0};
  int64_t k_stride[4] = {0, 0, 0, 0};
  int64_t v_stride[4] = {0, 0, 0, 0};
  int64_t o_stride[4] = {0, 0, 0, 0};

  MaskKind mask_kind = MaskKind::None;
  const void* mask = nullptr;         // broadcast to (B, Hq, L, S) through its strides
  int64_t mask_stride[4] = {0, 0, 0, 0};
  // CPU only: the keys that a mask hides from every row (bool false, float -inf)
  // are left out (read_mask in attention_cpu.cpp). Every row runs on keys [key_begin, S)
  // at most; with batch_keys set (host memory), batch entry b runs on keys
  // [batch_keys[2 b], batch_keys[2 b + 1]) instead (SequenceViews).
  int64_t key_begin = 0;
  const int64_t* batch_keys = nullptr;  // (B, 2)
  // CPU only, host memory: with a mask that varies by row, row i of batch
  // entry b sees no key outside [row_keys[r], row_keys[r + 1]) (r = b *
  // row_keys_stride + 2 i; empty when the row sees none), which bounds the key
  // tiles a query block visits, the query rows a key block visits, and each
  // row's scores (so a mask that held nothing else is dropped: mask_kind None).
  const int64_t* row_keys = nullptr;  // (B or 1, L, 2)
  int64_t row_keys_stride = 0;        // 2 L, or 0 when the mask broadcasts over the batch

  // Which keys a row sees (visible_key_range in attention_math.h). Row i sits
  // at key position i + causal_offset (0: top-left alignment as in PyTorch;
  // S - L: bottom-right as in FlashAttention), for the causal bound, the window
  // and the ALiBi distance alike. Causal: keys up to that position. Window:
  // keys [pos - window_left, pos + window_right]; -1 = unbounded on that side.
  bool causal = false;
  int64_t causal_offset = 0;
  int64_t window_left = -1, window_right = -1;

  double scale = 1.0;

  // Score modifiers, in this order (Gemma 2's): s = softcap * tanh(s / softcap)
  // when softcap > 0, then s -= slope * |pos - j| with slope = alibi[b * alibi_stride_b + h].
  double softcap = 0.0;
  const float* alibi = nullptr;  // (Hq,) (alibi_stride_b 0) or (B, Hq) (alibi_stride_b Hq)
  int64_t alibi_stride_b = 0;
  // Attention sinks: a logit per query head that joins every row's softmax
  // denominator and takes no value. (Hq,) contiguous, in lse's dtype.
  const void* sinks = nullptr;

  // Packed variable-length batches (varlen): B sequences; sequence b holds
  // query rows [cu_q[b], cu_q[b + 1]) and key rows [cu_k[b], cu_k[b + 1]) of
  // tensors whose batch stride is 0. L and S are then the longest sequence's;
  // the alignment offset is per sequence (S_b - L_b when bottom_right). The
  // CPU driver turns a sequence into a dense batch of one (sequence_view), whose
  // pointers start at the sequence's first row and whose row0 says which row that is.
  const int64_t* cu_q = nullptr;  // (B + 1,) int64
  const int64_t* cu_k = nullptr;  // (B + 1,) int64
  bool bottom_right = false;
  int64_t row0 = 0;

  // The log-sum-exp of row (b, h, i) is at lse[b * lse_stride[0] + h * lse_stride[1] + (row0 + i) * lse_stride[2]]:
  // (B, Hq, L) contiguous, or (total_q, Hq) for varlen.
  int64_t lse_stride[3] = {0, 0, 0};

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
  const void* dlse = nullptr;  // laid out as lse, lse's dtype; nullptr when lse got no gradient
  void* dsinks = nullptr;      // (B, Hq), lse's dtype: sequence b's part of the sinks' gradient (the host sums over b)
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
