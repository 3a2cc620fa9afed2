/* bcachefilter: the cache engine's public API.
 *
 * A struct bcf_cache is one cache device (in bcache's on-disk format) in
 * front of one backing store (struct bcf_backing).  The engine knows
 * nothing about nbdkit: the filter (plugin/) maps NBD requests onto these
 * calls.  All offsets and lengths here are in BYTES of the backing store
 * and must be multiples of bcf_cache_block_size() (the cache's block
 * size); the filter splits or bypasses requests that are not.
 *
 * Threads: every call may be made from many threads at once, except open,
 * close and start/stop of the background threads.  No call does device or
 * backing I/O while holding the btree lock.
 *
 * The cache-miss protocol (DESIGN.md "The cache-miss insert protocol"):
 *   bcf_lookup            -> hits (device locations) and misses
 *   bcf_miss_begin        -> inserts a check key over a missed range
 *   ... read the backing store, answer the client ...
 *   bcf_miss_fill         -> writes the data to the cache and replace-
 *                            inserts it against the check key; fails with
 *                            -EEXIST (a miss collision) if anything
 *                            touched the range meanwhile
 *   bcf_miss_cancel       -> drops the check key without caching
 */
#ifndef BCACHEFILTER_CACHE_H
#define BCACHEFILTER_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/backing.h"
#include "bcachefilter/format.h"
#include "bcachefilter/stats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

struct bcf_cache;
struct bcf_claim;
struct bcf_bdev;

/* What to do with a device that holds no usable cache. */
enum bcf_format_policy {
  BCF_FORMAT_NEVER = 0,   /* open an existing cache only */
  BCF_FORMAT_AUTO,        /* format a blank device; initialise a device made
                             by make-bcache -C; refuse anything else */
  BCF_FORMAT_FORCE,       /* format whatever is there (destroys it), but
                             a cache that holds dirty data only with
                             opts.discard_dirty */
};

enum bcf_log_level { BCF_LOG_DEBUG, BCF_LOG_INFO, BCF_LOG_WARN, BCF_LOG_ERROR };

/* How the engine drives the cache device (core/io.h). */
enum bcf_io_mode {
  BCF_IO_AUTO = 0,              /* io_uring if available and O_DIRECT,
                                 * else sync */
  BCF_IO_URING,                 /* io_uring or fail to open */
  BCF_IO_SYNC,                  /* pread / pwrite / fdatasync */
};

/* The steps of opening an existing cache that grow with its size, in
 * the order they run, for opts.progress.  On a large cache they are
 * nearly all of the open: the nodes after a clean close, the replay
 * after a crash. */
enum bcf_open_step {
  BCF_OPEN_JOURNAL,       /* reading the journal: buckets read, of all */
  BCF_OPEN_BTREE,         /* reading the btree nodes: the share of the tree
                             read (below) */
  BCF_OPEN_REPLAY,        /* replaying the journal: keys replayed, of all */
};

struct bcf_cache_opts {
  const char *path;               /* cache device or file */
  bool readonly;                  /* inspect only (tools): never write;
                                     backing may be absent; writes fail
                                     with -EROFS */
  uint64_t create_size;           /* create the file with this size if missing */
  /* The caller's claim on the device (bcachefilter/claim.h), held for
   * as long as the cache is open; NULL: a writable open claims the
   * device itself and fails with -EBUSY while another process has it. */
  const struct bcf_claim *claim;
  enum bcf_io_mode io_mode;
  bool direct_off;                /* never use O_DIRECT */

  enum bcf_format_policy format;
  /* With format FORCE, a cache that holds dirty data (acknowledged
   * writes its export does not have) is formatted too, losing them;
   * without it that is refused with -EBUSY, saying how much would be
   * lost.  A cache that cannot be opened to count it is formatted. */
  bool discard_dirty;
  unsigned bucket_sectors;        /* for formatting; 0 = 1024 (512 KiB) */
  unsigned block_sectors;         /* for formatting; 0 = device's */
  unsigned replacement;           /* enum bch_replacement, for formatting */
  /* Refuse to format a cache of fewer buckets than this, or to initialise
   * a make-bcache device of fewer into one: BCH_KERNEL_MIN_NBUCKETS asks
   * for a cache the Linux kernel can register.  0: bcache's own minimum,
   * 128 (tests use small caches).  Existing caches open whatever their
   * size. */
  unsigned min_buckets;

  struct bcf_backing backing;
  /* Identity of the backing export, recorded in the uuid entry (slot 0)
   * with its size.  A cache holding another export (another uuid, or the
   * same one recorded with another size) is refused unless
   * discard_foreign is set and it holds no dirty data.  A size of 0 in
   * the entry means "not recorded" (the kernel leaves it 0 for backing
   * devices): then only the uuid is compared. */
  uint8_t backing_uuid[16];
  char backing_label[32];
  bool discard_foreign;
  /* The export is a bcache backing device (bcachefilter/bdev.h, from
   * bcf_bdev_probe): its superblock's uuid and label are the identity
   * (backing_uuid and backing_label are not used), its uuid entry records
   * no size (as the kernel's), and its slot in the uuid array is chosen
   * as the kernel's attach chooses it (bcf_bdev_pick_slot), keeping the
   * other slots.  A device that a cache set holds dirty data for is
   * refused before anything is written, unless that set is this cache.
   * The caller marks the device attached after the open
   * (bcf_bdev_attach).  NULL: a plain export.  Must stay valid while the
   * cache is open. */
  struct bcf_bdev *bdev;

  size_t node_cache_bytes;        /* memory bound of the btree node cache;
                                     0 = 256 MiB */
  unsigned journal_delay_ms;      /* leaf-insert batching; 0 = 100 */
  /* Write-intent regions (core/intent.c): a write to data the cache
   * holds waits for the journal only the first time in a 16 MiB region;
   * after a crash, the clean data of regions marked then is dropped.
   * Off: every such write waits for its dirty keys' journal entry. */
  bool write_intent_off;
  unsigned checkpoint_interval_ms;  /* the btree is written at least this
                                       often while it has unwritten keys
                                       (background threads); 0 = 30000 */

  /* Diagnostics (may be NULL). */
  void (*log) (void *opaque, enum bcf_log_level level, const char *msg);
  void *log_opaque;
  /* Progress of the open of an existing cache (may be NULL; not called
   * when formatting), for a tool to show: called for each step of enum
   * bcf_open_step in turn, first with done 0 and last with done ==
   * total (total may be 0 when there is nothing to do), never with a
   * smaller done than before in that step, and at most once per journal
   * bucket, btree node or journal entry, so it costs nothing beside the
   * I/O.  The number of nodes is known only once they are all read, so
   * for BCF_OPEN_BTREE done / total is the share of the tree read, each
   * node's share split equally among its children (in the usual tree of
   * two levels, each leaf read adds the same).  Called on the opening
   * thread before bcf_cache_open returns, with no engine lock held; it
   * must not call the engine (there is no cache to call yet), and since
   * it delays the open it should only take note or print. */
  void (*progress) (void *opaque, enum bcf_open_step step, uint64_t done,
                    uint64_t total);
  void *progress_opaque;
};

/* Open (and if the policy allows, format) a cache.  Returns 0 and sets
 * *cp, or a negative errno with the reason in err.  The errors a caller
 * may want to tell apart:
 *   -EEXIST       the cache holds another export (uuid or size)
 *   -EBUSY        another process holds the device (bcachefilter/claim.h),
 *                 or format FORCE would destroy dirty data (discard_dirty)
 *   -EMEDIUMTYPE  the device holds something else (foreign data, a
 *                 bcache backing device) or, read-only, no cache yet
 *   -EUCLEAN      corrupt metadata (superblock, journal, prios, btree)
 *   -ENODEV       blank or never registered, and the policy forbids
 *                 formatting it
 *   -ENOSPC       too small to be a cache
 *   -ENOTSUP      a cache set of several devices
 * What the device holds can also be asked first: bcachefilter/probe.h. */
int bcf_cache_open (const struct bcf_cache_opts *opts, struct bcf_cache **cp,
                    char *err, size_t errlen);
/* Write everything that must be written and close.  Returns 0 or the
 * first error (the cache is freed either way).  Correctness never depends
 * on close being called: recovery handles a crash at any point. */
int bcf_cache_close (struct bcf_cache *c);

/* Give the cache up (the request path saw too many device errors, or an
 * invalidation could not be journalled): stop using it and clear
 * CACHE_SYNC in the superblock, so the next open starts with an empty
 * cache instead of keys whose invalidations may be missing (I2).  Refused
 * with -EBUSY while the cache holds dirty data (it must not be dropped).
 * Returns 0, or -errno if the superblock could not be written: then the
 * device must be reformatted before it is used again, and the caller must
 * say so. */
int bcf_cache_abandon (struct bcf_cache *c);

/* Detach the cache from its export, as bcache's detach does: the uuid
 * entry of the export (the slot its keys are under) becomes bcache's
 * invalid uuid, durably (a new uuid bucket, and a journal entry naming
 * it).  The next open starts with nothing cached for the export: a plain
 * export's cache starts empty, saying so in the log (core/super.c), and
 * a bcache backing device gets a new slot.  Keys stay where they are and
 * are never served again.  The cache stays open, for the caller to pass
 * everything through (bcf_req_detach_finish).  Refused with -EBUSY
 * while the cache holds dirty data (written back first: the caller
 * drains), -ENOENT if no export is attached, -EROFS read-only; another
 * -errno if the metadata could not be written (the entry is unchanged). */
int bcf_cache_detach (struct bcf_cache *c);

/* A message through the cache's log function (opts.log), for the layers
 * above the engine (the request path). */
void bcf_cache_log (struct bcf_cache *c, enum bcf_log_level level,
                    const char *fmt, ...)
  __attribute__ ((format (printf, 3, 4)));

/* Background threads: journal timer, allocator, GC.  Tests may instead
 * drive the work by hand (bcf_cache_journal_write, bcf_gc_run). */
int bcf_cache_start_threads (struct bcf_cache *c);
void bcf_cache_stop_threads (struct bcf_cache *c);

/* The engine keeps I/O buffers in a pool and an io_uring per thread for
 * reuse.  Give the calling thread's ring and the pool's cached buffers
 * back now (a program at exit, so that leak checkers see a clean exit;
 * a thread that is done with the engine).  Harmless if there are none. */
void bcf_release_memory (void);

unsigned bcf_cache_block_size (const struct bcf_cache *c);
/* The export an opened cache holds, as its uuid entry recorded it at
 * open (uuid and size in bytes, 0 if the entry records no size); false
 * for a cache that holds none yet, or whose export was detached.  A
 * read-only open (which has no export to compare) reports the first
 * slot that names a device (slot 0, but for a cache set the kernel used
 * for several backing devices), and is used to check the identity
 * early. */
bool bcf_cache_owner (const struct bcf_cache *c, uint8_t uuid[16],
                      uint64_t *bytes);
/* The superblock as it is on disk now (read-only view). */
const struct bch_sb *bcf_cache_super (const struct bcf_cache *c);
/* How the device is driven: "uring" or "sync", and whether O_DIRECT. */
const char *bcf_cache_io_name (const struct bcf_cache *c);
bool bcf_cache_io_direct (const struct bcf_cache *c);
uint64_t bcf_cache_backing_size (const struct bcf_cache *c);
/* Bytes the cache's buckets hold, metadata included: what
 * writeback_percent and the writeback cutoffs are shares of. */
uint64_t bcf_cache_capacity_bytes (const struct bcf_cache *c);
/* Bytes of dirty data the cache holds (a counter: no walk). */
uint64_t bcf_cache_dirty_bytes (struct bcf_cache *c);
/* Writes inserted as dirty keys so far (the stat dirty_inserts), counted
 * after the insert, seq_cst: the detach's settle check (request.c, D4). */
uint64_t bcf_cache_dirty_inserts (struct bcf_cache *c);
/* How many times since open a bucket became marked as holding dirty data
 * or metadata (a counter: no walk).  Only GC and the allocator's release
 * of metadata unmark them, so the buckets dirty or metadata
 * (bcf_cache_stats) grow by at most this much between two counts. */
uint64_t bcf_cache_in_use_marks (struct bcf_cache *c);
/* Has the cache device changed under us: become shorter than at open,
 * or (a file) lost much of its allocated space, as a truncate that later
 * writes grow back with holes does?  Holes read as zeros, not errors, so
 * from then on nothing the cache holds may be served.  The reason, or
 * NULL.  One atomic load: cheap enough for every request. */
const char *bcf_cache_device_lost (struct bcf_cache *c);
/* Look at the device now (an fstat; the journal thread does it every
 * journal_delay_ms, and every failed I/O does it too), and log the
 * first time it is found lost.  Returns 0, or -ENXIO once lost. */
int bcf_cache_check_device (struct bcf_cache *c);
/* Cache-device I/Os done since open, failed ones included (what
 * bcache's error half-life is counted in). */
uint64_t bcf_cache_device_ios (const struct bcf_cache *c);
/* Of those, the ones that failed (injected test faults included): the
 * device_errors of the statistics. */
uint64_t bcf_cache_device_errors (const struct bcf_cache *c);

/* ---- Reads ------------------------------------------------------------- */

enum bcf_extent_kind {
  BCF_EXTENT_MISS = 0,    /* not cached (a hole, or a check key) */
  BCF_EXTENT_HIT,         /* cached at dev_offset */
};

struct bcf_extent {
  enum bcf_extent_kind kind;
  bool dirty;             /* newer than the backing store */
  uint64_t offset;        /* backing-store bytes */
  uint64_t len;
  uint64_t dev_offset;    /* cache-device bytes (hits) */
  uint64_t ptr;           /* the pointer, for bcf_read_hit's recheck */
};

/* Plan a read: fill out[] with consecutive extents covering [offset,
 * offset + len), hits and misses, and set *n.  At most max extents; if
 * the range needs more, the last one returned ends early and the caller
 * continues from its end.  Returns 0 or a negative errno. */
int bcf_lookup (struct bcf_cache *c, uint64_t offset, uint64_t len,
                struct bcf_extent *out, unsigned max, unsigned *n);

/* Read a hit from the cache device into buf.  Afterwards the pointer's
 * gen is checked again: if the bucket was reused meanwhile the data may
 * be wrong, and -ESTALE is returned (counted as a read race); the caller
 * reads the backing store instead for a clean hit, and looks the range
 * up again for a dirty one (the backing store may be older than it).
 * Other errors are device errors (counted; the caller serves a clean
 * hit from the backing store). */
int bcf_read_hit (struct bcf_cache *c, const struct bcf_extent *e, void *buf);

/* ---- The cache-miss protocol ------------------------------------------- */

struct bcf_miss {
  uint64_t offset, len;
  uint64_t check_ptr;     /* identifies our check key */
};

/* Insert a check key over [offset, offset + len).  Returns 0, or
 * -ENOSPC if the cache cannot take it now (serve without caching). */
int bcf_miss_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
                    struct bcf_miss *m);
/* Write data (m->len bytes) to a new cache location and replace-insert it
 * against the check key.  Returns 0; -EEXIST if the range was touched
 * since bcf_miss_begin (a miss collision: nothing is cached, counted);
 * -ENOSPC if no space; another -errno on a device error.  Not journalled:
 * a crash simply forgets it (clean data, safe). */
int bcf_miss_fill (struct bcf_cache *c, struct bcf_miss *m, const void *data);
/* bcf_miss_fill for n misses at once: res[i] gets what bcf_miss_fill
 * would return for ms[i] (data[i] holds ms[i]->len bytes).  The data
 * writes of the whole batch go to the device in one submission, so
 * neighbours merge and a device with a costly doorbell (a virtual disk)
 * is rung once, not n times. */
void bcf_miss_fill_many (struct bcf_cache *c, struct bcf_miss *const *ms,
                         const void *const *data, unsigned n, int *res);
/* Remove our check key (if it is still there) without caching. */
void bcf_miss_cancel (struct bcf_cache *c, struct bcf_miss *m);

/* ---- Writes and invalidation ------------------------------------------- */

/* Remove [offset, offset + len) from the cache, journalled wherever the
 * range could hold data after a crash (a range that holds no key costs
 * nothing).  With durable, returns only once such an invalidation is on
 * the journal (the bypass-write ordering of DESIGN.md).  Returns 0 or
 * -errno. */
int bcf_invalidate (struct bcf_cache *c, uint64_t offset, uint64_t len,
                    bool durable);

/* Write data to a new cache location and insert it as clean (the backing
 * store already holds the same bytes) or dirty (it does not), journalled.
 * With durable, returns once the key is on the journal.  -ENOSPC if the
 * cache has no room now (the caller invalidates instead).  The range is
 * invalidated on any failure, so the cache never holds older data than
 * the caller wrote. */
int bcf_insert (struct bcf_cache *c, uint64_t offset, uint64_t len,
                const void *data, bool dirty, bool durable);

/* A read of hit e failed on the device: drop e from the cache, only if
 * it is still there as it was (a clean key; never a newer write's data),
 * journalled wherever a crash could bring it back.  Returns 0 or -errno. */
int bcf_drop_hit (struct bcf_cache *c, const struct bcf_extent *e);

/* Writes on dirty keys (DESIGN.md "Writes on dirty keys").  A write's
 * data goes into the cache as dirty keys, journalled, and is marked clean
 * once the backing store has it:
 *
 *   bcf_write_begin       data to new cache space, dirty keys inserted
 *   bcf_write_durable     if w->ordered: wait until the keys are on the
 *                         journal; the backing write must not be issued
 *                         before (otherwise it may run in parallel)
 *   ... the backing write ...
 *   bcf_write_undo        the backing write failed: remove the dirty keys
 *                         durably (the client is told it failed: no dirty
 *                         key may survive to be written back later); call
 *                         it while the write still holds its turn in the
 *                         in-flight write tracker
 *   bcf_write_mark_clean  the backing store has it: what is still ours
 *                         becomes clean (compare-and-swap against the
 *                         exact keys; not journalled)
 *   bcf_write_release     free w
 *
 * Offsets and lengths in bytes, whole blocks. */
#define BCF_WRITE_INLINE 4
struct bcf_write {
  uint64_t offset, len;
  uint64_t seq;               /* the journal entry holding the keys */
  bool ordered;               /* the range may hold data a crash could
                                 bring back: durable before the backing
                                 write (false once a write-intent mark
                                 covers it) */
  bool intent;                /* counted in its write-intent regions */
  unsigned npieces;           /* keys: one per allocation */
  uint64_t *ptrs;             /* their pointers */
  uint64_t inline_ptrs[BCF_WRITE_INLINE];
  struct bcf_write_io *io;    /* bcf_write_over_begin's device writes */
};

/* Returns 0; or -ENOSPC (no room now), -errno (device error): then
 * the range holds what it held before (older dirty data included: it is
 * not dropped here), except after an insert failure (the journal or a
 * node read failed), which can leave dirty keys of this write's data
 * over a prefix of the range.  The caller writes back the range's dirty
 * data if it has any and invalidates the range as for a write that
 * bypasses the cache (request.c's cache_write). */
int bcf_write_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
                     const void *data, struct bcf_write *w);
/* The same for a writethrough write (the caller writes the backing store
 * itself before it marks the keys clean): the range's write-intent
 * regions are marked first, and keys that bring back no dirty data after
 * a crash are not journalled (extent.c says why). */
int bcf_write_begin_through (struct bcf_cache *c, uint64_t offset,
                             uint64_t len, const void *data,
                             struct bcf_write *w);
/* The same for a writeback-mode write, whose backing write the
 * writeback thread makes after the keys are durable: no write-intent
 * mark is taken (there is nothing for it to stand in for), and
 * w->ordered means nothing. */
int bcf_write_begin_back (struct bcf_cache *c, uint64_t offset,
                          uint64_t len, const void *data,
                          struct bcf_write *w);
int bcf_write_durable (struct bcf_cache *c, struct bcf_write *w);
/* Wait until the keys are on the journal whatever w->ordered says (FUA:
 * a write that must survive a crash once acknowledged). */
int bcf_write_sync (struct bcf_cache *c, struct bcf_write *w);
int bcf_write_undo (struct bcf_cache *c, struct bcf_write *w);
/* Returns the bytes marked clean (fewer than w->len if newer writes
 * replaced part of it), or -errno. */
int64_t bcf_write_mark_clean (struct bcf_cache *c, struct bcf_write *w);
void bcf_write_release (struct bcf_cache *c, struct bcf_write *w);

/* bcf_invalidate with durable, for a write about to change the backing
 * store over the range (a bypassing write, under its turn in the
 * in-flight write tracker): where the range's write-intent regions can
 * stand in for the journal wait, they are held in w instead (no wait
 * once a region is marked).  Release w with bcf_write_release after the
 * backing write, in every case.  Returns 0 or -errno. */
int bcf_invalidate_before_write (struct bcf_cache *c, uint64_t offset,
                                 uint64_t len, struct bcf_write *w);

/* Writethrough writes over clean data the cache holds, with the
 * cache-device write in parallel with the backing write:
 *
 *   bcf_write_over_begin  under the write's turn in the in-flight write
 *                         tracker: marks the range's write-intent regions
 *                         and starts writing the data to new cache space,
 *                         without waiting; the range keeps its old data
 *                         meanwhile.  -EEXIST if the range holds dirty
 *                         data or a crash could bring some back, or no
 *                         mark can be made (use bcf_write_begin_through);
 *                         -ENOSPC, -EROFS, -ENOMEM: not cached
 *   ... the backing write, which returned `backing` ...
 *   bcf_write_over_end    waits for the device write; if both succeeded
 *                         the data goes in as clean keys (1), else the
 *                         range is invalidated durably (0, or -errno if
 *                         that failed); *device_failed says whether the
 *                         cache device failed the write.  Releases w.
 *
 * Both on the same thread (the device write is on its ring).  extent.c
 * argues why the old data may stay while the backing write runs. */
int bcf_write_over_begin (struct bcf_cache *c, uint64_t offset, uint64_t len,
                          const void *data, struct bcf_write *w);
int bcf_write_over_end (struct bcf_cache *c, struct bcf_write *w, int backing,
                        bool *device_failed);

/* Writethrough writes to data the cache does not hold (DESIGN.md "Writes
 * on dirty keys": where nothing was cached, the cache update and the
 * backing write may run in parallel): the cache gets the data after the
 * backing store has it, as a fill, so the write waits for no cache-device
 * write.
 *
 *   bcf_write_fill_begin  under the write's turn in the in-flight write
 *                         tracker: 0 if the span [span_off, +span_len)
 *                         holds nothing a crash could bring back and
 *                         nothing in memory either; -EEXIST if it does
 *                         (the caller writes dirty keys first instead)
 *   ... the backing write ...
 *   bcf_miss_begin, then bcf_miss_fill / bcf_miss_cancel: the whole
 *                         blocks written, cached as a read miss's are
 *                         (the data is clean)
 *
 * Why it keeps I2: there is no older data to come back, in memory or
 * after a crash, and the fill's clean key is a read miss's, made durable
 * only by a checkpoint, after the export barrier.  Why over cached data
 * it would not pay: the range would have to leave the cache at the
 * backing write, and a block read while it is written (the hot blocks of
 * a zipf workload) would miss until the fill is in.
 *
 * Returns 0, -EEXIST, or -EROFS, -ENOSPC, -errno (the cache cannot take
 * it now). */
int bcf_write_fill_begin (struct bcf_cache *c, uint64_t span_off,
                          uint64_t span_len);

/* ---- Dirty data (writeback) ---------------------------------------------- */

/* The dirty extents at or after offset, in key order: out[] gets up to
 * max of them (kind HIT, dirty), *n how many; continue from the end of
 * the last one.  Cheap over clean parts of the tree (leaves without
 * dirty keys are skipped whole).  Returns 0 or -errno. */
int bcf_dirty_scan (struct bcf_cache *c, uint64_t offset,
                    struct bcf_extent *out, unsigned max, unsigned *n);
/* Is dirty extent e (from bcf_dirty_scan) still in the cache, whole and
 * dirty, as it was? */
bool bcf_dirty_still (struct bcf_cache *c, const struct bcf_extent *e);
/* The backing store has e's data, durably: mark e clean where it still
 * is (pieces a newer write replaced stay as they are).  Not journalled: a
 * crash that loses it writes the same data back again.  Returns the bytes
 * marked clean, or -errno. */
int64_t bcf_dirty_mark_clean (struct bcf_cache *c, const struct bcf_extent *e);

/* A bucket more than this % full of live dirty data is not emptied by
 * moving GC: a run would copy nearly a bucket to free one. */
#define BCF_MOVE_FILL_MAX_PERCENT 75

/* Moving GC (bcache's movinggc.c, which mainline leaves off): dirty data
 * scattered over many buckets keeps each of them counted as dirty, and
 * the writeback cutoffs count buckets, not bytes.  bcf_move_dirty copies
 * the dirty extents of the emptiest dirty buckets (at most max_bytes of
 * them) into fresh buckets, as the same dirty data, so that the next GC
 * pass finds the old buckets clean.  Keys, not buckets, decide what is
 * dirty: a move never loses or reorders a write (core/movinggc.c says
 * why).  The caller asks for the GC afterwards.  Returns 0 or -errno;
 * st (if not NULL) gets what this call did. */
struct bcf_move_stats {
  uint64_t buckets;             /* buckets chosen */
  uint64_t keys, bytes;         /* extents moved, their bytes */
  uint64_t collisions;          /* changed under the move: left alone */
};
int bcf_move_dirty (struct bcf_cache *c, uint64_t max_bytes,
                    struct bcf_move_stats *st);

/* Make every insert and invalidation returned so far durable (FLUSH). */
int bcf_flush (struct bcf_cache *c);
/* The same in two steps, for a caller that knows which inserts a flush
 * must cover: bcf_flush_point, read after an insert or invalidation
 * returned, names a point that covers it; bcf_flush_upto makes
 * everything up to that point durable (and nothing inserted after it
 * need be).  Points only grow; the larger of two covers both. */
uint64_t bcf_flush_point (struct bcf_cache *c);
int bcf_flush_upto (struct bcf_cache *c, uint64_t point);

/* Foreground requests: the request layer counts each client request in
 * for its whole duration, so GC keeps its slices short while anyone waits
 * (core/gc.c).  Cheap (one relaxed atomic on a per-thread shard); the
 * token is the shard, to be handed back by the same request. */
struct bcf_inflight;
struct bcf_inflight *bcf_inflight_enter (struct bcf_cache *c);
void bcf_inflight_leave (struct bcf_inflight *t);
/* Requests that entered so far (never decreases): the writeback's idle
 * boost looks for rounds in which it did not change. */
uint64_t bcf_cache_requests (struct bcf_cache *c);

/* ---- Maintenance --------------------------------------------------------- */

/* Ask for a GC pass (asynchronous when threads run). */
void bcf_trigger_gc (struct bcf_cache *c);
/* Run a whole GC pass in the calling thread, in incremental slices. */
int bcf_gc_run (struct bcf_cache *c);
/* GC passes completed so far (never decreases; cheap). */
uint64_t bcf_gc_passes (struct bcf_cache *c);
/* Write the pending journal entry now. */
int bcf_cache_journal_write (struct bcf_cache *c);
/* Write every dirty btree node and commit a new root (journal reclaim). */
int bcf_cache_checkpoint (struct bcf_cache *c);

/* ---- Statistics ---------------------------------------------------------- */

/* Durations (struct bcf_time_stat) and the decayed counters: stats.h. */
struct bcf_cache_stats {
  uint64_t nbuckets, bucket_bytes, block_bytes;
  uint64_t buckets_free, buckets_clean, buckets_dirty, buckets_meta;
  uint64_t btree_nodes, btree_depth, btree_keys, btree_cache_bytes;
  uint64_t btree_evictions, btree_loads;  /* node cache */
  uint64_t dirty_sectors;
  uint64_t journal_seq, journal_last_seq, journal_writes;
  /* Totals of the cache's decayed counters (bcf_cache_counters): every
   * other request counter is there too, with bcache's views. */
  uint64_t miss_collisions, read_races;
  uint64_t inserts;              /* data inserted: fills, bcf_insert */
  uint64_t dirty_inserts;        /* writes inserted as dirty keys */
  uint64_t intent_regions;       /* write-intent regions marked now */
  uint64_t intent_marks, intent_clears;   /* ... set and cleared */
  uint64_t intent_dropped;       /* clean extents dropped at open in regions
                                    a crash left marked */
  uint64_t invalidates;          /* bcf_invalidate calls */
  uint64_t invalidates_marked;   /* ... of bypassing writes whose journal
                                    wait a write-intent mark stood in for */
  /* The export barrier (bcf_cache_set_export): flushes of the export a
   * checkpoint made before writing clean keys, and those that failed. */
  uint64_t export_flushes, export_flush_errors;
  /* Flushes of the export the request layer and the writeback asked for
   * (bcf_cache_flush_export) and did not send, because a flush that
   * succeeded had covered every change the export had acknowledged. */
  uint64_t export_flushes_skipped;
  /* Cache-device I/Os that failed (bcache's errors), injected test
   * faults included: every failed read, write and flush, whoever made it
   * (requests, fills, the journal, GC, the writeback). */
  uint64_t device_errors;
  struct bcf_time_stat gc, btree_split, journal_write, alloc_wait,
                       checkpoint;
  /* How long the btree lock was held for writing: by GC (a hold per leaf
   * of a slice), and by each of a checkpoint's two holds (the snapshot,
   * the release of dead buckets); and how long a foreground lookup that
   * found it taken waited for it (uncontended lookups are not timed).
   * update_locked: each other hold for writing (inserts, replaces, clean
   * marks, intent marks, loads and evictions of nodes); update_lock_wait:
   * how long those writers waited for it when they found it taken. */
  struct bcf_time_stat gc_slice_locked, ckpt_locked, lookup_lock_wait;
  struct bcf_time_stat update_locked, update_lock_wait;
  /* Each write-intent region marked: the time until the mark was durable
   * (the superblock's feature bit when it was off, the mark's journal
   * write), which the write that needed it waited. */
  struct bcf_time_stat intent_mark;
  /* Each write of a request's data to the cache device (the pieces of
   * one write, submitted together): how long the request waited for it
   * (a write over clean data writes beside its export write: only the
   * wait after that). */
  struct bcf_time_stat cache_write;
  /* Each device flush a journal write made before writing its entry
   * (data and metadata before the keys that point at them: part of
   * journal_write, the rest being the entry's write), and each write of
   * the prio buckets with the journal entry that points at them (after
   * GC or the allocator changed bucket gens). */
  struct bcf_time_stat journal_preflush, prio_write;
  uint64_t gc_passes, gc_slices, gc_nodes, gc_coalesced;
  /* Moving GC (bcf_move_dirty): runs, dirty extents moved and their
   * bytes, and extents a write, invalidation or clean mark changed
   * under the move (left as they were). */
  uint64_t moving_gc_runs, moving_gc_keys, moving_gc_bytes;
  uint64_t moving_gc_collisions;
  /* Nodes walked by the last GC slice, the most by any slice, and the
   * slices cut to the minimum because foreground requests were in flight
   * (gc.c: the slice rule). */
  uint64_t gc_slice_nodes_last, gc_slice_nodes_max, gc_slices_busy;
  uint64_t requests_in_flight;   /* foreground requests in the engine now */
  /* bcache's congestion tracking (bcf_cache_set_congestion): the
   * thresholds in microseconds, and "congested", the stream size in
   * sectors from which requests bypass now (0: not congested). */
  unsigned congested_read_threshold_us, congested_write_threshold_us;
  unsigned congested;
};

void bcf_cache_stats (struct bcf_cache *c, struct bcf_cache_stats *st);
/* The cache's counters with bcache's decayed views and the request
 * latency histograms (stats.h): owned by the cache, so that the engine
 * and the request layer count each event once, in one place. */
struct bcf_stats *bcf_cache_counters (struct bcf_cache *c);
/* Zero the time stats above (gc, btree_split, ...: count, total, max,
 * last and histogram), for clear_stats (bcf_stats_clear_all). */
void bcf_cache_clear_time_stats (struct bcf_cache *c);

/* bcache's congested_read_threshold_us / congested_write_threshold_us:
 * cache-device reads slower than read_us, and writes or flushes slower
 * than write_us, make the cache "congested", and while it is, requests
 * of sequential streams above a size that shrinks the more congested it
 * is bypass the cache (the request layer's should_bypass).  0 disables a
 * threshold; both 0, the default of an open cache, turn it off (bcache's
 * defaults are 2000 and 20000; the filter sets them). */
void bcf_cache_set_congestion (struct bcf_cache *c, unsigned read_us,
                               unsigned write_us);

/* The export barrier.  A clean key says "the export has this data,
 * durably", and a checkpoint makes the keys it writes survive a crash.
 * Where the export has a volatile write cache (a NAS), data it has
 * acknowledged but not flushed can be lost in a power cut of its own;
 * a clean key for it made durable first would then serve data the
 * export no longer has, and lose it for good once evicted.  So every
 * checkpoint first flushes the export if any of its writes completed
 * since the last such flush.  bcf_cache_set_export gives the export to
 * flush (it must stay valid while the cache is open, or until replaced;
 * NULL, the default: no barrier, for tools and caches whose export is
 * durable on completion).  For the filter it is the background
 * connection: its flush covers the other connections' writes where the
 * export supports multi-conn.  Every write, trim or zero of the export
 * is reported with bcf_cache_export_changed once it completed, before
 * any key says the export has the result: the request layer (bcf_req_*)
 * and the writeback thread do; a caller writing the export by other
 * means must too. */
void bcf_cache_set_export (struct bcf_cache *c, const struct bcf_backing *b);
void bcf_cache_export_changed (struct bcf_cache *c);
/* Flush the export through b and, if that succeeded, count it for the
 * barrier too, which then need not flush again for the changes it
 * covers: how the request layer and the writeback flush the export.
 * (So with the filter the background connection is opened for the
 * barrier only when no client flushed since the export last changed:
 * with nbdkit's nbd plugin its open prints "error: no connection in this
 * thread".)  Returns b's flush result. */
int bcf_cache_flush_export (struct bcf_cache *c, const struct bcf_backing *b);
/* 0 if the cache device is not congested, else the stream size in
 * sectors from which requests should bypass it (bcache's
 * bch_get_congested, with its random jitter). */
unsigned bcf_cache_congested (struct bcf_cache *c);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_CACHE_H */
