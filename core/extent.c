/* bcachefilter engine: extent operations (include/bcachefilter/cache.h,
 * "Reads", "The cache-miss protocol", "Writes and invalidation").
 *
 * Design
 * ------
 * The operations the request path needs, built from the modules: lookups
 * read the btree under tree_lock (read); inserts take it for writing just
 * long enough to add their keys to the journal and the tree, so journal
 * order is tree order; all device I/O (data writes, hit reads, journal
 * and node writes) happens with no btree lock held.
 *
 * Keys are at most 65535 sectors (KEY_SIZE is 16 bits) and a data extent
 * lies in one bucket, so long ranges become several keys; each piece of a
 * cache-miss fill is replace-inserted against the matching piece of the
 * check key (same pointer-minus-start relation), so pieces succeed or
 * collide independently.
 *
 * Cache hits are read and then the pointer's gen is checked again: if the
 * bucket was invalidated meanwhile the data may belong to a new owner, so
 * the read is reported stale and the caller goes to the backing store
 * (bcache's cache_read_races), or for dirty data, which the backing store
 * may not have, looks the range up again (request.c, read_hit).  The gen
 * is stored with release order when a bucket is invalidated, and the
 * allocator never hands a bucket out before its new gen is persisted,
 * which takes far longer than any read; the recheck closes the remaining
 * window.
 *
 * Locking: see engine.h.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define MAX_KEY_SECTORS BKEY_MAX_SIZE

/* ---- helpers --------------------------------------------------------------------- */

/* Check the alignment of a request; returns its sectors. */
static int
to_sectors (struct bcf_cache *c, uint64_t offset, uint64_t len,
            uint64_t *start, uint64_t *end)
{
  if (len == 0 || offset % c->block_bytes || len % c->block_bytes ||
      offset + len < offset ||
      (offset + len) >> BCH_SECTOR_SHIFT > c->backing_sectors)
    return -EINVAL;
  *start = offset >> BCH_SECTOR_SHIFT;
  *end = (offset + len) >> BCH_SECTOR_SHIFT;
  return 0;
}

/* The guards of every call that puts new data into the cache (a miss's
 * check key, a write's keys): a read-only cache takes nothing (-EROFS),
 * a failed one nothing new (-ENOSPC), and the range must be whole
 * blocks (to_sectors). */
static int
new_data_range (struct bcf_cache *c, uint64_t offset, uint64_t len,
                uint64_t *start, uint64_t *end)
{
  if (c->opts.readonly)
    return -EROFS;
  if (c->failed)
    return -ENOSPC;
  return to_sectors (c, offset, len, start, end);
}

/* What [s, e) holds, as an invalidation sees it (bcf_invalidate). */
enum range_state {
  RANGE_EMPTY,                /* no key at all */
  RANGE_VOLATILE,             /* check keys, and data keys only memory has */
  RANGE_PERSISTENT,           /* a data key a crash could bring back, or a
                                 leaf not in memory */
};

/* Is data key k of leaf n only in memory: inserted since n's open set
 * was last captured by a checkpoint, and not journalled?  Then no
 * recovery can bring it back.  A key in the open set is exactly one
 * inserted since the capture: a capture takes the whole open set, a
 * split or merge hands its open set on to the new nodes (btree.c's
 * inherit_open), and a pointer is never inserted twice (a fill writes to
 * newly allocated space).  Keys cut by later inserts are cut alike in
 * both sets, so the pieces still match.
 * open_jdata covers keys the journal holds: bcf_insert's, and those
 * replayed at open (which a writable open then checkpoints anyway), and
 * the clean copies of dirty keys (a crash brings those back dirty). */
static bool
key_only_in_memory (const struct btree_node *n, const struct ckey *k)
{
  return !n->open_jdata && keyset_contains (&n->open, k);
}

/* Look at [s, e) under tree_lock.  Any data key counts, stale ones too: a
 * bucket invalidated in memory gets its new gen persisted only with the
 * next prio write, so after a crash before that its old keys are valid
 * again.  (Stale keys already dropped from memory are bcf_invalidate's
 * other check.)  *rseq: the newest journal entry holding an insert into
 * the leaves of the range that removed a key a crash could bring back
 * (removal_seq; see bcf_invalidate), counted only where such a removal
 * can be in this range: a removal since the leaf's last checkpoint
 * capture is a key or whiteout in its open set, and one that capture
 * took is durable once it commits (the commit's journal entry follows
 * it).  So a leaf's pending removal elsewhere in the leaf does not make
 * a write here wait. */
static enum range_state
range_state_locked (struct bcf_cache *c, uint64_t s, uint64_t e,
                    uint64_t *rseq)
{
  enum range_state st = RANGE_EMPTY;
  uint64_t pos = s;

  *rseq = 0;
  while (pos < e) {
    struct btree_node *leaf = btree_find_leaf (c, c->inode, pos + 1);
    const struct keyset *ks;
    uint64_t leaf_end;

    if (!leaf || leaf->evicted)
      return RANGE_PERSISTENT;    /* not in memory: assume cached (safe) */
    leaf_end = ckey_inode (&leaf->key) == c->inode ? ckey_end (&leaf->key)
               : UINT64_MAX;
    if (leaf->removal_seq > *rseq &&
        (c->tree.ckpt_uncommitted ||
         btree_open_overlaps_locked (c, leaf, c->inode, pos,
                                     e < leaf_end ? e : leaf_end)))
      *rseq = leaf->removal_seq;
    ks = &leaf->keys;
    for (size_t i = keyset_search (ks, c->inode, pos); i < ks->nr; i++) {
      const struct ckey *k = &ks->k[i];
      if (ckey_inode (k) != c->inode || ckey_start (k) >= e)
        break;
      if (ckey_has_ptr (k) && !ckey_is_check (k) &&
          !key_only_in_memory (leaf, k))
        return RANGE_PERSISTENT;
      st = RANGE_VOLATILE;
    }
    pos = leaf_end;
  }
  return st;
}

/* range_state_locked under tree_lock, with the allocator's word on stale
 * keys a crash could revive (*unpersisted: gens not yet persisted), the
 * two things that say whether anything in [s, e) could come back: what
 * bcf_invalidate and bcf_write_fill_begin both ask. */
static enum range_state
range_look (struct bcf_cache *c, uint64_t s, uint64_t e, uint64_t *rseq,
            bool *unpersisted)
{
  enum range_state st;

  pthread_rwlock_rdlock (&c->tree_lock);
  st = range_state_locked (c, s, e, rseq);
  *unpersisted = alloc_gens_unpersisted (c);
  pthread_rwlock_unlock (&c->tree_lock);
  return st;
}

/* How insert_key journals its key. */
enum journal_how {
  JOURNAL_NEVER,              /* check keys: memory only */
  JOURNAL_ALWAYS,             /* data keys of writes (bcf_insert, dirty
                                 writes) */
  JOURNAL_IF_PERSISTENT,      /* whiteouts: where a crash could bring back
                                 what they remove (bcf_invalidate) */
};

/* What a durable insert must wait for, collected over its pieces. */
struct durability {
  uint64_t seq;               /* journal entry to make durable */
  bool ordered;               /* ... before the caller's backing write
                                 (dirty writes: see bcf_write_begin) */
  bool returns_dirty;         /* ... and a write-intent mark cannot stand
                                 in (btree_range_returns_dirty_locked) */
  bool marked;                /* in: the caller holds durable write-intent
                                 marks on the range, so a data key that
                                 brings back no dirty data needs no journal
                                 entry (bcf_write_begin_through) */
};

/* Is journal entry seq possibly not durable yet?  A relaxed read of
 * durable_seq: a stale value only makes a caller wait for an entry that
 * turns out to be durable already. */
static bool
journal_pending (struct bcf_cache *c, uint64_t seq)
{
  return seq > __atomic_load_n (&c->journal.durable_seq, __ATOMIC_RELAXED);
}

/* Insert under the tree lock, journalled as `how` says, and raise *d
 * (if not NULL) to what the caller must make durable for the insert to
 * be: the key's own entry, and for whiteouts also the pending removals
 * of the leaves (removal_seq).  With expect, only if [start, end) of k
 * still holds expect (a conditional invalidation: -EEXIST otherwise).
 * Check keys (JOURNAL_NEVER) are never laid over dirty data: -EEXIST.
 * An insert journalled because a crash could bring back what it removes
 * records that in the leaves (btree_note_removal_locked).  Handles a
 * full journal entry by dropping the lock and making room. */
static int
insert_key (struct bcf_cache *c, const struct ckey *k, enum journal_how how,
            const struct ckey *expect, struct durability *d)
{
  const uint64_t ks = ckey_start (k), ke = ckey_end (k);

  for (;;) {
    struct ckey need;
    uint64_t s = 0, rseq = 0;
    bool journal = how == JOURNAL_ALWAYS, removes = false;
    int r;

    tree_wrlock (c);
    if (!btree_range_loaded (c, ckey_inode (k), ks, ke, &need)) {
      tree_wrunlock (c);
      if ((r = btree_load_evicted (c, &need)) < 0)
        return r;
      continue;
    }
    if ((expect && !btree_range_matches_locked (c, k, expect)) ||
        (how == JOURNAL_NEVER &&
         btree_range_dirty_locked (c, c->inode, ks, ke))) {
      tree_wrunlock (c);
      return -EEXIST;
    }
    if (how == JOURNAL_ALWAYS && d && d->marked &&
        !btree_range_returns_dirty_locked (c, c->inode, ks, ke)) {
      /* Under a mark nothing older that comes back clean is served after
       * a crash, and nothing comes back dirty here: the key need not
       * survive a crash, so neither journal nor wait. */
      journal = false;
    }
    else if (how != JOURNAL_NEVER) {
      /* Decided here, under the lock the insert holds: a checkpoint's
       * capture cannot come between the look and the insert. */
      removes = range_state_locked (c, ks, ke, &rseq) == RANGE_PERSISTENT ||
                alloc_gens_unpersisted (c);
      if (how == JOURNAL_IF_PERSISTENT)
        journal = removes;
      if (d && how == JOURNAL_IF_PERSISTENT && rseq > d->seq)
        d->seq = rseq;
      if (d && how == JOURNAL_ALWAYS &&
          (removes || journal_pending (c, rseq))) {
        d->ordered = true;
        /* (Under marks it was asked above, and nothing reads it.) */
        if (!d->marked && !d->returns_dirty &&
            btree_range_returns_dirty_locked (c, c->inode, ks, ke))
          d->returns_dirty = true;
      }
    }
    if (journal) {
      s = journal_add_key_locked (c, k);
      if (s == 0) {
        tree_wrunlock (c);
        if ((r = journal_make_room (c)) < 0)
          return r;
        continue;
      }
      if (d && s > d->seq)
        d->seq = s;
    }
    r = btree_insert_locked (c, k, s);
    if (r == 0 && s && removes)
      btree_note_removal_locked (c, ckey_inode (k), ks, ke, s);
    tree_wrunlock (c);
    return r;
  }
}

/* Device I/O from / to a caller's buffer, which need not be aligned as
 * O_DIRECT requires: misaligned buffers go through an aligned bounce
 * buffer. */

/* The len bytes at data, aligned for the device: data itself, or a
 * pooled copy left in *bounce (free it with bcf_buf_free (*bounce, len);
 * NULL when no copy was needed).  NULL if the copy cannot be made. */
static const void *
aligned_source (const void *data, size_t len, void **bounce)
{
  *bounce = NULL;
  if ((uintptr_t) data % BCF_BUF_ALIGN == 0)
    return data;
  if (!(*bounce = bcf_buf_alloc (len)))
    return NULL;
  memcpy (*bounce, data, len);
  return *bounce;
}

static int
dev_read (struct bcf_cache *c, void *data, size_t len, uint64_t off)
{
  void *b;
  int r;

  if ((uintptr_t) data % BCF_BUF_ALIGN == 0)
    return bcf_io_pread (c->io, data, len, off);
  if (!(b = bcf_buf_alloc (len)))
    return -ENOMEM;
  r = bcf_io_pread (c->io, b, len, off);
  if (r == 0)
    memcpy (data, b, len);
  bcf_buf_free (b, len);
  return r;
}

/* Replace insert under the tree lock, loading evicted leaves first.
 * Returns 0, -EEXIST (collision) or -errno. */
static int
replace_key (struct bcf_cache *c, const struct ckey *k,
             const struct ckey *expect)
{
  for (;;) {
    int r;

    tree_wrlock (c);
    r = btree_replace_locked (c, k, expect);
    if (r == -ENODATA) {
      struct ckey need;
      bool loaded = btree_range_loaded (c, ckey_inode (k), ckey_start (k),
                                        ckey_end (k), &need);
      tree_wrunlock (c);
      if (!loaded && (r = btree_load_evicted (c, &need)) < 0)
        return r;
      continue;
    }
    tree_wrunlock (c);
    return r;
  }
}

/* ---- reads ------------------------------------------------------------------------ */

int
bcf_lookup (struct bcf_cache *c, uint64_t offset, uint64_t len,
            struct bcf_extent *out, unsigned max, unsigned *n)
{
  const uint64_t inode = c->inode;
  uint64_t pos, end;
  unsigned i = 0;
  int r;

  *n = 0;
  if ((r = to_sectors (c, offset, len, &pos, &end)) < 0 || max == 0)
    return r < 0 ? r : -EINVAL;

  lookup_rdlock (c);
  while (pos < end && i < max) {
    struct btree_node *leaf = btree_find_leaf (c, inode, pos + 1);
    const struct keyset *s;
    size_t ki;

    if (!leaf) {
      r = -EIO;
      break;
    }
    if (leaf->evicted) {
      struct ckey need = leaf->key;
      pthread_rwlock_unlock (&c->tree_lock);
      r = btree_load_evicted (c, &need);
      lookup_rdlock (c);
      if (r < 0)
        break;
      continue;
    }
    btree_touch (c, leaf);
    s = &leaf->keys;
    for (ki = keyset_search (s, inode, pos); pos < end && i < max; ki++) {
      const struct ckey *k = ki < s->nr && ckey_inode (&s->k[ki]) == inode
                             ? &s->k[ki] : NULL;
      uint64_t leaf_end = ckey_inode (&leaf->key) == inode
                          ? ckey_end (&leaf->key) : UINT64_MAX;
      uint64_t stop, kstart = k ? ckey_start (k) : UINT64_MAX;
      bool hit = false;

      if (kstart > pos) {               /* a hole before k */
        stop = kstart < end ? kstart : end;
        if (stop > leaf_end)
          stop = leaf_end;
        ki--;                           /* look at k again */
      }
      else {
        stop = ckey_end (k) < end ? ckey_end (k) : end;
        hit = ckey_has_ptr (k) && !ckey_is_check (k) &&
              !ptr_stale (c, k->ptr);
      }
      if (hit) {
        uint64_t dev = PTR_OFFSET (k->ptr) + (pos - kstart);
        out[i++] = (struct bcf_extent) {
          .kind = BCF_EXTENT_HIT, .dirty = ckey_dirty (k),
          .offset = pos << BCH_SECTOR_SHIFT,
          .len = (stop - pos) << BCH_SECTOR_SHIFT,
          .dev_offset = dev << BCH_SECTOR_SHIFT,
          .ptr = MAKE_PTR (PTR_GEN (k->ptr), dev, PTR_DEV (k->ptr)),
        };
      }
      else {
        if (i > 0 && out[i - 1].kind == BCF_EXTENT_MISS &&
            out[i - 1].offset + out[i - 1].len == pos << BCH_SECTOR_SHIFT)
          out[i - 1].len += (stop - pos) << BCH_SECTOR_SHIFT;
        else
          out[i++] = (struct bcf_extent) {
            .kind = BCF_EXTENT_MISS, .offset = pos << BCH_SECTOR_SHIFT,
            .len = (stop - pos) << BCH_SECTOR_SHIFT,
          };
      }
      pos = stop;
      if (pos >= leaf_end)
        break;                          /* continue in the next leaf */
    }
  }
  pthread_rwlock_unlock (&c->tree_lock);
  *n = i;
  /* No counting here: a lookup is not a request (the request path counts
   * hits and misses per request, bcache's way), and a shared counter
   * written by every lookup would be a contended line on the hit path. */
  return r;
}

int
bcf_read_hit (struct bcf_cache *c, const struct bcf_extent *e, void *buf)
{
  int r;

  if (e->kind != BCF_EXTENT_HIT)
    return -EINVAL;
  r = dev_read (c, buf, e->len, e->dev_offset);
  if (r < 0)
    return r;
  if (c->test_read_hook)
    c->test_read_hook (c, e, c->test_read_hook_opaque);
  if (ptr_stale (c, e->ptr)) {
    bcf_stats_add (c->counters, BCF_STAT_READ_RACES, 1);
    return -ESTALE;
  }
  alloc_touch (c, bucket_of_ptr (c, e->ptr));
  return 0;
}

/* ---- the cache-miss protocol ------------------------------------------------------- */

static uint64_t
random_check_offset (void)
{
  static _Atomic uint64_t counter;
  uint64_t x = bcf_now_ns () + (atomic_fetch_add (&counter, 1) << 32);
  x ^= x >> 31;
  x *= 0x7fb5d329728ea185ull;
  x ^= x >> 27;
  /* Leave room for the pointer to move with trimming (< 2^42). */
  return x & ((1ull << 41) - 1);
}

/* The piece [s, e) of a range key whose first sector is at ptr (offset
 * moves with the start). */
static struct ckey
range_piece (const struct bcf_cache *c, uint64_t s, uint64_t e,
             uint64_t range_start, bool has_ptr, uint64_t ptr, bool dirty)
{
  uint64_t p = has_ptr ? MAKE_PTR (PTR_GEN (ptr),
                                   PTR_OFFSET (ptr) + (s - range_start),
                                   PTR_DEV (ptr)) : 0;
  return ckey_make (c->inode, e, e - s, has_ptr, p, dirty);
}

int
bcf_miss_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
                struct bcf_miss *m)
{
  uint64_t s, e;
  int r;

  if ((r = new_data_range (c, offset, len, &s, &e)) < 0)
    return r;
  m->offset = offset;
  m->len = len;
  m->check_ptr = MAKE_PTR (0, random_check_offset (), PTR_CHECK_DEV);
  for (uint64_t p = s; p < e; p += MAX_KEY_SECTORS) {
    uint64_t pe = p + MAX_KEY_SECTORS < e ? p + MAX_KEY_SECTORS : e;
    struct ckey k = range_piece (c, p, pe, s, true, m->check_ptr, false);
    if ((r = insert_key (c, &k, JOURNAL_NEVER, NULL, NULL)) < 0)
      return r;
  }
  return 0;
}

/* One chunk of a fill: a piece of one miss, written to one allocation. */
struct fill_chunk {
  unsigned miss;                /* index into the batch */
  uint64_t s, e;                /* sectors */
  uint64_t ptr;                 /* from alloc_sectors; 0 = not allocated */
};

/* The largest piece of data one allocation takes (a fill's chunk, a
 * write's piece): a key's size, within a bucket, in whole blocks. */
static uint64_t
data_chunk_sectors (const struct bcf_cache *c)
{
  uint64_t chunk = c->bucket_sectors < MAX_KEY_SECTORS ? c->bucket_sectors
                   : MAX_KEY_SECTORS;
  return chunk / (c->block_bytes >> BCH_SECTOR_SHIFT) *
         (c->block_bytes >> BCH_SECTOR_SHIFT);
}

/* Give back the allocations of chunks [from, to) that have one. */
static void
put_chunks (struct bcf_cache *c, struct fill_chunk *ch, size_t from,
            size_t to)
{
  for (size_t i = from; i < to; i++)
    if (ch[i].ptr) {
      alloc_put (c, ch[i].ptr);
      ch[i].ptr = 0;
    }
}

/* Batched fills.  Three phases, so that the device sees the writes of the
 * whole batch at once (one submission: the block layer merges the ones
 * allocated next to each other, and the device gets one doorbell, which
 * on a virtual machine is the dominant cost of a small write):
 *   1. allocate every chunk (a miss whose allocation fails is cancelled);
 *   2. write them all with one bcf_io_submit;
 *   3. per miss, in chunk order: replace-insert each written chunk against
 *      the check key; at the first chunk whose write failed, give the rest
 *      back and cancel the miss (its earlier chunks stay: each was inserted
 *      against our own check key, so it is exactly the data read).
 * Each allocation stays pinned (alloc_put not yet called) from phase 1 to
 * its insert, so no bucket is invalidated under its write. */
void
bcf_miss_fill_many (struct bcf_cache *c, struct bcf_miss *const *ms,
                    const void *const *data, unsigned n, int *res)
{
  const uint64_t chunk = data_chunk_sectors (c);
  struct fill_chunk *ch = NULL;
  struct bcf_io_seg *segs = NULL;
  void **bounce = NULL;
  size_t nch = 0, k;
  int r;

  for (unsigned i = 0; i < n; i++) {
    res[i] = 0;
    nch += (ms[i]->len / BCH_SECTOR_SIZE + chunk - 1) / chunk;
  }
  ch = calloc (nch ? nch : 1, sizeof *ch);
  segs = calloc (nch ? nch : 1, sizeof *segs);
  bounce = calloc (n ? n : 1, sizeof *bounce);
  if (!ch || !segs || !bounce) {
    for (unsigned i = 0; i < n; i++) {
      bcf_miss_cancel (c, ms[i]);
      res[i] = -ENOMEM;
    }
    goto out;
  }

  /* 1. Allocate. */
  k = 0;
  for (unsigned i = 0; i < n; i++) {
    const uint64_t s = ms[i]->offset >> BCH_SECTOR_SHIFT;
    const uint64_t e = (ms[i]->offset + ms[i]->len) >> BCH_SECTOR_SHIFT;
    const uint8_t *src = aligned_source (data[i], ms[i]->len, &bounce[i]);
    const size_t first = k;

    if (!src)
      res[i] = -ENOMEM;
    for (uint64_t p = s; p < e && res[i] == 0; p += chunk) {
      uint64_t pe = p + chunk < e ? p + chunk : e;

      if (c->failed)
        res[i] = -ENOSPC;
      else if ((r = alloc_sectors (c, (uint32_t) (pe - p), false,
                                   &ch[k].ptr)) < 0)
        res[i] = r;
      else {
        ch[k].miss = i;
        ch[k].s = p;
        ch[k].e = pe;
        segs[k] = (struct bcf_io_seg) {
          .op = BCF_IO_WRITE,
          .buf = (void *) (src + ((p - s) << BCH_SECTOR_SHIFT)),
          .len = (pe - p) << BCH_SECTOR_SHIFT,
          .off = PTR_OFFSET (ch[k].ptr) << BCH_SECTOR_SHIFT,
        };
        k++;
      }
    }
    if (res[i] < 0) {
      put_chunks (c, ch, first, k);
      k = first;
      bcf_miss_cancel (c, ms[i]);
    }
  }
  nch = k;

  /* 2. Write. */
  if (nch)
    bcf_io_submit (c->io, segs, (unsigned) nch);

  /* 3. Insert, per miss in chunk order. */
  for (k = 0; k < nch; k++) {
    const unsigned i = ch[k].miss;
    const uint64_t s = ms[i]->offset >> BCH_SECTOR_SHIFT;
    struct ckey key, expect;

    if (res[i] < 0 && res[i] != -EEXIST) {
      put_chunks (c, ch, k, k + 1);   /* the miss failed on an earlier chunk */
      continue;
    }
    if (segs[k].result < 0) {
      put_chunks (c, ch, k, k + 1);
      bcf_miss_cancel (c, ms[i]);
      res[i] = segs[k].result;
      continue;
    }
    key = range_piece (c, ch[k].s, ch[k].e, ch[k].s, true, ch[k].ptr, false);
    expect = range_piece (c, ch[k].s, ch[k].e, s, true, ms[i]->check_ptr,
                          false);
    r = replace_key (c, &key, &expect);
    put_chunks (c, ch, k, k + 1);
    if (r == -EEXIST) {
      if (res[i] != -EEXIST)    /* counted once per miss */
        bcf_stats_add (c->counters, BCF_STAT_MISS_COLLISIONS, 1);
      res[i] = -EEXIST;
    }
    else if (r < 0)
      res[i] = r;
  }
  for (unsigned i = 0; i < n; i++)
    if (res[i] == 0)
      atomic_fetch_add (&c->stats.inserts, 1);

 out:
  if (bounce)
    for (unsigned i = 0; i < n; i++)
      bcf_buf_free (bounce[i], ms[i]->len);
  free (bounce);
  free (segs);
  free (ch);
}

int
bcf_miss_fill (struct bcf_cache *c, struct bcf_miss *m, const void *data)
{
  int r;

  bcf_miss_fill_many (c, &m, &data, 1, &r);
  return r;
}

void
bcf_miss_cancel (struct bcf_cache *c, struct bcf_miss *m)
{
  const uint64_t s = m->offset >> BCH_SECTOR_SHIFT;
  const uint64_t e = (m->offset + m->len) >> BCH_SECTOR_SHIFT;

  for (uint64_t p = s; p < e; p += MAX_KEY_SECTORS) {
    uint64_t pe = p + MAX_KEY_SECTORS < e ? p + MAX_KEY_SECTORS : e;
    struct ckey w = range_piece (c, p, pe, s, false, 0, false);
    struct ckey expect = range_piece (c, p, pe, s, true, m->check_ptr, false);
    /* Only where our check key is still whole; otherwise someone else's
     * key is there now and must stay. */
    replace_key (c, &w, &expect);
  }
}

/* ---- writes and invalidation ------------------------------------------------------ */

/* An invalidation is journalled only where a crash could bring back what
 * it removes; elsewhere the whiteout only has to reach the tree in memory
 * (to remove what is there and make in-flight misses collide).  Recovery
 * rebuilds the tree from committed nodes and replays the journal, so the
 * keys it can bring back are those a checkpoint captured or the journal
 * holds (RANGE_PERSISTENT), and stale keys dropped from memory while their
 * bucket's new gen was not yet persisted (alloc_gens_unpersisted, read
 * after the look at the tree; the rule and its ordering are in alloc.c's
 * header).  Keys only in memory (range_state_locked) cannot come
 * back, so a write to a range a miss filled since the last checkpoint —
 * a read-modify-write — costs no journal write and no flush.  The choice
 * is made under the write lock of the insert itself (insert_key), so no
 * checkpoint can capture a key between the look and the whiteout.
 *
 * Durable: the caller's backing write must not start before every
 * insert that removed data a crash could bring back is durable — ours,
 * and any earlier one not yet written: an invalidation on the read path
 * (durable = false), a dirty write over cached data, or a concurrent
 * writer's whiteout that is still waiting for its journal write.  Such a
 * removal leaves no key in the merged set, so our look can see EMPTY or
 * VOLATILE where it was; the leaf remembers it in removal_seq (inherited
 * through splits and merges), and we wait for that entry too.  That is a
 * wait only while the entry is not yet written, and only for writers in
 * the same leaf.
 *
 * Where there is no key at all, and nothing unpersisted, there is nothing
 * for a whiteout to do: a miss whose check key goes in after our look is
 * ordered after our caller's tracker registration (request.c's protocol),
 * and a write racing with us is a concurrent write of the same range,
 * which the tracker orders.  So a write to a range nobody cached costs no
 * key in the node's open set (written at the next checkpoint) and no
 * insert. */
/* bcf_invalidate without the wait: *d gets the journal entry that must
 * be durable before the backing store may change. */
static int
invalidate_range (struct bcf_cache *c, uint64_t offset, uint64_t len,
                  struct durability *d)
{
  uint64_t s, e;
  enum range_state st;
  bool unpersisted;
  int r;

  if (c->opts.readonly)
    return -EROFS;
  if ((r = to_sectors (c, offset, len, &s, &e)) < 0)
    return r;
  atomic_fetch_add (&c->stats.invalidates, 1);
  st = range_look (c, s, e, &d->seq, &unpersisted);
  if (st != RANGE_EMPTY || unpersisted)
    for (uint64_t p = s; p < e; p += MAX_KEY_SECTORS) {
      uint64_t pe = p + MAX_KEY_SECTORS < e ? p + MAX_KEY_SECTORS : e;
      struct ckey w = range_piece (c, p, pe, s, false, 0, false);
      if ((r = insert_key (c, &w, JOURNAL_IF_PERSISTENT, NULL, d)) < 0)
        return r;
    }
  return 0;
}

int
bcf_invalidate (struct bcf_cache *c, uint64_t offset, uint64_t len,
                bool durable)
{
  struct durability d = { 0 };
  int r = invalidate_range (c, offset, len, &d);

  if (r == 0 && durable && d.seq)
    return journal_flush_seq (c, d.seq);
  return r;
}

/* The one rule by which a write lets a durable write-intent mark on
 * [s, e) stand in for waiting until its keys (or whiteouts) are on the
 * journal (intent.c): while the caller holds the mark, and until a
 * checkpoint that holds those keys commits, recovery drops every clean
 * key of the region, so a crash that loses them brings back nothing that
 * is served.  Not where a dirty version of the range could come back
 * (returns_dirty: recovery keeps dirty keys and writes them back), nor
 * with write-intent regions off.  Asked after the keys are in.  True if
 * the caller now holds the marks (intent_write_end, through
 * bcf_write_release); false if it must wait instead. */
static bool
mark_instead_of_wait (struct bcf_cache *c, uint64_t s, uint64_t e,
                      bool returns_dirty)
{
  return !returns_dirty && !c->opts.write_intent_off &&
         intent_write_begin (c, s, e) == 0;
}

/* A write that goes around the cache invalidates the range durably
 * before its backing write (DESIGN.md's bypass-write ordering), which
 * where the range holds data a crash could bring back is a journal write
 * in series with the write: under the congestion bypass, a FUA write on
 * the device that was found congested, for every such write.  A
 * write-intent mark stands in for it as it does for a writethrough
 * write's keys (mark_instead_of_wait).  Whether a dirty version could
 * come back is asked after the whiteout is in, under the write's turn,
 * so nothing else changes the range meanwhile, and conservatively (a
 * checkpoint that is not committed counts as bringing everything back).
 * An unmarked region is marked, one journal write, as the invalidation's
 * own would have been; later writes there wait for none. */
int
bcf_invalidate_before_write (struct bcf_cache *c, uint64_t offset,
                             uint64_t len, struct bcf_write *w)
{
  struct durability d = { 0 };
  uint64_t s, e;
  bool returns;
  int r;

  memset (w, 0, sizeof *w);
  if ((r = invalidate_range (c, offset, len, &d)) < 0 || d.seq == 0 ||
      !journal_pending (c, d.seq))
    return r;
  if (!c->opts.write_intent_off && to_sectors (c, offset, len, &s, &e) == 0) {
    pthread_rwlock_rdlock (&c->tree_lock);
    returns = btree_range_returns_dirty_locked (c, c->inode, s, e);
    pthread_rwlock_unlock (&c->tree_lock);
    if (mark_instead_of_wait (c, s, e, returns)) {
      w->offset = offset;
      w->len = len;
      w->intent = true;
      atomic_fetch_add (&c->stats.invalidates_marked, 1);
      return 0;
    }
  }
  return journal_flush_seq (c, d.seq);
}

int
bcf_drop_hit (struct bcf_cache *c, const struct bcf_extent *e)
{
  uint64_t s, end;
  struct ckey w, expect;
  int r;

  if (c->opts.readonly)
    return -EROFS;
  if (e->kind != BCF_EXTENT_HIT || e->dirty ||
      (r = to_sectors (c, e->offset, e->len, &s, &end)) < 0)
    return -EINVAL;
  atomic_fetch_add (&c->stats.invalidates, 1);
  w = range_piece (c, s, end, s, false, 0, false);
  expect = ckey_make (c->inode, end, end - s, true,
                      MAKE_PTR (PTR_GEN (e->ptr),
                                e->dev_offset >> BCH_SECTOR_SHIFT,
                                PTR_DEV (e->ptr)), false);
  r = insert_key (c, &w, JOURNAL_IF_PERSISTENT, &expect, NULL);
  return r == -EEXIST ? 0 : r;
}

/* Allocate new cache space for [s, e) (sectors) in pieces of at most
 * data_chunk_sectors, pinned until given back with alloc_put; ptr[i]
 * gets piece i's pointer and segs[i] its device write from src (which
 * holds the range from s).  *got counts the pieces allocated, also when
 * one fails.  Returns 0 or -errno (-ENOSPC: no room now). */
static int
alloc_pieces (struct bcf_cache *c, uint64_t s, uint64_t e, const uint8_t *src,
              bool dirty, uint64_t *ptr, struct bcf_io_seg *segs,
              unsigned *got)
{
  const uint64_t chunk = data_chunk_sectors (c);
  int r = 0;

  for (uint64_t p = s; r == 0 && p < e; p += chunk) {
    uint64_t pe = p + chunk < e ? p + chunk : e;

    if ((r = alloc_sectors (c, (uint32_t) (pe - p), dirty, &ptr[*got])) < 0)
      break;
    segs[*got] = (struct bcf_io_seg) {
      .op = BCF_IO_WRITE,
      .buf = (void *) (src + ((p - s) << BCH_SECTOR_SHIFT)),
      .len = (pe - p) << BCH_SECTOR_SHIFT,
      .off = PTR_OFFSET (ptr[*got]) << BCH_SECTOR_SHIFT,
    };
    (*got)++;
  }
  return r;
}

/* Write [s, e) of data (sectors; data holds the range from s) to new
 * cache space and insert it, journalled, as one key per piece of at most
 * data_chunk_sectors; the pieces' pointers go to ptrs (if not NULL).
 * Raises *d.
 *
 * In three phases, as bcache's data insert collects its keys and inserts
 * them once every piece is written: allocate every piece, write them all
 * (one submission), then insert the keys.  So no room, or a cache
 * device that fails a data write, changes nothing in the tree: the range
 * keeps whatever it held, dirty data of earlier writes included, and the
 * caller decides what to do with it (request.c writes that data back
 * before it invalidates the range).  An earlier version inserted piece by
 * piece and, on a failure, invalidated the whole range in memory: that
 * dropped the older dirty data under the pieces it had not reached, the
 * only copy of acknowledged writes, before the backing store had anything
 * newer (the soak's writeback time travel).  Only an insert that fails
 * (the journal or a node read failing: the device is going) leaves the
 * pieces before it inserted: each holds this write's data, as a dirty
 * key would anyway.  Each allocation stays pinned until its key is in
 * or given up.  Returns 0 or -errno. */
static int
write_pieces (struct bcf_cache *c, uint64_t s, uint64_t e, const void *data,
              bool dirty, uint64_t *ptrs, struct durability *d)
{
  const uint64_t chunk = data_chunk_sectors (c);
  const unsigned n = (unsigned) ((e - s + chunk - 1) / chunk);
  uint64_t *ptr = ptrs ? ptrs : calloc (n, sizeof *ptr);
  struct bcf_io_seg *segs = calloc (n, sizeof *segs);
  void *bounce = NULL;
  const uint8_t *src = NULL;
  unsigned got = 0, put = 0, i;
  int r = 0;

  if (!ptr || !segs ||
      !(src = aligned_source (data, (e - s) << BCH_SECTOR_SHIFT, &bounce)))
    r = -ENOMEM;
  if (r == 0 && c->failed)
    r = -ENOSPC;
  /* 1. Allocate every piece. */
  if (r == 0)
    r = alloc_pieces (c, s, e, src, dirty, ptr, segs, &got);
  /* 2. Write them all. */
  if (r == 0) {
    const uint64_t t0 = bcf_now_ns ();

    bcf_io_submit (c->io, segs, n);
    bcf_time_record (c, &c->stats.cache_write, bcf_now_ns () - t0);
    for (i = 0; i < n && r == 0; i++)
      r = segs[i].result;
  }
  /* 3. Insert the keys, in order; each allocation is given back once
   * its key is in (or failed to go in). */
  for (i = 0; r == 0 && i < n; i++) {
    uint64_t p = s + i * chunk, pe = p + chunk < e ? p + chunk : e;
    struct ckey k = range_piece (c, p, pe, p, true, ptr[i], dirty);

    r = insert_key (c, &k, JOURNAL_ALWAYS, NULL, d);
    alloc_put (c, ptr[i]);
    put = i + 1;
  }
  /* The allocations no insert reached. */
  for (i = put; i < got; i++)
    alloc_put (c, ptr[i]);
  bcf_buf_free (bounce, (e - s) << BCH_SECTOR_SHIFT);
  free (segs);
  if (ptr != ptrs)
    free (ptr);
  return r;
}

int
bcf_insert (struct bcf_cache *c, uint64_t offset, uint64_t len,
            const void *data, bool dirty, bool durable)
{
  struct durability d = { 0 };
  uint64_t s, e;
  int r;

  if (c->opts.readonly)
    return -EROFS;
  if ((r = to_sectors (c, offset, len, &s, &e)) < 0)
    return r;
  r = write_pieces (c, s, e, data, dirty, NULL, &d);
  if (r < 0) {
    /* Never leave older data cached than what the caller wrote. */
    int r2 = bcf_invalidate (c, offset, len, durable);
    return r2 < 0 ? r2 : r;
  }
  atomic_fetch_add (&c->stats.inserts, 1);
  if (durable)
    return journal_flush_seq (c, d.seq);
  return 0;
}

/* ---- dirty writes (DESIGN.md "Writes on dirty keys") ----------------------------- */

/* The key of piece i of w, dirty or clean. */
static struct ckey
write_piece (const struct bcf_cache *c, const struct bcf_write *w,
             unsigned i, bool dirty)
{
  const uint64_t chunk = data_chunk_sectors (c);
  const uint64_t s = (w->offset >> BCH_SECTOR_SHIFT) + i * chunk;
  const uint64_t e = (w->offset + w->len) >> BCH_SECTOR_SHIFT;
  const uint64_t pe = s + chunk < e ? s + chunk : e;

  return range_piece (c, s, pe, s, true, w->ptrs[i], dirty);
}

/* w for the write [offset, +len) (bytes, whole blocks): its pieces, one
 * per allocation of at most data_chunk_sectors.  Returns 0 or -ENOMEM. */
static int
write_init (const struct bcf_cache *c, uint64_t offset, uint64_t len,
            struct bcf_write *w)
{
  const uint64_t chunk = data_chunk_sectors (c);
  const uint64_t sectors = len >> BCH_SECTOR_SHIFT;

  w->offset = offset;
  w->len = len;
  w->npieces = (unsigned) ((sectors + chunk - 1) / chunk);
  w->ptrs = w->npieces <= BCF_WRITE_INLINE ? w->inline_ptrs
            : calloc (w->npieces, sizeof *w->ptrs);
  return w->ptrs ? 0 : -ENOMEM;
}

/* Who writes the backing store, and so what a write-intent mark is for. */
enum write_kind {
  WRITE_ORDERED,              /* the caller, after bcf_write_durable: a
                                 mark may stand in for the journal wait */
  WRITE_THROUGH,              /* the caller, and its keys may go
                                 unjournalled under a mark taken first */
  WRITE_BACK,                 /* the writeback thread, after the keys are
                                 durable (B2): nothing relies on a mark */
};

/* A write's data goes to the cache as dirty keys ("the cache holds data
 * the backing store may not have yet"), journalled, before or alongside
 * its backing write.  Why ordered matters: where the range held data a
 * crash could bring back (a key a checkpoint captured or the journal
 * holds, a stale key of a bucket whose new gen is not persisted, or a
 * removal in the leaf whose entry is not durable yet: the same rule as
 * bcf_invalidate), the dirty key must be durable before the backing
 * write is issued: else a crash after the backing write lands brings the
 * old key back, and the cache serves older data than the export (I2).
 * Where nothing could come back, the two may run in parallel: after a
 * crash either the dirty key survives (and recovery writes the same data
 * back) or it does not (and nothing older is cached).  The decision is
 * made per piece under the lock of its insert. */
static int
write_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
             const void *data, struct bcf_write *w, enum write_kind kind)
{
  struct durability d = { 0 };
  uint64_t s, e;
  int r;

  memset (w, 0, sizeof *w);
  if (c->opts.readonly)
    return -EROFS;
  if ((r = to_sectors (c, offset, len, &s, &e)) < 0)
    return r;
  if ((r = write_init (c, offset, len, w)) < 0)
    return r;
  if (kind == WRITE_THROUGH && !c->opts.write_intent_off &&
      intent_write_begin (c, s, e) == 0)
    w->intent = d.marked = true;
  r = write_pieces (c, s, e, data, true, w->ptrs, &d);
  if (r < 0) {
    /* Nothing is taken out here: the range may hold older dirty data,
     * which must stay until the backing store has something at least as
     * new (the caller writes it back, then invalidates durably). */
    bcf_write_release (c, w);
    return r;
  }
  w->seq = d.seq;
  w->ordered = d.ordered;
  /* A durable write-intent mark on the range makes the journal wait
   * unnecessary (mark_instead_of_wait). */
  if (kind != WRITE_BACK && w->ordered && !w->intent &&
      mark_instead_of_wait (c, s, e, d.returns_dirty)) {
    w->ordered = false;
    w->intent = true;
  }
  atomic_fetch_add (&c->stats.dirty_inserts, 1);
  return 0;
}

int
bcf_write_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
                 const void *data, struct bcf_write *w)
{
  return write_begin (c, offset, len, data, w, WRITE_ORDERED);
}

/* A writeback-mode write makes no backing write of its own: the
 * writeback thread makes it, and only after it has made the keys
 * durable (writeback.c, B2), so no backing write ever relies on this
 * write's ordering, and a mark would only cost a journal write in the
 * write's path (the first in each region) and, after a crash, the
 * clean data of its region. */
int
bcf_write_begin_back (struct bcf_cache *c, uint64_t offset, uint64_t len,
                      const void *data, struct bcf_write *w)
{
  return write_begin (c, offset, len, data, w, WRITE_BACK);
}

/* A writethrough write: its backing write is its own (the caller's W3),
 * so a crash that loses its keys loses nothing the backing store will
 * not have.  Its write-intent regions are marked first (durably: one
 * journal write the first time a region is written), and where no dirty
 * data can come back the keys are not journalled at all (insert_key,
 * d.marked): no journal write for the write, and no clean copy whose
 * dirty version is on the journal, for the next write to the range to
 * wait for.  What a crash then brings back is older clean data (a key a
 * checkpoint wrote, the one the write replaced), which the marks make
 * recovery drop: they stay until a checkpoint that began after the
 * write ended commits (intent_tick), so that the replacement is on disk
 * first.  If the marks cannot be made: bcf_write_begin's way. */
int
bcf_write_begin_through (struct bcf_cache *c, uint64_t offset, uint64_t len,
                         const void *data, struct bcf_write *w)
{
  return write_begin (c, offset, len, data, w, WRITE_THROUGH);
}

int
bcf_write_durable (struct bcf_cache *c, struct bcf_write *w)
{
  return w->ordered ? journal_flush_seq (c, w->seq) : 0;
}

int
bcf_write_sync (struct bcf_cache *c, struct bcf_write *w)
{
  return journal_flush_seq (c, w->seq);
}

int64_t
bcf_write_mark_clean (struct bcf_cache *c, struct bcf_write *w)
{
  int64_t cleaned = 0;

  tree_wrlock (c);
  for (unsigned i = 0; i < w->npieces && cleaned >= 0; i++) {
    struct ckey k = write_piece (c, w, i, true);
    int64_t n = btree_mark_clean_locked (c, &k);
    cleaned = n < 0 ? n : cleaned + n;
  }
  tree_wrunlock (c);
  return cleaned < 0 ? cleaned : cleaned << BCH_SECTOR_SHIFT;
}

int
bcf_write_undo (struct bcf_cache *c, struct bcf_write *w)
{
  /* The range is still the writer's (the tracker orders every other
   * write after it, misses never lay check keys over dirty data), so
   * what is there is our dirty data: an invalidation takes it out, and
   * since it is journalled, so is the whiteout, durable before the
   * caller reports the failure. */
  return bcf_invalidate (c, w->offset, w->len, true);
}

void
bcf_write_release (struct bcf_cache *c, struct bcf_write *w)
{
  if (w->intent)
    intent_write_end (c, w->offset >> BCH_SECTOR_SHIFT,
                      (w->offset + w->len) >> BCH_SECTOR_SHIFT);
  w->intent = false;
  if (w->ptrs && w->ptrs != w->inline_ptrs)
    free (w->ptrs);
  w->ptrs = NULL;
}

/* ---- writes over clean data, in parallel (bcachefilter/cache.h, bcf_write_over_begin) - */

/* What a write over clean data keeps between its two halves: its pieces'
 * device writes, in flight during the caller's backing write. */
struct bcf_write_io {
  struct bcf_io_pending pending;
  void *bounce;                 /* aligned copy of the data (w->len), or NULL */
  unsigned got;                 /* pieces allocated (pinned) */
  struct bcf_io_seg segs[];
};

static void
write_over_free (struct bcf_cache *c, struct bcf_write *w)
{
  struct bcf_write_io *wio = w->io;

  if (wio) {
    for (unsigned i = 0; i < wio->got; i++)
      alloc_put (c, w->ptrs[i]);
    bcf_buf_free (wio->bounce, w->len);
    free (wio);
  }
  w->io = NULL;
  bcf_write_release (c, w);
}

/* Can the range be written in parallel: no dirty data in it and none a
 * crash could bring back (btree_range_returns_dirty_locked)?  Asked
 * under the write's turn, the answer holds until the write ends: only
 * writes put dirty data into a range, and the tracker orders every other
 * one after this write.  A checkpoint that captures the range meanwhile
 * clears dcopies, but only for what it then commits; asked between its
 * capture and its commit, the question answers yes (ckpt_uncommitted)
 * and the write takes cache_write's way. */
static bool
over_clean_data (struct bcf_cache *c, uint64_t s, uint64_t e)
{
  bool returns;

  pthread_rwlock_rdlock (&c->tree_lock);
  returns = btree_range_returns_dirty_locked (c, c->inode, s, e);
  pthread_rwlock_unlock (&c->tree_lock);
  return !returns;
}

/* Why the old data may stay in the tree while the backing write runs,
 * and the new keys go in clean after it, unjournalled:
 *  - reads meanwhile get the old data or, once the keys are in, the new:
 *    either is allowed before the write is acknowledged, and it is
 *    acknowledged only after bcf_write_over_end;
 *  - a read miss in a part of the range that held nothing lays a check
 *    key, sees the write in the tracker and caches nothing; the keys
 *    replace its check key anyway;
 *  - a crash: the range's write-intent regions were marked, durably,
 *    before the backing write, and stay marked until a checkpoint that
 *    began after this write ended has committed (the write holds them
 *    until bcf_write_release).  Recovery drops the clean keys of marked
 *    regions (intent_recover): the old data, whether a checkpoint or the
 *    journal brings it back, and the new keys, which need not survive.
 *    Dirty data would be kept and written back over the export; there is
 *    none (over_clean_data).  Once the mark is cleared, the committed
 *    checkpoint holds the new keys or what replaced them since;
 *  - the export barrier: the caller counts its backing write as an
 *    export change before bcf_write_over_end inserts clean keys, as for
 *    any fill, so no checkpoint persists them before the export was
 *    flushed. */
int
bcf_write_over_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
                      const void *data, struct bcf_write *w)
{
  uint64_t s, e;
  struct bcf_write_io *wio;
  const uint8_t *src;
  int r;

  memset (w, 0, sizeof *w);
  if ((r = new_data_range (c, offset, len, &s, &e)) < 0)
    return r;
  if (c->opts.write_intent_off || !over_clean_data (c, s, e))
    return -EEXIST;
  if ((r = write_init (c, offset, len, w)) < 0)
    return r;
  wio = calloc (1, sizeof *wio + w->npieces * sizeof *wio->segs);
  if (!wio) {
    bcf_write_release (c, w);
    return -ENOMEM;
  }
  w->io = wio;
  if (intent_write_begin (c, s, e) != 0) {
    write_over_free (c, w);
    return -EEXIST;
  }
  w->intent = true;
  if (!(src = aligned_source (data, len, &wio->bounce))) {
    write_over_free (c, w);
    return -ENOMEM;
  }
  if ((r = alloc_pieces (c, s, e, src, false, w->ptrs, wio->segs,
                         &wio->got)) < 0) {
    write_over_free (c, w);
    return r;
  }
  bcf_io_start (c->io, wio->segs, w->npieces, &wio->pending);
  return 0;
}

int
bcf_write_over_end (struct bcf_cache *c, struct bcf_write *w, int backing,
                    bool *device_failed)
{
  struct durability d = { .marked = true };
  const uint64_t t0 = bcf_now_ns ();
  int r = bcf_io_finish (&w->io->pending);

  /* What the write waited for the device beyond its backing write. */
  bcf_time_record (c, &c->stats.cache_write, bcf_now_ns () - t0);
  *device_failed = r < 0;
  for (unsigned i = 0; r == 0 && backing == 0 && i < w->npieces; i++) {
    struct ckey k = write_piece (c, w, i, false);

    r = insert_key (c, &k, JOURNAL_ALWAYS, NULL, &d);
  }
  if (r == 0 && backing == 0) {
    atomic_fetch_add (&c->stats.inserts, 1);
    write_over_free (c, w);
    return 1;
  }
  /* The backing store may hold the new data, or a part of it: the old
   * data must go (durably: the marks would drop it after a crash, but
   * this path is rare enough not to lean on them). */
  r = bcf_invalidate (c, w->offset, w->len, true);
  write_over_free (c, w);
  return r < 0 ? r : 0;
}

/* ---- writes cached as fills (bcachefilter/cache.h, bcf_write_fill_begin) ------------ */

int
bcf_write_fill_begin (struct bcf_cache *c, uint64_t span_off,
                      uint64_t span_len)
{
  uint64_t s, e, rseq;
  bool unpersisted;
  int r;

  if ((r = new_data_range (c, span_off, span_len, &s, &e)) < 0)
    return r;
  /* Only where nothing could come back: no key at all (bcf_invalidate's
   * test for a removal that needs no journal), no stale key a crash
   * could revive (unpersisted gens), no removal still in flight to the
   * journal.  The write's turn keeps it so until its check key goes in
   * (a read miss meanwhile lays a check key and takes it out again). */
  if (range_look (c, s, e, &rseq, &unpersisted) != RANGE_EMPTY ||
      unpersisted || (rseq && journal_pending (c, rseq)))
    return -EEXIST;
  return 0;
}

/* ---- dirty data ------------------------------------------------------------------- */

/* The dirty key an extent from bcf_dirty_scan describes. */
static struct ckey
dirty_key_of (const struct bcf_cache *c, const struct bcf_extent *e)
{
  uint64_t s = e->offset >> BCH_SECTOR_SHIFT;
  uint64_t end = (e->offset + e->len) >> BCH_SECTOR_SHIFT;

  return ckey_make (c->inode, end, end - s, true, e->ptr, true);
}

int
bcf_dirty_scan (struct bcf_cache *c, uint64_t offset, struct bcf_extent *out,
                unsigned max, unsigned *n)
{
  const uint64_t inode = c->inode;
  uint64_t pos = offset >> BCH_SECTOR_SHIFT;
  const uint64_t end = c->backing_sectors;

  *n = 0;
  pthread_rwlock_rdlock (&c->tree_lock);
  while (pos < end && *n < max && btree_dirty_sectors (c)) {
    struct btree_node *leaf = btree_find_leaf (c, inode, pos + 1);
    uint64_t leaf_end;

    if (!leaf) {
      pthread_rwlock_unlock (&c->tree_lock);
      return -EIO;
    }
    leaf_end = ckey_inode (&leaf->key) == inode ? ckey_end (&leaf->key) : end;
    /* An evicted leaf holds no dirty key (those are never evicted). */
    if (!leaf->evicted && leaf->keys.ndirty) {
      const struct keyset *ks = &leaf->keys;
      for (size_t i = keyset_search (ks, inode, pos); i < ks->nr && *n < max;
           i++) {
        const struct ckey *k = &ks->k[i];
        uint64_t s;

        if (ckey_inode (k) != inode)
          break;
        if (!ckey_dirty (k) || ptr_stale (c, k->ptr))
          continue;
        s = ckey_start (k) > pos ? ckey_start (k) : pos;
        out[(*n)++] = (struct bcf_extent) {
          .kind = BCF_EXTENT_HIT, .dirty = true,
          .offset = s << BCH_SECTOR_SHIFT,
          .len = (ckey_end (k) - s) << BCH_SECTOR_SHIFT,
          .dev_offset = (PTR_OFFSET (k->ptr) + (s - ckey_start (k)))
                        << BCH_SECTOR_SHIFT,
          .ptr = MAKE_PTR (PTR_GEN (k->ptr),
                           PTR_OFFSET (k->ptr) + (s - ckey_start (k)),
                           PTR_DEV (k->ptr)),
        };
        pos = ckey_end (k);
      }
      if (*n == max)
        break;
    }
    pos = leaf_end;
  }
  pthread_rwlock_unlock (&c->tree_lock);
  return 0;
}

bool
bcf_dirty_still (struct bcf_cache *c, const struct bcf_extent *e)
{
  struct ckey k = dirty_key_of (c, e);
  bool still;

  pthread_rwlock_rdlock (&c->tree_lock);
  still = btree_range_matches_locked (c, &k, &k);
  pthread_rwlock_unlock (&c->tree_lock);
  return still;
}

int64_t
bcf_dirty_mark_clean (struct bcf_cache *c, const struct bcf_extent *e)
{
  struct ckey k = dirty_key_of (c, e);
  int64_t n;

  tree_wrlock (c);
  n = btree_mark_clean_locked (c, &k);
  tree_wrunlock (c);
  return n < 0 ? n : n << BCH_SECTOR_SHIFT;
}

/* Moving GC's copy (movinggc.c has the design and the argument): read
 * the n dirty extents e[] (one submission), write each to new cache space
 * (one submission), and replace-insert each as the same dirty data at its
 * new place, journalled, only if its range still holds exactly e[i] (the
 * CAS of insert_key's expect: a write, an invalidation or a clean mark
 * that came first wins).  buf holds the sum of the lengths, aligned.
 * res[i]: 0 moved; -EEXIST the range changed; -ESTALE the bucket was
 * reused under the read (cannot happen while e[i] is in the tree, but a
 * stale read is never written anywhere); -ENOSPC no room; -errno. */
void
extent_move_dirty (struct bcf_cache *c, const struct bcf_extent *e,
                   unsigned n, uint8_t *buf, int *res)
{
  struct bcf_io_seg *segs = calloc (n, sizeof *segs);
  uint64_t *ptr = calloc (n, sizeof *ptr);
  uint64_t off = 0;
  unsigned nw = 0;
  int r = 0;                    /* the first allocation that failed */

  if (!segs || !ptr) {
    for (unsigned i = 0; i < n; i++)
      res[i] = -ENOMEM;
    goto out;
  }
  for (unsigned i = 0; i < n; i++) {
    segs[i] = (struct bcf_io_seg) { .op = BCF_IO_READ, .buf = buf + off,
                                    .len = e[i].len, .off = e[i].dev_offset };
    off += e[i].len;
  }
  bcf_io_submit (c->io, segs, n);
  for (unsigned i = 0; i < n; i++) {
    res[i] = segs[i].result;
    if (res[i] == 0 && ptr_stale (c, e[i].ptr))
      res[i] = -ESTALE;
  }
  /* Allocate for every extent read; after the first failure, none.  One
   * allocation per extent, not alloc_pieces: that cuts at
   * data_chunk_sectors, which can be shorter than a key (65535 sectors
   * in a bucket of 32 MiB with 4 KiB blocks), and the moved key must stay
   * one key, replacing exactly the old one. */
  for (unsigned i = 0; i < n; i++) {
    if (res[i] < 0)
      continue;
    if (r == 0 && c->failed)
      r = -ENOSPC;
    if (r == 0)
      r = alloc_sectors (c, (uint32_t) (e[i].len >> BCH_SECTOR_SHIFT), true,
                         &ptr[i]);
    if ((res[i] = r) < 0)
      continue;
    segs[nw++] = (struct bcf_io_seg) {
      .op = BCF_IO_WRITE, .buf = segs[i].buf, .len = e[i].len,
      .off = PTR_OFFSET (ptr[i]) << BCH_SECTOR_SHIFT,
    };
  }
  bcf_io_submit (c->io, segs, nw);
  if (c->test_move_hook)
    c->test_move_hook (c, c->test_move_hook_opaque);
  for (unsigned i = 0, w = 0; i < n; i++) {
    struct ckey k, expect;
    struct durability d = { 0 };

    if (res[i] < 0)
      continue;
    res[i] = segs[w++].result;
    if (res[i] == 0) {
      expect = dirty_key_of (c, &e[i]);
      k = ckey_make (c->inode, ckey_end (&expect), ckey_size (&expect), true,
                     ptr[i], true);
      res[i] = insert_key (c, &k, JOURNAL_ALWAYS, &expect, &d);
    }
    alloc_put (c, ptr[i]);
  }
out:
  free (segs);
  free (ptr);
}

/* The open entry: every key added so far is in it or in an older one,
 * and entries become durable in seq order (journal.c). */
uint64_t
bcf_flush_point (struct bcf_cache *c)
{
  return journal_open_seq (c);
}

int
bcf_flush_upto (struct bcf_cache *c, uint64_t point)
{
  if (c->opts.readonly)
    return 0;             /* nothing was written */
  return journal_flush_seq (c, point);
}

int
bcf_flush (struct bcf_cache *c)
{
  return bcf_flush_upto (c, bcf_flush_point (c));
}

int
bcf_cache_journal_write (struct bcf_cache *c)
{
  return bcf_flush (c);
}

int
bcf_cache_checkpoint (struct bcf_cache *c)
{
  int r;

  if (c->opts.readonly)
    return -EROFS;
  pthread_mutex_lock (&c->ckpt_lock);
  r = btree_checkpoint (c);
  pthread_mutex_unlock (&c->ckpt_lock);
  return r;
}
