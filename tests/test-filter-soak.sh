#!/usr/bin/env bash
# bcachefilter: soak of the real nbdkit process, killed with SIGKILL at
# random moments under load, in every cache mode (issue 12, point 5).
#
# remote: nbdkit memory 32M (SOAK_EXPORT_SIZE) on a unix socket, filled
#         with random data.
#         It keeps running across the proxy's kills: in every mode but
#         writeback it is the truth.  It runs with --threads=1 (requests
#         of one connection one at a time; the proxy's connections still
#         run in parallel) because nbdkit 1.32 aborts in raw_send_socket
#         ("Assertion `sock >= 0' failed") when a client vanishes while
#         several replies to it are being sent, and a kill -9 of the proxy
#         is such a client.
# proxy:  nbdkit --filter=bcachefilter nbd socket=REMOTE, one 8 MiB cache
#         file (8 KiB buckets, 4 KiB blocks: 1024 buckets, more than the
#         512 the Linux kernel needs, and a 64 KiB journal) in front of the 32 MiB export, so that buckets are
#         reclaimed, GC runs and the journal fills (checkpoints) many
#         times a second; each round picks a journal delay (1, 10 or 100
#         ms), a sequential cutoff (4M or 64K) and the cache I/O (io_uring
#         where the kernel allows it, or pread/pwrite) at random.
#
# A round (tests/filter/soak.py, the model in tests/filter/shadow.py):
#  1. start the proxy on the cache the last round left after its kill;
#  2. read the whole export through it: every byte must be a value the
#     model allows after a crash (the last acknowledged write, or the
#     data of one in flight at the kill), and the proxy's view must equal
#     the export read directly; that view is the truth from then on;
#  3. 4 libnbd connections, 4 requests in flight each, of random reads
#     (each checked), writes (some FUA), zeroes, trims, NBD_CMD_CACHE and
#     flushes; half-way to the kill, sometimes a GC is triggered or the
#     mode switched (to one of $runtime_modes) through the control socket;
#  4. kill -9 of the proxy at a random moment: usually 0.1 to 3 s into
#     the workload, sometimes within 0.5 s of its start (while step 2
#     reads, or the cache is being filled);
#  5. `bcachefilter-show --fsck` of the killed cache must be clean, and
#     `bcachefilter-show --verify CACHE REMOTE` (every clean extent equals
#     the export) too, where bcachefilter-show has --verify (else the log
#     says "skipped: no --verify").
# Rounds run for BCACHEFILTER_SOAK_SECONDS (default 45) seconds in all,
# shared by the modes, at least SOAK_MIN_ROUNDS (default 2) per mode
# (about a minute with the last round and the final checks); then a
# clean restart, a GC and a last verification, and a clean stop.  The test also checks that it tested
# something: the killed caches held cached extents, checkpoints and GC
# passes ran beyond those at start, and the cache served hits.
#
# The modes are the list $modes (SOAK_MODES overrides it).  Writeback
# has its own test, test-filter-soak-writeback.sh (30 kills of a
# writeback proxy, this script with SOAK_MODES=writeback and
# SOAK_MIN_ROUNDS=30); bench/soak.sh runs either for longer.
# For writeback the checks are those it needs: soak.py then
# models flush durability (a write acknowledged after the last completed
# flush may be lost in a crash, and the export is not the truth until
# writeback completed), so after a restart each byte must hold the value
# of the last flush or FUA covering it, or of any later write; the
# export is compared only after the dirty data drained (drain_writeback:
# the mode set to writethrough through the control socket, dirty_data at
# 0).
#
# The seed is printed; TEST_SEED=N replays its workloads and kill times
# (the number of rounds depends on the machine's speed).

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires timeout --version
requires bcachefilter-show --version
requires bcachefilter-ctl --version

modes="${SOAK_MODES:-writethrough writearound none}"
min_rounds="${SOAK_MIN_ROUNDS:-2}"
# Modes a round may switch to at run time (bcachefilter-ctl set
# cache_mode): those in which the export is the truth, so the checks of
# the round's own mode still hold.
runtime_modes=(writethrough writearound none)
budget="${BCACHEFILTER_SOAK_SECONDS:-45}"
seed="${TEST_SEED:-$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')}"
echo "$0: seed $seed (rerun with TEST_SEED=$seed), $budget s"
RANDOM=$seed

tmpdir d
start_remote --threads=1 memory "${SOAK_EXPORT_SIZE:-32M}"
remote_uri="nbd+unix:///?socket=$remote_sock"
cache="$d/cache"
ctl="$d/ctl"
state="$d/model"

if bcachefilter-show --help 2>&1 | grep -q -- '--verify'; then
    have_verify=1
else
    have_verify=0
fi

# The driver of a round runs in the background; stop it if the test ends
# early.
driver=
stop_driver ()
{
    if [ -n "$driver" ] && kill -0 "$driver" 2>/dev/null; then
        kill "$driver"
        wait "$driver" 2>/dev/null
    fi
}
cleanup_fn stop_driver

# soak ARGS...: tests/filter/soak.py on this test's proxy and remote.
# Bounded at 300 s: the check after a restart compares 32 MiB with the
# model in Python, which took over a minute on a loaded 2-core host (a
# round hit the earlier 120 s bound with the proxy idle and correct).
soak ()
{
    timeout 300 "$PYTHON" "$filterdir/soak.py" --sock "$p_sock" \
        --remote "$remote_sock" --state "$state" --pidfile "$d/p.pid" "$@"
}

# sleep_ms N
sleep_ms () { sleep "$(printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)))"; }

# json_get FILE EXPR: print EXPR of the JSON document d in FILE.
json_get ()
{
    "$PYTHON" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}

# keep_evidence: if the test ends during the rounds (a failed check, or
# a proxy that does not start on the cache the last kill left), keep what
# a post-mortem needs in $SOAK_KEEP (default soak-failure-SEED in the
# current directory): the cache as the last kill left it (killed), as
# the failed round's proxy left it (cache), the export (export.img) and
# the model (model).  A cleanup, so it runs however the test ends.
in_rounds=0
keep_evidence ()
{
    local keep="${SOAK_KEEP:-$PWD/soak-failure-$seed}"
    [ "$in_rounds" -eq 1 ] || return 0
    mkdir -p "$keep" || return 0
    cp "$d/killed" "$keep/killed" 2>/dev/null || true
    cp "$cache" "$keep/cache" 2>/dev/null || true
    cp -r "$state" "$keep/model" 2>/dev/null || true
    nbdcopy "$remote_uri" "$keep/export.img" 2>/dev/null || true
    echo "$0: the failed round's cache, export and model are in $keep"
}

# check_killed_cache ROUND: fsck (and verify) the cache of a killed proxy.
keys=0
check_killed_cache ()
{
    local st=0
    bcachefilter-show --fsck --json "$cache" > "$d/fsck.json" || st=$?
    cat "$d/fsck.json"
    test "$st" -eq 0 ||
        fail "round $1: bcachefilter-show --fsck of the killed cache exits" \
             "$st (seed $seed)"
    keys=$((keys + $(json_get "$d/fsck.json" 'd["keys"]')))
    if [ "$have_verify" -eq 1 ]; then
        bcachefilter-show --verify "$cache" "$remote_uri" ||
            fail "round $1: bcachefilter-show --verify: the killed cache" \
                 "holds clean data the export does not (seed $seed)"
    else
        echo "$0: round $1: skipped: no --verify"
    fi
}

# sample_stats: add the running proxy's checkpoints (beyond the one at
# open), GC passes and hits to the totals.
checkpoints=0 gc_passes=0 hits=0
sample_stats ()
{
    timeout 10 bcachefilter-ctl -s "$ctl" stats --json > "$d/stats.json" ||
        return 0
    checkpoints=$((checkpoints + $(json_get "$d/stats.json" \
        'max(0, d["engine"]["checkpoint"]["count"] - 1)')))
    gc_passes=$((gc_passes + $(json_get "$d/stats.json" \
        'd["engine"]["gc_passes"]')))
    hits=$((hits + $(json_get "$d/stats.json" 'd["cache_hits"]')))
}

# drain_writeback: after the writeback rounds, on a fresh proxy: its view
# must be the model's; once the dirty data is written back (the mode set
# to writethrough, dirty_data at 0) it must equal the export too.
drain_writeback ()
{
    local i dirty
    rm -f "$ctl"
    start_proxy p bcache="$cache" bcache-mode=writeback bcache-ctl="$ctl"
    soak --mode writeback --verify-only --label "writeback, before draining" ||
        fail "writeback: the proxy's view is wrong after the last kill" \
             "(seed $seed)"
    bcachefilter-ctl -s "$ctl" set cache_mode writethrough
    for (( i = 0; i < 600; i++ )); do
        dirty=$(ctl_stat "$ctl" dirty_data)
        [ "$dirty" -eq 0 ] && break
        sleep 0.1
    done
    test "$dirty" -eq 0 || fail "writeback did not drain in 60 s ($dirty" \
                                "bytes dirty)"
    soak --mode writeback --verify-only --export-truth \
        --label "writeback, drained" ||
        fail "writeback: after draining, the export differs (seed $seed)"
    stop_nbdkit "$p_pid"
}

soak --mode writethrough --init --seed "$seed"
cleanup_fn keep_evidence
in_rounds=1

nmodes=$(wc -w <<< "$modes")
round=0
for mode in $modes; do
    mode_end=$((SECONDS + budget / nmodes))
    mode_rounds=0
    while [ "$mode_rounds" -lt "$min_rounds" ] ||
          [ "$SECONDS" -lt "$mode_end" ]; do
        round=$((round + 1))
        mode_rounds=$((mode_rounds + 1))
        jdelay=$(( (RANDOM % 3 == 0) ? 1 : (RANDOM % 2 ? 10 : 100) ))
        cutoff=$(( RANDOM % 3 == 0 ? 65536 : 4194304 ))
        if [ $((RANDOM % 2)) -eq 0 ]; then io=auto; else io=sync; fi
        rm -f "$ctl" "$d/started"
        start_proxy p bcache="$cache" bcache-size=8M bcache-bucket-size=8K \
            bcache-block-size=4k bcache-mode="$mode" bcache-ctl="$ctl" \
            bcache-journal-delay="$jdelay" bcache-sequential-cutoff="$cutoff" \
            bcache-io="$io"
        rseed=$((seed * 1000 + round))
        soak --mode "$mode" --seed "$rseed" --seconds 30 \
            --started "$d/started" --label "round $round $mode" &
        driver=$!

        if [ $((RANDOM % 7)) -eq 0 ]; then
            when=$((RANDOM % 500))
            echo "$0: round $round ($mode, seed $rseed, io $io): kill -9" \
                 "${when} ms after the start"
            sleep_ms "$when"
        else
            for (( i = 0; i < 600; i++ )); do
                [ -e "$d/started" ] && break
                kill -0 "$driver" 2>/dev/null || break
                sleep 0.1
            done
            when=$((100 + RANDOM % 2900))
            # Half-way: nothing, a GC, or a switch to another mode.
            act=() what=
            case $((RANDOM % 3)) in
                1) act=(trigger-gc) what=", a GC triggered" ;;
                2) to=${runtime_modes[RANDOM % ${#runtime_modes[@]}]}
                   act=(set cache_mode "$to") what=", switched to $to" ;;
            esac
            echo "$0: round $round ($mode, seed $rseed, io $io): kill -9" \
                 "${when} ms into the workload$what"
            sleep_ms $((when / 2))
            if [ "${#act[@]}" -gt 0 ]; then
                timeout 10 bcachefilter-ctl -s "$ctl" "${act[@]}" || true
            fi
            sleep_ms $((when - when / 2))
            sample_stats
        fi
        crash_nbdkit "$p_pid"
        st=0
        wait "$driver" || st=$?
        driver=
        case "$st" in
            0|3) ;;
            *) fail "round $round ($mode): the checks failed (status $st;" \
                    "TEST_SEED=$seed replays it)" ;;
        esac
        check_killed_cache "$round"
        cp "$cache" "$d/killed"
    done
    if [ "$mode" = writeback ]; then
        drain_writeback
    fi
done

in_rounds=0

# A clean restart: the same data, before and after a GC; a clean stop.
rm -f "$ctl"
start_proxy p bcache="$cache" bcache-ctl="$ctl"
soak --mode writethrough --verify-only --label "after the rounds" ||
    fail "after the last kill the proxy's view is wrong (seed $seed)"
bcachefilter-ctl -s "$ctl" trigger-gc
sample_stats
soak --mode writethrough --verify-only --label "after a GC" ||
    fail "after a GC the proxy's view changed (seed $seed)"
stop_nbdkit "$p_pid"
bcachefilter-show --fsck "$cache" || fail "fsck after a clean stop"

echo "$0: $round rounds; the killed caches held $keys keys in all;" \
     "$checkpoints checkpoints and $gc_passes GC passes ran, $hits hits"
test "$keys" -gt 0 ||
    fail "no killed cache held a cached extent: the test checked nothing"
test "$checkpoints" -gt 0 || fail "no checkpoint ran during the workloads"
test "$gc_passes" -gt 0 || fail "no GC pass ran during the workloads"
test "$hits" -gt 0 || fail "the cache served no hits"
echo "$0: OK (seed $seed, $round rounds)"
