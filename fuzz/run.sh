#!/usr/bin/env bash
# Builds every fuzz target (cargo fuzz, libFuzzer, no sanitizer: stable Rust, safe code) and
# runs each in turn for a bounded time, then prints executions and crashes per target; exits
# non-zero if any target crashed (its input is kept under fuzz/artifacts/<target>/).
#
#   bash fuzz/run.sh [seconds-per-target]          # default 30
#   FUZZ_TARGETS="prompt_ids config" bash fuzz/run.sh 600
#   FUZZ_RUNS=10000000 bash fuzz/run.sh 3600         # stop each at 10 M executions (or 1 h)
#
# FUZZ_TARGET_DIR moves the build (default fuzz/target; CI keeps it in ~/.cache so a rerun on
# the same machine rebuilds only tokenonce).
#
# Seeds come from fuzz/corpus/<target>/ (committed, never written); what a run discovers goes
# to fuzz/work/<target>/ (ignored by git) and seeds the next local run. Installs cargo-fuzz
# from crates.io when missing (idempotent).
set -euo pipefail
cd "$(dirname "$0")"
SECONDS_PER_TARGET=${1:-30}
[[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ && "$SECONDS_PER_TARGET" -ge 1 ]] || {
  echo "usage: $0 [seconds-per-target]" >&2
  exit 2
}
ALL_TARGETS="sse_decoder json_splice prompt_ids request_view rewrites handoff config h1 engine_metrics kv_wire"
TARGETS=${FUZZ_TARGETS:-$ALL_TARGETS}
TRIPLE=x86_64-unknown-linux-gnu
TARGET_DIR=${FUZZ_TARGET_DIR:-target}
BIN="$TARGET_DIR/$TRIPLE/release"
RUNS=()
if [ -n "${FUZZ_RUNS:-}" ]; then RUNS=(-runs="$FUZZ_RUNS"); fi
CARGO_FUZZ_VERSION=0.13.2

if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "[fuzz] installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install --locked --quiet cargo-fuzz --version "$CARGO_FUZZ_VERSION"
fi
command -v c++ >/dev/null 2>&1 || { echo "[fuzz] no C++ compiler (libFuzzer): run .ci/setup" >&2; exit 1; }

# -O -a: release with debug assertions and overflow checks; 16 codegen units build several
# times faster than cargo-fuzz's default of 1 for a few percent of execution speed.
t0=$(date +%s)
# A failed build fails the run (a stale binary in a warm target dir must not stand in for it).
build_log=$(mktemp)
if ! cargo fuzz build -s none -O -a --codegen-units 16 --target-dir "$TARGET_DIR" >"$build_log" 2>&1; then
  grep -E "^error" -A12 "$build_log" >&2 || tail -40 "$build_log" >&2
  echo "[fuzz] build failed" >&2
  exit 1
fi
grep -E "^warning: unused|Finished" "$build_log" || true
rm -f "$build_log"
echo "[fuzz] built in $(( $(date +%s) - t0 )) s"

# Per-target input bound and dictionary: SSE inputs are decoded byte by byte, so a shorter
# bound keeps its execution rate near the others'.
max_len() { case $1 in sse_decoder) echo 512 ;; engine_metrics) echo 4096 ;; *) echo 2048 ;; esac; }
dict() { case $1 in sse_decoder) echo dicts/sse.dict ;; config) echo dicts/config.dict ;; h1) echo dicts/h1.dict ;; engine_metrics) echo dicts/prom.dict ;; kv_wire) echo dicts/kv.dict ;; *) echo dicts/json.dict ;; esac; }

failed=0
passed=0
report=()
for t in $TARGETS; do
  mkdir -p "work/$t" "artifacts/$t"
  log="artifacts/$t/last-run.log"
  before=$(find "artifacts/$t" -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' | wc -l)
  set +e
  timeout $(( SECONDS_PER_TARGET + 120 )) "$BIN/$t" "work/$t" "corpus/$t" "${RUNS[@]}" \
    -max_total_time="$SECONDS_PER_TARGET" -max_len="$(max_len "$t")" -dict="$(dict "$t")" \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="artifacts/$t/" >"$log" 2>&1
  rc=$?
  set -e
  after=$(find "artifacts/$t" -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' | wc -l)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  if [ -z "$execs" ]; then # a crash ends the run before the final stats
    execs=$(grep -oE '^#[0-9]+' "$log" | tail -n 1 | tr -d '#')
  fi
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  crashes=$(( after - before ))
  # A signal from outside ends libFuzzer with "run interrupted": a failed run, not a crash.
  if [ "$rc" -ne 0 ] && [ "$crashes" -eq 0 ]; then
    if grep -q "run interrupted" "$log"; then crashes=interrupted; else crashes=1; fi
  fi
  corpus=$(find "work/$t" -type f | wc -l)
  report+=("$(printf '%-13s %12s %9s %8s %7s' "$t" "${execs:-?}" "${rate:-?}" "$corpus" "$crashes")")
  if [ "$crashes" = 0 ]; then
    passed=$(( passed + 1 ))
  else
    failed=$(( failed + 1 ))
    echo "[fuzz] $t FAILED ($crashes, exit $rc); log: fuzz/$log" >&2
    grep -E -A8 "panicked at|ERROR: libFuzzer|SUMMARY" "$log" | head -n 30 >&2 || true
    echo "[fuzz] reproduce: (cd fuzz && $BIN/$t artifacts/$t/<crash-file>)" >&2
  fi
done

printf '%-13s %12s %9s %8s %7s\n' target executions execs/s corpus crashes
printf '%s\n' "${report[@]}"
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
