"""attn_ext.scaled_dot_product_attention forward vs the float64 reference.

Every case uses the tolerance rule of helpers.py: attn_ext's relative error must be
at most 2 x PyTorch's own error at the same dtype (plus a small floor).
"""

import math

import pytest
import torch

from helpers import (
    DTYPES,
    assert_close_by_rule,
    ERR_FACTOR,
    FLOOR,
    attention_reference,
    lse_dtype,
    make_generator,
    make_mask,
    make_qkv,
    randn,
    rel_err,
    run_forward_case,
    sdpa,
    torch_explicit_lse,
)

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))

# (B, H, L, S, E, Ev): odd sizes, L != S, L or S = 1, every supported head dim, Ev != E
SHAPES = [
    (2, 3, 17, 17, 16, 16),
    (2, 2, 17, 129, 64, 64),
    (1, 2, 129, 17, 80, 80),
    (2, 2, 1, 33, 128, 128),
    (2, 2, 33, 1, 8, 8),
    (1, 1, 1, 1, 16, 16),
    (1, 4, 9, 23, 16, 40),
    (2, 2, 129, 129, 64, 32),
    (1, 2, 64, 64, 128, 128),
    (3, 1, 31, 47, 8, 24),
]


@dtypes
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}L{}S{}E{}Ev{}".format(*s))
def test_forward_matches_reference_over_shapes(device, dtype, shape):
    B, H, L, S, E, Ev = shape
    q, k, v = make_qkv(B, H, H, L, S, E, Ev, dtype, device, seed=sum(shape))
    run_forward_case(q, k, v)


# Query blocks of a few rows (decoding) read the key and value rows in place on the CPU; a
# head dim of 1 to 8 whole vectors keeps the query row in registers there. Head dims of whole
# vectors and not, 53 keys (past whole vectors), GQA groups as rows.
@dtypes
@pytest.mark.parametrize("E", [8, 16, 20, 32, 48, 64, 112, 128, 136])
@pytest.mark.parametrize("rows", [(1, 1), (4, 1), (3, 2)], ids=lambda r: "L{}x{}".format(*r))
def test_forward_few_query_rows_over_head_dims(device, dtype, E, rows):
    L, group = rows
    q, k, v = make_qkv(2, 2 * group, 2, L, 53, E, E, dtype, device, seed=E + L)
    run_forward_case(q, k, v, enable_gqa=group > 1)


B, H, L, S = 2, 3, 17, 23
MASK_SHAPES = [(L, S), (1, S), (B, 1, 1, S), (1, H, L, S), (B, H, L, S), (H, 1, S),
               (B, 1, L, S), (L, 1), (1, 1, 1, 1)]


@dtypes
@pytest.mark.parametrize("kind", ["bool", "float", "float_neg_inf"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_masks_of_every_flavour_and_broadcast_shape(device, dtype, kind, mask_shape):
    q, k, v = make_qkv(B, H, H, L, S, 16, 16, dtype, device, seed=1)
    mask = make_mask(kind, mask_shape, dtype, device, seed=len(mask_shape) * 7 + mask_shape[-1])
    run_forward_case(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("layout", ["expanded", "transposed", "strided_last"])
def test_forward_mask_read_through_strides(device, dtype, kind, layout):
    q, k, v = make_qkv(B, H, H, L, S, 16, 16, dtype, device, seed=2)
    if layout == "expanded":  # stride 0 on the batch, head and query dims
        mask = make_mask(kind, (1, 1, 1, S), dtype, device, seed=3).expand(B, H, L, S)
    elif layout == "transposed":  # (S, L) storage seen as (L, S)
        mask = make_mask(kind, (S, L), dtype, device, seed=3).t()
    else:
        mask = make_mask(kind, (H, L, 2 * S), dtype, device, seed=3)[..., ::2]
    run_forward_case(q, k, v, attn_mask=mask)


CAUSAL_LS = [(17, 17), (17, 29), (29, 17), (1, 33), (33, 1), (129, 17), (17, 129)]


@dtypes
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("ls", CAUSAL_LS, ids=lambda ls: "L{}S{}".format(*ls))
def test_forward_causal_both_alignments(device, dtype, alignment, ls):
    L_, S_ = ls
    q, k, v = make_qkv(2, 2, 2, L_, S_, 32, 32, dtype, device, seed=L_ + S_)
    run_forward_case(q, k, v, is_causal=True, causal_alignment=alignment)


@dtypes
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("ls", [(17, 29), (29, 17)], ids=lambda ls: "L{}S{}".format(*ls))
def test_forward_causal_combined_with_mask(device, dtype, alignment, kind, ls):
    L_, S_ = ls
    q, k, v = make_qkv(2, 2, 2, L_, S_, 16, 16, dtype, device, seed=4)
    mask = make_mask(kind, (2, 1, 1, S_), dtype, device, seed=5, keep_prob=0.8)  # padding-like
    run_forward_case(q, k, v, attn_mask=mask, is_causal=True, causal_alignment=alignment)


def test_forward_causal_default_alignment_is_top_left(device):
    q, k, v = make_qkv(2, 2, 2, 9, 13, 16, 16, torch.float64, device, seed=6)
    a = sdpa(q, k, v, is_causal=True)
    b = sdpa(q, k, v, is_causal=True, causal_alignment="top_left")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    ref, _ = attention_reference(q, k, v, is_causal=True)
    assert rel_err(a, ref) <= FLOOR[torch.float64]


@dtypes
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (6, 3), (8, 2)], ids=lambda h: "Hq{}Hkv{}".format(*h))
@pytest.mark.parametrize("variant", ["plain", "causal_and_bool_mask", "float_mask_per_head"])
def test_forward_grouped_query_attention(device, dtype, heads, variant):
    Hq, Hkv = heads
    q, k, v = make_qkv(2, Hq, Hkv, 17, 23, 16, 16, dtype, device, seed=Hq * 10 + Hkv)
    if variant == "plain":
        run_forward_case(q, k, v, enable_gqa=True)
    elif variant == "causal_and_bool_mask":
        mask = make_mask("bool", (2, 1, 17, 23), dtype, device, seed=7, keep_prob=0.8)
        run_forward_case(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True,
                         causal_alignment="bottom_right")
    else:
        mask = make_mask("float", (1, Hq, 17, 23), dtype, device, seed=8)
        run_forward_case(q, k, v, attn_mask=mask, enable_gqa=True)


@dtypes
@pytest.mark.parametrize("layout", ["transposed", "strided_last", "mixed"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "boolmask"])
def test_forward_non_contiguous_inputs(device, dtype, layout, masked):
    gen = make_generator(9)
    Bn, Hn, Ln, Sn, E = 2, 3, 17, 29, 16
    if layout == "mixed":
        q = randn((Bn, Hn, Ln, E), dtype, device, gen, "transposed")
        k = randn((Bn, Hn, Sn, E), dtype, device, gen, "strided_last")
        v = randn((Bn, Hn, Sn, 24), dtype, device, gen, "contiguous")
    else:
        q, k, v = make_qkv(Bn, Hn, Hn, Ln, Sn, E, 24, dtype, device, seed=9, layout=layout)
    assert not q.is_contiguous() and not k.is_contiguous()
    mask = make_mask("bool", (Bn, 1, Ln, Sn), dtype, device, seed=10) if masked else None
    run_forward_case(q, k, v, attn_mask=mask, is_causal=masked)


@dtypes
@pytest.mark.parametrize("variant", ["plain", "causal", "mask_LS", "mask_NLS"])
def test_forward_3d_inputs(device, dtype, variant):
    gen = make_generator(11)
    N, Ln, Sn = 3, 17, 23
    q = randn((N, Ln, 16), dtype, device, gen)
    k = randn((N, Sn, 16), dtype, device, gen)
    v = randn((N, Sn, 8), dtype, device, gen)
    mask = None
    if variant == "mask_LS":
        mask = make_mask("float", (Ln, Sn), dtype, device, seed=12)
    elif variant == "mask_NLS":
        mask = make_mask("bool", (N, Ln, Sn), dtype, device, seed=12)
    out, lse, _, _ = run_forward_case(q, k, v, attn_mask=mask, is_causal=variant == "causal")
    assert out.shape == (N, Ln, 8) and lse.shape == (N, Ln)


@dtypes
@pytest.mark.parametrize("mask_shape", [None, (17, 23), (2, 1, 1, 17, 23), (1, 3, 2, 17, 23)],
                         ids=["nomask", "LS", "N1_1_1_LS", "1_N2_H_LS"])
def test_forward_5d_inputs(device, dtype, mask_shape):
    q, k, v = make_qkv(None, 2, 2, 17, 23, 16, 8, dtype, device, seed=13, batch=(2, 3))
    mask = None if mask_shape is None else make_mask("float", mask_shape, dtype, device, seed=14)
    out, lse, _, _ = run_forward_case(q, k, v, attn_mask=mask, is_causal=mask_shape is None)
    assert out.shape == (2, 3, 2, 17, 8) and lse.shape == (2, 3, 2, 17)


ZERO_SIZES = {  # (B, H, L, S, E, Ev)
    "B0": (0, 2, 5, 7, 8, 8),
    "H0": (2, 0, 5, 7, 8, 8),
    "L0": (2, 2, 0, 7, 8, 8),
    "S0": (2, 2, 5, 0, 8, 8),
    "Ev0": (2, 2, 5, 7, 8, 0),
    "L0S0": (2, 2, 0, 0, 8, 8),
}


@dtypes
@pytest.mark.parametrize("case", list(ZERO_SIZES))
def test_forward_zero_size_dims_give_empty_or_zero_results(device, dtype, case):
    B_, H_, L_, S_, E, Ev = ZERO_SIZES[case]
    q, k, v = make_qkv(B_, H_, H_, L_, S_, E, Ev, dtype, device, seed=15)
    for causal in (False, True):
        out, lse = sdpa(q, k, v, is_causal=causal, return_lse=True)
        assert out.shape == (B_, H_, L_, Ev) and out.dtype == dtype
        assert lse.shape == (B_, H_, L_) and lse.dtype == lse_dtype(dtype)
        if S_ == 0:  # every row is fully masked
            assert (out == 0).all()
            assert torch.isneginf(lse).all()
        if case == "Ev0":  # no output columns, but the lse is still defined
            ref_lse = attention_reference(q, k, v, is_causal=causal)[1]
            baseline = torch_explicit_lse(q, k, is_causal=causal)
            assert_close_by_rule("lse", lse, ref_lse, baseline, lse_dtype(dtype))


@dtypes
@pytest.mark.parametrize("scale", [0.05, 0.3, 2.0])
def test_forward_explicit_scale(device, dtype, scale):
    q, k, v = make_qkv(2, 2, 2, 17, 23, 16, 16, dtype, device, seed=16)
    run_forward_case(q, k, v, scale=scale)


def test_forward_default_scale_is_inverse_sqrt_head_dim(device):
    q, k, v = make_qkv(2, 2, 2, 9, 11, 64, 8, torch.float64, device, seed=17)
    a = sdpa(q, k, v)
    b = sdpa(q, k, v, scale=1.0 / math.sqrt(64))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@dtypes
@pytest.mark.parametrize("variant", ["plain", "bool_mask", "causal_bottom_right_L_gt_S", "gqa",
                                     "float_mask"])
def test_forward_return_lse(device, dtype, variant):
    L_, S_ = (29, 17) if variant == "causal_bottom_right_L_gt_S" else (17, 23)
    Hkv = 1 if variant == "gqa" else 2
    q, k, v = make_qkv(2, 2, Hkv, L_, S_, 16, 16, dtype, device, seed=18)
    kwargs = {}
    if variant == "bool_mask":
        kwargs["attn_mask"] = make_mask("bool", (L_, S_), dtype, device, seed=19)
    elif variant == "float_mask":
        kwargs["attn_mask"] = make_mask("float_neg_inf", (2, 1, L_, S_), dtype, device, seed=19)
    elif variant == "gqa":
        kwargs["enable_gqa"] = True
    elif variant == "causal_bottom_right_L_gt_S":
        kwargs.update(is_causal=True, causal_alignment="bottom_right")
    out, lse, _, _ = run_forward_case(q, k, v, **kwargs)
    plain = sdpa(q, k, v, **kwargs)
    assert not isinstance(plain, tuple)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def _fully_masked_inputs(variant, dtype, device):
    """q, k, v (requiring grad), kwargs, and the (B, H, L) bool of rows with no key."""
    if variant == "bool_mask_rows_false":
        q, k, v = make_qkv(2, 2, 2, 17, 23, 16, 16, dtype, device, seed=20, requires_grad=True)
        mask = make_mask("bool", (2, 1, 17, 23), dtype, device, seed=21, keep_prob=0.8)
        mask[0, :, [0, 5, 16]] = False
        mask[1, :, 9] = False
        rows = ~mask.any(-1).expand(2, 2, 17)
        return (q, k, v), {"attn_mask": mask}, rows
    if variant == "float_mask_neg_inf_rows":
        q, k, v = make_qkv(2, 2, 2, 17, 23, 16, 16, dtype, device, seed=22, requires_grad=True)
        mask = make_mask("float", (17, 23), dtype, device, seed=23)
        mask[[3, 11]] = float("-inf")
        rows = torch.zeros(2, 2, 17, dtype=torch.bool, device=device)
        rows[..., [3, 11]] = True
        return (q, k, v), {"attn_mask": mask}, rows
    if variant == "bottom_right_L_gt_S":
        q, k, v = make_qkv(2, 2, 2, 29, 17, 16, 16, dtype, device, seed=24, requires_grad=True)
        rows = torch.zeros(2, 2, 29, dtype=torch.bool, device=device)
        rows[..., :12] = True
        return (q, k, v), {"is_causal": True, "causal_alignment": "bottom_right"}, rows
    if variant == "causal_and_padding":
        q, k, v = make_qkv(2, 2, 2, 17, 17, 16, 16, dtype, device, seed=25, requires_grad=True)
        mask = torch.ones(2, 1, 1, 17, dtype=torch.bool, device=device)
        mask[1, ..., :4] = False  # batch 1: first 4 keys are padding -> its rows 0..3 see nothing
        rows = torch.zeros(2, 2, 17, dtype=torch.bool, device=device)
        rows[1, :, :4] = True
        return (q, k, v), {"attn_mask": mask, "is_causal": True}, rows
    raise ValueError(variant)


FULLY_MASKED = ["bool_mask_rows_false", "float_mask_neg_inf_rows", "bottom_right_L_gt_S",
                "causal_and_padding"]


@dtypes
@pytest.mark.parametrize("variant", FULLY_MASKED)
def test_fully_masked_rows_are_zero_with_zero_grad(device, dtype, variant):
    (q, k, v), kwargs, rows = _fully_masked_inputs(variant, dtype, device)
    assert rows.any() and not rows.all()
    out, lse, _, _ = run_forward_case(q, k, v, **kwargs)
    assert (out[rows] == 0).all()
    assert torch.isneginf(lse[rows]).all() and torch.isfinite(lse[~rows]).all()
    g = torch.randn(out.shape, generator=make_generator(26)).to(device=device, dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    for name, t in [("query", dq), ("key", dk), ("value", dv)]:
        assert torch.isfinite(t).all(), f"grad {name} is not finite"
    assert (dq[rows] == 0).all(), "grad query of rows without keys must be exactly 0"


@dtypes
@pytest.mark.parametrize("variant", ["plain", "bool_mask", "float_mask", "causal", "gqa"])
def test_forward_matches_torch_sdpa_directly(device, dtype, variant):
    """Where torch supports the case natively, attn_ext and torch agree to within the
    sum of their errors against the reference (ERR_FACTOR + 1 times torch's)."""
    import torch.nn.functional as F

    Hkv = 1 if variant == "gqa" else 2
    q, k, v = make_qkv(2, 2, Hkv, 17, 23, 16, 16, dtype, device, seed=27)
    kwargs = {}
    if variant == "bool_mask":
        kwargs["attn_mask"] = make_mask("bool", (2, 1, 17, 23), dtype, device, seed=28, keep_prob=0.9)
    elif variant == "float_mask":
        kwargs["attn_mask"] = make_mask("float", (17, 23), dtype, device, seed=28)
    elif variant == "causal":
        kwargs["is_causal"] = True
    elif variant == "gqa":
        kwargs["enable_gqa"] = True
    out = sdpa(q, k, v, **kwargs)
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    ref, _ = attention_reference(q, k, v, **kwargs)
    torch_err = rel_err(expected, ref)
    bound = (ERR_FACTOR + 1) * torch_err + FLOOR[dtype]
    err = rel_err(out, expected)
    assert err <= bound, f"rel err vs torch SDPA {err:.3e} > {bound:.3e} (torch vs ref {torch_err:.3e})"


@pytest.mark.parametrize("where", ["one_key", "one_query_row"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["float64", "float32", "bfloat16", "float16"])
def test_nan_input_gives_nan_rows_as_torch(device, dtype, where):
    """A NaN in the input is not hidden: the rows whose scores it reaches are NaN in the
    output and the log-sum-exp (as in torch SDPA), and the other rows and heads stay finite."""
    import attn_ext

    q, k, v = make_qkv(1, 2, 2, 70, 40, 32, 16, dtype, device, seed=8)
    if where == "one_key":
        k[0, 0, 5, 3] = float("nan")  # every query row of head 0 scores key 5
        nan_rows = torch.zeros(2, 70, dtype=torch.bool, device=device)
        nan_rows[0] = True
    else:
        q[0, 0, 9, 3] = float("nan")  # only row 9 of head 0: all its scores are NaN
        nan_rows = torch.zeros(2, 70, dtype=torch.bool, device=device)
        nan_rows[0, 9] = True
    out, lse = attn_ext.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert torch.equal(out[0].isnan().any(-1), nan_rows)
    assert torch.equal(lse[0].isnan(), nan_rows)
    assert out[0][~nan_rows].isfinite().all() and lse[0][~nan_rows].isfinite().all()
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert torch.equal(want[0].isnan().any(-1), nan_rows)  # the same rows as torch's
