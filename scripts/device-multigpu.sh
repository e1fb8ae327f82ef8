#!/usr/bin/env bash
# On a GPU machine with 2 or 4 GPUs: build the runtime, then train the
# carried multi-rank bundles (scripts/device-bundles.sh multi) over NCCL and compare
# their losses and throughput with one GPU on the same global batch.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
# The runtime alone (scripts/device-build.sh also runs every test).
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF 2>&1 | tail -3
B=build-device/runtime
R=.deps/bundles
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
compare() { # one.log many.log label tolerance
  python3 - "$@" <<'PY'
import re, sys
get = lambda p: [float(x) for x in re.findall(r"^step \d+/\d+  loss (\S+)", open(p).read(), re.M)]
a, b = get(sys.argv[1]), get(sys.argv[2])
n = min(len(a), len(b))
worst = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("inf"))
rate = re.findall(r"trained: ([\d.]+) ms per step, (\d+) tokens/s", open(sys.argv[2]).read())
print(f"{sys.argv[3]}: {len(b)} steps, loss {b[0] if b else 'n/a'} -> {b[-1] if b else 'n/a'}, "
      f"worst relative difference from one GPU {worst:.2e} over {n} steps"
      + (f"; {rate[0][0]} ms/step, {rate[0][1]} tokens/s" if rate else ""))
PY
}
run() { # bundle steps log
  timeout 240 $B/loom-run "$1" --backend cuda --steps "$2" > "$3" 2>&1 || { echo "FAILED: $1"; tail -5 "$3"; }
}
# SECTIONS=bf16, zero or graphs runs that section only (default: all).
if [ "${SECTIONS:-all}" = all ]; then
echo "== gpt-tiny, batch 8: one GPU vs 2 GPUs"
run $R/gpt-tiny-one.loom 20 /tmp/tiny-one.log
for p in dp2 tp2 pp2 zero2; do
  run "$R/gpt-tiny-$p.loom" 20 "/tmp/tiny-$p.log" && compare /tmp/tiny-one.log "/tmp/tiny-$p.log" "gpt-tiny $p"
done
echo "== gpt-tiny inference, tp2 against one GPU"
$B/loom-run $R/gpt-tiny-infer1.loom --backend cuda --seed 3 --output /tmp/infer1.safetensors > /dev/null &&
  $B/loom-run $R/gpt-tiny-infer-tp2.loom --backend cuda --seed 3 --output /tmp/infer2.safetensors > /dev/null &&
  $B/loom-compare /tmp/infer2.safetensors /tmp/infer1.safetensors --tolerance 1e-3
echo "== GPT-2 350M, batch 8, AdamW, f32 storage / TF32 GEMMs: one GPU vs several"
run $R/gpt2-350m-train.loom 10 /tmp/350-one.log
grep "trained:" /tmp/350-one.log | sed 's/^/one GPU: /'
for p in dp2 tp2 pp2; do
  run "$R/gpt2-350m-$p.loom" 10 "/tmp/350-$p.log" && compare /tmp/350-one.log "/tmp/350-$p.log" "350M $p"
done
if [ "$gpus" -ge 4 ]; then
  for p in dp4 tp4 pp4 dp2tp2 tp2pp2; do
    run "$R/gpt2-350m-$p.loom" 10 "/tmp/350-$p.log" && compare /tmp/350-one.log "/tmp/350-$p.log" "350M $p"
  done
fi
fi
if [ "${SECTIONS:-all}" = all ] || [ "${SECTIONS:-all}" = bf16 ]; then
echo "== bf16 (--precision bf16 --fuse): one GPU vs 2 GPUs, gpt-tiny then GPT-2 350M"
run $R/gpt-tiny-bf16-one.loom 20 /tmp/tiny16-one.log
run $R/gpt2-350m-bf16-one.loom 10 /tmp/350b-one.log
grep "trained:" /tmp/350b-one.log | sed 's/^/one GPU, bf16: /'
for p in dp2 tp2 pp2; do
  run "$R/gpt-tiny-bf16-$p.loom" 20 "/tmp/tiny16-$p.log" && compare /tmp/tiny16-one.log "/tmp/tiny16-$p.log" "gpt-tiny bf16 $p"
  run "$R/gpt2-350m-bf16-$p.loom" 10 "/tmp/350b-$p.log" && compare /tmp/350b-one.log "/tmp/350b-$p.log" "350M bf16 $p"
done
fi
if [ "${SECTIONS:-all}" = all ] || [ "${SECTIONS:-all}" = zero ]; then
  # ZeRO-1's collectives packed per bucket (the default: one NCCL call a
  # bucket, the reduce-scatter on the communication stream) and per tensor
  # (LOOM_CUDA_ZERO_PACKED=0), against one GPU and plain dp2.
  echo "== ZeRO-1 dp2, packed and per tensor: losses against one GPU, time against dp2 (bf16)"
  [ -f /tmp/tiny-one.log ] || run $R/gpt-tiny-one.loom 20 /tmp/tiny-one.log
  [ -f /tmp/350b-one.log ] || run $R/gpt2-350m-bf16-one.loom 10 /tmp/350b-one.log
  [ -f /tmp/350b-dp2.log ] || run $R/gpt2-350m-bf16-dp2.loom 10 /tmp/350b-dp2.log
  compare /tmp/350b-one.log /tmp/350b-dp2.log "350M bf16 dp2"
  for packed in 1 0; do
    LOOM_CUDA_ZERO_PACKED=$packed run $R/gpt-tiny-zero2.loom 20 /tmp/tiny-zero2-$packed.log &&
      compare /tmp/tiny-one.log /tmp/tiny-zero2-$packed.log "gpt-tiny zero2 (packed=$packed)"
    LOOM_CUDA_ZERO_PACKED=$packed run $R/gpt2-350m-bf16-zero2.loom 10 /tmp/350b-zero2-$packed.log &&
      compare /tmp/350b-one.log /tmp/350b-zero2-$packed.log "350M bf16 zero2 (packed=$packed)"
  done
fi
if [ "${SECTIONS:-all}" = all ] || [ "${SECTIONS:-all}" = graphs ]; then
  # Programs with NCCL calls captured as CUDA graphs (the default), against
  # NCCL calls outside them (LOOM_CUDA_GRAPHS_NCCL=0).
  echo "== bf16 dp2 and tp2 with their NCCL calls in CUDA graphs and outside them, against one GPU"
  [ -f /tmp/350b-one.log ] || run $R/gpt2-350m-bf16-one.loom 10 /tmp/350b-one.log
  for p in dp2 tp2; do
    [ -f /tmp/350b-$p.log ] || run $R/gpt2-350m-bf16-$p.loom 10 /tmp/350b-$p.log
    compare /tmp/350b-one.log /tmp/350b-$p.log "350M bf16 $p (graphs)"
    LOOM_CUDA_GRAPHS_NCCL=0 run $R/gpt2-350m-bf16-$p.loom 10 /tmp/350b-$p-eager.log &&
      compare /tmp/350b-one.log /tmp/350b-$p-eager.log "350M bf16 $p (NCCL outside graphs)"
  done
  # Pipeline sends and receives captured (the default) and eager
  # (LOOM_CUDA_GRAPHS_P2P=0): pp2's step program as one graph or not.
  [ -f /tmp/350b-pp2.log ] || run $R/gpt2-350m-bf16-pp2.loom 10 /tmp/350b-pp2.log
  compare /tmp/350b-one.log /tmp/350b-pp2.log "350M bf16 pp2 (sends and receives in graphs)"
  LOOM_CUDA_GRAPHS_P2P=0 run $R/gpt2-350m-bf16-pp2.loom 10 /tmp/350b-pp2-eager.log &&
    compare /tmp/350b-one.log /tmp/350b-pp2-eager.log "350M bf16 pp2 (sends and receives eager)"
  [ -f /tmp/tiny-one.log ] || run $R/gpt-tiny-one.loom 20 /tmp/tiny-one.log
  LOOM_CUDA_GRAPHS_P2P=0 run $R/gpt-tiny-pp2.loom 20 /tmp/tiny-pp2-eager.log &&
    compare /tmp/tiny-one.log /tmp/tiny-pp2-eager.log "gpt-tiny pp2 (sends and receives eager)"
fi
cp /tmp/*.log "${OUT:-/tmp}/" 2>/dev/null || true
