// attn_ext's C++ test: calls the operators as a LibTorch program would, through
// <attn_ext/attn_ext.h> (the dispatcher), and checks them against plain ATen math,
// on the CPU and, where the library has CUDA kernels and a GPU is here, on CUDA.
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <attn_ext/attn_ext.h>

namespace {

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor a64 = a.to(at::kCPU, at::kDouble), b64 = b.to(at::kCPU, at::kDouble);
  return (a64 - b64).norm().item<double>() / b64.norm().item<double>();
}

int failures = 0;

void expect_close(const char* what, double err, double tol) {
  const bool ok = err <= tol;
  std::printf("%-48s rel err %.2e (tol %.0e) %s\n", what, err, tol, ok ? "ok" : "FAILED");
  failures += !ok;
}

// causal (bottom-right aligned), optionally with a sliding window of `window` keys to the left.
void run_case(at::Device device, bool causal, std::optional<int64_t> window, at::ScalarType dtype, double tol) {
  const auto opts = at::TensorOptions().dtype(dtype);
  const int64_t B = 2, H = 3, L = 37, S = 53, E = 24;
  at::Tensor q = at::randn({B, H, L, E}, opts), k = at::randn({B, H, S, E}, opts), v = at::randn({B, H, S, E}, opts);
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));
  const int64_t offset = S - L;  // bottom-right causal alignment

  auto [out, lse] = attn_ext::attention_forward(q.to(device), k.to(device), v.to(device), std::nullopt, 0.0, causal,
                                                offset, scale, std::nullopt, window);

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
      attn_ext::attention_backward(grad.to(dtype).to(device), std::nullopt, q.to(device), k.to(device), v.to(device),
                                   out, lse, std::nullopt, 0.0, causal, offset, scale, std::nullopt, window);
  const std::string name = device.str() + (dtype == at::kFloat ? " float32" : " float64");
  const char* kind = window.has_value() ? "causal window" : (causal ? "causal" : "full");
  char label[96];
  std::snprintf(label, sizeof label, "%s %s out", name.c_str(), kind);
  expect_close(label, rel_err(out, ref), tol);
  std::snprintf(label, sizeof label, "%s %s lse", name.c_str(), kind);
  expect_close(label, rel_err(lse, ref_lse), tol);
  std::snprintf(label, sizeof label, "%s %s grad query/key/value", name.c_str(), kind);
  expect_close(label, std::max({rel_err(dq, q64.grad()), rel_err(dk, k64.grad()), rel_err(dv, v64.grad())}), tol * 10);
}

// A packed batch of two sequences (varlen_forward) against attention_forward on each.
void run_varlen(at::Device device) {
  const int64_t H = 2, E = 16, lengths[2] = {5, 11};
  const double scale = 0.25;
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor q = at::randn({16, H, E}, opts), k = at::randn({16, H, E}, opts), v = at::randn({16, H, E}, opts);
  at::Tensor cu = at::tensor({int64_t{0}, lengths[0], lengths[0] + lengths[1]}, at::kLong);
  auto [out, lse] = attn_ext::varlen_forward(q, k, v, cu, cu, 11, 11, 0.0, true, false, scale, std::nullopt);
  double err = 0;
  for (int64_t b = 0, start = 0; b < 2; start += lengths[b++]) {
    auto rows = [&](const at::Tensor& t) { return t.narrow(0, start, lengths[b]).transpose(0, 1).unsqueeze(0); };
    auto [ref, ref_lse] =
        attn_ext::attention_forward(rows(q), rows(k), rows(v), std::nullopt, 0.0, true, 0, scale, std::nullopt);
    err = std::max(err, rel_err(rows(out), ref));
  }
  expect_close((device.str() + " float32 varlen (2 sequences) out").c_str(), err, 1e-6);
}

}  // namespace

int main() {
  at::manual_seed(0);
  std::printf("%s\n", attn_ext::build_info().c_str());
  std::vector<at::Device> devices{at::kCPU};
#if defined(ATTN_EXT_TEST_CUDA)  // the library holds CUDA kernels
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA);
#endif
  for (const at::Device& device : devices) {
    const double tol32 = device.is_cpu() ? 1e-5 : 1e-4;  // CUDA: --use_fast_math
    for (bool causal : {false, true}) {
      run_case(device, causal, std::nullopt, at::kFloat, tol32);
      run_case(device, causal, std::nullopt, at::kDouble, 1e-12);
    }
    run_case(device, true, 7, at::kFloat, tol32);
    run_case(device, true, 7, at::kDouble, 1e-12);
    run_varlen(device);
  }
  std::printf("%d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
