"""GPU benchmark: attn_ext's CUDA kernels against SDPA's backends, in one run.

For each dtype (bf16, fp16), head dim (64, 128), causal or not, and sequence
length L in 512 .. 16k at 16k tokens per batch (B = 16384 / L, H = 2048 / E,
as FlashAttention's own benchmark), this times

  ours       attn_ext.scaled_dot_product_attention
  flash      torch SDPA restricted to SDPBackend.FLASH_ATTENTION
  efficient  torch SDPA restricted to SDPBackend.EFFICIENT_ATTENTION
  cudnn      torch SDPA restricted to SDPBackend.CUDNN_ATTENTION
  (each SDPA backend only where it accepts the inputs)

for the forward, the backward (of out.backward(grad), timed alone on a saved
graph) and forward+backward; it reports TFLOP/s (forward 4*B*H*L*S*E, halved
when causal; backward 2.5x; fwd+bwd 3.5x), the ratio to SDPA's flash backend
(flash time / ours: > 1 means ours is faster) and the peak memory of one
forward+backward (torch.cuda.max_memory_allocated above what was live).
Timing: torch.utils.benchmark (CUDA-synchronised), median.

Usage (on a machine with an NVIDIA GPU, attn_ext built with CUDA):
    python benchmarks/bench_gpu.py                        # the full grid
    python benchmarks/bench_gpu.py --quick                # L in 512, 2048; a minute
    python benchmarks/bench_gpu.py --json benchmarks/results/gpu.json --markdown
Anywhere (no GPU needed), the README's one-row-per-case table of a saved run:
    python benchmarks/bench_gpu.py --report benchmarks/results/gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from attn_ext.benchmark import common  # noqa: E402

TOKENS = 16384
MODEL_DIM = 2048
BACKENDS = ("flash", "efficient", "cudnn")


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}[name]

    def fn(q, k, v, is_causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return fn


def _impls():
    import attn_ext

    impls = {"ours": lambda q, k, v, is_causal: attn_ext.scaled_dot_product_attention(q, k, v, is_causal=is_causal)}
    for name in BACKENDS:
        impls[name] = _sdpa_backend(name)
    return impls


def run_case(shape, dtype, impls, min_run_time):
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(shape.B, shape.H, shape.L, shape.E, device=device, dtype=dtype, generator=g)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(shape.B, shape.H, shape.L, shape.E, device=device, dtype=dtype, generator=g)
    results = {}
    reference = None
    for name, fn in impls.items():
        try:
            with torch.no_grad():
                out = fn(q, k, v, shape.causal)
        except RuntimeError as exc:  # this SDPA backend does not take these inputs
            results[name] = {"error": str(exc).splitlines()[0][:120]}
            continue
        if reference is None and name != "ours":
            reference = out
        results[name] = {"out": out}
    if "out" in results.get("ours", {}) and reference is not None:
        results["ours"]["rel_err_vs_sdpa"] = common.rel_err(results["ours"]["out"], reference)

    for name, fn in impls.items():
        if "error" in results[name]:
            continue
        results[name].pop("out", None)

        def fwd():
            with torch.no_grad():
                fn(q, k, v, shape.causal)

        def fwd_bwd():
            fn(q, k, v, shape.causal).backward(grad)
            q.grad = k.grad = v.grad = None

        out = fn(q, k, v, shape.causal)

        def bwd():
            out.backward(grad, retain_graph=True)
            q.grad = k.grad = v.grad = None

        r = results[name]
        r["fwd_ms"] = common.time_fn(fwd, min_run_time=min_run_time).median_ms
        r["bwd_ms"] = common.time_fn(bwd, min_run_time=min_run_time).median_ms
        r["fwd+bwd_ms"] = common.time_fn(fwd_bwd, min_run_time=min_run_time).median_ms
        del out
        r["peak_mb"] = common.peak_memory(fwd_bwd, "cuda").peak_mb
        for p in ("fwd", "bwd", "fwd+bwd"):
            r[f"{p}_tflops"] = common.attention_flops(shape, p) / (r[f"{p}_ms"] * 1e-3) / 1e12
    return results


def report(paths):
    """The compact markdown table (one row per case) of saved --json runs."""
    header = ["B×H×L×E", "causal", "dtype", "fwd ours", "fwd flash", "fwd ×flash", "bwd ours", "bwd flash",
              "bwd ×flash", "fwd+bwd ×flash", "efficient fwd / bwd", "cuDNN fwd / bwd", "peak MB ours / flash"]
    rows, devices = [], set()
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        commit = f", commit {run['commit']}" if run.get("commit") else ""
        devices.add(f"{run['device']}, torch {run['torch']}{commit}")
        for rec in run["records"]:
            res = rec["results"]
            ours, flash = res.get("ours", {}), res.get("flash", {})
            if "fwd_ms" not in ours:
                continue
            shape = common.parse_shapes(rec["shape"])[0]

            def ratio(p):
                return common.fmt(flash[f"{p}_ms"] / ours[f"{p}_ms"], 2) if f"{p}_ms" in flash else "-"

            def pair(name):
                r = res.get(name, {})
                return f"{common.fmt(r['fwd_tflops'], 0)} / {common.fmt(r['bwd_tflops'], 0)}" if "fwd_tflops" in r else "-"

            rows.append([f"{shape.B}×{shape.H}×{shape.L}×{shape.E}", "yes" if shape.causal else "no", rec["dtype"],
                         common.fmt(ours["fwd_tflops"], 0), common.fmt(flash.get("fwd_tflops"), 0), f"**{ratio('fwd')}**",
                         common.fmt(ours["bwd_tflops"], 0), common.fmt(flash.get("bwd_tflops"), 0), f"**{ratio('bwd')}**",
                         ratio("fwd+bwd"), pair("efficient"), pair("cudnn"),
                         f"{common.fmt(ours['peak_mb'], 0)} / {common.fmt(flash.get('peak_mb'), 0)}"])
    print("TFLOP/s on " + "; ".join(sorted(devices)))
    print(common.format_table(header, rows, markdown=True))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16,float16")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--quick", action="store_true", help="L in 512 and 2048, short timings")
    ap.add_argument("--min-run-time", type=float, default=0.5)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--commit", default="", help="the commit measured, kept in the --json file")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the table of saved --json runs and exit")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device is available here", file=sys.stderr)
        return 2
    dtypes = [common.parse_dtype(d) for d in args.dtype.split(",")]
    seqlens = [512, 2048] if args.quick else [int(x) for x in args.seqlens.split(",")]
    min_run_time = 0.1 if args.quick else args.min_run_time
    impls = _impls()
    device_name = torch.cuda.get_device_name()
    print(f"attn_ext GPU benchmark on {device_name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    rows, records = [], []

    def save():  # after every case: a run cut short keeps what it measured
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"device": device_name, "torch": torch.__version__, "commit": args.commit, "records": records},
                          f, indent=1)

    for dtype in dtypes:
        for E in (int(x) for x in args.head_dims.split(",")):
            for causal in (False, True):
                for L in seqlens:
                    shape = common.Shape(B=max(1, TOKENS // L), H=MODEL_DIM // E, L=L, E=E, causal=causal)
                    res = run_case(shape, dtype, impls, min_run_time)
                    records.append({"shape": shape.spec(), "dtype": common.dtype_name(dtype), "results": res})
                    save()
                    flash = res.get("flash", {})
                    ours = res.get("ours", {})
                    for p in ("fwd", "bwd", "fwd+bwd"):
                        ratio = (flash[f"{p}_ms"] / ours[f"{p}_ms"]) if f"{p}_ms" in flash and f"{p}_ms" in ours else None
                        rows.append([shape.label(), "yes" if causal else "no", common.dtype_name(dtype), p,
                                     common.fmt(ours.get(f"{p}_tflops")),
                                     *(common.fmt(res.get(b, {}).get(f"{p}_tflops")) for b in BACKENDS),
                                     common.fmt(ratio, 2),
                                     common.fmt(ours.get("peak_mb")) if p == "fwd+bwd" else "",
                                     common.fmt(flash.get("peak_mb")) if p == "fwd+bwd" else ""])
                    if "error" in ours:
                        print(f"  ours failed on {shape.label()} {dtype}: {ours['error']}")
                    elif ours.get("rel_err_vs_sdpa", 0) > 2e-2:
                        print(f"  WARNING {shape.label()} {dtype}: ours vs SDPA rel err {ours['rel_err_vs_sdpa']:.2e}")
    header = ["shape BxHxLxE", "causal", "dtype", "pass", "ours TFLOP/s", "flash", "efficient", "cudnn",
              "vs flash", "peak MB ours", "peak MB flash"]
    print(common.format_table(header, rows, markdown=args.markdown))
    if args.json:
        save()
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
