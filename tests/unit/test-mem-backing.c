/* bcachefilter tests: the in-memory backing store (mem-backing.h) that
 * the engine's unit tests stand on.  If it is wrong, every race and crash
 * test built on it proves nothing, so its own tests check each knob
 * against a plain reference model (a flat shadow buffer).
 *
 * Random tests print their seed; set TEST_SEED to replay one.  Nothing
 * here asserts timing: latency is only checked not to break results, and
 * every wait on a gate has a timeout so a broken build fails, not hangs.
 */
#include "config.h"

#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mem-backing.h"
#include "testlib.h"

#define KiB (UINT64_C(1) << 10)
#define MiB (UINT64_C(1) << 20)
#define TiB (UINT64_C(1) << 40)
#define PAGE 4096

/* Long enough for any sanitizer build; reached only when broken. */
#define HIT_TIMEOUT_MS 10000

static uint64_t seed_base;

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static uint64_t
mix_next (uint64_t *s)
{
  uint64_t z = (*s += UINT64_C(0x9e3779b97f4a7c15));

  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

/* The seed of one random test, printed so a failure can be replayed. */
static uint64_t
case_seed (const char *name)
{
  printf ("%s: TEST_SEED=%" PRIu64 "\n", name, seed_base);
  fflush (stdout);
  return seed_base;
}

static int
rd (struct mem_backing *mb, void *buf, uint32_t len, uint64_t off)
{
  struct bcf_backing b = mem_backing_get (mb);
  return b.ops->pread (b.opaque, buf, len, off);
}

static int
wr (struct mem_backing *mb, const void *buf, uint32_t len, uint64_t off,
    bool fua)
{
  struct bcf_backing b = mem_backing_get (mb);
  return b.ops->pwrite (b.opaque, buf, len, off, fua);
}

static int
fl (struct mem_backing *mb)
{
  struct bcf_backing b = mem_backing_get (mb);
  return b.ops->flush (b.opaque);
}

static int
tr (struct mem_backing *mb, uint32_t len, uint64_t off)
{
  struct bcf_backing b = mem_backing_get (mb);
  return b.ops->trim (b.opaque, len, off);
}

static int
zr (struct mem_backing *mb, uint32_t len, uint64_t off, bool may_trim)
{
  struct bcf_backing b = mem_backing_get (mb);
  return b.ops->zero (b.opaque, len, off, may_trim);
}

/* A byte pattern that depends on position and tag, so shifted or stale
 * data never matches by accident. */
static void
fill (uint8_t *buf, size_t len, uint64_t off, unsigned tag)
{
  size_t i;

  for (i = 0; i < len; i++) {
    uint64_t x = off + i;
    buf[i] = (uint8_t) (x * 31 + (x >> 8) * 7 + tag * 101 + 1);
  }
}

static bool
is_zero (const uint8_t *buf, size_t len)
{
  size_t i;

  for (i = 0; i < len; i++)
    if (buf[i])
      return false;
  return true;
}

/* The store equals the reference, byte for byte; names the first
 * difference. */
static void
assert_store_eq (struct mem_backing *mb, const uint8_t *ref, size_t len,
                 uint64_t off)
{
  uint8_t *buf = malloc (len);
  size_t i;

  ck_assert_ptr_nonnull (buf);
  mem_backing_peek (mb, buf, len, off);
  for (i = 0; i < len; i++)
    if (buf[i] != ref[i])
      ck_abort_msg ("store differs at %" PRIu64 ": %#x, expected %#x",
                    off + i, buf[i], ref[i]);
  free (buf);
}

/* Random request length: mostly small, sometimes many pages. */
static uint64_t
rnd_len (uint64_t *s, uint64_t max)
{
  uint64_t len = (mix_next (s) & 1) ? 1 + mix_next (s) % 700 : 1 + mix_next (s) % 20000;
  return len < max ? len : max;
}

/* Random requests checked against shadow, a flat copy of the store. */
static void
model_run (struct mem_backing *mb, uint8_t *shadow, uint64_t size,
           uint64_t *s, int nops)
{
  uint8_t *buf = malloc (20000);
  int i;

  ck_assert_ptr_nonnull (buf);
  for (i = 0; i < nops; i++) {
    uint64_t off = mix_next (s) % size, len = rnd_len (s, size - off);

    switch (mix_next (s) % 10) {
    case 0: case 1: case 2: case 3:
      fill (buf, len, off, (unsigned) i);
      ck_assert_int_eq (wr (mb, buf, len, off, mix_next (s) % 4 == 0), 0);
      memcpy (shadow + off, buf, len);
      break;
    case 4: case 5: case 6:
      ck_assert_int_eq (rd (mb, buf, len, off), 0);
      if (memcmp (buf, shadow + off, len) != 0)
        ck_abort_msg ("op %d: read %" PRIu64 "+%" PRIu64 " differs",
                      i, off, len);
      break;
    case 7:
      ck_assert_int_eq (tr (mb, len, off), 0);
      memset (shadow + off, 0, len);
      break;
    case 8:
      ck_assert_int_eq (zr (mb, len, off, mix_next (s) & 1), 0);
      memset (shadow + off, 0, len);
      break;
    case 9:
      ck_assert_int_eq (fl (mb), 0);
      break;
    }
  }
  free (buf);
}

/* A thread doing one request, for gate tests.  Check's asserts belong in
 * the main thread, so it only records what happened. */
struct io_thread {
  pthread_t tid;
  struct mem_backing *mb;
  unsigned op;
  uint64_t off;
  uint32_t len;
  uint8_t *buf;
  int rc;
};

static void *
io_thread_run (void *arg)
{
  struct io_thread *t = arg;

  switch (t->op) {
  case MEM_BACKING_READ: t->rc = rd (t->mb, t->buf, t->len, t->off); break;
  case MEM_BACKING_WRITE:
    t->rc = wr (t->mb, t->buf, t->len, t->off, false);
    break;
  case MEM_BACKING_FLUSH: t->rc = fl (t->mb); break;
  default: t->rc = -999;
  }
  return NULL;
}

static void
io_thread_start (struct io_thread *t, struct mem_backing *mb, unsigned op,
                 uint8_t *buf, uint32_t len, uint64_t off)
{
  *t = (struct io_thread) {
    .mb = mb, .op = op, .buf = buf, .len = len, .off = off, .rc = -998,
  };
  ck_assert_int_eq (pthread_create (&t->tid, NULL, io_thread_run, t), 0);
}

static int
io_thread_join (struct io_thread *t)
{
  ck_assert_int_eq (pthread_join (t->tid, NULL), 0);
  return t->rc;
}

/* ------------------------------------------------------------------------
 * Storage
 * ------------------------------------------------------------------------ */

START_TEST (test_sparse_zeroes)
{
  struct mem_backing *mb = mem_backing_new (TiB);
  struct bcf_backing b = mem_backing_get (mb);
  static uint8_t buf[3 * PAGE];
  const uint64_t offs[] = { 0, 4095, 512 * 1024 * MiB + 17, TiB - sizeof buf };
  size_t i;

  ck_assert_int_eq (b.ops->size (b.opaque), (int64_t) TiB);
  for (i = 0; i < sizeof offs / sizeof offs[0]; i++) {
    memset (buf, 0xaa, sizeof buf);
    ck_assert_int_eq (rd (mb, buf, sizeof buf, offs[i]), 0);
    ck_assert (is_zero (buf, sizeof buf));
  }
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 0);

  /* One byte in the middle costs one page, and only that byte changes. */
  ck_assert_int_eq (wr (mb, "x", 1, TiB / 2 + 1, false), 0);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 1);
  ck_assert_int_eq (rd (mb, buf, sizeof buf, TiB / 2 - PAGE), 0);
  ck_assert (is_zero (buf, PAGE + 1));
  ck_assert_int_eq (buf[PAGE + 1], 'x');
  ck_assert (is_zero (buf + PAGE + 2, sizeof buf - PAGE - 2));
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_roundtrip_unaligned)
{
  /* Size not a page multiple: the last page is partial. */
  const uint64_t size = 64 * KiB + 100;
  struct mem_backing *mb = mem_backing_new (size);
  uint8_t *shadow = calloc (1, size), data[10000], buf[12000];

  ck_assert_ptr_nonnull (shadow);
  /* Across three pages from an odd offset. */
  fill (data, sizeof data, 4090, 1);
  ck_assert_int_eq (wr (mb, data, sizeof data, 4090, false), 0);
  memcpy (shadow + 4090, data, sizeof data);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 4);
  memset (buf, 0xaa, sizeof buf);
  ck_assert_int_eq (rd (mb, buf, sizeof data, 4090), 0);
  ck_assert_mem_eq (buf, data, sizeof data);
  /* A wider, differently aligned read sees the zeroes around it. */
  ck_assert_int_eq (rd (mb, buf, sizeof buf, 3000), 0);
  ck_assert_mem_eq (buf, shadow + 3000, sizeof buf);

  /* The last bytes of the store. */
  fill (data, 7, size - 7, 2);
  ck_assert_int_eq (wr (mb, data, 7, size - 7, false), 0);
  memcpy (shadow + size - 7, data, 7);
  ck_assert_int_eq (rd (mb, buf, 200, size - 200), 0);
  ck_assert_mem_eq (buf, shadow + size - 200, 200);
  assert_store_eq (mb, shadow, size, 0);
  mem_backing_free (mb);

  /* Then random requests against the model. */
  {
    uint64_t s = case_seed ("roundtrip_unaligned");
    const uint64_t msize = MiB + 333;
    uint8_t *mshadow = calloc (1, msize);

    ck_assert_ptr_nonnull (mshadow);
    mb = mem_backing_new (msize);
    model_run (mb, mshadow, msize, &s, 3000);
    assert_store_eq (mb, mshadow, msize, 0);
    mem_backing_free (mb);
    free (mshadow);
  }
  free (shadow);
}
END_TEST

START_TEST (test_trim_zero)
{
  const uint64_t size = MiB;
  struct mem_backing *mb = mem_backing_new (size);
  uint8_t *shadow = malloc (size);
  struct mem_backing_stats st;

  ck_assert_ptr_nonnull (shadow);
  fill (shadow, size, 0, 3);
  ck_assert_int_eq (wr (mb, shadow, size, 0, false), 0);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 256);

  /* Whole pages are freed. */
  ck_assert_int_eq (tr (mb, 2 * PAGE, 2 * PAGE), 0);
  memset (shadow + 2 * PAGE, 0, 2 * PAGE);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 254);
  assert_store_eq (mb, shadow, size, 0);

  /* Part of a page: zeroed in place, neighbours intact. */
  ck_assert_int_eq (zr (mb, 100, 100, false), 0);
  memset (shadow + 100, 0, 100);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 254);
  assert_store_eq (mb, shadow, size, 0);

  /* Unaligned: part of a hole, two whole pages (freed), part of one. */
  ck_assert_int_eq (zr (mb, 3 * PAGE, 3 * PAGE + 10, true), 0);
  memset (shadow + 3 * PAGE + 10, 0, 3 * PAGE);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 252);
  assert_store_eq (mb, shadow, size, 0);

  /* Trim of part of a page zeroes it too (deterministic, documented). */
  ck_assert_int_eq (tr (mb, 1, size - 1), 0);
  shadow[size - 1] = 0;
  assert_store_eq (mb, shadow, size, 0);

  /* Everything. */
  ck_assert_int_eq (zr (mb, size, 0, false), 0);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 0);
  memset (shadow, 0, size);
  assert_store_eq (mb, shadow, size, 0);

  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.trims, 2);
  ck_assert_uint_eq (st.zeros, 3);
  ck_assert_uint_eq (st.writes, 1);
  ck_assert_uint_eq (st.bytes_written, size);
  mem_backing_free (mb);
  free (shadow);
}
END_TEST

START_TEST (test_invalid_requests)
{
  struct mem_backing *mb = mem_backing_new (10 * PAGE);
  struct mem_backing_stats st;
  uint8_t buf[PAGE] = { 0 };

  ck_assert_int_eq (rd (mb, buf, PAGE, 10 * PAGE - PAGE + 1), -EINVAL);
  ck_assert_int_eq (wr (mb, buf, 1, 10 * PAGE, false), -EINVAL);
  ck_assert_int_eq (rd (mb, buf, 0, 0), -EINVAL);
  ck_assert_int_eq (tr (mb, PAGE, UINT64_MAX - 10), -EINVAL);
  ck_assert_int_eq (zr (mb, 2, UINT64_MAX, true), -EINVAL);
  /* The last byte is fine. */
  ck_assert_int_eq (wr (mb, buf, 1, 10 * PAGE - 1, false), 0);
  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.invalid, 5);
  ck_assert_uint_eq (st.reads, 0);
  ck_assert_uint_eq (st.writes, 1);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_counters)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  struct mem_backing_stats st;
  uint8_t buf[8192] = { 0 };

  ck_assert_int_eq (rd (mb, buf, 4096, 0), 0);
  ck_assert_int_eq (rd (mb, buf, 100, 4096), 0);
  ck_assert_int_eq (rd (mb, buf, 5000, 10000), 0);
  ck_assert_int_eq (wr (mb, buf, 8192, 0, true), 0);
  ck_assert_int_eq (wr (mb, buf, 10, 50000, false), 0);
  ck_assert_int_eq (fl (mb), 0);

  ck_assert_uint_eq (mem_backing_read_count_range (mb, 0, 1), 1);
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 4000, 200), 2);
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 4196, 5804), 0);
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 9999, 2), 1);
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 15000, 100), 0);
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 0, MiB), 3);
  /* Writes are not reads. */
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 50000, 10), 0);

  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.reads, 3);
  ck_assert_uint_eq (st.bytes_read, 4096 + 100 + 5000);
  ck_assert_uint_eq (st.writes, 2);
  ck_assert_uint_eq (st.fua_writes, 1);
  ck_assert_uint_eq (st.bytes_written, 8192 + 10);
  ck_assert_uint_eq (st.flushes, 1);
  ck_assert_uint_eq (st.faults, 0);

  mem_backing_reset_stats (mb);
  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.reads + st.writes + st.flushes + st.bytes_read, 0);
  ck_assert_uint_eq (mem_backing_read_count_range (mb, 0, MiB), 0);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_peek_poke_bypass)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  struct mem_backing_gate *g;
  struct mem_backing_stats st;
  uint8_t data[5000], buf[5000];
  int f;

  /* Everything that could stop or fail a request is armed... */
  g = mem_backing_gate_arm (mb, MEM_BACKING_ANY, MEM_BACKING_BEFORE_IO, 0, 0);
  f = mem_backing_fail_range (mb, MEM_BACKING_ANY, 0, 0, EIO);
  mem_backing_fail_nth_read (mb, 1, EIO);
  mem_backing_set_read_latency (mb, 1000);

  /* ...and peek and poke go straight through. */
  fill (data, sizeof data, 3000, 4);
  mem_backing_poke (mb, data, sizeof data, 3000);
  mem_backing_peek (mb, buf, sizeof buf, 3000);
  ck_assert_mem_eq (buf, data, sizeof data);
  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.reads + st.writes + st.faults, 0);
  ck_assert (!mem_backing_gate_wait_hit (g, 0));
  mem_backing_gate_release (g);

  /* The nth fault was not consumed by peek. */
  mem_backing_fail_range_clear (mb, f);
  ck_assert_int_eq (rd (mb, buf, 10, 0), -EIO);
  ck_assert_int_eq (rd (mb, buf, 10, 0), 0);
  mem_backing_free (mb);
}
END_TEST

/* ------------------------------------------------------------------------
 * Faults and latency
 * ------------------------------------------------------------------------ */

START_TEST (test_fault_nth_read)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  struct mem_backing_stats st;
  uint8_t data[PAGE], buf[PAGE];
  int i;

  fill (data, sizeof data, 0, 5);
  ck_assert_int_eq (wr (mb, data, sizeof data, 0, false), 0);

  mem_backing_fail_nth_read (mb, 3, EBADMSG);
  for (i = 1; i <= 12; i++) {
    int r;

    memset (buf, 0, sizeof buf);
    r = rd (mb, buf, sizeof buf, 0);
    if (i == 3)
      ck_assert_int_eq (r, -EBADMSG);
    else {
      ck_assert_int_eq (r, 0);
      ck_assert_mem_eq (buf, data, sizeof data);
    }
    /* Writes do not count towards a read fault. */
    ck_assert_int_eq (wr (mb, data, sizeof data, 0, false), 0);
  }
  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.faults, 1);
  ck_assert_uint_eq (st.reads, 12);     /* the failed one was issued */

  /* Negative errno accepted; n = 0 disarms. */
  mem_backing_fail_nth_read (mb, 1, -EIO);
  ck_assert_int_eq (rd (mb, buf, 1, 0), -EIO);
  mem_backing_fail_nth_read (mb, 2, EIO);
  mem_backing_fail_nth_read (mb, 0, EIO);
  ck_assert_int_eq (rd (mb, buf, 1, 0), 0);
  ck_assert_int_eq (rd (mb, buf, 1, 0), 0);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_fault_nth_write)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  uint8_t a[PAGE], b[PAGE], buf[PAGE];

  fill (a, sizeof a, 0, 6);
  fill (b, sizeof b, 0, 7);
  mem_backing_fail_nth_write (mb, 2, ENOSPC);
  ck_assert_int_eq (wr (mb, a, sizeof a, 0, false), 0);
  /* Trim, zero and flush are not pwrites: they do not count. */
  ck_assert_int_eq (tr (mb, 10, PAGE), 0);
  ck_assert_int_eq (zr (mb, 10, PAGE, false), 0);
  ck_assert_int_eq (fl (mb), 0);
  /* The second write fails and changes nothing. */
  ck_assert_int_eq (wr (mb, b, sizeof b, 0, true), -ENOSPC);
  mem_backing_peek (mb, buf, sizeof buf, 0);
  ck_assert_mem_eq (buf, a, sizeof a);
  ck_assert_int_eq (wr (mb, b, sizeof b, 0, false), 0);
  mem_backing_peek (mb, buf, sizeof buf, 0);
  ck_assert_mem_eq (buf, b, sizeof b);

  /* Trim has its own countdown. */
  mem_backing_fail_nth (mb, MEM_BACKING_TRIM, 1, EPERM);
  ck_assert_int_eq (tr (mb, PAGE, 0), -EPERM);
  mem_backing_peek (mb, buf, sizeof buf, 0);
  ck_assert_mem_eq (buf, b, sizeof b);
  ck_assert_int_eq (tr (mb, PAGE, 0), 0);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_fault_range)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  uint8_t data[PAGE], buf[PAGE] = { 0 };
  int w, m, r;

  fill (data, sizeof data, 0, 8);
  ck_assert_int_eq (wr (mb, data, 200, 8000, false), 0);

  w = mem_backing_fail_range (mb, MEM_BACKING_WRITE, 8192, PAGE, EROFS);
  ck_assert_int_eq (wr (mb, data, PAGE, 0, false), 0);
  ck_assert_int_eq (wr (mb, buf, 200, 8100, false), -EROFS);  /* overlaps */
  ck_assert_int_eq (wr (mb, buf, 1, 12287, true), -EROFS);    /* last byte */
  ck_assert_int_eq (wr (mb, data, 100, 12288, false), 0);     /* adjacent */
  ck_assert_int_eq (wr (mb, data, 192, 8000, false), 0);      /* adjacent */
  /* Failed writes changed nothing. */
  mem_backing_peek (mb, buf, 200, 8000);
  ck_assert_mem_eq (buf, data, 200);
  /* Only writes were named: reads and trims of the range work. */
  ck_assert_int_eq (rd (mb, buf, PAGE, 8192), 0);
  ck_assert_int_eq (tr (mb, 10, 9000), 0);
  /* Again and again, until cleared. */
  ck_assert_int_eq (wr (mb, data, PAGE, 8192, false), -EROFS);
  ck_assert_int_eq (wr (mb, data, PAGE, 8192, false), -EROFS);

  /* A second range fault, for every change. */
  m = mem_backing_fail_range (mb, MEM_BACKING_MODIFY, 100 * PAGE, 1, EIO);
  ck_assert_int_ne (m, w);
  ck_assert_int_eq (tr (mb, 2 * PAGE, 99 * PAGE), -EIO);
  ck_assert_int_eq (zr (mb, 1, 100 * PAGE, true), -EIO);
  ck_assert_int_eq (wr (mb, data, 1, 100 * PAGE, false), -EIO);
  ck_assert_int_eq (rd (mb, buf, PAGE, 100 * PAGE), 0);

  mem_backing_fail_range_clear (mb, w);
  ck_assert_int_eq (wr (mb, data, PAGE, 8192, false), 0);
  ck_assert_int_eq (tr (mb, 2 * PAGE, 99 * PAGE), -EIO);
  mem_backing_fail_range_clear (mb, m);
  ck_assert_int_eq (tr (mb, 2 * PAGE, 99 * PAGE), 0);

  /* len 0: the whole store; cleared by clear_faults. */
  r = mem_backing_fail_range (mb, MEM_BACKING_READ, 0, 0, ETIMEDOUT);
  ck_assert_int_ge (r, 0);
  ck_assert_int_eq (rd (mb, buf, 1, 0), -ETIMEDOUT);
  ck_assert_int_eq (rd (mb, buf, 1, MiB - 1), -ETIMEDOUT);
  mem_backing_clear_faults (mb);
  ck_assert_int_eq (rd (mb, buf, 1, MiB - 1), 0);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_fault_flush)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  uint8_t data[PAGE], buf[PAGE];

  mem_backing_track_crash (mb, true);
  fill (data, sizeof data, 0, 9);
  ck_assert_int_eq (wr (mb, data, sizeof data, 0, false), 0);

  mem_backing_fail_flush (mb, EIO);
  ck_assert_int_eq (fl (mb), -EIO);
  ck_assert_int_eq (fl (mb), -EIO);
  /* A failed flush made nothing durable. */
  ck_assert_uint_eq (mem_backing_unflushed (mb), 1);
  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 1);
  mem_backing_peek (mb, buf, sizeof buf, 0);
  ck_assert (is_zero (buf, sizeof buf));

  mem_backing_fail_flush (mb, 0);
  ck_assert_int_eq (wr (mb, data, sizeof data, 0, false), 0);
  ck_assert_int_eq (fl (mb), 0);
  ck_assert_uint_eq (mem_backing_unflushed (mb), 0);

  /* Nth flush. */
  mem_backing_fail_nth (mb, MEM_BACKING_FLUSH, 2, EDQUOT);
  ck_assert_int_eq (fl (mb), 0);
  ck_assert_int_eq (fl (mb), -EDQUOT);
  ck_assert_int_eq (fl (mb), 0);
  mem_backing_free (mb);
}
END_TEST

START_TEST (test_latency)
{
  uint64_t s = case_seed ("latency");
  const uint64_t size = 256 * KiB;
  struct mem_backing *mb = mem_backing_new (size);
  uint8_t *shadow = calloc (1, size);

  ck_assert_ptr_nonnull (shadow);
  mem_backing_set_read_latency (mb, 200);
  mem_backing_set_write_latency (mb, 300);
  model_run (mb, shadow, size, &s, 200);
  /* Changed while in use, then off again. */
  mem_backing_set_read_latency (mb, 0);
  model_run (mb, shadow, size, &s, 100);
  mem_backing_set_write_latency (mb, 0);
  model_run (mb, shadow, size, &s, 100);
  assert_store_eq (mb, shadow, size, 0);
  mem_backing_free (mb);
  free (shadow);
}
END_TEST

/* ------------------------------------------------------------------------
 * Gates
 * ------------------------------------------------------------------------ */

/* A read parked before the I/O sees a write made while it waits; other
 * requests, to the same bytes or not, are not held up meanwhile. */
START_TEST (test_gate_before_io)
{
  const uint64_t off = 3 * PAGE, len = 2 * PAGE;
  struct mem_backing *mb = mem_backing_new (MiB);
  static uint8_t old[2 * PAGE], new[2 * PAGE], got[2 * PAGE], buf[PAGE];
  struct mem_backing_gate *g;
  struct io_thread t;

  fill (old, len, off, 10);
  fill (new, len, off, 11);
  ck_assert_int_eq (wr (mb, old, len, off, false), 0);

  g = mem_backing_gate_arm (mb, MEM_BACKING_READ, MEM_BACKING_BEFORE_IO,
                            off + 100, 10);
  io_thread_start (&t, mb, MEM_BACKING_READ, got, len, off);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));

  /* Unrelated and related requests all complete while it is parked. */
  ck_assert_int_eq (rd (mb, buf, PAGE, 0), 0);
  ck_assert_int_eq (wr (mb, buf, PAGE, 2 * PAGE, false), 0);
  ck_assert_int_eq (rd (mb, buf, PAGE, off), 0);        /* one-shot gate */
  ck_assert_int_eq (fl (mb), 0);
  ck_assert_int_eq (wr (mb, new, len, off, false), 0);

  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), 0);
  ck_assert_mem_eq (got, new, len);
  mem_backing_free (mb);
}
END_TEST

/* A read parked after the I/O already holds the old data. */
START_TEST (test_gate_after_io)
{
  const uint64_t off = 5000, len = 6000;
  struct mem_backing *mb = mem_backing_new (MiB);
  static uint8_t old[6000], new[6000], got[6000], buf[6000];
  struct mem_backing_gate *g;
  struct io_thread t;

  fill (old, len, off, 12);
  fill (new, len, off, 13);
  ck_assert_int_eq (wr (mb, old, len, off, false), 0);

  g = mem_backing_gate_arm (mb, MEM_BACKING_ANY, MEM_BACKING_AFTER_IO, 0, 0);
  io_thread_start (&t, mb, MEM_BACKING_READ, got, len, off);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));
  ck_assert_int_eq (wr (mb, new, len, off, false), 0);
  ck_assert_int_eq (rd (mb, buf, len, off), 0);
  ck_assert_mem_eq (buf, new, len);
  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), 0);
  ck_assert_mem_eq (got, old, len);
  mem_backing_free (mb);
}
END_TEST

/* Write gates: BEFORE_IO has not changed the data yet, AFTER_IO has. */
START_TEST (test_gate_write_points)
{
  const uint64_t off = 70000, len = 3000;
  struct mem_backing *mb = mem_backing_new (MiB);
  static uint8_t new[3000], buf[3000];
  struct mem_backing_gate *g;
  struct io_thread t;

  fill (new, len, off, 14);

  g = mem_backing_gate_arm (mb, MEM_BACKING_WRITE, MEM_BACKING_BEFORE_IO,
                            off + len - 1, 1);
  io_thread_start (&t, mb, MEM_BACKING_WRITE, new, len, off);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));
  ck_assert_int_eq (rd (mb, buf, len, off), 0);
  ck_assert (is_zero (buf, len));
  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), 0);
  mem_backing_peek (mb, buf, len, off);
  ck_assert_mem_eq (buf, new, len);

  fill (new, len, off, 15);
  g = mem_backing_gate_arm (mb, MEM_BACKING_MODIFY, MEM_BACKING_AFTER_IO,
                            off, 1);
  io_thread_start (&t, mb, MEM_BACKING_WRITE, new, len, off);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));
  ck_assert_int_eq (rd (mb, buf, len, off), 0);
  ck_assert_mem_eq (buf, new, len);
  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), 0);
  mem_backing_free (mb);
}
END_TEST

/* wait_hit times out when nothing matches: other ranges, other ops. */
START_TEST (test_gate_timeout)
{
  struct mem_backing *mb = mem_backing_new (2 * MiB);
  struct mem_backing_gate *g;
  uint8_t buf[PAGE] = { 0 };

  g = mem_backing_gate_arm (mb, MEM_BACKING_READ, MEM_BACKING_BEFORE_IO,
                            MiB, PAGE);
  ck_assert (!mem_backing_gate_wait_hit (g, 0));
  ck_assert_int_eq (rd (mb, buf, PAGE, MiB - PAGE), 0);   /* adjacent */
  ck_assert_int_eq (rd (mb, buf, PAGE, MiB + PAGE), 0);   /* adjacent */
  ck_assert_int_eq (wr (mb, buf, PAGE, MiB, false), 0);   /* not a read */
  ck_assert_int_eq (tr (mb, PAGE, MiB), 0);
  ck_assert_int_eq (fl (mb), 0);
  ck_assert (!mem_backing_gate_wait_hit (g, 50));
  /* Released unhit: disarmed, the next read passes. */
  mem_backing_gate_release (g);
  ck_assert_int_eq (rd (mb, buf, PAGE, MiB), 0);
  mem_backing_free (mb);
}
END_TEST

/* Each gate catches one request; gates armed first catch first. */
START_TEST (test_gate_one_shot_order)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  struct mem_backing_gate *g1, *g2;
  static uint8_t b1[PAGE], b2[PAGE], b3[PAGE];
  struct io_thread t1, t2;

  g1 = mem_backing_gate_arm (mb, MEM_BACKING_READ, MEM_BACKING_BEFORE_IO,
                             0, PAGE);
  g2 = mem_backing_gate_arm (mb, MEM_BACKING_READ, MEM_BACKING_BEFORE_IO,
                             0, PAGE);
  io_thread_start (&t1, mb, MEM_BACKING_READ, b1, PAGE, 0);
  ck_assert (mem_backing_gate_wait_hit (g1, HIT_TIMEOUT_MS));
  ck_assert (!mem_backing_gate_wait_hit (g2, 0));
  io_thread_start (&t2, mb, MEM_BACKING_READ, b2, PAGE, 0);
  ck_assert (mem_backing_gate_wait_hit (g2, HIT_TIMEOUT_MS));
  /* Both parked; a third read passes. */
  ck_assert_int_eq (rd (mb, b3, PAGE, 0), 0);
  mem_backing_gate_release (g2);
  ck_assert_int_eq (io_thread_join (&t2), 0);
  mem_backing_gate_release (g1);
  ck_assert_int_eq (io_thread_join (&t1), 0);
  mem_backing_free (mb);
}
END_TEST

/* A failing request still passes its gates, and does no I/O. */
START_TEST (test_gate_with_fault)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  struct mem_backing_gate *g;
  static uint8_t buf[PAGE];
  struct io_thread t;

  fill (buf, PAGE, 0, 16);
  mem_backing_fail_nth_write (mb, 1, EIO);
  g = mem_backing_gate_arm (mb, MEM_BACKING_WRITE, MEM_BACKING_AFTER_IO,
                            0, PAGE);
  io_thread_start (&t, mb, MEM_BACKING_WRITE, buf, PAGE, 0);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));
  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), -EIO);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 0);
  mem_backing_free (mb);
}
END_TEST

/* A flush makes durable what was written before it passed BEFORE_IO, and
 * not what came while it was parked after its work. */
START_TEST (test_gate_flush)
{
  struct mem_backing *mb = mem_backing_new (MiB);
  struct mem_backing_gate *g;
  uint8_t x[PAGE], y[PAGE], buf[PAGE];
  struct io_thread t;

  fill (x, PAGE, 0, 17);
  fill (y, PAGE, PAGE, 18);
  mem_backing_track_crash (mb, true);

  g = mem_backing_gate_arm (mb, MEM_BACKING_FLUSH, MEM_BACKING_BEFORE_IO,
                            0, 0);
  io_thread_start (&t, mb, MEM_BACKING_FLUSH, NULL, 0, 0);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));
  ck_assert_int_eq (wr (mb, x, PAGE, 0, false), 0);
  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), 0);
  ck_assert_uint_eq (mem_backing_unflushed (mb), 0);

  g = mem_backing_gate_arm (mb, MEM_BACKING_FLUSH, MEM_BACKING_AFTER_IO,
                            0, 0);
  io_thread_start (&t, mb, MEM_BACKING_FLUSH, NULL, 0, 0);
  ck_assert (mem_backing_gate_wait_hit (g, HIT_TIMEOUT_MS));
  ck_assert_int_eq (wr (mb, y, PAGE, PAGE, false), 0);
  mem_backing_gate_release (g);
  ck_assert_int_eq (io_thread_join (&t), 0);
  ck_assert_uint_eq (mem_backing_unflushed (mb), 1);

  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 1);
  mem_backing_peek (mb, buf, PAGE, 0);
  ck_assert_mem_eq (buf, x, PAGE);
  mem_backing_peek (mb, buf, PAGE, PAGE);
  ck_assert (is_zero (buf, PAGE));
  mem_backing_free (mb);
}
END_TEST

/* ------------------------------------------------------------------------
 * Crash model
 * ------------------------------------------------------------------------ */

START_TEST (test_crash_lose_all)
{
  const uint64_t size = 64 * KiB;
  struct mem_backing *mb = mem_backing_new (size);
  uint8_t *ref = malloc (size), *buf = malloc (size);

  ck_assert_ptr_nonnull (ref);
  ck_assert_ptr_nonnull (buf);
  /* Before tracking: durable. */
  fill (buf, size, 0, 20);
  ck_assert_int_eq (wr (mb, buf, size, 0, false), 0);
  mem_backing_track_crash (mb, true);

  fill (buf, 10000, 0, 21);
  ck_assert_int_eq (wr (mb, buf, 10000, 0, false), 0);
  ck_assert_int_eq (fl (mb), 0);
  mem_backing_peek (mb, ref, size, 0);           /* the durable state */

  fill (buf, 15000, 5000, 22);
  ck_assert_int_eq (wr (mb, buf, 15000, 5000, false), 0);
  ck_assert_int_eq (tr (mb, PAGE, 0), 0);
  ck_assert_int_eq (zr (mb, 2 * PAGE, 4 * PAGE, true), 0);
  fill (buf, 100, size - 100, 23);
  ck_assert_int_eq (wr (mb, buf, 100, size - 100, false), 0);
  ck_assert_uint_eq (mem_backing_unflushed (mb), 4);

  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 4);
  assert_store_eq (mb, ref, size, 0);
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), size / PAGE);
  /* Nothing left to lose. */
  ck_assert_uint_eq (mem_backing_unflushed (mb), 0);
  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 0);
  assert_store_eq (mb, ref, size, 0);
  mem_backing_free (mb);
  free (ref);
  free (buf);
}
END_TEST

START_TEST (test_crash_fua)
{
  const uint64_t size = 64 * KiB;
  struct mem_backing *mb = mem_backing_new (size);
  uint8_t *ref = calloc (1, size), buf[3 * PAGE];

  ck_assert_ptr_nonnull (ref);
  mem_backing_track_crash (mb, true);
  /* X (lost) under Y (fua) under W (lost), then Z (lost). */
  fill (buf, 3 * PAGE, 0, 24);
  ck_assert_int_eq (wr (mb, buf, 3 * PAGE, 0, false), 0);
  fill (buf, PAGE, PAGE, 25);
  ck_assert_int_eq (wr (mb, buf, PAGE, PAGE, true), 0);
  memcpy (ref + PAGE, buf, PAGE);
  fill (buf, 20, PAGE + 10, 26);
  ck_assert_int_eq (wr (mb, buf, 20, PAGE + 10, false), 0);
  fill (buf, 100, 10000, 27);
  ck_assert_int_eq (wr (mb, buf, 100, 10000, false), 0);
  /* A poke is durable too. */
  fill (buf, 50, 30000, 28);
  mem_backing_poke (mb, buf, 50, 30000);
  memcpy (ref + 30000, buf, 50);
  ck_assert_uint_eq (mem_backing_unflushed (mb), 3);

  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 3);
  assert_store_eq (mb, ref, size, 0);
  /* Pages that held only lost data are holes again. */
  ck_assert_uint_eq (mem_backing_allocated_pages (mb), 2);
  mem_backing_free (mb);
  free (ref);
}
END_TEST

START_TEST (test_crash_keep_all)
{
  uint64_t s = case_seed ("crash_keep_all");
  const uint64_t size = 256 * KiB;
  struct mem_backing *mb = mem_backing_new (size);
  uint8_t *shadow = calloc (1, size);

  ck_assert_ptr_nonnull (shadow);
  mem_backing_track_crash (mb, true);
  model_run (mb, shadow, size, &s, 300);
  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_KEEP_ALL, 0), 0);
  assert_store_eq (mb, shadow, size, 0);
  /* Kept means durable now. */
  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 0);
  assert_store_eq (mb, shadow, size, 0);
  /* And with tracking off, nothing is logged at all. */
  mem_backing_track_crash (mb, false);
  model_run (mb, shadow, size, &s, 100);
  ck_assert_uint_eq (mem_backing_unflushed (mb), 0);
  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_LOSE_ALL, 0), 0);
  assert_store_eq (mb, shadow, size, 0);
  mem_backing_free (mb);
  free (shadow);
}
END_TEST

/* Random unflushed history, the same on two stores. */
static void
random_history (struct mem_backing *mb, uint64_t size, uint64_t s, int nops)
{
  uint8_t *buf = malloc (20000);
  int i;

  ck_assert_ptr_nonnull (buf);
  for (i = 0; i < nops; i++) {
    uint64_t off = mix_next (&s) % size, len = rnd_len (&s, size - off);

    switch (mix_next (&s) % 6) {
    case 0: ck_assert_int_eq (tr (mb, len, off), 0); break;
    case 1: ck_assert_int_eq (zr (mb, len, off, false), 0); break;
    default:
      fill (buf, len, off, (unsigned) i);
      ck_assert_int_eq (wr (mb, buf, len, off, mix_next (&s) % 8 == 0), 0);
    }
  }
  free (buf);
}

START_TEST (test_crash_random_deterministic)
{
  uint64_t s = case_seed ("crash_random_deterministic");
  const uint64_t size = 256 * KiB;
  struct mem_backing *a = mem_backing_new (size), *b = mem_backing_new (size);
  uint8_t *ra = malloc (size), *rb = malloc (size);
  uint64_t na, nb, seed = mix_next (&s);
  static uint8_t buf[20 * 1024];
  int i;

  ck_assert_ptr_nonnull (ra);
  ck_assert_ptr_nonnull (rb);
  mem_backing_track_crash (a, true);
  mem_backing_track_crash (b, true);
  random_history (a, size, s, 200);
  random_history (b, size, s, 200);
  na = mem_backing_crash (a, MEM_BACKING_RANDOM, seed);
  nb = mem_backing_crash (b, MEM_BACKING_RANDOM, seed);
  ck_assert_uint_eq (na, nb);
  mem_backing_peek (a, ra, size, 0);
  mem_backing_peek (b, rb, size, 0);
  ck_assert_mem_eq (ra, rb, size);
  mem_backing_free (a);
  mem_backing_free (b);

  /* Disjoint writes: each one is found whole or not at all. */
  a = mem_backing_new (size);
  mem_backing_track_crash (a, true);
  for (i = 0; i < 12; i++) {
    fill (buf, sizeof buf, i * sizeof buf, 30 + i);
    ck_assert_int_eq (wr (a, buf, sizeof buf, i * sizeof buf, false), 0);
  }
  na = mem_backing_crash (a, MEM_BACKING_RANDOM, seed);
  nb = 0;
  for (i = 0; i < 12; i++) {
    uint8_t want[sizeof buf];

    mem_backing_peek (a, buf, sizeof buf, i * sizeof buf);
    fill (want, sizeof want, i * sizeof buf, 30 + i);
    if (is_zero (buf, sizeof buf))
      nb++;
    else
      ck_assert_mem_eq (buf, want, sizeof buf);
  }
  ck_assert_uint_eq (na, nb);
  mem_backing_free (a);
  free (ra);
  free (rb);
}
END_TEST

/* What a crash must leave, computed independently: the state at the last
 * flush, plus every kept write since, oldest first. */
struct hist_op {
  uint64_t off, len;
  uint8_t *data;                /* NULL: trim or zero */
  bool durable, kept;
};

struct history {
  struct hist_op *ops;
  size_t n, cap;
  uint8_t *flushed;             /* the store at the last flush */
  uint64_t rng;
  size_t next;                  /* keep(): the op it is asked about */
  bool mismatch;
};

static void
hist_push (struct history *h, uint64_t off, uint64_t len,
           const uint8_t *data, bool durable)
{
  struct hist_op *o;

  if (h->n == h->cap) {
    h->cap = h->cap ? 2 * h->cap : 64;
    h->ops = realloc (h->ops, h->cap * sizeof *h->ops);
    ck_assert_ptr_nonnull (h->ops);
  }
  o = &h->ops[h->n++];
  *o = (struct hist_op) { .off = off, .len = len, .durable = durable };
  if (data) {
    o->data = malloc (len);
    ck_assert_ptr_nonnull (o->data);
    memcpy (o->data, data, len);
  }
}

static void
hist_clear (struct history *h)
{
  size_t i;

  for (i = 0; i < h->n; i++)
    free (h->ops[i].data);
  h->n = 0;
}

/* keep(): walks the model's unflushed ops newest first, as the store
 * does, checking it is asked about the same ones. */
static bool
hist_keep (void *arg, uint64_t i, uint64_t off, uint64_t len)
{
  struct history *h = arg;

  while (h->next > 0 && h->ops[h->next - 1].durable)
    h->next--;
  if (h->next == 0) {
    h->mismatch = true;
    return true;
  }
  h->next--;
  if (h->ops[h->next].off != off || h->ops[h->next].len != len)
    h->mismatch = true;
  h->ops[h->next].kept = mix_next (&h->rng) % 3 != 0;
  return h->ops[h->next].kept;
}

START_TEST (test_crash_model)
{
  uint64_t s = case_seed ("crash_model");
  const uint64_t size = 128 * KiB + 1000;
  struct mem_backing *mb = mem_backing_new (size);
  struct history h = { .rng = mix_next (&s) };
  uint8_t *shadow = calloc (1, size), *buf = malloc (20000);
  int round, i;

  ck_assert_ptr_nonnull (shadow);
  ck_assert_ptr_nonnull (buf);
  h.flushed = calloc (1, size);
  ck_assert_ptr_nonnull (h.flushed);
  mem_backing_track_crash (mb, true);

  for (round = 0; round < 20; round++) {
    size_t k;

    for (i = 0; i < 60; i++) {
      uint64_t off = mix_next (&s) % size, len = rnd_len (&s, size - off);
      unsigned what = mix_next (&s) % 12;

      if (what == 0) {
        ck_assert_int_eq (fl (mb), 0);
        memcpy (h.flushed, shadow, size);
        hist_clear (&h);
      }
      else if (what <= 2) {
        if (what == 1)
          ck_assert_int_eq (tr (mb, len, off), 0);
        else
          ck_assert_int_eq (zr (mb, len, off, true), 0);
        memset (shadow + off, 0, len);
        hist_push (&h, off, len, NULL, false);
      }
      else {
        bool fua = what == 3;

        fill (buf, len, off, (unsigned) (round * 100 + i));
        ck_assert_int_eq (wr (mb, buf, len, off, fua), 0);
        memcpy (shadow + off, buf, len);
        hist_push (&h, off, len, buf, fua);
      }
    }

    h.next = h.n;
    mem_backing_crash_with (mb, hist_keep, &h);
    ck_assert (!h.mismatch);
    /* Every unflushed op was asked about. */
    for (k = 0; k < h.next; k++)
      ck_assert (h.ops[k].durable);

    for (k = 0; k < h.n; k++) {
      const struct hist_op *o = &h.ops[k];

      if (!o->durable && !o->kept)
        continue;
      if (o->data)
        memcpy (h.flushed + o->off, o->data, o->len);
      else
        memset (h.flushed + o->off, 0, o->len);
    }
    assert_store_eq (mb, h.flushed, size, 0);
    /* After the crash, the store is the new durable state. */
    memcpy (shadow, h.flushed, size);
    hist_clear (&h);
  }
  mem_backing_free (mb);
  hist_clear (&h);
  free (h.ops);
  free (h.flushed);
  free (shadow);
  free (buf);
}
END_TEST

/* ------------------------------------------------------------------------
 * Concurrency
 * ------------------------------------------------------------------------ */

/* Units of 1536 bytes, dealt round robin to the threads, so neighbours
 * share pages and stripes but never bytes. */
#define CT_THREADS 8
#define CT_UNIT 1536
#define CT_UNITS 256            /* per thread */
#define CT_SIZE ((uint64_t) CT_THREADS * CT_UNITS * CT_UNIT)
#define CT_OPS 3000

struct ct_thread {
  pthread_t tid;
  struct mem_backing *mb;
  unsigned id;
  uint64_t seed;
  uint8_t *shadow;              /* shared; each thread its own bytes */
  uint64_t writes, reads, errors;
  char msg[128];
};

static void *
ct_run (void *arg)
{
  struct ct_thread *t = arg;
  uint8_t buf[CT_UNIT], want[CT_UNIT];
  uint64_t s = t->seed;
  int i;

  for (i = 0; i < CT_OPS && !t->errors; i++) {
    uint64_t unit = (mix_next (&s) % CT_UNITS) * CT_THREADS + t->id;
    uint64_t in = mix_next (&s) % CT_UNIT;
    uint64_t len = 1 + mix_next (&s) % (CT_UNIT - in);
    uint64_t off = unit * CT_UNIT + in;
    unsigned what = mix_next (&s) % 10;
    int r;

    if (what < 6) {
      fill (buf, len, off, t->id * 1000 + i);
      r = wr (t->mb, buf, len, off, what == 0);
      memcpy (t->shadow + off, buf, len);
      t->writes++;
    }
    else if (what < 9) {
      r = rd (t->mb, buf, len, off);
      memcpy (want, t->shadow + off, len);
      if (r == 0 && memcmp (buf, want, len) != 0) {
        snprintf (t->msg, sizeof t->msg, "thread %u: read %" PRIu64
                  "+%" PRIu64 " differs", t->id, off, len);
        t->errors++;
      }
      t->reads++;
    }
    else {
      r = (i & 1) ? tr (t->mb, len, off) : zr (t->mb, len, off, true);
      memset (t->shadow + off, 0, len);
    }
    if (r != 0) {
      snprintf (t->msg, sizeof t->msg, "thread %u: op %d returned %d",
                t->id, i, r);
      t->errors++;
    }
  }
  return NULL;
}

static atomic_bool ct_stop;

static void *
ct_flusher (void *arg)
{
  struct mem_backing *mb = arg;

  while (!atomic_load (&ct_stop)) {
    if (fl (mb) != 0)
      return (void *) 1;
    usleep (100);
  }
  return NULL;
}

START_TEST (test_concurrent)
{
  uint64_t s = case_seed ("concurrent");
  struct mem_backing *mb = mem_backing_new (CT_SIZE);
  uint8_t *shadow = calloc (1, CT_SIZE);
  struct ct_thread t[CT_THREADS];
  struct mem_backing_stats st;
  uint64_t writes = 0, reads = 0;
  pthread_t flusher;
  void *fret;
  unsigned i;

  ck_assert_ptr_nonnull (shadow);
  /* Tracking and a flusher run too, so the undo log is raced as well. */
  mem_backing_track_crash (mb, true);
  atomic_store (&ct_stop, false);
  ck_assert_int_eq (pthread_create (&flusher, NULL, ct_flusher, mb), 0);
  for (i = 0; i < CT_THREADS; i++) {
    t[i] = (struct ct_thread) {
      .mb = mb, .id = i, .seed = mix_next (&s), .shadow = shadow,
    };
    ck_assert_int_eq (pthread_create (&t[i].tid, NULL, ct_run, &t[i]), 0);
  }
  for (i = 0; i < CT_THREADS; i++) {
    ck_assert_int_eq (pthread_join (t[i].tid, NULL), 0);
    if (t[i].errors)
      ck_abort_msg ("%s", t[i].msg);
    writes += t[i].writes;
    reads += t[i].reads;
  }
  atomic_store (&ct_stop, true);
  ck_assert_int_eq (pthread_join (flusher, &fret), 0);
  ck_assert_ptr_null (fret);

  assert_store_eq (mb, shadow, CT_SIZE, 0);
  mem_backing_get_stats (mb, &st);
  ck_assert_uint_eq (st.writes, writes);
  ck_assert_uint_eq (st.reads, reads);
  ck_assert_uint_eq (st.faults + st.invalid, 0);
  ck_assert_uint_eq (mem_backing_crash (mb, MEM_BACKING_KEEP_ALL, 0), 0);
  assert_store_eq (mb, shadow, CT_SIZE, 0);
  mem_backing_free (mb);
  free (shadow);
}
END_TEST

/* ------------------------------------------------------------------------ */

/* Every case gets the same explicit timeout: Check's 4 s default (when
 * run outside make) is too short for the thread tests under TSan on a
 * busy machine, and 2 minutes is still far from a hang going unnoticed
 * (a gate wrongly blocking other requests shows up as a hang). */
static TCase *
new_tcase (const char *name)
{
  TCase *tc = tcase_create (name);

  tcase_set_timeout (tc, 120);
  return tc;
}

static Suite *
mem_backing_suite (void)
{
  Suite *s = suite_create ("mem-backing");
  TCase *tc;

  tc = new_tcase ("storage");
  tcase_add_test (tc, test_sparse_zeroes);
  tcase_add_test (tc, test_roundtrip_unaligned);
  tcase_add_test (tc, test_trim_zero);
  tcase_add_test (tc, test_invalid_requests);
  tcase_add_test (tc, test_counters);
  tcase_add_test (tc, test_peek_poke_bypass);
  suite_add_tcase (s, tc);

  tc = new_tcase ("faults");
  tcase_add_test (tc, test_fault_nth_read);
  tcase_add_test (tc, test_fault_nth_write);
  tcase_add_test (tc, test_fault_range);
  tcase_add_test (tc, test_fault_flush);
  tcase_add_test (tc, test_latency);
  suite_add_tcase (s, tc);

  tc = new_tcase ("gates");
  tcase_add_test (tc, test_gate_before_io);
  tcase_add_test (tc, test_gate_after_io);
  tcase_add_test (tc, test_gate_write_points);
  tcase_add_test (tc, test_gate_timeout);
  tcase_add_test (tc, test_gate_one_shot_order);
  tcase_add_test (tc, test_gate_with_fault);
  tcase_add_test (tc, test_gate_flush);
  suite_add_tcase (s, tc);

  tc = new_tcase ("crash");
  tcase_add_test (tc, test_crash_lose_all);
  tcase_add_test (tc, test_crash_fua);
  tcase_add_test (tc, test_crash_keep_all);
  tcase_add_test (tc, test_crash_random_deterministic);
  tcase_add_test (tc, test_crash_model);
  suite_add_tcase (s, tc);

  tc = new_tcase ("concurrency");
  tcase_add_test (tc, test_concurrent);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  seed_base = test_seed ("test-mem-backing");
  return test_main (mem_backing_suite ());
}
