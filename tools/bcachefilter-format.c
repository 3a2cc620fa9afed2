/* bcachefilter-format: make a bcache cache device and register it.
 *
 * Design
 * ------
 * The counterpart of 'make-bcache -C' that also does what the kernel does
 * the first time it registers a cache (research/bcache.md §1.9): journal
 * buckets, prio buckets, uuid bucket, an empty root leaf, the first journal
 * entries, and a version 3 superblock with CACHE_SYNC set.  All of that is
 * the engine's format path (core/super.c); this tool only decides whether
 * formatting is safe, calls bcf_cache_open with a format policy and
 * bcf_cache_close, and reports.
 *
 *   1. parse_options: sizes like 512k / 1M / 4096, validated here so that
 *      a bad value gets a message naming the option (powers of two, bucket
 *      4 KiB .. 16 MiB, block 512 .. 4096, block <= bucket).
 *   2. inspect: the engine's probe (bcf_device_probe, bcachefilter/
 *      probe.h: the classification its open decides by) says what is
 *      there:
 *        missing          created with --size, else an error;
 *        blank            formatted;
 *        made by          initialised with its own geometry (options that
 *          make-bcache -C   ask for another geometry are refused);
 *        a live cache     (CACHE_SYNC set) refused unless --force: the
 *                         engine would open it, not format it; and if it
 *                         holds dirty data (counted by a read-only open,
 *                         as bcachefilter-show counts it), refused even
 *                         with --force unless --discard-dirty too: that
 *                         data is the only copy of acknowledged writes
 *                         (the engine refuses it as well);
 *        zero superblock  refused unless --force, naming the first byte
 *          but data in the  that is not zero: a filesystem, RAID or
 *          first or last    volume signature may live past 8 KiB;
 *          MiB
 *        anything else    left to the engine, which refuses it
 *                         (-EMEDIUMTYPE: foreign data or a backing device,
 *                         -EUCLEAN: a damaged bcache superblock); the
 *                         message is the engine's plus a hint to --force.
 *   3. format: bcf_cache_open (policy auto, or force) with a backing store
 *      that has size 0 and fails every I/O, and a zero backing uuid: a
 *      format attaches no export, so uuid slot 0 stays unclaimed and the
 *      first open by the filter claims it (core/super.c open_existing).
 *      Then bcf_cache_close, which checkpoints.
 *      The engine is asked for a cache the Linux kernel can register
 *      (opts.min_buckets: more than 512 buckets), so it refuses to make,
 *      or to initialise a make-bcache device into, a smaller one; without
 *      --bucket-size its default bucket size shrinks on a small device to
 *      make that so, with a warning.
 *   4. summary: the superblock is read back with bch_sb_decode and shown.
 *
 * A file this tool created (--size) is removed again if formatting fails.
 *
 * Exit status (also in bcachefilter-format(1)):
 *   0  formatted (or initialised a make-bcache device)
 *   1  usage error or invalid option value
 *   2  DEVICE holds data that is not a bcache cache (foreign data, a
 *      bcache backing device, a damaged bcache superblock); --force
 *   3  DEVICE already holds a bcache cache (a live one, or one made by
 *      make-bcache with another geometry than asked for); --force; or,
 *      with --force, a cache that holds dirty data; --discard-dirty
 *   4  DEVICE cannot hold a cache with this geometry (too small: the
 *      kernel needs more than 512 buckets; block size below the device's
 *      logical block size, ...)
 *   5  DEVICE cannot be opened, created, read or written, is in use
 *      by another process (a running proxy), or another error
 */

#include <config.h>

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "tool-msg.h"
#include "bcachefilter/cache.h"
#include "bcachefilter/claim.h"
#include "bcachefilter/format.h"
#include "bcachefilter/probe.h"

#define PROGRAM_NAME "bcachefilter-format"

enum {
  EXIT_OK       = 0,
  EXIT_USAGE    = 1,
  EXIT_FOREIGN  = 2,
  EXIT_BCACHE   = 3,
  EXIT_GEOMETRY = 4,
  EXIT_IO       = 5,
};

/* Bucket sizes the engine writes: a power of two of 4 KiB (bcache's
 * PAGE_SECTORS minimum) up to 32768 sectors (the 16-bit bucket_size
 * field; larger buckets need bcache's large-bucket feature). */
#define MIN_BUCKET_BYTES  4096ull
#define MAX_BUCKET_BYTES  (32768ull * BCH_SECTOR_SIZE)
#define MIN_BLOCK_BYTES   512ull
#define MAX_BLOCK_BYTES   4096ull
/* Print a progress line for devices larger than this. */
#define PROGRESS_BYTES    (1ull << 30)

struct options {
  const char *path;
  uint64_t bucket_bytes;        /* 0 = not given */
  uint64_t block_bytes;         /* 0 = not given */
  const char *bucket_arg, *block_arg;   /* as given, for messages */
  int replacement;              /* -1 = not given */
  uint64_t size;                /* --size, 0 = not given */
  bool force;
  bool discard_dirty;           /* --discard-dirty: with --force */
  bool verbose;
};

/* "PROGRAM: DEVICE: message\n" on stderr. */
DEFINE_DEVICE_ERROR

static void __attribute__ ((format (printf, 1, 2)))
usage_error (const char *fs, ...)
{
  va_list args;

  fprintf (stderr, "%s: ", PROGRAM_NAME);
  va_start (args, fs);
  vfprintf (stderr, fs, args);
  va_end (args);
  fputc ('\n', stderr);
}

/* "512 KiB", "1 MiB", "4 KiB", "512 bytes" (exact, power-of-two units). */
static void
human (uint64_t bytes, char *buf, size_t len)
{
  static const char *const units[] = { "bytes", "KiB", "MiB", "GiB", "TiB",
                                        "PiB", "EiB" };
  unsigned u = 0;

  while (u + 1 < sizeof units / sizeof units[0] && bytes >= 1024 &&
         bytes % 1024 == 0) {
    bytes /= 1024;
    u++;
  }
  snprintf (buf, len, "%" PRIu64 " %s", bytes, units[u]);
}

/* ------------------------------------------------------------------------
 * Options
 * ------------------------------------------------------------------------ */

/* Parse a size: digits, then optionally one of k, M, G, T, P, E (either
 * case, powers of 1024), optionally followed by "iB" or "B".  Returns 0,
 * or -1 with the reason in why. */
static int
parse_size (const char *s, uint64_t *out, const char **why)
{
  const char *p = s;
  uint64_t n = 0, mult = 1;

  if (*p < '0' || *p > '9') {
    *why = "expected a number, optionally followed by k, M, G or T";
    return -1;
  }
  while (*p >= '0' && *p <= '9') {
    if (__builtin_mul_overflow (n, 10, &n) ||
        __builtin_add_overflow (n, (uint64_t) (*p - '0'), &n)) {
      *why = "number too large";
      return -1;
    }
    p++;
  }
  if (*p) {
    const char *units = "kmgtpe";
    const char *u = strchr (units, *p | 0x20);

    if (!u || *p == ' ') {
      *why = "unknown unit (use k, M, G or T, powers of 1024)";
      return -1;
    }
    for (ptrdiff_t i = 0; i <= u - units; i++)
      mult *= 1024;
    p++;
    if (strcmp (p, "iB") == 0 || strcmp (p, "B") == 0 || strcmp (p, "b") == 0)
      p += strlen (p);
    if (*p) {
      *why = "unexpected characters after the unit";
      return -1;
    }
  }
  if (__builtin_mul_overflow (n, mult, out)) {
    *why = "number too large";
    return -1;
  }
  return 0;
}

static bool
is_pow2 (uint64_t x)
{
  return x && !(x & (x - 1));
}

/* Parse and check the value of a size option.  Returns 0 or EXIT_USAGE. */
static int
size_option (const char *name, const char *arg, uint64_t *out)
{
  const char *why;

  if (parse_size (arg, out, &why) == -1) {
    usage_error ("%s '%s': %s", name, arg, why);
    return EXIT_USAGE;
  }
  return 0;
}

static int
check_geometry (const struct options *o)
{
  if (o->bucket_bytes) {
    const char *a = o->bucket_arg;

    if (!is_pow2 (o->bucket_bytes)) {
      usage_error ("--bucket-size %s: not a power of two", a);
      return EXIT_USAGE;
    }
    if (o->bucket_bytes < MIN_BUCKET_BYTES) {
      usage_error ("--bucket-size %s: too small, buckets are at least 4k",
                   a);
      return EXIT_USAGE;
    }
    if (o->bucket_bytes > MAX_BUCKET_BYTES) {
      usage_error ("--bucket-size %s: too large, buckets are at most 16M "
                   "(larger ones need bcache's large-bucket feature, which "
                   "bcachefilter does not write)", a);
      return EXIT_USAGE;
    }
  }
  if (o->block_bytes) {
    const char *a = o->block_arg;

    if (!is_pow2 (o->block_bytes)) {
      usage_error ("--block-size %s: not a power of two", a);
      return EXIT_USAGE;
    }
    if (o->block_bytes < MIN_BLOCK_BYTES || o->block_bytes > MAX_BLOCK_BYTES) {
      usage_error ("--block-size %s: must be 512, 1k, 2k or 4k", a);
      return EXIT_USAGE;
    }
  }
  if (o->bucket_bytes && o->block_bytes && o->block_bytes > o->bucket_bytes) {
    usage_error ("--block-size %s is larger than --bucket-size %s",
                 o->block_arg, o->bucket_arg);
    return EXIT_USAGE;
  }
  return 0;
}

static void
usage (FILE *fp)
{
  fprintf (fp,
           "Usage: %s [OPTIONS] DEVICE\n"
           "       %s --help | --version\n"
           "Format DEVICE (a block device or a file) as a bcache cache and\n"
           "register it for the first time, ready for the bcachefilter filter.\n"
           "\n"
           "  -b, --bucket-size SIZE   bucket size, a power of two from 4k to\n"
           "                           16M (default 512k)\n"
           "  -w, --block-size SIZE    block size: 512, 1k, 2k or 4k (default:\n"
           "                           the device's logical block size)\n"
           "      --replacement POLICY lru (default), fifo or random\n"
           "  -s, --size SIZE          create DEVICE as a file of SIZE bytes if\n"
           "                           it does not exist\n"
           "  -f, --force              format even if DEVICE holds a bcache\n"
           "                           cache or other data (destroys it), but\n"
           "                           not a cache holding dirty data\n"
           "      --discard-dirty      with --force: format a cache holding\n"
           "                           dirty data too (loses those writes)\n"
           "  -v, --verbose            print the engine's messages\n"
           "  -h, --help               print this help and exit\n"
           "  -V, --version            print the version and exit\n"
           "\n"
           "SIZE is a number of bytes, optionally with k, M, G or T (powers\n"
           "of 1024).\n"
           "Exit status: 0 formatted, 1 usage error, 2 holds other data (see\n"
           "--force), 3 already a bcache cache (see --force), 4 cannot hold a\n"
           "cache of this geometry, 5 I/O or other error.\n"
           "See bcachefilter-format(1).\n",
           PROGRAM_NAME, PROGRAM_NAME);
}

/* Returns -1 to continue, else the exit status. */
static int
parse_options (int argc, char *argv[], struct options *o)
{
  enum { REPLACEMENT_OPTION = 256, DISCARD_DIRTY_OPTION };
  static const struct option long_options[] = {
    { "bucket-size", required_argument, NULL, 'b' },
    { "block-size",  required_argument, NULL, 'w' },
    { "replacement", required_argument, NULL, REPLACEMENT_OPTION },
    { "size",        required_argument, NULL, 's' },
    { "force",       no_argument,       NULL, 'f' },
    { "discard-dirty", no_argument,     NULL, DISCARD_DIRTY_OPTION },
    { "verbose",     no_argument,       NULL, 'v' },
    { "help",        no_argument,       NULL, 'h' },
    { "version",     no_argument,       NULL, 'V' },
    { NULL, 0, NULL, 0 }
  };
  int c, r;

  o->replacement = -1;
  while ((c = getopt_long (argc, argv, "b:w:s:fvhV", long_options, NULL))
         != -1) {
    switch (c) {
    case 'b':
      if ((r = size_option ("--bucket-size", optarg, &o->bucket_bytes)))
        return r;
      o->bucket_arg = optarg;
      if (o->bucket_bytes == 0) {
        usage_error ("--bucket-size 0: must not be zero");
        return EXIT_USAGE;
      }
      break;
    case 'w':
      if ((r = size_option ("--block-size", optarg, &o->block_bytes)))
        return r;
      o->block_arg = optarg;
      if (o->block_bytes == 0) {
        usage_error ("--block-size 0: must not be zero");
        return EXIT_USAGE;
      }
      break;
    case 's':
      if ((r = size_option ("--size", optarg, &o->size)))
        return r;
      if (o->size == 0) {
        usage_error ("--size 0: must not be zero");
        return EXIT_USAGE;
      }
      break;
    case REPLACEMENT_OPTION:
      if (strcmp (optarg, "lru") == 0)
        o->replacement = BCH_REPLACEMENT_LRU;
      else if (strcmp (optarg, "fifo") == 0)
        o->replacement = BCH_REPLACEMENT_FIFO;
      else if (strcmp (optarg, "random") == 0)
        o->replacement = BCH_REPLACEMENT_RANDOM;
      else {
        usage_error ("--replacement '%s': must be lru, fifo or random",
                     optarg);
        return EXIT_USAGE;
      }
      break;
    case 'f': o->force = true; break;
    case DISCARD_DIRTY_OPTION: o->discard_dirty = true; break;
    case 'v': o->verbose = true; break;
    case 'h': usage (stdout); return EXIT_OK;
    case 'V': printf ("%s %s\n", PROGRAM_NAME, PACKAGE_VERSION); return EXIT_OK;
    default: usage (stderr); return EXIT_USAGE;
    }
  }
  if (argc - optind != 1) {
    usage_error ("%s", optind == argc ? "missing DEVICE argument"
                                      : "too many arguments");
    usage (stderr);
    return EXIT_USAGE;
  }
  if (o->discard_dirty && !o->force) {
    usage_error ("--discard-dirty is a refinement of --force: give both to "
                 "format a cache that holds dirty data");
    return EXIT_USAGE;
  }
  o->path = argv[optind];
  if (o->path[0] == '\0') {
    usage_error ("DEVICE must not be empty");
    return EXIT_USAGE;
  }
  return check_geometry (o) ? EXIT_USAGE : -1;
}

/* ------------------------------------------------------------------------
 * What is on the device now
 * ------------------------------------------------------------------------ */

enum existing_kind {
  EX_MISSING,           /* no such file */
  EX_BLANK,             /* zero superblock area, nothing found nearby */
  EX_DATA_PAST_SB,      /* zero superblock area, data elsewhere */
  EX_MAKE_BCACHE,       /* a cache superblock, CACHE_SYNC clear */
  EX_LIVE,              /* a cache superblock, CACHE_SYNC set */
  EX_OTHER,             /* anything else: left to the engine */
};

struct existing {
  enum existing_kind kind;
  uint64_t bytes;               /* size of the device */
  uint64_t data_at;             /* EX_DATA_PAST_SB: first non-zero byte */
  struct bch_sb sb;             /* EX_MAKE_BCACHE, EX_LIVE */
};

static int
read_at (int fd, void *buf, size_t len, uint64_t off)
{
  uint8_t *p = buf;

  while (len > 0) {
    ssize_t r = pread (fd, p, len, (off_t) off);

    if (r == -1 && errno == EINTR)
      continue;
    if (r <= 0) {
      if (r == 0)
        errno = EIO;
      return -1;
    }
    p += r;
    len -= (size_t) r;
    off += (uint64_t) r;
  }
  return 0;
}

/* An error from the engine: its messages mostly name the path already. */
static void
engine_error (const char *path, const char *err, const char *hint)
{
  fprintf (stderr, "%s: %s%s%s%s\n", PROGRAM_NAME,
           strstr (err, path) ? "" : path, strstr (err, path) ? "" : ": ",
           err, hint);
}

/* What the engine's probe found, in the terms this tool acts on. */
static enum existing_kind
existing_kind (const struct bcf_device_verdict *v)
{
  switch (v->kind) {
  case BCF_DEVICE_BLANK:       return EX_BLANK;
  case BCF_DEVICE_MAKE_BCACHE: return EX_MAKE_BCACHE;
  case BCF_DEVICE_CACHE:       return EX_LIVE;
  case BCF_DEVICE_FOREIGN:
    return v->data_at != UINT64_MAX ? EX_DATA_PAST_SB : EX_OTHER;
  default:                     return EX_OTHER;
  }
}

/* Returns -1 to continue, else an exit status (with a message). */
static int
inspect (const struct options *o, struct existing *ex)
{
  struct bcf_device_verdict v;
  struct stat st;
  char err[1024];

  memset (ex, 0, sizeof *ex);
  if (stat (o->path, &st) == -1) {
    if (errno == ENOENT && o->size) {
      ex->kind = EX_MISSING;
      return -1;
    }
    device_error (o->path, "cannot open: %m%s",
                  errno == ENOENT ? " (use --size SIZE to create a file)" : "");
    return EXIT_IO;
  }
  if (!S_ISREG (st.st_mode) && !S_ISBLK (st.st_mode)) {
    device_error (o->path, "not a regular file or block device");
    return EXIT_IO;
  }
  if (o->size && S_ISREG (st.st_mode) && (uint64_t) st.st_size != o->size)
    fprintf (stderr, "%s: %s: note: the file exists (%" PRIu64 " bytes); "
             "--size is ignored\n", PROGRAM_NAME, o->path,
             (uint64_t) st.st_size);
  if (bcf_device_probe (o->path, NULL, &v, err, sizeof err) < 0) {
    engine_error (o->path, err, "");
    return EXIT_IO;
  }
  ex->kind = existing_kind (&v);
  ex->bytes = v.size;
  ex->data_at = v.data_at;
  ex->sb = v.sb;
  return -1;
}

/* A make-bcache device is initialised with its own geometry: refuse
 * options asking for another.  Returns -1 or EXIT_BCACHE. */
static int
check_make_bcache (const struct options *o, const struct existing *ex)
{
  const uint64_t bucket = bch_sb_bucket_sectors (&ex->sb) * BCH_SECTOR_SIZE;
  const uint64_t block = (uint64_t) ex->sb.block_size * BCH_SECTOR_SIZE;
  static const char *const policy[] = { "lru", "fifo", "random" };
  char have[32], want[32];
  const char *what = NULL, *noun = NULL;

  if (o->bucket_bytes && o->bucket_bytes != bucket) {
    what = "--bucket-size";
    noun = "bucket size";
    human (bucket, have, sizeof have);
    human (o->bucket_bytes, want, sizeof want);
  }
  else if (o->block_bytes && o->block_bytes != block) {
    what = "--block-size";
    noun = "block size";
    human (block, have, sizeof have);
    human (o->block_bytes, want, sizeof want);
  }
  else if (o->replacement >= 0 &&
           (unsigned) o->replacement != bch_sb_replacement (&ex->sb)) {
    unsigned r = bch_sb_replacement (&ex->sb);
    what = "--replacement";
    noun = "replacement policy";
    snprintf (have, sizeof have, "%s", r < 3 ? policy[r] : "unknown");
    snprintf (want, sizeof want, "%s", policy[o->replacement]);
  }
  if (!what)
    return -1;
  device_error (o->path, "made by make-bcache -C with a %s of %s, but %s "
                "asks for %s; leave the option out to initialise it as it "
                "is, or use --force to format it anew", noun, have, what,
                want);
  return EXIT_BCACHE;
}

/* The bucket size a new format of bytes gets: --bucket-size, or the
 * engine's default, which shrinks on small devices so that the cache has
 * more than 512 buckets (bch_default_bucket_sectors). */
static uint64_t
format_bucket_bytes (const struct options *o, uint64_t bytes)
{
  if (o->bucket_bytes)
    return o->bucket_bytes;
  return (uint64_t) bch_default_bucket_sectors (
           bytes / BCH_SECTOR_SIZE,
           (unsigned) (o->block_bytes / BCH_SECTOR_SIZE)) * BCH_SECTOR_SIZE;
}

/* ------------------------------------------------------------------------
 * Formatting through the engine
 * ------------------------------------------------------------------------ */

/* No export is attached at format time: size 0, every I/O fails. */
static int null_pread (void *o, void *b, uint32_t n, uint64_t off)
{ (void) o; (void) b; (void) n; (void) off; return -EIO; }
static int null_pwrite (void *o, const void *b, uint32_t n, uint64_t off,
                        bool fua)
{ (void) o; (void) b; (void) n; (void) off; (void) fua; return -EIO; }
static int null_flush (void *o) { (void) o; return -EIO; }
static int null_trim (void *o, uint32_t n, uint64_t off)
{ (void) o; (void) n; (void) off; return -EIO; }
static int null_zero (void *o, uint32_t n, uint64_t off, bool may_trim)
{ (void) o; (void) n; (void) off; (void) may_trim; return -EIO; }
static int64_t null_size (void *o) { (void) o; return 0; }

static const struct bcf_backing_ops null_backing = {
  .pread = null_pread, .pwrite = null_pwrite, .flush = null_flush,
  .trim = null_trim, .zero = null_zero, .size = null_size,
};

struct log_ctx {
  const char *path;
  bool verbose;
};

static void
engine_log (void *opaque, enum bcf_log_level level, const char *msg)
{
  const struct log_ctx *l = opaque;

  if (level >= BCF_LOG_WARN || l->verbose)
    fprintf (stderr, "%s: %s%s\n", PROGRAM_NAME,
             level >= BCF_LOG_ERROR ? "error: " :
             level == BCF_LOG_WARN ? "warning: " : "", msg);
}

/* Exit status for an engine error. */
static int
errno_to_exit (int r)
{
  switch (-r) {
  case EMEDIUMTYPE:
  case EUCLEAN:
    return EXIT_FOREIGN;
  case ENOTSUP:
  case EEXIST:
    return EXIT_BCACHE;
  case EINVAL:
  case ENOSPC:
  case EFBIG:
    return EXIT_GEOMETRY;
  default:
    return EXIT_IO;
  }
}

/* For a live cache: what it holds, from a read-only open (best effort;
 * as bcachefilter-show counts it): a description for messages, and the
 * bytes of dirty data (0 if it cannot be opened). */
static void
describe_live (const struct options *o, const struct log_ctx *lc,
               char *buf, size_t len, uint64_t *dirty)
{
  struct bcf_cache_opts opts = { 0 };
  struct bcf_cache *c;
  struct bcf_cache_stats st;
  char err[512] = "";
  struct log_ctx quiet = *lc;

  quiet.verbose = false;
  opts.path = o->path;
  opts.readonly = true;
  opts.log = engine_log;
  opts.log_opaque = &quiet;
  *dirty = 0;
  if (bcf_cache_open (&opts, &c, err, sizeof err) < 0) {
    snprintf (buf, len, ", which cannot be opened: %s", err);
    return;
  }
  bcf_cache_stats (c, &st);
  *dirty = bcf_cache_dirty_bytes (c);
  bcf_cache_close (c);
  if (*dirty)
    snprintf (buf, len, ", with %" PRIu64 " bytes (%.1f MiB) of DIRTY data "
              "in %" PRIu64 " buckets (written to the cache but not yet to "
              "its export: formatting loses it)", *dirty,
              (double) *dirty / (1 << 20), st.buckets_dirty);
  else
    snprintf (buf, len, ", %" PRIu64 " buckets of clean data, no dirty data",
              st.buckets_clean);
}

/* --force over a live cache that holds dirty data: the only copy of
 * writes its clients were told are done.  Refused unless --discard-dirty
 * says their loss is meant.  Returns -1 to go on, else EXIT_BCACHE
 * (with a message). */
static int
refuse_losing_dirty (const struct options *o, const struct log_ctx *lc)
{
  char more[512], holder[1024];
  uint64_t dirty;

  /* A cache in use is the engine's to refuse, naming its holder (what
   * a running proxy's cache shows read-only is out of date anyway). */
  if (bcf_claim_probe (o->path, holder, sizeof holder) == 1)
    return -1;
  describe_live (o, lc, more, sizeof more, &dirty);
  if (dirty == 0)
    return -1;
  device_error (o->path, "holds a bcache cache%s.  Refusing to format it: "
                "start the filter on it with its export and write the "
                "dirty data back (bcachefilter-ctl flush, or "
                "bcachefilter-ctl detach), then format it; or add "
                "--discard-dirty to --force to destroy that data", more);
  return EXIT_BCACHE;
}

/* Print the result: the superblock read back. */
static int
summary (const char *path)
{
  static uint8_t area[BCH_SB_AREA_SIZE];
  struct bch_sb sb;
  struct bch_diag d;
  char uuid[37], set_uuid[37], bucket[32], block[32];
  static const char *const policy[] = { "lru", "fifo", "random" };
  unsigned repl;
  int fd = open (path, O_RDONLY | O_CLOEXEC);

  if (fd == -1 || read_at (fd, area, sizeof area, BCH_SB_OFFSET) == -1) {
    device_error (path, "reading the new superblock back: %m");
    if (fd != -1)
      close (fd);
    return EXIT_IO;
  }
  close (fd);
  if (bch_sb_decode (area, sizeof area, &sb, &d) != BCH_OK) {
    device_error (path, "the superblock read back is not valid: %s", d.msg);
    return EXIT_IO;
  }
  bch_uuid_unparse (sb.uuid, uuid);
  bch_uuid_unparse (sb.set_uuid, set_uuid);
  human (bch_sb_bucket_sectors (&sb) * BCH_SECTOR_SIZE, bucket, sizeof bucket);
  human ((uint64_t) sb.block_size * BCH_SECTOR_SIZE, block, sizeof block);
  repl = bch_sb_replacement (&sb);

  printf ("device:           %s\n", path);
  printf ("uuid:             %s\n", uuid);
  printf ("set uuid:         %s\n", set_uuid);
  printf ("version:          %" PRIu64 "\n", sb.version);
  printf ("nbuckets:         %" PRIu64 "\n", sb.nbuckets);
  printf ("bucket size:      %s (%" PRIu64 " sectors)\n", bucket,
          bch_sb_bucket_sectors (&sb));
  printf ("block size:       %s (%u sectors)\n", block, sb.block_size);
  printf ("first bucket:     %u\n", sb.first_bucket);
  if (sb.njournal_buckets)
    printf ("journal buckets:  %u (buckets %" PRIu64 "-%" PRIu64 ")\n",
            sb.njournal_buckets, sb.d[0], sb.d[sb.njournal_buckets - 1]);
  else
    printf ("journal buckets:  0\n");
  printf ("replacement:      %s\n", repl < 3 ? policy[repl] : "unknown");
  if (fflush (stdout) == EOF || ferror (stdout)) {
    fprintf (stderr, "%s: error writing output: %m\n", PROGRAM_NAME);
    return EXIT_IO;
  }
  return EXIT_OK;
}

int
main (int argc, char *argv[])
{
  struct options o = { 0 };
  struct existing ex;
  struct bcf_cache_opts opts = { 0 };
  struct log_ctx lc;
  struct bcf_cache *c;
  char err[1024] = "";
  bool progress = false;
  int r;

  atexit (bcf_release_memory);
  r = parse_options (argc, argv, &o);
  if (r >= 0)
    return r;
  lc.path = o.path;
  lc.verbose = o.verbose;

  r = inspect (&o, &ex);
  if (r >= 0)
    return r;

  if (!o.force) {
    switch (ex.kind) {
    case EX_LIVE: {
      char set_uuid[37], bucket[32], more[512] = "";

      bch_uuid_unparse (ex.sb.set_uuid, set_uuid);
      human (bch_sb_bucket_sectors (&ex.sb) * BCH_SECTOR_SIZE, bucket,
             sizeof bucket);
      char holder[1024];
      uint64_t dirty;

      describe_live (&o, &lc, more, sizeof more, &dirty);
      if (bcf_claim_probe (o.path, holder, sizeof holder) == 1) {
        device_error (o.path, "already holds a bcache cache (cache set %s), "
                      "and it is in use by %s; refusing to format it",
                      set_uuid, holder);
        return EXIT_IO;
      }
      device_error (o.path, "already holds a bcache cache (cache set %s: "
                    "%" PRIu64 " buckets of %s%s); refusing to format it: "
                    "use --force to destroy it", set_uuid, ex.sb.nbuckets,
                    bucket, more);
      return EXIT_BCACHE;
    }
    case EX_DATA_PAST_SB:
      device_error (o.path, "not blank: its first 8 KiB are zero but "
                    "byte %" PRIu64 " is not (it may hold a filesystem, "
                    "RAID member or partition table whose signature lies "
                    "elsewhere); refusing to format it: use --force to "
                    "overwrite it", ex.data_at);
      return EXIT_FOREIGN;
    case EX_MAKE_BCACHE:
      if ((r = check_make_bcache (&o, &ex)) >= 0)
        return r;
      break;
    default:
      break;
    }
  }

  if (o.force && !o.discard_dirty && ex.kind == EX_LIVE &&
      (r = refuse_losing_dirty (&o, &lc)) >= 0)
    return r;

  /* The progress line, for large devices. */
  {
    uint64_t bytes = ex.kind == EX_MISSING ? o.size : ex.bytes;
    uint64_t bucket = format_bucket_bytes (&o, bytes);
    uint64_t nb;
    char h[32];

    if (ex.kind == EX_MAKE_BCACHE && !o.force) {
      bucket = bch_sb_bucket_sectors (&ex.sb) * BCH_SECTOR_SIZE;
      nb = ex.sb.nbuckets;
    }
    else
      nb = bytes / bucket;
    if (bytes > PROGRESS_BYTES) {
      human (bucket, h, sizeof h);
      printf ("formatting %s: %" PRIu64 " buckets of %s ... ", o.path, nb, h);
      fflush (stdout);
      progress = true;
    }
  }

  opts.path = o.path;
  opts.create_size = ex.kind == EX_MISSING ? o.size : 0;
  opts.format = o.force ? BCF_FORMAT_FORCE : BCF_FORMAT_AUTO;
  opts.discard_dirty = o.discard_dirty;
  opts.bucket_sectors = (unsigned) (o.bucket_bytes / BCH_SECTOR_SIZE);
  opts.block_sectors = (unsigned) (o.block_bytes / BCH_SECTOR_SIZE);
  opts.min_buckets = BCH_KERNEL_MIN_NBUCKETS;
  opts.replacement = o.replacement >= 0 ? (unsigned) o.replacement
                                        : BCH_REPLACEMENT_LRU;
  opts.backing.ops = &null_backing;
  opts.backing.opaque = NULL;
  /* opts.backing_uuid stays zero: uuid slot 0 is left unclaimed. */
  opts.log = engine_log;
  opts.log_opaque = &lc;

  r = bcf_cache_open (&opts, &c, err, sizeof err);
  if (r == 0) {
    r = bcf_cache_close (c);
    if (r < 0)
      snprintf (err, sizeof err, "writing the new cache: %s", strerror (-r));
  }
  if (progress)
    printf (r == 0 ? "done\n" : "failed\n");
  if (r < 0) {
    int status = errno_to_exit (r);

    fflush (stdout);
    /* Not if the file is claimed by someone else: then it is theirs. */
    if (ex.kind == EX_MISSING && r != -EBUSY && unlink (o.path) == 0)
      fprintf (stderr, "%s: %s: removed the file created for it\n",
               PROGRAM_NAME, o.path);
    if (err[0] == '\0')
      snprintf (err, sizeof err, "%s", strerror (-r));
    engine_error (o.path, err,
                  status == EXIT_FOREIGN || status == EXIT_BCACHE ?
                  "; use --force to format it anyway (destroying its "
                  "contents)" : "");
    return status;
  }
  return summary (o.path);
}
