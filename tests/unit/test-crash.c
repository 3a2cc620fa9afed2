/* Crash tests for the cache engine, in Open CAS's style: for every I/O
 * index N of a scripted workload, cut the power after the N-th write to
 * the cache device, let its volatile write cache lose a seeded random
 * subset of the unflushed writes (core/io.c's crash model), reopen, and
 * check:
 *
 *   - the cache opens (recovery never gives up on a crash);
 *   - fsck finds nothing wrong (bcf_cache_fsck: node ranges, no live
 *     pointer into a metadata bucket, no pointer from the future);
 *   - I2: every cached extent equals the backing store;
 *   - I3: every block whose insert was acknowledged before the last
 *     completed flush, and not touched since, is still cached.
 *
 * The backing store (tests/unit/mem-backing) is durable: only the cache
 * device crashes, as when nbdkit's host loses power and the NAS does not
 * (one writeback workload crashes the export too).
 * Workloads: writethrough inserts with splits and invalidations; cache-miss
 * fills with checkpoints; a small cache under eviction with GC and journal
 * wrap-around; and the request path's writethrough writes on dirty keys
 * (dirty keys in, durable first where the range held data a crash could
 * bring back, the backing write, marked clean), after which every block
 * must read, through the request layer, a value written since the last
 * flush (in flight or done), the recovery writeback must make the cache
 * and the backing store agree without changing any block's value, and
 * every clean extent must equal the backing store.  The same checks,
 * per sector, follow three workloads in writeback mode through the
 * request layer, with writeback passes, checkpoints, GC and moving GC
 * among the writes, trims and flushes ("writeback mode through the request layer"
 * below says what each adds).
 * TEST_CRASH_STRIDE (default 1; 4 for the writeback workloads, from an
 * index the seed picks: wb_crash_workload) tests every K-th index.
 * The seed is printed; TEST_SEED replays.
 *
 * Also here: a block whose bucket was reclaimed and reused is not
 * brought back by recovery (test_gen_reuse_crash); nor is a key dropped
 * from memory as stale before its bucket's new gen was persisted
 * (test_stale_drop_crash); a durable invalidation waits for a whiteout
 * of its range still on its way to the journal (test_pending_whiteout_
 * crash); an invalidation is journalled exactly where recovery could
 * bring back what it removes — not for a key only memory has, even after
 * its leaf split, but for one a checkpoint wrote or has captured, or the
 * journal holds (test_invalidate_journal_choice, test_invalidate_
 * captured_crash); a fill survives a crash once the journal timer's
 * checkpoint ran (test_fill_survives_crash); recovery tolerates a
 * torn newest journal entry but says so (a warning, an fsck note), warns
 * about a corrupt entry it does not need that has valid entries on both
 * sides (an fsck problem: test_journal_corrupt_middle), and refuses a gap
 * in the middle of the journal; a crash inside a writeback pass, between
 * the export write and its flush, between the flush and the clean mark,
 * or after a checkpoint wrote the clean marks, with the export losing its
 * unflushed writes or not, brings no time travel either way (test_
 * writeback_order_crash: fails with the writeback's export flush
 * skipped); and a writethrough write over data that a crash brings
 * back dirty survives the crash, FUA or not (test_fua_over_dirty_crash,
 * test_write_over_dirty_crash).
 */
#include "config.h"

#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/request.h"
#include "engine.h"
#include "mem-backing.h"
#include "testlib.h"

#define BLOCK 4096u
#define BACKING (4u << 20)
#define NBLOCKS (BACKING / BLOCK)

static unsigned seed;
static char tmpdir[256];
/* The caches opened by run_init have the write-intent regions off, and
 * use synchronous I/O. */
static bool runs_without_intent, runs_sync_io;
/* Open without bcf_cache_set_export: no export barrier (a test shows
 * what it is for). */
static bool runs_without_export_barrier;


static void
log_cb (void *opaque, enum bcf_log_level level, const char *msg)
{
  if (getenv ("TEST_VERBOSE") || (level >= BCF_LOG_ERROR &&
                                  getenv ("TEST_VERBOSE_ERRORS")))
    fprintf (stderr, "engine: %s\n", msg);
}

#define MAX_VALUES 48

/* What the test knows about the cache. */
struct model {
  uint8_t *shadow;              /* the backing store's contents */
  bool cached[NBLOCKS];         /* cached now, if no crash */
  bool flushed[NBLOCKS];        /* cached as of the last completed flush */
  bool touched[NBLOCKS];        /* changed since the last completed flush */
  /* The shadow's blocks written since the last flush (shadow_set): the
   * flush rehashes only these (hashing all 4 MiB at every flush was most
   * of this test's time). */
  bool rewritten[NBLOCKS];
  /* Dirty-key writes (W_DIRTY): the values (hashes) a block may read
   * after a crash: the one at the last completed flush and every one
   * written since (done or in flight). */
  uint64_t values[NBLOCKS][MAX_VALUES];
  unsigned nvalues[NBLOCKS];
  /* The dirty-key write under way (W_DIRTY), if the crash stops one:
   * its blocks and their new values.  Its keys can be durable although
   * the wait for them failed (the journal write landed, the flush that
   * would have confirmed it did not), and then recovery writes them
   * back: the data of a write that was never acknowledged, which may
   * land. */
  uint64_t pending_blk, pending_nb;
  uint64_t pending[64];
};

struct run {
  char path[320];
  struct mem_backing *mb;
  struct bcf_backing b;
  struct bcf_cache_opts opts;
  struct bcf_cache *c;
  struct model m;
  uint8_t buf[64 * BLOCK];
};

static void
run_open (struct run *r, enum bcf_format_policy policy, bool must)
{
  char err[512] = "";
  int e;

  r->opts.format = policy;
  e = bcf_cache_open (&r->opts, &r->c, err, sizeof err);
  if (must)
    ck_assert_msg (e == 0, "seed %u: open: %s (%s)", seed, err, strerror (-e));
  if (e == 0 && !runs_without_export_barrier)
    bcf_cache_set_export (r->c, &r->b);         /* as the filter does */
}

/* Cut the power (bcf_cache_test_crash in mode, seeded by crash_seed) and
 * open the cache again, as the next start would. */
static void
run_crash_reopen (struct run *r, uint64_t crash_seed, int mode)
{
  bcf_cache_test_crash (r->c, crash_seed, mode);
  r->c = NULL;
  run_open (r, BCF_FORMAT_NEVER, true);
}

static void
run_init_policy (struct run *r, const char *name, uint64_t cache_bytes,
                 unsigned bucket_sectors, unsigned replacement)
{
  memset (r, 0, sizeof *r);
  r->opts.replacement = replacement;
  snprintf (r->path, sizeof r->path, "%s/%s", tmpdir, name);
  unlink (r->path);
  r->mb = mem_backing_new (BACKING);
  r->b = mem_backing_get (r->mb);
  r->m.shadow = calloc (1, BACKING);
  r->opts.path = r->path;
  r->opts.create_size = cache_bytes;
  r->opts.bucket_sectors = bucket_sectors;
  r->opts.block_sectors = BLOCK / 512;
  r->opts.backing = r->b;
  memcpy (r->opts.backing_uuid, "crash-test-uuid!", 16);
  r->opts.direct_off = true;   /* the crash model works on the file */
  r->opts.write_intent_off = runs_without_intent;
  r->opts.io_mode = runs_sync_io ? BCF_IO_SYNC : BCF_IO_AUTO;
  r->opts.log = log_cb;
  run_open (r, BCF_FORMAT_AUTO, true);
}

static void
run_init (struct run *r, const char *name, uint64_t cache_bytes,
          unsigned bucket_sectors)
{
  run_init_policy (r, name, cache_bytes, bucket_sectors, BCH_REPLACEMENT_LRU);
}

static void
run_free (struct run *r)
{
  if (r->c)
    bcf_cache_close (r->c);
  mem_backing_free (r->mb);
  free (r->m.shadow);
  unlink (r->path);
}

static void
fill (uint8_t *buf, size_t len)
{
  for (size_t i = 0; i < len; i += 8) {
    uint64_t x = rnd ();
    memcpy (buf + i, &x, len - i < 8 ? len - i : 8);
  }
}

static void
mark (struct run *r, uint64_t blk, uint64_t nb, bool cached)
{
  for (uint64_t i = 0; i < nb; i++) {
    r->m.cached[blk + i] = cached;
    r->m.touched[blk + i] = true;
  }
}

/* Blocks [blk, blk + nb) of the backing store now hold buf. */
static void
shadow_set (struct run *r, uint64_t blk, uint64_t nb, const uint8_t *buf)
{
  memcpy (r->m.shadow + blk * BLOCK, buf, nb * BLOCK);
  memset (r->m.rewritten + blk, true, nb);
}

/* New random data for blocks [blk, blk + nb): written to the backing
 * store and the shadow, and left in r->buf. */
static void
backing_write_random (struct run *r, uint64_t blk, uint64_t nb)
{
  int rc;

  fill (r->buf, nb * BLOCK);
  rc = r->b.ops->pwrite (r->b.opaque, r->buf, (uint32_t) (nb * BLOCK),
                         blk * BLOCK, false);
  check_msg (rc == 0, "backing store write at block %" PRIu64 ": %d", blk,
             rc);
  shadow_set (r, blk, nb, r->buf);
}

/* Every hit (clean_only: every clean hit; dirty data is newer than the
 * backing store), anywhere, reads the backing store's bytes (I2). */
static void
hits_equal_backing (struct run *r, bool clean_only, const char *what)
{
  for (uint64_t blk = 0; blk < NBLOCKS; blk += 64) {
    struct bcf_extent es[80];
    unsigned n;
    int rc = bcf_lookup (r->c, blk * BLOCK, 64 * BLOCK, es, 80, &n);

    check_msg (rc == 0, "%s: bcf_lookup at block %" PRIu64 ": %d", what, blk,
               rc);
    for (unsigned i = 0; i < n; i++)
      if (es[i].kind == BCF_EXTENT_HIT && !(clean_only && es[i].dirty)) {
        rc = bcf_read_hit (r->c, &es[i], r->buf);
        check_msg (rc == 0, "%s: bcf_read_hit at %" PRIu64 ": %d", what,
                   es[i].offset, rc);
        check_msg (memcmp (r->buf, r->m.shadow + es[i].offset, es[i].len)
                   == 0, "%s: %s blocks at %" PRIu64 " differ from "
                   "the backing store", what,
                   es[i].dirty ? "dirty" : "clean cached", es[i].offset);
      }
  }
}

/* The format and its arguments name the case in the failure message. */
static void check_hits_equal_backing (struct run *r, const char *fmt, ...)
  __attribute__ ((format (printf, 2, 3)));
static void
check_hits_equal_backing (struct run *r, const char *fmt, ...)
{
  char what[256];
  va_list ap;

  va_start (ap, fmt);
  vsnprintf (what, sizeof what, fmt, ap);
  va_end (ap);
  hits_equal_backing (r, false, what);
}

static void check_clean_hits_equal_backing (struct run *r, const char *fmt,
                                            ...)
  __attribute__ ((format (printf, 2, 3)));
static void
check_clean_hits_equal_backing (struct run *r, const char *fmt, ...)
{
  char what[256];
  va_list ap;

  va_start (ap, fmt);
  vsnprintf (what, sizeof what, fmt, ap);
  va_end (ap);
  hits_equal_backing (r, true, what);
}

/* ---- workload steps; each returns false once the "machine" died ---------- */

/* A writethrough write, in DESIGN.md's order: invalidate durably (where
 * anything is cached), write the backing store, then insert the clean key.
 * A crash between the backing write and the insert leaves the range
 * uncached, never cached with the old data. */
static bool
step_insert (struct run *r, uint64_t blk, uint64_t nb)
{
  mark (r, blk, nb, false);
  if (bcf_invalidate (r->c, blk * BLOCK, nb * BLOCK, true) != 0)
    return false;
  backing_write_random (r, blk, nb);
  if (bcf_insert (r->c, blk * BLOCK, nb * BLOCK, r->buf, false, false) != 0)
    return false;
  mark (r, blk, nb, true);
  return true;
}

static bool
step_bypass (struct run *r, uint64_t blk, uint64_t nb)
{
  mark (r, blk, nb, false);
  if (bcf_invalidate (r->c, blk * BLOCK, nb * BLOCK, true) != 0)
    return false;
  backing_write_random (r, blk, nb);
  return true;
}

static bool
step_read_fill (struct run *r, uint64_t blk, uint64_t nb)
{
  struct bcf_extent e[64];
  unsigned n;

  if (bcf_lookup (r->c, blk * BLOCK, nb * BLOCK, e, 64, &n) != 0)
    return false;
  for (unsigned i = 0; i < n; i++) {
    struct bcf_miss miss;
    int x;

    if (e[i].kind == BCF_EXTENT_HIT)
      continue;
    if (bcf_miss_begin (r->c, e[i].offset, e[i].len, &miss) != 0)
      return false;
    memcpy (r->buf, r->m.shadow + e[i].offset, e[i].len);
    x = bcf_miss_fill (r->c, &miss, r->buf);
    if (x != 0 && x != -EEXIST)
      return false;
    /* A fill is not journalled: it need not survive a crash. */
  }
  return true;
}

/* FNV-1a over one block. */
static uint64_t
block_hash (const uint8_t *p)
{
  uint64_t h = 0xcbf29ce484222325ull;

  for (unsigned i = 0; i < BLOCK; i++)
    h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/* The values of blocks [blk, blk + nb) in buf may be read from now on. */
static void
allow_values (struct run *r, uint64_t blk, uint64_t nb, const uint8_t *buf)
{
  for (uint64_t i = 0; i < nb; i++) {
    unsigned *n = &r->m.nvalues[blk + i];
    check_msg (*n < MAX_VALUES, "block %" PRIu64 ": more than %d values "
               "since the last flush", blk + i, MAX_VALUES);
    r->m.values[blk + i][(*n)++] = block_hash (buf + i * BLOCK);
  }
}

static bool
value_allowed (const struct run *r, uint64_t blk, uint64_t h)
{
  for (unsigned i = 0; i < r->m.nvalues[blk]; i++)
    if (r->m.values[blk][i] == h)
      return true;
  return false;
}

/* A writethrough write of the request path (core/request.c W2-W4), in
 * one thread: the data as dirty keys, durable first where it must be,
 * the backing write, marked clean.  No room: invalidated and written
 * through. */
static bool
step_dirty_write (struct run *r, uint64_t blk, uint64_t nb)
{
  struct bcf_write w;
  int e;

  fill (r->buf, nb * BLOCK);
  allow_values (r, blk, nb, r->buf);
  mark (r, blk, nb, false);
  r->m.pending_blk = blk;
  r->m.pending_nb = nb;
  for (uint64_t i = 0; i < nb; i++)
    r->m.pending[i] = block_hash (r->buf + i * BLOCK);
  e = bcf_write_begin_through (r->c, blk * BLOCK, nb * BLOCK, r->buf, &w);
  if (e == -ENOSPC) {
    if (bcf_invalidate (r->c, blk * BLOCK, nb * BLOCK, true) != 0)
      return false;
    ck_assert_int_eq (r->b.ops->pwrite (r->b.opaque, r->buf,
                                        (uint32_t) (nb * BLOCK), blk * BLOCK,
                                        false), 0);
    shadow_set (r, blk, nb, r->buf);
    r->m.pending_nb = 0;
    return true;
  }
  if (e != 0)
    return false;
  if (bcf_write_durable (r->c, &w) != 0) {
    bcf_write_release (r->c, &w);
    return false;
  }
  ck_assert_int_eq (r->b.ops->pwrite (r->b.opaque, r->buf,
                                      (uint32_t) (nb * BLOCK), blk * BLOCK,
                                      false), 0);
  shadow_set (r, blk, nb, r->buf);
  r->m.pending_nb = 0;
  e = bcf_write_mark_clean (r->c, &w) == (int64_t) (nb * BLOCK) ? 0 : -1;
  bcf_write_release (r->c, &w);
  if (e == 0)
    mark (r, blk, nb, true);
  return true;
}

/* A write that bypasses the cache, for W_DIRTY (allowed values too). */
static bool
step_dirty_bypass (struct run *r, uint64_t blk, uint64_t nb)
{
  if (!step_bypass (r, blk, nb))
    return false;
  allow_values (r, blk, nb, r->buf);
  return true;
}

static bool
step_flush (struct run *r)
{
  if (bcf_flush (r->c) != 0)
    return false;
  memcpy (r->m.flushed, r->m.cached, sizeof r->m.flushed);
  memset (r->m.touched, 0, sizeof r->m.touched);
  /* The backing store is durable: what it holds is what was flushed
   * (a block not rewritten since the last flush keeps its one value). */
  for (uint64_t x = 0; x < NBLOCKS; x++)
    if (r->m.rewritten[x] || r->m.nvalues[x] != 1) {
      r->m.values[x][0] = block_hash (r->m.shadow + x * BLOCK);
      r->m.nvalues[x] = 1;
    }
  memset (r->m.rewritten, 0, sizeof r->m.rewritten);
  return true;
}

enum workload { W_INSERTS, W_FILLS, W_EVICTION, W_DIRTY, W_DIRTY_NOINTENT,
                W_COUNT };
static const char *const wname[] = { "inserts+splits", "fills+checkpoints",
                                     "eviction+gc+journal-wrap",
                                     "dirty-key writethrough",
                                     "dirty-key writethrough, no write-intent "
                                     "regions" };

static bool
dirty_workload (enum workload w)
{
  return w == W_DIRTY || w == W_DIRTY_NOINTENT;
}

static void
workload (struct run *r, enum workload w, unsigned wseed)
{
  const unsigned ops = w == W_EVICTION ? 400 : dirty_workload (w) ? 150 : 250;

  rng_state = wseed * 0x9E3779B97F4A7C15ull + 11;
  for (uint64_t x = 0; x < NBLOCKS; x++) {
    /* Mostly a fresh, zeroed store: a block like block 0 has its hash. */
    r->m.values[x][0] = x && memcmp (r->m.shadow, r->m.shadow + x * BLOCK,
                                     BLOCK) == 0
                        ? r->m.values[0][0]
                        : block_hash (r->m.shadow + x * BLOCK);
    r->m.nvalues[x] = 1;
  }
  memset (r->m.rewritten, 0, sizeof r->m.rewritten);
  for (unsigned op = 0; op < ops; op++) {
    uint64_t blk = rnd_below (NBLOCKS), nb = 1 + rnd_below (8);
    uint64_t what = rnd_below (100);
    bool alive = true;

    if (blk + nb > NBLOCKS)
      nb = NBLOCKS - blk;
    switch (w) {
    case W_INSERTS:
      alive = what < 70 ? step_insert (r, blk, nb)
            : what < 85 ? step_bypass (r, blk, nb)
            : what < 95 ? step_read_fill (r, blk, nb)
            : step_flush (r);
      break;
    case W_FILLS:
      alive = what < 50 ? step_read_fill (r, blk, nb)
            : what < 70 ? step_insert (r, blk, nb)
            : what < 80 ? step_bypass (r, blk, nb)
            : what < 93 ? step_flush (r)
            : bcf_cache_checkpoint (r->c) == 0;
      break;
    case W_DIRTY:
    case W_DIRTY_NOINTENT:
      alive = what < 60 ? step_dirty_write (r, blk, nb)
            : what < 75 ? step_read_fill (r, blk, nb)
            : what < 85 ? step_dirty_bypass (r, blk, nb)
            : what < 93 ? step_flush (r)
            : what < 97 ? bcf_cache_checkpoint (r->c) == 0
            : bcf_gc_run (r->c) == 0;
      break;
    default:
      alive = what < 45 ? step_insert (r, blk, nb)
            : what < 75 ? step_read_fill (r, blk, nb)
            : what < 85 ? step_bypass (r, blk, nb)
            : what < 95 ? step_flush (r)
            : bcf_gc_run (r->c) == 0;
      break;
    }
    if (!alive)
      return;
  }
  step_flush (r);
}

/* ---- the checks after recovery ---------------------------------------------- */

static void
check_recovered (struct run *r, enum workload w, uint64_t n)
{
  char report[4096];
  int problems = bcf_cache_fsck (r->c, report, sizeof report);

  ck_assert_msg (problems == 0, "seed %u workload %s cut at write %" PRIu64
                 ": fsck found %d problems:\n%s", seed, wname[w], n,
                 problems, report);
  for (uint64_t blk = 0; blk < NBLOCKS; blk += 64) {
    struct bcf_extent e[80];
    unsigned ne;
    int rc = bcf_lookup (r->c, blk * BLOCK, 64 * BLOCK, e, 80, &ne);

    check_msg (rc == 0, "seed %u workload %s cut at write %" PRIu64
               ": bcf_lookup at block %" PRIu64 ": %d", seed, wname[w], n,
               blk, rc);
    for (unsigned i = 0; i < ne; i++) {
      uint64_t b0 = e[i].offset / BLOCK, b1 = (e[i].offset + e[i].len) / BLOCK;

      if (e[i].kind == BCF_EXTENT_HIT) {
        rc = bcf_read_hit (r->c, &e[i], r->buf);
        check_msg (rc == 0, "seed %u workload %s cut at write %" PRIu64
                   ": bcf_read_hit at block %" PRIu64 ": %d", seed,
                   wname[w], n, b0, rc);
        check_msg (memcmp (r->buf, r->m.shadow + e[i].offset, e[i].len)
                   == 0, "seed %u workload %s cut at write %" PRIu64
                   ": I2 violated: cached blocks %" PRIu64 "..%" PRIu64
                   " differ from the backing store", seed, wname[w], n,
                   b0, b1 - 1);
      }
      else if (w != W_EVICTION)
        for (uint64_t x = b0; x < b1; x++)
          check_msg (!(r->m.flushed[x] && !r->m.touched[x]),
                     "seed %u workload %s cut at write %" PRIu64
                     ": I3 violated: block %" PRIu64 " was inserted "
                     "and flushed but is no longer cached", seed,
                     wname[w], n, x);
    }
  }
}

/* After a crash in W_DIRTY: read everything through the request layer
 * (dirty hits are the newest data); each block must hold a value written
 * since the last flush.  Then the recovery writeback, after which the
 * same values must still be read, the backing store must hold them, no
 * dirty data may be left, and every clean extent must equal the backing
 * store. */
static void
check_recovered_dirty (struct run *r, enum workload w, uint64_t n)
{
  struct bcf_req_opts ro = { .mode = BCF_MODE_WRITETHROUGH };
  struct bcf_req_stats rs;
  uint8_t *first = malloc (BACKING), *again = malloc (BACKING);
  struct bcf_req *q;
  char report[4096];
  int problems = bcf_cache_fsck (r->c, report, sizeof report);

  ck_assert_msg (problems == 0, "seed %u workload %s cut at write %" PRIu64
                 ": fsck found %d problems:\n%s", seed, wname[w], n,
                 problems, report);
  q = bcf_req_new (r->c, &ro);
  ck_assert_ptr_nonnull (q);
  for (uint64_t off = 0; off < BACKING; off += 64 * BLOCK)
    ck_assert_int_eq (bcf_req_read (q, &r->b, first + off, 64 * BLOCK, off),
                      0);
  for (uint64_t x = 0; x < NBLOCKS; x++)
    check_msg (value_allowed (r, x, block_hash (first + x * BLOCK)),
               "seed %u workload %s cut at write %" PRIu64 ": block %"
               PRIu64 " reads a value older than the last flush (I2)",
               seed, wname[w], n, x);
  ck_assert_int_eq (bcf_req_writeback (q, &r->b), 0);
  bcf_req_get_stats (q, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  for (uint64_t off = 0; off < BACKING; off += 64 * BLOCK)
    ck_assert_int_eq (bcf_req_read (q, &r->b, again + off, 64 * BLOCK, off),
                      0);
  ck_assert_msg (memcmp (first, again, BACKING) == 0,
                 "seed %u workload %s cut at write %" PRIu64 ": a block "
                 "reads another value after the writeback", seed,
                 wname[w], n);
  mem_backing_peek (r->mb, again, BACKING, 0);
  ck_assert_msg (memcmp (first, again, BACKING) == 0,
                 "seed %u workload %s cut at write %" PRIu64 ": after the "
                 "writeback the backing store differs from what was read",
                 seed, wname[w], n);
  /* Every write of the workload wrote the backing store before the next
   * began, and the one the crash stopped had not, so the backing store
   * held the shadow, and recovery must not have written anything older
   * over it: only the shadow, or the stopped write's own data where its
   * keys became durable (struct model, pending). */
  for (uint64_t x = 0; x < NBLOCKS; x++)
    check_msg (memcmp (r->m.shadow + x * BLOCK, again + x * BLOCK, BLOCK)
               == 0 || (x >= r->m.pending_blk &&
                        x < r->m.pending_blk + r->m.pending_nb &&
                        block_hash (again + x * BLOCK) ==
                        r->m.pending[x - r->m.pending_blk]),
               "seed %u workload %s cut at write %" PRIu64 ": "
               "block %" PRIu64 ": the recovery wrote older data over "
               "the backing store", seed, wname[w], n, x);
  bcf_req_free (q);
  memcpy (r->m.shadow, again, BACKING);
  memset (r->m.rewritten, true, sizeof r->m.rewritten);
  check_hits_equal_backing (r, "seed %u workload %s cut at write %" PRIu64,
                            seed, wname[w], n);
  free (first);
  free (again);
}

/* Writes a workload makes to the cache device, without faults. */
static uint64_t
count_writes (enum workload w, uint64_t cache_bytes, unsigned bucket)
{
  struct run r;
  struct bcf_io_faults f = { 0 };
  struct bcf_io_stats st;

  run_init (&r, "count.img", cache_bytes, bucket);
  bcf_io_set_faults (bcf_cache_test_io (r.c), &f);
  workload (&r, w, seed);
  bcf_io_stats (bcf_cache_test_io (r.c), &st);
  bcf_io_set_faults (bcf_cache_test_io (r.c), NULL);
  run_free (&r);
  return st.writes;
}

static void
crash_workload (enum workload w)
{
  /* 8 KiB buckets: 8 KiB nodes of ~270 keys, so splits, relocations and
   * root growth happen within a few hundred operations.  The eviction
   * workload's cache holds a fraction of what it writes. */
  const uint64_t cache_bytes = w == W_EVICTION ? (3u << 20) : (16u << 20);
  const unsigned bucket = 16;
  uint64_t total, tested = 0;
  const char *s = getenv ("TEST_CRASH_STRIDE");
  uint64_t stride = s ? strtoull (s, NULL, 0) : 1;

  runs_without_intent = w == W_DIRTY_NOINTENT;
  total = count_writes (w, cache_bytes, bucket);
  if (stride == 0)
    stride = 1;
  for (uint64_t n = 1; n <= total; n += stride) {
    struct run r;
    struct bcf_io_faults f = { .power_cut_after_write = n };

    run_init (&r, "crash.img", cache_bytes, bucket);
    bcf_io_set_faults (bcf_cache_test_io (r.c), &f);
    workload (&r, w, seed);
    run_crash_reopen (&r, seed ^ n, BCF_IO_CRASH_RANDOM);
    if (dirty_workload (w))
      check_recovered_dirty (&r, w, n);
    else
      check_recovered (&r, w, n);
    run_free (&r);
    tested++;
  }
  runs_without_intent = false;
  printf ("test-crash: workload %s: %" PRIu64 " of %" PRIu64
          " write indices power-cut, recovered and checked\n", wname[w],
          tested, total);
  fflush (stdout);
}

START_TEST (test_crash_inserts) { crash_workload (W_INSERTS); }
END_TEST
START_TEST (test_crash_fills) { crash_workload (W_FILLS); }
END_TEST
START_TEST (test_crash_eviction) { crash_workload (W_EVICTION); }
END_TEST
START_TEST (test_crash_dirty) { crash_workload (W_DIRTY); }
END_TEST
START_TEST (test_crash_dirty_nointent) { crash_workload (W_DIRTY_NOINTENT); }
END_TEST

/* ---- writeback mode through the request layer ----------------------------- */

/* The writeback workloads drive the request layer (bcf_req_*) as the
 * filter does, mostly in writeback mode, with no background threads: the
 * writeback runs where the workload says (bcf_req_writeback), and fills
 * are drained after each read and each write (writethrough caches a
 * write over clean data as a fill), so that one seed makes the same
 * cache-device writes every time and write index N is the same write in
 * every run (a run that never reaches its power cut says so).
 *
 * The model is per 512-byte sector: what the cache reads now
 * (r->m.shadow), and for each sector the values it may read after a
 * crash: its value at the last flush, or at the last FUA request that
 * covered it whole, and every value written to it since (acknowledged or
 * in flight).  Unaligned requests are byte-granular where the export is
 * durable: a patch of a sector then lands on the sector's current value
 * (the request path widens writes over dirty data to whole blocks, and
 * a write that bypasses the cache lands on an export that has the
 * current value).  Where the export crashes too they are sector-granular:
 * mem_backing reverts an unflushed write except for the bytes a kept newer
 * write covers, so a sector could mix two writes, which a disk (atomic
 * per sector) cannot.
 *
 * Three workloads, each power-cut at every write index:
 *  - WB_SWITCH: the default configuration (write-intent regions on), and
 *    now and then a switch to writethrough or writearound and back, so
 *    that writes (FUA ones too) land on dirty data in the clean modes;
 *  - WB_NOINTENT: the same without write-intent regions: clean keys then
 *    survive the crash (a marked region's are dropped), and every one
 *    must equal the export;
 *  - WB_BACKING: the export loses its unflushed writes at the same crash
 *    (mem_backing_crash), write-intent regions off so that clean keys
 *    survive and are compared with what the export kept.  The writeback
 *    flushes the export before it marks keys clean (core/writeback.c B4),
 *    and a checkpoint flushes it before it writes the clean keys of
 *    fills and writethrough writes (the export barrier, cache.c), so no
 *    acknowledged write may be lost either way, and no clean key may
 *    outlive its data on the export.
 *
 * TEST_CRASH_ONLY=N runs write index N alone, TEST_CRASH_TRACE=N prints
 * the operations of the run cut at N (0: the run that counts the
 * writes), and TEST_VERBOSE what the counting run did.
 */
#define SECTOR 512u
#define NSECT (BACKING / SECTOR)
#define WB_MAXV 24              /* values per sector between flushes */
#define WB_OPS 400              /* at most; WB_MAX_WRITES ends it first */
#define WB_MAX_WRITES 700       /* cache-device writes: the crash points */
#define WB_CACHE_BYTES (1536u << 10)    /* for a 4 MiB export: dirty data
                                           can fill it */

enum wb_workload { WB_SWITCH, WB_NOINTENT, WB_BACKING, WB_COUNT };
static const char *const wbname[] = {
  "writeback with mode switches",
  "writeback with mode switches, no write-intent regions",
  "writeback, the export crashes too",
};

enum wb_op { OP_WRITE, OP_WRITE_DIRTY, OP_TRIM, OP_ZERO, OP_READ, OP_FLUSH,
             OP_WRITEBACK, OP_CHECKPOINT, OP_GC, OP_MOVE, OP_STREAM,
             OP_SWITCH, OP_COUNT };
static const char *const opname[] = {
  "write", "write over dirty data", "trim", "zero", "read", "flush",
  "writeback", "checkpoint", "gc", "moving gc", "stream", "mode switch",
};

struct wb {
  enum wb_workload w;
  struct run *r;
  struct bcf_req *q;            /* the workload's requests */
  unsigned granule;             /* of unaligned requests: 1 or SECTOR */
  uint64_t cut, writes0;        /* the power goes after write cut from
                                   writes0 (0: never) */
  unsigned op;                  /* the operation running (messages) */
  bool trace;                   /* print the operations (TEST_CRASH_TRACE) */
  unsigned nops[OP_COUNT], nfua, nunaligned;
  uint64_t cur[NSECT];          /* hash of each sector's value now */
  uint64_t vals[NSECT][WB_MAXV];        /* may be read after a crash */
  uint8_t nvals[NSECT];
  bool dirty[NBLOCKS];          /* written since the last writeback */
};

static void wb_trace (struct wb *wb, const char *fmt, ...)
  __attribute__ ((format (printf, 2, 3)));
static void
wb_trace (struct wb *wb, const char *fmt, ...)
{
  va_list ap;

  if (!wb->trace)
    return;
  va_start (ap, fmt);
  fputs ("test-crash: ", stderr);
  vfprintf (stderr, fmt, ap);
  fputc ('\n', stderr);
  va_end (ap);
}

static uint64_t
sector_hash (const uint8_t *p)
{
  uint64_t h = 0x9E3779B97F4A7C15ull;

  for (unsigned i = 0; i < SECTOR; i += 8) {
    uint64_t x;
    memcpy (&x, p + i, 8);
    h = (h ^ x) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  return h;
}

static bool
wb_value_allowed (const struct wb *wb, uint64_t s, uint64_t h)
{
  for (unsigned i = 0; i < wb->nvals[s]; i++)
    if (wb->vals[s][i] == h)
      return true;
  return false;
}

/* Bytes [off, off + len) of the shadow changed: their sectors may read
 * the new values from now on.  (Not ck_assert: a passing one costs a
 * write to Check's log, and this runs for every sector written.) */
static void
wb_changed (struct wb *wb, uint64_t off, uint64_t len)
{
  for (uint64_t s = off / SECTOR; s < (off + len + SECTOR - 1) / SECTOR;
       s++) {
    uint64_t h = sector_hash (wb->r->m.shadow + s * SECTOR);

    wb->cur[s] = h;
    if (!wb_value_allowed (wb, s, h)) {
      if (wb->nvals[s] >= WB_MAXV)      /* wb_room sees to it */
        ck_abort_msg ("seed %u: sector %" PRIu64 ": too many values", seed,
                      s);
      wb->vals[s][wb->nvals[s]++] = h;
    }
  }
}

/* A flush (or a FUA request) made the sectors wholly inside [off, off +
 * len) durable: only their values now may be read after a crash. */
static void
wb_settle (struct wb *wb, uint64_t off, uint64_t len)
{
  for (uint64_t s = (off + SECTOR - 1) / SECTOR; s < (off + len) / SECTOR;
       s++) {
    wb->vals[s][0] = wb->cur[s];
    wb->nvals[s] = 1;
  }
}

/* Room for one more value in every sector of [off, off + len)? */
static bool
wb_room (const struct wb *wb, uint64_t off, uint64_t len)
{
  for (uint64_t s = off / SECTOR; s < (off + len + SECTOR - 1) / SECTOR;
       s++)
    if (wb->nvals[s] >= WB_MAXV)
      return false;
  return true;
}

/* Cache-device writes since the workload began. */
static uint64_t
wb_writes (struct wb *wb)
{
  struct bcf_io_stats st;

  bcf_io_stats (bcf_cache_test_io (wb->r->c), &st);
  return st.writes - wb->writes0;
}

/* Has the power gone (write cut done)? */
static bool
wb_dead (struct wb *wb)
{
  return wb->cut && wb_writes (wb) >= wb->cut;
}

/* Did a step succeed?  Before the power cut nothing may fail; after it
 * the workload stops (the machine died). */
static bool
wb_ok (struct wb *wb, int rc, const char *what)
{
  if (rc == 0)
    return true;
  ck_assert_msg (wb_dead (wb), "seed %u workload %s op %u: %s failed "
                 "before the power cut: %s", seed, wbname[wb->w], wb->op,
                 what, strerror (-rc));
  return false;
}

static bool
wb_flush (struct wb *wb)
{
  if (!wb_ok (wb, bcf_req_flush (wb->q, &wb->r->b), "flush"))
    return false;
  wb_settle (wb, 0, BACKING);
  return true;
}

static bool
wb_write (struct wb *wb, uint64_t off, uint64_t len, bool fua)
{
  struct run *r = wb->r;
  int rc;

  if (!wb_room (wb, off, len) && !wb_flush (wb))
    return false;
  fill (r->buf, len);
  memcpy (r->m.shadow + off, r->buf, len);
  wb_changed (wb, off, len);
  for (uint64_t b = off / BLOCK; b < (off + len + BLOCK - 1) / BLOCK; b++)
    wb->dirty[b] = true;
  wb->nfua += fua;
  wb->nunaligned += off % BLOCK || len % BLOCK;
  wb_trace (wb, "%s write [%" PRIu64 ", +%" PRIu64 ") (blocks %" PRIu64
            "..%" PRIu64 ")%s", bcf_cache_mode_name (bcf_req_mode (wb->q)),
            off, len, off / BLOCK, (off + len - 1) / BLOCK,
            fua ? " FUA" : "");
  rc = bcf_req_write (wb->q, &r->b, r->buf, (uint32_t) len, off, fua);
  bcf_req_drain (wb->q);        /* the fills: the same writes every run */
  if (!wb_ok (wb, rc, fua ? "FUA write" : "write"))
    return false;
  if (fua)
    wb_settle (wb, off, len);
  return true;
}

static bool
wb_discard (struct wb *wb, uint64_t off, uint64_t len, bool zero, bool fua)
{
  struct run *r = wb->r;
  bool may_trim = rnd_below (2);
  int rc;

  if (!wb_room (wb, off, len) && !wb_flush (wb))
    return false;
  /* mem_backing's trim zeroes, as nbdkit's memory plugin does. */
  memset (r->m.shadow + off, 0, len);
  wb_changed (wb, off, len);
  wb->nfua += fua;
  wb->nunaligned += off % BLOCK || len % BLOCK;
  wb_trace (wb, "%s [%" PRIu64 ", +%" PRIu64 ") (blocks %" PRIu64 "..%"
            PRIu64 ")%s", zero ? "zero" : "trim", off, len, off / BLOCK,
            (off + len - 1) / BLOCK, fua ? " FUA" : "");
  rc = zero ? bcf_req_zero (wb->q, &r->b, (uint32_t) len, off, may_trim, fua)
       : bcf_req_trim (wb->q, &r->b, (uint32_t) len, off, fua);
  if (!wb_ok (wb, rc, zero ? "zero" : "trim"))
    return false;
  if (fua)
    wb_settle (wb, off, len);
  return true;
}

/* A read returns the last write (one thread: nothing is in flight). */
static bool
wb_read (struct wb *wb, uint64_t off, uint64_t len)
{
  struct run *r = wb->r;
  int rc = bcf_req_read (wb->q, &r->b, r->buf, (uint32_t) len, off);

  bcf_req_drain (wb->q);        /* the fills: the same writes every run */
  if (!wb_ok (wb, rc, "read"))
    return false;
  ck_assert_msg (memcmp (r->buf, r->m.shadow + off, len) == 0,
                 "seed %u workload %s op %u: a read of [%" PRIu64 ", +%"
                 PRIu64 ") does not return the last write (I1)", seed,
                 wbname[wb->w], wb->op, off, len);
  return true;
}

/* A writeback pass; a third of them followed at once by a checkpoint,
 * which puts the clean marks on disk before anything else flushes the
 * export (what B4 is for). */
static bool
wb_writeback (struct wb *wb)
{
  if (!wb_ok (wb, bcf_req_writeback (wb->q, &wb->r->b), "writeback"))
    return false;
  memset (wb->dirty, 0, sizeof wb->dirty);
  return rnd_below (3) != 0 || wb_dead (wb) ||
         wb_ok (wb, bcf_cache_checkpoint (wb->r->c), "checkpoint");
}

/* Out of writeback mode into writethrough or writearound, or back. */
static bool
wb_switch (struct wb *wb)
{
  enum bcf_cache_mode m = bcf_req_mode (wb->q) != BCF_MODE_WRITEBACK
                          ? BCF_MODE_WRITEBACK : rnd_below (2)
                          ? BCF_MODE_WRITETHROUGH : BCF_MODE_WRITEAROUND;

  wb_trace (wb, "mode %s", bcf_cache_mode_name (m));
  ck_assert_int_eq (bcf_req_set_mode (wb->q, m), 0);
  return true;
}

/* A range for a request: blocks, at a dirty block if over_dirty (the
 * next one from a random place), unaligned to the granule if asked. */
static void
wb_pick (struct wb *wb, bool over_dirty, bool unaligned, uint64_t *off,
         uint64_t *len)
{
  uint64_t blk = rnd_below (NBLOCKS), nb = 1 + rnd_below (8);
  const uint64_t g = wb->granule;

  if (over_dirty)
    for (uint64_t i = 0; i < NBLOCKS; i++)
      if (wb->dirty[(blk + i) % NBLOCKS]) {
        blk = (blk + i) % NBLOCKS;
        break;
      }
  if (blk + nb > NBLOCKS)
    nb = NBLOCKS - blk;
  *off = blk * BLOCK;
  *len = nb * BLOCK;
  if (unaligned) {
    *off += rnd_below (BLOCK / g) * g;
    *len = (1 + rnd_below (nb * BLOCK / g)) * g;
    if (*off + *len > BACKING)
      *len = BACKING - *off;
  }
}

/* One operation, chosen at random. */
static bool
wb_step (struct wb *wb)
{
  struct run *r = wb->r;
  uint64_t what = rnd_below (100), off, len;
  bool unaligned = rnd_below (100) < 35, fua = rnd_below (100) < 12;
  bool alive = true;
  struct bcf_cache_stats cs;
  enum wb_op op;

  /* Where most buckets are marked dirty, write back, run GC (which
   * updates the marks) and move dirty data more often, as the writeback
   * thread's rate controller and moving GC and the GC thread that the
   * allocator wakes would: a cache full of dirty data is reached now and
   * then, not in every run (there a write first reclaims what few
   * buckets it can, one prio write each, and then goes through: one such
   * write makes hundreds of crash points). */
  bcf_cache_stats (r->c, &cs);
  if (cs.buckets_dirty * 100 > cs.nbuckets * 70 && rnd_below (3) != 0)
    what = (const uint64_t[]) { 72, 85, 87 }[rnd_below (3)];

  if (what < 27) {
    op = OP_WRITE;
    wb_pick (wb, false, unaligned, &off, &len);
    alive = wb_write (wb, off, len, fua);
  }
  else if (what < 44) {
    op = OP_WRITE_DIRTY;
    wb_pick (wb, true, unaligned, &off, &len);
    alive = wb_write (wb, off, len, fua);
  }
  else if (what < 53) {
    op = what < 49 ? OP_TRIM : OP_ZERO;
    wb_pick (wb, rnd_below (100) < 70, unaligned, &off, &len);
    alive = wb_discard (wb, off, len, op == OP_ZERO, fua);
  }
  else if (what < 63) {
    op = OP_READ;
    wb_pick (wb, false, unaligned, &off, &len);
    alive = wb_read (wb, off, len);
  }
  else if (what < 71) {
    op = OP_FLUSH;
    alive = wb_flush (wb);
  }
  else if (what < 76) {
    op = OP_WRITEBACK;
    alive = wb_writeback (wb);
  }
  else if (what < 84) {
    op = OP_CHECKPOINT;
    alive = wb_ok (wb, bcf_cache_checkpoint (r->c), "checkpoint");
  }
  else if (what < 86) {
    op = OP_GC;
    alive = wb_ok (wb, bcf_gc_run (r->c), "GC");
  }
  else if (what < 88) {
    /* Moving GC between two GC passes, as the writeback thread runs
     * it: the first counts the buckets it may fill, the second what it
     * emptied, which is reused from then on while the moved keys may
     * still be on their way to the journal. */
    op = OP_MOVE;
    alive = wb_ok (wb, bcf_gc_run (r->c), "GC") &&
            wb_ok (wb, bcf_move_dirty (r->c, WB_CACHE_BYTES, NULL),
                   "moving GC") && wb_ok (wb, bcf_gc_run (r->c), "GC");
  }
  else if (what < 97) {
    /* 4 x 64 KiB in a row: past the 128 KiB sequential cutoff the
     * stream bypasses the cache (over dirty data it does not: it is
     * cached instead). */
    op = OP_STREAM;
    off = rnd_below (NBLOCKS - 64) * BLOCK;
    for (unsigned i = 0; i < 4 && alive && !wb_dead (wb); i++)
      alive = wb_write (wb, off + i * 16 * BLOCK, 16 * BLOCK, false);
  }
  else {
    op = OP_SWITCH;
    alive = wb_switch (wb);
  }
  wb->nops[op]++;
  wb_trace (wb, "op %u (%s) done: %" PRIu64 " cache-device writes, %"
            PRIu64 " bytes dirty", wb->op, opname[op], wb_writes (wb),
            bcf_cache_dirty_bytes (r->c));
  return alive;
}

/* Writes (aligned or not, some FUA) anywhere and over dirty data, trims
 * and zeroes (mostly of dirty ranges), reads, flushes, writeback passes,
 * checkpoints, GC passes, moving GC (dirty data copied out of sparse
 * buckets, which GC then frees), short sequential streams that the
 * cutoff makes bypass the cache, and mode switches, on a cache small
 * enough that dirty data fills it (writes are then written through) and
 * GC and the journal wrap.  It ends after WB_OPS operations, or at the first that
 * brings the cache-device writes to WB_MAX_WRITES: that bounds the crash
 * points, whatever the seed.  Then a flush. */
static void
wb_workload (struct wb *wb, unsigned wseed)
{
  struct run *r = wb->r;

  rng_state = wseed * 0x9E3779B97F4A7C15ull + 29;
  for (uint64_t s = 0; s < NSECT; s++) {
    wb->cur[s] = wb->vals[s][0] = sector_hash (r->m.shadow + s * SECTOR);
    wb->nvals[s] = 1;
  }
  for (wb->op = 0; wb->op < WB_OPS; wb->op++)
    if (!wb_step (wb) || wb_dead (wb) || wb_writes (wb) >= WB_MAX_WRITES)
      break;
  if (!wb_dead (wb))
    wb_flush (wb);
  ck_assert_msg (!wb->cut || wb_dead (wb), "seed %u workload %s: write %"
                 PRIu64 " never came (%" PRIu64 " writes): the workload is "
                 "not deterministic", seed, wbname[wb->w], wb->cut,
                 wb_writes (wb));
}

/* After the crash: fsck; every sector reads (through the request layer)
 * a value the model allows; a full writeback leaves nothing dirty,
 * changes no value, and leaves the export equal to what the cache reads;
 * every clean extent equals the export. */
static void
wb_check (struct wb *wb, uint64_t n)
{
  struct run *r = wb->r;
  /* Mode none: reads serve hits, dirty or clean, and fill nothing, so
   * the check neither changes the cache it looks at nor pays for filling
   * a small cache with the whole export at every crash point. */
  struct bcf_req_opts ro = { .mode = BCF_MODE_NONE };
  struct bcf_req_stats rs;
  /* Static: fresh 4 MiB buffers at every crash point cost more in page
   * faults than the rest of the check. */
  static uint8_t first[BACKING], again[BACKING];
  struct bcf_req *q;
  char report[4096];
  int problems = bcf_cache_fsck (r->c, report, sizeof report);

  ck_assert_msg (problems == 0, "seed %u workload %s cut at write %" PRIu64
                 ": fsck found %d problems:\n%s", seed, wbname[wb->w], n,
                 problems, report);
  q = bcf_req_new (r->c, &ro);
  ck_assert_ptr_nonnull (q);
  for (uint64_t off = 0; off < BACKING; off += 64 * BLOCK)
    ck_assert_int_eq (bcf_req_read (q, &r->b, first + off, 64 * BLOCK, off),
                      0);
  mem_backing_peek (r->mb, again, BACKING, 0);
  for (uint64_t s = 0; s < NSECT; s++) {
    uint64_t h = sector_hash (first + s * SECTOR);

    if (!wb_value_allowed (wb, s, h))
      ck_abort_msg ("seed %u workload %s cut at write %" PRIu64 ": sector %"
                    PRIu64 " (block %" PRIu64 ") reads a value older than "
                    "its last flush, or one never written there (%s the "
                    "export's; %u values allowed)", seed, wbname[wb->w],
                    n, s, s * SECTOR / BLOCK,
                    memcmp (first + s * SECTOR, again + s * SECTOR, SECTOR)
                    == 0 ? "equal to" : "unlike", wb->nvals[s]);
  }
  ck_assert_int_eq (bcf_req_writeback (q, &r->b), 0);
  bcf_req_get_stats (q, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  for (uint64_t off = 0; off < BACKING; off += 64 * BLOCK)
    ck_assert_int_eq (bcf_req_read (q, &r->b, again + off, 64 * BLOCK, off),
                      0);
  ck_assert_msg (memcmp (first, again, BACKING) == 0,
                 "seed %u workload %s cut at write %" PRIu64 ": a block "
                 "reads another value after the writeback", seed,
                 wbname[wb->w], n);
  mem_backing_peek (r->mb, again, BACKING, 0);
  for (uint64_t s = 0; s < NSECT; s++)
    if (memcmp (first + s * SECTOR, again + s * SECTOR, SECTOR) != 0)
      ck_abort_msg ("seed %u workload %s cut at write %" PRIu64 ": after "
                    "the writeback the export differs from what the cache "
                    "reads, first at sector %" PRIu64 " (block %" PRIu64
                    "; the cache reads %s)", seed, wbname[wb->w], n, s,
                    s * SECTOR / BLOCK, wb->cur[s] == sector_hash (first +
                    s * SECTOR) ? "the last value written" : "an older "
                    "value");
  bcf_req_free (q);
  memcpy (r->m.shadow, again, BACKING);
  check_hits_equal_backing (r, "seed %u workload %s cut at write %" PRIu64,
                            seed, wbname[wb->w], n);
}

static void
wb_summary (struct wb *wb)
{
  struct bcf_cache_stats cs;
  struct bcf_req_stats rs;

  bcf_cache_stats (wb->r->c, &cs);
  bcf_req_get_stats (wb->q, &rs);
  printf ("test-crash: workload %s: %u operations:", wbname[wb->w], wb->op);
  for (int i = 0; i < OP_COUNT; i++)
    printf (" %s %u,", opname[i], wb->nops[i]);
  printf (" (%u FUA, %u unaligned); %" PRIu64 " cache-device writes, %"
          PRIu64 " checkpoints, %" PRIu64 " GC passes, %" PRIu64
          " journal writes, %" PRIu64 " writes written through for want "
          "of room, %" PRIu64 " bytes written back, %" PRIu64 " extents "
          "moved (%" PRIu64 " collisions)\n", wb->nfua,
          wb->nunaligned, wb_writes (wb), cs.checkpoint.count, cs.gc_passes,
          cs.journal_writes, rs.writeback_cutoff_writes,
          rs.writeback_bytes, cs.moving_gc_keys, cs.moving_gc_collisions);
}

/* One run of workload w: power cut after write cut (0: none), then the
 * crash (of the export too in WB_BACKING), recovery and the checks.
 * Returns the cache-device writes the workload made. */
static uint64_t
wb_one (enum wb_workload w, uint64_t cut)
{
  struct run r;
  struct wb *wb = calloc (1, sizeof *wb);
  struct bcf_req_opts ro = { .mode = BCF_MODE_WRITEBACK,
                             .sequential_cutoff = 32 * BLOCK };
  struct bcf_io_faults f = { .power_cut_after_write = cut };
  const char *trace = getenv ("TEST_CRASH_TRACE");
  uint64_t writes;

  ck_assert_ptr_nonnull (wb);
  /* Sync I/O: the crash model lies above both I/O paths, and io_uring
   * on a tmpfs file hands every write to a kernel worker thread, which
   * costs these workloads half their time. */
  runs_sync_io = true;
  runs_without_intent = w != WB_SWITCH;
  run_init (&r, "wb.img", WB_CACHE_BYTES, 16);
  runs_sync_io = runs_without_intent = false;
  wb->w = w;
  wb->r = &r;
  wb->granule = w == WB_BACKING ? SECTOR : 1;
  wb->q = bcf_req_new (r.c, &ro);
  ck_assert_ptr_nonnull (wb->q);
  bcf_io_set_faults (bcf_cache_test_io (r.c), &f);
  wb->cut = cut;
  wb->writes0 = 0;
  wb->writes0 = wb_writes (wb);         /* counted from here on */
  wb->trace = trace && strtoull (trace, NULL, 0) == cut;
  if (w == WB_BACKING)
    mem_backing_track_crash (r.mb, true);

  wb_workload (wb, seed);
  writes = wb_writes (wb);
  if (!cut && getenv ("TEST_VERBOSE"))
    wb_summary (wb);
  bcf_req_free (wb->q);
  if (cut) {
    if (w == WB_BACKING) {
      mem_backing_crash (r.mb, MEM_BACKING_RANDOM, seed ^ (cut << 20));
      mem_backing_track_crash (r.mb, false);
    }
    run_crash_reopen (&r, seed ^ cut, BCF_IO_CRASH_RANDOM);
    wb_check (wb, cut);
  }
  else
    bcf_io_set_faults (bcf_cache_test_io (r.c), NULL);
  free (wb);
  run_free (&r);
  return writes;
}

/* Unless TEST_CRASH_STRIDE says otherwise, the writeback workloads cut
 * the power at every WB_DEFAULT_STRIDE-th write index, starting at an
 * index the seed picks, so that successive runs cover different indices:
 * at every index the three took over six minutes of make check, which
 * would put the whole CI past its 20 minutes.  TEST_CRASH_STRIDE=1 tests
 * every index. */
#define WB_DEFAULT_STRIDE 4

static void
wb_crash_workload (enum wb_workload w)
{
  const char *s = getenv ("TEST_CRASH_STRIDE");
  const char *o = getenv ("TEST_CRASH_ONLY");
  uint64_t stride = s ? strtoull (s, NULL, 0) : WB_DEFAULT_STRIDE, total,
           tested = 0, first;
  uint64_t only = o ? strtoull (o, NULL, 0) : 0;

  if (stride == 0)
    stride = 1;
  first = 1 + (s ? 0 : seed % stride);
  total = wb_one (w, 0);
  if (only)
    total = only;
  for (uint64_t n = only ? only : first; n <= total; n += stride) {
    wb_one (w, n);
    tested++;
  }
  printf ("test-crash: workload %s: %" PRIu64 " of %" PRIu64
          " write indices power-cut, recovered and checked\n", wbname[w],
          tested, total);
  fflush (stdout);
}

START_TEST (test_crash_writeback) { wb_crash_workload (WB_SWITCH); }
END_TEST
START_TEST (test_crash_writeback_nointent) { wb_crash_workload (WB_NOINTENT); }
END_TEST
START_TEST (test_crash_writeback_export) { wb_crash_workload (WB_BACKING); }
END_TEST

/* ---- moving GC, then the old buckets reused --------------------------------- */

/* Dirty blocks 0..63 in 8 KiB buckets (two blocks each), then the odd
 * ones written again: each of the first buckets keeps one live dirty
 * block.  All flushed (and, in one variant, checkpointed, so the old
 * keys come back from the btree rather than the journal).  Then, with
 * the power cut after write n of this phase: moving GC copies the even
 * blocks out, a GC pass finds their old buckets clean, and clean inserts
 * go on until the allocator has reused half of those buckets (new gens
 * persisted, new data written over the old).  Whatever the crash keeps,
 * every block must read its last write (all of them were flushed before
 * the phase), and the writeback must put exactly that on the export: a
 * moved key lost while its old bucket's reuse survived would bring back
 * the old key, stale, and the block's dirty data with it (movinggc.c's
 * point 3).  Negative control: with the move inserted by replace_key
 * (not journalled, as fills are), this fails.  Every
 * MOVE_CRASH_STRIDE-th index from one the seed picks (TEST_CRASH_STRIDE
 * overrides, 1 for all). */
#define MOVE_CRASH_BLOCKS 64
#define MOVE_CRASH_STRIDE 1

/* The phase: returns the cache-device writes it made (all of them when
 * cut is 0). */
static uint64_t
move_crash_one (uint64_t cut, bool ckpt)
{
  struct run r;
  struct bcf_req_opts wo = { .mode = BCF_MODE_WRITEBACK };
  const struct bcf_req_opts ro = { .mode = BCF_MODE_NONE };
  struct bcf_io_faults f = { .power_cut_after_write = cut };
  struct bcf_io_stats st;
  static uint8_t want[MOVE_CRASH_BLOCKS * BLOCK], got[MOVE_CRASH_BLOCKS * BLOCK];
  uint64_t old[MOVE_CRASH_BLOCKS / 2], writes0;
  uint8_t gen0[MOVE_CRASH_BLOCKS / 2];
  unsigned reused = 0;
  struct bcf_req *q;
  int e = 0;

  runs_sync_io = true;
  run_init_policy (&r, "move.img", 1u << 20, 16, BCH_REPLACEMENT_FIFO);
  runs_sync_io = false;
  q = bcf_req_new (r.c, &wo);
  ck_assert_ptr_nonnull (q);
  bcf_req_set_sequential_cutoff (q, 0);
  rng_state = seed * 0x9E3779B97F4A7C15ull + 41;
  fill (want, sizeof want);
  for (unsigned b = 0; b < MOVE_CRASH_BLOCKS; b++)
    ck_assert_int_eq (bcf_req_write (q, &r.b, want + b * BLOCK, BLOCK,
                                     b * BLOCK, false), 0);
  fill (r.buf, MOVE_CRASH_BLOCKS / 2 * BLOCK);
  for (unsigned b = 1; b < MOVE_CRASH_BLOCKS; b += 2) {
    memcpy (want + b * BLOCK, r.buf + b / 2 * BLOCK, BLOCK);
    ck_assert_int_eq (bcf_req_write (q, &r.b, want + b * BLOCK, BLOCK,
                                     b * BLOCK, false), 0);
  }
  ck_assert_int_eq (bcf_req_flush (q, &r.b), 0);
  if (ckpt)
    ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
  ck_assert_int_eq (bcf_gc_run (r.c), 0);
  for (unsigned b = 0; b < MOVE_CRASH_BLOCKS; b += 2) {
    struct bcf_extent x;
    unsigned n;

    ck_assert_int_eq (bcf_lookup (r.c, b * BLOCK, BLOCK, &x, 1, &n), 0);
    ck_assert (x.kind == BCF_EXTENT_HIT && x.dirty);
    old[b / 2] = bucket_of_ptr (r.c, x.ptr);
    gen0[b / 2] = r.c->alloc.buckets[old[b / 2]].gen;
  }

  bcf_io_set_faults (bcf_cache_test_io (r.c), &f);
  bcf_io_stats (bcf_cache_test_io (r.c), &st);
  writes0 = st.writes;
  {
    struct bcf_move_stats ms;

    e = bcf_move_dirty (r.c, 1u << 20, &ms);
    if (e == 0 && !cut)
      ck_assert_uint_eq (ms.keys, MOVE_CRASH_BLOCKS / 2);
  }
  if (e == 0)
    e = bcf_gc_run (r.c);
  for (unsigned i = 0; e == 0 && i < 2000 && reused < MOVE_CRASH_BLOCKS / 4;
       i++) {
    uint64_t blk = MOVE_CRASH_BLOCKS + i % (NBLOCKS - MOVE_CRASH_BLOCKS) / 2 * 2;

    backing_write_random (&r, blk, 2);
    e = bcf_insert (r.c, blk * BLOCK, 2 * BLOCK, r.buf, false, false);
    reused = 0;
    for (unsigned k = 0; k < MOVE_CRASH_BLOCKS / 2; k++)
      reused += r.c->alloc.buckets[old[k]].gen != gen0[k];
  }
  if (e == 0)
    e = bcf_flush (r.c);
  bcf_io_stats (bcf_cache_test_io (r.c), &st);
  if (!cut) {
    ck_assert_int_eq (e, 0);
    ck_assert_uint_ge (reused, MOVE_CRASH_BLOCKS / 4);
    bcf_req_free (q);
    bcf_io_set_faults (bcf_cache_test_io (r.c), NULL);
    run_free (&r);
    return st.writes - writes0;
  }
  bcf_req_free (q);
  run_crash_reopen (&r, seed ^ (cut << 8) ^ ckpt, BCF_IO_CRASH_RANDOM);
  ck_assert_int_eq (bcf_cache_fsck (r.c, NULL, 0), 0);
  q = bcf_req_new (r.c, &ro);
  ck_assert_ptr_nonnull (q);
  ck_assert_int_eq (bcf_req_read (q, &r.b, got, sizeof got, 0), 0);
  for (unsigned b = 0; b < MOVE_CRASH_BLOCKS; b++)
    ck_assert_msg (memcmp (got + b * BLOCK, want + b * BLOCK, BLOCK) == 0,
                   "seed %u%s, power cut at write %" PRIu64 " of the move "
                   "and the reuse: block %u does not read its last write "
                   "(%s)", seed, ckpt ? " (old keys checkpointed)" : "", cut,
                   b, memcmp (got + b * BLOCK, r.m.shadow + b * BLOCK, BLOCK)
                   == 0 ? "it reads the export's older data" : "garbage");
  ck_assert_int_eq (bcf_req_writeback (q, &r.b), 0);
  mem_backing_peek (r.mb, got, sizeof got, 0);
  ck_assert_msg (memcmp (got, want, sizeof got) == 0, "seed %u, power cut at "
                 "write %" PRIu64 ": the writeback put other data on the "
                 "export", seed, cut);
  bcf_req_free (q);
  run_free (&r);
  return 0;
}

START_TEST (test_move_reuse_crash)
{
  const char *s = getenv ("TEST_CRASH_STRIDE");
  uint64_t stride = s ? strtoull (s, NULL, 0) : MOVE_CRASH_STRIDE;

  if (stride == 0)
    stride = 1;
  for (int ckpt = 0; ckpt < 2; ckpt++) {
    uint64_t total = move_crash_one (0, ckpt), tested = 0;

    for (uint64_t n = 1 + (s ? 0 : seed % stride); n <= total; n += stride) {
      move_crash_one (n, ckpt);
      tested++;
    }
    printf ("test-crash: moving GC then reuse%s: %" PRIu64 " of %" PRIu64
            " write indices power-cut, recovered and checked\n",
            ckpt ? " (old keys checkpointed)" : "", tested, total);
    fflush (stdout);
  }
}
END_TEST

/* ---- the export barrier ---------------------------------------------------- */

/* One case: a writethrough write (by_read: a writearound write and then
 * a read miss that fills it), a checkpoint, and a power cut of both the
 * cache and the export, which loses every write it did not flush.
 * Returns the blocks whose clean cached data differs from what the
 * export kept afterwards.  With the barrier the checkpoint flushed the
 * export first: none may.  Without it the clean key outlives its data
 * on the export (evicted later, the block would go back in time): this
 * proves that the case reaches the hole the barrier closes. */
static unsigned
barrier_case (bool barrier, bool by_read, bool client_flush)
{
  const struct bcf_req_opts wo = {
    .mode = by_read ? BCF_MODE_WRITEAROUND : BCF_MODE_WRITETHROUGH,
  };
  const struct bcf_req_opts ro = { .mode = BCF_MODE_NONE };
  static uint8_t cached[64 * BLOCK], kept[64 * BLOCK];
  struct bcf_cache_stats cs;
  struct bcf_req *q;
  struct run r;
  unsigned differ = 0;

  runs_without_intent = true;   /* marked regions would drop the keys */
  runs_without_export_barrier = !barrier;
  run_init (&r, "barrier.img", 4u << 20, 16);
  runs_without_intent = runs_without_export_barrier = false;
  mem_backing_track_crash (r.mb, true);
  q = bcf_req_new (r.c, &wo);
  ck_assert_ptr_nonnull (q);
  rng_state = seed * 0x9E3779B97F4A7C15ull + 31;
  fill (r.buf, sizeof r.buf);
  ck_assert_int_eq (bcf_req_write (q, &r.b, r.buf, sizeof r.buf, 0, false),
                    0);
  bcf_req_drain (q);            /* a write over nothing cached is a fill */
  if (client_flush)
    ck_assert_int_eq (bcf_req_flush (q, &r.b), 0);
  if (by_read) {
    ck_assert_int_eq (bcf_req_read (q, &r.b, cached, sizeof cached, 0), 0);
    bcf_req_drain (q);
  }
  ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
  bcf_cache_stats (r.c, &cs);
  /* A client's flush after the write counts: the barrier flushes no
   * more. */
  ck_assert_uint_eq (cs.export_flushes, barrier && !client_flush ? 1 : 0);
  bcf_req_free (q);
  mem_backing_crash (r.mb, MEM_BACKING_LOSE_ALL, 0);
  mem_backing_track_crash (r.mb, false);
  run_crash_reopen (&r, seed, BCF_IO_CRASH_LOSE_ALL);

  q = bcf_req_new (r.c, &ro);   /* serves hits, fills nothing */
  ck_assert_ptr_nonnull (q);
  ck_assert_int_eq (bcf_req_read (q, &r.b, cached, sizeof cached, 0), 0);
  mem_backing_peek (r.mb, kept, sizeof kept, 0);
  for (unsigned b = 0; b < 64; b++)
    differ += memcmp (cached + b * BLOCK, kept + b * BLOCK, BLOCK) != 0;
  bcf_req_free (q);
  run_free (&r);
  return differ;
}

START_TEST (test_export_barrier)
{
  ck_assert_uint_eq (barrier_case (true, false, false), 0);
  ck_assert_uint_eq (barrier_case (true, true, false), 0);
  ck_assert_uint_eq (barrier_case (true, false, true), 0);
  ck_assert_uint_eq (barrier_case (true, true, true), 0);
  /* The same without the barrier loses the writes on the export while
   * the cache keeps clean keys for them. */
  ck_assert_uint_eq (barrier_case (false, false, false), 64);
  ck_assert_uint_eq (barrier_case (false, true, false), 64);
}
END_TEST

/* ---- journal recovery edge cases ------------------------------------------- */

struct jpos { uint64_t off, seq; };

/* Find every valid journal entry in the file: (device offset, seq). */
static size_t
find_entries (const char *path, struct jpos *out, size_t max)
{
  FILE *f = fopen (path, "rb");
  uint8_t sbuf[BCH_SB_AREA_SIZE];
  struct bch_sb sb;
  size_t n = 0;
  uint8_t *bucket;
  uint64_t bbytes;

  ck_assert_ptr_nonnull (f);
  ck_assert_int_eq (fseek (f, BCH_SB_OFFSET, SEEK_SET), 0);
  ck_assert_uint_eq (fread (sbuf, 1, sizeof sbuf, f), sizeof sbuf);
  ck_assert_int_eq (bch_sb_decode (sbuf, sizeof sbuf, &sb, NULL), BCH_OK);
  bbytes = bch_sb_bucket_sectors (&sb) << 9;
  bucket = malloc (bbytes);
  for (unsigned i = 0; i < sb.njournal_buckets; i++) {
    ck_assert_int_eq (fseeko (f, (off_t) (sb.d[i] * bbytes), SEEK_SET), 0);
    ck_assert_uint_eq (fread (bucket, 1, bbytes, f), bbytes);
    for (uint64_t off = 0; off + BCH_JSET_HEADER_SIZE <= bbytes;
         off += sb.block_size * 512u) {
      struct bch_jset j;
      if (bch_jset_decode (bucket + off, bbytes - off, bch_jset_magic (&sb),
                           &j, NULL) == BCH_OK && n < max)
        out[n++] = (struct jpos) { sb.d[i] * bbytes + off, j.seq };
    }
  }
  free (bucket);
  fclose (f);
  return n;
}

static void
corrupt_byte (const char *path, uint64_t off)
{
  FILE *f = fopen (path, "r+b");
  int ch;

  ck_assert_ptr_nonnull (f);
  fseeko (f, (off_t) off, SEEK_SET);
  ch = fgetc (f);
  fseeko (f, (off_t) off, SEEK_SET);
  fputc (ch ^ 0x5a, f);
  fclose (f);
}

/* Leave a cache with several journal entries after its last checkpoint,
 * as an unclean shutdown does. */
static void
unclean_cache (struct run *r)
{
  run_init (r, "journal.img", 16u << 20, 16);
  rng_state = seed;
  for (int i = 0; i < 6; i++) {
    ck_assert (step_insert (r, (uint64_t) i * 16, 4));
    ck_assert (step_flush (r));
  }
  bcf_cache_test_crash (r->c, 0, BCF_IO_CRASH_KEEP_ALL);
  r->c = NULL;
}

static int
cmp_seq (const void *a, const void *b)
{
  const struct jpos *x = a, *y = b;
  return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Keeps the warnings an open logs. */
struct warnings {
  char text[4096];
};

static void
keep_warnings (void *opaque, enum bcf_log_level level, const char *msg)
{
  struct warnings *w = opaque;
  size_t used = strlen (w->text);

  log_cb (NULL, level, msg);
  if (level >= BCF_LOG_WARN)
    snprintf (w->text + used, sizeof w->text - used, "%s\n", msg);
}

START_TEST (test_journal_torn_newest)
{
  struct run r;
  struct jpos e[256];
  struct warnings w = { "" };
  char report[4096], want[64];
  size_t n;

  unclean_cache (&r);
  n = find_entries (r.path, e, 256);
  ck_assert_uint_ge (n, 3);
  qsort (e, n, sizeof *e, cmp_seq);
  /* Tear the newest entry: it was never acknowledged, so it is dropped,
   * but not silently: the open warns, and fsck notes it (not a
   * problem). */
  corrupt_byte (r.path, e[n - 1].off + 100);
  r.opts.log = keep_warnings;
  r.opts.log_opaque = &w;
  run_open (&r, BCF_FORMAT_NEVER, true);
  snprintf (want, sizeof want, "claiming seq %" PRIu64, e[n - 1].seq);
  ck_assert_msg (strstr (w.text, "1 torn journal entry skipped") &&
                 strstr (w.text, want), "no warning for the torn entry "
                 "%" PRIu64 "; the open logged: %s", e[n - 1].seq, w.text);
  ck_assert_int_eq (bcf_cache_fsck (r.c, report, sizeof report), 0);
  ck_assert_msg (strncmp (report, "note: journal: 1 torn journal entry "
                          "skipped", 42) == 0 && strstr (report, want),
                 "fsck does not note the torn entry: %s", report);
  run_free (&r);
}
END_TEST

/* An entry older than what replay needs is damaged, with valid entries
 * older and newer than it: it was durable once, so the journal is
 * damaged.  The open still succeeds (replay does not need it) and warns;
 * fsck reports a problem. */
START_TEST (test_journal_corrupt_middle)
{
  struct run r;
  struct jpos e[256];
  struct bcf_journal_scan js;
  struct warnings w = { "" };
  char report[4096], err[256], want[64];
  const struct bch_sb *sb;
  uint64_t last_seq;
  size_t n, victim = 0;

  run_init (&r, "journal-mid.img", 16u << 20, 16);
  rng_state = seed;
  for (int i = 0; i < 6; i++) {
    ck_assert (step_insert (&r, (uint64_t) i * 16, 4));
    ck_assert (step_flush (&r));
    if (i == 2)
      ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
  }
  sb = bcf_cache_super (r.c);
  ck_assert_int_eq (bcf_journal_inspect (r.path, sb, &js, err, sizeof err),
                    0);
  ck_assert_int_eq (js.status, BCF_JOURNAL_OK);
  last_seq = js.newest->hdr.last_seq;
  bcf_journal_scan_free (&js);
  bcf_cache_test_crash (r.c, 0, BCF_IO_CRASH_KEEP_ALL);
  r.c = NULL;

  n = find_entries (r.path, e, 256);
  qsort (e, n, sizeof *e, cmp_seq);
  /* The newest entry not needed, with an older valid one before it. */
  for (size_t i = 1; i < n; i++)
    if (e[i].seq < last_seq)
      victim = i;
  ck_assert_msg (victim > 0, "no unneeded entry between two valid ones "
                 "(last_seq %" PRIu64 ", %zu entries)", last_seq, n);
  corrupt_byte (r.path, e[victim].off + 100);
  r.opts.log = keep_warnings;
  r.opts.log_opaque = &w;
  run_open (&r, BCF_FORMAT_NEVER, true);
  snprintf (want, sizeof want, "claiming seq %" PRIu64, e[victim].seq);
  ck_assert_msg (strstr (w.text, "1 corrupt journal entry skipped") &&
                 strstr (w.text, want), "no warning for the corrupt entry "
                 "%" PRIu64 "; the open logged: %s", e[victim].seq, w.text);
  ck_assert_int_eq (bcf_cache_fsck (r.c, report, sizeof report), 1);
  ck_assert_msg (strncmp (report, "journal: 1 corrupt journal entry "
                          "skipped", 39) == 0 && strstr (report, want),
                 "fsck does not report the corrupt entry: %s", report);
  run_free (&r);
}
END_TEST

START_TEST (test_journal_gap_refused)
{
  struct run r;
  struct jpos e[256];
  char err[512] = "";
  size_t n;
  int x;

  unclean_cache (&r);
  n = find_entries (r.path, e, 256);
  ck_assert_uint_ge (n, 3);
  qsort (e, n, sizeof *e, cmp_seq);
  /* Damage an entry between last_seq and the newest: a gap. */
  corrupt_byte (r.path, e[n - 2].off + 100);
  r.opts.format = BCF_FORMAT_NEVER;
  x = bcf_cache_open (&r.opts, &r.c, err, sizeof err);
  ck_assert_msg (x < 0, "a journal with a gap was accepted");
  ck_assert_msg (strstr (err, "missing") != NULL, "unexpected error: %s", err);
  r.c = NULL;
  run_free (&r);
}
END_TEST

/* ---- a reused bucket after a crash ------------------------------------------- */

/* Block X is cached durably (and, in one variant, its key written into
 * the on-disk btree by a checkpoint).  Then the allocator reclaims its
 * bucket (gen bumped, the new gen persisted by a prio write) and another
 * block's data is written where X's was, and flushed.  Then the power
 * fails.  Nothing journalled X's removal: after recovery the btree (or
 * the journal replay) still holds X's key, pointing into the bucket with
 * the old gen.  Only the persisted gen makes it stale.  X must be a miss;
 * a hit would read the other block's bytes.  Every crash mode: all
 * unflushed writes lost, all kept, and seeded random subsets. */
/* A 2 MiB cache in 8 KiB buckets with fifo replacement, so that block
 * 0's bucket comes round again after about 2 MiB of inserts; faults
 * armable through f; block 0 written to the backing store and cached
 * (durably).  Returns block 0's extent. */
static struct bcf_extent
fifo_run_block0 (struct run *r, const char *name, struct bcf_io_faults *f)
{
  struct bcf_extent e;
  unsigned n;

  run_init_policy (r, name, 2u << 20, 16, BCH_REPLACEMENT_FIFO);
  bcf_io_set_faults (bcf_cache_test_io (r->c), f);
  backing_write_random (r, 0, 1);
  ck_assert_int_eq (bcf_insert (r->c, 0, BLOCK, r->buf, false, true), 0);
  ck_assert_int_eq (bcf_lookup (r->c, 0, BLOCK, &e, 1, &n), 0);
  ck_assert_int_eq (e.kind, BCF_EXTENT_HIT);
  return e;
}

static void
gen_reuse_crash (int mode, uint64_t cseed, bool ckpt)
{
  struct run r;
  struct bcf_io_faults f = { 0 };
  struct bcf_extent e, ex;
  uint64_t y = 0, bucket;
  unsigned n;
  bool reused = false;

  rng_state = seed * 7 + cseed;
  ex = fifo_run_block0 (&r, "reuse.img", &f);
  bucket = ex.dev_offset / (r.c->bucket_sectors << 9);
  if (ckpt)
    ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);

  for (unsigned i = 0; i < 20000 && !reused; i++) {
    y = 1 + i % (NBLOCKS - 1);
    backing_write_random (&r, y, 1);
    ck_assert_int_eq (bcf_insert (r.c, y * BLOCK, BLOCK, r.buf, false, false),
                      0);
    ck_assert_int_eq (bcf_lookup (r.c, y * BLOCK, BLOCK, &e, 1, &n), 0);
    ck_assert_int_eq (e.kind, BCF_EXTENT_HIT);
    reused = e.dev_offset == ex.dev_offset;
  }
  ck_assert_msg (reused, "seed %u: bucket %" PRIu64 " was never reused", seed,
                 bucket);
  ck_assert_int_eq (bcf_flush (r.c), 0);

  run_crash_reopen (&r, cseed, mode);
  ck_assert_int_eq (bcf_cache_fsck (r.c, NULL, 0), 0);

  ck_assert_int_eq (bcf_lookup (r.c, 0, BLOCK, &e, 1, &n), 0);
  if (e.kind == BCF_EXTENT_HIT) {
    int x = bcf_read_hit (r.c, &e, r.buf);
    ck_abort_msg ("seed %u crash mode %d%s: block 0's key into reused bucket "
                  "%" PRIu64 " is a hit after recovery (read: %s, bytes %s)",
                  seed, mode, ckpt ? " (key checkpointed)" : "", bucket,
                  x ? strerror (-x) : "ok",
                  memcmp (r.buf, r.m.shadow, BLOCK) == 0 ? "block 0's"
                  : memcmp (r.buf, r.m.shadow + y * BLOCK, BLOCK) == 0
                  ? "THE NEW OWNER'S" : "garbage");
  }
  /* The block that took its place was flushed: it survives, and reads
   * right. */
  ck_assert_int_eq (bcf_lookup (r.c, y * BLOCK, BLOCK, &e, 1, &n), 0);
  ck_assert_msg (e.kind == BCF_EXTENT_HIT, "seed %u: flushed block %" PRIu64
                 " lost", seed, y);
  ck_assert_int_eq (bcf_read_hit (r.c, &e, r.buf), 0);
  ck_assert (memcmp (r.buf, r.m.shadow + y * BLOCK, BLOCK) == 0);
  /* And every other hit equals the backing store. */
  check_hits_equal_backing (&r, "seed %u crash mode %d", seed, mode);
  run_free (&r);
}

START_TEST (test_gen_reuse_crash)
{
  for (int ckpt = 0; ckpt < 2; ckpt++) {
    gen_reuse_crash (BCF_IO_CRASH_LOSE_ALL, 1, ckpt);
    gen_reuse_crash (BCF_IO_CRASH_KEEP_ALL, 2, ckpt);
    for (uint64_t k = 0; k < 3; k++)
      gen_reuse_crash (BCF_IO_CRASH_RANDOM, seed + k, ckpt);
  }
}
END_TEST

/* ---- a journal entry written while a new prio chain is unflushed ----------- */

/* Every journal entry names the head of the prio chain.  alloc_prio_write
 * writes the new chain, publishes it, then commits it with a metadata
 * entry.  An ordinary entry written in between (another thread's FLUSH or
 * durable invalidation) names the new chain too, and an entry of
 * whiteouts does not flush the device first.  So the new prio buckets
 * must be durable before they are published; otherwise a power cut after
 * that entry's write can keep the entry and lose the buckets, and the
 * cache no longer opens.  The hook is that other thread: it writes an
 * ordinary entry (a pending whiteout) in the window, and the power goes
 * as soon as the entry is written.  Random crash choices, several seeds. */
static void
prio_window_entry (struct bcf_cache *c, void *opaque)
{
  bcf_io_test_power_cut (bcf_cache_test_io (c), 1);
  (void) bcf_cache_journal_write (c);   /* a FUA write: it survives */
}

static void
prio_publish_crash (uint64_t cseed)
{
  struct run r;
  struct bcf_io_faults f = { 0 };
  int e;

  run_init (&r, "prio.img", 4u << 20, 16);
  for (uint64_t blk = 0; blk < 64; blk++) {
    backing_write_random (&r, blk, 1);
    ck_assert_int_eq (bcf_insert (r.c, blk * BLOCK, BLOCK, r.buf, false, true),
                      0);
  }
  bcf_io_set_faults (bcf_cache_test_io (r.c), &f);
  /* A whiteout waits in the open entry (block 0 is cached: journalled). */
  ck_assert_int_eq (bcf_invalidate (r.c, 0, BLOCK, false), 0);
  r.c->test_prio_hook = prio_window_entry;
  pthread_mutex_lock (&r.c->ckpt_lock);
  e = alloc_prio_write (r.c);
  pthread_mutex_unlock (&r.c->ckpt_lock);
  ck_assert_msg (e < 0, "seed %u: the prio write survived a power cut", seed);

  bcf_cache_test_crash (r.c, cseed, BCF_IO_CRASH_RANDOM);
  r.c = NULL;
  r.opts.format = BCF_FORMAT_NEVER;
  {
    char err[512] = "";
    e = bcf_cache_open (&r.opts, &r.c, err, sizeof err);
    ck_assert_msg (e == 0, "crash seed %" PRIu64 ": the cache does not open "
                   "after a power cut behind a journal entry that names an "
                   "unflushed prio chain: %s", cseed, err);
  }
  ck_assert_int_eq (bcf_cache_fsck (r.c, NULL, 0), 0);
  check_hits_equal_backing (&r, "crash seed %" PRIu64, cseed);
  run_free (&r);
}

START_TEST (test_prio_publish_crash)
{
  for (uint64_t k = 0; k < 16; k++)
    prio_publish_crash (seed * 16 + k);
}
END_TEST

/* ---- a stale key dropped from memory before its gen is persisted ---------- */

/* A bucket's gen is bumped in memory when the allocator invalidates it,
 * and persisted only with the next prio write.  In between, the keys
 * into it are stale in memory but valid on disk.  GC drops such keys from
 * memory, and so does a miss's check key laid over one.  A write to the
 * range then finds nothing cached and, unless it looks further, does not
 * journal its invalidation, so a power cut before the prio write brings
 * the old key back, valid, over data the backing store no longer has.
 * The hook is the window: the allocator has invalidated block 0's bucket
 * and written the new prio chain, but not committed it; there we drop
 * block 0's key (by GC, or by a miss begun and cancelled over it),
 * change block 0 in the backing store, invalidate it durably, and cut
 * the power before the prio commit. */
struct stale_window {
  struct run *r;
  uint64_t bucket;              /* block 0's */
  bool by_gc;                   /* drop by GC, else by a cancelled miss */
  bool fired;
};

static void
stale_window_hook (struct bcf_cache *c, void *opaque)
{
  struct stale_window *w = opaque;
  struct bucket *b = &c->alloc.buckets[w->bucket];
  struct bcf_extent e;
  unsigned n;

  if (w->fired || b->gen == b->disk_gen)
    return;                     /* not block 0's bucket this time */
  w->fired = true;
  ck_assert_int_eq (bcf_lookup (c, 0, BLOCK, &e, 1, &n), 0);
  ck_assert_msg (e.kind != BCF_EXTENT_HIT, "seed %u: a key into an "
                 "invalidated bucket is a hit", seed);
  if (w->by_gc)
    ck_assert_int_eq (bcf_gc_run (c), 0);
  else {
    struct bcf_miss m;
    ck_assert_int_eq (bcf_miss_begin (c, 0, BLOCK, &m), 0);
    bcf_miss_cancel (c, &m);
  }
  backing_write_random (w->r, 0, 1);
  ck_assert_int_eq (bcf_invalidate (c, 0, BLOCK, true), 0);
  /* At once: the prio commit that follows (a FUA write, durable as soon
   * as written) would persist the new gen and hide a missing whiteout. */
  bcf_io_test_power_cut (bcf_cache_test_io (c), 0);
}

/* Cut the power in `mode` (seeded by crash_seed) and reopen: block 0 is
 * not a hit, though its invalidation was acknowledged as durable, and
 * every hit matches the backing store.  what names the case. */
static void
crash_and_check_block0 (struct run *r, int mode, uint64_t crash_seed,
                        const char *what)
{
  struct bcf_extent e;
  unsigned n;

  run_crash_reopen (r, crash_seed, mode);
  ck_assert_int_eq (bcf_cache_fsck (r->c, NULL, 0), 0);
  ck_assert_int_eq (bcf_lookup (r->c, 0, BLOCK, &e, 1, &n), 0);
  ck_assert_msg (e.kind != BCF_EXTENT_HIT, "seed %u crash mode %d (%s): "
                 "block 0's old key is a hit after recovery, though its "
                 "invalidation was acknowledged as durable", seed, mode,
                 what);
  check_hits_equal_backing (r, "seed %u crash mode %d (%s)", seed, mode,
                            what);
}

static void
stale_drop_crash (bool by_gc, int mode, uint64_t cseed)
{
  struct run r;
  struct bcf_io_faults f = { 0 };
  struct bcf_extent e;
  struct stale_window w = { .r = &r, .by_gc = by_gc };

  rng_state = seed * 11 + cseed;
  e = fifo_run_block0 (&r, "stale.img", &f);
  w.bucket = e.dev_offset / (r.c->bucket_sectors << 9);
  ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);   /* the key on disk */

  r.c->test_prio_hook = stale_window_hook;
  r.c->test_prio_hook_opaque = &w;
  /* Durable inserts: no journal entry may be pending when the window
   * opens.  A durable invalidation waits for its leaf's pending entries
   * (jseq), and any entry written in the window names the new prio chain,
   * persisting block 0's new gen: the test would no longer see whether
   * the invalidation journals by itself. */
  for (unsigned i = 0; i < 20000 && !w.fired; i++) {
    uint64_t y = 1 + i % (NBLOCKS - 1);
    backing_write_random (&r, y, 1);
    if (bcf_insert (r.c, y * BLOCK, BLOCK, r.buf, false, true) < 0)
      break;                    /* the power went in the hook */
  }
  ck_assert_msg (w.fired, "seed %u: bucket %" PRIu64 " was never "
                 "invalidated", seed, w.bucket);

  crash_and_check_block0 (&r, mode, cseed, by_gc ? "dropped by GC"
                          : "dropped by a cancelled miss");
  run_free (&r);
}

START_TEST (test_stale_drop_crash)
{
  for (int by_gc = 0; by_gc < 2; by_gc++) {
    stale_drop_crash (by_gc, BCF_IO_CRASH_LOSE_ALL, 1);
    stale_drop_crash (by_gc, BCF_IO_CRASH_KEEP_ALL, 2);
    for (uint64_t k = 0; k < 4; k++)
      stale_drop_crash (by_gc, BCF_IO_CRASH_RANDOM, seed + k);
  }
}
END_TEST

/* ---- durable invalidations ------------------------------------------------- */

static const int crash_modes[3] = {
  BCF_IO_CRASH_LOSE_ALL, BCF_IO_CRASH_KEEP_ALL, BCF_IO_CRASH_RANDOM,
};

/* How block 0 came to be cached before a write invalidates it. */
enum before {
  B_FILL,               /* a miss filled it: only memory has the key */
  B_FILL_SPLIT,         /* ... and its leaf split since */
  B_FILL_CKPT,          /* a miss filled it and a checkpoint wrote it */
  B_INSERT,             /* bcf_insert: the journal holds the key */
  B_REPLAYED,           /* bcf_insert, then a crash: replayed at open */
  B_COUNT
};
static const char *const bname[] = {
  "filled", "filled, leaf split since", "filled and checkpointed",
  "inserted (journalled)", "inserted, replayed after a crash",
};

/* Keep an undo log of the cache device's unflushed writes from now on, so
 * that a crash in LOSE_ALL or RANDOM mode loses them. */
static void
arm_undo_log (struct run *r)
{
  const struct bcf_io_faults none = { 0 };

  bcf_io_set_faults (bcf_cache_test_io (r->c), &none);
}

static uint64_t
journal_writes (struct run *r)
{
  struct bcf_cache_stats st;

  bcf_cache_stats (r->c, &st);
  return st.journal_writes;
}

static void
assert_block0_hit (struct run *r, const char *what)
{
  struct bcf_extent e;
  unsigned n;

  ck_assert_int_eq (bcf_lookup (r->c, 0, BLOCK, &e, 1, &n), 0);
  ck_assert_msg (e.kind == BCF_EXTENT_HIT, "seed %u: block 0 is not cached "
                 "(%s)", seed, what);
}

/* A whiteout journalled but not yet written — an invalidation on the read
 * path (not durable), or a concurrent writer's still waiting for its
 * journal write — leaves no key behind in the merged set.  A durable
 * invalidation of the same range that finds nothing there must still wait
 * for that entry before its caller changes the backing store. */
START_TEST (test_pending_whiteout_crash)
{
  for (unsigned i = 0; i < 3; i++) {
    const int mode = crash_modes[i];
    struct run r;
    uint64_t w0;
    bool waited;

    rng_state = seed * 17 + (unsigned) mode;
    run_init (&r, "pending.img", 16u << 20, 16);
    arm_undo_log (&r);
    backing_write_random (&r, 0, 1);
    ck_assert_int_eq (bcf_insert (r.c, 0, BLOCK, r.buf, false, true), 0);
    ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
    assert_block0_hit (&r, "inserted and checkpointed");

    ck_assert_int_eq (bcf_invalidate (r.c, 0, BLOCK, false), 0);
    w0 = journal_writes (&r);
    ck_assert_int_eq (bcf_invalidate (r.c, 0, BLOCK, true), 0);
    waited = journal_writes (&r) > w0;
    backing_write_random (&r, 0, 1);
    crash_and_check_block0 (&r, mode, seed, "whiteout pending");
    ck_assert_msg (waited, "seed %u: a durable invalidation returned before "
                   "the pending whiteout of its range was written", seed);
    run_free (&r);
  }
}
END_TEST

/* A durable invalidation is journalled exactly where recovery could bring
 * the key back, and after a power cut the key is gone either way. */
static void
invalidate_after (enum before how, int mode)
{
  struct run r;
  uint64_t nodes, w0;
  bool journalled, expect = how >= B_FILL_CKPT;

  rng_state = seed * 13 + how;
  run_init (&r, "inval.img", 16u << 20, 16);
  arm_undo_log (&r);
  backing_write_random (&r, 0, 1);
  if (how >= B_INSERT) {
    ck_assert_int_eq (bcf_insert (r.c, 0, BLOCK, r.buf, false, true), 0);
    if (how == B_REPLAYED) {
      run_crash_reopen (&r, seed, BCF_IO_CRASH_KEEP_ALL);
      arm_undo_log (&r);
    }
  }
  else
    ck_assert (step_read_fill (&r, 0, 1));
  if (how == B_FILL_CKPT)
    ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
  if (how == B_FILL_SPLIT) {
    /* 8 KiB nodes hold ~270 keys: 400 more fills split block 0's leaf. */
    nodes = r.c->tree.nnodes;
    for (uint64_t blk = 2; blk < 802; blk += 2) {
      backing_write_random (&r, blk, 1);
      ck_assert (step_read_fill (&r, blk, 1));
    }
    ck_assert_uint_gt (r.c->tree.nnodes, nodes);
  }
  assert_block0_hit (&r, bname[how]);

  /* The write: invalidate durably, then change the backing store. */
  w0 = journal_writes (&r);
  ck_assert_int_eq (bcf_invalidate (r.c, 0, BLOCK, true), 0);
  journalled = journal_writes (&r) > w0;
  backing_write_random (&r, 0, 1);
  /* Safety first, then whether it cost a journal write where none was
   * needed (or skipped one that was). */
  crash_and_check_block0 (&r, mode, seed, bname[how]);
  ck_assert_msg (journalled == expect, "seed %u: block 0 %s: the durable "
                 "invalidation %s journalled", seed, bname[how],
                 journalled ? "was" : "was not");
  run_free (&r);
}

START_TEST (test_invalidate_journal_choice)
{
  for (int how = 0; how < B_COUNT; how++)
    for (unsigned i = 0; i < 3; i++)
      invalidate_after (how, crash_modes[i]);
}
END_TEST

/* A checkpoint captured block 0's key (so it is on its way to disk) and
 * has not committed yet when a write invalidates block 0: the key is no
 * longer in its leaf's open set, so the invalidation is journalled, and
 * after the commit and a power cut block 0 is not a hit. */
struct capture_window {
  struct run *r;
  pthread_t writer;
  bool started;
  atomic_bool done;
};

static void *
capture_writer (void *arg)
{
  struct capture_window *w = arg;

  ck_assert_int_eq (bcf_invalidate (w->r->c, 0, BLOCK, true), 0);
  atomic_store (&w->done, true);
  return NULL;
}

static void
capture_hook (struct bcf_cache *c, void *opaque)
{
  struct capture_window *w = opaque;

  if (w->started)
    return;
  w->started = true;
  ck_assert_int_eq (pthread_create (&w->writer, NULL, capture_writer, w), 0);
  /* Let the writer finish inside the window if it can (it may have to
   * wait for the checkpoint's journal entry; then it finishes after). */
  for (int i = 0; i < 500 && !atomic_load (&w->done); i++)
    bcf_sleep_ms (1);
}

START_TEST (test_invalidate_captured_crash)
{
  for (unsigned i = 0; i < 3; i++) {
    const int mode = crash_modes[i];
    struct run r;
    struct capture_window w = { .r = &r };

    rng_state = seed * 19 + (unsigned) mode;
    run_init (&r, "captured.img", 16u << 20, 16);
    arm_undo_log (&r);
    backing_write_random (&r, 0, 1);
    ck_assert (step_read_fill (&r, 0, 1));
    assert_block0_hit (&r, "filled");

    r.c->test_ckpt_hook = capture_hook;
    r.c->test_ckpt_hook_opaque = &w;
    ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
    r.c->test_ckpt_hook = NULL;
    ck_assert (w.started);
    ck_assert_int_eq (pthread_join (w.writer, NULL), 0);
    backing_write_random (&r, 0, 1);
    crash_and_check_block0 (&r, mode, seed, "captured, not yet committed");
    run_free (&r);
  }
}
END_TEST

/* Fills are not journalled; the journal timer's checkpoint makes them
 * survive a crash even when no journal entry fills the journal, as in a
 * read-mostly cache. */
START_TEST (test_fill_survives_crash)
{
  struct run r;
  struct bcf_cache_stats st;
  uint64_t n0;

  rng_state = seed * 23 + 1;
  run_init (&r, "timer.img", 16u << 20, 16);
  arm_undo_log (&r);
  r.c->opts.checkpoint_interval_ms = 100;
  r.c->opts.journal_delay_ms = 10;
  backing_write_random (&r, 0, 1);
  ck_assert (step_read_fill (&r, 0, 1));
  bcf_cache_stats (r.c, &st);
  n0 = st.checkpoint.count;
  ck_assert_int_eq (bcf_cache_start_threads (r.c), 0);
  for (int i = 0; i < 500 && st.checkpoint.count == n0; i++) {
    bcf_sleep_ms (10);
    bcf_cache_stats (r.c, &st);
  }
  ck_assert_msg (st.checkpoint.count > n0, "seed %u: no checkpoint within "
                 "5 s of a fill, with checkpoint_interval_ms = 100", seed);
  run_crash_reopen (&r, seed, BCF_IO_CRASH_LOSE_ALL);
  assert_block0_hit (&r, "filled, then a timed checkpoint and a crash");
  check_hits_equal_backing (&r, "seed %u: after the timed checkpoint", seed);
  run_free (&r);
}
END_TEST

/* ---- a write over data that comes back dirty ------------------------------- */

/* Blocks [0, 4) hold A, written in writeback mode and flushed: as a
 * dirty key, or (a_dirty false) written back, so as a clean key whose
 * dirty version is in the journal (clean marks are not journalled).
 * Then, in writethrough, a write of B over them (FUA or not), which
 * marks their write-intent region, and the power goes.  B was
 * acknowledged and the export has it: after recovery the blocks read B,
 * and the export holds B after the writeback (in writethrough the export
 * is never older than an acknowledged write, flushed or not).  The mark
 * covers only clean keys coming back (recovery drops them); A comes back
 * dirty and would be written back over B unless B's keys are durable
 * first.  Seen failing before each fix: for FUA without the journal wait
 * of FUA writes in cache_write (core/request.c); without FUA when the
 * mark stood in for the wait over data that comes back dirty (btree.c's
 * btree_range_returns_dirty_locked; the kill -9 soak found it,
 * TEST_SEED=41174: the proxy served an older write after the restart). */
static void
write_over_dirty (bool a_dirty, int cache_mode, bool fua)
{
  struct run r;
  struct bcf_req_opts ro = { .mode = BCF_MODE_WRITEBACK };
  struct bcf_req *q;
  static uint8_t a[4 * BLOCK], b[4 * BLOCK], got[4 * BLOCK];
  struct bcf_cache_stats st;
  const char *what = a_dirty ? "over a dirty key" : "over a clean key that "
                     "comes back dirty";
  const char *kind = fua ? "FUA write" : "write";

  rng_state = seed * 37 + a_dirty * 5 + (uint64_t) cache_mode + fua * 101;
  run_init (&r, "fua.img", 16u << 20, 16);
  q = bcf_req_new (r.c, &ro);
  ck_assert_ptr_nonnull (q);
  fill (a, sizeof a);
  ck_assert_int_eq (bcf_req_write (q, &r.b, a, sizeof a, 0, false), 0);
  ck_assert_int_eq (bcf_req_flush (q, &r.b), 0);
  if (!a_dirty)
    ck_assert_int_eq (bcf_req_writeback (q, &r.b), 0);
  ck_assert_int_eq (bcf_req_set_mode (q, BCF_MODE_WRITETHROUGH), 0);

  arm_undo_log (&r);
  fill (b, sizeof b);
  ck_assert_int_eq (bcf_req_write (q, &r.b, b, sizeof b, 0, fua), 0);
  bcf_cache_stats (r.c, &st);
  ck_assert_uint_eq (st.intent_regions, 1);
  bcf_req_free (q);
  run_crash_reopen (&r, seed, cache_mode);
  ck_assert_int_eq (bcf_cache_fsck (r.c, NULL, 0), 0);
  q = bcf_req_new (r.c, &ro);
  ck_assert_ptr_nonnull (q);
  ck_assert_int_eq (bcf_req_read (q, &r.b, got, sizeof got, 0), 0);
  ck_assert_msg (memcmp (got, b, sizeof b) == 0, "seed %u crash mode %d: a "
                 "%s %s reads %s after a crash", seed, cache_mode, kind,
                 what, memcmp (got, a, sizeof a) == 0 ? "the older write"
                 : "something else");
  ck_assert_int_eq (bcf_req_writeback (q, &r.b), 0);
  mem_backing_peek (r.mb, got, sizeof got, 0);
  ck_assert_msg (memcmp (got, b, sizeof b) == 0, "seed %u crash mode %d: a "
                 "%s %s: after the writeback the export does not hold it",
                 seed, cache_mode, kind, what);
  bcf_req_free (q);
  run_free (&r);
}

START_TEST (test_fua_over_dirty_crash)
{
  for (int a_dirty = 0; a_dirty < 2; a_dirty++)
    for (unsigned i = 0; i < 3; i++)
      write_over_dirty (a_dirty, crash_modes[i], true);
}
END_TEST

START_TEST (test_write_over_dirty_crash)
{
  for (int a_dirty = 0; a_dirty < 2; a_dirty++)
    for (unsigned i = 0; i < 3; i++)
      write_over_dirty (a_dirty, crash_modes[i], false);
}
END_TEST

/* ---- the writeback's order against crashes (core/writeback.c B1-B5) ------ */

/* Where the power goes during a writeback pass. */
enum wb_cut {
  CUT_EXPORT_WRITTEN,   /* B3 done, before B4: the export has the data in
                           its volatile cache, the keys are dirty */
  CUT_FLUSHED,          /* B4 done, before B5: durable on the export, the
                           keys still dirty */
  CUT_CLEAN_DURABLE,    /* B5 done and a checkpoint wrote the clean keys */
  CUT_COUNT
};
static const char *const cutname[] = {
  "between the export write and its flush",
  "between the export flush and the clean mark",
  "after the clean mark, made durable by a checkpoint",
};

/* A backing store that hands the writeback's flush to the test: the
 * mem_backing it wraps, with the power cut at the flush. */
struct cut_backing {
  struct bcf_backing inner;
  struct bcf_cache *c;
  enum wb_cut where;
  bool fired;
};

static int
cb_pread (void *o, void *buf, uint32_t count, uint64_t offset)
{
  struct cut_backing *cb = o;
  return cb->inner.ops->pread (cb->inner.opaque, buf, count, offset);
}

static int
cb_pwrite (void *o, const void *buf, uint32_t count, uint64_t offset,
           bool fua)
{
  struct cut_backing *cb = o;
  return cb->inner.ops->pwrite (cb->inner.opaque, buf, count, offset, fua);
}

/* The power cut is at once (the cache device takes nothing more) and
 * the flush does not happen (CUT_EXPORT_WRITTEN: the machine died), or
 * happens (CUT_FLUSHED): what follows in the pass, the clean mark, only
 * changes memory. */
static int
cb_flush (void *o)
{
  struct cut_backing *cb = o;
  int rc = 0;

  if (!cb->fired && cb->where == CUT_EXPORT_WRITTEN) {
    cb->fired = true;
    bcf_io_test_power_cut (bcf_cache_test_io (cb->c), 0);
    return -EIO;
  }
  rc = cb->inner.ops->flush (cb->inner.opaque);
  if (!cb->fired && cb->where == CUT_FLUSHED) {
    cb->fired = true;
    bcf_io_test_power_cut (bcf_cache_test_io (cb->c), 0);
  }
  return rc;
}

static int
cb_trim (void *o, uint32_t count, uint64_t offset)
{
  struct cut_backing *cb = o;
  return cb->inner.ops->trim (cb->inner.opaque, count, offset);
}

static int
cb_zero (void *o, uint32_t count, uint64_t offset, bool may_trim)
{
  struct cut_backing *cb = o;
  return cb->inner.ops->zero (cb->inner.opaque, count, offset, may_trim);
}

static int64_t
cb_size (void *o)
{
  struct cut_backing *cb = o;
  return cb->inner.ops->size (cb->inner.opaque);
}

static const struct bcf_backing_ops cut_backing_ops = {
  .pread = cb_pread, .pwrite = cb_pwrite, .flush = cb_flush,
  .trim = cb_trim, .zero = cb_zero, .size = cb_size,
};

/* Blocks [0, 16) hold O on the export (durable) and, as a clean key, in
 * the cache (a checkpointed fill); then A is written over them in
 * writeback mode and flushed: A is the last flushed write, dirty.  A
 * writeback pass then writes A back and the power goes at `where`, for
 * the cache device (in cache_mode) and for the export (in backing_mode:
 * its unflushed writes lost, or kept).  After recovery, no time travel
 * either way: the blocks read A (the cache does not serve the older O),
 * every clean extent equals the export (the export is not older than a
 * clean key), and a writeback leaves A on the export.
 *
 * Negative control, checked by hand: with the backing flush of
 * write_batch (B4) skipped, CUT_CLEAN_DURABLE with the export losing its
 * unflushed writes fails: the clean A that the checkpoint made durable
 * is dropped at recovery (its write-intent region is marked) and the
 * blocks read O from the export, older than the last flush; with the
 * regions off, the cache would keep A while the export holds O.  (The
 * cuts at the flush then never happen either: that is asserted last, so
 * that the data checks speak first.)  Returns whether the cut at the
 * flush happened (always true for CUT_CLEAN_DURABLE). */
static bool
wb_order_crash (enum wb_cut where, int cache_mode, int backing_mode,
                uint64_t cseed)
{
  struct run r;
  struct cut_backing cb;
  struct bcf_req_opts ro = { .mode = BCF_MODE_WRITEBACK };
  struct bcf_req *q;
  struct bcf_backing b;
  static uint8_t a[16 * BLOCK], got[16 * BLOCK];
  char what[256];
  int rc;

  snprintf (what, sizeof what, "seed %u: crash %s (cache device: mode %d, "
            "export: %s its unflushed writes)", seed, cutname[where],
            cache_mode, backing_mode == MEM_BACKING_LOSE_ALL ? "loses"
            : "keeps");
  rng_state = seed * 31 + where * 7 + (uint64_t) cache_mode * 3
              + (uint64_t) backing_mode;
  run_init (&r, "order.img", 16u << 20, 16);
  cb = (struct cut_backing) { .inner = r.b, .c = r.c, .where = where };
  b = (struct bcf_backing) { .ops = &cut_backing_ops, .opaque = &cb };
  q = bcf_req_new (r.c, &ro);
  ck_assert_ptr_nonnull (q);

  fill (r.buf, sizeof a);
  mem_backing_poke (r.mb, r.buf, sizeof a, 0);
  ck_assert_int_eq (bcf_req_read (q, &r.b, got, sizeof got, 0), 0);
  bcf_req_drain (q);
  ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
  fill (a, sizeof a);
  ck_assert_int_eq (bcf_req_write (q, &r.b, a, sizeof a, 0, false), 0);
  ck_assert_int_eq (bcf_req_flush (q, &r.b), 0);

  arm_undo_log (&r);
  mem_backing_track_crash (r.mb, true);
  rc = bcf_req_writeback (q, &b);
  if (where == CUT_EXPORT_WRITTEN && cb.fired)
    ck_assert_int_lt (rc, 0);   /* the flush "failed": the machine died */
  else
    ck_assert_int_eq (rc, 0);
  if (where == CUT_CLEAN_DURABLE)
    ck_assert_int_eq (bcf_cache_checkpoint (r.c), 0);
  bcf_req_free (q);

  mem_backing_crash (r.mb, backing_mode, cseed);
  mem_backing_track_crash (r.mb, false);
  run_crash_reopen (&r, cseed, cache_mode);
  ck_assert_int_eq (bcf_cache_fsck (r.c, NULL, 0), 0);
  mem_backing_peek (r.mb, r.m.shadow, BACKING, 0);
  memset (r.m.rewritten, true, sizeof r.m.rewritten);
  check_clean_hits_equal_backing (&r, "%s: the export is older than a "
                                  "clean key", what);
  q = bcf_req_new (r.c, &ro);
  ck_assert_ptr_nonnull (q);
  ck_assert_int_eq (bcf_req_read (q, &r.b, got, sizeof got, 0), 0);
  ck_assert_msg (memcmp (got, a, sizeof a) == 0, "%s: the blocks do not "
                 "read the last flushed write", what);
  ck_assert_int_eq (bcf_req_writeback (q, &r.b), 0);
  mem_backing_peek (r.mb, got, sizeof got, 0);
  ck_assert_msg (memcmp (got, a, sizeof a) == 0, "%s: after the writeback "
                 "the export does not hold the last flushed write", what);
  bcf_req_free (q);
  run_free (&r);
  return where == CUT_CLEAN_DURABLE || cb.fired;
}

START_TEST (test_writeback_order_crash)
{
  int unflushed = -1;

  for (int where = 0; where < CUT_COUNT; where++)
    for (int bm = 0; bm < 2; bm++) {
      const int backing_mode = bm ? MEM_BACKING_KEEP_ALL
                               : MEM_BACKING_LOSE_ALL;
      for (unsigned i = 0; i < 3; i++)
        if (!wb_order_crash (where, crash_modes[i], backing_mode, seed + i))
          unflushed = where;
    }
  ck_assert_msg (unflushed < 0, "seed %u: the writeback never flushed the "
                 "export (the cut %s never happened)", seed,
                 unflushed < 0 ? "" : cutname[unflushed]);
}
END_TEST

static void
add (Suite *s, const char *name, const TTest *t)
{
  TCase *tc = tcase_create (name);
  tcase_set_timeout (tc, 900);
  tcase_add_test (tc, t);
  suite_add_tcase (s, tc);
}

static Suite *
crash_suite (void)
{
  Suite *s = suite_create ("crash");

  add (s, "journal_torn_newest", test_journal_torn_newest);
  add (s, "journal_corrupt_middle", test_journal_corrupt_middle);
  add (s, "journal_gap_refused", test_journal_gap_refused);
  add (s, "crash_inserts", test_crash_inserts);
  add (s, "crash_fills", test_crash_fills);
  add (s, "crash_eviction", test_crash_eviction);
  add (s, "crash_dirty", test_crash_dirty);
  add (s, "crash_dirty_nointent", test_crash_dirty_nointent);
  add (s, "crash_writeback", test_crash_writeback);
  add (s, "crash_writeback_nointent", test_crash_writeback_nointent);
  add (s, "crash_writeback_export", test_crash_writeback_export);
  add (s, "move_reuse_crash", test_move_reuse_crash);
  add (s, "export_barrier", test_export_barrier);
  add (s, "gen_reuse_crash", test_gen_reuse_crash);
  add (s, "prio_publish_crash", test_prio_publish_crash);
  add (s, "stale_drop_crash", test_stale_drop_crash);
  add (s, "pending_whiteout_crash", test_pending_whiteout_crash);
  add (s, "invalidate_journal_choice", test_invalidate_journal_choice);
  add (s, "invalidate_captured_crash", test_invalidate_captured_crash);
  add (s, "fill_survives_crash", test_fill_survives_crash);
  add (s, "writeback_order_crash", test_writeback_order_crash);
  add (s, "fua_over_dirty_crash", test_fua_over_dirty_crash);
  add (s, "write_over_dirty_crash", test_write_over_dirty_crash);
  return s;
}

int
main (void)
{
  int r;

  seed = test_seed ("test-crash");
  test_tmpdir (tmpdir, sizeof tmpdir, "bcf-crash");
  r = test_main (crash_suite ());
  rmdir (tmpdir);
  return r;
}
