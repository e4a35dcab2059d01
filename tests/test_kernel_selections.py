"""One small call for every kernel the CUDA build instantiates, forward and backward,
checked against the float64 reference by test_fuzz's rule; and the list
`scripts/gpu_check.sh` runs under compute-sanitizer (memcheck, racecheck,
synccheck, initcheck), so that each tool sees every kernel selection.

The CUDA kernels and what selects them (csrc/cuda/attention_cuda.cpp):
- tensor cores: float16 and bfloat16 x head dims 32, 64, 96, 128 (E == Ev) x with or
  without a window; the backward also x short tiles (E 64 and 128, when a key is seen
  by at most 1024 / 512 query rows) or long ones;
- generic: float32, float64, and the half dtypes where the tensor cores do not apply
  (another head dim, softcap, ALiBi, sinks); dropout; masks; causal alignments;
- split-KV (float32/bfloat16/float16): a decoding step (at most 8 query rows per
  key/value head) on the decode kernel, with any number of key ranges; other calls
  whose tasks leave most SMs idle on the generic tile kernel;
- the explicit probabilities and packed batches (generic) are in
  `VARLEN_AND_PROBS`.
On the CPU the same cases run the kernels attn_ext picks there (cheap; it keeps this
file's own code tested on machines without a GPU).
"""

import pytest
import torch

from helpers import attn_ext_module

pytest.importorskip("hypothesis")  # test_fuzz's checks
from test_fuzz import _check, _inputs  # noqa: E402

from attn_ext.reference import attention_probs_reference, varlen_attention_reference  # noqa: E402

_BASE = dict(B=1, Hq=2, Hkv=1, seed=0, layouts=["contiguous"] * 3, is_causal=False, causal_alignment="top_left",
             sinks=False, dropout_p=0.0, scale=None)
# Query rows per key up to which the tensor-core backward takes its short tiles.
_SHORT_ROWS = {64: 1024, 128: 512}


def _tensor_core_cases():
    cases = {}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).split(".")[-1]
        for E in (32, 64, 96, 128):
            short, L = E in _SHORT_ROWS, _SHORT_ROWS.get(E, 64) + 65  # long tiles: more rows per key than that
            base = dict(_BASE, dtype=dtype, E=E, Ev=E)
            cases[f"tc-{name}-E{E}-long"] = dict(base, L=L, S=L)
            cases[f"tc-{name}-E{E}-long-window"] = dict(base, L=L, S=L, window=(L, 0))
            if short:
                cases[f"tc-{name}-E{E}-short"] = dict(base, L=130, S=130)
                cases[f"tc-{name}-E{E}-short-window"] = dict(base, L=130, S=130, window=(40, 3))
        base = dict(_BASE, dtype=dtype, E=64, Ev=64, L=77, S=130)
        cases[f"tc-{name}-bool-mask-causal-bottom-right"] = dict(
            base, mask=("bool", [1, 1, 77, 130]), is_causal=True, causal_alignment="bottom_right")
        cases[f"tc-{name}-float-mask-broadcast-gqa"] = dict(base, B=2, Hq=4, Hkv=2, mask=("float", [2, 1, 77, 130]))
        cases[f"tc-{name}-strided"] = dict(base, layouts=["transposed", "transposed", "transposed"], is_causal=True)
    return cases


def _generic_cases():
    cases = {}
    for dtype, E in ((torch.float32, 40), (torch.float64, 24), (torch.bfloat16, 80), (torch.float16, 48)):
        name = str(dtype).split(".")[-1]
        base = dict(_BASE, dtype=dtype, E=E, Ev=E + 8, L=70, S=90)
        cases[f"generic-{name}"] = dict(base)
        cases[f"generic-{name}-causal-float-mask"] = dict(base, is_causal=True, mask=("float", [1, 2, 70, 1]))
        cases[f"generic-{name}-bool-mask-window"] = dict(base, mask=("bool", [70, 90]), window=(20, 10))
        cases[f"generic-{name}-softcap-alibi-sinks"] = dict(base, softcap=5.0, alibi="batch_heads", sinks=True)
        cases[f"generic-{name}-dropout"] = dict(base, dropout_p=0.3, is_causal=True)
    # the half dtypes at a tensor-core head dim, sent to the generic kernels by a variant
    cases["generic-bfloat16-E64-softcap"] = dict(_BASE, dtype=torch.bfloat16, E=64, Ev=64, L=70, S=90, softcap=30.0)
    cases["generic-float16-E64-sinks-dropout"] = dict(_BASE, dtype=torch.float16, E=64, Ev=64, L=70, S=90,
                                                      sinks=True, dropout_p=0.3)
    cases["generic-float32-empty-keys"] = dict(_BASE, dtype=torch.float32, E=16, Ev=16, L=5, S=0)
    return cases


def _split_kv_cases():
    # Two query heads of one to three rows against 1100 keys: the decode kernel, 5 key
    # ranges of 224 keys on an H200; 12 rows: the tile kernel, 4 ranges of 320 keys
    base = dict(_BASE, E=64, Ev=64, S=1100)
    return {
        "split-kv-float32-decode": dict(base, dtype=torch.float32, L=1),
        "split-kv-bfloat16-causal-bottom-right-window-sinks": dict(
            base, dtype=torch.bfloat16, L=3, is_causal=True, causal_alignment="bottom_right", window=(600, 0),
            sinks=True),
        "split-kv-float16-float-mask-softcap-alibi": dict(base, dtype=torch.float16, L=2, mask=("float", [1, 2, 2, 1100]),
                                                          softcap=30.0, alibi="batch_heads"),
        # 2 heads x 12 rows per key/value head: more than the decode kernel takes, the tile kernel splits
        "split-kv-bfloat16-rows-on-tiles": dict(base, dtype=torch.bfloat16, L=12, is_causal=True,
                                                causal_alignment="bottom_right"),
    }


CASES = {**_tensor_core_cases(), **_generic_cases(), **_split_kv_cases()}


def _expects_tensor_cores(name):
    return name.startswith("tc-")  # the others are meant for the generic kernels


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_selection(device, name):
    case = dict(CASES[name], device=device)
    if device == "cuda" and _expects_tensor_cores(name):
        q, k, v, _, _ = _inputs(case)
        why = torch.ops.attn_ext.tensor_core_reason(q, k, v)
        if "compute capability" in why:
            pytest.skip(f"this GPU runs no tensor-core kernels: {why}")
        assert not why, f"{name} was meant for the tensor-core kernels, which say: {why}"
    if device == "cuda" and name.startswith("split-kv-"):
        q, k, v, _, _ = _inputs(case)
        assert torch.ops.attn_ext.split_kv_splits(q, k, v) > 1, f"{name} was meant for the split-KV kernels"
    _check(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probs_and_varlen_selection(device, dtype):
    """The explicit probabilities (forward and backward) and a packed batch of three
    sequences (forward and backward), each against the float64 reference."""
    attn_ext = attn_ext_module()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, n, 32, generator=gen).to(device, dtype).requires_grad_() for n in (33, 47))
    probs = attn_ext.attention_probs(q, k, is_causal=True)
    grad = torch.randn(probs.shape, generator=gen).to(probs)
    got = torch.autograd.grad(probs, (q, k), grad)
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    ref = attention_probs_reference(q64, k64, is_causal=True)
    want = torch.autograd.grad(ref, (q64, k64), grad.double())
    assert (probs.double() - ref).norm() <= tol * ref.norm()
    for g, w in zip(got, want):
        assert (g.double() - w).norm() <= tol * w.norm()

    lengths_q, lengths_k = [5, 0, 40], [9, 3, 33]
    cu_q = torch.tensor([0, 5, 5, 45], device=device)
    cu_k = torch.tensor([0, 9, 12, 45], device=device)
    qv = torch.randn(sum(lengths_q), 4, 32, generator=gen).to(device, dtype).requires_grad_()
    kv, vv = (torch.randn(sum(lengths_k), 2, 32, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
    out = attn_ext.varlen_attention(qv, kv, vv, cu_q, cu_k, max(lengths_q), max(lengths_k), is_causal=True)
    grad = torch.randn(out.shape, generator=gen).to(out)
    got = torch.autograd.grad(out, (qv, kv, vv), grad)
    ref_in = [t.detach().double().requires_grad_() for t in (qv, kv, vv)]
    ref, _ = varlen_attention_reference(*ref_in, cu_q, cu_k, is_causal=True)
    want = torch.autograd.grad(ref, ref_in, grad.double())
    assert (out.double() - ref).norm() <= tol * ref.norm()
    for g, w in zip(got, want):
        assert (g.double() - w).norm() <= tol * w.norm()
