#!/usr/bin/env bash
# Builds the control-plane libFuzzer targets (tests/fuzz) in build-fuzz with clang and runs each
# for N seconds on its seed corpus (tests/fuzz/corpus/<target>). New corpus entries go to a
# scratch copy (build-fuzz/corpus-work/<target>), not the repository, unless --update-corpus
# (then only inputs that add coverage are merged into tests/fuzz/corpus/<target>).
# Prints per target: executions, exec/s, corpus size, crashes. Exits non-zero on any crash,
# leak, timeout or out-of-memory; the input that caused it is kept under build-fuzz/artifacts/
# (reproduce: build-fuzz/tests/fuzz/<target> <artifact>).
#
# usage: scripts/fuzz.sh [--seconds N] [--jobs J] [--update-corpus] [--regen-corpus]
#                        [--junit FILE] [--targets "fuzz_framing ..."]
#   --seconds N      per target (default 600, the nightly run; CI uses 20)
#   --jobs J         run up to J targets at the same time (default 1)
#   --update-corpus  merge new coverage into tests/fuzz/corpus/
#   --regen-corpus   rewrite the seed files with fuzz_corpus_gen first (the generated names)
#   --junit FILE     also write one JUnit testcase per target (scripts/test.sh counts them)
# Env: SHARDPS_FUZZ_BUILD_DIR (default build-fuzz).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${SHARDPS_FUZZ_BUILD_DIR:-build-fuzz}
[[ $BUILD == /* ]] || BUILD="$ROOT/$BUILD"
SECONDS_PER=600
JOBS=1
UPDATE=0
REGEN=0
JUNIT=""
TARGETS="fuzz_framing fuzz_descriptor fuzz_coordinator"
while (($#)); do
  case "$1" in
    --seconds) SECONDS_PER=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --update-corpus) UPDATE=1; shift ;;
    --regen-corpus) REGEN=1; shift ;;
    --junit) JUNIT=$2; shift 2 ;;
    --targets) TARGETS=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

write_junit() {  # write_junit STATUS_LINES...: "name status message"
  [[ -n $JUNIT ]] || return 0
  mkdir -p "$(dirname "$JUNIT")"
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuite name=\"fuzz\" tests=\"$#\">"
    for line in "$@"; do
      read -r name st msg <<<"$line"
      if [[ $st == run ]]; then
        echo "  <testcase name=\"fuzz.$name\" classname=\"fuzz\" status=\"run\"/>"
      else
        echo "  <testcase name=\"fuzz.$name\" classname=\"fuzz\" status=\"fail\">"
        echo "    <failure message=\"${msg//\"/}\"/>"
        echo "  </testcase>"
      fi
    done
    echo "</testsuite>"
  } >"$JUNIT"
}

fail_all() {  # the build itself failed: every target counts as failed
  echo "fuzz.sh: $1" >&2
  local lines=()
  for t in $TARGETS; do lines+=("$t fail $1"); done
  write_junit "${lines[@]}"
  exit 1
}

CLANG=$(command -v clang || true)
CLANGXX=$(command -v clang++ || true)
[[ -n $CLANG && -n $CLANGXX ]] ||
  fail_all "clang/clang++ not found: the fuzz build needs them (scripts/deps.sh installs clang and libclang-rt-14-dev)"

launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
mkdir -p "$BUILD"
echo "=== fuzz: configuring $BUILD (clang, libFuzzer + ASan + UBSan) ==="
CC=$CLANG CXX=$CLANGXX nice -n 10 cmake -S . -B "$BUILD" -DSHARDPS_FUZZ=ON \
  -DCMAKE_C_COMPILER="$CLANG" -DCMAKE_CXX_COMPILER="$CLANGXX" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSHARDPS_WITH_VERBS=OFF -DSHARDPS_WITH_CUDA=OFF -DSHARDPS_WITH_PYTHON=OFF \
  -DSHARDPS_BUILD_BENCH=OFF "${launcher[@]}" >"$BUILD/configure.log" 2>&1 ||
  { tail -30 "$BUILD/configure.log" >&2; fail_all "configuring $BUILD failed"; }
echo "=== fuzz: building $TARGETS ==="
# shellcheck disable=SC2086
nice -n 10 cmake --build "$BUILD" -j"$(nproc)" --target $TARGETS fuzz_corpus_gen \
  >"$BUILD/build.log" 2>&1 ||
  { grep -E "error|Error" "$BUILD/build.log" | head -20 >&2; fail_all "building the fuzz targets failed"; }

if ((REGEN)); then
  "$BUILD/tests/fuzz/fuzz_corpus_gen" "$ROOT/tests/fuzz/corpus" || fail_all "corpus generator failed"
fi

ARTIFACTS="$BUILD/artifacts"
WORK="$BUILD/corpus-work"
mkdir -p "$ARTIFACTS" "$WORK"

run_target() {  # run_target NAME: fuzz it, leave a summary in $WORK/NAME.summary
  local t=$1 bin="$BUILD/tests/fuzz/$1" seed="$ROOT/tests/fuzz/corpus/$1" scratch="$WORK/$1"
  local log="$WORK/$t.log"
  rm -rf "$scratch" && mkdir -p "$scratch"
  local before
  before=$(find "$ARTIFACTS" -maxdepth 1 -name "$t-*" 2>/dev/null | wc -l)
  # New units go to the first directory (the scratch one); the seeds are read, never written.
  # -timeout: one input running this long is a hang; -rss_limit_mb: an input that makes the
  # process this big is an out-of-memory bug.
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 \
    nice -n 10 "$bin" -max_total_time="$SECONDS_PER" -timeout=25 -rss_limit_mb=2048 \
    -max_len=16384 -print_final_stats=1 -artifact_prefix="$ARTIFACTS/$t-" \
    "$scratch" "$seed" >"$log" 2>&1
  local rc=$?
  local after
  after=$(find "$ARTIFACTS" -maxdepth 1 -name "$t-*" 2>/dev/null | wc -l)
  local execs rate
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  local corpus
  corpus=$(($(find "$scratch" -type f | wc -l) + $(find "$seed" -type f | wc -l)))
  local crashes=$((after - before))
  local st=run msg=""
  if ((rc != 0 || crashes > 0)); then
    st=fail
    ((crashes > 0)) || crashes=1
    msg="libFuzzer exit $rc; see $log and $ARTIFACTS/$t-*"
  fi
  if ((UPDATE)) && [[ $st == run ]]; then
    "$bin" -merge=1 "$seed" "$scratch" >"$WORK/$t.merge.log" 2>&1 ||
      echo "fuzz.sh: merging $t's corpus failed (see $WORK/$t.merge.log)" >&2
  fi
  printf '%s: %s executions, %s exec/s, corpus %s files, %s crashes (%s s)%s\n' "$t" \
    "${execs:-?}" "${rate:-?}" "$corpus" "$crashes" "$SECONDS_PER" \
    "$([[ $st == fail ]] && echo " FAILED: $msg")" >"$WORK/$t.summary"
  echo "$t $st $msg" >"$WORK/$t.status"
  if [[ $st == fail ]]; then
    grep -E "ERROR: |SUMMARY: |check failed|Test unit written" "$log" | head -8 >>"$WORK/$t.summary"
  fi
}

echo "=== fuzz: $SECONDS_PER s per target, $JOBS at a time ==="
running=0
for t in $TARGETS; do
  run_target "$t" &
  running=$((running + 1))
  if ((running >= JOBS)); then
    wait -n
    running=$((running - 1))
  fi
done
wait

status=0
lines=()
for t in $TARGETS; do
  cat "$WORK/$t.summary"
  line=$(cat "$WORK/$t.status")
  lines+=("$line")
  [[ $line == "$t run"* ]] || status=1
done
write_junit "${lines[@]}"
if ((status)); then
  echo "fuzz: FAILED; artifacts under $ARTIFACTS (reproduce: $BUILD/tests/fuzz/<target> <artifact>)"
else
  echo "fuzz: all targets passed"
fi
exit $status
