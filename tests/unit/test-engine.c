/* Unit tests for the cache engine (core/): format / open / close, the
 * cache-miss protocol, a model-based random test with reopen cycles, and
 * GC running beside allocation.
 *
 * Also: the read race of a hit whose bucket is reused meanwhile
 * (test_read_race_stale), and the open's progress reports
 * (test_open_progress).
 *
 * The model test plays the request path of a writethrough cache over an
 * in-memory backing store (tests/unit/mem-backing) and keeps two
 * references: the shadow copy of what the backing store holds, and, block
 * by block, whether the block should be cached.  Every hit must equal the
 * shadow (I1/I2: never stale), and in the strict phase (no eviction) the
 * cache's hit/miss map must equal the model's exactly, also after every
 * close and reopen (persistence).  The seed comes from TEST_SEED or the
 * clock and is printed first.
 */
#include "config.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/probe.h"
#include "engine.h"
#include "mem-backing.h"
#include "testlib.h"

static unsigned seed;
static char tmpdir[256];


#define BLOCK 4096u

/* Warnings that a format used smaller buckets than the default. */
static atomic_uint smaller_bucket_warnings;

static void
log_cb (void *opaque, enum bcf_log_level level, const char *msg)
{
  if (level == BCF_LOG_WARN && strstr (msg, "instead of the default"))
    atomic_fetch_add (&smaller_bucket_warnings, 1);
  if (level >= BCF_LOG_WARN || getenv ("TEST_VERBOSE"))
    fprintf (stderr, "engine: %s\n", msg);
}

struct fixture {
  char path[320];
  struct mem_backing *mb;
  struct bcf_cache_opts opts;
  struct bcf_cache *c;
};

static void
fixture_init (struct fixture *f, const char *name, uint64_t backing_bytes,
              uint64_t cache_bytes, unsigned bucket_sectors)
{
  memset (f, 0, sizeof *f);
  snprintf (f->path, sizeof f->path, "%s/%s", tmpdir, name);
  unlink (f->path);
  f->mb = mem_backing_new (backing_bytes);
  ck_assert_ptr_nonnull (f->mb);
  f->opts.path = f->path;
  f->opts.create_size = cache_bytes;
  f->opts.format = BCF_FORMAT_AUTO;
  f->opts.bucket_sectors = bucket_sectors;
  f->opts.block_sectors = BLOCK / 512;
  f->opts.backing = mem_backing_get (f->mb);
  memcpy (f->opts.backing_uuid, "0123456789abcdef", 16);
  strcpy (f->opts.backing_label, "test export");
  f->opts.log = log_cb;
}

static void
fixture_open (struct fixture *f)
{
  char err[512] = "";
  int r = bcf_cache_open (&f->opts, &f->c, err, sizeof err);
  ck_assert_msg (r == 0, "bcf_cache_open: %s (%s)", err, strerror (-r));
}

static void
fixture_close (struct fixture *f)
{
  ck_assert_int_eq (bcf_cache_close (f->c), 0);
  f->c = NULL;
}

static void
fixture_free (struct fixture *f)
{
  if (f->c)
    bcf_cache_close (f->c);
  mem_backing_free (f->mb);
  unlink (f->path);
}

/* ---- the request path, as the filter will drive it ----------------------------- */

static void
fill (uint8_t *buf, size_t len)
{
  for (size_t i = 0; i < len; i += 8) {
    uint64_t x = rnd ();
    memcpy (buf + i, &x, len - i < 8 ? len - i : 8);
  }
}

/* Read through the cache; every hit is checked against the shadow. */
static void
cached_read (struct fixture *f, const uint8_t *shadow, uint64_t off,
             uint64_t len, bool fill_misses, uint64_t op)
{
  struct bcf_extent ext[64];
  unsigned n;
  uint64_t pos = off;
  uint8_t *buf = malloc (len);

  /* check_msg, not ck_assert: this runs for every read of the models. */
  check_msg (buf != NULL, "out of memory");
  while (pos < off + len) {
    int r = bcf_lookup (f->c, pos, off + len - pos, ext, 64, &n);

    check_msg (r == 0, "seed %u op %" PRIu64 ": bcf_lookup: %s", seed, op,
               strerror (-r));
    check_msg (n > 0, "seed %u op %" PRIu64 ": bcf_lookup found nothing at "
               "%" PRIu64, seed, op, pos);
    for (unsigned i = 0; i < n; i++) {
      uint8_t *p = buf + (ext[i].offset - off);
      check_msg (ext[i].offset == pos, "seed %u op %" PRIu64 ": extent at "
                 "%" PRIu64 ", expected %" PRIu64, seed, op, ext[i].offset,
                 pos);
      if (ext[i].kind == BCF_EXTENT_HIT) {
        r = bcf_read_hit (f->c, &ext[i], p);
        check_msg (r == 0 || r == -ESTALE, "read_hit: %s", strerror (-r));
        if (r == 0)
          check_msg (memcmp (p, shadow + ext[i].offset, ext[i].len) == 0,
                     "seed %u op %" PRIu64 ": STALE HIT at %" PRIu64
                     " len %" PRIu64, seed, op, ext[i].offset, ext[i].len);
      }
      else if (fill_misses) {
        struct bcf_miss m;
        struct bcf_backing b = mem_backing_get (f->mb);
        if (bcf_miss_begin (f->c, ext[i].offset, ext[i].len, &m) == 0) {
          r = b.ops->pread (b.opaque, p, (uint32_t) ext[i].len,
                            ext[i].offset);
          check_msg (r == 0, "backing read: %s", strerror (-r));
          r = bcf_miss_fill (f->c, &m, p);
          check_msg (r == 0 || r == -EEXIST || r == -ENOSPC,
                     "miss_fill: %s", strerror (-r));
        }
      }
      pos = ext[i].offset + ext[i].len;
    }
  }
  free (buf);
}

/* ---- tests ----------------------------------------------------------------------- */

START_TEST (test_format_reopen)
{
  struct fixture f;
  struct bcf_cache_stats st;
  uint8_t *data = malloc (65536);

  fixture_init (&f, "reopen.img", 16 << 20, 32 << 20, 256);
  fixture_open (&f);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.nbuckets, (32 << 20) / (256 * 512));
  ck_assert_uint_eq (st.btree_depth, 1);

  /* Write through, then reopen: the data must be a hit. */
  rng_state = seed + 1;
  fill (data, 65536);
  ck_assert_int_eq (bcf_insert (f.c, 1 << 20, 65536, data, false, true), 0);
  fixture_close (&f);

  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  struct bcf_extent e[4];
  unsigned n;
  ck_assert_int_eq (bcf_lookup (f.c, 1 << 20, 65536, e, 4, &n), 0);
  ck_assert_uint_eq (n, 1);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
  uint8_t *back = malloc (65536);
  ck_assert_int_eq (bcf_read_hit (f.c, &e[0], back), 0);
  ck_assert (memcmp (back, data, 65536) == 0);
  fixture_close (&f);

  /* bcache-super-show accepts what we wrote. */
  if (strcmp (BCACHE_SUPER_SHOW, "no") != 0) {
    char cmd[512];
    snprintf (cmd, sizeof cmd, "%s %s | grep -q '^sb.csum.*\\[match\\]'",
              BCACHE_SUPER_SHOW, f.path);
    ck_assert_int_eq (system (cmd), 0);
  }
  free (back);
  free (data);
  fixture_free (&f);
}
END_TEST

/* A device made by make-bcache -C is registered, written, reopened. */
START_TEST (test_make_bcache_interop)
{
  struct fixture f;
  char cmd[512];
  uint8_t *data = malloc (8192);

  if (strcmp (MAKE_BCACHE, "no") == 0) {
    fprintf (stderr, "SKIP: make-bcache missing\n");
    free (data);
    return;
  }
  fixture_init (&f, "mb.img", 16 << 20, 64 << 20, 0);
  {
    int fd = open (f.path, O_RDWR | O_CREAT, 0600);
    ck_assert_int_ge (fd, 0);
    ck_assert_int_eq (ftruncate (fd, 64 << 20), 0);
    close (fd);
  }
  snprintf (cmd, sizeof cmd, "%s -C -b 256k -w 4k %s >/dev/null", MAKE_BCACHE,
            f.path);
  ck_assert_int_eq (system (cmd), 0);
  f.opts.format = BCF_FORMAT_AUTO;
  fixture_open (&f);
  rng_state = seed + 2;
  fill (data, 8192);
  ck_assert_int_eq (bcf_insert (f.c, 40960, 8192, data, false, true), 0);
  fixture_close (&f);
  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  struct bcf_extent e[2];
  unsigned n;
  ck_assert_int_eq (bcf_lookup (f.c, 40960, 8192, e, 2, &n), 0);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
  fixture_close (&f);
  snprintf (cmd, sizeof cmd, "%s %s | grep -q '^sb.version.*3'",
            BCACHE_SUPER_SHOW, f.path);
  ck_assert_int_eq (system (cmd), 0);
  free (data);
  fixture_free (&f);
}
END_TEST

/* Once the cache has failed (here: it was given up and the device refused
 * the mark), a durable invalidation still succeeds where the journal
 * entries it must wait for were written before the failure: the leaf's
 * jseq names a durable entry.  It fails only where it needs the journal
 * now.  (With flush_seq checking the failure before durability, any leaf
 * that had ever held a journalled key failed, and with it most writes
 * through the filter while the device refused writes.) */
START_TEST (test_invalidate_after_failure)
{
  struct fixture f;
  struct bcf_io_faults refuse = { .fail_every = 1, .fail_writes_only = true };
  uint8_t *data = calloc (1, 4096);

  fixture_init (&f, "failed.img", 16 << 20, 32 << 20, 256);
  fixture_open (&f);
  ck_assert_int_eq (bcf_insert (f.c, 0, 4096, data, false, true), 0);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  bcf_io_set_faults (bcf_cache_test_io (f.c), &refuse);
  ck_assert_int_lt (bcf_cache_abandon (f.c), 0);
  /* Same leaf, nothing cached there, its journalled key durable. */
  ck_assert_int_eq (bcf_invalidate (f.c, 8 << 20, 65536, true), 0);
  /* The cached block needs a journal write that cannot happen. */
  ck_assert_int_eq (bcf_invalidate (f.c, 0, 4096, true), -EIO);
  bcf_io_set_faults (bcf_cache_test_io (f.c), NULL);
  free (data);
  fixture_free (&f);
}
END_TEST

/* A cache given up (bcf_cache_abandon) starts empty at the next open
 * (first registration), and stays empty at the one after: the old
 * incarnation's journal entries, newer than the new one's first, must not
 * be read as the newest (they would bring the old tree back: data older
 * than the export).  Its set uuid changes, so their magic no longer
 * matches, as a make-bcache device's never would. */
START_TEST (test_abandon_then_reuse)
{
  struct fixture f;
  struct bcf_extent e[4];
  unsigned n;
  uint8_t *data = calloc (1, 4096);
  uint8_t set[16];

  fixture_init (&f, "abandon.img", 16 << 20, 64 << 20, 256);
  fixture_open (&f);
  memcpy (set, bcf_cache_super (f.c)->set_uuid, 16);
  /* Journal entries over several journal buckets (128 KiB each). */
  for (unsigned i = 0; i < 120; i++)
    ck_assert_int_eq (bcf_insert (f.c, (uint64_t) i * 65536, 4096, data,
                                  false, true), 0);
  ck_assert_int_eq (bcf_cache_abandon (f.c), 0);
  fixture_close (&f);
  for (int open = 0; open < 2; open++) {
    fixture_open (&f);
    for (unsigned i = 0; i < 120; i++) {
      ck_assert_int_eq (bcf_lookup (f.c, (uint64_t) i * 65536, 4096, e, 4,
                                    &n), 0);
      ck_assert_msg (n == 1 && e[0].kind == BCF_EXTENT_MISS, "open %d: "
                     "block %u of the abandoned cache is a hit", open, i);
    }
    ck_assert_msg (memcmp (bcf_cache_super (f.c)->set_uuid, set, 16) != 0,
                   "open %d: an abandoned cache kept its set uuid", open);
    fixture_close (&f);
  }
  free (data);
  fixture_free (&f);
}
END_TEST

/* The superblock on disk, as the device probe decodes it. */
static void
read_disk_super (const char *path, struct bch_sb *sb)
{
  struct bcf_probe_opts o = { .direct_off = true };
  struct bcf_device_verdict v;
  char err[256];

  ck_assert_int_eq (bcf_device_probe (path, &o, &v, err, sizeof err), 0);
  ck_assert_int_eq (v.kind, BCF_DEVICE_CACHE);
  *sb = v.sb;
}

static bool
disk_intent_bit (const char *path, uint64_t *version)
{
  struct bch_sb sb;

  read_disk_super (path, &sb);
  *version = sb.version;
  return sb.feature_incompat & BCF_FEATURE_INCOMPAT_WRITE_INTENT;
}

/* While a write-intent mark may be on disk, the superblock carries the
 * incompatible feature bit a kernel refuses (intent.c): set before the
 * first mark, cleared once the marks are cleared durably (the journal
 * thread's quiet tick, a clean close), or by the open that recovered the
 * marks a crash left.  Without it a kernel registered a crashed cache
 * and served clean data older than the backing store (the kernel test's
 * crash case). */
START_TEST (test_intent_feature_bit)
{
  struct fixture f;
  struct bcf_write w;
  uint64_t version;
  uint8_t *data = calloc (1, 65536);

  fixture_init (&f, "intentbit.img", 16 << 20, 64 << 20, 256);
  f.opts.direct_off = true;             /* the crash model works on files */
  fixture_open (&f);
  ck_assert (!disk_intent_bit (f.path, &version));
  ck_assert_uint_eq (version, BCACHE_SB_VERSION_CDEV_WITH_UUID);

  for (int round = 0; round < 2; round++) {
    struct bcf_cache_stats st0, st;

    /* Cached data, then a write over it: ordered, so it marks.  (The
     * clean copy the last round left comes back dirty until a checkpoint
     * writes it, and over that the mark does not stand in.) */
    ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
    ck_assert_int_eq (bcf_insert (f.c, 0, 65536, data, false, true), 0);
    memset (data, 0x11 + round, 65536);
    bcf_cache_stats (f.c, &st0);
    ck_assert_int_eq (bcf_write_begin (f.c, 0, 65536, data, &w), 0);
    ck_assert (w.intent);
    bcf_cache_stats (f.c, &st);
    ck_assert_uint_eq (st.intent_mark.count, st0.intent_mark.count + 1);
    ck_assert_uint_eq (st.cache_write.count, st0.cache_write.count + 1);
    ck_assert_msg (disk_intent_bit (f.path, &version),
                   "round %d: a region is marked, the superblock on disk "
                   "has no write-intent bit", round);
    ck_assert_uint_eq (version, BCACHE_SB_VERSION_CDEV_WITH_FEATURES);
    ck_assert_int_eq (bcf_write_mark_clean (f.c, &w), 65536);
    bcf_write_release (f.c, &w);
    /* The journal thread's tick, after quiet_ns without writes, once a
     * checkpoint begun since the write has committed. */
    intent_tick (f.c, 0);
    ck_assert_uint_eq (intent_marked (f.c), 1);
    ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
    intent_tick (f.c, 0);
    ck_assert_uint_eq (intent_marked (f.c), 0);
    ck_assert_msg (!disk_intent_bit (f.path, &version),
                   "round %d: no region is marked, the bit is still set",
                   round);
    ck_assert_uint_eq (version, BCACHE_SB_VERSION_CDEV_WITH_UUID);
  }

  /* A crash with a region marked: the bit survives it, the next open
   * recovers the marks and clears it. */
  ck_assert_int_eq (bcf_insert (f.c, 1 << 20, 65536, data, false, true), 0);
  ck_assert_int_eq (bcf_write_begin (f.c, 1 << 20, 65536, data, &w), 0);
  ck_assert (w.intent);
  ck_assert_int_eq (bcf_write_mark_clean (f.c, &w), 65536);
  bcf_write_release (f.c, &w);
  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_KEEP_ALL);
  f.c = NULL;
  ck_assert (disk_intent_bit (f.path, &version));
  fixture_open (&f);
  ck_assert_msg (!disk_intent_bit (f.path, &version),
                 "the open that recovered the marks left the bit set");
  ck_assert (!(bcf_cache_super (f.c)->feature_incompat &
               BCF_FEATURE_INCOMPAT_WRITE_INTENT));
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_close (&f);
  ck_assert (!disk_intent_bit (f.path, &version));
  free (data);
  fixture_free (&f);
}
END_TEST

struct mark_call {
  struct bcf_cache *c;
  const uint8_t *data;
  atomic_bool done;
  int rc;
  bool intent;
};

static void *
mark_call (void *arg)
{
  struct mark_call *m = arg;
  struct bcf_write w;

  m->rc = bcf_write_begin (m->c, 0, 65536, m->data, &w);
  if (m->rc == 0) {
    m->intent = w.intent;
    bcf_write_release (m->c, &w);
  }
  atomic_store (&m->done, true);
  return NULL;
}

/* The write-intent bit's superblock write must not wait for a
 * checkpoint: every write into an unmarked region waits for the bit, and
 * a checkpoint holds ckpt_lock across its node writes (up to 608 ms in
 * bench/gc-stall.sh at 1M keys, where writes took up to 100 ms when a
 * run began with every region unmarked).  The test holds ckpt_lock as a
 * checkpoint in its I/O would, and a write over cached data needs the
 * bit: it must get its mark meanwhile. */
START_TEST (test_intent_bit_not_behind_checkpoint)
{
  struct fixture f;
  struct mark_call m = { 0 };
  uint8_t *data = calloc (1, 65536);
  uint64_t version;
  pthread_t t;
  bool done = false;

  fixture_init (&f, "intentckpt.img", 16 << 20, 64 << 20, 256);
  fixture_open (&f);
  ck_assert_int_eq (bcf_insert (f.c, 0, 65536, data, false, true), 0);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  ck_assert (!disk_intent_bit (f.path, &version));
  memset (data, 0x5c, 65536);
  m = (struct mark_call) { .c = f.c, .data = data };

  pthread_mutex_lock (&f.c->ckpt_lock);          /* a checkpoint's I/O */
  ck_assert_int_eq (pthread_create (&t, NULL, mark_call, &m), 0);
  for (unsigned i = 0; i < 1000 && !done; i++) {
    done = atomic_load (&m.done);
    if (!done)
      usleep (10000);
  }
  pthread_mutex_unlock (&f.c->ckpt_lock);
  pthread_join (t, NULL);
  ck_assert_msg (done, "a write into an unmarked region waited for a "
                 "checkpoint in progress (the write-intent bit's "
                 "superblock write takes ckpt_lock)");
  ck_assert_int_eq (m.rc, 0);
  ck_assert (m.intent);
  ck_assert (disk_intent_bit (f.path, &version));
  free (data);
  fixture_free (&f);
}
END_TEST

/* After the open that followed the crash of intent_fill_setup's cache:
 * every one of the nkeys clean blocks of the marked region is gone. */
static void
check_region_dropped (struct fixture *f, uint64_t nkeys)
{
  struct bcf_cache_stats st;
  struct bcf_extent e;
  unsigned got;

  bcf_cache_stats (f->c, &st);
  ck_assert_msg (st.intent_dropped >= nkeys, "the open dropped %" PRIu64
                 " clean extents of the marked region, not %" PRIu64,
                 st.intent_dropped, nkeys);
  for (uint64_t i = 1; i <= nkeys; i++) {
    ck_assert_int_eq (bcf_lookup (f->c, 2 * i * BLOCK, BLOCK, &e, 1, &got),
                      0);
    ck_assert_msg (got == 1 && e.kind == BCF_EXTENT_MISS, "block %" PRIu64
                   " of the marked region is still cached after the crash",
                   2 * i);
  }
}

/* The cache of the write-intent recovery tests, up to the crash:
 * nkeys clean blocks of region 0 (every other block: no neighbours, one
 * key each), committed; region 0 marked by a write over cached data;
 * then `entries` journal entries (durable inserts in region 1), or with
 * entries 0 as many as it takes for the journal to count as tight,
 * their number in *tight_at.  evict: a node cache so small that every
 * clean leaf is evicted (the clean keys span several leaves). */
static void
intent_fill_setup (struct fixture *f, uint64_t nkeys, uint64_t entries,
                   uint64_t *tight_at, bool evict)
{
  struct bcf_write w;
  struct bcf_cache_stats st;
  uint8_t *data = calloc (1, BLOCK);
  const uint64_t far = 16 << 20;
  uint64_t n = 0;

  fixture_init (f, "intent-fill.img", 32 << 20, 8 << 20, 16);
  f->opts.direct_off = true;            /* the crash model works on files */
  if (evict)
    f->opts.node_cache_bytes = 1;
  fixture_open (f);
  for (uint64_t i = 1; i <= nkeys; i++)
    ck_assert_int_eq (bcf_insert (f->c, 2 * i * BLOCK, BLOCK, data, false,
                                  false), 0);
  ck_assert_int_eq (bcf_cache_checkpoint (f->c), 0);
  bcf_cache_stats (f->c, &st);
  ck_assert_uint_gt (st.btree_nodes, 3);
  /* A write over cached data: ordered, so it marks region 0. */
  ck_assert_int_eq (bcf_insert (f->c, 0, BLOCK, data, false, true), 0);
  ck_assert_int_eq (bcf_write_begin (f->c, 0, BLOCK, data, &w), 0);
  ck_assert (w.intent);
  ck_assert_int_eq (bcf_write_mark_clean (f->c, &w), BLOCK);
  bcf_write_release (f->c, &w);
  while (entries ? n < entries : !journal_tight (f->c)) {
    ck_assert_int_eq (bcf_insert (f->c, far + n * BLOCK, BLOCK, data, false,
                                  true), 0);
    ck_assert_uint_lt (++n, 4096);
  }
  if (tight_at)
    *tight_at = n;
  free (data);
}

/* Write-intent recovery must see every mark and every clean key of a
 * marked region, whether or not their leaves are in memory.  An open
 * after a crash that left the journal tight commits the replayed tree
 * first, and that checkpoint evicts clean leaves when the node cache is
 * small: recovery then found the leaf of the marks evicted, took the
 * marked region for unmarked, and kept its clean keys, which may be
 * older than the export (test-model's lru-4k case, TEST_SEED=4
 * TEST_MODEL_OPS=500000: "block 0 is a hit but must not be cached"). */
START_TEST (test_intent_recover_evicted)
{
  struct fixture f;
  struct bcf_extent e;
  const uint64_t nkeys = 1200;
  unsigned got;

  /* A journal without its reserve, so the next open checkpoints (and
   * evicts) before it recovers the marks. */
  intent_fill_setup (&f, nkeys, 0, NULL, true);
  ck_assert_uint_eq (intent_marked (f.c), 1);
  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_KEEP_ALL);
  f.c = NULL;

  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  check_region_dropped (&f, nkeys);
  /* Block 0's write is back dirty (its clean mark was not journalled),
   * and kept; no mark is left. */
  ck_assert_int_eq (bcf_lookup (f.c, 0, BLOCK, &e, 1, &got), 0);
  ck_assert (got == 1 && e.kind == BCF_EXTENT_HIT && e.dirty);
  {
    uint64_t marks[4];
    ck_assert_uint_eq (bcf_cache_intent_marks (f.c, 0, marks, 4), 0);
  }
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_free (&f);
}
END_TEST

/* Open the fixture's cache on a thread, waiting at most 60 s: an open
 * that hangs fails the test instead of hanging it. */
struct bounded_open {
  struct fixture *f;
  char err[512];
  int r;
  bool done;
  pthread_mutex_t lock;
  pthread_cond_t cond;
};

static void *
bounded_open_run (void *arg)
{
  struct bounded_open *o = arg;
  struct bcf_cache *c = NULL;
  int r = bcf_cache_open (&o->f->opts, &c, o->err, sizeof o->err);

  pthread_mutex_lock (&o->lock);
  o->f->c = c;
  o->r = r;
  o->done = true;
  pthread_cond_signal (&o->cond);
  pthread_mutex_unlock (&o->lock);
  return NULL;
}

static void
fixture_open_bounded (struct fixture *f, const char *what)
{
  static struct bounded_open o;     /* a hung thread may still use it */
  struct timespec deadline;
  pthread_t t;

  memset (&o, 0, sizeof o);
  o.f = f;
  pthread_mutex_init (&o.lock, NULL);
  pthread_cond_init (&o.cond, NULL);
  ck_assert_int_eq (pthread_create (&t, NULL, bounded_open_run, &o), 0);
  clock_gettime (CLOCK_REALTIME, &deadline);
  deadline.tv_sec += 60;
  pthread_mutex_lock (&o.lock);
  while (!o.done &&
         pthread_cond_timedwait (&o.cond, &o.lock, &deadline) != ETIMEDOUT)
    ;
  ck_assert_msg (o.done, "%s: the open did not return within 60 s", what);
  pthread_mutex_unlock (&o.lock);
  pthread_join (t, NULL);
  ck_assert_msg (o.r == 0, "%s: bcf_cache_open: %s (%s)", what, o.err,
                 strerror (-o.r));
}

/* Write-intent recovery at open drops the clean keys of each marked
 * region with a journalled whiteout each; the open holds ckpt_lock the
 * whole time.  When those whiteouts fill the journal (a small cache,
 * many clean keys in a marked region, a journal not tight enough for
 * the open to have committed the replayed tree first), making room
 * needs a checkpoint: it took ckpt_lock again and the open hung for
 * ever (the kill -9 soak, TEST_SEED=49365, round 8: no control socket,
 * every connection reset). */
START_TEST (test_intent_recover_fills_journal)
{
  struct fixture f;
  const uint64_t nkeys = 1200;
  uint64_t tight_at;

  /* How many entries make the journal tight; then one fewer, so that
   * the open does not commit the replayed tree before the recovery, and
   * the recovery's whiteouts find the journal nearly full. */
  intent_fill_setup (&f, nkeys, 0, &tight_at, false);
  fixture_free (&f);
  ck_assert_uint_gt (tight_at, 1);
  intent_fill_setup (&f, nkeys, tight_at - 1, NULL, false);
  ck_assert (!journal_tight (f.c));
  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_KEEP_ALL);
  f.c = NULL;

  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open_bounded (&f, "reopen after the crash");
  check_region_dropped (&f, nkeys);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_free (&f);
}
END_TEST

/* journal_preflush times the flush a journal write makes before an
 * entry that follows data (part of journal_write), prio_write each write
 * of the prio buckets: the open writes one, a durable dirty insert makes
 * a journal write with a preflush, and a prio write counts once. */
START_TEST (test_preflush_and_prio_time_stats)
{
  struct fixture f;
  struct bcf_cache_stats st0, st;
  uint8_t *data = calloc (1, BLOCK);

  fixture_init (&f, "tstats.img", 16 << 20, 16 << 20, 256);
  fixture_open (&f);
  bcf_cache_stats (f.c, &st0);
  ck_assert_uint_ge (st0.prio_write.count, 1);
  ck_assert_uint_le (st0.journal_preflush.count, st0.journal_write.count);

  ck_assert_int_eq (bcf_insert (f.c, 0, BLOCK, data, true, true), 0);
  ck_assert_int_eq (bcf_flush (f.c), 0);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.journal_write.count, st0.journal_write.count + 1);
  ck_assert_uint_eq (st.journal_preflush.count,
                     st0.journal_preflush.count + 1);
  ck_assert_uint_le (st.journal_preflush.max_ns, st.journal_write.max_ns);

  ck_assert_int_eq (alloc_prio_write (f.c), 0);
  bcf_cache_stats (f.c, &st0);
  ck_assert_uint_eq (st0.prio_write.count, st.prio_write.count + 1);
  /* The prio write's own journal entry (metadata: a preflush too). */
  ck_assert_uint_gt (st0.journal_preflush.count, st.journal_preflush.count);
  fixture_free (&f);
  free (data);
}
END_TEST

/* A thread that takes the index lock through the engine (test_lock_waits
 * _timed): a lookup, or an invalidation (a whiteout's insert). */
struct lock_waiter {
  struct fixture *f;
  bool lookup;
  _Atomic pid_t tid;
  int r;
};

static void *
lock_waiter_thread (void *arg)
{
  struct lock_waiter *w = arg;
  struct bcf_extent e;
  unsigned n;

  atomic_store (&w->tid, gettid ());
  w->r = w->lookup ? bcf_lookup (w->f->c, 0, BLOCK, &e, 1, &n)
                   : bcf_invalidate (w->f->c, 0, BLOCK, false);
  return NULL;
}

/* Wait (up to 10 s) until thread tid sleeps in futex(2): with the index
 * lock held by the test and no other lock held, it waits for that lock. */
static bool
blocked_in_futex (pid_t tid)
{
  char path[64], line[64];

  snprintf (path, sizeof path, "/proc/self/task/%d/syscall", (int) tid);
  for (unsigned i = 0; i < 10000; i++) {
    FILE *fp = fopen (path, "r");
    bool in = false;

    if (fp) {
      in = fgets (line, sizeof line, fp) && atoi (line) == SYS_futex;
      fclose (fp);
    }
    if (in)
      return true;
    usleep (1000);
  }
  return false;
}

/* Run a lock_waiter against the index lock held by the test (for
 * writing if w->lookup, else for reading), and let it go once it waits. */
static void
make_wait (struct fixture *f, bool lookup)
{
  struct lock_waiter w = { .f = f, .lookup = lookup };
  pthread_t t;

  if (lookup)
    pthread_rwlock_wrlock (&f->c->tree_lock);
  else
    pthread_rwlock_rdlock (&f->c->tree_lock);
  ck_assert_int_eq (pthread_create (&t, NULL, lock_waiter_thread, &w), 0);
  while (atomic_load (&w.tid) == 0)
    usleep (1000);
  ck_assert_msg (blocked_in_futex (atomic_load (&w.tid)),
                 "the %s never waited for the index lock",
                 lookup ? "lookup" : "invalidation");
  pthread_rwlock_unlock (&f->c->tree_lock);
  pthread_join (t, NULL);
  ck_assert_int_eq (w.r, 0);
}

/* The index lock's waits are timed: a lookup that found it held for
 * writing (lookup_lock_wait), and a writer that found it held at all
 * (update_lock_wait: the rwlock prefers readers, so lookups can keep an
 * insert waiting).  Without the timing in tree_wrlock, update_lock_wait
 * stays 0. */
START_TEST (test_lock_waits_timed)
{
  struct fixture f;
  struct bcf_cache_stats st0, st;
  uint8_t *data = calloc (1, BLOCK);

  fixture_init (&f, "lockwait.img", 16 << 20, 16 << 20, 256);
  fixture_open (&f);
  /* Something to invalidate: an empty range needs no whiteout. */
  ck_assert_int_eq (bcf_insert (f.c, 0, BLOCK, data, false, false), 0);
  bcf_cache_stats (f.c, &st0);
  make_wait (&f, false);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_gt (st.update_lock_wait.count, st0.update_lock_wait.count);
  ck_assert_uint_gt (st.update_lock_wait.max_ns, 0);
  make_wait (&f, true);
  bcf_cache_stats (f.c, &st0);
  ck_assert_uint_eq (st0.lookup_lock_wait.count,
                     st.lookup_lock_wait.count + 1);
  fixture_free (&f);
  free (data);
}
END_TEST

/* A checkpoint may move nearly every leaf at once: after a crash,
 * write-intent recovery drops the clean keys of the marked regions with
 * a whiteout each, and a leaf whose log cannot take its whiteouts moves
 * to a new bucket.  The checkpoint asked for (leaves that move) x
 * (levels) free buckets, more than the free lists ever hold once a third
 * of the leaves move in a three-level tree: the open failed with "No
 * space left on device", and so did every open after it, on a cache full
 * of clean data (a 5M-key cache killed under gc-stall's load: 1,128
 * leaves, 3,385 buckets asked of free lists of 1,541).  Here: 4 KiB
 * buckets (nodes of at most ~130 keys, so three levels), 512-byte keys
 * inserted in random order (leaves ~70% full, so that their whiteouts do
 * not fit), two marked regions, a journal that takes the whiteouts of
 * more leaves than a third of the free lists. */
START_TEST (test_intent_recover_moves_every_leaf)
{
  struct fixture f;
  struct bcf_cache_stats st;
  struct bcf_extent e;
  uint8_t *data = calloc (1, BLOCK);
  const uint64_t nkeys = 24000, region = 16 << 20;
  uint64_t *order = malloc (nkeys * sizeof *order);
  unsigned got;

  rng_state = seed * 29 + 11;
  fixture_init (&f, "moves.img", 64 << 20, 64 << 20, 8);
  f.opts.block_sectors = 1;
  f.opts.direct_off = true;             /* the crash model works on files */
  fixture_open (&f);
  for (uint64_t i = 0; i < nkeys; i++)
    order[i] = i;
  for (uint64_t i = nkeys - 1; i > 0; i--) {
    uint64_t j = rnd_below (i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (uint64_t i = 0; i < nkeys; i++) {     /* every other sector */
    int r = bcf_insert (f.c, (2 * order[i] + 1) * 512, 512, data, false,
                        false);
    check_msg (r == 0, "bcf_insert of key %" PRIu64 ": %s", i,
               strerror (-r));
  }
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_ge (st.btree_depth, 3);
  ck_assert_uint_gt (st.btree_nodes * 3,
                     f.c->alloc.free[RESERVE_NONE].size +
                     f.c->alloc.free[RESERVE_BTREE].size);
  /* Writes over cached data mark both regions. */
  for (uint64_t off = 0; off < 2 * region; off += region) {
    struct bcf_write w;

    ck_assert_int_eq (bcf_insert (f.c, off, 512, data, false, true), 0);
    ck_assert_int_eq (bcf_write_begin (f.c, off, 512, data, &w), 0);
    ck_assert (w.intent);
    ck_assert_int_eq (bcf_write_mark_clean (f.c, &w), 512);
    bcf_write_release (f.c, &w);
  }
  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_KEEP_ALL);
  f.c = NULL;

  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open_bounded (&f, "reopen after the crash");
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_ge (st.intent_dropped, nkeys);
  ck_assert_int_eq (bcf_lookup (f.c, 512, 512, &e, 1, &got), 0);
  ck_assert (got == 1 && e.kind == BCF_EXTENT_MISS);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_close (&f);
  fixture_open_bounded (&f, "the open after");
  fixture_free (&f);
  free (order);
  free (data);
}
END_TEST

/* A dirty write that finds no room changes nothing (bcf_write_begin
 * drops no older dirty data: the request path writes it back first), and
 * the invalidation that follows must be durable to survive a crash:
 * where the range holds a key a crash brings back, here a durable dirty
 * insert made after the last checkpoint, a whiteout still in the open
 * journal entry is lost with the power, and recovery replays the old
 * dirty key (which it would then write back over the newer data the
 * backing store got).  request.c invalidates that range durably
 * (invalidate_durably); test-model's dirty write did not, and
 * TEST_SEED=1796483540 found a crash episode ending in such a write. */
START_TEST (test_nospace_write_invalidates_durably)
{
  struct fixture f;
  struct bcf_io_faults armed = { 0 };
  struct bcf_write w;
  struct bcf_extent e;
  uint8_t *old = malloc (16 * BLOCK), *new = malloc (16 * BLOCK);
  uint8_t *back = malloc (BLOCK);
  uint64_t blk = 16;
  unsigned got;
  int r;

  ck_assert (old && new && back);
  memset (old, 0x0d, 16 * BLOCK);
  memset (new, 0x2e, 16 * BLOCK);
  fixture_init (&f, "nospace.img", 32 << 20, 4 << 20, 32);
  f.opts.write_intent_off = true;       /* no mark drops anything */
  fixture_open (&f);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  /* From here the device has a volatile write cache (io.h). */
  bcf_io_set_faults (bcf_cache_test_io (f.c), &armed);
  ck_assert_int_eq (bcf_insert (f.c, 0, BLOCK, old, true, true), 0);
  /* Fill the cache with dirty data, which nothing may reclaim: in
   * pieces of 16 blocks, then single blocks for the space left. */
  for (unsigned n = 16; n > 0; n = n > 1 ? 1 : 0) {
    while ((r = bcf_insert (f.c, blk * BLOCK, n * BLOCK, old, true,
                            false)) == 0) {
      blk += n;
      ck_assert_uint_lt (blk, (32 << 20) / BLOCK);
    }
    ck_assert_int_eq (r, -ENOSPC);
  }
  ck_assert_int_eq (bcf_write_begin (f.c, 0, BLOCK, new, &w), -ENOSPC);
  /* Nothing dropped: the old dirty data is still there. */
  ck_assert_int_eq (bcf_lookup (f.c, 0, BLOCK, &e, 1, &got), 0);
  ck_assert (got == 1 && e.kind == BCF_EXTENT_HIT && e.dirty);
  ck_assert_int_eq (bcf_read_hit (f.c, &e, back), 0);
  ck_assert (memcmp (back, old, BLOCK) == 0);
  /* The caller wrote it back (not modelled here), then: */
  ck_assert_int_eq (bcf_invalidate (f.c, 0, BLOCK, true), 0);
  ck_assert_int_eq (bcf_lookup (f.c, 0, BLOCK, &e, 1, &got), 0);
  ck_assert (got == 1 && e.kind == BCF_EXTENT_MISS);

  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_LOSE_ALL);
  f.c = NULL;
  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  ck_assert_int_eq (bcf_lookup (f.c, 0, BLOCK, &e, 1, &got), 0);
  ck_assert_msg (got == 1 && e.kind == BCF_EXTENT_MISS,
                 "the invalidated block came back after the crash (%s)",
                 e.dirty ? "dirty" : "clean");
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  free (old);
  free (new);
  free (back);
  fixture_free (&f);
}
END_TEST

/* A crash in the middle of a checkpoint that the journal's reserve was
 * paying for: ordinary entries fill the ring up to the reserve, metadata
 * commits (a checkpoint's prio writes and sealed entry) use all of it
 * but one block, and the power goes before the commit.  A region is
 * marked, so the next open has three commits to make (its prio write,
 * the entry sealing the marks' clears, the commit of its checkpoint)
 * where there is room for one.  It must commit the replayed tree first,
 * and lose nothing (the writeback soak, TEST_SEED=40342:
 * "writing prio buckets failed: No space left on device" at every open
 * after it). */
START_TEST (test_open_after_crash_in_reserve)
{
  struct fixture f;
  struct bcf_write w;
  uint8_t *data = malloc (BLOCK), *back = malloc (BLOCK);
  struct bcf_extent e;
  uint64_t n = 1;
  unsigned got;

  fixture_init (&f, "reserve.img", 32 << 20, 4 << 20, 16);
  f.opts.direct_off = true;             /* the crash model works on files */
  fixture_open (&f);
  /* Block 0: cached, then written over: its region is marked. */
  memset (data, 0, BLOCK);
  ck_assert_int_eq (bcf_insert (f.c, 0, BLOCK, data, false, true), 0);
  ck_assert_int_eq (bcf_write_begin (f.c, 0, BLOCK, data, &w), 0);
  ck_assert (w.intent);
  ck_assert_int_eq (bcf_write_mark_clean (f.c, &w), BLOCK);
  bcf_write_release (f.c, &w);
  ck_assert_uint_eq (intent_marked (f.c), 1);
  while (!journal_tight (f.c)) {        /* an entry per durable insert */
    memset (data, (int) (n & 0xff), BLOCK);
    ck_assert_int_eq (bcf_insert (f.c, (16 << 20) + n * BLOCK, BLOCK, data,
                                  false, true), 0);
    n++;
    ck_assert_uint_lt (n, 4096);
  }
  while (journal_room (f.c, 2))
    ck_assert_int_eq (journal_meta (f.c), 0);
  /* ... and the rest of the bucket being written, and one entry of the
   * last free bucket: room for one entry of one block is left. */
  while (f.c->journal.cur_offset > 0 && f.c->journal.cur_offset < 16 * 512)
    ck_assert_int_eq (journal_meta (f.c), 0);
  ck_assert_int_eq (journal_meta (f.c), 0);
  ck_assert_uint_eq (f.c->journal.cur_offset, BLOCK);
  ck_assert (!journal_room (f.c, 1));
  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_KEEP_ALL);
  f.c = NULL;

  fixture_open (&f);
  /* Block 0's write is back dirty (its clean mark was never
   * journalled), the marks are recovered and cleared. */
  ck_assert_int_eq (bcf_lookup (f.c, 0, BLOCK, &e, 1, &got), 0);
  ck_assert (got == 1 && e.kind == BCF_EXTENT_HIT && e.dirty);
  ck_assert_uint_eq (intent_marked (f.c), 0);
  for (uint64_t i = 1; i < n; i++) {
    ck_assert_int_eq (bcf_lookup (f.c, (16 << 20) + i * BLOCK, BLOCK, &e, 1,
                                  &got), 0);
    ck_assert_msg (got == 1 && e.kind == BCF_EXTENT_HIT, "block %" PRIu64
                   " of %" PRIu64 " lost", i, n);
    ck_assert_int_eq (bcf_read_hit (f.c, &e, back), 0);
    memset (data, (int) (i & 0xff), BLOCK);
    ck_assert (memcmp (data, back, BLOCK) == 0);
  }
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_close (&f);
  free (data);
  free (back);
  fixture_free (&f);
}
END_TEST

/* The cache-miss protocol: an invalidation between begin and fill makes
 * the fill collide, and nothing is cached. */
START_TEST (test_miss_collision)
{
  struct fixture f;
  struct bcf_miss m;
  struct bcf_extent e[4];
  struct bcf_cache_stats st;
  unsigned n;
  uint8_t *data = calloc (1, 16384);

  fixture_init (&f, "collide.img", 16 << 20, 32 << 20, 256);
  fixture_open (&f);
  ck_assert_int_eq (bcf_miss_begin (f.c, 0, 16384, &m), 0);
  ck_assert_int_eq (bcf_invalidate (f.c, 4096, 4096, true), 0);
  ck_assert_int_eq (bcf_miss_fill (f.c, &m, data), -EEXIST);
  ck_assert_int_eq (bcf_lookup (f.c, 0, 16384, e, 4, &n), 0);
  ck_assert_uint_eq (n, 1);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_MISS);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.miss_collisions, 1);
  ck_assert_uint_eq (st.inserts, 0);

  /* Without interference the fill is cached, and counted as an insert. */
  ck_assert_int_eq (bcf_miss_begin (f.c, 0, 16384, &m), 0);
  ck_assert_int_eq (bcf_miss_fill (f.c, &m, data), 0);
  ck_assert_int_eq (bcf_lookup (f.c, 0, 16384, e, 4, &n), 0);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
  ck_assert_uint_eq (e[0].len, 16384);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.inserts, 1);
  free (data);
  fixture_free (&f);
}
END_TEST

/* An invalidation of a range that holds no key at all adds nothing: no
 * whiteout in the leaf's open set (it would be written at the next
 * checkpoint) and no journal entry.  Where something is cached, the
 * whiteout goes in and is journalled; where a miss is in flight, it goes
 * in and the fill collides (test_miss_collision). */
static size_t
open_keys_at (struct bcf_cache *c, uint64_t offset)
{
  struct btree_node *leaf;
  size_t n;

  pthread_rwlock_rdlock (&c->tree_lock);
  leaf = btree_find_leaf (c, c->inode, (offset >> 9) + 1);
  ck_assert_ptr_nonnull (leaf);
  n = leaf->open.nr;
  pthread_rwlock_unlock (&c->tree_lock);
  return n;
}

START_TEST (test_invalidate_empty)
{
  struct fixture f;
  struct bcf_cache_stats st;
  uint64_t writes;
  size_t open;
  uint8_t *data = calloc (1, 4096);

  fixture_init (&f, "inval.img", 16 << 20, 32 << 20, 256);
  fixture_open (&f);
  ck_assert_int_eq (bcf_insert (f.c, 0, 4096, data, false, true), 0);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  ck_assert (!alloc_gens_unpersisted (f.c));
  bcf_cache_stats (f.c, &st);
  writes = st.journal_writes;
  open = open_keys_at (f.c, 8 << 20);

  ck_assert_int_eq (bcf_invalidate (f.c, 8 << 20, 65536, true), 0);
  bcf_cache_stats (f.c, &st);
  ck_assert_msg (open_keys_at (f.c, 8 << 20) == open,
                 "a whiteout over a range with no key went into the open set");
  ck_assert_uint_eq (st.journal_writes, writes);

  ck_assert_int_eq (bcf_invalidate (f.c, 0, 4096, true), 0);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_gt (open_keys_at (f.c, 0), 0);
  ck_assert_uint_gt (st.journal_writes, writes);
  free (data);
  fixture_free (&f);
}
END_TEST

/* A write's keys are dirty until its backing write is done, then marked
 * clean (not journalled).  A clean close must keep them clean: the
 * checkpoint that captures the clean copies commits in an entry after
 * the one holding the dirty keys, so the next open does not replay them
 * over their clean copies (which made every restart write the data back
 * again, and refused a backing device: "the cache holds dirty data").
 * Both with the dirty keys' entry still open at the close and after it
 * was written. */
START_TEST (test_clean_close_keeps_clean_marks)
{
  struct fixture f;
  struct bcf_extent e[4];
  unsigned n;
  uint8_t *data = calloc (1, 65536);

  fixture_init (&f, "marks.img", 16 << 20, 64 << 20, 256);
  f.opts.write_intent_off = _i == 1;    /* the entry written at once */
  fixture_open (&f);
  for (int round = 0; round < 2; round++) {
    struct bcf_write w;
    uint64_t off = (uint64_t) round << 20;

    memset (data, 0x40 + round, 65536);
    ck_assert_int_eq (bcf_write_begin (f.c, off, 65536, data, &w), 0);
    if (_i == 1)
      ck_assert_int_eq (bcf_write_durable (f.c, &w), 0);
    ck_assert_int_eq (bcf_write_mark_clean (f.c, &w), 65536);
    bcf_write_release (f.c, &w);
    ck_assert_uint_eq (bcf_cache_dirty_bytes (f.c), 0);
    fixture_close (&f);
    fixture_open (&f);
    ck_assert_msg (bcf_cache_dirty_bytes (f.c) == 0, "round %d: %" PRIu64
                   " bytes dirty again after a clean close and open", round,
                   bcf_cache_dirty_bytes (f.c));
    ck_assert_int_eq (bcf_lookup (f.c, off, 65536, e, 4, &n), 0);
    ck_assert_uint_eq (n, 1);
    ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
    ck_assert (!e[0].dirty);
  }
  free (data);
  fixture_free (&f);
}
END_TEST

/* The strict model phase: no eviction, so the cached map is exact.  With
 * node_cache_bytes small, clean leaves are dropped from memory at every
 * checkpoint and read back on use, and the map must not change.  20000
 * operations by default: the long random run is test-model's (2M
 * operations with eviction); this one keeps the exact-map check. */
static void
model_run (size_t node_cache_bytes)
{
  const uint64_t backing = 16 << 20, nblocks = backing / BLOCK;
  const uint64_t ops = getenv ("TEST_MODEL_OPS")
                       ? strtoull (getenv ("TEST_MODEL_OPS"), NULL, 0) : 20000;
  struct fixture f;
  uint8_t *shadow = calloc (1, backing), *buf = malloc (64 * BLOCK);
  bool *cached = calloc (nblocks, sizeof *cached);
  struct bcf_backing b;
  uint64_t reopen = 0, checked = 0;

  rng_state = seed * 0x9E3779B97F4A7C15ull + 3;
  /* 512 MiB of cache in 16 KiB buckets: the test never fills it, so
   * nothing is evicted and the expected map is exact.  Small buckets mean
   * 16 KiB nodes of about 500 keys, so splits, relocations and a btree of
   * several levels happen. */
  fixture_init (&f, "model.img", backing, 512ull << 20, 32);
  f.opts.node_cache_bytes = node_cache_bytes;
  b = mem_backing_get (f.mb);
  fixture_open (&f);

  for (uint64_t op = 0; op < ops; op++) {
    uint64_t blk = rnd_below (nblocks), nb = 1 + rnd_below (rnd_below (4) ? 4 : 64);
    uint64_t what = rnd_below (100);

    if (blk + nb > nblocks)
      nb = nblocks - blk;
    if (what < 35) {                   /* writethrough write */
      fill (buf, nb * BLOCK);
      ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, (uint32_t) (nb * BLOCK),
                                       blk * BLOCK, false), 0);
      memcpy (shadow + blk * BLOCK, buf, nb * BLOCK);
      int r = bcf_insert (f.c, blk * BLOCK, nb * BLOCK, buf, false,
                          rnd_below (10) == 0);
      ck_assert_msg (r == 0, "insert: %s", strerror (-r));
      for (uint64_t i = 0; i < nb; i++)
        cached[blk + i] = true;
    }
    else if (what < 50) {              /* bypass write */
      ck_assert_int_eq (bcf_invalidate (f.c, blk * BLOCK, nb * BLOCK, true), 0);
      fill (buf, nb * BLOCK);
      ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, (uint32_t) (nb * BLOCK),
                                       blk * BLOCK, false), 0);
      memcpy (shadow + blk * BLOCK, buf, nb * BLOCK);
      for (uint64_t i = 0; i < nb; i++)
        cached[blk + i] = false;
    }
    else if (what < 90) {              /* read, filling misses */
      cached_read (&f, shadow, blk * BLOCK, nb * BLOCK, true, op);
      for (uint64_t i = 0; i < nb; i++)
        cached[blk + i] = true;
    }
    else if (what < 95)
      ck_assert_int_eq (bcf_flush (f.c), 0);
    else if (what < 97)
      ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
    else if (what < 98)
      ck_assert_int_eq (bcf_gc_run (f.c), 0);
    else if (rnd_below (20) == 0) {    /* clean close and reopen */
      fixture_close (&f);
      f.opts.format = BCF_FORMAT_NEVER;
      fixture_open (&f);
      reopen++;
    }

    /* Every so often compare the whole cached map. */
    if (op % 5000 == 4999 || op == ops - 1) {
      for (uint64_t blk2 = 0; blk2 < nblocks; blk2 += 256) {
        struct bcf_extent e[300];
        unsigned n;
        ck_assert_int_eq (bcf_lookup (f.c, blk2 * BLOCK, 256 * BLOCK, e, 300,
                                      &n), 0);
        for (unsigned i = 0; i < n; i++)
          for (uint64_t x = e[i].offset / BLOCK;
               x < (e[i].offset + e[i].len) / BLOCK; x++)
            ck_assert_msg ((e[i].kind == BCF_EXTENT_HIT) == cached[x],
                           "seed %u op %" PRIu64 ": block %" PRIu64
                           " is %s, the model says %s", seed, op, x,
                           e[i].kind == BCF_EXTENT_HIT ? "cached" : "not cached",
                           cached[x] ? "cached" : "not cached");
        checked++;
      }
      cached_read (&f, shadow, 0, 64 * BLOCK, false, op);
    }
  }
  struct bcf_cache_stats st;
  bcf_cache_stats (f.c, &st);
  printf ("test-engine: model: %" PRIu64 " ops, %" PRIu64 " reopens, %"
          PRIu64 " keys, %" PRIu64 " nodes, depth %" PRIu64 ", %" PRIu64
          " splits, %" PRIu64 " checkpoints\n", ops, reopen, st.btree_keys,
          st.btree_nodes, st.btree_depth, st.btree_split.count,
          st.checkpoint.count);
  ck_assert_uint_gt (st.btree_depth, 1);
  if (node_cache_bytes) {
    printf ("test-engine: model with a %zu-byte node cache: %" PRIu64
            " evictions, %" PRIu64 " reloads since the last open\n",
            node_cache_bytes, st.btree_evictions, st.btree_loads);
    ck_assert_uint_gt (st.btree_evictions, 0);
  }
  fixture_free (&f);
  free (shadow);
  free (buf);
  free (cached);
}

START_TEST (test_model_random)
{
  model_run (0);
}
END_TEST

START_TEST (test_model_small_node_cache)
{
  model_run (16384);
}
END_TEST

/* Eviction phase: a small cache under a large working set.  Only
 * correctness is checked (every hit equals the backing store). */
START_TEST (test_model_eviction)
{
  const uint64_t backing = 64 << 20, nblocks = backing / BLOCK;
  const uint64_t ops = 30000;
  struct fixture f;
  uint8_t *shadow = calloc (1, backing), *buf = malloc (64 * BLOCK);
  struct bcf_backing b;
  struct bcf_cache_stats st;

  rng_state = seed * 0x9E3779B97F4A7C15ull + 5;
  fixture_init (&f, "evict.img", backing, 16 << 20, 128);
  b = mem_backing_get (f.mb);
  fixture_open (&f);
  for (uint64_t op = 0; op < ops; op++) {
    uint64_t blk = rnd_below (nblocks), nb = 1 + rnd_below (16);
    if (blk + nb > nblocks)
      nb = nblocks - blk;
    if (rnd_below (3) == 0) {
      fill (buf, nb * BLOCK);
      ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, (uint32_t) (nb * BLOCK),
                                       blk * BLOCK, false), 0);
      memcpy (shadow + blk * BLOCK, buf, nb * BLOCK);
      int r = bcf_insert (f.c, blk * BLOCK, nb * BLOCK, buf, false, false);
      ck_assert_msg (r == 0 || r == -ENOSPC, "insert: %s", strerror (-r));
    }
    else
      cached_read (&f, shadow, blk * BLOCK, nb * BLOCK, true, op);
    if (op % 3000 == 2999)
      ck_assert_int_eq (bcf_gc_run (f.c), 0);
    if (op % 10000 == 9999) {
      fixture_close (&f);
      f.opts.format = BCF_FORMAT_NEVER;
      fixture_open (&f);
    }
  }
  bcf_cache_stats (f.c, &st);
  printf ("test-engine: eviction: %" PRIu64 " ops, %" PRIu64 " gc passes, "
          "%" PRIu64 " free buckets of %" PRIu64 "\n", ops, st.gc_passes,
          st.buckets_free, st.nbuckets);
  fixture_free (&f);
  free (shadow);
  free (buf);
}
END_TEST


/* GC does not block allocation: a GC pass paused half way (between two
 * slices, by a test hook) while foreground writes need more buckets than
 * the free lists hold; they must succeed (the allocator keeps
 * invalidating with the marks of the previous pass), and no bucket that
 * holds live data may be reused (every hit still equals the backing
 * store, before and after the pass completes). */
struct gc_pause {
  pthread_mutex_t lock;
  pthread_cond_t cv;
  unsigned at;
  bool paused, release;
};

static void
gc_pause_hook (struct bcf_cache *c, unsigned slice, void *opaque)
{
  struct gc_pause *p = opaque;

  if (slice != p->at)
    return;
  pthread_mutex_lock (&p->lock);
  p->paused = true;
  pthread_cond_broadcast (&p->cv);
  while (!p->release)
    pthread_cond_wait (&p->cv, &p->lock);
  pthread_mutex_unlock (&p->lock);
}

static void *
gc_runner (void *arg)
{
  return (void *) (intptr_t) bcf_gc_run (arg);
}

static void
verify_all_hits (struct fixture *f, const uint8_t *shadow, uint64_t bytes)
{
  for (uint64_t off = 0; off < bytes; off += 256 * BLOCK)
    cached_read (f, shadow, off, 256 * BLOCK, false, 0);
}

START_TEST (test_gc_does_not_block_alloc)
{
  const uint64_t backing = 64 << 20, nblocks = backing / BLOCK;
  struct fixture f;
  struct bcf_backing b;
  struct gc_pause p = { .at = 0 };
  uint8_t *shadow = calloc (1, backing), *buf = malloc (BLOCK);
  uint64_t prio_seq0, written = 0, need;
  struct bcf_cache_stats st;
  pthread_t th;
  void *ret;

  pthread_mutex_init (&p.lock, NULL);
  pthread_cond_init (&p.cv, NULL);
  rng_state = seed * 31 + 7;
  /* 16 MiB of cache in 16 KiB buckets (1024 buckets, 16 KiB nodes of
   * about 540 keys): scattered 4 KiB inserts give dozens of leaves, so a
   * pass has several slices. */
  fixture_init (&f, "gcalloc.img", backing, 16 << 20, 32);
  b = mem_backing_get (f.mb);
  fixture_open (&f);

  /* Fill the cache until it evicts: every bucket holds data. */
  while (written < 2 * (16 << 20)) {
    uint64_t blk = rnd_below (nblocks);
    fill (buf, BLOCK);
    ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, BLOCK, blk * BLOCK, false),
                      0);
    memcpy (shadow + blk * BLOCK, buf, BLOCK);
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false),
                      0);
    written += BLOCK;
  }
  ck_assert_int_eq (bcf_gc_run (f.c), 0);
  bcf_cache_stats (f.c, &st);
  /* More leaves than one slice handles (10), so the pass is mid-way when
   * paused after its first slice. */
  ck_assert_uint_gt (st.btree_nodes, 12);

  /* Pause a pass after its first slice. */
  f.c->gc.slice_hook = gc_pause_hook;
  f.c->gc.slice_hook_opaque = &p;
  ck_assert_int_eq (pthread_create (&th, NULL, gc_runner, f.c), 0);
  pthread_mutex_lock (&p.lock);
  while (!p.paused)
    pthread_cond_wait (&p.cv, &p.lock);
  pthread_mutex_unlock (&p.lock);

  /* Write more than every free list holds, so the allocator must
   * invalidate buckets while the pass is paused. */
  pthread_mutex_lock (&f.c->alloc.lock);
  prio_seq0 = f.c->alloc.prio_seq;
  need = 0;
  for (int r = 0; r < RESERVE_NR; r++)
    need += f.c->alloc.free[r].size;
  pthread_mutex_unlock (&f.c->alloc.lock);
  need = 2 * need * f.c->bucket_bytes;
  for (written = 0; written < need; written += BLOCK) {
    uint64_t blk = rnd_below (nblocks);
    fill (buf, BLOCK);
    ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, BLOCK, blk * BLOCK, false),
                      0);
    memcpy (shadow + blk * BLOCK, buf, BLOCK);
    int r = bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false);
    ck_assert_msg (r == 0, "insert during a paused GC pass: %s", strerror (-r));
  }
  pthread_mutex_lock (&f.c->alloc.lock);
  ck_assert_msg (f.c->alloc.prio_seq > prio_seq0,
                 "the allocator did not refill while GC was paused");
  pthread_mutex_unlock (&f.c->alloc.lock);
  ck_assert (f.c->gc.running);
  verify_all_hits (&f, shadow, backing);

  pthread_mutex_lock (&p.lock);
  p.release = true;
  pthread_cond_broadcast (&p.cv);
  pthread_mutex_unlock (&p.lock);
  ck_assert_int_eq (pthread_join (th, &ret), 0);
  ck_assert_int_eq ((int) (intptr_t) ret, 0);
  f.c->gc.slice_hook = NULL;
  verify_all_hits (&f, shadow, backing);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_free (&f);
  free (shadow);
  free (buf);
}
END_TEST


/* Many threads at once, with the background threads running: each worker
 * owns a disjoint region of the backing store (so its shadow copy is
 * exact) and does writethrough writes (durable invalidation, backing
 * write, insert), bypass writes, reads that fill misses, and flushes; a
 * small cache keeps the allocator and GC busy.  Every hit must equal the
 * shadow, during the run and after a close and reopen; fsck must be clean.
 * Run under TSan by run-tests to check the locking. */
#define T_WORKERS 4
struct worker {
  struct fixture *f;
  uint8_t *shadow;
  uint64_t first_blk, nblk;
  unsigned id;
  uint64_t ops;
};

static void *
worker_main (void *arg)
{
  struct worker *w = arg;
  struct bcf_backing b = mem_backing_get (w->f->mb);
  uint8_t *buf = malloc (16 * BLOCK);
  uint64_t st = (seed + 1) * 0x9E3779B97F4A7C15ull * (w->id + 1);

  for (uint64_t op = 0; op < w->ops; op++) {
    uint64_t x, blk, nb;

    st ^= st >> 12; st ^= st << 25; st ^= st >> 27;
    x = st * 2685821657736338717ull;
    nb = 1 + (x >> 8) % 8;
    blk = w->first_blk + (x >> 16) % (w->nblk - nb);
    switch (x % 10) {
    case 0: case 1: case 2:           /* writethrough */
    case 3:                           /* bypass */
      for (uint64_t i = 0; i < nb * BLOCK; i++)
        buf[i] = (uint8_t) (x >> (i % 56)) ^ (uint8_t) i;
      ck_assert_int_eq (bcf_invalidate (w->f->c, blk * BLOCK, nb * BLOCK,
                                        true), 0);
      ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, (uint32_t) (nb * BLOCK),
                                       blk * BLOCK, false), 0);
      memcpy (w->shadow + blk * BLOCK, buf, nb * BLOCK);
      if (x % 10 != 3) {
        int r = bcf_insert (w->f->c, blk * BLOCK, nb * BLOCK, buf, false,
                            false);
        ck_assert_msg (r == 0 || r == -ENOSPC, "insert: %s", strerror (-r));
      }
      break;
    case 9:
      ck_assert_int_eq (bcf_flush (w->f->c), 0);
      break;
    default:
      cached_read (w->f, w->shadow, blk * BLOCK, nb * BLOCK, true, op);
      break;
    }
  }
  free (buf);
  return NULL;
}

START_TEST (test_threads)
{
  const uint64_t backing = 32 << 20, nblocks = backing / BLOCK;
  struct fixture f;
  uint8_t *shadow = calloc (1, backing);
  struct worker w[T_WORKERS];
  pthread_t th[T_WORKERS];
  const uint64_t ops = getenv ("TEST_THREAD_OPS")
                       ? strtoull (getenv ("TEST_THREAD_OPS"), NULL, 0) : 4000;

  /* 8 MiB of cache for 32 MiB of data: constant eviction. */
  fixture_init (&f, "threads.img", backing, 8 << 20, 32);
  /* A tiny node cache: leaves are evicted at every checkpoint and read
   * back concurrently. */
  f.opts.node_cache_bytes = 32768;
  fixture_open (&f);
  ck_assert_int_eq (bcf_cache_start_threads (f.c), 0);
  for (unsigned i = 0; i < T_WORKERS; i++) {
    w[i] = (struct worker) {
      .f = &f, .shadow = shadow, .first_blk = i * (nblocks / T_WORKERS),
      .nblk = nblocks / T_WORKERS, .id = i, .ops = ops,
    };
    ck_assert_int_eq (pthread_create (&th[i], NULL, worker_main, &w[i]), 0);
  }
  for (int k = 0; k < 5; k++) {
    bcf_trigger_gc (f.c);
    ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  }
  for (unsigned i = 0; i < T_WORKERS; i++)
    ck_assert_int_eq (pthread_join (th[i], NULL), 0);
  bcf_cache_stop_threads (f.c);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  verify_all_hits (&f, shadow, backing);
  fixture_close (&f);
  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  verify_all_hits (&f, shadow, backing);
  fixture_free (&f);
  free (shadow);
}
END_TEST


/* GC coalesces sparse leaves: many small extents make many leaves; most
 * are then invalidated; a GC pass must leave fewer nodes, the same
 * cached data (every surviving extent still a hit with the right bytes),
 * fsck clean, before and after a reopen. */
START_TEST (test_gc_coalesce)
{
  const uint64_t backing = 64 << 20, nblocks = backing / BLOCK;
  struct fixture f;
  struct bcf_backing b;
  struct bcf_cache_stats st0, st1;
  uint8_t *shadow = calloc (1, backing), *buf = malloc (BLOCK);
  bool *cached = calloc (nblocks, sizeof *cached);

  rng_state = seed * 13 + 1;
  fixture_init (&f, "coalesce.img", backing, 64 << 20, 32);
  b = mem_backing_get (f.mb);
  fixture_open (&f);
  for (uint64_t blk = 0; blk < nblocks; blk += 2) {
    fill (buf, BLOCK);
    ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, BLOCK, blk * BLOCK, false),
                      0);
    memcpy (shadow + blk * BLOCK, buf, BLOCK);
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false),
                      0);
    cached[blk] = true;
  }
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  /* Keep one extent in 16. */
  for (uint64_t blk = 0; blk < nblocks; blk += 2)
    if (blk % 32) {
      ck_assert_int_eq (bcf_invalidate (f.c, blk * BLOCK, BLOCK, false), 0);
      cached[blk] = false;
    }
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  bcf_cache_stats (f.c, &st0);
  ck_assert_int_eq (bcf_gc_run (f.c), 0);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  bcf_cache_stats (f.c, &st1);
  printf ("test-engine: coalesce: %" PRIu64 " nodes before GC, %" PRIu64
          " after (%" PRIu64 " merges)\n", st0.btree_nodes, st1.btree_nodes,
          st1.gc_coalesced);
  ck_assert_uint_lt (st1.btree_nodes, st0.btree_nodes);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  for (int round = 0; round < 2; round++) {
    for (uint64_t blk = 0; blk < nblocks; blk += 256) {
      struct bcf_extent e[300];
      unsigned n;
      ck_assert_int_eq (bcf_lookup (f.c, blk * BLOCK, 256 * BLOCK, e, 300, &n),
                        0);
      for (unsigned i = 0; i < n; i++)
        for (uint64_t x = e[i].offset / BLOCK;
             x < (e[i].offset + e[i].len) / BLOCK; x++)
          check_msg ((e[i].kind == BCF_EXTENT_HIT) == cached[x],
                     "seed %u: block %" PRIu64 " %s after coalescing",
                     seed, x, cached[x] ? "lost" : "appeared");
    }
    verify_all_hits (&f, shadow, backing);
    fixture_close (&f);
    f.opts.format = BCF_FORMAT_NEVER;
    fixture_open (&f);
    ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  }
  fixture_free (&f);
  free (shadow);
  free (buf);
  free (cached);
}
END_TEST

/* The stale-pointer race of bcf_read_hit (bcache's cache_read_races): a
 * hit's bucket is invalidated and reused between bcf_lookup and the end
 * of bcf_read_hit.  The read must fail with -ESTALE (the caller then reads
 * the backing store) and count a read race, never return the bytes of
 * the bucket's new owner.  Two interleavings, both deterministic and
 * single-threaded:
 *   A. reused after the lookup, before the read: the device read returns
 *      the new owner's bytes (the test checks that it did), so without
 *      the gen recheck the caller would get wrong data;
 *   B. reused while the read is in flight: the test hook in bcf_read_hit
 *      (engine.h, test_read_hook), called between the device read and the
 *      recheck, reuses the bucket.
 * Reuse is driven through the API: 4 KiB clean inserts of other blocks,
 * under the fifo policy, until one of them is cached at exactly the old
 * device offset (so the bucket was invalidated, its gen persisted, and
 * rewritten). */
struct reuse {
  struct fixture *f;
  uint64_t dev_offset;        /* wait until new data lands here */
  uint64_t next_blk;          /* blocks used for the new data */
  uint64_t first_blk, nblk;
  uint8_t *newdata;           /* the data that landed at dev_offset */
  unsigned calls;
};

static void
reuse_offset (struct reuse *ru)
{
  test_reuse_dev_offset (ru->f->c, ru->dev_offset, ru->first_blk, ru->nblk,
                         &ru->next_blk, BLOCK, ru->newdata, 100000);
}

static void
reuse_hook (struct bcf_cache *c, const struct bcf_extent *e, void *opaque)
{
  struct reuse *ru = opaque;

  /* Once: the inserts below read nothing, but be safe. */
  c->test_read_hook = NULL;
  ru->calls++;
  ck_assert_uint_eq (e->dev_offset, ru->dev_offset);
  reuse_offset (ru);
}

START_TEST (test_read_race_stale)
{
  struct fixture f;
  struct bcf_cache_stats st;
  struct bcf_extent e;
  struct reuse ru;
  uint8_t *old = malloc (BLOCK), *buf = malloc (BLOCK);
  uint8_t *newdata = malloc (BLOCK);
  unsigned n;
  int r;

  rng_state = seed * 17 + 3;
  /* 2 MiB of cache in 8 KiB buckets: reuse comes after about 2 MiB of
   * writes. */
  fixture_init (&f, "race.img", 16 << 20, 2 << 20, 16);
  f.opts.replacement = BCH_REPLACEMENT_FIFO;
  fixture_open (&f);
  ru = (struct reuse) { .f = &f, .first_blk = 16, .nblk = 2000,
                        .newdata = newdata };

  for (int round = 0; round < 2; round++) {
    uint64_t blk = (uint64_t) round;

    fill (old, BLOCK);
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, old, false, true),
                      0);
    ck_assert_int_eq (bcf_lookup (f.c, blk * BLOCK, BLOCK, &e, 1, &n), 0);
    ck_assert_int_eq (e.kind, BCF_EXTENT_HIT);
    ru.dev_offset = e.dev_offset;

    if (round == 0) {
      /* A: reused between the lookup and the read. */
      reuse_offset (&ru);
      memset (buf, 0, BLOCK);
      r = bcf_read_hit (f.c, &e, buf);
      ck_assert_msg (r == -ESTALE, "seed %u: a hit whose bucket was reused "
                     "before the read returned %s, not -ESTALE (%s)", seed,
                     r ? strerror (-r) : "success",
                     memcmp (buf, newdata, BLOCK) == 0
                     ? "and the NEW OWNER's bytes" : "");
      /* The race was real: the device holds someone else's data there. */
      ck_assert (memcmp (buf, newdata, BLOCK) == 0);
      ck_assert (memcmp (buf, old, BLOCK) != 0);
    }
    else {
      /* B: reused while the read is in flight. */
      f.c->test_read_hook = reuse_hook;
      f.c->test_read_hook_opaque = &ru;
      r = bcf_read_hit (f.c, &e, buf);
      f.c->test_read_hook = NULL;
      ck_assert_uint_eq (ru.calls, 1);
      ck_assert_msg (r == -ESTALE, "seed %u: a hit whose bucket was reused "
                     "during the read returned %s, not -ESTALE", seed,
                     r ? strerror (-r) : "success");
    }
    /* The old block is no longer a hit; the block that took its place
     * reads back right. */
    ck_assert_int_eq (bcf_lookup (f.c, blk * BLOCK, BLOCK, &e, 1, &n), 0);
    ck_assert_int_eq (e.kind, BCF_EXTENT_MISS);
  }
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.read_races, 2);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_free (&f);
  free (old);
  free (buf);
  free (newdata);
}
END_TEST

/* The node cache bound holds between checkpoints: after a checkpoint
 * evicted most leaves, a read-only pass reloads them all; with the
 * background threads running, the journal timer evicts again without any
 * checkpoint (btree_evict_maybe), and every block still reads right. */
START_TEST (test_node_cache_bound_readonly)
{
  const uint64_t nblocks = 8192;
  const size_t bound = 65536;
  struct fixture f;
  struct bcf_cache_stats st0, st1, st2;
  uint8_t *shadow = calloc (nblocks, BLOCK), *buf = malloc (BLOCK);
  struct bcf_backing b;

  rng_state = seed * 11 + 5;
  fixture_init (&f, "bound.img", nblocks * BLOCK, 64 << 20, 32);
  f.opts.node_cache_bytes = bound;
  f.opts.journal_delay_ms = 10;
  b = mem_backing_get (f.mb);
  fixture_open (&f);
  for (uint64_t blk = 0; blk < nblocks; blk += 2) {
    fill (buf, BLOCK);
    ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, BLOCK, blk * BLOCK, false),
                      0);
    memcpy (shadow + blk * BLOCK, buf, BLOCK);
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false),
                      0);
  }
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  bcf_cache_stats (f.c, &st0);
  ck_assert_uint_le (st0.btree_cache_bytes, bound);
  ck_assert_uint_gt (st0.btree_evictions, 0);

  ck_assert_int_eq (bcf_cache_start_threads (f.c), 0);
  verify_all_hits (&f, shadow, nblocks * BLOCK);   /* reloads every leaf */
  bcf_cache_stats (f.c, &st1);
  ck_assert_uint_gt (st1.btree_loads, st0.btree_loads);
  for (int i = 0; i < 200; i++) {                  /* up to 2 s */
    bcf_sleep_ms (10);
    bcf_cache_stats (f.c, &st2);
    if (st2.btree_cache_bytes <= bound)
      break;
  }
  printf ("test-engine: node cache bound %zu: %" PRIu64 " bytes after the "
          "checkpoint, %" PRIu64 " after reloading %" PRIu64 " leaves, %"
          PRIu64 " after the journal thread's eviction (%" PRIu64
          " checkpoints before, %" PRIu64 " after)\n", bound,
          st0.btree_cache_bytes, st1.btree_cache_bytes,
          st1.btree_loads - st0.btree_loads, st2.btree_cache_bytes,
          st0.checkpoint.count, st2.checkpoint.count);
  fflush (stdout);
  ck_assert_uint_le (st2.btree_cache_bytes, bound);
  /* Evicted again (while the reads reloaded, or after), and not by a
   * checkpoint: nothing was written. */
  ck_assert_uint_gt (st2.btree_evictions, st0.btree_evictions);
  ck_assert_uint_eq (st2.checkpoint.count, st0.checkpoint.count);
  verify_all_hits (&f, shadow, nblocks * BLOCK);
  bcf_cache_stop_threads (f.c);
  ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_free (&f);
  free (shadow);
  free (buf);
}
END_TEST

/* Every call of opts.progress during an open, in order. */
struct progress_log {
  struct { enum bcf_open_step step; uint64_t done, total; } call[4096];
  size_t n;
};

static void
progress_cb (void *opaque, enum bcf_open_step step, uint64_t done,
             uint64_t total)
{
  struct progress_log *pl = opaque;

  ck_assert_uint_lt (pl->n, 4096);
  pl->call[pl->n].step = step;
  pl->call[pl->n].done = done;
  pl->call[pl->n].total = total;
  pl->n++;
}

/* The open's progress (opts.progress, what bcachefilter-show --fsck
 * shows): after a crash that left keys to replay, a read-only open of a
 * tree of several nodes reports the journal, the btree and the replay,
 * in that order, each from done 0 to done == total with the same total
 * and done never going down; the btree once per leaf, the replay up
 * to every key the crash left in the journal. */
START_TEST (test_open_progress)
{
  const uint64_t nblocks = 8192, late = 512;
  static struct progress_log pl;
  const enum bcf_open_step order[] = {
    BCF_OPEN_JOURNAL, BCF_OPEN_BTREE, BCF_OPEN_REPLAY,
  };
  struct fixture f;
  struct bcf_cache_stats st;
  uint8_t *buf = calloc (1, BLOCK);
  size_t i = 0, btree_calls = 0;

  fixture_init (&f, "progress.img", nblocks * BLOCK, 64 << 20, 32);
  fixture_open (&f);
  /* Small buckets: many leaves, committed by the checkpoint; then keys
   * only the journal holds when the power goes. */
  for (uint64_t blk = 0; blk < nblocks; blk += 2)
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false),
                      0);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  for (uint64_t blk = 1; blk < 2 * late; blk += 2)
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false),
                      0);
  ck_assert_int_eq (bcf_flush (f.c), 0);
  bcf_cache_test_crash (f.c, 0, BCF_IO_CRASH_KEEP_ALL);
  f.c = NULL;

  f.opts.readonly = true;
  f.opts.progress = progress_cb;
  f.opts.progress_opaque = &pl;
  fixture_open (&f);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_gt (st.btree_nodes, 2);
  for (size_t s = 0; s < sizeof order / sizeof order[0]; s++) {
    const size_t first = i;

    ck_assert_msg (i < pl.n && pl.call[i].step == order[s],
                   "step %zu: not reported, or out of order", s);
    ck_assert_uint_eq (pl.call[i].done, 0);
    for (; i < pl.n && pl.call[i].step == order[s]; i++) {
      ck_assert_uint_eq (pl.call[i].total, pl.call[first].total);
      ck_assert_uint_le (pl.call[i].done, pl.call[i].total);
      if (i > first)
        ck_assert_uint_ge (pl.call[i].done, pl.call[i - 1].done);
    }
    ck_assert_msg (pl.call[i - 1].done == pl.call[i - 1].total,
                   "step %zu ends at %" PRIu64 " of %" PRIu64, s,
                   pl.call[i - 1].done, pl.call[i - 1].total);
    ck_assert_uint_gt (pl.call[first].total, 0);
    if (order[s] == BCF_OPEN_BTREE)
      btree_calls = i - first;
    if (order[s] == BCF_OPEN_REPLAY)
      ck_assert_uint_ge (pl.call[i - 1].total, late);
  }
  ck_assert_uint_eq (i, pl.n);
  /* One call to start, then one per leaf: several. */
  ck_assert_uint_gt (btree_calls, 2);
  ck_assert_uint_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
  fixture_free (&f);
  free (buf);
}
END_TEST

/* Checkpoints running while inserts and invalidations change the very
 * nodes they are writing.  A checkpoint captures a node written whole by
 * sharing its key array (copy on write: keyset_share) and encodes it
 * after dropping the btree lock, so the first change of such a node must
 * copy the array instead of changing it under the encoder.  One thread
 * checkpoints in a loop, with the device slowed down so the encoding and
 * the writes overlap the changes; the main thread writes.  Afterwards the
 * cached map must be exactly the model's, also after a close and reopen,
 * and fsck clean.  Under ASan / TSan this also checks that no encoder
 * reads an array after it was changed or freed. */
struct ckpt_loop {
  struct fixture *f;
  atomic_bool stop;
  atomic_uint n;
};

static void *
ckpt_loop_main (void *arg)
{
  struct ckpt_loop *l = arg;

  while (!atomic_load (&l->stop)) {
    ck_assert_int_eq (bcf_cache_checkpoint (l->f->c), 0);
    atomic_fetch_add (&l->n, 1);
  }
  return NULL;
}

START_TEST (test_checkpoint_concurrent_changes)
{
  const uint64_t nblocks = 8192;
  struct fixture f;
  struct ckpt_loop l = { .f = &f };
  struct bcf_io_faults slow = { .delay_us = 200 };
  uint8_t *shadow = calloc (nblocks, BLOCK), *buf = malloc (16 * BLOCK);
  bool *cached = calloc (nblocks, sizeof *cached);
  struct bcf_backing b;
  pthread_t th;

  rng_state = seed * 23 + 9;
  /* 16 KiB nodes: a few dozen leaves, each written whole again and again
   * (splits, relocations). */
  fixture_init (&f, "ckptcow.img", nblocks * BLOCK, 128 << 20, 32);
  b = mem_backing_get (f.mb);
  fixture_open (&f);
  for (uint64_t blk = 0; blk < nblocks; blk += 2) {
    fill (buf, BLOCK);
    ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, BLOCK, blk * BLOCK, false),
                      0);
    memcpy (shadow + blk * BLOCK, buf, BLOCK);
    ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, BLOCK, buf, false, false),
                      0);
    cached[blk] = true;
  }
  bcf_io_set_faults (bcf_cache_test_io (f.c), &slow);
  ck_assert_int_eq (pthread_create (&th, NULL, ckpt_loop_main, &l), 0);
  for (unsigned op = 0; op < 3000 || atomic_load (&l.n) < 3; op++) {
    uint64_t nb = 1 + rnd_below (16), blk = rnd_below (nblocks - nb);
    if (rnd_below (4)) {
      fill (buf, nb * BLOCK);
      ck_assert_int_eq (b.ops->pwrite (b.opaque, buf, (uint32_t) (nb * BLOCK),
                                       blk * BLOCK, false), 0);
      memcpy (shadow + blk * BLOCK, buf, nb * BLOCK);
      ck_assert_int_eq (bcf_insert (f.c, blk * BLOCK, nb * BLOCK, buf, false,
                                    false), 0);
      for (uint64_t i = 0; i < nb; i++)
        cached[blk + i] = true;
    }
    else {
      ck_assert_int_eq (bcf_invalidate (f.c, blk * BLOCK, nb * BLOCK, false),
                        0);
      for (uint64_t i = 0; i < nb; i++)
        cached[blk + i] = false;
    }
  }
  atomic_store (&l.stop, true);
  ck_assert_int_eq (pthread_join (th, NULL), 0);
  bcf_io_set_faults (bcf_cache_test_io (f.c), NULL);
  printf ("test-engine: %u checkpoints ran beside the changes\n",
          atomic_load (&l.n));
  fflush (stdout);
  ck_assert_uint_ge (atomic_load (&l.n), 3);

  for (int round = 0; round < 2; round++) {
    ck_assert_int_eq (bcf_cache_fsck (f.c, NULL, 0), 0);
    for (uint64_t blk = 0; blk < nblocks; blk += 256) {
      struct bcf_extent e[300];
      unsigned n;
      ck_assert_int_eq (bcf_lookup (f.c, blk * BLOCK, 256 * BLOCK, e, 300, &n),
                        0);
      for (unsigned i = 0; i < n; i++)
        for (uint64_t x = e[i].offset / BLOCK;
             x < (e[i].offset + e[i].len) / BLOCK; x++)
          check_msg ((e[i].kind == BCF_EXTENT_HIT) == cached[x],
                     "seed %u round %d: block %" PRIu64 " %s", seed, round,
                     x, cached[x] ? "lost" : "appeared");
    }
    verify_all_hits (&f, shadow, nblocks * BLOCK);
    fixture_close (&f);
    f.opts.format = BCF_FORMAT_NEVER;
    fixture_open (&f);
  }
  fixture_free (&f);
  free (shadow);
  free (buf);
  free (cached);
}
END_TEST

/* bcf_miss_fill_many: one batch holds a clean miss, a colliding one, a
 * miss larger than a bucket (several chunks), one whose data is not
 * aligned (bounced), and then, with a write fault armed, a batch where
 * exactly one write fails: each miss gets what bcf_miss_fill would have
 * returned, and the failed one is cancelled (no check key, nothing
 * cached) while its neighbours are cached with the right bytes. */
START_TEST (test_miss_fill_many)
{
  enum { N = 4, BUCKET_SECTORS = 64 };          /* 32 KiB buckets */
  static const uint64_t off[N] = { 0, 65536, 131072, 524288 };
  static const uint64_t len[N] = { 8192, 8192, 98304, 12288 };
  struct fixture f;
  struct bcf_miss m[N], *ms[N];
  const void *data[N];
  uint8_t *buf[N], *unaligned, *back;
  struct bcf_extent e[8];
  struct bcf_io_faults faults = { .fail_nth = 2, .fail_writes_only = true };
  struct bcf_cache_stats st;
  int res[N];
  unsigned n;

  fixture_init (&f, "fillmany.img", 16 << 20, 32 << 20, BUCKET_SECTORS);
  fixture_open (&f);
  unaligned = malloc (len[3] + 1);
  back = malloc (98304);
  for (unsigned i = 0; i < N; i++) {
    buf[i] = malloc (len[i]);
    fill (buf[i], len[i]);
    ck_assert_int_eq (bcf_miss_begin (f.c, off[i], len[i], &m[i]), 0);
    ms[i] = &m[i];
    data[i] = buf[i];
  }
  memcpy (unaligned + 1, buf[3], len[3]);
  data[3] = unaligned + 1;
  ck_assert_int_eq (bcf_invalidate (f.c, off[1] + 4096, 4096, true), 0);

  bcf_miss_fill_many (f.c, ms, data, N, res);
  ck_assert_int_eq (res[0], 0);
  ck_assert_int_eq (res[1], -EEXIST);
  ck_assert_int_eq (res[2], 0);
  ck_assert_int_eq (res[3], 0);
  for (unsigned i = 0; i < N; i++) {
    ck_assert_int_eq (bcf_lookup (f.c, off[i], len[i], e, 8, &n), 0);
    if (i == 1) {
      for (unsigned x = 0; x < n; x++)
        ck_assert_int_eq (e[x].kind, BCF_EXTENT_MISS);
      continue;
    }
    for (unsigned x = 0; x < n; x++) {
      ck_assert_int_eq (e[x].kind, BCF_EXTENT_HIT);
      ck_assert_int_eq (bcf_read_hit (f.c, &e[x], back), 0);
      ck_assert_msg (memcmp (back, buf[i] + (e[x].offset - off[i]),
                             e[x].len) == 0,
                     "miss %u: cached bytes differ at %" PRIu64, i,
                     e[x].offset);
    }
  }
  ck_assert_msg (n >= 1, "lookup found nothing");

  /* Now the second write of a batch of three single-chunk misses fails. */
  for (unsigned i = 0; i < 3; i++) {
    ck_assert_int_eq (bcf_invalidate (f.c, off[i], len[i], true), 0);
    ck_assert_int_eq (bcf_miss_begin (f.c, off[i], 8192, &m[i]), 0);
    data[i] = buf[i];
  }
  bcf_cache_stats (f.c, &st);
  uint64_t errors = st.device_errors;
  bcf_io_set_faults (bcf_cache_test_io (f.c), &faults);
  bcf_miss_fill_many (f.c, ms, data, 3, res);
  bcf_io_set_faults (bcf_cache_test_io (f.c), NULL);
  ck_assert_int_eq (res[0], 0);
  ck_assert_int_eq (res[1], -EIO);
  ck_assert_int_eq (res[2], 0);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.device_errors, errors + 1);
  for (unsigned i = 0; i < 3; i++) {
    ck_assert_int_eq (bcf_lookup (f.c, off[i], 8192, e, 8, &n), 0);
    ck_assert_uint_eq (n, 1);
    ck_assert_int_eq (e[0].kind, i == 1 ? BCF_EXTENT_MISS : BCF_EXTENT_HIT);
  }
  /* The failed miss's check key is gone: a new miss there fills. */
  ck_assert_int_eq (bcf_miss_begin (f.c, off[1], 8192, &m[1]), 0);
  ck_assert_int_eq (bcf_miss_fill (f.c, &m[1], buf[1]), 0);

  for (unsigned i = 0; i < N; i++)
    free (buf[i]);
  free (unaligned);
  free (back);
  fixture_free (&f);
}
END_TEST

/* ---- identity (issue 16 B) and geometry (issue 16 C) ---------------------------- */

/* Give the fixture a new backing store of this size (same identity). */
static void
fixture_new_backing (struct fixture *f, uint64_t bytes)
{
  mem_backing_free (f->mb);
  f->mb = mem_backing_new (bytes);
  f->opts.backing = mem_backing_get (f->mb);
}

/* Write sectors into uuid slot 0 of the closed cache at f->path, as the
 * kernel leaves it for a backing device (0). */
static void
patch_owner_sectors (struct fixture *f, uint64_t sectors)
{
  uint64_t at;
  uint8_t le[8];
  int fd;

  fixture_open (f);
  at = f->c->uuid_bucket * f->c->bucket_bytes + 64;
  fixture_close (f);
  for (int i = 0; i < 8; i++)
    le[i] = (uint8_t) (sectors >> (8 * i));
  fd = open (f->path, O_WRONLY);
  ck_assert_int_ge (fd, 0);
  ck_assert_int_eq (pwrite (fd, le, 8, (off_t) at), 8);
  close (fd);
}

/* A uuid entry whose size is 0 records no size (the kernel's entry for a
 * backing device): only its uuid is compared.  Its message for another
 * uuid says the size is not recorded. */
START_TEST (test_identity_size_not_recorded)
{
  struct fixture f;
  uint8_t data[8192], back[8192];
  struct bcf_extent e[2];
  char err[512] = "";
  unsigned n;

  fixture_init (&f, "nosize.img", 16 << 20, 32 << 20, 256);
  fixture_open (&f);
  rng_state = seed + 7;
  fill (data, sizeof data);
  ck_assert_int_eq (bcf_insert (f.c, 1 << 20, sizeof data, data, false,
                                true), 0);
  fixture_close (&f);
  patch_owner_sectors (&f, 0);

  /* Another size, the same uuid: accepted, and still warm. */
  fixture_new_backing (&f, 20 << 20);
  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  ck_assert_int_eq (bcf_lookup (f.c, 1 << 20, sizeof data, e, 2, &n), 0);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
  ck_assert_int_eq (bcf_read_hit (f.c, &e[0], back), 0);
  ck_assert_mem_eq (back, data, sizeof data);
  fixture_close (&f);

  /* Another uuid: another export. */
  f.opts.backing_uuid[0] ^= 1;
  ck_assert_int_eq (bcf_cache_open (&f.opts, &f.c, err, sizeof err), -EEXIST);
  f.c = NULL;
  ck_assert_ptr_nonnull (strstr (err, "caches another export"));
  ck_assert_ptr_nonnull (strstr (err, "size not recorded"));
  fixture_free (&f);
}
END_TEST

/* A recorded size is still checked; a resized export is reported as a
 * resize of this export (its uuid named once), not as another export. */
START_TEST (test_identity_resized)
{
  struct fixture f;
  char err[512] = "", u[37];
  const char *at;

  fixture_init (&f, "resized.img", 16 << 20, 32 << 20, 256);
  fixture_open (&f);
  fixture_close (&f);
  fixture_new_backing (&f, 20 << 20);
  f.opts.format = BCF_FORMAT_NEVER;
  ck_assert_int_eq (bcf_cache_open (&f.opts, &f.c, err, sizeof err), -ESTALE);
  f.c = NULL;
  ck_assert_ptr_null (strstr (err, "another export"));
  ck_assert_ptr_nonnull (strstr (err, "caches this export"));
  ck_assert_ptr_nonnull (strstr (err, "16777216 bytes"));
  ck_assert_ptr_nonnull (strstr (err, "20971520 bytes"));
  bch_uuid_unparse (f.opts.backing_uuid, u);
  ck_assert_ptr_nonnull (at = strstr (err, u));
  ck_assert_ptr_null (strstr (at + 1, u));
  fixture_free (&f);
}
END_TEST

/* Without a bucket size, a small device gets buckets small enough for
 * the kernel to register it (more than 512), with a warning; a large one
 * gets 512 KiB.  With min_buckets = BCH_KERNEL_MIN_NBUCKETS an explicit
 * geometry that gives fewer is refused, and so is a make-bcache device
 * that has fewer; nothing is written. */
START_TEST (test_kernel_min_buckets)
{
  struct fixture f;
  struct bcf_cache_stats st;
  char err[512] = "";
  struct bcf_device_verdict verdict;

  atomic_store (&smaller_bucket_warnings, 0);
  fixture_init (&f, "small.img", 16 << 20, 64 << 20, 0);
  fixture_open (&f);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.bucket_bytes, 64 << 10);
  ck_assert_uint_eq (st.nbuckets, 1024);
  ck_assert_uint_eq (atomic_load (&smaller_bucket_warnings), 1);
  fixture_free (&f);

  fixture_init (&f, "large.img", 16 << 20, 513 << 19, 0);
  fixture_open (&f);
  bcf_cache_stats (f.c, &st);
  ck_assert_uint_eq (st.bucket_bytes, 512 << 10);
  ck_assert_uint_eq (st.nbuckets, 513);
  ck_assert_uint_eq (atomic_load (&smaller_bucket_warnings), 1);
  fixture_free (&f);

  /* 32 MiB of 128 KiB buckets: 256. */
  fixture_init (&f, "refused.img", 16 << 20, 32 << 20, 256);
  f.opts.min_buckets = BCH_KERNEL_MIN_NBUCKETS;
  ck_assert_int_eq (bcf_cache_open (&f.opts, &f.c, err, sizeof err), -EINVAL);
  f.c = NULL;
  ck_assert_ptr_nonnull (strstr (err, "256 buckets of 128 KiB"));
  ck_assert_ptr_nonnull (strstr (err, "registers none with 512 buckets or "
                                 "fewer"));
  ck_assert_int_eq (bcf_device_probe (f.path, NULL, &verdict, err,
                                      sizeof err), 0);
  ck_assert_int_eq (verdict.kind, BCF_DEVICE_BLANK);
  f.opts.bucket_sectors = 64;           /* 1024 of 32 KiB: fine */
  fixture_open (&f);
  fixture_free (&f);

  if (strcmp (MAKE_BCACHE, "no") != 0) {
    char cmd[512];
    fixture_init (&f, "mbsmall.img", 16 << 20, 64 << 20, 0);
    int fd = open (f.path, O_RDWR | O_CREAT, 0600);
    ck_assert_int_ge (fd, 0);
    ck_assert_int_eq (ftruncate (fd, 64 << 20), 0);
    close (fd);
    snprintf (cmd, sizeof cmd, "%s -C -b 256k %s >/dev/null", MAKE_BCACHE,
              f.path);
    ck_assert_int_eq (system (cmd), 0);
    f.opts.min_buckets = BCH_KERNEL_MIN_NBUCKETS;
    ck_assert_int_eq (bcf_cache_open (&f.opts, &f.c, err, sizeof err),
                      -EINVAL);
    f.c = NULL;
    ck_assert_ptr_nonnull (strstr (err, "make-bcache -b"));
    fixture_free (&f);
  }
}
END_TEST

/* ---- interior nodes as the kernel reads them ------------------------------------ */

/* A tree with interior nodes: 8 KiB buckets (8 KiB nodes, two 4 KiB
 * blocks of log), thousands of small extents, a checkpoint every few
 * hundred (splits, relocations); after each, each_round (if not NULL). */
static void
fill_deep_tree (struct fixture *f, unsigned rounds,
                void (*each_round) (struct fixture *f))
{
  uint8_t data[4096];

  fixture_init (f, "deep.img", 64 << 20, 32 << 20, 16);
  fixture_open (f);
  rng_state = seed + 11;
  for (unsigned r = 0; r < rounds; r++) {
    for (unsigned i = 0; i < 300; i++) {
      uint64_t off = rnd_below ((64 << 20) / 8192) * 8192;
      fill (data, sizeof data);
      ck_assert_int_eq (bcf_insert (f->c, off, sizeof data, data, false,
                                    false), 0);
    }
    ck_assert_int_eq (bcf_cache_checkpoint (f->c), 0);
    if (each_round)
      each_round (f);
  }
}

struct pos_list { uint64_t pos[4096]; size_t n; bool dup; };

static int
collect_positions (const struct bch_node_bset *set, void *opaque)
{
  struct pos_list *l = opaque;
  const uint8_t *p = (const uint8_t *) set->keys;

  for (size_t w = 0; w < set->hdr.keys; ) {
    struct bkey_padded b;
    uint64_t pos;

    ck_assert_int_eq (bkey_decode (p + 8 * w, (set->hdr.keys - w) * 8, &b,
                                   NULL), BCH_OK);
    w += bkey_u64s (&b.key);
    pos = (KEY_INODE (&b.key) << 44) ^ KEY_OFFSET (&b.key);
    for (size_t i = 0; i < l->n; i++)
      if (l->pos[i] == pos)
        l->dup = true;
    ck_assert_uint_lt (l->n, 4096);
    l->pos[l->n++] = pos;
  }
  return 0;
}

struct interior_check { struct fixture *f; unsigned nodes, bsets; };
static struct interior_check interior_seen;

/* No interior node on disk holds two keys at one position (in any of its
 * bsets): the kernel would take both for children. */
static int
check_interior_on_disk (struct bcf_cache *c, struct btree_node *n,
                        void *opaque)
{
  struct interior_check *ic = opaque;
  struct pos_list *l;
  uint8_t *buf;
  unsigned nsets;
  size_t written;
  struct bch_diag d;
  int fd;

  if (n->level == 0)
    return 0;
  ic->nodes++;
  l = calloc (1, sizeof *l);
  buf = malloc (c->tree.node_bytes);
  fd = open (ic->f->path, O_RDONLY);
  ck_assert_int_ge (fd, 0);
  ck_assert_int_eq (pread (fd, buf, c->tree.node_bytes,
                           (off_t) (bucket_of_ptr (c, n->key.ptr) *
                                    c->bucket_bytes)),
                    (ssize_t) c->tree.node_bytes);
  close (fd);
  ck_assert_int_eq (bch_node_walk (buf, c->tree.node_bytes, c->block_bytes,
                                   bch_bset_magic (&c->sb), n->key.ptr,
                                   n->level, NULL, collect_positions, l,
                                   &nsets, &written, &d), BCH_OK);
  ic->bsets += nsets;
  ck_assert_msg (!l->dup, "interior node in bucket %" PRIu64 " holds two "
                 "keys at one position on disk (%u bsets)",
                 bucket_of_ptr (c, n->key.ptr), nsets);
  free (buf);
  free (l);
  return 0;
}

static void
check_interior_after_round (struct fixture *f)
{
  interior_seen.f = f;
  btree_visit (f->c, check_interior_on_disk, &interior_seen);
}

/* Interior nodes are written whole, never as appended bsets: after every
 * checkpoint (splits, relocations) none holds a superseded child
 * pointer on disk. */
START_TEST (test_interior_nodes_written_whole)
{
  struct fixture f;

  memset (&interior_seen, 0, sizeof interior_seen);
  fill_deep_tree (&f, 12, check_interior_after_round);
  ck_assert_uint_ge (f.c->tree.root->level, 1);
  ck_assert_uint_ge (f.c->tree.root->keys.nr, 8);
  ck_assert_uint_ge (interior_seen.nodes, 12);
  fixture_close (&f);
  fixture_free (&f);
}
END_TEST

/* Keys bcache writes into interior nodes that are not children: a
 * freeing key at (0, 0), and a second, older key at the position of the
 * one before it in the same bset (the kernel sorts the newest first).
 * Appended to the root's log, they must change nothing. */
START_TEST (test_kernel_interior_keys)
{
  struct fixture f;
  struct btree_node *root;
  struct bcf_extent e[2];
  struct bkey_padded keys[3];
  uint8_t data[4096], *bset;
  uint64_t bogus, root_at, root_written, root_seq, root_ptr, magic;
  size_t bsz, words = 0;
  unsigned n, block;
  int fd;

  fill_deep_tree (&f, 4, NULL);
  rng_state = seed + 12;
  fill (data, sizeof data);
  ck_assert_int_eq (bcf_insert (f.c, 0, sizeof data, data, false, true), 0);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);
  /* A pointer that is not a node: the bucket of the data at 0. */
  ck_assert_int_eq (bcf_lookup (f.c, 0, sizeof data, e, 2, &n), 0);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
  bogus = e[0].ptr;
  root = f.c->tree.root;
  ck_assert_uint_ge (root->level, 1);
  ck_assert_uint_ge (root->keys.nr, 2);
  root_ptr = root->key.ptr;
  root_at = bucket_of_ptr (f.c, root_ptr) * f.c->bucket_bytes;
  root_written = root->written;
  root_seq = root->seq;
  magic = bch_bset_magic (&f.c->sb);
  block = f.c->block_bytes;
  /* The kernel's freeing key for the data bucket (gen + 1), then the
   * root's last key twice: the real child, and after it the bogus one. */
  bkey_init (&keys[0].key, 0, 0, f.c->bucket_sectors);
  SET_KEY_PTRS (&keys[0].key, 1);
  keys[0].key.ptr[0] = MAKE_PTR ((uint8_t) (PTR_GEN (bogus) + 1),
                                 PTR_OFFSET (bogus), 0);
  memcpy (&keys[1], ckey_bkey (&root->keys.k[root->keys.nr - 1]),
          sizeof keys[1]);
  memcpy (&keys[2], &keys[1], sizeof keys[2]);
  keys[2].key.ptr[0] = MAKE_PTR (PTR_GEN (bogus), PTR_OFFSET (bogus) /
                                 f.c->bucket_sectors * f.c->bucket_sectors,
                                 0);
  fixture_close (&f);

  bsz = block;
  bset = calloc (1, bsz);
  for (unsigned i = 0; i < 3; i++)
    words += bkey_encode (&keys[i].key, bset + BCH_BSET_HEADER_SIZE + 8 * words,
                          bsz - BCH_BSET_HEADER_SIZE - 8 * words) / 8;
  ck_assert (bch_bset_seal (bset, bsz, magic, root_seq, (uint32_t) words,
                            root_ptr) != 0);
  fd = open (f.path, O_WRONLY);
  ck_assert_int_ge (fd, 0);
  ck_assert_int_eq (pwrite (fd, bset, bsz, (off_t) (root_at + root_written)),
                    (ssize_t) bsz);
  close (fd);
  free (bset);

  /* Reopened: the same children, the data still there. */
  f.opts.format = BCF_FORMAT_NEVER;
  fixture_open (&f);
  ck_assert_int_eq (bcf_lookup (f.c, 0, sizeof data, e, 2, &n), 0);
  ck_assert_int_eq (e[0].kind, BCF_EXTENT_HIT);
  {
    uint8_t back[4096];
    ck_assert_int_eq (bcf_read_hit (f.c, &e[0], back), 0);
    ck_assert_mem_eq (back, data, sizeof data);
  }
  ck_assert_int_eq (bcf_gc_run (f.c), 0);
  fixture_free (&f);
}
END_TEST

/* One test case per test, so CK_RUN_CASE=name runs just that one. */
static void
add_timeout (Suite *s, const char *name, const TTest *t, double timeout)
{
  TCase *tc = tcase_create (name);
  tcase_set_timeout (tc, timeout);
  tcase_add_test (tc, t);
  suite_add_tcase (s, tc);
}

static void
add (Suite *s, const char *name, const TTest *t)
{
  TCase *tc = tcase_create (name);
  tcase_set_timeout (tc, 600);
  tcase_add_test (tc, t);
  suite_add_tcase (s, tc);
}

static Suite *
engine_suite (void)
{
  Suite *s = suite_create ("engine");

  add (s, "format_reopen", test_format_reopen);
  add (s, "make_bcache_interop", test_make_bcache_interop);
  add (s, "miss_collision", test_miss_collision);
  add (s, "invalidate_after_failure", test_invalidate_after_failure);
  add (s, "abandon_then_reuse", test_abandon_then_reuse);
  add (s, "invalidate_empty", test_invalidate_empty);
  add (s, "intent_feature_bit", test_intent_feature_bit);
  add (s, "intent_bit_not_behind_checkpoint",
       test_intent_bit_not_behind_checkpoint);
  add (s, "open_after_crash_in_reserve", test_open_after_crash_in_reserve);
  add (s, "intent_recover_evicted", test_intent_recover_evicted);
  add (s, "intent_recover_fills_journal", test_intent_recover_fills_journal);
  add (s, "preflush_and_prio_time_stats", test_preflush_and_prio_time_stats);
  add (s, "lock_waits_timed", test_lock_waits_timed);
  add (s, "intent_recover_moves_every_leaf",
       test_intent_recover_moves_every_leaf);
  add (s, "nospace_write_invalidates_durably",
       test_nospace_write_invalidates_durably);
  {
    TCase *tc = tcase_create ("clean_close_keeps_clean_marks");
    tcase_add_loop_test (tc, test_clean_close_keeps_clean_marks, 0, 2);
    suite_add_tcase (s, tc);
  }
  add (s, "miss_fill_many", test_miss_fill_many);
  add (s, "identity_size_not_recorded", test_identity_size_not_recorded);
  add (s, "identity_resized", test_identity_resized);
  add (s, "kernel_min_buckets", test_kernel_min_buckets);
  add (s, "interior_nodes_written_whole", test_interior_nodes_written_whole);
  add (s, "kernel_interior_keys", test_kernel_interior_keys);
  add (s, "model_random", test_model_random);
  add (s, "model_small_node_cache", test_model_small_node_cache);
  add (s, "model_eviction", test_model_eviction);
  add (s, "threads", test_threads);
  add (s, "gc_coalesce", test_gc_coalesce);
  add (s, "read_race_stale", test_read_race_stale);
  add (s, "node_cache_bound_readonly", test_node_cache_bound_readonly);
  add (s, "open_progress", test_open_progress);
  add (s, "checkpoint_concurrent_changes",
       test_checkpoint_concurrent_changes);
  /* An allocator that waits for GC never returns here (the pass is
   * paused): the timeout turns that stall into a failure. */
  add_timeout (s, "gc_does_not_block_alloc", test_gc_does_not_block_alloc,
               120);
  return s;
}

int
main (void)
{
  int r;

  seed = test_seed ("test-engine");
  test_tmpdir (tmpdir, sizeof tmpdir, "bcf-engine");
  r = test_main (engine_suite ());
  rmdir (tmpdir);
  return r;
}
