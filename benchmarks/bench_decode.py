"""Decoding-step calls on the CPU at issue 13's target shapes: attn_ext against
PyTorch's SDPA (one query row against a cache; no gradient), in one process.

`python -m attn_ext bench --decode --targets --no-model` (attn_ext/benchmark/decode.py):
both implementations in alternation, each figure its best round's time per
call, the ratio ours / SDPA (below 1: attn_ext is faster). From the
repository root:

    python benchmarks/bench_decode.py [--threads N] [--dtype bfloat16]
"""
import sys

from attn_ext.benchmark import decode

if __name__ == "__main__":
    sys.exit(decode.main(["--targets", "--no-model", *sys.argv[1:]], prog="bench_decode.py"))
