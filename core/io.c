/* bcachefilter engine: cache-device I/O (io_uring, O_DIRECT, sync fallback,
 * aligned buffer pool, fault injection).
 *
 * Design
 * ------
 * See core/io.h for the contract.  How it is built:
 *
 * Rings.  One io_uring per thread, created lazily by ring_get() and kept
 * in a __thread pointer; the same pointer is registered with a pthread
 * key whose destructor frees the ring when the thread exits.  A ring is
 * private to its thread, so no lock is ever taken around it.  Every call
 * waits for all it submitted before returning, so a ring is idle between
 * calls and serves every device the thread touches.  A child process
 * created by fork() must not share its parent's ring: a pthread_atfork
 * handler drops the child's copy (nbdkit forks to daemonize after the
 * cache may already have been read).
 *
 * Submission (uring_submit).  Each in-flight segment occupies a "slot" in
 * an array on the caller's stack, at most BCF_IO_RING_DEPTH of them; the
 * slot pointer is the SQE user data.  The ring is filled, submitted with
 * one io_uring_submit_and_wait, and refilled as completions are reaped, so
 * a request of any size streams through a fixed-depth ring.  A short
 * transfer is resubmitted for its remainder from the completion handler.
 * We never return while the kernel may still touch a caller's buffer: if
 * io_uring_enter fails in a way we cannot wait out, we abort.
 *
 * Sync path.  The same per-I/O bookkeeping (io_begin / io_end) around
 * pread / pwrite / fdatasync loops.
 *
 * Faults.  io_begin / io_end test io->armed once (an atomic flag, almost
 * always false); everything else about faults lives behind it.  The undo
 * log is an array of records, oldest first, under io->undo_lock.  A flush
 * is given an id when it starts, and every record whose write had already
 * completed is stamped with that id ("covered"); when a flush completes,
 * records covered by it or an earlier flush are durable and dropped.  A
 * write still in flight while a flush starts is not covered by it, like
 * on a real disk.  A FUA write (BCF_IO_WRITE_FUA, RWF_DSYNC) is durable
 * by itself once it completed: a crash keeps it whatever the mode.
 *
 * Buffer pool.  Nine free lists (4 KiB .. 1 MiB), each a singly linked
 * stack threaded through the free buffers themselves under its own mutex
 * (uncontended in practice: the critical section is two pointer moves).
 * Each list holds at most min(64, 8 MiB / size) buffers, so the pool
 * caches at most about 40 MiB.  Under AddressSanitizer cached buffers are
 * poisoned, so a use after bcf_buf_free is still caught.
 *
 * Locking summary: struct bcf_io is immutable after open except for
 * atomics (statistics, fault counters, the dead flag) and the undo log
 * (undo_lock).  Rings are thread-private.  Pool lists: one mutex each.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>

#include <linux/fs.h>
#include <liburing.h>

#include "bcachefilter/claim.h"
#include "io.h"
#include "util.h"

#if defined(__SANITIZE_ADDRESS__)
#define BCF_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define BCF_ASAN 1
#endif
#endif
#ifdef BCF_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION ((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION ((p), (n))
#else
#define POISON(p, n) ((void) (p), (void) (n))
#define UNPOISON(p, n) ((void) (p), (void) (n))
#endif

/* Largest single read/write handed to the kernel; Linux caps transfers at
 * just under 2 GiB anyway, and a short transfer is continued. */
#define MAX_CHUNK (1u << 30)
/* How often a transient -EAGAIN / -EINTR completion is retried. */
#define MAX_RETRIES 1000

/* ======================================================================
 * Aligned buffer pool
 * ====================================================================== */

#define BUF_MIN_SHIFT 12
#define BUF_MAX_SHIFT 20
#define BUF_CLASSES (BUF_MAX_SHIFT - BUF_MIN_SHIFT + 1)
#define BUF_CLASS_MAX_BUFFERS 64
#define BUF_CLASS_MAX_BYTES (8u << 20)

struct buf_class {
  pthread_mutex_t lock;
  void *head;                   /* first word of each buffer: next */
  unsigned count;
};

static struct buf_class buf_classes[BUF_CLASSES] = {
  [0 ... BUF_CLASSES - 1] = { .lock = PTHREAD_MUTEX_INITIALIZER },
};
static _Atomic uint64_t buf_allocs, buf_hits;

/* The free list for this size, or -1 if it is not pooled. */
static int
buf_class_of (size_t size)
{
  if (size < (1u << BUF_MIN_SHIFT) || size > (1u << BUF_MAX_SHIFT) ||
      (size & (size - 1)) != 0)
    return -1;
  return __builtin_ctzl (size) - BUF_MIN_SHIFT;
}

static unsigned
buf_class_cap (int c)
{
  unsigned cap = BUF_CLASS_MAX_BYTES >> (c + BUF_MIN_SHIFT);
  return cap < BUF_CLASS_MAX_BUFFERS ? cap : BUF_CLASS_MAX_BUFFERS;
}

void *
bcf_buf_alloc (size_t size)
{
  int c = buf_class_of (size);
  void *p = NULL;
  int r;

  if (size == 0) {
    errno = EINVAL;
    return NULL;
  }
  atomic_fetch_add_explicit (&buf_allocs, 1, memory_order_relaxed);
  if (c >= 0) {
    struct buf_class *bc = &buf_classes[c];
    pthread_mutex_lock (&bc->lock);
    p = bc->head;
    if (p) {
      bc->head = *(void **) p;
      bc->count--;
    }
    pthread_mutex_unlock (&bc->lock);
    if (p) {
      UNPOISON (p, size);
      atomic_fetch_add_explicit (&buf_hits, 1, memory_order_relaxed);
      return p;
    }
  }
  r = posix_memalign (&p, BCF_BUF_ALIGN, size);
  if (r != 0) {
    errno = r;
    return NULL;
  }
  return p;
}

void
bcf_buf_free (void *ptr, size_t size)
{
  int c = buf_class_of (size);

  if (ptr == NULL)
    return;
  if (c >= 0) {
    struct buf_class *bc = &buf_classes[c];
    bool cached = false;
    pthread_mutex_lock (&bc->lock);
    if (bc->count < buf_class_cap (c)) {
      *(void **) ptr = bc->head;
      bc->head = ptr;
      bc->count++;
      cached = true;
      /* Poison under the lock: once unlocked another thread may pop it. */
      POISON ((char *) ptr + sizeof (void *), size - sizeof (void *));
    }
    pthread_mutex_unlock (&bc->lock);
    if (cached)
      return;
  }
  free (ptr);
}

void
bcf_buf_stats (struct bcf_buf_stats *st)
{
  memset (st, 0, sizeof *st);
  st->allocs = atomic_load_explicit (&buf_allocs, memory_order_relaxed);
  st->pool_hits = atomic_load_explicit (&buf_hits, memory_order_relaxed);
  for (int c = 0; c < BUF_CLASSES; c++) {
    pthread_mutex_lock (&buf_classes[c].lock);
    st->cached_buffers += buf_classes[c].count;
    st->cached_bytes += (uint64_t) buf_classes[c].count << (c + BUF_MIN_SHIFT);
    pthread_mutex_unlock (&buf_classes[c].lock);
  }
}

void
bcf_buf_pool_trim (void)
{
  for (int c = 0; c < BUF_CLASSES; c++) {
    struct buf_class *bc = &buf_classes[c];
    void *p;
    pthread_mutex_lock (&bc->lock);
    p = bc->head;
    bc->head = NULL;
    bc->count = 0;
    pthread_mutex_unlock (&bc->lock);
    while (p) {
      void *next = *(void **) p;
      UNPOISON (p, (size_t) 1 << (c + BUF_MIN_SHIFT));
      free (p);
      p = next;
    }
  }
}

/* ======================================================================
 * The device
 * ====================================================================== */

enum kind { K_READ, K_WRITE, K_FLUSH };

/* One unflushed write, while faults are armed. */
struct undo_rec {
  uint64_t off;
  size_t len;
  void *old;                    /* the range's contents before the write */
  uint64_t cover;               /* id of the flush that makes it durable */
  bool completed;
  bool durable;                 /* a FUA write that completed: no crash
                                   undoes it */
};

struct bcf_io {
  int fd;
  char *path;
  const struct bcf_claim *claim;        /* writers: the device's claim */
  struct bcf_claim *own_claim;          /* ... if we took it ourselves */
  uint64_t size;
  unsigned block_size;
  bool readonly, direct, blockdev;
  enum bcf_io_mode mode;        /* BCF_IO_URING or BCF_IO_SYNC */
  bool may_fall_back;           /* opened with BCF_IO_AUTO */
  char notice[512];

  _Atomic uint64_t reads, writes, flushes;
  _Atomic uint64_t bytes_read, bytes_written;
  _Atomic uint64_t errors, errors_injected;

  /* Fault injection.  faults is written only by bcf_io_set_faults, before
   * armed is set (release), and read after armed is seen (acquire). */
  atomic_bool armed;
  struct bcf_io_faults faults;
  _Atomic uint64_t fault_ios, fault_writes;
  atomic_bool dead;

  /* The device changed under us (bcf_io_check): lost is set once, with
   * lost_why; blocks_peak is the most allocated space a file was seen
   * with (st_blocks, 512-byte units). */
  atomic_bool lost;
  char lost_why[256];
  pthread_mutex_t check_lock;
  uint64_t blocks_peak;

  pthread_mutex_t undo_lock;
  struct undo_rec **undo;       /* oldest first */
  size_t nundo, undo_cap;
  uint64_t flush_ids;

  /* Congestion (bcache's congested_read/write_threshold_us): thresholds
   * in microseconds (0 off), how congested the device is (<= 0, minus
   * the milliseconds of slowness not yet forgiven, as bcache's
   * c->congested) and when it was last slow (us, bcf_now_ns based). */
  _Atomic unsigned cong_read_us, cong_write_us;
  atomic_int congested;
  _Atomic uint64_t congested_last_us;
};

/* bcache's CONGESTED_MAX: the most slowness remembered, ms. */
#define CONGESTED_MAX 1024

/* Per-I/O state carried from io_begin to io_end. */
struct ioctx {
  struct bcf_io_seg *seg;       /* NULL for a flush */
  size_t done;                  /* bytes transferred so far */
  unsigned retries;
  bool armed;                   /* faults were armed at io_begin */
  bool cut;                     /* the power-cut write: die after it */
  struct undo_rec *rec;         /* this write's undo record */
  uint64_t flush_id;
  uint64_t t0;                  /* start (ns), when congestion is tracked */
};

static void __attribute__ ((format (printf, 3, 4)))
set_err (char *err, size_t errlen, const char *fmt, ...)
{
  va_list ap;

  if (err == NULL || errlen == 0)
    return;
  va_start (ap, fmt);
  vsnprintf (err, errlen, fmt, ap);
  va_end (ap);
}

static void __attribute__ ((format (printf, 2, 3)))
add_notice (struct bcf_io *io, const char *fmt, ...)
{
  size_t used = strlen (io->notice);
  va_list ap;

  if (used > 0 && used + 2 < sizeof io->notice) {
    strcpy (io->notice + used, "; ");
    used += 2;
  }
  va_start (ap, fmt);
  vsnprintf (io->notice + used, sizeof io->notice - used, fmt, ap);
  va_end (ap);
}

static inline void
count (_Atomic uint64_t *c, uint64_t n)
{
  atomic_fetch_add_explicit (c, n, memory_order_relaxed);
}

static inline uint64_t
load (_Atomic uint64_t *c)
{
  return atomic_load_explicit (c, memory_order_relaxed);
}

/* ---- Per-thread rings ------------------------------------------------- */

static pthread_key_t ring_key;
static pthread_once_t ring_once = PTHREAD_ONCE_INIT;
static int ring_key_err;
static atomic_bool ring_key_made;
static __thread struct io_uring *tls_ring;
static __thread int tls_ring_err;  /* this thread could not get a ring */
/* A batch bcf_io_start left in flight on this thread's ring: until its
 * bcf_io_finish, the thread's other I/O takes the synchronous path, so
 * that no wait sees the other's completions. */
static __thread const struct bcf_io_pending *tls_pending;
/* 0 unknown, 1 the kernel has every opcode we use, -errno if not. */
static atomic_int uring_ops;

/* ThreadSanitizer and ring memory.  liburing maps and unmaps a ring with
 * its own system calls, which TSan does not intercept, so it keeps the
 * shadow state of a finished thread's ring; a new thread's ring mapped
 * at the same address then looks like a racing access to that thread's
 * SQEs and CQ head (seen in CI: io_uring_prep_rw, io_uring_sqe_set_data,
 * io_uring_cq_advance, each against a "finished" thread).  The memory
 * really is handed over through the kernel, after the old ring's last
 * use: say so, with a release when a ring is freed and an acquire when
 * one is created, on one sync object. */
#if defined(__SANITIZE_THREAD__)
void __tsan_acquire (void *addr);
void __tsan_release (void *addr);
static char tsan_ring_sync;
static void tsan_ring_acquire (void) { __tsan_acquire (&tsan_ring_sync); }
static void tsan_ring_release (void) { __tsan_release (&tsan_ring_sync); }
#else
static void tsan_ring_acquire (void) { }
static void tsan_ring_release (void) { }
#endif

static void
ring_free (struct io_uring *ring, bool exit_ring)
{
  tsan_ring_release ();
  if (exit_ring)
    io_uring_queue_exit (ring);
  free (ring);
}

/* pthread key destructor: the thread is exiting. */
static void
ring_destructor (void *p)
{
  ring_free (p, true);
  tls_ring = NULL;
}

/* In a fork child: the ring is still the parent's (shared fd, shared
 * mappings).  Unmapping and closing our copies leaves the parent's intact. */
static void
ring_atfork_child (void)
{
  if (tls_ring) {
    ring_free (tls_ring, true);
    tls_ring = NULL;
    pthread_setspecific (ring_key, NULL);
  }
  tls_ring_err = 0;
}

static void
ring_init_once (void)
{
  ring_key_err = pthread_key_create (&ring_key, ring_destructor);
  if (ring_key_err == 0) {
    pthread_atfork (NULL, NULL, ring_atfork_child);
    atomic_store (&ring_key_made, true);
  }
}

/* When the filter is unloaded (dlclose) the key's destructor would point
 * into unmapped code for any thread that exits later, so delete the key:
 * such a thread then leaks its ring instead of crashing.  (glibc drops
 * the atfork handler of an unloaded object by itself.) */
static void __attribute__ ((destructor))
ring_unload (void)
{
  if (atomic_exchange (&ring_key_made, false))
    pthread_key_delete (ring_key);
}

/* Whether this kernel supports READ, WRITE and FSYNC (5.6+); checked
 * once, on the first ring made. */
static int
ring_check_ops (struct io_uring *ring)
{
  int ok = atomic_load (&uring_ops);
  struct io_uring_probe *probe;

  if (ok != 0)
    return ok < 0 ? ok : 0;
  probe = io_uring_get_probe_ring (ring);
  if (probe == NULL)
    ok = -ENOSYS;
  else {
    ok = io_uring_opcode_supported (probe, IORING_OP_READ) &&
      io_uring_opcode_supported (probe, IORING_OP_WRITE) &&
      io_uring_opcode_supported (probe, IORING_OP_FSYNC) ? 1 : -ENOSYS;
    io_uring_free_probe (probe);
  }
  atomic_store (&uring_ops, ok);
  return ok < 0 ? ok : 0;
}

static struct io_uring *
ring_create (int *errp)
{
  struct io_uring *ring = calloc (1, sizeof *ring);
  int r;

  if (ring == NULL) {
    *errp = ENOMEM;
    return NULL;
  }
  /* COOP_TASKRUN (5.19+) spares us interrupts: we always enter the
   * kernel to wait anyway.  Older kernels reject the flag. */
  r = io_uring_queue_init (BCF_IO_RING_DEPTH, ring, IORING_SETUP_COOP_TASKRUN);
  if (r == -EINVAL)
    r = io_uring_queue_init (BCF_IO_RING_DEPTH, ring, 0);
  if (r < 0) {
    ring_free (ring, false);
    *errp = -r;
    return NULL;
  }
  tsan_ring_acquire ();
  r = ring_check_ops (ring);
  if (r < 0) {
    ring_free (ring, true);
    *errp = -r;
    return NULL;
  }
  return ring;
}

/* The calling thread's ring, or NULL with *errp set. */
static struct io_uring *
ring_get (int *errp)
{
  struct io_uring *ring;

  if (__builtin_expect (tls_ring != NULL, 1))
    return tls_ring;
  if (tls_ring_err) {
    *errp = tls_ring_err;
    return NULL;
  }
  pthread_once (&ring_once, ring_init_once);
  if (ring_key_err) {
    *errp = tls_ring_err = ring_key_err;
    return NULL;
  }
  ring = ring_create (errp);
  if (ring == NULL) {
    tls_ring_err = *errp;
    return NULL;
  }
  if (pthread_setspecific (ring_key, ring) != 0) {
    ring_free (ring, true);
    *errp = tls_ring_err = ENOMEM;
    return NULL;
  }
  tls_ring = ring;
  return ring;
}

void
bcf_io_thread_cleanup (void)
{
  if (tls_ring) {
    pthread_setspecific (ring_key, NULL);
    ring_free (tls_ring, true);
    tls_ring = NULL;
  }
  tls_ring_err = 0;
}

/* ---- Fault layer ------------------------------------------------------ */

static void
undo_free (struct undo_rec *rec)
{
  free (rec->old);
  free (rec);
}

/* Drop the whole log.  Caller holds undo_lock. */
static void
undo_clear (struct bcf_io *io)
{
  for (size_t i = 0; i < io->nundo; i++)
    undo_free (io->undo[i]);
  free (io->undo);
  io->undo = NULL;
  io->nundo = io->undo_cap = 0;
}

static int
inject (struct bcf_io *io, int err)
{
  count (&io->errors_injected, 1);
  return -err;
}

static int full_pread (int fd, void *buf, size_t len, uint64_t off,
                       size_t *got);

/* Save the current contents of the range a write is about to replace.
 * Reads past EOF (a file shrunk underneath us) record zeroes. */
static int
undo_record (struct bcf_io *io, struct ioctx *c)
{
  struct bcf_io_seg *seg = c->seg;
  struct undo_rec *rec;
  size_t got = 0;
  int r;

  rec = calloc (1, sizeof *rec);
  if (rec == NULL)
    return -ENOMEM;
  rec->off = seg->off;
  rec->len = seg->len;
  /* Aligned, since io->fd may be O_DIRECT. */
  r = posix_memalign (&rec->old, io->block_size, seg->len);
  if (r != 0) {
    free (rec);
    return -r;
  }
  r = full_pread (io->fd, rec->old, seg->len, seg->off, &got);
  if (r < 0 && r != -EIO) {
    undo_free (rec);
    return r;
  }
  memset ((char *) rec->old + got, 0, seg->len - got);

  pthread_mutex_lock (&io->undo_lock);
  if (io->nundo == io->undo_cap) {
    size_t cap = io->undo_cap ? io->undo_cap * 2 : 64;
    struct undo_rec **a = realloc (io->undo, cap * sizeof *a);
    if (a == NULL) {
      pthread_mutex_unlock (&io->undo_lock);
      undo_free (rec);
      return -ENOMEM;
    }
    io->undo = a;
    io->undo_cap = cap;
  }
  io->undo[io->nundo++] = rec;
  pthread_mutex_unlock (&io->undo_lock);
  c->rec = rec;
  return 0;
}

/* A flush starts: it will make durable every write completed by now. */
static uint64_t
undo_flush_begin (struct bcf_io *io)
{
  uint64_t id;

  pthread_mutex_lock (&io->undo_lock);
  id = ++io->flush_ids;
  for (size_t i = 0; i < io->nundo; i++)
    if (io->undo[i]->completed && io->undo[i]->cover == 0)
      io->undo[i]->cover = id;
  pthread_mutex_unlock (&io->undo_lock);
  return id;
}

/* A flush completed: forget the writes it (or an earlier flush, which
 * started before it) covered. */
static void
undo_flush_done (struct bcf_io *io, uint64_t id)
{
  size_t j = 0;

  pthread_mutex_lock (&io->undo_lock);
  for (size_t i = 0; i < io->nundo; i++) {
    struct undo_rec *rec = io->undo[i];
    if (rec->cover != 0 && rec->cover <= id)
      undo_free (rec);
    else
      io->undo[j++] = rec;
  }
  io->nundo = j;
  pthread_mutex_unlock (&io->undo_lock);
}

/* Armed path of io_begin: decide whether this I/O fails, and prepare the
 * bookkeeping of one that goes ahead. */
static int __attribute__ ((noinline))
fault_begin (struct bcf_io *io, enum kind k, struct ioctx *c)
{
  const struct bcf_io_faults *f = &io->faults;
  uint64_t idx = 0;

  c->armed = true;
  if (!f->fail_writes_only || k == K_WRITE)
    idx = atomic_fetch_add (&io->fault_ios, 1) + 1;
  if (f->delay_us) {
    struct timespec ts = { .tv_sec = f->delay_us / 1000000,
                           .tv_nsec = (f->delay_us % 1000000) * 1000L };
    while (nanosleep (&ts, &ts) == -1 && errno == EINTR)
      ;
  }
  if (atomic_load (&io->dead))
    return inject (io, EIO);
  if (idx && (idx == f->fail_nth ||
              (f->fail_every && idx % f->fail_every == 0)))
    return inject (io, f->error ? f->error : EIO);

  switch (k) {
  case K_WRITE:
    if (f->power_cut_after_write) {
      uint64_t w = atomic_fetch_add (&io->fault_writes, 1) + 1;
      if (w > f->power_cut_after_write)
        return inject (io, EIO);
      c->cut = w == f->power_cut_after_write;
    }
    return undo_record (io, c);
  case K_FLUSH:
    c->flush_id = undo_flush_begin (io);
    return 0;
  case K_READ:
    return 0;
  }
  return 0;
}

static void __attribute__ ((noinline))
fault_end (struct bcf_io *io, enum kind k, struct ioctx *c, int result)
{
  if (k == K_WRITE && c->rec) {
    /* Even a failed write may have changed the range: keep the record. */
    pthread_mutex_lock (&io->undo_lock);
    c->rec->completed = true;
    if (result == 0 && c->seg->op == BCF_IO_WRITE_FUA)
      c->rec->durable = true;
    pthread_mutex_unlock (&io->undo_lock);
  }
  if (k == K_FLUSH && result == 0)
    undo_flush_done (io, c->flush_id);
  if (c->cut)
    atomic_store (&io->dead, true);
}

/* ---- Per-I/O bookkeeping ---------------------------------------------- */

static inline enum kind
seg_kind (const struct bcf_io_seg *seg)
{
  return seg->op == BCF_IO_READ ? K_READ : K_WRITE;
}

/* The threshold (us) an I/O of kind k is judged by, 0 if none. */
static inline unsigned
congestion_threshold (struct bcf_io *io, enum kind k)
{
  return k == K_READ
    ? atomic_load_explicit (&io->cong_read_us, memory_order_relaxed)
    : atomic_load_explicit (&io->cong_write_us, memory_order_relaxed);
}

/* bcache's bch_bbio_count_io_errors, its congestion part: an I/O slower
 * than its threshold makes the device congested by its latency in ms
 * (about: us / 1024, as bcache), up to CONGESTED_MAX in all; a fast one
 * forgives one ms.  The updates are not atomic as a whole (nor are
 * bcache's): a lost update only shifts the estimate a little. */
static void
congestion_account (struct bcf_io *io, enum kind k, uint64_t t0)
{
  const uint64_t now = bcf_now_ns ();
  const int64_t us = (int64_t) (now - t0) / 1000;
  int congested = atomic_load_explicit (&io->congested, memory_order_relaxed);

  if (us > (int64_t) congestion_threshold (io, k)) {
    int ms = (int) (us / 1024);
    if (ms > CONGESTED_MAX + congested)
      ms = CONGESTED_MAX + congested;
    atomic_store_explicit (&io->congested_last_us, now / 1000,
                           memory_order_relaxed);
    atomic_fetch_sub_explicit (&io->congested, ms, memory_order_relaxed);
  }
  else if (congested < 0)
    atomic_fetch_add_explicit (&io->congested, 1, memory_order_relaxed);
}

/* Before an I/O: returns 0 to go ahead, or the -errno it fails with. */
static inline int
io_begin (struct bcf_io *io, enum kind k, struct ioctx *c)
{
  c->t0 = congestion_threshold (io, k) ? bcf_now_ns () : 0;
  if (__builtin_expect (atomic_load_explicit (&io->armed,
                                              memory_order_acquire), 0))
    return fault_begin (io, k, c);
  return 0;
}

/* After an I/O that io_begin let through. */
static inline void
io_end (struct bcf_io *io, enum kind k, struct ioctx *c, int result)
{
  if (c->t0)
    congestion_account (io, k, c->t0);
  if (result < 0) {
    count (&io->errors, 1);
    /* A short read or write (-EIO from a file that shrank) or any other
     * failure: is the device still what we opened? */
    if (!c->armed)
      bcf_io_check (io);
  }
  else if (k == K_READ) {
    count (&io->reads, 1);
    count (&io->bytes_read, c->seg->len);
  }
  else if (k == K_WRITE) {
    count (&io->writes, 1);
    count (&io->bytes_written, c->seg->len);
  }
  else
    count (&io->flushes, 1);
  if (__builtin_expect (c->armed, 0))
    fault_end (io, k, c, result);
}

/* ---- Synchronous path ------------------------------------------------- */

/* Read len bytes, continuing short reads.  *got (if given) says how many
 * arrived; reaching EOF first is -EIO. */
static int
full_pread (int fd, void *buf, size_t len, uint64_t off, size_t *got)
{
  size_t done = 0;
  unsigned retries = 0;
  int r = 0;

  while (done < len) {
    size_t chunk = len - done < MAX_CHUNK ? len - done : MAX_CHUNK;
    ssize_t n = pread (fd, (char *) buf + done, chunk, off + done);
    if (n < 0) {
      if (errno == EINTR || (errno == EAGAIN && retries++ < MAX_RETRIES))
        continue;
      r = -errno;
      break;
    }
    if (n == 0) {
      r = -EIO;
      break;
    }
    done += n;
  }
  if (got)
    *got = done;
  return r;
}

static int
full_pwrite (int fd, const void *buf, size_t len, uint64_t off, int flags)
{
  size_t done = 0;
  unsigned retries = 0;

  while (done < len) {
    size_t chunk = len - done < MAX_CHUNK ? len - done : MAX_CHUNK;
    struct iovec iov = { .iov_base = (char *) buf + done, .iov_len = chunk };
    ssize_t n = pwritev2 (fd, &iov, 1, (off_t) (off + done), flags);
    if (n < 0) {
      if (errno == EINTR || (errno == EAGAIN && retries++ < MAX_RETRIES))
        continue;
      return -errno;
    }
    if (n == 0)
      return -EIO;              /* no progress: never spin */
    done += n;
  }
  return 0;
}

static void
sync_submit (struct bcf_io *io, struct bcf_io_seg *segs, unsigned n)
{
  for (unsigned i = 0; i < n; i++) {
    struct bcf_io_seg *seg = &segs[i];
    struct ioctx c = { .seg = seg };
    enum kind k = seg_kind (seg);
    int r;

    if (seg->len == 0) {
      seg->result = 0;
      continue;
    }
    r = io_begin (io, k, &c);
    if (r < 0) {
      seg->result = r;
      continue;
    }
    if (k == K_READ)
      r = full_pread (io->fd, seg->buf, seg->len, seg->off, NULL);
    else
      r = full_pwrite (io->fd, seg->buf, seg->len, seg->off,
                       seg->op == BCF_IO_WRITE_FUA ? RWF_DSYNC : 0);
    seg->result = r;
    io_end (io, k, &c, r);
  }
}

static int
sync_flush (struct bcf_io *io)
{
  while (fdatasync (io->fd) == -1) {
    if (errno != EINTR)
      return -errno;
  }
  return 0;
}

/* ---- io_uring path ---------------------------------------------------- */

struct uring_batch {
  struct bcf_io *io;
  struct io_uring *ring;
  struct ioctx slots[BCF_IO_RING_DEPTH];
  unsigned free_slots[BCF_IO_RING_DEPTH];
  unsigned nfree;
};

static struct io_uring_sqe *
get_sqe (struct io_uring *ring)
{
  struct io_uring_sqe *sqe = io_uring_get_sqe (ring);

  /* Never: at most BCF_IO_RING_DEPTH requests are outstanding, and that
   * is the SQ size. */
  if (sqe == NULL) {
    fprintf (stderr, "bcachefilter: io: submission queue overflow\n");
    abort ();
  }
  return sqe;
}

/* Queue (the rest of) a slot's transfer. */
static void
slot_prep (struct uring_batch *b, struct ioctx *c)
{
  struct bcf_io_seg *seg = c->seg;
  struct io_uring_sqe *sqe = get_sqe (b->ring);
  size_t left = seg->len - c->done;
  unsigned chunk = left < MAX_CHUNK ? left : MAX_CHUNK;

  if (seg->op == BCF_IO_READ)
    io_uring_prep_read (sqe, b->io->fd, (char *) seg->buf + c->done, chunk,
                        seg->off + c->done);
  else {
    io_uring_prep_write (sqe, b->io->fd, (char *) seg->buf + c->done, chunk,
                         seg->off + c->done);
    if (seg->op == BCF_IO_WRITE_FUA)
      sqe->rw_flags = RWF_DSYNC;
  }
  io_uring_sqe_set_data (sqe, c);
}

static void
slot_finish (struct uring_batch *b, struct ioctx *c, int r)
{
  c->seg->result = r;
  io_end (b->io, seg_kind (c->seg), c, r);
  b->free_slots[b->nfree++] = c - b->slots;
}

static void
slot_complete (struct uring_batch *b, struct ioctx *c, int res)
{
  if ((res == -EAGAIN || res == -EINTR) && c->retries++ < MAX_RETRIES)
    slot_prep (b, c);
  else if (res < 0)
    slot_finish (b, c, res);
  else if (res == 0)
    slot_finish (b, c, -EIO);   /* EOF, or no progress */
  else {
    c->done += res;
    if (c->done < c->seg->len)
      slot_prep (b, c);
    else
      slot_finish (b, c, 0);
  }
}

/* Submit what is queued and wait for at least one completion.  Transient
 * failures are waited out; anything else leaves requests we cannot reclaim
 * referencing the caller's memory, so it is fatal. */
static void
ring_submit_wait (struct io_uring *ring)
{
  for (;;) {
    int r = io_uring_submit_and_wait (ring, 1);
    if (r >= 0 || r == -EINTR)
      return;
    if (r == -EAGAIN || r == -EBUSY || r == -ENOMEM) {
      struct timespec ts = { 0, 1000000 };
      nanosleep (&ts, NULL);
      if (io_uring_cq_ready (ring))
        return;
      continue;
    }
    fprintf (stderr, "bcachefilter: io: io_uring_enter: %s\n", strerror (-r));
    abort ();
  }
}

static void
batch_init (struct uring_batch *b, struct bcf_io *io, struct io_uring *ring)
{
  b->io = io;
  b->ring = ring;
  b->nfree = BCF_IO_RING_DEPTH;
  for (unsigned i = 0; i < BCF_IO_RING_DEPTH; i++)
    b->free_slots[i] = BCF_IO_RING_DEPTH - 1 - i;
}

/* Queue segments from *next into every free slot.  Returns whether
 * anything is queued or in flight. */
static bool
batch_fill (struct uring_batch *b, struct bcf_io_seg *segs, unsigned n,
            unsigned *next)
{
  while (*next < n && b->nfree > 0) {
    struct bcf_io_seg *seg = &segs[(*next)++];
    struct ioctx *c;
    int r;

    if (seg->len == 0) {
      seg->result = 0;
      continue;
    }
    c = &b->slots[b->free_slots[b->nfree - 1]];
    *c = (struct ioctx) { .seg = seg };
    r = io_begin (b->io, seg_kind (seg), c);
    if (r < 0) {
      seg->result = r;
      continue;
    }
    b->nfree--;
    slot_prep (b, c);
  }
  return b->nfree < BCF_IO_RING_DEPTH;
}

/* Submit, wait for at least one completion and handle what arrived. */
static void
batch_reap (struct uring_batch *b)
{
  struct io_uring_cqe *cqe;
  unsigned head, seen = 0;

  ring_submit_wait (b->ring);
  io_uring_for_each_cqe (b->ring, head, cqe) {
    slot_complete (b, io_uring_cqe_get_data (cqe), cqe->res);
    seen++;
  }
  io_uring_cq_advance (b->ring, seen);
}

static void
uring_submit (struct bcf_io *io, struct io_uring *ring,
              struct bcf_io_seg *segs, unsigned n)
{
  struct uring_batch b;
  unsigned next = 0;

  batch_init (&b, io, ring);
  while (batch_fill (&b, segs, n, &next))
    batch_reap (&b);
}

static int
uring_flush (struct bcf_io *io, struct io_uring *ring)
{
  unsigned retries = 0;

  for (;;) {
    struct io_uring_sqe *sqe = get_sqe (ring);
    struct io_uring_cqe *cqe;
    int res;

    io_uring_prep_fsync (sqe, io->fd, IORING_FSYNC_DATASYNC);
    io_uring_sqe_set_data (sqe, NULL);
    do
      ring_submit_wait (ring);
    while (io_uring_peek_cqe (ring, &cqe) != 0);
    res = cqe->res;
    io_uring_cqe_seen (ring, cqe);
    if ((res == -EAGAIN || res == -EINTR) && retries++ < MAX_RETRIES)
      continue;
    return res < 0 ? res : 0;
  }
}

/* ---- Public I/O entry points ------------------------------------------ */

/* The ring to use, or NULL for the sync path; *errp set if neither. */
static struct io_uring *
pick_ring (struct bcf_io *io, int *errp)
{
  struct io_uring *ring;

  *errp = 0;
  if (io->mode == BCF_IO_SYNC || tls_pending)
    return NULL;
  ring = ring_get (errp);
  if (ring == NULL && io->may_fall_back)
    *errp = 0;                  /* this thread goes sync */
  return ring;
}

/* Check every segment against the contract in io.h, before any I/O. */
static int
validate (const struct bcf_io *io, struct bcf_io_seg *segs, unsigned n)
{
  uint64_t bs = io->block_size;
  int first = 0;

  for (unsigned i = 0; i < n; i++) {
    const struct bcf_io_seg *s = &segs[i];
    int r = 0;

    if (s->op != BCF_IO_READ && s->op != BCF_IO_WRITE &&
        s->op != BCF_IO_WRITE_FUA)
      r = -EINVAL;
    else if (s->op != BCF_IO_READ && io->readonly)
      r = -EROFS;
    else if (s->len % bs || s->off % bs ||
             (s->len && (uintptr_t) s->buf % bs) ||
             s->off > io->size || s->len > io->size - s->off)
      r = -EINVAL;
    segs[i].result = r;
    if (r < 0 && first == 0)
      first = r;
  }
  if (first < 0)
    for (unsigned i = 0; i < n; i++)
      if (segs[i].result == 0)
        segs[i].result = -ECANCELED;
  return first;
}

/* The first failed segment's result, or 0. */
static int
first_error (const struct bcf_io_seg *segs, unsigned n)
{
  for (unsigned i = 0; i < n; i++)
    if (segs[i].result < 0)
      return segs[i].result;
  return 0;
}

int
bcf_io_submit (struct bcf_io *io, struct bcf_io_seg *segs, unsigned n)
{
  struct io_uring *ring;
  int r;

  r = validate (io, segs, n);
  if (r < 0)
    return r;
  ring = pick_ring (io, &r);
  if (r) {
    for (unsigned i = 0; i < n; i++)
      segs[i].result = -r;
    return n ? -r : 0;
  }
  if (ring)
    uring_submit (io, ring, segs, n);
  else
    sync_submit (io, segs, n);
  return first_error (segs, n);
}

void
bcf_io_start (struct bcf_io *io, struct bcf_io_seg *segs, unsigned n,
              struct bcf_io_pending *p)
{
  struct uring_batch *b = NULL;
  struct io_uring *ring;
  int r;

  *p = (struct bcf_io_pending) { .io = io, .segs = segs, .n = n };
  if (validate (io, segs, n) < 0)
    return;
  ring = pick_ring (io, &r);
  if (r) {
    for (unsigned i = 0; i < n; i++)
      segs[i].result = -r;
    return;
  }
  if (ring && (b = malloc (sizeof *b)) != NULL) {
    batch_init (b, io, ring);
    if (batch_fill (b, segs, n, &p->next)) {
      /* Transient failures leave the entries queued: bcf_io_finish's
       * first wait submits them. */
      (void) io_uring_submit (ring);
      p->batch = b;
      tls_pending = p;
      return;
    }
    free (b);                   /* nothing needed I/O */
    return;
  }
  sync_submit (io, segs, n);    /* no ring, or no memory for the batch */
}

int
bcf_io_finish (struct bcf_io_pending *p)
{
  struct uring_batch *b = p->batch;

  if (b) {
    do
      batch_reap (b);
    while (batch_fill (b, p->segs, p->n, &p->next));
    free (b);
    p->batch = NULL;
    tls_pending = NULL;
  }
  return first_error (p->segs, p->n);
}

int
bcf_io_pread (struct bcf_io *io, void *buf, size_t len, uint64_t off)
{
  struct bcf_io_seg seg = { .op = BCF_IO_READ, .buf = buf, .len = len,
                            .off = off };
  return bcf_io_submit (io, &seg, 1);
}

static int
write_one (struct bcf_io *io, enum bcf_io_op op, const void *buf, size_t len,
           uint64_t off)
{
  /* The segment's buffer is not const because reads share the struct;
   * a write never stores through it. */
  struct bcf_io_seg seg = { .op = op, .buf = (void *) buf, .len = len,
                            .off = off };
  return bcf_io_submit (io, &seg, 1);
}

int
bcf_io_pwrite (struct bcf_io *io, const void *buf, size_t len, uint64_t off)
{
  return write_one (io, BCF_IO_WRITE, buf, len, off);
}

int
bcf_io_pwrite_fua (struct bcf_io *io, const void *buf, size_t len,
                   uint64_t off)
{
  return write_one (io, BCF_IO_WRITE_FUA, buf, len, off);
}

int
bcf_io_flush (struct bcf_io *io)
{
  struct ioctx c = { 0 };
  struct io_uring *ring;
  int r;

  ring = pick_ring (io, &r);
  if (r)
    return -r;
  r = io_begin (io, K_FLUSH, &c);
  if (r < 0)
    return r;
  r = ring ? uring_flush (io, ring) : sync_flush (io);
  io_end (io, K_FLUSH, &c, r);
  return r;
}

/* ---- Open / close ----------------------------------------------------- */

/* Read one block at offset 0 through the O_DIRECT fd: 0 if accepted, or
 * the -errno.  An empty file accepts anything. */
static int
probe_direct (int fd, unsigned bs)
{
  CLEANUP_FREE void *buf = NULL;
  ssize_t n;

  if (posix_memalign (&buf, BCF_BUF_ALIGN, bs) != 0)
    return -ENOMEM;
  do
    n = pread (fd, buf, bs, 0);
  while (n == -1 && errno == EINTR);
  return n < 0 ? -errno : 0;
}

/* The descriptor for I/O.  No O_EXCL for block devices: a writer's
 * claim (core/claim.c) holds the device exclusively already, and a second
 * exclusive open would conflict with it. */
static int
open_fd (const struct bcf_io_opts *opts, bool direct)
{
  int flags = (opts->readonly ? O_RDONLY : O_RDWR) | O_CLOEXEC;

  if (direct) {
    if (opts->test_flags & BCF_IO_TEST_REFUSE_DIRECT) {
      errno = EINVAL;
      return -1;
    }
    flags |= O_DIRECT;
  }
  return open (opts->path, flags);
}

/* O_DIRECT was refused: go buffered, or fail if it was required. */
static int
direct_refused (struct bcf_io *io, const struct bcf_io_opts *opts,
                char *err, size_t errlen)
{
  if (opts->direct == BCF_IO_DIRECT_REQUIRE) {
    set_err (err, errlen,
             "O_DIRECT refused on %s (filesystem does not support it)",
             opts->path);
    return -EINVAL;
  }
  if (io->fd >= 0)
    close (io->fd);
  io->direct = false;
  io->fd = open_fd (opts, false);
  if (io->fd < 0) {
    int r = -errno;
    set_err (err, errlen, "cannot open %s: %s", opts->path, strerror (errno));
    return r;
  }
  add_notice (io, "O_DIRECT refused on %s (filesystem does not support it); "
              "using buffered I/O with fdatasync", opts->path);
  return 0;
}

/* Size and logical block size; settles O_DIRECT for regular files. */
static int
probe_geometry (struct bcf_io *io, const struct bcf_io_opts *opts,
                char *err, size_t errlen)
{
  struct stat st;
  int r;

  if (fstat (io->fd, &st) == -1) {
    r = -errno;
    set_err (err, errlen, "cannot stat %s: %s", io->path, strerror (errno));
    return r;
  }
  if (S_ISBLK (st.st_mode)) {
    uint64_t size;
    int ssz;
    if (ioctl (io->fd, BLKGETSIZE64, &size) == -1 ||
        ioctl (io->fd, BLKSSZGET, &ssz) == -1) {
      r = -errno;
      set_err (err, errlen, "cannot get the size of block device %s: %s",
               io->path, strerror (errno));
      return r;
    }
    io->blockdev = true;
    io->size = size;
    io->block_size = ssz > 0 ? ssz : 512;
    return 0;
  }
  if (!S_ISREG (st.st_mode)) {
    set_err (err, errlen, "%s: not a regular file or block device",
             io->path);
    return -EINVAL;
  }
  io->size = st.st_size;
  io->block_size = 512;
  if (io->direct) {
    /* Some filesystems accept O_DIRECT at open and refuse the I/O. */
    r = probe_direct (io->fd, 512);
    if (r == -EINVAL) {
      io->block_size = 4096;
      r = probe_direct (io->fd, 4096);
    }
    if (r == -EINVAL) {
      io->block_size = 512;
      r = direct_refused (io, opts, err, errlen);
    }
    if (r < 0 && err && err[0] == '\0')
      set_err (err, errlen, "cannot read %s: %s", io->path, strerror (-r));
    if (r < 0)
      return r;
  }
  return 0;
}

static int
pick_mode (struct bcf_io *io, const struct bcf_io_opts *opts,
           char *err, size_t errlen)
{
  int e = 0;

  io->mode = opts->mode == BCF_IO_SYNC ? BCF_IO_SYNC : BCF_IO_URING;
  io->may_fall_back = opts->mode == BCF_IO_AUTO;
  /* Without O_DIRECT, io_uring hands each write, and each read the page
   * cache misses, to an io-wq worker thread (a buffered write may block on
   * the inode's lock): two thread switches per I/O, where pwrite is a copy
   * into the page cache.  So auto takes the sync path there (same-hour
   * runs, docs/BENCHMARKS.md, stop 27: hits 1.4 x the IOPS, writeback
   * rmw 1.4 x, mixed 1.3-1.5 x, writethrough rmw 0.78 -> 0.96 x the
   * pass-through proxy). */
  if (opts->mode == BCF_IO_AUTO && !io->direct)
    io->mode = BCF_IO_SYNC;
  if (io->mode == BCF_IO_SYNC)
    return 0;
  if (opts->test_flags & BCF_IO_TEST_NO_URING)
    e = ENOSYS;
  else if (ring_get (&e) != NULL)
    return 0;
  if (!io->may_fall_back) {
    set_err (err, errlen, "io_uring unavailable for %s: %s",
             io->path, strerror (e));
    return -e;
  }
  io->mode = BCF_IO_SYNC;
  add_notice (io, "io_uring unavailable (%s); using synchronous "
              "pread/pwrite", strerror (e));
  return 0;
}

/* The fence against a previous writer's I/O.  The claim (core/claim.c)
 * is a separate descriptor, and a process killed with I/O in flight
 * closes it at once, while the kernel finishes that I/O afterwards: a
 * killed process's io_uring requests are cancelled or completed by a
 * kernel worker after the process is gone, and a buffered write already
 * running there lands when it lands.  A restarted proxy that claimed the
 * cache and read its journal meanwhile would have a late journal or node
 * write of the dead process land over what it wrote itself.  So every
 * writer also holds an OFD write lock (F_OFD_SETLK, independent of the
 * claim's flock) on the descriptor its I/O uses: such a lock belongs to
 * the open file description and goes away only when the last reference
 * to it does, and every request in flight holds one.  Taking it waits
 * until nothing of the previous writer's can touch the device any more.
 * Filesystems without locks (ENOLCK, EINVAL) have no fence. */
#define FENCE_WAIT_MS 60000

static int
fence_previous_writer (struct bcf_io *io, char *err, size_t errlen)
{
  struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
  unsigned waited = 0;

  for (;;) {
    if (fcntl (io->fd, F_OFD_SETLK, &fl) == 0)
      break;
    if (errno == ENOLCK || errno == EINVAL)
      return 0;
    if (errno != EAGAIN && errno != EACCES) {
      set_err (err, errlen, "cannot lock %s: %s", io->path, strerror (errno));
      return -errno;
    }
    if (waited >= FENCE_WAIT_MS) {
      set_err (err, errlen, "%s: the I/O of a previous process on this "
               "cache has not finished after %u s (a process stuck in the "
               "kernel? see the processes that have it open: fuser %s)",
               io->path, FENCE_WAIT_MS / 1000, io->path);
      return -EBUSY;
    }
    usleep (10000);
    waited += 10;
  }
  if (waited)
    add_notice (io, "waited %u ms for the writes of a previous process on "
                "%s to finish", waited, io->path);
  return 0;
}

int
bcf_io_open (const struct bcf_io_opts *opts, struct bcf_io **iop,
             char *err, size_t errlen)
{
  struct bcf_io *io;
  int r;

  *iop = NULL;
  set_err (err, errlen, "%s", "");
  if (opts->path == NULL || opts->path[0] == '\0') {
    set_err (err, errlen, "no cache device path given");
    return -EINVAL;
  }

  io = calloc (1, sizeof *io);
  if (io == NULL || (io->path = strdup (opts->path)) == NULL) {
    free (io);
    set_err (err, errlen, "out of memory");
    return -ENOMEM;
  }
  /* A writer claims the device before anything is read or written (and
   * creates the file if asked), unless its caller holds a claim. */
  io->claim = opts->claim;
  if (!opts->readonly && !io->claim) {
    r = bcf_claim_open (opts->path, opts->create_size, &io->own_claim,
                        err, errlen);
    if (r < 0) {
      free (io->path);
      free (io);
      return r;
    }
    io->claim = io->own_claim;
  }
  pthread_mutex_init (&io->undo_lock, NULL);
  pthread_mutex_init (&io->check_lock, NULL);
  io->readonly = opts->readonly;
  io->direct = opts->direct != BCF_IO_DIRECT_OFF;
  io->fd = open_fd (opts, io->direct);
  if (io->fd < 0 && errno == EINVAL && io->direct)
    r = direct_refused (io, opts, err, errlen);
  else if (io->fd < 0) {
    r = -errno;
    set_err (err, errlen, "cannot open %s: %s%s", opts->path, strerror (errno),
             errno == EBUSY ? " (mounted or in use by another program)" : "");
  }
  else
    r = 0;
  if (r == 0 && io->claim && !bcf_claim_covers_fd (io->claim, io->fd)) {
    set_err (err, errlen, "%s is no longer the file or device claimed as "
             "%s (replaced meanwhile?)", opts->path,
             bcf_claim_path (io->claim));
    r = -ESTALE;
  }
  if (r == 0 && !io->readonly)
    r = fence_previous_writer (io, err, errlen);
  if (r == 0)
    r = probe_geometry (io, opts, err, errlen);
  if (r == 0)
    r = pick_mode (io, opts, err, errlen);
  if (r < 0) {
    bcf_io_close (io);
    return r;
  }
  io->size -= io->size % io->block_size;
  bcf_io_check (io);              /* the allocated space, as we found it */
  *iop = io;
  return 0;
}

int
bcf_io_close (struct bcf_io *io)
{
  int r = 0;

  if (io == NULL)
    return 0;
  if (io->fd >= 0 && close (io->fd) == -1)
    r = -errno;
  undo_clear (io);
  pthread_mutex_destroy (&io->undo_lock);
  pthread_mutex_destroy (&io->check_lock);
  bcf_claim_release (io->own_claim);
  free (io->path);
  free (io);
  return r;
}

/* ---- Accessors -------------------------------------------------------- */

uint64_t bcf_io_size (const struct bcf_io *io) { return io->size; }
unsigned bcf_io_block_size (const struct bcf_io *io) { return io->block_size; }
const char *bcf_io_path (const struct bcf_io *io) { return io->path; }
bool bcf_io_readonly (const struct bcf_io *io) { return io->readonly; }
bool bcf_io_is_blockdev (const struct bcf_io *io) { return io->blockdev; }
bool bcf_io_direct (const struct bcf_io *io) { return io->direct; }

const char *
bcf_io_mode_name (const struct bcf_io *io)
{
  return io->mode == BCF_IO_URING ? "uring" : "sync";
}

const char *
bcf_io_notice (const struct bcf_io *io)
{
  return io->notice[0] ? io->notice : NULL;
}

/* ---- The device changing under us ------------------------------------ */

static void
mark_lost (struct bcf_io *io, const char *fmt, ...)
  __attribute__ ((format (printf, 2, 3)));

/* Under check_lock. */
static void
mark_lost (struct bcf_io *io, const char *fmt, ...)
{
  va_list ap;

  if (atomic_load (&io->lost))
    return;
  va_start (ap, fmt);
  vsnprintf (io->lost_why, sizeof io->lost_why, fmt, ap);
  va_end (ap);
  atomic_store_explicit (&io->lost, true, memory_order_release);
}

/* Space a file may lose without being taken for changed: filesystems
 * that deallocate on their own (speculative preallocation, compression)
 * move a little; a truncation loses far more. */
static uint64_t
blocks_slack (const struct bcf_io *io)
{
  uint64_t slack = io->size / 32 / 512;

  return slack > 2048 ? slack : 2048;   /* at least 1 MiB */
}

int
bcf_io_check (struct bcf_io *io)
{
  struct stat st;
  uint64_t size;

  if (atomic_load_explicit (&io->lost, memory_order_acquire))
    return -ENXIO;
  pthread_mutex_lock (&io->check_lock);
  if (fstat (io->fd, &st) == -1)
    goto out;
  if (io->blockdev) {
    if (ioctl (io->fd, BLKGETSIZE64, &size) == -1)
      goto out;
  }
  else
    size = (uint64_t) st.st_size;
  if (size < io->size)
    mark_lost (io, "%s shrank from %" PRIu64 " to %" PRIu64 " bytes under "
               "us (truncated, or resized?)", io->path, io->size, size);
  else if (!io->blockdev) {
    uint64_t blocks = (uint64_t) st.st_blocks;

    if (blocks + blocks_slack (io) < io->blocks_peak)
      mark_lost (io, "%s lost %" PRIu64 " of its %" PRIu64 " allocated "
                 "bytes under us (truncated and written again, or holes "
                 "punched?)", io->path, (io->blocks_peak - blocks) * 512,
                 io->blocks_peak * 512);
    else if (blocks > io->blocks_peak)
      io->blocks_peak = blocks;
  }
 out:
  pthread_mutex_unlock (&io->check_lock);
  return atomic_load (&io->lost) ? -ENXIO : 0;
}

const char *
bcf_io_lost (struct bcf_io *io)
{
  return atomic_load_explicit (&io->lost, memory_order_acquire)
         ? io->lost_why : NULL;
}

void
bcf_io_set_congestion (struct bcf_io *io, unsigned read_us, unsigned write_us)
{
  atomic_store (&io->cong_read_us, read_us);
  atomic_store (&io->cong_write_us, write_us);
  if (!read_us && !write_us)
    atomic_store (&io->congested, 0);
}

void
bcf_io_get_congestion (struct bcf_io *io, unsigned *read_us,
                       unsigned *write_us)
{
  *read_us = atomic_load (&io->cong_read_us);
  *write_us = atomic_load (&io->cong_write_us);
}

/* bcache's fract_exp_two: 2^(x / 2^fract_bits), the fraction linear. */
static unsigned
fract_exp_two (unsigned x, unsigned fract_bits)
{
  unsigned fract = x & ~(~0u << fract_bits);

  x >>= fract_bits;
  x = 1u << x;
  x += (x * fract) >> fract_bits;
  return x;
}

/* A random 32-bit word for bcache's jitter: xorshift32, per thread. */
static uint32_t
jitter32 (void)
{
  static __thread uint32_t x;

  if (x == 0)
    x = (uint32_t) bcf_now_ns () | 1;
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  return x;
}

unsigned
bcf_io_congested (struct bcf_io *io)
{
  int64_t i;

  /* Nothing remembered (the usual case): no clock read.  With
   * congested >= 0, i below is >= 0 too. */
  if (atomic_load_explicit (&io->congested, memory_order_relaxed) >= 0)
    return 0;
  /* bcache's bch_get_congested: the slowness decays by 1 per ~ms since
   * the last slow I/O; while some is left, the sectors from which a
   * stream bypasses shrink exponentially with it, minus a little noise
   * (the popcount of a random word), at least 1. */
  i = ((int64_t) (bcf_now_ns () / 1000) -
       (int64_t) atomic_load_explicit (&io->congested_last_us,
                                       memory_order_relaxed)) / 1024;
  if (i < 0)
    return 0;
  i += atomic_load_explicit (&io->congested, memory_order_relaxed);
  if (i >= 0)
    return 0;
  i += CONGESTED_MAX;
  if (i > 0)
    i = fract_exp_two ((unsigned) i, 6);
  i -= __builtin_popcount (jitter32 ());
  return i > 0 ? (unsigned) i : 1;
}

uint64_t
bcf_io_count (struct bcf_io *io)
{
  return load (&io->reads) + load (&io->writes) + load (&io->flushes) +
         load (&io->errors) + load (&io->errors_injected);
}

uint64_t
bcf_io_errors (struct bcf_io *io)
{
  return load (&io->errors) + load (&io->errors_injected);
}

void
bcf_io_stats (struct bcf_io *io, struct bcf_io_stats *st)
{
  st->reads = load (&io->reads);
  st->writes = load (&io->writes);
  st->flushes = load (&io->flushes);
  st->bytes_read = load (&io->bytes_read);
  st->bytes_written = load (&io->bytes_written);
  st->errors = load (&io->errors);
  st->errors_injected = load (&io->errors_injected);
  st->unflushed_writes = 0;
  pthread_mutex_lock (&io->undo_lock);
  for (size_t i = 0; i < io->nundo; i++)
    st->unflushed_writes += !io->undo[i]->durable;
  pthread_mutex_unlock (&io->undo_lock);
}

/* ---- Fault control ---------------------------------------------------- */

void
bcf_io_set_faults (struct bcf_io *io, const struct bcf_io_faults *f)
{
  atomic_store_explicit (&io->armed, false, memory_order_release);
  pthread_mutex_lock (&io->undo_lock);
  undo_clear (io);
  pthread_mutex_unlock (&io->undo_lock);
  atomic_store (&io->fault_ios, 0);
  atomic_store (&io->fault_writes, 0);
  atomic_store (&io->dead, false);
  if (f) {
    io->faults = *f;
    atomic_store_explicit (&io->armed, true, memory_order_release);
  }
}

void
bcf_io_test_power_cut (struct bcf_io *io, uint64_t n)
{
  if (n == 0) {
    atomic_store (&io->dead, true);
    return;
  }
  /* fault_writes counts only while a power cut is set. */
  if (io->faults.power_cut_after_write == 0)
    atomic_store (&io->fault_writes, 0);
  io->faults.power_cut_after_write = atomic_load (&io->fault_writes) + n;
}

/* splitmix64: a seedable generator that needs no state but the seed. */
static uint64_t
crash_rand (uint64_t *state)
{
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct range { uint64_t lo, hi; };

/* Restore rec's old contents over [lo, hi), except where one of the kept
 * ranges kept[j..] (newer writes that survive) lies. */
static int
revert_range (int fd, const struct undo_rec *rec, uint64_t lo, uint64_t hi,
              const struct range *kept, size_t nkept, size_t j)
{
  for (; j < nkept; j++) {
    int r = 0;
    if (kept[j].hi <= lo || kept[j].lo >= hi)
      continue;
    if (lo < kept[j].lo)
      r = revert_range (fd, rec, lo, kept[j].lo, kept, nkept, j + 1);
    if (r == 0 && kept[j].hi < hi)
      r = revert_range (fd, rec, kept[j].hi, hi, kept, nkept, j + 1);
    return r;
  }
  return full_pwrite (fd, (const char *) rec->old + (lo - rec->off),
                      hi - lo, lo, 0);
}

int
bcf_io_crash (struct bcf_io *io, uint64_t seed, enum bcf_io_crash_mode mode)
{
  CLEANUP_FREE struct range *kept = NULL;
  CLEANUP_CLOSE int fd = -1;
  uint64_t state = seed;
  size_t nkept = 0;
  int reverted = 0, r = 0;

  atomic_store (&io->armed, false);
  pthread_mutex_lock (&io->undo_lock);
  if (io->nundo > 0) {
    kept = malloc (io->nundo * sizeof *kept);
    /* Buffered: the pieces left between kept writes need no alignment. */
    fd = open (io->path, O_WRONLY | O_CLOEXEC);
    if (kept == NULL)
      r = -ENOMEM;
    else if (fd < 0)
      r = -errno;
  }
  for (size_t i = io->nundo; r == 0 && i-- > 0;) {
    const struct undo_rec *rec = io->undo[i];
    bool keep;

    switch (mode) {
    case BCF_IO_CRASH_KEEP_ALL: keep = true; break;
    case BCF_IO_CRASH_LOSE_ALL: keep = false; break;
    default: keep = crash_rand (&state) & 1; break;
    }
    keep |= rec->durable;       /* a completed FUA write */
    if (keep)
      kept[nkept++] = (struct range) { rec->off, rec->off + rec->len };
    else {
      r = revert_range (fd, rec, rec->off, rec->off + rec->len,
                        kept, nkept, 0);
      reverted++;
    }
  }
  pthread_mutex_unlock (&io->undo_lock);
  if (r == 0 && fd >= 0 && fdatasync (fd) == -1)
    r = -errno;
  bcf_io_close (io);
  return r < 0 ? r : reverted;
}
