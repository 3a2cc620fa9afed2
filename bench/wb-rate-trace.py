# bench: wb-rate.sh's sampler of the writeback statistics, and its tables.
#
#   wb-rate-trace.py sample --bctl B --ctl SOCK --out TSV --every S
#                   [--seconds N] [--until clean|at_max] [--timeout T]
#                   [--resume] [--progress S] [--result JSON]
#       Samples `bcachefilter-ctl stats --json` every S seconds into TSV
#       (one row per sample, the columns of COLS), for N seconds or until
#       nothing is dirty / the idle boost is on (then exit 0; 3 if the
#       timeout passed first).  --resume sets writeback_running 1 after
#       the first sample, and t = 0 is the moment it was sent.  --result
#       writes what the caller reports (times, first and last sample).
#   wb-rate-trace.py drain-result WORKLOAD SAMPLE_JSON IDLE_JSON
#                   REMOTE_STATS VERIFY OUT_JSON
#       One drain's figures: the sampler's result, the wait for the idle
#       boost, and the remote's nbdkit stats filter file (its write ops
#       are the writeback's backing writes).
#   wb-rate-trace.py settle TSV SECONDS OUT_JSON
#       The settle run's figures over the last half of the run, and the
#       condensed trace (every 5 s) on stdout.
#   wb-rate-trace.py summary OUTDIR
#       summary.md's tables from OUTDIR's *.result.json, on stdout.
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bcfstats  # noqa: E402

MIB = 1048576.0
# The TSV's columns after t (seconds) and dirty_pct: statistics by name.
STATS = [
    "dirty_data", "writeback_rate", "writeback_rate_target",
    "writeback_rate_dirty", "writeback_rate_proportional",
    "writeback_rate_integral", "writeback_rate_change",
    "writeback_rate_next_io_ns", "writeback_rate_at_max",
    "writeback_bytes", "writeback_keys_done", "writeback_keys_failed",
    "export_flushes", "writeback_writes", "writeback_cutoff_writes",
    "buckets_dirty", "buckets_meta", "nbuckets", "bucket_bytes",
    "cache_available_percent", "writeback_running", "writeback_flushing",
    "writeback_backing_errors", "writeback_read_errors",
    "buckets_clean", "gc_passes",
]
COLS = ["t", "dirty_pct"] + STATS


def stats(bctl, ctl):
    out = subprocess.run([bctl, "-s", ctl, "stats", "--json"],
                         capture_output=True, text=True, check=True).stdout
    return bcfstats.flat(json.loads(out))


def capacity(f):
    """What writeback_percent is a percent of (core/writeback.c:
    capacity_sectors = bcf_cache_capacity_bytes = nbuckets * bucket_bytes)."""
    return f["nbuckets"] * f["bucket_bytes"]


def row(t, f):
    pct = 100.0 * f["dirty_data"] / capacity(f)
    vals = [f"{t:.3f}", f"{pct:.3f}"] + [str(int(f.get(k, -1))) for k in STATS]
    return "\t".join(vals) + "\n"


def cmd_sample(a):
    every = float(a["--every"])
    seconds = float(a.get("--seconds", 0))
    until = a.get("--until")
    timeout = float(a.get("--timeout", 0))
    progress = float(a.get("--progress", 0))
    bctl, ctl = a["--bctl"], a["--ctl"]
    res = {}
    with open(a["--out"], "w") as out:
        out.write("\t".join(COLS) + "\n")
        first = stats(bctl, ctl)
        t0 = time.monotonic()
        if "--resume" in a:
            subprocess.run([bctl, "-s", ctl, "set", "writeback_running", "1"],
                           check=True, stdout=subprocess.DEVNULL)
        out.write(row(0.0, first))
        res["first"] = first
        last_print = -progress
        n, f, t, done = 0, first, 0.0, False
        while True:
            n += 1
            # On a schedule, so that a slow stats call does not stretch it.
            time.sleep(max(0.0, t0 + n * every - time.monotonic()))
            f = stats(bctl, ctl)
            t = time.monotonic() - t0
            out.write(row(t, f))
            out.flush()
            if progress and t - last_print >= progress:
                last_print = t
                print(f"  t={t:6.1f}s dirty {f['dirty_data'] / MIB:8.1f} MiB"
                      f" ({100.0 * f['dirty_data'] / capacity(f):5.2f} %)"
                      f" rate {f['writeback_rate'] / MIB:9.2f} MiB/s"
                      f" written back {f['writeback_bytes'] / MIB:8.1f} MiB"
                      f" at_max {f['writeback_rate_at_max']}",
                      file=sys.stderr, flush=True)
            if until == "clean" and f["dirty_data"] == 0:
                done = True
            elif until == "at_max" and f["writeback_rate_at_max"]:
                done = True
            elif seconds and t >= seconds:
                done = True
            if done or (timeout and t >= timeout):
                break
    res.update(last=f, seconds=t, samples=n + 1, reached=done)
    if "--result" in a:
        with open(a["--result"], "w") as fp:
            json.dump(res, fp, indent=1)
    return 0 if done else 3


def read_tsv(path):
    with open(path) as f:
        head = f.readline().rstrip("\n").split("\t")
        rows = []
        for line in f:
            v = line.rstrip("\n").split("\t")
            rows.append({k: float(x) for k, x in zip(head, v)})
    return rows


def cmd_settle(tsv, seconds, out_json):
    rows = read_tsv(tsv)
    if not rows:
        sys.exit("wb-rate-trace: empty trace " + tsv)
    cap = rows[-1]["nbuckets"] * rows[-1]["bucket_bytes"]
    target = 100.0 * rows[-1]["writeback_rate_target"] / cap
    half = [r for r in rows if r["t"] >= seconds / 2.0 and r["t"] <= seconds]
    pcts = [r["dirty_pct"] for r in half] or [rows[-1]["dirty_pct"]]
    mean = sum(pcts) / len(pcts)
    # When dirty data first reached the target, and from when on it
    # stayed within +-2 points of it.
    reached = next((r["t"] for r in rows if r["dirty_pct"] >= target), None)
    settled = None
    for r in rows:
        if r["t"] > seconds:
            break
        inside = abs(r["dirty_pct"] - target) <= 2.0
        if inside and settled is None:
            settled = r["t"]
        elif not inside:
            settled = None
    # Seconds in which dirty data was above the target and nothing was
    # written back (the longest such stretch, and in all), and what was
    # written back against what came in over the last half.
    stalled, longest, run = 0.0, 0.0, 0.0
    for a, b in zip(rows, rows[1:]):
        dt = b["t"] - a["t"]
        if (a["dirty_data"] > a["writeback_rate_target"] and
                b["writeback_bytes"] == a["writeback_bytes"]):
            stalled += dt
            run += dt
            longest = max(longest, run)
        else:
            run = 0.0
    h0, h1 = (half[0], half[-1]) if len(half) > 1 else (rows[0], rows[-1])
    span = max(1e-9, h1["t"] - h0["t"])
    wb_mib_s = (h1["writeback_bytes"] - h0["writeback_bytes"]) / MIB / span
    res = dict(target_pct=target, mean_pct=mean, min_pct=min(pcts),
               max_pct=max(pcts), samples=len(pcts),
               within=all(abs(p - target) <= 2.0 for p in pcts),
               reached_target_s=reached, settled_from_s=settled,
               capacity_bytes=cap, seconds=seconds,
               stalled_s=stalled, longest_stall_s=longest,
               writeback_mib_s_last_half=wb_mib_s,
               start_pct=rows[0]["dirty_pct"])
    with open(out_json, "w") as fp:
        json.dump(res, fp, indent=1)
    # The condensed trace: bcache's writeback_rate_debug fields, every 5 s.
    print("| t s | dirty MiB | dirty % | in use % | rate KiB/s | target MiB"
          " | proportional KiB/s | integral KiB/s | change KiB/s | next io ms"
          " | at max | written back MiB | cutoff writes |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    nxt = 0.0
    for r in rows:
        if r["t"] + 0.5 < nxt:
            continue
        nxt += 5.0
        print(f"| {r['t']:.0f} | {r['dirty_data'] / MIB:.1f}"
              f" | {r['dirty_pct']:.2f}"
              f" | {100 - r['cache_available_percent']:.0f}"
              f" | {r['writeback_rate'] / 1024:.1f}"
              f" | {r['writeback_rate_target'] / MIB:.1f}"
              f" | {r['writeback_rate_proportional'] / 1024:.1f}"
              f" | {r['writeback_rate_integral'] / 1024:.1f}"
              f" | {r['writeback_rate_change'] / 1024:.1f}"
              f" | {r['writeback_rate_next_io_ns'] / 1e6:.0f}"
              f" | {r['writeback_rate_at_max']:.0f}"
              f" | {r['writeback_bytes'] / MIB:.1f}"
              f" | {r['writeback_cutoff_writes']:.0f} |")
    return 0


def remote_ops(path):
    """{op: (count, bytes, seconds)} from nbdkit's stats filter file
    (seconds: the time the requests took, summed)."""
    ops = {}
    units = {"bytes": 1, "KiB": 1024, "MiB": MIB, "GiB": MIB * 1024,
             "TiB": MIB * MIB}
    try:
        with open(path) as f:
            for line in f:
                if line[:1].isspace() or ": " not in line:
                    continue
                op, rest = line.split(": ", 1)
                parts = [p.strip() for p in rest.split(",")]
                n = int(parts[0].split()[0])
                size, secs = 0, 0.0
                if len(parts) > 1 and parts[1].endswith(" s"):
                    secs = float(parts[1].split()[0])
                if len(parts) > 2 and parts[2].split()[-1] in units:
                    num, unit = parts[2].split()
                    size = float(num) * units[unit]
                ops[op] = (n, size, secs)
    except OSError:
        pass
    return ops


def fio_write(path):
    try:
        with open(path) as f:
            return json.load(f)["jobs"][0]["write"]["bw_bytes"] / MIB
    except (OSError, ValueError, KeyError, IndexError):
        return None


def cmd_drain_result(workload, sample_json, idle_json, remote, verify, out,
                     near=None):
    s, idle = load(sample_json), load(idle_json) or {}
    first, last = s["first"], s["last"]
    d = lambda k: last[k] - first[k]  # noqa: E731
    res = dict(workload=workload, dirty_bytes=first["dirty_data"],
               capacity_bytes=capacity(first),
               dirty_left=last["dirty_data"], seconds=s["seconds"],
               reached=s["reached"],
               mib_s=first["dirty_data"] / MIB / s["seconds"],
               idle_boost_s=idle.get("seconds", float("nan")),
               idle_boost_reached=idle.get("reached", False),
               written_back_bytes=d("writeback_bytes"),
               export_flushes=d("export_flushes"),
               keys_done=d("writeback_keys_done"),
               keys_failed=d("writeback_keys_failed"),
               backing_errors=d("writeback_backing_errors"),
               read_errors=d("writeback_read_errors"),
               cutoff_writes=last["writeback_cutoff_writes"],
               verify=verify)
    ops = remote_ops(remote)
    if "write" in ops:
        res["backing_writes"] = ops["write"][0]
        res["backing_write_bytes"] = ops["write"][1]
        res["avg_write_kib"] = round(ops["write"][1] / 1024
                                     / max(1, ops["write"][0]), 1)
        # The remote's summed write time over the drain's: with several
        # backing writes in flight (writeback.c's WRITERS) it can pass
        # 100 %.
        res["remote_write_s"] = ops["write"][2]
        res["remote_busy_pct"] = 100.0 * ops["write"][2] / s["seconds"]
        res["remote_ms_per_write"] = 1000.0 * ops["write"][2] / max(
            1, ops["write"][0])
        res["ms_per_write"] = 1000.0 * s["seconds"] / max(1, ops["write"][0])
    if "flush" in ops:
        res["remote_flushes"] = ops["flush"][0]
    # fio alone on a second remote just before and just after: the
    # references within the same minutes.
    if near:
        for j in ("seq", "seqqd", "rand"):
            v = [fio_write(f"{near}.{j}.{w}.json") for w in ("before", "after")]
            v = [x for x in v if x is not None]
            if v:
                res[f"near_{j}_mib_s"] = v
                res[f"near_{j}_ratio"] = res["mib_s"] / (sum(v) / len(v))
        # Target 1's reference: the export's sequential speed, the faster
        # of fio's two depths.
        r = [res[k] for k in ("near_seq_ratio", "near_seqqd_ratio") if k in res]
        if r:
            res["near_best_ratio"] = min(r)
    with open(out, "w") as fp:
        json.dump(res, fp, indent=1)
    return 0


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cmd_summary(outdir):
    base = load(os.path.join(outdir, "baseline.result.json")) or {}
    seq = base.get("seq_mib_s")
    print("## Export baseline (fio alone against the remote)\n")
    print("| job | result |")
    print("|---|---:|")
    for k, label, unit in (
            ("seq_mib_s", "sequential write, bs=RUN_MAX_BYTES, QD1", "MiB/s"),
            ("seqqd_mib_s", "sequential write, bs=RUN_MAX_BYTES, QD=WRITERS",
             "MiB/s"),
            ("seq_fio_ms", "... one write as fio saw it (mean completion)",
             "ms"),
            ("seq_remote_ms", "... one write inside the remote (its stats"
             " filter)", "ms"),
            ("seq_proxy_mib_s", "the same through nbdkit's nbd plugin (the"
             " filter's hop to the export)", "MiB/s"),
            ("rand_qd1_iops", "random 4 KiB write, QD1", "IOPS"),
            ("rand_qd16_iops", "random 4 KiB write, QD16", "IOPS"),
            ("dev_seq_mib_s", "cache device (WORKDIR): 512 KiB O_DIRECT"
             " reads, QD1", "MiB/s"),
            ("dev_rand_iops", "cache device (WORKDIR): 4 KiB O_DIRECT"
             " random reads, QD1", "IOPS")):
        if k in base:
            print(f"| {label} | {base[k]:.1f} {unit} |")
    print()
    drains = [(v, load(os.path.join(outdir, f"drain.{v}.result.json")))
              for v in ("random", "seq")]
    drains = [(v, d) for v, d in drains if d]
    if drains:
        print("## Idle drain (writeback at full speed after the idle boost)\n")
        print("Each drain is set against fio alone on a second fresh remote"
              " just before it (during the wait for the idle boost) and just"
              " after it: sequential writes of RUN_MAX_BYTES at QD1 and at"
              " WRITERS (target 1's reference is the faster of the two) and"
              " random 4 KiB writes at QD1 (the random drain's own"
              " pattern).  The baseline phase's figure, minutes away on a"
              " shared host, is in the last ratio column.\n")
        print("| dirty data written as | dirty MiB | drain s | drain MiB/s"
              " | fio seq MiB/s before / after | ÷ it"
              " | fio seq at WRITERS MiB/s before / after | ÷ it"
              " | ÷ the faster | target ≥ 0.8"
              " | fio rand 4K QD1 MiB/s before / after | ÷ it"
              " | ÷ baseline phase seq | idle boost after s"
              " | backing writes | avg KiB/write | backing flushes"
              " | ms per write: drain / inside the remote | remote busy %"
              " | keys done | keys failed | verify |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:"
              "|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        nan = float("nan")
        pair = lambda v: " / ".join(f"{x:.1f}" for x in v) if v else "–"  # noqa
        for v, d in drains:
            ratio = d["mib_s"] / seq if seq else nan
            near = d.get("near_best_ratio", d.get("near_seq_ratio", ratio))
            ok = "yes" if near >= 0.8 else "no"
            print(f"| {d['workload']} | {d['dirty_bytes'] / MIB:.0f}"
                  f" | {d['seconds']:.2f} | {d['mib_s']:.1f}"
                  f" | {pair(d.get('near_seq_mib_s'))}"
                  f" | {d.get('near_seq_ratio', nan):.2f}"
                  f" | {pair(d.get('near_seqqd_mib_s'))}"
                  f" | {d.get('near_seqqd_ratio', nan):.2f}"
                  f" | {near:.2f} | {ok}"
                  f" | {pair(d.get('near_rand_mib_s'))}"
                  f" | {d.get('near_rand_ratio', nan):.2f}"
                  f" | {ratio:.2f} | {d['idle_boost_s']:.0f}"
                  f" | {d.get('backing_writes', '?')}"
                  f" | {d.get('avg_write_kib', '?')}"
                  f" | {d.get('remote_flushes', '?')}"
                  f" | {d.get('ms_per_write', float('nan')):.2f}"
                  f" / {d.get('remote_ms_per_write', float('nan')):.2f}"
                  f" | {d.get('remote_busy_pct', float('nan')):.0f}"
                  f" | {d['keys_done']}"
                  f" | {d['keys_failed']} | {d['verify']} |")
        print()
    st = load(os.path.join(outdir, "settle.result.json"))
    if st:
        start = ("after a pre-fill to the target" if st.get("prefill")
                 else "from an empty cache")
        print("## Settle (steady random 4 KiB writes below the export's"
              " speed)\n")
        print(f"Load: {st['rate_iops']} IOPS ({st['rate_note']}),"
              f" cache capacity {st['capacity_bytes'] / MIB:.0f} MiB"
              f" (nbuckets × bucket_bytes), {st['seconds']:.0f} s,"
              f" {start}."
              f" The proportional term alone would hold dirty data"
              f" {st['p_only_excess_pct']:.1f} points above the target"
              f" under this load ({st['p_term_inverse']} s of it:"
              f" p_term_inverse); the integral term takes that excess"
              f" away over hundreds of seconds.\n")
        print("| target % | start % | mean % | min % | max % (last half)"
              " | within ±2 | reached target at s | inside ±2 from s"
              " | load MiB/s | written back MiB/s (last half)"
              " | s above target, nothing written back (longest)"
              " | writes cut off (written through) |")
        print("|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
        fmt = lambda x: "–" if x is None else f"{x:.0f}"  # noqa: E731
        print(f"| {st['target_pct']:.1f} | {st['start_pct']:.2f}"
              f" | {st['mean_pct']:.2f}"
              f" | {st['min_pct']:.2f} | {st['max_pct']:.2f}"
              f" | {'yes' if st['within'] else 'no'}"
              f" | {fmt(st['reached_target_s'])}"
              f" | {fmt(st['settled_from_s'])}"
              f" | {st.get('fio_iops', 0) * 4096 / MIB:.2f}"
              f" | {st['writeback_mib_s_last_half']:.2f}"
              f" | {st['stalled_s']:.0f} ({st['longest_stall_s']:.0f})"
              f" | {st.get('cutoff_writes', '?')} |")
        print()
    return 0


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__ if __doc__ else "usage: see the header")
    cmd = argv[1]
    if cmd == "sample":
        a, i = {}, 2
        while i < len(argv):
            if argv[i] == "--resume":
                a["--resume"] = True
                i += 1
            else:
                a[argv[i]] = argv[i + 1]
                i += 2
        return cmd_sample(a)
    if cmd == "drain-result":
        return cmd_drain_result(*argv[2:9])
    if cmd == "settle":
        return cmd_settle(argv[2], float(argv[3]), argv[4])
    if cmd == "summary":
        return cmd_summary(argv[2])
    sys.exit("wb-rate-trace: unknown command " + cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
