#!/usr/bin/env python3
"""Row-table benchmark report: merges shardps_row_bench --json lines (ShardPS, with the bound
measured beside each point: hot, the same bytes each time, and cold, a different slice of a
256 MiB region each time) and bench/pslite_rows.sh --out lines (ps-lite's key-value pull/push,
same host, same window) into a markdown table (docs/benchmarks.md, "Row tables").

usage: rows_report.py SHARDPS.jsonl [PSLITE.jsonl|none] OUT.md
"""
import json
import sys


def load(path):
    rows = []
    if path and path != "none":
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    rows.append(json.loads(line))
    return rows


def cold(r, key, ratio=0):
    """A cold-bound field (files before it was measured have none: '–')."""
    v = r.get(key, 0)
    if not v:
        return "–"
    return f"{v:.2f}" if ratio else f"{v / 1e6:.2f} M"


def main():
    ours = load(sys.argv[1])
    theirs = {}
    for r in load(sys.argv[2]):
        theirs[(r["layout"], r["dist"], int(r["ids"]), int(r["dim"]), r["op"])] = r
    out = []
    out.append("| transport | layout | dist | dim | ids | op | ShardPS rows/s | GB/s | "
               "per worker | bound (1 read/write, same bytes) rows/s | ÷ bound | "
               "bound, one per worker at once | ÷ it | cold bound rows/s | ÷ it | "
               "cold bound, one per worker at once | ÷ it | ps-lite rows/s | ÷ ps-lite |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ours:
        key = (r["layout"].replace("-hashed", ""), r["dist"], int(r["ids"]), int(r["dim"]),
               r["op"])
        # ps-lite runs over tcp (ZeroMQ): its figures sit beside our tcp rows only.
        p = (theirs.get(key) if r["transport"] == "tcp" and not r["layout"].endswith("-hashed")
             else None)
        ps = f"{p['rows_per_s'] / 1e6:.2f} M" if p else "–"
        ratio = f"{r['rows_per_s'] / p['rows_per_s']:.2f}" if p and p["rows_per_s"] else "–"
        out.append(
            f"| {r['transport']} | {r['layout']} | {r['dist']} | {r['dim']} | {r['ids']} | "
            f"{r['op']} | {r['rows_per_s'] / 1e6:.2f} M | {r['gbps']:.3f} | "
            f"{r['per_worker'] / 1e6:.2f} M | {r['bound_rows_per_s'] / 1e6:.2f} M | "
            f"{r['ratio']:.2f} | {r.get('bound_all_rows_per_s', 0) / 1e6:.2f} M | "
            f"{r.get('ratio_all', 0):.2f} | {cold(r, 'cold_rows_per_s')} | "
            f"{cold(r, 'ratio_cold', 1)} | {cold(r, 'cold_all_rows_per_s')} | "
            f"{cold(r, 'ratio_cold_all', 1)} | {ps} | {ratio} |")
    with open(sys.argv[3], "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
