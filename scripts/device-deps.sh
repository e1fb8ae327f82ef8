#!/usr/bin/env bash
# Prepares .deps/ (git-ignored) for the GPU machine, which has no package
# registry: the nlohmann/json header, the GoogleTest sources and cuDNN's frontend
# headers (scripts/install-deps.sh fetches those into .deps/cudnn-frontend). Name `.deps`
# in the device tool's `carry`, then run scripts/device-build.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
mkdir -p .deps/include
cp -r /usr/include/nlohmann .deps/include/
rm -rf .deps/googletest
cp -r /usr/src/googletest .deps/googletest
du -sh .deps
