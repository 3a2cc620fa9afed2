#!/usr/bin/env bash
# gc-stall.sh: latency while GC runs, measured the way the seed measured it.
#
# WHAT IT MEASURES
#   The seed's job, fio --bs=8k --iodepth=1 --readwrite=randrw with
#   --write_lat_log --log_avg_msec=1000 --log_max_value=1 (fio's nbd
#   engine), and a QD16 4 KiB randrw variant, against three front ends of
#   the same remote, side by side in one run:
#
#     proxy         nbdkit nbd plugin -> remote (pass-through)
#     cachefilter   nbdkit --filter=cache cache=writeback cache-on-read=true
#                   cache-max-size=CACHE (nbdkit's own cache filter)
#     bcachefilter  nbdkit --filter=$FILTER_SO nbd -> remote,
#                   bcache-size=CACHE, bcache-ctl=... (writethrough)
#
#   The remote is nbdkit's memory plugin behind --filter=delay
#   delay-read=1ms delay-write=1ms (filter-bench.sh's stand-in for a NAS).
#
#   Sizes come from KEYS, the number of 4 KiB extents the bcachefilter
#   index should hold: the cache is KEYS * 4 KiB * 5/4 (data plus room for
#   metadata and the allocator's reserves), the export 4 * the cache.  The
#   caches are pre-filled through nbdkit: 4 KiB random reads at QD16
#   (fio's random map: each block once) of 3/2 * KEYS blocks, more than
#   fit, so the allocator must reclaim before the measured jobs start.
#   The pre-fill time is printed (it is bounded by the 1 ms remote: about
#   16 IOPS per ms, so ~1 min per million keys on an idle host).
#
#   Each job then runs DURATION seconds, for every front end, job by job:
#     proxy, cachefilter, bcachefilter-nogc (GC as the engine decides),
#     bcachefilter (GC forced every GC_EVERY s with bcachefilter-ctl
#     trigger-gc for the whole run).
#   Both bcachefilter runs are on the same pre-filled cache (one front end).
#   Before every run (and pre-fill) the host's dirty pages are written
#   back (bench-lib.sh's settle_disk; how much there was goes to
#   settle.tsv): the cache filter's temporary file is never synced, and
#   its writeback would otherwise land in the next front end's run.
#
#   Per run: IOPS (read + write), p50 / p99 / max completion latency
#   (fio's unified mixed statistics), the worst second (the largest
#   per-second max in fio's latency log), the seconds without any
#   completion (seconds of the run missing from the log), and the ratios
#   to the proxy in the same run.  The bcachefilter runs also save
#   bcachefilter-ctl stats --json (GC passes, slice sizes, lock holds).
#   Nothing fails because something was slow.
#
#   With REPEAT=N every job runs N times for every front end (round r
#   runs each of them once, so the rounds share the host's minutes), and
#   the summary adds, per job and front end, the medians over the rounds
#   and in how many rounds the forced-GC run met issue 15's bounds: a
#   single run's maximum follows single slow device writes and the
#   proxy's own maximum (stop 23 saw 0.95 x and 11.94 x the proxy with the
#   same code within half an hour).  Every run has a seed of its own
#   (fio --randrepeat=0 --randseed=N, N counting the runs; commands.txt
#   has them): the two bcachefilter front ends share one cache, and a run
#   with the seed of the one before it re-reads and re-writes what that
#   one just cached (stop 37: the forced-GC run after the nogc run served
#   ~4,500 hits/s from the device against the nogc run's ~850 until it
#   passed the other's last offset, and had twice its maxima).
#
# USAGE
#   bench/gc-stall.sh                            # KEYS=250k, 30 s per run
#   KEYS=1M DURATION=60 GC_EVERY=5 bench/gc-stall.sh
#   KEYS=1M REPEAT=3 CONFIGS="proxy bcachefilter" bench/gc-stall.sh
#
# ENVIRONMENT (all optional)
#   KEYS       extents to aim for (default 250k; k/M suffixes)
#   DURATION   seconds per measured run (default 30)
#   GC_EVERY   seconds between forced GC passes (default 5)
#   JOBS       subset of: qd1 qd16 (default both)
#   CONFIGS    subset of: proxy cachefilter bcachefilter-nogc bcachefilter
#   REPEAT     rounds of every job (default 1)
#   FILTER_SO  the filter (default _build/plugin/.libs/... of this tree)
#   BCTL       bcachefilter-ctl (default _build/tools/bcachefilter-ctl)
#   WORKDIR    cache files and sockets (default mktemp -d /var/tmp/...;
#              a disk with O_DIRECT; needs ~2.5 * CACHE free)
#   OUTDIR     fio JSON and logs, stats, summary.md (kept; default
#              /var/tmp/gc-stall-results.DATE-TIME)
#   BCACHE_ARGS extra bcachefilter parameters
#   KEEP=1     keep WORKDIR
#
# Needs nbdkit (memory, nbd plugins; delay, cache filters), fio with the
# nbd engine, nbdinfo, python3.  Every process it starts is stopped at exit.

set -euo pipefail

# shellcheck disable=SC2034  # used by bench-lib.sh
BENCH_NAME=gc-stall
# shellcheck source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"

HERE=$(cd "$(dirname "$0")/.." && pwd)
KEYS=${KEYS:-250k}
DURATION=${DURATION:-30}
GC_EVERY=${GC_EVERY:-5}
JOBS=${JOBS:-qd1 qd16}
REPEAT=${REPEAT:-1}
CONFIGS=${CONFIGS:-proxy cachefilter bcachefilter-nogc bcachefilter}
FILTER_SO=${FILTER_SO:-$HERE/_build/plugin/.libs/nbdkit-bcachefilter-filter.so}
BCTL=${BCTL:-$HERE/_build/tools/bcachefilter-ctl}
BCACHE_ARGS=${BCACHE_ARGS:-}
KEEP=${KEEP:-0}
PIDS=()

for t in nbdkit fio nbdinfo python3; do
    command -v "$t" >/dev/null || die "$t is not installed"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "fio has no nbd engine"
[[ -f $FILTER_SO ]] || die "no filter at $FILTER_SO (build first, or set FILTER_SO)"
[[ -x $BCTL ]] || die "no bcachefilter-ctl at $BCTL (set BCTL)"
for j in $JOBS; do [[ $j == qd1 || $j == qd16 ]] || die "unknown job '$j'"; done
[[ $REPEAT =~ ^[1-9][0-9]*$ ]] || die "REPEAT must be a positive integer, not '$REPEAT'"
for c in $CONFIGS; do
    case $c in proxy|cachefilter|bcachefilter-nogc|bcachefilter) ;;
    *) die "unknown config '$c'" ;;
    esac
done
has_config() { [[ " $CONFIGS " == *" $1 "* ]]; }

NKEYS=$(numfmt --from=si "${KEYS^^}") || die "bad KEYS=$KEYS"
(( NKEYS >= 10000 )) || die "KEYS must be at least 10k"
MIB=$(( 1024 * 1024 ))
CACHE_BYTES=$(( (NKEYS * 4096 * 5 / 4 + MIB - 1) / MIB * MIB ))
EXPORT_BYTES=$(( 4 * CACHE_BYTES ))
PREFILL_BYTES=$(( NKEYS * 3 / 2 * 4096 ))

bench_dirs gc-stall
AVAIL=$(df -B1 --output=avail "$WORKDIR" | tail -1)
(( AVAIL > 5 * CACHE_BYTES / 2 + (1 << 30) )) ||
    die "WORKDIR needs ~2.5 * $(numfmt --to=iec $CACHE_BYTES) free"

RSOCK=$WORKDIR/remote.sock
CTLSOCK=$WORKDIR/ctl.sock
CACHE=$WORKDIR/cache.img

bench_cleanup_on_exit "$CACHE"

{
    echo "date:      $(date -Is)"
    echo "command:   KEYS=$KEYS DURATION=$DURATION GC_EVERY=$GC_EVERY REPEAT=$REPEAT JOBS=\"$JOBS\" CONFIGS=\"$CONFIGS\" BCACHE_ARGS=\"$BCACHE_ARGS\" $0"
    echo "host:      nproc=$(nproc), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), RAM $(free -g | awk '/^Mem/ {print $2}') GiB"
    echo "software:  $(nbdkit --version), $(fio --version)"
    echo "filter:    $FILTER_SO ($(stat -c '%y' "$FILTER_SO" | cut -d. -f1))"
    echo "sizes:     cache $(numfmt --to=iec $CACHE_BYTES), export $(numfmt --to=iec $EXPORT_BYTES), pre-fill $(numfmt --to=iec $PREFILL_BYTES) (4 KiB reads)"
    echo "load avg:  $(cut -d' ' -f1-3 /proc/loadavg) (start)"
} | tee "$OUTDIR/machine.txt" >&2

# ---- servers ----------------------------------------------------------------
start_nbdkit remote "$RSOCK" --filter=delay memory size="$EXPORT_BYTES" \
    delay-read=1ms delay-write=1ms
declare -A SOCK
if has_config proxy; then
    start_nbdkit proxy "$WORKDIR/proxy.sock" nbd socket="$RSOCK"
    SOCK[proxy]=$WORKDIR/proxy.sock
fi
if has_config cachefilter; then
    TMPDIR=$WORKDIR start_nbdkit cachefilter "$WORKDIR/cachefilter.sock" \
        --filter=cache nbd socket="$RSOCK" cache=writeback cache-on-read=true \
        cache-max-size="$CACHE_BYTES"
    SOCK[cachefilter]=$WORKDIR/cachefilter.sock
fi
if has_config bcachefilter || has_config bcachefilter-nogc; then
    rm -f "$CACHE"
    # shellcheck disable=SC2086
    start_nbdkit bcachefilter "$WORKDIR/bcachefilter.sock" \
        --filter="$FILTER_SO" nbd socket="$RSOCK" bcache="$CACHE" \
        bcache-size="$CACHE_BYTES" bcache-ctl="$CTLSOCK" $BCACHE_ARGS
    SOCK[bcachefilter]=$WORKDIR/bcachefilter.sock
    SOCK[bcachefilter-nogc]=$WORKDIR/bcachefilter.sock
fi

# fio_bg NAME SOCKET OUTPUT ARGS...: fio in the background, waited for, so
# that a signal is handled at once.
run_fio() {
    local name=$1 sock=$2 json=$3; shift 3
    echo "fio --name=$name --ioengine=nbd --uri=$(uri "$sock") $*" >>"$OUTDIR/commands.txt"
    fio --name="$name" --ioengine=nbd --uri="$(uri "$sock")" --numjobs=1 \
        --output-format=json --output="$json" "$@" >/dev/null &
    local fpid=$! rc=0
    PIDS+=("$fpid")
    wait "$fpid" || rc=$?
    stop_pid "$fpid"
    (( rc == 0 )) || die "fio failed ($name, status $rc); see $json"
}

bstats() {                      # bstats FILE
    "$BCTL" --socket "$CTLSOCK" stats --json >"$1" 2>&1 || true
}

# ---- pre-fill -----------------------------------------------------------------
for c in cachefilter bcachefilter; do
    [[ -n ${SOCK[$c]:-} ]] || continue
    settle_disk "prefill.$c"
    say "pre-fill $c: $(( PREFILL_BYTES / 4096 )) random 4 KiB reads at QD16"
    t0=$(date +%s.%N)
    run_fio prefill "${SOCK[$c]}" "$OUTDIR/prefill.$c.json" \
        --rw=randread --bs=4k --iodepth=16 --size="$PREFILL_BYTES"
    t1=$(date +%s.%N)
    PF=$(python3 -c "print(f'{$t1 - $t0:.0f}')")
    echo "$c	$PF" >>"$OUTDIR/prefill.tsv"
    say "pre-fill $c took ${PF} s"
    if [[ $c == bcachefilter ]]; then bstats "$OUTDIR/prefill.stats.json"; fi
done

# ---- runs ---------------------------------------------------------------------
job_args() {
    case $1 in
    qd1)  echo "--bs=8k --iodepth=1 --readwrite=randrw" ;;
    qd16) echo "--bs=4k --iodepth=16 --readwrite=randrw" ;;
    esac
}

RESULTS=$OUTDIR/results.tsv
: >"$RESULTS"
runno=0
for rep in $(seq "$REPEAT"); do
for j in $JOBS; do
    for c in $CONFIGS; do
        name=$c.$j
        if (( REPEAT > 1 )); then name=$name.r$rep; fi
        settle_disk "$name"
        say "run $name: ${DURATION}s"
        gcpid=
        if [[ $c == bcachefilter ]]; then
            bstats "$OUTDIR/$name.before.json"
            ( while sleep "$GC_EVERY"; do
                  "$BCTL" --socket "$CTLSOCK" trigger-gc >/dev/null 2>&1 || true
              done ) &
            gcpid=$!
            PIDS+=("$gcpid")
        elif [[ $c == bcachefilter-nogc ]]; then
            bstats "$OUTDIR/$name.before.json"
        fi
        # --randseed: every run its own offsets (the header says why;
        # fio's default seed is fixed).  fio 3.33 ignores it unless
        # --randrepeat=0; with both it repeats.
        runno=$((runno + 1))
        # shellcheck disable=SC2046
        run_fio "$name" "${SOCK[$c]}" "$OUTDIR/$name.json" $(job_args "$j") \
            --randrepeat=0 --randseed="$runno" \
            --size="$EXPORT_BYTES" --norandommap --time_based \
            --runtime="$DURATION" --unified_rw_reporting=mixed \
            --write_lat_log="$OUTDIR/$name" --log_avg_msec=1000 \
            --log_max_value=1
        if [[ -n $gcpid ]]; then stop_pid "$gcpid" 5; fi
        if [[ $c == bcachefilter* ]]; then bstats "$OUTDIR/$name.stats.json"; fi
        printf '%s\t%s\t%s\t%s\n' "$c" "$j" "$name" "$rep" >>"$RESULTS"
    done
done
done

# ---- summary ------------------------------------------------------------------
python3 "$(dirname "$0")/gc-stall-summary.py" "$OUTDIR" "$DURATION" |
    tee "$OUTDIR/summary.md"
say "results in $OUTDIR"
