"""Context parallelism on the CPU: ring attention over W gloo processes against one process.

Issue 14's measure: the forward (+ backward) of attn_ext.distributed.ring_attention
with the sequence split over W processes of `--threads` threads each (default:
2 processes, 1 thread), against attn_ext.scaled_dot_product_attention over the
whole sequence in one process with the same threads per process. Every figure
is the best of `--rounds` rounds, wall time from a barrier before the call to a
barrier after it (the slowest rank's time); the one-process call runs on rank
0 while the other ranks wait at the barrier, interleaved with the ring's calls
round by round. Also printed: the ring's error against the one-process output
and, per rank, the peak bytes of tensors allocated during a forward+backward
(torch.profiler's allocator events; the largest rank's).

From the repository root:

    python benchmarks/bench_ring.py                      # L = 8192, 4 heads of 64, float32
    python benchmarks/bench_ring.py --world 2 --seq 4096 --dtype bfloat16
"""
import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.append(str(Path(__file__).resolve().parent.parent))  # an in-place build; an installed one wins
import attn_ext  # noqa: E402
from attn_ext.benchmark import common  # noqa: E402
from attn_ext.distributed import ring_attention, shard  # noqa: E402

# (name, is_causal, layout)
CONFIGS = [("full", False, "contiguous"), ("causal", True, "contiguous"), ("causal", True, "zigzag")]


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="processes in the ring (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    p.add_argument("--seq", type=int, default=8192, help="whole sequence length L (default: 8192)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default: 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
    p.add_argument("--dim", type=int, default=64, help="head dim (default: 64)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, float64 (default: float32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each figure is the best (default: 3)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    args = p.parse_args(argv)
    if args.world < 1 or args.seq % (2 * args.world):
        p.error(f"--seq must divide by 2 x --world (zigzag), got --seq {args.seq} and --world {args.world}")
    return args


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank, world, port, args, results):
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = common.parse_dtype(args.dtype)
    Hkv = args.kv_heads or args.heads
    g = torch.Generator().manual_seed(0)
    B, L, E = args.batch, args.seq, args.dim
    q, k, v, grad = (torch.randn(B, h, L, E, generator=g).to(dtype)
                     for h in (args.heads, Hkv, Hkv, args.heads))
    gqa = Hkv != args.heads

    def one_process(is_causal, backward):
        def run():
            if backward:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                attn_ext.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=gqa).backward(grad)
            else:
                with torch.no_grad():
                    attn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
        return run

    def ring(is_causal, layout, backward):
        local = [shard(t, -2, layout) for t in (q, k, v)]
        local_grad = shard(grad, -2, layout)

        def run():
            if backward:
                leaves = [t.clone().requires_grad_() for t in local]
                ring_attention(*leaves, is_causal=is_causal, enable_gqa=gqa, layout=layout).backward(local_grad)
            else:
                with torch.no_grad():
                    ring_attention(*local, is_causal=is_causal, enable_gqa=gqa, layout=layout)
        return run

    best = {}

    def keep(key, seconds):
        best[key] = min(best.get(key, float("inf")), seconds)

    for backward in (False, True):  # warm-up: one call of each, untimed
        for is_causal in (False, True):
            _timed(one_process(is_causal, backward) if rank == 0 else (lambda: None))
        for name, is_causal, layout in CONFIGS:
            _timed(ring(is_causal, layout, backward))
    for _ in range(args.rounds):
        for backward in (False, True):
            pass_ = "fwd+bwd" if backward else "fwd"
            for is_causal in (False, True):
                fn = one_process(is_causal, backward) if rank == 0 else (lambda: None)
                keep(("one", is_causal, pass_), _timed(fn))
            for name, is_causal, layout in CONFIGS:
                keep(("ring", is_causal, layout, pass_), _timed(ring(is_causal, layout, backward)))

    # accuracy: the ring's output against the one-process output, gathered on every rank
    errors = {}
    for name, is_causal, layout in CONFIGS:
        with torch.no_grad():
            local_out = ring_attention(*(shard(t, -2, layout) for t in (q, k, v)), is_causal=is_causal,
                                       enable_gqa=gqa, layout=layout)
            whole = attn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
        err = torch.tensor([common.rel_err(local_out, shard(whole, -2, layout))], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors[(is_causal, layout)] = err.item()

    peaks = {}
    if not args.no_memory:
        for name, is_causal, layout in CONFIGS:
            fn = ring(is_causal, layout, True)
            dist.barrier()
            peak = torch.tensor([common.peak_memory(fn, "cpu").peak_bytes], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            peaks[("ring", is_causal, layout)] = peak.item()
            if rank == 0:
                peaks[("one", is_causal)] = common.peak_memory(one_process(is_causal, True), "cpu").peak_bytes
            dist.barrier()
    if rank == 0:
        results.update(best=best, errors=errors, peaks=peaks)
    dist.destroy_process_group()


def main(argv=None):
    args = _parse(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(args.world, port, args, results), nprocs=args.world, start_method="spawn")
    best, errors, peaks = results["best"], results["errors"], results["peaks"]

    info = common.machine_info("cpu")
    info["torch_threads"] = args.threads
    print(common.describe_machine(info))
    print(f"ring of {args.world} processes x {args.threads} thread(s) against 1 process x {args.threads}; "
          f"B={args.batch}, heads {args.heads}/{args.kv_heads or args.heads}, L={args.seq}, E={args.dim}, "
          f"{args.dtype}; best of {args.rounds} rounds; ISA {attn_ext._build.library_info()['cpu_isa_active']}")
    header = ["mask", "layout", "pass", "1 process ms", "ring ms", "ring / 1 process", "ring GFLOP/s",
              "rel err", "peak MB 1 process", "peak MB per rank"]
    rows = []
    for name, is_causal, layout in CONFIGS:
        for pass_ in ("fwd", "fwd+bwd"):
            one, rng = best[("one", is_causal, pass_)], best[("ring", is_causal, layout, pass_)]
            shape = common.Shape(args.batch, args.heads, args.seq, args.dim, is_causal)
            flops = common.attention_flops(shape, pass_)
            peak_one, peak_ring = peaks.get(("one", is_causal)), peaks.get(("ring", is_causal, layout))
            rows.append([name, layout, pass_, f"{one * 1e3:.0f}", f"{rng * 1e3:.0f}", f"{rng / one:.2f}",
                         f"{flops / rng / 1e9:.0f}", f"{errors[(is_causal, layout)]:.1e}",
                         "-" if peak_one is None or pass_ == "fwd" else f"{peak_one / 2**20:.0f}",
                         "-" if peak_ring is None or pass_ == "fwd" else f"{peak_ring / 2**20:.0f}"])
    print(common.format_table(header, rows, markdown=True))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
