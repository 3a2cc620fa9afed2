/* bcachefilter engine: sorted key sets (the in-memory side of a bset).
 *
 * Design
 * ------
 * A btree node's keys are kept in memory as a sorted array of compact keys
 * (struct ckey: high, low, one pointer — 24 bytes, the same layout as a
 * bcache bkey with KEY_PTRS <= 1, so every KEY_* / PTR_* accessor of
 * format.h applies through ckey_bkey()).  This engine drives a single
 * cache device, so a key never needs more than one pointer.
 *
 * A keyset holds extents of one btree level:
 * - level 0 (leaves): extents [KEY_START, KEY_OFFSET) of an inode, sorted
 *   by (inode, offset) and never overlapping.  Inserting a key trims or
 *   splits the older keys it overlaps (newer data wins), exactly as
 *   bcache's bch_extent_insert_fixup does.  A key with no pointer is a
 *   whiteout: it removes the range.  Whether whiteouts are kept in the set
 *   is a property of the set: a node's open (not yet written) bset keeps
 *   them, because on disk they must override older bsets of the node; the
 *   merged view of a node drops them.
 * - level > 0 (interior nodes): one key per child, its offset the child's
 *   greatest key; lookups descend into the first key greater than the
 *   search position.  Interior sets use keyset_put / keyset_del, not the
 *   extent insert.
 *
 * Replace (compare-and-swap, bcache's replace_key): insert a key only if
 * its whole range is still covered by the expected key (offset-adjusted),
 * i.e. nothing touched the range since the expected key went in.  This is
 * the basis of the cache-miss protocol.  bcache inserts the part that
 * still matches; we insert all or nothing, which is simpler and only ever
 * loses a caching opportunity, never correctness.
 *
 * Each set keeps the on-disk size of its keys (words) and its count of
 * dirty keys up to date, so a checkpoint sizes a bset and the node cache
 * finds clean leaves without walking keys under the btree lock.
 *
 * Locking: none here; the btree (btree.c) serialises access to a node's
 * sets.  The one exception is a shared array (keyset_share), which its
 * holder reads without the lock: nothing ever writes a shared array, and
 * its reference count is atomic.
 */
#ifndef BCACHEFILTER_BSET_H
#define BCACHEFILTER_BSET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/format.h"

struct ckey {
  uint64_t high;
  uint64_t low;
  uint64_t ptr;               /* meaningful iff KEY_PTRS == 1 */
};

static inline const struct bkey *ckey_bkey (const struct ckey *k)
{ return (const struct bkey *) k; }
static inline struct bkey *ckey_bkey_mut (struct ckey *k)
{ return (struct bkey *) k; }

static inline uint64_t ckey_inode (const struct ckey *k)
{ return KEY_INODE (ckey_bkey (k)); }
static inline uint64_t ckey_end (const struct ckey *k) { return k->low; }
static inline uint64_t ckey_size (const struct ckey *k)
{ return KEY_SIZE (ckey_bkey (k)); }
static inline uint64_t ckey_start (const struct ckey *k)
{ return k->low - ckey_size (k); }
static inline bool ckey_has_ptr (const struct ckey *k)
{ return KEY_PTRS (ckey_bkey (k)) != 0; }
static inline bool ckey_is_check (const struct ckey *k)
{ return ckey_has_ptr (k) && PTR_DEV (k->ptr) == PTR_CHECK_DEV; }
static inline bool ckey_dirty (const struct ckey *k)
{ return KEY_DIRTY (ckey_bkey (k)) != 0; }

/* Make a key: an extent [end - size, end) of inode.  With has_ptr, ptr is
 * the location of its first sector. */
struct ckey ckey_make (uint64_t inode, uint64_t end, uint64_t size,
                       bool has_ptr, uint64_t ptr, bool dirty);

/* Compare by (inode, offset). */
static inline int
ckey_cmp (const struct ckey *a, const struct ckey *b)
{
  return bkey_cmp (ckey_bkey (a), ckey_bkey (b));
}
/* Compare a key with a position (inode, sector). */
static inline int
ckey_cmp_pos (const struct ckey *a, uint64_t inode, uint64_t sector)
{
  uint64_t ai = ckey_inode (a);
  if (ai != inode)
    return ai < inode ? -1 : 1;
  return a->low < sector ? -1 : a->low > sector ? 1 : 0;
}

/* Drop the first n sectors of an extent (its pointer moves with it). */
void ckey_cut_front (struct ckey *k, uint64_t n);
/* Drop the last n sectors of an extent. */
void ckey_cut_back (struct ckey *k, uint64_t n);

/* Convert from / to a decoded on-disk key.  ckey_from_bkey returns false
 * for keys with more than one pointer. */
bool ckey_from_bkey (const struct bkey *k, struct ckey *out);

/* An array of keys shared, copy on write, between a keyset and a reader
 * that works without the btree lock (the checkpoint encoding a node it
 * captured): see keyset_share. */
struct keyset_share;

struct keyset {
  struct ckey *k;             /* the keys: head slots into the allocation */
  size_t nr;
  size_t cap;                 /* slots allocated, before k included */
  size_t head;                /* free slots before k */
  size_t words;               /* sum of bkey_u64s: the keys' size on disk */
  size_t ndirty;              /* keys with KEY_DIRTY */
  struct keyset_share *share; /* k is shared (copy on write): NULL if not */
  bool keep_whiteouts;
};

void keyset_init (struct keyset *s, bool keep_whiteouts);
void keyset_free (struct keyset *s);
void keyset_clear (struct keyset *s);
/* Make room for n keys after k (for keyset_append); -ENOMEM on failure. */
int keyset_reserve (struct keyset *s, size_t n);
/* Take the set's array in O(1): returns its s->nr keys, and in *alloc
 * what the caller frees (with free) when done with them; the set is left
 * empty.  NULL if the set had no array (or ENOMEM while unsharing: check
 * s->nr first). */
struct ckey *keyset_steal (struct keyset *s, void **alloc);

/* Copy on write.  keyset_share returns a reference to the set's current
 * array (s->k, s->nr keys), which stays valid and unchanged until the
 * caller drops it with keyset_share_put, whatever happens to the set
 * meanwhile: the first change of the set after keyset_share copies the
 * array first (unless the reference was already dropped), and freeing
 * or clearing the set only drops the set's own reference.  So a capture
 * under the btree lock costs O(1) instead of a copy of the node.  The
 * reference count is atomic: keyset_share_put may run in any thread,
 * without the lock that protects the set.  NULL on ENOMEM. */
struct keyset_share *keyset_share (struct keyset *s);
void keyset_share_put (struct keyset_share *sh);
/* Make the set's array its own (copy if still shared); 0 or -ENOMEM.
 * Every function below that changes the set does this first. */
int keyset_unshare (struct keyset *s);
/* Bytes of memory held. */
static inline size_t keyset_bytes (const struct keyset *s)
{ return s->cap * sizeof (struct ckey); }

/* Index of the first key greater than (inode, sector), i.e. the first
 * extent ending after sector; s->nr if none. */
size_t keyset_search (const struct keyset *s, uint64_t inode,
                      uint64_t sector);

/* Does the set hold exactly k (same range, pointer and flags)?  For an
 * extent set, whose keys never overlap. */
bool keyset_contains (const struct keyset *s, const struct ckey *k);

/* Does s hold a key (or whiteout) overlapping [start, end) of inode? */
bool keyset_overlaps (const struct keyset *s, uint64_t inode, uint64_t start,
                      uint64_t end);

/* Extent insert (level 0): trims/splits older overlapping keys, then adds
 * k (unless it is a whiteout and the set drops whiteouts).  Returns 0 or
 * -ENOMEM (the set is unchanged on failure).  Zero-size keys are ignored. */
int keyset_insert (struct keyset *s, const struct ckey *k);

/* Is k an offset-adjusted copy of (a piece of) expect: same pointer
 * device and gen, same pointer-minus-start relation, same dirty bit? */
bool ckey_matches (const struct ckey *k, const struct ckey *expect);

/* Would a replace of k against expect succeed?  True iff [start, end) of
 * k is covered, without holes, by keys that are offset-adjusted copies of
 * expect (same pointer device, gen and offset relation, same dirty bit). */
bool keyset_replace_matches (const struct keyset *s, const struct ckey *k,
                             const struct ckey *expect);

/* Interior sets: add or replace the key with exactly this (inode,
 * offset); remove it.  keyset_put returns 0 or -ENOMEM; keyset_del 1 if
 * it removed the key, 0 if there was none, -ENOMEM. */
int keyset_put (struct keyset *s, const struct ckey *k);
int keyset_del (struct keyset *s, const struct ckey *k);

/* keyset_insert of w[0], w[1], ... w[n - 1] in that order, in one merge
 * of the set with w: O(nr + n), where n inserts move up to half the set
 * each.  w must be sorted and its keys must not overlap each other.
 * Returns 0 or -ENOMEM (the set is unchanged on failure). */
int keyset_insert_batch (struct keyset *s, const struct ckey *w, size_t n);

/* Walk the keys in order, calling drop on each, and remove those for
 * which it returns 1, in one pass: O(n) however many go, where removing
 * them one by one moves up to half the set each time.  drop returning
 * < 0 stops the walk: the keys it did not return 1 for stay, and the
 * error is returned.  Returns 0, or -ENOMEM (copying a shared array, before
 * drop is called at all), or drop's error. */
int keyset_remove_if (struct keyset *s,
                      int (*drop) (const struct ckey *k, void *arg),
                      void *arg);

/* Append a key known to sort after every key in the set (bulk loading
 * from disk and compaction).  Returns 0 or -ENOMEM. */
int keyset_append (struct keyset *s, const struct ckey *k);

/* Check the set's invariants: sorted, non-overlapping (leaves), sizes
 * and counters (words, ndirty) consistent.  Returns NULL or a static description of the first
 * violation (for tests and fsck). */
const char *keyset_check (const struct keyset *s, unsigned level);

#endif /* BCACHEFILTER_BSET_H */
