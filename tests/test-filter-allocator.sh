#!/usr/bin/env bash
# bcachefilter: the statistics show jemalloc's own figures when jemalloc
# is nbdkit's allocator, and nothing about the allocator otherwise.
#
#  - under glibc's malloc, "stats --json" has no "allocator" object and
#    the text has no [allocator] section;
#  - under LD_PRELOAD=libjemalloc.so.2 (skipped if the library cannot be
#    preloaded), the JSON has allocator.name "jemalloc" with allocated > 0
#    and resident >= allocated (jemalloc's own invariant), and the text
#    has the [allocator] section.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help

tmpdir d
start_remote memory 32M

# run_proxy NAME: a proxy with its control socket at $d/NAME.ctl.
run_proxy ()
{
    start_proxy "$1" bcache="$d/$1.cache" bcache-size=32M \
                bcache-ctl="$d/$1.ctl"
    for _ in $(seq 300); do test -S "$d/$1.ctl" && break; sleep 0.1; done
    test -S "$d/$1.ctl" || fail "no control socket at $d/$1.ctl"
}

# allocator CTL: print the JSON's allocator object as "name allocated
# resident", or "none".
allocator ()
{
    bcachefilter-ctl -s "$1" stats --json | "$PYTHON" -c '
import json, sys
a = json.load(sys.stdin).get("allocator")
print("none" if a is None else "%s %d %d" % (a["name"], a["allocated"], a["resident"]))'
}

run_proxy plain
test "$(allocator "$d/plain.ctl")" = none ||
    fail "stats show an allocator without jemalloc: $(allocator "$d/plain.ctl")"
! bcachefilter-ctl -s "$d/plain.ctl" stats | grep -F '[allocator]' ||
    fail "the text stats have an [allocator] section without jemalloc"

if LD_PRELOAD=libjemalloc.so.2 true 2>&1 | grep -q .; then
    echo "$0: test skipped (in part) because libjemalloc.so.2 cannot be preloaded"
    exit 77
fi
export LD_PRELOAD=libjemalloc.so.2
run_proxy je
unset LD_PRELOAD
nbdio "$je_sock" fill 0 1M 0x5a
read -r name allocated resident <<< "$(allocator "$d/je.ctl")"
test "$name" = jemalloc || fail "under jemalloc, stats show allocator $name"
test "$allocated" -gt 0 || fail "jemalloc's allocated is $allocated"
test "$resident" -ge "$allocated" ||
    fail "jemalloc's resident $resident is below its allocated $allocated"
bcachefilter-ctl -s "$d/je.ctl" stats > "$d/je.txt"
grep -E '^allocator +jemalloc$' "$d/je.txt"
grep -E '^allocated +[0-9]+$' "$d/je.txt"
grep -E '^resident +[0-9]+$' "$d/je.txt"
