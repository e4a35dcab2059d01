"""Backward A/B on a GPU: attn_ext against SDPA's flash (and cuDNN) on a few bf16 shapes.

A short, steady comparison for kernel work: run it once per build in one session
(e.g. PYTHONPATH=old_tree, then PYTHONPATH=new_tree) and compare the rows. For
each (head dim E, length L, causal) at 16k tokens per batch (B = 16384 / L,
H = 2048 / E) it prints forward and backward TFLOP/s (forward 4*B*H*L*L*E,
halved when causal; backward 2.5x) of ours and flash, the ratio
(ours / flash, > 1 means ours is faster), cuDNN's, and the relative error of
our dq, dk, dv against flash's. Timing: CUDA events around each call, median
of as many calls as fit in about 0.15 s (at least 5), after 3 warm-up calls.

Usage (a machine with an NVIDIA GPU, attn_ext built with CUDA):
    python benchmarks/bench_gpu_backward.py [LABEL]
"""

import statistics
import sys

import torch

from bench_gpu import _impls  # ours and SDPA's backends, as the full benchmark runs them

CASES = [(64, 512, True), (64, 512, False), (64, 1024, True), (64, 1024, False), (64, 2048, False), (64, 2048, True),
         (64, 8192, False), (128, 512, True), (128, 1024, True), (128, 1024, False), (128, 2048, False),
         (128, 2048, True), (128, 8192, False)]


def median_ms(fn, target_s=0.15):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    n = max(5, min(200, int(target_s * 1e3 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv):
    if not torch.cuda.is_available():
        print("bench_gpu_backward: no CUDA device is available here", file=sys.stderr)
        return 2
    label = argv[0] if argv else "attn_ext"
    impls = _impls()
    print(f"== {label}  {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'E':>4} {'L':>6} {'causal':>6} | {'fwd ours':>8} {'fwd fl':>8} {'x':>5} | {'bwd ours':>8} {'bwd fl':>8} "
          f"{'x':>5} | {'cudnn f/b':>11} | relerr dq dk dv")
    for E, L, causal in CASES:
        B, H = 16384 // L, 2048 // E
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        grad = torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16, generator=g)
        flops = 4 * B * H * L * L * E / (2 if causal else 1)
        tflops, grads = {}, {}
        for name in ("ours", "flash", "cudnn"):
            fn = impls[name]
            try:
                out = fn(q, k, v, causal)
            except RuntimeError:  # this SDPA backend does not take these inputs
                continue
            grads[name] = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

            def fwd():
                with torch.no_grad():
                    fn(q, k, v, causal)

            def bwd():
                torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

            tflops[name] = (flops / median_ms(fwd) / 1e9, 2.5 * flops / median_ms(bwd) / 1e9)
            del out
        errs = [((a.float() - b.float()).norm() / b.float().norm()).item()
                for a, b in zip(grads["ours"], grads["flash"])]
        (of, ob), (ff, fb) = tflops["ours"], tflops["flash"]
        cudnn = f"{tflops['cudnn'][0]:5.0f}/{tflops['cudnn'][1]:5.0f}" if "cudnn" in tflops else "-"
        print(f"{E:4d} {L:6d} {str(causal):>6} | {of:8.0f} {ff:8.0f} {of / ff:5.2f} | {ob:8.0f} {fb:8.0f} "
              f"{ob / fb:5.2f} | {cudnn:>11} | " + " ".join(f"{x:.1e}" for x in errs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
