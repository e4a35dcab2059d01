"""``python -m attn_ext bench --variant NAME``: each attention variant against
what a user would run without it.

  window   window=(W, 0) with is_causal (query i sees keys i - W .. i; --window W,
           default 256; a shape without ':causal' uses window=(W, W)), on
           1x8x8192x64. Against: torch SDPA and attn_ext with the equivalent dense
           bool mask, built once outside the timed region ("sdpa+mask",
           "ours+mask"); attn_ext without the window ("ours causal"); and
           flex_attention compiled with torch.compile and a sliding-window
           block mask ("flex"; PyTorch has no flex backward on the CPU, so that
           row shows the error).
  softcap  softcap=30 (--softcap)
  alibi    alibi_slopes 2^(-8(h+1)/H), float32; also against torch SDPA with
           the ALiBi bias as a dense float mask ("sdpa+bias")
  sinks    sinks = randn(H) float32, requiring grad (their gradient is part of
           fwd+bwd)
           The three above: against attn_ext without the variant ("ours plain"),
           same shapes (default 4x8x1024x64 causal and not).
  varlen   a packed batch: sequence lengths drawn uniformly from 64..2048
           (--lengths, seed 0), the last cut so that they total T tokens
           (--tokens, default 16384), 8 heads, E 64, causal (a shape 1xHxTxE
           gives H, T and E). attn_ext.varlen_attention against one dense call
           over all T tokens ("dense same tokens": another function, with
           ~T^2/2 pairs; compared by GFLOP/s), the sequences padded to the
           longest and batched with a key-padding mask through attn_ext
           ("padded+mask", with is_causal) and through torch SDPA ("sdpa
           padded", the mask holding the causal rule too).

Reporting as in sdpa.py: the median of torch.utils.benchmark in --rounds
interleaved rounds; "fwd" under torch.no_grad(), "fwd+bwd" a backward with a
random output grad, gradients to q, k, v (and sinks); peak memory of one call
in a worker process (see sdpa.py and common.py). FLOPs = 4 * E * (visible
(query, key) pairs, counted exactly, summed over batch and heads) for fwd,
3.5x that for fwd+bwd; a padded batch counts only the pairs of real tokens, so
its GFLOP/s is useful work per second. "time/ours" = the row's time / ours
(> 1: ours faster).

Before timing each case is checked once: every implementation of the case's
function (not "ours causal", "ours plain", "dense same tokens") against a
reference -- "sdpa+mask", "sdpa+bias", "sdpa padded", or attn_ext.reference's
float64 math for softcap and sinks -- by the relative error of the output and
of every input gradient (tolerance common.CHECK_TOL). One that is off is
flagged WRONG in the table and in a warning, and the exit status is 1.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from . import common

VARIANTS = ("window", "softcap", "alibi", "sinks", "varlen")
DEFAULT_SHAPES = {
    "window": "1x8x8192x64:causal",
    "softcap": "4x8x1024x64:causal,4x8x1024x64",
    "alibi": "4x8x1024x64:causal,4x8x1024x64",
    "sinks": "4x8x1024x64:causal,4x8x1024x64",
    "varlen": "1x8x16384x64:causal",
}
QUICK_L_DIV = 4
PASSES = ("fwd", "fwd+bwd")


@dataclasses.dataclass
class Impl:
    """One implementation: `fn(*inputs)` is its output; every input gets a gradient."""

    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    grad: torch.Tensor  # the output's gradient
    pairs: int  # visible (query, key) pairs of the function it computes, all batches and heads
    checked: bool = True  # computes the case's function, so it is compared with the reference
    is_ours: bool = True  # attn_ext's: raising in the check fails the run (a competitor's error is only shown)
    to_ref: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # output / grads in the reference's layout


@dataclasses.dataclass
class Target:
    """The issue's goal for one ratio: `value >= at_least`."""

    text: str
    pass_: str
    other: str
    at_least: float
    by: str = "time"  # "time": other's time / ours; "gflops": our GFLOP/s / other's


@dataclasses.dataclass
class Case:
    label: str
    impls: dict[str, Impl]  # "ours" first
    reference: str  # a key of impls, or "reference (float64)" with its Impl in `extra_reference`
    targets: list[Target]
    extra_reference: Impl | None = None
    info: dict = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------
# The cases
# ----------------------------------------------------------------------------


def _ours(*args, **kwargs):
    import attn_ext

    return attn_ext.scaled_dot_product_attention(*args, **kwargs)


_FLEX = None


def _flex(allowed: Callable, L: int, S: int, device: torch.device) -> Callable:
    """flex_attention, compiled, with the block mask of `allowed(i, j)`; a function that
    raises what went wrong if flex attention cannot be set up here."""
    global _FLEX
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(lambda b, h, i, j: allowed(i, j), None, None, L, S, device=device)
        if _FLEX is None:
            _FLEX = torch.compile(flex_attention)
    except Exception as exc:  # noqa: BLE001 - reported in the flex row

        def unavailable(*_, exc=exc):
            raise exc
        return unavailable

    def flex(q, k, v):
        # PyTorch has no flex backward on the CPU. Refused before torch.compile sees a
        # grad-requiring call: a failed compile leaves flex_attention running eagerly
        # (dense, ~100x slower) for the forward timings too.
        if device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError("FlexAttention does not support backward on CPU (PyTorch "
                                      f"{torch.__version__})")
        return _FLEX(q, k, v, block_mask=block_mask)
    return flex


def window_case(shape: common.Shape, args, randn, device) -> Case:
    B, H, L, S, E, causal, W = shape.B, shape.H, shape.L, shape.s, shape.E, shape.causal, args.window
    window = (W, 0) if causal else (W, W)

    def allowed(i, j):  # window's rule, for the dense mask and flex's mask_mod
        return (j >= i - window[0]) & (j <= i + window[1])
    mask = allowed(torch.arange(L, device=device)[:, None], torch.arange(S, device=device)[None, :])
    qkv, grad = (randn(B, H, L, E), randn(B, H, S, E), randn(B, H, S, E)), randn(B, H, L, E)
    pairs = B * H * common.visible_pairs(L, S, causal, window)
    full = "ours causal" if causal else "ours full"
    impls = {
        "ours": Impl(lambda q, k, v: _ours(q, k, v, is_causal=causal, window=window), qkv, grad, pairs),
        "ours+mask": Impl(lambda q, k, v: _ours(q, k, v, mask), qkv, grad, pairs),
        "sdpa+mask": Impl(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, mask), qkv, grad, pairs,
                          is_ours=False),
        full: Impl(lambda q, k, v: _ours(q, k, v, is_causal=causal), qkv, grad,
                   B * H * common.visible_pairs(L, S, causal), checked=False),
        "flex": Impl(_flex(allowed, L, S, device), qkv, grad, pairs, is_ours=False),
    }
    targets = [Target("ours fwd faster than flex fwd", "fwd", "flex", 1.0),
               Target(f"ours fwd+bwd >= 10x faster than {full}", "fwd+bwd", full, 10.0)]
    return Case(f"{shape.label()} W={W}" + (" causal" if causal else ""), impls, "sdpa+mask", targets)


def alibi_slopes(H: int) -> torch.Tensor:
    """ALiBi's slopes 2^(-8(h+1)/H), float32 (H,)."""
    return torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32) / H)


def score_variant_case(shape: common.Shape, args, randn, device) -> Case:
    """softcap, alibi or sinks (args.variant) against the same call without it."""
    from attn_ext.reference import attention_reference

    B, H, L, S, E, causal = shape.B, shape.H, shape.L, shape.s, shape.E, shape.causal
    qkv, grad = (randn(B, H, L, E), randn(B, H, S, E), randn(B, H, S, E)), randn(B, H, L, E)
    pairs = B * H * common.visible_pairs(L, S, causal)
    kwargs = {"is_causal": causal}
    inputs = qkv
    if args.variant == "softcap":
        kwargs["softcap"] = args.softcap
    elif args.variant == "alibi":
        kwargs["alibi_slopes"] = alibi_slopes(H).to(device)
    else:  # sinks: a learnable float32 logit per head, an input (it gets a gradient)
        inputs = qkv + (randn(H).float(),)

    def with_variant(fn):
        return lambda q, k, v, *sinks: fn(q, k, v, **kwargs, **({"sinks": sinks[0]} if sinks else {}))
    impls = {
        "ours": Impl(with_variant(_ours), inputs, grad, pairs),
        "ours plain": Impl(lambda q, k, v: _ours(q, k, v, is_causal=causal), qkv, grad, pairs, checked=False),
    }
    reference, extra = "reference (float64)", None
    if args.variant == "alibi":  # the bias as torch SDPA takes it: a dense float mask, -inf above the diagonal
        i, j = torch.arange(L, device=device)[:, None], torch.arange(S, device=device)[None, :]
        bias = -kwargs["alibi_slopes"][:, None, None] * (i - j).abs()
        if causal:
            bias = bias.masked_fill(j > i, float("-inf"))
        bias = bias.to(qkv[0].dtype)
        impls["sdpa+bias"] = Impl(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, bias), qkv, grad,
                                  pairs, is_ours=False)
        reference = "sdpa+bias"
    else:
        extra = Impl(with_variant(lambda *a, **kw: attention_reference(*a, **kw)[0]),
                     inputs, grad.double(), pairs)
    plain = [Target(f"ours {args.variant} within 10% of ours plain ({p})", p, "ours plain", 0.9)
             for p in PASSES]
    label = shape.label() + (" causal" if causal else "")
    return Case(label, impls, reference, plain, extra_reference=extra)


def packed_lengths(total: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Lengths drawn uniformly from lo..hi (seeded) until they reach `total`; the last is cut to fit."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - total
    return lengths


def varlen_case(shape: common.Shape, args, randn, device) -> Case:
    T, H, E, causal = shape.L, shape.H, shape.E, shape.causal
    lengths = packed_lengths(T, *args.length_range)
    nb, longest = len(lengths), max(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    q, k, v, grad = (randn(T, H, E) for _ in range(4))
    pairs = H * sum(common.visible_pairs(n, n, causal) for n in lengths)

    valid = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(device)  # (nb, longest)

    def pad(t):  # (T, H, E) -> (nb, H, longest, E), zeros after each sequence
        out = t.new_zeros(nb, longest, H, E)
        out[valid] = t
        return out.transpose(1, 2).contiguous()

    def unpad(t):  # the inverse, for the check
        return t.transpose(1, 2)[valid]
    padded, padded_grad = tuple(pad(t) for t in (q, k, v)), pad(grad)
    key_mask = valid[:, None, None, :]  # (nb, 1, 1, longest), True = a real token
    sdpa_mask = key_mask  # torch SDPA takes a mask or is_causal: the causal rule goes into the mask
    if causal:
        sdpa_mask = key_mask & torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    dense = tuple(t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v, grad))  # (1, H, T, E)

    def ours_varlen(q, k, v):
        import attn_ext

        return attn_ext.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=causal)
    impls = {
        "ours": Impl(ours_varlen, (q, k, v), grad, pairs),
        "dense same tokens": Impl(lambda q, k, v: _ours(q, k, v, is_causal=causal), dense[:3], dense[3],
                                  H * common.visible_pairs(T, T, causal), checked=False),
        "padded+mask": Impl(lambda q, k, v: _ours(q, k, v, key_mask, is_causal=causal),
                            padded, padded_grad, pairs, to_ref=unpad),
        "sdpa padded": Impl(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, sdpa_mask),
                            padded, padded_grad, pairs, to_ref=unpad, is_ours=False),
    }
    targets = [Target(f"ours GFLOP/s >= 0.9x dense same tokens ({p})", p, "dense same tokens", 0.9, by="gflops")
               for p in PASSES]
    targets += [Target(f"ours >= 2x faster than padded+mask ({p})", p, "padded+mask", 2.0) for p in PASSES]
    label = f"{T} tok/{nb} seqs H={H} E={E}" + (" causal" if causal else "")
    return Case(label, impls, "sdpa padded", targets,
                info={"tokens": T, "seq_lengths": lengths, "padded_to": longest})


BUILDERS = {"window": window_case, "softcap": score_variant_case, "alibi": score_variant_case,
            "sinks": score_variant_case, "varlen": varlen_case}


def build_case(shape: common.Shape, dtype: torch.dtype, device: torch.device, args) -> Case:
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return BUILDERS[args.variant](shape, args, randn, device)


def summary(case: Case) -> Case:
    """The case without its tensors (what the table needs), so that only one case's
    inputs are alive at a time."""
    impls = {name: dataclasses.replace(impl, fn=None, inputs=(), grad=None) for name, impl in case.impls.items()}
    return dataclasses.replace(case, impls=impls, extra_reference=None)


def passes_of(case: Case) -> dict[str, dict[str, Callable[[], None]]]:
    by_impl = {name: common.timed_passes(impl.fn, impl.inputs, impl.grad) for name, impl in case.impls.items()}
    return {p: {name: fns[p] for name, fns in by_impl.items()} for p in PASSES}


# ----------------------------------------------------------------------------
# Check, time, measure
# ----------------------------------------------------------------------------


def _outputs(impl: Impl) -> tuple[torch.Tensor, ...] | str:
    """(out, *grads) in the reference's layout, or the error text. A competitor whose
    backward is not supported (flex on the CPU) gives its output alone."""
    try:
        return tuple(impl.to_ref(t) for t in common.forward_backward(impl.fn, impl.inputs, impl.grad))
    except Exception as exc:  # noqa: BLE001
        if impl.is_ours:
            return common.error_text(exc)
    try:
        with torch.no_grad():
            return (impl.to_ref(impl.fn(*impl.inputs)),)
    except Exception as exc:  # noqa: BLE001
        return common.error_text(exc)


def check_case(case: Case, dtype: torch.dtype) -> dict:
    """Every checked implementation against the case's reference, once."""
    tol = common.CHECK_TOL.get(dtype, 1e-2)
    ref = _outputs(case.extra_reference or case.impls[case.reference])
    check = {"case": case.label, "dtype": common.dtype_name(dtype), "tol": tol,
             "reference": case.reference, "impls": {}, **case.info}
    if isinstance(ref, str):
        check.update(ok=False, error=f"the reference {case.reference} failed: {ref}")
        return check
    names = ("out", "dq", "dk", "dv", "dsinks")
    for name, impl in case.impls.items():
        if not impl.checked or name == case.reference:
            continue
        got = _outputs(impl)
        if isinstance(got, str):
            check["impls"][name] = {"error": got, "ok": not impl.is_ours}
            continue
        errs = {key: common.rel_err(a, b) for key, a, b in zip(names, got, ref)}
        check["impls"][name] = {"rel_err": errs, "max_rel_err": max(errs.values()),
                                "ok": bool(max(errs.values()) <= tol)}  # NaN fails too
    check["ok"] = all(c["ok"] for c in check["impls"].values())
    return check


def time_case(case: Case, args) -> dict[str, dict[str, common.Timing | str]]:
    """{impl: {pass: Timing, or the error text}}, the implementations interleaved."""
    records: dict[str, dict] = {name: {} for name in case.impls}
    for pass_, fns in passes_of(case).items():
        timed = common.time_interleaved(fns, min_run_time=args.min_run_time, rounds=args.rounds,
                                        warmup=args.warmup)
        for name, res in timed.items():
            records[name][pass_] = common.error_text(res) if isinstance(res, BaseException) else res
    return records


def measure_all_memory(cases, device, args) -> list[dict]:
    """Peak memory of one call per (case, impl, pass), as common.peaks_as_json."""
    if device.type == "cpu":
        common.prepare_cpu_peak_memory()
    out = []
    for shape, dtype in cases:
        print(f"memory {shape.spec()} {common.dtype_name(dtype)}", file=sys.stderr, flush=True)
        case = build_case(shape, dtype, device, args)
        records = {name: {"error": None} for name in case.impls}
        common.measure_peaks(passes_of(case), device, records)
        del case
        common.release_memory(device)
        out.append(common.peaks_as_json(records))
    return out


def to_rows(variant: str, case: Case, shape: common.Shape, dtype: torch.dtype, records: dict,
            peaks: dict, check: dict) -> list[dict]:
    """One result dict per (pass, impl). `case` may be a `summary`."""
    rows = []
    for pass_ in PASSES:
        ours = records["ours"][pass_]
        for name, impl in case.impls.items():
            res, peak = records[name][pass_], peaks.get(name, {}).get(f"peak_{pass_}")
            t = res.median_s if isinstance(res, common.Timing) else None
            flops = 4.0 * shape.E * impl.pairs * (3.5 if pass_ == "fwd+bwd" else 1.0)
            got = check["impls"].get(name)
            rows.append({
                "variant": variant, "case": case.label, "shape": shape.spec(),
                "dtype": common.dtype_name(dtype), "pass": pass_, "impl": name,
                "ms": t * 1e3 if t is not None else None,
                "iqr_ms": res.iqr_s * 1e3 if t is not None else None,
                "runs": res.runs if t is not None else None,
                "pairs": impl.pairs, "flops": flops,
                "gflops": flops / t / 1e9 if t else None,
                "time_vs_ours": t / ours.median_s if t and isinstance(ours, common.Timing) else None,
                "peak_bytes": peak["peak_bytes"] if peak else None,
                "tensor_peak_bytes": peak["tensor_peak_bytes"] if peak else None,
                "rss_peak_bytes": peak["rss_peak_bytes"] if peak else None,
                "peak_method": peak["method"] if peak else None,
                "check": ("reference" if name == case.reference else None if got is None
                          else "error" if "error" in got else "ok" if got["ok"] else "WRONG"),
                "max_rel_err": got.get("max_rel_err") if got else None,
                "checked_tensors": list(got["rel_err"]) if got and "rel_err" in got else None,
                "error": None if t is not None else res,
            })
    return rows


def evaluate_targets(case: Case, rows: list[dict]) -> list[dict]:
    index = {(r["impl"], r["pass"]): r for r in rows}
    out = []
    for t in case.targets:
        ours, other = index[("ours", t.pass_)], index[(t.other, t.pass_)]
        value = None
        if t.by == "time" and ours["ms"] and other["ms"]:
            value = other["ms"] / ours["ms"]
        elif t.by == "gflops" and ours["gflops"] and other["gflops"]:
            value = ours["gflops"] / other["gflops"]
        out.append({"case": case.label, "dtype": rows[0]["dtype"], "target": t.text, "pass": t.pass_,
                    "at_least": t.at_least, "value": value,
                    "met": None if value is None else bool(value >= t.at_least),
                    "why_not_measured": None if value is not None else (other["error"] or ours["error"])})
    return out


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------


def render_table(rows: list[dict], markdown: bool) -> str:
    header = ["case", "dtype", "pass", "impl", "ms", "GFLOP/s", "time/ours", "peak MB", "check", "note"]

    def check_cell(r):
        if r["check"] in ("ok", "WRONG"):  # "(out)": the backward raised, the output alone was compared
            return f"{r['check']} {r['max_rel_err']:.0e}" + (" (out)" if r["checked_tensors"] == ["out"] else "")
        return {"reference": "ref", "error": "error"}.get(r["check"], "-")
    body = [[r["case"], r["dtype"], r["pass"], r["impl"],
             common.fmt(r["ms"], 2) if r["ms"] is not None else "ERR", common.fmt(r["gflops"], 1),
             f"{r['time_vs_ours']:.2f}x" if r["time_vs_ours"] else "-",
             common.fmt(r["peak_bytes"] / 2**20 if r["peak_bytes"] is not None else None, 1),
             check_cell(r), (r["error"] or "")[:72]] for r in rows]
    return common.format_table(header, body, markdown=markdown, align="llll" + "r" * 4 + "ll")


def render_targets(targets: list[dict]) -> list[str]:
    lines = []
    for t in targets:
        if t["value"] is None:
            verdict = f"not measured ({(t['why_not_measured'] or '?')[:80]})"
        else:
            verdict = f"{t['value']:.2f}x (>= {t['at_least']:.2f}x): {'met' if t['met'] else 'NOT met'}"
        lines.append(f"target  {t['case']} {t['dtype']}: {t['target']}: {verdict}")
    return lines


def print_warnings(checks: list[dict]) -> None:
    for c in checks:
        if "error" in c:
            print(f"WARNING: {c['case']} {c['dtype']}: {c['error']}")
        for name, got in c["impls"].items():
            if "error" in got:
                print(f"{'WARNING' if not got['ok'] else 'note'}: {name} raised for {c['case']} "
                      f"{c['dtype']} in the check: {got['error']}")
            elif not got["ok"]:
                errs = ", ".join(f"{k}={v:.2e}" for k, v in got["rel_err"].items())
                print(f"WARNING: {name} is WRONG for {c['case']} {c['dtype']}: relative error vs "
                      f"{c['reference']} {errs} (tolerance {c['tol']:.0e}). Its timings are of a broken kernel.")


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def parse_args(argv=None, prog=None):
    p = common.bench_parser(
        prog, "Time one attention variant of attn_ext against the ways to get it without "
              "the variant (see the module docstring of attn_ext/benchmark/variants.py).",
        "Shapes: BxHxLxE[xS<keys>][:causal], comma separated. Defaults: "
        + "; ".join(f"{v} {s}" for v, s in DEFAULT_SHAPES.items())
        + ". varlen: a shape 1xHxTxE is T tokens packed (--tokens sets T).", QUICK_L_DIV)
    p.add_argument("--variant", required=True, choices=VARIANTS, help="which variant to benchmark")
    p.add_argument("--window", type=int, default=256,
                   help="window: query i sees keys i-W..i (window=(W, 0), causal; default 256)")
    p.add_argument("--softcap", type=float, default=30.0, help="softcap: the cap (default 30.0)")
    p.add_argument("--tokens", type=int, default=None,
                   help="varlen: total tokens T of the packed batch (default 16384, 4096 with --quick)")
    p.add_argument("--lengths", default="64-2048",
                   help="varlen: sequence lengths drawn uniformly from MIN-MAX, seed 0 (default 64-2048)")
    args = p.parse_args(argv)
    args = common.finish_bench_args(p, args, argv, DEFAULT_SHAPES[args.variant], QUICK_L_DIV)
    lo, _, hi = args.lengths.partition("-")
    if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
        p.error(f"--lengths must be MIN-MAX with 1 <= MIN <= MAX, got {args.lengths!r}")
    args.length_range = (int(lo), int(hi))
    if args.window < 0 or args.softcap <= 0 or (args.tokens is not None and args.tokens < 1):
        p.error(f"need --window >= 0, --softcap > 0, --tokens >= 1; got {args.window}, {args.softcap}, {args.tokens}")
    if args.variant == "varlen":
        bad = [s.spec() for s in args.shape_list if s.B != 1 or s.S is not None]
        if bad:
            p.error(f"varlen shapes are 1xHxTxE (T tokens packed), got {', '.join(bad)}")
        if args.tokens:
            args.shape_list = [dataclasses.replace(s, L=args.tokens) for s in args.shape_list]
    return args


def main(argv=None, prog=None) -> int:
    args = parse_args(argv, prog)
    device = common.bench_device(args.device, args.threads, prog or "attn_ext bench")
    if device is None:
        return 2
    cases = [(s, d) for s in args.shape_list for d in args.dtypes]
    if args.memory_worker:  # child of common.run_memory_worker
        peaks = measure_all_memory(cases, device, args)
        with open(args.memory_worker, "w") as f:
            json.dump(peaks, f)
        return 0
    from .sdpa import load_ours

    _, ours_desc = load_ours("attn_ext", quiet=True)
    info = common.machine_info(device)
    print(f"attn_ext variant benchmark: {args.variant}, on {device.type.upper()}")
    print(common.describe_machine(info))
    print(f"ours: {ours_desc}")
    print(f"{common.timing_note(args)}; time/ours = the row's time / ours (> 1: ours faster)")
    print("GFLOP/s: 4 * E * (visible (query, key) pairs, counted exactly, all batches and heads) per "
          "forward, 3.5x per fwd+bwd; padded rows count the real tokens' pairs only")
    print(common.peak_note(device) + (" [--quick]" if args.quick else ""))
    print(flush=True)

    t_start = time.perf_counter()
    bar = common.progress_bar(len(cases), f"bench {args.variant}")
    timed = []
    for shape, dtype in cases:
        bar.set_postfix_str(f"{shape.spec()} {common.dtype_name(dtype)}")
        case = build_case(shape, dtype, device, args)
        check = check_case(case, dtype)
        timed.append((summary(case), shape, dtype, time_case(case, args), check))
        del case
        gc.collect()
        bar.update(1)
    bar.close()

    # Memory after all timing, in a worker process on the CPU (see sdpa.py).
    peaks = common.run_memory_worker("attn_ext.benchmark.variants", args.argv) if device.type == "cpu" else None
    if peaks is None:
        peaks = measure_all_memory(cases, device, args)
    rows, checks, targets = [], [], []
    for (case, shape, dtype, records, check), case_peaks in zip(timed, peaks):
        case_rows = to_rows(args.variant, case, shape, dtype, records, case_peaks, check)
        rows += case_rows
        checks.append(check)
        targets += evaluate_targets(case, case_rows)

    print(render_table(rows, markdown=False))
    print()
    print("\n".join(render_targets(targets)))
    if args.markdown:
        print(f"\nMachine: {common.describe_machine(info)}. Median of torch.utils.benchmark; "
              f"time/ours > 1 means ours is faster.\n")
        print(render_table(rows, markdown=True))
    print()
    print_warnings(checks)
    print(f"({time.perf_counter() - t_start:.1f} s)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({
                "machine": info, "device": str(device), "ours": ours_desc, "variant": args.variant,
                "args": {k: v for k, v in vars(args).items() if k not in ("dtypes", "shape_list")},
                "shapes": [s.spec() for s in args.shape_list],
                "flop_convention": "fwd 4*E*(visible (query, key) pairs, exact, summed over batch and heads); "
                                   "fwd+bwd 3.5x; padded batches count real tokens' pairs only",
                "checks": checks, "targets": targets, "results": rows,
            }, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
