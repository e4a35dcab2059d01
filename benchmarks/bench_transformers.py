"""A Hugging Face model on attn_ext against transformers' "sdpa" implementation.

The model is a tiny Llama built from its config (random weights, no download):
4 layers, hidden size 256, 8 query heads sharing 4 key/value heads (head dim
32), vocabulary 1024. The same weights run with attn_implementation="attn_ext"
and "sdpa", interleaved in one process (common.time_interleaved: the machine's
drift hits both alike), and the ratio is sdpa's time over ours (> 1: attn_ext
is faster):

  train   one training step's forward and backward (model(ids, labels=ids).loss
          .backward()), batch 4 x 1024 tokens, in float32 and bfloat16
  prefill the forward of a 4 x 1024-token prompt without gradients
  decode  greedy generate() of 64 new tokens after a 4 x 512-token prompt
          (transformers' DynamicCache): new tokens per second, the median of
          --decode-rounds calls each, alternating
  static  the same with a StaticCache (cache_implementation="static")
  compiled  64 greedy decoding steps of torch.compile(model, fullgraph=True) on
          a StaticCache of 2048 slots after the 512-token prompt (eager
          prefill): the mask is built inside the traced graph, a bool row of
          the whole cache, whose unwritten tail the CPU kernels leave out

"same tokens" says, per decoding mode, whether attn_ext's greedy tokens equal
sdpa's. In bfloat16 the random weights' near-ties can part them: with a
2048-slot StaticCache, sdpa's and attn_ext's tokens, eager or compiled, each
left "eager"'s bfloat16 tokens within 3 to 6 steps in some rows.

Usage (CPU by default; --device cuda on a GPU):
    python benchmarks/bench_transformers.py [--threads 2] [--dtype float32,bfloat16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

from attn_ext.benchmark import common


# Timed generate() calls per implementation and decoding mode (the median): a
# whole call varies by tens of percent from one to the next on a shared 2-core
# machine, more than three calls outvote.
DECODE_ROUNDS = 5


def make_model(dtype, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      attention_dropout=0.0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(device=device, dtype=dtype)


def run(dtype, device, min_run_time, name, batch=4, seq=1024, prompt=512, new_tokens=64,
        decode_rounds=DECODE_ROUNDS):
    import copy

    models = {"attn_ext": make_model(dtype, device)}
    models["sdpa"] = copy.deepcopy(models["attn_ext"])  # the same weights
    models["attn_ext"].set_attn_implementation(name)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1024, (batch, seq), generator=gen).to(device)
    prompt_ids = ids[:, :prompt]
    result = {}

    def train_step(model):
        def fn():
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return fn

    def prefill(model):
        def fn():
            with torch.no_grad():
                model(ids)
        return fn

    for m in models.values():
        m.train()
    t = common.time_interleaved({k: train_step(m) for k, m in models.items()}, min_run_time=min_run_time, warmup=1)
    result["train_ms"] = {k: v.median_ms for k, v in t.items()}
    for m in models.values():
        m.eval()
    t = common.time_interleaved({k: prefill(m) for k, m in models.items()}, min_run_time=min_run_time, warmup=1)
    result["prefill_ms"] = {k: v.median_ms for k, v in t.items()}

    # Decoding: decode_rounds timed generate() calls each, alternating; the median. With
    # transformers' default DynamicCache, then with a StaticCache (keys preallocated
    # for prompt + new tokens: the mask function's static path).
    def generate(model, extra):
        def fn():
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                     pad_token_id=0, **extra)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start, out[:, prompt:]
        return fn

    same = {}
    for cache, key in (("dynamic", "decode_tokens_per_s"), ("static", "decode_static_tokens_per_s")):
        extra = dict(cache_implementation="static") if cache == "static" else {}
        result[key], same[cache] = tokens_per_s({k: generate(m, extra) for k, m in models.items()}, batch * new_tokens,
                                                decode_rounds)
    result["compiled_static_tokens_per_s"], same["compiled"] = compiled_static_steps(models, prompt_ids, new_tokens,
                                                                                     rounds=decode_rounds)
    result["same_tokens"] = same  # greedy tokens of attn_ext and sdpa, per decoding mode
    return result


def tokens_per_s(runs, tokens_made, rounds=DECODE_ROUNDS):
    """``rounds`` rounds of each run (``fn() -> (seconds, new tokens)``), alternating: the
    median tokens/s by name, and whether attn_ext's and sdpa's last tokens agree."""
    times, tokens = {k: [] for k in runs}, {}
    for _ in range(rounds):
        for k, fn in runs.items():
            elapsed, tokens[k] = fn()
            times[k].append(elapsed)
    rate = {k: tokens_made / sorted(v)[len(v) // 2] for k, v in times.items()}
    return rate, bool(torch.equal(tokens["attn_ext"], tokens["sdpa"]))


def compiled_static_steps(models, prompt_ids, new_tokens, slots=2048, rounds=DECODE_ROUNDS):
    """Tokens/s of ``new_tokens`` greedy steps of each model compiled (fullgraph) on a
    StaticCache of ``slots`` after an eager prefill of ``prompt_ids`` (tokens_per_s,
    after a compiling round)."""
    from transformers import StaticCache

    batch, prompt = prompt_ids.shape
    compiled = {k: torch.compile(m, fullgraph=True) for k, m in models.items()}

    def steps(k, n):
        cache = StaticCache(config=models[k].config, max_cache_len=slots)
        tokens = []
        with torch.no_grad():
            logits = models[k](prompt_ids, past_key_values=cache).logits[:, -1]
            start = time.perf_counter()
            for i in range(n):
                tokens.append(logits.argmax(-1, keepdim=True))
                pos = torch.tensor([prompt + i], device=prompt_ids.device)
                logits = compiled[k](tokens[-1], past_key_values=cache, cache_position=pos,
                                     position_ids=pos.expand(batch, 1)).logits[:, -1]
            if prompt_ids.device.type == "cuda":
                torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cat(tokens, 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values=, which newer versions call cache=
        for k in models:
            steps(k, 3)  # compiles
        return tokens_per_s({k: (lambda k=k: steps(k, new_tokens)) for k in models}, batch * new_tokens, rounds)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--min-run-time", type=float, default=6.0, help="seconds per timed pass, over 3 rounds")
    ap.add_argument("--decode-rounds", type=int, default=DECODE_ROUNDS,
                    help="timed generate() calls per implementation and decoding mode, alternating (the median)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.decode_rounds < 1:
        ap.error(f"--decode-rounds must be at least 1, got {args.decode_rounds}")
    try:
        import transformers
    except ModuleNotFoundError:
        print("bench_transformers: needs transformers (pip install transformers)", file=sys.stderr)
        return 2
    import attn_ext.integrations.transformers as hf

    name = hf.register()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    machine = common.machine_info(device)
    print(f"tiny Llama (4 x d256, GQA 8/4) on {device}, transformers {transformers.__version__}")
    print(common.describe_machine(machine))
    header = ["dtype", "train ms attn_ext", "train ms sdpa", "train x", "prefill ms attn_ext", "prefill ms sdpa",
              "prefill x", "decode tok/s attn_ext", "decode tok/s sdpa", "decode x", "static tok/s attn_ext",
              "static tok/s sdpa", "static x", "compiled tok/s attn_ext", "compiled tok/s sdpa", "compiled x",
              "same tokens (decode/static/compiled)"]
    rows, records = [], []
    for dname in args.dtype.split(","):
        dtype = common.parse_dtype(dname)
        r = run(dtype, device, args.min_run_time, name, decode_rounds=args.decode_rounds)
        records.append({"dtype": dname, **r})
        tr, pf, dc, st = r["train_ms"], r["prefill_ms"], r["decode_tokens_per_s"], r["decode_static_tokens_per_s"]
        cs = r["compiled_static_tokens_per_s"]
        rows.append([dname, common.fmt(tr["attn_ext"]), common.fmt(tr["sdpa"]), common.fmt(tr["sdpa"] / tr["attn_ext"], 2),
                     common.fmt(pf["attn_ext"]), common.fmt(pf["sdpa"]), common.fmt(pf["sdpa"] / pf["attn_ext"], 2),
                     common.fmt(dc["attn_ext"]), common.fmt(dc["sdpa"]), common.fmt(dc["attn_ext"] / dc["sdpa"], 2),
                     common.fmt(st["attn_ext"]), common.fmt(st["sdpa"]), common.fmt(st["attn_ext"] / st["sdpa"], 2),
                     common.fmt(cs["attn_ext"]), common.fmt(cs["sdpa"]), common.fmt(cs["attn_ext"] / cs["sdpa"], 2),
                     "/".join("yes" if r["same_tokens"][m] else "no" for m in ("dynamic", "static", "compiled"))])
        print(common.format_table(header, rows[-1:], markdown=True), flush=True)
    print(common.format_table(header, rows, markdown=True))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "machine": machine, "transformers": transformers.__version__,
                       "decode_rounds": args.decode_rounds, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
