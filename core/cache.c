/* bcachefilter engine: the cache set's life cycle (include/bcachefilter/
 * cache.h): open, close, abandon, accessors, statistics and the
 * background threads.  The extent operations the request path calls
 * (lookups, hits, the cache-miss protocol, inserts, invalidation) are in
 * extent.c.
 *
 * Design
 * ------
 * Open claims the device (claim.c), opens it (io.c) and hands it to
 * super.c, which formats, registers or opens the cache and replays its
 * journal.  Close stops the threads and writes a checkpoint; nothing
 * depends on it (recovery handles a crash at any point).
 *
 * Locking: see engine.h.  Background threads: the journal timer (writes the
 * open entry after journal_delay_ms, checkpoints when the journal is half
 * full or checkpoint_interval_ms after the last checkpoint if anything
 * changed), the allocator (keeps the free lists filled) and GC.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "super.h"

/* ---- open / close -------------------------------------------------------------- */

/* What bcf_cache_open set up besides the device and the tree: the one
 * teardown of a failed open, a close and a test crash. */
static void
cache_free (struct bcf_cache *c)
{
  gc_free (c);
  intent_free (c);
  pthread_rwlock_destroy (&c->tree_lock);
  pthread_mutex_destroy (&c->ckpt_lock);
  pthread_mutex_destroy (&c->super_lock);
  pthread_mutex_destroy (&c->export_lock);
  pthread_mutex_destroy (&c->stats.time_lock);
  bcf_stats_free (c->counters);
  free (c);
}

int
bcf_cache_open (const struct bcf_cache_opts *opts, struct bcf_cache **cp,
                char *err, size_t errlen)
{
  struct bcf_cache *c;
  struct bcf_io_opts io = { 0 };
  int64_t size;
  int r;

  *cp = NULL;
  if (!opts->backing.ops && !opts->readonly) {
    snprintf (err, errlen, "no backing store given");
    return -EINVAL;
  }
  size = opts->backing.ops ? opts->backing.ops->size (opts->backing.opaque)
         : 0;
  if (size < 0) {
    snprintf (err, errlen, "cannot get the size of the backing store: %s",
              strerror ((int) -size));
    return (int) size;
  }
  c = calloc (1, sizeof *c);
  if (!c)
    return -ENOMEM;
  c->opts = *opts;
  c->backing_sectors = (uint64_t) size >> BCH_SECTOR_SHIFT;
  pthread_rwlock_init (&c->tree_lock, NULL);
  pthread_mutex_init (&c->ckpt_lock, NULL);
  pthread_mutex_init (&c->super_lock, NULL);
  pthread_mutex_init (&c->export_lock, NULL);
  pthread_mutex_init (&c->stats.time_lock, NULL);
  /* Counted from 0: a process that ends cleanly leaves nothing
   * unflushed (its close's checkpoint passed the barrier).  One killed
   * may have: writes its clients never flushed, which this process could
   * fill and make durable as clean keys before anything flushes the
   * export.  Such writes were never promised durable; the window closes
   * at the first flush of the export by a client or the writeback, and
   * counting them here would open the background connection at every
   * start (with the nbd plugin, an error line each time). */
  atomic_init (&c->export_changes, 0);
  gc_init (c);
  c->counters = bcf_stats_new ();
  if (!c->counters)
    r = -ENOMEM;
  else
    r = intent_init (c);
  if (r < 0) {
    bcf_stats_free (c->counters);
    gc_free (c);
    intent_free (c);
    free (c);
    return r;
  }

  io.path = opts->path;
  io.readonly = opts->readonly;
  io.mode = opts->io_mode;
  io.direct = opts->direct_off ? BCF_IO_DIRECT_OFF : BCF_IO_DIRECT_AUTO;
  io.create_size = opts->create_size;
  io.claim = opts->claim;
  r = bcf_io_open (&io, &c->io, err, errlen);
  if (r < 0)
    goto fail;
  if (bcf_io_notice (c->io))
    bcf_log (c, BCF_LOG_INFO, "%s", bcf_io_notice (c->io));

  pthread_mutex_lock (&c->ckpt_lock);
  c->ckpt_held_by_open = true;
  r = super_open (c, err, errlen);
  c->ckpt_held_by_open = false;
  pthread_mutex_unlock (&c->ckpt_lock);
  if (r < 0)
    goto fail;
  *cp = c;
  return 0;

 fail:
  if (c->io)
    super_close_state (c);
  bcf_io_close (c->io);
  cache_free (c);
  return r;
}

int
bcf_cache_close (struct bcf_cache *c)
{
  int r = 0, r2;

  if (!c)
    return 0;
  bcf_cache_stop_threads (c);
  if (!c->failed && !c->opts.readonly) {
    /* A clean close leaves no marks: a mark is cleared only once a
     * checkpoint has the keys of the writes that relied on it (intent.c),
     * so one first, and one after for the clears. */
    pthread_mutex_lock (&c->ckpt_lock);
    r = btree_checkpoint (c);
    pthread_mutex_unlock (&c->ckpt_lock);
    if (r == 0) {
      intent_clear_all (c);
      pthread_mutex_lock (&c->ckpt_lock);
      r = btree_checkpoint (c);
      pthread_mutex_unlock (&c->ckpt_lock);
    }
  }
  super_close_state (c);
  r2 = bcf_io_close (c->io);
  if (r == 0)
    r = r2;
  cache_free (c);
  return r;
}

/* May the cache stop holding its export (an abandon, a detach)?  Not
 * read-only (-EROFS), and nothing dirty (-EBUSY): dirty data is the only
 * copy of acknowledged writes.  The caller keeps dirty data from
 * appearing afterwards (request.c). */
static int
may_let_go (struct bcf_cache *c)
{
  uint64_t dirty;

  if (c->opts.readonly)
    return -EROFS;
  pthread_rwlock_rdlock (&c->tree_lock);
  dirty = btree_dirty_sectors (c);
  pthread_rwlock_unlock (&c->tree_lock);
  return dirty > 0 ? -EBUSY : 0;
}

int
bcf_cache_abandon (struct bcf_cache *c)
{
  int r;

  if ((r = may_let_go (c)) < 0)
    return r;
  /* From here on every update fails, and close writes nothing. */
  c->failed = true;
  pthread_mutex_lock (&c->ckpt_lock);
  r = super_abandon (c);
  pthread_mutex_unlock (&c->ckpt_lock);
  if (r < 0)
    bcf_log (c, BCF_LOG_ERROR, "cannot mark the cache device %s as abandoned "
             "(%s): until it can be, writes to data it may hold fail with "
             "EIO, so that it never serves data older than the export; if "
             "the device is gone for good, stop nbdkit and start it without "
             "the cache, or with a new one (bcache-format=force)",
             c->opts.path, strerror (-r));
  else
    bcf_log (c, BCF_LOG_WARN, "cache device %s abandoned: the next open "
             "starts with an empty cache", c->opts.path);
  return r;
}

int
bcf_cache_detach (struct bcf_cache *c)
{
  int r;

  if ((r = may_let_go (c)) < 0)
    return r;
  pthread_mutex_lock (&c->ckpt_lock);
  r = super_detach (c);
  pthread_mutex_unlock (&c->ckpt_lock);
  if (r == 0)
    bcf_log (c, BCF_LOG_INFO, "%s: detached from its export (uuid slot %u "
             "invalidated): the next open starts with an empty cache",
             c->opts.path, c->inode);
  return r;
}

struct bcf_io *
bcf_cache_test_io (struct bcf_cache *c)
{
  return c->io;
}

int
bcf_cache_test_crash (struct bcf_cache *c, uint64_t seed, int mode)
{
  int r;

  bcf_cache_stop_threads (c);
  r = bcf_io_crash (c->io, seed, (enum bcf_io_crash_mode) mode);
  c->io = NULL;
  super_close_state (c);
  cache_free (c);
  return r;
}

unsigned
bcf_cache_block_size (const struct bcf_cache *c)
{
  return c->block_bytes;
}

bool
bcf_cache_owner (const struct bcf_cache *c, uint8_t uuid[16],
                 uint64_t *bytes)
{
  if (!bch_uuid_entry_live (&c->owner))
    return false;
  memcpy (uuid, c->owner.uuid, 16);
  *bytes = c->owner.sectors << BCH_SECTOR_SHIFT;
  return true;
}

const struct bch_sb *
bcf_cache_super (const struct bcf_cache *c)
{
  return &c->sb;
}

const char *
bcf_cache_io_name (const struct bcf_cache *c)
{
  return bcf_io_mode_name (c->io);
}

bool
bcf_cache_io_direct (const struct bcf_cache *c)
{
  return bcf_io_direct (c->io);
}

uint64_t
bcf_cache_backing_size (const struct bcf_cache *c)
{
  return c->backing_sectors << BCH_SECTOR_SHIFT;
}

void
bcf_cache_log (struct bcf_cache *c, enum bcf_log_level level,
               const char *fmt, ...)
{
  char msg[1024];
  va_list ap;

  va_start (ap, fmt);
  vsnprintf (msg, sizeof msg, fmt, ap);
  va_end (ap);
  bcf_log (c, level, "%s", msg);
}

uint64_t
bcf_cache_capacity_bytes (const struct bcf_cache *c)
{
  return (uint64_t) c->sb.nbuckets * c->bucket_bytes;
}

uint64_t
bcf_cache_in_use_marks (struct bcf_cache *c)
{
  return atomic_load (&c->alloc.in_use_marks);
}

uint64_t
bcf_cache_dirty_bytes (struct bcf_cache *c)
{
  /* Written under tree_lock; a racy read is only a moment old. */
  return __atomic_load_n (&c->tree.dirty_sectors, __ATOMIC_RELAXED)
         << BCH_SECTOR_SHIFT;
}

uint64_t
bcf_cache_dirty_inserts (struct bcf_cache *c)
{
  return atomic_load (&c->stats.dirty_inserts);   /* seq_cst: D4 */
}

const char *
bcf_cache_device_lost (struct bcf_cache *c)
{
  return bcf_io_lost (c->io);
}

int
bcf_cache_check_device (struct bcf_cache *c)
{
  int r = bcf_io_check (c->io);

  if (r < 0 && !atomic_exchange (&c->lost_logged, true))
    bcf_log (c, BCF_LOG_ERROR, "%s; giving the cache up: nothing it holds "
             "is served any more, everything passes through to the export, "
             "and the next start begins with an empty cache",
             bcf_io_lost (c->io));
  return r;
}

void
bcf_cache_set_congestion (struct bcf_cache *c, unsigned read_us,
                          unsigned write_us)
{
  bcf_io_set_congestion (c->io, read_us, write_us);
}

void
bcf_cache_set_export (struct bcf_cache *c, const struct bcf_backing *b)
{
  pthread_mutex_lock (&c->export_lock);
  c->export = b;
  pthread_mutex_unlock (&c->export_lock);
}

void
bcf_cache_export_changed (struct bcf_cache *c)
{
  atomic_fetch_add_explicit (&c->export_changes, 1, memory_order_release);
}

uint64_t
export_changes_now (struct bcf_cache *c)
{
  return atomic_load_explicit (&c->export_changes, memory_order_acquire);
}

/* Has a flush that succeeded covered every change up to `changes`? */
static bool
export_flushed_upto (struct bcf_cache *c, uint64_t changes)
{
  bool covered;

  pthread_mutex_lock (&c->export_lock);
  covered = c->export_flushed >= changes;
  pthread_mutex_unlock (&c->export_lock);
  return covered;
}

/* The changes counted before a flush is issued are the ones it covers
 * (the export acknowledged them before).  So a flush that finds every
 * change counted so far covered by one that succeeded has nothing to
 * make durable, and is not sent: a client's flush in writeback mode,
 * where writes stay in the cache, then waits for the cache's journal
 * only, not for a round trip to the export too.  Why that is enough:
 * every change the caller may rely on (one the export acknowledged
 * before the caller's flush arrived) was counted before its request
 * returned (export_changed), so it is in `changes`.  That one flush
 * covers changes made through other connections' handles is the
 * assumption export_barrier makes already (an export with multi-conn
 * semantics, as NBD's flush is for one that advertises it). */
int
bcf_cache_flush_export (struct bcf_cache *c, const struct bcf_backing *b)
{
  uint64_t changes = export_changes_now (c);
  int r;

  if (export_flushed_upto (c, changes)) {
    atomic_fetch_add (&c->stats.export_flushes_skipped, 1);
    return 0;
  }
  r = b->ops->flush (b->opaque);

  if (r == 0) {
    pthread_mutex_lock (&c->export_lock);
    if (changes > c->export_flushed)
      c->export_flushed = changes;
    pthread_mutex_unlock (&c->export_lock);
  }
  return r;
}

/* Make every export change counted up to `changes` durable on the
 * export (bcf_cache_set_export says why).  Why this order is enough: a
 * change is counted after the export acknowledged it, and a key that
 * relies on it is inserted (or marked clean) after that, under the tree
 * lock; the checkpoint reads the count under the same lock when it
 * captures the keys, so the count it passes here covers every change a
 * captured key relies on.  The count read here before the flush is
 * covered by the flush (the export acknowledged those changes before it
 * was issued).  Concurrent barriers queue on export_lock, and the later
 * one usually finds itself covered. */
int
export_barrier (struct bcf_cache *c, uint64_t changes)
{
  int r = 0;

  pthread_mutex_lock (&c->export_lock);
  if (c->export && c->export_flushed < changes) {
    uint64_t now = export_changes_now (c);

    r = c->export->ops->flush (c->export->opaque);
    if (r == 0) {
      c->export_flushed = now;
      atomic_fetch_add (&c->stats.export_flushes, 1);
    }
    else {
      atomic_fetch_add (&c->stats.export_flush_errors, 1);
      bcf_log (c, BCF_LOG_ERROR, "flushing the export before a checkpoint "
               "failed: %s; the checkpoint waits for the export (clean "
               "keys are made durable only for data the export has "
               "flushed)", strerror (-r));
    }
  }
  pthread_mutex_unlock (&c->export_lock);
  return r;
}

unsigned
bcf_cache_congested (struct bcf_cache *c)
{
  return bcf_io_congested (c->io);
}

uint64_t
bcf_cache_device_ios (const struct bcf_cache *c)
{
  return bcf_io_count (c->io);
}

uint64_t
bcf_cache_device_errors (const struct bcf_cache *c)
{
  return bcf_io_errors (c->io);
}

void
bcf_release_memory (void)
{
  bcf_io_thread_cleanup ();
  bcf_buf_pool_trim ();
}

/* ---- stats ------------------------------------------------------------------------ */

void
bcf_cache_stats (struct bcf_cache *c, struct bcf_cache_stats *st)
{
  uint64_t counters[BCF_STAT__COUNT];

  memset (st, 0, sizeof *st);
  st->nbuckets = c->sb.nbuckets;
  st->bucket_bytes = c->bucket_bytes;
  st->block_bytes = c->block_bytes;
  alloc_count (c, &st->buckets_free, &st->buckets_clean, &st->buckets_dirty,
               &st->buckets_meta);
  pthread_rwlock_rdlock (&c->tree_lock);
  st->dirty_sectors = btree_dirty_sectors (c);
  st->btree_nodes = c->tree.nnodes;
  st->btree_depth = c->tree.root ? c->tree.root->level + 1 : 0;
  st->btree_keys = c->tree.nkeys;
  st->btree_cache_bytes = c->tree.cache_bytes;
  st->btree_evictions = __atomic_load_n (&c->tree.evictions, __ATOMIC_RELAXED);
  st->btree_loads = __atomic_load_n (&c->tree.loads, __ATOMIC_RELAXED);
  pthread_rwlock_unlock (&c->tree_lock);
  bcf_io_get_congestion (c->io, &st->congested_read_threshold_us,
                         &st->congested_write_threshold_us);
  st->congested = bcf_io_congested (c->io);
  pthread_mutex_lock (&c->journal.lock);
  st->journal_seq = journal_open_seq (c);
  st->journal_last_seq = c->journal.last_seq;
  st->journal_writes = c->journal.writes;
  pthread_mutex_unlock (&c->journal.lock);
  bcf_stats_get (c->counters, BCF_VIEW_TOTAL, counters);
  st->miss_collisions = counters[BCF_STAT_MISS_COLLISIONS];
  st->read_races = counters[BCF_STAT_READ_RACES];
  st->inserts = atomic_load (&c->stats.inserts);
  st->dirty_inserts = atomic_load (&c->stats.dirty_inserts);
  st->intent_regions = intent_marked (c);
  st->intent_marks = atomic_load (&c->stats.intent_marks);
  st->intent_clears = atomic_load (&c->stats.intent_clears);
  st->intent_dropped = atomic_load (&c->stats.intent_dropped);
  st->invalidates = atomic_load (&c->stats.invalidates);
  st->invalidates_marked = atomic_load (&c->stats.invalidates_marked);
  st->export_flushes = atomic_load (&c->stats.export_flushes);
  st->export_flush_errors = atomic_load (&c->stats.export_flush_errors);
  st->export_flushes_skipped =
    atomic_load (&c->stats.export_flushes_skipped);
  st->device_errors = bcf_io_errors (c->io);
  st->gc_passes = atomic_load (&c->stats.gc_passes);
  st->gc_slices = atomic_load (&c->stats.gc_slices);
  st->gc_nodes = atomic_load (&c->stats.gc_nodes);
  st->gc_coalesced = atomic_load (&c->stats.gc_coalesced);
  st->moving_gc_runs = atomic_load (&c->stats.moving_gc_runs);
  st->moving_gc_keys = atomic_load (&c->stats.moving_gc_keys);
  st->moving_gc_bytes = atomic_load (&c->stats.moving_gc_bytes);
  st->moving_gc_collisions = atomic_load (&c->stats.moving_gc_collisions);
  st->gc_slice_nodes_last = atomic_load (&c->stats.gc_slice_nodes_last);
  st->gc_slice_nodes_max = atomic_load (&c->stats.gc_slice_nodes_max);
  st->gc_slices_busy = atomic_load (&c->stats.gc_slices_busy);
  st->requests_in_flight = bcf_inflight (c);
  pthread_mutex_lock (&c->stats.time_lock);
  st->gc = c->stats.gc;
  st->btree_split = c->stats.btree_split;
  st->journal_write = c->stats.journal_write;
  st->alloc_wait = c->stats.alloc_wait;
  st->checkpoint = c->stats.checkpoint;
  st->gc_slice_locked = c->stats.gc_slice_locked;
  st->ckpt_locked = c->stats.ckpt_locked;
  st->lookup_lock_wait = c->stats.lookup_lock_wait;
  st->update_locked = c->stats.update_locked;
  st->update_lock_wait = c->stats.update_lock_wait;
  st->intent_mark = c->stats.intent_mark;
  st->cache_write = c->stats.cache_write;
  st->journal_preflush = c->stats.journal_preflush;
  st->prio_write = c->stats.prio_write;
  pthread_mutex_unlock (&c->stats.time_lock);
}

struct bcf_stats *
bcf_cache_counters (struct bcf_cache *c)
{
  return c->counters;
}

void
bcf_cache_clear_time_stats (struct bcf_cache *c)
{
  struct bcf_time_stat *const all[] = {
    &c->stats.gc, &c->stats.btree_split, &c->stats.journal_write,
    &c->stats.alloc_wait, &c->stats.checkpoint, &c->stats.ckpt_locked,
    &c->stats.gc_slice_locked, &c->stats.lookup_lock_wait,
    &c->stats.update_locked, &c->stats.update_lock_wait,
    &c->stats.intent_mark, &c->stats.cache_write,
    &c->stats.journal_preflush, &c->stats.prio_write,
  };

  pthread_mutex_lock (&c->stats.time_lock);
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    memset (all[i], 0, sizeof *all[i]);
  pthread_mutex_unlock (&c->stats.time_lock);
}

/* ---- background threads ------------------------------------------------------------- */

void *gc_thread (void *arg);

/* Has anything been journalled since the last btree commit?  A commit
 * writes one entry (seq last_seq) and opens the next; without this check
 * a small journal (2 buckets: the current one alone is half) would be
 * committed again every tick while idle. */
static bool
journal_has_new_entries (struct bcf_cache *c)
{
  bool r;

  pthread_mutex_lock (&c->journal.lock);
  r = c->journal.seq > c->journal.last_seq + 1;
  pthread_mutex_unlock (&c->journal.lock);
  return r;
}

/* Is a checkpoint due by the clock: the tree has keys no checkpoint
 * captured, and the last one committed checkpoint_interval_ms ago?  Fills
 * are not journalled (btree.c), so only a checkpoint makes them survive a
 * crash; and a leaf with unwritten keys cannot be evicted.  Without this
 * a read-mostly cache, whose journal never fills, would keep everything
 * it cached since it started in memory only.  bcache writes a dirty
 * btree node within 30 s for the same reasons. */
static bool
checkpoint_due (struct bcf_cache *c)
{
  uint64_t interval = c->opts.checkpoint_interval_ms
                      ? c->opts.checkpoint_interval_ms : 30000;

  return bcf_now_ns () - atomic_load (&c->ckpt_done_ns) >=
         interval * 1000000ull && btree_has_uncaptured (c);
}

/* Journal timer: write the open entry every journal_delay_ms; commit the
 * btree when the journal is half full, so foreground inserts rarely have
 * to, or when checkpoint_due. */
static void *
journal_thread (void *arg)
{
  struct bcf_cache *c = arg;
  unsigned delay = c->opts.journal_delay_ms ? c->opts.journal_delay_ms : 100;

  while (!c->stopping) {
    bcf_sleep_ms (delay);
    bcf_cache_check_device (c);
    if (c->failed)
      continue;
    bcf_flush (c);
    intent_tick (c, INTENT_QUIET_MS * 1000000ull);
    if ((journal_used_percent (c) >= 50 && journal_has_new_entries (c)) ||
        checkpoint_due (c))
      bcf_cache_checkpoint (c);
    else
      btree_evict_maybe (c);
  }
  bcf_io_thread_cleanup ();
  return NULL;
}

/* Allocator: keep the data free list at least half full. */
static void *
alloc_thread (void *arg)
{
  struct bcf_cache *c = arg;
  struct alloc_state *a = &c->alloc;

  while (!c->stopping) {
    bool low;

    pthread_mutex_lock (&a->lock);
    low = alloc_lists_low (a);
    pthread_mutex_unlock (&a->lock);
    if (low && !c->failed && alloc_refill_background (c) == 0)
      continue;
    bcf_sleep_ms (20);
  }
  bcf_io_thread_cleanup ();
  return NULL;
}

int
bcf_cache_start_threads (struct bcf_cache *c)
{
  int r;

  if (c->threads_running || c->opts.readonly)
    return 0;
  c->stopping = false;
  /* The interval counts from now if no checkpoint ran yet (a cache just
   * formatted): not a checkpoint at the first fill. */
  if (atomic_load (&c->ckpt_done_ns) == 0)
    atomic_store (&c->ckpt_done_ns, bcf_now_ns ());
  if ((r = pthread_create (&c->journal_thread, NULL, journal_thread, c)))
    return -r;
  if ((r = pthread_create (&c->alloc_thread, NULL, alloc_thread, c))) {
    c->stopping = true;
    pthread_join (c->journal_thread, NULL);
    return -r;
  }
  if ((r = pthread_create (&c->gc_thread, NULL, gc_thread, c))) {
    c->stopping = true;
    pthread_join (c->journal_thread, NULL);
    pthread_join (c->alloc_thread, NULL);
    return -r;
  }
  c->threads_running = true;
  return 0;
}

void
bcf_cache_stop_threads (struct bcf_cache *c)
{
  if (!c->threads_running)
    return;
  c->stopping = true;
  gc_request (c);           /* wakes the GC thread */
  pthread_join (c->journal_thread, NULL);
  pthread_join (c->alloc_thread, NULL);
  pthread_join (c->gc_thread, NULL);
  c->threads_running = false;
}
