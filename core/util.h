/* bcachefilter engine: the ground floor (like bcache's util.c).
 *
 * Design
 * ------
 * The helpers every module uses: the monotonic clock, sleeping, condition
 * variables that time out on the monotonic clock, logging through the
 * caller's callback, time statistics and scoped cleanup attributes.  This
 * header depends on nothing in core/ but the public headers, so every
 * module can include it without creating an import cycle (engine.h
 * builds on it, not the other way round).
 *
 * Locking: none here; bcf_time_stat_add takes the lock it is given.
 */
#ifndef BCACHEFILTER_UTIL_H
#define BCACHEFILTER_UTIL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/cleanup.h"   /* CLEANUP_FREE, CLEANUP_CLOSE */

/* ---- Time ---------------------------------------------------------------- */

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t bcf_now_ns (void);
void bcf_sleep_ms (unsigned ms);
/* A CLOCK_MONOTONIC time in nanoseconds as a timespec (deadlines of
 * pthread_cond_timedwait on a condition made by bcf_cond_init_monotonic). */
struct timespec bcf_ns_to_timespec (uint64_t ns);
/* Initialise a condition variable whose timed waits use CLOCK_MONOTONIC
 * (so a change of the wall clock neither stretches nor cuts them). */
void bcf_cond_init_monotonic (pthread_cond_t *cond);

/* Record one duration (ns) in t, under lock: count, total, max, last and
 * the log-scale histogram (struct bcf_time_stat in bcachefilter/cache.h;
 * bcf_time_hist_floor_us names the buckets). */
void bcf_time_stat_add (struct bcf_time_stat *t, pthread_mutex_t *lock,
                        uint64_t ns);
/* The histogram bucket of a duration. */
unsigned bcf_time_hist_bucket (uint64_t ns);

/* ---- Logging ------------------------------------------------------------- */

typedef void bcf_log_fn (void *opaque, enum bcf_log_level level,
                         const char *msg);
/* Format a message and hand it to fn (nothing if fn is NULL). */
void bcf_log_to (bcf_log_fn *fn, void *opaque, enum bcf_log_level level,
                 const char *fmt, ...) __attribute__ ((format (printf, 4, 5)));

#endif /* BCACHEFILTER_UTIL_H */
