/* bcachefilter: read-only views of a cache, for tools and checks.
 *
 * Design
 * ------
 * What bcachefilter-show prints and what the engine trusts come from the
 * same functions, so the two cannot disagree:
 *
 * - the journal: bcf_journal_inspect reads every journal bucket block by
 *   block (bch_journal_bucket_scan) and judges the entries.  The engine's
 *   open reads its journal with the same scan and refuses it by the same
 *   verdict (core/journal.c, journal_read), with the same message: the
 *   newest valid entry names the oldest entry replay needs (last_seq),
 *   and every entry from there to the newest must be there exactly once,
 *   with keys that decode and point inside the cache.  Blocks that carry
 *   the journal's magic but do not decode (a torn or corrupt write) are
 *   listed and judged by the seq their header claims (unchecked, as the
 *   block does not decode; journal_judge, core/journal.c): newer than the newest
 *   valid entry, or a seq that a valid entry also has (rewritten after a
 *   crash), is a torn tail: the write in flight at a crash, never
 *   acknowledged, not an error; older than every valid entry is stale
 *   (a ring bucket's leftovers); between the oldest and the newest valid
 *   entries with no valid copy is corruption: entries are written one at
 *   a time in seq order, each durable before the next, so valid entries
 *   on both sides of a bad one mean it was durable once.  The open logs
 *   what it skipped (a warning), and bcf_cache_fsck reports it: the
 *   torn tail as a note, corruption as a problem.
 * - the btree: bcf_btree_walk visits the nodes the open loaded, parents
 *   before children, under the btree lock.
 * - buckets: bcf_cache_buckets copies the allocator's view of every
 *   bucket (use, prio, gen) under its lock.
 * - write-intent marks: bcf_cache_intent_marks lists the regions marked
 *   in the tree, whose clean data a crash left suspect.
 * - bcf_cache_fsck: the checks an open does not already make.
 *
 * A cache opened read-only (bcf_cache_opts.readonly) is never written;
 * these views change nothing.
 *
 * Locking: each call takes the engine's locks it needs; a walk's callback
 * runs under the btree lock and may call only bcf_node_key and
 * bcf_cache_ptr_stale.
 */
#ifndef BCACHEFILTER_INSPECT_H
#define BCACHEFILTER_INSPECT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/format.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

/* ---- The journal -------------------------------------------------------- */

enum bcf_journal_bad {
  BCF_JOURNAL_BAD_TORN,     /* a torn tail: never acknowledged */
  BCF_JOURNAL_BAD_STALE,    /* older than every valid entry */
  BCF_JOURNAL_BAD_CORRUPT,  /* valid entries older and newer: was durable */
};

struct bcf_journal_entry {
  bool bad;                 /* carries the magic but does not decode */
  uint64_t claimed_seq;     /* bad: the seq its header claims (unchecked) */
  enum bcf_journal_bad why; /* bad: the judgement, see above */
  unsigned index;           /* journal bucket: index in sb.d[] */
  uint64_t bucket;          /* ... and its bucket number */
  size_t offset;            /* bytes into the bucket */
  size_t bytes;             /* valid: size rounded up to the block size */
  struct bch_jset hdr;      /* valid: hdr.key_words points to words */
  uint64_t *words;          /* valid: a copy of the key words */
  unsigned nkeys;           /* valid: keys before the first bad one */
  char msg[320];            /* bad: why; valid: the first bad key, or "" */
};

enum bcf_journal_status {
  BCF_JOURNAL_OK,
  BCF_JOURNAL_EMPTY,        /* no valid entry */
  BCF_JOURNAL_GAP,          /* entries replay needs are missing */
  BCF_JOURNAL_DUPLICATE,    /* an entry replay needs is there twice */
  BCF_JOURNAL_BAD_KEY,      /* an entry replay needs holds a bad key */
};

#define BCF_JOURNAL_LISTED 16   /* gaps and duplicates kept for display */

struct bcf_journal_scan {
  /* Every valid entry and every bad block, in the order of the ring. */
  struct bcf_journal_entry *entries;
  size_t n;
  size_t valid;             /* how many of them are valid */
  /* The verdict. */
  enum bcf_journal_status status;
  const struct bcf_journal_entry *newest;     /* NULL if EMPTY */
  struct { uint64_t from, to; } gaps[BCF_JOURNAL_LISTED];
  size_t ngaps;             /* may exceed BCF_JOURNAL_LISTED */
  uint64_t dups[BCF_JOURNAL_LISTED];
  size_t ndups;
  const struct bcf_journal_entry *bad_key;
  char msg[768];            /* "" when OK: what is wrong, in words */
  /* The bad blocks, judged (whatever the status). */
  size_t ntorn, nstale, ncorrupt;
  char skipped[768];        /* "" if none torn or corrupt: what was skipped
                               and what it means, in words (the open's
                               warning, fsck's note or problem) */
};

/* Is an entry one that replay needs (newest's last_seq .. newest)? */
bool bcf_journal_needed (const struct bcf_journal_scan *s,
                         const struct bcf_journal_entry *e);

/* Read and judge the journal of the cache device at path, whose decoded
 * superblock is sb.  Returns 0 with the entries and the verdict in *s
 * (whatever the verdict: a corrupt journal is a result, not an error),
 * or -errno with a message in err if the device cannot be read.  Free
 * *s with bcf_journal_scan_free in either case. */
int bcf_journal_inspect (const char *path, const struct bch_sb *sb,
                         struct bcf_journal_scan *s, char *err,
                         size_t errlen);
void bcf_journal_scan_free (struct bcf_journal_scan *s);

/* ---- The btree ------------------------------------------------------------- */

struct btree_node;

struct bcf_node {
  unsigned level;           /* 0: a leaf */
  uint64_t bucket;          /* where the node is */
  uint8_t gen;              /* its pointer's gen */
  uint64_t inode, offset;   /* its key: the greatest position it holds */
  size_t written;           /* bytes of the node on disk */
  size_t nkeys;
  const struct btree_node *node_;   /* the engine's, for bcf_node_key */
};

/* The root node's bucket and level; false if the tree has no root. */
bool bcf_btree_root (struct bcf_cache *c, uint64_t *bucket, unsigned *level);
/* Visit every node in memory, depth first: a parent before its
 * children, so each level's nodes come from left to right.  Returns 0,
 * fn's first non-zero return, or -EIO if a child node is missing. */
typedef int (*bcf_node_fn) (struct bcf_cache *c, const struct bcf_node *n,
                            void *opaque);
int bcf_btree_walk (struct bcf_cache *c, bcf_node_fn fn, void *opaque);
/* Key i (< n->nkeys) of the node being visited: a bkey with at most one
 * pointer, valid during the callback. */
const struct bkey *bcf_node_key (const struct bcf_node *n, size_t i);
/* Has the bucket a pointer points into been reused since (its gen moved
 * on)?  A stale pointer's data is gone. */
bool bcf_cache_ptr_stale (struct bcf_cache *c, uint64_t ptr);

/* ---- Buckets ----------------------------------------------------------------- */

enum bcf_bucket_use {
  BCF_BUCKET_UNUSED,        /* nothing live */
  BCF_BUCKET_CLEAN,         /* clean cached data */
  BCF_BUCKET_DIRTY,         /* dirty data */
  BCF_BUCKET_METADATA,      /* btree, prios, uuids, journal */
};

struct bcf_bucket {
  enum bcf_bucket_use use;  /* as the last GC mark saw it */
  uint16_t prio;            /* bcache's LRU priority */
  uint8_t gen;
  uint32_t sectors_used;
};

/* A copy of every bucket: *out (freed by the caller with free) gets *n
 * entries.  Returns 0 or -ENOMEM. */
int bcf_cache_buckets (struct bcf_cache *c, struct bcf_bucket **out,
                       uint64_t *n);

/* ---- Write-intent marks ------------------------------------------------------ */

/* Write-intent regions (core/intent.c) are this big. */
#define BCF_INTENT_REGION_BYTES (16ull << 20)

/* The regions marked in the tree as the open found them (after a crash:
 * the clean data in them is suspect, and the next read-write open drops
 * it): up to max region start offsets (bytes of the export) from
 * byte from on, in order, into out.  Returns how many. */
unsigned bcf_cache_intent_marks (struct bcf_cache *c, uint64_t from,
                                 uint64_t *out, unsigned max);

/* ---- Consistency ------------------------------------------------------------- */

/* Check what open does not already enforce (core/fsck.c): returns the
 * number of problems, listed one per line in report (len bytes,
 * truncated if need be), or -1 if out of memory.  Lines starting with
 * "note: " are not problems (not counted): things worth saying that are
 * normal, such as a torn journal tail after a crash.  Meant for an idle
 * cache. */
int bcf_cache_fsck (struct bcf_cache *c, char *report, size_t len);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_INSPECT_H */
