# bench-lib.sh: what the benchmark scripts share (sourced, not run).
# shellcheck shell=bash
#
# The caller sets BENCH_NAME (for messages), OUTDIR (servers' logs and
# commands.txt go there) and PIDS=() (every process it started and has not
# reaped; stop_pid takes a pid out, the caller's exit trap stops the rest,
# newest first).  It runs with `set -euo pipefail`.
#
#   die MSG / say MSG          error exit / progress line, on stderr
#   stop_pid PID [timeout_s]   TERM, wait, KILL
#   uri SOCKET                 the NBD URI of a unix socket
#   start_server NAME SOCKET COMMAND...   an NBD server in the foreground
#                              (our child) on SOCKET, once it answers;
#                              SERVER_PID is its pid
#   start_nbdkit NAME SOCKET ARGS...      nbdkit -f --exit-with-parent
#   start_qemu_nbd NAME SOCKET ARGS...    qemu-nbd (setpriv --pdeathsig)
#   bench_dirs NAME            WORKDIR (mktemp -d /var/tmp/NAME.XXXXXX
#                              unless set; MADE_WORKDIR=1 then) and OUTDIR
#                              (/var/tmp/NAME-results.DATE unless set),
#                              both made and absolute
#   bench_cleanup_on_exit FILE...   the exit trap: stop PIDS newest first,
#                              then remove WORKDIR if bench_dirs made it,
#                              else its sockets and the FILEs; KEEP=1
#                              keeps everything but the files listed in
#                              the array BENCH_CLEANUP_ALWAYS, which go
#                              in every case
#   settle_disk NAME           before a measured run: write back every
#                              dirty page of the host (sync), and append
#                              how much there was to OUTDIR/settle.tsv
#
# Why settle_disk: nbdkit's cache filter keeps its cache in a temporary
# file it never syncs, so after its run the kernel writes gigabytes back
# in the background, and the next front end's device flushes wait for
# them (a journal write of 527 ms in the bcachefilter run that followed
# the cache filter's at 1M keys, where the others saw 16-65 ms).  Each
# run starts from a host with nothing dirty instead.

die() { echo "${BENCH_NAME:-bench}: $*" >&2; exit 1; }
say() { echo "[$(date +%T)] $*" >&2; }
uri() { echo "nbd+unix:///?socket=$1"; }

stop_pid() {                    # stop_pid PID [timeout_s]: TERM, wait, KILL
    local pid=$1 t=${2:-30} i
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for (( i = 0; i < t * 10; i++ )); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        say "WARNING: pid $pid did not exit within ${t}s of SIGTERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    local p keep=()
    for p in "${PIDS[@]}"; do [[ $p == "$pid" ]] || keep+=("$p"); done
    PIDS=("${keep[@]}")
}

# start_server NAME SOCKET COMMAND...: start an NBD server that stays in the
# foreground (as our child) and listens on SOCKET, wait until it answers;
# its pid is left in SERVER_PID (and in PIDS, so that it is stopped at exit).
start_server() {
    local name=$1 sock=$2 i; shift 2
    rm -f "$sock"
    echo "$*" >>"$OUTDIR/commands.txt"
    "$@" >>"$OUTDIR/$name.log" 2>&1 &
    SERVER_PID=$!
    PIDS+=("$SERVER_PID")
    for (( i = 0; i < 1200; i++ )); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            tail -20 "$OUTDIR/$name.log" >&2
            die "$name ($1) exited at startup; log: $OUTDIR/$name.log"
        fi
        if [[ -S $sock ]] && nbdinfo --size "$(uri "$sock")" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    die "$name ($1) not ready after 120 s; log: $OUTDIR/$name.log"
}

# start_nbdkit NAME SOCKET ARGS...: nbdkit in the foreground, see start_server
# (the caller may set NBDKIT_ENV, e.g. to (env LD_PRELOAD=...))
NBDKIT_ENV=()
start_nbdkit() {
    local name=$1 sock=$2; shift 2
    start_server "$name" "$sock" "${NBDKIT_ENV[@]}" \
        nbdkit -f --exit-with-parent -U "$sock" "$@"
}

# start_qemu_nbd NAME SOCKET ARGS...: qemu-nbd (it stays in the foreground
# without --fork).  It has no --exit-with-parent: setpriv --pdeathsig does
# that job.  SOCKET must be absolute.
start_qemu_nbd() {
    local name=$1 sock=$2 pre=(); shift 2
    if command -v setpriv >/dev/null; then pre=(setpriv --pdeathsig TERM); fi
    start_server "$name" "$sock" "${pre[@]}" qemu-nbd -k "$sock" "$@"
}

bench_dirs() {
    local name=$1
    MADE_WORKDIR=0
    if [[ -z ${WORKDIR:-} ]]; then
        WORKDIR=$(mktemp -d "/var/tmp/$name.XXXXXX")
        MADE_WORKDIR=1
    fi
    mkdir -p "$WORKDIR"; WORKDIR=$(cd "$WORKDIR" && pwd)
    OUTDIR=${OUTDIR:-/var/tmp/$name-results.$(date +%Y%m%d-%H%M%S)}
    mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
}

settle_disk() {                 # settle_disk NAME
    local dirty wb
    dirty=$(awk '/^Dirty:/ { print $2 }' /proc/meminfo)
    wb=$(awk '/^Writeback:/ { print $2 }' /proc/meminfo)
    sync
    printf '%s\t%s\t%s\n' "$1" "$dirty" "$wb" >>"$OUTDIR/settle.tsv"
}

BENCH_CLEANUP_FILES=()
bench_cleanup() {
    local rc=$? i
    trap - EXIT INT TERM HUP
    for (( i = ${#PIDS[@]} - 1; i >= 0; i-- )); do stop_pid "${PIDS[i]}" 10; done
    if [[ ${KEEP:-0} == 1 ]]; then say "kept WORKDIR $WORKDIR"
    elif [[ ${MADE_WORKDIR:-0} == 1 ]]; then rm -rf "$WORKDIR"
    else rm -f "$WORKDIR"/*.sock "${BENCH_CLEANUP_FILES[@]}"; fi
    # outside WORKDIR and never kept (filter-bench's copy in /dev/shm: RAM)
    rm -f ${BENCH_CLEANUP_ALWAYS[@]+"${BENCH_CLEANUP_ALWAYS[@]}"}
    exit "$rc"
}
bench_cleanup_on_exit() {
    BENCH_CLEANUP_FILES=("$@")
    trap bench_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    trap 'exit 129' HUP
}
