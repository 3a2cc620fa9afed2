#!/usr/bin/env bash
# seq-bypass.sh: does bypassing sequential streams pay off with a remote?
# (issue 15 point 4)
#
# bcache sends a sequential stream past its cutoff (4 MiB) around the
# cache, because its backing disk streams as fast as the SSD.  A NAS
# behind a network does not.  This script reads the same region twice,
# sequentially, 64 KiB at QD1 (a VM booting, a file copy), through
# bcachefilter in front of
#   slow:  a remote behind nbdkit's delay filter (RDELAY, default 1ms a
#          read), once with the default (bcache-sequential-bypass=auto)
#          and once with bcache's rule (=always);
#   fast:  the same remote without the delay (faster than the cache
#          device), with the default: after one pass that the filter
#          caches because it has not measured the cache yet, a stream over
#          a fresh region must go around the cache.
# and prints each pass's MiB/s, the second pass / first pass ratio, and
# the filter's bypass counters.  Target: slow+auto second pass >= 2x the
# first; slow+always about 1x (bcache's behaviour); fast+auto: the fresh
# stream bypassed.
#
# USAGE
#   bench/seq-bypass.sh                    # 384M, ~3 min
#   LEN=128M bench/seq-bypass.sh
# ENVIRONMENT: LEN (default 384M), RDELAY (1ms), FILTER_SO (default the
# build tree's _build/default/plugin/.libs/nbdkit-bcachefilter-filter.so),
# BCTL (its tools/bcachefilter-ctl), WORKDIR (default a new directory
# under /var/tmp: a disk with O_DIRECT, not tmpfs), OUTDIR (fio's JSON
# and the servers' logs, kept).
set -euo pipefail
# shellcheck disable=SC2034  # used by bench-lib.sh
BENCH_NAME=seq-bypass
# shellcheck source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"

top=$(cd "$(dirname "$0")/.." && pwd)
LEN=${LEN:-384M}
RDELAY=${RDELAY:-1ms}
FILTER_SO=${FILTER_SO:-$top/_build/default/plugin/.libs/nbdkit-bcachefilter-filter.so}
BCTL=${BCTL:-$top/_build/default/tools/bcachefilter-ctl}
[[ -f $FILTER_SO ]] || die "no filter at $FILTER_SO (build first, or set FILTER_SO)"
[[ -x $BCTL ]] || die "no bcachefilter-ctl at $BCTL (set BCTL)"
fio --enghelp=nbd >/dev/null 2>&1 || die "fio has no nbd engine"
BYTES=$(numfmt --from=iec "${LEN%B}")
WORKDIR=${WORKDIR:-$(mktemp -d /var/tmp/seq-bypass.XXXXXX)}
OUTDIR=${OUTDIR:-/var/tmp/seq-bypass-results.$(date +%Y%m%d-%H%M%S)}
mkdir -p "$WORKDIR" "$OUTDIR"
PIDS=()
cleanup() {
    local rc=$? i
    trap - EXIT
    for (( i = ${#PIDS[@]} - 1; i >= 0; i-- )); do stop_pid "${PIDS[i]}" 10; done
    rm -rf "$WORKDIR"
    exit "$rc"
}
trap cleanup EXIT
RSOCK=$WORKDIR/remote.sock FSOCK=$WORKDIR/front.sock CTL=$WORKDIR/ctl.sock

# pass NAME OFFSET: one sequential read of LEN from OFFSET; prints MiB/s.
pass() {
    fio --name="$1" --ioengine=nbd --uri="$(uri "$FSOCK")" --rw=read \
        --bs=64k --iodepth=1 --offset="$2" --size="$BYTES" \
        --output-format=json --output="$OUTDIR/$1.json" >/dev/null
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print("%.1f" % (j["jobs"][0]["read"]["bw_bytes"]/1048576))' "$OUTDIR/$1.json"
}
# stats KEY...: the values of KEYs from the filter's stats (any level).
stats() {
    "$BCTL" -s "$CTL" stats --json | PYTHONPATH="$top/bench" python3 -c '
import json, sys, bcfstats
flat = bcfstats.flat(json.load(sys.stdin))
print(" ".join("%s=%s" % (k, flat.get(k, "?")) for k in sys.argv[1:]))' "$@"
}

# run NAME DELAY POLICY: a remote (with DELAY, or none), the filter with
# POLICY, passes as described above; prints a line for the table.
run() {
    local name=$1 delay=$2 policy=$3 p1 p2 p3=- p4=-
    local rargs=(memory $((BYTES * 3)))
    [[ $delay != none ]] && rargs=(--filter=delay "${rargs[@]}" rdelay="$delay")
    rm -f "$WORKDIR/cache.img"
    start_nbdkit "remote-$name" "$RSOCK" "${rargs[@]}"
    start_nbdkit "front-$name" "$FSOCK" --filter="$FILTER_SO" nbd \
        socket="$RSOCK" bcache="$WORKDIR/cache.img" \
        bcache-size=$((BYTES * 2)) bcache-sequential-bypass="$policy" \
        bcache-ctl="$CTL"
    p1=$(pass "$name-1" 0)
    p2=$(pass "$name-2" 0)
    if [[ $delay == none ]]; then
        # The cache's hits are measured now: a fresh region must bypass.
        p3=$(pass "$name-3" "$BYTES")
        p4=$(pass "$name-4" "$BYTES")
    fi
    printf '| %s | %s | %s | %s | %s | %s | %.2f | %s |\n' "$name" "$policy" \
        "$p1" "$p2" "$p3" "$p4" "$(python3 -c 'import sys; print(float(sys.argv[2]) / float(sys.argv[1]))' "$p1" "$p2")" \
        "$(stats bypass_sequential sequential_cached export_read_ns_per_kib cache_read_ns_per_kib)"
    stop_pid "${PIDS[-1]}"
    stop_pid "${PIDS[-1]}"
}

say "LEN=$LEN RDELAY=$RDELAY WORKDIR=$WORKDIR ($(findmnt -n -o FSTYPE -T "$WORKDIR")) OUTDIR=$OUTDIR"
echo "| remote | sequential-bypass | pass 1 MiB/s | pass 2 MiB/s | fresh pass 3 | pass 4 | pass 2 / pass 1 | filter stats |"
echo "|---|---|---:|---:|---:|---:|---:|---|"
run slow "$RDELAY" auto
run slow-bcache "$RDELAY" always
run fast none auto
