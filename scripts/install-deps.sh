#!/usr/bin/env bash
# Installs, idempotently, every Debian package that Loom's build and tests need,
# and cuDNN's frontend headers (scripts/cudnn-frontend.sh, from PyPI). clang-19
# and its sanitizer and libFuzzer runtimes build the sanitizer and fuzz tests
# (scripts/sanitize.sh, scripts/fuzz.sh).
# Safe to run again: packages already present are skipped without touching apt.
set -euo pipefail
here=$(dirname "$0")

packages=(
  cmake ninja-build ccache g++ python3 python3-pip
  llvm-19-dev libmlir-19-dev mlir-19-tools llvm-19-tools
  nlohmann-json3-dev libgtest-dev
  libopenmpi-dev openmpi-bin
  libopenblas-dev
  libsentencepiece-dev
  libcpp-httplib-dev
  clang-19 libfuzzer-19-dev libclang-rt-19-dev
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  "$here/cudnn-frontend.sh"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
"$here/cudnn-frontend.sh"
