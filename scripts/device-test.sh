#!/usr/bin/env bash
# On the GPU machine: build the runtime, run its tests, check the CUDA backend
# against the CPU backend on every carried bundle, then benchmark GPT-2 350M
# training against PyTorch. Needs .deps (scripts/device-deps.sh and
# scripts/device-bundles.sh, run here first). Writes logs to $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp}
scripts/device-build.sh 2>&1 | tail -25
B=build-device/runtime
R=.deps/bundles
status=0
echo "== forward: CUDA vs CPU (relative L2 error, TF32 matmuls)"
for b in $R/*-infer.loom; do
  n=$(basename "$b" .loom)
  $B/loom-run "$b" --backend cpu --seed 3 --output "$OUT/$n.cpu.safetensors" > /dev/null || status=1
  $B/loom-run "$b" --backend cuda --seed 3 --steps 5 --output "$OUT/$n.cuda.safetensors" | grep forward: || status=1
  $B/loom-compare "$OUT/$n.cuda.safetensors" "$OUT/$n.cpu.safetensors" --tolerance 2e-3 | sed "s/^/$n: /" || status=1
done
echo "== training: CUDA vs CPU losses, first 20 steps"
for m in gpt-tiny llama-tiny; do
  $B/loom-run $R/$m-train.loom --backend cpu --steps 20 > "$OUT/$m.train.cpu.log" || status=1
  $B/loom-run $R/$m-train.loom --backend cuda --steps 20 > "$OUT/$m.train.cuda.log" || status=1
  python3 - "$OUT/$m.train.cpu.log" "$OUT/$m.train.cuda.log" "$m" <<'PY' || status=1
import re, sys
get = lambda p: [float(x) for x in re.findall(r"^step \d+/\d+  loss (\S+)", open(p).read(), re.M)]
a, b = get(sys.argv[1]), get(sys.argv[2])
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"{sys.argv[3]}: {len(a)} steps, loss {a[0]:.4f} -> {a[-1]:.4f} (cpu) vs {b[0]:.4f} -> {b[-1]:.4f} (cuda), worst relative difference {worst:.2e}")
sys.exit(0 if len(a) == len(b) == 20 and worst < 1e-2 else 1)
PY
done
echo "== GPT-2 350M (L=24, h=1024, 16 heads, s=1024, V=50304), batch 8, AdamW: Loom CUDA (f32 storage, TF32 GEMMs)"
$B/loom-run $R/gpt2-350m-train.loom --backend cuda --steps 13 2>&1 | tail -4
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== PyTorch on the same model and card"
python3 bench/torch_gpt.py --steps 10 --modes "${TORCH_MODES:-eager-fp32,compile-fp32,eager-bf16,compile-bf16}" 2>&1 | grep -v Warning
exit $status
