#!/usr/bin/env python3
# gc-stall-summary.py OUTDIR DURATION: the tables of bench/gc-stall.sh
# from what it left in OUTDIR (fio JSON and clat logs, results.tsv,
# bcachefilter-ctl stats --json before and after each bcachefilter run).
# Can be run again on a kept OUTDIR.
import json, os, sys, glob, statistics
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

# c, j, name and (from REPEAT on) the round; older runs have no round.
rows = [(l.rstrip("\n").split("\t") + ["1"])[:4]
        for l in open(os.path.join(out, "results.tsv"))]
rounds = sorted(set(int(r) for *_, r in rows))
res = {}
for c, j, name, rnd in rows:
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
        # The share of the run's reads served by the cache: a run that
        # re-reads what the run before it cached shows it here (stop 37).
        hits = e["cache_hits"] - e0["cache_hits"]
        reads = hits + e["cache_misses"] - e0["cache_misses"]
        r["hit"] = f"{100 * hits / reads:.0f} %" if reads else "–"
        for k, stat in (("slice", "gc_slice_locked"),
                        ("ckpt", "checkpoint_locked"),
                        ("wait", "lookup_lock_wait"),
                        ("upd", "update_locked"),
                        ("uwait", "update_lock_wait"),
                        ("mark", "intent_mark"),
                        ("jw", "journal_write"),
                        ("jpf", "journal_preflush"),
                        ("pw", "prio_write"),
                        ("cw", "cache_write"),
                        ("lw", "latency_write")):
            # (update_locked, update_lock_wait, intent_mark, cache_write,
            # journal_preflush, prio_write are newer than some saved runs.)
            r[k] = in_run(e[stat], e0[stat]) if stat in e else "–"
    res[(c, j, int(rnd))] = r

def ratio(r, c, j, rnd, k):
    """r[k] over the proxy's in the same job and round, or None."""
    px = res.get(("proxy", j, rnd))
    return r[k] / px[k] if px and px[k] else None

def fmt(x):
    return f"{x:.2f}" if x is not None else "–"

many = len(rounds) > 1
print(f"| job |{' round |' if many else ''} front end | IOPS | p50 ms | p99 ms | max ms | worst second (s: max ms) | s without completions | max / proxy max | p50 / proxy p50 |")
print(f"|---|{'---:|' if many else ''}---|---:|---:|---:|---:|---:|---:|---:|---:|")
for (c, j, rnd), r in res.items():
    print(f"| {j} |{f' {rnd} |' if many else ''} {c} | {r['iops']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | "
          f"{r['max']:.1f} | {r['worst'][0]}: {r['worst'][1]:.1f} | {r['idle']} | "
          f"{fmt(ratio(r, c, j, rnd, 'max'))} | {fmt(ratio(r, c, j, rnd, 'p50'))} |")
print()
if many:
    # Issue 15's bounds for the forced-GC runs: max <= 1.5 x the proxy's
    # max, no second without completions.
    print(f"Medians over the {len(rounds)} rounds (the ratios are the medians of each")
    print("round's ratio to the proxy of the same round), and the rounds in which")
    print("the run's max was at most 1.5 x the proxy's with no second without")
    print("completions:")
    print()
    print("| job | front end | IOPS | p50 ms | max ms | max / proxy max | p50 / proxy p50 | rounds within 1.5 x, no idle second |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for c, j in dict.fromkeys((c, j) for c, j, _ in res):
        rs = [(rnd, res[(c, j, rnd)]) for rnd in rounds if (c, j, rnd) in res]
        med = lambda k: statistics.median(r[k] for _, r in rs)
        rm = [ratio(r, c, j, rnd, "max") for rnd, r in rs]
        rp = [ratio(r, c, j, rnd, "p50") for rnd, r in rs]
        rm, rp = [x for x in rm if x is not None], [x for x in rp if x is not None]
        ok = sum(1 for rnd, r in rs
                 if (ratio(r, c, j, rnd, "max") or 0) <= 1.5 and r["idle"] == 0
                 and ("proxy", j, rnd) in res)
        print(f"| {j} | {c} | {med('iops'):.0f} | {med('p50'):.3f} | {med('max'):.1f} | "
              f"{fmt(statistics.median(rm) if rm else None)} | "
              f"{fmt(statistics.median(rp) if rp else None)} | "
              f"{ok} of {len(rs) if ('proxy', j, rs[0][0]) in res else 0} |")
    print()
# Issue 15's third bound: the p50 with GC forced every GC_EVERY s over the
# p50 with GC as the engine decides, same job and round (the two runs
# are next to each other, on the same cache).
gcp = [(j, rnd, r["p50"] / res[("bcachefilter-nogc", j, rnd)]["p50"])
       for (c, j, rnd), r in res.items()
       if c == "bcachefilter" and ("bcachefilter-nogc", j, rnd) in res
       and res[("bcachefilter-nogc", j, rnd)]["p50"]]
if gcp:
    print("p50 with GC forced over p50 without (bcachefilter / bcachefilter-nogc,")
    print("same job and round):")
    print()
    print("| job | " + " | ".join(f"round {rnd}" for rnd in rounds) + " | median | rounds within 1.1 x |")
    print("|---|" + "---:|" * (len(rounds) + 2))
    for j in dict.fromkeys(j for j, _, _ in gcp):
        v = {rnd: x for jj, rnd, x in gcp if jj == j}
        print(f"| {j} | " + " | ".join(fmt(v.get(rnd)) for rnd in rounds) +
              f" | {fmt(statistics.median(v.values()))} | "
              f"{sum(1 for x in v.values() if x <= 1.1)} of {len(v)} |")
    print()
print("Within each bcachefilter run, the longest (ms; a histogram bucket when the")
print("stat's max was set before the run) and how many (in parentheses):")
print()
print(f"| job |{' round |' if many else ''} front end | GC passes | btree keys / nodes | reads that hit | GC lock hold (a leaf) | checkpoint lock hold | other lock hold | lookup wait for the lock | other wait for the lock | journal write | its preflush | prio write | intent mark | request's cache write | whole write in the engine |")
print(f"|---|{'---:|' if many else ''}---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (c, j, rnd), r in res.items():
    if "gc" in r:
        print(f"| {j} |{f' {rnd} |' if many else ''} {c} | {r['gc']} | {r['keys']} / {r['nodes']} | {r['hit']} | {r['slice']} | "
              f"{r['ckpt']} | {r['upd']} | {r['wait']} | {r['uwait']} | {r['jw']} | {r['jpf']} | {r['pw']} | {r['mark']} | {r['cw']} | {r['lw']} |")
print()
pf = os.path.join(out, "prefill.tsv")
if os.path.exists(pf):
    for l in open(pf):
        c, t = l.split()
        print(f"pre-fill {c}: {t} s")
