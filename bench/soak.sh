#!/usr/bin/env bash
# bcachefilter: a long soak of the real nbdkit process, killed with
# SIGKILL under load (tests/test-filter-soak.sh), for longer than `make
# check` runs it.  Not a benchmark: it measures nothing, it looks for the
# rare interleaving (a lost flushed write, a cache that serves data older
# than the export) that the minute in `make check` may not reach.
#
#   bench/soak.sh [-b BUILDDIR] [-t TOTAL_SECONDS] [-r ROUND_SECONDS] [MODE...]
#
# Runs the soak again and again, each time with a new seed, for
# TOTAL_SECONDS (default 1800), each run lasting ROUND_SECONDS (default
# 300) shared by the MODEs (default: writeback; any of writethrough,
# writeback, writearound, none).  Stops at the first failure, keeps that
# run's log and prints the seed that replays it (TEST_SEED=N
# SOAK_MODES=... in the test's environment).  BUILDDIR (default
# _build/default) is a configured and built tree.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
build=$top/_build/default total=1800 round=300
while getopts b:t:r: o; do
  case $o in
    b) build=$(cd "$OPTARG" && pwd) ;;
    t) total=$OPTARG ;;
    r) round=$OPTARG ;;
    *) sed -n '2,/^set -e/p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
modes="${*:-writeback}"
[ -f "$build/tests/Makefile" ] ||
  { echo "$0: $build is not a configured build tree (see -b)" >&2; exit 2; }
make -s -C "$build" >/dev/null

end=$((SECONDS + total)) runs=0
log=$build/tests/test-filter-soak.log
while [ "$SECONDS" -lt "$end" ]; do
  seed=$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')
  runs=$((runs + 1))
  printf '%s: run %d, modes %s, seed %s, %s s\n' "$0" "$runs" "$modes" \
    "$seed" "$round"
  if ! TEST_SEED=$seed SOAK_MODES=$modes SOAK_MIN_ROUNDS=2 \
       BCACHEFILTER_SOAK_SECONDS=$round \
       make -s -C "$build/tests" check TESTS=test-filter-soak.sh \
         >/dev/null 2>&1; then
    cp "$log" "$build/soak-failed-$seed.log"
    grep -E 'FAIL|soak\[' "$log" | grep -v '^+' | tail -5 || true
    echo "$0: FAILED: replay with TEST_SEED=$seed SOAK_MODES='$modes'" \
         "BCACHEFILTER_SOAK_SECONDS=$round; log in" \
         "$build/soak-failed-$seed.log"
    exit 1
  fi
  grep -E 'OK \(seed' "$log" | tail -1
done
echo "$0: $runs runs passed in $SECONDS s (modes $modes)"
