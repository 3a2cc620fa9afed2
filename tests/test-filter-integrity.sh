#!/usr/bin/env bash
# bcachefilter: data integrity through the filter, in every mode, across
# clean restarts and kill -9.
#
# remote: nbdkit memory 16M on a unix socket (it outlives the proxies).
# proxy:  nbdkit --filter=bcachefilter nbd socket=REMOTE bcache=CACHE,
#         an 8 MiB cache file of 8 KiB buckets (smaller than the export,
#         so buckets are reused and GC runs; more than 512 buckets, as
#         every cache made must have), with a control socket: the
#         hit counters are printed after each session, and the test
#         checks that the cache served hits at all (a pass-through filter
#         would pass everything else).
# tests/filter/integrity.py drives 4 parallel libnbd connections doing
# random reads, writes (some FUA), zeroes (some fast / NO_HOLE), trims,
# NBD_CMD_CACHE and flushes, aligned and byte-unaligned, and some
# sequential runs, each read checked against a shadow copy; every session
# starts by reading the whole export through the fresh proxy (so a stale
# block kept in the cache from an earlier session or mode is found) and
# ends with a full read and a block-status check.
#
# Sessions, on one cache file: for each mode (writethrough, writearound,
# none): workload, clean stop, restart, workload, kill -9.  The same
# through the page cache (bcache-direct=false) in writethrough and
# writeback.  Then writethrough with a 64 KiB sequential cutoff
# (many writes bypass), and a kill -9 while a read-only workload is
# filling the cache (half-done inserts must never be served).  Finally the
# remote's content must equal the shadow.
#
# The seed is printed; TEST_SEED=N reruns with it.  TEST_OPS (default
# 250) sets the operations per connection per session.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires cmp --version
requires timeout --version

seed="${TEST_SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}"
ops="${TEST_OPS:-80}"
echo "$0: seed $seed (rerun with TEST_SEED=$seed)"

tmpdir d
start_remote memory 16M

cache="$d/cache"
round=0
# workload ARGS...: one session's workload through the proxy.
workload ()
{
    round=$((round + 1))
    timeout 120 "$PYTHON" "$filterdir/integrity.py" --sock "$p_sock" \
        --shadow "$d/shadow" --seed $((seed * 100 + round)) \
        --threads 4 --ops "$ops" --label "round $round" "$@" ||
        fail "round $round: the workload failed (seed $seed; TEST_SEED=$seed" \
             "reruns it)"
    show_stats
}
# show_stats: print the proxy's counters; add its hits to $hits.
hits=0
show_stats ()
{
    local h
    bcachefilter-ctl -s "$d/ctl" stats | sed -n '1,/^\[five_minute\]/p'
    h=$(ctl_stat "$d/ctl" cache_hits)
    hits=$((hits + h))
}

# sessions ARGS...: on a proxy with ARGS, a workload, a clean stop, a
# restart, a workload and a kill -9 (so the first session of the next
# call follows a kill -9).
first=--init
sessions ()
{
    local p=(bcache="$cache" bcache-ctl="$d/ctl" "$@") io

    start_proxy p "${p[@]}"
    if [[ " $* " == *" bcache-direct=false "* ]]; then
        io=$(bcachefilter-ctl -s "$d/ctl" show super --json |
                 "$PYTHON" "$filterdir/stat.py" io)
        test "$io" = sync ||
            fail "bcache-direct=false: the cache is driven by '$io', not sync"
    fi
    workload $first --verify-first
    first=
    stop_nbdkit "$p_pid"

    start_proxy p "${p[@]}"
    workload --verify-first
    crash_nbdkit "$p_pid"
    rm -f "$d/ctl"
}

for mode in writethrough writearound none; do
    sessions bcache-size=8M bcache-bucket-size=8K bcache-mode=$mode
done
# Through the page cache (bcache-direct=false, which bcache-io=auto then
# drives with pread/pwrite), writethrough and writeback: the dirty data
# a kill -9 leaves must come back.
for mode in writethrough writeback; do
    sessions bcache-direct=false bcache-mode=$mode
done

# Writes above a 64 KiB sequential cutoff bypass the cache (bcache's
# rule: the default, auto, may cache them if the export is slower).
start_proxy p bcache="$cache" bcache-sequential-cutoff=64K \
    bcache-sequential-bypass=always bcache-ctl="$d/ctl"
workload --verify-first
stop_nbdkit "$p_pid"

# kill -9 while reads are filling the cache.
start_proxy p bcache="$cache" bcache-ctl="$d/ctl"
timeout 120 "$PYTHON" "$filterdir/integrity.py" --sock "$p_sock" \
    --shadow "$d/shadow" --seed $((seed * 100 + 99)) --threads 4 \
    --ops 100000 --read-only --no-final-verify --label "killed" \
    > "$d/killed.log" 2>&1 &
reader=$!
cleanup_fn kill "$reader"
# Let it run for a while (it does not end by itself in that time).
for i in $(seq 1 15); do
    sleep 0.1
    kill -0 "$reader" 2>/dev/null || break
done
crash_nbdkit "$p_pid"
wait "$reader" || true
cat "$d/killed.log"
rm -f "$d/ctl"
if grep -q "FAIL:.*got" "$d/killed.log"; then
    fail "wrong data read before the proxy was killed (seed $seed)"
fi
start_proxy p bcache="$cache" bcache-ctl="$d/ctl"
workload --verify-first
stop_nbdkit "$p_pid"
test "$hits" -gt 0 || fail "the cache served no hits at all"

# The remote holds exactly what the clients wrote.
nbdio "$remote_sock" dump "$d/remote.img"
cmp "$d/remote.img" "$d/shadow" ||
    fail "the remote's content differs from the shadow (seed $seed)"
echo "$0: OK (seed $seed, $round sessions)"
