#!/usr/bin/env python3
"""Draws one step of a merged ShardPS trace as a Gantt-style timeline (docs/tracing.md).

usage: shardps_trace_plot.py MERGED.json [--step N] [-o step.png] [--margin-ms M]

MERGED.json comes from tools/shardps_trace_merge.py. The window is step N's "step" spans of
every worker (the median-length step if --step is not given), plus a margin. One row per
process and thread that has events in the window; spans coloured by phase (step, push, wait,
pull, apply, replication, checkpoint), instants (publish, push_in, failover, ...) as ticks.
Needs matplotlib (Debian: python3-matplotlib).
"""

import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "step": "#d9d9d9",
    "push": "#1f77b4",
    "wait": "#9e9e9e",
    "pull": "#2ca02c",
    "apply": "#d62728",
    "repl_apply": "#ff7f0e",
    "ckpt_capture": "#9467bd",
    "ckpt_write": "#8c564b",
}
INSTANT_COLORS = {"publish": "#d62728", "push_in": "#1f77b4", "repl_send": "#ff7f0e",
                  "failover": "#000000", "reconnect": "#000000", "promote": "#000000"}
# Drawing order (wider, enclosing spans first) and bar heights.
LAYER = {"step": (0, 0.8), "wait": (1, 0.5), "pull": (2, 0.34), "push": (3, 0.5),
         "apply": (3, 0.5)}


def pick_window(events, labels, step):
    steps = {}
    for e in events:
        if e.get("ph") == "X" and e["name"] == "step":
            steps.setdefault(e["args"]["step"], []).append(e)
    if not steps:
        sys.exit("shardps_trace_plot: no step spans in this trace")
    if step is None:
        # The step whose slowest worker took the median time: a typical step.
        ranked = sorted(steps, key=lambda s: max(e["dur"] for e in steps[s]))
        ranked = [s for s in ranked if s > 1] or ranked
        step = ranked[len(ranked) // 2]
    if step not in steps:
        sys.exit("shardps_trace_plot: no step %d (steps %d..%d)" % (step, min(steps), max(steps)))
    lo = min(e["ts"] for e in steps[step])
    hi = max(e["ts"] + e["dur"] for e in steps[step])
    return step, lo, hi


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("merged")
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("-o", "--output", default="trace-step.png")
    ap.add_argument("--margin-ms", type=float, default=0.05)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    with open(args.merged) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    labels = {p["pid"]: p["label"] for p in doc["shardps_merge"]["processes"]}
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    step, lo, hi = pick_window(events, labels, args.step)
    lo -= args.margin_ms * 1000
    hi += args.margin_ms * 1000
    inwin = [e for e in events if e.get("ph") in ("X", "i")
             and e["ts"] < hi and e["ts"] + e.get("dur", 0) > lo]
    rows = sorted({(e["pid"], e["tid"]) for e in inwin})
    row_of = {r: i for i, r in enumerate(rows)}

    fig, ax = plt.subplots(figsize=(12, 0.75 * len(rows) + 1.6), dpi=110)
    to_ms = lambda t: (t - lo) / 1000.0  # noqa: E731
    for e in sorted(inwin, key=lambda e: LAYER.get(e["name"], (4, 0.5))[0]):
        y = row_of[(e["pid"], e["tid"])]
        if e["ph"] == "X":
            h = LAYER.get(e["name"], (4, 0.5))[1]
            s, d = max(e["ts"], lo), min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)
            ax.barh(y, d / 1000.0, left=to_ms(s), height=h,
                    color=COLORS.get(e["name"], "#bcbd22"), edgecolor="white", linewidth=0.3)
            if e["name"] == "step":
                ax.text(to_ms(s) + 0.005 * (hi - lo) / 1000.0, y - h / 2 + 0.02,
                        "step %d" % e["args"]["step"], fontsize=7, va="top", color="#555555")
        else:
            ax.plot([to_ms(e["ts"])] * 2, [y - 0.42, y + 0.42],
                    color=INSTANT_COLORS.get(e["name"], "#17becf"), linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["%s · %s" % (labels.get(p, p), threads.get((p, t), "tid %d" % t))
                        for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (hi - lo) / 1000.0)
    ax.set_xlabel("ms (merged clock, from %.3f ms after the run's origin)" % (lo / 1000.0))
    ax.set_title(args.title or "ShardPS: step %d of a traced run (%s)" %
                 (step, ", ".join(sorted(set(labels.values())))), fontsize=10)
    present = {e["name"] for e in inwin if e["ph"] == "X"}
    handles = [Patch(color=c, label=n) for n, c in COLORS.items() if n in present]
    inst = sorted({e["name"] for e in inwin if e["ph"] == "i"})
    if inst:
        handles.append(Patch(color="white", label="ticks: " + ", ".join(inst)))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.2 / len(rows)),
              ncol=len(handles), fontsize=8, frameon=False)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    fig.tight_layout()
    fig.savefig(args.output)
    print("shardps_trace_plot: step %d, %.3f ms window, %d rows -> %s" %
          (step, (hi - lo) / 1000.0, len(rows), args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
