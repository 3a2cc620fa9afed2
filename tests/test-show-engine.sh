#!/usr/bin/env bash
# bcachefilter: bcachefilter-show's journal, btree, buckets and fsck modes
# on damaged caches.
#
# A cache is made with bcachefilter-format, then damaged in one precise
# way at a time, found through the tool's own output (the root node's
# bucket from --journal, node details from --btree), and every mode must
# give the exit status and message bcachefilter-show(1) documents:
#   - a flipped byte in the root node's checksummed header: the engine
#     refuses to open the cache (status 7, "checksum mismatch");
#   - a zeroed journal: status 7, "holds no valid entry";
#   - a gap in the journal (the newest entry renumbered, checksum
#     recomputed): status 7, the missing entries named;
#   - the newest entry written twice: status 7, the entry named;
#   (the journal mode and the engine's open judge a journal by the same
#   rule, so for each of these they give the same message)
#   - a torn newest entry (bad checksum): not an error — it is ignored,
#     the previous entry is the newest, and the cache is clean;
#   - a zeroed prio bucket: status 7, the prio bucket named;
#   - a key appended to the root leaf (a new bset with a correct
#     checksum) pointing into the prio bucket: the cache opens, --btree
#     shows the key, and --fsck reports the metadata bucket (status 8);
#     a dirty key next to it is counted by --btree and --buckets.
# --fsck is run a second time with stderr on a terminal (script(1)) for
# a clean, a corrupt, a torn and an inconsistent cache: its progress line
# must leave stdout and the exit status as they were, and be erased
# before any message and at the end.
# On-disk structures are edited with a small python3 helper that computes
# bcache's CRC-64 checksums.

source "$(dirname "$0")/functions.sh"
set -e
set -x

requires bcachefilter-format --version
requires bcachefilter-show --version
requires python3 --version
requires truncate --version
requires script --version

tmpdir d

# ------------------------------------------------------------------------
# Helpers

# edit.py: edit a cache image.
#   flip IMG OFFSET                      xor the byte at OFFSET with 1
#   copy IMG FROM TO LEN                 copy LEN bytes from byte FROM to
#                                        byte TO
#   jset-seq IMG OFFSET SEQ              set the seq of the jset at byte
#                                        OFFSET and recompute its checksum
#   node-append IMG NODE_OFFSET PTR MAGIC WRITTEN KEY...
#       append a bset to the btree node at byte NODE_OFFSET (checksums
#       seeded by PTR, the raw pointer of the node's key), at byte WRITTEN
#       of the node, with the node's seq and the keys given as
#       INODE:END:SIZE:DEV:SECTOR:GEN[:dirty]
#   pset-gen IMG PRIO_OFFSET BUCKET      print the gen of BUCKET from the
#                                        prio bucket at byte PRIO_OFFSET
cat > "$d/edit.py" <<'EOF'
import struct, sys

MASK = (1 << 64) - 1

def crc64_update(crc, data):
    # The kernel's crc64_be: MSB first, poly 0x42F0E1EBA9EA3693, no
    # initial value or final xor.
    for b in data:
        crc ^= b << 56
        for _ in range(8):
            crc = ((crc << 1) ^ 0x42F0E1EBA9EA3693) & MASK if crc >> 63 \
                  else (crc << 1) & MASK
    return crc

def bch_crc64(data):
    return crc64_update(MASK, data) ^ MASK

assert bch_crc64(b"123456789") == 0x62EC59E3F1A4F00A

def bset_csum(bset, ptr):
    keys = struct.unpack_from("<I", bset, 28)[0]
    return crc64_update(ptr, bset[8:32 + 8 * keys]) ^ MASK

cmd, path = sys.argv[1], sys.argv[2]
args = sys.argv[3:]
with open(path, "r+b") as f:
    if cmd == "flip":
        off = int(args[0])
        f.seek(off); b = f.read(1)
        f.seek(off); f.write(bytes([b[0] ^ 1]))
    elif cmd == "copy":
        src, dst, n = int(args[0]), int(args[1]), int(args[2])
        f.seek(src); data = f.read(n)
        f.seek(dst); f.write(data)
    elif cmd == "jset-seq":
        off, seq = int(args[0]), int(args[1])
        f.seek(off); j = bytearray(f.read(32768))
        keys = struct.unpack_from("<I", j, 28)[0]
        struct.pack_into("<Q", j, 16, seq)
        struct.pack_into("<Q", j, 0, bch_crc64(bytes(j[8:240 + 8 * keys])))
        f.seek(off); f.write(j[:240 + 8 * keys])
    elif cmd == "node-append":
        off, ptr, magic, written = (int(a, 0) for a in args[:4])
        f.seek(off); first = f.read(4096)
        # The formula must reproduce the node's first bset, or the test
        # would only be testing itself.
        assert struct.unpack_from("<Q", first, 0)[0] == bset_csum(first, ptr), \
            "bset checksum formula does not match the node's first bset"
        assert struct.unpack_from("<Q", first, 8)[0] == magic, "bset magic"
        seq = struct.unpack_from("<Q", first, 16)[0]
        words = b""
        for k in args[4:]:
            p = k.split(":")
            inode, end, size, dev, sector, gen = (int(x) for x in p[:6])
            dirty = len(p) > 6 and p[6] == "dirty"
            high = (1 << 63) | (1 << 60) | (int(dirty) << 36) | (size << 20) | inode
            ptrw = (dev << 51) | (sector << 8) | gen
            words += struct.pack("<QQQ", high, end, ptrw)
        bset = bytearray(32) + words
        struct.pack_into("<QQIi", bset, 8, magic, seq, 1, len(words) // 8)
        struct.pack_into("<Q", bset, 0, bset_csum(bset, ptr))
        f.seek(off + written); f.write(bset)
    elif cmd == "pset-gen":
        off, bucket = int(args[0]), int(args[1])
        f.seek(off + 40 + 3 * bucket)
        print(f.read(3)[2])
    else:
        sys.exit("edit.py: unknown command " + cmd)
EOF
edit () { python3 "$d/edit.py" "$@"; }

# expect STATUS PHRASE CMD...: run CMD; its exit status must be STATUS and
# its output (stdout or stderr) must contain PHRASE.
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
    expect_rc=$rc
}

# tty.py TTY ERR: TTY is what a terminal got on the tool's stderr, ERR
# what a file got.  The progress line ("\rbcachefilter-show: STEP: N%",
# then erase to the end of the line) must be there at least once, and
# each run of it erased ("\r" + erase) before anything else; without it
# the terminal got exactly ERR.
cat > "$d/tty.py" <<'EOF'
import re, sys
tty = open(sys.argv[1], "rb").read().replace(b"\r\n", b"\n")
err = open(sys.argv[2], "rb").read()
line = rb"\rbcachefilter-show: [a-z ]+: [0-9]+%\x1b\[K"
assert re.search(line, tty), "no progress line on the terminal: %r" % tty
rest = re.sub(b"(" + line + rb")+\r\x1b\[K", b"", tty)
assert rest == err, "the terminal got %r, a file %r" % (rest, err)
EOF

# expect_tty CMD...: CMD again, with stderr on a terminal: the same exit
# status and stdout as the expect just before, the same messages on
# stderr, and the progress line only between them (tty.py).
expect_tty ()
{
    local rc=0
    script -qec "$(printf '%q ' "$@") > $(printf '%q' "$d/tty.out")" \
           /dev/null > "$d/tty.err" || rc=$?
    cat -v "$d/tty.err"
    test "$rc" -eq "$expect_rc" ||
        fail "'$*' on a terminal exited with status $rc, not $expect_rc"
    cmp "$d/out" "$d/tty.out" ||
        fail "'$*': stdout differs when stderr is a terminal"
    python3 "$d/tty.py" "$d/tty.err" "$d/err" ||
        fail "'$*': the progress line on the terminal is wrong"
}

# jget FILE EXPR: a python expression over the JSON in FILE, as j.
jget ()
{
    python3 -c 'import json, sys
j = json.load(open(sys.argv[1]))
print(eval(sys.argv[2]))' "$1" "$2" || fail "$1: '$2' fails"
}

# A fresh, formatted cache: 512 MiB, 512 KiB buckets, 4 KiB blocks.
# Sets $bb (bucket bytes), $bs (block bytes), $bsec (bucket sectors),
# and from the newest journal entry $root (the root node's bucket),
# $root_ptr (its raw pointer), $prio (the prio bucket), $jb/$joff (where
# the newest entry is) and $seq / $last_seq.
good="$d/good.img"
truncate -s 512M "$good"
bcachefilter-format --bucket-size 512k --block-size 4k "$good"
bb=524288 bs=4096 bsec=1024
img="$d/cache.img"

fresh ()
{
    cp "$good" "$img"
}

fresh
expect 0 "clean:" bcachefilter-show --fsck "$img"
expect_tty bcachefilter-show --fsck "$img"
expect 0 '"status": "ok"' bcachefilter-show --journal --json "$img"
cp "$d/out" "$d/journal.json"
newest='[e for e in j["entries"] if e["newest"]][0]'
root="$(jget "$d/journal.json" "$newest['btree_root']['bucket']")"
root_ptr="$(jget "$d/journal.json" \
  "($newest['btree_root']['dev'] << 51) | ($newest['btree_root']['offset'] << 8) | $newest['btree_root']['gen']")"
prio="$(jget "$d/journal.json" "$newest['prio_bucket']")"
jb="$(jget "$d/journal.json" "$newest['bucket']")"
joff="$(jget "$d/journal.json" "$newest['offset']")"
seq="$(jget "$d/journal.json" "$newest['seq']")"
last_seq="$(jget "$d/journal.json" "$newest['last_seq']")"
test "$seq" = "$last_seq"   # a fresh cache needs only its newest entry
expect 0 "root bucket $root level 0" bcachefilter-show --btree "$img"
bcset="$(bcachefilter-show --json "$img" |
         python3 -c 'import json,sys; print(json.load(sys.stdin)["cset"]["bset_magic"])')"

# ------------------------------------------------------------------------
# A flipped byte in the root node's first bset (its seq, inside the
# checksummed part): the engine refuses to open the cache.

fresh
edit flip "$img" $((root * bb + 16))
msg="corrupt: btree node at bucket $root (level 0): bset 0 at byte 0: checksum mismatch"
expect 7 "$msg" bcachefilter-show --btree "$img"
test ! -s "$d/out" || fail "--btree printed output for a cache it cannot open"
expect 7 "$msg" bcachefilter-show --fsck "$img"
expect 7 "$msg" bcachefilter-show --buckets "$img"
expect 7 "$msg" bcachefilter-show --fsck --json "$img"
test ! -s "$d/out"
# The journal itself is intact, and so is the superblock.
expect 0 "all present" bcachefilter-show --journal "$img"
expect 0 "sb.magic" bcachefilter-show "$img"

# A flipped byte in the node's padding (after its empty first bset, not
# covered by any checksum) is harmless.
fresh
edit flip "$img" $((root * bb + 100))
expect 0 "clean: 1 nodes, 0 keys, 1024 buckets checked" \
       bcachefilter-show --fsck "$img"

# ------------------------------------------------------------------------
# A zeroed journal.

fresh
first_jb="$(jget "$d/journal.json" 'j["journal_buckets"][0]')"
njb="$(jget "$d/journal.json" 'len(j["journal_buckets"])')"
dd if=/dev/zero of="$img" bs="$bb" seek="$first_jb" count="$njb" \
   conv=notrunc status=none
expect 7 "the journal holds no valid entry" bcachefilter-show --journal "$img"
grep -qx "no valid entry" "$d/out"
expect 7 '"status": "corrupt"' bcachefilter-show --journal --json "$img"
expect 7 "corrupt: the journal holds no valid entry" \
       bcachefilter-show --fsck "$img"
expect_tty bcachefilter-show --fsck "$img"
expect 7 "the journal holds no valid entry" bcachefilter-show --btree "$img"

# ------------------------------------------------------------------------
# A gap: the newest entry renumbered seq + 2 (its last_seq unchanged, the
# checksum recomputed), so entries seq..seq+1 are missing.

fresh
edit jset-seq "$img" $((jb * bb + joff)) $((seq + 2))
expect 7 "journal entries $seq-$((seq + 1)) missing: the newest entry, $((seq + 2)), needs every entry from its last_seq $last_seq on" \
       bcachefilter-show --journal "$img"
grep -qF "replay needs entries $last_seq-$((seq + 2)): some are MISSING" "$d/out"
expect 7 '"from": '"$seq" bcachefilter-show --journal --json "$img"
test "$(jget "$d/out" 'j["missing"]')" = "[{'from': $seq, 'to': $((seq + 1))}]"
test "$(jget "$d/out" 'j["status"]')" = corrupt
# The engine's open (--fsck, --btree) refuses it by the same verdict, with
# the same message.
gap="journal entries $seq-$((seq + 1)) missing: the newest entry, $((seq + 2)), needs every entry from its last_seq $last_seq on"
expect 7 "corrupt: $gap" bcachefilter-show --fsck "$img"
expect 7 "corrupt: $gap" bcachefilter-show --btree "$img"

# ------------------------------------------------------------------------
# A duplicate: the newest entry (one block: a fresh cache's entries hold
# no keys) copied into the free block after it.

fresh
edit copy "$img" $((jb * bb + joff)) $((jb * bb + joff + bs)) $bs
dup="journal entry $seq is present more than once: the journal is corrupt"
expect 7 "$dup" bcachefilter-show --journal "$img"
grep -qF "replay needs entries $last_seq-$seq: some are DUPLICATED" "$d/out"
expect 7 "corrupt: $dup" bcachefilter-show --fsck "$img"

# ------------------------------------------------------------------------
# A torn newest entry (its checksum no longer matches): as after a crash
# during the write, it is ignored and the entry before it is the newest.
# Not an error.

fresh
edit flip "$img" $((jb * bb + joff + 20))
expect 0 "bucket $jb offset $joff: ignored: " bcachefilter-show --journal "$img"
grep -q "seq $((seq - 1)), .*\[newest\]$" "$d/out" ||
    fail "the entry before the torn one is not the newest"
grep -qF ": all present" "$d/out"
expect 0 "clean: 1 nodes" bcachefilter-show --fsck "$img"
expect_tty bcachefilter-show --fsck "$img"
expect 0 '"ignored"' bcachefilter-show --journal --json "$img"
test "$(jget "$d/out" 'len(j["ignored"])')" = 1

# ------------------------------------------------------------------------
# A zeroed prio bucket: bucket gens cannot be read.

fresh
dd if=/dev/zero of="$img" bs="$bb" seek="$prio" count=1 conv=notrunc status=none
expect 7 "prio bucket $prio:" bcachefilter-show --fsck "$img"
grep -qF "corrupt: reading the prio buckets (bucket gens): corrupt" "$d/err"
expect 7 "prio bucket $prio:" bcachefilter-show --buckets "$img"
# The journal does not cover the prio bucket.
expect 0 "all present" bcachefilter-show --journal "$img"

# ------------------------------------------------------------------------
# Keys appended to the root leaf, as a second bset with a correct
# checksum: a dirty extent in data bucket 100, and an extent pointing into
# the prio bucket (a metadata bucket: the bucket must have been reused
# while still referenced).  The cache opens; fsck finds the second.

fresh
written="$(bcachefilter-show --btree --json "$img" |
           python3 -c 'import json,sys; print(json.load(sys.stdin)["nodes"][0]["written"])')"
test "$written" = "$bs"
gen100="$(edit pset-gen "$img" $((prio * bb)) 100)"
genp="$(edit pset-gen "$img" $((prio * bb)) "$prio")"
edit node-append "$img" $((root * bb)) "$root_ptr" "$bcset" "$written" \
     "1:64:8:0:$((100 * bsec)):$gen100:dirty" \
     "1:72:8:0:$((prio * bsec + 8)):$genp"

expect 8 "problem: live extent 64+8 points into metadata bucket $prio" \
       bcachefilter-show --fsck "$img"
grep -qF "fsck found 1 problem in 1 nodes, 2 keys, 1024 buckets" "$d/err"
expect_tty bcachefilter-show --fsck "$img"
expect 8 '"status": "inconsistent"' bcachefilter-show --fsck --json "$img"
expect_tty bcachefilter-show --fsck --json "$img"
test "$(jget "$d/out" 'j["problems"]')" = \
     "['live extent 64+8 points into metadata bucket $prio']"

expect 0 "summary: 1 nodes, depth 1, 2 keys, 8 dirty sectors" \
       bcachefilter-show --btree -v "$img"
grep -qF "node bucket $root level 0: 2 keys, $((2 * bs)) bytes written, range (0:0, max], 8 dirty sectors" "$d/out"
grep -qx "    key 1:56+8 -> 0:$((100 * bsec)) gen $gen100 dirty" "$d/out"
grep -qx "    key 1:64+8 -> 0:$((prio * bsec + 8)) gen $genp" "$d/out"
expect 0 '"dirty": true' bcachefilter-show --btree -v --json "$img"
test "$(jget "$d/out" '[k["start"] for k in j["nodes"][0]["key_list"]]')" = "[56, 64]"
test "$(jget "$d/out" 'j["summary"]["dirty_sectors"]')" = 8

expect 0 "buckets.dirty		1" bcachefilter-show --buckets "$img"
grep -qF "buckets.data		1" "$d/out"
expect 0 '"data_buckets": 1' bcachefilter-show --buckets --json "$img"
test "$(jget "$d/out" 'j["dirty"]["buckets"]')" = 1

# bcachefilter-format sees the dirty data and refuses to destroy it.
expect 3 "DIRTY data in 1 buckets" bcachefilter-format "$img"
grep -qF -- "use --force" "$d/err"

# A key whose gen is older than its bucket's is stale: GC drops it, and
# it is no problem.
fresh
edit node-append "$img" $((root * bb)) "$root_ptr" "$bcset" "$written" \
     "1:64:8:0:$((100 * bsec)):$(( (gen100 + 255) % 256 )):dirty"
expect 0 "summary: 1 nodes, depth 1, 0 keys, 0 dirty sectors" \
       bcachefilter-show --btree "$img"
expect 0 "clean: 1 nodes, 0 keys" bcachefilter-show --fsck "$img"
