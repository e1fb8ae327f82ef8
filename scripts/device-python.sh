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
  rm -rf .deps/wheels .deps/python-bundles && mkdir -p .deps/wheels .deps/python-bundles
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
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip install -q --disable-pip-version-check --no-index \
  --no-build-isolation --no-deps -C build-dir=build-python-cuda ./python
echo "built and installed in $(( $(date +%s) - start )) s"
status=0
echo "== python/examples/torch_gpu.py"
python3 python/examples/torch_gpu.py .deps/python-bundles/gpt-tiny-infer.loom || status=1
echo "== pytest python/tests (the CUDA tests included)"
# Run from elsewhere so that `import loom` is the installed package.
root=$(pwd)
(cd /tmp && LOOM_TEST_BUNDLES="$root/.deps/python-bundles" python3 -m pytest -q -p no:cacheprovider -rs \
  "$root/python/tests") || status=1
exit $status
