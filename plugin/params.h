/* nbdkit-bcachefilter-filter: the filter's parameters (params.c).
 *
 * Every bcache-* parameter is parsed and checked once, in .config and
 * .config_complete, into cfg; the other files only read it.  The
 * plugin's parameters pass through, and those that name the export
 * (uri, socket, file, ...) are hashed into the export's default
 * identity (cfg.uuid), which is what the cache records.
 *
 * Locking: cfg is written only before nbdkit starts serving, read
 * without a lock afterwards.
 */
#ifndef BCACHEFILTER_PLUGIN_PARAMS_H
#define BCACHEFILTER_PLUGIN_PARAMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/request.h"

struct filter_config {
  const char *path;                     /* bcache= */
  int64_t create_size;                  /* bcache-size= */
  enum bcf_format_policy format;        /* bcache-format= */
  bool discard_dirty;                   /* ... =force-discard-dirty */
  enum bcf_cache_mode mode;             /* bcache-mode= */
  int64_t bucket_size, block_size;      /* bytes; 0 = default */
  int64_t cutoff;                       /* bcache-sequential-cutoff= */
  enum bcf_sequential_bypass seq_bypass;  /* bcache-sequential-bypass= */
  unsigned congested_read_us;           /* bcache-congested-read-... */
  unsigned congested_write_us;          /* bcache-congested-write-... */
  bool have_uuid;
  uint8_t uuid[16];                     /* bcache-backing-uuid=, or derived */
  bool bdev_auto;                       /* bcache-backing-device=auto */
  enum bcf_io_mode io_mode;             /* bcache-io= */
  bool direct;                          /* bcache-direct= */
  const char *ctl_path;                 /* bcache-ctl= */
  int64_t node_cache;                   /* bcache-node-cache= */
  unsigned journal_delay_ms;            /* bcache-journal-delay= */
  bool write_intent;                    /* bcache-write-intent= */
  bool copy_gc;                         /* bcache-copy-gc= */
  unsigned error_limit;                 /* bcache-error-limit= */
  uint64_t error_halflife;              /* bcache-error-halflife= */
  unsigned writeback_percent;           /* bcache-writeback-percent=, as
                                           bcf_req_opts takes it */
  unsigned writeback_delay;             /* bcache-writeback-delay=, ditto */
  enum bcf_sync_writes sync_writes;     /* bcache-sync-writes= */
  bool test_no_tracker;                 /* bcache-test-disable-tracker= */
  /* The first identifying parameter, for messages ("socket=/x"). */
  bool id_any;
  char id_text[256];
};

extern struct filter_config cfg;

int filter_config (nbdkit_next_config *next, nbdkit_backend *nxdata,
                   const char *key, const char *value);
int filter_config_complete (nbdkit_next_config_complete *next,
                            nbdkit_backend *nxdata);

#define filter_config_help \
  "bcache=PATH                 (required) cache device or file\n" \
  "bcache-size=SIZE            create the cache file with this size\n" \
  "bcache-format=auto|never|force|force-discard-dirty  what to do with\n" \
  "                            a non-cache device (force: not if dirty)\n" \
  "bcache-mode=writethrough|writeback|writearound|none  cache mode\n" \
  "bcache-writeback-percent=N  writeback: dirty share to keep (10)\n" \
  "bcache-writeback-delay=S    writeback: pause after a full pass (30)\n" \
  "bcache-sync-writes=all|fua  writeback: the writes that count as\n" \
  "                            bcache's REQ_SYNC in its cutoffs (all)\n" \
  "bcache-copy-gc=BOOL         writeback: compact dirty data (true)\n" \
  "bcache-bucket-size=SIZE     bucket size when formatting (512K)\n" \
  "bcache-block-size=SIZE      block size when formatting (device block)\n" \
  "bcache-sequential-cutoff=SIZE  bypass streams this long (4M; 0 off)\n" \
  "bcache-sequential-bypass=auto|always  auto: not while the export is\n" \
  "                            slower than the cache (auto)\n" \
  "bcache-congested-read-threshold-us=N  bypass more while cache reads\n" \
  "                            take longer (2000; 0 off)\n" \
  "bcache-congested-write-threshold-us=N  ... writes (20000; 0 off)\n" \
  "bcache-backing-uuid=UUID    identity of the export in the cache\n" \
  "bcache-backing-device=auto|never  serve a bcache backing device's data\n" \
  "bcache-io=uring|sync|auto   cache device I/O (auto)\n" \
  "bcache-direct=BOOL          use O_DIRECT on the cache (true)\n" \
  "bcache-ctl=PATH             control socket (bcachefilter-ctl)\n" \
  "bcache-node-cache=SIZE      btree node cache memory bound (256M)\n" \
  "bcache-journal-delay=MS     journal batching delay (100)\n" \
  "bcache-write-intent=BOOL    write-intent regions (true)\n" \
  "bcache-error-limit=N        device errors before passing through (64)\n" \
  "bcache-error-halflife=N     I/Os after which an error counts half\n" \
  "                            (1000000; 0 = errors never decay)\n" \
  "bcache-test-disable-tracker=BOOL  tests only: unsafe"

/* .load: make the filter's own version visible (params.c says where). */
void filter_load (void);
/* .unload: free what .config kept. */
void filter_unload (void);

/* A cache mode, for bcache-mode= and the control socket's set
 * cache_mode: the mode, or -1 with the reason in err. */
int parse_mode (const char *value, char *err, size_t errlen);

#endif /* BCACHEFILTER_PLUGIN_PARAMS_H */
