#!/usr/bin/env bash
# after-flood.sh: what writes get once a write flood that took the cache
# past its cutoffs has been written back (issue 14, writeback mode).
#
# The cutoffs (bcache's cutoff_writeback 40 %, cutoff_writeback_sync
# 70 %) count the buckets GC last marked dirty or metadata.  Random 4 KiB
# writes over an export half the cache's size leave most buckets holding
# some dirty data while a third of the cache's bytes are dirty, so the
# flood goes past 70 % and its writes are then written through.  Once
# everything is written back, the next writes should be cached again:
# this script shows whether they are.  For each filter in FILTER_SOS, in
# one run against the same kind of remote (nbdkit's memory plugin behind
# --filter=delay, 1 ms a request: filter-bench's stand-in for a NAS):
#
#   1. a fresh cache (CACHE) in writeback mode, FLOOD_SECONDS of fio
#      4 KiB random writes at QD16 over SIZE (--norandommap);
#   2. bcachefilter-ctl flush (everything written back at full speed),
#      then SETTLE_SECONDS with no request (two rounds of the rate
#      controller, which counts the buckets every 5 s);
#   3. BURST_SECONDS of the same writes.
#
# and prints, per filter: the flood's IOPS (also second by second: where
# it passes the cutoffs) and its writes written through
# (writeback_cutoff_writes), cache_available_percent and GC
# passes after step 2, and the burst's IOPS and the share of its writes
# written through.  The expected result: after a full writeback the
# burst is cached (few or no cut-off writes), as the first seconds of
# the flood were.
#
# USAGE
#   bench/after-flood.sh                        # the build tree's filter
#   FILTER_SOS="/var/tmp/old.so /var/tmp/new.so" bench/after-flood.sh
# ENVIRONMENT: FILTER_SOS (default the build tree's
# _build/default/plugin/.libs/nbdkit-bcachefilter-filter.so), BCTL (its
# tools/bcachefilter-ctl), SIZE (1G), CACHE (2G), FLOOD_SECONDS (30),
# SETTLE_SECONDS (12), BURST_SECONDS (10), BCACHE_ARGS (more filter
# parameters, e.g. bcache-direct=false), WORKDIR (default a new directory
# under /var/tmp: a disk with O_DIRECT, not tmpfs; removed at exit if
# this script made it, KEEP=1 keeps it), OUTDIR (fio's JSON,
# the statistics and the servers' logs, kept).  About 100 s per filter.
set -euo pipefail
# shellcheck disable=SC2034  # used by bench-lib.sh
BENCH_NAME=after-flood
# shellcheck source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"

top=$(cd "$(dirname "$0")/.." && pwd)
FILTER_SOS=${FILTER_SOS:-$top/_build/default/plugin/.libs/nbdkit-bcachefilter-filter.so}
BCTL=${BCTL:-$top/_build/default/tools/bcachefilter-ctl}
SIZE=${SIZE:-1G}
CACHE=${CACHE:-2G}
FLOOD_SECONDS=${FLOOD_SECONDS:-30}
SETTLE_SECONDS=${SETTLE_SECONDS:-12}
BURST_SECONDS=${BURST_SECONDS:-10}
BCACHE_ARGS=${BCACHE_ARGS:-}
for so in $FILTER_SOS; do
    [[ -f $so ]] || die "no filter at $so (build first, or set FILTER_SOS)"
done
[[ -x $BCTL ]] || die "no bcachefilter-ctl at $BCTL (set BCTL)"
fio --enghelp=nbd >/dev/null 2>&1 || die "fio has no nbd engine"
BYTES=$(numfmt --from=iec "${SIZE%B}")
CACHE_BYTES=$(numfmt --from=iec "${CACHE%B}")
# shellcheck disable=SC2034  # bench-lib.sh stops them
PIDS=()
bench_dirs after-flood
bench_cleanup_on_exit "$WORKDIR/cache.img"
RSOCK=$WORKDIR/remote.sock FSOCK=$WORKDIR/front.sock CTL=$WORKDIR/ctl.sock

# writes NAME SECONDS: 4 KiB random writes at QD16; prints the IOPS.
writes() {
    fio --name="$1" --ioengine=nbd --uri="$(uri "$FSOCK")" --rw=randwrite \
        --bs=4k --iodepth=16 --size="$BYTES" --norandommap --time_based \
        --runtime="$2" --write_iops_log="$OUTDIR/$1" --log_avg_msec=1000 \
        --output-format=json --output="$OUTDIR/$1.json" >/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("%.0f" % j["jobs"][0]["write"]["iops"])' "$OUTDIR/$1.json"
}
# snap FILE: the filter's statistics, saved.
snap() { "$BCTL" -s "$CTL" stats --json > "$1"; }
# delta BEFORE AFTER KEY: AFTER's KEY less BEFORE's.
delta() {
    PYTHONPATH="$top/bench" python3 -c '
import sys, bcfstats
a, b = bcfstats.load(sys.argv[1]), bcfstats.load(sys.argv[2])
print(b[sys.argv[3]] - a[sys.argv[3]])' "$1" "$2" "$3"
}
value() {
    PYTHONPATH="$top/bench" python3 -c '
import sys, bcfstats
print(bcfstats.load(sys.argv[1])[sys.argv[2]])' "$1" "$2"
}

rows=()
series=()
n=0
for so in $FILTER_SOS; do
    n=$((n + 1))
    tag=$n.$(basename "$so" .so)
    say "$tag: remote and filter ($so)"
    rm -f "$WORKDIR/cache.img"
    start_nbdkit remote "$RSOCK" --filter=delay memory "$BYTES" \
        delay-read=1ms delay-write=1ms
    rpid=$SERVER_PID
    # shellcheck disable=SC2086  # BCACHE_ARGS: words on purpose
    start_nbdkit "front.$tag" "$FSOCK" --filter="$so" nbd socket="$RSOCK" \
        bcache="$WORKDIR/cache.img" bcache-size="$CACHE_BYTES" \
        bcache-mode=writeback bcache-ctl="$CTL" $BCACHE_ARGS
    fpid=$SERVER_PID
    snap "$OUTDIR/$tag.0.json"
    say "$tag: flood, ${FLOOD_SECONDS} s"
    flood=$(writes "$tag.flood" "$FLOOD_SECONDS")
    snap "$OUTDIR/$tag.1.json"
    say "$tag: flush"
    "$BCTL" -s "$CTL" flush --timeout 900 > "$OUTDIR/$tag.flush.txt" 2>&1
    sleep "$SETTLE_SECONDS"
    snap "$OUTDIR/$tag.2.json"
    say "$tag: burst, ${BURST_SECONDS} s"
    burst=$(writes "$tag.burst" "$BURST_SECONDS")
    snap "$OUTDIR/$tag.3.json"
    stop_pid "$fpid" 30
    stop_pid "$rpid" 10
    fcut=$(delta "$OUTDIR/$tag.0.json" "$OUTDIR/$tag.1.json" writeback_cutoff_writes)
    bcut=$(delta "$OUTDIR/$tag.2.json" "$OUTDIR/$tag.3.json" writeback_cutoff_writes)
    bwb=$(delta "$OUTDIR/$tag.2.json" "$OUTDIR/$tag.3.json" writeback_writes)
    avail=$(value "$OUTDIR/$tag.2.json" cache_available_percent)
    gcs=$(delta "$OUTDIR/$tag.1.json" "$OUTDIR/$tag.2.json" gc_passes)
    dirty=$(value "$OUTDIR/$tag.2.json" dirty_data)
    share=$(python3 -c "import sys; c,w=int(sys.argv[1]),int(sys.argv[2]); print('%.0f %%' % (100*c/(c+w)) if c+w else '-')" "$bcut" "$bwb")
    rows+=("| $tag | $flood | $fcut | $dirty | $avail | $gcs | $burst | $bcut ($share) |")
    series+=("$tag: $(awk -F, '{ printf "%s%d", (NR > 1 ? " " : ""), $2 }' "$OUTDIR/$tag.flood_iops.1.log")")
done

{
    echo "after-flood: $(date -u +%F\ %T) UTC, SIZE=$SIZE CACHE=$CACHE" \
         "FLOOD_SECONDS=$FLOOD_SECONDS SETTLE_SECONDS=$SETTLE_SECONDS" \
         "BURST_SECONDS=$BURST_SECONDS BCACHE_ARGS='$BCACHE_ARGS'"
    echo
    echo "| filter | flood IOPS | flood writes cut off | after flush: dirty bytes | cache_available_percent | GC passes during flush + settle | burst IOPS | burst writes cut off (share) |"
    echo "|---|---:|---:|---:|---:|---:|---:|---:|"
    printf '%s\n' "${rows[@]}"
    echo
    echo "The flood's write IOPS, second by second (fio's --write_iops_log):"
    echo
    printf '    %s\n' "${series[@]}"
} | tee "$OUTDIR/summary.md"
say "results in $OUTDIR"
