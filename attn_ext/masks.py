"""Turning users' attention masks into what the kernels take.

The kernels take one mask of at most 4 dims that broadcasts to (B, H, L, S):
bool (True = may attend) or additive float of the query's dtype, read through
its strides. This module maps the user-facing conventions onto that, without
copying the mask wherever a view suffices.
"""

import torch


def _fmt(shape):
    return "(" + ", ".join(str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def sdpa_mask(attn_mask, batch_shape, num_heads, L, S, has_head_dim):
    """The kernel's mask for an ``attn_mask`` of scaled_dot_product_attention.

    Args:
        attn_mask: None, or a bool / float tensor broadcastable to
            ``(*batch_shape, num_heads, L, S)`` (to ``(*batch_shape, L, S)`` for
            3-D inputs, which have no head dim).
        batch_shape: the query's batch dims.
        has_head_dim: False for 3-D (N, L, E) inputs.

    Returns:
        None, or a view of ``attn_mask`` with at most 4 dims that broadcasts to
        ``(prod(batch_shape), num_heads, L, S)``; a copy only when several batch
        dims cannot be merged by a view.
    """
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a Tensor or None, got {type(attn_mask).__name__}")
    full = (*batch_shape, num_heads, L, S) if has_head_dim else (*batch_shape, L, S)
    shape = attn_mask.shape
    if has_head_dim and len(batch_shape) == 1 and len(shape) <= 4:
        # the common case, checked by hand: torch.broadcast_shapes costs ~10 us,
        # most of a decoding step's Python time
        if all(have == 1 or have == want for have, want in zip(reversed(shape), reversed(full))):
            return attn_mask
    try:
        fits = torch.broadcast_shapes(tuple(attn_mask.shape), full) == torch.Size(full)
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(f"attn_mask must broadcast to {_fmt(full)}, got {_fmt(tuple(attn_mask.shape))}")
    mask = attn_mask
    if not has_head_dim:
        return mask.unsqueeze(-3) if mask.dim() == 3 else mask
    if mask.dim() <= 4 and len(batch_shape) == 1:
        return mask
    if mask.dim() <= 3:
        return mask  # the batch dims are all broadcast
    # Several batch dims: merge them (a view when the mask's strides allow).
    tail = tuple(mask.shape[-3:])
    mask = mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))
    return mask.expand(*batch_shape, *tail).reshape(-1, *tail)


def _check_mask_dtype(mask, name):
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")


def _additive(mask, dtype):
    """A float additive mask in ``dtype``: bool True (= masked, nn.MultiheadAttention's polarity) -> -inf."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def mha_mask(attn_mask, key_padding_mask, batch, num_heads, L, S, extra_keys, dtype, attn_mask_is_causal=False):
    """The kernel's mask for ``torch.nn.MultiheadAttention``'s mask conventions.

    nn.MultiheadAttention's masks say what may NOT be attended: a bool True
    masks a position out, a float is added to the scores. This turns its two
    masks into the one mask the kernels take (bool True = may attend, or
    additive float), as a view where a view suffices.

    Args:
        attn_mask: None, ``(L, S)`` or ``(batch * num_heads, L, S)``; bool or float.
        key_padding_mask: None or ``(batch, S)``; bool (True = padding) or float.
        batch, num_heads, L, S: the problem (S counts the keys the caller projected).
        extra_keys: keys appended after those S (``bias_k``, the zero key of
            ``add_zero_attn``): every query sees them, as in PyTorch.
        dtype: the query's dtype; float masks are cast to it.
        attn_mask_is_causal: PyTorch's ``is_causal`` hint: ``attn_mask`` is
            checked but left out, the kernel's causal flag stands for it.

    Returns:
        None, or a mask broadcastable to ``(batch, num_heads, L, S + extra_keys)``:
        bool (True = may attend) when both masks are bool or only one is given
        as bool, else the sum of both as additive float in ``dtype``.
    """
    parts = []
    if attn_mask is not None:
        _check_mask_dtype(attn_mask, "attn_mask")
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (L, S):
                raise RuntimeError(f"the 2-D attn_mask must have shape {_fmt((L, S))}, got {_fmt(tuple(attn_mask.shape))}")
            attn_parts = [attn_mask]
        elif attn_mask.dim() == 3:
            want = (batch * num_heads, L, S)
            if tuple(attn_mask.shape) != want:
                raise RuntimeError(
                    f"the 3-D attn_mask must have shape (batch * num_heads, L, S) = {_fmt(want)}, "
                    f"got {_fmt(tuple(attn_mask.shape))}"
                )
            attn_parts = [attn_mask.reshape(batch, num_heads, L, S)]
        else:
            raise RuntimeError(f"attn_mask must be 2-D (L, S) or 3-D (batch * num_heads, L, S), "
                               f"got shape {_fmt(tuple(attn_mask.shape))}")
        if not attn_mask_is_causal:
            parts += attn_parts
    if key_padding_mask is not None:
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        if tuple(key_padding_mask.shape) != (batch, S):
            raise RuntimeError(f"key_padding_mask must have shape (batch, S) = {_fmt((batch, S))}, "
                               f"got {_fmt(tuple(key_padding_mask.shape))}")
        parts.append(key_padding_mask.reshape(batch, 1, 1, S))
    if not parts:
        return None
    if all(p.dtype == torch.bool for p in parts):
        mask = ~parts[0] if len(parts) == 1 else ~parts[0] & ~parts[1]
        pad = torch.ones if extra_keys else None
    else:
        mask = _additive(parts[0], dtype)
        if len(parts) == 2:
            mask = mask + _additive(parts[1], dtype)
        pad = torch.zeros if extra_keys else None
    if pad is not None:
        mask = torch.cat([mask, pad(*mask.shape[:-1], extra_keys, dtype=mask.dtype, device=mask.device)], dim=-1)
    return mask
