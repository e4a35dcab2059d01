"""The Python path of a call: the common call's short normalisation (ops._plain_op_args)
and the skipped autograd layer when nothing needs a gradient (ops._run) must give
exactly what the general path gives."""

import pytest
import torch

import attn_ext
from attn_ext import ops
from helpers import make_generator


def _qkv(device, B=2, Hq=4, Hkv=2, L=5, S=9, E=16, requires_grad=False, dtype=torch.float32):
    gen = make_generator(3)
    q, k, v = (torch.randn(B, h, n, E, generator=gen).to(device=device, dtype=dtype)
               for h, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


# Calls the short path takes (4-D, one batch size, no variant), with what varies among them.
PLAIN_CALLS = {
    "gqa": dict(enable_gqa=True),
    "gqa_causal_bottom_right": dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right"),
    "bool_mask_scale": dict(enable_gqa=True, attn_mask="bool", scale=0.3),
    "float_mask_2d": dict(enable_gqa=True, attn_mask="float2d"),
    "dropout": dict(enable_gqa=True, dropout_p=0.25),
}


def _kwargs(name, device, L=5, S=9):
    kw = dict(PLAIN_CALLS[name])
    gen = make_generator(5)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = (torch.rand(2, 1, L, S, generator=gen) > 0.3).to(device)
    elif kw.get("attn_mask") == "float2d":
        kw["attn_mask"] = torch.randn(L, S, generator=gen).to(device)
    return kw


@pytest.mark.parametrize("name", list(PLAIN_CALLS))
def test_plain_calls_normalise_as_the_general_path(device, name, monkeypatch):
    q, k, v = _qkv(device)
    kw = _kwargs(name, device)
    args = (kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw.get("is_causal", False), kw.get("scale"),
            kw.get("enable_gqa", False), kw.get("causal_alignment", "top_left"))
    fast = ops._Call(q, k, v, *args)
    assert ops._Call._plain(object.__new__(ops._Call), q, k, v, *args, None, None, None, None)
    torch.manual_seed(0)
    out_fast = attn_ext.scaled_dot_product_attention(q, k, v, **kw)
    monkeypatch.setattr(ops, "_plain_op_args", lambda *a: None)  # every call through _Call's general path
    slow = ops._Call(q, k, v, *args)
    torch.manual_seed(0)
    out_slow = attn_ext.scaled_dot_product_attention(q, k, v, **kw)
    for field in ("has_head_dim", "scale", "causal_offset", "dropout_p", "is_causal", "variants"):
        assert getattr(fast, field) == getattr(slow, field), field
    assert tuple(fast.query_shape) == tuple(slow.query_shape)
    for field in ("q", "k", "v"):
        assert getattr(fast, field) is getattr(slow, field) or torch.equal(getattr(fast, field), getattr(slow, field))
    assert (fast.mask is None) == (slow.mask is None)
    if fast.mask is not None:
        assert torch.equal(fast.mask, slow.mask)
    assert (fast.dropout_seed is None) == (slow.dropout_seed is None)
    assert torch.equal(out_fast, out_slow)


def test_the_general_path_keeps_its_errors_for_plain_looking_calls(device):
    q, k, v = _qkv(device)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        attn_ext.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="causal_alignment must be one of"):
        attn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True, causal_alignment="middle")
    with pytest.raises(ValueError, match="same batch dims"):
        attn_ext.scaled_dot_product_attention(q, k[:1], v[:1], enable_gqa=True)


class _CountingBelowAutograd:
    """Stands in for ops._below_autograd and counts the calls that took it."""

    entered = 0

    def __init__(self):
        self.guard = torch._C._AutoDispatchBelowAutograd()

    def __enter__(self):
        type(self).entered += 1
        return self.guard.__enter__()

    def __exit__(self, *exc):
        return self.guard.__exit__(*exc)


@pytest.mark.parametrize("mode", ["no_grad", "inputs_without_grad", "inference_mode"])
def test_calls_without_gradients_skip_autograd_and_give_the_same_result(device, mode, monkeypatch):
    monkeypatch.setattr(_CountingBelowAutograd, "entered", 0)
    monkeypatch.setattr(ops, "_below_autograd", _CountingBelowAutograd)
    q, k, v = _qkv(device)
    op = torch.ops.attn_ext.attention_forward
    call = ops._Call(q, k, v, None, 0.0, True, None, True, "top_left")
    expected, expected_lse = op(call.q, call.k, call.v, *call.op_args())  # through the autograd kernel
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "inputs_without_grad": torch.enable_grad}[mode]
    with context():
        out, lse = attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    assert out.grad_fn is None and not out.requires_grad
    assert _CountingBelowAutograd.entered == 1  # the op ran below autograd, from ops._run


def test_calls_with_gradients_keep_autograd(device, monkeypatch):
    monkeypatch.setattr(_CountingBelowAutograd, "entered", 0)
    monkeypatch.setattr(ops, "_below_autograd", _CountingBelowAutograd)
    q, k, v = _qkv(device, requires_grad=True, dtype=torch.float64)
    out = attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.grad_fn is not None
    out.sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (q, k, v))
    # a float mask or sinks that need a gradient also keep it, with inputs that do not
    q, k, v = _qkv(device, dtype=torch.float64)
    mask = torch.zeros(5, 9, dtype=torch.float64, device=device, requires_grad=True)
    sinks = torch.zeros(4, dtype=torch.float64, device=device, requires_grad=True)
    out = attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out.sum().backward()
    assert mask.grad is not None
    out = attn_ext.scaled_dot_product_attention(q, k, v, sinks=sinks, enable_gqa=True)
    (out * out).sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0
    assert _CountingBelowAutograd.entered == 0  # every call went through the autograd kernel


def test_compiled_call_without_gradients(device):
    q, k, v = _qkv(device)
    fn = torch.compile(lambda q, k, v: attn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                       fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(fn(q, k, v), attn_ext.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                   rtol=0, atol=0)


class _CountingCallBoxed:
    """Stands in for ops._call_boxed and counts the calls that took it."""

    calls = 0

    def __call__(self, handle, *args):
        type(self).calls += 1
        return torch._C._dispatch_call_boxed(handle, *args)


class _SeenOps:
    """The attn_ext operators a mode saw, by name."""

    def __init__(self):
        self.names = []

    def note(self, func):
        name = str(func)
        if name.startswith("attn_ext."):
            self.names.append(name)

    def run(self, func, args, kwargs):
        """What a mode's handler does: note the op, then run it."""
        self.note(func)
        return func(*args, **(kwargs or {}))


class _FunctionModeSpy(torch.overrides.TorchFunctionMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.seen.run(func, args, kwargs)


class _DispatchModeSpy(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.seen.run(func, args, kwargs)


class _FunctionSubclass(torch.Tensor):
    """A tensor subclass whose __torch_function__ records the attn_ext ops it is passed to."""

    seen = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.note(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _expected(q, k, v):
    call = ops._Call(q, k, v, None, 0.0, True, None, True, "top_left")
    with torch.no_grad():
        return torch.ops.attn_ext.attention_forward(call.q, call.k, call.v, *call.op_args())[0]


def _call(q, k, v):
    with torch.no_grad():
        return attn_ext.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_plain_calls_go_straight_to_the_dispatcher(device, monkeypatch):
    monkeypatch.setattr(_CountingCallBoxed, "calls", 0)
    monkeypatch.setattr(ops, "_call_boxed", _CountingCallBoxed())
    q, k, v = _qkv(device)
    assert torch.equal(_call(q, k, v), _expected(q, k, v))
    probs = attn_ext.attention_probs(q, k, enable_gqa=True)
    out, probs_too = ops.attention_and_probs(q, k, v, enable_gqa=True)
    assert torch.equal(probs, probs_too) and torch.allclose(probs @ v.repeat_interleave(2, 1), out, atol=1e-6)
    assert _CountingCallBoxed.calls == 4  # the plain call, attention_probs, and attention_and_probs' two ops


def test_modes_and_subclasses_still_see_the_op(device, monkeypatch):
    """The direct dispatcher call skips only the overload's own __torch_function__
    check: a torch-function mode or a subclass with __torch_function__ takes
    op(*args) and sees the op; a dispatch mode sees it either way."""
    monkeypatch.setattr(_CountingCallBoxed, "calls", 0)
    monkeypatch.setattr(ops, "_call_boxed", _CountingCallBoxed())
    q, k, v = _qkv(device)
    expected = _expected(q, k, v)

    seen = _SeenOps()
    with _FunctionModeSpy(seen):
        out = _call(q, k, v)
    assert torch.equal(out, expected) and seen.names == ["attn_ext.attention_forward.default"]
    assert _CountingCallBoxed.calls == 0

    seen = _SeenOps()
    with _DispatchModeSpy(seen):
        out = _call(q, k, v)
    assert torch.equal(out, expected) and seen.names == ["attn_ext.attention_forward.default"]
    assert _CountingCallBoxed.calls == 1

    seen = _SeenOps()
    monkeypatch.setattr(_FunctionSubclass, "seen", seen)
    out = _call(q.as_subclass(_FunctionSubclass), k, v)
    assert torch.equal(out.as_subclass(torch.Tensor), expected)
    assert seen.names == ["attn_ext.attention_forward.default"] and _CountingCallBoxed.calls == 1
