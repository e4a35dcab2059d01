"""attn_ext's operators under torch.compile(fullgraph=True) and torch.export."""

import torch

import attn_ext
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
