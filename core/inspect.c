/* bcachefilter engine: read-only views of a cache for tools
 * (include/bcachefilter/inspect.h).
 *
 * Design
 * ------
 * Thin wrappers that let a tool see what the engine sees without
 * reaching into struct bcf_cache: the journal through journal_scan (the
 * scan and verdict the open itself uses, core/journal.c), the btree
 * through btree_visit, the buckets as a copy of the allocator's array.
 * Nothing here writes.
 *
 * Locking: bcf_btree_walk holds tree_lock for reading around the whole
 * walk (its callback must not take it again); bcf_cache_buckets takes
 * alloc.lock for the copy; bcf_journal_inspect works on a device of its
 * own, opened read-only.
 */
#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

int
bcf_journal_inspect (const char *path, const struct bch_sb *sb,
                     struct bcf_journal_scan *s, char *err, size_t errlen)
{
  struct bcf_io_opts o = { .path = path, .readonly = true,
                           .mode = BCF_IO_SYNC };
  struct bcf_io *io;
  int r;

  memset (s, 0, sizeof *s);
  if ((r = bcf_io_open (&o, &io, err, errlen)) < 0)
    return r;
  r = journal_scan (io, sb, s, NULL);
  if (r < 0)
    snprintf (err, errlen, "reading the journal of %s: %s", path,
              strerror (-r));
  bcf_io_close (io);
  return r;
}

/* ---- the btree -------------------------------------------------------------- */

bool
bcf_btree_root (struct bcf_cache *c, uint64_t *bucket, unsigned *level)
{
  bool have;

  pthread_rwlock_rdlock (&c->tree_lock);
  have = c->tree.root != NULL;
  if (have) {
    *bucket = bucket_of_ptr (c, c->tree.root->key.ptr);
    *level = c->tree.root->level;
  }
  pthread_rwlock_unlock (&c->tree_lock);
  return have;
}

struct walk_ctx {
  bcf_node_fn fn;
  void *opaque;
};

static int
walk_node (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  const struct walk_ctx *w = opaque;
  const struct bcf_node v = {
    .level = n->level,
    .bucket = bucket_of_ptr (c, n->key.ptr),
    .gen = PTR_GEN (n->key.ptr),
    .inode = ckey_inode (&n->key),
    .offset = ckey_end (&n->key),
    .written = n->written,
    .nkeys = n->keys.nr,
    .node_ = n,
  };

  return w->fn (c, &v, w->opaque);
}

int
bcf_btree_walk (struct bcf_cache *c, bcf_node_fn fn, void *opaque)
{
  struct walk_ctx w = { .fn = fn, .opaque = opaque };
  int r;

  pthread_rwlock_rdlock (&c->tree_lock);
  r = btree_visit (c, walk_node, &w);
  pthread_rwlock_unlock (&c->tree_lock);
  return r;
}

const struct bkey *
bcf_node_key (const struct bcf_node *n, size_t i)
{
  return ckey_bkey (&n->node_->keys.k[i]);
}

bool
bcf_cache_ptr_stale (struct bcf_cache *c, uint64_t ptr)
{
  return ptr_stale (c, ptr);
}

/* ---- buckets ------------------------------------------------------------------ */

static enum bcf_bucket_use
bucket_use (uint8_t mark)
{
  switch (mark) {
  case GC_MARK_RECLAIMABLE: return BCF_BUCKET_CLEAN;
  case GC_MARK_DIRTY:       return BCF_BUCKET_DIRTY;
  case GC_MARK_METADATA:    return BCF_BUCKET_METADATA;
  default:                  return BCF_BUCKET_UNUSED;
  }
}

int
bcf_cache_buckets (struct bcf_cache *c, struct bcf_bucket **out, uint64_t *n)
{
  struct bcf_bucket *b;

  pthread_mutex_lock (&c->alloc.lock);
  b = malloc ((c->alloc.nbuckets ? c->alloc.nbuckets : 1) * sizeof *b);
  if (b) {
    for (uint64_t i = 0; i < c->alloc.nbuckets; i++) {
      const struct bucket *k = &c->alloc.buckets[i];
      b[i] = (struct bcf_bucket) {
        .use = bucket_use (k->mark), .prio = k->prio, .gen = k->gen,
        .sectors_used = k->sectors_used,
      };
    }
    *n = c->alloc.nbuckets;
  }
  pthread_mutex_unlock (&c->alloc.lock);
  *out = b;
  return b ? 0 : -ENOMEM;
}
