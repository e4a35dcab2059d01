"""pytest configuration: every device-aware test runs on the CPU and, when present, CUDA.

The kernel tests (KERNEL_TESTS) run on the CPU once per compiled CPU kernel variant
(ATTN_EXT_CPU_ISA=default, avx2, avx512, avx512bf16, amx); a variant this CPU cannot run is
skipped with the reason. The other tests run the variant attn_ext picks by itself.
"""

import os

import pytest
import torch

try:  # the property-based tests' budgets (tests/test_fuzz.py); hypothesis is a test dependency
    from hypothesis import HealthCheck, settings

    _FUZZ = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    settings.register_profile("ci", max_examples=1_000, **_FUZZ)  # 13 s alone on 2 cores
    # about an hour: 42 329 cases took 46 minutes on the 2-core Xeon (shared with builds)
    settings.register_profile("long", max_examples=50_000, **_FUZZ)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:
    pass

KERNEL_TESTS = {"test_sdpa_forward", "test_sdpa_backward", "test_tiling", "test_dropout", "test_probs",
                "test_reference", "test_variants", "test_varlen"}
# Tests of the float64 reference's own definitions (no kernel runs): the CPU is enough.
CPU_ONLY = {"test_reference_variants"}


def _cpu_variants():
    from attn_ext import _build

    info = _build.library_info()
    return info["cpu_isas"].split(), set(info["cpu_isas_supported"].split())


def _cuda_param():
    return pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"))


def pytest_generate_tests(metafunc):
    if "device" not in metafunc.fixturenames:
        return
    module = metafunc.module.__name__.rsplit(".", 1)[-1]
    params = ["cpu"]
    if module in CPU_ONLY:
        metafunc.parametrize("device", params, indirect=True)
        return
    if module in KERNEL_TESTS:
        compiled, supported = _cpu_variants()
        params = [
            pytest.param(f"cpu-{isa}", id=f"cpu-{isa}",
                         marks=pytest.mark.skipif(isa not in supported,
                                                  reason=f"this CPU cannot run the {isa} kernels "
                                                         f"(it runs: {' '.join(sorted(supported))})"))
            for isa in compiled
        ]
    metafunc.parametrize("device", params + [_cuda_param()], indirect=True)


@pytest.fixture
def device(request, monkeypatch):
    """The device string to put tensors on; 'cpu-<isa>' runs the CPU kernels of that variant."""
    name = request.param
    if name.startswith("cpu-"):
        monkeypatch.setenv("ATTN_EXT_CPU_ISA", name[len("cpu-"):])
        return "cpu"
    return name
