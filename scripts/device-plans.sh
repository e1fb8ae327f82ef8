#!/usr/bin/env bash
# On a GPU machine with 2 GPUs (issue #18): trains GPT-2 350M and GPT 1.3B
# with the planner's pick and with forced plans (bf16, global batch 8 a GPU), one
# GPU beside them, then PyTorch DDP and FSDP2 on the same model and cards, and
# prints each plan's prediction against its measurement: step time and GPU
# memory, and whether the pick is within 5% of the fastest plan measured.
# Needs .deps (scripts/device-deps.sh, then scripts/device-bundles.sh plans).
# MODELS="gpt2-350m" runs one model; SKIP_TORCH=1 leaves PyTorch out; ALTERNATIVES=0
# leaves out the pipelined plans with their sends eager or fewer link channels
# and tensor parallelism without its backward all-reduces overlapped, or with
# --tp-overlap (its products cut by rows beside their collectives).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
LOOM_BUILD_DIR=build-device scripts/build.sh -DLOOM_BUILD_COMPILER=OFF -DLOOM_BUILD_TESTS=OFF 2>&1 | tail -1
B=build-device/runtime
R=.deps/bundles
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
gpus=$(nvidia-smi -L | wc -l) # the bundles' ranks (scripts/device-bundles.sh plans, CLUSTER=h200:N)
status=0
for m in ${MODELS:-gpt2-350m gpt-1.3b}; do
  [ -d "$R/$m-plan-one.loom" ] || { echo "no $R/$m-plan-one.loom: run scripts/device-bundles.sh plans"; exit 1; }
  echo "== $m, bf16, AdamW, 10 steps (mean of the 7 after 3 warm-up)"
  timeout 300 $B/loom-run "$R/$m-plan-one.loom" --backend cuda --steps 10 > "$out/$m-plan-one.log" 2>&1 ||
    { echo "FAILED: one GPU"; tail -3 "$out/$m-plan-one.log"; status=1; }
  for txt in "$R/$m"-plan-*.txt; do
    name=$(basename "$txt" .txt)
    timeout 300 $B/loom-run "$R/$name.loom" --backend cuda --steps 10 > "$out/$name.log" 2>&1 ||
      { echo "FAILED: $name"; tail -3 "$out/$name.log"; status=1; }
  done
  python3 - "$R" "$out" "$m" "$gpus" <<'PY' || status=1
import glob, os, re, sys
R, out, m, gpus = sys.argv[1:]
gpus = int(gpus)
def measured(log):
    text = open(log).read() if os.path.exists(log) else ""
    ms = re.findall(r"^trained: ([\d.]+) ms per step", text, re.M)
    mem = [float(x) for x in re.findall(r"^device memory: rank \d+, GPU \d+: ([\d.]+) GiB in use", text, re.M)]
    arena = [float(x) for x in re.findall(r"\(arena ([\d.]+) GiB\)", text)]
    return (float(ms[0]) if ms else None), (max(mem) if mem else None), (max(arena) if arena else None)
one = measured(f"{out}/{m}-plan-one.log")[0]
rows = []
for txt in sorted(glob.glob(f"{R}/{m}-plan-*.txt")):
    name = os.path.basename(txt)[len(m) + 6:-4]
    plan = open(txt).read()
    pred = re.findall(r"predicted step\s+([\d.]+) ms", plan)
    pmem = re.findall(r"peak memory\s+([\d.]+) GiB", plan)
    # The largest stage's weights + activations: what the arena holds (the
    # peak adds a reserve for the CUDA context, workspaces and NCCL).
    stages = [float(w) + float(a) for w, a in re.findall(r"\(([\d.]+) GiB \+ ([\d.]+) GiB\)", plan)]
    field = lambda key: (re.findall(r"^  " + key + r"\s+(.*)$", plan, re.M) or ["?"])[0].strip()
    shape = (f"dp{field('data parallel')} tp{field('tensor parallel')}, pipeline {field('pipeline')}, "
             f"recomputation {field('recomputation')}")
    ms, mem, arena = measured(f"{out}/{m}-plan-{name}.log")
    rows.append((name, shape, float(pred[0]) if pred else None, ms, float(pmem[0]) if pmem else None, mem, arena,
                 max(stages) if stages else None))
err = lambda p, q: f"{(p - q) / q * 100:+.1f}%" if p is not None and q else "n/a"
f = lambda x, fmt: fmt % x if x is not None else "n/a"
print(f"one GPU, batch 8: {f(one, '%.1f')} ms/step")
print(f"{'plan':34s} {'predicted':>9s} {'measured':>9s} {'error':>7s} {'vs 1 GPU':>8s}   "
      f"{'arena pred.':>11s} {'arena':>6s} {'error':>7s}   {'peak pred.':>10s} {'in use':>7s} {'error':>7s}")
for name, shape, pred, ms, pmem, mem, arena, parena in rows:
    speed = f"{gpus * one / ms:.2f}x" if one and ms else "n/a"  # gpus times the tokens of the one-GPU step
    print(f"{name:34s} {f(pred, '%9.1f')} {f(ms, '%9.1f')} {err(pred, ms):>7s} {speed:>8s}   "
          f"{f(parena, '%9.1f G')} {f(arena, '%4.1f G')} {err(parena, arena):>7s}   "
          f"{f(pmem, '%8.1f G')} {f(mem, '%5.1f G')} {err(pmem, mem):>7s}")
done = [r for r in rows if r[3] is not None]
if done:
    fastest = min(done, key=lambda r: r[3])
    pick = next((r for r in done if r[0] == "pick"), None)
    print(f"fastest measured: {fastest[0]} ({fastest[3]:.1f} ms); "
          + (f"the pick ({pick[1]}) {pick[3]:.1f} ms, {(pick[3] / fastest[3] - 1) * 100:.1f}% slower "
             f"({'within' if pick[3] <= 1.05 * fastest[3] else 'NOT within'} 5%)" if pick else "the pick did not run"))
PY
  # Data parallelism with the bf16 gradients averaged as bf16 (--grad-reduce bf16): a
  # compile option, not a plan the planner prices, so measured without a prediction.
  for b in "$R/$m"-plan-*wire-bf16.loom; do
    [ -d "$b" ] || continue
    name=$(basename "$b" .loom)
    if timeout 300 $B/loom-run "$b" --backend cuda --steps 10 > "$out/$name.log" 2>&1; then
      python3 - "$out/$m-plan-one.log" "$out/$name.log" "$gpus" "${name#$m-plan-}" <<'PY'
import re, sys
ms = lambda p: float((re.findall(r"^trained: ([\d.]+) ms per step", open(p).read(), re.M) or ["nan"])[0])
one, this, gpus = ms(sys.argv[1]), ms(sys.argv[2]), int(sys.argv[3])
print(f"{sys.argv[4]:34s} {'':>9s} {this:9.1f} {'':>7s} {gpus * one / this:7.2f}x   (--grad-reduce bf16: no prediction)")
PY
    else
      echo "FAILED: $name"; tail -3 "$out/$name.log"; status=1
    fi
  done
  # Pipeline parallelism against one GPU accumulating the same microbatches
  # (the same global batch, in the same number of microbatches).
  for b in "$R/$m"-base-mb*.loom; do
    [ -d "$b" ] || continue
    mb=${b##*-base-mb}; mb=${mb%.loom}
    timeout 300 $B/loom-run "$b" --backend cuda --steps 10 > "$out/$m-base-mb$mb.log" 2>&1 ||
      { echo "FAILED: one GPU, $mb microbatches"; tail -3 "$out/$m-base-mb$mb.log"; status=1; continue; }
    python3 - "$out/$m-base-mb$mb.log" "$out" "$m" "$mb" <<'PY'
import glob, os, re, sys
ms = lambda p: (re.findall(r"^trained: ([\d.]+) ms per step", open(p).read(), re.M) or [None])[0]
base, out, m, mb = sys.argv[1:]
one = ms(base)
print(f"one GPU accumulating {mb} microbatches (the global batch): {one} ms/step")
for log in sorted(glob.glob(f"{out}/{m}-plan-pp-*_mb-{mb}_*.log")):  # pipeline only (no dp or tp)
    this = ms(log)
    if one and this:
        name = os.path.basename(log)[len(m) + 6:-4]
        print(f"  {name:40s} {float(this):7.1f} ms: {float(one) / float(this):.2f}x one GPU with the same microbatches")
PY
  done
  # Runtime and compile alternatives beside the plans they change (ALTERNATIVES=0 skips):
  # pipelined steps with their sends and receives eager (LOOM_CUDA_GRAPHS_P2P=0),
  # pipeline links with at most 4 NCCL channels (LOOM_NCCL_LINK_CTAS=4: fewer buffers),
  # and tensor parallelism without loom-overlap-tensor-reduce (PP_ALTS="..." picks the
  # pipelines' alternatives).
  if [ "${ALTERNATIVES:-1}" != 0 ]; then
    row() { # name, log
      python3 - "$2" "$1" <<'PY'
import re, sys
t = open(sys.argv[1]).read()
ms = re.findall(r"^trained: ([\d.]+) ms per step", t, re.M)
mem = [float(x) for x in re.findall(r"^device memory: rank \d+, GPU \d+: ([\d.]+) GiB in use", t, re.M)]
print(f"  {sys.argv[2]:58s} {ms[0] if ms else 'FAILED':>7s} ms   {max(mem) if mem else float('nan'):5.2f} GiB in use")
PY
    }
    echo "== alternatives (ms per step, the largest rank's GPU memory in use)"
    for b in "$R/$m"-plan-pp-*.loom; do
      [ -d "$b" ] || continue
      name=$(basename "$b" .loom)
      row "$name" "$out/$name.log"
      for alt in ${PP_ALTS:-LOOM_CUDA_GRAPHS_P2P=0 LOOM_NCCL_LINK_CTAS=4}; do
        env $alt timeout 300 $B/loom-run "$b" --backend cuda --steps 10 > "$out/$name-$alt.log" 2>&1 || status=1
        row "$name $alt" "$out/$name-$alt.log"
      done
    done
    # Tensor parallelism beside the plan as compiled by default: no-overlap
    # (without loom-overlap-tensor-reduce), tp-overlap and sp_tp-overlap (with
    # --tp-overlap: loom-split-tensor-reduce, and under sp loom-overlap-tensor-gather).
    for b in "$R/$m"-alt-tp-*.loom; do
      [ -d "$b" ] || continue
      name=$(basename "$b" .loom)
      case $name in *_sp_*) base=$(ls -d "$R/$m"-plan-tp-*_mb-1_zero-0_sp-1.loom 2>/dev/null | head -1) ;;
                    *) base=$(ls -d "$R/$m"-plan-tp-*_mb-1_zero-0.loom 2>/dev/null | head -1) ;; esac
      [ -n "$base" ] && row "$(basename "$base" .loom) (the default)" "$out/$(basename "$base" .loom).log"
      timeout 300 $B/loom-run "$b" --backend cuda --steps 10 > "$out/$name.log" 2>&1 || status=1
      row "$name" "$out/$name.log"
    done
  fi
  if [ -z "${SKIP_TORCH:-}" ]; then
    case $m in gpt2-350m) dims="--layers 24 --hidden 1024 --heads 16" ;; *) dims="--layers 24 --hidden 2048 --heads 16" ;; esac
    echo "== PyTorch on the same model and cards, global batch $((8 * gpus)) (bf16 autocast)"
    timeout 400 torchrun --nproc_per_node=$gpus bench/torch_ddp.py $dims --batch $((8 * gpus)) --steps 10 \
        --modes ddp-bf16,fsdp2-bf16 2>&1 | grep -vE "^W[0-9]|OMP_NUM_THREADS|^\*+$" || status=1
  fi
done
exit $status
