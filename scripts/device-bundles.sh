#!/usr/bin/env bash
# Compiles the bundles the GPU machine runs (it has no compiler) into
# .deps/bundles/, without weights (the runtime initialises them from the
# seed) so they stay small enough to carry.
#
# usage: scripts/device-bundles.sh [SET...]   (default: single)
#   single  one-GPU checks and the GPT-2 350M benchmark (scripts/device-test.sh)
#   multi   2- and 4-GPU plans of tiny GPT and GPT-2 350M (scripts/device-multigpu.sh)
#   scale   GPT-2 350M and GPT 1.3B on 4 GPUs, planner-chosen and forced (scripts/device-scale.sh)
#   trace   timelines of one GPU, dp2 and pp2 (scripts/device-trace.sh)
#   serve   serving bundles and their forward references (scripts/device-serve.sh)
#   mpi     one process per GPU under mpirun and Slurm (scripts/device-mpi.sh)
#   resnet  ResNet-50 training, f32 and --target cuda, batch 32 (128 for --target cuda),
#           and dp2 at 32 and 128 per GPU (scripts/device-resnet.sh)
#   plans   two-GPU plans of GPT-2 350M and GPT 1.3B, forced and the planner's pick, each
#           with its prediction (scripts/device-plans.sh; MODELS=gpt2-350m for one model;
#           CLUSTER=h200:4 for four GPUs at global batch 32); GPT-2 350M's are also what
#           scripts/device-nccl.sh runs
#   rank    what one GPU can time of two-GPU plans: a tensor-parallel rank's own work
#           with and without sequence parallelism, beside one GPU at the same batch
#           (scripts/device-rank.sh, LOOM_MEASURE_ONE_RANK)
#   zero    what one GPU can time of ZeRO: rank 0 of dp2 alone under ZeRO 0-3, GPT-2 350M
#           at 8 a rank beside one GPU at 8, and Llama 1.1B at one sequence a rank with
#           full recomputation (scripts/device-zero.sh, LOOM_MEASURE_ONE_RANK)
# The named sets replace what was there: the carried tree must stay under 64 MiB
# (bundles carry no weights; every set together is a few MiB).
set -euo pipefail
cd "$(dirname "$0")/.."
B=${LOOM_BUILD_DIR:-build}
out=.deps/bundles
sets=("${@:-single}")
rm -rf "$out" && mkdir -p "$out"
c() { "$B/compiler/loomc" compile "$@" --no-weights --seed 1 > /dev/null; }
# One-GPU GPT-2 350M, the baseline every set compares with.
c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --weight-decay 0.1 --clip 1.0 -o $out/gpt2-350m-train.loom
multi() {
  # Multi-GPU plans: the same global batch as one GPU.
  c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 -o $out/gpt-tiny-one.loom
  for plan in dp=2 tp=2 pp=2,mb=4,schedule=1f1b; do
    c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 --cluster h100:2 --force $plan -o $out/gpt-tiny-${plan%%=*}2.loom
  done
  # ZeRO-1 over NCCL (reduce-scatter, slices, all-gather) and tensor-parallel inference.
  c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 --cluster h100:2 --force dp=2,zero=1,mb=1 -o $out/gpt-tiny-zero2.loom
  c models/gpt-tiny.mlir --batch 2 -o $out/gpt-tiny-infer1.loom
  c models/gpt-tiny.mlir --batch 2 --cluster h100:2 --force tp=2 -o $out/gpt-tiny-infer-tp2.loom
  for plan in dp=2 tp=2 pp=2,mb=4,schedule=1f1b; do
    c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --cluster h100:2 --force $plan,zero=0 -o $out/gpt2-350m-${plan%%=*}2.loom
  done
  for plan in dp=4 tp=4 pp=4,mb=8,schedule=1f1b dp=2,tp=2 tp=2,pp=2,mb=4,schedule=1f1b; do
    name=$(echo "$plan" | sed 's/,mb=.*//; s/[=,]//g')
    c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --cluster h100:4 --force $plan,zero=0 -o $out/gpt2-350m-$name.loom
  done
  # bf16 (--precision bf16 --fuse): NCCL on bf16 activations (tensor parallelism) and f32 gradients.
  bf=(--precision bf16 --fuse)
  c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 "${bf[@]}" -o $out/gpt-tiny-bf16-one.loom
  c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 "${bf[@]}" -o $out/gpt2-350m-bf16-one.loom
  # dp2 as DDP runs it: one microbatch of 4 per GPU (unforced, the planner adds microbatches).
  for plan in dp=2,mb=1 tp=2 pp=2,mb=4,schedule=1f1b; do
    c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 "${bf[@]}" --cluster h100:2 --force $plan,zero=0 \
        -o $out/gpt-tiny-bf16-${plan%%=*}2.loom
    c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 "${bf[@]}" --cluster h100:2 --force $plan,zero=0 \
        -o $out/gpt2-350m-bf16-${plan%%=*}2.loom
  done
  # ZeRO-1 as the dp2 above (scripts/device-multigpu.sh SECTIONS=zero).
  c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 "${bf[@]}" --cluster h100:2 --force dp=2,mb=1,zero=1 \
      -o $out/gpt2-350m-bf16-zero2.loom
}
mpi() {
  # One process per GPU (scripts/device-mpi.sh): the 2-GPU plans of GPT-2 350M,
  # and tiny GPT dp2 with rank 1's first all-reduce removed (its peer's NCCL
  # all-reduce never completes: the timeout must end it).
  for plan in dp=2 tp=2 pp=2,mb=4,schedule=1f1b; do
    c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --cluster h100:2 --force $plan,zero=0 -o $out/gpt2-350m-${plan%%=*}2.loom
  done
  c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 --cluster h100:2 --force dp=2,zero=0,mb=1 -o $out/gpt-tiny-stall-dp2.loom
  python3 -c "
import json, sys
p = sys.argv[1]; m = json.load(open(p)); programs = m['ranks'][1]['programs']
name = next(n for n in ('backward', 'update', 'step') if any(i['op'] == 'all_reduce' for i in programs.get(n, [])))
programs[name].remove(next(i for i in programs[name] if i['op'] == 'all_reduce'))
json.dump(m, open(p, 'w'))" $out/gpt-tiny-stall-dp2.loom/manifest.json
}
trace() {
  c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 -o $out/gpt-tiny-one.loom
  for plan in dp=2,mb=1 pp=2,mb=4,schedule=1f1b; do
    c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 --cluster h100:2 --force $plan,zero=0 -o $out/gpt-tiny-${plan%%=*}2.loom
    c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --precision bf16 --fuse --cluster h100:2 \
        --force $plan,zero=0 -o $out/gpt2-350m-bf16-${plan%%=*}2.loom
  done
}
scale() {
  prof=bench/data/profile-h100-gpt2-350m.json
  # GPT 1.3B is written on demand (too big to check against the reference on CI's CPU).
  "$B/compiler/loomc" models gpt --layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 \
      -o .deps/gpt-1.3b.mlir
  model() { [ "$1" = gpt-1.3b ] && echo .deps/gpt-1.3b.mlir || echo models/$1.mlir; }
  for m in gpt2-350m gpt-1.3b; do
    # The plan the planner picks for 4 GPUs, calibrated by the runtime's measured profile.
    "$B/compiler/loomc" plan $(model $m) --cluster h200:4 --batch 8 --profile $prof \
        --materialized-attention --json "$out/$m-planned.json" > "$out/$m-planned.txt"
    c $(model $m) --batch 8 --train --lr 3e-4 --cluster h200:4 --plan "$out/$m-planned.json" -o $out/$m-planned.loom
  done
  c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --cluster h200:4 \
      --force dp=2,pp=2,vpp=2,mb=4,schedule=interleaved,zero=0 -o $out/gpt2-350m-interleaved.loom
  c .deps/gpt-1.3b.mlir --batch 8 --train --lr 3e-4 -o $out/gpt-1.3b-one.loom
  for plan in dp=4 tp=4 pp=4,mb=8,schedule=1f1b dp=2,tp=2 tp=2,pp=2,mb=4,schedule=1f1b; do
    name=$(echo "$plan" | sed 's/,mb=.*//; s/[=,]//g')
    c .deps/gpt-1.3b.mlir --batch 8 --train --lr 3e-4 --cluster h200:4 --force $plan,zero=0 -o $out/gpt-1.3b-$name.loom
  done
}
serve() {
  # Greedy decoding with the paged cache against re-running the forward pass, on the GPU.
  for m in gpt-tiny llama-tiny; do
    c models/$m.mlir --serve --target cuda --max-batch 4 --prefill-chunk 8 -o $out/$m-serve.loom
    c models/$m.mlir --target cuda -o $out/$m-fwd.loom
  done
  # The benchmark: GPT-2 350M, prompt 128 + 128 new tokens, batch 1 and 32; TinyLlama 1.1B batch 1.
  c models/gpt2-350m.mlir --serve --target cuda --max-batch 32 --max-seq 256 -o $out/gpt2-350m-serve.loom
  c models/gpt2-350m.mlir --serve --target cuda --max-batch 1 --max-seq 256 -o $out/gpt2-350m-serve-b1.loom
  c models/llama-1.1b.mlir --serve --target cuda --max-batch 1 --max-seq 256 -o $out/llama-1.1b-serve-b1.loom
  # The same with the weights as the model lays them out ([K, N]; the default is [N, K]).
  c models/gpt2-350m.mlir --serve --target cuda --max-batch 1 --max-seq 256 --weight-layout kn -o $out/gpt2-350m-serve-b1-kn.loom
  c models/llama-1.1b.mlir --serve --target cuda --max-batch 1 --max-seq 256 --weight-layout kn -o $out/llama-1.1b-serve-b1-kn.loom
  # Tensor-parallel decoding over NCCL (timed where the machine has two GPUs).
  c models/gpt2-350m.mlir --serve --target cuda --max-batch 1 --max-seq 256 --cluster h100:2 --force tp=2 \
      -o $out/gpt2-350m-serve-b1-tp2.loom
  c models/llama-1.1b.mlir --serve --target cuda --max-batch 1 --max-seq 256 --cluster h100:2 --force tp=2 \
      -o $out/llama-1.1b-serve-b1-tp2.loom
  # GPT-2 350M's and TinyLlama's decoding with the cache against their full forward pass.
  c models/gpt2-350m.mlir --target cuda -o $out/gpt2-350m-fwd.loom
  c models/llama-1.1b.mlir --target cuda -o $out/llama-1.1b-fwd.loom
}
resnet() {
  # ResNet-50 (224x224, 1000 classes) and the same network on 64x64 images
  # with 100 classes (the CPU reference steps take seconds), batch 32, SGD
  # with momentum as torchvision trains it: f32 (NCHW, and NHWC), and
  # --target cuda (bf16, --fuse, NHWC; and NCHW to compare).
  "$B/compiler/loomc" models resnet --image 64 --classes 100 -o .deps/resnet50-img64.mlir
  sgd=(--batch 32 --train --optimizer sgd --lr 0.1 --momentum 0.9)
  for m in models/resnet50.mlir .deps/resnet50-img64.mlir; do
    n=$(basename "$m" .mlir)
    c "$m" "${sgd[@]}" -o $out/$n-b32-train.loom
    c "$m" "${sgd[@]}" --layout nhwc -o $out/$n-b32-nhwc-train.loom
    c "$m" "${sgd[@]}" --target cuda -o $out/$n-b32-cuda-train.loom
    c "$m" "${sgd[@]}" --target cuda --layout nchw -o $out/$n-b32-cuda-nchw-train.loom
  done
  # Batch 128, the issue's second size (--target cuda only).
  c models/resnet50.mlir --batch 128 --train --optimizer sgd --lr 0.1 --momentum 0.9 --target cuda \
    -o $out/resnet50-b128-cuda-train.loom
  # Data parallelism over 2 GPUs at 32 and 128 images per GPU, one microbatch
  # each (as the one-GPU runs; the planner's own choice at 128 is two of 64).
  dp=(--train --optimizer sgd --lr 0.1 --momentum 0.9 --cluster h100:2 --force dp=2,mb=1,zero=0)
  c models/resnet50.mlir --batch 64 "${dp[@]}" -o $out/resnet50-dp2-train.loom
  c models/resnet50.mlir --batch 64 "${dp[@]}" --target cuda -o $out/resnet50-dp2-cuda-train.loom
  c models/resnet50.mlir --batch 256 "${dp[@]}" --target cuda -o $out/resnet50-dp2-b256-cuda-train.loom
  # The same with the bf16 gradients averaged as bf16 (--grad-reduce bf16).
  c models/resnet50.mlir --batch 64 "${dp[@]}" --target cuda --grad-reduce bf16 -o $out/resnet50-dp2-wire16-cuda-train.loom
  c models/resnet50.mlir --batch 256 "${dp[@]}" --target cuda --grad-reduce bf16 \
    -o $out/resnet50-dp2-b256-wire16-cuda-train.loom
}
single() {
for m in gpt-tiny llama-tiny bert-tiny mlp; do
  c models/$m.mlir --batch 4 -o $out/$m-infer.loom
done
for m in gpt-tiny llama-tiny mlp; do
  c models/$m.mlir --batch 4 --train --lr 1e-3 -o $out/$m-train.loom
done
# Generated fused kernels (--fuse): the GPU runs their PTX; compared with the unfused bundles.
c models/gpt-tiny.mlir --batch 4 --train --lr 1e-3 --fuse -o $out/gpt-tiny-fused-train.loom
c models/bert-tiny.mlir --batch 4 --fuse -o $out/bert-tiny-fused-infer.loom
c models/gpt2-124m.mlir --batch 2 -o $out/gpt2-124m-infer.loom
c models/bert-base.mlir --batch 2 -o $out/bert-base-infer.loom
c models/llama-1.1b.mlir --batch 1 -o $out/llama-1.1b-b1.loom # forward checked unless LOOM_QUICK (CPU side: minutes)
c models/resnet50.mlir --batch 2 -o $out/resnet50-infer.loom # convolutions as im2col + GEMMs
c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --weight-decay 0.1 --clip 1.0 -o $out/gpt2-350m-train.loom
c models/gpt2-350m.mlir --batch 1 --train --lr 3e-4 -o $out/gpt2-350m-b1-train.loom
# bf16 activations and gradients, f32 master weights (--precision bf16): checked
# against the CPU backend's bf16 and timed against PyTorch's bf16 autocast.
for m in gpt-tiny llama-tiny bert-tiny mlp; do
  c models/$m.mlir --batch 4 --precision bf16 -o $out/$m-bf16-infer.loom
done
for m in gpt-tiny llama-tiny; do
  c models/$m.mlir --batch 4 --train --lr 1e-3 --precision bf16 -o $out/$m-bf16-train.loom
done
c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --weight-decay 0.1 --clip 1.0 --precision bf16 \
    -o $out/gpt2-350m-bf16-train.loom
c models/gpt2-350m.mlir --batch 1 --train --lr 3e-4 --precision bf16 -o $out/gpt2-350m-bf16-b1-train.loom
# ... and with --fuse (bias adds in cuBLASLt's epilogue, chains as generated kernels:
# Llama's SwiGLU and its gradient, on bf16 tensors).
c models/gpt-tiny.mlir --batch 4 --train --lr 1e-3 --precision bf16 --fuse -o $out/gpt-tiny-bf16-fused-train.loom
c models/llama-tiny.mlir --batch 4 --train --lr 1e-3 --precision bf16 --fuse -o $out/llama-tiny-bf16-fused-train.loom
c models/llama-tiny.mlir --batch 4 --precision bf16 --fuse -o $out/llama-tiny-bf16-fused-infer.loom
# Two microbatches: the weight gradients added into their sums by their products
# (loom-accumulate-in-products), against the CPU.
c models/gpt-tiny.mlir --batch 4 --train --lr 1e-3 --precision bf16 --fuse --cluster h100:1 --force mb=2,zero=0 \
    -o $out/gpt-tiny-bf16-fused-mb2-train.loom
# Generated row kernels (layernorm, rmsnorm, softmax) against the CPU's, f32 and bf16.
c test/runtime/Inputs/rows.mlir --batch 16 --fuse -o $out/rows-fused-infer.loom
c test/runtime/Inputs/rows.mlir --batch 16 --target cuda -o $out/rows-bf16-fused-infer.loom
c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --weight-decay 0.1 --clip 1.0 --precision bf16 --fuse \
    -o $out/gpt2-350m-bf16-fused-train.loom
}
plans() {
  # Issue #18: the planner's pick for two GPUs against forced plans, GPT-2 350M
  # and GPT 1.3B, bf16 (--target cuda), global batch 16, AdamW; each plan's
  # prediction (loomc plan, calibrated by the H200 profile) beside its bundle
  # (scripts/device-plans.sh runs them and prints predicted against measured).
  prof=bench/data/profile-h200-gpt2-350m-bf16.json
  "$B/compiler/loomc" models gpt --layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 \
      -o .deps/gpt-1.3b.mlir
  model() { [ "$1" = gpt-1.3b ] && echo .deps/gpt-1.3b.mlir || echo models/$1.mlir; }
  # CLUSTER=h200:4 makes the four-GPU set (global batch 32, its own forced plans).
  cluster=${CLUSTER:-h200:2}
  gpus=${cluster#*:}
  batch=$((8 * gpus))
  if [ "$gpus" = 4 ]; then
    plans="pick dp=4,mb=1,zero=0 dp=4,mb=1,zero=1 dp=2,tp=2,mb=1,zero=0 tp=4,mb=1,zero=0 \
           dp=2,pp=2,mb=4,schedule=zb-h1,zero=0 pp=4,mb=8,schedule=1f1b,zero=0 pp=4,mb=8,schedule=zb-h1,zero=0 \
           tp=2,pp=2,mb=4,schedule=1f1b,zero=0 tp=4,mb=1,zero=0,sp=1 dp=2,tp=2,mb=1,zero=0,sp=1"
  else
    plans="pick dp=2,mb=1,zero=0 dp=2,mb=2,zero=0 dp=2,mb=1,zero=1 dp=2,mb=1,zero=2 dp=2,mb=1,zero=3 tp=2,mb=1,zero=0 \
           tp=2,mb=1,zero=0,sp=1 tp=2,mb=2,zero=0 tp=2,mb=2,zero=0,sp=1 \
           pp=2,mb=4,schedule=1f1b,zero=0 pp=2,mb=4,schedule=zb-h1,zero=0 pp=2,vpp=2,mb=4,schedule=interleaved,zero=0 \
           pp=2,mb=8,schedule=1f1b,zero=0 pp=2,mb=8,schedule=zb-h1,zero=0"
  fi
  for m in ${MODELS:-gpt2-350m gpt-1.3b}; do
    # One GPU at the same batch per GPU as the data-parallel plans (8 sequences).
    c $(model $m) --batch 8 --train --lr 3e-4 --target cuda -o $out/$m-plan-one.loom
    for plan in $plans; do
      name=$(echo "$plan" | tr '=,' '-_')
      force=(); [ "$plan" = pick ] || force=(--force "$plan")
      "$B/compiler/loomc" plan $(model $m) --cluster $cluster --batch $batch --profile $prof "${force[@]}" \
          --json "$out/$m-plan-$name.json" > "$out/$m-plan-$name.txt"
      c $(model $m) --batch $batch --train --lr 3e-4 --target cuda --cluster $cluster --plan "$out/$m-plan-$name.json" \
          -o "$out/$m-plan-$name.loom"
    done
    # One GPU accumulating the microbatches of each pipelined plan (the issue's
    # baseline for pipeline parallelism: the same global batch and microbatches).
    for mb in $(echo "$plans" | tr ' ' '\n' | grep 'pp=' | sed -n 's/.*mb=\([0-9]*\).*/\1/p' | sort -un); do
      c $(model $m) --batch $batch --train --lr 3e-4 --target cuda --cluster h200:1 --force mb=$mb,zero=0 \
          -o "$out/$m-base-mb$mb.loom"
    done
    # Tensor parallelism without loom-overlap-tensor-reduce (the backward's
    # all-reduces in place, synchronous), to time the rewrite against.
    c $(model $m) --batch $batch --train --lr 3e-4 --target cuda --cluster $cluster --force tp=$gpus,mb=1,zero=0 \
        --skip-pass loom-overlap-tensor-reduce -o "$out/$m-alt-tp-${gpus}_no-overlap.loom"
    # ... and with --tp-overlap: its forward sums in two halves (loom-split-tensor-reduce),
    # and with sequence parallelism each product's own rows beside its gather
    # (loom-overlap-tensor-gather).
    c $(model $m) --batch $batch --train --lr 3e-4 --target cuda --cluster $cluster --force tp=$gpus,mb=1,zero=0 \
        --tp-overlap -o "$out/$m-alt-tp-${gpus}_tp-overlap.loom"
    c $(model $m) --batch $batch --train --lr 3e-4 --target cuda --cluster $cluster --force tp=$gpus,mb=1,zero=0,sp=1 \
        --tp-overlap -o "$out/$m-alt-tp-${gpus}_sp_tp-overlap.loom"
    # Data parallelism over every GPU with the bf16 gradients averaged as bf16 (--grad-reduce bf16).
    c $(model $m) --batch $batch --train --lr 3e-4 --target cuda --cluster $cluster --force dp=$gpus,mb=1,zero=0 \
        --grad-reduce bf16 -o "$out/$m-plan-dp-${gpus}_mb-1_zero-0_wire-bf16.loom"
  done
}
rank() {
  # Issue #18 on one GPU: GPT-2 350M and GPT 1.3B at global batch 16 (bf16,
  # --target cuda): one GPU, and rank 0 of tp2 with and without sequence
  # parallelism (each run alone, its collectives local copies).
  "$B/compiler/loomc" models gpt --layers 24 --hidden 2048 --heads 16 --seq 1024 --vocab 50304 \
      -o .deps/gpt-1.3b.mlir
  for m in ${MODELS:-gpt2-350m gpt-1.3b}; do
    src=models/$m.mlir; [ "$m" = gpt-1.3b ] && src=.deps/gpt-1.3b.mlir
    c $src --batch 16 --train --lr 3e-4 --target cuda -o $out/$m-rank-one.loom
    c $src --batch 16 --train --lr 3e-4 --target cuda --cluster h200:2 --force tp=2,mb=1,zero=0 -o $out/$m-rank-tp2.loom
    c $src --batch 16 --train --lr 3e-4 --target cuda --cluster h200:2 --force tp=2,mb=1,zero=0,sp=1 \
        -o $out/$m-rank-tp2-sp.loom
  done
}
zero() {
  # Issue #18 on one GPU: each ZeRO stage's rank alone (its collectives local
  # copies), with the planner's prediction of its memory beside it.
  c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --target cuda -o $out/gpt2-350m-zero-one.loom
  for z in 0 1 2 3; do
    c models/gpt2-350m.mlir --batch 16 --train --lr 3e-4 --target cuda --cluster h200:2 --force dp=2,mb=1,zero=$z \
        -o $out/gpt2-350m-zero-z$z.loom
  done
  for z in 1 2 3; do
    c models/llama-1.1b.mlir --batch 2 --train --lr 3e-4 --target cuda --cluster h200:2 \
        --force dp=2,zero=$z,recompute=full -o $out/llama-1.1b-zero-z$z.loom
    "$B/compiler/loomc" plan models/llama-1.1b.mlir --batch 2 --cluster h200:2 --force dp=2,zero=$z,recompute=full \
        | grep -E "^  0 |predicted step" > $out/llama-1.1b-zero-z$z.plan.txt
  done
}
for set_name in "${sets[@]}"; do
  case $set_name in
    single | multi | scale | trace | serve | mpi | resnet | plans | rank | zero) "$set_name" ;;
    *) echo "device-bundles.sh: unknown set '$set_name' (single, multi, scale, trace, serve, mpi, resnet, plans, rank, zero)" >&2; exit 2 ;;
  esac
done
du -sh "$out"
