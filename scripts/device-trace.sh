#!/usr/bin/env bash
# On a GPU machine with 2 GPUs: builds the runtime, then writes and checks the
# timelines (loom-run --trace) of a training step on one GPU and of dp2 and
# pp2 steps over NCCL (bundles: scripts/device-bundles.sh trace). The traces
# go to $OUT (default /tmp) for docs/images (scripts/trace-svg.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
out=${OUT:-/tmp}
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF > "$out/build.log" 2>&1 ||
  { tail -30 "$out/build.log"; exit 1; }
B=build-device/runtime
R=.deps/bundles
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
status=0
for name in gpt-tiny-one gpt-tiny-dp2 gpt-tiny-pp2 gpt2-350m-bf16-dp2 gpt2-350m-bf16-pp2; do
  steps=${STEPS:-4}
  if ! timeout 300 $B/loom-run "$R/$name.loom" --backend cuda --steps "$steps" --trace "$out/$name.json" \
      > "$out/$name.log" 2>&1; then
    echo "FAILED: $name"; tail -5 "$out/$name.log"; status=1; continue
  fi
  grep -E "trained|wrote" "$out/$name.log"
  python3 test/runtime/Inputs/check_trace.py "$out/$name.json" "$R/$name.loom" "$steps" compute || status=1
done
# The same steps without --trace: what tracing costs (graphs off, events on).
for name in gpt2-350m-bf16-dp2 gpt2-350m-bf16-pp2; do
  timeout 300 $B/loom-run "$R/$name.loom" --backend cuda --steps 8 2>&1 | grep trained | sed "s/^/$name untraced: /"
done
exit $status
