/* bcachefilter engine: sequential stream detection.  See seqdetect.h.
 *
 * This is the sequential part of bcache's check_should_bypass()
 * (drivers/md/bcache/request.c), per cache instead of per backing
 * device: a table of RECENT_IO (128, bcache's RECENT_IO_BITS = 7) recent
 * streams, each remembering where it ended ("last"), how many bytes it
 * has seen ("sequential") and when it expires (5 s after it was last
 * continued).  The entries are chained in RECENT_IO hash buckets and in
 * an LRU list.  A request looks for its stream; otherwise the least
 * recently used entry is recycled (expired or not, as bcache does) with
 * a zero count.  Either way the entry then takes the request, is
 * rehashed under its new end and moves to the LRU tail.  Entries never
 * used yet are in no hash chain, so they never match (bcache parks them
 * in an extra, unsearched bucket).
 *
 * Out-of-order arrivals (the one change to bcache's rule).  bcache sees
 * a stream's bios in order; an NBD server does not: a client's 16
 * sequential 4 KiB requests in flight are taken by 16 nbdkit threads and
 * reach the filter slightly shuffled (0, 8K, 4K, 12K, ...), and bcache's
 * exact rule ("starts where a stream ended") then never sees a stream
 * longer than a few requests.  So a request continues the stream whose
 * end is exactly its start (bcache's match, preferred), or else one whose
 * end lies within WINDOW bytes of its start, before or after.  The stream
 * counts the sectors the request covers that it had not covered yet: each
 * stream remembers which sectors of the last WINDOW before its end it has
 * seen (a bitmap, `seen`).  So a shuffled stream counts each byte once, a
 * strictly sequential one exactly as bcache, a strided one (4 KiB every
 * 64 KiB) only what it reads, never the gaps, and re-reads of a hot range
 * nothing after the first.  Where several entries match, the most
 * recently used wins (for an exact match that is bcache's: its hash
 * chain keeps the most recently rehashed entry first).  Entries are
 * hashed by their end's WINDOW-sized granule, so the candidates for a
 * request lie in three chains: its granule and the two next to it.
 *
 * Differences from bcache besides that: offsets and counts are in bytes,
 * not sectors; there is no per-task EWMA (sequential_io_avg): NBD
 * requests carry no task identity, so the caller compares the returned
 * stream size alone with the cutoff.  A zero-length request is not
 * accounted (returns 0).
 *
 * Locking: one mutex around the whole table, held for three hash-chain
 * walks and a few pointer updates (bcache uses a spinlock the same way).
 * The clock is read under it too, so time never goes backwards per entry.
 */
#include "config.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util.h"
#include "seqdetect.h"

#define RECENT_IO_BITS 7
#define RECENT_IO      (1 << RECENT_IO_BITS)
#define EXPIRE_NS      (UINT64_C (5) * 1000 * 1000 * 1000)
#define WINDOW         BCF_SEQDETECT_WINDOW
#define WINDOW_SECTORS (WINDOW >> 9)
#define SEEN_WORDS     (WINDOW_SECTORS / 64)

struct io {
  struct io *hnext, **hpprev;       /* hash chain (hpprev NULL: unhashed) */
  struct io *lprev, *lnext;         /* LRU list, head = least recent */
  uint64_t last;                    /* where the stream ended */
  uint64_t deadline;                /* forgotten from then (ns) */
  uint64_t sequential;              /* bytes in the stream */
  uint64_t stamp;                   /* when it was last used (a count) */
  /* Bit i: sector top - 1 - i was covered, for the WINDOW_SECTORS sectors
   * below top (the sector after the stream's end, rounded up). */
  uint64_t top;
  uint64_t seen[SEEN_WORDS];
};

struct bcf_seqdetect {
  pthread_mutex_t lock;
  uint64_t (*now_ns) (void);
  struct io *hash[RECENT_IO];
  struct io *lru_head, *lru_tail;
  uint64_t stamp;                   /* requests accounted */
  struct io io[RECENT_IO];
};

/* The chain of a granule (an offset / WINDOW). */
static unsigned
hash_of_granule (uint64_t g)
{
  /* Multiplicative (golden ratio) hash, like the kernel's hash_64. */
  return (unsigned) ((g * UINT64_C (0x61C8864680B583EB)) >>
                     (64 - RECENT_IO_BITS));
}

static unsigned
hash_of (uint64_t last)
{
  return hash_of_granule (last / WINDOW);
}

static void
hash_del (struct io *i)
{
  if (i->hpprev == NULL)
    return;
  *i->hpprev = i->hnext;
  if (i->hnext)
    i->hnext->hpprev = i->hpprev;
  i->hnext = NULL;
  i->hpprev = NULL;
}

static void
hash_add (struct bcf_seqdetect *s, struct io *i)
{
  struct io **head = &s->hash[hash_of (i->last)];

  i->hnext = *head;
  if (*head)
    (*head)->hpprev = &i->hnext;
  *head = i;
  i->hpprev = head;
}

static void
lru_del (struct bcf_seqdetect *s, struct io *i)
{
  if (i->lprev) i->lprev->lnext = i->lnext; else s->lru_head = i->lnext;
  if (i->lnext) i->lnext->lprev = i->lprev; else s->lru_tail = i->lprev;
  i->lprev = i->lnext = NULL;
}

static void
lru_add_tail (struct bcf_seqdetect *s, struct io *i)
{
  i->lprev = s->lru_tail;
  i->lnext = NULL;
  if (s->lru_tail) s->lru_tail->lnext = i; else s->lru_head = i;
  s->lru_tail = i;
}

struct bcf_seqdetect *
bcf_seqdetect_new (void)
{
  struct bcf_seqdetect *s = calloc (1, sizeof *s);

  if (s == NULL)
    return NULL;
  pthread_mutex_init (&s->lock, NULL);
  s->now_ns = bcf_now_ns;
  for (unsigned k = 0; k < RECENT_IO; k++)
    lru_add_tail (s, &s->io[k]);
  return s;
}

void
bcf_seqdetect_free (struct bcf_seqdetect *s)
{
  if (s == NULL)
    return;
  pthread_mutex_destroy (&s->lock);
  free (s);
}

/* Is i, unexpired, the stream of a request starting at offset: exact
 * (its end is offset), or near (its end within WINDOW of offset)? */
static bool
ends_exactly (const struct io *i, uint64_t offset, uint64_t now)
{
  return i->last == offset && now < i->deadline;
}

static bool
ends_near (const struct io *i, uint64_t offset, uint64_t now)
{
  uint64_t d = i->last > offset ? i->last - offset : offset - i->last;

  return d <= WINDOW && now < i->deadline;
}

/* The most recently used entry of the chains of offset's granule and its
 * two neighbours (every entry whose end is within WINDOW of offset) that
 * match says, or NULL. */
static struct io *
find_stream (struct bcf_seqdetect *s, uint64_t offset, uint64_t now,
             bool (*match) (const struct io *, uint64_t, uint64_t))
{
  const uint64_t g = offset / WINDOW;
  struct io *best = NULL;

  for (int d = -1; d <= 1; d++) {
    if ((d < 0 && g == 0) || (d > 0 && g == UINT64_MAX / WINDOW))
      continue;
    for (struct io *i = s->hash[hash_of_granule (g + (uint64_t) d)]; i;
         i = i->hnext)
      if (match (i, offset, now) && (!best || i->stamp > best->stamp))
        best = i;
  }
  return best;
}

/* Move i's window up so that it ends at sector top (> i->top). */
static void
seen_advance (struct io *i, uint64_t top)
{
  uint64_t d = top - i->top;

  i->top = top;
  if (d >= WINDOW_SECTORS) {
    memset (i->seen, 0, sizeof i->seen);
    return;
  }
  /* A shift left by d bits of the multi-word bitmap (word 0 lowest). */
  for (int w = SEEN_WORDS - 1; w >= 0; w--) {
    uint64_t v = 0;
    int from = w - (int) (d / 64);
    unsigned b = (unsigned) (d % 64);

    if (from >= 0) {
      v = i->seen[from] << b;
      if (b && from > 0)
        v |= i->seen[from - 1] >> (64 - b);
    }
    i->seen[w] = v;
  }
}

/* Mark sectors [s, e) seen in i (whose window ends at or above e); the
 * bytes that were not seen before.  Sectors below the window count as
 * new: nothing remembers them. */
static uint64_t
seen_mark (struct io *i, uint64_t s, uint64_t e)
{
  const uint64_t low = i->top > WINDOW_SECTORS ? i->top - WINDOW_SECTORS : 0;
  uint64_t fresh = 0;

  if (s < low) {                /* below the window: new, uncounted */
    fresh = (e < low ? e : low) - s;
    s = low;
  }
  for (uint64_t x = s; x < e; x++) {
    uint64_t bit = i->top - 1 - x;

    if (!(i->seen[bit / 64] & (UINT64_C (1) << (bit % 64)))) {
      i->seen[bit / 64] |= UINT64_C (1) << (bit % 64);
      fresh++;
    }
  }
  /* Saturating: a request of 2^64 - 1 bytes has 2^55 sectors. */
  return fresh > (UINT64_MAX >> 9) ? UINT64_MAX : fresh << 9;
}

uint64_t
bcf_seqdetect_account (struct bcf_seqdetect *s, uint64_t offset,
                       uint64_t len)
{
  struct io *i;
  uint64_t now, seq, end;
  bool exact;

  if (len == 0)
    return 0;
  end = offset + len < offset ? UINT64_MAX : offset + len;
  pthread_mutex_lock (&s->lock);
  now = s->now_ns ();
  exact = (i = find_stream (s, offset, now, ends_exactly)) != NULL;
  if (!i && !(i = find_stream (s, offset, now, ends_near))) {
    i = s->lru_head;
    i->sequential = 0;
    i->last = offset;
    i->top = offset >> 9;
    memset (i->seen, 0, sizeof i->seen);
    exact = true;
  }
  /* A request that continues the stream exactly (or starts one) counts
   * whole, as in bcache; one near it, the sectors it had not seen. */
  {
    uint64_t ss = offset >> 9, se = (end >> 9) + ((end & 511) != 0);
    uint64_t add;

    if (se > i->top)
      seen_advance (i, se);
    add = seen_mark (i, ss, se);
    if (exact || add > len)
      add = len;
    i->sequential = i->sequential + add < i->sequential ?
      UINT64_MAX : i->sequential + add;
    if (end > i->last)
      i->last = end;
  }
  i->deadline = now + EXPIRE_NS;
  i->stamp = ++s->stamp;
  hash_del (i);
  hash_add (s, i);
  lru_del (s, i);
  lru_add_tail (s, i);
  seq = i->sequential;
  pthread_mutex_unlock (&s->lock);
  return seq;
}

void
bcf_seqdetect_test_clock (struct bcf_seqdetect *s, uint64_t (*now_ns) (void))
{
  pthread_mutex_lock (&s->lock);
  s->now_ns = now_ns ? now_ns : bcf_now_ns;
  pthread_mutex_unlock (&s->lock);
}
