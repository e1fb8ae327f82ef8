#!/usr/bin/env bash
# Unpacks the headers of cuDNN's frontend (header-only C++ over cuDNN's
# backend API; the CUDA backend builds its fused attention graphs with it)
# into .deps/cudnn-frontend/include, from the pinned PyPI wheel. Idempotent;
# without network or pip it says so and the runtime builds without it (our
# flash kernels then run every attention). docs/development.md says why.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.32.0
dest=.deps/cudnn-frontend
if grep -qs "^$version\$" "$dest/VERSION"; then
  echo "cudnn-frontend: $version present"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
     --platform manylinux_2_28_x86_64 "nvidia-cudnn-frontend==$version" -d "$tmp" >&2; then
  echo "cudnn-frontend: could not download nvidia-cudnn-frontend==$version; cuDNN attention stays off" >&2
  exit 0
fi
rm -rf "$dest" && mkdir -p "$dest"
python3 - "$tmp"/*.whl "$dest" <<'PY'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("include/")])
PY
echo "$version" > "$dest/VERSION"
echo "cudnn-frontend: $version unpacked into $dest/include ($(du -sh "$dest" | cut -f1))"
