#!/usr/bin/env bash
# bcachefilter: the cache persists across restarts.
#
# The remote is nbdkit memory 32M behind nbdkit's log filter, so every
# request that reaches it is a line in $d/remote.log ("connection=N Read
# id=... offset=0x... count=0x..."); "no backing read" is proven by
# counting those lines, not by timing.
#
#  1. Fill the remote with random data (directly).
#  2. Proxy (writethrough, 64 MiB cache file, no sequential cutoff): warm A = [0, 8M) by
#     reading it, B = [16M, 20M) with NBD_CMD_CACHE, and write C =
#     [24M, 26M) through the proxy (writethrough caches it).  Re-reading
#     A, B and C must reach a state where it sends nothing to the remote
#     (polled a few times: a miss is inserted after the client has its
#     answer).
#  3. Clean stop, restart: reading A, B, C sends no Read to the remote,
#     and the data is right; reading [0, 12M) reads only [8M, 12M) from
#     the remote.
#  4. kill -9 after a flush, restart: the data is still right and still
#     all cached (the flush made the journal, with the inserts, durable).

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires head --version

tmpdir d
log="$d/remote.log"
start_remote --filter=log memory 32M logfile="$log"

head -c 32M /dev/urandom > "$d/data"
nbdio "$remote_sock" wfile 0 "$d/data"
# C's new content.
head -c 2M /dev/urandom > "$d/c"

# sha OFF LEN: the sha256 of the expected content.
sha ()
{
    "$PYTHON" -c '
import hashlib, sys
f = open(sys.argv[1], "rb"); f.seek(int(sys.argv[2])); print(hashlib.sha256(f.read(int(sys.argv[3]))).hexdigest())' \
        "$d/data" "$1" "$2"
}
M=$((1024 * 1024))

# lines: the number of lines in the remote's log now.
lines () { wc -l < "$log"; }
# reads_since N: the Read (and Cache) requests the remote got after line N.
reads_since ()
{
    tail -n +$(($1 + 1)) "$log" | grep -Ec ' (Read|Cache) id=' || true
}

# check_all URI: A, B and C read through the proxy have the right data.
check_all ()
{
    test "$(nbdio "$p_sock" sha 0 8M)" = "$(sha 0 $((8 * M)))" ||
        fail "wrong data in A"
    test "$(nbdio "$p_sock" sha 16M 4M)" = "$(sha $((16 * M)) $((4 * M)))" ||
        fail "wrong data in B"
    test "$(nbdio "$p_sock" sha 24M 2M)" = "$(sha $((24 * M)) $((2 * M)))" ||
        fail "wrong data in C"
}

# Sequential cutoff off: A is read sequentially, and bcache bypasses the
# cache for a stream past the cutoff (reads included).
p=(bcache="$d/cache" bcache-size=64M bcache-mode=writethrough
   bcache-sequential-cutoff=0)
start_proxy p "${p[@]}"

n=$(lines)
nbdio "$p_sock" sha 0 8M > /dev/null
test "$(reads_since "$n")" -gt 0 || fail "reading A reached no remote: the log filter is not working"
nbdio "$p_sock" cache 16M 4M
nbdio "$p_sock" wfile 24M "$d/c"
"$PYTHON" -c '
import sys
f = open(sys.argv[1], "r+b"); f.seek(24 << 20); f.write(open(sys.argv[2], "rb").read())' \
    "$d/data" "$d/c"

# Poll until the ranges are served from the cache alone.
for i in $(seq 1 10); do
    n=$(lines)
    check_all
    r=$(reads_since "$n")
    [ "$r" -eq 0 ] && break
    echo "$0: re-reading A, B, C still sent $r reads to the remote"
    sleep 0.5
done
test "$r" -eq 0 ||
    fail "A, B and C never became cached ($r remote reads at the last try)"
tail -n +$((n + 1)) "$log"

# Restart: everything comes from the cache.
stop_nbdkit "$p_pid"
start_proxy p "${p[@]}"
n=$(lines)
check_all
tail -n +$((n + 1)) "$log"
r=$(reads_since "$n")
test "$r" -eq 0 ||
    fail "after a restart, reading cached A, B and C sent $r reads to the remote"

# A partial hit: [0, 12M) reads only [8M, 12M) from the remote.
n=$(lines)
test "$(nbdio "$p_sock" sha 0 12M)" = "$(sha 0 $((12 * M)))" ||
    fail "wrong data in [0, 12M)"
tail -n +$((n + 1)) "$log" | grep -E ' Read id=' > "$d/reads" || true
cat "$d/reads"
test -s "$d/reads" || fail "reading [8M, 12M) (never read) sent no read to the remote"
"$PYTHON" -c '
import re, sys
for line in open(sys.argv[1]):
    m = re.search(r"offset=(0x[0-9a-f]+) count=(0x[0-9a-f]+)", line)
    off, cnt = int(m.group(1), 16), int(m.group(2), 16)
    if off < (8 << 20) or off + cnt > (12 << 20):
        sys.exit("remote read %d+%d is outside the cold range [8M, 12M)" % (off, cnt))
' "$d/reads" || fail "a partial hit read cached data from the remote"

# kill -9 after a flush: still the right data.
nbdio "$p_sock" flush
crash_nbdkit "$p_pid"
start_proxy p "${p[@]}"
n=$(lines)
check_all
r=$(reads_since "$n")
# The flush made the journal, and so the inserts, durable.
test "$r" -eq 0 ||
    fail "after a flush and kill -9, reading A, B, C sent $r reads to the remote"
stop_nbdkit "$p_pid"
