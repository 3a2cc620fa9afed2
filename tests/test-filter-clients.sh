#!/usr/bin/env bash
# bcachefilter: real NBD clients through the filter.
#
# remote: nbdkit memory 32M; proxy: the filter in writethrough mode with
# a 64 MiB cache and a control socket (each part checks, from the stats,
# that the cache took part).  Each part is skipped if its tool is
# missing:
#   - qemu-img convert a random 32M file into the proxy, then qemu-img
#     compare it back (through the proxy, twice: the second time from
#     the cache), and against the remote directly;
#   - qemu-io writes patterns (-P) at aligned and unaligned offsets and
#     reads them back with pattern verification, including after a
#     restart of the proxy;
#   - nbdcopy file -> proxy and proxy -> file, compared with cmp;
#   - fio's nbd engine: a short random-write run with crc32c
#     verification (do_verify reads everything back), then a random-read
#     verify pass.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires cmp --version
requires bcachefilter-ctl --help

tmpdir d
start_remote memory 32M
p=(bcache="$d/cache" bcache-size=64M bcache-ctl="$d/ctl")
start_proxy p "${p[@]}"
ran=0

# hits, misses: the proxy's reads served from the cache, and from the
# export, now.  A read the sequential cutoff bypasses still reads what the
# cache holds (cache_bypass_hits): which reads of a stream count as
# bypassed depends on the order the client's parallel requests arrive in.
stat_sum () { echo $(( $(ctl_stat "$d/ctl" "$1") + $(ctl_stat "$d/ctl" "$2") )); }
hits () { stat_sum cache_hits cache_bypass_hits; }
misses () { stat_sum cache_misses cache_bypass_misses; }

head -c 32M /dev/urandom > "$d/data"

# ---------------------------------------------------------------------
if qemu-img --version >/dev/null 2>&1; then
    ran=$((ran + 1))
    qemu-img convert -n -p -f raw -O raw "$d/data" "$p_uri"
    qemu-img compare -f raw -F raw "$d/data" "$p_uri"
    h0=$(hits) m0=$(misses)
    qemu-img compare -f raw -F raw "$d/data" "$p_uri"
    h1=$(hits) m1=$(misses)
    echo "$0: qemu-img compare: cache hits $h0 -> $h1, misses $m0 -> $m1"
    bcachefilter-ctl -s "$d/ctl" stats
    test "$h1" -gt "$h0" || fail "the second qemu-img compare had no cache hit"
    # Every write was cached (none dropped): then the second compare
    # reads nothing from the export.
    if [ "$(ctl_stat "$d/ctl" write_collisions)" -eq 0 ] &&
       [ "$(ctl_stat "$d/ctl" fills_dropped)" -eq 0 ]; then
        test "$m1" -eq "$m0" ||
            fail "the second qemu-img compare read from the export"
    fi
    qemu-img compare -f raw -F raw "$d/data" \
        "nbd+unix:///?socket=$remote_sock" ||
        fail "the remote does not hold what qemu-img convert wrote"
else
    echo "$0: qemu-img is missing: skipped"
fi

# ---------------------------------------------------------------------
if qemu-io --version >/dev/null 2>&1; then
    ran=$((ran + 1))
    # qemu-io prints "Pattern verification failed" (and may still exit
    # 0), so its output is checked.
    qio ()
    {
        qemu-io -f raw "$p_uri" "$@" > "$d/qio.out" 2>&1 || {
            cat "$d/qio.out"; fail "qemu-io $* failed"; }
        cat "$d/qio.out"
        if grep -Eiq 'verification failed|error|fail' "$d/qio.out"; then
            fail "qemu-io $*: see above"
        fi
    }
    qio -c 'write -P 0xa5 0 1M' -c 'write -P 0x5a 1M 3M' \
        -c 'write -P 0x11 12345 7777' -c 'write -P 0x22 8M 1' \
        -c 'write -z 20M 1M' -c 'discard 28M 64k'
    qio -c 'read -P 0xa5 0 12345' -c 'read -P 0x11 12345 7777' \
        -c 'read -P 0xa5 20122 1028454' -c 'read -P 0x5a 1M 3M' \
        -c 'read -P 0x22 8M 1' -c 'read -P 0 20M 1M' -c 'read -P 0 28M 64k'
    # Again from the cache, then after a restart.
    qio -c 'read -P 0x5a 1M 3M' -c 'read -P 0x11 12345 7777'
    stop_nbdkit "$p_pid"
    start_proxy p "${p[@]}"
    qio -c 'read -P 0xa5 0 12345' -c 'read -P 0x11 12345 7777' \
        -c 'read -P 0x5a 1M 3M' -c 'read -P 0x22 8M 1' \
        -c 'read -P 0 20M 1M' -c 'read -P 0 28M 64k'
    qio -c 'aio_write -P 0x33 24M 64k' -c 'aio_write -P 0x44 25M 64k' \
        -c 'aio_flush' -c 'read -P 0x33 24M 64k' -c 'read -P 0x44 25M 64k'
else
    echo "$0: qemu-io is missing: skipped"
fi

# ---------------------------------------------------------------------
if nbdcopy --version >/dev/null 2>&1; then
    ran=$((ran + 1))
    head -c 32M /dev/urandom > "$d/data2"
    nbdcopy --flush "$d/data2" "$p_uri"
    nbdcopy "$p_uri" "$d/out"
    cmp "$d/data2" "$d/out" || fail "nbdcopy out of the proxy differs"
    h0=$(hits)
    rm -f "$d/out"
    nbdcopy "$p_uri" "$d/out"
    cmp "$d/data2" "$d/out" || fail "nbdcopy out of the proxy differs (second copy)"
    echo "$0: nbdcopy: cache hits $h0 -> $(hits)"
    # And the remote holds it.
    rm -f "$d/out"
    nbdcopy "nbd+unix:///?socket=$remote_sock" "$d/out"
    cmp "$d/data2" "$d/out" || fail "the remote does not hold what nbdcopy wrote"
else
    echo "$0: nbdcopy is missing: skipped"
fi

# ---------------------------------------------------------------------
if fio --enghelp=nbd >/dev/null 2>&1; then
    ran=$((ran + 1))
    cd "$d"         # fio may leave files in the current directory
    f=(--ioengine=nbd --uri="$p_uri" --size=16M --bs=4k --iodepth=8
       --verify=crc32c --verify_fatal=1 --group_reporting --offset=16M
       --verify_state_save=0)
    timeout 120 fio --name=write --rw=randwrite --do_verify=1 "${f[@]}" \
        --output="$d/fio1" || { cat "$d/fio1"; fail "fio write+verify failed"; }
    cat "$d/fio1"
    # A second verify-only pass over what was written (now cached).
    timeout 120 fio --name=write --rw=randwrite --verify_only=1 "${f[@]}" \
        --output="$d/fio2" || { cat "$d/fio2"; fail "fio verify pass failed"; }
    cat "$d/fio2"
    grep -Eiq 'verify.*(fail|bad)' "$d/fio1" "$d/fio2" &&
        fail "fio reported a verify failure"
else
    echo "$0: fio with the nbd engine is missing: skipped"
fi

stop_nbdkit "$p_pid"
if [ "$ran" -eq 0 ]; then
    echo "$0: test skipped because no client tool is installed"
    exit 77
fi
