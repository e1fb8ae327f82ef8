#!/usr/bin/env bash
# Compiles the bundles the GPU machine runs (it has no compiler) into
# .deps/bundles/, without weights (the runtime initialises them from the
# seed) so they stay small enough to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${LOOM_BUILD_DIR:-build}
out=.deps/bundles
rm -rf "$out" && mkdir -p "$out"
c() { "$B/compiler/loomc" compile "$@" --no-weights --seed 1 > /dev/null; }
for m in gpt-tiny llama-tiny bert-tiny mlp; do
  c models/$m.mlir --batch 4 -o $out/$m-infer.loom
done
for m in gpt-tiny llama-tiny mlp; do
  c models/$m.mlir --batch 4 --train --lr 1e-3 -o $out/$m-train.loom
done
c models/gpt2-124m.mlir --batch 2 -o $out/gpt2-124m-infer.loom
c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --weight-decay 0.1 --clip 1.0 -o $out/gpt2-350m-train.loom
c models/gpt2-350m.mlir --batch 1 --train --lr 3e-4 -o $out/gpt2-350m-b1-train.loom
# Multi-GPU plans (scripts/device-multigpu.sh): the same global batch as one GPU.
c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 -o $out/gpt-tiny-one.loom
for plan in dp=2 tp=2 pp=2,mb=4,schedule=1f1b; do
  c models/gpt-tiny.mlir --batch 8 --train --lr 1e-3 --cluster h100:2 --force $plan -o $out/gpt-tiny-${plan%%,*}.loom
done
for plan in dp=2 tp=2 pp=2,mb=4,schedule=1f1b; do
  c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --cluster h100:2 --force $plan,zero=0 -o $out/gpt2-350m-${plan%%,*}.loom
done
for plan in dp=4 tp=4 pp=4,mb=8,schedule=1f1b dp=2,tp=2 tp=2,pp=2,mb=4,schedule=1f1b; do
  name=$(echo "$plan" | sed 's/,mb=.*//; s/[=,]//g')
  c models/gpt2-350m.mlir --batch 8 --train --lr 3e-4 --cluster h100:4 --force $plan,zero=0 -o $out/gpt2-350m-$name.loom
done
du -sh "$out"
