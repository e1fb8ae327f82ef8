#!/usr/bin/env bash
# On the GPU machine: ResNet-50 training on the CUDA backend (#21). Builds the
# runtime (without running its whole ctest suite), runs the CNN
# instructions against the CPU backend (CudaConv.* gtests), compares training
# losses of the GPU with the CPU backend's, CUDA graphs with eager launches
# and cuDNN's forward convolutions with our im2col ones, then times
# images/s at batch 32 and 128 beside PyTorch (bench/torch_resnet.py), and dp2
# beside PyTorch DDP.
# Needs .deps from `scripts/device-deps.sh && scripts/device-bundles.sh resnet`
# run here first. The CPU reference steps run the 64x64-image network (seconds
# a step on 16 cores); RESNET_FULL=1 adds the 224x224 one (the CPU's im2col
# products: 46 s a step at batch 32 on 2 cores). TORCH_MODES=none skips PyTorch.
# SECTIONS=check (tests and losses), SECTIONS=speed (profiles, images/s at
# batch 32 and 128 beside PyTorch eager and torch.compile) or SECTIONS=dp
# (two GPUs: dp2 at 32 and 128 images per GPU beside PyTorch DDP) runs one
# part, each within a device call's ten minutes (a list, "speed dp", runs
# several; PROFILE=0 leaves out speed's profiles, SIZES=32 or 128 picks the
# batch of speed and dp); SECTIONS=dpx (two GPUs) splits
# dp2's extra time a step by program (LOOM_CUDA_PROGRAM_TIMES=1) and by rank
# on the host (LOOM_RUN_STEP_TIMES=1), and writes graphed traces of one GPU's
# and dp2's steps (LOOM_CUDA_TRACE_GRAPHS=1) to $OUT, then GPT-2 350M's dp2
# the same way where its bundles are here (DPX_SIZES=32 or 128 picks the
# images per GPU, 0 none; DPX_ENVS lists settings to time dp2 under);
# LOOM_TUNING_CACHE defaults to
# build-device/tuning-cache.json; the runtime is built first
# either way (its ctest suite is scripts/device-build.sh's). QUICK=1 times
# only the --target cuda bundles; SKIP_BUILD=1 uses build-device as it is.
set -uo pipefail
cd "$(dirname "$0")/.."
# cuDNN's timed choices kept across this script's processes (and a warm
# machine's later calls): each run starts without timing again.
mkdir -p build-device
export LOOM_TUNING_CACHE=${LOOM_TUNING_CACHE:-$PWD/build-device/tuning-cache.json}
OUT=${OUT:-/tmp}
LOG=$(mktemp -d)
SECTIONS=${SECTIONS:-all}
want() { [ "$SECTIONS" = all ] || [[ " $SECTIONS " == *" $1 "* ]]; }
[ -n "${SKIP_BUILD:-}" ] || LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF 2>&1 | tail -5
B=build-device/runtime
R=.deps/bundles
status=0
# run NAME BUNDLE STEPS [ENV...]: trains on the CUDA backend into $LOG/NAME.log.
run() {
  local name=$1 bundle=$2 steps=$3
  shift 3
  env "$@" $B/loom-run "$R/$bundle.loom" --backend cuda --steps "$steps" > "$LOG/$name.log" 2>&1 || {
    status=1
    tail -5 "$LOG/$name.log"
  }
}
close() { # close A B TOL LABEL
  echo -n "$4: "
  python3 test/training/Inputs/close_losses.py "$LOG/$1.log" "$LOG/$2.log" "$3" || status=1
}
if want check; then
echo "== convolution, pooling and batch-norm instructions: CUDA against CPU (f32 with TF32 off, bf16)"
build-device/test/unit/loom-gpu-tests --gtest_filter='CudaConv.*' 2>&1 | grep -E -A6 "^\[  (PASSED|FAILED|SKIPPED) |Failure" || status=1
echo "== training losses, GPU against the CPU backend (f32 with TF32 off within 1e-3; bf16 within 3e-2)"
models=(resnet50-img64)
[ -n "${RESNET_FULL:-}" ] && models+=(resnet50)
for m in "${models[@]}"; do
  steps=2
  $B/loom-run $R/$m-b32-train.loom --backend cpu --steps $steps > "$LOG/$m.cpu.log" 2>&1 || status=1
  $B/loom-run $R/$m-b32-cuda-train.loom --backend cpu --steps $steps > "$LOG/$m-bf16.cpu.log" 2>&1 || status=1
  run $m.cuda $m-b32-train $steps LOOM_CUDA_TF32=0
  run $m-nhwc.cuda $m-b32-nhwc-train $steps LOOM_CUDA_TF32=0
  run $m-bf16.cuda $m-b32-cuda-train $steps
  grep -h "^step" "$LOG/$m.cpu.log" "$LOG/$m.cuda.log" "$LOG/$m-nhwc.cuda.log" "$LOG/$m-bf16.cpu.log" \
      "$LOG/$m-bf16.cuda.log" | sed "s/^/$m: /"
  close $m.cuda $m.cpu 1e-3 "$m f32"
  close $m-nhwc.cuda $m.cpu 1e-3 "$m f32 NHWC"
  close $m-bf16.cuda $m-bf16.cpu 3e-2 "$m bf16 (NHWC)"
done
echo "== the GPU against itself: CUDA graphs against eager launches, cuDNN's forward against im2col (f32, TF32 off)"
m=resnet50-img64
run $m.eager $m-b32-train 10 LOOM_CUDA_TF32=0 LOOM_CUDA_GRAPHS=0
run $m.graphs $m-b32-train 10 LOOM_CUDA_TF32=0
run $m.im2col $m-b32-train 10 LOOM_CUDA_TF32=0 LOOM_CUDA_CONV=im2col
# cuDNN may pick algorithms that add in a varying order: not bit for bit.
close $m.graphs $m.eager 1e-3 "graphs vs eager"
close $m.graphs $m.im2col 1e-3 "cuDNN vs im2col forward"
fi
if want speed; then
echo "== where a bf16 step's time goes at batch 32 and 128 (loom-run --profile)"
# (the algorithm cuDNN chose for each convolution shape goes to $OUT too)
for n in ${SIZES:-32 128}; do
  [ "${PROFILE:-1}" = 0 ] && break
  LOOM_CUDNN_VERBOSE=1 $B/loom-run $R/resnet50-b$n-cuda-train.loom --backend cuda --steps 6 \
      --profile "$OUT/profile-resnet50-b$n-bf16.json" 2> "$OUT/cudnn-resnet50-b$n-bf16.txt" | tail -25
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for n in ${SIZES:-32 128}; do
  echo "== images/s at batch $n: Loom beside PyTorch (channels_last) in one invocation"
  loom=($R/resnet50-b$n-cuda-train.loom)
  # batch 32 also times f32 (TF32) and bf16 NCHW
  [ $n = 32 ] && [ -z "${QUICK:-}" ] && loom+=($R/resnet50-b32-train.loom $R/resnet50-b32-nhwc-train.loom
                                                 $R/resnet50-b32-cuda-nchw-train.loom)
  if [ "${TORCH_MODES:-}" = none ]; then
    for b in "${loom[@]}"; do
      echo "$(basename "$b" .loom): $($B/loom-run "$b" --backend cuda --steps 23 2>&1 | grep -E "trained|rror" | tail -1)"
    done
  else
    python3 bench/torch_resnet.py --batch $n --steps 20 --modes "${TORCH_MODES:-eager-bf16,compile-bf16}" \
        --loom "${loom[@]}" --loom-run $B/loom-run 2>&1 | grep -v Warning || status=1
  fi
done
fi
if want dp; then
# Data parallelism over NCCL: the same images per GPU as one GPU, beside PyTorch DDP.
export NCCL_NVLS_ENABLE=0
for n in ${SIZES:-32 128}; do
  one=$R/resnet50-b$n-cuda-train.loom
  two=$R/resnet50-dp2-cuda-train.loom
  [ $n = 128 ] && two=$R/resnet50-dp2-b256-cuda-train.loom
  # and the same with the gradients averaged in bf16 (--grad-reduce bf16), where compiled
  w16=${two%-cuda-train.loom}-wire16-cuda-train.loom
  [ -e "$w16" ] || w16=
  echo "== dp2 at $n images per GPU: Loom one GPU, dp2, then PyTorch DDP"
  for b in $one $two $w16; do
    echo "$(basename "$b" .loom): $($B/loom-run "$b" --backend cuda --steps 23 2>&1 | grep -E "trained|rror" | tail -1)"
  done
  if [ "${TORCH_MODES:-}" != none ]; then
    torchrun --nproc_per_node=2 bench/torch_resnet.py --batch $((2 * n)) --steps 20 \
        --modes "${DDP_MODES:-ddp-eager-bf16,ddp-compile-bf16}" 2>&1 | grep -v -i warning || status=1
  fi
done
fi
if [[ " $SECTIONS " == *" dpx "* ]]; then
export NCCL_NVLS_ENABLE=0
for n in ${DPX_SIZES:-32}; do
  [ "$n" = 0 ] && continue
  one=resnet50-b$n-cuda-train two=resnet50-dp2-cuda-train
  [ $n = 128 ] && two=resnet50-dp2-b256-cuda-train
  echo "== $n images per GPU: programs' and ranks' times, one GPU then dp2 (graphs on)"
  for b in $one $two; do
    LOOM_CUDA_PROGRAM_TIMES=1 LOOM_RUN_STEP_TIMES=1 $B/loom-run "$R/$b.loom" --backend cuda --steps 23 2>&1 |
        grep -E "trained|loom: rank|step times|rror"
    # the graphed step's timeline (its event nodes lengthen it: compare traces with traces)
    LOOM_CUDA_TRACE_GRAPHS=1 $B/loom-run "$R/$b.loom" --backend cuda --steps 6 --trace "$OUT/trace-$b.json" \
        > /dev/null 2>&1 && gzip -f "$OUT/trace-$b.json"
  done
done
# GPT-2 350M's dp2 the same way, where its bundles are here
# (MODELS=gpt2-350m scripts/device-bundles.sh resnet plans).
# dp2 with the gradients averaged as bf16 (--grad-reduce bf16), beside the f32 all-reduce
for b in resnet50-dp2-cuda-train resnet50-dp2-wire16-cuda-train gpt2-350m-plan-dp-2_mb-1_zero-0 \
         gpt2-350m-plan-dp-2_mb-1_zero-0_wire-bf16; do
  [ -e "$R/$b.loom" ] && echo "$b: $($B/loom-run "$R/$b.loom" --backend cuda --steps 23 2>&1 | grep -E "trained|rror" | tail -1)"
done
# dp2 under each setting of DPX_ENVS beside none (default: the buckets not
# exchanged, what dp2 costs besides its transfers, where the loss is each
# rank's own; the arena and workspaces from ncclMemAlloc so that NCCL
# registers them as it captures the graphs), with the last loss of each.
for b in resnet50-dp2-cuda-train gpt2-350m-plan-dp-2_mb-1_zero-0; do
  [ -e "$R/$b.loom" ] || continue
  for setting in NONE=1 ${DPX_ENVS:-LOOM_CUDA_COLLECTIVES=skip LOOM_NCCL_REGISTER=1}; do
    echo "$b, $setting: $(env "$setting" $B/loom-run "$R/$b.loom" --backend cuda --steps 23 2>&1 |
        grep -E "^step 23|trained|rror" | sed 's/  [0-9]* [a-z]*\/s  elapsed.*//' | tr '\n' ' ')"
  done
done
for b in $R/gpt2-350m-plan-one.loom $R/gpt2-350m-plan-dp-2_mb-1_zero-0.loom; do
  [ -e "$b" ] || continue
  echo "== $(basename "$b" .loom): programs' and ranks' times"
  LOOM_CUDA_PROGRAM_TIMES=1 LOOM_RUN_STEP_TIMES=1 $B/loom-run "$b" --backend cuda --steps 13 2>&1 |
      grep -E "trained|loom: rank|step times|rror"
  LOOM_CUDA_TRACE_GRAPHS=1 $B/loom-run "$b" --backend cuda --steps 6 --trace "$OUT/trace-$(basename "$b" .loom).json" \
      > /dev/null 2>&1 && gzip -f "$OUT/trace-$(basename "$b" .loom).json"
done
fi
rm -rf "$LOG"
exit $status
