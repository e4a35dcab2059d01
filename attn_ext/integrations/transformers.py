"""attn_ext as a Hugging Face transformers attention implementation.

    >>> import attn_ext.integrations.transformers as hf
    >>> name = hf.register()                       # "attn_ext"
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    >>> model.set_attn_implementation(name)        # or switch an existing model

``register`` puts two functions into transformers' registries: an attention
function (``AttentionInterface``) that runs every attention layer on
:func:`attn_ext.scaled_dot_product_attention` (or :func:`attn_ext.varlen_attention`
for padding-free packed batches), and a mask function (``AttentionMaskInterface``)
that describes a layer's mask to it as compactly as the kernels can take it.

What a layer's mask becomes:

- causal, sliding-window or bidirectional attention, with or without padding,
  the queries being the last ``q_length`` of the keys (no cache, or transformers'
  dynamic caches): ``None`` or a (B, 1, 1, S) bool key-padding mask. The
  attention function then adds ``is_causal`` (bottom-right aligned, as a cache
  needs), ``window=(w - 1, 0)`` for a transformers ``sliding_window`` of w, and
  the softcap and sinks the model passes. No (B, 1, L, S) tensor is built.
- transformers' static caches (the keys are the whole preallocated cache, past
  the queries): a (B, 1, 1, n) bool mask of the n keys up to the last query (all
  True without padding). The attention function cuts the keys to those n, and
  the pattern is the one above: the kernels never see the empty slots. The
  cache's length comes as a tensor: it is read in eager code only (reading it
  under torch.compile would break the graph). Compiled code takes the general
  path below, where a decoding step's (one query row) causal mask is one bool
  row of the whole cache, the written slots True: the CPU kernels cut the keys
  after the last True themselves, so the empty slots cost nothing there either.
- padding-free packed batches (``position_ids`` restarting at 0, no
  ``attention_mask``, batch 1): ``None``; the attention function finds the
  sequences from ``position_ids`` (as transformers' flash-attention path does)
  and runs :func:`attn_ext.varlen_attention` on them. Not under torch.compile,
  where the sequences' number and lengths cannot steer the traced graph: there
  transformers' packed-sequence mask takes the general path below (and, with a
  cache, where transformers does not look for packing, neither does attn_ext).
- anything else (static caches and packed batches under torch.compile, chunked
  or blockwise masks, custom mask functions): transformers' own (B, 1, L, S) bool
  mask, which the attention function applies as it is; with one query row it
  would read as key padding (below), so there only causal and bidirectional
  patterns stay bool, the others become an additive float mask (0 or -inf).
  A float mask or a bool mask of several rows carries the whole pattern, and so
  does a 4-D mask a user hands the model (transformers passes it on untouched);
  a bool mask of one query row is key padding (the causal pattern adds nothing
  to one row that sees the last key): that is how the attention function tells
  them apart (and one shorter than the keys cuts them, as above).

Grouped-query attention runs on the key/value heads as they come (no
``repeat_kv``); a decoding step (one query) takes a group's query heads as the
rows of one head, so each cached key is read once per group. Dropout applies
in training (the model passes its rate).
Query rows that see no key (padding positions) come out 0, where eager gives an
average of the values: real positions agree, padding positions may not.

Importing attn_ext does not import transformers; importing this module does.
"""

from __future__ import annotations

import torch
import transformers
from transformers import masking_utils

from ..ops import scaled_dot_product_attention, varlen_attention

__all__ = ["register", "attention_forward", "attention_mask"]


# ---------------------------------------------------------------------------
# The mask function
# ---------------------------------------------------------------------------

# The mask functions are read through their code objects and closure cells:
# torch.compile traces those (fullgraph), where it cannot trace
# inspect.getclosurevars, nor reading __qualname__ off a function argument.

def _qualname(fn):
    """``fn``'s qualified name ("" for what is not a Python function)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    return code.co_qualname if hasattr(code, "co_qualname") else fn.__qualname__  # Python 3.10: no co_qualname


def _closure_value(fn, name):
    """The value of the variable ``name`` that ``fn`` closes over, else None."""
    names = fn.__code__.co_freevars
    if fn.__closure__ is None or name not in names:
        return None
    return fn.__closure__[names.index(name)].cell_contents


def _mask_parts(mask_function):
    """The mask functions that and_masks() combined into ``mask_function`` (itself if none),
    seen through the position remapping transformers adds for packed sequences."""
    if mask_function in (masking_utils.causal_mask_function, masking_utils.bidirectional_mask_function):
        return [mask_function]
    name = _qualname(mask_function)
    if name.startswith("and_masks."):
        parts = _closure_value(mask_function, "mask_functions") or ()
        return [leaf for part in parts for leaf in _mask_parts(part)]
    if name.startswith("remap_positions_for_packed_sequence."):
        inner = _closure_value(mask_function, "mask_function")
        if inner is not None:
            return _mask_parts(inner)
    return [mask_function]


def _kind(part):
    """What one mask function is, for the patterns the kernels take by flags."""
    if part is masking_utils.causal_mask_function:
        return "causal"
    if part is masking_utils.bidirectional_mask_function:
        return "bidirectional"
    name = _qualname(part)
    for prefix, kind in (("sliding_window_overlay.", "sliding"), ("sliding_window_bidirectional_overlay.", "sliding"),
                         ("packed_sequence_mask_function.", "packed")):
        if name.startswith(prefix):
            return kind
    return None


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                   mask_function=masking_utils.causal_mask_function, attention_mask=None, dtype=torch.float32,
                   device="cpu", **kwargs):
    """transformers' mask interface for attn_ext: ``None``, a (B, 1, 1, S) bool key-padding
    mask, or a (B, 1, L, S) additive float mask (see the module's docstring)."""
    kinds = [_kind(part) for part in _mask_parts(mask_function)]
    plain = all(k in ("causal", "bidirectional", "sliding") for k in kinds)
    if isinstance(q_offset, torch.Tensor) and q_offset.numel() == 1 and not torch.compiler.is_compiling():
        # A StaticCache's length comes as a tensor (so that compiled code need not
        # read it); in eager it is read once per forward and layer type.
        q_offset = int(q_offset)
    offsets_known = isinstance(q_offset, int) and isinstance(kv_offset, int)
    # Causal and sliding patterns ride on the kernels' bottom-right alignment: the
    # last query must be the last key.
    ordered = "causal" in kinds or "sliding" in kinds
    used = q_offset + q_length - kv_offset if offsets_known else None  # keys up to the last query's
    aligned = not ordered or used == kv_length
    # A static cache: the keys past the last query's position are empty slots that
    # no query sees. A key mask of the used keys only, (B or 1, 1, 1, used), tells the
    # attention function to cut the keys there; the pattern is then aligned again.
    static = ordered and used is not None and 0 < used < kv_length
    if plain and (aligned or static):
        keys = used if static else kv_length
        padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return torch.ones((1, 1, 1, keys), dtype=torch.bool, device=device) if static else None
        padding = padding[:, kv_offset:kv_offset + keys].to(device=device, dtype=torch.bool)
        # An all-True mask changes nothing: dropped when it costs no graph break (a
        # static cache's mask carries the key count, so it stays).
        if not static and not torch.compiler.is_compiling() and bool(padding.all()):
            return None
        return padding[:, None, None, :]
    if ("packed" in kinds and attention_mask is None and batch_size == 1
            and set(kinds) <= {"causal", "sliding", "packed"} and not torch.compiler.is_compiling()):
        # The attention function reads the sequences off position_ids. Not under
        # torch.compile: their number and lengths are data, which the traced graph
        # cannot depend on; the general path below masks them with tensor ops.
        return None
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    full = masking_utils.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                   kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                                   allow_is_causal_skip=False, allow_is_bidirectional_skip=False, device=device,
                                   **kwargs)
    if q_length > 1 or set(kinds) <= {"causal", "bidirectional"}:
        # transformers' bool mask as it is. With one query row and causal or
        # bidirectional layers it is that row's keys, as a key-padding mask says them
        # (a static cache under torch.compile: the written slots, padding included),
        # and the kernels leave out the keys past the last True (the empty slots).
        return full
    # One query row of another pattern (sliding, chunked, custom) would read as key
    # padding, which the attention function adds a bottom-right causal window to.
    additive = torch.zeros(full.shape, dtype=dtype, device=full.device)
    return additive.masked_fill_(~full, float("-inf"))


# ---------------------------------------------------------------------------
# The attention function
# ---------------------------------------------------------------------------

def _packed_sequences(position_ids, batch_size, q_length):
    """cu_seqlens of a padding-free packed batch (batch 1, positions restarting at 0), else None."""
    if position_ids is None or batch_size != 1 or q_length <= 1 or position_ids.shape[-1] != q_length:
        return None
    pos = position_ids.reshape(-1)
    increasing = torch.arange(q_length, device=pos.device) + pos.min()
    if not bool((increasing != pos).any()):
        return None  # one sequence
    starts = torch.nonzero(pos == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([q_length])])


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention interface for attn_ext.

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev); ``attention_mask``
    what :func:`attention_mask` made. Returns ((B, L, Hq, Ev), None): no attention
    weights (``output_attentions`` needs ``attn_implementation="eager"``).
    """
    if kwargs.get("position_bias") is not None:
        raise ValueError("attn_ext: position_bias (T5-style relative attention bias) is not supported; "
                         "use attn_implementation='eager' or 'sdpa' for this model")
    if kwargs.get("output_attentions", False):
        transformers.utils.logging.get_logger(__name__).warning_once(
            "attn_ext does not return attention weights (output_attentions=True); "
            "use attn_implementation='eager' for them")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    B, Hq, L, _ = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    if (attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.shape[-2] == 1
            and 0 < attention_mask.shape[-1] < S):
        # A static cache (see attention_mask): the keys past the mask's length are
        # empty slots no query sees; the kernels never read them.
        S = attention_mask.shape[-1]
        key, value = key[:, :, :S], value[:, :, :S]
    if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape[-2] != 1):
        # A whole mask, causal and window included: transformers' own (float), or a
        # 4-D mask the user gave the model, which transformers passes on as it is.
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(query.dtype)
        out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                           dropout_p=dropout, scale=scaling, enable_gqa=Hq != Hkv,
                                           softcap=softcap, sinks=s_aux)
        return out.transpose(1, 2).contiguous(), None

    window = None
    if sliding_window is not None and (causal or sliding_window < max(L, S)):
        window = (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)
    if L == 1 and Hq > Hkv and window is None and s_aux is None and dropout == 0.0:
        # A decoding step with grouped-query attention: the query heads of a group
        # become the rows of one head (transformers' sdpa path does the same), so each
        # key and value row is read once per group, not once per query head. One
        # query sees every key (bottom-right causal), and the key-padding mask
        # broadcasts over the rows.
        grouped = query.reshape(B, Hkv, Hq // Hkv, query.shape[-1])
        out = scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling,
                                           softcap=softcap)
        return out.reshape(B, Hq, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    cu = None
    if attention_mask is None and L == S and not torch.compiler.is_compiling():
        cu = _packed_sequences(kwargs.get("position_ids"), B, L)
    if cu is not None:
        # (1, H, T, E) -> (T, H, E): one varlen call over the packed sequences.
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        out = varlen_attention(q, k, v, cu, cu, dropout_p=dropout, is_causal=causal, scale=scaling, window=window,
                               softcap=softcap, sinks=s_aux)
        return out.unsqueeze(0).contiguous(), None
    out = scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                       is_causal=causal, scale=scaling, enable_gqa=Hq != Hkv,
                                       causal_alignment="bottom_right", window=window, softcap=softcap, sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "attn_ext") -> str:
    """Registers attn_ext with transformers under ``name`` (attention and mask
    functions) and returns ``name``, for ``attn_implementation=name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"attn_ext: name must be a non-empty string, got {name!r}")
    transformers.AttentionInterface.register(name, attention_forward)
    transformers.AttentionMaskInterface.register(name, attention_mask)
    return name
