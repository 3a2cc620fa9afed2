#!/usr/bin/env bash
# bcachefilter: a cache file that changes under the proxy.
#
# A mistaken `truncate`, or a restore from backup over the cache file,
# while the proxy runs: later cache writes grow the file back with a hole
# over the old extents, and the holes read as zeros without any error.
# The proxy must notice (it looks at the device every journal_delay_ms,
# and at every failed I/O), give the cache up and serve the export.
#
#  1. Warm [0, 16M) through the proxy.
#  2. truncate -s 8M, then back to the full size: a hole over everything
#     past the first 8 MiB, where the data is (the superblock survives, so only the proxy's own mark can make
#     the next start begin empty).
#  3. Within a second the proxy says why it gave the cache up, reads of
#     the old extents return the export's data, and the stats say
#     passthrough.
#  4. The proxy marked the cache as given up: a restart begins with an
#     empty cache (first registration), serving the export's data.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires head --version
requires truncate --version

tmpdir d
start_remote memory 32M
head -c 32M /dev/urandom > "$d/data"
nbdio "$remote_sock" wfile 0 "$d/data"

p=(bcache="$d/cache" bcache-size=64M bcache-sequential-cutoff=0
   bcache-ctl="$d/ctl.sock")
start_proxy p "${p[@]}" 2> "$d/proxy.log"
nbdio "$p_sock" sha 0 16M > /dev/null
nbdio "$p_sock" flush
test "$(ctl_stat "$d/ctl.sock" cache_hits)" -ge 0

truncate -s 8M "$d/cache"
truncate -s 64M "$d/cache"

# The journal thread looks every 100 ms.  It usually looks after the
# second truncate and sees the lost allocation; if it looks between the
# two, it sees the file shrink.  Both are this change noticed (a sleep
# between the truncates makes the second every time).
noticed='(lost .* allocated bytes|shrank from [0-9]+ to [0-9]+ bytes) under us'
for (( i = 0; i < 100; i++ )); do
    grep -qE "$noticed" "$d/proxy.log" && break
    sleep 0.1
done
nbdio "$p_sock" dump "$d/view"
cmp "$d/data" "$d/view" || fail "the proxy served the truncated cache"
cat "$d/proxy.log"
grep -qE "$noticed" "$d/proxy.log" ||
    fail "the proxy did not notice its cache file was truncated"
grep -q "giving the cache up" "$d/proxy.log" ||
    fail "the proxy did not say it gives the cache up"
bcachefilter-ctl -s "$d/ctl.sock" stats | grep -E '^passthrough +yes' ||
    fail "the stats do not say passthrough"

cat "$d/proxy.log"
grep -q "abandoned: the next open starts with an empty cache" "$d/proxy.log" ||
    fail "the proxy did not mark the cache as given up"

stop_nbdkit "$p_pid"
start_proxy p "${p[@]}" 2> "$d/proxy2.log"
cat "$d/proxy2.log"
grep -q "first registration" "$d/proxy2.log" ||
    fail "the restart did not begin with an empty cache"
nbdio "$p_sock" dump "$d/view"
cmp "$d/data" "$d/view" || fail "wrong data after the restart"
