"""The float64 reference's attention variants (window, softcap, ALiBi, sinks) and its
packed variable-length form, against the definitions written out row by row.

No compiled attn_ext is needed here: the kernel tests (test_variants.py,
test_varlen.py) are only as good as this file.
"""

import math
import re

import pytest
import torch

from helpers import (
    attention_probs_reference,
    attention_reference,
    make_generator,
    make_mask,
    make_qkv,
    variant_visible,
    varlen_attention_reference,
)

F64 = torch.float64
# Two float64 computations of the same small attention differ by a few ulps.
TOL = dict(rtol=1e-10, atol=1e-12)


def _explicit(q, k, v, *, scale=None, is_causal=False, window=None, alignment="top_left",
              softcap=None, slopes=None, mask=None, sinks=None):
    """Attention of 4-D (B, H, L, E) inputs (as many key as query heads), one row and
    one key at a time, straight from the definitions in DESIGN.md:

    key j visible from query i iff i + offset - left <= j <= i + offset + right (and
    j <= i + offset if causal); score = scale * q.k -> softcap * tanh(score / softcap)
    -> - slope * |i + offset - j| -> + mask; softmax over the visible keys and the sink.
    Differentiable (every step is a torch op on scalars)."""
    B, H, L, E = q.shape
    S, Ev = k.size(-2), v.size(-1)
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    offset = 0 if alignment == "top_left" else S - L
    left, right = (None, None) if window is None else window
    if mask is not None:
        mask = mask.expand(B, H, L, S)
    if slopes is not None and slopes.dim() == 1:
        slopes = slopes.expand(B, H)
    outs, lses = [], []
    for b in range(B):
        for h in range(H):
            for i in range(L):
                js, logits = [], []
                for j in range(S):
                    if left is not None and j < i + offset - left:
                        continue
                    if right is not None and j > i + offset + right:
                        continue
                    if is_causal and j > i + offset:
                        continue
                    x = (q[b, h, i] * k[b, h, j]).sum() * scale
                    if softcap is not None:
                        x = softcap * torch.tanh(x / softcap)
                    if slopes is not None:
                        x = x - slopes[b, h] * abs(i + offset - j)
                    if mask is not None:
                        if mask.dtype == torch.bool:
                            if not mask[b, h, i, j]:
                                continue
                        else:
                            x = x + mask[b, h, i, j]
                    js.append(j)
                    logits.append(x)
                if sinks is not None:
                    logits.append(sinks[h].to(F64))
                t = torch.stack(logits) if logits else torch.zeros(0, dtype=F64)
                if t.numel() == 0 or not torch.isfinite(t).any():
                    outs.append(torch.zeros(Ev, dtype=F64))
                    lses.append(torch.tensor(float("-inf"), dtype=F64))
                    continue
                lse = torch.logsumexp(t, 0)
                p = torch.exp(t - lse)[: len(js)]
                out = (p.unsqueeze(-1) * v[b, h, js]).sum(0) if js else torch.zeros(Ev, dtype=F64)
                outs.append(out)
                lses.append(lse)
    return (torch.stack(outs).reshape(B, H, L, Ev), torch.stack(lses).reshape(B, H, L))


def _check_forward_and_grads(got, expected, inputs):
    """(out, lse) pairs equal, and so are the gradients of sum(out * g) + sum(lse * w)
    (finite lse only) with respect to ``inputs``."""
    (out, lse), (e_out, e_lse) = got, expected
    torch.testing.assert_close(out, e_out, **TOL)
    torch.testing.assert_close(lse, e_lse, **TOL)
    gen = make_generator(99)
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    w = torch.randn(lse.shape, generator=gen, dtype=F64)

    def loss(o, s):
        return (o * g).sum() + torch.where(torch.isfinite(s), s * w, torch.zeros_like(s)).sum()

    live = [t for t in inputs if t is not None and t.requires_grad]
    a = torch.autograd.grad(loss(out, lse), live)
    b = torch.autograd.grad(loss(e_out, e_lse), live)
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m, i=i: f"grad of input {i}: {m}")


def _slopes(H, seed, batch=None):
    """ALiBi slopes: the usual geometric ones (2^(-8h/H)), perturbed per batch row."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32)
    if batch is None:
        return base
    return base * (1 + torch.rand(batch, H, generator=make_generator(seed)))


def _sinks(H, seed, dtype=F64, requires_grad=False):
    s = (torch.randn(H, generator=make_generator(seed)) + 1.0).to(dtype)
    return s.requires_grad_(requires_grad)


# --------------------------------------------------------------------------- window

WINDOWS = [(2, 1), (0, 0), (3, None), (None, 2), (None, None), (1, 4), (20, 20)]


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(7, 7), (5, 9), (9, 4)])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["window", "window_causal"])
def test_window_equals_explicit_bool_mask(device, window, L, S, alignment, is_causal):
    q, k, v = make_qkv(2, 2, 2, L, S, 4, 3, F64, device, seed=L * 10 + S, requires_grad=True)
    got = attention_reference(q, k, v, window=window, is_causal=is_causal,
                              causal_alignment=alignment)
    visible = variant_visible(L, S, is_causal, window, alignment, device)
    expected = attention_reference(q, k, v, attn_mask=visible)
    _check_forward_and_grads(got, expected, [q, k, v])
    # and straight from the definition, one key at a time
    torch.testing.assert_close(got[0], _explicit(q, k, v, is_causal=is_causal, window=window,
                                                 alignment=alignment)[0], **TOL)


def test_window_causal_is_right_zero(device):
    q, k, v = make_qkv(1, 2, 2, 8, 11, 4, 4, F64, device, seed=1)
    for alignment in ("top_left", "bottom_right"):
        a = attention_reference(q, k, v, window=(3, 5), is_causal=True, causal_alignment=alignment)
        b = attention_reference(q, k, v, window=(3, 0), causal_alignment=alignment)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        c = attention_reference(q, k, v, window=(None, 0), causal_alignment=alignment)
        d = attention_reference(q, k, v, is_causal=True, causal_alignment=alignment)
        torch.testing.assert_close(c, d, rtol=0, atol=0)


def test_window_none_sides_is_no_window(device):
    q, k, v = make_qkv(2, 2, 2, 6, 9, 4, 4, F64, device, seed=2)
    a = attention_reference(q, k, v, window=(None, None))
    b = attention_reference(q, k, v)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_window_alignment_applies_without_is_causal(device):
    # L < S, window (1, 1): top_left rows see keys near i, bottom_right near i + S - L
    q, k, v = make_qkv(1, 1, 1, 3, 8, 4, 4, F64, device, seed=3)
    p_tl = attention_probs_reference(q, k, window=(1, 1))
    p_br = attention_probs_reference(q, k, window=(1, 1), causal_alignment="bottom_right")
    assert torch.equal(p_tl[0, 0] > 0, variant_visible(3, 8, False, (1, 1), "top_left", device))
    assert torch.equal(p_br[0, 0] > 0, variant_visible(3, 8, False, (1, 1), "bottom_right", device))
    assert (p_br[0, 0, 0, :4] == 0).all() and (p_br[0, 0, 0, 4:7] > 0).all()


# --------------------------------------------------------------------------- softcap, ALiBi


@pytest.mark.parametrize("softcap", [0.5, 2.0, 30.0])
def test_softcap_matches_the_formula(device, softcap):
    q, k, v = make_qkv(2, 2, 2, 5, 7, 4, 3, F64, device, seed=4, requires_grad=True)
    scale = 1.5  # scores of std ~3: the cap bites
    got = attention_reference(q, k, v, scale=scale, softcap=softcap)
    scores = softcap * torch.tanh(q @ k.transpose(-2, -1) * scale / softcap)
    expected_out = torch.softmax(scores, -1) @ v
    expected = (expected_out, torch.logsumexp(scores, -1))
    _check_forward_and_grads(got, expected, [q, k, v])
    torch.testing.assert_close(got[0], _explicit(q, k, v, scale=scale, softcap=softcap)[0], **TOL)


def test_softcap_comes_before_the_mask_and_alibi(device):
    # order: score -> softcap -> + alibi -> + attn_mask; a mask inside the tanh would differ
    q, k, v = make_qkv(2, 2, 2, 5, 7, 4, 3, F64, device, seed=5, requires_grad=True)
    mask = (make_mask("float", (2, 1, 5, 7), F64, device, seed=6) * 3).requires_grad_(True)
    slopes = _slopes(2, 7)
    got = attention_reference(q, k, v, attn_mask=mask, softcap=1.0, alibi_slopes=slopes)
    i, j = torch.arange(5).unsqueeze(-1), torch.arange(7)
    scores = (torch.tanh(q @ k.transpose(-2, -1) / 2.0)
              - slopes.double().view(2, 1, 1) * (i - j).abs() + mask)
    expected = (torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1))
    _check_forward_and_grads(got, expected, [q, k, v, mask])
    torch.testing.assert_close(
        got[0], _explicit(q, k, v, softcap=1.0, slopes=slopes.double(), mask=mask)[0], **TOL)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(6, 6), (4, 9), (9, 4)])
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_H", "slopes_NH"])
def test_alibi_equals_a_distance_bias(device, per_batch, L, S, alignment):
    q, k, v = make_qkv(2, 3, 3, L, S, 4, 3, F64, device, seed=8, requires_grad=True)
    slopes = _slopes(3, 9, batch=2 if per_batch else None)
    got = attention_reference(q, k, v, alibi_slopes=slopes, causal_alignment=alignment)
    offset = 0 if alignment == "top_left" else S - L
    dist = (torch.arange(L).unsqueeze(-1) + offset - torch.arange(S)).abs().double()
    s = slopes.double().reshape(-1 if per_batch else 1, 3, 1, 1)
    expected = attention_reference(q, k, v, attn_mask=-s * dist)
    _check_forward_and_grads(got, expected, [q, k, v])
    torch.testing.assert_close(
        got[0], _explicit(q, k, v, slopes=slopes.double(), alignment=alignment)[0], **TOL)


def test_alibi_slopes_are_constants(device):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 4, 4, F64, device, seed=10, requires_grad=True)
    slopes = _slopes(2, 0).requires_grad_(True)
    out, _ = attention_reference(q, k, v, alibi_slopes=slopes)
    (gs,) = torch.autograd.grad(out.sum(), [slopes], allow_unused=True)
    assert gs is None


def test_alibi_slopes_float32_and_float64_agree(device):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 4, 4, F64, device, seed=11)
    s32 = _slopes(2, 0)
    a = attention_reference(q, k, v, alibi_slopes=s32)
    b = attention_reference(q, k, v, alibi_slopes=s32.double())
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- sinks


def test_sinks_equal_softmax_with_an_extra_column(device):
    q, k, v = make_qkv(2, 3, 3, 5, 7, 4, 3, F64, device, seed=12, requires_grad=True)
    sinks = _sinks(3, 13, requires_grad=True)
    got = attention_reference(q, k, v, sinks=sinks)
    scores = q @ k.transpose(-2, -1) / 2.0
    full = torch.cat([scores, sinks.view(1, 3, 1, 1).expand(2, 3, 5, 1)], -1)
    p = torch.softmax(full, -1)[..., :-1]
    expected = (p @ v, torch.logsumexp(full, -1))
    _check_forward_and_grads(got, expected, [q, k, v, sinks])
    torch.testing.assert_close(got[0], _explicit(q, k, v, sinks=sinks)[0], **TOL)
    probs = attention_probs_reference(q, k, sinks=sinks)
    torch.testing.assert_close(probs, p, **TOL)
    # a row sums to 1 - p_sink, p_sink = exp(sink - lse)
    p_sink = torch.exp(sinks.view(3, 1) - got[1])
    torch.testing.assert_close(probs.sum(-1), 1 - p_sink, **TOL)
    assert (p_sink > 0.01).all()  # the sinks matter in this test


def test_sinks_with_gqa_are_per_query_head(device):
    q, k, v = make_qkv(1, 4, 2, 5, 6, 4, 3, F64, device, seed=14)
    sinks = _sinks(4, 15)
    got = attention_reference(q, k, v, enable_gqa=True, sinks=sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = _explicit(q, kk, vv, sinks=sinks)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    torch.testing.assert_close(got[1], expected[1], **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_sinks_gradient_comes_in_the_sinks_dtype(device, dtype):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 4, 4, F64, device, seed=16)
    sinks = _sinks(2, 17, dtype=dtype, requires_grad=True)
    out, lse = attention_reference(q, k, v, sinks=sinks)
    (g,) = torch.autograd.grad(out.sum() + lse.sum(), [sinks])
    assert g.dtype == dtype and torch.isfinite(g).all() and (g != 0).all()


@pytest.mark.parametrize("how", ["bool_mask", "float_mask_neg_inf", "window", "S_zero"])
def test_fully_masked_rows_with_sinks_give_zero_and_lse_equal_to_the_sink(device, how):
    L, S = 6, 0 if how == "S_zero" else 8
    q, k, v = make_qkv(2, 2, 2, L, S, 4, 3, F64, device, seed=18, requires_grad=True)
    sinks = _sinks(2, 19, requires_grad=True)
    kw, dead = {}, torch.zeros(2, 2, L, dtype=torch.bool)
    mask = None
    if how == "bool_mask":
        mask = torch.ones(2, 1, L, S, dtype=torch.bool)
        mask[0, :, 1] = False
        mask[1, :, 4] = False
        dead[0, :, 1] = dead[1, :, 4] = True
    elif how == "float_mask_neg_inf":
        mask = make_mask("float", (L, S), F64, device, seed=20)
        mask[2] = float("-inf")
        mask.requires_grad_(True)
        dead[:, :, 2] = True
    elif how == "window":
        # top_left, L > S, window (0, 0): query i sees key i only, none for i >= S
        kw = dict(window=(0, 0))
        q, k, v = make_qkv(2, 2, 2, 9, 5, 4, 3, F64, device, seed=21, requires_grad=True)
        dead = torch.zeros(2, 2, 9, dtype=torch.bool)
        dead[:, :, 5:] = True
    else:
        dead[:] = True
    out, lse = attention_reference(q, k, v, attn_mask=mask, sinks=sinks, **kw)
    assert not torch.isnan(out).any() and torch.isfinite(lse).all()
    assert (out[dead] == 0).all()
    sink_rows = sinks.detach().view(1, 2, 1).expand_as(lse)
    assert torch.equal(lse[dead], sink_rows[dead])
    assert (lse[~dead] > sink_rows[~dead]).all()
    gen = make_generator(22)
    g_out = torch.randn(out.shape, generator=gen, dtype=F64)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=F64)
    inputs = [q, k, v, sinks] + ([mask] if mask is not None and mask.requires_grad else [])
    gq, gk, gv, gs, *gm = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), inputs,
                                               retain_graph=True)
    for t in (gq, gk, gv, gs, *gm):
        assert torch.isfinite(t).all()
    assert (gq[dead] == 0).all()
    # d lse / d sink = 1 on a dead row and its output is 0: dead rows give the sink g_lse
    only_dead = torch.autograd.grad((lse * torch.where(dead, g_lse, 0)).sum(), [sinks])[0]
    torch.testing.assert_close(only_dead, torch.where(dead, g_lse, 0).sum((0, 2)), **TOL)


def test_sink_of_minus_infinity_is_no_sink(device):
    q, k, v = make_qkv(1, 2, 2, 4, 5, 4, 4, F64, device, seed=23)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    sinks = torch.full((2,), float("-inf"), dtype=F64)
    a = attention_reference(q, k, v, attn_mask=mask, sinks=sinks)
    b = attention_reference(q, k, v, attn_mask=mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- all together


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_every_variant_together_matches_the_definition(device, alignment):
    L, S = 5, 8
    q, k, v = make_qkv(2, 2, 2, L, S, 4, 3, F64, device, seed=24, requires_grad=True)
    mask = make_mask("float", (2, 2, L, S), F64, device, seed=25, requires_grad=True)
    slopes = _slopes(2, 26, batch=2)
    sinks = _sinks(2, 27, requires_grad=True)
    kw = dict(window=(2, 1), is_causal=True, softcap=1.5, alibi_slopes=slopes, sinks=sinks,
              causal_alignment=alignment, scale=0.8)
    got = attention_reference(q, k, v, attn_mask=mask, **kw)
    expected = _explicit(q, k, v, scale=0.8, is_causal=True, window=(2, 1), alignment=alignment,
                         softcap=1.5, slopes=slopes.double(), mask=mask, sinks=sinks)
    _check_forward_and_grads(got, expected, [q, k, v, mask, sinks])
    # attention_probs_reference is the same softmax
    probs = attention_probs_reference(q, k, attn_mask=mask, **kw)
    torch.testing.assert_close(probs @ v, got[0], **TOL)


def test_3d_inputs_take_one_head_of_slopes_and_sinks(device):
    gen = make_generator(28)
    q, k, v = (torch.randn(s, generator=gen, dtype=F64) for s in [(3, 5, 4), (3, 7, 4), (3, 7, 2)])
    sinks = _sinks(1, 29)
    for slopes in (_slopes(1, 0), _slopes(1, 30, batch=3)):
        got = attention_reference(q, k, v, window=(1, 2), softcap=2.0, alibi_slopes=slopes,
                                  sinks=sinks)
        expected = attention_reference(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                       window=(1, 2), softcap=2.0, alibi_slopes=slopes, sinks=sinks)
        torch.testing.assert_close(got[0], expected[0].squeeze(1), rtol=0, atol=0)
        torch.testing.assert_close(got[1], expected[1].squeeze(1), rtol=0, atol=0)
        # (N, 1) slopes: batch entry n has its own slope
        explicit = _explicit(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), window=(1, 2),
                             softcap=2.0, slopes=slopes.double().reshape(-1, 1).expand(3, 1),
                             sinks=sinks)
        torch.testing.assert_close(got[0], explicit[0].squeeze(1), **TOL)


def test_5d_inputs_take_slopes_per_batch_entry(device):
    q, k, v = make_qkv(None, 2, 2, 4, 5, 4, 3, F64, device, seed=31, batch=(2, 3))
    slopes = _slopes(2, 32, batch=6).reshape(2, 3, 2)  # (N1, N2, H): one row per batch entry
    got, _ = attention_reference(q, k, v, alibi_slopes=slopes)
    for n in range(2):
        for m in range(3):
            one = (slice(n, n + 1), m)  # (1, H, L, E): batch entry (n, m) alone
            expected, _ = attention_reference(q[one], k[one], v[one], alibi_slopes=slopes[n, m])
            torch.testing.assert_close(got[n, m], expected[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"alibi_slopes.*\(2, 2\)"):
        attention_reference(q, k, v, alibi_slopes=slopes[:, 0])  # (N1, H) is not a batch shape


def test_new_arguments_left_none_change_nothing(device):
    q, k, v = make_qkv(2, 2, 2, 5, 7, 4, 3, F64, device, seed=33)
    mask = make_mask("bool", (5, 7), F64, device, seed=34)
    a = attention_reference(q, k, v, attn_mask=mask, is_causal=True, window=None, softcap=None,
                            alibi_slopes=None, sinks=None)
    b = attention_reference(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_gradcheck_with_every_variant(device):
    q, k, v = make_qkv(1, 2, 1, 4, 6, 3, 2, F64, device, seed=35, requires_grad=True)
    mask = make_mask("float", (2, 4, 6), F64, device, seed=36, requires_grad=True)
    sinks = _sinks(2, 37, requires_grad=True)
    slopes = _slopes(2, 38)

    def fn(q, k, v, mask, sinks):
        return attention_reference(q, k, v, attn_mask=mask, enable_gqa=True, window=(1, 2),
                                   softcap=1.5, alibi_slopes=slopes, sinks=sinks,
                                   causal_alignment="bottom_right")

    assert torch.autograd.gradcheck(fn, (q, k, v, mask, sinks))


# --------------------------------------------------------------------------- bad values


BAD = {
    "window_negative": (dict(window=(-1, 0)), "window", "(-1, 0)"),
    "window_one_int": (dict(window=3), "window", "3"),
    "window_three": (dict(window=(1, 2, 3)), "window", "(1, 2, 3)"),
    "window_float": (dict(window=(1.5, 0)), "window", "(1.5, 0)"),
    "softcap_negative": (dict(softcap=-1.0), "softcap", "-1.0"),
    "softcap_zero": (dict(softcap=0.0), "softcap", "0.0"),
    "softcap_nan": (dict(softcap=float("nan")), "softcap", "nan"),
    "alibi_wrong_heads": (dict(alibi_slopes=torch.ones(3)), "alibi_slopes", "(3,)"),
    "alibi_wrong_batch": (dict(alibi_slopes=torch.ones(3, 2)), "alibi_slopes", "(3, 2)"),
    "sinks_wrong_heads": (dict(sinks=torch.ones(5)), "sinks", "(5,)"),
    "sinks_int": (dict(sinks=torch.ones(2, dtype=torch.int64)), "sinks", "torch.int64"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_reference_rejects_bad_variant_values_naming_them(device, case):
    kw, name, value = BAD[case]
    q, k, v = make_qkv(2, 2, 2, 3, 4, 4, 4, F64, device, seed=39)
    with pytest.raises(ValueError, match=rf"(?s){name}.*{re.escape(value)}"):
        attention_reference(q, k, v, **kw)


# --------------------------------------------------------------------------- varlen


def _packed(lens_q, lens_k, Hq, Hkv, E, Ev, seed, requires_grad=False, index_dtype=torch.int32):
    gen = make_generator(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, Hq, E, generator=gen, dtype=F64).requires_grad_(requires_grad)
    k = torch.randn(tk, Hkv, E, generator=gen, dtype=F64).requires_grad_(requires_grad)
    v = torch.randn(tk, Hkv, Ev, generator=gen, dtype=F64).requires_grad_(requires_grad)
    cu_q = torch.tensor([0] + lens_q, dtype=index_dtype).cumsum(0).to(index_dtype)
    cu_k = torch.tensor([0] + lens_k, dtype=index_dtype).cumsum(0).to(index_dtype)
    return q, k, v, cu_q, cu_k


def _per_sequence(q, k, v, cu_q, cu_k, **kw):
    """attention_reference on each sequence as a (1, H, L_b, E) batch, K/V heads repeated
    by hand, slopes row b to sequence b; packed back."""
    groups = q.size(1) // k.size(1)
    slopes = kw.pop("alibi_slopes", None)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
        ks = k[cu_k[b]:cu_k[b + 1]].repeat_interleave(groups, 1).transpose(0, 1)[None]
        vs = v[cu_k[b]:cu_k[b + 1]].repeat_interleave(groups, 1).transpose(0, 1)[None]
        s = None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])
        o, l = attention_reference(qs, ks, vs, alibi_slopes=s, **kw)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


VARLEN_KW = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "window_softcap": dict(window=(2, 1), softcap=1.0),
    "alibi_per_sequence_bottom_right": dict(alibi="BH", causal_alignment="bottom_right"),
    "everything": dict(is_causal=True, causal_alignment="bottom_right", window=(3, None),
                       softcap=2.0, alibi="H", sinks=True),
}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", list(VARLEN_KW))
def test_varlen_reference_equals_per_sequence_calls(device, case, index_dtype):
    lens_q, lens_k = [0, 3, 1, 5, 2, 4], [2, 4, 1, 3, 0, 6]  # empty q, empty k, L > S, L < S
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 3, 2, seed=40, requires_grad=True,
                                  index_dtype=index_dtype)
    kw = dict(VARLEN_KW[case])
    alibi = kw.pop("alibi", None)
    if alibi is not None:
        kw["alibi_slopes"] = _slopes(4, 41, batch=6 if alibi == "BH" else None)
    sinks = None
    if kw.pop("sinks", False):
        sinks = kw["sinks"] = _sinks(4, 42, requires_grad=True)
    got = varlen_attention_reference(q, k, v, cu_q, cu_k, **kw)
    assert got[0].shape == (sum(lens_q), 4, 2) and got[1].shape == (sum(lens_q), 4)
    expected = _per_sequence(q, k, v, cu_q.tolist(), cu_k.tolist(), **kw)
    _check_forward_and_grads(got, expected, [q, k, v, sinks])


def test_varlen_reference_sequences_do_not_see_each_other(device):
    q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2], 2, 2, 3, 3, seed=43)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k)
    k2, v2 = k.clone(), v.clone()
    k2[5:] += 1.0  # the second sequence's keys and values
    v2[5:] -= 2.0
    out2, lse2 = varlen_attention_reference(q, k2, v2, cu_q, cu_k)
    torch.testing.assert_close(out2[:3], out[:3], rtol=0, atol=0)
    torch.testing.assert_close(lse2[:3], lse[:3], rtol=0, atol=0)
    assert not torch.equal(out2[3:], out[3:])


def test_varlen_reference_empty_key_sequence_gives_zero_and_sink(device):
    q, k, v, cu_q, cu_k = _packed([2, 3], [4, 0], 2, 1, 3, 3, seed=44)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k)
    assert (out[2:] == 0).all() and torch.isneginf(lse[2:]).all()
    sinks = _sinks(2, 45)
    out, lse = varlen_attention_reference(q, k, v, cu_q, cu_k, sinks=sinks)
    assert (out[2:] == 0).all()
    torch.testing.assert_close(lse[2:], sinks.expand(3, 2), rtol=0, atol=0)


def test_varlen_reference_dropout_mask_blocks(device):
    q, k, v, cu_q, cu_k = _packed([3, 2], [4, 5], 2, 2, 3, 3, seed=46)
    keep = torch.rand(5, 2, 9, generator=make_generator(47)) > 0.3
    got, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, dropout_p=0.3, dropout_mask=keep)
    for b, (q0, q1, k0, k1) in enumerate([(0, 3, 0, 4), (3, 5, 4, 9)]):
        m = keep[q0:q1, :, k0:k1].transpose(0, 1)[None]
        e, _ = attention_reference(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                                   v[k0:k1].transpose(0, 1)[None], dropout_p=0.3, dropout_mask=m)
        torch.testing.assert_close(got[q0:q1], e[0].transpose(0, 1), **TOL)


def test_varlen_reference_gradcheck(device):
    q, k, v, cu_q, cu_k = _packed([2, 0, 3], [3, 2, 2], 2, 1, 3, 2, seed=48, requires_grad=True)
    sinks = _sinks(2, 49, requires_grad=True)

    def fn(q, k, v, sinks):
        return varlen_attention_reference(q, k, v, cu_q, cu_k, window=(1, 0), softcap=1.5,
                                          alibi_slopes=_slopes(2, 50, batch=3), sinks=sinks,
                                          causal_alignment="bottom_right")

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


BAD_CU = {
    "not_from_zero": (torch.tensor([1, 3]), "cu_seqlens_q", "[1, 3]"),
    "decreasing": (torch.tensor([0, 2, 1, 3]), "cu_seqlens_q", "[0, 2, 1, 3]"),
    "not_to_total": (torch.tensor([0, 2]), "cu_seqlens_q", "[0, 2]"),
    "float": (torch.tensor([0.0, 3.0]), "cu_seqlens_q", "float32"),
    "2d": (torch.tensor([[0, 3]]), "cu_seqlens_q", "(1, 2)"),
}


@pytest.mark.parametrize("case", list(BAD_CU))
def test_varlen_reference_rejects_bad_cu_seqlens(device, case):
    cu, name, value = BAD_CU[case]
    q, k, v, _, cu_k = _packed([3], [3], 1, 1, 2, 2, seed=51)
    with pytest.raises(ValueError, match=rf"(?s){name}.*{re.escape(value)}"):
        varlen_attention_reference(q, k, v, cu, cu_k)
