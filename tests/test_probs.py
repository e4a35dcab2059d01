"""attn_ext.attention_probs: the explicit probabilities op, forward and backward,
against the float64 reference, gradcheck, opcheck, and its agreement with the
fused kernel under dropout."""

import math

import pytest
import torch

from attn_ext.reference import attention_probs_reference
from helpers import (FLOOR, ERR_FACTOR, attn_ext_module, make_mask, make_qkv, op_args, rel_err)

CASES = {
    "plain": dict(),
    "L_ne_S_odd": dict(L=17, S=29),
    "bool_mask": dict(mask=("bool", (2, 1, 9, 13))),
    "float_mask": dict(mask=("float", (9, 13))),
    "causal_top_left": dict(is_causal=True),
    "causal_bottom_right_L_gt_S": dict(is_causal=True, causal_alignment="bottom_right", L=13, S=9),
    "causal_and_mask": dict(is_causal=True, mask=("bool", (9, 13))),
    "gqa": dict(Hq=4, Hkv=2, enable_gqa=True),
    "long_keys": dict(S=300),
}


def _inputs(case, dtype, device, requires_grad=False, seed=0, layout="contiguous"):
    cfg = CASES[case]
    Hq, Hkv = cfg.get("Hq", 2), cfg.get("Hkv", 2)
    L, S = cfg.get("L", 9), cfg.get("S", 13)
    q, k, _ = make_qkv(2, Hq, Hkv, L, S, 8, 8, dtype, device, seed=seed, layout=layout,
                       requires_grad=requires_grad)
    mask = None
    if "mask" in cfg:
        kind, shape = cfg["mask"]
        shape = tuple(L if s == 9 else S if s == 13 else s for s in shape)
        mask = make_mask(kind, shape, dtype, device, seed=seed + 1,
                         requires_grad=requires_grad and kind == "float")
    kwargs = dict(is_causal=cfg.get("is_causal", False), enable_gqa=cfg.get("enable_gqa", False),
                  causal_alignment=cfg.get("causal_alignment", "top_left"))
    return q, k, mask, kwargs


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_probs_match_reference(case, dtype, device):
    attn_ext = attn_ext_module()
    q, k, mask, kwargs = _inputs(case, dtype, device)
    got = attn_ext.attention_probs(q, k, mask, **kwargs)
    ref = attention_probs_reference(q, k, mask, **kwargs)
    assert got.dtype == dtype and got.shape == ref.shape
    assert not torch.isnan(got).any()
    # The baseline error: the exact probabilities rounded to the dtype (stricter
    # than torch's own softmax at the dtype, which adds its rounding of the scores).
    torch_got = ref.to(dtype)
    bound = ERR_FACTOR * rel_err(torch_got, ref) + FLOOR[dtype]
    assert rel_err(got, ref) <= bound


def test_fully_masked_rows_are_zero_with_zero_grad(device):
    attn_ext = attn_ext_module()
    q, k, _ = make_qkv(1, 2, 2, 6, 5, 8, 8, torch.float64, device, seed=3, requires_grad=True)
    mask = torch.ones(6, 5, dtype=torch.bool, device=device)
    mask[2] = False
    probs = attn_ext.attention_probs(q, k, mask)
    assert (probs[:, :, 2] == 0).all()
    (probs * torch.randn_like(probs)).sum().backward()
    assert (q.grad[:, :, 2] == 0).all()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("case", list(CASES))
def test_probs_backward_matches_reference(case, device):
    attn_ext = attn_ext_module()
    q, k, mask, kwargs = _inputs(case, torch.float32, device, requires_grad=True, seed=5)
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    m64 = None if mask is None or mask.dtype == torch.bool else mask.detach().double().requires_grad_()
    got = attn_ext.attention_probs(q, k, mask, **kwargs)
    ref = attention_probs_reference(q64, k64, mask if m64 is None else m64, **kwargs)
    grad = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    got_grads = torch.autograd.grad(got, [t for t in (q, k, mask) if t is not None and t.requires_grad],
                                    grad.float())
    ref_grads = torch.autograd.grad(ref, [t for t in (q64, k64, m64) if t is not None], grad)
    for g, r in zip(got_grads, ref_grads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_probs_gradcheck(case, device):
    attn_ext = attn_ext_module()
    q, k, mask, kwargs = _inputs(case, torch.float64, device, requires_grad=True, seed=7)
    inputs = [q, k] + ([mask] if mask is not None and mask.requires_grad else [])

    def fn(q, k, *m):
        return attn_ext.attention_probs(q, k, m[0] if m else mask, **kwargs)

    # Several key tiles (S = 300) make the full Jacobian slow: check random projections of it.
    assert torch.autograd.gradcheck(fn, tuple(inputs), fast_mode=case == "long_keys")


def test_probs_gradcheck_with_dropout_and_transposed_inputs(device):
    attn_ext = attn_ext_module()
    q, k, _ = make_qkv(2, 2, 2, 7, 9, 8, 8, torch.float64, device, seed=2, layout="transposed",
                       requires_grad=True)

    def fn(q, k):
        torch.manual_seed(0)
        return attn_ext.attention_probs(q, k, dropout_p=0.3, is_causal=True)

    assert torch.autograd.gradcheck(fn, (q, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probs_with_dropout_times_value_equals_fused_output(dtype, device):
    # Same seed, same Philox mapping: the explicit probabilities are exactly the
    # fused kernel's dropped probabilities, so probs @ v == scaled_dot_product_attention.
    attn_ext = attn_ext_module()
    q, k, v = make_qkv(2, 4, 2, 33, 70, 16, 16, dtype, device, seed=11)
    mask = make_mask("bool", (33, 70), dtype, device, seed=12)
    kw = dict(dropout_p=0.4, is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    torch.manual_seed(123)
    probs = attn_ext.attention_probs(q, k, mask, **kw)
    torch.manual_seed(123)
    out = attn_ext.scaled_dot_product_attention(q, k, v, mask, **kw)
    expected = probs @ v.repeat_interleave(2, dim=1)
    assert rel_err(out, expected) < (1e-12 if dtype == torch.float64 else 1e-5)
    visible = attention_probs_reference(q, k, mask, is_causal=True, enable_gqa=True,
                                        causal_alignment="bottom_right") > 0
    dropped = (probs == 0) & visible
    assert 0.35 < dropped.sum().item() / visible.sum().item() < 0.45


def test_probs_rows_sum_to_one_over_3d_and_5d_inputs(device):
    attn_ext = attn_ext_module()
    g = torch.Generator().manual_seed(0)
    q3, k3 = torch.randn(3, 10, 8, generator=g).to(device), torch.randn(3, 12, 8, generator=g).to(device)
    p3 = attn_ext.attention_probs(q3, k3)
    assert p3.shape == (3, 10, 12)
    torch.testing.assert_close(p3.sum(-1), torch.ones(3, 10, device=device))
    q5, k5 = torch.randn(2, 3, 4, 10, 8, generator=g).to(device), torch.randn(2, 3, 4, 12, 8, generator=g).to(device)
    p5 = attn_ext.attention_probs(q5, k5, scale=0.5)
    torch.testing.assert_close(p5, attention_probs_reference(q5, k5, scale=0.5).float())


def _probs_values(dtype, device, with_mask, dropout):
    """attention_probs' arguments by name (helpers.op_args puts them in schema order)."""
    q, k, _ = make_qkv(2, 4, 2, 6, 10, 8, 8, dtype, device, seed=1, requires_grad=True)
    mask = make_mask("float", (1, 4, 6, 10), dtype, device, seed=2, requires_grad=True) if with_mask else None
    seed = torch.tensor([99], dtype=torch.int64, device=device) if dropout else None
    return dict(query=q, key=k, attn_mask=mask, dropout_p=0.2 if dropout else 0.0, is_causal=True,
                causal_offset=4, scale=1 / math.sqrt(8), dropout_seed=seed)


@pytest.mark.parametrize("with_mask", [False, True], ids=["no_mask", "float_mask"])
@pytest.mark.parametrize("dropout", [False, True], ids=["no_dropout", "dropout"])
def test_opcheck_attention_probs(with_mask, dropout, device):
    attn_ext_module()
    op = torch.ops.attn_ext.attention_probs.default
    torch.library.opcheck(op, op_args(op, **_probs_values(torch.float64, device, with_mask, dropout)))


def test_opcheck_attention_probs_backward(device):
    attn_ext_module()
    values = _probs_values(torch.float64, device, True, True)
    values = {n: (t.detach() if torch.is_tensor(t) else t) for n, t in values.items()}
    fwd = torch.ops.attn_ext.attention_probs.default
    probs, lse = fwd(*op_args(fwd, **values))
    op = torch.ops.attn_ext.attention_probs_backward.default
    args = op_args(op, grad_probs=torch.randn_like(probs), grad_lse=torch.randn_like(lse), probs=probs, lse=lse,
                   compute_grad_mask=True, **values)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
