#!/usr/bin/python3
"""Glue for scripts/bench.sh (Debian's python3; matplotlib from python3-matplotlib for `plot`).

  ps_report.py merge OUT IN.json|IN.jsonl...     one results file from several shardps_bench runs
                                                 (.jsonl: bench/pslite_dense.sh's ps-lite rows)
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

KIB, MIB = 1024, 1 << 20
# Peers are compared only where they were measured in the same run: dmlc ps-lite's rows come from
# bench/pslite_dense.sh (JSON lines with "system": "ps-lite"), merged into the results file under
# "pslite". A run without them shows no ps-lite column figures.
FAULTS_PER_GB_MAX = 100  # "no page fault on the data path": allows stray heap growth, not paging

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
    rows, metas, pslite = [], [], []
    for p in inputs:
        if p.endswith(".jsonl"):
            with open(p) as f:
                pslite.extend(json.loads(l) for l in f if l.strip())
            continue
        d = load(p)
        metas.append(d.get("meta", {}))
        rows.extend(d.get("rows", []))
    with open(out, "w") as f:
        json.dump({"meta": metas, "rows": rows, "pslite": pslite}, f, indent=1)


def pslite_index(d):
    """(series, layout, mode, size) -> ps-lite row of the same run."""
    return {(r["series"], r["layout"], r["mode"], r["size"]): r for r in d.get("pslite", [])}


def ratio(a, b):
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
        return None
    return a / b


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


def targets(rows, ps=None):
    """Yields (text, row, value, threshold, ok) for every row a target applies to (issue 19's
    targets: ratios in one run, tcp loopback, 1x1 and 2x2)."""
    ps = ps or {}
    by_layout = {(r["transport"], r["layout"], r["series"], r["mode"], r["size"]): r for r in rows}
    for r in rows:
        t, s, m, n = r["transport"], r["series"], r["mode"], r["size"]
        rv = r.get("ratio")
        if t == "tcp" and s == "throughput" and n >= 64 * KIB and rv is not None:
            yield ("tcp ≥ 0.9× raw TCP stream bound, 64 KiB and up", r, rv, 0.9, rv >= 0.9)
        if t == "tcp" and s == "throughput" and n == 4 * KIB and rv is not None:
            yield ("tcp 4 KiB pipelined ≥ 0.5× raw TCP stream bound", r, rv, 0.5, rv >= 0.5)
        if t == "tcp" and s == "latency" and n == 4 * KIB and rv is not None:
            yield ("tcp 4 KiB one in flight: p50 ≤ 1.2× raw ping-pong", r, rv, 1.2, rv <= 1.2)
        if s == "throughput":
            for side in ("server", "worker"):
                v = r.get(f"{side}_faults_per_gb")
                if v is not None:
                    yield (f"no page fault on the data path ({side}, faults/GB)", r, v,
                           FAULTS_PER_GB_MAX, v <= FAULTS_PER_GB_MAX)
        p = ps.get((s, r["layout"], m, n))
        if t == "tcp" and s == "throughput" and p and r.get("gbps_pslite") and p.get("gbps_pslite"):
            v = r["gbps_pslite"] / p["gbps_pslite"]
            yield ("tcp ≥ ps-lite of the same run (its convention)", r, v, 1.0, v >= 1.0)
        if (t == "tcp" and s == "throughput" and m == "push" and n >= 64 * KIB and p
                and r.get("server_cpu_s_per_gb") and p.get("server_cpu_s_per_gb")):
            v = r["server_cpu_s_per_gb"] / p["server_cpu_s_per_gb"]
            yield ("tcp push server CPU/GB ≤ ps-lite's (same run)", r, v, 1.0, v <= 1.0)
        if r["layout"].endswith("r2") and s == "throughput":
            base = by_layout.get((t, r["layout"][:-2], s, m, n))
            v = ratio(r.get("gbps"), base.get("gbps") if base else None)
            if v is not None:
                yield ("replication goodput ≥ 0.8× without a backup", r, v, 0.8, v >= 0.8)
        if t == "shm" and s == "throughput" and n >= MIB and rv is not None:
            yield ("shm ≥ 0.7× memcpy, 1 MiB and up", r, rv, 0.7, rv >= 0.7)
        if t == "verbs" and s == "throughput" and rv is not None:
            yield ("verbs ≥ 0.85× perftest", r, rv, 0.85, rv >= 0.85)


def rowkey(r):
    return (r["transport"], r["layout"], MODES.index(r["mode"]) if r["mode"] in MODES else 9,
            r["size"])


def throughput_table(rows, transport, ps):
    out = ["| layout | mode | size | keys/round | ours Gbit/s | µs/key | server CPU s/GB | "
           "page faults/GB server + worker | context switches/GB server + worker | "
           "bound Gbit/s | ours ÷ bound | ps-lite Gbit/s | ours ÷ ps-lite | "
           "ps-lite server CPU s/GB | ps-lite server faults/GB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["transport"] == transport and
                     r["series"] == "throughput"), key=rowkey):
        p = ps.get(("throughput", r["layout"], r["mode"], r["size"])) if transport == "tcp" else None
        vs = ratio(r.get("gbps_pslite"), p.get("gbps_pslite") if p else None)
        out.append(f"| {r['layout']} | {r['mode']} | {size_name(r['size'])} | "
                   f"{r['keys_per_round']} | {fmt(r['gbps'], '.3f')} | "
                   f"{fmt(r['us_per_key'], '.1f')} | {fmt(r['server_cpu_s_per_gb'], '.3f')} | "
                   f"{fmt(r.get('server_faults_per_gb'), '.0f')} + "
                   f"{fmt(r.get('worker_faults_per_gb'), '.0f')} | "
                   f"{fmt(r.get('server_switches_per_gb'), '.0f')} + "
                   f"{fmt(r.get('worker_switches_per_gb'), '.0f')} | "
                   f"{fmt(r['bound_gbps'], '.3f')} | **{fmt(r['ratio'])}** | "
                   f"{fmt(p['gbps_pslite'], '.3f') if p else '–'} | {fmt(vs)} | "
                   f"{fmt(p.get('server_cpu_s_per_gb'), '.3f') if p else '–'} | "
                   f"{fmt(p.get('server_faults_per_gb'), '.0f') if p else '–'} |")
    return out


def latency_table(rows, transport, ps):
    out = ["| layout | mode | size | p50 µs | p99 µs | Gbit/s | server CPU s/GB | bound p50 µs | "
           "ours ÷ bound (p50) | ps-lite p50 µs | ours ÷ ps-lite |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["transport"] == transport and r["series"] == "latency"),
                    key=rowkey):
        p = ps.get(("latency", r["layout"], r["mode"], r["size"])) if transport == "tcp" else None
        vs = ratio(r.get("lat_p50_us"), p.get("lat_p50_us") if p else None)
        out.append(f"| {r['layout']} | {r['mode']} | {size_name(r['size'])} | "
                   f"{fmt(r['lat_p50_us'], '.1f')} | {fmt(r['lat_p99_us'], '.1f')} | "
                   f"{fmt(r['gbps'], '.3f')} | {fmt(r['server_cpu_s_per_gb'], '.3f')} | "
                   f"{fmt(r['bound_lat_p50_us'], '.1f')} | **{fmt(r['ratio'])}** | "
                   f"{fmt(p.get('lat_p50_us'), '.1f') if p else '–'} | {fmt(vs)} |")
    return out


def bound_names(rows, transport):
    names = sorted({(r["series"], r["mode"], r["bound"]) for r in rows
                    if r["transport"] == transport and r.get("bound")})
    return [f"- {s}, {m}: {b}" for s, m, b in names]


def markdown(results, train, doc, png):
    d = load(results)
    rows = d["rows"]
    ps = pslite_index(d)
    metas = d["meta"] if isinstance(d["meta"], list) else [d["meta"]]
    lines = ["<!-- BEGIN GENERATED -->", "",
             f"Generated by `scripts/bench.sh` from `{os.path.relpath(results, os.path.dirname(doc) + '/..')}`.", ""]
    for m in metas:
        lines.append(f"- run: host `{m.get('host')}`, {m.get('nproc')} CPUs, {m.get('label', '')}; "
                     f"server optimizer `{m.get('optimizer')}`, consistency `{m.get('consistency')}`, "
                     f"medians of {m.get('reps')} reps, throughput points ≥ {m.get('seconds')} s, "
                     f"latency points ≥ {m.get('lat_seconds')} s, {m.get('wall_s')} s wall, "
                     f"{m.get('failures')} failed clusters")
    lines.append(f"- ps-lite (dmlc, ZeroMQ tcp): {len(ps)} points measured in this run by "
                 "`bench/pslite_dense.sh`" if ps else
                 "- ps-lite: not measured in this run (set PSLITE_DIR to a checkout); no column "
                 "compares with figures from another day")
    lines.append("")
    transports = [t for t in ("tcp", "shm", "verbs") if any(r["transport"] == t for r in rows)]
    for t in transports:
        lines += [f"### {t}: throughput series (keys_per_server × servers requests per worker per round)", ""]
        lines += throughput_table(rows, t, ps) + [""]
        if any(r["transport"] == t and r["series"] == "latency" for r in rows):
            lines += [f"### {t}: latency series (one request in flight)", ""]
            lines += latency_table(rows, t, ps) + [""]
        lines += [f"Bounds used for {t}:"] + bound_names(rows, t) + [""]
        verified = sum(r.get("verified_bytes", 0) for r in rows if r["transport"] == t
                       and r["series"] == "throughput" and r["mode"] == "push")
        lines += [f"Verified for {t}: {verified} bytes pushed and pulled back byte for byte "
                  "(each cluster, after its timed series).", ""]
    lines += ["### Targets", "", "| target | row | value | threshold | met |", "|---|---|---|---|---|"]
    for text, r, v, thr, ok in targets(rows, ps):
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
    d = load(results)
    rows = [r for r in d["rows"] if r["series"] == "throughput"]
    psrows = [r for r in d.get("pslite", []) if r["series"] == "throughput"]
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
        if t == "tcp":  # ps-lite of the same run, our convention (push-pull counts both ways)
            for m in MODES:
                pts = sorted((r["size"], r["gbps"]) for r in psrows
                             if r["layout"] == "1x1" and r["mode"] == m and r.get("gbps"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-.", marker="x",
                            color=colors[m], alpha=0.45, label=f"ps-lite {m} 1x1 (same run)")
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
    d = load(results)
    rows = d["rows"]
    missed = 0
    for text, r, v, thr, ok in targets(rows, pslite_index(d)):
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
