# bcachefilter: helpers for the kernel round-trip tests
# (tests/kernel/test-kernel-*.sh).  -*- shell-script -*-
#
# Source it after functions.sh and filter/common.sh:
#
#   source "$(dirname "$0")/../functions.sh"
#   source "$(dirname "$0")/../filter/common.sh"
#   source "$(dirname "$0")/kernel.sh"
#   filter_requires
#   kernel_requires          # skip (77) with the reason if it cannot run
#   tmpdir d
#   ...
#   vm_boot vm "$kerneldir/vm-cache.sh" "$d/cache.img" "$d/backing.img"
#   vm_report vm             # the VM's output and the kernel's bcache lines
#
# The VM is Debian 12's own kernel (the linux-image-6.1.0-N-amd64 that
# linux-image-amd64 depends on, and its bcache.ko) under qemu's TCG (no
# KVM needed), with a busybox initramfs: kernel_requires downloads the
# kernel package and busybox-static once (apt-get download, dpkg -x: they
# are not installed),
# keeps vmlinuz and the modules the VM needs (bcache, virtio_blk and their
# dependencies, found with depmod and modprobe --show-depends) and builds
# the base initramfs, in $KERNEL_TEST_DIR (default: tests/kernel/vm in
# the build tree; reused by later runs; a lock makes parallel tests
# wait for one setup).
#
# A boot gets the base initramfs plus an overlay archive with the case's
# VM script as /case.sh, the VM scripts' helpers (vm-lib.sh) as
# /vm-lib.sh and $d/NAME.data/* as /data/*, and the images as
# virtio disks vda, vdb, ... in order (raw, writes go to the files).  The
# VM's /init (tests/kernel/init) runs the script and sends its output and
# the kernel log back on the second serial port ($d/NAME.result); the
# kernel console is $d/NAME.console.
#
# Environment: KERNEL_TEST_DIR (above), KERNEL_VM_TIMEOUT (seconds one
# boot may take, default 300; qemu runs under timeout and nice).

kerneldir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KERNEL_TEST_DIR="${KERNEL_TEST_DIR:-${abs_top_builddir:-$kerneldir/..}/tests/kernel/vm}"
KERNEL_VM_TIMEOUT="${KERNEL_VM_TIMEOUT:-300}"

# cache_all: the proxy parameters that make the filter cache every
# request a test sends: no sequential bypass and no congestion bypass.
# bcache's default thresholds (a cache read slower than 2 ms, a write
# slower than 20 ms) are passed by a cache file on a machine that runs
# three TCG VMs at once: in CI a first workload then cached too few keys
# for the interior node the kernel must read.  The VM scripts turn the
# kernel's congestion bypass off the same way.
cache_all=(bcache-sequential-cutoff=0 bcache-congested-read-threshold-us=0
           bcache-congested-write-threshold-us=0)

# The packages the test needs, for the skip message (scripts/install-deps
# installs them).
_kernel_packages="qemu-system-x86 kmod cpio bcache-tools"

_kernel_skip ()
{
    echo "$0: test skipped because $*"
    exit 77
}

# kernel_requires
#
# Skip (77) with a clear reason unless the kernel test can run here: the
# commands it needs, and the kernel and initramfs (set up on first use;
# that needs apt-get and access to Debian's archive).  Sets $kernel_version.
kernel_requires ()
{
    local c
    for c in qemu-system-x86_64 cpio gzip depmod modprobe dpkg-deb \
             apt-get apt-cache make-bcache bcache-super-show flock timeout; do
        command -v "$c" > /dev/null ||
            _kernel_skip "'$c' is missing (the kernel test needs the" \
                         "packages $_kernel_packages: scripts/install-deps" \
                         "installs them)"
    done
    mkdir -p "$KERNEL_TEST_DIR" ||
        _kernel_skip "cannot create $KERNEL_TEST_DIR"
    # One setup at a time; a finished one is reused.
    exec 8> "$KERNEL_TEST_DIR/lock"
    flock 8
    if [ ! -f "$KERNEL_TEST_DIR/ready" ] ||
       [ "$kerneldir/init" -nt "$KERNEL_TEST_DIR/ready" ] ||
       [ "$kerneldir/setup.sh" -nt "$KERNEL_TEST_DIR/ready" ]; then
        local st=0 why
        bash "$kerneldir/setup.sh" "$KERNEL_TEST_DIR" \
            > "$KERNEL_TEST_DIR/setup.log" 2>&1 || st=$?
        cat "$KERNEL_TEST_DIR/setup.log"
        if [ "$st" -ne 0 ]; then
            flock -u 8
            why="$(sed -n 's/^SKIP: //p' "$KERNEL_TEST_DIR/setup.log" | tail -1)"
            [ "$st" -eq 77 ] && _kernel_skip "$why"
            fail "setting up the kernel test failed (status $st, see above)"
        fi
    fi
    flock -u 8
    kernel_version="$(cat "$KERNEL_TEST_DIR/ready")"
    echo "$0: kernel $kernel_version ($(cat "$KERNEL_TEST_DIR/package"))," \
         "modules: $(tr '\n' ' ' < "$KERNEL_TEST_DIR/modules.list")"
}

# vm_boot NAME SCRIPT DRIVE...
#
# Boot the VM with SCRIPT as /case.sh and $d/NAME.data/* as /data/*, the
# DRIVEs as vda, vdb, ...; output in $d/NAME.result, kernel console in
# $d/NAME.console.  Fails the test if the VM's log is incomplete (it
# crashed, hung past KERNEL_VM_TIMEOUT, or never started).
vm_boot ()
{
    local name="$1" script="$2" ov="$d/$1.overlay" drives=() dr t0 rc=0
    shift 2
    rm -rf "$ov"
    mkdir -p "$ov/data"
    install -m 0755 "$script" "$ov/case.sh"
    cp "$kerneldir/vm-lib.sh" "$ov/vm-lib.sh"
    [ -d "$d/$name.data" ] && cp -a "$d/$name.data/." "$ov/data/"
    (cd "$ov" && find . | LC_ALL=C sort | cpio -o -H newc --quiet -R 0:0) |
        gzip -1 > "$d/$name.overlay.cpio.gz"
    cat "$KERNEL_TEST_DIR/base.cpio.gz" "$d/$name.overlay.cpio.gz" > "$d/$name.initrd"
    for dr in "$@"; do
        drives+=(-drive "file=$dr,format=raw,if=virtio,cache=unsafe")
    done
    : > "$d/$name.console"
    : > "$d/$name.result"
    t0=$SECONDS
    # no_timer_check: under TCG on a loaded host the kernel's check that
    # the 8254 timer reaches the IO-APIC can miss its ticks, and the boot
    # panics ("IO-APIC + timer doesn't work!"; seen with the six kernel
    # tests beside four busy loops).  The timer works; only the check is
    # too impatient for an emulated CPU.
    timeout -k 10 "$KERNEL_VM_TIMEOUT" nice -n 10 qemu-system-x86_64 \
        -accel tcg -m 768 -smp 1 -nographic -no-reboot -monitor none \
        -nic none -kernel "$KERNEL_TEST_DIR/vmlinuz" -initrd "$d/$name.initrd" \
        -append "console=ttyS0 panic=-1 quiet no_timer_check kt.timeout=$((KERNEL_VM_TIMEOUT - 30))" \
        -serial "file:$d/$name.console" -serial "file:$d/$name.result" \
        "${drives[@]}" > "$d/$name.qemu.log" 2>&1 || rc=$?
    echo "$0: $name: the VM ran $((SECONDS - t0)) s (qemu exit status $rc)"
    if ! grep -q '@@KT-END@@' "$d/$name.result"; then
        cat "$d/$name.qemu.log"
        tail -40 "$d/$name.console"
        fail "$name: the VM did not finish (qemu exit status $rc)"
    fi
    if grep -q '@@KT-TIMEOUT' "$d/$name.result"; then
        vm_report "$name"
        fail "$name: the VM's script did not finish in time"
    fi
}

# vm_report NAME: the VM script's output, then the kernel's bcache lines
# (and any warning or oops).
vm_report ()
{
    echo "----- $1: the VM's output -----"
    sed -n '/@@KT-BEGIN/,/@@KT-DMESG@@/p' "$d/$1.result" | grep -v '@@KT-DMESG@@'
    echo "----- $1: the kernel's bcache lines -----"
    vm_kernel_lines "$1"
}

# vm_kernel_lines NAME: the kernel log lines about bcache, and any
# warning, oops or I/O error.
vm_kernel_lines ()
{
    sed -n '/@@KT-DMESG@@/,/@@KT-END@@/p' "$d/$1.result" |
        grep -E 'bcache|WARNING:|BUG:|Call Trace|Oops|RIP:|I/O error' || true
}

# vm_trouble NAME: the kernel lines that look like trouble (bcache
# errors, warnings, oopses), minus the expected "invalidating existing
# data" of a first registration.  Empty if none.  The words are looked
# for with the lines' uuids taken out: a set uuid such as d500fbad-...
# holds "bad" one time in a few hundred.
vm_trouble ()
{
    sed -n '/@@KT-DMESG@@/,$p' "$d/$1.result" | awk '
        BEGIN {
            h = "[0-9a-f]"; h4 = h h h h
            uuid = h4 h4 "-" h4 "-" h4 "-" h4 "-" h4 h4 h4
        }
        { l = $0; gsub(uuid, "", l) }
        l ~ /bcache.*(error|invalid|bad|corrupt|fail|stale|incorrect|mismatch|unable|cannot|Couldn|too small)|WARNING:|BUG:|Call Trace|Oops|I\/O error/ &&
        l !~ /run_cache_set\(\) invalidating existing data/'
}

# vm_said NAME TEXT: did the VM's script print a line "RESULT TEXT..."?
vm_said ()
{
    grep -q "^RESULT $2" "$d/$1.result"
}

# vm_value NAME KEY: the value of the VM script's line "RESULT KEY VALUE".
vm_value ()
{
    sed -n "s/^RESULT $2 //p" "$d/$1.result" | head -1
}

# kcheck ARGS...: tests/kernel/kcheck.py with the python that has libnbd.
kcheck ()
{
    "$PYTHON" "$kerneldir/kcheck.py" "$@"
}

# bcachesb ARGS...: tests/filter/bcachesb.py (superblocks in images).
bcachesb ()
{
    "$PYTHON" "$filterdir/bcachesb.py" "$@"
}
