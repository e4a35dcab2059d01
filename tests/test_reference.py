"""The float64 reference (attn_ext/reference.py) against PyTorch and explicit math.

No compiled attn_ext is needed here: everything else is only as good as this file.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    attention_probs_reference,
    attention_reference,
    causal_visible,
    make_mask,
    make_qkv,
)

F64 = torch.float64
# Two float64 computations of the same small attention differ by a few ulps.
TOL = dict(rtol=1e-10, atol=1e-12)


def _torch_math(q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _check_against_torch(q, k, v, ref_kwargs, torch_kwargs, seed=0):
    """Forward and q/k/v (and float mask) gradients of the reference vs torch, float64."""
    out, lse = attention_reference(q, k, v, **ref_kwargs)
    expected = _torch_math(q, k, v, **torch_kwargs)
    torch.testing.assert_close(out, expected, **TOL)
    assert lse.shape == q.shape[:-1]

    gen = torch.Generator().manual_seed(seed + 1)
    g = torch.randn(out.shape, generator=gen, dtype=F64).to(q.device)
    inputs = [q, k, v]
    mask = ref_kwargs.get("attn_mask")
    if mask is not None and mask.requires_grad:
        inputs.append(mask)
    got_grads = torch.autograd.grad(out, inputs, g)
    expected_grads = torch.autograd.grad(expected, inputs, g)
    for name, a, b in zip(["query", "key", "value", "attn_mask"], got_grads, expected_grads):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("L,S", [(7, 7), (5, 11), (12, 3), (1, 9), (9, 1)])
def test_reference_matches_torch_without_mask(device, L, S):
    q, k, v = make_qkv(2, 3, 3, L, S, 8, 6, F64, device, seed=L * 100 + S, requires_grad=True)
    _check_against_torch(q, k, v, {}, {})


@pytest.mark.parametrize("mask_shape", [(7, 11), (1, 11), (2, 1, 1, 11), (1, 3, 7, 11), (2, 3, 7, 11), (3, 1, 11)])
@pytest.mark.parametrize("kind", ["bool", "float", "float_neg_inf"])
def test_reference_matches_torch_with_masks(device, kind, mask_shape):
    q, k, v = make_qkv(2, 3, 3, 7, 11, 8, 5, F64, device, seed=1, requires_grad=True)
    # keep_prob high so torch's math path sees few fully masked rows (both give 0 there).
    mask = make_mask(kind, mask_shape, F64, device, seed=2, requires_grad=kind == "float",
                     keep_prob=0.8)
    _check_against_torch(q, k, v, {"attn_mask": mask}, {"attn_mask": mask})


@pytest.mark.parametrize("L,S", [(7, 7), (5, 11), (11, 5)])
def test_reference_causal_top_left_matches_torch(device, L, S):
    q, k, v = make_qkv(2, 2, 2, L, S, 8, 8, F64, device, seed=3, requires_grad=True)
    _check_against_torch(q, k, v, {"is_causal": True}, {"is_causal": True})


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 3), (4, 1), (2, 2)])
def test_reference_gqa_matches_torch(device, hq, hkv):
    q, k, v = make_qkv(2, hq, hkv, 6, 9, 8, 4, F64, device, seed=4, requires_grad=True)
    _check_against_torch(q, k, v, {"enable_gqa": True}, {"enable_gqa": True})


def test_reference_gqa_reads_kv_head_h_div_group(device):
    q, k, v = make_qkv(1, 6, 2, 5, 7, 8, 8, F64, device, seed=5)
    out, _ = attention_reference(q, k, v, enable_gqa=True)
    for h in range(6):
        kv = h // 3
        expected, _ = attention_reference(q[:, h], k[:, kv], v[:, kv])
        torch.testing.assert_close(out[:, h], expected, **TOL)


@pytest.mark.parametrize("scale", [0.1, 1.0, 2.5])
def test_reference_scale_matches_torch(device, scale):
    q, k, v = make_qkv(2, 2, 2, 6, 8, 8, 8, F64, device, seed=6, requires_grad=True)
    _check_against_torch(q, k, v, {"scale": scale}, {"scale": scale})


def test_reference_3d_and_5d_inputs_match_torch(device):
    gen = torch.Generator().manual_seed(7)
    q3, k3, v3 = (torch.randn(s, generator=gen, dtype=F64).to(device).requires_grad_()
                  for s in [(3, 5, 8), (3, 9, 8), (3, 9, 4)])
    _check_against_torch(q3, k3, v3, {}, {})
    q5, k5, v5 = make_qkv(None, 2, 2, 5, 9, 8, 4, F64, device, seed=8, requires_grad=True,
                          batch=(2, 3))
    _check_against_torch(q5, k5, v5, {"is_causal": True}, {"is_causal": True})


def test_reference_lse_matches_torch_cpu_kernel():
    q, k, v = make_qkv(2, 3, 3, 7, 11, 8, 8, F64, "cpu", seed=9)
    mask = make_mask("float", (7, 11), F64, "cpu", seed=10)
    _, lse = attention_reference(q, k, v, attn_mask=mask)
    _, expected = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask)
    torch.testing.assert_close(lse, expected.to(F64), **TOL)
    # and by definition
    scores = q @ k.transpose(-2, -1) / math.sqrt(8) + mask
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **TOL)


def _explicit_causal_attention(q, k, v, alignment):
    """Row-by-row softmax over the visible keys, in plain Python loops."""
    L, S = q.size(-2), k.size(-2)
    offset = 0 if alignment == "top_left" else S - L
    out = torch.zeros(q.shape[:-1] + (v.size(-1),), dtype=F64, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=F64, device=q.device)
    for i in range(L):
        last = min(S - 1, i + offset)
        if last < 0:
            continue  # no visible key: output 0, lse -inf
        s = q[..., i : i + 1, :] @ k[..., : last + 1, :].transpose(-2, -1) / math.sqrt(q.size(-1))
        m = s.max(-1, keepdim=True).values
        e = torch.exp(s - m)
        out[..., i, :] = ((e / e.sum(-1, keepdim=True)) @ v[..., : last + 1, :]).squeeze(-2)
        lse[..., i] = (m + torch.log(e.sum(-1, keepdim=True))).squeeze(-1).squeeze(-1)
    return out, lse


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(6, 6), (4, 10), (10, 4), (1, 7), (7, 1)])
def test_reference_causal_alignments_match_explicit_loops(device, alignment, L, S):
    q, k, v = make_qkv(2, 2, 2, L, S, 8, 5, F64, device, seed=11)
    out, lse = attention_reference(q, k, v, is_causal=True, causal_alignment=alignment)
    expected_out, expected_lse = _explicit_causal_attention(q, k, v, alignment)
    torch.testing.assert_close(out, expected_out, **TOL)
    torch.testing.assert_close(lse, expected_lse, **TOL)


def test_reference_bottom_right_equals_top_left_when_square(device):
    q, k, v = make_qkv(2, 2, 2, 7, 7, 8, 8, F64, device, seed=12)
    a, _ = attention_reference(q, k, v, is_causal=True, causal_alignment="bottom_right")
    b, _ = attention_reference(q, k, v, is_causal=True, causal_alignment="top_left")
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_reference_causal_with_mask_applies_both(device, alignment, kind):
    L, S = 6, 9
    q, k, v = make_qkv(2, 2, 2, L, S, 8, 8, F64, device, seed=13, requires_grad=True)
    mask = make_mask(kind, (2, 1, L, S), F64, device, seed=14, requires_grad=kind == "float",
                     keep_prob=0.9)
    visible = causal_visible(L, S, alignment, device)
    combined = mask & visible if kind == "bool" else mask.masked_fill(~visible, float("-inf"))
    _check_against_torch(
        q, k, v,
        {"attn_mask": mask, "is_causal": True, "causal_alignment": alignment},
        {"attn_mask": combined},
    )


def _fully_masked_cases(device):
    L, S = 6, 8
    q, k, v = make_qkv(2, 2, 2, L, S, 8, 4, F64, device, seed=15, requires_grad=True)
    bool_mask = torch.ones(2, 1, L, S, dtype=torch.bool, device=device)
    bool_mask[0, :, 1] = False
    bool_mask[1, :, 4] = False
    float_mask = make_mask("float", (L, S), F64, device, seed=16)
    float_mask[2] = float("-inf")
    float_mask.requires_grad_(True)
    rows_bool = torch.zeros(2, 2, L, dtype=torch.bool, device=device)
    rows_bool[0, :, 1] = True
    rows_bool[1, :, 4] = True
    rows_float = torch.zeros(2, 2, L, dtype=torch.bool, device=device)
    rows_float[:, :, 2] = True
    # bottom_right with L > S: rows i < L - S see no key
    qb, kb, vb = make_qkv(2, 2, 2, 9, 4, 8, 4, F64, device, seed=17, requires_grad=True)
    rows_br = torch.zeros(2, 2, 9, dtype=torch.bool, device=device)
    rows_br[:, :, :5] = True
    # S = 0: every row
    q0, k0, v0 = make_qkv(2, 2, 2, 3, 0, 8, 4, F64, device, seed=18, requires_grad=True)
    rows_0 = torch.ones(2, 2, 3, dtype=torch.bool, device=device)
    return [
        ((q, k, v), {"attn_mask": bool_mask}, rows_bool),
        ((q, k, v), {"attn_mask": float_mask}, rows_float),
        ((qb, kb, vb), {"is_causal": True, "causal_alignment": "bottom_right"}, rows_br),
        ((q0, k0, v0), {}, rows_0),
    ]


@pytest.mark.parametrize("case", range(4), ids=["bool_mask", "float_mask_neg_inf",
                                                "bottom_right_L_gt_S", "S_zero"])
def test_reference_fully_masked_rows_are_zero_with_neg_inf_lse_and_zero_grad(device, case):
    (q, k, v), kwargs, rows = _fully_masked_cases(device)[case]
    out, lse = attention_reference(q, k, v, **kwargs)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[rows] == 0).all()
    assert torch.isneginf(lse[rows]).all()
    assert torch.isfinite(lse[~rows]).all()
    gen = torch.Generator().manual_seed(19)
    g_out = torch.randn(out.shape, generator=gen, dtype=F64).to(device)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=F64).to(device)
    # the lse gradient of a -inf row is ignored: weight finite entries only
    loss = (out * g_out).sum() + torch.where(rows, 0.0, lse * g_lse).sum()
    inputs = [q, k, v] + [m for m in kwargs.values() if torch.is_tensor(m) and m.requires_grad]
    gq, *others = torch.autograd.grad(loss, inputs)
    for g in [gq, *others]:
        assert not torch.isnan(g).any()
    assert (gq[rows] == 0).all()
    if "attn_mask" in kwargs and kwargs["attn_mask"].requires_grad:
        assert (others[-1][2] == 0).all()


def test_reference_probs_are_softmax_rows_summing_to_one(device):
    q, k, _ = make_qkv(2, 4, 2, 5, 9, 8, 8, F64, device, seed=20)
    mask = make_mask("bool", (5, 9), F64, device, seed=21)
    mask[3] = False
    p = attention_probs_reference(q, k, attn_mask=mask, enable_gqa=True)
    kk = k.repeat_interleave(2, dim=-3)
    scores = (q @ kk.transpose(-2, -1) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    expected = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)
    torch.testing.assert_close(p, expected, **TOL)
    sums = p.sum(-1)
    torch.testing.assert_close(sums[..., 3], torch.zeros_like(sums[..., 3]))
    keep_rows = [i for i in range(5) if i != 3]
    torch.testing.assert_close(sums[..., keep_rows], torch.ones_like(sums[..., keep_rows]), **TOL)


def test_reference_dropout_scales_kept_probabilities(device):
    q, k, v = make_qkv(2, 2, 2, 5, 7, 8, 6, F64, device, seed=22)
    gen = torch.Generator().manual_seed(23)
    keep = (torch.rand(2, 2, 5, 7, generator=gen) > 0.3).to(device)
    out, lse = attention_reference(q, k, v, dropout_p=0.3, dropout_mask=keep)
    p = attention_probs_reference(q, k)
    torch.testing.assert_close(out, (p * keep / 0.7) @ v, **TOL)
    _, lse_plain = attention_reference(q, k, v)
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=0)  # lse is before dropout


def test_reference_dropout_without_mask_raises(device):
    q, k, v = make_qkv(1, 1, 1, 3, 3, 4, 4, F64, device, seed=24)
    with pytest.raises(ValueError, match="dropout_mask"):
        attention_reference(q, k, v, dropout_p=0.1)


def test_reference_rejects_unknown_causal_alignment(device):
    q, k, v = make_qkv(1, 1, 1, 3, 3, 4, 4, F64, device, seed=25)
    with pytest.raises(ValueError, match="center"):
        attention_reference(q, k, v, is_causal=True, causal_alignment="center")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_casts_low_precision_inputs_to_float64(device, dtype):
    q, k, v = make_qkv(1, 2, 2, 4, 6, 8, 8, dtype, device, seed=26)
    out, lse = attention_reference(q, k, v)
    assert out.dtype == F64 and lse.dtype == F64
    expected, _ = attention_reference(q.double(), k.double(), v.double())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
