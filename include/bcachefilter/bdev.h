/* bcachefilter: a bcache backing device as the export (make-bcache -B).
 *
 * Design
 * ------
 * A backing device begins with a bcache superblock (byte 4096) and keeps
 * its data from data_offset on (16 sectors for make-bcache -B).  The
 * kernel caches such a device with keys at backing-device sectors, data
 * offset included, and keeps the device's state in that superblock
 * (research/bcache.md §1.2, §2.5): set_uuid names the cache set it is
 * attached to, BDEV_STATE says whether that set holds dirty data for it.
 * When the export the filter caches is such a device, the filter does as
 * the kernel does, so that the pair (cache, backing device) can move
 * between the filter and a kernel in both directions:
 *
 *  - the client sees the data region only: request offsets are shifted
 *    by the data offset (bcf_req_opts.offset), so keys are at backing
 *    sectors;
 *  - the device's uuid (and label) is the export's identity in the cache,
 *    and its uuid entry records no size (sectors 0, as the kernel's);
 *  - the slot in the cache's uuid array is chosen as the kernel's
 *    bch_cached_dev_attach chooses it (bcf_bdev_pick_slot), and the
 *    superblock is then marked attached to the cache set, clean
 *    (bcf_bdev_attach);
 *  - a device that another cache set holds dirty data for is refused:
 *    serving it from this cache would return data older than what was
 *    written to it.
 *
 * The superblock comes from the remote export: it is untrusted, decoded
 * and validated by bch_bdev_sb_decode (format.h).
 *
 * Writes of the superblock go through the backing store (the export's
 * first 8 KiB, which no client can address) with FUA, and the copy in
 * memory changes only once the write succeeded.  A failed read or write
 * of it is tried again a few times (50 ms apart) before it counts: the
 * export is a remote, whose errors may pass.
 *
 * Locking: a struct bcf_bdev has a mutex of its own; every function here
 * may be called from any thread.  A state change holds it across its
 * write, so changes are applied in order.
 */
#ifndef BCACHEFILTER_BDEV_H
#define BCACHEFILTER_BDEV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/backing.h"
#include "bcachefilter/format.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

struct bcf_bdev;

/* What a backing superblock says about one cache set. */
enum bcf_bdev_relation {
  BCF_BDEV_DETACHED,      /* state none or stale: attached to no set */
  BCF_BDEV_OURS_CLEAN,    /* attached to this set, no dirty data */
  BCF_BDEV_OURS_DIRTY,    /* this set holds dirty data for it */
  BCF_BDEV_OTHER_CLEAN,   /* attached to another set, clean */
  BCF_BDEV_OTHER_DIRTY,   /* another set holds dirty data for it */
};

/* The relation of backing superblock bsb to cache set set_uuid (NULL: a
 * set not made yet, which no device can be attached to).  Dirty with a
 * zero set_uuid counts as another set's. */
enum bcf_bdev_relation bcf_bdev_relation (const struct bch_sb *bsb,
                                          const uint8_t *set_uuid);

/* Does the backing store begin with a bcache backing superblock?  Reads
 * its first 8 KiB (a failed read is tried again a few times).  Returns 1 and sets *bdp (free with bcf_bdev_free);
 * 0 if it does not (no bcache magic, a cache device's superblock, or a
 * store smaller than 8 KiB): then it is a plain export; or -errno with
 * the reason in err (a damaged or unknown bcache superblock, a read
 * error). */
int bcf_bdev_probe (const struct bcf_backing *b, struct bcf_bdev **bdp,
                    char *err, size_t errlen);
void bcf_bdev_free (struct bcf_bdev *bd);

/* The superblock as it is on the device now (a copy). */
void bcf_bdev_super (struct bcf_bdev *bd, struct bch_sb *sb);
/* Where the data region begins, in bytes (constant). */
uint64_t bcf_bdev_data_offset (const struct bcf_bdev *bd);

/* Choose the uuid slot of the backing device bsb in a cache set
 * (set_uuid) whose uuid array is uuids[0..n), as the kernel's attach
 * does:
 *  - attached to this set (clean or dirty): its entry, found by uuid; if
 *    there is none, a new one (clean), or a refusal (dirty: the data it
 *    says this set holds is not here);
 *  - detached, or attached to another set and clean: an entry for it is
 *    out of date (the device was written without this cache since), so
 *    it is invalidated (bcache's invalid uuid, invalidated = now) and a
 *    new entry made;
 *  - another set holds dirty data for it: refused.
 * A new entry is the first all-zero slot, with the device's uuid and
 * label, first_reg = last_reg = now, sectors 0.  Sets *slot; *changed
 * tells whether uuids[] was modified (it must then be written).
 * may_invalidate false refuses where an entry would be invalidated (the
 * cache holds dirty data, which must not be orphaned).  Returns 0, or
 * -errno with the reason in err. */
int bcf_bdev_pick_slot (const struct bch_sb *bsb, const uint8_t set_uuid[16],
                        struct bch_uuid_entry *uuids, unsigned n,
                        uint32_t now, bool may_invalidate, unsigned *slot,
                        bool *changed, char *err, size_t errlen);

/* Mark the device attached to cache set set_uuid, as the kernel's attach
 * does: unless it is already attached to that set, set_uuid and state
 * clean are written.  Call after bcf_cache_open succeeded with this
 * device (the cache's uuid entry is written first, as in the kernel).
 * Returns 0 or -errno with the reason in err. */
int bcf_bdev_attach (struct bcf_bdev *bd, const struct bcf_backing *b,
                     const uint8_t set_uuid[16], char *err, size_t errlen);

/* Mark the device detached from cache set set_uuid, as the kernel's
 * detach does once its writeback is done (cached_dev_detach_finish): a
 * zero set_uuid and state none, so that it can be attached to any set
 * (research/bcache.md §1.2).  Call only with nothing dirty left for it
 * in the cache.  Nothing is written if it is attached to no set; -EINVAL
 * if it is attached to another set.  Returns 0 once the superblock is
 * durable, or -errno with the reason in err (the state in memory is
 * unchanged). */
int bcf_bdev_detach (struct bcf_bdev *bd, const struct bcf_backing *b,
                     const uint8_t set_uuid[16], char *err, size_t errlen);

/* Set BDEV_STATE of an attached device (its set_uuid is kept): dirty
 * before the first write of dirty data to its cache is acknowledged,
 * clean after a writeback pass found nothing dirty (research/bcache.md
 * §2.5).  Writes only if the state changes; returns once the superblock
 * is durable on the backing store.  Returns 0, -EINVAL for a state that
 * is not clean or dirty, or another -errno (the write failed: the state
 * in memory is unchanged) with the reason in err. */
int bcf_bdev_set_state (struct bcf_bdev *bd, const struct bcf_backing *b,
                        enum bch_bdev_state state, char *err, size_t errlen);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_BDEV_H */
