/* bcachefilter engine: write-intent regions (DESIGN.md "Writes on dirty
 * keys", the second way to pay less for the durable step).
 *
 * Design
 * ------
 * A write to data the cache holds must not reach the backing store while
 * a crash could still bring back the older cached data: the write's
 * dirty key must be durable first, one journal write in series with the
 * write (bcf_write_durable).  A write-intent region, in the manner of
 * md's write-intent bitmap, pays that price once per region instead: a
 * region (INTENT_REGION_SECTORS, 16 MiB) is marked durably when a write
 * that needs it starts there, and while it is marked, writes inside it
 * need no journal wait.  After a crash, every clean key in a region that
 * is still marked is suspect (the backing store may hold newer data than
 * the key's, if the newer write's dirty key did not reach the journal),
 * so recovery drops the clean keys of marked regions (intent_recover):
 * warmth is traded, never correctness.  Dirty keys stay: they are newer
 * than the backing store and are written back.
 *
 * Writes rely on a mark in three ways.  A write into a region that is not
 * marked yet inserts its dirty keys, journalled, then asks for the mark
 * (bcf_write_begin, intent_write_begin), which it makes durable.  A
 * writethrough write marks its regions before its keys go in and,
 * where no dirty data can come back, does not journal them at all
 * (extent.c's bcf_write_begin_through): what a crash brings back older
 * than such a write is a clean key of the region, which recovery drops
 * while the mark stands.  A write that goes around the cache does the
 * same with the whiteout that removes the older data
 * (bcf_invalidate_before_write): it marks, and then does not wait for
 * the whiteout's journal entry.  So a mark is cleared (lazily:
 * intent_tick, from the journal thread) only once every key of every
 * write that relied on it is on disk without it: no write holds it, the
 * region has been quiet for a while (so that a busy region is not marked
 * and cleared over and over), and a checkpoint that began after the
 * region's last write ended has committed (ckpt_begun_ns): the
 * committed nodes hold those keys, or what replaced them since.
 * Clearing need not be durable: a mark a crash brings back only costs
 * warmth.
 *
 * Where the marks live: in the btree, as keys of inode INTENT_INODE
 * (0xffffe, beyond any uuid slot a cache can have: slots are
 * bucket_bytes / 128, at most 65536), one per region, each with one
 * pointer to PTR_CHECK_DEV (4095) and KEY_SIZE = the region, journalled
 * when set and cleared (a whiteout), so they survive checkpoints and
 * replays like any key.  What a kernel would see: keys of an inode no
 * backing device is attached to, whose pointer names no cache device
 * (bcache treats such a pointer as bad: it marks no bucket, serves no
 * read, and GC drops bad keys when it rewrites a node).
 *
 * The kernel does not know what they mean, and would serve the suspect
 * clean data of a cache that crashed with regions marked (the kernel
 * test's crash case read 1800 such sectors).  So while a mark may exist
 * on disk, the superblock carries BCF_FEATURE_INCOMPAT_WRITE_INTENT, an
 * incompatible feature bit the kernel does not know, and a kernel
 * refuses to register the cache ("Unsupported incompatible feature")
 * instead of serving it: the bit is set, durably, before the first mark
 * is inserted (sb_on, from region_enter), and cleared only when no
 * region is marked and the clears are durable (sb_off, at the end of
 * intent_tick), or by the open that recovered the marks, after its
 * checkpoint (super.c).  A cache the filter closed cleanly has no marks
 * (intent_clear_all at close) and no bit.  Why the clears must be
 * durable first: a mark a crash brings back is again a region whose
 * clean data only the filter's recovery knows to drop.  Why a clear
 * that is durable is enough: it follows a committed checkpoint that
 * holds the keys of every write that relied on the mark.
 * The cost is a superblock write when the first region is marked and
 * when the last one is cleared (after quiet_ns without writes).
 *
 * Locking: intent.lock guards the region table (a small hash of the
 * marked regions); it is taken inside no other lock and held across no
 * I/O.  sb_lock serialises the superblock bit's changes and is held
 * across that write (it takes the engine's super_lock inside, never
 * ckpt_lock: the bit's write does not wait for a checkpoint's I/O); it
 * is never taken with intent.lock held.  Setting or clearing a mark (a key insert, and for a set a
 * journal wait) happens with it released, with the region in a
 * MARKING / CLEARING state that makes other writers wait on intent.cond,
 * so the journal's order of set and clear is the order of the state
 * changes.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bcachefilter/inspect.h"
#include "engine.h"
#include "super.h"

enum region_state {
  R_MARKING,                    /* mark key inserted, not yet durable */
  R_MARKED,                     /* durable: writes need no journal wait */
  R_CLEARING,                   /* the clear is being inserted */
};

struct region {
  struct region *next;          /* hash chain */
  uint64_t index;               /* region number */
  enum region_state state;
  unsigned writes;              /* writes in flight relying on the mark */
  uint64_t last_ns;             /* last write's end */
};

#define HASH_SIZE 256

static size_t
slot (uint64_t index)
{
  return (size_t) ((index * 0x9E3779B97F4A7C15ull) >> 56) % HASH_SIZE;
}

int
intent_init (struct bcf_cache *c)
{
  struct intent *in = &c->intent;

  memset (in, 0, sizeof *in);
  pthread_mutex_init (&in->lock, NULL);
  pthread_mutex_init (&in->sb_lock, NULL);
  pthread_cond_init (&in->cond, NULL);
  in->hash = calloc (HASH_SIZE, sizeof *in->hash);
  return in->hash ? 0 : -ENOMEM;
}

void
intent_free (struct bcf_cache *c)
{
  struct intent *in = &c->intent;

  if (in->hash)
    for (size_t i = 0; i < HASH_SIZE; i++)
      while (in->hash[i]) {
        struct region *r = in->hash[i];
        in->hash[i] = r->next;
        free (r);
      }
  free (in->hash);
  in->hash = NULL;
  pthread_mutex_destroy (&in->lock);
  pthread_mutex_destroy (&in->sb_lock);
  pthread_cond_destroy (&in->cond);
}

/* Under intent.lock. */
static struct region *
find (struct intent *in, uint64_t index)
{
  for (struct region *r = in->hash[slot (index)]; r; r = r->next)
    if (r->index == index)
      return r;
  return NULL;
}

static void
unlink_region (struct intent *in, struct region *r)
{
  struct region **p = &in->hash[slot (r->index)];

  while (*p != r)
    p = &(*p)->next;
  *p = r->next;
  in->nregions--;
}

/* The mark key of region index (set: with its pointer; clear: the
 * whiteout). */
static struct ckey
mark_key (uint64_t index, bool set)
{
  return ckey_make (INTENT_INODE, (index + 1) * INTENT_REGION_SECTORS,
                    INTENT_REGION_SECTORS, set,
                    set ? MAKE_PTR (0, 0, PTR_CHECK_DEV) : 0, false);
}

/* Insert a mark key, journalled; *seq gets its entry.  No lock held. */
static int
insert_mark (struct bcf_cache *c, uint64_t index, bool set, uint64_t *seq)
{
  struct ckey k = mark_key (index, set);

  for (;;) {
    uint64_t s;
    int r;

    tree_wrlock (c);
    s = journal_add_key_locked (c, &k);
    if (s == 0) {
      tree_wrunlock (c);
      if ((r = journal_make_room (c)) < 0)
        return r;
      continue;
    }
    r = btree_insert_locked (c, &k, s);
    tree_wrunlock (c);
    if (r == -ENODATA) {
      struct ckey need;
      bool loaded;
      pthread_rwlock_rdlock (&c->tree_lock);
      loaded = btree_range_loaded (c, INTENT_INODE, ckey_start (&k),
                                   ckey_end (&k), &need);
      pthread_rwlock_unlock (&c->tree_lock);
      if (!loaded && (r = btree_load_evicted (c, &need)) < 0)
        return r;
      continue;
    }
    *seq = s;
    return r;
  }
}

/* The superblock's bit, before a mark goes in (see the header).  Returns
 * 0 or -errno. */
static int
sb_on (struct bcf_cache *c)
{
  struct intent *in = &c->intent;
  int e = 0;

  pthread_mutex_lock (&in->sb_lock);
  if (!in->sb_flag && (e = super_set_write_intent (c, true)) == 0)
    in->sb_flag = true;
  pthread_mutex_unlock (&in->sb_lock);
  return e;
}

/* The bit off, once no region is marked and the clears are durable.  A
 * region entered meanwhile counts in nregions before it waits for
 * sb_lock (region_enter), and sets the bit again after us. */
static void
sb_off (struct bcf_cache *c)
{
  struct intent *in = &c->intent;
  uint64_t seq;
  unsigned n;
  bool stuck;

  pthread_mutex_lock (&in->lock);
  n = in->nregions;
  seq = in->last_clear_seq;
  stuck = in->clear_failed;
  pthread_mutex_unlock (&in->lock);
  if (n || stuck || c->failed || (seq && journal_flush_seq (c, seq) < 0))
    return;
  pthread_mutex_lock (&in->sb_lock);
  pthread_mutex_lock (&in->lock);
  n = in->nregions;
  pthread_mutex_unlock (&in->lock);
  if (n == 0 && in->sb_flag && super_set_write_intent (c, false) == 0)
    in->sb_flag = false;
  pthread_mutex_unlock (&in->sb_lock);
}

/* Make region index durably marked and count a write in it.  Returns 0
 * or -errno (the write must then wait for its keys instead). */
static int
region_enter (struct bcf_cache *c, uint64_t index)
{
  struct intent *in = &c->intent;
  struct region *r;
  uint64_t seq, t0;
  int e;

  pthread_mutex_lock (&in->lock);
  for (;;) {
    r = find (in, index);
    if (r && r->state == R_MARKED) {
      r->writes++;
      pthread_mutex_unlock (&in->lock);
      return 0;
    }
    if (!r)
      break;
    pthread_cond_wait (&in->cond, &in->lock);   /* marking or clearing */
  }
  if (!(r = calloc (1, sizeof *r))) {
    pthread_mutex_unlock (&in->lock);
    return -ENOMEM;
  }
  r->index = index;
  r->state = R_MARKING;
  r->next = in->hash[slot (index)];
  in->hash[slot (index)] = r;
  in->nregions++;
  pthread_mutex_unlock (&in->lock);

  t0 = bcf_now_ns ();
  e = sb_on (c);
  if (e == 0)
    e = insert_mark (c, index, true, &seq);
  if (e == 0)
    e = journal_flush_seq (c, seq);
  bcf_time_record (c, &c->stats.intent_mark, bcf_now_ns () - t0);

  pthread_mutex_lock (&in->lock);
  if (e == 0) {
    r->state = R_MARKED;
    r->writes = 1;
    atomic_fetch_add (&c->stats.intent_marks, 1);
  }
  else {
    /* The key may be in the tree: a stale mark costs warmth only; the
     * region is simply not relied on. */
    unlink_region (in, r);
    free (r);
  }
  pthread_cond_broadcast (&in->cond);
  pthread_mutex_unlock (&in->lock);
  return e;
}

int
intent_write_begin (struct bcf_cache *c, uint64_t start, uint64_t end)
{
  uint64_t first = start / INTENT_REGION_SECTORS;
  uint64_t last = (end - 1) / INTENT_REGION_SECTORS;
  int e = 0;

  for (uint64_t i = first; i <= last && e == 0; i++)
    if ((e = region_enter (c, i)) < 0)
      /* Let go of the regions entered so far. */
      intent_write_end (c, start, i * INTENT_REGION_SECTORS);
  return e;
}

void
intent_write_end (struct bcf_cache *c, uint64_t start, uint64_t end)
{
  struct intent *in = &c->intent;
  uint64_t now = bcf_now_ns ();

  if (end <= start)
    return;
  pthread_mutex_lock (&in->lock);
  for (uint64_t i = start / INTENT_REGION_SECTORS;
       i <= (end - 1) / INTENT_REGION_SECTORS; i++) {
    struct region *r = find (in, i);
    if (!r || r->state != R_MARKED || r->writes == 0)
      continue;                 /* cannot happen: the write holds it */
    r->writes--;
    r->last_ns = now;
  }
  pthread_mutex_unlock (&in->lock);
}

/* Clear one region that qualified; no lock held.  Returns 0 or -errno. */
static int
clear_region (struct bcf_cache *c, struct region *r)
{
  struct intent *in = &c->intent;
  uint64_t seq;
  int e = insert_mark (c, r->index, false, &seq);

  pthread_mutex_lock (&in->lock);
  unlink_region (in, r);
  free (r);
  if (e == 0) {
    atomic_fetch_add (&c->stats.intent_clears, 1);
    if (seq > in->last_clear_seq)
      in->last_clear_seq = seq;
  }
  else
    in->clear_failed = true;    /* the mark may stay: so does the bit */
  pthread_cond_broadcast (&in->cond);
  pthread_mutex_unlock (&in->lock);
  return e;
}

void
intent_tick (struct bcf_cache *c, uint64_t quiet_ns)
{
  struct intent *in = &c->intent;
  uint64_t now = bcf_now_ns ();
  uint64_t begun = atomic_load (&c->ckpt_begun_ns);

  for (;;) {
    struct region *pick = NULL;

    pthread_mutex_lock (&in->lock);
    for (size_t i = 0; i < HASH_SIZE && !pick && in->nregions; i++)
      for (struct region *r = in->hash[i]; r && !pick; r = r->next)
        if (r->state == R_MARKED && r->writes == 0 &&
            now - r->last_ns >= quiet_ns && r->last_ns < begun)
          pick = r;
    if (pick)
      pick->state = R_CLEARING;
    pthread_mutex_unlock (&in->lock);
    if (!pick)
      break;
    if (clear_region (c, pick) < 0)
      return;
  }
  sb_off (c);
}

void
intent_clear_all (struct bcf_cache *c)
{
  /* At close, after the last write. */
  intent_tick (c, 0);
}

unsigned
intent_list (struct bcf_cache *c, uint64_t *out, unsigned max)
{
  struct intent *in = &c->intent;
  unsigned n = 0;

  pthread_mutex_lock (&in->lock);
  for (size_t i = 0; i < HASH_SIZE; i++)
    for (struct region *r = in->hash[i]; r; r = r->next)
      if (n < max)
        out[n++] = r->index;
  pthread_mutex_unlock (&in->lock);
  return n;
}

unsigned
intent_marked (struct bcf_cache *c)
{
  unsigned n;

  pthread_mutex_lock (&c->intent.lock);
  n = c->intent.nregions;
  pthread_mutex_unlock (&c->intent.lock);
  return n;
}

/* ---- recovery ------------------------------------------------------------------------ */

/* The marks in the tree: up to max region numbers, from region from on,
 * into out, their count into *n.  Under tree_lock (any).  Returns false,
 * with *need set, at a leaf that is not in memory: the caller drops the
 * lock, loads it (btree_load_evicted) and walks again.  An evicted leaf
 * is not an empty one: the open that follows a crash commits the
 * replayed tree before it recovers the marks when the journal is tight
 * (super.c), and that checkpoint evicts clean leaves if the node cache
 * is small; a mark missed there leaves its region's suspect clean data
 * cached, to be served after the crash. */
static bool
marks_locked (struct bcf_cache *c, uint64_t from, uint64_t *out,
              unsigned max, unsigned *n, struct ckey *need)
{
  uint64_t pos = from * INTENT_REGION_SECTORS;

  *n = 0;
  while (*n < max) {
    struct btree_node *leaf = btree_find_leaf (c, INTENT_INODE, pos + 1);
    const struct keyset *ks;

    if (!leaf)
      break;
    if (leaf->evicted) {
      *need = leaf->key;
      return false;
    }
    ks = &leaf->keys;
    for (size_t i = keyset_search (ks, INTENT_INODE, pos);
         i < ks->nr && *n < max; i++) {
      const struct ckey *k = &ks->k[i];
      if (ckey_inode (k) != INTENT_INODE)
        break;
      if (ckey_is_check (k)) {
        out[(*n)++] = ckey_start (k) / INTENT_REGION_SECTORS;
        pos = ckey_end (k);
      }
    }
    if (ckey_inode (&leaf->key) != INTENT_INODE || *n == max)
      break;
    pos = ckey_end (&leaf->key);
  }
  return true;
}

/* marks_locked, reading back the leaves it needs.  Returns 0 or -errno
 * (a leaf could not be read). */
static int
marks (struct bcf_cache *c, uint64_t from, uint64_t *out, unsigned max,
       unsigned *n)
{
  for (;;) {
    struct ckey need;
    bool done;
    int r;

    pthread_rwlock_rdlock (&c->tree_lock);
    done = marks_locked (c, from, out, max, n, &need);
    pthread_rwlock_unlock (&c->tree_lock);
    if (done)
      return 0;
    if ((r = btree_load_evicted (c, &need)) < 0) {
      *n = 0;
      return r;
    }
  }
}

_Static_assert (BCF_INTENT_REGION_BYTES ==
                INTENT_REGION_SECTORS << BCH_SECTOR_SHIFT,
                "inspect.h's region size is the engine's");

unsigned
bcf_cache_intent_marks (struct bcf_cache *c, uint64_t from, uint64_t *out,
                        unsigned max)
{
  unsigned n;

  /* A leaf that cannot be read back: none listed (an error the open's
   * load would have reported already). */
  marks (c, from / BCF_INTENT_REGION_BYTES, out, max, &n);
  for (unsigned i = 0; i < n; i++)
    out[i] *= BCF_INTENT_REGION_BYTES;
  return n;
}

/* The clean data keys of [s, e) of inode c->inode, up to max (a region
 * holds at most its sectors' worth); *next: where the walk stopped.
 * Under tree_lock (any).  A leaf that is not in memory stops the walk at
 * its start, and if no key was found before it, *need gets it (*load):
 * the caller drops the lock, loads it (btree_load_evicted) and walks on
 * from there.  Its clean keys are as suspect as any others (see
 * marks_locked for how a leaf of a marked region comes to be evicted). */
static size_t
clean_keys_locked (struct bcf_cache *c, uint64_t s, uint64_t e,
                   struct ckey *out, size_t max, uint64_t *next, bool *load,
                   struct ckey *need)
{
  uint64_t pos = s;
  size_t n = 0;

  *load = false;
  while (pos < e && n < max) {
    struct btree_node *leaf = btree_find_leaf (c, c->inode, pos + 1);
    const struct keyset *ks;

    if (!leaf)
      break;
    if (leaf->evicted) {
      if (n == 0) {
        *need = leaf->key;
        *load = true;
      }
      break;
    }
    ks = &leaf->keys;
    for (size_t i = keyset_search (ks, c->inode, pos); i < ks->nr && n < max;
         i++) {
      const struct ckey *k = &ks->k[i];
      if (ckey_inode (k) != c->inode || ckey_start (k) >= e)
        break;
      if (ckey_has_ptr (k) && !ckey_is_check (k) && !ckey_dirty (k))
        out[n++] = *k;
      pos = ckey_end (k);
    }
    if (n == max || ckey_inode (&leaf->key) != c->inode)
      break;
    pos = ckey_end (&leaf->key);
  }
  *next = pos;
  return n;
}

int
intent_recover (struct bcf_cache *c, uint64_t *regions, uint64_t *dropped)
{
  uint64_t idx[64], from = 0;
  unsigned n;
  int r = 0;

  *regions = *dropped = 0;
  do {
    if ((r = marks (c, from, idx, 64, &n)) < 0)
      return r;
    for (unsigned i = 0; i < n && r == 0; i++) {
      uint64_t s = idx[i] * INTENT_REGION_SECTORS;
      uint64_t e = s + INTENT_REGION_SECTORS, pos = s, seq;

      if (e > c->backing_sectors)
        e = c->backing_sectors;
      /* Drop the region's clean keys (each only as it is: the whiteout
       * is journalled where the key could come back), keep the dirty
       * ones, then the mark. */
      while (pos < e && r == 0) {
        struct ckey keys[256], need;
        bool load;
        size_t nk;

        pthread_rwlock_rdlock (&c->tree_lock);
        nk = clean_keys_locked (c, pos, e, keys, 256, &pos, &load, &need);
        pthread_rwlock_unlock (&c->tree_lock);
        if (load) {
          r = btree_load_evicted (c, &need);
          continue;
        }
        if (nk == 0)
          break;
        for (size_t k = 0; k < nk && r == 0; k++) {
          struct bcf_extent x = {
            .kind = BCF_EXTENT_HIT,
            .offset = ckey_start (&keys[k]) << BCH_SECTOR_SHIFT,
            .len = ckey_size (&keys[k]) << BCH_SECTOR_SHIFT,
            .dev_offset = PTR_OFFSET (keys[k].ptr) << BCH_SECTOR_SHIFT,
            .ptr = keys[k].ptr,
          };
          r = bcf_drop_hit (c, &x);
          (*dropped)++;
        }
      }
      if (r == 0)
        r = insert_mark (c, idx[i], false, &seq);
      (*regions)++;
      from = idx[i] + 1;
    }
  } while (n == 64 && r == 0);
  return r;
}
