#!/usr/bin/env bash
# bcachefilter: the filter's writeback cache with dirty data, stopped
# cleanly, written back by a real Linux kernel (issue 16;
# tests/kernel/README.md).
#
#  1. The filter, in bcache-mode=writeback with writeback_running 0, in
#     front of a bcache backing device (make-bcache -B, behind nbdkit's
#     file plugin), caches a random workload (64 KiB buckets, small
#     writes: a btree of two levels) and is stopped cleanly (SIGTERM)
#     with all the writes still dirty.
#  2. On the host: the device's superblock says attached to the filter's
#     cache set, dirty (marked before the first write was acknowledged);
#     its data region lacks the writes, and every sector it lacks is in
#     a dirty key: the device with the cache's dirty data laid over it
#     is exactly what the client wrote.
#  3. The kernel registers the device (its superblock must read dirty,
#     and no /dev/bcache0 appear without the cache set) and then the
#     cache: it attaches the pair and reads /dev/bcache0
#     whole while its writeback starts at bcache's first rate (most of
#     the dirty data is still dirty when the read ends, and the device
#     lacks it: read from the cache), then writes back at full speed,
#     waits until the device's state is clean, and stops without
#     detaching.  What it read must be what the client wrote.  (Without
#     the dirty mark the kernel counts the dirty data but never writes it
#     back, and the device stays without the writes.)
#  4. After the kernel: the superblock says clean (still attached to the
#     set); the device's data region alone holds everything the client
#     wrote; the cache the kernel left checks clean with no dirty key,
#     and the filter serves from it exactly what the client wrote.

source "$(dirname "$0")/../functions.sh"
source "$(dirname "$0")/../filter/common.sh"
source "$(dirname "$0")/kernel.sh"
set -e
set -x

filter_requires
kernel_requires
tmpdir d

data=$((64 << 20))
img="$d/bdev.img" c="$d/cache.img"
truncate -s $((data + 8192)) "$img"
make-bcache -B -w 4k "$img" > /dev/null
kcheck pattern "$img" 8192 "$data" used-wb
dd if="$img" of="$d/mirror.img" bs=8192 skip=1 status=none

# 1. The filter's turn: everything the client writes stays dirty.
start_remote file "$img"
start_proxy p bcache="$c" bcache-size=256M bcache-bucket-size=64K \
    bcache-mode=writeback "${cache_all[@]}" bcache-ctl="$d/ctl"
test "$(nbdio "$p_sock" size)" = "$data" || fail "not the data region"
bcachefilter-ctl -s "$d/ctl" set writeback_running 0
test "$(bcachesb show "$img" state)" = dirty ||
    fail "writeback mode: the device is not dirty before the first write"
kcheck workload "$p_uri" --mirror "$d/mirror.img" --log "$d/ops.log" \
    --ops 3000 --seed used-wb --max 8192 ||
    fail "the workload read wrong data"
bcachefilter-ctl -s "$d/ctl" stats |
    grep -E '^(btree_depth|btree_keys|inserts|dirty_data|writeback_(bytes|cutoff_writes)) '
test "$(ctl_stat "$d/ctl" btree_depth)" -ge 2 ||
    fail "the btree has no interior node for the kernel to read"
test "$(ctl_stat "$d/ctl" writeback_bytes)" = 0 ||
    fail "the filter wrote back with writeback_running 0"
fdirty="$(ctl_stat "$d/ctl" dirty_data)"
stop_nbdkit "$p_pid"
stop_nbdkit "$remote_pid"

# 2. What the filter left: the device lacks the writes, the cache has them.
set="$(bcachesb show "$c" set_uuid)"
test "$(bcachesb show "$img" set_uuid)" = "$set" ||
    fail "the backing device is not attached to the cache set"
test "$(bcachesb show "$img" state)" = dirty ||
    fail "a clean stop with dirty data: the device is not dirty"
bcachefilter-show --fsck "$c" || fail "fsck of the filter's cache"
bcachefilter-show --btree -v --json "$c" > "$d/btree.json"
bcachefilter-show --btree "$c" | tail -1
kcheck cached "$d/btree.json" --sectors $((data / 512)) --shift 16 \
    --out "$d/cached.json"
dirty="$(kcheck cached "$d/btree.json" --sectors $((data / 512)) --shift 16 \
         --dirty --out "$d/dirty.json")"
echo "the filter's dirty keys: $dirty ($fdirty bytes by its count)"
dd if="$img" of="$d/before.img" bs=8192 skip=1 status=none
kcheck differ "$d/before.img" "$d/mirror.img" --cached "$d/dirty.json" |
    tee "$d/lacks.json"
lacks="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["differ"])' "$d/lacks.json")"
test "$lacks" -gt 0 || fail "the device already holds every write"
grep -q '"differ_outside": 0' "$d/lacks.json" ||
    fail "the device lacks writes that are in no dirty key"
cp "$d/before.img" "$d/overlay.img"
kcheck dirty-overlay "$d/btree.json" "$c" "$d/overlay.img" \
    --sectors $((data / 512)) --shift 16
cmp "$d/overlay.img" "$d/mirror.img" ||
    fail "the device with the cache's dirty data is not what the client wrote"

# 3. The kernel's turn: it attaches the dirty pair and writes back.
cp --sparse=always "$c" "$d/vmcache.img"
truncate -s "$data" "$d/dump.img"
mkdir -p "$d/vm.data"
printf 'CACHES="/dev/vda:%s"\nBDEV=/dev/vdb\nDUMP=/dev/vdc\nWRITEBACK=1\n' \
       "$set" > "$d/vm.data/params"
vm_boot vm "$kerneldir/vm-cache.sh" "$d/vmcache.img" "$img" "$d/dump.img"
vm_report vm
vm_said vm "bdev-waiting dirty" ||
    fail "the kernel does not read the device's superblock as dirty"
vm_said vm "bcache0-before-cache absent" ||
    fail "the kernel ran the dirty device without its cache set"
vm_said vm "cset-appeared $set" || fail "the kernel did not register the cache"
vm_said vm "attached" || fail "the kernel did not attach the backing device"
test "$(vm_value vm bcache0-sectors)" = $((data / 512)) ||
    fail "bcache0 is not the data region"
vm_said vm "wb-clean" || fail "the kernel did not write the dirty data back"
vm_said vm "stopped-cleanly" || fail "the kernel did not stop cleanly"
trouble="$(vm_trouble vm)"
[ -z "$trouble" ] || fail "the kernel complained: $trouble"
echo "the kernel's dirty_data at attach: $(vm_value vm dirty-data-at-attach)," \
     "after its dump: $(vm_value vm dirty-data-before-writeback)," \
     "after: $(vm_value vm dirty-data-after); the filter's: $fdirty bytes"
cmp "$d/dump.img" "$d/mirror.img" ||
    fail "the kernel did not read what the client wrote"

# 4. The device alone holds every write.
test "$(bcachesb show "$img" state)" = clean ||
    fail "the kernel did not mark the device clean"
test "$(bcachesb show "$img" set_uuid)" = "$set" ||
    fail "the device is no longer attached to the cache set"
dd if="$img" of="$d/after.img" bs=8192 skip=1 status=none
echo "----- what the kernel wrote back -----"
kcheck differ "$d/before.img" "$d/after.img" --cached "$d/dirty.json" |
    tee "$d/wrote.json"
grep -q "\"differ\": $lacks," "$d/wrote.json" &&
    grep -q '"differ_outside": 0' "$d/wrote.json" ||
    fail "the kernel did not write back exactly the $lacks sectors the device lacked"
cmp "$d/after.img" "$d/mirror.img" ||
    fail "the device alone does not hold what the client wrote"
bcachefilter-show --fsck "$d/vmcache.img" || fail "fsck after the kernel"
bcachefilter-show --btree -v --json "$d/vmcache.img" > "$d/btree.after.json"
left="$(kcheck cached "$d/btree.after.json" --sectors $((data / 512)) \
        --shift 16 --dirty --out "$d/dirty.after.json")"
echo "dirty after the kernel: $left"
test "$(cat "$d/dirty.after.json")" = "[]" || fail "dirty keys are left: $left"
start_remote file "$img"
start_proxy p bcache="$d/vmcache.img" bcache-format=never \
    bcache-mode=none "${cache_all[@]}"
kcheck dump "$p_uri" "$d/filter.img"
stop_nbdkit "$p_pid"
stop_nbdkit "$remote_pid"
cmp "$d/filter.img" "$d/mirror.img" ||
    fail "the filter does not serve what the client wrote from the cache the kernel left"
echo "$0: OK: the kernel wrote the filter's dirty data back"
