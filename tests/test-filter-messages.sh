#!/usr/bin/env bash
# bcachefilter: what the filter says on a normal start and stop, and its
# version.
#
#  1. A normal run prints no "error:" line, with -v and without, and
#     without -v nothing at all (the engine's information, such as a
#     first registration, and a change of mode through the control socket
#     are debug output; nbdkit points stderr at /dev/null once it forks,
#     so nothing may go there directly).  Runs: a new cache file
#     (bcache-size=: formatted at start, attached to the export at the
#     first connection), its restart (opened for the export it
#     recorded), and a cache made by bcachefilter-format; each serving
#     writes, reads and a flush, answering the control socket (stats, a
#     mode change and back, show super), then stopping.  In particular
#     the filter opens no backend context outside a connection, for which
#     nbdkit-nbd-plugin prints "error: no connection in this thread".
#  2. With -v, the engine's informational lines are in the debug output;
#     once attached, show super gives the export's size.
#  3. nbdkit --version names the filter's own version, --dump-plugin
#     gives bcachefilter_version=, --help shows it in the longname.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help
requires bcachefilter-format --version
requires timeout --version

tmpdir d
start_remote memory 32M
version="$(bcachefilter-show --version | awk '{ print $2 }')"
test -n "$version"

# The client nbdkit --run starts: I/O, a flush, the control socket.
cat > "$d/client.sh" <<EOF
set -e
sock="\$1"
io () { "$PYTHON" "$filterdir/nbdio.py" "\$sock" "\$@"; }
ctl () { bcachefilter-ctl -s "$d/ctl" "\$@"; }
io fill 1M 64k 0x5a
io check 1M 64k 0x5a
io sha 0 4M > /dev/null
io sha 0 4M > /dev/null
io flush
ctl stats > /dev/null
ctl set cache_mode writearound
ctl set cache_mode writethrough
ctl show super --json > "$d/super.json"
EOF

# run NAME VERBOSE BCACHE-PARAMETERS...: nbdkit in front of the remote,
# running the client, then stopping; its messages in $d/NAME.log.  No
# "error:" line; without -v (VERBOSE empty) no line at all.
run ()
{
    local name="$1" v="$2"
    shift 2
    rm -f "$d/super.json"
    timeout 120 nbdkit $v -U - --filter="$BCACHEFILTER_SO" \
        nbd socket="$remote_sock" bcache-ctl="$d/ctl" "$@" \
        --run "bash '$d/client.sh' \"\$unixsocket\"" \
        > "$d/$name.out" 2> "$d/$name.log" ||
        { cat "$d/$name.log"; fail "$name: nbdkit failed"; }
    if grep -n 'error:' "$d/$name.log"; then
        fail "$name: a normal start and stop printed an error line"
    fi
    if [ -z "$v" ] && [ -s "$d/$name.log" ]; then
        cat "$d/$name.log"
        fail "$name: without -v nbdkit printed something"
    fi
    test "$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["export_size"])' "$d/super.json")" = 33554432 ||
        fail "$name: show super does not give the export's size"
}

# 1. Quiet runs.
run new "" bcache="$d/new" bcache-size=64M
run restart "" bcache="$d/new"
bcachefilter-format --size 64M "$d/formatted" > /dev/null
run formatted "" bcache="$d/formatted"

# 2. Verbose runs: the same, and the information is there as debug.
run new-v -v bcache="$d/new-v" bcache-size=64M
grep -q 'debug: bcachefilter: .*first registration of a new cache' \
    "$d/new-v.log" || fail "no first registration line in the debug output"
grep -q 'debug: bcachefilter: cache_mode set to writearound' \
    "$d/new-v.log" || fail "no line for the mode change in the debug output"
run restart-v -v bcache="$d/new-v"
grep -q 'debug: bcachefilter: .*opened; replayed' "$d/restart-v.log" ||
    fail "no open line in the debug output"

# 3. The filter's own version.
nbdkit --filter="$BCACHEFILTER_SO" memory 1M --version > "$d/version"
cat "$d/version"
grep -qx "nbdkit-bcachefilter-filter $version" "$d/version" ||
    fail "nbdkit --version does not show the filter's version $version"
nbdkit --filter="$BCACHEFILTER_SO" memory --dump-plugin > "$d/dump"
grep -qx "bcachefilter_version=$version" "$d/dump" ||
    fail "nbdkit --dump-plugin does not show bcachefilter_version=$version"
nbdkit --filter="$BCACHEFILTER_SO" memory --help > "$d/help"
grep -qF "filter: bcachefilter (bcachefilter $version: " "$d/help" ||
    fail "nbdkit --help does not show the filter's version"
