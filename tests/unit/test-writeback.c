/* Unit tests for writeback mode (core/request.c, core/writeback.c) over
 * the in-memory backing store: writes acknowledged from the cache and
 * written back later; partial writes over dirty data (read-modify-write,
 * in writeback and after a switch to writethrough); trim and zero of
 * dirty ranges, also when the backing store fails them; a flush that
 * makes acknowledged writes survive a crash; the writeback's own order
 * (keys on the journal before their data reaches the backing store);
 * the cutoffs; and bcache's rate controller against its published
 * behaviour.
 *
 * Negative controls: the tests that guard an ordering say in their
 * comment which code, disabled, makes them fail (checked by hand).
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <check.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/request.h"
#include "bypass.h"
#include "engine.h"
#include "io.h"
#include "mem-backing.h"
#include "testlib.h"
#include "writeback.h"

#define BLOCK 4096u
#define MiB (1024u * 1024u)

static char tmpdir[256];
static unsigned seed;

static void
log_cb (void *opaque, enum bcf_log_level level, const char *msg)
{
  if (level >= BCF_LOG_ERROR || getenv ("TEST_VERBOSE"))
    fprintf (stderr, "engine: %s\n", msg);
}

struct fx {
  char path[320];
  struct mem_backing *mb;
  struct bcf_backing b;
  struct bcf_cache_opts opts;
  struct bcf_cache *c;
  struct bcf_req *r;
  struct bcf_req_opts ro;
};

static void
fx_open (struct fx *f)
{
  char err[512] = "";
  int r = bcf_cache_open (&f->opts, &f->c, err, sizeof err);

  ck_assert_msg (r == 0, "bcf_cache_open: %s (%s)", err, strerror (-r));
  f->r = bcf_req_new (f->c, &f->ro);
  ck_assert_ptr_nonnull (f->r);
}

static void
fx_init (struct fx *f, const char *name, uint64_t backing_bytes,
         enum bcf_cache_mode mode)
{
  memset (f, 0, sizeof *f);
  snprintf (f->path, sizeof f->path, "%s/%s", tmpdir, name);
  unlink (f->path);
  f->mb = mem_backing_new (backing_bytes);
  f->b = mem_backing_get (f->mb);
  f->opts.path = f->path;
  f->opts.create_size = 64 * MiB;
  f->opts.format = BCF_FORMAT_AUTO;
  f->opts.bucket_sectors = 256;         /* 128 KiB */
  f->opts.block_sectors = BLOCK / 512;
  f->opts.backing = f->b;
  memcpy (f->opts.backing_uuid, "writeback-test01", 16);
  f->opts.log = log_cb;
  f->ro.mode = mode;
  f->ro.sequential_cutoff = 4 * MiB;
  fx_open (f);
}

static void
fx_close (struct fx *f)
{
  bcf_req_free (f->r);
  f->r = NULL;
  ck_assert_int_eq (bcf_cache_close (f->c), 0);
  f->c = NULL;
}

static void
fx_free (struct fx *f)
{
  if (f->c)
    fx_close (f);
  mem_backing_free (f->mb);
  unlink (f->path);
}

/* Cut the power of the cache device: unflushed writes lost. */
static void
fx_crash (struct fx *f)
{
  bcf_req_free (f->r);
  f->r = NULL;
  bcf_cache_test_crash (f->c, seed, BCF_IO_CRASH_LOSE_ALL);
  f->c = NULL;
  fx_open (f);
}

static void
check_read (struct fx *f, uint64_t off, const uint8_t *want, size_t len,
            const char *what)
{
  uint8_t *got = malloc (len);

  ck_assert_ptr_nonnull (got);
  ck_assert_int_eq (bcf_req_read (f->r, &f->b, got, (uint32_t) len, off), 0);
  /* memcmp first: each passing ck_assert is a write to Check's log, and
   * a byte-wise one over 12 MiB made millions (minutes of make check). */
  if (memcmp (got, want, len) != 0)
    for (size_t i = 0; i < len; i++)
      ck_assert_msg (got[i] == want[i], "%s: byte %zu of [%" PRIu64 ", +%zu) "
                     "reads 0x%02x, expected 0x%02x", what, i, off, len,
                     got[i], want[i]);
  free (got);
}

static void
check_backing (struct fx *f, uint64_t off, const uint8_t *want, size_t len,
               const char *what)
{
  uint8_t *got = malloc (len);

  ck_assert_ptr_nonnull (got);
  mem_backing_peek (f->mb, got, len, off);
  ck_assert_msg (memcmp (got, want, len) == 0, "%s: the backing store "
                 "differs in [%" PRIu64 ", +%zu)", what, off, len);
  free (got);
}

/* A write in writeback mode is acknowledged from the cache: the backing
 * store does not see it until the writeback, which then makes both
 * agree. */
START_TEST (write_acknowledged_from_cache)
{
  struct fx f;
  static uint8_t old[65536], new[65536];
  struct bcf_req_stats rs;
  struct mem_backing_stats ms;
  const uint64_t off = 3 * MiB;

  fx_init (&f, "ack.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x11, sizeof old);
  memset (new, 0x22, sizeof new);
  mem_backing_poke (f.mb, old, sizeof old, off);
  mem_backing_reset_stats (f.mb);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false), 0);
  mem_backing_get_stats (f.mb, &ms);
  ck_assert_uint_eq (ms.writes, 0);
  check_backing (&f, off, old, sizeof old, "before writeback");
  check_read (&f, off, new, sizeof new, "dirty data");
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, sizeof new);
  ck_assert_uint_eq (rs.writeback_writes, 1);
  ck_assert_int_eq (bcf_req_has_dirty (f.r, 512, off + 4096), 1);
  ck_assert_int_eq (bcf_req_has_dirty (f.r, 512, off + sizeof new), 0);

  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, new, sizeof new, "after writeback");
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  check_read (&f, off, new, sizeof new, "clean after writeback");
  fx_free (&f);
}
END_TEST

/* Unaligned writes over dirty data keep the dirty bytes around them:
 * in writeback mode, and in writethrough after a switch from writeback
 * (dirty data still there).  Negative control: with the read-modify-
 * write disabled (widen_write skipped for dirty spans) the writethrough
 * case loses the dirty bytes of the partial blocks: they read as the
 * export's old data. */
static void
partial_over_dirty (enum bcf_cache_mode second)
{
  struct fx f;
  static uint8_t old[16384], want[16384], patch[700];
  const uint64_t off = 5 * MiB;

  fx_init (&f, "rmw.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x33, sizeof old);
  mem_backing_poke (f.mb, old, sizeof old, off);
  memset (want, 0x44, sizeof want);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, want, sizeof want, off, false),
                    0);
  ck_assert_int_eq (bcf_req_set_mode (f.r, second), 0);
  memset (patch, 0x55, sizeof patch);
  /* Straddles the block at off + 4096 and the next one. */
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, patch, sizeof patch,
                                   off + 4096 + 3800, false), 0);
  memcpy (want + 4096 + 3800, patch, sizeof patch);
  check_read (&f, off, want, sizeof want, "after the partial write");
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, want, sizeof want, "after writeback");
  check_read (&f, off, want, sizeof want, "after writeback");
  fx_close (&f);
  fx_open (&f);
  check_read (&f, off, want, sizeof want, "after a restart");
  fx_free (&f);
}

START_TEST (partial_write_over_dirty_writeback)
{
  partial_over_dirty (BCF_MODE_WRITEBACK);
}
END_TEST

START_TEST (partial_write_over_dirty_writethrough)
{
  partial_over_dirty (BCF_MODE_WRITETHROUGH);
}
END_TEST

START_TEST (partial_write_over_dirty_writearound)
{
  partial_over_dirty (BCF_MODE_WRITEAROUND);
}
END_TEST

/* Trim and zero of dirty ranges reach the backing store and remove the
 * dirty keys; when the backing store fails them, the range still reads
 * as the last acknowledged write (its dirty data was written back
 * first), never the export's older data. */
START_TEST (trim_and_zero_of_dirty_data)
{
  struct fx f;
  static uint8_t old[32768], new[32768], zero[32768];
  struct bcf_req_stats rs;
  const uint64_t off = 7 * MiB;
  int fail;

  fx_init (&f, "trim.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x66, sizeof old);
  memset (new, 0x77, sizeof new);
  mem_backing_poke (f.mb, old, sizeof old, off);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false), 0);

  /* A zero that fails at the backing store. */
  fail = mem_backing_fail_range (f.mb, MEM_BACKING_ZERO, off, sizeof new, EIO);
  ck_assert_int_lt (bcf_req_zero (f.r, &f.b, 8192, off + 4096, false, false),
                    0);
  mem_backing_fail_range_clear (f.mb, fail);
  check_read (&f, off, new, sizeof new, "after a failed zero");
  check_backing (&f, off + 4096, new, 8192,
                 "after a failed zero (its range written back first)");

  /* A zero that works, unaligned: the rest stays. */
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false), 0);
  ck_assert_int_eq (bcf_req_zero (f.r, &f.b, 5000, off + 1000, false, false),
                    0);
  memcpy (zero, new, sizeof zero);
  memset (zero + 1000, 0, 5000);
  check_read (&f, off, zero, sizeof zero, "after a zero");
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, zero, sizeof zero, "after zero and writeback");

  /* A trim of everything dirty. */
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false), 0);
  ck_assert_int_eq (bcf_req_trim (f.r, &f.b, sizeof new, off, false), 0);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  ck_assert_int_eq (bcf_req_has_dirty (f.r, sizeof new, off), 0);
  fx_free (&f);
}
END_TEST

/* What a flush acknowledged survives a power cut of the cache device,
 * and is written back after the restart; what came after the flush reads
 * either as it was written or as before, consistently. */
START_TEST (flushed_writes_survive_a_crash)
{
  struct fx f;
  static uint8_t old[65536], a[65536], b[65536], got[65536];
  const uint64_t off = 9 * MiB, off2 = 20 * MiB;

  fx_init (&f, "crash.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x01, sizeof old);
  memset (a, 0xa1, sizeof a);
  memset (b, 0xb2, sizeof b);
  mem_backing_poke (f.mb, old, sizeof old, off);
  mem_backing_poke (f.mb, old, sizeof old, off2);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, sizeof a, off, false), 0);
  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, b, sizeof b, off2, false), 0);
  fx_crash (&f);
  check_read (&f, off, a, sizeof a, "a flushed write after a crash");
  check_backing (&f, off, old, sizeof old, "not written back yet");
  ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, off2), 0);
  ck_assert_msg (memcmp (got, b, sizeof got) == 0 ||
                 memcmp (got, old, sizeof got) == 0,
                 "an unflushed write reads as neither its data nor the old");
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, a, sizeof a, "after the writeback");
  check_backing (&f, off2, got, sizeof got, "the unflushed write agrees");
  fx_free (&f);
}
END_TEST

/* A writeback-mode write over clean data a crash could bring back takes
 * no write-intent mark: nothing writes the backing store before its
 * keys are durable (the writeback makes them so first), so a mark would
 * only put a journal write in the write's path and, after a crash, drop
 * the region's clean data.  Before bcf_write_begin_back the write marked
 * its region (intent_marked 1).  A flushed write still survives a crash
 * over the older clean key, which does not come back. */
START_TEST (writeback_write_takes_no_mark)
{
  struct fx f;
  static uint8_t old[65536], new[65536];
  struct bcf_cache_stats st;
  const uint64_t off = 11 * MiB;

  fx_init (&f, "nomark.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x61, sizeof old);
  memset (new, 0x62, sizeof new);
  mem_backing_poke (f.mb, old, sizeof old, off);
  /* A clean key the journal holds: a crash would bring it back. */
  ck_assert_int_eq (bcf_insert (f.c, off, sizeof old, old, false, true), 0);
  ck_assert_uint_eq (intent_marked (f.c), 0);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false),
                    0);
  bcf_cache_stats (f.c, &st);
  ck_assert_msg (intent_marked (f.c) == 0 && st.intent_marks == 0,
                 "a writeback-mode write marked %u write-intent regions",
                 intent_marked (f.c));
  check_read (&f, off, new, sizeof new, "the write");
  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);
  fx_crash (&f);
  check_read (&f, off, new, sizeof new, "a flushed write after a crash");
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, new, sizeof new, "after the writeback");
  fx_free (&f);
}
END_TEST

/* The writeback puts the keys on the journal before their data reaches
 * the backing store.  Without that (bcf_flush skipped in write_batch), a
 * crash after the writeback loses the dirty key from the journal while
 * the backing store has its data, and the older clean key underneath
 * comes back: the cache then serves data older than the export.  (With
 * write-intent regions the crash also drops that key: the test turns
 * them off to see the journal's order alone.) */
START_TEST (writeback_journals_before_backing_write)
{
  struct fx f;
  static uint8_t old[16384], new[16384];
  const uint64_t off = 11 * MiB;

  fx_init (&f, "order.img", 64 * MiB, BCF_MODE_WRITEBACK);
  /* Write-intent regions would also drop the old key after the crash:
   * without them the journal's order alone must do it. */
  fx_close (&f);
  f.opts.write_intent_off = true;
  fx_open (&f);
  memset (old, 0x0f, sizeof old);
  memset (new, 0xf0, sizeof new);
  mem_backing_poke (f.mb, old, sizeof old, off);
  check_read (&f, off, old, sizeof old, "the old data");
  bcf_req_drain (f.r);
  ck_assert_int_eq (bcf_cache_checkpoint (f.c), 0);      /* clean key: durable */
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false), 0);
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, new, sizeof new, "written back");
  fx_crash (&f);
  check_read (&f, off, new, sizeof new, "after a crash that followed the "
              "writeback (the cache must not serve data older than the "
              "export)");
  fx_free (&f);
}
END_TEST

struct wb_call {
  struct fx *f;
  int rc;
};

static void *
writeback_call (void *arg)
{
  struct wb_call *w = arg;

  w->rc = bcf_req_writeback (w->f->r, &w->f->b);
  return NULL;
}

/* The runs of a batch are written back with more than one backing write
 * in flight (writeback.c's writers), and still nothing is marked clean
 * before the batch's backing flush: run A parked in its backing write,
 * run B's write must reach the backing store meanwhile, and both stay
 * dirty and unflushed until A finishes. */
START_TEST (writeback_writes_in_parallel)
{
  struct fx f;
  static uint8_t a[16384], b[16384], got[16384];
  const uint64_t off_a = 3 * MiB, off_b = 40 * MiB;
  struct mem_backing_stats ms0, ms;
  struct mem_backing_gate *g;
  struct bcf_req_stats rs;
  struct wb_call w;
  pthread_t t;
  bool b_arrived = false;

  fx_init (&f, "parallel.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (a, 0xa1, sizeof a);
  memset (b, 0xb2, sizeof b);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, sizeof a, off_a, false), 0);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, b, sizeof b, off_b, false), 0);
  mem_backing_get_stats (f.mb, &ms0);
  g = mem_backing_gate_arm (f.mb, MEM_BACKING_WRITE, MEM_BACKING_BEFORE_IO,
                            off_a, sizeof a);
  w = (struct wb_call) { .f = &f };
  ck_assert_int_eq (pthread_create (&t, NULL, writeback_call, &w), 0);
  ck_assert_msg (mem_backing_gate_wait_hit (g, 10000),
                 "run A's backing write never came");
  for (unsigned i = 0; i < 1000 && !b_arrived; i++) {
    mem_backing_peek (f.mb, got, sizeof got, off_b);
    b_arrived = memcmp (got, b, sizeof b) == 0;
    if (!b_arrived)
      usleep (10000);
  }
  mem_backing_get_stats (f.mb, &ms);
  bcf_req_get_stats (f.r, &rs);
  mem_backing_gate_release (g);
  pthread_join (t, NULL);
  ck_assert_msg (b_arrived, "run B's backing write waited for run A's: one "
                 "backing write in flight at a time");
  ck_assert_msg (ms.flushes == ms0.flushes, "the backing store was flushed "
                 "before every write of the batch was done");
  ck_assert_msg (rs.dirty_bytes == sizeof a + sizeof b, "%" PRIu64 " bytes "
                 "dirty while a write of the batch was in flight: marked "
                 "clean before the batch's flush", rs.dirty_bytes);
  ck_assert_int_eq (w.rc, 0);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  check_backing (&f, off_a, a, sizeof a, "run A written back");
  check_backing (&f, off_b, b, sizeof b, "run B written back");
  fx_free (&f);
}
END_TEST

/* A backing store that fails keeps the data dirty, readable, and
 * written back once it works again; a flush of dirty data waits for it. */
START_TEST (writeback_thread_and_flush)
{
  struct fx f;
  static uint8_t new[65536];
  struct bcf_req_stats rs;
  const uint64_t off = 13 * MiB;
  int fail;

  fx_init (&f, "thread.img", 64 * MiB, BCF_MODE_WRITEBACK);
  bcf_req_free (f.r);
  f.ro.background = &f.b;
  f.ro.writeback_percent = BCF_WRITEBACK_PERCENT_ZERO;
  f.r = bcf_req_new (f.c, &f.ro);
  ck_assert_ptr_nonnull (f.r);
  ck_assert_int_eq (bcf_req_set_writeback_running (f.r, false), 0);
  memset (new, 0x5a, sizeof new);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, new, sizeof new, off, false), 0);
  fail = mem_backing_fail_range (f.mb, MEM_BACKING_WRITE, off, sizeof new,
                                 EIO);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 0, NULL, NULL), -EIO);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, sizeof new);
  ck_assert_uint_ge (rs.writeback_backing_errors, 1);
  check_read (&f, off, new, sizeof new, "dirty data the export refused");
  mem_backing_fail_range_clear (f.mb, fail);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  check_backing (&f, off, new, sizeof new, "after the flush");
  f.ro.background = NULL;
  fx_free (&f);
}
END_TEST

/* bcache's rate controller: P retires the excess in about 40 s, the
 * rate never drops below 8 sectors/s, I winds up only while the device
 * keeps up, and six idle rounds give full speed. */
START_TEST (rate_controller)
{
  struct bcf_wb_pi pi;
  struct bcf_wb_pi_input in = {
    .dirty = 1000000, .target = 600000, .in_use = 20,
    .update_seconds = 5, .now_ns = 1000000000ull,
  };

  bcf_wb_pi_init (&pi, in.now_ns);
  ck_assert_int_eq (pi.rate, BCF_WB_RATE_INITIAL);
  bcf_wb_pi_update (&pi, &in);
  ck_assert_int_eq (pi.proportional, 400000 / 40);
  ck_assert_int_eq (pi.integral, 400000 * 5);       /* keeping up */
  ck_assert_int_eq (pi.rate, 10000 + 2000000 / 10000);
  ck_assert_int_eq (pi.target, 600000);

  /* Behind (next far in the past): no wind-up. */
  pi.next_ns = 0;
  in.now_ns += 5000000000ull;
  bcf_wb_pi_update (&pi, &in);
  ck_assert_int_eq (pi.integral, 400000 * 5);

  /* Below target: the integral shrinks while positive; the rate is the
   * minimum. */
  in.dirty = 100;
  bcf_wb_pi_update (&pi, &in);
  ck_assert_int_lt (pi.integral, 400000 * 5);
  for (int i = 0; i < 10; i++)
    bcf_wb_pi_update (&pi, &in);
  ck_assert_int_eq (pi.rate, BCF_WB_RATE_MINIMUM);

  /* Idle for six rounds with dirty data: full speed; I/O: back. */
  in.idle = true;
  for (int i = 0; i < BCF_WB_IDLE_ROUNDS - 1; i++) {
    bcf_wb_pi_update (&pi, &in);
    ck_assert (!pi.at_max);
  }
  bcf_wb_pi_update (&pi, &in);
  ck_assert (pi.at_max);
  ck_assert_int_eq (pi.rate, BCF_WB_RATE_MAX);
  in.idle = false;
  bcf_wb_pi_update (&pi, &in);
  ck_assert (!pi.at_max);
  ck_assert_int_eq (pi.rate, BCF_WB_RATE_MINIMUM);

  /* The limiter: 1000 sectors at 1000 sectors/s is one second; never
   * more than 2.5 s ahead. */
  pi.rate = 1000;
  pi.next_ns = in.now_ns;
  ck_assert_uint_eq (bcf_wb_pi_next_delay (&pi, 1000, in.now_ns),
                     1000000000ull);
  ck_assert_uint_eq (bcf_wb_pi_next_delay (&pi, 100000, in.now_ns),
                     2500000000ull);

  /* The fragmentation boost: 60 % of buckets in use, each dirty bucket
   * an eighth full: P becomes (dirty / dirty_buckets) · 1 · (60 - 57) ·
   * ... per bcache's thresholds. */
  in = (struct bcf_wb_pi_input) { .dirty = 10000, .target = 9000,
                                  .in_use = 60, .dirty_buckets = 80,
                                  .bucket_sectors = 1024,
                                  .update_seconds = 5,
                                  .now_ns = in.now_ns };
  bcf_wb_pi_init (&pi, in.now_ns);
  bcf_wb_pi_update (&pi, &in);
  ck_assert_int_eq (pi.proportional,
                    10000 / 80 * BCF_WB_FP_TERM_MID * (60 - 57));
}
END_TEST

/* f's request again, with a writeback thread that is paused, whose rate
 * stays at its minimum and which measures the cache every second, and no
 * sequential bypass: the cutoffs alone decide where writes go. */
static void
fx_paused_writeback (struct fx *f, enum bcf_sync_writes sync_writes)
{
  bcf_req_free (f->r);
  f->ro.background = &f->b;
  f->ro.sync_writes = sync_writes;
  f->ro.writeback_percent = 100;
  f->ro.sequential_cutoff = 0;
  f->r = bcf_req_new (f->c, &f->ro);
  ck_assert_ptr_nonnull (f->r);
  ck_assert_int_eq (bcf_req_set_writeback_update_seconds (f->r, 1), 0);
  ck_assert_int_eq (bcf_req_set_writeback_running (f->r, false), 0);
}

/* Between cutoff_writeback (40 %) and cutoff_writeback_sync (70 %) of
 * the cache in use: with bcache-sync-writes=fua (bcache's rule for
 * writes that are not REQ_SYNC), writes that are neither FUA nor over
 * dirty data are written through, so that a cache filling with dirty
 * data slows writes to the export's speed instead of running out of
 * room; with all (the default), every write counts as REQ_SYNC and is
 * still written back.  Negative control for the second: with
 * should_write_back ignoring r->all_sync, the 64 KiB write at 40 MiB
 * reaches the backing store (ms.writes == 1). */
static void
cutoff_case (enum bcf_sync_writes sync_writes)
{
  struct fx f;
  static uint8_t buf[1 << 20];
  struct bcf_req_stats rs;
  struct mem_backing_stats ms;
  uint64_t off = 0, cut;

  fx_init (&f, "cutoff.img", 128 * MiB, BCF_MODE_WRITEBACK);
  /* Paused: only the writes below reach the backing store (the rounds
   * still measure the cache). */
  fx_paused_writeback (&f, sync_writes);
  memset (buf, 0x3c, sizeof buf);
  /* About 45 % of the 64 MiB cache dirty, with FUA writes (written back
   * up to the sync cutoff under either rule: the cutoff counts the
   * buckets these take as they go). */
  for (; off < 29 * MiB; off += sizeof buf)
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, sizeof buf, off, true),
                      0);
  for (int i = 0; i < 300; i++) {
    bcf_req_get_stats (f.r, &rs);
    if (rs.cache_in_use > BCF_WB_CUTOFF)
      break;
    usleep (10000);
  }
  ck_assert_uint_gt (rs.cache_in_use, BCF_WB_CUTOFF);
  ck_assert_uint_le (rs.cache_in_use, BCF_WB_CUTOFF_SYNC);
  cut = rs.writeback_cutoff_writes;
  mem_backing_reset_stats (f.mb);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, 65536, 40 * MiB, false), 0);
  mem_backing_get_stats (f.mb, &ms);
  bcf_req_get_stats (f.r, &rs);
  if (sync_writes == BCF_SYNC_WRITES_FUA) {
    ck_assert_uint_eq (ms.writes, 1);
    ck_assert_uint_eq (rs.writeback_cutoff_writes, cut + 1);
  }
  else {
    ck_assert_uint_eq (ms.writes, 0);
    ck_assert_uint_eq (rs.writeback_cutoff_writes, cut);
  }
  /* FUA, and writes over dirty data, are still written back. */
  mem_backing_reset_stats (f.mb);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, 65536, 50 * MiB, true), 0);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, 65536, 0, false), 0);
  mem_backing_get_stats (f.mb, &ms);
  ck_assert_uint_eq (ms.writes, 0);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  f.ro.background = NULL;
  fx_free (&f);
}

START_TEST (cutoff_writes_through)
{
  cutoff_case (BCF_SYNC_WRITES_FUA);
}
END_TEST

START_TEST (cutoff_sync_writes_all)
{
  cutoff_case (BCF_SYNC_WRITES_ALL);
}
END_TEST

/* The sync cutoff holds between two of the controller's counts of the
 * buckets in use (every writeback_rate_update_seconds, 60 here), where
 * buckets fill faster than dirty bytes: the setup leaves a quarter of
 * the cache's bytes dirty spread over nearly half its buckets (16 MiB,
 * then 7 of every 8 blocks written again, so that each old bucket keeps
 * an eighth of its data dirty and no GC can reclaim it), and the
 * controller counts that.  Then 4 KiB writes to new ranges: their dirty
 * bytes stay under 70 % of the cache while the buckets they open take it
 * past 70 %.  Those writes must be cut off (written through), and the
 * buckets dirty or metadata stay within a point of 70 %.  Negative
 * control: with bcf_writeback_in_use returning only the last count, the
 * writes go on until the dirty bytes pass 70 %, with 95 % of the
 * buckets dirty or metadata.  Moving GC is off: its copies are no write
 * and take fresh buckets too, counted until the GC pass after them frees
 * more than they took (writeback.c bounds a run to 2 points under 70 %,
 * at least 1/128 of the cache; with a sixteenth of it, 73 % here;
 * moving_gc_* tests below). */
START_TEST (cutoff_follows_dirty_buckets)
{
  struct fx f;
  static uint8_t buf[1 << 20];
  struct bcf_req_stats rs;
  struct bcf_cache_stats cs;
  const uint64_t first = 16 * MiB;
  unsigned worst = 0;
  uint64_t cut;

  fx_init (&f, "buckets.img", 128 * MiB, BCF_MODE_WRITEBACK);
  fx_paused_writeback (&f, BCF_SYNC_WRITES_ALL);
  ck_assert_int_eq (bcf_req_set_copy_gc (f.r, false), 0);
  memset (buf, 0x5a, sizeof buf);
  for (uint64_t off = 0; off < first; off += sizeof buf)
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, sizeof buf, off, false),
                      0);
  for (unsigned pass = 1; pass < 8; pass++)
    for (uint64_t off = pass * BLOCK; off < first; off += 8 * BLOCK)
      ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, BLOCK, off, false), 0);
  /* A count now, then none for a minute. */
  ck_assert_int_eq (bcf_req_set_writeback_update_seconds (f.r, 1), 0);
  usleep (1500000);
  ck_assert_int_eq (bcf_req_set_writeback_update_seconds (f.r, 60), 0);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_lt (rs.cache_in_use, BCF_WB_CUTOFF_SYNC);
  cut = rs.writeback_cutoff_writes;

  for (uint64_t off = 32 * MiB; off < 64 * MiB; off += BLOCK) {
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, BLOCK, off, false), 0);
    bcf_cache_stats (f.c, &cs);
    unsigned u = (unsigned) ((cs.buckets_dirty + cs.buckets_meta) * 100
                             / cs.nbuckets);
    if (u > worst)
      worst = u;
  }
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_gt (rs.writeback_cutoff_writes, cut);
  ck_assert_msg (worst <= BCF_WB_CUTOFF_SYNC + 1,
                 "%u %% of the buckets dirty or metadata", worst);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  f.ro.background = NULL;
  fx_free (&f);
}
END_TEST

/* A read of dirty data whose bucket is reused while the read is in
 * flight (bcache's cache_read_races) must not fall back to the backing
 * store, as a clean hit does: the backing store never had that data,
 * and serves what was there before it, a write the client may have
 * flushed since (time travel).  Forced with the engine's read hook,
 * between the device read of block 0's dirty data A and the check of
 * its pointer: block 0 is written again (B), every other block of A's
 * bucket too, so that nothing is left in it, and clean inserts of other
 * blocks (FIFO replacement) run until A's device offset holds someone
 * else's data, as test-engine's read_race_stale does.  The read must
 * return B (the range as it is now); A would do too, the export's zeros
 * never.  Negative control: with the race falling back to the backing
 * store, the read returns zeros ("reads 0x00"). */
struct dirty_race {
  struct fx *f;
  uint8_t b[BLOCK];
  uint64_t dev_offset;
  unsigned calls, inserts;
};

static void
dirty_race_hook (struct bcf_cache *c, const struct bcf_extent *e,
                 void *opaque)
{
  struct dirty_race *d = opaque;
  static uint8_t other[BLOCK];
  uint64_t next = 0;

  c->test_read_hook = NULL;
  d->calls++;
  d->dev_offset = e->dev_offset;
  ck_assert (e->dirty);
  /* Block 0 and the rest of its bucket written again, elsewhere. */
  for (uint64_t blk = 0; blk < 64; blk++) {
    memset (other, (int) (0x40 + blk), sizeof other);
    ck_assert_int_eq (bcf_req_write (d->f->r, &d->f->b, blk ? other : d->b,
                                     BLOCK, blk * BLOCK, false), 0);
  }
  /* Clean data until A's offset is reused. */
  test_reuse_dev_offset (c, d->dev_offset, 1024, 8192, &next, BLOCK, other,
                         200000);
  d->inserts = (unsigned) next;
}

START_TEST (dirty_read_race_not_from_backing)
{
  struct fx f;
  static struct dirty_race d;
  static uint8_t a[BLOCK], filler[BLOCK];

  rng_state = seed * 31 + 7;            /* the reused bucket's new data */
  fx_init (&f, "dirtyrace.img", 64 * MiB, BCF_MODE_WRITEBACK);
  fx_close (&f);                        /* again, with FIFO replacement */
  unlink (f.path);
  f.opts.create_size = 16 * MiB;
  f.opts.bucket_sectors = 64;          /* 32 KiB: 512 buckets */
  f.opts.replacement = BCH_REPLACEMENT_FIFO;
  fx_open (&f);
  /* GC, as nbdkit runs it: only a GC marks A's bucket free again. */
  ck_assert_int_eq (bcf_cache_start_threads (f.c), 0);
  bcf_req_set_sequential_cutoff (f.r, 0);
  memset (a, 0xa1, sizeof a);
  memset (d.b, 0xb2, sizeof d.b);
  memset (filler, 0x33, sizeof filler);
  d.f = &f;
  /* A in block 0, dirty, and the rest of its bucket dirty too. */
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, BLOCK, 0, false), 0);
  for (uint64_t blk = 1; blk < 64; blk++)
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, filler, BLOCK, blk * BLOCK,
                                     false), 0);
  f.c->test_read_hook = dirty_race_hook;
  f.c->test_read_hook_opaque = &d;
  {
    uint8_t got[BLOCK];
    struct bcf_cache_stats cs;

    ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, BLOCK, 0), 0);
    f.c->test_read_hook = NULL;
    ck_assert_uint_eq (d.calls, 1);
    bcf_cache_stats (f.c, &cs);
    ck_assert_uint_ge (cs.read_races, 1);       /* the race happened */
    ck_assert_msg (memcmp (got, d.b, BLOCK) == 0 || memcmp (got, a, BLOCK) == 0,
                   "a dirty read that raced with its bucket's reuse "
                   "reads 0x%02x, expected 0x%02x (or 0x%02x); %u inserts",
                   got[0], d.b[0], a[0], d.inserts);
  }
  check_read (&f, 0, d.b, BLOCK, "block 0 after the race");
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  check_backing (&f, 0, d.b, BLOCK, "block 0 written back");
  fx_free (&f);
}
END_TEST

/* The cutoffs lift once the dirty data is written back, with no write
 * to start a GC.  The buckets in use are GC's marks: a bucket that held
 * dirty data stays marked dirty until a GC looks at it again, and GC
 * runs when the allocator has handed out a sixteenth of the cache or
 * runs short of buckets.  After a write flood past the cutoffs, writes
 * are cut off (written through: the cutoffs were the reason) and
 * sequential ones bypass, so little or nothing is allocated: the cache
 * went on counting itself 70 % dirty after every dirty byte was written
 * back, and writes went to the export at its speed until enough of them
 * had been cached (bcache's "permanent bypass once the cache is full",
 * research/bcache.md §4.4; seen here after filter-bench's rmw: 77 % of
 * the buckets counted dirty with nothing dirty, for the 15 s it was
 * watched).  So the writeback asks for a GC when it has cleaned a
 * sixteenth of the cache, or all of it, while the buckets in use are
 * past cutoff_writeback.  Negative control: without that request the
 * count stays at 46 %. */
START_TEST (cutoff_lifts_once_written_back)
{
  struct fx f;
  static uint8_t buf[1 << 20];
  struct bcf_req_stats rs;
  struct mem_backing_stats ms;
  uint64_t cut;
  int i;

  fx_init (&f, "lifts.img", 128 * MiB, BCF_MODE_WRITEBACK);
  ck_assert_int_eq (bcf_cache_start_threads (f.c), 0);  /* GC: as nbdkit */
  fx_paused_writeback (&f, BCF_SYNC_WRITES_FUA);  /* others cut off at 40 % */
  memset (buf, 0x6b, sizeof buf);
  for (uint64_t off = 0; off < 29 * MiB; off += sizeof buf)
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, sizeof buf, off, true),
                      0);
  for (i = 0; i < 300; i++) {
    bcf_req_get_stats (f.r, &rs);
    if (rs.cache_in_use > BCF_WB_CUTOFF)
      break;
    usleep (10000);
  }
  ck_assert_uint_gt (rs.cache_in_use, BCF_WB_CUTOFF);

  /* Everything written back: nothing dirty, nothing written since. */
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, 0);
  for (i = 0; i < 1000; i++) {          /* rounds every second: 10 s */
    bcf_req_get_stats (f.r, &rs);
    if (rs.cache_in_use <= BCF_WB_CUTOFF)
      break;
    usleep (10000);
  }
  ck_assert_msg (rs.cache_in_use <= BCF_WB_CUTOFF, "%u %% of the buckets "
                 "still counted in use with nothing dirty", rs.cache_in_use);

  /* And a write that is not FUA is written back again. */
  cut = rs.writeback_cutoff_writes;
  mem_backing_reset_stats (f.mb);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, 65536, 40 * MiB, false), 0);
  mem_backing_get_stats (f.mb, &ms);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (ms.writes, 0);
  ck_assert_uint_eq (rs.writeback_cutoff_writes, cut);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  f.ro.background = NULL;
  fx_free (&f);
}
END_TEST

/* bcache's cutoffs hold from the first write on, not only once the rate
 * controller has measured the cache (every writeback_rate_update_seconds,
 * and never without a writeback thread): a proxy restarted under a write
 * flood filled its whole cache with dirty data within a round of the
 * soak, and after the next crash the open found no free bucket for its
 * prio write ("writing prio buckets failed: No space left on device"):
 * the dirty data could not be reached.  Dirty data stays under
 * cutoff_writeback_sync of the cache, the rest is written through, and a
 * crash then reopens.  Negative control: with should_write_back reading
 * only the controller's figure, dirty_bytes reaches 60 MiB of 64. */
START_TEST (dirty_data_never_fills_the_cache)
{
  struct fx f;
  static uint8_t buf[1 << 20], got[1 << 20];
  struct bcf_req_stats rs;
  struct bcf_cache_stats cs;
  const uint64_t total = 60 * MiB;

  fx_init (&f, "flood.img", 128 * MiB, BCF_MODE_WRITEBACK);
  bcf_req_set_sequential_cutoff (f.r, 0);
  bcf_cache_stats (f.c, &cs);
  for (uint64_t off = 0; off < total; off += sizeof buf) {
    memset (buf, (int) (off / MiB) + 1, sizeof buf);
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, buf, sizeof buf, off, false),
                      0);
  }
  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_msg (rs.dirty_bytes * 100 <= cs.nbuckets * cs.bucket_bytes *
                 BCF_WB_CUTOFF_SYNC + 100 * sizeof buf,
                 "%" PRIu64 " bytes dirty in a cache of %" PRIu64,
                 rs.dirty_bytes, cs.nbuckets * cs.bucket_bytes);
  ck_assert_uint_gt (rs.writeback_cutoff_writes, 0);
  fx_crash (&f);
  for (uint64_t off = 0; off < total; off += sizeof buf) {
    memset (buf, (int) (off / MiB) + 1, sizeof buf);
    ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, off), 0);
    ck_assert_msg (memcmp (got, buf, sizeof got) == 0, "MiB %" PRIu64
                   " after the crash", off / MiB);
  }
  fx_free (&f);
}
END_TEST

/* A cache device that fails while it holds dirty data is not given up
 * (that would lose the data): a read of the dirty range fails with EIO
 * rather than return the export's older data, clean data is served from
 * the export, writes elsewhere pass through, and once the device works
 * again the dirty data is written back. */
START_TEST (failing_device_keeps_dirty_data)
{
  struct fx f;
  static uint8_t old[65536], a[65536], got[65536];
  struct bcf_io_faults faults = { .fail_every = 1 };
  struct bcf_req_stats rs;

  fx_init (&f, "faults.img", 64 * MiB, BCF_MODE_WRITEBACK);
  bcf_req_free (f.r);
  f.ro.error_limit = 4;
  f.r = bcf_req_new (f.c, &f.ro);
  ck_assert_ptr_nonnull (f.r);
  memset (old, 0x12, sizeof old);
  memset (a, 0x34, sizeof a);
  mem_backing_poke (f.mb, old, sizeof old, MiB);
  mem_backing_poke (f.mb, old, sizeof old, 8 * MiB);
  check_read (&f, 8 * MiB, old, sizeof old, "clean data");
  bcf_req_drain (f.r);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, sizeof a, MiB, false), 0);
  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);

  bcf_io_set_faults (bcf_cache_test_io (f.c), &faults);
  for (int i = 0; i < 8; i++) {
    ck_assert_int_eq (bcf_req_read (f.r, &f.b, got, sizeof got, MiB), -EIO);
    check_read (&f, 8 * MiB, old, sizeof old, "clean data, device failing");
  }
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_ge (rs.device_errors, 4);
  ck_assert (!rs.passthrough);
  ck_assert_uint_eq (rs.dirty_bytes, sizeof a);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, sizeof a, 20 * MiB, false),
                    0);
  check_backing (&f, 20 * MiB, a, sizeof a, "a write next to the dirty data");

  bcf_io_set_faults (bcf_cache_test_io (f.c), NULL);
  check_read (&f, MiB, a, sizeof a, "dirty data, device back");
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, MiB, a, sizeof a, "written back after the errors");
  fx_free (&f);
}
END_TEST

/* A write over dirty data that the cache cannot take (the device fails
 * its data writes) must not drop the older dirty data before the backing
 * store has something as new: here the device refuses every write, so
 * the write can neither be cached nor journal an invalidation, and fails;
 * the range must still read as the flushed write A (from the export, to
 * which it was written back first), never the export's older data.
 * Negative control: with write_pieces inserting piece by piece and
 * invalidating the whole range in memory on a failure (the code before
 * this test), A is gone from memory before the write-back looks for it,
 * and the range reads the export's old 0x01. */
START_TEST (write_over_dirty_device_refuses_writes)
{
  struct fx f;
  static uint8_t old[512 * 1024], a[512 * 1024], b[512 * 1024];
  struct bcf_io_faults faults = { .fail_every = 1, .fail_writes_only = true };
  const uint64_t off = 16 * MiB;

  fx_init (&f, "refuse.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x01, sizeof old);
  memset (a, 0xa1, sizeof a);
  memset (b, 0xb2, sizeof b);
  mem_backing_poke (f.mb, old, sizeof old, off);
  /* Four pieces (128 KiB buckets). */
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, sizeof a, off, false), 0);
  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);
  check_backing (&f, off, old, sizeof old, "not written back yet");

  bcf_io_set_faults (bcf_cache_test_io (f.c), &faults);
  ck_assert_int_lt (bcf_req_write (f.r, &f.b, b, sizeof b, off, false), 0);
  check_read (&f, off, a, sizeof a, "after a write over dirty data that "
              "the device refused (must read as the flushed write)");
  check_backing (&f, off, a, sizeof a, "the dirty data written back "
                 "before the range was given up");
  bcf_io_set_faults (bcf_cache_test_io (f.c), NULL);
  fx_free (&f);
}
END_TEST

/* A writethrough write over dirty data (a switch from writeback) whose
 * backing write fails: its dirty keys replaced the only copy of the
 * flushed write A, so they must not be removed (the export still has
 * older data); they stay dirty, the range reads as the failed write, and
 * the writeback brings the export to it.  Negative control: with
 * complete_cache_write undoing the keys as for any failed write (the
 * code before this test), the range reads the export's old 0x01. */
START_TEST (writethrough_over_dirty_backing_fails)
{
  struct fx f;
  static uint8_t old[65536], a[65536], b[65536];
  struct bcf_req_stats rs;
  const uint64_t off = 24 * MiB;

  fx_init (&f, "wtfail.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (old, 0x01, sizeof old);
  memset (a, 0xa1, sizeof a);
  memset (b, 0xb2, sizeof b);
  mem_backing_poke (f.mb, old, sizeof old, off);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, a, sizeof a, off, false), 0);
  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);
  ck_assert_int_eq (bcf_req_set_mode (f.r, BCF_MODE_WRITETHROUGH), 0);

  mem_backing_fail_nth_write (f.mb, 1, EIO);
  ck_assert_int_eq (bcf_req_write (f.r, &f.b, b, sizeof b, off, false), -EIO);
  mem_backing_clear_faults (f.mb);
  check_read (&f, off, b, sizeof b, "after a failed writethrough write "
              "over dirty data");
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.dirty_bytes, sizeof b);
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  check_backing (&f, off, b, sizeof b, "after the writeback");
  fx_close (&f);
  fx_open (&f);
  check_read (&f, off, b, sizeof b, "after a restart");
  fx_free (&f);
}
END_TEST

/* bcache sleeps writeback_delay only after a refill that scanned the
 * whole index into its keybuf of 500 keys (refill_dirty): with more dirty
 * extents than that the writeback wraps and goes on.  600 separate dirty
 * extents, then 100. */
START_TEST (delay_only_after_whole_index)
{
  struct fx f;
  static uint8_t blk[4096];
  struct bcf_writeback *wb;
  struct bcf_bypass *t;

  fx_init (&f, "keybuf.img", 64 * MiB, BCF_MODE_WRITEBACK);
  memset (blk, 0x3c, sizeof blk);
  for (unsigned i = 0; i < 600; i++)       /* every other block: no merge */
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, blk, sizeof blk,
                                     (uint64_t) i * 2 * sizeof blk, false), 0);
  ck_assert_ptr_nonnull (t = bcf_bypass_new (64 * MiB));
  ck_assert_ptr_nonnull (wb = bcf_writeback_new (f.c, t, &f.b, false));
  ck_assert (!bcf_writeback_searched_full_index (wb));
  ck_assert_int_eq (bcf_req_writeback (f.r, &f.b), 0);
  for (unsigned i = 0; i < 100; i++)
    ck_assert_int_eq (bcf_req_write (f.r, &f.b, blk, sizeof blk,
                                     (uint64_t) i * 2 * sizeof blk, false), 0);
  ck_assert (bcf_writeback_searched_full_index (wb));
  bcf_writeback_free (wb);
  bcf_bypass_free (t);
  fx_free (&f);
}
END_TEST

/* ---- moving GC (core/movinggc.c) ------------------------------------------- */

#define MV_BLOCKS 3072u                 /* 12 MiB: 96 buckets of 128 KiB */

/* Block blk's content in generation g. */
static void
mv_fill (uint8_t *b, uint64_t blk, unsigned g)
{
  for (unsigned i = 0; i < BLOCK; i += 8) {
    uint64_t v = blk * 0x9E3779B97F4A7C15ull + g * 0xff51afd7ed558ccdull + i;
    memcpy (b + i, &v, 8);
  }
}

/* Blocks [0, nblocks) (a multiple of 16) written dirty, 64 KiB at a
 * time, then blocks 4k+1..4k+3 written again, 12 KiB at a time, in a
 * seeded random order: the buckets of the first pass keep a quarter of
 * their data live, dirty, in 4 KiB pieces, and count as dirty as the
 * full ones.  want gets what each block must read.  (Few large writes:
 * 4 KiB ones, FUA in one test, took minutes on a disk busy with the
 * rest of make check.) */
static void
mv_fragment (struct fx *f, uint64_t nblocks, uint8_t *want, bool fua)
{
  uint64_t *order = malloc (nblocks / 4 * sizeof *order), n = 0;

  ck_assert_ptr_nonnull (order);
  for (uint64_t blk = 0; blk < nblocks; blk++) {
    mv_fill (want + blk * BLOCK, blk, 1);
    if (blk % 4 == 0)
      order[n++] = blk + 1;
  }
  for (uint64_t blk = 0; blk < nblocks; blk += 16)
    ck_assert_int_eq (bcf_req_write (f->r, &f->b, want + blk * BLOCK,
                                     16 * BLOCK, blk * BLOCK, fua), 0);
  rng_state = seed * 131 + 3;
  for (uint64_t i = n - 1; i > 0; i--) {
    uint64_t j = rnd_below (i + 1), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  for (uint64_t i = 0; i < n; i++) {
    uint64_t blk = order[i];
    for (uint64_t k = 0; k < 3; k++)
      mv_fill (want + (blk + k) * BLOCK, blk + k, 2);
    ck_assert_int_eq (bcf_req_write (f->r, &f->b, want + blk * BLOCK,
                                     3 * BLOCK, blk * BLOCK, fua), 0);
  }
  free (order);
}

/* Moving GC copies the live dirty data of the emptiest dirty buckets into
 * fresh ones: afterwards a GC pass counts far fewer buckets dirty, the
 * same bytes are dirty, every block reads what was last written to it,
 * across a crash once flushed (the moved keys are journalled), and the
 * writeback writes the same data back. */
START_TEST (moving_gc_compacts_dirty_data)
{
  struct fx f;
  static uint8_t want[MV_BLOCKS * BLOCK];
  struct bcf_cache_stats cs0, cs1;
  struct bcf_req_stats rs;
  struct bcf_move_stats ms;

  fx_init (&f, "move.img", 64 * MiB, BCF_MODE_WRITEBACK);
  bcf_req_set_sequential_cutoff (f.r, 0);
  mv_fragment (&f, MV_BLOCKS, want, false);
  bcf_req_get_stats (f.r, &rs);
  ck_assert_uint_eq (rs.writeback_cutoff_writes, 0);
  ck_assert_int_eq (bcf_gc_run (f.c), 0);
  bcf_cache_stats (f.c, &cs0);

  ck_assert_int_eq (bcf_move_dirty (f.c, 64 * MiB, &ms), 0);
  ck_assert_int_eq (bcf_gc_run (f.c), 0);
  bcf_cache_stats (f.c, &cs1);
  printf ("test-writeback: moving GC: %" PRIu64 " buckets chosen, %" PRIu64
          " extents (%" PRIu64 " bytes) moved, %" PRIu64 " collisions; "
          "buckets dirty %" PRIu64 " -> %" PRIu64 "\n", ms.buckets, ms.keys,
          ms.bytes, ms.collisions, cs0.buckets_dirty, cs1.buckets_dirty);
  /* A quarter of the first 96 buckets was live: 3 MiB into 24. */
  ck_assert_uint_eq (ms.bytes, MV_BLOCKS / 4 * BLOCK);
  ck_assert_uint_eq (ms.collisions, 0);
  ck_assert_uint_eq (cs1.moving_gc_bytes, ms.bytes);
  ck_assert_uint_le (cs1.buckets_dirty + 60, cs0.buckets_dirty);
  ck_assert_uint_eq (bcf_cache_dirty_bytes (f.c), MV_BLOCKS * BLOCK);
  check_read (&f, 0, want, sizeof want, "after the move");

  ck_assert_int_eq (bcf_req_flush (f.r, &f.b), 0);
  fx_crash (&f);
  check_read (&f, 0, want, sizeof want, "after the move and a crash");
  ck_assert_uint_eq (bcf_cache_dirty_bytes (f.c), MV_BLOCKS * BLOCK);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  check_backing (&f, 0, want, sizeof want, "written back after the move");
  fx_free (&f);
}
END_TEST

struct mv_race {
  struct fx *f;
  uint8_t newer[BLOCK];
  unsigned calls;
};

/* During the first batch of the move, between its copy and its inserts:
 * block 0 is written again, block 4 trimmed. */
static void
mv_race_hook (struct bcf_cache *c, void *opaque)
{
  struct mv_race *m = opaque;

  c->test_move_hook = NULL;
  m->calls++;
  memset (m->newer, 0xc3, sizeof m->newer);
  ck_assert_int_eq (bcf_req_write (m->f->r, &m->f->b, m->newer, BLOCK, 0,
                                   false), 0);
  ck_assert_int_eq (bcf_req_trim (m->f->r, &m->f->b, BLOCK, 4 * BLOCK, false),
                    0);
}

/* A write or a trim that lands while moving GC copies the range wins:
 * the move's insert is a compare-and-swap against the old key.
 * Negative control: with insert_key's expect NULL in extent_move_dirty,
 * block 0 reads its older data again. */
START_TEST (moving_gc_yields_to_a_racing_write)
{
  struct fx f;
  static uint8_t want[256 * BLOCK];
  static struct mv_race m;
  struct bcf_move_stats ms;

  fx_init (&f, "moverace.img", 64 * MiB, BCF_MODE_WRITEBACK);
  bcf_req_set_sequential_cutoff (f.r, 0);
  mv_fragment (&f, 256, want, false);
  ck_assert_int_eq (bcf_gc_run (f.c), 0);
  m.f = &f;
  f.c->test_move_hook = mv_race_hook;
  f.c->test_move_hook_opaque = &m;
  ck_assert_int_eq (bcf_move_dirty (f.c, 64 * MiB, &ms), 0);
  ck_assert_uint_eq (m.calls, 1);
  memcpy (want, m.newer, BLOCK);
  memset (want + 4 * BLOCK, 0, BLOCK);
  check_read (&f, 0, want, sizeof want, "after a move raced by writes");
  ck_assert_uint_eq (ms.collisions, 2);
  ck_assert_uint_eq (ms.keys, 256 / 4 - 2);
  ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
  check_backing (&f, 0, want, sizeof want, "written back");
  fx_free (&f);
}
END_TEST

/* How much one moving-GC run may copy (bcf_wb_move_budget): a
 * sixteenth of the cache, less where its copies would push the buckets
 * in use within 2 points of the cutoff the writes meet, at least 1/128
 * just below it, and the sixteenth again at or past it.  With only FUA
 * writes sync (bcache-sync-writes=fua) the writes meet cutoff_writeback:
 * sized against cutoff_writeback_sync instead, a run at 37 % copied a
 * sixteenth and pushed them through. */
START_TEST (moving_gc_budget)
{
  const uint64_t cap = 1ull << 30, pct = cap / 100;
  const uint64_t max = cap / 16, floor = cap / 128;

  /* Every write sync: cutoff_writeback_sync. */
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 60, BCF_WB_CUTOFF_SYNC), max);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 66, BCF_WB_CUTOFF_SYNC),
                     2 * pct);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 67, BCF_WB_CUTOFF_SYNC), pct);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 68, BCF_WB_CUTOFF_SYNC),
                     floor);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 69, BCF_WB_CUTOFF_SYNC),
                     floor);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 70, BCF_WB_CUTOFF_SYNC), max);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 85, BCF_WB_CUTOFF_SYNC), max);
  /* FUA writes only: the others meet cutoff_writeback. */
  ck_assert_msg (bcf_wb_move_budget (cap, 36, BCF_WB_CUTOFF) == 2 * pct,
                 "a run at 36 %% may copy %" PRIu64 " bytes, where 2 %% "
                 "(%" PRIu64 ") keeps the writes under cutoff_writeback",
                 bcf_wb_move_budget (cap, 36, BCF_WB_CUTOFF), 2 * pct);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 37, BCF_WB_CUTOFF), pct);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 38, BCF_WB_CUTOFF), floor);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 39, BCF_WB_CUTOFF), floor);
  ck_assert_uint_eq (bcf_wb_move_budget (cap, 57, BCF_WB_CUTOFF), max);
}
END_TEST

/* The writeback thread moves dirty data between its batches when the
 * buckets counted in use are past cutoff_writeback and the dirty data
 * fills less than 3/4 of the buckets marked dirty: with the writeback
 * paused and no write, once copy_gc_enabled is set the count falls under
 * the cutoff within a few rounds, while the dirty bytes stay as they
 * were.  Left at 0 it stays above for as long (the control, in the same
 * test). */
START_TEST (moving_gc_lifts_the_cutoff)
{
  for (int on = 0; on <= 1; on++) {
    struct fx f;
    static uint8_t want[5120 * BLOCK];
    struct bcf_req_stats rs;
    struct bcf_cache_stats cs;
    uint64_t dirty;
    int i;

    fx_init (&f, "movecut.img", 64 * MiB, BCF_MODE_WRITEBACK);
    ck_assert_int_eq (bcf_cache_start_threads (f.c), 0);
    fx_paused_writeback (&f, BCF_SYNC_WRITES_FUA);  /* FUA ones up to 70 % */
    ck_assert_int_eq (bcf_req_set_copy_gc (f.r, false), 0);
    /* 20 MiB, then 15 again: 280 of the 512 buckets marked dirty. */
    mv_fragment (&f, 5120, want, true);
    bcf_req_get_stats (f.r, &rs);
    ck_assert_uint_eq (rs.writeback_cutoff_writes, 0);
    dirty = bcf_cache_dirty_bytes (f.c);
    bcf_trigger_gc (f.c);
    for (i = 0; i < 300; i++) {         /* the next round's count */
      bcf_req_get_stats (f.r, &rs);
      if (rs.cache_in_use > BCF_WB_CUTOFF)
        break;
      usleep (10000);
    }
    ck_assert_uint_gt (rs.cache_in_use, BCF_WB_CUTOFF);
    ck_assert_int_eq (bcf_req_set_copy_gc (f.r, on), 0);
    for (i = 0; i < 600; i++) {         /* rounds every second: 6 s */
      bcf_req_get_stats (f.r, &rs);
      if (rs.cache_in_use <= BCF_WB_CUTOFF)
        break;
      usleep (10000);
    }
    bcf_cache_stats (f.c, &cs);
    printf ("test-writeback: copy_gc_enabled %d: %u %% of the buckets in "
            "use after %d ms, %" PRIu64 " bytes moved; %" PRIu64 " dirty, "
            "%" PRIu64 " buckets dirty\n", on,
            rs.cache_in_use, i * 10, cs.moving_gc_bytes, dirty,
            cs.buckets_dirty);
    fflush (stdout);
    ck_assert_uint_eq (bcf_cache_dirty_bytes (f.c), dirty);
    if (on)
      ck_assert_msg (rs.cache_in_use <= BCF_WB_CUTOFF, "%u %% of the buckets "
                     "still counted in use", rs.cache_in_use);
    else
      ck_assert_uint_gt (rs.cache_in_use, BCF_WB_CUTOFF);
    ck_assert_uint_eq (cs.moving_gc_bytes > 0, on);
    check_read (&f, 0, want, sizeof want, "after the moves");
    ck_assert_int_eq (bcf_req_flush_dirty (f.r, &f.b, 60000, NULL, NULL), 0);
    check_backing (&f, 0, want, sizeof want, "written back");
    f.ro.background = NULL;
    fx_free (&f);
  }
}
END_TEST

static Suite *
writeback_suite (void)
{
  Suite *s = suite_create ("writeback");
  TCase *tc;

#define ADD(fn) \
  tc = tcase_create (#fn); tcase_set_timeout (tc, 300); \
  tcase_add_test (tc, fn); suite_add_tcase (s, tc)
  ADD (write_acknowledged_from_cache);
  ADD (partial_write_over_dirty_writeback);
  ADD (partial_write_over_dirty_writethrough);
  ADD (partial_write_over_dirty_writearound);
  ADD (trim_and_zero_of_dirty_data);
  ADD (flushed_writes_survive_a_crash);
  ADD (writeback_write_takes_no_mark);
  ADD (writeback_journals_before_backing_write);
  ADD (writeback_thread_and_flush);
  ADD (writeback_writes_in_parallel);
  ADD (rate_controller);
  ADD (delay_only_after_whole_index);
  ADD (cutoff_writes_through);
  ADD (cutoff_sync_writes_all);
  ADD (cutoff_follows_dirty_buckets);
  ADD (cutoff_lifts_once_written_back);
  ADD (dirty_read_race_not_from_backing);
  ADD (failing_device_keeps_dirty_data);
  ADD (dirty_data_never_fills_the_cache);
  ADD (write_over_dirty_device_refuses_writes);
  ADD (writethrough_over_dirty_backing_fails);
  ADD (moving_gc_compacts_dirty_data);
  ADD (moving_gc_yields_to_a_racing_write);
  ADD (moving_gc_budget);
  ADD (moving_gc_lifts_the_cutoff);
#undef ADD
  return s;
}

int
main (void)
{
  int r;

  seed = test_seed ("test-writeback");
  test_tmpdir (tmpdir, sizeof tmpdir, "test-writeback");
  r = test_main (writeback_suite ());
  rmdir (tmpdir);
  return r;
}
