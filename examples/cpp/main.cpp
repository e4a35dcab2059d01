// A LibTorch program calling attn_ext's fused attention: forward with a causal
// mask, backward, and the same numbers from plain ATen math beside them.
#include <cmath>
#include <cstdio>

#include <ATen/ATen.h>
#include <attn_ext/attn_ext.h>

int main() {
  at::manual_seed(0);
  const int64_t B = 2, H = 4, L = 128, E = 64;
  at::Tensor q = at::randn({B, H, L, E}), k = at::randn({B, H, L, E}), v = at::randn({B, H, L, E});
  const double scale = 1.0 / std::sqrt(static_cast<double>(E));

  // out (B, H, L, E), lse (B, H, L): causal, top-left aligned (causal_offset 0), no dropout.
  auto [out, lse] = attn_ext::attention_forward(q, k, v, std::nullopt, 0.0, /*is_causal=*/true,
                                                /*causal_offset=*/0, scale, std::nullopt);
  at::Tensor grad_out = at::randn_like(out);
  auto [dq, dk, dv, dmask, dsinks] = attn_ext::attention_backward(grad_out, std::nullopt, q, k, v, out, lse,
                                                                  std::nullopt, 0.0, true, 0, scale, std::nullopt);

  at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  scores = scores.masked_fill(at::ones({L, L}, at::kBool).triu(1), -INFINITY);
  at::Tensor ref = at::matmul(at::softmax(scores, -1), v);
  const double err = ((out - ref).norm() / ref.norm()).item<double>();

  std::printf("attn_ext %s\n", attn_ext::build_info().c_str());
  std::printf("out %s, lse %s, grad_query %s; rel err vs ATen math %.1e\n", c10::str(out.sizes()).c_str(),
              c10::str(lse.sizes()).c_str(), c10::str(dq.sizes()).c_str(), err);
  return err < 1e-5 ? 0 : 1;
}
