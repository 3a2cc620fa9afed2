#!/usr/bin/env bash
# bcachefilter: test bcachefilter-show against make-bcache and
# bcache-super-show from bcache-tools.
#
# - Cache devices made by make-bcache -C with several bucket and block
#   sizes must be accepted (exit 0), and every field that both
#   bcachefilter-show and bcache-super-show print must have the same value.
# - --json must be valid JSON agreeing with what make-bcache reported.
# - Each kind of bad device must give its own exit status (see
#   bcachefilter-show(1)) and a message saying what is wrong.  Superblocks
#   are edited with a small python3 helper that recomputes the CRC-64/WE
#   checksum, so each case fails for the intended reason only.

source "$(dirname "$0")/functions.sh"
set -e
set -x

requires bcachefilter-show --version
requires command -v make-bcache
requires command -v bcache-super-show
requires python3 --version
requires truncate --version

tmpdir d

# ------------------------------------------------------------------------
# Helpers

# sbedit FILE FIELD=VALUE...: edit the cache superblock at byte 4096 of
# FILE and recompute its checksum.  Fields: label=STRING (bytes),
# offset=N, flags=N, version=N, incompat=N, bucket_size=N, keys=N (also
# fills d[] with first_bucket + i), d=I:N (d[I] = N), or
# byte=OFFSET:VALUE (a raw byte of the superblock, written after the
# checksum so that it can break it).
cat > "$d/sbedit.py" <<'EOF'
import os, struct, sys

def crc64_we(data):
    # CRC-64/WE: poly 0x42F0E1EBA9EA3693, MSB first, init and xorout ~0.
    crc = 0xffffffffffffffff
    for b in data:
        crc ^= b << 56
        for _ in range(8):
            if crc & (1 << 63):
                crc = ((crc << 1) ^ 0x42F0E1EBA9EA3693) & 0xffffffffffffffff
            else:
                crc = (crc << 1) & 0xffffffffffffffff
    return crc ^ 0xffffffffffffffff

assert crc64_we(b"123456789") == 0x62EC59E3F1A4F00A

path = sys.argv[1]
with open(path, "r+b") as f:
    f.seek(4096)
    sb = bytearray(f.read(4096))
    raw = []
    for arg in sys.argv[2:]:
        key, val = arg.split("=", 1)
        if key == "label":
            sb[72:104] = os.fsencode(val).ljust(32, b"\0")[:32]
        elif key == "flags":
            struct.pack_into("<Q", sb, 104, int(val, 0))
        elif key == "offset":
            struct.pack_into("<Q", sb, 8, int(val, 0))
        elif key == "version":
            struct.pack_into("<Q", sb, 16, int(val, 0))
        elif key == "incompat":
            struct.pack_into("<Q", sb, 128, int(val, 0))
        elif key == "bucket_size":
            struct.pack_into("<H", sb, 194, int(val, 0))
        elif key == "keys":
            n = int(val, 0)
            first = struct.unpack_from("<H", sb, 204)[0]
            struct.pack_into("<H", sb, 206, n)
            for i in range(n):
                struct.pack_into("<Q", sb, 208 + 8 * i, first + i)
        elif key == "d":
            i, v = val.split(":")
            struct.pack_into("<Q", sb, 208 + 8 * int(i, 0), int(v, 0))
        elif key == "byte":
            off, v = val.split(":")
            raw.append((int(off, 0), int(v, 0)))
        else:
            sys.exit("sbedit: unknown field " + key)
    keys = struct.unpack_from("<H", sb, 206)[0]
    struct.pack_into("<Q", sb, 0, crc64_we(bytes(sb[8:208 + 8 * keys])))
    for off, v in raw:
        sb[off] = v
    f.seek(4096)
    f.write(sb)
EOF
sbedit () { python3 "$d/sbedit.py" "$@"; }

# expect STATUS PHRASE CMD...: run CMD; its exit status must be STATUS and
# its output (stdout or stderr) must contain PHRASE.  The output is left
# in $d/out and $d/err.
expect ()
{
    local want=$1 phrase=$2 rc=0
    shift 2
    "$@" > "$d/out" 2> "$d/err" || rc=$?
    cat "$d/err"
    if [ "$rc" -ne "$want" ]; then
        fail "'$*' exited with status $rc, expected $want"
    fi
    if ! grep -qF -- "$phrase" "$d/out" "$d/err"; then
        fail "'$*': output does not contain '$phrase'"
    fi
}

# Normalise "name<tabs>value" lines to "name<TAB>value" with single
# spaces and lower-case hex, dropping blank lines.
normalise ()
{
    awk 'NF { name = $1; $1 = ""; sub(/^ +/, ""); print name "\t" tolower($0) }' "$1"
}

# compare_with_super_show FILE: every field printed by both tools has the
# same value, and every field of bcache-super-show is printed by
# bcachefilter-show.
compare_with_super_show ()
{
    bcachefilter-show "$1" > "$d/ours"
    bcache-super-show "$1" > "$d/theirs"
    normalise "$d/ours" > "$d/ours.n"
    normalise "$d/theirs" > "$d/theirs.n"
    awk -F '\t' '
        NR == FNR { theirs[$1] = $2; nt++; next }
        ($1 in theirs) {
            common++
            seen[$1] = 1
            if (theirs[$1] != $2) {
                printf "field %s: bcachefilter-show \"%s\", bcache-super-show \"%s\"\n", $1, $2, theirs[$1]
                bad = 1
            }
        }
        END {
            for (f in theirs)
                if (!(f in seen)) {
                    printf "field %s of bcache-super-show is missing\n", f
                    bad = 1
                }
            printf "%d fields compared\n", common
            if (nt < 16) { print "bcache-super-show printed only " nt " fields"; bad = 1 }
            exit bad
        }' "$d/theirs.n" "$d/ours.n" ||
        fail "bcachefilter-show and bcache-super-show disagree on $1"
}

# json_get FILE EXPR: evaluate a python expression over the JSON output
# j of bcachefilter-show --json FILE (which must be valid JSON).  One
# interpreter checks and evaluates (one start per call: functions.sh).
json_get ()
{
    bcachefilter-show --json "$1" > "$d/json"
    python3 -c 'import json, sys
try:
    j = json.load(open(sys.argv[1]))
except ValueError as e:
    sys.exit("not valid JSON: %s" % e)
print(eval(sys.argv[2]))' "$d/json" "$2" ||
        fail "bcachefilter-show --json $1 is not valid JSON, or '$2' fails"
}

# make_cache FILE SIZE MAKE-BCACHE-ARGS...: a fresh cache file; what
# make-bcache printed is left in $d/mb.
make_cache ()
{
    local file=$1 size=$2
    shift 2
    rm -f "$file"
    truncate -s "$size" "$file"
    make-bcache -C "$@" "$file" > "$d/mb"
    cat "$d/mb"
}

# mb_field NAME: a value from make-bcache's output ("nbuckets:  512").
mb_field ()
{
    awk -v n="$1:" '$1 == n { print $2 }' "$d/mb"
}

# ------------------------------------------------------------------------
# Good cache devices: several bucket and block sizes, and sizes that are
# not a multiple of the bucket size.

img="$d/cache.img"
for geometry in "256M 512k 4k" "512M 1M 512" "64M 64k 2k" \
                "100000000 128k 1k" "600M 2M 4k"; do
    read -r size bucket block <<< "$geometry"
    make_cache "$img" "$size" -b "$bucket" -w "$block"
    expect 0 "sb.magic" bcachefilter-show "$img"
    compare_with_super_show "$img"

    # JSON agrees with make-bcache.
    nb="$(json_get "$img" 'j["layout"]["nbuckets"]')"
    test "$nb" = "$(mb_field nbuckets)" ||
        fail "--json nbuckets $nb, make-bcache said $(mb_field nbuckets)"
    bs="$(json_get "$img" 'j["dev"]["sectors_per_bucket"]')"
    test "$bs" = "$(mb_field bucket_size)" ||
        fail "--json bucket size $bs, make-bcache said $(mb_field bucket_size)"
    test "$(json_get "$img" 'j["layout"]["bucket_bytes"]')" = $((bs * 512))
    test "$(json_get "$img" 'j["status"]')" = ok
    test "$(json_get "$img" 'j["dev"]["uuid"]')" = "$(mb_field UUID)"
    test "$(json_get "$img" 'j["cset"]["uuid"]')" = \
         "$(awk '$1 == "Set" { print $3 }' "$d/mb")"
    test "$(json_get "$img" 'j["layout"]["fits"]')" = True
done

# The derived magics and layout of a 512 KiB-bucket cache (bcache.md
# §1.3 / §1.5 / §1.7): set_magic is the first 8 bytes of the set uuid,
# little-endian.
make_cache "$img" 256M -b 512k -w 4k
expect 0 "layout.btree_node_bytes" bcachefilter-show "$img"
set_uuid="$(json_get "$img" 'j["cset"]["uuid"]')"
magic="$(python3 -c 'import sys, uuid
print("0x%016x" % int.from_bytes(uuid.UUID(sys.argv[1]).bytes[:8], "little"))' "$set_uuid")"
test "$(json_get "$img" 'j["cset"]["set_magic"]')" = "$magic"
test "$(json_get "$img" 'j["cset"]["jset_magic"]')" = \
     "$(printf '0x%016x' $(( magic ^ 0x245235c1a3625032 )))"
test "$(json_get "$img" 'j["layout"]["btree_node_bytes"]')" = 262144
test "$(json_get "$img" 'j["layout"]["prios_per_bucket"]')" = 174749
test "$(json_get "$img" 'j["layout"]["uuids_per_bucket"]')" = 4096
test "$(json_get "$img" 'j["layout"]["journal_nbuckets"]')" = 4
grep -q '^sb.d[[:space:]]*(none)$' "$d/out"

# Flags, label and journal buckets set as the kernel would (version 3,
# CACHE_SYNC, d[] filled in): still valid, still matching
# bcache-super-show, label escaped in JSON.
sbedit "$img" version=3 flags=0x7 keys=4 'label=my cache/"x"\y'
expect 0 "sb.flags" bcachefilter-show "$img"
compare_with_super_show "$img"
grep -q '^sb.flags.*0x7 \[CACHE_SYNC CACHE_DISCARD CACHE_REPLACEMENT=fifo\]$' "$d/ours"
grep -q '^sb.d[[:space:]]*1-4$' "$d/ours"
grep -q '^layout.journal_buckets.*1-4 \[4 buckets, allocated\]$' "$d/ours"
test "$(json_get "$img" 'j["dev"]["label"]')" = 'my cache/"x"\y'
test "$(json_get "$img" 'j["sb"]["d"]')" = '[1, 2, 3, 4]'
test "$(json_get "$img" 'j["dev"]["cache"]["ordered"]')" = True
# Bytes above 127: bcache-super-show prints them sign-extended
# (%ffffffe9), bcachefilter-show as %e9; JSON reads them as Latin-1.
sbedit "$img" $'label=\xe9t\xe9\t1'
expect 0 "dev.label" bcachefilter-show "$img"
grep -q '^dev.label[[:space:]]*%e9t%e9%91$' "$d/out"
test "$(json_get "$img" 'j["dev"]["label"]')" = $'\u00e9t\u00e9\t1'

# A byte changed outside the checksummed area is not an error.
make_cache "$img" 256M -b 512k -w 4k
sbedit "$img" byte=3000:0x55
expect 0 "[match]" bcachefilter-show "$img"

# A block device (a read-only loop device), where the size comes from
# BLKGETSIZE64.  Only as root and where loop devices work.
if [ "$(id -u)" -eq 0 ] && loop="$(losetup -f --show -r "$img" 2>/dev/null)"
then
    cleanup_fn losetup -d "$loop"
    expect 0 "layout.device_bytes" bcachefilter-show "$loop"
    grep -q '^layout.device_bytes[[:space:]]*268435456$' "$d/out"
else
    echo "$0: block device case skipped (needs root and a loop device)"
fi

# ------------------------------------------------------------------------
# Usage and I/O errors: exit 1.

expect 0 "Usage:" bcachefilter-show --help
expect 0 "Usage:" bcachefilter-show -h
expect 0 "bcachefilter-show " bcachefilter-show --version
expect 1 "missing DEVICE" bcachefilter-show
expect 1 "too many arguments" bcachefilter-show "$img" "$img"
expect 1 "Usage:" bcachefilter-show --no-such-option "$img"
expect 1 "$d/nonexistent: cannot open: No such file or directory" \
       bcachefilter-show "$d/nonexistent"
expect 1 "not a regular file or block device" bcachefilter-show "$d"

# ------------------------------------------------------------------------
# Not bcache: exit 2.

truncate -s 1M "$d/zero.img"
expect 2 "not a bcache device" bcachefilter-show "$d/zero.img"
expect 2 "not a bcache device" bcachefilter-show --json "$d/zero.img"
test ! -s "$d/out"

# ------------------------------------------------------------------------
# A backing device: exit 3.

truncate -s 64M "$d/backing.img"
make-bcache -B "$d/backing.img"
expect 3 "this is a bcache backing device, not a cache device" \
       bcachefilter-show "$d/backing.img"

# ------------------------------------------------------------------------
# Truncated: exit 4.

# Smaller than nbuckets * bucket_size (but the superblock is intact).
make_cache "$img" 256M -b 512k -w 4k
truncate -s 200M "$img"
expect 4 "must be at least 268435456 bytes" bcachefilter-show "$img"
grep -qF "the device is 209715200 bytes" "$d/err"

# Smaller than 8 KiB.
head -c 4096 /dev/zero > "$d/small.img"
expect 4 "must be at least 8192 bytes" bcachefilter-show "$d/small.img"
grep -qF "the device is 4096 bytes" "$d/err"

# ------------------------------------------------------------------------
# Bad checksum: exit 5, with and without --force.

make_cache "$img" 256M -b 512k -w 4k
stored="$(json_get "$img" '"%X" % int(j["sb"]["csum"], 16)')"
sbedit "$img" byte=100:0x5a
expect 5 "bad superblock checksum: stored $stored, computed" \
       bcachefilter-show "$img"
test ! -s "$d/out"
# --force prints the fields, and the computed checksum agrees with
# bcache-super-show's [expected X].
expect 5 "bad superblock checksum" bcachefilter-show --force "$img"
expected="$(bcache-super-show -f "$img" |
            awk '$1 == "sb.csum" { sub(/\]$/, "", $4); print $4 }')"
test -n "$expected"
grep -q "^sb.csum[[:space:]]*$stored \[expected $expected\]\$" "$d/out" ||
    fail "sb.csum line differs from bcache-super-show -f ($stored $expected)"
grep -qF "computed $expected" "$d/err" ||
    fail "message does not give the computed checksum $expected"
grep -q '^cset.uuid' "$d/out"
expect 5 '"status": "bad checksum"' bcachefilter-show -f --json "$img"
python3 -m json.tool "$d/out" > /dev/null

# ------------------------------------------------------------------------
# Unsupported version or features: exit 6.

make_cache "$img" 256M -b 512k -w 4k
sbedit "$img" version=2
expect 6 "unsupported superblock version 2" bcachefilter-show "$img"
expect 6 "sb.version" bcachefilter-show -f "$img"
grep -q '^sb.version[[:space:]]*2 \[unknown\]$' "$d/out"

make_cache "$img" 256M -b 512k -w 4k
sbedit "$img" version=5 incompat=0x4
expect 6 "unsupported superblock" bcachefilter-show "$img"
grep -qF "incompat" "$d/err"
expect 6 "unknown=0x4" bcachefilter-show -f "$img"

# ------------------------------------------------------------------------
# Other invalid fields: exit 7.

make_cache "$img" 256M -b 512k -w 4k
sbedit "$img" bucket_size=1000
expect 7 "invalid superblock" bcachefilter-show "$img"
grep -qF "bucket_size" "$d/err"
expect 7 "dev.sectors_per_bucket" bcachefilter-show --force "$img"

make_cache "$img" 256M -b 512k -w 4k
sbedit "$img" offset=9
expect 7 "offset" bcachefilter-show "$img"
expect 7 "sb.first_sector" bcachefilter-show -f "$img"
grep -q '^sb.first_sector[[:space:]]*9 \[expected 8\]$' "$d/out"

# Journal buckets that do not follow first_bucket.
make_cache "$img" 256M -b 512k -w 4k
sbedit "$img" keys=4 d=2:9
expect 7 "d[2]" bcachefilter-show "$img"
expect 7 "sb.d" bcachefilter-show -f "$img"
grep -q '^sb.d[[:space:]]*1-2 9 4$' "$d/out"
