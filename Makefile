# attn_ext: one command for each job; each sets up everything it needs on a
# fresh machine (Python 3.11): a virtual environment in .venv with torch
# 2.14.1, the build tools, and attn_ext built in place against that torch.
#
#   make demo    build, run a gradcheck + reference pass, then a short benchmark against SDPA
#   make test    build, run the test suite
#   make bench   the full CPU benchmark (the README's table)
#   make gpu     on a machine with an NVIDIA GPU and torch already installed (no
#                registry needed): build in place with CUDA, run the test suite on
#                CUDA plus compute-sanitizer, then the GPU benchmark against SDPA
#
# ATTN_EXT_CPU_ONLY=1 skips the CUDA sources; MAX_JOBS and TORCH_CUDA_ARCH_LIST are honoured.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
TRANSFORMERS_SPEC ?= transformers==5.24.0
PY := $(VENV)/bin/python
SOURCES := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)

.PHONY: build demo test bench gpu clean

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC) numpy pytest ninja setuptools wheel tqdm matplotlib $(TRANSFORMERS_SPEC)
	touch $@

$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

demo: build
	$(PY) -m attn_ext check
	$(PY) benchmarks/bench_cpu.py --quick

test: build
	$(PY) -m pytest tests

bench: build
	$(PY) benchmarks/bench_cpu.py --dtype float32,bfloat16

gpu:
	$(PYTHON) setup.py build_ext --inplace
	PYTHON=$(PYTHON) PYTHONPATH=$(CURDIR) scripts/gpu_check.sh
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_gpu.py --markdown --json benchmarks/results/gpu.json

clean:
	rm -rf build attn_ext/_C*.so attn_ext/_build_info.py *.egg-info $(VENV)/.built
