/* bcachefilter engine: garbage collection (mark and sweep).
 *
 * Design
 * ------
 * bcache's GC (research/bcache.md §2.3) with the two stall fixes built in
 * from the start (§4.1, §4.2):
 *
 * - The allocator never waits for GC.  GC computes its marks into shadow
 *   arrays and applies them only when the pass ends; until then the
 *   allocator keeps using the previous marks, which are conservative
 *   (data only ever leaves a bucket between passes, never arrives in an
 *   AVAILABLE one).  This generalises bcache 6.10's reclaimable_in_gc: not
 *   only the buckets reclaimable at the start stay usable, the allocator
 *   simply never notices GC.
 *
 * - GC is incremental: it walks the leaves in key order in slices: 10
 *   nodes per slice while foreground requests are in flight, max(10,
 *   nodes / 128) when idle; between slices it sleeps 10 ms when someone
 *   waits for a bucket, else 100 ms (bcache 6.19).  bcf_gc_run (tests,
 *   tools) does not sleep.  A slice takes the btree lock for one leaf at
 *   a time (gc_next_leaf), so a request waits for one leaf's marking at
 *   most, not for a slice's: at 5M keys a busy slice of 10 leaves had
 *   held it up to 16 ms, and an idle slice is nodes / 128 leaves.
 *   (Marking a leaf without the lock, from a copy-on-write reference,
 *   was tried and reverted: stop 38 in docs/BENCHMARKS.md.)  "In flight"
 *   is c->inflight, which request.c's entry points count (bcf_inflight);
 *   a request that arrives during a slice is felt from the next one.
 *   Each hold of the lock is timed (gc_slice_locked) and each slice's
 *   size recorded (gc_slice_nodes_last/_max, gc_slices_busy), so the
 *   cost of GC can be seen from ctl stats.
 *
 * What a pass computes per bucket: the mark (free / clean / dirty /
 * metadata), sectors used, and the oldest gen still referenced (last_gc,
 * which the allocator's gen-wrap guard needs).  Keys whose pointer is
 * stale are removed from their leaf with a whiteout in the node's open set,
 * so the removal reaches the disk at the next checkpoint; until then the
 * stale gen still counts towards last_gc.
 *
 * Applying the marks: only to buckets that were AVAILABLE when the pass
 * started and still are, with the same gen.  A bucket opened, filled,
 * invalidated or allocated as metadata during the pass keeps the marks
 * the allocator gave it — GC may not have seen its newest keys.
 *
 * Coalescing: before marking a leaf, GC merges it with its right sibling
 * when both fit in 2/3 of a node (btree_coalesce_locked; bcache merges up
 * to four).  Moving GC, which bcache leaves off by default, is
 * movinggc.c's: the writeback thread runs it between its batches.
 *
 * Locking: gc.lock protects the request flag and the shadow arrays; each
 * leaf of a slice is walked under tree_lock for writing (the slice's size
 * is read under it for reading); marks are applied under alloc.lock.
 * The in-flight count (bcf_inflight_enter / _leave, here because the
 * slice rule is its reader) is relaxed atomics, one shard per thread;
 * the slice stats are atomics, the lock-hold times go under
 * stats.time_lock.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define GC_NODES_MIN     10
#define GC_IDLE_DIV      128
#define GC_SLEEP_WAIT_MS 10
#define GC_SLEEP_MS      100

enum { GC_AVAILABLE_AT_START = 1 };

struct gc_pass {
  uint8_t *start_gen;
  uint8_t *mark;
  uint8_t *oldest;
  uint32_t *used;
  uint64_t nodes;
};

int
gc_init (struct bcf_cache *c)
{
  struct gc_state *g = &c->gc;

  memset (g, 0, sizeof *g);
  g->nodes_min = GC_NODES_MIN;
  g->idle_div = GC_IDLE_DIV;
  pthread_mutex_init (&g->lock, NULL);
  pthread_cond_init (&g->wake, NULL);
  return 0;
}

void
gc_free (struct bcf_cache *c)
{
  pthread_mutex_destroy (&c->gc.lock);
  pthread_cond_destroy (&c->gc.wake);
}

void
gc_request (struct bcf_cache *c)
{
  pthread_mutex_lock (&c->gc.lock);
  c->gc.requested = true;
  pthread_cond_broadcast (&c->gc.wake);
  pthread_mutex_unlock (&c->gc.lock);
}

static void
pass_free (struct gc_pass *p)
{
  free (p->start_gen);
  free (p->mark);
  free (p->oldest);
  free (p->used);
}

static int
pass_start (struct bcf_cache *c, struct gc_pass *p)
{
  struct alloc_state *a = &c->alloc;
  uint64_t nb = a->nbuckets;

  memset (p, 0, sizeof *p);
  p->start_gen = malloc (nb);
  p->mark = calloc (nb, 1);
  p->oldest = malloc (nb);
  p->used = calloc (nb, sizeof *p->used);
  if (!p->start_gen || !p->mark || !p->oldest || !p->used) {
    pass_free (p);
    return -ENOMEM;
  }
  pthread_mutex_lock (&a->lock);
  for (uint64_t b = 0; b < nb; b++) {
    p->start_gen[b] = a->buckets[b].gen;
    p->oldest[b] = a->buckets[b].gen;
    a->buckets[b].gc_flags &= (uint8_t) ~BUCKET_DIRTIED;
    if (a->buckets[b].state == BUCKET_AVAILABLE)
      a->buckets[b].gc_flags |= GC_AVAILABLE_AT_START;
    else
      a->buckets[b].gc_flags &= (uint8_t) ~GC_AVAILABLE_AT_START;
  }
  pthread_mutex_unlock (&a->lock);
  return 0;
}

/* Note a pointer into bucket b carrying gen: keep the oldest gen seen
 * (oldest starts at the bucket's gen; a stale pointer is behind it). */
static void
note_gen (struct gc_pass *p, uint64_t b, uint8_t gen)
{
  uint8_t behind = (uint8_t) (p->oldest[b] - gen);

  if (behind > 0 && behind < 128)
    p->oldest[b] = gen;
}

static void
mark_bucket (struct gc_pass *p, uint64_t b, uint8_t mark, uint64_t sectors)
{
  if (mark > p->mark[b])
    p->mark[b] = mark;
  p->used[b] += (uint32_t) sectors;
}

/* The whiteouts of a leaf's stale keys, in key order (gc_leaf). */
struct stale_keys {
  struct ckey *w;
  size_t n, cap, next;
  struct bcf_cache *c;
};

/* Mark k's bucket, or, if its pointer is stale, add k's whiteout to st. */
static int
gc_key (struct bcf_cache *c, struct gc_pass *p, const struct ckey *k,
        struct stale_keys *st)
{
  uint64_t b;

  if (!ckey_has_ptr (k) || ckey_is_check (k))
    return 0;
  b = bucket_of_ptr (c, k->ptr);
  if (b >= c->alloc.nbuckets)
    return 0;
  note_gen (p, b, PTR_GEN (k->ptr));
  if (!ptr_stale (c, k->ptr)) {
    mark_bucket (p, b, ckey_dirty (k) ? GC_MARK_DIRTY : GC_MARK_RECLAIMABLE,
                 ckey_size (k));
    return 0;
  }
  if (st->n == st->cap) {
    size_t cap = st->cap ? 2 * st->cap : 64;
    struct ckey *w = realloc (st->w, cap * sizeof *w);

    if (!w)
      return -ENOMEM;
    st->w = w;
    st->cap = cap;
  }
  st->w[st->n++] = ckey_make (ckey_inode (k), ckey_end (k), ckey_size (k),
                              false, 0, false);
  return 0;
}

/* keyset_remove_if's rule: drop exactly the keys gc_leaf found stale,
 * those whose range is the next whiteout's (the walk sees the same keys
 * in the same order: tree_lock is held throughout, and a gen that moved
 * meanwhile does not change the list; keys of a leaf never overlap). */
static int
drop_stale (const struct ckey *k, void *arg)
{
  struct stale_keys *st = arg;
  struct bcf_cache *c = st->c;

  if (st->next >= st->n || ckey_cmp (k, &st->w[st->next]) != 0 ||
      ckey_size (k) != ckey_size (&st->w[st->next]))
    return 0;
  st->next++;
  /* A bucket holding a key that is dirty in memory is never invalidated
   * (its mark stays dirty until a pass sees every key in it clean), so a
   * stale dirty key can only be one that a journal replay brought back
   * after its data was written back and marked clean (clean marks are
   * not journalled) and its bucket reused: nothing is lost by dropping
   * it. */
  if (ckey_dirty (k)) {
    bcf_log (c, BCF_LOG_DEBUG, "GC: dropping dirty extent [%" PRIu64
             ", +%" PRIu64 ") of a reused bucket %" PRIu64 " (written "
             "back before a crash lost its clean mark)",
             ckey_start (k), ckey_size (k), bucket_of_ptr (c, k->ptr));
    __atomic_sub_fetch (&c->tree.dirty_sectors, ckey_size (k),
                        __ATOMIC_RELAXED);
  }
  c->tree.nkeys--;
  return 1;
}

/* Mark one leaf and drop its stale keys: a whiteout for each goes into
 * the node's open set, so the removal reaches the disk at the next
 * checkpoint, and the keys leave the leaf.
 *
 * Both in one pass over each set (keyset_insert_batch, keyset_remove_if).
 * One keyset_insert per stale key, into the open set and into the leaf,
 * moved up to half of each set every time: a pass over leaves whose
 * buckets the allocator had reclaimed held the tree lock 3-13 ms per
 * slice in a 256 MiB cache, 0.6-1.5 ms this way (and every lookup
 * waits for a slice).  The whiteouts go in first: should that fail, the
 * leaf keeps its stale keys (harmless: a stale pointer is never served)
 * for the next pass, where removing them from memory first could have
 * let last_gc pass a gen still on disk.  Under tree_lock (write). */
static int
gc_leaf (struct bcf_cache *c, struct gc_pass *p, struct btree_node *n)
{
  struct stale_keys st = { .c = c };
  int r = 0;

  for (size_t i = 0; i < n->keys.nr && r == 0; i++)
    r = gc_key (c, p, &n->keys.k[i], &st);
  if (r == 0 && st.n > 0 &&
      (r = keyset_insert_batch (&n->open, st.w, st.n)) == 0)
    r = keyset_remove_if (&n->keys, drop_stale, &st);
  free (st.w);
  return r;
}

/* Apply the pass's marks.  Under alloc.lock. */
static void
pass_finish (struct bcf_cache *c, struct gc_pass *p)
{
  struct alloc_state *a = &c->alloc;

  pthread_mutex_lock (&a->lock);
  for (uint64_t b = 0; b < a->nbuckets; b++) {
    struct bucket *bk = &a->buckets[b];
    if (!(bk->gc_flags & GC_AVAILABLE_AT_START))
      continue;
    bk->gc_flags &= (uint8_t) ~GC_AVAILABLE_AT_START;
    if (bk->state != BUCKET_AVAILABLE || bk->gen != p->start_gen[b])
      continue;
    if (bk->mark == GC_MARK_METADATA)
      continue;                 /* released metadata is marked free already */
    if ((bk->gc_flags & BUCKET_DIRTIED) && p->mark[b] != GC_MARK_DIRTY)
      continue;                 /* a dirty key came in behind the pass */
    bk->mark = p->mark[b];
    bk->sectors_used = p->used[b] < c->bucket_sectors ?
                       p->used[b] : (uint32_t) c->bucket_sectors;
    bk->last_gc = p->oldest[b];
  }
  pthread_cond_broadcast (&a->wait);
  pthread_mutex_unlock (&a->lock);
}

/* The in-flight count.  A thread keeps one shard, chosen round robin the
 * first time it enters; a request leaves the shard it entered. */
static atomic_uint next_shard;
static __thread unsigned my_shard = UINT_MAX;

struct bcf_inflight *
bcf_inflight_enter (struct bcf_cache *c)
{
  struct bcf_inflight *t;

  if (my_shard == UINT_MAX)
    my_shard = atomic_fetch_add (&next_shard, 1) % BCF_INFLIGHT_SHARDS;
  t = &c->inflight[my_shard];
  atomic_fetch_add_explicit (&t->n, 1, memory_order_relaxed);
  atomic_fetch_add_explicit (&t->entered, 1, memory_order_relaxed);
  return t;
}

uint64_t
bcf_cache_requests (struct bcf_cache *c)
{
  uint64_t n = 0;

  for (unsigned i = 0; i < BCF_INFLIGHT_SHARDS; i++)
    n += atomic_load_explicit (&c->inflight[i].entered, memory_order_relaxed);
  return n;
}

void
bcf_inflight_leave (struct bcf_inflight *t)
{
  atomic_fetch_sub_explicit (&t->n, 1, memory_order_relaxed);
}

/* The slice rule: how many nodes the next slice may walk.  *busy: cut to
 * the minimum because foreground requests are in flight (request.c
 * counts them into c->inflight). */
static unsigned
slice_budget (struct bcf_cache *c, bool *busy)
{
  const struct gc_state *g = &c->gc;
  uint64_t idle = g->idle_div ? c->tree.nnodes / g->idle_div : 0;

  *busy = bcf_inflight (c) > 0;
  if (*busy || idle < g->nodes_min)
    return g->nodes_min;
  return idle > UINT_MAX ? UINT_MAX : (unsigned) idle;
}

/* Record what a slice walked. */
static void
note_slice (struct bcf_cache *c, uint64_t nodes, bool busy)
{
  uint64_t max = atomic_load (&c->stats.gc_slice_nodes_max);

  atomic_store (&c->stats.gc_slice_nodes_last, nodes);
  while (nodes > max &&
         !atomic_compare_exchange_weak (&c->stats.gc_slice_nodes_max, &max,
                                        nodes))
    ;
  if (busy)
    atomic_fetch_add (&c->stats.gc_slices_busy, 1);
}

/* One step of a slice: the leaf holding (*inode, *pos + 1) is coalesced
 * with its right sibling if both are sparse, marked and rid of its stale
 * keys, and the cursor moves past it (*done after the last leaf).  If
 * the leaf is evicted, it is read back instead and the cursor stays.
 * Takes tree_lock for writing and releases it before returning: a slice
 * holds it for one leaf at a time, so a lookup or an insert that arrives
 * during a slice waits for one leaf's marking (gc_slice_locked times
 * each hold), not for the whole slice.  Nothing carries over between
 * the holds but the cursor, as between slices. */
static int
gc_next_leaf (struct bcf_cache *c, struct gc_pass *p, uint64_t *inode,
              uint64_t *pos, bool *done)
{
  struct btree_node *n;
  int r;

  tree_wrlock_timing (c, NULL);
  n = btree_find_leaf (c, *inode, *pos + 1);
  if (!n) {
    tree_wrunlock_into (c, &c->stats.gc_slice_locked);
    return -EIO;
  }
  if (n->evicted) {
    /* Marking needs the keys: read the leaf back (no lock held). */
    struct ckey need = n->key;
    tree_wrunlock_into (c, &c->stats.gc_slice_locked);
    return btree_load_evicted (c, &need);
  }
  /* Sparse neighbours become one node before marking, so each key is
   * marked once. */
  r = btree_coalesce_locked (c, n);
  if (r > 0) {
    atomic_fetch_add (&c->stats.gc_coalesced, 1);
    n = btree_find_leaf (c, *inode, *pos + 1);
    r = n ? 0 : -EIO;
  }
  if (r == 0)
    r = gc_leaf (c, p, n);
  if (r == 0) {
    p->nodes++;
    if (ckey_inode (&n->key) == BKEY_MAX_INODE &&
        ckey_end (&n->key) == BKEY_MAX_OFFSET)
      *done = true;
    else {
      *inode = ckey_inode (&n->key);
      *pos = ckey_end (&n->key);
    }
  }
  tree_wrunlock_into (c, &c->stats.gc_slice_locked);
  return r;
}

/* Run a pass.  With pace, sleep between slices as described above. */
static int
gc_pass (struct bcf_cache *c, bool pace)
{
  struct gc_pass p;
  uint64_t inode = 0, pos = 0, t0 = bcf_now_ns ();
  unsigned slice = 0;
  bool done = false;
  int r;

  if ((r = pass_start (c, &p)) < 0)
    return r;
  pthread_mutex_lock (&c->gc.lock);
  c->gc.running = true;
  c->gc.requested = false;
  pthread_mutex_unlock (&c->gc.lock);

  while (!done && r == 0) {
    uint64_t nodes0 = p.nodes;
    unsigned budget;
    bool busy;

    pthread_rwlock_rdlock (&c->tree_lock);      /* tree.nnodes */
    budget = slice_budget (c, &busy);
    pthread_rwlock_unlock (&c->tree_lock);
    for (unsigned k = 0; k < budget && !done && r == 0; k++)
      r = gc_next_leaf (c, &p, &inode, &pos, &done);
    atomic_fetch_add (&c->stats.gc_slices, 1);
    note_slice (c, p.nodes - nodes0, busy);
    if (c->gc.slice_hook)
      c->gc.slice_hook (c, slice, c->gc.slice_hook_opaque);
    slice++;
    if (pace && !done)
      bcf_sleep_ms (atomic_load (&c->alloc.waiting) ? GC_SLEEP_WAIT_MS
                : GC_SLEEP_MS);
  }

  /* Metadata the walk of the leaves does not see: every node, the
   * journal, prio and uuid buckets are IN_USE and keep their marks. */
  if (r == 0)
    pass_finish (c, &p);
  atomic_fetch_add (&c->stats.gc_nodes, p.nodes);
  atomic_fetch_add (&c->stats.gc_passes, 1);
  bcf_time_record (c, &c->stats.gc, bcf_now_ns () - t0);
  pass_free (&p);
  pthread_mutex_lock (&c->gc.lock);
  c->gc.running = false;
  pthread_cond_broadcast (&c->gc.wake);
  pthread_mutex_unlock (&c->gc.lock);
  return r;
}

int
bcf_gc_run (struct bcf_cache *c)
{
  return gc_pass (c, false);
}

uint64_t
bcf_gc_passes (struct bcf_cache *c)
{
  return atomic_load (&c->stats.gc_passes);
}

void
bcf_trigger_gc (struct bcf_cache *c)
{
  gc_request (c);
}

/* The GC thread: one pass per request. */
void *gc_thread (void *arg);
void *
gc_thread (void *arg)
{
  struct bcf_cache *c = arg;

  for (;;) {
    pthread_mutex_lock (&c->gc.lock);
    while (!c->gc.requested && !c->stopping)
      pthread_cond_wait (&c->gc.wake, &c->gc.lock);
    pthread_mutex_unlock (&c->gc.lock);
    if (c->stopping)
      break;
    gc_pass (c, true);
  }
  bcf_io_thread_cleanup ();
  return NULL;
}
