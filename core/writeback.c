/* bcachefilter engine: writing dirty data back to the backing store
 * (DESIGN.md "Writes on dirty keys"; bcache's writeback.c).
 *
 * Design
 * ------
 * A dirty key says "the cache holds data the backing store may not have
 * yet".  The writeback thread walks the dirty keys in key order
 * (bcf_dirty_scan, bcache's keybuf refill), takes runs of contiguous
 * extents as one backing write each, and for a batch of runs:
 *
 *   B1. registers each run in the in-flight write tracker and waits for
 *       its turn (bcf_bypass_begin, bcf_bypass_wait_turn): every
 *       overlapping write that registered earlier has finished, and every
 *       later one waits for this run's backing write, so the backing
 *       store sees the writes of a range in the order the cache did;
 *   B2. checks that the run's extents are still the dirty keys it found
 *       (bcf_dirty_still): a write that came first replaced them, and
 *       they are not written back (counted as keys_failed, as bcache's
 *       writeback_keys_failed);
 *   B3. reads the run from the cache and writes it to the backing store,
 *       then lets later overlapping writes go (bcf_bypass_done);
 *   B4. flushes the backing store, ONCE FOR THE BATCH, and only then
 *   B5. marks the extents clean (bcf_dirty_mark_clean, a compare-and-swap
 *       against the exact keys: a piece a newer write replaced meanwhile
 *       stays as it is) and ends the registrations.
 *
 * Why flush before marking clean (bcache marks clean first: its own
 * TODO, research/bcache.md §4.5): a clean key says the backing store has
 * the data.  Marked before the backing store made it durable, a power
 * loss of the backing store's volatile cache loses the data while the
 * cache, which dropped the dirty state, may later evict it: the write is
 * lost.  After B4 nothing can lose it.  The clean marks themselves are
 * not journalled: a crash that loses one finds the key dirty and writes
 * the same data back again.
 *
 * Why registering in the tracker (B1) keeps I1 and I2: a foreground
 * write W to a range being written back either registered first (the
 * run waits for W, and then W's keys replaced ours: B2 skips them), or
 * later (W waits until our backing write completed, so W's lands after
 * ours: the backing store ends with W's data, as the cache does).  A
 * read miss in the range cannot cache while the run is registered
 * (request.c's protocol) and a check key is never laid over a dirty key
 * anyway.
 *
 * Failures never lose dirty data: a backing write or flush that fails
 * leaves the batch dirty, counted in backing_errors, and the thread
 * backs off (100 ms doubling up to 30 s) before it tries again.  A cache
 * read that fails (the cache device) leaves the run dirty too, counted
 * in read_errors: that data exists nowhere else, and the request path
 * fails reads of it with EIO rather than serve the export's older copy.
 *
 * When: with `drain` (the clean modes: writethrough, writearound, none)
 * the thread writes back whatever is dirty and then only looks again
 * every DRAIN_RECHECK_MS: in those modes dirty keys are those a crash
 * left (they must be written back before the cache can be treated as
 * clean) and, for a moment, those of writes in flight (which clean them
 * themselves).  bcf_writeback_kick wakes it at once.
 *
 * Locking: lock guards the state the thread and its callers share
 * (stop, kicks, the counters); the thread does its I/O with no lock.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bcachefilter/cache.h"
#include "bypass.h"
#include "io.h"
#include "util.h"
#include "writeback.h"

#define SCAN_EXTENTS    64              /* extents per bcf_dirty_scan */
#define BATCH_RUNS      16              /* runs per backing flush */
#define RUN_MAX_BYTES   (4u << 20)      /* one backing write at most */
#define BATCH_MAX_BYTES (16u << 20)
#define BACKOFF_MIN_MS  100
#define BACKOFF_MAX_MS  30000
#define DRAIN_RECHECK_MS 30000

struct run {
  struct bcf_bypass_token tok;
  unsigned first, n;                    /* extents [first, first + n) */
  uint64_t offset, len;
  bool written;                         /* B3 done */
};

struct bcf_writeback {
  struct bcf_cache *c;
  struct bcf_bypass *tracker;
  struct bcf_backing b;
  bool drain;

  pthread_mutex_t lock;
  pthread_cond_t wake;
  bool stop, kicked, thread_started;
  pthread_t thread;
  uint64_t passes, idle_passes;
  struct bcf_writeback_stats st;
};

/* ---- one batch --------------------------------------------------------------------- */

static void
count (struct bcf_writeback *wb, uint64_t *field, uint64_t n)
{
  pthread_mutex_lock (&wb->lock);
  *field += n;
  pthread_mutex_unlock (&wb->lock);
}

/* B3 for one run: read its extents from the cache into buf, write them
 * to the backing store as one write.  Returns 0, or -errno (with which
 * counter went up). */
static int
write_run (struct bcf_writeback *wb, const struct bcf_extent *ext,
           struct run *r, uint8_t *buf)
{
  int e;

  for (unsigned i = 0; i < r->n; i++) {
    const struct bcf_extent *x = &ext[r->first + i];
    if ((e = bcf_read_hit (wb->c, x, buf + (x->offset - r->offset))) < 0) {
      count (wb, &wb->st.read_errors, 1);
      return e;
    }
  }
  e = wb->b.ops->pwrite (wb->b.opaque, buf, (uint32_t) r->len, r->offset,
                         false);
  if (e < 0)
    count (wb, &wb->st.backing_errors, 1);
  return e;
}

/* Cut the extents of one scan into runs of contiguous extents, each at
 * most RUN_MAX_BYTES, up to BATCH_RUNS runs and BATCH_MAX_BYTES.
 * Returns the number of runs; *used, the extents they take. */
static unsigned
make_runs (const struct bcf_extent *ext, unsigned n, struct run *runs,
           unsigned *used)
{
  unsigned nr = 0, i = 0;
  uint64_t bytes = 0;

  while (i < n && nr < BATCH_RUNS && bytes + ext[i].len <= BATCH_MAX_BYTES) {
    struct run *r = &runs[nr++];

    *r = (struct run) { .first = i, .n = 1, .offset = ext[i].offset,
                        .len = ext[i].len };
    bytes += ext[i].len;
    for (i++; i < n && ext[i].offset == r->offset + r->len &&
         r->len + ext[i].len <= RUN_MAX_BYTES &&
         bytes + ext[i].len <= BATCH_MAX_BYTES; i++) {
      r->n++;
      r->len += ext[i].len;
      bytes += ext[i].len;
    }
  }
  *used = i;
  return nr;
}

/* B1-B5 for the runs of one scan.  Returns 0, or -errno if the backing
 * store failed (the caller backs off). */
static int
write_batch (struct bcf_writeback *wb, const struct bcf_extent *ext,
             struct run *runs, unsigned nr)
{
  uint8_t *buf = bcf_buf_alloc (RUN_MAX_BYTES);
  unsigned written = 0;
  int rc = 0;

  if (!buf)
    return -ENOMEM;
  for (unsigned k = 0; k < nr; k++) {
    struct run *r = &runs[k];
    bool still = true;

    bcf_bypass_begin (wb->tracker, r->offset, r->len, &r->tok);   /* B1 */
    bcf_bypass_wait_turn (wb->tracker, &r->tok);
    for (unsigned i = 0; i < r->n && still; i++)                  /* B2 */
      still = bcf_dirty_still (wb->c, &ext[r->first + i]);
    if (!still) {
      count (wb, &wb->st.keys_failed, r->n);
      bcf_bypass_done (wb->tracker, &r->tok);
      continue;
    }
    if (rc == 0 && (rc = write_run (wb, ext, r, buf)) == 0) {     /* B3 */
      r->written = true;
      written++;
    }
    bcf_bypass_done (wb->tracker, &r->tok);
  }
  bcf_buf_free (buf, RUN_MAX_BYTES);

  if (written && rc == 0 &&                                       /* B4 */
      (rc = wb->b.ops->flush (wb->b.opaque)) < 0)
    count (wb, &wb->st.backing_errors, 1);

  for (unsigned k = 0; k < nr; k++) {                             /* B5 */
    struct run *r = &runs[k];

    if (r->written && rc == 0)
      for (unsigned i = 0; i < r->n; i++) {
        const struct bcf_extent *x = &ext[r->first + i];
        int64_t clean = bcf_dirty_mark_clean (wb->c, x);

        pthread_mutex_lock (&wb->lock);
        if (clean == (int64_t) x->len)
          wb->st.keys_done++;
        else
          wb->st.keys_failed++;
        if (clean > 0)
          wb->st.bytes_written += (uint64_t) clean;
        pthread_mutex_unlock (&wb->lock);
      }
    bcf_bypass_end (wb->tracker, &r->tok);
  }
  return rc;
}

int
bcf_writeback_pass (struct bcf_writeback *wb)
{
  struct bcf_extent ext[SCAN_EXTENTS];
  struct run runs[BATCH_RUNS];
  uint64_t pos = 0;
  int rc = 0;

  count (wb, &wb->passes, 1);
  for (;;) {
    unsigned n, used, nr;

    pthread_mutex_lock (&wb->lock);
    if (wb->stop) {
      pthread_mutex_unlock (&wb->lock);
      break;
    }
    pthread_mutex_unlock (&wb->lock);
    if ((rc = bcf_dirty_scan (wb->c, pos, ext, SCAN_EXTENTS, &n)) < 0 ||
        n == 0)
      break;
    nr = make_runs (ext, n, runs, &used);
    if ((rc = write_batch (wb, ext, runs, nr)) < 0)
      break;
    pos = ext[used - 1].offset + ext[used - 1].len;
  }
  return rc;
}

/* ---- the thread --------------------------------------------------------------------- */

/* Sleep up to ms unless stopped or kicked.  Under lock; false if
 * stopping. */
static bool
sleep_locked (struct bcf_writeback *wb, unsigned ms)
{
  struct timespec until = bcf_ns_to_timespec (bcf_now_ns () +
                                              (uint64_t) ms * 1000000);

  while (!wb->stop && !wb->kicked)
    if (pthread_cond_timedwait (&wb->wake, &wb->lock, &until) != 0)
      break;
  wb->kicked = false;
  return !wb->stop;
}

static void *
writeback_thread (void *arg)
{
  struct bcf_writeback *wb = arg;
  unsigned backoff = 0;

  for (;;) {
    unsigned ms;
    int rc = 0;

    if (bcf_cache_dirty_bytes (wb->c) > 0)
      rc = bcf_writeback_pass (wb);
    if (rc < 0)
      backoff = backoff ? (backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS
                           : backoff * 2) : BACKOFF_MIN_MS;
    else
      backoff = 0;
    ms = backoff ? backoff : DRAIN_RECHECK_MS;
    pthread_mutex_lock (&wb->lock);
    if (rc < 0)
      wb->st.retries++;
    if (!sleep_locked (wb, ms)) {
      pthread_mutex_unlock (&wb->lock);
      break;
    }
    pthread_mutex_unlock (&wb->lock);
  }
  bcf_io_thread_cleanup ();
  return NULL;
}

/* ---- life cycle ---------------------------------------------------------------------- */

struct bcf_writeback *
bcf_writeback_new (struct bcf_cache *c, struct bcf_bypass *tracker,
                   const struct bcf_backing *b, bool drain)
{
  struct bcf_writeback *wb = calloc (1, sizeof *wb);

  if (!wb)
    return NULL;
  wb->c = c;
  wb->tracker = tracker;
  wb->b = *b;
  wb->drain = drain;
  pthread_mutex_init (&wb->lock, NULL);
  bcf_cond_init_monotonic (&wb->wake);
  return wb;
}

int
bcf_writeback_start (struct bcf_writeback *wb)
{
  int r = pthread_create (&wb->thread, NULL, writeback_thread, wb);

  if (r != 0)
    return -r;
  wb->thread_started = true;
  return 0;
}

void
bcf_writeback_kick (struct bcf_writeback *wb)
{
  pthread_mutex_lock (&wb->lock);
  wb->kicked = true;
  pthread_cond_broadcast (&wb->wake);
  pthread_mutex_unlock (&wb->lock);
}

void
bcf_writeback_free (struct bcf_writeback *wb)
{
  if (!wb)
    return;
  pthread_mutex_lock (&wb->lock);
  wb->stop = true;
  pthread_cond_broadcast (&wb->wake);
  pthread_mutex_unlock (&wb->lock);
  if (wb->thread_started)
    pthread_join (wb->thread, NULL);
  pthread_mutex_destroy (&wb->lock);
  pthread_cond_destroy (&wb->wake);
  free (wb);
}

void
bcf_writeback_get_stats (struct bcf_writeback *wb,
                         struct bcf_writeback_stats *st)
{
  pthread_mutex_lock (&wb->lock);
  *st = wb->st;
  pthread_mutex_unlock (&wb->lock);
}
