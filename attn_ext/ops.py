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

__all__ = ["scaled_dot_product_attention", "attention_probs", "varlen_attention"]

_CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
_NO_VARIANTS = (None, None, None, None, None)
# What torch.library's own autograd kernel enters for a call that needs no gradient.
_below_autograd = torch._C._AutoDispatchBelowAutograd
# The dispatcher's boxed call of an operator handle: what ``op(*args)`` ends in,
# without the overload's Python frame and schema matching in front of it.
_call_boxed = torch._C._dispatch_call_boxed
_torch_function_mode_on = torch._C._is_torch_function_mode_enabled
# The overloads the functional API calls, looked up once: ``torch.ops.attn_ext.X.default``
# on every call took 0.7-1.7 us of a 34 us decoding step (1x4x1x100x32, AMD EPYC family 23).
_forward_op = torch.ops.attn_ext.attention_forward.default
_probs_op = torch.ops.attn_ext.attention_probs.default


def _run(op, tensors, args):
    """op(*args), skipping the Python autograd layer when nothing needs a gradient.

    ``args`` is the op's argument tuple, passed as it is (gathering it again
    through ``*args`` costs about 0.2 us a call: 0.19-0.23 us for 14 arguments
    in a bare Python call, AMD EPYC Zen 5); ``tensors`` holds every tensor
    among it that the caller was given (None where absent). torch.library's
    autograd kernel (register_autograd) is Python: even when no input requires
    grad it costs a few microseconds a call (it walks the arguments, then
    redispatches below autograd), which is a third of a small decoding call.
    Its own no-grad branch runs the op below autograd, so doing that here,
    under the same condition, gives the same result without the detour. Under
    torch.compile / export the op is called as it is, for the tracer to see.

    Below autograd, plain tensors and no torch-function mode leave the
    overload's own first step (the ``__torch_function__`` check) nothing to
    do, so the call goes straight to the dispatcher's boxed call of the
    operator (``torch._C._dispatch_call_boxed``, as torch._custom_op does):
    about 1.1 us less of a 10 us decoding step (measured, AMD EPYC Zen 4).
    The dispatcher still sees every key (Python dispatch modes, functorch,
    autocast). Tensor subclasses and torch-function modes take ``op(*args)``.
    Callers pass the overload (``.default``), not the packet.
    """
    grad = torch.is_grad_enabled()
    plain = True
    for t in tensors:
        if t is not None:
            if grad and t.requires_grad:
                return op(*args)
            if type(t) is not torch.Tensor:
                plain = False
    if torch.compiler.is_compiling():
        return op(*args)
    with _below_autograd():
        if plain and not _torch_function_mode_on():
            return _call_boxed(op._handle, *args)
        return op(*args)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale(scale, E):
    """The scores' scale: the one given, else 1/sqrt(E) (SDPA's default; 1 for E = 0)."""
    return float(scale) if scale is not None else (1.0 / math.sqrt(E) if E > 0 else 1.0)


# The variants' arguments, at the end of every op's argument list (see csrc/ops.cpp):
# window_left, window_right, softcap, alibi_slopes, sinks.
_N_VARIANT_ARGS = 5


def _grad_sinks(sinks, grad):
    """The sinks' gradient as autograd wants it: None when there are no sinks."""
    return None if sinks is None else grad


# --- attention_forward -------------------------------------------------------


@torch.library.register_fake("attn_ext::attention_forward")
def _attention_forward_fake(query, key, value, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed,
                            window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None):
    B, Hq, L, _ = query.shape
    torch._check(key.shape[0] == B and value.shape[:-1] == key.shape[:-1])
    out = query.new_empty((B, Hq, L, value.shape[-1]))
    lse = query.new_empty((B, Hq, L), dtype=_lse_dtype(query.dtype))
    return out, lse


def _attention_forward_setup_context(ctx, inputs, output):
    query, key, value, attn_mask = inputs[:4]
    dropout_seed, alibi_slopes, sinks = inputs[8], inputs[12], inputs[13]
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, dropout_seed, alibi_slopes, sinks)
    ctx.attrs = inputs[4:8] + inputs[9:12]  # dropout_p, is_causal, causal_offset, scale, window, softcap


def _attention_forward_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, attn_mask, dropout_seed, alibi_slopes, sinks = ctx.saved_tensors
    dropout_p, is_causal, causal_offset, scale, window_left, window_right, softcap = ctx.attrs
    grad_mask_needed = attn_mask is not None and ctx.needs_input_grad[3]
    grad_query, grad_key, grad_value, grad_mask, grad_sinks = torch.ops.attn_ext.attention_backward(
        grad_out, grad_lse, query, key, value, out, lse, attn_mask,
        dropout_p, is_causal, causal_offset, scale, dropout_seed,
        window_left, window_right, softcap, alibi_slopes, sinks, grad_mask_needed,
    )
    return (grad_query, grad_key, grad_value, grad_mask if grad_mask_needed else None, None, None, None, None, None,
            None, None, None, None, _grad_sinks(sinks, grad_sinks))


torch.library.register_autograd(
    "attn_ext::attention_forward", _attention_forward_backward, setup_context=_attention_forward_setup_context
)


# --- attention_backward ------------------------------------------------------


@torch.library.register_fake("attn_ext::attention_backward")
def _attention_backward_fake(grad_out, grad_lse, query, key, value, out, lse, attn_mask, dropout_p, is_causal,
                             causal_offset, scale, dropout_seed, window_left=None, window_right=None, softcap=None,
                             alibi_slopes=None, sinks=None, compute_grad_mask=False):
    grad_mask = attn_mask.new_empty(attn_mask.shape) if compute_grad_mask else query.new_empty((0,))
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty((0,))
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_mask,
            grad_sinks)


# --- attention_probs ---------------------------------------------------------


@torch.library.register_fake("attn_ext::attention_probs")
def _attention_probs_fake(query, key, attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed,
                          window_left=None, window_right=None, softcap=None, alibi_slopes=None, sinks=None):
    B, Hq, L, _ = query.shape
    probs = query.new_empty((B, Hq, L, key.shape[-2]))
    lse = query.new_empty((B, Hq, L), dtype=_lse_dtype(query.dtype))
    return probs, lse


def _attention_probs_setup_context(ctx, inputs, output):
    query, key, attn_mask = inputs[:3]
    dropout_seed, alibi_slopes, sinks = inputs[7], inputs[11], inputs[12]
    probs, lse = output
    ctx.save_for_backward(query, key, probs, lse, attn_mask, dropout_seed, alibi_slopes, sinks)
    ctx.attrs = inputs[3:7] + inputs[8:11]


def _attention_probs_backward(ctx, grad_probs, grad_lse):
    query, key, probs, lse, attn_mask, dropout_seed, alibi_slopes, sinks = ctx.saved_tensors
    dropout_p, is_causal, causal_offset, scale, window_left, window_right, softcap = ctx.attrs
    grad_mask_needed = attn_mask is not None and ctx.needs_input_grad[2]
    grad_query, grad_key, grad_mask, grad_sinks = torch.ops.attn_ext.attention_probs_backward(
        grad_probs, grad_lse, query, key, probs, lse, attn_mask,
        dropout_p, is_causal, causal_offset, scale, dropout_seed,
        window_left, window_right, softcap, alibi_slopes, sinks, grad_mask_needed,
    )
    return (grad_query, grad_key, grad_mask if grad_mask_needed else None, None, None, None, None, None,
            None, None, None, None, _grad_sinks(sinks, grad_sinks))


torch.library.register_autograd(
    "attn_ext::attention_probs", _attention_probs_backward, setup_context=_attention_probs_setup_context
)


@torch.library.register_fake("attn_ext::attention_probs_backward")
def _attention_probs_backward_fake(grad_probs, grad_lse, query, key, probs, lse, attn_mask, dropout_p, is_causal,
                                   causal_offset, scale, dropout_seed, window_left=None, window_right=None,
                                   softcap=None, alibi_slopes=None, sinks=None, compute_grad_mask=False):
    grad_mask = attn_mask.new_empty(attn_mask.shape) if compute_grad_mask else query.new_empty((0,))
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty((0,))
    return query.new_empty(query.shape), key.new_empty(key.shape), grad_mask, grad_sinks


# --- varlen_forward ----------------------------------------------------------


@torch.library.register_fake("attn_ext::varlen_forward")
def _varlen_forward_fake(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         is_causal, bottom_right, scale, dropout_seed, window_left=None, window_right=None,
                         softcap=None, alibi_slopes=None, sinks=None):
    total_q, Hq, _ = query.shape
    torch._check(cu_seqlens_q.shape == cu_seqlens_k.shape)
    out = query.new_empty((total_q, Hq, value.shape[-1]))
    lse = query.new_empty((total_q, Hq), dtype=_lse_dtype(query.dtype))
    return out, lse


def _varlen_forward_setup_context(ctx, inputs, output):
    query, key, value, cu_seqlens_q, cu_seqlens_k = inputs[:5]
    dropout_seed, alibi_slopes, sinks = inputs[11], inputs[15], inputs[16]
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_seed, alibi_slopes, sinks)
    ctx.attrs = inputs[5:11] + inputs[12:15]


def _varlen_forward_backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, dropout_seed, alibi_slopes, sinks = ctx.saved_tensors
    (max_seqlen_q, max_seqlen_k, dropout_p, is_causal, bottom_right, scale,
     window_left, window_right, softcap) = ctx.attrs
    grad_query, grad_key, grad_value, grad_sinks = torch.ops.attn_ext.varlen_backward(
        grad_out, grad_lse, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        dropout_p, is_causal, bottom_right, scale, dropout_seed, window_left, window_right, softcap, alibi_slopes,
        sinks,
    )
    return (grad_query, grad_key, grad_value) + (None,) * 13 + (_grad_sinks(sinks, grad_sinks),)


torch.library.register_autograd(
    "attn_ext::varlen_forward", _varlen_forward_backward, setup_context=_varlen_forward_setup_context
)


@torch.library.register_fake("attn_ext::varlen_backward")
def _varlen_backward_fake(grad_out, grad_lse, query, key, value, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, is_causal, bottom_right, scale, dropout_seed, window_left=None,
                          window_right=None, softcap=None, alibi_slopes=None, sinks=None):
    grad_sinks = sinks.new_empty(sinks.shape) if sinks is not None else query.new_empty((0,))
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), grad_sinks


# --- functional API ----------------------------------------------------------


def _window_sides(window):
    """window=(left, right) -> (left, right) as the ops take them (None = unbounded)."""
    if window is None:
        return None, None
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        side is None or (isinstance(side, int) and not isinstance(side, bool) and side >= 0) for side in window)
    if not ok:
        raise ValueError(f"window must be None or a pair (left, right) of ints >= 0 or None, got {window!r}")
    return window[0], window[1]


def _softcap(softcap):
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a finite float > 0, got {softcap!r}")
    return float(softcap)


def _per_head(t, name, batch_shape, heads, allow_batch):
    """alibi_slopes / sinks as the ops take them: (H,) or, with allow_batch, (B, H) for the
    flattened batch (the user gives (H,) or (*batch, H))."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or a Tensor, got {type(t).__name__}")
    if allow_batch and t.dim() == len(batch_shape) + 1 and tuple(t.shape) == tuple(batch_shape) + (heads,):
        return t.reshape(-1, heads)
    expected = f"({heads},)" + (f" or {tuple(batch_shape) + (heads,)}" if allow_batch else "")
    if tuple(t.shape) != (heads,):
        raise ValueError(f"{name} must have shape {expected} (one value per query head), got {tuple(t.shape)}")
    return t


def _variant_args(window, softcap, alibi_slopes, sinks, batch_shape, heads):
    """window_left, window_right, softcap, alibi_slopes, sinks, as the ops take them."""
    left, right = _window_sides(window)
    if alibi_slopes is not None and isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dtype != torch.float32:
        raise ValueError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if sinks is not None and isinstance(sinks, torch.Tensor) and not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    return (left, right, _softcap(softcap), _per_head(alibi_slopes, "alibi_slopes", batch_shape, heads, True),
            _per_head(sinks, "sinks", batch_shape, heads, False))


class _Call:
    """A user's call normalised to the operators' arguments: 4-D (B, H, X, D)
    tensors, a mask of at most 4 dims, the causal offset, the scale, a dropout
    seed drawn from torch's generator for the device, and the variants."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                 window=None, softcap=None, alibi_slopes=None, sinks=None):
        if self._plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                       window, softcap, alibi_slopes, sinks):
            return
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
        self.scale = _scale(scale, E)
        self.causal_offset = S - L if causal_alignment == "bottom_right" else 0
        self.dropout_p = float(dropout_p)
        self.is_causal = bool(is_causal)
        self.variants = _variant_args(window, softcap, alibi_slopes, sinks, batch_shape, self.q.shape[1])
        self.dropout_seed = None
        if dropout_p > 0:
            self.dropout_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=query.device)

    def _plain(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
               window, softcap, alibi_slopes, sinks):
        """The common call (_plain_op_args) filling self: True, or False (nothing filled)
        for the general path."""
        args = _plain_op_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                              causal_alignment, window, softcap, alibi_slopes, sinks)
        if args is None:
            return False
        self.has_head_dim = True
        self.query_shape = query.shape
        (self.q, self.k, self.v, self.mask, self.dropout_p, self.is_causal, self.causal_offset, self.scale,
         self.dropout_seed) = args[:9]
        self.variants = _NO_VARIANTS
        return True

    def op_args(self):
        """attn_mask, dropout_p, is_causal, causal_offset, scale, dropout_seed and the
        variants, as the ops take them."""
        return (self.mask, self.dropout_p, self.is_causal, self.causal_offset, self.scale, self.dropout_seed,
                *self.variants)

    def tensors(self):
        """The tensors among the ops' arguments that came from the user (None where absent)."""
        return self.q, self.k, self.v, self.mask, self.variants[3], self.variants[4]

    def unflatten(self, t):
        """(B, H, L, X) -> the user's (N, ..., H, L, X), or (N, L, X) for 3-D inputs; works for lse too."""
        if not self.has_head_dim:
            return t.squeeze(1)
        if len(self.query_shape) == 4:  # already (B, H, L, X): no reshape on the per-call path
            return t
        return t.reshape(*self.query_shape[:-1], *t.shape[3:])


def _plain_op_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                   window, softcap, alibi_slopes, sinks):
    """The ops' arguments for the common call, in few steps (a decoding step's
    Python time is most of its time): 4-D query, key and value of one batch
    size, heads that match (or divide, with enable_gqa), no variant. Returns
    (query, key, value, mask, dropout_p, is_causal, causal_offset, scale,
    dropout_seed, *variants), the tensors as given (4-D in, 4-D out); None,
    with nothing drawn, sends every other call, and every error, through
    _Call's general path and its messages. The shapes are read once, as
    tuples (the three ``dim()`` calls took 0.2 us)."""
    if not (window is None and softcap is None and alibi_slopes is None and sinks is None
            and isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor)):
        return None
    query_shape, key_shape = query.shape, key.shape
    if not (len(query_shape) == 4 and len(key_shape) == 4 and value.dim() == 4):
        return None
    B, Hq, L, E = query_shape
    Bk, Hkv, S, _ = key_shape
    if not (Bk == B and value.shape[0] == B and (Hq == Hkv or (enable_gqa and Hkv > 0 and Hq % Hkv == 0))):
        return None
    if causal_alignment == "top_left":
        causal_offset = 0
    elif causal_alignment == "bottom_right":
        causal_offset = S - L
    else:
        return None
    mask = None if attn_mask is None else sdpa_mask(attn_mask, (B,), Hq, L, S, True)
    scale = _scale(scale, E)
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=query.device)
    return (query, key, value, mask, float(dropout_p), bool(is_causal), causal_offset, scale, seed, *_NO_VARIANTS)


def _split_batch(t, has_head_dim):
    """(N, ..., H, X, D) -> (B, H, X, D); (N, X, D) -> (N, 1, X, D). Also returns the batch shape."""
    if not has_head_dim:
        return t.unsqueeze(1), tuple(t.shape[:1])
    batch = tuple(t.shape[:-3])
    return (t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:])), batch


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, causal_alignment="top_left", return_lse=False, window=None,
                                 softcap=None, alibi_slopes=None, sinks=None):
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
        window: ``(left, right)``: query i sees keys ``i + offset - left`` to
            ``i + offset + right`` (offset 0, or S - L for "bottom_right"); ``None``
            on a side leaves it unbounded. Key blocks outside the window are skipped:
            a sliding window costs O(L * window), not O(L * S). Combines with ``is_causal``.
        softcap: scores become ``softcap * tanh(score / softcap)`` (Gemma 2), before
            the ALiBi bias and the mask.
        alibi_slopes: float32 (Hq,) or (N, ..., Hq): adds ``-slope * |i + offset - j|``
            to the score (no gradient).
        sinks: (Hq,), any float dtype: a logit per head that joins every row's softmax
            denominator and takes no value (gpt-oss); gets a gradient. A row with
            no visible key then gives 0 and lse = sink.

    Shape:
        out: (N, ..., Hq, L, Ev) in the query's dtype.
        lse: (N, ..., Hq, L), float32 (float64 for float64 inputs); -inf for fully masked rows
        (the sink's logit with sinks).

    Returns:
        ``out``, or ``(out, lse)`` when ``return_lse``.

    Example::

        >>> q, k, v = (torch.randn(2, 8, 128, 64, requires_grad=True) for _ in range(3))
        >>> out = attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> out.sum().backward()
    """
    # the common call goes without a _Call (about 1.5 us of a decoding step)
    args = _plain_op_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                          window, softcap, alibi_slopes, sinks)
    if args is not None:  # its tensors: query, key, value and the mask
        out, lse = _run(_forward_op, args[:4], args)
        return (out, lse) if return_lse else out
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                 window, softcap, alibi_slopes, sinks)
    # the tensors among the arguments: query, key, value, mask, alibi_slopes and the sinks as given
    out, lse = _run(_forward_op, (call.q, call.k, call.v, call.mask, call.variants[3], sinks),
                    (call.q, call.k, call.v, *call.op_args()))
    out, lse = call.unflatten(out), call.unflatten(lse)
    return (out, lse) if return_lse else out


def attention_probs(query, key, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                    causal_alignment="top_left", window=None, softcap=None, alibi_slopes=None, sinks=None):
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
        with no visible key are 0. With ``sinks`` a row sums to 1 - p_sink.

    The variants (``window``, ``softcap``, ``alibi_slopes``, ``sinks``) mean what
    they mean for :func:`scaled_dot_product_attention`.

    Example::

        >>> q, k = torch.randn(1, 4, 16, 32), torch.randn(1, 4, 16, 32)
        >>> p = attn_ext.attention_probs(q, k, is_causal=True)
        >>> p.sum(-1)  # all ones
    """
    call = _Call(query, key, None, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                 window, softcap, alibi_slopes, sinks)
    probs, _ = _run(_probs_op, call.tensors(), (call.q, call.k, *call.op_args()))
    return call.unflatten(probs)


def attention_and_probs(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, *, causal_alignment="top_left", window=None, softcap=None,
                        alibi_slopes=None, sinks=None):
    """``(scaled_dot_product_attention(...), attention_probs(...))`` with one dropout draw.

    The output comes from the fused kernel and the probabilities from the
    probabilities kernel, both seeded with the same Philox seed, so the dropped
    probabilities are the ones the output used: ``probs @ value`` equals ``out``.
    For ``MultiHeadAttention(need_weights=True)``. Arguments as for
    :func:`scaled_dot_product_attention`.
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                 window, softcap, alibi_slopes, sinks)
    tensors = call.tensors()
    out, _ = _run(_forward_op, tensors, (call.q, call.k, call.v, *call.op_args()))
    probs, _ = _run(_probs_op, tensors, (call.q, call.k, *call.op_args()))
    return call.unflatten(out), call.unflatten(probs)


def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     dropout_p=0.0, is_causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
                     sinks=None, causal_alignment="top_left", return_lse=False):
    r"""Attention over a packed batch of sequences of different lengths (FlashAttention's varlen layout).

    Sequence b is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and key/value
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``; its queries see only its keys.
    One kernel call runs the whole batch: no padding, no per-sequence loop. The
    result equals :func:`scaled_dot_product_attention` run on each sequence alone
    (with ``enable_gqa``), to rounding.

    Args:
        query: (total_q, Hq, E), any strides.
        key: (total_k, Hkv, E), Hq a multiple of Hkv (grouped-query attention, no copies).
        value: (total_k, Hkv, Ev).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 (B + 1,), non-decreasing from 0
            to total_q / total_k. Empty sequences are allowed. They are read on the
            host (a device-to-host copy on a GPU).
        max_seqlen_q, max_seqlen_k: the longest sequences, if known (checked);
            computed from cu_seqlens when None.
        dropout_p, is_causal, scale, window, softcap, sinks: as for
            :func:`scaled_dot_product_attention`; ``causal_alignment="bottom_right"``
            aligns each sequence's last query with its last key (offset S_b - L_b).
        alibi_slopes: float32 (Hq,) or (B, Hq) (row b for sequence b).
        return_lse: also return the log-sum-exp, (total_q, Hq).

    Returns:
        ``out`` (total_q, Hq, Ev), or ``(out, lse)``.

    Example::

        >>> cu = torch.tensor([0, 5, 12])             # two sequences: 5 and 7 tokens
        >>> q, k, v = (torch.randn(12, 4, 32) for _ in range(3))
        >>> out = attn_ext.varlen_attention(q, k, v, cu, cu, is_causal=True)
    """
    named = [("query", query), ("key", key), ("value", value), ("cu_seqlens_q", cu_seqlens_q),
             ("cu_seqlens_k", cu_seqlens_k)]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    for name, t in named[:3]:
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, dim), got shape {tuple(t.shape)}")
    for name, t in named[3:]:
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor (B + 1,), got {t.dtype} of shape "
                             f"{tuple(t.shape)}")
    if causal_alignment not in _CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {_CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 0
    if max_seqlen_k is None:
        max_seqlen_k = int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max()) if cu_seqlens_k.numel() > 1 else 0
    E = query.shape[-1]
    scale = _scale(scale, E)
    batch = (max(cu_seqlens_q.numel() - 1, 0),)
    variants = _variant_args(window, softcap, alibi_slopes, sinks, batch, query.shape[1])
    dropout_seed = None
    if dropout_p > 0:
        dropout_seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=query.device)
    out, lse = torch.ops.attn_ext.varlen_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), float(dropout_p),
        bool(is_causal), causal_alignment == "bottom_right", scale, dropout_seed, *variants,
    )
    return (out, lse) if return_lse else out
