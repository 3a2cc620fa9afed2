# bcachefilter: helpers for the shell tests (tests/test-*.sh), in the style
# of nbdkit's tests/functions.sh.  -*- shell-script -*-
#
# Usage.  A test starts like this:
#
#   #!/usr/bin/env bash
#   source "$(dirname "$0")/functions.sh"
#   set -e
#   set -x
#
#   requires nbdkit --version           # skip (exit 77) unless this works
#   tmpdir d                            # $d: a fresh directory, removed on exit
#   start_nbdkit -P "$d/pid" -U "$d/sock" memory 1M
#   nbdsh -u "nbd+unix:///?socket=$d/sock" -c '...'
#   cleanup_fn rm -f some-file          # more cleanups, run in reverse order
#   test "$x" = 1 || fail "x is $x, expected 1"
#
# Everything a test creates is removed by the cleanup functions, which run
# when the script exits for any reason (normal exit, error under set -e,
# fail, or INT/QUIT/TERM), newest first.  The exit status of the test is
# kept; if it was 0 but a cleanup found a problem (nbdkit had to be
# killed with SIGKILL or exited with an error), the test fails with 1.
#
# Exit statuses follow automake's conventions: 0 pass, 77 skip, anything
# else fail.
#
# make check exports abs_top_builddir and abs_top_srcdir and puts the
# built tools ($abs_top_builddir/tools) first in PATH (tests/Makefile.am).
# bcache-tools installs make-bcache and bcache-super-show in /usr/sbin, so
# the sbin directories are added to the end of PATH here.

case ":$PATH:" in
  *:/usr/sbin:*) ;;
  *) PATH="$PATH:/usr/sbin:/sbin"; export PATH ;;
esac

# python3: Debian's own interpreter where there is one.  The tests'
# helpers need only its standard library (and libnbd's module, which
# python3-libnbd installs for it), while the python3 first on PATH may
# be a version manager's shim: pyenv's takes 0.34 s to start on the CI's
# machine against 0.03 s, and test-format-tool.sh alone starts python 71
# times.
if [ -x /usr/bin/python3 ]; then
    python3 () { /usr/bin/python3 "$@"; }
fi

# fail MESSAGE...
#
# Print "$0: FAIL: MESSAGE" on stderr and exit 1 (cleanups still run).
fail ()
{
    echo "$0: FAIL: $*" >&2
    exit 1
}

# requires CMD ARGS...
#
# Run the command quietly.  If it fails, the test is skipped (exit 77),
# e.g. 'requires nbdsh --version'.
requires ()
{
    local _r=0
    ( "$@" ) </dev/null >/dev/null 2>&1 || _r=$?
    if [ "$_r" -ne 0 ]; then
        echo "$0: test skipped because '$*' failed (exit status $_r)"
        exit 77
    fi
}

# requires_root
#
# Skip the test unless it runs as root.
requires_root ()
{
    if [ "$(id -u)" -ne 0 ]; then
        echo "$0: test skipped because it must be run as root"
        exit 77
    fi
}

# cleanup_fn FN ARGS...
#
# Run "FN ARGS..." when the test exits.  Cleanups run in the reverse of
# the order they were registered, with set -e off.  The arguments are
# quoted now, so later changes to variables do not affect them.
_cleanup_fns=()
_cleanup_failed=0

cleanup_fn ()
{
    local _cmd
    printf -v _cmd '%q ' "$@"
    _cleanup_fns+=("$_cmd")
}

_run_cleanup_fns ()
{
    local _status=$1 _i

    set +e
    trap '' INT QUIT TERM
    trap - EXIT
    echo "$0: running cleanups (exit status $_status)"
    for (( _i = ${#_cleanup_fns[@]} - 1; _i >= 0; _i-- )); do
        eval "${_cleanup_fns[_i]}"
    done
    if [ "$_status" -eq 0 ] && [ "$_cleanup_failed" -ne 0 ]; then
        echo "$0: FAIL: a cleanup function failed" >&2
        _status=1
    fi
    exit "$_status"
}

trap '_run_cleanup_fns $?' EXIT
trap '_run_cleanup_fns 130' INT
trap '_run_cleanup_fns 131' QUIT
trap '_run_cleanup_fns 143' TERM

# tmpdir VAR
#
# Make a fresh temporary directory (under $TMPDIR or /tmp), remove it when
# the test exits, and store its path in the variable VAR.  (It sets a
# variable rather than printing the path because a command substitution
# runs in a subshell, where the cleanup could not be registered.)
tmpdir ()
{
    local _d
    if [[ ! "$1" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
        fail "tmpdir: usage: tmpdir VARIABLE-NAME"
    fi
    _d="$(mktemp -d "${TMPDIR:-/tmp}/bcachefilter-test.XXXXXXXXXX")" ||
        fail "tmpdir: mktemp -d failed"
    cleanup_fn rm -rf "$_d"
    printf -v "$1" '%s' "$_d"
}

# start_nbdkit -P PIDFILE -U SOCKET ARGS...
#
# Start "nbdkit -f -v --exit-with-parent -P PIDFILE -U SOCKET ARGS..." in
# the background, serving on the Unix socket SOCKET, and wait until it is
# ready: nbdkit writes PIDFILE once it accepts connections.  The wait is
# bounded by $NBDKIT_START_TIMEOUT seconds (default 60).  If nbdkit exits
# first, or does not get ready in time, the test fails with a message
# saying so; nbdkit's own messages are in the test log (-v).  A cleanup
# that stops nbdkit is registered.  The nbdkit pid is left in
# $nbdkit_pid.
start_nbdkit ()
{
    local _pidfile _sock _pid _i _status=0
    local _timeout="${NBDKIT_START_TIMEOUT:-60}"

    if [ "$1" != "-P" ] || [ -z "$2" ]; then
        fail "start_nbdkit: the first arguments must be -P PIDFILE"
    fi
    _pidfile="$2"
    shift 2
    if [ "$1" != "-U" ] || [ -z "$2" ]; then
        fail "start_nbdkit: -P PIDFILE must be followed by -U SOCKET"
    fi
    _sock="$2"
    shift 2

    rm -f "$_pidfile"
    nbdkit -f -v --exit-with-parent -P "$_pidfile" -U "$_sock" "$@" &
    _pid=$!
    # shellcheck disable=SC2034  # for the tests
    nbdkit_pid=$_pid
    cleanup_fn kill_nbdkit "$_pid"

    for (( _i = 0; _i < _timeout * 10; _i++ )); do
        if [ -s "$_pidfile" ]; then
            break
        fi
        if ! _process_alive "$_pid"; then
            wait "$_pid" || _status=$?
            fail "start_nbdkit: nbdkit exited with status $_status before" \
                 "it was ready (nbdkit $*); see its messages above"
        fi
        sleep 0.1
    done
    if [ ! -s "$_pidfile" ]; then
        fail "start_nbdkit: nbdkit did not write $_pidfile within" \
             "$_timeout seconds (nbdkit $*)"
    fi
    if [ ! -S "$_sock" ]; then
        fail "start_nbdkit: nbdkit is ready but $_sock is not a socket"
    fi
}

# Is the process alive (and not a zombie)?
_process_alive ()
{
    local _state
    kill -0 "$1" 2>/dev/null || return 1
    _state="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
    [[ "$_state" != Z* ]]
}

# kill_nbdkit PID
#
# Stop an nbdkit started by start_nbdkit: SIGTERM, then SIGKILL if it has
# not exited within $NBDKIT_KILL_TIMEOUT seconds (default 60).  Having to
# use SIGKILL, or nbdkit exiting with an error (a crash, or a sanitizer
# report at shutdown), fails the test.
kill_nbdkit ()
{
    local _pid=$1 _i _status=0 _killed=0
    local _timeout="${NBDKIT_KILL_TIMEOUT:-60}"

    if _process_alive "$_pid"; then
        kill "$_pid"
        for (( _i = 0; _i < _timeout * 10; _i++ )); do
            _process_alive "$_pid" || break
            sleep 0.1
        done
        if _process_alive "$_pid"; then
            echo "$0: nbdkit pid $_pid did not exit on SIGTERM" \
                 "within $_timeout seconds; sending SIGKILL" >&2
            kill -9 "$_pid"
            _killed=1
            _cleanup_failed=1
        fi
    fi
    wait "$_pid" 2>/dev/null || _status=$?
    # 143 = killed by our SIGTERM (nbdkit normally handles it and exits 0).
    if [ "$_killed" -eq 0 ] && [ "$_status" -ne 0 ] &&
       [ "$_status" -ne 143 ]; then
        echo "$0: nbdkit pid $_pid exited with status $_status" >&2
        _cleanup_failed=1
    fi
}

# _forget_cleanup CMD
#
# Remove the registered cleanup whose quoted form is CMD (as cleanup_fn
# would have quoted it).
_forget_cleanup ()
{
    local _i
    for _i in "${!_cleanup_fns[@]}"; do
        if [ "${_cleanup_fns[_i]}" = "$1" ]; then
            unset '_cleanup_fns[_i]'
        fi
    done
    _cleanup_fns=("${_cleanup_fns[@]}")
}

# stop_nbdkit PID
#
# Stop an nbdkit started by start_nbdkit before the end of the test, the
# way the cleanup would (SIGTERM, the same checks as kill_nbdkit: having
# to use SIGKILL or a non-zero exit status fails the test when it ends),
# and drop its cleanup.  Use it to restart a server mid-test.
stop_nbdkit ()
{
    local _cmd
    printf -v _cmd '%q ' kill_nbdkit "$1"
    kill_nbdkit "$1"
    _forget_cleanup "$_cmd"
}

# crash_nbdkit PID
#
# Kill an nbdkit started by start_nbdkit with SIGKILL (a crash: nothing
# it would do at exit runs), reap it and drop its cleanup.
crash_nbdkit ()
{
    local _cmd
    printf -v _cmd '%q ' kill_nbdkit "$1"
    kill -9 "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    _forget_cleanup "$_cmd"
}
