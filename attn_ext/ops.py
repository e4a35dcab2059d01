"""attn_ext's operators: fake kernels, autograd, and the functional API.

The kernels are C++ (csrc/cpu) and CUDA (csrc/cuda), registered as
``torch.ops.attn_ext.attention_forward`` / ``attention_backward`` (the fused
attention) and ``attention_probs`` / ``attention_probs_backward`` (the explicit
probabilities). This module gives them fake (meta) kernels, so that they trace
under ``torch.compile`` and ``torch.export``, and an autograd formula, then
the functional API on top.
"""

import math

import torch

from . import _build  # noqa: F401  (loads the operators)
from .masks import sdpa_mask

__all__ = ["scaled_dot_product_attention", "attention_probs"]

_CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- attention_forward -------------------------------------------------------


@torch.library.register_fake("attn_ext::attention_forward")
def _attention_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed):
    B, Hq, L, _ = query.shape
    out = query.new_empty((B, Hq, L, value.shape[-1]))
    lse = query.new_empty((B, Hq, L), dtype=_lse_dtype(query.dtype))
    return out, lse


def _attention_forward_setup_context(ctx, inputs, output):
    query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, dropout_seed)
    ctx.attrs = (dropout_p, is_causal, causal_offset, scale)


def _attention_forward_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, attn_mask, dropout_seed = ctx.saved_tensors
    dropout_p, is_causal, causal_offset, scale = ctx.attrs
    grad_mask_needed = attn_mask is not None and ctx.needs_input_grad[3]
    grad_query, grad_key, grad_value, grad_mask = torch.ops.attn_ext.attention_backward(
        grad_out, grad_lse, query, key, value, out, lse, attn_mask,
        dropout_p, is_causal, causal_offset, scale, dropout_seed, grad_mask_needed,
    )
    return grad_query, grad_key, grad_value, grad_mask if grad_mask_needed else None, None, None, None, None, None


torch.library.register_autograd(
    "attn_ext::attention_forward", _attention_forward_backward, setup_context=_attention_forward_setup_context
)


# --- attention_backward ------------------------------------------------------


@torch.library.register_fake("attn_ext::attention_backward")
def _attention_backward_fake(grad_out, grad_lse, query, key, value, out, lse, attn_mask, dropout_p, is_causal,
                             causal_offset, scale, dropout_seed, compute_grad_mask):
    grad_mask = attn_mask.new_empty(attn_mask.shape) if compute_grad_mask else query.new_empty((0,))
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_mask


# --- attention_probs ---------------------------------------------------------


@torch.library.register_fake("attn_ext::attention_probs")
def _attention_probs_fake(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed):
    B, Hq, L, _ = query.shape
    probs = query.new_empty((B, Hq, L, key.shape[-2]))
    lse = query.new_empty((B, Hq, L), dtype=_lse_dtype(query.dtype))
    return probs, lse


def _attention_probs_setup_context(ctx, inputs, output):
    query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed = inputs
    probs, lse = output
    ctx.save_for_backward(query, key, probs, lse, attn_mask, dropout_seed)
    ctx.attrs = (dropout_p, is_causal, causal_offset, scale)


def _attention_probs_backward(ctx, grad_probs, grad_lse):
    query, key, probs, lse, attn_mask, dropout_seed = ctx.saved_tensors
    dropout_p, is_causal, causal_offset, scale = ctx.attrs
    grad_mask_needed = attn_mask is not None and ctx.needs_input_grad[2]
    grad_query, grad_key, grad_mask = torch.ops.attn_ext.attention_probs_backward(
        grad_probs, grad_lse, query, key, probs, lse, attn_mask,
        dropout_p, is_causal, causal_offset, scale, dropout_seed, grad_mask_needed,
    )
    return grad_query, grad_key, grad_mask if grad_mask_needed else None, None, None, None, None, None


torch.library.register_autograd(
    "attn_ext::attention_probs", _attention_probs_backward, setup_context=_attention_probs_setup_context
)


@torch.library.register_fake("attn_ext::attention_probs_backward")
def _attention_probs_backward_fake(grad_probs, grad_lse, query, key, probs, lse, attn_mask, dropout_p, is_causal,
                                   causal_offset, scale, dropout_seed, compute_grad_mask):
    grad_mask = attn_mask.new_empty(attn_mask.shape) if compute_grad_mask else query.new_empty((0,))
    return query.new_empty(query.shape), key.new_empty(key.shape), grad_mask


# --- functional API ----------------------------------------------------------


class _Call:
    """A user's call normalised to the operators' arguments: 4-D (B, H, X, D)
    tensors, a mask of at most 4 dims, the causal offset, the scale and a
    dropout seed drawn from torch's generator for the device."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment):
        named = [("query", query), ("key", key)] + ([("value", value)] if value is not None else [])
        for name, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if query.dim() < 3:
            raise ValueError(f"query must have at least 3 dims (N, ..., L, E), got shape {tuple(query.shape)}")
        for name, t in named[1:]:
            if t.dim() != query.dim():
                raise ValueError(
                    f"{name} must have as many dims as query ({query.dim()}), got {name} shape {tuple(t.shape)} "
                    f"for query shape {tuple(query.shape)}"
                )
        if causal_alignment not in _CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal_alignment must be one of {_CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")
        self.has_head_dim = query.dim() >= 4
        if self.has_head_dim:
            if any(t.shape[:-3] != query.shape[:-3] for _, t in named):
                shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named)
                raise ValueError(f"{', '.join(n for n, _ in named)} must have the same batch dims, got {shapes}")
            Hq, Hkv = query.shape[-3], key.shape[-3]
            if enable_gqa:
                if Hkv == 0 or Hq % Hkv != 0:
                    raise ValueError(
                        f"enable_gqa needs query heads ({Hq}) to be a multiple of key/value heads ({Hkv}), "
                        f"got query {tuple(query.shape)} and key {tuple(key.shape)}"
                    )
            elif Hq != Hkv:
                raise ValueError(
                    f"query has {Hq} heads but key has {Hkv}: pass enable_gqa=True for grouped-query attention "
                    f"(query {tuple(query.shape)}, key {tuple(key.shape)})"
                )
        self.query_shape = tuple(query.shape)
        self.q, batch_shape = _split_batch(query, self.has_head_dim)
        self.k, _ = _split_batch(key, self.has_head_dim)
        self.v = None if value is None else _split_batch(value, self.has_head_dim)[0]
        L, E, S = self.q.shape[-2], self.q.shape[-1], self.k.shape[-2]
        self.mask = sdpa_mask(attn_mask, batch_shape, self.q.shape[1], L, S, self.has_head_dim)
        self.scale = float(scale) if scale is not None else (1.0 / math.sqrt(E) if E > 0 else 1.0)
        self.causal_offset = S - L if causal_alignment == "bottom_right" else 0
        self.dropout_p = float(dropout_p)
        self.is_causal = bool(is_causal)
        self.dropout_seed = None
        if dropout_p > 0:
            self.dropout_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=query.device)

    def op_args(self):
        """attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed, as the ops take them."""
        return self.mask, self.dropout_p, self.is_causal, self.causal_offset, self.scale, self.dropout_seed

    def unflatten(self, t):
        """(B, H, L, X) -> the user's (N, ..., H, L, X), or (N, L, X) for 3-D inputs; works for lse too."""
        if not self.has_head_dim:
            return t.squeeze(1)
        if len(self.query_shape) == 4:  # already (B, H, L, X): no reshape on the per-call path
            return t
        return t.reshape(*self.query_shape[:-1], *t.shape[3:])


def _split_batch(t, has_head_dim):
    """(N, ..., H, X, D) -> (B, H, X, D); (N, X, D) -> (N, 1, X, D). Also returns the batch shape."""
    if not has_head_dim:
        return t.unsqueeze(1), tuple(t.shape[:1])
    batch = tuple(t.shape[:-3])
    return (t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])), batch


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_alignment="top_left", return_lse=False):
    r"""Scaled dot-product attention computed by attn_ext's fused kernels.

    Same signature and meaning as :func:`torch.nn.functional.scaled_dot_product_attention`:
    ``softmax(query @ key.T * scale + mask) @ value`` with optional dropout on the
    probabilities. Differences from PyTorch:

    * ``is_causal`` may be combined with ``attn_mask`` (both apply).
    * ``causal_alignment="bottom_right"`` aligns the causal diagonal to the end
      of the keys (FlashAttention's convention, for queries that continue a
      longer key sequence); the default ``"top_left"`` is PyTorch's.
    * A query row whose keys are all masked gives 0 (PyTorch gives NaN) and
      zero gradients.
    * A float ``attn_mask`` that requires grad gets its gradient.
    * ``return_lse=True`` also returns the log-sum-exp of each row.
    * Dropout uses a Philox counter-based generator seeded from torch's
      generator for the device: ``torch.manual_seed`` reproduces a call.

    Args:
        query: (N, ..., Hq, L, E) or (N, L, E), float16 / bfloat16 / float32 / float64, any strides.
        key: (N, ..., Hkv, S, E) or (N, S, E).
        value: (N, ..., Hkv, S, Ev) or (N, S, Ev).
        attn_mask: bool (True = may attend) or additive float of the query's
            dtype, broadcastable to (N, ..., Hq, L, S) (to (N, L, S) for 3-D inputs).
        dropout_p: probability of dropping an attention probability, in [0, 1).
        is_causal: mask out keys after the query's position.
        scale: multiplies the scores; default 1 / sqrt(E).
        enable_gqa: allow Hkv < Hq (grouped-query attention, Hq a multiple of
            Hkv); query head h uses key/value head h // (Hq // Hkv). K and V are not copied.
        causal_alignment: "top_left" (key j visible from query i iff j <= i) or
            "bottom_right" (iff j <= i + S - L).
        return_lse: also return the log-sum-exp of the masked, scaled scores.

    Shape:
        out: (N, ..., Hq, L, Ev) in the query's dtype.
        lse: (N, ..., Hq, L), float32 (float64 for float64 inputs); -inf for fully masked rows.

    Returns:
        ``out``, or ``(out, lse)`` when ``return_lse``.

    Example::

        >>> q, k, v = (torch.randn(2, 8, 128, 64, requires_grad=True) for _ in range(3))
        >>> out = attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> out.sum().backward()
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
    out, lse = torch.ops.attn_ext.attention_forward(call.q, call.k, call.v, *call.op_args())
    out, lse = call.unflatten(out), call.unflatten(lse)
    return (out, lse) if return_lse else out


def attention_probs(query, key, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                    causal_alignment="top_left"):
    r"""The attention probabilities ``softmax(query @ key.T * scale + mask)``, explicitly.

    For ``need_weights=True`` and for looking at what a head attends to. The
    arguments mean what they mean for :func:`scaled_dot_product_attention`;
    the result is differentiable (its backward is a hand-written kernel too),
    including with respect to a float ``attn_mask``. With ``dropout_p > 0`` the
    dropped probabilities are 0 and the kept ones are scaled by 1 / (1 - p), as
    the fused kernel applies them: with the same ``torch.manual_seed``,
    ``attention_probs(q, k, ...) @ value`` equals ``scaled_dot_product_attention(q, k, value, ...)``.

    Args:
        query: (N, ..., Hq, L, E) or (N, L, E).
        key: (N, ..., Hkv, S, E) or (N, S, E).

    Shape:
        probs: (N, ..., Hq, L, S) (or (N, L, S)) in the query's dtype; rows
        with no visible key are 0.

    Example::

        >>> q, k = torch.randn(1, 4, 16, 32), torch.randn(1, 4, 16, 32)
        >>> p = attn_ext.attention_probs(q, k, is_causal=True)
        >>> p.sum(-1)  # all ones
    """
    call = _Call(query, key, None, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
    probs, _ = torch.ops.attn_ext.attention_probs(call.q, call.k, *call.op_args())
    return call.unflatten(probs)


def attention_and_probs(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, *, causal_alignment="top_left"):
    """``(scaled_dot_product_attention(...), attention_probs(...))`` with one dropout draw.

    The output comes from the fused kernel and the probabilities from the
    probabilities kernel, both seeded with the same Philox seed, so the dropped
    probabilities are the ones the output used: ``probs @ value`` equals ``out``.
    For ``MultiHeadAttention(need_weights=True)``. Arguments as for
    :func:`scaled_dot_product_attention`.
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment)
    out, _ = torch.ops.attn_ext.attention_forward(call.q, call.k, call.v, *call.op_args())
    probs, _ = torch.ops.attn_ext.attention_probs(call.q, call.k, *call.op_args())
    return call.unflatten(out), call.unflatten(probs)
