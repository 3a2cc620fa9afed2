/* nbd-writes: random writes with a flush every N writes, at a fixed queue
 * depth, over NBD (libnbd): the filter-bench `writes` workload as a VM's
 * filesystem generates it.
 *
 * Why not fio
 * -----------
 * fio's --fsync=32 at --iodepth=16 (nbd engine) does not send one flush
 * per 32 writes: after the 32nd write it puts a flush into every queue
 * slot that frees up until one of them completes, so the slower the
 * server's flush, the more flushes (docs/BENCHMARKS.md, "The journal's
 * second flush does not bound `writes`").  This driver sends exactly one.
 *
 * Design
 * ------
 * One libnbd handle, one thread, the AIO API: nbd_aio_pwrite and
 * nbd_aio_flush with a completion callback that auto-retires the command
 * (returns 1), and nbd_poll as the main loop.
 *
 *   - Exactly --depth requests are in flight (writes and flushes count
 *     alike): a fixed table of depth slots; a slot is taken at submission
 *     and given back by the completion callback, and the main loop
 *     (run_load) refills every free slot after each nbd_poll.
 *   - Each write is --bs bytes at a uniformly random bs-aligned offset over
 *     the whole export (nbd_get_size; splitmix64 modulo the block count,
 *     a relative bias of blocks/2^64 at most: 2^-36 for 1 TiB of 4 KiB
 *     blocks), no flags, from one buffer filled once from the seed
 *     (writes only read it, so all share it).
 *   - After every --flush-every writes *submitted*, the next request
 *     submitted is one NBD_CMD_FLUSH; writes go on filling the other
 *     slots while it is outstanding (no drain: a filesystem's other
 *     writers keep going while its commit's flush waits).  So flushes =
 *     floor(writes submitted / flush-every), exactly; a flush that falls
 *     due as the run ends is still sent.  --flush-every 0: no flushes.
 *   - Time-based: writes stop being submitted --runtime seconds after the
 *     first one; then everything in flight is waited for (60 s at most).
 *     Rates (IOPS, bandwidth) are over the time from the first submission
 *     to the last completion.
 *   - Latency: CLOCK_MONOTONIC from just before the nbd_aio_* call to the
 *     completion callback, every one stored (8 bytes each: 20 s at 50k
 *     IOPS is 8 MB), sorted at the end; percentiles are exact (nearest
 *     rank), writes and flushes separately.
 *   - Any request error (the callback's *error, or a failed nbd_aio_*
 *     call: nbd_get_error) is printed with the request (write #n at
 *     offset o, or flush #n) and the exit status is 1.
 *
 * Output: "seed N" first, a one-line summary at the end, both on stderr.
 * --json FILE: the part of fio's --output-format=json that
 * bench/filter-bench.sh reads for a write job, same keys, same units
 * (ns latencies, bw in KiB/s, runtime in ms): jobs[0].write (iops,
 * bw_bytes, total_ios, clat_ns and lat_ns with percentiles), read and trim
 * all zero, jobs[0].sync (the flushes: total_ios, lat_ns), jobname
 * "writes-fs", and a top-level "nbd-writes" object with the options, the
 * seed and the export size.  clat_ns and lat_ns hold the same figures:
 * there is no submission latency (fio's slat) to split off here.
 *
 * Exit status: 0 done, 1 a request or connection error, 2 usage, or a
 * server that cannot be used (read-only, or no flush when flushes are
 * wanted).
 */
#include "config.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <libnbd.h>

#define PROGRAM_NAME "nbd-writes"
#define MAX_DEPTH 1024
#define MAX_BS (32u << 20)      /* nbdkit's largest request */
#define DRAIN_NS (60 * 1000000000ull)
#define MAX_ERRORS_SHOWN 10

/* ---- options ------------------------------------------------------------- */

static struct {
  unsigned depth;
  uint64_t flush_every;
  uint32_t bs;
  double runtime;               /* seconds */
  uint64_t seed;
  bool seed_given;
  const char *json;
  const char *uri;
} opt = { .depth = 16, .flush_every = 32, .bs = 4096, .runtime = 20 };

/* ---- the run's state ----------------------------------------------------- */

enum kind { WRITE, FLUSH };

struct slot {
  struct run *run;
  enum kind kind;
  uint64_t seq;                 /* write #seq or flush #seq, from 0 */
  uint64_t offset;              /* writes only */
  uint64_t t0;                  /* submission, ns */
};

struct lat_log {                /* every latency, ns */
  uint64_t *v;
  size_t n, cap;
};

struct run {
  struct nbd_handle *nbd;
  uint64_t size;                /* export bytes */
  uint64_t blocks;              /* size / bs: the offsets written */
  void *buf;                    /* the data of every write */
  uint64_t rng;                 /* splitmix64 state: offsets */

  struct slot *slots;           /* depth of them */
  struct slot **free_slots;     /* a stack */
  unsigned nfree;
  unsigned in_flight;

  uint64_t writes_submitted, flushes_submitted;
  uint64_t since_flush;         /* writes submitted since the last flush */
  bool flush_due;
  bool stopping;                /* no more writes */

  uint64_t t_start;             /* ns: the first submission */
  uint64_t t_stop;              /* ns: no write submitted after it */
  uint64_t t_last;              /* ns: the last completion */
  struct lat_log wlat, flat;
  uint64_t errors;
};

/* ---- small helpers ------------------------------------------------------- */

static void __attribute__ ((noreturn, format (printf, 2, 3)))
die (int status, const char *fmt, ...)
{
  va_list ap;

  fflush (stdout);
  fprintf (stderr, PROGRAM_NAME ": ");
  va_start (ap, fmt);
  vfprintf (stderr, fmt, ap);
  va_end (ap);
  fprintf (stderr, "\n");
  exit (status);
}

static uint64_t
now_ns (void)
{
  struct timespec ts;

  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static uint64_t
splitmix64 (uint64_t *s)
{
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);

  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Unsigned integers, decimal or 0x hex; with k_suffix also K/M/G (binary). */
static uint64_t
parse_u64 (const char *s, const char *what, bool k_suffix)
{
  char *end;
  unsigned long long v;
  unsigned shift = 0;

  errno = 0;
  if (*s == '-' || *s == '\0')
    die (2, "bad %s: %s", what, s);
  v = strtoull (s, &end, 0);
  if (errno || end == s)
    die (2, "bad %s: %s", what, s);
  if (k_suffix) {
    switch (*end) {
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    }
    if (shift && *end == 'i' && end[1] == 'B')
      end += 2;
  }
  if (*end || (shift && v > (UINT64_MAX >> shift)))
    die (2, "bad %s: %s", what, s);
  return (uint64_t) v << shift;
}

static void *
xmalloc (size_t n)
{
  void *p = malloc (n);

  if (!p)
    die (1, "out of memory (%zu bytes)", n);
  return p;
}

/* ---- latencies ----------------------------------------------------------- */

static void
lat_push (struct lat_log *l, uint64_t ns)
{
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 1 << 16;
    uint64_t *v = realloc (l->v, cap * sizeof *v);

    if (!v)
      die (1, "out of memory (%zu latencies)", cap);
    l->v = v;
    l->cap = cap;
  }
  l->v[l->n++] = ns;
}

static int
cmp_u64 (const void *a, const void *b)
{
  uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;

  return (x > y) - (x < y);
}

struct lat_stats {
  uint64_t n, min, max;
  double mean, stddev;          /* sample standard deviation, as fio */
};

/* Sorts the log (percentiles read it afterwards). */
static struct lat_stats
lat_summarise (struct lat_log *l)
{
  struct lat_stats s = { .n = l->n };
  double sum = 0, sq = 0;

  if (l->n == 0)
    return s;
  qsort (l->v, l->n, sizeof *l->v, cmp_u64);
  s.min = l->v[0];
  s.max = l->v[l->n - 1];
  for (size_t i = 0; i < l->n; i++)
    sum += (double) l->v[i];
  s.mean = sum / (double) l->n;
  for (size_t i = 0; i < l->n; i++) {
    double d = (double) l->v[i] - s.mean;
    sq += d * d;
  }
  s.stddev = l->n > 1 ? sqrt (sq / (double) (l->n - 1)) : 0;
  return s;
}

/* The nearest-rank percentile of a sorted, non-empty log, the percentile
 * in hundredths (9990: p99.9), in integers so that the rank is exact. */
static uint64_t
lat_percentile (const struct lat_log *l, unsigned hundredths)
{
  uint64_t rank = ((uint64_t) l->n * hundredths + 9999) / 10000;

  return l->v[rank ? rank - 1 : 0];
}

/* ---- requests ------------------------------------------------------------ */

static void
report_request_error (struct run *r, const struct slot *s, const char *err)
{
  r->errors++;
  if (r->errors > MAX_ERRORS_SHOWN)
    return;
  if (s->kind == WRITE)
    fprintf (stderr, PROGRAM_NAME ": write #%" PRIu64 " (%" PRIu32
             " bytes at offset %" PRIu64 ") failed: %s\n",
             s->seq, opt.bs, s->offset, err);
  else
    fprintf (stderr, PROGRAM_NAME ": flush #%" PRIu64 " (after write #%"
             PRIu64 ") failed: %s\n",
             s->seq, (s->seq + 1) * opt.flush_every - 1, err);
}

static struct slot *
take_slot (struct run *r)
{
  struct slot *s = r->free_slots[--r->nfree];

  r->in_flight++;
  return s;
}

static void
give_slot (struct run *r, struct slot *s)
{
  r->free_slots[r->nfree++] = s;
  r->in_flight--;
}

/* The completion callback of every request; returns 1: auto-retired. */
static int
on_complete (void *user_data, int *error)
{
  struct slot *s = user_data;
  struct run *r = s->run;
  uint64_t t = now_ns ();

  if (*error)
    report_request_error (r, s, strerror (*error));
  else
    lat_push (s->kind == WRITE ? &r->wlat : &r->flat, t - s->t0);
  r->t_last = t;
  give_slot (r, s);
  return 1;
}

static void
submit (struct run *r, enum kind kind)
{
  struct slot *s = take_slot (r);
  nbd_completion_callback cb = { .callback = on_complete, .user_data = s };
  int64_t cookie;

  s->kind = kind;
  s->offset = 0;
  if (kind == WRITE) {
    s->seq = r->writes_submitted;
    s->offset = splitmix64 (&r->rng) % r->blocks * opt.bs;
  }
  else
    s->seq = r->flushes_submitted;
  /* Everything the callback reads is set before the call. */
  s->t0 = now_ns ();
  if (kind == WRITE)
    cookie = nbd_aio_pwrite (r->nbd, r->buf, opt.bs, s->offset, cb, 0);
  else
    cookie = nbd_aio_flush (r->nbd, cb, 0);
  if (cookie == -1) {
    report_request_error (r, s, nbd_get_error ());
    give_slot (r, s);
    return;
  }

  if (kind == FLUSH) {
    r->flushes_submitted++;
    r->flush_due = false;
  }
  else {
    r->writes_submitted++;
    if (opt.flush_every && ++r->since_flush == opt.flush_every) {
      r->since_flush = 0;
      r->flush_due = true;
    }
  }
}

/* Submits into every free slot: a flush when one is due (even once the
 * run is stopping), else a write until the runtime is over. */
static void
fill_slots (struct run *r)
{
  while (r->nfree > 0 && !r->errors) {
    if (r->flush_due)
      submit (r, FLUSH);
    else if (r->stopping)
      break;
    else if (now_ns () >= r->t_stop)
      r->stopping = true;
    else
      submit (r, WRITE);
  }
}

/* ---- the run ------------------------------------------------------------- */

static void
connect_export (struct run *r)
{
  int64_t size;
  int ro, fl;

  r->nbd = nbd_create ();
  if (!r->nbd)
    die (1, "nbd_create: %s", nbd_get_error ());
  if (nbd_set_handle_name (r->nbd, PROGRAM_NAME) == -1 ||
      nbd_connect_uri (r->nbd, opt.uri) == -1)
    die (1, "%s: %s", opt.uri, nbd_get_error ());
  if ((size = nbd_get_size (r->nbd)) == -1)
    die (1, "%s: %s", opt.uri, nbd_get_error ());
  if ((ro = nbd_is_read_only (r->nbd)) == -1)
    die (1, "%s: %s", opt.uri, nbd_get_error ());
  if (ro)
    die (2, "%s: the export is read-only (the server says so): cannot "
         "write to it", opt.uri);
  if (opt.flush_every) {
    if ((fl = nbd_can_flush (r->nbd)) == -1)
      die (1, "%s: %s", opt.uri, nbd_get_error ());
    if (!fl)
      die (2, "%s: the server cannot flush (no NBD_CMD_FLUSH), and "
           "--flush-every is %" PRIu64 " (0: no flushes)",
           opt.uri, opt.flush_every);
  }
  r->size = (uint64_t) size;
  r->blocks = r->size / opt.bs;
  if (r->blocks == 0)
    die (2, "%s: the export (%" PRIu64 " bytes) is smaller than --bs %"
         PRIu32, opt.uri, r->size, opt.bs);
}

static void
setup (struct run *r)
{
  uint64_t dseed = opt.seed ^ 0x6E62642D77726974ull;   /* another stream */
  uint64_t *w;

  r->rng = opt.seed;
  r->buf = xmalloc (opt.bs);
  w = r->buf;
  for (size_t i = 0; i < opt.bs / sizeof *w; i++)
    w[i] = splitmix64 (&dseed);
  memset ((char *) r->buf + opt.bs / sizeof *w * sizeof *w, 0xa5,
          opt.bs % sizeof *w);

  r->slots = xmalloc (opt.depth * sizeof *r->slots);
  r->free_slots = xmalloc (opt.depth * sizeof *r->free_slots);
  for (unsigned i = 0; i < opt.depth; i++) {
    r->slots[i] = (struct slot) { .run = r };
    r->free_slots[i] = &r->slots[i];
  }
  r->nfree = opt.depth;
}

static void
run_load (struct run *r)
{
  uint64_t drain_end = 0;
  bool conn_failed = false;

  r->t_start = now_ns ();
  r->t_stop = r->t_start + (uint64_t) (opt.runtime * 1e9);
  r->t_last = r->t_start;
  for (;;) {
    uint64_t t;
    int timeout, p;

    fill_slots (r);
    if (r->in_flight == 0 || r->errors)
      break;
    t = now_ns ();
    if (!r->stopping)
      /* wake up at the end of the runtime even if nothing completes */
      timeout = t >= r->t_stop ? 0
        : (int) ((r->t_stop - t + 999999) / 1000000);
    else {
      if (!drain_end)
        drain_end = t + DRAIN_NS;
      if (t >= drain_end)
        die (1, "%u requests still in flight %llu s after the end of the "
             "run", r->in_flight, DRAIN_NS / 1000000000ull);
      timeout = 1000;
    }
    p = nbd_poll (r->nbd, timeout);
    if (p == -1) {              /* the connection: its requests failed too */
      fprintf (stderr, PROGRAM_NAME ": %s: %s\n", opt.uri, nbd_get_error ());
      conn_failed = true;
      break;
    }
  }
  if (r->errors || conn_failed) {
    if (r->errors > MAX_ERRORS_SHOWN)
      fprintf (stderr, PROGRAM_NAME ": ... and %" PRIu64 " more errors\n",
               r->errors - MAX_ERRORS_SHOWN);
    die (1, "stopped: %" PRIu64 " requests failed%s (seed %" PRIu64 ")",
         r->errors, conn_failed ? ", and the connection" : "", opt.seed);
  }
}

/* ---- reports ------------------------------------------------------------- */

static void
summary_line (struct run *r, const struct lat_stats *ws,
              const struct lat_stats *fs)
{
  double secs = (double) (r->t_last - r->t_start + 1) / 1e9;

  fprintf (stderr, PROGRAM_NAME ": %" PRIu64 " writes in %.2f s: %.0f IOPS, "
           "%.1f MiB/s, p50 %.3f p99 %.3f max %.3f ms",
           ws->n, secs, (double) ws->n / secs,
           (double) ws->n * opt.bs / secs / 1048576.0,
           ws->n ? lat_percentile (&r->wlat, 5000) / 1e6 : 0.0,
           ws->n ? lat_percentile (&r->wlat, 9900) / 1e6 : 0.0,
           ws->max / 1e6);
  if (opt.flush_every)
    fprintf (stderr, "; %" PRIu64 " flushes (1 per %" PRIu64 " writes): "
             "p50 %.3f p99 %.3f max %.3f ms",
             fs->n, opt.flush_every,
             fs->n ? lat_percentile (&r->flat, 5000) / 1e6 : 0.0,
             fs->n ? lat_percentile (&r->flat, 9900) / 1e6 : 0.0,
             fs->max / 1e6);
  else
    fprintf (stderr, "; no flushes");
  fprintf (stderr, " (depth %u, bs %" PRIu32 ", seed %" PRIu64 ")\n",
           opt.depth, opt.bs, opt.seed);
}

static void
json_string (FILE *f, const char *s)
{
  fputc ('"', f);
  for (; *s; s++) {
    unsigned char c = (unsigned char) *s;

    if (c == '"' || c == '\\')
      fprintf (f, "\\%c", c);
    else if (c < 0x20)
      fprintf (f, "\\u%04x", c);
    else
      fputc (c, f);
  }
  fputc ('"', f);
}

/* fio's percentile list, in hundredths. */
static const unsigned percentiles[] = {
  100, 500, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 9500,
  9900, 9950, 9990, 9995, 9999,
};

/* "NAME": {min, max, mean, stddev, N[, percentile]}, as fio's *lat_ns. */
static void
json_lat (FILE *f, const char *name, const struct lat_stats *s,
          const struct lat_log *l, const char *indent)
{
  fprintf (f, "%s\"%s\" : {\n", indent, name);
  fprintf (f, "%s  \"min\" : %" PRIu64 ",\n", indent, s->min);
  fprintf (f, "%s  \"max\" : %" PRIu64 ",\n", indent, s->max);
  fprintf (f, "%s  \"mean\" : %.6f,\n", indent, s->mean);
  fprintf (f, "%s  \"stddev\" : %.6f,\n", indent, s->stddev);
  fprintf (f, "%s  \"N\" : %" PRIu64 "%s\n", indent, s->n, l ? "," : "");
  if (l) {
    fprintf (f, "%s  \"percentile\" : {\n", indent);
    for (size_t i = 0; i < sizeof percentiles / sizeof *percentiles; i++)
      fprintf (f, "%s    \"%u.%02u0000\" : %" PRIu64 "%s\n", indent,
               percentiles[i] / 100, percentiles[i] % 100,
               lat_percentile (l, percentiles[i]),
               i + 1 < sizeof percentiles / sizeof *percentiles ? "," : "");
    fprintf (f, "%s  }\n", indent);
  }
  fprintf (f, "%s}", indent);
}

/* "NAME": a direction as fio's jobs[].read/write/trim; s NULL: all zero. */
static void
json_dir (FILE *f, const char *name, const struct lat_stats *s,
          const struct lat_log *l, uint64_t runtime_ms, double secs)
{
  static const struct lat_stats zero;
  uint64_t n = s ? s->n : 0, bytes = n * opt.bs;
  const struct lat_log *pl = s && s->n ? l : NULL;

  fprintf (f, "      \"%s\" : {\n", name);
  fprintf (f, "        \"io_bytes\" : %" PRIu64 ",\n", bytes);
  fprintf (f, "        \"io_kbytes\" : %" PRIu64 ",\n", bytes >> 10);
  fprintf (f, "        \"bw_bytes\" : %" PRIu64 ",\n",
           s ? (uint64_t) ((double) bytes / secs) : 0);
  fprintf (f, "        \"bw\" : %" PRIu64 ",\n",
           s ? (uint64_t) ((double) bytes / secs / 1024) : 0);
  fprintf (f, "        \"iops\" : %.6f,\n", s ? (double) n / secs : 0.0);
  fprintf (f, "        \"runtime\" : %" PRIu64 ",\n", s ? runtime_ms : 0);
  fprintf (f, "        \"total_ios\" : %" PRIu64 ",\n", n);
  fprintf (f, "        \"short_ios\" : 0,\n");
  fprintf (f, "        \"drop_ios\" : 0,\n");
  json_lat (f, "clat_ns", s ? s : &zero, pl, "        ");
  fprintf (f, ",\n");
  json_lat (f, "lat_ns", s ? s : &zero, pl, "        ");
  fprintf (f, "\n      }");
}

static void
write_json (struct run *r, const struct lat_stats *ws,
            const struct lat_stats *fs)
{
  uint64_t ns = r->t_last - r->t_start;
  uint64_t runtime_ms = (ns + 500000) / 1000000;
  double secs = (double) (ns + 1) / 1e9;    /* never 0 */
  FILE *f = fopen (opt.json, "w");

  if (!f)
    die (1, "%s: %s", opt.json, strerror (errno));
  fprintf (f, "{\n  \"nbd-writes\" : {\n    \"uri\" : ");
  json_string (f, opt.uri);
  fprintf (f, ",\n    \"depth\" : %u,\n", opt.depth);
  fprintf (f, "    \"flush_every\" : %" PRIu64 ",\n", opt.flush_every);
  fprintf (f, "    \"bs\" : %" PRIu32 ",\n", opt.bs);
  fprintf (f, "    \"runtime\" : %g,\n", opt.runtime);
  fprintf (f, "    \"seed\" : %" PRIu64 ",\n", opt.seed);
  fprintf (f, "    \"export_size\" : %" PRIu64 ",\n", r->size);
  fprintf (f, "    \"elapsed_ns\" : %" PRIu64 "\n  },\n", ns);
  fprintf (f, "  \"jobs\" : [\n    {\n");
  fprintf (f, "      \"jobname\" : \"writes-fs\",\n");
  fprintf (f, "      \"error\" : 0,\n");
  fprintf (f, "      \"job_runtime\" : %" PRIu64 ",\n", runtime_ms);
  json_dir (f, "read", NULL, NULL, runtime_ms, secs);
  fprintf (f, ",\n");
  json_dir (f, "write", ws, &r->wlat, runtime_ms, secs);
  fprintf (f, ",\n");
  json_dir (f, "trim", NULL, NULL, runtime_ms, secs);
  fprintf (f, ",\n      \"sync\" : {\n");
  fprintf (f, "        \"total_ios\" : %" PRIu64 ",\n", fs->n);
  json_lat (f, "lat_ns", fs, fs->n ? &r->flat : NULL, "        ");
  fprintf (f, "\n      }\n    }\n  ]\n}\n");
  if (ferror (f) | (fclose (f) != 0))
    die (1, "%s: write error", opt.json);
}

/* ---- main ---------------------------------------------------------------- */

static void
usage (FILE *f)
{
  fprintf (f,
"usage: nbd-writes [options] URI\n"
"  Random writes at a fixed queue depth with one flush (NBD_CMD_FLUSH)\n"
"  after every N writes submitted, as a VM's filesystem does.\n"
"  --depth N        requests in flight, writes and flushes alike (default 16)\n"
"  --flush-every N  a flush after every N writes (default 32; 0: none)\n"
"  --bs BYTES       write size, and the alignment of the offsets (default\n"
"                   4096; K/M suffixes)\n"
"  --runtime SECS   submit writes for this long (default 20)\n"
"  --seed N         random seed (default: from the clock)\n"
"  --json FILE      results as fio --output-format=json shapes them\n"
"  URI              the export, e.g. nbd+unix:///?socket=/tmp/s.sock\n");
}

static void
parse_args (int argc, char **argv)
{
  enum { O_DEPTH = 256, O_FLUSH, O_BS, O_RUNTIME, O_SEED, O_JSON, O_HELP };
  static const struct option longopts[] = {
    { "depth", required_argument, NULL, O_DEPTH },
    { "flush-every", required_argument, NULL, O_FLUSH },
    { "bs", required_argument, NULL, O_BS },
    { "runtime", required_argument, NULL, O_RUNTIME },
    { "seed", required_argument, NULL, O_SEED },
    { "json", required_argument, NULL, O_JSON },
    { "help", no_argument, NULL, O_HELP },
    { NULL, 0, NULL, 0 },
  };
  uint64_t v;
  char *end;
  int c;

  while ((c = getopt_long (argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
    case O_DEPTH:
      v = parse_u64 (optarg, "--depth", false);
      if (v < 1 || v > MAX_DEPTH)
        die (2, "--depth: 1 to %d, not %s", MAX_DEPTH, optarg);
      opt.depth = (unsigned) v;
      break;
    case O_FLUSH:
      opt.flush_every = parse_u64 (optarg, "--flush-every", false);
      break;
    case O_BS:
      v = parse_u64 (optarg, "--bs", true);
      if (v < 1 || v > MAX_BS)
        die (2, "--bs: 1 to %u bytes, not %s", MAX_BS, optarg);
      opt.bs = (uint32_t) v;
      break;
    case O_RUNTIME:
      errno = 0;
      opt.runtime = strtod (optarg, &end);
      if (errno || end == optarg || *end || !(opt.runtime > 0) ||
          opt.runtime > 1e6)
        die (2, "bad --runtime (seconds): %s", optarg);
      break;
    case O_SEED:
      opt.seed = parse_u64 (optarg, "--seed", false);
      opt.seed_given = true;
      break;
    case O_JSON: opt.json = optarg; break;
    case O_HELP: case 'h': usage (stdout); exit (0);
    default: usage (stderr); exit (2);
    }
  }
  if (optind != argc - 1) {
    usage (stderr);
    exit (2);
  }
  opt.uri = argv[optind];
  if (!opt.seed_given) {
    struct timespec ts;

    clock_gettime (CLOCK_REALTIME, &ts);
    opt.seed = (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
    opt.seed ^= (uint64_t) getpid () << 48;
  }
}

int
main (int argc, char **argv)
{
  static struct run r;
  struct lat_stats ws, fs;

  parse_args (argc, argv);
  fprintf (stderr, PROGRAM_NAME ": seed %" PRIu64 "\n", opt.seed);
  connect_export (&r);
  setup (&r);
  run_load (&r);
  if (r.flushes_submitted != (opt.flush_every
                              ? r.writes_submitted / opt.flush_every : 0))
    die (1, "internal error: %" PRIu64 " flushes for %" PRIu64 " writes",
         r.flushes_submitted, r.writes_submitted);
  if (nbd_shutdown (r.nbd, 0) == -1)
    fprintf (stderr, PROGRAM_NAME ": %s: shutdown: %s\n", opt.uri,
             nbd_get_error ());
  nbd_close (r.nbd);

  ws = lat_summarise (&r.wlat);
  fs = lat_summarise (&r.flat);
  summary_line (&r, &ws, &fs);
  if (opt.json)
    write_json (&r, &ws, &fs);
  return 0;
}
