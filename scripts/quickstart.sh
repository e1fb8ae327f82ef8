#!/usr/bin/env bash
# The main job on its embedded default: installs what is missing, builds, then
# writes a small GPT with `loomc models`, verifies it and prints its summary,
# compiles it and runs its forward pass on the CPU backend, plans GPT-2 350M for
# a node of 8 H100s (plan.json, plan.svg), trains the small GPT for 40 steps on
# the CPU backend with checkpoints, trains it again split over two CPU ranks
# (tensor parallelism, same losses), and lists the GPUs the runtime can use
# (where there is one, it trains the small GPT there too, with --target cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
B=${LOOM_BUILD_DIR:-build}
mkdir -p "$B/quickstart"
model="$B/quickstart/gpt-small.mlir"
"$B/compiler/loomc" models gpt --layers 4 --hidden 256 --heads 4 --seq 128 --vocab 512 -o "$model"
echo "== wrote $model"
"$B/compiler/loomc" verify "$model"
for m in models/*.mlir; do "$B/compiler/loomc" verify "$m" | head -3; done
echo "== compile and run the forward pass on the CPU backend"
"$B/compiler/loomc" compile "$model" --batch 4 -o "$B/quickstart/gpt-small.loom"
"$B/runtime/loom-run" "$B/quickstart/gpt-small.loom" --steps 5
echo "== plan it for a node of 8 H100s, and draw the schedule"
"$B/compiler/loomc" plan models/gpt2-350m.mlir --cluster h100:8 --batch 64 --json "$B/quickstart/plan.json"
"$B/compiler/loomc" inspect "$B/quickstart/plan.json" --svg "$B/quickstart/plan.svg"
echo "== train it on the CPU backend: a token file with a repeating pattern, loss should fall"
python3 -c "import struct,sys; ids=[(i % 16) + 1 for i in range(20000)]; open(sys.argv[1],'wb').write(struct.pack('<%dH' % len(ids), *ids))" "$B/quickstart/tokens.bin"
"$B/compiler/loomc" compile "$model" --train --batch 4 --lr 1e-3 --warmup 10 --total-steps 40 -o "$B/quickstart/gpt-small-train.loom"
"$B/runtime/loom-run" "$B/quickstart/gpt-small-train.loom" --steps 40 --data "$B/quickstart/tokens.bin" \
  --save-every 20 --checkpoint "$B/quickstart/checkpoint" | awk 'NR <= 3 || /step (10|20|30|40)\// || /saved|trained/' 
echo "== the same training split over 2 CPU ranks by tensor parallelism: the losses of one device"
"$B/compiler/loomc" compile "$model" --train --batch 4 --lr 1e-3 --warmup 10 --total-steps 40 \
  --cluster cpu:2 --force tp=2,mb=1 -o "$B/quickstart/gpt-small-tp2.loom"
"$B/compiler/loomc" inspect "$B/quickstart/gpt-small-tp2.loom" | sed -n '3,6p'
"$B/runtime/loom-run" "$B/quickstart/gpt-small-tp2.loom" --steps 10 --data "$B/quickstart/tokens.bin" \
  | awk 'NR == 1 || /step 10\//'
if [ -x "$B/runtime/loom-devices" ]; then
  if "$B/runtime/loom-devices"; then
    echo "== a GPU is here: the same training on it, compiled for CUDA (bf16, fused kernels)"
    "$B/compiler/loomc" compile "$model" --train --batch 4 --lr 1e-3 --warmup 10 --total-steps 40 \
      --target cuda -o "$B/quickstart/gpt-small-cuda.loom"
    "$B/runtime/loom-run" "$B/quickstart/gpt-small-cuda.loom" --backend cuda --steps 40 \
      --data "$B/quickstart/tokens.bin" | awk 'NR <= 3 || /step (10|20|30|40)\// || /trained/'
  else
    echo "(no GPU here: the CPU backend is the reference)"
  fi
fi
