#!/usr/bin/env bash
# Runs each libFuzzer target of the sanitizer build (scripts/sanitize.sh build)
# for a bounded time, starting from its seed corpus and every regression input.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]   default: 10 seconds each, every target
#
# Targets: manifest, safetensors, tokens, tokenizer, cluster, plan, verify (fuzz/*.cpp).
# Seeds are fuzz/corpus/TARGET (verify also takes models/ and the loomc test
# inputs); inputs that found new coverage go to build-san/fuzz/corpus/TARGET.
# A crash leaves build-san/fuzz/TARGET-crash-* and fails the run: fix the
# reader, then add the input to fuzz/regressions/TARGET/, which ctest replays.
# ctest runs this as the test `fuzz` (label "sanitizer").
set -euo pipefail
cd "$(dirname "$0")/.."
SAN=${LOOM_SAN_BUILD_DIR:-build-san}
seconds=${1:-10}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(manifest safetensors tokens tokenizer cluster plan verify)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

status=0
mkdir -p "$SAN/fuzz"
for t in "${targets[@]}"; do
  bin="$SAN/fuzz/loom-fuzz-$t"
  if [ ! -x "$bin" ]; then
    echo "fuzz: error: $bin is not built: run scripts/sanitize.sh build" >&2
    status=1
    continue
  fi
  seeds=()
  for d in fuzz/corpus/"$t" fuzz/regressions/"$t"; do [ -d "$d" ] && seeds+=("$d"); done
  [ "$t" = verify ] && seeds+=(models test/loomc/Inputs test/Dialect) # model files
  mkdir -p "$SAN/fuzz/corpus/$t"
  log="$SAN/fuzz/$t.log"
  start=$(date +%s)
  if "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix="$SAN/fuzz/$t-" "$SAN/fuzz/corpus/$t" "${seeds[@]}" > "$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    echo "fuzz: $t: $runs runs in $(( $(date +%s) - start )) s, no crash"
  else
    echo "fuzz: $t: FOUND A CRASH after $(( $(date +%s) - start )) s; the last of its log ($log):"
    tail -60 "$log"
    echo "fuzz: $t: reproduce with: $bin $(ls -t "$SAN/fuzz/$t"-* 2>/dev/null | grep -v '\.log$' | head -1)"
    echo "fuzz: $t: fix the reader, then copy that input into fuzz/regressions/$t/"
    status=1
  fi
done
exit $status
