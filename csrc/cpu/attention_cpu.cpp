// attn_ext: the CPU implementations of the operators: allocate the outputs,
// fill the parameter structs, run the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../ops.h"
#include "kernels.h"

namespace attn_ext {
namespace {

uint64_t read_seed(const std::optional<at::Tensor>& dropout_seed, double dropout_p) {
  return dropout_p > 0.0 ? static_cast<uint64_t>(dropout_seed->item<int64_t>()) : 0;
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query,   // (B, Hq, L, E)
    const at::Tensor& key,     // (B, Hkv, S, E)
    const at::Tensor& value,   // (B, Hkv, S, Ev)
    const std::optional<at::Tensor>& attn_mask,  // broadcastable to (B, Hq, L, S)
    double dropout_p, bool is_causal, int64_t causal_offset, double scale,
    const std::optional<at::Tensor>& dropout_seed) {  // int64, 1 element
  AttnParams p = make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  at::Tensor out = at::empty({p.B, p.Hq, p.L, p.Ev}, query.options());
  at::Tensor lse = at::empty({p.B, p.Hq, p.L}, query.options().dtype(accumulation_dtype(query.scalar_type())));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  p.seed = read_seed(dropout_seed, dropout_p);
  p.out = out.data_ptr();
  p.lse = lse.data_ptr();
  p.o_stride[0] = out.stride(0), p.o_stride[1] = out.stride(1), p.o_stride[2] = out.stride(2),
  p.o_stride[3] = out.stride(3);
  cpu::attention_forward(p);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out,                // (B, Hq, L, Ev)
    const std::optional<at::Tensor>& grad_lse, // (B, Hq, L), lse's dtype
    const at::Tensor& query,                   // (B, Hq, L, E)
    const at::Tensor& key,                     // (B, Hkv, S, E)
    const at::Tensor& value,                   // (B, Hkv, S, Ev)
    const at::Tensor& out,                     // (B, Hq, L, Ev), attention_forward's
    const at::Tensor& lse,                     // (B, Hq, L), attention_forward's
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask) {
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const std::vector<int64_t> out_shape = {p.B, p.Hq, p.L, p.Ev};
  const std::vector<int64_t> lse_shape = {p.B, p.Hq, p.L};
  TORCH_CHECK(grad_out.sizes() == out_shape && out.sizes() == out_shape,
              "attn_ext: grad_out and out must have shape ", shape_str(out_shape), ", got grad_out ",
              shape_str(grad_out.sizes()), " and out ", shape_str(out.sizes()));
  TORCH_CHECK(grad_out.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "attn_ext: grad_out and out must have query's dtype ", query.scalar_type(), ", got ",
              grad_out.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK(lse.sizes() == lse_shape && lse.scalar_type() == acc,
              "attn_ext: lse must be ", acc, " of shape ", shape_str(lse_shape), ", got ", lse.scalar_type(),
              " of shape ", shape_str(lse.sizes()));
  TORCH_CHECK(!compute_grad_mask || p.mask_kind == MaskKind::Additive,
              "attn_ext: compute_grad_mask needs a float attn_mask");

  at::Tensor grad_query = at::empty(query.sizes(), query.options());
  at::Tensor grad_key = at::empty(key.sizes(), key.options());
  at::Tensor grad_value = at::empty(value.sizes(), value.options());
  at::Tensor grad_mask = at::empty({0}, query.options());
  if (p.B == 0 || p.Hq == 0) {
    if (compute_grad_mask) grad_mask = at::zeros(attn_mask->sizes(), attn_mask->options());
    return {grad_query, grad_key, grad_value, grad_mask};
  }

  const at::Tensor lse_c = lse.contiguous();
  std::optional<at::Tensor> grad_lse_c;
  if (grad_lse.has_value()) {
    TORCH_CHECK(grad_lse->sizes() == lse_shape && grad_lse->scalar_type() == acc,
                "attn_ext: grad_lse must be ", acc, " of shape ", shape_str(lse_shape), ", got ",
                grad_lse->scalar_type(), " of shape ", shape_str(grad_lse->sizes()));
    grad_lse_c = grad_lse->contiguous();
    p.dlse = grad_lse_c->data_ptr();
  }
  p.seed = read_seed(dropout_seed, dropout_p);
  p.out = const_cast<void*>(out.data_ptr());
  p.lse = const_cast<void*>(lse_c.data_ptr());
  p.dout = grad_out.data_ptr();
  p.dq = grad_query.data_ptr();
  p.dk = grad_key.data_ptr();
  p.dv = grad_value.data_ptr();
  for (int d = 0; d < 4; ++d) {
    p.o_stride[d] = out.stride(d);
    p.do_stride[d] = grad_out.stride(d);
    p.dq_stride[d] = grad_query.stride(d);
    p.dk_stride[d] = grad_key.stride(d);
    p.dv_stride[d] = grad_value.stride(d);
  }

  at::Tensor dmask_acc;
  if (compute_grad_mask) {
    // Tasks are (batch, key/value head) pairs; they write the same mask
    // element when the mask broadcasts over a dim they are split on. Then
    // each thread accumulates into a copy of its own.
    std::vector<int64_t> shape(4 - attn_mask->dim(), 1);  // the mask's sizes, padded to 4-D
    for (int64_t size : attn_mask->sizes()) shape.push_back(size);
    const bool shared = (p.B > 1 && shape[0] == 1) || (p.Hkv > 1 && shape[1] == 1);
    shape.insert(shape.begin(), shared ? at::get_num_threads() : 1);
    dmask_acc = at::zeros(shape, query.options().dtype(acc));
    const at::Tensor view = dmask_acc[0].expand({p.B, p.Hq, p.L, p.S});
    for (int d = 0; d < 4; ++d) p.dmask_stride[d] = view.stride(d);
    p.dmask = dmask_acc.data_ptr();
    p.dmask_numel = dmask_acc[0].numel();
    p.dmask_per_thread = shared;
  }

  cpu::attention_backward(p);

  if (compute_grad_mask) grad_mask = dmask_acc.sum(0).view(attn_mask->sizes()).to(attn_mask->scalar_type());
  return {grad_query, grad_key, grad_value, grad_mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, CPU, m) {
  m.impl("attention_forward", &attention_forward_cpu);
  m.impl("attention_backward", &attention_backward_cpu);
}

}  // namespace attn_ext
