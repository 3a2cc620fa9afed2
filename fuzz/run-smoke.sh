#!/bin/sh
# Run one fuzz target for a bounded time (make fuzz-smoke, in the build
# directory): run-smoke.sh TARGET MAXLEN SECONDS [LIBFUZZER-FLAGS...].
# Crashes, leaks and timeouts go to TARGET.artifacts/; the log is
# TARGET.log and the report TARGET.report, which make prints in order once
# every target ran (they run JOBS at a time).  Exit status 1 if the
# target failed.
t=$1 maxlen=$2 seconds=$3
shift 3
corpus=corpus-${t#fuzz-} art=$t.artifacts
rm -rf "$art"
mkdir -p "$art"
{
  echo "  FUZZ     $t ($seconds s, corpus $corpus)"
  if ./"$t" -max_total_time="$seconds" -max_len="$maxlen" \
       -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
       -artifact_prefix="$art/" "$@" "$corpus" >"$t.log" 2>&1; then
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$t.log" | tail -n 1 |
      sed 's/^#[0-9]*[[:space:]]*DONE[[:space:]]*//')
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$t.log")
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$t.log")
    echo "           ok: $execs execs, $rate exec/s; $done_line"
    rc=0
  else
    echo "           FAILED: see $(pwd)/$t.log"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|.*fuzz assertion failed|.*runtime error)' "$t.log" |
      head -n 5 | sed 's/^/           /'
    for a in "$art"/*; do
      test -f "$a" || continue
      sz=$(wc -c <"$a" | tr -d ' ')
      echo "           artifact ($sz bytes): $(pwd)/$a"
      od -A x -t x1z -v "$a" | head -n 64 | sed 's/^/             /'
      test "$sz" -le 1024 || echo "             ... (first 1024 bytes shown)"
    done
    rc=1
  fi
} >"$t.report"
exit $rc
