/* Unit tests for core/seqdetect: bcache's sequential stream detection.
 *
 * Streams continue, interleave, expire after 5 s (fake clock), the table
 * recycles its least recently used entry (RECENT_IO = 128 as in bcache),
 * counts saturate, and a random model test compares the table with a
 * simple reference (a list of streams with LRU stamps).  A threaded test
 * runs independent streams from several threads (TSan).  The seed comes
 * from TEST_SEED or the clock and is printed first.
 */
#include "config.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <check.h>

#include "seqdetect.h"
#include "testlib.h"

#define RECENT_IO 128                   /* bcache's RECENT_IO */
#define SEC       UINT64_C (1000000000)
#define EXPIRE    (5 * SEC)
#define MiB       (UINT64_C (1) << 20)
#define WINDOW    BCF_SEQDETECT_WINDOW

static unsigned seed;

static _Atomic uint64_t fake_ns;
static uint64_t fake_clock (void) { return atomic_load (&fake_ns); }

static struct bcf_seqdetect *
new_fake (void)
{
  struct bcf_seqdetect *s = bcf_seqdetect_new ();

  ck_assert_ptr_nonnull (s);
  atomic_store (&fake_ns, 1000 * SEC);
  bcf_seqdetect_test_clock (s, fake_clock);
  return s;
}

START_TEST (test_stream)
{
  struct bcf_seqdetect *s = new_fake ();

  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, 4096), 4096);
  for (uint64_t i = 1; i < 1024; i++)
    ck_assert_uint_eq (bcf_seqdetect_account (s, i * 4096, 4096),
                       (i + 1) * 4096);
  /* Varying sizes continue too. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 4 * MiB, 512), 4 * MiB + 512);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 4 * MiB + 512, MiB),
                     5 * MiB + 512);
  /* A gap or a backwards step larger than the window (seqdetect.h)
   * starts a new stream. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 5 * MiB + 512 + WINDOW + 1,
                                            4096), 4096);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 5 * MiB + 512 - WINDOW - 4097,
                                            4096), 4096);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, 4096), 4096);
  /* The old stream is still there. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 5 * MiB + 512, 512),
                     5 * MiB + 1024);
  /* Zero-length requests are not accounted. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 5 * MiB + 1024, 0), 0);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 5 * MiB + 1024, 1),
                     5 * MiB + 1025);
  /* A request at offset 0 does not match the never-used entries. */
  bcf_seqdetect_free (s);
  s = new_fake ();
  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, 1), 1);
  bcf_seqdetect_free (s);
}
END_TEST

START_TEST (test_interleaved)
{
  struct bcf_seqdetect *s = new_fake ();
  const unsigned n = 100;               /* more than 64, fewer than 128 */
  const uint64_t base = 1ull << 40;

  for (uint64_t round = 0; round < 50; round++)
    for (uint64_t k = 0; k < n; k++)
      ck_assert_uint_eq (bcf_seqdetect_account (s, base * k + round * 65536,
                                                65536),
                         (round + 1) * 65536);
  /* Two streams farther apart than the window each keep their own
   * count; one that reaches the other's start continues into it (an
   * exact match is preferred to a near one). */
  bcf_seqdetect_free (s);
  s = new_fake ();
  const uint64_t b = 2 * WINDOW;
  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, 4096), 4096);          /* A */
  ck_assert_uint_eq (bcf_seqdetect_account (s, b, 4096), 4096);          /* B */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 4096, 4096), 8192);       /* A */
  ck_assert_uint_eq (bcf_seqdetect_account (s, b + 4096, 4096), 8192);   /* B */
  for (uint64_t o = 8192; o < b; o += 4096)                              /* A */
    ck_assert_uint_eq (bcf_seqdetect_account (s, o, 4096), o + 4096);
  /* A ended at b + 8192 - 8192 = b, where B started; B's end (b + 8192)
   * is near too, but A's is exact. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, b, 4096), b + 4096);      /* A */
  bcf_seqdetect_free (s);
}
END_TEST

/* Out-of-order arrivals (seqdetect.c): a stream whose requests come
 * shuffled within the window counts as one stream, each byte once. */
START_TEST (test_reordered)
{
  struct bcf_seqdetect *s = new_fake ();
  uint64_t got = 0;

  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, 4096), 4096);
  /* Ahead of the end: the request counts, the gap does not ... */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 8192, 4096), 8192);
  /* ... the late arrival fills it and counts then. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 4096, 4096), 12288);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 12288, 4096), 16384);
  /* Overlapping the end: only what is new counts; seen again: nothing. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 14336, 4096), 18432);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 4096, 8192), 18432);
  bcf_seqdetect_free (s);

  /* Strided reads (4 KiB every 64 KiB, within the window of each other)
   * count what they read, never the gaps: 100 of them are 400 KiB, far
   * below a cutoff of megabytes (test-request's fills_run_without_drain
   * caught a first version that counted the gaps). */
  s = new_fake ();
  for (uint64_t k = 0; k < 100; k++)
    ck_assert_uint_eq (bcf_seqdetect_account (s, 9 * MiB + k * 65536, 4096),
                       (k + 1) * 4096);
  bcf_seqdetect_free (s);

  /* 4 MiB of 4 KiB requests, 16 in flight: each group of 16 arrives in
   * a shuffled order.  Every byte counts once, and never more than the
   * group that has arrived. */
  s = new_fake ();
  rng_state = seed * 0x9E3779B97F4A7C15ull + 7;
  for (uint64_t g = 0; g < 4 * MiB / 65536; g++) {
    uint64_t order[16];
    for (unsigned k = 0; k < 16; k++)
      order[k] = k;
    for (unsigned k = 15; k > 0; k--) {
      unsigned j = (unsigned) rnd_below (k + 1);
      uint64_t t = order[k];
      order[k] = order[j];
      order[j] = t;
    }
    for (unsigned k = 0; k < 16; k++) {
      got = bcf_seqdetect_account (s, g * 65536 + order[k] * 4096, 4096);
      ck_assert_uint_le (got, (g + 1) * 65536);
      ck_assert_uint_ge (got + 15 * 4096, g * 65536 + 4096);
    }
  }
  ck_assert_uint_eq (got, 4 * MiB);
  bcf_seqdetect_free (s);

  /* Random requests in a small hot range (within the window of each
   * other) never count more than the range itself. */
  s = new_fake ();
  for (unsigned k = 0; k < 10000; k++)
    ck_assert_uint_le (bcf_seqdetect_account (s, 8 * MiB + rnd_below (16) * 4096,
                                              4096), 16 * 4096);
  bcf_seqdetect_free (s);
}
END_TEST

START_TEST (test_expiry)
{
  struct bcf_seqdetect *s = new_fake ();
  uint64_t t0 = atomic_load (&fake_ns);

  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, 4096), 4096);
  atomic_store (&fake_ns, t0 + EXPIRE - 1);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 4096, 4096), 8192);
  /* Each continuation restarts the 5 s. */
  atomic_store (&fake_ns, t0 + 2 * EXPIRE - 2);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 8192, 4096), 12288);
  /* Exactly 5 s later: forgotten. */
  atomic_store (&fake_ns, t0 + 3 * EXPIRE - 2);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 12288, 4096), 4096);
  /* ... and the new stream continues. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 16384, 4096), 8192);
  /* A long pause. */
  atomic_store (&fake_ns, t0 + 1000 * SEC);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 20480, 4096), 4096);
  /* The real clock works too. */
  bcf_seqdetect_test_clock (s, NULL);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 1 << 30, 4096), 4096);
  ck_assert_uint_eq (bcf_seqdetect_account (s, (1 << 30) + 4096, 4096),
                     8192);
  bcf_seqdetect_free (s);
}
END_TEST

START_TEST (test_lru)
{
  struct bcf_seqdetect *s = new_fake ();
  const uint64_t base = 1ull << 36;

  /* RECENT_IO streams all fit. */
  for (uint64_t k = 0; k < RECENT_IO; k++)
    ck_assert_uint_eq (bcf_seqdetect_account (s, base * k, 4096), 4096);
  for (uint64_t k = 0; k < RECENT_IO; k++)
    ck_assert_uint_eq (bcf_seqdetect_account (s, base * k + 4096, 4096), 8192);
  /* Touch stream 0, then a new stream: it takes the LRU entry, which is
   * stream 1's. */
  ck_assert_uint_eq (bcf_seqdetect_account (s, 8192, 4096), 12288);
  ck_assert_uint_eq (bcf_seqdetect_account (s, base * RECENT_IO, 4096), 4096);
  ck_assert_uint_eq (bcf_seqdetect_account (s, 12288, 4096), 16384);
  for (uint64_t k = 2; k < RECENT_IO; k++)
    ck_assert_uint_eq (bcf_seqdetect_account (s, base * k + 8192, 4096),
                       12288);
  ck_assert_uint_eq (bcf_seqdetect_account (s, base + 8192, 4096), 4096);

  /* RECENT_IO + 1 streams round-robin: each is evicted before it comes
   * back, so nothing is ever sequential (bcache behaves the same). */
  bcf_seqdetect_free (s);
  s = new_fake ();
  for (uint64_t round = 0; round < 4; round++)
    for (uint64_t k = 0; k <= RECENT_IO; k++)
      ck_assert_uint_eq (bcf_seqdetect_account (s, base * k + round * 4096,
                                                4096), 4096);
  bcf_seqdetect_free (s);
}
END_TEST

START_TEST (test_saturate)
{
  struct bcf_seqdetect *s = new_fake ();

  ck_assert_uint_eq (bcf_seqdetect_account (s, 0, UINT64_MAX - 1),
                     UINT64_MAX - 1);
  ck_assert_uint_eq (bcf_seqdetect_account (s, UINT64_MAX - 1, 100),
                     UINT64_MAX);
  ck_assert_uint_eq (bcf_seqdetect_account (s, UINT64_MAX, 100),
                     UINT64_MAX);
  bcf_seqdetect_free (s);
}
END_TEST

/* Reference: RECENT_IO entries with an LRU stamp; a lookup matches the
 * unexpired entry ending at offset that was used last, or else the
 * unexpired one ending within the window of offset that was used last;
 * the stream counts the bytes by which the request moves its end. */
#define WSECT (WINDOW / 512)
struct ref {
  uint64_t last, deadline, seq, stamp, top;
  bool used;
  bool seen[WSECT];             /* [i]: sector top - 1 - i seen */
};

/* The reference's count of [off, off + len) in r, naively. */
static uint64_t
ref_fresh (struct ref *r, uint64_t off, uint64_t len)
{
  uint64_t end = off + len, ss = off / 512, se = (end + 511) / 512, n = 0;

  if (se > r->top) {
    uint64_t d = se - r->top;
    for (uint64_t i = WSECT; i-- > 0;)
      r->seen[i] = i >= d ? r->seen[i - d] : false;
    r->top = se;
  }
  for (uint64_t x = ss; x < se; x++) {
    if (r->top - x > WSECT)
      n++;
    else if (!r->seen[r->top - 1 - x]) {
      r->seen[r->top - 1 - x] = true;
      n++;
    }
  }
  return n * 512;
}

START_TEST (test_model_random)
{
  static struct ref ref[RECENT_IO];  /* zeroed below */
  struct bcf_seqdetect *s = new_fake ();
  uint64_t stamp = 0, ends[16] = { 0 };
  const uint64_t ops = 200000;

  rng_state = seed * 0x9E3779B97F4A7C15ull + 1;
  memset (ref, 0, sizeof ref);
  for (unsigned k = 0; k < RECENT_IO; k++)
    ref[k].stamp = stamp++;
  for (uint64_t op = 0; op < ops; op++) {
    uint64_t now, off, len = 1 + rnd_below (3) * 4096, want, fresh;
    bool exact;
    struct ref *hit = NULL, *near = NULL, *lru = &ref[0];

    atomic_fetch_add (&fake_ns, rnd_below (10) == 0 ? rnd_below (6 * SEC)
                                                    : rnd_below (SEC / 50));
    now = atomic_load (&fake_ns);
    /* Continue a recent end, or somewhere random in a small space so
     * that collisions and reuses happen. */
    off = rnd_below (2) ? ends[rnd_below (16)] : rnd_below (512) * 4096;
    for (unsigned k = 0; k < RECENT_IO; k++) {
      uint64_t d = ref[k].last > off ? ref[k].last - off : off - ref[k].last;
      bool live = ref[k].used && now < ref[k].deadline;
      if (live && d == 0 && (hit == NULL || ref[k].stamp > hit->stamp))
        hit = &ref[k];
      if (live && d <= WINDOW && (near == NULL || ref[k].stamp > near->stamp))
        near = &ref[k];
      if (ref[k].stamp < lru->stamp)
        lru = &ref[k];
    }
    exact = hit != NULL;
    if (hit == NULL)
      hit = near;
    if (hit == NULL) {
      hit = lru;
      hit->seq = 0;
      hit->last = off;
      hit->top = off / 512;
      memset (hit->seen, 0, sizeof hit->seen);
      exact = true;
    }
    hit->used = true;
    fresh = ref_fresh (hit, off, len);
    hit->seq += exact || fresh > len ? len : fresh;
    if (off + len > hit->last)
      hit->last = off + len;
    hit->deadline = now + EXPIRE;
    hit->stamp = stamp++;
    want = hit->seq;
    ends[rnd_below (16)] = hit->last;
    ck_assert_msg (bcf_seqdetect_account (s, off, len) == want,
                   "seed %u op %" PRIu64 ": account (%" PRIu64 ", %" PRIu64
                   ") != model %" PRIu64, seed, op, off, len, want);
  }
  bcf_seqdetect_free (s);
}
END_TEST

#define T_THREADS 8
static struct bcf_seqdetect *shared;
static atomic_uint thread_errors;

static void *
stream_thread (void *arg)
{
  uint64_t base = ((uint64_t) (uintptr_t) arg + 1) << 40;

  for (uint64_t i = 0; i < 20000; i++)
    if (bcf_seqdetect_account (shared, base + i * 4096, 4096) !=
        (i + 1) * 4096)
      atomic_fetch_add (&thread_errors, 1);
  return NULL;
}

START_TEST (test_threads)
{
  pthread_t th[T_THREADS];

  shared = bcf_seqdetect_new ();    /* real clock: 20000 ops < 5 s */
  atomic_store (&thread_errors, 0);
  for (unsigned i = 0; i < T_THREADS; i++)
    pthread_create (&th[i], NULL, stream_thread, (void *) (uintptr_t) i);
  for (unsigned i = 0; i < T_THREADS; i++)
    pthread_join (th[i], NULL);
  ck_assert_uint_eq (atomic_load (&thread_errors), 0);
  bcf_seqdetect_free (shared);
}
END_TEST

static Suite *
seqdetect_suite (void)
{
  Suite *s = suite_create ("seqdetect");
  TCase *tc = tcase_create ("streams");

  tcase_set_timeout (tc, 600);
  tcase_add_test (tc, test_stream);
  tcase_add_test (tc, test_interleaved);
  tcase_add_test (tc, test_reordered);
  tcase_add_test (tc, test_expiry);
  tcase_add_test (tc, test_lru);
  tcase_add_test (tc, test_saturate);
  tcase_add_test (tc, test_model_random);
  tcase_add_test (tc, test_threads);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  seed = test_seed ("test-seqdetect");
  return test_main (seqdetect_suite ());
}
