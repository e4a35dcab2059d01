#!/usr/bin/env bash
# Builds attn_ext as a C++ library against the LibTorch of the active Python's
# torch (CMakeLists.txt), then runs its C++ test with ctest.
#   scripts/cmake_build.sh [build-dir]      (default build/cmake)
# A CUDA build of torch makes CMake look for the CUDA toolkit: it is taken
# from nvcc itself, and nvrtc from the pip package `nvidia` that torch brings.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build/cmake}
PYTHON=${PYTHON:-python}
args=(-DCMAKE_PREFIX_PATH="$($PYTHON -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')")
if [ "$($PYTHON -c 'import torch; print(torch.version.cuda or "")')" != "" ]; then
  export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0}
  if command -v nvcc >/dev/null; then
    top=$(nvcc --dryrun -x cu -c /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    [ -n "$top" ] && args+=(-DCUDA_TOOLKIT_ROOT_DIR="$(realpath "$top")" -DCUDAToolkit_ROOT="$(realpath "$top")")
  fi
  nvrtc=$($PYTHON - <<'PY'
import glob, os, torch
sp = os.path.dirname(os.path.dirname(torch.__file__))
print(next(iter(sorted(glob.glob(os.path.join(sp, "nvidia", "cu*", "lib", "libnvrtc.so*")))), ""))
PY
)
  [ -n "$nvrtc" ] && args+=(-DCUDA_nvrtc_LIBRARY="$nvrtc")
fi
cmake -S . -B "$BUILD_DIR" "${args[@]}"
cmake --build "$BUILD_DIR" -j "${MAX_JOBS:-2}"
ctest --test-dir "$BUILD_DIR" --output-on-failure
