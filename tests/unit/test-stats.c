/* Unit tests for core/stats: bcache's counters and decayed views.
 *
 * The decay tests drive a fake monotonic clock and compare the views with
 * values worked out by hand from bcache's arithmetic: a tick every
 * 300/22 s moves what was added (x << 16, fixed point) into the views,
 * then five_minute is scaled by 31/32 (integer division) every tick, hour
 * every 12 ticks and day every 288; a view shows x >> 16.  The thread
 * tests check that no add is lost, neither in the total nor through the
 * collector while ticks run concurrently.  Then the latency histograms
 * (buckets, quantiles, no record lost across the shards), clear_stats,
 * and the table of descriptors.
 */
#include "config.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <check.h>

#include "bcachefilter/stats.h"
#include "testlib.h"

/* bcache's accounting_delay, in ns. */
#define TICK (300ull * 1000000000ull / 22)

static _Atomic uint64_t fake_ns;
static uint64_t fake_clock (void) { return atomic_load (&fake_ns); }

static struct bcf_stats *
new_fake (uint64_t start)
{
  struct bcf_stats *s = bcf_stats_new ();

  ck_assert_ptr_nonnull (s);
  atomic_store (&fake_ns, start);
  bcf_stats_test_clock (s, fake_clock);   /* the epoch is now */
  return s;
}

static uint64_t
view (struct bcf_stats *s, enum bcf_stat_view v, enum bcf_stat_counter k)
{
  uint64_t out[BCF_STAT__COUNT];

  bcf_stats_get (s, v, out);
  return out[k];
}

static void
at (uint64_t start, uint64_t ns)
{
  atomic_store (&fake_ns, start + ns);
}

START_TEST (test_names)
{
  static const char *const names[BCF_STAT__COUNT] = {
    "cache_hits", "cache_misses", "cache_bypass_hits", "cache_bypass_misses",
    "cache_miss_collisions", "cache_read_races", "bypassed",
  };
  static const char *const views[BCF_VIEW__COUNT] = {
    "total", "five_minute", "hour", "day",
  };

  for (int k = 0; k < BCF_STAT__COUNT; k++)
    ck_assert_str_eq (bcf_stat_name (k), names[k]);
  for (int v = 0; v < BCF_VIEW__COUNT; v++)
    ck_assert_str_eq (bcf_stat_view_name (v), views[v]);
  ck_assert_ptr_null (bcf_stat_name (BCF_STAT__COUNT));
  ck_assert_ptr_null (bcf_stat_view_name (BCF_VIEW__COUNT));
}
END_TEST

START_TEST (test_total_exact)
{
  struct bcf_stats *s = bcf_stats_new ();
  uint64_t out[BCF_STAT__COUNT];

  ck_assert_ptr_nonnull (s);
  for (int k = 0; k < BCF_STAT__COUNT; k++)
    bcf_stats_add (s, k, (uint64_t) k + 1);
  bcf_stats_add (s, BCF_STAT_BYPASSED_BYTES, UINT64_C (1) << 40);
  bcf_stats_add (s, BCF_STAT_HITS, 0);
  bcf_stats_add (s, BCF_STAT__COUNT, 5);          /* ignored */
  bcf_stats_get (s, BCF_VIEW_TOTAL, out);
  for (int k = 0; k < BCF_STAT_BYPASSED_BYTES; k++)
    ck_assert_uint_eq (out[k], (uint64_t) k + 1);
  ck_assert_uint_eq (out[BCF_STAT_BYPASSED_BYTES], 7 + (UINT64_C (1) << 40));
  bcf_stats_free (s);
  bcf_stats_free (NULL);
}
END_TEST

/* 1000 hits at time 0, then nothing: the views tick by tick. */
START_TEST (test_decay_one_burst)
{
  const uint64_t t0 = 1000 * TICK + 12345;   /* any start */
  struct bcf_stats *s = new_fake (t0);

  bcf_stats_add (s, BCF_STAT_HITS, 1000);

  /* Before the first tick the views are empty (bcache's lag) and the
   * total is exact. */
  at (t0, TICK - 1);
  ck_assert_uint_eq (view (s, BCF_VIEW_TOTAL, BCF_STAT_HITS), 1000);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_HITS), 0);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 0);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 0);

  /* Tick 1: 1000 << 16 = 65536000 moved; five_minute scaled once:
   * 65536000 * 31 / 32 = 63488000, >> 16 = 968 (968.75 truncated). */
  at (t0, TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_HITS), 968);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 1000);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 1000);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_MISSES), 0);

  /* Tick 11: hour not yet scaled. */
  at (t0, 11 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 1000);
  /* Tick 12: five_minute scaled 12 times -> 683; hour once -> 968. */
  at (t0, 12 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_HITS), 683);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 968);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 1000);

  /* Tick 22 (five minutes): (31/32)^22 ~ 1/2 -> 497. */
  at (t0, 22 * TICK + TICK / 2);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_HITS), 497);

  /* Tick 288: five_minute 288 scalings -> 0; hour 24 -> 466; day 1 ->
   * 968. */
  at (t0, 288 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_HITS), 0);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 466);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 968);

  /* A day (6336 ticks) in one jump: day scaled 22 times -> 497. */
  at (t0, 22 * 288 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 497);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 0);

  /* 100 days idle: everything decayed but the total. */
  at (t0, 100 * 22 * 288 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 0);
  ck_assert_uint_eq (view (s, BCF_VIEW_TOTAL, BCF_STAT_HITS), 1000);
  bcf_stats_free (s);
}
END_TEST

/* An add after several silent ticks must land in its own interval: the
 * add runs the missed ticks first. */
START_TEST (test_decay_lazy_add)
{
  const uint64_t t0 = 0;
  struct bcf_stats *s = new_fake (t0);

  bcf_stats_add (s, BCF_STAT_HITS, 1000);
  at (t0, 5 * TICK + 1);                  /* ticks 1..5 missed */
  bcf_stats_add (s, BCF_STAT_HITS, 500);  /* runs them, then adds */
  at (t0, 6 * TICK);
  /* five_minute: the 1000 moved at tick 1 and scaled at ticks 1..6,
   * 65536000 -> 63488000 -> 61504000 -> 59582000 -> 57720062 ->
   * 55916310 -> 54168925; the 500 moved at tick 6 and scaled once,
   * 32768000 -> 31744000; 85912925 >> 16 = 1310.  (Had the 500 been
   * moved at tick 1 with the 1000, it would show 1500 * 0.826 = 1239.)
   * Hour and day are not scaled before ticks 12 and 288. */
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_HITS), 1310);
  ck_assert_uint_eq (view (s, BCF_VIEW_HOUR, BCF_STAT_HITS), 1500);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 1500);
  bcf_stats_free (s);
}
END_TEST

/* Catching up many ticks at once gives exactly what running every tick
 * gives, with adds at the same times. */
START_TEST (test_decay_jump_equals_steps)
{
  struct bcf_stats *stepped = new_fake (0);
  struct bcf_stats *jumped;
  uint64_t a[BCF_STAT__COUNT], b[BCF_STAT__COUNT];
  uint64_t t = 0;

  jumped = bcf_stats_new ();
  ck_assert_ptr_nonnull (jumped);
  bcf_stats_test_clock (jumped, fake_clock);

  for (int round = 0; round < 40; round++) {
    const uint64_t gap = (uint64_t) (round * 37 % 700) + 1;   /* ticks */

    for (int k = 0; k < BCF_STAT__COUNT; k++) {
      bcf_stats_add (stepped, k, (uint64_t) (round + 1) * 1000003 * (k + 1));
      bcf_stats_add (jumped, k, (uint64_t) (round + 1) * 1000003 * (k + 1));
    }
    for (uint64_t i = 1; i <= gap; i++) {
      atomic_store (&fake_ns, t + i * TICK);
      bcf_stats_get (stepped, BCF_VIEW_FIVE_MINUTE, a);
    }
    t += gap * TICK;
    for (int v = 0; v < BCF_VIEW__COUNT; v++) {
      bcf_stats_get (stepped, v, a);
      bcf_stats_get (jumped, v, b);
      ck_assert_mem_eq (a, b, sizeof a);
    }
  }
  bcf_stats_free (stepped);
  bcf_stats_free (jumped);
}
END_TEST

START_TEST (test_decay_large)
{
  const uint64_t big = UINT64_C (1) << 40;
  struct bcf_stats *s = new_fake (0);

  bcf_stats_add (s, BCF_STAT_BYPASSED_BYTES, big);
  bcf_stats_add (s, BCF_STAT_MISSES, UINT64_MAX);
  at (0, TICK);
  /* 2^40 * 31 / 32 exactly: no precision lost in the fixed point. */
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_BYPASSED_BYTES),
                     big / 32 * 31);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_BYPASSED_BYTES), big);
  /* The largest add does not wrap. */
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_MISSES), UINT64_MAX);
  ck_assert_uint_eq (view (s, BCF_VIEW_FIVE_MINUTE, BCF_STAT_MISSES),
                     UINT64_MAX - UINT64_MAX / 32 - 1);
  bcf_stats_free (s);
}
END_TEST

/* The real clock: nothing moves within a second, totals are immediate. */
START_TEST (test_real_clock)
{
  struct bcf_stats *s = bcf_stats_new ();

  ck_assert_ptr_nonnull (s);
  bcf_stats_add (s, BCF_STAT_READ_RACES, 3);
  ck_assert_uint_eq (view (s, BCF_VIEW_TOTAL, BCF_STAT_READ_RACES), 3);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_READ_RACES), 0);
  bcf_stats_test_clock (s, fake_clock);
  bcf_stats_test_clock (s, NULL);
  ck_assert_uint_eq (view (s, BCF_VIEW_TOTAL, BCF_STAT_READ_RACES), 3);
  bcf_stats_free (s);
}
END_TEST

/* ---- Threads ------------------------------------------------------------ */

#define THREADS 8
#define ADDS    200000

static struct bcf_stats *shared;
static _Atomic int adders_left;

static void *
adder (void *arg)
{
  const uintptr_t id = (uintptr_t) arg;

  for (int i = 0; i < ADDS; i++) {
    enum bcf_stat_counter k = (enum bcf_stat_counter) ((i + id) % BCF_STAT__COUNT);

    bcf_stats_add (shared, k, (uint64_t) (k + 1));
    if (i % 1000 == 0) {
      uint64_t out[BCF_STAT__COUNT];

      bcf_stats_get (shared, (enum bcf_stat_view) (i / 1000 % BCF_VIEW__COUNT),
                     out);
    }
  }
  atomic_fetch_sub (&adders_left, 1);
  return NULL;
}

/* Moves the fake clock one tick at a time while the adders run, at most
 * 10 ticks: with the final one, 11, so that neither hour (scaled at tick
 * 12) nor day is ever scaled. */
static void *
ticker (void *arg)
{
  int ticks = 0;

  while (atomic_load (&adders_left) > 0) {
    if (ticks < 10) {
      atomic_fetch_add (&fake_ns, TICK);
      ticks++;
    }
    nanosleep (&(struct timespec) { .tv_nsec = 2000000 }, NULL);
  }
  return NULL;
}

static void
expect (const uint64_t out[BCF_STAT__COUNT])
{
  /* Counter k gets k + 1 for each of its adds; every thread makes
   * ADDS adds spread round robin over the counters. */
  uint64_t want[BCF_STAT__COUNT] = { 0 };

  for (uintptr_t id = 0; id < THREADS; id++)
    for (int i = 0; i < ADDS; i++) {
      int k = (int) ((i + id) % BCF_STAT__COUNT);
      want[k] += (uint64_t) k + 1;
    }
  for (int k = 0; k < BCF_STAT__COUNT; k++)
    ck_assert_uint_eq (out[k], want[k]);
}

static void
run_threads (bool with_ticker)
{
  pthread_t t[THREADS], tk;
  uint64_t out[BCF_STAT__COUNT];

  atomic_store (&adders_left, THREADS);
  for (uintptr_t i = 0; i < THREADS; i++)
    ck_assert_int_eq (pthread_create (&t[i], NULL, adder, (void *) i), 0);
  if (with_ticker)
    ck_assert_int_eq (pthread_create (&tk, NULL, ticker, NULL), 0);
  for (int i = 0; i < THREADS; i++)
    pthread_join (t[i], NULL);
  if (with_ticker)
    pthread_join (tk, NULL);

  bcf_stats_get (shared, BCF_VIEW_TOTAL, out);
  expect (out);
}

START_TEST (test_threads_total)
{
  shared = bcf_stats_new ();
  ck_assert_ptr_nonnull (shared);
  run_threads (false);
  bcf_stats_free (shared);
}
END_TEST

/* Adds racing the ticks: after one more tick everything added has been
 * moved, and hour and day (never scaled yet) must equal the total. */
START_TEST (test_threads_ticks)
{
  uint64_t out[BCF_STAT__COUNT];

  shared = new_fake (0);
  run_threads (true);
  atomic_fetch_add (&fake_ns, TICK);
  bcf_stats_get (shared, BCF_VIEW_DAY, out);
  expect (out);
  bcf_stats_get (shared, BCF_VIEW_HOUR, out);
  expect (out);
  bcf_stats_free (shared);
}
END_TEST

/* The latency histograms: buckets as bcf_time_stat's (hist[0] under
 * 1 us, hist[i] in [2^(i-1), 2^i) us), count, sum and max exact, and
 * the quantiles inside the right bucket, never above the max. */
START_TEST (test_latency_buckets)
{
  struct bcf_stats *s = bcf_stats_new ();
  struct bcf_time_stat t;

  for (int i = 0; i < 98; i++)
    bcf_stats_latency (s, BCF_LAT_READ_HIT, 3000);      /* [2, 4) us */
  bcf_stats_latency (s, BCF_LAT_READ_HIT, 500);         /* < 1 us */
  bcf_stats_latency (s, BCF_LAT_READ_HIT, 5000000);     /* [4096, 8192) us */
  bcf_stats_latency (s, BCF_LAT_WRITE, 7);
  bcf_stats_latency_get (s, BCF_LAT_READ_HIT, &t);
  ck_assert_uint_eq (t.count, 100);
  ck_assert_uint_eq (t.total_ns, 98 * 3000 + 500 + 5000000);
  ck_assert_uint_eq (t.max_ns, 5000000);
  ck_assert_uint_eq (t.hist[0], 1);
  ck_assert_uint_eq (t.hist[2], 98);
  ck_assert_uint_eq (t.hist[13], 1);
  ck_assert_uint_ge (bcf_time_stat_quantile_ns (&t, 0.5), 2000);
  ck_assert_uint_lt (bcf_time_stat_quantile_ns (&t, 0.5), 4000);
  ck_assert_uint_le (bcf_time_stat_quantile_ns (&t, 0.99), 4000);
  ck_assert_uint_ge (bcf_time_stat_quantile_ns (&t, 1.0), 4096000);
  ck_assert_uint_le (bcf_time_stat_quantile_ns (&t, 1.0), 5000000);
  bcf_stats_latency_get (s, BCF_LAT_WRITE, &t);
  ck_assert_uint_eq (t.count, 1);
  ck_assert_uint_eq (t.hist[0], 1);
  bcf_stats_latency_get (s, BCF_LAT_FLUSH, &t);
  ck_assert_uint_eq (t.count, 0);
  ck_assert_uint_eq (bcf_time_stat_quantile_ns (&t, 0.5), 0);
  bcf_stats_free (s);
}
END_TEST

#define LAT_THREADS 8
#define LAT_PER_THREAD 100000

static void *
lat_thread (void *arg)
{
  for (unsigned i = 0; i < LAT_PER_THREAD; i++)
    bcf_stats_latency (arg, BCF_LAT_READ_MISS, 1000 + i % 5000);
  return NULL;
}

/* No record is lost across the shards, whichever threads share one. */
START_TEST (test_latency_threads)
{
  struct bcf_stats *s = bcf_stats_new ();
  pthread_t th[LAT_THREADS];
  struct bcf_time_stat t;
  uint64_t sum = 0;

  for (int i = 0; i < LAT_THREADS; i++)
    ck_assert_int_eq (pthread_create (&th[i], NULL, lat_thread, s), 0);
  for (int i = 0; i < LAT_THREADS; i++)
    pthread_join (th[i], NULL);
  bcf_stats_latency_get (s, BCF_LAT_READ_MISS, &t);
  ck_assert_uint_eq (t.count, (uint64_t) LAT_THREADS * LAT_PER_THREAD);
  for (unsigned b = 0; b < BCF_TIME_HIST; b++)
    sum += t.hist[b];
  ck_assert_uint_eq (sum, t.count);
  ck_assert_uint_eq (t.max_ns, 1000 + 4999);
  bcf_stats_free (s);
}
END_TEST

/* clear_stats: the totals, the decayed views and the histograms start
 * from zero, and count again. */
START_TEST (test_clear)
{
  struct bcf_stats *s = new_fake (1000);
  struct bcf_time_stat t;

  bcf_stats_add (s, BCF_STAT_HITS, 1000);
  bcf_stats_latency (s, BCF_LAT_FLUSH, 123456);
  at (1000, 2 * TICK);
  ck_assert_uint_gt (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 0);
  bcf_stats_add (s, BCF_STAT_HITS, 5);          /* in the collector */
  bcf_stats_clear (s);
  for (int v = 0; v < BCF_VIEW__COUNT; v++)
    ck_assert_uint_eq (view (s, v, BCF_STAT_HITS), 0);
  bcf_stats_latency_get (s, BCF_LAT_FLUSH, &t);
  ck_assert_uint_eq (t.count, 0);
  ck_assert_uint_eq (t.max_ns, 0);
  at (1000, 4 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 0);
  bcf_stats_add (s, BCF_STAT_HITS, 7);
  bcf_stats_latency (s, BCF_LAT_FLUSH, 10);
  at (1000, 5 * TICK);
  ck_assert_uint_eq (view (s, BCF_VIEW_TOTAL, BCF_STAT_HITS), 7);
  ck_assert_uint_eq (view (s, BCF_VIEW_DAY, BCF_STAT_HITS), 7);
  bcf_stats_latency_get (s, BCF_LAT_FLUSH, &t);
  ck_assert_uint_eq (t.count, 1);
  ck_assert_uint_eq (t.max_ns, 10);
  bcf_stats_free (s);
}
END_TEST

/* The table: names unique, every counter of bcache's views in it under
 * its name, and found by name. */
START_TEST (test_descs)
{
  size_t n;
  const struct bcf_stat_desc *d = bcf_stat_descs (&n);

  ck_assert_uint_gt (n, 100);
  for (size_t i = 0; i < n; i++) {
    ck_assert_ptr_nonnull (d[i].help);
    ck_assert_uint_gt (strlen (d[i].help), 10);
    ck_assert_ptr_eq (bcf_stat_find (d[i].name), &d[i]);
    for (size_t j = i + 1; j < n; j++)
      ck_assert_str_ne (d[i].name, d[j].name);
  }
  for (int k = 0; k < BCF_STAT__COUNT; k++) {
    const struct bcf_stat_desc *c = bcf_stat_find (bcf_stat_name (k));

    ck_assert_ptr_nonnull (c);
    ck_assert_int_eq (c->kind, BCF_KIND_COUNTER);
    ck_assert_int_eq (c->section, BCF_SECTION_VIEWS);
  }
  ck_assert_int_eq (bcf_stat_find ("dirty_data")->kind, BCF_KIND_GAUGE);
  ck_assert_int_eq (bcf_stat_find ("gc")->kind, BCF_KIND_TIME);
  ck_assert_int_eq (bcf_stat_find ("latency_write")->kind,
                    BCF_KIND_HISTOGRAM);
  ck_assert_int_eq (bcf_stat_find ("device_errors")->flags,
                    BCF_STAT_JSON_TOP);
  ck_assert_ptr_null (bcf_stat_find ("no_such_statistic"));
}
END_TEST

static Suite *
stats_suite (void)
{
  Suite *s = suite_create ("stats");
  TCase *tc = tcase_create ("stats");

  tcase_set_timeout (tc, 600);
  tcase_add_test (tc, test_names);
  tcase_add_test (tc, test_total_exact);
  tcase_add_test (tc, test_decay_one_burst);
  tcase_add_test (tc, test_decay_lazy_add);
  tcase_add_test (tc, test_decay_jump_equals_steps);
  tcase_add_test (tc, test_decay_large);
  tcase_add_test (tc, test_real_clock);
  tcase_add_test (tc, test_threads_total);
  tcase_add_test (tc, test_threads_ticks);
  tcase_add_test (tc, test_latency_buckets);
  tcase_add_test (tc, test_latency_threads);
  tcase_add_test (tc, test_clear);
  tcase_add_test (tc, test_descs);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  return test_main (stats_suite ());
}
