"""attn_ext's operators under torch.compile(fullgraph=True) and torch.export."""

import math

import pytest
import torch

import attn_ext
from attn_ext.benchmark.common import CountingInductor
from helpers import make_generator, rel_err


def _qkv(device, dtype=torch.float32, requires_grad=True):
    gen = make_generator(0)
    shapes = [(2, 4, 33, 16), (2, 2, 47, 16), (2, 2, 47, 24)]
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_(requires_grad)
            for s in shapes]


def _attention(q, k, v, bias):
    out, lse = attn_ext.scaled_dot_product_attention(q, k, v, bias, is_causal=True, enable_gqa=True,
                                                     causal_alignment="bottom_right", return_lse=True)
    probs = attn_ext.attention_probs(q, k, bias, is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    return out, lse, probs


def test_forward_and_backward_compile_with_fullgraph(device):
    torch._dynamo.reset()
    q, k, v = _qkv(device)
    bias = torch.randn(33, 47, generator=make_generator(1)).to(device).requires_grad_()
    compiled = torch.compile(_attention, fullgraph=True)  # fullgraph: a graph break raises
    eager = _attention(q, k, v, bias)
    got = compiled(q, k, v, bias)
    for a, b in zip(got, eager):
        assert rel_err(a, b) < 1e-6
    leaves = (q, k, v, bias)
    loss = lambda outs: sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))  # noqa: E731
    g_eager = torch.autograd.grad(loss(eager), leaves)
    g_comp = torch.autograd.grad(loss(got), leaves)
    for a, b in zip(g_comp, g_eager):
        assert rel_err(a, b) < 1e-6


def test_dropout_compiles_and_reproduces_with_the_seed(device):
    torch._dynamo.reset()
    q, k, v = _qkv(device, requires_grad=False)
    f = torch.compile(lambda q, k, v: attn_ext.scaled_dot_product_attention(q, k, v, dropout_p=0.3,
                                                                           enable_gqa=True), fullgraph=True)
    torch.manual_seed(5)
    a = f(q, k, v)
    torch.manual_seed(5)
    b = f(q, k, v)
    torch.manual_seed(6)
    c = f(q, k, v)
    assert torch.equal(a, b) and not torch.equal(a, c)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = attn_ext.MultiHeadAttention(32, 4, batch_first=True, num_kv_heads=2)

    def forward(self, x, pad):
        return self.attn(x, x, x, key_padding_mask=pad, is_causal=True, need_weights=False)[0]


def test_module_exports_and_the_exported_program_matches(device):
    block = _Block().to(device).eval()
    x = torch.randn(2, 9, 32, generator=make_generator(2)).to(device)
    pad = torch.zeros(2, 9, dtype=torch.bool, device=device)
    pad[1, 6:] = True
    exported = torch.export.export(block, (x, pad))
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert any("attn_ext.attention_forward" in t for t in targets), targets
    assert rel_err(exported.module()(x, pad), block(x, pad)) < 1e-6


def test_functional_export_keeps_the_operators_in_the_graph(device):
    class F(torch.nn.Module):
        def forward(self, q, k, v, bias):
            return _attention(q, k, v, bias)

    q, k, v = _qkv(device, requires_grad=False)
    bias = torch.randn(33, 47, generator=make_generator(1)).to(device)
    exported = torch.export.export(F(), (q, k, v, bias))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert any("attn_ext.attention_forward" in t for t in targets)
    assert any("attn_ext.attention_probs" in t for t in targets)
    for a, b in zip(exported.module()(q, k, v, bias), _attention(q, k, v, bias)):
        assert rel_err(a, b) < 1e-6


def _variants(q, k, v, bias, slopes, sinks):
    kw = dict(is_causal=True, enable_gqa=True, causal_alignment="bottom_right", window=(8, 2), softcap=3.0,
              alibi_slopes=slopes, sinks=sinks)
    out, lse = attn_ext.scaled_dot_product_attention(q, k, v, bias, return_lse=True, **kw)
    probs = attn_ext.attention_probs(q, k, bias, **kw)
    return out, lse, probs


def test_variants_compile_with_fullgraph(device):
    torch._dynamo.reset()
    q, k, v = _qkv(device)
    gen = make_generator(3)
    bias = torch.randn(33, 47, generator=gen).to(device).requires_grad_()
    slopes = (torch.rand(2, 4, generator=gen) * 0.1).to(device)
    sinks = torch.randn(4, generator=gen).to(device).requires_grad_()
    compiled = torch.compile(_variants, fullgraph=True)  # a graph break raises
    eager = _variants(q, k, v, bias, slopes, sinks)
    got = compiled(q, k, v, bias, slopes, sinks)
    for a, b in zip(got, eager):
        assert rel_err(a, b) < 1e-6
    leaves = (q, k, v, bias, sinks)
    loss = lambda outs: sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))  # noqa: E731
    g_eager = torch.autograd.grad(loss(eager), leaves)
    g_comp = torch.autograd.grad(loss(got), leaves)
    for a, b in zip(g_comp, g_eager):
        assert rel_err(a, b) < 1e-6


def _packed(q, k, v, cu_q, cu_k, sinks):
    # max_seqlen given: computing it from cu_seqlens would read data (a graph break)
    return attn_ext.varlen_attention(q, k, v, cu_q, cu_k, 9, 11, is_causal=True, causal_alignment="bottom_right",
                                     window=(4, 0), softcap=2.0, sinks=sinks, return_lse=True)


def test_varlen_compiles_with_fullgraph(device):
    torch._dynamo.reset()
    gen = make_generator(4)
    lens_q, lens_k = [5, 0, 9, 3], [7, 2, 11, 3]
    q = torch.randn(sum(lens_q), 4, 16, generator=gen).to(device).requires_grad_()
    k = torch.randn(sum(lens_k), 2, 16, generator=gen).to(device).requires_grad_()
    v = torch.randn(sum(lens_k), 2, 8, generator=gen).to(device).requires_grad_()
    sinks = torch.randn(4, generator=gen).to(device).requires_grad_()
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(device, torch.int32)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(device, torch.int32)
    eager = _packed(q, k, v, cu_q, cu_k, sinks)
    got = torch.compile(_packed, fullgraph=True)(q, k, v, cu_q, cu_k, sinks)
    for a, b in zip(got, eager):
        assert rel_err(a, b) < 1e-6
    leaves = (q, k, v, sinks)
    loss = lambda out_lse: (out_lse[0] * 2).sum() + torch.nan_to_num(out_lse[1], neginf=0.0).sum()  # noqa: E731
    for a, b in zip(torch.autograd.grad(loss(got), leaves), torch.autograd.grad(loss(eager), leaves)):
        assert rel_err(a, b) < 1e-6


def test_variants_and_varlen_export_keep_the_operators_in_the_graph(device):
    class Variants(torch.nn.Module):
        def forward(self, q, k, v, bias, slopes, sinks):
            return _variants(q, k, v, bias, slopes, sinks)

    class Packed(torch.nn.Module):
        def forward(self, q, k, v, cu_q, cu_k, sinks):
            return _packed(q, k, v, cu_q, cu_k, sinks)

    gen = make_generator(5)
    q, k, v = _qkv(device, requires_grad=False)
    bias = torch.randn(33, 47, generator=gen).to(device)
    slopes = (torch.rand(2, 4, generator=gen) * 0.1).to(device)
    sinks = torch.randn(4, generator=gen).to(device)
    lens_q, lens_k = [5, 0, 9, 3], [7, 2, 11, 3]
    packed = (torch.randn(sum(lens_q), 4, 16, generator=gen).to(device),
              torch.randn(sum(lens_k), 2, 16, generator=gen).to(device),
              torch.randn(sum(lens_k), 2, 8, generator=gen).to(device),
              torch.tensor([0] + lens_q).cumsum(0).to(device, torch.int32),
              torch.tensor([0] + lens_k).cumsum(0).to(device, torch.int32), sinks)
    for module, args, op in ((Variants(), (q, k, v, bias, slopes, sinks), "attn_ext.attention_forward"),
                             (Packed(), packed, "attn_ext.varlen_forward")):
        exported = torch.export.export(module, args)
        targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
        assert any(op in t for t in targets), targets
        for a, b in zip(exported.module()(*args), module(*args)):
            assert rel_err(a, b) < 1e-6


class _Decoder(torch.nn.Module):
    """One attention layer that keeps its KVCache as an attribute (as model code often does)."""

    def __init__(self):
        super().__init__()
        self.attn = attn_ext.MultiHeadAttention(32, 4, batch_first=True, num_kv_heads=2)
        self.cache = attn_ext.KVCache()

    def forward(self, x):
        return self.attn(x, x, x, is_causal=True, need_weights=False, cache=self.cache)[0]


@pytest.mark.parametrize("held", ["argument", "attribute"])
def test_decoding_with_a_cache_compiles_a_few_times_not_once_per_step(device, held):
    # Before the cache length became a tensor size and causal_offset a SymInt, every
    # step recompiled (the length was a constant of the graph), and fullgraph=True
    # raised once the recompile limit (8) was hit. Three prompts of 40 steps each:
    # prefill, decode, and the steps that double the buffers all reuse their graphs.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Decoder().to(device).eval()
    eager_cache = attn_ext.KVCache()
    backend = CountingInductor()
    if held == "attribute":
        cache, step = model.cache, torch.compile(model, backend=backend, fullgraph=True)
    else:
        cache = attn_ext.KVCache()
        compiled = torch.compile(lambda x, c: model.attn(x, x, x, is_causal=True, need_weights=False, cache=c)[0],
                                 backend=backend, fullgraph=True)
        step = lambda x: compiled(x, cache)  # noqa: E731
    with torch.no_grad():
        for prompt in (7, 12, 5):
            cache.reset()
            eager_cache.reset()
            x = torch.randn(2, prompt, 32, device=device)
            moves, eager_moves, where, eager_where = 0, 0, None, None
            for _ in range(40):
                got = step(x)
                want = model.attn(x, x, x, is_causal=True, need_weights=False, cache=eager_cache)[0]
                assert rel_err(got, want) < 1e-5
                assert len(cache) == len(eager_cache)
                moves += cache._key.data_ptr() != where
                eager_moves += eager_cache._key.data_ptr() != eager_where
                where, eager_where = cache._key.data_ptr(), eager_cache._key.data_ptr()
                x = torch.randn(2, 1, 32, device=device)
            # appends write into the buffer in place; only a doubling moves it, as in eager
            assert moves == eager_moves <= 2 + math.log2(len(cache) / prompt), (moves, eager_moves)
    # 5 (torch 2.11 and 2.14): the prefill, the first step, the later steps, a doubling
    # step and a later prompt's prefill, each once (the first two static, then symbolic)
    assert backend.graphs <= 6, backend.graphs


def test_varlen_compiles_once_for_batches_of_changing_lengths(device):
    # max_seqlen_q / max_seqlen_k are SymInts in the schema: a new longest sequence
    # per batch makes them symbolic instead of recompiling every batch.
    torch._dynamo.reset()
    backend = CountingInductor()

    def packed(q, k, v, cu, max_len):
        return attn_ext.varlen_attention(q, k, v, cu, cu, max_len, max_len, is_causal=True)

    compiled = torch.compile(packed, backend=backend, fullgraph=True)
    gen = make_generator(6)
    for _ in range(5):
        lens = torch.randint(3, 40, (3,), generator=gen)
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(device, torch.int32)
        q, k, v = (torch.randn(int(lens.sum()), 4, 16, generator=gen).to(device) for _ in range(3))
        max_len = int(lens.max())
        assert rel_err(compiled(q, k, v, cu, max_len), packed(q, k, v, cu, max_len)) < 1e-6
    assert backend.graphs <= 2, backend.graphs  # the first batch's static graph, then one symbolic
