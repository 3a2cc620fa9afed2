/* nbdkit-bcachefilter-filter: the filter's parameters (see params.h). */
#include "config.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bcachefilter/format.h"
#include "ctl.h"
#include "params.h"

#define DEFAULT_CUTOFF (4u << 20)

struct filter_config cfg = {
  .format = BCF_FORMAT_AUTO,
  .mode = BCF_MODE_WRITETHROUGH,
  .cutoff = DEFAULT_CUTOFF,
  .seq_bypass = BCF_SEQUENTIAL_BYPASS_AUTO,
  .congested_read_us = 2000,            /* bcache's defaults */
  .congested_write_us = 20000,
  .direct = true,
  .bdev_auto = true,
  .write_intent = true,
  .copy_gc = true,
  .sync_writes = BCF_SYNC_WRITES_ALL,
};

/* The plugin's parameters that name the export, hashed in order into the
 * default identity (FNV-1a, two 64-bit lanes with different offset bases). */
static const char *const identity_keys[] = {
  "uri", "socket", "hostname", "host", "port", "vsock", "export",
  "exportname", "file", "dir", "command", "server", "url", "disk",
  NULL,
};
static uint64_t id_hash[2] = { 0xcbf29ce484222325ull, 0x84222325cbf29ce4ull };

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

int
parse_mode (const char *value, char *err, size_t errlen)
{
  int m = bcf_cache_mode_parse (value);

  if (m < 0)
    snprintf (err, errlen, "unknown mode '%s': use writethrough (cache "
              "reads and writes, writes reach the export before they "
              "complete), writeback (writes complete in the cache and "
              "reach the export later), writearound (cache reads only) "
              "or none", value);
  return m;
}

/* ---- .config ---------------------------------------------------------------------- */

/* nbdkit changes directory to / when it forks into the background, after
 * .get_ready: the control socket is made and a cache may be opened after
 * that, so relative paths are made absolute here (nbdkit_absolute_path),
 * and freed at .unload. */
static char *path_buf, *ctl_path_buf;

static int
set_path (char **buf, const char *value)
{
  char *abs = nbdkit_absolute_path (value);

  if (!abs)
    return -1;                  /* nbdkit_absolute_path said why */
  free (*buf);
  *buf = abs;
  return 0;
}

int
filter_config (nbdkit_next_config *next, nbdkit_backend *nxdata,
               const char *key, const char *value)
{
  if (strncmp (key, "bcache", 6) != 0) {
    if (is_identity_key (key)) {
      hash_bytes (key);
      hash_bytes ("=");
      hash_bytes (value);
      hash_bytes ("\n");
      if (!cfg.id_any)
        snprintf (cfg.id_text, sizeof cfg.id_text, "%s=%s", key, value);
      cfg.id_any = true;
    }
    return next (nxdata, key, value);
  }

  if (strcmp (key, "bcache") == 0) {
    if (!*value) {
      nbdkit_error ("bcache=: give the path of the cache device or file");
      return -1;
    }
    if (set_path (&path_buf, value) < 0)
      return -1;
    cfg.path = path_buf;
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
    else if (strcmp (value, "force-discard-dirty") == 0) {
      cfg.format = BCF_FORMAT_FORCE;
      cfg.discard_dirty = true;
    }
    else {
      nbdkit_error ("bcache-format=%s: use auto (format a blank device or "
                    "one made by make-bcache -C), never (open an existing "
                    "cache only), force (destroy what is there, unless it is "
                    "a cache holding dirty data) or force-discard-dirty "
                    "(destroy it even then)", value);
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
  else if (strcmp (key, "bcache-sequential-bypass") == 0) {
    int p = bcf_sequential_bypass_parse (value);
    if (p < 0) {
      nbdkit_error ("bcache-sequential-bypass=%s: use auto (bypass long "
                    "streams only while the export is no slower than the "
                    "cache) or always (bcache's rule)", value);
      return -1;
    }
    cfg.seq_bypass = (enum bcf_sequential_bypass) p;
  }
  else if (strcmp (key, "bcache-congested-read-threshold-us") == 0)
    return nbdkit_parse_unsigned (key, value, &cfg.congested_read_us);
  else if (strcmp (key, "bcache-congested-write-threshold-us") == 0)
    return nbdkit_parse_unsigned (key, value, &cfg.congested_write_us);
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
    if (set_path (&ctl_path_buf, value) < 0)
      return -1;
    cfg.ctl_path = ctl_path_buf;
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
  else if (strcmp (key, "bcache-write-intent") == 0)
    return parse_bool_param (key, value, &cfg.write_intent);
  else if (strcmp (key, "bcache-copy-gc") == 0)
    return parse_bool_param (key, value, &cfg.copy_gc);
  else if (strcmp (key, "bcache-error-limit") == 0) {
    if (nbdkit_parse_unsigned (key, value, &cfg.error_limit) == -1)
      return -1;
    if (cfg.error_limit == 0) {
      nbdkit_error ("bcache-error-limit=0: must be at least 1");
      return -1;
    }
  }
  else if (strcmp (key, "bcache-writeback-percent") == 0) {
    unsigned v;
    if (nbdkit_parse_unsigned (key, value, &v) == -1)
      return -1;
    if (v > 100) {
      nbdkit_error ("bcache-writeback-percent=%s: a percentage of the "
                    "cache, 0 to 100", value);
      return -1;
    }
    cfg.writeback_percent = v ? v : BCF_WRITEBACK_PERCENT_ZERO;
  }
  else if (strcmp (key, "bcache-sync-writes") == 0) {
    if (strcmp (value, "all") == 0)
      cfg.sync_writes = BCF_SYNC_WRITES_ALL;
    else if (strcmp (value, "fua") == 0)
      cfg.sync_writes = BCF_SYNC_WRITES_FUA;
    else {
      nbdkit_error ("bcache-sync-writes=%s: use all (every write may be "
                    "written back up to 70 %% of the cache in use) or fua "
                    "(only FUA writes; the others up to 40 %%, as bcache "
                    "treats writes that are not REQ_SYNC)", value);
      return -1;
    }
  }
  else if (strcmp (key, "bcache-writeback-delay") == 0) {
    unsigned v;
    if (nbdkit_parse_unsigned (key, value, &v) == -1)
      return -1;
    cfg.writeback_delay = v ? v : BCF_WRITEBACK_DELAY_ZERO;
  }
  else if (strcmp (key, "bcache-error-halflife") == 0) {
    if (nbdkit_parse_uint64_t (key, value, &cfg.error_halflife) == -1)
      return -1;
    if (cfg.error_halflife == 0)          /* bcache's 0: no decay */
      cfg.error_halflife = BCF_ERROR_HALFLIFE_NEVER;
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

int
filter_config_complete (nbdkit_next_config_complete *next,
                        nbdkit_backend *nxdata)
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

/* ---- the filter's own version ------------------------------------------------------- */

/* Was nbdkit started with this option (an argument of its own)? */
static bool
started_with (const char *opt1, const char *opt2)
{
  char buf[16384];
  FILE *f = fopen ("/proc/self/cmdline", "re");
  size_t n = f ? fread (buf, 1, sizeof buf - 1, f) : 0;
  bool found = false;

  if (f)
    fclose (f);
  buf[n] = '\0';
  for (size_t i = 0; i < n && !found; i += strlen (buf + i) + 1)
    found = strcmp (buf + i, opt1) == 0 || (opt2 && strcmp (buf + i, opt2) == 0);
  return found;
}

static void
print_version_line (void)
{
  printf ("nbdkit-bcachefilter-filter %s\n", PACKAGE_VERSION);
}

static void
print_version_field (void)
{
  printf ("bcachefilter_version=%s\n", PACKAGE_VERSION);
}

/* nbdkit --version prints each filter's _version, which must be the
 * version of nbdkit the filter was built for (nbdkit refuses to load it
 * otherwise), and --dump-plugin only the plugin's fields; --dump-config
 * loads no filter at all.  So when nbdkit was started to print versions,
 * the filter adds its own line after nbdkit's (at exit).  Otherwise it
 * only says its version in the debug output. */
void
filter_unload (void)
{
  free (path_buf);
  free (ctl_path_buf);
  path_buf = ctl_path_buf = NULL;
}

void
filter_load (void)
{
  if (started_with ("--version", "-V"))
    atexit (print_version_line);
  else if (started_with ("--dump-plugin", NULL))
    atexit (print_version_field);
  else
    nbdkit_debug ("bcachefilter %s", PACKAGE_VERSION);
}

