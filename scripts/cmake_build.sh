#!/usr/bin/env bash
# Builds attn_ext as a C++ library against the LibTorch of the active Python's
# torch (CMakeLists.txt: docs/building.md's cmake lines), runs its C++ tests
# with ctest, installs it into <build-dir>/install, then builds and runs
# examples/cpp, a program that finds it there with find_package(attn_ext).
#   scripts/cmake_build.sh [build-dir]      (default build/cmake)
# CMakeLists.txt finds the CUDA toolkit and nvrtc itself for a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build/cmake}
PYTHON=${PYTHON:-python}
JOBS=${MAX_JOBS:-2}
TORCH_PREFIX=$($PYTHON -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD_DIR" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX"
cmake --build "$BUILD_DIR" -j "$JOBS"
ctest --test-dir "$BUILD_DIR" --output-on-failure
PREFIX=$(realpath "$BUILD_DIR")/install
cmake --install "$BUILD_DIR" --prefix "$PREFIX"
cmake -S examples/cpp -B "$BUILD_DIR/example" -DCMAKE_PREFIX_PATH="$PREFIX;$TORCH_PREFIX"
cmake --build "$BUILD_DIR/example" -j "$JOBS"
"$BUILD_DIR/example/attention_example"
