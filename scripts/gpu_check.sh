#!/usr/bin/env bash
# attn_ext's checks on a machine with an NVIDIA GPU, in one command:
#
#   1. what the build holds and which GPU runs it (python -m attn_ext info);
#   2. the whole test suite (CUDA variants included: they skip only without a GPU);
#   3. compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over
#      tests/test_kernel_selections.py: one small forward+backward call for every
#      kernel the CUDA build instantiates (tensor-core dtype x head dim x window x
#      short/long backward tiles; generic dtypes, masks, variants, dropout,
#      probabilities, packed batches);
#   then a summary table. Exit status 0 iff every step passed.
#
# The caller has built attn_ext (pip install --no-build-isolation --no-deps -e .);
# run from anywhere: scripts/gpu_check.sh
#
# Environment:
#   PYTHON            the interpreter with torch and attn_ext (default: python)
#   SANITIZER_TOOLS   compute-sanitizer tools to run (default: "memcheck racecheck synccheck initcheck")
#   SKIP_SUITE=1      skip step 2 (only the sanitizer runs)
#   STEP_TIMEOUT      seconds each sanitizer run may take (default 600)

set -u
set -o pipefail

cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python}
TOOLS=${SANITIZER_TOOLS:-memcheck racecheck synccheck initcheck}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
LOG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/attn_ext_gpu_check.XXXXXX")

declare -a SUMMARY=()
FAILED=0

say() { printf '\n=== %s\n' "$*"; }

# run_step NAME COMMAND...: runs COMMAND, logs its output to $LOG_DIR, records pass/fail and time.
run_step() {
  local name=$1
  shift
  local log="$LOG_DIR/${name//[^A-Za-z0-9_.-]/_}.log"
  say "$name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee "$log"
  local rc=$?
  local took=$((SECONDS - start))
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("$(printf '%-28s %-6s %5ss' "$name" PASS "$took")")
  else
    FAILED=$((FAILED + 1))
    SUMMARY+=("$(printf '%-28s %-6s %5ss  exit %s, log %s' "$name" FAIL "$took" "$rc" "$log")")
  fi
  return 0
}

# --- preconditions ------------------------------------------------------------
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: torch sees no CUDA device with $PYTHON (torch.cuda.is_available() is False, or torch is missing)" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import attn_ext' 2>"$LOG_DIR/import.log"; then
  echo "gpu_check: attn_ext does not import with $PYTHON; build it first with" >&2
  echo "  pip install --no-build-isolation --no-deps -e .   (see $LOG_DIR/import.log)" >&2
  cat "$LOG_DIR/import.log" >&2
  exit 2
fi
if ! "$PYTHON" -c 'import attn_ext._build as b, sys; sys.exit(0 if (b.built_for() or {}).get("cuda", "none") != "none" else 1)'; then
  echo "gpu_check: this attn_ext build has no CUDA kernels (built CPU-only: was nvcc found? ATTN_EXT_CPU_ONLY set?)" >&2
  exit 2
fi

run_step "info" "$PYTHON" -m attn_ext info
run_step "tensor-core routing" "$PYTHON" - <<'EOF'
# Which kernels typical calls take on this GPU (tensor_core_reason: "" = tensor cores).
import torch
import attn_ext  # noqa: F401
op = torch.ops.attn_ext.tensor_core_reason
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for E in (64, 80, 128):
        q = torch.randn(1, 2, 8, E, device="cuda", dtype=dtype)
        why = op(q, q, q)
        print(f"  {str(dtype):15s} E={E:<4d} {'tensor cores' if not why else 'generic: ' + why}")
EOF

# --- the whole suite ------------------------------------------------------------
if [ "${SKIP_SUITE:-0}" = "1" ]; then
  SUMMARY+=("$(printf '%-28s %-6s' "test suite" SKIPPED)")
else
  run_step "test suite" "$PYTHON" -m pytest -q -rs tests
fi

# --- compute-sanitizer on small CUDA cases --------------------------------------
SANITIZER=$(command -v compute-sanitizer || true)
for candidate in "${CUDA_HOME:-}" /usr/local/cuda; do
  if [ -z "$SANITIZER" ] && [ -n "$candidate" ] && [ -x "$candidate/bin/compute-sanitizer" ]; then
    SANITIZER="$candidate/bin/compute-sanitizer"
  fi
done

# Every kernel selection, each once, with small shapes (every kernel runs 10-1000x
# slower under the sanitizer): tests/test_kernel_selections.py lists them and
# checks that the tensor-core cases do run on the tensor cores.
SELECTIONS=(
  "tests/test_kernel_selections.py::-k cuda"
)

if [ -z "$SANITIZER" ]; then
  echo "gpu_check: compute-sanitizer not found (looked on PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin): sanitizer runs skipped" >&2
  SUMMARY+=("$(printf '%-28s %-6s' "compute-sanitizer" MISSING)")
  FAILED=$((FAILED + 1))
else
  for tool in $TOOLS; do
    for sel in "${SELECTIONS[@]}"; do
      file=${sel%%::*}
      kexpr=${sel#*::-k }
      # memcheck sees out-of-bounds accesses only at the edge of an allocation: no caching allocator.
      # --kernel-name kns=attn_ext: only our kernels (namespace attn_ext::cuda) are checked. The
      # tests also run PyTorch's SDPA as their error baseline, and racecheck reports hazards inside
      # its cuDNN kernels (seen on an H200 with torch 2.11) that are not ours to fix.
      run_step "$tool $(basename "$file" .py)" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        timeout "$STEP_TIMEOUT" "$SANITIZER" --tool "$tool" --kernel-name kns=attn_ext \
        --error-exitcode 99 --print-limit 20 \
        "$PYTHON" -m pytest -q -x -p no:cacheprovider "$file" -k "$kexpr"
    done
  done
fi

# --- summary ----------------------------------------------------------------------
say "summary (logs in $LOG_DIR)"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
if [ "$FAILED" -eq 0 ]; then
  echo "gpu_check: all steps passed"
  exit 0
fi
echo "gpu_check: $FAILED step(s) failed"
exit 1
