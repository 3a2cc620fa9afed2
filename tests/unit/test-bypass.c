/* Unit tests for core/bypass: the in-flight backing-write tracker.
 *
 * - begin/end/busy semantics on chunk and page boundaries, size 0,
 *   sizes that are not a multiple of 32 MiB, clamping, long ranges: the
 *   chunks a registration counts in, and busy() exact to the byte (a
 *   write in the same chunk that does not overlap is not busy);
 * - the ordering of overlapping writes (wait_turn, done) in every
 *   interleaving: earlier and later, overlapping or not, done or ended;
 * - memory figures for 1 TiB, 16 TiB and an odd size, idle and at peak,
 *   against DESIGN.md's bounds (printed too);
 * - the reserve pool and the wait for a page under simulated malloc
 *   failure;
 * - a random model test (one thread) against per-chunk counters and the
 *   exact ranges;
 * - a multi-threaded stress test: writers register random ranges and
 *   publish some of them through a mutex (the btree lock of the request
 *   path); readers that take the mutex, see a published writer and then
 *   call busy() must see it busy.  Meant to run under TSan/ASan too.
 *   TEST_BYPASS_DISABLE=1 switches the tracker off (busy() always false)
 *   to show that the checker then fails.
 *
 * The seed comes from TEST_SEED or the clock and is printed first.
 */
#include "config.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <check.h>

#include "bypass.h"
#include "testlib.h"

#define CHUNK   (UINT64_C (1) << BCF_BYPASS_CHUNK_SHIFT)   /* 32 MiB */
#define PAGE_CHUNKS 1024
#define PAGE_SPAN (CHUNK * PAGE_CHUNKS)                     /* 32 GiB */
#define TiB     (UINT64_C (1) << 40)
#define KiB     UINT64_C (1024)

static unsigned seed;

/* xorshift64*: small, seedable, reproducible; one state per thread. */
static uint64_t
rnd_r (uint64_t *s)
{
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}
static uint64_t rnd_below_r (uint64_t *s, uint64_t n)
{
  return n ? rnd_r (s) % n : 0;
}

static struct bcf_bypass_mem
mem (struct bcf_bypass *t)
{
  struct bcf_bypass_mem m;

  bcf_bypass_get_mem (t, &m);
  return m;
}

/* ---- Exact semantics --------------------------------------------------- */

START_TEST (test_boundaries)
{
  struct bcf_bypass *t = bcf_bypass_new (TiB);
  struct bcf_bypass_token a, b;

  ck_assert_ptr_nonnull (t);
  ck_assert (!bcf_bypass_busy (t, 0, TiB));

  /* One byte at the start of chunk 0. */
  bcf_bypass_begin (t, 0, 1, &a);
  ck_assert_uint_eq (a.first, 0);
  ck_assert_uint_eq (a.nchunks, 1);
  ck_assert (bcf_bypass_busy (t, 0, 1));
  ck_assert (!bcf_bypass_busy (t, 1, 1));          /* same chunk, no overlap */
  ck_assert (!bcf_bypass_busy (t, CHUNK - 1, 1));
  ck_assert (!bcf_bypass_busy (t, CHUNK, 1));
  ck_assert (bcf_bypass_busy (t, 0, 2));
  ck_assert (!bcf_bypass_busy (t, CHUNK, TiB));    /* clamped */
  ck_assert (!bcf_bypass_busy (t, 0, 0));
  ck_assert_uint_gt (mem (t).exact_checks, 0);
  ck_assert_uint_eq (mem (t).pages, 1);
  ck_assert_uint_eq (mem (t).in_flight, 1);
  bcf_bypass_end (t, &a);
  ck_assert (!bcf_bypass_busy (t, 0, TiB));
  ck_assert_uint_eq (mem (t).pages, 0);
  ck_assert_uint_eq (mem (t).in_flight, 0);

  /* Two bytes straddling chunks 1|2. */
  bcf_bypass_begin (t, 2 * CHUNK - 1, 2, &a);
  ck_assert_uint_eq (a.first, 1);
  ck_assert_uint_eq (a.nchunks, 2);
  ck_assert (!bcf_bypass_busy (t, 0, CHUNK));
  ck_assert (!bcf_bypass_busy (t, CHUNK, 1));
  ck_assert (bcf_bypass_busy (t, CHUNK, CHUNK));
  ck_assert (bcf_bypass_busy (t, 2 * CHUNK, 1));
  ck_assert (!bcf_bypass_busy (t, 2 * CHUNK + 1, 1));
  ck_assert (!bcf_bypass_busy (t, 3 * CHUNK - 1, 1));
  ck_assert (!bcf_bypass_busy (t, 3 * CHUNK, CHUNK));
  bcf_bypass_end (t, &a);

  /* Straddling the page boundary (chunks 1023|1024): two pages. */
  bcf_bypass_begin (t, PAGE_SPAN - 512, 1024, &a);
  ck_assert_uint_eq (a.first, PAGE_CHUNKS - 1);
  ck_assert_uint_eq (a.nchunks, 2);
  ck_assert_uint_eq (mem (t).pages, 2);
  ck_assert (bcf_bypass_busy (t, PAGE_SPAN - 1, 1));
  ck_assert (bcf_bypass_busy (t, PAGE_SPAN, 1));
  ck_assert (bcf_bypass_busy (t, PAGE_SPAN + 511, 1));
  ck_assert (!bcf_bypass_busy (t, PAGE_SPAN + 512, 1));
  ck_assert (!bcf_bypass_busy (t, PAGE_SPAN + CHUNK - 1, 1));
  ck_assert (!bcf_bypass_busy (t, PAGE_SPAN + CHUNK, 1));
  ck_assert (!bcf_bypass_busy (t, PAGE_SPAN - CHUNK - 1, 1));
  /* A second writer in the same chunk: still busy after one ends. */
  bcf_bypass_begin (t, PAGE_SPAN, 4096, &b);
  bcf_bypass_end (t, &a);
  ck_assert (!bcf_bypass_busy (t, PAGE_SPAN - 1, 1));
  ck_assert (bcf_bypass_busy (t, PAGE_SPAN, 1));
  ck_assert (!bcf_bypass_busy (t, PAGE_SPAN + 4096, 1));
  ck_assert_uint_eq (mem (t).pages, 1);
  bcf_bypass_end (t, &b);
  ck_assert_uint_eq (mem (t).pages, 0);

  /* A range over many chunks and pages (more than a token remembers). */
  bcf_bypass_begin (t, 5 * CHUNK + 7, 3 * PAGE_SPAN, &a);
  ck_assert_uint_eq (a.first, 5);
  ck_assert_uint_eq (a.nchunks, 3 * PAGE_CHUNKS + 1);
  ck_assert_uint_eq (mem (t).pages, 4);
  ck_assert (!bcf_bypass_busy (t, 0, 5 * CHUNK));
  ck_assert (!bcf_bypass_busy (t, 5 * CHUNK, 7));
  ck_assert (bcf_bypass_busy (t, 5 * CHUNK, 8));
  ck_assert (bcf_bypass_busy (t, 2 * PAGE_SPAN + 12345, 1));
  ck_assert (bcf_bypass_busy (t, 3 * PAGE_SPAN + 5 * CHUNK + 6, 1));
  ck_assert (!bcf_bypass_busy (t, 3 * PAGE_SPAN + 5 * CHUNK + 7, 1));
  ck_assert (!bcf_bypass_busy (t, 3 * PAGE_SPAN + 6 * CHUNK, TiB));
  bcf_bypass_end (t, &a);
  ck_assert (!bcf_bypass_busy (t, 0, TiB));
  ck_assert_uint_eq (mem (t).pages, 0);

  /* Everything. */
  bcf_bypass_begin (t, 0, UINT64_MAX, &a);
  ck_assert_uint_eq (a.nchunks, TiB / CHUNK);
  ck_assert (bcf_bypass_busy (t, TiB - 1, 1));
  ck_assert (bcf_bypass_busy (t, TiB - 1, UINT64_MAX));
  bcf_bypass_end (t, &a);
  ck_assert (!bcf_bypass_busy (t, 0, UINT64_MAX));
  bcf_bypass_free (t);
}
END_TEST

START_TEST (test_odd_sizes)
{
  struct bcf_bypass_token a, b;
  struct bcf_bypass *t = bcf_bypass_new (0);

  /* Size 0: nothing to track, nothing allocated. */
  ck_assert_ptr_nonnull (t);
  bcf_bypass_begin (t, 0, 4096, &a);
  ck_assert_uint_eq (a.nchunks, 0);
  ck_assert (!bcf_bypass_busy (t, 0, 4096));
  ck_assert_uint_eq (mem (t).in_flight, 1);
  bcf_bypass_end (t, &a);
  ck_assert_uint_eq (mem (t).bytes, 0);
  ck_assert_uint_eq (mem (t).peak_bytes, 0);
  bcf_bypass_free (t);

  /* 3 chunks + 4 KiB: a partial 4th chunk. */
  const uint64_t size = 3 * CHUNK + 4096;
  t = bcf_bypass_new (size);
  ck_assert_ptr_nonnull (t);
  bcf_bypass_begin (t, size - 1, 100, &a);     /* clamped to 1 byte */
  ck_assert_uint_eq (a.first, 3);
  ck_assert_uint_eq (a.nchunks, 1);
  ck_assert (!bcf_bypass_busy (t, 3 * CHUNK, 1));    /* same chunk */
  ck_assert (bcf_bypass_busy (t, size - 1, 1));
  ck_assert (bcf_bypass_busy (t, size - 1, UINT64_MAX));
  ck_assert (!bcf_bypass_busy (t, size, 1));
  ck_assert (!bcf_bypass_busy (t, 0, 3 * CHUNK));
  bcf_bypass_begin (t, size, 10, &b);           /* wholly outside */
  ck_assert_uint_eq (b.nchunks, 0);
  bcf_bypass_end (t, &b);
  bcf_bypass_begin (t, UINT64_MAX - 5, 10, &b); /* no overflow */
  ck_assert_uint_eq (b.nchunks, 0);
  bcf_bypass_end (t, &b);
  ck_assert (!bcf_bypass_busy (t, UINT64_MAX - 5, 10));
  bcf_bypass_begin (t, 0, 0, &b);               /* len 0: nothing */
  ck_assert_uint_eq (b.nchunks, 0);
  bcf_bypass_end (t, &b);
  bcf_bypass_end (t, &a);
  ck_assert (!bcf_bypass_busy (t, 0, size));
  ck_assert_uint_eq (mem (t).pages, 0);
  ck_assert_uint_eq (mem (t).in_flight, 0);
  bcf_bypass_free (t);

  /* One byte. */
  t = bcf_bypass_new (1);
  bcf_bypass_begin (t, 0, 1, &a);
  ck_assert (bcf_bypass_busy (t, 0, 1));
  bcf_bypass_end (t, &a);
  ck_assert (!bcf_bypass_busy (t, 0, 1));
  bcf_bypass_free (t);
}
END_TEST

/* ---- Ordering ------------------------------------------------------------ */

/* A writer in the background: begin, wait_turn, then hold until told. */
struct bg_writer {
  struct bcf_bypass *t;
  uint64_t off, len;
  struct bcf_bypass_token tok;
  pthread_t th;
  atomic_bool turned;           /* its wait returned */
  bool client;                  /* a client write (wait_turn_write) ... */
  bool absorbed;                /* ... that a later one stood in for */
  int rc;                       /* ... with this result */
};

static void *
bg_writer_run (void *arg)
{
  struct bg_writer *w = arg;

  if (w->client)
    w->absorbed = bcf_bypass_wait_turn_write (w->t, &w->tok, &w->rc);
  else
    bcf_bypass_wait_turn (w->t, &w->tok);
  atomic_store (&w->turned, true);
  return NULL;
}

/* Register now (in this thread, so the order is known), wait for the
 * turn in the background; a client write with flags. */
static void
bg_writer_launch (struct bg_writer *w, struct bcf_bypass *t, uint64_t off,
                  uint64_t len, bool client, unsigned flags)
{
  memset (w, 0, sizeof *w);
  w->t = t;
  w->off = off;
  w->len = len;
  w->client = client;
  if (client)
    bcf_bypass_begin_write (t, off, len, flags, &w->tok);
  else
    bcf_bypass_begin (t, off, len, &w->tok);
  ck_assert_int_eq (pthread_create (&w->th, NULL, bg_writer_run, w), 0);
}

static void
bg_writer_start (struct bg_writer *w, struct bcf_bypass *t, uint64_t off,
                 uint64_t len)
{
  bg_writer_launch (w, t, off, len, false, 0);
}

static void
bg_write_start (struct bg_writer *w, struct bcf_bypass *t, uint64_t off,
                uint64_t len, unsigned flags)
{
  bg_writer_launch (w, t, off, len, true, flags);
}

static bool
bg_writer_turned_within (struct bg_writer *w, unsigned ms)
{
  for (unsigned i = 0; i < ms && !atomic_load (&w->turned); i++)
    usleep (1000);
  return atomic_load (&w->turned);
}

START_TEST (test_ordering)
{
  struct bcf_bypass *t = bcf_bypass_new (TiB);
  struct bcf_bypass_token a, b;
  struct bg_writer w1, w2, w3;

  /* Alone: no wait. */
  bcf_bypass_begin (t, 4096, 8192, &a);
  ck_assert_uint_eq (bcf_bypass_wait_turn (t, &a), 0);
  /* Same chunk, no overlap: no wait. */
  bcf_bypass_begin (t, 12288, 4096, &b);
  ck_assert_uint_eq (bcf_bypass_wait_turn (t, &b), 0);
  bcf_bypass_end (t, &b);
  /* Registered after a, overlapping: waits until a is done ... */
  bg_writer_start (&w1, t, 8192, 8192);
  ck_assert (!bg_writer_turned_within (&w1, 50));
  /* ... a later non-overlapping writer does not wait for either ... */
  bcf_bypass_begin (t, 65536, 4096, &b);
  ck_assert_uint_eq (bcf_bypass_wait_turn (t, &b), 0);
  bcf_bypass_end (t, &b);
  /* ... nor does a (earlier writers never wait for later ones) ... */
  ck_assert_uint_eq (bcf_bypass_wait_turn (t, &a), 0);
  /* ... a second overlapping writer waits for both a and w1 ... */
  bg_writer_start (&w2, t, 0, 1 << 20);
  ck_assert (!bg_writer_turned_within (&w2, 50));
  /* ... done lets w1 go (a stays registered: misses still skip it) ... */
  bcf_bypass_done (t, &a);
  ck_assert (bg_writer_turned_within (&w1, 10000));
  pthread_join (w1.th, NULL);
  ck_assert (bcf_bypass_busy (t, 4096, 1));
  ck_assert (!bg_writer_turned_within (&w2, 50));
  /* ... and w2 goes once w1 ends too. */
  bcf_bypass_end (t, &w1.tok);
  ck_assert (bg_writer_turned_within (&w2, 10000));
  pthread_join (w2.th, NULL);
  /* A writer registered after w2 waits for w2, not for a (done). */
  bg_writer_start (&w3, t, 4096, 4096);
  ck_assert (!bg_writer_turned_within (&w3, 50));
  bcf_bypass_end (t, &w2.tok);
  ck_assert (bg_writer_turned_within (&w3, 10000));
  pthread_join (w3.th, NULL);
  bcf_bypass_end (t, &w3.tok);
  bcf_bypass_end (t, &a);
  ck_assert_uint_ge (mem (t).waits, 3);
  ck_assert_uint_gt (mem (t).wait_max_ns, 0);
  ck_assert_uint_ge (mem (t).in_flight_peak, 3);
  ck_assert_uint_eq (mem (t).in_flight, 0);

  /* With the ordering disabled (tests only), nobody waits. */
  bcf_bypass_test_disable_ordering (t, true);
  bcf_bypass_begin (t, 0, 4096, &a);
  bcf_bypass_begin (t, 0, 4096, &b);
  ck_assert_uint_eq (bcf_bypass_wait_turn (t, &b), 0);
  bcf_bypass_end (t, &b);
  bcf_bypass_end (t, &a);
  bcf_bypass_free (t);
}
END_TEST

/* ---- Absorption --------------------------------------------------------- */

/* Wait (up to 10 s) until n writes wait for their turn and `absorbed`
 * writes have been absorbed in all (an absorbed write no longer waits
 * for its turn, only for its absorber). */
static void
wait_for (struct bcf_bypass *t, uint64_t n, uint64_t absorbed)
{
  for (unsigned i = 0; i < 10000 && (mem (t).waiting != n ||
                                     mem (t).absorbed != absorbed); i++)
    usleep (1000);
  ck_assert_uint_eq (mem (t).waiting, n);
  ck_assert_uint_eq (mem (t).absorbed, absorbed);
}

/* absorber ends with rc: w, which it stood in for and which has not
 * returned yet, returns, absorbed, with rc. */
static void
end_and_check_absorbed (struct bcf_bypass *t, struct bg_writer *absorber,
                        int rc, struct bg_writer *w)
{
  ck_assert (!bg_writer_turned_within (w, 50));
  bcf_bypass_end_write (t, &absorber->tok, rc);
  ck_assert (bg_writer_turned_within (w, 10000));
  pthread_join (w->th, NULL);
  ck_assert (w->absorbed);
  ck_assert_int_eq (w->rc, rc);
}

/* A write covering earlier waiting writes stands in for them: they
 * return only when it ends, with its result; one absorbed in turn
 * passes its absorber's result on.  (Disable absorb_earlier and P and A
 * get their turns instead: absorbed stays 0.) */
START_TEST (test_absorption)
{
  struct bcf_bypass *t = bcf_bypass_new (TiB);
  struct bcf_bypass_token v;
  struct bg_writer p, a, b;

  bcf_bypass_begin_write (t, 0, 8192, BCF_BYPASS_ABSORB, &v);
  ck_assert (!bcf_bypass_wait_turn_write (t, &v, &(int) { 0 }));
  bg_write_start (&p, t, 4096, 4096, BCF_BYPASS_ABSORB);
  wait_for (t, 1, 0);
  /* A covers P, which waits: A takes it over (and the running v, which
   * covers nothing A does not, is not absorbed: it is not waiting). */
  bg_write_start (&a, t, 0, 8192, BCF_BYPASS_ABSORB);
  wait_for (t, 1, 1);
  /* B, a FUA write, covers A: takes A over. */
  bg_write_start (&b, t, 0, 8192, BCF_BYPASS_ABSORB | BCF_BYPASS_FUA);
  wait_for (t, 1, 2);
  ck_assert (!bg_writer_turned_within (&p, 20));
  ck_assert (!bg_writer_turned_within (&a, 20));
  ck_assert (!bg_writer_turned_within (&b, 20));
  /* v ends: B's turn (P and A count as done); P and A still wait. */
  bcf_bypass_end_write (t, &v, 0);
  ck_assert (bg_writer_turned_within (&b, 10000));
  pthread_join (b.th, NULL);
  ck_assert (!b.absorbed);
  ck_assert (!bg_writer_turned_within (&p, 1));
  /* B ends with 42: A completes with it, and P when A ends. */
  end_and_check_absorbed (t, &b, 42, &a);
  end_and_check_absorbed (t, &a, a.rc, &p);
  bcf_bypass_end_write (t, &p.tok, p.rc);
  ck_assert_uint_eq (mem (t).in_flight, 0);
  ck_assert_uint_eq (mem (t).waiting, 0);

  /* Across a barrier (detach's wait for the writes in flight: the whole
   * store, registered between P and A): the barrier goes once v ends,
   * without waiting for P, which A stands in for; then A, then P. */
  {
    struct bg_writer barrier;

    bcf_bypass_begin_write (t, 0, 8192, BCF_BYPASS_ABSORB, &v);
    ck_assert (!bcf_bypass_wait_turn_write (t, &v, &(int) { 0 }));
    bg_write_start (&p, t, 0, 4096, BCF_BYPASS_ABSORB);
    wait_for (t, 1, 2);
    bg_writer_start (&barrier, t, 0, TiB);
    ck_assert (!bg_writer_turned_within (&barrier, 20));
    bg_write_start (&a, t, 0, 4096, BCF_BYPASS_ABSORB);
    wait_for (t, 1, 3);
    bcf_bypass_end_write (t, &v, 0);
    ck_assert (bg_writer_turned_within (&barrier, 10000));
    pthread_join (barrier.th, NULL);
    ck_assert (!bg_writer_turned_within (&a, 20));
    bcf_bypass_end (t, &barrier.tok);
    ck_assert (bg_writer_turned_within (&a, 10000));
    pthread_join (a.th, NULL);
    ck_assert (!a.absorbed);
    end_and_check_absorbed (t, &a, 7, &p);
    bcf_bypass_end_write (t, &p.tok, p.rc);
    ck_assert_uint_eq (mem (t).in_flight, 0);
  }
  bcf_bypass_free (t);
}
END_TEST

/* What is never absorbed: a FUA write by a write without FUA, a write
 * that does not register as absorbable (a trim, the writeback), one that
 * is not wholly inside the later write, and one that is not waiting. */
START_TEST (test_absorption_limits)
{
  struct bcf_bypass *t = bcf_bypass_new (TiB);
  struct bcf_bypass_token v;
  struct bg_writer f, n, x, a;

  bcf_bypass_begin_write (t, 0, 8192, BCF_BYPASS_ABSORB, &v);
  ck_assert (!bcf_bypass_wait_turn_write (t, &v, &(int) { 0 }));
  bg_write_start (&f, t, 0, 4096, BCF_BYPASS_ABSORB | BCF_BYPASS_FUA);
  wait_for (t, 1, 0);
  bg_write_start (&n, t, 0, 4096, 0);
  wait_for (t, 2, 0);
  bg_write_start (&x, t, 4096, 8192, BCF_BYPASS_ABSORB);
  wait_for (t, 3, 0);
  bg_write_start (&a, t, 0, 8192, BCF_BYPASS_ABSORB);
  wait_for (t, 4, 0);
  /* Each gets its own turn, in order. */
  bcf_bypass_end_write (t, &v, 0);
  ck_assert (bg_writer_turned_within (&f, 10000));
  ck_assert (!bg_writer_turned_within (&n, 20));
  bcf_bypass_end_write (t, &f.tok, 0);
  ck_assert (bg_writer_turned_within (&n, 10000));
  ck_assert (!bg_writer_turned_within (&a, 20));
  bcf_bypass_end_write (t, &n.tok, 0);
  ck_assert (bg_writer_turned_within (&x, 10000));
  ck_assert (!bg_writer_turned_within (&a, 20));
  bcf_bypass_end_write (t, &x.tok, 0);
  ck_assert (bg_writer_turned_within (&a, 10000));
  bcf_bypass_end_write (t, &a.tok, 0);
  pthread_join (f.th, NULL);
  pthread_join (n.th, NULL);
  pthread_join (x.th, NULL);
  pthread_join (a.th, NULL);
  ck_assert (!f.absorbed && !n.absorbed && !x.absorbed && !a.absorbed);
  ck_assert_uint_eq (mem (t).absorbed, 0);
  ck_assert_uint_eq (mem (t).in_flight, 0);

  /* With the ordering disabled (tests only) nothing waits or absorbs. */
  bcf_bypass_test_disable_ordering (t, true);
  bcf_bypass_begin_write (t, 0, 4096, BCF_BYPASS_ABSORB, &v);
  bcf_bypass_begin_write (t, 0, 4096, BCF_BYPASS_ABSORB, &a.tok);
  ck_assert (!bcf_bypass_wait_turn_write (t, &a.tok, &(int) { 0 }));
  bcf_bypass_end_write (t, &a.tok, 0);
  bcf_bypass_end_write (t, &v, 0);
  bcf_bypass_free (t);
}
END_TEST

/* ---- Memory ------------------------------------------------------------- */

static void
check_memory (uint64_t size)
{
  struct bcf_bypass *t = bcf_bypass_new (size);
  const uint64_t nchunks = (size + CHUNK - 1) / CHUNK;
  const uint64_t npages = (nchunks + PAGE_CHUNKS - 1) / PAGE_CHUNKS;
  const uint64_t table = npages * sizeof (void *);
  const double tib = (double) size / (double) TiB;
  struct bcf_bypass_token *tok = calloc (npages, sizeof *tok);
  struct bcf_bypass_mem m;
  uint64_t reserve;

  ck_assert_ptr_nonnull (t);
  ck_assert_ptr_nonnull (tok);

  /* Idle: the page table (and the constant reserve) only. */
  m = mem (t);
  reserve = m.reserve_pages;
  ck_assert_uint_eq (m.pages, 0);
  ck_assert_uint_le (reserve, 4);
  ck_assert_uint_eq (m.bytes, table + reserve * 4096);
  ck_assert ((double) (m.bytes - reserve * 4096) <= 0.5 * KiB * tib);

  /* Peak: one write in every page. */
  for (uint64_t p = 0; p < npages; p++) {
    uint64_t span = size - p * PAGE_SPAN < PAGE_SPAN
      ? size - p * PAGE_SPAN : PAGE_SPAN;
    uint64_t r = seed + p + 1;
    bcf_bypass_begin (t, p * PAGE_SPAN + rnd_below_r (&r, span), 1, &tok[p]);
  }
  m = mem (t);
  ck_assert_uint_eq (m.pages, npages);
  ck_assert_uint_eq (m.reserve_pages, 0);       /* nothing left to need */
  ck_assert_uint_eq (m.bytes, table + npages * 4096);
  /* Pages: 128 KiB per TiB, rounded up to a whole page (32 GiB). */
  ck_assert ((double) (npages * 4096) <= 128.0 * KiB * tib + 4096);
  ck_assert ((double) table <= 0.5 * KiB * tib);
  ck_assert_uint_eq (m.peak_bytes, table + npages * 4096);
  printf ("bypass memory, %.3f TiB: idle %" PRIu64 " B (table %" PRIu64
          " B = %.1f B/TiB, reserve %" PRIu64 " B); peak %" PRIu64
          " B = %.2f KiB/TiB (pages %" PRIu64 " B = %.2f KiB/TiB)\n",
          tib, table + reserve * 4096, table, (double) table / tib,
          reserve * 4096, m.peak_bytes,
          (double) m.peak_bytes / KiB / tib,
          npages * 4096, (double) (npages * 4096) / KiB / tib);
  fflush (stdout);

  /* Idle again: pages freed, reserve back. */
  for (uint64_t p = 0; p < npages; p++)
    bcf_bypass_end (t, &tok[p]);
  m = mem (t);
  ck_assert_uint_eq (m.pages, 0);
  ck_assert_uint_eq (m.in_flight, 0);
  ck_assert_uint_eq (m.reserve_pages, reserve);
  ck_assert_uint_eq (m.bytes, table + reserve * 4096);
  free (tok);
  bcf_bypass_free (t);
}

START_TEST (test_memory)
{
  check_memory (TiB);
  check_memory (16 * TiB);
  check_memory (3 * TiB + 5 * CHUNK + 17);
}
END_TEST

/* ---- Reserve and waits -------------------------------------------------- */

struct bg_begin {
  struct bcf_bypass *t;
  uint64_t offset, len;
  struct bcf_bypass_token tok;
  atomic_bool done;
  pthread_t th;
};

static void *
bg_begin_thread (void *arg)
{
  struct bg_begin *b = arg;

  bcf_bypass_begin (b->t, b->offset, b->len, &b->tok);
  atomic_store (&b->done, true);
  return NULL;
}

static void
bg_start (struct bg_begin *b, struct bcf_bypass *t, uint64_t off, uint64_t len)
{
  b->t = t;
  b->offset = off;
  b->len = len;
  atomic_init (&b->done, false);
  ck_assert_int_eq (pthread_create (&b->th, NULL, bg_begin_thread, b), 0);
}

/* Did b finish within about ms milliseconds? */
static bool
bg_done_within (struct bg_begin *b, unsigned ms)
{
  for (unsigned i = 0; i < ms && !atomic_load (&b->done); i++)
    usleep (1000);
  return atomic_load (&b->done);
}

START_TEST (test_reserve)
{
  struct bcf_bypass *t = bcf_bypass_new (TiB);
  struct bcf_bypass_token tok[4], x;
  struct bg_begin bg1, bg2, bg3;
  struct bcf_bypass_mem m;

  ck_assert_uint_eq (mem (t).reserve_pages, 4);
  bcf_bypass_test_fail_alloc (t, true);

  /* Four pages come from the reserve. */
  for (unsigned i = 0; i < 4; i++)
    bcf_bypass_begin (t, i * PAGE_SPAN, 4096, &tok[i]);
  m = mem (t);
  ck_assert_uint_eq (m.pages, 4);
  ck_assert_uint_eq (m.reserve_pages, 0);
  ck_assert_uint_eq (m.reserve_uses, 4);
  for (unsigned i = 0; i < 4; i++)
    ck_assert (bcf_bypass_busy (t, i * PAGE_SPAN, 1));

  /* A page already there needs no allocation. */
  bcf_bypass_begin (t, 3 * PAGE_SPAN + 5 * CHUNK, 1, &x);
  ck_assert (bcf_bypass_busy (t, 3 * PAGE_SPAN + 5 * CHUNK, 1));
  bcf_bypass_end (t, &x);

  /* A fifth page: begin waits, tracking is not skipped ... */
  bg_start (&bg1, t, 10 * PAGE_SPAN, 4096);
  ck_assert (!bg_done_within (&bg1, 100));
  ck_assert (!bcf_bypass_busy (t, 10 * PAGE_SPAN, 1));
  /* ... until a page frees. */
  bcf_bypass_end (t, &tok[1]);
  ck_assert (bg_done_within (&bg1, 10000));
  pthread_join (bg1.th, NULL);
  ck_assert (bcf_bypass_busy (t, 10 * PAGE_SPAN, 1));
  ck_assert (!bcf_bypass_busy (t, 1 * PAGE_SPAN, 1));
  m = mem (t);
  ck_assert_uint_eq (m.pages, 4);
  ck_assert_uint_eq (m.reserve_uses, 5);

  /* A begin needing 4 pages when none is to be had waits, and goes
   * through by itself once malloc works again (timed retry). */
  bg_start (&bg2, t, 20 * PAGE_SPAN - 1, 2 * PAGE_SPAN + 2);
  ck_assert (!bg_done_within (&bg2, 100));
  ck_assert (!bcf_bypass_busy (t, 20 * PAGE_SPAN, 1));
  bcf_bypass_test_fail_alloc (t, false);
  ck_assert (bg_done_within (&bg2, 10000));
  pthread_join (bg2.th, NULL);
  ck_assert (!bcf_bypass_busy (t, 20 * PAGE_SPAN - CHUNK - 1, 1));
  ck_assert (bcf_bypass_busy (t, 20 * PAGE_SPAN - 1, 1));
  ck_assert (bcf_bypass_busy (t, 21 * PAGE_SPAN, 1));
  ck_assert (bcf_bypass_busy (t, 22 * PAGE_SPAN, 1));
  ck_assert (!bcf_bypass_busy (t, 22 * PAGE_SPAN + CHUNK, 1));
  m = mem (t);
  ck_assert_uint_eq (m.pages, 8);               /* 0 2 3 10 19-22 */
  ck_assert_uint_eq (m.reserve_pages, 4);       /* refilled */
  ck_assert_uint_eq (m.reserve_uses, 5);

  bcf_bypass_end (t, &bg1.tok);
  bcf_bypass_end (t, &bg2.tok);
  bcf_bypass_end (t, &tok[0]);
  bcf_bypass_end (t, &tok[2]);
  bcf_bypass_end (t, &tok[3]);
  m = mem (t);
  ck_assert_uint_eq (m.pages, 0);
  ck_assert_uint_eq (m.in_flight, 0);
  ck_assert_uint_eq (m.reserve_pages, 4);
  ck_assert (!bcf_bypass_busy (t, 0, TiB));

  /* A begin needing more pages than the reserve holds while malloc
   * fails takes nothing (no half-linked pages, the reserve intact) and
   * waits. */
  bcf_bypass_test_fail_alloc (t, true);
  bg_start (&bg3, t, 0, 6 * PAGE_SPAN);         /* needs 6 > 4 pages */
  ck_assert (!bg_done_within (&bg3, 50));
  m = mem (t);
  ck_assert_uint_eq (m.pages, 0);
  ck_assert_uint_eq (m.reserve_pages, 4);
  ck_assert_uint_eq (m.reserve_uses, 5);
  ck_assert (!bcf_bypass_busy (t, 0, TiB));
  bcf_bypass_test_fail_alloc (t, false);
  ck_assert (bg_done_within (&bg3, 10000));
  pthread_join (bg3.th, NULL);
  ck_assert_uint_eq (mem (t).pages, 6);
  ck_assert (bcf_bypass_busy (t, 6 * PAGE_SPAN - 1, 1));
  bcf_bypass_end (t, &bg3.tok);
  ck_assert_uint_eq (mem (t).pages, 0);
  bcf_bypass_free (t);
}
END_TEST

/* ---- Random model test ---------------------------------------------------- */

#define M_PAGES 3
#define M_SIZE  ((M_PAGES - 1) * PAGE_SPAN + 5 * CHUNK + 12345)
#define M_CHUNKS ((M_SIZE + CHUNK - 1) / CHUNK)
#define M_SLOTS 64

static uint64_t
random_offset (uint64_t *s)
{
  /* Mostly near chunk and page boundaries. */
  switch (rnd_below_r (s, 4)) {
  case 0: return rnd_below_r (s, M_SIZE + CHUNK);
  case 1: return rnd_below_r (s, M_CHUNKS + 1) * CHUNK
            + rnd_below_r (s, 3) - 1;
  case 2: return rnd_below_r (s, M_PAGES + 1) * PAGE_SPAN
            + rnd_below_r (s, 5) * CHUNK - 2 * CHUNK + rnd_below_r (s, 3) - 1;
  default: return M_SIZE - rnd_below_r (s, 3 * CHUNK);
  }
}

static uint64_t
random_len (uint64_t *s)
{
  switch (rnd_below_r (s, 5)) {
  case 0: return 1 + rnd_below_r (s, 2);
  case 1: return 1 + rnd_below_r (s, 6 * CHUNK);
  case 2: return rnd_below_r (s, 3) * CHUNK + rnd_below_r (s, 3);
  case 3: return 1 + rnd_below_r (s, 2 * PAGE_SPAN);
  default: return UINT64_MAX - rnd_below_r (s, 3);
  }
}

static void
model_range (uint64_t off, uint64_t len, uint64_t *first, uint64_t *end)
{
  uint64_t last;

  *first = *end = 0;
  if (len == 0 || off >= M_SIZE)
    return;
  last = len > M_SIZE - off ? M_SIZE - 1 : off + len - 1;
  *first = off / CHUNK;
  *end = last / CHUNK + 1;
}

/* The exact range a registration of [off, off + len) covers. */
static void
model_bytes (uint64_t off, uint64_t len, uint64_t *start, uint64_t *end)
{
  *start = off < M_SIZE ? off : M_SIZE;
  *end = len > M_SIZE - *start ? M_SIZE : *start + len;
}

START_TEST (test_model_random)
{
  static uint32_t count[M_CHUNKS];
  struct slot {
    bool used;
    struct bcf_bypass_token tok;
    uint64_t first, end;        /* chunks */
    uint64_t bstart, bend;      /* bytes */
  } slot[M_SLOTS];
  struct bcf_bypass *t = bcf_bypass_new (M_SIZE);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const uint64_t ops = getenv ("TEST_BYPASS_OPS")
    ? strtoull (getenv ("TEST_BYPASS_OPS"), NULL, 0) : 200000;

  memset (count, 0, sizeof count);
  memset (slot, 0, sizeof slot);
  for (uint64_t op = 0; op < ops; op++) {
    struct slot *sl = &slot[rnd_below_r (&s, M_SLOTS)];
    uint64_t off = random_offset (&s), len = random_len (&s);
    uint64_t first, end, bs, be;

    if (!sl->used && rnd_below_r (&s, 3) != 0) {        /* begin */
      model_range (off, len, &first, &end);
      bcf_bypass_begin (t, off, len, &sl->tok);
      ck_assert_msg (sl->tok.first == first && sl->tok.nchunks == end - first,
                     "seed %u op %" PRIu64 ": token [%" PRIu64 "+%" PRIu64
                     "], model [%" PRIu64 ", %" PRIu64 ")", seed, op,
                     sl->tok.first, sl->tok.nchunks, first, end);
      sl->used = true;
      sl->first = first;
      sl->end = end;
      model_bytes (off, len, &sl->bstart, &sl->bend);
      for (uint64_t c = first; c < end; c++)
        count[c]++;
    }
    else if (sl->used && rnd_below_r (&s, 2) == 0) {    /* end */
      bcf_bypass_end (t, &sl->tok);
      for (uint64_t c = sl->first; c < sl->end; c++)
        count[c]--;
      sl->used = false;
    }

    /* busy on a random range, against the model: a registered range that
     * overlaps it, to the byte. */
    off = random_offset (&s);
    len = random_len (&s);
    bs = off;
    be = len > UINT64_MAX - off ? UINT64_MAX : off + len;
    bool want = false;
    for (unsigned i = 0; i < M_SLOTS && !want && len > 0; i++)
      want = slot[i].used && slot[i].bstart < slot[i].bend &&
             slot[i].bstart < be && bs < slot[i].bend;
    ck_assert_msg (bcf_bypass_busy (t, off, len) == want,
                   "seed %u op %" PRIu64 ": busy(%" PRIu64 ", %" PRIu64
                   ") = %d, model %d", seed, op, off, len, !want, want);

    /* Pages: exactly those with a registration. */
    if (op % 64 == 0) {
      uint64_t pages = 0;
      for (uint64_t p = 0; p < M_PAGES; p++) {
        bool any = false;
        for (uint64_t c = p * PAGE_CHUNKS;
             c < (p + 1) * PAGE_CHUNKS && c < M_CHUNKS; c++)
          any |= count[c] > 0;
        pages += any;
      }
      ck_assert_msg (mem (t).pages == pages, "seed %u op %" PRIu64
                     ": %" PRIu64 " pages, model %" PRIu64, seed, op,
                     mem (t).pages, pages);
    }
  }
  for (unsigned i = 0; i < M_SLOTS; i++)
    if (slot[i].used)
      bcf_bypass_end (t, &slot[i].tok);
  ck_assert_uint_eq (mem (t).pages, 0);
  ck_assert_uint_eq (mem (t).in_flight, 0);
  ck_assert (!bcf_bypass_busy (t, 0, UINT64_MAX));
  bcf_bypass_free (t);
}
END_TEST

/* ---- Multi-threaded stress -------------------------------------------------- */

/* The handoff: a writer registers, then under M publishes its range (as
 * its invalidation would, under the btree lock); a reader takes M (as
 * its check-key insert would), pins a published range, drops M and
 * calls busy(), which must answer true.  The writer unpublishes (under
 * M, after every pin is gone) before it ends. */
#define S_SIZE   (8 * PAGE_SPAN + 3 * CHUNK)      /* 9 pages */
#define S_WRITERS 4
#define S_READERS 3
#define S_PUB    S_WRITERS

static struct {
  struct bcf_bypass *t;
  pthread_mutex_t m;
  pthread_cond_t unpinned;
  struct pub { bool on, closing; uint64_t off, len; unsigned pins; }
    pub[S_PUB];
  atomic_bool stop;
  atomic_ulong checks, misses, begins;
} st;

static void
stress_range (uint64_t *s, uint64_t *off, uint64_t *len)
{
  switch (rnd_below_r (s, 8)) {
  case 0:                               /* large, many pages */
    *off = rnd_below_r (s, S_SIZE);
    *len = 1 + rnd_below_r (s, 3 * PAGE_SPAN);
    break;
  case 1: case 2:                       /* across a page boundary */
    *off = (1 + rnd_below_r (s, 8)) * PAGE_SPAN - rnd_below_r (s, 2 * CHUNK);
    *len = 1 + rnd_below_r (s, 3 * CHUNK);
    break;
  default:                              /* small, anywhere: page churn */
    *off = rnd_below_r (s, S_SIZE);
    *len = 1 + rnd_below_r (s, 1 << 20);
    break;
  }
}

static void *
stress_writer (void *arg)
{
  unsigned id = (unsigned) (uintptr_t) arg;
  uint64_t s = (seed + 1) * 0x9E3779B97F4A7C15ull + id;

  while (!atomic_load_explicit (&st.stop, memory_order_relaxed)) {
    struct bcf_bypass_token tok;
    uint64_t off, len;

    stress_range (&s, &off, &len);
    bcf_bypass_begin (st.t, off, len, &tok);
    atomic_fetch_add_explicit (&st.begins, 1, memory_order_relaxed);
    if (rnd_below_r (&s, 2) == 0) {
      pthread_mutex_lock (&st.m);
      st.pub[id] = (struct pub) { .on = true, .off = off, .len = len };
      pthread_mutex_unlock (&st.m);
      for (unsigned i = rnd_below_r (&s, 4); i > 0; i--)
        sched_yield ();
      pthread_mutex_lock (&st.m);
      st.pub[id].closing = true;        /* no new pins */
      while (st.pub[id].pins > 0)
        pthread_cond_wait (&st.unpinned, &st.m);
      st.pub[id].on = false;
      pthread_mutex_unlock (&st.m);
    }
    else if (rnd_below_r (&s, 2) == 0)
      sched_yield ();
    bcf_bypass_end (st.t, &tok);
  }
  return NULL;
}

static void *
stress_reader (void *arg)
{
  unsigned id = (unsigned) (uintptr_t) arg;
  uint64_t s = (seed + 2) * 0x9E3779B97F4A7C15ull + id;

  while (!atomic_load_explicit (&st.stop, memory_order_relaxed)) {
    unsigned w = (unsigned) rnd_below_r (&s, S_PUB);
    uint64_t off = 0, len = 0;
    bool pinned = false;

    pthread_mutex_lock (&st.m);
    if (st.pub[w].on && !st.pub[w].closing) {
      /* A sub-range of the published one, clamped like the tracker. */
      off = st.pub[w].off + rnd_below_r (&s, st.pub[w].len);
      len = 1 + rnd_below_r (&s, 2 * CHUNK);
      st.pub[w].pins++;
      pinned = true;
    }
    pthread_mutex_unlock (&st.m);

    if (pinned) {
      if (off >= S_SIZE)
        off = S_SIZE - 1;
      if (!bcf_bypass_busy (st.t, off, len))
        atomic_fetch_add (&st.misses, 1);
      atomic_fetch_add_explicit (&st.checks, 1, memory_order_relaxed);
      pthread_mutex_lock (&st.m);
      if (--st.pub[w].pins == 0)
        pthread_cond_broadcast (&st.unpinned);
      pthread_mutex_unlock (&st.m);
    }
    else {
      /* Unsynchronised reads: exercise the page reclamation. */
      uint64_t o, l;
      stress_range (&s, &o, &l);
      (void) bcf_bypass_busy (st.t, o, l);
      if (rnd_below_r (&s, 4) == 0)
        sched_yield ();                 /* leave the writers some CPU */
    }
  }
  return NULL;
}

START_TEST (test_stress)
{
  pthread_t w[S_WRITERS], r[S_READERS];
  const double secs = getenv ("TEST_BYPASS_SECONDS")
    ? atof (getenv ("TEST_BYPASS_SECONDS")) : 2.0;
  struct bcf_bypass_mem m;

  memset (&st, 0, sizeof st);
  st.t = bcf_bypass_new (S_SIZE);
  ck_assert_ptr_nonnull (st.t);
  if (getenv ("TEST_BYPASS_DISABLE"))
    bcf_bypass_test_disable (st.t, true);
  pthread_mutex_init (&st.m, NULL);
  pthread_cond_init (&st.unpinned, NULL);
  for (unsigned i = 0; i < S_WRITERS; i++)
    pthread_create (&w[i], NULL, stress_writer, (void *) (uintptr_t) i);
  for (unsigned i = 0; i < S_READERS; i++)
    pthread_create (&r[i], NULL, stress_reader, (void *) (uintptr_t) i);
  usleep ((useconds_t) (secs * 1e6));
  atomic_store (&st.stop, true);
  for (unsigned i = 0; i < S_WRITERS; i++)
    pthread_join (w[i], NULL);
  for (unsigned i = 0; i < S_READERS; i++)
    pthread_join (r[i], NULL);

  bcf_bypass_get_mem (st.t, &m);
  printf ("bypass stress: %lu begins, %lu handoff checks, %lu missed; "
          "peak %" PRIu64 " B\n", atomic_load (&st.begins),
          atomic_load (&st.checks), atomic_load (&st.misses), m.peak_bytes);
  ck_assert_msg (atomic_load (&st.misses) == 0,
                 "seed %u: %lu of %lu readers missed a writer they had "
                 "seen through the mutex", seed, atomic_load (&st.misses),
                 atomic_load (&st.checks));
  ck_assert_uint_gt (atomic_load (&st.checks), 0);
  ck_assert_uint_eq (m.pages, 0);
  ck_assert_uint_eq (m.in_flight, 0);
  /* Total pages never exceed npages (retired ones are reused first). */
  ck_assert_uint_le (m.peak_bytes, 9 * 8 + 9 * 4096);
  bcf_bypass_free (st.t);
  pthread_cond_destroy (&st.unpinned);
  pthread_mutex_destroy (&st.m);
}
END_TEST

static Suite *
bypass_suite (void)
{
  Suite *s = suite_create ("bypass");
  TCase *tc = tcase_create ("tracker");

  tcase_set_timeout (tc, 600);
  tcase_add_test (tc, test_boundaries);
  tcase_add_test (tc, test_odd_sizes);
  tcase_add_test (tc, test_ordering);
  tcase_add_test (tc, test_absorption);
  tcase_add_test (tc, test_absorption_limits);
  tcase_add_test (tc, test_memory);
  tcase_add_test (tc, test_reserve);
  tcase_add_test (tc, test_model_random);
  tcase_add_test (tc, test_stress);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  seed = test_seed ("test-bypass");
  return test_main (bypass_suite ());
}
