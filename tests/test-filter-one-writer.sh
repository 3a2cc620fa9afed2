#!/usr/bin/env bash
# bcachefilter: one writer per cache (DESIGN.md "One writer per cache").
#
# Two proxies on one cache file each keep their own btree, allocator and
# journal in memory and overwrite each other's buckets: both serve wrong
# data, and the wrong data survives a restart.  The first proxy claims the
# file (an exclusive flock taken in .get_ready, before nbdkit forks, held
# by the daemon for its whole life); every later writer is refused:
#
#  1. a proxy p serves a cache file it warmed (reads and writes);
#  2. a second proxy on the same path, on a hard link and on a symlink to
#     it is refused before it serves anything, with a message naming p's
#     pid; bcachefilter-format refuses the file too, and bcachefilter-show
#     reads it but says it is in use;
#  3. p still serves exactly the remote's data everywhere, and after a
#     restart too;
#  4. kill -9 of p releases the claim: a new proxy starts at once;
#  5. two proxies started at the same moment on a missing file: exactly
#     one of them starts.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires head --version
requires cmp --version

tmpdir d
start_remote memory 32M
head -c 32M /dev/urandom > "$d/data"
nbdio "$remote_sock" wfile 0 "$d/data"

p=(bcache="$d/cache" bcache-size=64M bcache-sequential-cutoff=0)
start_proxy p "${p[@]}"

# 1. Warm half the export, and write through the proxy.
nbdio "$p_sock" sha 0 16M > /dev/null
head -c 4M /dev/urandom > "$d/w"
nbdio "$p_sock" wfile 8M "$d/w"
dd if="$d/w" of="$d/data" bs=1M seek=8 conv=notrunc status=none
nbdio "$p_sock" flush

# 2. Every second writer is refused, naming p.
ln "$d/cache" "$d/hard"
ln -s "$d/cache" "$d/sym"
for path in "$d/cache" "$d/hard" "$d/sym"; do
    must_refuse "$d/second.log" "in use by another process: pid $p_pid " \
        --filter="$BCACHEFILTER_SO" nbd socket="$remote_sock" \
        bcache="$path" bcache-sequential-cutoff=0
done
# Also with bcache-size (the create path) and bcache-format=force, which
# must not destroy a cache in use.
must_refuse "$d/second.log" "in use by another process: pid $p_pid " \
    --filter="$BCACHEFILTER_SO" nbd socket="$remote_sock" \
    bcache="$d/hard" bcache-size=64M bcache-format=force
st=0
bcachefilter-format --force "$d/sym" > "$d/format.log" 2>&1 || st=$?
cat "$d/format.log"
test "$st" -ne 0 || fail "bcachefilter-format formatted a cache in use"
grep -q "in use by another process: pid $p_pid " "$d/format.log" ||
    fail "bcachefilter-format did not say the cache is in use"
bcachefilter-show "$d/hard" > "$d/show.log" 2>&1
cat "$d/show.log"
grep -q "in use by pid $p_pid " "$d/show.log" ||
    fail "bcachefilter-show did not say the cache is in use"
grep -q "may be stale" "$d/show.log" ||
    fail "bcachefilter-show did not say its view may be stale"

# 3. p still serves the right data, now and after a restart.
nbdio "$p_sock" dump "$d/view"
cmp "$d/data" "$d/view" || fail "the proxy serves wrong data"
stop_nbdkit "$p_pid"
start_proxy p "${p[@]}"
nbdio "$p_sock" dump "$d/view"
cmp "$d/data" "$d/view" || fail "wrong data after a restart"
bcachefilter-show "$d/cache" > "$d/show.log" 2>&1
grep -q "in use by pid $p_pid " "$d/show.log" ||
    fail "bcachefilter-show did not say the restarted cache is in use"

# 4. kill -9 lets go of the claim.
crash_nbdkit "$p_pid"
bcachefilter-show "$d/cache" > "$d/show.log" 2>&1
if grep -q "in use" "$d/show.log"; then
    fail "the cache still reads as in use after its proxy died"
fi
start_proxy p "${p[@]}"
nbdio "$p_sock" dump "$d/view"
cmp "$d/data" "$d/view" || fail "wrong data after kill -9"
stop_nbdkit "$p_pid"

# 5. Two proxies at once on a missing file: one starts, one is refused.
for i in 1 2; do
    timeout 60 nbdkit -f -U "$d/race$i.sock" -P "$d/race$i.pid" \
        --filter="$BCACHEFILTER_SO" nbd socket="$remote_sock" \
        bcache="$d/new" bcache-size=64M > "$d/race$i.log" 2>&1 &
    eval "race$i=\$!"
done
cleanup_fn kill "$race1" "$race2"
# The loser exits by itself; the winner serves until stopped.
for (( i = 0; i < 600; i++ )); do
    alive=0
    for pid in "$race1" "$race2"; do
        ! kill -0 "$pid" 2>/dev/null || alive=$((alive + 1))
    done
    { [ "$alive" -eq 1 ] && { [ -s "$d/race1.pid" ] || [ -s "$d/race2.pid" ]; }; } &&
        break
    sleep 0.1
done
cat "$d/race1.log" "$d/race2.log"
test "$alive" -eq 1 || fail "$alive of two racing proxies are running"
grep -q "in use by another process" "$d/race1.log" "$d/race2.log" ||
    fail "the refused racer did not say the cache is in use"
for i in 1 2; do
    if [ -s "$d/race$i.pid" ]; then
        nbdio "$d/race$i.sock" dump "$d/view"
        cmp "$d/data" "$d/view" || fail "the racing winner serves wrong data"
    fi
done
kill "$race1" "$race2" 2>/dev/null || true
wait "$race1" "$race2" 2>/dev/null || true

# 6. A proxy that forks into the background (no -f) keeps the claim in
#    the daemon: .get_ready claims before the fork.
nbdkit -U "$d/bg.sock" -P "$d/bg.pid" \
    --filter="$BCACHEFILTER_SO" nbd socket="$remote_sock" \
    bcache="$d/cache" bcache-sequential-cutoff=0
# The daemon writes its pid file once it serves, after .after_fork (which
# reads the export): the parent has returned before that.
for (( i = 0; i < 600; i++ )); do
    [ -s "$d/bg.pid" ] && break
    sleep 0.1
done
bg=$(cat "$d/bg.pid")
test -n "$bg" || fail "the daemonized proxy wrote no pid file within 60 s"
cleanup_fn kill "$bg"
must_refuse "$d/second.log" "in use by another process: pid $bg " \
    --filter="$BCACHEFILTER_SO" nbd socket="$remote_sock" \
    bcache="$d/sym" bcache-sequential-cutoff=0
nbdio "$d/bg.sock" dump "$d/view"
cmp "$d/data" "$d/view" || fail "the daemonized proxy serves wrong data"
kill "$bg"
for (( i = 0; i < 600; i++ )); do
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.1
done
