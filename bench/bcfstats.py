# bench: the one reader of "bcachefilter-ctl stats --json" for the bench
# scripts (filter-bench.sh, seq-bypass.sh, gc-stall-summary.py).
#
# The engine describes every statistic once (core/metrics.c, the table of
# bcachefilter/stats.h), each under one name, unique across the
# document's sections; so a statistic is looked up by its name alone,
# wherever the JSON puts it: the settings and bcache's totals at the top
# level, the engine's figures in "engine", jemalloc's in "allocator"
# (whose "name" is the statistic "allocator").  bcache's decayed views
# stay in doc["views"].  Time stats and latencies are objects (count,
# total_ns, max_ns, ... hist_us), the rest numbers, words or booleans.
import json


def flat(doc):
    """{name: value} for every statistic of a stats --json document."""
    out = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    out.update(doc.get("engine", {}))
    alloc = dict(doc.get("allocator", {}))
    if "name" in alloc:
        alloc["allocator"] = alloc.pop("name")
    out.update(alloc)
    return out


def load(path):
    """flat() of the stats --json saved in path, or None if it is missing
    or not the JSON of the statistics (a failed bcachefilter-ctl)."""
    try:
        with open(path) as f:
            return flat(json.load(f))
    except (OSError, ValueError, AttributeError):
        return None
