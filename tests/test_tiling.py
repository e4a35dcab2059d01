"""Shapes that span several query and key tiles of the kernels, with partial
last tiles: the online softmax across key tiles, causal tile skipping, the
mask and dropout offsets of later tiles, and the backward's accumulation over
tiles, all in float64 against the reference (errors ~1e-15, so 1e-11 leaves no
room for a real bug). The CPU kernels choose their tiles per CPU, by the L2
size, within bounds the library reports (build_info: 64 query rows; 128 to 512
keys forward, 128 to 256 backward): the shapes span several of any choice, which
test_shapes_span_every_tile_choice checks against what the library says."""

import pytest
import torch

from attn_ext.reference import attention_reference
from helpers import attn_ext_module, make_mask, make_qkv, rel_err

TOL = 1e-11

# (L, S): at least two query tiles and, for every key-tile choice, two key tiles plus a partial one.
SHAPES = {"short_queries_long_keys": (70, 1100), "long_queries": (300, 1090)}
VARIANTS = {
    "plain": dict(),
    "causal_top_left": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "float_mask_grad_and_causal": dict(mask="float", is_causal=True),
    "bool_mask_gqa": dict(mask="bool", gqa=True),
    "dropout_causal": dict(dropout_p=0.3, is_causal=True, causal_alignment="bottom_right"),
}


def _tile_choices():
    """(query rows per tile, every key-tile width the CPU kernels may choose), from build_info."""
    from attn_ext import _build

    info = _build.library_info()
    keys = set()
    for name in ("cpu_forward_tile_keys", "cpu_backward_tile_keys"):
        low, high = (int(x) for x in info[name].split(".."))
        while high >= low:
            keys.add(high)
            high //= 2
    return int(info["cpu_tile_rows"]), sorted(keys)


def test_shapes_span_every_tile_choice():
    """SHAPES (and the split-backward case's 150 x 1100) give every tile choice the library
    reports a full query tile plus a partial one, and two key tiles plus a partial one."""
    rows, key_tiles = _tile_choices()
    assert rows > 0 and key_tiles, (rows, key_tiles)
    for name, (L, S) in [*SHAPES.items(), ("split_backward", (150, 1100))]:
        assert L > rows and L % rows != 0, f"{name}: L = {L} against {rows}-row query tiles"
        for kv in key_tiles:
            assert S > 2 * kv and S % kv != 0, f"{name}: S = {S} against {kv}-key tiles"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_multi_tile_forward_and_backward_match_reference(shape, variant, device):
    attn_ext = attn_ext_module()
    L, S = SHAPES[shape]
    cfg = VARIANTS[variant]
    Hq, Hkv = (4, 2) if cfg.get("gqa") else (2, 2)
    q, k, v = make_qkv(1, Hq, Hkv, L, S, 16, 8, torch.float64, device, seed=L + S, requires_grad=True)
    mask = None
    if cfg.get("mask") == "float":
        mask = make_mask("float", (1, Hq, L, S), torch.float64, device, seed=3, requires_grad=True)
    elif cfg.get("mask") == "bool":
        mask = make_mask("bool", (L, S), torch.float64, device, seed=3, keep_prob=0.9)
    kw = dict(is_causal=cfg.get("is_causal", False), enable_gqa=Hq != Hkv,
              causal_alignment=cfg.get("causal_alignment", "top_left"))
    p = cfg.get("dropout_p", 0.0)
    keep = None
    if p > 0:
        # The keep-mask, read back through value = identity with the same seed.
        eye = torch.eye(S, dtype=torch.float64, device=device).expand(1, Hkv, S, S)
        torch.manual_seed(7)
        keep = attn_ext.scaled_dot_product_attention(q.detach(), k.detach(), eye, mask, dropout_p=p, **kw) != 0
    torch.manual_seed(7)
    out = attn_ext.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, **kw)
    ref, _ = attention_reference(q, k, v, mask, dropout_p=p, dropout_mask=keep, **kw)
    assert rel_err(out, ref) < TOL

    inputs = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(device)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    for name, g, w in zip(["query", "key", "value", "attn_mask"], got, want):
        assert rel_err(g, w) < TOL, name


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("variant", ["plain", "float_mask_grad_and_causal", "bool_mask_gqa"])
def test_backward_split_over_key_chunks_matches_reference(variant, threads, device):
    """One (batch, kv head) and more threads than that: the backward splits the keys into
    chunks, one task each, and sums their dQ afterwards (B = 1, Hkv = 1, GQA over 3 heads)."""
    attn_ext = attn_ext_module()
    cfg = VARIANTS[variant]
    Hq = 3 if cfg.get("gqa") else 1
    L, S = 150, 1100
    q, k, v = make_qkv(1, Hq, 1, L, S, 16, 8, torch.float64, device, seed=11, requires_grad=True)
    mask = None
    if cfg.get("mask") == "float":
        mask = make_mask("float", (1, Hq, L, S), torch.float64, device, seed=4, requires_grad=True)
    elif cfg.get("mask") == "bool":
        mask = make_mask("bool", (L, S), torch.float64, device, seed=4, keep_prob=0.9)
    # bottom-right: every key block has rows that see it, so every chunk's dQ counts
    kw = dict(is_causal=cfg.get("is_causal", False), enable_gqa=Hq > 1, causal_alignment="bottom_right")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attn_ext.scaled_dot_product_attention(q, k, v, mask, **kw)
        inputs = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
        grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).to(device)
        got = torch.autograd.grad(out, inputs, grad)
    finally:
        torch.set_num_threads(before)
    ref, _ = attention_reference(q, k, v, mask, **kw)
    want = torch.autograd.grad(ref, inputs, grad)
    for name, g, w in zip(["query", "key", "value", "attn_mask"], got, want):
        assert rel_err(g, w) < TOL, name


def test_multi_tile_probs_match_reference(device):
    attn_ext = attn_ext_module()
    from attn_ext.reference import attention_probs_reference

    q, k, _ = make_qkv(2, 2, 2, 150, 1100, 16, 16, torch.float64, device, seed=5)
    got = attn_ext.attention_probs(q, k, is_causal=True, causal_alignment="bottom_right")
    want = attention_probs_reference(q, k, is_causal=True, causal_alignment="bottom_right")
    assert rel_err(got, want) < TOL


# Query blocks of a few rows (decoding) read each key row in place instead of packing K^T, up
# to limits the library reports (build_info: cpu_direct_rows for float32/float64 and
# cpu_direct_rows_converted for float16/bfloat16 on at::vec, cpu_dot_rows for bfloat16 on the
# amx variant): every dtype, contiguous or strided keys, over several key tiles (S = 600), with
# the mask, bottom-right causal bound and GQA of a cached decoding step; 1-3 rows and each
# limit and the row after it. "transposed" is a (B, S, H, E) layout: float32 value rows are
# read in place by a few query rows, packed once per head by the block products (in place
# only when contiguous).
DECODE_ROWS = ["1", "2", "3", "cpu_direct_rows", "cpu_direct_rows+1", "cpu_direct_rows_converted",
               "cpu_direct_rows_converted+1", "cpu_dot_rows", "cpu_dot_rows+1"]


def _decode_rows(name):
    """Query rows for a DECODE_ROWS entry: a number, or a limit from build_info (+1: past it)."""
    from attn_ext import _build

    base, _, extra = name.partition("+")
    rows = int(base) if base.isdigit() else int(_build.library_info()[base])
    return rows + int(extra or 0)


@pytest.mark.parametrize("rows", DECODE_ROWS)
@pytest.mark.parametrize("layout", ["contiguous", "strided_last", "transposed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16],
                         ids=["float64", "float32", "bfloat16", "float16"])
def test_decode_rows_match_reference(rows, layout, dtype, device):
    from attn_ext.reference import attention_probs_reference

    from helpers import run_forward_case

    L = _decode_rows(rows)
    attn_ext = attn_ext_module()
    S = 600
    q, k, v = make_qkv(2, 4, 2, L, S, 24, 16, dtype, device, seed=L, layout=layout)
    mask = make_mask("bool", (2, 1, L, S), dtype, device, seed=L, keep_prob=0.8)
    kw = dict(attn_mask=mask, is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    run_forward_case(q, k, v, **kw)
    if dtype == torch.float64:
        got = attn_ext.attention_probs(q, k, **kw)
        assert rel_err(got, attention_probs_reference(q, k, **kw)) < TOL


# The decoding products read key and value rows in place. bfloat16 (AVX512-BF16 dot products
# on the amx variant) takes keys 16 at a time plus a tail, head dims 32 at a time with a
# masked tail, and value columns up to 128 per pass over the keys; float32 takes keys a
# vector's width at a time (16 or 8) plus a tail, head dims likewise, and value columns 8 or
# 4 vectors per pass, keys in pairs plus an odd one: head dims and key counts on either side
# of each.
@pytest.mark.parametrize("L", [1, 2, 4, 8])
@pytest.mark.parametrize("E,Ev,S", [(24, 16, 7), (64, 64, 33), (128, 128, 1), (256, 200, 45), (96, 40, 16),
                                    (64, 144, 40)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_head_dims_and_key_counts_match_reference(L, E, Ev, S, dtype, device):
    from helpers import run_forward_case

    q, k, v = make_qkv(2, 2, 1, L, S, E, Ev, dtype, device, seed=E + S + L)
    run_forward_case(q, k, v, enable_gqa=True)
    run_forward_case(q, k, v, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")


# float16 and bfloat16 keys are converted and packed transposed (K^T panels), 16 rows at a
# time through 16 x 16 register transposes of 256-column chunks, the rows left one at a
# time: head dims past one chunk and not a multiple of 16, key counts not a multiple of 16;
# 20 query rows pack (more than the in-place decoding rows). Forward and backward.
@pytest.mark.parametrize("E,S", [(300, 45), (264, 40), (17, 33), (48, 16)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_key_packing_head_dims_and_key_counts_match_reference(E, S, dtype, device):
    from helpers import run_backward_case, run_forward_case

    q, k, v = make_qkv(2, 2, 1, 20, S, E, 24, dtype, device, seed=E, requires_grad=True)
    kw = dict(is_causal=True, enable_gqa=True, causal_alignment="bottom_right")
    run_forward_case(q, k, v, **kw)
    run_backward_case(q, k, v, **kw)


# float16 on the amx variant runs its products in split bfloat16 on the tiles, forward and
# backward (each value as hi + lo, three or four bfloat16 products per product, from 16 query
# rows, 32 keys and 8192 pairs of them on): head dims not a multiple of 32 and past 128, value dims
# unlike the key's, key counts spanning several panels with a partial last one, one query tile
# exactly and a partial one, rows read through a (B, L, H, E) layout; with GQA, masks and the
# bottom-right causal bound. The log-sum-exp keeps float32's accuracy (the rule against
# PyTorch's at float32): rows that see one key each (their log-sum-exp is that score) fail it
# when Q K^T leaves out the lo x lo products. On the other variants the same cases run on the
# converted-to-float32 kernels.
@pytest.mark.parametrize("L,S,E,Ev", [(16, 600, 40, 24), (64, 1100, 72, 96), (130, 130, 128, 128),
                                      (70, 300, 200, 256), (33, 2000, 64, 64), (256, 32, 64, 64)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_float16_split_products_match_reference(L, S, E, Ev, layout, device):
    from helpers import run_backward_case, run_forward_case

    q, k, v = make_qkv(2, 4, 2, L, S, E, Ev, torch.float16, device, seed=L + E, layout=layout, requires_grad=True)
    run_forward_case(q, k, v, enable_gqa=True)
    run_forward_case(q, k, v, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
    run_backward_case(q, k, v, enable_gqa=True, is_causal=True, causal_alignment="bottom_right")
    q, k, v = q.detach(), k.detach(), v.detach()
    mask = make_mask("bool", (2, 1, L, S), torch.float16, device, seed=E, keep_prob=0.7)
    run_forward_case(q, k, v, attn_mask=mask, enable_gqa=True)
    mask = make_mask("float", (L, S), torch.float16, device, seed=E)
    run_forward_case(q[:1, :2], k[:1, :2], v[:1, :2], attn_mask=mask)
    # float32's accuracy: the log-sum-exp by the rule against PyTorch's float32 one on the same
    # (exactly converted) values; rows that see one key each have their score as log-sum-exp.
    from helpers import assert_close_by_rule, torch_lse

    q = q[:, :2]
    for mask in (None, torch.arange(S, device=device) == (torch.arange(L, device=device) % S)[:, None]):
        _, lse = attn_ext_module().scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
        _, ref_lse = attention_reference(q, k, v, attn_mask=mask)
        base_lse = torch_lse(q.float(), k.float(), v.float(), mask)
        if base_lse is not None:  # (on the CPU)
            assert_close_by_rule("lse", lse, ref_lse, base_lse, torch.float32)

