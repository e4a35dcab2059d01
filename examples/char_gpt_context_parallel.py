"""char_gpt.py's model trained with every sequence split across processes (context parallelism).

Each process (rank) of a gloo group keeps one shard of every training window:
with ``--layout zigzag`` (the default) rank r of W holds chunks r and 2W - 1 - r
of 2W, which gives every rank the same share of the causal attention. The
attention layers run ``attn_ext.distributed.ring_attention`` (set on the model
by ``attn_ext.distributed.enable_context_parallel``): keys and values travel
around the ring of ranks, and no rank ever holds a whole sequence's keys and
values. Everything else in the model works token by token. The parameters are
replicated by DistributedDataParallel, which averages their gradients over
the ranks, and with shards of equal size that average is the gradient of the
whole batch's mean loss. One process and W processes therefore train the same
model, and with the same seed their loss curves agree to float32 rounding.
Dropout is off by default, because each rank would draw its own masks.

Run from the repository root::

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/char_gpt_context_parallel.py --steps 100
    .venv/bin/python examples/char_gpt_context_parallel.py --steps 100      # one process, the same losses

Rank 0 prints the mean loss over the whole batch (every rank's tokens).
"""

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

EXAMPLES = Path(__file__).resolve().parent
sys.path.insert(0, str(EXAMPLES))
from char_gpt import DEFAULT_TEXT, CharGPT, GPTConfig, Vocab, get_batch  # noqa: E402  (also puts attn_ext on the path)

import attn_ext.distributed as cp  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="training text (default: the Sonnets)")
    p.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    p.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag", help="how sequences are split (default: zigzag)")
    p.add_argument("--seed", type=int, default=0, help="seed of initialisation and batches (default: 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (default: 10)")
    p.add_argument("--context", type=int, default=256, help="window in characters (default: 256)")
    p.add_argument("--d-model", type=int, default=128, help="width, even (default: 128)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default: 4)")
    p.add_argument("--heads", type=int, default=4, help="query heads (default: 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: 2)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout (default: 0; each rank draws its own)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step (default: 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of AdamW (default: 1e-3)")
    return p.parse_args(argv)


def init_process_group():
    """The process group torchrun describes in the environment, or a group of one process."""
    if "WORLD_SIZE" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))


def main(argv=None):
    args = parse_args(argv)
    init_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.context % (2 * world):
        raise SystemExit(f"--context ({args.context}) must divide by 2 x the number of processes ({2 * world})")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cp_group = dist.new_group(backend="gloo")  # the ring's own group, apart from DDP's all-reduces

    text = args.text.read_text(encoding="utf-8")
    vocab = Vocab(sorted(set(text)))
    data = torch.tensor(vocab.encode(text), dtype=torch.long)
    cfg = GPTConfig(len(vocab.chars), args.context, args.d_model, args.layers, args.heads, args.kv_heads,
                    args.dropout)
    model = CharGPT(cfg)
    cp.enable_context_parallel(model, cp_group, args.layout)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.1)
    positions = cp.shard(torch.arange(args.context), 0, args.layout, cp_group)
    if rank == 0:
        print(f"{world} process(es) x {args.threads} thread(s), layout {args.layout}: each holds "
              f"{len(positions)} of every {args.context} characters; "
              f"{sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    generator = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = get_batch(data, args.batch_size, args.context, generator)
        x, y = cp.shard(x, 1, args.layout, cp_group), cp.shard(y, 1, args.layout, cp_group)
        logits, _ = ddp(x, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # this rank's tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps:
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            if rank == 0:
                seconds = time.perf_counter() - start
                print(f"step {step:5d} | train loss {whole.item() / world:.6f} | {seconds:6.1f} s | "
                      f"{step * args.batch_size * args.context / seconds:,.0f} tok/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
