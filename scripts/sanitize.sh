#!/usr/bin/env bash
# The runtime under AddressSanitizer and UndefinedBehaviorSanitizer, with
# clang-19 and without the CUDA backend, in its own build directory.
#
#   scripts/sanitize.sh build         configure and build build-san/: the runtime,
#                                     its tests and tools, the fuzz targets (of the
#                                     compiler, only the dialect and the planner)
#   scripts/sanitize.sh test BUILD    run the runtime's tests, the bundle
#                                     corruption tests and loom-run's lit tests
#                                     under them, on bundles that BUILD (an ordinary
#                                     build directory) compiles with its loomc
#
# ctest runs both as the tests sanitize-build and sanitize (label "sanitizer").
# LOOM_SAN_BUILD_DIR (default build-san) and LOOM_JOBS (default nproc) apply.
set -euo pipefail
cd "$(dirname "$0")/.."
SAN=$(realpath -m "${LOOM_SAN_BUILD_DIR:-build-san}")
say() { echo "sanitize: $*"; }
die() { echo "sanitize: error: $*" >&2; exit 1; }

# Sanitizer reports end the test with a failure and a stack.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

build() {
  command -v clang++-19 >/dev/null ||
    die "clang++-19 not found: run scripts/install-deps.sh (clang-19, libfuzzer-19-dev, libclang-rt-19-dev)"
  local probe
  probe=$(mktemp -d)
  echo 'extern "C" int LLVMFuzzerTestOneInput(const char *, unsigned long) { return 0; }' > "$probe/p.cpp"
  if ! clang++-19 -fsanitize=address,undefined,fuzzer "$probe/p.cpp" -o "$probe/p" 2> "$probe/log"; then
    cat "$probe/log" >&2
    rm -rf "$probe"
    die "clang++-19 cannot link a sanitized libFuzzer target: run scripts/install-deps.sh (libfuzzer-19-dev, libclang-rt-19-dev)"
  fi
  rm -rf "$probe"
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  if [ ! -f "$SAN/CMakeCache.txt" ] || { [ ! -f "$SAN/build.ninja" ] && [ ! -f "$SAN/Makefile" ]; }; then
    say "configuring $SAN (clang-19, ASan + UBSan, libFuzzer, no CUDA)"
    mkdir -p "$SAN"
    cmake -S . -B "$SAN" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_C_COMPILER=clang-19 -DCMAKE_CXX_COMPILER=clang++-19 \
      -DLOOM_SANITIZE=ON -DLOOM_FUZZ=ON -DLOOM_SANITIZER_TESTS=OFF \
      -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON > "$SAN/configure.log" 2>&1 ||
      { tail -30 "$SAN/configure.log" >&2; rm -f "$SAN/CMakeCache.txt"; die "configuring $SAN failed (log: $SAN/configure.log)"; }
  fi
  say "building $SAN"
  cmake --build "$SAN" --parallel "${LOOM_JOBS:-$(nproc)}" \
    --target loom-runtime-tests loom-corruption-tests loom-run loom-compare loom-tokenize loom-embed-example \
      loom-serve-example loom-fuzzers
}

run_tests() {
  local build=${1:-} lit=${2:-/usr/lib/llvm-19/build/utils/lit/lit.py}
  [ -n "$build" ] && [ -x "$build/compiler/loomc" ] && [ -f "$build/test/lit.site.cfg.py" ] ||
    die "usage: scripts/sanitize.sh test BUILD [LIT] (BUILD: an ordinary build directory, with loomc)"
  [ -x "$SAN/test/unit/loom-runtime-tests" ] || die "$SAN is not built: run scripts/sanitize.sh build"
  local status=0 bundle="$SAN/corruption/gpt-tiny.loom"
  say "runtime tests"
  "$SAN/test/unit/loom-runtime-tests" --gtest_brief=1 || { say "FAILED: the runtime tests under ASan/UBSan"; status=1; }
  mkdir -p "$SAN/corruption"
  "$build/compiler/loomc" compile models/gpt-tiny.mlir --batch 2 -o "$bundle" > /dev/null
  say "bundle corruption tests"
  LOOM_TEST_BUNDLE="$bundle" "$SAN/test/unit/loom-corruption-tests" --gtest_brief=1 ||
    { say "FAILED: the corruption tests under ASan/UBSan"; status=1; }
  # loom-run's lit tests (inference, fusion, errors, token files, checkpoints)
  # on bundles from the ordinary loomc. Not the long training runs (hundreds
  # of steps; about 8x slower under ASan) nor mpirun.
  say "loom-run's lit tests (test/runtime, training/bad-data, training/checkpoint-resume)"
  LOOM_LIT_RUNTIME_DIR="$SAN/runtime" LOOM_LIT_EXEC_ROOT="$SAN/lit" python3 "$lit" -s "$build/test" \
    --filter 'runtime/|training/(bad-data|checkpoint-resume)' ||
    { say "FAILED: loom-run's lit tests under ASan/UBSan"; status=1; }
  [ $status -eq 0 ] && say "no sanitizer reports, every test passed"
  return $status
}

case "${1:-}" in
  build) build ;;
  test) run_tests "${2:-}" "${3:-}" ;;
  *) die "usage: scripts/sanitize.sh build | test BUILD [LIT]" ;;
esac
