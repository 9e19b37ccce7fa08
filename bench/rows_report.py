#!/usr/bin/env python3
"""Row-table benchmark report: merges shardps_row_bench --json lines (ShardPS, with the bound
measured beside each point: hot, the same bytes each time, and cold, a different slice of a
256 MiB region each time) and bench/pslite_rows.sh --out lines (ps-lite's key-value pull/push,
same host, same window) into a markdown table (docs/benchmarks.md, "Row tables").

usage: rows_report.py SHARDPS.jsonl [PSLITE.jsonl|none] OUT.md
       rows_report.py --target TARGET.jsonl OUT.md

--target: the issue's target point (a 4,096 x 64 pull >= 0.5x one contiguous read of the same
bytes), from a run of many short interleaved rounds: ours per worker from the median batch time
over the hot bound (the same bytes every time, cache-warm) and over the cold one (a different
slice of a 256 MiB region every time, as cold as rows scattered over the table are), and the
gather floor (the same rows copied out of a local table: no transport, no checks).
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


TARGET = 0.5


def target(src, dst):
    out = ["| transport | layout | dist | rounds | ours per worker (p50) | ÷ hot bound | "
           "÷ cold bound | ÷ cold bound at W streams | gather floor | ≥ 0.5× hot | ≥ 0.5× cold |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in load(src):
        hot, cold_r = r.get("ratio_p50", 0), r.get("ratio_cold_p50", 0)
        out.append(
            f"| {r['transport']} | {r['layout']} | {r['dist']} | {r.get('rounds', 1)} | "
            f"{r.get('p50_per_worker', 0) / 1e6:.2f} M | {hot:.2f} | {cold_r:.2f} | "
            f"{r.get('ratio_cold_all', 0):.2f} | {r.get('floor_rows_per_s', 0) / 1e6:.1f} M | "
            f"{'yes' if hot >= TARGET else '**no**'} | "
            f"{'yes' if cold_r >= TARGET else '**no**'} |")
    with open(dst, "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


def main():
    if sys.argv[1] == "--target":
        target(sys.argv[2], sys.argv[3])
        return
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
