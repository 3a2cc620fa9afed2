#!/usr/bin/env bash
# bcachefilter: the seed race (DESIGN.md "Why it exists" 2) — a read miss
# that overlaps a bypassing write must not put old data in the cache.
#
# The remote is nbdkit's data plugin (X = [1M, 1M+256K) holds 0x11, the
# "old" data) behind the delay filter (every write takes $RACE_DELAY
# seconds, default 3) and the log filter outside it, so the log shows
# when a write has reached the remote ("Write id=N") and when it is done
# ("...Write id=N return=").  The order of events is forced through the
# log, not by sleeping:
#   1. a client writes 0x22 over X through the proxy, in the background;
#      the write bypasses the cache (writearound, or writethrough with a
#      128K sequential cutoff and a 256K write);
#   2. once the remote has the write (it is now delayed there), X (its
#      first 64K) is read through the proxy: a miss, served from the remote (old data), and
#      the test checks the write is still in flight at the remote;
#   3. after the write has completed, X is read again: it must be 0x22
#      (I1) — and again after a restart of the proxy (the cache kept
#      nothing stale).
# With bcache-test-disable-tracker=true (the in-flight write tracker off)
# the same sequence must return the stale 0x11 in step 3: that shows this
# test catches the bug it exists for.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
delay="${RACE_DELAY:-3}"

tmpdir d
M=$((1024 * 1024))
X=$M                    # X = [1M, 1M + 256K)
XLEN=$((256 * 1024))
# The reads cover the first 64K of X: below the 128K cutoff, and not a
# continuation of the write's stream, so they are cached (a 256K read
# would itself bypass the cache and the cutoff scenarios would prove
# nothing).
RLEN=$((64 * 1024))

# wait_log REGEXP: wait (bounded) until the remote's log has a line
# matching REGEXP after line $mark.
wait_log ()
{
    local i
    for i in $(seq 1 300); do
        tail -n +$((mark + 1)) "$log" | grep -Eq "$1" && return 0
        sleep 0.1
    done
    cat "$log"
    fail "the remote's log never showed '$1'"
}

# read_x: print the byte X holds through the proxy (01 bytes: "11", "22"),
# or "mixed".
read_x ()
{
    nbdio "$p_sock" rfile $X $RLEN "$d/x"
    "$PYTHON" -c '
import sys
b = open(sys.argv[1], "rb").read()
print("%02x" % b[0] if b.count(b[0]) == len(b) else "mixed")' "$d/x"
}

# scenario NAME EXPECT PROXY-ARGS...: run steps 1-3 against a fresh
# remote and cache; EXPECT is what the read after the write must return
# (22 = new data; 11 = stale, with the tracker disabled).
scenario ()
{
    local name="$1" expect="$2" during after after_restart st=0
    shift 2
    echo "$0: scenario $name"
    log="$d/$name.log"
    start_remote_named "r_$name" --filter=log --filter=delay \
        data "@$X ( 0x11 )*$XLEN" size=16M \
        logfile="$log" delay-write="$delay"
    local rsock="$d/r_$name.sock" rpid="$nbdkit_pid"
    nbdio "$rsock" check $X $XLEN 0x11
    start_proxy p remote="$rsock" bcache="$d/$name.cache" bcache-size=64M "$@"

    mark=$(wc -l < "$log")
    nbdio "$p_sock" fill $X $XLEN 0x22 &
    local writer=$!
    wait_log ' Write id='
    during="$(read_x)"
    if tail -n +$((mark + 1)) "$log" | grep -q '\.\.\.Write id=.*return'; then
        wait "$writer" || true
        fail "$name: the write finished before the read did: the machine" \
             "is too slow for RACE_DELAY=$delay, raise it"
    fi
    wait "$writer" || st=$?
    test "$st" -eq 0 || fail "$name: the write failed (status $st)"
    after="$(read_x)"
    echo "$0: $name: during the write X read $during, after it $after"
    if [ "$expect" = 22 ]; then
        test "$after" = 22 ||
            fail "$name: X read $after after the write completed:" \
                 "stale data was cached by the overlapping read miss"
        # And the cache kept nothing stale.
        stop_nbdkit "$p_pid"
        start_proxy p remote="$rsock" bcache="$d/$name.cache" \
                    bcache-size=64M "$@"
        after_restart="$(read_x)"
        test "$after_restart" = 22 ||
            fail "$name: X read $after_restart after a restart"
    else
        test "$during" = 11 ||
            fail "$name: the read during the write returned $during, not" \
                 "the old data: the race was not set up"
        test "$after" = 11 ||
            fail "$name: with the tracker disabled X read $after, not the" \
                 "stale 11: this test cannot show the race it exists for"
        echo "$0: $name: the stale read appeared, as expected without the tracker"
    fi
    nbdio "$rsock" check $X $XLEN 0x22 || fail "$name: the remote lost the write"
    stop_nbdkit "$p_pid"
    stop_nbdkit "$rpid"
}

scenario writearound 22 bcache-mode=writearound
# The cutoff scenarios need the write to bypass: bcache's rule
# (sequential-bypass=always), since under the default (auto) a stream
# from an export slower than the cache, as this delayed one is, is cached.
scenario cutoff 22 bcache-mode=writethrough bcache-sequential-cutoff=128K \
    bcache-sequential-bypass=always
scenario writearound_notracker 11 bcache-mode=writearound \
    bcache-test-disable-tracker=true
scenario cutoff_notracker 11 bcache-mode=writethrough \
    bcache-sequential-cutoff=128K bcache-sequential-bypass=always \
    bcache-test-disable-tracker=true
