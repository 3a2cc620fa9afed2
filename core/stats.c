/* bcachefilter engine: request counters with bcache's decayed views, and
 * the request latency histograms.  See include/bcachefilter/stats.h for
 * the interface (the descriptors and renderers are core/metrics.c).
 *
 * What bcache does (drivers/md/bcache/stats.c)
 * --------------------------------------------
 * Requests add to a per-device "collector".  A timer fires every
 * accounting_delay = 300/22 s (a "tick") and, in order:
 *
 *   1. moves each collector counter into the views: t = xchg (collector,
 *      0) << 16 (16 bits of fixed-point fraction), added to five_minute,
 *      hour, day and total;
 *   2. rescales the views: each decayed view has a tick counter, and when
 *      it reaches its rescale_at (five_minute 1, hour 12, day 288) it is
 *      reset and every counter of the view becomes ewma_add (x, 0, 32, 0)
 *      = x * 31 / 32 (integer division).  Since (31/32)^22 ~ 1/2, the
 *      half-lives are 5 minutes, 1 hour and 1 day.
 *
 * sysfs shows x >> 16 (so values are truncated, and a view shows nothing
 * of what was added since the last tick).
 *
 * What this file does
 * -------------------
 * The same arithmetic, bit for bit, but without a timer.  Tick k is due
 * at epoch + k * TICK_NS (the epoch is the creation time, or the time the
 * test clock was set).  Whoever adds or reads first after a tick is due
 * runs the ticks that were missed (catch_up):
 *
 *   - the collector holds only what was added since the last tick that
 *     ran, because every add first catches up; so with n missed ticks, the
 *     first of them moves the collector and the others move nothing, as
 *     bcache's timer would have done;
 *   - a view's counter is rescaled (tick counter + n) / rescale_at times,
 *     stopping at 0; any value is 0 after fewer than MAX_RESCALES, so the
 *     loop is bounded however long the counters sat idle.
 *
 * floor (x * 31 / 32) is computed as x - ceil (x / 32), which cannot
 * overflow.  The fixed-point views are 128 bits wide where the compiler
 * has them, so 64-bit byte counts shifted by 16 never saturate; otherwise
 * they saturate at UINT64_MAX.
 *
 * One deliberate difference: the total view is exact and immediate (an
 * atomic counter of every add), where bcache's stats_total, like its
 * decayed views, lags by up to one tick.  Decayed views lag as bcache's
 * do.
 *
 * Locking
 * -------
 * bcf_stats_add is the hot path: two relaxed atomic adds (total,
 * collector), one clock read and one atomic load of the next tick's time;
 * only when a tick is due does it take the mutex and catch up.  The mutex
 * protects the decayed views, the tick counters, and the clock / epoch.
 * The collector is drained with atomic exchange under the mutex, so an add
 * racing with the drain lands either in this tick or in the next one,
 * never nowhere (an add that read the clock just before a tick may be
 * accounted one tick late, which bcache's timer allows too).
 * bcf_stats_get of the total view takes no lock.
 *
 * Latency histograms
 * ------------------
 * bcf_stats_latency is on every write and flush and on one read in eight
 * (request.c), from many threads at once.  Each thread is given one of
 * LAT_SHARDS shards when it first records (round robin), and adds to it
 * with relaxed atomics: count, sum, the bucket, and the max by
 * compare-and-swap only when it grows.  Threads beyond LAT_SHARDS share
 * shards, which the atomics make safe; each shard has its own cache
 * lines, so threads that do not share one do not contend.  Readers sum
 * the shards without a lock: a reader racing with a record may see the
 * count without the bucket, which no reader relies on.
 *
 * clear_stats
 * -----------
 * bcf_stats_clear zeroes what this file owns (the totals, the collector
 * and the views under the mutex; the shards with relaxed stores: an add
 * racing with it lands before or after).  The counters of other layers
 * are rebased instead (core/metrics.c): the clear stores their values
 * here (bcf_stats_set_base), and snapshots subtract them, so that no
 * layer sees its own counters go backwards.
 */
#include "config.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util.h"
#include "bcachefilter/stats.h"
#include "metrics.h"

/* bcache's constants. */
#define TICK_NS          (300ull * 1000000000ull / 22)   /* accounting_delay */
#define FIXED_SHIFT      16                              /* t <<= 16 */
#define WEIGHT           32                              /* accounting_weight */
#define MAX_RESCALES     4096   /* any 128-bit value is 0 after 2,900 */

/* The three decayed views, in the order of enum bcf_stat_view minus one. */
#define NR_DECAYED       (BCF_VIEW__COUNT - 1)
static const unsigned rescale_at[NR_DECAYED] = {
  1,     /* FIVE_MINUTE_RESCALE */
  12,    /* HOUR_RESCALE */
  288,   /* DAY_RESCALE */
};

#ifdef __SIZEOF_INT128__
typedef unsigned __int128 fixed_t;
#define FIXED_MAX ((fixed_t) -1)
#else
typedef uint64_t fixed_t;
#define FIXED_MAX UINT64_MAX
#endif

#define LAT_SHARDS       16

struct lat_hist {
  _Atomic uint64_t count, sum_ns, max_ns;
  _Atomic uint64_t hist[BCF_TIME_HIST];
};

struct lat_shard {
  _Alignas (64) struct lat_hist h[BCF_LAT__COUNT];
};

struct bcf_stats {
  /* The latency shards first: aligned_alloc aligns them. */
  struct lat_shard lat[LAT_SHARDS];

  /* Hot path (atomics). */
  _Atomic uint64_t total[BCF_STAT__COUNT];
  _Atomic uint64_t collector[BCF_STAT__COUNT];
  _Atomic uint64_t next_tick_ns;            /* when catch_up has work */

  /* The clock: read without the lock by adds, set under it. */
  _Atomic (uint64_t (*) (void)) now_ns;

  pthread_mutex_t lock;                     /* the rest */
  uint64_t epoch_ns;
  uint64_t ticks_done;                      /* ticks run since the epoch */
  unsigned rescale[NR_DECAYED];             /* bcache's stats->rescale */
  fixed_t view[NR_DECAYED][BCF_STAT__COUNT];
  uint64_t *base;                           /* clear_stats: metrics.c's */
  size_t nbase;
};

static const char *const counter_names[BCF_STAT__COUNT] = {
  [BCF_STAT_HITS]            = "cache_hits",
  [BCF_STAT_MISSES]          = "cache_misses",
  [BCF_STAT_BYPASS_HITS]     = "cache_bypass_hits",
  [BCF_STAT_BYPASS_MISSES]   = "cache_bypass_misses",
  [BCF_STAT_MISS_COLLISIONS] = "cache_miss_collisions",
  [BCF_STAT_READ_RACES]      = "cache_read_races",
  [BCF_STAT_BYPASSED_BYTES]  = "bypassed",
};

static const char *const view_names[BCF_VIEW__COUNT] = {
  [BCF_VIEW_TOTAL]       = "total",
  [BCF_VIEW_FIVE_MINUTE] = "five_minute",
  [BCF_VIEW_HOUR]        = "hour",
  [BCF_VIEW_DAY]         = "day",
};

static uint64_t
clock_now (struct bcf_stats *s)
{
  return atomic_load_explicit (&s->now_ns, memory_order_relaxed) ();
}

static fixed_t
fixed_add_sat (fixed_t a, fixed_t b)
{
  return a > FIXED_MAX - b ? FIXED_MAX : a + b;
}

/* bcache's scale_stat: ewma_add (x, 0, 32, 0) = floor (x * 31 / 32). */
static fixed_t
scale (fixed_t x)
{
  return x - (x / WEIGHT + (x % WEIGHT != 0));
}

/* Start counting ticks from now (lock held, or not yet shared). */
static void
rebase (struct bcf_stats *s)
{
  s->epoch_ns = clock_now (s);
  s->ticks_done = 0;
  atomic_store (&s->next_tick_ns, s->epoch_ns + TICK_NS);
}

/* Run the ticks that are due (lock held). */
static void
catch_up (struct bcf_stats *s)
{
  uint64_t now = clock_now (s);
  uint64_t due, n;

  if (now < s->epoch_ns)        /* a test clock went backwards */
    return;
  due = (now - s->epoch_ns) / TICK_NS;
  if (due <= s->ticks_done)
    return;
  n = due - s->ticks_done;

  /* The first missed tick moves the collector (bcache's move_stat). */
  for (int k = 0; k < BCF_STAT__COUNT; k++) {
    uint64_t t = atomic_exchange_explicit (&s->collector[k], 0,
                                           memory_order_relaxed);
    fixed_t f;

    if (t == 0)
      continue;
#ifdef __SIZEOF_INT128__
    f = (fixed_t) t << FIXED_SHIFT;
#else
    f = t > (UINT64_MAX >> FIXED_SHIFT) ? FIXED_MAX : t << FIXED_SHIFT;
#endif
    for (int v = 0; v < NR_DECAYED; v++)
      s->view[v][k] = fixed_add_sat (s->view[v][k], f);
  }

  /* Every tick advances each view's rescale counter (scale_stats). */
  for (int v = 0; v < NR_DECAYED; v++) {
    uint64_t c = s->rescale[v] + n;
    uint64_t times = c / rescale_at[v];

    s->rescale[v] = (unsigned) (c % rescale_at[v]);
    if (times > MAX_RESCALES)
      times = MAX_RESCALES;
    for (int k = 0; k < BCF_STAT__COUNT; k++)
      for (uint64_t i = 0; i < times && s->view[v][k] != 0; i++)
        s->view[v][k] = scale (s->view[v][k]);
  }

  s->ticks_done = due;
  atomic_store (&s->next_tick_ns, s->epoch_ns + (due + 1) * TICK_NS);
}

struct bcf_stats *
bcf_stats_new (void)
{
  const size_t size = (sizeof (struct bcf_stats) + 63) & ~(size_t) 63;
  struct bcf_stats *s = aligned_alloc (64, size);
  int err;

  if (s == NULL)
    return NULL;
  memset (s, 0, size);
  err = pthread_mutex_init (&s->lock, NULL);
  if (err != 0) {
    free (s);
    errno = err;
    return NULL;
  }
  for (int k = 0; k < BCF_STAT__COUNT; k++) {
    atomic_init (&s->total[k], 0);
    atomic_init (&s->collector[k], 0);
  }
  atomic_init (&s->next_tick_ns, 0);
  atomic_init (&s->now_ns, bcf_now_ns);
  rebase (s);
  return s;
}

void
bcf_stats_free (struct bcf_stats *s)
{
  if (s == NULL)
    return;
  pthread_mutex_destroy (&s->lock);
  free (s->base);
  free (s);
}

void
bcf_stats_add (struct bcf_stats *s, enum bcf_stat_counter k, uint64_t n)
{
  if (s == NULL || (unsigned) k >= BCF_STAT__COUNT || n == 0)
    return;

  /* Run a due tick first, so that the collector only ever holds adds
   * made since the last tick (see the header comment). */
  if (clock_now (s) >= atomic_load_explicit (&s->next_tick_ns,
                                            memory_order_acquire)) {
    pthread_mutex_lock (&s->lock);
    catch_up (s);
    pthread_mutex_unlock (&s->lock);
  }
  atomic_fetch_add_explicit (&s->total[k], n, memory_order_relaxed);
  atomic_fetch_add_explicit (&s->collector[k], n, memory_order_relaxed);
}

void
bcf_stats_get (struct bcf_stats *s, enum bcf_stat_view v,
               uint64_t out[BCF_STAT__COUNT])
{
  if (s == NULL || (unsigned) v >= BCF_VIEW__COUNT) {
    memset (out, 0, sizeof (uint64_t) * BCF_STAT__COUNT);
    return;
  }
  if (v == BCF_VIEW_TOTAL) {
    for (int k = 0; k < BCF_STAT__COUNT; k++)
      out[k] = atomic_load_explicit (&s->total[k], memory_order_relaxed);
    return;
  }

  pthread_mutex_lock (&s->lock);
  catch_up (s);
  for (int k = 0; k < BCF_STAT__COUNT; k++) {
    fixed_t x = s->view[v - 1][k] >> FIXED_SHIFT;   /* bcache's >> 16 */

#ifdef __SIZEOF_INT128__
    out[k] = x > UINT64_MAX ? UINT64_MAX : (uint64_t) x;
#else
    out[k] = x;
#endif
  }
  pthread_mutex_unlock (&s->lock);
}

const char *
bcf_stat_name (enum bcf_stat_counter k)
{
  return (unsigned) k < BCF_STAT__COUNT ? counter_names[k] : NULL;
}

const char *
bcf_stat_view_name (enum bcf_stat_view v)
{
  return (unsigned) v < BCF_VIEW__COUNT ? view_names[v] : NULL;
}

void
bcf_stats_test_clock (struct bcf_stats *s, uint64_t (*now_ns) (void))
{
  pthread_mutex_lock (&s->lock);
  catch_up (s);                 /* settle the old clock's ticks */
  atomic_store (&s->now_ns, now_ns ? now_ns : bcf_now_ns);
  rebase (s);
  pthread_mutex_unlock (&s->lock);
}

/* ---- Latency histograms ------------------------------------------------- */

static unsigned
lat_shard_index (void)
{
  static _Atomic unsigned next;
  static __thread unsigned mine;        /* index + 1; 0: not given yet */

  if (mine == 0)
    mine = atomic_fetch_add_explicit (&next, 1, memory_order_relaxed)
      % LAT_SHARDS + 1;
  return mine - 1;
}

void
bcf_stats_latency (struct bcf_stats *s, enum bcf_latency k, uint64_t ns)
{
  struct lat_hist *h;
  uint64_t max;

  if (s == NULL || (unsigned) k >= BCF_LAT__COUNT)
    return;
  h = &s->lat[lat_shard_index ()].h[k];
  atomic_fetch_add_explicit (&h->count, 1, memory_order_relaxed);
  atomic_fetch_add_explicit (&h->sum_ns, ns, memory_order_relaxed);
  atomic_fetch_add_explicit (&h->hist[bcf_time_hist_bucket (ns)], 1,
                             memory_order_relaxed);
  max = atomic_load_explicit (&h->max_ns, memory_order_relaxed);
  while (ns > max &&
         !atomic_compare_exchange_weak_explicit (&h->max_ns, &max, ns,
                                                 memory_order_relaxed,
                                                 memory_order_relaxed))
    ;
}

void
bcf_stats_latency_get (struct bcf_stats *s, enum bcf_latency k,
                       struct bcf_time_stat *out)
{
  memset (out, 0, sizeof *out);
  if (s == NULL || (unsigned) k >= BCF_LAT__COUNT)
    return;
  for (unsigned i = 0; i < LAT_SHARDS; i++) {
    struct lat_hist *h = &s->lat[i].h[k];
    uint64_t max = atomic_load_explicit (&h->max_ns, memory_order_relaxed);

    out->count += atomic_load_explicit (&h->count, memory_order_relaxed);
    out->total_ns += atomic_load_explicit (&h->sum_ns, memory_order_relaxed);
    if (max > out->max_ns)
      out->max_ns = max;
    for (unsigned b = 0; b < BCF_TIME_HIST; b++)
      out->hist[b] += atomic_load_explicit (&h->hist[b],
                                            memory_order_relaxed);
  }
}

uint64_t
bcf_time_stat_quantile_ns (const struct bcf_time_stat *t, double q)
{
  uint64_t n = 0, rank, seen = 0;

  for (unsigned i = 0; i < BCF_TIME_HIST; i++)
    n += t->hist[i];
  if (n == 0 || q <= 0)
    return 0;
  rank = (uint64_t) (q * (double) n + 0.999999);
  if (rank < 1)
    rank = 1;
  if (rank > n)
    rank = n;
  for (unsigned i = 0; i < BCF_TIME_HIST; i++) {
    uint64_t lo, hi, v;

    if (seen + t->hist[i] < rank) {
      seen += t->hist[i];
      continue;
    }
    lo = bcf_time_hist_floor_us (i) * 1000;
    hi = i + 1 < BCF_TIME_HIST ? bcf_time_hist_floor_us (i + 1) * 1000
      : t->max_ns;
    if (hi > t->max_ns && t->max_ns >= lo)
      hi = t->max_ns;
    v = lo + (uint64_t) ((double) (hi - lo) * (double) (rank - seen)
                         / (double) t->hist[i]);
    return v < t->max_ns || t->max_ns == 0 ? v : t->max_ns;
  }
  return t->max_ns;
}

/* ---- clear_stats -------------------------------------------------------- */

void
bcf_stats_clear (struct bcf_stats *s)
{
  if (s == NULL)
    return;
  pthread_mutex_lock (&s->lock);
  catch_up (s);
  for (int k = 0; k < BCF_STAT__COUNT; k++) {
    atomic_store_explicit (&s->total[k], 0, memory_order_relaxed);
    atomic_store_explicit (&s->collector[k], 0, memory_order_relaxed);
    for (int v = 0; v < NR_DECAYED; v++)
      s->view[v][k] = 0;
  }
  pthread_mutex_unlock (&s->lock);
  for (unsigned i = 0; i < LAT_SHARDS; i++)
    for (int k = 0; k < BCF_LAT__COUNT; k++) {
      struct lat_hist *h = &s->lat[i].h[k];

      atomic_store_explicit (&h->count, 0, memory_order_relaxed);
      atomic_store_explicit (&h->sum_ns, 0, memory_order_relaxed);
      atomic_store_explicit (&h->max_ns, 0, memory_order_relaxed);
      for (unsigned b = 0; b < BCF_TIME_HIST; b++)
        atomic_store_explicit (&h->hist[b], 0, memory_order_relaxed);
    }
}

int
bcf_stats_set_base (struct bcf_stats *s, const uint64_t *base, size_t n)
{
  uint64_t *copy = malloc (n * sizeof *copy);

  if (copy == NULL)
    return -ENOMEM;
  memcpy (copy, base, n * sizeof *copy);
  pthread_mutex_lock (&s->lock);
  free (s->base);
  s->base = copy;
  s->nbase = n;
  pthread_mutex_unlock (&s->lock);
  return 0;
}

void
bcf_stats_get_base (struct bcf_stats *s, uint64_t *base, size_t n)
{
  pthread_mutex_lock (&s->lock);
  for (size_t i = 0; i < n; i++)
    base[i] = i < s->nbase ? s->base[i] : 0;
  pthread_mutex_unlock (&s->lock);
}
