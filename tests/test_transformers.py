"""attn_ext.integrations.transformers: attn_ext as a Hugging Face transformers attention implementation.

Offline, on tiny randomly initialised models built from configs (2 layers, hidden 64,
4 query heads, 2 key/value heads where the architecture has grouped-query attention,
vocabulary 128, 16 tokens: longer than the sliding windows of 4). One set of weights
is loaded into a model per attn_implementation ("eager", "sdpa", "attn_ext"), and:

- logits and every parameter's gradient equal eager's and sdpa's, without padding and
  with left and right padding (only real positions are compared and carry the loss):
  Llama, Mistral (sliding window), Qwen2 (full and sliding layers), Gemma 2 (softcap,
  sliding window; no sdpa: sdpa takes no softcap), GPT-2, BERT (bidirectional
  encoder), gpt-oss (sinks, sliding window; no sdpa: sdpa takes no sinks);
- every attention layer ran attn_ext's kernel (forward and backward), on the key/value
  heads as they come (no repeat_kv);
- a bfloat16 model is as close to its float64 self as with torch's own attention
  (within BF16_FACTOR x torch's error + BF16_FLOOR, logits and gradients);
- these, generate() and the packed batch also on CUDA when there is a GPU (the
  ``device`` fixture of conftest.py);
- greedy cached generate() (DynamicCache and StaticCache) gives eager's tokens and
  logits, left-padded batch;
- a padding-free packed batch (position_ids restarting at 0, no attention_mask,
  batch 1) runs attn_ext's varlen kernel and equals each sequence run alone, with the
  config's use_cache and with use_cache=False; packed rows in a batch of two equal eager;
- attention dropout in training: finite, reproducible under torch.manual_seed,
  different from eval, differentiable;
- register() returns its name, is idempotent, takes a custom name;
  ``import attn_ext`` does not import transformers.

Tolerances: float32 2e-5, float64 1e-10, on the maximum absolute error relative to
the reference's maximum absolute value (max |got - ref| <= tol * max |ref|), per
tensor: the logits at real positions, and each parameter's gradient. A gradient's
scale is floored at 1% of the model's largest gradient (GRAD_SCALE_FLOOR): BERT's key
bias has a gradient that is 0 but for roundoff (softmax is invariant to a shift of a
row), which no two implementations share. The other gradients of these models are
at least about 1% of the largest (gpt-oss's expert biases are the smallest), so for
them the measure is relative to their own size, or nearly.

float64: the Llama-family eager attentions take the softmax in float32
(``softmax(..., dtype=torch.float32)``), which makes eager's float64 only float32-
accurate (and turns its fully masked padding rows into NaN, which then reach real
rows through 0 * NaN). The float64 eager references therefore run with that softmax
kept in float64 (:func:`_eager_softmax_keeps_float64`); nothing else changes.
gpt-oss runs its experts with experts_implementation="eager" (the default grouped_mm
takes no float64); that touches no attention.
"""

import contextlib
import copy
import os
import subprocess
import sys
import unittest.mock
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoModelForMaskedLM  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

import attn_ext.integrations.transformers as attn_hf  # noqa: E402

ATTN_EXT = attn_hf.register()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
GRAD_SCALE_FLOOR = 1e-2
VOCAB, LENGTH, WINDOW, PAD = 128, 16, 4, 5
LAYERS, KV_HEADS = 2, 2

HAS_GPT_OSS = hasattr(transformers, "GptOssConfig")
KINDS = ["llama", "mistral", "qwen2", "gemma2", "gpt2", "bert",
         pytest.param("gpt_oss", marks=pytest.mark.skipif(not HAS_GPT_OSS,
                                                          reason="this transformers has no GptOssConfig"))]
# sdpa takes neither a softcap (transformers raises) nor sinks (gpt-oss does not offer it):
# those models are compared with eager only.
NO_SDPA = {"gemma2", "gpt_oss"}
DECODERS = ["llama", "mistral", "qwen2", "gemma2", "gpt2",
            pytest.param("gpt_oss", marks=pytest.mark.skipif(not HAS_GPT_OSS,
                                                             reason="this transformers has no GptOssConfig"))]
dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


# --------------------------------------------------------------------------- models


def _config(kind, dropout=0.0):
    """A tiny config of ``kind``: scores of O(1) (initializer_range 0.2, so that masks,
    windows, softcaps and sinks change the result), all dropout ``dropout`` on the
    attention probabilities and 0 elsewhere."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                  initializer_range=0.2, attention_dropout=dropout, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common)
    if kind == "qwen2":
        # layer 0 full attention, layer 1 a sliding window (layers >= max_window_layers)
        cfg = transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common)
        assert list(cfg.layer_types) == ["full_attention", "sliding_attention"], cfg.layer_types
        return cfg
    if kind == "gemma2":
        # layers alternate sliding / full; softcap 2 bends scores of O(1); the scale 24 ** -0.5
        # is not head_dim ** -0.5 (the default an implementation might fall back to)
        cfg = transformers.Gemma2Config(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                        attn_logit_softcapping=2.0, **common)
        assert list(cfg.layer_types) == ["sliding_attention", "full_attention"], cfg.layer_types
        return cfg
    if kind == "gpt_oss":
        common.update(intermediate_size=64)
        cfg = transformers.GptOssConfig(head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                        sliding_window=WINDOW, rope_parameters=dict(rope_type="default",
                                                                                    rope_theta=150000.0),
                                        **common)
        assert list(cfg.layer_types) == ["sliding_attention", "full_attention"], cfg.layer_types
        return cfg
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_inner=128,
                                       n_positions=64, initializer_range=0.2, attn_pdrop=dropout, resid_pdrop=0.0,
                                       embd_pdrop=0.0, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    if kind == "bert":
        return transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS,
                                       num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                                       initializer_range=0.2, attention_probs_dropout_prob=dropout,
                                       hidden_dropout_prob=0.0, pad_token_id=0)
    raise ValueError(kind)


def _kv_heads(kind):
    return 4 if kind in ("gpt2", "bert") else KV_HEADS


def _build(kind, impl, dtype=torch.float32, state=None, dropout=0.0, device="cpu"):
    """``kind``'s tiny model with ``attn_implementation=impl``, in eval mode, ``dtype``
    and on ``device``.

    The weights come from torch.manual_seed(0) (gpt-oss's sinks then redrawn with std 1,
    so that they matter), or from ``state`` (another model's state_dict)."""
    auto = AutoModelForMaskedLM if kind == "bert" else AutoModelForCausalLM
    # gpt-oss's default experts kernel (grouped_mm) takes no float64; the eager one does
    extra = dict(experts_implementation="eager") if kind == "gpt_oss" else {}
    torch.manual_seed(0)
    model = auto.from_config(_config(kind, dropout), attn_implementation=impl, **extra)
    if state is not None:
        model.load_state_dict(state)
    elif kind == "gpt_oss":
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
    assert model.config._attn_implementation == impl
    return model.to(device=device, dtype=dtype).eval()


def _models(kind, dtype, impls=("eager", "sdpa", ATTN_EXT), device="cpu"):
    """{impl: model}, the same weights in each (sdpa left out for NO_SDPA kinds)."""
    base = _build(kind, impls[0], dtype, device=device)
    models = {impls[0]: base}
    for impl in impls[1:]:
        if impl == "sdpa" and kind in NO_SDPA:
            continue
        models[impl] = _build(kind, impl, dtype, state=base.state_dict(), device=device)
    return models


_softmax = torch.nn.functional.softmax


def _softmax_keeping_float64(input, dim=None, _stacklevel=3, dtype=None):
    if input.dtype == torch.float64:
        dtype = None
    return _softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


def _eager_softmax_keeps_float64():
    """A context where ``softmax(x, dtype=torch.float32)`` of a float64 ``x`` stays in
    float64: the eager attentions' float32 softmax would make a float64 reference only
    float32-accurate (see the module's docstring)."""
    return unittest.mock.patch.object(torch.nn.functional, "softmax", _softmax_keeping_float64)


def _context(impl, dtype):
    return _eager_softmax_keeps_float64() if impl == "eager" and dtype == torch.float64 else contextlib.nullcontext()


# --------------------------------------------------------------------------- op log


class _AttnExtOps(TorchDispatchMode):
    """Records every attn_ext operator that runs (forward and backward, whoever calls
    it: the check does not depend on how the integration imports attn_ext's functions),
    with its arguments by their names in the operator's schema."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "attn_ext":
            named = {a.name: v for a, v in zip(func._schema.arguments, args)}
            named.update(kwargs)
            self.calls.append((func._schema.name.split("::")[1], named))
        return func(*args, **kwargs)

    def count(self, name):
        return sum(1 for n, _ in self.calls if n == name)

    def args(self, name):
        return [a for n, a in self.calls if n == name]


# --------------------------------------------------------------------------- comparisons


def _max_err(got, ref):
    """max |got - ref| and max |ref|, in float64."""
    got, ref = got.detach().to(torch.float64), ref.detach().to(torch.float64)
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    assert torch.isfinite(ref).all(), "the reference is not finite"
    assert torch.isfinite(got).all(), "not finite"
    return (got - ref).abs().max().item(), ref.abs().max().item()


def _assert_close(name, got, ref, tol):
    err, scale = _max_err(got, ref)
    assert err <= tol * scale, f"{name}: max abs err {err:.3e} > {tol:.0e} x max |ref| {scale:.3e}"


def _grad_errors(got, ref):
    """{parameter name: (max |got - ref|, its scale)} for every gradient ``ref`` has: the scale
    is the gradient's max |ref| floored at GRAD_SCALE_FLOOR x the model's largest gradient (the
    docstring's measure). A gradient None in one of the two only fails here."""
    assert got.keys() == ref.keys()
    assert any(g is not None for g in ref.values())
    largest = max(g.abs().max().item() for g in ref.values() if g is not None)
    assert largest > 0
    errors = {}
    for name, g_ref in ref.items():
        assert (got[name] is None) == (g_ref is None), f"grad of {name} is None in one only"
        if g_ref is not None:
            err, scale = _max_err(got[name], g_ref)
            errors[name] = (err, max(scale, GRAD_SCALE_FLOOR * largest))
    return errors


def _assert_grads_close(what, got, ref, tol):
    """Every parameter's gradient by the tolerance, relative to its floored scale (_grad_errors)."""
    for name, (err, scale) in _grad_errors(got, ref).items():
        assert err <= tol * scale, (f"{what}: grad of {name}: max abs err {err:.3e} > {tol:.0e} x "
                                    f"{scale:.3e} (max |ref|, floored at {GRAD_SCALE_FLOOR} x the largest)")


def _tokens(batch, length, seed):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _padding_mask(padding, batch=2, length=LENGTH, pad=PAD):
    """(batch, length) long, 0 = padding: row 0 padded by ``pad`` on ``padding``'s side, the others full."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding == "left":
        mask[0, :pad] = 0
    elif padding == "right":
        mask[0, length - pad:] = 0
    return mask


def _logits_and_grads(model, dtype, ids, mask, loss_weights, real, **kwargs):
    """(logits, {parameter name: gradient of sum(logits * loss_weights) over ``real`` positions})."""
    model.zero_grad(set_to_none=True)
    with _context(model.config._attn_implementation, dtype):
        logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits
        loss = (logits * loss_weights.to(logits.device, dtype) * real[..., None].to(logits.device, dtype)).sum()
        names, params = zip(*model.named_parameters())
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return logits.detach(), dict(zip(names, grads))


# --------------------------------------------------------------------------- equality with eager and sdpa


@pytest.mark.parametrize("padding", ["none", "left", "right"])
@dtypes
@pytest.mark.parametrize("kind", KINDS)
def test_logits_and_gradients_match_eager_and_sdpa(kind, dtype, padding, device):
    """attn_ext's logits at the real positions and every parameter's gradient (of a loss
    over the real positions) equal eager's and sdpa's with the same weights, without
    padding and with left / right padding (an attention_mask row with 5 zeros); each
    layer ran attn_ext's forward and backward kernels once, with the model's key/value
    heads (grouped-query attention without repeat_kv), and no (B, 1, L, S) mask: the
    causal flag, the window and at most a key-padding vector. On CUDA too (float32
    there is IEEE float32 in eager's and sdpa's products: torch's default)."""
    models = _models(kind, dtype, device=device)
    ids = _tokens(2, LENGTH, seed=1).to(device)
    mask = None if padding == "none" else _padding_mask(padding).to(device)
    real = torch.ones(2, LENGTH, dtype=torch.bool, device=device) if mask is None else mask.bool()
    weights = torch.randn(2, LENGTH, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    results = {}
    for impl, model in models.items():
        if impl == ATTN_EXT:
            with _AttnExtOps() as ops:
                results[impl] = _logits_and_grads(model, dtype, ids, mask, weights, real)
        else:
            results[impl] = _logits_and_grads(model, dtype, ids, mask, weights, real)

    assert ops.count("attention_forward") == LAYERS, [n for n, _ in ops.calls]
    assert ops.count("attention_backward") == LAYERS, [n for n, _ in ops.calls]
    for a in ops.args("attention_forward"):
        q, k, v = a["query"], a["key"], a["value"]
        assert q.device.type == device, (q.device, device)
        assert q.shape[1] == 4 and k.shape[1] == v.shape[1] == _kv_heads(kind), (q.shape, k.shape)
        m = a["attn_mask"]
        assert m is None or (m.dtype == torch.bool and m.shape[-2] == 1), (m.dtype, m.shape)

    logits, grads = results[ATTN_EXT]
    tol = TOL[dtype]
    for ref in [impl for impl in models if impl != ATTN_EXT]:
        ref_logits, ref_grads = results[ref]
        _assert_close(f"logits vs {ref}", logits[real], ref_logits[real], tol)
        _assert_grads_close(f"vs {ref}", grads, ref_grads, tol)


def _relative_errors(got, ref):
    """{tensor name: max |got - ref| / its scale} for the logits (max |ref|) and every
    parameter's gradient (_grad_errors' floored scale)."""
    (logits, grads), (ref_logits, ref_grads) = got, ref
    err, scale = _max_err(logits, ref_logits)
    errors = {"logits": err / scale}
    errors.update({name: err / scale for name, (err, scale) in _grad_errors(grads, ref_grads).items()})
    return errors


# attn_ext's bfloat16 error may be this many times torch's own attention's, plus BF16_FLOOR
BF16_FACTOR, BF16_FLOOR = 2.0, 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_model_is_as_accurate_as_torchs_attention(kind, device):
    """A bfloat16 model (left-padded batch, every layer bfloat16) run with attn_ext is
    as close to the same weights in float64 (eager) as the bfloat16 model run with
    torch's own attention (sdpa; eager for the NO_SDPA kinds): on the logits at the
    real positions, and on the worst parameter gradient, attn_ext's relative error is
    at most BF16_FACTOR x torch's + BF16_FLOOR. The float64 model holds the bfloat16
    weights exactly, so the errors are the bfloat16 arithmetic's alone."""
    torch_impl = "eager" if kind in NO_SDPA else "sdpa"
    models = _models(kind, torch.bfloat16, impls=(torch_impl, ATTN_EXT), device=device)
    exact = _build(kind, "eager", torch.float64, state=models[torch_impl].state_dict(), device=device)
    ids = _tokens(2, LENGTH, seed=11).to(device)
    mask = _padding_mask("left").to(device)
    real = mask.bool()
    weights = torch.randn(2, LENGTH, VOCAB, generator=torch.Generator().manual_seed(12), dtype=torch.float64)

    def run(model, dtype):
        logits, grads = _logits_and_grads(model, dtype, ids, mask, weights, real)
        return logits[real], grads

    ref = run(exact, torch.float64)
    with _AttnExtOps() as ops:
        ours = _relative_errors(run(models[ATTN_EXT], torch.bfloat16), ref)
    assert ops.count("attention_forward") == ops.count("attention_backward") == LAYERS, [n for n, _ in ops.calls]
    theirs = _relative_errors(run(models[torch_impl], torch.bfloat16), ref)
    worst = {who: max((e, n) for n, e in errs.items() if n != "logits") for who, errs in
             (("ours", ours), ("theirs", theirs))}
    report = (f"{kind} on {device}: logits {ours['logits']:.2e} (torch's {torch_impl}: {theirs['logits']:.2e}); "
              f"worst gradient {worst['ours'][0]:.2e} ({worst['ours'][1]}) (torch's: {worst['theirs'][0]:.2e} "
              f"({worst['theirs'][1]}))")
    assert ours["logits"] <= BF16_FACTOR * theirs["logits"] + BF16_FLOOR, report
    assert worst["ours"][0] <= BF16_FACTOR * worst["theirs"][0] + BF16_FLOOR, report
    # both are bfloat16-accurate, not exact: the comparison measures something
    assert theirs["logits"] > 1e-5 and worst["theirs"][0] > 1e-5, report


# --------------------------------------------------------------------------- generate


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", DECODERS)
def test_greedy_generate_matches_eager(kind, cache, device):
    """Greedy cached generate() on a left-padded batch (prompt 10 tokens, 8 new: past
    the window of 4) gives eager's tokens, and the logits of every step equal eager's
    (float32 tolerance); attn_ext ran every layer of every step. "dynamic" is the
    default DynamicCache (sliding-window layers keep a sliding cache); "static" a
    StaticCache, whose keys run past the queries: the kernels still get no (B, 1, L, S)
    mask, only key padding, and never the cache's empty slots (the keys of a call of
    step t are at most the 10 + t written so far)."""
    new = 8
    ids = _tokens(2, 10, seed=3)
    mask = _padding_mask("left", length=10, pad=4)
    ids, mask = ids.masked_fill(mask == 0, 0).to(device), mask.to(device)
    models = _models(kind, torch.float32, impls=("eager", ATTN_EXT), device=device)
    extra = dict(cache_implementation="static") if cache == "static" else {}
    outs = {}
    for impl, model in models.items():
        with _AttnExtOps() as ops:
            outs[impl] = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                        min_new_tokens=new, pad_token_id=0, eos_token_id=None,
                                        return_dict_in_generate=True, output_logits=True, **extra)
        if impl == ATTN_EXT:
            # one prefill and new - 1 decoding steps, each through every layer
            assert ops.count("attention_forward") == LAYERS * new, [n for n, _ in ops.calls]
            for call, a in enumerate(ops.args("attention_forward")):
                m, written = a["attn_mask"], 10 + call // LAYERS
                assert m is None or (m.dtype == torch.bool and m.shape[-2] == 1), (call, m.dtype, m.shape)
                assert a["key"].shape[-2] <= written, (call, tuple(a["key"].shape), written)
                assert a["key"].device.type == device, (call, a["key"].device)
        else:
            assert not ops.calls
    got, ref = outs[ATTN_EXT], outs["eager"]
    assert got.sequences.shape == (2, 10 + new)
    assert torch.equal(got.sequences, ref.sequences), f"\n{got.sequences}\n!=\n{ref.sequences}"
    assert len(got.logits) == len(ref.logits) == new
    _assert_close("generate logits", torch.stack(got.logits), torch.stack(ref.logits), TOL[torch.float32])


# --------------------------------------------------------------------------- packed batches


PACKED_KINDS = ["llama", "mistral", "gemma2",
                pytest.param("gpt_oss", marks=pytest.mark.skipif(not HAS_GPT_OSS,
                                                                 reason="this transformers has no GptOssConfig"))]


@pytest.mark.parametrize("use_cache", ["default", "false"])
@pytest.mark.parametrize("kind", PACKED_KINDS)
def test_packed_batch_runs_varlen_and_equals_each_sequence_alone(kind, use_cache, device):
    """Sequences of 5, 7 and 4 tokens packed into one row (batch 1, position_ids
    restarting at 0, no attention_mask) through attn_ext: the logits equal each
    sequence run alone (eager) and the parameters' gradients equal the sum of the
    single sequences'; every layer ran attn_ext's varlen kernel (forward and backward)
    on the key/value heads as they come, and no padded kernel.

    "default": the config's use_cache (True: the model makes a DynamicCache, and
    transformers' mask code then does not look for packed sequences; eager mixes
    them); "false": use_cache=False, where transformers' mask code finds the packed
    sequences and hands the mask function a packed-sequence mask pattern."""
    lengths = [5, 7, 4]
    total = sum(lengths)
    models = _models(kind, torch.float32, impls=("eager", ATTN_EXT), device=device)
    ids = _tokens(1, total, seed=4).to(device)
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
    weights = torch.randn(1, total, VOCAB, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    everywhere = torch.ones(1, total, dtype=torch.bool)
    extra = dict(use_cache=False) if use_cache == "false" else {}

    with _AttnExtOps() as ops:
        logits, grads = _logits_and_grads(models[ATTN_EXT], torch.float32, ids, None, weights, everywhere,
                                          position_ids=position_ids, **extra)
    assert ops.count("varlen_forward") == LAYERS, [n for n, _ in ops.calls]
    assert ops.count("varlen_backward") == LAYERS, [n for n, _ in ops.calls]
    assert ops.count("attention_forward") == 0, [n for n, _ in ops.calls]
    for a in ops.args("varlen_forward"):
        q, k, cu = a["query"], a["key"], a["cu_seqlens_q"]
        assert cu.tolist() == [0, 5, 12, 16] and a["cu_seqlens_k"].tolist() == [0, 5, 12, 16], cu
        assert q.shape[1] == 4 and k.shape[1] == KV_HEADS, (q.shape, k.shape)
        assert q.device.type == device, (q.device, device)

    start, ref_logits, ref_grads = 0, [], None
    for n in lengths:
        piece = slice(start, start + n)
        one, g = _logits_and_grads(models["eager"], torch.float32, ids[:, piece], None, weights[:, piece],
                                   everywhere[:, piece])
        ref_logits.append(one)
        ref_grads = g if ref_grads is None else {
            k: None if v is None else v + g[k] for k, v in ref_grads.items()}
        start += n
    _assert_close("packed logits", logits, torch.cat(ref_logits, dim=1), TOL[torch.float32])
    _assert_grads_close("packed", grads, ref_grads, TOL[torch.float32])


# gpt-oss is left out: its model does not pass position_ids to transformers' mask code,
# so its eager attention does not keep packed sequences apart (nothing to compare with).
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_packed_rows_in_a_batch_of_two_match_eager(kind):
    """Two rows, each packing two sequences (position_ids restarting at 0), no
    attention_mask, use_cache=False: transformers' mask code finds the sequences of
    each row (eager then keeps them apart); attn_ext's logits and gradients equal
    eager's. (The varlen path is for batch 1; a batch of packed rows must still not
    mix its sequences.)"""
    models = _models(kind, torch.float32, impls=("eager", ATTN_EXT))
    ids = _tokens(2, 12, seed=9)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    weights = torch.randn(2, 12, VOCAB, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    everywhere = torch.ones(2, 12, dtype=torch.bool)
    results = {impl: _logits_and_grads(model, torch.float32, ids, None, weights, everywhere,
                                       position_ids=position_ids, use_cache=False)
               for impl, model in models.items()}
    # the reference keeps the sequences apart: row 0's second sequence equals it run alone
    alone, _ = _logits_and_grads(models["eager"], torch.float32, ids[:1, 5:], None, weights[:1, 5:],
                                 everywhere[:1, 5:])
    _assert_close("eager's packed row vs the sequence alone", results["eager"][0][:1, 5:], alone, TOL[torch.float32])
    _assert_close("logits", results[ATTN_EXT][0], results["eager"][0], TOL[torch.float32])
    _assert_grads_close("vs eager", results[ATTN_EXT][1], results["eager"][1], TOL[torch.float32])


# --------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
def test_attention_dropout_in_training(kind):
    """With attention dropout 0.5 in train mode (every other dropout 0): attn_ext's
    kernel gets p = 0.5, the logits are finite, the same torch.manual_seed reproduces
    them, another seed and eval mode change them, and backward gives finite
    gradients through attn_ext's backward kernel. In eval mode the kernel gets p = 0."""
    model = _build(kind, ATTN_EXT, dropout=0.5)
    ids = _tokens(2, LENGTH, seed=6)
    mask = _padding_mask("right")

    def run(seed):
        torch.manual_seed(seed)
        with _AttnExtOps() as ops:
            logits = model(input_ids=ids, attention_mask=mask).logits
        return logits, ops

    with torch.no_grad():
        evaluated, ops = run(0)
    assert ops.count("attention_forward") == LAYERS
    assert all(a["dropout_p"] == 0.0 for a in ops.args("attention_forward")), "eval mode must not drop"

    model.train()
    first, ops = run(0)
    assert ops.count("attention_forward") == LAYERS
    assert all(a["dropout_p"] == pytest.approx(0.5) for a in ops.args("attention_forward")), \
        [a["dropout_p"] for a in ops.args("attention_forward")]
    assert torch.isfinite(first).all()
    again, _ = run(0)
    other, _ = run(1)
    assert torch.equal(first, again), "torch.manual_seed must reproduce attention dropout"
    real = mask.bool()
    for name, t in (("eval mode", evaluated), ("another seed", other)):
        err, scale = _max_err(first[real], t[real])
        assert err > 1e-2 * scale, f"training with dropout gives the same logits as {name}"

    with _AttnExtOps() as ops:
        (first[real] * torch.randn(first[real].shape, generator=torch.Generator().manual_seed(7))).sum().backward()
    assert ops.count("attention_backward") == LAYERS
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    assert any(g is not None and g.abs().max() > 0 for n, g in grads.items() if "attn" in n or "attention" in n)


# --------------------------------------------------------------------------- a user's 4-D mask


@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
def test_a_users_4d_mask_is_applied_as_given(mask_dtype):
    """A 4-D mask handed to the model (transformers passes it on untouched) is the whole
    pattern: a prefix-LM mask (bidirectional over the first 4 tokens, causal after) gives
    sdpa's logits, and eager's too for a float mask (eager adds a bool mask as numbers)."""
    models = _models("llama", torch.float32)
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=gen)
    keep = torch.tril(torch.ones(LENGTH, LENGTH, dtype=torch.bool))
    keep[:4, :4] = True
    mask = keep[None, None].expand(2, 1, LENGTH, LENGTH)
    if mask_dtype == "float":
        mask = torch.zeros(2, 1, LENGTH, LENGTH).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = {impl: m(ids, attention_mask=mask).logits for impl, m in models.items()}
    refs = ["sdpa"] + (["eager"] if mask_dtype == "float" else [])
    for ref in refs:
        scale = logits[ref].abs().max()
        assert (logits[ATTN_EXT] - logits[ref]).abs().max() <= TOL[torch.float32] * scale, ref
    # the pattern matters: without the bidirectional prefix the logits differ
    with torch.no_grad():
        causal = models[ATTN_EXT](ids).logits
    assert (causal[:, :3] - logits[ATTN_EXT][:, :3]).abs().max() > 1e-3


# --------------------------------------------------------------------------- torch.compile


def test_compiled_model_matches_eager_with_padding_and_trains():
    """torch.compile of a model with attn_implementation="attn_ext": a left-padded batch
    gives eager's logits at the real positions, and a loss backpropagates through the
    compiled graph to the same gradients as the uncompiled attn_ext model."""
    torch._dynamo.reset()
    models = _models("llama", torch.float32, impls=("eager", ATTN_EXT))
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, VOCAB, (2, LENGTH), generator=gen)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[0, :PAD] = 0
    real = mask.bool()
    with torch.no_grad():
        expected = models["eager"](ids, attention_mask=mask).logits
    ours = models[ATTN_EXT]
    compiled = torch.compile(ours, fullgraph=True)
    got = compiled(ids, attention_mask=mask).logits
    scale = expected[real].abs().max()
    assert (got - expected)[real].abs().max() <= TOL[torch.float32] * scale
    (got[real] ** 2).mean().backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad(set_to_none=True)
    (ours(ids, attention_mask=mask).logits[real] ** 2).mean().backward()
    for n, p in ours.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_compiled_batch_of_one_with_and_without_packed_sequences():
    """torch.compile(fullgraph=True) of a batch-1 model without an attention_mask: the
    packed-sequence search (data-dependent) is left to transformers' mask under
    compile, so one sequence gives eager's logits, and sequences of 5, 7 and 4 tokens
    packed into the row (position_ids restarting at 0, use_cache=False) give each
    sequence's logits run alone."""
    torch._dynamo.reset()
    models = _models("llama", torch.float32, impls=("eager", ATTN_EXT))
    compiled = torch.compile(models[ATTN_EXT], fullgraph=True, backend="aot_eager")
    ids = _tokens(1, 16, seed=4)
    with torch.no_grad():
        _assert_close("one sequence", compiled(ids).logits, models["eager"](ids).logits, TOL[torch.float32])
        lengths = [5, 7, 4]
        position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        got = compiled(ids, position_ids=position_ids, use_cache=False).logits
        pieces = torch.split(ids, lengths, dim=1)
        ref = torch.cat([models["eager"](piece).logits for piece in pieces], dim=1)
    _assert_close("packed sequences", got, ref, TOL[torch.float32])


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_compiled_static_cache_decoding_steps_match_eager(kind):
    """Decoding steps with a StaticCache under torch.compile(fullgraph=True), as
    transformers compiles them for generation: the mask function's introspection and
    the tensor cache length trace without a graph break, and greedy steps after a
    left-padded eager prefill give eager's tokens and logits (float32 tolerance).
    The traced graph gives every kernel call a one-row bool mask: a causal layer's
    is the whole cache's (the written slots and the padding), which the CPU kernels
    cut after the last written slot."""
    torch._dynamo.reset()
    masks = []

    def recording(gm, example_inputs):  # the masks the traced kernel calls get, then aot_eager
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.attn_ext.attention_forward.default:
                named = {a.name: v for a, v in zip(node.target._schema.arguments, node.args)} | node.kwargs
                mask = named.get("attn_mask")
                masks.append(None if mask is None else mask.meta["example_value"])
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)

    models = _models(kind, torch.float32, impls=("eager", ATTN_EXT))
    ids = _tokens(2, 10, seed=3)
    mask = _padding_mask("left", length=10, pad=4)
    ids = ids.masked_fill(mask == 0, 0)

    def steps(model, forward):
        cache = transformers.StaticCache(config=model.config, max_cache_len=24)
        attention = mask
        logits = [model(ids, attention_mask=attention, past_key_values=cache).logits[:, -1]]
        for _ in range(6):
            token = logits[-1].argmax(-1, keepdim=True)
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            logits.append(forward(token, attention_mask=attention, past_key_values=cache).logits[:, -1])
        return torch.stack(logits, 1)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= is being renamed
        ref = steps(models["eager"], models["eager"])
        ours = models[ATTN_EXT]
        got = steps(ours, torch.compile(ours, fullgraph=True, backend=recording))
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # Every call: a one-row bool mask. Causal layers: the whole cache's 24 slots
    # (the kernels cut it); sliding layers: their window's cache, all of it used.
    shapes = [(None, ()) if m is None else (m.dtype, tuple(m.shape)) for m in masks]
    assert len(masks) >= ours.config.num_hidden_layers and all(
        dtype == torch.bool and shape[-2] == 1 for dtype, shape in shapes), shapes
    if kind != "mistral":  # mistral's layers are all sliding
        assert any(shape[-1] == 24 for _, shape in shapes), shapes
    _assert_close("compiled static-cache logits", got, ref, TOL[torch.float32])


# --------------------------------------------------------------------------- registration, imports


def test_register_returns_the_name_is_idempotent_and_takes_a_custom_name():
    """register() returns "attn_ext" (again on a second call) and registers both the
    attention and the mask function under it; register("custom") does the same under
    "custom", and a model switched to it with set_attn_implementation runs attn_ext
    (the padding mask included: without the mask function transformers would hand it
    no mask) and matches eager on a left-padded batch."""
    assert attn_hf.register() == "attn_ext"
    assert attn_hf.register() == "attn_ext"
    assert "attn_ext" in ALL_ATTENTION_FUNCTIONS and "attn_ext" in ALL_MASK_ATTENTION_FUNCTIONS
    custom = "attn_ext_custom_name_for_test"
    assert attn_hf.register(custom) == custom
    assert attn_hf.register(custom) == custom
    assert custom in ALL_ATTENTION_FUNCTIONS and custom in ALL_MASK_ATTENTION_FUNCTIONS

    eager = _build("mistral", "eager")
    switched = copy.deepcopy(eager)
    switched.set_attn_implementation(custom)
    assert switched.config._attn_implementation == custom
    assert eager.config._attn_implementation == "eager"
    ids, mask = _tokens(2, LENGTH, seed=8), _padding_mask("left")
    real = mask.bool()
    with torch.no_grad():
        ref = eager(input_ids=ids, attention_mask=mask).logits
        with _AttnExtOps() as ops:
            got = switched(input_ids=ids, attention_mask=mask).logits
    assert ops.count("attention_forward") == LAYERS
    _assert_close("logits", got[real], ref[real], TOL[torch.float32])


def test_import_attn_ext_does_not_import_transformers():
    """``import attn_ext`` (in a fresh interpreter) leaves transformers unimported."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = "import attn_ext, sys; assert 'transformers' not in sys.modules, 'attn_ext imported transformers'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
