#!/usr/bin/env bash
# bcachefilter: bcachefilter-ctl detach (nbdkit-bcachefilter-filter(1),
# WRITEBACK: before the export is used from another host).
#
#  1. Writeback mode, writeback paused: data written by a client is dirty
#     in the cache, not on the export.  detach, while another client
#     keeps writing (the remote is slowed by the delay filter, so that
#     writes arrive during the writeback, and the writeback is slower
#     than the cache takes writes): it ends "detached", within a minute
#     (no write is acknowledged from the cache once it started), and the
#     export has every acknowledged write, those made during the detach
#     included.
#  2. Afterwards the cache passes everything through: a write through
#     the proxy is on the export at once (no dirty data), and a change
#     made to the export behind the proxy's back, over data the cache
#     held, is what the proxy serves.  A second detach says detached
#     again; set cache_mode is refused.
#  3. Stop, change the export behind the cache, start the proxy again on
#     the same cache: it serves the export's data, not the old cached
#     copy, and its log says that the export was detached.
#  4. A detach while the export fails writes (nbdkit's error filter) fails
#     with a clear error and changes nothing: the data stays dirty, the
#     cache keeps serving it in writeback mode; once the export works
#     again the detach succeeds and the export has the data.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help
requires nbdkit --filter=delay null --dump-plugin
requires nbdkit --filter=error null --dump-plugin
requires cmp --version

tmpdir d
ctl="$d/ctl"
M=$((1024 * 1024))
C () { bcachefilter-ctl -s "$ctl" "$@"; }
s () { ctl_stat "$ctl" "$1"; }

# The export: 32 MiB, written 5 ms per request slower than it reads.
start_remote --filter=delay memory 32M delay-write=5ms
head -c 32M /dev/urandom > "$d/data"
nbdio "$remote_sock" wfile 0 "$d/data"
start_proxy p bcache="$d/cache" bcache-size=64M bcache-ctl="$ctl" \
    bcache-mode=writeback
wait_ctl "$ctl"

# ---------------------------------------------------------------------
# 1. Dirty data, then detach under a stream of writes.
C set writeback_running 0
head -c 4M /dev/urandom > "$d/a"
nbdio "$p_sock" wfile $((1 * M)) "$d/a"
# (Most of it: a write that finds no room yet is written through.)
test "$(s dirty_data)" -ge $((2 * M)) || fail "the writes are not dirty in the cache"
nbdio "$remote_sock" rfile $((1 * M)) 4M "$d/remote.a"
! cmp -s "$d/remote.a" "$d/a" || fail "the export has the writes already"

# The writer: 4 KiB writes at random places in [8 MiB, 16 MiB), each of
# its own byte, until told to stop; it records what it wrote in order.
# Scattered, its writes are written back one export write each, far
# slower than the cache takes them in writeback mode: the detach ends
# only because from its start no write is acknowledged from the cache.
"$PYTHON" - "$p_sock" "$d/stop" "$d/written" <<'EOF' &
import os, random, sys, nbd
sock, stop, log = sys.argv[1:]
h = nbd.NBD()
h.connect_unix(sock)
with open(log, "w") as f:
    i = 0
    while not (i >= 64 and os.path.exists(stop)):
        off = (8 << 20) + random.randrange(2048) * 4096
        h.pwrite(bytes([i % 251 + 1]) * 4096, off)
        f.write(f"{off} {i % 251 + 1}\n")
        f.flush()
        i += 1
h.shutdown()
EOF
writer=$!
for (( i = 0; i < 300; i++ )); do
    [ "$(cat "$d/written" 2>/dev/null | wc -l)" -ge 64 ] && break
    sleep 0.1
done
before=$(wc -l < "$d/written")
C detach --timeout 60 > "$d/detach.out" 2> "$d/detach.err" || {
    cat "$d/detach.out" "$d/detach.err"; fail "detach failed"; }
after=$(wc -l < "$d/written")
cat "$d/detach.out" "$d/detach.err"
touch "$d/stop"
wait "$writer" || fail "the writer failed"
test "$after" -gt "$before" || fail "no write arrived during the detach"
grep -q '^detached: all dirty data is written back' "$d/detach.out" ||
    fail "detach: no final line saying what was done"
C detach_status | grep -q '^detached ' || fail "detach_status is not detached"
test "$(s detach)" = detached || fail "the stats do not say detached"
test "$(s dirty_data)" = 0 || fail "dirty data left after the detach"

# The export has every acknowledged write.
cp "$d/data" "$d/expect"
"$PYTHON" - "$d/expect" "$d/a" "$d/written" <<'EOF'
import sys
path, a, log = sys.argv[1:]
with open(path, "r+b") as f:
    f.seek(1 << 20); f.write(open(a, "rb").read())
    for line in open(log):
        off, byte = map(int, line.split())
        f.seek(off); f.write(bytes([byte]) * 4096)
EOF
test "$(wc -l < "$d/written")" -ge 64 || fail "the writer wrote too little"
nbdio "$remote_sock" dump "$d/remote"
cmp "$d/remote" "$d/expect" ||
    fail "the export does not have every write acknowledged before and during the detach"

# ---------------------------------------------------------------------
# 2. Pass-through from now on.
nbdio "$p_sock" fill $((20 * M)) 1M 0x5a
test "$(s dirty_data)" = 0 || fail "a write after the detach left dirty data"
nbdio "$remote_sock" check $((20 * M)) 1M 0x5a ||
    fail "a write after the detach did not reach the export"
# The cache held [1 MiB, 5 MiB) (written back clean): change it behind
# the proxy's back.
nbdio "$remote_sock" fill $((1 * M)) 1M 0x17
nbdio "$p_sock" check $((1 * M)) 1M 0x17 ||
    fail "after the detach the proxy served the cache's copy, not the export"
C detach | grep -q '^detached' || fail "a second detach does not say detached"
st=0; C set cache_mode writethrough > "$d/mode.out" 2>&1 || st=$?
cat "$d/mode.out"
test "$st" -eq 1 && grep -q "detached" "$d/mode.out" ||
    fail "set cache_mode after the detach was not refused"

# ---------------------------------------------------------------------
# 3. A restart on the same cache serves nothing old.
stop_nbdkit "$p_pid"
nbdio "$remote_sock" fill $((2 * M)) 1M 0x29
nbdio "$remote_sock" fill $((9 * M)) 64k 0x33
start_proxy p bcache="$d/cache" bcache-ctl="$ctl" bcache-mode=writeback \
    2> "$d/restart.log"
wait_ctl "$ctl"
nbdio "$p_sock" check $((2 * M)) 1M 0x29 ||
    fail "after a restart the cache served data from before the detach"
nbdio "$p_sock" check $((9 * M)) 64k 0x33 ||
    fail "after a restart the cache served data from before the detach"
nbdio "$p_sock" check $((1 * M)) 1M 0x17
grep "was detached from it" "$d/restart.log" ||
    fail "the restart does not say in its log that the export was detached"
test "$(s detach)" = none || fail "the restarted proxy is not attached"
stop_nbdkit "$p_pid"

# ---------------------------------------------------------------------
# 4. A detach the export fails: nothing changes.
trigger="$d/fail-writes"
start_remote_named erem --filter=error memory 32M error=EIO \
    error-pwrite-rate=100% error-file="$trigger"
start_proxy q remote="$erem_sock" bcache="$d/cache2" bcache-size=64M \
    bcache-ctl="$ctl" bcache-mode=writeback
wait_ctl "$ctl"
C set writeback_running 0
head -c 2M /dev/urandom > "$d/b"
nbdio "$q_sock" wfile $((3 * M)) "$d/b"
dirty="$(s dirty_data)"
test "$dirty" -ge $((1 * M)) || fail "the writes are not dirty in the cache"
touch "$trigger"
st=0; C detach > "$d/fail.out" 2> "$d/fail.err" || st=$?
cat "$d/fail.out" "$d/fail.err"
test "$st" -eq 1 || fail "a detach the export fails: exit status $st, not 1"
grep -q "detach failed: writing the dirty data back to the export failed (Input/output error)" \
    "$d/fail.err" || fail "a failed detach does not say why"
grep -q "nothing was changed" "$d/fail.err" ||
    fail "a failed detach does not say that nothing changed"
test "$(s dirty_data)" = "$dirty" || fail "a failed detach changed the dirty data"
test "$(s detach)" = none || fail "a failed detach left the cache detaching"
test "$(s cache_mode)" = writeback || fail "a failed detach changed the mode"
nbdio "$q_sock" rfile $((3 * M)) 2M "$d/back"
cmp "$d/back" "$d/b" || fail "after a failed detach the proxy does not serve the dirty data"
rm -f "$trigger"
C detach > "$d/again.out" || fail "the detach failed once the export worked"
grep -q '^detached' "$d/again.out" || fail "detach: no final line"
nbdio "$erem_sock" rfile $((3 * M)) 2M "$d/back"
cmp "$d/back" "$d/b" || fail "after the detach the export does not have the data"
stop_nbdkit "$q_pid"

echo "$0: OK"
