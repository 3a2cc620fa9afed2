/* bcachefilter: the statistics, as one model.
 *
 * Three parts:
 *
 *  1. The counters with bcache's decayed views (struct bcf_stats).
 *     bcache keeps each counter as a total and as exponentially decayed
 *     five-minute, hour and day views (stats_total, stats_five_minute,
 *     stats_hour, stats_day).  Adding is cheap and safe from any thread;
 *     the decay is applied lazily from the monotonic clock when counters
 *     are added or read, so no timer thread is needed.  The same object
 *     holds the request latency histograms (read hit, read miss, write,
 *     flush), recorded into per-thread shards without a lock.  A cache
 *     owns one (bcf_cache_counters).
 *
 *  2. The descriptors: one table (bcf_stat_descs) naming every statistic
 *     the project shows, as bcache spells it where bcache has it, with
 *     its kind (counter, gauge, time stat, histogram, state), unit,
 *     one-line help and how to read it from a snapshot.
 *
 *  3. The snapshot (struct bcf_snapshot: every figure of a cache and its
 *     request layer, read at one time) and its renderers: text, JSON and
 *     Prometheus's text exposition format, each written once, from the
 *     table.  bcachefilter-ctl stats prints through them (the filter's
 *     control socket), bcachefilter-show reads its figures through the
 *     table by name, and the bench scripts read the JSON by the same
 *     names (bench/bcfstats.py).
 *
 * Locking: the counters are safe from any thread (core/stats.c says how);
 * a snapshot is the caller's alone.
 */
#ifndef BCACHEFILTER_STATS_H
#define BCACHEFILTER_STATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

/* ---- Counters with bcache's decayed views -------------------------------- */

enum bcf_stat_counter {
  BCF_STAT_HITS,              /* reads served wholly from the cache */
  BCF_STAT_MISSES,            /* reads that needed the backing store */
  BCF_STAT_BYPASS_HITS,       /* bypassed reads that hit */
  BCF_STAT_BYPASS_MISSES,     /* bypassed reads that missed */
  BCF_STAT_MISS_COLLISIONS,   /* miss inserts lost to a concurrent change */
  BCF_STAT_READ_RACES,        /* hits whose bucket was reused mid-read */
  BCF_STAT_BYPASSED_BYTES,    /* bytes that went around the cache */
  BCF_STAT__COUNT
};

enum bcf_stat_view {
  BCF_VIEW_TOTAL,
  BCF_VIEW_FIVE_MINUTE,
  BCF_VIEW_HOUR,
  BCF_VIEW_DAY,
  BCF_VIEW__COUNT
};

struct bcf_stats;

struct bcf_stats *bcf_stats_new (void);
void bcf_stats_free (struct bcf_stats *s);

void bcf_stats_add (struct bcf_stats *s, enum bcf_stat_counter k, uint64_t n);
/* The counters of one view (decayed views are rounded to integers). */
void bcf_stats_get (struct bcf_stats *s, enum bcf_stat_view v,
                    uint64_t out[BCF_STAT__COUNT]);

/* bcache's sysfs names: "cache_hits", "cache_misses", ... and "total",
 * "five_minute", "hour", "day". */
const char *bcf_stat_name (enum bcf_stat_counter k);
const char *bcf_stat_view_name (enum bcf_stat_view v);

/* Tests only: the clock (monotonic nanoseconds); NULL restores the real
 * one. */
void bcf_stats_test_clock (struct bcf_stats *s, uint64_t (*now_ns) (void));

/* ---- Durations ------------------------------------------------------------ */

/* Durations, like bcache's time_stats: count, total (for the average),
 * max, the last one, and a log-scale histogram: hist[0] counts those
 * under 1 us, hist[i] (i >= 1) those in [2^(i-1), 2^i) us, and the last
 * bucket everything from 2^(BCF_TIME_HIST-2) us (about 1 s) up. */
#define BCF_TIME_HIST 22
struct bcf_time_stat {
  uint64_t count;
  uint64_t total_ns;
  uint64_t max_ns;
  uint64_t last_ns;
  uint64_t hist[BCF_TIME_HIST];
};
/* The lower bound in microseconds of histogram bucket i (0 for i = 0). */
uint64_t bcf_time_hist_floor_us (unsigned i);
/* The q-quantile (0 < q <= 1) of t in ns, interpolated linearly inside
 * its bucket and never above t->max_ns; 0 if t is empty. */
uint64_t bcf_time_stat_quantile_ns (const struct bcf_time_stat *t, double q);

/* Request latency histograms: from the entry of bcf_req_read / _write /
 * _flush to its return.  A read is a hit if the cache served all of it.
 * Reads are timed one in eight per thread (the hit path reads no clock
 * otherwise), writes and flushes every one. */
enum bcf_latency {
  BCF_LAT_READ_HIT,
  BCF_LAT_READ_MISS,
  BCF_LAT_WRITE,
  BCF_LAT_FLUSH,
  BCF_LAT__COUNT
};
/* Record one duration: relaxed atomic adds to the calling thread's shard,
 * no lock. */
void bcf_stats_latency (struct bcf_stats *s, enum bcf_latency k, uint64_t ns);
/* The shards summed (last_ns is not kept: 0). */
void bcf_stats_latency_get (struct bcf_stats *s, enum bcf_latency k,
                            struct bcf_time_stat *out);

/* Zero the counters, their views and the latency histograms of s. */
void bcf_stats_clear (struct bcf_stats *s);

/* ---- The descriptors ------------------------------------------------------ */

enum bcf_stat_kind {
  BCF_KIND_COUNTER,           /* only grows (until clear_stats) */
  BCF_KIND_GAUGE,             /* a level: goes up and down */
  BCF_KIND_TIME,              /* an engine time stat (bcache's time_stats) */
  BCF_KIND_HISTOGRAM,         /* a request latency histogram */
  BCF_KIND_STATE,             /* a word or a yes/no: the mode, ... */
};

enum bcf_stat_unit {
  BCF_UNIT_NONE,
  BCF_UNIT_BYTES,
  BCF_UNIT_NS,
  BCF_UNIT_US,
  BCF_UNIT_SECONDS,
  BCF_UNIT_PERCENT,
};

/* Where a statistic sits in the text and JSON outputs. */
enum bcf_stat_section {
  BCF_SECTION_TOP,            /* the settings: first, at the top level */
  BCF_SECTION_VIEWS,          /* bcache's counters: per view */
  BCF_SECTION_ENGINE,         /* text [cache], JSON "engine" */
  BCF_SECTION_ALLOCATOR,      /* text [allocator], JSON "allocator" */
};

/* Flags of a descriptor. */
#define BCF_STAT_JSON_TOP   1u  /* in JSON at the top level, after "engine"
                                   (device_errors) */

struct bcf_stat_desc {
  const char *name;           /* bcache's spelling: the text and JSON key */
  enum bcf_stat_kind kind;
  enum bcf_stat_unit unit;
  enum bcf_stat_section section;
  unsigned flags;
  const char *help;           /* one line */
};

/* The table, in the order the outputs list it; *n gets its length. */
const struct bcf_stat_desc *bcf_stat_descs (size_t *n);
/* The descriptor of that name, or NULL. */
const struct bcf_stat_desc *bcf_stat_find (const char *name);

/* ---- Snapshots and their renderers ---------------------------------------- */

struct bcf_cache;
struct bcf_req;
struct bcf_snapshot;

/* Read every figure of cache c and, if r is not NULL, of its request
 * layer r (whose cache must be c).  NULL on out of memory.  Takes the
 * engine's locks briefly, does no I/O. */
struct bcf_snapshot *bcf_snapshot_take (struct bcf_cache *c,
                                        struct bcf_req *r);
/* The process's allocator as it reports itself (jemalloc's figures, for
 * the filter to add): the allocator section is shown only then. */
void bcf_snapshot_set_allocator (struct bcf_snapshot *snap, const char *name,
                                 uint64_t allocated, uint64_t resident);
void bcf_snapshot_free (struct bcf_snapshot *snap);

/* A statistic's value in a snapshot.  false if the snapshot has no such
 * figure (the request layer's without one, the allocator's unless set). */
struct bcf_stat_value {
  enum { BCF_VALUE_U64, BCF_VALUE_I64, BCF_VALUE_BOOL, BCF_VALUE_STR,
         BCF_VALUE_TIME } type;
  uint64_t u;
  int64_t i;
  bool b;
  const char *s;
  struct bcf_time_stat t;
};
bool bcf_stat_get (const struct bcf_snapshot *snap,
                   const struct bcf_stat_desc *d, enum bcf_stat_view v,
                   struct bcf_stat_value *out);

enum bcf_stats_format {
  BCF_STATS_TEXT,             /* aligned "name value" lines, [sections] */
  BCF_STATS_JSON,             /* one JSON object (json-c) */
  BCF_STATS_PROMETHEUS,       /* the text exposition format, 0.0.4 */
};
/* Write the snapshot to fp.  0, or -1 with errno set (out of memory, a
 * write error). */
int bcf_snapshot_render (const struct bcf_snapshot *snap,
                         enum bcf_stats_format f, FILE *fp);

/* clear_stats (bcache's): zero every counter, time stat and histogram of
 * cache c and its request layer r (may be NULL); gauges (dirty_data,
 * buckets, ...) and states stay.  The counters of other layers (which
 * their own logic may read) are not written: snapshots of c subtract
 * what they held at the clear.  0, or -ENOMEM: then nothing was
 * cleared. */
int bcf_stats_clear_all (struct bcf_cache *c, struct bcf_req *r);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_STATS_H */
