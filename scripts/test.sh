#!/usr/bin/env bash
# Runs every ShardPS test tier from a fresh machine: installs packages, builds, then
#   0. clang's thread-safety analysis over the libraries (scripts/tsa.sh, build-tsa);
#   1. unit + conformance (tcp, shm) + benchmark smoke on the host, through ctest; then the
#      control-plane fuzz targets for 20 s each (scripts/fuzz.sh, counted as tests);
#   2. the verbs tier for real on SoftRoCE inside the qemu guest of ../shared/softroce
#      (two rxe devices joined by a veth). SHARDPS_REQUIRE_VERBS=1 there turns a skip into a
#      failure. If the harness is missing, the tier fails on a machine with /dev/kvm and is
#      reported as not run elsewhere.
# Ends with one line "tests: N passed, N failed, N skipped" counted from the gtest XML reports.
# Env: SHARDPS_SOFTROCE_DIR (default ../shared/softroce), SHARDPS_SKIP_VERBS=1 (host tiers only),
#      SHARDPS_BUILD_DIR (default build), CTEST_ARGS (extra ctest arguments).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${SHARDPS_BUILD_DIR:-build}
RESULTS="$ROOT/$BUILD/test-results"
SOFTROCE=${SHARDPS_SOFTROCE_DIR:-$ROOT/../shared/softroce}

"$ROOT/scripts/deps.sh" || { echo "test.sh: installing packages failed" >&2; exit 1; }
"$ROOT/scripts/build.sh" || { echo "test.sh: build failed" >&2; exit 1; }
# The digits data (scikit-learn, from Debian's python) for the tests that train on it: the plan
# validation smoke (bench.plan_smoke) skips without it.
DATA_DIR=${SHARDPS_DATA_DIR:-$ROOT/$BUILD/data}
if [[ ! -s $DATA_DIR/digits_train.bin ]]; then
  timeout 120 "${SHARDPS_PYTHON:-/usr/bin/python3}" "$ROOT/scripts/export_digits.py" \
    --out "$DATA_DIR" || { echo "test.sh: exporting the digits data failed" >&2; exit 1; }
fi

rm -rf "$RESULTS" && mkdir -p "$RESULTS/host" "$RESULTS/verbs"
status=0

# Clang's thread-safety analysis over the libraries (scripts/tsa.sh, build-tsa): a violated
# GUARDED_BY / REQUIRES fails the run.
echo "=== thread-safety analysis: clang -Wthread-safety (scripts/tsa.sh) ==="
"$ROOT/scripts/tsa.sh" || status=1

echo "=== host tiers: unit, conformance (tcp, shm), benchmark smoke ==="
# ctest's own JUnit report: one file, written once (per-process gtest XML files would race
# when ctest runs two tests at a time).
ctest --test-dir "$BUILD" --output-on-failure --output-junit "$RESULTS/host/ctest.xml" \
  --timeout 900 -j 2 ${CTEST_ARGS:-} || status=1

# Control-plane fuzzing, bounded (20 s per target; the nightly run is scripts/fuzz.sh with its
# default 600 s). Each target is one test result in the count below (fuzz.xml, ctest's format);
# a machine that cannot build the fuzz targets (no clang) fails here, loudly.
echo "=== fuzz: control-plane libFuzzer targets, 20 s each ==="
if ! "$ROOT/scripts/fuzz.sh" --seconds 20 --junit "$RESULTS/host/fuzz.xml"; then
  status=1
  [[ -s "$RESULTS/host/fuzz.xml" ]] || printf '%s\n' '<?xml version="1.0"?>' \
    '<testsuite name="fuzz"><testcase name="fuzz" status="fail"><failure message="fuzz.sh failed"/></testcase></testsuite>' \
    >"$RESULTS/host/fuzz.xml"
fi

verbs_ran=0
if [[ ${SHARDPS_SKIP_VERBS:-0} == 1 ]]; then
  echo "=== verbs tier: skipped (SHARDPS_SKIP_VERBS=1) ==="
elif [[ -x "$SOFTROCE/run-in-guest.sh" ]]; then
  echo "=== verbs tier: SoftRoCE guest ($SOFTROCE) ==="
  if "$SOFTROCE/build-guest.sh"; then
    "$SOFTROCE/run-in-guest.sh" --timeout 2100 --rw "$RESULTS/verbs" \
      --env SHARDPS_REQUIRE_VERBS=1 --env "GLOG_logtostderr=1" -- sh -c "
        set -e
        '$SOFTROCE/softroce-up.sh' 2
        before=\$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts)
        rc=0
        run() {  # run BINARY FILTER NAME: one gtest binary's verbs instances, XML kept
          if [ -x \"\$1\" ]; then
            \"\$1\" --gtest_color=no --gtest_filter=\"\$2\" \
              --gtest_output=xml:'$RESULTS/verbs/'\"\$3\".xml || rc=1
          fi
        }
        run '$BUILD/tests/unit_tests' 'Verbs*' unit_verbs
        run '$BUILD/tests/transport_conformance_test' '*/verbs' conformance_verbs
        run '$BUILD/tests/integration_tests' '*/verbs:*/verbs_*' integration_verbs
        run '$BUILD/tests/process_cluster_test' '*/verbs:*/verbs_*' process_verbs
        run '$BUILD/tests/consistency_property_test' '*/verbs:*/verbs_*' consistency_verbs
        run '$BUILD/tests/hierarchical_test' '*/verbs:*/verbs_*' hierarchical_verbs
        run '$BUILD/tests/doctor_test' 'DoctorVerbs*' doctor_verbs
        after=\$(cat /sys/class/infiniband/rxe0/ports/1/hw_counters/sent_pkts)
        echo \"rxe0 sent \$((after - before)) packets on the wire during the verbs tier\"
        [ \$((after - before)) -gt 0 ] || { echo 'no packet crossed the wire' >&2; rc=1; }
        exit \$rc"
    rc=$?
    [[ $rc -eq 0 ]] || { echo "verbs tier failed (rc $rc)" >&2; status=1; }
    verbs_ran=1
  else
    echo "verbs tier: building the SoftRoCE guest failed" >&2
    status=1
  fi
elif [[ -e /dev/kvm ]]; then
  echo "verbs tier: NOT RUN — no SoftRoCE harness at $SOFTROCE, but this machine has /dev/kvm;" \
       "set SHARDPS_SOFTROCE_DIR" >&2
  status=1
else
  echo "=== verbs tier: not run (no SoftRoCE harness and no /dev/kvm here) ==="
fi

# Count gtest results from the XML reports (host and guest).
/usr/bin/env python3 - "$RESULTS" "$verbs_ran" <<'PY' || status=1
import glob, sys, xml.etree.ElementTree as ET
root, verbs_ran = sys.argv[1], sys.argv[2] == "1"
tot = {"host": [0, 0, 0], "verbs": [0, 0, 0]}
failed = []  # (tier, name, output tail): printed last, where a CI log's tail shows them
def tail(tc, n=60):
    text = ""
    for tag in ("failure", "error", "system-out", "system-err"):
        for e in tc.iter(tag):
            text += (e.get("message") or "") + "\n" + (e.text or "")
    return "\n".join(text.strip().splitlines()[-n:])
for tier in tot:
    for f in glob.glob(f"{root}/{tier}/*.xml"):
        try:
            tree = ET.parse(f)
        except ET.ParseError as e:
            print(f"unreadable report {f}: {e}"); tot[tier][1] += 1; continue
        for tc in tree.iter("testcase"):
            st = tc.get("status")
            if tier == "host":  # ctest JUnit: status run | fail | notrun | disabled
                if st == "fail" or tc.find("failure") is not None:
                    tot[tier][1] += 1
                    failed.append((tier, tc.get("name"), tail(tc)))
                elif st in ("notrun", "disabled"):
                    tot[tier][2] += 1
                else:
                    tot[tier][0] += 1
                continue
            if st == "notrun":
                continue
            if tc.find("failure") is not None or tc.find("error") is not None:
                tot[tier][1] += 1
                failed.append((tier, f'{tc.get("classname")}.{tc.get("name")}', tail(tc, 20)))
            elif tc.find("skipped") is not None or tc.get("result") == "skipped":
                tot[tier][2] += 1
            else:
                tot[tier][0] += 1
for i, (tier, name, out) in enumerate(failed):
    if i < 4:
        print(f"=== FAILED ({tier} tier): {name} — the end of its output ===")
        print(out)
    print(f"FAILED ({tier} tier): {name}")
for tier, (p, f, s) in tot.items():
    print(f"{tier} tier: {p} passed, {f} failed, {s} skipped")
bad = False
if verbs_ran and tot["verbs"][0] == 0:
    print("verbs tier ran no test"); bad = True
if verbs_ran and tot["verbs"][2] > 0:
    print("verbs tier skipped tests inside the SoftRoCE guest"); bad = True
p = sum(v[0] for v in tot.values()); f = sum(v[1] for v in tot.values())
s = sum(v[2] for v in tot.values())
print(f"tests: {p} passed, {f} failed, {s} skipped")
sys.exit(1 if bad or f else 0)
PY
exit $status
