"""Plain float64 scaled dot-product attention: the reference every test compares against.

Nothing here is fast or clever on purpose. The full (..., Hq, L, S) score matrix is
built explicitly, in float64, from differentiable ops only (matmul, where,
masked_fill, logsumexp, exp), so autograd through these functions gives the reference
gradients too.

Semantics are those of :func:`torch.nn.functional.scaled_dot_product_attention`, plus
the attn_ext extras:

- ``is_causal`` may be combined with ``attn_mask`` (both apply);
- ``causal_alignment="bottom_right"``: key ``j`` is visible from query ``i`` iff
  ``j <= i + (S - L)`` (FlashAttention's convention); ``"top_left"`` is PyTorch's
  ``j <= i``;
- a row whose keys are all masked gives output 0, log-sum-exp ``-inf`` and zero
  gradients, never NaN (forward and backward);
- dropout is applied only through an explicit ``dropout_mask`` (True = kept), so a
  test can reproduce the kernel's random draw.
"""

import math

import torch

__all__ = ["attention_reference", "attention_probs_reference"]

_ALIGNMENTS = ("top_left", "bottom_right")


def _causal_visible(L, S, causal_alignment, device):
    """(L, S) bool: True where key j is visible from query i under the causal rule."""
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}"
        )
    offset = 0 if causal_alignment == "top_left" else S - L
    i = torch.arange(L, device=device).unsqueeze(-1)
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i + offset


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


def _masked_scores(query, key, attn_mask, is_causal, scale, causal_alignment):
    """float64 scaled scores with every mask applied, and the (…, L, S) visibility.

    Returns ``(scores, visible)``: ``scores`` has ``-inf`` where a key is masked
    (bool mask False, causal, or a float mask of -inf), ``visible`` is
    ``scores > -inf``.
    """
    L, S, E = query.size(-2), key.size(-2), query.size(-1)
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        elif attn_mask.is_floating_point():
            scores = scores + attn_mask.to(torch.float64)
        else:
            raise ValueError(
                f"attn_mask must be bool or floating point, got dtype {attn_mask.dtype}"
            )
    if is_causal:
        visible = _causal_visible(L, S, causal_alignment, query.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    elif causal_alignment not in _ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}"
        )
    return scores, scores > float("-inf")


def _probs_and_lse(scores, visible):
    """NaN-free softmax over keys; rows without any visible key give probs 0, lse -inf."""
    row_has_key = visible.any(dim=-1, keepdim=True)  # (..., L, 1)
    # Rows with no key get finite stand-in scores, so logsumexp and exp (and their
    # backward) never see -inf - (-inf); the torch.where below zeroes those rows and
    # sends them zero gradient.
    safe_scores = torch.where(row_has_key, scores, torch.zeros_like(scores))
    safe_lse = torch.logsumexp(safe_scores, dim=-1, keepdim=True)
    probs = torch.where(
        row_has_key, torch.exp(safe_scores - safe_lse), torch.zeros_like(scores)
    )
    lse = torch.where(
        row_has_key, safe_lse, torch.full_like(safe_lse, float("-inf"))
    ).squeeze(-1)
    return probs, lse


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
):
    """The (..., Hq, L, S) attention probabilities, in float64 (no dropout).

    Rows whose keys are all masked are 0.
    """
    q = query.to(torch.float64)
    k = key.to(torch.float64)
    k, _ = _expand_kv_heads(q, k, k, enable_gqa)
    mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else _to64(attn_mask)
    scores, visible = _masked_scores(q, k, mask, is_causal, scale, causal_alignment)
    probs, _ = _probs_and_lse(scores, visible)
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
        causal_alignment: "top_left" (j <= i) or "bottom_right" (j <= i + S - L).
        dropout_mask: bool, broadcastable to (N, ..., Hq, L, S), True = kept; kept
            probabilities are scaled by 1 / (1 - dropout_p).

    Returns:
        out: (N, ..., Hq, L, Ev) float64.
        lse: (N, ..., Hq, L) float64, log-sum-exp over keys of the masked scaled
            scores (before dropout); -inf for rows with no visible key.
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
    scores, visible = _masked_scores(q, k, mask, is_causal, scale, causal_alignment)
    probs, lse = _probs_and_lse(scores, visible)
    if dropout_mask is not None:
        probs = probs * dropout_mask.to(torch.float64) / (1.0 - dropout_p)
    out = torch.matmul(probs, v)
    return out, lse
