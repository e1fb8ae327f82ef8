#!/usr/bin/env bash
# Installs, idempotently, every Debian package that Loom's build and tests need.
# Safe to run again: packages already present are skipped without touching apt.
set -euo pipefail

packages=(
  cmake ninja-build ccache g++ python3
  llvm-19-dev libmlir-19-dev mlir-19-tools llvm-19-tools
  nlohmann-json3-dev libgtest-dev
  libopenmpi-dev openmpi-bin
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
