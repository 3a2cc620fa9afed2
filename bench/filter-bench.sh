#!/usr/bin/env bash
# filter-bench.sh: bcachefilter end to end, next to the alternatives.
#
# WHAT IT MEASURES
#   fio's nbd engine (one job, iodepth 16, the same as nbdkit's default of
#   16 threads per connection) against the configs below.  The proxy and
#   cache configs serve the same "remote": nbdkit's memory plugin, filled
#   with random data, behind `--filter=delay delay-read=1ms delay-write=1ms`
#   on a unix socket.  It stands in for a NAS.  The ceilings (file, filepc,
#   qemunbd) serve a local copy of the same data, with no remote at all.
#
#     remote        fio talks to the remote directly (no proxy)
#     proxy         nbdkit nbd plugin -> remote (pass-through proxy)
#     qemuproxy     qemu-nbd -f raw --persistent --shared=16 on the remote's
#                   NBD URI: a pass-through proxy that is not nbdkit (one
#                   thread, coroutines, no hand-off between threads per
#                   request).  Next to proxy it shows how much of the
#                   proxy's cost is nbdkit's hop rather than any second hop.
#                   Skipped with a warning if qemu-nbd is not installed.
#     cachefilter   nbdkit --filter=cache cache=writeback cache-on-read=true
#                   nbd -> remote (its cache file goes in $WORKDIR)
#     bcachefilter  nbdkit --filter=$FILTER_SO nbd -> remote,
#                   bcache=$WORKDIR/cache.img bcache-size=2*SIZE
#                   (default mode writethrough, the cache file is O_DIRECT)
#     bcachefilter-wb  the same with bcache-mode=writeback: writes complete
#                   in the cache, the writeback thread sends them on at
#                   bcache's rate (writeback_percent 10)
#     bcachefilter-pc  the same plus bcache-direct=false: the cache file goes
#                   through the page cache.  Its own fresh cache file and its
#                   own warm-up.  Compare it with filepc.
#     bcachefilter-je  (not in the default set) bcachefilter with nbdkit
#                   under LD_PRELOAD=$JEMALLOC (the filter cannot link
#                   jemalloc: nbdkit dlopens it).  Next to bcachefilter it
#                   shows what jemalloc does for the proxy's allocations;
#                   skipped with a warning if $JEMALLOC cannot be preloaded.
#     bcachefilter-none  the same with bcache-mode=none: the filter in the
#                   path, caching nothing (every request passes through,
#                   reads still look up the index).  Against proxy it shows
#                   what the filter itself costs per request, apart from
#                   the work of caching.  No warm-up (it would cache
#                   nothing).
#     file          nbdkit file plugin, cache=none, on a local file in
#                   $WORKDIR: the issue's ceiling (no remote at all).  NB:
#                   in nbdkit 1.32 cache=none is not O_DIRECT, it is
#                   posix_fadvise(DONTNEED) after each request, and a good
#                   part of its reads still come from the page cache (see the
#                   "device reads/IO" column).
#     filepc        the file plugin with the page cache (cache=default), for
#                   reference: a second, higher ceiling.  For hits, the data
#                   file is read once first, so that it starts in the page
#                   cache (the cache=none run evicts part of it).
#     fileshm       (not in the default set) the file plugin on a copy of
#                   the data in /dev/shm: nbdkit with no device at all, only
#                   a copy into memory per request and a flush that does
#                   nothing.  What nbdkit, the client and the kernel cost
#                   per request before any storage: the floor under every
#                   config here, for the write workloads most of all.  The
#                   copy (SIZE of RAM) exists only while its runs do.
#     qemunbd       qemu-nbd -f raw --persistent --shared=16 --cache=none
#                   --aio=io_uring on the same local file: a true O_DIRECT
#                   server, the fair ceiling for bcachefilter's default
#                   O_DIRECT cache file.  Skipped with a warning if qemu-nbd
#                   is not installed.
#   The ceilings run every workload like the other configs; they only mean
#   something for hits (and are cheap elsewhere).
#
#   Workloads (all 4 KiB unless stated, over the whole SIZE export):
#     hits     random reads of a WARM working set.  Cache configs first get
#              a warm-up pass: 4 KiB random reads, every block of the
#              export exactly once (fio's random map), at QD16, with
#              bcachefilter's default settings (plus bcache-direct=false
#              for bcachefilter-pc).  A random pass, not a
#              sequential one, because bcachefilter's sequential cutoff
#              (4 MiB) rightly bypasses sequential streams; and 4 KiB
#              reads leave one 4 KiB extent per block in its index, the
#              worst case for lookups.  nbdkit's cache filter gets the
#              same pass (it caches whole 64 KiB blocks).  Then
#              RUNTIME of uniform random reads.
#     zipf     COLD random reads, random_distribution=zipf:1.2, fresh
#              cache (new front end, and for bcachefilter a new cache
#              file): the warming of the cache is what is measured.
#     randrw   70/30 random read/write (rwmixread=70), fresh cache.
#     seqread  1 MiB sequential reads, fresh cache.  fio loops
#              over the export, so a cache that caches sequential reads
#              (nbdkit's cache filter) serves later laps from its cache.
#     mixed    (not in the default set) a VM host's mix: 70/30 random 4 KiB
#              reads and writes, random_distribution=zipf:1.2, COLD (fresh
#              cache).  Writethrough caches what it writes, so the hit
#              ratio should stay near that of zipf's reads alone; the
#              counters below show it, with the miss collisions and the
#              writes that ended up cached.
#     rmw      (not in the default set) random writes over a WARM working
#              set, after the same warm-up pass as hits: the writes of a
#              read-modify-write, every one to a cached block.  Shows what
#              keeping the cache right costs a write (bcachefilter
#              journals an invalidation only where a crash could bring the
#              cached block back).
#     writes   (not in the default set) 4 KiB random writes with a flush
#              every 32 (fio --fsync=32: NBD_CMD_FLUSH), COLD: a VM's
#              filesystem.  Writeback acknowledges from the cache; the
#              flushes make its journal durable.  fio sends more flushes
#              than that at depth 16: after the 32nd write one into every
#              slot that frees up until a flush completes, so the slower
#              the flush the more of them (docs/BENCHMARKS.md).
#     fswrites (not in the default set) the same writes with exactly one
#              flush per 32 writes submitted, the others going on while it
#              is outstanding: bench/nbd-writes (libnbd), at IODEPTH, COLD.
#              What issue 14 defines as `writes`.
#   Every (config, workload) pair gets a freshly started front end, and
#   every measured run starts after a sync (settle_disk: what was dirty
#   goes to settle.tsv), so that no config pays for the page cache the
#   one before it left (the cache filter's never-synced file).  The
#   runs go workload by workload, all configs back to back, so that the
#   runs a ratio compares are close in time on a shared host; one remote
#   serves them all (it keeps no state that matters here).
#
#   At the end: a table of IOPS (MiB/s for seqread) and median latencies,
#   and the ratios the issue's targets are stated in:
#     hits   bcachefilter / file          target >= 0.90
#     hits   bcachefilter / filepc        target >= 0.90 (reference)
#     hits   bcachefilter / qemunbd       target >= 0.90 (the true O_DIRECT
#                                         ceiling: both read the device)
#     hits   bcachefilter-pc / filepc     target >= 0.90 (both through the
#                                         page cache)
#     zipf   bcachefilter / remote        target >= 0.95
#     randrw bcachefilter / remote        target >= 0.95 (total IOPS; the
#                                         read IOPS are shown too)
#     seq    bcachefilter / proxy         target >= 0.95
#   and, without a target, what they decompose into: bcachefilter-je /
#   bcachefilter for hits and mixed (jemalloc vs glibc's malloc); the pass-through
#   proxy / remote (what any nbdkit proxy reaches on this host),
#   qemuproxy / remote (what a proxy outside nbdkit reaches), and
#   randrw bcachefilter / proxy and bcachefilter-none / proxy (what
#   caching costs on top of the hop, and what the filter costs without
#   caching); and rmw bcachefilter / proxy (write IOPS).
#   The same ratios are printed for nbdkit's cache filter, for reference.
#
#   Every run also gets "device reads/IO": the reads completed (field 1 of
#   /sys/class/block/DEV/stat) by the block device holding WORKDIR over the
#   fio job, divided by fio's I/O count.  It shows whether a front end
#   really reads the device: about 1 for an O_DIRECT 4k hit (qemunbd,
#   bcachefilter), about 0 for a page-cache hit (filepc, bcachefilter-pc),
#   and in between for the file plugin's cache=none.  The remote is in
#   memory and never reads the device.  It counts the whole device, so other
#   I/O on the host shows up too; "–" if WORKDIR is not on a block device
#   that can be found (tmpfs, overlay, ...).
#   Nothing fails because something was slow: the exit status is non-zero
#   only if the harness itself failed.
#
# USAGE
#   bench/filter-bench.sh                      # everything, ~15 min
#   CONFIGS="remote bcachefilter" WORKLOADS="zipf randrw" bench/filter-bench.sh
#   SIZE=256M RUNTIME=5 bench/filter-bench.sh  # smoke run, ~4 min
#
# ENVIRONMENT (all optional)
#   SIZE       working set = export size (default 1G; nbdkit/numfmt suffixes)
#   RUNTIME    seconds per measured job (default 20)
#   FILTER_SO  the filter (default /tmp/b-bench/plugin/.libs/
#              nbdkit-bcachefilter-filter.so).  If it does not exist the
#              bcachefilter, bcachefilter-pc and bcachefilter-none configs
#              are skipped with a warning.
#   WORKDIR    where the cache file, the local data file and the sockets go.
#              Default: a new `mktemp -d /var/tmp/filter-bench.XXXXXX`,
#              removed at exit.  Must be a real disk filesystem with O_DIRECT
#              (not tmpfs): the script checks and prints what it is.  Needs
#              about 4*SIZE free (data file, 2*SIZE cache, cache filter file;
#              no two bcachefilter configs have a cache file at the same
#              time).
#   OUTDIR     where fio's JSON, the front ends' logs and summary.md go
#              (kept).  Default /var/tmp/filter-bench-results.DATE-TIME.
#   CONFIGS    subset of: remote proxy qemuproxy cachefilter bcachefilter
#              bcachefilter-wb bcachefilter-pc bcachefilter-je bcachefilter-none
#              file filepc fileshm qemunbd (default: all but
#              bcachefilter-je and fileshm)
#   JEMALLOC   the library bcachefilter-je preloads (default
#              libjemalloc.so.2)
#   WORKLOADS  subset of: hits zipf randrw seqread mixed rmw writes fswrites (default:
#              the first four, the first issue's)
#   REPEAT     runs per (config, workload), the table shows the median
#              (default 1).  For hits the warm-up is done once.
#   ZIPF       zipf theta (default 1.2)
#   WARM_MAX   seconds cap on a warm-up pass (default 180)
#   BCACHE_ARGS extra bcachefilter parameters, e.g.
#              "bcache-io=sync" or "bcache-sequential-cutoff=0" (for every
#              bcachefilter config)
#   NBD_WRITES bench/nbd-writes for fswrites (default: next to BCTL's
#              tools/, in ../bench/)
#   BCTL       path of bcachefilter-ctl (default /tmp/b-bench/tools/
#              bcachefilter-ctl).  If it is executable, the filter gets
#              bcache-ctl=$WORKDIR/ctl.sock and its stats (--json) are saved
#              after each bcachefilter(-pc) run, and hits/misses/bypass are
#              shown.
#   PERF       "CONFIG:WORKLOAD" (or a space-separated list of them): also
#              `perf record -g` the front end during that run, into OUTDIR.
#   PERF_OPTS  perf record options instead of -g, e.g. "--call-graph dwarf"
#              (the filter is built without frame pointers).
#   IODEPTH    fio's queue depth (default 16).  At 16 a 2-CPU host is
#              CPU-bound for randrw; a lower depth shows the same configs
#              with CPU to spare.
#   KEEP=1     keep WORKDIR.
#
# Needs: nbdkit (memory, file, nbd plugins; delay, cache filters), fio with
# the nbd engine, nbdinfo, nbdcopy, python3; for the qemunbd and qemuproxy
# configs, qemu-nbd (Debian/Ubuntu package qemu-utils) with io_uring support.  Every
# process it starts is stopped at exit, including on SIGINT/SIGTERM/SIGHUP
# (nbdkit runs with --exit-with-parent, and qemu-nbd under
# `setpriv --pdeathsig TERM` when setpriv exists, so that even a SIGKILLed
# script leaves nothing behind).

set -euo pipefail

# shellcheck disable=SC2034  # used by bench-lib.sh
BENCH_NAME=filter-bench
# shellcheck source=bench-lib.sh
source "$(dirname "$0")/bench-lib.sh"   # die, say, stop_pid, start_server, ...

SIZE=${SIZE:-1G}
RUNTIME=${RUNTIME:-20}
FILTER_SO=${FILTER_SO:-/tmp/b-bench/plugin/.libs/nbdkit-bcachefilter-filter.so}
ALL_CONFIGS="remote proxy qemuproxy cachefilter bcachefilter bcachefilter-wb bcachefilter-pc bcachefilter-je bcachefilter-none file filepc fileshm qemunbd"
DEFAULT_CONFIGS=${ALL_CONFIGS/ bcachefilter-je/}
CONFIGS=${CONFIGS:-${DEFAULT_CONFIGS/ fileshm/}}
JEMALLOC=${JEMALLOC:-libjemalloc.so.2}
WORKLOADS=${WORKLOADS:-hits zipf randrw seqread}
REPEAT=${REPEAT:-1}
ZIPF=${ZIPF:-1.2}
WARM_MAX=${WARM_MAX:-180}
BCACHE_ARGS=${BCACHE_ARGS:-}
BCTL=${BCTL:-/tmp/b-bench/tools/bcachefilter-ctl}
PERF=${PERF:-}
PERF_OPTS=${PERF_OPTS:--g}
KEEP=${KEEP:-0}
IODEPTH=${IODEPTH:-16}
[[ $IODEPTH =~ ^[1-9][0-9]*$ ]] || { echo "filter-bench: bad IODEPTH=$IODEPTH" >&2; exit 1; }

for t in nbdkit fio nbdinfo nbdcopy python3; do
    command -v "$t" >/dev/null || die "$t is not installed"
done
fio --enghelp=nbd >/dev/null 2>&1 || die "fio has no nbd engine"

BYTES=$(numfmt --from=iec "${SIZE%B}") || die "bad SIZE=$SIZE"
(( BYTES >= 16*1024*1024 && BYTES % 4096 == 0 )) ||
    die "SIZE must be a multiple of 4 KiB and at least 16M"
CACHE_BYTES=$(( 2 * BYTES ))

for c in $CONFIGS; do
    [[ " $ALL_CONFIGS " == *" $c "* ]] ||
        die "unknown config '$c' ($ALL_CONFIGS)"
done
for w in $WORKLOADS; do
    case $w in hits|zipf|randrw|seqread|mixed|rmw|writes|fswrites) ;;
    *) die "unknown workload '$w' (hits zipf randrw seqread mixed rmw writes fswrites)" ;;
    esac
done
NBD_WRITES=${NBD_WRITES:-$(dirname "$BCTL")/../bench/nbd-writes}
if [[ " $WORKLOADS " == *" fswrites "* ]]; then
    [[ -x $NBD_WRITES ]] ||
        die "fswrites needs bench/nbd-writes (make in the build tree; NBD_WRITES=$NBD_WRITES)"
fi
has_config() { [[ " $CONFIGS " == *" $1 "* ]]; }
drop_config() {                 # drop_config NAME WHY: skip it, with a warning
    local c keep=()
    has_config "$1" || return 0
    say "WARNING: $2: skipping the $1 config"
    for c in $CONFIGS; do [[ $c == "$1" ]] || keep+=("$c"); done
    CONFIGS=${keep[*]}
}
if [[ ! -f $FILTER_SO ]]; then
    drop_config bcachefilter "$FILTER_SO does not exist"
    drop_config bcachefilter-pc "$FILTER_SO does not exist"
    drop_config bcachefilter-je "$FILTER_SO does not exist"
    drop_config bcachefilter-none "$FILTER_SO does not exist"
    drop_config bcachefilter-wb "$FILTER_SO does not exist"
fi
# ld.so only warns (and runs the program) when it cannot preload
if [[ -n $(LD_PRELOAD=$JEMALLOC true 2>&1) ]]; then
    drop_config bcachefilter-je "LD_PRELOAD=$JEMALLOC does not work"
fi
command -v qemu-nbd >/dev/null || drop_config qemunbd "qemu-nbd is not installed (qemu-utils)"
command -v qemu-nbd >/dev/null || drop_config qemuproxy "qemu-nbd is not installed (qemu-utils)"
if has_config fileshm; then
    shm_free=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1)
    [[ ${shm_free:-0} -gt $(( BYTES + BYTES / 4 )) ]] ||
        drop_config fileshm "/dev/shm has ${shm_free:-no} bytes free, it needs SIZE ($BYTES) and a margin"
fi

# ---- work and output directories, cleanup --------------------------------
bench_dirs filter-bench

RSOCK=$WORKDIR/remote.sock      # the remote
FSOCK=$WORKDIR/front.sock       # the front end under test
CTLSOCK=$WORKDIR/ctl.sock
DATA=$WORKDIR/data.img          # random data: remote's content, file ceiling
SHMDATA=/dev/shm/filter-bench.$$.data.img   # fileshm's copy, while it runs
CACHE=$WORKDIR/cache.img        # bcachefilter's cache
PIDS=()                         # every process we started and not yet reaped

# newest first: fio and perf, then the front end, then the remote
BENCH_CLEANUP_ALWAYS=("$SHMDATA")
bench_cleanup_on_exit "$DATA" "$CACHE"

# ---- machine --------------------------------------------------------------
FSTYPE=$(findmnt -n -o FSTYPE -T "$WORKDIR" 2>/dev/null || stat -f -c %T "$WORKDIR")
FSDEV=$(findmnt -n -o SOURCE -T "$WORKDIR" 2>/dev/null || echo '?')
[[ $FSTYPE == tmpfs || $FSTYPE == ramfs ]] &&
    die "WORKDIR $WORKDIR is on $FSTYPE; bcachefilter needs O_DIRECT on a disk"
if dd if=/dev/zero of="$WORKDIR/.odirect" bs=4096 count=1 oflag=direct \
      status=none 2>/dev/null; then ODIRECT=yes; else ODIRECT=NO; fi
rm -f "$WORKDIR/.odirect"
[[ $ODIRECT == yes ]] || say "WARNING: O_DIRECT does not work in $WORKDIR"
# The block device holding WORKDIR, for "device reads/IO": by WORKDIR's
# st_dev first (/sys/dev/block/MAJ:MIN, a partition or a dm device included),
# then by the mount's source (e.g. btrfs, whose st_dev is anonymous:
# "/dev/vda2[/@]" -> /sys/class/block/vda2).  Empty if neither is a block
# device (tmpfs, overlay, ...).
find_devstat() {
    local majmin src
    majmin=$(stat -c '%Hd:%Ld' "$WORKDIR" 2>/dev/null) || majmin=
    if [[ -n $majmin && -r /sys/dev/block/$majmin/stat ]]; then
        echo "/sys/dev/block/$majmin/stat"; return 0
    fi
    src=$(findmnt -n -o SOURCE --target "$WORKDIR" 2>/dev/null | head -1) || src=
    src=${src%%\[*}
    [[ $src == /dev/* && -b $src ]] || return 0
    src=$(basename "$(readlink -f "$src")")
    if [[ -r /sys/class/block/$src/stat ]]; then echo "/sys/class/block/$src/stat"; fi
}
DEVSTAT=$(find_devstat)
if [[ -n $DEVSTAT ]]; then
    DEVNAME=$(basename "$(dirname "$(readlink -f "$DEVSTAT")")")
    DEVDESC="$DEVNAME ($DEVSTAT)"
else
    DEVDESC="not found: the device reads/IO column shows –"
fi
dev_reads() {                   # reads completed by WORKDIR's device, or ""
    if [[ -n $DEVSTAT ]]; then awk '{ print $1 }' "$DEVSTAT"; fi
}

AVAIL=$(df -B1 --output=avail "$WORKDIR" | tail -1)
(( AVAIL > 4 * BYTES + (1 << 30) )) ||
    die "WORKDIR needs ~4*SIZE free, has $(numfmt --to=iec "$AVAIL")"

{
    echo "date:      $(date -Is)"
    echo "command:   SIZE=$SIZE RUNTIME=$RUNTIME CONFIGS=\"$CONFIGS\" WORKLOADS=\"$WORKLOADS\" REPEAT=$REPEAT ZIPF=$ZIPF BCACHE_ARGS=\"$BCACHE_ARGS\" $0"
    echo "host:      nproc=$(nproc), $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), RAM $(free -g | awk '/^Mem/ {print $2}') GiB"
    echo "kernel:    $(uname -srm)"
    echo "workdir:   $WORKDIR on $FSDEV ($FSTYPE), O_DIRECT $ODIRECT"
    echo "device:    $DEVDESC"
    echo "software:  $(nbdkit --version), $(fio --version), $(nbdinfo --version 2>/dev/null | head -1)"
    if has_config qemunbd || has_config qemuproxy; then
        echo "qemu-nbd:  $(qemu-nbd --version | head -1)"
    fi
    if [[ -f $FILTER_SO ]]; then
        echo "filter:    $FILTER_SO ($(stat -c '%y' "$FILTER_SO" | cut -d. -f1))"
    fi
    echo "load avg:  $(cut -d' ' -f1-3 /proc/loadavg) (start)"
} | tee "$OUTDIR/machine.txt" >&2

# ---- data -------------------------------------------------------------------
say "creating $(numfmt --to=iec "$BYTES") of random data in $DATA"
head -c "$BYTES" /dev/urandom >"$DATA"
sync "$DATA"

# The disk under WORKDIR on its own: 4 KiB O_DIRECT random reads, QD16,
# what bcachefilter's hits and the file ceiling can at best get.
say "disk baseline: fio 4k randread O_DIRECT QD$IODEPTH on $DATA, 5 s"
fio --name=disk --filename="$DATA" --readonly --direct=1 --ioengine=libaio \
    --rw=randread --bs=4k --iodepth=$IODEPTH --time_based --runtime=5 \
    --output-format=json --output="$OUTDIR/disk-baseline.json" >/dev/null

# ---- runs -------------------------------------------------------------------
RESULTS=$OUTDIR/results.tsv     # config workload rep json
: >"$RESULTS"

start_remote() {
    start_nbdkit remote "$RSOCK" --filter=delay memory size="$BYTES" \
        delay-read=1ms delay-write=1ms
    REMOTE_PID=$SERVER_PID
    nbdcopy "$DATA" "$(uri "$RSOCK")"
}

# start_front CONFIG FRESH: the front end for CONFIG on FSOCK (or the remote
# itself); FRESH=1 gives bcachefilter(-pc) a new cache file.  Sets FRONT_SOCK
# and FRONT_PID (empty for "remote").
start_front() {
    local cfg=$1 fresh=$2
    FRONT_PID=
    FRONT_SOCK=$FSOCK
    case $cfg in
    remote) FRONT_SOCK=$RSOCK ;;
    proxy)
        start_nbdkit "$cfg" "$FSOCK" nbd socket="$RSOCK" ;;
    qemuproxy)
        start_qemu_nbd "$cfg" "$FSOCK" -f raw --persistent --shared=$IODEPTH \
            "$(uri "$RSOCK")" ;;
    cachefilter)
        TMPDIR=$WORKDIR start_nbdkit "$cfg" "$FSOCK" --filter=cache \
            nbd socket="$RSOCK" cache=writeback cache-on-read=true ;;
    bcachefilter|bcachefilter-pc|bcachefilter-je|bcachefilter-none|bcachefilter-wb)
        # they never run at the same time: each gets a new file at $CACHE
        if [[ $fresh == 1 ]]; then rm -f "$CACHE"; fi
        local ctl=() pc=() NBDKIT_ENV=()
        if [[ $cfg == bcachefilter-je ]]; then NBDKIT_ENV=(env LD_PRELOAD="$JEMALLOC"); fi
        if [[ -x $BCTL ]]; then ctl=(bcache-ctl="$CTLSOCK"); fi
        if [[ $cfg == bcachefilter-pc ]]; then pc=(bcache-direct=false); fi
        if [[ $cfg == bcachefilter-none ]]; then pc=(bcache-mode=none); fi
        if [[ $cfg == bcachefilter-wb ]]; then pc=(bcache-mode=writeback); fi
        # shellcheck disable=SC2086
        start_nbdkit "$cfg" "$FSOCK" --filter="$FILTER_SO" \
            nbd socket="$RSOCK" bcache="$CACHE" bcache-size="$CACHE_BYTES" \
            "${ctl[@]}" "${pc[@]}" $BCACHE_ARGS ;;
    file)
        start_nbdkit "$cfg" "$FSOCK" file "$DATA" cache=none ;;
    filepc)
        start_nbdkit "$cfg" "$FSOCK" file "$DATA" ;;
    fileshm)
        cp "$DATA" "$SHMDATA" || die "cannot copy the data to $SHMDATA"
        start_nbdkit "$cfg" "$FSOCK" file "$SHMDATA" ;;
    qemunbd)
        start_qemu_nbd "$cfg" "$FSOCK" -f raw --persistent --shared=$IODEPTH \
            --cache=none --aio=io_uring "$DATA" ;;
    esac
    [[ $cfg == remote ]] || FRONT_PID=$SERVER_PID
}

stop_front() {
    if [[ -n $FRONT_PID ]]; then stop_pid "$FRONT_PID" 60; fi
    FRONT_PID=
    rm -f "$SHMDATA"            # fileshm's copy: RAM, only while it runs
}

is_bcache() { [[ $1 == bcachefilter || $1 == bcachefilter-pc || $1 == bcachefilter-je || $1 == bcachefilter-none || $1 == bcachefilter-wb ]]; }

bctl_stats() {                  # bctl_stats FILE: save bcachefilter's stats
    [[ -x $BCTL && -S $CTLSOCK ]] || return 0
    "$BCTL" --socket "$CTLSOCK" stats --json >"$1" 2>&1 || true
}

# run_fio NAME JSON FIO-ARGS...
run_fio() {
    local name=$1 json=$2; shift 2
    echo "fio --name=$name --ioengine=nbd --uri=$(uri "$FRONT_SOCK") $*" >>"$OUTDIR/commands.txt"
    # In the background and waited for, so that a signal is handled at once
    # (bash runs traps only after a foreground child exits).
    fio --name="$name" --ioengine=nbd --uri="$(uri "$FRONT_SOCK")" \
        --iodepth=$IODEPTH --numjobs=1 --size="$BYTES" \
        --output-format=json --output="$json" "$@" >/dev/null &
    local fpid=$! rc=0
    PIDS+=("$fpid")
    wait "$fpid" || rc=$?
    stop_pid "$fpid"
    (( rc == 0 )) || die "fio failed ($name, status $rc); see $json"
}

# run_nbd_writes NAME JSON: the fswrites job, fio's JSON from nbd-writes
run_nbd_writes() {
    local name=$1 json=$2
    local cmd=("$NBD_WRITES" --depth "$IODEPTH" --flush-every 32 --bs 4096
               --runtime "$RUNTIME" --json "$json" "$(uri "$FRONT_SOCK")")
    echo "${cmd[*]}" >>"$OUTDIR/commands.txt"
    "${cmd[@]}" 2>>"$OUTDIR/$name.nbd-writes.log" &
    local pid=$! rc=0
    PIDS+=("$pid")
    wait "$pid" || rc=$?
    stop_pid "$pid"
    (( rc == 0 )) || die "nbd-writes failed ($name, status $rc); see $OUTDIR/$name.nbd-writes.log"
}

workload_args() {               # the measured job of each workload
    case $1 in
    hits)    echo "--rw=randread --bs=4k --norandommap --time_based --runtime=$RUNTIME" ;;
    zipf)    echo "--rw=randread --bs=4k --random_distribution=zipf:$ZIPF --norandommap --time_based --runtime=$RUNTIME" ;;
    randrw)  echo "--rw=randrw --rwmixread=70 --bs=4k --norandommap --time_based --runtime=$RUNTIME" ;;
    seqread) echo "--rw=read --bs=1M --time_based --runtime=$RUNTIME" ;;
    mixed)   echo "--rw=randrw --rwmixread=70 --bs=4k --random_distribution=zipf:$ZIPF --norandommap --time_based --runtime=$RUNTIME" ;;
    rmw)     echo "--rw=randwrite --bs=4k --norandommap --time_based --runtime=$RUNTIME" ;;
    # a VM's filesystem: random 4k writes, a flush (NBD_CMD_FLUSH) every 32
    writes)  echo "--rw=randwrite --bs=4k --norandommap --fsync=32 --time_based --runtime=$RUNTIME" ;;
    esac
}

cpu_ticks() {                   # cpu_ticks PID: utime+stime of all its threads
    if [[ -r /proc/$1/stat ]]; then
        sed 's/.*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'
    else echo 0; fi
}
CLK_TCK=$(getconf CLK_TCK)
host_ticks() {                  # host_ticks: "busy total" ticks of all CPUs
    # /proc/stat's first line: user nice system idle iowait irq softirq
    # steal ...; busy is all but idle and iowait
    awk '/^cpu / { t = 0; for (i = 2; i <= NF; i++) t += $i
                   print t - $5 - $6, t; exit }' /proc/stat
}

perf_wanted() { [[ " $PERF " == *" $1:$2 "* ]]; }

measure() {                     # measure CONFIG WORKLOAD REP
    local cfg=$1 wl=$2 rep=$3 json load perf_pid=""
    json=$OUTDIR/$cfg.$wl.$rep.json
    load=$(cut -d' ' -f1 /proc/loadavg)
    say "  $cfg $wl (run $rep): ${RUNTIME}s"
    if perf_wanted "$cfg" "$wl" && [[ -n $FRONT_PID ]]; then
        # shellcheck disable=SC2086
        perf record $PERF_OPTS -p "$FRONT_PID" -o "$OUTDIR/perf.$cfg.$wl.$rep.data" \
            -- sleep $(( RUNTIME + 2 )) >"$OUTDIR/perf.$cfg.$wl.$rep.log" 2>&1 &
        perf_pid=$!
        PIDS+=("$perf_pid")
    fi
    local cpid=${FRONT_PID:-$REMOTE_PID} c0 c1 r0 r1 d0 d1 dreads= h0 h1
    # Nothing dirty from the config before (the cache filter never syncs
    # its temporary file): bench-lib.sh's settle_disk.
    settle_disk "$cfg.$wl.$rep"
    c0=$(cpu_ticks "$cpid"); r0=$(cpu_ticks "$REMOTE_PID"); d0=$(dev_reads)
    h0=$(host_ticks)
    if [[ $wl == fswrites ]]; then
        run_nbd_writes "$cfg.$wl.$rep" "$json"
    else
        # shellcheck disable=SC2046
        run_fio "$wl" "$json" $(workload_args "$wl")
    fi
    h1=$(host_ticks)
    c1=$(cpu_ticks "$cpid"); r1=$(cpu_ticks "$REMOTE_PID"); d1=$(dev_reads)
    if [[ -n $d0 && -n $d1 ]]; then dreads=$(( d1 - d0 )); fi
    # CPU seconds of the front end (the remote itself for "remote") and of
    # the remote over the job (no fio job has a ramp), the reads
    # completed by WORKDIR's device over the job, and the host's busy
    # and total CPU milliseconds over it (every process and the kernel:
    # fio, both nbdkits, interrupts, anything else running)
    load="$load	$(( (c1 - c0) * 1000 / CLK_TCK ))	$(( (r1 - r0) * 1000 / CLK_TCK ))	$dreads"
    load="$load	$(awk -v a="$h0" -v b="$h1" -v hz="$CLK_TCK" 'BEGIN {
        split(a, x, " "); split(b, y, " ")
        printf "%d\t%d", (y[1] - x[1]) * 1000 / hz, (y[2] - x[2]) * 1000 / hz }')"
    if [[ -n $perf_pid ]]; then stop_pid "$perf_pid" 30; fi
    if is_bcache "$cfg"; then bctl_stats "$OUTDIR/$cfg.$wl.$rep.stats.json"; fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$cfg" "$wl" "$rep" "$json" "$load" >>"$RESULTS"
}

warm() {                        # warm CONFIG: every 4 KiB block once, random
    local cfg=$1 json=$OUTDIR/$1.warm.json
    say "  $cfg warm-up: 4k random reads of all $(numfmt --to=iec "$BYTES") (cap ${WARM_MAX}s)"
    run_fio warm "$json" --rw=randread --bs=4k --runtime="$WARM_MAX"
    if is_bcache "$cfg"; then bctl_stats "$OUTDIR/$cfg.warm.stats.json"; fi
    python3 - "$json" "$BYTES" <<'EOF' >&2
import json, sys
j = json.load(open(sys.argv[1]))["jobs"][0]["read"]
done, want = j["io_bytes"], int(sys.argv[2])
print(f"    warm-up: {done/2**20:.0f} MiB in {j['runtime']/1000:.1f} s, "
      f"{j['iops']:.0f} IOPS" + ("" if done >= want else
      "  WARNING: incomplete, the hit run will see misses"))
EOF
}

# Workload by workload, the configs one after the other, so that the configs
# compared in a ratio ran minutes apart at most (the host may be shared).
# One remote serves the whole run: it holds no state that matters here.
T0=$SECONDS
REMOTE_PID=
if [[ " $CONFIGS " =~ \ (remote|proxy|qemuproxy|cachefilter|bcachefilter|bcachefilter-wb|bcachefilter-pc|bcachefilter-je|bcachefilter-none)\  ]]; then
    say "remote: nbdkit memory plugin behind the delay filter, filling it"
    start_remote
fi
for wl in $WORKLOADS; do
    say "workload $wl"
    if [[ $wl == hits || $wl == rmw ]]; then
        for cfg in $CONFIGS; do
            start_front "$cfg" 1
            if [[ $cfg == cachefilter ]] ||
               { is_bcache "$cfg" && [[ $cfg != bcachefilter-none ]]; }; then
                warm "$cfg"
            fi
            # the file plugin's cache=none run evicts pages of DATA: put it
            # all back, so that the page-cache ceiling starts warm too
            if [[ $cfg == filepc ]]; then cat "$DATA" >/dev/null; fi
            for (( r = 1; r <= REPEAT; r++ )); do measure "$cfg" "$wl" "$r"; done
            stop_front
        done
    else
        for (( r = 1; r <= REPEAT; r++ )); do
            for cfg in $CONFIGS; do
                start_front "$cfg" 1
                measure "$cfg" "$wl" "$r"
                stop_front
            done
        done
    fi
done
if [[ -n $REMOTE_PID ]]; then stop_pid "$REMOTE_PID" 30; fi
echo "load avg:  $(cut -d' ' -f1-3 /proc/loadavg) (end), elapsed $(( SECONDS - T0 )) s" |
    tee -a "$OUTDIR/machine.txt" >&2

# ---- report -----------------------------------------------------------------
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)"  # bcfstats.py: the stats' reader
python3 - "$RESULTS" "$OUTDIR" "$REPEAT" <<'EOF' | tee "$OUTDIR/summary.md"
import json, os, statistics, sys
import bcfstats
from collections import defaultdict
results, outdir, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3])

def load(path):
    j = json.load(open(path))["jobs"][0]
    r, w = j["read"], j["write"]
    def p(d, q):
        v = d.get("clat_ns", {}).get("percentile", {}).get(q)
        return v / 1e6 if v else 0.0
    return dict(riops=r["iops"], wiops=w["iops"], iops=r["iops"] + w["iops"],
                mibs=(r["bw_bytes"] + w["bw_bytes"]) / 2**20,
                rp50=p(r, "50.000000"), rp99=p(r, "99.000000"),
                wp50=p(w, "50.000000"), wp99=p(w, "99.000000"))

runs = defaultdict(list)
allruns = []
order_c, order_w = [], []
for line in open(results):
    c, w, rep, path, la, fcpu, rcpu, dreads, hbusy, htotal = \
        line.rstrip("\n").split("\t")
    runs[c, w].append(load(path))
    j = json.load(open(path))["jobs"][0]
    ios = j["read"]["total_ios"] + j["write"]["total_ios"]
    runs[c, w][-1]["cpu_us"] = int(fcpu) * 1000 / ios if ios else 0
    runs[c, w][-1]["host_busy"] = int(hbusy) / int(htotal) if int(htotal) else None
    runs[c, w][-1]["host_us"] = int(hbusy) * 1000 / ios if ios else None
    runs[c, w][-1]["dev_per_io"] = int(dreads) / ios if dreads and ios else None
    allruns.append((c, w, rep, runs[c, w][-1], la))
    if c not in order_c: order_c.append(c)
    if w not in order_w: order_w.append(w)

def med(c, w, k):
    v = [r[k] for r in runs.get((c, w), [])]
    return statistics.median(v) if v else None

def n(x, d=0):
    if x is None: return "–"
    if d == 0 and x >= 10000: return f"{x/1000:.1f}k"
    return f"{x:,.{d}f}"

disk = json.load(open(os.path.join(outdir, "disk-baseline.json")))["jobs"][0]["read"]
print(f"Disk under WORKDIR, fio 4k randread O_DIRECT QD16: {n(disk['iops'])} IOPS\n")
print("| config | hits 4k IOPS (p50/p99 ms) | cold zipf 4k IOPS (p50/p99 ms) "
      "| randrw 70/30 IOPS read+write (read p50/p99 ms) | seq 1M read MiB/s |")
print("|---|---:|---:|---:|---:|")
for c in order_c:
    cells = []
    for w in ("hits", "zipf"):
        if (c, w) in runs:
            cells.append(f"{n(med(c,w,'riops'))} ({med(c,w,'rp50'):.2f}/{med(c,w,'rp99'):.2f})")
        else: cells.append("–")
    if (c, "randrw") in runs:
        cells.append(f"{n(med(c,'randrw','riops'))} + {n(med(c,'randrw','wiops'))} "
                     f"= {n(med(c,'randrw','iops'))} ({med(c,'randrw','rp50'):.2f}/{med(c,'randrw','rp99'):.2f})")
    else: cells.append("–")
    cells.append(n(med(c, "seqread", "mibs")) if (c, "seqread") in runs else "–")
    print(f"| {c} | " + " | ".join(cells) + " |")
if repeat > 1:
    print(f"\n(median of {repeat} runs each)")
def write_table(wl, what):
    """The write-only workloads: write IOPS and write p50/p99 per config."""
    if not any(w == wl for _, w in runs):
        return
    print(f"\n| config | {wl}: {what}, IOPS (write p50/p99 ms) |")
    print("|---|---:|")
    for c in order_c:
        if (c, wl) in runs:
            print(f"| {c} | {n(med(c,wl,'wiops'))} ({med(c,wl,'wp50'):.2f}/{med(c,wl,'wp99'):.2f}) |")
write_table("rmw", "4k random writes to warm blocks")
write_table("writes", "4k random writes, a flush every 32")
write_table("fswrites", "4k random writes, exactly one flush per 32 (nbd-writes)")
if any(w == "mixed" for _, w in runs):
    print("\n| config | mixed: zipf 70/30 4k cold, IOPS read+write (read p50/p99, write p50/p99 ms) |")
    print("|---|---:|")
    for c in order_c:
        if (c, "mixed") in runs:
            print(f"| {c} | {n(med(c,'mixed','riops'))} + {n(med(c,'mixed','wiops'))} = "
                  f"{n(med(c,'mixed','iops'))} ({med(c,'mixed','rp50'):.2f}/{med(c,'mixed','rp99'):.2f}, "
                  f"{med(c,'mixed','wp50'):.2f}/{med(c,'mixed','wp99'):.2f}) |")

# (workload, figure, config in the "bcachefilter" column, baseline, target,
# label); the cache filter column is always cachefilter / baseline
targets = [("hits",   "riops", "bcachefilter",    "file",    0.90, "4k hit IOPS vs the file plugin, cache=none (ceiling)"),
           ("hits",   "riops", "bcachefilter",    "filepc",  0.90, "4k hit IOPS vs the file plugin, page cache (reference)"),
           ("hits",   "riops", "bcachefilter",    "qemunbd", 0.90, "4k hit IOPS vs qemu-nbd cache=none (true O_DIRECT ceiling)"),
           ("hits",   "riops", "bcachefilter-pc", "filepc",  0.90, "4k hit IOPS, bcache-direct=false vs the file plugin, page cache"),
           ("zipf",   "riops", "bcachefilter",    "remote",  0.95, "cold zipf IOPS vs the remote alone"),
           ("randrw", "iops",  "bcachefilter",    "remote",  0.95, "70/30 total IOPS vs the remote alone"),
           ("randrw", "riops", "bcachefilter",    "remote",  0.95, "70/30 read IOPS vs the remote alone"),
           ("seqread","mibs",  "bcachefilter",    "proxy",   0.95, "1M seq read MiB/s vs the pass-through proxy"),
           # no target: what the randrw ratio is made of
           ("randrw", "iops",  "proxy",           "remote",  None, "70/30 total IOPS: the pass-through proxy vs the remote alone"),
           ("randrw", "iops",  "qemuproxy",       "remote",  None, "70/30 total IOPS: qemu-nbd as a proxy vs the remote alone"),
           ("randrw", "iops",  "bcachefilter",    "proxy",   None, "70/30 total IOPS vs the pass-through proxy"),
           ("randrw", "iops",  "bcachefilter-none", "proxy", None, "70/30 total IOPS, bcache-mode=none vs the pass-through proxy"),
           ("rmw",    "wiops", "bcachefilter",    "proxy",   0.90, "4k writes to warm blocks: write IOPS vs the pass-through proxy"),
           ("mixed",  "iops",  "bcachefilter",    "proxy",   1.80, "zipf 70/30 cold: total IOPS vs the pass-through proxy"),
           # writeback (issue 14)
           ("rmw",    "wiops", "bcachefilter-wb", "proxy",   3.00, "writeback: 4k writes to warm blocks, write IOPS vs the pass-through proxy"),
           ("rmw",    "wiops", "bcachefilter-wb", "cachefilter", 1.00, "writeback: 4k writes to warm blocks, write IOPS vs nbdkit's cache filter (cache=writeback)"),
           ("writes", "wiops", "bcachefilter-wb", "proxy",   3.00, "writeback: 4k random writes, a flush every 32, vs the pass-through proxy"),
           ("writes", "wiops", "bcachefilter-wb", "cachefilter", 1.00, "writeback: 4k random writes, a flush every 32, vs nbdkit's cache filter"),
           ("writes", "wiops", "bcachefilter",    "proxy",   None, "writethrough: 4k random writes, a flush every 32, vs the pass-through proxy"),
           ("fswrites", "wiops", "bcachefilter-wb", "proxy", 3.00, "writeback: 4k random writes, exactly one flush per 32, vs the pass-through proxy"),
           ("fswrites", "wiops", "bcachefilter-wb", "cachefilter", 1.00, "writeback: 4k random writes, exactly one flush per 32, vs nbdkit's cache filter"),
           ("fswrites", "wiops", "bcachefilter",  "proxy",   None, "writethrough: 4k random writes, exactly one flush per 32, vs the pass-through proxy"),
           ("mixed",  "iops",  "bcachefilter-wb", "bcachefilter", 1.50, "zipf 70/30 cold: writeback vs writethrough, total IOPS"),
           # no target: nbdkit under LD_PRELOAD=jemalloc vs glibc's malloc
           ("hits",   "riops", "bcachefilter-je", "bcachefilter", None, "4k hit IOPS: nbdkit under jemalloc vs glibc's malloc"),
           ("mixed",  "iops",  "bcachefilter-je", "bcachefilter", None, "zipf 70/30 cold: total IOPS, jemalloc vs glibc's malloc")]
print("\n| ratio | target | bcachefilter | nbdkit cache filter |")
print("|---|---:|---:|---:|")
for w, k, bc, base, tgt, what in targets:
    b = med(base, w, k)
    cells = []
    for c in (bc, "cachefilter"):
        x = med(c, w, k)
        # against another bcachefilter config the cache filter has no cell
        if x is None or not b or (c != bc and base.startswith("bcachefilter")):
            cells.append("–")
        else:
            r = x / b
            mark = (" ✔" if r >= tgt else " ✘") if c == bc and tgt else ""
            cells.append(f"{r:.2f}" + mark)
    print(f"| {what} | " + (f"≥ {tgt:.2f}" if tgt else "–") + " | "
          + " | ".join(cells) + " |")

# rmw's p99: at most 1.3x the proxy's (lower is better)
b, x = med("proxy", "rmw", "wp99"), med("bcachefilter", "rmw", "wp99")
if b and x:
    print(f"| 4k writes to warm blocks: write p99 vs the pass-through proxy's (at most) "
          f"| ≤ 1.30 | {x/b:.2f}{' ✔' if x/b <= 1.30 else ' ✘'} | "
          + (f"{med('cachefilter','rmw','wp99')/b:.2f}" if med('cachefilter','rmw','wp99') else "–")
          + " |")

print("\nEvery run. Front-end CPU: user+system CPU time of the front-end process "
      "(nbdkit, or qemu-nbd; the remote's own for \"remote\") over the job, per I/O. "
      "Device reads/IO: reads completed by the block device holding WORKDIR over "
      "the job, per fio I/O (about 1 for a 4k hit that really reads the device, "
      "about 0 for one served by the page cache; the whole device is counted). "
      "Host busy: the share of all CPUs' time over the job that was neither idle "
      "nor waiting for I/O (/proc/stat: fio, both nbdkits, the kernel, and any other "
      "tenant), and that busy time per I/O: near 100% busy, a config's IOPS are "
      "bounded by its host CPU µs/IO, whatever its latency. "
      f"Load average: 1 min, when the run started, on {os.cpu_count()} CPUs.\n")
print("| config | workload | run | read IOPS | write IOPS | MiB/s | read p50 ms | read p99 ms "
      "| front-end CPU µs/IO | host busy | host CPU µs/IO | device reads/IO | load avg |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for c, w, rep, r, la in allruns:
    dev = "–" if r["dev_per_io"] is None else f"{r['dev_per_io']:.2f}"
    hb = "–" if r["host_busy"] is None else f"{100 * r['host_busy']:.0f}%"
    hu = "–" if r["host_us"] is None else f"{r['host_us']:.0f}"
    print(f"| {c} | {w} | {rep} | {r['riops']:.0f} | {r['wiops']:.0f} | {r['mibs']:.1f} "
          f"| {r['rp50']:.2f} | {r['rp99']:.2f} | {r['cpu_us']:.0f} | {hb} | {hu} | {dev} | {la} |")

stats = [f for f in sorted(os.listdir(outdir)) if f.endswith(".stats.json")]
if stats:
    print("\nbcachefilter counters (bcachefilter-ctl stats --json) over each run; "
          "for hits and rmw, minus those of the warm-up:\n")
    keys = ("cache_hits", "cache_misses", "cache_bypass_hits", "cache_bypass_misses",
            "cache_miss_collisions", "cache_read_races", "bypassed",
            "write_inserts", "write_collisions", "write_waits", "write_absorbed",
            "fills_dropped",
            "export_flushes")
    def get(f):
        return bcfstats.load(os.path.join(outdir, f)) or {}
    print("| run | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for f in stats:
        s = get(f)
        warm = f.split(".")[0] + ".warm.stats.json"  # that config's warm-up
        base = get(warm) if (".hits." in f or ".rmw." in f) and warm in stats else {}
        cells = []
        for k in keys:
            v = s.get(k)
            cells.append("?" if not isinstance(v, int) else str(v - base.get(k, 0)))
        print(f"| {f.removesuffix('.stats.json')} | " + " | ".join(cells) + " |")

    # The mixed workload's targets, from the counters of one run each.
    def counters(cfg, wl):
        f = f"{cfg}.{wl}.1.stats.json"
        return get(f) if f in stats else None
    def hit_ratio(s):
        h, m = s.get("cache_hits", 0), s.get("cache_misses", 0)
        return h / (h + m) if h + m else None
    z, mx = counters("bcachefilter", "zipf"), counters("bcachefilter", "mixed")
    if mx:
        print("\n| mixed (bcachefilter) | target | value |")
        print("|---|---:|---:|")
        hz, hm = (hit_ratio(z) if z else None), hit_ratio(mx)
        if hz and hm:
            print(f"| hit ratio vs zipf reads only ({hm*100:.1f}% / {hz*100:.1f}%) | ≥ 0.95 | "
                  f"{hm/hz:.2f}{' ✔' if hm/hz >= 0.95 else ' ✘'} |")
        m = mx.get("cache_misses", 0)
        if m:
            c = mx.get("cache_miss_collisions", 0) / m
            print(f"| miss collisions / misses | < 2% | {c*100:.2f}%{' ✔' if c < 0.02 else ' ✘'} |")
        wi, wc = mx.get("write_inserts", 0), mx.get("write_collisions", 0)
        if wi + wc:
            r = wi / (wi + wc)
            print(f"| writes that ended up cached | ≥ 95% | {r*100:.1f}%{' ✔' if r >= 0.95 else ' ✘'} |")
EOF
say "results in $OUTDIR (summary.md, fio JSON, nbdkit logs, commands.txt)"
