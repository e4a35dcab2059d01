"""Fine-tune a small Hugging Face Llama on the Sonnets with attn_implementation="attn_ext".

What it demonstrates:

* ``attn_ext.integrations.transformers.register()``: after it, any transformers
  model takes ``attn_implementation="attn_ext"`` and every attention layer runs
  on attn_ext's kernels, forward and backward (here: causal, grouped-query
  attention with 4 query heads sharing 2 key/value heads, no ``repeat_kv``);
* transformers' own training loop pieces (``labels=`` gives the loss) and
  ``generate()`` with its DynamicCache, both on attn_ext;
* that the model stays the same model: at the end the held-out loss is
  computed again with ``attn_implementation="sdpa"`` and must agree.

The model is built from a ``LlamaConfig`` (random initial weights, nothing
downloaded): characters as tokens, 4 layers, hidden size 128. The text is
Shakespeare's Sonnets (examples/data/sonnets.txt, public domain): the first 90%
for training, the last 10% held out.

Run from the repository root (300 steps in 45 s on 2 cores of an Intel Xeon;
needs transformers)::

    .venv/bin/python examples/hf_llama_sonnets.py
    .venv/bin/python examples/hf_llama_sonnets.py --steps 600 --prompt "Shall I"
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES.parent))  # the attn_ext built in place, when it is not installed

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ModuleNotFoundError:
    sys.exit("hf_llama_sonnets.py needs transformers: python -m pip install transformers")

import attn_ext.integrations.transformers as attn_ext_hf  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=EXAMPLES / "data" / "sonnets.txt")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", default="When in disgrace")
    ap.add_argument("--generate", type=int, default=300, help="characters to generate at the end")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def windows(data, batch, context, generator):
    """``batch`` random windows of ``context + 1`` characters: the inputs and, shifted by one, the labels."""
    ix = torch.randint(len(data) - context - 1, (batch,), generator=generator).tolist()
    return torch.stack([data[i : i + context + 1] for i in ix])


@torch.no_grad()
def held_out_loss(model, data, context):
    """The mean next-character loss over the held-out text, in non-overlapping windows."""
    n = (len(data) - 1) // context
    x = data[: n * context].view(n, context)
    was_training = model.training
    model.eval()
    logits = model(x).logits
    y = data[1 : n * context + 1].view(n, context)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    model.train(was_training)
    return loss.item()


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    name = attn_ext_hf.register()  # "attn_ext"

    text = args.text.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]

    cfg = LlamaConfig(vocab_size=len(chars), hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(args.context, 1024), bos_token_id=None, eos_token_id=None,
                      pad_token_id=None, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(name)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama from config: {args.layers} layers, hidden {args.hidden}, 4 heads / 2 KV heads, "
          f"{n_params / 1e6:.2f}M parameters, {len(chars)} characters; attention: {model.config._attn_implementation}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    start, running = time.perf_counter(), []
    model.train()
    for step in range(1, args.steps + 1):
        batch = windows(train, args.batch, args.context, gen)
        loss = model(batch[:, :-1], labels=batch[:, :-1]).loss  # transformers shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            elapsed = time.perf_counter() - start
            print(f"step {step:4d}  train loss {sum(running) / len(running):.3f}  "
                  f"{step * args.batch * args.context / elapsed:,.0f} tokens/s  {elapsed:.0f} s", flush=True)
            running = []

    ours = held_out_loss(model, held_out, args.context)
    model.set_attn_implementation("sdpa")
    theirs = held_out_loss(model, held_out, args.context)
    model.set_attn_implementation(name)
    print(f"held-out loss: {ours:.4f} with attn_ext, {theirs:.4f} with sdpa (the same model: they must agree)")

    sample = ""
    if args.generate > 0:
        unknown = sorted(set(args.prompt) - set(index))
        if unknown:
            sys.exit(f"--prompt has characters the model never saw: {''.join(unknown)!r}")
        prompt = torch.tensor([[index[c] for c in args.prompt]])
        model.eval()
        torch.manual_seed(args.seed)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.generate,
                             do_sample=True, top_k=20, temperature=0.8, pad_token_id=0)
        sample = "".join(chars[i] for i in out[0].tolist())
        print("---")
        print(sample)
    return ours, theirs, sample


if __name__ == "__main__":
    main()
