#!/usr/bin/env bash
# The main job on its embedded default: installs what is missing, builds, then
# writes a small GPT with `loomc models`, verifies it and prints its summary,
# compiles it and runs its forward pass on the CPU backend, and lists the GPUs
# the runtime can use (if any).
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
if [ -x "$B/runtime/loom-devices" ]; then
  "$B/runtime/loom-devices" || echo "(no GPU here: the CPU backend is the reference)"
fi
