#!/usr/bin/env bash
# wb-rate.sh: how fast the writeback drains, and where its rate controller
# holds the dirty data (issue 14, writeback mode).
#
# WHAT IT MEASURES
#   The issue's two writeback targets, in one run, against one kind of
#   remote: nbdkit's memory plugin behind --filter=delay delay-write=1ms
#   delay-read=1ms (filter-bench.sh's stand-in for a NAS), with nbdkit's
#   stats filter in front of it, which counts the backing writes and the
#   time the remote itself took for them.  Every phase starts a fresh
#   remote (the memory plugin writes to new pages much more slowly than
#   to pages it has, so every measured write goes to new ones) and,
#   for the filter, a fresh cache.
#
#   baseline  fio alone against the remote, BASE_SECONDS each:
#             sequential writes of WB_BS at QD1 and at WB_QD, and random
#             4 KiB writes at QD1 and QD16.  WB_BS is the most the
#             writeback sends in one backing write (RUN_MAX_BYTES in
#             core/writeback.c, read from the source: 4 MiB), WB_QD the
#             most backing writes it has in flight (WRITERS there: 16):
#             for each batch (one scan of at most 128 dirty extents, cut
#             into at most 64 runs of contiguous extents, 64 MiB) its
#             writers read runs from the cache and write them to the
#             export, up to WB_QD at once, then it flushes the export
#             once for the batch.  The faster of the two sequential
#             figures is the reference of target 1 ("idle writeback
#             drains at >= 0.8x the export's sequential write speed
#             measured by fio alone"): the export's speed, not fio's at
#             one depth.  fio issues
#             no flushes (the memory plugin's flush costs nothing).  The
#             same job through nbdkit's nbd plugin (a pass-through proxy,
#             the filter's own way to the export) shows what that hop
#             costs.  Also
#             the cache device under WORKDIR, which the writeback reads
#             before each backing write: 512 KiB (a bucket, the largest
#             extent) and 4 KiB O_DIRECT reads at QD1, 5 s each.
#   drain     target 1.  The filter in writeback mode on a cache of
#             DRAIN_CACHE (default 4 * DIRTY: the fill stays below
#             bcache's 40 % cutoff_writeback, above which writes would be
#             written through), with bcache-sequential-cutoff=0 so that
#             the sequential fill is cached too.  The writeback is paused
#             (bcachefilter-ctl set writeback_running 0), DIRTY is written
#             through the filter with fio (--verify=crc32c, verified
#             later), and dirty_data must then be DIRTY.  The script
#             waits, still paused, until the controller's idle boost is
#             on (writeback_rate_at_max: no front-end request for
#             BCF_WB_IDLE_ROUNDS = 6 rounds of writeback_rate_update_seconds
#             = 5 s, so ~30 s: "idle writeback" in bcache's sense; the
#             wait is reported), resumes the writeback and samples the
#             statistics every POLL seconds until dirty_data is 0.  Drain
#             MiB/s = the dirty bytes / the time from the resume to the
#             first sample that saw 0 (so it is low by up to POLL
#             seconds).  Two variants:
#               random  DIRTY of 4 KiB random writes at QD16 over the
#                       whole export (fio's random map: each block at most
#                       once), so only about DIRTY/SIZE of the keys touch
#                       a neighbour: nearly every backing write is one
#                       4 KiB key, at QD1, to a remote that takes 1 ms per
#                       write.  Bounded by the remote's latency, not its
#                       bandwidth: compare the QD1 random baseline too.
#               seq     SEQ_BS (1M) sequential writes at QD16: contiguous
#                       keys, merged into backing writes of WB_BS.
#             A shared host's speed drifts between phases, so each drain
#             also has its own references, measured in the same minutes:
#             fio alone on a second fresh remote (same configuration),
#             sequential WB_BS writes at QD1 and at WB_QD and random 4 KiB
#             writes at QD1, BASE_SECONDS each, once while the script
#             waits for the idle boost and once right after the drain;
#             target 1's ratio is the drain over the mean of the two
#             sequential figures at the depth that was faster.
#             Afterwards fio --verify_only reads the remote directly: it
#             must hold exactly what was written.  The table gives the
#             writeback's counters over the drain (keys done and failed),
#             the remote's count of writes and flushes, their average
#             size, and the time per backing write (the drain's, and the
#             remote's own, to set against the baseline's).
#   settle    target 2.  The filter in writeback mode on a fresh cache of
#             CACHE (default 1G), every writeback setting at its default
#             (writeback_percent 10, update every 5 s, delay 30 s).  With
#             SETTLE_PREFILL=1 (the default) dirty data is first written up
#             to the target (writeback_percent of the cache) at full speed
#             with the writeback paused; then fio writes random 4 KiB
#             blocks at QD16 over the whole export, limited to RATE_IOPS
#             (--rate_iops), for SETTLE_SECONDS.  The statistics are
#             sampled every second into settle.tsv: dirty_data as a % of
#             what writeback_percent is a percent of (core/writeback.c's
#             capacity_sectors, bcf_cache_capacity_bytes = nbuckets *
#             bucket_bytes: the denominator used here), and bcache's
#             writeback_rate_debug fields (rate, dirty, target,
#             proportional, integral, change, next io), with the buckets
#             in use and the writes the cutoff wrote through.  Over the
#             last half of the run: mean, min and max of dirty%, and
#             whether they stay within target +-2 points; also the
#             seconds in which dirty data was above the target and the
#             writeback wrote nothing (writeback_delay after a pass).
#             RATE_IOPS defaults to RATE_SHARE (40) % of the export's
#             random 4 KiB write IOPS at the depth RATE_BASIS names: qd1
#             (the default: a load the writeback keeps up with even
#             with one backing write in flight, as it had until
#             WRITERS); with qd16 the load (~17 MiB/s here) is below
#             the export's speed for fio, and since WRITERS is 16 below
#             what the writeback drains random keys at (26.6 MiB/s), but
#             bcache's proportional term alone would hold dirty data
#             ~67 points above the target (the summary prints it), and
#             dirty data climbs to the cutoff instead.  Why the pre-fill: bcache's controller
#             (p_term_inverse 40) holds dirty data about 40 s of the load
#             above the target until its integral term, which needs
#             hundreds of seconds, takes over.  A load small enough for
#             that to be within 2 points of a cache C (40 s * L <=
#             0.02 C) needs 0.1 C / L >= 200 s to bring an empty cache to
#             10 %, whatever C is.  The summary prints that excess.
#
#   Nothing fails because something was slow.  It fails on a wrong
#   result: dirty data that does not reach 0 within DRAIN_TIMEOUT, a fill
#   that did not leave the dirty data it wrote, a backing or read error
#   of the writeback, or a remote that does not hold what was written.
#
# USAGE
#   bench/wb-rate.sh                                # defaults, ~12 min
#   DIRTY=64M SETTLE_SECONDS=60 bench/wb-rate.sh    # smoke run, ~5 min
#   PHASES="baseline settle" RATE_BASIS=qd16 bench/wb-rate.sh
#
# ENVIRONMENT (all optional)
#   SIZE            the remote export (default 4G)
#   DIRTY           dirty data written for each drain (default 512M)
#   DRAIN_CACHE     the drain phase's cache (default 4 * DIRTY, >= 1G)
#   CACHE           the settle phase's cache (default 1G)
#   SETTLE_SECONDS  the settle run (default 180)
#   SETTLE_PREFILL  1 (default): dirty data to the target before the
#                   load; 0: the load starts on an empty cache
#   RATE_IOPS       the settle load (default RATE_SHARE % of the export's
#                   random 4 KiB write IOPS at RATE_BASIS)
#   RATE_SHARE      (default 40)   RATE_BASIS  qd1 (default) or qd16
#   BASE_SECONDS    each baseline job against the remote (default 10)
#   WB_BS           the baseline's sequential write size (default
#                   RUN_MAX_BYTES of core/writeback.c)
#   WB_QD           the baseline's second sequential depth (default
#                   WRITERS of core/writeback.c)
#   SEQ_BS          the sequential drain's fill write size (default 1M)
#   POLL            drain sampling interval, seconds (default 0.2)
#   DRAIN_TIMEOUT   seconds a drain may take before it counts as failed
#                   (default 120 + 4 s per MiB of DIRTY: 0.25 MiB/s)
#   PHASES          subset of: baseline drain-random drain-seq settle
#                   (the others need baseline's figures only for the
#                   ratios and the default RATE_IOPS)
#   FILTER_SO       the filter (default the first of _build/,
#                   _build/default/, _build/*/ of this tree that has one)
#   BCTL            bcachefilter-ctl (default beside that filter's build)
#   WORKDIR         cache files and sockets (default mktemp -d
#                   /var/tmp/wb-rate.XXXXXX; a disk with O_DIRECT; needs
#                   DRAIN_CACHE free)
#   OUTDIR          fio JSON, the servers' logs and stats, the traces
#                   (drain.*.tsv, settle.tsv), summary.md (kept; default
#                   /var/tmp/wb-rate-results.DATE-TIME)
#   BCACHE_ARGS     extra bcachefilter parameters (every phase)
#   KEEP=1          keep WORKDIR
#
# Needs nbdkit (memory, nbd plugins; delay, stats filters), fio with the
# nbd engine, nbdinfo, python3.  Every process it starts is stopped at exit.

set -euo pipefail

# shellcheck disable=SC2034  # used by bench-lib.sh
BENCH_NAME=wb-rate
# shellcheck source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"

HERE=$(cd "$(dirname "$0")/.." && pwd)
TRACE="$HERE/bench/wb-rate-trace.py"
SIZE=${SIZE:-4G}
DIRTY=${DIRTY:-512M}
DRAIN_CACHE=${DRAIN_CACHE:-}
CACHE=${CACHE:-1G}
SETTLE_SECONDS=${SETTLE_SECONDS:-180}
RATE_IOPS=${RATE_IOPS:-}
RATE_SHARE=${RATE_SHARE:-40}
RATE_BASIS=${RATE_BASIS:-qd1}
BASE_SECONDS=${BASE_SECONDS:-10}
SEQ_BS=${SEQ_BS:-1M}
POLL=${POLL:-0.2}
SETTLE_PREFILL=${SETTLE_PREFILL:-1}
PHASES=${PHASES:-baseline drain-random drain-seq settle}
BCACHE_ARGS=${BCACHE_ARGS:-}
KEEP=${KEEP:-0}
PIDS=()

if [[ -z ${FILTER_SO:-} ]]; then
    for d in "$HERE/_build" "$HERE/_build/default" "$HERE"/_build/*; do
        if [[ -f $d/plugin/.libs/nbdkit-bcachefilter-filter.so ]]; then
            FILTER_SO=$d/plugin/.libs/nbdkit-bcachefilter-filter.so
            BCTL=${BCTL:-$d/tools/bcachefilter-ctl}
            break
        fi
    done
fi
FILTER_SO=${FILTER_SO:-$HERE/_build/plugin/.libs/nbdkit-bcachefilter-filter.so}
BCTL=${BCTL:-$HERE/_build/tools/bcachefilter-ctl}

for t in nbdkit fio nbdinfo python3 numfmt; do
    command -v "$t" >/dev/null || die "$t is not installed"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "fio has no nbd engine"
[[ -f $FILTER_SO ]] || die "no filter at $FILTER_SO (build first, or set FILTER_SO)"
[[ -x $BCTL ]] || die "no bcachefilter-ctl at $BCTL (set BCTL)"
for p in $PHASES; do
    case $p in baseline|drain-random|drain-seq|settle) ;;
    *) die "unknown phase '$p'" ;;
    esac
done
has_phase() { [[ " $PHASES " == *" $1 "* ]]; }
[[ $RATE_BASIS == qd1 || $RATE_BASIS == qd16 ]] || die "RATE_BASIS is qd1 or qd16"

bytes() { numfmt --from=iec "${1%B}" || die "bad size '$1'"; }
MIB=$(( 1024 * 1024 ))
SIZE_BYTES=$(bytes "$SIZE")
DIRTY_BYTES=$(bytes "$DIRTY")
CACHE_BYTES=$(bytes "$CACHE")
if [[ -n $DRAIN_CACHE ]]; then DRAIN_CACHE_BYTES=$(bytes "$DRAIN_CACHE")
else
    DRAIN_CACHE_BYTES=$(( 4 * DIRTY_BYTES ))
    (( DRAIN_CACHE_BYTES >= 1024 * MIB )) || DRAIN_CACHE_BYTES=$(( 1024 * MIB ))
fi
(( DIRTY_BYTES <= SIZE_BYTES )) || die "DIRTY must fit in SIZE"
DRAIN_TIMEOUT=${DRAIN_TIMEOUT:-$(( 120 + 4 * DIRTY_BYTES / MIB ))}

# The writeback's largest backing write, from the source it was built from.
run_max_bytes() {
    local v
    v=$(sed -n 's/^#define RUN_MAX_BYTES *(\([0-9]*\)u* *<< *\([0-9]*\)).*/\1 << \2/p' \
        "$HERE/core/writeback.c")
    if [[ -n $v ]]; then echo $(( v )); else echo $(( 4 * MIB )); fi
}
WB_BS=${WB_BS:-$(run_max_bytes)}
# The most backing writes the writeback has in flight, likewise.
WB_QD=${WB_QD:-$(sed -n 's/^#define WRITERS *\([0-9]*\).*/\1/p' \
    "$HERE/core/writeback.c")}
WB_QD=${WB_QD:-1}
# bcache's p_term_inverse: the proportional term retires the excess over
# the target in this many seconds.
P_TERM_INVERSE=$(sed -n 's/^#define BCF_WB_P_TERM_INVERSE *\([0-9]*\).*/\1/p' \
    "$HERE/core/writeback.h")
P_TERM_INVERSE=${P_TERM_INVERSE:-40}
WB_BS=$(bytes "$WB_BS")

bench_dirs wb-rate
AVAIL=$(df -B1 --output=avail "$WORKDIR" | tail -1)
(( AVAIL > DRAIN_CACHE_BYTES + (1 << 30) )) ||
    die "WORKDIR needs ~$(numfmt --to=iec "$DRAIN_CACHE_BYTES") free"

RSOCK=$WORKDIR/remote.sock
FSOCK=$WORKDIR/filter.sock
CTLSOCK=$WORKDIR/ctl.sock
CACHE_IMG=$WORKDIR/cache.img

bench_cleanup_on_exit "$CACHE_IMG"

{
    echo "date:      $(date -Is)"
    echo "command:   SIZE=$SIZE DIRTY=$DIRTY CACHE=$CACHE SETTLE_SECONDS=$SETTLE_SECONDS RATE_IOPS=$RATE_IOPS RATE_SHARE=$RATE_SHARE RATE_BASIS=$RATE_BASIS PHASES=\"$PHASES\" BCACHE_ARGS=\"$BCACHE_ARGS\" $0"
    echo "host:      nproc=$(nproc), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), RAM $(free -g | awk '/^Mem/ {print $2}') GiB"
    echo "software:  $(nbdkit --version), $(fio --version)"
    echo "filter:    $FILTER_SO ($(stat -c '%y' "$FILTER_SO" | cut -d. -f1))"
    echo "sizes:     export $(numfmt --to=iec "$SIZE_BYTES"), dirty $(numfmt --to=iec "$DIRTY_BYTES"), drain cache $(numfmt --to=iec "$DRAIN_CACHE_BYTES"), settle cache $(numfmt --to=iec "$CACHE_BYTES"), writeback's largest write $(numfmt --to=iec "$WB_BS")"
    echo "workdir:   $WORKDIR ($(findmnt -n -o FSTYPE -T "$WORKDIR" || echo '?'))"
    echo "load avg:  $(cut -d' ' -f1-3 /proc/loadavg) (start)"
} | tee "$OUTDIR/machine.txt" >&2

# ---- servers ----------------------------------------------------------------
# start_remote NAME [SOCKET]: a fresh remote (on RSOCK by default); its
# stats go to remote.NAME.stats when it stops.
start_remote() {
    start_nbdkit "remote-$1" "${2:-$RSOCK}" --filter=stats --filter=delay \
        memory size="$SIZE_BYTES" delay-write=1ms delay-read=1ms \
        statsfile="$OUTDIR/remote.$1.stats"
    REMOTE_PID=$SERVER_PID
}

# start_filter NAME CACHE_BYTES ARGS...: the filter in writeback mode on a
# new cache file, in front of the remote.
start_filter() {
    local name=$1 cbytes=$2; shift 2
    rm -f "$CACHE_IMG"
    # shellcheck disable=SC2086
    start_nbdkit "filter-$name" "$FSOCK" --filter="$FILTER_SO" nbd \
        socket="$RSOCK" bcache="$CACHE_IMG" bcache-size="$cbytes" \
        bcache-mode=writeback bcache-ctl="$CTLSOCK" "$@" $BCACHE_ARGS
    FILTER_PID=$SERVER_PID
}

ctl() { "$BCTL" --socket "$CTLSOCK" "$@"; }
bstats() { ctl stats --json >"$1" 2>&1 || true; }
# sval FILE NAME: one statistic from a stats --json file.
sval() {
    PYTHONPATH="$HERE/bench" python3 -c '
import sys, bcfstats
f = bcfstats.load(sys.argv[1])
print(f.get(sys.argv[2], "?") if f else "?")' "$1" "$2"
}
# jget FILE KEY: a number from a JSON object file.
jget() {
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$1" "$2"
}

# run_fio NAME SOCKET OUTPUT ARGS...: fio's nbd engine on SOCKET, in the
# background, waited for, so that a signal is handled at once.
run_fio() {
    local name=$1 sock=$2 json=$3; shift 3
    run_fio_any "$name" "$json" --ioengine=nbd --uri="$(uri "$sock")" "$@"
}
# run_fio_any NAME OUTPUT ARGS...: the same with any engine.
run_fio_any() {
    local name=$1 json=$2; shift 2
    echo "fio --name=$name $*" >>"$OUTDIR/commands.txt"
    fio --name="$name" --numjobs=1 --output-format=json --output="$json" \
        "$@" >/dev/null &
    local fpid=$! rc=0
    PIDS+=("$fpid")
    wait "$fpid" || rc=$?
    stop_pid "$fpid"
    (( rc == 0 )) || die "fio failed ($name, status $rc); see $json"
}
# fio_val JSON rw FIELD: jobs[0][rw][FIELD]
fio_val() {
    python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["jobs"][0][sys.argv[2]][sys.argv[3]])' "$@"
}

# ---- baseline -----------------------------------------------------------------
BASE=$OUTDIR/baseline.result.json
if has_phase baseline; then
    say "baseline: fio alone against the remote, ${BASE_SECONDS}s per job"
    # A remote for the sequential job alone: its stats give the time the
    # remote itself takes for one write of WB_BS, to set against the
    # drain's.
    start_remote baseline-seq
    # Not time based: it stops at the end of the export rather than
    # overwrite, because the memory plugin writes to pages it already has
    # much faster than to new ones, and the drain writes to new ones.
    run_fio base-seq "$RSOCK" "$OUTDIR/base-seq.json" --rw=write \
        --bs="$WB_BS" --iodepth=1 --size="$SIZE_BYTES" \
        --runtime="$BASE_SECONDS"
    stop_pid "$REMOTE_PID"
    start_remote baseline-seqqd
    run_fio base-seqqd "$RSOCK" "$OUTDIR/base-seqqd.json" --rw=write \
        --bs="$WB_BS" --iodepth="$WB_QD" --size="$SIZE_BYTES" \
        --runtime="$BASE_SECONDS"
    stop_pid "$REMOTE_PID"
    # The same through nbdkit's nbd plugin, the filter's way to the
    # export, on a fresh remote: what the hop alone costs.
    start_remote baseline-proxy
    start_nbdkit proxy "$WORKDIR/proxy.sock" nbd socket="$RSOCK"
    PROXY_PID=$SERVER_PID
    run_fio base-seq-proxy "$WORKDIR/proxy.sock" \
        "$OUTDIR/base-seq-proxy.json" --rw=write --bs="$WB_BS" --iodepth=1 \
        --size="$SIZE_BYTES" --runtime="$BASE_SECONDS"
    stop_pid "$PROXY_PID"
    stop_pid "$REMOTE_PID"
    start_remote baseline-rand
    for qd in 1 16; do
        run_fio "base-rand-qd$qd" "$RSOCK" "$OUTDIR/base-rand-qd$qd.json" \
            --rw=randwrite --bs=4k --iodepth="$qd" --size="$SIZE_BYTES" \
            --norandommap --time_based --runtime="$BASE_SECONDS"
    done
    stop_pid "$REMOTE_PID"
    # The cache device, which the writeback reads before each backing
    # write (one extent at a time, O_DIRECT, synchronously): 512 KiB (a
    # bucket, the largest extent) and 4 KiB reads at QD1.
    for j in "seq --rw=read --bs=512k" "rand --rw=randread --bs=4k"; do
        # shellcheck disable=SC2086
        run_fio_any "base-dev-${j%% *}" "$OUTDIR/base-dev-${j%% *}.json" \
            --ioengine=psync --direct=1 --filename="$WORKDIR/dev-test.img" \
            --size=256M --time_based --runtime=5 ${j#* }
    done
    rm -f "$WORKDIR/dev-test.img"
    PYTHONPATH="$HERE/bench" PYTHONDONTWRITEBYTECODE=1 \
        python3 - "$OUTDIR" "$WB_BS" >"$BASE" <<'EOF'
import json, sys
wb_rate_trace = __import__("wb-rate-trace")
d = sys.argv[1]
w = wb_rate_trace.remote_ops(f"{d}/remote.baseline-seq.stats")["write"]
j = lambda n, rw="write": json.load(open(f"{d}/{n}.json"))["jobs"][0][rw]  # noqa
print(json.dumps(dict(
    wb_bs=int(sys.argv[2]),
    seq_mib_s=j("base-seq")["bw_bytes"] / 1048576,
    seqqd_mib_s=j("base-seqqd")["bw_bytes"] / 1048576,
    seq_remote_ms=1000.0 * w[2] / max(1, w[0]),
    seq_fio_ms=j("base-seq")["clat_ns"]["mean"] / 1e6,
    seq_proxy_mib_s=j("base-seq-proxy")["bw_bytes"] / 1048576,
    rand_qd1_iops=j("base-rand-qd1")["iops"],
    rand_qd16_iops=j("base-rand-qd16")["iops"],
    dev_seq_mib_s=j("base-dev-seq", "read")["bw_bytes"] / 1048576,
    dev_rand_iops=j("base-dev-rand", "read")["iops"]), indent=1))
EOF
    say "baseline: sequential $(numfmt --to=iec "$WB_BS") QD1 $(jget "$BASE" seq_mib_s | xargs printf %.1f) MiB/s," \
        "QD$WB_QD $(jget "$BASE" seqqd_mib_s | xargs printf %.1f) MiB/s," \
        "random 4k QD1 $(jget "$BASE" rand_qd1_iops | xargs printf %.0f) IOPS," \
        "QD16 $(jget "$BASE" rand_qd16_iops | xargs printf %.0f) IOPS;" \
        "cache device reads $(jget "$BASE" dev_seq_mib_s | xargs printf %.0f) MiB/s (512k)," \
        "$(jget "$BASE" dev_rand_iops | xargs printf %.0f) IOPS (4k)"
fi

# ---- drain --------------------------------------------------------------------
# near_base VARIANT WHEN: the references of one drain measured within the
# same minute, since a shared host's speed drifts between phases: fio
# alone on a second fresh remote (same configuration, its own socket),
# sequential WB_BS writes at QD1 and at WB_QD and random 4 KiB writes at
# QD1, into near.VARIANT.{seq,seqqd,rand}.WHEN.json.
near_base() {
    local v=$1 when=$2 j pid main=$REMOTE_PID
    for j in seq seqqd rand; do
        start_remote "near-$v-$j-$when" "$WORKDIR/remote2.sock"
        pid=$REMOTE_PID
        REMOTE_PID=$main
        if [[ $j == seq* ]]; then
            run_fio "near-$j" "$WORKDIR/remote2.sock" \
                "$OUTDIR/near.$v.$j.$when.json" --rw=write --bs="$WB_BS" \
                --iodepth="$([[ $j == seq ]] && echo 1 || echo "$WB_QD")" \
                --size="$SIZE_BYTES" --runtime="$BASE_SECONDS"
        else
            run_fio "near-$j" "$WORKDIR/remote2.sock" \
                "$OUTDIR/near.$v.$j.$when.json" --rw=randwrite --bs=4k \
                --iodepth=1 --size="$SIZE_BYTES" --norandommap \
                --time_based --runtime="$BASE_SECONDS"
        fi
        stop_pid "$pid"
    done
}

# drain VARIANT: pause, fill, wait for the idle boost, resume, time the
# drain, verify the remote.
drain() {
    local v=$1 fill=() label dirty rc=0 verify=ok
    case $v in
    random) fill=(--rw=randwrite --bs=4k --size="$SIZE_BYTES" --io_size="$DIRTY_BYTES")
            label="4 KiB random writes over $SIZE, QD16" ;;
    seq)    fill=(--rw=write --bs="$SEQ_BS" --size="$DIRTY_BYTES")
            label="$SEQ_BS sequential writes, QD16" ;;
    esac
    fill+=(--iodepth=16 --verify=crc32c --verify_state_save=0 --randseed=1414)
    say "drain-$v: fresh remote and cache ($(numfmt --to=iec "$DRAIN_CACHE_BYTES")), writeback paused, writing $DIRTY ($label)"
    start_remote "drain-$v"
    start_filter "drain-$v" "$DRAIN_CACHE_BYTES" bcache-sequential-cutoff=0
    ctl set writeback_running 0 >/dev/null
    run_fio "fill-$v" "$FSOCK" "$OUTDIR/fill.$v.json" "${fill[@]}" --do_verify=0
    bstats "$OUTDIR/drain.$v.filled.json"
    dirty=$(sval "$OUTDIR/drain.$v.filled.json" dirty_data)
    say "drain-$v: dirty_data $dirty bytes ($(( dirty / MIB )) MiB), written through by the cutoff: $(sval "$OUTDIR/drain.$v.filled.json" writeback_cutoff_writes) writes"
    [[ $dirty == "$DIRTY_BYTES" ]] ||
        die "drain-$v: the fill of $DIRTY_BYTES bytes left $dirty bytes dirty (cutoff? see $OUTDIR/drain.$v.filled.json)"

    say "drain-$v: waiting, paused, for the idle boost (writeback_rate_at_max); meanwhile fio alone on a second remote"
    python3 "$TRACE" sample --bctl "$BCTL" --ctl "$CTLSOCK" \
        --out "$OUTDIR/drain.$v.idle.tsv" --every 1 --until at_max \
        --timeout 120 --result "$OUTDIR/drain.$v.idle.json" &
    local spid=$!
    PIDS+=("$spid")
    near_base "$v" before
    wait "$spid" || rc=$?
    stop_pid "$spid"
    if (( rc == 3 )); then
        say "drain-$v: WARNING: no idle boost after 120 s; draining at the controller's rate"
    elif (( rc != 0 )); then die "drain-$v: sampling failed"; fi
    say "drain-$v: idle boost after $(jget "$OUTDIR/drain.$v.idle.json" seconds | xargs printf %.0f) s; resuming the writeback"

    rc=0
    python3 "$TRACE" sample --bctl "$BCTL" --ctl "$CTLSOCK" --resume \
        --out "$OUTDIR/drain.$v.tsv" --every "$POLL" --until clean \
        --timeout "$DRAIN_TIMEOUT" --progress 2 \
        --result "$OUTDIR/drain.$v.sample.json" || rc=$?
    bstats "$OUTDIR/drain.$v.stats.json"
    (( rc != 3 )) || die "drain-$v: dirty data left after ${DRAIN_TIMEOUT}s: $(sval "$OUTDIR/drain.$v.stats.json" dirty_data) bytes (see $OUTDIR/drain.$v.tsv)"
    (( rc == 0 )) || die "drain-$v: sampling failed"
    for e in writeback_backing_errors writeback_read_errors; do
        [[ $(sval "$OUTDIR/drain.$v.stats.json" $e) == 0 ]] ||
            die "drain-$v: $e = $(sval "$OUTDIR/drain.$v.stats.json" $e)"
    done

    say "drain-$v: fio alone on a second remote again"
    near_base "$v" after
    say "drain-$v: verifying the remote against what was written"
    ( run_fio "fill-$v" "$RSOCK" "$OUTDIR/verify.$v.json" "${fill[@]}" \
          --verify_only=1 ) || verify=FAILED
    stop_pid "$FILTER_PID"
    stop_pid "$REMOTE_PID"
    python3 "$TRACE" drain-result "$label" "$OUTDIR/drain.$v.sample.json" \
        "$OUTDIR/drain.$v.idle.json" "$OUTDIR/remote.drain-$v.stats" \
        "$verify" "$OUTDIR/drain.$v.result.json" "$OUTDIR/near.$v"
    say "drain-$v: $(jget "$OUTDIR/drain.$v.result.json" seconds | xargs printf %.2f) s," \
        "$(jget "$OUTDIR/drain.$v.result.json" mib_s | xargs printf %.1f) MiB/s," \
        "$(jget "$OUTDIR/drain.$v.result.json" backing_writes) backing writes, verify $verify"
    [[ $verify == ok ]] || die "drain-$v: the remote does not hold what was written (see $OUTDIR/verify.$v.json)"
}
has_phase drain-random && drain random
has_phase drain-seq && drain seq

# ---- settle -------------------------------------------------------------------
if has_phase settle; then
    note=
    if [[ -z $RATE_IOPS ]]; then
        [[ -f $BASE ]] || die "settle: set RATE_IOPS, or run the baseline phase"
        RATE_IOPS=$(python3 -c 'import json, sys; print(int(json.load(open(sys.argv[1]))[sys.argv[2]] * int(sys.argv[3]) / 100))' \
            "$BASE" "rand_${RATE_BASIS}_iops" "$RATE_SHARE")
        note="$RATE_SHARE % of the export's random 4 KiB write IOPS at ${RATE_BASIS^^}"
    else
        note="RATE_IOPS"
    fi
    say "settle: fresh remote and cache ($CACHE), ${SETTLE_SECONDS}s of random 4 KiB writes at QD16 limited to $RATE_IOPS IOPS ($note)"
    start_remote settle
    start_filter settle "$CACHE_BYTES"
    if [[ $SETTLE_PREFILL == 1 ]]; then
        # Dirty data up to the target first, at full speed with the
        # writeback paused: from an empty cache a load the writeback can
        # follow needs minutes to get there (see the header).
        bstats "$OUTDIR/settle.empty.json"
        pre=$(python3 -c 'import sys; print(int(sys.argv[1]) * int(sys.argv[2]) * int(sys.argv[3]) // 100 // 4096 * 4096)' \
            "$(sval "$OUTDIR/settle.empty.json" nbuckets)" \
            "$(sval "$OUTDIR/settle.empty.json" bucket_bytes)" \
            "$(sval "$OUTDIR/settle.empty.json" writeback_percent)")
        say "settle: pre-filling $(( pre / MIB )) MiB of dirty data (writeback_percent of the cache), writeback paused"
        ctl set writeback_running 0 >/dev/null
        run_fio settle-prefill "$FSOCK" "$OUTDIR/settle-prefill.json" \
            --rw=randwrite --bs=4k --iodepth=16 --size="$SIZE_BYTES" \
            --io_size="$pre" --randseed=2828
        ctl set writeback_running 1 >/dev/null
    fi
    bstats "$OUTDIR/settle.before.json"
    python3 "$TRACE" sample --bctl "$BCTL" --ctl "$CTLSOCK" \
        --out "$OUTDIR/settle.tsv" --every 1 \
        --seconds "$(( SETTLE_SECONDS + 2 ))" --progress 10 &
    spid=$!
    PIDS+=("$spid")
    run_fio settle "$FSOCK" "$OUTDIR/settle.json" --rw=randwrite --bs=4k \
        --iodepth=16 --size="$SIZE_BYTES" --norandommap --randrepeat=0 \
        --time_based --runtime="$SETTLE_SECONDS" --rate_iops="$RATE_IOPS"
    rc=0; wait "$spid" || rc=$?
    stop_pid "$spid"
    (( rc == 0 )) || die "settle: sampling failed (status $rc)"
    bstats "$OUTDIR/settle.stats.json"
    python3 "$TRACE" settle "$OUTDIR/settle.tsv" "$SETTLE_SECONDS" \
        "$OUTDIR/settle.result.json" >"$OUTDIR/settle-trace.md"
    python3 - "$OUTDIR" "$RATE_IOPS" "$note" \
        "$(sval "$OUTDIR/settle.stats.json" writeback_cutoff_writes)" \
        "$P_TERM_INVERSE" "$SETTLE_PREFILL" <<'EOF'
import json, sys
d, rate, note, cutoff, pti, prefill = sys.argv[1:7]
p = f"{d}/settle.result.json"
r = json.load(open(p))
f = json.load(open(f"{d}/settle.json"))["jobs"][0]["write"]
# Where the proportional term alone would hold dirty data under this
# load: rate = (dirty - target) / p_term_inverse, so the excess is
# p_term_inverse seconds of the load.
excess = 100.0 * int(pti) * f["bw_bytes"] / r["capacity_bytes"]
r.update(rate_iops=int(rate), rate_note=note, fio_iops=f["iops"],
         cutoff_writes=cutoff, p_term_inverse=int(pti),
         p_only_excess_pct=excess, prefill=prefill == "1")
json.dump(r, open(p, "w"), indent=1)
EOF
    for e in writeback_backing_errors writeback_read_errors; do
        [[ $(sval "$OUTDIR/settle.stats.json" $e) == 0 ]] ||
            die "settle: $e = $(sval "$OUTDIR/settle.stats.json" $e)"
    done
    stop_pid "$FILTER_PID" 60
    stop_pid "$REMOTE_PID"
fi

# ---- summary ------------------------------------------------------------------
{
    echo "# wb-rate $(date -Is)"
    echo
    sed 's/^/    /' "$OUTDIR/machine.txt"
    echo
    python3 "$TRACE" summary "$OUTDIR"
    if [[ -f $OUTDIR/settle-trace.md ]]; then
        echo "### The controller's trace, every 5 s (settle.tsv has every second)"
        echo
        cat "$OUTDIR/settle-trace.md"
    fi
} | tee "$OUTDIR/summary.md"
say "results in $OUTDIR"
