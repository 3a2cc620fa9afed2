/* bcachefilter tests: an in-memory backing store with fault, timing and
 * pause injection and a volatile-cache crash model.
 *
 * Design
 * ------
 * The engine reaches the store it caches only through struct bcf_backing
 * (include/bcachefilter/backing.h).  mem_backing implements every call of
 * it over memory, so core/ can be unit tested without nbdkit, and adds
 * the knobs race and crash tests need:
 *
 * - Storage is a sparse radix tree of 4 KiB pages, allocated on first
 *   write: a 1 TiB store costs a few KiB until written.  Unwritten pages
 *   read as zeroes; trim and zero free whole pages and zero the partial
 *   ones.  Trim zeroes, like nbdkit's memory plugin, so tests are
 *   deterministic; NBD does not promise that, and the engine must not
 *   rely on it.
 *
 * - Every request is one atomic step against the data: it holds the
 *   stripe locks (rwlocks, shared for reads) of the pages it covers for
 *   the memcpy only.  Latency sleeps and gate pauses happen with no lock
 *   held, so a request parked at a gate blocks nothing else, not even a
 *   request to the same bytes.
 *
 * - Faults and latency are settable from any thread at any time: atomics,
 *   and for range faults a small table under a mutex that requests skip
 *   while it is empty.  A fault is decided when the request arrives (so
 *   "the Nth read" means the Nth call to pread after arming) and takes
 *   effect when the request would touch the data: a failing request
 *   still passes its gates, but reads and writes nothing.
 *
 * - Gates park one chosen request at a chosen point, for deterministic
 *   interleavings: BEFORE_IO (nothing read or written yet) or AFTER_IO
 *   (data already read or written, the call has not returned).
 *
 * - Crash model: with tracking on, every data-changing request records an
 *   undo entry (the range and a copy of the pages it overwrote).  A flush
 *   makes durable every write recorded before the flush passed its
 *   BEFORE_IO gate; a fua write and a poke are durable at once.
 *   mem_backing_crash reverts unflushed writes, newest first, each one
 *   whole, never over bytes a kept newer write covers.
 *
 * - Counters count requests as the engine issued them, including those
 *   failed by injection (but not invalid ones, counted apart), because
 *   tests use them to prove what the engine asked for.
 *
 * Everything here aborts on out-of-memory and on misuse by a test (peek
 * outside the store, ...): it is a test fixture, and a loud stop beats a
 * confusing failure later.  A request that breaks backing.h's contract
 * (count 0, past size) returns -EINVAL, prints a line on stderr and bumps
 * stats.invalid, so tests can assert the engine never does that.
 *
 * Other unit tests use it by adding unit/mem-backing.c to their _SOURCES
 * (see tests/Makefile.am).
 */
#ifndef BCACHEFILTER_MEM_BACKING_H
#define BCACHEFILTER_MEM_BACKING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/backing.h"

struct mem_backing;
struct mem_backing_gate;

/* Kinds of request, as bits so gates and range faults can take a set. */
enum mem_backing_op {
  MEM_BACKING_READ = 1 << 0,
  MEM_BACKING_WRITE = 1 << 1,   /* pwrite, fua or not */
  MEM_BACKING_TRIM = 1 << 2,
  MEM_BACKING_ZERO = 1 << 3,
  MEM_BACKING_FLUSH = 1 << 4,
  /* Every call that changes data. */
  MEM_BACKING_MODIFY = MEM_BACKING_WRITE | MEM_BACKING_TRIM | MEM_BACKING_ZERO,
  /* Every call with a range.  Flush has none, so it is left out: a flush
   * is caught only by gates and faults that name MEM_BACKING_FLUSH. */
  MEM_BACKING_ANY = MEM_BACKING_READ | MEM_BACKING_MODIFY,
};

enum mem_backing_gate_point {
  MEM_BACKING_BEFORE_IO,        /* parked before touching the data */
  MEM_BACKING_AFTER_IO,         /* data read/written, not yet returned */
};

enum mem_backing_crash_mode {
  MEM_BACKING_LOSE_ALL,         /* revert every unflushed write */
  MEM_BACKING_KEEP_ALL,         /* keep them all (cache drained in time) */
  MEM_BACKING_RANDOM,           /* keep or revert each, from a seed */
};

struct mem_backing_stats {
  uint64_t reads, writes, fua_writes, flushes, trims, zeros;
  uint64_t bytes_read, bytes_written;   /* pread / pwrite bytes */
  uint64_t faults;              /* requests failed by injection */
  uint64_t invalid;             /* requests refused: count 0, past size */
};

/* Life cycle.  mem_backing_free requires that no call is in flight; gates
 * still armed are discarded (their handles become invalid). */
extern struct mem_backing *mem_backing_new (uint64_t size_bytes);
extern void mem_backing_free (struct mem_backing *mb);
/* The engine's view: ops + opaque, valid until mem_backing_free. */
extern struct bcf_backing mem_backing_get (struct mem_backing *mb);

/* Latency in microseconds added to each request before it touches the
 * data, with no lock held.  Write latency covers pwrite, trim, zero and
 * flush.  0 = none. */
extern void mem_backing_set_read_latency (struct mem_backing *mb,
                                          uint32_t usec);
extern void mem_backing_set_write_latency (struct mem_backing *mb,
                                           uint32_t usec);

/* Fail the Nth call of one kind of request (a single MEM_BACKING_* bit),
 * counting from now, 1 = the next one, with -err; once.  n = 0 disarms.
 * err may be given as EIO or -EIO. */
extern void mem_backing_fail_nth (struct mem_backing *mb,
                                  enum mem_backing_op op,
                                  uint64_t n, int err);
static inline void
mem_backing_fail_nth_read (struct mem_backing *mb, uint64_t n, int err)
{
  mem_backing_fail_nth (mb, MEM_BACKING_READ, n, err);
}
static inline void
mem_backing_fail_nth_write (struct mem_backing *mb, uint64_t n, int err)
{
  mem_backing_fail_nth (mb, MEM_BACKING_WRITE, n, err);
}

/* Fail every request of a kind in ops (a set of ranged kinds) that
 * overlaps [offset, offset+len) with -err, until cleared.  len 0 means
 * the whole store.  Returns an id for mem_backing_fail_range_clear.  At
 * most 16 at once (aborts beyond). */
extern int mem_backing_fail_range (struct mem_backing *mb, unsigned ops,
                                   uint64_t offset, uint64_t len, int err);
extern void mem_backing_fail_range_clear (struct mem_backing *mb, int id);

/* Make every flush fail with -err until called again with 0.  A failed
 * flush makes nothing durable. */
extern void mem_backing_fail_flush (struct mem_backing *mb, int err);

/* Disarm every fault (nth, range, flush).  Latency is left alone. */
extern void mem_backing_clear_faults (struct mem_backing *mb);

/* Gates.  Arm: the next request whose kind is in ops and which overlaps
 * [offset, offset+len) (len 0: anywhere; flush: whenever ops has
 * MEM_BACKING_FLUSH) parks at point until the gate is released.  One
 * request only: later ones pass.  Gates armed earlier catch first. */
extern struct mem_backing_gate *
mem_backing_gate_arm (struct mem_backing *mb, unsigned ops,
                      enum mem_backing_gate_point point,
                      uint64_t offset, uint64_t len);
/* Wait until a request is parked at the gate.  true when one is; false
 * after timeout_ms (0: just look), so tests never hang. */
extern bool mem_backing_gate_wait_hit (struct mem_backing_gate *gate,
                                       unsigned timeout_ms);
/* Let the parked request go, or disarm the gate if none was caught.
 * Frees the handle: every armed gate must be released exactly once. */
extern void mem_backing_gate_release (struct mem_backing_gate *gate);

/* Crash model.  Turning tracking on starts an empty undo log: whatever
 * the store holds then counts as durable.  Turning it off drops the log. */
extern void mem_backing_track_crash (struct mem_backing *mb, bool on);
/* Number of unflushed writes (pwrite, trim, zero) in the undo log. */
extern uint64_t mem_backing_unflushed (struct mem_backing *mb);
/* Simulate power loss of a volatile write cache: revert unflushed writes
 * as mode says (RANDOM: seeded, deterministic for one seed and one
 * history).  Afterwards everything counts as durable.  Call with no
 * request in flight.  Returns how many writes were reverted. */
extern uint64_t mem_backing_crash (struct mem_backing *mb,
                                   enum mem_backing_crash_mode mode,
                                   uint64_t seed);
/* The same, deciding each unflushed write with keep(): called newest
 * first with i = 0, 1, ... and the write's range; durable writes are
 * always kept and not shown.  For tests that model the outcome. */
typedef bool mem_backing_keep_fn (void *arg, uint64_t i,
                                  uint64_t offset, uint64_t len);
extern uint64_t mem_backing_crash_with (struct mem_backing *mb,
                                        mem_backing_keep_fn *keep,
                                        void *arg);

/* Counters. */
extern void mem_backing_get_stats (struct mem_backing *mb,
                                   struct mem_backing_stats *stats);
/* Zero the counters and forget recorded reads. */
extern void mem_backing_reset_stats (struct mem_backing *mb);
/* How many preads (since creation or the last reset) overlapped
 * [offset, offset+len).  0 proves a range was served with no backing
 * read.  Every read is recorded: 16 bytes each. */
extern uint64_t mem_backing_read_count_range (struct mem_backing *mb,
                                              uint64_t offset,
                                              uint64_t len);
/* 4 KiB pages currently allocated. */
extern uint64_t mem_backing_allocated_pages (struct mem_backing *mb);

/* Direct access for tests, bypassing counters, latency, gates and faults
 * (but thread safe).  A poke is durable at once.  Abort outside the
 * store. */
extern void mem_backing_peek (struct mem_backing *mb, void *buf,
                              size_t len, uint64_t offset);
extern void mem_backing_poke (struct mem_backing *mb, const void *buf,
                              size_t len, uint64_t offset);

#endif /* BCACHEFILTER_MEM_BACKING_H */
