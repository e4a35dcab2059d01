"""attn_ext.varlen_attention: packed variable-length batches (FlashAttention's layout).

- forward (output and lse) and gradients (query, key, value, sinks) against the float64
  reference run sequence by sequence, by the tolerance rule (PyTorch's error: the same
  math by plain torch ops at the dtype, sequence by sequence) and by max-abs;
- equal, to rounding, to attn_ext.scaled_dot_product_attention run on each sequence;
- sequence lengths 0 and 1 and lengths spanning several tiles, L_b != S_b under both
  alignments, grouped-query heads, every variant, int32 and int64 cu_seqlens;
- gradcheck in float64, dropout against the reference given the kernel's mask;
- bad cu_seqlens / max_seqlen raise, naming the argument and the value.
"""

import pytest
import torch

from helpers import (
    assert_close_by_rule,
    assert_max_abs_by_rule,
    assert_sum_close_by_rule,
    attn_ext_module,
    error_pattern,
    grads,
    leaf64,
    low_precision_leaf,
    lse_dtype,
    make_generator,
    rel_err,
    sdpa,
    torch_variant_attention,
    varlen_attention_reference,
)

F64 = torch.float64
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
ERRORS = (RuntimeError, ValueError)


def _ids(d):
    return str(d).replace("torch.", "")


def varlen(*args, **kwargs):
    return attn_ext_module().varlen_attention(*args, **kwargs)


# (lengths of the query sequences, lengths of the key sequences)
LENS = {
    # 0 and 1, and lengths that span one, two and five 64-row query tiles (partial last)
    "tiles": ([0, 1, 17, 64, 130, 257], [0, 1, 17, 64, 130, 257]),
    # L_b > S_b, L_b < S_b, an empty key sequence with queries, empty queries with keys
    "L_ne_S": ([5, 0, 12, 1, 30, 7], [9, 4, 0, 7, 21, 7]),
}

# name -> configuration. Defaults: Hq = Hkv = 2, E = Ev = 16, lens "L_ne_S".
CASES = {
    "plain_tiles": dict(lens="tiles"),
    "causal_top_left": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "gqa_causal_tiles": dict(lens="tiles", Hq=4, Hkv=2, is_causal=True),
    "window_tiles": dict(lens="tiles", window=(20, 3)),
    "window_bottom_right": dict(window=(3, None), causal_alignment="bottom_right"),
    "softcap": dict(softcap=2.0, scale=1.0),
    "alibi_per_head": dict(alibi="H"),
    "alibi_per_sequence_bottom_right": dict(alibi="BH", is_causal=True,
                                            causal_alignment="bottom_right"),
    "sinks": dict(sinks=torch.float32),
    "everything_gqa_tiles": dict(lens="tiles", Hq=4, Hkv=2, window=(37, 5), is_causal=True,
                                 causal_alignment="bottom_right", softcap=3.0, alibi="BH",
                                 sinks=torch.float32),
}


def _slopes(H, device, B=None, seed=0):
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])
    if B is not None:
        base = base * (1 + torch.rand(B, H, generator=make_generator(seed)))
    return base.to(device=device, dtype=torch.float32)


def _case(name, dtype, device, seed=0, requires_grad=False, index_dtype=torch.int32, cfg=None):
    """(query, key, value, cu_seqlens_q, cu_seqlens_k, kwargs) for a named case."""
    cfg = CASES[name] if cfg is None else cfg
    lens_q, lens_k = cfg.get("lens_qk") or LENS[cfg.get("lens", "L_ne_S")]
    Hq = cfg.get("Hq", 2)
    Hkv = cfg.get("Hkv", Hq)
    E, Ev = cfg.get("E", 16), cfg.get("Ev", 16)
    gen = make_generator(seed)
    tq, tk = sum(lens_q), sum(lens_k)

    def draw(shape):
        t = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    q, k, v = draw((tq, Hq, E)), draw((tk, Hkv, E)), draw((tk, Hkv, Ev))
    cu_q = torch.tensor([0] + list(lens_q)).cumsum(0).to(device=device, dtype=index_dtype)
    cu_k = torch.tensor([0] + list(lens_k)).cumsum(0).to(device=device, dtype=index_dtype)
    kw = dict(is_causal=cfg.get("is_causal", False),
              causal_alignment=cfg.get("causal_alignment", "top_left"),
              window=cfg.get("window"), softcap=cfg.get("softcap"), scale=cfg.get("scale"))
    if cfg.get("alibi") == "H":
        kw["alibi_slopes"] = _slopes(Hq, device)
    elif cfg.get("alibi") == "BH":
        kw["alibi_slopes"] = _slopes(Hq, device, B=len(lens_q), seed=seed)
    if cfg.get("sinks") is not None:
        s = (torch.randn(Hq, generator=make_generator(seed + 1)) + 1.0)
        kw["sinks"] = s.to(device=device, dtype=cfg["sinks"]).requires_grad_(requires_grad)
    return q, k, v, cu_q, cu_k, kw


def _sequences(cu_q, cu_k):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [(bq[b], bq[b + 1], bk[b], bk[b + 1]) for b in range(len(bq) - 1)]


def _per_sequence(fn, q, k, v, cu_q, cu_k, kw):
    """Run ``fn(q_b, k_b, v_b, **kw_b)`` -> (out, lse) on each sequence as a
    (1, H, L_b, E) batch and pack the results back to (total_q, Hq, ...)."""
    slopes = kw.get("alibi_slopes")
    outs, lses = [], []
    for b, (q0, q1, k0, k1) in enumerate(_sequences(cu_q, cu_k)):
        kw_b = dict(kw, enable_gqa=q.size(1) != k.size(1))
        if slopes is not None and slopes.dim() == 2:
            kw_b["alibi_slopes"] = slopes[b]
        out, lse = fn(q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
                      v[k0:k1].transpose(0, 1)[None], **kw_b)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def _torch_varlen(q, k, v, cu_q, cu_k, kw):
    """PyTorch's error baseline: plain torch ops at the dtype, sequence by sequence."""
    return _per_sequence(torch_variant_attention, q, k, v, cu_q, cu_k, kw)


def _attn_ext_per_sequence(q, k, v, cu_q, cu_k, kw):
    return _per_sequence(lambda *a, **k_: sdpa(*a, return_lse=True, **k_), q, k, v, cu_q, cu_k, kw)


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_forward_matches_reference(device, case, dtype):
    q, k, v, cu_q, cu_k, kw = _case(case, dtype, device, seed=len(case))
    out, lse = varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    ref, ref_lse = varlen_attention_reference(q, k, v, cu_q, cu_k, **kw)
    with torch.no_grad():
        base, base_lse = _torch_varlen(q, k, v, cu_q, cu_k, kw)
    assert out.shape == ref.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == ref_lse.shape and lse.dtype == lse_dtype(dtype)
    assert_close_by_rule("out", out, ref, base, dtype)
    assert_max_abs_by_rule("out", out, ref, base, dtype)
    assert_close_by_rule("lse", lse, ref_lse, base_lse, lse_dtype(dtype))
    assert_max_abs_by_rule("lse", lse, ref_lse, base_lse, lse_dtype(dtype))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    # rows of a query sequence whose key sequence is empty
    for q0, q1, k0, k1 in _sequences(cu_q, cu_k):
        if k0 == k1:
            assert (out[q0:q1] == 0).all()
            if "sinks" in kw:
                torch.testing.assert_close(lse[q0:q1], kw["sinks"].detach().to(lse.dtype).expand(q1 - q0, -1))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", ["causal_bottom_right", "everything_gqa_tiles"])
def test_varlen_takes_int32_and_int64_cu_seqlens(device, case, index_dtype):
    q, k, v, cu_q, cu_k, kw = _case(case, torch.float32, device, seed=1, index_dtype=index_dtype)
    out, lse = varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    ref, ref_lse = varlen_attention_reference(q, k, v, cu_q, cu_k, **kw)
    with torch.no_grad():
        base, base_lse = _torch_varlen(q, k, v, cu_q, cu_k, kw)
    assert_close_by_rule("out", out, ref, base, torch.float32)
    assert_close_by_rule("lse", lse, ref_lse, base_lse, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=_ids)
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_equals_sdpa_on_each_sequence(device, case, dtype):
    q, k, v, cu_q, cu_k, kw = _case(case, dtype, device, seed=2)
    out, lse = varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    e_out, e_lse = _attn_ext_per_sequence(q, k, v, cu_q, cu_k, kw)
    tol = 1e-12 if dtype == F64 else 1e-5
    assert rel_err(out, e_out) < tol
    assert rel_err(lse, e_lse) < tol
    torch.testing.assert_close(out, e_out, rtol=tol, atol=tol)


def test_varlen_max_seqlen_given_or_larger_changes_nothing(device):
    q, k, v, cu_q, cu_k, kw = _case("everything_gqa_tiles", torch.float32, device, seed=3)
    a = varlen(q, k, v, cu_q, cu_k, **kw)
    b = varlen(q, k, v, cu_q, cu_k, 257, 257, **kw)
    c = varlen(q, k, v, cu_q, cu_k, 300, 400, **kw)
    assert torch.equal(a, b)
    assert rel_err(c, a) < 1e-6


def test_varlen_sequences_do_not_see_each_other(device):
    q, k, v, cu_q, cu_k, kw = _case("gqa_causal_tiles", torch.float32, device, seed=4)
    out = varlen(q, k, v, cu_q, cu_k, **kw)
    k2, v2 = k.clone(), v.clone()
    k0, k1 = cu_k[3].item(), cu_k[4].item()  # the 64-key sequence
    k2[k0:k1] += 1.0
    v2[k0:k1] -= 2.0
    out2 = varlen(q, k2, v2, cu_q, cu_k, **kw)
    q0, q1 = cu_q[3].item(), cu_q[4].item()
    assert torch.equal(out2[:q0], out[:q0]) and torch.equal(out2[q1:], out[q1:])
    assert not torch.equal(out2[q0:q1], out[q0:q1])


def test_varlen_non_contiguous_inputs(device):
    # (H, total, E)-born tensors seen as (total, H, E), and a strided value
    q, k, v, cu_q, cu_k, kw = _case("everything_gqa_tiles", torch.float32, device, seed=5)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    kt = k.transpose(0, 1).contiguous().transpose(0, 1)
    vt = torch.cat([v, v], dim=-1)[..., ::2]
    assert not qt.is_contiguous() and not vt.is_contiguous()
    vt.copy_(v)
    a = varlen(qt, kt, vt, cu_q, cu_k, **kw)
    ref, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, **kw)
    with torch.no_grad():
        base, _ = _torch_varlen(q, k, v, cu_q, cu_k, kw)
    assert_close_by_rule("out", a, ref, base, torch.float32)


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=_ids)
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_grads_match_reference(device, case, dtype):
    q, k, v, cu_q, cu_k, kw = _case(case, dtype, device, seed=len(case), requires_grad=True)
    sinks = kw.get("sinks")
    inputs = [q, k, v, sinks]
    gen = make_generator(6)
    g = torch.randn(q.shape[:-1] + (v.size(-1),), generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(q.shape[:-1], generator=gen).to(device=device, dtype=lse_dtype(dtype))

    def loss_of(out, lse, acc):
        finite = torch.isfinite(lse.detach())
        return ((out.to(acc) * g.to(acc)).sum()
                + torch.where(finite, lse * w.to(lse.dtype), torch.zeros_like(lse)).sum())

    out, lse = varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    got = grads(loss_of(out, lse, lse_dtype(dtype)), inputs, None)
    r = [leaf64(t) for t in inputs]
    r_out, r_lse = varlen_attention_reference(r[0], r[1], r[2], cu_q, cu_k, **dict(kw, sinks=r[3]))
    expected = grads(loss_of(r_out, r_lse, F64), r, None)
    t = [low_precision_leaf(x) for x in inputs]
    t_out, t_lse = _torch_varlen(t[0], t[1], t[2], cu_q, cu_k, dict(kw, sinks=t[3]))
    baseline = grads(loss_of(t_out, t_lse, lse_dtype(dtype)), t, None)
    for name, x, a, e, b in zip(["grad query", "grad key", "grad value", "grad sinks"],
                                inputs, got, expected, baseline):
        if x is None:
            continue
        assert a.shape == x.shape and a.dtype == x.dtype, name
        if name == "grad sinks":
            # d loss / d sink_h = sum over rows of p_sink * (w - g . out)
            with torch.no_grad():
                p_sink = torch.exp(r[3] - r_lse)
                terms = p_sink * (w.to(F64) - (g.to(F64) * r_out).sum(-1))
            assert_sum_close_by_rule(name, a, e, b, dtype, terms.abs().sum(0))
            continue
        assert_close_by_rule(name, a, e, b, dtype)
        assert_max_abs_by_rule(name, a, e, b, dtype)


def test_varlen_grads_equal_sdpa_on_each_sequence(device):
    q, k, v, cu_q, cu_k, kw = _case("everything_gqa_tiles", F64, device, seed=7, requires_grad=True)
    inputs = [q, k, v, kw["sinks"]]
    g = torch.randn(q.shape[:-1] + (v.size(-1),), generator=make_generator(8), dtype=F64).to(device)
    out = varlen(q, k, v, cu_q, cu_k, **kw)
    e_out, _ = _attn_ext_per_sequence(q, k, v, cu_q, cu_k, kw)
    for name, a, b in zip(["query", "key", "value", "sinks"], torch.autograd.grad(out, inputs, g),
                          torch.autograd.grad(e_out, inputs, g)):
        # the sinks' gradient comes in their own dtype (float32 here): summed in another order per call
        assert rel_err(a, b) < (1e-12 if a.dtype == F64 else 1e-6), name


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("variant", [dict(is_causal=True), dict(window=(50, 7)),
                                     dict(is_causal=True, causal_alignment="bottom_right")],
                         ids=["causal", "window", "causal_bottom_right"])
def test_varlen_uneven_lengths_shared_out_over_threads(device, variant, threads):
    """One long sequence among short and empty ones: the CPU kernels share a packed batch's
    tasks out by cost, one contiguous share per thread, so a share may end inside a sequence
    (between its heads or query blocks); every thread count gives the reference's result."""
    cfg = dict(lens_qk=([3, 700, 0, 130, 1, 64, 257], [5, 690, 4, 130, 1, 64, 257]), Hq=4, Hkv=2, **variant)
    q, k, v, cu_q, cu_k, kw = _case("uneven", F64, device, seed=5, requires_grad=True, cfg=cfg)
    g = torch.randn(q.shape[:-1] + (v.size(-1),), generator=make_generator(9), dtype=F64).to(device)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = varlen(q, k, v, cu_q, cu_k, **kw)
        got = torch.autograd.grad(out, (q, k, v), g)
    finally:
        torch.set_num_threads(before)
    r = [leaf64(t) for t in (q, k, v)]
    r_out, _ = varlen_attention_reference(r[0], r[1], r[2], cu_q, cu_k, **kw)
    assert rel_err(out, r_out) < 1e-11
    for name, a, e in zip(["query", "key", "value"], got, torch.autograd.grad(r_out, r, g)):
        assert rel_err(a, e) < 1e-11, name


# Tiny float64 problems: lengths 0 to 3, an empty key sequence, L_b != S_b.
GRADCHECK_CASES = {
    "plain": dict(),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "gqa_window_softcap_alibi_sinks": dict(window=(1, 0), softcap=1.5, alibi="BH", sinks=F64,
                                           causal_alignment="bottom_right"),
}


def _gradcheck_case(name, device):
    cfg = dict(dict(lens_qk=([2, 0, 3, 2], [3, 2, 0, 2]), Hq=2, Hkv=1, E=3, Ev=2),
               **GRADCHECK_CASES[name])
    return _case(name, F64, device, seed=9, requires_grad=True, cfg=cfg)


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_varlen_gradcheck(device, case):
    q, k, v, cu_q, cu_k, kw = _gradcheck_case(case, device)
    sinks = kw.pop("sinks", None)

    def fn(q, k, v, *s):
        out, lse = varlen(q, k, v, cu_q, cu_k, return_lse=True, **dict(kw, sinks=s[0] if s else None))
        # without sinks the rows of the empty key sequence have lse -inf: check the output
        return (out, lse) if s else out

    inputs = (q, k, v) + ((sinks,) if sinks is not None else ())
    assert torch.autograd.gradcheck(fn, inputs)


def test_varlen_gradcheck_with_dropout(device):
    q, k, v, cu_q, cu_k, kw = _gradcheck_case("gqa_window_softcap_alibi_sinks", device)
    sinks = kw.pop("sinks")

    def fn(q, k, v, s, p=0.3):
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        return varlen(q, k, v, cu_q, cu_k, dropout_p=p, sinks=s, **kw)

    assert not torch.equal(fn(q, k, v, sinks), fn(q, k, v, sinks, p=0.0)), "dropout dropped nothing"
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_varlen_dropout_matches_reference_given_the_recovered_mask(device):
    # value = identity over all total_k keys: output column j of row i is
    # P_ij * keep_ij / (1 - p) within row i's sequence, so it gives the kernel's mask.
    q, k, _, cu_q, cu_k, kw = _case("everything_gqa_tiles", F64, device, seed=10,
                                    cfg=dict(CASES["everything_gqa_tiles"], lens="L_ne_S"))
    total_k, p = k.size(0), 0.4
    v = torch.eye(total_k, dtype=F64, device=device)[:, None, :].expand(total_k, k.size(1), total_k)
    v = v.contiguous()
    torch.manual_seed(11)
    out = varlen(q, k, v, cu_q, cu_k, dropout_p=p, **kw)
    probs, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, **kw)  # = P, per block
    keep = (out != 0) | (probs == 0)
    dropped = ((~keep).sum() / (probs > 0).sum()).item()
    assert 0.3 < dropped < 0.5
    ref, _ = varlen_attention_reference(q, k, v, cu_q, cu_k, dropout_p=p, dropout_mask=keep, **kw)
    assert rel_err(out, ref) < 1e-11
    torch.manual_seed(11)
    assert torch.equal(varlen(q, k, v, cu_q, cu_k, dropout_p=p, **kw), out)


# --------------------------------------------------------------------------- bad input


def _small(device, lens_q=(3, 2), lens_k=(4, 1), Hq=2, Hkv=2):
    cfg = dict(lens_qk=(list(lens_q), list(lens_k)), Hq=Hq, Hkv=Hkv, E=8, Ev=8)
    q, k, v, cu_q, cu_k, _ = _case("x", torch.float32, device, cfg=cfg)
    return q, k, v, cu_q, cu_k


def _cu(values, device, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=device)


# name -> (call kwargs over the 5-row query / 5-row key problem, argument name, values)
BAD = {
    "cu_q_not_from_zero": (lambda d: dict(cu_seqlens_q=_cu([1, 3, 5], d)), "cu_seqlens_q",
                           ("[1, 3, 5]", "1")),
    "cu_q_decreasing": (lambda d: dict(cu_seqlens_q=_cu([0, 4, 3], d)), "cu_seqlens_q",
                        ("[0, 4, 3]", "3")),
    "cu_q_not_to_total": (lambda d: dict(cu_seqlens_q=_cu([0, 3, 4], d)), "cu_seqlens_q",
                          ("[0, 3, 4]", "4")),
    "cu_k_not_to_total": (lambda d: dict(cu_seqlens_k=_cu([0, 4, 6], d)), "cu_seqlens_k",
                          ("[0, 4, 6]", "6")),
    "cu_k_float": (lambda d: dict(cu_seqlens_k=torch.tensor([0.0, 4.0, 5.0], device=d)),
                   "cu_seqlens_k", ("torch.float32", "float32", "float")),
    "cu_q_int16": (lambda d: dict(cu_seqlens_q=_cu([0, 3, 5], d, torch.int16)), "cu_seqlens_q",
                   ("torch.int16", "int16", "short")),
    "cu_q_2d": (lambda d: dict(cu_seqlens_q=_cu([[0, 3, 5]], d)), "cu_seqlens_q", ("(1, 3)",)),
    "cu_lengths_differ": (lambda d: dict(cu_seqlens_k=_cu([0, 1, 4, 5], d)),
                          "cu_seqlens", ("3", "4")),
    "max_seqlen_q_too_small": (lambda d: dict(max_seqlen_q=2), "max_seqlen_q", ("2",)),
    "max_seqlen_k_too_small": (lambda d: dict(max_seqlen_k=3), "max_seqlen_k", ("3",)),
    "alibi_wrong_batch": (lambda d: dict(alibi_slopes=torch.ones(3, 2, device=d)), "alibi_slopes",
                          ("(3, 2)",)),
    "window_negative": (lambda d: dict(window=(2, -1)), "window", ("(2, -1)", "-1")),
    "softcap_negative": (lambda d: dict(softcap=-1.0), "softcap", ("-1.0",)),
    "sinks_wrong_heads": (lambda d: dict(sinks=torch.ones(3, device=d)), "sinks", ("(3,)",)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_varlen_bad_input_raises_naming_the_argument(device, case):
    make, name, values = BAD[case]
    q, k, v, cu_q, cu_k = _small(device)
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, **make(device)}
    cu = (args.pop("cu_seqlens_q"), args.pop("cu_seqlens_k"))
    with pytest.raises(ERRORS, match=error_pattern(name, *values)):
        varlen(q, k, v, *cu, **args)


def test_varlen_query_must_be_3d(device):
    q, k, v, cu_q, cu_k = _small(device)
    with pytest.raises(ERRORS, match=error_pattern("query", "(1, 5, 2, 8)")):
        varlen(q[None], k, v, cu_q, cu_k)


def test_varlen_heads_must_divide(device):
    q, k, v, cu_q, cu_k = _small(device, Hq=3, Hkv=2)
    with pytest.raises(ERRORS, match=error_pattern("head", "(5, 3, 8)", "3")):
        varlen(q, k, v, cu_q, cu_k)
