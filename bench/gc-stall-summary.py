#!/usr/bin/env python3
# gc-stall-summary.py OUTDIR DURATION: the tables of bench/gc-stall.sh
# from what it left in OUTDIR (fio JSON and clat logs, results.tsv,
# bcachefilter-ctl stats --json before and after each bcachefilter run).
# Can be run again on a kept OUTDIR.
import json, os, sys, glob
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bcfstats
out, dur = sys.argv[1], int(sys.argv[2])

def lat_log(name):
    """fio's clat log (one entry per direction per 1 s window that had a
    completion; the value is the window's max, in ns): the entries as
    (time ms, max ms), and the seconds without completions, from the gaps
    between windows (a gap of about 2 s is one second without any)."""
    ent = []
    for f in glob.glob(os.path.join(out, name + "_clat.*.log")):
        for line in open(f):
            p = [x.strip() for x in line.split(",")]
            if len(p) >= 2:
                ent.append((int(p[0]), int(p[1]) / 1e6))
    times = sorted(set(t for t, _ in ent))
    idle, prev = 0, 0
    for t in times + [dur * 1000]:
        idle += max(0, round((t - prev) / 1000) - 1)
        prev = t
    return ent, idle

def in_run(t, t0):
    """The longest duration of a time stat within a run, from the
    histogram's change: "[lo, hi) ms" of the highest bucket that grew,
    the max itself if it grew in the run; and how many were recorded."""
    n = t["count"] - t0["count"]
    if n == 0:
        return "–"
    if t["max_ns"] > t0["max_ns"]:
        return f"{t['max_ns'] / 1e6:.2f} ({n})"
    h, h0 = t.get("hist_us", {}), t0.get("hist_us", {})
    grew = [int(k) for k in h if h[k] > h0.get(k, 0)]
    lo = max(grew) if grew else 0
    hi = 2 * lo if lo else 1
    return f"[{lo / 1000:g}, {hi / 1000:g}) ({n})"

def stats_of(name):
    return bcfstats.load(os.path.join(out, name + ".stats.json"))

def before_of(name):
    return bcfstats.load(os.path.join(out, name + ".before.json"))

rows = [l.rstrip("\n").split("\t") for l in open(os.path.join(out, "results.tsv"))]
res = {}
for c, j, name in rows:
    d = json.load(open(os.path.join(out, name + ".json")))["jobs"][0]["mixed"]
    cl = d["clat_ns"]
    ent, idle = lat_log(name)
    worst = max(ent, key=lambda x: x[1]) if ent else (0, 0)
    worst = (round(worst[0] / 1000), worst[1])
    r = dict(iops=d["iops"], p50=cl["percentile"]["50.000000"] / 1e6,
             p99=cl["percentile"]["99.000000"] / 1e6, max=cl["max"] / 1e6,
             worst=worst, idle=idle)
    st, b0 = stats_of(name), before_of(name)
    if st and b0:
        e, e0 = st, b0
        r["gc"] = e["gc_passes"] - e0["gc_passes"]
        r["keys"] = e["btree_keys"]
        r["nodes"] = e["btree_nodes"]
        for k, stat in (("slice", "gc_slice_locked"),
                        ("ckpt", "checkpoint_locked"),
                        ("wait", "lookup_lock_wait"),
                        ("jw", "journal_write")):
            r[k] = in_run(e[stat], e0[stat])
    res[(c, j)] = r

print("| job | front end | IOPS | p50 ms | p99 ms | max ms | worst second (s: max ms) | s without completions | max / proxy max | p50 / proxy p50 |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for (c, j), r in res.items():
    px = res.get(("proxy", j))
    rmax = f"{r['max'] / px['max']:.2f}" if px and px["max"] else "–"
    rp50 = f"{r['p50'] / px['p50']:.2f}" if px and px["p50"] else "–"
    print(f"| {j} | {c} | {r['iops']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | "
          f"{r['max']:.1f} | {r['worst'][0]}: {r['worst'][1]:.1f} | {r['idle']} | {rmax} | {rp50} |")
print()
print("Within each bcachefilter run, the longest (ms; a histogram bucket when the")
print("stat's max was set before the run) and how many (in parentheses):")
print()
print("| job | front end | GC passes | btree keys / nodes | GC slice lock hold | checkpoint lock hold | lookup wait for the lock | journal write |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for (c, j), r in res.items():
    if "gc" in r:
        print(f"| {j} | {c} | {r['gc']} | {r['keys']} / {r['nodes']} | {r['slice']} | "
              f"{r['ckpt']} | {r['wait']} | {r['jw']} |")
print()
pf = os.path.join(out, "prefill.tsv")
if os.path.exists(pf):
    for l in open(pf):
        c, t = l.split()
        print(f"pre-fill {c}: {t} s")
