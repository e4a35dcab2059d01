"""attn_ext.distributed: ring attention over gloo process groups of 2 and 4 ranks on this machine.

Each test spawns the ranks once (127.0.0.1, one thread each) and runs its cases
in them: every rank draws the same full-sequence inputs, runs ring_attention on
its shards, and compares its shard of the output, the lse and the gradients
with the float64 reference over the whole sequence (float64: to roundoff;
float32 / bfloat16: within the suite's rule, ERR_FACTOR x torch's own error
at that dtype + FLOOR).
"""

import os
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import ERR_FACTOR, FLOOR, assert_close_by_rule, grads, rel_err, torch_sdpa

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

SPAWN_DEADLINE_S = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, *args, deadline_s=SPAWN_DEADLINE_S):
    """Run fn(rank, world, port, *args) in `world` fresh processes; a rank's exception fails
    the test (with its traceback), and so does a run past the deadline (instead of a hang)."""
    ctx = mp.start_processes(_entry, args=(fn, world, _free_port(), args), nprocs=world, join=False,
                             start_method="spawn")
    end = time.monotonic() + deadline_s
    while not ctx.join(timeout=1):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{fn.__name__} with {world} ranks did not finish in {deadline_s} s")


def _entry(rank, fn, world, port, args):
    torch.set_num_threads(1)
    timeout = args[-1] if args and isinstance(args[-1], timedelta) else timedelta(seconds=120)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timeout)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A rank that succeeded ends here, before the interpreter's teardown: a process group still
    # referenced elsewhere (FSDP2's device mesh holds the default group) is otherwise destroyed
    # during that teardown, where gloo's threads once aborted the process in CI under load
    # (SIGABRT, "terminate called without an active exception", no Python error from the rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- the cases


def _full_inputs(B, Hq, Hkv, L, E, Ev, seed, three_d=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, L, E), (B, Hkv, L, E), (B, Hkv, L, Ev), (B, Hq, L, Ev), (B, Hq, L)]
    if three_d:
        shapes = [(B, L, E), (B, L, E), (B, L, Ev), (B, L, Ev), (B, L)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _grads(out, lse, inputs, grad_out, grad_lse):
    """The inputs' gradients for grad_out on out and, when given, grad_lse on lse."""
    if grad_lse is None:
        return grads(out, inputs, grad_out)
    return grads([out, lse], inputs, [grad_out, grad_lse])


def _check_case(dtype, layout, is_causal, Hq, Hkv, L, E=16, Ev=16, B=2, seed=0, with_lse=False, three_d=False,
                S=None):
    from attn_ext.distributed import ring_attention, shard, unshard
    from attn_ext.reference import attention_reference

    gqa = Hq != Hkv
    # drawn in float64, rounded to dtype: the reference sees the values the kernels see
    q, k, v, grad_out, grad_lse = (t.to(dtype).to(torch.float64) for t in _full_inputs(B, Hq, Hkv, L, E, Ev, seed,
                                                                                     three_d))
    if S is not None:  # keys of another length (cross-attention): the first S of another draw
        k, v = (t.to(dtype).to(torch.float64)[..., :S, :] for t in _full_inputs(B, Hq, Hkv, max(L, S), E, Ev,
                                                                                  seed + 1, three_d)[1:3])
    name = f"{dtype} {layout} causal={is_causal} Hq={Hq} Hkv={Hkv} L={L} S={S} W={dist.get_world_size()}"

    # the float64 reference over the whole sequence, and torch at this dtype (the yardstick)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_reference(*ref_in, is_causal=is_causal, enable_gqa=gqa)
    ref_grads = _grads(ref_out, ref_lse, ref_in, grad_out, grad_lse if with_lse else None)
    torch_in = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    torch_out = torch_sdpa(*torch_in, is_causal=is_causal, enable_gqa=gqa)
    torch_grads = torch.autograd.grad(torch_out, torch_in, grad_out.to(dtype))

    # the ring, each rank on its shards
    local = [shard(t, -2, layout).to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = ring_attention(*local, is_causal=is_causal, enable_gqa=gqa, layout=layout, return_lse=True)
    assert out.dtype == dtype and out.shape == shard(ref_out, -2, layout).shape, (name, out.dtype, out.shape)
    local_grads = _grads(out, lse, local, shard(grad_out, -2, layout).to(dtype),
                         shard(grad_lse, -1, layout) if with_lse else None)

    pairs = [("out", out, ref_out, torch_out), ("lse", lse, ref_lse, None)]
    pairs += [(f"grad_{n}", g, r, t) for n, g, r, t in zip("qkv", local_grads, ref_grads, torch_grads)]
    for what, got, ref, torch_got in pairs:
        ref = shard(ref, -2 if what != "lse" else -1, layout)
        if dtype == torch.float64:
            err = rel_err(got, ref)
            assert err < 1e-12, f"{name}: {what} rel err {err:.2e} vs the float64 reference"
        elif torch_got is None:  # lse: float32 whatever the inputs' dtype
            err = rel_err(got, ref)
            assert err < 1e-5, f"{name}: {what} rel err {err:.2e}"
        else:
            assert_close_by_rule(f"{name}: {what}", got, ref, shard(torch_got, -2, layout), dtype)

    # unshard gathers every rank's output: the whole sequence's
    full = unshard(out.detach(), -2, layout)
    err = rel_err(full, ref_out)
    bound = 1e-12 if dtype == torch.float64 else ERR_FACTOR * rel_err(torch_out, ref_out) + FLOOR[dtype]
    assert err <= bound, f"{name}: unshard(out) rel err {err:.2e} > {bound:.2e}"


def _run_cases(rank, world, cases):
    for case in cases:
        _check_case(**case)


def _cases(world):
    L = 2 * world * 7  # chunks of 7 rows: odd, shorter than a tile
    cases = []
    for layout in ("contiguous", "zigzag"):
        for is_causal in (False, True):
            for Hq, Hkv in ((2, 2), (4, 2)):
                cases.append(dict(dtype=torch.float64, layout=layout, is_causal=is_causal, Hq=Hq, Hkv=Hkv, L=L,
                                  seed=len(cases)))
            cases.append(dict(dtype=torch.float32, layout=layout, is_causal=is_causal, Hq=4, Hkv=2, L=4 * L,
                              E=64, Ev=32, seed=len(cases)))
    cases.append(dict(dtype=torch.float64, layout="zigzag", is_causal=True, Hq=4, Hkv=1, L=L, with_lse=True,
                      seed=100))
    cases.append(dict(dtype=torch.float64, layout="contiguous", is_causal=False, Hq=1, Hkv=1, L=L, three_d=True,
                      seed=101))
    for layout in ("contiguous", "zigzag"):
        cases.append(dict(dtype=torch.float64, layout=layout, is_causal=False, Hq=2, Hkv=1, L=L,
                          S=2 * world * 3, seed=103))
    cases.append(dict(dtype=torch.bfloat16, layout="zigzag", is_causal=True, Hq=4, Hkv=4, L=8 * L, E=64, Ev=64,
                      seed=102))
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_whole_sequence(world):
    _spawn(_run_cases, world, _cases(world))


def _gradcheck_cases(rank, world):
    """gradcheck of unshard(ring_attention(shard(q), shard(k), shard(v))) as a function of the full
    (replicated) q, k, v: every rank perturbs the same element at the same time, so each rank's
    numerical Jacobian is the whole function's; the analytic one goes through the ring's backward
    and shard's all-reduce."""
    from attn_ext.distributed import ring_attention, shard, unshard

    g = torch.Generator().manual_seed(7)
    L = 2 * world  # zigzag chunks of one row
    configs = [("zigzag", True, 2, 1), ("contiguous", False, 2, 2), ("contiguous", True, 1, 1)]
    for layout, is_causal, Hq, Hkv in configs[:1] if world > 2 else configs:  # 4 ranks on 2 cores: one
        q = torch.randn(1, Hq, L, 4, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(1, Hkv, L, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))

        def f(q, k, v):
            out, lse = ring_attention(*(shard(t, -2, layout) for t in (q, k, v)), is_causal=is_causal,
                                      enable_gqa=Hq != Hkv, layout=layout, return_lse=True)
            return unshard(out, -2, layout), unshard(lse, -1, layout)

        assert torch.autograd.gradcheck(f, (q, k, v)), (layout, is_causal)


@pytest.mark.parametrize("world", [2, 4])
def test_gradcheck_through_the_ring(world):
    _spawn(_gradcheck_cases, world)


# ----------------------------------------------------------------------------- the module


def _module_case(rank, world, layout):
    import attn_ext
    from attn_ext.distributed import enable_context_parallel, shard

    torch.manual_seed(0)
    E, H, Hkv, N, L = 32, 4, 2, 2, 8 * world
    mha = attn_ext.MultiHeadAttention(E, H, batch_first=True, num_kv_heads=Hkv, dtype=torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64)
    grad = torch.randn(N, L, E, dtype=torch.float64)
    ref, _ = mha(x, x, x, need_weights=False, is_causal=True)
    ref_param_grads = torch.autograd.grad(ref, list(mha.parameters()), grad)

    assert enable_context_parallel(mha, layout=layout) == 1
    assert f"context_parallel_layout='{layout}'" in repr(mha)
    x_local = shard(x, 1, layout).requires_grad_()
    out, _ = mha(x_local, x_local, x_local, need_weights=False, is_causal=True)
    assert rel_err(out, shard(ref, 1, layout)) < 1e-12
    param_grads = torch.autograd.grad(out, list(mha.parameters()), shard(grad, 1, layout))
    for (n, _), g, r in zip(mha.named_parameters(), param_grads, ref_param_grads):
        dist.all_reduce(g)  # each rank holds its tokens' share: the sum is the whole sequence's
        assert rel_err(g, r) < 1e-10, f"{n}: {rel_err(g, r):.2e}"

    with pytest.raises(ValueError, match="need_weights=True"):
        mha(x_local, x_local, x_local, is_causal=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x_local, x_local, x_local, need_weights=False, key_padding_mask=torch.zeros(N, x_local.shape[1]).bool())
    assert enable_context_parallel(mha, group=False) == 1 and mha.context_parallel_group is None
    with pytest.raises(ValueError, match=r"has length 7, which must divide by 4 \(2 ranks, layout 'zigzag'\)"):
        shard(torch.randn(3, 7), 1, "zigzag")


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_module_context_parallel(layout):
    _spawn(_module_case, 2, layout)


def _fsdp_case(rank, world):
    import attn_ext
    from attn_ext.distributed import enable_context_parallel, shard
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    E, H, N, L = 16, 2, 2, 4 * world
    mha = attn_ext.MultiHeadAttention(E, H, batch_first=True, num_kv_heads=1, dtype=torch.float64)
    x = torch.randn(N, L, E, dtype=torch.float64)
    ref, _ = mha(x, x, x, need_weights=False, is_causal=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), list(mha.parameters()))

    enable_context_parallel(mha, layout="zigzag")
    fully_shard(mha)  # parameters sharded over the same ranks that hold the sequence's shards
    x_local = shard(x, 1, "zigzag")
    out, _ = mha(x_local, x_local, x_local, need_weights=False, is_causal=True)
    assert rel_err(out, shard(ref, 1, "zigzag")) < 1e-12
    out.square().sum().backward()  # this rank's share of the whole loss
    for (name, p), r in zip(mha.named_parameters(), ref_grads):
        # FSDP averages the ranks' gradients; the whole loss is their sum
        err = rel_err(p.grad.full_tensor() * world, r)
        assert err < 1e-12, f"{name}: {err:.2e}"


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_module_context_parallel_under_fsdp():
    """fully_shard (FSDP2) over a context-parallel MultiHeadAttention on gloo: the output is
    the whole sequence's and the sharded gradients are the whole loss's (averaged over ranks)."""
    pytest.importorskip("torch.distributed.fsdp")
    _spawn(_fsdp_case, 2)


# ----------------------------------------------------------------------------- failures


def _missing_rank_case(rank, world, behaviour, timeout):
    from attn_ext.distributed import ring_attention

    if rank == 1:  # never calls ring_attention
        if behaviour == "stalls":
            time.sleep(timeout.total_seconds() + 3)
        return
    q = torch.randn(1, 2, 16, 8)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="ring_attention: step 0: exchanging keys/values"):
        ring_attention(q, q, q)
    assert time.monotonic() - start < timeout.total_seconds() + 30


@pytest.mark.parametrize("behaviour", ["exits", "stalls"])
def test_missing_rank_raises_instead_of_hanging(behaviour):
    """A rank that leaves (its connections close) or stays without calling (the group's timeout
    runs out) makes the other raise, naming the ring step, instead of waiting forever."""
    _spawn(_missing_rank_case, 2, behaviour, timedelta(seconds=5), deadline_s=120)


def test_needs_initialised_process_group():
    from attn_ext.distributed import ring_attention, shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(q, -2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layout="striped"), "layout must be one of"),
    (dict(is_causal=True, key_len=4), "same length, got 8 and 4"),
    (dict(layout="zigzag", query_len=7, key_len=7), "must be even, got query 7"),
    (dict(heads_kv=1), "pass enable_gqa=True"),
    (dict(heads_kv=3, enable_gqa=True), "multiple of Hkv"),
])
def test_bad_arguments_name_the_value(kwargs, match):
    from attn_ext.distributed import ring_attention

    kwargs = dict(kwargs)
    Lq, Lk, Hkv = kwargs.pop("query_len", 8), kwargs.pop("key_len", 8), kwargs.pop("heads_kv", 2)
    q = torch.randn(1, 2, Lq, 4)
    k = torch.randn(1, Hkv, Lk, 4)
    with pytest.raises(ValueError, match=match):
        ring_attention(q, k, k, **kwargs)


def test_module_refuses_an_unknown_layout():
    import attn_ext

    with pytest.raises(ValueError, match="layout must be one of .* got 'ring'"):
        attn_ext.MultiHeadAttention(8, 2, context_parallel_layout="ring")


def test_dtype_mismatch():
    from attn_ext.distributed import ring_attention

    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="same dtype"):
        ring_attention(q, q.double(), q)


def test_bench_ring_prints_every_row():
    """benchmarks/bench_ring.py at a tiny size: one row per (mask, layout, pass), the ring's
    output equal to the one-process output, and a ratio for each."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_ring.py"
    proc = subprocess.run([sys.executable, str(script), "--seq", "64", "--heads", "2", "--dim", "16", "--rounds", "1",
                           "--no-memory"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| (full|causal) ", line)]
    assert len(rows) == 6, proc.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[5]) > 0 and float(cells[7]) < 1e-5, row
