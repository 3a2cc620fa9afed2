#!/usr/bin/env bash
# bcachefilter: errors at the export under a random workload (issue 12,
# point 10).
#
# remote: nbdkit --filter=error memory 32M, injecting EIO into 5% of
#         reads and 3% of writes, zeroes and trims while the trigger file
#         exists (error-file=).  The test also reads and writes the
#         remote directly, with the trigger removed.
# proxy:  nbdkit --filter=bcachefilter nbd socket=REMOTE, a 16 MiB cache
#         file (16 KiB buckets, 4 KiB blocks: 1024, more than the 512
#         the Linux kernel needs) with a control socket.
#
# For each mode in $modes a session (tests/filter/faults.py, the model
# in tests/filter/shadow.py):
#  1. the proxy's view equals the export and the model;
#  2. errors on: 4 connections of random reads, writes (some FUA),
#     zeroes, trims, NBD_CMD_CACHE and flushes over the first 28 MiB for
#     BCACHEFILTER_FAULT_SECONDS (default 5) seconds, then reads of the
#     last 4 MiB (the probe region: fresh data that nothing cached),
#     each block read once.  Every request is bounded (30 s: more is a
#     hang); every error a client sees must be EIO, no connection may
#     die, successful reads must return the right data; reads, writes
#     and probe reads must each have failed at least once;
#  3. errors off: failed reads left no cached data: the probe region is
#     overwritten directly on the remote, and a block the proxy still
#     serves from its cache must be one a successful read read (and must
#     hold what the export held); in mode none no block may be cached,
#     in the others some must be (else the check could not fail);
#  4. the proxy's view equals the export everywhere (a failed write's
#     bytes may hold old or new data, but the same in both);
#  5. a clean restart: the proxy's view still equals the export, and
#     `bcachefilter-show --fsck` of the stopped cache is clean.
# The proxy's counters are printed after each session.
#
# For writeback (not supported yet), step 4 and 5 may compare with the
# export only once the dirty data drained (set cache_mode writethrough
# and wait for dirty_data 0, as test-filter-soak.sh does); faults.py
# already models that a write acknowledged since the last flush may be
# lost.
#
# The seed is printed; TEST_SEED=N replays its workloads (not the error
# filter's choices, which are its own).

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires timeout --version
requires bcachefilter-show --version
requires bcachefilter-ctl --version
requires nbdkit --filter=error null --dump-plugin

modes="writethrough writearound none"
seconds="${BCACHEFILTER_FAULT_SECONDS:-5}"
seed="${TEST_SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}"
echo "$0: seed $seed (rerun with TEST_SEED=$seed)"

tmpdir d
trigger="$d/errors-on"
start_remote --filter=error memory 32M error=EIO error-file="$trigger" \
    error-pread-rate=5% error-pwrite-rate=3% error-zero-rate=3% \
    error-trim-rate=3%
cache="$d/cache"
ctl="$d/ctl"

# faults ARGS...: tests/filter/faults.py on this test's proxy and remote.
faults ()
{
    timeout 300 "$PYTHON" "$filterdir/faults.py" --sock "$p_sock" \
        --remote "$remote_sock" --trigger "$trigger" --state "$d/model" "$@"
}

faults --mode writethrough --init --seed "$seed"
n=0
for mode in $modes; do
    n=$((n + 1))
    p=(bcache="$cache" bcache-size=16M bcache-bucket-size=16K
       bcache-block-size=4k bcache-mode="$mode" bcache-ctl="$ctl")
    rm -f "$ctl"
    start_proxy p "${p[@]}"
    faults --mode "$mode" --seed $((seed * 10 + n)) --seconds "$seconds" ||
        fail "$mode: errors at the export went wrong (seed $seed;" \
             "TEST_SEED=$seed replays the workload)"
    bcachefilter-ctl -s "$ctl" stats | sed -n '1,/^\[five_minute\]/p'
    bcachefilter-ctl -s "$ctl" stats | sed -n '/^\[cache\]/,$p'
    stop_nbdkit "$p_pid"
    bcachefilter-show --fsck "$cache" ||
        fail "$mode: fsck of the cache after errors at the export"

    rm -f "$ctl"
    start_proxy p "${p[@]}"
    faults --mode "$mode" --verify-only ||
        fail "$mode: after a restart the proxy's view is wrong (seed $seed)"
    stop_nbdkit "$p_pid"
done
echo "$0: OK (seed $seed)"
