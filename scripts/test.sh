#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (lit + gtest) through
# ctest, which ends with its summary line. GPU tests skip where no GPU is.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
cd "${LOOM_BUILD_DIR:-build}"
ctest --output-on-failure --parallel "$(nproc)"
