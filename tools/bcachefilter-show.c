/* bcachefilter-show: decode and check a bcache cache device offline.
 *
 * Design
 * ------
 * The tool works in three steps, each a small function:
 *
 *   1. open_device:  open DEVICE read-only and find its size (st_size for
 *      a file, the BLKGETSIZE64 ioctl for a block device).
 *   2. load_super:   read the 4096-byte superblock area at byte 4096 with
 *      pread, decode it with bch_sb_decode, check the device size against
 *      nbuckets * bucket_size, then bch_sb_validate.  Every failure is
 *      reported once, on stderr, as "bcachefilter-show: DEVICE: reason",
 *      and mapped to a distinct exit status (below).
 *   3. a mode:       show something about the device.  A mode is a
 *      function called with the loaded device (struct device), selected
 *      by an option:
 *        (default)   the superblock, as bcache-super-show shows it and
 *                    more (sb_view, rendered as text or JSON);
 *        --journal   the journal buckets d[], read and judged by the
 *                    engine's own scan (bcf_journal_inspect,
 *                    bcachefilter/inspect.h): every valid entry and every
 *                    block that carries the journal's magic but does not
 *                    decode, and the verdict the engine's open would
 *                    reach (entries last_seq..newest all there, once,
 *                    with good keys), with the same message;
 *        --btree     the btree, through the engine: a read-only
 *                    bcf_cache_open (which reads and checks the journal,
 *                    prios, uuids and every node, and replays the journal
 *                    in memory), then bcf_btree_walk;
 *        --buckets   bcache's priority_stats from a copy of the engine's
 *                    buckets after that open (which runs the initial
 *                    mark), bcf_cache_buckets;
 *        --fsck      the open itself (every checksum, the journal's
 *                    continuity, every key) plus bcf_cache_fsck;
 *        --verify    the open, with the export at URI (libnbd) as its
 *                    backing store for reads only, then bcf_lookup over
 *                    the whole export: every clean hit is read from the
 *                    cache (bcf_read_hit) and from the export and
 *                    compared; dirty hits are counted, not compared (they
 *                    are newer than the export by design), and so are
 *                    clean hits in write-intent regions still marked
 *                    (bcf_cache_intent_marks: after a crash the export may
 *                    be newer there, and the next open drops them).  The keys are
 *                    at backing-store bytes, which for a bcache backing
 *                    device include its data_offset, so the URI must
 *                    serve the store the filter ran on, whole.
 *      --verify and --fsck show a percentage on stderr when it is a
 *      terminal (struct progress, the one helper for any long mode):
 *      --verify of the export; --fsck of each step of the open
 *      (reading the journal, the btree nodes, replaying the journal),
 *      which the engine reports through opts.progress, because the
 *      open is where its time goes on a large cache (at 1M keys ~98%;
 *      bcf_cache_fsck's walks take the rest).  Engine messages and
 *      errors erase the line first.
 *      The engine modes use only its public API (bcachefilter/cache.h,
 *      inspect.h) on a single-threaded, read-only open, so no lock is
 *      contended.  A read-only open never writes the device.
 *
 * The superblock mode first computes everything it shows into a
 * struct sb_view (raw fields, checksum comparison, derived magics and
 * bucket layout), then renders that view either as text or as one JSON
 * object.  The text output starts with exactly the fields, names, order
 * and formatting of bcache-super-show(8), so the two can be compared line
 * by line; extra information follows in further sections.
 *
 * Everything read from the device is untrusted: all decoding goes through
 * core/format.c (or the engine, which uses it), and the derived values
 * guard against zero and overflowing sizes so that --force can print any
 * superblock.
 *
 * Exit status (also in bcachefilter-show(1)):
 *   0  the superblock is a valid cache superblock (and the mode found
 *      nothing wrong)
 *   1  usage error, or the device cannot be opened, sized or read
 *   2  not a bcache device (no bcache magic at byte 4096)
 *   3  a bcache backing device, not a cache device
 *   4  truncated: smaller than 8 KiB, or than nbuckets * bucket_size
 *   5  bad superblock checksum
 *   6  unsupported superblock version or feature bits (or, in the engine
 *      modes, a cache the engine cannot use: several devices in the set)
 *   7  another superblock field is invalid; in the other modes, corrupt
 *      metadata: a gap in the journal, no valid journal entry, a bad
 *      checksum in a prio bucket or btree node, an invalid key...
 *   8  --fsck found inconsistencies (listed on standard output)
 *   9  the journal, btree and buckets modes only: the device was made by
 *      make-bcache -C and never registered, so it has no journal, btree
 *      or prios yet
 * With --force, statuses 5 to 7 still print the superblock (and still
 * exit with that status).  --verify has its own statuses, like cmp(1):
 * 0 every clean extent agrees, 1 some differ, 2 any error.
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
#include <time.h>
#include <unistd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <linux/fs.h>

#include <json.h>
#include <libnbd.h>

#include "tool-msg.h"
#include "bcachefilter/cache.h"
#include "bcachefilter/claim.h"
#include "bcachefilter/cleanup.h"
#include "bcachefilter/format.h"
#include "bcachefilter/inspect.h"
#include "bcachefilter/stats.h"

#define PROGRAM_NAME "bcachefilter-show"

/* Exit statuses, see the header comment and the man page. */
enum {
  EXIT_OK          = 0,
  EXIT_ERROR       = 1,     /* usage, open, size or read failure */
  EXIT_NOT_BCACHE  = 2,
  EXIT_BACKING     = 3,
  EXIT_TRUNCATED   = 4,
  EXIT_CSUM        = 5,
  EXIT_UNSUPPORTED = 6,
  EXIT_INVALID     = 7,     /* also: corrupt metadata (engine modes) */
  EXIT_FSCK        = 8,     /* --fsck found problems */
  EXIT_NOT_INIT    = 9,     /* never registered: no journal / btree yet */
};

/* The smallest device that can hold a superblock: 4 KiB unused, then
 * the 4 KiB superblock area. */
#define MIN_DEVICE_BYTES (BCH_SB_OFFSET + BCH_SB_AREA_SIZE)

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

/* "PROGRAM: DEVICE: message\n" on stderr. */
DEFINE_DEVICE_ERROR

/* Progress on stderr, only when stderr is a terminal: "LABEL: N%" on
 * one line, rewritten at most four times a second, erased at the end.
 * The one helper for long modes (--verify, and --fsck through the
 * open's steps: progress_step). */
struct progress {
  bool on;
  const char *label;
  uint64_t total;
  struct timespec last;
  int shown;                /* the percentage last printed for this
                               label, or -1 */
  bool drawn;               /* a line is on the terminal */
};

static void
progress_start (struct progress *p, const char *label, uint64_t total)
{
  p->on = isatty (STDERR_FILENO) == 1;
  p->label = label;
  p->total = total;
  p->last = (struct timespec) { 0, 0 };
  p->shown = -1;
  p->drawn = false;
}

static void
progress_update (struct progress *p, uint64_t done)
{
  struct timespec now;
  int pct;

  if (!p->on)
    return;
  clock_gettime (CLOCK_MONOTONIC, &now);
  if ((now.tv_sec - p->last.tv_sec) * 1000000000LL +
      (now.tv_nsec - p->last.tv_nsec) < 250000000LL)
    return;
  pct = p->total ? (int) ((double) done * 100 / (double) p->total) : 100;
  if (pct > 100)
    pct = 100;
  p->last = now;
  if (pct == p->shown)
    return;
  p->shown = pct;
  p->drawn = true;
  /* \033[K: the previous step's label may have been longer. */
  fprintf (stderr, "\r%s: %s: %d%%\033[K", PROGRAM_NAME, p->label, pct);
}

/* A new step of the same run, on the same line: LABEL's share of TOTAL
 * from now on.  The rate limit carries over, so quick steps do not
 * flicker. */
static void
progress_step (struct progress *p, const char *label, uint64_t total)
{
  p->label = label;
  p->total = total;
  p->shown = -1;            /* print the new label even at the same % */
}

/* Erase the line: at the end, and before any other message on stderr
 * (the next update draws it again). */
static void
progress_end (struct progress *p)
{
  if (p->drawn)
    fputs ("\r\033[K", stderr);
  p->shown = -1;
  p->drawn = false;
}

/* a * b, or UINT64_MAX if that overflows (sizes derived from untrusted
 * fields are only ever shown or compared, so saturating is right). */
static uint64_t
mul_sat (uint64_t a, uint64_t b)
{
  uint64_t r;

  return __builtin_mul_overflow (a, b, &r) ? UINT64_MAX : r;
}

/* ------------------------------------------------------------------------
 * The device
 * ------------------------------------------------------------------------ */

struct device {
  const char *path;
  int fd;
  uint64_t bytes;                     /* device or file size */
  uint8_t area[BCH_SB_AREA_SIZE];     /* raw superblock area */
  struct bch_sb sb;                   /* decoded (valid if status allows) */
  struct bch_diag diag;               /* result of decode / validate */
};

/* Size of an open file or block device; -1 with a message on error. */
static int
device_size (struct device *dev)
{
  struct stat st;

  if (fstat (dev->fd, &st) == -1) {
    device_error (dev->path, "fstat: %m");
    return -1;
  }
  if (S_ISREG (st.st_mode)) {
    dev->bytes = (uint64_t) st.st_size;
    return 0;
  }
  if (S_ISBLK (st.st_mode)) {
    if (ioctl (dev->fd, BLKGETSIZE64, &dev->bytes) == -1) {
      device_error (dev->path, "ioctl BLKGETSIZE64: %m");
      return -1;
    }
    return 0;
  }
  device_error (dev->path, "not a regular file or block device");
  return -1;
}

/* Read exactly len bytes at offset; 0 on success, -1 with a message. */
static int
read_exact (const struct device *dev, void *buf, size_t len, off_t offset)
{
  uint8_t *p = buf;

  while (len > 0) {
    ssize_t r = pread (dev->fd, p, len, offset);

    if (r == -1) {
      if (errno == EINTR)
        continue;
      device_error (dev->path, "read at byte %jd: %m", (intmax_t) offset);
      return -1;
    }
    if (r == 0) {
      device_error (dev->path, "read at byte %jd: unexpected end of file",
                    (intmax_t) offset);
      return -1;
    }
    p += r;
    len -= (size_t) r;
    offset += r;
  }
  return 0;
}

/* Open path and read its size; returns EXIT_OK or EXIT_ERROR.  On
 * success the caller owns dev->fd. */
static int
open_device (struct device *dev, const char *path)
{
  dev->path = path;
  dev->fd = open (path, O_RDONLY | O_CLOEXEC);
  if (dev->fd == -1) {
    device_error (path, "cannot open: %m");
    return EXIT_ERROR;
  }
  return device_size (dev) == -1 ? EXIT_ERROR : EXIT_OK;
}

/* ------------------------------------------------------------------------
 * Loading and checking the superblock
 * ------------------------------------------------------------------------ */

static int
status_to_exit (enum bch_status s)
{
  switch (s) {
  case BCH_OK:            return EXIT_OK;
  case BCH_ERR_TRUNCATED: return EXIT_TRUNCATED;
  case BCH_ERR_MAGIC:     return EXIT_NOT_BCACHE;
  case BCH_ERR_BACKING:   return EXIT_BACKING;
  case BCH_ERR_CSUM:      return EXIT_CSUM;
  case BCH_ERR_VERSION:
  case BCH_ERR_FEATURES:  return EXIT_UNSUPPORTED;
  case BCH_ERR_INVALID:   return EXIT_INVALID;
  }
  return EXIT_INVALID;
}

/* Explain a decode / validate failure on stderr.  Returns the exit
 * status. */
static int
report_status (const struct device *dev)
{
  const char *path = dev->path;
  const char *msg = dev->diag.msg;

  switch (dev->diag.status) {
  case BCH_OK:
    return EXIT_OK;
  case BCH_ERR_MAGIC:
    device_error (path, "not a bcache device (no bcache magic at byte %u); "
                  "to make a cache device use 'make-bcache -C %s'",
                  BCH_SB_OFFSET, path);
    break;
  case BCH_ERR_BACKING:
    device_error (path, "this is a bcache backing device, not a cache device "
                  "(superblock version %" PRIu64 "); bcachefilter needs a "
                  "cache device made with 'make-bcache -C'",
                  dev->sb.version);
    break;
  case BCH_ERR_CSUM:
    device_error (path, "bad superblock checksum: stored %" PRIX64
                  ", computed %" PRIX64 "%s",
                  dev->sb.csum, bch_sb_csum (dev->area, sizeof dev->area),
                  " (use --force to show the fields anyway)");
    break;
  case BCH_ERR_VERSION:
    device_error (path, "%s; bcachefilter cannot use this device", msg);
    break;
  case BCH_ERR_FEATURES:
    device_error (path, "unsupported superblock: %s; bcachefilter cannot "
                  "use this device", msg);
    break;
  case BCH_ERR_TRUNCATED:
    device_error (path, "truncated: %s", msg);
    break;
  case BCH_ERR_INVALID:
  default:
    device_error (path, "invalid superblock: %s", msg);
    break;
  }
  return status_to_exit (dev->diag.status);
}

/* Record a truncation in dev->diag and report it. */
static int __attribute__ ((format (printf, 2, 3)))
truncated (struct device *dev, const char *fs, ...)
{
  va_list args;

  dev->diag.status = BCH_ERR_TRUNCATED;
  va_start (args, fs);
  vsnprintf (dev->diag.msg, sizeof dev->diag.msg, fs, args);
  va_end (args);
  device_error (dev->path, "truncated: %s", dev->diag.msg);
  return EXIT_TRUNCATED;
}

/* The device must hold nbuckets buckets.  Checked here rather than left
 * to bch_sb_validate so the message can say how big the device is and
 * how big it must be. */
static int
check_device_size (struct device *dev)
{
  const uint64_t bucket_sectors = bch_sb_bucket_sectors (&dev->sb);
  const uint64_t need = mul_sat (mul_sat (dev->sb.nbuckets, bucket_sectors),
                                 BCH_SECTOR_SIZE);

  if (dev->bytes >= need)
    return EXIT_OK;
  return truncated (dev, "the device is %" PRIu64 " bytes, but the "
                    "superblock describes %" PRIu64 " buckets of %" PRIu64
                    " bytes, so it must be at least %" PRIu64 " bytes; "
                    "restore its full size or reformat it with "
                    "'make-bcache -C'",
                    dev->bytes, dev->sb.nbuckets,
                    mul_sat (bucket_sectors, BCH_SECTOR_SIZE), need);
}

/* Read, decode and validate the superblock.  Returns the exit status and
 * prints the reason on failure.  dev->sb is meaningful when the status
 * is EXIT_OK, EXIT_TRUNCATED (after decoding) or >= EXIT_CSUM. */
static int
load_super (struct device *dev)
{
  int r;

  memset (&dev->sb, 0, sizeof dev->sb);
  if (dev->bytes < MIN_DEVICE_BYTES)
    return truncated (dev, "the device is %" PRIu64 " bytes, but a bcache "
                      "device must be at least %u bytes (its superblock is "
                      "at byte %u)",
                      dev->bytes, MIN_DEVICE_BYTES, BCH_SB_OFFSET);
  if (read_exact (dev, dev->area, sizeof dev->area, BCH_SB_OFFSET) == -1)
    return EXIT_ERROR;

  if (bch_sb_decode (dev->area, sizeof dev->area, &dev->sb, &dev->diag)
      != BCH_OK)
    return report_status (dev);

  r = check_device_size (dev);
  if (r != EXIT_OK)
    return r;

  if (bch_sb_validate (&dev->sb, dev->bytes / BCH_SECTOR_SIZE, &dev->diag)
      != BCH_OK)
    return report_status (dev);
  return EXIT_OK;
}

/* ------------------------------------------------------------------------
 * The superblock view: everything the superblock mode shows
 * ------------------------------------------------------------------------ */

struct sb_view {
  const struct device *dev;
  const struct bch_sb *sb;
  const char *status;           /* "ok" or bch_status_name */
  const char *error;            /* diag message, or NULL */

  char uuid[37], set_uuid[37];
  uint64_t csum_computed;
  const char *version_name;

  /* bcache-super-show's dev.cache.* values (sectors). */
  uint64_t bucket_sectors;
  uint64_t cache_first_sector, cache_sectors, total_sectors;

  /* Magics. */
  uint64_t set_magic, jset_magic, pset_magic, bset_magic;

  /* Layout; the per-bucket figures are 0 when the bucket size is
   * nonsense. */
  uint64_t block_bytes, bucket_bytes;
  uint64_t btree_node_bytes, prios_per_bucket, prio_buckets, uuids_per_bucket;
  unsigned njournal;            /* journal buckets, stored or planned */
  bool journal_allocated;       /* njournal_buckets != 0 */
  uint64_t journal_first, journal_last;
  uint64_t device_bytes, cache_bytes;
};

static const char *
version_name (uint64_t version)
{
  switch (version) {
  case BCACHE_SB_VERSION_CDEV:
  case BCACHE_SB_VERSION_CDEV_WITH_UUID:
  case BCACHE_SB_VERSION_CDEV_WITH_FEATURES:
    return "cache device";
  case BCACHE_SB_VERSION_BDEV:
  case BCACHE_SB_VERSION_BDEV_WITH_OFFSET:
  case BCACHE_SB_VERSION_BDEV_WITH_FEATURES:
    return "backing device";
  default:
    return "unknown";
  }
}

static const char *
replacement_name (unsigned r)
{
  switch (r) {
  case BCH_REPLACEMENT_LRU:    return "lru";
  case BCH_REPLACEMENT_FIFO:   return "fifo";
  case BCH_REPLACEMENT_RANDOM: return "random";
  default:                     return NULL;
  }
}

static void
view_layout (struct sb_view *v)
{
  const struct bch_sb *sb = v->sb;

  v->block_bytes = (uint64_t) sb->block_size * BCH_SECTOR_SIZE;
  v->bucket_bytes = mul_sat (v->bucket_sectors, BCH_SECTOR_SIZE);
  if (v->bucket_sectors > 0 && v->bucket_bytes > BCH_PSET_HEADER_SIZE &&
      v->bucket_bytes != UINT64_MAX) {
    v->btree_node_bytes = bch_btree_node_bytes (v->bucket_sectors);
    v->prios_per_bucket = bch_prios_per_bucket (v->bucket_bytes);
    v->prio_buckets = bch_prio_buckets (sb->nbuckets, v->bucket_bytes);
    v->uuids_per_bucket = bch_uuids_per_bucket (v->bucket_bytes);
  }

  /* The journal: d[] once allocated (contiguous in a valid superblock);
   * before that, what first registration will choose. */
  v->journal_allocated = sb->njournal_buckets != 0;
  if (v->journal_allocated) {
    v->njournal = sb->njournal_buckets < BCH_SB_JOURNAL_BUCKETS ?
                  sb->njournal_buckets : BCH_SB_JOURNAL_BUCKETS;
    v->journal_first = sb->d[0];
    v->journal_last = sb->d[v->njournal - 1];
  }
  else {
    v->njournal = bch_journal_buckets_for (sb->nbuckets);
    v->journal_first = sb->first_bucket;
    v->journal_last = (uint64_t) sb->first_bucket + v->njournal - 1;
  }

  v->device_bytes = v->dev->bytes;
  v->cache_bytes = mul_sat (sb->nbuckets, v->bucket_bytes);
}

static void
make_view (struct sb_view *v, const struct device *dev, int exit_status)
{
  const struct bch_sb *sb = &dev->sb;

  memset (v, 0, sizeof *v);
  v->dev = dev;
  v->sb = sb;
  v->status = exit_status == EXIT_OK ? "ok"
                                     : bch_status_name (dev->diag.status);
  v->error = exit_status == EXIT_OK ? NULL : dev->diag.msg;

  bch_uuid_unparse (sb->uuid, v->uuid);
  bch_uuid_unparse (sb->set_uuid, v->set_uuid);
  v->csum_computed = bch_sb_csum (dev->area, sizeof dev->area);
  v->version_name = version_name (sb->version);

  /* Same arithmetic as bcache-super-show (wrapping u64), with the
   * effective bucket size. */
  v->bucket_sectors = bch_sb_bucket_sectors (sb);
  v->cache_first_sector = v->bucket_sectors * sb->first_bucket;
  v->cache_sectors = v->bucket_sectors * (sb->nbuckets - sb->first_bucket);
  v->total_sectors = v->bucket_sectors * sb->nbuckets;

  v->set_magic = bch_set_magic (sb);
  v->jset_magic = bch_jset_magic (sb);
  v->pset_magic = bch_pset_magic (sb);
  v->bset_magic = bch_bset_magic (sb);

  view_layout (v);
}

/* Names of the flag bits set in sb->flags, space separated, into buf. */
static void
flags_string (const struct bch_sb *sb, char *buf, size_t len)
{
  const char *rname = replacement_name (bch_sb_replacement (sb));
  const uint64_t known = BCH_CACHE_SYNC | BCH_CACHE_DISCARD |
                         BCH_CACHE_REPLACEMENT_MASK;
  size_t n = 0;

  buf[0] = '\0';
#define APPEND(...)                                                     \
  do {                                                                  \
    if (n < len)                                                        \
      n += (size_t) snprintf (buf + n, len - n, __VA_ARGS__);           \
  } while (0)
  if (sb->flags & BCH_CACHE_SYNC)
    APPEND ("%sCACHE_SYNC", n ? " " : "");
  if (sb->flags & BCH_CACHE_DISCARD)
    APPEND ("%sCACHE_DISCARD", n ? " " : "");
  if (rname)
    APPEND ("%sCACHE_REPLACEMENT=%s", n ? " " : "", rname);
  else
    APPEND ("%sCACHE_REPLACEMENT=%u", n ? " " : "", bch_sb_replacement (sb));
  if (sb->flags & ~known)
    APPEND (" unknown=0x%" PRIx64, sb->flags & ~known);
#undef APPEND
}

/* Names of the incompat feature bits. */
static const char *
incompat_name (uint64_t bit)
{
  switch (bit) {
  case BCH_FEATURE_INCOMPAT_OBSO_LARGE_BUCKET: return "OBSO_LARGE_BUCKET";
  case BCH_FEATURE_INCOMPAT_LOG_LARGE_BUCKET:  return "LOG_LARGE_BUCKET_SIZE";
  case BCF_FEATURE_INCOMPAT_WRITE_INTENT:      return "BCF_WRITE_INTENT";
  default:                                     return NULL;
  }
}

/* Print d[] as a compact list of ascending runs: "1-4 9 12-13".  n is
 * clamped to the size of d[]. */
static void
print_bucket_list (FILE *fp, const uint64_t *d, unsigned n)
{
  unsigned i = 0;

  if (n > BCH_SB_JOURNAL_BUCKETS)
    n = BCH_SB_JOURNAL_BUCKETS;
  while (i < n) {
    unsigned j = i;

    while (j + 1 < n && d[j + 1] == d[j] + 1)
      j++;
    fprintf (fp, "%s%" PRIu64, i ? " " : "", d[i]);
    if (j > i)
      fprintf (fp, "-%" PRIu64, d[j]);
    i = j + 1;
  }
}

/* ------------------------------------------------------------------------
 * Text output
 * ------------------------------------------------------------------------ */

/* Print "name<TAB...>" padded to column 24, as bcache-super-show does,
 * then the formatted value and a newline. */
static void __attribute__ ((format (printf, 2, 3)))
field (const char *name, const char *fs, ...)
{
  size_t col = strlen (name);
  va_list args;

  fputs (name, stdout);
  do {
    putchar ('\t');
    col = (col / 8 + 1) * 8;
  } while (col < 24);
  va_start (args, fs);
  vprintf (fs, args);
  va_end (args);
  putchar ('\n');
}

/* The label as bcache-super-show prints it: alphanumerics and ".-_"
 * as they are, any other byte as %xx (lower-case hex, not padded), up to
 * the first NUL; "(empty)" if empty. */
static void
print_label_text (const uint8_t *label)
{
  size_t i;

  fputs ("dev.label\t\t", stdout);
  if (label[0] == '\0')
    fputs ("(empty)", stdout);
  for (i = 0; i < BCH_SB_LABEL_SIZE && label[i] != '\0'; i++) {
    const unsigned c = label[i];

    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
        (c >= 'A' && c <= 'Z') || strchr (".-_", (int) c))
      putchar ((int) c);
    else
      printf ("%%%x", c);
  }
  putchar ('\n');
}

/* The part identical to bcache-super-show's output. */
static void
text_bcache_super_show (const struct sb_view *v)
{
  const struct bch_sb *sb = v->sb;
  const unsigned repl = bch_sb_replacement (sb);
  const char *rname = replacement_name (repl);

  field ("sb.magic", "ok");
  field ("sb.first_sector", "%" PRIu64 " [%s]", sb->offset,
         sb->offset == BCH_SB_SECTOR ? "match" : "expected 8");
  if (sb->csum == v->csum_computed)
    field ("sb.csum", "%" PRIX64 " [match]", sb->csum);
  else
    field ("sb.csum", "%" PRIX64 " [expected %" PRIX64 "]",
           sb->csum, v->csum_computed);
  field ("sb.version", "%" PRIu64 " [%s]", sb->version, v->version_name);
  putchar ('\n');

  print_label_text (sb->label);
  field ("dev.uuid", "%s", v->uuid);
  field ("dev.sectors_per_block", "%u", sb->block_size);
  field ("dev.sectors_per_bucket", "%" PRIu64, v->bucket_sectors);
  field ("dev.cache.first_sector", "%" PRIu64, v->cache_first_sector);
  field ("dev.cache.cache_sectors", "%" PRIu64, v->cache_sectors);
  field ("dev.cache.total_sectors", "%" PRIu64, v->total_sectors);
  field ("dev.cache.ordered", "%s", sb->flags & BCH_CACHE_SYNC ? "yes" : "no");
  field ("dev.cache.discard", "%s",
         sb->flags & BCH_CACHE_DISCARD ? "yes" : "no");
  field ("dev.cache.pos", "%u", sb->nr_this_dev);
  if (rname)
    field ("dev.cache.replacement", "%u [%s]", repl, rname);
  else
    field ("dev.cache.replacement", "%u", repl);
  putchar ('\n');

  field ("cset.uuid", "%s", v->set_uuid);
}

/* Names of the feature bits set in bits, space separated, into buf
 * (empty if none): the known incompat bits by name, any other bit as
 * unknown=0x... */
static void
features_string (uint64_t bits, bool incompat, char *buf, size_t len)
{
  size_t n = 0;
  uint64_t bit;

  buf[0] = '\0';
  for (bit = 1; bit != 0 && n < len; bit <<= 1) {
    const char *s = incompat ? incompat_name (bit) : NULL;

    if (!(bits & bit))
      continue;
    if (s)
      n += (size_t) snprintf (buf + n, len - n, "%s%s", n ? " " : "", s);
    else
      n += (size_t) snprintf (buf + n, len - n, "%sunknown=0x%" PRIx64,
                              n ? " " : "", bit);
  }
}

/* Room for all 64 bits as " unknown=0x8000000000000000". */
#define FEATURES_STRING_SIZE 2048

/* "0x3 [OBSO_LARGE_BUCKET LOG_LARGE_BUCKET_SIZE]" or "0x0 [none]". */
static void
text_features (const char *name, uint64_t bits, bool incompat)
{
  char names[FEATURES_STRING_SIZE];

  features_string (bits, incompat, names, sizeof names);
  field (name, "0x%" PRIx64 " [%s]", bits, names[0] ? names : "none");
}

static void
text_super_extra (const struct sb_view *v)
{
  const struct bch_sb *sb = v->sb;
  char flags[128];
  char date[32] = "never";

  flags_string (sb, flags, sizeof flags);
  if (sb->last_mount) {
    const time_t t = sb->last_mount;
    struct tm tm;

    if (gmtime_r (&t, &tm))
      strftime (date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &tm);
  }

  field ("sb.seq", "%" PRIu64, sb->seq);
  field ("sb.flags", "0x%" PRIx64 " [%s]", sb->flags, flags);
  text_features ("sb.feature_compat", sb->feature_compat, false);
  text_features ("sb.feature_incompat", sb->feature_incompat, true);
  text_features ("sb.feature_ro_compat", sb->feature_ro_compat, false);
  field ("sb.last_mount", "%" PRIu32 " [%s]", sb->last_mount, date);
  field ("sb.nr_in_set", "%u", sb->nr_in_set);
  field ("sb.nr_this_dev", "%u", sb->nr_this_dev);
  field ("sb.nbuckets", "%" PRIu64, sb->nbuckets);
  field ("sb.first_bucket", "%u", sb->first_bucket);
  field ("sb.bucket_size", "%u", sb->bucket_size);
  field ("sb.njournal_buckets", "%u", sb->njournal_buckets);
  fputs ("sb.d\t\t\t", stdout);
  if (sb->njournal_buckets == 0)
    fputs ("(none)", stdout);
  print_bucket_list (stdout, sb->d, sb->njournal_buckets);
  putchar ('\n');
}

static void
text_magics (const struct sb_view *v)
{
  field ("cset.set_magic", "0x%016" PRIx64, v->set_magic);
  field ("cset.jset_magic", "0x%016" PRIx64, v->jset_magic);
  field ("cset.pset_magic", "0x%016" PRIx64, v->pset_magic);
  field ("cset.bset_magic", "0x%016" PRIx64, v->bset_magic);
}

static void
text_layout (const struct sb_view *v)
{
  field ("layout.block_bytes", "%" PRIu64, v->block_bytes);
  field ("layout.bucket_bytes", "%" PRIu64, v->bucket_bytes);
  field ("layout.nbuckets", "%" PRIu64, v->sb->nbuckets);
  field ("layout.first_bucket", "%u", v->sb->first_bucket);
  field ("layout.btree_node_bytes", "%" PRIu64, v->btree_node_bytes);
  field ("layout.prios_per_bucket", "%" PRIu64, v->prios_per_bucket);
  field ("layout.prio_buckets", "%" PRIu64, v->prio_buckets);
  field ("layout.uuids_per_bucket", "%" PRIu64, v->uuids_per_bucket);
  field ("layout.journal_buckets", "%" PRIu64 "-%" PRIu64 " [%u buckets, %s]",
         v->journal_first, v->journal_last, v->njournal,
         v->journal_allocated ? "allocated"
                              : "allocated at first registration");
  field ("layout.device_bytes", "%" PRIu64, v->device_bytes);
  if (v->device_bytes >= v->cache_bytes)
    field ("layout.cache_bytes", "%" PRIu64 " [fits, %" PRIu64 " bytes unused]",
           v->cache_bytes, v->device_bytes - v->cache_bytes);
  else
    field ("layout.cache_bytes", "%" PRIu64 " [device too small by %" PRIu64
           " bytes]", v->cache_bytes, v->cache_bytes - v->device_bytes);
}

static void
show_super_text (const struct sb_view *v)
{
  text_bcache_super_show (v);
  putchar ('\n');
  text_super_extra (v);
  putchar ('\n');
  text_magics (v);
  putchar ('\n');
  text_layout (v);
}

/* ------------------------------------------------------------------------
 * JSON output
 *
 * Values are made and written by json-c; this writer only streams the
 * document's outer levels, so that a large cache's btree or journal is
 * never held in memory whole.  The root object and the arrays that are
 * its members ("nodes", "entries", "problems", ...) are streamed: "{",
 * "[", the separators and the indentation are written as members and
 * elements come, one per line.  Anything below them (an element, an
 * object member) is built as a json-c object and written, with
 * json_object_to_json_string_ext, once it is complete.
 * ------------------------------------------------------------------------ */

#define JSON_MAX_DEPTH 16
#define JSON_FLAGS (JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE)

struct json {
  FILE *fp;
  unsigned depth;                       /* containers open */
  /* Per open container: streamed (node NULL: written as it comes, with
   * need_comma) or built (node, to be written or added under key). */
  json_object *node[JSON_MAX_DEPTH];
  const char *key[JSON_MAX_DEPTH];
  bool need_comma[JSON_MAX_DEPTH];
};

/* A string as JSON: bytes as they are, except that, since a label is
 * bytes and not necessarily UTF-8, every non-ASCII byte is taken as
 * Latin-1 (json-c then writes valid UTF-8; control characters it
 * escapes itself). */
static json_object *
jw_latin1 (const char *s, size_t len)
{
  size_t n = 0;
  json_object *o;
  char *u;

  for (size_t i = 0; i < len; i++)
    n += (unsigned char) s[i] >= 0x80 ? 2 : 1;
  u = malloc (n + 1);
  if (u == NULL)
    return json_object_new_string_len (s, (int) len);
  n = 0;
  for (size_t i = 0; i < len; i++) {
    const unsigned char c = (unsigned char) s[i];

    if (c >= 0x80) {
      u[n++] = (char) (0xc0 | c >> 6);
      u[n++] = (char) (0x80 | (c & 0x3f));
    }
    else
      u[n++] = (char) c;
  }
  o = json_object_new_string_len (u, (int) n);
  free (u);
  return o;
}

/* Start a member of the streamed container at the current depth:
 * separator, indentation and "key": (if any). */
static void
jw_member (struct json *j, const char *key)
{
  if (j->need_comma[j->depth])
    fputc (',', j->fp);
  j->need_comma[j->depth] = true;
  fprintf (j->fp, "\n%*s", (int) (2 * j->depth), "");
  if (key) {
    json_object *k = jw_latin1 (key, strlen (key));

    fprintf (j->fp, "%s: ", json_object_to_json_string_ext (k, JSON_FLAGS));
    json_object_put (k);
  }
}

/* A whole member of a streamed container: v (consumed; NULL: null). */
static void
jw_emit (struct json *j, const char *key, json_object *v)
{
  jw_member (j, key);
  fputs (v ? json_object_to_json_string_ext (v, JSON_FLAGS) : "null",
         j->fp);
  json_object_put (v);
}

/* Add v (consumed; NULL: null) under key to the innermost container. */
static void
jw_add (struct json *j, const char *key, json_object *v)
{
  json_object *parent = j->depth ? j->node[j->depth - 1] : NULL;

  if (parent == NULL) {
    jw_emit (j, key, v);
    return;
  }
  if (json_object_is_type (parent, json_type_array))
    json_object_array_add (parent, v);
  else
    json_object_object_add (parent, key, v);
}

static void
jw_open (struct json *j, const char *key, char bracket)
{
  const bool streamed = j->depth == 0 ||
    (j->depth == 1 && j->node[0] == NULL && bracket == '[');

  if (j->depth + 1 >= JSON_MAX_DEPTH)
    abort ();                   /* the callers nest at most 7 deep */
  if (streamed) {
    if (j->depth > 0)
      jw_member (j, key);
    fputc (bracket, j->fp);
    j->node[j->depth] = NULL;
  }
  else
    j->node[j->depth] = bracket == '[' ? json_object_new_array ()
                                       : json_object_new_object ();
  j->key[j->depth] = key;
  j->depth++;
  j->need_comma[j->depth] = false;
}

static void
jw_close (struct json *j, char bracket)
{
  json_object *node;

  j->depth--;
  node = j->node[j->depth];
  if (node == NULL) {           /* streamed */
    if (j->need_comma[j->depth + 1])
      fprintf (j->fp, "\n%*s", (int) (2 * j->depth), "");
    fputc (bracket, j->fp);
    return;
  }
  j->node[j->depth] = NULL;
  jw_add (j, j->key[j->depth], node);
}

static void
jw_u64 (struct json *j, const char *key, uint64_t n)
{
  jw_add (j, key, json_object_new_uint64 (n));
}

static void
jw_bool (struct json *j, const char *key, bool b)
{
  jw_add (j, key, json_object_new_boolean (b));
}

static void
jw_null (struct json *j, const char *key)
{
  jw_add (j, key, NULL);
}

static void
jw_strn (struct json *j, const char *key, const char *s, size_t len)
{
  jw_add (j, key, jw_latin1 (s, len));
}

static void
jw_str (struct json *j, const char *key, const char *s)
{
  if (s)
    jw_strn (j, key, s, strlen (s));
  else
    jw_null (j, key);
}

/* A space-separated list of words as a JSON array of strings. */
static void
jw_words (struct json *j, const char *key, const char *words)
{
  jw_open (j, key, '[');
  while (*words) {
    const size_t len = strcspn (words, " ");

    if (len > 0)
      jw_strn (j, NULL, words, len);
    words += len;
    words += strspn (words, " ");
  }
  jw_close (j, ']');
}

/* 64-bit checksums and magics: "0x%016x" strings (JSON numbers lose
 * precision above 2^53 in most parsers). */
static void
jw_hex64 (struct json *j, const char *key, uint64_t n)
{
  char buf[24];

  snprintf (buf, sizeof buf, "0x%016" PRIx64, n);
  jw_str (j, key, buf);
}

static void
json_sb (struct json *j, const struct sb_view *v)
{
  const struct bch_sb *sb = v->sb;
  char flags[128];
  char features[FEATURES_STRING_SIZE];

  flags_string (sb, flags, sizeof flags);
  jw_open (j, "sb", '{');
  jw_str (j, "magic", "ok");
  jw_u64 (j, "first_sector", sb->offset);
  jw_hex64 (j, "csum", sb->csum);
  jw_hex64 (j, "csum_expected", v->csum_computed);
  jw_bool (j, "csum_ok", sb->csum == v->csum_computed);
  jw_u64 (j, "version", sb->version);
  jw_str (j, "version_name", v->version_name);
  jw_u64 (j, "seq", sb->seq);
  jw_u64 (j, "flags", sb->flags);
  jw_words (j, "flags_decoded", flags);
  jw_u64 (j, "feature_compat", sb->feature_compat);
  features_string (sb->feature_compat, false, features, sizeof features);
  jw_words (j, "feature_compat_decoded", features);
  jw_u64 (j, "feature_incompat", sb->feature_incompat);
  features_string (sb->feature_incompat, true, features, sizeof features);
  jw_words (j, "feature_incompat_decoded", features);
  jw_u64 (j, "feature_ro_compat", sb->feature_ro_compat);
  features_string (sb->feature_ro_compat, false, features, sizeof features);
  jw_words (j, "feature_ro_compat_decoded", features);
  jw_u64 (j, "last_mount", sb->last_mount);
  jw_u64 (j, "nr_in_set", sb->nr_in_set);
  jw_u64 (j, "nr_this_dev", sb->nr_this_dev);
  jw_u64 (j, "nbuckets", sb->nbuckets);
  jw_u64 (j, "first_bucket", sb->first_bucket);
  jw_u64 (j, "block_size", sb->block_size);
  jw_u64 (j, "bucket_size", sb->bucket_size);
  jw_u64 (j, "njournal_buckets", sb->njournal_buckets);
  jw_open (j, "d", '[');
  for (unsigned i = 0;
       i < sb->njournal_buckets && i < BCH_SB_JOURNAL_BUCKETS; i++)
    jw_u64 (j, NULL, sb->d[i]);
  jw_close (j, ']');
  jw_close (j, '}');
}

static void
json_dev (struct json *j, const struct sb_view *v)
{
  const struct bch_sb *sb = v->sb;
  size_t label_len = strnlen ((const char *) sb->label, BCH_SB_LABEL_SIZE);
  const char *rname = replacement_name (bch_sb_replacement (sb));

  jw_open (j, "dev", '{');
  jw_strn (j, "label", (const char *) sb->label, label_len);
  jw_str (j, "uuid", v->uuid);
  jw_u64 (j, "sectors_per_block", sb->block_size);
  jw_u64 (j, "sectors_per_bucket", v->bucket_sectors);
  jw_open (j, "cache", '{');
  jw_u64 (j, "first_sector", v->cache_first_sector);
  jw_u64 (j, "cache_sectors", v->cache_sectors);
  jw_u64 (j, "total_sectors", v->total_sectors);
  jw_bool (j, "ordered", sb->flags & BCH_CACHE_SYNC);
  jw_bool (j, "discard", sb->flags & BCH_CACHE_DISCARD);
  jw_u64 (j, "pos", sb->nr_this_dev);
  jw_u64 (j, "replacement", bch_sb_replacement (sb));
  jw_str (j, "replacement_name", rname);
  jw_close (j, '}');
  jw_close (j, '}');
}

static void
json_cset (struct json *j, const struct sb_view *v)
{
  jw_open (j, "cset", '{');
  jw_str (j, "uuid", v->set_uuid);
  jw_hex64 (j, "set_magic", v->set_magic);
  jw_hex64 (j, "jset_magic", v->jset_magic);
  jw_hex64 (j, "pset_magic", v->pset_magic);
  jw_hex64 (j, "bset_magic", v->bset_magic);
  jw_close (j, '}');
}

static void
json_layout (struct json *j, const struct sb_view *v)
{
  jw_open (j, "layout", '{');
  jw_u64 (j, "block_bytes", v->block_bytes);
  jw_u64 (j, "bucket_bytes", v->bucket_bytes);
  jw_u64 (j, "nbuckets", v->sb->nbuckets);
  jw_u64 (j, "first_bucket", v->sb->first_bucket);
  jw_u64 (j, "btree_node_bytes", v->btree_node_bytes);
  jw_u64 (j, "prios_per_bucket", v->prios_per_bucket);
  jw_u64 (j, "prio_buckets", v->prio_buckets);
  jw_u64 (j, "uuids_per_bucket", v->uuids_per_bucket);
  jw_u64 (j, "journal_first_bucket", v->journal_first);
  jw_u64 (j, "journal_last_bucket", v->journal_last);
  jw_u64 (j, "journal_nbuckets", v->njournal);
  jw_bool (j, "journal_allocated", v->journal_allocated);
  jw_u64 (j, "device_bytes", v->device_bytes);
  jw_u64 (j, "cache_bytes", v->cache_bytes);
  jw_bool (j, "fits", v->device_bytes >= v->cache_bytes);
  jw_close (j, '}');
}

static void
show_super_json (const struct sb_view *v)
{
  struct json j = { .fp = stdout };

  jw_open (&j, NULL, '{');
  jw_str (&j, "device", v->dev->path);
  jw_str (&j, "status", v->status);
  jw_str (&j, "error", v->error);
  json_sb (&j, v);
  json_dev (&j, v);
  json_cset (&j, v);
  json_layout (&j, v);
  jw_close (&j, '}');
  putchar ('\n');
}

/* ------------------------------------------------------------------------
 * Helpers shared by the journal and engine modes
 * ------------------------------------------------------------------------ */

struct options {
  bool json;
  bool force;
  bool verbose;
  const char *path;
  const char *uri;              /* --verify: the export */
  const char *mode_option;      /* "--journal" ..., NULL: superblock */
  /* The mode: shows something about a device whose superblock was
   * loaded with status load_status (EXIT_OK, or >= EXIT_CSUM with
   * --force).  Returns the exit status. */
  int (*mode) (const struct options *, const struct device *,
               int load_status);
};

static int
finish_output (void)
{
  if (fflush (stdout) == EOF || ferror (stdout)) {
    fprintf (stderr, "%s: error writing output: %m\n", PROGRAM_NAME);
    return EXIT_ERROR;
  }
  return EXIT_OK;
}

/* The first of two statuses that is an error. */
static int
worst (int output_status, int status)
{
  return status != EXIT_OK ? status : output_status;
}

/* A device made by make-bcache -C that was never registered has no
 * journal, btree or prios to show. */
static int
not_initialised (const struct device *dev)
{
  device_error (dev->path, "made by make-bcache -C but never registered "
                "(CACHE_SYNC is clear): it has no journal, btree or prios "
                "yet; bcachefilter-format or the bcachefilter filter "
                "initialises it");
  return EXIT_NOT_INIT;
}

/* "inode:offset", or "max" for the greatest key. */
static void
pos_string (uint64_t inode, uint64_t offset, char *buf, size_t len)
{
  if (inode == BKEY_MAX_INODE && offset == BKEY_MAX_OFFSET)
    snprintf (buf, len, "max");
  else
    snprintf (buf, len, "%" PRIu64 ":%" PRIu64, inode, offset);
}

/* Is the key's (first) pointer a data pointer whose bucket has moved on
 * to a newer gen?  Needs the engine's bucket array. */
static bool
key_stale (struct bcf_cache *c, const struct bkey *k)
{
  return c && KEY_PTRS (k) >= 1 && bch_ptr_is_data (k->ptr[0]) &&
         PTR_DEV (k->ptr[0]) == 0 && bcf_cache_ptr_stale (c, k->ptr[0]);
}

/* A key as text.  Leaves: "inode:start+size -> dev:offset gen G" and the
 * words dirty, check, stale; interior nodes: "child inode:offset ->
 * dev:offset gen G (bucket B)". */
static void
text_key (const struct bkey *k, unsigned level, struct bcf_cache *c,
          uint64_t bucket_sectors)
{
  char pos[48];

  if (level == 0)
    printf ("%" PRIu64 ":%" PRIu64 "+%" PRIu64, KEY_INODE (k), KEY_START (k),
            KEY_SIZE (k));
  else {
    pos_string (KEY_INODE (k), KEY_OFFSET (k), pos, sizeof pos);
    printf ("child %s", pos);
  }
  fputs (" ->", stdout);
  if (KEY_PTRS (k) == 0)
    fputs (" none", stdout);
  for (unsigned i = 0; i < KEY_PTRS (k); i++) {
    const uint64_t p = k->ptr[i];

    printf ("%s %" PRIu64 ":%" PRIu64 " gen %u", i ? "," : "", PTR_DEV (p),
            PTR_OFFSET (p), PTR_GEN (p));
    if (level > 0 && bucket_sectors)
      printf (" (bucket %" PRIu64 ")", PTR_OFFSET (p) / bucket_sectors);
  }
  if (KEY_DIRTY (k))
    fputs (" dirty", stdout);
  if (bkey_is_check (k))
    fputs (" check", stdout);
  if (key_stale (c, k))
    fputs (" stale", stdout);
  putchar ('\n');
}

static void
json_ptr (struct json *j, const char *key, uint64_t p, uint64_t bucket_sectors)
{
  jw_open (j, key, '{');
  jw_u64 (j, "dev", PTR_DEV (p));
  jw_u64 (j, "offset", PTR_OFFSET (p));
  jw_u64 (j, "gen", PTR_GEN (p));
  if (bucket_sectors)
    jw_u64 (j, "bucket", PTR_OFFSET (p) / bucket_sectors);
  jw_close (j, '}');
}

static void
json_bkey (struct json *j, const struct bkey *k, unsigned level,
           struct bcf_cache *c, uint64_t bucket_sectors)
{
  jw_open (j, NULL, '{');
  jw_u64 (j, "inode", KEY_INODE (k));
  jw_u64 (j, "offset", KEY_OFFSET (k));
  jw_u64 (j, "size", KEY_SIZE (k));
  if (level == 0)
    jw_u64 (j, "start", KEY_START (k));
  jw_bool (j, "dirty", KEY_DIRTY (k));
  jw_bool (j, "check", bkey_is_check (k));
  if (c)
    jw_bool (j, "stale", key_stale (c, k));
  jw_open (j, "ptrs", '[');
  for (unsigned i = 0; i < KEY_PTRS (k); i++)
    json_ptr (j, NULL, k->ptr[i], bucket_sectors);
  jw_close (j, ']');
  jw_close (j, '}');
}

/* ------------------------------------------------------------------------
 * --journal: the journal buckets, as the engine's open reads and judges
 * them (bcf_journal_inspect)
 * ------------------------------------------------------------------------ */

/* "bucket B gen G" for a jset's pointer key ("none" without pointer). */
static void
text_jptr (const struct bkey *k, uint64_t bucket_sectors)
{
  if (KEY_PTRS (k) == 0) {
    fputs ("none", stdout);
    return;
  }
  if (PTR_DEV (k->ptr[0]) != 0)
    printf ("dev %" PRIu64 " ", PTR_DEV (k->ptr[0]));
  printf ("bucket %" PRIu64 " gen %u", PTR_OFFSET (k->ptr[0]) / bucket_sectors,
          PTR_GEN (k->ptr[0]));
}

/* The keys of a journal entry, one per line ("    key ..."). */
static void
text_jentry_keys (const struct bcf_journal_entry *e, uint64_t bucket_sectors)
{
  const uint8_t *p = (const uint8_t *) e->words;
  size_t w = 0;

  while (w < e->hdr.keys) {
    struct bkey_padded b;

    if (bkey_decode (p + 8 * w, (e->hdr.keys - w) * 8, &b, NULL) != BCH_OK)
      break;
    fputs ("    key ", stdout);
    text_key (&b.key, 0, NULL, bucket_sectors);
    w += bkey_u64s (&b.key);
  }
}

/* The engine's judgement of a bad block (bcachefilter/inspect.h). */
static const char *
bad_word (enum bcf_journal_bad why)
{
  switch (why) {
  case BCF_JOURNAL_BAD_TORN:    return "torn tail";
  case BCF_JOURNAL_BAD_STALE:   return "stale";
  case BCF_JOURNAL_BAD_CORRUPT: return "corrupt";
  }
  return "?";
}

static void
text_jentry (const struct bcf_journal_scan *s,
             const struct bcf_journal_entry *e, uint64_t bucket_sectors,
             bool verbose)
{
  printf ("bucket %" PRIu64 " offset %zu: ", e->bucket, e->offset);
  if (e->bad) {
    printf ("ignored: %s (claims seq %" PRIu64 ": %s)\n", e->msg,
            e->claimed_seq, bad_word (e->why));
    return;
  }
  printf ("seq %" PRIu64 ", last_seq %" PRIu64 ", %u keys (%u words), root ",
          e->hdr.seq, e->hdr.last_seq, e->nkeys, e->hdr.keys);
  text_jptr (&e->hdr.btree_root.key, bucket_sectors);
  printf (" level %u, uuid ", e->hdr.btree_level);
  text_jptr (&e->hdr.uuid_bucket.key, bucket_sectors);
  printf (", prio bucket %" PRIu64, e->hdr.prio_bucket[0]);
  if (e == s->newest)
    fputs (" [newest]", stdout);
  else if (s->newest && !bcf_journal_needed (s, e))
    fputs (" [old]", stdout);
  if (e->msg[0])
    printf (" [%s]", e->msg);
  putchar ('\n');
  if (verbose)
    text_jentry_keys (e, bucket_sectors);
}

static void
json_jentry (struct json *j, const struct bcf_journal_scan *s,
             const struct bcf_journal_entry *e, uint64_t bucket_sectors,
             bool verbose)
{
  jw_open (j, NULL, '{');
  jw_u64 (j, "bucket", e->bucket);
  jw_u64 (j, "index", e->index);
  jw_u64 (j, "offset", e->offset);
  if (e->bad) {
    jw_str (j, "error", e->msg);
    jw_u64 (j, "claimed_seq", e->claimed_seq);
    jw_str (j, "judged", bad_word (e->why));
    jw_close (j, '}');
    return;
  }
  jw_u64 (j, "bytes", e->bytes);
  jw_u64 (j, "seq", e->hdr.seq);
  jw_u64 (j, "last_seq", e->hdr.last_seq);
  jw_u64 (j, "keys", e->nkeys);
  jw_u64 (j, "key_words", e->hdr.keys);
  if (KEY_PTRS (&e->hdr.btree_root.key))
    json_ptr (j, "btree_root", e->hdr.btree_root.key.ptr[0], bucket_sectors);
  else
    jw_null (j, "btree_root");
  jw_u64 (j, "btree_level", e->hdr.btree_level);
  if (KEY_PTRS (&e->hdr.uuid_bucket.key))
    json_ptr (j, "uuid_bucket", e->hdr.uuid_bucket.key.ptr[0],
              bucket_sectors);
  else
    jw_null (j, "uuid_bucket");
  jw_u64 (j, "prio_bucket", e->hdr.prio_bucket[0]);
  jw_bool (j, "newest", e == s->newest);
  jw_bool (j, "needed", bcf_journal_needed (s, e));
  jw_str (j, "key_error", e->msg[0] ? e->msg : NULL);
  if (verbose) {
    const uint8_t *p = (const uint8_t *) e->words;
    size_t w = 0;

    jw_open (j, "key_list", '[');
    while (w < e->hdr.keys) {
      struct bkey_padded b;

      if (bkey_decode (p + 8 * w, (e->hdr.keys - w) * 8, &b, NULL) != BCH_OK)
        break;
      json_bkey (j, &b.key, 0, NULL, bucket_sectors);
      w += bkey_u64s (&b.key);
    }
    jw_close (j, ']');
  }
  jw_close (j, '}');
}

static void
json_journal (const struct device *dev, const struct bcf_journal_scan *s,
              bool verbose)
{
  const struct bch_sb *sb = &dev->sb;
  const uint64_t bucket_sectors = bch_sb_bucket_sectors (sb);
  struct json j = { .fp = stdout };

  jw_open (&j, NULL, '{');
  jw_str (&j, "device", dev->path);
  jw_u64 (&j, "bucket_bytes", bucket_sectors * BCH_SECTOR_SIZE);
  jw_u64 (&j, "block_bytes", (uint64_t) sb->block_size * BCH_SECTOR_SIZE);
  jw_hex64 (&j, "jset_magic", bch_jset_magic (sb));
  jw_open (&j, "journal_buckets", '[');
  for (unsigned i = 0; i < sb->njournal_buckets; i++)
    jw_u64 (&j, NULL, sb->d[i]);
  jw_close (&j, ']');
  jw_open (&j, "entries", '[');
  for (size_t i = 0; i < s->n; i++)
    if (!s->entries[i].bad)
      json_jentry (&j, s, &s->entries[i], bucket_sectors, verbose);
  jw_close (&j, ']');
  jw_open (&j, "ignored", '[');
  for (size_t i = 0; i < s->n; i++)
    if (s->entries[i].bad)
      json_jentry (&j, s, &s->entries[i], bucket_sectors, false);
  jw_close (&j, ']');
  if (s->newest) {
    jw_u64 (&j, "newest_seq", s->newest->hdr.seq);
    jw_u64 (&j, "last_seq", s->newest->hdr.last_seq);
  }
  jw_open (&j, "missing", '[');
  for (size_t i = 0; i < s->ngaps && i < BCF_JOURNAL_LISTED; i++) {
    jw_open (&j, NULL, '{');
    jw_u64 (&j, "from", s->gaps[i].from);
    jw_u64 (&j, "to", s->gaps[i].to);
    jw_close (&j, '}');
  }
  jw_close (&j, ']');
  jw_str (&j, "status", s->status == BCF_JOURNAL_OK ? "ok" : "corrupt");
  jw_str (&j, "error", s->status == BCF_JOURNAL_OK ? NULL : s->msg);
  jw_close (&j, '}');
  putchar ('\n');
}

/* What replay would find, in a word. */
static const char *
replay_word (enum bcf_journal_status st)
{
  switch (st) {
  case BCF_JOURNAL_GAP:       return "some are MISSING";
  case BCF_JOURNAL_DUPLICATE: return "some are DUPLICATED";
  case BCF_JOURNAL_BAD_KEY:   return "one has a BAD KEY";
  default:                    return "all present";
  }
}

static void
text_journal (const struct device *dev, const struct bcf_journal_scan *s,
              bool verbose)
{
  const struct bch_sb *sb = &dev->sb;
  const uint64_t bucket_sectors = bch_sb_bucket_sectors (sb);
  const unsigned nj = sb->njournal_buckets;
  const struct bcf_journal_entry *nw = s->newest;

  printf ("journal of %s: %u buckets (%" PRIu64 "-%" PRIu64 ") of %" PRIu64
          " bytes, %u-byte blocks, jset magic 0x%016" PRIx64 "\n",
          dev->path, nj, sb->d[0], sb->d[nj - 1],
          bucket_sectors * BCH_SECTOR_SIZE,
          (unsigned) sb->block_size * BCH_SECTOR_SIZE, bch_jset_magic (sb));
  for (size_t i = 0; i < s->n; i++)
    text_jentry (s, &s->entries[i], bucket_sectors, verbose);
  if (!nw) {
    printf ("no valid entry\n");
    return;
  }
  printf ("newest entry: seq %" PRIu64 " (bucket %" PRIu64 " offset %zu), "
          "last_seq %" PRIu64 "\n", nw->hdr.seq, nw->bucket, nw->offset,
          nw->hdr.last_seq);
  printf ("replay needs entries %" PRIu64 "-%" PRIu64 ": %s\n",
          nw->hdr.last_seq, nw->hdr.seq, replay_word (s->status));
  if (s->skipped[0])
    printf ("skipped: %s\n", s->skipped);
}

static int
mode_journal (const struct options *opts, const struct device *dev,
              int load_status)
{
  const struct bch_sb *sb = &dev->sb;
  struct bcf_journal_scan s;
  char err[1024];
  int status;

  (void) load_status;
  if (!(sb->flags & BCH_CACHE_SYNC))
    return not_initialised (dev);
  if (sb->njournal_buckets == 0) {
    device_error (dev->path, "CACHE_SYNC is set but the superblock lists "
                  "no journal buckets: the cache is corrupt");
    return EXIT_INVALID;
  }
  if (bcf_journal_inspect (dev->path, sb, &s, err, sizeof err) < 0) {
    device_error (dev->path, "%s", err);
    bcf_journal_scan_free (&s);
    return EXIT_ERROR;
  }
  if (opts->json)
    json_journal (dev, &s, opts->verbose);
  else
    text_journal (dev, &s, opts->verbose);
  status = finish_output ();
  if (s.status != BCF_JOURNAL_OK) {
    device_error (dev->path, "%s", s.msg);
    status = worst (status, EXIT_INVALID);
  }
  bcf_journal_scan_free (&s);
  return status;
}

/* ------------------------------------------------------------------------
 * Opening the cache through the engine (read-only)
 * ------------------------------------------------------------------------ */

struct log_ctx {
  const char *path;
  bool verbose;
  struct progress *progress;    /* the open's, or NULL */
};

static void
engine_log (void *opaque, enum bcf_log_level level, const char *msg)
{
  const struct log_ctx *l = opaque;

  if (level < BCF_LOG_WARN && !l->verbose)
    return;
  if (l->progress)
    progress_end (l->progress);
  if (strstr (msg, l->path))
    fprintf (stderr, "%s: %s\n", PROGRAM_NAME, msg);
  else
    fprintf (stderr, "%s: %s: %s\n", PROGRAM_NAME, l->path, msg);
}

/* The exit status for an error of a read-only bcf_cache_open. */
static int
open_error_to_exit (int r)
{
  switch (-r) {
  case EMEDIUMTYPE: return EXIT_NOT_BCACHE;
  case EUCLEAN:     return EXIT_INVALID;
  case ENOSPC:      return EXIT_TRUNCATED;
  case ENOTSUP:
  case EFBIG:       return EXIT_UNSUPPORTED;
  default:          return EXIT_ERROR;
  }
}

/* opts.progress of the open: each of its steps on the progress line. */
static void
open_progress (void *opaque, enum bcf_open_step step, uint64_t done,
               uint64_t total)
{
  static const char *const what[] = {
    [BCF_OPEN_JOURNAL] = "reading the journal",
    [BCF_OPEN_BTREE]   = "reading the btree",
    [BCF_OPEN_REPLAY]  = "replaying the journal",
  };
  struct progress *p = opaque;
  const char *label = step < sizeof what / sizeof what[0] && what[step]
                      ? what[step] : "opening the cache";

  if (p->label != label)
    progress_step (p, label, total);
  progress_update (p, done);
}

/* Open the cache read-only: reads and checks the journal, prios, uuids
 * and every btree node, replays the journal in memory and runs the
 * initial mark.  NULL with *status set (and a message) on failure.
 * With progress (started by the caller; NULL: none) the open's steps
 * are shown on it, and engine messages erase it first. */
static struct bcf_cache *
engine_open_backing (const struct options *opts, const struct device *dev,
                     const struct bcf_backing *backing,
                     struct progress *progress, int *status)
{
  static struct log_ctx lc;
  struct bcf_cache_opts o = { 0 };
  struct bcf_cache *c;
  char err[1024] = "";
  int r;

  if (!(dev->sb.flags & BCH_CACHE_SYNC)) {
    *status = not_initialised (dev);
    return NULL;
  }
  lc.path = dev->path;
  lc.verbose = opts->verbose;
  lc.progress = progress;
  o.path = dev->path;
  o.readonly = true;
  o.log = engine_log;
  o.log_opaque = &lc;
  if (backing)
    o.backing = *backing;
  if (progress) {
    o.progress = open_progress;
    o.progress_opaque = progress;
  }
  r = bcf_cache_open (&o, &c, err, sizeof err);
  if (r < 0) {
    if (progress)
      progress_end (progress);
    *status = open_error_to_exit (r);
    if (err[0] == '\0')
      snprintf (err, sizeof err, "%s", strerror (-r));
    device_error (dev->path, "%s%s", r == -EUCLEAN ? "corrupt: " :
                  "cannot open the cache: ", err);
    return NULL;
  }
  *status = EXIT_OK;
  return c;
}

/* The same without a backing store (the engine then knows no export
 * size, and nothing can be looked up by offset). */
static struct bcf_cache *
engine_open (const struct options *opts, const struct device *dev,
             int *status)
{
  return engine_open_backing (opts, dev, NULL, NULL, status);
}

/* ------------------------------------------------------------------------
 * --btree
 * ------------------------------------------------------------------------ */

#define MAX_LEVELS 32

struct btree_ctx {
  const struct options *opts;
  struct json *j;
  uint64_t bucket_sectors;
  struct { uint64_t inode, offset; } prev[MAX_LEVELS]; /* last node seen
                                                           at each level */
  bool have_prev[MAX_LEVELS];
  uint64_t nodes, keys, dirty_sectors, check_keys;
};

/* A leaf's live dirty sectors and check keys. */
static uint64_t
leaf_dirty (struct bcf_cache *c, const struct bcf_node *n, uint64_t *checks)
{
  uint64_t dirty = 0;

  for (size_t i = 0; i < n->nkeys; i++) {
    const struct bkey *k = bcf_node_key (n, i);
    if (bkey_is_check (k))
      (*checks)++;
    else if (KEY_DIRTY (k) && KEY_PTRS (k) && !key_stale (c, k))
      dirty += KEY_SIZE (k);
  }
  return dirty;
}

static void
json_node (struct btree_ctx *x, struct bcf_cache *c, const struct bcf_node *n,
           uint64_t lo_inode, uint64_t lo_offset, uint64_t node_dirty)
{
  struct json *j = x->j;

  jw_open (j, NULL, '{');
  jw_u64 (j, "level", n->level);
  jw_u64 (j, "bucket", n->bucket);
  jw_u64 (j, "gen", n->gen);
  jw_u64 (j, "keys", n->nkeys);
  jw_u64 (j, "written", n->written);
  jw_open (j, "range", '{');
  jw_open (j, "after", '{');
  jw_u64 (j, "inode", lo_inode);
  jw_u64 (j, "offset", lo_offset);
  jw_close (j, '}');
  jw_open (j, "to", '{');
  jw_u64 (j, "inode", n->inode);
  jw_u64 (j, "offset", n->offset);
  jw_close (j, '}');
  jw_close (j, '}');
  if (n->level == 0)
    jw_u64 (j, "dirty_sectors", node_dirty);
  if (x->opts->verbose) {
    jw_open (j, "key_list", '[');
    for (size_t i = 0; i < n->nkeys; i++)
      json_bkey (j, bcf_node_key (n, i), n->level, c, x->bucket_sectors);
    jw_close (j, ']');
  }
  jw_close (j, '}');
}

static int
show_node (struct bcf_cache *c, const struct bcf_node *n, void *opaque)
{
  struct btree_ctx *x = opaque;
  const unsigned lv = n->level < MAX_LEVELS ? n->level : MAX_LEVELS - 1;
  uint64_t lo_inode = 0, lo_offset = 0, node_dirty = 0;
  char lo[48], hi[48];

  if (x->have_prev[lv]) {
    lo_inode = x->prev[lv].inode;
    lo_offset = x->prev[lv].offset;
  }
  x->prev[lv].inode = n->inode;
  x->prev[lv].offset = n->offset;
  x->have_prev[lv] = true;
  x->nodes++;
  if (n->level == 0) {
    x->keys += n->nkeys;
    node_dirty = leaf_dirty (c, n, &x->check_keys);
    x->dirty_sectors += node_dirty;
  }
  if (x->j) {
    json_node (x, c, n, lo_inode, lo_offset, node_dirty);
    return 0;
  }

  pos_string (lo_inode, lo_offset, lo, sizeof lo);
  pos_string (n->inode, n->offset, hi, sizeof hi);
  printf ("node bucket %" PRIu64 " level %u: %zu keys, %zu bytes written, "
          "range (%s, %s]", n->bucket, n->level, n->nkeys, n->written, lo,
          hi);
  if (n->level == 0 && node_dirty)
    printf (", %" PRIu64 " dirty sectors", node_dirty);
  putchar ('\n');
  if (x->opts->verbose)
    for (size_t i = 0; i < n->nkeys; i++) {
      fputs (n->level ? "    " : "    key ", stdout);
      text_key (bcf_node_key (n, i), n->level, c, x->bucket_sectors);
    }
  return 0;
}

static int
mode_btree (const struct options *opts, const struct device *dev,
            int load_status)
{
  struct json j = { .fp = stdout };
  struct btree_ctx x = { .opts = opts };
  struct bcf_cache *c;
  uint64_t root = 0;
  unsigned level = 0, depth;
  int status, r;

  (void) load_status;
  if (!(c = engine_open (opts, dev, &status)))
    return status;
  x.bucket_sectors = bch_sb_bucket_sectors (bcf_cache_super (c));
  if (opts->json)
    x.j = &j;

  depth = bcf_btree_root (c, &root, &level) ? level + 1 : 0;
  if (opts->json) {
    jw_open (&j, NULL, '{');
    jw_str (&j, "device", dev->path);
    jw_open (&j, "root", '{');
    jw_u64 (&j, "bucket", root);
    jw_u64 (&j, "level", level);
    jw_close (&j, '}');
    jw_open (&j, "nodes", '[');
  }
  else
    printf ("btree of %s: root bucket %" PRIu64 " level %u\n", dev->path,
            root, level);
  r = bcf_btree_walk (c, show_node, &x);

  if (opts->json) {
    jw_close (&j, ']');
    jw_open (&j, "summary", '{');
    jw_u64 (&j, "nodes", x.nodes);
    jw_u64 (&j, "depth", depth);
    jw_u64 (&j, "keys", x.keys);
    jw_u64 (&j, "check_keys", x.check_keys);
    jw_u64 (&j, "dirty_sectors", x.dirty_sectors);
    jw_close (&j, '}');
    jw_close (&j, '}');
    putchar ('\n');
  }
  else
    printf ("summary: %" PRIu64 " nodes, depth %u, %" PRIu64 " keys, %"
            PRIu64 " dirty sectors\n", x.nodes, depth, x.keys,
            x.dirty_sectors);
  status = finish_output ();
  if (r != 0) {
    device_error (dev->path, "walking the btree: %s (a child node is "
                  "missing)", strerror (r < 0 ? -r : EIO));
    status = worst (status, EXIT_INVALID);
  }
  bcf_cache_close (c);
  return status;
}

/* ------------------------------------------------------------------------
 * --buckets: bcache's priority_stats
 * ------------------------------------------------------------------------ */

#define NQUANTILES 31

static int
cmp_prio_desc (const void *a, const void *b)
{
  const uint16_t x = *(const uint16_t *) a, y = *(const uint16_t *) b;
  return x > y ? -1 : x < y;
}

static uint64_t
percent (uint64_t n, uint64_t total)
{
  return total ? n * 100 / total : 0;
}

static int
mode_buckets (const struct options *opts, const struct device *dev,
              int load_status)
{
  struct bcf_cache *c;
  struct bcf_bucket *bk;
  uint64_t nb, unused = 0, clean = 0, dirty = 0, meta = 0, ndata = 0;
  uint64_t age_sum = 0, prio_sum = 0, average = 0, prio_average = 0;
  uint64_t sectors_per_q, first_bucket, bucket_sectors;
  unsigned q[NQUANTILES] = { 0 };
  uint16_t *prios;
  int status;

  (void) load_status;
  if (!(c = engine_open (opts, dev, &status)))
    return status;
  first_bucket = bcf_cache_super (c)->first_bucket;
  bucket_sectors = bch_sb_bucket_sectors (bcf_cache_super (c));
  if (bcf_cache_buckets (c, &bk, &nb) < 0 ||
      !(prios = malloc ((nb ? nb : 1) * sizeof *prios))) {
    device_error (dev->path, "out of memory");
    free (bk);
    bcf_cache_close (c);
    return EXIT_ERROR;
  }
  bcf_cache_close (c);
  for (uint64_t b = 0; b < nb; b++) {
    if (bk[b].sectors_used == 0)
      unused++;
    switch (bk[b].use) {
    case BCF_BUCKET_CLEAN:    clean++; break;
    case BCF_BUCKET_DIRTY:    dirty++; break;
    case BCF_BUCKET_METADATA: meta++; break;
    default: break;
    }
    if (b >= first_bucket &&
        (bk[b].use == BCF_BUCKET_CLEAN || bk[b].use == BCF_BUCKET_DIRTY))
      prios[ndata++] = bk[b].prio;
  }
  free (bk);

  /* As bcache: prios sorted from the most recently used down; the
   * figures shown are INITIAL_PRIO - prio (0 = just used). */
  qsort (prios, ndata, sizeof *prios, cmp_prio_desc);
  for (uint64_t i = 0; i < ndata; i++) {
    age_sum += prios[i] < BCH_INITIAL_PRIO ? BCH_INITIAL_PRIO - prios[i] : 0;
    prio_sum += prios[i];
  }
  if (ndata) {
    average = age_sum / ndata;
    prio_average = prio_sum / ndata;
    for (unsigned i = 0; i < NQUANTILES; i++) {
      uint16_t p = prios[ndata * (i + 1) / (NQUANTILES + 1)];
      q[i] = p < BCH_INITIAL_PRIO ? BCH_INITIAL_PRIO - p : 0;
    }
  }
  sectors_per_q = ndata * bucket_sectors / (NQUANTILES + 1);
  free (prios);

  if (opts->json) {
    struct json j = { .fp = stdout };

    jw_open (&j, NULL, '{');
    jw_str (&j, "device", dev->path);
    jw_u64 (&j, "nbuckets", nb);
    jw_u64 (&j, "bucket_bytes", bucket_sectors * BCH_SECTOR_SIZE);
    jw_u64 (&j, "first_bucket", first_bucket);
#define JSON_SHARE(name, n)                             \
    jw_open (&j, name, '{');                          \
    jw_u64 (&j, "buckets", n);                        \
    jw_u64 (&j, "percent", percent (n, nb));          \
    jw_close (&j, '}')
    JSON_SHARE ("unused", unused);
    JSON_SHARE ("clean", clean);
    JSON_SHARE ("dirty", dirty);
    JSON_SHARE ("metadata", meta);
#undef JSON_SHARE
    jw_u64 (&j, "data_buckets", ndata);
    jw_u64 (&j, "average", average);
    jw_u64 (&j, "prio_average", prio_average);
    jw_u64 (&j, "sectors_per_q", sectors_per_q);
    jw_open (&j, "quantiles", '[');
    for (unsigned i = 0; i < NQUANTILES; i++)
      jw_u64 (&j, NULL, q[i]);
    jw_close (&j, ']');
    jw_close (&j, '}');
    putchar ('\n');
  }
  else {
    /* bcache's priority_stats, exactly as sysfs prints it. */
    printf ("Unused:\t\t%" PRIu64 "%%\n", percent (unused, nb));
    printf ("Clean:\t\t%" PRIu64 "%%\n", percent (clean, nb));
    printf ("Dirty:\t\t%" PRIu64 "%%\n", percent (dirty, nb));
    printf ("Metadata:\t%" PRIu64 "%%\n", percent (meta, nb));
    printf ("Average:\t%" PRIu64 "\n", average);
    printf ("Sectors per Q:\t%" PRIu64 "\n", sectors_per_q);
    fputs ("Quantiles:\t[", stdout);
    for (unsigned i = 0; i < NQUANTILES; i++)
      printf ("%s%u", i ? " " : "", q[i]);
    fputs ("]\n\n", stdout);
    field ("buckets.total", "%" PRIu64, nb);
    field ("buckets.unused", "%" PRIu64, unused);
    field ("buckets.clean", "%" PRIu64, clean);
    field ("buckets.dirty", "%" PRIu64, dirty);
    field ("buckets.metadata", "%" PRIu64, meta);
    field ("buckets.data", "%" PRIu64, ndata);
    field ("prio.average", "%" PRIu64, prio_average);
  }
  return finish_output ();
}

/* ------------------------------------------------------------------------
 * --fsck
 * ------------------------------------------------------------------------ */

#define FSCK_REPORT_BYTES (1024 * 1024)

/* bcf_cache_fsck's report lines that are notes, not problems. */
#define NOTE_PREFIX "note: "
#define NOTE_PREFIX_LEN (sizeof NOTE_PREFIX - 1)

static bool
is_note (const char *line)
{
  return strncmp (line, NOTE_PREFIX, NOTE_PREFIX_LEN) == 0;
}

/* A figure of the engine's statistics, by its name in the table
 * (bcachefilter/stats.h): 0 if the snapshot has none. */
static uint64_t
stat_u64 (const struct bcf_snapshot *snap, const char *name)
{
  struct bcf_stat_value v;

  return snap && bcf_stat_get (snap, bcf_stat_find (name), BCF_VIEW_TOTAL,
                               &v) ? v.u : 0;
}

static int
mode_fsck (const struct options *opts, const struct device *dev,
           int load_status)
{
  struct bcf_cache *c;
  struct bcf_snapshot *snap;
  struct progress pr;
  char *report;
  uint64_t nodes, keys, buckets;
  size_t lines = 0;
  int problems, status;

  (void) load_status;
  /* The open is where the time goes (the journal, the nodes, after a
   * crash the replay: seconds on a large cache); bcf_cache_fsck's walks
   * take a few percent of it, so the line ends with the open's last
   * step. */
  progress_start (&pr, "opening the cache", 0);
  if (!(c = engine_open_backing (opts, dev, NULL, &pr, &status)))
    return status;
  report = malloc (FSCK_REPORT_BYTES);
  if (!report) {
    progress_end (&pr);
    device_error (dev->path, "out of memory");
    bcf_cache_close (c);
    return EXIT_ERROR;
  }
  problems = bcf_cache_fsck (c, report, FSCK_REPORT_BYTES);
  progress_end (&pr);
  snap = bcf_snapshot_take (c, NULL);
  if (snap == NULL)
    problems = -ENOMEM;
  nodes = stat_u64 (snap, "btree_nodes");
  keys = stat_u64 (snap, "btree_keys");
  buckets = stat_u64 (snap, "nbuckets");
  bcf_snapshot_free (snap);
  bcf_cache_close (c);
  if (problems < 0) {
    device_error (dev->path, "fsck: out of memory");
    free (report);
    return EXIT_ERROR;
  }

  if (opts->json) {
    struct json j = { .fp = stdout };
    const char *p = report;

    jw_open (&j, NULL, '{');
    jw_str (&j, "device", dev->path);
    jw_str (&j, "status", problems ? "inconsistent" : "clean");
    jw_u64 (&j, "nodes", nodes);
    jw_u64 (&j, "keys", keys);
    jw_u64 (&j, "buckets", buckets);
    jw_u64 (&j, "problem_count", (uint64_t) problems);
    jw_open (&j, "problems", '[');
    while (*p) {
      size_t len = strcspn (p, "\n");
      if (!is_note (p)) {
        jw_strn (&j, NULL, p, len);
        lines++;
      }
      p += len;
      p += *p == '\n';
    }
    jw_close (&j, ']');
    jw_open (&j, "notes", '[');
    for (p = report; *p; ) {
      size_t len = strcspn (p, "\n");
      if (is_note (p))
        jw_strn (&j, NULL, p + NOTE_PREFIX_LEN, len - NOTE_PREFIX_LEN);
      p += len;
      p += *p == '\n';
    }
    jw_close (&j, ']');
    jw_close (&j, '}');
    putchar ('\n');
  }
  else {
    const char *p = report;

    while (*p) {
      size_t len = strcspn (p, "\n");
      if (is_note (p))
        printf ("%.*s\n", (int) len, p);
      else {
        printf ("problem: %.*s\n", (int) len, p);
        lines++;
      }
      p += len;
      p += *p == '\n';
    }
    if (lines < (size_t) problems)
      printf ("problem: ... %zu more (the report was truncated)\n",
              (size_t) problems - lines);
    if (problems == 0)
      printf ("clean: %" PRIu64 " nodes, %" PRIu64 " keys, %" PRIu64
              " buckets checked\n", nodes, keys, buckets);
  }
  free (report);
  status = finish_output ();
  if (problems) {
    device_error (dev->path, "fsck found %d problem%s in %" PRIu64 " nodes, "
                  "%" PRIu64 " keys, %" PRIu64 " buckets", problems,
                  problems == 1 ? "" : "s", nodes, keys, buckets);
    status = worst (status, EXIT_FSCK);
  }
  return status;
}

/* ------------------------------------------------------------------------
 * --verify: the cache's clean data against the export
 * ------------------------------------------------------------------------ */

/* Exit statuses of --verify, like cmp(1)'s (see the man page). */
enum {
  VERIFY_SAME   = 0,        /* every clean extent agrees with the export */
  VERIFY_DIFFER = 1,        /* at least one differs */
  VERIFY_ERROR  = 2,        /* could not tell */
};

#define VERIFY_CHUNK (1024 * 1024)   /* bytes compared at a time */
#define VERIFY_EXTENTS 64            /* extents per bcf_lookup */

struct verify {
  struct bcf_cache *c;
  struct nbd_handle *nbd;
  const char *path, *uri;
  char *cbuf, *ebuf;        /* VERIFY_CHUNK bytes each */
  uint64_t *marks;          /* write-intent regions marked (start bytes) */
  size_t nmarks;
  uint64_t extents, bytes, differ, dirty, dirty_bytes, suspect,
           suspect_bytes;
};

/* Is any byte of e in a marked write-intent region?  After a crash its
 * clean data is suspect (the export may be newer), and the next
 * read-write open drops it: skipped, like dirty data. */
static bool
in_marked_region (const struct verify *v, const struct bcf_extent *e)
{
  for (size_t i = 0; i < v->nmarks; i++)
    if (e->offset < v->marks[i] + BCF_INTENT_REGION_BYTES &&
        v->marks[i] < e->offset + e->len)
      return true;
  return false;
}

/* Collect the marked regions.  0, or -1 if out of memory. */
static int
load_marks (struct verify *v)
{
  uint64_t buf[64], from = 0;
  unsigned n;

  while ((n = bcf_cache_intent_marks (v->c, from, buf, 64)) > 0) {
    uint64_t *p = realloc (v->marks, (v->nmarks + n) * sizeof *p);
    if (!p)
      return -1;
    v->marks = p;
    memcpy (v->marks + v->nmarks, buf, n * sizeof *buf);
    v->nmarks += n;
    from = buf[n - 1] + BCF_INTENT_REGION_BYTES;
    if (n < 64)
      break;
  }
  return 0;
}

/* Compare one clean hit: returns 0, or -1 after a message (an error). */
static int
verify_hit (struct verify *v, const struct bcf_extent *e)
{
  uint64_t done;
  bool differs = false;

  for (done = 0; done < e->len && !differs; ) {
    struct bcf_extent piece = *e;
    size_t n = e->len - done < VERIFY_CHUNK ? e->len - done : VERIFY_CHUNK;
    size_t i;
    int r;

    piece.offset += done;
    piece.dev_offset += done;
    piece.len = n;
    r = bcf_read_hit (v->c, &piece, v->cbuf);
    if (r < 0) {
      errno = -r;
      device_error (v->path, "reading the cache at byte %" PRIu64
                    " (export bytes %" PRIu64 "+%zu): %m",
                    piece.dev_offset, piece.offset, n);
      return -1;
    }
    if (nbd_pread (v->nbd, v->ebuf, n, piece.offset, 0) == -1) {
      fprintf (stderr, "%s: %s: reading export bytes %" PRIu64 "+%zu: %s\n",
               PROGRAM_NAME, v->uri, piece.offset, n, nbd_get_error ());
      return -1;
    }
    if (memcmp (v->cbuf, v->ebuf, n) != 0) {
      for (i = 0; v->cbuf[i] == v->ebuf[i]; i++)
        ;
      printf ("differs: export offset %" PRIu64 " length %" PRIu64
              " (cache byte %" PRIu64 "): first differing byte at export "
              "offset %" PRIu64 "\n", e->offset, e->len, e->dev_offset,
              piece.offset + i);
      differs = true;
    }
    done += n;
  }
  v->extents++;
  v->bytes += e->len;
  v->differ += differs;
  return 0;
}

/* Walk [0, size) with bcf_lookup: every hit is compared (clean) or
 * counted (dirty).  0, or -1 after a message. */
static int
verify_all (struct verify *v, uint64_t size)
{
  struct bcf_extent ex[VERIFY_EXTENTS];
  struct progress p;
  uint64_t pos = 0;

  progress_start (&p, "verify", size);
  while (pos < size) {
    unsigned n, i;
    int r = bcf_lookup (v->c, pos, size - pos, ex, VERIFY_EXTENTS, &n);

    if (r < 0 || n == 0) {
      progress_end (&p);
      errno = r < 0 ? -r : EIO;
      device_error (v->path, "looking up export bytes %" PRIu64 " on: %m",
                    pos);
      return -1;
    }
    for (i = 0; i < n; i++) {
      if (ex[i].kind == BCF_EXTENT_HIT && ex[i].dirty) {
        v->dirty++;
        v->dirty_bytes += ex[i].len;
      }
      else if (ex[i].kind == BCF_EXTENT_HIT && in_marked_region (v, &ex[i])) {
        v->suspect++;
        v->suspect_bytes += ex[i].len;
      }
      else if (ex[i].kind == BCF_EXTENT_HIT && verify_hit (v, &ex[i]) < 0) {
        progress_end (&p);
        return -1;
      }
      pos = ex[i].offset + ex[i].len;
      progress_update (&p, pos);
    }
  }
  progress_end (&p);
  return 0;
}

/* The export as the engine's backing store: only its size and reads
 * are used (a read-only open never writes it). */
static int
nbd_backing_pread (void *opaque, void *buf, uint32_t count, uint64_t offset)
{
  return nbd_pread (opaque, buf, count, offset, 0) == -1 ? -EIO : 0;
}

static int64_t
nbd_backing_size (void *opaque)
{
  int64_t size = nbd_get_size (opaque);
  return size < 0 ? -EIO : size;
}

static const struct bcf_backing_ops nbd_backing_ops = {
  .pread = nbd_backing_pread,
  .size = nbd_backing_size,
};

static int
mode_verify (const struct options *opts, const struct device *dev,
             int load_status)
{
  struct verify v = { .path = dev->path, .uri = opts->uri };
  struct bcf_backing backing;
  int64_t size;
  int status = VERIFY_ERROR;

  (void) load_status;
  v.nbd = nbd_create ();
  if (!v.nbd || nbd_connect_uri (v.nbd, opts->uri) == -1 ||
      (size = nbd_get_size (v.nbd)) == -1) {
    fprintf (stderr, "%s: %s: cannot read the export: %s\n", PROGRAM_NAME,
             opts->uri, nbd_get_error ());
    nbd_close (v.nbd);
    return VERIFY_ERROR;
  }
  /* The cache's keys are at backing-store bytes: the export must be the
   * store the filter ran on (for a bcache backing device, the whole
   * device, superblock included: its data_offset is in the keys). */
  backing.ops = &nbd_backing_ops;
  backing.opaque = v.nbd;
  if (!(v.c = engine_open_backing (opts, dev, &backing, NULL, &status))) {
    nbd_close (v.nbd);
    return VERIFY_ERROR;
  }
  status = VERIFY_ERROR;
  v.cbuf = malloc (VERIFY_CHUNK);
  v.ebuf = malloc (VERIFY_CHUNK);
  if (!v.cbuf || !v.ebuf) {
    device_error (dev->path, "out of memory");
    goto out;
  }
  printf ("verify: clean extents of %s against %s, at export offsets "
          "(the cache's keys: for a bcache backing device, its data_offset "
          "is included)\n", dev->path, opts->uri);
  if (load_marks (&v) < 0) {
    device_error (dev->path, "out of memory");
    goto out;
  }
  if (verify_all (&v, (uint64_t) size) < 0)
    goto out;
  if (v.suspect)
    printf ("%" PRIu64 " clean extent%s (%" PRIu64 " bytes) in %zu "
            "write-intent region%s marked at a crash skipped: the export "
            "may be newer there, and the next open drops them\n",
            v.suspect, v.suspect == 1 ? "" : "s", v.suspect_bytes,
            v.nmarks, v.nmarks == 1 ? "" : "s");
  printf ("%" PRIu64 " extent%s checked (%" PRIu64 " bytes), %" PRIu64
          " differ%s, %" PRIu64 " dirty skipped (%" PRIu64 " bytes)\n",
          v.extents, v.extents == 1 ? "" : "s", v.bytes, v.differ,
          v.differ == 1 ? "s" : "", v.dirty, v.dirty_bytes);
  if (finish_output () != EXIT_OK)
    goto out;
  status = v.differ ? VERIFY_DIFFER : VERIFY_SAME;
  if (v.differ)
    device_error (dev->path, "%" PRIu64 " clean extent%s differ%s from "
                  "the export", v.differ, v.differ == 1 ? "" : "s",
                  v.differ == 1 ? "s" : "");
 out:
  if (v.nbd)
    nbd_close (v.nbd);
  free (v.cbuf);
  free (v.ebuf);
  free (v.marks);
  bcf_cache_close (v.c);
  return status;
}

/* ------------------------------------------------------------------------
 * The superblock mode, options and main
 * ------------------------------------------------------------------------ */

static int
mode_super (const struct options *opts, const struct device *dev,
            int load_status)
{
  struct sb_view v;

  make_view (&v, dev, load_status);
  if (opts->json)
    show_super_json (&v);
  else
    show_super_text (&v);
  if (finish_output () != EXIT_OK)
    return EXIT_ERROR;
  return load_status;
}

static void
usage (FILE *fp)
{
  fprintf (fp,
           "Usage: %s [--json] [-f|--force] DEVICE\n"
           "       %s --journal|--btree|--buckets|--fsck [--json] [-v] DEVICE\n"
           "       %s --verify [-v] DEVICE URI\n"
           "       %s --help | --version\n"
           "Decode and check a bcache cache device or file (read only).\n"
           "\n"
           "Modes (default: the superblock):\n"
           "      --journal  the journal entries in the journal buckets\n"
           "      --btree    the btree nodes (-v: and every key)\n"
           "      --buckets  bucket usage and priorities (priority_stats)\n"
           "      --fsck     check the whole cache\n"
           "      --verify   compare the cache's clean data with the export\n"
           "                 at URI (nbd+unix:///?socket=...); exit 0 same,\n"
           "                 1 different, 2 error\n"
           "Options:\n"
           "      --json     print one JSON object instead of text\n"
           "  -f, --force    print the superblock even if its checksum,\n"
           "                 version, features or fields are bad\n"
           "  -v, --verbose  --journal, --btree: also every key\n"
           "  -h, --help     print this help and exit\n"
           "  -V, --version  print the version and exit\n"
           "\n"
           "Exit status: 0 ok, 1 usage or I/O error, 2 not bcache, 3 backing\n"
           "device, 4 truncated, 5 bad checksum, 6 unsupported version or\n"
           "features, 7 invalid superblock or corrupt metadata, 8 fsck found\n"
           "problems, 9 never registered.  See bcachefilter-show(1).\n",
           PROGRAM_NAME, PROGRAM_NAME, PROGRAM_NAME, PROGRAM_NAME);
}

static int
set_mode (struct options *opts, const char *option,
          int (*mode) (const struct options *, const struct device *, int))
{
  if (opts->mode_option && strcmp (opts->mode_option, option) != 0) {
    fprintf (stderr, "%s: %s and %s: choose one mode\n", PROGRAM_NAME,
             opts->mode_option, option);
    return EXIT_ERROR;
  }
  opts->mode_option = option;
  opts->mode = mode;
  return -1;
}

/* Parse the command line into opts.  Returns -1 to continue, else the
 * exit status. */
static int
parse_options (int argc, char *argv[], struct options *opts)
{
  enum { JSON_OPTION = 256, JOURNAL_OPTION, BTREE_OPTION, BUCKETS_OPTION,
         FSCK_OPTION, VERIFY_OPTION };
  static const struct option long_options[] = {
    { "json",    no_argument, NULL, JSON_OPTION },
    { "journal", no_argument, NULL, JOURNAL_OPTION },
    { "btree",   no_argument, NULL, BTREE_OPTION },
    { "buckets", no_argument, NULL, BUCKETS_OPTION },
    { "fsck",    no_argument, NULL, FSCK_OPTION },
    { "verify",  no_argument, NULL, VERIFY_OPTION },
    { "force",   no_argument, NULL, 'f' },
    { "verbose", no_argument, NULL, 'v' },
    { "help",    no_argument, NULL, 'h' },
    { "version", no_argument, NULL, 'V' },
    { NULL, 0, NULL, 0 }
  };
  int c, r = -1;
  bool verify;

  opts->mode = mode_super;
  while ((c = getopt_long (argc, argv, "fvhV", long_options, NULL)) != -1) {
    switch (c) {
    case JSON_OPTION: opts->json = true; break;
    case JOURNAL_OPTION: r = set_mode (opts, "--journal", mode_journal); break;
    case BTREE_OPTION: r = set_mode (opts, "--btree", mode_btree); break;
    case BUCKETS_OPTION: r = set_mode (opts, "--buckets", mode_buckets); break;
    case FSCK_OPTION: r = set_mode (opts, "--fsck", mode_fsck); break;
    case VERIFY_OPTION: r = set_mode (opts, "--verify", mode_verify); break;
    case 'f': opts->force = true; break;
    case 'v': opts->verbose = true; break;
    case 'h': usage (stdout); return EXIT_OK;
    case 'V': printf ("%s %s\n", PROGRAM_NAME, PACKAGE_VERSION); return EXIT_OK;
    default: usage (stderr); return EXIT_ERROR;
    }
    if (r >= 0)
      return r;
  }
  verify = opts->mode == mode_verify;
  if (argc - optind != 1 + verify) {
    fprintf (stderr, "%s: %s\n", PROGRAM_NAME,
             optind == argc ? "missing DEVICE argument" :
             argc - optind < 1 + verify ? "--verify: missing URI argument "
             "(the export, e.g. nbd+unix:///?socket=SOCKET)" :
             "too many arguments");
    usage (stderr);
    return verify ? VERIFY_ERROR : EXIT_ERROR;
  }
  if (verify)
    opts->uri = argv[optind + 1];
  if (opts->json && opts->mode == mode_verify) {
    fprintf (stderr, "%s: --verify prints text only; drop --json\n",
             PROGRAM_NAME);
    return VERIFY_ERROR;
  }
  if (opts->force && opts->mode_option) {
    fprintf (stderr, "%s: --force applies only to the superblock display, "
             "not to %s\n", PROGRAM_NAME, opts->mode_option);
    return EXIT_ERROR;
  }
  opts->path = argv[optind];
  return -1;
}

/* Statuses for which --force still shows what was decoded. */
static bool
forceable (int status)
{
  return status == EXIT_CSUM || status == EXIT_UNSUPPORTED ||
         status == EXIT_INVALID;
}

/* The device may have a writer (a running proxy): say so, since what
 * we read from under it may be a moment old or mid-update.  We take no
 * claim ourselves (bcachefilter/claim.h). */
static void
note_writer (const char *path)
{
  char holder[1024];

  if (bcf_claim_probe (path, holder, sizeof holder) == 1)
    fprintf (stderr, PROGRAM_NAME ": note: %s is in use by %s; it is being "
             "written while we read it, so what follows may be stale\n",
             path, holder);
}

int
main (int argc, char *argv[])
{
  struct options opts = { 0 };
  static struct device dev;     /* static: holds the 4 KiB area */
  CLEANUP_CLOSE int fd = -1;
  int r;

  atexit (bcf_release_memory);
  r = parse_options (argc, argv, &opts);
  if (r >= 0)
    return r != EXIT_OK && opts.mode == mode_verify ? VERIFY_ERROR : r;

  r = open_device (&dev, opts.path);
  fd = dev.fd;
  if (r != EXIT_OK)
    return opts.mode == mode_verify ? VERIFY_ERROR : r;
  note_writer (opts.path);

  r = load_super (&dev);
  if (r != EXIT_OK && !(opts.force && forceable (r)))
    return opts.mode == mode_verify ? VERIFY_ERROR : r;

  return opts.mode (&opts, &dev, r);
}
