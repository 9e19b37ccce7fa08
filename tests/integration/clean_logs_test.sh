#!/usr/bin/env bash
# A clean run logs no ERROR and no WARNING (issue 17): scripts/launch-local.sh trains digits on
# 2 groups x 2 replicas (primary + backup) and 2 workers, then every process exits at the job's
# end. Every log of the run must be free of glog's E and W lines, and the run must end with its
# "final:" line. Covers the job-end paths that used to warn for nothing: workers leaving,
# endpoints closing, the backup's replication stream ending, a primary leaving after the
# workers were done. Once per transport given (tcp, shm).
# usage: clean_logs_test.sh SOURCE_DIR BUILD_DIR TRANSPORT...   exit 0 pass, 1 fail, 77 skip
set -uo pipefail
ROOT=$(cd "$1" && pwd)
BUILD=$(cd "$2" && pwd)
shift 2
PY=${SHARDPS_PYTHON:-/usr/bin/python3}
"$PY" -c 'import sklearn' 2>/dev/null ||
  { echo "SKIP: scikit-learn is not importable by $PY (the digits data)"; exit 77; }
DATA="$BUILD/data"
[[ -s $DATA/digits_test.bin && -s $DATA/digits_train.bin ]] ||
  timeout 60 "$PY" "$ROOT/scripts/export_digits.py" --out "$DATA" >/dev/null
T=$(mktemp -d "${TMPDIR:-/tmp}/shardps-cleanlogs.XXXXXX")
trap '[[ -n ${KEEP:-} ]] || rm -rf "$T"' EXIT
fails=0
for transport in "$@"; do
  run="$T/$transport"
  SHARDPS_BUILD_DIR="$BUILD" SHARDPS_DATA_DIR="$DATA" GLOG_minloglevel=0 \
    timeout -s KILL 300 "$ROOT/scripts/launch-local.sh" --servers 2 --replicas 2 --workers 2 \
    --transport "$transport" --timeout 240 --run-dir "$run" --quiet -- --epochs 3 \
    >"$T/launch-$transport.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 ]] || ! grep -q "final:" "$T/launch-$transport.log"; then
    echo "FAIL: $transport: the run failed (exit $rc)"; tail -20 "$T/launch-$transport.log"
    fails=$((fails + 1))
    continue
  fi
  logs=("$run"/*.log)
  # The one WARNING about the host, not the run: the coordinator's report that it was itself
  # descheduled (a loaded host; it then does not count the pause as its members' silence).
  bad=$(grep -HE '^[EWF][0-9]{8} ' "${logs[@]}" | grep -v '\] coordinator: this process was descheduled for' || true)
  if [[ -n $bad ]]; then
    echo "FAIL: $transport: a clean run logged $(wc -l <<<"$bad") ERROR/WARNING line(s):"
    head -20 <<<"$bad"
    fails=$((fails + 1))
  else
    echo "clean_logs: $transport: ${#logs[@]} logs, no ERROR or WARNING line;" \
         "$(grep -ho 'final: test accuracy [0-9.]*' "$T/launch-$transport.log")"
  fi
done
[[ $fails -eq 0 ]] && echo "clean_logs: PASS" || exit 1
