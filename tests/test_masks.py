"""attn_ext.masks.mha_mask: nn.MultiheadAttention's mask conventions -> the kernel's one mask."""

import pytest
import torch

from attn_ext.masks import mha_mask

N, H, L, S = 2, 3, 4, 5


def _visible(mask, extra=0):
    """The kernel mask as a dense (N, H, L, S + extra) 'may attend' bool tensor."""
    full = (N, H, L, S + extra)
    if mask.dtype == torch.bool:
        return mask.expand(full)
    return ~torch.isneginf(mask.expand(full))


def test_no_masks_give_none():
    assert mha_mask(None, None, N, H, L, S, 0, torch.float32) is None


def test_bool_masks_flip_polarity_and_combine_without_float():
    am = torch.rand(L, S) < 0.3
    kpm = torch.rand(N, S) < 0.3
    m = mha_mask(am, kpm, N, H, L, S, 0, torch.float32)
    assert m.dtype == torch.bool
    expected = ~am[None, None] & ~kpm[:, None, None, :]
    assert torch.equal(m.expand(N, H, L, S), expected.expand(N, H, L, S))


def test_float_attn_mask_is_a_view_in_the_query_dtype():
    am = torch.randn(L, S)
    m = mha_mask(am, None, N, H, L, S, 0, torch.float32)
    assert m.data_ptr() == am.data_ptr(), "a float mask of the query's dtype must not be copied"
    assert mha_mask(am.double(), None, N, H, L, S, 0, torch.float32).dtype == torch.float32


def test_mixed_masks_add_as_float_with_minus_inf_for_true():
    am = torch.randn(N * H, L, S)
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[1, 2] = True
    m = mha_mask(am, kpm, N, H, L, S, 0, torch.float64)
    assert m.dtype == torch.float64 and m.shape == (N, H, L, S)
    assert torch.isneginf(m[1, :, :, 2]).all()
    assert torch.equal(m[0], am.view(N, H, L, S)[0].double())


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_appended_keys_are_visible_to_every_query(kind):
    am = (torch.rand(L, S) < 0.5) if kind == "bool" else torch.randn(L, S).masked_fill(torch.rand(L, S) < 0.5,
                                                                                        float("-inf"))
    m = mha_mask(am, None, N, H, L, S, 2, torch.float32)
    assert m.shape[-1] == S + 2
    assert _visible(m, 2)[..., S:].all()


def test_float_mask_gradient_flows_through():
    am = torch.randn(N * H, L, S, requires_grad=True)
    kpm = torch.randn(N, S, requires_grad=True)
    mha_mask(am, kpm, N, H, L, S, 1, torch.float32).sum().backward()
    assert torch.equal(am.grad, torch.ones_like(am)) and torch.equal(kpm.grad, torch.full_like(kpm, H * L))


@pytest.mark.parametrize("am,kpm,pattern", [
    (torch.zeros(L, S + 1), None, r"\(4, 5\), got \(4, 6\)"),
    (torch.zeros(N, L, S), None, r"\(6, 4, 5\), got \(2, 4, 5\)"),
    (torch.zeros(L, S, dtype=torch.int8), None, r"int8"),
    (None, torch.zeros(N + 1, S, dtype=torch.bool), r"\(2, 5\), got \(3, 5\)"),
    (None, torch.zeros(N, S, dtype=torch.int32), r"int32"),
], ids=["2d_shape", "3d_shape", "attn_int", "kpm_shape", "kpm_int"])
def test_bad_masks_raise_naming_the_value(am, kpm, pattern):
    with pytest.raises((RuntimeError, TypeError), match=pattern):
        mha_mask(am, kpm, N, H, L, S, 0, torch.float32)


def test_causal_hint_checks_attn_mask_but_leaves_it_out():
    am = torch.zeros(L, S)
    kpm = torch.rand(N, S) < 0.3
    hinted = mha_mask(am, kpm, N, H, L, S, 0, torch.float32, attn_mask_is_causal=True)
    assert torch.equal(hinted, mha_mask(None, kpm, N, H, L, S, 0, torch.float32))
    assert mha_mask(am, None, N, H, L, S, 0, torch.float32, attn_mask_is_causal=True) is None
    with pytest.raises(RuntimeError, match=r"\(4, 5\), got \(4, 6\)"):
        mha_mask(torch.zeros(L, S + 1), None, N, H, L, S, 0, torch.float32, attn_mask_is_causal=True)
