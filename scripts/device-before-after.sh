#!/usr/bin/env bash
# On the GPU machine: the step time of GPT-2 350M (bf16, --target cuda) with
# the runtime of this tree against the runtime of an earlier commit, built
# side by side and timed alternately in the same call.
# Here, first: scripts/device-bundles.sh single, and
#   mkdir -p .deps/before && git archive BASE CMakeLists.txt runtime test/unit \
#     test/CMakeLists.txt bench scripts models | tar -x -C .deps/before
#   (cd .deps/before && mkdir -p .deps && for d in include googletest cudnn-frontend; do
#      ln -sf ../../$d .deps/$d; done)
# then carry .deps and run this after scripts/device-build.sh (or device-test.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
(cd .deps/before && LOOM_BUILD_DIR=build-before scripts/build.sh -DLOOM_BUILD_COMPILER=OFF > /tmp/before-build.log 2>&1) ||
  { tail -20 /tmp/before-build.log; exit 1; }
R=.deps/bundles/gpt2-350m-bf16-fused-train.loom
for round in 1 2 3; do
  for side in after before; do
    run=build-device/runtime/loom-run
    [ $side = before ] && run=.deps/before/build-before/runtime/loom-run
    echo "$side (round $round): $($run $R --backend cuda --steps 13 2>&1 | tail -1)"
  done
done
