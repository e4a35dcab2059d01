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
