"""What long training runs and servers meet and the shape-by-shape tests do not: memory
that grows per call, Python threads calling the ops at once, results that change from
run to run, NaN/inf inputs, and tensors whose element offsets pass 2**31 (CPU)."""

import os
import threading

import pytest
import torch

from attn_ext.reference import attention_reference

from helpers import attn_ext_module, rel_err


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _qkv(seed, B=2, H=4, L=48, S=40, E=24, dtype=torch.float32, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, E, generator=gen, dtype=dtype).requires_grad_(requires_grad) for n in (L, S, S)]


def _fwd_bwd(attn_ext, q, k, v, mask=None, **kw):
    out = attn_ext.scaled_dot_product_attention(q, k, v, mask, **kw)
    return (out, *torch.autograd.grad(out, [t for t in (q, k, v, mask) if t is not None and t.requires_grad],
                                      torch.ones_like(out)))


def _sanitized():
    from attn_ext import _build

    return "sanitize" in _build.library_info()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_rss_is_flat_over_20k_forward_backward_calls_with_errors_between():
    """< 1 MB of RSS growth over 20 000 forward+backward calls, every 10th call followed
    by a call that raises (a bad shape), after 2 000 calls of warm-up."""
    if _sanitized():
        pytest.skip("under AddressSanitizer freed memory waits in its quarantine: RSS grows by design")
    calls = _calls_with_errors_between("cpu")
    calls(2_000)
    before = _rss_bytes()
    calls(20_000)
    growth = _rss_bytes() - before
    assert growth < 1 << 20, f"RSS grew by {growth / 2**20:.2f} MB over 20 000 calls"


def _calls_with_errors_between(device):
    """calls(n): n forward+backward calls on `device`, alternately causal, in float32 and
    (on CUDA, where it takes the tensor-core kernels) bfloat16; after every 10th a call
    that raises (a key with another head dim)."""
    attn_ext = attn_ext_module()
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    inputs = []
    for dtype in dtypes:
        q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in _qkv(0, B=1, H=2, L=32, S=32, E=16))
        mask = torch.randn(1, 1, 32, 32).to(device, dtype).requires_grad_()
        inputs.append((q, k, v, mask))
    bad = torch.randn(1, 2, 32, 15, device=device)

    def calls(n):
        for i in range(n):
            q, k, v, mask = inputs[i % len(inputs)]
            _fwd_bwd(attn_ext, q, k, v, mask, is_causal=i % 4 < 2)
            if i % 10 == 0:
                with pytest.raises((RuntimeError, ValueError)):
                    attn_ext.scaled_dot_product_attention(q, bad.to(q.dtype), v)

    return calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_memory_is_flat_over_20k_forward_backward_calls_with_errors_between():
    """After 2 000 calls of warm-up, 20 000 more leave torch's CUDA memory as it was: the
    same bytes allocated (nothing kept between calls) and no more reserved."""
    calls = _calls_with_errors_between("cuda")
    calls(2_000)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    calls(20_000)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated, "CUDA memory allocated grew over 20 000 calls"
    assert torch.cuda.memory_reserved() <= reserved, "CUDA memory reserved grew over 20 000 calls"


def test_python_threads_calling_at_once_give_the_serial_results():
    """8 Python threads, each with its own tensors and config, 5 rounds each: every result
    is bitwise the one the same call gives alone (the kernels keep no state between calls)."""
    attn_ext = attn_ext_module()
    configs = [dict(is_causal=bool(i % 2), window=(8, 0) if i % 3 == 0 else None,
                    softcap=20.0 if i % 4 == 1 else None) for i in range(8)]
    inputs = [_qkv(100 + i, dtype=torch.float32 if i % 2 else torch.bfloat16) for i in range(8)]
    serial = [_fwd_bwd(attn_ext, *inputs[i], **configs[i]) for i in range(8)]
    results, errors = {}, []

    def worker(i):
        try:
            for round_ in range(5):
                results[(i, round_)] = _fwd_bwd(attn_ext, *inputs[i], **configs[i])
        except Exception as e:  # noqa: BLE001 - reported below, with the thread
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (i, round_), got in results.items():
        for name, g, want in zip(("out", "grad query", "grad key", "grad value"), got, serial[i]):
            assert torch.equal(g, want), f"thread {i}, round {round_}: {name} differs from the serial call"


def test_results_are_bitwise_reproducible_at_each_thread_count():
    attn_ext = attn_ext_module()
    q, k, v = _qkv(7, B=1, H=1, L=200, S=300, E=32)  # one (batch, head): the keys split over threads
    mask = torch.randn(1, 1, 200, 1, requires_grad=True)  # broadcast over keys: per-thread gradient copies
    # A row's mask gradient sums dS over its keys, which is 0 but for the sink's share of the row:
    # without a sink the gradient is rounding noise (1e-7), whose runs differed by 7 % (avx2
    # kernels, AMD EPYC family 23).
    sinks = torch.tensor([0.5])
    threads = torch.get_num_threads()
    try:
        runs = {}
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            first = _fwd_bwd(attn_ext, q, k, v, mask, is_causal=True, sinks=sinks)
            again = _fwd_bwd(attn_ext, q, k, v, mask, is_causal=True, sinks=sinks)
            for a, b in zip(first, again):
                assert torch.equal(a, b), f"{n} threads: two identical calls differ"
            runs[n] = first
    finally:
        torch.set_num_threads(threads)
    ref = attention_reference(q, k, v, mask, is_causal=True, sinks=sinks)[0]
    for n, (out, *grads) in runs.items():  # another thread count sums in another order: close, not equal
        assert rel_err(out, ref) < 1e-5, f"{n} threads"
        for g, g1 in zip(grads, runs[1][1:]):
            assert rel_err(g, g1) < 1e-5, f"{n} threads vs 1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_backward_is_deterministic_under_use_deterministic_algorithms():
    """bfloat16, head dim 64, a mask broadcast over batch and heads: what the tensor-core
    kernels take, whose backward adds dQ (and the mask's gradient) with atomics. Under
    torch.use_deterministic_algorithms(True) two identical backwards give the same bits,
    and the same gradients as the default backward, to bfloat16's precision."""
    attn_ext = attn_ext_module()
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad_out = (torch.randn(2, 4, 512, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(4))
    mask = torch.randn(1, 1, 512, 512, generator=gen).to("cuda", torch.bfloat16)
    inputs = [t.requires_grad_() for t in (q, k, v, mask)]

    def grads():
        out = attn_ext.scaled_dot_product_attention(q, k, v, mask)
        return torch.autograd.grad(out, inputs, grad_out)

    default = grads()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = grads(), grads()
    finally:
        torch.use_deterministic_algorithms(was)
    for name, a, b, d in zip(("query", "key", "value", "mask"), first, second, default):
        assert torch.equal(a, b), f"grad {name}: two deterministic backwards differ"
        assert rel_err(a, d) < 1e-2, f"grad {name}: deterministic and default backwards disagree"


def _cpu_ticks_per_thread():
    """user + system clock ticks of each thread of this process, from /proc."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts each thread's CPU time in /proc; needs 2 cores")
def test_set_num_threads_sets_the_threads_the_kernels_run_on():
    """After torch.set_num_threads(n) the forward and backward run on n threads: with 1,
    one thread of the process does the work; with 2, two threads share it."""
    attn_ext = attn_ext_module()
    q, k, v = _qkv(11, B=1, H=8, L=1024, S=1024, E=64)
    threads = torch.get_num_threads()
    try:
        for n in (2, 1, 2):
            torch.set_num_threads(n)
            _fwd_bwd(attn_ext, q, k, v)  # warm-up; OpenMP's idle workers stop spinning
            before = _cpu_ticks_per_thread()
            for calls in range(1, 65):  # until the busiest thread has 40 ticks (0.4 s at 100 Hz) to compare
                _fwd_bwd(attn_ext, q, k, v)
                after = _cpu_ticks_per_thread()
                busiest = sorted((after[t] - before.get(t, 0) for t in after), reverse=True)
                if calls >= 8 and busiest[0] >= 40:
                    break
            assert busiest[0] >= 20, f"too short to measure: {busiest[:3]} ticks after {calls} calls"
            if n == 1:
                assert busiest[1] <= 0.1 * busiest[0], f"1 thread set, but the busiest threads took {busiest[:3]} ticks"
            else:
                assert busiest[1] >= 0.3 * busiest[0], f"2 threads set, but the busiest took {busiest[:3]} ticks"
    finally:
        torch.set_num_threads(threads)


def test_set_num_threads_in_another_thread_does_not_disturb_a_running_call():
    """torch.set_num_threads is per thread once a thread has run a parallel op (PyTorch's
    OpenMP rule); one thread switching between 1 and 2 while another runs the backward
    whose mask gradient has a copy per thread leaves that one's results bitwise the same."""
    attn_ext = attn_ext_module()
    q, k, v = _qkv(12, B=1, H=1, L=200, S=300, E=32)
    mask = torch.randn(1, 1, 200, 1, requires_grad=True)
    threads = torch.get_num_threads()
    serial = _fwd_bwd(attn_ext, q, k, v, mask)
    ready, stop, errors, results = threading.Event(), threading.Event(), [], []

    def switcher():
        try:
            other = _qkv(13, B=1, H=1, L=64, S=64, E=16)
            while not stop.is_set():
                for n in (1, 2):
                    torch.set_num_threads(n)
                    _fwd_bwd(attn_ext, *other)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def caller():
        try:
            torch.set_num_threads(threads)  # before the switcher starts: a new thread takes the last value set
            ready.set()
            for _ in range(100):
                results.append(_fwd_bwd(attn_ext, q, k, v, mask))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            stop.set()

    workers = [threading.Thread(target=caller), threading.Thread(target=switcher)]
    try:
        workers[0].start()
        ready.wait(timeout=60)
        workers[1].start()
        for t in workers:
            t.join()
    finally:
        torch.set_num_threads(threads)  # also the value new threads take
    assert not errors, errors
    assert len(results) == 100
    for r, got in enumerate(results):
        for name, g, want in zip(("out", "grad query", "grad key", "grad value", "grad mask"), got, serial):
            assert torch.equal(g, want), f"call {r}: {name} differs from the serial call"


@pytest.mark.parametrize("where", ["query", "key", "value", "mask_nan", "mask_pos_inf"])
def test_nan_and_inf_propagate_as_in_sdpa_math(where):
    """A NaN in query/key/value, or a NaN or +inf in an additive mask, gives NaN exactly
    where SDPA's math gives it (causal: a NaN key reaches the rows that see it; a NaN value
    reaches its column in every row, as 0 * NaN does in SDPA's product), the other entries
    are the math's, and nothing crashes. (The float64 reference differs here: it treats a
    row whose scores are NaN as a row without keys.)"""
    attn_ext = attn_ext_module()
    q, k, v = _qkv(3, B=1, H=2, L=12, S=12, E=8, requires_grad=False)
    mask = None
    if where == "query":
        q[0, 1, 4, 2] = float("nan")
    elif where == "key":
        k[0, 0, 5, 0] = float("nan")
    elif where == "value":
        v[0, 1, 5, 3] = float("nan")
    else:  # at (7, 3), a position the causal rule leaves visible
        mask = torch.randn(1, 1, 12, 12, generator=torch.Generator().manual_seed(4))
        mask[0, 0, 7, 3] = float("nan") if where == "mask_nan" else float("inf")
    out = attn_ext.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    # SDPA's math, with hidden keys left out (torch.where) rather than sent to -inf by
    # addition: NaN + -inf is NaN, so adding a causal mask would spread a NaN key to the
    # rows that cannot see it (SDPA's explicit-mask path does; its is_causal path does not).
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    scores = q64 @ k64.transpose(-2, -1) / 8**0.5 + (0 if mask is None else mask.to(torch.float64))
    hidden = torch.ones(12, 12, dtype=torch.bool).triu(1)
    want = torch.softmax(torch.where(hidden, float("-inf"), scores), dim=-1) @ v64
    assert torch.equal(torch.isnan(out), torch.isnan(want)), f"NaN pattern differs from the math's for {where}"
    assert torch.isnan(out).any(), "nothing became NaN"
    finite = ~torch.isnan(want)
    assert rel_err(out[finite], want[finite]) < 1e-5, "the other entries differ from the math's"


def _mem_available():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.skipif(_mem_available() < 12 << 30, reason="needs 12 GiB of free memory")
def test_element_offsets_past_2_31_forward():
    """query (1, 1, L, 64) bfloat16 with L * 64 = 2**31 + 2**20 elements (4 GiB, and as much
    for the output): the rows past element 2**31 come out as the reference gives them.
    (The backward at this length would add float32 dQ sums of 8 GiB: the backward tests
    below cross 2**31 in the keys, and in the query's heads.)"""
    attn_ext = attn_ext_module()
    E, S = 64, 16
    L = (2**31 + 2**20) // E
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, S, E, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 1, S, E, generator=gen).to(torch.bfloat16)
    # q's rows repeat a block of 4096 random rows (row r is block[r % 4096]): the reference
    # needs the block only.
    block = torch.randn(1, 1, 4096, E, generator=gen).to(torch.bfloat16)
    q = torch.empty(1, 1, L, E, dtype=torch.bfloat16)
    full = L // 4096 * 4096
    q[0, 0, :full].view(-1, 4096, E).copy_(block[0, 0].expand(full // 4096, 4096, E))
    q[0, 0, full:] = block[0, 0, : L - full]
    out = attn_ext.scaled_dot_product_attention(q, k, v)
    ref, _ = attention_reference(block, k, v)
    rows = torch.arange(L - 4096, L)  # all past element 2**31
    assert (rows[0] * E).item() > 2**31
    assert rel_err(out[0, 0, L - 4096:], ref[0, 0, rows % 4096]) < 1e-2
    assert rel_err(out[0, 0, :4096], ref[0, 0]) < 1e-2


def _repeat_rows(block, n, out_rows):
    """A (1, H, out_rows, D) tensor whose row r is block's row r % len(block), for
    out_rows = n * len(block), written block by block (no float64 copy of the whole)."""
    H, rows, D = block.shape[1], block.shape[2], block.shape[3]
    assert out_rows == n * rows
    out = torch.empty(1, H, out_rows, D, dtype=block.dtype)
    out[0].view(H, n, rows, D).copy_(block[0].unsqueeze(1).expand(H, n, rows, D))
    return out


@pytest.mark.skipif(_mem_available() < 14 << 30, reason="needs 14 GiB of free memory")
def test_element_offsets_past_2_31_backward_keys():
    """key (1, 1, S, 64) bfloat16 with S * 64 = 2**31 + 2**20 elements (4 GiB, and as much for
    its gradient). Keys and values repeat a block of 4096 rows n times, so every probability
    is the block's / n: the output and dQ are the block's, dK and dV the block's / n, also
    in the rows past element 2**31."""
    attn_ext = attn_ext_module()
    E, Ev, L, rows = 64, 8, 4, 4096
    S = (2**31 + 2**20) // E
    n = S // rows
    gen = torch.Generator().manual_seed(1)
    q, k_block, v_block, grad_out = (torch.randn(1, 1, m, d, generator=gen).to(torch.bfloat16)
                                     for m, d in ((L, E), (rows, E), (rows, Ev), (L, Ev)))
    k, v = _repeat_rows(k_block, n, S).requires_grad_(), _repeat_rows(v_block, n, S).requires_grad_()
    q.requires_grad_()
    out = attn_ext.scaled_dot_product_attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    del k, v
    ref_in = [t.detach().double().requires_grad_() for t in (q, k_block, v_block)]
    ref, _ = attention_reference(*ref_in)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, ref_in, grad_out.double())
    assert (S - rows) * E > 2**31  # the last block: past element 2**31
    assert rel_err(out, ref) < 1e-2
    assert rel_err(dq, ref_dq) < 1e-2
    for first in (0, S - rows):
        assert rel_err(dk[:, :, first:first + rows].double() * n, ref_dk) < 1e-2, f"dK rows {first}.."
        assert rel_err(dv[:, :, first:first + rows].double() * n, ref_dv) < 1e-2, f"dV rows {first}.."


@pytest.mark.skipif(_mem_available() < 16 << 30, reason="needs 16 GiB of free memory")
def test_element_offsets_past_2_31_backward_query_heads():
    """query (1, 8, L, 64) bfloat16 with 8 * L * 64 = 2**31 + 2**20 elements (4 GiB, and as
    much for dQ; float32 dQ sums of 1 GiB a thread, one head at a time): the last head's
    last rows lie past element 2**31. Every head's query rows repeat one block of 2048
    rows, with 16 keys and values alike in every head, so out and dQ are the block's and
    dK, dV n times the block's."""
    attn_ext = attn_ext_module()
    H, E, Ev, S, rows = 8, 64, 8, 16, 2048
    L = (2**31 + 2**20) // (H * E)
    n = L // rows
    gen = torch.Generator().manual_seed(2)
    q_block, k1, v1, go_block = (torch.randn(1, 1, m, d, generator=gen).to(torch.bfloat16)
                                 for m, d in ((rows, E), (S, E), (S, Ev), (rows, Ev)))
    q = _repeat_rows(q_block.expand(1, H, rows, E), n, L).requires_grad_()
    k, v = k1.expand(1, H, S, E).contiguous().requires_grad_(), v1.expand(1, H, S, Ev).contiguous().requires_grad_()
    out = attn_ext.scaled_dot_product_attention(q, k, v)
    grad_out = _repeat_rows(go_block.expand(1, H, rows, Ev), n, L)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    del q, grad_out
    ref_in = [t.double().requires_grad_() for t in (q_block, k1, v1)]
    ref, _ = attention_reference(*ref_in)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, ref_in, go_block.double())
    assert ((H - 1) * L + L - rows) * E > 2**31  # the last head's last block: past element 2**31
    for h in (0, H - 1):
        for first in (0, L - rows):
            assert rel_err(out[:, h:h + 1, first:first + rows], ref) < 1e-2, f"out head {h} rows {first}.."
            assert rel_err(dq[:, h:h + 1, first:first + rows], ref_dq) < 1e-2, f"dQ head {h} rows {first}.."
        assert rel_err(dk[:, h:h + 1].double() / n, ref_dk) < 1e-2, f"dK head {h}"
        assert rel_err(dv[:, h:h + 1].double() / n, ref_dv) < 1e-2, f"dV head {h}"


_HUGE_PAGE_PROBE = r"""
import torch, attn_ext

def anon_huge_kb(t):
    # AnonHugePages of the mapping that holds t's first huge page boundary
    addr = t.data_ptr() + (2 << 20)
    in_it = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                in_it = lo <= addr < hi
            elif in_it and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")

gen = torch.Generator().manual_seed(0)
q = torch.randn(1, 8, 8192, 64, generator=gen).requires_grad_()  # 16 MiB out and grad_query
k, v = (torch.randn(1, 8, 64, 64, generator=gen) for _ in range(2))
out = attn_ext.scaled_dot_product_attention(q, k, v)
out.backward(torch.ones_like(out))
print(anon_huge_kb(out), anon_huge_kb(q.grad))
"""


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


@pytest.mark.skipif(_thp_mode() != "madvise", reason="the advice matters where transparent huge pages are 'madvise'")
def test_large_outputs_are_advised_onto_huge_pages():
    """Outputs of 4 MiB or more get MADV_HUGEPAGE before the kernel writes them (a fresh
    32 MiB output's 8192 page faults took 9.9 ms, 2.4 ms as huge pages); ATTN_EXT_HUGE_PAGES=0
    turns the advice off."""
    import subprocess
    import sys

    def probe(**env):
        proc = subprocess.run([sys.executable, "-c", _HUGE_PAGE_PROBE], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [int(x) for x in proc.stdout.split()]

    advised, off = probe(), probe(ATTN_EXT_HUGE_PAGES="0")
    assert all(kb >= 2048 for kb in advised), advised  # out, grad_query
    assert off == [0, 0], off
