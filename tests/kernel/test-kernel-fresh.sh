#!/usr/bin/env bash
# bcachefilter: a real Linux kernel registers the caches bcachefilter
# formats (issue 16; tests/kernel/README.md).
#
# Two caches made by bcachefilter-format at the smallest sizes it makes
# with its defaults: 257 MiB of 512 KiB buckets (514 buckets: the kernel
# registers none of 512 or fewer), and 64 MiB, for which the default
# bucket shrinks to 64 KiB (1024 buckets).  Debian's kernel must register
# both without a complaint, run GC on them and stop them cleanly; then
# bcachefilter-show --fsck finds both clean and the filter opens them.

source "$(dirname "$0")/../functions.sh"
source "$(dirname "$0")/../filter/common.sh"
source "$(dirname "$0")/kernel.sh"
set -e
set -x

filter_requires
kernel_requires
tmpdir d

bcachefilter-format --size 257M "$d/a.img"
bcachefilter-format --size 64M "$d/b.img" 2> "$d/b.err"
cat "$d/b.err"
grep -q "buckets of 64 KiB instead of the default" "$d/b.err" ||
    fail "no warning about the smaller buckets"
test "$(bcachesb show "$d/a.img" nbuckets)" = 514
test "$(bcachesb show "$d/b.img" nbuckets)" = 1024
seta="$(bcachesb show "$d/a.img" set_uuid)"
setb="$(bcachesb show "$d/b.img" set_uuid)"

mkdir "$d/vm.data"
printf 'CACHES="/dev/vda:%s /dev/vdb:%s"\nBDEV=\nDUMP=\nKWRITES=0\nGC=1\n' \
       "$seta" "$setb" > "$d/vm.data/params"
vm_boot vm "$kerneldir/vm-cache.sh" "$d/a.img" "$d/b.img"
vm_report vm
vm_said vm "cset-appeared $seta" || fail "the kernel did not register $seta"
vm_said vm "cset-appeared $setb" || fail "the kernel did not register $setb"
vm_said vm "stopped-cleanly" || fail "the cache sets did not stop cleanly"
trouble="$(vm_trouble vm)"
[ -z "$trouble" ] || fail "the kernel complained: $trouble"

# After the kernel: clean, and still ours.
start_remote memory 64M
for c in a b; do
    bcachefilter-show --fsck "$d/$c.img" || fail "$c.img: fsck after the kernel"
    start_proxy p bcache="$d/$c.img" bcache-format=never
    test "$(nbdio "$p_sock" size)" = $((64 << 20))
    stop_nbdkit "$p_pid"
done
echo "$0: OK"
