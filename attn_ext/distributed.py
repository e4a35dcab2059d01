"""Context parallelism: attention over a sequence split across the ranks of a process group.

Each rank holds one shard of the sequence (dim -2 of query, key and value).
:func:`ring_attention` passes the key/value shards around the ring of ranks
with ``torch.distributed`` point-to-point operations (gloo on the CPU, NCCL on
GPUs), runs attn_ext's forward kernel on each (local queries, visiting keys)
block while the next block is in flight, and merges the partial outputs
through their log-sum-exp. The backward sends the keys and values around
again, each rank adds its share of their gradients, and the gradients travel
with them back to the rank that owns them. No rank ever holds more than two
key/value shards (the one it computes with and the one arriving).

Layouts (W ranks, the sequence cut into equal chunks):

* ``"contiguous"``: rank r holds chunk r of W. With ``is_causal`` the work is
  unbalanced: rank 0 computes one block, rank W - 1 computes W.
* ``"zigzag"``: rank r holds chunks r and 2W - 1 - r of 2W (in that order).
  Causal attention then costs every rank the same: half a block per step.

:func:`shard` and :func:`unshard` cut a full tensor into this rank's shard and
gather the shards back, in either layout. Positions (for positional encodings)
are ``shard(torch.arange(L), 0, layout)``.

Example (``torchrun --nproc-per-node 2 script.py``)::

    dist.init_process_group("gloo")
    q, k, v = (attn_ext.distributed.shard(t, -2, "zigzag") for t in (q_full, k_full, v_full))
    out = attn_ext.distributed.ring_attention(q, k, v, is_causal=True, layout="zigzag")
    out_full = attn_ext.distributed.unshard(out, -2, "zigzag")
"""

import math

import torch
import torch.distributed as dist

from .ops import _lse_dtype, _scale, _split_batch

__all__ = ["ring_attention", "shard", "unshard", "enable_context_parallel"]

LAYOUTS = ("contiguous", "zigzag")

# Tags of the point-to-point messages (gloo matches on them; NCCL keeps the posting order,
# which is the same on every rank).
_TAG_KV, _TAG_GRAD = 0, 2


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _ring(group):
    """(group, world size, this rank in the group, global rank of the next and previous rank)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("attn_ext.distributed needs torch.distributed initialised first "
                           "(torch.distributed.init_process_group)")
    group = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the group it was given")
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    return group, world, rank, nxt, prv


def _chunks(world, layout):
    return world if layout == "contiguous" else 2 * world


def _owned_chunks(rank, world, layout):
    """The global chunk indices a rank holds, in local order."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


# ----------------------------------------------------------------------------- shard / unshard


def _cut(x, dim, layout, rank, world):
    """This rank's shard of x along dim (a view for "contiguous")."""
    n_chunks = _chunks(world, layout)
    size = x.shape[dim]
    if size % n_chunks:
        raise ValueError(f"shard: dim {dim} of x (shape {tuple(x.shape)}) has length {size}, which must divide "
                         f"by {n_chunks} ({world} ranks, layout {layout!r})")
    c = size // n_chunks
    parts = [x.narrow(dim, i * c, c) for i in _owned_chunks(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class _Shard(torch.autograd.Function):
    """shard() of a tensor that requires grad: replicated in, so its gradient is summed over the ranks."""

    @staticmethod
    def forward(ctx, x, dim, layout, group):
        group, world, rank, _, _ = _ring(group)
        ctx.args = x.shape, dim, layout, group, rank, world
        return _cut(x, dim, layout, rank, world).clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dim, layout, group, rank, world = ctx.args
        full = grad.new_zeros(shape)
        c = shape[dim] // _chunks(world, layout)
        for j, i in enumerate(_owned_chunks(rank, world, layout)):
            full.narrow(dim, i * c, c).copy_(grad.narrow(dim, j * c, c))
        dist.all_reduce(full, group=group)
        return full, None, None, None


def shard(x, dim=-2, layout="contiguous", group=None):
    """This rank's shard of a full tensor along ``dim``: chunk r of W (``"contiguous"``)
    or chunks r and 2W - 1 - r of 2W, concatenated (``"zigzag"``).

    ``x.shape[dim]`` must divide by W (by 2W for zigzag). The full tensor is
    taken to be the same on every rank (replicated). Without gradients the
    result is a view for ``"contiguous"``; for an ``x`` that requires grad it is
    a copy, and the backward sums the ranks' gradients (an all-reduce over the
    group), so that every rank gets the whole gradient of ``x``: every rank must
    then run the backward.
    """
    _check_layout(layout)
    group, world, rank, _, _ = _ring(group)
    if x.requires_grad and torch.is_grad_enabled():
        return _Shard.apply(x, dim, layout, group)
    return _cut(x, dim, layout, rank, world)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, layout, group):
        group, world, rank, _, _ = _ring(group)
        ctx.dim, ctx.layout, ctx.group = dim, layout, group
        shards = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
        dist.all_gather(shards, x.contiguous(), group=group)
        if layout == "contiguous":
            return torch.cat(shards, dim)
        chunks = [None] * (2 * world)
        for r, s in enumerate(shards):
            chunks[r], chunks[2 * world - 1 - r] = s.chunk(2, dim)
        return torch.cat(chunks, dim)

    @staticmethod
    def backward(ctx, grad):
        return shard(grad, ctx.dim, ctx.layout, ctx.group), None, None, None


def unshard(x, dim=-2, layout="contiguous", group=None):
    """The full tensor from every rank's shard (an all-gather), the inverse of :func:`shard`.

    Every rank gets the whole tensor. Its gradient is taken to be the same on
    every rank (a loss computed from the gathered tensor, identically
    everywhere): each rank's shard receives its slice of it.
    """
    _check_layout(layout)
    _, world, _, _, _ = _ring(group)
    dim = dim % x.dim()
    if layout == "zigzag" and x.shape[dim] % 2:
        raise ValueError(f"unshard: a zigzag shard holds two equal chunks, got dim {dim} of length {x.shape[dim]} "
                         f"(x shape {tuple(x.shape)})")
    return _Unshard.apply(x, dim, layout, group)


# ----------------------------------------------------------------------------- the ring


def _block(step_src, rank, is_causal, layout, n_q, n_k):
    """What rank ``rank`` computes with the keys/values of rank ``step_src``:
    None, or (query rows [a, b), key rows [c, d), causal) of the local shards."""
    if not is_causal:
        return (0, n_q), (0, n_k), False
    if step_src == rank:  # own keys: causal (local order is global order in both layouts)
        return (0, n_q), (0, n_k), True
    if layout == "contiguous":  # an earlier chunk: every key visible; a later one: none
        return ((0, n_q), (0, n_k), False) if step_src < rank else None
    # zigzag: chunks (s, 2W-1-s) against (r, 2W-1-r). s < r: both query chunks see chunk s
    # and neither sees 2W-1-s; s > r: only chunk 2W-1-r sees anything, and sees both.
    if step_src < rank:
        return (0, n_q), (0, n_k // 2), False
    return (n_q // 2, n_q), (0, n_k), False


def _merge(out, lse, block_out, block_lse):
    """out, lse <- the softmax-weighted combination of (out, lse) and a block's (out, lse),
    in place; rows where both are empty (lse -inf) stay 0 / -inf."""
    new_lse = torch.logaddexp(lse, block_lse)
    empty = torch.isneginf(new_lse)
    w_old = torch.exp(lse - new_lse).masked_fill_(empty, 0.0).unsqueeze(-1)
    w_new = torch.exp(block_lse - new_lse).masked_fill_(empty, 0.0).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_new)
    lse.copy_(new_lse)


class _Exchange:
    """Tensors sent to the next rank while their like arrives from the previous one."""

    def __init__(self, tensors, nxt, prv, group, tag, what, step):
        self.what, self.step, self.prv = what, step, prv
        self.send = [t.contiguous() for t in tensors]  # alive until the sends complete
        self.recv = [torch.empty_like(t) for t in self.send]
        ops = [dist.P2POp(dist.isend, t, nxt, group, tag + i) for i, t in enumerate(self.send)]
        ops += [dist.P2POp(dist.irecv, t, prv, group, tag + i) for i, t in enumerate(self.recv)]
        try:
            self.works = dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            self._fail(e)

    def _fail(self, e):
        raise RuntimeError(f"ring_attention: step {self.step}: exchanging {self.what} with the neighbouring ranks "
                           f"failed (receiving from global rank {self.prv}); a rank has failed, left or not called "
                           f"ring_attention with the same arguments: {e}") from e

    def wait(self):
        """The received tensors, once the transfers are done (a failed one raises)."""
        try:
            for w in self.works:
                w.wait()
        except RuntimeError as e:
            self._fail(e)
        self.send = None
        return self.recv


def _into(full_shape, rows, t, acc):
    """t as the rows [a, b) (dim -2) of a tensor of full_shape in the accumulation dtype, zeros elsewhere;
    t itself (converted) when it is all the rows."""
    a, b = rows
    if b - a == full_shape[-2]:
        return t.to(acc)
    whole = t.new_zeros(full_shape, dtype=acc)
    whole[..., a:b, :] = t
    return whole


def _ring_forward(q, k, v, scale, is_causal, layout, group):
    """q (B, Hq, Lq, E), k (B, Hkv, Lk, E), v (B, Hkv, Lk, Ev): the local shards.
    Returns out (B, Hq, Lq, Ev) in q's dtype and lse (B, Hq, Lq) in the accumulation dtype."""
    group, world, rank, nxt, prv = _ring(group)
    acc = _lse_dtype(q.dtype)
    B, Hq, Lq, _ = q.shape
    out = lse = None  # the merged output (accumulation dtype) and lse, from the first block on
    kv = [k.contiguous(), v.contiguous()]
    for step in range(world):
        exchange = None
        if step + 1 < world:  # the next block travels while this one is computed
            exchange = _Exchange(kv, nxt, prv, group, _TAG_KV, "keys/values", step)
        block = _block((rank - step) % world, rank, is_causal, layout, Lq, k.shape[-2])
        if block is not None:
            (a, b), (c, d), causal = block
            block_out, block_lse = torch.ops.attn_ext.attention_forward.default(
                q[:, :, a:b], kv[0][:, :, c:d], kv[1][:, :, c:d], None, 0.0, causal, 0, scale, None)
            if out is None and b - a == Lq:
                out, lse = block_out.to(acc), block_lse
            else:
                if out is None:
                    out = q.new_zeros((B, Hq, Lq, v.shape[-1]), dtype=acc)
                    lse = q.new_full((B, Hq, Lq), -math.inf, dtype=acc)
                _merge(out[:, :, a:b], lse[:, :, a:b], block_out, block_lse)
        if exchange is not None:
            kv = exchange.wait()
    if out is None:  # no visible key at all (not reached by the layouts above)
        out = q.new_zeros((B, Hq, Lq, v.shape[-1]), dtype=acc)
        lse = q.new_full((B, Hq, Lq), -math.inf, dtype=acc)
    return out.to(q.dtype), lse


def _ring_backward(grad_out, grad_lse, q, k, v, out, lse, scale, is_causal, layout, group):
    """The gradients of the local q, k, v shards. Keys/values go around the ring
    once more; each rank adds its share of their gradients (in the accumulation
    dtype) to the sums that travel with them, and the sums end at their owner."""
    group, world, rank, nxt, prv = _ring(group)
    acc = _lse_dtype(q.dtype)
    Lq, Lk = q.shape[-2], k.shape[-2]
    grad_q = None
    kv = [k.contiguous(), v.contiguous()]
    grads_in = None  # the sums for the block this rank holds, arriving from the previous rank
    for step in range(world):
        kv_exchange = None
        if step + 1 < world:
            kv_exchange = _Exchange(kv, nxt, prv, group, _TAG_KV, "keys/values", step)
        mine = None  # this rank's share of the held block's gradients, then the sums so far
        block = _block((rank - step) % world, rank, is_causal, layout, Lq, Lk)
        if block is not None:
            (a, b), (c, d), causal = block
            g_lse = None if grad_lse is None else grad_lse[:, :, a:b]
            gq, gk, gv, _, _ = torch.ops.attn_ext.attention_backward.default(
                grad_out[:, :, a:b], g_lse, q[:, :, a:b], kv[0][:, :, c:d], kv[1][:, :, c:d], out[:, :, a:b],
                lse[:, :, a:b], None, 0.0, causal, 0, scale, None)
            if grad_q is None:
                grad_q = _into(q.shape, (a, b), gq, acc)
            else:
                grad_q[:, :, a:b] += gq
            mine = [_into(k.shape, (c, d), gk, acc), _into(v.shape, (c, d), gv, acc)]
        if grads_in is not None:
            received = grads_in.wait()
            mine = received if mine is None else [m.add_(r) for m, r in zip(mine, received)]
        if mine is None:
            mine = [k.new_zeros(k.shape, dtype=acc), v.new_zeros(v.shape, dtype=acc)]
        # the sums go to the next rank, which holds this block at the next step (after the
        # last step: its owner)
        if world > 1:
            grads_in = _Exchange(mine, nxt, prv, group, _TAG_GRAD, "key/value gradients", step)
        if kv_exchange is not None:
            kv = kv_exchange.wait()
    grad_k, grad_v = grads_in.wait() if world > 1 else mine
    if grad_q is None:
        grad_q = torch.zeros_like(q)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal, layout, group):
        out, lse = _ring_forward(q, k, v, scale, is_causal, layout, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = scale, is_causal, layout, group
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        scale, is_causal, layout, group = ctx.args
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_q, grad_k, grad_v = _ring_backward(grad_out, grad_lse, q, k, v, out, lse, scale, is_causal, layout,
                                                group)
        return grad_q, grad_k, grad_v, None, None, None, None


def ring_attention(query, key, value, *, group=None, is_causal=False, scale=None, enable_gqa=False,
                   layout="contiguous", return_lse=False):
    r"""Attention over a sequence sharded across the ranks of ``group`` (context parallelism).

    Every rank calls it with its own shards of query, key and value (the
    sequence dimension, -2, cut by :func:`shard`) and gets its shard of the
    output: the same values, and through autograd the same gradients, as
    :func:`attn_ext.scaled_dot_product_attention` over the whole sequence.
    Key/value shards travel around the ring while the kernel works on the
    previous one; partial outputs merge through the log-sum-exp in float32
    (float64 for float64 inputs).

    Args:
        query: (N, ..., Hq, Lq, E) or (N, Lq, E): this rank's shard of the queries.
        key: (N, ..., Hkv, Lk, E) or (N, Lk, E): this rank's shard of the keys.
        value: (N, ..., Hkv, Lk, Ev) or (N, Lk, Ev).
        group: the process group whose ranks hold the shards (default: the world);
            every member must call with shards of the same shapes and the same arguments.
        is_causal: global causal mask (key position <= query position). Needs the
            same query and key lengths.
        scale: multiplies the scores; default 1 / sqrt(E).
        enable_gqa: allow Hkv < Hq (grouped-query attention), as in
            :func:`attn_ext.scaled_dot_product_attention`; K/V are not copied.
        layout: ``"contiguous"`` (rank r holds chunk r of W) or ``"zigzag"`` (chunks r
            and 2W - 1 - r of 2W; balances causal work).
        return_lse: also return the log-sum-exp of this rank's query rows (differentiable).

    Returns:
        ``out`` (N, ..., Hq, Lq, Ev) in the query's dtype, or ``(out, lse)`` with
        lse (N, ..., Hq, Lq) float32 (float64 for float64 inputs).

    A rank that fails or never calls makes the others raise a RuntimeError
    after the process group's timeout (``init_process_group(timeout=...)``)
    instead of waiting forever. Dropout, masks and the attention variants are
    not supported here.
    """
    _check_layout(layout)
    named = (("query", query), ("key", key), ("value", value))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if query.dim() < 3 or any(t.dim() != query.dim() for _, t in named):
        raise ValueError(f"query, key and value must have the same number of dims, at least 3, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise ValueError(f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, "
                         f"{value.dtype}")
    if key.shape[:-1] != value.shape[:-1] or key.shape[:-3] != query.shape[:-3] or query.shape[-1] != key.shape[-1]:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)} (want (N, ..., Hq, Lq, E), (N, ..., Hkv, Lk, E), (N, ..., Hkv, Lk, Ev))")
    has_heads = query.dim() >= 4
    if has_heads:
        Hq, Hkv = query.shape[-3], key.shape[-3]
        if Hq != Hkv and not (enable_gqa and Hkv > 0 and Hq % Hkv == 0):
            raise ValueError(f"query has {Hq} heads and key {Hkv}: "
                             + ("Hq must be a multiple of Hkv" if enable_gqa else "pass enable_gqa=True")
                             + f" (query {tuple(query.shape)}, key {tuple(key.shape)})")
    Lq, Lk = query.shape[-2], key.shape[-2]
    if is_causal and Lq != Lk:
        raise ValueError(f"is_causal needs query and key shards of the same length, got {Lq} and {Lk}")
    if layout == "zigzag" and (Lq % 2 or Lk % 2):
        raise ValueError(f"layout='zigzag' shards hold two equal chunks: their lengths must be even, got query "
                         f"{Lq} and key {Lk}")
    E = query.shape[-1]
    scale = _scale(scale, E)
    q, batch = _split_batch(query, has_heads)
    k, _ = _split_batch(key, has_heads)
    v, _ = _split_batch(value, has_heads)
    out, lse = _RingAttention.apply(q, k, v, scale, bool(is_causal), layout, group)
    if has_heads:
        out = out.reshape(*query.shape[:-1], out.shape[-1])
        lse = lse.reshape(query.shape[:-1])
    else:
        out, lse = out.squeeze(1), lse.squeeze(1)
    return (out, lse) if return_lse else out


def enable_context_parallel(model, group=None, layout="contiguous"):
    """Run every :class:`attn_ext.MultiHeadAttention` in ``model`` with context
    parallelism over ``group`` (default: the world) in ``layout``; ``group=False``
    turns it off. Returns how many modules were set.

    The model's inputs must then be each rank's shard of the sequence (cut by
    :func:`shard` in the same layout), with positions to match.
    """
    from .modules import MultiHeadAttention

    _check_layout(layout)
    if group is None:
        _ring(None)  # checks torch.distributed is initialised
        group = dist.group.WORLD
    n = 0
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.context_parallel_group = None if group is False else group
            m.context_parallel_layout = layout
            n += 1
    return n
