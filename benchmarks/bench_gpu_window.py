"""A sliding window on the GPU: attn_ext with window=(255, 0) and is_causal (a
256-key window) against attn_ext full causal, the same window as a dense bool
mask (attn_ext and SDPA) and SDPA full causal; 1x8x8192x64, bfloat16 and
float32, forward and forward+backward wall time per call (the mean of ITERS
calls after one warm-up), and the window's relative error against SDPA with the
bool mask. From the repository root, after building:

    python benchmarks/bench_gpu_window.py

Results: benchmarks/results/gpu_h100_window.txt.
"""
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
import attn_ext  # noqa: E402

B, H, L, E, W = 1, 8, 8192, 64, 256
ITERS = 10


def timeit(fn, iters=ITERS):
    """Milliseconds per call of fn (one warm-up call first)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main():
    print(torch.cuda.get_device_name(), torch.__version__)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, L, E, device="cuda", dtype=dtype)
        mask = torch.ones(L, L, dtype=torch.bool, device="cuda").tril().triu(-(W - 1))
        cases = {
            "attn_ext causal": lambda: attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True),
            "attn_ext window": lambda: attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                             window=(W - 1, 0)),
            "attn_ext bool mask": lambda: attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask),
            "sdpa causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "sdpa bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        }
        ref = cases["sdpa bool mask"]().float()
        err = (cases["attn_ext window"]().float() - ref).norm() / ref.norm()
        name = str(dtype).replace("torch.", "")
        for label, fn in cases.items():
            fwd = timeit(fn)
            both = timeit(lambda: torch.autograd.grad(fn(), (q, k, v), g))
            print(f"{name:9s} {label:20s} fwd {fwd:8.2f} ms  fwd+bwd {both:8.2f} ms")
        print(f"{name:9s} window vs sdpa bool mask rel err {err:.2e}")


if __name__ == "__main__":
    main()
