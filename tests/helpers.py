"""Shared test helpers: inputs, the error measure, the tolerance rule, torch baselines.

Tolerance rule (flash-attention's): for every case, measure PyTorch's own error at the
dtype under test against the float64 reference (``attn_ext/reference.py``) and require
attn_ext's error to be at most ``ERR_FACTOR`` times that plus a small per-dtype floor.
Errors are relative Frobenius norms: ``||got - ref|| / ||ref||``.
"""

import importlib.util
import math
import pathlib
import platform
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

try:
    from attn_ext.reference import (attention_probs_reference, attention_reference,
                                    varlen_attention_reference)
except Exception:  # attn_ext/__init__.py loads the compiled library; the reference needs none
    _spec = importlib.util.spec_from_file_location(
        "_attn_ext_reference",
        pathlib.Path(__file__).resolve().parent.parent / "attn_ext" / "reference.py",
    )
    _reference = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_reference)
    attention_reference = _reference.attention_reference
    attention_probs_reference = _reference.attention_probs_reference
    varlen_attention_reference = _reference.varlen_attention_reference


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.bfloat16, torch.float16]

# attn_ext's error may be at most ERR_FACTOR x PyTorch's error at the same dtype ...
ERR_FACTOR = 2.0
# ... plus this floor. The floor only matters where PyTorch happens to be (nearly)
# exact, e.g. S = 1 (softmax is exactly 1, torch just copies a row of V) or a sum that
# rounds luckily: then 2 x torch's error is ~0, and any legitimate re-association
# (exp(s - lse) computed as 1 - ulp, a different summation order) would fail. Each
# floor is a few units of roundoff of the accumulation type, far below a real bug:
FLOOR = {
    torch.float64: 1e-12,  # fp64 roundoff 1.1e-16, x ~1e4 for sums over S <= 129
    torch.float32: 1e-6,   # fp32 roundoff 6e-8, x ~16
    torch.bfloat16: 1e-3,  # output is rounded to bf16 (roundoff 3.9e-3 / 2); a fraction of it
    torch.float16: 1e-3,   # output is rounded to fp16 (roundoff 4.9e-4); about two of it
}


def lse_dtype(dtype):
    """The dtype attn_ext returns the log-sum-exp in (the accumulation type): the
    rule of attn_ext.ops (its fake kernels), which the tests hold the kernels to."""
    return attn_ext_module().ops._lse_dtype(dtype)


# --------------------------------------------------------------------------- attn_ext


def attn_ext_module():
    """Import attn_ext lazily so test modules collect even before the build; a missing
    build then fails the tests loudly instead of skipping them."""
    import attn_ext

    return attn_ext


def sdpa(*args, **kwargs):
    return attn_ext_module().scaled_dot_product_attention(*args, **kwargs)


def attn_ops():
    attn_ext_module()
    return torch.ops.attn_ext


def op_args(op, **values):
    """Positional arguments for the operator overload ``op``, by the names in its schema:
    ``values[name]``, else the schema's default, else None for an optional argument.

    Tests name what they pass, so an optional argument added to a schema later does
    not shift the others; a required argument the test does not give, or a value the
    schema has no argument for, fails with the schema in the message."""
    args = []
    for a in op._schema.arguments:
        if a.name in values:
            args.append(values.pop(a.name))
        elif a.has_default_value():
            args.append(a.default_value)
        elif isinstance(a.type, torch._C.OptionalType):
            args.append(None)
        else:
            raise AssertionError(f"the test gives no value for {a.name!r} of {op._schema}")
    if values:
        raise AssertionError(f"{op._schema} has no argument(s) {sorted(values)}")
    return tuple(args)


# --------------------------------------------------------------------------- inputs


def make_generator(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, device, gen, layout="contiguous", requires_grad=False, std=1.0):
    """Standard-normal tensor of ``shape`` (drawn in float32 on the CPU, then cast).

    layout:
      "contiguous"   plain tensor;
      "transposed"   a (N, L, H, E)-born tensor seen as (N, H, L, E) through
                     transpose(-3, -2) (the batch_first layout, needs >= 3 dims);
      "strided_last" every other element of a last dim twice as long (stride 2).
    """
    shape = tuple(shape)
    if layout == "contiguous":
        t = torch.randn(shape, generator=gen) * std
        t = t.to(device=device, dtype=dtype)
    elif layout == "transposed":
        assert len(shape) >= 3
        born = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        t = (torch.randn(born, generator=gen) * std).to(device=device, dtype=dtype)
        t = t.transpose(-3, -2)
    elif layout == "strided_last":
        born = shape[:-1] + (2 * shape[-1],)
        t = (torch.randn(born, generator=gen) * std).to(device=device, dtype=dtype)
        t = t[..., ::2]
    else:
        raise ValueError(layout)
    assert t.shape == shape
    if requires_grad:
        t.requires_grad_(True)
    return t


def make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, device, seed, layout="contiguous",
             requires_grad=False, batch=None):
    """query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev).

    ``batch`` replaces the leading (B,) by any tuple of batch dims (e.g. (N1, N2)).
    Inputs are drawn with std 1 (scores of std ~1 after the 1/sqrt(E) scale)."""
    gen = make_generator(seed)
    lead = (B,) if batch is None else tuple(batch)
    q = randn(lead + (Hq, L, E), dtype, device, gen, layout, requires_grad)
    k = randn(lead + (Hkv, S, E), dtype, device, gen, layout, requires_grad)
    v = randn(lead + (Hkv, S, Ev), dtype, device, gen, layout, requires_grad)
    return q, k, v


def make_mask(kind, shape, dtype, device, seed, requires_grad=False, keep_prob=0.7):
    """An attention mask of ``shape``.

    kind: "bool" (True with probability keep_prob), "float" (N(0, 1) additive bias,
    in ``dtype``), "float_neg_inf" (like "float" with ~25% of the entries -inf).
    """
    gen = make_generator(seed)
    if kind == "bool":
        m = (torch.rand(shape, generator=gen) < keep_prob).to(device)
    elif kind == "float":
        m = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    elif kind == "float_neg_inf":
        m = torch.randn(shape, generator=gen)
        m = m.masked_fill(torch.rand(shape, generator=gen) < 0.25, float("-inf"))
        m = m.to(device=device, dtype=dtype)
    else:
        raise ValueError(kind)
    if requires_grad:
        assert m.is_floating_point()
        m.requires_grad_(True)
    return m


def leaf64(t):
    """A float64 leaf copy of ``t`` (same values), requiring grad if ``t`` does."""
    if t is None:
        return None
    c = t.detach().to(torch.float64) if t.is_floating_point() else t.detach()
    if t.requires_grad:
        c.requires_grad_(True)
    return c


def low_precision_leaf(t):
    """A detached copy of ``t`` (same dtype and values) as a new leaf, so a second
    implementation (torch SDPA) gets its own gradients."""
    if t is None:
        return None
    c = t.detach().clone()
    if t.requires_grad:
        c.requires_grad_(True)
    return c


# --------------------------------------------------------------------------- errors


def _comparable(got, ref):
    """(got, ref) in float64 with the -inf entries both have (log-sum-exp of fully masked
    rows) set to 0; 0.0 when empty; inf for a NaN or an infinity in one but not the other."""
    got = got.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if got.numel() == 0:
        return 0.0
    both_neg_inf = torch.isneginf(got) & torch.isneginf(ref)
    got = torch.where(both_neg_inf, torch.zeros_like(got), got)
    ref = torch.where(both_neg_inf, torch.zeros_like(ref), ref)
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return math.inf
    return got, ref


def rel_err(got, ref):
    """||got - ref|| / ||ref|| in float64; the absolute error if ref is all zero.

    -inf entries (log-sum-exp of fully masked rows) must coincide and are left out."""
    pair = _comparable(got, ref)
    if not isinstance(pair, tuple):
        return pair
    got, ref = pair
    diff = (got - ref).norm().item()
    denom = ref.norm().item()
    return diff / denom if denom > 0 else diff


def assert_no_nan(t, name):
    assert not torch.isnan(t).any(), f"{name} contains NaN"


# The maximum absolute error is one extreme sample where the Frobenius norm averages,
# so it moves more between two correct implementations; its factor is looser. A wrong
# row or column (the bug the norm can hide) is off by O(max |ref|), far above either.
MAX_ERR_FACTOR = 4.0


def max_abs_err(got, ref):
    """max |got - ref| / max |ref| in float64 (the absolute max if ref is all zero);
    -inf entries must coincide and are left out, as in :func:`rel_err`."""
    pair = _comparable(got, ref)
    if not isinstance(pair, tuple):
        return pair
    got, ref = pair
    diff = (got - ref).abs().max().item()
    denom = ref.abs().max().item()
    return diff / denom if denom > 0 else diff


def assert_max_abs_by_rule(name, got, ref, torch_got, dtype):
    """Like :func:`assert_close_by_rule` on the maximum absolute error (relative to
    max |ref|), with MAX_ERR_FACTOR: catches one wrong row that the norm hides."""
    err = max_abs_err(got, ref)
    torch_err = max_abs_err(torch_got, ref)
    bound = MAX_ERR_FACTOR * torch_err + FLOOR[dtype]
    assert err <= bound, (
        f"{name} ({dtype}): max abs err vs float64 reference {err:.3e} (of max |ref|) > "
        f"{MAX_ERR_FACTOR} x torch's {torch_err:.3e} + floor {FLOOR[dtype]:.0e}"
    )
    return err, torch_err


def assert_close_by_rule(name, got, ref, torch_got, dtype):
    """attn_ext's error <= ERR_FACTOR x torch's error + FLOOR[dtype], both measured
    against the float64 reference ``ref``. Returns (attn_ext's error, torch's error)."""
    assert_no_nan(got, name)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = rel_err(got, ref)
    torch_err = rel_err(torch_got, ref)
    bound = ERR_FACTOR * torch_err + FLOOR[dtype]
    assert err <= bound, (
        f"{name} ({dtype}): rel err vs float64 reference {err:.3e} > "
        f"{ERR_FACTOR} x torch's {torch_err:.3e} + floor {FLOOR[dtype]:.0e}"
    )
    return err, torch_err


def assert_sum_close_by_rule(name, got, ref, torch_got, dtype, terms_scale):
    """The rule (Frobenius, then max-abs with MAX_ERR_FACTOR) for a result each of whose
    entries is a sum of many signed terms, with the errors measured against
    ``terms_scale`` (per entry, the sum of the terms' magnitudes) instead of the result.

    For the sinks' gradient: one number per head, summed over every row with random
    signs. Relative to the (cancelling) sum itself, the roundoff of a correct kernel
    is unbounded, and with one or two entries torch's error is a coin toss that can
    land near 0; relative to the terms' magnitudes both are a few roundoffs."""
    assert_no_nan(got, name)
    assert got.shape == ref.shape == terms_scale.shape, (got.shape, ref.shape, terms_scale.shape)
    got, ref, torch_got, scale = (t.detach().to(torch.float64) for t in (got, ref, torch_got, terms_scale))
    norm = scale.norm().item()
    err = (got - ref).norm().item() / norm
    torch_err = (torch_got - ref).norm().item() / norm
    bound = ERR_FACTOR * torch_err + FLOOR[dtype]
    assert err <= bound, (
        f"{name} ({dtype}): err vs float64 reference {err:.3e} (of the terms' magnitudes) > "
        f"{ERR_FACTOR} x torch's {torch_err:.3e} + floor {FLOOR[dtype]:.0e}"
    )
    peak = scale.abs().max().item()
    err = (got - ref).abs().max().item() / peak
    torch_err = (torch_got - ref).abs().max().item() / peak
    bound = MAX_ERR_FACTOR * torch_err + FLOOR[dtype]
    assert err <= bound, (
        f"{name} ({dtype}): max abs err {err:.3e} (of the terms' magnitudes) > "
        f"{MAX_ERR_FACTOR} x torch's {torch_err:.3e} + floor {FLOOR[dtype]:.0e}"
    )


# --------------------------------------------------------------------------- torch baseline


def causal_visible(L, S, causal_alignment, device):
    """(L, S) bool, True where key j is visible from query i."""
    offset = 0 if causal_alignment == "top_left" else S - L
    i = torch.arange(L, device=device).unsqueeze(-1)
    j = torch.arange(S, device=device).unsqueeze(0)
    return j <= i + offset


def torch_equivalent_mask(attn_mask, is_causal, causal_alignment, L, S, device):
    """One mask that makes torch SDPA (called with is_causal=False) compute attn_ext's
    ``attn_mask`` + ``is_causal`` + ``causal_alignment`` semantics. Differentiable
    with respect to a float ``attn_mask``."""
    if not is_causal:
        return attn_mask
    visible = causal_visible(L, S, causal_alignment, device)
    if attn_mask is None:
        return visible
    if attn_mask.dtype == torch.bool:
        return attn_mask & visible
    return attn_mask.masked_fill(~visible, float("-inf"))


def torch_sdpa(query, key, value, attn_mask=None, is_causal=False, scale=None,
               enable_gqa=False, causal_alignment="top_left"):
    """torch.nn.functional.scaled_dot_product_attention with attn_ext's semantics.

    Uses torch's own is_causal where torch supports the case (no mask, top-left or
    L == S), an equivalent explicit mask otherwise. Rows that are fully masked are
    set to 0 (attn_ext's definition; torch gives 0 there as well in recent releases).
    """
    L, S = query.size(-2), key.size(-2)
    native_causal = is_causal and attn_mask is None and (causal_alignment == "top_left" or L == S)
    if native_causal:
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    else:
        mask = torch_equivalent_mask(attn_mask, is_causal, causal_alignment, L, S, query.device)
        if mask is not None and query.is_cuda:
            # PyTorch's CUDA backends mishandle broadcast masks: with an (L, 1) or
            # (1, 1, 1, 1) mask, torch 2.11's cuDNN kernel reads out of alignment
            # ("misaligned address", seen under compute-sanitizer on an H200) and the
            # efficient kernel refuses a stride-0 last dim. The baseline gets the
            # same mask materialised, which every backend takes.
            mask = mask.expand(*query.shape[:-2], L, S).contiguous()
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    return torch.nan_to_num(out, nan=0.0)


def torch_lse(query, key, value, attn_mask=None, is_causal=False, scale=None,
              causal_alignment="top_left"):
    """PyTorch's own log-sum-exp for this problem (CPU flash kernel), or None."""
    if query.device.type != "cpu" or query.dim() != 4 or query.size(-3) != key.size(-3):
        return None
    L, S = query.size(-2), key.size(-2)
    mask = torch_equivalent_mask(attn_mask, is_causal, causal_alignment, L, S, query.device)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, float("-inf"))
    try:
        _, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.detach(), key.detach(), value.detach(), 0.0, False,
            attn_mask=None if mask is None else mask.detach(), scale=scale,
        )
    except Exception:
        return None
    return lse


# --------------------------------------------------------------------------- gradients


def grads(outputs, inputs, grad_outputs):
    """torch.autograd.grad over the inputs that require grad (None for the others)."""
    live = [t for t in inputs if t is not None and t.requires_grad]
    got = torch.autograd.grad(outputs, live, grad_outputs, allow_unused=False)
    it = iter(got)
    return [next(it) if (t is not None and t.requires_grad) else None for t in inputs]


# --------------------------------------------------------------------------- errors (messages)


def error_pattern(name, *values):
    """A regex asserting that the message names ``name`` and shows one of ``values``."""
    vals = "|".join(re.escape(str(v)) for v in values)
    return rf"(?is)(?=.*{name})(?=.*(?<![\w.])({vals})(?![\w]))"


# --------------------------------------------------------------------------- whole cases


def torch_explicit_lse(query, key, attn_mask=None, is_causal=False, scale=None,
                       enable_gqa=False, causal_alignment="top_left"):
    """The log-sum-exp computed by plain torch ops at the inputs' dtype (scores from a
    matmul in that dtype, logsumexp in float32/float64): PyTorch's error baseline for
    the lse where its fused kernels do not expose one. Differentiable."""
    acc = lse_dtype(query.dtype)
    L, S, E = query.size(-2), key.size(-2), query.size(-1)
    if enable_gqa and query.dim() >= 3 and query.size(-3) != key.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)).to(acc) * scale
    mask = torch_equivalent_mask(attn_mask, is_causal, causal_alignment, L, S, query.device)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(acc)
    return torch.logsumexp(scores, dim=-1)


def run_forward_case(query, key, value, attn_mask=None, is_causal=False, scale=None,
                     enable_gqa=False, causal_alignment="top_left", check_lse=True):
    """attn_ext forward vs the float64 reference, by the tolerance rule against torch.

    Checks: output shape/dtype/device, the tolerance rule, fully masked rows exactly 0,
    no NaN; with ``check_lse`` the returned lse (shape, dtype, -inf rows, tolerance
    rule at the lse's accumulation dtype). Returns (out, lse, ref_out, ref_lse)."""
    dtype = query.dtype
    kwargs = dict(attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                  causal_alignment=causal_alignment)
    if check_lse:
        out, lse = sdpa(query, key, value, return_lse=True, **kwargs)
    else:
        out, lse = sdpa(query, key, value, **kwargs), None
    ref, ref_lse = attention_reference(query, key, value, **kwargs)
    expected_shape = query.shape[:-1] + (value.size(-1),)
    assert out.shape == expected_shape, f"out shape {tuple(out.shape)} != {tuple(expected_shape)}"
    assert out.dtype == dtype, f"out dtype {out.dtype} != {dtype}"
    assert out.device == query.device
    assert_no_nan(out, "out")
    with torch.no_grad():
        baseline = torch_sdpa(query, key, value, **kwargs)
    assert_close_by_rule("out", out, ref, baseline, dtype)
    dead = torch.isneginf(ref_lse)
    if dead.any():
        assert (out[dead] == 0).all(), "rows without any visible key must be exactly 0"
    if check_lse:
        assert lse.shape == query.shape[:-1], f"lse shape {tuple(lse.shape)} != {tuple(query.shape[:-1])}"
        assert lse.dtype == lse_dtype(dtype), f"lse dtype {lse.dtype} != {lse_dtype(dtype)}"
        assert_no_nan(lse, "lse")
        assert torch.equal(torch.isneginf(lse), dead), "lse must be -inf exactly on rows without keys"
        base_lse = None
        if not enable_gqa:
            base_lse = torch_lse(query, key, value, attn_mask, is_causal, scale, causal_alignment)
        if base_lse is None:
            with torch.no_grad():
                base_lse = torch_explicit_lse(query, key, attn_mask, is_causal, scale,
                                              enable_gqa, causal_alignment)
        # torch's kernels leave the lse of rows without keys unspecified: not compared
        base_lse = torch.where(dead, torch.full_like(base_lse, float("-inf")), base_lse)
        assert_close_by_rule("lse", lse, ref_lse, base_lse, lse_dtype(dtype))
    return out, lse, ref, ref_lse


def run_backward_case(query, key, value, attn_mask=None, is_causal=False, scale=None,
                      enable_gqa=False, causal_alignment="top_left", lse_weight=False, seed=0):
    """Gradients of attn_ext vs float64 reference autograd, by the tolerance rule against
    torch's own gradients at the same dtype.

    query/key/value (and a float attn_mask) must require grad. The loss is
    sum(out * g) (+ sum(lse * w) over rows with keys when ``lse_weight``).
    Returns the attn_ext gradients [dq, dk, dv, dmask or None]."""
    dtype = query.dtype
    kwargs = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                  causal_alignment=causal_alignment)
    inputs = [query, key, value, attn_mask]
    gen = make_generator(seed + 12345)
    out_shape = query.shape[:-1] + (value.size(-1),)
    g = torch.randn(out_shape, generator=gen).to(device=query.device, dtype=dtype)
    w = torch.randn(query.shape[:-1], generator=gen).to(device=query.device,
                                                       dtype=lse_dtype(dtype))

    def loss_of(out, lse):
        acc = lse_dtype(dtype)
        loss = (out.to(acc) * g.to(acc)).sum()
        if lse_weight:
            finite = torch.isfinite(lse.detach())
            loss = loss + torch.where(finite, lse * w.to(lse.dtype), torch.zeros_like(lse)).sum()
        return loss

    # attn_ext
    if lse_weight:
        out, lse = sdpa(query, key, value, attn_mask=attn_mask, return_lse=True, **kwargs)
    else:
        out, lse = sdpa(query, key, value, attn_mask=attn_mask, **kwargs), None
    got = grads(loss_of(out, lse), inputs, None)

    # float64 reference
    ref_inputs = [leaf64(t) for t in inputs]
    ref_out, ref_lse = attention_reference(*ref_inputs[:3], attn_mask=ref_inputs[3], **kwargs)
    ref_loss = (ref_out * g.to(torch.float64)).sum()
    if lse_weight:
        finite = torch.isfinite(ref_lse.detach())
        ref_loss = ref_loss + torch.where(finite, ref_lse * w.to(torch.float64),
                                          torch.zeros_like(ref_lse)).sum()
    expected = grads(ref_loss, ref_inputs, None)

    # torch at the same dtype
    t_inputs = [low_precision_leaf(t) for t in inputs]
    t_out = torch_sdpa(*t_inputs[:3], attn_mask=t_inputs[3], **kwargs)
    t_lse = None
    if lse_weight:
        t_lse = torch_explicit_lse(t_inputs[0], t_inputs[1], t_inputs[3], is_causal, scale,
                                   enable_gqa, causal_alignment)
    baseline = [None if t is None else torch.nan_to_num(t, nan=0.0)
                for t in grads(loss_of(t_out, t_lse), t_inputs, None)]

    names = ["grad query", "grad key", "grad value", "grad attn_mask"]
    for name, t, a, e, b in zip(names, inputs, got, expected, baseline):
        if t is None or not t.requires_grad:
            continue
        assert_grad_like(name, a, t)
        assert_close_by_rule(name, a, e, b, dtype)
    return got


def assert_grad_like(name, grad, t):
    """The gradient of ``t`` exists and has its shape and dtype."""
    assert grad is not None, f"{name} is None"
    assert grad.shape == t.shape, f"{name} shape {tuple(grad.shape)} != {tuple(t.shape)}"
    assert grad.dtype == t.dtype, f"{name} dtype {grad.dtype} != {t.dtype}"


# --------------------------------------------------------------------------- variants


def variant_visible(L, S, is_causal=False, window=None, causal_alignment="top_left",
                    device="cpu"):
    """(L, S) bool, True where key j is visible from query i under the causal rule and
    ``window=(left, right)`` (None on a side = unbounded), written out row by row."""
    offset = 0 if causal_alignment == "top_left" else S - L
    left, right = (None, None) if window is None else window
    visible = torch.zeros(L, S, dtype=torch.bool)
    for i in range(L):
        lo = 0 if left is None else max(0, i + offset - left)
        hi = S - 1 if right is None else min(S - 1, i + offset + right)
        if is_causal:
            hi = min(hi, i + offset)
        if lo <= hi:
            visible[i, lo : hi + 1] = True
    return visible.to(device)


def per_head_view(t, query):
    """A per-head tensor (ALiBi slopes, sinks) of shape (H,) or (N, H) ((1,) or (N, 1)
    for 3-D inputs) viewed to broadcast against scores (N, ..., H, L, S)."""
    if query.dim() == 3 or t.dim() == 1:
        return t.reshape(-1, 1, 1)
    return t.reshape(t.shape[0], *([1] * (query.dim() - 4)), t.shape[1], 1, 1)


def torch_variant_probs(query, key, attn_mask=None, is_causal=False, scale=None,
                        enable_gqa=False, causal_alignment="top_left", window=None,
                        softcap=None, alibi_slopes=None, sinks=None):
    """Attention probabilities (in the accumulation dtype) and lse by plain torch ops at
    the inputs' dtype: PyTorch's error baseline where its SDPA cannot express a variant
    (softcap, sinks). The scores come from a matmul in the inputs' dtype (rounded to it,
    as torch's math path does); softcap, ALiBi, the mask and the softmax (with the sink
    column) run in float32 (float64 for float64 inputs). Rows without keys (and no sink)
    give 0 and lse -inf, without NaN. Differentiable in query, key, a float mask, sinks."""
    acc = lse_dtype(query.dtype)
    L, S, E = query.size(-2), key.size(-2), query.size(-1)
    if enable_gqa and query.dim() >= 4 and query.size(-3) != key.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    offset = 0 if causal_alignment == "top_left" else S - L
    scores = (query @ key.transpose(-2, -1)).to(acc) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        i = torch.arange(L, device=query.device, dtype=acc).unsqueeze(-1) + offset
        j = torch.arange(S, device=query.device, dtype=acc).unsqueeze(0)
        scores = scores - per_head_view(alibi_slopes.detach().to(acc), query) * (i - j).abs()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(acc)
    if is_causal or window is not None:
        visible = variant_visible(L, S, is_causal, window, causal_alignment, query.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = per_head_view(sinks.to(acc), query).expand(scores.shape[:-1] + (1,))
        scores = torch.cat([scores, sink], dim=-1)
    alive = (scores > float("-inf")).any(dim=-1, keepdim=True)
    safe = torch.where(alive, scores, torch.zeros_like(scores))
    lse = torch.logsumexp(safe, dim=-1, keepdim=True)
    probs = torch.where(alive, torch.exp(safe - lse), torch.zeros_like(safe))
    if sinks is not None:
        probs = probs[..., :-1]
    lse = torch.where(alive, lse, torch.full_like(lse, float("-inf"))).squeeze(-1)
    return probs, lse


def torch_variant_attention(query, key, value, attn_mask=None, is_causal=False, scale=None,
                            enable_gqa=False, causal_alignment="top_left", window=None,
                            softcap=None, alibi_slopes=None, sinks=None):
    """``(out, lse)`` by plain torch ops at the inputs' dtype (see
    :func:`torch_variant_probs`); the probabilities are rounded to the dtype and
    multiplied with ``value`` in it, as torch's math path does. Differentiable."""
    probs, lse = torch_variant_probs(query, key, attn_mask, is_causal, scale, enable_gqa,
                                     causal_alignment, window, softcap, alibi_slopes, sinks)
    if enable_gqa and query.dim() >= 4 and query.size(-3) != value.size(-3):
        value = value.repeat_interleave(query.size(-3) // value.size(-3), dim=-3)
    return probs.to(query.dtype) @ value, lse


# The instruction-set level of a line of x86-64 code (0: the baseline, 1: AVX/AVX2, 2: AVX-512 or
# AMX), and of a kernel unit by the namespace in a function's name (demangled, or mangled where
# objdump leaves it so: OpenMP's outlined bodies). Code run at load time runs on every CPU.
_AVX512_CODE = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(1[6-9]|2\d|3[01])\b|\{1to\d+\}|"
                          r"^(vpternlog|vmovdq[au](8|16|32|64)|vperm[it]2|vpcompress|vpexpand|vcvtne2?ps2bf16|"
                          r"vdpbf16ps|vpmov[dqw]2m|vpmovm2|kmov|kor|kand|tile|tdp|ldtilecfg|sttilecfg)")
_AVX_CODE = re.compile(r"%ymm|^v[a-z]")
_UNIT_LEVELS = ((re.compile(r"::(AVX512|AVX512BF16|AMX|amx)::|6AVX512|10AVX512BF16|3AMX|3amx"), 2),
                (re.compile(r"::AVX2::|4AVX2"), 1),
                (re.compile(r"::DEFAULT::|7DEFAULT|^_GLOBAL__sub_I_"), 0))
CAN_READ_X86_CODE = platform.machine().lower() in ("x86_64", "amd64") and shutil.which("objdump") is not None


def _code_level(instruction):
    return 2 if _AVX512_CODE.search(instruction) else 1 if _AVX_CODE.search(instruction) else 0


def _unit_level(name):
    return max((level for pattern, level in _UNIT_LEVELS if pattern.search(name)), default=None)


def code_wider_than_its_callers(library):
    """The places in a shared library's x86-64 code (objdump -d) that a CPU able to run the caller
    may not run: a function of a kernel unit (default, avx2, avx512, amx, or the load-time code)
    with instructions wider than its unit's, or a direct call or jump to code wider than the caller
    may run (its unit's level, or for a function of no unit -- shared code -- what its own
    instructions already need). Empty when every unit reaches only code its CPUs run."""
    dump = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(library)],
                          capture_output=True, text=True, timeout=600, check=True).stdout
    functions, calls = {}, []  # start address -> [name, code level]; (caller, callee) start addresses
    start = None
    for line in dump.splitlines():
        head = re.match(r"^([0-9a-f]+) <(.*)>:$", line)
        if head:
            start = int(head.group(1), 16)
            functions[start] = [head.group(2), 0]
            continue
        parts = line.split("\t", 1)
        if start is None or len(parts) < 2:
            continue
        instruction = parts[1].strip()
        functions[start][1] = max(functions[start][1], _code_level(instruction))
        target = re.match(r"^(call|j[a-z]+)\s+([0-9a-f]+) <([^>]*)>$", instruction)
        if target and "@plt" not in target.group(3) and "+0x" not in target.group(3):
            calls.append((start, int(target.group(2), 16)))
    assert len(functions) > 1000, f"objdump read too little of {library}: {dump[:2000]}"
    may_run = {a: (level if _unit_level(name) is None else _unit_level(name)) for a, (name, level) in functions.items()}
    wider_units = [f"{name[:200]}: level {level} code in a level {may_run[a]} unit"
                   for a, (name, level) in functions.items() if level > may_run[a]]
    wider_calls = sorted({f"{functions[a][0][:160]} (may run level {may_run[a]}) calls "
                          f"{functions[b][0][:160]} (level {functions[b][1]} code)"
                          for a, b in calls if b in functions and b != a and functions[b][1] > may_run[a]})
    return wider_units + wider_calls
