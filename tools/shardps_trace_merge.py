#!/usr/bin/env python3
"""Merges the per-process timeline traces of a ShardPS run onto one clock (docs/tracing.md).

usage: shardps_trace_merge.py [-o MERGED.json] [--summary] FILE_OR_DIR...

Every input is a file written by --trace_file / ClientOptions.trace_file / SHARDPS_TRACE_FILE
(a directory stands for the *.json files in it; merged outputs found there are skipped). Each
file carries its process's clock anchor (CLOCK_MONOTONIC read together with CLOCK_REALTIME):
every event is moved from its process's monotonic clock onto the wall clock
(ts - anchor.monotonic_us + anchor.realtime_us), then expressed in microseconds since the
run's earliest event (shardps_merge.time_origin_realtime_us in the output says which instant
that is). Processes are labelled (coordinator, server g0 r0, backup g0 r2, worker 1, ...),
renumbered 1..N in that order (pids of different hosts may collide), and the events sorted
by time: the output opens in Perfetto (ui.perfetto.dev) and chrome://tracing.

--summary prints, per step of each worker ("step" spans), its duration and the time covered by
its push, wait and pull spans and by the servers' apply spans during the step, then the means.

A file cut short while its process was being killed (during a flush) is repaired: the events
are one per line, and the clock anchor is in the file's first line as well as in its trailer.
Python 3 standard library only.
"""

import argparse
import json
import os
import re
import sys

ROLE_ORDER = {"coordinator": 0, "server": 1, "backup": 1, "worker": 2}


def load_trace(path):
    """The document of one per-process file (repaired if its end was cut off), or None."""
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and "traceEvents" in doc:
            return doc, False
    except ValueError:
        pass
    # Repair: the header line, then one event per line until the first line that does not parse.
    lines = text.split("\n")
    doc = None
    m = re.match(r'\{"shardps_header":(\{.*\}),$', lines[0]) if lines else None
    if m is None:
        return None, True
    try:
        header = json.loads(m.group(1))
    except ValueError:
        return None, True
    events = []
    for line in lines[2:]:
        line = line.rstrip(",")
        if not line.startswith("{"):
            break
        try:
            events.append(json.loads(line))
        except ValueError:
            break
    doc = {"traceEvents": events, "shardps_header": header}
    return doc, True


def describe(doc):
    """(role, rank, group, anchor, hostname, pid) of one file."""
    meta = doc.get("shardps") or {}
    head = doc.get("shardps_header") or {}
    anchor = meta.get("clock_anchor") or head.get("clock_anchor")
    role = meta.get("role")
    rank = meta.get("rank", -1)
    group = meta.get("group", -1)
    if role is None:  # repaired: the identity is in the last process_name event
        role, rank, group = "process", -1, -1
        for e in doc["traceEvents"]:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                label = e.get("args", {}).get("name", "")
                mm = re.match(r"(\w+)(?: g(\d+))?(?: r(\d+))?", label)
                if mm:
                    role = mm.group(1)
                    group = int(mm.group(2)) if mm.group(2) else -1
                    rank = int(mm.group(3)) if mm.group(3) else -1
    return role, rank, group, anchor, meta.get("hostname", head.get("hostname", "?")), \
        meta.get("pid", head.get("pid", 0))


def label_of(role, rank, group):
    if role == "coordinator":
        return "coordinator"
    if role in ("server", "backup"):
        return "%s g%d r%d" % (role, group, rank) if group >= 0 else "%s r%d" % (role, rank)
    if role == "worker":
        return "worker %d" % rank
    return role


def expand_inputs(inputs):
    files = []
    for p in inputs:
        if os.path.isdir(p):
            for n in sorted(os.listdir(p)):
                if n.endswith(".json"):
                    files.append(os.path.join(p, n))
        else:
            files.append(p)
    return files


def merge(paths, warn=sys.stderr):
    procs = []
    for path in paths:
        try:
            doc, repaired = load_trace(path)
        except OSError as e:
            print("shardps_trace_merge: %s: %s" % (path, e), file=warn)
            continue
        if doc is None:
            print("shardps_trace_merge: %s: not a ShardPS trace file; skipped" % path, file=warn)
            continue
        if "shardps_merge" in doc:
            continue  # an earlier merged output in the same directory
        role, rank, group, anchor, host, pid = describe(doc)
        if not anchor:
            print("shardps_trace_merge: %s: no clock anchor; skipped" % path, file=warn)
            continue
        if repaired:
            print("shardps_trace_merge: %s: cut short (its process died during a write); "
                  "repaired: %d events kept" % (path, len(doc["traceEvents"])), file=warn)
        procs.append({"path": path, "doc": doc, "role": role, "rank": rank, "group": group,
                      "anchor": anchor, "host": host, "pid": pid,
                      "dropped": (doc.get("shardps") or {}).get("dropped_events", 0),
                      "repaired": repaired})
    procs.sort(key=lambda p: (ROLE_ORDER.get(p["role"], 3), p["group"], p["rank"], p["host"],
                              p["pid"]))
    # The time origin: the earliest event on the wall clock, in whole seconds.
    origin = None
    for p in procs:
        a = p["anchor"]
        p["offset"] = a["realtime_us"] - a["monotonic_us"]
        for e in p["doc"]["traceEvents"]:
            if e.get("ph") != "M":
                t = e["ts"] - a["monotonic_us"] + a["realtime_us"]
                origin = t if origin is None else min(origin, t)
    origin = int(origin // 1e6 * 1e6) if origin is not None else 0
    out = []
    for n, p in enumerate(procs, start=1):
        a = p["anchor"]
        shift = a["realtime_us"] - origin  # exact enough: both near each other
        p["label"] = label_of(p["role"], p["rank"], p["group"])
        out.append({"ph": "M", "name": "process_name", "pid": n, "tid": 0, "ts": 0,
                    "args": {"name": "%s (%s:%s)" % (p["label"], p["host"], p["pid"])}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": n, "tid": 0, "ts": 0,
                    "args": {"sort_index": n}})
        for e in p["doc"]["traceEvents"]:
            if e.get("ph") == "M":
                if e.get("name") == "process_name":
                    continue
                e = dict(e, pid=n, ts=0)
            else:
                e = dict(e, pid=n, ts=round(e["ts"] - a["monotonic_us"] + shift, 3))
            out.append(e)
    out.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    merged = {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "shardps_merge": {
            "time_origin_realtime_us": origin,
            "processes": [{"pid": n, "label": p["label"], "file": p["path"], "host": p["host"],
                           "os_pid": p["pid"], "dropped_events": p["dropped"],
                           "repaired": p["repaired"],
                           "anchor_uncertainty_us": p["anchor"].get("uncertainty_us", 0)}
                          for n, p in enumerate(procs, start=1)],
        },
    }
    return merged


def union_ms(intervals, lo, hi):
    """Milliseconds of [lo, hi) covered by the union of (start, end) intervals."""
    iv = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total / 1000.0


def summary(merged, out=sys.stdout):
    labels = {p["pid"]: p["label"] for p in merged["shardps_merge"]["processes"]}
    spans = {}  # (pid, name) -> [(start, end)]
    steps = []  # (step, worker label, pid, start, end)
    for e in merged["traceEvents"]:
        if e.get("ph") != "X":
            continue
        s, d = e["ts"], e.get("dur", 0)
        spans.setdefault((e["pid"], e["name"]), []).append((s, s + d))
        if e["name"] == "step":
            steps.append((e.get("args", {}).get("step", 0), labels.get(e["pid"], "?"), e["pid"],
                          s, s + d))
    if not steps:
        print("no step spans (a client that calls Push/Pull/Wait itself has none); phases "
              "overall:", file=out)
    applies = [iv for (pid, name), ivs in spans.items() if name == "apply" for iv in ivs]
    steps.sort(key=lambda t: (t[0], t[1]))
    cols = ("step", "process", "step_ms", "push_ms", "wait_ms", "pull_ms", "apply_ms")
    print("%5s  %-10s %9s %9s %9s %9s %9s" % cols, file=out)
    sums = [0.0] * 5
    for step, label, pid, s, e in steps:
        row = [(e - s) / 1000.0,
               union_ms(spans.get((pid, "push"), []), s, e),
               union_ms(spans.get((pid, "wait"), []), s, e),
               union_ms(spans.get((pid, "pull"), []), s, e),
               union_ms(applies, s, e)]
        sums = [a + b for a, b in zip(sums, row)]
        print("%5d  %-10s %9.3f %9.3f %9.3f %9.3f %9.3f" % ((step, label) + tuple(row)),
              file=out)
    if steps:
        print("%5s  %-10s %9.3f %9.3f %9.3f %9.3f %9.3f" %
              (("mean", "(%d)" % len(steps)) + tuple(x / len(steps) for x in sums)), file=out)
    print("\nspans      count   total_ms    mean_us     max_us", file=out)
    by_name = {}
    for (pid, name), ivs in spans.items():
        by_name.setdefault(name, []).extend(e - s for s, e in ivs)
    for name in sorted(by_name):
        d = by_name[name]
        print("%-10s %5d %10.3f %10.1f %10.1f" % (name, len(d), sum(d) / 1000.0,
                                                   sum(d) / len(d), max(d)), file=out)
    dropped = [(p["label"], p["dropped_events"]) for p in merged["shardps_merge"]["processes"]
               if p["dropped_events"]]
    for label, n in dropped:
        print("note: %s dropped %d events (--trace_max_events)" % (label, n), file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="per-process trace files, or directories of them")
    ap.add_argument("-o", "--output", default="", help="merged trace (default: none written)")
    ap.add_argument("--summary", action="store_true", help="print per-step phase durations")
    args = ap.parse_args(argv)
    paths = [p for p in expand_inputs(args.inputs)
             if not args.output or os.path.abspath(p) != os.path.abspath(args.output)]
    if not paths:
        print("shardps_trace_merge: no trace files", file=sys.stderr)
        return 2
    merged = merge(paths)
    if not merged["shardps_merge"]["processes"]:
        print("shardps_trace_merge: none of the inputs is a ShardPS trace", file=sys.stderr)
        return 1
    if args.output:
        tmp = args.output + ".tmp"
        with open(tmp, "w") as f:
            json.dump(merged, f, separators=(",", ":"))
            f.write("\n")
        os.replace(tmp, args.output)
        print("shardps_trace_merge: %d processes, %d events -> %s" %
              (len(merged["shardps_merge"]["processes"]), len(merged["traceEvents"]),
               args.output), file=sys.stderr)
    if args.summary:
        summary(merged)
    elif not args.output:
        json.dump(merged, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
