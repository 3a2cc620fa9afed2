#!/usr/bin/env bash
# bcachefilter kernel test: set up the VM in DIR (kernel.sh's
# kernel_requires runs it, under a lock, when DIR holds no finished
# setup).
#
#   setup.sh DIR
#
# The kernel is the one Debian 12's linux-image-amd64 depends on
# (linux-image-6.1.0-N-amd64), downloaded with apt-get download and
# unpacked with dpkg -x, not installed; depmod finds the dependencies of
# the modules the VM loads (bcache, virtio_pci, virtio_blk), and only
# those and vmlinuz are kept (about 10 MiB of the package's 400).  The
# base initramfs is the static busybox of Debian's busybox-static
# (downloaded and unpacked the same way), those modules in load order
# (modules.list) and tests/kernel/init.  Writes DIR/vmlinuz,
# DIR/base.cpio.gz, DIR/modules.list, DIR/package and, last, DIR/ready
# (the kernel version).
#
# Exit status 77 with a line "SKIP: reason" when the kernel cannot be
# had here (apt knows no such package, or cannot download it); 1 on any
# other failure.
set -euo pipefail

dir="$1"
here="$(cd "$(dirname "$0")" && pwd)"
skip () { echo "SKIP: $*"; exit 77; }

rm -f "$dir/ready"
kernel_package ()
{
    apt-cache depends linux-image-amd64 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1
}
pkg="$(kernel_package)"
if [ -z "$pkg" ] && [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq || true
    pkg="$(kernel_package)"
fi
[ -n "$pkg" ] ||
    skip "apt knows no kernel package behind linux-image-amd64 (run" \
         "apt-get update as root, with access to Debian's archive)"
kv="${pkg#linux-image-}"

rm -rf "$dir/pkg" "$dir/root" "$dir/initramfs" "$dir/busybox"
mkdir -p "$dir/pkg"
download () { (cd "$dir/pkg" && apt-get download "$pkg" busybox-static); }
if ! download; then
    # The lists may name a version the archive no longer has.
    { [ "$(id -u)" -eq 0 ] && apt-get update -qq && download; } ||
        skip "cannot download $pkg and busybox-static (apt-get download" \
             "needs access to Debian's archive)"
fi
deb="$(ls "$dir/pkg/${pkg}_"*.deb | head -1)"

root="$dir/root"
dpkg -x "$deb" "$root"
dpkg -x "$(ls "$dir/pkg/busybox-static_"*.deb | head -1)" "$dir/busybox"
depmod -b "$root" "$kv"
mkdir -p "$dir/initramfs"/{bin,dev,proc,sys,tmp,data,lib/modules}
: > "$dir/modules.list"
for m in bcache virtio_pci virtio_blk; do
    modprobe -S "$kv" -d "$root" --show-depends "$m" |
        awk '$1 == "insmod" { print $2 }'
done | awk '!seen[$0]++' > "$dir/modules.paths"
while read -r ko; do
    cp "$ko" "$dir/initramfs/lib/modules/"
    basename "$ko" >> "$dir/modules.list"
done < "$dir/modules.paths"
grep -q '^bcache\.ko' "$dir/modules.list" ||
    { echo "$pkg has no bcache module"; exit 1; }
cp "$root/boot/vmlinuz-$kv" "$dir/vmlinuz"
echo "$(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version)" > "$dir/package"
rm -rf "$root" "$dir/modules.paths"

cp "$dir/busybox/bin/busybox" "$dir/initramfs/bin/busybox"
rm -rf "$dir/busybox" "$dir/pkg"
ln -s busybox "$dir/initramfs/bin/sh"
cp "$dir/modules.list" "$dir/initramfs/modules.list"
install -m 0755 "$here/init" "$dir/initramfs/init"
(cd "$dir/initramfs" && find . | LC_ALL=C sort |
     cpio -o -H newc --quiet -R 0:0) | gzip -6 > "$dir/base.cpio.gz"
rm -rf "$dir/initramfs"
echo "$kv" > "$dir/ready"
echo "setup.sh: kernel $kv ($(cat "$dir/package")) in $dir"
