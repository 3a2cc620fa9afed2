/* Unit tests for a bcache backing device as the export (core/bdev.c,
 * the engine's uuid slots in core/super.c, the request layer's offset),
 * and the entry such an export leaves read by a plain export.
 *
 *  - bcf_bdev_relation and bcf_bdev_pick_slot against the kernel's attach
 *    rules, case by case (no I/O);
 *  - bcf_bdev_probe over an in-memory backing store holding make-bcache
 *    -B's bytes, a cache superblock, a damaged one, nothing;
 *  - bcf_bdev_attach and bcf_bdev_set_state: what reaches the store (and
 *    only when something changes), a failed write changing nothing;
 *  - the engine with such an export: keys at backing sectors (the data
 *    offset included), the entry records no size, reopen keeps the data;
 *    a device detached, or attached to another set, since: its old entry
 *    invalidated, a new slot, nothing stale served; a device another set
 *    holds dirty data for: refused, and a blank cache left blank; the
 *    slots of other devices kept;
 *  - the entry a backing-device export leaves (no size) opened as a plain
 *    export of the whole device (bcache-backing-device=never): matched by
 *    uuid alone (test-engine checks the rule itself).
 *
 * The backing superblock in the stores is one as make-bcache -B writes it
 * (version 1, 4 KiB blocks, detached), encoded with bch_sb_encode
 * (test-format checks that against bytes bcache-tools wrote).
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <check.h>

#include "bcachefilter/bdev.h"
#include "bcachefilter/cache.h"
#include "bcachefilter/probe.h"
#include "bcachefilter/request.h"
#include "engine.h"
#include "mem-backing.h"
#include "testlib.h"

#define MiB (1024u * 1024u)
#define BLOCK 4096u

static char tmpdir[256];

/* make-bcache -B -w 4k's superblock (version 1: data at sector 16,
 * detached, with a set_uuid of its own), encoded into area. */
static void
make_bdev_area (uint8_t area[BCH_SB_AREA_SIZE])
{
  static const uint8_t uuid[16] = "a backing dev --";
  static const uint8_t set[16] = "make-bcache set-";
  struct bch_sb s;

  memset (&s, 0, sizeof s);
  s.offset = BCH_SB_SECTOR;
  s.version = BCACHE_SB_VERSION_BDEV;
  memcpy (s.magic, bch_sb_magic, 16);
  memcpy (s.uuid, uuid, 16);
  memcpy (s.set_uuid, set, 16);
  s.block_size = 8;
  s.bucket_size = 1024;
  bch_sb_encode (&s, area);
}

static void
log_cb (void *opaque, enum bcf_log_level level, const char *msg)
{
  if (level >= BCF_LOG_WARN || getenv ("TEST_VERBOSE"))
    fprintf (stderr, "engine: %s\n", msg);
}

static const uint8_t uuid_a[16] = "backing-dev-A---";
static const uint8_t uuid_b[16] = "backing-dev-B---";
static const uint8_t set_x[16] = "cache-set-X-----";
static const uint8_t set_y[16] = "cache-set-Y-----";

/* A backing superblock in memory (not encoded): uuid, set, state. */
static struct bch_sb
bsb (const uint8_t uuid[16], const uint8_t set[16], unsigned state)
{
  struct bch_sb s;

  memset (&s, 0, sizeof s);
  s.version = BCACHE_SB_VERSION_BDEV;
  memcpy (s.uuid, uuid, 16);
  memcpy (s.set_uuid, set, 16);
  memcpy (s.label, "label of the device", 19);
  s.flags = (uint64_t) state << BCH_BDEV_STATE_SHIFT;
  return s;
}

/* ---- relation and slot choice --------------------------------------------------- */

START_TEST (test_relation)
{
  struct bch_sb s;

  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_NONE);
  ck_assert_int_eq (bcf_bdev_relation (&s, set_x), BCF_BDEV_DETACHED);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_STALE);
  ck_assert_int_eq (bcf_bdev_relation (&s, set_x), BCF_BDEV_DETACHED);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_CLEAN);
  ck_assert_int_eq (bcf_bdev_relation (&s, set_x), BCF_BDEV_OURS_CLEAN);
  ck_assert_int_eq (bcf_bdev_relation (&s, set_y), BCF_BDEV_OTHER_CLEAN);
  ck_assert_int_eq (bcf_bdev_relation (&s, NULL), BCF_BDEV_OTHER_CLEAN);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (bcf_bdev_relation (&s, set_x), BCF_BDEV_OURS_DIRTY);
  ck_assert_int_eq (bcf_bdev_relation (&s, set_y), BCF_BDEV_OTHER_DIRTY);
  ck_assert_int_eq (bcf_bdev_relation (&s, NULL), BCF_BDEV_OTHER_DIRTY);
  /* Dirty for a zero set: nobody's, so not ours. */
  {
    static const uint8_t zero[16];
    s = bsb (uuid_a, zero, BCH_BDEV_STATE_DIRTY);
    ck_assert_int_eq (bcf_bdev_relation (&s, zero), BCF_BDEV_OTHER_DIRTY);
  }
}
END_TEST

#define NSLOTS 8

static int
pick (const struct bch_sb *s, const uint8_t set[16],
      struct bch_uuid_entry *u, bool may_invalidate, unsigned *slot,
      bool *changed, char *err)
{
  return bcf_bdev_pick_slot (s, set, u, NSLOTS, 1234, may_invalidate, slot,
                             changed, err, 512);
}

START_TEST (test_pick_slot)
{
  struct bch_uuid_entry u[NSLOTS];
  struct bch_sb s;
  char err[512];
  unsigned slot;
  bool changed;

  /* Attached to this set, entry present: that slot, nothing written. */
  memset (u, 0, sizeof u);
  memcpy (u[0].uuid, uuid_b, 16);
  memcpy (u[3].uuid, uuid_a, 16);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_CLEAN);
  ck_assert_int_eq (pick (&s, set_x, u, true, &slot, &changed, err), 0);
  ck_assert_uint_eq (slot, 3);
  ck_assert (!changed);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (pick (&s, set_x, u, false, &slot, &changed, err), 0);
  ck_assert_uint_eq (slot, 3);
  ck_assert (!changed);

  /* Attached to this set, no entry: clean makes one in the first free
   * slot, with the device's uuid and label; dirty is refused. */
  memset (u, 0, sizeof u);
  memcpy (u[0].uuid, uuid_b, 16);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_CLEAN);
  ck_assert_int_eq (pick (&s, set_x, u, true, &slot, &changed, err), 0);
  ck_assert_uint_eq (slot, 1);
  ck_assert (changed);
  ck_assert_mem_eq (u[1].uuid, uuid_a, 16);
  ck_assert_mem_eq (u[1].label, "label of the device", 19);
  ck_assert_uint_eq (u[1].first_reg, 1234);
  ck_assert_uint_eq (u[1].last_reg, 1234);
  ck_assert_uint_eq (u[1].sectors, 0);
  ck_assert_mem_eq (u[0].uuid, uuid_b, 16);     /* the other kept */
  memset (&u[1], 0, sizeof u[1]);
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (pick (&s, set_x, u, true, &slot, &changed, err),
                    -EUCLEAN);
  ck_assert_ptr_nonnull (strstr (err, "no entry"));
  ck_assert (!changed);

  /* Detached, or attached elsewhere and clean, with an old entry here:
   * the old entry is invalidated as bcache does, a new slot made. */
  for (int kind = 0; kind < 3; kind++) {
    memset (u, 0, sizeof u);
    memcpy (u[0].uuid, uuid_a, 16);
    memcpy (u[0].label, "old label", 9);
    s = kind == 0 ? bsb (uuid_a, set_x, BCH_BDEV_STATE_NONE)
        : kind == 1 ? bsb (uuid_a, set_x, BCH_BDEV_STATE_STALE)
        : bsb (uuid_a, set_y, BCH_BDEV_STATE_CLEAN);
    ck_assert_int_eq (pick (&s, set_x, u, true, &slot, &changed, err), 0);
    ck_assert (changed);
    ck_assert_uint_eq (slot, 1);
    ck_assert_mem_eq (u[0].uuid, bch_invalid_uuid, 16);
    ck_assert_mem_eq (u[0].label, bch_invalid_uuid, 16);
    ck_assert_uint_eq (u[0].invalidated, 1234);
    ck_assert_mem_eq (u[1].uuid, uuid_a, 16);
    /* ... but not while the cache holds dirty data. */
    memset (u, 0, sizeof u);
    memcpy (u[0].uuid, uuid_a, 16);
    ck_assert_int_eq (pick (&s, set_x, u, false, &slot, &changed, err),
                      -EBUSY);
    ck_assert (!changed);
    ck_assert_mem_eq (u[0].uuid, uuid_a, 16);
  }

  /* Detached, no entry: a new one, nothing invalidated. */
  memset (u, 0, sizeof u);
  s = bsb (uuid_a, set_y, BCH_BDEV_STATE_NONE);
  ck_assert_int_eq (pick (&s, set_x, u, false, &slot, &changed, err), 0);
  ck_assert_uint_eq (slot, 0);
  ck_assert (changed);

  /* Another set holds dirty data for it: refused, naming that set. */
  memset (u, 0, sizeof u);
  memcpy (u[0].uuid, uuid_a, 16);
  s = bsb (uuid_a, set_y, BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (pick (&s, set_x, u, true, &slot, &changed, err), -EBUSY);
  ck_assert_ptr_nonnull (strstr (err, "dirty data"));
  {
    char sy[37];
    bch_uuid_unparse (set_y, sy);
    ck_assert_ptr_nonnull (strstr (err, sy));
  }
  ck_assert (!changed);
  ck_assert_mem_eq (u[0].uuid, uuid_a, 16);

  /* No free slot. */
  for (unsigned i = 0; i < NSLOTS; i++)
    memcpy (u[i].uuid, uuid_b, 16), u[i].uuid[15] = (uint8_t) i;
  s = bsb (uuid_a, set_x, BCH_BDEV_STATE_NONE);
  ck_assert_int_eq (pick (&s, set_x, u, true, &slot, &changed, err), -ENOSPC);
}
END_TEST

/* ---- probe, attach, set_state over a store ----------------------------------------- */

/* A store of size bytes holding make-bcache -B's superblock. */
static struct mem_backing *
store_with_bdev (uint64_t size, uint8_t area[BCH_SB_AREA_SIZE])
{
  struct mem_backing *mb = mem_backing_new (size);

  make_bdev_area (area);
  mem_backing_poke (mb, area, BCH_SB_AREA_SIZE, BCH_SB_OFFSET);
  return mb;
}

static struct bch_sb
sb_on_store (struct mem_backing *mb)
{
  uint8_t area[BCH_SB_AREA_SIZE];
  struct bch_sb s;
  struct bch_diag d;

  mem_backing_peek (mb, area, sizeof area, BCH_SB_OFFSET);
  ck_assert_msg (bch_bdev_sb_decode (area, sizeof area, 0, &s, &d) == BCH_OK,
                 "%s", d.msg);
  return s;
}

/* The state the store's superblock has now, and the writes it got. */
static unsigned
state_on_store (struct mem_backing *mb)
{
  struct bch_sb s = sb_on_store (mb);
  return bch_bdev_state (&s);
}

static uint64_t
writes_to (struct mem_backing *mb)
{
  struct mem_backing_stats st;
  mem_backing_get_stats (mb, &st);
  return st.writes;
}

static int
set_state (struct bcf_bdev *bd, const struct bcf_backing *b,
           enum bch_bdev_state state, char *err)
{
  return bcf_bdev_set_state (bd, b, state, err, 512);
}

START_TEST (test_probe)
{
  uint8_t area[BCH_SB_AREA_SIZE];
  struct mem_backing *mb;
  struct bcf_backing b;
  struct bcf_bdev *bd;
  struct bch_sb s;
  char err[512] = "";

  /* Nothing there: a plain export. */
  mb = mem_backing_new (16 * MiB);
  b = mem_backing_get (mb);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), 0);
  ck_assert_ptr_null (bd);
  mem_backing_free (mb);

  /* make-bcache -B (and a failed read is tried again). */
  mb = store_with_bdev (16 * MiB, area);
  b = mem_backing_get (mb);
  mem_backing_fail_nth (mb, MEM_BACKING_READ, 1, EIO);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), 1);
  ck_assert_uint_eq (bcf_bdev_data_offset (bd), 8192);
  bcf_bdev_super (bd, &s);
  ck_assert_uint_eq (s.version, BCACHE_SB_VERSION_BDEV);
  ck_assert_uint_eq (bch_bdev_state (&s), BCH_BDEV_STATE_NONE);
  ck_assert_mem_eq (s.uuid, area + 40, 16);
  bcf_bdev_free (bd);

  /* A read that keeps failing: an error, not a plain export. */
  {
    int id = mem_backing_fail_range (mb, MEM_BACKING_READ, 0, 0, EIO);
    ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), -EIO);
    ck_assert_ptr_nonnull (strstr (err, "first 8 KiB"));
    mem_backing_fail_range_clear (mb, id);
  }

  /* Damaged (one byte inside the checksum): refused, not a plain export. */
  area[72] ^= 1;
  mem_backing_poke (mb, area, sizeof area, BCH_SB_OFFSET);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), -EUCLEAN);
  ck_assert_ptr_null (bd);
  ck_assert_ptr_nonnull (strstr (err, "checksum"));
  /* An unknown version (2, no longer accepted by the kernel): refused. */
  area[72] ^= 1;
  area[16] = 2;
  bch_put_le64 (area, bch_sb_csum (area, sizeof area));
  mem_backing_poke (mb, area, sizeof area, BCH_SB_OFFSET);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), -EMEDIUMTYPE);
  /* A cache device's superblock: a plain export (today's behaviour). */
  area[16] = BCACHE_SB_VERSION_CDEV;
  bch_put_le64 (area, bch_sb_csum (area, sizeof area));
  mem_backing_poke (mb, area, sizeof area, BCH_SB_OFFSET);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), 0);
  mem_backing_free (mb);

  /* A data offset past the end of the store: no data region. */
  mb = store_with_bdev (8192, area);
  b = mem_backing_get (mb);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), -EUCLEAN);
  ck_assert_ptr_nonnull (strstr (err, "leaves no data"));
  mem_backing_free (mb);
  /* Smaller than 8 KiB: nothing to look at. */
  mb = mem_backing_new (4096);
  b = mem_backing_get (mb);
  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), 0);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_attach_and_state)
{
  uint8_t area[BCH_SB_AREA_SIZE], after[BCH_SB_AREA_SIZE];
  struct mem_backing_stats st;
  struct mem_backing *mb = store_with_bdev (16 * MiB, area);
  struct bcf_backing b = mem_backing_get (mb);
  struct bcf_bdev *bd;
  struct bch_sb s;
  char err[512] = "";

  ck_assert_int_eq (bcf_bdev_probe (&b, &bd, err, sizeof err), 1);
  /* No state before an attach. */
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_DIRTY, err), -EINVAL);

  /* Attach: set_uuid and clean reach the store, with FUA, and nothing
   * else changes there. */
  mem_backing_reset_stats (mb);
  ck_assert_int_eq (bcf_bdev_attach (bd, &b, set_x, err, sizeof err), 0);
  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.writes, 1);
  ck_assert_uint_eq (st.fua_writes, 1);
  s = sb_on_store (mb);
  ck_assert_mem_eq (s.set_uuid, set_x, 16);
  ck_assert_uint_eq (bch_bdev_state (&s), BCH_BDEV_STATE_CLEAN);
  mem_backing_peek (mb, after, sizeof after, BCH_SB_OFFSET);
  for (size_t i = 8; i < sizeof after; i++)
    if ((i < 56 || i >= 72) && (i < 104 || i >= 112))
      ck_assert_msg (after[i] == area[i], "byte %zu changed", i);
  /* Attached already: nothing written. */
  ck_assert_int_eq (bcf_bdev_attach (bd, &b, set_x, err, sizeof err), 0);
  ck_assert_uint_eq (writes_to (mb), 1);

  /* Dirty, once (its set kept); clean, once; nothing else. */
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_DIRTY, err), 0);
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_DIRTY, err), 0);
  ck_assert_uint_eq (writes_to (mb), 2);
  ck_assert_uint_eq (state_on_store (mb), BCH_BDEV_STATE_DIRTY);
  ck_assert_mem_eq (sb_on_store (mb).set_uuid, set_x, 16);
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_CLEAN, err), 0);
  ck_assert_uint_eq (writes_to (mb), 3);
  ck_assert_uint_eq (state_on_store (mb), BCH_BDEV_STATE_CLEAN);
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_NONE, err), -EINVAL);

  /* One failed write is tried again. */
  mem_backing_reset_stats (mb);
  mem_backing_fail_nth (mb, MEM_BACKING_WRITE, 1, EIO);
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_DIRTY, err), 0);
  ck_assert_uint_eq (writes_to (mb), 2);
  ck_assert_uint_eq (state_on_store (mb), BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_CLEAN, err), 0);

  /* A write that keeps failing: the error is returned, memory and store
   * unchanged, and the next attempt writes again. */
  {
    int id = mem_backing_fail_range (mb, MEM_BACKING_WRITE, BCH_SB_OFFSET,
                                     BCH_SB_AREA_SIZE, EIO);
    ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_DIRTY, err), -EIO);
    mem_backing_fail_range_clear (mb, id);
  }
  ck_assert_ptr_nonnull (strstr (err, "dirty"));
  bcf_bdev_super (bd, &s);
  ck_assert_uint_eq (bch_bdev_state (&s), BCH_BDEV_STATE_CLEAN);
  ck_assert_uint_eq (state_on_store (mb), BCH_BDEV_STATE_CLEAN);
  ck_assert_int_eq (set_state (bd, &b, BCH_BDEV_STATE_DIRTY, err), 0);
  ck_assert_uint_eq (state_on_store (mb), BCH_BDEV_STATE_DIRTY);

  /* Attached to another set (here: this one, dirty, seen from set y):
   * an attach there is refused. */
  ck_assert_int_eq (bcf_bdev_attach (bd, &b, set_y, err, sizeof err), -EBUSY);
  bcf_bdev_free (bd);
  mem_backing_free (mb);
}
END_TEST

/* ---- the engine with a backing-device export -------------------------------------- */

struct fx {
  char path[320];
  struct mem_backing *mb;
  struct bcf_backing b;
  struct bcf_bdev *bd;
  struct bcf_cache_opts opts;
  struct bcf_cache *c;
  struct bcf_req *r;
};

static void
fx_init (struct fx *f, const char *name, struct mem_backing *mb)
{
  memset (f, 0, sizeof *f);
  snprintf (f->path, sizeof f->path, "%s/%s", tmpdir, name);
  f->mb = mb;
  f->b = mem_backing_get (mb);
  f->opts.path = f->path;
  f->opts.create_size = 64 * MiB;
  f->opts.format = BCF_FORMAT_AUTO;
  f->opts.bucket_sectors = 256;
  f->opts.block_sectors = BLOCK / 512;
  f->opts.backing = f->b;
  f->opts.log = log_cb;
}

/* Probe the store, open the cache with what it holds, attach as the
 * filter does.  Returns bcf_cache_open's result (err holds its message). */
static int
fx_open (struct fx *f, char *err, size_t errlen)
{
  struct bcf_req_opts ro = { .mode = BCF_MODE_WRITETHROUGH };
  int r;

  bcf_bdev_free (f->bd);
  f->bd = NULL;
  ck_assert_int_ge (bcf_bdev_probe (&f->b, &f->bd, err, errlen), 0);
  f->opts.bdev = f->bd;
  r = bcf_cache_open (&f->opts, &f->c, err, errlen);
  if (r < 0)
    return r;
  if (f->bd)
    ck_assert_int_eq (bcf_bdev_attach (f->bd, &f->b,
                                       bcf_cache_super (f->c)->set_uuid,
                                       err, errlen), 0);
  ro.offset = f->bd ? bcf_bdev_data_offset (f->bd) : 0;
  f->r = bcf_req_new (f->c, &ro);
  ck_assert_ptr_nonnull (f->r);
  return 0;
}

static void
fx_open_ok (struct fx *f)
{
  char err[512] = "";
  int r = fx_open (f, err, sizeof err);
  ck_assert_msg (r == 0, "open: %s (%s)", err, strerror (-r));
}

static void
fx_close (struct fx *f)
{
  bcf_req_free (f->r);
  f->r = NULL;
  if (f->c)
    ck_assert_int_eq (bcf_cache_close (f->c), 0);
  f->c = NULL;
}

static void
fx_free (struct fx *f)
{
  fx_close (f);
  bcf_bdev_free (f->bd);
  mem_backing_free (f->mb);
  unlink (f->path);
}

/* Is [off, off + len) of the backing store (not client offsets) a hit? */
static bool
cached (struct fx *f, uint64_t off, uint64_t len)
{
  struct bcf_extent e[16];
  unsigned n;

  bcf_req_drain (f->r);
  ck_assert_int_eq (bcf_lookup (f->c, off, len, e, 16, &n), 0);
  return n == 1 && e[0].kind == BCF_EXTENT_HIT && e[0].len == len;
}

/* Rewrite the store's backing superblock with this set and state, as a
 * kernel (or another host) would have. */
static void
set_store_state (struct mem_backing *mb, const uint8_t set[16],
                 unsigned state)
{
  uint8_t area[BCH_SB_AREA_SIZE];

  mem_backing_peek (mb, area, sizeof area, BCH_SB_OFFSET);
  bch_bdev_sb_set_state (area, set, state);
  mem_backing_poke (mb, area, sizeof area, BCH_SB_OFFSET);
}

START_TEST (test_engine_backing_sectors)
{
  uint8_t area[BCH_SB_AREA_SIZE], data[16384], got[16384];
  struct fx f;
  uint8_t uuid[16];
  uint64_t bytes;
  struct bch_sb s;

  fx_init (&f, "keys.img", store_with_bdev (32 * MiB, area));
  fx_open_ok (&f);
  /* The identity is the device's uuid; no size recorded; slot 0. */
  ck_assert (bcf_cache_owner (f.c, uuid, &bytes));
  ck_assert_mem_eq (uuid, area + 40, 16);
  ck_assert_uint_eq (bytes, 0);
  ck_assert_uint_eq (f.c->inode, 0);
  ck_assert_uint_eq (f.c->uuids[0].sectors, 0);
  /* Attached: the store's superblock names the cache set, clean. */
  s = sb_on_store (f.mb);
  ck_assert_mem_eq (s.set_uuid, bcf_cache_super (f.c)->set_uuid, 16);
  ck_assert_uint_eq (bch_bdev_state (&s), BCH_BDEV_STATE_CLEAN);

  /* A write at client offset 1 MiB lands at backing byte 1 MiB + 8 KiB,
   * and so does its key; the superblock is untouched. */
  for (size_t i = 0; i < sizeof data; i++)
    data[i] = (uint8_t) (i * 7 + 1);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, data, sizeof data, 1 * MiB,
                                   false), 0);
  mem_backing_peek (f.mb, got, sizeof got, 1 * MiB + 8192);
  ck_assert_mem_eq (got, data, sizeof data);
  ck_assert (cached (&f, 1 * MiB + 8192, sizeof data));
  ck_assert (!cached (&f, 1 * MiB, 8192));
  s = sb_on_store (f.mb);
  ck_assert_uint_eq (bch_bdev_state (&s), BCH_BDEV_STATE_CLEAN);
  /* A read at client offset 0 is backing byte 8192 (not the sb). */
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, 4096, 0), 0);
  mem_backing_peek (f.mb, data, 4096, 8192);
  ck_assert_mem_eq (got, data, 4096);
  ck_assert (cached (&f, 8192, 4096));
  /* The last client byte is the last backing byte. */
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, 4096,
                                  32 * MiB - 8192 - 4096), 0);
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, 4096, 32 * MiB - 8192),
                    -ERANGE);

  /* Reopened, attached to this set: the same slot, still cached. */
  fx_close (&f);
  f.opts.format = BCF_FORMAT_NEVER;
  fx_open_ok (&f);
  ck_assert_uint_eq (f.c->inode, 0);
  ck_assert (cached (&f, 1 * MiB + 8192, sizeof data));
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, 1 * MiB), 0);
  for (size_t i = 0; i < sizeof got; i++)
    ck_assert_uint_eq (got[i], (uint8_t) (i * 7 + 1));
  fx_free (&f);
}
END_TEST

/* The device was detached (state none), or attached to another cache
 * set, and written meanwhile: the old entry must not be used. */
static void
written_while_away (unsigned state, const uint8_t *set)
{
  uint8_t area[BCH_SB_AREA_SIZE], newer[8192], got[8192];
  uint8_t set_here[16];
  struct fx f;

  fx_init (&f, "away.img", store_with_bdev (32 * MiB, area));
  fx_open_ok (&f);
  memset (got, 0x11, sizeof got);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, got, sizeof got, 64 * 1024,
                                   false), 0);
  ck_assert (cached (&f, 64 * 1024 + 8192, sizeof got));
  memcpy (set_here, bcf_cache_super (f.c)->set_uuid, 16);
  fx_close (&f);

  /* Away: written without this cache, superblock changed. */
  memset (newer, 0x22, sizeof newer);
  mem_backing_poke (f.mb, newer, sizeof newer, 64 * 1024 + 8192);
  set_store_state (f.mb, set ? set : set_here, state);

  f.opts.format = BCF_FORMAT_NEVER;
  fx_open_ok (&f);
  ck_assert_uint_eq (f.c->inode, 1);
  ck_assert_mem_eq (f.c->uuids[0].uuid, bch_invalid_uuid, 16);
  ck_assert_mem_eq (f.c->uuids[1].uuid, area + 40, 16);
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, 64 * 1024), 0);
  ck_assert_mem_eq (got, newer, sizeof got);
  /* Attached here now; and so it stays across a reopen. */
  {
    struct bch_sb s = sb_on_store (f.mb);
    ck_assert_mem_eq (s.set_uuid, set_here, 16);
    ck_assert_uint_eq (bch_bdev_state (&s), BCH_BDEV_STATE_CLEAN);
  }
  fx_close (&f);
  fx_open_ok (&f);
  ck_assert_uint_eq (f.c->inode, 1);
  ck_assert_mem_eq (f.c->uuids[0].uuid, bch_invalid_uuid, 16);
  fx_free (&f);
}

START_TEST (test_engine_detached_meanwhile)
{
  static const uint8_t zero[16];
  written_while_away (BCH_BDEV_STATE_NONE, zero);
}
END_TEST

START_TEST (test_engine_other_set_meanwhile)
{
  written_while_away (BCH_BDEV_STATE_CLEAN, set_y);
}
END_TEST

START_TEST (test_engine_refuses_dirty_elsewhere)
{
  uint8_t area[BCH_SB_AREA_SIZE];
  struct fx f;
  char err[512] = "";
  struct bcf_device_verdict verdict;

  /* A blank cache device is not formatted for it. */
  fx_init (&f, "dirty.img", store_with_bdev (32 * MiB, area));
  set_store_state (f.mb, set_y, BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (fx_open (&f, err, sizeof err), -EBUSY);
  ck_assert_ptr_nonnull (strstr (err, "dirty data"));
  ck_assert_int_eq (bcf_device_probe (f.path, NULL, &verdict, err,
                                      sizeof err), 0);
  ck_assert_int_eq (verdict.kind, BCF_DEVICE_BLANK);

  /* Nor is a live cache of another set opened for it. */
  set_store_state (f.mb, set_y, BCH_BDEV_STATE_NONE);
  fx_open_ok (&f);
  fx_close (&f);
  set_store_state (f.mb, set_y, BCH_BDEV_STATE_DIRTY);
  ck_assert_int_eq (fx_open (&f, err, sizeof err), -EBUSY);
  /* Nor reformatted over (force): its own dirty data would be lost. */
  {
    uint8_t set_here[16];
    struct bch_sb cs;
    struct bch_diag d;
    uint8_t sbuf[BCH_SB_AREA_SIZE];
    FILE *fp = fopen (f.path, "rb");
    ck_assert_ptr_nonnull (fp);
    ck_assert_int_eq (fseek (fp, BCH_SB_OFFSET, SEEK_SET), 0);
    ck_assert_uint_eq (fread (sbuf, 1, sizeof sbuf, fp), sizeof sbuf);
    fclose (fp);
    ck_assert_int_eq (bch_sb_decode (sbuf, sizeof sbuf, &cs, &d), BCH_OK);
    memcpy (set_here, cs.set_uuid, 16);
    set_store_state (f.mb, set_here, BCH_BDEV_STATE_DIRTY);
    f.opts.format = BCF_FORMAT_FORCE;
    ck_assert_int_eq (fx_open (&f, err, sizeof err), -EBUSY);
    fp = fopen (f.path, "rb");
    ck_assert_int_eq (fseek (fp, BCH_SB_OFFSET, SEEK_SET), 0);
    ck_assert_uint_eq (fread (sbuf, 1, sizeof sbuf, fp), sizeof sbuf);
    fclose (fp);
    ck_assert_int_eq (bch_sb_decode (sbuf, sizeof sbuf, &cs, &d), BCH_OK);
    ck_assert_mem_eq (cs.set_uuid, set_here, 16);
  }
  fx_free (&f);
}
END_TEST

/* A second device attached to the same cache set gets a slot of its own;
 * the first one's entry and data are kept. */
START_TEST (test_engine_two_devices)
{
  uint8_t area[BCH_SB_AREA_SIZE], a_data[4096], got[4096];
  struct mem_backing *mb_b;
  struct fx f;

  fx_init (&f, "two.img", store_with_bdev (32 * MiB, area));
  fx_open_ok (&f);
  memset (a_data, 0xaa, sizeof a_data);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a_data, sizeof a_data, 0,
                                   false), 0);
  fx_close (&f);

  /* Device B: another uuid, detached. */
  mb_b = store_with_bdev (32 * MiB, area);
  area[40] ^= 0xff;
  bch_put_le64 (area, bch_sb_csum (area, sizeof area));
  mem_backing_poke (mb_b, area, sizeof area, BCH_SB_OFFSET);
  {
    struct mem_backing *mb_a = f.mb;
    struct bcf_bdev *bd_a = f.bd;

    f.mb = mb_b;
    f.b = mem_backing_get (mb_b);
    f.opts.backing = f.b;
    f.bd = NULL;
    fx_open_ok (&f);
    ck_assert_uint_eq (f.c->inode, 1);
    ck_assert (!bch_uuid_is_zero (f.c->uuids[0].uuid));
    ck_assert_mem_ne (f.c->uuids[0].uuid, bch_invalid_uuid, 16);
    fx_close (&f);
    bcf_bdev_free (f.bd);
    mem_backing_free (mb_b);
    f.mb = mb_a;
    f.b = mem_backing_get (mb_a);
    f.opts.backing = f.b;
    f.bd = bd_a;
  }
  /* A again: slot 0, its data still cached. */
  fx_open_ok (&f);
  ck_assert_uint_eq (f.c->inode, 0);
  ck_assert (cached (&f, 8192, sizeof a_data));
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, 0), 0);
  ck_assert_mem_eq (got, a_data, sizeof got);
  fx_free (&f);
}
END_TEST

/* ---- the entry read by a plain export -------------------------------------------- */

START_TEST (test_plain_entry_without_size)
{
  uint8_t area[BCH_SB_AREA_SIZE], data[4096], got[4096];
  struct fx f;
  char err[512] = "";
  int r;

  /* A cache whose slot 0 was written for a backing device (sectors 0,
   * as the kernel writes it), holding a block at backing byte 8192. */
  fx_init (&f, "nosize.img", store_with_bdev (32 * MiB, area));
  fx_open_ok (&f);
  memset (data, 0x5c, sizeof data);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, data, sizeof data, 0, false),
                    0);
  fx_close (&f);

  /* Opened as a plain export (the whole device) under that uuid: the
   * size is not recorded, so only the uuid is compared; keys are export
   * sectors = backing sectors. */
  bcf_bdev_free (f.bd);
  f.bd = NULL;
  f.opts.bdev = NULL;
  memcpy (f.opts.backing_uuid, area + 40, 16);
  f.opts.format = BCF_FORMAT_NEVER;
  r = bcf_cache_open (&f.opts, &f.c, err, sizeof err);
  ck_assert_msg (r == 0, "%s", err);
  f.r = bcf_req_new (f.c, &(struct bcf_req_opts) { .mode = BCF_MODE_WRITETHROUGH });
  ck_assert (cached (&f, 8192, sizeof data));
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, 8192), 0);
  ck_assert_mem_eq (got, data, sizeof got);
  fx_close (&f);

  /* Another uuid: refused, as another export. */
  f.opts.backing_uuid[0] ^= 1;
  ck_assert_int_eq (bcf_cache_open (&f.opts, &f.c, err, sizeof err), -EEXIST);
  ck_assert_ptr_nonnull (strstr (err, "another export"));
  ck_assert_ptr_nonnull (strstr (err, "size not recorded"));
  f.c = NULL;
  fx_free (&f);
}
END_TEST

static Suite *
bdev_suite (void)
{
  Suite *s = suite_create ("bdev");
  TCase *t = tcase_create ("bdev");

  tcase_set_timeout (t, 120);
  tcase_add_test (t, test_relation);
  tcase_add_test (t, test_pick_slot);
  tcase_add_test (t, test_probe);
  tcase_add_test (t, test_attach_and_state);
  tcase_add_test (t, test_engine_backing_sectors);
  tcase_add_test (t, test_engine_detached_meanwhile);
  tcase_add_test (t, test_engine_other_set_meanwhile);
  tcase_add_test (t, test_engine_refuses_dirty_elsewhere);
  tcase_add_test (t, test_engine_two_devices);
  tcase_add_test (t, test_plain_entry_without_size);
  suite_add_tcase (s, t);
  return s;
}

int
main (void)
{
  int r;

  test_tmpdir (tmpdir, sizeof tmpdir, "bcf-bdev");
  r = test_main (bdev_suite ());
  rmdir (tmpdir);
  return r;
}
