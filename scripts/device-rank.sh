#!/usr/bin/env bash
# On a GPU machine with one GPU (issue #18): what a tensor-parallel rank's own
# work costs, with and without sequence parallelism. Each tp2 bundle's rank 0
# runs alone on GPU 0 (LOOM_MEASURE_ONE_RANK=0: its collectives become local
# copies, so its losses mean nothing), beside one GPU at the same global
# batch; ROUNDS alternates them. Needs .deps (scripts/device-deps.sh, then
# scripts/device-bundles.sh rank).
set -uo pipefail
cd "$(dirname "$0")/.."
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF -DLOOM_BUILD_TESTS=OFF 2>&1 | tail -1
B=build-device/runtime
R=.deps/bundles
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
status=0
for m in ${MODELS:-gpt2-350m gpt-1.3b}; do
  [ -d "$R/$m-rank-one.loom" ] || { echo "no $R/$m-rank-one.loom: run scripts/device-bundles.sh rank"; exit 1; }
  echo "== $m, bf16, batch 16, 13 steps (the mean of 10 after 3 warm-up)"
  for round in $(seq 1 ${ROUNDS:-2}); do
    for b in one tp2 tp2-sp; do
      env=(); [ "$b" = one ] || env=(LOOM_MEASURE_ONE_RANK=0)
      log="$out/$m-rank-$b-$round.log"
      env "${env[@]}" timeout 300 $B/loom-run "$R/$m-rank-$b.loom" --backend cuda --steps 13 > "$log" 2>&1 ||
        { echo "FAILED: $m $b"; tail -3 "$log"; status=1; continue; }
      echo "  $b (round $round): $(grep -o '^trained: [0-9.]* ms per step' "$log" | head -1), $(grep -o 'arena [0-9.]* MiB (activations [0-9.]* MiB)' "$log" | head -1)"
    done
  done
done
exit $status
