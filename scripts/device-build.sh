#!/usr/bin/env bash
# On the GPU machine (no LLVM there): builds the runtime alone and runs its
# tests, GPU ones included. Needs .deps/ carried (scripts/device-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
LOOM_BUILD_DIR=${LOOM_BUILD_DIR:-build-device} scripts/build.sh -DLOOM_BUILD_COMPILER=OFF
B=${LOOM_BUILD_DIR:-build-device}
"$B/runtime/loom-devices"
cd "$B" && ctest --output-on-failure
