#!/usr/bin/env bash
# bcachefilter: bcachefilter-show --verify compares the cache's clean
# data with the export.
#
#  1. The remote is nbdkit file over $d/backing.  Through the proxy
#     (writethrough, no sequential cutoff) write [0, 4M) and read
#     [8M, 12M), so that both are cached, then stop the proxy.
#  2. --verify CACHE URI-of-the-remote: every clean extent agrees, exit 0,
#     and the summary counts the bytes checked.
#  3. Change bytes of the backing file behind the cache's back (at 1M +
#     100 and at 9M): --verify names both extents and the first
#     differing byte of each, and exits 1.
#  4. Usage and connection errors exit 2.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-show --version
requires head --version

tmpdir d
M=$((1024 * 1024))
truncate -s 16M "$d/backing"
start_remote file "$d/backing"
remote_uri="nbd+unix:///?socket=$remote_sock"

head -c 4M /dev/urandom > "$d/a"
head -c 4M /dev/urandom > "$d/b"
# B is written to the backing file directly, then read through the proxy.
dd if="$d/b" of="$d/backing" bs=1M seek=8 conv=notrunc status=none

start_proxy p bcache="$d/cache" bcache-size=64M bcache-mode=writethrough \
            bcache-sequential-cutoff=0
nbdio "$p_sock" wfile 0 "$d/a"
# A miss is inserted after the client has its answer: read B a few
# times and flush; the check below counts the bytes cached.
for i in 1 2 3; do nbdio "$p_sock" sha 8M 4M > /dev/null; done
nbdio "$p_sock" flush
stop_nbdkit "$p_pid"

# 2. All agree.
st=0
bcachefilter-show --verify "$d/cache" "$remote_uri" > "$d/out" 2>&1 || st=$?
cat "$d/out"
test "$st" -eq 0 || fail "--verify of an untouched cache exited $st, not 0"
grep -E '^[0-9]+ extents? checked \(([0-9]+) bytes\), 0 differ' "$d/out" ||
    fail "--verify: no summary line with 0 differing"
bytes=$(sed -nE 's/.* checked \(([0-9]+) bytes\).*/\1/p' "$d/out")
test "$bytes" -ge $((4 * M)) ||
    fail "--verify checked $bytes bytes: the written 4M were not cached"

# 3. Corrupt the export behind the cache's back: each of 3 bytes
# replaced by its complement, so that the first of them differs for sure
# (a constant string matched the random byte there 1 time in 256, and
# the first difference was then one byte further on).
flip3 ()        # flip3 OFFSET
{
    local b out=
    for b in $(od -An -tu1 -j "$1" -N 3 "$d/backing"); do
        out+=$(printf '\\%03o' $((255 - b)))
    done
    printf "$out" | dd of="$d/backing" bs=1 seek="$1" conv=notrunc status=none
}
flip3 $((M + 100))
flip3 $((9 * M))
st=0
bcachefilter-show --verify "$d/cache" "$remote_uri" > "$d/out" 2>&1 || st=$?
cat "$d/out"
test "$st" -eq 1 || fail "--verify of a changed export exited $st, not 1"
grep -E "^differs: export offset [0-9]+ length [0-9]+ .*first differing byte at export offset $((M + 100))\$" "$d/out" ||
    fail "--verify did not report the extent changed at 1M + 100"
if [ "$bytes" -ge $((8 * M)) ]; then
    grep -E "first differing byte at export offset $((9 * M))\$" "$d/out" ||
        fail "--verify did not report the extent changed at 9M"
fi
grep -E '^[0-9]+ extents? checked .*, [12] differs?,' "$d/out" ||
    fail "--verify: the summary does not count the differing extents"

# 4. Errors: 2.
st=0
bcachefilter-show --verify "$d/cache" > "$d/out" 2>&1 || st=$?
cat "$d/out"
test "$st" -eq 2 || fail "--verify without a URI exited $st, not 2"
st=0
bcachefilter-show --verify "$d/cache" "nbd+unix:///?socket=$d/nothing.sock" \
    > "$d/out" 2>&1 || st=$?
cat "$d/out"
test "$st" -eq 2 || fail "--verify with no server exited $st, not 2"
grep -F "cannot read the export" "$d/out" ||
    fail "--verify with no server: no message saying so"
st=0
bcachefilter-show --verify "$d/backing" "$remote_uri" > "$d/out" 2>&1 || st=$?
cat "$d/out"
test "$st" -eq 2 || fail "--verify of a non-bcache device exited $st, not 2"
