"""pytest configuration: every device-aware test runs on the CPU and, when present, CUDA."""

import pytest
import torch

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
