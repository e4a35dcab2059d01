"""Attention variants (window, softcap, ALiBi, sinks) in attn_ext.scaled_dot_product_attention
and attn_ext.attention_probs, alone and together, against the float64 reference.

- forward (output and lse) and gradients (query, key, value, float mask, sinks) at every
  dtype by the tolerance rule: attn_ext's error <= ERR_FACTOR x PyTorch's error + FLOOR,
  both against the float64 reference. PyTorch's SDPA cannot express a softcap or sinks,
  so its error is that of the same math by plain torch ops at the dtype
  (helpers.torch_variant_attention). A max-abs check stands beside the Frobenius one;
- shapes spanning several query and key tiles, where tiles wholly outside the window
  are skipped;
- rows that see no key: 0, lse -inf, or lse = sink with sinks;
- gradcheck in float64 for every differentiable path, with dropout too;
- dropout: attention_probs(...) @ value equals the fused output under the same seed;
- bad variant values raise, naming the argument and the value.
"""

import pytest
import torch

from helpers import (
    assert_close_by_rule,
    assert_grad_like,
    assert_max_abs_by_rule,
    assert_sum_close_by_rule,
    attention_probs_reference,
    attention_reference,
    attn_ext_module,
    error_pattern,
    grads,
    leaf64,
    low_precision_leaf,
    lse_dtype,
    make_generator,
    make_mask,
    make_qkv,
    per_head_view,
    randn,
    rel_err,
    sdpa,
    torch_variant_attention,
    torch_variant_probs,
)

F64 = torch.float64
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LOW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ids(d):
    return str(d).replace("torch.", "")


def _slopes(H, device, batch=None, seed=0):
    """float32 ALiBi slopes: the usual 2^(-8h/H), perturbed per batch entry when
    ``batch`` (a shape) is given."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])
    if batch is not None:
        base = base * (1 + torch.rand(tuple(batch) + (H,), generator=make_generator(seed)))
    return base.to(device=device, dtype=torch.float32)


def _sinks(H, dtype, device, seed=0, requires_grad=False):
    """Sinks around 1: p_sink of a few percent over ~40 keys, enough to matter."""
    s = (torch.randn(H, generator=make_generator(seed + 1000)) + 1.0).to(device=device, dtype=dtype)
    return s.requires_grad_(requires_grad)


# name -> configuration. Defaults: B=2, Hq=Hkv=2, L=S=37, E=Ev=16, no variant.
CASES = {
    "window_symmetric": dict(window=(4, 4)),
    "window_left_only": dict(window=(5, None)),
    "window_right_only": dict(window=(None, 3)),
    "window_causal": dict(window=(6, None), is_causal=True),
    "window_causal_right_clipped": dict(window=(3, 4), is_causal=True),
    "window_bottom_right_L_lt_S": dict(L=19, S=45, window=(7, 2), causal_alignment="bottom_right"),
    # rows i < L - S see no key: output 0, lse -inf
    "window_causal_bottom_right_L_gt_S": dict(L=45, S=19, window=(5, None), is_causal=True,
                                              causal_alignment="bottom_right"),
    "softcap": dict(softcap=2.0, scale=1.0),  # scores of std ~4: the cap bites
    "softcap_causal_bottom_right": dict(L=19, S=45, softcap=5.0, is_causal=True,
                                        causal_alignment="bottom_right"),
    "alibi": dict(alibi="H"),
    "alibi_per_batch_bottom_right": dict(L=19, S=45, alibi="NH", causal_alignment="bottom_right"),
    "alibi_causal": dict(alibi="H", is_causal=True),
    "sinks": dict(sinks=torch.float32),
    "sinks_in_query_dtype": dict(sinks="query"),
    # one row of batch 0 has no key: output 0, lse = sink
    "sinks_bool_mask_dead_row": dict(sinks=torch.float32, mask="bool_dead_row"),
    "everything_gqa": dict(Hq=4, Hkv=2, L=29, S=53, window=(11, 4), is_causal=True,
                           causal_alignment="bottom_right", softcap=3.0, alibi="NH",
                           sinks=torch.float32, mask="float"),
    "three_d": dict(three_d=True, L=29, S=29, window=(5, 5), softcap=2.0, alibi="N1",
                    sinks=torch.float32),
    "three_d_scalar_slopes": dict(three_d=True, L=23, S=31, alibi="H", is_causal=True,
                                  sinks=torch.float32),
    "non_contiguous": dict(layout="transposed", window=(7, 3), softcap=4.0, alibi="H",
                           sinks=torch.float32),
    "odd_sizes": dict(L=33, S=71, E=24, Ev=8, window=(10, 10), alibi="H", mask="float"),
}


def _case(name, dtype, device, seed=0, requires_grad=False, cfg=None):
    """(query, key, value, attn_mask, kwargs) for a named case; with ``requires_grad``
    q, k, v, a float mask and the sinks require grad."""
    cfg = CASES[name] if cfg is None else cfg
    B, L, S = cfg.get("B", 2), cfg.get("L", 37), cfg.get("S", 37)
    Hq = cfg.get("Hq", 2)
    Hkv = cfg.get("Hkv", Hq)
    E, Ev = cfg.get("E", 16), cfg.get("Ev", 16)
    three_d = cfg.get("three_d", False)
    if three_d:
        gen = make_generator(seed)
        q = randn((B, L, E), dtype, device, gen, requires_grad=requires_grad)
        k = randn((B, S, E), dtype, device, gen, requires_grad=requires_grad)
        v = randn((B, S, Ev), dtype, device, gen, requires_grad=requires_grad)
        H = 1
    else:
        q, k, v = make_qkv(B, Hq, Hkv, L, S, E, Ev, dtype, device, seed=seed,
                           layout=cfg.get("layout", "contiguous"), requires_grad=requires_grad)
        H = Hq
    kw = dict(is_causal=cfg.get("is_causal", False),
              causal_alignment=cfg.get("causal_alignment", "top_left"),
              window=cfg.get("window"), softcap=cfg.get("softcap"), scale=cfg.get("scale"))
    if Hq != Hkv:
        kw["enable_gqa"] = True
    alibi = cfg.get("alibi")
    if alibi == "H":
        kw["alibi_slopes"] = _slopes(H, device)
    elif alibi in ("NH", "N1"):
        kw["alibi_slopes"] = _slopes(H, device, batch=(B,), seed=seed)
    sinks = cfg.get("sinks")
    if sinks is not None:
        kw["sinks"] = _sinks(H, dtype if sinks == "query" else sinks, device, seed, requires_grad)
    mask = None
    lead = (B,) if three_d else (B, 1)
    if cfg.get("mask") == "float":
        shape = (L, S) if three_d else (1, H, L, S)
        mask = make_mask("float", shape, dtype, device, seed=seed + 1, requires_grad=requires_grad)
    elif cfg.get("mask") == "bool_dead_row":
        mask = make_mask("bool", lead + (L, S), dtype, device, seed=seed + 1, keep_prob=0.8)
        mask[0, ..., 3, :] = False
    return q, k, v, mask, kw


def _no_key_rows(q, k, mask, kw):
    """Rows of the reference with no visible key (bool, shaped like the lse)."""
    probs = attention_probs_reference(q, k, attn_mask=mask, **dict(kw, sinks=None))
    return probs.sum(-1) == 0


def check_forward(q, k, v, mask, kw):
    """Output and lse of attn_ext vs the float64 reference, by the rule and by max-abs;
    rows without keys are exactly 0, their lse -inf (the sink with sinks)."""
    dtype = q.dtype
    out, lse = sdpa(q, k, v, mask, return_lse=True, **kw)
    ref, ref_lse = attention_reference(q, k, v, attn_mask=mask, **kw)
    with torch.no_grad():
        base, base_lse = torch_variant_attention(q, k, v, mask, **kw)
    assert out.shape == ref.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == q.shape[:-1], f"lse shape {tuple(lse.shape)} != {tuple(q.shape[:-1])}"
    assert lse.dtype == lse_dtype(dtype)
    assert_close_by_rule("out", out, ref, base, dtype)
    assert_max_abs_by_rule("out", out, ref, base, dtype)
    assert_close_by_rule("lse", lse, ref_lse, base_lse, lse_dtype(dtype))
    assert_max_abs_by_rule("lse", lse, ref_lse, base_lse, lse_dtype(dtype))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse -inf on the wrong rows"
    dead = _no_key_rows(q, k, mask, kw)
    assert (out[dead] == 0).all(), "rows without any visible key must be exactly 0"
    sinks = kw.get("sinks")
    if sinks is not None and dead.any():
        sink = per_head_view(sinks.detach().to(lse.dtype), q).squeeze(-1).expand_as(lse)
        torch.testing.assert_close(lse[dead], sink[dead])
    return out, lse


def _per_head_abs_sum(terms, q):
    """Sum of |terms| (shaped like the lse) per head: (H,), or (1,) for 3-D inputs."""
    if q.dim() == 3:
        return terms.abs().sum().reshape(1)
    return terms.abs().transpose(0, -2).reshape(terms.size(-2), -1).sum(1)


def check_backward(q, k, v, mask, kw, seed=0, lse_weight=False):
    """Gradients of sum(out * g) (+ sum(lse * w) over finite lse) for q, k, v, a float
    mask and sinks, vs float64 reference autograd, by the rule against the plain-torch
    baseline's gradients at the same dtype, and by max-abs."""
    dtype = q.dtype
    sinks = kw.get("sinks")
    inputs = [q, k, v, mask, sinks]
    gen = make_generator(seed + 12345)
    out_shape = q.shape[:-1] + (v.size(-1),)
    g = torch.randn(out_shape, generator=gen).to(device=q.device, dtype=dtype)
    w = torch.randn(q.shape[:-1], generator=gen).to(device=q.device, dtype=lse_dtype(dtype))

    def loss_of(out, lse, acc):
        loss = (out.to(acc) * g.to(acc)).sum()
        if lse_weight:
            finite = torch.isfinite(lse.detach())
            loss = loss + torch.where(finite, lse * w.to(lse.dtype), torch.zeros_like(lse)).sum()
        return loss

    out, lse = sdpa(q, k, v, mask, return_lse=True, **kw)
    got = grads(loss_of(out, lse, lse_dtype(dtype)), inputs, None)

    r = [leaf64(t) for t in inputs]
    r_out, r_lse = attention_reference(r[0], r[1], r[2], attn_mask=r[3], **dict(kw, sinks=r[4]))
    expected = grads(loss_of(r_out, r_lse, F64), r, None)

    t = [low_precision_leaf(x) for x in inputs]
    t_out, t_lse = torch_variant_attention(t[0], t[1], t[2], t[3], **dict(kw, sinks=t[4]))
    baseline = grads(loss_of(t_out, t_lse, lse_dtype(dtype)), t, None)

    names = ["grad query", "grad key", "grad value", "grad attn_mask", "grad sinks"]
    for name, x, a, e, b in zip(names, inputs, got, expected, baseline):
        if x is None or not x.requires_grad:
            continue
        assert_grad_like(name, a, x)
        if name == "grad sinks":
            # d loss / d sink = sum over the head's rows of p_sink * (w - g . out)
            with torch.no_grad():
                p_sink = torch.exp(per_head_view(r[4], q).squeeze(-1) - r_lse)
                w64 = w.to(F64) if lse_weight else 0.0
                terms = p_sink * (w64 - (g.to(F64) * r_out).sum(-1))
            assert_sum_close_by_rule(name, a, e, b, dtype, _per_head_abs_sum(terms, q))
            continue
        assert_close_by_rule(name, a, e, b, dtype)
        assert_max_abs_by_rule(name, a, e, b, dtype)
    return got


# --------------------------------------------------------------------------- forward, backward


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", list(CASES))
def test_variant_forward_matches_reference(device, case, dtype):
    q, k, v, mask, kw = _case(case, dtype, device, seed=len(case))
    check_forward(q, k, v, mask, kw)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=_ids)
@pytest.mark.parametrize("case", list(CASES))
def test_variant_grads_match_reference(device, case, dtype):
    q, k, v, mask, kw = _case(case, dtype, device, seed=len(case), requires_grad=True)
    check_backward(q, k, v, mask, kw, seed=len(case))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case", ["sinks", "sinks_bool_mask_dead_row", "everything_gqa",
                                  "window_causal_bottom_right_L_gt_S", "three_d"])
def test_variant_grads_through_lse_match_reference(device, case, dtype):
    q, k, v, mask, kw = _case(case, dtype, device, seed=3, requires_grad=True)
    check_backward(q, k, v, mask, kw, seed=3, lse_weight=True)


# Several query tiles (64 rows) and key tiles (up to 512 keys) with partial last ones;
# a sliding window leaves whole key tiles outside every row of a query tile: skipped.
TILE_CASES = {
    "L300_window_37_5": dict(B=1, L=300, S=300, window=(37, 5)),
    "L300_S333_everything_gqa": dict(B=1, Hq=4, Hkv=2, L=300, S=333, window=(64, 7),
                                     causal_alignment="bottom_right", softcap=4.0, alibi="H",
                                     sinks=torch.float32),
    "L1100_causal_window_256": dict(B=1, L=1100, S=1100, window=(256, 0), is_causal=True),
    "L70_S1100_bottom_right_window_sinks": dict(B=1, L=70, S=1100, window=(100, 0),
                                                causal_alignment="bottom_right",
                                                sinks=torch.float32),
    # a window whose forward panels are 128 keys: the CPU backward's key blocks are twice
    # that (windowed_backward_kv_block), 256 keys, each seen by about 12 query blocks
    "L1400_causal_window_500": dict(B=1, L=1400, S=1400, window=(500, 0), is_causal=True),
}


# bfloat16 too: its products skip the blocks of rows and keys outside each block's band
# (both sides of a window, the causal bound), reading Q and dO in place where L % 16 == 0;
# and float16, whose forward takes the same products in split bfloat16 on the amx variant.
_TILE_PARAMS = ([(c, torch.float32) for c in TILE_CASES] + [("L300_S333_everything_gqa", F64),
                                                               ("L1400_causal_window_500", F64)]
                + [(c, torch.bfloat16) for c in TILE_CASES] + [(c, torch.float16) for c in TILE_CASES])


@pytest.mark.parametrize("case,dtype", _TILE_PARAMS, ids=[f"{c}-{_ids(d)}" for c, d in _TILE_PARAMS])
def test_multi_tile_window_forward_and_grads_match_reference(device, case, dtype):
    cfg = TILE_CASES[case]
    q, k, v, mask, kw = _case(case, dtype, device, seed=7, requires_grad=True, cfg=cfg)
    check_forward(q, k, v, mask, kw)
    check_backward(q, k, v, mask, kw, seed=7, lse_weight=True)


# The tensor-core CUDA kernels take windows too (float16/bfloat16, E = Ev in 32, 64,
# 96, 128; their query tiles are 64-128 rows, their key tiles 64-128 keys): windows
# that leave whole key tiles out, cut tiles at their left or right edge, and rows
# that see no key. On the CPU the same shapes run through its kernels.
TC_WINDOW_CASES = {
    "E64_L700_window_100_20": dict(B=1, L=700, S=700, E=64, Ev=64, window=(100, 20)),
    "E128_L520_gqa_causal_window_200": dict(B=1, Hq=4, Hkv=2, L=520, S=520, E=128, Ev=128, window=(200, 0),
                                            is_causal=True),
    "E64_L300_S900_bottom_right_causal_window_64": dict(B=2, L=300, S=900, E=64, Ev=64, window=(64, None),
                                                        is_causal=True, causal_alignment="bottom_right"),
    # rows i < 593 see no key: output 0, lse -inf
    "E64_L900_S300_bottom_right_window_30_7": dict(B=1, L=900, S=300, E=64, Ev=64, window=(30, 7),
                                                   causal_alignment="bottom_right"),
    "E32_L400_right_only_50": dict(B=1, L=400, S=400, E=32, Ev=32, window=(None, 50)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_ids)
@pytest.mark.parametrize("case", list(TC_WINDOW_CASES))
def test_tensor_core_window_forward_and_grads_match_reference(device, case, dtype):
    cfg = TC_WINDOW_CASES[case]
    q, k, v, mask, kw = _case(case, dtype, device, seed=11, requires_grad=True, cfg=cfg)
    if q.is_cuda:  # the call runs on the tensor-core kernels (a window does not change the choice)
        assert torch.ops.attn_ext.tensor_core_reason(q, k, v) == ""
    check_forward(q, k, v, mask, kw)
    check_backward(q, k, v, mask, kw, seed=11, lse_weight=True)


# Split-KV: one head and a few query rows against thousands of keys leave threads
# idle, so the CPU forward splits each task's keys among them and merges the
# partial results through the log-sum-exp (4 threads here: 2-3 splits of up to
# 512-key tiles). On CUDA the same cases leave most SMs idle and split too
# (float32 and bfloat16 alike: kernels.h, SplitKV), on the decode kernel where a
# key/value head has at most 8 query rows and its K rows are read 16 bytes at a
# time, else on the generic tile kernel.
SPLIT_KV_CASES = {
    "decode": dict(B=1, Hq=1, L=1, S=3000, E=64, Ev=64),
    "causal_bottom_right_rows": dict(B=1, Hq=1, L=3, S=3000, E=64, Ev=64, is_causal=True,
                                     causal_alignment="bottom_right"),
    "window_bottom_right": dict(B=1, Hq=1, L=5, S=3100, E=32, Ev=48, window=(900, None), is_causal=True,
                                causal_alignment="bottom_right"),
    "sinks_gqa": dict(B=1, Hq=2, Hkv=1, L=1, S=2900, E=64, Ev=64, sinks=torch.float32),
    "dead_row_bool_mask": dict(B=1, Hq=1, L=4, S=3000, E=64, Ev=64, mask="bool_dead_row"),  # row 3 sees nothing
    "softcap_alibi": dict(B=1, Hq=1, L=1, S=3000, E=64, Ev=64, softcap=20.0, alibi="H"),
    # 40 rows: bfloat16 takes the AMX products (16+ rows) on the amx variant
    "chunk_of_rows_causal": dict(B=1, Hq=1, L=40, S=3000, E=64, Ev=64, is_causal=True,
                                 causal_alignment="bottom_right"),
    # CUDA's decode kernel (at most 8 rows per key/value head): a group of 8 query
    # heads, 4 heads x 2 rows at head dim 256, value columns unlike the keys'
    "gqa_group_of_eight": dict(B=2, Hq=16, Hkv=2, L=1, S=2500, E=128, Ev=128),
    "two_rows_gqa_head_dim_256": dict(B=1, Hq=8, Hkv=2, L=2, S=1500, E=256, Ev=200, is_causal=True,
                                      causal_alignment="bottom_right"),
    # the head dim strided: K rows the decode kernel cannot read 16 bytes at a time
    "strided_head_dim": dict(B=1, Hq=2, Hkv=1, L=1, S=2000, E=64, Ev=64, layout="strided_last"),
}


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case", list(SPLIT_KV_CASES))
def test_split_kv_forward_and_grads_match_reference(device, case, dtype, four_threads):
    cfg = SPLIT_KV_CASES[case]
    q, k, v, mask, kw = _case(case, dtype, device, seed=13, requires_grad=True, cfg=cfg)
    check_forward(q, k, v, mask, kw)
    check_backward(q, k, v, mask, kw, seed=13, lse_weight=True)


def test_cuda_splits_the_keys_where_the_tasks_leave_sms_idle(device):
    if device != "cuda":
        pytest.skip("CUDA's split-KV plan (the CPU's depends on its threads: the tests above)")
    for case, cfg in SPLIT_KV_CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, _, _ = _case(case, dtype, device, seed=13, cfg=cfg)
            assert torch.ops.attn_ext.split_kv_splits(q, k, v) > 1, (case, dtype)
    q, k, v, _, _ = _case("decode", torch.float64, device, seed=13, cfg=SPLIT_KV_CASES["decode"])
    assert torch.ops.attn_ext.split_kv_splits(q, k, v) == 1  # float64 never splits
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # the decode kernel aims at four blocks per SM; the tile kernel splits while half the SMs are idle
    q, k, v, _, _ = _case("decode", torch.float32, device, seed=13, cfg=dict(B=4 * sms, Hq=1, L=1, S=1000, E=64, Ev=64))
    assert torch.ops.attn_ext.split_kv_splits(q, k, v) == 1  # four decode blocks per SM: nothing idle
    q, k, v, _, _ = _case("decode", torch.float32, device, seed=13, cfg=dict(B=sms, Hq=1, L=9, S=1000, E=64, Ev=64))
    assert torch.ops.attn_ext.split_kv_splits(q, k, v) == 1  # 9 rows: a tile task per SM, nothing idle


def test_split_kv_over_batch_entries_cut_apart(device, four_threads):
    """Two decoding requests in one 3000-slot cache, 2600 and 300 slots written: on the
    CPU each entry runs on its own keys, split between threads (the shorter one's
    single tile leaves a split empty), and matches the reference."""
    cfg = dict(B=2, Hq=1, L=1, S=3000, E=64, Ev=64, tail="key_rows", used=[2600, 300])
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, _, kw = _case("decode", dtype, device, seed=19, requires_grad=True, cfg=cfg)
        mask = _tail_mask(cfg, 2, 1, 1, 3000, device, seed=19)
        check_forward(q, k, v, mask, kw)
        _, gk, gv = check_backward(q, k, v, mask, kw, seed=19, lse_weight=True)[:3]
        assert (gk[1, :, 300:] == 0).all() and (gv[1, :, 300:] == 0).all()


def test_split_kv_over_query_blocks_of_row_ranges(device, four_threads):
    """Three query rows that see three far-apart runs of a 4000-key cache (a bool mask
    that is no causal bound or window): on the CPU each row is a query block of its own
    (its keys start past the previous row's), three tasks for four threads, so each
    block's keys are split between threads and merged; the results match the reference."""
    starts, ends = torch.tensor([0, 1500, 3000]), torch.tensor([1500, 3000, 3900])
    keys = torch.arange(4000)
    mask = ((keys >= starts.view(3, 1)) & (keys < ends.view(3, 1))).view(1, 1, 3, 4000).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, _, kw = _case("decode", dtype, device, seed=29, requires_grad=True,
                               cfg=dict(B=1, Hq=1, L=3, S=4000, E=64, Ev=64))
        check_forward(q, k, v, mask, kw)
        check_backward(q, k, v, mask, kw, seed=29, lse_weight=True)


def test_split_kv_keeps_dropout_and_nan(device, four_threads):
    """The dropout of a split call is the unsplit call's (one thread: no split), and a
    NaN in a row's scores reaches its output and lse through the merge."""
    cfg = dict(B=1, Hq=1, L=2, S=3000, E=64, Ev=64)
    q, k, v, _, kw = _case("decode", torch.float32, device, seed=17, cfg=cfg)
    torch.manual_seed(5)
    split = sdpa(q, k, v, None, dropout_p=0.3, **kw)
    torch.set_num_threads(1)
    torch.manual_seed(5)
    whole = sdpa(q, k, v, None, dropout_p=0.3, **kw)
    torch.set_num_threads(4)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    k = k.clone()
    k[0, 0, 2500, 0] = float("nan")  # one key: every row's scores get a NaN
    out, lse = sdpa(q, k, v, None, return_lse=True, **kw)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_keys_outside_every_window_get_zero_grad(device):
    # L = S = 300, window (10, 0) top_left: key j is seen by rows j..j+10 only; with
    # queries 0..149 only, keys 150.. are outside every window: dK = dV = 0 exactly.
    q, k, v = make_qkv(1, 2, 2, 150, 300, 16, 16, torch.float32, device, seed=8, requires_grad=True)
    out = sdpa(q, k, v, window=(10, 0))
    gq, gk, gv = torch.autograd.grad(out.sum(), [q, k, v])
    assert (gk[..., 150:, :] == 0).all() and (gv[..., 150:, :] == 0).all()
    assert (gv[..., :150, :] != 0).all()


# A bool mask whose first or last keys no row sees: a preallocated cache with its
# written slots marked, as in gpt-fast or transformers' StaticCache under
# torch.compile, or a left-padded batch. The CPU kernels leave out the keys before
# the first visible one and after the last, per batch entry when the mask has a
# batch dim (requests at different positions of one cache, different padding); the
# results, dK and dV of the keys left out (0) included, are the uncut call's. cfg as
# CASES, and "tail": how the mask is made (see _tail_mask), with "used" the keys each
# batch entry has written and "pad" its padding keys at the start.
TAIL_CASES = {
    # one query row per sequence, a key row per batch entry (written 77 and 140 of 300)
    "decode_key_rows_gqa": dict(Hq=8, Hkv=2, L=1, S=300, E=32, Ev=32, tail="key_rows", used=[77, 140],
                                softcap=3.0, sinks=torch.float32),
    # four requests at different positions of one 512-slot cache, a chunk of 4 rows
    # each: row r of entry b sits at position used[b] - 4 + r (entry 2 fills the cache,
    # entry 3 has written 9 slots); the kernels run each entry on its own keys
    "entries_causal_rows_gqa": dict(B=4, Hq=4, Hkv=2, L=4, S=512, E=32, Ev=32, tail="entry_causal_rows",
                                    used=[300, 45, 512, 9], alibi="NH"),
    # gpt-fast's mask: query i at position 50 + i sees keys 0 .. 50 + i of 160
    "chunk_causal_rows": dict(L=7, S=160, tail="causal_rows", alibi="H"),
    # a random (B, H, L, S) mask, the last 30 keys hidden (40 in entry 1); the causal
    # offset and the window stay the uncut S's (bottom_right: S - L)
    "random_bottom_right_window": dict(Hq=4, Hkv=2, L=21, S=190, tail="random", used=[160, 150], is_causal=True,
                                       causal_alignment="bottom_right", window=(40, 0), alibi="NH"),
    # every key hidden: rows without keys, no key at all to run on
    "all_hidden": dict(L=5, S=64, tail="none_seen"),
    # a left-padded batch of three continuing with 5 rows each (transformers' dynamic
    # cache: a key-padding mask and the bottom-right causal pattern); entry 2 has 10
    # keys left, and entry 1's window reaches back past its padding
    "left_padded_entries": dict(B=3, Hq=4, Hkv=2, L=5, S=300, tail="key_rows", pad=[0, 120, 290], is_causal=True,
                                causal_alignment="bottom_right", window=(200, 0), softcap=5.0),
    # the same padding and written slots in every entry: one range [70, 150) for the batch
    "one_range_window": dict(L=9, S=200, tail="key_rows", pad=[70, 70], used=[150, 150], is_causal=True,
                             causal_alignment="bottom_right", window=(100, 0), sinks=torch.float32),
    # masks that vary by row (the kernels skip the key tiles a query block's rows do not
    # reach, and the query rows a key block is not seen by): the causal pattern as a bool
    # mask without the flag, over several query and key tiles
    "causal_as_bool": dict(B=1, L=300, S=300, tail="lower_triangle", used=[300]),
    # packed documents: a block-diagonal causal mask per batch entry, the documents'
    # lengths differing between the entries; GQA and per-batch ALiBi
    "documents": dict(Hq=4, Hkv=2, L=400, S=400, E=32, Ev=32, tail="documents", alibi="NH",
                      docs=[[50, 130, 20, 200], [260, 140]]),
    # a band (a sliding window as a bool mask) of another width per head, with a softcap
    "band_per_head": dict(B=1, Hq=2, L=260, S=260, tail="band_per_head", softcap=5.0),
    # each row sees a span of up to 40 keys somewhere in 700 (some rows none): a query
    # block's tiles span all of its rows' spans, a key block's rows are scattered
    "random_spans": dict(L=150, S=700, tail="random_spans", sinks=torch.float32),
    # masks that are flags (the CPU kernels drop the mask and run the flags): a causal
    # band of 64 keys, bottom-right, over left padding (entry 1's padding ends past the
    # band's start), with ALiBi measured from the call's own alignment
    "band_left_padded_alibi": dict(Hq=4, Hkv=2, L=40, S=300, tail="band", width=64, pad=[0, 230], alibi="NH",
                                   causal_alignment="bottom_right"),
    # the top-left triangle while ALiBi measures from the bottom-right alignment: the
    # flags cannot say both, so the rows' own ranges stand for the mask
    "triangle_alibi_other_alignment": dict(L=40, S=100, tail="lower_triangle", alibi="H",
                                           causal_alignment="bottom_right"),
    # documents with keys hidden inside them: the mask is not its ranges, and is read
    "documents_with_holes": dict(B=1, L=300, S=300, tail="documents_holes", docs=[[90, 150, 60]]),
}


def _tail_mask(cfg, B, H, L, S, device, seed):
    kind = cfg["tail"]
    used = torch.tensor(cfg.get("used", [S] * B)).view(B, 1, 1, 1)
    pad = torch.tensor(cfg.get("pad", [0] * B)).view(B, 1, 1, 1)
    if kind == "key_rows":
        return ((torch.arange(S) < used) & (torch.arange(S) >= pad)).to(device)
    if kind == "entry_causal_rows":
        return (torch.arange(S).view(1, 1, 1, S) <= used - L + torch.arange(L).view(1, 1, L, 1)).to(device)
    rows, keys = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
    if kind == "lower_triangle":
        return (keys <= rows).view(1, 1, L, S).to(device)
    if kind in ("documents", "documents_holes"):
        doc = [torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in cfg["docs"]]
        same = torch.stack([(d.view(L, 1) == d.view(1, S)) for d in doc])
        mask = (same & (keys <= rows)).view(B, 1, L, S)
        if kind == "documents_holes":
            mask &= torch.rand(mask.shape, generator=make_generator(seed)) > 0.02
        return mask.to(device)
    if kind == "band":
        pos = rows + S - L
        return ((keys <= pos) & (keys > pos - cfg["width"]) & (keys >= pad)).to(device)
    if kind == "random_spans":
        gen = make_generator(seed)
        start = torch.randint(0, S, (B, 1, L, 1), generator=gen)
        width = torch.randint(0, 41, (B, 1, L, 1), generator=gen)
        return ((keys >= start) & (keys < start + width)).to(device)
    if kind == "band_per_head":
        return torch.stack([(keys <= rows) & (keys > rows - w) for w in (40, 90)]).view(1, H, L, S).to(device)
    if kind == "causal_rows":
        return (torch.arange(S).view(1, S) <= 50 + torch.arange(L).view(L, 1)).view(1, 1, L, S).to(device)
    if kind == "random":
        mask = make_mask("bool", (B, H, L, S), None, device, seed=seed, keep_prob=0.8)
        return mask & (torch.arange(S) < used).to(device)
    return torch.zeros(1, 1, L, S, dtype=torch.bool, device=device)


def _as_kind(mask, kind, dtype, seed):
    """A bool mask as the call gets it. "bool": as it is. "float": 0 where it shows a key,
    -inf where it hides one (nn.Transformer's generate_square_subsequent_mask is such a
    mask), which the CPU kernels read as the bool mask's ranges and then drop.
    "float_bias": a random bias where it shows a key, -inf where not, requiring grad:
    the forward reads its ranges but keeps it; the backward, which computes its
    gradient, reads it whole."""
    if kind == "bool":
        return mask
    bias = torch.zeros(mask.shape, dtype=dtype)
    if kind == "float_bias":
        bias = torch.randn(mask.shape, generator=make_generator(seed)).to(dtype)
    out = bias.to(mask.device).masked_fill(~mask, float("-inf"))
    return out.requires_grad_(kind == "float_bias")


@pytest.mark.parametrize("mask_kind", ["bool", "float", "float_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case", list(TAIL_CASES))
def test_keys_no_row_sees_are_cut_and_match_reference(device, case, dtype, mask_kind):
    cfg = TAIL_CASES[case]
    if mask_kind == "float_bias":
        # no sinks beside a learned bias here (CASES has them together): with one query
        # row, a sink's gradient is a few terms of D = rowsum(dO O), which the kernels
        # take from the stored output, as FlashAttention does; in bfloat16 that is up to
        # 2^-9 of each term, beyond 2x torch's error on some draws
        cfg = {key: value for key, value in cfg.items() if key != "sinks"}
    q, k, v, _, kw = _case(case, dtype, device, seed=21, requires_grad=True, cfg=cfg)
    B, H, L, S = q.size(0), q.size(1), q.size(2), k.size(2)
    shown = _tail_mask(cfg, B, H, L, S, device, seed=22)
    mask = _as_kind(shown, mask_kind, dtype, seed=23)
    check_forward(q, k, v, mask, kw)
    _, gk, gv = check_backward(q, k, v, mask, kw, seed=21, lse_weight=True)[:3]
    seen = shown.expand(B, H, L, S).any(-2).any(-2)  # (B, S): the keys some row of each entry sees
    ranges = [(int(row.nonzero().min()), int(row.nonzero().max()) + 1) if row.any() else (0, 0) for row in seen]
    ends = shown.expand(B, H, L, S).any(1)[..., [0, -1]]  # (B, L, 2): does each row see the first and last key
    assert not ends.all(), "the mask hides no key at either end of any row: nothing to cut or skip"
    for b, (begin, end) in enumerate(ranges):
        for name, grad in (("grad key", gk), ("grad value", gv)):
            assert (grad[b, :, :begin] == 0).all() and (grad[b, :, end:] == 0).all(), f"batch entry {b}: {name}"


def test_slots_past_the_cut_are_never_read(device):
    """A cache allocated with torch.empty may hold NaN in its unwritten slots (and in its
    padding). On the CPU the keys before a batch entry's first visible one and past its
    last are not read, so a NaN there reaches neither the output nor a gradient (SDPA's
    math spreads a NaN value to every row, as 0 * NaN)."""
    if device != "cpu":
        pytest.skip("the CUDA kernels do not cut (the mask would have to be read on the host)")
    q, k, v = make_qkv(2, 4, 2, 3, 200, 16, 16, torch.float32, device, seed=25)
    mask = (torch.arange(200) < torch.tensor([50, 120]).view(2, 1, 1, 1)).to(device)
    g = torch.randn(2, 4, 3, 16, generator=make_generator(26)).to(device)
    results = []
    mask[1, ..., :30] = False  # entry 1's padding
    for fill in (0.0, float("nan")):  # each batch entry's unwritten slots, and the padding
        kf, vf = k.clone(), v.clone()
        kf[0, :, 50:], vf[0, :, 50:], kf[1, :, 120:], vf[1, :, 120:] = fill, fill, fill, fill
        kf[1, :, :30], vf[1, :, :30] = fill, fill
        leaves = [t.requires_grad_(True) for t in (q.clone(), kf, vf)]
        out = sdpa(*leaves, mask, enable_gqa=True)
        results.append((out, *torch.autograd.grad((out * g).sum(), leaves)))
    for name, clean, poisoned in zip(("out", "grad query", "grad key", "grad value"), *results):
        assert torch.equal(clean, poisoned), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_only_neg_inf_hides_a_key_of_a_float_mask(device, dtype):
    """-inf hides a key, any finite bias does not, however large: a row biased by
    finfo.min on every key (transformers' eager masks) averages the values as torch
    SDPA does (its base-2 shift overflowed to NaN before), and a row hidden by
    finfo.min on some keys still sees the rest. A row of -inf gives 0 (DESIGN.md),
    where SDPA gives NaN."""
    q, k, v = make_qkv(1, 2, 2, 6, 70, 16, 16, dtype, device, seed=31)
    low = torch.finfo(dtype).min
    mask = torch.zeros(6, 70, dtype=dtype)
    mask[:, 50:] = float("-inf")  # no row but 1 sees keys 50..69: cut
    mask[1] = low
    mask[2] = float("-inf")
    mask[3, :20] = low
    mask[4, 5:9] = float("-inf")  # a hole: the mask is kept
    mask = mask.to(device)
    check_forward(q, k, v, mask, {})
    out = sdpa(q, k, v, mask)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # the output's rounding
    torch.testing.assert_close(out[0, :, 1].float(), v.float().mean(-2)[0], rtol=tol, atol=tol)
    assert (out[0, :, 2] == 0).all()
    expect = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask.double())
    torch.testing.assert_close(out[0, :, [0, 1, 3, 4, 5]].double(), expect[0, :, [0, 1, 3, 4, 5]],
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=_ids)
def test_gradients_and_probs_of_rows_that_see_only_finfo_min_keys(device, dtype):
    """The backward takes P = exp(S - lse); a row whose scores all sit near finfo.min has
    lse = max + log(sum) rounded to the max (at 3e38 log(70) is far below its ulp), so
    P summed to the key count: gradients about 15x too large, and attention_probs' rows
    summed to 70 (PyTorch's own CPU flash kernel gives the same gradients). Such rows
    now find their max and log(sum) again. Row 1 sees every key at finfo.min, row 3 some,
    head 1 of row 4 sees keys at finfo.min beside a sink."""
    q, k, v = make_qkv(1, 2, 2, 6, 70, 16, 16, dtype, device, seed=32, requires_grad=True)
    low = torch.finfo(dtype).min
    mask = torch.zeros(6, 70, dtype=dtype)
    mask[1] = low
    mask[3, :20] = low
    mask[4] = low
    mask = mask.to(device)
    sink_dtype = F64 if dtype == F64 else torch.float32  # head 1's sink weighs nothing
    sinks = torch.tensor([0.5, -300.0], dtype=sink_dtype, device=device, requires_grad=True)
    g = torch.randn(1, 2, 6, 16, generator=make_generator(33)).to(device, dtype)
    out = sdpa(q, k, v, mask, sinks=sinks)
    got = torch.autograd.grad(out, [q, k, v, sinks], g)
    r = [leaf64(t) for t in (q, k, v, sinks)]
    ref = attention_reference(*r[:3], attn_mask=mask.double(), sinks=r[3])[0]
    want = torch.autograd.grad(ref, r, g.double())
    bound = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    assert rel_err(out, ref) < bound, "out"
    for name, a, b in zip(("grad query", "grad key", "grad value", "grad sinks"), got, want):
        assert rel_err(a, b) < bound, name
    probs = attn_ext_module().attention_probs(q.detach(), k.detach(), attn_mask=mask)
    want_probs = attention_probs_reference(*(t.detach().double() for t in (q, k)), attn_mask=mask.double())
    assert rel_err(probs, want_probs) < bound
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(1, 2, 6, dtype=F64), rtol=0, atol=bound * 10)


def test_cut_keys_keep_the_dropout_of_the_uncut_call(device):
    """Dropout draws by key index: a bool mask whose tail is hidden (cut) gives the same
    output and gradients under one seed as a float mask that hides the same keys by a
    bias of -1e30 (their weight is 0 just the same, but only -inf is read as hidden:
    nothing is cut)."""
    q, k, v = make_qkv(2, 4, 2, 9, 120, 16, 16, torch.float32, device, seed=23, requires_grad=True)
    mask = (torch.arange(120) < torch.tensor([40, 70]).view(2, 1, 1, 1)).to(device)
    additive = torch.zeros(mask.shape, device=device).masked_fill(~mask, -1e30)
    g = torch.randn(2, 4, 9, 16, generator=make_generator(24)).to(device)
    results = []
    for m in (mask, additive):
        torch.manual_seed(5)
        out = sdpa(q, k, v, m, dropout_p=0.3, enable_gqa=True)
        results.append((out, *torch.autograd.grad((out * g).sum(), [q, k, v])))
    for name, a, b in zip(("out", "grad query", "grad key", "grad value"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert (results[0][0] != 0).any() and (results[0][3][0, :, 40:] == 0).all() and (results[0][3][1, :, 70:] == 0).all()


# Bool masks that show each row exactly what a causal bound and a window would (a
# model's causal or sliding-window mask built as a tensor, transformers' under
# torch.compile), as (B, L, S, the mask of rows and keys, the flags' kwargs, the pads
# of a left-padded batch, which go to the flag call as a (B, 1, 1, S) key-padding mask).
FLAG_MASKS = {
    "causal_top_left": (1, 200, 200, lambda i, j: j <= i, dict(is_causal=True), None),
    "causal_bottom_right": (1, 70, 200, lambda i, j: j <= i + 130,
                            dict(is_causal=True, causal_alignment="bottom_right"), None),
    "sliding_window": (1, 300, 300, lambda i, j: (j <= i) & (j > i - 50), dict(is_causal=True, window=(49, 0)), None),
    "left_padded_causal": (2, 150, 150, lambda i, j: j <= i, dict(is_causal=True), [0, 40]),
    "band_both_sides": (1, 200, 200, lambda i, j: (j >= i - 20) & (j <= i + 10), dict(window=(20, 10)), None),
    # the same mask copied for every head, (B, Hq, L, S) in memory
    "sliding_window_per_head": (1, 300, 300, lambda i, j: (j <= i) & (j > i - 50),
                                dict(is_causal=True, window=(49, 0)), None),
}


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("case", list(FLAG_MASKS))
def test_a_mask_that_says_what_flags_say_runs_as_the_flags(device, case, mask_kind):
    """On the CPU such a mask, bool or float of 0 and -inf, is replaced by the flags (no
    mask is read, and the products stop at each row group's diagonal as the flags' do):
    output and gradients are the flag call's bitwise, and so is where a NaN value
    reaches, which the mask read in full spreads further (0 * NaN in the tiles the flags
    skip part of)."""
    if device != "cpu":
        pytest.skip("the CUDA kernels read the mask as given")
    B, L, S, visible, flags, pads = FLAG_MASKS[case]
    mask = visible(torch.arange(L).view(L, 1), torch.arange(S).view(1, S)).view(1, 1, L, S).expand(B, 1, L, S)
    padding = None
    if pads is not None:
        padding = (torch.arange(S) >= torch.tensor(pads).view(B, 1, 1, 1)).to(device)
        mask = mask & padding
    if case.endswith("_per_head"):
        mask = mask.expand(B, 4, L, S).contiguous()
    mask = _as_kind(mask.to(device), mask_kind, torch.float32, seed=29)
    q, k, v = make_qkv(B, 4, 2, L, S, 32, 32, torch.float32, device, seed=27, requires_grad=True)
    g = torch.randn(B, 4, L, 32, generator=make_generator(28)).to(device)
    results = []
    for m, kw in ((mask, {}), (padding, flags)):
        out = sdpa(q, k, v, m, enable_gqa=True, **kw)
        results.append((out, *torch.autograd.grad((out * g).sum(), [q, k, v])))
    for name, a, b in zip(("out", "grad query", "grad key", "grad value"), *results):
        assert torch.equal(a, b), name
    poisoned = v.detach().clone()
    poisoned[:, :, S - 1] = float("nan")  # the last key: seen by the last rows only
    with torch.no_grad():
        by_mask, by_flags = sdpa(q, k, poisoned, mask, enable_gqa=True), sdpa(q, k, poisoned, padding, enable_gqa=True, **flags)
    assert by_flags.isnan().any() and not by_flags[:, :, : L // 2].isnan().any()
    torch.testing.assert_close(by_mask, by_flags, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=_ids)
def test_rows_without_keys_with_sinks_give_zero_and_lse_equal_to_the_sink(device, dtype):
    # top_left L > S, window (3, 0): rows i >= S + 3 see no key; and a bool mask row
    L, S = 40, 20
    q, k, v = make_qkv(2, 2, 2, L, S, 16, 16, dtype, device, seed=9, requires_grad=True)
    sinks = _sinks(2, torch.float32, device, seed=9, requires_grad=True)
    mask = torch.ones(2, 1, L, S, dtype=torch.bool, device=device)
    mask[1, :, 5] = False
    kw = dict(window=(3, 0), sinks=sinks)
    out, lse = sdpa(q, k, v, mask, return_lse=True, **kw)
    dead = torch.zeros(2, 2, L, dtype=torch.bool, device=device)
    dead[:, :, S + 3:] = True
    dead[1, :, 5] = True
    assert torch.equal(_no_key_rows(q, k, mask, kw), dead)
    assert (out[dead] == 0).all()
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse[dead], sinks.detach().to(lse.dtype).view(1, 2, 1).expand_as(lse)[dead])
    gen = make_generator(10)
    g = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(lse.shape, generator=gen).to(device=device, dtype=lse.dtype)
    gq, gk, gv, gs = torch.autograd.grad((out * g).sum() + (lse * w).sum(), [q, k, v, sinks])
    for t in (gq, gk, gv, gs):
        assert torch.isfinite(t).all()
    assert (gq[dead] == 0).all()
    check_backward(q, k, v, mask, kw, seed=10, lse_weight=True)


def test_alibi_slopes_get_no_gradient(device):
    q, k, v = make_qkv(1, 2, 2, 9, 11, 8, 8, torch.float32, device, seed=11, requires_grad=True)
    slopes = _slopes(2, device).requires_grad_(True)
    out = sdpa(q, k, v, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is None
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_steep_alibi_matches_reference_and_leaves_subnormals_to_the_caller(device, dtype):
    """Slopes of 1/2 and 1/4 over 600 keys take far keys' probabilities below float's
    normal range, which the CPU kernels flush to zero while they run: output, lse and
    gradients still match the reference, and afterwards the caller's threads compute
    subnormal results again (the floating-point mode is restored)."""
    q, k, v = make_qkv(1, 2, 2, 600, 600, 32, 32, dtype, device, seed=21, requires_grad=True)
    kw = dict(is_causal=True, alibi_slopes=torch.tensor([0.5, 0.25], device=device))
    check_forward(q, k, v, None, kw)
    check_backward(q, k, v, None, kw, seed=21, lse_weight=True)
    tiny = torch.full((1 << 20,), 1e-30, dtype=torch.float32) * 1e-10  # 1e-40: subnormal, on every thread
    assert (tiny > 0).all() and (tiny < torch.finfo(torch.float32).tiny).all()


@pytest.mark.parametrize("softcap", [40.0, 50.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
def test_softcap_with_saturated_negative_scores_matches_reference(device, dtype, softcap):
    """Half the query rows point away from every key (scores near -300): after the cap
    their scores are all about -softcap. With a softcap of at most 40 the CPU forward
    uses the cap as each row's max, so these rows' exp(score - cap) are about
    exp(-2 cap) = exp(-80), near the end of float's normal range; at 50 it finds the
    max. A bool mask leaves one row no key (0 out, lse -inf). Output, lse and
    gradients against the reference."""
    E = 32
    gen = make_generator(23)
    away = torch.ones(E) * (40.0 / E**0.5)  # |away| = 40
    q = torch.randn(1, 2, 70, E, generator=gen)
    q[..., :35, :] += away
    k = torch.randn(1, 2, 90, E, generator=gen) - away
    v = torch.randn(1, 2, 90, E, generator=gen)
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))
    mask = make_mask("bool", (70, 90), dtype, device, seed=24, keep_prob=0.9)
    mask[5] = False
    kw = dict(softcap=softcap)
    check_forward(q, k, v, mask, kw)
    check_backward(q, k, v, mask, kw, seed=23, lse_weight=True)


def test_variants_left_none_equal_the_plain_call(device):
    q, k, v = make_qkv(2, 2, 2, 17, 23, 16, 16, torch.float32, device, seed=12)
    a = sdpa(q, k, v, is_causal=True, window=None, softcap=None, alibi_slopes=None, sinks=None)
    b = sdpa(q, k, v, is_causal=True)
    assert torch.equal(a, b)
    c = sdpa(q, k, v, window=(None, None))
    assert rel_err(c, sdpa(q, k, v)) < 1e-6


# --------------------------------------------------------------------------- attention_probs


PROBS_CASES = ["window_symmetric", "window_causal_bottom_right_L_gt_S", "softcap", "alibi",
               "alibi_per_batch_bottom_right", "sinks", "sinks_bool_mask_dead_row",
               "everything_gqa", "three_d", "non_contiguous"]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("case", PROBS_CASES)
def test_variant_probs_match_reference(device, case, dtype):
    attn_ext = attn_ext_module()
    q, k, _, mask, kw = _case(case, dtype, device, seed=len(case))
    got = attn_ext.attention_probs(q, k, mask, **kw)
    ref = attention_probs_reference(q, k, mask, **kw)
    assert got.dtype == dtype and got.shape == ref.shape
    with torch.no_grad():
        base, _ = torch_variant_probs(q, k, mask, **kw)
    # PyTorch's error: the plain-torch probabilities at the dtype (with the dtype's
    # rounding of the scores and of the result)
    base = base.to(dtype)
    assert_close_by_rule("probs", got, ref, base, dtype)
    assert_max_abs_by_rule("probs", got, ref, base, dtype)
    dead = _no_key_rows(q, k, mask, kw)
    assert (got[dead] == 0).all()
    if dtype in (torch.float32, F64) and kw.get("sinks") is not None:
        # a row sums to 1 - p_sink, p_sink = exp(sink - lse)
        _, lse = attention_reference(q, k, k, mask, **kw)  # any value: only the lse is used
        sink = per_head_view(kw["sinks"].detach().double(), q).squeeze(-1)
        p_sink = torch.exp(sink - lse)
        tol = 1e-12 if dtype == F64 else 1e-5
        torch.testing.assert_close(got.sum(-1).double(), torch.where(dead, 0.0, 1 - p_sink),
                                   rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case", ["window_causal_bottom_right_L_gt_S", "softcap", "sinks",
                                  "everything_gqa", "three_d"])
def test_variant_probs_grads_match_reference(device, case, dtype):
    q, k, _, mask, kw = _case(case, dtype, device, seed=len(case), requires_grad=True)
    _check_probs_grads(q, k, mask, kw, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_ids)
@pytest.mark.parametrize("case", [c for c, cfg in TAIL_CASES.items() if cfg["tail"] not in ("key_rows", "none_seen")])
def test_probs_of_masks_that_vary_by_row_match_reference(device, case, dtype):
    """attention_probs with a bool mask that varies by row: on the CPU it is read as its
    rows' ranges (and the flags they follow: the causal pattern, a band, documents),
    no key is cut, and every key's probability is written (0 where hidden)."""
    cfg = TAIL_CASES[case]
    q, k, _, _, kw = _case(case, dtype, device, seed=31, requires_grad=True, cfg=cfg)
    mask = _tail_mask(cfg, q.size(0), q.size(1), q.size(2), k.size(2), device, seed=32)
    got = attn_ext_module().attention_probs(q, k, mask, **kw)
    ref = attention_probs_reference(q, k, mask, **kw)
    with torch.no_grad():
        base, _ = torch_variant_probs(q, k, mask, **kw)
    assert_close_by_rule("probs", got, ref, base.to(dtype), dtype)
    assert (got.detach()[~mask.expand(got.shape)] == 0).all()
    _check_probs_grads(q, k, mask, kw, dtype)


def _check_probs_grads(q, k, mask, kw, dtype):
    """attention_probs' gradients (query, key, a float mask, sinks) against the float64
    reference's, by the rule."""
    attn_ext = attn_ext_module()
    sinks = kw.get("sinks")
    inputs = [q, k, mask, sinks]
    got_probs = attn_ext.attention_probs(q, k, mask, **kw)
    g = torch.randn(got_probs.shape, generator=make_generator(13)).to(device=q.device, dtype=dtype)
    got = grads(got_probs, inputs, g)
    r = [leaf64(t) for t in inputs]
    ref = attention_probs_reference(r[0], r[1], r[2], **dict(kw, sinks=r[3]))
    expected = grads(ref, r, g.to(F64))
    t = [low_precision_leaf(x) for x in inputs]
    base, _ = torch_variant_probs(t[0], t[1], t[2], **dict(kw, sinks=t[3]))
    baseline = grads(base.to(dtype), t, g)
    for name, x, a, e, b in zip(["grad query", "grad key", "grad attn_mask", "grad sinks"],
                                inputs, got, expected, baseline):
        if x is None or not x.requires_grad:
            continue
        assert a.dtype == x.dtype and a.shape == x.shape
        if name == "grad sinks":
            # d loss / d sink = -sum over the head's rows of p_sink * sum_j g_ij P_ij
            with torch.no_grad():
                p_sink = 1 - ref.sum(-1)
                terms = p_sink * (g.to(F64) * ref).sum(-1)
            assert_sum_close_by_rule(name, a, e, b, dtype, _per_head_abs_sum(terms, q))
            continue
        assert_close_by_rule(name, a, e, b, dtype)
        assert_max_abs_by_rule(name, a, e, b, dtype)


# --------------------------------------------------------------------------- gradcheck

# Tiny float64 problems (every row sees a key, so the lse is finite and checked too).
GRADCHECK_CASES = {
    "window": dict(L=5, S=6, window=(1, 1)),
    "window_one_side_none": dict(L=5, S=6, window=(None, 1)),
    "window_causal_bottom_right": dict(L=4, S=6, window=(2, None), is_causal=True,
                                       causal_alignment="bottom_right"),
    "softcap": dict(L=5, S=6, softcap=0.7, scale=1.0),
    "alibi_bottom_right": dict(L=4, S=6, alibi="H", causal_alignment="bottom_right"),
    "alibi_per_batch": dict(B=2, L=4, S=5, alibi="NH"),
    "sinks": dict(L=5, S=6, sinks=F64),
    "sinks_float32": dict(L=4, S=5, sinks=torch.float32),
    "float_mask_sinks_window": dict(L=5, S=6, window=(2, 0), sinks=F64, mask="float"),
    "everything_gqa": dict(Hq=2, Hkv=1, L=4, S=6, window=(1, 2), is_causal=True,
                           causal_alignment="bottom_right", softcap=1.5, alibi="NH", sinks=F64,
                           mask="float"),
    "three_d": dict(three_d=True, L=4, S=5, window=(1, 1), softcap=2.0, alibi="N1", sinks=F64),
}


def _gradcheck_case(name, device):
    cfg = dict(dict(B=1, E=4, Ev=3), **GRADCHECK_CASES[name])
    q, k, v, mask, kw = _case(name, F64, device, seed=len(name), requires_grad=True, cfg=cfg)
    sinks = kw.pop("sinks", None)
    if sinks is not None and sinks.dtype != F64:
        sinks.requires_grad_(False)  # gradcheck needs float64 inputs: check it as a constant
        kw["sinks"] = sinks
        sinks = None
    extra = [t for t in (mask, sinks) if t is not None and t.requires_grad]
    return q, k, v, mask, sinks, extra, kw


def _split_extra(extra, mask, sinks):
    """The mask and sinks back from gradcheck's positional inputs."""
    it = iter(extra)
    m = next(it) if mask is not None and mask.requires_grad else mask
    s = next(it) if sinks is not None else None
    return m, s


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_variant_gradcheck(device, case):
    q, k, v, mask, sinks, extra, kw = _gradcheck_case(case, device)

    def fn(q, k, v, *extra):
        m, s = _split_extra(extra, mask, sinks)
        kw2 = dict(kw) if s is None else dict(kw, sinks=s)
        return sdpa(q, k, v, m, return_lse=True, **kw2)

    out, lse = fn(q, k, v, *extra)
    assert torch.isfinite(lse).all()
    assert torch.autograd.gradcheck(fn, (q, k, v, *extra))


@pytest.mark.parametrize("case", ["window_causal_bottom_right", "softcap", "sinks",
                                  "everything_gqa", "three_d"])
def test_variant_probs_gradcheck(device, case):
    attn_ext = attn_ext_module()
    q, k, _, mask, sinks, extra, kw = _gradcheck_case(case, device)

    def fn(q, k, *extra):
        m, s = _split_extra(extra, mask, sinks)
        kw2 = dict(kw) if s is None else dict(kw, sinks=s)
        return attn_ext.attention_probs(q, k, m, **kw2)

    assert torch.autograd.gradcheck(fn, (q, k, *extra))


@pytest.mark.parametrize("op", ["sdpa", "probs"])
def test_variant_gradcheck_with_dropout(device, op):
    attn_ext = attn_ext_module()
    q, k, v, mask, sinks, extra, kw = _gradcheck_case("everything_gqa", device)

    def fn(q, k, *rest, p=0.3):
        v, extra = (None, rest) if op == "probs" else (rest[0], rest[1:])
        m, s = _split_extra(extra, mask, sinks)
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        if op == "probs":
            return attn_ext.attention_probs(q, k, m, dropout_p=p, **dict(kw, sinks=s))
        return sdpa(q, k, v, m, dropout_p=p, **dict(kw, sinks=s))

    inputs = (q, k, *extra) if op == "probs" else (q, k, v, *extra)
    assert not torch.equal(fn(*inputs), fn(*inputs, p=0.0)), "dropout dropped nothing"
    assert torch.autograd.gradcheck(fn, inputs)


# --------------------------------------------------------------------------- dropout


DROPOUT_KW = dict(window=(9, 3), softcap=3.0, is_causal=True, causal_alignment="bottom_right")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=_ids)
def test_probs_with_dropout_and_variants_times_value_equals_fused_output(device, dtype):
    attn_ext = attn_ext_module()
    q, k, v = make_qkv(2, 4, 2, 33, 70, 16, 16, dtype, device, seed=14)
    kw = dict(DROPOUT_KW, enable_gqa=True, alibi_slopes=_slopes(4, device, batch=(2,), seed=15),
              sinks=_sinks(4, torch.float32, device, seed=16), dropout_p=0.3)
    torch.manual_seed(123)
    probs = attn_ext.attention_probs(q, k, **kw)
    torch.manual_seed(123)
    out = attn_ext.scaled_dot_product_attention(q, k, v, **kw)
    expected = probs @ v.repeat_interleave(2, dim=1)
    assert rel_err(out, expected) < (1e-12 if dtype == F64 else 1e-5)
    kw_ref = {n: x for n, x in kw.items() if n != "dropout_p"}
    ref = attention_probs_reference(q, k, **kw_ref)
    visible = ref > 0
    dropped = ((probs == 0) & visible).sum().item() / visible.sum().item()
    assert 0.25 < dropped < 0.35
    # kept entries are the reference probabilities / (1 - p)
    kept = (probs != 0)
    torch.testing.assert_close(probs[kept].double() * 0.7, ref[kept],
                               rtol=1e-10 if dtype == F64 else 1e-5, atol=1e-12 if dtype == F64 else 1e-7)


def test_dropout_with_variants_matches_reference_given_the_recovered_mask(device):
    # value = [I_S | v]: the first S output columns are P * keep / (1 - p), so they give
    # the kernel's keep-mask; the output and the gradients must then equal the
    # reference's with that mask (float64: the tolerance of test_tiling).
    L, S, p = 21, 40, 0.3
    q, k, v0 = make_qkv(2, 4, 2, L, S, 8, 6, F64, device, seed=17, requires_grad=True)
    eye = torch.eye(S, dtype=F64, device=device).expand(2, 2, S, S)
    v = torch.cat([eye, v0.detach()], dim=-1).requires_grad_(True)
    mask = make_mask("float", (1, 4, L, S), F64, device, seed=18, requires_grad=True)
    sinks = _sinks(4, F64, device, seed=19, requires_grad=True)
    kw = dict(DROPOUT_KW, enable_gqa=True, alibi_slopes=_slopes(4, device), sinks=sinks)
    torch.manual_seed(5)
    out = sdpa(q, k, v, mask, dropout_p=p, **kw)
    probs = attention_probs_reference(q, k, mask, **kw)
    keep = (out[..., :S].detach() != 0) | (probs == 0)
    assert 0.2 < (~keep).sum().item() / (probs > 0).sum().item() < 0.4
    ref, _ = attention_reference(q, k, v, attn_mask=mask, dropout_p=p, dropout_mask=keep, **kw)
    assert rel_err(out, ref) < 1e-11
    g = torch.randn(out.shape, generator=make_generator(20), dtype=F64).to(device)
    inputs = [q, k, v, mask, sinks]
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    for name, a, b in zip(["query", "key", "value", "attn_mask", "sinks"], got, want):
        assert rel_err(a, b) < 1e-11, name


# --------------------------------------------------------------------------- bad values

ERRORS = (RuntimeError, ValueError)

# (kwargs for a (2, 4, 17, 16) query, argument name, values the message may show)
BAD_VARIANTS = {
    "window_negative_left": (dict(window=(-1, 0)), "window", ("(-1, 0)", "-1")),
    "window_negative_right": (dict(window=(0, -2)), "window", ("(0, -2)", "-2")),
    "window_not_a_pair": (dict(window=5), "window", ("5",)),
    "window_three_values": (dict(window=(1, 2, 3)), "window", ("(1, 2, 3)",)),
    "window_float_side": (dict(window=(1.5, 0)), "window", ("(1.5, 0)", "1.5")),
    "softcap_negative": (dict(softcap=-1.0), "softcap", ("-1.0",)),
    "softcap_zero": (dict(softcap=0.0), "softcap", ("0.0", "0")),
    "softcap_nan": (dict(softcap=float("nan")), "softcap", ("nan",)),
    "alibi_wrong_heads": (dict(alibi_slopes=("ones", (3,), torch.float32)), "alibi_slopes", ("(3,)",)),
    "alibi_wrong_batch": (dict(alibi_slopes=("ones", (3, 4), torch.float32)), "alibi_slopes",
                          ("(3, 4)",)),
    "alibi_3d": (dict(alibi_slopes=("ones", (2, 4, 1), torch.float32)), "alibi_slopes",
                 ("(2, 4, 1)",)),
    "alibi_float64": (dict(alibi_slopes=("ones", (4,), F64)), "alibi_slopes",
                      ("torch.float64", "float64", "double")),
    "sinks_wrong_heads": (dict(sinks=("ones", (5,), torch.float32)), "sinks", ("(5,)",)),
    "sinks_2d": (dict(sinks=("ones", (4, 1), torch.float32)), "sinks", ("(4, 1)",)),
    "sinks_int": (dict(sinks=("ones", (4,), torch.int64)), "sinks", ("torch.int64", "int64", "long")),
}


def _materialise(kw, device):
    return {n: torch.ones(x[1], dtype=x[2], device=device) if isinstance(x, tuple) and x and x[0] == "ones"
            else x for n, x in kw.items()}


@pytest.mark.parametrize("case", list(BAD_VARIANTS))
def test_bad_variant_value_raises_naming_the_argument(device, case):
    kw, name, values = BAD_VARIANTS[case]
    q, k, v = make_qkv(2, 4, 4, 17, 23, 16, 16, torch.float32, device, seed=21)
    with pytest.raises(ERRORS, match=error_pattern(name, *values)):
        sdpa(q, k, v, **_materialise(kw, device))


@pytest.mark.parametrize("case", ["window_negative_left", "softcap_zero", "alibi_wrong_heads",
                                  "sinks_wrong_heads"])
def test_bad_variant_value_raises_in_attention_probs(device, case):
    attn_ext = attn_ext_module()
    kw, name, values = BAD_VARIANTS[case]
    q, k, _ = make_qkv(2, 4, 4, 17, 23, 16, 16, torch.float32, device, seed=22)
    with pytest.raises(ERRORS, match=error_pattern(name, *values)):
        attn_ext.attention_probs(q, k, **_materialise(kw, device))


def test_bad_variant_values_on_3d_inputs_name_the_one_head(device):
    gen = make_generator(23)
    q, k, v = (randn(s, torch.float32, device, gen) for s in [(2, 7, 8), (2, 9, 8), (2, 9, 8)])
    with pytest.raises(ERRORS, match=error_pattern("sinks", "(2,)")):
        sdpa(q, k, v, sinks=torch.ones(2, device=device))
    with pytest.raises(ERRORS, match=error_pattern("alibi_slopes", "(3, 1)")):
        sdpa(q, k, v, alibi_slopes=torch.ones(3, 1, device=device))
