/* bcachefilter engine: a bcache backing device as the export
 * (include/bcachefilter/bdev.h).
 *
 * Design
 * ------
 * The superblock is read once, at probe, from the backing store's first
 * 8 KiB and decoded by bch_bdev_sb_decode (format.c).  The raw 4 KiB
 * area is kept: a state change patches set_uuid and the state bits into
 * it (bch_bdev_sb_set_state) and writes it back whole, so bytes this code
 * does not know about survive, as they do when the kernel rewrites the
 * superblock it read.
 *
 * The kernel's rules followed here (drivers/md/bcache/super.c,
 * bch_cached_dev_attach and cached_dev_detach_finish; research/bcache.md
 * §1.2, §2.5):
 *  - a device in state none or stale is attached to no cache set, whatever
 *    set_uuid holds (make-bcache -B writes a random one);
 *  - attaching a device that is not attached to this set invalidates any
 *    entry this set still has for it, and makes a new one: that entry's
 *    data may be older than the device;
 *  - attaching writes set_uuid and state clean to the device, after the
 *    cache's uuid entry; detaching writes a zero set_uuid and state none;
 *  - a device whose superblock says dirty must find its entry in the set
 *    it names.
 * One difference: the kernel keeps the entry of a clean device that was
 * attached to another set since (an explicit attach back); here that
 * entry is invalidated too, because the other set's writes went to the
 * device without passing through this cache.
 *
 * The superblock's read and writes are retried a few times on error
 * (IO_TRIES): the export is a remote, whose errors may pass.
 *
 * Locking: bd->lock guards sb and area; a state change holds it across
 * its write (changes are rare: attach, and the dirty/clean transitions).
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bcachefilter/bdev.h"
#include "util.h"

/* A backing-store call is tried this often, this far apart, before its
 * error counts: a remote's passing error at start must neither decide
 * what the export is nor keep the filter from starting.  (Both calls are
 * idempotent: a read, and a write of the same bytes.) */
#define IO_TRIES 8
#define IO_RETRY_MS 50

struct bcf_bdev {
  pthread_mutex_t lock;
  struct bch_sb sb;                     /* decoded from area */
  uint8_t area[BCH_SB_AREA_SIZE];       /* as on the device */
  uint64_t data_offset;                 /* bytes */
};

enum bcf_bdev_relation
bcf_bdev_relation (const struct bch_sb *bsb, const uint8_t *set_uuid)
{
  unsigned state = bch_bdev_state (bsb);
  bool ours = set_uuid && !bch_uuid_is_zero (bsb->set_uuid) &&
              memcmp (bsb->set_uuid, set_uuid, 16) == 0;

  switch (state) {
  case BCH_BDEV_STATE_CLEAN:
    return ours ? BCF_BDEV_OURS_CLEAN : BCF_BDEV_OTHER_CLEAN;
  case BCH_BDEV_STATE_DIRTY:
    return ours ? BCF_BDEV_OURS_DIRTY : BCF_BDEV_OTHER_DIRTY;
  default:
    return BCF_BDEV_DETACHED;
  }
}

/* ---- probe ------------------------------------------------------------------ */

static int
read_area (const struct bcf_backing *b, uint8_t *area)
{
  int r = -EIO;

  for (int i = 0; i < IO_TRIES && r < 0; i++) {
    if (i)
      bcf_sleep_ms (IO_RETRY_MS);
    r = b->ops->pread (b->opaque, area, BCH_SB_AREA_SIZE, BCH_SB_OFFSET);
  }
  return r;
}

static int
write_area (const struct bcf_backing *b, const uint8_t *area)
{
  int r = -EIO;

  for (int i = 0; i < IO_TRIES && r < 0; i++) {
    if (i)
      bcf_sleep_ms (IO_RETRY_MS);
    r = b->ops->pwrite (b->opaque, area, BCH_SB_AREA_SIZE, BCH_SB_OFFSET,
                        true);
  }
  return r;
}

static bool
is_cache_version (uint64_t v)
{
  return v == BCACHE_SB_VERSION_CDEV || v == BCACHE_SB_VERSION_CDEV_WITH_UUID ||
         v == BCACHE_SB_VERSION_CDEV_WITH_FEATURES;
}

int
bcf_bdev_probe (const struct bcf_backing *b, struct bcf_bdev **bdp,
                char *err, size_t errlen)
{
  int64_t size = b->ops->size (b->opaque);
  struct bcf_bdev *bd;
  struct bch_diag d;
  enum bch_status st;
  int r;

  *bdp = NULL;
  if (size < 0) {
    snprintf (err, errlen, "cannot get the size of the export: %s",
              strerror ((int) -size));
    return (int) size;
  }
  if ((uint64_t) size < BCH_SB_OFFSET + BCH_SB_AREA_SIZE)
    return 0;
  if (!(bd = calloc (1, sizeof *bd)))
    return -ENOMEM;
  r = read_area (b, bd->area);
  if (r < 0) {
    snprintf (err, errlen, "reading the export's first 8 KiB (where a "
              "bcache backing superblock would be): %s", strerror (-r));
    goto out;
  }
  st = bch_bdev_sb_decode (bd->area, BCH_SB_AREA_SIZE,
                           (uint64_t) size >> BCH_SECTOR_SHIFT, &bd->sb, &d);
  if (st == BCH_ERR_MAGIC ||
      (st == BCH_ERR_VERSION && is_cache_version (bd->sb.version))) {
    r = 0;                              /* a plain export */
    goto out;
  }
  if (st != BCH_OK) {
    snprintf (err, errlen, "the export begins with a bcache superblock "
              "that cannot be used as a backing device's: %s", d.msg);
    r = st == BCH_ERR_VERSION ? -EMEDIUMTYPE : -EUCLEAN;
    goto out;
  }
  bd->data_offset = bch_bdev_data_offset (&bd->sb) << BCH_SECTOR_SHIFT;
  pthread_mutex_init (&bd->lock, NULL);
  *bdp = bd;
  return 1;

 out:
  free (bd);
  return r;
}

void
bcf_bdev_free (struct bcf_bdev *bd)
{
  if (!bd)
    return;
  pthread_mutex_destroy (&bd->lock);
  free (bd);
}

void
bcf_bdev_super (struct bcf_bdev *bd, struct bch_sb *sb)
{
  pthread_mutex_lock (&bd->lock);
  *sb = bd->sb;
  pthread_mutex_unlock (&bd->lock);
}

uint64_t
bcf_bdev_data_offset (const struct bcf_bdev *bd)
{
  return bd->data_offset;
}

/* ---- the uuid slot ---------------------------------------------------------- */

static int
find_uuid (const struct bch_uuid_entry *uuids, unsigned n,
           const uint8_t uuid[16])
{
  for (unsigned i = 0; i < n; i++)
    if (memcmp (uuids[i].uuid, uuid, 16) == 0)
      return (int) i;
  return -1;
}

int
bcf_bdev_pick_slot (const struct bch_sb *bsb, const uint8_t set_uuid[16],
                    struct bch_uuid_entry *uuids, unsigned n, uint32_t now,
                    bool may_invalidate, unsigned *slot, bool *changed,
                    char *err, size_t errlen)
{
  static const uint8_t zero[16];
  enum bcf_bdev_relation rel = bcf_bdev_relation (bsb, set_uuid);
  int found = find_uuid (uuids, n, bsb->uuid);
  char dev[37], set[37];
  int empty;

  *changed = false;
  bch_uuid_unparse (bsb->uuid, dev);
  bch_uuid_unparse (bsb->set_uuid, set);
  switch (rel) {
  case BCF_BDEV_OTHER_DIRTY:
    snprintf (err, errlen, "the export is bcache backing device %s, and "
              "its superblock says that cache set %s holds dirty data for "
              "it (written to that cache, not yet to the device): served "
              "from this cache it would read older data than was written.  "
              "Attach it to that cache set again (a kernel, or the filter "
              "with that cache) and let it write the data back, or detach "
              "it there, first", dev, set);
    return -EBUSY;
  case BCF_BDEV_OURS_DIRTY:
    if (found < 0) {
      snprintf (err, errlen, "the export is bcache backing device %s, and "
                "its superblock says that this cache set (%s) holds dirty "
                "data for it, but the cache has no entry for it: the data "
                "it needs is not here", dev, set);
      return -EUCLEAN;
    }
    /* fall through */
  case BCF_BDEV_OURS_CLEAN:
    if (found >= 0) {
      *slot = (unsigned) found;
      return 0;
    }
    break;
  case BCF_BDEV_DETACHED:
  case BCF_BDEV_OTHER_CLEAN:
    if (found >= 0) {
      if (!may_invalidate) {
        snprintf (err, errlen, "the export is bcache backing device %s, "
                  "which is %s, so the data this cache holds for it may be "
                  "out of date; but the cache holds dirty data, which is "
                  "never dropped: attach the device to this cache set "
                  "first", dev, rel == BCF_BDEV_DETACHED
                  ? "attached to no cache set"
                  : "attached to another cache set");
        return -EBUSY;
      }
      bch_uuid_entry_invalidate (&uuids[found], now);
      *changed = true;
    }
    break;
  }

  empty = find_uuid (uuids, n, zero);
  if (empty < 0) {
    snprintf (err, errlen, "no free uuid slot in this cache set for "
              "backing device %s (all %u are used)", dev, n);
    return -ENOSPC;
  }
  memset (&uuids[empty], 0, sizeof uuids[empty]);
  memcpy (uuids[empty].uuid, bsb->uuid, 16);
  memcpy (uuids[empty].label, bsb->label, sizeof uuids[empty].label);
  uuids[empty].first_reg = uuids[empty].last_reg = now;
  *slot = (unsigned) empty;
  *changed = true;
  return 0;
}

/* ---- state changes ----------------------------------------------------------- */

/* Write set_uuid and state to the device, then to memory.  Under
 * bd->lock. */
static int
write_state_locked (struct bcf_bdev *bd, const struct bcf_backing *b,
                    const uint8_t set_uuid[16], unsigned state, char *err,
                    size_t errlen)
{
  uint8_t next[BCH_SB_AREA_SIZE];
  struct bch_diag d;
  int r;

  memcpy (next, bd->area, sizeof next);
  bch_bdev_sb_set_state (next, set_uuid, state);
  r = write_area (b, next);
  if (r < 0) {
    snprintf (err, errlen, "writing the backing device's superblock "
              "(state %s): %s", bch_bdev_state_name (state), strerror (-r));
    return r;
  }
  memcpy (bd->area, next, sizeof next);
  /* It decoded before, and only set_uuid and the state changed. */
  if (bch_bdev_sb_decode (bd->area, sizeof bd->area, 0, &bd->sb, &d)
      != BCH_OK)
    abort ();
  return 0;
}

int
bcf_bdev_attach (struct bcf_bdev *bd, const struct bcf_backing *b,
                 const uint8_t set_uuid[16], char *err, size_t errlen)
{
  int r = 0;

  pthread_mutex_lock (&bd->lock);
  switch (bcf_bdev_relation (&bd->sb, set_uuid)) {
  case BCF_BDEV_OURS_CLEAN:
  case BCF_BDEV_OURS_DIRTY:
    break;
  case BCF_BDEV_OTHER_DIRTY:
    snprintf (err, errlen, "the backing device is attached to another "
              "cache set, which holds dirty data for it");
    r = -EBUSY;
    break;
  case BCF_BDEV_DETACHED:
  case BCF_BDEV_OTHER_CLEAN:
    r = write_state_locked (bd, b, set_uuid, BCH_BDEV_STATE_CLEAN, err,
                            errlen);
    break;
  }
  pthread_mutex_unlock (&bd->lock);
  return r;
}

int
bcf_bdev_detach (struct bcf_bdev *bd, const struct bcf_backing *b,
                 const uint8_t set_uuid[16], char *err, size_t errlen)
{
  static const uint8_t none[16];
  int r = 0;

  pthread_mutex_lock (&bd->lock);
  switch (bcf_bdev_relation (&bd->sb, set_uuid)) {
  case BCF_BDEV_OURS_CLEAN:
  case BCF_BDEV_OURS_DIRTY:       /* the caller wrote everything back */
    r = write_state_locked (bd, b, none, BCH_BDEV_STATE_NONE, err, errlen);
    break;
  case BCF_BDEV_DETACHED:
    break;
  case BCF_BDEV_OTHER_CLEAN:
  case BCF_BDEV_OTHER_DIRTY:
    snprintf (err, errlen, "the backing device is attached to another "
              "cache set, not to this one");
    r = -EINVAL;
    break;
  }
  pthread_mutex_unlock (&bd->lock);
  return r;
}

int
bcf_bdev_set_state (struct bcf_bdev *bd, const struct bcf_backing *b,
                    enum bch_bdev_state state, char *err, size_t errlen)
{
  int r = 0;

  if (state != BCH_BDEV_STATE_CLEAN && state != BCH_BDEV_STATE_DIRTY) {
    snprintf (err, errlen, "backing device state %s: only clean and dirty "
              "can be set on an attached device",
              bch_bdev_state_name (state));
    return -EINVAL;
  }
  pthread_mutex_lock (&bd->lock);
  switch (bch_bdev_state (&bd->sb)) {
  case BCH_BDEV_STATE_CLEAN:
  case BCH_BDEV_STATE_DIRTY:
    if (bch_bdev_state (&bd->sb) != (unsigned) state)
      r = write_state_locked (bd, b, bd->sb.set_uuid, state, err, errlen);
    break;
  default:
    snprintf (err, errlen, "the backing device is attached to no cache "
              "set: attach it (bcf_bdev_attach) before setting its state");
    r = -EINVAL;
  }
  pthread_mutex_unlock (&bd->lock);
  return r;
}
