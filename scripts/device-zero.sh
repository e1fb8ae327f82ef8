#!/usr/bin/env bash
# On a GPU machine with one GPU (issue #18): what each ZeRO stage costs a
# data-parallel rank besides its transfers, and the GPU memory it holds.
# Rank 0 of each dp2 bundle runs alone on GPU 0 (LOOM_MEASURE_ONE_RANK=0: its
# collectives become local copies, so its losses mean nothing), beside one
# GPU at the same batch a rank. Needs .deps (scripts/device-deps.sh, then
# scripts/device-bundles.sh zero).
set -uo pipefail
cd "$(dirname "$0")/.."
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF -DLOOM_BUILD_TESTS=OFF 2>&1 | tail -1
B=build-device/runtime
R=.deps/bundles
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
status=0
run() { # name, steps, env...
  local name=$1 steps=$2
  shift 2
  local log="$out/$name.log"
  env "$@" timeout 300 $B/loom-run "$R/$name.loom" --backend cuda --steps "$steps" > "$log" 2>&1 ||
    { echo "FAILED: $name"; tail -3 "$log"; status=1; return; }
  echo "  $name: $(grep -o '^trained: [0-9.]* ms per step' "$log" | head -1); $(grep -o 'GPU 0: .*' "$log" | head -1)"
}
echo "== GPT-2 350M, bf16, 8 sequences a rank, 13 steps (the mean of 10 after 3 warm-up)"
for round in $(seq 1 ${ROUNDS:-2}); do
  run gpt2-350m-zero-one 13
  for z in 0 1 2 3; do run gpt2-350m-zero-z$z 13 LOOM_MEASURE_ONE_RANK=0; done
done
echo "== Llama 1.1B, bf16, one sequence a rank, every layer recomputed, 8 steps"
for z in 1 2 3; do
  run llama-1.1b-zero-z$z 8 LOOM_MEASURE_ONE_RANK=0
  sed 's/^/      planner: /' "$R/llama-1.1b-zero-z$z.plan.txt"
done
exit $status
