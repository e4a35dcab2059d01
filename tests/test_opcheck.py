"""torch.library.opcheck on the low-level operators (schema, fake kernels, autograd
registration, AOT dispatch) for several sample inputs, the attention variants and the
packed variable-length ops among them.

Arguments are given by their schema names (helpers.op_args), so each sample says what it
sets and leaves the other optional arguments None."""

import math

import pytest
import torch

from helpers import attn_ops, make_generator, make_mask, make_qkv, op_args

SAMPLES = ["plain", "bool_mask", "float_mask_grad", "causal_top_left", "causal_bottom_right",
           "dropout", "gqa", "gqa_causal_mask_dropout", "non_contiguous", "L_ne_S_odd"]
# attention variants (window, softcap, ALiBi, sinks), alone and with everything else
VARIANT_SAMPLES = ["window", "window_one_side_causal_bottom_right", "softcap_alibi", "alibi_per_batch_sinks",
                   "everything_gqa_float_mask_dropout"]
dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


def _slopes(H, device, B=None):
    s = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])
    if B is not None:
        s = s * torch.arange(1, B + 1, dtype=torch.float32).view(B, 1)
    return s.to(device)


def _forward_values(sample, dtype, device, requires_grad=True):
    """attention_forward's arguments for a named sample (4-D inputs, as the op takes),
    by name."""
    Hq, Hkv = (4, 2) if sample.startswith(("gqa", "everything_gqa")) else (2, 2)
    L, S = (9, 13) if sample in ("L_ne_S_odd", "everything_gqa_float_mask_dropout") else (6, 8)
    layout = "transposed" if sample == "non_contiguous" else "contiguous"
    q, k, v = make_qkv(2, Hq, Hkv, L, S, 8, 8, dtype, device, seed=len(sample), layout=layout,
                       requires_grad=requires_grad)
    values = dict(query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=False,
                  causal_offset=0, scale=1.0 / math.sqrt(8), dropout_seed=None)
    if sample == "bool_mask":
        values["attn_mask"] = make_mask("bool", (2, 1, L, S), dtype, device, seed=1, keep_prob=0.8)
    elif sample in ("float_mask_grad", "everything_gqa_float_mask_dropout"):
        values["attn_mask"] = make_mask("float", (1, Hq, L, S), dtype, device, seed=1,
                                        requires_grad=requires_grad)
    elif sample == "gqa_causal_mask_dropout":
        values["attn_mask"] = make_mask("bool", (L, S), dtype, device, seed=1, keep_prob=0.8)
    if sample in ("causal_top_left", "causal_bottom_right", "gqa_causal_mask_dropout",
                  "window_one_side_causal_bottom_right", "everything_gqa_float_mask_dropout"):
        values["is_causal"] = True
    if sample in ("causal_bottom_right", "gqa_causal_mask_dropout",
                  "window_one_side_causal_bottom_right", "everything_gqa_float_mask_dropout"):
        values["causal_offset"] = S - L
    if sample in ("dropout", "gqa_causal_mask_dropout", "everything_gqa_float_mask_dropout"):
        values["dropout_p"] = 0.25
        values["dropout_seed"] = torch.tensor([1234], dtype=torch.int64, device=device)
    if sample == "window":
        values.update(window_left=3, window_right=1)
    elif sample == "window_one_side_causal_bottom_right":
        values.update(window_left=2, window_right=None)
    elif sample == "softcap_alibi":
        values.update(softcap=2.0, alibi_slopes=_slopes(Hq, device))
    elif sample == "alibi_per_batch_sinks":
        values.update(alibi_slopes=_slopes(Hq, device, B=2),
                      sinks=torch.randn(Hq, generator=make_generator(3)).to(device, dtype)
                      .requires_grad_(requires_grad))
    elif sample == "everything_gqa_float_mask_dropout":
        values.update(window_left=4, window_right=2, softcap=3.0, alibi_slopes=_slopes(Hq, device, B=2),
                      sinks=torch.randn(Hq, generator=make_generator(4)).to(device, dtype)
                      .requires_grad_(requires_grad))
    return values


@dtypes
@pytest.mark.parametrize("sample", SAMPLES + VARIANT_SAMPLES)
def test_opcheck_attention_forward(device, dtype, sample):
    op = attn_ops().attention_forward.default
    torch.library.opcheck(op, op_args(op, **_forward_values(sample, dtype, device)))


def _backward_cases():
    """(dtype, sample): every sample at both dtypes; the variants (whose forward opcheck
    already runs the backward through autograd) at float64 only."""
    cases = [(d, s) for d in (torch.float32, torch.float64) for s in SAMPLES]
    return cases + [(torch.float64, s) for s in VARIANT_SAMPLES]


@pytest.mark.parametrize("dtype,sample", _backward_cases(),
                         ids=[f"{str(d)[6:]}-{s}" for d, s in _backward_cases()])
@pytest.mark.parametrize("with_grad_lse", [False, True], ids=["no_grad_lse", "grad_lse"])
def test_opcheck_attention_backward(device, dtype, sample, with_grad_lse):
    values = _forward_values(sample, dtype, device, requires_grad=False)
    fwd = attn_ops().attention_forward.default
    out, lse = fwd(*op_args(fwd, **values))
    gen = make_generator(99)
    grad_out = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    grad_lse = None
    if with_grad_lse:
        grad_lse = torch.randn(lse.shape, generator=gen).to(device=device, dtype=lse.dtype)
    mask = values["attn_mask"]
    op = attn_ops().attention_backward.default
    args = op_args(op, grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse,
                   compute_grad_mask=mask is not None and mask.is_floating_point(), **values)
    # attention_backward has no autograd of its own: skip the autograd-registration test
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


PROBS_SAMPLES = ["window_one_side_causal_bottom_right", "softcap_alibi", "everything_gqa_float_mask_dropout"]


def _probs_values(sample, device):
    values = _forward_values(sample, torch.float64, device)
    del values["value"]
    return values


@pytest.mark.parametrize("sample", PROBS_SAMPLES)
def test_opcheck_attention_probs_with_variants(device, sample):
    op = attn_ops().attention_probs.default
    torch.library.opcheck(op, op_args(op, **_probs_values(sample, device)))


@pytest.mark.parametrize("sample", ["everything_gqa_float_mask_dropout"])
def test_opcheck_attention_probs_backward_with_variants(device, sample):
    values = _probs_values(sample, device)
    values = {n: (t.detach() if torch.is_tensor(t) else t) for n, t in values.items()}
    fwd = attn_ops().attention_probs.default
    probs, lse = fwd(*op_args(fwd, **values))
    mask = values["attn_mask"]
    op = attn_ops().attention_probs_backward.default
    args = op_args(op, grad_probs=torch.randn_like(probs), grad_lse=torch.randn_like(lse), probs=probs,
                   lse=lse, compute_grad_mask=mask is not None and mask.is_floating_point(), **values)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# --------------------------------------------------------------------------- varlen

VARLEN_SAMPLES = ["plain_int32", "plain_int64", "gqa_causal_bottom_right", "everything_dropout"]
VARLEN_BACKWARD_SAMPLES = ["plain_int64", "everything_dropout"]


def _varlen_values(sample, dtype, device, requires_grad=True):
    """varlen_forward's arguments by name: sequences of 3, 0, 5 and 1 queries over 4, 2, 0
    and 6 keys."""
    lens_q, lens_k = [3, 0, 5, 1], [4, 2, 0, 6]
    Hq, Hkv = (4, 2) if sample != "plain_int32" and sample != "plain_int64" else (2, 2)
    gen = make_generator(len(sample))

    def draw(*shape):
        return torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(requires_grad)

    index = torch.int64 if sample == "plain_int64" else torch.int32
    values = dict(query=draw(sum(lens_q), Hq, 8), key=draw(sum(lens_k), Hkv, 8),
                  value=draw(sum(lens_k), Hkv, 6),
                  cu_seqlens_q=torch.tensor([0] + lens_q).cumsum(0).to(device, index),
                  cu_seqlens_k=torch.tensor([0] + lens_k).cumsum(0).to(device, index),
                  max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), dropout_p=0.0, is_causal=False,
                  bottom_right=False, scale=1.0 / math.sqrt(8), dropout_seed=None)
    if sample in ("gqa_causal_bottom_right", "everything_dropout"):
        values.update(is_causal=True, bottom_right=True)
    if sample == "everything_dropout":
        values.update(dropout_p=0.25, dropout_seed=torch.tensor([77], dtype=torch.int64, device=device),
                      window_left=2, window_right=0, softcap=2.5, alibi_slopes=_slopes(Hq, device, B=4),
                      sinks=draw(Hq))
    return values


@dtypes
@pytest.mark.parametrize("sample", VARLEN_SAMPLES)
def test_opcheck_varlen_forward(device, dtype, sample):
    op = attn_ops().varlen_forward.default
    torch.library.opcheck(op, op_args(op, **_varlen_values(sample, dtype, device)))


@pytest.mark.parametrize("sample", VARLEN_BACKWARD_SAMPLES)
@pytest.mark.parametrize("with_grad_lse", [False, True], ids=["no_grad_lse", "grad_lse"])
def test_opcheck_varlen_backward(device, sample, with_grad_lse):
    values = _varlen_values(sample, torch.float64, device, requires_grad=False)
    fwd = attn_ops().varlen_forward.default
    out, lse = fwd(*op_args(fwd, **values))
    gen = make_generator(98)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(device)
    grad_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64).to(device) if with_grad_lse else None
    op = attn_ops().varlen_backward.default
    args = op_args(op, grad_out=grad_out, grad_lse=grad_lse, out=out, lse=lse, **values)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
