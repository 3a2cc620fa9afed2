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
 *       writeback_keys_failed); then, once per batch, makes the journal
 *       durable (bcf_flush; free when it already is): see below;
 *   B3. reads the run from the cache and writes it to the backing store,
 *       then lets later overlapping writes go (bcf_bypass_done): done by
 *       the writers (struct writers), up to WRITERS runs at once;
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
 * Why the keys must be on the journal before B3: a writeback-mode write
 * is acknowledged with its dirty key only in memory (FUA and flush make
 * it durable).  Written back and marked clean, then lost by a crash
 * before its journal entry was written, the key is gone while the
 * backing store has its data, and an older clean key of the range, on
 * disk, comes back: the cache would serve data older than the export
 * (I2).  With the key durable first, the crash finds it dirty and writes
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
 * When.  In the clean modes (writethrough, writearound, none: `drain`,
 * tunables.writeback false) the thread writes back whatever is dirty at
 * full speed and then only looks again every DRAIN_RECHECK_MS: dirty
 * keys are then those a crash or writeback mode left (they must be
 * written back before the cache can be treated as clean) and, for a
 * moment, those of writethrough writes in flight (which clean them
 * themselves).  In writeback mode it follows bcache's writeback thread:
 * batches in key order from where the last one ended, each at most one
 * second's worth at the current rate, the rate limiter's delay between
 * them (bcf_wb_pi_next_delay), writeback_delay after a pass that
 * searched the whole index (bcf_writeback_searched_full_index: as
 * bcache's refill_dirty, only when the dirty keys left fit in one keybuf;
 * under a steady load the scan wraps and goes on at once), and
 * every update_seconds a round of the PI controller (bcf_wb_pi_update,
 * bcache's constants, its fragmentation and idle boosts), which also
 * measures the buckets in use that the request path's cutoffs read.  A
 * flush (bcf_writeback_flush, bcf_writeback_hurry) runs it at full speed,
 * ignoring the rate and writeback_running, until nothing is dirty.
 *
 * Locking: lock guards the state the thread and its callers share
 * (stop, kicks, tunables, the controller, the counters); the thread does
 * its I/O with no lock.  used_seen, marks_seen and nbuckets are atomics
 * the request path reads (bcf_writeback_in_use).
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

/* A batch ends with a barrier: every write of it done, one export flush,
 * the clean marks.  With WRITERS in flight, batches of 16 runs / 16 MiB
 * (one wave of 4 MiB writes) drained 1 GiB of sequential dirty data at
 * 0.82 x fio's sequential writes to the export at the same depth, and
 * batches of 64 MiB at 0.96-1.04 x; random 4 KiB keys at 9.1-9.3 MiB/s
 * with 16 runs per batch, 10.2 with 64 (docs/BENCHMARKS.md, stop 25).
 * Those were with 4 writers.  A random key is one 4 KiB backing write,
 * one remote round trip: 16 writers drained random keys at 26.6 MiB/s
 * where 4 did 10.5 (a 1 ms remote; sequential data still at 0.82 x fio
 * at the writers' depth), and bcache keeps up to 64 writeback I/Os in
 * flight.  Each writer holds at most one run's buffer (RUN_MAX_BYTES). */
#define SCAN_EXTENTS    128             /* extents per bcf_dirty_scan */
#define BATCH_RUNS      64              /* runs per backing flush */
#define RUN_MAX_BYTES   (4u << 20)      /* one backing write at most */
#define BATCH_MAX_BYTES (64u << 20)
#define BACKOFF_MIN_MS  100
#define BACKOFF_MAX_MS  30000
#define DRAIN_RECHECK_MS 30000
#define KEYBUF_KEYS     500             /* bcache's keybuf (refill_dirty) */
#define WRITERS         16              /* backing writes in flight, at most */

struct run {
  struct bcf_bypass_token tok;
  unsigned first, n;                    /* extents [first, first + n) */
  uint64_t offset, len;
  bool written;                         /* B3 done */
};

/* The writers: threads that do B3 for the runs the writeback thread hands
 * them, so that up to WRITERS backing writes of a batch are in flight at
 * once (bcache keeps up to 64 writeback I/Os in flight).  One at a time,
 * each backing write also waited for the cache reads before it, the
 * detour through the filter's own nbdkit context and the remote's
 * latency; a drain then ran at 0.71-0.80 of fio's sequential writes to
 * the export alone, and random dirty blocks at one remote round trip
 * each.  The runs of a batch never overlap (they come from one scan in
 * key order), so the order in which their writes reach the backing
 * store does not matter; what does is unchanged: each run is registered
 * and has its turn (B1) and its keys checked (B2), and the journal is
 * durable (B2b), before it is handed over, and the batch's flush (B4)
 * waits for every write handed over.  Started on the first batch,
 * stopped by bcf_writeback_free.  Under wb->lock: the queue, busy, rc. */
struct writers {
  pthread_t t[WRITERS];
  unsigned started;
  pthread_cond_t work, ran;
  const struct bcf_extent *ext;         /* the batch's extents */
  struct run *queue[BATCH_RUNS];
  unsigned head, tail;                  /* queue[head, tail): waiting */
  unsigned busy;                        /* handed over, not finished */
  int rc;                               /* the batch's first error */
  bool quit;                            /* bcf_writeback_free: no batch
                                           can come any more */
};

struct bcf_writeback {
  struct bcf_cache *c;
  struct bcf_bypass *tracker;
  struct bcf_backing b;
  uint64_t capacity_sectors;            /* of the cache's buckets */
  _Atomic uint64_t used_seen;           /* buckets dirty or metadata */
  _Atomic uint64_t marks_seen;          /* bcf_cache_in_use_marks then */
  _Atomic uint64_t nbuckets;

  pthread_mutex_t lock;
  pthread_cond_t wake, flushed;
  bool stop, kicked, thread_started;
  struct bcf_writeback_tunables t;
  unsigned flushers;                    /* bcf_writeback_flush waiting */
  bool hurry;                           /* full speed until clean */
  uint64_t flush_gen;                   /* passes that ended clean */
  int flush_rc;                         /* the last pass's result */
  struct bcf_wb_pi pi;
  uint64_t front_seen;                  /* bcf_cache_requests, last round */
  pthread_t thread;
  uint64_t passes, idle_passes;
  uint64_t cleaned_since_gc;            /* bytes marked clean since the
                                           last GC this thread asked for */
  uint64_t counted_at_gc;               /* bcf_gc_passes at the last count
                                           of the buckets in use */
  uint64_t moved_at_gc;                 /* ... at the last moving GC */
  struct bcf_writeback_stats st;
  struct writers w;
};

/* ---- the rate controller ---------------------------------------------------------- */

void
bcf_wb_pi_init (struct bcf_wb_pi *pi, uint64_t now_ns)
{
  *pi = (struct bcf_wb_pi) { .rate = BCF_WB_RATE_INITIAL, .next_ns = now_ns };
}

/* bcache's __update_writeback_rate (6.1), line for line where it can be:
 * P retires the excess over the target in about p_term_inverse seconds,
 * I grows only while the device keeps up (no wind-up while the backing
 * store is the bottleneck) and shrinks only while positive; above 50 %
 * of buckets in use with fragmented dirty buckets, the fragmentation
 * boost raises P (dongdong tao's fix for writes that bypass a cache full
 * of half-empty dirty buckets, research/bcache.md §4.4).  Idle boost:
 * after BCF_WB_IDLE_ROUNDS rounds without front-end I/O the rate is the
 * maximum until I/O arrives. */
void
bcf_wb_pi_update (struct bcf_wb_pi *pi, const struct bcf_wb_pi_input *in)
{
  int64_t error = in->dirty - in->target;
  int64_t prop = error / BCF_WB_P_TERM_INVERSE;
  int64_t rate;

  pi->idle_rounds = in->idle ? pi->idle_rounds + 1 : 0;
  if (in->in_use > BCF_WB_FRAGMENT_LOW && in->dirty > 0 &&
      in->dirty_buckets > 0) {
    int64_t fragment = in->dirty_buckets * in->bucket_sectors / in->dirty;
    int64_t fp_term;

    if (in->in_use <= BCF_WB_FRAGMENT_MID)
      fp_term = BCF_WB_FP_TERM_LOW * (in->in_use - BCF_WB_FRAGMENT_LOW);
    else if (in->in_use <= BCF_WB_FRAGMENT_HIGH)
      fp_term = BCF_WB_FP_TERM_MID * (in->in_use - BCF_WB_FRAGMENT_MID);
    else
      fp_term = BCF_WB_FP_TERM_HIGH * (in->in_use - BCF_WB_FRAGMENT_HIGH);
    int64_t fps = in->dirty / in->dirty_buckets * fp_term;
    if (fragment > 3 && fps > prop)
      prop = fps;
  }
  if ((error < 0 && pi->integral > 0) ||
      (error > 0 && in->now_ns < pi->next_ns + 1000000))
    pi->integral += error * (int64_t) in->update_seconds;
  pi->integral_scaled = pi->integral / BCF_WB_I_TERM_INVERSE;
  rate = prop + pi->integral_scaled;
  if (rate < BCF_WB_RATE_MINIMUM)
    rate = BCF_WB_RATE_MINIMUM;
  if (rate > BCF_WB_RATE_MAX)
    rate = BCF_WB_RATE_MAX;
  pi->at_max = pi->idle_rounds >= BCF_WB_IDLE_ROUNDS && in->dirty > 0;
  if (pi->at_max)
    rate = BCF_WB_RATE_MAX;
  pi->proportional = prop;
  pi->change = rate - pi->rate;
  pi->rate = rate;
  pi->target = in->target;
  pi->dirty = in->dirty;
}

/* bcache's bch_next_delay: never more than 2 s behind (no backlog that
 * could never be caught up), never more than 2.5 s ahead. */
uint64_t
bcf_wb_pi_next_delay (struct bcf_wb_pi *pi, uint64_t done, uint64_t now_ns)
{
  pi->next_ns += done * 1000000000ull / (uint64_t) pi->rate;
  if (pi->next_ns > now_ns + 2500000000ull)
    pi->next_ns = now_ns + 2500000000ull;
  if (now_ns > 2000000000ull && pi->next_ns < now_ns - 2000000000ull)
    pi->next_ns = now_ns - 2000000000ull;
  return pi->next_ns > now_ns ? pi->next_ns - now_ns : 0;
}

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
  bcf_cache_export_changed (wb->c);     /* the export barrier's count */
  if (e < 0)
    count (wb, &wb->st.backing_errors, 1);
  return e;
}

/* Cut the extents of one scan into runs of contiguous extents, each at
 * most RUN_MAX_BYTES, up to BATCH_RUNS runs and BATCH_MAX_BYTES.
 * Returns the number of runs; *used, the extents they take. */
static unsigned
make_runs (const struct bcf_extent *ext, unsigned n, struct run *runs,
           unsigned *used, uint64_t budget)
{
  unsigned nr = 0, i = 0;
  uint64_t bytes = 0;

  /* One extent at least, however small the budget. */
  while (i < n && nr < BATCH_RUNS &&
         (bytes == 0 || bytes + ext[i].len <= budget)) {
    struct run *r = &runs[nr++];

    *r = (struct run) { .first = i, .n = 1, .offset = ext[i].offset,
                        .len = ext[i].len };
    bytes += ext[i].len;
    for (i++; i < n && ext[i].offset == r->offset + r->len &&
         r->len + ext[i].len <= RUN_MAX_BYTES &&
         bytes + ext[i].len <= budget; i++) {
      r->n++;
      r->len += ext[i].len;
      bytes += ext[i].len;
    }
  }
  *used = i;
  return nr;
}

/* A writer: B3 for each run handed over, into its own buffer. */
static void *
writer_thread (void *arg)
{
  struct bcf_writeback *wb = arg;
  uint8_t *buf = bcf_buf_alloc (RUN_MAX_BYTES);

  pthread_mutex_lock (&wb->lock);
  for (;;) {
    struct run *r;
    int e;

    while (!wb->w.quit && wb->w.head == wb->w.tail)
      pthread_cond_wait (&wb->w.work, &wb->lock);
    if (wb->w.head == wb->w.tail)
      break;                            /* quitting, nothing handed over */
    r = wb->w.queue[wb->w.head++];
    pthread_mutex_unlock (&wb->lock);
    e = buf ? write_run (wb, wb->w.ext, r, buf) : -ENOMEM;
    bcf_bypass_done (wb->tracker, &r->tok);
    pthread_mutex_lock (&wb->lock);
    if (e == 0) {
      r->written = true;
    }
    else if (wb->w.rc == 0)
      wb->w.rc = e;
    if (--wb->w.busy == 0)
      pthread_cond_broadcast (&wb->w.ran);
  }
  pthread_mutex_unlock (&wb->lock);
  bcf_buf_free (buf, RUN_MAX_BYTES);
  bcf_io_thread_cleanup ();
  return NULL;
}

/* Start the writers if they are not running.  0, or -errno (none could
 * start). */
static int
writers_start (struct bcf_writeback *wb)
{
  int r = 0;

  while (wb->w.started < WRITERS &&
         (r = pthread_create (&wb->w.t[wb->w.started], NULL, writer_thread,
                              wb)) == 0)
    wb->w.started++;
  return wb->w.started ? 0 : -r;
}

/* Hand run r over to the writers (B3).  Returns the batch's error so far:
 * once a write failed, the runs not handed over yet are not written (the
 * batch stays dirty and the thread backs off). */
static int
writers_hand_over (struct bcf_writeback *wb, struct run *r)
{
  int rc;

  pthread_mutex_lock (&wb->lock);
  if ((rc = wb->w.rc) == 0) {
    wb->w.queue[wb->w.tail++] = r;
    wb->w.busy++;
    pthread_cond_signal (&wb->w.work);
  }
  pthread_mutex_unlock (&wb->lock);
  return rc;
}

/* B1-B5 for the runs of one scan.  Returns 0, or -errno if the backing
 * store failed (the caller backs off). */
static int
write_batch (struct bcf_writeback *wb, const struct bcf_extent *ext,
             struct run *runs, unsigned nr)
{
  bool journalled = false, written = false;
  int rc;

  if ((rc = writers_start (wb)) < 0)
    return rc;
  pthread_mutex_lock (&wb->lock);
  wb->w.ext = ext;
  wb->w.head = wb->w.tail = 0;
  wb->w.rc = 0;
  pthread_mutex_unlock (&wb->lock);
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
    /* B2b: the keys on the journal before the backing store sees their
     * data (once per batch; free when they already are).  The keys of
     * every run were found before it, so it covers them all. */
    if (rc == 0 && !journalled && (rc = bcf_flush (wb->c)) == 0)
      journalled = true;
    if (rc == 0)
      rc = writers_hand_over (wb, r);                             /* B3 */
    if (rc < 0)
      bcf_bypass_done (wb->tracker, &r->tok);
  }
  pthread_mutex_lock (&wb->lock);                 /* every B3 handed over */
  while (wb->w.busy > 0)
    pthread_cond_wait (&wb->w.ran, &wb->lock);
  if (rc == 0)
    rc = wb->w.rc;
  pthread_mutex_unlock (&wb->lock);
  for (unsigned k = 0; k < nr; k++)
    written = written || runs[k].written;

  if (written && rc == 0 &&                                       /* B4 */
      (rc = bcf_cache_flush_export (wb->c, &wb->b)) < 0)
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
        if (clean > 0) {
          wb->st.bytes_written += (uint64_t) clean;
          wb->cleaned_since_gc += (uint64_t) clean;
        }
        pthread_mutex_unlock (&wb->lock);
      }
    bcf_bypass_end (wb->tracker, &r->tok);
  }
  return rc;
}

/* One batch from *pos on, at most budget bytes: written back, flushed
 * and marked clean.  *pos moves past it; *done gets its bytes; returns 1
 * if nothing dirty is left from *pos on (a full pass ended), 0, or
 * -errno if the backing store or the cache failed. */
static int
writeback_step (struct bcf_writeback *wb, uint64_t *pos, uint64_t budget,
                uint64_t *done)
{
  struct bcf_extent ext[SCAN_EXTENTS];
  struct run runs[BATCH_RUNS];
  unsigned n, used, nr;
  int rc;

  *done = 0;
  if ((rc = bcf_dirty_scan (wb->c, *pos, ext, SCAN_EXTENTS, &n)) < 0)
    return rc;
  if (n == 0)
    return 1;
  nr = make_runs (ext, n, runs, &used, budget);
  if ((rc = write_batch (wb, ext, runs, nr)) < 0)
    return rc;
  for (unsigned k = 0; k < nr; k++)
    *done += runs[k].len;
  *pos = ext[used - 1].offset + ext[used - 1].len;
  return 0;
}

bool
bcf_writeback_searched_full_index (struct bcf_writeback *wb)
{
  struct bcf_extent *ext = malloc (KEYBUF_KEYS * sizeof *ext);
  unsigned n = KEYBUF_KEYS;

  /* bcache's writeback_delay follows a refill_dirty that scanned the
   * whole index into its keybuf of 500 keys: few dirty keys are left.
   * Sleeping after every wrap instead stopped the writeback for 30 s at
   * each end of the key space however much was dirty (a finding of
   * bench/wb-rate.sh's review of the thread). */
  if (ext && bcf_dirty_scan (wb->c, 0, ext, KEYBUF_KEYS, &n) < 0)
    n = KEYBUF_KEYS;
  free (ext);
  return n < KEYBUF_KEYS;
}

static bool
stopping (struct bcf_writeback *wb)
{
  bool stop;

  pthread_mutex_lock (&wb->lock);
  stop = wb->stop;
  pthread_mutex_unlock (&wb->lock);
  return stop;
}

int
bcf_writeback_pass (struct bcf_writeback *wb)
{
  uint64_t pos = 0, done;
  int rc = 0;

  count (wb, &wb->passes, 1);
  while (!stopping (wb) &&
         (rc = writeback_step (wb, &pos, BATCH_MAX_BYTES, &done)) == 0)
    ;
  return rc < 0 ? rc : 0;
}

/* ---- the thread --------------------------------------------------------------------- */

/* Sleep up to ns unless stopped or kicked.  Under lock; false if
 * stopping. */
static bool
sleep_locked (struct bcf_writeback *wb, uint64_t ns)
{
  struct timespec until = bcf_ns_to_timespec (bcf_now_ns () + ns);

  while (!wb->stop && !wb->kicked)
    if (pthread_cond_timedwait (&wb->wake, &wb->lock, &until) != 0)
      break;
  wb->kicked = false;
  return !wb->stop;
}

/* Count the buckets in use (dirty or metadata) for the cutoffs
 * (bcf_writeback_in_use): into cs, which the caller may use too.  Under
 * lock (bcf_cache_stats takes only the engine's own locks). */
static void
count_in_use_locked (struct bcf_writeback *wb, struct bcf_cache_stats *cs)
{
  uint64_t passes = bcf_gc_passes (wb->c);
  uint64_t marks = bcf_cache_in_use_marks (wb->c);      /* before the count */

  bcf_cache_stats (wb->c, cs);
  atomic_store (&wb->nbuckets, cs->nbuckets);
  atomic_store (&wb->used_seen, cs->buckets_dirty + cs->buckets_meta);
  atomic_store (&wb->marks_seen, marks);        /* after used_seen: below */
  wb->counted_at_gc = passes;
  wb->st.in_use = cs->nbuckets ? (unsigned) ((cs->buckets_dirty +
                                              cs->buckets_meta) * 100
                                             / cs->nbuckets) : 0;
}

/* Count again as soon as a GC pass has ended, not at the controller's
 * next round (up to update_seconds later): a pass is what lowers the
 * count (the marks only grow between passes), and the cutoffs it lifts
 * make every write in the meantime a write through.  Under lock. */
static void
recount_after_gc_locked (struct bcf_writeback *wb)
{
  struct bcf_cache_stats cs;

  if (bcf_gc_passes (wb->c) != wb->counted_at_gc)
    count_in_use_locked (wb, &cs);
}

/* Measure and update the controller (every update_seconds).  Under
 * lock. */
static void
update_rate_locked (struct bcf_writeback *wb, uint64_t now)
{
  struct bcf_cache_stats cs;
  uint64_t front = bcf_cache_requests (wb->c);
  struct bcf_wb_pi_input in;

  count_in_use_locked (wb, &cs);
  in = (struct bcf_wb_pi_input) {
    .dirty = (int64_t) (bcf_cache_dirty_bytes (wb->c) >> 9),
    .target = (int64_t) (wb->capacity_sectors * wb->t.percent / 100),
    .in_use = wb->st.in_use,
    .dirty_buckets = (int64_t) cs.buckets_dirty,
    .bucket_sectors = (int64_t) (cs.bucket_bytes >> 9),
    .update_seconds = wb->t.update_seconds,
    .idle = front == wb->front_seen,
    .now_ns = now,
  };
  wb->front_seen = front;
  bcf_wb_pi_update (&wb->pi, &in);
}

/* A pass ended (rc: 0 clean, else the error): wake the flushers. */
static void
pass_ended_locked (struct bcf_writeback *wb, int rc)
{
  wb->flush_rc = rc;
  wb->flush_gen++;
  pthread_cond_broadcast (&wb->flushed);
}

/* A GC once the writeback has cleaned a sixteenth of the cache, or all
 * its dirty data, while the buckets counted in use are past
 * cutoff_writeback.  Why: the count is GC's marks, and a bucket stays
 * marked dirty until a GC walks the tree again; GC runs when the
 * allocator has handed out a sixteenth of the cache or runs short.
 * Past the cutoffs writes are written through and streams bypass, so
 * little is allocated, and a cache whose dirty data was all written
 * back went on counting itself 70 % dirty, cutting writes off, until
 * enough writes had been cached to start one (bcache's "permanent
 * bypass once the cache is full", research/bcache.md §4.4; its fixes
 * are a GC when the backing device is clean and gc_after_writeback).
 * Below cutoff_writeback the marks change nothing a write sees, and
 * the allocator asks for its own GC when it needs the buckets, so no
 * GC is spent there.  Under lock. */
static void
gc_after_cleaning_locked (struct bcf_writeback *wb, bool all_clean)
{
  uint64_t sixteenth = (wb->capacity_sectors << 9) / 16;

  if (wb->cleaned_since_gc == 0 ||
      (!all_clean && wb->cleaned_since_gc < sixteenth))
    return;
  if (bcf_writeback_in_use (wb) <= BCF_WB_CUTOFF)
    return;
  wb->cleaned_since_gc = 0;
  wb->st.gc_requests++;
  bcf_trigger_gc (wb->c);
}

/* Moving GC (movinggc.c) between two batches, when no run is registered
 * (movinggc.c's point 5), in writeback mode with copy_gc_enabled, while
 * the buckets counted in use are within BCF_WB_MOVE_MARGIN of the
 * cutoff the writes meet first (writes_cutoff: cutoff_writeback_sync
 * when every write counts as bcache's REQ_SYNC, else cutoff_writeback)
 * and the dirty data fills at most BCF_MOVE_FILL_MAX_PERCENT of the
 * buckets marked dirty (bcf_move_dirty's own rule per bucket, here on
 * average, so that no scan is made where no bucket could qualify):
 * then copying the emptiest buckets' dirty data brings the count down
 * towards the dirty bytes.  Not from cutoff_writeback on whatever the
 * writes meet: the fuller the cache may get, the emptier the emptiest
 * buckets are, and the less is copied per bucket freed (under
 * filter-bench's rmw, starting at 40 % copied 1.85 GB for 2.19 GB of
 * client writes in 20 s; at 60 %, 2.74 GB over two such runs, and at
 * 65 %, 2.19 GB, with 5.9k writes written through instead of 15.1k).
 * One run per GC pass: the pass it asks for counts what the run emptied,
 * and the next run chooses from those counts; how much one run copies is
 * bcf_wb_move_budget's.  Under lock (dropped for the run, which does
 * I/O). */
static void
move_between_batches_locked (struct bcf_writeback *wb)
{
  struct bcf_cache_stats cs;
  struct bcf_move_stats ms;
  uint64_t passes = bcf_gc_passes (wb->c), dirty_buckets_sectors;
  const uint64_t capacity = wb->capacity_sectors << 9;
  unsigned in_use = bcf_writeback_in_use (wb);
  uint64_t budget;

  if (!wb->t.writeback || !wb->t.copy_gc || passes == wb->moved_at_gc ||
      in_use + BCF_WB_MOVE_MARGIN <= wb->t.writes_cutoff)
    return;
  budget = bcf_wb_move_budget (capacity, in_use, wb->t.writes_cutoff);
  bcf_cache_stats (wb->c, &cs);
  dirty_buckets_sectors = cs.buckets_dirty * (cs.bucket_bytes >> 9);
  if ((bcf_cache_dirty_bytes (wb->c) >> 9) * 100 >
      dirty_buckets_sectors * BCF_MOVE_FILL_MAX_PERCENT)
    return;                     /* the buckets are too full to empty */
  wb->moved_at_gc = passes;
  pthread_mutex_unlock (&wb->lock);
  bcf_move_dirty (wb->c, budget, &ms);
  if (ms.keys)
    bcf_trigger_gc (wb->c);
  pthread_mutex_lock (&wb->lock);
}

/* A run copies at most a sixteenth of the cache.  Below the cutoff the
 * writes meet, no more than the buckets in use can take before
 * BCF_WB_MOVE_HEADROOM points short of it: a run's copies count as in
 * use until the GC pass after it has freed the buckets they came from,
 * and past the cutoff writes are written through (with only the
 * sixteenth, an O_DIRECT rmw run wrote 5,192 writes through where it
 * wrote none without moving GC).  Close to the cutoff a run still
 * copies 1/128 of the cache, so that it can dig a cache out from there.
 * At or past the cutoff the writes are written through already, and the
 * sooner the count is back under it the fewer are: the whole sixteenth.
 * The cutoff is cutoff_writeback, not cutoff_writeback_sync, where only
 * FUA writes count as sync (bcache-sync-writes=fua): the others meet
 * the lower one, and a run sized against the higher one pushed them
 * through. */
uint64_t
bcf_wb_move_budget (uint64_t capacity, unsigned in_use, unsigned cutoff)
{
  uint64_t budget = capacity / BCF_WB_MOVE_MAX_SHARE;
  uint64_t least = capacity / BCF_WB_MOVE_MIN_SHARE, headroom;

  if (in_use >= cutoff)
    return budget;
  headroom = in_use + BCF_WB_MOVE_HEADROOM < cutoff
             ? capacity / 100 * (cutoff - BCF_WB_MOVE_HEADROOM - in_use) : 0;
  if (headroom < budget)
    budget = headroom > least ? headroom : least;
  return budget;
}

static void *
writeback_thread (void *arg)
{
  struct bcf_writeback *wb = arg;
  const uint64_t ms = 1000000;
  uint64_t pos = 0, backoff = 0, next_update = bcf_now_ns ();

  pthread_mutex_lock (&wb->lock);
  while (!wb->stop) {
    uint64_t now = bcf_now_ns (), done = 0, sleep_ns;
    uint64_t round = (uint64_t) wb->t.update_seconds * 1000 * ms;
    bool fast = wb->flushers > 0 || wb->hurry || !wb->t.writeback;
    uint64_t budget;
    int rc;

    if (next_update > now + round)
      next_update = now + round;        /* the period was shortened */
    if (now >= next_update) {
      update_rate_locked (wb, now);
      next_update = now + round;
    }
    else
      recount_after_gc_locked (wb);
    move_between_batches_locked (wb);
    if ((!wb->t.running && !fast) || bcf_cache_dirty_bytes (wb->c) == 0) {
      if (bcf_cache_dirty_bytes (wb->c) == 0) {
        pos = 0;
        wb->hurry = false;
        gc_after_cleaning_locked (wb, true);
        pass_ended_locked (wb, 0);
      }
      sleep_locked (wb, wb->t.writeback ? next_update - now
                    : (uint64_t) DRAIN_RECHECK_MS * ms);
      continue;
    }
    fast = fast || wb->pi.at_max;
    budget = fast ? BATCH_MAX_BYTES
             : (uint64_t) wb->pi.rate << 9 < BATCH_MAX_BYTES
             ? (uint64_t) wb->pi.rate << 9 : BATCH_MAX_BYTES;
    wb->st.flushing = wb->flushers > 0 || wb->hurry;
    pthread_mutex_unlock (&wb->lock);
    rc = writeback_step (wb, &pos, budget, &done);
    pthread_mutex_lock (&wb->lock);
    now = bcf_now_ns ();
    if (rc < 0) {
      /* Nothing is lost: the data stays dirty.  Back off, doubling. */
      backoff = backoff ? (backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS
                           : backoff * 2) : BACKOFF_MIN_MS;
      wb->st.retries++;
      pass_ended_locked (wb, rc);
      sleep_locked (wb, backoff * ms);
      continue;
    }
    backoff = 0;
    gc_after_cleaning_locked (wb, bcf_cache_dirty_bytes (wb->c) == 0);
    if (rc == 1) {
      /* The end of the key space: bcache sleeps writeback_delay before
       * it scans again only if the scan saw the whole index, else wraps
       * and goes on. */
      pos = 0;
      wb->passes++;
      if (bcf_cache_dirty_bytes (wb->c) == 0)
        pass_ended_locked (wb, 0);
      if (wb->flushers == 0 && !wb->hurry && wb->t.writeback) {
        bool full;

        /* The scan reads the tree (and may load leaves): no lock held,
         * as for every other I/O of the thread. */
        pthread_mutex_unlock (&wb->lock);
        full = bcf_writeback_searched_full_index (wb);
        pthread_mutex_lock (&wb->lock);
        if (full && wb->flushers == 0 && !wb->hurry && wb->t.writeback)
          sleep_locked (wb, (uint64_t) wb->t.delay_s * 1000 * ms);
      }
      else if (wb->flushers == 0 && !wb->hurry)
        sleep_locked (wb, (uint64_t) DRAIN_RECHECK_MS * ms);
      continue;
    }
    sleep_ns = bcf_wb_pi_next_delay (&wb->pi, done >> 9, now);
    if (!fast && sleep_ns)
      sleep_locked (wb, sleep_ns);
  }
  pthread_mutex_unlock (&wb->lock);
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
  wb->t = (struct bcf_writeback_tunables) {
    .writeback = !drain, .running = true, .percent = 10, .delay_s = 30,
    .update_seconds = BCF_WB_UPDATE_SECONDS, .copy_gc = true,
    .writes_cutoff = BCF_WB_CUTOFF_SYNC,
  };
  wb->capacity_sectors = bcf_cache_capacity_bytes (c) >> 9;
  wb->moved_at_gc = UINT64_MAX;         /* none yet */
  bcf_wb_pi_init (&wb->pi, bcf_now_ns ());
  pthread_mutex_init (&wb->lock, NULL);
  bcf_cond_init_monotonic (&wb->wake);
  bcf_cond_init_monotonic (&wb->flushed);
  pthread_cond_init (&wb->w.work, NULL);
  pthread_cond_init (&wb->w.ran, NULL);
  return wb;
}

void
bcf_writeback_get_tunables (struct bcf_writeback *wb,
                            struct bcf_writeback_tunables *t)
{
  pthread_mutex_lock (&wb->lock);
  *t = wb->t;
  pthread_mutex_unlock (&wb->lock);
}

int
bcf_writeback_set_tunables (struct bcf_writeback *wb,
                            const struct bcf_writeback_tunables *t)
{
  if (t->percent > 100 || t->update_seconds < 1 || t->update_seconds > 60)
    return -EINVAL;
  pthread_mutex_lock (&wb->lock);
  wb->t = *t;
  wb->kicked = true;
  pthread_cond_broadcast (&wb->wake);
  pthread_mutex_unlock (&wb->lock);
  return 0;
}

/* bcache's in_use is GC's count, taken here every
 * writeback_rate_update_seconds.  Between two counts a write flood marks
 * buckets dirty far faster than that: 4 KiB writes at 26k a second open
 * 200 buckets of 512 KiB a second, a quarter of a 2 GiB cache in a 5 s
 * round, where the cutoffs are 40 % and 70 %.  So the buckets marked
 * dirty or metadata since the count are added (new btree nodes and
 * journal buckets take their share): an upper bound, as none is taken
 * as cleaned meanwhile; and the percentage is rounded
 * up, so that "past 70 %" means past 70 % of the buckets (bcache's
 * in_use, which the controller uses, is rounded down).  marks_seen is
 * stored after used_seen and loaded before it, so a reader that sees a
 * new marks_seen sees its used_seen (one that sees the old marks_seen
 * with a new used_seen only counts too much). */
unsigned
bcf_writeback_in_use (struct bcf_writeback *wb)
{
  uint64_t marks = atomic_load (&wb->marks_seen);
  uint64_t used = atomic_load (&wb->used_seen);
  uint64_t n = atomic_load (&wb->nbuckets);

  used += bcf_cache_in_use_marks (wb->c) - marks;
  if (n == 0)
    return 0;
  used = (used * 100 + n - 1) / n;
  return used > 100 ? 100 : (unsigned) used;
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
bcf_writeback_hurry (struct bcf_writeback *wb)
{
  pthread_mutex_lock (&wb->lock);
  wb->hurry = true;
  wb->st.flushing = true;
  wb->kicked = true;
  pthread_cond_broadcast (&wb->wake);
  pthread_mutex_unlock (&wb->lock);
}

void
bcf_writeback_kick (struct bcf_writeback *wb)
{
  pthread_mutex_lock (&wb->lock);
  wb->kicked = true;
  pthread_cond_broadcast (&wb->wake);
  pthread_mutex_unlock (&wb->lock);
}

int
bcf_writeback_flush (struct bcf_writeback *wb, unsigned timeout_ms,
                     void (*progress) (void *opaque, uint64_t dirty),
                     void *opaque)
{
  uint64_t start = bcf_now_ns ();
  int rc = 0;

  if (!wb->thread_started)
    return bcf_writeback_pass (wb);
  pthread_mutex_lock (&wb->lock);
  wb->flushers++;
  for (;;) {
    uint64_t gen = wb->flush_gen, now;
    struct timespec until;

    if (bcf_cache_dirty_bytes (wb->c) == 0 || wb->stop)
      break;
    wb->kicked = true;
    pthread_cond_broadcast (&wb->wake);
    now = bcf_now_ns ();
    if (timeout_ms && now - start >= (uint64_t) timeout_ms * 1000000) {
      rc = -ETIMEDOUT;
      break;
    }
    until = bcf_ns_to_timespec (now + 1000000000ull);
    while (wb->flush_gen == gen && !wb->stop &&
           pthread_cond_timedwait (&wb->flushed, &wb->lock, &until) == 0)
      ;
    if (wb->flush_gen != gen && wb->flush_rc < 0) {
      rc = wb->flush_rc;
      break;
    }
    if (progress) {
      pthread_mutex_unlock (&wb->lock);
      progress (opaque, bcf_cache_dirty_bytes (wb->c));
      pthread_mutex_lock (&wb->lock);
    }
  }
  if (--wb->flushers == 0 && !wb->hurry)
    wb->st.flushing = false;
  pthread_mutex_unlock (&wb->lock);
  return rc;
}

void
bcf_writeback_free (struct bcf_writeback *wb)
{
  if (!wb)
    return;
  pthread_mutex_lock (&wb->lock);
  wb->stop = true;
  pthread_cond_broadcast (&wb->wake);
  pthread_cond_broadcast (&wb->flushed);
  pthread_mutex_unlock (&wb->lock);
  if (wb->thread_started)
    pthread_join (wb->thread, NULL);
  /* The writeback thread is gone, so no batch is in progress or can
   * start (wb->stop alone would not do: a batch in progress still hands
   * runs over after it is set). */
  pthread_mutex_lock (&wb->lock);
  wb->w.quit = true;
  pthread_cond_broadcast (&wb->w.work);
  pthread_mutex_unlock (&wb->lock);
  for (unsigned i = 0; i < wb->w.started; i++)
    pthread_join (wb->w.t[i], NULL);
  pthread_mutex_destroy (&wb->lock);
  pthread_cond_destroy (&wb->wake);
  pthread_cond_destroy (&wb->flushed);
  pthread_cond_destroy (&wb->w.work);
  pthread_cond_destroy (&wb->w.ran);
  free (wb);
}

void
bcf_writeback_get_stats (struct bcf_writeback *wb,
                         struct bcf_writeback_stats *st)
{
  pthread_mutex_lock (&wb->lock);
  *st = wb->st;
  st->rate = wb->pi;
  if (st->rate.next_ns) {
    uint64_t now = bcf_now_ns ();
    st->rate.next_ns = st->rate.next_ns > now ? st->rate.next_ns - now : 0;
  }
  pthread_mutex_unlock (&wb->lock);
}
