"""Attention heatmaps of a char_gpt model: one panel per layer and head.

Runs a snippet of text through a model trained by examples/char_gpt.py with
``need_weights=True, average_attn_weights=False`` in every
``attn_ext.MultiHeadAttention`` (the per-head weights come from attn_ext's
attention-probabilities kernel) and draws a grid of heatmaps, layers down and
heads across: row = query position, column = key position, with the snippet's
characters as tick labels (space shown as an open box, newline as a return
arrow). The upper triangle is empty: the attention is causal. The colour scale
is a square root, so that weak but structured attention stays visible. It also
prints, for each head, how far back it looks on average and how much weight it
puts on the previous character.

Run from the repository root, after examples/char_gpt.py (needs matplotlib)::

    .venv/bin/python examples/attention_heatmaps.py
    .venv/bin/python examples/attention_heatmaps.py --text "When in disgrace with fortune" --out heads.png
"""

import argparse
import math
import sys
from pathlib import Path

import torch

try:
    import matplotlib
except ModuleNotFoundError:
    sys.exit("attention_heatmaps.py needs matplotlib: python -m pip install matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import PowerNorm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from char_gpt import DEFAULT_OUT as DEFAULT_CHECKPOINT  # noqa: E402
from char_gpt import load_checkpoint  # noqa: E402

DEFAULT_TEXT = "Shall I compare thee to a summer's day?\nThou art"
DEFAULT_PNG = Path(__file__).resolve().parent / "attention_heatmaps.png"
SHOWN = {" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"}  # open box, return arrow, tab arrow


@torch.no_grad()
def attention_maps(model, vocab, text):
    """The per-head attention weights of each layer for ``text``: a list of (n_heads, L, L) tensors."""
    ids = torch.tensor([vocab.encode(text, "the snippet")])
    _, weights = model.eval()(ids, need_weights=True)
    return [w[0] for w in weights]


def head_statistics(weights):
    """For (H, L, L) weights: each head's mean distance looked back (characters) and weight on the previous one."""
    L = weights.shape[-1]
    q = torch.arange(L)
    distance = (q[:, None] - q[None, :]).clamp(min=0).to(weights.dtype)
    mean_distance = (weights * distance).sum(-1).mean(-1)
    if L == 1:
        return mean_distance, torch.zeros_like(mean_distance)
    return mean_distance, weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)


def draw(maps, text, out, title, num_kv_heads):
    """Draw the (layers x heads) grid of heatmaps to the PNG ``out``."""
    layers, heads, L = len(maps), maps[0].shape[0], len(text)
    panel = 4.5  # inches per panel
    fig, axes = plt.subplots(layers, heads, figsize=(panel * heads + 1.2, panel * layers + 0.9), squeeze=False,
                             constrained_layout=True)
    labels = [SHOWN.get(c, c) for c in text]
    fontsize = 5.5
    stride = max(1, math.ceil(L * fontsize / (panel * 72 * 0.85)))  # labels at least 1 em apart
    ticks = list(range(0, L, stride))
    group = heads // num_kv_heads
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            image = ax.imshow(maps[layer][head].numpy(), cmap="magma", norm=norm, interpolation="nearest")
            ax.set_title(f"layer {layer + 1}, head {head + 1} (kv head {head // group + 1})", fontsize=9)
            ax.set_xticks(ticks, [labels[i] for i in ticks], fontsize=fontsize)
            ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=fontsize)
            ax.tick_params(length=1.5, pad=1)
            if layer == layers - 1:
                ax.set_xlabel("key (attended-to character)", fontsize=8)
            if head == 0:
                ax.set_ylabel("query (current character)", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.5, label="attention weight (square-root scale)")
    fig.suptitle(title, fontsize=11)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help="a checkpoint written by char_gpt.py (default: examples/char_gpt.pt)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="the snippet to run through the model (default: the start of "
                   "Sonnet 18, 48 characters); at most the model's context; every character is labelled up to "
                   "about 50 characters")
    p.add_argument("--out", type=Path, default=DEFAULT_PNG,
                   help="PNG to write (default: examples/attention_heatmaps.png)")
    args = p.parse_args(argv)
    if not args.checkpoint.is_file():
        p.error(f"no checkpoint at {args.checkpoint} (train one first: python examples/char_gpt.py)")
    if not args.text:
        p.error("--text must not be empty")
    return args, p


def main(argv=None):
    """Draw the heatmaps for the command line ``argv``; returns the list of (n_heads, L, L) weight tensors."""
    args, parser = parse_args(argv)
    model, vocab, _ = load_checkpoint(args.checkpoint)
    if len(args.text) > model.cfg.context:
        parser.error(f"--text has {len(args.text)} characters; the model's context is {model.cfg.context}")
    try:
        vocab.encode(args.text, "--text")
    except ValueError as exc:
        parser.error(str(exc))
    maps = attention_maps(model, vocab, args.text)
    for layer, weights in enumerate(maps):
        distance, previous = head_statistics(weights)
        for head in range(weights.shape[0]):
            print(f"layer {layer + 1} head {head + 1}: looks back {distance[head]:5.1f} characters on average, "
                  f"{100 * previous[head]:4.1f}% on the previous character")
    title = (f"{args.checkpoint.name}: per-head attention over {args.text!r}\n"
             f"{model.cfg.n_layers} layers, {model.cfg.n_heads} query heads sharing "
             f"{model.cfg.n_kv_heads} key/value heads")
    draw(maps, args.text, args.out, title, model.cfg.n_kv_heads)
    print(f"wrote {args.out}")
    return maps


if __name__ == "__main__":
    main()
