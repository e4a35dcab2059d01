"""``python -m attn_ext bench --decode``: decoding steps, attn_ext against torch SDPA.

A decoding step is one query row per sequence against a cache of S keys and
values, without a gradient: what a call with ``attn_ext.KVCache`` runs. The
steps are timed for cache lengths 128 .. 32768, batch 1 and 8, 8 query heads
over 8 key/value heads and over 2 (grouped-query; SDPA gets enable_gqa=True),
head dim 64. Both implementations are called in alternation, --rounds short
rounds of calls each; the figure is each one's best round per call (a step
takes microseconds, and this takes the machine's interruptions out), and the
ratio is ours / SDPA (below 1: attn_ext is faster). --targets times issue 13's five
target shapes instead, with the target beside each. --written F times a
preallocated cache instead (a static KV cache): of the S slots the first F·S are
written, and both implementations get a (B, 1, 1, S) bool mask of them (attn_ext's
CPU kernels leave out the keys after the last written slot; SDPA computes them all).
--written F1,F2,... gives the batch entries different fractions (cycled over the
batch): requests at different positions of one cache, which the CPU kernels run
each on its own written slots.

Then, unless --no-model, generation with the char-level GPT of
examples/char_gpt.py (a source checkout's; random weights, 4 layers,
d_model 128, 4 heads, context 128, float32): greedy tokens/s of

  ours cached       attn_ext.MultiHeadAttention with one KVCache per layer
                    (the example's generate(): a single-token call per token)
  ours compiled     the same, the model under torch.compile (inductor); its
                    graphs and the first generation's time (compiling) are
                    reported beside (--no-compile skips it)
  ours recompute    the same model without a cache: every token runs the
                    whole window again
  torch recompute   the same weights in torch.nn.MultiheadAttention (it has
                    no cache, so it must recompute), with the causal mask

The prompt and the generated tokens stay within the context, so the three
continue the same way; "same tokens" compares their greedy choices.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import common

# issue 13's targets: (B, Hq, Hkv, S, E) -> the largest ours / SDPA
TARGETS = {
    (1, 8, 8, 4000, 64): 1.0,
    (4, 8, 8, 1024, 64): 1.0,
    (1, 8, 8, 32768, 64): 1.0,
    (1, 4, 4, 100, 32): 1.3,
    (1, 1, 1, 32768, 128): 0.6,
}
LENGTHS = (128, 512, 2048, 8192, 32768)
BATCHES = (1, 8)
HEADS = ((8, 8), (8, 2))
HEAD_DIM = 64
CHAR_GPT = Path(__file__).resolve().parents[2] / "examples" / "char_gpt.py"


def per_call_us(fn: Callable[[], object], calls: int, device: torch.device = torch.device("cpu")) -> float:
    """µs per call of ``calls`` calls; on a GPU, from an idle stream until the last call has run."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def best_per_call(fns: dict[str, Callable[[], object]], rounds: int, calls: int,
                  device: torch.device = torch.device("cpu")) -> dict[str, float]:
    """Each function's best round, in µs per call, the functions called in alternation."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], per_call_us(fn, calls, device))
    return best


def time_step(B: int, Hq: int, Hkv: int, S: int, E: int, dtype: torch.dtype, rounds: int,
              gen: torch.Generator, device: torch.device = torch.device("cpu"),
              written: Sequence[float] | None = None) -> dict:
    import attn_ext

    q = torch.randn(B, Hq, 1, E, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, S, E, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, S, E, generator=gen).to(device, dtype)
    gqa = Hq != Hkv
    mask = None  # with `written`: the slots each batch entry has written so far in a preallocated cache
    if written is not None:
        counts = [max(1, round(written[b % len(written)] * S)) for b in range(B)]
        mask = (torch.arange(S, device=device) < torch.tensor(counts, device=device).view(B, 1, 1, 1))
    fns = {"ours": lambda: attn_ext.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa),
           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=gqa)}
    # short rounds (5 calls at the largest caches, ~200 at the smallest; 200 on a GPU),
    # alternating: both implementations see the same state of the machine
    calls = 200 if device.type == "cuda" else max(5, int(2e5 // (B * Hkv * S * E // 64 + 1000)))
    best = best_per_call(fns, rounds, calls, device)
    ours = fns["ours"]().double()
    err = common.rel_err(ours, fns["sdpa"]().double())
    written_only = None  # with `written`: ours against SDPA on each entry's written keys alone, unmasked
    if mask is not None:
        alone = [F.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], enable_gqa=gqa)
                 for b, n in enumerate(counts)]
        written_only = common.rel_err(ours, torch.cat(alone).double())
    return {"B": B, "Hq": Hq, "Hkv": Hkv, "S": S, "E": E, "dtype": common.dtype_name(dtype),
            "ours_us": best["ours"], "sdpa_us": best["sdpa"], "ratio": best["ours"] / best["sdpa"],
            "rel_err_vs_sdpa": err, "written": None if written is None else list(written),
            "rel_err_vs_written_keys_only": written_only,
            "target": None if written is not None else TARGETS.get((B, Hq, Hkv, S, E))}


# ----------------------------------------------------------------------------
# The char GPT: tokens/s
# ----------------------------------------------------------------------------


class TorchAttention(nn.Module):
    """torch.nn.MultiheadAttention behind the call the example's blocks make
    (``attn(h, h, h, need_weights=..., average_attn_weights=..., is_causal=True,
    cache=...)``): no cache (it has none), the causal rule as the mask it needs."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, query, key, value, need_weights=False, average_attn_weights=True, is_causal=False,
                cache=None):
        if cache is not None:
            raise ValueError("torch.nn.MultiheadAttention has no cache")
        L = query.shape[1]
        mask = torch.ones(L, L, dtype=torch.bool, device=query.device).triu(1) if is_causal else None
        return self.mha(query, key, value, attn_mask=mask, need_weights=False, is_causal=is_causal)


def load_char_gpt():
    """examples/char_gpt.py as a module, or None where this is not a source checkout."""
    if not CHAR_GPT.is_file():
        return None
    spec = importlib.util.spec_from_file_location("attn_ext_char_gpt", CHAR_GPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def greedy_recompute(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, the whole sequence run again for each (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def time_char_gpt(n_tokens: int, rounds: int, seed: int = 0, compiled: bool = True) -> dict:
    gpt = load_char_gpt()
    if gpt is None:
        return {"skipped": f"{CHAR_GPT} not found (the model comparison runs from a source checkout)"}
    torch.manual_seed(seed)
    cfg = gpt.GPTConfig(vocab_size=65, context=128, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, dropout=0.0)
    ours = gpt.CharGPT(cfg).eval()
    theirs = gpt.CharGPT(cfg).eval()
    for block in theirs.blocks:
        block.attn = TorchAttention(nn.MultiheadAttention(cfg.d_model, cfg.n_heads, batch_first=True))
    # attn_ext.MultiHeadAttention's state_dict is torch's (same parameter names and shapes)
    theirs.load_state_dict({k.replace(".attn.", ".attn.mha."): v for k, v in ours.state_dict().items()})
    gen = torch.Generator().manual_seed(seed)
    n_prompt = cfg.context - n_tokens
    if n_prompt < 1:
        raise ValueError(f"--tokens must be below the model's context of {cfg.context}, got {n_tokens}")
    prompt = torch.randint(0, cfg.vocab_size, (n_prompt,), generator=gen).tolist()
    runs = {
        "ours cached": lambda: gpt.generate(ours, prompt, n_tokens, temperature=0),
        "ours recompute": lambda: greedy_recompute(ours, prompt, n_tokens),
        "torch recompute": lambda: greedy_recompute(theirs, prompt, n_tokens),
    }
    compile_info = None
    if compiled:
        backend = common.CountingInductor()
        model = torch.compile(ours, backend=backend)
        torch._dynamo.reset()
        start = time.perf_counter()
        try:
            gpt.generate(model, prompt, n_tokens, temperature=0)
        except Exception as exc:  # inductor needs a C++ compiler at run time
            compile_info = {"skipped": f"torch.compile failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"}
        else:
            compile_info = {"first_generation_s": time.perf_counter() - start, "graphs": backend.graphs}
            runs = {"ours cached": runs.pop("ours cached"),
                    "ours compiled": lambda: gpt.generate(model, prompt, n_tokens, temperature=0), **runs}
    tokens = {name: fn() for name, fn in runs.items()}
    best = {name: float("inf") for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    first = tokens["ours cached"]
    return {"config": {"vocab_size": cfg.vocab_size, "context": cfg.context, "d_model": cfg.d_model,
                       "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "prompt_tokens": n_prompt,
                       "generated_tokens": n_tokens},
            "tokens_per_s": {name: n_tokens / t for name, t in best.items()},
            "same_tokens": {name: toks == first for name, toks in tokens.items()},
            "compiled": compile_info}


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None, prog: str | None) -> argparse.Namespace:
    p = common.OneLineErrorParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", action="store_true", help="(how `python -m attn_ext bench` comes here)")
    p.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16, float16")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the steps run (the char GPT runs on the CPU only)")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="cache lengths S, comma-separated")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes, comma-separated")
    p.add_argument("--targets", action="store_true", help="time issue 13's five target shapes instead of the grid")
    p.add_argument("--written", default=None, metavar="F[,F...]",
                   help="a preallocated cache of S slots, the first F*S written, behind a bool mask of them; "
                        "several fractions: one per batch entry, cycled")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds; each figure is the best (default 7)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N); on the README's Xeon that call alone slows SDPA's own "
                        "steps (docs/performance.md), so the default makes none")
    p.add_argument("--tokens", type=int, default=96, help="tokens the char GPT generates (default 96)")
    p.add_argument("--no-model", action="store_true", help="skip the char GPT's tokens/s")
    p.add_argument("--no-compile", action="store_true", help="skip the char GPT under torch.compile")
    p.add_argument("--json", metavar="PATH", help="write every result to PATH")
    args = p.parse_args(argv)

    def numbers(flag: str, text: str, kind: type, what: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            p.error(f"{flag} must be comma-separated {what}, got {text!r}")

    try:
        args.dtypes = [common.parse_dtype(d) for d in args.dtype.split(",") if d.strip()]
    except ValueError as exc:
        p.error(str(exc))
    args.length_list = numbers("--lengths", args.lengths, int, "integers")
    args.batch_list = numbers("--batches", args.batches, int, "integers")
    what = "fractions in (0, 1]"
    args.written_list = None if args.written is None else numbers("--written", args.written, float, what)
    if any(x < 1 for x in args.length_list + args.batch_list) or args.rounds < 1:
        p.error(f"--lengths, --batches and --rounds must be >= 1, got {args.lengths}, {args.batches}, {args.rounds}")
    if args.written_list is not None and not all(0.0 < f <= 1.0 for f in args.written_list):
        p.error(f"--written must be comma-separated {what}, got {args.written!r}")
    if not 1 <= args.tokens < 128:
        p.error(f"--tokens must be in 1..127 (the char GPT's context is 128), got {args.tokens}")
    return args


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    device = common.bench_device(args.device, args.threads, prog or "attn_ext bench --decode")
    if device is None:
        return 2
    import attn_ext
    from attn_ext import _build

    info = common.machine_info(device)
    info["cpu_isa_active"] = _build.library_info().get("cpu_isa_active", "?")
    print(f"attn_ext decoding benchmark on {device.type.upper()}")
    print(common.describe_machine(info))
    print(f"ours: attn_ext from {Path(attn_ext.__file__).parent}, CPU kernels: {info['cpu_isa_active']}")
    print(f"timing: best of {args.rounds} alternating rounds of calls, µs per step; ratio = ours / SDPA (< 1: ours faster)")
    if args.written_list is not None:
        fractions = ", ".join(f"{f:g}" for f in args.written_list)
        which = "" if len(args.written_list) == 1 else " by the batch entries in turn"
        print(f"a preallocated cache: S slots, the first {fractions} x S written{which}, a bool mask of them for both")
    if args.targets:
        cases = [(B, Hq, Hkv, S, E) for (B, Hq, Hkv, S, E) in TARGETS]
    else:
        cases = [(B, Hq, Hkv, S, HEAD_DIM) for B in args.batch_list for Hq, Hkv in HEADS for S in args.length_list]
    gen = torch.Generator().manual_seed(0)
    steps = []
    for dtype in args.dtypes:
        for B, Hq, Hkv, S, E in cases:
            steps.append(time_step(B, Hq, Hkv, S, E, dtype, args.rounds, gen, device, args.written_list))
    rows = [(r["dtype"], r["B"], f"{r['Hq']}/{r['Hkv']}", r["S"], r["E"], common.fmt(r["ours_us"]),
             common.fmt(r["sdpa_us"]), common.fmt(r["ratio"], 2),
             "" if r["target"] is None else f"<= {r['target']}: {'met' if r['ratio'] <= r['target'] else 'not met'}")
            for r in steps]
    print()
    print(common.format_table(["dtype", "B", "Hq/Hkv", "S", "E", "ours us", "sdpa us", "ours/sdpa", "target"],
                              rows, align="lrrrrrrrl"))
    worst = max((r["rel_err_vs_sdpa"] for r in steps), default=0.0)
    print(f"largest relative difference of an output from SDPA's: {worst:.1e}")

    model = None
    if not args.no_model and device.type == "cpu":
        model = time_char_gpt(args.tokens, max(1, args.rounds // 2), compiled=not args.no_compile)
        print()
        if "skipped" in model:
            print(f"char GPT: skipped: {model['skipped']}")
        else:
            c = model["config"]
            print(f"char GPT (examples/char_gpt.py, random weights: {c['n_layers']} layers, d_model {c['d_model']}, "
                  f"{c['n_heads']} heads, float32), {c['generated_tokens']} greedy tokens after "
                  f"{c['prompt_tokens']}, best of {max(1, args.rounds // 2)}:")
            base = model["tokens_per_s"]["torch recompute"]
            print(common.format_table(
                ["generation", "tokens/s", "x torch recompute", "same tokens"],
                [(name, common.fmt(tps), common.fmt(tps / base, 2), "yes" if model["same_tokens"][name] else "NO")
                 for name, tps in model["tokens_per_s"].items()], align="lrrl"))
            compiled = model["compiled"]
            if compiled and "skipped" in compiled:
                print(f"ours compiled: skipped: {compiled['skipped']}")
            elif compiled:
                print(f"ours compiled: {compiled['graphs']} graphs for the whole generation (not one per token), "
                      f"first generation {compiled['first_generation_s']:.1f} s with compiling")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args) | {"dtypes": None}, "steps": steps, "char_gpt": model},
                      f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
