"""attn_ext.MultiHeadAttention against torch.nn.MultiheadAttention with the same weights.

Every comparison loads torch's module's state_dict into ours (or draws both from
the same seed) and compares outputs, attention weights and every gradient
(parameters, inputs, float masks) by relative error, in float32 and float64,
with dropout 0 unless a test says otherwise. Masks never hide every key of a
row: PyTorch returns NaN there, attn_ext returns 0 (tested on its own).
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import attn_ext
from helpers import make_generator, rel_err

DTYPES = [torch.float32, torch.float64]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
TOL = {torch.float32: 2e-5, torch.float64: 1e-11}

N, L, S, E, H = 2, 5, 7, 16, 4

# torch.nn.MultiheadAttention warns when a bool and a float mask are mixed (deprecated there, tested here).
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched")


def _randn(shape, dtype, device, gen, requires_grad=False):
    t = torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _pair(dtype, device, seed=0, **kwargs):
    """(torch's module, ours with the same weights), both in ``dtype`` on ``device``."""
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(E, H, **kwargs).to(device=device, dtype=dtype)
    ours = attn_ext.MultiHeadAttention(E, H, **kwargs).to(device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _bool_mask(shape, gen, device, p=0.3):
    """True (= masked, nn.MultiheadAttention's polarity) with probability p; key 0 never masked."""
    m = torch.rand(shape, generator=gen) < p
    m[..., 0] = False
    return m.to(device)


def _float_mask(shape, gen, dtype, device):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5).to(device=device, dtype=dtype)


def _inputs(dtype, device, gen, batch_first, kdim=E, vdim=E, unbatched=False, layout="self"):
    """query, key, value for torch's layout: (L, N, E), or (N, L, E) with batch_first, or (L, E)."""
    def shape(n, d):
        if unbatched:
            return (n, d)
        return (N, n, d) if batch_first else (n, N, d)

    q = _randn(shape(L, E), dtype, device, gen, True)
    if layout == "self":
        return q, q, q
    k = _randn(shape(S, kdim), dtype, device, gen, True)
    if layout == "kv_same":
        return q, k, k
    return q, k, _randn(shape(S, vdim), dtype, device, gen, True)


def _compare(theirs, ours, args, kwargs, dtype, extra_leaves=()):
    """Run both modules, compare outputs, weights, parameter and input gradients."""
    out_t, w_t = theirs(*args, **kwargs)
    leaves = [t for t in {id(a): a for a in (*args, *extra_leaves)}.values() if t is not None and t.requires_grad]
    grads_t = _backward(out_t, w_t, theirs, leaves)
    out_o, w_o = ours(*args, **kwargs)
    grads_o = _backward(out_o, w_o, ours, leaves)

    tol = TOL[dtype]
    assert out_o.shape == out_t.shape and out_o.dtype == out_t.dtype
    assert rel_err(out_o, out_t) < tol, f"output rel err {rel_err(out_o, out_t):.2e}"
    if w_t is None:
        assert w_o is None
    else:
        assert w_o.shape == w_t.shape, f"weights shape {tuple(w_o.shape)} != {tuple(w_t.shape)}"
        assert rel_err(w_o, w_t) < tol, f"weights rel err {rel_err(w_o, w_t):.2e}"
    for name in grads_t:
        assert (grads_o[name] is None) == (grads_t[name] is None), name
        if grads_t[name] is not None:
            assert rel_err(grads_o[name], grads_t[name]) < tol, f"grad {name}: {rel_err(grads_o[name], grads_t[name]):.2e}"


def _backward(out, weights, module, leaves):
    gen = make_generator(123)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out)).sum()
    if weights is not None:
        loss = loss + (weights * torch.randn(weights.shape, generator=gen, dtype=torch.float64).to(weights)).sum()
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(loss, params + list(leaves), allow_unused=True)
    names = [n for n, _ in module.named_parameters()] + [f"input{i}" for i in range(len(leaves))]
    return dict(zip(names, grads))


# --------------------------------------------------------------------------- construction


CTOR_OPTIONS = list(itertools.product([True, False], [False, True], [False, True], [None, (11, 9)], [False, True]))


def _ctor_id(opts):
    bias, bias_kv, zero_attn, kv_dims, batch_first = opts
    return (f"bias{int(bias)}-biaskv{int(bias_kv)}-zeroattn{int(zero_attn)}-"
            f"{'kv' + 'x'.join(map(str, kv_dims)) if kv_dims else 'kvE'}-bf{int(batch_first)}")


def _ctor_kwargs(opts):
    bias, bias_kv, zero_attn, kv_dims, batch_first = opts
    kwargs = dict(bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=batch_first)
    if kv_dims:
        kwargs.update(kdim=kv_dims[0], vdim=kv_dims[1])
    return kwargs


@pytest.mark.parametrize("opts", CTOR_OPTIONS, ids=_ctor_id)
def test_same_seed_gives_same_parameters_and_state_dict_layout(opts):
    kwargs = _ctor_kwargs(opts)
    torch.manual_seed(7)
    theirs = torch.nn.MultiheadAttention(E, H, **kwargs)
    torch.manual_seed(7)
    ours = attn_ext.MultiHeadAttention(E, H, **kwargs)
    sd_t, sd_o = theirs.state_dict(), ours.state_dict()
    assert list(sd_o) == list(sd_t)
    for name in sd_t:
        assert torch.equal(sd_o[name], sd_t[name]), name
    for attr in ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first",
                 "_qkv_same_embed_dim", "add_zero_attn"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr


def test_from_torch_copies_configuration_weights_and_mode():
    theirs = torch.nn.MultiheadAttention(E, H, dropout=0.1, add_bias_kv=True, kdim=11, vdim=9,
                                         batch_first=True, dtype=torch.float64).eval()
    ours = attn_ext.MultiHeadAttention.from_torch(theirs)
    assert not ours.training and ours.dropout == 0.1 and ours.batch_first and ours.kdim == 11
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    assert ours.in_proj_bias.dtype == torch.float64


# --------------------------------------------------------------------------- forward vs torch


@dtypes
@pytest.mark.parametrize("opts", CTOR_OPTIONS, ids=_ctor_id)
def test_every_constructor_option_matches_torch(device, dtype, opts):
    kwargs = _ctor_kwargs(opts)
    theirs, ours = _pair(dtype, device, **kwargs)
    gen = make_generator(sum(map(bool, opts)) + 3)
    layout = "self" if "kdim" not in kwargs else "separate"
    args = _inputs(dtype, device, gen, kwargs["batch_first"], kwargs.get("kdim", E), kwargs.get("vdim", E),
                   layout=layout)
    S_ = args[1].shape[1 if kwargs["batch_first"] else 0]
    fwd = dict(key_padding_mask=_bool_mask((N, S_), gen, device), attn_mask=_float_mask((L, S_), gen, dtype, device),
               need_weights=True, average_attn_weights=False)
    _compare(theirs, ours, args, fwd, dtype)


KPM = ["none", "bool", "float"]
ATTN_MASK = ["none", "2d_bool", "2d_float", "3d_bool", "3d_float"]


def _masks(kpm_kind, am_kind, gen, dtype, device, S_=S, batch=N, unbatched=False):
    kpm = None
    kpm_shape = (S_,) if unbatched else (batch, S_)
    if kpm_kind == "bool":
        kpm = _bool_mask(kpm_shape, gen, device)
    elif kpm_kind == "float":
        kpm = _float_mask(kpm_shape, gen, dtype, device).masked_fill(_bool_mask(kpm_shape, gen, device), float("-inf"))
    am = None
    if am_kind != "none":
        shape = (L, S_) if am_kind.startswith("2d") else ((H if unbatched else batch * H), L, S_)
        am = _bool_mask(shape, gen, device) if am_kind.endswith("bool") else _float_mask(shape, gen, dtype, device)
    return kpm, am


@dtypes
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)],
                         ids=["weights_avg", "weights_per_head", "no_weights"])
@pytest.mark.parametrize("am_kind", ATTN_MASK)
@pytest.mark.parametrize("kpm_kind", KPM)
def test_every_mask_combination_matches_torch(device, dtype, kpm_kind, am_kind, need_weights, average):
    theirs, ours = _pair(dtype, device, batch_first=True)
    gen = make_generator(KPM.index(kpm_kind) * 10 + ATTN_MASK.index(am_kind))
    q, k, v = _inputs(dtype, device, gen, True, layout="separate")
    kpm, am = _masks(kpm_kind, am_kind, gen, dtype, device)
    _compare(theirs, ours, (q, k, v), dict(key_padding_mask=kpm, attn_mask=am, need_weights=need_weights,
                                           average_attn_weights=average), dtype)


@dtypes
@pytest.mark.parametrize("layout", ["self", "kv_same", "separate"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
def test_self_and_cross_attention_layouts_match_torch(device, dtype, layout, batch_first):
    theirs, ours = _pair(dtype, device, batch_first=batch_first)
    gen = make_generator(5)
    args = _inputs(dtype, device, gen, batch_first, layout=layout)
    _compare(theirs, ours, args, dict(need_weights=True), dtype)


@dtypes
@pytest.mark.parametrize("am_kind", ["none", "2d_bool", "3d_float"])
@pytest.mark.parametrize("kpm_kind", ["none", "bool"])
def test_unbatched_inputs_match_torch(device, dtype, kpm_kind, am_kind):
    theirs, ours = _pair(dtype, device, add_bias_kv=True)
    gen = make_generator(11)
    q, k, v = _inputs(dtype, device, gen, False, unbatched=True, layout="separate")
    kpm, am = _masks(kpm_kind, am_kind, gen, dtype, device, unbatched=True)
    _compare(theirs, ours, (q, k, v), dict(key_padding_mask=kpm, attn_mask=am, average_attn_weights=False), dtype)


@dtypes
@pytest.mark.parametrize("need_weights", [False, True])
def test_is_causal_hint_with_causal_mask_matches_torch(device, dtype, need_weights):
    theirs, ours = _pair(dtype, device, batch_first=True)
    gen = make_generator(3)
    q, _, _ = _inputs(dtype, device, gen, True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=dtype)
    kwargs = dict(attn_mask=causal, is_causal=True, need_weights=need_weights)
    _compare(theirs, ours, (q, q, q), kwargs, dtype)
    # Ours also takes is_causal without a mask: the same result.
    out_flag, _ = ours(q, q, q, is_causal=True, need_weights=False)
    out_mask, _ = ours(q, q, q, attn_mask=causal, need_weights=False)
    assert rel_err(out_flag, out_mask) < TOL[dtype]
    # The hint is trusted, as in torch's SDPA path: the causal flag replaces the mask.
    out_hint, _ = ours(q, q, q, attn_mask=torch.zeros_like(causal), is_causal=True, need_weights=need_weights)
    assert rel_err(out_hint, out_mask) < TOL[dtype]


@dtypes
def test_square_subsequent_mask_runs_as_the_causal_flag(device, dtype):
    """nn.Transformer's float causal mask (0 and -inf), with a key-padding mask beside it:
    on the CPU the kernels read the -inf as hidden keys and run the pattern as the causal
    flag, so output and gradients are the flag call's bitwise."""
    if device != "cpu":
        pytest.skip("the CUDA kernels read the mask as given")
    _, ours = _pair(dtype, device, batch_first=True)
    T = 70  # rows over several micro-kernel row groups and key vectors
    x = torch.randn(N, T, ours.embed_dim, generator=make_generator(4)).to(device, dtype)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(T, device=device, dtype=dtype)
    pad = torch.zeros(N, T, dtype=torch.bool, device=device)
    pad[0, :20] = True  # entry 0 left-padded
    results = []
    for kwargs in (dict(attn_mask=causal), dict(is_causal=True)):
        leaf = x.clone().requires_grad_(True)
        out, _ = ours(leaf, leaf, leaf, key_padding_mask=pad, need_weights=False, **kwargs)
        g = torch.randn(out.shape, generator=make_generator(5)).to(device, dtype)
        results.append((out, *torch.autograd.grad(out, [leaf, *ours.parameters()], g)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@dtypes
def test_float_attn_mask_gradient_matches_torch(device, dtype):
    theirs, ours = _pair(dtype, device, batch_first=True)
    gen = make_generator(9)
    q, k, v = _inputs(dtype, device, gen, True, layout="separate")
    bias = _float_mask((N * H, L, S), gen, dtype, device).requires_grad_(True)
    _compare(theirs, ours, (q, k, v), dict(attn_mask=bias, need_weights=False), dtype, extra_leaves=(bias,))


def test_fully_masked_rows_give_zero_not_nan(device):
    _, ours = _pair(torch.float64, device, batch_first=True, bias=False)
    gen = make_generator(2)
    q, k, v = _inputs(torch.float64, device, gen, True, layout="separate")
    kpm = torch.zeros(N, S, dtype=torch.bool, device=device)
    kpm[1] = True  # batch 1 sees no key at all
    out, w = ours(q, k, v, key_padding_mask=kpm)
    assert not out.isnan().any() and not w.isnan().any()
    assert (out[1] == 0).all() and (w[1] == 0).all()  # no out_proj bias: the output is exactly 0
    out.sum().backward()
    assert not q.grad.isnan().any() and (k.grad[1] == 0).all()


def test_need_weights_with_dropout_returns_the_weights_the_output_used(device):
    """With dropout, the weights come from the probabilities kernel with the fused
    kernel's seed: recomputing the output from them gives the module's output."""
    _, ours = _pair(torch.float64, device, batch_first=True, dropout=0.4)
    ours.train()
    gen = make_generator(4)
    q, k, v = _inputs(torch.float64, device, gen, True, layout="separate")
    torch.manual_seed(0)
    out, w = ours(q, k, v, average_attn_weights=False)
    assert (w == 0).any(), "dropout dropped nothing"
    b_v = ours.in_proj_bias[2 * E:]
    v_heads = F.linear(v, ours.in_proj_weight[2 * E:], b_v).unflatten(-1, (H, E // H)).transpose(1, 2)
    again = F.linear((w @ v_heads).transpose(1, 2).reshape(N, L, E), ours.out_proj.weight, ours.out_proj.bias)
    assert rel_err(out, again) < 1e-12
    ours.eval()
    out_eval, _ = ours(q, k, v)
    assert rel_err(out_eval, out) > 1e-3  # dropout is off in eval mode


def test_module_forward_passes_gradcheck(device):
    _, ours = _pair(torch.float64, device, batch_first=True, add_bias_kv=True)
    gen = make_generator(8)
    q, k, v = (_randn((2, n, E), torch.float64, device, gen, True) for n in (3, 4, 4))
    bias = _float_mask((3, 4), gen, torch.float64, device).requires_grad_(True)
    kpm = torch.tensor([[False, False, True, False], [False, False, False, False]], device=device)

    def f(q, k, v, bias):
        out, w = ours(q, k, v, attn_mask=bias, key_padding_mask=kpm, average_attn_weights=False)
        return out, w

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


# --------------------------------------------------------------------------- in torch's Transformer layers


def _layers_equal_after_swap(theirs, ours, src, dtype, **kwargs):
    out_t = theirs(src, **kwargs)
    out_o = ours(src, **kwargs)
    assert rel_err(out_o, out_t) < TOL[dtype], f"rel err {rel_err(out_o, out_t):.2e}"
    return out_o


@dtypes
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_layer_swap_gives_same_results(device, dtype, norm_first):
    torch.manual_seed(0)
    theirs = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=32, dropout=0.0, batch_first=True,
                                              norm_first=norm_first).to(device=device, dtype=dtype)
    ours = attn_ext.convert_attention(__import__("copy").deepcopy(theirs))
    assert isinstance(ours.self_attn, attn_ext.MultiHeadAttention)
    gen = make_generator(1)
    src = _randn((N, L, E), dtype, device, gen, True)
    pad = _bool_mask((N, L), gen, device)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=dtype)
    kwargs = dict(src_mask=causal, src_key_padding_mask=pad, is_causal=True)

    out_t = theirs(src, **kwargs)
    out_o = ours(src, **kwargs)
    assert rel_err(out_o, out_t) < TOL[dtype], f"{rel_err(out_o, out_t):.2e}"
    cot = _randn(out_t.shape, dtype, device, gen)  # a random cotangent (LayerNorm makes a sum of squares flat)
    g_t = torch.autograd.grad((out_t * cot).sum(), [src, *theirs.parameters()])
    g_o = torch.autograd.grad((out_o * cot).sum(), [src, *ours.parameters()])
    for a, b in zip(g_o, g_t):
        assert rel_err(a, b) < TOL[dtype], f"{rel_err(a, b):.2e}"

    # Inference (eval, no grad) would take torch's fused fast path, which bypasses
    # self_attn: ours is called all the same, and agrees.
    theirs.eval(), ours.eval()
    calls = []
    handle = ours.self_attn.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        _layers_equal_after_swap(theirs, ours, src, dtype, src_key_padding_mask=pad)
    handle.remove()
    assert calls, "nn.TransformerEncoderLayer did not call attn_ext.MultiHeadAttention"


@dtypes
def test_transformer_decoder_layer_swap_gives_same_results(device, dtype):
    torch.manual_seed(0)
    theirs = torch.nn.TransformerDecoderLayer(E, H, dim_feedforward=32, dropout=0.0).to(device=device, dtype=dtype)
    ours = attn_ext.convert_attention(__import__("copy").deepcopy(theirs))
    assert isinstance(ours.self_attn, attn_ext.MultiHeadAttention)
    assert isinstance(ours.multihead_attn, attn_ext.MultiHeadAttention)
    gen = make_generator(2)
    tgt = _randn((L, N, E), dtype, device, gen, True)
    memory = _randn((S, N, E), dtype, device, gen, True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=dtype)
    mem_pad = _bool_mask((N, S), gen, device)
    kwargs = dict(tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mem_pad)
    out_t, out_o = theirs(tgt, memory, **kwargs), ours(tgt, memory, **kwargs)
    assert rel_err(out_o, out_t) < TOL[dtype], f"{rel_err(out_o, out_t):.2e}"
    cot = _randn(out_t.shape, dtype, device, gen)
    g_t = torch.autograd.grad((out_t * cot).sum(), [tgt, memory])
    g_o = torch.autograd.grad((out_o * cot).sum(), [tgt, memory])
    for a, b in zip(g_o, g_t):
        assert rel_err(a, b) < TOL[dtype], f"{rel_err(a, b):.2e}"


def test_whole_transformer_converts_and_matches(device):
    torch.manual_seed(0)
    theirs = torch.nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32,
                                  dropout=0.0, batch_first=True, dtype=torch.float64).to(device)
    ours = attn_ext.convert_attention(__import__("copy").deepcopy(theirs))
    converted = [m for m in ours.modules() if isinstance(m, attn_ext.MultiHeadAttention)]
    assert len(converted) == 2 + 2 * 2
    assert not any(isinstance(m, torch.nn.MultiheadAttention) for m in ours.modules())
    gen = make_generator(3)
    src, tgt = _randn((N, S, E), torch.float64, device, gen), _randn((N, L, E), torch.float64, device, gen)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, device=device, dtype=torch.float64)
    assert rel_err(ours(src, tgt, tgt_mask=mask), theirs(src, tgt, tgt_mask=mask)) < 1e-10


# --------------------------------------------------------------------------- grouped-query attention


def _gqa_reference(m, x, attn_mask=None, is_causal=False):
    """Plain float64 math for MultiHeadAttention with num_kv_heads (self-attention, batch_first)."""
    Hq, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    kv = Hkv * D
    proj = F.linear(x, m.in_proj_weight, m.in_proj_bias)
    q, k, v = proj.split([m.embed_dim, kv, kv], dim=-1)
    q = q.unflatten(-1, (Hq, D)).transpose(1, 2)
    k = k.unflatten(-1, (Hkv, D)).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    v = v.unflatten(-1, (Hkv, D)).transpose(1, 2).repeat_interleave(Hq // Hkv, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    if is_causal:
        Lq, Sk = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(Lq, Sk, dtype=torch.bool, device=x.device).triu(Sk - Lq + 1),
                                    float("-inf"))
    if attn_mask is not None:
        scores = scores + attn_mask
    p = scores.softmax(-1)
    out = (p @ v).transpose(1, 2).flatten(-2)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias), p


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_grouped_query_attention_matches_plain_math(device, num_kv_heads):
    torch.manual_seed(0)
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True, num_kv_heads=num_kv_heads, dtype=torch.float64).to(device)
    kv = num_kv_heads * (E // H)
    assert m.in_proj_weight.shape == (E + 2 * kv, E)
    assert m.in_proj_bias.shape == (E + 2 * kv,)
    gen = make_generator(num_kv_heads)
    x = _randn((N, L, E), torch.float64, device, gen, True)
    bias = _float_mask((L, L), gen, torch.float64, device)
    out, w = m(x, x, x, attn_mask=bias, average_attn_weights=False)
    ref, ref_w = _gqa_reference(m, x, attn_mask=bias)
    assert rel_err(out, ref) < 1e-12 and rel_err(w, ref_w) < 1e-12
    g = torch.autograd.grad(out.sum(), [x, m.in_proj_weight])
    g_ref = torch.autograd.grad(ref.sum(), [x, m.in_proj_weight])
    assert all(rel_err(a, b) < 1e-11 for a, b in zip(g, g_ref))


def test_grouped_query_attention_with_separate_kdim_vdim(device):
    m = attn_ext.MultiHeadAttention(E, H, kdim=11, vdim=9, num_kv_heads=2, dtype=torch.float64).to(device)
    assert m.k_proj_weight.shape == (8, 11) and m.v_proj_weight.shape == (8, 9)
    gen = make_generator(1)
    q, k, v = _inputs(torch.float64, device, gen, False, 11, 9, layout="separate")
    out, w = m(q, k, v)
    assert out.shape == (L, N, E) and w.shape == (N, L, S)
    assert torch.allclose(w.sum(-1), torch.ones((), dtype=torch.float64, device=device))


# --------------------------------------------------------------------------- variants and packed sequences


def _variant_reference(m, x, is_causal, cu_seqlens=None):
    """The module's output in float64 by the reference math: its projections, then
    attention_reference with the module's window, softcap and sinks (per sequence when packed)."""
    from attn_ext.reference import attention_reference

    H_, D = m.num_heads, m.head_dim
    q, k, v = F.linear(x, m.in_proj_weight, m.in_proj_bias).split([E, E, E], dim=-1)
    kw = dict(is_causal=is_causal, window=m.window, softcap=m.softcap, sinks=m.sinks)
    if cu_seqlens is None:  # (N, L, E) batch_first
        heads = [t.unflatten(-1, (H_, D)).transpose(1, 2) for t in (q, k, v)]
        out, _ = attention_reference(*heads, **kw)
        out = out.transpose(1, 2).flatten(-2)
    else:  # (total, E): each sequence alone
        outs = []
        for b in range(len(cu_seqlens) - 1):
            rows = slice(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
            heads = [t[rows].unflatten(-1, (H_, D)).transpose(0, 1) for t in (q, k, v)]
            o, _ = attention_reference(*heads, **kw)
            outs.append(o.transpose(0, 1).flatten(-2))
        out = torch.cat(outs)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias)


@pytest.mark.parametrize("variants", [dict(window=(3, 0)), dict(window=(2, 1), softcap=2.5),
                                      dict(sinks=True), dict(window=(4, None), softcap=1.5, sinks=True)],
                         ids=["window", "window_softcap", "sinks", "everything"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_module_variants_match_the_reference(device, variants, is_causal):
    torch.manual_seed(0)
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True, dtype=torch.float64, **variants).to(device)
    if m.sinks is not None:
        with torch.no_grad():
            m.sinks.copy_(torch.randn(H, generator=make_generator(5), dtype=torch.float64))
    x = _randn((N, 9, E), torch.float64, device, make_generator(1), True)
    out, _ = m(x, x, x, is_causal=is_causal, need_weights=False)
    ref = _variant_reference(m, x, is_causal)
    assert rel_err(out, ref) < 1e-12
    params = [x, m.in_proj_weight] + ([m.sinks] if m.sinks is not None else [])
    g = torch.autograd.grad(out.sum(), params)
    g_ref = torch.autograd.grad(ref.sum(), params)
    assert all(rel_err(a, b) < 1e-11 for a, b in zip(g, g_ref))
    # the weights come from the probabilities kernel with the same variants
    out_w, w = m(x, x, x, is_causal=is_causal, average_attn_weights=False)
    assert rel_err(out_w, out) < 1e-12 and w.shape == (N, H, 9, 9)


@pytest.mark.parametrize("variants", [dict(), dict(window=(2, 0), sinks=True)], ids=["plain", "window_sinks"])
def test_module_packed_sequences_match_each_sequence_alone(device, variants):
    torch.manual_seed(0)
    m = attn_ext.MultiHeadAttention(E, H, dtype=torch.float64, num_kv_heads=2, **variants).to(device)
    cu = torch.tensor([0, 3, 3, 10, 11], device=device)
    x = _randn((11, E), torch.float64, device, make_generator(2), True)
    out, w = m(x, x, x, is_causal=True, need_weights=False, cu_seqlens=cu)
    assert w is None and out.shape == (11, E)
    alone = [m(x[cu[b]:cu[b + 1]], x[cu[b]:cu[b + 1]], x[cu[b]:cu[b + 1]], is_causal=True, need_weights=False)[0]
             for b in range(4) if cu[b + 1] > cu[b]]
    expected = torch.cat(alone)
    assert rel_err(out, expected) < 1e-12
    g = torch.autograd.grad(out.sum(), [x, m.in_proj_weight])
    g_ref = torch.autograd.grad(expected.sum(), [x, m.in_proj_weight])
    assert all(rel_err(a, b) < 1e-11 for a, b in zip(g, g_ref))


def test_module_variant_misuse_raises_naming_the_value(device):
    with pytest.raises(ValueError, match=r"window.*\(-1, 0\)"):
        attn_ext.MultiHeadAttention(E, H, window=(-1, 0))
    with pytest.raises(ValueError, match=r"window.*add_bias_kv"):
        attn_ext.MultiHeadAttention(E, H, window=(4, 0), add_bias_kv=True)
    with pytest.raises(ValueError, match=r"softcap.*-2"):
        attn_ext.MultiHeadAttention(E, H, softcap=-2.0)
    m = attn_ext.MultiHeadAttention(E, H).to(device)
    x = torch.randn(6, E, device=device)
    cu = torch.tensor([0, 2, 6], device=device)
    with pytest.raises(ValueError, match=r"cu_seqlens.*need_weights"):
        m(x, x, x, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"cu_seqlens.*key_padding_mask"):
        m(x, x, x, cu_seqlens=cu, need_weights=False, key_padding_mask=torch.zeros(6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query must be 2-D.*\(1, 6, 16\)"):
        m(x[None], x[None], x[None], cu_seqlens=cu, need_weights=False)


# --------------------------------------------------------------------------- decoding cache


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("prefill", [0, 3])
def test_decoding_cache_steps_equal_the_full_causal_computation(device, num_kv_heads, prefill):
    torch.manual_seed(0)
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True, num_kv_heads=num_kv_heads,
                                    dtype=torch.float64).to(device).eval()
    T = 9
    x = _randn((N, T, E), torch.float64, device, make_generator(prefill))
    with torch.no_grad():
        full, full_w = m(x, x, x, is_causal=True, average_attn_weights=False)
        cache = attn_ext.KVCache()
        steps = [x[:, :prefill]] if prefill else []
        steps += list(x[:, prefill:].split(1, dim=1))
        outs, seen = [], 0
        for chunk in steps:
            out, w = m(chunk, chunk, chunk, is_causal=True, cache=cache, average_attn_weights=False)
            seen += chunk.shape[1]
            assert len(cache) == seen and w.shape == (N, H, chunk.shape[1], seen)
            # The step's weights are the full computation's rows, up to the keys seen so far.
            assert rel_err(w, full_w[:, :, seen - chunk.shape[1]:seen, :seen]) < 1e-12
            outs.append(out)
    assert rel_err(torch.cat(outs, dim=1), full) < 1e-12


def test_decoding_cache_with_autograd_matches_full_gradients(device):
    torch.manual_seed(0)
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True, dtype=torch.float64).to(device)
    x = _randn((N, 6, E), torch.float64, device, make_generator(1), True)
    full, _ = m(x, x, x, is_causal=True, need_weights=False)
    cache = attn_ext.KVCache()
    stepped = torch.cat([m(t, t, t, is_causal=True, need_weights=False, cache=cache)[0]
                         for t in x.split(2, dim=1)], dim=1)
    assert rel_err(stepped, full) < 1e-12
    g_full = torch.autograd.grad(full.square().sum(), [x, m.in_proj_weight])
    g_step = torch.autograd.grad(stepped.square().sum(), [x, m.in_proj_weight])
    assert all(rel_err(a, b) < 1e-11 for a, b in zip(g_step, g_full))


def test_decoding_cache_reserves_grows_and_resets(device):
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True).to(device).eval()
    cache = attn_ext.KVCache(capacity=4)
    x = torch.randn(1, 10, E, device=device)
    with torch.no_grad():
        for t in x.split(1, dim=1):
            m(t, t, t, need_weights=False, is_causal=True, cache=cache)
    assert len(cache) == 10 and cache.key.shape == (1, H, 10, E // H)
    cache.reset()
    assert len(cache) == 0 and cache.key is None


def test_decoding_cache_appends_in_place_and_moves_only_to_double(device):
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True).to(device).eval()
    # 100 tokens in room for 2, 3, 5, 9, 17, 33, 65, 129 (one slot kept free): 8 moves; reserved: one
    for capacity, most_moves in ((0, 8), (100, 1)):
        cache, moves, where = attn_ext.KVCache(capacity=capacity), 0, None
        with torch.no_grad():
            for t in torch.randn(1, 100, E, device=device).split(1, dim=1):
                m(t, t, t, need_weights=False, is_causal=True, cache=cache)
                moves += cache.key.data_ptr() != where
                where = cache.key.data_ptr()
        assert moves <= most_moves, f"capacity={capacity}: the keys moved {moves} times in 100 steps"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(embed_dim=10, num_heads=4), r"embed_dim.*divisible.*embed_dim=10.*num_heads=4"),
    (dict(embed_dim=16, num_heads=4, num_kv_heads=3), r"multiple of num_kv_heads.*num_heads=4.*num_kv_heads=3"),
    (dict(embed_dim=16, num_heads=0), r"num_heads=0"),
    (dict(embed_dim=16, num_heads=4, dropout=1.0), r"dropout.*1\.0"),
], ids=["embed_dim_not_divisible", "kv_heads_not_divisor", "zero_heads", "dropout_one"])
def test_bad_constructor_arguments_raise_naming_the_value(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        attn_ext.MultiHeadAttention(**kwargs)


def _bad_forward_cases(device):
    x = torch.randn(N, L, E, device=device)
    y = torch.randn(N, S, E, device=device)
    return {
        "attn_mask_wrong_2d": (dict(attn_mask=torch.zeros(L, S + 1, device=device)), r"\(5, 7\).*\(5, 8\)"),
        "attn_mask_wrong_3d": (dict(attn_mask=torch.zeros(N, L, S, device=device)), r"\(8, 5, 7\).*\(2, 5, 7\)"),
        "attn_mask_4d": (dict(attn_mask=torch.zeros(1, 1, L, S, device=device)), r"\(1, 1, 5, 7\)"),
        "attn_mask_int": (dict(attn_mask=torch.zeros(L, S, dtype=torch.int32, device=device)), r"int32"),
        "kpm_wrong": (dict(key_padding_mask=torch.zeros(N, S - 1, dtype=torch.bool, device=device)), r"\(2, 6\)"),
        "kpm_int": (dict(key_padding_mask=torch.zeros(N, S, dtype=torch.int64, device=device)), r"int64"),
        "kpm_1d_for_batched": (dict(key_padding_mask=torch.zeros(S, dtype=torch.bool, device=device)), r"2-D.*\(7,\)"),
    }, x, y


@pytest.mark.parametrize("case", list(_bad_forward_cases("cpu")[0]))
def test_bad_masks_raise_naming_the_value(device, case):
    cases, x, y = _bad_forward_cases(device)
    kwargs, pattern = cases[case]
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True).to(device)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=pattern):
        m(x, y, y, **kwargs)


def test_bad_inputs_raise_naming_the_value(device):
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True).to(device)
    x = torch.randn(N, L, E, device=device)
    with pytest.raises(ValueError, match=r"embed_dim = 16.*\(2, 5, 12\)"):
        m(x[..., :12], x, x)
    with pytest.raises(ValueError, match=r"batch size.*\(2, 5, 16\).*\(3, 5, 16\)"):
        m(x, torch.randn(3, L, E, device=device), torch.randn(3, L, E, device=device))
    with pytest.raises(ValueError, match=r"3-D \(batched\) or 2-D.*\(1, 2, 5, 16\)"):
        m(x[None], x[None], x[None])


def test_cache_misuse_raises_naming_the_value(device):
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True).to(device).eval()
    cache = attn_ext.KVCache()
    with torch.no_grad():
        m(torch.randn(2, 3, E, device=device), *[torch.randn(2, 3, E, device=device)] * 2, cache=cache)
        x3 = torch.randn(3, 1, E, device=device)
        with pytest.raises(ValueError, match=r"batch of 2, got a batch of 3"):
            m(x3, x3, x3, cache=cache)
        other = attn_ext.MultiHeadAttention(2 * E, H, batch_first=True).to(device).eval()
        x = torch.randn(2, 1, 2 * E, device=device)
        with pytest.raises(ValueError, match=r"4 heads x 4 dims, got 4 x 8"):
            other(x, x, x, cache=cache)
        with_bias = attn_ext.MultiHeadAttention(E, H, batch_first=True, add_bias_kv=True).to(device)
        x = torch.randn(2, 1, E, device=device)
        with pytest.raises(ValueError, match=r"add_bias_kv"):
            with_bias(x, x, x, cache=attn_ext.KVCache())
    assert len(cache) == 3, "a rejected call must not change the cache"


def test_module_compiles_with_fullgraph_and_matches_eager():
    torch.manual_seed(0)
    m = attn_ext.MultiHeadAttention(E, H, batch_first=True, num_kv_heads=2, dtype=torch.float64)
    compiled = torch.compile(m, fullgraph=True)
    x = _randn((N, L, E), torch.float64, "cpu", make_generator(0), True)
    kpm = _bool_mask((N, L), make_generator(1), "cpu")
    out, w = m(x, x, x, key_padding_mask=kpm, is_causal=True)
    out_c, w_c = compiled(x, x, x, key_padding_mask=kpm, is_causal=True)
    assert rel_err(out_c, out) < 1e-12 and rel_err(w_c, w) < 1e-12
    g = torch.autograd.grad(out.sum(), x)[0]
    g_c = torch.autograd.grad(out_c.sum(), x)[0]
    assert rel_err(g_c, g) < 1e-12


def test_converted_transformer_encoder_runs_inference_with_padding(device):
    """nn.TransformerEncoder's nested-tensor inference path is turned off by convert_attention."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, dtype=torch.float64)
    theirs = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).to(device).eval()
    ours = attn_ext.convert_attention(__import__("copy").deepcopy(theirs))
    x = _randn((N, L, E), torch.float64, device, make_generator(0))
    pad = torch.zeros(N, L, dtype=torch.bool, device=device)
    pad[1, 3:] = True
    with torch.no_grad():
        out_t, out_o = theirs(x, src_key_padding_mask=pad), ours(x, src_key_padding_mask=pad)
    # torch's nested path zeroes the padded positions; compare the real tokens.
    keep = ~pad
    assert rel_err(out_o[keep], out_t[keep]) < 1e-10
    with pytest.raises(ValueError, match="nested tensors"):
        nested = torch.nested.nested_tensor([x[0], x[1, :3]])
        ours.layers[0].self_attn(nested, nested, nested)
