#!/usr/bin/python3
"""Flattens a shardps doctor JSON report (or probe file) into tab-separated lines for
tests/doctor/doctor_test.cc, and with --table checks that every JSON check appears in the
people's table with the same status, name, detail and fix.

  check  NAME STATUS DETAIL FIX
  pair   TO OK TRANSPORT W_ALPHA W_BETA R_ALPHA R_BETA VERIFIED SMALL LARGE FROM
  port   DEVICE:PORT STATE AUTO_GID AUTO_GID_REASON
  exit_status N          (reports only)
  table_match 1|0        (with --table)
"""
import json
import math
import sys


def main():
    doc = json.load(open(sys.argv[1]))
    out = []
    if "exit_status" in doc:
        out.append("exit_status\t%d" % doc["exit_status"])
    for c in doc.get("checks", []):
        out.append("\t".join(["check", c["name"], c["status"], c["detail"], c["fix"]]))
    for p in doc.get("pairs", []):
        w, r = p["write"], p["read"]
        nums = [w["alpha_us"], w["beta_Bps"], r["alpha_us"], r["beta_Bps"]]
        nums = ["nan" if v is None or not math.isfinite(v) else repr(float(v)) for v in nums]
        out.append("\t".join(["pair", p["to"], "1" if p["ok"] else "0", p["transport"]] + nums +
                             [str(p["verified_bytes"]), str(w["small_bytes"]),
                              str(w["large_bytes"]), p["from"]]))
    for p in doc.get("rdma_ports", []):
        out.append("\t".join(["port", "%s:%d" % (p["device"], p["port"]), p["state"],
                              str(p["auto_gid_index"]), p["auto_gid_reason"]]))
    if len(sys.argv) > 3 and sys.argv[2] == "--table":
        table = open(sys.argv[3]).read().splitlines()
        ok = True
        for c in doc.get("checks", []):
            want = "%-7s%s" % (c["status"].upper(), c["name"])
            rows = [l for l in table if l.startswith(want + " ")]
            if len(rows) != 1 or c["detail"] not in rows[0] or (c["fix"] and c["fix"] not in rows[0]):
                print("table mismatch for check %r: %r" % (c["name"], rows), file=sys.stderr)
                ok = False
        out.append("table_match\t%d" % (1 if ok else 0))
    print("\n".join(out))


if __name__ == "__main__":
    main()
