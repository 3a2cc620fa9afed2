#!/usr/bin/env bash
# bcachefilter: bad input never corrupts (I4) — clear errors, nothing
# lost, no crash.
#
#  1. Bad parameters: each makes nbdkit refuse to start with a message
#     naming the parameter, and creates no cache file.
#  2. Undersized cache (1 MiB): refused, saying why.
#  3. Foreign data (random bytes; an ext4 file system; zeros with a btrfs
#     signature at 64 KiB) and a blank file with bcache-format=never:
#     refused, the file untouched; with
#     bcache-format=force it is formatted and serves the right data.
#  4. A corrupt cache (a flipped superblock byte; a zeroed journal; a
#     truncated file), made from a real cache holding data: refused with a
#     message, the file untouched — or, for the journal, accepted only if
#     every read is right.
#  5. Unusable cache paths: a directory, a file in a missing directory,
#     a read-only file (run as nobody when the test is root, since root
#     ignores permissions), /proc/version.
#  6. A cache made for another export: a remote of another size, another
#     bcache-backing-uuid: refused; the cache still works for its own
#     export; the same export resized: every connection refused;
#     bcache-format=force re-purposes it and serves the new export's
#     data, not the old one's.
#  7. Unaligned and out-of-range requests (tests/filter/requests.py):
#     out-of-range ones fail, the server survives, unaligned ones are
#     right.
#  8. Remote errors (nbdkit's error filter on the remote, switched on by a
#     trigger file) under a random workload in writethrough and
#     writearound: clients get errors, never wrong data; the proxy
#     survives; afterwards the proxy and the remote hold the same data.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires md5sum --version
requires cmp --version
requires truncate --version

seed="${TEST_SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}"
echo "$0: seed $seed (rerun with TEST_SEED=$seed)"

tmpdir d
F=(--filter="$BCACHEFILTER_SO")

# refuse NAME REGEXP ARGS...: the filter on a memory plugin with ARGS
# must refuse to start; messages in $d/NAME.err.  A failure is recorded
# in $bad and the test goes on, so one run reports every case.
bad=()
refuse ()
{
    local name="$1" re="$2"
    shift 2
    ( must_refuse "$d/$name.err" "$re" "${F[@]}" memory 32M "$@" ) ||
        bad+=("$name: $*")
}
# soft NAME CMD...: run CMD in a subshell; if it fails (or calls fail),
# record NAME in $bad and go on.
soft ()
{
    local name="$1"
    shift
    ( "$@" ) || bad+=("$name")
}
# unchanged FILE SUM WHAT: FILE's md5 must still be SUM.
unchanged ()
{
    test "$(md5sum < "$1")" = "$2" || bad+=("$3: the filter changed $1")
}
# check_bad: fail if anything was recorded in $bad.
check_bad ()
{
    if [ "${#bad[@]}" -gt 0 ]; then
        local b
        for b in "${bad[@]}"; do
            echo "$0: FAILED: $b" >&2
        done
        fail "${#bad[@]} bad inputs were not handled as they should (above)"
    fi
}

# ---------------------------------------------------------------------
# 1. Bad parameters.
c="$d/never-created"
refuse noparam 'bcache'
refuse wbpercent 'bcache-writeback-percent' bcache="$c" bcache-size=64M \
       bcache-mode=writeback bcache-writeback-percent=101
refuse syncwrites 'bcache-sync-writes' bcache="$c" bcache-size=64M \
       bcache-mode=writeback bcache-sync-writes=some
refuse badmode 'bcache-mode' bcache="$c" bcache-size=64M bcache-mode=bogus
refuse badsize 'bcache-size' bcache="$c" bcache-size=12Q
refuse negsize 'bcache-size' bcache="$c" bcache-size=-64M
refuse bucket 'bcache-bucket-size' bcache="$c" bcache-size=64M \
    bcache-bucket-size=3k
refuse bucket2 'bcache-bucket-size' bcache="$c" bcache-size=64M \
    bcache-bucket-size=1G
refuse block 'bcache-block-size' bcache="$c" bcache-size=64M \
    bcache-block-size=3000
refuse cutoff 'bcache-sequential-cutoff' bcache="$c" bcache-size=64M \
    bcache-sequential-cutoff=lots
refuse format 'bcache-format' bcache="$c" bcache-size=64M bcache-format=maybe
refuse io 'bcache-io' bcache="$c" bcache-size=64M bcache-io=carrier-pigeon
refuse backingdev 'bcache-backing-device' bcache="$c" bcache-size=64M \
    bcache-backing-device=maybe
refuse direct 'bcache-direct' bcache="$c" bcache-size=64M bcache-direct=maybe
refuse uuid 'bcache-backing-uuid' bcache="$c" bcache-size=64M \
    bcache-backing-uuid=not-a-uuid
refuse errlimit 'bcache-error-limit' bcache="$c" bcache-size=64M \
    bcache-error-limit=many
refuse halflife 'bcache-error-halflife' bcache="$c" bcache-size=64M \
    bcache-error-halflife=-1
refuse nodecache 'bcache-node-cache' bcache="$c" bcache-size=64M \
    bcache-node-cache=huge
refuse ctl 'bcache-ctl' bcache="$c" bcache-size=64M \
    bcache-ctl="$d/no/such/dir/ctl.sock"
refuse tracker 'bcache-test-disable-tracker' bcache="$c" bcache-size=64M \
    bcache-test-disable-tracker=perhaps
test ! -e "$c" || bad+=("a refused start left $c behind")

# ---------------------------------------------------------------------
# 2. Undersized.
refuse small 'small|size|buckets' bcache="$d/small" bcache-size=1M
ls -l "$d/small" || true
truncate -s 1M "$d/small1"
refuse small1 'small|size|buckets' bcache="$d/small1"

# ---------------------------------------------------------------------
# 3. Foreign data.
head -c 64M /dev/urandom > "$d/random"
sum="$(md5sum < "$d/random")"
refuse random 'bcache-format|force|other data|not a bcache' bcache="$d/random"
unchanged "$d/random" "$sum" "random data"
refuse random-never 'bcache-format|force|other data|not a bcache' \
    bcache="$d/random" bcache-format=never
unchanged "$d/random" "$sum" "random data, bcache-format=never"

if mkfs.ext4 -V >/dev/null 2>&1; then
    truncate -s 64M "$d/ext4"
    mkfs.ext4 -q -F "$d/ext4"
    sum="$(md5sum < "$d/ext4")"
    refuse ext4 'bcache-format|force|other data|not a bcache|ext' \
        bcache="$d/ext4"
    unchanged "$d/ext4" "$sum" "ext4"
fi

# Zeros where a cache's superblock goes, but a btrfs signature at 64 KiB:
# not blank (the engine's rule: the first and last MiB too), so refused
# before nbdkit forks, saying why, and left alone.
truncate -s 64M "$d/sig64k"
printf '_BHRfS_M' |
    dd of="$d/sig64k" bs=1 seek=$((65536 + 64)) conv=notrunc status=none
sum="$(md5sum < "$d/sig64k")"
refuse sig64k 'starts with zeros but is not blank' bcache="$d/sig64k"
unchanged "$d/sig64k" "$sum" "a btrfs signature at 64 KiB"

truncate -s 64M "$d/blank"
refuse never 'bcache-format|never|not formatted|not a bcache' \
    bcache="$d/blank" bcache-format=never

# The remote, with known data, for what follows.
start_remote memory 32M
head -c 32M /dev/urandom > "$d/data"
nbdio "$remote_sock" wfile 0 "$d/data"
# check_proxy: the whole export through the proxy equals $d/data.
check_proxy ()
{
    nbdio "$p_sock" dump "$d/dump"
    cmp "$d/dump" "$d/data" || fail "$1: the proxy serves wrong data"
}

start_proxy p bcache="$d/random" bcache-format=force
check_proxy "a forced format of random data"
check_proxy "a forced format of random data (cached)"
stop_nbdkit "$p_pid"

# ---------------------------------------------------------------------
# 4. Corrupt caches, made from a good cache that holds data.
start_proxy p bcache="$d/good" bcache-size=64M
check_proxy "a new cache"
stop_nbdkit "$p_pid"
start_proxy p bcache="$d/good"
check_proxy "a restarted cache"
stop_nbdkit "$p_pid"

# Flip a byte of the superblock's uuid (checksummed).
cp "$d/good" "$d/sb"
"$PYTHON" -c '
import sys
f = open(sys.argv[1], "r+b"); f.seek(4096 + 40); b = f.read(1)
f.seek(4096 + 40); f.write(bytes([b[0] ^ 0x40]))' "$d/sb"
sum="$(md5sum < "$d/sb")"
soft "corrupt superblock" \
    must_refuse "$d/sb.err" 'checksum|superblock|corrupt' \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/sb"
unchanged "$d/sb" "$sum" "corrupt superblock"

# Zero the journal (its buckets, from the superblock).
cp "$d/good" "$d/journal"
"$PYTHON" -c '
import struct, sys
f = open(sys.argv[1], "r+b"); f.seek(4096); sb = f.read(4096)
bucket_size = struct.unpack_from("<H", sb, 194)[0]
first_bucket = struct.unpack_from("<H", sb, 204)[0]
nr = struct.unpack_from("<H", sb, 206)[0]
print("bucket size %d sectors, first bucket %d, %d journal buckets" % (bucket_size, first_bucket, nr), file=sys.stderr)
for i in range(nr):
    b = struct.unpack_from("<Q", sb, 208 + 8 * i)[0]
    f.seek(b * bucket_size * 512); f.write(bytes(bucket_size * 512))' \
    "$d/journal" 2>&1 | tee "$d/journal.info"
bcachefilter-show --journal "$d/journal" || true
sum="$(md5sum < "$d/journal")"
# Either refused before serving (with a message), or accepted and every
# read right.
st=0
rm -f "$d/dump" "$d/journal.ran"
timeout 60 nbdkit -U - "${F[@]}" nbd socket="$remote_sock" bcache="$d/journal" \
    --run "touch '$d/journal.ran'; timeout 10 '$PYTHON' '$filterdir/nbdio.py' \$unixsocket dump '$d/dump'" \
    > "$d/journal.err" 2>&1 || st=$?
cat "$d/journal.err"
if [ -e "$d/journal.ran" ]; then
    if [ "$st" -eq 0 ] && cmp "$d/dump" "$d/data"; then
        echo "$0: a cache with a zeroed journal was accepted, and serves the right data"
    else
        bad+=("zeroed journal: nbdkit started serving, then the client failed (status $st): it must refuse before serving or serve the right data")
    fi
elif [ "$st" -ge 128 ] || [ "$st" -eq 0 ]; then
    bad+=("nbdkit died (status $st) on a cache with a zeroed journal")
else
    grep -Eiq 'journal|corrupt|checksum' "$d/journal.err" ||
        bad+=("a zeroed journal was refused without a clear message")
    unchanged "$d/journal" "$sum" "zeroed journal"
fi

# Truncated to half its size.
cp "$d/good" "$d/trunc"
truncate -s 32M "$d/trunc"
sum="$(md5sum < "$d/trunc")"
soft "truncated cache" \
    must_refuse "$d/trunc.err" 'truncat|size|short|small|buckets' \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/trunc"
unchanged "$d/trunc" "$sum" "truncated cache"

# ---------------------------------------------------------------------
# 5. Unusable paths.
refuse dir 'bcache|director' bcache="$d"
refuse missingdir 'bcache|No such file' bcache="$d/no/such/dir/cache" \
    bcache-size=64M
refuse proc 'bcache|/proc/version' bcache=/proc/version
cp "$d/good" "$d/ro"
chmod 0444 "$d/ro"
if [ "$(id -u)" -ne 0 ]; then
    refuse ro 'read-only|permission|denied|writ' bcache="$d/ro"
elif setpriv --reuid=65534 --regid=65534 --clear-groups true 2>/dev/null &&
     setpriv --reuid=65534 --regid=65534 --clear-groups \
         test -r "$BCACHEFILTER_SO"; then
    chmod 0711 "$d"
    chown 65534:65534 "$d/ro"
    st=0
    setpriv --reuid=65534 --regid=65534 --clear-groups \
        timeout 60 nbdkit -U - "${F[@]}" memory 32M bcache="$d/ro" \
        --run true > "$d/ro.err" 2>&1 || st=$?
    cat "$d/ro.err"
    chmod 0700 "$d"
    if [ "$st" -eq 0 ]; then
        bad+=("a read-only cache file was accepted")
    elif [ "$st" -ge 128 ] || [ "$st" -eq 124 ]; then
        bad+=("nbdkit died (status $st) on a read-only cache file")
    elif ! grep -Eiq 'read-only|permission|denied|writ' "$d/ro.err"; then
        bad+=("a read-only cache file was refused without a clear message")
    fi
else
    echo "$0: skipped the read-only cache check (root without setpriv)"
fi
cmp "$d/ro" "$d/good" || bad+=("the filter changed a read-only cache")

# ---------------------------------------------------------------------
# 6. A cache made for another export.
start_remote_named other memory 48M
cp "$d/good" "$d/keep"
soft "another export (size)" \
    must_refuse "$d/other.err" 'size|export|uuid|another|different|backing' \
    "${F[@]}" nbd socket="$other_sock" bcache="$d/good"
soft "another export (uuid)" \
    must_refuse "$d/uuid.err" 'size|export|uuid|another|different|backing' \
    "${F[@]}" nbd socket="$remote_sock" bcache="$d/good" \
    bcache-backing-uuid=0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0
# Still good for its own export, and still warm.
start_proxy p bcache="$d/good"
check_proxy "the cache after it was refused for another export"
stop_nbdkit "$p_pid"
# The same export resized (its bcache-backing-uuid, another size): the
# export's size is known only from a connection, so nbdkit starts, but
# every connection is refused, naming both sizes, and nothing is served;
# the cache still serves its own export afterwards.
uuid=6d0c1a5e-8f3b-4c2d-9e7a-0b1c2d3e4f50
start_proxy p bcache="$d/resized" bcache-size=64M bcache-backing-uuid=$uuid
check_proxy "a cache with its own bcache-backing-uuid"
stop_nbdkit "$p_pid"
st=0
timeout 60 nbdkit -U - "${F[@]}" nbd socket="$other_sock" bcache="$d/resized" \
    bcache-backing-uuid=$uuid \
    --run "'$PYTHON' '$filterdir/nbdio.py' \$unixsocket size" \
    > "$d/resized.err" 2>&1 || st=$?
cat "$d/resized.err"
[ "$st" -ne 0 ] || bad+=("a resized export was served")
grep -q "this export has 50331648 bytes but the cache holds an export of 33554432 bytes" \
    "$d/resized.err" || bad+=("a resized export was refused without naming the sizes")
start_proxy p bcache="$d/resized" bcache-backing-uuid=$uuid
check_proxy "the cache after it was refused for a resized export"
stop_nbdkit "$p_pid"
# Forced onto the other export: its data, not the old cached data.
head -c 48M /dev/urandom > "$d/data48"
nbdio "$other_sock" wfile 0 "$d/data48"
start_proxy p remote="$other_sock" bcache="$d/good" bcache-format=force
nbdio "$p_sock" dump "$d/dump"
cmp "$d/dump" "$d/data48" || fail "a forced cache serves the old export's data"
stop_nbdkit "$p_pid"
stop_nbdkit "$other_pid"

# ---------------------------------------------------------------------
# 7. Unaligned and out-of-range requests (4K blocks, 64K buckets).
start_proxy p bcache="$d/req" bcache-size=64M bcache-bucket-size=64K \
    bcache-block-size=4k
cp "$d/data" "$d/shadow"
timeout 120 "$PYTHON" "$filterdir/requests.py" "$p_sock" "$d/shadow" ||
    fail "unaligned or out-of-range requests (see above)"
stop_nbdkit "$p_pid"
nbdio "$remote_sock" dump "$d/dump"
cmp "$d/dump" "$d/shadow" || fail "the remote does not hold what was written"
start_proxy p bcache="$d/req"
check_proxy_shadow () {
    nbdio "$p_sock" dump "$d/dump"
    cmp "$d/dump" "$d/shadow" || fail "$1: the proxy serves wrong data"
}
check_proxy_shadow "after unaligned requests and a restart"
stop_nbdkit "$p_pid"
stop_nbdkit "$remote_pid"

# ---------------------------------------------------------------------
# 8. Remote errors.
trigger="$d/errors-on"
start_remote_named erem --filter=error memory 32M error=EIO \
    error-pread-rate=25% error-pwrite-rate=15% error-zero-rate=15% \
    error-trim-rate=15% error-cache-rate=10% \
    error-extents-rate=10% error-file="$trigger"
I=("$PYTHON" "$filterdir/integrity.py" --shadow "$d/eshadow"
   --uncertain "$d/euncertain" --threads 4)
start_proxy p remote="$erem_sock" bcache="$d/errcache" bcache-size=128M \
    bcache-bucket-size=128K
timeout 120 "${I[@]}" --sock "$p_sock" --init --seed "$seed" --ops 100 ||
    fail "the workload without errors failed (seed $seed)"
touch "$trigger"
timeout 120 "${I[@]}" --sock "$p_sock" --errors --seed $((seed + 1)) \
    --ops 150 --label "writethrough, remote errors" ||
    fail "wrong data or a bad error with remote errors (seed $seed)"
stop_nbdkit "$p_pid"
start_proxy p remote="$erem_sock" bcache="$d/errcache" bcache-mode=writearound
timeout 120 "${I[@]}" --sock "$p_sock" --errors --seed $((seed + 2)) \
    --ops 150 --label "writearound, remote errors" ||
    fail "wrong data or a bad error with remote errors (seed $seed)"
rm -f "$trigger"
# No more errors: the proxy and the remote agree everywhere (the cache
# holds nothing the remote does not), and certain bytes are right.
timeout 120 "${I[@]}" --sock "$p_sock" --errors --seed $((seed + 3)) \
    --ops 0 --verify-first --label "after the errors" ||
    fail "wrong data after remote errors (seed $seed)"
nbdio "$p_sock" dump "$d/pdump"
nbdio "$erem_sock" dump "$d/rdump"
cmp "$d/pdump" "$d/rdump" || fail "after remote errors the proxy and the remote differ"
stop_nbdkit "$p_pid"
start_proxy p remote="$erem_sock" bcache="$d/errcache"
nbdio "$p_sock" dump "$d/pdump"
cmp "$d/pdump" "$d/rdump" || fail "after a restart the proxy and the remote differ"
stop_nbdkit "$p_pid"
check_bad
echo "$0: OK (seed $seed)"
