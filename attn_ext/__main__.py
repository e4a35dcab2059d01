"""``python -m attn_ext info | check | bench``.

info   what this build holds (torch/CUDA it was built against, kernels compiled) and what runs here
check  gradcheck in float64 and the comparison with the float64 reference over a
       representative set of configurations; a pass/fail table, exit 1 on a failure
bench  attn_ext vs torch SDPA vs the plain softmax(QK^T)V over a sequence-length
       sweep: a table, JSON (--json) and a PNG plot of GFLOP/s against L (--plot);
       every option of attn_ext/benchmark/sdpa.py is accepted (--help lists them).
       bench --variant window|softcap|alibi|sinks|varlen: that attention variant
       against the ways to get it without it (attn_ext/benchmark/variants.py;
       python -m attn_ext bench --variant window --help)
"""

import argparse
import sys
import time

import torch


_ISA_WHAT = {
    "default": "portable at::vec code",
    "avx2": "AVX2 + FMA, 8 float lanes",
    "avx512": "AVX-512, 16 float lanes, 32 registers",
    "avx512bf16": "AVX512-BF16 dot products for bfloat16's matrix products, avx512 for the other dtypes",
    "amx": ("AMX-BF16 tiles for bfloat16 (decoding rows: AVX512-BF16 dot products) and, in split bfloat16, "
            "float16; avx512 for the rest"),
}


def _cpu_kernel_lines(lib):
    """One line per compiled CPU kernel variant: running, usable, or why not."""
    import os

    active = lib.get("cpu_isa_active", "")
    supported = set(lib.get("cpu_isas_supported", "").split())
    forced = os.environ.get("ATTN_EXT_CPU_ISA")
    lines = []
    for isa in (lib.get("cpu_isas") or "default").split():
        what = _ISA_WHAT.get(isa, "")
        if isa == active:
            state = "usable, running" + (" (ATTN_EXT_CPU_ISA)" if forced else "")
        elif isa in supported:
            state = "usable (ATTN_EXT_CPU_ISA=" + isa + " selects it)"
        else:
            state = "not usable: this CPU (or its OS) lacks the instructions"
        if isa == "avx512bf16" and lib.get("cpu_bf16_dot_products", "all") != "all":
            rows = lib["cpu_bf16_dot_products"].split("<")[-1]
            what += (f" (on this Intel CPU only forwards of under {rows} query rows and decoding rows take the dot "
                     "products, the rest avx512's float32 kernels, which are faster here; ATTN_EXT_CPU_ISA=avx512bf16 "
                     "forces them)")
        lines.append(f"{isa:<10} {state}; {what}")
    if lib.get("cpu_l2_bytes"):
        lines.append(f"tiles      {lib['cpu_tile_rows']} query rows x {lib['cpu_forward_tile_keys']} keys forward, "
                     f"{lib['cpu_backward_tile_keys']} backward, the widest whose work fits half the "
                     f"{int(lib['cpu_l2_bytes']) >> 10} KiB L2 per core")
    if not active or active.startswith("none"):
        lines.append(f"error: {active}")
    if lib.get("openmp") != "yes":
        lines.append("warning: built without OpenMP, the kernels run on one thread")
    return lines


def _cuda_kernel_lines(built):
    """One line per CUDA kernel family: usable on this machine's GPU, or why not."""
    archs = built.get("cuda_archs", "none")
    if built.get("cuda", "none") == "none":
        why = "not built: " + built.get("cuda_skipped", "torch was CPU-only, nvcc was not found, or ATTN_EXT_CPU_ONLY=1")
        return [f"generic  {why}", f"tensor   {why}"]
    if not torch.cuda.is_available():
        why = f"not usable here: built for sm {archs}, but no CUDA device is visible"
        return [f"generic  {why}", f"tensor   {why}"]
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    compiled = [tuple(int(x) for x in a.split("+")[0].split(".")) for a in archs.split()]
    runs = any(m == major and n <= minor for m, n in compiled) or any("+PTX" in a for a in archs.split())
    if not runs:
        why = f"not usable: built for sm {archs}, {name} is sm {major}.{minor}; rebuild with TORCH_CUDA_ARCH_LIST={major}.{minor}"
        return [f"generic  {why}", f"tensor   {why}"]
    lines = [f"generic  usable on {name} (sm {major}.{minor}): float32/float64, any head dim, probabilities"]
    q = torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    why = torch.ops.attn_ext.tensor_core_reason(q, q, q)
    lines.append("tensor   " + (f"usable on {name}: float16/bfloat16, head dims 32/64/96/128 (E == Ev)"
                                 if not why else f"not usable: {why}"))
    return lines


def _info(args):
    from . import __version__, _build

    built = _build.built_for() or {}
    lib = _build.library_info()
    print(f"attn_ext {__version__}")
    print(f"  built against   torch {built.get('torch')}, CUDA {built.get('cuda')}, CUDA archs {built.get('cuda_archs')}")
    print(f"  running on      torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}")
    print(f"  CPU kernels     compiled for {lib.get('cpu_isas')}; torch's CPU capability here: "
          f"{torch.backends.cpu.get_cpu_capability()}; ATTN_EXT_CPU_ISA forces one")
    for line in _cpu_kernel_lines(lib):
        print(f"    {line}")
    print("  CUDA kernels")
    for line in _cuda_kernel_lines(built):
        print(f"    {line}")
    deterministic = "on" if torch.are_deterministic_algorithms_enabled() else "off"
    print("  determinism")
    print("    CPU      the same call gives the same bits at a fixed thread count (another count sums in another order)")
    print("    CUDA     the forward always; the backward under torch.use_deterministic_algorithms(True) "
          f"({deterministic} now),")
    print("             which runs the generic kernels (no dQ atomics) and a full-size buffer for a broadcast mask's")
    print("             gradient; otherwise those two take atomics, and their last bits vary between runs")
    return 0


def _configs():
    """(name, kwargs for make_inputs / the call) covering each path once."""
    return [
        ("plain", {}),
        ("L != S, odd sizes", dict(L=17, S=29)),
        ("bool mask", dict(mask="bool")),
        ("float mask + grad", dict(mask="float")),
        ("causal top_left", dict(is_causal=True)),
        ("causal bottom_right", dict(is_causal=True, causal_alignment="bottom_right", L=5, S=11)),
        ("causal + bool mask", dict(is_causal=True, mask="bool")),
        ("GQA (4 q heads, 2 kv)", dict(Hq=4, Hkv=2, enable_gqa=True)),
        ("Ev != E", dict(Ev=5)),
        ("dropout 0.3, fixed seed", dict(dropout_p=0.3)),
        ("transposed (N, L, H, E)", dict(transposed=True)),
    ]


def _run_config(cfg, device, dtype):
    from .ops import scaled_dot_product_attention
    from .reference import attention_reference

    B, Hq, Hkv = 2, cfg.get("Hq", 2), cfg.get("Hkv", cfg.get("Hq", 2))
    L, S, E, Ev = cfg.get("L", 7), cfg.get("S", 9), 8, cfg.get("Ev", 8)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=True):
        t = torch.randn(*shape, generator=g, dtype=dtype).to(device)
        return t.requires_grad_(grad)

    if cfg.get("transposed"):
        q = rand(B, L, Hq, E).transpose(1, 2).detach().requires_grad_()
        k = rand(B, S, Hkv, E).transpose(1, 2).detach().requires_grad_()
        v = rand(B, S, Hkv, Ev).transpose(1, 2).detach().requires_grad_()
    else:
        q, k, v = rand(B, Hq, L, E), rand(B, Hkv, S, E), rand(B, Hkv, S, Ev)
    mask = None
    inputs = [q, k, v]
    if cfg.get("mask") == "bool":
        mask = (torch.rand(L, S, generator=g) > 0.3).to(device)
    elif cfg.get("mask") == "float":
        mask = rand(1, Hq, L, S)
        inputs.append(mask)
    kwargs = dict(is_causal=cfg.get("is_causal", False), enable_gqa=cfg.get("enable_gqa", False),
                  causal_alignment=cfg.get("causal_alignment", "top_left"))
    p = cfg.get("dropout_p", 0.0)

    def ours(q, k, v, *m):
        torch.manual_seed(1234)  # the same dropout mask on every call
        return scaled_dot_product_attention(q, k, v, m[0] if m else mask, dropout_p=p, **kwargs)

    out = ours(*inputs)
    if p > 0:  # the forward's keep-mask, read back through value = identity
        eye = torch.eye(S, dtype=dtype, device=device).expand(B, Hkv, S, S)
        keep = ours(q.detach(), k.detach(), eye, *[t.detach() for t in inputs[3:]]) != 0
        ref, _ = attention_reference(q, k, v, inputs[3] if len(inputs) > 3 else mask, dropout_p=p,
                                     dropout_mask=keep, **kwargs)
    else:
        ref, _ = attention_reference(q, k, v, inputs[3] if len(inputs) > 3 else mask, **kwargs)
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    ok_ref = err < 1e-10
    ok_grad = torch.autograd.gradcheck(ours, tuple(inputs), raise_exception=False)
    return err, ok_ref, ok_grad


def _check(args):
    from . import _build  # noqa: F401

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("attn_ext check: --device cuda asked for, but no CUDA device is available here", file=sys.stderr)
        return 2
    print(f"attn_ext check on {device}: gradcheck (float64) and float64 reference comparison")
    rows, failed = [], 0
    configs = _configs()
    try:
        from tqdm import tqdm

        configs = tqdm(configs, desc="check", unit="config", leave=False, file=sys.stderr, disable=None)
    except ImportError:  # tqdm is optional: no progress bar
        pass
    for name, cfg in configs:
        t0 = time.perf_counter()
        err, ok_ref, ok_grad = _run_config(cfg, device, torch.float64)
        ok = ok_ref and ok_grad
        failed += not ok
        rows.append((name, f"{err:.1e}", "pass" if ok_grad else "FAIL", "PASS" if ok else "FAIL",
                     f"{time.perf_counter() - t0:.2f}s"))
    head = ("configuration", "rel err vs ref", "gradcheck", "result", "time")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    """argparse, with bad arguments reported in one line (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv=None):
    parser = _Parser(prog="python -m attn_ext", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what was built and what runs here")
    check = sub.add_parser("check", help="gradcheck + reference comparison, pass/fail table")
    check.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    sub.add_parser("bench", add_help=False, help="side-by-side benchmark with a table, JSON and a plot "
                                                 "(options: python -m attn_ext bench --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"info": _info, "check": _check}[args.command](args)


# The sweep `bench` runs by default: L = S from 256 to 4096 at B x H = 16, E = 64, causal or not.
BENCH_SWEEP = ",".join(f"{max(1, 4096 // L)}x4x{L}x64{c}" for c in ("", ":causal") for L in (256, 512, 1024, 2048, 4096))


def _bench(rest):
    from .benchmark import decode, sdpa, variants

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--variant")
    pre.add_argument("--decode", action="store_true")
    known = pre.parse_known_args(rest)[0]
    if known.decode:
        return decode.main(rest, prog="python -m attn_ext bench --decode")
    variant = known.variant
    if variant is not None:  # variants.py checks the name and has its own default shapes
        defaults = ["--json", f"attn_ext_bench_{variant}.json"]
        return variants.main(defaults + rest, prog="python -m attn_ext bench")
    defaults = ["--shapes", BENCH_SWEEP, "--json", "attn_ext_bench.json", "--plot", "attn_ext_bench.png"]
    return sdpa.main(defaults + rest, prog="python -m attn_ext bench")  # the user's options come last and win


if __name__ == "__main__":
    sys.exit(main())
