// attn_ext: the CUDA implementations of the operators: allocate the outputs
// and the backward's workspace, fill the parameter structs, pick the kernels
// (tensor cores when they can run the call, else the generic kernels) and
// launch them on the current stream. The contracts (shapes, dtypes,
// contiguity of the results) are the CPU implementations' in
// csrc/cpu/attention_cpu.cpp; validation is make_params() from ops.h.
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../ops.h"
#include "kernels.h"

namespace attn_ext {
namespace {

// The kernels read the seed on the device: the host never waits for it.
void point_to_seed(AttnParams& p, const std::optional<at::Tensor>& dropout_seed) {
  if (p.dropout_p > 0.0) p.seed_ptr = dropout_seed->data_ptr<int64_t>();  // make_params checked device and dtype
}

// ---------------------------------------------------------------------------
// Which kernels run
// ---------------------------------------------------------------------------

// nullptr when the tensor-core kernels can run `p` on the current device, else why not.
// (A call without keys runs on the generic kernels, whatever this says.)
const char* tensor_core_reason_for(const AttnParams& p) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return cuda::tensor_core_unsupported(p, prop->major, prop->minor, static_cast<int>(prop->sharedMemPerBlockOptin));
}

// A decoding step (a few query rows per key/value head) runs on the decode
// kernel, and a call that leaves most SMs idle splits its keys on the generic
// kernels (kernels.h: SplitKV); the others run on the tensor cores when they
// can, else on the generic kernels.
void launch_forward(const AttnParams& p) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cuda::SplitKV split = cuda::split_kv_plan(p, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
  if (split.n_splits > 1 || split.decode) {
    // The partial rows live until the merge kernel has run: the caching
    // allocator hands their memory out again only behind it on this stream.
    const auto options = at::TensorOptions()
                             .device(at::kCUDA, at::cuda::current_device())
                             .dtype(p.dtype == DType::Float64 ? at::kDouble : at::kFloat);
    const at::Tensor o_part = at::empty({split.n_splits, p.B, p.Hq, p.L, p.Ev}, options);
    const at::Tensor ml_part = at::empty({split.n_splits, p.B, p.Hq, p.L, 2}, options);
    split.o_part = o_part.data_ptr();
    split.ml_part = ml_part.data_ptr();
    cuda::forward_generic(p, stream, split);
  } else if (p.probs == nullptr && p.S > 0 && tensor_core_reason_for(p) == nullptr) {
    cuda::forward_tensor_core(p, stream);
  } else {
    cuda::forward_generic(p, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------
// The backward's buffers
// ---------------------------------------------------------------------------

// Everything the backward allocates besides its results: the accumulators of
// the kernels (BwdWorkspace), the mask-gradient buffer, contiguous lse/dlse.
struct BwdBuffers {
  at::Tensor dq, dk, dv, delta;  // float32/float64 accumulators, zeroed; but see kv_direct
  bool kv_direct = false;        // dk, dv are the results themselves, written whole by the tensor-core kernel
  at::Tensor dmask;              // mask-gradient accumulator, or undefined
  bool dmask_full = false;       // dmask is (B, Hq, L, S), summed over the mask's broadcast dims afterwards
  at::Tensor lse, grad_lse;
  cuda::BwdWorkspace ws;
};

// The mask's gradient accumulates dS into a buffer in the accumulation dtype.
// Where the mask is not broadcast, each element receives one addition and the
// buffer has the mask's own (4-D padded) shape. Where it is broadcast, several
// (b, h, i, j) add into one element with atomicAdd, in an order that changes
// from run to run: the last bits then differ between two identical calls.
// For float64 (gradcheck demands bitwise-identical repeated backwards) and
// under torch.use_deterministic_algorithms(True), the buffer is instead the
// full (B, Hq, L, S) gradient, one addition per element, summed over the
// broadcast dims by torch afterwards, as PyTorch's own efficient-attention
// backward does for a bias.
void make_mask_buffer(AttnBwdParams& p, BwdBuffers& buf, const at::Tensor& attn_mask, at::ScalarType acc) {
  TORCH_CHECK(p.mask_kind == MaskKind::Additive, "attn_ext: compute_grad_mask needs a float attn_mask, got ",
              attn_mask.scalar_type());
  const int64_t full[4] = {p.B, p.Hq, p.L, p.S};
  std::vector<int64_t> shape(4 - attn_mask.dim(), 1);  // the mask's sizes, padded to 4-D
  for (int64_t size : attn_mask.sizes()) shape.push_back(size);
  bool broadcast = false;
  for (int d = 0; d < 4; ++d) broadcast |= shape[d] != full[d];
  buf.dmask_full = broadcast && (p.dtype == DType::Float64 || at::globalContext().deterministicAlgorithms());
  if (buf.dmask_full) {
    buf.dmask = at::zeros({p.B, p.Hq, p.L, p.S}, attn_mask.options().dtype(acc));
    copy_strides(p.dmask_stride, buf.dmask);
  } else {
    buf.dmask = at::zeros(shape, attn_mask.options().dtype(acc));
    copy_strides(p.dmask_stride, buf.dmask.expand({p.B, p.Hq, p.L, p.S}));  // stride 0 on broadcast dims
  }
  p.dmask = buf.dmask.data_ptr();
  p.dmask_numel = buf.dmask.numel();
  p.dmask_per_thread = false;
}

at::Tensor grad_mask_of(const BwdBuffers& buf, const at::Tensor& attn_mask) {
  at::Tensor g = buf.dmask;
  if (buf.dmask_full) {
    std::vector<int64_t> dims;
    const int64_t pad = 4 - attn_mask.dim();
    for (int64_t d = 0; d < 4; ++d)
      if ((d < pad || attn_mask.size(d - pad) == 1) && g.size(d) != 1) dims.push_back(d);
    if (!dims.empty()) g = g.sum(dims, /*keepdim=*/true);
  }
  return g.view(attn_mask.sizes()).to(attn_mask.scalar_type());
}

// The shape of a per-query-head accumulator over the keys, with `cols` columns:
// (B, Hq, S, cols), or (total_k, Hq, cols) for a packed batch (cu_k read on the
// host, before the kernels get the device copies). rows_shape() is the queries'.
std::vector<int64_t> key_rows_shape(const AttnParams& p, int64_t cols) {
  return p.cu_k != nullptr ? std::vector<int64_t>{p.cu_k[p.B], p.Hq, cols}
                           : std::vector<int64_t>{p.B, p.Hq, p.S, cols};
}

// Common part of both backwards: lse/dlse, seed, workspace, mask gradient.
// kv_direct: the tensor-core kernel will run without grouped-query attention,
// so dK and dV need no accumulators (see BwdWorkspace).
BwdBuffers allocate_backward(AttnBwdParams& p, const at::Tensor& query, const at::Tensor& lse,
                            const std::optional<at::Tensor>& grad_lse, const std::optional<at::Tensor>& attn_mask,
                            const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask, bool with_value,
                            bool kv_direct) {
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const at::TensorOptions opts = query.options().dtype(acc);
  check_lse(lse, "lse", p, query);
  BwdBuffers buf;
  buf.lse = lse.contiguous();
  p.lse = buf.lse.data_ptr();
  if (grad_lse.has_value()) {
    check_lse(*grad_lse, "grad_lse", p, query);
    buf.grad_lse = grad_lse->contiguous();
    p.dlse = buf.grad_lse.data_ptr();
  }
  point_to_seed(p, dropout_seed);
  if (compute_grad_mask) {
    TORCH_CHECK(attn_mask.has_value(), "attn_ext: compute_grad_mask needs a float attn_mask, got none");
    make_mask_buffer(p, buf, *attn_mask, acc);
  }
  buf.dq = at::zeros(rows_shape(p, p.E), opts);
  buf.delta = at::zeros(rows_shape(p, -1), opts);
  buf.ws.dq_accum = buf.dq.data_ptr();
  buf.ws.delta = buf.delta.data_ptr();
  buf.kv_direct = kv_direct && with_value && p.Hq == p.Hkv;
  if (buf.kv_direct) {
    buf.dk = at::empty({p.B, p.Hkv, p.S, p.E}, query.options());
    buf.dv = at::empty({p.B, p.Hkv, p.S, p.Ev}, query.options());
    buf.ws.dk_out = buf.dk.data_ptr();
    buf.ws.dv_out = buf.dv.data_ptr();
    return buf;
  }
  // dk/dv get one slice per query head; the host sums each GQA group afterwards.
  buf.dk = at::zeros(key_rows_shape(p, p.E), opts);
  buf.ws.dk_accum = buf.dk.data_ptr();
  if (with_value) {
    buf.dv = at::zeros(key_rows_shape(p, p.Ev), opts);
    buf.ws.dv_accum = buf.dv.data_ptr();
  }
  return buf;
}

// Per-query-head accumulator -> gradient in `dtype` with Hkv heads:
// (B, Hq, S, D) -> (B, Hkv, S, D), or packed (total_k, Hq, D) -> (total_k, Hkv, D).
at::Tensor sum_over_groups(const at::Tensor& accum, const AttnParams& p, at::ScalarType dtype) {
  const int64_t group = p.Hkv > 0 ? p.Hq / p.Hkv : 1;
  if (group == 1) return accum.to(dtype);
  if (accum.dim() == 3) return accum.view({accum.size(0), p.Hkv, group, accum.size(2)}).sum(2).to(dtype);
  return accum.view({p.B, p.Hkv, group, accum.size(2), accum.size(3)}).sum(2).to(dtype);
}

// A packed batch's cu_seqlens, checked and kept as int64 on the host by
// make_varlen_params, copied to the device for the kernels: p.cu_q/cu_k then
// point there (call it after everything that reads them on the host).
struct DeviceSeqlens {
  at::Tensor cu_q, cu_k;
};
DeviceSeqlens to_device(AttnParams& p, const PackedSeqlens& cu, const at::Tensor& query) {
  DeviceSeqlens d{cu.cu_q.to(query.device()), cu.cu_k.to(query.device())};
  p.cu_q = d.cu_q.data_ptr<int64_t>();
  p.cu_k = d.cu_k.data_ptr<int64_t>();
  return d;
}

// ---------------------------------------------------------------------------
// The operators
// ---------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(
    const at::Tensor& query,   // (B, Hq, L, E), any strides
    const at::Tensor& key,     // (B, Hkv, S, E)
    const at::Tensor& value,   // (B, Hkv, S, Ev)
    const std::optional<at::Tensor>& attn_mask,  // bool or query's dtype, broadcastable to (B, Hq, L, S)
    double dropout_p, bool is_causal, int64_t causal_offset, double scale,
    const std::optional<at::Tensor>& dropout_seed,  // int64, 1 element, on query's device
    std::optional<int64_t> window_left, std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes,  // float32 (Hq,) or (B, Hq)
    const std::optional<at::Tensor>& sinks) {       // (Hq,)
  const c10::cuda::CUDAGuard guard(query.device());
  AttnParams p = make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  auto [out, lse] = make_forward_outputs(p, query, /*probs=*/false);
  if (lse.numel() == 0) return {out, lse};
  point_to_seed(p, dropout_seed);
  launch_forward(p);
  return {out, lse};
}

// The backward of the ops with a value once `p` holds the forward's parameters
// (variants described): grad_out and out described, buffers allocated, the
// kernels run. Returns dq, dk, dv (dk, dv with Hkv heads) and the sinks'
// gradient buffer; the mask's gradient stays in `buf`.
struct BackwardResults {
  at::Tensor grad_query, grad_key, grad_value, sinks_buffer;
};
BackwardResults run_backward_kernels(AttnBwdParams& p, BwdBuffers& buf, const Variants& variants,
                                     const at::Tensor& grad_out, const at::Tensor& query, const at::Tensor& out,
                                     const at::Tensor& lse, const std::optional<at::Tensor>& grad_lse,
                                     const std::optional<at::Tensor>& attn_mask,
                                     const std::optional<at::Tensor>& dropout_seed, bool compute_grad_mask,
                                     const PackedSeqlens* cu) {
  describe_grad_output(p, grad_out, out, query);
  // Both kernel families read out and grad_out through any strides, so the
  // forward's choice (made from q, k, v, mask, ...) holds for the backward.
  // The tensor-core backward adds dQ with atomics, in an order that varies
  // from run to run; under torch.use_deterministic_algorithms(True) the
  // generic kernels run instead (each dQ row summed by one block, in order).
  // Without keys (S = 0) only the sinks can have a gradient.
  const bool launch = p.B > 0 && p.Hq > 0 && p.L > 0;  // else every gradient is 0: the zeroed buffers
  const bool tensor_cores = launch && p.S > 0 && !at::globalContext().deterministicAlgorithms() &&
                            tensor_core_reason_for(p) == nullptr;
  buf = allocate_backward(p, query, lse, grad_lse, attn_mask, dropout_seed, compute_grad_mask, true, tensor_cores);
  BackwardResults g;
  g.sinks_buffer = grad_sinks_buffer(p, variants, query);
  DeviceSeqlens device_cu;
  if (cu != nullptr) device_cu = to_device(p, *cu, query);
  if (launch) {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (tensor_cores) {
      cuda::backward_tensor_core(p, buf.ws, stream);
    } else {
      cuda::backward_generic(p, buf.ws, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::ScalarType dtype = query.scalar_type();
  g.grad_query = buf.dq.to(dtype);
  g.grad_key = buf.kv_direct ? buf.dk : sum_over_groups(buf.dk, p, dtype);
  g.grad_value = buf.kv_direct ? buf.dv : sum_over_groups(buf.dv, p, dtype);
  return g;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& grad_out,                 // (B, Hq, L, Ev), any strides
    const std::optional<at::Tensor>& grad_lse,  // (B, Hq, L), lse's dtype
    const at::Tensor& query,                    // (B, Hq, L, E)
    const at::Tensor& key,                      // (B, Hkv, S, E)
    const at::Tensor& value,                    // (B, Hkv, S, Ev)
    const at::Tensor& out,                      // (B, Hq, L, Ev), attention_forward's
    const at::Tensor& lse,                      // (B, Hq, L), attention_forward's
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, bool compute_grad_mask) {
  const c10::cuda::CUDAGuard guard(query.device());
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  BwdBuffers buf;
  BackwardResults g = run_backward_kernels(p, buf, variants, grad_out, query, out, lse, grad_lse, attn_mask,
                                           dropout_seed, compute_grad_mask, nullptr);
  at::Tensor grad_mask = compute_grad_mask ? grad_mask_of(buf, *attn_mask) : at::empty({0}, query.options());
  return {g.grad_query, g.grad_key, g.grad_value, grad_mask, grad_sinks_from(g.sinks_buffer, variants, query)};
}

std::tuple<at::Tensor, at::Tensor> attention_probs_cuda(
    const at::Tensor& query,  // (B, Hq, L, E), any strides
    const at::Tensor& key,    // (B, Hkv, S, E)
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  AttnParams p = make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  auto [probs, lse] = make_forward_outputs(p, query, /*probs=*/true);
  if (lse.numel() == 0) return {probs, lse};
  point_to_seed(p, dropout_seed);
  launch_forward(p);  // the generic kernels: the tensor-core ones do not write probabilities
  return {probs, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_probs_backward_cuda(
    const at::Tensor& grad_probs,               // (B, Hq, L, S), any strides
    const std::optional<at::Tensor>& grad_lse,  // (B, Hq, L)
    const at::Tensor& query,                    // (B, Hq, L, E)
    const at::Tensor& key,                      // (B, Hkv, S, E)
    const at::Tensor& probs,                    // (B, Hq, L, S), attention_probs'
    const at::Tensor& lse,                      // (B, Hq, L), attention_probs'
    const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, int64_t causal_offset,
    double scale, const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks, bool compute_grad_mask) {
  const c10::cuda::CUDAGuard guard(query.device());
  AttnBwdParams p;
  static_cast<AttnParams&>(p) =
      make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  describe_grad_probs(p, grad_probs, probs, query);
  BwdBuffers buf =
      allocate_backward(p, query, lse, grad_lse, attn_mask, dropout_seed, compute_grad_mask, false, false);
  at::Tensor dsinks = grad_sinks_buffer(p, variants, query);
  if (p.B > 0 && p.Hq > 0 && p.L > 0) {
    cuda::backward_generic(p, buf.ws, at::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::ScalarType dtype = query.scalar_type();
  at::Tensor grad_mask = compute_grad_mask ? grad_mask_of(buf, *attn_mask) : at::empty({0}, query.options());
  return {buf.dq.to(dtype), sum_over_groups(buf.dk, p, dtype), grad_mask, grad_sinks_from(dsinks, variants, query)};
}

// Why attention_forward(query, key, value) would not run on the tensor-core
// kernels on query's device, or "" when it would. Masks, causal and dropout do
// not change the choice. The operator allocates out itself, contiguous and
// aligned: it is described as such (a null pointer counts as aligned).
std::string tensor_core_reason(const at::Tensor& query,    // (B, Hq, L, E)
                               const at::Tensor& key,      // (B, Hkv, S, E)
                               const at::Tensor& value) {  // (B, Hkv, S, Ev)
  const c10::cuda::CUDAGuard guard(query.device());
  AttnParams p = make_params(query, key, value, std::nullopt, 0.0, false, 0, 1.0, std::nullopt);
  const int64_t out_stride[4] = {p.Hq * p.L * p.Ev, p.L * p.Ev, p.Ev, 1};
  for (int d = 0; d < 4; ++d) p.o_stride[d] = out_stride[d];
  const char* reason = tensor_core_reason_for(p);
  return reason == nullptr ? std::string() : std::string(reason);
}

// How many key ranges attention_forward(query, key, value) splits each row's
// keys into on query's device (kernels.h: SplitKV); 1 when it does not split.
// Masks, causal and the variants do not change it; dropout turns it off.
int64_t split_kv_splits(const at::Tensor& query,    // (B, Hq, L, E)
                        const at::Tensor& key,      // (B, Hkv, S, E)
                        const at::Tensor& value) {  // (B, Hkv, S, Ev)
  const c10::cuda::CUDAGuard guard(query.device());
  const AttnParams p = make_params(query, key, value, std::nullopt, 0.0, false, 0, 1.0, std::nullopt);
  return cuda::split_kv_plan(p, at::cuda::getCurrentDeviceProperties()->multiProcessorCount).n_splits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(attn_ext, m) {
  // "" when attention_forward(query, key, value) runs on the tensor-core
  // kernels on this device, else the reason it falls back to the generic ones.
  m.def("tensor_core_reason(Tensor query, Tensor key, Tensor value) -> str");
  // The key ranges of its split-KV forward on this device (1: no split).
  m.def("split_kv_splits(Tensor query, Tensor key, Tensor value) -> int");
}

// Packed batches (varlen_attention): the generic kernels, one launch over
// (sequence, head, tile) for the whole batch. cu_seqlens are checked on the
// host (make_varlen_params reads them there), then copied to the device.
std::tuple<at::Tensor, at::Tensor> varlen_forward_cuda(
    const at::Tensor& query,         // (total_q, Hq, E)
    const at::Tensor& key,           // (total_k, Hkv, E)
    const at::Tensor& value,         // (total_k, Hkv, Ev)
    const at::Tensor& cu_seqlens_q,  // (B + 1,) int32/int64
    const at::Tensor& cu_seqlens_k,  // (B + 1,)
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, bool is_causal, bool bottom_right, double scale,
    const std::optional<at::Tensor>& dropout_seed, std::optional<int64_t> window_left,
    std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  PackedSeqlens cu;
  AttnParams p = make_varlen_params(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p, is_causal, bottom_right, scale, dropout_seed, cu);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  auto [out, lse] = make_forward_outputs(p, query, /*probs=*/false);
  if (lse.numel() == 0) return {out, lse};
  const DeviceSeqlens device_cu = to_device(p, cu, query);
  point_to_seed(p, dropout_seed);
  cuda::forward_generic(p, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_backward_cuda(
    const at::Tensor& grad_out,                 // (total_q, Hq, Ev)
    const std::optional<at::Tensor>& grad_lse,  // (total_q, Hq)
    const at::Tensor& query,                    // (total_q, Hq, E)
    const at::Tensor& key,                      // (total_k, Hkv, E)
    const at::Tensor& value,                    // (total_k, Hkv, Ev)
    const at::Tensor& out,                      // (total_q, Hq, Ev), varlen_forward's
    const at::Tensor& lse,                      // (total_q, Hq), varlen_forward's
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, bool is_causal, bool bottom_right, double scale, const std::optional<at::Tensor>& dropout_seed,
    std::optional<int64_t> window_left, std::optional<int64_t> window_right, std::optional<double> softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
  const c10::cuda::CUDAGuard guard(query.device());
  PackedSeqlens cu;
  AttnBwdParams p;
  static_cast<AttnParams&>(p) = make_varlen_params(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   max_seqlen_k, dropout_p, is_causal, bottom_right, scale,
                                                   dropout_seed, cu);
  Variants variants = variants_of(window_left, window_right, softcap, alibi_slopes, sinks);
  describe_variants(p, variants, query);
  BwdBuffers buf;
  BackwardResults g = run_backward_kernels(p, buf, variants, grad_out, query, out, lse, grad_lse, std::nullopt,
                                           dropout_seed, false, &cu);
  return {g.grad_query, g.grad_key, g.grad_value, grad_sinks_from(g.sinks_buffer, variants, query)};
}

TORCH_LIBRARY_IMPL(attn_ext, CUDA, m) {
  m.impl("attention_forward", &attention_forward_cuda);
  m.impl("attention_backward", &attention_backward_cuda);
  m.impl("attention_probs", &attention_probs_cuda);
  m.impl("attention_probs_backward", &attention_probs_backward_cuda);
  m.impl("tensor_core_reason", &tensor_core_reason);
  m.impl("split_kv_splits", &split_kv_splits);
  m.impl("varlen_forward", &varlen_forward_cuda);
  m.impl("varlen_backward", &varlen_backward_cuda);
}

}  // namespace attn_ext
