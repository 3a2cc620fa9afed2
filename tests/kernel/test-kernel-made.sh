#!/usr/bin/env bash
# bcachefilter: the filter serves a cache a real Linux kernel made and
# wrote (issue 16; tests/kernel/README.md).
#
#  1. make-bcache -C makes a cache (512 KiB buckets, 1024 of them) and
#     make-bcache -B a backing device; the kernel registers both (its
#     first registration of the cache), attaches the device, writes 32
#     ranges through /dev/bcache0 (writethrough) and reads 32 others twice
#     (a miss that caches the device's data, then a hit), and stops.
#  2. On the host: the device holds the writes, and its superblock says
#     attached to that cache set, clean (the kernel's attach); the kernel
#     read the right data; bcachefilter-show decodes and checks the cache.
#  3. The filter serves the kernel's cache in front of a copy of the
#     device whose data region is poisoned (0xA5; its superblock kept): it
#     takes the device's uuid from that superblock and the kernel's uuid
#     entry (which records no size) as the export's.  Every sector the
#     kernel's btree holds must read as what the kernel cached, every
#     other as 0xA5.
#  4. The same as a plain export of the whole device
#     (bcache-backing-device=never, bcache-backing-uuid= the device's): the
#     kernel's entry, which records no size, is this export's (issue 16 B).

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
kcheck pattern "$img" 8192 "$data" made
set="$(bcachesb show "$c" set_uuid)"

mkdir "$d/vm.data"
kcheck kwrites "$d/ranges" "$d/vm.data/pat" --n 64 --size "$data" --seed made
head -32 "$d/ranges" > "$d/vm.data/kwrites"
tail -32 "$d/ranges" > "$d/vm.data/kreads"
dd if="$img" of="$d/expect.img" bs=8192 skip=1 status=none
kcheck apply-writes "$d/expect.img" "$d/vm.data/kwrites" "$d/vm.data/pat"
printf 'CSET=%s\n' "$set" > "$d/vm.data/params"

vm_boot vm "$kerneldir/vm-make.sh" "$c" "$img"
vm_report vm
vm_said vm "cset-appeared $set" || fail "the kernel did not register the cache"
vm_said vm "attached" || fail "the kernel did not attach the backing device"
test "$(vm_value vm kwrites-mismatches)" = 0 ||
    fail "the kernel read back other data than it wrote"
vm_said vm "kreads-stable" || fail "the kernel's second reads differ"
vm_said vm "stopped-cleanly" || fail "the kernel did not stop cleanly"
trouble="$(vm_trouble vm)"
[ -z "$trouble" ] || fail "the kernel complained: $trouble"

# 2. What the kernel left.
dd if="$img" bs=8192 skip=1 status=none | cmp - "$d/expect.img" ||
    fail "the backing device does not hold the kernel's writes"
sed -n '/^KREADS-BEGIN/,/^KREADS-END/p' "$d/vm.result" | sed '1d;$d' > "$d/kreads.vm"
while read -r off len; do
    dd if="$d/expect.img" bs=65536 skip="$off" count="$len" \
       iflag=skip_bytes,count_bytes status=none | md5sum | cut -d' ' -f1
done < "$d/vm.data/kreads" > "$d/kreads.host"
cmp "$d/kreads.vm" "$d/kreads.host" || fail "the kernel read wrong data"
test "$(bcachesb show "$img" set_uuid)" = "$set" ||
    fail "the kernel did not attach the device's superblock to its set"
test "$(bcachesb show "$img" state)" = clean
bcachefilter-show "$c"
bcachefilter-show --fsck "$c" || fail "fsck of the kernel's cache"
bcachefilter-show --journal "$c" | tail -3
bcachefilter-show --btree -v --json "$c" > "$d/btree.json"
bcachefilter-show --btree "$c" | tail -1
cached="$(kcheck cached "$d/btree.json" --sectors $((data / 512)) \
          --shift 16 --out "$d/cached.json")"
echo "the kernel's cache holds: $cached"

# 3. The filter serves it, in front of the poisoned copy.
cp --sparse=always "$img" "$d/poisoned.img"
bcachesb poison "$d/poisoned.img" 0xA5
cp --sparse=always "$c" "$d/fcache.img"
start_remote file "$d/poisoned.img"
start_proxy p bcache="$d/fcache.img" bcache-format=never bcache-mode=none \
    "${cache_all[@]}" bcache-ctl="$d/ctl"
test "$(nbdio "$p_sock" size)" = "$data" || fail "not the data region"
kcheck dump "$p_uri" "$d/filter.img"
bcachefilter-ctl -s "$d/ctl" stats | sed -n '/^\[total\]/,/^\[/p' |
    grep -E '^cache_(bypass_)?(hits|misses) '
stop_nbdkit "$p_pid"
echo "----- what the filter served from the kernel's cache -----"
kcheck compare --dump "$d/filter.img" --expect "$d/expect.img" \
    --cached "$d/cached.json" --poison 0xA5 ||
    fail "the filter did not serve the kernel's cached data right"
stop_nbdkit "$remote_pid"

# 4. The same cache served as a plain export of the whole device
# (bcache-backing-device=never) under the device's uuid: the kernel's uuid
# entry records no size (issue 16 B), and the keys are the whole device's
# sectors.  Every byte of this copy is poisoned, superblock included.
buuid="$(bcachesb show "$img" uuid)"
head -c 8192 /dev/zero > "$d/expect-whole.img"
cat "$d/expect.img" >> "$d/expect-whole.img"
truncate -s $((data + 8192)) "$d/all-poisoned.img"
"$PYTHON" -c 'import sys; f=open(sys.argv[1],"r+b"); f.write(b"\xa5"*int(sys.argv[2]))' \
    "$d/all-poisoned.img" $((data + 8192))
kcheck cached "$d/btree.json" --sectors $((data / 512 + 16)) \
    --out "$d/cached-whole.json" > /dev/null
cp --sparse=always "$c" "$d/fcache.img"
start_remote file "$d/all-poisoned.img"
start_proxy p bcache="$d/fcache.img" bcache-format=never bcache-mode=none \
    "${cache_all[@]}" bcache-backing-device=never \
    bcache-backing-uuid="$buuid"
test "$(nbdio "$p_sock" size)" = $((data + 8192)) || fail "not the whole device"
kcheck dump "$p_uri" "$d/filter-whole.img"
stop_nbdkit "$p_pid"
echo "----- the same, as a plain export of the whole device -----"
kcheck compare --dump "$d/filter-whole.img" --expect "$d/expect-whole.img" \
    --cached "$d/cached-whole.json" --poison 0xA5 ||
    fail "the filter did not serve the kernel's cache as a plain export"
echo "$0: OK"
