#!/usr/bin/env bash
# bcachefilter: an export whose plugin is not PARALLEL never sees two of
# the filter's calls at once (nbdkit-bcachefilter-filter(1), NOTES).
#
# nbdkit serialises the clients' requests as the plugin's thread model
# asks, but not the calls the filter's own threads make on its own
# context into the export: the writeback thread and its writers
# (core/writeback.c, up to 16 backing writes in flight).  nbdkit-filter(3)
# leaves that to the filter (plugin/backing.c serialises them).
#
# The export is nbdkit's eval plugin over a file, in its default model
# (serialize_all_requests).  Each data call takes a lock directory and
# fails, leaving a mark, if another call holds it; writes take 20 ms, so
# that concurrent writeback writes meet.  Writeback mode, writeback
# paused: 16 separate 64 KiB writes are dirty in the cache.  Then
# bcachefilter-ctl flush writes them back while a client keeps reading
# other blocks through the proxy.  No call may have met another, the
# writeback must report no export error, and the export must hold every
# write.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help
requires nbdkit eval --version
requires dd --version
requires cmp --version

tmpdir d
ctl="$d/ctl"
K=1024
M=$((1024 * K))
C () { bcachefilter-ctl -s "$ctl" "$@"; }
s () { ctl_stat "$ctl" "$1"; }

truncate -s 8M "$d/export"
guard="mkdir '$d/busy' 2>/dev/null || { touch '$d/overlap';
         echo 'EIO two calls in the plugin at once' >&2; exit 1; }"
rm -f "$d/proxy.sock"
start_nbdkit -P "$d/proxy.pid" -U "$d/proxy.sock" \
    --filter="$BCACHEFILTER_SO" eval \
    get_size='echo 8388608' \
    can_write='exit 0' can_flush='exit 0' \
    pread="$guard
           dd if='$d/export' skip=\$4 count=\$3 iflag=skip_bytes,count_bytes \
              status=none; r=\$?; rmdir '$d/busy'; exit \$r" \
    pwrite="$guard
           sleep 0.02
           dd of='$d/export' seek=\$4 oflag=seek_bytes conv=notrunc \
              status=none; r=\$?; rmdir '$d/busy'; exit \$r" \
    flush="$guard
           rmdir '$d/busy'" \
    bcache="$d/cache" bcache-size=64M bcache-ctl="$ctl" \
    bcache-mode=writeback
proxy_sock="$d/proxy.sock"
wait_ctl "$ctl"

C set writeback_running 0
head -c 1M /dev/urandom > "$d/data"
for i in $(seq 0 15); do
    dd if="$d/data" of="$d/piece" bs=64K skip="$i" count=1 status=none
    nbdio "$proxy_sock" wfile $((i * 256 * K)) "$d/piece"
done
test "$(s dirty_data)" -eq $((1 * M)) ||
    fail "the 16 writes are not all dirty in the cache: $(s dirty_data) bytes"

# Client reads of other blocks (misses: they reach the export) while the
# writeback writes back.
( for i in $(seq 0 15); do
      nbdio "$proxy_sock" sha $((4 * M + i * 64 * K)) 64K >/dev/null
  done ) &
reader=$!
C flush --timeout 60
wait "$reader" || fail "a client read failed while the writeback ran"

test ! -e "$d/overlap" ||
    fail "the export's plugin (serialize_all_requests) saw two calls at once"
test "$(s writeback_backing_errors)" -eq 0 ||
    fail "the writeback saw $(s writeback_backing_errors) export errors"
test "$(s dirty_data)" -eq 0 || fail "dirty data left after the flush"
for i in $(seq 0 15); do
    dd if="$d/data" of="$d/want" bs=64K skip="$i" count=1 status=none
    dd if="$d/export" of="$d/got" bs=64K skip=$((i * 4)) count=1 status=none
    cmp "$d/want" "$d/got" || fail "write $i is not on the export"
done
