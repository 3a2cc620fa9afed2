/* nbdkit-bcachefilter-filter: the cache's life in the filter (see
 * lifecycle.h). */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

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
static uint64_t export_size;
static bool ctl_running;

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

static int
ctl_stats (FILE *fp, bool json, char *err, size_t errlen)
{
  if (!req) {
    snprintf (err, errlen, "the cache is not open");
    return -1;
  }
  render_stats (fp, json, cache, req);
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

static int
ctl_show_super (FILE *fp, bool json, char *err, size_t errlen)
{
  if (!cache) {
    snprintf (err, errlen, "the cache is not open");
    return -1;
  }
  render_super (fp, json, cache, cfg.path, export_size);
  return 0;
}

static const struct bcf_ctl_ops ctl_ops = {
  .stats = ctl_stats, .set = ctl_set, .trigger_gc = ctl_trigger_gc,
  .show_super = ctl_show_super,
};

int
filter_get_ready (int thread_model)
{
  return probe_cache (&claim, &verdict);
}

/* ---- .after_fork: open the cache -------------------------------------------------- */

int
filter_after_fork (nbdkit_backend *backend)
{
  struct bcf_cache_opts o = { 0 };
  struct bcf_req_opts ro = { 0 };
  char err[512];
  int64_t size;
  const struct bcf_backing *bg = bk_background_open (backend, &size);
  int r;

  if (!bg)
    return -1;
  export_size = (uint64_t) size;

  o.path = cfg.path;
  o.claim = claim;               /* created the file if it was missing */
  o.io_mode = cfg.io_mode;
  o.direct_off = !cfg.direct;
  o.format = cfg.format;
  o.bucket_sectors = (unsigned) (cfg.bucket_size >> 9);
  o.block_sectors = (unsigned) (cfg.block_size >> 9);
  o.backing = *bg;
  memcpy (o.backing_uuid, cfg.uuid, 16);
  /* The label is informational and truncated to its 32 bytes. */
  {
    const char *label = cfg.id_any ? cfg.id_text : "nbdkit export";
    size_t n = strlen (label);
    if (n > sizeof o.backing_label - 1)
      n = sizeof o.backing_label - 1;
    memcpy (o.backing_label, label, n);
  }
  o.node_cache_bytes = (size_t) cfg.node_cache;
  o.journal_delay_ms = cfg.journal_delay_ms;
  o.log = engine_log;

  r = bcf_cache_open (&o, &cache, err, sizeof err);
  if (r < 0) {
    nbdkit_error ("bcachefilter: %s", err);
    if (r == -EEXIST)
      nbdkit_error ("bcachefilter: this cache belongs to another export; "
                    "give the right bcache-backing-uuid=, or "
                    "bcache-format=force to start an empty cache here");
    bk_background_close ();
    return -1;
  }
  ro.mode = cfg.mode;
  ro.sequential_cutoff = (uint64_t) cfg.cutoff;
  ro.error_limit = cfg.error_limit;
  ro.error_halflife = cfg.error_halflife;
  ro.background = bg;
  req = bcf_req_new (cache, &ro);
  if (!req) {
    nbdkit_error ("bcachefilter: out of memory");
    goto fail;
  }
  if (cfg.test_no_tracker) {
    nbdkit_error ("bcachefilter: the in-flight write tracker is disabled "
                  "(bcache-test-disable-tracker): reads may cache stale "
                  "data.  For tests only.");
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
  bk_background_close ();
  return -1;
}

void
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
  bk_background_close ();
  bcf_claim_release (claim);
  claim = NULL;
}

/* ---- connections ------------------------------------------------------------------ */

int
lifecycle_check_export (int64_t size)
{
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
