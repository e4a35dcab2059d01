#!/usr/bin/env bash
# attn_ext on a GPU lent for a few minutes: build, check and time in one call.
#
# What `make gpu` does in full (scripts/gpu_check.sh, the whole benchmark grid)
# takes longer than a short lease; this script runs the steps that matter in a
# fixed order, each under its own time limit, and leaves every log and result
# in $OUT (the folder the lease sends back; a temporary one otherwise):
#
#   build      python setup.py build_ext --inplace, for this GPU's architecture only
#   tests      the CUDA tests (pytest -k cuda, 8 workers)
#   memcheck, racecheck, synccheck, initcheck
#              that compute-sanitizer tool (our kernels only) over tests/test_kernel_selections.py:
#              one small forward+backward call for every kernel selection
#   backward   benchmarks/bench_gpu_backward.py (a dozen bf16 shapes, ~30 s);
#              with BASELINE=DIR also the tree in DIR (built here first), in the same session
#   decode     python -m attn_ext bench --decode --device cuda: decoding steps against SDPA
#              (issue 13's shapes and the grid of cache lengths, bfloat16 and float32; split-KV)
#   transformers  benchmarks/bench_transformers.py --device cuda: a tiny Llama's training step, prefill and
#              generation (dynamic, static and compiled static cache) against "sdpa", bfloat16 and float32
#   grid       benchmarks/bench_gpu.py, the whole grid, --json $OUT/gpu.json (its JSON is
#              written after every case, so a grid cut short keeps what it measured)
#   profile    Nsight Compute (ncu: $NCU, the PATH's or CUDA's) on the bf16 backward's main kernel, ours and
#              flash's (benchmarks/profile_gpu_backward.py): opcode counts by name, pipes,
#              stalls, source counters; about 25 s each on an H200
#
# Measured on an H100 (2026-11-26): build 72-84 s with 16 jobs, tests 65 s,
# memcheck 15 s, backward 25 s per tree, grid about 4 minutes at 0.1 s per measurement.
#
# Usage, from the repository root:  scripts/gpu_lease.sh [STEP ...]   (default: build tests backward)
# Environment:
#   PYTHON      the interpreter with torch (default python3)
#   OUT         where logs and results go (default: a new temporary folder)
#   COMMIT      the commit being measured, recorded in the grid's JSON
#   BASELINE    a copy of another tree (e.g. `git archive HEAD~1 | tar -x -C DIR`) to time beside this one
#   *_TIMEOUT   seconds per step: BUILD_TIMEOUT 300, TESTS_TIMEOUT 200, SANITIZER_TIMEOUT 180 (each tool),
#               BACKWARD_TIMEOUT 120, DECODE_TIMEOUT 120 (each of two), TRANSFORMERS_TIMEOUT 240,
#               GRID_TIMEOUT 300, PROFILE_TIMEOUT 90

set -u
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/attn_ext_gpu_lease.XXXXXX")}
mkdir -p "$OUT"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(build tests backward)
T0=$SECONDS
declare -a SUMMARY=()

step() {  # step NAME TIMEOUT COMMAND...: runs COMMAND with its output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-10s rc=%-3s %4ss  (at %ss) %s' "$name" "$rc" "$((SECONDS - start))" "$((SECONDS - T0))" \
    "$([ "$rc" -eq 124 ] && echo 'stopped at its time limit')")")
  tail -n 3 "$OUT/$name.log"
  return $rc
}

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_lease: torch sees no CUDA device with $PYTHON" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader 2>/dev/null
ARCH=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$ARCH} PYTHONUNBUFFERED=1

for s in "${STEPS[@]}"; do
  case $s in
    build)
      step build "${BUILD_TIMEOUT:-300}" env MAX_JOBS=${MAX_JOBS:-16} "$PYTHON" setup.py build_ext --inplace || break
      if [ -n "${BASELINE:-}" ]; then
        (cd "$BASELINE" && MAX_JOBS=${MAX_JOBS:-16} timeout "${BUILD_TIMEOUT:-300}" "$PYTHON" setup.py build_ext --inplace \
          >"$OUT/build_baseline.log" 2>&1) || echo "gpu_lease: the baseline did not build (see $OUT/build_baseline.log)"
      fi
      ;;
    tests)
      step tests "${TESTS_TIMEOUT:-200}" env PYTHONPATH="$PWD" "$PYTHON" -m pytest -q -n 8 -rfEs -k cuda -p no:cacheprovider tests
      grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
      ;;
    memcheck | racecheck | synccheck | initcheck)
      step "$s" "${SANITIZER_TIMEOUT:-180}" env PYTHONPATH="$PWD" PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        compute-sanitizer --tool "$s" --kernel-name kns=attn_ext --error-exitcode 99 --print-limit 10 \
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernel_selections.py -k cuda
      ;;
    backward)
      step backward "${BACKWARD_TIMEOUT:-120}" env PYTHONPATH="$PWD" "$PYTHON" benchmarks/bench_gpu_backward.py \
        "this tree ${COMMIT:-}"
      if [ -n "${BASELINE:-}" ]; then
        step backward_baseline "${BACKWARD_TIMEOUT:-120}" env PYTHONPATH="$BASELINE" "$PYTHON" \
          benchmarks/bench_gpu_backward.py "baseline $BASELINE"
      fi
      ;;
    decode)
      step decode "${DECODE_TIMEOUT:-120}" env PYTHONPATH="$PWD" "$PYTHON" -m attn_ext bench --decode --device cuda \
        --dtype bfloat16,float32 --targets --rounds 5 --json "$OUT/decode_targets.json"
      step decode_grid "${DECODE_TIMEOUT:-120}" env PYTHONPATH="$PWD" "$PYTHON" -m attn_ext bench --decode --device cuda \
        --dtype bfloat16 --rounds 5 --json "$OUT/decode_grid.json"
      ;;
    transformers)
      step transformers "${TRANSFORMERS_TIMEOUT:-240}" env PYTHONPATH="$PWD" "$PYTHON" benchmarks/bench_transformers.py \
        --device cuda --dtype bfloat16,float32 --min-run-time 1 --json "$OUT/transformers.json"
      ;;
    grid)
      step grid "${GRID_TIMEOUT:-300}" env PYTHONPATH="$PWD" "$PYTHON" benchmarks/bench_gpu.py --min-run-time 0.1 \
        --markdown --commit "${COMMIT:-}" --json "$OUT/gpu.json"
      [ -f "$OUT/gpu.json" ] && env PYTHONPATH="$PWD" "$PYTHON" benchmarks/bench_gpu.py --report "$OUT/gpu.json"
      ;;
    profile)
      # Nsight Compute on the bf16 backward's main kernel, ours and flash's: every SASS
      # opcode's count by name, the pipes, the stall reasons and the source counters.
      NCU_ARGS=(--section InstructionStats --section WarpStateStats --section SourceCounters --print-details all
                --metrics sass__inst_executed_per_opcode,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_lsu.sum,smsp__inst_executed_pipe_tensor.sum,smsp__inst_executed_pipe_uniform.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_global_red.sum
                --print-metric-instances details --launch-skip 1 --launch-count 1)
      NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
      step profile_ours "${PROFILE_TIMEOUT:-90}" env PYTHONPATH="$PWD" "$NCU" "${NCU_ARGS[@]}" --kernel-name-base demangled \
        --kernel-name regex:attention_bwd_tc "$PYTHON" benchmarks/profile_gpu_backward.py ours
      step profile_flash "${PROFILE_TIMEOUT:-90}" env PYTHONPATH="$PWD" "$NCU" "${NCU_ARGS[@]}" \
        --kernel-name regex:flash_bwd_dq_dk_dv "$PYTHON" benchmarks/profile_gpu_backward.py flash
      ;;
    *)
      echo "gpu_lease: unknown step '$s' (build, tests, memcheck, backward, decode, transformers, grid, profile)" >&2
      exit 2
      ;;
  esac
done

echo
echo "gpu_lease: logs and results in $OUT"
for line in "${SUMMARY[@]}"; do echo "  $line"; done
