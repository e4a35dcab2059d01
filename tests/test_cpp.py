"""The C++ library (CMakeLists.txt) and its C++ tests, built against LibTorch, run through
ctest, installed, and used by a program that finds it with find_package(attn_ext).

scripts/cmake_build.sh runs docs/building.md's cmake lines as written (with a CUDA build of
torch, CMakeLists.txt finds the toolkit and builds the CUDA kernels too): it builds
libattn_ext and tests/cpp/test_attention.cpp (which calls the operators through
<attn_ext/attn_ext.h> and checks them against plain ATen math) and, on x86-64,
tests/cpp/test_amx_bf16.cpp (the AMX tile primitives), runs ctest, installs the
library, then builds and runs examples/cpp against the installed package. The build
directory is build/cmake-pytest, kept between runs (incremental).
"""

import os
import shutil
import subprocess
import sys

import pytest

import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cmake_library_builds_and_ctest_passes():
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "cmake_build.sh"),
                           os.path.join(ROOT, "build", "cmake-pytest")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"cmake build or ctest failed:\n{log[-4000:]}"
    assert "100% tests passed" in log, log[-2000:]
    assert "rel err vs ATen math" in log, log[-2000:]  # examples/cpp ran against the installed package
    if os.uname().machine in ("x86_64", "AMD64"):
        assert "test_amx_bf16" in log, log[-2000:]  # the AMX tile primitives ran (or said why not)
    if helpers.CAN_READ_X86_CODE:  # CMake's link order too keeps the narrowest unit's shared code
        problems = helpers.code_wider_than_its_callers(os.path.join(ROOT, "build", "cmake-pytest", "libattn_ext.so"))
        assert not problems, "\n".join(problems)[:6000]
