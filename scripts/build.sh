#!/usr/bin/env bash
# Configures and builds Loom in build/ (Release, Ninja, ccache when present).
# Extra arguments go to CMake, e.g. scripts/build.sh -DLOOM_BUILD_COMPILER=OFF
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${LOOM_BUILD_DIR:-build}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# Configure when there is no finished configuration (a failed one leaves a
# cache but no build files).
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ] || { [ ! -f "$BUILD_DIR/build.ninja" ] && [ ! -f "$BUILD_DIR/Makefile" ]; }; then
  cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
elif [ $# -gt 0 ]; then
  cmake -S . -B "$BUILD_DIR" "$@"
fi
cmake --build "$BUILD_DIR" --parallel "${LOOM_JOBS:-$(nproc)}"
