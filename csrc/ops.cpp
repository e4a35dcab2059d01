// attn_ext: operator schemas and the input validation every device shares.
#include "ops.h"

#include <cmath>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/library.h>


#if defined(ATTN_EXT_BUILD_INFO_HEADER)
#include ATTN_EXT_BUILD_INFO_HEADER  // CMake writes the build info into a header
#endif
#ifndef ATTN_EXT_BUILD_INFO
#define ATTN_EXT_BUILD_INFO "unknown"
#endif

namespace attn_ext {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "(";
  for (size_t d = 0; d < sizes.size(); ++d) os << (d ? ", " : "") << sizes[d];
  os << (sizes.size() == 1 ? ",)" : ")");
  return os.str();
}

at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    default:
      TORCH_CHECK(false, "attn_ext: query must be float16, bfloat16, float32 or float64, got ", t);
  }
}

void check_4d(const at::Tensor& t, const char* name, const char* dims) {
  TORCH_CHECK(t.dim() == 4, "attn_ext: ", name, " must be 4-D ", dims, ", got shape ", shape_str(t.sizes()));
}

}  // namespace

void copy_strides(int64_t (&dst)[4], const at::Tensor& t) {
  for (int d = 0; d < 4; ++d) dst[d] = t.stride(d);
}

static void check_like_query(const at::Tensor& t, const char* name, at::IntArrayRef shape, const at::Tensor& query) {
  TORCH_CHECK(t.sizes() == shape, "attn_ext: ", name, " must have shape ", shape_str(shape), ", got ",
              shape_str(t.sizes()));
  TORCH_CHECK(t.scalar_type() == query.scalar_type() && t.device() == query.device(), "attn_ext: ", name,
              " must be ", query.scalar_type(), " on ", query.device(), ", got ", t.scalar_type(), " on ", t.device());
}

void check_lse(const at::Tensor& lse, const char* name, const AttnParams& p, const at::Tensor& query) {
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const std::vector<int64_t> shape = {p.B, p.Hq, p.L};
  TORCH_CHECK(lse.sizes() == shape && lse.scalar_type() == acc && lse.device() == query.device(), "attn_ext: ",
              name, " must be ", acc, " of shape ", shape_str(shape), " on ", query.device(), ", got ",
              lse.scalar_type(), " of shape ", shape_str(lse.sizes()), " on ", lse.device());
}

std::tuple<at::Tensor, at::Tensor> make_forward_outputs(AttnParams& p, const at::Tensor& query, bool probs) {
  at::Tensor result = at::empty({p.B, p.Hq, p.L, probs ? p.S : p.Ev}, query.options());
  at::Tensor lse = at::empty({p.B, p.Hq, p.L}, query.options().dtype(accumulation_dtype(query.scalar_type())));
  if (probs) {
    p.probs = result.data_ptr();
    copy_strides(p.probs_stride, result);
  } else {
    p.out = result.data_ptr();
    copy_strides(p.o_stride, result);
  }
  p.lse = lse.data_ptr();
  return {result, lse};
}

void describe_grad_output(AttnBwdParams& p, const at::Tensor& grad_out, const at::Tensor& out,
                          const at::Tensor& query) {
  const std::vector<int64_t> shape = {p.B, p.Hq, p.L, p.Ev};
  check_like_query(grad_out, "grad_out", shape, query);
  check_like_query(out, "out", shape, query);
  p.out = const_cast<void*>(out.data_ptr());
  p.dout = grad_out.data_ptr();
  copy_strides(p.o_stride, out);
  copy_strides(p.do_stride, grad_out);
}

void describe_grad_probs(AttnBwdParams& p, const at::Tensor& grad_probs, const at::Tensor& probs,
                         const at::Tensor& query) {
  const std::vector<int64_t> shape = {p.B, p.Hq, p.L, p.S};
  check_like_query(grad_probs, "grad_probs", shape, query);
  check_like_query(probs, "probs", shape, query);
  p.probs = const_cast<void*>(probs.data_ptr());
  p.dprobs = grad_probs.data_ptr();
  copy_strides(p.probs_stride, probs);
  copy_strides(p.dprobs_stride, grad_probs);
}

AttnParams make_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                       const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                       int64_t causal_offset, double scale, const std::optional<at::Tensor>& dropout_seed) {
  AttnParams p = make_params(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed);
  check_4d(value, "value", "(B, Hkv, S, Ev)");
  TORCH_CHECK(value.scalar_type() == query.scalar_type(), "attn_ext: query, key and value must have the same dtype, got query ",
              query.scalar_type(), ", key ", key.scalar_type(), ", value ", value.scalar_type());
  TORCH_CHECK(value.device() == query.device(), "attn_ext: query, key and value must be on the same device, got query ",
              query.device(), ", key ", key.device(), ", value ", value.device());
  TORCH_CHECK(value.size(0) == p.B && value.size(1) == p.Hkv && value.size(2) == p.S,
              "attn_ext: value must have key's batch, heads and length (", p.B, ", ", p.Hkv, ", ", p.S,
              "), got value ", shape_str(value.sizes()), " for key ", shape_str(key.sizes()));
  p.Ev = value.size(3);
  p.v = value.data_ptr();
  copy_strides(p.v_stride, value);
  return p;
}

AttnParams make_params(const at::Tensor& query, const at::Tensor& key, const std::optional<at::Tensor>& attn_mask,
                       double dropout_p, bool is_causal, int64_t causal_offset, double scale,
                       const std::optional<at::Tensor>& dropout_seed) {
  check_4d(query, "query", "(B, Hq, L, E)");
  check_4d(key, "key", "(B, Hkv, S, E)");
  TORCH_CHECK(key.scalar_type() == query.scalar_type(), "attn_ext: query and key must have the same dtype, got query ",
              query.scalar_type(), ", key ", key.scalar_type());
  TORCH_CHECK(key.device() == query.device(), "attn_ext: query and key must be on the same device, got query ",
              query.device(), ", key ", key.device());
  const int64_t B = query.size(0), Hq = query.size(1), L = query.size(2), E = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2);
  TORCH_CHECK(key.size(0) == B, "attn_ext: query and key must have the same batch size, got query ",
              shape_str(query.sizes()), ", key ", shape_str(key.sizes()));
  TORCH_CHECK(key.size(3) == E, "attn_ext: key's head dim must equal query's (", E, "), got key ",
              shape_str(key.sizes()), " for query ", shape_str(query.sizes()));
  TORCH_CHECK((Hkv == 0 && Hq == 0) || (Hkv > 0 && Hq % Hkv == 0),
              "attn_ext: the number of query heads must be a multiple of the number of key/value heads, "
              "got query ", shape_str(query.sizes()), " (", Hq, " heads) and key ", shape_str(key.sizes()),
              " (", Hkv, " heads)");
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "attn_ext: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK_VALUE(std::isfinite(scale), "attn_ext: scale must be finite, got ", scale);

  AttnParams p;
  p.B = B, p.Hq = Hq, p.Hkv = Hkv, p.L = L, p.S = S, p.E = E;
  p.dtype = to_dtype(query.scalar_type());
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  copy_strides(p.q_stride, query);
  copy_strides(p.k_stride, key);
  p.causal = is_causal;
  p.causal_offset = causal_offset;
  p.scale = scale;
  p.dropout_p = dropout_p;

  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    TORCH_CHECK(mask.device() == query.device(), "attn_ext: attn_mask must be on query's device ",
                query.device(), ", got ", mask.device());
    TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == query.scalar_type(),
                "attn_ext: attn_mask must be bool or have query's dtype (", query.scalar_type(), "), got ",
                mask.scalar_type());
    const int64_t target[4] = {B, Hq, L, S};
    bool ok = mask.dim() <= 4;
    for (int64_t d = 0; ok && d < mask.dim(); ++d) {
      const int64_t size = mask.size(mask.dim() - 1 - d);
      ok = size == 1 || size == target[3 - d];
    }
    TORCH_CHECK(ok, "attn_ext: attn_mask must broadcast to ", shape_str(target), ", got ",
                shape_str(mask.sizes()));
    p.mask_kind = mask.scalar_type() == at::kBool ? MaskKind::Bool : MaskKind::Additive;
    p.mask = mask.data_ptr();
    copy_strides(p.mask_stride, expand_mask(mask, p));
  }

  if (dropout_p > 0.0) {
    TORCH_CHECK(dropout_seed.has_value(), "attn_ext: dropout_p = ", dropout_p, " needs a dropout_seed tensor");
    const at::Tensor& seed = *dropout_seed;
    TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1,
                "attn_ext: dropout_seed must be an int64 tensor with one element, got ", seed.scalar_type(),
                " of shape ", shape_str(seed.sizes()));
    TORCH_CHECK(seed.device() == query.device(), "attn_ext: dropout_seed must be on query's device ",
                query.device(), ", got ", seed.device());
  }
  return p;
}

at::Tensor expand_mask(const at::Tensor& attn_mask, const AttnParams& p) {
  at::Tensor m = attn_mask;
  while (m.dim() < 4) m = m.unsqueeze(0);
  return m.expand({p.B, p.Hq, p.L, p.S});
}

namespace {
std::string build_info() {
  std::ostringstream os;
  os << ATTN_EXT_BUILD_INFO << ";" << cpu::kernel_info();
#if defined(_OPENMP)
  os << ";openmp=yes";  // at::parallel_for is inline: without OpenMP it runs on one thread
#else
  os << ";openmp=no";
#endif
  return os.str();
}
}  // namespace

TORCH_LIBRARY(attn_ext, m) {
  // query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev), any strides.
  // Returns out (B, Hq, L, Ev) and the log-sum-exp of each row (B, Hq, L) in
  // float32 (float64 for float64 inputs). Key j is visible from row i iff
  // j <= i + causal_offset when is_causal.
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
      "bool is_causal, int causal_offset, float scale, Tensor? dropout_seed) -> (Tensor out, Tensor lse)");
  // Gradients of attention_forward's inputs; grad_mask is (0,) unless
  // compute_grad_mask, then it has attn_mask's shape.
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor lse, Tensor? attn_mask, float dropout_p, bool is_causal, int causal_offset, "
      "float scale, Tensor? dropout_seed, bool compute_grad_mask) -> (Tensor grad_query, Tensor grad_key, "
      "Tensor grad_value, Tensor grad_mask)");
  // The explicit attention probabilities (B, Hq, L, S), with dropout applied
  // as attention_forward applies it (so probs @ value == out), and lse.
  m.def(
      "attention_probs(Tensor query, Tensor key, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "int causal_offset, float scale, Tensor? dropout_seed) -> (Tensor probs, Tensor lse)");
  m.def(
      "attention_probs_backward(Tensor grad_probs, Tensor? grad_lse, Tensor query, Tensor key, Tensor probs, "
      "Tensor lse, Tensor? attn_mask, float dropout_p, bool is_causal, int causal_offset, float scale, "
      "Tensor? dropout_seed, bool compute_grad_mask) -> (Tensor grad_query, Tensor grad_key, Tensor grad_mask)");
  // What this library was built against and which kernels it holds:
  // "key=value;key=value".
  m.def("build_info() -> str", &build_info);
}

}  // namespace attn_ext
