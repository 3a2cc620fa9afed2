/* bcachefilter engine: consistency check of an open cache.
 *
 * Design
 * ------
 * Checks what open does not already enforce (every checksum, key order
 * within a bset, the journal's continuity and the superblock are verified
 * by the decoders while opening):
 *   - every node: keys sorted and, in leaves, non-overlapping; every key
 *     inside the node's range (previous sibling's key, node key]; every
 *     child of an interior node present and one level down;
 *   - no two nodes in one bucket; every node bucket marked metadata;
 *   - every live data pointer (not stale, not a check key) inside the
 *     cache, past first_bucket, and not into a metadata bucket (journal,
 *     prio, uuid, btree node): that would mean a bucket was reused while
 *     still referenced;
 *   - bucket accounting: no pointer carries a gen newer than its bucket's
 *     (bcache's "pointer from the future");
 *   - dirty data: every live dirty extent's bucket is marked dirty (a
 *     bucket marked otherwise could be reclaimed under data that exists
 *     nowhere else), no dirty extent's pointer is stale unless a replay
 *     brought it back (GC drops those: written back before a crash lost
 *     its clean mark), and the dirty-data counter equals the extents'
 *     sum;
 *   - write-intent marks (intent.c): keys of INTENT_INODE are region-
 *     sized placeholders at region boundaries, and where there is one
 *     the superblock carries the write-intent feature bit (the kernel
 *     must refuse the cache).
 *   - the journal: what the open's scan skipped, judged by its rule
 *     (journal_judge): corrupt entries are a problem, a torn tail (normal
 *     after a crash) a note.
 * Problems are appended to the report, one per line; the count is
 * returned.  Notes are lines starting with "note: ", not counted.
 *
 * Locking: takes tree_lock for reading and alloc.lock briefly per check;
 * meant for an idle cache (tools, tests).
 */
#include "config.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

struct fsck_ctx {
  char *report;
  size_t len, used;
  unsigned problems;
  uint8_t *node_bucket;       /* 1 per bucket holding a node */
  uint64_t dirty_sectors;     /* live dirty extents, summed */
  uint64_t intent_marks;
};

/* Append PREFIX, the formatted line and a newline to the report,
 * truncating it if need be. */
static void
append (struct fsck_ctx *f, const char *prefix, const char *fmt, va_list ap)
{
  if (!f->report || f->used + 1 >= f->len)
    return;
  f->used += (size_t) snprintf (f->report + f->used, f->len - f->used, "%s",
                                prefix);
  if (f->used + 1 < f->len)
    f->used += (size_t) vsnprintf (f->report + f->used, f->len - f->used,
                                   fmt, ap);
  if (f->used + 1 < f->len) {
    f->report[f->used++] = '\n';
    f->report[f->used] = '\0';
  }
  else
    f->used = f->len - 1;
}

static void __attribute__ ((format (printf, 2, 3)))
problem (struct fsck_ctx *f, const char *fmt, ...)
{
  va_list ap;

  f->problems++;
  va_start (ap, fmt);
  append (f, "", fmt, ap);
  va_end (ap);
}

/* A line that is not a problem (not counted): "note: ...". */
static void __attribute__ ((format (printf, 2, 3)))
note (struct fsck_ctx *f, const char *fmt, ...)
{
  va_list ap;

  va_start (ap, fmt);
  append (f, "note: ", fmt, ap);
  va_end (ap);
}

static int
check_node (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct fsck_ctx *f = opaque;
  uint64_t b = bucket_of_ptr (c, n->key.ptr);
  const char *why = keyset_check (&n->keys, n->level);

  if (b >= c->alloc.nbuckets) {
    problem (f, "node at level %u points outside the cache (bucket %" PRIu64
             ")", n->level, b);
    return 0;
  }
  if (f->node_bucket[b]++)
    problem (f, "bucket %" PRIu64 " holds two btree nodes", b);
  if (c->alloc.buckets[b].mark != GC_MARK_METADATA)
    problem (f, "btree node bucket %" PRIu64 " is not marked metadata", b);
  if (why)
    problem (f, "node in bucket %" PRIu64 " (level %u): %s", b, n->level, why);
  for (size_t i = 0; i < n->keys.nr; i++) {
    const struct ckey *k = &n->keys.k[i];
    if (ckey_cmp (k, &n->key) > 0)
      problem (f, "node in bucket %" PRIu64 ": key %" PRIu64 ":%" PRIu64
               " beyond the node's range", b, ckey_inode (k), ckey_end (k));
  }
  return 0;
}

/* Every key of a node lies in its range (lo, hi]: after the previous
 * sibling's key, at most its own key; children are one level down. */
static void
check_subtree (struct bcf_cache *c, struct fsck_ctx *f, struct btree_node *n,
               const struct ckey *lo)
{
  uint64_t b = bucket_of_ptr (c, n->key.ptr);

  for (size_t i = 0; i < n->keys.nr; i++) {
    const struct ckey *k = &n->keys.k[i];
    /* Leaves: the extent's start; interior: the child's key. */
    bool below = false;

    if (lo) {
      if (n->level == 0)
        below = ckey_inode (k) < ckey_inode (lo) ||
                (ckey_inode (k) == ckey_inode (lo) &&
                 ckey_start (k) < ckey_end (lo));
      else
        below = ckey_cmp (k, lo) <= 0;
    }
    if (below)
      problem (f, "node in bucket %" PRIu64 " (level %u): key %" PRIu64 ":%"
               PRIu64 " lies before the node's range", b, n->level,
               ckey_inode (k), ckey_end (k));
  }
  if (n->level == 0)
    return;
  for (size_t i = 0; i < n->keys.nr; i++) {
    struct btree_node *ch = btree_child (c, &n->keys.k[i]);
    if (!ch) {
      problem (f, "node in bucket %" PRIu64 ": child %zu is missing", b, i);
      continue;
    }
    if (ch->level + 1 != n->level)
      problem (f, "node in bucket %" PRIu64 " (level %u) has a child at "
               "level %u", b, n->level, ch->level);
    check_subtree (c, f, ch, i > 0 ? &n->keys.k[i - 1] : lo);
  }
}

static int
check_leaf_pointers (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct fsck_ctx *f = opaque;

  if (n->level > 0)
    return 0;
  for (size_t i = 0; i < n->keys.nr; i++) {
    const struct ckey *k = &n->keys.k[i];
    uint64_t b;
    uint8_t gen;

    if (!ckey_has_ptr (k) || ckey_is_check (k))
      continue;
    b = bucket_of_ptr (c, k->ptr);
    if (b < c->sb.first_bucket || b >= c->alloc.nbuckets) {
      problem (f, "extent %" PRIu64 "+%" PRIu64 " points outside the data "
               "buckets (bucket %" PRIu64 ")", ckey_start (k), ckey_size (k),
               b);
      continue;
    }
    if (ckey_dirty (k))
      f->dirty_sectors += ckey_size (k);
    gen = c->alloc.buckets[b].gen;
    if (gen != PTR_GEN (k->ptr)) {
      if (bch_gen_after (PTR_GEN (k->ptr), gen))
        problem (f, "extent %" PRIu64 "+%" PRIu64 " has gen %u, newer than "
                 "its bucket %" PRIu64 "'s gen %u", ckey_start (k),
                 ckey_size (k), PTR_GEN (k->ptr), b, gen);
      continue;                 /* stale: fine */
    }
    if (c->alloc.buckets[b].mark == GC_MARK_METADATA)
      problem (f, "live extent %" PRIu64 "+%" PRIu64 " points into "
               "metadata bucket %" PRIu64, ckey_start (k), ckey_size (k), b);
    else if (ckey_dirty (k) && c->alloc.buckets[b].mark != GC_MARK_DIRTY)
      problem (f, "dirty extent %" PRIu64 "+%" PRIu64 " lies in bucket %"
               PRIu64 ", which is not marked dirty (it could be reclaimed)",
               ckey_start (k), ckey_size (k), b);
  }
  return 0;
}

static int
check_intent_marks (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct fsck_ctx *f = opaque;

  if (n->level > 0)
    return 0;
  for (size_t i = 0; i < n->keys.nr; i++) {
    const struct ckey *k = &n->keys.k[i];

    if (ckey_inode (k) != INTENT_INODE)
      continue;
    f->intent_marks++;
    if (!ckey_is_check (k) || ckey_size (k) != INTENT_REGION_SECTORS ||
        ckey_end (k) % INTENT_REGION_SECTORS || ckey_dirty (k))
      problem (f, "write-intent mark %" PRIu64 "+%" PRIu64 " is not a "
               "region placeholder", ckey_start (k), ckey_size (k));
  }
  return 0;
}

int
bcf_cache_fsck (struct bcf_cache *c, char *report, size_t len)
{
  struct fsck_ctx f = { .report = report, .len = len };

  bool intent_bit;

  if (report && len)
    report[0] = '\0';
  f.node_bucket = calloc (c->alloc.nbuckets, 1);
  if (!f.node_bucket)
    return -1;
  /* Before the walk: the bit is set before a mark goes in, and cleared
   * only after the last one is gone (intent.c). */
  pthread_mutex_lock (&c->super_lock);
  intent_bit = c->sb.feature_incompat & BCF_FEATURE_INCOMPAT_WRITE_INTENT;
  pthread_mutex_unlock (&c->super_lock);
  /* Set once by the open. */
  if (c->journal.skipped[0] && c->journal.ncorrupt)
    problem (&f, "journal: %s", c->journal.skipped);
  else if (c->journal.skipped[0])
    note (&f, "journal: %s", c->journal.skipped);
  pthread_rwlock_rdlock (&c->tree_lock);
  pthread_mutex_lock (&c->alloc.lock);
  btree_visit (c, check_node, &f);
  if (c->tree.root)
    check_subtree (c, &f, c->tree.root, NULL);
  btree_visit (c, check_leaf_pointers, &f);
  btree_visit (c, check_intent_marks, &f);
  if (f.intent_marks && !intent_bit)
    problem (&f, "%" PRIu64 " write-intent mark%s but the superblock has "
             "no write-intent feature bit: a kernel would register the "
             "cache and could serve clean data older than the backing "
             "store after a crash", f.intent_marks,
             f.intent_marks == 1 ? "" : "s");
  if (f.dirty_sectors != btree_dirty_sectors (c))
    problem (&f, "the dirty-data counter says %" PRIu64 " sectors, the "
             "extents hold %" PRIu64, btree_dirty_sectors (c),
             f.dirty_sectors);
  pthread_mutex_unlock (&c->alloc.lock);
  pthread_rwlock_unlock (&c->tree_lock);
  free (f.node_bucket);
  return (int) f.problems;
}
