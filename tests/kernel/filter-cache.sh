# bcachefilter kernel test: a cache the filter used, read by the kernel,
# written by the kernel, and served by the filter again
# (test-kernel-used.sh: clean stop; test-kernel-crash.sh: kill -9).
# -*- shell-script -*-
#
# The export is a bcache backing device (make-bcache -B: data from byte
# 8192) behind nbdkit's file plugin; the filter serves its data region,
# keys at backing sectors, and marks it attached to its cache, as the
# kernel would: so the pair is one the kernel takes as it is.
#
#  1. The filter caches a random workload (64 KiB buckets and small
#     writes, so that the btree has interior nodes), and stops (clean, or
#     kill -9 in the middle of a second workload).
#     The kill -9 case runs its second workload without write-intent
#     regions (bcache-write-intent=false): a cache that crashed with a
#     region marked carries an incompatible feature bit, so that a kernel,
#     which does not know the marks, refuses it rather than serve clean
#     data the filter's recovery would drop (core/intent.c).  That the
#     kernel does refuse such a cache is the case's extra step (0.).
#  0. (kill -9 case) A small cache crashed with a region marked: the
#     kernel must refuse it, and the filter's next open clears the bit.
#  2. The kernel gets the cache and a copy of the backing device whose
#     data region is poisoned (all 0xA5): it registers both, attaches the
#     device by itself (its superblock names the cache set, clean), and
#     reads /dev/bcache0 whole (cache_mode none).  Every sector the
#     filter's btree holds must read as the data the filter cached, every
#     other as 0xA5: the first kind is proven to come from the cache.
#  3. The kernel writes 32 ranges (writethrough), reads them back, runs
#     GC and stops.
#  4. The filter opens the cache the kernel wrote, in front of that
#     backing copy, and must serve: what it cached itself where the
#     kernel did not write, the kernel's data where it did, the backing
#     copy elsewhere (kcheck.py roundtrip).
#
# A test is "source filter-cache.sh" and "filter_cache_case MODE", MODE
# clean or kill: this file sources the helpers and sets the shell up.

source "$(dirname "${BASH_SOURCE[0]}")/../functions.sh"
source "$(dirname "${BASH_SOURCE[0]}")/../filter/common.sh"
source "$(dirname "${BASH_SOURCE[0]}")/kernel.sh"
set -e
set -x

# marked_cache CACHE REMOTE: a 64 MiB cache that crashed (kill -9) with
# a write-intent region marked: a write over cached data that a crash
# could bring back, in front of the file REMOTE; the superblock must
# carry the write-intent bit.  The range is read and the proxy stopped
# first, so that the write goes over clean data a checkpoint wrote,
# which is what needs the mark (over nothing cached a write is cached
# afterwards as a fill; over data that only memory has it needs
# nothing; over a write's clean copy, whose dirty version stays on the
# journal until a checkpoint, its own keys are journalled and waited
# for instead, the mark not being enough there).
marked_cache ()
{
    local mc="$1" mr="$2"

    truncate -s 16M "$mr"
    start_remote file "$mr"
    start_proxy p bcache="$mc" bcache-size=64M bcache-bucket-size=64K \
        "${cache_all[@]}"
    nbdio "$p_sock" check 0 64k 0x00        # cached: a fill
    nbdio "$p_sock" flush                   # (fills queued before are in)
    stop_nbdkit "$p_pid"                    # the clean stop writes it
    start_proxy p bcache="$mc" bcache-format=never \
        "${cache_all[@]}" bcache-ctl="$d/marked.ctl"
    nbdio "$p_sock" fill 0 64k 0x22         # over cached data: marks
    test "$(ctl_stat "$d/marked.ctl" intent_regions)" -ge 1 ||
        fail "no write-intent region marked"
    crash_nbdkit "$p_pid"
    stop_nbdkit "$remote_pid"
    test "$(bcachesb show "$mc" feature_incompat)" = 9223372036854775808 ||
        fail "a cache crashed with a region marked has no write-intent bit"
}

# marked_cache_reopen CACHE REMOTE: the filter's next open recovers the
# marks, clears the bit, and serves the acknowledged write.
marked_cache_reopen ()
{
    local mc="$1" mr="$2"

    start_remote file "$mr"
    start_proxy p bcache="$mc" bcache-format=never
    nbdio "$p_sock" check 0 64k 0x22 ||
        fail "the reopened cache lost an acknowledged write"
    stop_nbdkit "$p_pid"
    stop_nbdkit "$remote_pid"
    test "$(bcachesb show "$mc" feature_incompat)" = 0 ||
        fail "the open that recovered the marks left the write-intent bit"
    bcachefilter-show --fsck "$mc" || fail "fsck of the reopened cache"
}

filter_cache_case ()
{
    local mode="$1" data=$((64 << 20)) img c set cached ops=3000

    filter_requires
    kernel_requires
    requires command -v make-bcache
    tmpdir d
    img="$d/bdev.img" c="$d/cache.img"

    truncate -s $((data + 8192)) "$img"
    make-bcache -B -w 4k "$img" > /dev/null
    kcheck pattern "$img" 8192 "$data" "data-$mode"
    dd if="$img" of="$d/mirror.img" bs=8192 skip=1 status=none
    start_remote file "$img"

    # 1. The filter's turn.
    start_proxy p bcache="$c" bcache-size=256M bcache-bucket-size=64K \
        "${cache_all[@]}" bcache-ctl="$d/ctl"
    test "$(nbdio "$p_sock" size)" = "$data" || fail "not the data region"
    kcheck workload "$p_uri" --mirror "$d/mirror.img" --log "$d/ops.log" \
        --ops $ops --seed "w-$mode" --max 8192 ||
        fail "the first workload read wrong data"
    bcachefilter-ctl -s "$d/ctl" stats
    test "$(ctl_stat "$d/ctl" btree_depth)" -ge 2 ||
        fail "the btree has no interior node for the kernel to read"
    if [ "$mode" = kill ]; then
        stop_nbdkit "$p_pid"
        start_proxy p bcache="$c" "${cache_all[@]}" \
            bcache-write-intent=false bcache-ctl="$d/ctl"
        kcheck workload "$p_uri" --mirror "$d/mirror.img" --log "$d/ops2.log" \
            --duration 30 --seed "x-$mode" --write-frac 0.8 --max 8192 \
            > "$d/workload2.json" 2>&1 &
        local wl=$!
        cleanup_fn kill "$wl"
        sleep 4
        crash_nbdkit "$p_pid"
        wait "$wl" || true
        cat "$d/workload2.json"
        grep -q '"read_mismatches": 0' "$d/workload2.json" ||
            fail "the second workload read wrong data"
        echo "writes when killed: $(grep -c '"sent"' "$d/ops2.log") sent," \
             "$(grep -c '"done"' "$d/ops2.log") acknowledged"
    else
        stop_nbdkit "$p_pid"
    fi
    stop_nbdkit "$remote_pid"
    local drives=("$d/vmcache.img" "$d/backing.img" "$d/dump.img") refuse=
    if [ "$mode" = kill ]; then
        marked_cache "$d/marked.img" "$d/marked-remote.img"
        drives+=("$d/marked.img")
        refuse="/dev/vdd:$(bcachesb show "$d/marked.img" set_uuid)"
    fi
    set="$(bcachesb show "$c" set_uuid)"
    test "$(bcachesb show "$img" set_uuid)" = "$set" ||
        fail "the backing device is not attached to the cache set"
    test "$(bcachesb show "$img" state)" = clean
    bcachefilter-show --fsck "$c" || fail "fsck of the filter's cache"
    bcachefilter-show --btree -v --json "$c" > "$d/btree.json"
    bcachefilter-show --btree "$c" | tail -1
    cached="$(kcheck cached "$d/btree.json" --sectors $((data / 512)) \
              --shift 16 --out "$d/cached.json")"
    echo "the filter's cache holds: $cached"

    # 2, 3. The kernel's turn, with the data region poisoned.
    dd if="$img" of="$d/orig.img" bs=8192 skip=1 status=none
    # Where the cache holds dirty keys (after a kill -9: a write whose key
    # was durable before its backing write was done), the cache has the
    # newest data, and a kernel serves it, as for any dirty key.
    kcheck dirty-overlay "$d/btree.json" "$c" "$d/orig.img" \
        --sectors $((data / 512)) --shift 16
    cp --sparse=always "$img" "$d/backing.img"
    bcachesb poison "$d/backing.img" 0xA5
    cp --sparse=always "$c" "$d/vmcache.img"
    truncate -s "$data" "$d/dump.img"
    mkdir -p "$d/vm.data"
    kcheck kwrites "$d/vm.data/kwrites" "$d/vm.data/pat" --n 32 \
        --size "$data" --seed "k-$mode"
    printf 'CACHES="/dev/vda:%s"\nBDEV=/dev/vdb\nDUMP=/dev/vdc\nKWRITES=1\nGC=1\nREFUSE=%s\n' \
           "$set" "$refuse" > "$d/vm.data/params"
    vm_boot vm "$kerneldir/vm-cache.sh" "${drives[@]}"
    vm_report vm
    if [ -n "$refuse" ]; then
        vm_said vm "refused-refused" ||
            fail "the kernel registered a cache that crashed with" \
                 "write-intent regions marked"
        vm_kernel_lines vm | grep -q "Unsupported incompatible feature" ||
            fail "the kernel did not refuse it for the feature bit"
        marked_cache_reopen "$d/marked.img" "$d/marked-remote.img"
    fi
    vm_said vm "cset-appeared $set" || fail "the kernel did not register the cache"
    vm_said vm "attached clean" ||
        fail "the kernel did not attach the backing device (clean) by itself"
    test "$(vm_value vm bcache0-sectors)" = $((data / 512)) ||
        fail "bcache0 is not the data region"
    test "$(vm_value vm kwrites-mismatches)" = 0 ||
        fail "the kernel read back other data than it wrote"
    vm_said vm "stopped-cleanly" || fail "the kernel did not stop cleanly"
    local trouble
    # The refusal of step 0 is an error line, the expected one.
    trouble="$(vm_trouble vm | grep -v "Unsupported incompatible feature" || true)"
    [ -z "$trouble" ] || fail "the kernel complained: $trouble"
    echo "----- what the kernel read through /dev/bcache0 -----"
    kcheck compare --dump "$d/dump.img" --expect "$d/orig.img" \
        --cached "$d/cached.json" --poison 0xA5 ||
        fail "the kernel did not read the filter's cached data right"

    # 4. The filter again, on the cache the kernel left.
    bcachefilter-show --fsck "$d/vmcache.img" || fail "fsck after the kernel"
    bcachefilter-show --btree -v --json "$d/vmcache.img" > "$d/btree.after.json"
    kcheck cached "$d/btree.after.json" --sectors $((data / 512)) --shift 16 \
        --out "$d/cached.after.json"
    dd if="$d/backing.img" of="$d/after.img" bs=8192 skip=1 status=none
    kcheck roundtrip --first "$d/cached.json" --final "$d/cached.after.json" \
        --orig "$d/orig.img" --after "$d/after.img" \
        --kwrites "$d/vm.data/kwrites" --out "$d/expect.img"
    start_remote file "$d/backing.img"
    # Mode none: hits are served, nothing new is cached (a fill could
    # evict what the expectation counts as cached).
    start_proxy p bcache="$d/vmcache.img" bcache-format=never \
        bcache-mode=none "${cache_all[@]}"
    kcheck dump "$p_uri" "$d/filter.img"
    stop_nbdkit "$p_pid"
    cmp "$d/filter.img" "$d/expect.img" ||
        fail "the filter does not serve what the kernel left in the cache"
    echo "$0: OK: the kernel and the filter read each other's cache"
}
