#!/usr/bin/env bash
# bcachefilter: the control socket (bcache-ctl=PATH) and bcachefilter-ctl.
#
#  - the socket exists with mode 0600 (owner only);
#  - "stats --json" is JSON (python3's json) with bcache's counters, and
#    they move: a read miss counts in cache_misses, re-reading it counts
#    in cache_hits; a write then read in writethrough is a hit;
#  - "set cache_mode writearound" takes effect: writes are no longer
#    cached (a write then a read of it is a miss), and stats report the
#    mode; back to writethrough, writes are cached again;
#  - "set cache_mode writeback" and "set cache_mode bogus" fail with exit
#    status 1 and a message naming the problem; the mode is unchanged;
#  - "set sequential_cutoff" takes effect (stats), bad values fail;
#  - "trigger_gc" and "show super" work (show super names the cache);
#  - an unknown command fails with status 1; the text stats work;
#  - three idle connections held open do not delay stats (under 1 s),
#    and 300 simultaneous connects are all answered, none refused;
#  - after all that the data is right, and the proxy stops cleanly (the
#    socket is removed);
#  - settings made through the socket before the first connection are
#    still in effect after it (the cache is opened again for its export
#    then).

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help
requires stat --version

tmpdir d
ctl="$d/ctl"
start_remote memory 32M
head -c 32M /dev/urandom > "$d/data"
nbdio "$remote_sock" wfile 0 "$d/data"
start_proxy p bcache="$d/cache" bcache-size=64M bcache-ctl="$ctl"

# The control socket is created in .after_fork, which may still be
# opening the cache when the NBD socket and the pidfile already exist.
for _ in $(seq 300); do test -S "$ctl" && break; sleep 0.1; done
test -S "$ctl" || fail "no control socket at $ctl"
mode="$(stat -c %a "$ctl")"
test "$mode" = 600 || fail "the control socket has mode $mode, not 600"

C () { bcachefilter-ctl -s "$ctl" "$@"; }
s () { ctl_stat "$ctl" "$1"; }

C stats --json > "$d/stats.json"
"$PYTHON" -c 'import json, sys; json.load(open(sys.argv[1]))' "$d/stats.json" ||
    fail "stats --json is not JSON"
for k in cache_hits cache_misses cache_bypass_hits cache_bypass_misses \
         cache_miss_collisions cache_read_races bypassed device_errors \
         passthrough cache_mode sequential_cutoff; do
    "$PYTHON" "$filterdir/stat.py" "$k" < "$d/stats.json" >/dev/null ||
        fail "stats --json has no $k"
done
# The error counter's limit and half-life (bcache's io_error_*).
test "$(s io_error_limit)" = 64 || fail "io_error_limit is not the default 64"
test "$(s io_error_halflife)" = 1000000 ||
    fail "io_error_halflife is not the default 1000000"
test "$(s io_errors)" = 0 || fail "io_errors is not 0"
C stats > "$d/stats.txt"
cat "$d/stats.txt"
grep -q cache_hits "$d/stats.txt" || fail "text stats have no cache_hits"

# A read miss, then a hit.
m0=$(s cache_misses); h0=$(s cache_hits)
nbdio "$p_sock" sha 4M 64k > /dev/null
m1=$(s cache_misses); h1=$(s cache_hits)
test "$m1" -gt "$m0" || fail "a read miss did not count in cache_misses ($m0 -> $m1)"
# (The insert may land just after the client has its answer.)
for i in $(seq 1 20); do
    nbdio "$p_sock" sha 4M 64k > /dev/null
    h1=$(s cache_hits)
    [ "$h1" -gt "$h0" ] && break
    sleep 0.2
done
test "$h1" -gt "$h0" || fail "re-reading a range did not count in cache_hits"

# writethrough: a write is cached (write, then read = hit).  A write to
# data the cache does not hold is cached by the fill queue after its
# export write (core/request.c, write_fill), so the client may have its
# answer before the key is in: wait (3 s at most) for the insert to be
# counted.  Where nothing is cached (writearound) the wait runs out and
# the read must still miss.
write_then_read ()
{
    local off="$1" h m i0 i
    i0=$(s inserts)
    nbdio "$p_sock" fill "$off" 64k 0x5c
    for i in $(seq 1 30); do
        [ "$(s inserts)" -gt "$i0" ] && break
        sleep 0.1
    done
    h=$(s cache_hits); m=$(s cache_misses)
    nbdio "$p_sock" check "$off" 64k 0x5c
    echo "hits $h -> $(s cache_hits), misses $m -> $(s cache_misses)"
    if [ "$(s cache_hits)" -gt "$h" ] && [ "$(s cache_misses)" -eq "$m" ]; then
        echo hit
    else
        echo miss
    fi
}
r="$(write_then_read 8M | tail -1)"
test "$r" = hit || fail "in writethrough, a written range was not cached"

C set cache_mode writearound
test "$(s cache_mode)" = writearound || fail "cache_mode did not change"
r="$(write_then_read 9M | tail -1)"
test "$r" = miss || fail "in writearound, a write was cached"

# Writeback, and its knobs; then back (a refused value changes nothing).
C set cache_mode writeback
test "$(s cache_mode)" = writeback || fail "cache_mode did not change to writeback"
C set writeback_percent 25
test "$(s writeback_percent)" = 25 || fail "writeback_percent did not change"
st=0; C set writeback_percent 101 > "$d/wbp.out" 2>&1 || st=$?
cat "$d/wbp.out"
test "$st" -eq 1 || fail "set writeback_percent 101: exit status $st, not 1"
grep -q "out of range" "$d/wbp.out" || fail "writeback_percent 101: no reason given"
test "$(s writeback_percent)" = 25 || fail "a refused writeback_percent changed it"
C writeback_flush
C set cache_mode writearound
# Refused modes, with a message, and nothing changes.
st=0; C set cache_mode bogus > "$d/bogus.out" 2>&1 || st=$?
cat "$d/bogus.out"
test "$st" -eq 1 || fail "set cache_mode bogus: exit status $st, not 1"
grep -q "unknown mode 'bogus': use writethrough" "$d/bogus.out" ||
    fail "set cache_mode bogus: not the filter's message naming the modes"
test "$(s cache_mode)" = writearound || fail "a refused set changed cache_mode"

C set cache_mode writethrough
test "$(s cache_mode)" = writethrough || fail "cache_mode did not change back"
r="$(write_then_read 10M | tail -1)"
test "$r" = hit || fail "back in writethrough, a written range was not cached"

# sequential_cutoff.
C set sequential_cutoff 1M
test "$(s sequential_cutoff)" = 1048576 || fail "sequential_cutoff did not change"
C set sequential_cutoff 0
test "$(s sequential_cutoff)" = 0 || fail "sequential_cutoff did not change to 0"
st=0; C set sequential_cutoff lots > "$d/cut.out" 2>&1 || st=$?
cat "$d/cut.out"
test "$st" -eq 1 || fail "set sequential_cutoff lots: exit status $st, not 1"

# sequential_bypass (auto by default) and bcache's congestion thresholds
# (2000 and 20000 us by default).
test "$(s sequential_bypass)" = auto || fail "sequential_bypass is not auto"
C set sequential_bypass always
test "$(s sequential_bypass)" = always ||
    fail "sequential_bypass did not change"
st=0; C set sequential_bypass sometimes > "$d/sb.out" 2>&1 || st=$?
test "$st" -eq 1 || fail "set sequential_bypass sometimes: exit status $st"
test "$(s congested_read_threshold_us)" = 2000 ||
    fail "congested_read_threshold_us is not bcache's 2000"
test "$(s congested_write_threshold_us)" = 20000 ||
    fail "congested_write_threshold_us is not bcache's 20000"
C set congested_read_threshold_us 0
C set congested_write_threshold_us 0
test "$(s congested_read_threshold_us)" = 0 ||
    fail "congested_read_threshold_us did not change"
test "$(s congested)" = 0 || fail "congested with the tracking off"
C set congested_read_threshold_us 2000
C set congested_write_threshold_us 20000
C set sequential_bypass auto

# trigger_gc, show super, an unknown command.
C trigger_gc
C show super > "$d/super"
cat "$d/super"
grep -qF "$d/cache" "$d/super" || grep -Eqi 'uuid|bucket' "$d/super" ||
    fail "show super shows nothing recognisable"
st=0; C frobnicate > "$d/unknown.out" 2>&1 || st=$?
cat "$d/unknown.out"
test "$st" -ne 0 || fail "an unknown command succeeded"
test -s "$d/unknown.out" || fail "an unknown command failed without a message"

# Under load: three idle connections held open do not delay stats (served
# one connection at a time it waited 15 s), and 300 simultaneous
# non-blocking connects are queued, not refused with EAGAIN (the backlog
# was 16); each is answered with the stats or, beyond the documented
# bound, "error: busy".  The idle connections close with the script.
"$PYTHON" - "$ctl" <<'EOF'
import errno, select, socket, subprocess, sys, time
path = sys.argv[1]
idle = [socket.socket(socket.AF_UNIX) for _ in range(3)]
for s in idle:
    s.connect(path)
time.sleep(0.2)
t0 = time.monotonic()
out = subprocess.run(["bcachefilter-ctl", "-s", path, "stats", "--json"],
                     capture_output=True, timeout=20)
dt = time.monotonic() - t0
print(f"stats with 3 idle connections: {dt * 1000:.0f} ms")
assert out.returncode == 0 and b"cache_hits" in out.stdout, out
assert dt < 1.0, f"stats took {dt:.3f} s behind 3 idle connections"
for s in idle:
    s.close()

conns = []
for i in range(300):
    s = socket.socket(socket.AF_UNIX)
    s.setblocking(False)
    try:
        s.connect(path)
    except OSError as e:
        sys.exit(f"connect {i + 1} of 300: {errno.errorcode[e.errno]}")
    conns.append(s)
for s in conns:
    try:
        s.send(b"stats --json\n")
    except (BrokenPipeError, ConnectionResetError):
        pass                    # refused as busy: its answer counts
answers = {s: b"" for s in conns}
done, deadline = {}, time.monotonic() + 30
while len(done) < len(conns):
    assert time.monotonic() < deadline, f"{len(conns) - len(done)} unanswered"
    ready, _, _ = select.select([s for s in conns if s not in done], [], [], 1)
    for s in ready:
        try:
            d = s.recv(65536)
        except ConnectionResetError:
            d = b""
        if d:
            answers[s] += d
        else:
            done[s] = answers[s]
            s.close()
ok = sum(a.startswith(b"ok\n{") for a in done.values())
busy = sum(a.startswith(b"error: busy: ") for a in done.values())
print(f"300 simultaneous connects: {ok} answered, {busy} busy")
assert ok + busy == 300, [a for a in done.values()
                          if not a.startswith((b"ok\n{", b"error: busy: "))][:3]
EOF

# The data is right after all that, and the proxy stops cleanly.
cp "$d/data" "$d/expect"
"$PYTHON" -c '
import sys
f = open(sys.argv[1], "r+b")
for off in (8, 9, 10):
    f.seek(off << 20); f.write(b"\x5c" * 65536)' "$d/expect"
nbdio "$p_sock" dump "$d/dump"
cmp "$d/dump" "$d/expect" || fail "wrong data through the proxy"
stop_nbdkit "$p_pid"
test ! -e "$ctl" || fail "the control socket was left behind after a clean stop"

# Settings made before the first connection outlive it: a new cache is
# opened again for its export at the first connection (lifecycle.c's
# first_connection), and the writeback knobs set through the socket
# meanwhile were lost there (the thread came back running, at 10 %).
ctl2="$d/ctl2"
start_proxy q bcache="$d/cache2" bcache-size=64M bcache-ctl="$ctl2" \
    bcache-mode=writeback
wait_ctl "$ctl2"
C2 () { bcachefilter-ctl -s "$ctl2" "$@"; }
C2 set writeback_running 0
C2 set writeback_percent 37
C2 set writeback_delay 7
C2 set writeback_rate_update_seconds 9
C2 set copy_gc_enabled 0
C2 set sequential_cutoff 3M
head -c 64K /dev/urandom > "$d/piece"
nbdio "$q_sock" wfile 0 "$d/piece"
for kv in writeback_running=0 writeback_percent=37 writeback_delay=7 \
          writeback_rate_update_seconds=9 copy_gc_enabled=0 \
          sequential_cutoff=3145728 cache_mode=writeback; do
    got="$(ctl_stat "$ctl2" "${kv%%=*}")"
    test "$got" = "${kv#*=}" ||
        fail "${kv%%=*} is $got after the first connection, not ${kv#*=} as set before it"
done
test "$(ctl_stat "$ctl2" dirty_data)" -gt 0 ||
    fail "the write is not dirty in the cache (writeback_running 0)"
stop_nbdkit "$q_pid"

# Relative paths with nbdkit in the background, where it changes to /
# when it forks: the cache and the control socket are made where they
# were named from, not under /.
rm -f "$d/bg.pid"
(cd "$d" && nbdkit -P "$d/bg.pid" -U "$d/bg.sock" --filter="$BCACHEFILTER_SO" \
     nbd socket="$remote_sock" bcache=bg.cache bcache-size=64M \
     bcache-ctl=bg.ctl 2> "$d/bg.log")
for (( i = 0; i < 100; i++ )); do [ -s "$d/bg.pid" ] && break; sleep 0.1; done
bgpid="$(cat "$d/bg.pid")"
cleanup_fn kill "$bgpid"
nbdio "$d/bg.sock" sha 0 1M > /dev/null
test -S "$d/bg.ctl" || fail "bcache-ctl=bg.ctl: no socket in the directory nbdkit started in"
bcachefilter-ctl -s "$d/bg.ctl" stats | grep -E '^cache_hits ' ||
    fail "the control socket of the background proxy does not answer"
test -f "$d/bg.cache" || fail "bcache=bg.cache: no cache file where it was named"
test ! -e /bg.cache && test ! -e /bg.ctl || fail "a relative path was taken from /"
kill "$bgpid"
for (( i = 0; i < 100; i++ )); do kill -0 "$bgpid" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$bgpid" 2>/dev/null || fail "the background proxy did not stop"
