/* bcachefilter engine: format, first registration, open.
 *
 * Design
 * ------
 * What the device holds decides what open does (classify: the same
 * verdict bcf_device_probe gives callers who ask first, bcachefilter/
 * probe.h):
 *
 *   BLANK                      format it (policy auto or force)
 *   MAKE_BCACHE (a cache       first registration, like the kernel
 *     superblock, CACHE_SYNC   (research/bcache.md §1.9)
 *     clear)
 *   CACHE (CACHE_SYNC set)     a live cache: read the journal, prios,
 *                              uuids and btree, replay, check identity
 *   anything else              refused (policy force overwrites it)
 *
 * First registration (also the second half of a format): journal buckets
 * = clamp(nbuckets >> 7, 2, 256) at first_bucket + i (with a floor, see
 * journal_buckets_for); free lists are filled from the other buckets,
 * their gens bumped to 1; prios and gens are written; a uuid bucket records the backing export (slot 0: its uuid, label and
 * size in sectors); an empty root leaf (key MAX_KEY) is written; journal
 * entries commit root, uuid and prio pointers; LAST, the superblock is
 * rewritten as version 3 with CACHE_SYNC and d[] filled in.  Until that
 * final write the device still reads as blank / make-bcache, so a crash
 * during format just formats again.  (A forced format of a live cache
 * first zeroes its superblock for the same reason.)
 *
 * Identity: the uuid entry in slot 0 names the (plain) export the cache
 * belongs to.  Opening against another export (different uuid, or a
 * different size: a resized export would make cached offsets lie) is
 * refused unless discard_foreign is set, and even then not while the
 * cache holds dirty data — that data exists nowhere else.  An entry with
 * size 0 records no size (the kernel's entries for backing devices): only
 * its uuid is compared.  When the export is a bcache backing device
 * (opts.bdev), its slot is the kernel's choice instead (core/bdev.c:
 * found by the device's uuid, or a new one, the old one invalidated where
 * the device was written without this cache since), and a device that
 * any cache set holds dirty data for is refused before a format would
 * make an empty cache for it.  The whole uuid array is kept and
 * rewritten, so slots of other devices survive.
 *
 * Open runs: journal_read -> prio chain (gens) -> uuid bucket -> btree
 * load -> journal replay -> initial mark (metadata buckets by layout, data
 * buckets by a full GC pass) -> free lists from unused buckets -> prio
 * write -> checkpoint (so the replayed keys are in the tree on disk and
 * the journal can be reused).
 *
 * Locking: single-threaded (open and close run before / after any other
 * call).
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bcachefilter/bdev.h"
#include "bcachefilter/probe.h"
#include "engine.h"
#include "super.h"

static void
random_bytes (uint8_t *p, size_t n)
{
  FILE *f = fopen ("/dev/urandom", "re");
  size_t got = f ? fread (p, 1, n, f) : 0;

  if (f)
    fclose (f);
  if (got != n) {
    /* Fall back to the clock; uniqueness is all that matters here. */
    uint64_t x = bcf_now_ns ();
    for (size_t i = 0; i < n; i++) {
      x ^= x << 13; x ^= x >> 7; x ^= x << 17;
      p[i] = (uint8_t) x;
    }
  }
}

/* Geometry fields derived from the superblock. */
static void
set_geometry (struct bcf_cache *c)
{
  c->bucket_sectors = bch_sb_bucket_sectors (&c->sb);
  c->bucket_bytes = c->bucket_sectors << BCH_SECTOR_SHIFT;
  c->block_bytes = (unsigned) c->sb.block_size << BCH_SECTOR_SHIFT;
  c->set_magic = bch_set_magic (&c->sb);
}

/* ---- what the device holds (bcachefilter/probe.h) ---------------------------- */

/* Offset of the first non-zero byte of buf (which starts at device
 * offset off), or UINT64_MAX. */
static uint64_t
first_nonzero (const uint8_t *buf, size_t len, uint64_t off)
{
  for (size_t i = 0; i < len; i++)
    if (buf[i])
      return off + i;
  return UINT64_MAX;
}

/* A device is blank only if nothing else's signature is there either:
 * btrfs keeps its superblock at 64 KiB, md and GPT keep copies at the
 * end.  Find the first non-zero byte in the first and the last MiB
 * (UINT64_MAX: none).  Returns 0 or -errno. */
static int
edges_first_nonzero (struct bcf_io *io, uint64_t *at)
{
  const uint64_t size = bcf_io_size (io);
  const size_t span = 1 << 20;
  uint8_t *buf = bcf_buf_alloc (span);
  int r = 0;

  *at = UINT64_MAX;
  if (!buf)
    return -ENOMEM;
  for (int i = 0; i < 2 && r == 0 && *at == UINT64_MAX; i++) {
    uint64_t off = i == 0 ? 0 : size > span ? size - span : 0;
    size_t len = size < span ? (size_t) size / 4096 * 4096 : span;
    r = bcf_io_pread (io, buf, len, off);
    if (r == 0)
      *at = first_nonzero (buf, len, off);
  }
  bcf_buf_free (buf, span);
  return r;
}

/* The one classification of a device (the table in bcachefilter/
 * probe.h), from its first 8 KiB (head) and, when those are zero, its
 * edges.  super_open and bcf_device_probe both decide by it.  Returns 0,
 * or -errno if the edges could not be read. */
static int
classify (struct bcf_io *io, const uint8_t *head, struct bcf_device_verdict *v)
{
  struct bch_diag d;
  enum bch_status st;
  int r;

  if (bch_is_zero (head, 2 * BCH_SB_AREA_SIZE)) {
    if ((r = edges_first_nonzero (io, &v->data_at)) < 0)
      return r;
    v->kind = v->data_at == UINT64_MAX ? BCF_DEVICE_BLANK : BCF_DEVICE_FOREIGN;
    if (v->kind == BCF_DEVICE_FOREIGN)
      snprintf (v->reason, sizeof v->reason, "its superblock area is zero "
                "but byte %" PRIu64 " is not (a filesystem, RAID or "
                "partition table signature?)", v->data_at);
    return 0;
  }
  st = bch_sb_decode (head + BCH_SB_OFFSET, BCH_SB_AREA_SIZE, &v->sb, &d);
  if (st == BCH_OK)
    st = bch_sb_validate (&v->sb, v->size >> BCH_SECTOR_SHIFT, &d);
  switch (st) {
  case BCH_OK:
    v->kind = v->sb.flags & BCH_CACHE_SYNC ? BCF_DEVICE_CACHE
              : BCF_DEVICE_MAKE_BCACHE;
    return 0;
  case BCH_ERR_MAGIC:
    v->kind = BCF_DEVICE_FOREIGN;
    break;
  case BCH_ERR_BACKING:
    v->kind = BCF_DEVICE_BACKING;
    break;
  default:
    v->kind = BCF_DEVICE_CORRUPT;
    v->error = -EUCLEAN;
    snprintf (v->reason, sizeof v->reason, "bad bcache superblock: %s",
              d.msg);
    return 0;
  }
  snprintf (v->reason, sizeof v->reason, "%s", d.msg);
  return 0;
}

/* Classify the device open on io into *v.  Returns 0, or -errno with a
 * message in err. */
static int
probe_io (struct bcf_io *io, struct bcf_device_verdict *v, char *err,
          size_t errlen)
{
  const char *path = bcf_io_path (io);
  uint8_t *buf;
  int r;

  memset (v, 0, sizeof *v);
  v->size = bcf_io_size (io);
  v->data_at = UINT64_MAX;
  if (v->size < 2 * BCH_SB_AREA_SIZE) {
    v->kind = BCF_DEVICE_TOO_SMALL;
    snprintf (v->reason, sizeof v->reason, "%" PRIu64 " bytes; a cache "
              "needs more than %u (its superblock is at byte %u)", v->size,
              2 * BCH_SB_AREA_SIZE, BCH_SB_OFFSET);
    return 0;
  }
  buf = bcf_buf_alloc (2 * BCH_SB_AREA_SIZE);
  if (!buf)
    return -ENOMEM;
  r = bcf_io_pread (io, buf, 2 * BCH_SB_AREA_SIZE, 0);
  if (r < 0)
    snprintf (err, errlen, "reading the superblock of %s: %s", path,
              strerror (-r));
  else if ((r = classify (io, buf, v)) < 0)
    snprintf (err, errlen, "reading %s: %s", path, strerror (-r));
  bcf_buf_free (buf, 2 * BCH_SB_AREA_SIZE);
  return r;
}

/* A registered cache, opened read-only as bcf_cache_open will open it
 * for real (every checksum, the journal, prios, uuids and btree): whose
 * export it holds, or CORRUPT with the open's reason. */
static void
check_cache (const char *path, const struct bcf_probe_opts *opts,
             struct bcf_device_verdict *v)
{
  struct bcf_cache_opts o = {
    .path = path, .readonly = true, .io_mode = BCF_IO_SYNC,
    .direct_off = opts->direct_off, .format = BCF_FORMAT_NEVER,
  };
  struct bcf_cache *c;
  int r = bcf_cache_open (&o, &c, v->reason, sizeof v->reason);

  if (r < 0) {
    v->kind = BCF_DEVICE_CORRUPT;
    v->error = r;
    return;
  }
  v->has_owner = bcf_cache_owner (c, v->owner_uuid, &v->owner_bytes);
  v->dirty_bytes = bcf_cache_dirty_bytes (c);
  bcf_cache_close (c);
}

/* A forced format of a cache that holds dirty data loses acknowledged
 * writes, which exist nowhere else: refused unless discard_dirty says it
 * is meant (DESIGN.md: a cache holding dirty data is never discarded
 * silently).  The count comes from a read-only open (check_cache), as
 * bcachefilter-show's; a cache that cannot be opened for it (corrupt:
 * what force is there for) is formatted. */
static int
refuse_losing_dirty (struct bcf_cache *c, struct bcf_device_verdict *v,
                     char *err, size_t errlen)
{
  const struct bcf_probe_opts po = {
    .check = true, .direct_off = c->opts.direct_off,
  };
  const char *path = bcf_io_path (c->io);

  if (c->opts.discard_dirty)
    return 0;
  check_cache (path, &po, v);
  if (v->kind != BCF_DEVICE_CACHE) {
    bcf_log (c, BCF_LOG_WARN, "%s: formatting as forced; its dirty data, if "
             "any, cannot be counted: %s", path, v->reason);
    return 0;
  }
  if (v->dirty_bytes == 0)
    return 0;
  snprintf (err, errlen, "%s holds %" PRIu64 " bytes (%.1f MiB) of dirty "
            "data, writes acknowledged to clients that its export does not "
            "have yet: formatting it would lose them.  Open it with its "
            "export and write them back first (bcachefilter-ctl flush or "
            "detach), or ask for their loss explicitly", path,
            v->dirty_bytes, (double) v->dirty_bytes / (1 << 20));
  return -EBUSY;
}

int
bcf_device_probe (const char *path, const struct bcf_probe_opts *opts,
                  struct bcf_device_verdict *v, char *err, size_t errlen)
{
  static const struct bcf_probe_opts defaults;
  struct bcf_io_opts o = { .path = path, .readonly = true };
  struct bcf_io *io;
  int r;

  if (!opts)
    opts = &defaults;
  o.mode = BCF_IO_SYNC;
  o.direct = opts->direct_off ? BCF_IO_DIRECT_OFF : BCF_IO_DIRECT_AUTO;
  memset (v, 0, sizeof *v);
  if ((r = bcf_io_open (&o, &io, err, errlen)) < 0)
    return r;
  r = probe_io (io, v, err, errlen);
  bcf_io_close (io);
  if (r == 0 && v->kind == BCF_DEVICE_CACHE && opts->check)
    check_cache (path, opts, v);
  return r;
}

static int
write_super (struct bcf_cache *c)
{
  uint8_t *buf = bcf_buf_alloc (BCH_SB_AREA_SIZE);
  int r;

  if (!buf)
    return -ENOMEM;
  bch_sb_encode (&c->sb, buf);
  r = bcf_io_pwrite (c->io, buf, BCH_SB_AREA_SIZE, BCH_SB_OFFSET);
  if (r == 0)
    r = bcf_io_flush (c->io);
  bcf_buf_free (buf, BCH_SB_AREA_SIZE);
  return r;
}

/* Under super_lock, which serialises the superblock's writers. */
static int
set_write_intent_locked (struct bcf_cache *c, bool on)
{
  struct bch_sb old;
  int r;

  old = c->sb;
  if (on) {
    c->sb.feature_incompat |= BCF_FEATURE_INCOMPAT_WRITE_INTENT;
    if (c->sb.version < BCACHE_SB_VERSION_CDEV_WITH_FEATURES)
      c->sb.version = BCACHE_SB_VERSION_CDEV_WITH_FEATURES;
  }
  else {
    c->sb.feature_incompat &= ~BCF_FEATURE_INCOMPAT_WRITE_INTENT;
    /* Version 5 only for features (bcache-tools' rule): without any,
     * back to the version every kernel and bcache-super-show knows. */
    if (!c->sb.feature_compat && !c->sb.feature_incompat &&
        !c->sb.feature_ro_compat)
      c->sb.version = BCACHE_SB_VERSION_CDEV_WITH_UUID;
  }
  r = memcmp (&old, &c->sb, sizeof old) ? write_super (c) : 0;
  if (r < 0)
    c->sb = old;
  return r;
}

int
super_set_write_intent (struct bcf_cache *c, bool on)
{
  int r;

  pthread_mutex_lock (&c->super_lock);
  r = set_write_intent_locked (c, on);
  pthread_mutex_unlock (&c->super_lock);
  return r;
}

/* Clear CACHE_SYNC on disk, so the next open runs first registration
 * (starts empty) instead of trusting keys.  See bcf_cache_abandon.
 * The set gets a new uuid too: every journal entry's magic derives from
 * it, and first registration starts the journal at seq 1, so with the
 * old uuid the old entries still in the journal buckets would be valid
 * and newer, and the open after the first registration would take the
 * newest of them for its root: the abandoned tree, older than the export.
 * (A device made by make-bcache has a uuid no journal entry was written
 * with; ours are new sets to the kernel too, which runs the same first
 * registration.) */
int
super_abandon (struct bcf_cache *c)
{
  int r;

  pthread_mutex_lock (&c->super_lock);
  c->sb.flags &= ~BCH_CACHE_SYNC;
  random_bytes (c->sb.set_uuid, 16);
  r = write_super (c);
  pthread_mutex_unlock (&c->super_lock);
  return r;
}

/* ---- uuids ------------------------------------------------------------------ */

/* The uuid array: one bucket of 128-byte entries (bcache.md §1.8), kept
 * whole in memory so that a rewrite keeps every slot, ours or not (a
 * cache the kernel used may hold several backing devices). */
static int
uuids_alloc (struct bcf_cache *c)
{
  free (c->uuids);
  c->nr_uuids = (unsigned) bch_uuids_per_bucket (c->bucket_bytes);
  c->uuids = calloc (c->nr_uuids, sizeof *c->uuids);
  return c->uuids ? 0 : -ENOMEM;
}

/* Slot 0 for a plain export: its uuid, label and size in sectors. */
static void
our_uuid_entry (struct bcf_cache *c, struct bch_uuid_entry *u)
{
  memset (u, 0, sizeof *u);
  memcpy (u->uuid, c->opts.backing_uuid, 16);
  memcpy (u->label, c->opts.backing_label, 32);
  u->first_reg = u->last_reg = (uint32_t) time (NULL);
  u->sectors = c->backing_sectors;
}

/* The slot of a backing-device export, as the kernel's attach picks it
 * (bcf_bdev_pick_slot; entries of a device that was written without
 * this cache since are invalidated, never while dirty data exists).
 * Sets c->inode; *changed when c->uuids must be written. */
static int
bdev_slot (struct bcf_cache *c, bool *changed, char *err, size_t errlen)
{
  struct bch_sb b;
  unsigned slot;
  int r;

  bcf_bdev_super (c->opts.bdev, &b);
  r = bcf_bdev_pick_slot (&b, c->sb.set_uuid, c->uuids, c->nr_uuids,
                          (uint32_t) time (NULL),
                          btree_dirty_sectors (c) == 0, &slot, changed,
                          err, errlen);
  if (r == 0)
    c->inode = slot;
  return r;
}

/* A backing device that a cache set holds dirty data for can be served
 * only by that set: refuse before a format makes a new, empty one (what
 * an attach to a set with no entries would say).  set_uuid is the set
 * the format keeps (a make-bcache device's), or NULL for a new one. */
static int
bdev_refuse_format (struct bcf_cache *c, const uint8_t *set_uuid, char *err,
                    size_t errlen)
{
  struct bch_uuid_entry none = { 0 };
  struct bch_sb b;
  unsigned slot;
  bool changed;

  if (!c->opts.bdev)
    return 0;
  bcf_bdev_super (c->opts.bdev, &b);
  return bcf_bdev_pick_slot (&b, set_uuid, &none, 1, 0, true, &slot,
                             &changed, err, errlen);
}

/* Write the uuid array to a new bucket and release the old one once a
 * journal entry points at the new one. */
static int
uuid_write (struct bcf_cache *c)
{
  uint64_t nb, old = c->uuid_bucket;
  bool had_old = c->sb.flags & BCH_CACHE_SYNC;
  uint8_t *buf;
  int r;

  if ((r = alloc_bucket_nowait (c, RESERVE_BTREE, &nb)) < 0)
    return r;
  buf = bcf_buf_alloc (c->bucket_bytes);
  if (!buf) {
    alloc_release_meta (c, nb);
    return -ENOMEM;
  }
  memset (buf, 0, c->bucket_bytes);
  for (unsigned i = 0; i < c->nr_uuids; i++)
    bch_uuid_entry_encode (&c->uuids[i], buf + (size_t) i * BCH_UUID_ENTRY_SIZE);
  r = bcf_io_pwrite (c->io, buf, c->bucket_bytes, nb * c->bucket_bytes);
  bcf_buf_free (buf, c->bucket_bytes);
  /* Durable before it is published: every journal entry names it, and
   * an ordinary entry does not flush first (journal.c). */
  if (r == 0)
    r = bcf_io_flush (c->io);
  if (r < 0) {
    /* Nothing names it yet: back to the allocator. */
    alloc_release_meta (c, nb);
    return r;
  }
  /* Under the journal's lock: journal_write_locked names it in every
   * entry, and a detach (super_detach) writes it while the journal
   * thread runs. */
  pthread_mutex_lock (&c->journal.lock);
  c->uuid_bucket = nb;
  pthread_mutex_unlock (&c->journal.lock);
  r = journal_meta (c);
  if (r == 0 && had_old && old != nb)
    alloc_release_meta (c, old);
  return r;
}

static int
uuid_read (struct bcf_cache *c, const struct bkey *k, char *err,
           size_t errlen)
{
  uint64_t b;
  uint8_t *buf;
  int r;

  if (KEY_PTRS (k) != 1 || PTR_DEV (k->ptr[0]) != 0 ||
      (b = PTR_OFFSET (k->ptr[0]) / c->bucket_sectors) >= c->sb.nbuckets ||
      b < c->sb.first_bucket) {
    snprintf (err, errlen, "the journal's uuid bucket pointer is invalid");
    return -EUCLEAN;
  }
  if ((r = uuids_alloc (c)) < 0)
    return r;
  buf = bcf_buf_alloc (c->bucket_bytes);
  if (!buf)
    return -ENOMEM;
  r = bcf_io_pread (c->io, buf, c->bucket_bytes, b * c->bucket_bytes);
  if (r == 0)
    for (unsigned i = 0; i < c->nr_uuids; i++)
      bch_uuid_entry_decode (buf + (size_t) i * BCH_UUID_ENTRY_SIZE,
                             &c->uuids[i]);
  else
    snprintf (err, errlen, "reading the uuid bucket: %s", strerror (-r));
  bcf_buf_free (buf, c->bucket_bytes);
  c->uuid_bucket = b;
  return r;
}

/* Detach the export from the cache, durably (bcf_cache_detach): its
 * slot becomes bcache's invalid uuid, written with a new uuid bucket and
 * a journal entry that names it (uuid_write), as the kernel's
 * bcache_device_detach does.  Under ckpt_lock (the metadata writers'
 * lock; the other threads run).  The entry in memory is restored if the
 * write fails: the cache then still holds the export, as on disk. */
int
super_detach (struct bcf_cache *c)
{
  struct bch_uuid_entry was;
  int r;

  if (c->failed)
    return -EIO;
  if (!c->uuids || !bch_uuid_entry_live (&c->uuids[c->inode]))
    return -ENOENT;
  was = c->uuids[c->inode];
  bch_uuid_entry_invalidate (&c->uuids[c->inode], (uint32_t) time (NULL));
  if ((r = uuid_write (c)) < 0)
    c->uuids[c->inode] = was;
  return r;
}

/* The first slot that names a device (a read-only open's owner: what a
 * caller checks before it opens the cache for an export); NULL if none
 * does, as in a new cache or one whose export was detached. */
static const struct bch_uuid_entry *
first_live_slot (const struct bcf_cache *c)
{
  for (unsigned i = 0; i < c->nr_uuids; i++)
    if (bch_uuid_entry_live (&c->uuids[i]))
      return &c->uuids[i];
  return NULL;
}

/* ---- layout marks ------------------------------------------------------------ */

static void
mark_meta (struct bcf_cache *c, uint64_t b)
{
  if (b < c->alloc.nbuckets) {
    c->alloc.buckets[b].state = BUCKET_IN_USE;
    c->alloc.buckets[b].mark = GC_MARK_METADATA;
    c->alloc.buckets[b].prio = BCH_BTREE_PRIO;
    c->alloc.buckets[b].sectors_used = (uint32_t) c->bucket_sectors;
  }
}

static int
mark_node (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  mark_meta (c, bucket_of_ptr (c, n->key.ptr));
  return 0;
}

/* Everything that is not data: the superblock area, the journal, the
 * prio chain, the uuid bucket, every btree node. */
static void
mark_layout (struct bcf_cache *c)
{
  for (uint64_t b = 0; b < c->sb.first_bucket; b++)
    mark_meta (c, b);
  for (unsigned i = 0; i < c->sb.njournal_buckets; i++)
    mark_meta (c, c->sb.d[i]);
  for (unsigned i = 0; i < c->alloc.nprio; i++)
    mark_meta (c, c->alloc.prio_buckets[i]);
  if (c->sb.flags & BCH_CACHE_SYNC)
    mark_meta (c, c->uuid_bucket);
  btree_visit (c, mark_node, NULL);
}

/* ---- first registration ---------------------------------------------------------- */

/* The kernel's rule, clamp (nbuckets >> 7, 2, 256), with a floor: the
 * journal holds at least 16 maximum-size (32 KiB) entries, so a small
 * cache does not checkpoint after every few writes (and always has room
 * for its reserve).  Any count up to 256 with d[i] = first_bucket + i is
 * valid bcache format. */
static unsigned
journal_buckets_for (const struct bcf_cache *c)
{
  uint64_t entry = BCH_JSET_MAX_BYTES < c->bucket_bytes ? BCH_JSET_MAX_BYTES
                   : c->bucket_bytes;
  uint64_t floor = (16 * entry + c->bucket_bytes - 1) / c->bucket_bytes;
  uint64_t n = bch_journal_buckets_for (c->sb.nbuckets);

  if (n < floor)
    n = floor;
  if (n > c->sb.nbuckets / 8)
    n = c->sb.nbuckets / 8;
  if (n > BCH_SB_JOURNAL_BUCKETS)
    n = BCH_SB_JOURNAL_BUCKETS;
  return n < 2 ? 2 : (unsigned) n;
}

static int
first_registration (struct bcf_cache *c, char *err, size_t errlen)
{
  int r;

  bcf_log (c, BCF_LOG_INFO, "%s: first registration of a new cache "
           "(%" PRIu64 " buckets of %" PRIu64 " KiB)", bcf_io_path (c->io),
           c->sb.nbuckets, c->bucket_bytes >> 10);
  c->sb.flags &= ~BCH_CACHE_SYNC;
  c->sb.njournal_buckets = (uint16_t) journal_buckets_for (c);
  memset (c->sb.d, 0, sizeof c->sb.d);
  for (unsigned i = 0; i < c->sb.njournal_buckets; i++)
    c->sb.d[i] = c->sb.first_bucket + i;
  if ((uint64_t) c->sb.first_bucket + c->sb.njournal_buckets + 64 >
      c->sb.nbuckets) {
    snprintf (err, errlen, "cache too small: %" PRIu64 " buckets", c->sb.nbuckets);
    return -ENOSPC;
  }

  if ((r = alloc_init (c)) < 0 || (r = journal_init (c)) < 0 ||
      (r = btree_init (c)) < 0) {
    snprintf (err, errlen, "initialising the cache: %s", strerror (-r));
    return r;
  }
  mark_layout (c);
  alloc_fill_from_unused (c);

  if ((r = uuids_alloc (c)) < 0)
    return r;
  if (c->opts.bdev) {
    bool changed;
    if ((r = bdev_slot (c, &changed, err, errlen)) < 0)
      return r;
  }
  else
    our_uuid_entry (c, &c->uuids[0]);
  c->owner = c->uuids[c->inode];
  if ((r = alloc_prio_write (c)) < 0 ||
      (r = uuid_write (c)) < 0 ||
      (r = btree_new_root (c)) < 0 ||
      (r = btree_checkpoint (c)) < 0) {
    snprintf (err, errlen, "formatting %s: %s", bcf_io_path (c->io),
              strerror (-r));
    return r;
  }

  c->sb.version = BCACHE_SB_VERSION_CDEV_WITH_UUID;
  c->sb.flags |= BCH_CACHE_SYNC;
  c->sb.seq++;
  c->sb.last_mount = (uint32_t) time (NULL);
  if ((r = write_super (c)) < 0) {
    snprintf (err, errlen, "writing the superblock of %s: %s",
              bcf_io_path (c->io), strerror (-r));
    return r;
  }
  return 0;
}

/* A cache of fewer buckets than opts.min_buckets is not made. */
static int
too_few_buckets (struct bcf_cache *c, const struct bch_sb *sb,
                 const char *advice, char *err, size_t errlen)
{
  snprintf (err, errlen, "%s: a cache of %" PRIu64 " buckets of %" PRIu64
            " KiB is too small for the Linux kernel, which registers none "
            "with 512 buckets or fewer (at least %u are asked for); %s",
            bcf_io_path (c->io), sb->nbuckets, bch_sb_bucket_sectors (sb) / 2,
            c->opts.min_buckets, advice);
  return -EINVAL;
}

/* Build a superblock for a blank device (make-bcache -C's defaults). */
static int
new_superblock (struct bcf_cache *c, char *err, size_t errlen)
{
  uint64_t dev_bytes = bcf_io_size (c->io);
  unsigned block = c->opts.block_sectors ? c->opts.block_sectors
                   : bcf_io_block_size (c->io) >> BCH_SECTOR_SHIFT;
  unsigned bucket;
  struct bch_sb *sb = &c->sb;
  struct bch_diag d;

  if (block == 0)
    block = 1;
  /* The default shrinks on small devices, so that the kernel can
   * register the cache (BCH_KERNEL_MIN_NBUCKETS). */
  bucket = c->opts.bucket_sectors ? c->opts.bucket_sectors
           : bch_default_bucket_sectors (dev_bytes >> BCH_SECTOR_SHIFT, block);
  memset (sb, 0, sizeof *sb);
  sb->offset = BCH_SB_SECTOR;
  sb->version = BCACHE_SB_VERSION_CDEV;
  memcpy (sb->magic, bch_sb_magic, 16);
  random_bytes (sb->uuid, 16);
  random_bytes (sb->set_uuid, 16);
  sb->flags = ((uint64_t) c->opts.replacement << BCH_CACHE_REPLACEMENT_SHIFT) &
              BCH_CACHE_REPLACEMENT_MASK;
  sb->bucket_size = (uint16_t) bucket;
  sb->block_size = (uint16_t) block;
  sb->nbuckets = (dev_bytes >> BCH_SECTOR_SHIFT) / bucket;
  sb->nr_in_set = 1;
  sb->nr_this_dev = 0;
  sb->first_bucket = (uint16_t) (23 / bucket + 1);
  if (bucket > 0xffff || bch_sb_validate (sb, dev_bytes >> BCH_SECTOR_SHIFT,
                                          &d) != BCH_OK) {
    snprintf (err, errlen, "cannot format %s (%" PRIu64 " bytes) with "
              "%u-sector buckets and %u-sector blocks: %s%s",
              bcf_io_path (c->io), dev_bytes, bucket, block,
              bucket > 0xffff ? "bucket too large" : d.msg,
              sb->nbuckets < 128 ? " (a cache needs at least 128 buckets)"
              : "");
    return -EINVAL;
  }
  if (sb->nbuckets < c->opts.min_buckets)
    return too_few_buckets (c, sb, c->opts.bucket_sectors
                            ? "give a larger device or smaller buckets"
                            : "give a larger device", err, errlen);
  if (block << BCH_SECTOR_SHIFT < bcf_io_block_size (c->io)) {
    snprintf (err, errlen, "block size %u bytes is smaller than the "
              "device's logical block size %u", block << BCH_SECTOR_SHIFT,
              bcf_io_block_size (c->io));
    return -EINVAL;
  }
  if (!c->opts.bucket_sectors && bucket < 1024)
    bcf_log (c, BCF_LOG_WARN, "%s: %" PRIu64 " bytes: formatting with "
             "buckets of %u KiB instead of the default 512 KiB, so that the "
             "cache has more than 512 buckets (the Linux kernel registers no "
             "cache with fewer)", bcf_io_path (c->io), dev_bytes, bucket / 2);
  set_geometry (c);
  return 0;
}

/* ---- open ------------------------------------------------------------------------ */

static int
replay_one (struct bcf_cache *c, const struct ckey *k, uint64_t seq,
            void *opaque)
{
  int r;

  tree_wrlock (c);
  r = btree_insert_locked (c, k, seq);
  tree_wrunlock (c);
  return r;
}

/* Write-intent marks a crash left (intent.c): the clean data of their
 * regions may be older than the export; drop it, and say so. */
static int
recover_intent (struct bcf_cache *c)
{
  uint64_t regions, dropped;
  int r = intent_recover (c, &regions, &dropped);

  if (regions)
    bcf_log (c, BCF_LOG_WARN, "%s: %" PRIu64 " write-intent region%s of 16 "
             "MiB %s marked when the cache was last used (a crash, or a "
             "stop without a clean close): dropped %" PRIu64 " clean "
             "extent%s there, which may be older than the export; dirty "
             "data is kept", bcf_io_path (c->io), regions,
             regions == 1 ? "" : "s", regions == 1 ? "was" : "were", dropped,
             dropped == 1 ? "" : "s");
  atomic_fetch_add (&c->stats.intent_dropped, dropped);
  return r;
}

/* Slot 0 was detached (bcf_cache_detach, or a kernel's detach): its
 * export was written back whole and may have been written elsewhere
 * since, so nothing here may be served to it again.  The cache starts
 * empty (*detached; super_open), whatever export opens it, unless it
 * holds what that would lose: dirty data (never after a detach, which
 * writes it back first; a refusal rather than a silent loss), or
 * another device's slot. */
static int
detached_identity (struct bcf_cache *c, bool *detached, char *err,
                   size_t errlen)
{
  const char *path = bcf_io_path (c->io);
  const struct bch_uuid_entry *other = first_live_slot (c);
  uint64_t dirty = btree_dirty_sectors (c);

  if (other) {
    char u[37];

    bch_uuid_unparse (other->uuid, u);
    snprintf (err, errlen, "%s: its export was detached from it, but it "
              "caches another device too (bcache backing device %s): it "
              "cannot start empty for a plain export", path, u);
    return -EEXIST;
  }
  if (dirty) {
    snprintf (err, errlen, "%s: its export was detached from it, but it "
              "holds %" PRIu64 " bytes of dirty data, which a detach never "
              "leaves and which is never discarded silently: check it with "
              "bcachefilter-show --fsck", path, dirty << BCH_SECTOR_SHIFT);
    return -EUCLEAN;
  }
  *detached = true;
  return 0;
}

/* Is slot 0 this plain export's?  An empty slot 0 (a cache never
 * attached to an export) is claimed by the caller; a detached one
 * (detached_identity) makes the cache start empty.  A size of 0 in the
 * entry is "not recorded" (the kernel leaves it 0 for backing devices):
 * then the uuid alone decides.  Another export, or this one with another
 * size (a resized export: cached data may not be where the export's is
 * now), is refused unless discard_foreign is set and the cache holds no
 * dirty data, which sets *foreign. */
static int
plain_identity (struct bcf_cache *c, bool *foreign, bool *detached,
                char *err, size_t errlen)
{
  const struct bch_uuid_entry *u = &c->uuids[0];
  const bool other = memcmp (u->uuid, c->opts.backing_uuid, 16) != 0;
  const bool resized = !other && u->sectors &&
                       u->sectors != c->backing_sectors;
  const uint64_t bytes = c->backing_sectors << BCH_SECTOR_SHIFT;
  const char *path = bcf_io_path (c->io);
  char have[37], want[37], size[64] = ", size not recorded";
  const char *tail;
  uint64_t dirty;

  if (bch_uuid_entry_detached (u))
    return detached_identity (c, detached, err, errlen);
  if (bch_uuid_is_zero (u->uuid) || (!other && !resized))
    return 0;
  dirty = btree_dirty_sectors (c);
  if (c->opts.discard_foreign && !dirty) {
    *foreign = true;
    return 0;
  }
  bch_uuid_unparse (u->uuid, have);
  bch_uuid_unparse (c->opts.backing_uuid, want);
  tail = dirty ? "; it holds dirty data that exists nowhere else, so it is "
         "never discarded: attach it to its own export first"
         : "; to discard its contents and reuse it for this export, ask for "
         "that explicitly";
  if (u->sectors)
    snprintf (size, sizeof size, ", %" PRIu64 " bytes",
              u->sectors << BCH_SECTOR_SHIFT);
  if (other) {
    snprintf (err, errlen, "%s caches another export (uuid %s%s), not this "
              "one (uuid %s, %" PRIu64 " bytes)%s", path, have, size, want,
              bytes, tail);
    return -EEXIST;
  }
  snprintf (err, errlen, "%s caches this export (uuid %s) as it was with %"
            PRIu64 " bytes, but it has %" PRIu64 " bytes now: after a "
            "resize, cached data may not be where the export's is%s", path,
            have, u->sectors << BCH_SECTOR_SHIFT, bytes, tail);
  return -ESTALE;
}

static int
open_existing (struct bcf_cache *c, bool *foreign, bool *detached, char *err,
               size_t errlen)
{
  struct journal_replay jr;
  struct ckey root;
  uint64_t nkeys;
  bool write_uuids = false;
  int r;

  *foreign = *detached = false;
  if ((r = alloc_init (c)) < 0 || (r = journal_init (c)) < 0 ||
      (r = btree_init (c)) < 0) {
    snprintf (err, errlen, "initialising the cache: %s", strerror (-r));
    return r;
  }
  if ((r = journal_read (c, &jr, err, errlen)) < 0)
    return r;
  if ((r = alloc_prio_read (c, jr.prio_head)) < 0) {
    snprintf (err, errlen, "reading the prio buckets (bucket gens): %s",
              r == -EUCLEAN ? "corrupt" : strerror (-r));
    return r;
  }
  if ((r = uuid_read (c, &jr.uuid_bucket.key, err, errlen)) < 0)
    return r;
  if (first_live_slot (c))
    c->owner = *first_live_slot (c);
  if (!ckey_from_bkey (&jr.root.key, &root) || !ckey_has_ptr (&root) ||
      bucket_of_ptr (c, root.ptr) >= c->sb.nbuckets ||
      jr.root_level > 16) {
    snprintf (err, errlen, "the journal's btree root pointer is invalid");
    return -EUCLEAN;
  }
  c->committed_root = root;
  c->committed_level = jr.root_level;
  if ((r = btree_load (c, &root, jr.root_level, err, errlen)) < 0)
    return r;
  if ((r = journal_replay (c, replay_one, NULL, &nkeys, err, errlen)) < 0)
    return r;
  bcf_log (c, BCF_LOG_INFO, "%s: opened; replayed %" PRIu64 " journal "
           "entries (%" PRIu64 " keys), %" PRIu64 " keys in %zu btree nodes",
           bcf_io_path (c->io), jr.entries, nkeys, c->tree.nkeys,
           c->tree.nnodes);

  /* A read-only open (tools) stops here, after the initial mark in
   * memory: nothing is written, and there is no export to compare. */
  if (c->opts.readonly) {
    mark_layout (c);
    if ((r = bcf_gc_run (c)) < 0)
      snprintf (err, errlen, "initial mark of the cache: %s", strerror (-r));
    return r;
  }

  /* Whose cache is it? */
  if (c->opts.bdev) {
    if ((r = bdev_slot (c, &write_uuids, err, errlen)) < 0)
      return r;
  }
  else {
    if ((r = plain_identity (c, foreign, detached, err, errlen)) < 0 ||
        *foreign || *detached)
      return r;
    if (bch_uuid_is_zero (c->uuids[0].uuid)) {
      our_uuid_entry (c, &c->uuids[0]);
      write_uuids = true;
    }
  }
  c->owner = c->uuids[c->inode];

  /* The initial mark, free lists, gens on disk, replayed keys in the
   * tree on disk. */
  mark_layout (c);
  if ((r = bcf_gc_run (c)) < 0) {
    snprintf (err, errlen, "initial mark of the cache: %s", strerror (-r));
    return r;
  }
  alloc_fill_from_unused (c);
  /* A crash in the middle of a checkpoint (or of the prio write before
   * one) leaves the journal with less than its reserve: the metadata
   * commits below would find no room ("writing prio buckets failed: No
   * space left on device", the writeback soak at TEST_SEED=40342).  So
   * the prio write commits the replayed tree first where the journal is
   * tight, as the allocator's refill does: one entry (nothing is pending
   * to seal), after which the whole ring is free, and the free buckets'
   * gens are on disk already. */
  if ((r = alloc_prio_write_with_room (c, true)) < 0 ||
      (write_uuids && (r = uuid_write (c)) < 0) ||
      (r = recover_intent (c)) < 0 ||
      (r = btree_checkpoint (c)) < 0 ||
      /* The marks' clears are committed: no kernel need refuse it now
       * (intent.c). */
      ((c->sb.feature_incompat & BCF_FEATURE_INCOMPAT_WRITE_INTENT) &&
       (r = super_set_write_intent (c, false)) < 0)) {
    snprintf (err, errlen, "opening %s: writing metadata: %s",
              bcf_io_path (c->io), strerror (-r));
    return r;
  }
  return 0;
}

/* Free the engine state built by a failed or discarded open. */
static void
drop_state (struct bcf_cache *c)
{
  free (c->uuids);
  c->uuids = NULL;
  c->nr_uuids = 0;
  c->inode = 0;
  btree_free (c);
  journal_free (c);
  alloc_free (c);
  memset (&c->tree, 0, sizeof c->tree);
  memset (&c->journal, 0, sizeof c->journal);
  memset (&c->alloc, 0, sizeof c->alloc);
}

static int
zero_superblock (struct bcf_cache *c)
{
  uint8_t *buf = bcf_buf_alloc (2 * BCH_SB_AREA_SIZE);
  int r;

  if (!buf)
    return -ENOMEM;
  memset (buf, 0, 2 * BCH_SB_AREA_SIZE);
  r = bcf_io_pwrite (c->io, buf, 2 * BCH_SB_AREA_SIZE, 0);
  if (r == 0)
    r = bcf_io_flush (c->io);
  bcf_buf_free (buf, 2 * BCH_SB_AREA_SIZE);
  return r;
}

/* The export of this cache was detached from it (detached_identity):
 * say so, and start empty with the geometry it has.  As an abandon
 * does, the superblock is written first with CACHE_SYNC clear and a new
 * set uuid (super_abandon says why the uuid), so that a crash before
 * the first registration below is done leaves a device that registers
 * afresh, never the old keys. */
static int
restart_detached (struct bcf_cache *c, char *err, size_t errlen)
{
  const struct bch_uuid_entry u = c->uuids[0];
  const char *path = bcf_io_path (c->io);
  char when[64] = "at an unknown time", size[64] = "a bcache backing device";
  time_t t = (time_t) u.invalidated;
  struct tm tm;
  int r;

  if (u.invalidated && gmtime_r (&t, &tm))
    strftime (when, sizeof when, "on %Y-%m-%d %H:%M:%S UTC", &tm);
  if (u.sectors)
    snprintf (size, sizeof size, "an export of %" PRIu64 " bytes",
              u.sectors << BCH_SECTOR_SHIFT);
  bcf_log (c, BCF_LOG_WARN, "%s: its export (%s) was detached from it %s, "
           "with nothing dirty left: starting with an empty cache, as the "
           "export may have been written elsewhere since", path, size, when);
  drop_state (c);
  if ((r = super_abandon (c)) < 0) {
    snprintf (err, errlen, "%s: starting empty after a detach: writing the "
              "superblock: %s", path, strerror (-r));
    return r;
  }
  set_geometry (c);
  return first_registration (c, err, errlen);
}

int
super_open (struct bcf_cache *c, char *err, size_t errlen)
{
  const char *path = bcf_io_path (c->io);
  struct bcf_device_verdict v;
  bool foreign, detached;
  int r;

  if ((r = probe_io (c->io, &v, err, errlen)) < 0)
    return r;
  c->sb = v.sb;
  if (v.kind == BCF_DEVICE_TOO_SMALL) {
    snprintf (err, errlen, "%s is too small to be a cache (%" PRIu64
              " bytes)", path, v.size);
    return -ENOSPC;
  }
  if (c->opts.readonly && v.kind != BCF_DEVICE_CACHE) {
    snprintf (err, errlen, "%s is not an initialised bcache cache (%s)", path,
              v.kind == BCF_DEVICE_BLANK ? "blank"
              : v.kind == BCF_DEVICE_MAKE_BCACHE
              ? "made by make-bcache, never registered" : v.reason);
    return v.kind == BCF_DEVICE_BLANK || v.kind == BCF_DEVICE_FOREIGN
           ? -EMEDIUMTYPE : -EUCLEAN;
  }
  if (c->opts.format == BCF_FORMAT_FORCE) {
    if ((r = bdev_refuse_format (c, NULL, err, errlen)) < 0 ||
        (v.kind == BCF_DEVICE_CACHE &&
         (r = refuse_losing_dirty (c, &v, err, errlen)) < 0))
      return r;
    if (v.kind != BCF_DEVICE_BLANK && (r = zero_superblock (c)) < 0) {
      snprintf (err, errlen, "clearing the old superblock of %s: %s", path,
                strerror (-r));
      return r;
    }
    v.kind = BCF_DEVICE_BLANK;
  }
  switch (v.kind) {
  case BCF_DEVICE_BLANK:
    if (c->opts.format == BCF_FORMAT_NEVER) {
      snprintf (err, errlen, "%s is blank, not a cache; format it first "
                "(bcachefilter-format) or allow formatting", path);
      return -ENODEV;
    }
    if ((r = bdev_refuse_format (c, NULL, err, errlen)) < 0 ||
        (r = new_superblock (c, err, errlen)) < 0)
      return r;
    return first_registration (c, err, errlen);
  case BCF_DEVICE_FOREIGN:
    snprintf (err, errlen, "%s holds data that is not a bcache cache "
              "device; refusing to overwrite it (format it explicitly "
              "with force if it is really meant to be a cache)", path);
    return -EMEDIUMTYPE;
  case BCF_DEVICE_BACKING:
    snprintf (err, errlen, "%s is a bcache backing device, not a cache "
              "device", path);
    return -EMEDIUMTYPE;
  case BCF_DEVICE_CORRUPT:
    snprintf (err, errlen, "%s: %s", path, v.reason);
    return -EUCLEAN;
  default:
    break;                      /* MAKE_BCACHE, CACHE */
  }
  set_geometry (c);
  if (c->sb.nr_in_set != 1) {
    snprintf (err, errlen, "%s belongs to a cache set of %u devices; only "
              "single-device cache sets are supported", path,
              c->sb.nr_in_set);
    return -ENOTSUP;
  }
  if (c->block_bytes < bcf_io_block_size (c->io)) {
    snprintf (err, errlen, "%s: cache block size %u is smaller than the "
              "device's logical block size %u", path, c->block_bytes,
              bcf_io_block_size (c->io));
    return -EINVAL;
  }
  if (v.kind == BCF_DEVICE_MAKE_BCACHE) {
    if (c->opts.format == BCF_FORMAT_NEVER) {
      snprintf (err, errlen, "%s was made by make-bcache but never "
                "registered; allow formatting to initialise it", path);
      return -ENODEV;
    }
    if (c->sb.nbuckets < c->opts.min_buckets)
      return too_few_buckets (c, &c->sb, "make it again with smaller "
                              "buckets (make-bcache -b), or format it anew",
                              err, errlen);
    if ((r = bdev_refuse_format (c, c->sb.set_uuid, err, errlen)) < 0)
      return r;
    return first_registration (c, err, errlen);
  }
  r = open_existing (c, &foreign, &detached, err, errlen);
  if (r == 0 && detached)
    return restart_detached (c, err, errlen);
  if (r == 0 && foreign) {
    bcf_log (c, BCF_LOG_WARN, "%s: discarding a clean cache of another "
             "export, as asked", path);
    drop_state (c);
    if ((r = zero_superblock (c)) < 0) {
      snprintf (err, errlen, "clearing %s: %s", path, strerror (-r));
      return r;
    }
    if ((r = new_superblock (c, err, errlen)) < 0)
      return r;
    return first_registration (c, err, errlen);
  }
  return r;
}

void
super_close_state (struct bcf_cache *c)
{
  drop_state (c);
}
