/* nbdkit-bcachefilter-filter: the cache's life in the filter (see
 * lifecycle.h). */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bcachefilter/bdev.h"
#include "bcachefilter/cache.h"
#include "bcachefilter/claim.h"
#include "bcachefilter/probe.h"
#include "bcachefilter/request.h"
#include "backing.h"
#include "ctl.h"
#include "lifecycle.h"
#include "params.h"
#include "probe.h"
#include "render.h"

static struct bcf_claim *claim;          /* from .get_ready on */
static struct bcf_device_verdict verdict; /* what .get_ready found */
static struct bcf_cache *cache;
struct bcf_req *req;
static uint64_t export_size;            /* the size the cache was opened for */
static bool attached;                   /* ... and it is the export's */
static bool first_seen;                 /* a connection has passed .prepare */
/* The export is a bcache backing device: clients see its data region,
 * from data_offset bytes on (bcachefilter/bdev.h).  Set by the first
 * connection, before the engine is opened for it. */
static struct bcf_bdev *bdev;
static uint64_t data_offset;
static bool ctl_running;
static pthread_mutex_t attach_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_rwlock_t state_lock = PTHREAD_RWLOCK_INITIALIZER;

/* The engine's messages: its warnings and errors are the operator's
 * (nbdkit_error reaches the log, whatever nbdkit did with stderr), its
 * information and detail are debug output (-v). */
static void
engine_log (void *opaque, enum bcf_log_level level, const char *msg)
{
  if (level >= BCF_LOG_WARN)
    nbdkit_error ("bcachefilter: %s", msg);
  else
    nbdkit_debug ("bcachefilter: %s", msg);
}

/* ---- control socket --------------------------------------------------------------- */

/* An operation on the open cache: true with state_lock held for reading
 * (ctl_end releases it), or false, saying why in err. */
static bool
ctl_begin (char *err, size_t errlen)
{
  pthread_rwlock_rdlock (&state_lock);
  if (req)                      /* cache and req are open together */
    return true;
  pthread_rwlock_unlock (&state_lock);
  snprintf (err, errlen, "the cache is not open: the cache of a bcache "
            "backing device is opened at the first client connection, "
            "which can read the device's superblock");
  return false;
}

static void
ctl_end (void)
{
  pthread_rwlock_unlock (&state_lock);
}

static int
render_stats_as (FILE *fp, enum bcf_stats_format f, char *err,
                 size_t errlen)
{
  int r;

  if (!ctl_begin (err, errlen))
    return -1;
  r = render_stats (fp, f, cache, req);
  ctl_end ();
  if (r < 0)
    snprintf (err, errlen, "stats: cannot render them: %m");
  return r;
}

static int
ctl_stats (FILE *fp, bool json, char *err, size_t errlen)
{
  return render_stats_as (fp, json ? BCF_STATS_JSON : BCF_STATS_TEXT, err,
                          errlen);
}

static int
ctl_prometheus (FILE *fp, bool json, char *err, size_t errlen)
{
  return render_stats_as (fp, BCF_STATS_PROMETHEUS, err, errlen);
}

/* bcache's clear_stats: counters and histograms from zero. */
static int
ctl_clear_stats (char *err, size_t errlen)
{
  int r;

  if (!ctl_begin (err, errlen))
    return -1;
  r = bcf_stats_clear_all (cache, req);
  ctl_end ();
  if (r < 0) {
    snprintf (err, errlen, "clear_stats: %s: nothing was cleared",
              strerror (-r));
    return -1;
  }
  nbdkit_debug ("bcachefilter: statistics cleared (clear_stats)");
  return 0;
}

static int update_bdev_state (const struct bcf_backing *b,
                              enum bcf_cache_mode mode);
/* The backing device (bdev) is attached to the open cache. */
static bool bdev_attached;

static bool detach_refuses_mode (char *err, size_t errlen);

static int
set_setting (const char *name, const char *value, char *err, size_t errlen)
{
  if (strcmp (name, "cache_mode") == 0) {
    int m = parse_mode (value, err, errlen);
    if (m < 0 || detach_refuses_mode (err, errlen))
      return -1;
    if (m == BCF_MODE_WRITEBACK && update_bdev_state (bk_background (),
                                                      BCF_MODE_WRITEBACK) < 0) {
      snprintf (err, errlen, "cannot mark the backing device dirty (see "
                "the log): staying in %s", bcf_cache_mode_name (bcf_req_mode (req)));
      return -1;
    }
    if (bcf_req_set_mode (req, (enum bcf_cache_mode) m) < 0)
      return -1;
    nbdkit_debug ("bcachefilter: cache_mode set to %s", value);
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
    nbdkit_debug ("bcachefilter: sequential_cutoff set to %llu", v);
    return 0;
  }
  if (strcmp (name, "sequential_bypass") == 0) {
    int p = bcf_sequential_bypass_parse (value);
    if (p < 0) {
      snprintf (err, errlen, "sequential_bypass '%s': auto or always", value);
      return -1;
    }
    bcf_req_set_sequential_bypass (req, (enum bcf_sequential_bypass) p);
    nbdkit_debug ("bcachefilter: sequential_bypass set to %s", value);
    return 0;
  }
  if (strcmp (name, "congested_read_threshold_us") == 0 ||
      strcmp (name, "congested_write_threshold_us") == 0) {
    struct bcf_cache_stats cs;
    char *end;
    unsigned long v;

    errno = 0;
    v = strtoul (value, &end, 10);
    if (errno || end == value || *end || v > UINT32_MAX) {
      snprintf (err, errlen, "%s '%s': give a number of microseconds "
                "(0 disables)", name, value);
      return -1;
    }
    bcf_cache_stats (cache, &cs);
    if (strcmp (name, "congested_read_threshold_us") == 0)
      cs.congested_read_threshold_us = (unsigned) v;
    else
      cs.congested_write_threshold_us = (unsigned) v;
    bcf_cache_set_congestion (cache, cs.congested_read_threshold_us,
                              cs.congested_write_threshold_us);
    nbdkit_debug ("bcachefilter: %s set to %lu", name, v);
    return 0;
  }
  if (strncmp (name, "writeback_", 10) == 0 ||
      strcmp (name, "copy_gc_enabled") == 0) {
    char *end;
    unsigned long v;
    int r = -EINVAL;

    errno = 0;
    v = strtoul (value, &end, 10);
    if (errno || end == value || *end || v > UINT32_MAX) {
      snprintf (err, errlen, "%s '%s': give a number", name, value);
      return -1;
    }
    if (strcmp (name, "writeback_percent") == 0)
      r = bcf_req_set_writeback_percent (req, (unsigned) v);
    else if (strcmp (name, "writeback_delay") == 0)
      r = bcf_req_set_writeback_delay (req, (unsigned) v);
    else if (strcmp (name, "writeback_running") == 0 && v <= 1)
      r = bcf_req_set_writeback_running (req, v == 1);
    else if (strcmp (name, "writeback_rate_update_seconds") == 0)
      r = bcf_req_set_writeback_update_seconds (req, (unsigned) v);
    else if (strcmp (name, "copy_gc_enabled") == 0 && v <= 1)
      r = bcf_req_set_copy_gc (req, v == 1);
    else if (strcmp (name, "writeback_running") == 0 ||
             strcmp (name, "copy_gc_enabled") == 0) {
      snprintf (err, errlen, "%s %s: give 0 or 1", name, value);
      return -1;
    }
    else {
      snprintf (err, errlen, "unknown setting '%s'", name);
      return -1;
    }
    if (r == -ENOTSUP)
      snprintf (err, errlen, "%s: this filter runs no writeback thread",
                name);
    else if (r < 0)
      snprintf (err, errlen, "%s %s: out of range (writeback_percent 0-100, "
                "writeback_running 0 or 1, writeback_rate_update_seconds "
                "1-60)", name, value);
    else
      nbdkit_debug ("bcachefilter: %s set to %lu", name, v);
    return r < 0 ? -1 : 0;
  }
  snprintf (err, errlen, "unknown setting '%s'; settable: cache_mode, "
            "sequential_cutoff, sequential_bypass, "
            "congested_read_threshold_us, congested_write_threshold_us, "
            "writeback_percent, writeback_delay, writeback_running, "
            "writeback_rate_update_seconds, copy_gc_enabled", name);
  return -1;
}

static int
ctl_set (const char *name, const char *value, char *err, size_t errlen)
{
  int r;

  if (!ctl_begin (err, errlen))
    return -1;
  r = set_setting (name, value, err, errlen);
  ctl_end ();
  return r;
}

static int
ctl_trigger_gc (char *err, size_t errlen)
{
  if (!ctl_begin (err, errlen))
    return -1;
  bcf_trigger_gc (cache);
  ctl_end ();
  return 0;
}

/* Start writing back everything at full speed (bcachefilter-ctl flush
 * waits for dirty_data to reach 0 through the stats: the serving thread
 * never waits for the export). */
static int
ctl_writeback_flush (char *err, size_t errlen)
{
  int r;

  if (!ctl_begin (err, errlen))
    return -1;
  r = bcf_req_writeback_hurry (req);
  ctl_end ();
  if (r < 0) {
    snprintf (err, errlen, "this filter runs no writeback thread");
    return -1;
  }
  return 0;
}

static int
ctl_show_super (FILE *fp, bool json, char *err, size_t errlen)
{
  if (!ctl_begin (err, errlen))
    return -1;
  render_super (fp, json, cache, cfg.path, export_size);
  ctl_end ();
  return 0;
}

/* ---- detach (bcachefilter-ctl detach; lifecycle.h) ------------------------------- */

/* The detach runs on a thread of its own, which waits for the export;
 * the control socket only starts it and reads how it stands (detach and
 * detach_status), so its serving thread never waits.  detach_lock
 * guards the state below; the thread holds state_lock for reading while
 * it uses the cache (as the socket's operations do), and .cleanup stops
 * and joins it before closing the cache. */
enum detach_phase { DETACH_IDLE, DETACH_RUNNING, DETACH_DONE, DETACH_FAILED };
static pthread_mutex_t detach_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t detach_thread;
static bool detach_joinable;
static enum detach_phase detach_phase;
static char detach_msg[1024];
static atomic_bool detach_stop;         /* .cleanup: stop draining */

/* The thread's result: the phase and the line detach_status shows (also
 * in the debug log). */
static void __attribute__ ((format (printf, 2, 3)))
detach_end (enum detach_phase phase, const char *fs, ...)
{
  va_list args;

  pthread_mutex_lock (&detach_lock);
  va_start (args, fs);
  vsnprintf (detach_msg, sizeof detach_msg, fs, args);
  va_end (args);
  detach_phase = phase;
  nbdkit_debug ("bcachefilter: %s", detach_msg);
  pthread_mutex_unlock (&detach_lock);
}

/* A mode change while a detach runs or after it would undo what the
 * detach decided (a switch to writeback marks a backing device dirty).
 * True, with the reason in err, if that is now. */
static bool
detach_refuses_mode (char *err, size_t errlen)
{
  enum detach_phase p;

  pthread_mutex_lock (&detach_lock);
  p = detach_phase;
  pthread_mutex_unlock (&detach_lock);
  if (p == DETACH_RUNNING)
    snprintf (err, errlen, "a detach is under way (bcachefilter-ctl "
              "detach_status): the mode cannot change now");
  else if (p == DETACH_DONE)
    snprintf (err, errlen, "the cache is detached from its export: it "
              "passes everything through until nbdkit stops");
  return p == DETACH_RUNNING || p == DETACH_DONE;
}

static bool
detach_go_on (void *opaque, uint64_t dirty)
{
  return !atomic_load (&detach_stop);
}

/* Between the drain and the cache's mark: a backing device is detached
 * from this cache set on its own superblock, as the kernel's detach does
 * (bcf_bdev_detach), so that it can be attached elsewhere.  0, or -1 with
 * the reason in err. */
static int
detach_backing_device (char *err, size_t errlen)
{
  char why[512];

  if (!bdev || !bdev_attached)
    return 0;
  if (bcf_bdev_detach (bdev, bk_background (),
                       bcf_cache_super (cache)->set_uuid, why,
                       sizeof why) < 0) {
    snprintf (err, errlen, "%s", why);
    return -1;
  }
  bdev_attached = false;
  return 0;
}

/* What the backing device's superblock says now, for the final line. */
static void
describe_backing_device (char *buf, size_t len)
{
  char dev[37];
  struct bch_sb sb;

  buf[0] = '\0';
  if (!bdev)
    return;
  bcf_bdev_super (bdev, &sb);
  bch_uuid_unparse (sb.uuid, dev);
  snprintf (buf, len, "; bcache backing device %s is detached from this "
            "cache set (its superblock: no cache set, state %s), so it can "
            "be attached to another", dev,
            bch_bdev_state_name (bch_bdev_state (&sb)));
}

/* The thread: drain (write back everything, make no new dirty data),
 * detach a backing device, mark the cache and pass through.  Anything
 * that fails before the mark leaves everything as it was. */
static void *
detach_main (void *arg)
{
  char err[512], bd[256];
  uint64_t dirty;
  const char *mode;
  int r;

  pthread_rwlock_rdlock (&state_lock);
  r = bcf_req_detach_drain (req, bk_background (), detach_go_on, NULL);
  dirty = bcf_cache_dirty_bytes (cache);
  mode = bcf_cache_mode_name (bcf_req_mode (req));
  if (r < 0)
    detach_end (DETACH_FAILED, "detach failed: %s%s%s; nothing was "
                "changed: %" PRIu64 " bytes of dirty data stay in the "
                "cache, which goes on serving in %s mode%s",
                r == -ECANCELED ? "nbdkit is stopping"
                : "writing the dirty data back to the export failed (",
                r == -ECANCELED ? "" : strerror (-r),
                r == -ECANCELED ? "" : ")", dirty, mode,
                r == -ECANCELED ? "" : ".  Run detach again once the "
                "export takes writes");
  else if (detach_backing_device (err, sizeof err) < 0) {
    bcf_req_detach_cancel (req);
    detach_end (DETACH_FAILED, "detach failed: the dirty data is written "
                "back, but the backing device's superblock could not be "
                "updated: %s; nothing else was changed: the cache goes on "
                "serving in %s mode", err, mode);
  }
  else if ((r = bcf_req_detach_finish (req)) == -EBUSY) {
    bcf_req_detach_cancel (req);
    detach_end (DETACH_FAILED, "detach failed: dirty data appeared after "
                "the writeback (%" PRIu64 " bytes); the cache goes on "
                "serving in %s mode", dirty, mode);
  }
  else if (r < 0)
    detach_end (DETACH_FAILED, "detach failed: the export has all the "
                "data, but the cache could not be marked detached (%s): it "
                "is given up instead, as after device errors, and passes "
                "everything through (see the log)", strerror (-r));
  else {
    describe_backing_device (bd, sizeof bd);
    detach_end (DETACH_DONE, "detached: all dirty data is written back to "
                "the export; the cache passes everything through until "
                "nbdkit stops, and its next start begins with nothing "
                "cached for this export%s", bd);
  }
  pthread_rwlock_unlock (&state_lock);
  bcf_release_memory ();        /* this thread's ring */
  return NULL;
}

/* bcachefilter-ctl detach: start the thread, or let the caller follow
 * the one under way or done (detach_status says which). */
static int
ctl_detach (char *err, size_t errlen)
{
  int r = 0;

  if (!ctl_begin (err, errlen))
    return -1;
  pthread_mutex_lock (&detach_lock);
  if (detach_phase == DETACH_RUNNING || detach_phase == DETACH_DONE)
    goto out;
  if (!attached) {
    snprintf (err, errlen, "the cache holds no export yet (a new cache is "
              "attached to its export at the first client connection): "
              "there is nothing to detach");
    r = -1;
    goto out;
  }
  if (detach_joinable)          /* a failed attempt: it has ended */
    pthread_join (detach_thread, NULL);
  detach_joinable = false;
  detach_phase = DETACH_RUNNING;
  snprintf (detach_msg, sizeof detach_msg, "writing the dirty data back");
  r = pthread_create (&detach_thread, NULL, detach_main, NULL);
  if (r != 0) {
    detach_phase = DETACH_FAILED;
    snprintf (err, errlen, "cannot start the detach: %s", strerror (r));
    r = -1;
    goto out;
  }
  detach_joinable = true;
 out:
  pthread_mutex_unlock (&detach_lock);
  ctl_end ();
  return r;
}

static int
ctl_detach_status (FILE *fp, bool json, char *err, size_t errlen)
{
  static const char *const names[] = {
    [DETACH_IDLE] = "none", [DETACH_RUNNING] = "draining",
    [DETACH_DONE] = "detached", [DETACH_FAILED] = "failed",
  };

  pthread_mutex_lock (&detach_lock);
  fprintf (fp, "%s%s%s\n", names[detach_phase],
           detach_phase == DETACH_IDLE ? "" : " ", detach_msg);
  pthread_mutex_unlock (&detach_lock);
  return 0;
}

/* .cleanup: a drain under way stops (nothing changes), then the thread
 * is joined, before the cache it uses is closed. */
static void
stop_detach (void)
{
  atomic_store (&detach_stop, true);
  if (detach_joinable)
    pthread_join (detach_thread, NULL);
  detach_joinable = false;
}

static const struct bcf_ctl_ops ctl_ops = {
  .stats = ctl_stats, .set = ctl_set, .trigger_gc = ctl_trigger_gc,
  .writeback_flush = ctl_writeback_flush,
  .show_super = ctl_show_super,
  .prometheus = ctl_prometheus, .clear_stats = ctl_clear_stats,
  .detach = ctl_detach, .detach_status = ctl_detach_status,
};

/* ---- .get_ready ------------------------------------------------------------------- */

int
filter_get_ready (int thread_model)
{
  bk_set_thread_model (thread_model);
  return probe_cache (&claim, &verdict);
}

/* ---- opening the engine ----------------------------------------------------------- */

/* The backing store handed to bcf_cache_open: only .size is called, and
 * it answers the size the cache is opened for (lifecycle.h). */
static int64_t
open_size_fn (void *opaque)
{
  return (int64_t) *(const uint64_t *) opaque;
}

static const struct bcf_backing_ops open_ops = { .size = open_size_fn };

/* The settings the request layer starts with. */
struct req_settings {
  enum bcf_cache_mode mode;
  uint64_t cutoff;
  enum bcf_sequential_bypass seq_bypass;
  unsigned congested_read_us, congested_write_us;
  /* The writeback knobs of a request layer being replaced, as the
   * control socket may have changed them (wb_set: it ran a writeback
   * thread); else the parameters' go in through bcf_req_opts.  They are
   * applied just after the new thread starts, before any client request:
   * a thread that wakes before them (a backing device's cache can hold
   * dirty data) starts at most one batch as the parameters say, as if
   * the setting had come a moment later. */
  bool wb_set;
  unsigned wb_percent, wb_delay, wb_update_seconds;
  bool wb_running, copy_gc;
};

/* The settings as the parameters give them, before any change at run
 * time through the control socket. */
static struct req_settings
configured_settings (void)
{
  return (struct req_settings) {
    .mode = cfg.mode, .cutoff = (uint64_t) cfg.cutoff,
    .seq_bypass = cfg.seq_bypass,
    .congested_read_us = cfg.congested_read_us,
    .congested_write_us = cfg.congested_write_us,
  };
}

/* The settings of the open request layer r, as the control socket may
 * have changed them. */
static struct req_settings
current_settings (struct bcf_req *r)
{
  struct req_settings s = configured_settings ();
  struct bcf_cache_stats cs;
  struct bcf_req_stats st;

  bcf_cache_stats (cache, &cs);
  bcf_req_get_stats (r, &st);
  s.mode = bcf_req_mode (r);
  s.cutoff = bcf_req_sequential_cutoff (r);
  s.seq_bypass = bcf_req_sequential_bypass (r);
  s.congested_read_us = cs.congested_read_threshold_us;
  s.congested_write_us = cs.congested_write_threshold_us;
  s.wb_set = st.writeback_update_seconds != 0;     /* a writeback thread */
  s.wb_percent = st.writeback_percent;
  s.wb_delay = st.writeback_delay;
  s.wb_update_seconds = st.writeback_update_seconds;
  s.wb_running = st.writeback_running;
  s.copy_gc = st.copy_gc_enabled;
  return s;
}

/* Give the new request layer the writeback knobs s carries. */
static int
apply_writeback_settings (struct bcf_req *r, const struct req_settings *s)
{
  if (!s->wb_set)
    return 0;
  if (bcf_req_set_writeback_percent (r, s->wb_percent) < 0 ||
      bcf_req_set_writeback_delay (r, s->wb_delay) < 0 ||
      bcf_req_set_writeback_update_seconds (r, s->wb_update_seconds) < 0 ||
      bcf_req_set_writeback_running (r, s->wb_running) < 0 ||
      bcf_req_set_copy_gc (r, s->copy_gc) < 0)
    return -1;
  return 0;
}

/* Open the cache for an export of size bytes whose identity is uuid
 * (zero: none yet; ignored for a backing device, bdev), and its request
 * layer and threads.  0, or -1 after nbdkit_error, with cache and req
 * NULL. */
static int
open_engine (const uint8_t uuid[16], uint64_t size,
             enum bcf_format_policy format, const struct req_settings *s)
{
  struct bcf_cache_opts o = { 0 };
  struct bcf_req_opts ro = { 0 };
  const char *label = cfg.id_any ? cfg.id_text : "nbdkit export";
  char err[512];
  int r;

  o.path = cfg.path;
  o.claim = claim;               /* created the file if it was missing */
  o.io_mode = cfg.io_mode;
  o.direct_off = !cfg.direct;
  o.format = format;
  o.discard_dirty = cfg.discard_dirty;
  o.bucket_sectors = probe_format_bucket_sectors (verdict.size);
  o.block_sectors = (unsigned) (cfg.block_size >> 9);
  o.min_buckets = BCH_KERNEL_MIN_NBUCKETS;
  o.backing = (struct bcf_backing) { .ops = &open_ops, .opaque = &size };
  memcpy (o.backing_uuid, uuid, 16);
  /* The label is informational and truncated to its 32 bytes. */
  memcpy (o.backing_label, label,
          strnlen (label, sizeof o.backing_label - 1));
  o.node_cache_bytes = (size_t) cfg.node_cache;
  o.journal_delay_ms = cfg.journal_delay_ms;
  o.write_intent_off = !cfg.write_intent;
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
    return -1;
  }
  ro.mode = s->mode;
  ro.offset = data_offset;
  ro.sequential_cutoff = s->cutoff;
  ro.sequential_bypass = s->seq_bypass;
  bcf_cache_set_congestion (cache, s->congested_read_us,
                            s->congested_write_us);
  ro.error_limit = cfg.error_limit;
  ro.error_halflife = cfg.error_halflife;
  ro.writeback_percent = cfg.writeback_percent;
  ro.writeback_delay = cfg.writeback_delay;
  ro.copy_gc_off = !cfg.copy_gc;
  ro.sync_writes = cfg.sync_writes;
  ro.background = bk_background ();
  /* The checkpoint's export barrier flushes through the background
   * connection (bcf_cache_set_export), which outlives the cache. */
  bcf_cache_set_export (cache, bk_background ());
  req = bcf_req_new (cache, &ro);
  if (!req) {
    nbdkit_error ("bcachefilter: out of memory");
    goto fail;
  }
  if (cfg.test_no_tracker)
    bcf_req_test_disable_tracker (req, true);
  if (apply_writeback_settings (req, s) < 0) {
    nbdkit_error ("bcachefilter: the writeback settings made through the "
                  "control socket could not be kept");
    goto fail;
  }
  if ((r = bcf_cache_start_threads (cache)) < 0) {
    nbdkit_error ("bcachefilter: starting the cache threads: %s",
                  strerror (-r));
    goto fail;
  }
  export_size = size;
  return 0;

 fail:
  bcf_req_free (req);
  req = NULL;
  bcf_cache_close (cache);
  cache = NULL;
  return -1;
}

/* Close the request layer and the cache (a checkpoint). */
static void
close_engine (void)
{
  /* A backing device that nothing dirty is left for is clean again
   * (the writeback thread may have drained it). */
  if (req && bcf_req_mode (req) != BCF_MODE_WRITEBACK)
    update_bdev_state (bk_background (), bcf_req_mode (req));
  bdev_attached = false;
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
}

/* The export's size, as the cache recorded it: known for a cache that
 * holds this export (the probe in .get_ready checked the uuid), not for
 * a new cache or one about to be formatted, nor for the cache of a bcache
 * backing device (its entry records no size, as the kernel's do). */
static bool
recorded_size (uint64_t *size)
{
  if (cfg.format == BCF_FORMAT_FORCE || verdict.kind != BCF_DEVICE_CACHE ||
      !verdict.has_owner || verdict.owner_bytes == 0)
    return false;
  *size = verdict.owner_bytes;
  return true;
}

/* A cache that holds an export whose identity only the export can tell:
 * a backing device's entry (no size), whose uuid is in the device's
 * superblock.  Opened at the first connection only (not without an
 * export in .after_fork, as a new cache is: its slot is someone's). */
static bool
owner_unknown (void)
{
  return cfg.format != BCF_FORMAT_FORCE && verdict.kind == BCF_DEVICE_CACHE &&
         verdict.has_owner && verdict.owner_bytes == 0;
}



/* ---- .after_fork ------------------------------------------------------------------ */

int
filter_after_fork (nbdkit_backend *backend)
{
  static const uint8_t no_export[16];
  const struct req_settings s = configured_settings ();
  uint64_t size = 0;
  char err[512];

  bk_background_init (backend);
  attached = recorded_size (&size);
  if (owner_unknown ())
    nbdkit_debug ("bcachefilter: cache %s holds a bcache backing device's "
                  "data: opened at the first connection, which can read "
                  "the export's superblock", cfg.path);
  else if (open_engine (attached ? cfg.uuid : no_export, size, cfg.format,
                        &s) < 0)
    return -1;
  if (cfg.test_no_tracker)
    nbdkit_error ("bcachefilter: the in-flight write tracker is disabled "
                  "(bcache-test-disable-tracker): reads may cache stale "
                  "data.  For tests only.");
  if (cfg.ctl_path) {
    if (bcf_ctl_start (cfg.ctl_path, &ctl_ops, err, sizeof err) < 0) {
      nbdkit_error ("bcache-ctl=%s: %s", cfg.ctl_path, err);
      close_engine ();
      return -1;
    }
    ctl_running = true;
  }
  if (cache)
    nbdkit_debug ("bcachefilter: cache %s open (%s%s), %s, mode %s",
                  cfg.path, bcf_cache_io_name (cache),
                  bcf_cache_io_direct (cache) ? ", O_DIRECT" : "",
                  attached ? "for the export it holds"
                  : "attached to its export at the first connection",
                  bcf_cache_mode_name (cfg.mode));
  return 0;
}

/* ---- connections ------------------------------------------------------------------ */

/* Is the export a bcache backing device (with bcache-backing-device=
 * auto)?  Then clients see its data region (data_offset), and its
 * superblock's uuid is the export's identity: bcache-backing-uuid=, if
 * given, must agree.  0 (bdev set if it is one), or -1 after
 * nbdkit_error. */
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

/* The state a bcache backing device's superblock must show, as the
 * kernel keeps it (research/bcache.md §2.5): dirty before a dirty write
 * to its cache can be acknowledged, so that nothing uses the device
 * without this cache while the cache holds its newest data; clean once
 * nothing is dirty.  Here: dirty in writeback mode and while dirty data
 * exists, set before the mode switches to writeback (set_setting) and
 * at attach; clean at attach and at close when nothing is dirty and the
 * mode is not writeback.  (Dirty keys a writethrough crash leaves belong
 * to writes that were never acknowledged: the device alone may serve its
 * older data.)  0, or -1 after nbdkit_error. */
static int
update_bdev_state (const struct bcf_backing *b, enum bcf_cache_mode mode)
{
  enum bch_bdev_state want;
  char err[512];

  if (!bdev || !cache || !bdev_attached)
    return 0;
  want = mode == BCF_MODE_WRITEBACK || bcf_cache_dirty_bytes (cache) > 0
         ? BCH_BDEV_STATE_DIRTY : BCH_BDEV_STATE_CLEAN;
  if (bcf_bdev_set_state (bdev, b, want, err, sizeof err) < 0) {
    nbdkit_error ("bcachefilter: marking the backing device %s: %s",
                  bch_bdev_state_name (want), err);
    return -1;
  }
  return 0;
}

/* After the cache is open for a backing device: mark the device attached
 * to it, as the kernel's attach does (its superblock then names this
 * cache set).  0, or -1 after nbdkit_error. */
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
  /* Dirty for this set (a kernel's writeback cache, or ours): the dirty
   * data is in this cache, served as the newest and written back. */
  if (bcf_bdev_relation (&sb, set) == BCF_BDEV_OTHER_CLEAN)
    nbdkit_error ("bcachefilter: backing device %s was attached to cache "
                  "set %s; it is now attached to this cache (set %s), and "
                  "the copy of its data in set %s is out of date: do not "
                  "attach it there again without detaching it there first",
                  dev, was, now, was);
  if (bcf_bdev_attach (bdev, b, set, err, sizeof err) < 0) {
    nbdkit_error ("bcachefilter: attaching backing device %s to cache set "
                  "%s: %s", dev, now, err);
    return -1;
  }
  bdev_attached = true;
  return update_bdev_state (b, bcf_req_mode (req)) < 0 ? -1 : 0;
}

/* The first connection: unless the cache was opened for the export it
 * holds, learn from the export what only it can tell (lifecycle.h) and
 * open the cache again for it, keeping what the control socket set
 * meanwhile.  On failure the server is shut down, as an open failure in
 * .after_fork would have stopped it. */
static int
first_connection (const struct bcf_backing *b, uint64_t size)
{
  int r;

  /* A cache that recorded its export's size holds a plain export (a
   * backing device's entry never records one): it is served as it was,
   * whole, whatever the export begins with, and not read here. */
  if (attached)
    return 0;                   /* opened in .after_fork for this export */
  r = probe_backing_device (b);
  if (r == 0) {
    struct req_settings s;

    pthread_rwlock_wrlock (&state_lock);
    s = req ? current_settings (req) : configured_settings ();
    close_engine ();
    r = open_engine (cfg.uuid, size, BCF_FORMAT_NEVER, &s);
    if (r == 0 && bdev && attach_backing_device (b) < 0) {
      close_engine ();
      r = -1;
    }
    attached = r == 0;
    pthread_rwlock_unlock (&state_lock);
  }
  if (r < 0) {
    nbdkit_error ("bcachefilter: the cache could not be attached to the "
                  "export; shutting down");
    nbdkit_shutdown ();
    return -1;
  }
  nbdkit_debug ("bcachefilter: cache %s attached to the export (%" PRIu64
                " bytes%s)", cfg.path, size,
                bdev ? ", a bcache backing device" : "");
  return 0;
}

int
lifecycle_check_export (nbdkit_next *next)
{
  int64_t size = bk_next_get_size (next);
  int r = 0;

  if (size == -1)
    return -1;
  pthread_mutex_lock (&attach_lock);
  if (!first_seen) {
    struct bk k;
    struct bcf_backing b;

    bk_init (&k, &b, next, 0);
    r = first_connection (&b, (uint64_t) size);
    first_seen = true;
  }
  pthread_mutex_unlock (&attach_lock);
  if (r < 0)
    return -1;
  if (!req) {
    nbdkit_error ("bcachefilter: the cache is not open");
    return -1;
  }
  if ((uint64_t) size != export_size) {
    nbdkit_error ("bcachefilter: this export has %" PRIi64 " bytes but the "
                  "cache holds an export of %" PRIu64 " bytes (one cache "
                  "serves one export); if the export was resized, start "
                  "with bcache-format=force for an empty cache", size,
                  export_size);
    return -1;
  }
  return 0;
}

uint64_t
lifecycle_data_offset (void)
{
  return data_offset;
}

/* ---- .cleanup --------------------------------------------------------------------- */

void
filter_cleanup (nbdkit_backend *backend)
{
  if (ctl_running) {
    bcf_ctl_stop ();
    ctl_running = false;
  }
  stop_detach ();               /* no new one: the socket is closed */
  close_engine ();
  bcf_bdev_free (bdev);         /* the cache, which used it, is closed */
  bdev = NULL;
  bk_background_close ();       /* after the writeback thread stopped */
  bcf_claim_release (claim);
  claim = NULL;
}
