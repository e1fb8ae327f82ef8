#!/usr/bin/env bash
# On a 4-GPU machine (issue #7): GPT-2 350M and GPT 1.3B training with the plan
# the planner picks for 4 GPUs and with forced plans, against one GPU, and
# PyTorch DDP and FSDP2 on the same models and cards. Needs .deps from
# scripts/device-deps.sh and scripts/device-bundles.sh scale.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF 2>&1 | tail -1
B=build-device/runtime
R=.deps/bundles
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
report() { # one.log many.log label
  python3 - "$@" <<'PY'
import re, sys
get = lambda p: [float(x) for x in re.findall(r"^step \d+/\d+  loss (\S+)", open(p).read(), re.M)]
a, b = get(sys.argv[1]), get(sys.argv[2])
worst = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("inf"))
rate = re.findall(r"trained: ([\d.]+) ms per step, (\d+) tokens/s", open(sys.argv[2]).read())
print(f"{sys.argv[3]}: {len(b)} steps, worst relative loss difference from one GPU {worst:.2e}"
      + (f"; {rate[0][0]} ms/step, {rate[0][1]} tokens/s" if rate else ""), flush=True)
PY
}
run() { # bundle steps log
  timeout 150 $B/loom-run "$1" --backend cuda --steps "$2" > "$3" 2>&1 || { echo "FAILED: $1"; tail -3 "$3"; }
}
echo "== Loom, GPT-2 350M, batch 8"
run $R/gpt2-350m-train.loom 10 /tmp/350-one.log && report /tmp/350-one.log /tmp/350-one.log "350M one GPU"
for p in planned interleaved; do
  grep -h "^  data\|^  tensor\|^  pipeline" $R/gpt2-350m-$p.txt 2>/dev/null | tr -s ' ' | tr '\n' ';'; echo
  run $R/gpt2-350m-$p.loom 10 /tmp/350-$p.log && report /tmp/350-one.log /tmp/350-$p.log "350M $p"
done
echo "== Loom, GPT 1.3B (L=24, h=2048, 16 heads), batch 8"
run $R/gpt-1.3b-one.loom 8 /tmp/13-one.log && report /tmp/13-one.log /tmp/13-one.log "1.3B one GPU"
grep -h "^  data\|^  tensor\|^  pipeline" $R/gpt-1.3b-planned.txt | tr -s ' ' | tr '\n' ';'; echo
for p in planned dp4 tp4 pp4 dp2tp2 tp2pp2; do
  run $R/gpt-1.3b-$p.loom 8 /tmp/13-$p.log && report /tmp/13-one.log /tmp/13-$p.log "1.3B $p"
done
echo "== calibration profiles for the planner (one GPU, per model): loomc plan --profile"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9')
for m in gpt2-350m gpt-1.3b; do
  b=$R/$m-one.loom; [ "$m" = gpt2-350m ] && b=$R/gpt2-350m-train.loom
  timeout 120 $B/loom-run "$b" --backend cuda --steps 6 --profile "${OUT:-/tmp}/profile-$card-$m.json" \
    | grep -E "per instruction|matmul" | head -3
done
echo "== PyTorch (f32 weights, TF32 matmuls, as Loom), same models and cards"
cd bench
timeout 120 python3 torch_gpt.py --steps 8 --modes eager-fp32 2>&1 | grep "^torch" | sed 's/^/350M 1 GPU /'
timeout 150 torchrun --nproc_per_node=4 torch_ddp.py --steps 8 2>&1 | grep "^torch" | sed 's/^/350M /'
timeout 120 python3 torch_gpt.py --hidden 2048 --steps 5 --modes eager-fp32 2>&1 | grep "^torch" | sed 's/^/1.3B 1 GPU /'
timeout 150 torchrun --nproc_per_node=4 torch_ddp.py --hidden 2048 --steps 5 2>&1 | grep "^torch" | sed 's/^/1.3B /'
cp /tmp/*.log "${OUT:-/tmp}/" 2>/dev/null || true
