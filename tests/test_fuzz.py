"""Property-based tests: random calls of attn_ext.scaled_dot_product_attention, forward
and backward, against the float64 reference (attn_ext/reference.py).

Hypothesis draws every argument together: shapes (1, odd, the kernels' tile
boundaries +-1, zero-length), layouts of query, key and value (contiguous, transposed,
a sliced last dim, a batch broadcast with stride 0), dtypes, masks of every broadcast shape
(bool and additive float; bool ones with their first and last keys hidden from every
row, in spans or bands, and the same patterns as float masks of -inf and 0 or a bias), causal
alignments, windows, softcap, ALiBi, sinks, GQA, dropout and scale. Inputs are fresh random tensors from a drawn seed.

Profiles (tests/conftest.py): "ci" (the default: 1 000 cases, 13 s alone on 2 cores) and
"long" (`pytest tests/test_fuzz.py --hypothesis-profile=long --hypothesis-show-statistics`:
50 000 cases, about an hour on 2 cores: 42 329 took 46 minutes on a machine shared with
builds and tests). A failing case that hypothesis finds and
shrinks becomes an @example below, so that it is run on every run from then on.
"""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, strategies as st  # noqa: E402

from attn_ext.reference import attention_probs_reference, attention_reference  # noqa: E402

from helpers import ERR_FACTOR, attn_ext_module, grads, torch_variant_attention  # noqa: E402

# The CPU kernels tile rows and keys by 16..64 and head dims by 8/16 lanes: sizes at
# those boundaries +-1, plus 1, odd ones and (for L and S) zero.
SEQ = [0, 1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128, 129]
DIM = [1, 2, 3, 5, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 80, 96, 127, 128]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# The rule's floor here. The hand-written tests pick well-conditioned inputs and hold the
# kernels to 2 x torch's error + helpers.FLOOR; random draws also reach cancellations
# (dS = P (dP - D) with D ~ dP, a saturated softcap, one key and a sink) where two correct
# formulations differ by far more than their roundoff. What the fuzzing is for, a wrong
# index, stride, tile edge or mask broadcast, gives errors of order 1.
FUZZ_FLOOR = {torch.float64: 1e-9, torch.float32: 5e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


def _tensor(shape, dtype, layout, gen, requires_grad, device="cpu"):
    """A standard-normal (B, H, N, D) tensor in `layout`: a view of a leaf that takes
    the gradient (so the kernels see the layout, and autograd gives its gradient)."""
    B, H, N, D = shape
    born = {"transposed": (B, N, H, D), "sliced": (B, H, N, 2 * D), "expanded": (1, H, N, D)}.get(layout, shape)
    leaf = torch.randn(born, generator=gen).to(device, dtype).requires_grad_(requires_grad)
    if layout == "transposed":
        return leaf.transpose(1, 2)
    if layout == "sliced":  # every other element of a last dim twice as long
        return leaf[..., ::2]
    if layout == "expanded":  # one batch entry seen B times (stride 0)
        return leaf.expand(B, H, N, D)
    return leaf


def _cpu_isas():
    """The CPU kernel variants this build holds and this CPU runs (each case runs one)."""
    from attn_ext import _build

    info = _build.library_info()
    supported = set(info["cpu_isas_supported"].split())
    return [isa for isa in info["cpu_isas"].split() if isa in supported]


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(DTYPES))
    B, Hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Hq = Hkv * group
    L, S = draw(st.sampled_from(SEQ)), draw(st.sampled_from(SEQ))
    E, Ev = draw(st.sampled_from(DIM)), draw(st.sampled_from(DIM))
    case = dict(dtype=dtype, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, seed=draw(st.integers(0, 2**31 - 1)))
    case["isa"] = draw(st.sampled_from(_cpu_isas()))
    case["layouts"] = [draw(st.sampled_from(LAYOUTS)) for _ in range(3)]
    # a mask broadcast: each of (B, Hq, L, S) full or 1, leading ones maybe dropped
    # "neg_inf": a bool pattern as a float mask, -inf where it hides a key (which the CPU
    # kernels read as the bool mask's ranges), 0 or a bias requiring grad where it shows one
    mask_kind = draw(st.sampled_from([None, None, "bool", "float", "neg_inf"]))
    if mask_kind is not None:
        dims = [draw(st.booleans()) for _ in range(4)]
        shape = [n if full else 1 for n, full in zip((B, Hq, L, S), dims)]
        case["mask"] = (mask_kind, shape[draw(st.integers(0, 2)):])
        if mask_kind == "neg_inf":
            case["mask_bias"] = draw(st.booleans())
        pattern = mask_kind in ("bool", "neg_inf")
        if pattern and dims[3] and S > 0 and draw(st.booleans()):
            # the first and last keys hidden from every row of a batch entry (a preallocated
            # cache, its entries' sequences at different lengths, left padding): the CPU
            # kernels leave them out, per entry
            entries = B if len(case["mask"][1]) == 4 and dims[0] else 1
            case["mask_tail"] = [draw(st.integers(0, S)) for _ in range(entries)]
            case["mask_head"] = [draw(st.integers(0, S)) for _ in range(entries)]
        if pattern and dims[2] and dims[3] and S > 0 and draw(st.booleans()):
            # each row sees one span of keys (causal-like, banded, documents): the CPU kernels
            # skip the key tiles a query block's spans miss
            case["mask_spans"] = draw(st.integers(1, S))  # the widest span
        elif pattern and dims[2] and dims[3] and S > 0 and draw(st.booleans()):
            # a band as a bool mask, row i seeing keys i + shift - left .. i + shift + right (a
            # side None: unbounded): the causal pattern, a sliding window, the CPU kernels run
            # it as those flags (or the causal bound beside the rows' ranges)
            side = st.one_of(st.none(), st.integers(0, S))
            case["mask_band"] = (draw(st.integers(-L, S)), draw(side), draw(side))
    case["is_causal"] = draw(st.booleans())
    case["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.integers(0, 3)) == 0:
        side = st.one_of(st.none(), st.integers(0, max(S, 1)))
        case["window"] = (draw(side), draw(side))
    if draw(st.integers(0, 3)) == 0:
        # Scores have std ~ (scale x sqrt(E)) <= 2: a softcap of 5 bends them, 30 barely. A cap far
        # below the scores (softcap 1 at std 5) saturates tanh, where 1 - tanh^2 cancels: there
        # any two correct formulations differ by eps / (1 - tanh^2), beyond the rule's floor.
        case["softcap"] = draw(st.sampled_from([5.0, 30.0]))
    if draw(st.integers(0, 3)) == 0:
        case["alibi"] = draw(st.sampled_from(["heads", "batch_heads"]))
    case["sinks"] = draw(st.integers(0, 3)) == 0
    case["dropout_p"] = draw(st.sampled_from([0.0, 0.0, 0.0, 0.3]))
    factor = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))  # the scale, in units of 1/sqrt(E)
    case["scale"] = None if factor is None else factor / E**0.5
    return case


def _inputs(case):
    """q, k, v (views that require grad), the mask (a float one requires grad) and the
    keyword arguments (sinks require grad), on case["device"] (default: the CPU)."""
    gen = torch.Generator().manual_seed(case["seed"])
    dtype, B, Hq, Hkv, L, S = (case[k] for k in ("dtype", "B", "Hq", "Hkv", "L", "S"))
    device = case.get("device", "cpu")
    lq, lk, lv = case["layouts"]
    q = _tensor((B, Hq, L, case["E"]), dtype, lq, gen, True, device)
    k = _tensor((B, Hkv, S, case["E"]), dtype, lk, gen, True, device)
    v = _tensor((B, Hkv, S, case["Ev"]), dtype, lv, gen, True, device)
    kw = dict(is_causal=case["is_causal"], causal_alignment=case["causal_alignment"], scale=case["scale"],
              enable_gqa=Hq != Hkv, window=case.get("window"), softcap=case.get("softcap"))
    mask = None
    if "mask" in case:
        kind, shape = case["mask"]
        if kind in ("bool", "neg_inf"):
            mask = (torch.rand(shape, generator=gen) < 0.8).to(device)
            if case.get("mask_spans"):
                start = torch.randint(0, S, (*shape[:-1], 1), generator=gen)
                width = torch.randint(0, case["mask_spans"] + 1, (*shape[:-1], 1), generator=gen)
                keys = torch.arange(S)
                mask = ((keys >= start) & (keys < start + width)).to(device)
            if case.get("mask_band"):
                shift, left, right = case["mask_band"]
                pos, keys = torch.arange(L).view(L, 1) + shift, torch.arange(S).view(1, S)
                band = torch.ones(L, S, dtype=torch.bool)
                if left is not None:
                    band &= keys >= pos - left
                if right is not None:
                    band &= keys <= pos + right
                mask = band.expand(shape).clone().to(device)
            hidden = zip(case.get("mask_head", []), case.get("mask_tail", []))
            for b, (head, tail) in enumerate(hidden):  # per batch entry, or for all
                entry = b if len(case["mask_tail"]) > 1 else slice(None)
                mask[entry, ..., :head] = False
                mask[entry, ..., S - tail:] = False
            if kind == "neg_inf":
                bias = torch.randn(shape, generator=gen) if case["mask_bias"] else torch.zeros(shape)
                mask = bias.to(device).masked_fill(~mask, float("-inf")).to(dtype)
                mask.requires_grad_(case["mask_bias"])
        else:
            mask = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_(True)
    if "alibi" in case:
        shape = (Hq,) if case["alibi"] == "heads" else (B, Hq)
        kw["alibi_slopes"] = (torch.rand(shape, generator=gen) * 0.5).to(device)
    if case["sinks"]:
        kw["sinks"] = torch.randn(Hq, generator=gen).to(device, dtype).requires_grad_(True)
    return q, k, v, mask, kw


def _float64(t):
    """A float64 leaf with t's values (requiring grad if t does); None and bool pass."""
    if t is None or not t.is_floating_point():
        return t
    return t.detach().to(torch.float64).requires_grad_(t.requires_grad)


def _check(case):
    attn_ext = attn_ext_module()
    q, k, v, mask, kw = _inputs(case)
    p = case["dropout_p"]
    keep = None
    if p > 0:
        # The kernel's keep-mask, read back through value = identity under the same seed:
        # out[..., j] = P_ij / (1 - p) where kept, 0 where dropped (and where P_ij = 0).
        B, Hkv, S = case["B"], case["Hkv"], case["S"]
        eye = torch.eye(S, dtype=q.dtype, device=q.device).expand(B, Hkv, S, S)
        detached = {n: (a.detach() if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
        qd, kd, md = q.detach(), k.detach(), None if mask is None else mask.detach()
        with torch.no_grad():
            torch.manual_seed(case["seed"])
            keep = attn_ext.scaled_dot_product_attention(qd, kd, eye, md, dropout_p=p, **detached) != 0
            keep |= attention_reference(qd, kd, eye, md, **detached)[0] == 0

    torch.manual_seed(case["seed"])
    out, lse = attn_ext.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, return_lse=True, **kw)
    rq, rk, rv, rmask = (_float64(t) for t in (q, k, v, mask))
    rkw = {n: (_float64(a) if n == "sinks" else a) for n, a in kw.items()}
    full_mask = None  # a float mask as the full (B, Hq, L, S) leaf: its gradient is the scores' dS
    if rmask is not None and rmask.requires_grad:
        full_mask = rmask.detach().expand(case["B"], case["Hq"], case["L"], case["S"]).clone()
        full_mask.requires_grad_(True)
        # rmask's values, both leaves' gradients (0 through full_mask where rmask is -inf,
        # whose gradient is 0: -inf + (x - x) would be NaN there)
        ref_mask = rmask + torch.where(torch.isinf(rmask.detach()), 0.0, full_mask - full_mask.detach())
    else:
        ref_mask = rmask
    ref, ref_lse = attention_reference(rq, rk, rv, ref_mask, dropout_p=p, dropout_mask=keep, **rkw)

    # PyTorch's error at the same precision: the same math by plain torch ops in the
    # inputs' dtype (without dropout, against the reference without dropout).
    tq, tk, tv, tmask = (_leaf_copy(t) for t in (q, k, v, mask))
    tkw = {n: (_leaf_copy(a) if n == "sinks" else a) for n, a in kw.items()}
    t_out, t_lse = torch_variant_attention(tq, tk, tv, tmask, **tkw)
    plain = (ref, ref_lse) if keep is None else attention_reference(rq, rk, rv, ref_mask, **rkw)

    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any(), "NaN in out"
    dropout = keep is not None
    _assert_rule("out", out, ref, t_out, plain[0], case["dtype"], dropout=dropout)
    _assert_rule("lse", lse, ref_lse, t_lse, plain[1], case["dtype"], dropout=dropout)

    named = [("query", q, rq, tq), ("key", k, rk, tk), ("value", v, rv, tv), ("attn_mask", mask, ref_mask, tmask),
             ("sinks", kw.get("sinks"), rkw.get("sinks"), tkw.get("sinks"))]
    named = [(n, t, r, b) for n, t, r, b in named if t is not None and t.requires_grad]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(case["seed"] + 1)).to(out)
    got = grads([out], [t for _, t, _, _ in named], [grad_out])
    ref_inputs = [r if n != "attn_mask" else rmask for n, _, r, _ in named]
    want = grads([ref], ref_inputs + [full_mask], [grad_out.to(torch.float64)])
    base = grads([t_out], [b for _, _, _, b in named], [grad_out])
    plain_want = want if keep is None else grads([plain[0]], ref_inputs, [grad_out.to(torch.float64)])
    terms = _terms(case, rq, rk, rv, rmask, rkw, ref, grad_out, keep)
    for (name, t, _, _), g, w, b, pw in zip(named, got, want, base, plain_want):
        assert g.shape == t.shape, f"grad {name}: shape {tuple(g.shape)}, input {tuple(t.shape)}"
        assert not torch.isnan(g).any(), f"NaN in grad {name}"
        _assert_rule(f"grad {name}", g, w, b, pw, case["dtype"], terms.get(name), dropout)


def _terms(case, q, k, v, mask, kw, out, grad_out, keep):
    """The magnitudes of the terms each gradient sums, in float64: the errors are measured
    against them where the sum cancels. dS = P (dP - D), D = rowsum(dO * O); a correct
    kernel's roundoff scales with |P| (|dP| + rowsum(|dO| |O|)), not with |dS|, which
    cancels to ~0 when one key (or a key and the sink) takes all the weight, or when a mask
    is constant along a row (a broadcast mask's gradient sums dS over the broadcast dims).
    D itself is taken, as FlashAttention takes it, from the output as stored (rounded to
    the dtype), so its roundoff is eps rowsum(|dO| |O|) however much D cancels; the sinks'
    gradient, -sum_i p_sink,i D_i, carries it alone (found by this test: bfloat16, one row,
    one key, Ev 65, D = 1/93 of rowsum(|dO| |O|), a 2.7% error in the sink's gradient)."""
    with torch.no_grad():
        args = {n: (a.detach() if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
        probs = attention_probs_reference(q.detach(), k.detach(), None if mask is None else mask.detach(), **args)
        p_sink = 1.0 - probs.sum(-1)  # the sink's probability (0 without sinks, up to roundoff)
        if keep is not None:
            probs = probs * keep / (1.0 - case["dropout_p"])
        group = case["Hq"] // case["Hkv"]
        kx, vx = (t.detach().repeat_interleave(group, dim=1) for t in (k, v))
        d_out = grad_out.to(torch.float64)
        d_probs = d_out @ vx.transpose(-2, -1)
        delta_terms = (d_out.abs() * out.detach().abs()).sum(-1, keepdim=True)
        ds = probs.abs() * (d_probs.abs() + delta_terms)
        scale = case["scale"] if case["scale"] is not None else case["E"] ** -0.5
        return {"query": (ds @ kx.abs()).norm().item() * scale,
                "key": (ds.transpose(-2, -1) @ q.detach().abs()).norm().item() * scale,
                "attn_mask": ds.norm().item(),
                "sinks": (p_sink * delta_terms.squeeze(-1)).sum().item()}


def _leaf_copy(t):
    """A detached copy with t's dtype, values and strides, requiring grad if t does."""
    if t is None or not t.is_floating_point():
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


def _assert_rule(name, got, ref, torch_got, torch_ref, dtype, scale=None, dropout=False):
    """||got - ref|| <= ERR_FACTOR x ||torch_got - torch_ref|| + floor, both relative to
    max(||ref||, scale); -inf entries (lse of rows without keys) must coincide. (With
    dropout torch's error is measured without it, at another point; the floor covers it.)"""
    got, ref, torch_got, torch_ref = (t.detach().to(torch.float64) for t in (got, ref, torch_got, torch_ref))
    if got.numel() == 0:
        return
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: -inf where the reference has none"
    finite = ~torch.isneginf(ref)
    got, ref = got[finite], ref[finite]
    torch_got, torch_ref = torch_got[finite], torch_ref[finite]
    denom = max(ref.norm().item(), scale or 0.0) or 1.0
    err = (got - ref).norm().item() / denom
    torch_err = (torch_got - torch_ref).norm().item() / denom
    floor = FUZZ_FLOOR[dtype]
    bound = ERR_FACTOR * torch_err + floor
    assert err <= bound, f"{name}: rel err {err:.2e} > {ERR_FACTOR} x torch's {torch_err:.2e} + {floor:.0e}"


# Found by this test: with one (batch, head) pair the backward splits the keys over
# threads, and a mask broadcast over the keys took both threads' dS sums into one
# element unguarded (a lost update in ~1 call of 60).
BROADCAST_MASK_KEY_CHUNKS = {
    "dtype": torch.float64, "B": 1, "Hq": 1, "Hkv": 1, "L": 65, "S": 65, "E": 1, "Ev": 1, "seed": 0,
    "isa": "default", "layouts": ["contiguous"] * 3, "mask": ("float", [1, 1, 1, 1]), "is_causal": False,
    "causal_alignment": "top_left", "window": (0, 0), "softcap": 5.0, "sinks": True, "dropout_p": 0.0,
    "scale": None}


def test_broadcast_mask_gradient_is_the_same_every_call():
    case = dict(BROADCAST_MASK_KEY_CHUNKS, isa=_cpu_isas()[-1], seed=3)
    attn_ext = attn_ext_module()
    q, k, v, mask, kw = _inputs(case)
    grad_out = torch.randn(q.shape[:-1] + (case["Ev"],), dtype=torch.float64)
    seen = set()
    for _ in range(300):
        out = attn_ext.scaled_dot_product_attention(q, k, v, mask, **kw)
        seen.add(torch.autograd.grad(out, mask, grad_out)[0].item())
    assert len(seen) == 1, f"the mask's gradient varies between identical calls: {sorted(seen)}"


# Found by the hour-long run: the sink's gradient where D = rowsum(dO * O) cancels (see _terms).
SINK_GRAD_D_CANCELS = {
    "dtype": torch.bfloat16, "B": 1, "Hq": 1, "Hkv": 1, "L": 1, "S": 1, "E": 1, "Ev": 65, "seed": 0,
    "isa": "default", "layouts": ["sliced"] * 3, "is_causal": False, "causal_alignment": "top_left",
    "softcap": 5.0, "sinks": True, "dropout_p": 0.0, "scale": None}


@given(calls())
@example(case=BROADCAST_MASK_KEY_CHUNKS)
@example(case=SINK_GRAD_D_CANCELS)
def test_random_calls_match_reference(case):
    before = os.environ.get("ATTN_EXT_CPU_ISA")
    os.environ["ATTN_EXT_CPU_ISA"] = case["isa"]
    try:
        _check(case)
    finally:
        if before is None:
            del os.environ["ATTN_EXT_CPU_ISA"]
        else:
            os.environ["ATTN_EXT_CPU_ISA"] = before
