// attn_ext: host-side helpers shared by the CPU and CUDA operator
// implementations: input validation and the filling of the parameter structs.
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "attention.h"

namespace attn_ext {

// "(2, 4, 17, 33)": how every message here prints a shape.
std::string shape_str(at::IntArrayRef sizes);

// Checks query/key/value/attn_mask/dropout and fills every field of the
// forward parameters except the output pointers (out, lse).
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

// The attn_mask viewed as (B, Hq, L, S) without copying (stride 0 on broadcast dims).
at::Tensor expand_mask(const at::Tensor& attn_mask, const AttnParams& params);

// Host helpers shared by the CPU and CUDA operator implementations.
void copy_strides(int64_t (&dst)[4], const at::Tensor& t);  // t is 4-D
// t must have `shape` and query's dtype and device; the message names `name`.
void check_like_query(const at::Tensor& t, const char* name, at::IntArrayRef shape, const at::Tensor& query);
// A log-sum-exp (or its gradient) for the rows of `p`: accumulation dtype, (B, Hq, L), on query's device.
void check_lse(const at::Tensor& lse, const char* name, const AttnParams& p, const at::Tensor& query);

// float32 for float16/bfloat16/float32, float64 for float64.
at::ScalarType accumulation_dtype(at::ScalarType dtype);

}  // namespace attn_ext
