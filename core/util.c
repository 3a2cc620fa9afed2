/* bcachefilter engine: the ground floor (see util.h). */
#include "config.h"

#include <stdarg.h>
#include <stdio.h>

#include "util.h"

uint64_t
bcf_now_ns (void)
{
  struct timespec ts;

  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

void
bcf_sleep_ms (unsigned ms)
{
  struct timespec ts = { .tv_sec = ms / 1000,
                         .tv_nsec = (long) (ms % 1000) * 1000000 };
  nanosleep (&ts, NULL);
}

struct timespec
bcf_ns_to_timespec (uint64_t ns)
{
  return (struct timespec) { .tv_sec = (time_t) (ns / 1000000000u),
                             .tv_nsec = (long) (ns % 1000000000u) };
}

void
bcf_cond_init_monotonic (pthread_cond_t *cond)
{
  pthread_condattr_t ca;

  pthread_condattr_init (&ca);
  pthread_condattr_setclock (&ca, CLOCK_MONOTONIC);
  pthread_cond_init (cond, &ca);
  pthread_condattr_destroy (&ca);
}

void
bcf_time_stat_add (struct bcf_time_stat *t, pthread_mutex_t *lock,
                   uint64_t ns)
{
  pthread_mutex_lock (lock);
  t->count++;
  t->total_ns += ns;
  t->last_ns = ns;
  if (ns > t->max_ns)
    t->max_ns = ns;
  t->hist[bcf_time_hist_bucket (ns)]++;
  pthread_mutex_unlock (lock);
}

unsigned
bcf_time_hist_bucket (uint64_t ns)
{
  uint64_t us = ns / 1000;
  unsigned i = us ? 64 - (unsigned) __builtin_clzll (us) : 0;

  return i < BCF_TIME_HIST ? i : BCF_TIME_HIST - 1;
}

uint64_t
bcf_time_hist_floor_us (unsigned i)
{
  return i == 0 ? 0 : UINT64_C (1) << (i - 1);
}

void
bcf_log_to (bcf_log_fn *fn, void *opaque, enum bcf_log_level level,
            const char *fmt, ...)
{
  char msg[512];
  va_list ap;

  if (!fn)
    return;
  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  fn (opaque, level, msg);
}
