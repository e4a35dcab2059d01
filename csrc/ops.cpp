// attn_ext: operator schemas and the input validation every device shares.
#include "ops.h"

#include <cmath>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>
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

// The kernels count work and index in 64-bit integers, and the largest
// product they form is B Hq L S (E + Ev), the forward's multiply-adds (L and S
// the longest sequences when packed). Inputs expanded with stride 0 can have
// sizes past that without the memory; they raise here instead of overflowing.
void check_indexable(const AttnParams& p, const at::Tensor& query, const at::Tensor& key) {
  const int64_t factors[5] = {p.B, p.Hq, p.L, p.S, p.E + p.Ev};
  int64_t product = 1;
  bool overflows = false;
  for (int64_t f : factors) overflows = c10::mul_overflows(product, std::max<int64_t>(f, 1), &product) || overflows;
  TORCH_CHECK_VALUE(!overflows, "attn_ext: B * Hq * L * S * ", p.Ev > 0 ? "(E + Ev)" : "E", " = ", p.B, " * ", p.Hq,
                    " * ", p.L, " * ", p.S, " * ", p.E + p.Ev,
                    " is past 2**63 - 1, which the kernels cannot index; got query ", shape_str(query.sizes()),
                    " and key ", shape_str(key.sizes()));
}

}  // namespace

void copy_strides(int64_t (&dst)[4], const at::Tensor& t) {
  if (t.dim() == 3) {  // packed (rows, H, D): a batch stride of 0 over (H, rows, D)
    const int64_t packed[4] = {0, t.stride(1), t.stride(0), t.stride(2)};
    std::copy(packed, packed + 4, dst);
    return;
  }
  for (int d = 0; d < 4; ++d) dst[d] = t.stride(d);
}

namespace {
bool packed(const AttnParams& p) { return p.cu_q != nullptr; }
int64_t total_q(const AttnParams& p) { return p.cu_q[p.B]; }
}  // namespace

std::vector<int64_t> rows_shape(const AttnParams& p, int64_t cols) {
  std::vector<int64_t> shape = packed(p) ? std::vector<int64_t>{total_q(p), p.Hq}  //
                                         : std::vector<int64_t>{p.B, p.Hq, p.L};
  if (cols >= 0) shape.push_back(cols);
  return shape;
}

namespace {
void set_lse_strides(AttnParams& p) {
  const int64_t dense[3] = {p.Hq * p.L, p.L, 1}, packed_rows[3] = {0, 1, p.Hq};
  std::copy(packed(p) ? packed_rows : dense, (packed(p) ? packed_rows : dense) + 3, p.lse_stride);
}
}  // namespace

static void check_like_query(const at::Tensor& t, const char* name, at::IntArrayRef shape, const at::Tensor& query) {
  TORCH_CHECK(t.sizes() == shape, "attn_ext: ", name, " must have shape ", shape_str(shape), ", got ",
              shape_str(t.sizes()));
  TORCH_CHECK(t.scalar_type() == query.scalar_type() && t.device() == query.device(), "attn_ext: ", name,
              " must be ", query.scalar_type(), " on ", query.device(), ", got ", t.scalar_type(), " on ", t.device());
}

void check_lse(const at::Tensor& lse, const char* name, const AttnParams& p, const at::Tensor& query) {
  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const std::vector<int64_t> shape = rows_shape(p, -1);
  TORCH_CHECK(lse.sizes() == shape && lse.scalar_type() == acc && lse.device() == query.device(), "attn_ext: ",
              name, " must be ", acc, " of shape ", shape_str(shape), " on ", query.device(), ", got ",
              lse.scalar_type(), " of shape ", shape_str(lse.sizes()), " on ", lse.device());
}

std::tuple<at::Tensor, at::Tensor> make_forward_outputs(AttnParams& p, const at::Tensor& query, bool probs) {
  at::Tensor result = at::empty(rows_shape(p, probs ? p.S : p.Ev), query.options());
  at::Tensor lse = at::empty(rows_shape(p, -1), query.options().dtype(accumulation_dtype(query.scalar_type())));
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
  const std::vector<int64_t> shape = rows_shape(p, p.Ev);
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
  check_indexable(p, query, key);
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
  set_lse_strides(p);
  check_indexable(p, query, key);  // Ev = 0 here; the overload with a value checks again with it

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
    broadcast_mask_strides(p.mask_stride, mask);  // 0 on broadcast dims
  }

  check_dropout_seed(dropout_p, dropout_seed, query);
  return p;
}

void check_dropout_seed(double dropout_p, const std::optional<at::Tensor>& dropout_seed, const at::Tensor& query) {
  if (dropout_p <= 0.0) return;
  TORCH_CHECK(dropout_seed.has_value(), "attn_ext: dropout_p = ", dropout_p, " needs a dropout_seed tensor");
  const at::Tensor& seed = *dropout_seed;
  TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1,
              "attn_ext: dropout_seed must be an int64 tensor with one element, got ", seed.scalar_type(),
              " of shape ", shape_str(seed.sizes()));
  TORCH_CHECK(seed.device() == query.device(), "attn_ext: dropout_seed must be on query's device ",
              query.device(), ", got ", seed.device());
}

void describe_variants(AttnParams& p, Variants& v, const at::Tensor& query) {
  for (const auto& [side, name] : {std::pair{v.window_left, "window_left"}, std::pair{v.window_right, "window_right"}})
    TORCH_CHECK_VALUE(!side.has_value() || *side >= 0, "attn_ext: ", name, " must be >= 0 or None, got ", *side);
  p.window_left = v.window_left.value_or(-1);
  p.window_right = v.window_right.value_or(-1);
  if (v.softcap.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*v.softcap) && *v.softcap > 0.0,
                      "attn_ext: softcap must be a finite float > 0, got ", *v.softcap);
    p.softcap = *v.softcap;
  }
  const std::string heads = std::to_string(p.Hq), batch = std::to_string(p.B);
  if (v.alibi_slopes.has_value()) {
    const at::Tensor& slopes = *v.alibi_slopes;
    const bool shape_ok = (slopes.dim() == 1 && slopes.size(0) == p.Hq) ||
                          (slopes.dim() == 2 && slopes.size(0) == p.B && slopes.size(1) == p.Hq);
    TORCH_CHECK(slopes.scalar_type() == at::kFloat && shape_ok && slopes.device() == query.device(),
                "attn_ext: alibi_slopes must be float32 of shape (", heads, ",) or (", batch, ", ", heads, ") on ",
                query.device(), ", got ", slopes.scalar_type(), " of shape ", shape_str(slopes.sizes()), " on ",
                slopes.device());
    v.alibi_for_kernel = slopes.contiguous();
    p.alibi = v.alibi_for_kernel.data_ptr<float>();
    p.alibi_stride_b = slopes.dim() == 2 ? p.Hq : 0;
  }
  if (v.sinks.has_value()) {
    const at::Tensor& sinks = *v.sinks;
    TORCH_CHECK(sinks.is_floating_point() && sinks.dim() == 1 && sinks.size(0) == p.Hq &&
                    sinks.device() == query.device(),
                "attn_ext: sinks must be a float tensor of shape (", heads, ",) on ", query.device(), ", got ",
                sinks.scalar_type(), " of shape ", shape_str(sinks.sizes()), " on ", sinks.device());
    v.sinks_for_kernel = sinks.to(accumulation_dtype(query.scalar_type())).contiguous();
    p.sinks = v.sinks_for_kernel.data_ptr();
  }
}

at::Tensor grad_sinks_buffer(AttnBwdParams& p, const Variants& variants, const at::Tensor& query) {
  if (!variants.sinks.has_value()) return at::Tensor();
  at::Tensor buffer = at::zeros({p.B, p.Hq}, query.options().dtype(accumulation_dtype(query.scalar_type())));
  p.dsinks = buffer.data_ptr();
  return buffer;
}

at::Tensor grad_sinks_from(const at::Tensor& buffer, const Variants& variants, const at::Tensor& query) {
  if (!buffer.defined()) return at::empty({0}, query.options());
  return buffer.sum(0).to(variants.sinks->scalar_type());
}

namespace {
// cu_seqlens as the kernels read them: int64, contiguous, checked (names the argument).
at::Tensor checked_cu_seqlens(const at::Tensor& cu, const char* name, int64_t total, const char* total_of) {
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1 && (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong),
              "attn_ext: ", name, " must be a 1-D int32 or int64 tensor (B + 1,), got ", cu.scalar_type(),
              " of shape ", shape_str(cu.sizes()));
  at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
  const int64_t* x = c.data_ptr<int64_t>();
  const int64_t n = c.numel();
  TORCH_CHECK_VALUE(x[0] == 0, "attn_ext: ", name, " must start at 0, got ", x[0], " (", name, " = ", cu, ")");
  for (int64_t b = 0; b + 1 < n; ++b)
    TORCH_CHECK_VALUE(x[b + 1] >= x[b], "attn_ext: ", name, " must be non-decreasing, got ", x[b], " then ",
                      x[b + 1], " at ", b, " (", name, " = ", cu, ")");
  TORCH_CHECK_VALUE(x[n - 1] == total, "attn_ext: ", name, " must end at the number of rows of ", total_of, " (",
                    total, "), got ", x[n - 1]);
  return c;
}

int64_t longest(const at::Tensor& cu) {
  const int64_t* x = cu.data_ptr<int64_t>();
  int64_t m = 0;
  for (int64_t b = 0; b + 1 < cu.numel(); ++b) m = std::max(m, x[b + 1] - x[b]);
  return m;
}
}  // namespace

AttnParams make_varlen_params(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, double dropout_p, bool is_causal, bool bottom_right, double scale,
                              const std::optional<at::Tensor>& dropout_seed, PackedSeqlens& cu) {
  const char* dims[3] = {"(total_q, Hq, E)", "(total_k, Hkv, E)", "(total_k, Hkv, Ev)"};
  const at::Tensor* tensors[3] = {&query, &key, &value};
  const char* names[3] = {"query", "key", "value"};
  for (int t = 0; t < 3; ++t)
    TORCH_CHECK(tensors[t]->dim() == 3, "attn_ext: ", names[t], " must be 3-D ", dims[t], ", got shape ",
                shape_str(tensors[t]->sizes()));
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "attn_ext: query, key and value must have the same dtype, got query ", query.scalar_type(), ", key ",
              key.scalar_type(), ", value ", value.scalar_type());
  TORCH_CHECK(key.device() == query.device() && value.device() == query.device(),
              "attn_ext: query, key and value must be on the same device, got query ", query.device(), ", key ",
              key.device(), ", value ", value.device());
  const int64_t Hq = query.size(1), E = query.size(2), Hkv = key.size(1);
  TORCH_CHECK(key.size(2) == E, "attn_ext: key's head dim must equal query's (", E, "), got key ",
              shape_str(key.sizes()));
  TORCH_CHECK(value.size(0) == key.size(0) && value.size(1) == Hkv, "attn_ext: value must have key's rows and heads (",
              key.size(0), ", ", Hkv, "), got value ", shape_str(value.sizes()));
  TORCH_CHECK((Hkv == 0 && Hq == 0) || (Hkv > 0 && Hq % Hkv == 0),
              "attn_ext: the number of query heads must be a multiple of the number of key/value heads, got query ",
              shape_str(query.sizes()), " and key ", shape_str(key.sizes()));
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "attn_ext: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK_VALUE(std::isfinite(scale), "attn_ext: scale must be finite, got ", scale);
  cu.cu_q = checked_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", query.size(0), "query");
  cu.cu_k = checked_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", key.size(0), "key");
  TORCH_CHECK_VALUE(cu.cu_q.numel() == cu.cu_k.numel(), "attn_ext: cu_seqlens_q and cu_seqlens_k must have the same "
                    "length (B + 1), got ", cu.cu_q.numel(), " and ", cu.cu_k.numel());
  const int64_t L = longest(cu.cu_q), S = longest(cu.cu_k);
  TORCH_CHECK_VALUE(max_seqlen_q >= L, "attn_ext: max_seqlen_q must be at least the longest query sequence (", L,
                    "), got ", max_seqlen_q);
  TORCH_CHECK_VALUE(max_seqlen_k >= S, "attn_ext: max_seqlen_k must be at least the longest key sequence (", S,
                    "), got ", max_seqlen_k);

  AttnParams p;
  p.B = cu.cu_q.numel() - 1, p.Hq = Hq, p.Hkv = Hkv, p.L = L, p.S = S, p.E = E, p.Ev = value.size(2);
  p.dtype = to_dtype(query.scalar_type());
  p.q = query.data_ptr();
  p.k = key.data_ptr();
  p.v = value.data_ptr();
  copy_strides(p.q_stride, query);
  copy_strides(p.k_stride, key);
  copy_strides(p.v_stride, value);
  p.cu_q = cu.cu_q.data_ptr<int64_t>();
  p.cu_k = cu.cu_k.data_ptr<int64_t>();
  p.causal = is_causal;
  p.bottom_right = bottom_right;
  p.scale = scale;
  p.dropout_p = dropout_p;
  set_lse_strides(p);
  check_dropout_seed(dropout_p, dropout_seed, query);
  check_indexable(p, query, key);
  return p;
}

void broadcast_mask_strides(int64_t (&dst)[4], const at::Tensor& attn_mask) {
  // what attn_mask.expand({B, Hq, L, S}).strides() would be, without making the view
  // (a few tensor ops: microseconds of a decoding step)
  const int64_t missing = 4 - attn_mask.dim();
  for (int64_t d = 0; d < 4; ++d) {
    const int64_t own = d - missing;  // the mask's dim, < 0 where it has none
    dst[d] = own < 0 || attn_mask.size(own) == 1 ? 0 : attn_mask.stride(own);
  }
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
  // The variants' arguments, the same in every op (DESIGN.md "Attention variants"):
  // window sides (unset = unbounded), softcap, ALiBi slopes float32 (Hq,) or (B, Hq),
  // sinks (Hq,) of any float dtype (their gradient comes in their dtype).
  // Row i sits at key position i + causal_offset for the causal bound, the
  // window and the ALiBi distance.
#define ATTN_EXT_VARIANTS                                                                                \
  "int? window_left=None, int? window_right=None, float? softcap=None, Tensor? alibi_slopes=None, " \
  "Tensor? sinks=None"
  // query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev), any strides.
  // Returns out (B, Hq, L, Ev) and the log-sum-exp of each row (B, Hq, L) in
  // float32 (float64 for float64 inputs).
  m.def(
      "attention_forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
      "bool is_causal, SymInt causal_offset, float scale, Tensor? dropout_seed, " ATTN_EXT_VARIANTS
      ") -> (Tensor out, Tensor lse)");
  // Gradients of attention_forward's inputs; grad_mask is (0,) unless
  // compute_grad_mask, then it has attn_mask's shape; grad_sinks is (0,) without sinks.
  m.def(
      "attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, "
      "Tensor out, Tensor lse, Tensor? attn_mask, float dropout_p, bool is_causal, SymInt causal_offset, "
      "float scale, Tensor? dropout_seed, " ATTN_EXT_VARIANTS ", bool compute_grad_mask=False) -> (Tensor grad_query, "
      "Tensor grad_key, Tensor grad_value, Tensor grad_mask, Tensor grad_sinks)");
  // The explicit attention probabilities (B, Hq, L, S), with dropout applied
  // as attention_forward applies it (so probs @ value == out), and lse.
  m.def(
      "attention_probs(Tensor query, Tensor key, Tensor? attn_mask, float dropout_p, bool is_causal, "
      "SymInt causal_offset, float scale, Tensor? dropout_seed, " ATTN_EXT_VARIANTS ") -> (Tensor probs, Tensor lse)");
  m.def(
      "attention_probs_backward(Tensor grad_probs, Tensor? grad_lse, Tensor query, Tensor key, Tensor probs, "
      "Tensor lse, Tensor? attn_mask, float dropout_p, bool is_causal, SymInt causal_offset, float scale, "
      "Tensor? dropout_seed, " ATTN_EXT_VARIANTS ", bool compute_grad_mask=False) -> (Tensor grad_query, "
      "Tensor grad_key, Tensor grad_mask, Tensor grad_sinks)");
  // A packed batch: query (total_q, Hq, E), key (total_k, Hkv, E), value
  // (total_k, Hkv, Ev); sequence b is rows [cu_seqlens[b], cu_seqlens[b + 1]).
  // Returns out (total_q, Hq, Ev) and lse (total_q, Hq). bottom_right aligns
  // each sequence's last query with its last key.
  m.def(
      "varlen_forward(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, bool is_causal, bool bottom_right, float scale, "
      "Tensor? dropout_seed, " ATTN_EXT_VARIANTS ") -> (Tensor out, Tensor lse)");
  m.def(
      "varlen_backward(Tensor grad_out, Tensor? grad_lse, Tensor query, Tensor key, Tensor value, Tensor out, "
      "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
      "bool is_causal, bool bottom_right, float scale, Tensor? dropout_seed, " ATTN_EXT_VARIANTS
      ") -> (Tensor grad_query, Tensor grad_key, Tensor grad_value, Tensor grad_sinks)");
#undef ATTN_EXT_VARIANTS
  // What this library was built against and which kernels it holds:
  // "key=value;key=value".
  m.def("build_info() -> str", &build_info);
}

}  // namespace attn_ext
