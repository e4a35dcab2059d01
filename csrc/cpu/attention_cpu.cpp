// attn_ext: the CPU implementations of the operators: allocate the outputs,
// fill the parameter structs, run the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../ops.h"
#include "kernels.h"

namespace attn_ext {
namespace {

void set_seed(AttnParams& p, const std::optional<at::Tensor>& dropout_seed) {
  if (p.dropout_p > 0.0) p.seed = static_cast<uint64_t>(dropout_seed->item<int64_t>());
}

// The float32/float64 buffer the kernel accumulates the mask's gradient in.
// Tasks are (batch, key/value head) pairs; they hit the same mask element
// when the mask broadcasts over a dim they are split on, and then each thread
// accumulates into a copy of its own. grad_mask_from() sums the copies.
at::Tensor grad_mask_buffer(AttnBwdParams& p, const at::Tensor& attn_mask, at::ScalarType acc) {
  TORCH_CHECK(p.mask_kind == MaskKind::Additive, "attn_ext: compute_grad_mask needs a float attn_mask");
  std::vector<int64_t> shape(4 - attn_mask.dim(), 1);  // the mask's sizes, padded to 4-D
  for (int64_t size : attn_mask.sizes()) shape.push_back(size);
  const bool shared = (p.B > 1 && shape[0] == 1) || (p.Hkv > 1 && shape[1] == 1);
  shape.insert(shape.begin(), shared ? at::get_num_threads() : 1);
  at::Tensor buffer = at::zeros(shape, attn_mask.options().dtype(acc));
  copy_strides(p.dmask_stride, buffer[0].expand({p.B, p.Hq, p.L, p.S}));
  p.dmask = buffer.data_ptr();
  p.dmask_numel = buffer[0].numel();
  p.dmask_per_thread = shared;
  return buffer;
}

at::Tensor grad_mask_from(const at::Tensor& buffer, const at::Tensor& attn_mask) {
  return buffer.sum(0).view(attn_mask.sizes()).to(attn_mask.scalar_type());
}

// Common part of both backwards: dlse, seed, lse, dq/dk outputs, mask gradient.
struct BwdOutputs {
  at::Tensor grad_query, grad_key, grad_mask, mask_buffer, lse, grad_lse;
};

BwdOutputs prepare_backward(AttnBwdParams& p, const at::Tensor& query, const at::Tensor& key, const at::Tensor& lse,
                            const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& attn_mask,
                            const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask) {
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  check_lse(lse, "lse", p, query);
  BwdOutputs o;
  o.grad_query = at::empty(query.sizes(), query.options());
  o.grad_key = at::empty(key.sizes(), key.options());
  o.grad_mask = at::empty({0}, query.options());
  o.lse = lse.contiguous();
  p.lse = o.lse.data_ptr();
  if (grad_lse.has_value()) {
    check_lse(*grad_lse, "grad_lse", p, query);
    o.grad_lse = grad_lse->contiguous();
    p.dlse = o.grad_lse.data_ptr();
  }
  set_seed(p, dropout_seed);
  p.dq = o.grad_query.data_ptr();
  p.dk = o.grad_key.data_ptr();
  copy_strides(p.dq_stride, o.grad_query);
  copy_strides(p.dk_stride, o.grad_key);
  if (compute_grad_mask) {
    TORCH_CHECK(attn_mask.has_value(), "attn_ext: compute_grad_mask needs a float attn_mask");
    o.mask_buffer = grad_mask_buffer(p, *attn_mask, acc);
  }
  return o;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query,   // (B, Hq, L, E)
    const at::Tensor& key,     // (B, Hkv, S, E)
    const at::Tensor& value,   // (B, Hkv, S, Ev)
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (B, Hq, L, S)
    double dropout_p, bool is_causal, int64_t causal_offset, double scale,
    const std::optional<at::Tensor>& dropout_seed) {  // int64, 1 element
  AttnParams p = make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  auto [out, lse] = make_forward_outputs(p, query, /*probs=*/false);
  if (lse.numel() == 0) return {out, lse};
  set_seed(p, dropout_seed);
  cpu::attention_forward(p);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out,                 // (B, Hq, L, Ev), any strides
    const std::optional<at::Tensor>& grad_lse,  // (B, Hq, L), lse's dtype
    const at::Tensor& query,                    // (B, Hq, L, E)
    const at::Tensor& key,                      // (B, Hkv, S, E)
    const at::Tensor& value,                    // (B, Hkv, S, Ev)
    const at::Tensor& out,                      // (B, Hq, L, Ev), attention_forward's
    const at::Tensor& lse,                      // (B, Hq, L), attention_forward's
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask) {
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  describe_grad_output(p, grad_out, out, query);
  BwdOutputs o = prepare_backward(p, query, key, lse, grad_lse, attn_mask, dropout_seed, compute_grad_mask);
  at::Tensor grad_value = at::empty(value.sizes(), value.options());
  if (p.B > 0 && p.Hq > 0) {
    p.dv = grad_value.data_ptr();
    copy_strides(p.dv_stride, grad_value);
    cpu::attention_backward(p);
  }
  if (compute_grad_mask) o.grad_mask = grad_mask_from(o.mask_buffer, *attn_mask);
  return {o.grad_query, o.grad_key, grad_value, o.grad_mask};
}

std::tuple<at::Tensor, at::Tensor> attention_probs_cpu(
    const at::Tensor& query,  // (B, Hq, L, E)
    const at::Tensor& key,    // (B, Hkv, S, E)
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed) {
  AttnParams p = make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  auto [probs, lse] = make_forward_outputs(p, query, /*probs=*/true);
  if (lse.numel() == 0) return {probs, lse};
  set_seed(p, dropout_seed);
  cpu::attention_forward(p);
  return {probs, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_probs_backward_cpu(
    const at::Tensor& grad_probs,               // (B, Hq, L, S), any strides
    const std::optional<at::Tensor>& grad_lse,  // (B, Hq, L)
    const at::Tensor& query,                    // (B, Hq, L, E)
    const at::Tensor& key,                      // (B, Hkv, S, E)
    const at::Tensor& probs,                    // (B, Hq, L, S), attention_probs'
    const at::Tensor& lse,                      // (B, Hq, L), attention_probs'
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask) {
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  describe_grad_probs(p, grad_probs, probs, query);
  BwdOutputs o = prepare_backward(p, query, key, lse, grad_lse, attn_mask, dropout_seed, compute_grad_mask);
  if (p.B > 0 && p.Hq > 0) cpu::attention_backward(p);
  if (compute_grad_mask) o.grad_mask = grad_mask_from(o.mask_buffer, *attn_mask);
  return {o.grad_query, o.grad_key, o.grad_mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
  m.impl("attention_probs", &attention_probs_cpu);
  m.impl("attention_probs_backward", &attention_probs_backward_cpu);
}

}  // namespace attn_ext
