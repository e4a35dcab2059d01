"""Dropout: reproducible from torch.manual_seed, the kept fraction, and the forward and
backward against the reference given the very mask the kernel drew.

The keep-mask is recovered with the identity trick: with value = [I_S | V] (the S x S
identity next to the real values), the first S output columns are P * keep / (1 - p),
so keep = (those columns != 0) wherever the reference probabilities P are > 0. One
call thus gives both the mask and the output to check; its backward must use that
same mask.
"""

import pytest
import torch

from helpers import (
    ERR_FACTOR,
    FLOOR,
    attention_probs_reference,
    attention_reference,
    grads,
    leaf64,
    low_precision_leaf,
    make_generator,
    make_mask,
    make_qkv,
    rel_err,
    sdpa,
    torch_sdpa,
)

dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                                 ids=["float32", "float64", "bfloat16"])


def _value_with_identity(v):
    """[I_S | v] along the last dim, I_S broadcast over v's batch and head dims."""
    S = v.size(-2)
    eye = torch.eye(S, dtype=v.dtype, device=v.device).expand(v.shape[:-2] + (S, S))
    return torch.cat([eye, v], dim=-1)


def _variant(variant, dtype, device, seed):
    Hq, Hkv = (4, 2) if variant == "gqa" else (2, 2)
    L, S = (29, 17) if variant == "causal_bottom_right" else (17, 23)
    q, k, v = make_qkv(2, Hq, Hkv, L, S, 16, 8, dtype, device, seed=seed, requires_grad=True)
    kw = {}
    mask = None
    if variant == "bool_mask":
        mask = make_mask("bool", (2, 1, L, S), dtype, device, seed=seed + 1, keep_prob=0.8)
    elif variant == "float_mask":
        mask = make_mask("float", (1, Hq, L, S), dtype, device, seed=seed + 1, requires_grad=True)
    elif variant == "causal":
        kw.update(is_causal=True)
    elif variant == "causal_bottom_right":
        kw.update(is_causal=True, causal_alignment="bottom_right")
    elif variant == "gqa":
        kw.update(enable_gqa=True)
    return q, k, v, mask, kw


def _recover_keep(out, S, probs):
    """The kept-entries mask from the identity columns of ``out``."""
    keep = out[..., :S].detach() != 0
    # where P > 0, a dropped entry is exactly 0 and a kept one is P / (1 - p) > 0
    return keep | (probs == 0)


DROPOUT_VARIANTS = ["plain", "bool_mask", "float_mask", "causal", "causal_bottom_right", "gqa"]


@dtypes
@pytest.mark.parametrize("variant", DROPOUT_VARIANTS)
@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_forward_and_grads_match_reference_with_recovered_mask(device, dtype, variant, p):
    q, k, v0, mask, kw = _variant(variant, dtype, device, seed=int(p * 10) + len(variant))
    S = k.size(-2)
    v = _value_with_identity(v0.detach()).requires_grad_(True)
    torch.manual_seed(1234)
    out = sdpa(q, k, v, attn_mask=mask, dropout_p=p, **kw)
    assert not torch.isnan(out).any()
    probs = attention_probs_reference(q, k, attn_mask=mask, **kw)
    keep = _recover_keep(out, S, probs)
    dropped = (~keep).sum().item() / keep.numel()
    assert 0 < dropped < 1, "dropout dropped nothing or everything"

    # forward vs reference given that mask, by the rule against torch's no-dropout error
    ref_inputs = [leaf64(t) for t in (q, k, v, mask)]
    ref, _ = attention_reference(*ref_inputs[:3], attn_mask=ref_inputs[3], dropout_p=p,
                                 dropout_mask=keep, **kw)
    t_inputs = [low_precision_leaf(t) for t in (q, k, v, mask)]
    t_out = torch_sdpa(*t_inputs[:3], attn_mask=t_inputs[3], **kw)
    plain_ref, _ = attention_reference(*ref_inputs[:3], attn_mask=ref_inputs[3], **kw)
    torch_err = rel_err(t_out, plain_ref)
    err = rel_err(out, ref)
    bound = ERR_FACTOR * torch_err + FLOOR[dtype]
    assert err <= bound, (f"dropout out: rel err {err:.3e} > {ERR_FACTOR} x torch's "
                          f"(no-dropout) {torch_err:.3e} + {FLOOR[dtype]:.0e}")

    # backward: must regenerate exactly the forward's mask
    g = torch.randn(out.shape, generator=make_generator(5)).to(device=device, dtype=dtype)
    got = grads(out, [q, k, v, mask], g)
    expected = grads(ref, ref_inputs, g.to(torch.float64))
    # torch's gradient error at this dtype, on the same problem without dropout (and
    # without the identity columns: torch gets the real values only)
    g_real = g[..., S:]
    t_inputs = [low_precision_leaf(t) for t in (q, k, v0, mask)]
    t_out = torch_sdpa(*t_inputs[:3], attn_mask=t_inputs[3], **kw)
    baseline = grads(t_out, t_inputs, g_real)
    plain_inputs = [leaf64(t) for t in (q, k, v0, mask)]
    plain_out, _ = attention_reference(*plain_inputs[:3], attn_mask=plain_inputs[3], **kw)
    plain_expected = grads(plain_out, plain_inputs, g_real.to(torch.float64))
    names = ["grad query", "grad key", "grad value", "grad attn_mask"]
    for name, a, e, b, b_ref in zip(names, got, expected, baseline, plain_expected):
        if a is None:
            continue
        assert not torch.isnan(a).any(), f"{name} has NaN"
        err = rel_err(a, e)
        torch_err = rel_err(torch.nan_to_num(b, nan=0.0), b_ref)
        bound = ERR_FACTOR * torch_err + FLOOR[dtype]
        assert err <= bound, (f"dropout {name}: rel err {err:.3e} > {ERR_FACTOR} x torch's "
                              f"(no-dropout) {torch_err:.3e} + {FLOOR[dtype]:.0e}")


def test_same_seed_gives_identical_output(device):
    q, k, v = make_qkv(2, 2, 2, 33, 47, 16, 16, torch.float32, device, seed=1)
    torch.manual_seed(7)
    a = sdpa(q, k, v, dropout_p=0.4)
    torch.manual_seed(7)
    b = sdpa(q, k, v, dropout_p=0.4)
    assert torch.equal(a, b)


def test_different_seed_gives_different_output(device):
    q, k, v = make_qkv(2, 2, 2, 33, 47, 16, 16, torch.float32, device, seed=2)
    torch.manual_seed(7)
    a = sdpa(q, k, v, dropout_p=0.4)
    torch.manual_seed(8)
    b = sdpa(q, k, v, dropout_p=0.4)
    assert not torch.equal(a, b)


def test_consecutive_calls_draw_new_masks(device):
    q, k, v = make_qkv(2, 2, 2, 33, 47, 16, 16, torch.float32, device, seed=3)
    torch.manual_seed(7)
    a = sdpa(q, k, v, dropout_p=0.4)
    b = sdpa(q, k, v, dropout_p=0.4)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kept_fraction_is_close_to_one_minus_p(device, p):
    B_, H_, L_, S_ = 4, 4, 64, 64  # 65536 draws: binomial std <= 0.002
    q, k, _ = make_qkv(B_, H_, H_, L_, S_, 16, 16, torch.float32, device, seed=4)
    v = torch.eye(S_, device=device).expand(B_, H_, S_, S_).contiguous()
    torch.manual_seed(11)
    out = sdpa(q, k, v, dropout_p=p)
    kept = (out != 0).double().mean().item()
    assert abs(kept - (1 - p)) < 0.01, f"kept fraction {kept:.4f}, expected {1 - p:.4f}"
    # kept entries are P / (1 - p): undo the scale and compare with float32 roundoff room
    probs = attention_probs_reference(q, k)
    scaled = out.double()[out != 0] * (1 - p)
    torch.testing.assert_close(scaled, probs[out != 0], rtol=1e-5, atol=1e-7)


def test_dropout_masks_differ_across_batch_and_heads(device):
    S_ = 32
    q, k, _ = make_qkv(2, 2, 2, 32, S_, 16, 16, torch.float32, device, seed=5)
    v = torch.eye(S_, device=device).expand(2, 2, S_, S_).contiguous()
    torch.manual_seed(12)
    keep = sdpa(q, k, v, dropout_p=0.5) != 0
    assert not torch.equal(keep[0, 0], keep[0, 1]), "heads share one dropout mask"
    assert not torch.equal(keep[0, 0], keep[1, 0]), "batch entries share one dropout mask"
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1]), "rows share one dropout mask"


def test_dropout_p_zero_is_deterministic_and_equals_no_dropout(device):
    q, k, v = make_qkv(2, 2, 2, 17, 23, 16, 16, torch.float32, device, seed=6)
    a = sdpa(q, k, v, dropout_p=0.0)
    b = sdpa(q, k, v)
    assert torch.equal(a, b)


def test_dropout_does_not_touch_the_lse(device):
    q, k, v = make_qkv(2, 2, 2, 17, 23, 16, 16, torch.float64, device, seed=7)
    torch.manual_seed(3)
    _, lse_drop = sdpa(q, k, v, dropout_p=0.5, return_lse=True)
    _, lse = sdpa(q, k, v, return_lse=True)
    torch.testing.assert_close(lse_drop, lse, rtol=0, atol=0)
