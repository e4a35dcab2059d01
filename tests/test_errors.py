"""Bad input raises RuntimeError/ValueError naming the argument and showing the value
received; nothing returns NaN silently, nothing crashes."""

import pytest
import torch

from helpers import attn_ops, error_pattern, make_generator, op_args, sdpa

ERRORS = (RuntimeError, ValueError)
F32, F64 = torch.float32, torch.float64


def _t(shape, device, dtype=F32, gen=None):
    gen = gen or make_generator(sum(shape) if shape else 0)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _qkv(device, q=(2, 4, 17, 16), k=(2, 4, 23, 16), v=(2, 4, 23, 16), dtypes=(F32, F32, F32)):
    return _t(q, device, dtypes[0]), _t(k, device, dtypes[1]), _t(v, device, dtypes[2])


# (id, inputs -> call kwargs, argument name regex, offending values)
CASES = {
    "query_2d": (dict(q=(7, 13), k=(7, 13), v=(7, 13)), {}, "query", ("2", "13")),
    "query_4d_key_3d": (dict(k=(2, 23, 16), v=(2, 23, 16)), {}, "key", ("3", "23")),
    "batch_mismatch": (dict(k=(3, 4, 23, 16), v=(3, 4, 23, 16)), {}, "key", ("3",)),
    "head_dim_mismatch": (dict(k=(2, 4, 23, 33)), {}, "key", ("33",)),
    "key_value_S_mismatch": (dict(v=(2, 4, 29, 16)), {}, "value", ("29",)),
    "key_value_heads_mismatch": (dict(v=(2, 3, 23, 16)), {}, "value", ("3",)),
    "mixed_dtypes": (dict(dtypes=(F32, F64, F32)), {}, "key", ("float64", "double")),
    "dropout_negative": ({}, dict(dropout_p=-0.1), "dropout_p", ("-0.1",)),
    "dropout_one": ({}, dict(dropout_p=1.0), "dropout_p", ("1.0", "1")),
    "gqa_not_multiple": (dict(q=(2, 6, 17, 16)), dict(enable_gqa=True), "(enable_gqa|head)",
                         ("6", "4")),
    "heads_differ_without_gqa": (dict(k=(2, 2, 23, 16), v=(2, 2, 23, 16)), {},
                                 "(enable_gqa|head)", ("2", "4")),
    "unknown_causal_alignment": ({}, dict(is_causal=True, causal_alignment="center"),
                                 "causal_alignment", ("center",)),
    "scale_nan": ({}, dict(scale=float("nan")), "scale", ("nan",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_naming_the_argument(device, case):
    shapes, kwargs, name, values = CASES[case]
    q, k, v = _qkv(device, **shapes)
    with pytest.raises(ERRORS, match=error_pattern(name, *values)):
        sdpa(q, k, v, **kwargs)


MASK_CASES = {
    "mask_does_not_broadcast": (lambda d: _t((19, 23), d), "19"),
    "mask_wrong_heads": (lambda d: _t((2, 5, 17, 23), d), "5"),
    "mask_int_dtype": (lambda d: torch.ones(17, 23, dtype=torch.int32, device=d), ("int32", "int")),
    "float_mask_other_dtype": (lambda d: _t((17, 23), d, F64), ("float64", "double")),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_bad_attn_mask_raises_naming_attn_mask(device, case):
    make, values = MASK_CASES[case]
    values = values if isinstance(values, tuple) else (values,)
    q, k, v = _qkv(device)
    with pytest.raises(ERRORS, match=error_pattern("attn_mask", *values)):
        sdpa(q, k, v, attn_mask=make(device))


def test_half_mask_with_float_query_is_rejected(device):
    q, k, v = _qkv(device)
    with pytest.raises(ERRORS, match=error_pattern("attn_mask", "float16", "half")):
        sdpa(q, k, v, attn_mask=_t((17, 23), device, torch.float16))


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64], ids=["int64", "complex64"])
def test_unsupported_input_dtype_is_rejected(device, dtype):
    q, k, v = _qkv(device)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    with pytest.raises(ERRORS, match=error_pattern("query", "int64", "long", "complex64",
                                                   "complexfloat")):
        sdpa(q, k, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU for a device mismatch")
def test_inputs_on_different_devices_are_rejected():
    q, k, v = _qkv("cuda")
    with pytest.raises(ERRORS, match=error_pattern("key", "cpu")):
        sdpa(q, k.cpu(), v)


def test_low_level_forward_requires_4d_and_a_dropout_seed(device):
    q, k, v = _qkv(device)
    op = attn_ops().attention_forward.default
    values = dict(attn_mask=None, dropout_p=0.0, is_causal=False, causal_offset=0, scale=0.25, dropout_seed=None)
    with pytest.raises(ERRORS, match=error_pattern("query", "3-D", "4-D", "17")):
        op(*op_args(op, query=q[0], key=k[0], value=v[0], **values))
    with pytest.raises(ERRORS, match=error_pattern("dropout_seed", "0.5")):
        op(*op_args(op, query=q, key=k, value=v, **dict(values, dropout_p=0.5)))


def test_legal_edge_values_give_finite_results(device):
    """Legal edge values give finite results, not NaN: a tiny scale, a huge scale,
    a mask of all -inf except one key, dropout_p just below 1."""
    q, k, v = _qkv(device)
    for kwargs in (dict(scale=1e-30), dict(scale=1e4)):
        assert torch.isfinite(sdpa(q, k, v, **kwargs)).all(), kwargs
    mask = torch.full((17, 23), float("-inf"), device=device)
    mask[:, 5] = 0.0
    out = sdpa(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, v[:, :, 5:6, :].expand_as(out), rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    assert torch.isfinite(sdpa(q, k, v, dropout_p=0.999)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_names_bad_cu_seqlens():
    """cu_seqlens on the GPU are read on the host once, checked there, and named as on the CPU."""
    import attn_ext

    q, k, v = (_t((9, 2, 16), "cuda") for _ in range(3))
    cu = torch.tensor([0, 4, 9], device="cuda")
    with pytest.raises(ERRORS, match="cu_seqlens_q must be non-decreasing"):
        attn_ext.varlen_attention(q, k, v, torch.tensor([0, 5, 4], device="cuda"), cu, 5, 5)
    with pytest.raises(ERRORS, match="cu_seqlens_k must end at the number of rows of key"):
        attn_ext.varlen_attention(q, k, v, cu, torch.tensor([0, 4, 8], device="cuda"), 5, 5)
    with pytest.raises(ERRORS, match="max_seqlen_q must be at least"):
        attn_ext.varlen_attention(q, k, v, cu, cu, 4, 5)


def test_sizes_past_64_bit_indexing_raise(device):
    """Keys expanded with stride 0 to 2**55 rows take no memory, but B Hq L S (E + Ev)
    is past 2**63: every op raises a ValueError naming the sizes instead of running
    with overflowed offsets."""
    import attn_ext

    S = 2**55
    q = _t((2, 4, 17, 16), device)
    k, v = (_t((2, 4, 1, 16), device).expand(2, 4, S, 16) for _ in range(2))
    pattern = error_pattern("key", S)
    with pytest.raises(ValueError, match=pattern):
        sdpa(q, k, v)
    with pytest.raises(ValueError, match=pattern):
        attn_ext.attention_probs(q, k)
    qp = _t((17, 4, 16), device)
    kp, vp = (_t((1, 4, 16), device).expand(S, 4, 16) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 17], device=device), torch.tensor([0, S], device=device)
    with pytest.raises(ValueError, match=pattern):
        attn_ext.varlen_attention(qp, kp, vp, cu_q, cu_k, 17, S)
    # Inside the limit the checks pass: an empty query with 2**50 keys has nothing to compute.
    assert attn_ext.scaled_dot_product_attention(q[:, :, :0], k[:, :, :2**50], v[:, :, :2**50]).shape[2] == 0
