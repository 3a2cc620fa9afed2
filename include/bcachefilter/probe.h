/* bcachefilter: what a device holds, asked before anything writes it.
 *
 * Design
 * ------
 * bcf_cache_open decides what to do with a device by what it holds
 * (core/super.c): format a blank one, initialise one made by make-bcache
 * -C, open a registered cache, refuse anything else.  bcf_device_probe
 * answers the same question with the same classification, read-only, so
 * a caller that must refuse early (the filter before nbdkit forks,
 * bcachefilter-format before it formats) refuses exactly what the open
 * would, for the same reasons, and tests a verdict instead of matching
 * the text of an error.
 *
 *   all zero in the superblock area and     BLANK
 *     in the first and last MiB
 *   all zero in the superblock area, data   FOREIGN (data_at: where; a
 *     in the first or last MiB                filesystem, RAID or
 *                                             partition table signature)
 *   no bcache magic at byte 4096            FOREIGN
 *   a bcache backing superblock             BACKING
 *   a cache superblock that does not        CORRUPT (reason)
 *     decode or validate
 *   a valid cache superblock, CACHE_SYNC    MAKE_BCACHE (never registered)
 *     clear
 *   a valid cache superblock, CACHE_SYNC    CACHE; with opts.check also
 *     set                                     opened read-only (journal,
 *                                             prios, uuids, btree): the
 *                                             export it holds and its
 *                                             dirty data, or CORRUPT with
 *                                             the open's reason
 *   smaller than the superblock area        TOO_SMALL
 *
 * Locking: none; the device is opened read-only, nothing is claimed or
 * written (a writer may be using it: see bcachefilter/claim.h).
 */
#ifndef BCACHEFILTER_PROBE_H
#define BCACHEFILTER_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/format.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

enum bcf_device_kind {
  BCF_DEVICE_BLANK,
  BCF_DEVICE_MAKE_BCACHE,
  BCF_DEVICE_CACHE,
  BCF_DEVICE_FOREIGN,
  BCF_DEVICE_BACKING,
  BCF_DEVICE_CORRUPT,
  BCF_DEVICE_TOO_SMALL,
};

struct bcf_device_verdict {
  enum bcf_device_kind kind;
  uint64_t size;                /* bytes the engine can address */
  /* FOREIGN with a zero superblock area: the first non-zero byte found
   * in the first or last MiB.  UINT64_MAX otherwise. */
  uint64_t data_at;
  /* MAKE_BCACHE and CACHE (CORRUPT: as far as it decoded). */
  struct bch_sb sb;
  /* CACHE, probed with check: the export it holds (bcf_cache_owner),
   * and the bytes of dirty data in it (bcf_cache_dirty_bytes: writes
   * that exist nowhere else; a format would lose them). */
  bool has_owner;
  uint8_t owner_uuid[16];
  uint64_t owner_bytes;
  uint64_t dirty_bytes;
  /* CORRUPT: the -errno bcf_cache_open gives for it. */
  int error;
  /* FOREIGN, BACKING, CORRUPT, TOO_SMALL: why, in words. */
  char reason[512];
};

struct bcf_probe_opts {
  bool check;                   /* open a CACHE read-only to check it */
  bool direct_off;              /* never use O_DIRECT */
};

/* Probe the device at path.  Returns 0 with the verdict in *v, or -errno
 * with a message in err if the device cannot be opened or read. */
int bcf_device_probe (const char *path, const struct bcf_probe_opts *opts,
                      struct bcf_device_verdict *v, char *err,
                      size_t errlen);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_PROBE_H */
