// attn_ext's C++ test: calls the operators through the dispatcher, as a
// LibTorch program would, and checks them against plain ATen math.
#include <cmath>
#include <cstdio>
#include <tuple>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace {

// The variants' arguments every op ends with: window_left, window_right, softcap, alibi_slopes, sinks.
#define VARIANT_ARGS \
  std::optional<int64_t>, std::optional<int64_t>, std::optional<double>, const std::optional<at::Tensor>&, \
      const std::optional<at::Tensor>&
using ForwardFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const std::optional<at::Tensor>&, double, bool, int64_t,
                                                     double, const std::optional<at::Tensor>&, VARIANT_ARGS);
using BackwardFn = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, bool, int64_t, double,
    const std::optional<at::Tensor>&, VARIANT_ARGS, bool);
#undef VARIANT_ARGS

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / b.to(at::kDouble).norm().item<double>();
}

int failures = 0;

void expect_close(const char* what, double err, double tol) {
  const bool ok = err <= tol;
  std::printf("%-48s rel err %.2e (tol %.0e) %s\n", what, err, tol, ok ? "ok" : "FAILED");
  failures += !ok;
}

// causal (bottom-right aligned), optionally with a sliding window of `window` keys to the left.
void run_case(bool causal, std::optional<int64_t> window, at::ScalarType dtype, double tol) {
  auto forward = c10::Dispatcher::singleton().findSchemaOrThrow("attn_ext::attention_forward", "").typed<ForwardFn>();
  auto backward =
      c10::Dispatcher::singleton().findSchemaOrThrow("attn_ext::attention_backward", "").typed<BackwardFn>();
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t B = 2, H = 3, L = 37, S = 53, E = 24;
  at::Tensor q = at::randn({B, H, L, E}, opts), k = at::randn({B, H, S, E}, opts), v = at::randn({B, H, S, E}, opts);
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));
  const int64_t offset = S - L;  // bottom-right causal alignment

  auto [out, lse] = forward.call(q, k, v, std::nullopt, 0.0, causal, offset, scale, std::nullopt, window,
                                 std::nullopt, std::nullopt, std::nullopt, std::nullopt);

  // Plain ATen math in float64.
  at::Tensor q64 = q.to(at::kDouble).requires_grad_(), k64 = k.to(at::kDouble).requires_grad_(),
             v64 = v.to(at::kDouble).requires_grad_();
  at::Tensor scores = at::matmul(q64, k64.transpose(-2, -1)) * scale;
  if (causal) {
    at::Tensor visible = at::ones({L, S}, at::kBool).tril(offset);
    scores = scores.masked_fill(visible.logical_not(), -INFINITY);
  }
  if (window.has_value()) {  // keys before i + offset - window are hidden
    at::Tensor visible = at::ones({L, S}, at::kBool).triu(offset - *window);
    scores = scores.masked_fill(visible.logical_not(), -INFINITY);
  }
  at::Tensor ref = at::matmul(at::softmax(scores, -1), v64);
  at::Tensor ref_lse = at::logsumexp(scores, -1);
  at::Tensor grad = at::randn_like(ref);
  ref.backward(grad);

  auto [dq, dk, dv, dmask, dsinks] =
      backward.call(grad.to(dtype), std::nullopt, q, k, v, out, lse, std::nullopt, 0.0, causal, offset, scale,
                    std::nullopt, window, std::nullopt, std::nullopt, std::nullopt, std::nullopt, false);
  const char* name = dtype == at::kFloat ? "float32" : "float64";
  const char* kind = window.has_value() ? "causal window" : (causal ? "causal" : "full");
  char label[96];
  std::snprintf(label, sizeof label, "%s %s out", name, kind);
  expect_close(label, rel_err(out, ref), tol);
  std::snprintf(label, sizeof label, "%s %s lse", name, kind);
  expect_close(label, rel_err(lse, ref_lse), tol);
  std::snprintf(label, sizeof label, "%s %s grad query/key/value", name, kind);
  expect_close(label, std::max({rel_err(dq, q64.grad()), rel_err(dk, k64.grad()), rel_err(dv, v64.grad())}), tol * 10);
}

}  // namespace

int main() {
  at::manual_seed(0);
  for (bool causal : {false, true}) {
    run_case(causal, std::nullopt, at::kFloat, 1e-5);
    run_case(causal, std::nullopt, at::kDouble, 1e-12);
  }
  run_case(true, 7, at::kFloat, 1e-5);
  run_case(true, 7, at::kDouble, 1e-12);
  std::printf("%d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
