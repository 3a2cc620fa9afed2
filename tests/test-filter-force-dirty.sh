#!/usr/bin/env bash
# bcachefilter: a forced format never destroys dirty data unasked.
#
# A cache holding dirty data (writeback mode, writeback paused, a clean
# stop) holds the only copy of writes its clients were told are done.
#
#  1. nbdkit ... bcache-format=force refuses to start, saying how much
#     dirty data would be lost and what to do instead (flush or detach);
#     bcache-format=force-discard-dirty starts, with an empty cache.
#  2. bcachefilter-format --force refuses (exit 3) likewise;
#     --discard-dirty without --force is a usage error (exit 1);
#     --force --discard-dirty formats.
#  3. After the refusals the cache is unchanged: started normally it
#     serves the dirty data; once flushed (bcachefilter-ctl flush),
#     bcache-format=force formats it without the second word.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help
requires bcachefilter-format --help
requires cmp --version

tmpdir d
ctl="$d/ctl"
M=$((1024 * 1024))
F=(--filter="$BCACHEFILTER_SO" nbd)

start_remote memory 32M
nbdio "$remote_sock" fill 0 32M 0x11
start_proxy p bcache="$d/cache" bcache-size=64M bcache-ctl="$ctl" \
    bcache-mode=writeback
wait_ctl "$ctl"
bcachefilter-ctl -s "$ctl" set writeback_running 0
head -c 2M /dev/urandom > "$d/b"
nbdio "$p_sock" wfile $((4 * M)) "$d/b"
dirty="$(ctl_stat "$ctl" dirty_data)"
test "$dirty" -gt 0 || fail "no dirty data in the cache"
stop_nbdkit "$p_pid"
cp --sparse=always "$d/cache" "$d/cache.copy1"
cp --sparse=always "$d/cache" "$d/cache.copy2"

# 1. The filter.
must_refuse "$d/force.log" "holds $dirty bytes .* of dirty data" \
    "${F[@]}" socket="$remote_sock" bcache="$d/cache" bcache-format=force
grep -q "bcachefilter-ctl flush" "$d/force.log" &&
    grep -q "bcache-format=force-discard-dirty" "$d/force.log" ||
    fail "the refusal does not say what to do instead"
start_proxy q bcache="$d/cache.copy1" bcache-format=force-discard-dirty
nbdio "$q_sock" check $((4 * M)) 2M 0x11 ||
    fail "force-discard-dirty: not an empty cache"
stop_nbdkit "$q_pid"

# 2. bcachefilter-format.
st=0; bcachefilter-format --force "$d/cache" > "$d/fmt.out" 2>&1 || st=$?
cat "$d/fmt.out"
test "$st" -eq 3 || fail "bcachefilter-format --force over dirty data: exit $st, not 3"
grep -q "$dirty bytes .* of DIRTY data" "$d/fmt.out" &&
    grep -q -- "--discard-dirty" "$d/fmt.out" &&
    grep -q "bcachefilter-ctl flush" "$d/fmt.out" ||
    fail "bcachefilter-format: the refusal does not say what is lost and what to do"
st=0; bcachefilter-format --discard-dirty "$d/cache" > "$d/fmt2.out" 2>&1 || st=$?
cat "$d/fmt2.out"
test "$st" -eq 1 || fail "--discard-dirty without --force: exit $st, not 1"
bcachefilter-format --force --discard-dirty "$d/cache.copy2" ||
    fail "bcachefilter-format --force --discard-dirty failed"
start_proxy q bcache="$d/cache.copy2"
nbdio "$q_sock" check $((4 * M)) 2M 0x11 ||
    fail "--force --discard-dirty: not an empty cache"
stop_nbdkit "$q_pid"

# 3. Nothing was lost; flushed, force needs no second word.
start_proxy p bcache="$d/cache" bcache-ctl="$ctl"
wait_ctl "$ctl"
nbdio "$p_sock" rfile $((4 * M)) 2M "$d/back"
cmp "$d/back" "$d/b" || fail "a refused format changed the cache: its dirty data is gone"
bcachefilter-ctl -s "$ctl" flush
stop_nbdkit "$p_pid"
start_proxy p bcache="$d/cache" bcache-format=force
nbdio "$p_sock" rfile $((4 * M)) 2M "$d/back"
cmp "$d/back" "$d/b" || fail "the flushed data is not on the export"
stop_nbdkit "$p_pid"

echo "$0: OK"
