"""Decoding-step calls on the CPU: attn_ext against PyTorch's SDPA at the shapes of
issue 13's targets (one query row against a cache; no gradient), in one process.

Each shape is timed for both implementations in alternation, ROUNDS rounds of
CALLS calls; the figure is the best round's time per call, and the ratio is
ours / SDPA (below 1: attn_ext is faster). From the repository root:

    python benchmarks/bench_decode.py [--threads N]
"""
import argparse
import time

import torch
import torch.nn.functional as F

import attn_ext

# (B, H, L, S, E): the targets, ours / SDPA
SHAPES = {
    (1, 8, 1, 4000, 64): "<= 1.0",
    (4, 8, 1, 1024, 64): "<= 1.0",
    (1, 8, 1, 32768, 64): "<= 1.0",
    (1, 4, 1, 100, 32): "<= 1.3",
    (1, 1, 1, 32768, 128): "<= 0.6",
}
ROUNDS = 7


def per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}")
    print(f"{'B, H, L, S, E':24s} {'attn_ext us':>12s} {'sdpa us':>10s} {'ratio':>7s}  target")
    gen = torch.Generator().manual_seed(0)
    for shape, target in SHAPES.items():
        B, H, L, S, E = shape
        q = torch.randn(B, H, L, E, generator=gen).to(dtype)
        k = torch.randn(B, H, S, E, generator=gen).to(dtype)
        v = torch.randn(B, H, S, E, generator=gen).to(dtype)
        ours = lambda: attn_ext.scaled_dot_product_attention(q, k, v)  # noqa: E731
        theirs = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
        calls = max(5, int(2e5 // (H * S * E // 64 + 1000)))
        ours(), theirs()
        best_ours = best_theirs = float("inf")
        for _ in range(ROUNDS):
            best_ours = min(best_ours, per_call_us(ours, calls))
            best_theirs = min(best_theirs, per_call_us(theirs, calls))
        print(f"{str(shape):24s} {best_ours:12.1f} {best_theirs:10.1f} {best_ours / best_theirs:7.2f}  {target}")


if __name__ == "__main__":
    main()
