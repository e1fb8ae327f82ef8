#!/usr/bin/env bash
# On a GPU machine with 2 GPUs (issue #18): what holds GPT-2 350M's multi-GPU plans back.
# - the SM clock and power while one GPU, dp2 and tp2 sp train (nvidia-smi): is dp2's slower
#   backward the GPU's clock or NCCL's kernels beside it?
# - dp2 and ZeRO-1 with NCCL's CTAs capped (NCCL_MAX_CTAS, NCCL_CTA_POLICY=1), dp2 under one
#   NCCL protocol (NCCL_PROTO);
# - tp2 sp and ZeRO-1 with their buffers as symmetric NCCL windows (the default) and without
#   (LOOM_NCCL_WINDOWS=0), dp2 with them (LOOM_NCCL_WINDOWS=dp);
# - tp2 and tp2 sp with and without --tp-overlap (loom-split-tensor-reduce, and under sp
#   loom-overlap-tensor-gather; the losses beside the times), tp2 sp with more or fewer channels;
# - pp2 at 4 and 8 microbatches, captured (the default) and eager (LOOM_CUDA_GRAPHS_P2P=0), beside one GPU
#   accumulating the same microbatches.
# Needs .deps (scripts/device-deps.sh, then MODELS=gpt2-350m scripts/device-bundles.sh plans;
# carry only the bundles it runs if the tree and the carry pass 64 MiB). Two rounds each.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF -DLOOM_BUILD_TESTS=OFF 2>&1 | tail -1
B=build-device/runtime; R=.deps/bundles
OUT=${OUT:-/tmp}
run() { # label bundle env...
  local label=$1 n=$2; shift 2
  env "$@" timeout 60 $B/loom-run $R/gpt2-350m-$n.loom --backend cuda --steps 13 > $OUT/x.log 2>&1 || { echo "FAILED $label"; tail -2 $OUT/x.log; return; }
  echo "  $label: $(grep -o '^trained: [0-9.]* ms per step' $OUT/x.log); $(grep -o 'step 13/13  loss [0-9.]*' $OUT/x.log)"
}
clocks() { # label bundle
  nvidia-smi --query-gpu=index,clocks.sm,power.draw,temperature.gpu --format=csv,noheader,nounits -lms 100 > $OUT/smi.csv &
  local pid=$!
  run "$@"
  kill $pid; wait $pid 2>/dev/null
  python3 - $OUT/smi.csv "$1" <<'PY'
import sys
rows = [l.split(',') for l in open(sys.argv[1]) if l.count(',') == 3]
for g in ('0', '1'):
    r = [(float(c), float(p), float(t)) for i, c, p, t in rows if i.strip() == g and float(p) > 200]
    if r:
        c = sorted(x[0] for x in r); p = sorted(x[1] for x in r)
        print(f"    {sys.argv[2]} GPU {g}: {len(r)} busy samples, SM clock median {c[len(c)//2]:.0f} MHz (min {c[0]:.0f}), power median {p[len(p)//2]:.0f} W (max {p[-1]:.0f}), temp max {max(x[2] for x in r):.0f} C")
PY
}
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
echo "== clocks"
clocks one plan-one
clocks dp2 plan-dp-2_mb-1_zero-0
clocks tp2sp plan-tp-2_mb-1_zero-0_sp-1
echo "== NCCL channels (NCCL_DEBUG=INFO), tp2 sp"
NCCL_DEBUG=INFO timeout 60 $B/loom-run $R/gpt2-350m-plan-tp-2_mb-1_zero-0_sp-1.loom --backend cuda --steps 2 2>&1 | grep -E "Channel [0-9]+/|nChannels|NCCL version|CTA|P2P" | sort | uniq -c | sort -rn | head -12
echo "== dp2 and ZeRO-1 with NCCL's CTAs capped"
for round in 1 2; do
  run "dp2 default" plan-dp-2_mb-1_zero-0
  for c in 4 16; do run "dp2 max_ctas=$c" plan-dp-2_mb-1_zero-0 NCCL_MIN_CTAS=1 NCCL_MAX_CTAS=$c; done
  run "dp2 cta_policy=1" plan-dp-2_mb-1_zero-0 NCCL_CTA_POLICY=1
  for proto in Simple LL128; do run "dp2 NCCL_PROTO=$proto" plan-dp-2_mb-1_zero-0 NCCL_PROTO=$proto; done
  run "zero1 default" plan-dp-2_mb-1_zero-1
  for c in 8; do run "zero1 max_ctas=$c" plan-dp-2_mb-1_zero-1 NCCL_MIN_CTAS=1 NCCL_MAX_CTAS=$c; done
  run "one" plan-one
done
echo "== symmetric NCCL windows (the default for tensor-parallel and ZeRO ranks) against cudaMalloc"
for round in 1 2; do
  run "tp2sp (windows)" plan-tp-2_mb-1_zero-0_sp-1
  run "tp2sp LOOM_NCCL_WINDOWS=0" plan-tp-2_mb-1_zero-0_sp-1 LOOM_NCCL_WINDOWS=0
  run "zero1 (windows)" plan-dp-2_mb-1_zero-1
  run "zero1 LOOM_NCCL_WINDOWS=0" plan-dp-2_mb-1_zero-1 LOOM_NCCL_WINDOWS=0
  run "dp2 (no windows)" plan-dp-2_mb-1_zero-0
  run "dp2 LOOM_NCCL_WINDOWS=dp" plan-dp-2_mb-1_zero-0 LOOM_NCCL_WINDOWS=dp
done
echo "== tp2 sp: gathers beside the products (loom-overlap-tensor-gather) or not; more channels"
for round in 1 2; do
  run "tp2sp default" plan-tp-2_mb-1_zero-0_sp-1
  run "tp2sp --tp-overlap" alt-tp-2_sp_tp-overlap
  run "tp2 (no sp)" plan-tp-2_mb-1_zero-0
  run "tp2 (no sp) --tp-overlap" alt-tp-2_tp-overlap
  for c in 32; do run "tp2sp min_ctas=$c" plan-tp-2_mb-1_zero-0_sp-1 NCCL_MIN_CTAS=$c NCCL_MAX_CTAS=32; done
  run "tp2sp max_ctas=8" plan-tp-2_mb-1_zero-0_sp-1 NCCL_MIN_CTAS=1 NCCL_MAX_CTAS=8
done
echo "== pipelines at 4 microbatches"
for round in 1 2; do
  for n in plan-pp-2_mb-4_schedule-1f1b_zero-0 plan-pp-2_mb-4_schedule-zb-h1_zero-0 plan-pp-2_vpp-2_mb-4_schedule-interleaved_zero-0 base-mb4; do run "$n" $n; done
  for n in plan-pp-2_mb-4_schedule-1f1b_zero-0 plan-pp-2_mb-4_schedule-zb-h1_zero-0 plan-pp-2_vpp-2_mb-4_schedule-interleaved_zero-0 plan-pp-2_mb-8_schedule-zb-h1_zero-0; do run "$n eager sends" $n LOOM_CUDA_GRAPHS_P2P=0; done
  run "pp zb-h1 mb8 captured" plan-pp-2_mb-8_schedule-zb-h1_zero-0
  run "one GPU mb8" base-mb8
done
