/* bcachefilter: request counters with bcache's decayed views.
 *
 * bcache keeps each counter as a total and as exponentially decayed
 * five-minute, hour and day views (stats_total, stats_five_minute,
 * stats_hour, stats_day).  Adding is cheap and safe from any thread;
 * the decay is applied lazily from the monotonic clock when counters are
 * added or read, so no timer thread is needed.
 */
#ifndef BCACHEFILTER_STATS_H
#define BCACHEFILTER_STATS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

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

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_STATS_H */
