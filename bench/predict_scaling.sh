#!/usr/bin/env bash
# The planner's predicted step time for each plan measured by
# scripts/device-multigpu.sh and scripts/device-scale.sh (H200 cards, f32
# storage with TF32 GEMMs and materialised attention, as the CUDA backend runs
# today), calibrated by the runtime's measured profile.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${LOOM_BUILD_DIR:-build}
prof=${PROFILE:-bench/data/calibration-h200-4gpu.json}
"$B/compiler/loomc" models gpt --layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 \
    -o /tmp/gpt-1.3b.mlir
predict() { # model devices force
  f=models/$1.mlir; [ "$1" = gpt-1.3b ] && f=/tmp/gpt-1.3b.mlir
  "$B/compiler/loomc" plan $f --cluster h200:$2 --batch 8 --profile $prof \
      --materialized-attention ${3:+--force $3} | sed -n 's/^  predicted step *\([0-9.]*\) ms.*/\1/p'
}
for row in "gpt2-350m 1 dp=1" "gpt2-350m 2 dp=2,mb=4,zero=0" "gpt2-350m 2 tp=2,mb=1,zero=0" \
           "gpt2-350m 2 pp=2,mb=4,schedule=1f1b,zero=0" "gpt2-350m 4 dp=4,mb=1,zero=0" \
           "gpt2-350m 4 tp=4,mb=1,zero=0" "gpt2-350m 4 pp=4,mb=8,schedule=1f1b,zero=0" \
           "gpt2-350m 4 dp=2,tp=2,mb=1,zero=0" "gpt2-350m 4 tp=2,pp=2,mb=4,schedule=1f1b,zero=0" \
           "gpt2-350m 4 dp=2,pp=2,vpp=2,mb=4,schedule=interleaved,zero=0" "gpt2-350m 4 dp=4,mb=2,zero=1" \
           "gpt-1.3b 1 dp=1" "gpt-1.3b 4 dp=4,mb=1,zero=0" "gpt-1.3b 4 tp=4,mb=1,zero=0" \
           "gpt-1.3b 4 tp=2,pp=2,mb=4,schedule=1f1b,zero=0" "gpt-1.3b 4 dp=4,mb=2,zero=1" \
           "gpt2-350m 4 " "gpt-1.3b 4 "; do
  set -- $row
  printf '%-10s %d GPU(s) %-50s predicted %s ms\n' "$1" "$2" "${3:-(the planner picks)}" "$(predict "$1" "$2" "${3:-}")"
done
