/* bcachefilter engine: cache-device I/O.
 *
 * Design
 * ------
 * Every byte the engine reads from or writes to the cache device (a block
 * device or a regular file) goes through this module.  It offers:
 *
 * - bcf_io_open / bcf_io_close: open the device with O_DIRECT where the
 *   filesystem accepts it, else buffered I/O made durable by fdatasync
 *   (bcf_io_notice then says so, for the caller to log).  The size is
 *   BLKGETSIZE64 / st_size, the logical block size BLKSSZGET for block
 *   devices and, for files, 512 or 4096: whichever an O_DIRECT probe read
 *   accepts (512 when buffered).  The size is rounded down to a multiple
 *   of the block size: a partial tail block cannot be addressed by aligned
 *   I/O.  (An empty file cannot be probed and gets 512.)  A device
 *   opened for writing is claimed first (include/bcachefilter/claim.h:
 *   flock, and O_EXCL for block devices), so a second writer, a mounted
 *   device or one another program holds exclusively is refused (EBUSY)
 *   rather than shared.
 *
 * - bcf_io_submit: all segments of one request (reads and writes mixed)
 *   queued together and waited for.  In io_uring mode each thread has its
 *   own ring (created on first use, freed when the thread exits), shared
 *   by every device that thread touches; a call never leaves anything in
 *   flight on it, so devices cannot see each other's completions.  More
 *   segments than the ring depth are streamed: as completions arrive the
 *   ring is refilled.  Short transfers are continued for the remainder;
 *   one that makes no progress (EOF because the file shrank underneath
 *   us) is -EIO.  Nothing is ever silently short.
 *
 * - a synchronous pread/pwrite/fdatasync path, chosen with
 *   BCF_IO_SYNC or automatically (BCF_IO_AUTO) where io_uring is missing
 *   or forbidden (ENOSYS, EPERM from kernel.io_uring_disabled, ENOMEM...),
 *   and where the device is not opened with O_DIRECT (buffered io_uring
 *   I/O goes through kernel worker threads; io.c, pick_mode).
 *
 * - an aligned buffer pool (bcf_buf_alloc / bcf_buf_free).
 *
 * - a fault-injection layer for tests (bcf_io_set_faults, bcf_io_crash),
 *   described below.  When not armed it costs one predictable branch per
 *   I/O.
 *
 * Alignment contract (the same in every mode, so code tested on a buffered
 * tmpfs file behaves the same on a real O_DIRECT device): each segment's
 * offset and length must be multiples of bcf_io_block_size, its buffer
 * aligned to the block size (bcf_buf_alloc's 4096 always is), and the
 * range must lie inside [0, bcf_io_size).  A submit with any segment
 * breaking these rules is REJECTED as a whole before any I/O: the bad
 * segments get -EINVAL, the others -ECANCELED, and nothing is read or
 * written.  Zero-length segments are allowed and succeed without I/O.
 *
 * Fault model (bcf_io_set_faults, tests only)
 * -------------------------------------------
 * Arming the faults (even with all knobs zero) makes the device behave
 * like a disk with a VOLATILE WRITE CACHE: a write is "completed" but not
 * durable until a flush that started after it completed has itself
 * completed.  To simulate that on an ordinary file, every write made while
 * armed first saves the old contents of its range in memory (the undo
 * log); a successful flush discards the records it made durable.
 * bcf_io_crash then plays the power loss: the unflushed writes are taken
 * newest first and each is kept or reverted to its old contents (a seeded
 * choice, or all lost / all kept).  Reverting never touches bytes that a
 * newer kept write covers, so the result is always a state the real
 * device could have reached: some subset of the unflushed writes, each
 * applied whole.  Writes are NEVER TORN in this model (a real device may
 * tear a write at sector granularity; the engine must not rely on it not
 * doing so, but this model does not exercise it).  Concurrent writes to
 * overlapping ranges are not modelled (the engine never issues them).
 * A write that fails for real keeps its record (its range may or may not
 * have changed).  The log holds a copy of every byte written since the
 * last flush: arm faults only in tests.
 *
 * Power cut (power_cut_after_write = N): the N-th write after arming is
 * performed, and once it has completed the device is dead: every later
 * read, write and flush fails with -EIO and no further write reaches the
 * file.  Typically followed by bcf_io_crash and a reopen "after reboot".
 *
 * fail_nth / fail_every count I/Os from the moment of arming: each
 * segment and each flush is one I/O (only writes if fail_writes_only).
 * An injected failure is not performed at all.
 *
 * Locking
 * -------
 * A struct bcf_io is shared by all threads; submit, pread, pwrite and
 * flush may be called concurrently (the caller orders overlapping I/O).
 * After open the struct is read-only except for atomic counters.  The
 * buffer pool has one mutex per size class.  The undo log has its own
 * mutex (test-only path).  bcf_io_set_faults and bcf_io_crash must not
 * race with I/O on the same device.
 */
#ifndef BCACHEFILTER_IO_H
#define BCACHEFILTER_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/cache.h"

/* Depth of each thread's io_uring; submits of more segments stream. */
#define BCF_IO_RING_DEPTH 64

/* ---- Aligned buffer pool ------------------------------------------------ */

/* Buffers are 4096-aligned.  Power-of-two sizes from 4 KiB to 1 MiB are
 * recycled through per-size free lists (a bounded number per size);
 * other sizes go straight to posix_memalign / free.  bcf_buf_free must be
 * given the size that was allocated.  Returns NULL (errno ENOMEM) on
 * failure. */
#define BCF_BUF_ALIGN 4096
extern void *bcf_buf_alloc (size_t size);
extern void bcf_buf_free (void *ptr, size_t size);

struct bcf_buf_stats {
  uint64_t allocs;          /* bcf_buf_alloc calls */
  uint64_t pool_hits;       /* ... served from a free list */
  uint64_t cached_buffers;  /* buffers now held by the free lists */
  uint64_t cached_bytes;
};
extern void bcf_buf_stats (struct bcf_buf_stats *st);
/* Give every cached buffer back to the allocator. */
extern void bcf_buf_pool_trim (void);

/* ---- Device ------------------------------------------------------------- */

/* enum bcf_io_mode (auto, uring, sync) is public: bcachefilter/cache.h. */

enum bcf_io_direct {
  BCF_IO_DIRECT_AUTO = 0,       /* O_DIRECT, buffered if refused (default) */
  BCF_IO_DIRECT_OFF,            /* always buffered */
  BCF_IO_DIRECT_REQUIRE,        /* O_DIRECT or fail to open */
};

/* Test-only knobs (opts.test_flags): simulate environments this machine
 * may not have. */
#define BCF_IO_TEST_REFUSE_DIRECT 0x1   /* act as if O_DIRECT gave EINVAL */
#define BCF_IO_TEST_NO_URING      0x2   /* act as if io_uring gave ENOSYS */

struct bcf_claim;

struct bcf_io_opts {
  const char *path;
  bool readonly;
  enum bcf_io_mode mode;
  enum bcf_io_direct direct;
  /* If non-zero and path does not exist, create a file of this size
   * (bcf_claim_open).  An existing file is used as it is, whatever its
   * size (unless it is empty). */
  uint64_t create_size;
  /* A writer's claim on the device (include/bcachefilter/claim.h), taken
   * by the caller; NULL: a writer open claims the device itself (and
   * fails with -EBUSY if another process holds it) and releases it at
   * close. */
  const struct bcf_claim *claim;
  unsigned test_flags;
};

enum bcf_io_op {
  BCF_IO_READ,
  BCF_IO_WRITE,
  /* A write that is durable when it completes (RWF_DSYNC: a FUA write,
   * or write and flush on a device without FUA).  It makes no earlier
   * write durable. */
  BCF_IO_WRITE_FUA,
};

struct bcf_io_seg {
  enum bcf_io_op op;
  void *buf;
  size_t len;
  uint64_t off;
  int result;                   /* out: 0 or -errno */
};

struct bcf_io;

/* Open a cache device.  Returns 0 and sets *iop, or -errno with a
 * message ("cannot open /dev/x: Permission denied") in err. */
extern int bcf_io_open (const struct bcf_io_opts *opts, struct bcf_io **iop,
                        char *err, size_t errlen);
/* Close; returns 0 or the -errno of close(2).  NULL is allowed. */
extern int bcf_io_close (struct bcf_io *io);

/* Perform all segments; returns 0 if every one succeeded, else the
 * result of the first failed segment (lowest index).  A rejected submit
 * (see "Alignment contract") returns the first invalid segment's error.
 * Safe to call from many threads at once. */
extern int bcf_io_submit (struct bcf_io *io, struct bcf_io_seg *segs,
                          unsigned n);
/* bcf_io_submit in two halves, for a caller with something else to do
 * meanwhile (a writethrough write's backing write): bcf_io_start queues
 * the segments and returns without waiting; bcf_io_finish waits for
 * them and returns what bcf_io_submit would have.  segs and their
 * buffers must stay until bcf_io_finish, which must be called, once, on
 * the same thread (the I/O is on that thread's ring).  Meanwhile the
 * thread's other I/O takes the synchronous path, and a second
 * bcf_io_start on the thread is performed synchronously at once.
 * Without io_uring (or without memory for the batch) bcf_io_start does
 * the I/O itself. */
struct bcf_io_pending {
  struct bcf_io *io;
  struct bcf_io_seg *segs;
  unsigned n, next;
  void *batch;                  /* in flight on the thread's ring */
};
extern void bcf_io_start (struct bcf_io *io, struct bcf_io_seg *segs,
                          unsigned n, struct bcf_io_pending *p);
extern int bcf_io_finish (struct bcf_io_pending *p);

extern int bcf_io_pread (struct bcf_io *io, void *buf, size_t len,
                         uint64_t off);
extern int bcf_io_pwrite (struct bcf_io *io, const void *buf, size_t len,
                          uint64_t off);
extern int bcf_io_pwrite_fua (struct bcf_io *io, const void *buf,
                              size_t len, uint64_t off);
/* Make every write completed before this call durable (fdatasync). */
extern int bcf_io_flush (struct bcf_io *io);

extern uint64_t bcf_io_size (const struct bcf_io *io);
extern unsigned bcf_io_block_size (const struct bcf_io *io);
extern const char *bcf_io_path (const struct bcf_io *io);
extern bool bcf_io_readonly (const struct bcf_io *io);
extern bool bcf_io_is_blockdev (const struct bcf_io *io);
/* Whether O_DIRECT is in use. */
extern bool bcf_io_direct (const struct bcf_io *io);
/* "uring" or "sync". */
extern const char *bcf_io_mode_name (const struct bcf_io *io);
/* What the open decided that the user should hear about (O_DIRECT
 * refused, io_uring unavailable), or NULL. */
extern const char *bcf_io_notice (const struct bcf_io *io);

/* Free the calling thread's io_uring now rather than at thread exit (for
 * threads that outlive their use of the engine).  Harmless if it has
 * none. */
extern void bcf_io_thread_cleanup (void);

/* ---- Statistics --------------------------------------------------------- */

struct bcf_io_stats {
  uint64_t reads, writes, flushes;      /* successful operations */
  uint64_t bytes_read, bytes_written;
  uint64_t errors;                      /* real I/O errors */
  uint64_t errors_injected;             /* by the fault layer */
  uint64_t unflushed_writes;            /* writes a crash would undo
                                           (armed only) */
};
extern void bcf_io_stats (struct bcf_io *io, struct bcf_io_stats *st);
/* Is the device still the one we opened?  A file or block device that
 * became shorter than at open, or a file that lost much of its allocated
 * space (truncated and grown back: reads of the holes return zeros, not
 * errors) is "lost": from then on the cache must not be trusted.  One
 * fstat (and BLKGETSIZE64), cheap enough to call every 100 ms; also
 * called by every failed I/O.  Returns 0, or -ENXIO once lost. */
extern int bcf_io_check (struct bcf_io *io);
/* Why the device was found lost, or NULL while it is not. */
extern const char *bcf_io_lost (struct bcf_io *io);
/* Every I/O done so far, failed ones included (cheap: a few atomic
 * loads; bcache's io_count, which its error decay is measured in). */
extern uint64_t bcf_io_count (struct bcf_io *io);
/* The I/Os that failed, injected faults included (two relaxed loads). */
extern uint64_t bcf_io_errors (struct bcf_io *io);

/* ---- Congestion (bcache's congested_read/write_threshold_us) ------------ */

/* Every read slower than read_us, and every write or flush slower than
 * write_us, makes the device congested by its latency in milliseconds
 * (at most 1024 remembered); faster I/Os and the time since the last slow
 * one take it back.  0 disables a threshold; both 0 (the default after
 * open) turn the tracking off, and then no I/O reads the clock for it. */
extern void bcf_io_set_congestion (struct bcf_io *io, unsigned read_us,
                                   unsigned write_us);
extern void bcf_io_get_congestion (struct bcf_io *io, unsigned *read_us,
                                   unsigned *write_us);
/* bcache's bch_get_congested: 0 if the device is not congested, else the
 * stream size in sectors from which requests should bypass the cache (the
 * more congested, the smaller; with bcache's random jitter; at least 1). */
extern unsigned bcf_io_congested (struct bcf_io *io);

/* ---- Fault injection (tests) -------------------------------------------- */

struct bcf_io_faults {
  uint64_t fail_nth;            /* the N-th I/O after arming fails; 0 off */
  uint64_t fail_every;          /* every K-th I/O fails; 0 off */
  bool fail_writes_only;        /* fail_nth / fail_every count writes only */
  int error;                    /* errno to inject; 0 means EIO */
  unsigned delay_us;            /* sleep before each I/O */
  uint64_t power_cut_after_write; /* see "Power cut" above; 0 off */
};

/* Arm (f != NULL: counters restart, undo logging starts) or disarm
 * (f == NULL: the undo log is dropped). */
extern void bcf_io_set_faults (struct bcf_io *io,
                               const struct bcf_io_faults *f);
/* With the faults armed: cut the power once the n-th write from now has
 * completed (see "Power cut"), or at once if n is 0, keeping the undo
 * log of the writes made so far, so a test can place the cut inside a
 * sequence it started earlier.  Not for concurrent use with I/O. */
extern void bcf_io_test_power_cut (struct bcf_io *io, uint64_t n);

enum bcf_io_crash_mode {
  BCF_IO_CRASH_RANDOM = 0,      /* keep each unflushed write or not (seed) */
  BCF_IO_CRASH_LOSE_ALL,        /* every unflushed write is lost */
  BCF_IO_CRASH_KEEP_ALL,        /* every unflushed write survives */
};

/* Simulate the power loss on the backing file as described above, then
 * close io (always, even on error: it must not be used again).  The same
 * seed over the same unflushed writes makes the same choices.  Returns
 * the number of writes reverted, or -errno if restoring failed. */
extern int bcf_io_crash (struct bcf_io *io, uint64_t seed,
                         enum bcf_io_crash_mode mode);

#endif /* BCACHEFILTER_IO_H */
