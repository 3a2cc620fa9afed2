/* bcachefilter engine: sequential stream detection.  See seqdetect.h.
 *
 * This is the sequential part of bcache's check_should_bypass()
 * (drivers/md/bcache/request.c), per cache instead of per backing
 * device: a table of RECENT_IO (128, bcache's RECENT_IO_BITS = 7) recent
 * streams, each remembering where it ended ("last"), how many bytes it
 * has seen ("sequential") and when it expires (5 s after it was last
 * continued).  The entries are chained in RECENT_IO hash buckets keyed
 * by "last" and in an LRU list.  A request looks up its start offset in
 * the hash: an unexpired entry ending exactly there is its stream;
 * otherwise the least recently used entry is recycled (expired or not,
 * as bcache does) with a zero count.  Either way the entry then adds the
 * request's bytes (saturating), is rehashed under its new end and moves
 * to the LRU tail.  Entries never used yet are in no hash chain, so
 * they never match (bcache parks them in an extra, unsearched bucket).
 *
 * Differences from bcache: offsets and counts are in bytes, not sectors;
 * there is no per-task EWMA (sequential_io_avg): NBD requests carry no
 * task identity, so the caller compares the returned stream size alone
 * with the cutoff.  A zero-length request is not accounted (returns 0).
 *
 * Locking: one mutex around the whole table, held for a hash-chain walk
 * and a few pointer updates (bcache uses a spinlock the same way).  The
 * clock is read under it too, so time never goes backwards per entry.
 */
#include "config.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "util.h"
#include "seqdetect.h"

#define RECENT_IO_BITS 7
#define RECENT_IO      (1 << RECENT_IO_BITS)
#define EXPIRE_NS      (UINT64_C (5) * 1000 * 1000 * 1000)

struct io {
  struct io *hnext, **hpprev;       /* hash chain (hpprev NULL: unhashed) */
  struct io *lprev, *lnext;         /* LRU list, head = least recent */
  uint64_t last;                    /* where the stream ended */
  uint64_t deadline;                /* forgotten from then (ns) */
  uint64_t sequential;              /* bytes in the stream */
};

struct bcf_seqdetect {
  pthread_mutex_t lock;
  uint64_t (*now_ns) (void);
  struct io *hash[RECENT_IO];
  struct io *lru_head, *lru_tail;
  struct io io[RECENT_IO];
};

static unsigned
hash_of (uint64_t last)
{
  /* Multiplicative (golden ratio) hash, like the kernel's hash_64. */
  return (unsigned) ((last * UINT64_C (0x61C8864680B583EB)) >>
                     (64 - RECENT_IO_BITS));
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

uint64_t
bcf_seqdetect_account (struct bcf_seqdetect *s, uint64_t offset,
                       uint64_t len)
{
  struct io *i;
  uint64_t now, seq;

  if (len == 0)
    return 0;
  pthread_mutex_lock (&s->lock);
  now = s->now_ns ();
  for (i = s->hash[hash_of (offset)]; i != NULL; i = i->hnext)
    if (i->last == offset && now < i->deadline)
      break;
  if (i == NULL) {
    i = s->lru_head;
    i->sequential = 0;
  }
  i->sequential = i->sequential + len < i->sequential ?
    UINT64_MAX : i->sequential + len;
  i->last = offset + len < offset ? UINT64_MAX : offset + len;
  i->deadline = now + EXPIRE_NS;
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
