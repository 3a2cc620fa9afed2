/* nbdkit-bcachefilter-filter: the checks before nbdkit forks (see
 * probe.h). */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bcachefilter/cleanup.h"
#include "bcachefilter/format.h"
#include "params.h"
#include "probe.h"

unsigned
probe_format_bucket_sectors (uint64_t size)
{
  return cfg.bucket_size ? (unsigned) (cfg.bucket_size >> BCH_SECTOR_SHIFT)
    : bch_default_bucket_sectors (size >> BCH_SECTOR_SHIFT,
                                  (unsigned) (cfg.block_size >> 9));
}

/* Can a cache of size bytes be formatted with the configured geometry,
 * so that the Linux kernel could register it (more than 512 buckets,
 * BCH_KERNEL_MIN_NBUCKETS)?  Without bcache-bucket-size the engine
 * picks smaller buckets for a small cache (bch_default_bucket_sectors),
 * with a warning. */
static int
check_format_size (uint64_t size, const char *what)
{
  uint64_t bucket = (uint64_t) probe_format_bucket_sectors (size)
                    << BCH_SECTOR_SHIFT;
  uint64_t need = BCH_KERNEL_MIN_NBUCKETS * bucket;

  if (size / bucket >= BCH_KERNEL_MIN_NBUCKETS)
    return 0;
  nbdkit_error ("%s (%" PRIu64 " bytes) is too small for a cache: it needs "
                "more than 512 buckets (the Linux kernel registers no "
                "smaller cache), and %" PRIu64 " buckets of %" PRIu64
                " KiB take %" PRIu64 " bytes%s", what, size,
                (uint64_t) BCH_KERNEL_MIN_NBUCKETS, bucket >> 10, need,
                cfg.bucket_size ? "; give a larger size, or a smaller "
                "bcache-bucket-size" : "; give a larger size");
  return -1;
}

/* A cache file that does not exist yet: may it be created (claiming it
 * creates it)?  0 also when it exists. */
static int
check_new_file (void)
{
  struct stat s;
  CLEANUP_FREE char *dir = NULL;
  char *slash;

  if (stat (cfg.path, &s) == 0)
    return 0;
  if (errno != ENOENT) {
    nbdkit_error ("bcache=%s: %m", cfg.path);
    return -1;
  }
  if (cfg.create_size == 0) {
    nbdkit_error ("bcache=%s does not exist: give bcache-size=SIZE to "
                  "create a cache file, or the path of a device", cfg.path);
    return -1;
  }
  if (cfg.format == BCF_FORMAT_NEVER) {
    nbdkit_error ("bcache=%s does not exist and bcache-format=never "
                  "forbids creating it", cfg.path);
    return -1;
  }
  dir = strdup (cfg.path);
  if (!dir) {
    nbdkit_error ("strdup: %m");
    return -1;
  }
  slash = strrchr (dir, '/');
  if (slash == dir)
    dir[1] = '\0';
  else if (slash)
    *slash = '\0';
  else
    strcpy (dir, ".");
  if (access (dir, W_OK | X_OK) == -1) {
    nbdkit_error ("bcache=%s cannot be created: directory %s: %m",
                  cfg.path, dir);
    return -1;
  }
  return check_format_size ((uint64_t) cfg.create_size, "bcache-size");
}

/* Claim the cache device before anything reads or writes it, and hold
 * the claim for the life of the process: nbdkit forks into the
 * background after .get_ready, and the child inherits the claim's
 * descriptor, so the lock is never let go in between (DESIGN.md "One
 * writer per cache").  Claiming a missing file creates it. */
static int
claim_cache_device (struct bcf_claim **claim)
{
  char err[1024];
  int r = bcf_claim_open (cfg.path, (uint64_t) cfg.create_size, claim,
                          err, sizeof err);

  if (r == -EBUSY) {
    nbdkit_error ("bcache=%s: %s (see ONE WRITER PER CACHE in "
                  "nbdkit-bcachefilter-filter(1))", cfg.path, err);
    return -1;
  }
  if (r < 0) {
    nbdkit_error ("bcache=%s: %s", cfg.path, err);
    return -1;
  }
  return 0;
}

/* A cache of another export: refused (DESIGN.md "One writer per cache,
 * one cache per export").  An entry that records no size is a bcache
 * backing device's (the kernel's, or ours for an export that is one).
 * If the export may be one too (bcache-backing-device=auto), its uuid
 * comes from the export's superblock, which only a connection can read:
 * compared then (lifecycle.c). */
static int
check_owner (const struct bcf_device_verdict *v)
{
  char have[37], want[37], size[64] = "size not recorded: a bcache "
    "backing device's";

  if (!v->has_owner || memcmp (v->owner_uuid, cfg.uuid, 16) == 0 ||
      (v->owner_bytes == 0 && cfg.bdev_auto))
    return 0;
  bch_uuid_unparse (v->owner_uuid, have);
  bch_uuid_unparse (cfg.uuid, want);
  if (v->owner_bytes)
    snprintf (size, sizeof size, "%" PRIu64 " bytes", v->owner_bytes);
  nbdkit_error ("bcache=%s caches another export (uuid %s, %s), not this "
                "one (uuid %s%s%s).  Give that export's "
                "bcache-backing-uuid= if it is the same export under a new "
                "name, or bcache-format=force to start an empty cache for "
                "this one", cfg.path, have, size, want,
                cfg.have_uuid ? "" : ", derived from ",
                cfg.have_uuid ? "" : (cfg.id_any ? cfg.id_text
                                      : "no parameters"));
  return -1;
}

/* Refuse now, with a clear message, whatever the open in .after_fork
 * would refuse: that one runs after nbdkit has forked and started
 * serving. */
static int
judge (const struct bcf_device_verdict *v)
{
  switch (v->kind) {
  case BCF_DEVICE_TOO_SMALL:
    nbdkit_error ("bcache=%s is too small to be a cache (%" PRIu64 " bytes)",
                  cfg.path, v->size);
    return -1;
  case BCF_DEVICE_BLANK:
    if (cfg.format == BCF_FORMAT_NEVER) {
      nbdkit_error ("bcache=%s is blank, not a cache, and bcache-format=never "
                    "forbids formatting it", cfg.path);
      return -1;
    }
    return check_format_size (v->size, cfg.path);
  case BCF_DEVICE_MAKE_BCACHE:
    if (cfg.format == BCF_FORMAT_NEVER) {
      nbdkit_error ("bcache=%s was made by make-bcache but never "
                    "registered, and bcache-format=never forbids "
                    "initialising it", cfg.path);
      return -1;
    }
    if (v->sb.nbuckets < BCH_KERNEL_MIN_NBUCKETS) {
      nbdkit_error ("bcache=%s was made by make-bcache with %" PRIu64
                    " buckets, but the Linux kernel registers no cache "
                    "with 512 buckets or fewer; make it again with "
                    "smaller buckets (make-bcache -b), or give "
                    "bcache-format=force to format it with more",
                    cfg.path, v->sb.nbuckets);
      return -1;
    }
    return 0;
  case BCF_DEVICE_CACHE:
    return check_owner (v);
  case BCF_DEVICE_FOREIGN:
    if (v->data_at != UINT64_MAX)
      nbdkit_error ("bcache=%s starts with zeros but is not blank: byte "
                    "%" PRIu64 ", in its first or last MiB, is not (a "
                    "filesystem, RAID or partition table signature?); "
                    "refusing to overwrite it.  If it really is meant to be "
                    "a cache, add bcache-format=force (this destroys it)",
                    cfg.path, v->data_at);
    else
      nbdkit_error ("bcache=%s holds data that is not a bcache cache; "
                    "refusing to overwrite it.  If it really is meant to be "
                    "a cache, add bcache-format=force (this destroys it)",
                    cfg.path);
    return -1;
  case BCF_DEVICE_BACKING:
    nbdkit_error ("bcache=%s is a bcache backing device, not a cache "
                  "device (make-bcache -C makes cache devices)", cfg.path);
    return -1;
  case BCF_DEVICE_CORRUPT:
    nbdkit_error ("bcache=%s: %s.  Check it with bcachefilter-show --fsck; "
                  "bcache-format=force starts a new, empty cache there",
                  cfg.path, v->reason);
    return -1;
  }
  return -1;
}

/* bcache-format=force over a cache: refused if the cache holds dirty
 * data (acknowledged writes that exist nowhere else) unless
 * force-discard-dirty says their loss is meant.  A cache the check could
 * not open (CORRUPT, which force is there for) is formatted. */
static int
judge_force (const struct bcf_device_verdict *v)
{
  if (v->kind == BCF_DEVICE_TOO_SMALL)
    return judge (v);
  if (v->kind == BCF_DEVICE_CACHE && v->dirty_bytes && !cfg.discard_dirty) {
    nbdkit_error ("bcache=%s holds %" PRIu64 " bytes (%.1f MiB) of dirty "
                  "data: writes acknowledged to clients that its export "
                  "does not have yet, which bcache-format=force would "
                  "destroy.  Start the filter on it normally, with its "
                  "export, and write them back (bcachefilter-ctl flush, or "
                  "bcachefilter-ctl detach), then format it; or give "
                  "bcache-format=force-discard-dirty to destroy them",
                  cfg.path, v->dirty_bytes,
                  (double) v->dirty_bytes / (1 << 20));
    return -1;
  }
  if (v->kind == BCF_DEVICE_CORRUPT)
    nbdkit_debug ("bcachefilter: bcache=%s: formatting as forced; its dirty "
                  "data, if any, cannot be counted: %s", cfg.path, v->reason);
  return check_format_size (v->size, cfg.path);
}

int
probe_cache (struct bcf_claim **claim, struct bcf_device_verdict *v)
{
  struct bcf_probe_opts o = {
    /* Also for a forced format: it must not destroy dirty data
     * unasked. */
    .check = !cfg.discard_dirty,
    .direct_off = !cfg.direct,
  };
  char err[512];

  if (check_new_file () == -1 || claim_cache_device (claim) == -1)
    return -1;
  if (bcf_device_probe (cfg.path, &o, v, err, sizeof err) < 0) {
    nbdkit_error ("bcache=%s: %s", cfg.path, err);
    return -1;
  }
  if (cfg.format == BCF_FORMAT_FORCE)
    return judge_force (v);
  return judge (v);
}
