"""attn_ext.MultiHeadAttention: torch.nn.MultiheadAttention on attn_ext's kernels.

The module keeps PyTorch's constructor, parameter names, state_dict layout,
forward arguments and return values; the attention itself always runs through
attn_ext's operators (the fused forward/backward, and the probabilities op when
weights are asked for). Extras: grouped-query attention (``num_kv_heads``) and
an incremental-decoding cache (:class:`KVCache`).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .distributed import _check_layout, ring_attention
from .masks import _fmt, mha_mask
from .ops import _window_sides, attention_and_probs, scaled_dot_product_attention, varlen_attention

__all__ = ["KVCache", "MultiHeadAttention", "convert_attention"]


class KVCache:
    r"""The projected keys and values of the tokens seen so far, for incremental decoding.

    Pass one cache per attention layer as ``cache=`` to
    :meth:`MultiHeadAttention.forward`: each call appends the new tokens' keys
    and values and attends to everything cached, with the causal diagonal
    aligned to the end of the keys (``causal_alignment="bottom_right"``), so a
    step's output equals the matching rows of the full causal computation.

    Under ``torch.no_grad()``/``torch.inference_mode()`` the keys and values go
    into buffers that grow by doubling (amortised O(1) copies per token); when
    autograd needs them, each step concatenates instead, so gradients flow
    through every cached step.

    Under ``torch.compile`` the length is a symbolic size (the cache keeps it
    as a tensor's size, the operators take ``causal_offset`` as a SymInt): a
    decoding loop compiles about 5 graphs (the prefill, a step, a step that
    doubles the buffers, each first static), not one per token, and a step
    writes the new token into the buffer in place. ``capacity`` (no doubling)
    and ``torch.compile(..., dynamic=True)`` (no static graphs) make it 2.

    Args:
        capacity: tokens to reserve room for up front (0: grow on demand).

    Example::

        >>> mha = attn_ext.MultiHeadAttention(64, 4, batch_first=True).eval()
        >>> cache = attn_ext.KVCache()
        >>> with torch.no_grad():
        ...     for x in tokens.split(1, dim=1):             # (N, 1, 64) each
        ...         y, _ = mha(x, x, x, need_weights=False, is_causal=True, cache=cache)
    """

    def __init__(self, capacity=0):
        if int(capacity) < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = int(capacity)
        self.reset()

    def reset(self):
        """Forget every cached token (e.g. before a new prompt)."""
        self._key = None    # (N, Hkv, room, D): the keys so far, then free room (no_grad), or exactly them
        self._value = None  # (N, Hkv, room, Dv)
        # The length lives in a tensor's size, not in a Python int: torch.compile
        # specialises integers read from globals and module attributes (a recompile
        # per step) but lets a tensor's changing size become symbolic. One int8
        # element expanded to (len,), stride 0: with views of the buffers instead,
        # inductor's aliasing guards made a decoding loop compile 8 graphs, not 5.
        self._length = None

    def __len__(self):
        return 0 if self._length is None else self._length.shape[0]

    @property
    def key(self):
        """(N, Hkv, len, D): the cached keys (a view), or None when empty."""
        return None if self._key is None else self._key[:, :, : len(self)]

    @property
    def value(self):
        """(N, Hkv, len, Dv): the cached values (a view), or None when empty."""
        return None if self._value is None else self._value[:, :, : len(self)]

    def check(self, key, value):
        """Raise if ``key`` (N, Hkv, n, D) / ``value`` (N, Hkv, n, Dv) cannot extend this cache."""
        if self._key is None:
            return
        for name, new, old in (("key", key, self._key), ("value", value, self._value)):
            if new.shape[0] != old.shape[0]:
                raise ValueError(f"the KVCache holds a batch of {old.shape[0]}, got a batch of {new.shape[0]} "
                                 f"(call cache.reset() before a new batch)")
            if new.shape[1] != old.shape[1] or new.shape[3] != old.shape[3]:
                raise ValueError(f"the KVCache holds {name}s of {old.shape[1]} heads x {old.shape[3]} dims, got "
                                 f"{new.shape[1]} x {new.shape[3]} (one cache per attention layer)")
            if new.dtype != old.dtype or new.device != old.device:
                raise ValueError(f"the KVCache holds {old.dtype} on {old.device}, got {name} {new.dtype} on "
                                 f"{new.device}")

    def append(self, key, value):
        """Append ``key`` (N, Hkv, n, D) and ``value`` (N, Hkv, n, Dv); return all keys and values."""
        self.check(key, value)
        length = len(self)
        end = length + key.shape[2]
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad
                                        or (self._key is not None and self._key.requires_grad)):
            if self._key is None:
                self._key, self._value = key, value
            else:
                self._key = torch.cat([self.key, key], dim=2)
                self._value = torch.cat([self.value, value], dim=2)
        else:
            # One slot always stays free (end < room): the keys are then never the
            # whole buffer, so a compiled step needs no variant for a full one.
            if self._key is None or end >= self._key.shape[2] or self._key.requires_grad:
                room = max(end, 2 * length, self.capacity) + 1
                new_key = key.new_empty(key.shape[0], key.shape[1], room, key.shape[3])
                new_value = value.new_empty(value.shape[0], value.shape[1], room, value.shape[3])
                if length:
                    new_key[:, :, :length].copy_(self.key)
                    new_value[:, :, :length].copy_(self.value)
                self._key, self._value = new_key, new_value
            self._key[:, :, length:end].copy_(key)
            self._value[:, :, length:end].copy_(value)
        self._length = key.new_empty(1, dtype=torch.int8).expand(end)
        return self.key, self.value


def _keep_torch_fast_paths_off(module, args):
    """A no-op forward pre-hook. nn.TransformerEncoderLayer skips its fused
    inference fast path (torch._transformer_encoder_layer_fwd, which would read
    this module's weights and never call it) when any submodule has a hook."""
    return None


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention on attn_ext's kernels; a drop-in for :class:`torch.nn.MultiheadAttention`.

    Same constructor, parameter names and ``state_dict`` layout, same forward
    arguments and return values, same mask conventions as PyTorch's module
    (bool ``True`` = may NOT attend, float = added to the scores; ``attn_mask``
    ``(L, S)`` or ``(N * num_heads, L, S)``; ``key_padding_mask`` ``(N, S)``;
    unbatched 2-D inputs). A ``torch.nn.MultiheadAttention`` state_dict loads
    into it and gives the same outputs, weights and gradients. The attention
    runs through :func:`attn_ext.scaled_dot_product_attention`; with
    ``need_weights=True`` the weights come from attn_ext's probabilities kernel.

    Differences from PyTorch:

    * ``num_kv_heads`` (keyword-only): grouped-query attention; the key and
      value projections have ``num_kv_heads * head_dim`` outputs and each group
      of ``num_heads // num_kv_heads`` query heads shares one key/value head.
      ``in_proj_weight`` is then ``(embed_dim + 2 * kv_dim, embed_dim)``.
    * ``window``, ``softcap``, ``sinks`` (keyword-only): the attention variants of
      :func:`attn_ext.scaled_dot_product_attention` for every call: a sliding
      window ``(left, right)`` (Mistral's window of w tokens with ``is_causal``
      is ``(w - 1, 0)``), a tanh softcap on the scores (Gemma 2), and with
      ``sinks=True`` a learned sink logit per head (gpt-oss), the parameter
      ``sinks`` (num_heads,), initialised to 0.
    * ``context_parallel_group`` / ``context_parallel_layout`` (keyword-only,
      also attributes to set later, or set on a whole model by
      :func:`attn_ext.distributed.enable_context_parallel`): context
      parallelism. Each rank of the process group passes its shard of the
      sequence (cut by :func:`attn_ext.distributed.shard` in the layout
      given, ``"contiguous"`` or ``"zigzag"``) and gets its shard of the
      output; the attention runs through
      :func:`attn_ext.distributed.ring_attention`. Takes no masks but
      ``is_causal``, no weights, no cache, no dropout while training and no
      variants.
    * ``cache`` (keyword-only, forward): a :class:`KVCache` for incremental decoding.
    * ``cu_seqlens`` (keyword-only, forward): packed sequences. query, key and
      value are ``(total, E)`` (``(total, kdim)``, ``(total, vdim)``): sequence b
      is rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` and attends only to itself,
      through :func:`attn_ext.varlen_attention` (no padding). Takes no masks and
      no weights (``need_weights=False``).
    * ``is_causal=True`` without ``attn_mask`` applies the causal mask (PyTorch
      raises). With ``attn_mask`` it is PyTorch's hint that the mask is the
      causal mask: the kernel's causal flag is used instead of reading the
      mask (PyTorch's SDPA path does the same), except with ``add_bias_kv`` /
      ``add_zero_attn``, where the mask is applied as given.
    * A query whose keys are all masked gives 0 and zero gradients (PyTorch: NaN).
    * The module never takes PyTorch's fused inference fast paths
      (``torch._native_multi_head_attention`` /
      ``torch._transformer_encoder_layer_fwd``): it keeps a no-op forward
      pre-hook so that ``nn.TransformerEncoderLayer`` calls it.
      ``nn.TransformerEncoder`` needs ``enable_nested_tensor=False`` (which
      :func:`convert_attention` sets).

    Args:
        embed_dim: total dimension of the model.
        num_heads: number of attention heads; ``embed_dim`` must be divisible by it.
        dropout: dropout probability on the attention weights (in training mode), in [0, 1).
        bias: add biases to the input and output projections.
        add_bias_kv: append a learned key and value (``bias_k``, ``bias_v``) to the keys and values.
        add_zero_attn: append a zero key and value after the projections.
        kdim, vdim: feature sizes of key and value (default ``embed_dim``).
        batch_first: inputs and outputs are ``(N, L, E)`` instead of ``(L, N, E)``.
        num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
        window: ``(left, right)`` keys each query sees around its own position
            (``None`` on a side: unbounded); default no window.
        softcap: scores become ``softcap * tanh(score / softcap)``; default none.
        sinks: learn one sink logit per head (a ``sinks`` parameter).
        context_parallel_group: a ``torch.distributed`` process group (``None``: off)
            whose ranks each hold a shard of every sequence.
        context_parallel_layout: ``"contiguous"`` or ``"zigzag"``: how the sequence is sharded.

    Shape:
        query ``(L, N, E)``, ``(N, L, E)`` with ``batch_first`` or ``(L, E)``;
        key ``(S, N, kdim)`` etc., value ``(S, N, vdim)`` etc.;
        output like query; weights ``(N, L, S)`` averaged over heads, else
        ``(N, num_heads, L, S)`` (without N for unbatched inputs).

    Example::

        >>> mha = attn_ext.MultiHeadAttention(64, 8, batch_first=True)
        >>> mha.load_state_dict(torch.nn.MultiheadAttention(64, 8, batch_first=True).state_dict())
        >>> x = torch.randn(2, 10, 64)
        >>> out, weights = mha(x, x, x)               # (2, 10, 64), (2, 10, 10)
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, num_kv_heads=None,
                 window=None, softcap=None, sinks=False, context_parallel_group=None,
                 context_parallel_layout="contiguous"):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads, got num_heads={num_heads} and "
                             f"num_kv_heads={num_kv_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        _window_sides(window)  # checks it
        _check_layout(context_parallel_layout)
        if window is not None and (add_bias_kv or add_zero_attn):
            raise ValueError(f"window={window!r} cannot be combined with add_bias_kv or add_zero_attn: the "
                             f"appended key sits at the end of the keys, outside most queries' windows")
        if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                    or not 0 < softcap < float("inf")):
            raise ValueError(f"softcap must be None or a finite float > 0, got {softcap!r}")
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        kv_dim = num_kv_heads * self.head_dim

        # The parameters in PyTorch's order (same names, shapes, and draws from the generator).
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((kv_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((kv_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(torch.empty((embed_dim + 2 * kv_dim, embed_dim), **factory_kwargs))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * kv_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory_kwargs)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, kv_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, kv_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.window = None if window is None else tuple(window)
        self.softcap = None if softcap is None else float(softcap)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, **factory_kwargs))
        else:
            self.register_parameter("sinks", None)
        self._reset_parameters()
        self.context_parallel_group = context_parallel_group
        self.context_parallel_layout = context_parallel_layout
        self.register_forward_pre_hook(_keep_torch_fast_paths_off)

    def _reset_parameters(self):
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    @classmethod
    def from_torch(cls, mha):
        """An attn_ext.MultiHeadAttention with ``mha``'s configuration, weights and training mode."""
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"from_torch needs a torch.nn.MultiheadAttention, got {type(mha).__name__}")
        weight = mha.in_proj_weight if mha._qkv_same_embed_dim else mha.q_proj_weight
        new = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
                  add_bias_kv=mha.bias_k is not None, add_zero_attn=mha.add_zero_attn, kdim=mha.kdim,
                  vdim=mha.vdim, batch_first=mha.batch_first, device=weight.device, dtype=weight.dtype)
        new.load_state_dict(mha.state_dict())
        return new.train(mha.training)

    def extra_repr(self):
        kv = f", num_kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        extras = "".join(f", {name}={value!r}" for name, value in
                         (("window", self.window), ("softcap", self.softcap)) if value is not None)
        extras += ", sinks=True" if self.sinks is not None else ""
        if self.context_parallel_group is not None:
            extras += f", context_parallel_layout={self.context_parallel_layout!r}"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}{kv}, dropout={self.dropout}, "
                f"batch_first={self.batch_first}{extras}")

    def _variants(self):
        return dict(window=self.window, softcap=self.softcap, sinks=self.sinks)

    # ------------------------------------------------------------------ forward

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, cache=None, cu_seqlens=None):
        r"""Attention of ``query`` over ``key``/``value``, as :meth:`torch.nn.MultiheadAttention.forward`.

        Args:
            query: ``(L, N, E)``, ``(N, L, E)`` when ``batch_first``, or ``(L, E)`` unbatched.
            key: ``(S, N, kdim)`` / ``(N, S, kdim)`` / ``(S, kdim)``.
            value: ``(S, N, vdim)`` / ``(N, S, vdim)`` / ``(S, vdim)``.
            key_padding_mask: ``(N, S)`` (``(S,)`` unbatched); bool True = padding, or float added.
            need_weights: also return the attention weights (from attn_ext's probabilities kernel).
            attn_mask: ``(L, S)`` or ``(N * num_heads, L, S)``; bool True = masked, or float added.
            average_attn_weights: average the returned weights over heads.
            is_causal: apply the causal mask (see the class docstring).
            cache: a :class:`KVCache`: keys and values are appended to it and
                the queries attend to every cached token (S counts them all in
                the masks' shapes).
            cu_seqlens: int32/int64 ``(B + 1,)``: query, key and value are packed
                ``(total, features)`` sequences (see the class docstring).

        Returns:
            ``(attn_output, attn_weights)``; ``attn_weights`` is None unless ``need_weights``.
        """
        same_qk, same_kv = query is key, key is value
        if self.context_parallel_group is not None:
            self._check_context_parallel(key_padding_mask, need_weights, attn_mask, cache, cu_seqlens)
        if cu_seqlens is not None:
            return self._forward_packed(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal,
                                        cache, cu_seqlens, same_qk, same_kv)
        if any(isinstance(t, torch.Tensor) and t.is_nested for t in (query, key, value)):
            raise ValueError("attn_ext.MultiHeadAttention does not take nested tensors; nn.TransformerEncoder "
                             "makes them in eval mode with a src_key_padding_mask unless it was built with "
                             "enable_nested_tensor=False (attn_ext.convert_attention turns that off)")
        is_batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        N, L, S = query.shape[0], query.shape[1], key.shape[1]

        q, k, v = self._in_projection(query, key, value, same_qk, same_kv)  # (N, L, E), (N, S, kv_dim) x 2
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(N, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.expand(N, 1, -1)], dim=1)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = q.unflatten(-1, (H, D)).transpose(1, 2)    # (N, H, L, D), a view
        k = k.unflatten(-1, (Hkv, D)).transpose(1, 2)  # (N, Hkv, S', D)
        v = v.unflatten(-1, (Hkv, D)).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, Hkv, 1, D)], dim=2)
            v = torch.cat([v, v.new_zeros(N, Hkv, 1, D)], dim=2)
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)

        causal_alignment = "top_left"
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be an attn_ext.KVCache or None, got {type(cache).__name__}")
            if extra:
                raise ValueError("a KVCache cannot be used with add_bias_kv=True or add_zero_attn=True "
                                 "(they would append a key at every step)")
            S += len(cache)
            causal_alignment = "bottom_right"  # the new queries are the last L of S positions
        # is_causal with attn_mask is PyTorch's hint that attn_mask is the causal mask: the
        # kernel's causal flag replaces it (and skips the hidden key tiles), as torch's SDPA
        # path does. Not with appended keys (bias_k, zero key): every query must see those.
        use_causal_flag = bool(is_causal) and (attn_mask is None or extra == 0)
        mask = mha_mask(attn_mask, key_padding_mask, N, H, L, S, extra, query.dtype,
                        attn_mask_is_causal=use_causal_flag)  # validated before the cache changes
        if cache is not None:
            k, v = cache.append(k, v)  # checks batch, heads, dtype first
        dropout_p = self.dropout if self.training else 0.0
        kwargs = dict(attn_mask=mask, dropout_p=dropout_p, is_causal=use_causal_flag, enable_gqa=Hkv != H,
                      causal_alignment=causal_alignment, **self._variants())
        if self.context_parallel_group is not None:
            out, weights = ring_attention(q, k, v, group=self.context_parallel_group, is_causal=bool(is_causal),
                                          enable_gqa=Hkv != H, layout=self.context_parallel_layout), None
        elif need_weights:
            out, weights = attention_and_probs(q, k, v, **kwargs)
        else:
            out, weights = scaled_dot_product_attention(q, k, v, **kwargs), None
        out = F.linear(out.transpose(1, 2).reshape(N, L, self.embed_dim), self.out_proj.weight, self.out_proj.bias)

        if not is_batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if weights is not None:
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                weights = weights.squeeze(0)
        return out, weights

    def _forward_packed(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal, cache,
                        cu_seqlens, same_qk, same_kv):
        """forward() for packed sequences: (total, features) inputs, one varlen_attention call."""
        refused = [name for name, given in (("key_padding_mask", key_padding_mask is not None),
                                            ("attn_mask", attn_mask is not None), ("cache", cache is not None),
                                            ("need_weights", bool(need_weights)))
                   if given]
        if refused:
            raise ValueError(f"cu_seqlens (packed sequences) takes no {', '.join(refused)}: each sequence "
                             f"attends only to itself (pass need_weights=False)")
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError("cu_seqlens (packed sequences) cannot be used with add_bias_kv or add_zero_attn")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                shape = _fmt(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"with cu_seqlens, {name} must be 2-D (total, features), got {shape}")
        q, k, v = self._in_projection(query, key, value, same_qk, same_kv)  # (total, E), (total, kv_dim) x 2
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        out = varlen_attention(q.unflatten(-1, (H, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D)),
                               cu_seqlens, cu_seqlens, dropout_p=self.dropout if self.training else 0.0,
                               is_causal=bool(is_causal), **self._variants())
        return F.linear(out.flatten(-2), self.out_proj.weight, self.out_proj.bias), None

    def _check_context_parallel(self, key_padding_mask=None, need_weights=False, attn_mask=None, cache=None,
                                cu_seqlens=None):
        """What context parallelism cannot take, refused by name."""
        _check_layout(self.context_parallel_layout)
        refused = [name for name, given in (
            ("key_padding_mask", key_padding_mask is not None), ("attn_mask", attn_mask is not None),
            ("need_weights=True", bool(need_weights)), ("cache", cache is not None),
            ("cu_seqlens", cu_seqlens is not None), ("add_bias_kv", self.bias_k is not None),
            ("add_zero_attn", self.add_zero_attn), ("window", self.window is not None),
            ("softcap", self.softcap is not None), ("sinks", self.sinks is not None),
            (f"dropout={self.dropout} in training mode", self.training and self.dropout > 0))
            if given]
        if refused:
            raise ValueError(f"context parallelism (context_parallel_group set) takes no {', '.join(refused)}: "
                             f"only is_causal, without weights (pass need_weights=False)")

    def _in_projection(self, query, key, value, same_qk, same_kv):
        """q (N, L, embed_dim), k (N, S, kv_dim), v (N, S, kv_dim): one matmul for self-attention."""
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        b = self.in_proj_bias
        b_q, b_k, b_v = b.split([E, kv, kv]) if b is not None else (None, None, None)
        if not self._qkv_same_embed_dim:
            return (F.linear(query, self.q_proj_weight, b_q), F.linear(key, self.k_proj_weight, b_k),
                    F.linear(value, self.v_proj_weight, b_v))
        w = self.in_proj_weight
        if same_kv and same_qk:
            return F.linear(query, w, b).split([E, kv, kv], dim=-1)
        w_q, w_k, w_v = w.split([E, kv, kv])
        if same_kv:
            w_kv = w[E:]
            b_kv = b[E:] if b is not None else None
            return (F.linear(query, w_q, b_q), *F.linear(key, w_kv, b_kv).split([kv, kv], dim=-1))
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask):
        """PyTorch's shape rules for this module, with the values in the messages. Returns is_batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be 3-D (batched) or 2-D (unbatched), got shape {_fmt(query.shape)}")
        is_batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"key and value must be {query.dim()}-D like query {_fmt(query.shape)}, got key "
                             f"{_fmt(key.shape)} and value {_fmt(value.shape)}")
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != dim:
                what = "embed_dim" if name == "query" else ("kdim" if name == "key" else "vdim")
                raise ValueError(f"{name}'s last dim must be {what} = {dim}, got {name} {_fmt(t.shape)}")
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise ValueError(f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, "
                             f"{value.dtype}")
        seq = 0 if (not is_batched or not self.batch_first) else 1
        if key.shape[seq] != value.shape[seq]:
            raise ValueError(f"key and value must have the same sequence length, got key {_fmt(key.shape)} and "
                             f"value {_fmt(value.shape)}")
        if is_batched:
            batch = 1 - seq
            if not query.shape[batch] == key.shape[batch] == value.shape[batch]:
                raise ValueError(f"query, key and value must have the same batch size, got {_fmt(query.shape)}, "
                                 f"{_fmt(key.shape)}, {_fmt(value.shape)} (batch_first={self.batch_first})")
        if key_padding_mask is not None and isinstance(key_padding_mask, torch.Tensor):
            want = query.dim() - 1
            if key_padding_mask.dim() != want:
                raise ValueError(f"key_padding_mask must be {want}-D for a {query.dim()}-D query, got shape "
                                 f"{_fmt(key_padding_mask.shape)}")
        if attn_mask is not None and isinstance(attn_mask, torch.Tensor):
            if attn_mask.dim() == 3 and not is_batched and attn_mask.shape[0] != self.num_heads:
                raise ValueError(f"an unbatched 3-D attn_mask must be (num_heads, L, S) with num_heads = "
                                 f"{self.num_heads}, got {_fmt(attn_mask.shape)}")
        return is_batched


def convert_attention(module):
    """Replace every ``torch.nn.MultiheadAttention`` inside ``module`` by an
    :class:`MultiHeadAttention` with the same weights, in place; returns ``module``.

    ``nn.TransformerEncoder``s inside get ``use_nested_tensor = False``: their
    nested-tensor inference path would hand the attention nested tensors.

    Example::

        >>> layer = torch.nn.TransformerEncoderLayer(256, 8, batch_first=True)
        >>> attn_ext.convert_attention(layer)   # layer.self_attn now runs attn_ext's kernels
    """
    if isinstance(module, nn.MultiheadAttention):
        return MultiHeadAttention.from_torch(module)
    if isinstance(module, nn.TransformerEncoder):
        module.use_nested_tensor = False
    for name, child in module.named_children():
        if isinstance(child, nn.MultiheadAttention):
            setattr(module, name, MultiHeadAttention.from_torch(child))
        else:
            convert_attention(child)
    return module
