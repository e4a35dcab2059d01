"""The build itself: what the library reports of itself and how a mismatched build is explained."""

import torch

from attn_ext import _build


def test_library_runs_cpu_kernels_in_parallel():
    # at::parallel_for is inline in the kernels: built without OpenMP they silently run on one thread.
    assert _build.library_info()["openmp"] == "yes"


def test_library_reports_the_torch_it_was_built_for():
    info = _build.library_info()
    assert info["torch"] == torch.__version__ == _build.built_for()["torch"]
    assert "DEFAULT" in info["cpu_isas"].split()
    assert info["cpu_isa_active"] in info["cpu_isas"].split()


def test_mismatched_torch_raises_one_clear_sentence(monkeypatch):
    monkeypatch.setattr(_build, "built_for", lambda: {"torch": "0.0.1"})
    try:
        _build.load_library()
    except ImportError as e:
        msg = str(e)
    else:
        raise AssertionError("a build for torch 0.0.1 was loaded under torch " + torch.__version__)
    assert "built for torch 0.0.1" in msg and torch.__version__ in msg and "pip install" in msg
