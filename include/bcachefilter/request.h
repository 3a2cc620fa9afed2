/* bcachefilter: the request path (core/request.c).
 *
 * Maps client requests (any offset and length) onto the engine: reads
 * with hits, misses and the cache-miss insert protocol; writes per cache
 * mode; flush, trim, zero, block status and prefetch.  Knows nothing about
 * nbdkit: the backing store of each request is passed in (the filter wraps
 * its per-connection next_ops in a struct bcf_backing), so many
 * connections can share one struct bcf_req.
 *
 * Safe for many threads at once.  See core/request.c for the ordering
 * arguments (DESIGN.md "The cache-miss insert protocol").
 */
#ifndef BCACHEFILTER_REQUEST_H
#define BCACHEFILTER_REQUEST_H

#include <stdbool.h>
#include <stdint.h>

#include "bcachefilter/backing.h"
#include "bcachefilter/cache.h"
#include "bcachefilter/stats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

#define BCF_ERROR_HALFLIFE_DEFAULT 1000000
#define BCF_ERROR_HALFLIFE_NEVER UINT64_MAX

enum bcf_cache_mode {
  BCF_MODE_WRITETHROUGH = 0,
  BCF_MODE_WRITEAROUND,
  BCF_MODE_NONE,
  BCF_MODE_WRITEBACK,
};

/* "writethrough", ... ; -1 for an unknown name. */
int bcf_cache_mode_parse (const char *name);
const char *bcf_cache_mode_name (enum bcf_cache_mode m);

struct bcf_req;

/* When a sequential stream past the cutoff (or a congested cache's
 * threshold) goes around the cache. */
enum bcf_sequential_bypass {
  /* bcache's rule: always.  It assumes the backing store streams as fast
   * as the cache device, as a local disk does. */
  BCF_SEQUENTIAL_BYPASS_ALWAYS = 0,
  /* Only while the export serves reads no slower than the cache device
   * (per byte, measured: EWMAs of the backing store's reads and of the
   * cache's hits; the cache counts as faster until a hit was measured).
   * A NAS behind a network is slower than a local SSD, so its streams
   * are cached and a second pass reads the SSD. */
  BCF_SEQUENTIAL_BYPASS_AUTO,
};

struct bcf_req_opts {
  enum bcf_cache_mode mode;
  uint64_t sequential_cutoff;   /* bytes; 0 disables */
  enum bcf_sequential_bypass sequential_bypass;
  /* Cache-device errors tolerated before the cache is switched to pass
   * through (every error is served from the backing store anyway);
   * 0 = 64.  Errors decay as bcache's io_errors do: an error counts
   * half as much after error_halflife more cache-device I/Os, so rare,
   * harmless errors never add up to the limit over months, while a
   * failing device reaches it fast.  0 = 1000000 I/Os;
   * BCF_ERROR_HALFLIFE_NEVER: no decay (bcache's default). */
  unsigned error_limit;
  uint64_t error_halflife;
  /* A backing store for background work: the writeback thread writes
   * dirty data back through it (dirty keys a crash left, in every mode).
   * Must stay valid until bcf_req_free.  NULL: no thread (tests drive
   * bcf_req_writeback by hand). */
  const struct bcf_backing *background;
  /* After a failed attempt to mark the cache device as given up, how
   * long before the next one (writes never wait for it; see
   * abandon_device in core/request.c); 0 = 1000 ms. */
  unsigned abandon_retry_ms;
  /* Added to the offset of every request: where the bytes the clients
   * address begin in the backing store, so that the cache's keys are at
   * backing-store sectors.  A bcache backing device's data offset
   * (bcachefilter/bdev.h), the kernel's bio shift; 0 for a plain export.
   * A multiple of 512, below the backing store's size; clients may
   * address size - offset bytes. */
  uint64_t offset;
  /* Writeback mode (bcache's sysfs knobs): the share of the cache dirty
   * data is written back down to (0 = 10; BCF_WRITEBACK_PERCENT_ZERO for
   * 0 %), and the pause after a full pass, seconds (0 = 30;
   * BCF_WRITEBACK_DELAY_ZERO for none). */
  unsigned writeback_percent;
  unsigned writeback_delay;
  /* Writeback mode: no moving GC (bcache's copy_gc_enabled 0; the
   * default here is on: core/movinggc.c says why). */
  bool copy_gc_off;
  /* Writeback mode: which writes bcache's cutoffs treat as its REQ_SYNC
   * writes, written back up to cutoff_writeback_sync (70 % of the
   * buckets in use) where the others stop at cutoff_writeback (40 %).
   * NBD does not say whether a client waits for a write (it has FUA,
   * which is REQ_FUA).  BCF_SYNC_WRITES_ALL (the default): every write,
   * as a VM's writes through qemu's cache=none (O_DIRECT) reach a local
   * bcache; BCF_SYNC_WRITES_FUA: FUA writes only (bcache's cutoff_writeback
   * then holds for the rest). */
  enum bcf_sync_writes {
    BCF_SYNC_WRITES_ALL = 0,
    BCF_SYNC_WRITES_FUA,
  } sync_writes;
};
#define BCF_WRITEBACK_PERCENT_ZERO 1000
#define BCF_WRITEBACK_DELAY_ZERO   UINT32_MAX

/* c must stay open for the lifetime of the request layer. */
struct bcf_req *bcf_req_new (struct bcf_cache *c, const struct bcf_req_opts *o);
void bcf_req_free (struct bcf_req *r);

/* Run-time knobs (the control socket).  set_mode returns 0, or -EINVAL
 * for a value that is not a mode. */
int bcf_req_set_mode (struct bcf_req *r, enum bcf_cache_mode m);
enum bcf_cache_mode bcf_req_mode (struct bcf_req *r);
void bcf_req_set_sequential_cutoff (struct bcf_req *r, uint64_t bytes);
uint64_t bcf_req_sequential_cutoff (struct bcf_req *r);
/* Returns 0, or -EINVAL for a value that is not a policy. */
int bcf_req_set_sequential_bypass (struct bcf_req *r,
                                   enum bcf_sequential_bypass p);
enum bcf_sequential_bypass bcf_req_sequential_bypass (struct bcf_req *r);
/* "auto" or "always" (bcache's), and back: -1 for another name. */
int bcf_sequential_bypass_parse (const char *name);
const char *bcf_sequential_bypass_name (enum bcf_sequential_bypass p);
/* The settings a running cache takes by name (bcache's sysfs names:
 * bcachefilter-ctl set, the filter's control socket), and the form of
 * their values: a word (cache_mode, sequential_bypass), a whole number
 * (the thresholds and writeback knobs), or a size in bytes with an
 * optional k, M or G suffix (sequential_cutoff).  The one list: the
 * control protocol, the filter and the ctl tool all look names up here. */
enum bcf_setting_value {
  BCF_SETTING_WORD, BCF_SETTING_NUMBER, BCF_SETTING_SIZE,
};
struct bcf_setting {
  const char *name;
  enum bcf_setting_value value;
};
/* The setting of that name, or NULL. */
const struct bcf_setting *bcf_setting_find (const char *name);
/* Every name, as "a, b, ... and z", for messages. */
const char *bcf_setting_names (void);

/* Writeback knobs (bcache's names): writeback_percent 0..100,
 * writeback_delay seconds, writeback_running, writeback_rate_update_seconds
 * 1..60.  Return 0 or -EINVAL (a value out of range), -ENOTSUP (no
 * writeback thread: no background backing store was given). */
int bcf_req_set_writeback_percent (struct bcf_req *r, unsigned percent);
int bcf_req_set_writeback_delay (struct bcf_req *r, unsigned seconds);
int bcf_req_set_writeback_running (struct bcf_req *r, bool running);
int bcf_req_set_writeback_update_seconds (struct bcf_req *r, unsigned s);
/* bcache's copy_gc_enabled: moving GC between the writeback's batches
 * (core/movinggc.c).  0 or -ENOTSUP as above. */
int bcf_req_set_copy_gc (struct bcf_req *r, bool enabled);
/* Write every dirty extent back at full speed through the writeback
 * thread and return once none is left (bcachefilter-ctl flush): 0, the
 * backing store's -errno (the data stays dirty), or -ETIMEDOUT after
 * timeout_ms (0: none).  progress (may be NULL) is called about once a
 * second with the dirty bytes left.  Without a thread, one pass in the
 * calling thread through b. */
int bcf_req_flush_dirty (struct bcf_req *r, const struct bcf_backing *b,
                         unsigned timeout_ms,
                         void (*progress) (void *opaque, uint64_t dirty),
                         void *opaque);
/* Start writing everything back at full speed and return at once; the
 * thread goes on until nothing is dirty (dirty_bytes in the stats shows
 * the progress).  -ENOTSUP without a thread. */
int bcf_req_writeback_hurry (struct bcf_req *r);
/* True once too many cache-device errors switched the cache off. */
bool bcf_req_passthrough (struct bcf_req *r);

/* Detaching the cache from its export (bcachefilter-ctl detach; bcache's
 * detach), in two steps so that the caller can do its own part between
 * them (a bcache backing device's superblock):
 *
 *   bcf_req_detach_drain   no new dirty data from now on (writes are
 *                          cached only over dirty data, as in
 *                          writearound, and never acknowledged from the
 *                          cache), wait for the writes in flight, and
 *                          write everything dirty back.  Blocks until
 *                          nothing is dirty: call it from a thread of
 *                          its own.  go_on (may be NULL) is called about
 *                          once a second with the dirty bytes left, and
 *                          stops the drain by returning false.  Returns
 *                          0 (DRAINING, nothing dirty), -EBUSY (a detach
 *                          is under way), -EALREADY (detached), or the
 *                          backing store's -errno, -ECANCELED: then
 *                          nothing changed (the data stays dirty, the
 *                          cache serves as before);
 *   bcf_req_detach_finish  mark the cache detached (bcf_cache_detach)
 *                          and pass everything through from then on:
 *                          nothing is read from the cache or put in it.
 *                          0; -EBUSY (dirty data: call cancel); another
 *                          -errno if the mark could not be written: the
 *                          cache is then given up as after device
 *                          errors (passes through too);
 *   bcf_req_detach_cancel  after a drain that is not to be finished:
 *                          serve as before.
 *
 * core/request.c argues why nothing acknowledged is left only in the
 * cache when the drain returns 0. */
enum bcf_detach_state {
  BCF_DETACH_NONE = 0,
  BCF_DETACH_DRAINING,
  BCF_DETACH_DONE,
};
int bcf_req_detach_drain (struct bcf_req *r, const struct bcf_backing *b,
                          bool (*go_on) (void *opaque, uint64_t dirty),
                          void *opaque);
int bcf_req_detach_finish (struct bcf_req *r);
void bcf_req_detach_cancel (struct bcf_req *r);
enum bcf_detach_state bcf_req_detach_state (struct bcf_req *r);

/* The requests, at client offsets (opts.offset is added).  Return 0 or a
 * negative errno (from the backing store: cache-device errors never fail
 * a request the backing store can serve). */
int bcf_req_read (struct bcf_req *r, const struct bcf_backing *b,
                  void *buf, uint32_t count, uint64_t offset);
int bcf_req_write (struct bcf_req *r, const struct bcf_backing *b,
                   const void *buf, uint32_t count, uint64_t offset, bool fua);
int bcf_req_flush (struct bcf_req *r, const struct bcf_backing *b);
int bcf_req_trim (struct bcf_req *r, const struct bcf_backing *b,
                  uint32_t count, uint64_t offset, bool fua);
int bcf_req_zero (struct bcf_req *r, const struct bcf_backing *b,
                  uint32_t count, uint64_t offset, bool may_trim, bool fua);
/* NBD_CMD_CACHE: read the range into the cache (no data returned). */
int bcf_req_prefetch (struct bcf_req *r, const struct bcf_backing *b,
                      uint32_t count, uint64_t offset);
/* Does the cache hold data for any byte of [offset, offset + count) that
 * the backing store may not have (dirty)?  Block status must then not
 * report a hole or zero there.  Returns 1, 0 or -errno. */
int bcf_req_has_dirty (struct bcf_req *r, uint32_t count, uint64_t offset);

struct bcf_req_stats {
  uint64_t device_errors;       /* cache-device errors served from backing */
  uint64_t io_errors;           /* ... decayed (bcache's io_errors) */
  uint64_t io_error_limit;      /* pass through when io_errors reaches it */
  uint64_t io_error_halflife;   /* I/Os; 0: no decay */
  bool passthrough;
  enum bcf_detach_state detach;
  uint64_t bypass_bytes_now, bypass_bytes_peak, bypass_pages,
           bypass_reserve_uses, bypass_in_flight;
  uint64_t fills_dropped;       /* misses not cached: fill queue full */
  uint64_t write_inserts;       /* writethrough writes whose data is cached */
  uint64_t write_collisions;    /* ... whose data could not be (no room, a
                                   device error, a failed backing write) */
  uint64_t write_waits;         /* writes that waited for an overlapping
                                   write in flight */
  uint64_t write_wait_ns, write_wait_max_ns;    /* how long in all, at most */
  uint64_t write_absorbed;      /* writes a later write covering them
                                   stood in for while they waited */
  uint64_t writes_in_flight_peak;
  uint64_t bypass_exact_checks; /* misses in a chunk with a write in
                                   flight: the exact ranges decided */
  /* Why requests went around the cache (should_bypass), and the stream
   * requests that did not because the export is slower than the cache
   * (BCF_SEQUENTIAL_BYPASS_AUTO). */
  uint64_t bypass_sequential, bypass_congested, sequential_cached;
  /* The costs compared: nanoseconds per KiB read from the export and
   * from the cache (EWMAs; 0: nothing measured yet). */
  uint64_t export_read_ns_per_kib, cache_read_ns_per_kib;
  uint64_t dirty_bytes;         /* dirty data in the cache */
  uint64_t writeback_keys_done, writeback_keys_failed, writeback_bytes,
           writeback_backing_errors, writeback_read_errors,
           writeback_retries;
  /* GCs the writeback asked for, to count the buckets it cleaned while
   * the cutoffs applied. */
  uint64_t writeback_gc_requests;
  uint64_t fill_queue_bytes;    /* data waiting to be written to the cache */
  /* Writeback mode. */
  uint64_t writeback_writes;    /* writes acknowledged from the cache */
  uint64_t writeback_cutoff_writes;     /* ... written through instead:
                                           the cache was too full */
  unsigned writeback_percent, writeback_delay, writeback_update_seconds;
  bool writeback_running, writeback_flushing;
  bool copy_gc_enabled;
  unsigned cache_in_use;        /* % of buckets dirty or metadata */
  /* bcache's writeback_rate_debug: sectors/s and sectors; next_io_ns:
   * how long until the rate limiter lets the next write-back go. */
  int64_t wb_rate, wb_dirty, wb_target, wb_proportional, wb_integral,
          wb_change;
  uint64_t wb_next_io_ns;
  bool wb_at_max;               /* idle boost */
};
void bcf_req_get_stats (struct bcf_req *r, struct bcf_req_stats *st);
/* The counters with bcache's decayed views. */
struct bcf_stats *bcf_req_counters (struct bcf_req *r);   /* the cache's */

/* Wait until every cache fill queued so far has been done.  Fills run in
 * the background so that clients need not wait for them; bcf_req_flush
 * drains, and tests use this to see the cache state. */
void bcf_req_drain (struct bcf_req *r);

/* Write every dirty extent back now, in the calling thread (what the
 * writeback thread does in the background; tests and tools).  Returns 0
 * or the backing store's -errno (the data stays dirty). */
int bcf_req_writeback (struct bcf_req *r, const struct bcf_backing *b);

/* Tests only: disable the in-flight write tracker's check. */
void bcf_req_test_disable_tracker (struct bcf_req *r, bool disabled);
/* Tests only: disable the ordering of overlapping writes. */
void bcf_req_test_disable_ordering (struct bcf_req *r, bool disabled);
/* Tests only: writes waiting for their turn in the tracker now. */
uint64_t bcf_req_test_writes_waiting (struct bcf_req *r);
/* Tests only: times a fill worker woke to find nothing queued. */
uint64_t bcf_req_test_fill_idle_wakeups (struct bcf_req *r);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_REQUEST_H */
