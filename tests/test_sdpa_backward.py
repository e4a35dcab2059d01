"""Gradients of attn_ext.scaled_dot_product_attention.

Two kinds of checks:
- gradients at float32 / bfloat16 / float16 against float64 reference autograd, by the
  tolerance rule (attn_ext's error <= 2 x torch's own gradient error + floor);
- torch.autograd.gradcheck in float64 on tiny shapes, for every differentiable path.
"""

import pytest
import torch

from helpers import (
    attention_reference,
    leaf64,
    make_generator,
    make_mask,
    make_qkv,
    randn,
    run_backward_case,
    run_forward_case,
    sdpa,
)

LOW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
low_dtypes = pytest.mark.parametrize("dtype", LOW_DTYPES, ids=lambda d: str(d).replace("torch.", ""))


def _case(variant, dtype, device, seed=0):
    """(query, key, value, attn_mask, kwargs) for a named backward case; float masks
    that should get a gradient require grad."""
    kw = {}
    mask = None
    B, Hq, Hkv, L, S, E, Ev = 2, 2, 2, 17, 23, 16, 16
    layout = "contiguous"
    batch = None
    if variant == "large_odd":
        B, Hq, Hkv, L, S, E, Ev = 1, 2, 2, 33, 129, 64, 64
    elif variant == "Ev_ne_E":
        E, Ev = 80, 24
    elif variant == "L_is_1":
        L = 1
    elif variant == "S_is_1":
        S = 1
    elif variant == "non_contiguous":
        layout = "transposed"
    elif variant == "5d":
        batch = (2, 3)
    elif variant.startswith("gqa"):
        Hq, Hkv = 4, 2
    if variant in ("causal_bottom_right_L_gt_S",):
        L, S = 29, 17
    q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, device, seed=seed, layout=layout,
                       requires_grad=True, batch=batch)
    lead = (B,) if batch is None else batch
    if variant == "bool_mask":
        mask = make_mask("bool", lead + (1, L, S), dtype, device, seed=seed + 1, keep_prob=0.8)
    elif variant.startswith("float_mask_"):
        shape = {
            "float_mask_full": lead + (Hq, L, S),
            "float_mask_LS": (L, S),
            "float_mask_B11S": (B, 1, 1, S),
            "float_mask_1HLS": (1, Hq, L, S),
            "float_mask_H1S": (Hq, 1, S),
        }[variant]
        mask = make_mask("float", shape, dtype, device, seed=seed + 1, requires_grad=True)
    elif variant == "causal_top_left":
        kw.update(is_causal=True)
    elif variant in ("causal_bottom_right", "causal_bottom_right_L_gt_S"):
        kw.update(is_causal=True, causal_alignment="bottom_right")
    elif variant == "causal_and_bool_mask":
        mask = make_mask("bool", (B, 1, 1, S), dtype, device, seed=seed + 1, keep_prob=0.8)
        kw.update(is_causal=True, causal_alignment="bottom_right")
    elif variant == "causal_and_float_mask":
        mask = make_mask("float", (1, 1, L, S), dtype, device, seed=seed + 1, requires_grad=True)
        kw.update(is_causal=True)
    elif variant == "gqa":
        kw.update(enable_gqa=True)
    elif variant == "gqa_causal_float_mask":
        mask = make_mask("float", (Hq, L, S), dtype, device, seed=seed + 1, requires_grad=True)
        kw.update(enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
    elif variant == "scale":
        kw.update(scale=0.7)
    elif variant == "5d":
        kw.update(is_causal=True)
    return q, k, v, mask, kw


VARIANTS = [
    "plain", "large_odd", "Ev_ne_E", "L_is_1", "S_is_1", "non_contiguous", "5d", "scale",
    "bool_mask", "float_mask_full", "float_mask_LS", "float_mask_B11S", "float_mask_1HLS",
    "float_mask_H1S", "causal_top_left", "causal_bottom_right", "causal_bottom_right_L_gt_S",
    "causal_and_bool_mask", "causal_and_float_mask", "gqa", "gqa_causal_float_mask",
]


@low_dtypes
@pytest.mark.parametrize("variant", VARIANTS)
def test_grads_match_reference(device, dtype, variant):
    q, k, v, mask, kw = _case(variant, dtype, device, seed=len(variant))
    run_backward_case(q, k, v, attn_mask=mask, seed=len(variant), **kw)


@low_dtypes
@pytest.mark.parametrize("variant", ["plain", "float_mask_B11S", "causal_bottom_right", "gqa"])
def test_grads_through_lse_match_reference(device, dtype, variant):
    q, k, v, mask, kw = _case(variant, dtype, device, seed=3)
    run_backward_case(q, k, v, attn_mask=mask, lse_weight=True, seed=3, **kw)


# Every head dim the CUDA tensor-core kernels have, over several key blocks (the
# backward's CTA owns 64-128 keys) with a partial last one. Top-left causal with
# S > L leaves whole key blocks that no query sees (their dK, dV are zero);
# bottom-right with L > S leaves query rows with no key. GQA sums dK, dV over
# each group; a float mask takes its gradient.
BLOCK_VARIANTS = {
    "plain": dict(L=70, S=300),
    "causal_top_left_S_gt_L": dict(L=70, S=300, is_causal=True),
    "causal_bottom_right_L_gt_S": dict(L=300, S=70, is_causal=True, causal_alignment="bottom_right"),
    "gqa_float_mask": dict(L=130, S=190, gqa=True, mask=True),
    # The CUDA tensor-core backward takes its long-sequence tiles when a key sees
    # more than short_rows query rows on average (L, or L / 2 causal; short_rows in
    # csrc/cuda/attention_tc.cuh: 1024 at E = 64, 512 at E = 128); the cases above
    # take the short tiles.
    "long_queries": dict(L=1100, S=70),
    "long_queries_causal_bottom_right": dict(L=2100, S=300, is_causal=True, causal_alignment="bottom_right"),
}


@low_dtypes
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("variant", list(BLOCK_VARIANTS))
def test_grads_over_head_dims_and_key_blocks(device, dtype, head_dim, variant):
    cfg = dict(BLOCK_VARIANTS[variant])
    L, S = cfg.pop("L"), cfg.pop("S")
    Hq, Hkv = (4, 2) if cfg.pop("gqa", False) else (2, 2)
    seed = head_dim + L
    q, k, v = make_qkv(1, Hq, Hkv, L, S, head_dim, head_dim, dtype, device, seed=seed, requires_grad=True)
    mask = None
    if cfg.pop("mask", False):
        mask = make_mask("float", (1, Hq, L, S), dtype, device, seed=seed + 1, requires_grad=True)
    run_backward_case(q, k, v, attn_mask=mask, enable_gqa=Hq != Hkv, seed=seed, **cfg)



@low_dtypes
@pytest.mark.parametrize("rows", [1, 6, 7, 8, 9, 12, 15, 16, 17, 65])
def test_row_counts_at_the_kernel_paths_boundaries(device, dtype, rows):
    """Query row counts on both sides of where the CPU kernels change path (at::vec:
    keys read in place up to 6 rows, packed from 7; bfloat16: in-place dot products up
    to 8 rows, the 16-row tile products from 9 on, a second, partial tile from 17; 65:
    a 5-row last block after a 60-row one, which packs), forward and backward, bottom-right causal over 300 keys
    with grouped-query heads and a bool key-padding mask (as a batched decoding or
    speculative step has them)."""
    q, k, v = make_qkv(2, 4, 2, rows, 300, 64, 64, dtype, device, seed=rows, requires_grad=True)
    mask = make_mask("bool", (2, 1, 1, 300), dtype, device, seed=rows + 1, keep_prob=0.9)
    run_forward_case(q, k, v, attn_mask=mask, is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    run_backward_case(q, k, v, attn_mask=mask, is_causal=True, causal_alignment="bottom_right", enable_gqa=True,
                      seed=rows, lse_weight=True)

def test_float_mask_grad_is_summed_over_broadcast_dims(device):
    dtype = torch.float64
    q, k, v = make_qkv(2, 3, 3, 7, 9, 8, 8, dtype, device, seed=4)
    small = make_mask("float", (1, 1, 7, 9), dtype, device, seed=5, requires_grad=True)
    full = small.detach().expand(2, 3, 7, 9).clone().requires_grad_(True)
    g = torch.randn(2, 3, 7, 8, generator=make_generator(6), dtype=dtype).to(device)
    (g_small,) = torch.autograd.grad(sdpa(q, k, v, attn_mask=small), small, g)
    (g_full,) = torch.autograd.grad(sdpa(q, k, v, attn_mask=full), full, g)
    assert g_small.shape == small.shape
    torch.testing.assert_close(g_small, g_full.sum(dim=(0, 1), keepdim=True), rtol=1e-10, atol=1e-12)


def test_backward_accepts_non_contiguous_grad_output(device):
    dtype = torch.float64
    q, k, v = make_qkv(2, 3, 3, 7, 9, 8, 6, dtype, device, seed=7, requires_grad=True)
    out = sdpa(q, k, v, is_causal=True)
    g = torch.randn(2, 7, 3, 6, generator=make_generator(8), dtype=dtype).to(device).transpose(1, 2)
    got = torch.autograd.grad(out, (q, k, v), g)
    r = [leaf64(t) for t in (q, k, v)]
    expected = torch.autograd.grad(attention_reference(*r, is_causal=True)[0], r, g)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_gradient_through_fully_masked_rows_is_zero(device):
    """Rows with no visible key (float mask of -inf, or bottom-right causal with L > S)
    contribute nothing: zero query grad on those rows, zero mask grad on them, and
    key/value/mask grads equal to the reference's (which ignores those rows)."""
    dtype = torch.float64
    q, k, v = make_qkv(2, 2, 2, 9, 6, 8, 8, dtype, device, seed=9, requires_grad=True)
    mask = make_mask("float", (9, 6), dtype, device, seed=10)
    mask[6] = float("-inf")  # row 6 fully masked by the mask; rows 0..2 by the causal rule
    mask.requires_grad_(True)
    kw = dict(attn_mask=mask, is_causal=True, causal_alignment="bottom_right")
    out = sdpa(q, k, v, **kw)
    g = torch.randn(out.shape, generator=make_generator(11), dtype=dtype).to(device)
    got = torch.autograd.grad(out, (q, k, v, mask), g)
    r = [leaf64(t) for t in (q, k, v, mask)]
    expected = torch.autograd.grad(attention_reference(*r[:3], attn_mask=r[3], is_causal=True,
                                                       causal_alignment="bottom_right")[0], r, g)
    dead = [0, 1, 2, 6]
    assert (got[0][..., dead, :] == 0).all()
    assert (got[3][dead] == 0).all()
    for name, a, e in zip(["query", "key", "value", "attn_mask"], got, expected):
        assert torch.isfinite(a).all(), f"grad {name} not finite"
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"grad {n}: {m}")


def test_gradient_with_no_keys_at_all_is_zero(device):
    q, k, v = make_qkv(2, 2, 2, 5, 0, 8, 8, torch.float64, device, seed=12, requires_grad=True)
    out, lse = sdpa(q, k, v, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert (dq == 0).all() and dk.shape == k.shape and dv.shape == v.shape


# --------------------------------------------------------------------------- gradcheck


GRADCHECK_PATHS = [
    "plain", "bool_mask", "float_mask_full", "float_mask_LS", "float_mask_11LS",
    "float_mask_B11S", "float_mask_H1S", "causal_top_left", "causal_bottom_right",
    "causal_bottom_right_L_gt_S", "causal_and_bool_mask", "causal_and_float_mask", "gqa",
    "gqa_float_mask", "dropout", "dropout_float_mask_causal", "return_lse",
    "return_lse_float_mask", "non_contiguous", "scale", "3d", "Ev_ne_E",
    # float masks with -inf (read on the CPU as the keys they hide): 0 and -inf, a
    # causal pattern over left padding (dropped, run as the flags); a bias with -inf
    # above the diagonal, requiring grad (its ranges read, the mask kept)
    "neg_inf_mask_as_flags", "neg_inf_bias_mask",
]


def _gradcheck_problem(path, device):
    """(fn, inputs) with tiny random sizes: B=2, H=2, L in 5..9, S in 6..11, E in 4..8."""
    gen = make_generator(sum(map(ord, path)))
    L = int(torch.randint(5, 10, (), generator=gen))
    S = int(torch.randint(6, 12, (), generator=gen))
    E = int(torch.randint(4, 9, (), generator=gen))
    Ev = E + 3 if path == "Ev_ne_E" else E
    if path == "causal_bottom_right_L_gt_S":
        L, S = 9, 6
    Hq, Hkv = (4, 2) if path.startswith("gqa") else (2, 2)
    layout = "transposed" if path == "non_contiguous" else "contiguous"
    f64 = torch.float64
    if path == "3d":
        q = randn((2, L, E), f64, device, gen, requires_grad=True)
        k = randn((2, S, E), f64, device, gen, requires_grad=True)
        v = randn((2, S, Ev), f64, device, gen, requires_grad=True)
    else:
        q = randn((2, Hq, L, E), f64, device, gen, layout, requires_grad=True)
        k = randn((2, Hkv, S, E), f64, device, gen, layout, requires_grad=True)
        v = randn((2, Hkv, S, Ev), f64, device, gen, layout, requires_grad=True)
    mask = None
    kw = {}
    seed = int(torch.randint(0, 1000, (), generator=gen))
    if path == "bool_mask":
        mask = make_mask("bool", (2, 1, L, S), f64, device, seed, keep_prob=0.8)
    elif path.startswith("float_mask") or path in ("gqa_float_mask", "return_lse_float_mask"):
        shape = {
            "float_mask_full": (2, Hq, L, S), "float_mask_LS": (L, S),
            "float_mask_11LS": (1, 1, L, S), "float_mask_B11S": (2, 1, 1, S),
            "float_mask_H1S": (Hq, 1, S), "gqa_float_mask": (1, Hq, L, S),
            "return_lse_float_mask": (2, 1, L, S),
        }[path]
        mask = make_mask("float", shape, f64, device, seed, requires_grad=True)
    elif path == "causal_top_left":
        kw.update(is_causal=True)
    elif path in ("causal_bottom_right", "causal_bottom_right_L_gt_S"):
        kw.update(is_causal=True, causal_alignment="bottom_right")
    elif path == "causal_and_bool_mask":
        mask = make_mask("bool", (2, 1, 1, S), f64, device, seed, keep_prob=0.8)
        kw.update(is_causal=True)
    elif path == "causal_and_float_mask":
        mask = make_mask("float", (1, 1, L, S), f64, device, seed, requires_grad=True)
        kw.update(is_causal=True, causal_alignment="bottom_right")
    elif path in ("neg_inf_mask_as_flags", "neg_inf_bias_mask"):
        rows, keys = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
        hidden = (keys > rows + S - L) | (keys < torch.tensor([0, 2]).view(2, 1, 1, 1))  # (2, 1, L, S)
        bias = torch.zeros(hidden.shape, dtype=f64)
        if path == "neg_inf_bias_mask":
            bias = make_mask("float", hidden.shape, f64, "cpu", seed)
        mask = bias.masked_fill(hidden, float("-inf")).to(device).requires_grad_(path == "neg_inf_bias_mask")
    elif path == "dropout_float_mask_causal":
        mask = make_mask("float", (L, S), f64, device, seed, requires_grad=True)
        kw.update(is_causal=True, dropout_p=0.3)
    elif path == "dropout":
        kw.update(dropout_p=0.3)
    elif path == "scale":
        kw.update(scale=0.4)
    if path.startswith("gqa"):
        kw.update(enable_gqa=True)
    return_lse = path.startswith("return_lse")
    diff_mask = mask is not None and mask.requires_grad

    def fn(q, k, v, *rest):
        m = rest[0] if diff_mask else mask
        if kw.get("dropout_p", 0.0) > 0:
            torch.manual_seed(0)  # the same dropout mask on every call
        return sdpa(q, k, v, attn_mask=m, return_lse=return_lse, **kw)

    inputs = (q, k, v) + ((mask,) if diff_mask else ())
    return fn, inputs


@pytest.mark.parametrize("path", GRADCHECK_PATHS)
def test_gradcheck_float64(device, path):
    fn, inputs = _gradcheck_problem(path, device)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)
