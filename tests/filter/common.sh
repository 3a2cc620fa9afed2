# bcachefilter: helpers shared by the filter's shell tests
# (tests/test-filter-*.sh).  -*- shell-script -*-
#
# Source it after functions.sh:
#
#   source "$(dirname "$0")/functions.sh"
#   source "$(dirname "$0")/filter/common.sh"
#   filter_requires                 # skip unless the filter and libnbd's
#                                   # python module are there
#   tmpdir d
#   start_remote memory 32M         # $remote_sock, $remote_pid
#   start_proxy p bcache="$d/cache" bcache-size=64M
#                                   # $p_sock, $p_pid, $p_uri
#
# make check exports BCACHEFILTER_SO (the built filter); when it is
# missing (the filter did not build) the test is skipped.

filterdir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# filter_requires
#
# Skip (exit 77) unless nbdkit runs, $BCACHEFILTER_SO is a built filter
# and a python3 with libnbd's "nbd" module exists; that python is left in
# $PYTHON (the first python3 on PATH may be a virtualenv without it).
filter_requires ()
{
    local _p
    requires nbdkit --version
    if [ -z "$BCACHEFILTER_SO" ] || [ ! -f "$BCACHEFILTER_SO" ]; then
        echo "$0: test skipped because the filter is not built" \
             "(BCACHEFILTER_SO='${BCACHEFILTER_SO}')"
        exit 77
    fi
    PYTHON=
    # A path, not the python3 function of functions.sh: $PYTHON is also
    # run by timeout and by nbdkit --run.
    for _p in "${PYTHON_NBD:-}" /usr/bin/python3 "$(type -P python3)" \
              /usr/local/bin/python3
    do
        [ -n "$_p" ] || continue
        if "$_p" -c 'import nbd' >/dev/null 2>&1; then
            PYTHON="$_p"
            break
        fi
    done
    if [ -z "$PYTHON" ]; then
        echo "$0: test skipped because no python3 has libnbd's nbd module"
        exit 77
    fi
    export PYTHON
}

# nbdio ARGS...
#
# Run tests/filter/nbdio.py (single NBD operations from the shell; see
# its header) with the python found by filter_requires.
nbdio ()
{
    "$PYTHON" "$filterdir/nbdio.py" "$@"
}

# start_remote ARGS...
#
# Start the "remote" (the export the proxy caches): nbdkit ARGS... on
# $d/remote.sock.  Sets $remote_sock and $remote_pid.
start_remote ()
{
    start_remote_named remote "$@"
}

# start_remote_named NAME ARGS...
#
# The same with another name: sets ${NAME}_sock and ${NAME}_pid.
start_remote_named ()
{
    local _n="$1"
    shift
    rm -f "$d/$_n.sock"     # left by an earlier server of that name
    start_nbdkit -P "$d/$_n.pid" -U "$d/$_n.sock" "$@"
    printf -v "${_n}_sock" '%s' "$d/$_n.sock"
    printf -v "${_n}_pid" '%s' "$nbdkit_pid"
}

# start_proxy NAME [remote=SOCK] ARGS...
#
# Start the proxy: nbdkit --filter=bcachefilter nbd socket=$remote_sock
# ARGS... on $d/NAME.sock (ARGS are the bcache-* parameters).  Sets
# ${NAME}_sock, ${NAME}_pid and ${NAME}_uri.  "remote=SOCK" as the
# first argument puts another remote behind it.
start_proxy ()
{
    local _n="$1" _r="$remote_sock"
    shift
    case "$1" in
        remote=*) _r="${1#remote=}"; shift ;;
    esac
    rm -f "$d/$_n.sock"     # left by an earlier server of that name
    start_nbdkit -P "$d/$_n.pid" -U "$d/$_n.sock" \
                 --filter="$BCACHEFILTER_SO" nbd socket="$_r" "$@"
    printf -v "${_n}_sock" '%s' "$d/$_n.sock"
    printf -v "${_n}_pid" '%s' "$nbdkit_pid"
    printf -v "${_n}_uri" '%s' "nbd+unix:///?socket=$d/$_n.sock"
}

# must_refuse LOG REGEXP NBDKIT-ARGS...
#
# nbdkit NBDKIT-ARGS... must refuse to start: exit with an error, within a
# bounded time, before it serves anything — with --run, nbdkit runs the
# command once it is serving, so a command that ran means the problem was
# found too late (e.g. in .after_fork: a service manager would have seen
# it start).  Its messages (kept in LOG) must match the extended REGEXP
# (grep -Ei).
must_refuse ()
{
    local _log="$1" _re="$2" _st=0 _ran="$1.ran"
    shift 2
    rm -f "$_ran"
    timeout 60 nbdkit -U - "$@" --run "touch '$_ran'" >"$_log" 2>&1 || _st=$?
    cat "$_log"
    if [ "$_st" -eq 124 ] || [ "$_st" -ge 128 ]; then
        fail "nbdkit $* did not exit cleanly (status $_st)"
    fi
    if [ -e "$_ran" ]; then
        fail "nbdkit $* started serving (exit status $_st); it should have" \
             "refused to start"
    fi
    if [ "$_st" -eq 0 ]; then
        fail "nbdkit $* exited with status 0; it should have refused"
    fi
    if ! grep -Eiq -- "$_re" "$_log"; then
        fail "nbdkit $* failed, but its message does not match '$_re'"
    fi
}

# ctl_stat SOCKET COUNTER
#
# Print a counter (e.g. cache_hits) from bcachefilter-ctl stats --json.
ctl_stat ()
{
    bcachefilter-ctl -s "$1" stats --json | "$PYTHON" "$filterdir/stat.py" "$2"
}

# wait_ctl SOCKET
#
# Wait (up to 30 s) for the proxy's control socket: it is made in
# .after_fork, which may still be opening the cache when the NBD socket
# and the pidfile already exist.
wait_ctl ()
{
    local _i
    for (( _i = 0; _i < 300; _i++ )); do
        test -S "$1" && return 0
        sleep 0.1
    done
    fail "no control socket at $1"
}
