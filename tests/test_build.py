"""The build itself: what the library reports of itself and how a mismatched build is explained."""

import pytest
import torch

import helpers
from attn_ext import _build


def test_library_runs_cpu_kernels_in_parallel():
    # at::parallel_for is inline in the kernels: built without OpenMP they silently run on one thread.
    assert _build.library_info()["openmp"] == "yes"


def test_library_reports_the_torch_it_was_built_for():
    info = _build.library_info()
    assert info["torch"] == torch.__version__ == _build.built_for()["torch"]
    assert "default" in info["cpu_isas"].split()
    assert info["cpu_isa_active"] in info["cpu_isas_supported"].split()
    assert set(info["cpu_isas_supported"].split()) <= set(info["cpu_isas"].split())


def test_default_variant_is_the_widest_this_cpu_runs(monkeypatch):
    """Unforced, a call runs the widest variant this CPU supports that ATEN_CPU_CAPABILITY allows
    (cpu_isas lists them narrowest first): amx over avx512bf16 over avx512 where all three run."""
    monkeypatch.delenv("ATTN_EXT_CPU_ISA", raising=False)
    info = _build.library_info()
    supported = set(info["cpu_isas_supported"].split())
    allowed = {"AVX512": None, "AVX2": {"default", "avx2"}}.get(torch.backends.cpu.get_cpu_capability(), {"default"})
    usable = [isa for isa in info["cpu_isas"].split() if isa in supported and (allowed is None or isa in allowed)]
    assert info["cpu_isa_active"] == usable[-1], info


def test_cpu_isa_switch_picks_each_variant_and_rejects_others(monkeypatch):
    """ATTN_EXT_CPU_ISA forces a variant: each one this CPU runs becomes the active one and
    computes the same attention; an unknown name is an error naming the variable and the value."""
    from attn_ext import scaled_dot_product_attention

    compiled = _build.library_info()["cpu_isas"].split()
    supported = _build.library_info()["cpu_isas_supported"].split()
    q = torch.randn(1, 2, 40, 16)
    outs = {}
    for isa in supported:
        monkeypatch.setenv("ATTN_EXT_CPU_ISA", isa)
        assert _build.library_info()["cpu_isa_active"] == isa
        outs[isa] = scaled_dot_product_attention(q, q, q)
    for isa, out in outs.items():
        torch.testing.assert_close(out, outs["default"], msg=isa)

    monkeypatch.setenv("ATTN_EXT_CPU_ISA", "avx1024")
    try:
        scaled_dot_product_attention(q, q, q)
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError("ATTN_EXT_CPU_ISA=avx1024 was accepted")
    assert "ATTN_EXT_CPU_ISA=avx1024" in msg and " ".join(compiled) in msg
    for isa in set(compiled) - set(supported):  # e.g. avx512 on an AVX2-only CPU
        monkeypatch.setenv("ATTN_EXT_CPU_ISA", isa)
        try:
            scaled_dot_product_attention(q, q, q)
        except RuntimeError as e:
            assert f"ATTN_EXT_CPU_ISA={isa}" in str(e) and "cannot run" in str(e)
        else:
            raise AssertionError(f"ATTN_EXT_CPU_ISA={isa} ran on a CPU that lacks it")


def _cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""


def test_bf16_dot_products_run_where_they_pay(monkeypatch):
    """avx512bf16, chosen by default, takes its AVX512-BF16 dot products for bfloat16's blocked
    products on AMD's cores, and on Intel's only for forwards of fewer than 32 query rows
    (there avx512's float32 kernels are faster: bf16_dot_products_pay in kernels.h);
    ATTN_EXT_CPU_ISA=avx512bf16 takes them everywhere. Read off the bits: a call under the
    default choice gives exactly the bits of the variant whose kernels it should have run."""
    monkeypatch.delenv("ATTN_EXT_CPU_ISA", raising=False)
    info = _build.library_info()
    if info["cpu_isa_active"] != "avx512bf16":
        pytest.skip(f"the default variant here is {info['cpu_isa_active']}, not avx512bf16")
    intel = _cpu_vendor() == "GenuineIntel"
    assert info["cpu_bf16_dot_products"] == ("forward_rows<32" if intel else "all"), info

    from attn_ext import scaled_dot_product_attention

    def call(isa, L, backward):
        if isa is None:
            monkeypatch.delenv("ATTN_EXT_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ATTN_EXT_CPU_ISA", isa)
        gen = torch.Generator().manual_seed(L)
        q, k, v, g = (torch.randn(2, 3, n, 64, generator=gen).bfloat16() for n in (L, 200, 200, L))
        q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
        out = scaled_dot_product_attention(q, k, v)
        if not backward:
            return [out]
        out.backward(g)
        return [out, q.grad, k.grad, v.grad]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    monkeypatch.setenv("ATTN_EXT_CPU_ISA", "avx512bf16")
    assert _build.library_info()["cpu_bf16_dot_products"] == "all"
    for L, backward in ((16, False), (64, False), (64, True)):
        dots, fp32 = call("avx512bf16", L, backward), call("avx512", L, backward)
        assert not same(dots, fp32), (L, backward)  # the two kernels round differently: the check can tell them
        expect = fp32 if intel and (backward or L >= 32) else dots
        assert same(call(None, L, backward), expect), (L, backward, intel)


def test_mismatched_torch_raises_one_clear_sentence(monkeypatch):
    monkeypatch.setattr(_build, "built_for", lambda: {"torch": "0.0.1"})
    try:
        _build.load_library()
    except ImportError as e:
        msg = str(e)
    else:
        raise AssertionError("a build for torch 0.0.1 was loaded under torch " + torch.__version__)
    assert "built for torch 0.0.1" in msg and torch.__version__ in msg and "pip install" in msg


def test_gpu_check_sanitizer_selections_each_pick_cuda_tests():
    """scripts/gpu_check.sh runs compute-sanitizer over pytest -k selections; a renamed test
    would leave one empty (found only on a GPU machine). Here they are collected (not run):
    each selects CUDA tests only, and together every CUDA test of
    tests/test_kernel_selections.py (the list of kernel selections)."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "scripts", "gpu_check.sh")) as f:
        script = f.read()
    block = re.search(r"^SELECTIONS=\(\n(.*?)^\)", script, re.S | re.M).group(1)
    selections = re.findall(r'^\s*"([^"]+)"', block, re.M)
    assert selections

    def collect(path, expr):
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               os.path.join(root, path), "-k", expr], capture_output=True, text=True, timeout=600,
                              cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:]
        return {line for line in proc.stdout.splitlines() if "::" in line}

    selected = set()
    for sel in selections:
        ids = collect(*sel.split("::-k "))
        assert ids, f"{sel!r} selects nothing"
        assert all("cuda" in i for i in ids), f"{sel!r} selects CPU tests too"
        selected |= ids
    every = collect("tests/test_kernel_selections.py", "cuda")
    assert len(every) > 50 and every <= selected, f"not under the sanitizer: {sorted(every - selected)[:5]}"


@pytest.mark.skipif(not helpers.CAN_READ_X86_CODE, reason="reads x86-64 code with binutils' objdump")
def test_no_code_calls_instructions_wider_than_its_callers_unit():
    """Each kernel unit (default, avx2, avx512, amx) holds its own copy of every inline function it
    uses from the shared headers, compiled with its own flags, and the linker keeps one copy of
    each. Linked in the wrong order (amx first), AttnParams' constructor and std::vector's members
    kept their AVX-512 copies and the avx2 kernels died of SIGILL on AVX2-only CPUs, which a test
    run on an AVX-512 machine never sees. So this reads the library's code itself
    (helpers.code_wider_than_its_callers)."""
    import attn_ext._C

    problems = helpers.code_wider_than_its_callers(attn_ext._C.__file__)
    assert not problems, "\n".join(problems)[:6000]
