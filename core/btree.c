/* bcachefilter engine: the btree of extents.
 *
 * Design
 * ------
 * bcache's btree (research/bcache.md §1.5, §2.2): leaves hold extents,
 * interior nodes hold one pointer key per child (offset = the child's
 * greatest key), one node per bucket, each node on disk a log of bsets
 * whose checksums are seeded by the node's pointer.
 *
 * In memory every node has a merged, sorted key set (what lookups read)
 * and an open set: what changed since the node was last written (which
 * also tells bcf_invalidate which keys nothing on disk holds yet).  A leaf
 * never holds an extent crossing its range (previous key, key]: inserts
 * are cut at node boundaries, so every leaf is self-contained.
 *
 * Writing (the checkpoint, btree_checkpoint):
 *   1. under tree_lock (write), with no I/O: split nodes that outgrew a
 *      node, pick for each dirty node what to write — its open set as a
 *      new bset appended at `written`, or the whole node into a new bucket
 *      when it is new or its log is full (copy on write; the parent gets
 *      the new pointer) — and capture those keys: an open set is taken
 *      whole, a node's merged keys are shared copy-on-write
 *      (keyset_share), and the bset's size comes from the set's word
 *      count, so this step is O(nodes), never O(keys) (DESIGN.md I5: the
 *      lock is held for about 1 ms at 1M keys); seal the open journal
 *      entry (keys journalled from now on are not in this snapshot);
 *      and note how many export changes the captured keys may rely on;
 *   2. without locks: encode and checksum the captured keys, flush the
 *      export if any of those changes is not flushed yet (the export
 *      barrier, cache.c: a clean key says the export has the data
 *      durably), flush the device (data before the keys that point at
 *      it), write the buffers, flush (children before parents);
 *   3. write the sealed entry, if it is not yet, as any other (the old
 *      root); then a journal entry carrying the new root and last_seq =
 *      the sealed entry + 1, and wait for it: from then on recovery
 *      starts from this tree and replays only newer entries.  The
 *      commit is never the sealed entry itself: an entry must need
 *      itself (last_seq <= seq, as the kernel requires), so that would
 *      replay keys the snapshot holds, and replaying a dirty key over
 *      the clean copy a writeback or a write's mark-clean put in the
 *      tree since makes it dirty again (every clean close would leave
 *      dirty data to write back at the next start);
 *   4. free the buckets of nodes that the committed root no longer
 *      reaches.
 * A node freed (split, relocated) is still reachable from the last
 * committed root, so its bucket is released only when a checkpoint whose
 * snapshot was taken after the free has committed (the epoch rule: each
 * dead bucket records the snapshot epoch current when it died).
 *
 * This is bcache's journal reclaim + btree write path folded into one
 * step: every write of a node is followed by a flush before anything that
 * depends on it, so a lost (unflushed) write can only lose the newest
 * bset of a node whose keys the journal still holds.
 *
 * Crash argument for replace inserts (not journalled, like bcache): a
 * fill's data is written before its key is inserted, and every later
 * change of the backing store journals an invalidation of the range
 * wherever recovery could bring a key back there (bcf_invalidate says
 * where that is); the journal is replayed in order on top of whatever
 * bsets reached the disk, so a clean key that survives recovery has no
 * journalled change after it and still equals the backing store (I2);
 * and the export barrier (step 2) sees to it that the backing store has
 * that data durably before any checkpoint makes the key durable.
 *
 * Locking: everything here runs under tree_lock (see engine.h), except
 * the I/O phase of the checkpoint, which works on private buffers.  Node
 * structs are freed only under tree_lock held for writing.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

/* ---- node hash ------------------------------------------------------------- */

static size_t
hash_slot (const struct btree *t, uint64_t bucket)
{
  return (bucket * 0x9E3779B97F4A7C15ull >> 20) % t->hash_size;
}

static void
hash_add (struct btree *t, struct btree_node *n, uint64_t bucket)
{
  size_t s = hash_slot (t, bucket);
  n->hash_next = t->hash[s];
  t->hash[s] = n;
}

static void
hash_del (struct btree *t, struct btree_node *n, uint64_t bucket)
{
  struct btree_node **p = &t->hash[hash_slot (t, bucket)];
  while (*p && *p != n)
    p = &(*p)->hash_next;
  if (*p)
    *p = n->hash_next;
}

static uint64_t
node_bucket (const struct bcf_cache *c, const struct btree_node *n)
{
  return bucket_of_ptr (c, n->key.ptr);
}

/* The child node a pointer key names (NULL if not in memory). */
static struct btree_node *
hash_find (struct bcf_cache *c, const struct ckey *k)
{
  struct btree *t = &c->tree;
  uint64_t b = bucket_of_ptr (c, k->ptr);

  for (struct btree_node *n = t->hash[hash_slot (t, b)]; n; n = n->hash_next)
    if (n->key.ptr == k->ptr)
      return n;
  return NULL;
}

struct btree_node *
btree_child (struct bcf_cache *c, const struct ckey *k)
{
  return hash_find (c, k);
}

/* ---- nodes ------------------------------------------------------------------ */

static uint64_t
random_seq (void)
{
  static _Atomic uint64_t counter;
  uint64_t x = bcf_now_ns () ^ (atomic_fetch_add (&counter, 1) << 48);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x ? x : 1;
}

static struct btree_node *
node_new (struct bcf_cache *c, unsigned level, uint64_t bucket,
          const struct ckey *range)
{
  struct btree_node *n = calloc (1, sizeof *n);
  uint8_t gen;

  if (!n)
    return NULL;
  n->level = level;
  keyset_init (&n->keys, false);
  keyset_init (&n->open, level == 0);
  gen = c->alloc.buckets[bucket].gen;
  n->key = ckey_make (ckey_inode (range), ckey_end (range),
                      c->tree.node_bytes >> BCH_SECTOR_SHIFT, true,
                      bucket_ptr (c, bucket, gen), false);
  n->seq = random_seq ();
  n->rewrite = true;
  hash_add (&c->tree, n, bucket);
  c->tree.nnodes++;
  return n;
}

static void
node_free (struct bcf_cache *c, struct btree_node *n)
{
  hash_del (&c->tree, n, node_bucket (c, n));
  keyset_free (&n->keys);
  keyset_free (&n->open);
  keyset_free (&n->dcopies);
  free (n);
  c->tree.nnodes--;
}

static int
dead_add (struct bcf_cache *c, uint64_t bucket)
{
  struct btree *t = &c->tree;

  if (t->ndead == t->dead_cap) {
    size_t cap = t->dead_cap ? t->dead_cap * 2 : 16;
    void *p = realloc (t->dead, cap * sizeof *t->dead);
    if (!p)
      return -ENOMEM;
    t->dead = p;
    t->dead_cap = cap;
  }
  t->dead[t->ndead].bucket = bucket;
  t->dead[t->ndead].epoch = t->epoch;
  t->ndead++;
  return 0;
}

/* ---- setup ------------------------------------------------------------------ */

int
btree_init (struct bcf_cache *c)
{
  struct btree *t = &c->tree;

  memset (t, 0, sizeof *t);
  t->node_bytes = bch_btree_node_bytes (c->bucket_sectors);
  /* A leaf is split when its merged keys would fill more than 4/5 of a
   * node written as one bset (bcache's rule). */
  t->max_leaf_keys = (t->node_bytes - BCH_BSET_HEADER_SIZE) /
                     sizeof (struct ckey) * 4 / 5;
  t->hash_size = 4096;
  t->hash = calloc (t->hash_size, sizeof *t->hash);
  return t->hash ? 0 : -ENOMEM;
}

static void
free_subtree (struct bcf_cache *c, struct btree_node *n)
{
  if (n->level > 0)
    for (size_t i = 0; i < n->keys.nr; i++) {
      struct btree_node *ch = hash_find (c, &n->keys.k[i]);
      if (ch)
        free_subtree (c, ch);
    }
  node_free (c, n);
}

void
btree_free (struct bcf_cache *c)
{
  struct btree *t = &c->tree;

  if (t->root)
    free_subtree (c, t->root);
  t->root = NULL;
  free (t->hash);
  free (t->dead);
  t->hash = NULL;
  t->dead = NULL;
}

bool
btree_has_uncaptured (struct bcf_cache *c)
{
  bool r;

  pthread_rwlock_rdlock (&c->tree_lock);
  r = c->tree.leaf_inserts != c->tree.leaf_inserts_captured;
  pthread_rwlock_unlock (&c->tree_lock);
  return r;
}

int
btree_new_root (struct bcf_cache *c)
{
  struct ckey max;
  uint64_t bucket;
  int r;

  r = alloc_bucket_nowait (c, RESERVE_BTREE, &bucket);
  if (r < 0)
    return r;
  max = ckey_make (BKEY_MAX_INODE, BKEY_MAX_OFFSET, 0, false, 0, false);
  c->tree.root = node_new (c, 0, bucket, &max);
  return c->tree.root ? 0 : -ENOMEM;
}

/* ---- lookup ------------------------------------------------------------------ */

/* Index of the child whose range (previous key, key] holds position
 * (inode, pos). */
static size_t
child_index (const struct keyset *s, uint64_t inode, uint64_t pos)
{
  size_t i = keyset_search (s, inode, pos);
  if (i > 0 && ckey_cmp_pos (&s->k[i - 1], inode, pos) == 0)
    i--;
  return i;
}

struct btree_node *
btree_find_leaf (struct bcf_cache *c, uint64_t inode, uint64_t pos)
{
  struct btree_node *n = c->tree.root;

  while (n && n->level > 0) {
    size_t i = child_index (&n->keys, inode, pos);
    if (i >= n->keys.nr)
      i = n->keys.nr - 1;     /* the root's key is MAX_KEY: cannot happen */
    n = hash_find (c, &n->keys.k[i]);
  }
  return n;
}

/* The parent of n (NULL for the root). */
static struct btree_node *
find_parent (struct bcf_cache *c, struct btree_node *n)
{
  struct btree_node *p = c->tree.root;

  if (p == n)
    return NULL;
  while (p && p->level > n->level + 1) {
    size_t i = child_index (&p->keys, ckey_inode (&n->key), ckey_end (&n->key));
    p = i < p->keys.nr ? hash_find (c, &p->keys.k[i]) : NULL;
  }
  return p;
}

/* ---- insert ------------------------------------------------------------------ */

static int relocate_node (struct bcf_cache *c, struct btree_node *n);

/* Record a new or moved child pointer in interior node p, which is then
 * written whole into a new bucket (copy on write, up to the root), never
 * as a bset appended to its log.  Our loader would let a later key at the
 * same position win, but the kernel keeps every pointer of an interior
 * node that is not stale by its bucket's gen, and a superseded child's
 * bucket keeps its gen until it is reused: its GC walks such a pointer
 * and coalesces the old child with the new ones, bringing old extents
 * back into its tree (tests/kernel's crash case showed it, after the
 * kernel replayed our journal).  bcache's own interior updates leave no
 * such pointer either: they bump the old bucket's gen at once. */
static int
interior_update (struct bcf_cache *c, struct btree_node *p,
                 const struct ckey *k)
{
  int r;

  if (!p->rewrite && (r = relocate_node (c, p)) < 0)
    return r;
  r = keyset_put (&p->open, k);
  return r < 0 ? r : keyset_put (&p->keys, k);
}

static size_t
btree_free_buckets (struct bcf_cache *c)
{
  struct alloc_state *a = &c->alloc;
  size_t n;

  pthread_mutex_lock (&a->lock);
  n = a->free[RESERVE_BTREE].nr + a->free[RESERVE_NONE].nr;
  pthread_mutex_unlock (&a->lock);
  return n;
}

/* A leaf made from others (split, merge) keeps their open sets' keys in
 * its own open set, with open_jdata and removal_seq: it is written whole
 * (rewrite), so its open set serves only to tell which keys nothing on
 * disk holds yet (cache.c's key_only_in_memory), and those keys are still
 * only in memory.  Without this every split would make its keys look
 * persistent until the next checkpoint.  side < 0 takes the part of
 * from's open set before position mid, side > 0 the part after it,
 * side == 0 all of it; clip_to_side cuts one key to its side (false:
 * nothing of it is there). */
static bool
clip_to_side (struct ckey *k, const struct ckey *mid, int side)
{
  const uint64_t m = ckey_end (mid);

  if (ckey_inode (k) != ckey_inode (mid))
    return (ckey_inode (k) < ckey_inode (mid)) == (side < 0);
  if (side < 0 ? ckey_start (k) >= m : ckey_end (k) <= m)
    return false;                         /* wholly on the other side */
  if (side < 0 && ckey_end (k) > m)
    ckey_cut_back (k, ckey_end (k) - m);
  if (side > 0 && ckey_start (k) < m)
    ckey_cut_front (k, m - ckey_start (k));
  return true;
}

/* Append from's keys on the side's part to to. */
static int
inherit_keys (struct keyset *to, const struct keyset *from,
              const struct ckey *mid, int side)
{
  for (size_t i = 0; i < from->nr; i++) {
    struct ckey k = from->k[i];
    int r;

    if (side != 0 && !clip_to_side (&k, mid, side))
      continue;
    if ((r = keyset_append (to, &k)) < 0)
      return r;
  }
  return 0;
}

static int
inherit_open (struct btree_node *to, const struct btree_node *from,
              const struct ckey *mid, int side)
{
  int r;

  if ((r = inherit_keys (&to->open, &from->open, mid, side)) < 0 ||
      (r = inherit_keys (&to->dcopies, &from->dcopies, mid, side)) < 0)
    return r;
  if (from->open_jdata)
    to->open_jdata = true;
  if (from->removal_seq > to->removal_seq)
    to->removal_seq = from->removal_seq;
  return 0;
}

/* Split node n in two (and its ancestors as needed).  Returns 0, or
 * -EAGAIN when there are not enough free buckets now. */
static int
split_node (struct bcf_cache *c, struct btree_node *n)
{
  struct btree *t = &c->tree;
  struct btree_node *parent = find_parent (c, n), *n1, *n2;
  uint64_t b1, b2, b3 = 0;
  size_t m = n->keys.nr / 2;
  struct ckey k1;
  uint64_t t0 = bcf_now_ns ();
  unsigned depth = t->root->level + 1;
  int r;

  if (n->keys.nr < 2)
    return 0;
  /* Worst case: every level splits and the root grows. */
  if (btree_free_buckets (c) < 2 * depth + 1)
    return -EAGAIN;
  if (alloc_bucket_nowait (c, RESERVE_BTREE, &b1) < 0 ||
      alloc_bucket_nowait (c, RESERVE_BTREE, &b2) < 0 ||
      (!parent && alloc_bucket_nowait (c, RESERVE_BTREE, &b3) < 0))
    return -EAGAIN;           /* cannot happen after the count above */

  /* n1 takes the lower half; its range ends at its last key. */
  k1 = ckey_make (ckey_inode (&n->keys.k[m - 1]), ckey_end (&n->keys.k[m - 1]),
                  0, false, 0, false);
  n1 = node_new (c, n->level, b1, &k1);
  n2 = node_new (c, n->level, b2, &n->key);
  if (!n1 || !n2)
    return -ENOMEM;
  for (size_t i = 0; i < n->keys.nr; i++)
    if ((r = keyset_append (i < m ? &n1->keys : &n2->keys, &n->keys.k[i])) < 0)
      return r;
  if (n->level == 0 &&
      ((r = inherit_open (n1, n, &k1, -1)) < 0 ||
       (r = inherit_open (n2, n, &k1, 1)) < 0))
    return r;

  if (!parent) {
    struct ckey range = ckey_make (BKEY_MAX_INODE, BKEY_MAX_OFFSET, 0, false,
                                   0, false);
    parent = node_new (c, n->level + 1, b3, &range);
    if (!parent)
      return -ENOMEM;
    t->root = parent;
  }
  if ((r = interior_update (c, parent, &n1->key)) < 0 ||
      (r = interior_update (c, parent, &n2->key)) < 0)
    return r;

  dead_add (c, node_bucket (c, n));
  node_free (c, n);
  bcf_time_record (c, &c->stats.btree_split, bcf_now_ns () - t0);

  if (parent->keys.nr > t->max_leaf_keys)
    return split_node (c, parent);
  return 0;
}

/* GC's coalescing (bcache's btree_gc_coalesce, for two nodes): if leaf n
 * and its right sibling under the same parent fit together in 2/3 of a
 * node, replace both by one new node.  The parent loses a child key, which
 * an appended bset cannot express (interior bsets only add or replace
 * keys), so the parent moves to a new bucket and is written whole
 * (relocate_node), like any copy on write.  The old nodes' buckets die
 * under the epoch rule.  Returns 1 if it merged, 0 if not, -errno.  Under
 * tree_lock (write), no I/O. */
int
btree_coalesce_locked (struct bcf_cache *c, struct btree_node *n)
{
  struct btree *t = &c->tree;
  struct btree_node *p = find_parent (c, n), *m, *x;
  size_t i;
  uint64_t b;
  int r;

  if (!p || n->level != 0 || n->evicted)
    return 0;
  i = child_index (&p->keys, ckey_inode (&n->key), ckey_end (&n->key));
  if (i + 1 >= p->keys.nr)
    return 0;
  m = hash_find (c, &p->keys.k[i + 1]);
  if (!m || m->evicted || n->keys.nr + m->keys.nr > t->max_leaf_keys * 2 / 3)
    return 0;
  /* x, and the parent's new bucket, and whatever the parent's parents
   * need when the pointer changes. */
  if (btree_free_buckets (c) < 2 * (t->root->level + 1) + 2)
    return 0;
  if ((r = alloc_bucket_nowait (c, RESERVE_BTREE, &b)) < 0)
    return 0;
  x = node_new (c, 0, b, &m->key);
  if (!x)
    return -ENOMEM;
  if ((r = keyset_reserve (&x->keys, n->keys.nr + m->keys.nr)) < 0)
    return r;
  for (size_t k = 0; k < n->keys.nr; k++)
    keyset_append (&x->keys, &n->keys.k[k]);
  for (size_t k = 0; k < m->keys.nr; k++)
    keyset_append (&x->keys, &m->keys.k[k]);
  if ((r = inherit_open (x, n, NULL, 0)) < 0 ||
      (r = inherit_open (x, m, NULL, 0)) < 0)
    return r;
  if ((r = keyset_del (&p->keys, &n->key)) < 0 ||
      (r = keyset_put (&p->keys, &x->key)) < 0)
    return r;
  keyset_clear (&p->open);
  if (!p->rewrite && (r = relocate_node (c, p)) < 0)
    return r;
  dead_add (c, node_bucket (c, n));
  dead_add (c, node_bucket (c, m));
  node_free (c, n);
  node_free (c, m);
  return 1;
}

/* Sectors of dirty keys of s inside [start, end). */
static uint64_t
dirty_in (const struct keyset *s, uint64_t inode, uint64_t start,
          uint64_t end)
{
  uint64_t sectors = 0;

  if (s->ndirty == 0)
    return 0;
  for (size_t i = keyset_search (s, inode, start); i < s->nr; i++) {
    const struct ckey *k = &s->k[i];
    uint64_t a, b;

    if (ckey_inode (k) != inode || ckey_start (k) >= end)
      break;
    if (!ckey_dirty (k))
      continue;
    a = ckey_start (k) > start ? ckey_start (k) : start;
    b = ckey_end (k) < end ? ckey_end (k) : end;
    sectors += b - a;
  }
  return sectors;
}

/* Insert one piece that lies inside leaf n.  Keeps tree.dirty_sectors
 * exact: an insert changes only what lies inside its own range.
 * survives: a crash can bring k back though no checkpoint captured it
 * (it is journalled, or it is the clean copy of a dirty key that a
 * journal entry or a committed node holds); returns_dirty: and it comes
 * back dirty (a journalled dirty key, or such a clean copy). */
static int
leaf_insert (struct bcf_cache *c, struct btree_node *n, const struct ckey *k,
             bool survives, bool returns_dirty)
{
  const uint64_t inode = ckey_inode (k), s = ckey_start (k), e = ckey_end (k);
  size_t before = n->keys.nr;
  uint64_t dirty_before = dirty_in (&n->keys, inode, s, e);
  int r;

  if ((r = keyset_insert (&n->open, k)) < 0 ||
      (r = keyset_insert (&n->keys, k)) < 0)
    return r;
  /* Atomic: bcf_cache_dirty_bytes reads it without the lock. */
  __atomic_add_fetch (&c->tree.dirty_sectors,
                      dirty_in (&n->keys, inode, s, e) - dirty_before,
                      __ATOMIC_RELAXED);
  c->tree.leaf_inserts++;
  if (ckey_dirty (k) && ckey_has_ptr (k))
    alloc_mark_dirty (c, k->ptr);
  if (survives && ckey_has_ptr (k) && !ckey_is_check (k)) {
    n->open_jdata = true;
    if (returns_dirty && (r = keyset_insert (&n->dcopies, k)) < 0)
      return r;
  }
  c->tree.nkeys += n->keys.nr - before;
  if (n->keys.nr > c->tree.max_leaf_keys) {
    r = split_node (c, n);
    if (r == -EAGAIN)
      r = 0;                  /* the checkpoint splits it later */
  }
  return r;
}

/* Cut k to the part inside leaf n (starting at pos). */
static struct ckey
piece_in_leaf (const struct btree_node *n, const struct ckey *k, uint64_t pos)
{
  struct ckey p = *k;
  uint64_t end = ckey_end (k);

  if (ckey_inode (&n->key) == ckey_inode (k) && ckey_end (&n->key) < end)
    end = ckey_end (&n->key);
  ckey_cut_front (&p, pos - ckey_start (k));
  ckey_cut_back (&p, ckey_end (k) - end);
  return p;
}

static int
insert_pieces (struct bcf_cache *c, const struct ckey *k, bool survives,
               bool returns_dirty)
{
  uint64_t pos = ckey_start (k);
  struct ckey need;

  if (!btree_range_loaded (c, ckey_inode (k), pos, ckey_end (k), &need))
    return -ENODATA;          /* the caller loads it and retries */

  while (pos < ckey_end (k)) {
    struct btree_node *n = btree_find_leaf (c, ckey_inode (k), pos + 1);
    struct ckey p;
    int r;

    if (!n)
      return -EIO;
    p = piece_in_leaf (n, k, pos);
    if ((r = leaf_insert (c, n, &p, survives, returns_dirty)) < 0)
      return r;
    pos = ckey_end (&p);
  }
  return 0;
}

int
btree_insert_locked (struct bcf_cache *c, const struct ckey *k, uint64_t jseq)
{
  return insert_pieces (c, k, jseq != 0, jseq != 0 && ckey_dirty (k));
}

void
btree_note_removal_locked (struct bcf_cache *c, uint64_t inode,
                           uint64_t start, uint64_t end, uint64_t seq)
{
  uint64_t pos = start;

  while (pos < end) {
    struct btree_node *n = btree_find_leaf (c, inode, pos + 1);

    if (!n)
      return;
    if (seq > n->removal_seq)
      n->removal_seq = seq;
    if (ckey_inode (&n->key) != inode)
      return;
    pos = ckey_end (&n->key);
  }
}

uint64_t
btree_removal_seq_locked (struct bcf_cache *c, uint64_t inode,
                          uint64_t start, uint64_t end)
{
  uint64_t pos = start, seq = 0;

  while (pos < end) {
    struct btree_node *n = btree_find_leaf (c, inode, pos + 1);

    if (!n)
      break;
    if (n->removal_seq > seq)
      seq = n->removal_seq;
    if (ckey_inode (&n->key) != inode)
      break;
    pos = ckey_end (&n->key);
  }
  return seq;
}

bool
btree_open_overlaps_locked (struct bcf_cache *c, const struct btree_node *n,
                            uint64_t inode, uint64_t start, uint64_t end)
{
  return keyset_overlaps (&n->open, inode, start, end);
}

bool
btree_range_dirty_locked (struct bcf_cache *c, uint64_t inode,
                          uint64_t start, uint64_t end)
{
  uint64_t pos = start;

  if (c->tree.dirty_sectors == 0)
    return false;
  while (pos < end) {
    struct btree_node *n = btree_find_leaf (c, inode, pos + 1);

    if (!n)
      return false;
    if (dirty_in (&n->keys, inode, pos, end))
      return true;
    if (ckey_inode (&n->key) != inode)
      return false;
    pos = ckey_end (&n->key);
  }
  return false;
}

/* Could a crash bring back a dirty version of anything in [start, end)?
 * Recovery keeps dirty data and writes it back, so a dirty key that
 * comes back is written over whatever the export has since: a
 * write-intent mark does not cover it (it drops only clean keys).  A
 * dirty key now, or the clean copy of one (W4's clean marks are not
 * journalled), comes back dirty if the journal or a committed node holds
 * its dirty version: then it was inserted or marked clean since its
 * leaf's open set was last captured, so the leaf's dcopies hold it, even
 * if it left memory since (a stale key GC dropped while its bucket's new
 * gen is not persisted, an invalidation); or a capture took it and has
 * not committed yet.  A leaf not in memory has none (a leaf with open
 * keys is never evicted).  Fills and bcf_insert's clean keys never come
 * back dirty: they are not in dcopies. */
bool
btree_range_returns_dirty_locked (struct bcf_cache *c, uint64_t inode,
                                  uint64_t start, uint64_t end)
{
  uint64_t pos = start;

  if (c->tree.ckpt_uncommitted)
    return true;
  while (pos < end) {
    struct btree_node *n = btree_find_leaf (c, inode, pos + 1);
    bool last;
    uint64_t e;

    if (!n)
      return false;
    last = ckey_inode (&n->key) != inode;
    e = !last && ckey_end (&n->key) < end ? ckey_end (&n->key) : end;
    if (!n->evicted && (dirty_in (&n->keys, inode, pos, e) ||
                        keyset_overlaps (&n->dcopies, inode, pos, e)))
      return true;
    if (last)
      return false;
    pos = ckey_end (&n->key);
  }
  return false;
}

int64_t
btree_mark_clean_locked (struct bcf_cache *c, const struct ckey *dirty)
{
  const uint64_t inode = ckey_inode (dirty), end = ckey_end (dirty);
  uint64_t pos = ckey_start (dirty);
  struct clean_piece {
    struct ckey k;              /* the clean copy */
    bool back;                  /* it comes back dirty after a crash */
  } *match = NULL;
  size_t n = 0, cap = 0;
  int64_t cleaned = 0;
  int r = 0;

  /* First the matching pieces, clipped to the range (the tree is not
   * changed while it is walked), and whether each comes back dirty after
   * a crash: a dirty key a checkpoint captured (it is not in the open
   * set) does; one still in the open set does if it is journalled, and
   * then dcopies has it already; an unjournalled one does not
   * (bcf_write_begin_through) ... */
  while (pos < end && r == 0) {
    struct btree_node *leaf = btree_find_leaf (c, inode, pos + 1);
    const struct keyset *ks;

    if (!leaf || leaf->evicted) {
      r = leaf ? -ENODATA : -EIO;   /* a leaf with dirty keys stays loaded */
      break;
    }
    ks = &leaf->keys;
    for (size_t i = keyset_search (ks, inode, pos); i < ks->nr; i++) {
      struct ckey k = ks->k[i];

      if (ckey_inode (&k) != inode || ckey_start (&k) >= end)
        break;
      if (!ckey_matches (&k, dirty))
        continue;
      if (ckey_start (&k) < ckey_start (dirty))
        ckey_cut_front (&k, ckey_start (dirty) - ckey_start (&k));
      if (ckey_end (&k) > end)
        ckey_cut_back (&k, ckey_end (&k) - end);
      SET_KEY_DIRTY (ckey_bkey_mut (&k), 0);
      if (n == cap) {
        size_t nc = cap ? cap * 2 : 8;
        void *p = realloc (match, nc * sizeof *match);
        if (!p) {
          r = -ENOMEM;
          break;
        }
        match = p;
        cap = nc;
      }
      match[n++] = (struct clean_piece) {
        .k = k, .back = !keyset_contains (&leaf->open, &ks->k[i]),
      };
    }
    if (ckey_inode (&leaf->key) != inode)
      break;
    pos = ckey_end (&leaf->key);
  }
  /* ... then each replaced by its clean copy, which covers exactly it.
   * The copy is not journalled, but the dirty key it replaces may be in
   * the journal or in a committed node, so a crash brings the key back,
   * dirty: the copy must not count as a key only memory has
   * (extent.c's key_only_in_memory), or an invalidation over it would
   * skip its journal write and the restart would write the dirty key's
   * data back over the newer data of the write that invalidated it.
   * (Where the dirty key was only in memory, the copy still counts as
   * surviving: that only journals such an invalidation needlessly.) */
  for (size_t i = 0; i < n && r == 0; i++) {
    r = insert_pieces (c, &match[i].k, true, match[i].back);
    if (r == 0)
      cleaned += (int64_t) ckey_size (&match[i].k);
  }
  free (match);
  return r < 0 ? r : cleaned;
}

bool
btree_range_matches_locked (struct bcf_cache *c, const struct ckey *k,
                            const struct ckey *expect)
{
  uint64_t pos = ckey_start (k);

  while (pos < ckey_end (k)) {
    struct btree_node *n = btree_find_leaf (c, ckey_inode (k), pos + 1);
    struct ckey p;

    if (!n || n->evicted)
      return false;
    p = piece_in_leaf (n, k, pos);
    if (!keyset_replace_matches (&n->keys, &p, expect))
      return false;
    pos = ckey_end (&p);
  }
  return true;
}

int
btree_replace_locked (struct bcf_cache *c, const struct ckey *k,
                      const struct ckey *expect)
{
  struct ckey need;

  if (!btree_range_loaded (c, ckey_inode (k), ckey_start (k), ckey_end (k),
                           &need))
    return -ENODATA;
  /* All or nothing: every leaf first. */
  if (!btree_range_matches_locked (c, k, expect))
    return -EEXIST;
  return btree_insert_locked (c, k, 0);
}

/* ---- the node cache -------------------------------------------------------- */

/* The LRU clock ticks at each eviction pass (checkpoints, and
 * btree_evict_maybe), not per use: a lookup must not write a cache line
 * every other lookup also writes, and "used since the last pass" is the
 * resolution eviction needs.  The node's line is written only when the
 * clock moved.  Callers hold tree_lock (read or write); the clock changes
 * only under the write lock, and last_use is atomic because readers store
 * to it concurrently. */
void
btree_touch (struct bcf_cache *c, struct btree_node *n)
{
  if (__atomic_load_n (&n->last_use, __ATOMIC_RELAXED) != c->tree.lru_clock)
    __atomic_store_n (&n->last_use, c->tree.lru_clock, __ATOMIC_RELAXED);
}

bool
btree_range_loaded (struct bcf_cache *c, uint64_t inode, uint64_t start,
                    uint64_t end, struct ckey *need)
{
  uint64_t pos = start;

  do {
    struct btree_node *n = btree_find_leaf (c, inode, pos + 1);
    if (!n)
      return true;            /* callers report the missing leaf */
    if (n->evicted) {
      *need = n->key;
      return false;
    }
    if (ckey_inode (&n->key) != inode)
      break;
    pos = ckey_end (&n->key);
  } while (pos < end);
  return true;
}

int
btree_load_evicted (struct bcf_cache *c, const struct ckey *key)
{
  struct btree_node tmp = { .key = *key, .level = 0 };
  struct btree_node *n;
  char err[256];
  int r;

  keyset_init (&tmp.keys, false);
  keyset_init (&tmp.open, true);
  r = btree_node_read (c, &tmp, err, sizeof err);

  tree_wrlock (c);
  n = hash_find (c, key);
  if (n && n->evicted) {
    if (r == 0) {
      n->keys = tmp.keys;
      keyset_init (&tmp.keys, false);
      n->evicted = false;
      c->tree.nkeys += n->keys.nr;
      c->tree.cache_bytes += keyset_bytes (&n->keys);
      btree_touch (c, n);
      __atomic_add_fetch (&c->tree.loads, 1, __ATOMIC_RELAXED);
    }
    else
      bcf_log (c, BCF_LOG_ERROR, "reloading an evicted btree node: %s", err);
  }
  else
    r = 0;                    /* loaded or freed meanwhile: just retry */
  tree_wrunlock (c);
  keyset_free (&tmp.keys);
  keyset_free (&tmp.open);
  return r;
}

struct evict_ctx {
  size_t bytes;
  struct btree_node **cand;
  size_t n, cap;
};

static int
count_cache (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct evict_ctx *e = opaque;

  e->bytes += keyset_bytes (&n->keys) + keyset_bytes (&n->open);
  if (n->level > 0 || n->evicted || n->rewrite || n->open.nr ||
      n == c->tree.root)
    return 0;
  /* Dirty data must stay countable without I/O (writeback, identity). */
  if (n->keys.ndirty)
    return 0;
  if (e->n == e->cap) {
    size_t cap = e->cap ? e->cap * 2 : 64;
    void *p = realloc (e->cand, cap * sizeof *e->cand);
    if (!p)
      return 1;
    e->cand = p;
    e->cap = cap;
  }
  e->cand[e->n++] = n;
  return 0;
}

static int
cmp_last_use (const void *a, const void *b)
{
  const struct btree_node *x = *(struct btree_node *const *) a;
  const struct btree_node *y = *(struct btree_node *const *) b;
  return x->last_use < y->last_use ? -1 : x->last_use > y->last_use;
}

static size_t
cache_limit (const struct bcf_cache *c)
{
  return c->opts.node_cache_bytes ? c->opts.node_cache_bytes
         : (size_t) 256 << 20;
}

void
btree_evict_maybe (struct bcf_cache *c)
{
  bool over;

  pthread_rwlock_rdlock (&c->tree_lock);
  over = c->tree.cache_bytes > cache_limit (c);
  pthread_rwlock_unlock (&c->tree_lock);
  if (!over)
    return;
  tree_wrlock (c);
  btree_evict_locked (c);
  tree_wrunlock (c);
}

void
btree_evict_locked (struct bcf_cache *c)
{
  const size_t limit = cache_limit (c);
  struct evict_ctx e = { 0 };

  c->tree.lru_clock++;

  btree_visit (c, count_cache, &e);
  c->tree.cache_bytes = e.bytes;
  if (e.bytes > limit && e.n) {
    /* Least recently used first, down to 3/4 of the bound so this does
     * not run at every checkpoint. */
    qsort (e.cand, e.n, sizeof *e.cand, cmp_last_use);
    for (size_t i = 0; i < e.n && e.bytes > limit / 4 * 3; i++) {
      struct btree_node *n = e.cand[i];
      e.bytes -= keyset_bytes (&n->keys);
      c->tree.nkeys -= n->keys.nr;
      keyset_free (&n->keys);
      n->evicted = true;
      __atomic_add_fetch (&c->tree.evictions, 1, __ATOMIC_RELAXED);
    }
    c->tree.cache_bytes = e.bytes;
  }
  free (e.cand);
}

/* ---- visiting --------------------------------------------------------------- */

static int
visit (struct bcf_cache *c, struct btree_node *n, btree_visit_fn fn,
       void *opaque)
{
  int r = fn (c, n, opaque);

  if (r)
    return r;
  if (n->level > 0)
    for (size_t i = 0; i < n->keys.nr; i++) {
      struct btree_node *ch = hash_find (c, &n->keys.k[i]);
      if (!ch)
        return -EIO;
      if ((r = visit (c, ch, fn, opaque)))
        return r;
    }
  return 0;
}

int
btree_visit (struct bcf_cache *c, btree_visit_fn fn, void *opaque)
{
  return c->tree.root ? visit (c, c->tree.root, fn, opaque) : 0;
}

static int
add_dirty_sectors (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  uint64_t *sectors = opaque;

  if (n->level == 0 && n->keys.ndirty)
    for (size_t i = 0; i < n->keys.nr; i++)
      if (ckey_dirty (&n->keys.k[i]))
        *sectors += ckey_size (&n->keys.k[i]);
  return 0;
}

uint64_t
btree_count_dirty_sectors (struct bcf_cache *c)
{
  uint64_t sectors = 0;

  btree_visit (c, add_dirty_sectors, &sectors);
  return sectors;
}

uint64_t
btree_dirty_sectors (struct bcf_cache *c)
{
  return __atomic_load_n (&c->tree.dirty_sectors, __ATOMIC_RELAXED);
}

/* ---- reading nodes ----------------------------------------------------------- */

struct load_ctx {
  struct bcf_cache *c;
  struct btree_node *n;
  int err;
};

/* In an interior node, the keys bcache writes that are not child
 * pointers: a key at (0, 0) frees a node (make_btree_freeing_key: the old
 * pointer with its bucket's gen + 1, so that the kernel, reading it first,
 * knows the old pointer is stale); and of two keys at one position in one
 * bset, the second is the older (bcache sorts and inserts the newest
 * first; a later bset is newer still, and keyset_put lets it win). */
static bool
not_a_child (const struct ckey *k, const struct ckey *prev_in_bset)
{
  return (ckey_inode (k) == 0 && ckey_end (k) == 0) ||
         (prev_in_bset && ckey_cmp (prev_in_bset, k) == 0);
}

static int
load_bset (const struct bch_node_bset *set, void *opaque)
{
  struct load_ctx *l = opaque;
  const uint8_t *p = (const uint8_t *) set->keys;
  size_t w = 0;
  struct ckey prev;
  bool have_prev = false;

  while (w < set->hdr.keys) {
    struct bkey_padded b;
    struct ckey k;

    if (bkey_decode (p + 8 * w, (set->hdr.keys - w) * 8, &b, NULL) != BCH_OK)
      return -1;
    w += bkey_u64s (&b.key);
    if (!ckey_from_bkey (&b.key, &k)) {
      l->err = -ENOTSUP;
      return -1;
    }
    if (l->n->level == 0)
      l->err = keyset_insert (&l->n->keys, &k);
    else if (!not_a_child (&k, have_prev ? &prev : NULL))
      l->err = keyset_put (&l->n->keys, &k);
    if (l->err < 0)
      return -1;
    prev = k;
    have_prev = true;
  }
  return 0;
}

int
btree_node_read (struct bcf_cache *c, struct btree_node *n, char *err,
                 size_t errlen)
{
  const size_t nb = c->tree.node_bytes;
  struct bch_key_geometry geo = {
    .nbuckets = c->sb.nbuckets, .bucket_sectors = c->bucket_sectors,
    .first_bucket = c->sb.first_bucket, .nr_in_set = 1,
  };
  struct load_ctx l = { .c = c, .n = n };
  struct bch_diag d;
  uint8_t *buf;
  size_t written;
  unsigned nsets;
  int r;

  buf = bcf_buf_alloc (nb);
  if (!buf)
    return -ENOMEM;
  r = bcf_io_pread (c->io, buf, nb, node_bucket (c, n) * c->bucket_bytes);
  if (r < 0) {
    snprintf (err, errlen, "reading btree node at bucket %" PRIu64 ": %s",
              node_bucket (c, n), strerror (-r));
    goto out;
  }
  keyset_clear (&n->keys);
  if (bch_node_walk (buf, nb, c->block_bytes, bch_bset_magic (&c->sb),
                     n->key.ptr, n->level, &geo, load_bset, &l, &nsets,
                     &written, &d) != BCH_OK) {
    snprintf (err, errlen, "btree node at bucket %" PRIu64 " (level %u): %s",
              node_bucket (c, n), n->level,
              l.err == -ENOTSUP ? "key with several pointers (multi-device "
              "cache sets are not supported)" : d.msg);
    r = l.err ? l.err : -EUCLEAN;
    goto out;
  }
  n->seq = bch_get_le64 (buf + 16);
  n->written = written;
  n->rewrite = false;
 out:
  bcf_buf_free (buf, nb);
  return r;
}

/* The open's progress through the tree (BCF_OPEN_BTREE): the node count
 * is unknown until the last node is read, so the whole tree is this many
 * shares, each node's split equally among its children; a leaf read
 * reports the end of its share.  Depth first, so done only grows.
 * 2^32 keeps span * i (i < a node's keys) far from overflowing. */
#define LOAD_SHARES (UINT64_C (1) << 32)

/* Read node n and, below it, every node it points at; [lo, lo + span)
 * is n's share of LOAD_SHARES. */
static int
load_subtree (struct bcf_cache *c, struct btree_node *n, uint64_t lo,
              uint64_t span, char *err, size_t errlen)
{
  int r = btree_node_read (c, n, err, errlen);

  if (r < 0)
    return r;
  if (n->level == 0) {
    c->tree.nkeys += n->keys.nr;
    open_progress (&c->opts, BCF_OPEN_BTREE, lo + span, LOAD_SHARES);
    return 0;
  }
  if (n->keys.nr == 0) {
    snprintf (err, errlen, "interior btree node at bucket %" PRIu64
              " is empty", node_bucket (c, n));
    return -EUCLEAN;
  }
  for (size_t i = 0; i < n->keys.nr; i++) {
    const struct ckey *k = &n->keys.k[i];
    uint64_t b = bucket_of_ptr (c, k->ptr), from, to;
    struct btree_node *ch;

    if (b >= c->sb.nbuckets || hash_find (c, k)) {
      snprintf (err, errlen, "btree node at bucket %" PRIu64 " points at "
                "bucket %" PRIu64 " twice or outside the cache",
                node_bucket (c, n), b);
      return -EUCLEAN;
    }
    ch = calloc (1, sizeof *ch);
    if (!ch)
      return -ENOMEM;
    ch->level = n->level - 1;
    ch->key = *k;
    keyset_init (&ch->keys, false);
    keyset_init (&ch->open, ch->level == 0);
    hash_add (&c->tree, ch, b);
    c->tree.nnodes++;
    /* The last child's share ends exactly where this node's does. */
    from = lo + span * i / n->keys.nr;
    to = lo + span * (i + 1) / n->keys.nr;
    if ((r = load_subtree (c, ch, from, to - from, err, errlen)) < 0)
      return r;
  }
  return 0;
}

int
btree_load (struct bcf_cache *c, const struct ckey *root, unsigned level,
            char *err, size_t errlen)
{
  struct btree_node *n = calloc (1, sizeof *n);
  int r;

  if (!n)
    return -ENOMEM;
  n->level = level;
  n->key = *root;
  keyset_init (&n->keys, false);
  keyset_init (&n->open, level == 0);
  hash_add (&c->tree, n, bucket_of_ptr (c, root->ptr));
  c->tree.nnodes++;
  c->tree.root = n;
  open_progress (&c->opts, BCF_OPEN_BTREE, 0, LOAD_SHARES);
  if ((r = load_subtree (c, n, 0, LOAD_SHARES, err, errlen)) < 0)
    return r;
  __atomic_store_n (&c->tree.dirty_sectors, btree_count_dirty_sectors (c),
                    __ATOMIC_RELAXED);
  return 0;
}

/* ---- the checkpoint --------------------------------------------------------- */

struct node_write {
  /* Captured under the lock (phase 1): */
  struct ckey *keys;          /* the keys to write: owned (a stolen open
                                 set, freed as keys_alloc), or shared with
                                 the node (share) */
  void *keys_alloc;
  struct keyset_share *share; /* reference to the node's merged keys */
  size_t nkeys;
  uint64_t seq, ptr0;         /* the node's bset seq and pointer (csum seed) */
  uint64_t off;               /* device bytes */
  size_t len;                 /* bytes to write: a block multiple */
  unsigned level;
  /* Encoded without the lock (phase 2): */
  void *buf;
  size_t alloc;               /* bytes allocated */
};

struct ckpt {
  struct node_write *w;
  size_t nw, cap;
};

static size_t
round_block (const struct bcf_cache *c, size_t x)
{
  return (x + c->block_bytes - 1) / c->block_bytes * c->block_bytes;
}

/* Phase 1, under the lock: take the keys one bset of node n will hold,
 * at byte `at` of the node.  With steal, the array itself is taken (the
 * open set, which the caller then re-initialises); otherwise it is
 * shared copy-on-write (the merged view of a node written whole: the
 * node copies it only if it changes before phase 2 is done with it).
 * Both are O(1): the size comes from the set's word count, and encoding
 * and checksumming, the expensive part, wait for phase 2 (encode_bset),
 * so the lock is not held for anything proportional to the keys.
 * Returns the block-rounded size, or 0 on ENOMEM. */
static size_t
capture_bset (struct bcf_cache *c, struct ckpt *ck, struct btree_node *n,
              struct keyset *s, bool steal, size_t at)
{
  struct node_write *w;

  if (ck->nw == ck->cap) {
    size_t cap = ck->cap ? ck->cap * 2 : 32;
    void *nw = realloc (ck->w, cap * sizeof *ck->w);
    if (!nw)
      return 0;
    ck->w = nw;
    ck->cap = cap;
  }
  w = &ck->w[ck->nw];
  memset (w, 0, sizeof *w);
  w->nkeys = s->nr;
  w->len = round_block (c, BCH_BSET_HEADER_SIZE + s->words * 8);
  if (steal) {
    /* open sets are never shared: no copy, no failure but ENOMEM */
    if (s->nr && !(w->keys = keyset_steal (s, &w->keys_alloc)))
      return 0;
  }
  else if (s->nr) {
    w->share = keyset_share (s);
    if (!w->share)
      return 0;
    w->keys = s->k;
  }
  w->seq = n->seq;
  w->ptr0 = n->key.ptr;
  w->off = node_bucket (c, n) * c->bucket_bytes + at;
  w->level = n->level;
  bcf_log (c, BCF_LOG_DEBUG, "node write: bucket %" PRIu64 " level %u at "
           "%zu, %zu bytes, %zu keys, seq %" PRIx64, node_bucket (c, n),
           n->level, at, w->len, w->nkeys, n->seq);
  ck->nw++;
  return w->len;
}

/* Phase 2, no lock: encode a captured bset into its buffer. */
static int
encode_bset (struct bcf_cache *c, struct node_write *w)
{
  uint8_t *buf, *p;
  uint32_t words = 0;

  w->alloc = w->len;
  buf = bcf_buf_alloc (w->alloc);
  if (!buf)
    return -ENOMEM;
  memset (buf, 0, w->alloc);
  p = buf + BCH_BSET_HEADER_SIZE;
  for (size_t i = 0; i < w->nkeys; i++) {
    size_t kb = bkey_encode (ckey_bkey (&w->keys[i]), p, buf + w->alloc - p);
    p += kb;
    words += (uint32_t) (kb / 8);
  }
  bch_bset_seal (buf, w->alloc, bch_bset_magic (&c->sb), w->seq, words,
                 w->ptr0);
  w->buf = buf;
  return 0;
}

/* Move node n to a fresh bucket (its log is full): copy on write.  The
 * parent learns the new pointer through its open set. */
static int
relocate_node (struct bcf_cache *c, struct btree_node *n)
{
  struct btree_node *parent = find_parent (c, n);
  uint64_t old = node_bucket (c, n), nb;
  int r;

  if ((r = alloc_bucket_nowait (c, RESERVE_BTREE, &nb)) < 0)
    return r;
  hash_del (&c->tree, n, old);
  n->key.ptr = bucket_ptr (c, nb, c->alloc.buckets[nb].gen);
  hash_add (&c->tree, n, nb);
  n->seq = random_seq ();
  n->rewrite = true;
  n->written = 0;
  dead_add (c, old);
  if (parent)
    return interior_update (c, parent, &n->key);
  return 0;
}

struct snap_ctx {
  struct ckpt *ck;
  unsigned level;
  int err;
};

/* Phase 1 for one node at the level being processed. */
static int
snapshot_node (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct snap_ctx *s = opaque;
  size_t need;
  int r;

  if (n->level != s->level || (!n->rewrite && n->open.nr == 0))
    return 0;
  need = round_block (c, BCH_BSET_HEADER_SIZE +
                      n->open.nr * sizeof (struct ckey));
  if (!n->rewrite && n->written + need > c->tree.node_bytes)
    if ((r = relocate_node (c, n)) < 0)
      return s->err = r;
  if (n->rewrite) {
    size_t len = capture_bset (c, s->ck, n, &n->keys, false, 0);
    if (!len)
      return s->err = -ENOMEM;
    n->written = len;
  }
  else {
    size_t len = capture_bset (c, s->ck, n, &n->open, true, n->written);
    if (!len)
      return s->err = -ENOMEM;
    n->written += len;
  }
  /* What changes from now on starts empty (the open set's array too:
   * splits fill it). */
  keyset_free (&n->open);
  keyset_init (&n->open, n->level == 0);
  n->open_jdata = false;
  keyset_free (&n->dcopies);
  n->rewrite = false;
  return 0;
}

/* How many buckets can a snapshot's relocations take?  A node relocates
 * at most once per snapshot (relocate_node sets rewrite, which
 * snapshot_node and interior_update check first): the nodes whose next
 * bset does not fit now (moves), and the interior nodes above them,
 * which a child's new pointer relocates at once (interior nodes are
 * written whole: interior_update); so each interior node not yet being
 * rewritten counts once if anything moves.  The bound was
 * once (moves) x (levels), which asked 3,385 buckets of a 5M-key cache
 * whose free lists hold at most 1,541: after a crash, recovery had
 * dropped clean keys in every leaf, and no checkpoint, hence no open,
 * could ever succeed again ("No space left on device", on a cache full
 * of reclaimable clean data). */
struct reloc_ctx { size_t moves, interior; };
static int
count_relocations (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct reloc_ctx *rc = opaque;
  size_t need = round_block (c, BCH_BSET_HEADER_SIZE +
                             n->open.nr * sizeof (struct ckey));

  if (n->rewrite)
    return 0;                   /* written whole to its own bucket anyway */
  if (n->open.nr && n->written + need > c->tree.node_bytes)
    rc->moves++;
  if (n->level > 0)
    rc->interior++;
  return 0;
}

static size_t
relocations_at_most (const struct reloc_ctx *rc)
{
  return rc->moves ? rc->moves + rc->interior : 0;
}

/* Split every node that outgrew a node.  Returns -EAGAIN if buckets ran
 * out.  One walk of the tree finds every oversized node of the lowest
 * level that has any; splitting one of them frees only it and perhaps
 * ancestors (which split_node splits in turn), never another node of the
 * same level, so they are all split before the next walk. */
struct oversize_ctx {
  struct btree_node **found;
  size_t n, cap;
  unsigned level;
  bool nomem;
};
static int
find_oversized (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct oversize_ctx *o = opaque;

  if (n->keys.nr <= c->tree.max_leaf_keys || n->level > o->level)
    return 0;
  if (n->level < o->level) {
    o->level = n->level;
    o->n = 0;
  }
  if (o->n == o->cap) {
    size_t cap = o->cap ? o->cap * 2 : 16;
    void *p = realloc (o->found, cap * sizeof *o->found);
    if (!p) {
      o->nomem = true;
      return 1;
    }
    o->found = p;
    o->cap = cap;
  }
  o->found[o->n++] = n;
  return 0;
}

static int
split_oversized (struct bcf_cache *c)
{
  struct oversize_ctx o = { 0 };
  int r = 0;

  do {
    o.n = 0;
    o.level = UINT_MAX;
    btree_visit (c, find_oversized, &o);
    if (o.nomem)
      r = -ENOMEM;
    for (size_t i = 0; i < o.n && r == 0; i++)
      r = split_node (c, o.found[i]);
  } while (r == 0 && o.n);
  free (o.found);
  return r;
}

static void
ckpt_free (struct ckpt *ck)
{
  for (size_t i = 0; i < ck->nw; i++) {
    if (ck->w[i].buf)
      bcf_buf_free (ck->w[i].buf, ck->w[i].alloc);
    if (ck->w[i].share)
      keyset_share_put (ck->w[i].share);
    else
      free (ck->w[i].keys_alloc);
  }
  free (ck->w);
}

/* Phase 1: returns 0 with the writes in ck, root and last_seq set; or
 * -EAGAIN (needs buckets; nothing was changed that matters). */
static int
snapshot (struct bcf_cache *c, struct ckpt *ck, struct ckey *root,
          unsigned *root_level, uint64_t *last_seq, uint64_t *epoch,
          uint64_t *export_changes)
{
  int r;

  tree_wrlock_timing (c, NULL);
  /* From the first open set taken until this checkpoint commits, a
   * removal that is in no open set may still be undurable (see
   * tree.ckpt_uncommitted). */
  c->tree.ckpt_uncommitted = true;
  r = split_oversized (c);
  /* Nothing below may fail half way: it clears open sets and advances
   * `written` as it encodes.  So first make sure every relocation can get
   * its bucket: each node whose log is full moves, and the pointer update
   * may in turn fill its parent's log, up to the root
   * (relocations_at_most). */
  if (r == 0) {
    struct reloc_ctx rc = { 0 };
    btree_visit (c, count_relocations, &rc);
    if (btree_free_buckets (c) < relocations_at_most (&rc) + 1)
      r = -EAGAIN;
  }
  if (r == 0) {
    for (unsigned lvl = 0; lvl <= c->tree.root->level && r == 0; lvl++) {
      struct snap_ctx s = { .ck = ck, .level = lvl };
      btree_visit (c, snapshot_node, &s);
      r = s.err;
    }
    if (r < 0) {
      /* Out of memory half way: the tree in memory no longer matches
       * what can be written.  Stop writing metadata. */
      bcf_log (c, BCF_LOG_ERROR, "checkpoint snapshot failed: %s",
               strerror (-r));
      c->failed = true;
    }
  }
  if (r == 0) {
    *root = c->tree.root->key;
    *root_level = c->tree.root->level;
    *last_seq = journal_seal_locked (c) + 1;
    *epoch = c->tree.epoch++;
    /* Under the lock every fill and mark-clean takes: every captured
     * clean key's export change is counted (export_barrier). */
    *export_changes = export_changes_now (c);
    c->tree.leaf_inserts_captured = c->tree.leaf_inserts;
  }
  tree_wrunlock_into (c, &c->stats.ckpt_locked);
  return r;
}

static int
cmp_level (const void *a, const void *b)
{
  const struct node_write *x = a, *y = b;
  return (int) x->level - (int) y->level;
}

int
btree_checkpoint (struct bcf_cache *c)
{
  struct ckpt ck = { 0 };
  struct ckey root = { 0 };
  unsigned root_level = 0, level;
  uint64_t last_seq = 0, epoch = 0, t0 = bcf_now_ns (), changes = 0;
  size_t i, j;
  int r, tries = 0;

  if (c->failed)
    return -EIO;
  /* The export barrier first for what is known now, while a failure
   * changes nothing: an export that cannot flush postpones the
   * checkpoint, and the cache stays writable.  The one in phase 2 then
   * only covers what completed since, and seldom has to flush. */
  if ((r = export_barrier (c, export_changes_now (c))) < 0)
    return r;
  while ((r = snapshot (c, &ck, &root, &root_level, &last_seq, &epoch,
                        &changes)) == -EAGAIN && tries++ < 8) {
    ckpt_free (&ck);
    memset (&ck, 0, sizeof ck);
    /* Each refill commits a prio write through the journal, and the
     * reserve holds one (journal.c): never take the room this
     * checkpoint's own sealed entry and commit need, or the ring can
     * fill up with no way to commit (and, after a crash, no room for
     * the next open's commits). */
    if (!journal_room (c, JOURNAL_RESERVE))
      break;
    if ((r = alloc_refill_ckpt_locked (c)) < 0 && r != -ENOSPC)
      return r;
  }
  if (r < 0) {
    ckpt_free (&ck);
    if (r != -EAGAIN)
      c->failed = true;
    return r == -EAGAIN ? -ENOSPC : r;
  }

  if (c->test_ckpt_hook)
    c->test_ckpt_hook (c, c->test_ckpt_hook_opaque);

  /* Phase 2: encode what the snapshot captured (no lock held: lookups and
   * inserts go on), then data first, then nodes level by level, each
   * level flushed before its parents are written. */
  r = 0;
  for (i = 0; i < ck.nw && r == 0; i++)
    r = encode_bset (c, &ck.w[i]);
  if (ck.nw)
    qsort (ck.w, ck.nw, sizeof *ck.w, cmp_level);
  if (r == 0 && ck.nw)
    r = export_barrier (c, changes);
  if (r == 0)
    r = bcf_io_flush (c->io);
  for (i = 0; i < ck.nw && r == 0; i = j) {
    struct bcf_io_seg segs[64];
    unsigned n = 0;

    level = ck.w[i].level;
    for (j = i; j < ck.nw && ck.w[j].level == level; j++) {
      segs[n++] = (struct bcf_io_seg) {
        .op = BCF_IO_WRITE, .buf = ck.w[j].buf, .len = ck.w[j].len,
        .off = ck.w[j].off,
      };
      if (n == 64 || j + 1 == ck.nw || ck.w[j + 1].level != level) {
        if ((r = bcf_io_submit (c->io, segs, n)) < 0)
          break;
        n = 0;
      }
    }
    if (r == 0)
      r = bcf_io_flush (c->io);
  }
  ckpt_free (&ck);

  /* Phase 3: commit, in an entry after the sealed one (step 3 above). */
  if (r == 0 && last_seq > 1)
    r = journal_flush_sealed (c, last_seq - 1);
  if (r == 0) {
    pthread_mutex_lock (&c->journal.lock);
    c->committed_root = root;
    c->committed_level = root_level;
    pthread_mutex_unlock (&c->journal.lock);
    journal_set_last_seq (c, last_seq);
    r = journal_meta (c);
  }
  if (r < 0) {
    bcf_log (c, BCF_LOG_ERROR, "btree checkpoint failed: %s; the cache is "
             "now read-only", strerror (-r));
    c->failed = true;
    return r;
  }

  /* Phase 4: buckets freed before this snapshot are unreachable now. */
  tree_wrlock_timing (c, NULL);
  for (i = j = 0; i < c->tree.ndead; i++) {
    if (c->tree.dead[i].epoch <= epoch)
      alloc_release_meta (c, c->tree.dead[i].bucket);
    else
      c->tree.dead[j++] = c->tree.dead[i];
  }
  c->tree.ndead = j;
  c->tree.ckpt_uncommitted = false;   /* committed: all it took is durable */
  atomic_store (&c->ckpt_begun_ns, t0);
  btree_evict_locked (c);
  tree_wrunlock_into (c, &c->stats.ckpt_locked);
  bcf_time_record (c, &c->stats.checkpoint, bcf_now_ns () - t0);
  atomic_store (&c->ckpt_done_ns, bcf_now_ns ());
  return 0;
}
