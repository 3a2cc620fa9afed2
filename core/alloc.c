/* bcachefilter engine: buckets, gens, prios and the allocator.
 *
 * Design
 * ------
 * As in bcache (research/bcache.md §2.1).  Every bucket has an 8-bit gen;
 * a pointer is valid only while its gen equals the bucket's, so freeing a
 * bucket is incrementing its gen ("invalidating" it), and nothing is ever
 * overwritten in place while a pointer might still reach it.
 *
 * The rule that makes reuse crash-safe: a bucket's new gen is persisted
 * (prio buckets + a journal entry pointing at them) BEFORE the bucket is
 * handed out.  Otherwise a crash could bring back the old gen together
 * with on-disk keys that point into the bucket, and those keys would read
 * whatever was written there since.  Hence the pipeline
 *
 *   AVAILABLE --invalidate (gen++)--> FREE_INC --prio write--> FREE
 *   FREE --alloc--> OPEN (data, appended) --full--> AVAILABLE
 *   FREE --alloc--> IN_USE (metadata) --released--> AVAILABLE
 *
 * The other side of the same window: while a bucket is FREE_INC its keys
 * are stale in memory but still valid on disk, and memory forgets them
 * (GC drops stale keys, a miss lays its check key over one).  A write to
 * such a range then finds nothing cached, yet its invalidation must be
 * journalled, or a crash before the prio write revives the old key over
 * data the backing store no longer has.  So the allocator counts the
 * buckets whose gen is not persisted (unpersisted), and bcf_invalidate
 * journals whenever that count is not zero.
 *
 * Which AVAILABLE buckets may be invalidated is decided by their mark
 * (free or clean data; never dirty data or metadata), their pin count
 * (no data write in flight) and the gen-wrap guard: gen - last_gc < 96,
 * where last_gc is the oldest gen GC still saw referenced, so an 8-bit gen
 * never wraps around to a value an old pointer carries.  Marks are
 * recomputed by GC (gc.c); between passes they are conservative (a bucket
 * filled with data is "reclaimable" or "dirty" until GC says it emptied).
 * GC never invalidates marks while it runs, so the allocator keeps
 * working during a whole GC pass (the fix for bcache's GC stalls, §4.1).
 *
 * Policies (the superblock's cache_replacement): lru orders candidates
 * by (prio - min_prio + (32768 - min_prio) / 8) * sectors_used, least
 * recently hit and emptiest first; fifo walks a cursor; random picks at
 * random.
 *
 * Data placement: a few open buckets are appended to sequentially, clean
 * and dirty data apart (so a clean bucket can be evicted whole).  Each
 * allocation pins its bucket until the caller's data write and key insert
 * are done (alloc_put): a bucket is never invalidated under a write.
 *
 * Locking: alloc.lock protects everything here; it is a leaf lock (taken
 * inside tree_lock or journal.lock, never around them).  Refilling does
 * I/O (the prio write and its journal entry), so it runs under ckpt_lock
 * only, one thread at a time, like a checkpoint.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

/* ---- fifo ----------------------------------------------------------------- */

static int
fifo_init (struct fifo *f, size_t size)
{
  f->data = calloc (size ? size : 1, sizeof *f->data);
  f->size = size;
  f->front = f->nr = 0;
  return f->data ? 0 : -ENOMEM;
}

static bool fifo_full (const struct fifo *f) { return f->nr == f->size; }
static bool fifo_empty (const struct fifo *f) { return f->nr == 0; }

static void
fifo_push (struct fifo *f, uint64_t v)
{
  f->data[(f->front + f->nr++) % f->size] = v;
}

static uint64_t
fifo_pop (struct fifo *f)
{
  uint64_t v = f->data[f->front];
  f->front = (f->front + 1) % f->size;
  f->nr--;
  return v;
}

/* A bucket's prio is reset by cache hits without alloc.lock (the hit path
 * must not take a global lock), so every access to it is atomic; relaxed
 * order suffices, prio only steers eviction. */
static inline uint16_t
prio_get (const struct bucket *b)
{
  return __atomic_load_n (&b->prio, __ATOMIC_RELAXED);
}

static inline void
prio_set (struct bucket *b, uint16_t prio)
{
  __atomic_store_n (&b->prio, prio, __ATOMIC_RELAXED);
}

/* ---- setup ------------------------------------------------------------------ */

static uint64_t
prio_bucket_count (const struct bcf_cache *c)
{
  return bch_prio_buckets (c->alloc.nbuckets, c->bucket_bytes);
}

int
alloc_init (struct bcf_cache *c)
{
  struct alloc_state *a = &c->alloc;
  uint64_t nb = c->sb.nbuckets;
  size_t none = nb / 32 > 16 ? nb / 32 : 16;
  size_t sizes[RESERVE_NR];
  size_t total = 0;

  memset (a, 0, sizeof *a);
  pthread_mutex_init (&a->lock, NULL);
  pthread_cond_init (&a->wait, NULL);
  a->nbuckets = nb;
  if (prio_bucket_count (c) > sizeof a->prio_buckets / sizeof a->prio_buckets[0])
    return -EFBIG;
  a->buckets = calloc (nb, sizeof *a->buckets);
  if (!a->buckets)
    return -ENOMEM;
  for (uint64_t b = 0; b < nb; b++)
    prio_set (&a->buckets[b], BCH_INITIAL_PRIO);

  /* Reserves: a prio write needs a whole new chain; a checkpoint may
   * rewrite a few nodes per level; the rest is for data. */
  sizes[RESERVE_PRIO] = prio_bucket_count (c);
  sizes[RESERVE_BTREE] = 16;
  sizes[RESERVE_MOVINGGC] = 4;
  sizes[RESERVE_NONE] = none;
  for (int r = 0; r < RESERVE_NR; r++) {
    if (fifo_init (&a->free[r], sizes[r]) < 0)
      return -ENOMEM;
    total += sizes[r];
  }
  if (fifo_init (&a->free_inc, total) < 0)
    return -ENOMEM;
  for (int i = 0; i < NR_OPEN_BUCKETS; i++)
    a->open[i].bucket = UINT64_MAX;
  a->rand_state = 0x2545F4914F6CDD1Dull ^ (uint64_t) bcf_now_ns ();
  a->sectors_to_gc = nb * c->bucket_sectors / 16;
  a->rescale_sectors = nb * c->bucket_sectors / 1024;
  return 0;
}

void
alloc_free (struct bcf_cache *c)
{
  struct alloc_state *a = &c->alloc;

  for (int r = 0; r < RESERVE_NR; r++)
    free (a->free[r].data);
  free (a->free_inc.data);
  free (a->buckets);
  a->buckets = NULL;
  pthread_mutex_destroy (&a->lock);
  pthread_cond_destroy (&a->wait);
}

/* ---- helpers -------------------------------------------------------------- */


bool
ptr_stale (struct bcf_cache *c, uint64_t ptr)
{
  uint64_t b = bucket_of_ptr (c, ptr);
  uint8_t gen;

  if (b >= c->alloc.nbuckets)
    return true;
  gen = __atomic_load_n (&c->alloc.buckets[b].gen, __ATOMIC_ACQUIRE);
  return gen != PTR_GEN (ptr);
}

void
alloc_touch (struct bcf_cache *c, uint64_t bucket)
{
  if (bucket < c->alloc.nbuckets)
    prio_set (&c->alloc.buckets[bucket], BCH_INITIAL_PRIO);
}

static bool
can_invalidate (const struct bucket *b)
{
  return b->state == BUCKET_AVAILABLE && b->pin == 0 &&
         (b->mark == GC_MARK_FREE || b->mark == GC_MARK_RECLAIMABLE) &&
         (uint8_t) (b->gen - b->last_gc) < BUCKET_GC_GEN_MAX;
}

/* a->unpersisted += delta (+1 or -1).  Release, so that a new gen
 * published after it implies it. */
static void
add_unpersisted (struct alloc_state *a, int delta)
{
  atomic_fetch_add_explicit (&a->unpersisted,
                             (uint_fast64_t) (int64_t) delta,
                             memory_order_release);
}

/* Record that gen is persisted for b.  Under alloc.lock. */
static void
set_disk_gen (struct alloc_state *a, struct bucket *b, uint8_t gen)
{
  bool was = b->gen != b->disk_gen, is = b->gen != gen;

  b->disk_gen = gen;
  if (is != was)
    add_unpersisted (a, is ? 1 : -1);
}

bool
alloc_gens_unpersisted (struct bcf_cache *c)
{
  return atomic_load_explicit (&c->alloc.unpersisted,
                               memory_order_acquire) != 0;
}

static void
invalidate_one (struct alloc_state *a, uint64_t bi)
{
  struct bucket *b = &a->buckets[bi];
  uint8_t gen = (uint8_t) (b->gen + 1);

  /* Counted before the new gen is published (a FREE_INC bucket is never
   * invalidated again before its gen is persisted, so the new gen always
   * differs from disk_gen). */
  if (b->gen == b->disk_gen)
    add_unpersisted (a, 1);
  /* Release ordering: a reader that sees the new gen after reading the
   * data knows the data may be from the new owner (bcf_read_hit), and
   * sees the count above. */
  __atomic_store_n (&b->gen, gen, __ATOMIC_RELEASE);
  b->state = BUCKET_FREE_INC;
  b->mark = GC_MARK_FREE;
  b->sectors_used = 0;
  prio_set (b, BCH_INITIAL_PRIO);
  fifo_push (&a->free_inc, bi);
}

/* lru score: lower goes first. */
static uint64_t
lru_score (const struct bucket *b, unsigned min_prio)
{
  return ((uint64_t) (prio_get (b) - min_prio) + (32768u - min_prio) / 8) *
         (b->sectors_used + 1);
}

static int
cmp_u64_pair (const void *x, const void *y)
{
  const uint64_t *a = x, *b = y;
  return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* Choose up to want buckets by the policy and invalidate them.  Under
 * alloc.lock.  Returns how many. */
static size_t
invalidate_buckets (struct bcf_cache *c, size_t want)
{
  struct alloc_state *a = &c->alloc;
  size_t done = 0;

  switch (bch_sb_replacement (&c->sb)) {
  case BCH_REPLACEMENT_FIFO:
    for (uint64_t n = 0; n < a->nbuckets && done < want; n++) {
      uint64_t bi = a->fifo_cursor;
      a->fifo_cursor = (a->fifo_cursor + 1) % a->nbuckets;
      if (can_invalidate (&a->buckets[bi])) {
        invalidate_one (a, bi);
        done++;
      }
    }
    break;
  case BCH_REPLACEMENT_RANDOM:
    for (uint64_t n = 0; n < 2 * a->nbuckets && done < want; n++) {
      uint64_t bi;
      a->rand_state ^= a->rand_state << 13;
      a->rand_state ^= a->rand_state >> 7;
      a->rand_state ^= a->rand_state << 17;
      bi = a->rand_state % a->nbuckets;
      if (can_invalidate (&a->buckets[bi])) {
        invalidate_one (a, bi);
        done++;
      }
    }
    break;
  default: {                          /* lru */
    unsigned min_prio = 65535;
    uint64_t (*cand)[2];
    size_t n = 0;

    for (uint64_t bi = 0; bi < a->nbuckets; bi++)
      if (can_invalidate (&a->buckets[bi]) &&
          prio_get (&a->buckets[bi]) < min_prio)
        min_prio = prio_get (&a->buckets[bi]);
    cand = malloc (a->nbuckets * sizeof *cand);
    if (!cand)
      return 0;
    for (uint64_t bi = 0; bi < a->nbuckets; bi++)
      if (can_invalidate (&a->buckets[bi])) {
        cand[n][0] = lru_score (&a->buckets[bi], min_prio);
        cand[n][1] = bi;
        n++;
      }
    qsort (cand, n, sizeof *cand, cmp_u64_pair);
    for (size_t i = 0; i < n && done < want; i++) {
      invalidate_one (a, cand[i][1]);
      done++;
    }
    free (cand);
  }
  }
  return done;
}

/* Move buckets whose gen is persisted from free_inc to the free lists,
 * the prio reserve first.  Under alloc.lock. */
static void
free_inc_to_free_lists (struct alloc_state *a)
{
  size_t n = a->free_inc.nr;

  while (n--) {
    uint64_t bi = fifo_pop (&a->free_inc);
    struct bucket *b = &a->buckets[bi];
    bool placed = false;

    if (b->gen == b->disk_gen) {
      static const int order[] = { RESERVE_PRIO, RESERVE_BTREE,
                                   RESERVE_MOVINGGC, RESERVE_NONE };
      for (unsigned i = 0; i < 4 && !placed; i++)
        if (!fifo_full (&a->free[order[i]])) {
          fifo_push (&a->free[order[i]], bi);
          b->state = BUCKET_FREE;
          placed = true;
        }
    }
    if (!placed)
      fifo_push (&a->free_inc, bi);
  }
  pthread_cond_broadcast (&a->wait);
}

void
alloc_fill_from_unused (struct bcf_cache *c)
{
  struct alloc_state *a = &c->alloc;

  pthread_mutex_lock (&a->lock);
  for (uint64_t bi = 0; bi < a->nbuckets && !fifo_full (&a->free_inc); bi++) {
    struct bucket *b = &a->buckets[bi];
    if (b->state == BUCKET_AVAILABLE && b->mark == GC_MARK_FREE &&
        b->pin == 0)
      invalidate_one (a, bi);
  }
  /* Nothing on disk points at these buckets with their current gen (the
   * mark says so), so they may be used before the bumped gens are
   * persisted: treat the bump as persisted for the free lists, and the
   * next prio write records it. */
  for (size_t i = 0; i < a->free_inc.nr; i++) {
    uint64_t bi = a->free_inc.data[(a->free_inc.front + i) % a->free_inc.size];
    set_disk_gen (a, &a->buckets[bi], a->buckets[bi].gen);
  }
  free_inc_to_free_lists (a);
  pthread_mutex_unlock (&a->lock);
}

/* ---- allocation ------------------------------------------------------------ */

int
alloc_bucket_nowait (struct bcf_cache *c, enum alloc_reserve r,
                     uint64_t *bucket)
{
  struct alloc_state *a = &c->alloc;
  struct fifo *f = NULL;
  struct bucket *b;

  pthread_mutex_lock (&a->lock);
  if (!fifo_empty (&a->free[RESERVE_NONE]))
    f = &a->free[RESERVE_NONE];
  else if (r != RESERVE_NONE && !fifo_empty (&a->free[r]))
    f = &a->free[r];
  if (!f) {
    pthread_mutex_unlock (&a->lock);
    return -EAGAIN;
  }
  *bucket = fifo_pop (f);
  b = &a->buckets[*bucket];
  if (r == RESERVE_NONE) {
    b->state = BUCKET_OPEN;
    b->mark = GC_MARK_RECLAIMABLE;
    prio_set (b, BCH_INITIAL_PRIO);
  }
  else {
    b->state = BUCKET_IN_USE;
    b->mark = GC_MARK_METADATA;
    prio_set (b, BCH_BTREE_PRIO);
    atomic_fetch_add (&a->in_use_marks, 1);
  }
  b->sectors_used = (uint32_t) c->bucket_sectors;
  pthread_mutex_unlock (&a->lock);
  return 0;
}

void
alloc_release_meta (struct bcf_cache *c, uint64_t bucket)
{
  struct alloc_state *a = &c->alloc;

  if (bucket >= a->nbuckets)
    return;
  pthread_mutex_lock (&a->lock);
  a->buckets[bucket].state = BUCKET_AVAILABLE;
  a->buckets[bucket].mark = GC_MARK_FREE;
  a->buckets[bucket].sectors_used = 0;
  prio_set (&a->buckets[bucket], BCH_INITIAL_PRIO);
  pthread_mutex_unlock (&a->lock);
}

/* Are the free lists below the level the allocator thread keeps them at
 * (half full)?  Under alloc.lock. */
bool
alloc_lists_low (struct alloc_state *a)
{
  return a->free[RESERVE_NONE].nr < a->free[RESERVE_NONE].size / 2 ||
         a->free[RESERVE_BTREE].nr < a->free[RESERVE_BTREE].size / 2;
}

/* Refill the free lists.  Serialised by ckpt_lock (a refill ends with a
 * journal entry, like a checkpoint).  in_ckpt: called from inside a
 * checkpoint that ran short of btree buckets; then the journal's reserve
 * pays for the prio entry.  Otherwise, if the journal is too full to keep
 * that reserve, commit the btree first so the ring empties. */
static int
do_refill (struct bcf_cache *c, bool in_ckpt, bool background)
{
  struct alloc_state *a = &c->alloc;
  int r;

  if (!in_ckpt)
    pthread_mutex_lock (&c->ckpt_lock);
  pthread_mutex_lock (&a->lock);
  if (background && !alloc_lists_low (a)) {
    pthread_mutex_unlock (&a->lock);
    pthread_mutex_unlock (&c->ckpt_lock);
    return 1;
  }
  if (!background && !in_ckpt && !fifo_empty (&a->free[RESERVE_NONE]) &&
      a->free[RESERVE_BTREE].nr >= a->free[RESERVE_BTREE].size / 2) {
    /* Another thread refilled while we waited for the lock. */
    pthread_mutex_unlock (&a->lock);
    pthread_mutex_unlock (&c->ckpt_lock);
    return 0;
  }
  invalidate_buckets (c, a->free_inc.size - a->free_inc.nr);
  if (fifo_empty (&a->free_inc)) {
    pthread_mutex_unlock (&a->lock);
    if (!in_ckpt)
      pthread_mutex_unlock (&c->ckpt_lock);
    gc_request (c);
    return -ENOSPC;
  }
  pthread_mutex_unlock (&a->lock);

  r = alloc_prio_write_with_room (c, !in_ckpt);

  pthread_mutex_lock (&a->lock);
  if (r == 0)
    free_inc_to_free_lists (a);
  pthread_cond_broadcast (&a->wait);
  pthread_mutex_unlock (&a->lock);
  if (!in_ckpt)
    pthread_mutex_unlock (&c->ckpt_lock);
  return r;
}

int
alloc_refill (struct bcf_cache *c)
{
  return do_refill (c, false, false);
}

int
alloc_refill_ckpt_locked (struct bcf_cache *c)
{
  return do_refill (c, true, false);
}

int
alloc_refill_background (struct bcf_cache *c)
{
  return do_refill (c, false, true);
}

/* Count non-bypassed I/O for GC triggering and prio decay (bcache's
 * bch_rescale_priorities).  Under alloc.lock. */
static void
account_sectors (struct bcf_cache *c, uint32_t sectors)
{
  struct alloc_state *a = &c->alloc;

  if (a->sectors_to_gc <= sectors) {
    a->sectors_to_gc = a->nbuckets * c->bucket_sectors / 16;
    gc_request (c);
  }
  else
    a->sectors_to_gc -= sectors;

  if (a->rescale_sectors <= sectors) {
    a->rescale_sectors = a->nbuckets * c->bucket_sectors / 1024;
    for (uint64_t bi = 0; bi < a->nbuckets; bi++) {
      struct bucket *b = &a->buckets[bi];
      uint16_t prio = prio_get (b);
      if (b->mark != GC_MARK_METADATA && b->pin == 0 && prio)
        prio_set (b, (uint16_t) (prio - 1));
    }
  }
  else
    a->rescale_sectors -= sectors;
}

/* Close open bucket i: its data becomes evictable once unpinned. */
static void
close_open_bucket (struct alloc_state *a, int i)
{
  struct open_bucket *ob = &a->open[i];

  if (ob->bucket != UINT64_MAX) {
    struct bucket *b = &a->buckets[ob->bucket];
    b->state = BUCKET_AVAILABLE;
    b->mark = ob->dirty ? GC_MARK_DIRTY : GC_MARK_RECLAIMABLE;
  }
  ob->bucket = UINT64_MAX;
  ob->sectors_free = 0;
}

int
alloc_sectors (struct bcf_cache *c, uint32_t sectors, bool dirty,
               uint64_t *ptr)
{
  struct alloc_state *a = &c->alloc;
  const uint32_t block = c->block_bytes >> BCH_SECTOR_SHIFT;
  uint64_t t0 = 0;
  int r;

  sectors = (sectors + block - 1) / block * block;
  if (sectors == 0 || sectors > c->bucket_sectors)
    return -EINVAL;

  for (;;) {
    uint64_t bucket;

    pthread_mutex_lock (&a->lock);
    for (int i = 0; i < NR_OPEN_BUCKETS; i++) {
      struct open_bucket *ob = &a->open[i];
      if (ob->bucket != UINT64_MAX && ob->dirty == dirty &&
          ob->sectors_free >= sectors) {
        struct bucket *b = &a->buckets[ob->bucket];
        uint64_t off = ob->bucket * c->bucket_sectors +
                       (c->bucket_sectors - ob->sectors_free);
        *ptr = MAKE_PTR (b->gen, off, 0);
        ob->sectors_free -= sectors;
        b->pin++;
        if (ob->sectors_free < block)
          close_open_bucket (a, i);
        account_sectors (c, sectors);
        pthread_mutex_unlock (&a->lock);
        if (t0)
          bcf_time_record (c, &c->stats.alloc_wait, bcf_now_ns () - t0);
        return 0;
      }
    }
    pthread_mutex_unlock (&a->lock);

    /* Open a new bucket, replacing the least recently opened one. */
    r = alloc_bucket_nowait (c, RESERVE_NONE, &bucket);
    if (r == 0) {
      pthread_mutex_lock (&a->lock);
      int i = (int) (a->next_open++ % NR_OPEN_BUCKETS);
      close_open_bucket (a, i);
      a->open[i].bucket = bucket;
      a->open[i].sectors_free = (uint32_t) c->bucket_sectors;
      a->open[i].dirty = dirty;
      if (dirty) {
        a->buckets[bucket].mark = GC_MARK_DIRTY;
        atomic_fetch_add (&a->in_use_marks, 1);
      }
      pthread_mutex_unlock (&a->lock);
      continue;
    }
    if (!t0)
      t0 = bcf_now_ns ();
    atomic_fetch_add (&a->waiting, 1);
    r = alloc_refill (c);
    atomic_fetch_sub (&a->waiting, 1);
    if (r < 0)
      return r;
  }
}

/* Why: a bucket is closed (state available) as soon as its last sectors
 * are allocated, before the write that took them has inserted its keys.
 * A GC pass that starts then, or that had walked past the key's position
 * when it is inserted, computes the bucket's mark without the key and
 * would make a bucket holding dirty data reclaimable: its data, the only
 * copy of an acknowledged writeback write, would be reused (clean keys
 * only go stale, which is safe).  Marking at insert time closes both. */
void
alloc_mark_dirty (struct bcf_cache *c, uint64_t ptr)
{
  struct alloc_state *a = &c->alloc;
  uint64_t bi = bucket_of_ptr (c, ptr);

  if (!a->buckets || bi >= a->nbuckets)
    return;
  pthread_mutex_lock (&a->lock);
  if (a->buckets[bi].mark != GC_MARK_METADATA) {
    if (a->buckets[bi].mark != GC_MARK_DIRTY)
      atomic_fetch_add (&a->in_use_marks, 1);
    a->buckets[bi].mark = GC_MARK_DIRTY;
    a->buckets[bi].gc_flags |= BUCKET_DIRTIED;
  }
  pthread_mutex_unlock (&a->lock);
}

void
alloc_put (struct bcf_cache *c, uint64_t ptr)
{
  struct alloc_state *a = &c->alloc;
  uint64_t bi = bucket_of_ptr (c, ptr);

  if (bi >= a->nbuckets)
    return;
  pthread_mutex_lock (&a->lock);
  if (a->buckets[bi].pin)
    a->buckets[bi].pin--;
  pthread_mutex_unlock (&a->lock);
}

void
alloc_count (struct bcf_cache *c, uint64_t *nfree, uint64_t *clean,
             uint64_t *dirty, uint64_t *meta)
{
  struct alloc_state *a = &c->alloc;

  *nfree = *clean = *dirty = *meta = 0;
  pthread_mutex_lock (&a->lock);
  for (uint64_t bi = 0; bi < a->nbuckets; bi++) {
    const struct bucket *b = &a->buckets[bi];
    if (b->state == BUCKET_FREE || b->state == BUCKET_FREE_INC ||
        (b->state == BUCKET_AVAILABLE && b->mark == GC_MARK_FREE))
      (*nfree)++;
    else if (b->mark == GC_MARK_METADATA)
      (*meta)++;
    else if (b->mark == GC_MARK_DIRTY)
      (*dirty)++;
    else
      (*clean)++;
  }
  pthread_mutex_unlock (&a->lock);
}

/* ---- prio buckets ---------------------------------------------------------- */

int
alloc_prio_write (struct bcf_cache *c)
{
  struct alloc_state *a = &c->alloc;
  const uint64_t per = bch_prios_per_bucket (c->bucket_bytes);
  const uint64_t nprio = prio_bucket_count (c);
  uint64_t newchain[64], oldchain[64];
  unsigned nold;
  struct bch_bucket_disk *ent;
  uint8_t *buf;
  uint64_t seq, t0 = bcf_now_ns ();
  int r = 0;

  ent = malloc (a->nbuckets * sizeof *ent);
  buf = bcf_buf_alloc (c->bucket_bytes);
  if (!ent || !buf) {
    free (ent);
    if (buf)
      bcf_buf_free (buf, c->bucket_bytes);
    return -ENOMEM;
  }

  /* Take the new chain's buckets and snapshot gens and prios. */
  pthread_mutex_lock (&a->lock);
  for (uint64_t i = 0; i < nprio; i++) {
    /* Any free bucket will do (its gen is persisted): the prio reserve
     * first, then the others, as bcache's bch_bucket_alloc does. */
    static const int order[] = { RESERVE_PRIO, RESERVE_NONE,
                                 RESERVE_MOVINGGC, RESERVE_BTREE };
    struct fifo *f = NULL;

    for (unsigned k = 0; k < 4 && !f; k++)
      if (!fifo_empty (&a->free[order[k]]))
        f = &a->free[order[k]];
    if (!f) {
      bcf_log (c, BCF_LOG_DEBUG, "prio write: no free bucket (free_inc %zu, "
               "lists %zu/%zu/%zu/%zu)", a->free_inc.nr,
               a->free[0].nr, a->free[1].nr, a->free[2].nr, a->free[3].nr);
      /* Put back what we took: they stay free with persisted gens. */
      while (i--)
        fifo_push (&a->free[RESERVE_PRIO], newchain[i]);
      pthread_mutex_unlock (&a->lock);
      r = -ENOSPC;
      goto out;
    }
    newchain[i] = fifo_pop (f);
    a->buckets[newchain[i]].state = BUCKET_IN_USE;
    a->buckets[newchain[i]].mark = GC_MARK_METADATA;
    prio_set (&a->buckets[newchain[i]], BCH_BTREE_PRIO);
    atomic_fetch_add (&a->in_use_marks, 1);
  }
  for (uint64_t bi = 0; bi < a->nbuckets; bi++) {
    ent[bi].gen = a->buckets[bi].gen;
    ent[bi].prio = prio_get (&a->buckets[bi]);
  }
  seq = ++a->prio_seq;
  pthread_mutex_unlock (&a->lock);

  /* Last to first, so each records its successor (bcache's order). */
  for (uint64_t i = nprio; i-- > 0;) {
    struct bch_pset_hdr h = {
      .magic = bch_pset_magic (&c->sb),
      .seq = seq,
      .next_bucket = i + 1 < nprio ? newchain[i + 1] : 0,
    };
    uint64_t first = i * per;
    uint64_t n = first + per <= a->nbuckets ? per : a->nbuckets - first;

    bch_pset_encode (&h, ent + first, n, buf, c->bucket_bytes);
    r = bcf_io_pwrite (c->io, buf, c->bucket_bytes,
                       newchain[i] * c->bucket_bytes);
    if (r < 0)
      break;
  }

  /* Durable before they are published: every journal entry written from
   * then on names the new chain, and an ordinary entry (no data keys)
   * does not flush first (journal.c). */
  if (r == 0)
    r = bcf_io_flush (c->io);
  if (r == 0) {
    /* Publish the new chain, then commit it through the journal. */
    pthread_mutex_lock (&a->lock);
    nold = a->nprio;
    memcpy (oldchain, a->prio_buckets, nold * sizeof oldchain[0]);
    memcpy (a->prio_buckets, newchain, nprio * sizeof newchain[0]);
    a->nprio = (unsigned) nprio;
    pthread_mutex_unlock (&a->lock);

    if (c->test_prio_hook)
      c->test_prio_hook (c, c->test_prio_hook_opaque);
    r = journal_meta (c);
    if (r == 0) {
      pthread_mutex_lock (&a->lock);
      for (uint64_t bi = 0; bi < a->nbuckets; bi++)
        set_disk_gen (a, &a->buckets[bi], ent[bi].gen);
      pthread_mutex_unlock (&a->lock);
      for (unsigned i = 0; i < nold; i++)
        alloc_release_meta (c, oldchain[i]);
    }
  }
  if (r < 0) {
    bcf_log (c, BCF_LOG_ERROR, "writing prio buckets failed: %s",
             strerror (-r));
    c->failed = true;
  }
 out:
  if (r == 0)
    bcf_time_record (c, &c->stats.prio_write, bcf_now_ns () - t0);
  bcf_buf_free (buf, c->bucket_bytes);
  free (ent);
  return r;
}

int
alloc_prio_write_with_room (struct bcf_cache *c, bool may_checkpoint)
{
  int r;

  if (may_checkpoint && journal_tight (c) && (r = btree_checkpoint (c)) < 0)
    return r;
  return alloc_prio_write (c);
}

int
alloc_prio_read (struct bcf_cache *c, uint64_t head)
{
  struct alloc_state *a = &c->alloc;
  const uint64_t per = bch_prios_per_bucket (c->bucket_bytes);
  const uint64_t nprio = prio_bucket_count (c);
  uint64_t bucket = head;
  uint8_t *buf;
  int r = 0;

  buf = bcf_buf_alloc (c->bucket_bytes);
  if (!buf)
    return -ENOMEM;
  a->nprio = 0;
  for (uint64_t i = 0; i < nprio; i++) {
    struct bch_pset_hdr h;
    struct bch_diag d;
    uint64_t first = i * per;
    uint64_t n = first + per <= a->nbuckets ? per : a->nbuckets - first;

    if (bucket < c->sb.first_bucket || bucket >= a->nbuckets) {
      bcf_log (c, BCF_LOG_ERROR, "prio chain points at bucket %" PRIu64
               ", outside the cache", bucket);
      r = -EUCLEAN;
      break;
    }
    r = bcf_io_pread (c->io, buf, c->bucket_bytes, bucket * c->bucket_bytes);
    if (r < 0)
      break;
    if (bch_pset_decode (buf, c->bucket_bytes, bch_pset_magic (&c->sb), &h,
                         &d) != BCH_OK) {
      bcf_log (c, BCF_LOG_ERROR, "prio bucket %" PRIu64 ": %s", bucket,
               d.msg);
      r = -EUCLEAN;
      break;
    }
    /* One chain, written in one go: every bucket carries the head's seq,
     * and none appears twice (a cycle would load wrong gens). */
    for (unsigned k = 0; k < a->nprio; k++)
      if (a->prio_buckets[k] == bucket)
        h.seq = 0;
    if (i > 0 && h.seq != a->prio_seq) {
      bcf_log (c, BCF_LOG_ERROR, "prio bucket %" PRIu64 " does not belong to "
               "the chain (seq %" PRIu64 ", head has %" PRIu64 ", or seen "
               "twice)", bucket, h.seq, a->prio_seq);
      r = -EUCLEAN;
      break;
    }
    for (uint64_t j = 0; j < n; j++) {
      struct bch_bucket_disk e = bch_pset_entry (buf, j);
      struct bucket *b = &a->buckets[first + j];
      b->gen = b->disk_gen = b->last_gc = e.gen;
      prio_set (b, e.prio);
    }
    a->prio_buckets[a->nprio++] = bucket;
    if (i == 0)
      a->prio_seq = h.seq;
    bucket = h.next_bucket;
  }
  bcf_buf_free (buf, c->bucket_bytes);
  return r;
}
