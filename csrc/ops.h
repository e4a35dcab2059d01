// attn_ext: host-side helpers shared by the CPU and CUDA operator
// implementations: input validation and the filling of the parameter structs.
#pragma once

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "attention.h"

namespace attn_ext {

// "(2, 4, 17, 33)": how every message here prints a shape.
std::string shape_str(at::IntArrayRef sizes);

// The attention variants of one call as the ops take them (DESIGN.md
// "Attention variants"). make_params checks them and keeps here what it
// converted for the kernels (sinks in lse's dtype, contiguous float32 slopes).
struct Variants {
  std::optional<int64_t> window_left, window_right;  // >= 0; unset = unbounded
  std::optional<double> softcap;                     // > 0
  std::optional<at::Tensor> alibi_slopes;            // float32 (Hq,) or (B, Hq)
  std::optional<at::Tensor> sinks;                   // (Hq,), any float dtype
  at::Tensor alibi_for_kernel, sinks_for_kernel;     // filled by make_params

  bool any() const {
    return window_left.has_value() || window_right.has_value() || softcap.has_value() || alibi_slopes.has_value() ||
           sinks.has_value();
  }
};

// The variants as the operators receive them.
inline Variants variants_of(std::optional<int64_t> window_left, std::optional<int64_t> window_right,
                            std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
                            const std::optional<at::Tensor>& sinks) {
  Variants v;
  v.window_left = window_left;
  v.window_right = window_right;
  v.softcap = softcap;
  v.alibi_slopes = alibi_slopes;
  v.sinks = sinks;
  return v;
}

// Checks the variants against the batch and heads of `p` and fills their fields.
void describe_variants(AttnParams& p, Variants& variants, const at::Tensor& query);

// The sinks' gradient: the kernels write each (b, h)'s part into a (B, Hq)
// buffer in lse's dtype, which grad_sinks_buffer allocates (zeroed) and
// describes as p.dsinks (undefined without sinks); grad_sinks_from sums it over
// b into the sinks' dtype (an empty tensor without sinks).
at::Tensor grad_sinks_buffer(AttnBwdParams& p, const Variants& variants, const at::Tensor& query);
at::Tensor grad_sinks_from(const at::Tensor& buffer, const Variants& variants, const at::Tensor& query);

// A packed batch (varlen ops): query (total_q, Hq, E), key (total_k, Hkv, E),
// value (total_k, Hkv, Ev), cu_seqlens int32/int64 (B + 1,) from 0 to the totals,
// non-decreasing, on the CPU (the lengths are read on the host). Fills every
// field but the outputs; L and S are the longest sequence's (max_seqlen_* must
// be at least that). `cu` keeps the int64 copies the kernels read.
struct PackedSeqlens {
  at::Tensor cu_q, cu_k;
};
AttnParams make_varlen_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, double dropout_p, bool is_causal, bool bottom_right, double scale,
                              const std::optional<at::Tensor>& dropout_seed, PackedSeqlens& cu);

// Checks query/key/value/attn_mask/dropout and fills every field of the
// forward parameters except the output pointers (out, lse) and the variants.
//   query      (B, Hq, L, E)   any strides
//   key        (B, Hkv, S, E)  any strides, Hq % Hkv == 0
//   value      (B, Hkv, S, Ev) any strides
//   attn_mask  bool or query's dtype, at most 4-D, broadcastable to (B, Hq, L, S)
//   dropout_seed  int64, one element, on query's device; required iff dropout_p > 0
AttnParams make_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                       int64_t causal_offset, double scale, const std::optional<at::Tensor>& dropout_seed);

// The same for the ops without value (attention_probs): Ev = 0, no v.
AttnParams make_params(const at::Tensor& query, const at::Tensor& key, const std::optional<at::Tensor>& attn_mask,
                       double dropout_p, bool is_causal, int64_t causal_offset, double scale,
                       const std::optional<at::Tensor>& dropout_seed);

// dropout_seed: int64, one element, on query's device; required iff dropout_p > 0.
void check_dropout_seed(double dropout_p, const std::optional<at::Tensor>& dropout_seed, const at::Tensor& query);

// The strides of attn_mask (at most 4-D, broadcastable to (B, Hq, L, S)) read as
// (B, Hq, L, S): 0 on its broadcast dims.
void broadcast_mask_strides(int64_t (&dst)[4], const at::Tensor& attn_mask);

// The shape of a per-query-row tensor of `p` with `cols` columns: (B, Hq, L, cols),
// or (total_q, Hq, cols) for a packed batch (read from p.cu_q on the host);
// cols < 0 for the log-sum-exp's (B, Hq, L) / (total_q, Hq).
std::vector<int64_t> rows_shape(const AttnParams& p, int64_t cols);

// Host helpers shared by the CPU and CUDA operator implementations.
void copy_strides(int64_t (&dst)[4], const at::Tensor& t);  // t is 4-D
// A log-sum-exp (or its gradient) for the rows of `p`: accumulation dtype, (B, Hq, L)
// ((total_q, Hq) for a packed batch), on query's device.
void check_lse(const at::Tensor& lse, const char* name, const AttnParams& p, const at::Tensor& query);

// The forward's results for `p`, allocated contiguous and described in it: the output
// (B, Hq, L, Ev) as p.out / p.o_stride, or with `probs` (attention_probs) the
// probabilities (B, Hq, L, S) as p.probs / p.probs_stride; and the log-sum-exp
// (B, Hq, L) in the accumulation dtype as p.lse. Returns {output or probs, lse}.
// For a packed batch: the output (total_q, Hq, Ev) and lse (total_q, Hq).
std::tuple<at::Tensor, at::Tensor> make_forward_outputs(AttnParams& p, const at::Tensor& query, bool probs);

// The backward's incoming gradient and the forward result it is for, checked
// against `p` (shape, query's dtype and device) and described in it:
//   attention_backward:        grad_out and out, (B, Hq, L, Ev)  -> p.dout / p.out
//   attention_probs_backward:  grad_probs and probs, (B, Hq, L, S) -> p.dprobs / p.probs
void describe_grad_output(AttnBwdParams& p, const at::Tensor& grad_out, const at::Tensor& out,
                          const at::Tensor& query);
void describe_grad_probs(AttnBwdParams& p, const at::Tensor& grad_probs, const at::Tensor& probs,
                         const at::Tensor& query);

namespace cpu {
// The CPU kernel variants: "cpu_isas=...;cpu_isas_supported=...;cpu_isa_active=..."
// (csrc/cpu/dispatch.cpp), for the build_info op.
std::string kernel_info();
}  // namespace cpu

// float32 for float16/bfloat16/float32, float64 for float64.
at::ScalarType accumulation_dtype(at::ScalarType dtype);

}  // namespace attn_ext
