#!/usr/bin/env bash
# bcachefilter: a bcache backing device (make-bcache -B) as the export.
#
# The remote is nbdkit's file plugin on a 64 MiB image made by make-bcache
# -B (data from byte 8192).  The filter must serve it as the kernel's
# bcache serves it (nbdkit-bcachefilter-filter(1), BCACHE BACKING
# DEVICES):
#
#  1. Clients see the data region: 8 KiB less; a write at client offset X
#     lands at byte X + 8192 of the image; the superblock is never
#     touched by a client; block status is the image's, shifted (the
#     superblock's page is data in the image, but not in the client's
#     view).  The superblock then says: attached to the cache's set,
#     clean.  After a restart the data is served from the cache.
#  2. bcache-backing-device=never serves the image whole (the old
#     behaviour); with the device's uuid as bcache-backing-uuid the same
#     cache serves it, its keys being backing sectors.
#  3. bcache-backing-uuid= that is not the device's is refused.
#  4. A device written meanwhile without this cache, and then marked
#     attached to another set (clean) or detached: the filter serves what
#     the image holds, not its old cached copy, and attaches it again.
#  5. A device that another cache set holds dirty data for is refused,
#     and a new cache file gets no keys for it.  One that this cache's
#     own set holds dirty data for (a kernel's writeback cache, or ours)
#     is served: with nothing dirty in the cache, it is made clean at
#     once; switched to writeback, it is marked dirty before the first
#     dirty write and stays dirty across a clean stop; a writethrough
#     restart serves that dirty data, writes it back to the device and
#     marks the device clean.
#  6. bcachefilter-ctl detach does what the kernel's detach does: the
#     dirty data reaches the device, whose superblock then names no cache
#     set (state none); the next start attaches it afresh, serving what
#     the device holds, not the old cached copy.
#  7. A damaged backing superblock is refused, naming
#     bcache-backing-device=never.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires command -v make-bcache
requires cmp --version
requires truncate --version

tmpdir d
F=(--filter="$BCACHEFILTER_SO")
sb () { "$PYTHON" "$filterdir/bcachesb.py" "$@"; }
M=$((1024 * 1024))

img="$d/bdev.img"
truncate -s 64M "$img"
make-bcache -B -w 4k "$img" > /dev/null
dev_uuid="$(sb show "$img" uuid)"
cp "$img" "$d/bdev.orig"
start_remote file "$img"

# refused_at_connect LOG REGEXP NBDKIT-ARGS...: a cache that does not
# hold its export yet is opened at the first connection, which can read
# the export (lifecycle.h): that connection must be refused, nbdkit must
# shut down, and its messages (in LOG) match REGEXP.  The client is
# nbdio.py, run by --run: nbdkit exits with its status.
refused_at_connect ()
{
    local log="$1" re="$2" st=0
    shift 2
    timeout 60 nbdkit -U - "$@" --run "'$PYTHON' '$filterdir/nbdio.py' \$unixsocket size" \
        > "$log" 2>&1 || st=$?
    cat "$log"
    if [ "$st" -eq 0 ] || [ "$st" -eq 124 ] || [ "$st" -ge 128 ]; then
        fail "nbdkit $*: the connection was served, or nbdkit did not stop (status $st)"
    fi
    grep -Eq -- "$re" "$log" || fail "nbdkit $*: no message matching '$re'"
    grep -q "shutting down" "$log" || fail "nbdkit $*: the server was not shut down"
}

# cset CTL: the cache set uuid of the proxy on control socket CTL.
cset ()
{
    bcachefilter-ctl -s "$1" show super --json |
        "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["cset_uuid"])'
}

# ---------------------------------------------------------------------
# 1. The data region, at backing sectors.
start_proxy p bcache="$d/cache" bcache-size=64M bcache-ctl="$d/ctl"
test "$(nbdio "$p_sock" size)" = $((64 * M - 8192)) ||
    fail "the proxy does not serve the data region"
set_uuid="$(cset "$d/ctl")"
test "$(sb show "$img" state)" = clean || fail "not marked clean on attach"
test "$(sb show "$img" set_uuid)" = "$set_uuid" ||
    fail "the superblock does not name the cache set"
test "$(sb show "$img" csum_ok)" = True
test "$(sb show "$img" uuid)" = "$dev_uuid"

head -c 256K /dev/urandom > "$d/a"
nbdio "$p_sock" wfile $((1 * M)) "$d/a"
nbdio "$p_sock" fill 0 4096 0x5a
dd if="$img" bs=4096 skip=$(((1 * M + 8192) / 4096)) count=64 status=none |
    cmp - "$d/a" || fail "a client write is not at byte X + 8192 of the image"
cmp -n 4096 <(dd if="$img" bs=4096 skip=2 count=1 status=none) \
    <(head -c 4096 /dev/zero | tr '\0' '\132') ||
    fail "client offset 0 is not byte 8192 of the image"
# The image differs from the original in its first 8 KiB only where the
# attach wrote (csum, set_uuid, flags): compare everything else.
"$PYTHON" - "$img" "$d/bdev.orig" <<'EOF'
import sys
a = open(sys.argv[1], "rb").read(8192)
b = open(sys.argv[2], "rb").read(8192)
allowed = set(range(4096, 4104)) | set(range(4096 + 56, 4096 + 72)) | \
          set(range(4096 + 104, 4096 + 112))
bad = [i for i in range(8192) if a[i] != b[i] and i not in allowed]
sys.exit(f"the superblock area changed at bytes {bad[:8]}" if bad else 0)
EOF

# Block status, shifted: the image's superblock page is allocated, the
# client's first 8 KiB are not that page.
"$PYTHON" - "$p_sock" "$remote_sock" <<'EOF'
import sys, nbd
def status(sock, off, length):
    h = nbd.NBD()
    h.add_meta_context("base:allocation")
    h.connect_unix(sock)
    ext = []
    def cb(meta, o, entries, err):
        for i in range(0, len(entries), 2):
            ext.append((entries[i], entries[i + 1]))
    h.block_status(length, off, cb)
    h.shutdown()
    return ext
M = 1 << 20
# Where the remote says "hole" at backing offset 8192 + X, the proxy must
# say "hole" at X; where the remote says data, so must the proxy.
r = status(sys.argv[2], 8192, M)
p = status(sys.argv[1], 0, M)
def flags_at(ext, x):
    pos = 0
    for n, f in ext:
        if pos <= x < pos + n:
            return f & 1
        pos += n
    return None
for x in range(0, M, 4096):
    fr, fp = flags_at(r, x), flags_at(p, x)
    if fr is not None and fp is not None and fr != fp:
        sys.exit(f"block status at client {x}: proxy hole={fp}, image at "
                 f"{x + 8192} hole={fr} (remote {r[:4]}, proxy {p[:4]})")
print("block status: proxy", p[:4], "remote", r[:4])
EOF

stop_nbdkit "$p_pid"
start_proxy p bcache="$d/cache" bcache-ctl="$d/ctl"
# The cache of a backing device opens at the first connection.
test "$(nbdio "$p_sock" size)" = $((64 * M - 8192)) || fail "restart: wrong size"
before="$(ctl_stat "$d/ctl" cache_hits)"
nbdio "$p_sock" rfile $((1 * M)) 256K "$d/back"
cmp "$d/back" "$d/a" || fail "wrong data after a restart"
test "$(ctl_stat "$d/ctl" cache_hits)" -gt "$before" ||
    fail "nothing served from the cache after a restart"
stop_nbdkit "$p_pid"

# ---------------------------------------------------------------------
# 2. bcache-backing-device=never: the whole image.  Under the derived
# identity the cache (which holds the device) is another export's ...
must_refuse "$d/never.err" 'another export' "${F[@]}" nbd socket="$remote_sock" \
    bcache="$d/cache" bcache-backing-device=never
# ... under the device's uuid it is this one, its keys backing sectors.
start_proxy p bcache="$d/cache" bcache-backing-device=never \
    bcache-backing-uuid="$dev_uuid" bcache-ctl="$d/ctl"
test "$(nbdio "$p_sock" size)" = $((64 * M)) || fail "never: not the whole image"
before="$(ctl_stat "$d/ctl" cache_hits)"
nbdio "$p_sock" rfile $((1 * M + 8192)) 256K "$d/back"
cmp "$d/back" "$d/a" || fail "never: wrong data"
test "$(ctl_stat "$d/ctl" cache_hits)" -gt "$before" ||
    fail "never: the keys at backing sectors were not hits"
stop_nbdkit "$p_pid"

# ---------------------------------------------------------------------
# 3. A uuid that is not the device's.
refused_at_connect "$d/uuid.err" 'bcache-backing-uuid=.*but the export is bcache backing device' \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/cache" \
    bcache-backing-uuid=0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0

# ---------------------------------------------------------------------
# 4. Written meanwhile without this cache.
other=5e133599-ba5d-4f2b-a3df-5278658848c7
for how in "$other clean" "00000000-0000-0000-0000-000000000000 none"; do
    read -r set state <<< "$how"
    head -c 256K /dev/urandom > "$d/b"
    dd if="$d/b" of="$img" bs=4096 seek=$(((1 * M + 8192) / 4096)) \
       conv=notrunc status=none
    sb set-state "$img" "$set" "$state"
    timeout 60 nbdkit -U - "${F[@]}" nbd socket="$remote_sock" \
        bcache="$d/cache" --run "'$PYTHON' '$filterdir/nbdio.py' \$unixsocket \
        rfile $((1 * M)) 256K '$d/back'" > "$d/away.$state.log" 2>&1 ||
        { cat "$d/away.$state.log"; fail "a device $state for set $set: not served"; }
    cat "$d/away.$state.log"
    cmp "$d/back" "$d/b" ||
        fail "a device $state for set $set: the cache served its old data"
    test "$(sb show "$img" set_uuid)" = "$set_uuid" ||
        fail "a device $state for set $set: not attached to the cache again"
    test "$(sb show "$img" state)" = clean
    cp "$d/b" "$d/a"
done
grep -q "backing device $dev_uuid was attached to cache set $other" \
    "$d/away.clean.log" || fail "no warning naming the set the device was taken from"

# ---------------------------------------------------------------------
# 5. Dirty for another set: refused, and a new cache is not attached to
# it.  (A new cache is formatted before any connection, with no export,
# so that the control socket works; the device is read, and refused, at
# the first connection: the cache stays empty and the device untouched.)
sb set-state "$img" "$other" dirty
refused_at_connect "$d/dirty.err" "cache set $other holds dirty data" \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/cache"
refused_at_connect "$d/dirty2.err" "holds dirty data" \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/new" bcache-size=64M
if [ -e "$d/new" ] && ! cmp -s "$d/new" <(head -c 64M /dev/zero); then
    bcachefilter-show --fsck --json "$d/new" > "$d/new.fsck" ||
        { cat "$d/new.fsck"; fail "the new cache does not check clean"; }
    test "$("$PYTHON" "$filterdir/stat.py" keys < "$d/new.fsck")" = 0 ||
        fail "the new cache holds keys for a device another set holds dirty data for"
fi
test "$(sb show "$img" set_uuid)" = "$other" && test "$(sb show "$img" state)" = dirty ||
    fail "the superblock of a device another set holds dirty data for was changed"
# Dirty for this cache's own set (a kernel's writeback cache, or ours):
# served, and clean again once nothing is dirty (writethrough: at once).
sb set-state "$img" "$set_uuid" dirty
start_proxy p bcache="$d/cache" bcache-ctl="$d/ctl"
nbdio "$p_sock" rfile $((1 * M)) 64K "$d/back"
test "$(sb show "$img" state)" = clean ||
    fail "dirty for our own set, nothing dirty in the cache: not made clean"
# Writeback: dirty before the first dirty write, and it stays so across a
# clean stop while dirty data is in the cache; a writethrough start
# drains it and makes the device clean.
bcachefilter-ctl -s "$d/ctl" set cache_mode writeback
test "$(sb show "$img" state)" = dirty ||
    fail "writeback mode on a backing device: its superblock is not dirty"
head -c 64K /dev/urandom > "$d/wb"
nbdio "$p_sock" wfile $((2 * M)) "$d/wb"
stop_nbdkit "$p_pid"
test "$(sb show "$img" state)" = dirty ||
    fail "a clean stop with dirty data: the device is not dirty"
start_proxy p bcache="$d/cache" bcache-ctl="$d/ctl"
nbdio "$p_sock" rfile $((2 * M)) 64K "$d/back"
cmp "$d/back" "$d/wb" || fail "the dirty data was not served after a restart"
for (( i = 0; i < 300; i++ )); do
    [ "$(ctl_stat "$d/ctl" dirty_data)" -eq 0 ] && break
    sleep 0.1
done
stop_nbdkit "$p_pid"
test "$(sb show "$img" state)" = clean ||
    fail "after the writeback drained: the device is not clean"
cmp <(dd if="$img" bs=4096 skip=$(((2 * M + 8192) / 4096)) count=16 status=none) \
    "$d/wb" || fail "the dirty data did not reach the device"

# ---------------------------------------------------------------------
# 6. bcachefilter-ctl detach, as the kernel's detach: the dirty data
# written back, the superblock says no cache set, state none; a restart
# on the same cache attaches it afresh and serves what the device holds.
start_proxy p bcache="$d/cache" bcache-ctl="$d/ctl" bcache-mode=writeback
nbdio "$p_sock" size > /dev/null      # the cache opens at the first one
bcachefilter-ctl -s "$d/ctl" set writeback_running 0
head -c 64K /dev/urandom > "$d/wb2"
nbdio "$p_sock" wfile $((3 * M)) "$d/wb2"
test "$(sb show "$img" state)" = dirty || fail "writeback: the device is not dirty"
bcachefilter-ctl -s "$d/ctl" detach | tee "$d/detach.out"
grep -q "backing device $dev_uuid is detached from this cache set" \
    "$d/detach.out" || fail "detach: the final line does not name the device"
test "$(sb show "$img" state)" = none &&
    test "$(sb show "$img" set_uuid)" = 00000000-0000-0000-0000-000000000000 ||
    fail "after a detach the superblock still names a cache set"
test "$(sb show "$img" csum_ok)" = True
cmp <(dd if="$img" bs=4096 skip=$(((3 * M + 8192) / 4096)) count=16 status=none) \
    "$d/wb2" || fail "the detach did not write the dirty data to the device"
stop_nbdkit "$p_pid"
printf 'x%.0s' $(seq 4096) | dd of="$img" bs=4096 seek=$(((3 * M + 8192) / 4096)) \
    conv=notrunc status=none
start_proxy p bcache="$d/cache" bcache-ctl="$d/ctl"
nbdio "$p_sock" check $((3 * M)) 4096 0x78 ||
    fail "after a detach and a restart the cache served its old copy"
test "$(sb show "$img" state)" = clean &&
    test "$(sb show "$img" set_uuid)" = "$(cset "$d/ctl")" ||
    fail "after a detach, a restart did not attach the device again"
stop_nbdkit "$p_pid"

# ---------------------------------------------------------------------
# 7. A damaged superblock.
printf 'x' | dd of="$img" bs=1 seek=$((4096 + 80)) conv=notrunc status=none
refused_at_connect "$d/damaged.err" 'bcache-backing-device=never' \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/cache"
grep -q 'checksum' "$d/damaged.err" || fail "the refusal does not say what is wrong"

echo "$0: OK"
