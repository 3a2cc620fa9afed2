#!/usr/bin/env bash
# bcachefilter: a kernel's writeback cache with dirty data, opened by the
# filter, which serves the dirty data and writes it back (issue 16;
# tests/kernel/README.md).
#
#  1. make-bcache -C makes a cache, make-bcache -B a backing device; the
#     kernel registers both, attaches the device, sets cache_mode
#     writeback with writeback_running 0, writes 32 ranges through
#     /dev/bcache0 and reads 32 others twice (clean cached data), and
#     stops without detaching: the data it wrote stays dirty in the cache.
#  2. On the host: the device's superblock says attached to that cache
#     set, dirty; its data region is what it was before the kernel (none
#     of the writes reached it); the kernel's btree holds the writes as
#     dirty keys, exactly as many sectors as it wrote.
#  3. The filter opens the kernel's cache in front of a copy of the
#     device whose data region is poisoned (0xA5), with the copy failing
#     every write (nbdkit's error filter): the writeback cannot reach it,
#     so every dirty sector the filter serves comes from the cache.
#     Every cached sector (dirty or clean) must read as the kernel wrote
#     or read it, every other as 0xA5; the filter counts the kernel's
#     dirty data as it wrote it.  Then the copy takes writes again:
#     bcachefilter-ctl flush writes the dirty data back, and the stop
#     marks the device clean.  The copy's data region must then be the
#     poison with exactly the kernel's writes in it, and the cache fsck
#     clean with no dirty key left.
#  4. What a user does (nbdkit-bcachefilter-filter(1), THE LINUX KERNEL):
#     the filter, in its default mode, on the device itself with another
#     copy of the kernel's cache; a client connects (the cache of a
#     backing device opens then) and the filter drains the dirty data on
#     its own; after the stop the device alone holds every write, and
#     says clean.

source "$(dirname "$0")/../functions.sh"
source "$(dirname "$0")/../filter/common.sh"
source "$(dirname "$0")/kernel.sh"
set -e
set -x

filter_requires
kernel_requires
tmpdir d

data=$((64 << 20))
c="$d/cache.img" img="$d/bdev.img"
truncate -s 512M "$c"
make-bcache -C -w 4k -b 512k "$c" > /dev/null
truncate -s $((data + 8192)) "$img"
make-bcache -B -w 4k "$img" > /dev/null
kcheck pattern "$img" 8192 "$data" made-wb
set="$(bcachesb show "$c" set_uuid)"

mkdir "$d/vm.data"
kcheck kwrites "$d/ranges" "$d/vm.data/pat" --n 64 --size "$data" --seed made-wb
head -32 "$d/ranges" > "$d/vm.data/kwrites"
tail -32 "$d/ranges" > "$d/vm.data/kreads"
dd if="$img" of="$d/orig.img" bs=8192 skip=1 status=none
cp "$d/orig.img" "$d/expect.img"
kcheck apply-writes "$d/expect.img" "$d/vm.data/kwrites" "$d/vm.data/pat"
written=$(awk '{ s += $2 } END { print s / 512 }' "$d/vm.data/kwrites")
printf 'CSET=%s\nWRITEBACK=1\n' "$set" > "$d/vm.data/params"

# 1. The kernel's turn.
vm_boot vm "$kerneldir/vm-make.sh" "$c" "$img"
vm_report vm
vm_said vm "cset-appeared $set" || fail "the kernel did not register the cache"
vm_said vm "attached" || fail "the kernel did not attach the backing device"
vm_said vm "cache-mode writeback" || fail "the kernel's device is not in writeback mode"
test "$(vm_value vm kwrites-mismatches)" = 0 ||
    fail "the kernel read back other data than it wrote"
vm_said vm "kreads-stable" || fail "the kernel's second reads differ"
vm_said vm "state dirty" || fail "the kernel's device is not dirty after its writes"
vm_said vm "stopped-cleanly" || fail "the kernel did not stop cleanly"
trouble="$(vm_trouble vm)"
[ -z "$trouble" ] || fail "the kernel complained: $trouble"

# 2. What the kernel left: the writes in the cache only.
test "$(bcachesb show "$img" set_uuid)" = "$set" ||
    fail "the kernel did not attach the device's superblock to its set"
test "$(bcachesb show "$img" state)" = dirty ||
    fail "the device's superblock does not say dirty"
echo "the device's cache mode: $(bcachesb show "$img" cache_mode)"
dd if="$img" bs=8192 skip=1 status=none | cmp - "$d/orig.img" ||
    fail "the kernel wrote to the backing device (writeback_running was 0)"
sed -n '/^KREADS-BEGIN/,/^KREADS-END/p' "$d/vm.result" | sed '1d;$d' > "$d/kreads.vm"
while read -r off len; do
    dd if="$d/expect.img" bs=65536 skip="$off" count="$len" \
       iflag=skip_bytes,count_bytes status=none | md5sum | cut -d' ' -f1
done < "$d/vm.data/kreads" > "$d/kreads.host"
cmp "$d/kreads.vm" "$d/kreads.host" || fail "the kernel read wrong data"
bcachefilter-show "$c"
bcachefilter-show --fsck "$c" || fail "fsck of the kernel's cache"
bcachefilter-show --btree -v --json "$c" > "$d/btree.json"
cached="$(kcheck cached "$d/btree.json" --sectors $((data / 512)) \
          --shift 16 --out "$d/cached.json")"
dirty="$(kcheck cached "$d/btree.json" --sectors $((data / 512)) \
         --shift 16 --dirty --out "$d/dirty.json")"
echo "the kernel's cache holds: $cached, dirty: $dirty; the kernel wrote $written sectors"
test "$(echo "$dirty" | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["sectors"])')" \
    = "$written" || fail "the kernel's dirty keys are not the $written sectors it wrote"
kcheck differ "$d/orig.img" "$d/expect.img" --cached "$d/dirty.json" | tee "$d/differ.json"
grep -q '"differ_outside": 0' "$d/differ.json" ||
    fail "some of the kernel's writes are not in dirty keys"

# 3. The filter serves the dirty data from the cache (the copy fails
# writes, so none is written back yet), then writes it back.
cp --sparse=always "$img" "$d/poisoned.img"
bcachesb poison "$d/poisoned.img" 0xA5
"$PYTHON" -c 'import sys; open(sys.argv[1],"wb").write(b"\xa5"*int(sys.argv[2]))' \
    "$d/poison-expect.img" "$data"
kcheck apply-writes "$d/poison-expect.img" "$d/vm.data/kwrites" "$d/vm.data/pat"
cp --sparse=always "$c" "$d/fcache.img"
touch "$d/wfail"
start_remote --filter=error file "$d/poisoned.img" \
    error-pwrite=EIO error-pwrite-rate=1 error-pwrite-file="$d/wfail"
start_proxy p bcache="$d/fcache.img" bcache-format=never bcache-mode=none \
    "${cache_all[@]}" bcache-ctl="$d/ctl"
test "$(nbdio "$p_sock" size)" = "$data" || fail "not the data region"
test "$(ctl_stat "$d/ctl" dirty_data)" = $((written * 512)) ||
    fail "the filter does not count the kernel's $written dirty sectors"
kcheck dump "$p_uri" "$d/filter.img"
bcachefilter-ctl -s "$d/ctl" stats > "$d/stats1"
sed -n '/^\[total\]/,/^\[/p' "$d/stats1" | grep -E '^cache_(bypass_)?(hits|misses) '
grep -E '^(dirty_data|writeback_(bytes|backing_errors)) ' "$d/stats1"
test "$(ctl_stat "$d/ctl" writeback_bytes)" = 0 ||
    fail "the filter wrote back to a copy that fails writes"
test "$(ctl_stat "$d/ctl" writeback_backing_errors)" -ge 1 ||
    fail "the filter did not try to write back in mode none"
echo "----- what the filter served from the kernel's writeback cache -----"
kcheck compare --dump "$d/filter.img" --expect "$d/expect.img" \
    --cached "$d/cached.json" --poison 0xA5 ||
    fail "the filter did not serve the kernel's cached and dirty data right"
test "$(bcachesb show "$d/poisoned.img" state)" = dirty ||
    fail "the filter marked the device clean while the cache holds dirty data"
rm "$d/wfail"
timeout 120 bcachefilter-ctl -s "$d/ctl" flush --timeout 60 ||
    fail "the filter did not write the kernel's dirty data back"
bcachefilter-ctl -s "$d/ctl" stats | grep -E '^(dirty_data|writeback_(bytes|keys_done|backing_errors)) '
test "$(ctl_stat "$d/ctl" writeback_bytes)" = $((written * 512)) ||
    fail "the filter wrote back other than the kernel's $written dirty sectors"
stop_nbdkit "$p_pid"
stop_nbdkit "$remote_pid"
test "$(bcachesb show "$d/poisoned.img" state)" = clean ||
    fail "the filter did not mark the device clean after the writeback"
test "$(bcachesb show "$d/poisoned.img" set_uuid)" = "$set"
dd if="$d/poisoned.img" bs=8192 skip=1 status=none | cmp - "$d/poison-expect.img" ||
    fail "the written-back copy is not the poison with the kernel's writes"
bcachefilter-show --fsck "$d/fcache.img" || fail "fsck after the writeback"
bcachefilter-show --btree -v --json "$d/fcache.img" > "$d/btree.after.json"
left="$(kcheck cached "$d/btree.after.json" --sectors $((data / 512)) \
        --shift 16 --dirty --out "$d/dirty.after.json")"
echo "dirty after the writeback: $left"
test "$(cat "$d/dirty.after.json")" = "[]" || fail "dirty keys are left: $left"

# 4. The device itself, with another copy of the kernel's cache, in the
# filter's default mode: the drain writes it back.
cp --sparse=always "$c" "$d/fcache2.img"
start_remote file "$img"
start_proxy p bcache="$d/fcache2.img" bcache-format=never bcache-ctl="$d/ctl2"
nbdio "$p_sock" size > /dev/null      # the cache opens at the first one
timeout 120 bcachefilter-ctl -s "$d/ctl2" flush --timeout 60 ||
    fail "the drain did not write the kernel's dirty data back"
stop_nbdkit "$p_pid"
stop_nbdkit "$remote_pid"
test "$(bcachesb show "$img" state)" = clean ||
    fail "the device is not clean after the drain"
dd if="$img" bs=8192 skip=1 status=none | cmp - "$d/expect.img" ||
    fail "the device alone does not hold the kernel's writes"
echo "$0: OK: the filter served the kernel's dirty data and wrote it back"
