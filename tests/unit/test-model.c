/* Model-based random test of the cache engine (core/), at the level of
 * the public API, with millions of operations.
 *
 * A long random mix of bcf_insert (clean or dirty, durable or not),
 * bcf_miss_begin / bcf_miss_fill / bcf_miss_cancel (up to four misses
 * open at once, interleaved with everything else), bcf_invalidate,
 * bcf_lookup + bcf_read_hit, flushes, checkpoints, GC passes and clean
 * close + reopen cycles runs against a small cache (buckets are reclaimed
 * all the time, the journal wraps every few dozen entries, nodes split,
 * coalesce and are evicted from the node cache) over a small key space
 * (many overwrites).  No background threads: the run is deterministic for
 * a seed (the engine's own randomness only picks bset seqs and check-key
 * offsets, and the random replacement policy is reseeded from the seed).
 *
 * The reference map, per block: a version (the data last given for it)
 * and a state:
 *   NONE  the block must not be a hit (never cached, invalidated, under a
 *         check key, or its fill collided).
 *   MUST  the block is cached at a known pointer: a lookup must return a
 *         hit at exactly that pointer, whose bytes are the version's.
 *   MAY   a hit is allowed (bytes must be the version's), a miss too.
 * A clean block leaves MUST only when its bucket is reclaimed: after every
 * operation that can allocate, the test compares every bucket's gen with
 * the previous one, and where a gen moved, MUST blocks pointing into that
 * bucket (ptr_stale) become MAY.  So a miss of a MUST block is a bug
 * (cached data lost), unlike eviction.  MAY, not NONE: a reclaimed key may
 * stay in the tree until GC drops it, and is valid again only if the gen
 * went back, which the gen-wrap guard forbids, so a hit would still have
 * to carry the right bytes.  A dirty block must never leave MUST.
 * Operations whose exact result depends on engine internals (a fill that
 * ran out of space half way, a piece of an insert reclaimed by a later
 * piece of the same insert) leave the affected blocks MAY; the next hit
 * makes them MUST again at the pointer it returned.
 *
 * The cache-miss protocol is checked exactly: every operation that writes
 * keys (insert, invalidate, begin, a successful fill) stamps its blocks;
 * a fill piece (the engine replaces in pieces of one bucket) must succeed
 * iff every block of it still carries the stamp of its bcf_miss_begin,
 * and bcf_miss_fill must return -EEXIST iff a piece collided.
 *
 * Dirty keys: bcf_insert (dirty), and the writes of the request path
 * (bcf_write_begin, then bcf_write_mark_clean, bcf_write_undo, or nothing
 * yet); a check key is never laid over a dirty block (bcf_miss_begin
 * fails with -EEXIST, and the model says when it must).  Each block
 * keeps the dirty bit in memory and the one a crash would find: the last
 * journalled insert's, or the last checkpoint's (clean marks are not
 * journalled: a crash brings the key back dirty).
 *
 * After a clean close and reopen the map must be unchanged: MUST blocks
 * still hit at the same pointer with the same bytes (persistence), NONE
 * blocks still miss (invalidations and check keys reached the disk).
 * Crash episodes: a checkpoint, then only durable journalled operations
 * (durable inserts, dirty writes made durable with bcf_write_sync and
 * perhaps marked clean, durable invalidations) and lookups, then a power
 * cut that loses every unflushed write (bcf_cache_test_crash) and an
 * open: the map must be the checkpoint's plus those operations, with
 * every block marked clean since the checkpoint dirty again, and every
 * clean block of a write-intent region marked at the crash (core/
 * intent.c: its clean data is suspect) dropped.  Every other open cycle
 * runs with the write-intent regions off.
 * The whole key space is verified after each reopen and every 20000
 * operations.
 *
 * Several configurations run as separate test cases (block size, bucket
 * size, replacement policy, node cache bound, dirty data), each with a
 * share of the operations.
 *
 * Environment: TEST_SEED replays a run (the seed is printed first);
 * TEST_MODEL_OPS is the total operation count over all the cases
 * (default 2000000); TEST_VERBOSE prints the engine's log.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "bcachefilter/cache.h"
#include "engine.h"
#include "mem-backing.h"
#include "testlib.h"

static unsigned seed;
static char tmpdir[256];

/* ck_assert_* report every passing check to the Check runner (a write to
 * a pipe each): far too slow for millions of checks.  These report only
 * failures. */
#define REQUIRE(cond, ...)                                              \
  do {                                                                  \
    if (__builtin_expect (!(cond), 0))                                  \
      ck_abort_msg (__VA_ARGS__);                                       \
  } while (0)
#define REQUIRE_OK(call)                                                \
  do {                                                                  \
    int r_ = (call);                                                    \
    REQUIRE (r_ == 0, "seed %u: %s: %s", seed, #call, strerror (-r_));  \
  } while (0)
static uint64_t total_ops;


static void
log_cb (void *opaque, enum bcf_log_level level, const char *msg)
{
  if (level >= BCF_LOG_WARN || getenv ("TEST_VERBOSE"))
    fprintf (stderr, "engine: %s\n", msg);
}

enum { S_NONE = 0, S_MAY, S_MUST };

struct blk {
  uint32_t ver;               /* data last given for the block (0: none) */
  uint8_t st;                 /* S_* */
  bool dirty;                 /* the last insert was dirty (not marked
                                 clean since) */
  bool dirty_disk;            /* ... as a crash would find it */
  uint64_t ptr;               /* S_MUST: pointer of the block's first sector */
  uint64_t stamp;             /* last operation that wrote a key over it */
};

#define MAX_MISSES 4

struct pending {
  bool active;
  struct bcf_miss m;
  uint64_t blk, nb, stamp;
};

struct config {
  const char *name;
  unsigned block_sectors, bucket_sectors, replacement;
  uint64_t cache_bytes, nblocks;
  unsigned dirty_blocks;      /* dirty inserts go to [0, dirty_blocks) */
  size_t small_node_cache;    /* used in every other open cycle */
  unsigned share;             /* of total_ops, in percent */
};

struct counts {
  uint64_t dirty_writes, marked_clean, undone, dirty_refusals, crashes,
           intent_dropped, written_back;
  uint64_t inserts, dirty_inserts, enospc, invalidates, begins, fills,
           fill_ok, collisions, cancels, lookups, hits, hit_blocks,
           reads, flushes, checkpoints, gc, reopens, verifies, reclaimed,
           may_to_must;
  /* Engine stats, summed over the open cycles. */
  uint64_t splits, coalesced, node_evictions, node_loads, journal_writes,
           ckpts, gc_passes, max_depth, max_nodes;
};

struct model {
  const struct config *cfg;
  char path[320];
  struct mem_backing *mb;
  struct bcf_cache_opts opts;
  struct bcf_cache *c;
  unsigned block;             /* bytes */
  uint64_t nblocks;
  struct blk *b;
  struct pending miss[MAX_MISSES];
  uint8_t *gens;              /* last seen gen of every bucket */
  uint8_t *buf, *rbuf;        /* max_op blocks */
  uint64_t max_op;            /* blocks */
  uint64_t stamp, ver;
  uint64_t op;
  struct counts n;
};

/* ---- data ----------------------------------------------------------------------- */

/* The bytes of block blk at version ver: distinct for every (blk, ver). */
static void
gen_block (uint8_t *p, unsigned len, uint64_t blk, uint32_t ver)
{
  uint64_t x = (blk << 32 | ver) * 0x9E3779B97F4A7C15ull + seed;

  for (unsigned i = 0; i < len; i += 8) {
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    memcpy (p + i, &x, 8);
  }
}

static void
check_block (struct model *m, const uint8_t *p, uint64_t blk)
{
  uint8_t want[4096];

  gen_block (want, m->block, blk, m->b[blk].ver);
  REQUIRE (memcmp (p, want, m->block) == 0,
                 "seed %u case %s op %" PRIu64 ": WRONG DATA: block %" PRIu64
                 " (state %d, version %" PRIu32 ") read from the cache is "
                 "not its last version", seed, m->cfg->name, m->op, blk,
                 m->b[blk].st, m->b[blk].ver);
}

/* ---- open / close ------------------------------------------------------------ */

static void
model_open (struct model *m, bool format)
{
  char err[512] = "";
  int r;

  m->opts.format = format ? BCF_FORMAT_AUTO : BCF_FORMAT_NEVER;
  /* Every other cycle with a tiny node cache: clean leaves are dropped
   * at each checkpoint and read back on use. */
  m->opts.node_cache_bytes = m->cfg->small_node_cache &&
                             m->n.reopens % 2 == 1
                             ? m->cfg->small_node_cache : 0;
  m->opts.write_intent_off = (m->n.reopens + m->n.crashes) % 2 == 1;
  r = bcf_cache_open (&m->opts, &m->c, err, sizeof err);
  REQUIRE (r == 0, "seed %u: bcf_cache_open: %s (%s)", seed, err,
                 strerror (-r));
  ck_assert_uint_eq (bcf_cache_block_size (m->c), m->block);
  /* The random replacement policy seeds itself from the clock. */
  m->c->alloc.rand_state = (seed + m->n.reopens) * 0x2545F4914F6CDD1Dull | 1;
  if (!m->gens)
    m->gens = malloc (m->c->alloc.nbuckets);
  for (uint64_t i = 0; i < m->c->alloc.nbuckets; i++)
    m->gens[i] = m->c->alloc.buckets[i].gen;
}

static void
add_stats (struct model *m)
{
  struct bcf_cache_stats st;

  bcf_cache_stats (m->c, &st);
  m->n.splits += st.btree_split.count;
  m->n.coalesced += st.gc_coalesced;
  m->n.node_evictions += st.btree_evictions;
  m->n.node_loads += st.btree_loads;
  m->n.journal_writes += st.journal_writes;
  m->n.ckpts += st.checkpoint.count;
  m->n.gc_passes += st.gc_passes;
  if (st.btree_depth > m->n.max_depth)
    m->n.max_depth = st.btree_depth;
  if (st.btree_nodes > m->n.max_nodes)
    m->n.max_nodes = st.btree_nodes;
}

/* ---- the reference map ---------------------------------------------------------- */

static uint64_t
block_ptr (const struct model *m, uint64_t ext_ptr, uint64_t i)
{
  return MAKE_PTR (PTR_GEN (ext_ptr),
                   PTR_OFFSET (ext_ptr) + i * (m->block >> 9),
                   PTR_DEV (ext_ptr));
}

/* After an operation that may have allocated: where a bucket's gen moved,
 * the clean blocks cached in it may be gone.  Returns true if any gen
 * moved. */
static bool
sweep_gens (struct model *m)
{
  struct alloc_state *a = &m->c->alloc;
  bool moved = false;

  for (uint64_t i = 0; i < a->nbuckets; i++) {
    uint8_t g = __atomic_load_n (&a->buckets[i].gen, __ATOMIC_RELAXED);
    if (g != m->gens[i]) {
      m->gens[i] = g;
      moved = true;
    }
  }
  if (!moved)
    return false;
  for (uint64_t x = 0; x < m->nblocks; x++) {
    struct blk *b = &m->b[x];
    if (b->st == S_MUST && ptr_stale (m->c, b->ptr)) {
      REQUIRE (!b->dirty, "seed %u case %s op %" PRIu64 ": the bucket "
                     "of DIRTY block %" PRIu64 " was reclaimed", seed,
                     m->cfg->name, m->op, x);
      b->st = S_MAY;
      m->n.reclaimed++;
    }
  }
  return true;
}

/* Look up [blk, blk + nb) and check every extent against the map.  With
 * read, hits are read and their bytes checked.  With strict, a MAY block
 * that misses is an error too (used right after an operation that cached
 * the range, when nothing can have been reclaimed meanwhile). */
static void
lookup_check (struct model *m, uint64_t blk, uint64_t nb, bool read)
{
  uint64_t pos = blk * m->block, end = (blk + nb) * m->block;
  struct bcf_extent e[16];

  m->n.lookups++;
  while (pos < end) {
    unsigned n;
    int r = bcf_lookup (m->c, pos, end - pos, e, 16, &n);

    REQUIRE (r == 0, "seed %u op %" PRIu64 ": bcf_lookup: %s", seed,
                   m->op, strerror (-r));
    REQUIRE (n > 0, "seed %u op %" PRIu64 ": empty lookup", seed, m->op);
    for (unsigned i = 0; i < n; i++) {
      uint64_t b0 = e[i].offset / m->block, nbk = e[i].len / m->block;

      REQUIRE (e[i].offset == pos && e[i].len > 0 &&
                     e[i].len % m->block == 0 && e[i].offset + e[i].len <= end,
                     "seed %u op %" PRIu64 ": lookup extent %" PRIu64 "+%"
                     PRIu64 " does not continue at %" PRIu64, seed, m->op,
                     e[i].offset, e[i].len, pos);
      if (e[i].kind == BCF_EXTENT_HIT) {
        m->n.hits++;
        m->n.hit_blocks += nbk;
        REQUIRE (e[i].dev_offset % m->block == 0, "seed %u op %" PRIu64 ": hit not block aligned", seed, m->op);
        for (uint64_t k = 0; k < nbk; k++) {
          struct blk *b = &m->b[b0 + k];
          uint64_t p = block_ptr (m, e[i].ptr, k);
          REQUIRE (b->st != S_NONE, "seed %u case %s op %" PRIu64
                         ": block %" PRIu64 " is a hit but must not be "
                         "cached (version %" PRIu32 ", last written by op "
                         "stamp %" PRIu64 ")", seed, m->cfg->name, m->op,
                         b0 + k, b->ver, b->stamp);
          REQUIRE (e[i].dirty == b->dirty, "seed %u case %s op %"
                         PRIu64 ": block %" PRIu64 " is a %s hit, expected "
                         "%s", seed, m->cfg->name, m->op, b0 + k,
                         e[i].dirty ? "dirty" : "clean",
                         b->dirty ? "dirty" : "clean");
          if (b->st == S_MUST)
            REQUIRE (p == b->ptr, "seed %u case %s op %" PRIu64
                           ": block %" PRIu64 " hits at pointer %" PRIx64
                           ", expected %" PRIx64, seed, m->cfg->name, m->op,
                           b0 + k, p, b->ptr);
          else {
            b->st = S_MUST;
            b->ptr = p;
            m->n.may_to_must++;
          }
        }
        if (read) {
          r = bcf_read_hit (m->c, &e[i], m->rbuf);
          REQUIRE (r == 0, "seed %u op %" PRIu64 ": bcf_read_hit: %s",
                         seed, m->op, strerror (-r));
          m->n.reads++;
          for (uint64_t k = 0; k < nbk; k++)
            check_block (m, m->rbuf + k * m->block, b0 + k);
        }
      }
      else
        for (uint64_t k = 0; k < nbk; k++) {
          struct blk *b = &m->b[b0 + k];
          REQUIRE (b->st != S_MUST, "seed %u case %s op %" PRIu64
                         ": LOST: block %" PRIu64 " (%s, version %" PRIu32
                         ", pointer %" PRIx64 " not stale) is a miss", seed,
                         m->cfg->name, m->op, b0 + k,
                         b->dirty ? "dirty" : "clean", b->ver, b->ptr);
        }
      pos = e[i].offset + e[i].len;
    }
  }
}

static void
verify_all (struct model *m)
{
  m->n.verifies++;
  for (uint64_t x = 0; x < m->nblocks; x += m->max_op) {
    uint64_t nb = m->nblocks - x < m->max_op ? m->nblocks - x : m->max_op;
    lookup_check (m, x, nb, true);
  }
}

/* Blocks of [blk, blk + nb) that an operation left cached but that a
 * lookup shows as misses are acceptable only if a bucket was reclaimed
 * during the operation (a later piece of it may have reclaimed an
 * earlier piece's bucket).  Then they become MAY. */
static void
settle (struct model *m, uint64_t blk, uint64_t nb, bool reclaimed)
{
  if (reclaimed)
    for (uint64_t k = 0; k < nb; k++)
      if (m->b[blk + k].st == S_MUST)
        m->b[blk + k].st = S_MAY;
  lookup_check (m, blk, nb, false);
}

/* ---- operations -------------------------------------------------------------- */

/* The engine's checkpoints so far (it also runs them by itself, when the
 * journal fills up). */
static uint64_t
checkpoints (struct model *m)
{
  struct bcf_cache_stats st;

  bcf_cache_stats (m->c, &st);
  return st.checkpoint.count;
}

/* A checkpoint since *seen captured the map as it is now: that is what
 * a crash finds (before the blocks of the operation that ran it are
 * updated: their journalled state comes after the checkpoint). */
static void
note_checkpoints (struct model *m, uint64_t *seen)
{
  uint64_t now = checkpoints (m);

  if (now == *seen)
    return;
  *seen = now;
  for (uint64_t x = 0; x < m->nblocks; x++)
    m->b[x].dirty_disk = m->b[x].dirty;
}

/* seen (if not NULL): note_checkpoints, in a crash episode. */
static void
op_insert (struct model *m, uint64_t blk, uint64_t nb, bool dirty,
           bool durable, uint64_t *seen)
{
  uint64_t stamp = ++m->stamp;
  bool moved;
  int r;

  for (uint64_t k = 0; k < nb; k++)
    gen_block (m->buf + k * m->block, m->block, blk + k,
               (uint32_t) (m->ver + 1 + k));
  r = bcf_insert (m->c, blk * m->block, nb * m->block, m->buf, dirty,
                  durable);
  if (seen)
    note_checkpoints (m, seen);
  REQUIRE (r == 0 || r == -ENOSPC, "seed %u op %" PRIu64
                 ": bcf_insert: %s", seed, m->op, strerror (-r));
  m->n.inserts++;
  m->n.dirty_inserts += dirty;
  moved = sweep_gens (m);
  for (uint64_t k = 0; k < nb; k++) {
    struct blk *b = &m->b[blk + k];
    b->ver = (uint32_t) (m->ver + 1 + k);
    b->stamp = stamp;
    b->dirty = b->dirty_disk = dirty && r == 0;
    /* MAY until the lookup below tells the pointer. */
    b->st = r == 0 ? S_MAY : S_NONE;
  }
  m->ver += nb;
  if (r == -ENOSPC) {
    m->n.enospc++;
    REQUIRE_OK (bcf_gc_run (m->c));
    sweep_gens (m);
    return;
  }
  lookup_check (m, blk, nb, false);
  if (!moved)
    for (uint64_t k = 0; k < nb; k++)
      REQUIRE (m->b[blk + k].st == S_MUST, "seed %u case %s op %"
                     PRIu64 ": block %" PRIu64 " is not cached right after "
                     "its insert", seed, m->cfg->name, m->op, blk + k);
}

static void
op_invalidate (struct model *m, uint64_t blk, uint64_t nb, bool durable,
               uint64_t *seen)
{
  uint64_t stamp = ++m->stamp;
  int r = bcf_invalidate (m->c, blk * m->block, nb * m->block, durable);

  if (seen)
    note_checkpoints (m, seen);
  REQUIRE (r == 0, "seed %u op %" PRIu64 ": bcf_invalidate: %s", seed,
                 m->op, strerror (-r));
  m->n.invalidates++;
  sweep_gens (m);
  for (uint64_t k = 0; k < nb; k++) {
    m->b[blk + k].st = S_NONE;
    m->b[blk + k].dirty = m->b[blk + k].dirty_disk = false;
    m->b[blk + k].stamp = stamp;
  }
}

/* A write of the request path: data in as dirty keys, then, as the
 * backing write succeeded or failed, marked clean or undone, or left
 * dirty (in flight, or writeback mode).  With sync, the keys are made
 * durable (a crash episode). */
static void
op_dirty_write (struct model *m, uint64_t blk, uint64_t nb, bool sync,
                uint64_t *seen)
{
  uint64_t stamp = ++m->stamp, what = rnd_below (10);
  struct bcf_write w;
  bool moved;
  int r;

  for (uint64_t k = 0; k < nb; k++)
    gen_block (m->buf + k * m->block, m->block, blk + k,
               (uint32_t) (m->ver + 1 + k));
  r = bcf_write_begin (m->c, blk * m->block, nb * m->block, m->buf, &w);
  if (seen)
    note_checkpoints (m, seen);
  REQUIRE (r == 0 || r == -ENOSPC, "seed %u op %" PRIu64
           ": bcf_write_begin: %s", seed, m->op, strerror (-r));
  m->n.dirty_writes++;
  moved = sweep_gens (m);
  for (uint64_t k = 0; k < nb; k++) {
    struct blk *b = &m->b[blk + k];
    b->ver = (uint32_t) (m->ver + 1 + k);
    b->stamp = stamp;
    b->dirty = b->dirty_disk = r == 0;
    b->st = r == 0 ? S_MAY : S_NONE;
  }
  m->ver += nb;
  if (r == -ENOSPC) {
    /* No room: nothing of the write went in and the range still holds
     * what it held (bcf_write_begin drops nothing, so that older dirty
     * data survives until the caller has written it back); the caller
     * then invalidates the range durably, as the request path does
     * (invalidate_durably in core/request.c).  Durably, because the map
     * now says NONE and only a durable whiteout survives a crash: the
     * range may hold keys a crash brings back (here, a durable insert
     * of this crash episode), and a whiteout left in the open journal
     * entry is lost with it (TEST_SEED=1796483540, random-4k-16k, op
     * 517500: the last operation of a crash episode). */
    m->n.enospc++;
    REQUIRE_OK (bcf_invalidate (m->c, blk * m->block, nb * m->block, true));
    REQUIRE_OK (bcf_gc_run (m->c));
    sweep_gens (m);
    return;
  }
  if (sync) {
    REQUIRE_OK (bcf_write_sync (m->c, &w));
    if (seen)
      note_checkpoints (m, seen);
  }
  lookup_check (m, blk, nb, false);
  if (!moved)
    for (uint64_t k = 0; k < nb; k++)
      REQUIRE (m->b[blk + k].st == S_MUST, "seed %u case %s op %"
               PRIu64 ": block %" PRIu64 " is not cached right after its "
               "dirty write", seed, m->cfg->name, m->op, blk + k);
  if (what < 7) {                       /* the backing write succeeded */
    int64_t clean = bcf_write_mark_clean (m->c, &w);
    REQUIRE (clean == (int64_t) (nb * m->block), "seed %u op %" PRIu64
             ": bcf_write_mark_clean cleaned %" PRId64 " of %" PRIu64
             " bytes", seed, m->op, clean, nb * m->block);
    for (uint64_t k = 0; k < nb; k++)
      m->b[blk + k].dirty = false;      /* on disk: still dirty */
    m->n.marked_clean++;
  }
  else if (what < 8) {                  /* ... failed */
    REQUIRE_OK (bcf_write_undo (m->c, &w));
    if (seen)
      note_checkpoints (m, seen);
    sweep_gens (m);
    for (uint64_t k = 0; k < nb; k++) {
      struct blk *b = &m->b[blk + k];
      b->st = S_NONE;
      b->dirty = b->dirty_disk = false;
      b->stamp = ++m->stamp;
    }
    m->n.undone++;
  }
  bcf_write_release (m->c, &w);
  lookup_check (m, blk, nb, false);
}

/* The writeback's clean marks: the dirty extents found in
 * [blk, blk + nb) by bcf_dirty_scan, whole inside it, marked clean with
 * bcf_dirty_mark_clean as core/writeback.c does once the backing store
 * has them.  Not journalled: a crash finds them dirty again, so a later
 * invalidation of such a block must still be journalled (its dirty
 * version is in a checkpoint or the journal). */
static void
op_writeback_clean (struct model *m, uint64_t blk, uint64_t nb)
{
  const uint64_t end = (blk + nb) * m->block;
  uint64_t pos = blk * m->block;

  while (pos < end) {
    struct bcf_extent e[16];
    unsigned n = 0;

    REQUIRE_OK (bcf_dirty_scan (m->c, pos, e, 16, &n));
    if (n == 0)
      break;
    for (unsigned i = 0; i < n; i++) {
      uint64_t eb = e[i].offset / m->block, enb = e[i].len / m->block;
      int64_t clean;

      if (e[i].offset >= end) {
        pos = end;
        break;
      }
      pos = e[i].offset + e[i].len;
      if (e[i].offset < blk * m->block || pos > end)
        continue;
      for (uint64_t k = 0; k < enb; k++)
        REQUIRE (m->b[eb + k].dirty, "seed %u op %" PRIu64 ": block %"
                 PRIu64 " is dirty in the cache, clean in the model",
                 seed, m->op, eb + k);
      clean = bcf_dirty_mark_clean (m->c, &e[i]);
      REQUIRE (clean == (int64_t) e[i].len, "seed %u op %" PRIu64
               ": bcf_dirty_mark_clean cleaned %" PRId64 " of %" PRIu64
               " bytes", seed, m->op, clean, e[i].len);
      for (uint64_t k = 0; k < enb; k++)
        m->b[eb + k].dirty = false;     /* on disk: still dirty */
      m->n.written_back++;
    }
  }
  lookup_check (m, blk, nb, false);
}

static bool
range_dirty (const struct model *m, uint64_t blk, uint64_t nb)
{
  for (uint64_t k = 0; k < nb; k++)
    if (m->b[blk + k].dirty)
      return true;
  return false;
}

static void
op_begin (struct model *m, struct pending *p, uint64_t blk, uint64_t nb)
{
  uint64_t stamp = ++m->stamp;
  bool dirty = range_dirty (m, blk, nb);
  int r = bcf_miss_begin (m->c, blk * m->block, nb * m->block, &p->m);

  REQUIRE (r == (dirty ? -EEXIST : 0), "seed %u op %" PRIu64
           ": bcf_miss_begin over %s blocks: %s", seed, m->op,
           dirty ? "dirty" : "clean", r ? strerror (-r) : "success");
  if (dirty) {                  /* never over dirty data: nothing changed */
    m->n.dirty_refusals++;
    lookup_check (m, blk, nb, false);
    return;
  }
  m->n.begins++;
  sweep_gens (m);
  p->active = true;
  p->blk = blk;
  p->nb = nb;
  p->stamp = stamp;
  /* The check key replaces whatever was cached there. */
  for (uint64_t k = 0; k < nb; k++) {
    m->b[blk + k].st = S_NONE;
    m->b[blk + k].dirty = m->b[blk + k].dirty_disk = false;
    m->b[blk + k].stamp = stamp;
  }
}

/* The engine replaces a fill in pieces of one bucket (or KEY_SIZE's
 * maximum), rounded down to the block size, from the start of the miss. */
static uint64_t
fill_piece_blocks (const struct model *m)
{
  uint64_t chunk = m->c->bucket_sectors < BKEY_MAX_SIZE
                   ? m->c->bucket_sectors : BKEY_MAX_SIZE;
  return chunk / (m->block >> 9);
}

static void
op_fill (struct model *m, struct pending *p)
{
  const uint64_t piece = fill_piece_blocks (m);
  uint64_t stamp = ++m->stamp;
  bool any_collide = false, moved;
  int r;

  for (uint64_t k = 0; k < p->nb; k++)
    gen_block (m->buf + k * m->block, m->block, p->blk + k,
               (uint32_t) (m->ver + 1 + k));
  r = bcf_miss_fill (m->c, &p->m, m->buf);
  m->n.fills++;
  moved = sweep_gens (m);
  REQUIRE (r == 0 || r == -EEXIST || r == -ENOSPC, "seed %u op %"
                 PRIu64 ": bcf_miss_fill: %s", seed, m->op, strerror (-r));
  for (uint64_t k0 = 0; k0 < p->nb; k0 += piece) {
    uint64_t k1 = k0 + piece < p->nb ? k0 + piece : p->nb;
    bool whole = true;

    for (uint64_t k = k0; k < k1; k++)
      whole &= m->b[p->blk + k].stamp == p->stamp;
    any_collide |= !whole;
    for (uint64_t k = k0; k < k1; k++) {
      struct blk *b = &m->b[p->blk + k];
      if (b->stamp != p->stamp)
        continue;               /* someone else's write: theirs stays */
      /* Untouched blocks of a collided piece keep the check key. */
      if (whole && r != -ENOSPC) {
        b->ver = (uint32_t) (m->ver + 1 + k);
        b->st = S_MAY;          /* MUST after the lookup below */
        b->stamp = stamp;
      }
      else if (r == -ENOSPC) {
        /* Filled or cancelled, depending on where space ran out. */
        b->ver = (uint32_t) (m->ver + 1 + k);
        b->st = S_MAY;
        b->stamp = stamp;
      }
    }
  }
  m->ver += p->nb;
  p->active = false;
  if (r == -ENOSPC) {
    m->n.enospc++;
    REQUIRE_OK (bcf_gc_run (m->c));
    sweep_gens (m);
    return;
  }
  REQUIRE ((r == -EEXIST) == any_collide, "seed %u case %s op %" PRIu64
                 ": bcf_miss_fill over blocks %" PRIu64 "+%" PRIu64
                 " returned %s, but the model says %s", seed, m->cfg->name,
                 m->op, p->blk, p->nb, r ? strerror (-r) : "success",
                 any_collide ? "a piece was touched (collision)"
                 : "nothing touched it");
  if (any_collide)
    m->n.collisions++;
  else
    m->n.fill_ok++;
  lookup_check (m, p->blk, p->nb, false);
  if (!moved)
    for (uint64_t k = 0; k < p->nb; k++)
      if (m->b[p->blk + k].stamp == stamp)
        REQUIRE (m->b[p->blk + k].st == S_MUST, "seed %u case %s op %"
                       PRIu64 ": block %" PRIu64 " is not cached right after "
                       "its fill", seed, m->cfg->name, m->op, p->blk + k);
}

static void
op_cancel (struct model *m, struct pending *p)
{
  bcf_miss_cancel (m->c, &p->m);
  m->n.cancels++;
  sweep_gens (m);
  p->active = false;
  /* Blocks still under our check key were NONE and stay NONE; blocks
   * someone else wrote keep their state. */
  settle (m, p->blk, p->nb, false);
}

static void
finish_misses (struct model *m)
{
  for (int i = 0; i < MAX_MISSES; i++)
    if (m->miss[i].active) {
      if (rnd_below (2))
        op_fill (m, &m->miss[i]);
      else
        op_cancel (m, &m->miss[i]);
    }
}

/* A crash episode (see the header comment). */
static void
op_crash_episode (struct model *m)
{
  struct bcf_io_faults armed = { 0 };
  unsigned n = 5 + (unsigned) rnd_below (40), nmarked;
  uint64_t seen, marked[64];

  finish_misses (m);
  REQUIRE_OK (bcf_cache_checkpoint (m->c));
  sweep_gens (m);
  seen = checkpoints (m);
  for (uint64_t x = 0; x < m->nblocks; x++)
    m->b[x].dirty_disk = m->b[x].dirty;
  /* From here the device has a volatile write cache (io.h). */
  bcf_io_set_faults (bcf_cache_test_io (m->c), &armed);
  for (unsigned i = 0; i < n; i++) {
    uint64_t nb = 1 + rnd_below (4);
    uint64_t what = rnd_below (10);
    uint64_t blk = rnd_below (m->nblocks - nb + 1);

    if (m->cfg->dirty_blocks && what < 5) {
      blk = rnd_below (m->cfg->dirty_blocks - nb + 1);
      if (what < 2)
        op_dirty_write (m, blk, nb, true, &seen);
      else if (what < 4)
        op_insert (m, blk, nb, true, true, &seen);
      else {
        /* Written back, then changed: the invalidation must survive. */
        op_writeback_clean (m, blk, nb);
        op_invalidate (m, blk, nb, true, &seen);
      }
    }
    else if (what < 6)
      op_insert (m, blk, nb, false, true, &seen);
    else if (what < 7)
      op_invalidate (m, blk, nb, true, &seen);
    else
      lookup_check (m, blk, nb, rnd_below (2));
  }
  add_stats (m);
  nmarked = intent_list (m->c, marked, 64);
  bcf_cache_test_crash (m->c, seed + m->op, BCF_IO_CRASH_LOSE_ALL);
  m->c = NULL;
  m->n.crashes++;
  model_open (m, false);
  for (uint64_t x = 0; x < m->nblocks; x++)
    if (m->b[x].st != S_NONE)
      m->b[x].dirty = m->b[x].dirty_disk;
  /* Clean blocks of the regions marked at the crash are dropped. */
  for (unsigned i = 0; i < nmarked; i++) {
    uint64_t per = INTENT_REGION_SECTORS * 512 / m->block;
    for (uint64_t x = marked[i] * per; x < (marked[i] + 1) * per &&
         x < m->nblocks; x++)
      if (m->b[x].st != S_NONE && !m->b[x].dirty) {
        m->b[x].st = S_NONE;
        m->n.intent_dropped++;
      }
  }
  for (uint64_t i = 0; i < m->c->alloc.nbuckets; i++)
    m->gens[i] = m->c->alloc.buckets[i].gen;
  verify_all (m);
  REQUIRE_OK (bcf_cache_fsck (m->c, NULL, 0));
}

static void
op_reopen (struct model *m)
{
  finish_misses (m);
  /* Close checkpoints, and a checkpoint may reclaim buckets (refill):
   * checkpoint first so the model sees that, and close has nothing left
   * to write. */
  REQUIRE_OK (bcf_cache_checkpoint (m->c));
  sweep_gens (m);
  add_stats (m);
  REQUIRE_OK (bcf_cache_close (m->c));
  m->c = NULL;
  m->n.reopens++;
  model_open (m, false);
  /* Opening may invalidate buckets that hold nothing live; nothing
   * cached may be lost. */
  for (uint64_t i = 0; i < m->c->alloc.nbuckets; i++)
    m->gens[i] = m->c->alloc.buckets[i].gen;
  verify_all (m);
  REQUIRE_OK (bcf_cache_fsck (m->c, NULL, 0));
}

/* ---- the run --------------------------------------------------------------- */

static void
model_run (const struct config *cfg)
{
  struct model m;
  uint64_t ops = total_ops * cfg->share / 100, reopen_every;
  uint64_t t0 = bcf_now_ns ();

  memset (&m, 0, sizeof m);
  m.cfg = cfg;
  m.block = cfg->block_sectors * 512;
  m.nblocks = cfg->nblocks;
  m.max_op = 64;
  m.b = calloc (m.nblocks, sizeof *m.b);
  m.buf = malloc (m.max_op * m.block);
  m.rbuf = malloc (m.max_op * m.block);
  ck_assert (m.b && m.buf && m.rbuf);
  rng_state = (seed + 1) * 0x9E3779B97F4A7C15ull ^ cfg->bucket_sectors;

  snprintf (m.path, sizeof m.path, "%s/model-%s.img", tmpdir, cfg->name);
  unlink (m.path);
  m.mb = mem_backing_new (m.nblocks * m.block);
  m.opts.path = m.path;
  m.opts.create_size = cfg->cache_bytes;
  m.opts.bucket_sectors = cfg->bucket_sectors;
  m.opts.block_sectors = cfg->block_sectors;
  m.opts.replacement = cfg->replacement;
  m.opts.backing = mem_backing_get (m.mb);
  memcpy (m.opts.backing_uuid, "model-test-uuid!", 16);
  m.opts.log = log_cb;
  if (getenv ("TEST_MODEL_IO"))
    m.opts.io_mode = atoi (getenv ("TEST_MODEL_IO"));
  model_open (&m, true);

  /* About 40 close/reopen cycles per run, at least one every 50000. */
  reopen_every = ops / 40 > 50000 ? 50000 : ops / 40 > 500 ? ops / 40 : 500;

  for (m.op = 0; m.op < ops; m.op++) {
    uint64_t what = rnd_below (10000);
    uint64_t nb = rnd_below (8) ? 1 + rnd_below (4)
                  : 1 + rnd_below (rnd_below (4) ? 16 : m.max_op);
    uint64_t blk = rnd_below (m.nblocks - nb + 1);

    if (what < 3000) {                          /* 30%: insert */
      bool dirty = cfg->dirty_blocks && rnd_below (10) == 0;
      if (dirty) {
        nb = 1 + rnd_below (4);
        blk = rnd_below (cfg->dirty_blocks - nb + 1);
        if (rnd_below (8) == 0)                 /* the writeback's */
          op_writeback_clean (&m, blk, nb);
        else if (rnd_below (2))                 /* the request path's */
          op_dirty_write (&m, blk, nb, rnd_below (10) == 0, NULL);
        else
          op_insert (&m, blk, nb, true, rnd_below (50) == 0, NULL);
      }
      else
        op_insert (&m, blk, nb, false, rnd_below (50) == 0, NULL);
    }
    else if (what < 4000) {                     /* 10%: invalidate */
      if (rnd_below (20) == 0) {                /* a large range */
        nb = 1 + rnd_below (m.nblocks / 4);
        blk = rnd_below (m.nblocks - nb + 1);
      }
      op_invalidate (&m, blk, nb, rnd_below (20) == 0, NULL);
    }
    else if (what < 5800) {                     /* 18%: the miss protocol */
      struct pending *p = &m.miss[rnd_below (MAX_MISSES)];
      if (!p->active)
        op_begin (&m, p, blk, nb);
      else if (rnd_below (5))
        op_fill (&m, p);
      else
        op_cancel (&m, p);
    }
    else if (what < 9930)                       /* 41%: lookups (+ reads) */
      lookup_check (&m, blk, nb, rnd_below (4) == 0);
    else if (what < 9990) {                     /* flush */
      REQUIRE_OK (bcf_flush (m.c));
      m.n.flushes++;
      sweep_gens (&m);
    }
    else if (what < 9997) {                     /* checkpoint */
      REQUIRE_OK (bcf_cache_checkpoint (m.c));
      m.n.checkpoints++;
      sweep_gens (&m);
    }
    else {                                      /* GC pass */
      REQUIRE_OK (bcf_gc_run (m.c));
      m.n.gc++;
      sweep_gens (&m);
    }

    if (m.op % reopen_every == reopen_every - 1)
      op_reopen (&m);
    else if (m.op % reopen_every == reopen_every / 2)
      op_crash_episode (&m);
    else if (m.op % 20000 == 19999)
      verify_all (&m);
  }
  finish_misses (&m);
  verify_all (&m);
  REQUIRE_OK (bcf_cache_fsck (m.c, NULL, 0));
  op_reopen (&m);
  add_stats (&m);

  printf ("test-model: %s: %" PRIu64 " ops in %.1f s: %" PRIu64 " inserts (%"
          PRIu64 " dirty, %" PRIu64 " ENOSPC), %" PRIu64 " invalidates, %"
          PRIu64 " misses begun (%" PRIu64 " filled, %" PRIu64 " collided, %"
          PRIu64 " cancelled), %" PRIu64 " lookups (%" PRIu64 " hit extents, %"
          PRIu64 " blocks; %" PRIu64 " reads checked), %" PRIu64 " flushes, %"
          PRIu64 " reopens, %" PRIu64 " full verifies\n", cfg->name, ops,
          (bcf_now_ns () - t0) / 1e9, m.n.inserts, m.n.dirty_inserts,
          m.n.enospc, m.n.invalidates, m.n.begins, m.n.fill_ok,
          m.n.collisions, m.n.cancels, m.n.lookups, m.n.hits, m.n.hit_blocks,
          m.n.reads, m.n.flushes, m.n.reopens, m.n.verifies);
  printf ("test-model: %s: %" PRIu64 " dirty writes (%" PRIu64 " marked "
          "clean, %" PRIu64 " undone), %" PRIu64 " extents marked clean by "
          "writeback, %" PRIu64 " misses refused over dirty "
          "data, %" PRIu64 " crash episodes (%" PRIu64 " clean blocks of "
          "marked write-intent regions dropped)\n", cfg->name,
          m.n.dirty_writes, m.n.marked_clean, m.n.undone, m.n.written_back,
          m.n.dirty_refusals, m.n.crashes, m.n.intent_dropped);
  printf ("test-model: %s: engine: %" PRIu64 " blocks reclaimed, %" PRIu64
          " splits, %" PRIu64 " coalesced, %" PRIu64 " checkpoints, %" PRIu64
          " journal writes, %" PRIu64 " GC passes, %" PRIu64 " node "
          "evictions, %" PRIu64 " reloads, up to %" PRIu64 " nodes, depth %"
          PRIu64 "\n", cfg->name, m.n.reclaimed, m.n.splits, m.n.coalesced,
          m.n.ckpts, m.n.journal_writes, m.n.gc_passes, m.n.node_evictions,
          m.n.node_loads, m.n.max_nodes, m.n.max_depth);
  fflush (stdout);
  /* A long run must have exercised what it is meant to. */
  if (ops >= 200000) {
    ck_assert_uint_gt (m.n.reclaimed, 0);
    ck_assert_uint_gt (m.n.splits, 0);
    ck_assert_uint_gt (m.n.coalesced, 0);
    ck_assert_uint_gt (m.n.collisions, 0);
    ck_assert_uint_gt (m.n.ckpts, m.n.checkpoints);
    ck_assert_uint_gt (m.n.max_depth, 1);
    if (cfg->small_node_cache)
      ck_assert_uint_gt (m.n.node_loads, 0);
    ck_assert_uint_gt (m.n.crashes, 0);
    if (cfg->dirty_blocks) {
      ck_assert_uint_gt (m.n.marked_clean, 0);
      ck_assert_uint_gt (m.n.written_back, 0);
      ck_assert_uint_gt (m.n.undone, 0);
      ck_assert_uint_gt (m.n.dirty_refusals, 0);
    }
  }

  bcf_cache_close (m.c);
  mem_backing_free (m.mb);
  unlink (m.path);
  free (m.b);
  free (m.buf);
  free (m.rbuf);
  free (m.gens);
}

/* Caches of 2-4 MiB over 8-16 MiB of key space: a few hundred buckets,
 * most of them reclaimed again and again. */
static const struct config configs[] = {
  { "lru-4k", 8, 16, BCH_REPLACEMENT_LRU, 4 << 20, 2048, 32, 16384, 40 },
  { "fifo-512", 1, 16, BCH_REPLACEMENT_FIFO, 2 << 20, 8192, 64, 8192, 30 },
  { "random-4k-16k", 8, 32, BCH_REPLACEMENT_RANDOM, 4 << 20, 4096, 32, 0, 30 },
};

START_TEST (test_model)
{
  model_run (&configs[_i]);
}
END_TEST

static Suite *
model_suite (void)
{
  Suite *s = suite_create ("model");

  for (unsigned i = 0; i < sizeof configs / sizeof configs[0]; i++) {
    TCase *tc = tcase_create (configs[i].name);
    tcase_set_timeout (tc, 600);
    tcase_add_loop_test (tc, test_model, (int) i, (int) i + 1);
    suite_add_tcase (s, tc);
  }
  return s;
}

int
main (void)
{
  int r;

  seed = test_seed ("test-model");
  total_ops = getenv ("TEST_MODEL_OPS")
              ? strtoull (getenv ("TEST_MODEL_OPS"), NULL, 0) : 2000000;
  printf ("test-model: %" PRIu64 " operations (TEST_MODEL_OPS)\n",
          total_ops);
  fflush (stdout);
  test_tmpdir (tmpdir, sizeof tmpdir, "bcf-model");
  r = test_main (model_suite ());
  rmdir (tmpdir);
  return r;
}
