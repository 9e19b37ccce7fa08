#!/usr/bin/python3
"""Glue for scripts/bench.sh (Debian's python3; matplotlib from python3-matplotlib for `plot`).

  ps_report.py merge OUT IN.json...              one results file from several shardps_bench runs
  ps_report.py training OUT.json LOG...          digits_trainer "final:" lines -> JSON
  ps_report.py markdown RESULTS.json TRAIN.json DOC.md PNG
                                                 rewrites the generated part of docs/benchmarks.md
  ps_report.py plot RESULTS.json PNG             goodput against size, one panel per transport
  ps_report.py summary RESULTS.json              targets met / missed on stdout (exit 3 if missed)

docs/benchmarks.md keeps everything outside the markers
<!-- BEGIN GENERATED --> ... <!-- END GENERATED -->, so the hand-written analysis survives a rerun.
"""
import json
import math
import os
import re
import sys

# dmlc/ps-lite (ZeroMQ over TCP) on this kind of machine, "quiet" columns of
# ../shared/baselines/README.md (2026-11-22): (series, layout, mode, size) -> (Gbit/s, us/key).
# Goodput under ps-lite's convention (push-pull counts len once).
KIB, MIB = 1024, 1 << 20
PSLITE = {}
def _add(series, layout, mode, rows):
    for size, gbps, uspk in rows:
        PSLITE[(series, layout, mode, size)] = (gbps, uspk)
_add("throughput", "1x1", "push", [(4*KIB, 2.732, 12), (64*KIB, 14.336, 37), (MIB, 33.467, 251), (4*MIB, 29.626, 1133), (16*MIB, 32.535, 4125)])
_add("throughput", "1x1", "pull", [(4*KIB, 2.269, 14), (64*KIB, 11.134, 47), (MIB, 28.009, 299), (4*MIB, 28.751, 1167), (16*MIB, 21.445, 6259)])
_add("throughput", "1x1", "push-pull", [(4*KIB, 1.675, 20), (64*KIB, 5.932, 88), (MIB, 12.368, 678), (4*MIB, 15.507, 2164), (16*MIB, 12.969, 10349)])
_add("throughput", "2x2", "push", [(4*KIB, 3.848, 17), (64*KIB, 11.964, 88), (MIB, 25.262, 664), (4*MIB, 32.925, 2038), (16*MIB, 28.332, 9475)])
_add("throughput", "2x2", "pull", [(4*KIB, 4.292, 15), (64*KIB, 11.492, 91), (MIB, 23.506, 725), (4*MIB, 26.099, 2571), (16*MIB, 23.829, 11265)])
_add("throughput", "2x2", "push-pull", [(4*KIB, 2.338, 28), (64*KIB, 7.013, 150), (MIB, 11.883, 1412), (4*MIB, 14.911, 4501), (16*MIB, 11.926, 22516)])
_add("latency", "1x1", "push", [(4*KIB, 0.176, 186), (64*KIB, 2.315, 227), (MIB, 24.106, 348), (4*MIB, 29.316, 1145), (16*MIB, 31.967, 4199)])
_add("latency", "1x1", "pull", [(4*KIB, 0.181, 181), (64*KIB, 2.604, 201), (MIB, 19.109, 439), (4*MIB, 26.627, 1260), (16*MIB, 23.619, 5683)])
_add("latency", "1x1", "push-pull", [(4*KIB, 0.169, 194), (64*KIB, 2.158, 243), (MIB, 14.584, 575), (4*MIB, 15.039, 2231), (16*MIB, 13.373, 10036)])

MODES = ["push", "pull", "push-pull"]


def size_name(b):
    if b >= MIB and b % MIB == 0:
        return f"{b // MIB} MiB"
    if b >= KIB and b % KIB == 0:
        return f"{b // KIB} KiB"
    return f"{b} B"


def fmt(v, spec=".2f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def load(path):
    with open(path) as f:
        return json.load(f)


def merge(out, inputs):
    rows, metas = [], []
    for p in inputs:
        d = load(p)
        metas.append(d.get("meta", {}))
        rows.extend(d.get("rows", []))
    with open(out, "w") as f:
        json.dump({"meta": metas, "rows": rows}, f, indent=1)


def training(out, logs):
    res = []
    pat = re.compile(r"final: test accuracy ([0-9.]+) after (\d+) steps, ([0-9.]+) samples/s, "
                     r"transport (\S+), control messages per step (\S+), step ([0-9.]+) ms "
                     r"\(in Step\(\) ([0-9.]+) ms\), consistency (\S+), (\d+) workers")
    for p in logs:
        with open(p, errors="replace") as f:
            text = f.read()
        m = pat.search(text)
        name = os.path.basename(p)
        if not m:
            res.append({"log": name, "error": "no final line"})
            continue
        res.append({"log": name, "accuracy": float(m.group(1)), "steps": int(m.group(2)),
                    "samples_per_s": float(m.group(3)), "transport": m.group(4),
                    "control_per_step": float(m.group(5)), "step_ms": float(m.group(6)),
                    "in_step_ms": float(m.group(7)), "consistency": m.group(8),
                    "workers": int(m.group(9))})
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


# (transport, series, mode predicate, size predicate, kind, threshold, text)
def targets(rows):
    """Yields (text, row, value, threshold, ok) for every row a target applies to."""
    for r in rows:
        t, s, m, n = r["transport"], r["series"], r["mode"], r["size"]
        ps = PSLITE.get((s, r["layout"], m, n))
        if t == "tcp" and s == "throughput" and n >= MIB and r.get("ratio") is not None:
            yield ("tcp ≥ 0.9× raw TCP bound, 1 MiB and up", r, r["ratio"], 0.9, r["ratio"] >= 0.9)
        if t == "tcp" and s == "throughput" and ps and r.get("gbps_pslite") is not None:
            v = r["gbps_pslite"] / ps[0]
            yield ("tcp ≥ ps-lite (same convention), every size", r, v, 1.0, v >= 1.0)
        if t == "tcp" and s == "latency" and m == "push" and n == 4 * KIB and r["layout"] == "1x1":
            if ps and r.get("lat_p50_us") is not None:
                v = r["lat_p50_us"] / ps[1]
                yield ("tcp 4 KiB push latency ≤ 0.5× ps-lite", r, v, 0.5, v <= 0.5)
            if r.get("ratio") is not None:
                yield ("tcp 4 KiB push latency ≤ 1.3× raw TCP ping-pong", r, r["ratio"], 1.3,
                       r["ratio"] <= 1.3)
        if t == "shm" and s == "throughput" and n >= MIB and r.get("ratio") is not None:
            yield ("shm ≥ 0.7× memcpy, 1 MiB and up", r, r["ratio"], 0.7, r["ratio"] >= 0.7)
        if t == "verbs" and s == "throughput" and r.get("ratio") is not None:
            yield ("verbs ≥ 0.85× perftest", r, r["ratio"], 0.85, r["ratio"] >= 0.85)


def rowkey(r):
    return (r["transport"], r["layout"], MODES.index(r["mode"]) if r["mode"] in MODES else 9,
            r["size"])


def throughput_table(rows, transport):
    out = ["| layout | mode | size | keys/round | ours Gbit/s | ps-lite conv. Gbit/s | µs/key | "
           "server CPU s/GB | bound Gbit/s | ours ÷ bound | ps-lite Gbit/s | ours ÷ ps-lite |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["transport"] == transport and
                     r["series"] == "throughput"), key=rowkey):
        ps = PSLITE.get(("throughput", r["layout"], r["mode"], r["size"]))
        vs = r["gbps_pslite"] / ps[0] if ps and r.get("gbps_pslite") else None
        out.append(f"| {r['layout']} | {r['mode']} | {size_name(r['size'])} | "
                   f"{r['keys_per_round']} | {fmt(r['gbps'], '.3f')} | "
                   f"{fmt(r['gbps_pslite'], '.3f')} | {fmt(r['us_per_key'], '.1f')} | "
                   f"{fmt(r['server_cpu_s_per_gb'], '.3f')} | {fmt(r['bound_gbps'], '.3f')} | "
                   f"**{fmt(r['ratio'])}** | {fmt(ps[0], '.3f') if ps else '–'} | "
                   f"{fmt(vs)} |")
    return out


def latency_table(rows, transport):
    out = ["| layout | mode | size | p50 µs | p99 µs | Gbit/s | server CPU s/GB | bound p50 µs | "
           "ours ÷ bound (p50) | ps-lite µs | ours ÷ ps-lite |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["transport"] == transport and r["series"] == "latency"),
                    key=rowkey):
        ps = PSLITE.get(("latency", r["layout"], r["mode"], r["size"]))
        vs = r["lat_p50_us"] / ps[1] if ps and r.get("lat_p50_us") else None
        out.append(f"| {r['layout']} | {r['mode']} | {size_name(r['size'])} | "
                   f"{fmt(r['lat_p50_us'], '.1f')} | {fmt(r['lat_p99_us'], '.1f')} | "
                   f"{fmt(r['gbps'], '.3f')} | {fmt(r['server_cpu_s_per_gb'], '.3f')} | "
                   f"{fmt(r['bound_lat_p50_us'], '.1f')} | **{fmt(r['ratio'])}** | "
                   f"{fmt(ps[1], '.0f') if ps else '–'} | {fmt(vs)} |")
    return out


def bound_names(rows, transport):
    names = sorted({(r["series"], r["mode"], r["bound"]) for r in rows
                    if r["transport"] == transport and r.get("bound")})
    return [f"- {s}, {m}: {b}" for s, m, b in names]


def markdown(results, train, doc, png):
    d = load(results)
    rows = d["rows"]
    metas = d["meta"] if isinstance(d["meta"], list) else [d["meta"]]
    lines = ["<!-- BEGIN GENERATED -->", "",
             f"Generated by `scripts/bench.sh` from `{os.path.relpath(results, os.path.dirname(doc) + '/..')}`.", ""]
    for m in metas:
        lines.append(f"- run: host `{m.get('host')}`, {m.get('nproc')} CPUs, {m.get('label', '')}; "
                     f"server optimizer `{m.get('optimizer')}`, consistency `{m.get('consistency')}`, "
                     f"medians of {m.get('reps')} reps, throughput points ≥ {m.get('seconds')} s, "
                     f"latency points ≥ {m.get('lat_seconds')} s, {m.get('wall_s')} s wall, "
                     f"{m.get('failures')} failed clusters")
    lines.append("")
    transports = [t for t in ("tcp", "shm", "verbs") if any(r["transport"] == t for r in rows)]
    for t in transports:
        lines += [f"### {t}: throughput series (keys_per_server × servers requests per worker per round)", ""]
        lines += throughput_table(rows, t) + [""]
        if any(r["transport"] == t and r["series"] == "latency" for r in rows):
            lines += [f"### {t}: latency series (one request in flight)", ""]
            lines += latency_table(rows, t) + [""]
        lines += [f"Bounds used for {t}:"] + bound_names(rows, t) + [""]
        verified = sum(r.get("verified_bytes", 0) for r in rows if r["transport"] == t
                       and r["series"] == "throughput" and r["mode"] == "push")
        lines += [f"Verified for {t}: {verified} bytes pushed and pulled back byte for byte "
                  "(each cluster, after its timed series).", ""]
    lines += ["### Targets", "", "| target | row | value | threshold | met |", "|---|---|---|---|---|"]
    for text, r, v, thr, ok in targets(rows):
        lines.append(f"| {text} | {r['transport']} {r['layout']} {r['series']} {r['mode']} "
                     f"{size_name(r['size'])} | {v:.2f} | {thr} | {'yes' if ok else '**no**'} |")
    lines.append("")
    if train and os.path.exists(train):
        tr = load(train)
        lines += ["### Training benchmark (examples/digits_trainer, sync SGD = BSP)", "",
                  "| transport | workers | step ms | in Step() ms | samples/s (cluster) | "
                  "test accuracy | control msgs/step |", "|---|---|---|---|---|---|---|"]
        for e in tr:
            if "error" in e:
                lines.append(f"| {e['log']} | – | failed: {e['error']} | | | | |")
                continue
            lines.append(f"| {e['transport']} | {e['workers']} | {e['step_ms']:.2f} | "
                         f"{e['in_step_ms']:.2f} | {e['samples_per_s']:.0f} | "
                         f"{e['accuracy']:.4f} | {e['control_per_step']:g} |")
        lines.append("")
    if png:
        lines += [f"![goodput against value size]({os.path.basename(png)})", ""]
    lines.append("<!-- END GENERATED -->")
    gen = "\n".join(lines)
    text = ""
    if os.path.exists(doc):
        with open(doc) as f:
            text = f.read()
    if "<!-- BEGIN GENERATED -->" in text and "<!-- END GENERATED -->" in text:
        a = text.index("<!-- BEGIN GENERATED -->")
        b = text.index("<!-- END GENERATED -->") + len("<!-- END GENERATED -->")
        text = text[:a] + gen + text[b:]
    else:
        text = "# Parameter-server benchmarks\n\n" + gen + "\n" + text
    with open(doc, "w") as f:
        f.write(text)


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in load(results)["rows"] if r["series"] == "throughput"]
    transports = [t for t in ("tcp", "shm", "verbs") if any(r["transport"] == t for r in rows)]
    fig, axes = plt.subplots(1, len(transports), figsize=(6.5 * len(transports), 5), squeeze=False)
    colors = {"push": "tab:blue", "pull": "tab:green", "push-pull": "tab:red"}
    for ax, t in zip(axes[0], transports):
        rt = [r for r in rows if r["transport"] == t]
        for layout, style in (("1x1", "-"), ("2x2", "--")):
            for m in MODES:
                pts = sorted((r["size"], r["gbps"]) for r in rt
                             if r["layout"] == layout and r["mode"] == m and r["gbps"])
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o",
                            color=colors[m], label=f"ours {m} {layout}")
        for m in MODES:  # the bound of 1x1
            pts = sorted((r["size"], r["bound_gbps"]) for r in rt
                         if r["layout"] == "1x1" and r["mode"] == m and r.get("bound_gbps"))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ":", color=colors[m],
                        alpha=0.6, label=f"bound {m} 1x1")
        if t == "tcp":
            for m in MODES:
                pts = sorted((k[3], v[0]) for k, v in PSLITE.items()
                             if k[0] == "throughput" and k[1] == "1x1" and k[2] == m)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-.", marker="x",
                        color=colors[m], alpha=0.45, label=f"ps-lite {m} 1x1 (own conv.)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["size"] for r in rt})
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_name(s) for s in sizes])
        ax.set_xlabel("value size")
        ax.set_ylabel("goodput, Gbit/s (push-pull counts both directions)")
        ax.set_title(f"{t}: throughput series")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def summary(results):
    rows = load(results)["rows"]
    missed = 0
    for text, r, v, thr, ok in targets(rows):
        missed += not ok
        print(f"{'ok    ' if ok else 'MISSED'} {text}: {r['transport']} {r['layout']} "
              f"{r['series']} {r['mode']} {size_name(r['size'])} = {v:.2f} (threshold {thr})")
    return 3 if missed else 0


def main(argv):
    if len(argv) >= 4 and argv[1] == "merge":
        merge(argv[2], argv[3:])
    elif len(argv) >= 3 and argv[1] == "training":
        training(argv[2], argv[3:])
    elif len(argv) == 6 and argv[1] == "markdown":
        markdown(argv[2], argv[3], argv[4], argv[5])
    elif len(argv) == 4 and argv[1] == "plot":
        plot(argv[2], argv[3])
    elif len(argv) == 3 and argv[1] == "summary":
        return summary(argv[2])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
