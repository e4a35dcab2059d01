"""torch.library.opcheck on the low-level operators (schema, fake kernels, autograd
registration, AOT dispatch) for several sample inputs."""

import math

import pytest
import torch

from helpers import attn_ops, make_generator, make_mask, make_qkv

SAMPLES = ["plain", "bool_mask", "float_mask_grad", "causal_top_left", "causal_bottom_right",
           "dropout", "gqa", "gqa_causal_mask_dropout", "non_contiguous", "L_ne_S_odd"]
dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


def _forward_args(sample, dtype, device, requires_grad=True):
    """Arguments of attention_forward for a named sample (4-D inputs, as the op takes)."""
    Hq, Hkv = (4, 2) if sample.startswith("gqa") else (2, 2)
    L, S = (9, 13) if sample == "L_ne_S_odd" else (6, 8)
    layout = "transposed" if sample == "non_contiguous" else "contiguous"
    q, k, v = make_qkv(2, Hq, Hkv, L, S, 8, 8, dtype, device, seed=len(sample), layout=layout,
                       requires_grad=requires_grad)
    mask, p, causal, offset, seed = None, 0.0, False, 0, None
    if sample == "bool_mask":
        mask = make_mask("bool", (2, 1, L, S), dtype, device, seed=1, keep_prob=0.8)
    elif sample == "float_mask_grad":
        mask = make_mask("float", (1, Hq, L, S), dtype, device, seed=1, requires_grad=requires_grad)
    elif sample == "causal_top_left":
        causal = True
    elif sample == "causal_bottom_right":
        causal, offset = True, S - L
    elif sample == "dropout":
        p = 0.25
    elif sample == "gqa_causal_mask_dropout":
        mask = make_mask("bool", (L, S), dtype, device, seed=1, keep_prob=0.8)
        causal, offset, p = True, S - L, 0.25
    if p > 0:
        seed = torch.tensor([1234], dtype=torch.int64, device=device)
    scale = 1.0 / math.sqrt(8)
    return (q, k, v, mask, p, causal, offset, scale, seed)


@dtypes
@pytest.mark.parametrize("sample", SAMPLES)
def test_opcheck_attention_forward(device, dtype, sample):
    args = _forward_args(sample, dtype, device)
    torch.library.opcheck(attn_ops().attention_forward.default, args)


@dtypes
@pytest.mark.parametrize("sample", SAMPLES)
@pytest.mark.parametrize("with_grad_lse", [False, True], ids=["no_grad_lse", "grad_lse"])
def test_opcheck_attention_backward(device, dtype, sample, with_grad_lse):
    q, k, v, mask, p, causal, offset, scale, seed = _forward_args(sample, dtype, device,
                                                                  requires_grad=False)
    out, lse = attn_ops().attention_forward(q, k, v, mask, p, causal, offset, scale, seed)
    gen = make_generator(99)
    grad_out = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    grad_lse = None
    if with_grad_lse:
        grad_lse = torch.randn(lse.shape, generator=gen).to(device=device, dtype=lse.dtype)
    compute_grad_mask = mask is not None and mask.is_floating_point()
    args = (grad_out, grad_lse, q, k, v, out, lse, mask, p, causal, offset, scale, seed,
            compute_grad_mask)
    # attention_backward has no autograd of its own: skip the autograd-registration test
    torch.library.opcheck(attn_ops().attention_backward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
