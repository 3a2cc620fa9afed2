/* bcachefilter: the in-flight backing-write tracker ("bypass tracker").
 *
 * Why: a read miss that fetches old data from the backing store while a
 * write replaces it there must not insert that old data into the cache
 * (DESIGN.md "Why it exists" 2, the seed race).  Every write that reaches
 * the backing store registers here for the whole of its backing write;
 * a read miss checks here after inserting its check key and does not
 * cache if an overlapping write is in flight.
 *
 * Granularity: one 32-bit word per 32 MiB chunk of the backing store,
 * kept in lazily allocated 4 KiB pages (1024 chunks = 32 GiB per page);
 * a page is freed again when no write is registered in it.  A small
 * reserve pool of pages means registering never fails, even when malloc
 * does.  Memory: the page table is 8 bytes per 32 GiB (256 B per TiB)
 * idle, and the pages at most 128 KiB per TiB with every page allocated;
 * on top of that the reserve pool is a fixed 4 pages (16 KiB) whatever
 * the size, the price of never failing.
 *
 * The word of a chunk holds the number of registered writes and an epoch
 * that every registration advances; a writer's token records the words
 * its registration produced, so bcf_bypass_alone() can tell whether the
 * writer has been the only writer in its chunks for its whole lifetime
 * (the rule for inserting writethrough data as clean).
 *
 * bcf_bypass_busy() is lock-free (the read-miss path); begin/end may
 * take a lock.
 */
#ifndef BCACHEFILTER_BYPASS_H
#define BCACHEFILTER_BYPASS_H

#include <stdbool.h>
#include <stdint.h>

#define BCF_BYPASS_CHUNK_SHIFT 25          /* 32 MiB chunks */
#define BCF_BYPASS_TOKEN_CHUNKS 4          /* chunks a token remembers */

struct bcf_bypass;

/* What one registration did: the chunks [first, first + nchunks) and the
 * word each chunk held right after this registration (for alone()). */
struct bcf_bypass_token {
  uint64_t first, nchunks;
  uint32_t word[BCF_BYPASS_TOKEN_CHUNKS];
};

struct bcf_bypass_mem {
  uint64_t bytes;             /* now: page table + pages + reserve */
  uint64_t peak_bytes;        /* high-water mark of bytes */
  uint64_t pages;             /* pages allocated now */
  uint64_t reserve_pages;     /* pages in the reserve pool now */
  uint64_t reserve_uses;      /* times the reserve served an allocation */
  uint64_t in_flight;         /* registered writes now */
};

/* A tracker for a backing store of size bytes; NULL if out of memory. */
struct bcf_bypass *bcf_bypass_new (uint64_t size);
void bcf_bypass_free (struct bcf_bypass *t);

/* Register a write over [offset, offset + len) (len > 0; clamped to the
 * size).  Never fails. */
void bcf_bypass_begin (struct bcf_bypass *t, uint64_t offset, uint64_t len,
                       struct bcf_bypass_token *tok);
/* Unregister what begin registered. */
void bcf_bypass_end (struct bcf_bypass *t, const struct bcf_bypass_token *tok);

/* Is a write registered in any chunk overlapping [offset, offset + len)?
 * Lock-free.  Everything registered before the caller's last acquire of a
 * lock that the registering thread released after begin() is seen. */
bool bcf_bypass_busy (struct bcf_bypass *t, uint64_t offset, uint64_t len);

/* Has tok's writer been the only registered writer in each of its chunks
 * since it registered?  False when unsure (more chunks than a token
 * remembers). */
bool bcf_bypass_alone (struct bcf_bypass *t, const struct bcf_bypass_token *tok);

void bcf_bypass_get_mem (struct bcf_bypass *t, struct bcf_bypass_mem *m);

/* Tests only: make busy() always answer false, to show that the seed-race
 * tests fail without the tracker. */
void bcf_bypass_test_disable (struct bcf_bypass *t, bool disabled);

/* Tests only: make every page allocation (malloc) fail while set, to
 * exercise the reserve pool and the wait for a free page. */
void bcf_bypass_test_fail_alloc (struct bcf_bypass *t, bool fail);

#endif /* BCACHEFILTER_BYPASS_H */
