/* engine-bench: a micro-benchmark of the cache engine (core/).
 *
 * What it measures (docs/BENCHMARKS.md has the figures and the targets):
 *   a. insert: a cache is filled with N distinct 4 KiB clean extents, one
 *      at every other 4 KiB block of a sparse in-memory backing store of
 *      2*N blocks (so neighbours never merge), through bcf_insert (clean,
 *      not durable), in random order by default.  Inserts/s is reported
 *      per segment between the checkpoints 10k, 100k, 1M, 10M keys (those
 *      <= N, and N), including everything the engine does on the way:
 *      the 4 KiB data write, journal entry writes when an entry fills,
 *      checkpoints when the journal ring fills, allocator refills (prio
 *      writes), and a bcf_flush at the end of each segment.
 *   b. lookup: random 4 KiB bcf_lookup calls over the cached blocks at
 *      each checkpoint: median / p99 / max latency (clock_gettime around
 *      each call; the clock's own cost is printed in the header) and
 *      lookups/s from an untimed run, with 1 and 2 threads; plus random
 *      lookups of uncached blocks (the holes between the extents).
 *   c. open: bcf_cache_close, then bcf_cache_open (BCF_FORMAT_NEVER) of the
 *      cache at each checkpoint; "load" is the time until the engine logs
 *      "opened; replayed" (journal scan, prios, uuids, btree load, replay),
 *      the rest is the initial GC mark, free lists, prio write and the
 *      checkpoint that open_existing ends with.
 *   d. memory: RSS (/proc/self/statm) just before the open and after it,
 *      per key; also what the btree's own arrays hold (walked through the
 *      engine's internals), and bcf_cache_stats.
 *   e. hit read: lookup + bcf_read_hit of random 4 KiB hits, content
 *      checked, 1 and 2 threads (device I/O; informative).
 *   f. overwrite (--overwrites N): N random 4 KiB writeback-mode writes
 *      (bcf_write_begin_back: data to new cache space, a journalled dirty
 *      key over the cached block) with 1 and --threads threads, the
 *      filter's per-write engine work under writeback rmw without
 *      nbdkit, fio or a remote around it; with how long each held the
 *      btree lock for writing (the engine's update_locked).  The data
 *      written differs from the block's first content in its last word;
 *      hit reads then check which one each block holds.
 * After each reopen every key is looked up once in block order (verify)
 * to prove the cache persisted all N extents.
 *
 * It checks every return code and every result (a hit where a hit is
 * expected, the right offset and length, the right data); any error makes
 * the exit status 1.  Performance never does: nothing here asserts a
 * timing.  The seed (--seed, else the clock) is printed first.
 *
 * Output: a header (the command line, the machine, the cache geometry)
 * and one Markdown table row per measurement, ready for the docs.
 */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "bcachefilter/cache.h"
#include "engine.h"
#include "io.h"
#include "mem-backing.h"

#define BLOCK 4096u

/* ---- options ---------------------------------------------------------------- */

static struct {
  uint64_t keys;
  uint64_t cache_size;          /* 0 = computed from keys */
  const char *dir;
  int io_mode;                  /* enum bcf_io_mode */
  bool quick;
  uint64_t seed;
  bool seq_order;
  unsigned threads;             /* the multi-threaded rows */
  unsigned insert_threads;      /* threads inserting (phase a) */
  unsigned reopens;             /* opens per checkpoint */
  bool reopen_trim;             /* malloc_trim before each of them */
  uint64_t lookups;             /* per thread, per measurement */
  uint64_t reads;               /* hit reads per thread */
  bool bg_threads;
  bool keep;
  unsigned bucket_sectors;
  uint64_t flush_every;
  bool no_verify;
  uint64_t node_cache;          /* opts.node_cache_bytes (0: engine's) */
  uint64_t overwrites;          /* phase f, per row (0: skipped) */
} opt = {
  .keys = 1000000, .io_mode = BCF_IO_AUTO, .threads = 2, .insert_threads = 1,
  .reopens = 1,
  .lookups = 1000000, .reads = 20000, .bucket_sectors = 1024,
};

static char cache_path[4096];
static int failures;            /* correctness problems seen */

/* ---- small helpers ------------------------------------------------------------- */

static void
cleanup_file (void)
{
  if (cache_path[0] && !opt.keep)
    unlink (cache_path);
}

static void __attribute__ ((noreturn, format (printf, 1, 2)))
die (const char *fmt, ...)
{
  va_list ap;

  fflush (stdout);
  fprintf (stderr, "engine-bench: ");
  va_start (ap, fmt);
  vfprintf (stderr, fmt, ap);
  va_end (ap);
  fprintf (stderr, " (seed %" PRIu64 ")\n", opt.seed);
  cleanup_file ();
  exit (1);
}

static void
on_signal (int sig)
{
  /* async-signal-safe: unlink and _exit only */
  if (cache_path[0] && !opt.keep)
    unlink (cache_path);
  _exit (128 + sig);
}

static void
fail (const char *fmt, ...)
{
  va_list ap;

  fflush (stdout);
  fprintf (stderr, "engine-bench: ERROR: ");
  va_start (ap, fmt);
  vfprintf (stderr, fmt, ap);
  va_end (ap);
  fprintf (stderr, " (seed %" PRIu64 ")\n", opt.seed);
  failures++;
}

static uint64_t
now_ns (void)
{
  struct timespec ts;
  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static uint64_t
rnd_next (uint64_t *s)
{
  /* xorshift64* */
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

static uint64_t
rnd_seed (uint64_t a, uint64_t b)
{
  uint64_t x = a * 0x9E3779B97F4A7C15ull + b + 1;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  return x ? x : 1;
}

/* Counts: 10k, 1M, 10M, 1e6 (k/M/G are decimal). */
static uint64_t
parse_count (const char *s, const char *what)
{
  char *end;
  double v;
  uint64_t mul = 1;

  errno = 0;
  v = strtod (s, &end);
  if (errno || end == s || v < 0)
    die ("bad %s: %s", what, s);
  switch (*end) {
  case 'k': case 'K': mul = 1000; end++; break;
  case 'm': case 'M': mul = 1000000; end++; break;
  case 'g': case 'G': mul = 1000000000; end++; break;
  }
  if (*end)
    die ("bad %s: %s", what, s);
  return (uint64_t) (v * (double) mul + 0.5);
}

/* Sizes: 512M, 6G (K/M/G/T are binary). */
static uint64_t
parse_bytes (const char *s, const char *what)
{
  char *end;
  double v;
  uint64_t mul = 1;

  errno = 0;
  v = strtod (s, &end);
  if (errno || end == s || v < 0)
    die ("bad %s: %s", what, s);
  switch (*end) {
  case 'k': case 'K': mul = 1ull << 10; end++; break;
  case 'm': case 'M': mul = 1ull << 20; end++; break;
  case 'g': case 'G': mul = 1ull << 30; end++; break;
  case 't': case 'T': mul = 1ull << 40; end++; break;
  }
  if (*end == 'i' || *end == 'B')
    end++;
  if (*end == 'B')
    end++;
  if (*end)
    die ("bad %s: %s", what, s);
  return (uint64_t) (v * (double) mul);
}

static uint64_t
rss_bytes (void)
{
  FILE *f = fopen ("/proc/self/statm", "r");
  unsigned long size, rss;

  if (!f)
    die ("/proc/self/statm: %s", strerror (errno));
  if (fscanf (f, "%lu %lu", &size, &rss) != 2)
    die ("/proc/self/statm: cannot parse");
  fclose (f);
  return (uint64_t) rss * (uint64_t) sysconf (_SC_PAGESIZE);
}

static int
cmp_double (const void *a, const void *b)
{
  double x = *(const double *) a, y = *(const double *) b;
  return x < y ? -1 : x > y;
}

static uint64_t
minor_faults (void)
{
  struct rusage ru;

  if (getrusage (RUSAGE_SELF, &ru) < 0)
    return 0;
  return (uint64_t) ru.ru_minflt;
}

/* Give freed memory back so RSS differences mean something. */
static void
trim_memory (void)
{
  bcf_buf_pool_trim ();
  malloc_trim (0);
}

static const char *
fmt_ns (char *buf, size_t len, double ns)
{
  if (ns < 1000)
    snprintf (buf, len, "%.0f ns", ns);
  else if (ns < 1e6)
    snprintf (buf, len, "%.2f us", ns / 1e3);
  else if (ns < 1e9)
    snprintf (buf, len, "%.2f ms", ns / 1e6);
  else
    snprintf (buf, len, "%.2f s", ns / 1e9);
  return buf;
}

static const char *
fmt_rate (char *buf, size_t len, double per_s)
{
  if (per_s >= 1e6)
    snprintf (buf, len, "%.2f M", per_s / 1e6);
  else if (per_s >= 1e3)
    snprintf (buf, len, "%.1f k", per_s / 1e3);
  else
    snprintf (buf, len, "%.0f", per_s);
  return buf;
}

static const char *
fmt_count (char *buf, size_t len, uint64_t n)
{
  if (n >= 1000000 && n % 1000000 == 0)
    snprintf (buf, len, "%" PRIu64 "M", n / 1000000);
  else if (n >= 1000 && n % 1000 == 0)
    snprintf (buf, len, "%" PRIu64 "k", n / 1000);
  else
    snprintf (buf, len, "%" PRIu64, n);
  return buf;
}

static const char *
fmt_bytes (char *buf, size_t len, double b)
{
  if (b >= 1024.0 * 1024 * 1024)
    snprintf (buf, len, "%.2f GiB", b / (1024.0 * 1024 * 1024));
  else if (b >= 1024.0 * 1024)
    snprintf (buf, len, "%.1f MiB", b / (1024.0 * 1024));
  else if (b >= 1024.0)
    snprintf (buf, len, "%.1f KiB", b / 1024.0);
  else
    snprintf (buf, len, "%.0f B", b);
  return buf;
}

/* ---- latency histogram ----------------------------------------------------------- */

/* Log-linear: values below 128 ns exact, above in 128 steps per power of
 * two (< 0.8% error).  Small and mergeable, so it costs no memory that
 * would show in the RSS figures. */
#define HSUB_BITS 7
#define HSUB (1u << HSUB_BITS)
#define HSLOTS (64u * HSUB)

struct hist {
  uint64_t n, max, sum;
  uint64_t b[HSLOTS];
};

static unsigned
hist_slot (uint64_t v)
{
  unsigned p;

  if (v < HSUB)
    return (unsigned) v;
  p = 63u - (unsigned) __builtin_clzll (v);
  return (p - HSUB_BITS + 1) * HSUB +
         (unsigned) ((v >> (p - HSUB_BITS)) & (HSUB - 1));
}

static double
hist_value (unsigned slot)
{
  unsigned p, sub;
  double lo, w;

  if (slot < HSUB)
    return slot;
  p = slot / HSUB + HSUB_BITS - 1;
  sub = slot % HSUB;
  lo = (double) ((uint64_t) (HSUB + sub) << (p - HSUB_BITS));
  w = (double) (1ull << (p - HSUB_BITS));
  return lo + w / 2;
}

static void
hist_add (struct hist *h, uint64_t v)
{
  h->b[hist_slot (v)]++;
  h->n++;
  h->sum += v;
  if (v > h->max)
    h->max = v;
}

static void
hist_merge (struct hist *into, const struct hist *from)
{
  for (unsigned i = 0; i < HSLOTS; i++)
    into->b[i] += from->b[i];
  into->n += from->n;
  into->sum += from->sum;
  if (from->max > into->max)
    into->max = from->max;
}

static double
hist_pct (const struct hist *h, double q)
{
  uint64_t rank, seen = 0;

  if (h->n == 0)
    return 0;
  rank = (uint64_t) (q * (double) h->n);
  if (rank >= h->n)
    rank = h->n - 1;
  for (unsigned i = 0; i < HSLOTS; i++) {
    seen += h->b[i];
    if (seen > rank)
      return hist_value (i) < (double) h->max ? hist_value (i)
             : (double) h->max;
  }
  return (double) h->max;
}

static struct hist *
hist_new (void)
{
  struct hist *h = calloc (1, sizeof *h);
  if (!h)
    die ("out of memory");
  return h;
}

/* ---- the table ------------------------------------------------------------------- */

static void
row_header (void)
{
  printf ("\n| phase | keys | thr | ops | ops/s | p50 | p99 | max | notes |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|\n");
}

/* One row; h may be NULL (then the latency columns are empty). */
static void __attribute__ ((format (printf, 7, 8)))
row (const char *phase, uint64_t keys, unsigned thr, uint64_t ops,
     double secs, const struct hist *h, const char *notes_fmt, ...)
{
  char k[32], rate[32], p50[32] = "", p99[32] = "", mx[32] = "", notes[512];
  char th[16] = "", o[32] = "";
  va_list ap;

  va_start (ap, notes_fmt);
  vsnprintf (notes, sizeof notes, notes_fmt, ap);
  va_end (ap);
  if (h && h->n) {
    fmt_ns (p50, sizeof p50, hist_pct (h, 0.5));
    fmt_ns (p99, sizeof p99, hist_pct (h, 0.99));
    fmt_ns (mx, sizeof mx, (double) h->max);
  }
  if (ops && secs > 0)
    fmt_rate (rate, sizeof rate, (double) ops / secs);
  else
    rate[0] = 0;
  if (thr)
    snprintf (th, sizeof th, "%u", thr);
  if (ops)
    fmt_count (o, sizeof o, ops);
  printf ("| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", phase,
          fmt_count (k, sizeof k, keys), th, o, rate, p50, p99, mx, notes);
  fflush (stdout);
}

/* ---- the engine under test --------------------------------------------------------- */

struct bench {
  struct mem_backing *mb;
  struct bcf_cache_opts copts;
  struct bcf_cache *c;
  uint64_t nkeys;               /* keys inserted so far */
  uint32_t *order;              /* block of the i-th insert (NULL: i) */
  uint64_t open_loaded_ns;      /* when the engine logged "opened" */
  bool opening;
};

static struct bench B;

static void
log_cb (void *opaque, enum bcf_log_level level, const char *msg)
{
  struct bench *b = opaque;

  if (b->opening && strstr (msg, "opened; replayed"))
    b->open_loaded_ns = now_ns ();
  if (level >= BCF_LOG_WARN || getenv ("BENCH_VERBOSE"))
    fprintf (stderr, "engine: %s\n", msg);
}

static uint64_t
block_of (const struct bench *b, uint64_t i)
{
  return b->order ? b->order[i] : i;
}

/* Offset in the backing store of extent number blk. */
static uint64_t
extent_offset (uint64_t blk)
{
  return 2 * blk * (uint64_t) BLOCK;
}

static void
fill_block (uint64_t *buf, uint64_t blk)
{
  uint64_t x = rnd_seed (opt.seed, blk);

  buf[0] = blk;
  buf[1] = ~blk;
  for (unsigned w = 2; w < BLOCK / 8; w++)
    buf[w] = x + w;
}

/* Blocks phase f wrote (1 each), so that reads after it know which
 * content to expect; NULL before it. */
static uint8_t *overwritten;

/* What phase f writes: the block's own content with its last word
 * changed, so a lost overwrite reads back as the old content. */
static void
fill_block_overwrite (uint64_t *buf, uint64_t blk)
{
  fill_block (buf, blk);
  buf[BLOCK / 8 - 1] = ~buf[BLOCK / 8 - 1];
}

static bool
check_block (const uint64_t *buf, uint64_t blk)
{
  uint64_t x = rnd_seed (opt.seed, blk), last = x + BLOCK / 8 - 1;

  if (overwritten && __atomic_load_n (&overwritten[blk], __ATOMIC_RELAXED))
    last = ~last;
  return buf[0] == blk && buf[1] == ~blk && buf[2] == x + 2 &&
         buf[BLOCK / 8 - 1] == last;
}

static void
cache_open (struct bench *b, enum bcf_format_policy fmt)
{
  char err[512] = "";
  int r;

  b->copts.format = fmt;
  b->opening = true;
  b->open_loaded_ns = 0;
  r = bcf_cache_open (&b->copts, &b->c, err, sizeof err);
  b->opening = false;
  if (r < 0)
    die ("bcf_cache_open %s: %s (%s)", cache_path, err, strerror (-r));
  if (opt.bg_threads && (r = bcf_cache_start_threads (b->c)) < 0)
    die ("bcf_cache_start_threads: %s", strerror (-r));
}

static void
cache_close (struct bench *b)
{
  int r = bcf_cache_close (b->c);

  b->c = NULL;
  if (r < 0)
    die ("bcf_cache_close: %s", strerror (-r));
}

/* What the btree holds in memory, from the engine's own structures. */
struct mem_walk {
  uint64_t leaves, evicted, interior, keys, key_cap, open_cap, bytes;
};

static int
mem_visit (struct bcf_cache *c, struct btree_node *n, void *opaque)
{
  struct mem_walk *m = opaque;

  if (n->level == 0) {
    m->leaves++;
    m->keys += n->keys.nr;
    if (n->evicted)
      m->evicted++;
  }
  else
    m->interior++;
  m->key_cap += n->keys.cap;
  m->open_cap += n->open.cap;
  /* dcopies: the dirty keys journalled since the last capture (phase f
   * makes them; clean inserts never do). */
  m->bytes += sizeof *n + keyset_bytes (&n->keys) + keyset_bytes (&n->open) +
              keyset_bytes (&n->dcopies);
  return 0;
}

static struct mem_walk
btree_memory (struct bcf_cache *c)
{
  struct mem_walk m = { 0 };
  int r;

  pthread_rwlock_rdlock (&c->tree_lock);
  r = btree_visit (c, mem_visit, &m);
  pthread_rwlock_unlock (&c->tree_lock);
  if (r < 0)
    fail ("btree_visit: %s", strerror (-r));
  m.bytes += c->tree.hash_size * sizeof (void *);
  return m;
}

/* ---- phase a: inserts --------------------------------------------------------------- */

struct inserter {
  pthread_t tid;
  struct bench *b;
  _Atomic uint64_t *next;
  uint64_t target;
  struct hist *h;
  int err;
  uint64_t err_i;
};

static void *
inserter_main (void *arg)
{
  struct inserter *in = arg;
  struct bench *b = in->b;
  uint64_t *buf = bcf_buf_alloc (BLOCK);

  if (!buf) {
    in->err = -ENOMEM;
    return NULL;
  }
  for (;;) {
    uint64_t i = atomic_fetch_add (in->next, 1), blk, t;
    int r;

    if (i >= in->target)
      break;
    blk = block_of (b, i);
    fill_block (buf, blk);
    t = now_ns ();
    r = bcf_insert (b->c, extent_offset (blk), BLOCK, buf, false, false);
    hist_add (in->h, now_ns () - t);
    if (r == 0 && opt.flush_every && (i + 1) % opt.flush_every == 0)
      r = bcf_flush (b->c);
    if (r < 0) {
      in->err = r;
      in->err_i = i;
      break;
    }
  }
  bcf_buf_free (buf, BLOCK);
  bcf_io_thread_cleanup ();
  return NULL;
}

/* Insert keys b->nkeys..target-1 with opt.insert_threads threads taking
 * the next index in turn, then bcf_flush; the time includes the flush. */
static void
insert_to (struct bench *b, uint64_t target, struct hist *h, double *secs)
{
  struct inserter in[64];
  _Atomic uint64_t next = b->nkeys;
  unsigned nthr = opt.insert_threads;
  uint64_t t0, t1;
  int r;

  t0 = now_ns ();
  for (unsigned t = 0; t < nthr; t++) {
    in[t] = (struct inserter) { .b = b, .next = &next, .target = target,
                                .h = hist_new () };
    if (nthr == 1)
      inserter_main (&in[t]);
    else if ((r = pthread_create (&in[t].tid, NULL, inserter_main, &in[t])))
      die ("pthread_create: %s", strerror (r));
  }
  for (unsigned t = 0; t < nthr; t++) {
    if (nthr > 1 && (r = pthread_join (in[t].tid, NULL)))
      die ("pthread_join: %s", strerror (r));
    hist_merge (h, in[t].h);
    free (in[t].h);
  }
  for (unsigned t = 0; t < nthr; t++)
    if (in[t].err)
      die ("bcf_insert #%" PRIu64 " (block %" PRIu64 "): %s", in[t].err_i,
           block_of (b, in[t].err_i), strerror (-in[t].err));
  if ((r = bcf_flush (b->c)) < 0)
    die ("bcf_flush: %s", strerror (-r));
  t1 = now_ns ();
  b->nkeys = target;
  *secs = (double) (t1 - t0) / 1e9;
}

/* ---- phase b / e: lookups and hit reads (threads) --------------------------------------- */

enum work { W_LOOKUP_HIT, W_LOOKUP_MISS, W_READ_HIT, W_OVERWRITE };

struct worker {
  pthread_t tid;
  struct bench *b;
  enum work what;
  bool timed;
  uint64_t count;
  uint64_t seed;
  pthread_barrier_t *bar;
  struct hist *h;
  uint64_t errors, stale;
  uint64_t sink;
  uint64_t hot_blocks;          /* > 0: blocks [0, hot_blocks) only */
  _Atomic bool *stop;           /* non-NULL: run until set */
  uint64_t done;                /* lookups made */
};

static void *
worker_main (void *arg)
{
  struct worker *w = arg;
  struct bench *b = w->b;
  uint64_t s = w->seed, *buf = NULL;
  struct bcf_extent ext[4];
  unsigned n;

  if ((w->what == W_READ_HIT || w->what == W_OVERWRITE) &&
      !(buf = bcf_buf_alloc (BLOCK))) {
    w->errors++;
    return NULL;
  }
  pthread_barrier_wait (w->bar);
  for (uint64_t i = 0; i < w->count; i++) {
    if (w->stop && atomic_load_explicit (w->stop, memory_order_relaxed))
      break;
    w->done++;
    uint64_t blk = w->hot_blocks ? rnd_next (&s) % w->hot_blocks
                   : block_of (b, rnd_next (&s) % b->nkeys);
    uint64_t off = extent_offset (blk) + (w->what == W_LOOKUP_MISS ? BLOCK : 0);
    uint64_t t = w->timed ? now_ns () : 0;
    int r;

    if (w->what == W_OVERWRITE) {
      struct bcf_write wr;

      fill_block_overwrite (buf, blk);
      r = bcf_write_begin_back (b->c, off, BLOCK, buf, &wr);
      if (r == 0) {
        bcf_write_release (b->c, &wr);
        __atomic_store_n (&overwritten[blk], 1, __ATOMIC_RELAXED);
      }
      if (w->timed)
        hist_add (w->h, now_ns () - t);
      if (r < 0 && w->errors++ < 5)
        fail ("overwrite of block %" PRIu64 ": %s", blk, strerror (-r));
      continue;
    }
    r = bcf_lookup (b->c, off, BLOCK, ext, 4, &n);

    if (w->what == W_READ_HIT && r == 0 && n == 1 &&
        ext[0].kind == BCF_EXTENT_HIT) {
      r = bcf_read_hit (b->c, &ext[0], buf);
      if (r == -ESTALE) {
        w->stale++;
        r = 0;
      }
      else if (r == 0 && !check_block (buf, blk)) {
        if (w->errors++ < 5)
          fail ("hit read of block %" PRIu64 " returned wrong data", blk);
      }
    }
    if (w->timed)
      hist_add (w->h, now_ns () - t);
    if (r < 0 || n != 1 || ext[0].offset != off || ext[0].len != BLOCK ||
        ext[0].kind != (w->what == W_LOOKUP_MISS ? BCF_EXTENT_MISS
                        : BCF_EXTENT_HIT)) {
      if (w->errors++ < 5)
        fail ("lookup of %" PRIu64 " (block %" PRIu64 "): r=%d n=%u kind=%d "
              "offset=%" PRIu64 " len=%" PRIu64, off, blk, r, n,
              n ? (int) ext[0].kind : -1, n ? ext[0].offset : 0,
              n ? ext[0].len : 0);
    }
    w->sink += ext[0].dev_offset;
  }
  if (buf)
    bcf_buf_free (buf, BLOCK);
  bcf_io_thread_cleanup ();
  return NULL;
}

/* Run `what` on nthr threads, count ops each; returns wall seconds and
 * merges latencies into h (if timed). */
static uint64_t hot_blocks;     /* for the next run_workers */

static double
run_workers (struct bench *b, enum work what, unsigned nthr, uint64_t count,
             bool timed, struct hist *h, uint64_t *errors, uint64_t *stale)
{
  struct worker w[16];
  pthread_barrier_t bar;
  uint64_t t0, t1;
  static uint64_t run_no;
  int r;

  if (nthr > 16)
    nthr = 16;
  if ((r = pthread_barrier_init (&bar, NULL, nthr + 1)))
    die ("pthread_barrier_init: %s", strerror (r));
  run_no++;
  for (unsigned i = 0; i < nthr; i++) {
    w[i] = (struct worker) {
      .b = b, .what = what, .timed = timed, .count = count,
      .seed = rnd_seed (opt.seed ^ (run_no << 32), i + 1),
      .bar = &bar, .h = timed ? hist_new () : NULL,
      .hot_blocks = hot_blocks,
    };
    if ((r = pthread_create (&w[i].tid, NULL, worker_main, &w[i])))
      die ("pthread_create: %s", strerror (r));
  }
  pthread_barrier_wait (&bar);
  t0 = now_ns ();
  for (unsigned i = 0; i < nthr; i++)
    if ((r = pthread_join (w[i].tid, NULL)))
      die ("pthread_join: %s", strerror (r));
  t1 = now_ns ();
  pthread_barrier_destroy (&bar);
  *errors = 0;
  if (stale)
    *stale = 0;
  for (unsigned i = 0; i < nthr; i++) {
    *errors += w[i].errors;
    if (stale)
      *stale += w[i].stale;
    if (timed) {
      hist_merge (h, w[i].h);
      free (w[i].h);
    }
  }
  return (double) (t1 - t0) / 1e9;
}

static uint64_t
btree_loads (struct bench *b)
{
  struct bcf_cache_stats st;

  bcf_cache_stats (b->c, &st);
  return st.btree_loads;
}

struct lookup_result {
  double p50_ns;                /* single thread, hits */
  double rate_1t;
};

static struct lookup_result
phase_lookups (struct bench *b, const char *label)
{
  struct lookup_result res = { 0 };
  unsigned thr[2] = { 1, opt.threads };
  char phase[64];

  for (unsigned ti = 0; ti < 2; ti++) {
    unsigned t = thr[ti];
    struct hist *h = hist_new ();
    uint64_t errors, e2, ops = opt.lookups * t;
    double secs_timed, secs, rep[3];

    if (ti == 1 && t == 1)
      break;
    uint64_t loads0 = btree_loads (b);

    secs_timed = run_workers (b, W_LOOKUP_HIT, t, opt.lookups, true, h,
                              &errors, NULL);
    /* Untimed: three runs, the median reported (the host is shared). */
    for (unsigned k = 0; k < 3; k++) {
      rep[k] = run_workers (b, W_LOOKUP_HIT, t, opt.lookups, false, NULL,
                            &e2, NULL);
      errors += e2;
    }
    qsort (rep, 3, sizeof rep[0], cmp_double);
    secs = rep[1];
    snprintf (phase, sizeof phase, "lookup hit%s", label);
    row (phase, b->nkeys, t, ops, secs, h,
         "ops/s: median of 3 untimed runs (%.2f-%.2f M/s); timed run "
         "%.2f M/s; %" PRIu64 " evicted leaves loaded%s",
         (double) ops / rep[2] / 1e6, (double) ops / rep[0] / 1e6,
         (double) ops / secs_timed / 1e6, btree_loads (b) - loads0,
         errors ? "; ERRORS" : "");
    if (t == 1) {
      res.p50_ns = hist_pct (h, 0.5);
      res.rate_1t = (double) ops / secs;
    }
    free (h);
  }
  /* Once every key is in, blocks 0..N-1 are all cached: a lookup
   * confined to the first 1/64 of them (a few leaves, which stay in the
   * CPU caches) runs the same code on the same tree, so the difference
   * from the uniform row is the cost of cache misses. */
  if (b->nkeys == opt.keys && opt.keys >= 64 * 1000) {
    struct hist *h = hist_new ();
    uint64_t errors;
    double secs;

    hot_blocks = opt.keys / 64;
    secs = run_workers (b, W_LOOKUP_HIT, 1, opt.lookups, true, h, &errors,
                        NULL);
    hot_blocks = 0;
    snprintf (phase, sizeof phase, "lookup hit, hot 1/64%s", label);
    row (phase, b->nkeys, 1, opt.lookups, secs, h,
         "blocks [0, N/64) only: %" PRIu64 " keys in a few leaves (timed "
         "run)%s", opt.keys / 64, errors ? "; ERRORS" : "");
    free (h);
  }
  {
    struct hist *h = hist_new ();
    uint64_t errors;
    double secs = run_workers (b, W_LOOKUP_MISS, 1, opt.lookups / 2, true, h,
                               &errors, NULL);
    snprintf (phase, sizeof phase, "lookup miss%s", label);
    row (phase, b->nkeys, 1, opt.lookups / 2, secs, h,
         "holes between extents (timed run)%s", errors ? "; ERRORS" : "");
    free (h);
  }
  return res;
}

/* Lookups on one thread while the main thread runs a checkpoint of
 * everything dirtied since the last one: how long do readers wait?
 * (DESIGN.md I5: no foreground request waits for a whole background
 * pass.)  The checkpoint's snapshot phase holds tree_lock for writing. */
static void
phase_ckpt_stall (struct bench *b)
{
  _Atomic bool stop = false;
  pthread_barrier_t bar;
  struct worker w = {
    .b = b, .what = W_LOOKUP_HIT, .timed = true, .count = UINT64_MAX,
    .seed = rnd_seed (opt.seed, 0xc4c4), .bar = &bar, .h = hist_new (),
    .stop = &stop,
  };
  struct timespec ms10 = { 0, 10 * 1000000 };
  struct bcf_time_stat held;
  uint64_t t0, t1, t2;
  char tc[32], th[32];
  int r;

  if ((r = pthread_barrier_init (&bar, NULL, 2)))
    die ("pthread_barrier_init: %s", strerror (r));
  if ((r = pthread_create (&w.tid, NULL, worker_main, &w)))
    die ("pthread_create: %s", strerror (r));
  pthread_barrier_wait (&bar);
  t0 = now_ns ();
  nanosleep (&ms10, NULL);
  /* The engine's own account of how long this checkpoint held the btree
   * lock for writing (core/engine.h), to tell a lock stall from the
   * scheduler's. */
  pthread_mutex_lock (&b->c->stats.time_lock);
  memset (&b->c->stats.ckpt_locked, 0, sizeof b->c->stats.ckpt_locked);
  pthread_mutex_unlock (&b->c->stats.time_lock);
  t1 = now_ns ();
  if ((r = bcf_cache_checkpoint (b->c)) < 0)
    die ("bcf_cache_checkpoint: %s", strerror (-r));
  t2 = now_ns ();
  pthread_mutex_lock (&b->c->stats.time_lock);
  held = b->c->stats.ckpt_locked;
  pthread_mutex_unlock (&b->c->stats.time_lock);
  nanosleep (&ms10, NULL);
  atomic_store (&stop, true);
  if ((r = pthread_join (w.tid, NULL)))
    die ("pthread_join: %s", strerror (r));
  pthread_barrier_destroy (&bar);
  row ("lookup during checkpoint", b->nkeys, 1, w.done,
       (double) (now_ns () - t0) / 1e9, w.h,
       "a checkpoint of %s ran meanwhile on another thread; it held the "
       "btree lock for writing %" PRIu64 " times, at most %s%s",
       fmt_ns (tc, sizeof tc, (double) (t2 - t1)), held.count,
       fmt_ns (th, sizeof th, (double) held.max_ns),
       w.errors ? "; ERRORS" : "");
  free (w.h);
}

static void
phase_reads (struct bench *b)
{
  unsigned thr[2] = { 1, opt.threads };

  for (unsigned ti = 0; ti < 2; ti++) {
    unsigned t = thr[ti];
    struct hist *h = hist_new ();
    uint64_t errors, stale;
    double secs;

    if (ti == 1 && t == 1)
      break;
    secs = run_workers (b, W_READ_HIT, t, opt.reads, true, h, &errors,
                        &stale);
    row ("hit read 4K", b->nkeys, t, opt.reads * t, secs, h,
         "lookup + bcf_read_hit, io %s, data checked; %" PRIu64 " stale%s",
         bcf_io_mode_name (bcf_cache_test_io (b->c)), stale,
         errors ? "; ERRORS" : "");
    free (h);
  }
}

/* Phase f.  The rows say what the tree lock cost per update: the
 * engine's update_locked over the row (its own inserts, and any node
 * load, split or clean mark they caused). */
static void
phase_overwrites (struct bench *b)
{
  unsigned thr[2] = { 1, opt.threads };

  if (opt.overwrites && !(overwritten = calloc (2 * opt.keys, 1)))
    die ("out of memory");
  for (unsigned ti = 0; ti < 2 && opt.overwrites; ti++) {
    unsigned t = thr[ti];
    struct hist *h = hist_new ();
    struct bcf_cache_stats st0, st1;
    uint64_t errors;
    double secs;
    char ta[32], tm[32];

    if (ti == 1 && t == 1)
      break;
    bcf_cache_stats (b->c, &st0);
    secs = run_workers (b, W_OVERWRITE, t, opt.overwrites / t, true, h,
                        &errors, NULL);
    bcf_cache_stats (b->c, &st1);
    row ("overwrite 4K", b->nkeys, t, opt.overwrites / t * t, secs, h,
         "bcf_write_begin_back over cached blocks; btree lock held for "
         "updates %" PRIu64 " times, average %s, max %s (all time); %" PRIu64
         " journal writes, %" PRIu64 " checkpoints%s",
         st1.update_locked.count - st0.update_locked.count,
         fmt_ns (ta, sizeof ta, st1.update_locked.count >
                                st0.update_locked.count
                 ? (double) (st1.update_locked.total_ns -
                             st0.update_locked.total_ns) /
                   (double) (st1.update_locked.count -
                             st0.update_locked.count) : 0),
         fmt_ns (tm, sizeof tm, (double) st1.update_locked.max_ns),
         st1.journal_writes - st0.journal_writes,
         st1.checkpoint.count - st0.checkpoint.count,
         errors ? "; ERRORS" : "");
    free (h);
  }
  if (opt.overwrites) {
    uint64_t errors, stale, n = opt.overwrites < 20000 ? opt.overwrites
                                                       : 20000;
    double secs = run_workers (b, W_READ_HIT, 1, n, false, NULL, &errors,
                               &stale);

    row ("verify overwrites", b->nkeys, 1, n, secs, NULL,
         "random hit reads after them, content checked; %" PRIu64
         " stale%s", stale, errors ? "; ERRORS" : "");
  }
  free (overwritten);
  overwritten = NULL;           /* no phase reads the blocks after this */
}

/* Every key, once (after a reopen: persistence).  Once all N are in,
 * blocks 0..N-1 in ascending order; before that, the inserted ones in
 * insertion order. */
static void
phase_verify (struct bench *b)
{
  struct bcf_extent ext[4];
  const bool all = b->nkeys == opt.keys;
  uint64_t errors = 0, t0 = now_ns ();
  unsigned n;

  for (uint64_t i = 0; i < b->nkeys; i++) {
    uint64_t blk = all ? i : block_of (b, i);
    uint64_t off = extent_offset (blk);
    int r = bcf_lookup (b->c, off, BLOCK, ext, 4, &n);

    if (r < 0 || n != 1 || ext[0].kind != BCF_EXTENT_HIT ||
        ext[0].offset != off || ext[0].len != BLOCK) {
      if (errors++ < 5)
        fail ("verify: block %" PRIu64 " is not a whole hit (r=%d n=%u "
              "kind=%d)", blk, r, n, n ? (int) ext[0].kind : -1);
    }
  }
  row ("verify", b->nkeys, 1, b->nkeys, (double) (now_ns () - t0) / 1e9,
       NULL, "every key looked up once, %s: %" PRIu64 " not hits",
       all ? "in block order" : "in insertion order", errors);
}

struct open_result {
  double secs;
};

static struct open_result
phase_reopen (struct bench *b)
{
  struct open_result res = { 0 };
  struct bcf_cache_stats st;
  struct mem_walk mw;
  uint64_t t0, t1, t2, rss_closed, rss_open, rss_before = rss_bytes (), flt;
  char b1[32], b2[32], b3[32], t[32];
  double load_s;

  t0 = now_ns ();
  cache_close (b);
  t1 = now_ns ();
  row ("close", b->nkeys, 1, 0, 0, NULL, "%s (includes a checkpoint)",
       fmt_ns (t, sizeof t, (double) (t1 - t0)));
  trim_memory ();
  rss_closed = rss_bytes ();

  flt = minor_faults ();
  t1 = now_ns ();
  cache_open (b, BCF_FORMAT_NEVER);
  t2 = now_ns ();
  flt = minor_faults () - flt;
  res.secs = (double) (t2 - t1) / 1e9;
  load_s = b->open_loaded_ns ? (double) (b->open_loaded_ns - t1) / 1e9 : 0;
  bcf_cache_stats (b->c, &st);
  row ("open", b->nkeys, 1, 0, 0, NULL,
       "**%.3f s**: load (journal, prios, btree, replay) %.3f s + mark, "
       "prio write, checkpoint %.3f s; %" PRIu64 " keys, %" PRIu64
       " nodes, depth %" PRIu64 "; %" PRIu64 " minor page faults",
       res.secs, load_s, res.secs - load_s, st.btree_keys, st.btree_nodes,
       st.btree_depth, flt);
  /* btree_keys counts the keys of loaded leaves only: compare it only
   * while nothing is evicted (verify checks every key either way). */
  if (st.btree_evictions == 0 && st.btree_keys != b->nkeys)
    fail ("after reopen the btree holds %" PRIu64 " keys, expected %" PRIu64,
          st.btree_keys, b->nkeys);

  trim_memory ();
  rss_open = rss_bytes ();
  mw = btree_memory (b->c);
  row ("memory", b->nkeys, 0, 0, 0, NULL,
       "RSS +%s after open = **%.1f B/key** (before close %s over the "
       "closed baseline); btree arrays %s = %.1f B/key (%" PRIu64 " leaves "
       "(%" PRIu64 " evicted), %" PRIu64 " interior, key slots %.0f%% used, "
       "open-set slots %"
       PRIu64 "); buckets array %s",
       fmt_bytes (b1, sizeof b1, (double) rss_open - (double) rss_closed),
       ((double) rss_open - (double) rss_closed) / (double) b->nkeys,
       fmt_bytes (b2, sizeof b2, (double) rss_before - (double) rss_closed),
       fmt_bytes (b3, sizeof b3, (double) mw.bytes),
       (double) mw.bytes / (double) b->nkeys, mw.leaves, mw.evicted,
       mw.interior,
       mw.key_cap ? 100.0 * (double) mw.keys / (double) mw.key_cap : 0,
       mw.open_cap,
       fmt_bytes (t, sizeof t, (double) st.nbuckets * sizeof (struct bucket)));
  /* More opens (--reopens): the spread, and a profile dominated by open. */
  if (opt.reopens > 1) {
    double *v = calloc (opt.reopens, sizeof *v), *l = calloc (opt.reopens,
                                                             sizeof *l);
    unsigned n = opt.reopens;

    if (!v || !l)
      die ("out of memory");
    v[0] = res.secs;
    l[0] = load_s;
    uint64_t flt_min = UINT64_MAX, flt_max = 0;

    for (unsigned i = 1; i < n; i++) {
      cache_close (b);
      if (opt.reopen_trim)
        trim_memory ();
      flt = minor_faults ();
      t1 = now_ns ();
      cache_open (b, BCF_FORMAT_NEVER);
      t2 = now_ns ();
      flt = minor_faults () - flt;
      if (flt < flt_min)
        flt_min = flt;
      if (flt > flt_max)
        flt_max = flt;
      v[i] = (double) (t2 - t1) / 1e9;
      l[i] = b->open_loaded_ns ? (double) (b->open_loaded_ns - t1) / 1e9 : 0;
    }
    qsort (v, n, sizeof *v, cmp_double);
    qsort (l, n, sizeof *l, cmp_double);
    row ("open xN", b->nkeys, 1, n, 0, NULL,
         "%u opens: min %.3f s, median %.3f s, max %.3f s (load: min %.3f, "
         "median %.3f, max %.3f s); opens 2..%u: %" PRIu64 "-%" PRIu64
         " minor page faults%s", n, v[0], v[n / 2], v[n - 1], l[0],
         l[n / 2], l[n - 1], n, flt_min, flt_max,
         opt.reopen_trim ? ", memory trimmed before each" : "");
    free (v);
    free (l);
  }

  return res;
}

static void
print_stats_row (struct bench *b, const char *phase)
{
  struct bcf_cache_stats st;
  struct mem_walk mw = btree_memory (b->c);
  char t1[32], t2[32], t3[32], t4[32], t5[32];

  bcf_cache_stats (b->c, &st);
  row (phase, b->nkeys, 0, 0, 0, NULL,
       "btree %" PRIu64 " nodes (%" PRIu64 " leaves, %" PRIu64 " evicted), "
       "depth %" PRIu64 ", %" PRIu64 " keys loaded, arrays %s = %.1f B/key, "
       "node cache %s (%" PRIu64 " evictions, %" PRIu64 " loads so far)"
       "; buckets free %" PRIu64 " clean %" PRIu64 " meta %" PRIu64 " of %"
       PRIu64 "; journal writes %" PRIu64 ", checkpoints %" PRIu64
       " (total %s, max %s), splits %" PRIu64 ", alloc waits %" PRIu64
       " (total %s)",
       st.btree_nodes, mw.leaves, mw.evicted, st.btree_depth, st.btree_keys,
       fmt_bytes (t1, sizeof t1, (double) mw.bytes),
       (double) mw.bytes / (double) (b->nkeys ? b->nkeys : 1),
       fmt_bytes (t5, sizeof t5, (double) st.btree_cache_bytes),
       st.btree_evictions, st.btree_loads, st.buckets_free, st.buckets_clean,
       st.buckets_meta, st.nbuckets, st.journal_writes, st.checkpoint.count,
       fmt_ns (t2, sizeof t2, (double) st.checkpoint.total_ns),
       fmt_ns (t3, sizeof t3, (double) st.checkpoint.max_ns),
       st.btree_split.count, st.alloc_wait.count,
       fmt_ns (t4, sizeof t4, (double) st.alloc_wait.total_ns));
}

/* ---- the machine -------------------------------------------------------------------- */

static void
print_machine (void)
{
  char model[256] = "unknown", line[512];
  struct utsname u;
  FILE *f;
  uint64_t mem_kb = 0;

  if ((f = fopen ("/proc/cpuinfo", "r"))) {
    while (fgets (line, sizeof line, f))
      if (strncmp (line, "model name", 10) == 0) {
        char *p = strchr (line, ':');
        if (p) {
          p++;
          while (*p == ' ' || *p == '\t')
            p++;
          p[strcspn (p, "\n")] = 0;
          snprintf (model, sizeof model, "%s", p);
        }
        break;
      }
    fclose (f);
  }
  if ((f = fopen ("/proc/meminfo", "r"))) {
    while (fgets (line, sizeof line, f))
      if (sscanf (line, "MemTotal: %" SCNu64, &mem_kb) == 1)
        break;
    fclose (f);
  }
  if (uname (&u) < 0)
    memset (&u, 0, sizeof u);
  printf ("# machine: %ld CPUs (nproc), %s, %.1f GiB RAM, Linux %s %s\n",
          sysconf (_SC_NPROCESSORS_ONLN), model,
          (double) mem_kb / (1024.0 * 1024), u.release, u.machine);
}

/* The machine may be shared: say how busy it was. */
static void
print_loadavg (const char *when)
{
  char line[128] = "?";
  FILE *f = fopen ("/proc/loadavg", "r");

  if (f) {
    if (!fgets (line, sizeof line, f))
      snprintf (line, sizeof line, "?");
    fclose (f);
  }
  line[strcspn (line, "\n")] = 0;
  printf ("# load average %s: %s\n", when, line);
}

static double
clock_cost_ns (void)
{
  uint64_t t0 = now_ns (), x = 0;

  for (int i = 0; i < 1000000; i++)
    x += now_ns ();
  return (double) (now_ns () - t0) / 1e6 + (double) (x & 0);
}

/* ---- main ----------------------------------------------------------------------------- */

static void
usage (FILE *f)
{
  fprintf (f,
"usage: engine-bench [options]\n"
"  --keys N          distinct 4 KiB extents to insert (default 1M; 10k, 10M, ...)\n"
"  --cache-size SIZE cache file size (default N*4KiB*1.2 + N*256 B + 256 MiB)\n"
"  --dir DIR         where the cache file goes (default $TMPDIR or /var/tmp)\n"
"  --io MODE         cache-device I/O: auto, sync or uring (default auto)\n"
"  --order ORDER     insert order: random (default) or seq\n"
"  --lookups N       lookups per thread per measurement (default 1M)\n"
"  --reads N         hit reads per thread (default 20k)\n"
"  --threads T       threads of the multi-threaded rows (default 2)\n"
"  --insert-threads T  threads inserting at once (default 1); with a\n"
"                    device that needs queue depth, T > 1 keeps it busy\n"
"  --flush-every N   bcf_flush every N inserts as well (default: only at\n"
"                    each checkpoint; the engine writes the journal itself)\n"
"  --reopens R       close and open R times at each checkpoint (default 1)\n"
"  --reopen-trim     give freed memory back (malloc_trim) before each of\n"
"                    those opens too, as before the first\n"
"  --bg-threads      run the engine's background threads (journal timer,\n"
"                    allocator, GC) as the filter does\n"
"  --bucket-size S   bucket size when formatting (default 512K)\n"
"  --node-cache SIZE the btree node cache bound (default: the engine's)\n"
"  --seed S          random seed (default: from the clock)\n"
"  --quick           a smoke run: 20k keys unless --keys, fewer lookups\n"
"  --no-verify       skip the every-key lookup after each reopen\n"
"  --overwrites N    at the end, N random 4 KiB writeback-mode writes over\n"
"                    cached blocks, with 1 and 2 threads (default 0: none);\n"
"                    the default cache size makes room for them\n"
"  --keep            keep the cache file\n");
}

int
main (int argc, char **argv)
{
  enum { O_KEYS = 256, O_CACHE, O_DIR, O_IO, O_ORDER, O_LOOKUPS, O_READS,
         O_THREADS, O_INSERT_THREADS, O_REOPENS, O_REOPEN_TRIM, O_NODE_CACHE,
         O_FLUSH, O_BG, O_BUCKET, O_SEED, O_QUICK, O_NOVERIFY,
         O_KEEP, O_HELP, O_OVERWRITES };
  static const struct option longopts[] = {
    { "keys", required_argument, NULL, O_KEYS },
    { "cache-size", required_argument, NULL, O_CACHE },
    { "dir", required_argument, NULL, O_DIR },
    { "io", required_argument, NULL, O_IO },
    { "order", required_argument, NULL, O_ORDER },
    { "lookups", required_argument, NULL, O_LOOKUPS },
    { "reads", required_argument, NULL, O_READS },
    { "threads", required_argument, NULL, O_THREADS },
    { "insert-threads", required_argument, NULL, O_INSERT_THREADS },
    { "reopens", required_argument, NULL, O_REOPENS },
    { "reopen-trim", no_argument, NULL, O_REOPEN_TRIM },
    { "node-cache", required_argument, NULL, O_NODE_CACHE },
    { "flush-every", required_argument, NULL, O_FLUSH },
    { "bg-threads", no_argument, NULL, O_BG },
    { "bucket-size", required_argument, NULL, O_BUCKET },
    { "seed", required_argument, NULL, O_SEED },
    { "quick", no_argument, NULL, O_QUICK },
    { "no-verify", no_argument, NULL, O_NOVERIFY },
    { "keep", no_argument, NULL, O_KEEP },
    { "overwrites", required_argument, NULL, O_OVERWRITES },
    { "help", no_argument, NULL, O_HELP },
    { NULL, 0, NULL, 0 },
  };
  static const uint64_t checkpoints[] = { 10000, 100000, 1000000, 10000000,
                                          100000000 };
  bool keys_given = false, lookups_given = false, reads_given = false;
  bool seed_given = false;
  struct bench *b = &B;
  struct lookup_result lk_1m = { 0 };
  struct open_result op_1m = { 0 };
  bool have_1m = false;
  uint64_t rss_base;
  struct stat sb;
  char tmp[64], tmp2[64], tmp3[64];
  int c;

  while ((c = getopt_long (argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
    case O_KEYS: opt.keys = parse_count (optarg, "--keys"); keys_given = true;
      break;
    case O_CACHE: opt.cache_size = parse_bytes (optarg, "--cache-size"); break;
    case O_DIR: opt.dir = optarg; break;
    case O_IO:
      if (strcmp (optarg, "auto") == 0) opt.io_mode = BCF_IO_AUTO;
      else if (strcmp (optarg, "sync") == 0) opt.io_mode = BCF_IO_SYNC;
      else if (strcmp (optarg, "uring") == 0) opt.io_mode = BCF_IO_URING;
      else die ("--io: auto, sync or uring, not %s", optarg);
      break;
    case O_ORDER:
      if (strcmp (optarg, "random") == 0) opt.seq_order = false;
      else if (strcmp (optarg, "seq") == 0) opt.seq_order = true;
      else die ("--order: random or seq, not %s", optarg);
      break;
    case O_LOOKUPS: opt.lookups = parse_count (optarg, "--lookups");
      lookups_given = true; break;
    case O_READS: opt.reads = parse_count (optarg, "--reads");
      reads_given = true; break;
    case O_THREADS: opt.threads = (unsigned) parse_count (optarg, "--threads");
      break;
    case O_INSERT_THREADS:
      opt.insert_threads = (unsigned) parse_count (optarg, "--insert-threads");
      break;
    case O_REOPENS:
      opt.reopens = (unsigned) parse_count (optarg, "--reopens");
      break;
    case O_REOPEN_TRIM: opt.reopen_trim = true; break;
    case O_NODE_CACHE:
      opt.node_cache = parse_bytes (optarg, "--node-cache");
      break;
    case O_FLUSH: opt.flush_every = parse_count (optarg, "--flush-every");
      break;
    case O_BG: opt.bg_threads = true; break;
    case O_BUCKET:
      opt.bucket_sectors = (unsigned) (parse_bytes (optarg, "--bucket-size")
                                       / 512);
      break;
    case O_SEED: opt.seed = parse_count (optarg, "--seed"); seed_given = true;
      break;
    case O_QUICK: opt.quick = true; break;
    case O_NOVERIFY: opt.no_verify = true; break;
    case O_KEEP: opt.keep = true; break;
    case O_OVERWRITES:
      opt.overwrites = parse_count (optarg, "--overwrites");
      break;
    case O_HELP: case 'h': usage (stdout); return 0;
    default: usage (stderr); return 2;
    }
  }
  if (optind < argc) {
    usage (stderr);
    return 2;
  }
  if (opt.quick) {
    if (!keys_given)
      opt.keys = 20000;
    if (!lookups_given)
      opt.lookups = 50000;
    if (!reads_given)
      opt.reads = 2000;
  }
  if (opt.keys < 1 || opt.keys > UINT32_MAX)
    die ("--keys must be between 1 and %u", UINT32_MAX);
  if (opt.lookups < 2 || opt.threads < 1 || opt.threads > 16 ||
      opt.insert_threads < 1 || opt.insert_threads > 64 ||
      opt.reopens < 1 || opt.reopens > 1000 ||
      opt.bucket_sectors < 8)
    die ("bad --lookups, --threads or --bucket-size");
  if (!seed_given)
    opt.seed = now_ns () % 1000000007ull;
  if (!opt.dir)
    opt.dir = getenv ("TMPDIR") && *getenv ("TMPDIR") ? getenv ("TMPDIR")
              : "/var/tmp";
  /* Nothing reclaims the space overwrites leave stale (no GC runs
   * without --bg-threads): two rows of them need room of their own. */
  if (!opt.cache_size)
    opt.cache_size = (opt.keys * BLOCK / 5 * 6 + opt.keys * 256 +
                      2 * opt.overwrites * BLOCK / 5 * 6 +
                      (256ull << 20) + (1ull << 20) - 1) & ~((1ull << 20) - 1);
  snprintf (cache_path, sizeof cache_path, "%s/engine-bench.%ld.img",
            opt.dir, (long) getpid ());
  if (stat (cache_path, &sb) == 0)
    die ("%s exists already", cache_path);
  signal (SIGINT, on_signal);
  signal (SIGTERM, on_signal);
  signal (SIGHUP, on_signal);

  /* The header: the command, the machine, the setup. */
  printf ("# command:");
  for (int i = 0; i < argc; i++)
    printf (" %s", argv[i]);
  printf ("\n# seed: %" PRIu64 " (rerun with --seed %" PRIu64 ")\n", opt.seed,
          opt.seed);
  print_machine ();
  print_loadavg ("at start");
  printf ("# clock_gettime(CLOCK_MONOTONIC): %.1f ns per call (included in "
          "every timed latency)\n", clock_cost_ns ());

  /* Everything the bench itself needs is allocated before the baseline. */
  if (!opt.seq_order) {
    uint64_t s = rnd_seed (opt.seed, 0xbe9c4);
    b->order = malloc (opt.keys * sizeof *b->order);
    if (!b->order)
      die ("out of memory for the insert order");
    for (uint64_t i = 0; i < opt.keys; i++)
      b->order[i] = (uint32_t) i;
    for (uint64_t i = opt.keys - 1; i > 0; i--) {
      uint64_t j = rnd_next (&s) % (i + 1);
      uint32_t x = b->order[i];
      b->order[i] = b->order[j];
      b->order[j] = x;
    }
  }
  b->mb = mem_backing_new (2 * opt.keys * (uint64_t) BLOCK);
  b->copts = (struct bcf_cache_opts) {
    .path = cache_path, .create_size = opt.cache_size,
    .io_mode = opt.io_mode, .bucket_sectors = opt.bucket_sectors,
    .block_sectors = BLOCK / 512, .backing = mem_backing_get (b->mb),
    .log = log_cb, .log_opaque = b,
    .node_cache_bytes = (size_t) opt.node_cache,
  };
  memcpy (b->copts.backing_uuid, "engine-bench-uid", 16);
  snprintf (b->copts.backing_label, sizeof b->copts.backing_label,
            "engine-bench");

  trim_memory ();
  rss_base = rss_bytes ();
  cache_open (b, BCF_FORMAT_FORCE);
  {
    struct bcf_cache_stats st;
    struct bcf_io *io = bcf_cache_test_io (b->c);

    bcf_cache_stats (b->c, &st);
    printf ("# cache: %s, %s, %" PRIu64 " buckets of %s, block %s, "
            "io %s, O_DIRECT %s, background threads %s, node cache %s\n",
            cache_path,
            fmt_bytes (tmp, sizeof tmp, (double) opt.cache_size),
            st.nbuckets, fmt_bytes (tmp2, sizeof tmp2,
                                    (double) st.bucket_bytes),
            st.block_bytes == 4096 ? "4 KiB" : "?", bcf_io_mode_name (io),
            bcf_io_direct (io) ? "yes" : "no", opt.bg_threads ? "on" : "off",
            opt.node_cache ? fmt_bytes (tmp3, sizeof tmp3,
                                        (double) opt.node_cache)
            : "engine default");
    printf ("# workload: %" PRIu64 " clean 4 KiB extents at every other "
            "block of a %s sparse in-memory backing store, %s order; "
            "lookups %" PRIu64 " per thread per row, hit reads %" PRIu64
            " per thread\n", opt.keys,
            fmt_bytes (tmp, sizeof tmp, 2.0 * (double) opt.keys * BLOCK),
            opt.seq_order ? "ascending" : "random", opt.lookups, opt.reads);
    printf ("# RSS baseline before the first open: %s\n",
            fmt_bytes (tmp, sizeof tmp, (double) rss_base));
  }
  row_header ();

  for (unsigned ci = 0; ci < sizeof checkpoints / sizeof checkpoints[0] &&
       b->nkeys < opt.keys; ci++) {
    uint64_t target = checkpoints[ci] < opt.keys ? checkpoints[ci] : opt.keys;
    uint64_t from = b->nkeys;
    struct hist *h = hist_new ();
    struct bcf_cache_stats st0, st1;
    double secs;
    char tt[32], tm[32];

    if (target < checkpoints[ci] && ci > 0 && target == b->nkeys)
      break;
    bcf_cache_stats (b->c, &st0);
    insert_to (b, target, h, &secs);
    bcf_cache_stats (b->c, &st1);
    row ("insert", target, opt.insert_threads, target - from, secs, h,
         "keys %" PRIu64 "..%" PRIu64 ", incl. final flush; %" PRIu64
         " journal writes, %" PRIu64 " checkpoints (%s, max %s), %" PRIu64
         " alloc refills waited",
         from, target, st1.journal_writes - st0.journal_writes,
         st1.checkpoint.count - st0.checkpoint.count,
         fmt_ns (tt, sizeof tt, (double) (st1.checkpoint.total_ns -
                                          st0.checkpoint.total_ns)),
         fmt_ns (tm, sizeof tm, (double) st1.checkpoint.max_ns),
         st1.alloc_wait.count - st0.alloc_wait.count);
    free (h);
    print_stats_row (b, "state");
    {
      uint64_t rss;

      trim_memory ();
      rss = rss_bytes ();
      row ("memory", target, 0, 0, 0, NULL,
           "RSS +%s over the baseline after inserting = %.1f B/key",
           fmt_bytes (tmp, sizeof tmp, (double) rss - (double) rss_base),
           ((double) rss - (double) rss_base) / (double) target);
    }
    {
      struct lookup_result lr = phase_lookups (b, "");
      struct open_result orr;

      phase_ckpt_stall (b);
      orr = phase_reopen (b);
      struct lookup_result lr2;

      if (!opt.no_verify)
        phase_verify (b);
      lr2 = phase_lookups (b, " (reopened)");
      if (target == 1000000) {
        have_1m = true;
        lk_1m = lr.p50_ns > lr2.p50_ns ? lr : lr2;   /* the worse of two */
        op_1m = orr;
      }
    }
  }
  phase_reads (b);
  phase_overwrites (b);
  print_stats_row (b, "final");

  /* Targets (informative: they never change the exit status). */
  printf ("\n");
  if (have_1m) {
    char t1[32];
    printf ("# target: open a 1M-extent cache in under 2 s: %s (%.3f s)\n",
            op_1m.secs < 2.0 ? "MET" : "MISSED", op_1m.secs);
    printf ("# target: cached 4 KiB lookup under 2 us median at 1M keys: %s "
            "(%s, the worse of before/after reopen, 1 thread)\n",
            lk_1m.p50_ns < 2000 ? "MET" : "MISSED",
            fmt_ns (t1, sizeof t1, lk_1m.p50_ns));
  }
  else
    printf ("# targets are defined at 1M keys; this run had %" PRIu64 "\n",
            opt.keys);

  print_loadavg ("at end");
  cache_close (b);
  mem_backing_free (b->mb);
  free (b->order);
  cleanup_file ();
  if (failures) {
    printf ("# %d ERRORS (seed %" PRIu64 ")\n", failures, opt.seed);
    return 1;
  }
  printf ("# no errors (seed %" PRIu64 ")\n", opt.seed);
  return 0;
}
