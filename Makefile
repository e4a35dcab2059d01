# attn_ext: one command for each job; each sets up everything it needs on a
# fresh machine (Python 3.11): a virtual environment in .venv with torch
# 2.14.1, the build tools, and attn_ext built in place against that torch.
#
#   make demo    build, run a gradcheck + reference pass, then a short benchmark against SDPA
#   make test    build, run the test suite
#   make test-oldest   the CPU suite against the oldest torch attn_ext supports (OLDEST_TORCH_SPEC),
#                in its own virtual environment and a copy of the tracked files (CPU-only build)
#   make wheel   an sdist, then a wheel built from it (python -m build), into dist/: one
#                abi3 wheel for CPython >= 3.10, for the torch in .venv
#   make wheel-check   that wheel installed in a fresh virtual environment (WHEEL_VENV) with
#                TORCH_SPEC, outside the source tree: python -m attn_ext info, then check
#   make sanitize   the CPU kernels built with AddressSanitizer + UndefinedBehaviorSanitizer
#                (ATTN_EXT_SANITIZE=1) in a copy of the tracked files (SANITIZE_TREE), and
#                the CPU suite run under them (libasan preloaded); any report fails it
#   make ci      what CI runs (.ci/run): make test, make test-oldest, make wheel-check
#   make bench   the full CPU benchmark (the README's table)
#   make gpu     on a machine with an NVIDIA GPU and torch already installed (no
#                registry needed): build in place with CUDA, run the test suite on
#                CUDA plus compute-sanitizer, then the GPU benchmark against SDPA
#
# ATTN_EXT_CPU_ONLY=1 skips the CUDA sources, FORCE_CUDA=1 builds them without a GPU;
# MAX_JOBS and TORCH_CUDA_ARCH_LIST are honoured; ATTN_EXT_DEBUG_INFO=1 keeps -g.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
TRANSFORMERS_SPEC ?= transformers==5.24.0
PY := $(VENV)/bin/python
# The oldest torch attn_ext supports: the lent GPU machines' version.
OLDEST_TORCH_SPEC ?= torch==2.11.0
OLDEST_VENV ?= .venv-oldest
OLDEST_TREE ?= build-oldest
WHEEL_VENV ?= .venv-wheel
SANITIZE_TREE ?= build-sanitize
# The suite under the sanitizers, less the tests that start compilers (CMake, torch.compile's
# inductor) or other processes (the command line, torchrun, the examples).
SANITIZE_PYTEST ?= tests -q -x -k "not cuda" --ignore=tests/test_cpp.py --ignore=tests/test_build.py \
	--ignore=tests/test_compile.py --ignore=tests/test_cli.py --ignore=tests/test_distributed.py \
	--ignore=tests/test_examples.py
SOURCES := setup.py pyproject.toml $(shell find csrc -type f 2>/dev/null)

.PHONY: build demo test test-oldest wheel wheel-check sanitize ci bench gpu clean

$(VENV)/.deps:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH_SPEC) numpy pytest hypothesis ninja setuptools wheel build tqdm matplotlib $(TRANSFORMERS_SPEC)
	touch $@

# build: what PyTorch's conventions say (CUDA kernels where torch sees a GPU; setup.py).
# make test also compiles the CUDA kernels wherever nvcc is (FORCE_CUDA=1), so that CI
# compiles them on every run, GPU or not.
NVCC := $(shell command -v nvcc 2>/dev/null)
$(VENV)/.built: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

$(VENV)/.built-test: $(VENV)/.deps $(SOURCES)
	$(if $(NVCC),FORCE_CUDA=1) $(PY) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	touch $@

build: $(VENV)/.built

demo: build
	$(PY) -m attn_ext check
	$(PY) benchmarks/bench_cpu.py --quick

test: $(VENV)/.built-test
	$(PY) -m attn_ext info
	$(PY) -m pytest tests

$(OLDEST_VENV)/.deps:
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --disable-pip-version-check $(OLDEST_TORCH_SPEC) numpy pytest hypothesis ninja setuptools wheel
	touch $@

# A copy of the tracked files, so that its in-place build (against the other torch) never
# meets this tree's build/ or attn_ext/_C*.so.
test-oldest: $(OLDEST_VENV)/.deps
	rm -rf $(OLDEST_TREE) && mkdir -p $(OLDEST_TREE)
	git ls-files -z | xargs -0 cp --parents -t $(OLDEST_TREE)
	cd $(OLDEST_TREE) && ATTN_EXT_CPU_ONLY=1 $(CURDIR)/$(OLDEST_VENV)/bin/python setup.py -q build_ext --inplace
	cd $(OLDEST_TREE) && $(CURDIR)/$(OLDEST_VENV)/bin/python -m attn_ext info
	cd $(OLDEST_TREE) && $(CURDIR)/$(OLDEST_VENV)/bin/python -m pytest tests -q

# The sdist carries csrc/ (MANIFEST.in); python -m build builds the wheel from the unpacked
# sdist, so a file missing from the sdist fails here. --no-isolation: against .venv's torch.
wheel: $(VENV)/.deps
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .

# Run from outside the tree, so that Python imports the installed package, not ./attn_ext.
wheel-check: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check $(TORCH_SPEC) dist/attn_ext-*.whl
	cd $(WHEEL_VENV) && bin/python -m attn_ext info && bin/python -m attn_ext check

# Python itself is not instrumented: libasan (and libubsan) are preloaded, leaks are not
# checked (the interpreter's own are reported at exit), and torch's operator new/delete
# pairs across libraries are not flagged.
sanitize: $(VENV)/.deps
	rm -rf $(SANITIZE_TREE) && mkdir -p $(SANITIZE_TREE)
	git ls-files -z | xargs -0 cp --parents -t $(SANITIZE_TREE)
	cd $(SANITIZE_TREE) && ATTN_EXT_CPU_ONLY=1 ATTN_EXT_SANITIZE=1 $(CURDIR)/$(PY) setup.py -q build_ext --inplace
	cd $(SANITIZE_TREE) && \
	  LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(CURDIR)/$(PY) -m pytest $(SANITIZE_PYTEST)

ci: test test-oldest wheel-check

bench: build
	$(PY) benchmarks/bench_cpu.py --dtype float32,bfloat16

gpu:
	$(PYTHON) setup.py build_ext --inplace
	PYTHON=$(PYTHON) PYTHONPATH=$(CURDIR) scripts/gpu_check.sh
	PYTHONPATH=$(CURDIR) $(PYTHON) benchmarks/bench_gpu.py --markdown --json benchmarks/results/gpu.json

clean:
	rm -rf build dist attn_ext/_C*.so attn_ext/_build_info.py *.egg-info $(VENV)/.built $(VENV)/.built-test $(OLDEST_TREE) $(WHEEL_VENV) $(SANITIZE_TREE)
