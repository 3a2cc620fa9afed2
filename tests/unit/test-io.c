/* Unit tests for core/io: cache-device I/O, buffer pool, fault injection.
 *
 * Most tests run twice (Check loop tests), once with io_uring and once on
 * the synchronous path; where io_uring is unavailable the first run says
 * so and tests the sync path again.  Files go to /tmp (or $TEST_IO_DIR);
 * /dev/shm is used to look at the O_DIRECT fallback.
 *
 * The seed comes from TEST_SEED or the clock and is printed first; every
 * test derives its own generator from it, so a failing test can be
 * replayed alone (CK_RUN_CASE) with the same numbers.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>

#include <check.h>

#include "../../core/io.h"
#include "testlib.h"

#define KiB 1024u
#define MiB (1024u * 1024u)

static unsigned seed;

/* ---- Helpers ------------------------------------------------------------ */

/* xorshift64*: small, seedable. */
struct rng { uint64_t s; };
static uint64_t
rng_next (struct rng *r)
{
  r->s ^= r->s >> 12;
  r->s ^= r->s << 25;
  r->s ^= r->s >> 27;
  return r->s * 2685821657736338717ull;
}
static uint64_t rng_below (struct rng *r, uint64_t n) { return n ? rng_next (r) % n : 0; }

/* A generator for one test: the global seed mixed with the test's name. */
static struct rng
rng_for (const char *name)
{
  uint64_t h = 1469598103934665603ull ^ seed;
  for (const char *p = name; *p; p++)
    h = (h ^ (unsigned char) *p) * 1099511628211ull;
  return (struct rng) { h ? h : 1 };
}

static const char *
test_dir (void)
{
  const char *d = getenv ("TEST_IO_DIR");
  return d && *d ? d : "/tmp";
}

/* Create a file of the given size in dir, contents zero; returns its
 * malloc'd path. */
static char *
make_file_in (const char *dir, uint64_t size)
{
  char *path;
  int fd;

  ck_assert (asprintf (&path, "%s/test-io-XXXXXX", dir) > 0);
  fd = mkstemp (path);
  ck_assert_msg (fd >= 0, "mkstemp %s: %s", path, strerror (errno));
  ck_assert_int_eq (ftruncate (fd, size), 0);
  close (fd);
  return path;
}
static char *make_file (uint64_t size) { return make_file_in (test_dir (), size); }

static void
remove_file (char *path)
{
  unlink (path);
  free (path);
}

/* Fill with bytes that depend on tag and on the file offset, so a block
 * written to the wrong place or a stale block is recognised. */
static void
fill (void *buf, size_t len, uint64_t off, uint32_t tag)
{
  uint32_t *w = buf;
  for (size_t i = 0; i < len / 4; i++)
    w[i] = tag * 2654435761u ^ (uint32_t) ((off + i * 4) / 4);
}

/* Read straight from the file, bypassing bcf_io. */
static void
file_read (const char *path, void *buf, size_t len, uint64_t off)
{
  int fd = open (path, O_RDONLY);
  ck_assert (fd >= 0);
  ck_assert_int_eq (pread (fd, buf, len, off), (ssize_t) len);
  close (fd);
}

static void
file_write (const char *path, const void *buf, size_t len, uint64_t off)
{
  int fd = open (path, O_WRONLY);
  ck_assert (fd >= 0);
  ck_assert_int_eq (pwrite (fd, buf, len, off), (ssize_t) len);
  close (fd);
}

static const enum bcf_io_mode loop_modes[2] = { BCF_IO_URING, BCF_IO_SYNC };

/* Open in the given mode; if io_uring is not available here, say so and
 * use the sync path. */
static struct bcf_io *
open_opts (struct bcf_io_opts *o)
{
  struct bcf_io *io = NULL;
  char err[256];
  int r = bcf_io_open (o, &io, err, sizeof err);

  if (r < 0 && o->mode == BCF_IO_URING &&
      (r == -ENOSYS || r == -EPERM || r == -ENOMEM)) {
    printf ("io_uring unavailable (%s): testing the sync path instead\n", err);
    o->mode = BCF_IO_SYNC;
    r = bcf_io_open (o, &io, err, sizeof err);
  }
  ck_assert_msg (r == 0, "bcf_io_open %s: %d %s", o->path, r, err);
  if (o->mode != BCF_IO_AUTO)
    ck_assert_str_eq (bcf_io_mode_name (io),
                      o->mode == BCF_IO_SYNC ? "sync" : "uring");
  return io;
}

static struct bcf_io *
open_mode (const char *path, enum bcf_io_mode mode)
{
  struct bcf_io_opts o = { .path = path, .mode = mode };
  return open_opts (&o);
}

static void *
xbuf (size_t len)
{
  void *p = bcf_buf_alloc (len);
  ck_assert (p != NULL);
  return p;
}

/* ---- Buffer pool -------------------------------------------------------- */

START_TEST (test_buf_pool)
{
  struct bcf_buf_stats st;
  void *p, *q, *bufs[200];

  bcf_buf_pool_trim ();
  p = xbuf (4096);
  ck_assert_int_eq ((uintptr_t) p % BCF_BUF_ALIGN, 0);
  memset (p, 0xab, 4096);
  bcf_buf_free (p, 4096);
  bcf_buf_stats (&st);
  ck_assert_uint_eq (st.cached_buffers, 1);
  ck_assert_uint_eq (st.cached_bytes, 4096);
  q = xbuf (4096);
  ck_assert_ptr_eq (q, p);              /* recycled */
  bcf_buf_free (q, 4096);

  /* Sizes that are not pooled are still aligned. */
  p = xbuf (12288);
  ck_assert_int_eq ((uintptr_t) p % BCF_BUF_ALIGN, 0);
  bcf_buf_free (p, 12288);
  p = xbuf (2 * MiB);
  ck_assert_int_eq ((uintptr_t) p % BCF_BUF_ALIGN, 0);
  bcf_buf_free (p, 2 * MiB);
  p = xbuf (100);
  ck_assert_int_eq ((uintptr_t) p % BCF_BUF_ALIGN, 0);
  bcf_buf_free (p, 100);
  errno = 0;
  ck_assert_ptr_null (bcf_buf_alloc (0));
  ck_assert_int_eq (errno, EINVAL);

  /* Bounded: 200 freed 8 KiB buffers, at most 64 kept. */
  bcf_buf_pool_trim ();
  for (int i = 0; i < 200; i++)
    bufs[i] = xbuf (8192);
  for (int i = 0; i < 200; i++)
    bcf_buf_free (bufs[i], 8192);
  bcf_buf_stats (&st);
  ck_assert_uint_eq (st.cached_buffers, 64);
  /* And 1 MiB buffers: at most 8. */
  for (int i = 0; i < 20; i++)
    bufs[i] = xbuf (MiB);
  for (int i = 0; i < 20; i++)
    bcf_buf_free (bufs[i], MiB);
  bcf_buf_stats (&st);
  ck_assert_uint_eq (st.cached_buffers, 64 + 8);
  ck_assert_uint_eq (st.cached_bytes, 64 * 8192 + 8 * MiB);
  bcf_buf_pool_trim ();
  bcf_buf_stats (&st);
  ck_assert_uint_eq (st.cached_buffers, 0);
}
END_TEST

struct pool_thread { unsigned id; uint64_t seed; int bad; };

static void *
pool_worker (void *arg)
{
  struct pool_thread *t = arg;
  struct rng r = { t->seed };
  struct { unsigned char *p; size_t len; } held[8] = { { 0 } };

  for (int i = 0; i < 3000; i++) {
    unsigned k = rng_below (&r, 8);
    if (held[k].p) {
      /* Nobody else may have been handed this buffer meanwhile. */
      for (size_t j = 0; j < held[k].len; j += 512)
        if (held[k].p[j] != (unsigned char) t->id)
          t->bad++;
      bcf_buf_free (held[k].p, held[k].len);
      held[k].p = NULL;
    }
    else {
      held[k].len = (size_t) 4096 << rng_below (&r, 9);
      held[k].p = bcf_buf_alloc (held[k].len);
      if (held[k].p == NULL)
        t->bad++;
      else                      /* sparse: sanitizer builds stay quick */
        for (size_t j = 0; j < held[k].len; j += 512)
          held[k].p[j] = t->id;
    }
  }
  for (int k = 0; k < 8; k++)
    bcf_buf_free (held[k].p, held[k].len);
  return NULL;
}

START_TEST (test_buf_pool_threads)
{
  struct rng r = rng_for ("buf_pool_threads");
  pthread_t th[8];
  struct pool_thread t[8];

  for (unsigned i = 0; i < 8; i++) {
    t[i] = (struct pool_thread) { .id = i + 1, .seed = rng_next (&r) | 1 };
    ck_assert_int_eq (pthread_create (&th[i], NULL, pool_worker, &t[i]), 0);
  }
  for (unsigned i = 0; i < 8; i++) {
    pthread_join (th[i], NULL);
    ck_assert_int_eq (t[i].bad, 0);
  }
  bcf_buf_pool_trim ();
}
END_TEST

/* ---- Round trips -------------------------------------------------------- */

START_TEST (test_roundtrip)
{
  static const size_t lens[8] = { 4 * KiB, 64 * KiB, 8 * KiB, 4 * KiB,
                                  128 * KiB, 16 * KiB, 32 * KiB, 1 * MiB };
  char *path = make_file (4 * MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  struct bcf_io_seg w[8], rd[8];
  struct bcf_io_stats st;
  uint64_t off = 0, total = 0;
  unsigned char *check = malloc (MiB);

  for (int i = 0; i < 8; i++) {
    w[i] = (struct bcf_io_seg) { .op = BCF_IO_WRITE, .buf = xbuf (lens[i]),
                                 .len = lens[i], .off = off, .result = 99 };
    fill (w[i].buf, lens[i], off, 1);
    rd[i] = (struct bcf_io_seg) { .op = BCF_IO_READ, .buf = xbuf (lens[i]),
                                  .len = lens[i], .off = off, .result = 99 };
    off += lens[i] + 12 * KiB;          /* leave gaps */
    total += lens[i];
  }
  ck_assert_int_eq (bcf_io_submit (io, w, 8), 0);
  ck_assert_int_eq (bcf_io_submit (io, rd, 8), 0);
  for (int i = 0; i < 8; i++) {
    ck_assert_int_eq (w[i].result, 0);
    ck_assert_int_eq (rd[i].result, 0);
    ck_assert_mem_eq (rd[i].buf, w[i].buf, lens[i]);
    file_read (path, check, lens[i], w[i].off);   /* really in the file */
    ck_assert_mem_eq (check, w[i].buf, lens[i]);
  }
  /* The gaps are untouched. */
  file_read (path, check, 12 * KiB, lens[0]);
  for (unsigned i = 0; i < 12 * KiB; i++)
    ck_assert_int_eq (check[i], 0);

  ck_assert_int_eq (bcf_io_flush (io), 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.writes, 8);
  ck_assert_uint_eq (st.reads, 8);
  ck_assert_uint_eq (st.flushes, 1);
  ck_assert_uint_eq (st.bytes_written, total);
  ck_assert_uint_eq (st.bytes_read, total);
  ck_assert_uint_eq (st.errors, 0);

  /* Single-segment helpers and zero-length segments. */
  ck_assert_int_eq (bcf_io_pwrite (io, w[0].buf, 4096, 3 * MiB), 0);
  ck_assert_int_eq (bcf_io_pread (io, rd[0].buf, 4096, 3 * MiB), 0);
  ck_assert_mem_eq (rd[0].buf, w[0].buf, 4096);
  ck_assert_int_eq (bcf_io_pread (io, NULL, 0, 0), 0);
  ck_assert_int_eq (bcf_io_submit (io, NULL, 0), 0);

  for (int i = 0; i < 8; i++) {
    bcf_buf_free (w[i].buf, lens[i]);
    bcf_buf_free (rd[i].buf, lens[i]);
  }
  free (check);
  ck_assert_int_eq (bcf_io_close (io), 0);
  remove_file (path);
}
END_TEST

/* More segments than the ring is deep, reads and writes interleaved. */
START_TEST (test_many_segments)
{
  const unsigned n = 3 * BCF_IO_RING_DEPTH + 7;
  char *path = make_file (8 * MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  struct bcf_io_seg *segs = calloc (2 * n, sizeof *segs);
  unsigned char *data = xbuf (n * 4096), *back = xbuf (n * 4096);
  unsigned char *data2 = xbuf (n * 4096);
  struct bcf_io_stats st;

  /* n writes of 4 KiB, scattered over the first half, in one submit. */
  fill (data, n * 4096, 0, 7);
  for (unsigned i = 0; i < n; i++)
    segs[i] = (struct bcf_io_seg) { .op = BCF_IO_WRITE,
                                    .buf = data + i * 4096, .len = 4096,
                                    .off = (uint64_t) i * 8192 };
  ck_assert_int_eq (bcf_io_submit (io, segs, n), 0);

  /* Now read them back while writing the second half, alternating. */
  fill (data2, n * 4096, 0, 8);
  for (unsigned i = 0; i < n; i++) {
    segs[2 * i] = (struct bcf_io_seg) { .op = BCF_IO_READ,
                                        .buf = back + i * 4096, .len = 4096,
                                        .off = (uint64_t) i * 8192 };
    segs[2 * i + 1] = (struct bcf_io_seg) {
      .op = BCF_IO_WRITE, .buf = data2 + i * 4096, .len = 4096,
      .off = 4 * MiB + (uint64_t) i * 4096 };
  }
  ck_assert_int_eq (bcf_io_submit (io, segs, 2 * n), 0);
  for (unsigned i = 0; i < 2 * n; i++)
    ck_assert_int_eq (segs[i].result, 0);
  ck_assert_mem_eq (back, data, n * 4096);
  file_read (path, back, n * 4096, 4 * MiB);
  ck_assert_mem_eq (back, data2, n * 4096);

  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.writes, 2 * n);
  ck_assert_uint_eq (st.reads, n);

  bcf_buf_free (data, n * 4096);
  bcf_buf_free (data2, n * 4096);
  bcf_buf_free (back, n * 4096);
  free (segs);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

/* bcf_io_start / bcf_io_finish: more segments than the ring is deep,
 * left in flight while the same thread does other I/O (which takes the
 * synchronous path meanwhile), and a second start on the thread, which
 * is done at once.  Everything lands, and the stats count it. */
START_TEST (test_start_finish)
{
  const unsigned n = 2 * BCF_IO_RING_DEPTH + 3;
  char *path = make_file (8 * MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  struct bcf_io_seg *segs = calloc (n, sizeof *segs), two;
  unsigned char *data = xbuf (n * 4096), *back = xbuf (n * 4096);
  unsigned char *other = xbuf (4096), *got = xbuf (4096);
  struct bcf_io_pending p, q;
  struct bcf_io_stats st;

  fill (data, n * 4096, 0, 11);
  fill (other, 4096, 0, 12);
  for (unsigned i = 0; i < n; i++)
    segs[i] = (struct bcf_io_seg) { .op = BCF_IO_WRITE,
                                    .buf = data + i * 4096, .len = 4096,
                                    .off = (uint64_t) i * 8192 };
  bcf_io_start (io, segs, n, &p);
  /* Meanwhile, on this thread: a write, a read, a flush, and a second
   * start (its own I/O is done before it returns). */
  ck_assert_int_eq (bcf_io_pwrite (io, other, 4096, 6 * MiB), 0);
  ck_assert_int_eq (bcf_io_pread (io, got, 4096, 6 * MiB), 0);
  ck_assert_mem_eq (got, other, 4096);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  two = (struct bcf_io_seg) { .op = BCF_IO_WRITE, .buf = other, .len = 4096,
                              .off = 7 * MiB };
  bcf_io_start (io, &two, 1, &q);
  ck_assert_int_eq (bcf_io_finish (&q), 0);
  ck_assert_int_eq (bcf_io_finish (&p), 0);
  for (unsigned i = 0; i < n; i++) {
    ck_assert_int_eq (segs[i].result, 0);
    file_read (path, back + i * 4096, 4096, (uint64_t) i * 8192);
  }
  ck_assert_mem_eq (back, data, n * 4096);
  file_read (path, got, 4096, 7 * MiB);
  ck_assert_mem_eq (got, other, 4096);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.writes, n + 2);
  ck_assert_uint_eq (st.reads, 1);

  /* After finish the thread's ring is its own again; a rejected start
   * reports at finish, as bcf_io_submit would. */
  ck_assert_int_eq (bcf_io_pread (io, got, 4096, 0), 0);
  ck_assert_mem_eq (got, data, 4096);
  two.off = 1;
  bcf_io_start (io, &two, 1, &q);
  ck_assert_int_eq (bcf_io_finish (&q), -EINVAL);

  bcf_buf_free (data, n * 4096);
  bcf_buf_free (back, n * 4096);
  bcf_buf_free (other, 4096);
  bcf_buf_free (got, 4096);
  free (segs);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

/* Misaligned segments are rejected, and the whole submit with them. */
START_TEST (test_unaligned)
{
  char *path = make_file (MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  unsigned bs = bcf_io_block_size (io);
  unsigned char *buf = xbuf (16 * KiB), *check = malloc (8 * KiB);
  struct bcf_io_seg segs[2];
  struct bcf_io_stats st;

  ck_assert (bs == 512 || bs == 4096);
  memset (buf, 'x', 16 * KiB);

  /* Misaligned memory, next to a good segment: neither is performed. */
  segs[0] = (struct bcf_io_seg) { BCF_IO_WRITE, buf, 4096, 0, 99 };
  segs[1] = (struct bcf_io_seg) { BCF_IO_WRITE, buf + 1, 4096, 8192, 99 };
  ck_assert_int_eq (bcf_io_submit (io, segs, 2), -EINVAL);
  ck_assert_int_eq (segs[0].result, -ECANCELED);
  ck_assert_int_eq (segs[1].result, -EINVAL);
  file_read (path, check, 8 * KiB, 0);
  for (unsigned i = 0; i < 8 * KiB; i++)
    ck_assert_int_eq (check[i], 0);

  ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 100), -EINVAL);
  ck_assert_int_eq (bcf_io_pwrite (io, buf, 100, 0), -EINVAL);
  ck_assert_int_eq (bcf_io_pread (io, buf, bs + 1, 0), -EINVAL);
  ck_assert_int_eq (bcf_io_pread (io, buf + bs / 2, bs, 0), -EINVAL);
  segs[0].op = 7;                     /* not an op */
  ck_assert_int_eq (bcf_io_submit (io, segs, 1), -EINVAL);

  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.writes + st.reads + st.errors, 0);
  bcf_buf_free (buf, 16 * KiB);
  free (check);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

/* Outside the device: -EINVAL before any I/O.  A file shrunk underneath
 * us: the read hits EOF and is -EIO, never short. */
START_TEST (test_eof)
{
  char *path = make_file (MiB + 100);   /* partial tail block */
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  unsigned char *buf = xbuf (64 * KiB);
  struct bcf_io_stats st;

  ck_assert_uint_eq (bcf_io_size (io), MiB);   /* tail rounded off */
  ck_assert_int_eq (bcf_io_pread (io, buf, 4096, MiB), -EINVAL);
  ck_assert_int_eq (bcf_io_pread (io, buf, 8192, MiB - 4096), -EINVAL);
  ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, MiB), -EINVAL);
  ck_assert_int_eq (bcf_io_pread (io, buf, 4096, UINT64_MAX - 4095), -EINVAL);
  ck_assert_int_eq (bcf_io_pread (io, buf, 4096, MiB - 4096), 0);

  ck_assert_int_eq (truncate (path, 512 * KiB), 0);
  ck_assert_int_eq (bcf_io_pread (io, buf, 4096, 768 * KiB), -EIO);
  ck_assert_int_eq (bcf_io_pread (io, buf, 64 * KiB, 480 * KiB), -EIO);
  ck_assert_int_eq (bcf_io_pread (io, buf, 64 * KiB, 448 * KiB), 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.errors, 2);

  bcf_buf_free (buf, 64 * KiB);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

START_TEST (test_flush_readonly)
{
  char *path = make_file (MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  unsigned char *buf = xbuf (4096), *back = xbuf (4096);
  struct bcf_io_opts o = { .path = path, .mode = loop_modes[_i],
                           .readonly = true };
  struct bcf_io_stats st;

  fill (buf, 4096, 0, 3);
  ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 0), 0);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.flushes, 2);
  bcf_io_close (io);

  io = open_opts (&o);
  ck_assert (bcf_io_readonly (io));
  ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 4096), -EROFS);
  ck_assert_int_eq (bcf_io_pread (io, back, 4096, 0), 0);
  ck_assert_mem_eq (back, buf, 4096);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  bcf_io_close (io);

  bcf_buf_free (buf, 4096);
  bcf_buf_free (back, 4096);
  remove_file (path);
}
END_TEST

/* ---- O_DIRECT ----------------------------------------------------------- */

static const char *
fs_name (const char *dir)
{
  struct statfs sf;
  if (statfs (dir, &sf) == -1)
    return "?";
  switch (sf.f_type) {
  case 0xEF53: return "ext4";
  case 0x01021994: return "tmpfs";
  case 0x58465342: return "xfs";
  case 0x9123683E: return "btrfs";
  case 0x794c7630: return "overlayfs";
  default: return "other";
  }
}

/* Whatever the filesystem: bcf_io says whether O_DIRECT is on, explains
 * itself when it is not, and the data is right either way. */
static void
check_direct_in (const char *dir, unsigned test_flags)
{
  char *path;
  struct bcf_io_opts o = { .mode = BCF_IO_AUTO, .test_flags = test_flags };
  struct bcf_io *io;
  unsigned char *buf = xbuf (64 * KiB), *back = malloc (64 * KiB);
  const char *notice;

  if (access (dir, W_OK) != 0) {
    printf ("%s not writable: O_DIRECT check skipped there\n", dir);
    goto out;
  }
  path = make_file_in (dir, MiB);
  o.path = path;
  io = open_opts (&o);
  notice = bcf_io_notice (io);
  printf ("%s (%s): direct=%d block=%u mode=%s notice=%s\n", dir,
          fs_name (dir), bcf_io_direct (io), bcf_io_block_size (io),
          bcf_io_mode_name (io), notice ? notice : "none");
  if (bcf_io_direct (io))
    ck_assert (notice == NULL || strstr (notice, "O_DIRECT") == NULL);
  else {
    char *expect;
    ck_assert (asprintf (&expect, "O_DIRECT refused on %s (filesystem does "
                         "not support it); using buffered I/O with fdatasync",
                         path) > 0);
    ck_assert_ptr_nonnull (notice);
    ck_assert_msg (strstr (notice, expect) != NULL, "notice: %s", notice);
    free (expect);
  }
  fill (buf, 64 * KiB, 4096, 5);
  ck_assert_int_eq (bcf_io_pwrite (io, buf, 64 * KiB, 4096), 0);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  file_read (path, back, 64 * KiB, 4096);
  ck_assert_mem_eq (back, buf, 64 * KiB);
  memset (buf, 0, 64 * KiB);
  ck_assert_int_eq (bcf_io_pread (io, buf, 64 * KiB, 4096), 0);
  ck_assert_mem_eq (back, buf, 64 * KiB);
  bcf_io_close (io);
  remove_file (path);
 out:
  bcf_buf_free (buf, 64 * KiB);
  free (back);
}

START_TEST (test_direct_filesystems)
{
  check_direct_in ("/tmp", 0);
  check_direct_in ("/dev/shm", 0);     /* tmpfs: O_DIRECT only on 6.6+ */
  check_direct_in (test_dir (), 0);
}
END_TEST

/* The fallback itself, whatever this machine's filesystems accept. */
START_TEST (test_direct_refused)
{
  char *path = make_file (MiB);
  struct bcf_io_opts o = { .path = path, .mode = loop_modes[_i],
                           .test_flags = BCF_IO_TEST_REFUSE_DIRECT };
  struct bcf_io *io;
  char err[256];

  check_direct_in (test_dir (), BCF_IO_TEST_REFUSE_DIRECT);

  io = open_opts (&o);
  ck_assert (!bcf_io_direct (io));
  ck_assert_uint_eq (bcf_io_block_size (io), 512);
  bcf_io_close (io);

  o.direct = BCF_IO_DIRECT_REQUIRE;
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -EINVAL);
  ck_assert_ptr_null (io);
  ck_assert_msg (strstr (err, "O_DIRECT refused on") != NULL, "%s", err);

  o.direct = BCF_IO_DIRECT_OFF;
  o.test_flags = 0;
  io = open_opts (&o);
  ck_assert (!bcf_io_direct (io));
  ck_assert_ptr_null (bcf_io_notice (io));
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

/* ---- Open --------------------------------------------------------------- */

START_TEST (test_open_errors)
{
  struct bcf_io_opts o = { 0 };
  struct bcf_io *io = (struct bcf_io *) 1;
  char err[256], *path, *expect;
  struct stat st;

  o.path = "/nonexistent-bcf/x";
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -ENOENT);
  ck_assert_ptr_null (io);
  ck_assert_str_eq (err, "cannot open /nonexistent-bcf/x: "
                    "No such file or directory");
  o.create_size = MiB;
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -ENOENT);
  ck_assert_str_eq (err, "cannot create /nonexistent-bcf/x: "
                    "No such file or directory");
  o.create_size = 0;

  o.path = "/dev/null";
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -EINVAL);
  ck_assert_str_eq (err, "/dev/null: not a regular file or block device");
  o.path = "/tmp";
  o.readonly = true;
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -EINVAL);
  ck_assert_str_eq (err, "/tmp: not a regular file or block device");
  o.readonly = false;
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -EISDIR);
  o.path = "";
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -EINVAL);
  ck_assert_str_eq (err, "no cache device path given");

  /* create_size: created when missing... */
  path = make_file (0);
  unlink (path);
  o.path = path;
  o.readonly = true;
  o.create_size = 3 * MiB;
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -ENOENT);
  ck_assert (asprintf (&expect, "cannot open %s: No such file or directory",
                       path) > 0);
  ck_assert_str_eq (err, expect);
  free (expect);
  o.readonly = false;
  io = open_opts (&o);
  ck_assert_uint_eq (bcf_io_size (io), 3 * MiB);
  ck_assert (!bcf_io_is_blockdev (io));
  ck_assert_str_eq (bcf_io_path (io), path);
  bcf_io_close (io);
  ck_assert_int_eq (stat (path, &st), 0);
  ck_assert_int_eq (st.st_size, 3 * MiB);
  /* ... and an existing file is used as it is. */
  o.create_size = 5 * MiB;
  io = open_opts (&o);
  ck_assert_uint_eq (bcf_io_size (io), 3 * MiB);
  bcf_io_close (io);
  remove_file (path);

  /* Permissions: only meaningful when not root. */
  if (geteuid () != 0) {
    path = make_file (MiB);
    chmod (path, 0400);
    o.path = path;
    o.create_size = 0;
    ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -EACCES);
    ck_assert (asprintf (&expect, "cannot open %s: Permission denied",
                         path) > 0);
    ck_assert_str_eq (err, expect);
    free (expect);
    remove_file (path);
  }
}
END_TEST

/* The fence (io.c, fence_previous_writer): a previous writer's I/O
 * descriptor that is still referenced (a killed process's requests in
 * flight hold it, after the process and its claim are gone) holds the
 * OFD lock its open took; here the test holds such a descriptor itself,
 * with a write that "lands late", just before it lets go.  A new writer
 * must wait for it, and only then start: it sees the late write. */
struct fence_ctx {
  const char *path;
  atomic_bool released;
  bool released_at_open;
  char notice[512];
  uint8_t first;
};

static void *
fence_opener (void *arg)
{
  struct fence_ctx *f = arg;
  struct bcf_io_opts o = { .path = f->path };
  struct bcf_io *io = open_opts (&o);
  uint8_t *b = bcf_buf_alloc (4096);

  f->released_at_open = atomic_load (&f->released);
  snprintf (f->notice, sizeof f->notice, "%s",
            bcf_io_notice (io) ? bcf_io_notice (io) : "");
  ck_assert_int_eq (bcf_io_pread (io, b, 4096, 0), 0);
  f->first = b[0];
  bcf_buf_free (b, 4096);
  bcf_io_close (io);
  return NULL;
}

START_TEST (test_fence_previous_writer)
{
  char *path = make_file (MiB);
  struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
  struct fence_ctx f = { .path = path };
  uint8_t late[4096];
  pthread_t t;
  int fd = open (path, O_RDWR);

  ck_assert_int_ge (fd, 0);
  ck_assert_int_eq (fcntl (fd, F_OFD_SETLK, &fl), 0);
  ck_assert_int_eq (pthread_create (&t, NULL, fence_opener, &f), 0);
  usleep (200000);
  memset (late, 0x5a, sizeof late);
  ck_assert_int_eq (pwrite (fd, late, sizeof late, 0), (ssize_t) sizeof late);
  atomic_store (&f.released, true);
  close (fd);
  ck_assert_int_eq (pthread_join (t, NULL), 0);
  ck_assert_msg (f.released_at_open, "the open did not wait for the "
                 "previous writer's descriptor");
  ck_assert_uint_eq (f.first, 0x5a);
  ck_assert_msg (strstr (f.notice, "previous process") != NULL, "notice: %s",
                 f.notice);
  remove_file (path);
}
END_TEST

START_TEST (test_modes)
{
  char *path = make_file (MiB);
  struct bcf_io_opts o = { .path = path, .mode = BCF_IO_SYNC };
  struct bcf_io *io;
  char err[256];
  int r;

  io = open_opts (&o);
  ck_assert_str_eq (bcf_io_mode_name (io), "sync");
  bcf_io_close (io);

  o.mode = BCF_IO_URING;
  r = bcf_io_open (&o, &io, err, sizeof err);
  if (r == 0) {
    ck_assert_str_eq (bcf_io_mode_name (io), "uring");
    bcf_io_close (io);
  }
  else
    printf ("io_uring unavailable here: %s\n", err);

  /* AUTO: uring where it works (and O_DIRECT too: below), else sync with
   * a notice. */
  o.mode = BCF_IO_AUTO;
  io = open_opts (&o);
  ck_assert_str_eq (bcf_io_mode_name (io),
                    r == 0 && bcf_io_direct (io) ? "uring" : "sync");
  bcf_io_close (io);

  /* AUTO without O_DIRECT: sync, by choice (no notice); URING keeps
   * io_uring there if asked for. */
  o.direct = BCF_IO_DIRECT_OFF;
  io = open_opts (&o);
  ck_assert (!bcf_io_direct (io));
  ck_assert_str_eq (bcf_io_mode_name (io), "sync");
  ck_assert_ptr_null (bcf_io_notice (io));
  bcf_io_close (io);
  if (r == 0) {
    o.mode = BCF_IO_URING;
    io = open_opts (&o);
    ck_assert_str_eq (bcf_io_mode_name (io), "uring");
    bcf_io_close (io);
    o.mode = BCF_IO_AUTO;
  }
  o.direct = BCF_IO_DIRECT_AUTO;

  o.test_flags = BCF_IO_TEST_NO_URING;
  io = open_opts (&o);
  ck_assert_str_eq (bcf_io_mode_name (io), "sync");
  ck_assert_ptr_nonnull (bcf_io_notice (io));
  ck_assert_msg (strstr (bcf_io_notice (io), "io_uring unavailable (") != NULL,
                 "%s", bcf_io_notice (io));
  bcf_io_close (io);

  o.mode = BCF_IO_URING;
  ck_assert_int_eq (bcf_io_open (&o, &io, err, sizeof err), -ENOSYS);
  ck_assert_msg (strstr (err, "io_uring unavailable for") != NULL, "%s", err);
  remove_file (path);
}
END_TEST

/* ---- Concurrency -------------------------------------------------------- */

#define T_THREADS 8
#define T_REGION (512 * KiB)

struct io_thread {
  struct bcf_io *io;
  unsigned id;
  uint64_t seed;
  unsigned char *model;         /* what the region should hold */
  int bad;
};

static void *
io_worker (void *arg)
{
  struct io_thread *t = arg;
  struct rng r = { t->seed };
  uint64_t base = (uint64_t) t->id * T_REGION;
  unsigned char *buf = bcf_buf_alloc (T_REGION);

  if (buf == NULL) {
    t->bad++;
    return NULL;
  }
  for (unsigned it = 0; it < 150; it++) {
    unsigned nseg = 1 + rng_below (&r, 4);
    struct bcf_io_seg segs[4];
    size_t used = 0;

    /* Up to 4 writes in one submit; ranges may overlap within the thread's
     * region only across submits (within one, they are disjoint slices). */
    for (unsigned s = 0; s < nseg; s++) {
      uint64_t slice = T_REGION / 4, lo = s * slice;
      size_t len = 4096 * (1 + rng_below (&r, 8));
      uint64_t off = lo + 4096 * rng_below (&r, (slice - len) / 4096 + 1);
      fill (buf + used, len, base + off, t->id * 1000 + it);
      segs[s] = (struct bcf_io_seg) { BCF_IO_WRITE, buf + used, len,
                                      base + off, 0 };
      memcpy (t->model + off, buf + used, len);
      used += len;
    }
    if (bcf_io_submit (t->io, segs, nseg) != 0)
      t->bad++;
    if (rng_below (&r, 16) == 0 && bcf_io_flush (t->io) != 0)
      t->bad++;
    if (rng_below (&r, 8) == 0) {
      uint64_t off = 4096 * rng_below (&r, T_REGION / 4096 - 16);
      if (bcf_io_pread (t->io, buf, 16 * 4096, base + off) != 0 ||
          memcmp (buf, t->model + off, 16 * 4096) != 0)
        t->bad++;
    }
  }
  if (bcf_io_pread (t->io, buf, T_REGION, base) != 0 ||
      memcmp (buf, t->model, T_REGION) != 0)
    t->bad++;
  bcf_buf_free (buf, T_REGION);
  return NULL;                  /* the thread's ring goes with it */
}

START_TEST (test_threads)
{
  struct rng r = rng_for ("threads");
  char *path = make_file (T_THREADS * T_REGION);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  pthread_t th[T_THREADS];
  struct io_thread t[T_THREADS];
  unsigned char *back = malloc (T_REGION);

  for (unsigned i = 0; i < T_THREADS; i++) {
    t[i] = (struct io_thread) { .io = io, .id = i, .seed = rng_next (&r) | 1,
                                .model = calloc (1, T_REGION) };
    ck_assert_int_eq (pthread_create (&th[i], NULL, io_worker, &t[i]), 0);
  }
  for (unsigned i = 0; i < T_THREADS; i++)
    pthread_join (th[i], NULL);
  for (unsigned i = 0; i < T_THREADS; i++) {
    ck_assert_msg (t[i].bad == 0, "thread %u: %d failures", i, t[i].bad);
    file_read (path, back, T_REGION, (uint64_t) i * T_REGION);
    ck_assert_mem_eq (back, t[i].model, T_REGION);
    free (t[i].model);
  }
  free (back);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

/* A fork child gets its own ring, not a share of its parent's. */
START_TEST (test_fork)
{
  char *path = make_file (MiB);
  struct bcf_io *io = open_mode (path, BCF_IO_AUTO);
  unsigned char *buf = xbuf (4096), *back = xbuf (4096);
  pid_t pid;
  int status;

  fill (buf, 4096, 0, 11);
  ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 0), 0);
  pid = fork ();
  ck_assert (pid >= 0);
  if (pid == 0) {
    int ok = bcf_io_pread (io, back, 4096, 0) == 0 &&
      memcmp (back, buf, 4096) == 0 &&
      bcf_io_pwrite (io, buf, 4096, 8192) == 0 && bcf_io_flush (io) == 0;
    _exit (ok ? 0 : 1);
  }
  ck_assert_int_eq (waitpid (pid, &status, 0), pid);
  ck_assert (WIFEXITED (status) && WEXITSTATUS (status) == 0);
  ck_assert_int_eq (bcf_io_pread (io, back, 4096, 8192), 0);
  ck_assert_mem_eq (back, buf, 4096);
  bcf_buf_free (buf, 4096);
  bcf_buf_free (back, 4096);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

/* ---- Fault injection ---------------------------------------------------- */

/* Exactly the N-th I/O fails, counting reads, writes and flushes. */
START_TEST (test_fail_nth)
{
  static const char ops[] = "wrwfrwrfwr";
  char *path = make_file (MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  unsigned char *buf = xbuf (64 * KiB), *back = malloc (4096);
  struct bcf_io_faults f = { .fail_nth = 5 };
  struct bcf_io_seg segs[6];
  struct bcf_io_stats st;

  fill (buf, 64 * KiB, 0, 2);
  bcf_io_set_faults (io, &f);
  for (int n = 1; ops[n - 1]; n++) {
    int r = ops[n - 1] == 'w' ? bcf_io_pwrite (io, buf, 4096, n * 4096)
      : ops[n - 1] == 'r' ? bcf_io_pread (io, buf, 4096, 0)
      : bcf_io_flush (io);
    ck_assert_msg (r == (n == 5 ? -EIO : 0), "I/O %d (%c): %d", n,
                   ops[n - 1], r);
  }
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.errors_injected, 1);
  ck_assert_uint_eq (st.errors, 0);

  /* Within one submit: the 3rd segment, and it is not performed. */
  f.fail_nth = 3;
  bcf_io_set_faults (io, &f);
  fill (buf, 64 * KiB, 0, 4);
  for (int i = 0; i < 6; i++)
    segs[i] = (struct bcf_io_seg) { BCF_IO_WRITE, buf + i * 4096, 4096,
                                    256 * KiB + i * 4096, 99 };
  ck_assert_int_eq (bcf_io_submit (io, segs, 6), -EIO);
  for (int i = 0; i < 6; i++)
    ck_assert_int_eq (segs[i].result, i == 2 ? -EIO : 0);
  file_read (path, back, 4096, 256 * KiB + 2 * 4096);
  for (int i = 0; i < 4096; i++)
    ck_assert_int_eq (back[i], 0);
  file_read (path, back, 4096, 256 * KiB + 3 * 4096);
  ck_assert_mem_eq (back, buf + 3 * 4096, 4096);

  /* fail_every counting writes only, with a chosen errno. */
  f = (struct bcf_io_faults) { .fail_every = 2, .fail_writes_only = true,
                               .error = ENOSPC };
  bcf_io_set_faults (io, &f);
  for (int n = 1; n <= 6; n++) {
    ck_assert_int_eq (bcf_io_pread (io, buf, 4096, 0), 0);
    ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 0),
                      n % 2 == 0 ? -ENOSPC : 0);
  }
  /* Disarmed: nothing fails. */
  bcf_io_set_faults (io, NULL);
  for (int n = 1; n <= 6; n++)
    ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 0), 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.errors_injected, 1 + 1 + 3);

  bcf_buf_free (buf, 64 * KiB);
  free (back);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

START_TEST (test_delay)
{
  char *path = make_file (MiB);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  unsigned char *buf = xbuf (4096);
  struct bcf_io_faults f = { .delay_us = 2000 };
  struct timespec t0, t1;
  double ms;

  memset (buf, 1, 4096);
  bcf_io_set_faults (io, &f);
  clock_gettime (CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < 5; i++)
    ck_assert_int_eq (bcf_io_pwrite (io, buf, 4096, 0), 0);
  clock_gettime (CLOCK_MONOTONIC, &t1);
  ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
  ck_assert_msg (ms >= 10.0, "5 delayed I/Os took %.3f ms", ms);   /* lower bound only */
  bcf_buf_free (buf, 4096);
  bcf_io_close (io);
  remove_file (path);
}
END_TEST

#define REGION (64 * KiB)

static void
write_region (struct bcf_io *io, unsigned k, uint32_t tag, int expect)
{
  unsigned char *buf = xbuf (REGION);
  fill (buf, REGION, k * REGION, tag);
  ck_assert_int_eq (bcf_io_pwrite (io, buf, REGION, k * REGION), expect);
  bcf_buf_free (buf, REGION);
}

/* Region k of the file holds tag's pattern (tag 0: zeroes). */
static bool
region_is (const char *path, unsigned k, uint32_t tag)
{
  unsigned char *a = malloc (REGION), *b = calloc (1, REGION);
  bool same;
  file_read (path, a, REGION, k * REGION);
  if (tag)
    fill (b, REGION, k * REGION, tag);
  same = memcmp (a, b, REGION) == 0;
  free (a);
  free (b);
  return same;
}

/* Power cut after the 4th write, writes 2..4 unflushed. */
static int
power_cut_run (const char *path, enum bcf_io_mode mode,
               enum bcf_io_crash_mode crash)
{
  struct bcf_io *io = open_mode (path, mode);
  struct bcf_io_faults f = { .power_cut_after_write = 4 };
  unsigned char *buf = xbuf (4096);
  struct bcf_io_stats st;
  int r;

  bcf_io_set_faults (io, &f);
  write_region (io, 0, 100, 0);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  write_region (io, 1, 101, 0);
  write_region (io, 2, 102, 0);
  write_region (io, 3, 103, 0);
  /* Dead from here on. */
  write_region (io, 4, 104, -EIO);
  ck_assert_int_eq (bcf_io_pread (io, buf, 4096, 0), -EIO);
  ck_assert_int_eq (bcf_io_flush (io), -EIO);
  write_region (io, 5, 105, -EIO);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.writes, 4);
  ck_assert_uint_eq (st.errors_injected, 4);
  ck_assert_uint_eq (st.unflushed_writes, 3);
  /* Region 4 never reached the file, even before the crash. */
  ck_assert (region_is (path, 4, 0));
  bcf_buf_free (buf, 4096);
  r = bcf_io_crash (io, seed, crash);
  return r;
}

START_TEST (test_power_cut)
{
  char *path = make_file (8 * REGION);
  struct bcf_io *io;

  /* Lose all: only the flushed write survives the "reboot". */
  ck_assert_int_eq (power_cut_run (path, loop_modes[_i],
                                   BCF_IO_CRASH_LOSE_ALL), 3);
  ck_assert (region_is (path, 0, 100));
  for (unsigned k = 1; k < 8; k++)
    ck_assert_msg (region_is (path, k, 0), "region %u not reverted", k);
  io = open_mode (path, loop_modes[_i]);     /* usable after the reboot */
  write_region (io, 1, 201, 0);
  bcf_io_close (io);
  ck_assert (region_is (path, 1, 201));
  remove_file (path);

  /* Keep all: every completed write survives; the dead ones never were. */
  path = make_file (8 * REGION);
  ck_assert_int_eq (power_cut_run (path, loop_modes[_i],
                                   BCF_IO_CRASH_KEEP_ALL), 0);
  for (unsigned k = 0; k < 4; k++)
    ck_assert (region_is (path, k, 100 + k));
  for (unsigned k = 4; k < 8; k++)
    ck_assert (region_is (path, k, 0));
  remove_file (path);
}
END_TEST

/* The cut inside one submit: the writes after the N-th are issued before
 * it completes (io_uring), and still must not reach the file. */
START_TEST (test_power_cut_batch)
{
  char *path = make_file (8 * REGION);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  struct bcf_io_faults f = { .power_cut_after_write = 2 };
  unsigned char *buf = xbuf (4 * REGION);
  struct bcf_io_seg segs[4];

  bcf_io_set_faults (io, &f);
  for (unsigned k = 0; k < 4; k++) {
    fill (buf + k * REGION, REGION, k * REGION, 300 + k);
    segs[k] = (struct bcf_io_seg) { BCF_IO_WRITE, buf + k * REGION, REGION,
                                    k * REGION, 99 };
  }
  ck_assert_int_eq (bcf_io_submit (io, segs, 4), -EIO);
  for (unsigned k = 0; k < 4; k++)
    ck_assert_int_eq (segs[k].result, k < 2 ? 0 : -EIO);
  ck_assert (region_is (path, 2, 0));
  ck_assert (region_is (path, 3, 0));
  ck_assert_int_eq (bcf_io_crash (io, seed, BCF_IO_CRASH_KEEP_ALL), 0);
  ck_assert (region_is (path, 0, 300));
  ck_assert (region_is (path, 1, 301));
  ck_assert (region_is (path, 2, 0));
  bcf_buf_free (buf, 4 * REGION);
  remove_file (path);
}
END_TEST

/* A flush covers writes completed before it, and a later write to the same
 * range is undone back to the flushed data, not to the original. */
START_TEST (test_crash_flush_boundary)
{
  char *path = make_file (4 * REGION);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  struct bcf_io_faults f = { 0 };
  struct bcf_io_stats st;

  bcf_io_set_faults (io, &f);
  write_region (io, 0, 1, 0);
  write_region (io, 1, 2, 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.unflushed_writes, 2);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.unflushed_writes, 0);
  write_region (io, 0, 3, 0);           /* overwrites flushed data */
  write_region (io, 2, 4, 0);
  write_region (io, 0, 5, 0);           /* twice */
  ck_assert_int_eq (bcf_io_crash (io, seed, BCF_IO_CRASH_LOSE_ALL), 3);
  ck_assert (region_is (path, 0, 1));
  ck_assert (region_is (path, 1, 2));
  ck_assert (region_is (path, 2, 0));
  remove_file (path);
}
END_TEST

/* A FUA write survives any crash once it completed, even over an older
 * unflushed write of the same range; it makes no other write durable. */
START_TEST (test_crash_fua)
{
  char *path = make_file (4 * REGION);
  struct bcf_io *io = open_mode (path, loop_modes[_i]);
  struct bcf_io_faults f = { 0 };
  struct bcf_io_stats st;
  unsigned char *buf = xbuf (REGION);

  bcf_io_set_faults (io, &f);
  write_region (io, 0, 1, 0);
  ck_assert_int_eq (bcf_io_flush (io), 0);
  write_region (io, 1, 2, 0);           /* unflushed */
  write_region (io, 0, 3, 0);           /* unflushed, then overwritten */
  fill (buf, REGION, 0, 4);
  ck_assert_int_eq (bcf_io_pwrite_fua (io, buf, REGION, 0), 0);
  fill (buf, REGION, 2 * REGION, 5);
  ck_assert_int_eq (bcf_io_pwrite_fua (io, buf, REGION, 2 * REGION), 0);
  bcf_io_stats (io, &st);
  ck_assert_uint_eq (st.unflushed_writes, 2);
  ck_assert_int_eq (bcf_io_crash (io, seed, BCF_IO_CRASH_LOSE_ALL), 2);
  ck_assert (region_is (path, 0, 4));
  ck_assert (region_is (path, 1, 0));
  ck_assert (region_is (path, 2, 5));
  bcf_buf_free (buf, REGION);
  remove_file (path);
}
END_TEST

/* Seeded random crash over overlapping writes: the result is always one of
 * the states a volatile cache could leave (the durable base plus some
 * subset of the unflushed writes, each whole, applied in order), and the
 * same seed gives the same state. */
#define CR_SIZE (64 * KiB)
#define CR_WRITES 6
#define CR_FLUSHED 2

struct cr_write { uint64_t off; size_t len; uint32_t tag; };

static int
crash_run (const char *path, enum bcf_io_mode mode, const struct cr_write *w,
           uint64_t crash_seed)
{
  struct bcf_io *io = open_mode (path, mode);
  struct bcf_io_faults f = { 0 };

  bcf_io_set_faults (io, &f);
  for (int i = 0; i < CR_WRITES; i++) {
    unsigned char *buf = xbuf (w[i].len);
    fill (buf, w[i].len, w[i].off, w[i].tag);
    ck_assert_int_eq (bcf_io_pwrite (io, buf, w[i].len, w[i].off), 0);
    bcf_buf_free (buf, w[i].len);
    if (i + 1 == CR_FLUSHED)
      ck_assert_int_eq (bcf_io_flush (io), 0);
  }
  return bcf_io_crash (io, crash_seed, BCF_IO_CRASH_RANDOM);
}

START_TEST (test_crash_random)
{
  struct rng r = rng_for ("crash_random");
  const unsigned nsub = 1u << (CR_WRITES - CR_FLUSHED);
  unsigned char *base = malloc (CR_SIZE), *got = malloc (CR_SIZE);
  unsigned char *got2 = malloc (CR_SIZE), *model = malloc (CR_SIZE);
  unsigned char *tmp = malloc (CR_SIZE);
  bool seen[1u << (CR_WRITES - CR_FLUSHED)] = { false };
  unsigned distinct = 0;

  for (int round = 0; round < 12; round++) {
    struct cr_write w[CR_WRITES];
    uint64_t crash_seed = rng_next (&r);
    char *p1 = make_file (CR_SIZE), *p2 = make_file (CR_SIZE);
    int match = -1, r1, r2;

    /* Random base contents; random overlapping writes. */
    for (unsigned i = 0; i < CR_SIZE; i += 8)
      *(uint64_t *) (base + i) = rng_next (&r);
    file_write (p1, base, CR_SIZE, 0);
    file_write (p2, base, CR_SIZE, 0);
    for (int i = 0; i < CR_WRITES; i++) {
      w[i].len = 4096 * (1 + rng_below (&r, 6));
      w[i].off = 4096 * rng_below (&r, (CR_SIZE - w[i].len) / 4096 + 1);
      w[i].tag = 1000 * round + i + 1;
    }
    printf ("crash_random round %d: crash seed %" PRIu64 "\n", round,
            crash_seed);
    r1 = crash_run (p1, loop_modes[_i], w, crash_seed);
    r2 = crash_run (p2, loop_modes[_i ^ 1], w, crash_seed);
    ck_assert_int_ge (r1, 0);
    ck_assert_int_eq (r1, r2);
    file_read (p1, got, CR_SIZE, 0);
    file_read (p2, got2, CR_SIZE, 0);
    ck_assert_mem_eq (got, got2, CR_SIZE);      /* deterministic */

    /* Which subset of the unflushed writes is it? */
    for (unsigned s = 0; s < nsub && match < 0; s++) {
      memcpy (model, base, CR_SIZE);
      for (int i = 0; i < CR_WRITES; i++)
        if (i < CR_FLUSHED || (s >> (i - CR_FLUSHED) & 1)) {
          fill (tmp, w[i].len, w[i].off, w[i].tag);
          memcpy (model + w[i].off, tmp, w[i].len);
        }
      if (memcmp (model, got, CR_SIZE) == 0 &&
          r1 == CR_WRITES - CR_FLUSHED - __builtin_popcount (s))
        match = s;
    }
    ck_assert_msg (match >= 0, "round %d: crash state is no subset of the "
                   "unflushed writes (seed %" PRIu64 ")", round, crash_seed);
    if (!seen[match])
      distinct++;
    seen[match] = true;
    remove_file (p1);
    remove_file (p2);
  }
  printf ("crash_random: %u distinct outcomes in 12 rounds\n", distinct);
  free (base);
  free (got);
  free (got2);
  free (model);
  free (tmp);
}
END_TEST

/* The revert of an older write must not clobber a newer write that was
 * kept: write A over [0,32K), then B over [16K,48K), unflushed.  The four
 * possible outcomes are base, A|base, A|B and base|B; the last one is the
 * case a naive "revert everything lost" gets wrong (it would put base
 * back over [16K,32K)).  Try seeds until each outcome has been seen. */
START_TEST (test_crash_overlap)
{
  struct rng r = rng_for ("crash_overlap");
  unsigned char *model[4], *got = malloc (CR_SIZE), *tmp = malloc (32 * KiB);
  unsigned seen = 0;

  /* model[kept A | kept B << 1] */
  for (unsigned m = 0; m < 4; m++) {
    model[m] = calloc (1, CR_SIZE);
    if (m & 1)
      fill (model[m], 32 * KiB, 0, 1);
    if (m & 2)
      fill (model[m] + 16 * KiB, 32 * KiB, 16 * KiB, 2);
  }
  for (int tries = 0; tries < 200 && seen != 0xf; tries++) {
    char *path = make_file (CR_SIZE);
    struct bcf_io *io = open_mode (path, loop_modes[_i]);
    struct bcf_io_faults f = { 0 };
    uint64_t s = rng_next (&r);
    unsigned char *buf = xbuf (32 * KiB);
    int n, m;

    bcf_io_set_faults (io, &f);
    fill (buf, 32 * KiB, 0, 1);
    ck_assert_int_eq (bcf_io_pwrite (io, buf, 32 * KiB, 0), 0);
    fill (buf, 32 * KiB, 16 * KiB, 2);
    ck_assert_int_eq (bcf_io_pwrite (io, buf, 32 * KiB, 16 * KiB), 0);
    n = bcf_io_crash (io, s, BCF_IO_CRASH_RANDOM);
    file_read (path, got, CR_SIZE, 0);
    for (m = 0; m < 4; m++)
      if (memcmp (got, model[m], CR_SIZE) == 0)
        break;
    ck_assert_msg (m < 4, "seed %" PRIu64 ": impossible crash state", s);
    ck_assert_int_eq (n, 2 - __builtin_popcount (m));
    if (m == 2 && !(seen & 4))
      printf ("crash_overlap: seed %" PRIu64 " lost A, kept B: ok\n", s);
    seen |= 1u << m;
    bcf_buf_free (buf, 32 * KiB);
    remove_file (path);
  }
  ck_assert_msg (seen == 0xf, "outcomes seen: %#x", seen);
  for (unsigned m = 0; m < 4; m++)
    free (model[m]);
  free (got);
  free (tmp);
}
END_TEST

/* ---- Block devices ------------------------------------------------------ */

/* A loop device, when we may make one (root, losetup, /dev/loop-control). */
START_TEST (test_blockdev)
{
  char *file, cmd[512], dev[128] = "";
  struct bcf_io_opts o = { .mode = loop_modes[_i] };
  struct bcf_io *io = NULL;
  unsigned bs = 0;
  uint64_t size = 0;
  bool isblk = false, direct = false;
  int r = -1, rw = -1, cmp = -1, busy = 0;
  FILE *fp;
  char err[256], err2[256] = "";

  if (geteuid () != 0 || access ("/dev/loop-control", W_OK) != 0) {
    printf ("blockdev: not root or no loop devices: skipped\n");
    return;
  }
  file = make_file (8 * MiB);
  snprintf (cmd, sizeof cmd,
            "losetup --find --show --sector-size 4096 %s 2>/dev/null || "
            "losetup --find --show %s 2>/dev/null", file, file);
  fp = popen (cmd, "r");
  if (fp == NULL || fgets (dev, sizeof dev, fp) == NULL)
    dev[0] = '\0';
  if (fp)
    pclose (fp);
  dev[strcspn (dev, "\n")] = '\0';
  if (dev[0] == '\0') {
    printf ("blockdev: losetup failed: skipped\n");
    remove_file (file);
    return;
  }
  o.path = dev;
  r = bcf_io_open (&o, &io, err, sizeof err);
  if (r == 0) {
    unsigned char *buf = xbuf (64 * KiB), *back = xbuf (64 * KiB);
    isblk = bcf_io_is_blockdev (io);
    size = bcf_io_size (io);
    bs = bcf_io_block_size (io);
    direct = bcf_io_direct (io);
    {
      struct bcf_io *io2 = NULL;
      busy = bcf_io_open (&o, &io2, err2, sizeof err2);   /* O_EXCL */
      bcf_io_close (io2);
    }
    fill (buf, 64 * KiB, MiB, 9);
    rw = bcf_io_pwrite (io, buf, 64 * KiB, MiB) || bcf_io_flush (io) ||
      bcf_io_pread (io, back, 64 * KiB, MiB);
    cmp = memcmp (buf, back, 64 * KiB);
    bcf_buf_free (buf, 64 * KiB);
    bcf_buf_free (back, 64 * KiB);
    bcf_io_close (io);
  }
  /* Detach before asserting, so a failure leaves no loop device behind. */
  snprintf (cmd, sizeof cmd, "losetup -d %s", dev);
  if (system (cmd) != 0)
    printf ("blockdev: %s failed\n", cmd);
  printf ("blockdev %s: size %" PRIu64 " block %u direct %d\n", dev, size,
          bs, direct);
  remove_file (file);
  ck_assert_msg (r == 0, "open %s: %s", dev, err);
  ck_assert (isblk);
  ck_assert_uint_eq (size, 8 * MiB);
  ck_assert (bs == 512 || bs == 4096);
  ck_assert (direct);
  ck_assert_int_eq (rw, 0);
  ck_assert_int_eq (cmp, 0);
  ck_assert_int_eq (busy, -EBUSY);
  ck_assert_msg (strstr (err2, "in use") != NULL, "%s", err2);
}
END_TEST

/* ---- Main --------------------------------------------------------------- */

static Suite *
io_suite (void)
{
  Suite *s = suite_create ("io");
  TCase *tc;

  tc = tcase_create ("pool");
  tcase_set_timeout (tc, 120);
  tcase_add_test (tc, test_buf_pool);
  tcase_add_test (tc, test_buf_pool_threads);
  suite_add_tcase (s, tc);

  tc = tcase_create ("io");
  tcase_set_timeout (tc, 120);
  tcase_add_loop_test (tc, test_roundtrip, 0, 2);
  tcase_add_loop_test (tc, test_many_segments, 0, 2);
  tcase_add_loop_test (tc, test_start_finish, 0, 2);
  tcase_add_loop_test (tc, test_unaligned, 0, 2);
  tcase_add_loop_test (tc, test_eof, 0, 2);
  tcase_add_loop_test (tc, test_flush_readonly, 0, 2);
  tcase_add_test (tc, test_direct_filesystems);
  tcase_add_loop_test (tc, test_direct_refused, 0, 2);
  tcase_add_test (tc, test_open_errors);
  tcase_add_test (tc, test_fence_previous_writer);
  tcase_add_test (tc, test_modes);
  tcase_add_loop_test (tc, test_threads, 0, 2);
  tcase_add_test (tc, test_fork);
  tcase_add_loop_test (tc, test_blockdev, 0, 2);
  suite_add_tcase (s, tc);

  tc = tcase_create ("faults");
  tcase_set_timeout (tc, 120);
  tcase_add_loop_test (tc, test_fail_nth, 0, 2);
  tcase_add_loop_test (tc, test_delay, 0, 2);
  tcase_add_loop_test (tc, test_power_cut, 0, 2);
  tcase_add_loop_test (tc, test_power_cut_batch, 0, 2);
  tcase_add_loop_test (tc, test_crash_flush_boundary, 0, 2);
  tcase_add_loop_test (tc, test_crash_fua, 0, 2);
  tcase_add_loop_test (tc, test_crash_random, 0, 2);
  tcase_add_loop_test (tc, test_crash_overlap, 0, 2);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  int r;

  seed = test_seed ("test-io");
  r = test_main (io_suite ());
  if (r)
    printf ("test-io: seed was %u\n", seed);
  return r;
}
