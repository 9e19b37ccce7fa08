#!/usr/bin/env python3
"""Checks a merged trace of a BSP run (tests/trace/trace_cluster_test.sh) on its data.

usage: check_trace.py MERGED.json --workers W --servers S --steps N [--summary SUMMARY.txt]
Exit 0 when every check holds; 1 with the failures listed otherwise.
"""

import argparse
import collections
import json
import re
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("merged")
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--servers", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--summary", default="")
    a = ap.parse_args()
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)
        return cond

    with open(a.merged) as f:
        doc = json.load(f)  # the merged file is JSON (raises otherwise)
    events = doc["traceEvents"]
    procs = {p["pid"]: p["label"] for p in doc["shardps_merge"]["processes"]}
    labels = sorted(procs.values())
    want = (["coordinator"] + ["worker %d" % r for r in range(a.workers)])
    for w in want:
        check(w in labels, "process %r missing from %s" % (w, labels))
    servers = [l for l in labels if re.match(r"server g\d+ r\d+$", l)]
    check(len(servers) == a.servers, "expected %d servers, got %s" % (a.servers, labels))
    check(all(p["dropped_events"] == 0 for p in doc["shardps_merge"]["processes"]),
          "events were dropped")
    # Sorted on the merged clock.
    ts = [e["ts"] for e in events if e.get("ph") != "M"]
    check(ts == sorted(ts), "events not sorted by time")

    worker_of = {pid: int(l.split()[1]) for pid, l in procs.items() if l.startswith("worker ")}
    group_of = {pid: int(re.match(r"server g(\d+)", l).group(1)) for pid, l in procs.items()
                if l.startswith("server g")}
    steps = collections.defaultdict(dict)          # worker -> step -> event
    pushes = collections.defaultdict(list)         # worker -> [event]
    pulls = collections.defaultdict(list)
    push_at = {}                                   # (worker, chunk, clock) -> push event
    applies = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = e.get("args", {})
        if e["pid"] in worker_of:
            w = worker_of[e["pid"]]
            if e["name"] == "step":
                check(args["step"] not in steps[w], "worker %d: step %d twice" % (w, args["step"]))
                steps[w][args["step"]] = e
            elif e["name"] == "push":
                pushes[w].append(e)
                key = (w, args["chunk"], args["clock"])
                check(key not in push_at, "worker %d pushed chunk %d at clock %d twice" % key)
                push_at[key] = e
            elif e["name"] == "pull":
                pulls[w].append(e)
        elif e["pid"] in group_of and e["name"] == "apply":
            applies.append(e)

    # The chunks: every chunk some server applied (the model, as the servers hold it).
    chunks = sorted({e["args"]["chunk"] for e in applies})
    check(len(chunks) >= 4, "expected >= 4 chunks (512-byte partitions), got %s" % chunks)
    server_of_chunk = {}
    for w in range(a.workers):
        check(sorted(steps[w]) == list(range(1, a.steps + 1)),
              "worker %d: step spans %s, expected 1..%d" % (w, sorted(steps[w]), a.steps))
        for s, st in sorted(steps[w].items()):
            lo, hi = st["ts"], st["ts"] + st["dur"]
            inside = lambda e: e["ts"] >= lo - 0.001 and e["ts"] + e["dur"] <= hi + 0.001
            ps = [e for e in pushes[w] if e["args"]["step"] == s]
            check(all(inside(e) for e in ps), "worker %d step %d: a push outside the step" % (w, s))
            check(sorted(e["args"]["chunk"] for e in ps) == chunks,
                  "worker %d step %d: pushes of chunks %s, expected %s" %
                  (w, s, sorted(e["args"]["chunk"] for e in ps), chunks))
            check(all(e["args"]["clock"] == st["args"]["clock"] for e in ps),
                  "worker %d step %d: pushes at another clock than the step's" % (w, s))
            for e in ps:
                server_of_chunk.setdefault(e["args"]["chunk"], e["args"]["server"])
                check(e["args"]["bytes"] > 0, "push without bytes")
            pl = [e for e in pulls[w] if inside(e)]
            check(sorted(e["args"]["chunk"] for e in pl) == chunks,
                  "worker %d step %d: pulls of chunks %s, expected %s" %
                  (w, s, sorted(e["args"]["chunk"] for e in pl), chunks))
            check(all(e["args"]["ok"] == 1 for e in pl), "worker %d step %d: a failed pull" % (w, s))
    check(len(set(server_of_chunk.values())) == a.servers,
          "chunks on servers %s, expected %d servers" % (set(server_of_chunk.values()), a.servers))

    # Every apply of (worker, chunk, clock) starts after that worker's push of it started.
    applied = collections.Counter()
    checked = 0
    for e in applies:
        args = e["args"]
        chunk, clock = args["chunk"], args["clock"]
        applied[(chunk, clock)] += 1
        check(group_of[e["pid"]] == server_of_chunk.get(chunk),
              "chunk %d applied on group %d, pushed to %s" %
              (chunk, group_of[e["pid"]], server_of_chunk.get(chunk)))
        workers = [int(x) for x in str(args["workers"]).split(",") if x != ""]
        check(sorted(workers) == list(range(a.workers)),
              "apply of chunk %d clock %d had workers %s" % (chunk, clock, workers))
        for w in workers:
            p = push_at.get((w, chunk, clock))
            if check(p is not None, "apply of chunk %d clock %d: no push by worker %d" %
                     (chunk, clock, w)):
                checked += 1
                check(e["ts"] >= p["ts"],
                      "apply of chunk %d clock %d started at %.3f, before worker %d's push "
                      "started (%.3f)" % (chunk, clock, e["ts"], w, p["ts"]))
    for key in push_at:
        check(applied[(key[1], key[2])] == 1,
              "chunk %d clock %d applied %d times" % (key[1], key[2], applied[(key[1], key[2])]))
    check(checked == len(chunks) * a.steps * a.workers,
          "checked %d apply/push pairs, expected %d" % (checked, len(chunks) * a.steps * a.workers))
    publishes = [e for e in events if e.get("name") == "publish" and e["pid"] in group_of]
    check(len(publishes) >= len(applies), "%d publishes for %d applies" %
          (len(publishes), len(applies)))
    # The other direction: a pull that read version v of a chunk ended after the server
    # published v. With the check above, the clocks of the workers and the servers are aligned
    # both ways (an offset either way breaks one of them).
    published = {(e["args"]["chunk"], e["args"]["version"]): e["ts"] for e in publishes}
    read = 0
    for w, pl in pulls.items():
        for e in pl:
            key = (e["args"]["chunk"], e["args"]["version"])
            if key not in published:
                continue  # the initial weights (published before the server's trace began)
            read += 1
            check(e["ts"] + e["dur"] >= published[key],
                  "worker %d's pull of chunk %d version %d ended at %.3f, before the server "
                  "published it (%.3f)" % ((w,) + key + (e["ts"] + e["dur"], published[key])))
    check(read >= len(chunks) * a.steps * a.workers,
          "%d pulls matched a publish, expected >= %d" % (read, len(chunks) * a.steps * a.workers))

    if a.summary:
        text = open(a.summary).read()
        rows = [l for l in text.splitlines() if re.match(r"\s*\d+\s+worker \d+\s", l)]
        check(len(rows) == a.steps * a.workers, "summary: %d step rows, expected %d" %
              (len(rows), a.steps * a.workers))
        check(re.search(r"^\s*mean\s", text, re.M) is not None, "summary: no mean row")

    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print("check_trace: %d workers x %d steps x %d chunks: push/pull spans complete; %d applies "
          "after their pushes; %d pulls after their versions' publication; %d events" %
          (a.workers, a.steps, len(chunks), checked, read, len(events)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
