#!/usr/bin/env bash
# bcachefilter: "stats --prometheus", the latency histograms and
# "clear_stats", through the control socket and bcachefilter-ctl.
#
#  - the Prometheus output parses (filter/prometheus.py check): HELP and
#    TYPE for every family, counters named *_total, numbers for values,
#    histograms with cumulative buckets ending at +Inf = count;
#  - it is the same table as the JSON: every statistic of the JSON's
#    "engine" object and every counter at its top level has a family,
#    the three decayed views are labels, the cache mode is a label;
#  - values move after I/O: misses, hits, the read-miss, read-hit, write
#    and flush latency histograms, whose p50/p99/max the text and JSON
#    show too;
#  - clear_stats zeroes the counters and histograms (bcache's counters,
#    the engine's, the latencies) but not the gauges (buckets, cutoff),
#    and the counters count again afterwards;
#  - a bad stats option is refused with its usage.

source "$(dirname "$0")/functions.sh"
source "$(dirname "$0")/filter/common.sh"
set -e
set -x

filter_requires
requires bcachefilter-ctl --help

tmpdir d
ctl="$d/ctl"
start_remote memory 32M
start_proxy p bcache="$d/cache" bcache-size=64M bcache-ctl="$ctl"
wait_ctl "$ctl"

C () { bcachefilter-ctl -s "$ctl" "$@"; }
prom () { C stats --prometheus > "$d/prom"; }
pv () { "$PYTHON" "$filterdir/prometheus.py" value "$@" < "$d/prom"; }

prom
cat "$d/prom"
"$PYTHON" "$filterdir/prometheus.py" check < "$d/prom" ||
    fail "stats --prometheus does not follow the exposition format"

# One table: the JSON's statistics all have a family, and the families
# have the types of their kinds.
C stats --json > "$d/stats.json"
"$PYTHON" - "$d/stats.json" "$d/prom" "$filterdir" <<'EOF'
import json, sys
sys.path.insert(0, sys.argv[3])
import prometheus
j = json.load(open(sys.argv[1]))
fams = prometheus.parse(open(sys.argv[2]).read())
def family(name):
    for suffix in ("", "_total", "_bytes", "_bytes_total", "_seconds",
                   "_seconds_total", "_percent"):
        for base in (name, name[:-3] if name.endswith(("_ns", "_us")) else None):
            if base and "bcachefilter_" + base + suffix in fams:
                return "bcachefilter_" + base + suffix
    sys.exit(f"no Prometheus family for the JSON's {name}")
names = [k for k in j["engine"]] + \
        [k for k, v in j.items() if not isinstance(v, (dict, list))]
for k in names:
    f = family(k)
    if isinstance(j.get(k, j["engine"].get(k)), dict):   # a time stat
        assert fams[f]["type"] == "histogram", (k, f, fams[f]["type"])
print(f"{len(names)} statistics of the JSON, each with a family")
for k in ("cache_hits", "cache_misses", "bypassed", "device_errors",
          "journal_writes", "gc_passes", "write_inserts"):
    assert fams[family(k)]["type"] == "counter", k
for k in ("dirty_data", "nbuckets", "buckets_free", "io_errors"):
    assert fams[family(k)]["type"] == "gauge", k
views = {s[1]["view"] for s in fams["bcachefilter_cache_hits_decayed"]["samples"]}
assert views == {"five_minute", "hour", "day"}, views
for h in ("read_hit", "read_miss", "write", "flush"):
    assert fams[f"bcachefilter_latency_{h}_seconds"]["type"] == "histogram"
EOF
test "$(pv bcachefilter_cache_mode cache_mode=writethrough)" = 1 ||
    fail "the cache mode is not a label"
test "$(pv bcachefilter_io_error_limit)" = 64 || fail "io_error_limit"

# Values move after I/O.
m0=$(pv bcachefilter_cache_misses_total)
rm0=$(pv bcachefilter_latency_read_miss_seconds_count)
w0=$(pv bcachefilter_latency_write_seconds_count)
f0=$(pv bcachefilter_latency_flush_seconds_count)
# Reads are timed one in eight per thread: each connection's first is.
for i in $(seq 0 15); do nbdio "$p_sock" sha $((i * 65536)) 64k > /dev/null; done
nbdio "$p_sock" fill 8M 64k 0x5c
nbdio "$p_sock" flush
prom
"$PYTHON" "$filterdir/prometheus.py" check < "$d/prom"
m1=$(pv bcachefilter_cache_misses_total)
rm1=$(pv bcachefilter_latency_read_miss_seconds_count)
test "$m1" -ge $((m0 + 16)) || fail "16 read misses: cache_misses $m0 -> $m1"
test "$rm1" -gt "$rm0" || fail "read misses were not timed ($rm0 -> $rm1)"
test "$(pv bcachefilter_latency_write_seconds_count)" -gt "$w0" ||
    fail "a write was not timed"
test "$(pv bcachefilter_latency_flush_seconds_count)" -gt "$f0" ||
    fail "a flush was not timed"
test "$(pv bcachefilter_latency_read_miss_seconds_bucket le=+Inf)" = "$rm1" ||
    fail "the read-miss histogram's +Inf bucket is not its count"
# Hits (the fills may land just after the clients have their answers).
for i in $(seq 1 50); do
    for j in $(seq 0 15); do
        nbdio "$p_sock" sha $((j * 65536)) 64k > /dev/null
    done
    prom
    [ "$(pv bcachefilter_latency_read_hit_seconds_count)" -gt 0 ] && break
    sleep 0.2
done
test "$(pv bcachefilter_cache_hits_total)" -gt 0 || fail "no hits counted"
test "$(pv bcachefilter_latency_read_hit_seconds_count)" -gt 0 ||
    fail "hits were not timed"
"$PYTHON" "$filterdir/prometheus.py" check < "$d/prom"

# The text and JSON show the latencies as p50, p99 and max.
C stats > "$d/stats.txt"
grep -E '^latency_read_hit +count [1-9][0-9]*, p50 [0-9.]+ ms, p99 [0-9.]+ ms, max [0-9.]+ ms$' \
     "$d/stats.txt" || fail "the text stats have no read-hit latency line"
C stats --json | "$PYTHON" -c '
import json, sys
e = json.load(sys.stdin)["engine"]
for h in ("latency_read_hit", "latency_read_miss", "latency_write", "latency_flush"):
    t = e[h]
    assert t["count"] > 0 and 0 < t["p50_ns"] <= t["p99_ns"] <= t["max_ns"], (h, t)
    assert sum(t["hist_us"].values()) == t["count"], (h, t)
' || fail "the JSON latencies are not count, p50 <= p99 <= max"

# clear_stats: counters and histograms from zero, gauges kept.
nb=$(pv bcachefilter_nbuckets)
cut=$(pv bcachefilter_sequential_cutoff_bytes)
test "$(pv bcachefilter_journal_writes_total)" -gt 0 || fail "no journal writes"
test "$(pv bcachefilter_inserts_total)" -gt 0 || fail "no inserts"
C clear_stats
prom
cat "$d/prom"
"$PYTHON" "$filterdir/prometheus.py" check < "$d/prom"
for c in cache_hits_total cache_misses_total inserts_total \
         journal_writes_total write_inserts_total device_errors_total \
         latency_read_hit_seconds_count latency_read_miss_seconds_count \
         latency_write_seconds_count latency_flush_seconds_count \
         checkpoint_seconds_count; do
    test "$(pv bcachefilter_$c)" = 0 || fail "$c is $(pv bcachefilter_$c) after clear_stats"
done
test "$(pv bcachefilter_cache_hits_decayed view=day)" = 0 ||
    fail "the day view was not cleared"
test "$(pv bcachefilter_nbuckets)" = "$nb" || fail "clear_stats changed nbuckets"
test "$(pv bcachefilter_sequential_cutoff_bytes)" = "$cut" ||
    fail "clear_stats changed sequential_cutoff"
test "$(ctl_stat "$ctl" cache_hits)" = 0 || fail "JSON cache_hits after clear_stats"
# ... and they count again.
nbdio "$p_sock" sha 0 64k > /dev/null
nbdio "$p_sock" fill 9M 64k 0x5d
nbdio "$p_sock" flush
prom
test $(( $(pv bcachefilter_cache_hits_total) + $(pv bcachefilter_cache_misses_total) )) -eq 1 ||
    fail "a read after clear_stats did not count once"
test "$(pv bcachefilter_write_inserts_total)" = 1 ||
    fail "write_inserts did not count from 0 after clear_stats"
test "$(pv bcachefilter_latency_write_seconds_count)" = 1 ||
    fail "the write after clear_stats: $(pv bcachefilter_latency_write_seconds_count) timed"

# Usage.
st=0; C stats --prometheus --json > "$d/usage.out" 2>&1 || st=$?
test "$st" = 2 || fail "stats --prometheus --json: exit status $st, not 2"
st=0; C clear_stats now > "$d/usage.out" 2>&1 || st=$?
test "$st" = 2 || fail "clear_stats now: exit status $st, not 2"
