"""Helpers shared by the attn_ext benchmarks (CPU and CUDA).

Nothing here knows about attn_ext itself: shapes, FLOP counts, timing, peak
memory, error measures, machine description and table formatting.

FLOP convention of sdpa.py (docs/performance.md; variants.py counts the visible
pairs exactly instead, see visible_pairs):
    forward  = 4 * B * H * L * S * E   (two matmuls, 2 FLOPs per multiply-add)
    backward = 2.5 * forward            (five matmuls, one recomputes the scores)
    fwd+bwd  = 3.5 * forward
    all halved when causal (only the lower triangle is computed).

Peak memory: the largest number of bytes allocated *above what was live when
the call started* at any moment during one call (one forward+backward in the
benchmarks). It therefore counts the output, the saved tensors, the log-sum-exp,
workspace, score matrices (for the plain implementation) and the gradients
q.grad / k.grad / v.grad, but not the inputs, which exist before the call.
  * CUDA: torch.cuda.reset_peak_memory_stats() before, max_memory_allocated()
    - memory_allocated() after (exact, caching-allocator level).
  * CPU: PyTorch has no peak counter for its CPU allocator. Two measures are
    taken, each a lower bound of the truth, and the larger is reported:
    (a) tensors: the call runs under torch.profiler.profile(profile_memory=
        True); every allocation and free through the c10 CPU allocator is a
        "[memory]" event with a signed byte count; summed in time order, the
        running maximum is the peak. Exact for tensors (checked: q @ k^T of
        shape (B, H, L, S) float32 gives exactly B*H*L*S*4 bytes), but blind
        to memory a kernel takes from malloc/new (std::vector scratch) and to
        allocator calls made on OpenMP worker threads (no profiler state there).
    (b) everything: peak RSS growth, VmHWM reset through /proc/self/clear_refs,
        in a process started with RSS_ENV (glibc's mmap threshold pinned at
        16 KiB, so a freed block leaves RSS and a new one is faulted in) and
        after malloc_trim(0). Sees malloc'd scratch on any thread; page-
        granular. Linux + glibc only; benchmarks measure it in a worker process.
    Both figures are in the JSON (tensor_peak_bytes, rss_peak_bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from typing import Callable, Iterable, Sequence

import torch

# ----------------------------------------------------------------------------
# Shapes and FLOPs
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention problem: query (B, H, L, E), key/value (B, H, S, E)."""

    B: int
    H: int
    L: int
    E: int
    causal: bool = False
    S: int | None = None  # key length; defaults to L

    @property
    def s(self) -> int:
        return self.L if self.S is None else self.S

    def label(self) -> str:
        base = f"{self.B}x{self.H}x{self.L}x{self.E}"
        return base if self.S is None else f"{base} S={self.S}"

    def spec(self) -> str:
        """The string `parse_shapes` reads back."""
        base = f"{self.B}x{self.H}x{self.L}x{self.E}"
        if self.S is not None:
            base += f"xS{self.S}"
        return base + (":causal" if self.causal else "")

    def scaled(self, l_div: int) -> "Shape":
        """The same problem with L (and S) divided by `l_div` (for --quick)."""
        return dataclasses.replace(
            self,
            L=max(1, self.L // l_div),
            S=None if self.S is None else max(1, self.S // l_div),
        )


_SHAPE_RE = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+)(?:xS(\d+))?$")


def parse_shapes(text: str) -> list[Shape]:
    """Parse "4x8x1024x64:causal,1x8x4096x64" (BxHxLxE[xS<keys>][:causal])."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        dims, _, flag = item.partition(":")
        m = _SHAPE_RE.match(dims.strip())
        if m is None:
            raise ValueError(
                f"bad shape {item!r}: expected BxHxLxE, optionally xS<keys>, "
                f"optionally ':causal', e.g. '4x8x1024x64:causal'"
            )
        if flag.strip() not in ("", "causal", "nocausal"):
            raise ValueError(f"bad shape flag {flag!r} in {item!r}: expected 'causal'")
        B, H, L, E = (int(m.group(i)) for i in range(1, 5))
        S = int(m.group(5)) if m.group(5) else None
        shapes.append(Shape(B, H, L, E, causal=flag.strip() == "causal", S=S))
    if not shapes:
        raise ValueError(f"no shapes in {text!r}")
    return shapes


PASSES = ("fwd", "fwd+bwd", "bwd")
_PASS_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def attention_flops(shape: Shape, pass_: str) -> float:
    """FLOPs of one call, per the convention in the module docstring."""
    fwd = 4.0 * shape.B * shape.H * shape.L * shape.s * shape.E
    if shape.causal:
        fwd /= 2.0
    return fwd * _PASS_FACTOR[pass_]


def visible_pairs(L: int, S: int, causal: bool = False,
                  window: tuple[int | None, int | None] | None = None) -> int:
    """Exact number of (query, key) pairs one head of one sequence computes.

    Key j is visible from query i iff i - left <= j <= i + right (top-left
    aligned, as attn_ext's `window`), right = 0 when causal. The variant
    benchmarks count FLOPs as 4 * E * (these pairs), not the halved L * S.
    """
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    i = torch.arange(L, dtype=torch.int64)
    hi = torch.full_like(i, S - 1) if right is None else (i + right).clamp(max=S - 1)
    lo = torch.zeros_like(i) if left is None else (i - left).clamp(min=0)
    return int((hi - lo + 1).clamp(min=0).sum())


def parse_dtype(name: str) -> torch.dtype:
    aliases = {"fp32": "float32", "fp64": "float64", "fp16": "float16",
               "bf16": "bfloat16", "half": "float16", "float": "float32",
               "double": "float64"}
    name = aliases.get(name.strip(), name.strip())
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown floating dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# Relative error (norm-wise, see `rel_err`) above which a result is called
# wrong. Flash-style kernels accumulate in float32 for every dtype below
# float64, so the residual vs. another float32-accumulating kernel is a few
# ulps of the storage dtype times sqrt(reduction length): these are generous.
CHECK_TOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (0 for empty tensors)."""
    a = actual.detach().double()
    e = expected.detach().double()
    denom = e.norm().item()
    if denom == 0.0:
        return (a - e).norm().item()
    return (a - e).norm().item() / denom


class CountingInductor:
    """torch.compile's default backend (inductor), counting the graphs it is given:
    ``torch.compile(fn, backend=CountingInductor())``, then ``.graphs``."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)


def release_memory(device: torch.device) -> None:
    """Give back what a dropped case held (the CUDA caching allocator keeps it otherwise)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def error_text(exc: BaseException) -> str:
    """An exception in one line, for a table cell or the JSON."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def forward_backward(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                     grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(output, *input grads) of one `fn(*inputs).backward(grad)` on fresh leaf copies."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return (out.detach(), *(t.grad for t in leaves))


def timed_passes(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                 grad: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The two calls the benchmarks time: "fwd" (under no_grad) and "fwd+bwd".

    fwd+bwd runs `fn` on leaf copies of `inputs` that require grad, backward
    with `grad`, and drops the input gradients (so the next call allocates them
    afresh, as a training step does).
    """
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]

    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        fn(*leaves).backward(grad)
        for t in leaves:
            t.grad = None
    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    median_s: float
    iqr_s: float
    runs: int  # number of measured blocks the median is taken over

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3


def time_fn(
    fn: Callable[[], object],
    *,
    min_run_time: float,
    num_threads: int | None = None,
    warmup: int = 2,
    min_runs: int = 3,
    label: str = "",
) -> Timing:
    """Median time of `fn()` with torch.utils.benchmark.Timer.

    Runs `warmup` untimed calls, then Timer.blocked_autorange(min_run_time).
    If a call is so slow that fewer than `min_runs` blocks were measured,
    single calls are added until there are `min_runs`. torch's timer
    synchronizes the accelerator around every block, so this is right for
    CUDA as well. `num_threads` defaults to torch.get_num_threads() (Timer's
    own default is 1 thread, which is not what we want to measure).
    """
    import torch.utils.benchmark as torch_benchmark  # lazily: importing it warns on CUDA-less machines

    for _ in range(warmup):
        fn()
    timer = torch_benchmark.Timer(
        stmt="fn()",
        globals={"fn": fn},
        num_threads=num_threads or torch.get_num_threads(),
        label=label,
    )
    m = timer.blocked_autorange(min_run_time=min_run_time)
    times = list(m.times)
    while len(times) < min_runs:
        times.extend(timer.timeit(number=1).times)
    times.sort()
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) >= 2 else (times[0],) * 3
    return Timing(median_s=statistics.median(times), iqr_s=q3 - q1, runs=len(times))


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    min_run_time: float,
    rounds: int = 3,
    num_threads: int | None = None,
    warmup: int = 2,
    min_runs: int = 3,
) -> dict[str, Timing | BaseException]:
    """Like `time_fn` for several functions, measured in interleaved rounds.

    Each round gives every function min_run_time / rounds of blocked_autorange,
    in turn, and the median is over all blocks of all rounds: a slow drift of
    the machine (another job starting on a shared box) then hits every
    implementation alike instead of whichever happened to run last, which is
    what keeps the *ratios* meaningful. A function that raises (during warm-up
    or timing) gets the exception instead of a Timing; the others go on.
    """
    import torch.utils.benchmark as torch_benchmark  # lazily: importing it warns on CUDA-less machines

    results: dict[str, Timing | BaseException] = {}
    timers = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
        except Exception as exc:  # noqa: BLE001
            results[name] = exc
            continue
        timers[name] = torch_benchmark.Timer(
            stmt="fn()", globals={"fn": fn},
            num_threads=num_threads or torch.get_num_threads())
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(max(1, rounds)):
        for name, timer in timers.items():
            if name in results:
                continue
            try:
                times[name].extend(timer.blocked_autorange(min_run_time=min_run_time / rounds).times)
            except Exception as exc:  # noqa: BLE001
                results[name] = exc
    for name, timer in timers.items():
        if name in results:
            continue
        ts = times[name]
        while len(ts) < min_runs:
            ts.extend(timer.timeit(number=1).times)
        ts.sort()
        q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) >= 2 else (ts[0],) * 3
        results[name] = Timing(median_s=statistics.median(ts), iqr_s=q3 - q1, runs=len(ts))
    return {name: results[name] for name in fns}


# ----------------------------------------------------------------------------
# Peak memory
# ----------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence the profiler's native log lines (kineto prints to fd 2)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@dataclasses.dataclass
class PeakMemory:
    peak_bytes: int      # the figure to report (CPU: max of the two below)
    retained_bytes: int  # bytes still allocated (vs. the start) when the call returned
    method: str
    tensor_peak_bytes: int | None = None  # CPU: from the profiler's allocator events
    rss_peak_bytes: int | None = None     # CPU: peak RSS growth, None if unavailable

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / 2**20


def _read_rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


# Environment for a process whose peak RSS should be measurable: glibc's mmap
# threshold pinned low (which also turns off its dynamic growth), so every
# block of 16 KiB or more is its own mapping, faulted in on first touch and
# unmapped on free, never a recycled, already-resident heap chunk. It must be
# set when the process starts (the heap of a running process is already full
# of resident free chunks), and it slows every large allocation, so timings
# are not taken in such a process: the benchmarks run a separate worker.
RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "16384", "MALLOC_TRIM_THRESHOLD_": "32768"}

_RSS_READY: bool | None = None
_LIBC = None


def prepare_cpu_peak_memory() -> bool:
    """Enable the peak-RSS half of the CPU measure, where it can be trusted.

    The profiler only sees memory that goes through PyTorch's CPU allocator;
    scratch a kernel takes from malloc/new (std::vector inside a parallel
    region, say) is invisible to it. Peak RSS growth sees everything, but only
    in a process started with RSS_ENV (Linux + glibc). Returns whether it is
    on; if not, peak_memory() reports the profiler figure alone.
    """
    global _RSS_READY, _LIBC
    if _RSS_READY is not None:
        return _RSS_READY
    _RSS_READY = False
    if (not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc"
            or any(os.environ.get(k) != v for k, v in RSS_ENV.items())):
        return False
    try:
        import ctypes

        _LIBC = ctypes.CDLL(None)
        _LIBC.malloc_trim(ctypes.c_size_t(0))
        _RSS_READY = _reset_rss_peak()
    except (OSError, AttributeError):
        _RSS_READY = False
    return _RSS_READY


def _cpu_peak_memory(fn: Callable[[], object]) -> PeakMemory:
    from torch.profiler import ProfilerActivity, profile

    # 1. Peak RSS growth (see prepare_cpu_peak_memory), in its own call: the
    #    profiler's bookkeeping must not count.
    rss_peak = None
    if _RSS_READY:
        # Hand every free page back to the OS (all arenas), so a block freed
        # by an earlier call and reused by this one is faulted in again and
        # counted, instead of being resident already.
        _LIBC.malloc_trim(0)
    if _RSS_READY and _reset_rss_peak():
        base, _ = _read_rss()
        fn()
        rss_peak = max(0, _read_rss()[1] - base)

    # 2. Every allocation/free through the c10 CPU allocator, summed in order.
    with _quiet_native_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = [
        e for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and str(e.device_type()) == "DeviceType.CPU"
    ]
    # Stable sort: events with the same timestamp keep their recorded order.
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return PeakMemory(
        peak_bytes=max(peak, rss_peak or 0), retained_bytes=live,
        method="max(torch.profiler allocator events, peak RSS growth)" if rss_peak is not None
        else "torch.profiler allocator events",
        tensor_peak_bytes=peak, rss_peak_bytes=rss_peak)


def _cuda_peak_memory(fn: Callable[[], object], device: torch.device) -> PeakMemory:
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - start
    retained = torch.cuda.memory_allocated(device) - start
    return PeakMemory(peak_bytes=peak, retained_bytes=retained,
                      method="torch.cuda.max_memory_allocated")


def peak_memory(fn: Callable[[], object], device: torch.device | str) -> PeakMemory:
    """Peak extra bytes allocated during one call of `fn` (see module docstring).

    `fn` should drop what it creates before returning (e.g. set .grad to
    None), so `retained_bytes` is ~0 and the figure is not confused by
    allocations from an earlier call.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak_memory(fn, device)
    if device.type == "cpu":
        return _cpu_peak_memory(fn)
    raise ValueError(f"peak memory is measured on cpu and cuda devices only, got device {device}")


def measure_peaks(passes: dict[str, dict[str, Callable[[], object]]], device: torch.device,
                  records: dict[str, dict]) -> None:
    """Peak memory of one call of every function, into records[name]["peak_<pass>"].

    `passes` is {pass: {name: fn}} (see `timed_passes`); a name whose record
    already has an "error" is skipped, one that raises gets it.
    """
    for pass_, fns in passes.items():
        for name, fn in fns.items():
            if records[name].get("error") is not None:
                continue
            try:
                fn()  # warm: one-time allocations (thread pools, caches) are not the call's
                records[name][f"peak_{pass_}"] = peak_memory(fn, device)
            except Exception as exc:  # noqa: BLE001
                records[name]["error"] = error_text(exc)
            gc.collect()


def peaks_as_json(records: dict[str, dict]) -> dict[str, dict]:
    """The peak_* entries (and errors) of `measure_peaks`'s records, as plain dicts."""
    return {name: {key: (dataclasses.asdict(val) if isinstance(val, PeakMemory) else val)
                   for key, val in rec.items() if key.startswith("peak_") or (key == "error" and val)}
            for name, rec in records.items()}


def merge_peaks(records: dict[str, dict], saved: dict[str, dict]) -> None:
    """Put `peaks_as_json` output (e.g. from the memory worker) back into timing records."""
    for name, rec in records.items():
        for key, value in saved.get(name, {}).items():
            if key == "error":
                rec["error"] = rec["error"] or value
            else:
                rec[key] = PeakMemory(**value)


def run_memory_worker(module: str, argv: Sequence[str]) -> list | None:
    """Run `python -m module *argv --memory-worker PATH` in a process started with RSS_ENV.

    The module's main, given --memory-worker, measures peak memory (after
    prepare_cpu_peak_memory) and writes a JSON list to PATH, which is returned.
    Returns None (the caller then measures in-process, tensors only) if the
    child fails.
    """
    env = dict(os.environ, **RSS_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "memory.json")
        cmd = [sys.executable, "-m", module, *argv,
               "--threads", str(torch.get_num_threads()), "--memory-worker", path]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    print(f"note: the memory worker failed (exit {proc.returncode}); peak MB counts "
          f"PyTorch-allocated tensors only", file=sys.stderr)
    return None


# ----------------------------------------------------------------------------
# Machine description
# ----------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device | str) -> dict:
    device = torch.device(device)
    info = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            gpu_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
    return info


def describe_machine(info: dict) -> str:
    line = (
        f"CPU: {info['cpu']} ({info['cpu_count']} logical cores"
        + (f", {info['affinity']} usable" if info.get("affinity") not in (None, info["cpu_count"]) else "")
        + f", {info['cpu_capability']}), torch {info['torch']}, "
        f"{info['torch_threads']} torch threads, Python {info['python']}"
    )
    if "gpu" in info:
        line += (f"\nGPU: {info['gpu']} (sm_{info['gpu_capability'].replace('.', '')}, "
                 f"{info['gpu_memory_gb']} GiB), CUDA {info['cuda']}")
    return line


# ----------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------


def format_table(header: Sequence[str], rows: Iterable[Sequence[object]],
                 markdown: bool = False, align: str | None = None) -> str:
    """Aligned plain-text table, or a GitHub markdown table.

    `align` has one letter per column, "l" or "r" (default: all left).
    """
    rows = [[str(c) for c in r] for r in rows]
    header = [str(h) for h in header]
    align = (align or "").ljust(len(header), "l")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def cell(i: int, text: str) -> str:
        return text.rjust(widths[i]) if align[i] == "r" else text.ljust(widths[i])

    if markdown:
        lines = ["| " + " | ".join(cell(i, h) for i, h in enumerate(header)) + " |"]
        lines.append("|" + "|".join(
            ("-" * (w + 1) + ":" if align[i] == "r" else ":" + "-" * (w + 1))
            for i, w in enumerate(widths)) + "|")
        lines += ["| " + " | ".join(cell(i, c) for i, c in enumerate(r)) + " |" for r in rows]
    else:
        lines = ["  ".join(cell(i, h) for i, h in enumerate(header)).rstrip()]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(cell(i, c) for i, c in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    """Number for a table cell; '-' when missing."""
    if value is None:
        return "-"
    if value != value:  # NaN
        return "nan"
    return f"{value:.{digits}f}"


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, with bad arguments reported in one line (no usage block) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def bench_parser(prog: str | None, description: str, epilog: str, quick_div: int) -> OneLineErrorParser:
    """An argument parser with the options every benchmark takes (the caller adds
    its own, then calls `finish_bench_args`)."""
    p = OneLineErrorParser(prog=prog, description=description, epilog=epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32",
                   help="comma-separated dtypes (float32, bfloat16, float16, float64)")
    p.add_argument("--shapes", default=None, help="override the default shape set")
    p.add_argument("--quick", action="store_true",
                   help=f"L and S divided by {quick_div} and a short --min-run-time: a smoke test")
    p.add_argument("--min-run-time", type=float, default=None,
                   help="seconds of timed calls per measurement (default 1.0, 0.05 with --quick)")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved timing rounds across implementations (default 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before timing (default 2, 1 with --quick)")
    p.add_argument("--memory-worker", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", metavar="PATH", help="write every result to PATH")
    p.add_argument("--markdown", action="store_true",
                   help="also print the table as markdown (for README.md)")
    return p


def finish_bench_args(p: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None,
                      default_shapes: str, quick_div: int) -> argparse.Namespace:
    """Fill in what `bench_parser`'s options leave open: args.argv (for the memory
    worker), the --quick defaults, args.dtypes and args.shape_list (L, S divided
    by `quick_div` with --quick). A bad dtype or shape is a one-line error."""
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.min_run_time is None:
        args.min_run_time = 0.05 if args.quick else 1.0
    try:
        args.dtypes = [parse_dtype(d) for d in args.dtype.split(",") if d.strip()]
        args.shape_list = parse_shapes(args.shapes or default_shapes)
    except ValueError as exc:
        p.error(str(exc))
    if args.quick:
        args.shape_list = [s.scaled(quick_div) for s in args.shape_list]
    return args


def timing_note(args: argparse.Namespace) -> str:
    """How the figures were timed, for the line above a table."""
    return (f"timing: torch.utils.benchmark.Timer.blocked_autorange, {args.min_run_time} s per "
            f"measurement in {args.rounds} interleaved rounds, median")


def peak_note(device: torch.device) -> str:
    """What the peak MB figures mean, for the line above a table."""
    return ("peak MB: extra memory during one call (fwd row: no-grad forward; fwd+bwd row: "
            "forward+backward incl. grads)"
            + ("; CPU: max(allocator events, peak RSS growth)" if device.type == "cpu" else ""))


class _LineProgress:
    """A stand-in for tqdm: one line per finished item on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.note = total, desc, 0, ""

    def set_postfix_str(self, text: str) -> None:
        self.note = text

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{self.desc} [{self.n}/{self.total}] {self.note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str):
    """A tqdm progress bar on stderr, or a line per item where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(total, desc)
    # disable=None: no bar when stderr is not a terminal (logs, CI), only the results.
    return tqdm(total=total, desc=desc, unit="case", file=sys.stderr, dynamic_ncols=True, disable=None)


def bench_device(name: str, threads: int | None, prog: str) -> torch.device | None:
    """Set torch's thread count (when given) and return the device to benchmark on, or
    print one line and return None when it is a GPU that is not there."""
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: --device {name} asked for, but no CUDA device is available here", file=sys.stderr)
        return None
    return device
