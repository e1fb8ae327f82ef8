#!/usr/bin/env bash
# The Python package's tests (ctest runs this as the test `python`):
#   1. a venv in BUILD/python-venv with NumPy, pytest, nanobind and
#      scikit-build-core from PyPI (python/requirements-dev.txt), installed
#      once: later runs find them and reach no registry;
#   2. `pip install ./python`, CPU backend only (CUDA toolkit not looked for), its CMake tree
#      kept in BUILD/python-build and compiled through ccache, timed;
#   3. pytest on python/tests, compiling bundles with BUILD's loomc and
#      checking training against BUILD's loom-run.
# usage: scripts/python-test.sh [BUILD]   (default build/; extra pytest
# arguments in PYTEST_ARGS)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
venv=$build/python-venv
# The system's packages (PyTorch, where installed) stay visible: the DLPack
# tests use it when it is there and skip when it is not.
if [ ! -x "$venv/bin/python" ]; then
  "${LOOM_PYTHON:-python3}" -m venv --system-site-packages "$venv"
fi
py=$venv/bin/python
requirements=$root/python/requirements-dev.txt
if ! cmp -s "$requirements" "$venv/requirements-installed.txt"; then
  "$py" -m pip install -q --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$venv/requirements-installed.txt"
fi
start=$(date +%s)
CCACHE_BASEDIR=$root "$py" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
  -C build-dir="$build/python-build" -C cmake.define.CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON "$root/python"
echo "python-test: pip install ./python took $(( $(date +%s) - start )) s"
cd "$build"
LOOM_BUILD_DIR=$build "$py" -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} "$root/python/tests"
