/* bcachefilter engine: the request path (include/bcachefilter/request.h).
 *
 * Design
 * ------
 * Each entry point first adds opts.offset to the client's offset (the
 * data offset of a bcache backing device: the kernel shifts a bio the
 * same way before its lookup), so everything below works in
 * backing-store offsets, and the keys are at backing-store sectors.
 *
 * Client requests may have any offset and length; the engine works in
 * whole cache blocks.  A request is widened to the blocks it touches (the
 * "span").  Reads of a span that is not the request itself go through a
 * bounce buffer, so a 512-byte read still caches its block.  Writes,
 * trims and zeroes invalidate the whole span (dropping more than was
 * written is always safe) and only the blocks the request covers
 * entirely can be inserted.  The tail of a backing store whose size is
 * not a multiple of the block size is never cached.
 *
 * Read: plan with bcf_lookup; hits are read from the cache device (a
 * pointer that went stale meanwhile, or a device error, is served from
 * the backing store instead); misses follow the cache-miss protocol:
 *
 *   1. bcf_miss_begin inserts a check key over the missed range;
 *   2. the in-flight write tracker is consulted: a write that overlaps
 *      and is in flight means the backing store is changing, so the check
 *      key is dropped and the data is not cached;
 *   3. the backing store is read and the data copied for the client;
 *   4. bcf_miss_fill writes the data to the cache and replace-inserts it
 *      against the check key; it fails (a miss collision) if anything
 *      touched the range since step 1.  This step is queued to the fill
 *      workers with a copy of the data, so the client is answered
 *      without waiting for the cache write (as bcache completes a read
 *      before its insert).  A late fill is as safe as an early one: the
 *      check key decides.  If the queue is full the fill is dropped
 *      (the check key removed): caching is an optimisation, waiting is
 *      not allowed.  The workers take the queue in batches
 *      (bcf_miss_fill_many), one device submission per batch.
 *
 * Write (every mode).  The backing write is registered in the tracker
 * for its whole duration, ordered after every overlapping write
 * registered before it, and the cache is updated before the backing
 * write is issued:
 *
 *   W1. bcf_bypass_begin (registered: the chunk counters and the exact
 *       range), then bcf_bypass_wait_turn: every overlapping write that
 *       registered earlier has finished its backing write and its cache
 *       update (the tracker's ordering);
 *   W2. writethrough, the whole blocks of the request (DESIGN.md "Writes
 *       on dirty keys"): bcf_write_begin_through puts the data in the
 *       cache as dirty keys, after marking their write-intent regions,
 *       journalled only where dirty data could come back (not at all in
 *       the common case); where the range held data a crash
 *       could bring back (w.ordered), bcf_write_durable waits for the
 *       journal, and a FUA write always waits for it (cache_write says
 *       why).
 *       The partial blocks at the ends of the span, and the whole span of
 *       a write that is not cached (bypass, writearound, none, no room, a
 *       device error), are invalidated durably instead: bcf_invalidate
 *       (durable), journalled wherever a crash could bring back what it
 *       removes (the rule and its argument: bcf_invalidate in
 *       core/extent.c);
 *   W3. the backing write;
 *   W4. writethrough: if it succeeded, bcf_write_mark_clean (the dirty
 *       keys become clean: the backing store has the data); if it failed,
 *       bcf_write_undo removes them durably before the error is returned,
 *       so no dirty key of a write the client was told failed is left for
 *       a restart to write back.  Except over dirty data (span_dirty): the
 *       keys replaced the only copy of earlier acknowledged writes, so they
 *       stay dirty and are written back later (complete_cache_write);
 *   W5. bcf_bypass_end.
 *
 * Writethrough to data the cache does not hold (write_fill):
 * W2 checks the span is empty (bcf_write_fill_begin: nothing in memory,
 * nothing a crash could bring back), W3 is the backing write, W4 lays a
 * check key and queues the data as a fill, a read miss's (see below):
 * no cache-device write is in series with the write.
 *
 * Writethrough over clean data the cache holds (write_over): W2 marks
 * the write-intent regions and starts the cache-device write without
 * waiting (bcf_write_over_begin); W3 runs alongside it; W4 waits for it
 * and puts the data in as clean keys, replacing the old data, which
 * served reads until then (bcf_write_over_end).  Not where dirty data is
 * in the span or could come back after a crash: there cache_write's
 * dirty keys go first.
 *
 * Writeback mode (should_write_back: bcache's should_writeback and its
 * cutoffs): W1 as above; W2 puts the whole blocks in as dirty keys
 * (write_back), journalled, waiting for the journal only for FUA; and
 * the write is acknowledged: no W3, the writeback thread writes the data
 * back later (core/writeback.c), so W4 and W5 follow at once.  A flush
 * makes the journal durable and fails if it cannot.  Above the cutoffs,
 * or with no room, the write is written through as above.
 *
 * Dirty data in the span (writeback mode, a switch away from it, a
 * crash) changes two things, decided after W1, when only this write can
 * change the span until W5 (span_dirty):
 *  - a write that would leave partial blocks (invalidated at W2) reads
 *    them first and writes the whole blocks (widen_write): invalidating
 *    a partial block would drop the dirty bytes around the write, the
 *    only copy of an acknowledged write.  Writeback mode widens every
 *    unaligned write so that it can be cached;
 *  - a write over dirty data is never bypassed, in any mode (bcache:
 *    writes that overlap the writeback's keys): it is cached as a
 *    writethrough write, whose dirty keys replace the old ones, durably
 *    before the backing write where needed; an invalidation first would
 *    drop the old dirty data before the backing store has the new, and a
 *    crash between the two would serve the export's older data;
 *  - a trim or zero first writes the
 *    span's dirty data back and flushes it (write_back_span), so that
 *    one the backing store fails leaves the last acknowledged write, not
 *    the export's older data.
 *
 * Why no read can cache data older than the backing store (I1, I2).  The
 * btree lock orders every check-key insert (step 1) against every cache
 * update of W2 (dirty keys, whiteouts, or the look of an invalidation
 * that found nothing to remove).  Take a read miss R over a range a
 * write W changes.
 *  - R's check key went in before W2: W2's dirty keys or whiteouts remove
 *    it, so R's fill collides; nothing is cached.
 *  - R's check key was to go in after W2's dirty keys: a check key is
 *    never laid over a dirty key (bcf_miss_begin fails with -EEXIST), so
 *    R reads the backing store without caching.  That read began before
 *    W was acknowledged (its lookup missed, so W2 had not happened), so
 *    the older data it may return is allowed (I1).
 *  - Otherwise R's check key went in after W2: W1 happened before W2,
 *    which released the btree lock after it; step 1 acquired that lock
 *    after, so R's tracker check (step 2, after step 1) sees W registered
 *    (the exact range overlaps R's: no write that does not overlap makes
 *    R skip caching), unless W already reached W5 — and then W's backing
 *    write completed before R read the backing store (step 3 is after
 *    step 2), so R reads W's data or newer.
 * Without the tracker the last case is the seed race: R reads the
 * backing store before W3 lands and its fill succeeds with old data.
 *
 * Why the cache and the backing store agree on overlapping writes.  V
 * and W overlap and V registered first: W1 makes W wait until V is past
 * W4, so V's cache update (W2) and backing write (W3) both come before
 * W's.  The cache's newest key for the overlap is W's, and so is the
 * backing store's last write.  V's mark-clean (W4) is done before W
 * proceeds, so it cannot hit W's keys, and a mark-clean only ever
 * touches the exact keys of its own write anyway.  Without the ordering
 * V's backing write could land after W's while the cache holds W's data:
 * the cache would be newer than the export, and a restart (or a clean
 * key of W) would serve data the export does not have.
 *
 * Absorbed writes.  A write of whole blocks that registers while an
 * earlier write of whole blocks inside its range still waits for its
 * turn stands in for it (bypass.h, bcf_bypass_wait_turn_write): the
 * earlier write P does nothing at all, neither W2 nor W3, and completes
 * with the later write A's result once A has passed W5.  The ordering
 * above holds for A as for any write, and P never changes the cache or
 * the backing store, so the two agree as if P had landed just before A
 * and A over all of it: an order the client allows, since neither was
 * acknowledged before the other arrived.  P is acknowledged after A's
 * data is in both, so a read after P's acknowledgement gets A's data
 * or newer; a FUA write is absorbed only by a FUA write; a flush that
 * registered between the two does not wait for P, which it need not
 * cover (P was not acknowledged before the flush arrived).
 *
 * Why a crash leaves no clean key older than the backing store (I2).
 * W's dirty keys reach the journal before W3 wherever a crash could
 * otherwise bring back an older key of the range (w.ordered).  After a
 * crash, a surviving dirty key of W means the backing store may or may
 * not have W's data: the engine writes every dirty key back before it
 * treats the cache as clean (core/writeback.c), so both agree on W's
 * data, which was never acknowledged unless W3 completed.  A lost dirty
 * key (not yet durable) means nothing older could come back (not
 * ordered), so the backing store decides.  The clean marks of W4 are not
 * journalled: losing one only makes recovery write the same data back.
 * (A write-intent mark stands in for the wait only against clean keys
 * coming back, which recovery drops, and in a marked region W's keys
 * need not survive a crash at all; an older dirty key that comes back
 * would be written back over W's data, so where one can (btree.c's
 * btree_range_returns_dirty_locked) W's keys are journalled and W waits, and
 * a FUA write always waits for what it journalled: cache_write.)
 *
 * Cache-device errors do not fail a request the backing store can serve:
 * they are counted, the affected range is invalidated, and the request is
 * served from the backing store.  The count decays as bcache's io_errors
 * does (device_error): every error_halflife / 88 cache-device I/Os it is
 * multiplied by 127/128, so an error counts half after error_halflife
 * I/Os ((127/128)^88 = 0.50).  The decay is applied lazily, from the
 * device's I/O count, when an error is counted or the stats are read:
 * nothing is added to the I/O path.  Once the decayed count reaches
 * error_limit, or if an
 * invalidation cannot be journalled (then the cache could bring old data
 * back after a crash), the cache is abandoned: bcf_cache_abandon marks it
 * so the next open starts empty, and from then on everything passes
 * through to the backing store.  If even that mark cannot be written, it
 * is tried again by later changes to the backing store, at most once per
 * abandon_retry_ms and never with a writer waiting for it; until it is
 * written, a change to a range whose invalidation cannot be made durable
 * fails with EIO rather than leave old data for a later start to serve
 * (the one exception, argued at begin_backing_change).
 *
 * Bypass: mode none bypasses everything, writearound every write, and the
 * sequential cutoff (bcache's) any request continuing a stream of at
 * least cutoff bytes.  Bypassed reads still read hits from the cache; they
 * only do not insert misses.
 *
 * Flush drains the fill queue (fills queued before it complete) and then
 * makes the journal durable up to what the writes, trims and zeroes that
 * returned before it put there (ACKED), no further.
 *
 * In flight: every entry point a client request comes through (read,
 * prefetch, write, trim, zero, flush, has_dirty) is counted in the
 * engine's c->inflight from its first line to its return (IN_FLIGHT, a
 * cleanup attribute, so no return path leaks a count), which is what GC's
 * slice rule reads (core/gc.c).  Queued fills and writeback are not
 * counted: nobody waits for them.
 *
 * Locking: fill_lock guards the fill queue (a FIFO of copies, bounded in
 * bytes) and is never held across I/O; everything else is atomics (the
 * in-flight count: one shard per thread, relaxed), and
 * the engine, the tracker, the stream table and the counters are each
 * safe for many threads.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bcachefilter/request.h"
#include "bypass.h"
#include "io.h"
#include "seqdetect.h"
#include "util.h"
#include "writeback.h"

#define PLAN_EXTENTS 16
#define PREFETCH_CHUNK (1u << 20)
#define DEFAULT_ERROR_LIMIT 64
#define ERROR_SHIFT 20                  /* io_errors fixed point (bcache's) */
#define ERROR_DECAY_DIVISOR 88          /* halflife = 88 decay steps */
#define ERROR_DECAY_MAX_STEPS 4096      /* (127/128)^4096 < 2^-46: all gone */
#define DEFAULT_ABANDON_RETRY_MS 1000
#define FILL_WORKERS 2
#define FILL_QUEUE_BYTES (32u << 20)
#define FILL_BATCH 64                   /* fills per device submission */
#define FILL_BATCH_BYTES (4u << 20)
#define FILL_LINGER_NS 4000000ull       /* how long a small batch may wait */
#define COST_SAMPLE_EVERY 8             /* reads per sampled read (read_timed) */

/* A queued cache fill: a check key and a copy of its data. */
struct fill {
  struct fill *next;
  struct bcf_miss m;
  uint64_t seq;                 /* enqueue order, for drain */
  uint64_t queued_ns;           /* CLOCK_MONOTONIC at enqueue */
  void *data;                   /* m.len bytes, from bcf_buf_alloc */
  bool write;                   /* a write's data (write_fill) */
};

struct bcf_req {
  struct bcf_cache *c;
  struct bcf_bypass *tracker;
  struct bcf_seqdetect *seq;
  struct bcf_stats *stats;
  uint64_t block;               /* cache block size, bytes */
  uint64_t offset;              /* added to every request (opts.offset) */
  uint64_t size;                /* backing store size */
  uint64_t cache_end;           /* size rounded down to a block */
  unsigned error_limit;
  _Atomic int mode;
  _Atomic uint64_t cutoff;
  _Atomic int seq_bypass;       /* enum bcf_sequential_bypass */
  bool all_sync;                /* every write is REQ_SYNC (bcf_sync_writes) */
  _Atomic uint64_t bypass_sequential, bypass_congested, sequential_cached;
  /* What a read costs, from the export and from the cache (cost_sample). */
  struct read_cost { _Atomic uint64_t ns8, bytes8; } export_cost, cache_cost;
  /* The decayed count (device_error): errors << ERROR_SHIFT, decayed up
   * to device I/O decayed_to; decay_ios = halflife / 88 (0: never). */
  pthread_mutex_t error_lock;
  uint64_t io_errors, decayed_to, decay_ios, halflife;
  atomic_bool passthrough;
  atomic_bool abandoned;        /* the device knows it was given up */
  pthread_mutex_t abandon_lock; /* one mark attempt at a time */
  _Atomic uint64_t abandon_next_ns;     /* no attempt before (0: now) */
  uint64_t abandon_retry_ns;

  /* The fill queue and its workers. */
  pthread_mutex_t fill_lock;
  pthread_cond_t fill_work, fill_done;
  struct fill *fill_head, *fill_tail;
  uint64_t fill_bytes;          /* queued, not yet taken */
  unsigned fill_count;          /* fills queued, not yet taken */
  unsigned fill_writes;         /* ... of them writes' (no lingering) */
  unsigned fill_drainers;       /* bcf_req_drain callers waiting */
  uint64_t fill_idle_wakeups;   /* a worker woke to an empty queue */
  uint64_t fill_enq;            /* seq of the last enqueued fill */
  uint64_t fill_busy[FILL_WORKERS];     /* seq a worker runs, 0 = none */
  bool fill_stop;
  unsigned nworkers;
  pthread_t workers[FILL_WORKERS];
  struct fill_worker_arg { struct bcf_req *r; unsigned idx; }
    wargs[FILL_WORKERS];
  _Atomic uint64_t fills_dropped;
  _Atomic uint64_t write_inserts, write_collisions;
  /* The writeback thread (opts.background), and the counters of hand
   * passes (bcf_req_writeback) made without it. */
  struct bcf_writeback *wb;
  struct bcf_writeback_stats wb_hand;
  pthread_mutex_t wb_hand_lock;
  _Atomic uint64_t wb_writes, wb_cutoff_writes;
  /* The largest bcf_flush_point read as a write, trim or zero returned
   * (ACKED): what a client's flush must make durable. */
  _Atomic uint64_t acked_point;
  uint64_t capacity_bytes;      /* of the cache's buckets */
  atomic_bool failing;          /* errors past the limit, dirty data kept */
  _Atomic int detach;           /* enum bcf_detach_state */
};

static uint64_t cost_per_kib (struct read_cost *k);

/* What the request path decided about one request. */
struct span {
  uint64_t start, end;          /* whole blocks, clamped to cache_end */
};

/* ---- foreground requests in flight --------------------------------------------- */

/* Every entry point that serves the client counts itself into
 * c->inflight for its whole duration (GC's slice rule reads it):
 * IN_FLIGHT (r) at the top of the function, and the cleanup attribute
 * takes it out again on every return. */
static inline void
inflight_leave (struct bcf_inflight **t)
{
  bcf_inflight_leave (*t);
}

#define IN_FLIGHT(r)                                                    \
  struct bcf_inflight *in_flight_                                       \
    __attribute__ ((cleanup (inflight_leave), unused)) =               \
    bcf_inflight_enter ((r)->c)

/* What a flush covers.  NBD's flush must make durable every write the
 * server completed before the flush arrived, and no more.  So every
 * entry point that changes data (write, trim, zero) raises acked_point
 * to bcf_flush_point as it returns, by which time every key it added is
 * in an entry up to that point; bcf_req_flush reads acked_point as it
 * arrives and waits for the journal up to there only.  A flush that
 * arrives while an entry is being written and no request has returned
 * since the entry was sealed waits for that entry alone, where waiting
 * for the open entry would also wait for a second journal write, for
 * the keys of requests not yet acknowledged.  (fio's fsync=N sends its
 * flushes in bursts like that, and so does a guest whose filesystem
 * flushes from several threads.)  A request that returns after the
 * flush's read is not covered, and need not be: it completed after the
 * flush arrived. */
static inline void
acked_leave (struct bcf_req **r)
{
  uint64_t point = bcf_flush_point ((*r)->c);
  uint64_t seen = atomic_load (&(*r)->acked_point);

  while (seen < point &&
         !atomic_compare_exchange_weak (&(*r)->acked_point, &seen, point))
    ;
}

#define ACKED(r)                                                        \
  struct bcf_req *acked_                                                \
    __attribute__ ((cleanup (acked_leave), unused)) = (r)

/* The request latency histograms (stats.h): TIMED (r, kind, on) at the
 * top of an entry point reads the clock if on, and the cleanup attribute
 * records the time to its return under timer_.kind (which the function
 * may change: a read learns at its end whether it hit).  One read in
 * COST_SAMPLE_EVERY per thread is sampled (read_timed): its latency goes
 * to the histogram and its hits' cost to cache_cost (read_hit), so the
 * hit path reads no clock for seven reads in eight.  (Two samplers, one
 * per request and one per hit, each reading the clock one time in eight,
 * fell on different reads: four clock reads in eight.) */
struct req_timer {
  struct bcf_stats *stats;
  enum bcf_latency kind;
  uint64_t t0;                  /* 0: not timed */
};

static inline void
req_timer_end (struct req_timer *t)
{
  if (t->t0)
    bcf_stats_latency (t->stats, t->kind, bcf_now_ns () - t->t0);
}

static __thread bool read_sampled;      /* this thread's current read */

static inline bool
read_timed (void)
{
  static __thread unsigned reads;
  return read_sampled = reads++ % COST_SAMPLE_EVERY == 0;
}

#define TIMED(r, k, on)                                                 \
  struct req_timer timer_ __attribute__ ((cleanup (req_timer_end))) =  \
    { (r)->stats, (k), (on) ? bcf_now_ns () : 0 }

int
bcf_cache_mode_parse (const char *name)
{
  static const char *const names[] = {
    [BCF_MODE_WRITETHROUGH] = "writethrough",
    [BCF_MODE_WRITEAROUND] = "writearound",
    [BCF_MODE_NONE] = "none",
    [BCF_MODE_WRITEBACK] = "writeback",
  };

  for (int i = 0; i < (int) (sizeof names / sizeof names[0]); i++)
    if (strcmp (name, names[i]) == 0)
      return i;
  return -1;
}

const char *
bcf_cache_mode_name (enum bcf_cache_mode m)
{
  switch (m) {
  case BCF_MODE_WRITETHROUGH: return "writethrough";
  case BCF_MODE_WRITEAROUND: return "writearound";
  case BCF_MODE_NONE: return "none";
  case BCF_MODE_WRITEBACK: return "writeback";
  }
  return "unknown";
}

/* ---- the fill queue --------------------------------------------------------------- */

static void device_error (struct bcf_req *r);
static void decay_errors_locked (struct bcf_req *r);
static void go_passthrough (struct bcf_req *r);

/* Account for one fill's result (step 4 / W5). */
static void
fill_result (struct bcf_req *r, int rc)
{
  /* A collision (-EEXIST) was counted by the engine. */
  if (rc < 0 && rc != -EEXIST && rc != -ENOSPC)
    device_error (r);
}

static void
free_fill (struct fill *f)
{
  bcf_buf_free (f->data, f->m.len);
  free (f);
}

/* Run a batch of fills (a list linked by next, n of them) with one
 * device submission, and free them. */
static void
run_fills (struct bcf_req *r, struct fill *batch, unsigned n)
{
  struct bcf_miss *ms[FILL_BATCH];
  const void *data[FILL_BATCH];
  int res[FILL_BATCH];
  struct fill *f = batch;

  for (unsigned i = 0; i < n; i++, f = f->next) {
    ms[i] = &f->m;
    data[i] = f->data;
  }
  bcf_miss_fill_many (r->c, ms, data, n, res);
  for (unsigned i = 0; i < n; i++) {
    struct fill *next = batch->next;
    fill_result (r, res[i]);
    if (batch->write)
      atomic_fetch_add (res[i] == 0 ? &r->write_inserts
                        : &r->write_collisions, 1);
    free_fill (batch);
    batch = next;
  }
}

/* Should a worker take the queue now rather than let it grow?  Under
 * fill_lock. */
static bool
batch_ready (const struct bcf_req *r)
{
  return r->fill_count >= FILL_BATCH || r->fill_bytes >= FILL_BATCH_BYTES ||
         r->fill_writes || r->fill_drainers || r->fill_stop;
}

/* Each worker takes what is queued, up to FILL_BATCH fills and
 * FILL_BATCH_BYTES (at least one fill), and runs it as one batch: under
 * a stream of misses the device gets a few large submissions instead of
 * one small write per miss.  A batch is a prefix of the FIFO, so its seqs
 * are consecutive and fill_busy holds the first (for drain).
 *
 * A small batch lingers until its oldest fill is FILL_LINGER_NS old,
 * unless the batch fills up, a write's fill is queued (until it is in,
 * its range reads from the export: write_fill), or a drain (FLUSH) or
 * stop wants it: at a few
 * thousand misses a second that turns one write per miss into one per
 * twenty or so.  Each submission rings the device's doorbell, which on a
 * virtual disk is an exit to the hypervisor: on the 2-CPU VM of
 * docs/BENCHMARKS.md, 4 ms instead of 1 ms took a third of the
 * submissions and 8% of the CPU per request off a cold 70/30 run, with
 * no change to cold zipf reads; longer gained nothing more, as batches
 * then fill up first.  The delay is harmless to correctness (the check
 * key decides whether a late fill may insert) and costs a client
 * nothing: it has its data already; a re-read inside the window misses
 * again.  queue_fill
 * wakes a worker only when the queue becomes non-empty or a batch is
 * full, so a lingering worker is not woken by every miss. */
static void *
fill_worker (void *arg)
{
  struct fill_worker_arg *wa = arg;
  struct bcf_req *r = wa->r;

  pthread_mutex_lock (&r->fill_lock);
  for (;;) {
    struct fill *batch = r->fill_head, *last;
    uint64_t bytes;
    unsigned n;

    if (!batch) {
      if (r->fill_stop)
        break;
      pthread_cond_wait (&r->fill_work, &r->fill_lock);
      r->fill_idle_wakeups += !r->fill_head && !r->fill_stop;
      continue;
    }
    if (!batch_ready (r) &&
        bcf_now_ns () < batch->queued_ns + FILL_LINGER_NS) {
      struct timespec until = bcf_ns_to_timespec (batch->queued_ns +
                                              FILL_LINGER_NS);
      pthread_cond_timedwait (&r->fill_work, &r->fill_lock, &until);
      continue;
    }
    last = batch;
    bytes = batch->m.len;
    n = 1;
    while (last->next && n < FILL_BATCH &&
           bytes + last->next->m.len <= FILL_BATCH_BYTES) {
      last = last->next;
      bytes += last->m.len;
      n++;
    }
    r->fill_head = last->next;
    if (!r->fill_head)
      r->fill_tail = NULL;
    last->next = NULL;
    r->fill_bytes -= bytes;
    r->fill_count -= n;
    for (struct fill *t = batch; t; t = t->next)
      r->fill_writes -= t->write;
    r->fill_busy[wa->idx] = batch->seq;
    pthread_mutex_unlock (&r->fill_lock);

    run_fills (r, batch, n);

    pthread_mutex_lock (&r->fill_lock);
    r->fill_busy[wa->idx] = 0;
    pthread_cond_broadcast (&r->fill_done);
  }
  pthread_mutex_unlock (&r->fill_lock);
  return NULL;
}

/* Queue the fill of check key m with a copy of data; if the queue is full
 * (or memory short), drop it instead: the check key is removed and
 * nothing is cached. */
static void
queue_fill (struct bcf_req *r, struct bcf_miss *m, const void *data,
            bool write)
{
  struct fill *f = NULL;
  void *copy = NULL;
  bool queued = false;

  /* The copy comes from the engine's aligned buffer pool: aligned for the
   * device, so bcf_miss_fill_many writes it without a bounce. */
  if (m->len <= FILL_QUEUE_BYTES && (f = malloc (sizeof *f)) &&
      (copy = bcf_buf_alloc (m->len))) {
    memcpy (copy, data, m->len);
    f->m = *m;
    f->data = copy;
    f->next = NULL;
    f->write = write;
    pthread_mutex_lock (&r->fill_lock);
    if (!r->fill_stop && r->fill_bytes + m->len <= FILL_QUEUE_BYTES) {
      f->seq = ++r->fill_enq;
      f->queued_ns = bcf_now_ns ();
      if (r->fill_tail)
        r->fill_tail->next = f;
      else
        r->fill_head = f;
      r->fill_tail = f;
      r->fill_bytes += m->len;
      r->fill_count++;
      r->fill_writes += write;
      queued = true;
      if (r->fill_count == 1 || batch_ready (r))
        pthread_cond_signal (&r->fill_work);
    }
    pthread_mutex_unlock (&r->fill_lock);
  }
  if (!queued) {
    atomic_fetch_add (&r->fills_dropped, 1);
    if (write)
      atomic_fetch_add (&r->write_collisions, 1);
    bcf_miss_cancel (r->c, m);
    if (f && copy)
      free_fill (f);
    else
      free (f);
  }
}

/* Has every fill queued up to seq finished?  Under fill_lock. */
static bool
fills_done_upto (struct bcf_req *r, uint64_t seq)
{
  if (r->fill_head && r->fill_head->seq <= seq)
    return false;
  for (unsigned i = 0; i < FILL_WORKERS; i++)
    if (r->fill_busy[i] && r->fill_busy[i] <= seq)
      return false;
  return true;
}

void
bcf_req_drain (struct bcf_req *r)
{
  uint64_t seq;

  pthread_mutex_lock (&r->fill_lock);
  seq = r->fill_enq;
  r->fill_drainers++;
  /* No lingering now (batch_ready sees the drainer).  Only where a fill
   * is queued: with none, no worker lingers, and waking them would only
   * send both back to sleep, at every flush (a writeback write flood
   * with fio's fsync=32 flushes 3,700 times a second; two context
   * switches each cost a hypervisor call on a virtual machine). */
  if (r->fill_head)
    pthread_cond_broadcast (&r->fill_work);
  while (!fills_done_upto (r, seq))
    pthread_cond_wait (&r->fill_done, &r->fill_lock);
  r->fill_drainers--;
  pthread_mutex_unlock (&r->fill_lock);
}

/* ---- life cycle ------------------------------------------------------------------- */

/* The cutoff a write that is not FUA meets first in writeback mode
 * (bcache's should_writeback): cutoff_writeback_sync where every write
 * counts as REQ_SYNC (r->all_sync), else cutoff_writeback.  The one
 * rule for should_write_back and for the writeback thread's moving GC,
 * which must free buckets before the writes meet it. */
static unsigned
writes_cutoff (const struct bcf_req *r)
{
  return r->all_sync ? BCF_WB_CUTOFF_SYNC : BCF_WB_CUTOFF;
}

struct bcf_req *
bcf_req_new (struct bcf_cache *c, const struct bcf_req_opts *o)
{
  struct bcf_req *r = calloc (1, sizeof *r);

  if (!r)
    return NULL;
  pthread_mutex_init (&r->abandon_lock, NULL);
  r->abandon_retry_ns = (uint64_t) (o->abandon_retry_ms ? o->abandon_retry_ms
                                    : DEFAULT_ABANDON_RETRY_MS) * 1000000ull;
  pthread_mutex_init (&r->fill_lock, NULL);
  bcf_cond_init_monotonic (&r->fill_work);
  pthread_cond_init (&r->fill_done, NULL);
  r->c = c;
  r->block = bcf_cache_block_size (c);
  r->offset = o->offset;
  r->size = bcf_cache_backing_size (c);
  r->cache_end = r->size / r->block * r->block;
  r->capacity_bytes = bcf_cache_capacity_bytes (c);
  r->error_limit = o->error_limit ? o->error_limit : DEFAULT_ERROR_LIMIT;
  pthread_mutex_init (&r->error_lock, NULL);
  pthread_mutex_init (&r->wb_hand_lock, NULL);
  r->halflife = o->error_halflife == BCF_ERROR_HALFLIFE_NEVER ? 0
                : o->error_halflife ? o->error_halflife
                : BCF_ERROR_HALFLIFE_DEFAULT;
  r->decay_ios = r->halflife / ERROR_DECAY_DIVISOR;
  if (r->halflife && r->decay_ios == 0)
    r->decay_ios = 1;
  r->decayed_to = bcf_cache_device_ios (c);
  r->tracker = bcf_bypass_new (r->size);
  r->seq = bcf_seqdetect_new ();
  r->stats = bcf_cache_counters (c);      /* the cache's */
  if (!r->tracker || !r->seq || !r->stats ||
      bcf_req_set_mode (r, o->mode) < 0) {
    bcf_req_free (r);
    return NULL;
  }
  atomic_store (&r->cutoff, o->sequential_cutoff);
  r->all_sync = o->sync_writes == BCF_SYNC_WRITES_ALL;
  if (bcf_req_set_sequential_bypass (r, o->sequential_bypass) < 0) {
    bcf_req_free (r);
    return NULL;
  }
  /* Dirty keys a crash left are written back before anything treats the
   * cache as clean; until then they are served as the newest data. */
  if (o->background) {
    struct bcf_writeback_tunables t;

    if (!(r->wb = bcf_writeback_new (c, r->tracker, o->background,
                                     o->mode != BCF_MODE_WRITEBACK))) {
      bcf_req_free (r);
      return NULL;
    }
    bcf_writeback_get_tunables (r->wb, &t);
    if (o->writeback_percent)
      t.percent = o->writeback_percent == BCF_WRITEBACK_PERCENT_ZERO ? 0
                  : o->writeback_percent;
    if (o->writeback_delay)
      t.delay_s = o->writeback_delay == BCF_WRITEBACK_DELAY_ZERO ? 0
                  : o->writeback_delay;
    if (o->copy_gc_off)
      t.copy_gc = false;
    t.writes_cutoff = writes_cutoff (r);
    if (bcf_writeback_set_tunables (r->wb, &t) < 0 ||
        bcf_writeback_start (r->wb) < 0) {
      bcf_req_free (r);
      return NULL;
    }
  }
  for (unsigned i = 0; i < FILL_WORKERS; i++) {
    r->wargs[i] = (struct fill_worker_arg) { .r = r, .idx = i };
    if (pthread_create (&r->workers[i], NULL, fill_worker, &r->wargs[i])
        != 0) {
      bcf_req_free (r);
      return NULL;
    }
    r->nworkers++;
  }
  return r;
}

void
bcf_req_free (struct bcf_req *r)
{
  if (!r)
    return;
  bcf_writeback_free (r->wb);
  /* The workers finish what is queued, then stop. */
  pthread_mutex_lock (&r->fill_lock);
  r->fill_stop = true;
  pthread_cond_broadcast (&r->fill_work);
  pthread_mutex_unlock (&r->fill_lock);
  for (unsigned i = 0; i < r->nworkers; i++)
    pthread_join (r->workers[i], NULL);
  pthread_mutex_destroy (&r->fill_lock);
  pthread_cond_destroy (&r->fill_work);
  pthread_cond_destroy (&r->fill_done);
  bcf_bypass_free (r->tracker);
  bcf_seqdetect_free (r->seq);
  pthread_mutex_destroy (&r->abandon_lock);
  pthread_mutex_destroy (&r->error_lock);
  pthread_mutex_destroy (&r->wb_hand_lock);
  free (r);
}

int
bcf_req_set_mode (struct bcf_req *r, enum bcf_cache_mode m)
{
  switch (m) {
  case BCF_MODE_WRITETHROUGH:
  case BCF_MODE_WRITEAROUND:
  case BCF_MODE_NONE:
  case BCF_MODE_WRITEBACK:
    atomic_store (&r->mode, (int) m);
    /* Away from writeback the thread drains what is dirty at full
     * speed; dirty data stays readable meanwhile (it is the newest). */
    if (r->wb) {
      struct bcf_writeback_tunables t;
      bcf_writeback_get_tunables (r->wb, &t);
      t.writeback = m == BCF_MODE_WRITEBACK;
      bcf_writeback_set_tunables (r->wb, &t);
    }
    return 0;
  }
  return -EINVAL;
}

/* Change one writeback knob and apply it. */
enum knob { K_PERCENT, K_DELAY, K_RUNNING, K_UPDATE, K_COPY_GC };

static int
set_tunable (struct bcf_req *r, enum knob k, unsigned v)
{
  struct bcf_writeback_tunables t;

  if (!r->wb)
    return -ENOTSUP;
  bcf_writeback_get_tunables (r->wb, &t);
  switch (k) {
  case K_PERCENT: t.percent = v; break;
  case K_DELAY: t.delay_s = v; break;
  case K_RUNNING: t.running = v != 0; break;
  case K_UPDATE: t.update_seconds = v; break;
  case K_COPY_GC: t.copy_gc = v != 0; break;
  }
  /* bcf_writeback_set_tunables checks the ranges. */
  return bcf_writeback_set_tunables (r->wb, &t);
}

int
bcf_req_set_writeback_percent (struct bcf_req *r, unsigned percent)
{
  return set_tunable (r, K_PERCENT, percent);
}

int
bcf_req_set_writeback_delay (struct bcf_req *r, unsigned seconds)
{
  return set_tunable (r, K_DELAY, seconds);
}

int
bcf_req_set_writeback_running (struct bcf_req *r, bool running)
{
  return set_tunable (r, K_RUNNING, running);
}

int
bcf_req_set_writeback_update_seconds (struct bcf_req *r, unsigned s)
{
  return set_tunable (r, K_UPDATE, s);
}

int
bcf_req_set_copy_gc (struct bcf_req *r, bool enabled)
{
  return set_tunable (r, K_COPY_GC, enabled);
}

int
bcf_req_writeback_hurry (struct bcf_req *r)
{
  if (!r->wb)
    return -ENOTSUP;
  bcf_writeback_hurry (r->wb);
  return 0;
}

int
bcf_req_flush_dirty (struct bcf_req *r, const struct bcf_backing *b,
                     unsigned timeout_ms,
                     void (*progress) (void *opaque, uint64_t dirty),
                     void *opaque)
{
  if (r->wb)
    return bcf_writeback_flush (r->wb, timeout_ms, progress, opaque);
  return bcf_req_writeback (r, b);
}

/* ---- detach ----------------------------------------------------------------------- */

/* Wait until every write registered in the tracker before now has
 * finished (W5): register the whole backing store, wait for the turn,
 * and let the writes queued behind go again.  See bcf_req_detach_drain
 * for what it is for. */
static void
wait_for_writes_in_flight (struct bcf_req *r)
{
  struct bcf_bypass_token tok;

  bcf_bypass_begin (r->tracker, 0, r->size, &tok);
  bcf_bypass_wait_turn (r->tracker, &tok);
  bcf_bypass_end (r->tracker, &tok);
}

/* The argument: at the end, nothing is dirty and nothing can become
 * dirty again, so the export has every acknowledged write.
 *
 *  D1. detach = DRAINING.  A write that reads it (at W1 or later: the
 *      decision to write back, should_write_back, and to cache, are made
 *      after register_change) caches nothing except over dirty data, and
 *      acknowledges nothing from the cache: its data reaches the export
 *      before it completes.
 *  D2. wait_for_writes_in_flight.  A write registered after the barrier
 *      read DRAINING: its registration took the tracker's lock after the
 *      barrier's did, which was after D1's store.  A write registered
 *      before it has finished W5, so the dirty keys it made as a
 *      writeback-mode write (before it could see D1) are in the tree and
 *      counted in dirty_bytes now.
 *  D3. write back at full speed until dirty_bytes is 0.  After D2 only
 *      writes over dirty data make dirty keys (every mode caches them as
 *      writethrough does; in writeback mode they stay dirty after their
 *      backing write, for the writeback to clean).  Seeing 0 once is not
 *      enough: a write W that registered after a run of the writeback
 *      goes on once the run's backing write is done (B3), before the run
 *      marks its keys clean (B5); W can see the span dirty, the run then
 *      clean the last dirty key, and W insert its own dirty key after
 *      dirty_bytes was seen at 0 (test-filter-detach caught that, with
 *      the dirty key left in a detached cache).  So:
 *  D4. settle: read the count of dirty inserts (g), then see dirty_bytes
 *      at 0 (T0), then wait for every write registered so far, as D2
 *      (the barrier, from T1), then see dirty_bytes at 0 and g unchanged
 *      (T4); else back to D3.  Why then no dirty key can appear: a write
 *      inserts one only over a dirty key it saw at its check.  Nothing
 *      was dirty at T0 (g's read is seq_cst, so an insert counted before
 *      it is seen by the read of dirty_bytes after it).  A write that
 *      checked before T0 registered before T1, so it finished before the
 *      barrier's turn, and had it inserted, g would have changed.  So no
 *      key became dirty between T0 and the barrier's end, and a write
 *      registered after T1 checks only after that end (the barrier spans
 *      the whole store), finds nothing dirty, and inserts nothing dirty:
 *      nor does any later write.
 * Then bcf_req_detach_finish may mark the cache detached and pass
 * everything through: requests already under way finish with the cache
 * (clean data, never served again), later ones never touch it.
 *
 * The waiting is D3's, bounded by the export: go_on is asked about once
 * a second whether to go on. */
int
bcf_req_detach_drain (struct bcf_req *r, const struct bcf_backing *b,
                      bool (*go_on) (void *opaque, uint64_t dirty),
                      void *opaque)
{
  int expected = BCF_DETACH_NONE;
  int rc = 0;

  if (!atomic_compare_exchange_strong (&r->detach, &expected,
                                       BCF_DETACH_DRAINING))
    return expected == BCF_DETACH_DONE ? -EALREADY : -EBUSY;
  wait_for_writes_in_flight (r);                               /* D2 */
  for (;;) {
    uint64_t g = bcf_cache_dirty_inserts (r->c);               /* D4 */

    if (bcf_cache_dirty_bytes (r->c) == 0) {
      wait_for_writes_in_flight (r);
      if (bcf_cache_dirty_bytes (r->c) == 0 &&
          bcf_cache_dirty_inserts (r->c) == g)
        break;
      continue;
    }
    rc = bcf_req_flush_dirty (r, b, 1000, NULL, NULL);         /* D3 */
    if (rc == -ETIMEDOUT)
      rc = 0;
    if (rc < 0)
      break;
    if (go_on && !go_on (opaque, bcf_cache_dirty_bytes (r->c))) {
      rc = -ECANCELED;
      break;
    }
  }
  if (rc < 0)
    atomic_store (&r->detach, BCF_DETACH_NONE);
  return rc;
}

void
bcf_req_detach_cancel (struct bcf_req *r)
{
  int expected = BCF_DETACH_DRAINING;

  atomic_compare_exchange_strong (&r->detach, &expected, BCF_DETACH_NONE);
}

/* After the drain: mark the cache, then pass through.  abandoned is
 * stored before passthrough, so a write that finds the cache off finds
 * it marked too (invalidate_durably), and never writes an abandon over
 * the detach mark. */
int
bcf_req_detach_finish (struct bcf_req *r)
{
  int rc;

  if (atomic_load (&r->detach) != BCF_DETACH_DRAINING)
    return -EINVAL;
  rc = bcf_cache_detach (r->c);
  if (rc == -EBUSY)
    return rc;                  /* dirty data: the caller cancels */
  if (rc < 0) {
    /* The export has everything, but the cache cannot say so: give it
     * up as after device errors (its next open starts empty, once that
     * mark is written). */
    go_passthrough (r);
  }
  else {
    atomic_store (&r->abandoned, true);
    atomic_store (&r->passthrough, true);
  }
  atomic_store (&r->detach, BCF_DETACH_DONE);
  return rc;
}

enum bcf_detach_state
bcf_req_detach_state (struct bcf_req *r)
{
  return (enum bcf_detach_state) atomic_load (&r->detach);
}

enum bcf_cache_mode
bcf_req_mode (struct bcf_req *r)
{
  return (enum bcf_cache_mode) atomic_load (&r->mode);
}

void
bcf_req_set_sequential_cutoff (struct bcf_req *r, uint64_t bytes)
{
  atomic_store (&r->cutoff, bytes);
}

uint64_t
bcf_req_sequential_cutoff (struct bcf_req *r)
{
  return atomic_load (&r->cutoff);
}

int
bcf_sequential_bypass_parse (const char *name)
{
  if (strcmp (name, "always") == 0)
    return BCF_SEQUENTIAL_BYPASS_ALWAYS;
  if (strcmp (name, "auto") == 0)
    return BCF_SEQUENTIAL_BYPASS_AUTO;
  return -1;
}

const char *
bcf_sequential_bypass_name (enum bcf_sequential_bypass p)
{
  return p == BCF_SEQUENTIAL_BYPASS_AUTO ? "auto" : "always";
}

int
bcf_req_set_sequential_bypass (struct bcf_req *r,
                               enum bcf_sequential_bypass p)
{
  if (p != BCF_SEQUENTIAL_BYPASS_ALWAYS && p != BCF_SEQUENTIAL_BYPASS_AUTO)
    return -EINVAL;
  atomic_store (&r->seq_bypass, (int) p);
  return 0;
}

enum bcf_sequential_bypass
bcf_req_sequential_bypass (struct bcf_req *r)
{
  return (enum bcf_sequential_bypass) atomic_load (&r->seq_bypass);
}

bool
bcf_req_passthrough (struct bcf_req *r)
{
  return atomic_load (&r->passthrough);
}

struct bcf_stats *
bcf_req_counters (struct bcf_req *r)
{
  return r->stats;
}

void
bcf_req_test_disable_tracker (struct bcf_req *r, bool disabled)
{
  bcf_bypass_test_disable (r->tracker, disabled);
}

int
bcf_req_writeback (struct bcf_req *r, const struct bcf_backing *b)
{
  struct bcf_writeback *wb = bcf_writeback_new (r->c, r->tracker, b, true);
  struct bcf_writeback_stats st;
  int rc;

  if (!wb)
    return -ENOMEM;
  rc = bcf_writeback_pass (wb);
  bcf_writeback_get_stats (wb, &st);
  bcf_writeback_free (wb);
  pthread_mutex_lock (&r->wb_hand_lock);
  r->wb_hand.keys_done += st.keys_done;
  r->wb_hand.keys_failed += st.keys_failed;
  r->wb_hand.bytes_written += st.bytes_written;
  r->wb_hand.backing_errors += st.backing_errors;
  r->wb_hand.read_errors += st.read_errors;
  r->wb_hand.retries += st.retries;
  r->wb_hand.gc_requests += st.gc_requests;
  pthread_mutex_unlock (&r->wb_hand_lock);
  return rc;
}

void
bcf_req_test_disable_ordering (struct bcf_req *r, bool disabled)
{
  bcf_bypass_test_disable_ordering (r->tracker, disabled);
}

uint64_t
bcf_req_test_fill_idle_wakeups (struct bcf_req *r)
{
  uint64_t n;

  pthread_mutex_lock (&r->fill_lock);
  n = r->fill_idle_wakeups;
  pthread_mutex_unlock (&r->fill_lock);
  return n;
}

uint64_t
bcf_req_test_writes_waiting (struct bcf_req *r)
{
  struct bcf_bypass_mem m;

  bcf_bypass_get_mem (r->tracker, &m);
  return m.waiting;
}

void
bcf_req_get_stats (struct bcf_req *r, struct bcf_req_stats *st)
{
  struct bcf_bypass_mem m;

  memset (st, 0, sizeof *st);
  st->device_errors = bcf_cache_device_errors (r->c);
  pthread_mutex_lock (&r->error_lock);
  decay_errors_locked (r);
  st->io_errors = r->io_errors >> ERROR_SHIFT;
  pthread_mutex_unlock (&r->error_lock);
  st->io_error_limit = r->error_limit;
  st->io_error_halflife = r->halflife;
  st->passthrough = atomic_load (&r->passthrough);
  st->detach = bcf_req_detach_state (r);
  bcf_bypass_get_mem (r->tracker, &m);
  st->bypass_bytes_now = m.bytes;
  st->bypass_bytes_peak = m.peak_bytes;
  st->bypass_pages = m.pages;
  st->bypass_reserve_uses = m.reserve_uses;
  st->bypass_in_flight = m.in_flight;
  st->fills_dropped = atomic_load (&r->fills_dropped);
  st->write_inserts = atomic_load (&r->write_inserts);
  st->write_collisions = atomic_load (&r->write_collisions);
  st->write_waits = m.waits;
  st->write_absorbed = m.absorbed;
  st->write_wait_ns = m.wait_ns;
  st->write_wait_max_ns = m.wait_max_ns;
  st->writes_in_flight_peak = m.in_flight_peak;
  st->bypass_exact_checks = m.exact_checks;
  st->bypass_sequential = atomic_load (&r->bypass_sequential);
  st->bypass_congested = atomic_load (&r->bypass_congested);
  st->sequential_cached = atomic_load (&r->sequential_cached);
  st->export_read_ns_per_kib = cost_per_kib (&r->export_cost);
  st->cache_read_ns_per_kib = cost_per_kib (&r->cache_cost);
  st->dirty_bytes = bcf_cache_dirty_bytes (r->c);
  {
    struct bcf_writeback_stats w = { 0 };
    if (r->wb)
      bcf_writeback_get_stats (r->wb, &w);
    pthread_mutex_lock (&r->wb_hand_lock);
    st->writeback_keys_done = w.keys_done + r->wb_hand.keys_done;
    st->writeback_keys_failed = w.keys_failed + r->wb_hand.keys_failed;
    st->writeback_bytes = w.bytes_written + r->wb_hand.bytes_written;
    st->writeback_backing_errors = w.backing_errors +
                                   r->wb_hand.backing_errors;
    st->writeback_read_errors = w.read_errors + r->wb_hand.read_errors;
    st->writeback_retries = w.retries + r->wb_hand.retries;
    st->writeback_gc_requests = w.gc_requests + r->wb_hand.gc_requests;
    pthread_mutex_unlock (&r->wb_hand_lock);
  }
  pthread_mutex_lock (&r->fill_lock);
  st->fill_queue_bytes = r->fill_bytes;
  pthread_mutex_unlock (&r->fill_lock);
  st->writeback_writes = atomic_load (&r->wb_writes);
  st->writeback_cutoff_writes = atomic_load (&r->wb_cutoff_writes);
  if (r->wb) {
    struct bcf_writeback_tunables t;
    struct bcf_writeback_stats w;

    bcf_writeback_get_tunables (r->wb, &t);
    bcf_writeback_get_stats (r->wb, &w);
    st->writeback_percent = t.percent;
    st->writeback_delay = t.delay_s;
    st->writeback_update_seconds = t.update_seconds;
    st->writeback_running = t.running;
    st->copy_gc_enabled = t.copy_gc;
    st->writeback_flushing = w.flushing;
    st->cache_in_use = w.in_use;
    st->wb_rate = w.rate.rate;
    st->wb_dirty = w.rate.dirty;
    st->wb_target = w.rate.target;
    st->wb_proportional = w.rate.proportional;
    st->wb_integral = w.rate.integral_scaled;
    st->wb_change = w.rate.change;
    st->wb_next_io_ns = w.rate.next_ns;
    st->wb_at_max = w.rate.at_max;
  }
}

/* ---- helpers ---------------------------------------------------------------------- */

/* The whole blocks touched by [offset, offset + count), clamped to the
 * cacheable part of the backing store (may be empty). */
static struct span
span_of (const struct bcf_req *r, uint64_t offset, uint64_t count)
{
  struct span s;

  s.start = offset / r->block * r->block;
  s.end = (offset + count + r->block - 1) / r->block * r->block;
  if (s.end > r->cache_end)
    s.end = r->cache_end;
  if (s.start > s.end)
    s.start = s.end;
  return s;
}

/* The whole blocks inside [offset, offset + count), clamped likewise. */
static struct span
inner_of (const struct bcf_req *r, uint64_t offset, uint64_t count)
{
  struct span s;

  s.start = (offset + r->block - 1) / r->block * r->block;
  s.end = (offset + count) / r->block * r->block;
  if (s.end > r->cache_end)
    s.end = r->cache_end;
  if (s.start > s.end)
    s.start = s.end;
  return s;
}

/* Is a detach draining the cache (bcf_req_detach_drain)?  Then writes
 * are cached only over dirty data, as in writearound, and none is
 * written back later: no new dirty data is made. */
static bool
detaching (struct bcf_req *r)
{
  return atomic_load (&r->detach) == BCF_DETACH_DRAINING;
}

/* Is the cache off: given up after errors, or its device changed under
 * us (bcf_cache_device_lost), which gives it up now? */
static bool
cache_off (struct bcf_req *r)
{
  if (atomic_load (&r->passthrough))
    return true;
  if (__builtin_expect (bcf_cache_device_lost (r->c) != NULL, 0)) {
    bcf_cache_check_device (r->c);      /* logs why, the first time */
    go_passthrough (r);
    return true;
  }
  return false;
}

/* Mark the device as given up, so the next open starts empty.  While
 * that fails (the device is failing), later changes to the backing store
 * try again, so that a device that comes back is marked and writes stop
 * needing begin_backing_change's check.  Nothing depends on when that
 * happens for safety: until the mark is written, every change is checked
 * there.  So a failing device is not hammered with a superblock write
 * (and an error in the log) per client write: attempts are at least
 * abandon_retry_ns apart, and a writer that finds another attempt under
 * way, or the last one too recent, goes on without waiting.  A device
 * that hangs instead of failing then stalls one writer, not all. */
static void
abandon_device (struct bcf_req *r)
{
  if (atomic_load (&r->abandoned) ||
      bcf_now_ns () < atomic_load (&r->abandon_next_ns) ||
      pthread_mutex_trylock (&r->abandon_lock) != 0)
    return;
  if (!atomic_load (&r->abandoned) &&
      bcf_now_ns () >= atomic_load (&r->abandon_next_ns)) {
    if (bcf_cache_abandon (r->c) == 0)
      atomic_store (&r->abandoned, true);
    else
      atomic_store (&r->abandon_next_ns,
                    bcf_now_ns () + r->abandon_retry_ns);
  }
  pthread_mutex_unlock (&r->abandon_lock);
}

/* Give the cache up and pass everything through from now on. */
static void
go_passthrough (struct bcf_req *r)
{
  uint64_t dirty = bcf_cache_dirty_bytes (r->c);

  /* Giving the cache up would lose the dirty data in it, the only copy
   * of acknowledged writes: keep it in service until that is written
   * back (dirty hits that cannot be read fail with EIO, never serve the
   * export's older data), cache no new writes as dirty, and try again
   * at the next error.  Writes whose invalidation cannot be made durable
   * fail meanwhile (cache_update_failed: not abandoned). */
  if (dirty > 0 && bcf_cache_device_lost (r->c) == NULL) {
    if (!atomic_exchange (&r->failing, true))
      bcf_cache_log (r->c, BCF_LOG_WARN, "the cache device is failing while it "
                           "holds %" PRIu64 " bytes of dirty data (at risk: "
                           "they exist nowhere else); not giving it up "
                           "until they are written back, new writes are "
                           "written through", dirty);
    return;
  }
  atomic_store (&r->passthrough, true);
  abandon_device (r);
}

/* Apply the decay for the device I/Os done since decayed_to (bcache's
 * bch_count_io_errors, applied in arrears).  Under error_lock. */
static void
decay_errors_locked (struct bcf_req *r)
{
  uint64_t ios = bcf_cache_device_ios (r->c), steps;

  if (r->decay_ios == 0 || ios < r->decayed_to + r->decay_ios)
    return;
  steps = (ios - r->decayed_to) / r->decay_ios;
  r->decayed_to += steps * r->decay_ios;
  if (steps > ERROR_DECAY_MAX_STEPS)
    steps = ERROR_DECAY_MAX_STEPS;
  while (steps-- && r->io_errors)
    r->io_errors = r->io_errors * 127 / 128;
}

/* A cache-device error: counted (decaying); at the limit, pass through. */
static void
device_error (struct bcf_req *r)
{
  bool give_up;

  pthread_mutex_lock (&r->error_lock);
  decay_errors_locked (r);
  r->io_errors += UINT64_C (1) << ERROR_SHIFT;
  give_up = r->io_errors >> ERROR_SHIFT >= r->error_limit;
  pthread_mutex_unlock (&r->error_lock);
  if (give_up)
    go_passthrough (r);
}

/* ---- what a read costs ----------------------------------------------------------- */

/* An EWMA (weight 1/8) of the time and the bytes of reads, so that
 * ns8 / bytes8 is a cost per byte in which larger reads weigh more, as
 * they do in a stream.  Relaxed loads and stores: two readers racing lose
 * a sample, which an estimate can afford. */
static void
cost_sample (struct read_cost *k, uint64_t ns, uint64_t bytes)
{
  uint64_t n = atomic_load_explicit (&k->ns8, memory_order_relaxed);
  uint64_t b = atomic_load_explicit (&k->bytes8, memory_order_relaxed);

  atomic_store_explicit (&k->ns8, n - n / 8 + ns, memory_order_relaxed);
  atomic_store_explicit (&k->bytes8, b - b / 8 + bytes, memory_order_relaxed);
}

/* ns per KiB, 0 if nothing was measured. */
static uint64_t
cost_per_kib (struct read_cost *k)
{
  uint64_t n = atomic_load_explicit (&k->ns8, memory_order_relaxed);
  uint64_t b = atomic_load_explicit (&k->bytes8, memory_order_relaxed);

  return b ? (uint64_t) ((double) n * 1024 / (double) b) : 0;
}

/* Does the export serve reads slower than the cache would?  The cache
 * counts as faster until one of its hits was measured: a cache device is
 * local, and a cold cache must not keep bcache's rule forever because it
 * never caches a stream it could measure. */
static bool
export_slower (struct bcf_req *r)
{
  uint64_t e = cost_per_kib (&r->export_cost);
  uint64_t k = cost_per_kib (&r->cache_cost);

  return k == 0 || e > k;
}

static int
timed_backing_pread (struct bcf_req *r, const struct bcf_backing *b,
                     void *buf, uint64_t len, uint64_t offset)
{
  uint64_t t0 = bcf_now_ns ();
  int rc = b->ops->pread (b->opaque, buf, (uint32_t) len, offset);

  if (rc == 0)
    cost_sample (&r->export_cost, bcf_now_ns () - t0, len);
  return rc;
}

/* Should this request go around the cache (bcache's check_should_bypass)?
 * Accounts the request in the stream table.  bcache's two reasons: a
 * stream past the sequential cutoff, and a stream past the size that a
 * congested cache device allows (bcf_cache_congested).  With
 * BCF_SEQUENTIAL_BYPASS_AUTO neither applies while the export is slower
 * than the cache: bypassing would send the stream to the slower side. */
static bool
should_bypass (struct bcf_req *r, uint64_t offset, uint64_t count)
{
  uint64_t cutoff = atomic_load (&r->cutoff);
  uint64_t stream = bcf_seqdetect_account (r->seq, offset, count);
  unsigned congested;
  bool seq;

  if (atomic_load (&r->mode) == BCF_MODE_NONE)
    return true;
  seq = cutoff > 0 && stream >= cutoff;
  congested = seq ? 0 : bcf_cache_congested (r->c);
  if (!seq && !(congested && stream >> BCH_SECTOR_SHIFT >= congested))
    return false;
  if (atomic_load (&r->seq_bypass) == BCF_SEQUENTIAL_BYPASS_AUTO &&
      export_slower (r)) {
    atomic_fetch_add_explicit (&r->sequential_cached, 1,
                               memory_order_relaxed);
    return false;
  }
  atomic_fetch_add_explicit (seq ? &r->bypass_sequential
                             : &r->bypass_congested, 1, memory_order_relaxed);
  return true;
}

static int
backing_pread (const struct bcf_backing *b, void *buf, uint64_t len,
               uint64_t offset)
{
  return b->ops->pread (b->opaque, buf, (uint32_t) len, offset);
}

/* Every change of the export is counted as soon as it completed (failed
 * ones too: a failure may have changed part of the range), before
 * anything marks or fills a clean key for it: the checkpoint's export
 * barrier (bcf_cache_set_export) relies on the count. */
static int
export_changed (struct bcf_req *r, int rc)
{
  bcf_cache_export_changed (r->c);
  return rc;
}

static int
backing_pwrite (struct bcf_req *r, const struct bcf_backing *b,
                const void *buf, uint64_t len, uint64_t offset)
{
  return export_changed (r, b->ops->pwrite (b->opaque, buf, (uint32_t) len,
                                            offset, false));
}

static int has_dirty (struct bcf_req *r, struct span s);

/* ---- reads ------------------------------------------------------------------------ */

/* Read a missed range [e->offset, +len) into buf: from the backing store,
 * caching it unless bypass.  Returns 0 or a backing-store error. */
static int
read_miss (struct bcf_req *r, const struct bcf_backing *b,
           const struct bcf_extent *e, void *buf, bool bypass)
{
  struct bcf_miss m;
  int rc;

  if (bypass || cache_off (r))
    return timed_backing_pread (r, b, buf, e->len, e->offset);
  rc = bcf_miss_begin (r->c, e->offset, e->len, &m);
  if (rc < 0) {
    /* -EEXIST: a write put dirty data there since our lookup; it was not
     * acknowledged when this read began, so the backing store's data is
     * an answer this read may give, but not one to cache. */
    if (rc != -ENOSPC && rc != -EROFS && rc != -EEXIST)
      device_error (r);
    return backing_pread (b, buf, e->len, e->offset);
  }
  /* Step 2: after our check key is in (see the header comment). */
  if (bcf_bypass_busy (r->tracker, e->offset, e->len)) {
    bcf_miss_cancel (r->c, &m);
    return backing_pread (b, buf, e->len, e->offset);
  }
  rc = timed_backing_pread (r, b, buf, e->len, e->offset);
  if (rc < 0) {
    bcf_miss_cancel (r->c, &m);
    return rc;
  }
  queue_fill (r, &m, buf, false);
  return 0;
}

static int read_span_again (struct bcf_req *r, const struct bcf_backing *b,
                            struct span s, uint8_t *buf, unsigned again);

/* How often a dirty hit whose bucket was reused under the read is looked
 * up again before the read fails (each time needs another key replaced
 * and its bucket collected, invalidated and persisted within one read). */
#define DIRTY_RACE_RETRIES 4

/* Read a hit; on a race or a device error of a clean hit, from the
 * backing store.  again: how many times this range was looked up again
 * after a race (read_span_again).
 *
 * A race on a dirty hit (-ESTALE: its bucket was invalidated while we
 * read) means the key we read was replaced or marked clean, and GC then
 * freed its bucket: the range now holds a newer key, or clean data the
 * backing store has.  The backing store is NOT a fallback there: it may
 * be older than the data we were reading (nothing wrote it back), so it
 * would serve a write from before that dirty data, which a flush may
 * already have made durable (time travel).  So the range is looked up
 * again and read as any read would read it now. */
static int
read_hit (struct bcf_req *r, const struct bcf_backing *b,
          const struct bcf_extent *e, void *buf, unsigned again)
{
  /* The read-hit path: time the hits of a sampled read (read_timed),
   * and any while nothing is measured, so that hits neither read the
   * clock each time nor write the shared average each time. */
  bool timed = read_sampled ||
    atomic_load_explicit (&r->cache_cost.bytes8, memory_order_relaxed) == 0;
  uint64_t t0 = timed ? bcf_now_ns () : 0;
  int rc = bcf_read_hit (r->c, e, buf);

  if (rc == 0 && timed)
    cost_sample (&r->cache_cost, bcf_now_ns () - t0, e->len);

  /* A device found changed while we read it may have given us a hole's
   * zeros: the backing store has the data (clean hits only). */
  if (rc == 0 && !e->dirty && cache_off (r))
    return backing_pread (b, buf, e->len, e->offset);
  if (rc == 0)
    return 0;
  if (rc != -ESTALE) {          /* a race was counted by the engine */
    if (e->dirty)
      return rc;        /* the only copy: the backing store is older */
    device_error (r);
    bcf_drop_hit (r->c, e);
  }
  else if (e->dirty) {
    if (again >= DIRTY_RACE_RETRIES) {
      bcf_cache_log (r->c, BCF_LOG_ERROR, "a read of dirty data at %" PRIu64
                     " found its bucket reused under it %u times: failing "
                     "it rather than serving the export's older data",
                     e->offset, again + 1);
      return -EIO;
    }
    return read_span_again (r, b, (struct span) { e->offset,
                                                  e->offset + e->len },
                            buf, again + 1);
  }
  return backing_pread (b, buf, e->len, e->offset);
}

/* Read the whole blocks [s.start, s.end) into buf.  *all_hit tells
 * whether the cache served all of it.  again: see read_hit. */
static int
read_span_n (struct bcf_req *r, const struct bcf_backing *b, struct span s,
             uint8_t *buf, bool bypass, bool *all_hit, unsigned again)
{
  uint64_t pos = s.start;

  *all_hit = true;
  while (pos < s.end) {
    struct bcf_extent ext[PLAN_EXTENTS];
    unsigned n = 0;
    int rc;

    if (cache_off (r) ||
        bcf_lookup (r->c, pos, s.end - pos, ext, PLAN_EXTENTS, &n) < 0 ||
        n == 0) {
      /* No plan (device error loading a node, or passing through). */
      *all_hit = false;
      return backing_pread (b, buf + (pos - s.start), s.end - pos, pos);
    }
    for (unsigned i = 0; i < n; i++) {
      uint8_t *p = buf + (ext[i].offset - s.start);
      if (ext[i].kind == BCF_EXTENT_HIT)
        rc = read_hit (r, b, &ext[i], p, again);
      else {
        *all_hit = false;
        rc = read_miss (r, b, &ext[i], p, bypass);
      }
      if (rc < 0)
        return rc;
      pos = ext[i].offset + ext[i].len;
    }
  }
  return 0;
}

static int
read_span (struct bcf_req *r, const struct bcf_backing *b, struct span s,
           uint8_t *buf, bool bypass, bool *all_hit)
{
  return read_span_n (r, b, s, buf, bypass, all_hit, 0);
}

/* A range looked up again after a dirty hit raced (read_hit): read as a
 * bypassing read, so a miss there (the data left the cache after it was
 * written back) is read from the backing store and not cached. */
static int
read_span_again (struct bcf_req *r, const struct bcf_backing *b,
                 struct span s, uint8_t *buf, unsigned again)
{
  bool hit;

  return read_span_n (r, b, s, buf, true, &hit, again);
}

static void
count_read (struct bcf_req *r, bool bypass, bool hit, uint64_t count)
{
  if (bypass) {
    bcf_stats_add (r->stats, hit ? BCF_STAT_BYPASS_HITS
                   : BCF_STAT_BYPASS_MISSES, 1);
    bcf_stats_add (r->stats, BCF_STAT_BYPASSED_BYTES, count);
  }
  else
    bcf_stats_add (r->stats, hit ? BCF_STAT_HITS : BCF_STAT_MISSES, 1);
}

/* *all_hit: the request counted as a hit (count_read); left alone when
 * the cache was not asked. */
static int
do_read (struct bcf_req *r, const struct bcf_backing *b, void *buf,
         uint32_t count, uint64_t offset, bool bypass, bool *all_hit)
{
  struct span s = span_of (r, offset, count);
  uint64_t end = offset + count;
  bool hit = false;
  int rc = 0;

  if (count == 0)
    return 0;
  if (offset > r->size || count > r->size - offset)
    return -ERANGE;
  if (cache_off (r) || s.start >= s.end)
    return backing_pread (b, buf, count, offset);

  if (s.start == offset && s.end == end)
    rc = read_span (r, b, s, buf, bypass, &hit);
  else {
    /* Widened to whole blocks: through a bounce buffer.  The part past
     * cache_end (a partial last block) comes from the backing store. */
    uint8_t *bounce = malloc (s.end - s.start);
    if (!bounce)
      return -ENOMEM;
    rc = read_span (r, b, s, bounce, bypass, &hit);
    if (rc == 0) {
      uint64_t a = offset > s.start ? offset : s.start;
      uint64_t z = end < s.end ? end : s.end;
      if (z > a)
        memcpy ((uint8_t *) buf + (a - offset), bounce + (a - s.start), z - a);
      if (end > s.end)
        rc = backing_pread (b, (uint8_t *) buf + (s.end - offset), end - s.end,
                            s.end);
    }
    free (bounce);
  }
  if (rc == 0)
    count_read (r, bypass, hit, count);
  *all_hit = rc == 0 && hit;
  return rc;
}

int
bcf_req_read (struct bcf_req *r, const struct bcf_backing *b,
              void *buf, uint32_t count, uint64_t offset)
{
  IN_FLIGHT (r);
  TIMED (r, BCF_LAT_READ_MISS, read_timed ());
  bool bypass, hit = false;
  int rc;

  offset += r->offset;
  bypass = should_bypass (r, offset, count);

  rc = do_read (r, b, buf, count, offset, bypass, &hit);
  if (hit)
    timer_.kind = BCF_LAT_READ_HIT;
  return rc;
}

int
bcf_req_prefetch (struct bcf_req *r, const struct bcf_backing *b,
                  uint32_t count, uint64_t offset)
{
  IN_FLIGHT (r);
  uint64_t end;
  uint8_t *buf;
  bool hit;
  int rc = 0;

  offset += r->offset;
  end = offset + count;

  if (offset > r->size || count > r->size - offset)
    return -ERANGE;
  if (!(buf = malloc (count < PREFETCH_CHUNK ? count : PREFETCH_CHUNK)))
    return -ENOMEM;
  for (uint64_t pos = offset; pos < end && rc == 0; ) {
    uint64_t len = end - pos < PREFETCH_CHUNK ? end - pos : PREFETCH_CHUNK;
    (void) read_timed ();       /* its hits' cost, one chunk in eight */
    rc = do_read (r, b, buf, (uint32_t) len, pos,
                  atomic_load (&r->mode) == BCF_MODE_NONE, &hit);
    pos += len;
  }
  free (buf);
  return rc;
}

/* ---- writes ----------------------------------------------------------------------- */

/* W1 of the write protocol: register the backing change and wait for
 * every overlapping write registered before it. */
static void
register_change (struct bcf_req *r, struct span s,
                 struct bcf_bypass_token *tok)
{
  bcf_bypass_begin (r->tracker, s.start, s.end - s.start, tok);
  bcf_bypass_wait_turn (r->tracker, tok);
}

/* W1 of a client write of [offset, +count) over span s: the same, but a
 * write of whole blocks may absorb, and be absorbed by, the writes of
 * whole blocks it overlaps (bypass.h): returns true if a later write
 * stood in for this one, which is then complete with the result in *rc
 * (the caller ends its registration with bcf_bypass_end_write, the
 * result passed on to what this write absorbed, and does nothing
 * else: not even W2, so the cache, like the backing store, only ever
 * sees the write that stood in). */
static bool
register_write (struct bcf_req *r, struct span s, uint64_t offset,
                uint32_t count, bool fua, struct bcf_bypass_token *tok,
                int *rc)
{
  unsigned flags = offset == s.start && offset + count == s.end
                   ? BCF_BYPASS_ABSORB | (fua ? BCF_BYPASS_FUA : 0) : 0;

  bcf_bypass_begin_write (r->tracker, s.start, s.end - s.start, flags, tok);
  return bcf_bypass_wait_turn_write (r->tracker, tok, rc);
}

/* A durable cache update (an invalidation, dirty keys) of W2 failed, so
 * the range may hold data a restart could bring back: give the cache up
 * (go_passthrough), which tries to write that mark.  Returns 0 if it is
 * written (the next open starts empty: the backing store may change), or
 * -EIO.
 *
 * If the mark cannot be written either, the device refuses writes, and
 * the span may hold data a restart could bring back (bcf_invalidate
 * fails only where a journal write was needed).  Should the device come
 * back, the next start would serve that data over what this write put in
 * the backing store (I2).  So the change must not happen.  That fails a
 * request the backing store could have served, but only for ranges the
 * cache holds, and only while the device takes no writes at all;
 * everywhere else writes pass through.  In pass-through the same holds
 * until the mark is written: a change may first retry it
 * (abandon_device), and checks the span whenever it is not written. */
static int
cache_update_failed (struct bcf_req *r)
{
  device_error (r);
  go_passthrough (r);
  return atomic_load (&r->abandoned) ? 0 : -EIO;
}

/* W2 for data that is not cached: drop [start, start + len) durably.
 * Returns 0 when the backing store may change: the range is invalidated
 * durably, or the cache is abandoned (the next open starts empty), which
 * is equally safe; else -EIO (cache_update_failed).  With hold (a write
 * that goes around the cache, under its turn), a write-intent mark may
 * stand in for the journal wait (bcf_invalidate_before_write): *hold
 * keeps it until bcf_write_release, after the backing write. */
static int
invalidate_held (struct bcf_req *r, uint64_t start, uint64_t len,
                 struct bcf_write *hold)
{
  if (hold)
    memset (hold, 0, sizeof *hold);
  if (len == 0)
    return 0;
  if (cache_off (r))
    abandon_device (r);
  if (atomic_load (&r->abandoned))
    return 0;
  if ((hold ? bcf_invalidate_before_write (r->c, start, len, hold)
       : bcf_invalidate (r->c, start, len, true)) == 0)
    return 0;
  return cache_update_failed (r);
}

static int
invalidate_durably (struct bcf_req *r, uint64_t start, uint64_t len)
{
  return invalidate_held (r, start, len, NULL);
}

static int write_back_span (struct bcf_req *r, const struct bcf_backing *b,
                            struct span s);

/* W2 for writethrough: the whole blocks in of the span s as dirty keys
 * (data holds them), the partial blocks at the ends invalidated.
 * Returns 1 if the data is in the cache (w to be completed at W4), 0 if
 * it is not but the range is invalidated, or -EIO (see
 * cache_update_failed).
 *
 * A FUA write's keys are on the journal before its backing write, even
 * where w->ordered does not ask for it.  w->ordered is false where
 * nothing older could come back, or where a write-intent mark covers the
 * range; the mark only covers clean data coming back (recovery drops the
 * clean keys of a marked region, intent.c).  Dirty data comes back too:
 * a dirty key, or a clean one whose dirty version is still in the
 * journal (W4's clean marks are not journalled).  Recovery keeps it and
 * writes it back, so a write whose own keys the crash lost would be
 * replaced, in the cache and then in the backing store, by the older
 * data: a writethrough write the export had acknowledged would be
 * undone (the kill -9 soak, TEST_SEED=41174), and a FUA write would lose
 * what it was acknowledged as durable (I3; test-crash's writeback
 * workload with mode switches, TEST_SEED=2).  So where dirty data can
 * come back (bcf_write_begin asks btree_range_returns_dirty_locked) the mark
 * does not stand in and w->ordered stays; a FUA write waits anyway.
 * With its keys durable first, recovery finds them newer than anything
 * older in the range. */
static int
cache_write (struct bcf_req *r, const struct bcf_backing *b, struct span s,
             struct span in, const void *data, bool dirty, bool fua,
             struct bcf_write *w)
{
  int rc = bcf_write_begin_through (r->c, in.start, in.end - in.start, data,
                                    w);

  if (rc < 0) {
    if (rc != -ENOSPC && rc != -EROFS)
      device_error (r);
    /* Not cached over dirty data (no room): the invalidation must not
     * drop the dirty data before the backing store has something at
     * least as new, so it is written back first, as for a trim. */
    if (dirty && (rc = write_back_span (r, b, s)) < 0)
      return rc;
    return invalidate_durably (r, s.start, s.end - s.start);
  }
  /* The edges first: their journal entry, if they need one, comes after
   * the dirty keys', so waiting for it covers both. */
  if ((rc = invalidate_durably (r, s.start, in.start - s.start)) == 0 &&
      (rc = invalidate_durably (r, in.end, s.end - in.end)) == 0 &&
      (fua ? bcf_write_sync (r->c, w) : bcf_write_durable (r->c, w)) < 0)
    rc = cache_update_failed (r);
  if (rc < 0) {
    /* The backing write will not happen: the dirty keys must not be
     * served (they may survive a restart only if the journal that is
     * failing still takes them). */
    bcf_write_undo (r->c, w);
    bcf_write_release (r->c, w);
    return rc;
  }
  if (cache_off (r)) {
    /* Given up meanwhile (abandoned): the data need not be kept. */
    bcf_write_undo (r->c, w);
    bcf_write_release (r->c, w);
    return 0;
  }
  return 1;
}

/* W4: the backing write returned rc.  over_dirty: the span held dirty
 * data before this write (span_dirty, at W1); fua: the backing write was
 * durable when it completed. */
static void
complete_cache_write (struct bcf_req *r, struct bcf_write *w, int rc,
                      bool over_dirty, bool fua)
{
  if (rc == 0 && over_dirty && !fua) {
    /* The keys stay dirty until the writeback has flushed the export
     * (B4).  The older dirty data they replaced may be a flushed write
     * that only the cache holds; marked clean now, this write's keys
     * would say the export has something at least as new, while the
     * export may still lose this write in a crash of its own, and an
     * invalidation of the range (a trim, a bypassing write) would then
     * leave the export's data from before both: time travel past a
     * flush (test-crash, crash_writeback_export, TEST_SEED=1796485577).
     * The price: the writeback writes this data once more. */
    atomic_fetch_add (&r->write_inserts, 1);
  }
  else if (rc == 0) {
    int64_t clean = bcf_write_mark_clean (r->c, w);
    atomic_fetch_add (clean == (int64_t) w->len ? &r->write_inserts
                      : &r->write_collisions, 1);
  }
  else if (over_dirty) {
    /* The write's dirty keys replaced older dirty data, the only copy of
     * writes acknowledged earlier, which the backing store does not have
     * (it may even hold a part of this write now).  Removing the keys
     * would serve the export's older data: time travel past a flush.  So
     * they stay, dirty, and are written back later like any dirty data:
     * the range reads as this write, never as older data.  The client is
     * told the write failed, which leaves its range unspecified. */
    atomic_fetch_add (&r->write_collisions, 1);
  }
  else {
    /* The client is told the write failed: its data must not stay to be
     * written back by a restart. */
    if (bcf_write_undo (r->c, w) < 0)
      cache_update_failed (r);
    atomic_fetch_add (&r->write_collisions, 1);
  }
  bcf_write_release (r->c, w);
}

/* Does the span hold dirty data (a lookup that fails: assume so)?  Asked
 * after W1, the answer holds until W5: only this write can change the
 * span meanwhile (the tracker's ordering covers the writeback too). */
static bool
span_dirty (struct bcf_req *r, struct span s)
{
  return bcf_cache_dirty_bytes (r->c) > 0 && has_dirty (r, s) != 0;
}

/* Is the cache past cutoff (a percentage)?  in_use is the writeback
 * thread's bound on the buckets in use (bcf_writeback_in_use), 0 where
 * there is no thread.  The dirty data is a counter, and its share of the
 * cache a lower bound of the buckets it takes, which holds without a
 * thread too: before it, a write flood in the first seconds filled the
 * whole cache with dirty data, leaving no free bucket for the metadata
 * an open after a crash must write.  The share is compared exactly: a
 * percentage rounded down let dirty data reach 71 % of a cache with a
 * 70 % cutoff. */
static bool
past_cutoff (struct bcf_req *r, unsigned in_use, unsigned cutoff)
{
  return in_use > cutoff ||
    (r->capacity_bytes &&
     bcf_cache_dirty_bytes (r->c) * 100 > r->capacity_bytes * cutoff);
}

/* Writeback mode: should this write be acknowledged from the cache
 * (bcache's should_writeback)?  Above cutoff_writeback_sync never;
 * a write over dirty data always (bcache: writes overlapping the
 * writeback's keys, and no bypass for them); a bypassing write never;
 * else a write bcache would see as REQ_SYNC (every write, or only FUA
 * ones: r->all_sync, bcf_sync_writes says why) up to the sync cutoff,
 * others up to cutoff_writeback.  Above the cutoffs writes are written
 * through, so a cache full of dirty data slows writes to the export's
 * speed and never blocks them.
 *
 * *dirty is whether s holds dirty data (span_dirty), -1 while not known:
 * it is looked up only where it changes the answer.  Below the cutoffs
 * a write that does not bypass is written back either way, and the
 * lookup (a tree lookup under the tree lock, which every write of a
 * writeback flood took: 24-26k of them waited for the lock, 3.2 s in
 * all, in a 20 s run of filter-bench's rmw) would decide nothing. */
static bool
should_write_back (struct bcf_req *r, bool bypass, bool fua, struct span s,
                   int *dirty)
{
  unsigned in_use = r->wb ? bcf_writeback_in_use (r->wb) : 0;
  unsigned cutoff = writes_cutoff (r);

  if (atomic_load (&r->mode) != BCF_MODE_WRITEBACK ||
      atomic_load (&r->failing) || detaching (r))
    return false;
  if (past_cutoff (r, in_use, BCF_WB_CUTOFF_SYNC)) {
    atomic_fetch_add (&r->wb_cutoff_writes, 1);
    return false;
  }
  /* (The sync cutoff is the one just checked.) */
  if (!bypass && (fua || cutoff == BCF_WB_CUTOFF_SYNC ||
                  !past_cutoff (r, in_use, cutoff)))
    return true;
  if (*dirty < 0)
    *dirty = span_dirty (r, s);
  if (*dirty)
    return true;
  if (!bypass)                  /* past cutoff_writeback */
    atomic_fetch_add (&r->wb_cutoff_writes, 1);
  return false;
}

/* Read-modify-write of the partial blocks at the ends of span s, for a
 * write that is to cover s whole (written back, or over dirty data that
 * an invalidation of the partial blocks would lose): *out gets the
 * bytes [s.start, max (s.end, end)) with the client's data in place.
 * The partial blocks are read as any read is, hits (dirty or clean) from
 * the cache and the rest from the backing store, never cached.  Under
 * the write's turn (W1): nothing else changes them until W5. */
static int
widen_write (struct bcf_req *r, const struct bcf_backing *b, struct span s,
             const void *buf, uint64_t count, uint64_t offset,
             uint8_t **out, uint64_t *outlen)
{
  uint64_t end = offset + count, wend = end > s.end ? end : s.end;
  uint8_t *w = malloc (wend - s.start);
  bool hit, head = offset > s.start;
  int rc = 0;

  if (!w)
    return -ENOMEM;
  if (head)
    rc = read_span (r, b, (struct span) { s.start, s.start + r->block }, w,
                    true, &hit);
  if (rc == 0 && end < s.end && !(head && s.end - r->block == s.start))
    rc = read_span (r, b, (struct span) { s.end - r->block, s.end },
                    w + (s.end - r->block - s.start), true, &hit);
  if (rc < 0) {
    free (w);
    return rc;
  }
  memcpy (w + (offset - s.start), buf, count);
  *out = w;
  *outlen = wend - s.start;
  return 0;
}

/* Writeback mode, W2 and the acknowledgement: the whole blocks in as
 * dirty keys; with FUA on the journal before the write is acknowledged
 * (the journal write flushes the device first, so the data is durable
 * too).  No backing write: the writeback thread makes it later.
 * Returns 1 if the write is done, 0 if it was not cached (the caller
 * writes it through), -EIO if a FUA write's journal failed and the cache
 * could not be given up either (cache_update_failed). */
static int
write_back (struct bcf_req *r, struct span in, const void *data, bool fua)
{
  struct bcf_write w;
  int rc = bcf_write_begin_back (r->c, in.start, in.end - in.start, data,
                                 &w);

  if (rc < 0) {
    if (rc != -ENOSPC && rc != -EROFS)
      device_error (r);
    atomic_fetch_add (&r->wb_cutoff_writes, 1);
    return 0;
  }
  if (fua && bcf_write_sync (r->c, &w) < 0) {
    /* Not acknowledged: the write goes through instead (its keys are
     * dropped; a restart that finds them writes the same data back). */
    bcf_write_undo (r->c, &w);
    bcf_write_release (r->c, &w);
    return cache_update_failed (r);
  }
  bcf_write_release (r->c, &w);
  atomic_fetch_add (&r->wb_writes, 1);
  return 1;
}

/* Writethrough of a write to data the cache does not hold, W2 to W4 as a
 * fill (bcf_write_fill_begin): the backing write goes out at once, and
 * the data is cached after it, by the fill queue, clean, without its
 * lingering.  The write waits for no cache-device write, where
 * cache_write's dirty keys put one in series with every write.  A reader
 * meanwhile misses and reads the backing store (the old data before W3,
 * the new after) and, the range being the write's until W5, caches
 * nothing; a later overlapping write replaces the check key, so a late
 * fill caches nothing (write_collisions).  Returns 1 and the backing
 * write's result in *rc if done; 0 if not taken (the span holds data, or
 * the cache cannot take it: the caller goes on with cache_write). */
static int
write_fill (struct bcf_req *r, const struct bcf_backing *b, struct span s,
            struct span in, const void *buf, uint32_t count, uint64_t offset,
            bool fua, int *rc)
{
  struct bcf_miss m;
  int e = bcf_write_fill_begin (r->c, s.start, s.end - s.start);

  if (e < 0) {
    if (e != -EEXIST && e != -ENOSPC && e != -EROFS)
      device_error (r);
    return 0;
  }
  *rc = export_changed (r, b->ops->pwrite (b->opaque, buf, count, offset,
                                           fua));             /* W3 */
  if (*rc == 0 &&                                               /* W4 */
      bcf_miss_begin (r->c, in.start, in.end - in.start, &m) == 0)
    queue_fill (r, &m, (const uint8_t *) buf + (in.start - offset), true);
  else
    atomic_fetch_add (&r->write_collisions, 1);   /* wanted, not cached */
  return 1;
}

/* Writethrough over clean data the cache holds (bcf_write_over_begin):
 * W2's cache-device write runs alongside W3 instead of before it (with
 * io_uring; on the sync path bcf_io_start does it at once, which where
 * auto picks that path is a copy into the page cache), and
 * the data goes in as clean keys at W4, after both.  The range keeps its
 * old data until then, which concurrent reads may get (the write is not
 * acknowledged yet), and its write-intent marks make a crash drop both
 * (extent.c argues it).  So the write costs what its backing write
 * costs, where cache_write put a device write in series with it.  Not
 * taken where the range holds dirty data or a crash could bring some
 * back: there the keys must be on the journal, dirty, before W3.  The
 * partial blocks at the ends are invalidated durably before W3, as
 * cache_write does.  Returns 1 and the write's result in *rc if done; 0
 * if not taken (the caller goes on with cache_write). */
static int
write_over (struct bcf_req *r, const struct bcf_backing *b, struct span s,
            struct span in, const uint8_t *buf, uint32_t count,
            uint64_t offset, bool fua, int *rc)
{
  struct bcf_write w;
  bool failed;
  int e = bcf_write_over_begin (r->c, in.start, in.end - in.start,
                                buf + (in.start - offset), &w);

  if (e < 0) {
    if (e != -EEXIST && e != -ENOSPC && e != -EROFS && e != -ENOMEM)
      device_error (r);
    return 0;
  }
  if ((*rc = invalidate_durably (r, s.start, in.start - s.start)) == 0 &&
      (*rc = invalidate_durably (r, in.end, s.end - in.end)) == 0)
    *rc = export_changed (r, b->ops->pwrite (b->opaque, buf, count,   /* W3 */
                                             offset, fua));
  e = bcf_write_over_end (r->c, &w, *rc, &failed);              /* W4 */
  if (failed)
    device_error (r);
  if (e < 0)
    cache_update_failed (r);
  atomic_fetch_add (e == 1 ? &r->write_inserts : &r->write_collisions, 1);
  return 1;
}

int
bcf_req_write (struct bcf_req *r, const struct bcf_backing *b,
               const void *buf, uint32_t count, uint64_t offset, bool fua)
{
  IN_FLIGHT (r);
  ACKED (r);
  TIMED (r, BCF_LAT_WRITE, true);
  struct span s, in;
  struct bcf_bypass_token tok;
  struct bcf_write w;
  bool bypass = false, insert, dirty, back, cached = false, off;
  int known = -1;               /* does s hold dirty data? (-1: not asked) */
  const uint8_t *data;
  uint8_t *wide = NULL;
  uint64_t woff, wlen;
  int rc;

  offset += r->offset;
  s = span_of (r, offset, count);
  in = inner_of (r, offset, count);

  if (count == 0)
    return 0;
  if (offset > r->size || count > r->size - offset)
    return -ERANGE;
  if (s.start >= s.end)         /* the uncached tail */
    return export_changed (r, b->ops->pwrite (b->opaque, buf, count, offset,
                                              fua));

  /* In pass-through nothing is inserted, and nothing counted as bypassed
   * (the stream table and the counters are the cache's). */
  off = cache_off (r);
  if (!off)
    bypass = should_bypass (r, offset, count);

  if (register_write (r, s, offset, count, fua, &tok, &rc)) {  /* W1 */
    bcf_bypass_end_write (r->tracker, &tok, rc);
    return rc;
  }
  data = buf;
  woff = offset;
  wlen = count;
  back = !off && should_write_back (r, bypass, fua, s, &known);
  if (!back && known < 0)
    known = !off && span_dirty (r, s);
  /* A write that is written back has no use for the answer unless the
   * cache cannot take it after all (write_back returns 0): then it is
   * looked up below, still under the write's turn. */
  dirty = known > 0;
  /* Over dirty data every mode caches the write as writethrough does:
   * its dirty keys replace the old ones, on the journal before the
   * backing write where a crash could bring the old ones back.  An
   * invalidation instead would drop the old dirty data durably before
   * the backing store has the write, and a crash between the two would
   * leave the export's older data (time travel past a flush). */
  insert = !off && (dirty || (!bypass && !detaching (r) &&
                              atomic_load (&r->mode) != BCF_MODE_WRITEAROUND &&
                              atomic_load (&r->mode) != BCF_MODE_NONE));
  if (!off && (dirty || back) &&
      (in.start != s.start || in.end != s.end)) {
    /* The whole span is written: the partial blocks' dirty data must
     * not be invalidated, and writeback caches whole blocks only. */
    if ((rc = widen_write (r, b, s, buf, count, offset, &wide, &wlen)) < 0) {
      bcf_bypass_end_write (r->tracker, &tok, rc);
      return rc;
    }
    data = wide;
    woff = s.start;
    in = s;
  }
  if (back && in.start < in.end &&
      (rc = write_back (r, in, data + (in.start - woff), fua)) != 0) {
    rc = rc < 0 ? rc : 0;
    bcf_bypass_end_write (r->tracker, &tok, rc);
    free (wide);
    return rc;
  }
  if (known < 0) {
    dirty = span_dirty (r, s);
    insert = insert || dirty;
  }
  insert = insert && in.start < in.end;
  if (!insert && !off)
    bcf_stats_add (r->stats, BCF_STAT_BYPASSED_BYTES, count);
  if (insert && !dirty && !cache_off (r) &&
      (write_fill (r, b, s, in, data, (uint32_t) wlen, woff, fua, &rc) ||
       write_over (r, b, s, in, data, (uint32_t) wlen, woff, fua, &rc))) {
    bcf_bypass_end_write (r->tracker, &tok, rc);              /* W5 */
    free (wide);
    return rc;
  }

  if (insert && !cache_off (r))                                /* W2 */
    rc = cache_write (r, b, s, in, data + (in.start - woff), dirty, fua,
                      &w);
  else
    rc = invalidate_held (r, s.start, s.end - s.start, &w);
  if (insert && rc == 0)
    atomic_fetch_add (&r->write_collisions, 1);   /* wanted, not cached */
  if (rc < 0) {
    bcf_bypass_end_write (r->tracker, &tok, rc);
    free (wide);
    return rc;
  }
  cached = rc == 1;
  rc = export_changed (r, b->ops->pwrite (b->opaque, data,       /* W3 */
                                          (uint32_t) wlen, woff, fua));
  if (cached)                                                 /* W4 */
    complete_cache_write (r, &w, rc, dirty, fua);
  else
    bcf_write_release (r->c, &w);       /* the invalidation's marks */
  bcf_bypass_end_write (r->tracker, &tok, rc);                /* W5 */
  free (wide);
  return rc;
}

/* Under the turn of a trim or zero over s (W1): write the dirty data of
 * s to the backing store, and flush it, before the invalidation removes
 * it.  A trim or zero that then fails leaves the range as the last
 * acknowledged write left it, never the older data the backing store
 * had; one that succeeds makes this work moot, but trims of dirty data
 * are rare enough not to be worth a cleverer order.  Returns 0 or
 * -errno (nothing was changed: the data stays dirty). */
static int
write_back_span (struct bcf_req *r, const struct bcf_backing *b,
                 struct span s)
{
  uint64_t pos = s.start;
  uint8_t *buf = NULL;
  bool wrote = false;
  int rc = 0;

  while (pos < s.end && rc == 0) {
    struct bcf_extent ext[PLAN_EXTENTS];
    unsigned n = 0;

    if ((rc = bcf_dirty_scan (r->c, pos, ext, PLAN_EXTENTS, &n)) < 0 ||
        n == 0)
      break;
    for (unsigned i = 0; i < n && rc == 0; i++) {
      uint64_t a = ext[i].offset > pos ? ext[i].offset : pos;
      uint64_t z = ext[i].offset + ext[i].len;

      if (a >= s.end) {
        pos = s.end;
        break;
      }
      if (z > s.end)
        z = s.end;
      if (!buf && !(buf = malloc (PREFETCH_CHUNK)))
        rc = -ENOMEM;
      for (; rc == 0 && a < z; a += PREFETCH_CHUNK) {
        uint64_t len = z - a < PREFETCH_CHUNK ? z - a : PREFETCH_CHUNK;
        bool hit;
        if ((rc = read_span (r, b, (struct span) { a, a + len }, buf, true,
                             &hit)) == 0 &&
            (rc = backing_pwrite (r, b, buf, len, a)) == 0)
          wrote = true;
      }
      pos = z > pos ? z : pos;
    }
  }
  free (buf);
  if (rc == 0 && wrote)
    rc = bcf_cache_flush_export (r->c, b);
  return rc;
}

/* Trim and zero: the same ordering as a bypassing write. */
static int
change_range (struct bcf_req *r, const struct bcf_backing *b, uint32_t count,
              uint64_t offset, int (*fn) (const struct bcf_backing *b,
                                          uint32_t count, uint64_t offset,
                                          void *arg), void *arg)
{
  struct span s = span_of (r, offset, count);
  struct bcf_bypass_token tok;
  int rc;

  if (count == 0)
    return 0;
  if (offset > r->size || count > r->size - offset)
    return -ERANGE;
  if (s.start >= s.end)         /* the uncached tail */
    return export_changed (r, fn (b, count, offset, arg));
  register_change (r, s, &tok);
  if (!cache_off (r) && span_dirty (r, s))
    rc = write_back_span (r, b, s);
  else
    rc = 0;
  if (rc == 0 && (rc = invalidate_durably (r, s.start, s.end - s.start)) == 0)
    rc = export_changed (r, fn (b, count, offset, arg));
  bcf_bypass_end (r->tracker, &tok);
  return rc;
}

struct zero_args { bool may_trim; };

static int
call_trim (const struct bcf_backing *b, uint32_t count, uint64_t offset,
           void *arg)
{
  return b->ops->trim (b->opaque, count, offset);
}

static int
call_zero (const struct bcf_backing *b, uint32_t count, uint64_t offset,
           void *arg)
{
  const struct zero_args *z = arg;
  return b->ops->zero (b->opaque, count, offset, z->may_trim);
}

int
bcf_req_trim (struct bcf_req *r, const struct bcf_backing *b,
              uint32_t count, uint64_t offset, bool fua)
{
  IN_FLIGHT (r);
  ACKED (r);
  int rc = change_range (r, b, count, offset + r->offset, call_trim, NULL);

  /* The backing trim has no FUA of its own in the ops: flush. */
  if (rc == 0 && fua)
    rc = bcf_cache_flush_export (r->c, b);
  return rc;
}

int
bcf_req_zero (struct bcf_req *r, const struct bcf_backing *b,
              uint32_t count, uint64_t offset, bool may_trim, bool fua)
{
  IN_FLIGHT (r);
  ACKED (r);
  struct zero_args z = { .may_trim = may_trim };
  int rc = change_range (r, b, count, offset + r->offset, call_zero, &z);

  if (rc == 0 && fua)
    rc = bcf_cache_flush_export (r->c, b);
  return rc;
}

int
bcf_req_flush (struct bcf_req *r, const struct bcf_backing *b)
{
  IN_FLIGHT (r);
  TIMED (r, BCF_LAT_FLUSH, true);
  uint64_t point = atomic_load (&r->acked_point);     /* ACKED says why */
  int rc = bcf_cache_flush_export (r->c, b);

  bcf_req_drain (r);

  /* Nothing acknowledged depends on the cache's journal in the clean
   * modes (invalidations are durable before their writes), but the keys
   * of the writes that returned are made durable too, so that a flush
   * also keeps them cached after a crash.  In writeback mode, and
   * wherever dirty data exists, the journal holds acknowledged writes: a
   * flush that cannot make it durable fails. */
  if (rc == 0 && !cache_off (r) && bcf_flush_upto (r->c, point) < 0) {
    device_error (r);
    if (atomic_load (&r->mode) == BCF_MODE_WRITEBACK ||
        bcf_cache_dirty_bytes (r->c) > 0)
      rc = -EIO;
  }
  return rc;
}

int
bcf_req_has_dirty (struct bcf_req *r, uint32_t count, uint64_t offset)
{
  IN_FLIGHT (r);
  return has_dirty (r, span_of (r, offset + r->offset, count));
}

static int
has_dirty (struct bcf_req *r, struct span s)
{
  uint64_t pos = s.start;

  if (cache_off (r) || bcf_cache_dirty_bytes (r->c) == 0)
    return 0;
  while (pos < s.end) {
    struct bcf_extent ext[PLAN_EXTENTS];
    unsigned n = 0;
    int rc = bcf_lookup (r->c, pos, s.end - pos, ext, PLAN_EXTENTS, &n);

    if (rc < 0)
      return rc;
    if (n == 0)
      break;
    for (unsigned i = 0; i < n; i++) {
      if (ext[i].kind == BCF_EXTENT_HIT && ext[i].dirty)
        return 1;
      pos = ext[i].offset + ext[i].len;
    }
  }
  return 0;
}
