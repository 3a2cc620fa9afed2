#!/usr/bin/env bash
# bcachefilter: test bcachefilter-format, and the journal, btree, buckets
# and fsck modes of bcachefilter-show on the caches it makes.
#
# - Files formatted with several bucket and block sizes must be accepted by
#   bcache-super-show (checksum [match], version 3, CACHE_SYNC) and by
#   every mode of bcachefilter-show: --fsck clean, --journal lists entries
#   and finds the replay range complete, --btree shows one empty root leaf
#   (the same bucket the newest journal entry names), --buckets gives sane
#   percentages.
# - A device made by make-bcache -C is initialised with its own geometry
#   and uuids.
# - No cache the Linux kernel would not register is made: it needs more
#   than 512 buckets.  Without --bucket-size a small device gets smaller
#   buckets (with a warning); with one, or for a make-bcache device made
#   that small, the format is refused (status 4).
# - What must be refused is refused, with exit status and message as in
#   bcachefilter-format(1): a live cache (status 3), random data, data
#   past a zero superblock, a backing device (status 2) — each message
#   naming --force, and the device left unchanged; --force overwrites.
# - Bad options give status 1 and a message naming the option.
# Each assertion checks an exit status and a key phrase.

source "$(dirname "$0")/functions.sh"
set -e
set -x

requires bcachefilter-format --version
requires bcachefilter-show --version
requires command -v make-bcache
requires command -v bcache-super-show
requires python3 --version
requires truncate --version

tmpdir d

# expect STATUS PHRASE CMD...: run CMD; its exit status must be STATUS and
# its output (stdout or stderr) must contain PHRASE.  The output is left
# in $d/out and $d/err.
expect ()
{
    local want=$1 phrase=$2 rc=0
    shift 2
    "$@" > "$d/out" 2> "$d/err" || rc=$?
    cat "$d/out" "$d/err"
    if [ "$rc" -ne "$want" ]; then
        fail "'$*' exited with status $rc, expected $want"
    fi
    if ! grep -qF -- "$phrase" "$d/out" "$d/err"; then
        fail "'$*': output does not contain '$phrase'"
    fi
}

# jq_py FILE EXPR: evaluate a python expression over the JSON in FILE
# (which must be valid JSON) as j.
jq_py ()
{
    python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
print(eval(sys.argv[2]))' "$1" "$2" || fail "$1 is not valid JSON or '$2' fails"
}

# jq_all FILE EXPR...: every python expression over the JSON in FILE (as
# j) must be true.  One interpreter for them all: check_cache used to
# start one per expression (with pyenv's shim, 0.4 s each: functions.sh).
jq_all ()
{
    local f=$1
    shift
    python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
bad = [e for e in sys.argv[2:] if eval(e) is not True]
for e in bad:
    print("false:", e, file=sys.stderr)
sys.exit(1 if bad else 0)' "$f" "$@" ||
        fail "$f is not valid JSON or an expression is false: $*"
}

# human BYTES: as bcachefilter-format prints sizes ("512 KiB", "1 MiB").
human ()
{
    if (( $1 % 1048576 == 0 )); then echo "$(( $1 >> 20 )) MiB"
    elif (( $1 % 1024 == 0 )); then echo "$(( $1 >> 10 )) KiB"
    else echo "$1 bytes"
    fi
}

# summary_field NAME: a value from bcachefilter-format's summary in $d/out
# ("bucket size:      512 KiB (1024 sectors)" -> "512 KiB (1024 sectors)").
summary_field ()
{
    sed -n "s/^$1: *//p" "$d/out"
}

# check_cache FILE NBUCKETS: every mode of bcachefilter-show accepts the
# freshly formatted FILE.
check_cache ()
{
    local img=$1 nb=$2 root_j root_b

    # bcache-tools accepts it: checksum, version 3, initialised.
    bcache-super-show "$img" > "$d/bss" || fail "bcache-super-show rejects $img"
    cat "$d/bss"
    grep -q '^sb.csum.*\[match\]$' "$d/bss" || fail "bcache-super-show: no csum match"
    grep -q '^sb.version[[:space:]]*3 \[cache device\]$' "$d/bss" ||
        fail "bcache-super-show: not version 3"
    grep -q '^dev.cache.ordered[[:space:]]*yes$' "$d/bss" ||
        fail "bcache-super-show: CACHE_SYNC is not set"

    expect 0 "sb.magic" bcachefilter-show "$img"
    grep -q '^dev.cache.ordered[[:space:]]*yes$' "$d/out" ||
        fail "bcachefilter-show: CACHE_SYNC is not set"

    expect 0 "clean: 1 nodes, 0 keys, $nb buckets checked" \
           bcachefilter-show --fsck "$img"
    expect 0 '"status": "clean"' bcachefilter-show --fsck --json "$img"
    jq_all "$d/out" "str(j['buckets']) == '$nb'"

    expect 0 "replay needs entries" bcachefilter-show --journal "$img"
    grep -q '\[newest\]$' "$d/out" || fail "--journal: no newest entry"
    grep -q ': all present$' "$d/out" || fail "--journal: replay range incomplete"
    test "$(grep -c '^bucket [0-9]* offset [0-9]*: seq ' "$d/out")" -ge 1 ||
        fail "--journal lists no entry"
    expect 0 '"status": "ok"' bcachefilter-show --journal --json "$img"
    jq_all "$d/out" 'len(j["entries"]) >= 1' 'str(len(j["missing"])) == "0"'
    root_j="$(jq_py "$d/out" \
        '[e for e in j["entries"] if e["newest"]][0]["btree_root"]["bucket"]')"

    expect 0 "summary: 1 nodes, depth 1, 0 keys, 0 dirty sectors" \
           bcachefilter-show --btree "$img"
    grep -q '^node bucket [0-9]* level 0: 0 keys, [0-9]* bytes written, range (0:0, max\]$' \
         "$d/out" || fail "--btree: no empty root leaf"
    root_b="$(sed -n 's/^btree of .*: root bucket \([0-9]*\) level 0$/\1/p' "$d/out")"
    test "$root_b" = "$root_j" ||
        fail "--btree root bucket $root_b, newest journal entry says $root_j"
    expect 0 '"nodes": 1' bcachefilter-show --btree --json -v "$img"
    jq_all "$d/out" 'str(j["nodes"][0]["key_list"]) == "[]"'

    # No data: everything is unused or metadata.  Each percentage is
    # rounded down, so the two add up to 98..100.
    expect 0 "Quantiles:" bcachefilter-show --buckets "$img"
    grep -qP '^Clean:\t\t0%$' "$d/out" || fail "--buckets: clean is not 0%"
    grep -qP '^Dirty:\t\t0%$' "$d/out" || fail "--buckets: dirty is not 0%"
    test "$(sed -n 's/^Quantiles:\t\[\(.*\)\]$/\1/p' "$d/out" | wc -w)" = 31 ||
        fail "--buckets: not 31 quantiles"
    expect 0 '"quantiles"' bcachefilter-show --buckets --json "$img"
    jq_all "$d/out" \
        "str(j['unused']['buckets'] + j['metadata']['buckets']) == '$nb'" \
        '98 <= j["unused"]["percent"] + j["metadata"]["percent"] <= 100' \
        'j["metadata"]["buckets"] >= 5' \
        'str(j["data_buckets"]) == "0"'
}

img="$d/cache.img"

# ------------------------------------------------------------------------
# Several bucket and block sizes.  (A block size below the logical block
# size of the filesystem under $TMPDIR is refused with status 4: then that
# geometry is skipped.)  The 9 GiB one with 16 MiB buckets also prints the
# progress line for devices over 1 GiB.  Each has more than 512 buckets.

for geometry in "257M 512k 4k" "1G 1M 512" "64M 64k 2k" \
                "100000000 128k 1k" "40M 4k 4k" "9G 16M 4k"; do
    read -r size bucket block <<< "$geometry"
    rm -f "$img"
    truncate -s "$size" "$img"
    rc=0
    bcachefilter-format --bucket-size "$bucket" --block-size "$block" "$img" \
        > "$d/out" 2> "$d/err" || rc=$?
    cat "$d/out" "$d/err"
    if [ "$rc" -eq 4 ] && grep -q "smaller than the device's logical block size" "$d/err"
    then
        echo "$0: geometry $geometry skipped: $(cat "$d/err")"
        continue
    fi
    test "$rc" -eq 0 || fail "bcachefilter-format $geometry: exit status $rc"
    grep -q '^set uuid: ' "$d/out" || fail "no summary"

    bucket_bytes="$(numfmt --from=iec "${bucket^^}")"
    block_bytes="$(numfmt --from=iec "${block^^}")"
    test "$(summary_field 'bucket size')" = \
         "$(human "$bucket_bytes") ($((bucket_bytes / 512)) sectors)" ||
        fail "summary bucket size: $(summary_field 'bucket size')"
    test "$(summary_field 'block size')" = \
         "$(human "$block_bytes") ($((block_bytes / 512)) sectors)" ||
        fail "summary block size: $(summary_field 'block size')"
    test "$(summary_field version)" = 3
    nb="$(summary_field nbuckets)"
    test "$nb" = $(( $(stat -c %s "$img") / bucket_bytes ))
    grep -q '^journal buckets: *[0-9]* (buckets [0-9]*-[0-9]*)$' "$d/out" ||
        fail "summary: journal buckets"
    if [ "$(stat -c %s "$img")" -gt $((1 << 30)) ]; then
        grep -qF "formatting $img: $nb buckets of 16 MiB ... done" "$d/out" ||
            fail "no progress line for a device over 1 GiB"
    else
        ! grep -q '^formatting' "$d/out" || fail "progress line for a small device"
    fi

    check_cache "$img" "$nb"
done

# The default geometry (512 KiB buckets), and the replacement policy.
rm -f "$img"
truncate -s 512M "$img"
expect 0 "replacement:      fifo" bcachefilter-format --replacement fifo "$img"
grep -qF "bucket size:      512 KiB (1024 sectors)" "$d/out"
! grep -q "instead of the default" "$d/err" || fail "a warning for a large device"
bcache-super-show "$img" | grep -q '^dev.cache.replacement[[:space:]]*1 \[fifo\]$' ||
    fail "bcache-super-show does not see the fifo policy"
check_cache "$img" 1024

# A small device gets smaller buckets by default, and says so: 256 MiB
# would be 512 buckets of 512 KiB, which the kernel does not register.
rm -f "$img"
truncate -s 256M "$img"
expect 0 "bucket size:      256 KiB (512 sectors)" bcachefilter-format "$img"
grep -qF "warning: $img: 268435456 bytes: formatting with buckets of 256 KiB instead of the default 512 KiB" "$d/err" ||
    fail "no warning about the smaller buckets"
check_cache "$img" 1024
rm -f "$img"
truncate -s 16M "$img"
expect 0 "bucket size:      16 KiB (32 sectors)" bcachefilter-format "$img"
check_cache "$img" 1024
# An explicit bucket size that leaves 512 buckets or fewer is refused,
# and the device left as it was.
rm -f "$img"
truncate -s 256M "$img"
expect 4 "a cache of 512 buckets of 512 KiB is too small for the Linux kernel, which registers none with 512 buckets or fewer" \
       bcachefilter-format --bucket-size 512k "$img"
grep -qF "give a larger device or smaller buckets" "$d/err"
cmp "$img" <(head -c 256M /dev/zero) || fail "a refused format changed the device"
expect 4 "512 buckets or fewer" bcachefilter-format --force --bucket-size 512k "$img"
# Too small even for 4 KiB buckets.
rm -f "$img"
truncate -s 2M "$img"
expect 4 "a cache of 512 buckets of 4 KiB is too small" bcachefilter-format "$img"
grep -qF "give a larger device" "$d/err"
# A make-bcache device with too few buckets is not initialised as it is
# (the kernel would refuse it); --force formats it with more.
rm -f "$img"
truncate -s 128M "$img"
make-bcache -C -b 512k "$img" > /dev/null
expect 4 "make it again with smaller buckets (make-bcache -b)" \
       bcachefilter-format "$img"
bcache-super-show "$img" | grep -q '^sb.version[[:space:]]*0 ' ||
    fail "a refused make-bcache device was changed"
expect 0 "bucket size:      128 KiB (256 sectors)" bcachefilter-format --force "$img"
check_cache "$img" 1024

# ------------------------------------------------------------------------
# A second format without --force is refused, and changes nothing.

cp "$img" "$d/before.img"
expect 3 "already holds a bcache cache" bcachefilter-format "$img"
grep -qF -- "use --force" "$d/err" || fail "the refusal does not name --force"
grep -qF "no dirty data" "$d/err" || fail "the refusal does not say there is no dirty data"
cmp "$img" "$d/before.img" || fail "a refused format changed the device"

# --force formats it anew: another cache set, clean.
old_set="$(bcachefilter-show --json "$img" |
           python3 -c 'import json,sys; print(json.load(sys.stdin)["cset"]["uuid"])')"
expect 0 "set uuid:" bcachefilter-format --force "$img"
test "$(summary_field 'set uuid')" != "$old_set" || fail "--force kept the cache set"
check_cache "$img" 1024

# ------------------------------------------------------------------------
# Data that is not a bcache cache: refused with status 2, unchanged.

head -c 16M /dev/urandom > "$d/random.img"
cp "$d/random.img" "$d/before.img"
expect 2 "not a bcache cache device" bcachefilter-format "$d/random.img"
grep -qF -- "--force" "$d/err" || fail "the refusal does not name --force"
cmp "$d/random.img" "$d/before.img" || fail "a refused format changed the file"
# ... and formatted with --force.
truncate -s 512M "$d/random.img"
expect 0 "set uuid:" bcachefilter-format --force "$d/random.img"
check_cache "$d/random.img" 1024

# Zeroes where the superblock goes, but data further on (a filesystem
# signature past 8 KiB, as btrfs keeps at 64 KiB).
rm -f "$img"
truncate -s 512M "$img"
printf '_BHRfS_M' | dd of="$img" bs=1 seek=$((65536 + 64)) conv=notrunc status=none
expect 2 "byte 65600 is not" bcachefilter-format "$img"
grep -qF -- "use --force" "$d/err"
# The same near the end (an md superblock, a GPT backup header).
rm -f "$img"
truncate -s 512M "$img"
printf 'EFI PART' | dd of="$img" bs=1 seek=$((512 * 1024 * 1024 - 512)) conv=notrunc status=none
expect 2 "not blank" bcachefilter-format "$img"
expect 0 "set uuid:" bcachefilter-format -f "$img"

# A bcache backing device.
rm -f "$img"
truncate -s 64M "$img"
make-bcache -B "$img" > /dev/null
expect 2 "backing device" bcachefilter-format "$img"
grep -qF -- "--force" "$d/err"

# A bcache superblock with a bad checksum.
rm -f "$img"
truncate -s 256M "$img"
make-bcache -C "$img" > /dev/null
printf 'x' | dd of="$img" bs=1 seek=$((4096 + 72)) conv=notrunc status=none
expect 2 "bad bcache superblock" bcachefilter-format "$img"
grep -qF -- "--force" "$d/err"

# ------------------------------------------------------------------------
# A device made by make-bcache -C is initialised as it is: its uuids and
# geometry are kept.

rm -f "$img"
truncate -s 256M "$img"
make-bcache -C -b 256k -w 4k "$img" > "$d/mb"
cat "$d/mb"
mb_uuid="$(awk '$1 == "UUID:" { print $2 }' "$d/mb")"
mb_set="$(awk '$1 == "Set" { print $3 }' "$d/mb")"
# Never registered: nothing for the other modes to show yet.
expect 9 "never registered" bcachefilter-show --journal "$img"
expect 9 "never registered" bcachefilter-show --fsck "$img"
# Options asking for another geometry are refused.
expect 3 "made by make-bcache -C with a bucket size of 256 KiB" \
       bcachefilter-format --bucket-size 512k "$img"
grep -qF -- "--force" "$d/err"
expect 3 "replacement policy of lru, but --replacement asks for random" bcachefilter-format --replacement random "$img"
# The same geometry is fine.
expect 0 "bucket size:      256 KiB (512 sectors)" \
       bcachefilter-format --bucket-size 256k "$img"
test "$(summary_field uuid)" = "$mb_uuid" || fail "the device uuid changed"
test "$(summary_field 'set uuid')" = "$mb_set" || fail "the set uuid changed"
grep -qF "block size:       4 KiB (8 sectors)" "$d/out"
check_cache "$img" 1024

# ------------------------------------------------------------------------
# --size creates a file; a failed format removes it again.

rm -f "$img"
expect 5 "use --size SIZE to create a file" bcachefilter-format "$img"
test ! -e "$img"
expect 0 "set uuid:" bcachefilter-format --size 64M --bucket-size 64k "$img"
test "$(stat -c %s "$img")" = $((64 << 20))
check_cache "$img" 1024
# An existing file keeps its size.
expect 0 "--size is ignored" bcachefilter-format --force --size 128M "$img"
test "$(stat -c %s "$img")" = $((64 << 20))

rm -f "$img"
expect 4 "512 buckets or fewer" bcachefilter-format --size 16M --bucket-size 64k "$img"
grep -qF "removed the file created for it" "$d/err"
test ! -e "$img"

# Too small for its geometry (an existing file is kept).
truncate -s 16M "$img"
expect 4 "a cache of 256 buckets of 64 KiB is too small" \
       bcachefilter-format --bucket-size 64k "$img"
test -e "$img"

# ------------------------------------------------------------------------
# Usage errors: status 1, naming the option.

expect 0 "Usage:" bcachefilter-format --help
expect 0 "bcachefilter-format " bcachefilter-format --version
expect 1 "missing DEVICE" bcachefilter-format
expect 1 "too many arguments" bcachefilter-format "$img" "$img"
expect 1 "Usage:" bcachefilter-format --no-such-option "$img"
expect 1 "--bucket-size 3k: not a power of two" bcachefilter-format -b 3k "$img"
expect 1 "--bucket-size 2k: too small, buckets are at least 4k" \
       bcachefilter-format --bucket-size 2k "$img"
expect 1 "--bucket-size 32M: too large, buckets are at most 16M" \
       bcachefilter-format --bucket-size 32M "$img"
expect 1 "--bucket-size '1Q': unknown unit" bcachefilter-format -b 1Q "$img"
expect 1 "--bucket-size 'big': expected a number" \
       bcachefilter-format -b big "$img"
expect 1 "--bucket-size '99999999999999999999': number too large" \
       bcachefilter-format -b 99999999999999999999 "$img"
expect 1 "--block-size 8k: must be 512, 1k, 2k or 4k" \
       bcachefilter-format -w 8k "$img"
expect 1 "--block-size 256: must be 512, 1k, 2k or 4k" \
       bcachefilter-format --block-size 256 "$img"
expect 1 "--block-size 3000: not a power of two" \
       bcachefilter-format --block-size 3000 "$img"
expect 1 "--replacement 'lfu': must be lru, fifo or random" \
       bcachefilter-format --replacement lfu "$img"
expect 1 "--size 0: must not be zero" bcachefilter-format --size 0 "$img"
# Sizes with units are accepted in every spelling.
rm -f "$img"
expect 0 "bucket size:      1 MiB (2048 sectors)" \
       bcachefilter-format --size 520MiB --bucket-size 1MiB --block-size 4K "$img"

# bcachefilter-show: modes are exclusive; --force is for the superblock.
expect 1 "--journal and --fsck: choose one mode" \
       bcachefilter-show --journal --fsck "$img"
expect 1 "--force applies only to the superblock display" \
       bcachefilter-show --btree --force "$img"
