/* nbdkit-bcachefilter-filter: a persistent SSD cache in bcache's on-disk
 * format in front of any NBD export.
 *
 * Design
 * ------
 * This file is the glue between nbdkit and the engine (core/): parameters,
 * lifecycle, and the mapping of NBD requests onto the request path
 * (core/request.c, which holds the cache-miss protocol and the write
 * ordering).  One cache serves every connection.
 *
 * Lifecycle:
 *   .config / .config_complete  parse and check the bcache-* parameters;
 *                               every other parameter goes to the plugin,
 *                               and the identifying ones (uri, socket,
 *                               file, ...) also name the export for the
 *                               cache's identity check.
 *   .get_ready                  probe the cache device before nbdkit
 *                               forks: exists or can be created, writable,
 *                               holds a cache, is blank, or (refused) holds
 *                               something else.
 *   .after_fork                 open a backend context to learn the
 *                               export's size and whether it is a bcache
 *                               backing device (core/bdev.c), open the
 *                               cache (replay, identity check), mark such
 *                               a device attached, start the engine's
 *                               threads and the control socket.
 *   .prepare                    each connection checks that its export has
 *                               the size the cache was opened for.
 *   .cleanup                    stop threads and close the cache (writes a
 *                               checkpoint).  Correctness never depends on
 *                               it: the engine recovers from a crash at any
 *                               point.
 *
 * Each request wraps its connection's nbdkit_next in a struct bcf_backing
 * on the stack, so the request path can reach the backing store without
 * knowing nbdkit.  For a bcache backing device, clients see its data
 * region: .get_size and block status are shifted here, and the request
 * layer adds the data offset to every request (bcf_req_opts.offset), so
 * the cache's keys are at the device's sectors, as the kernel's are.
 *
 * Locking: the global state is written only before the server starts
 * (config, get_ready, after_fork) and at cleanup; the engine and request
 * path are safe for the PARALLEL thread model.  The statistics printer
 * runs on the control socket's thread and only reads.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#include "bcachefilter/bdev.h"
#include "bcachefilter/cache.h"
#include "bcachefilter/claim.h"
#include "bcachefilter/format.h"
#include "bcachefilter/request.h"
#include "bcachefilter/stats.h"
#include "ctl.h"
#include "io.h"

#define DEFAULT_CUTOFF (4u << 20)

/* ---- parameters ------------------------------------------------------------------- */

static struct {
  const char *path;                     /* bcache= */
  int64_t create_size;                  /* bcache-size= */
  enum bcf_format_policy format;        /* bcache-format= */
  enum bcf_cache_mode mode;             /* bcache-mode= */
  int64_t bucket_size, block_size;      /* bytes; 0 = default */
  int64_t cutoff;                       /* bcache-sequential-cutoff= */
  bool have_uuid;
  uint8_t uuid[16];                     /* bcache-backing-uuid= */
  bool bdev_auto;                       /* bcache-backing-device=auto */
  int io_mode;                          /* enum bcf_io_mode */
  bool direct;                          /* bcache-direct= */
  const char *ctl_path;                 /* bcache-ctl= */
  int64_t node_cache;                   /* bcache-node-cache= */
  unsigned journal_delay_ms;            /* bcache-journal-delay= */
  unsigned error_limit;                 /* bcache-error-limit= */
  bool test_no_tracker;                 /* bcache-test-disable-tracker= */
} cfg = {
  .format = BCF_FORMAT_AUTO,
  .mode = BCF_MODE_WRITETHROUGH,
  .cutoff = DEFAULT_CUTOFF,
  .direct = true,
  .bdev_auto = true,
};

/* The plugin's parameters that name the export, hashed in order into the
 * default identity (FNV-1a, two 64-bit lanes with different offset bases). */
static const char *const identity_keys[] = {
  "uri", "socket", "hostname", "host", "port", "vsock", "export",
  "exportname", "file", "dir", "command", "server", "url", "disk",
  NULL,
};
static uint64_t id_hash[2] = { 0xcbf29ce484222325ull, 0x84222325cbf29ce4ull };
static char id_text[256];               /* for messages: "socket=/x" */
static bool id_any;

/* ---- global state (after .after_fork) --------------------------------------------- */

static struct bcf_claim *claim;          /* from .get_ready on */
static struct bcf_cache *cache;
static struct bcf_req *req;
static uint64_t export_size;            /* of the plugin's export */
/* The export is a bcache backing device: clients see its data region,
 * from data_offset bytes on (bcachefilter/bdev.h). */
static struct bcf_bdev *bdev;
static uint64_t data_offset;
static bool ctl_running;

/* ---- small helpers ---------------------------------------------------------------- */

static void
hash_bytes (const char *s)
{
  for (; *s; s++)
    for (int lane = 0; lane < 2; lane++) {
      id_hash[lane] ^= (uint8_t) *s;
      id_hash[lane] *= 0x100000001b3ull;
    }
}

static bool
is_identity_key (const char *key)
{
  for (size_t i = 0; identity_keys[i]; i++)
    if (strcmp (key, identity_keys[i]) == 0)
      return true;
  return false;
}

/* A size parameter: nbdkit's syntax (4M, 1G, ...), >= min. */
static int
parse_size_param (const char *key, const char *value, int64_t min,
                  int64_t *out)
{
  int64_t v = nbdkit_parse_size (value);

  if (v == -1) {
    nbdkit_error ("%s=%s: not a size (a number of bytes, with an optional "
                  "K, M, G or T suffix)", key, value);
    return -1;
  }
  if (v < min) {
    nbdkit_error ("%s=%s: must be at least %" PRIi64 " bytes", key, value,
                  min);
    return -1;
  }
  *out = v;
  return 0;
}

static int
parse_bool_param (const char *key, const char *value, bool *out)
{
  int b = nbdkit_parse_bool (value);

  if (b == -1) {
    nbdkit_error ("%s=%s: not a boolean (use true or false)", key, value);
    return -1;
  }
  *out = b;
  return 0;
}

static int
parse_pow2_param (const char *key, const char *value, int64_t min, int64_t max,
                  int64_t *out)
{
  if (parse_size_param (key, value, min, out) == -1)
    return -1;
  if (*out > max || (*out & (*out - 1)) != 0) {
    nbdkit_error ("%s=%s: must be a power of two between %" PRIi64
                  " and %" PRIi64 " bytes", key, value, min, max);
    return -1;
  }
  return 0;
}

/* A cache mode, for bcache-mode= and the control socket's set
 * cache_mode.  bcache's writeback mode gets a refusal of its own: the
 * engine has no writeback (no dirty data is ever written). */
static int
parse_mode (const char *value, char *err, size_t errlen)
{
  int m = bcf_cache_mode_parse (value);

  if (m < 0 && strcmp (value, "writeback") == 0)
    snprintf (err, errlen, "writeback mode is not supported: use "
              "writethrough (the default), writearound or none");
  else if (m < 0)
    snprintf (err, errlen, "unknown mode '%s': use writethrough (cache "
              "reads and writes), writearound (cache reads only) or none",
              value);
  return m;
}

static void
engine_log (void *opaque, enum bcf_log_level level, const char *msg)
{
  switch (level) {
  case BCF_LOG_DEBUG:
    nbdkit_debug ("bcachefilter: %s", msg);
    break;
  case BCF_LOG_INFO:
  case BCF_LOG_WARN:
    /* nbdkit has no info level: these are rare and worth seeing. */
    fprintf (stderr, "nbdkit: bcachefilter: %s\n", msg);
    break;
  case BCF_LOG_ERROR:
    nbdkit_error ("bcachefilter: %s", msg);
    break;
  }
}

/* ---- .config ---------------------------------------------------------------------- */

static int
filter_config (nbdkit_next_config *next, nbdkit_backend *nxdata,
            const char *key, const char *value)
{
  if (strncmp (key, "bcache", 6) != 0) {
    if (is_identity_key (key)) {
      hash_bytes (key);
      hash_bytes ("=");
      hash_bytes (value);
      hash_bytes ("\n");
      if (!id_any)
        snprintf (id_text, sizeof id_text, "%s=%s", key, value);
      id_any = true;
    }
    return next (nxdata, key, value);
  }

  if (strcmp (key, "bcache") == 0) {
    if (!*value) {
      nbdkit_error ("bcache=: give the path of the cache device or file");
      return -1;
    }
    cfg.path = value;
  }
  else if (strcmp (key, "bcache-size") == 0)
    return parse_size_param (key, value, 1 << 20, &cfg.create_size);
  else if (strcmp (key, "bcache-format") == 0) {
    if (strcmp (value, "auto") == 0)
      cfg.format = BCF_FORMAT_AUTO;
    else if (strcmp (value, "never") == 0)
      cfg.format = BCF_FORMAT_NEVER;
    else if (strcmp (value, "force") == 0)
      cfg.format = BCF_FORMAT_FORCE;
    else {
      nbdkit_error ("bcache-format=%s: use auto (format a blank device or "
                    "one made by make-bcache -C), never (open an existing "
                    "cache only) or force (destroy what is there)", value);
      return -1;
    }
  }
  else if (strcmp (key, "bcache-mode") == 0) {
    char err[256];
    int m = parse_mode (value, err, sizeof err);
    if (m < 0) {
      nbdkit_error ("bcache-mode=%s: %s", value, err);
      return -1;
    }
    cfg.mode = (enum bcf_cache_mode) m;
  }
  else if (strcmp (key, "bcache-bucket-size") == 0)
    return parse_pow2_param (key, value, 4096, 8 << 20, &cfg.bucket_size);
  else if (strcmp (key, "bcache-block-size") == 0)
    return parse_pow2_param (key, value, 512, 64 << 10, &cfg.block_size);
  else if (strcmp (key, "bcache-sequential-cutoff") == 0)
    return parse_size_param (key, value, 0, &cfg.cutoff);
  else if (strcmp (key, "bcache-backing-uuid") == 0) {
    if (bch_uuid_parse (value, cfg.uuid) != 0) {
      nbdkit_error ("bcache-backing-uuid=%s: not a UUID (expected the form "
                    "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)", value);
      return -1;
    }
    cfg.have_uuid = true;
  }
  else if (strcmp (key, "bcache-backing-device") == 0) {
    if (strcmp (value, "auto") == 0)
      cfg.bdev_auto = true;
    else if (strcmp (value, "never") == 0)
      cfg.bdev_auto = false;
    else {
      nbdkit_error ("bcache-backing-device=%s: use auto (an export that "
                    "begins with a bcache backing superblock is served as "
                    "the kernel's bcache serves it) or never (every export "
                    "is served whole)", value);
      return -1;
    }
  }
  else if (strcmp (key, "bcache-io") == 0) {
    if (strcmp (value, "uring") == 0)
      cfg.io_mode = BCF_IO_URING;
    else if (strcmp (value, "sync") == 0)
      cfg.io_mode = BCF_IO_SYNC;
    else if (strcmp (value, "auto") == 0)
      cfg.io_mode = BCF_IO_AUTO;
    else {
      nbdkit_error ("bcache-io=%s: use uring, sync or auto", value);
      return -1;
    }
  }
  else if (strcmp (key, "bcache-direct") == 0) {
    return parse_bool_param (key, value, &cfg.direct);
  }
  else if (strcmp (key, "bcache-ctl") == 0) {
    if (!*value) {
      nbdkit_error ("bcache-ctl=: give the path of the control socket");
      return -1;
    }
    cfg.ctl_path = value;
  }
  else if (strcmp (key, "bcache-node-cache") == 0)
    return parse_size_param (key, value, 1 << 20, &cfg.node_cache);
  else if (strcmp (key, "bcache-journal-delay") == 0) {
    if (nbdkit_parse_unsigned (key, value, &cfg.journal_delay_ms) == -1)
      return -1;
    if (cfg.journal_delay_ms == 0 || cfg.journal_delay_ms > 10000) {
      nbdkit_error ("bcache-journal-delay=%s: milliseconds, 1 to 10000",
                    value);
      return -1;
    }
  }
  else if (strcmp (key, "bcache-error-limit") == 0) {
    if (nbdkit_parse_unsigned (key, value, &cfg.error_limit) == -1)
      return -1;
    if (cfg.error_limit == 0) {
      nbdkit_error ("bcache-error-limit=0: must be at least 1");
      return -1;
    }
  }
  else if (strcmp (key, "bcache-test-disable-tracker") == 0) {
    return parse_bool_param (key, value, &cfg.test_no_tracker);
  }
  else {
    nbdkit_error ("unknown parameter %s: see nbdkit-bcachefilter-filter(1) "
                  "or --help for the bcache-* parameters", key);
    return -1;
  }
  return 0;
}

static int
filter_config_complete (nbdkit_next_config_complete *next, nbdkit_backend *nxdata)
{
  char err[512];

  if (!cfg.path) {
    nbdkit_error ("bcache=PATH is required: the cache device or file "
                  "(with bcache-size=SIZE to create a file)");
    return -1;
  }
  if (cfg.block_size && cfg.bucket_size && cfg.block_size > cfg.bucket_size) {
    nbdkit_error ("bcache-block-size (%" PRIi64 ") is larger than "
                  "bcache-bucket-size (%" PRIi64 ")", cfg.block_size,
                  cfg.bucket_size);
    return -1;
  }
  if (!cfg.have_uuid) {
    /* Derived from the export's identifying parameters. */
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 8; j++)
        cfg.uuid[i * 8 + j] = (uint8_t) (id_hash[i] >> (8 * j));
    cfg.uuid[6] = (cfg.uuid[6] & 0x0f) | 0x80;        /* "v8" */
    cfg.uuid[8] = (cfg.uuid[8] & 0x3f) | 0x80;
  }
  if (cfg.ctl_path && bcf_ctl_check_path (cfg.ctl_path, err, sizeof err) < 0) {
    nbdkit_error ("bcache-ctl=%s: %s", cfg.ctl_path, err);
    return -1;
  }
  return next (nxdata);
}

#define filter_config_help \
  "bcache=PATH                 (required) cache device or file\n" \
  "bcache-size=SIZE            create the cache file with this size\n" \
  "bcache-format=auto|never|force  what to do with a non-cache device\n" \
  "bcache-mode=writethrough|writearound|none  cache mode\n" \
  "bcache-bucket-size=SIZE     bucket size when formatting (512K)\n" \
  "bcache-block-size=SIZE      block size when formatting (device block)\n" \
  "bcache-sequential-cutoff=SIZE  bypass streams this long (4M; 0 off)\n" \
  "bcache-backing-uuid=UUID    identity of the export in the cache\n" \
  "bcache-backing-device=auto|never  serve a bcache backing device's data\n" \
  "bcache-io=uring|sync|auto   cache device I/O (auto)\n" \
  "bcache-direct=BOOL          use O_DIRECT on the cache (true)\n" \
  "bcache-ctl=PATH             control socket (bcachefilter-ctl)\n" \
  "bcache-node-cache=SIZE      btree node cache memory bound (256M)\n" \
  "bcache-journal-delay=MS     journal batching delay (100)\n" \
  "bcache-error-limit=N        device errors before passing through (64)\n" \
  "bcache-test-disable-tracker=BOOL  tests only: unsafe"

/* ---- .get_ready: probe the cache device before forking ---------------------------- */

/* Can a cache of size bytes be formatted with the configured geometry,
 * so that the Linux kernel could register it (more than 512 buckets,
 * BCH_KERNEL_MIN_NBUCKETS)?  Without bcache-bucket-size the engine
 * picks smaller buckets for a small cache (bch_default_bucket_sectors),
 * with a warning. */
static int
check_format_size (uint64_t size, const char *what)
{
  uint64_t bucket = cfg.bucket_size ? (uint64_t) cfg.bucket_size
    : (uint64_t) bch_default_bucket_sectors (size >> BCH_SECTOR_SHIFT,
                                             (unsigned) (cfg.block_size >> 9))
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

/* An existing cache: open it read-only (no writes, no export needed) to
 * check everything the real open will check, and whose export it holds. */
static int
probe_existing_cache (void)
{
  struct bcf_cache_opts o = { 0 };
  struct bcf_cache *c;
  char err[512], have[37], want[37];
  uint8_t uuid[16];
  uint64_t bytes;
  int r;

  o.path = cfg.path;
  o.readonly = true;
  o.io_mode = BCF_IO_SYNC;      /* no io_uring ring before the fork */
  o.direct_off = !cfg.direct;
  o.format = BCF_FORMAT_NEVER;
  r = bcf_cache_open (&o, &c, err, sizeof err);
  if (r < 0) {
    nbdkit_error ("bcache=%s: %s.  Check it with bcachefilter-show --fsck; "
                  "bcache-format=force starts a new, empty cache there",
                  cfg.path, err);
    return -1;
  }
  r = 0;
  /* An entry that records no size is a bcache backing device's (the
   * kernel's, or ours for an export that is one).  If the export may be
   * one too (bcache-backing-device=auto), its uuid comes from the
   * export's superblock, which only .after_fork can read: compared
   * there. */
  if (bcf_cache_owner (c, uuid, &bytes) && (bytes != 0 || !cfg.bdev_auto) &&
      memcmp (uuid, cfg.uuid, 16) != 0) {
    bch_uuid_unparse (uuid, have);
    bch_uuid_unparse (cfg.uuid, want);
    nbdkit_error ("bcache=%s caches another export (uuid %s, %" PRIu64
                  " bytes), not this one (uuid %s%s%s).  Give that export's "
                  "bcache-backing-uuid= if it is the same export under a new "
                  "name, or bcache-format=force to start an empty cache for "
                  "this one", cfg.path, have, bytes, want,
                  cfg.have_uuid ? "" : ", derived from ",
                  cfg.have_uuid ? "" : (id_any ? id_text : "no parameters"));
    r = -1;
  }
  bcf_cache_close (c);
  return r;
}

/* Refuse now, with a clear message, whatever the open in .after_fork
 * would refuse: that one runs after nbdkit has forked and started
 * serving.  Only a change of the export's size is left for it. */
static int
probe_cache_device (void)
{
  uint8_t buf[BCH_SB_OFFSET + BCH_SB_AREA_SIZE];
  struct bch_sb sb;
  struct bch_diag d;
  enum bch_status st;
  struct stat s;
  uint64_t size;
  ssize_t n;
  int fd;

  if (stat (cfg.path, &s) == -1) {
    nbdkit_error ("bcache=%s: %m", cfg.path);
    return -1;
  }
  if (!S_ISREG (s.st_mode) && !S_ISBLK (s.st_mode)) {
    nbdkit_error ("bcache=%s is neither a regular file nor a block device",
                  cfg.path);
    return -1;
  }
  fd = open (cfg.path, O_RDWR | O_CLOEXEC);
  if (fd == -1) {
    nbdkit_error ("bcache=%s: cannot open for reading and writing: %m (the "
                  "cache must be writable by the user running nbdkit)",
                  cfg.path);
    return -1;
  }
  {
    off_t end = lseek (fd, 0, SEEK_END);
    size = end > 0 ? (uint64_t) end : 0;
  }
  n = pread (fd, buf, sizeof buf, 0);
  close (fd);
  if (n < 0) {
    nbdkit_error ("bcache=%s: cannot read: %m", cfg.path);
    return -1;
  }
  if ((size_t) n < sizeof buf) {
    nbdkit_error ("bcache=%s is too small to be a cache (%" PRIu64 " bytes)",
                  cfg.path, size);
    return -1;
  }
  if (cfg.format == BCF_FORMAT_FORCE)
    return check_format_size (size, cfg.path);
  if (bch_is_zero (buf, sizeof buf)) {
    char err[512] = "";
    bool blank;

    /* The engine's definition of blank (its edges too), so that what
     * passes here is what .after_fork's open will format. */
    if (bcf_device_blank (cfg.path, &blank, err, sizeof err) < 0) {
      nbdkit_error ("bcache=%s: %s", cfg.path, err);
      return -1;
    }
    if (!blank) {
      nbdkit_error ("bcache=%s starts with zeros but is not blank: there "
                    "is data in its first or last MiB (a filesystem, RAID "
                    "or partition table signature?); refusing to overwrite "
                    "it.  If it really is meant to be a cache, add "
                    "bcache-format=force (this destroys it)", cfg.path);
      return -1;
    }
    if (cfg.format == BCF_FORMAT_NEVER) {
      nbdkit_error ("bcache=%s is blank, not a cache, and bcache-format=never "
                    "forbids formatting it", cfg.path);
      return -1;
    }
    return check_format_size (size, cfg.path);
  }
  st = bch_sb_decode (buf + BCH_SB_OFFSET, BCH_SB_AREA_SIZE, &sb, &d);
  switch (st) {
  case BCH_OK:
    if (!(sb.flags & BCH_CACHE_SYNC)) {   /* made by make-bcache -C */
      if (cfg.format == BCF_FORMAT_NEVER) {
        nbdkit_error ("bcache=%s was made by make-bcache but never "
                      "registered, and bcache-format=never forbids "
                      "initialising it", cfg.path);
        return -1;
      }
      if (sb.nbuckets < BCH_KERNEL_MIN_NBUCKETS) {
        nbdkit_error ("bcache=%s was made by make-bcache with %" PRIu64
                      " buckets, but the Linux kernel registers no cache "
                      "with 512 buckets or fewer; make it again with "
                      "smaller buckets (make-bcache -b), or give "
                      "bcache-format=force to format it with more",
                      cfg.path, sb.nbuckets);
        return -1;
      }
      return 0;
    }
    return probe_existing_cache ();
  case BCH_ERR_MAGIC:
    nbdkit_error ("bcache=%s holds data that is not a bcache cache; "
                  "refusing to overwrite it.  If it really is meant to be "
                  "a cache, add bcache-format=force (this destroys it)",
                  cfg.path);
    return -1;
  case BCH_ERR_BACKING:
    nbdkit_error ("bcache=%s is a bcache backing device, not a cache "
                  "device (make-bcache -C makes cache devices)", cfg.path);
    return -1;
  default:
    nbdkit_error ("bcache=%s: corrupt bcache superblock (%s).  Check it "
                  "with bcachefilter-show --fsck; bcache-format=force "
                  "starts a new, empty cache", cfg.path, d.msg);
    return -1;
  }
}

/* A cache file that does not exist yet: may it be created (claiming it
 * creates it)?  0 also when it exists. */
static int
check_new_file (void)
{
  struct stat s;
  char *dir, *slash;
  int ok;

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
  ok = access (dir, W_OK | X_OK) == 0;
  if (!ok)
    nbdkit_error ("bcache=%s cannot be created: directory %s: %m",
                  cfg.path, dir);
  free (dir);
  if (!ok)
    return -1;
  return check_format_size ((uint64_t) cfg.create_size, "bcache-size");
}

/* Claim the cache device before anything reads or writes it, and hold
 * the claim for the life of the process: nbdkit forks into the
 * background after .get_ready, and the child inherits the claim's
 * descriptor, so the lock is never let go in between (DESIGN.md "One
 * writer per cache").  Claiming a missing file creates it. */
static int
claim_cache_device (void)
{
  char err[1024];
  int r = bcf_claim_open (cfg.path, (uint64_t) cfg.create_size, &claim,
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

static int
filter_get_ready (int thread_model)
{
  if (check_new_file () == -1 || claim_cache_device () == -1)
    return -1;
  return probe_cache_device ();
}

/* ---- .after_fork: open the cache -------------------------------------------------- */

/* The engine's view of a backing store: a connection's nbdkit_next.  Only
 * the size is used at open; requests build their own (see struct bk). */
struct bk {
  nbdkit_next *next;
  uint32_t flags;               /* of the client request (FAST_ZERO) */
  bool fua_native;
};

static int
bk_err (int e)
{
  return -(e ? e : EIO);
}

static int
bk_pread (void *opaque, void *buf, uint32_t count, uint64_t offset)
{
  struct bk *k = opaque;
  int e = 0;

  return k->next->pread (k->next, buf, count, offset, 0, &e) == -1
         ? bk_err (e) : 0;
}

static int
bk_pwrite (void *opaque, const void *buf, uint32_t count, uint64_t offset,
           bool fua)
{
  struct bk *k = opaque;
  uint32_t f = fua && k->fua_native ? NBDKIT_FLAG_FUA : 0;
  int e = 0;

  if (k->next->pwrite (k->next, buf, count, offset, f, &e) == -1)
    return bk_err (e);
  if (fua && !k->fua_native &&
      k->next->flush (k->next, 0, &e) == -1)
    return bk_err (e);
  return 0;
}

static int
bk_flush (void *opaque)
{
  struct bk *k = opaque;
  int e = 0;

  return k->next->flush (k->next, 0, &e) == -1 ? bk_err (e) : 0;
}

static int
bk_trim (void *opaque, uint32_t count, uint64_t offset)
{
  struct bk *k = opaque;
  int e = 0;

  return k->next->trim (k->next, count, offset, 0, &e) == -1
         ? bk_err (e) : 0;
}

static int
bk_zero (void *opaque, uint32_t count, uint64_t offset, bool may_trim)
{
  struct bk *k = opaque;
  uint32_t f = (may_trim ? NBDKIT_FLAG_MAY_TRIM : 0) |
               (k->flags & NBDKIT_FLAG_FAST_ZERO);
  int e = 0;

  return k->next->zero (k->next, count, offset, f, &e) == -1
         ? bk_err (e) : 0;
}

static int64_t
bk_size (void *opaque)
{
  struct bk *k = opaque;
  int64_t s = k->next->get_size (k->next);

  return s < 0 ? -EIO : s;
}

static const struct bcf_backing_ops bk_ops = {
  .pread = bk_pread, .pwrite = bk_pwrite, .flush = bk_flush,
  .trim = bk_trim, .zero = bk_zero, .size = bk_size,
};

/* A request's (or .after_fork's) view of the backing store. */
static void
bk_init (struct bk *k, struct bcf_backing *b, nbdkit_next *next,
         uint32_t flags)
{
  k->next = next;
  k->flags = flags;
  k->fua_native = next->can_fua (next) == NBDKIT_FUA_NATIVE;
  b->ops = &bk_ops;
  b->opaque = k;
}


/* A context of our own on the export, for what .after_fork reads and
 * writes before any client connects: its size, and a bcache backing
 * superblock at its start.  Prepared, so it may do I/O (DESIGN.md
 * "Concurrency"). */
static nbdkit_next *
open_export (nbdkit_backend *backend)
{
  nbdkit_next *next = nbdkit_next_context_open (backend, 0, "", 1);

  if (!next) {
    nbdkit_error ("bcachefilter: cannot open the export");
    return NULL;
  }
  if (next->prepare (next) == -1) {
    nbdkit_next_context_close (next);
    return NULL;
  }
  return next;
}

static void
close_export (nbdkit_next *next)
{
  next->finalize (next);
  nbdkit_next_context_close (next);
}

/* Is the export a bcache backing device (with bcache-backing-device=
 * auto)?  Then clients see its data region (data_offset), and its
 * superblock's uuid is the export's identity: bcache-backing-uuid=, if
 * given, must agree. */
static int
probe_backing_device (const struct bcf_backing *b)
{
  char err[512], have[37], want[37];
  struct bch_sb sb;
  int r;

  if (!cfg.bdev_auto)
    return 0;
  r = bcf_bdev_probe (b, &bdev, err, sizeof err);
  if (r < 0) {
    nbdkit_error ("bcachefilter: %s.  To serve the export whole, as any "
                  "other, give bcache-backing-device=never", err);
    return -1;
  }
  if (r == 0)
    return 0;
  bcf_bdev_super (bdev, &sb);
  bch_uuid_unparse (sb.uuid, have);
  if (cfg.have_uuid && memcmp (sb.uuid, cfg.uuid, 16) != 0) {
    bch_uuid_unparse (cfg.uuid, want);
    nbdkit_error ("bcachefilter: bcache-backing-uuid=%s, but the export is "
                  "bcache backing device %s, and its superblock is its "
                  "identity: drop bcache-backing-uuid=, or give "
                  "bcache-backing-device=never to serve the export whole",
                  want, have);
    bcf_bdev_free (bdev);
    bdev = NULL;
    return -1;
  }
  data_offset = bcf_bdev_data_offset (bdev);
  nbdkit_debug ("bcachefilter: the export is bcache backing device %s "
                "(state %s): serving its data from byte %" PRIu64, have,
                bch_bdev_state_name (bch_bdev_state (&sb)), data_offset);
  return 0;
}

/* After the cache is open: mark the backing device attached to it, as
 * the kernel's attach does (its superblock then names this cache set). */
static int
attach_backing_device (const struct bcf_backing *b)
{
  const uint8_t *set = bcf_cache_super (cache)->set_uuid;
  char err[512], dev[37], was[37], now[37];
  struct bch_sb sb;

  bcf_bdev_super (bdev, &sb);
  bch_uuid_unparse (sb.uuid, dev);
  bch_uuid_unparse (sb.set_uuid, was);
  bch_uuid_unparse (set, now);
  /* Until writeback exists (issue 14), dirty data is served but never
   * written back, and a write to part of a block drops the rest of it:
   * let the kernel write it back first. */
  if (bcf_bdev_relation (&sb, set) == BCF_BDEV_OURS_DIRTY) {
    nbdkit_error ("bcachefilter: backing device %s says that this cache "
                  "(set %s) holds dirty data for it (a kernel's writeback "
                  "cache), and the filter does not write dirty data back: "
                  "let the kernel write it back first (echo writethrough "
                  "> /sys/block/bcacheN/bcache/cache_mode, then wait until "
                  "its state is clean)", dev, now);
    return -1;
  }
  if (bcf_bdev_relation (&sb, set) == BCF_BDEV_OTHER_CLEAN) {
    char msg[512];
    snprintf (msg, sizeof msg, "backing device %s was attached to cache set "
              "%s; it is now attached to this cache (set %s), and the copy "
              "of its data in set %s is out of date: do not attach it there "
              "again without detaching it there first", dev, was, now, was);
    engine_log (NULL, BCF_LOG_WARN, msg);
  }
  if (bcf_bdev_attach (bdev, b, set, err, sizeof err) < 0) {
    nbdkit_error ("bcachefilter: attaching backing device %s to cache set "
                  "%s: %s", dev, now, err);
    return -1;
  }
  return 0;
}

static int ctl_stats (FILE *fp, bool json, char *err, size_t errlen);
static int ctl_set (const char *name, const char *value, char *err,
                    size_t errlen);
static int ctl_trigger_gc (char *err, size_t errlen);
static int ctl_show_super (FILE *fp, bool json, char *err, size_t errlen);

static const struct bcf_ctl_ops ctl_ops = {
  .stats = ctl_stats, .set = ctl_set, .trigger_gc = ctl_trigger_gc,
  .show_super = ctl_show_super,
};

/* Fixed-size opaque handed to the engine at open: only .size is called. */
static struct bk open_bk;
static int64_t open_size;

static int64_t
open_size_fn (void *opaque)
{
  return open_size;
}

static const struct bcf_backing_ops open_ops = { .size = open_size_fn };

static int
filter_after_fork (nbdkit_backend *backend)
{
  struct bcf_cache_opts o = { 0 };
  struct bcf_req_opts ro = { 0 };
  struct bk ek;
  struct bcf_backing eb;
  nbdkit_next *next;
  char err[512];
  int r;

  if (!(next = open_export (backend)))
    return -1;
  bk_init (&ek, &eb, next, 0);
  open_size = next->get_size (next);
  if (open_size < 0) {
    nbdkit_error ("bcachefilter: cannot get the size of the export");
    close_export (next);
    return -1;
  }
  export_size = (uint64_t) open_size;
  if (probe_backing_device (&eb) == -1) {
    close_export (next);
    return -1;
  }

  o.path = cfg.path;
  o.claim = claim;               /* created the file if it was missing */
  o.io_mode = cfg.io_mode;
  o.direct_off = !cfg.direct;
  o.format = cfg.format;
  o.bucket_sectors = (unsigned) (cfg.bucket_size >> 9);
  o.block_sectors = (unsigned) (cfg.block_size >> 9);
  o.min_buckets = BCH_KERNEL_MIN_NBUCKETS;
  o.backing = (struct bcf_backing) { .ops = &open_ops, .opaque = &open_bk };
  memcpy (o.backing_uuid, cfg.uuid, 16);
  /* The label is informational and truncated to its 32 bytes. */
  {
    const char *label = id_any ? id_text : "nbdkit export";
    size_t n = strlen (label);
    if (n > sizeof o.backing_label - 1)
      n = sizeof o.backing_label - 1;
    memcpy (o.backing_label, label, n);
  }
  o.node_cache_bytes = (size_t) cfg.node_cache;
  o.journal_delay_ms = cfg.journal_delay_ms;
  o.log = engine_log;
  o.bdev = bdev;

  r = bcf_cache_open (&o, &cache, err, sizeof err);
  if (r < 0) {
    nbdkit_error ("bcachefilter: %s", err);
    if (r == -EEXIST)
      nbdkit_error ("bcachefilter: this cache belongs to another export; "
                    "give the right bcache-backing-uuid=, or "
                    "bcache-format=force to start an empty cache here");
    else if (r == -ESTALE)
      nbdkit_error ("bcachefilter: the export was resized since this cache "
                    "was filled; bcache-format=force starts an empty cache "
                    "for it");
    close_export (next);
    return -1;
  }
  r = bdev ? attach_backing_device (&eb) : 0;
  close_export (next);
  if (r == -1)
    goto fail;
  ro.mode = cfg.mode;
  ro.offset = data_offset;
  ro.sequential_cutoff = (uint64_t) cfg.cutoff;
  ro.error_limit = cfg.error_limit;
  req = bcf_req_new (cache, &ro);
  if (!req) {
    nbdkit_error ("bcachefilter: out of memory");
    goto fail;
  }
  if (cfg.test_no_tracker) {
    fprintf (stderr, "nbdkit: bcachefilter: WARNING: the in-flight write "
             "tracker is disabled (bcache-test-disable-tracker): reads may "
             "cache stale data.  For tests only.\n");
    bcf_req_test_disable_tracker (req, true);
  }
  if ((r = bcf_cache_start_threads (cache)) < 0) {
    nbdkit_error ("bcachefilter: starting the cache threads: %s",
                  strerror (-r));
    goto fail;
  }
  if (cfg.ctl_path) {
    if (bcf_ctl_start (cfg.ctl_path, &ctl_ops, err, sizeof err) < 0) {
      nbdkit_error ("bcache-ctl=%s: %s", cfg.ctl_path, err);
      goto fail;
    }
    ctl_running = true;
  }
  nbdkit_debug ("bcachefilter: cache %s open (%s%s), export %" PRIu64
                " bytes, mode %s", cfg.path, bcf_cache_io_name (cache),
                bcf_cache_io_direct (cache) ? ", O_DIRECT" : "",
                export_size, bcf_cache_mode_name (cfg.mode));
  return 0;

 fail:
  bcf_req_free (req);
  req = NULL;
  bcf_cache_close (cache);
  cache = NULL;
  bcf_bdev_free (bdev);
  bdev = NULL;
  return -1;
}

static void
filter_cleanup (nbdkit_backend *backend)
{
  if (ctl_running) {
    bcf_ctl_stop ();
    ctl_running = false;
  }
  /* The request layer first: its fill workers finish what is queued. */
  bcf_req_free (req);
  req = NULL;
  if (cache) {
    int r = bcf_cache_close (cache);     /* stops threads, checkpoints */
    if (r < 0)
      nbdkit_error ("bcachefilter: closing the cache: %s (nothing is lost: "
                    "the next start recovers from the journal)",
                    strerror (-r));
    cache = NULL;
  }
  bcf_bdev_free (bdev);
  bdev = NULL;
  bcf_claim_release (claim);
  claim = NULL;
}

/* ---- connections ------------------------------------------------------------------ */

static int
filter_thread_model (void)
{
  return NBDKIT_THREAD_MODEL_PARALLEL;
}

static void *
filter_open (nbdkit_next_open *next, nbdkit_context *nxdata, int readonly,
          const char *exportname, int is_tls)
{
  if (next (nxdata, readonly, exportname) == -1)
    return NULL;
  return NBDKIT_HANDLE_NOT_NEEDED;
}

static int
filter_prepare (nbdkit_next *next, void *handle, int readonly)
{
  int64_t size = next->get_size (next);

  if (size == -1)
    return -1;
  if (!req) {
    nbdkit_error ("bcachefilter: the cache is not open");
    return -1;
  }
  if ((uint64_t) size != export_size) {
    nbdkit_error ("bcachefilter: this export has %" PRIi64 " bytes but the "
                  "cache was opened for %" PRIu64 " bytes (one cache serves "
                  "one export)", size, export_size);
    return -1;
  }
  return 0;
}

/* A bcache backing device's clients see its data region only. */
static int64_t
filter_get_size (nbdkit_next *next, void *handle)
{
  int64_t size = next->get_size (next);

  return size == -1 ? -1 : size - (int64_t) data_offset;
}

static int
filter_can_cache (nbdkit_next *next, void *handle)
{
  return NBDKIT_CACHE_NATIVE;
}

static int
result (int r, int *err)
{
  if (r < 0) {
    *err = -r == ERANGE ? EINVAL : -r;
    return -1;
  }
  return 0;
}

static int
filter_pread (nbdkit_next *next, void *handle, void *buf, uint32_t count,
           uint64_t offset, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_read (req, &b, buf, count, offset), err);
}

static int
filter_pwrite (nbdkit_next *next, void *handle, const void *buf, uint32_t count,
            uint64_t offset, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_write (req, &b, buf, count, offset,
                                flags & NBDKIT_FLAG_FUA), err);
}

static int
filter_flush (nbdkit_next *next, void *handle, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_flush (req, &b), err);
}

static int
filter_trim (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
          uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_trim (req, &b, count, offset,
                               flags & NBDKIT_FLAG_FUA), err);
}

static int
filter_zero (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
          uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_zero (req, &b, count, offset,
                               flags & NBDKIT_FLAG_MAY_TRIM,
                               flags & NBDKIT_FLAG_FUA), err);
}

static int
filter_cache_op (nbdkit_next *next, void *handle, uint32_t count,
              uint64_t offset, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_prefetch (req, &b, count, offset), err);
}

/* The export's block status for a data region that begins data_offset
 * bytes into it: asked at the shifted offset, answered shifted back. */
static int
shifted_extents (nbdkit_next *next, uint32_t count, uint64_t offset,
                 uint32_t flags, struct nbdkit_extents *extents, int *err)
{
  struct nbdkit_extents *e;
  int r = 0;

  e = nbdkit_extents_new (offset + data_offset, export_size);
  if (!e) {
    *err = errno;
    return -1;
  }
  if (next->extents (next, count, offset + data_offset, flags, e, err) == -1)
    r = -1;
  for (size_t i = 0; r == 0 && i < nbdkit_extents_count (e); i++) {
    struct nbdkit_extent x = nbdkit_get_extent (e, i);
    if (nbdkit_add_extent (extents, x.offset - data_offset, x.length,
                           x.type) == -1) {
      *err = errno;
      r = -1;
    }
  }
  nbdkit_extents_free (e);
  return r;
}

/* Block status: the backing store's answer, unless the cache holds data
 * there that the backing store does not have yet (dirty): then all data,
 * so no client skips it as a hole or zeroes. */
static int
filter_extents (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
             uint32_t flags, struct nbdkit_extents *extents, int *err)
{
  int d = bcf_req_has_dirty (req, count, offset);

  if (d < 0) {
    *err = -d;
    return -1;
  }
  if (d > 0)
    return nbdkit_add_extent (extents, offset, count, 0);
  if (data_offset)
    return shifted_extents (next, count, offset, flags, extents, err);
  return next->extents (next, count, offset, flags, extents, err);
}

/* ---- control socket --------------------------------------------------------------- */

static void
print_time_stat (FILE *fp, bool json, const char *name,
                 const struct bcf_time_stat *t, bool *first)
{
  if (json)
    fprintf (fp, "%s\"%s\": {\"count\": %" PRIu64 ", \"total_ns\": %" PRIu64
             ", \"max_ns\": %" PRIu64 ", \"last_ns\": %" PRIu64 "}",
             *first ? "" : ", ", name, t->count, t->total_ns, t->max_ns,
             t->last_ns);
  else
    fprintf (fp, "%-28s count %" PRIu64 ", avg %.3f ms, max %.3f ms\n", name,
             t->count, t->count ? t->total_ns / 1e6 / (double) t->count : 0.0,
             t->max_ns / 1e6);
  *first = false;
}

static void
print_u64 (FILE *fp, bool json, const char *name, uint64_t v, bool *first)
{
  if (json)
    fprintf (fp, "%s\"%s\": %" PRIu64, *first ? "" : ", ", name, v);
  else
    fprintf (fp, "%-28s %" PRIu64 "\n", name, v);
  *first = false;
}

static void
print_views (FILE *fp, bool json)
{
  struct bcf_stats *s = bcf_req_counters (req);

  if (json)
    fprintf (fp, "\"views\": {");
  for (int v = 0; v < BCF_VIEW__COUNT; v++) {
    uint64_t c[BCF_STAT__COUNT];
    bool first = true;
    uint64_t lookups;

    bcf_stats_get (s, (enum bcf_stat_view) v, c);
    lookups = c[BCF_STAT_HITS] + c[BCF_STAT_MISSES];
    if (json)
      fprintf (fp, "%s\"%s\": {", v ? ", " : "",
               bcf_stat_view_name ((enum bcf_stat_view) v));
    else
      fprintf (fp, "[%s]\n", bcf_stat_view_name ((enum bcf_stat_view) v));
    for (int k = 0; k < BCF_STAT__COUNT; k++)
      print_u64 (fp, json, bcf_stat_name ((enum bcf_stat_counter) k), c[k],
                 &first);
    print_u64 (fp, json, "cache_hit_ratio",
               lookups ? c[BCF_STAT_HITS] * 100 / lookups : 0, &first);
    if (json)
      fprintf (fp, "}");
  }
  if (json)
    fprintf (fp, "}, ");
}

static int
ctl_stats (FILE *fp, bool json, char *err, size_t errlen)
{
  struct bcf_cache_stats st;
  struct bcf_req_stats rs;
  bool first = true;
  uint64_t c[BCF_STAT__COUNT];

  if (!req) {
    snprintf (err, errlen, "the cache is not open");
    return -1;
  }
  bcf_cache_stats (cache, &st);
  bcf_req_get_stats (req, &rs);
  bcf_stats_get (bcf_req_counters (req), BCF_VIEW_TOTAL, c);

  if (json) {
    fprintf (fp, "{\"cache_mode\": \"%s\", \"sequential_cutoff\": %" PRIu64
             ", \"passthrough\": %s, ",
             bcf_cache_mode_name (bcf_req_mode (req)),
             bcf_req_sequential_cutoff (req), rs.passthrough ? "true" : "false");
    /* The totals at the top level too, under bcache's names. */
    for (int k = 0; k < BCF_STAT__COUNT; k++)
      fprintf (fp, "\"%s\": %" PRIu64 ", ",
               bcf_stat_name ((enum bcf_stat_counter) k), c[k]);
    print_views (fp, json);
    fprintf (fp, "\"engine\": {");
  }
  else {
    fprintf (fp, "%-28s %s\n", "cache_mode",
             bcf_cache_mode_name (bcf_req_mode (req)));
    fprintf (fp, "%-28s %" PRIu64 "\n", "sequential_cutoff",
             bcf_req_sequential_cutoff (req));
    fprintf (fp, "%-28s %s\n", "passthrough", rs.passthrough ? "yes" : "no");
    print_views (fp, json);
    fprintf (fp, "[cache]\n");
  }
  if (!json)      /* at the top level in JSON */
    print_u64 (fp, json, "device_errors", rs.device_errors, &first);
  print_u64 (fp, json, "nbuckets", st.nbuckets, &first);
  print_u64 (fp, json, "bucket_bytes", st.bucket_bytes, &first);
  print_u64 (fp, json, "block_bytes", st.block_bytes, &first);
  print_u64 (fp, json, "buckets_free", st.buckets_free, &first);
  print_u64 (fp, json, "buckets_clean", st.buckets_clean, &first);
  print_u64 (fp, json, "buckets_dirty", st.buckets_dirty, &first);
  print_u64 (fp, json, "buckets_meta", st.buckets_meta, &first);
  print_u64 (fp, json, "dirty_data", st.dirty_sectors << 9, &first);
  print_u64 (fp, json, "btree_nodes", st.btree_nodes, &first);
  print_u64 (fp, json, "btree_depth", st.btree_depth, &first);
  print_u64 (fp, json, "btree_keys", st.btree_keys, &first);
  print_u64 (fp, json, "btree_cache_bytes", st.btree_cache_bytes, &first);
  print_u64 (fp, json, "btree_evictions", st.btree_evictions, &first);
  print_u64 (fp, json, "btree_loads", st.btree_loads, &first);
  print_u64 (fp, json, "journal_seq", st.journal_seq, &first);
  print_u64 (fp, json, "journal_last_seq", st.journal_last_seq, &first);
  print_u64 (fp, json, "journal_writes", st.journal_writes, &first);
  print_u64 (fp, json, "inserts", st.inserts, &first);
  print_u64 (fp, json, "invalidates", st.invalidates, &first);
  print_u64 (fp, json, "gc_passes", st.gc_passes, &first);
  print_u64 (fp, json, "gc_slices", st.gc_slices, &first);
  print_u64 (fp, json, "gc_nodes", st.gc_nodes, &first);
  print_u64 (fp, json, "gc_coalesced", st.gc_coalesced, &first);
  print_time_stat (fp, json, "gc", &st.gc, &first);
  print_time_stat (fp, json, "btree_split", &st.btree_split, &first);
  print_time_stat (fp, json, "journal_write", &st.journal_write, &first);
  print_time_stat (fp, json, "alloc_wait", &st.alloc_wait, &first);
  print_time_stat (fp, json, "checkpoint", &st.checkpoint, &first);
  print_u64 (fp, json, "tracker_bytes", rs.bypass_bytes_now, &first);
  print_u64 (fp, json, "tracker_peak_bytes", rs.bypass_bytes_peak, &first);
  print_u64 (fp, json, "tracker_pages", rs.bypass_pages, &first);
  print_u64 (fp, json, "tracker_reserve_uses", rs.bypass_reserve_uses, &first);
  print_u64 (fp, json, "tracker_in_flight", rs.bypass_in_flight, &first);
  print_u64 (fp, json, "fills_dropped", rs.fills_dropped, &first);
  print_u64 (fp, json, "fill_queue_bytes", rs.fill_queue_bytes, &first);
  if (json)
    fprintf (fp, "}, \"device_errors\": %" PRIu64 "}\n", rs.device_errors);
  return 0;
}

static int
ctl_set (const char *name, const char *value, char *err, size_t errlen)
{
  if (!req) {
    snprintf (err, errlen, "the cache is not open");
    return -1;
  }
  if (strcmp (name, "cache_mode") == 0) {
    int m = parse_mode (value, err, errlen);
    if (m < 0 || bcf_req_set_mode (req, (enum bcf_cache_mode) m) < 0)
      return -1;
    fprintf (stderr, "nbdkit: bcachefilter: cache_mode set to %s\n", value);
    return 0;
  }
  if (strcmp (name, "sequential_cutoff") == 0) {
    char *end;
    unsigned long long v;

    errno = 0;
    v = strtoull (value, &end, 10);
    if (errno || end == value || *end) {
      snprintf (err, errlen, "sequential_cutoff '%s': give a number of bytes",
                value);
      return -1;
    }
    bcf_req_set_sequential_cutoff (req, v);
    return 0;
  }
  snprintf (err, errlen, "unknown setting '%s'; settable: cache_mode, "
            "sequential_cutoff", name);
  return -1;
}

static int
ctl_trigger_gc (char *err, size_t errlen)
{
  if (!cache) {
    snprintf (err, errlen, "the cache is not open");
    return -1;
  }
  bcf_trigger_gc (cache);
  return 0;
}

/* A JSON string literal (paths may hold anything). */
static void
json_string (FILE *fp, const char *s)
{
  fputc ('"', fp);
  for (; *s; s++) {
    unsigned char ch = (unsigned char) *s;
    if (ch == '"' || ch == '\\')
      fprintf (fp, "\\%c", ch);
    else if (ch < 0x20)
      fprintf (fp, "\\u%04x", ch);
    else
      fputc (ch, fp);
  }
  fputc ('"', fp);
}

static int
ctl_show_super (FILE *fp, bool json, char *err, size_t errlen)
{
  const struct bch_sb *sb;
  char set_uuid[37], uuid[37];

  if (!cache) {
    snprintf (err, errlen, "the cache is not open");
    return -1;
  }
  sb = bcf_cache_super (cache);
  bch_uuid_unparse (sb->set_uuid, set_uuid);
  bch_uuid_unparse (sb->uuid, uuid);
  if (json) {
    fprintf (fp, "{\"path\": ");
    json_string (fp, cfg.path);
    fprintf (fp, ", \"version\": %" PRIu64 ", "
             "\"cset_uuid\": \"%s\", \"dev_uuid\": \"%s\", "
             "\"block_size\": %u, \"bucket_size\": %u, \"nbuckets\": %" PRIu64
             ", \"first_bucket\": %u, \"njournal_buckets\": %u, "
             "\"sync\": %s, \"io\": \"%s\", \"direct\": %s, "
             "\"export_size\": %" PRIu64 "}\n",
             sb->version, set_uuid, uuid,
             (unsigned) sb->block_size << 9, (unsigned) sb->bucket_size << 9,
             sb->nbuckets, sb->first_bucket, sb->njournal_buckets,
             sb->flags & BCH_CACHE_SYNC ? "true" : "false",
             bcf_cache_io_name (cache),
             bcf_cache_io_direct (cache) ? "true" : "false", export_size);
  }
  else
    fprintf (fp, "path                 %s\n"
             "sb.version           %" PRIu64 "\n"
             "cset.uuid            %s\n"
             "dev.uuid             %s\n"
             "dev.sectors_per_block %u\n"
             "dev.sectors_per_bucket %u\n"
             "dev.cache.first_bucket %u\n"
             "dev.cache.nbuckets   %" PRIu64 "\n"
             "journal_buckets      %u\n"
             "cache_sync           %s\n"
             "io                   %s%s\n"
             "export_size          %" PRIu64 "\n",
             cfg.path, sb->version, set_uuid, uuid,
             (unsigned) sb->block_size, (unsigned) sb->bucket_size,
             sb->first_bucket, sb->nbuckets, sb->njournal_buckets,
             sb->flags & BCH_CACHE_SYNC ? "yes" : "no",
             bcf_cache_io_name (cache),
             bcf_cache_io_direct (cache) ? ", O_DIRECT" : "", export_size);
  return 0;
}

static struct nbdkit_filter filter = {
  .name = "bcachefilter",
  .longname = "nbdkit bcache-format persistent cache filter",
  .config = filter_config,
  .config_complete = filter_config_complete,
  .config_help = filter_config_help,
  .thread_model = filter_thread_model,
  .get_ready = filter_get_ready,
  .after_fork = filter_after_fork,
  .cleanup = filter_cleanup,
  .open = filter_open,
  .prepare = filter_prepare,
  .get_size = filter_get_size,
  .can_cache = filter_can_cache,
  .pread = filter_pread,
  .pwrite = filter_pwrite,
  .flush = filter_flush,
  .trim = filter_trim,
  .zero = filter_zero,
  .extents = filter_extents,
  .cache = filter_cache_op,
};

NBDKIT_REGISTER_FILTER (filter)
