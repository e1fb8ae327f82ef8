#!/usr/bin/env bash
# On the GPU machine: Hugging Face checkpoints imported by loomc against
# transformers (which the GPU machine has): logits of f32 bundles on the CUDA
# backend with full-f32 products (LOOM_CUDA_TF32=0) and of --target cuda (bf16)
# bundles, and 32 greedily generated tokens (scripts/hf-compare.py check).
# Prepare here first (needs torch and transformers; writes a few MiB):
#   python3 scripts/hf-compare.py prepare .deps/import
# then run this with .deps carried.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d .deps/import ] || { echo "no .deps/import: run 'python3 scripts/hf-compare.py prepare .deps/import' first"; exit 1; }
export NCCL_NVLS_ENABLE=0
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF > /tmp/device-build.log 2>&1 || { tail -25 /tmp/device-build.log; exit 1; }
B=build-device/runtime
status=0
echo "== CPU backend (the same bundles)"
python3 scripts/hf-compare.py check .deps/import --backend cpu --loom-run $B/loom-run || status=1
echo "== CUDA backend"
LOOM_CUDA_TF32=0 python3 scripts/hf-compare.py check .deps/import --backend cuda --loom-run $B/loom-run || status=1
exit $status
