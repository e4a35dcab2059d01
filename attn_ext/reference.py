"""Plain float64 scaled dot-product attention: the reference every test compares against.

Nothing here is fast or clever on purpose. The full (..., Hq, L, S) score matrix is
built explicitly, in float64, from differentiable ops only (matmul, tanh, where,
masked_fill, cat, logsumexp, exp), so autograd through these functions gives the
reference gradients too (for query, key, value, a float ``attn_mask`` and ``sinks``).

Semantics are those of :func:`torch.nn.functional.scaled_dot_product_attention`, plus
the attn_ext extras:

- ``is_causal`` may be combined with ``attn_mask`` (both apply);
- ``causal_alignment="bottom_right"``: key ``j`` is visible from query ``i`` iff
  ``j <= i + (S - L)`` (FlashAttention's convention); ``"top_left"`` is PyTorch's
  ``j <= i``. The alignment offset (0 or ``S - L``) also places the window and the
  ALiBi distance, whether or not ``is_causal`` is set;
- ``window=(left, right)``: key ``j`` is visible from query ``i`` iff
  ``i + offset - left <= j <= i + offset + right`` (``None`` on a side = unbounded);
  ``is_causal`` is ``right = 0``, and both may be given;
- ``softcap``: the scaled score ``s`` becomes ``softcap * tanh(s / softcap)``;
- ``alibi_slopes`` (Hq,) or (N, Hq) ((N, ..., Hq) for more batch dims):
  ``-slope * |i + offset - j|`` is added to the score; a constant (no gradient);
- ``sinks`` (Hq,): a per-head logit that joins every row's softmax denominator and
  takes no value; the log-sum-exp includes it; differentiable;
- the order is score -> softcap -> + ALiBi -> + attn_mask -> causal / window;
- a row whose keys are all masked gives output 0 and zero gradients, never NaN
  (forward and backward); its log-sum-exp is ``-inf``, or the sink with ``sinks``;
- dropout is applied only through an explicit ``dropout_mask`` (True = kept), so a
  test can reproduce the kernel's random draw;
- :func:`varlen_attention_reference`: packed variable-length batches
  (FlashAttention's varlen layout), one :func:`attention_reference` call per sequence.

For 3-D inputs (N, L, E) there is one head: ``alibi_slopes`` of shape (1,) or (N, 1),
``sinks`` of shape (1,). (The reference also takes sinks per batch entry, shaped like
the slopes; the kernels take (Hq,) only.)
"""

import math
import numbers

import torch

__all__ = ["attention_reference", "attention_probs_reference", "varlen_attention_reference"]

_ALIGNMENTS = ("top_left", "bottom_right")


def _check_alignment(causal_alignment):
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}"
        )


def _alignment_offset(L, S, causal_alignment):
    _check_alignment(causal_alignment)
    return 0 if causal_alignment == "top_left" else S - L


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_window(window):
    """``window`` as a (left, right) tuple of int-or-None, or None; ValueError otherwise."""
    if window is None:
        return None
    ok = (
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(w is None or (_is_int(w) and w >= 0) for w in window)
    )
    if not ok:
        raise ValueError(
            f"window must be None or a pair (left, right) of ints >= 0 or None, got {window!r}"
        )
    return tuple(None if w is None else int(w) for w in window)


def _check_softcap(softcap):
    if softcap is None:
        return None
    if (
        isinstance(softcap, bool)
        or not isinstance(softcap, numbers.Real)
        or not math.isfinite(softcap)
        or softcap <= 0
    ):
        raise ValueError(f"softcap must be a float > 0, got {softcap!r}")
    return float(softcap)


def _visible(L, S, is_causal, window, causal_alignment, device):
    """(L, S) bool, True where key j is visible from query i under the causal rule and
    the window; None when neither applies."""
    offset = _alignment_offset(L, S, causal_alignment)
    if not is_causal and window is None:
        return None
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    i = torch.arange(L, device=device).unsqueeze(-1) + offset
    j = torch.arange(S, device=device).unsqueeze(0)
    visible = torch.ones(L, S, dtype=torch.bool, device=device)
    if left is not None:
        visible &= j >= i - left
    if right is not None:
        visible &= j <= i + right
    return visible


def _per_head(t, name, query):
    """A per-head tensor (``alibi_slopes`` or ``sinks``) in float64, shaped to
    broadcast against the (..., L, S) scores.

    Accepted shapes: (H,) or (N, ..., H), the query's batch dims then H; H = Hq, or
    1 for 3-D inputs (N, L, E)."""
    if not torch.is_tensor(t) or not t.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point Tensor, got "
            f"{t.dtype if torch.is_tensor(t) else type(t).__name__}"
        )
    three_d = query.dim() == 3
    batch = tuple(query.shape[:1]) if three_d else tuple(query.shape[:-3])
    H = 1 if three_d else query.size(-3)
    allowed = [(H,), batch + (H,)]
    if tuple(t.shape) not in allowed:
        raise ValueError(
            f"{name} must have shape {' or '.join(str(s) for s in allowed)}, got {tuple(t.shape)}"
        )
    v = t.to(torch.float64)
    if three_d:  # the scores have no head dim: drop the size-1 one
        v = v.squeeze(-1)
    return v.unsqueeze(-1).unsqueeze(-1)


def _expand_kv_heads(query, key, value, enable_gqa):
    """Repeat key/value heads (dim -3) so query head h reads kv head h // (Hq // Hkv)."""
    if not enable_gqa or query.dim() < 3:
        return key, value
    hq, hkv = query.size(-3), key.size(-3)
    if hq == hkv:
        return key, value
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"enable_gqa=True needs the query heads to be a multiple of the key heads, "
            f"got Hq={hq} and Hkv={hkv}"
        )
    groups = hq // hkv
    return (
        key.repeat_interleave(groups, dim=-3),
        value.repeat_interleave(groups, dim=-3),
    )


def _masked_scores(query, key, attn_mask, is_causal, scale, causal_alignment,
                   window=None, softcap=None, alibi_slopes=None):
    """float64 scaled scores with every variant and mask applied, and the (…, L, S)
    visibility.

    Order: score -> softcap -> + ALiBi -> + attn_mask -> causal / window. Returns
    ``(scores, visible)``: ``scores`` has ``-inf`` where a key is masked (bool mask
    False, causal, window, or a float mask of -inf), ``visible`` is ``scores > -inf``.
    """
    L, S, E = query.size(-2), key.size(-2), query.size(-1)
    window = _check_window(window)
    softcap = _check_softcap(softcap)
    offset = _alignment_offset(L, S, causal_alignment)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = _per_head(alibi_slopes, "alibi_slopes", query).detach()  # a constant
        i = torch.arange(L, device=query.device, dtype=torch.float64).unsqueeze(-1) + offset
        j = torch.arange(S, device=query.device, dtype=torch.float64).unsqueeze(0)
        scores = scores - slopes * (i - j).abs()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask.is_floating_point():
            scores = scores + attn_mask.to(torch.float64)
        else:
            raise ValueError(
                f"attn_mask must be bool or floating point, got dtype {attn_mask.dtype}"
            )
    visible = _visible(L, S, is_causal, window, causal_alignment, query.device)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores, scores > float("-inf")


def _probs_and_lse(scores, visible):
    """NaN-free softmax over keys; rows without any visible key give probs 0, lse -inf."""
    row_has_key = visible.any(dim=-1, keepdim=True)  # (..., L, 1)
    # Rows with no key get finite stand-in scores, so logsumexp and exp (and their
    # backward) never see -inf - (-inf); the torch.where below zeroes those rows and
    # sends them zero gradient.
    safe_scores = torch.where(row_has_key, scores, torch.zeros_like(scores))
    # The row max first, then exp and the sum: exp(s - lse) would lose the sum where
    # lse is too large for log(sum) to change it (a float mask of finfo.min on every
    # key: such a row averages its keys). Both results are independent of the max,
    # so it takes no gradient.
    row_max = (safe_scores.detach().amax(dim=-1, keepdim=True) if scores.size(-1) > 0
               else safe_scores.new_zeros(scores.shape[:-1] + (1,)))  # no key at all
    weights = torch.exp(safe_scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    safe_lse = row_max + torch.log(total)
    probs = torch.where(row_has_key, weights / total, torch.zeros_like(scores))
    lse = torch.where(
        row_has_key, safe_lse, torch.full_like(safe_lse, float("-inf"))
    ).squeeze(-1)
    return probs, lse


def _probs_and_lse_with_sinks(scores, visible, sinks, query):
    """Softmax over the keys and one more column holding the head's sink logit.

    The sink column takes part in the log-sum-exp (so in every probability) and is
    then dropped: rows sum to 1 - p_sink, a row without keys has probs 0 and
    lse = sink, and autograd carries the sink's gradient."""
    if sinks is None:
        return _probs_and_lse(scores, visible)
    sink = _per_head(sinks, "sinks", query)  # (..., 1, 1), float64, differentiable
    sink_col = sink.expand(scores.shape[:-1] + (1,))
    full = torch.cat([scores, sink_col], dim=-1)
    full_visible = torch.cat([visible, sink_col > float("-inf")], dim=-1)
    probs, lse = _probs_and_lse(full, full_visible)
    return probs[..., :-1], lse


def _to64(t):
    return None if t is None else t.to(torch.float64)


def attention_probs_reference(
    query,
    key,
    attn_mask=None,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    causal_alignment="top_left",
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
):
    """The (..., Hq, L, S) attention probabilities, in float64 (no dropout).

    Rows sum to 1 (to 1 - p_sink with ``sinks``); rows whose keys are all masked are 0.
    Arguments as for :func:`attention_reference`.
    """
    q = query.to(torch.float64)
    k = key.to(torch.float64)
    k, _ = _expand_kv_heads(q, k, k, enable_gqa)
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else _to64(attn_mask)
    scores, visible = _masked_scores(q, k, mask, is_causal, scale, causal_alignment,
                                     window, softcap, alibi_slopes)
    probs, _ = _probs_and_lse_with_sinks(scores, visible, sinks, q)
    return probs


def attention_reference(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    causal_alignment="top_left",
    dropout_mask=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
):
    """Scaled dot-product attention in float64; returns ``(out, lse)``.

    Args:
        query: (N, ..., Hq, L, E) or (N, L, E).
        key: (N, ..., Hkv, S, E).
        value: (N, ..., Hkv, S, Ev).
        attn_mask: bool (True = may attend) or additive float, broadcastable to
            (N, ..., Hq, L, S).
        dropout_p: dropout probability; when > 0, ``dropout_mask`` must be given.
        is_causal: apply the causal rule (together with ``attn_mask`` if both given).
        scale: defaults to 1/sqrt(E).
        enable_gqa: query head h uses key/value head h // (Hq // Hkv).
        causal_alignment: "top_left" (offset 0) or "bottom_right" (offset S - L): the
            causal rule is j <= i + offset; the offset also places the window and the
            ALiBi distance.
        dropout_mask: bool, broadcastable to (N, ..., Hq, L, S), True = kept; kept
            probabilities are scaled by 1 / (1 - dropout_p).
        window: None or (left, right), ints >= 0 or None (unbounded): key j is
            visible from query i iff i + offset - left <= j <= i + offset + right.
        softcap: None or a float > 0: scores s become softcap * tanh(s / softcap).
        alibi_slopes: None or (Hq,) or (N, ..., Hq) (the batch dims; for 3-D inputs
            (1,) or (N, 1)): adds -slope * |i + offset - j| after the softcap. No
            gradient.
        sinks: None or (Hq,) (for 3-D inputs (1,)): a per-head logit in every
            row's softmax denominator, without a value. Differentiable.

    Returns:
        out: (N, ..., Hq, L, Ev) float64.
        lse: (N, ..., Hq, L) float64, log-sum-exp over keys (and the sink) of the
            masked scores (before dropout); -inf for rows with no visible key and no
            sink, the sink for rows with no visible key.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and dropout_mask is None:
        raise ValueError(
            "attention_reference needs an explicit dropout_mask when dropout_p > 0 "
            f"(got dropout_p={dropout_p})"
        )
    q = query.to(torch.float64)
    k = key.to(torch.float64)
    v = value.to(torch.float64)
    k, v = _expand_kv_heads(q, k, v, enable_gqa)
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else _to64(attn_mask)
    scores, visible = _masked_scores(q, k, mask, is_causal, scale, causal_alignment,
                                     window, softcap, alibi_slopes)
    probs, lse = _probs_and_lse_with_sinks(scores, visible, sinks, q)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(torch.float64) / (1.0 - dropout_p)
    out = torch.matmul(probs, v)
    return out, lse


def _check_cu_seqlens(name, cu, total):
    """The boundaries of ``cu`` as a Python list, after checking it."""
    if not torch.is_tensor(cu) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
        raise ValueError(
            f"{name} must be a 1-D int32 or int64 tensor of shape (B + 1,), got "
            + (f"dtype {cu.dtype} and shape {tuple(cu.shape)}" if torch.is_tensor(cu)
               else type(cu).__name__)
        )
    bounds = cu.tolist()
    if (
        len(bounds) < 1
        or bounds[0] != 0
        or bounds[-1] != total
        or any(b < a for a, b in zip(bounds, bounds[1:]))
    ):
        raise ValueError(
            f"{name} must start at 0, be non-decreasing and end at the total length "
            f"{total}, got {cu}"
        )
    return bounds


def varlen_attention_reference(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    is_causal=False,
    scale=None,
    window=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    causal_alignment="top_left",
    dropout_p=0.0,
    dropout_mask=None,
):
    """Attention over a packed batch of variable-length sequences, in float64.

    Sequence b is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``query`` and
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``key`` / ``value``; its
    queries see only its keys. Each sequence goes through
    :func:`attention_reference` (with ``enable_gqa=True``) on its own, so the
    alignment offset is S_b - L_b for ``"bottom_right"``.

    Args:
        query: (total_q, Hq, E).
        key: (total_k, Hkv, E), Hq a multiple of Hkv.
        value: (total_k, Hkv, Ev).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 (B + 1,), non-decreasing from 0
            to total_q / total_k.
        alibi_slopes: None, (Hq,) or (B, Hq) (row b for sequence b).
        sinks: None or (Hq,).
        dropout_mask: bool (total_q, Hq, total_k), True = kept; sequence b uses its
            block ``[q_b0:q_b1, :, k_b0:k_b1]``.
        The other arguments as for :func:`attention_reference`.

    Returns:
        out: (total_q, Hq, Ev) float64.
        lse: (total_q, Hq) float64.
    """
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(
            f"query, key and value must be 3-D (total, H, E), got {tuple(query.shape)}, "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    total_q, Hq, _ = query.shape
    total_k, Hkv, _ = key.shape
    qb = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q)
    kb = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k)
    if len(qb) != len(kb):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (B + 1), got "
            f"{len(qb)} and {len(kb)}"
        )
    B = len(qb) - 1
    if alibi_slopes is not None and alibi_slopes.dim() == 2:
        if tuple(alibi_slopes.shape) != (B, Hq):
            raise ValueError(
                f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), got "
                f"{tuple(alibi_slopes.shape)}"
            )
    if dropout_mask is not None and tuple(dropout_mask.shape) != (total_q, Hq, total_k):
        raise ValueError(
            f"dropout_mask must have shape {(total_q, Hq, total_k)}, got {tuple(dropout_mask.shape)}"
        )
    outs, lses = [], []
    for b in range(B):
        q0, q1, k0, k1 = qb[b], qb[b + 1], kb[b], kb[b + 1]
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, Hq, L_b, E)
        k = key[k0:k1].transpose(0, 1).unsqueeze(0)  # (1, Hkv, S_b, E)
        v = value[k0:k1].transpose(0, 1).unsqueeze(0)  # (1, Hkv, S_b, Ev)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        keep = None
        if dropout_mask is not None:
            keep = dropout_mask[q0:q1, :, k0:k1].transpose(0, 1).unsqueeze(0)
        out, lse = attention_reference(
            q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=True,
            causal_alignment=causal_alignment, dropout_mask=keep, window=window,
            softcap=softcap, alibi_slopes=slopes, sinks=sinks,
        )
        outs.append(out[0].transpose(0, 1))  # (L_b, Hq, Ev)
        lses.append(lse[0].transpose(0, 1))  # (L_b, Hq)
    if not outs:
        Ev = value.size(-1)
        return (query.new_zeros((0, Hq, Ev), dtype=torch.float64),
                query.new_zeros((0, Hq), dtype=torch.float64))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=0)
