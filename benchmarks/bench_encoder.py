"""A Transformer encoder layer with attn_ext's attention against the same layer with PyTorch's.

For each sequence length, dtype and causal setting, in one run on one machine:

  torch  torch.nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward,
         dropout=0, batch_first=True): its self_attn is torch.nn.MultiheadAttention
  ours   a deep copy of that layer after attn_ext.convert_attention: self_attn is
         attn_ext.MultiHeadAttention with the same weights; everything else is
         the same modules

timed for forward+backward in training mode (`layer(x).backward(grad)`, grads
reset after each call) and for the forward in eval mode under torch.no_grad()
(where torch's layer takes its fused inference fast path,
torch._transformer_encoder_layer_fwd, and ours cannot: it is the fairest
inference comparison PyTorch offers). Causal rows pass the causal mask with
is_causal=True to both, as nn.TransformerEncoder does. The two layers'
outputs are compared before timing. Timing: torch.utils.benchmark, median, in
interleaved rounds (benchmarks/common.py); ratio = torch time / ours (> 1: ours
faster). Peak memory: extra MB allocated during one forward+backward
(torch.profiler's allocation events on the CPU, max_memory_allocated on CUDA).

Usage:
    python benchmarks/bench_encoder.py                      # CPU, float32
    python benchmarks/bench_encoder.py --quick              # one short row per dtype
    python benchmarks/bench_encoder.py --device cuda --dtype bfloat16,float16 --seqlens 1024,4096
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

from attn_ext.benchmark import common  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None,
                    help="comma-separated dtypes (default: float32 on the CPU, where bf16 matmuls are slow "
                         "without AVX512-BF16/AMX; bfloat16 on CUDA)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--nhead", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2048, help="dim_feedforward")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlens", default="512,1024,2048")
    ap.add_argument("--min-run-time", type=float, default=2.0, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="one L = 256 row per dtype, short timings")
    ap.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args(argv)
    try:
        dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        args.dtypes = [common.parse_dtype(d) for d in dtype.split(",")]
        args.seqlen_list = [256] if args.quick else [int(x) for x in args.seqlens.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if args.quick:
        args.min_run_time, args.rounds = 0.5, 2
    return args


def make_layers(args, dtype, device):
    torch.manual_seed(0)
    theirs = torch.nn.TransformerEncoderLayer(args.d_model, args.nhead, args.ffn, dropout=0.0, batch_first=True,
                                              device=device, dtype=dtype)
    import attn_ext

    ours = attn_ext.convert_attention(copy.deepcopy(theirs))
    return theirs, ours


def run_case(args, L, dtype, causal, device):
    theirs, ours = make_layers(args, dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(L)
    x = torch.randn(args.batch, L, args.d_model, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen).to(device=device, dtype=dtype)
    kwargs = {}
    if causal:
        kwargs = dict(src_mask=torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=dtype),
                      is_causal=True)
    layers = {"torch": theirs, "ours": ours}

    with torch.no_grad():
        err = common.rel_err(ours(x, **kwargs), theirs(x, **kwargs))

    def train_step(layer):
        def fn():
            layer(x, **kwargs).backward(grad)
            x.grad = None
            for p in layer.parameters():
                p.grad = None
        return fn

    def infer_step(layer):
        def fn():
            with torch.no_grad():
                layer(x, **kwargs)
        return fn

    for layer in layers.values():
        layer.train()
    train = common.time_interleaved({name: train_step(m) for name, m in layers.items()},
                                    min_run_time=args.min_run_time, rounds=args.rounds)
    peak = {name: common.peak_memory(train_step(m), device).peak_mb for name, m in layers.items()}
    for layer in layers.values():
        layer.eval()
    infer = common.time_interleaved({name: infer_step(m) for name, m in layers.items()},
                                    min_run_time=args.min_run_time, rounds=args.rounds)
    return {"L": L, "dtype": common.dtype_name(dtype), "causal": causal, "rel_err": err,
            "fwd+bwd_ms": {n: t.median_ms for n, t in train.items()},
            "eval_fwd_ms": {n: t.median_ms for n, t in infer.items()},
            "peak_mb": peak}


def main(argv=None):
    args = parse_args(argv)
    device = common.bench_device(args.device, args.threads, "bench_encoder")
    if device is None:
        return 2
    info = common.machine_info(device)
    print("TransformerEncoderLayer: attn_ext.MultiHeadAttention vs torch.nn.MultiheadAttention")
    print(common.describe_machine(info))
    print(f"layer: d_model={args.d_model}, nhead={args.nhead}, dim_feedforward={args.ffn}, dropout=0, "
          f"batch_first; batch {args.batch}; ratio = torch time / ours (> 1: ours faster)")
    records, rows = [], []
    for dtype in args.dtypes:
        for L in args.seqlen_list:
            for causal in (False, True):
                r = run_case(args, L, dtype, causal, device)
                records.append(r)
                tt, to = r["fwd+bwd_ms"], r["eval_fwd_ms"]
                rows.append([f"{args.batch}x{L}x{args.d_model}", "yes" if causal else "no", r["dtype"],
                             common.fmt(tt["torch"], 2), common.fmt(tt["ours"], 2),
                             common.fmt(tt["torch"] / tt["ours"], 2),
                             common.fmt(to["torch"], 2), common.fmt(to["ours"], 2),
                             common.fmt(to["torch"] / to["ours"], 2),
                             common.fmt(r["peak_mb"]["torch"]), common.fmt(r["peak_mb"]["ours"]),
                             f"{r['rel_err']:.1e}"])
                print(f"  done N x L x d = {rows[-1][0]} causal={causal} {r['dtype']}", file=sys.stderr, flush=True)
    header = ["N x L x d", "causal", "dtype", "train ms torch", "train ms ours", "train ratio",
              "eval ms torch", "eval ms ours", "eval ratio", "peak MB torch", "peak MB ours", "out rel err"]
    print(common.format_table(header, rows, markdown=args.markdown, align="lll" + "r" * 9))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": {k: v for k, v in vars(args).items() if k != "dtypes"},
                       "records": records}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
