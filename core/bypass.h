/* bcachefilter: the in-flight backing-write tracker ("bypass tracker").
 *
 * Why: a read miss that fetches old data from the backing store while a
 * write replaces it there must not insert that old data into the cache
 * (DESIGN.md "Why it exists" 2, the seed race).  Every write that reaches
 * the backing store registers here for the whole of its backing write;
 * a read miss checks here after inserting its check key and does not
 * cache if an overlapping write is in flight.
 *
 * Two layers (DESIGN.md "In-flight write ranges"):
 * - the seed's chunk counters: one 32-bit count of registered writes per
 *   32 MiB chunk of the backing store, in lazily allocated 4 KiB pages
 *   (1024 chunks = 32 GiB per page), a page freed again when no write is
 *   registered in it, and a small reserve pool of pages so registering
 *   never fails, even when malloc does.  A miss in chunks whose counts
 *   are all 0 needs nothing more: that check is lock-free (the read-miss
 *   path).  Memory: the page table is 8 bytes per 32 GiB (256 B per TiB)
 *   idle, the pages at most 128 KiB per TiB with every page allocated,
 *   plus a fixed reserve of 4 pages (16 KiB) whatever the size;
 * - behind them, the exact ranges of the writes in flight, in
 *   registration order: a miss in a busy chunk skips caching only if a
 *   write that really overlaps it (byte ranges) is in flight.  The record
 *   of a write is its token (on the writer's stack): memory is bounded by
 *   the number of writes in flight, and nothing is allocated for it.
 *
 * Ordering: overlapping writes reach the backing store in registration
 * order.  A writer calls bcf_bypass_wait_turn after registering: it
 * returns once every overlapping write registered before it has called
 * bcf_bypass_done (its backing write completed).  So the cache's order of
 * overlapping writes and the backing store's are the same (request.c
 * argues why that matters).  Earlier writes never wait for later ones, so
 * no cycle of waits can form.
 *
 * Absorption: a client write registered with BCF_BYPASS_ABSORB (its
 * bytes are exactly its range) that covers an earlier such write still
 * waiting for its turn stands in for it: the earlier write counts as
 * done at once (later writes no longer wait for it), never writes, and
 * completes with the later write's result when that one ends
 * (bcf_bypass_wait_turn_write).  Neither was acknowledged before the
 * other arrived, so the two may land in either order; landing the
 * earlier first and the later over all of it leaves what the later one
 * leaves.  A FUA write is absorbed only by a FUA write.  On a block
 * written over and over (a hot block of a VM's filesystem), a queue of
 * k waiting writes then costs one backing write, not k in series.
 */
#ifndef BCACHEFILTER_BYPASS_H
#define BCACHEFILTER_BYPASS_H

#include <stdbool.h>
#include <stdint.h>

#define BCF_BYPASS_CHUNK_SHIFT 25          /* 32 MiB chunks */

struct bcf_bypass;

/* One registered write: its chunks (for the counters), its exact byte
 * range, and its place in the in-flight list.  Owned by the writer;
 * opaque to it. */
struct bcf_bypass_token {
  uint64_t first, nchunks;      /* chunks [first, first + nchunks) */
  uint64_t start, end;          /* bytes, clamped to the size */
  uint64_t seq;                 /* registration order */
  bool done;                    /* its backing write has completed (or
                                   it was absorbed: it will make none) */
  unsigned flags;               /* BCF_BYPASS_ABSORB, BCF_BYPASS_FUA */
  bool waiting;                 /* in wait_turn_write, before its turn */
  bool absorbed_done;           /* its absorber ended, with absorbed_rc */
  int absorbed_rc;
  struct bcf_bypass_token *absorber;    /* the later write standing in */
  struct bcf_bypass_token *prev, *next;
};

/* Flags of bcf_bypass_begin_write. */
#define BCF_BYPASS_ABSORB 1u    /* a client write of exactly its range:
                                   may absorb and be absorbed */
#define BCF_BYPASS_FUA    2u    /* ... with FUA */

struct bcf_bypass_mem {
  uint64_t bytes;             /* now: page table + pages + reserve */
  uint64_t peak_bytes;        /* high-water mark of bytes */
  uint64_t pages;             /* pages allocated now */
  uint64_t reserve_pages;     /* pages in the reserve pool now */
  uint64_t reserve_uses;      /* times the reserve served an allocation */
  uint64_t in_flight;         /* registered writes now */
  uint64_t in_flight_peak;    /* ... at most */
  uint64_t exact_checks;      /* busy() calls that needed the exact ranges */
  uint64_t waits;             /* wait_turn calls that had to wait */
  uint64_t absorbed;          /* writes a later one stood in for */
  uint64_t waiting;           /* writes in wait_turn_write now, before
                                 their turn */
  uint64_t wait_ns, wait_max_ns;  /* how long, in all and at most */
};

/* A tracker for a backing store of size bytes; NULL if out of memory. */
struct bcf_bypass *bcf_bypass_new (uint64_t size);
void bcf_bypass_free (struct bcf_bypass *t);

/* Register a write over [offset, offset + len) (clamped to the size).
 * Never fails and never waits for other writes. */
void bcf_bypass_begin (struct bcf_bypass *t, uint64_t offset, uint64_t len,
                       struct bcf_bypass_token *tok);
/* Wait until every write registered before tok that overlaps it is done
 * (bcf_bypass_done or bcf_bypass_end).  Returns the nanoseconds waited. */
uint64_t bcf_bypass_wait_turn (struct bcf_bypass *t,
                               struct bcf_bypass_token *tok);
/* A client write: begin with flags; then wait_turn_write, which also
 * lets tok absorb the earlier writes it covers that are still waiting,
 * and returns true if a later write absorbed tok itself: the write is
 * complete, with the result in *rc (the caller makes no backing write
 * and calls bcf_bypass_end_write with that result).  False: tok's turn,
 * as bcf_bypass_wait_turn. */
void bcf_bypass_begin_write (struct bcf_bypass *t, uint64_t offset,
                             uint64_t len, unsigned flags,
                             struct bcf_bypass_token *tok);
bool bcf_bypass_wait_turn_write (struct bcf_bypass *t,
                                 struct bcf_bypass_token *tok, int *rc);
/* tok's backing write has completed: later overlapping writes may go. */
void bcf_bypass_done (struct bcf_bypass *t, struct bcf_bypass_token *tok);
/* Unregister what begin registered.  The writes tok absorbed complete
 * with rc (bcf_bypass_end: -EIO; a write that may absorb ends with its
 * result). */
void bcf_bypass_end (struct bcf_bypass *t, struct bcf_bypass_token *tok);
void bcf_bypass_end_write (struct bcf_bypass *t, struct bcf_bypass_token *tok,
                           int rc);

/* Is a write that overlaps [offset, offset + len) registered?  Lock-free
 * when no write is registered in the chunks of the range (the common
 * case); else it looks at the exact ranges under the tracker's lock.
 * Everything registered before the caller's last acquire of a lock that
 * the registering thread released after begin() is seen. */
bool bcf_bypass_busy (struct bcf_bypass *t, uint64_t offset, uint64_t len);

void bcf_bypass_get_mem (struct bcf_bypass *t, struct bcf_bypass_mem *m);

/* Tests only: make busy() always answer false, to show that the seed-race
 * tests fail without the tracker. */
void bcf_bypass_test_disable (struct bcf_bypass *t, bool disabled);
/* Tests only: make wait_turn return at once, to show that the ordering
 * tests fail without the ordering. */
void bcf_bypass_test_disable_ordering (struct bcf_bypass *t, bool disabled);

/* Tests only: make every page allocation (malloc) fail while set, to
 * exercise the reserve pool and the wait for a free page. */
void bcf_bypass_test_fail_alloc (struct bcf_bypass *t, bool fail);

#endif /* BCACHEFILTER_BYPASS_H */
