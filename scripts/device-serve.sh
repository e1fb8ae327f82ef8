#!/usr/bin/env bash
# On the GPU machine: builds the runtime, checks generation with the paged
# key/value cache against re-running the forward pass (greedy, bf16, on the
# GPU), then times GPT-2 350M (prompt 128, 128 new tokens, batch 1 and 32) and
# TinyLlama 1.1B (batch 1) beside transformers' generate in the same call.
# Needs .deps (scripts/device-deps.sh, then scripts/device-bundles.sh serve).
# SKIP_HF=1 leaves out transformers.
set -uo pipefail
cd "$(dirname "$0")/.."
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF 2>&1 | tail -3
B=build-device/runtime
R=.deps/bundles
T=$(mktemp -d)
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== decoding's kernels (paged attention, slices, argmax) against the CPU backend"
build-device/test/unit/loom-gpu-tests --gtest_filter='CudaServe.*' 2>&1 | grep -E -A6 "^\[  (PASSED|FAILED|SKIPPED) |Failure" || status=1
printf '1 2 3 4 5\n10 20 30\n7 9 7 9 7 9 7 9 7 9 7 9 7 9 7 9 7 9 7\n100\n50 60\n' > $T/small.txt
echo "== greedy decoding with the cache equals re-running the forward pass (CUDA, bf16)"
for m in gpt-tiny llama-tiny; do
  $B/loom-run $R/$m-serve.loom --backend cuda --prompt $T/small.txt --max-new 10 --reference $R/$m-fwd.loom \
      | grep -E "^reference|^serving" || status=1
done
python3 -c "
import random; random.seed(0)
p = lambda: ' '.join(str(random.randrange(50257)) for _ in range(128))
open('$T/b1.txt', 'w').write(p() + '\n')
open('$T/b32.txt', 'w').write('\n'.join(p() for _ in range(32)) + '\n')
q = lambda: ' '.join(str(random.randrange(32000)) for _ in range(128))
open('$T/l1.txt', 'w').write(q() + '\n')"
head -c 200 $T/b1.txt | cut -d' ' -f1-8 > $T/short.txt
echo "== GPT-2 350M: the cache against the full forward pass over 24 new tokens"
$B/loom-run $R/gpt2-350m-serve-b1.loom --backend cuda --prompt $T/short.txt --max-new 24 \
    --reference $R/gpt2-350m-fwd.loom | grep -E "^reference" || status=1
head -c 200 $T/l1.txt | cut -d' ' -f1-8 > $T/lshort.txt
echo "== TinyLlama 1.1B: the cache against the full forward pass over 24 new tokens"
$B/loom-run $R/llama-1.1b-serve-b1.loom --backend cuda --prompt $T/lshort.txt --max-new 24 \
    --reference $R/llama-1.1b-fwd.loom | grep -E "^reference" || status=1
echo "== Loom: GPT-2 350M, prompt 128, 128 new tokens"
$B/loom-run $R/gpt2-350m-serve-b1.loom --backend cuda --prompt $T/b1.txt --max-new 128 --repeat 3 \
    | grep -E "^serving|^time|^per-token|^throughput|^engine" | sed 's/^/batch 1: /' || status=1
$B/loom-run $R/gpt2-350m-serve.loom --backend cuda --prompt $T/b32.txt --max-new 128 --repeat 3 \
    | grep -E "^serving|^time|^per-token|^throughput|^engine" | sed 's/^/batch 32: /' || status=1
echo "== the same, batch 1, kernels launched plainly (LOOM_CUDA_PDL=0; the default lets decoding's start early)"
LOOM_CUDA_PDL=0 $B/loom-run $R/gpt2-350m-serve-b1.loom --backend cuda --prompt $T/b1.txt --max-new 128 --repeat 3 \
    | grep -E "^per-token|^engine" | sed 's/^/batch 1, no PDL: /' || status=1
echo "== batch 1 with RMS norms apart (LOOM_CUDA_GEMV_NORM=layer; the default folds them into the products)"
LOOM_CUDA_GEMV_NORM=layer $B/loom-run $R/llama-1.1b-serve-b1.loom --backend cuda --prompt $T/l1.txt --max-new 128 --repeat 3 \
    | grep -E "^per-token|^engine" | sed 's/^/TinyLlama batch 1, RMS norms apart: /' || status=1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "== GPT-2 350M tensor-parallel over two GPUs: the cache against the full forward pass on one"
  NCCL_NVLS_ENABLE=0 $B/loom-run $R/gpt2-350m-serve-b1-tp2.loom --backend cuda --prompt $T/short.txt --max-new 24 \
      --reference $R/gpt2-350m-fwd.loom | grep -E "^reference" || status=1
  echo "== Loom: GPT-2 350M batch 1, tensor-parallel over two GPUs (NCCL, captured in the step's CUDA graph)"
  NCCL_NVLS_ENABLE=0 $B/loom-run $R/gpt2-350m-serve-b1-tp2.loom --backend cuda --prompt $T/b1.txt --max-new 128 \
      --repeat 3 | grep -E "^time|^per-token|^throughput|^engine" | sed 's/^/tp2 batch 1: /' || status=1
  echo "== the same, NCCL calls outside graphs (LOOM_CUDA_GRAPHS_NCCL=0)"
  LOOM_CUDA_GRAPHS_NCCL=0 NCCL_NVLS_ENABLE=0 $B/loom-run $R/gpt2-350m-serve-b1-tp2.loom --backend cuda --prompt $T/b1.txt \
      --max-new 128 --repeat 3 | grep -E "^per-token|^engine" | sed 's/^/tp2 eager NCCL batch 1: /' || status=1
  echo "== Loom: TinyLlama 1.1B batch 1, tensor-parallel over two GPUs (NCCL)"
  NCCL_NVLS_ENABLE=0 $B/loom-run $R/llama-1.1b-serve-b1-tp2.loom --backend cuda --prompt $T/l1.txt --max-new 128 \
      --repeat 3 | grep -E "^time|^per-token|^throughput|^engine" | sed 's/^/tp2 batch 1: /' || status=1
fi
echo "== Loom: TinyLlama 1.1B, prompt 128, 128 new tokens, batch 1"
$B/loom-run $R/llama-1.1b-serve-b1.loom --backend cuda --prompt $T/l1.txt --max-new 128 --repeat 3 \
    | grep -E "^time|^per-token|^throughput|^engine" || status=1
if [ -z "${SKIP_HF:-}" ]; then
  echo "== transformers generate, same models and card"
  python3 bench/serve_hf.py --model gpt2-350m --batches 1,32 || status=1
  python3 bench/serve_hf.py --model llama-1.1b --batches 1 || status=1
fi
exit $status
