/* bcachefilter engine: moving GC, compacting dirty data
 * (bcache's movinggc.c, research/bcache.md §2.4).
 *
 * Why
 * ---
 * The writeback cutoffs (bcache's cutoff_writeback 40 %, _sync 70 %)
 * count buckets marked dirty, not dirty bytes.  Random overwrites leave
 * most buckets holding a little live dirty data, and the writeback
 * cleans in key order, not bucket order: under filter-bench's rmw 70 %
 * of a 2 GiB cache counted dirty while 24-33 % of its bytes were, and
 * every write after that was written through at the export's speed
 * (docs/BENCHMARKS.md, after-flood).  Copying the dirty extents of the
 * emptiest dirty buckets into fresh ones (bcache's copy_gc, off by
 * default in mainline) lets the next GC pass count the old buckets
 * clean: the buckets counted then follow the dirty bytes.
 *
 * What a run does (bcf_move_dirty)
 * --------------------------------
 *  1. Counts the live dirty sectors of every bucket from a scan of the
 *     dirty keys (bcf_dirty_scan: exact now, where GC's sectors_used
 *     counts clean data too and is as old as the last pass).
 *  2. Chooses, under alloc.lock, closed data buckets (state available,
 *     marked dirty, no write in flight into them) at most
 *     BCF_MOVE_FILL_MAX_PERCENT (3/4) full of dirty data, emptiest
 *     first, while their dirty data fits max_bytes and half the
 *     buckets the allocator could still hand out (a run never takes the
 *     room the writes it makes room for need).
 *  3. Scans again and copies the extents that lie in chosen buckets, in
 *     batches (extent_move_dirty): read, write to new space, then
 *     replace-insert the same dirty key at the new place, journalled,
 *     only if the range still holds exactly the old key.
 * The clean keys of a chosen bucket are not copied: they go stale when
 * the bucket is reused, which only costs a future miss.  The caller asks
 * for the GC pass that recounts the buckets.
 *
 * Why no write is lost or reordered
 * ---------------------------------
 *  (1) The insert is a compare-and-swap against the exact old key (same
 *      pointer relation, gen, dirty bit).  A write that replaced any
 *      part of it first, an invalidation (trim, zero, a bypassing
 *      write), or a clean mark makes the move fail (-EEXIST, counted as
 *      a collision) and the newer state stays.  One that comes after the
 *      move replaces the moved key as it would the old one.
 *  (2) The data read is the old key's: while a dirty key is in the
 *      tree its bucket is never reclaimed (GC marks it dirty, and
 *      alloc_mark_dirty marks it at insert), and a key once replaced
 *      never comes back at run time, so if the CAS succeeds the key was
 *      there for the whole read.  (The read is still checked for a stale
 *      pointer: a stale read is written nowhere.)
 *  (3) A crash.  The moved key is journalled; its data write completed
 *      before the insert, and a journal write flushes the device first,
 *      as for every dirty write.  Lost with its journal entry, the old
 *      key comes back, pointing at a bucket that cannot have been
 *      reused: reuse needs a GC pass that found the bucket clean, which
 *      needs the move in memory first, then an invalidation whose new
 *      gen is persisted with a journal entry before the bucket is handed
 *      out (alloc.c), and journal entries become durable in order, so
 *      that entry's durability implies the move's.  test-crash's
 *      move_reuse_crash cuts the power at every write of a move, the
 *      GC after it and the reuse of the old buckets; its writeback
 *      workloads move dirty data among their other operations.
 *  (4) A reader that looked the old key up and reads the old bucket
 *      after its reuse sees a stale pointer (bcf_read_hit's recheck); a
 *      dirty hit is then looked up again, never read from the export
 *      (request.c, read_hit).
 *  (5) The writeback's runs check their keys (B2) and read them (B3)
 *      without a lock in between; a move between the two could let a
 *      run read a reused bucket.  So the writeback thread, the one
 *      caller outside tests, moves only between its batches, when no
 *      run is registered (writeback.c).
 *
 * Locking: none of its own.  The scans take tree_lock for reading, the
 * choice alloc.lock, the copy each insert's tree_lock for writing; no
 * lock is held across I/O.
 */
#include "config.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define MOVE_SCAN        128            /* extents per bcf_dirty_scan */
#define MOVE_BATCH       64             /* extents per extent_move_dirty */
#define MOVE_BATCH_BYTES (1u << 20)     /* at least; a bucket if larger */

/* Calls fn for every dirty extent of the cache, in key order.  Returns 0,
 * fn's first nonzero return, or -errno. */
static int
each_dirty_extent (struct bcf_cache *c,
                   int (*fn) (const struct bcf_extent *e, void *arg),
                   void *arg)
{
  struct bcf_extent ext[MOVE_SCAN];
  uint64_t pos = 0;
  unsigned n;
  int r;

  do {
    if ((r = bcf_dirty_scan (c, pos, ext, MOVE_SCAN, &n)) < 0)
      return r;
    for (unsigned i = 0; i < n; i++)
      if ((r = fn (&ext[i], arg)) != 0)
        return r;
    if (n)
      pos = ext[n - 1].offset + ext[n - 1].len;
  } while (n == MOVE_SCAN);
  return 0;
}

struct count_arg {
  struct bcf_cache *c;
  uint32_t *dirty;              /* sectors per bucket */
};

static int
count_one (const struct bcf_extent *e, void *arg)
{
  struct count_arg *a = arg;
  uint64_t b = bucket_of_ptr (a->c, e->ptr);

  if (b < a->c->alloc.nbuckets)
    a->dirty[b] += (uint32_t) (e->len >> BCH_SECTOR_SHIFT);
  return 0;
}

struct candidate {
  uint64_t bucket;
  uint32_t dirty;
};

static int
by_dirty (const void *x, const void *y)
{
  const struct candidate *a = x, *b = y;

  return a->dirty < b->dirty ? -1 : a->dirty > b->dirty;
}

/* Step 2: set chosen[b] for the buckets to empty; returns how many. */
static uint64_t
choose_buckets (struct bcf_cache *c, const uint32_t *dirty,
                uint64_t max_sectors, uint8_t *chosen)
{
  struct alloc_state *a = &c->alloc;
  const uint64_t full = c->bucket_sectors * BCF_MOVE_FILL_MAX_PERCENT / 100;
  struct candidate *cand = malloc (a->nbuckets * sizeof *cand);
  uint64_t ncand = 0, room = 0, sum = 0, n = 0;

  if (!cand)
    return 0;
  pthread_mutex_lock (&a->lock);
  for (uint64_t b = 0; b < a->nbuckets; b++) {
    const struct bucket *bk = &a->buckets[b];

    if (bk->state == BUCKET_FREE ||
        (bk->state == BUCKET_AVAILABLE && bk->mark <= GC_MARK_RECLAIMABLE &&
         bk->pin == 0))
      room++;
    else if (bk->state == BUCKET_AVAILABLE && bk->mark == GC_MARK_DIRTY &&
             bk->pin == 0 && dirty[b] > 0 && dirty[b] <= full)
      cand[ncand++] = (struct candidate) { b, dirty[b] };
  }
  pthread_mutex_unlock (&a->lock);
  room = room / 2 * c->bucket_sectors;
  if (max_sectors > room)
    max_sectors = room;
  qsort (cand, ncand, sizeof *cand, by_dirty);
  for (uint64_t i = 0; i < ncand && sum + cand[i].dirty <= max_sectors; i++) {
    chosen[cand[i].bucket] = 1;
    sum += cand[i].dirty;
    n++;
  }
  free (cand);
  return n;
}

struct move_arg {
  struct bcf_cache *c;
  const uint8_t *chosen;
  struct bcf_extent batch[MOVE_BATCH];
  int res[MOVE_BATCH];
  unsigned n;
  uint64_t bytes, cap;
  uint8_t *buf;
  struct bcf_move_stats st;
};

/* Copy the batch.  No room ends the run (1); so does a device error
 * (-errno).  Either way what was not moved stays where it is, as dirty
 * as before. */
static int
move_batch (struct move_arg *m)
{
  int r = 0;

  extent_move_dirty (m->c, m->batch, m->n, m->buf, m->res);
  for (unsigned i = 0; i < m->n; i++) {
    if (m->res[i] == 0) {
      m->st.keys++;
      m->st.bytes += m->batch[i].len;
    }
    else if (m->res[i] == -EEXIST || m->res[i] == -ESTALE)
      m->st.collisions++;
    else if (m->res[i] == -ENOSPC && r == 0)
      r = 1;
    else if (m->res[i] != -ENOSPC && r <= 0)
      r = m->res[i];
  }
  m->n = 0;
  m->bytes = 0;
  return r;
}

static int
move_one (const struct bcf_extent *e, void *arg)
{
  struct move_arg *m = arg;
  uint64_t b = bucket_of_ptr (m->c, e->ptr);
  int r;

  if (b >= m->c->alloc.nbuckets || !m->chosen[b])
    return 0;
  if ((m->n == MOVE_BATCH || m->bytes + e->len > m->cap) &&
      (r = move_batch (m)) != 0)
    return r;
  m->batch[m->n++] = *e;
  m->bytes += e->len;
  return 0;
}

int
bcf_move_dirty (struct bcf_cache *c, uint64_t max_bytes,
                struct bcf_move_stats *st)
{
  const uint64_t nb = c->alloc.nbuckets;
  const uint64_t bucket_bytes = c->bucket_sectors << BCH_SECTOR_SHIFT;
  struct count_arg ca = { .c = c };
  struct move_arg *m = NULL;
  uint8_t *chosen = NULL;
  int r = 0;

  if (st)
    memset (st, 0, sizeof *st);
  if (c->opts.readonly || c->failed)
    return 0;
  if (!(ca.dirty = calloc (nb, sizeof *ca.dirty)) ||
      !(chosen = calloc (nb, 1)) || !(m = calloc (1, sizeof *m))) {
    r = -ENOMEM;
    goto out;
  }
  if ((r = each_dirty_extent (c, count_one, &ca)) < 0)
    goto out;
  m->c = c;
  m->chosen = chosen;
  m->st.buckets = choose_buckets (c, ca.dirty, max_bytes >> BCH_SECTOR_SHIFT,
                                  chosen);
  if (m->st.buckets == 0)
    goto out;
  m->cap = bucket_bytes > MOVE_BATCH_BYTES ? bucket_bytes : MOVE_BATCH_BYTES;
  if (!(m->buf = bcf_buf_alloc (m->cap))) {
    r = -ENOMEM;
    goto out;
  }
  r = each_dirty_extent (c, move_one, m);
  if (r == 0 && m->n)
    r = move_batch (m);
  if (r > 0)
    r = 0;                      /* no room left: the run ends here */
  bcf_buf_free (m->buf, m->cap);
  atomic_fetch_add (&c->stats.moving_gc_runs, 1);
  atomic_fetch_add (&c->stats.moving_gc_keys, m->st.keys);
  atomic_fetch_add (&c->stats.moving_gc_bytes, m->st.bytes);
  atomic_fetch_add (&c->stats.moving_gc_collisions, m->st.collisions);
  if (r < 0)
    bcf_log (c, BCF_LOG_WARN, "moving GC stopped: %s (the dirty data "
             "not moved stays where it is, still dirty)", strerror (-r));
out:
  if (st && m)
    *st = m->st;
  free (m);
  free (chosen);
  free (ca.dirty);
  return r;
}
