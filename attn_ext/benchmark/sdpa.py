"""Side-by-side benchmark of attn_ext.scaled_dot_product_attention.

For every shape and dtype, in one run on one machine, this times

  ours   attn_ext.scaled_dot_product_attention(q, k, v, is_causal=...)
  SDPA   torch.nn.functional.scaled_dot_product_attention (on the CPU, PyTorch's
         flash kernel for these inputs)
  plain  softmax(q @ k^T * scale + causal_mask) @ v, the mask an additive float
         (L, S) tensor built once, outside the timed region

for the forward alone (under torch.no_grad()) and for forward + backward
(`out.backward(grad)` with a random grad, grads reset to None after each
call); backward alone is reported as (fwd+bwd) - fwd. Each figure is the median
of torch.utils.benchmark.Timer.blocked_autorange after a warm-up, taken in
--rounds rounds that interleave the three implementations, so a machine that
gets busier during the run slows all three alike (the ratios stay honest).

Reported: time in ms, GFLOP/s (forward 4*B*H*L*S*E FLOPs, halved when causal;
backward 2.5x forward; fwd+bwd 3.5x), the ratio to SDPA (SDPA time / our
time: > 1 means faster than SDPA), the ratio to plain, and peak memory.

Peak memory = the extra bytes allocated, above what was live before the call,
at the worst moment of one call: one forward+backward on the "fwd+bwd" row
(output, saved tensors, log-sum-exp, workspace, score matrices, and the three
input gradients; not the inputs themselves), one no-grad forward on the "fwd"
row. On the CPU it is the larger of two lower bounds: the tensors allocated
through PyTorch's CPU allocator (torch.profiler's allocation events, summed in
time order; exact for tensors) and the growth of the process's peak RSS (which
also sees scratch a kernel takes from malloc, e.g. std::vector on OpenMP
threads). Memory is measured after all timing, in a worker process (this
script, re-run with a hidden --memory-worker flag) started with glibc's mmap
threshold pinned low, which makes peak RSS exact but would slow the timed
code. On CUDA it is torch.cuda.max_memory_allocated, in-process. See
attn_ext/benchmark/common.py for the details.
The JSON keeps both CPU figures (tensor_peak_bytes, rss_peak_bytes).

Before timing, each case is checked once: our output and input gradients
against SDPA's (norm-wise relative error, tolerance per dtype). A case that
fails is still timed but flagged WRONG in the table and in a warning, so a
broken kernel is never timed silently.

Absolute times on shared machines are noise; the ratios are the figure.

Usage:
    python benchmarks/bench_cpu.py                       # the default set, float32
    python benchmarks/bench_cpu.py --quick               # L/4, seconds (smoke test)
    python benchmarks/bench_cpu.py --dtype float32,bfloat16 --markdown
    python benchmarks/bench_cpu.py --shapes "4x8x1024x64:causal,1x8x4096x64" \\
        --threads 2 --min-run-time 2 --json benchmarks/results/cpu.json
Shape syntax: BxHxLxE[xS<keys>][:causal], comma separated.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import common

DEFAULT_SHAPES = "4x8x1024x64:causal,4x8x1024x64,1x8x4096x64,2x16x2048x128:causal"
QUICK_L_DIV = 4

IMPLS = ("ours", "sdpa", "plain")


# ----------------------------------------------------------------------------
# The implementations
# ----------------------------------------------------------------------------


def load_ours(which: str, quiet: bool = False) -> tuple[Callable, str]:
    """Return (function under test, a description of where it came from)."""
    if which != "torch":
        try:
            import attn_ext

            from attn_ext import _build

            fn = attn_ext.scaled_dot_product_attention
            isa = _build.library_info().get("cpu_isa_active", "?")
            return fn, (f"attn_ext from {os.path.dirname(os.path.abspath(attn_ext.__file__ or '.'))}, "
                        f"CPU kernels: {isa}")
        except Exception as exc:  # ImportError, or a half-built package
            if which == "attn_ext":
                raise SystemExit(f"cannot use attn_ext.scaled_dot_product_attention: {exc!r}")
            reason = f"{type(exc).__name__}: {exc}"
    else:
        reason = "--impl-under-test torch"
    banner = "!" * 78
    if not quiet:
        print(f"{banner}\n!! NOTE: attn_ext is NOT being measured ({reason}).\n"
              f"!! 'ours' is a stand-in: torch.nn.functional.scaled_dot_product_attention.\n"
              f"!! Every 'ours' figure below is PyTorch's, and 'vs SDPA' should read ~1.00x.\n"
              f"{banner}", file=sys.stderr, flush=True)
    return F.scaled_dot_product_attention, f"STAND-IN torch SDPA ({reason})"


def make_impls(ours_fn: Callable, shape: common.Shape, dtype: torch.dtype,
               device: torch.device, with_plain: bool) -> dict[str, Callable]:
    causal = shape.causal
    impls = {
        "ours": lambda q, k, v: ours_fn(q, k, v, is_causal=causal),
        "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    if with_plain:
        scale = 1.0 / math.sqrt(shape.E)
        if causal:  # top-left aligned, as SDPA's is_causal
            mask = torch.ones(shape.L, shape.s, dtype=torch.bool, device=device).triu(1)
            mask = torch.zeros(shape.L, shape.s, dtype=dtype, device=device).masked_fill(mask, float("-inf"))
            impls["plain"] = lambda q, k, v: torch.softmax(
                q @ k.transpose(-2, -1) * scale + mask, dim=-1) @ v
        else:
            impls["plain"] = lambda q, k, v: torch.softmax(
                q @ k.transpose(-2, -1) * scale, dim=-1) @ v
    return impls


# ----------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------


def check_case(impls: dict[str, Callable], q, k, v, grad) -> dict[str, dict]:
    """Forward + backward of every implementation; errors vs SDPA per tensor.

    Raises if ours or SDPA raises; a failing plain (e.g. out of memory) is
    recorded as {"error": ...} instead.
    """
    results = {}
    for name, fn in impls.items():
        try:
            results[name] = common.forward_backward(fn, (q, k, v), grad)
        except Exception as exc:  # noqa: BLE001
            if name != "plain":
                raise
            results[name] = common.error_text(exc)
    ref = results["sdpa"]
    errs = {}
    for name, got in results.items():
        if name == "sdpa":
            continue
        if isinstance(got, str):
            errs[name] = {"error": got}
        else:
            errs[name] = {key: common.rel_err(a, b)
                          for key, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    return errs


def make_case(shape: common.Shape, dtype: torch.dtype, device: torch.device,
              ours_fn: Callable, with_plain: bool) -> dict:
    """Inputs (fresh torch.randn, seeded) and the callables that get timed."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    q = randn(shape.B, shape.H, shape.L, shape.E)
    k = randn(shape.B, shape.H, shape.s, shape.E)
    v = randn(shape.B, shape.H, shape.s, shape.E)
    grad = randn(shape.B, shape.H, shape.L, shape.E)
    impls = make_impls(ours_fn, shape, dtype, device, with_plain=with_plain)
    by_impl = {name: common.timed_passes(fn, (q, k, v), grad) for name, fn in impls.items()}
    passes = {pass_: {name: p[pass_] for name, p in by_impl.items()} for pass_ in ("fwd", "fwd+bwd")}
    return {"q": q, "k": k, "v": v, "grad": grad, "impls": impls, "passes": passes}


def run_case(shape: common.Shape, dtype: torch.dtype, device: torch.device,
             ours_fn: Callable, args, progress: Callable[[str], None]) -> tuple[dict, dict]:
    """Check, then time, one (shape, dtype). Returns (records by impl, check)."""
    case = make_case(shape, dtype, device, ours_fn, with_plain=not args.no_plain)

    # --- correctness, once, before anything is timed -------------------------
    progress("check")
    tol = common.CHECK_TOL.get(dtype, 1e-2)
    check = {"shape": shape.spec(), "label": shape.label(), "causal": shape.causal,
             "dtype": common.dtype_name(dtype), "tol": tol}
    try:
        errs = check_case(case["impls"], case["q"], case["k"], case["v"], case["grad"])
        ours_err = max(errs["ours"].values())
        check.update(rel_err=errs, ours_max_rel_err=ours_err,
                     ok=bool(ours_err <= tol))  # NaN fails too
    except Exception as exc:  # noqa: BLE001 - report and go on with the next case
        check.update(ok=False, error=f"{type(exc).__name__}: {exc}")

    # --- timing, interleaved across implementations ---------------------------
    records = {name: {"impl": name, "fwd": None, "fwd+bwd": None, "peak_fwd": None,
                      "peak_fwd+bwd": None, "error": None} for name in case["impls"]}
    for pass_, fns in case["passes"].items():
        progress(f"time {pass_}")
        live = {n: f for n, f in fns.items() if records[n]["error"] is None}
        timed = common.time_interleaved(live, min_run_time=args.min_run_time,
                                        rounds=args.rounds, warmup=args.warmup)
        for name, res in timed.items():
            if isinstance(res, BaseException):  # e.g. plain out of memory, a dtype ours lacks
                records[name]["error"] = records[name]["error"] or common.error_text(res)
            else:
                records[name][pass_] = res
    del case
    common.release_memory(device)
    return records, check


def measure_all_memory(cases, device, ours_fn, args, all_records=None) -> list[dict]:
    """Peak memory for every case (after all timing: prepare_cpu_peak_memory changes
    malloc's behaviour): [{impl: {"peak_fwd": {...}, ...}}, ...]."""
    if device.type == "cpu":
        common.prepare_cpu_peak_memory()
    out = []
    for i, (shape, dtype) in enumerate(cases):
        print(f"memory {shape.spec()} {common.dtype_name(dtype)}", file=sys.stderr, flush=True)
        records = {name: {"error": None} for name in IMPLS}
        if all_records is not None:  # skip what already failed while timing
            records = {n: {"error": r["error"]} for n, r in all_records[i].items()}
        case = make_case(shape, dtype, device, ours_fn, with_plain=not args.no_plain)
        common.measure_peaks(case["passes"], device, records)
        del case
        common.release_memory(device)
        out.append(common.peaks_as_json(records))
    return out


def to_rows(shape: common.Shape, dtype: torch.dtype, records: list[dict],
            check: dict) -> list[dict]:
    """Flatten one case into one result dict per (pass, impl)."""
    rows = []
    for rec in records:
        fwd, fb = rec["fwd"], rec["fwd+bwd"]
        # The backward is forward+backward less the forward: on a call so short that
        # timing noise exceeds it, that difference is not a time (None, as unmeasured).
        bwd = fb.median_s - fwd.median_s if (fwd and fb) else None
        times = {
            "fwd": fwd.median_s if fwd else None,
            "fwd+bwd": fb.median_s if fb else None,
            "bwd": bwd if bwd is not None and bwd > 0 else None,
        }
        for pass_ in common.PASSES:
            t = times[pass_]
            flops = common.attention_flops(shape, pass_)
            peak = rec.get(f"peak_{pass_}")
            timing = rec.get(pass_) if pass_ != "bwd" else None
            rows.append({
                "shape": shape.label(), "B": shape.B, "H": shape.H, "L": shape.L,
                "S": shape.s, "E": shape.E, "causal": shape.causal,
                "dtype": common.dtype_name(dtype), "pass": pass_, "impl": rec["impl"],
                "ms": t * 1e3 if t is not None else None,
                "iqr_ms": timing.iqr_s * 1e3 if timing else None,
                "runs": timing.runs if timing else None,
                "gflops": flops / t / 1e9 if t is not None and t > 0 else None,
                "flops": flops,
                "peak_bytes": peak.peak_bytes if peak else None,
                "tensor_peak_bytes": peak.tensor_peak_bytes if peak else None,
                "rss_peak_bytes": peak.rss_peak_bytes if peak else None,
                "peak_method": peak.method if peak else None,
                "retained_bytes": peak.retained_bytes if peak else None,
                "check_ok": check.get("ok"),
                "error": rec["error"],
            })
    return rows


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------


def render_table(rows: list[dict], checks: list[dict], with_plain: bool, markdown: bool) -> str:
    index = {(r["shape"], r["causal"], r["dtype"], r["pass"], r["impl"]): r for r in rows}
    cases = list(dict.fromkeys((r["shape"], r["causal"], r["dtype"]) for r in rows))
    failed = {(c["label"], c["causal"], c["dtype"]) for c in checks if not c.get("ok")}

    header = ["shape BxHxLxE", "causal", "dtype", "pass", "ours ms", "ours GFLOP/s",
              "SDPA GFLOP/s", "vs SDPA"]
    if with_plain:
        header += ["plain GFLOP/s", "vs plain"]
    header += ["peak MB ours", "SDPA"] + (["plain"] if with_plain else []) + ["note"]

    def ratio(a, b):  # speed of a relative to b = time b / time a
        if a is None or b is None or a["ms"] is None or b["ms"] is None or a["ms"] <= 0:
            return "-"
        return f"{b['ms'] / a['ms']:.2f}x"

    def mb(r):
        if r is None or r["error"]:
            return "ERR" if r is not None else "-"
        return common.fmt(r["peak_bytes"] / 2**20 if r["peak_bytes"] is not None else None, 1)

    def gf(r):
        if r is None:
            return "-"
        return "ERR" if r["error"] else common.fmt(r["gflops"], 1)

    out_rows = []
    for shape, causal, dtype in cases:
        for pass_ in common.PASSES:
            o, s, p = (index.get((shape, causal, dtype, pass_, i)) for i in IMPLS)
            notes = []
            if (shape, causal, dtype) in failed and not (o and o["error"]):
                notes.append("WRONG vs SDPA")
            for name, r in (("ours", o), ("SDPA", s), ("plain", p)):
                if r is not None and r["error"]:
                    notes.append(f"{name}: {r['error'][:40]}")
            line = [shape, "yes" if causal else "no", dtype, pass_,
                    "ERR" if o["error"] else common.fmt(o["ms"], 2), gf(o), gf(s), ratio(o, s)]
            if with_plain:
                line += [gf(p), ratio(o, p)]
            show_mem = pass_ != "bwd"
            line += [mb(o) if show_mem else "", mb(s) if show_mem else ""]
            if with_plain:
                line += [mb(p) if show_mem else ""]
            line += ["; ".join(notes)]
            out_rows.append(line)
    align = "llll" + "r" * (len(header) - 5) + "l"
    if not any(line[-1] for line in out_rows):  # no notes: drop the column
        header, align, out_rows = header[:-1], align[:-1], [line[:-1] for line in out_rows]
    return common.format_table(header, out_rows, markdown=markdown, align=align)


def print_warnings(checks: list[dict]) -> None:
    for c in checks:
        if c.get("ok"):
            continue
        if "error" in c:
            print(f"WARNING: ours FAILED for {c['shape']} {c['dtype']}: raised "
                  f"{c['error'].splitlines()[0]}", flush=True)
            continue
        errs = ", ".join(f"{k}={v:.2e}" for k, v in c["rel_err"]["ours"].items())
        print(f"WARNING: ours is WRONG for {c['shape']} {c['dtype']}: relative error vs SDPA "
              f"{errs} (tolerance {c['tol']:.0e}). Its timings are of a broken kernel.",
              flush=True)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


IMPL_LABELS = {"ours": "attn_ext", "sdpa": "torch SDPA", "plain": "plain softmax(QK^T)V"}


def plot_throughput(rows: list[dict], path: str, title: str) -> None:
    """PNG: GFLOP/s against sequence length, one panel per (dtype, causal) x (fwd, fwd+bwd)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["dtype"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.4 * len(groups)), squeeze=False)
    for i, (dtype, causal) in enumerate(groups):
        for j, pass_ in enumerate(("fwd", "fwd+bwd")):
            ax = axes[i][j]
            for impl in IMPLS:
                points = sorted((r["L"], r["gflops"]) for r in rows
                                if (r["dtype"], r["causal"], r["pass"], r["impl"]) == (dtype, causal, pass_, impl)
                                and r["gflops"])
                if points:
                    ax.plot(*zip(*points), marker="o", label=IMPL_LABELS[impl])
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length L = S")
            ax.set_ylabel("GFLOP/s")
            ax.set_title(f"{dtype}, {'causal' if causal else 'not causal'}, {pass_}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None, prog=None):
    p = common.bench_parser(
        prog, "Time attn_ext.scaled_dot_product_attention against PyTorch's SDPA "
              "and the plain softmax(QK^T)V, forward and backward.",
        "Shapes: BxHxLxE[xS<keys>][:causal], comma separated, e.g. "
        "'4x8x1024x64:causal,1x8x4096x64'.\nDefault: " + DEFAULT_SHAPES
        + "\nThe attention variants (window, softcap, alibi, sinks, varlen): "
          "python -m attn_ext bench --variant NAME --help\nDecoding steps and the char GPT's tokens/s: "
          "python -m attn_ext bench --decode --help", QUICK_L_DIV)
    p.add_argument("--no-plain", action="store_true", help="skip the plain softmax(QK^T)V")
    p.add_argument("--plot", metavar="PATH", help="draw GFLOP/s against L to this PNG (matplotlib)")
    p.add_argument("--impl-under-test", choices=("auto", "attn_ext", "torch"), default="auto",
                   help="debug: 'torch' times torch SDPA as a stand-in for ours; 'auto' "
                        "(default) falls back to it, loudly, if attn_ext cannot be used")
    return common.finish_bench_args(p, p.parse_args(argv), argv, DEFAULT_SHAPES, QUICK_L_DIV)


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    device = common.bench_device(args.device, args.threads, prog or "attn_ext bench")
    if device is None:
        return 2
    if args.memory_worker:  # child of run_memory_worker
        ours_fn, _ = load_ours(args.impl_under_test, quiet=True)
        cases = [(s, d) for s in args.shape_list for d in args.dtypes]
        peaks = measure_all_memory(cases, device, ours_fn, args)
        with open(args.memory_worker, "w") as f:
            json.dump(peaks, f)
        return 0
    ours_fn, ours_desc = load_ours(args.impl_under_test)
    info = common.machine_info(device)

    print(f"attn_ext attention benchmark on {device.type.upper()}")
    print(common.describe_machine(info))
    print(f"ours: {ours_desc}")
    print(f"{common.timing_note(args)}; bwd = (fwd+bwd) - fwd; vs X = X time / ours time (>1: ours faster)")
    print(common.peak_note(device) + (" [--quick]" if args.quick else ""))
    print(flush=True)

    cases = [(s, d) for s in args.shape_list for d in args.dtypes]
    all_rows, checks, all_records = [], [], []
    t_start = time.perf_counter()
    bar = common.progress_bar(len(cases), "bench")
    for shape, dtype in cases:
        prefix = f"{shape.spec()} {common.dtype_name(dtype)}"

        def progress(stage, prefix=prefix):
            bar.set_postfix_str(f"{prefix}: {stage}")

        records, check = run_case(shape, dtype, device, ours_fn, args, progress)
        bar.update(1)
        checks.append(check)
        all_records.append(records)
    bar.close()

    # Memory after timing. On the CPU in a worker process started with
    # common.RSS_ENV (see common.py), so peak RSS can be trusted and the
    # timings above ran with the default malloc.
    peaks = None
    if device.type == "cpu":
        stand_in = ours_fn is F.scaled_dot_product_attention
        peaks = common.run_memory_worker("attn_ext.benchmark.sdpa", [
            *args.argv, "--impl-under-test", "torch" if stand_in else "attn_ext"])
    if peaks is None:
        peaks = measure_all_memory(cases, device, ours_fn, args, all_records)
    for (shape, dtype), records, check, case_peaks in zip(cases, all_records, checks, peaks):
        common.merge_peaks(records, case_peaks)
        all_rows.extend(to_rows(shape, dtype, list(records.values()), check))

    print(render_table(all_rows, checks, with_plain=not args.no_plain, markdown=False))
    if args.markdown:
        print()
        print(f"Machine: {common.describe_machine(info)}. "
              f"Median of torch.utils.benchmark; vs SDPA > 1 means faster than "
              f"torch.nn.functional.scaled_dot_product_attention.")
        print()
        print(render_table(all_rows, checks, with_plain=not args.no_plain, markdown=True))
    print()
    print_warnings(checks)
    print(f"({time.perf_counter() - t_start:.1f} s)")

    if args.plot:
        plot_throughput(all_rows, args.plot, f"{common.describe_machine(info).splitlines()[0]}")
        print(f"wrote {args.plot}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({
                "machine": info, "device": str(device), "ours": ours_desc,
                "stand_in": ours_fn is F.scaled_dot_product_attention,
                "args": {k: v for k, v in vars(args).items() if k not in ("dtypes", "shape_list")},
                "shapes": [s.spec() for s in args.shape_list],
                "flop_convention": "fwd 4*B*H*L*S*E (halved if causal), bwd 2.5x, fwd+bwd 3.5x",
                "checks": checks, "results": all_rows,
            }, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(c.get("ok") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
