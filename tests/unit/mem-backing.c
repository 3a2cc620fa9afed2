/* bcachefilter tests: in-memory backing store (see mem-backing.h).
 *
 * Data structures and locking
 * ---------------------------
 * Pages: a radix tree, 512 slots per node, as many levels as the store's
 * size needs, whose leaves point to 4 KiB pages.  Interior nodes are
 * added with compare-and-swap and never freed before mem_backing_free,
 * so lookups walk the tree without a lock.  A leaf slot (and the page
 * behind it) is read or changed only under the stripe lock of its page.
 *
 * Stripe locks: NR_STRIPES rwlocks; the page at index pg belongs to
 * stripe (pg >> STRIPE_PAGES_SHIFT) % NR_STRIPES.  A request takes the
 * locks of all stripes it covers in increasing lock order (so no
 * deadlock), shared to read, exclusive to change, for the memcpy only:
 * never across a latency sleep or a gate.  Holding all of a request's
 * locks at once makes each request atomic, so overlapping requests are
 * ordered, and that order is the order of their undo entries.
 *
 * Lock order: stripe locks, then undo_lock.  fault_lock, gate_lock and
 * read_log_lock are leaves (nothing is taken while holding one).
 *
 * Undo log (crash model): an array of entries in the order the writes
 * happened, each with a sequence number, its range, whether it is already
 * durable, and copies of the pages that were allocated in the range
 * before it (pages not copied were holes, that is zeroes).  A crash walks
 * the log newest first keeping a set of byte ranges covered by kept
 * writes; reverting a write restores its old bytes outside that set.  For
 * any byte this leaves the data of the newest kept write covering it, or
 * the durable value if none: exactly what a volatile cache that wrote
 * back some of its writes would leave.
 */
#include "config.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mem-backing.h"

#define MB_PAGE_SHIFT 12
#define MB_PAGE_SIZE (UINT64_C(1) << MB_PAGE_SHIFT)
#define RADIX_SHIFT 9
#define RADIX_FANOUT (1u << RADIX_SHIFT)
#define STRIPE_PAGES_SHIFT 4    /* 16 pages = 64 KiB per stripe unit */
/* Stripe locks, one bit each in a uint64_t mask.  Not more: a request
 * may hold all of them plus undo_lock, and ThreadSanitizer's deadlock
 * detector tracks at most 64 locks held by one thread. */
#define NR_STRIPES 32
#define ALL_STRIPES ((UINT64_C(1) << NR_STRIPES) - 1)
#define NR_RANGE_FAULTS 16

/* Index of each kind of request, for per-kind state. */
enum { OP_READ, OP_WRITE, OP_TRIM, OP_ZERO, OP_FLUSH, NR_OPS };

struct radix_node {
  _Atomic (void *) slot[RADIX_FANOUT];
};

struct range_fault {
  unsigned ops;                 /* 0 = free slot */
  uint64_t offset, len;
  int err;
};

enum gate_state { GATE_ARMED, GATE_HIT, GATE_RELEASED };

struct mem_backing_gate {
  struct mem_backing *mb;
  struct mem_backing_gate *next;        /* in mb->armed while ARMED */
  unsigned ops;
  enum mem_backing_gate_point point;
  uint64_t offset, len;
  /* The rest under mb->gate_lock. */
  enum gate_state state;
  unsigned refs;                /* the test's handle + a parked request */
  pthread_cond_t cond;          /* state changed */
};

struct read_rec {
  uint64_t offset, len;
};

struct undo_page {
  uint64_t pg;
  uint8_t *data;                /* the whole page as it was */
};

struct undo_entry {
  uint64_t seq;
  uint64_t offset, len;
  bool durable;                 /* fua write or poke: never reverted */
  size_t npages, cap;
  struct undo_page *pages;      /* ascending pg */
};

struct mem_backing {
  uint64_t size;
  unsigned levels;              /* radix levels, >= 1 */
  struct radix_node *root;
  _Atomic uint64_t allocated_pages;

  pthread_rwlock_t stripe[NR_STRIPES];

  _Atomic uint32_t read_latency, write_latency;
  _Atomic int64_t nth_countdown[NR_OPS];
  _Atomic int nth_err[NR_OPS];
  _Atomic int flush_err;
  _Atomic unsigned nr_range_faults;     /* lets requests skip fault_lock */
  pthread_mutex_t fault_lock;
  struct range_fault range_fault[NR_RANGE_FAULTS];

  pthread_mutex_t gate_lock;
  _Atomic unsigned nr_armed;            /* lets requests skip gate_lock */
  struct mem_backing_gate *armed;       /* oldest first */
  unsigned parked;

  _Atomic uint64_t count[NR_OPS];
  _Atomic uint64_t fua_writes, bytes_read, bytes_written, faults, invalid;
  pthread_mutex_t read_log_lock;
  struct read_rec *read_log;
  size_t read_log_len, read_log_cap;

  pthread_mutex_t undo_lock;
  _Atomic bool tracking;        /* changed under undo_lock */
  struct undo_entry **undo;     /* oldest first */
  size_t undo_len, undo_cap;
  uint64_t undo_next_seq;
};

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

static void __attribute__ ((noreturn, format (printf, 1, 2)))
die (const char *fmt, ...)
{
  va_list ap;

  fputs ("mem-backing: ", stderr);
  va_start (ap, fmt);
  vfprintf (stderr, fmt, ap);
  va_end (ap);
  fputc ('\n', stderr);
  abort ();
}

/* A test fixture has no sensible way to go on without memory. */
static void *
xmalloc (size_t n)
{
  void *p = malloc (n);
  if (!p)
    die ("out of memory (%zu bytes)", n);
  return p;
}

static void *
xcalloc (size_t n, size_t size)
{
  void *p = calloc (n, size);
  if (!p)
    die ("out of memory (%zu x %zu bytes)", n, size);
  return p;
}

/* Array p of *cap elements of size, grown to hold at least need. */
static void *
grow (void *p, size_t *cap, size_t need, size_t size)
{
  size_t ncap;

  if (need <= *cap)
    return p;
  ncap = *cap ? *cap * 2 : 16;
  while (ncap < need)
    ncap *= 2;
  p = realloc (p, ncap * size);
  if (!p)
    die ("out of memory (%zu x %zu bytes)", ncap, size);
  *cap = ncap;
  return p;
}

static uint64_t
min_u64 (uint64_t a, uint64_t b)
{
  return a < b ? a : b;
}

static uint64_t
max_u64 (uint64_t a, uint64_t b)
{
  return a > b ? a : b;
}

/* Half-open ranges [a, a+alen) and [b, b+blen); alen, blen > 0, and
 * neither end past UINT64_MAX (see clamp_len). */
static bool
overlaps (uint64_t a, uint64_t alen, uint64_t b, uint64_t blen)
{
  return a < b + blen && b < a + alen;
}

/* Test-given ranges may run past 2^64 ("from here to the end"): clamp
 * the length so overlaps() cannot wrap.  len 0 means everything. */
static uint64_t
clamp_len (uint64_t offset, uint64_t len)
{
  if (len == 0)
    return UINT64_MAX - offset ? UINT64_MAX - offset : 1;
  return min_u64 (len, UINT64_MAX - offset);
}

static int
op_index (unsigned op)
{
  assert (op && !(op & (op - 1)) && op <= MEM_BACKING_FLUSH);
  return __builtin_ctz (op);
}

static int
positive_errno (int err)
{
  return err < 0 ? -err : err;
}

static void
sleep_usec (uint32_t usec)
{
  struct timespec ts = {
    .tv_sec = usec / 1000000,
    .tv_nsec = (long) (usec % 1000000) * 1000,
  };

  while (nanosleep (&ts, &ts) == -1 && errno == EINTR)
    ;
}

/* ------------------------------------------------------------------------
 * Pages: radix tree and stripe locks
 * ------------------------------------------------------------------------ */

static unsigned
radix_index (uint64_t pg, unsigned level)
{
  return (pg >> (level * RADIX_SHIFT)) & (RADIX_FANOUT - 1);
}

/* The leaf slot of page pg; NULL if an interior node is missing and
 * create is false.  Lock-free: interior nodes are only ever added. */
static _Atomic (void *) *
page_slot (struct mem_backing *mb, uint64_t pg, bool create)
{
  struct radix_node *n = mb->root;
  unsigned level;

  for (level = mb->levels - 1; level > 0; level--) {
    _Atomic (void *) *s = &n->slot[radix_index (pg, level)];
    void *child = atomic_load_explicit (s, memory_order_acquire);

    if (!child) {
      void *fresh, *expected = NULL;

      if (!create)
        return NULL;
      fresh = xcalloc (1, sizeof (struct radix_node));
      if (atomic_compare_exchange_strong_explicit (s, &expected, fresh,
                                                   memory_order_acq_rel,
                                                   memory_order_acquire))
        child = fresh;
      else {                    /* another writer added it first */
        free (fresh);
        child = expected;
      }
    }
    n = child;
  }
  return &n->slot[radix_index (pg, 0)];
}

/* Caller holds pg's stripe lock. */
static uint8_t *
page_get (struct mem_backing *mb, uint64_t pg)
{
  _Atomic (void *) *s = page_slot (mb, pg, false);

  return s ? atomic_load_explicit (s, memory_order_relaxed) : NULL;
}

/* Caller holds pg's stripe lock exclusively.  A fresh page is zeroed
 * unless the caller is about to overwrite all of it. */
static uint8_t *
page_get_or_alloc (struct mem_backing *mb, uint64_t pg, bool will_fill)
{
  _Atomic (void *) *s = page_slot (mb, pg, true);
  uint8_t *p = atomic_load_explicit (s, memory_order_relaxed);

  if (!p) {
    p = will_fill ? xmalloc (MB_PAGE_SIZE) : xcalloc (1, MB_PAGE_SIZE);
    atomic_store_explicit (s, p, memory_order_relaxed);
    atomic_fetch_add (&mb->allocated_pages, 1);
  }
  return p;
}

/* Caller holds the page's stripe lock exclusively. */
static void
page_free (struct mem_backing *mb, _Atomic (void *) *slot)
{
  free (atomic_load_explicit (slot, memory_order_relaxed));
  atomic_store_explicit (slot, NULL, memory_order_relaxed);
  atomic_fetch_sub (&mb->allocated_pages, 1);
}

typedef void page_fn (struct mem_backing *mb, uint64_t pg,
                      _Atomic (void *) *slot, void *arg);

/* Call fn for every allocated page in [first, last], ascending, skipping
 * empty subtrees, so a huge trim over a sparse store stays cheap.  fn may
 * free the page. */
static void
walk_node (struct mem_backing *mb, struct radix_node *n, unsigned level,
           uint64_t base, uint64_t first, uint64_t last,
           page_fn *fn, void *arg)
{
  uint64_t span = UINT64_C(1) << (level * RADIX_SHIFT);
  uint64_t i = first > base ? (first - base) / span : 0;
  uint64_t end = min_u64 ((last - base) / span, RADIX_FANOUT - 1);

  for (; i <= end; i++) {
    _Atomic (void *) *s = &n->slot[i];
    void *child = atomic_load_explicit (s, memory_order_acquire);

    if (!child)
      continue;
    if (level == 0)
      fn (mb, base + i, s, arg);
    else
      walk_node (mb, child, level - 1, base + i * span, first, last, fn, arg);
  }
}

static void
walk_pages (struct mem_backing *mb, uint64_t first, uint64_t last,
            page_fn *fn, void *arg)
{
  walk_node (mb, mb->root, mb->levels - 1, 0, first, last, fn, arg);
}

/* The stripe locks covering [offset, offset+len), len > 0, as a mask. */
static uint64_t
stripe_mask (uint64_t offset, uint64_t len)
{
  uint64_t first = (offset >> MB_PAGE_SHIFT) >> STRIPE_PAGES_SHIFT;
  uint64_t last = ((offset + len - 1) >> MB_PAGE_SHIFT) >> STRIPE_PAGES_SHIFT;
  uint64_t mask = 0, u;

  if (last - first >= NR_STRIPES - 1)
    return ALL_STRIPES;
  for (u = first; u <= last; u++)
    mask |= UINT64_C(1) << (u % NR_STRIPES);
  return mask;
}

static void
lock_stripes (struct mem_backing *mb, uint64_t mask, bool exclusive)
{
  unsigned i;

  for (i = 0; i < NR_STRIPES; i++) {
    if (!(mask & (UINT64_C(1) << i)))
      continue;
    if (exclusive)
      pthread_rwlock_wrlock (&mb->stripe[i]);
    else
      pthread_rwlock_rdlock (&mb->stripe[i]);
  }
}

static void
unlock_stripes (struct mem_backing *mb, uint64_t mask)
{
  unsigned i;

  for (i = NR_STRIPES; i-- > 0; )
    if (mask & (UINT64_C(1) << i))
      pthread_rwlock_unlock (&mb->stripe[i]);
}

/* ------------------------------------------------------------------------
 * Data access, under the stripe locks
 * ------------------------------------------------------------------------ */

static void
store_read (struct mem_backing *mb, uint8_t *buf, uint64_t len,
            uint64_t offset)
{
  while (len > 0) {
    uint64_t pg = offset >> MB_PAGE_SHIFT;
    size_t in = offset & (MB_PAGE_SIZE - 1);
    size_t n = min_u64 (MB_PAGE_SIZE - in, len);
    uint8_t *p = page_get (mb, pg);

    if (p)
      memcpy (buf, p + in, n);
    else
      memset (buf, 0, n);
    buf += n;
    offset += n;
    len -= n;
  }
}

static void
store_write (struct mem_backing *mb, const uint8_t *buf, uint64_t len,
             uint64_t offset)
{
  while (len > 0) {
    uint64_t pg = offset >> MB_PAGE_SHIFT;
    size_t in = offset & (MB_PAGE_SIZE - 1);
    size_t n = min_u64 (MB_PAGE_SIZE - in, len);
    uint8_t *p = page_get_or_alloc (mb, pg, n == MB_PAGE_SIZE);

    memcpy (p + in, buf, n);
    buf += n;
    offset += n;
    len -= n;
  }
}

struct byte_range {
  uint64_t start, end;          /* half open */
};

/* Zero the part of page pg inside the range, freeing it if whole. */
static void
zero_page_fn (struct mem_backing *mb, uint64_t pg, _Atomic (void *) *slot,
              void *arg)
{
  const struct byte_range *r = arg;
  uint64_t pstart = pg << MB_PAGE_SHIFT;
  uint64_t from = max_u64 (r->start, pstart);
  uint64_t to = min_u64 (r->end, pstart + MB_PAGE_SIZE);
  uint8_t *p = atomic_load_explicit (slot, memory_order_relaxed);

  if (from == pstart && to == pstart + MB_PAGE_SIZE)
    page_free (mb, slot);
  else
    memset (p + (from - pstart), 0, to - from);
}

/* Trim and zero: only allocated pages need work. */
static void
store_zero (struct mem_backing *mb, uint64_t len, uint64_t offset)
{
  struct byte_range r = { offset, offset + len };

  walk_pages (mb, offset >> MB_PAGE_SHIFT, (offset + len - 1) >> MB_PAGE_SHIFT,
              zero_page_fn, &r);
}

/* ------------------------------------------------------------------------
 * Undo log
 * ------------------------------------------------------------------------ */

static void
undo_entry_free (struct undo_entry *e)
{
  size_t i;

  if (!e)
    return;
  for (i = 0; i < e->npages; i++)
    free (e->pages[i].data);
  free (e->pages);
  free (e);
}

static void
save_page_fn (struct mem_backing *mb, uint64_t pg, _Atomic (void *) *slot,
              void *arg)
{
  struct undo_entry *e = arg;
  uint8_t *copy = xmalloc (MB_PAGE_SIZE);

  memcpy (copy, atomic_load_explicit (slot, memory_order_relaxed),
          MB_PAGE_SIZE);
  e->pages = grow (e->pages, &e->cap, e->npages + 1, sizeof *e->pages);
  e->pages[e->npages++] = (struct undo_page) { .pg = pg, .data = copy };
}

/* Before a change to [offset, offset+len), under its stripe locks held
 * exclusively: copy what it will overwrite.  NULL when not tracking.  A
 * durable change will never be reverted, so only its range is kept. */
static struct undo_entry *
undo_prepare (struct mem_backing *mb, uint64_t offset, uint64_t len,
              bool durable)
{
  struct undo_entry *e;

  if (!atomic_load (&mb->tracking))
    return NULL;
  e = xcalloc (1, sizeof *e);
  e->offset = offset;
  e->len = len;
  e->durable = durable;
  if (!durable)
    walk_pages (mb, offset >> MB_PAGE_SHIFT,
                (offset + len - 1) >> MB_PAGE_SHIFT, save_page_fn, e);
  return e;
}

/* After the change, still under the stripe locks, so that the log order
 * of overlapping changes is the order they were applied in.  Tracking
 * may have been turned off meanwhile: then the entry is dropped. */
static void
undo_commit (struct mem_backing *mb, struct undo_entry *e)
{
  if (!e)
    return;
  pthread_mutex_lock (&mb->undo_lock);
  if (atomic_load (&mb->tracking)) {
    mb->undo = grow (mb->undo, &mb->undo_cap, mb->undo_len + 1,
                     sizeof *mb->undo);
    e->seq = mb->undo_next_seq++;
    mb->undo[mb->undo_len++] = e;
    e = NULL;
  }
  pthread_mutex_unlock (&mb->undo_lock);
  undo_entry_free (e);
}

/* Caller holds undo_lock. */
static void
undo_clear (struct mem_backing *mb)
{
  size_t i;

  for (i = 0; i < mb->undo_len; i++)
    undo_entry_free (mb->undo[i]);
  mb->undo_len = 0;
}

/* The sequence number the next change will get: a flush makes durable
 * every change numbered below it. */
static uint64_t
undo_snapshot (struct mem_backing *mb)
{
  uint64_t seq;

  pthread_mutex_lock (&mb->undo_lock);
  seq = mb->undo_next_seq;
  pthread_mutex_unlock (&mb->undo_lock);
  return seq;
}

/* Entries are in seq order, so the durable ones are a prefix. */
static void
undo_make_durable (struct mem_backing *mb, uint64_t below)
{
  size_t n = 0, i;

  pthread_mutex_lock (&mb->undo_lock);
  while (n < mb->undo_len && mb->undo[n]->seq < below)
    n++;
  if (n > 0) {                  /* else undo may be NULL */
    for (i = 0; i < n; i++)
      undo_entry_free (mb->undo[i]);
    memmove (mb->undo, mb->undo + n, (mb->undo_len - n) * sizeof *mb->undo);
    mb->undo_len -= n;
  }
  pthread_mutex_unlock (&mb->undo_lock);
}

/* ------------------------------------------------------------------------
 * Crash: reverting the undo log
 * ------------------------------------------------------------------------ */

/* Disjoint, sorted byte ranges written by kept writes. */
struct covered {
  struct byte_range *r;
  size_t n, cap;
};

static void
covered_add (struct covered *c, uint64_t start, uint64_t end)
{
  size_t i = 0, j;

  while (i < c->n && c->r[i].end < start)
    i++;
  /* Merge every range touching [start, end) into it. */
  j = i;
  while (j < c->n && c->r[j].start <= end) {
    start = min_u64 (start, c->r[j].start);
    end = max_u64 (end, c->r[j].end);
    j++;
  }
  if (j == i) {
    c->r = grow (c->r, &c->cap, c->n + 1, sizeof *c->r);
    memmove (&c->r[i + 1], &c->r[i], (c->n - i) * sizeof *c->r);
    c->n++;
  }
  else {
    memmove (&c->r[i + 1], &c->r[j], (c->n - j) * sizeof *c->r);
    c->n -= j - i - 1;
  }
  c->r[i] = (struct byte_range) { start, end };
}

/* The saved copy of page pg in e, or NULL if pg was a hole. */
static const uint8_t *
undo_find_page (const struct undo_entry *e, uint64_t pg)
{
  size_t lo = 0, hi = e->npages;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;

    if (e->pages[mid].pg == pg)
      return e->pages[mid].data;
    if (e->pages[mid].pg < pg)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

struct restore {
  const struct undo_entry *e;
  struct byte_range r;
};

/* A page now allocated that was a hole before e: zero the restored part. */
static void
restore_hole_fn (struct mem_backing *mb, uint64_t pg, _Atomic (void *) *slot,
                 void *arg)
{
  const struct restore *rs = arg;

  if (!undo_find_page (rs->e, pg))
    zero_page_fn (mb, pg, slot, (void *) &rs->r);
}

/* Put back e's old bytes in [start, end), a part of e's range. */
static void
restore_range (struct mem_backing *mb, const struct undo_entry *e,
               uint64_t start, uint64_t end)
{
  struct restore rs = { .e = e, .r = { start, end } };
  uint64_t first = start >> MB_PAGE_SHIFT, last = (end - 1) >> MB_PAGE_SHIFT;
  size_t i;

  walk_pages (mb, first, last, restore_hole_fn, &rs);
  for (i = 0; i < e->npages; i++) {
    uint64_t pg = e->pages[i].pg, pstart = pg << MB_PAGE_SHIFT;
    uint64_t from, to;

    if (pg < first || pg > last)
      continue;
    from = max_u64 (start, pstart);
    to = min_u64 (end, pstart + MB_PAGE_SIZE);
    memcpy (page_get_or_alloc (mb, pg, false) + (from - pstart),
            e->pages[i].data + (from - pstart), to - from);
  }
}

/* Revert e where no kept newer write covers it. */
static void
revert_entry (struct mem_backing *mb, const struct undo_entry *e,
              const struct covered *c)
{
  uint64_t pos = e->offset, end = e->offset + e->len;
  size_t i;

  for (i = 0; i < c->n && pos < end; i++) {
    if (c->r[i].end <= pos)
      continue;
    if (c->r[i].start >= end)
      break;
    if (c->r[i].start > pos)
      restore_range (mb, e, pos, c->r[i].start);
    pos = c->r[i].end;
  }
  if (pos < end)
    restore_range (mb, e, pos, end);
}

uint64_t
mem_backing_crash_with (struct mem_backing *mb, mem_backing_keep_fn *keep,
                        void *arg)
{
  struct covered c = { 0 };
  uint64_t reverted = 0, i = 0;
  size_t k;

  lock_stripes (mb, ALL_STRIPES, true);
  pthread_mutex_lock (&mb->undo_lock);
  for (k = mb->undo_len; k-- > 0; ) {
    const struct undo_entry *e = mb->undo[k];

    if (e->durable || keep (arg, i++, e->offset, e->len))
      covered_add (&c, e->offset, e->offset + e->len);
    else {
      revert_entry (mb, e, &c);
      reverted++;
    }
  }
  undo_clear (mb);
  pthread_mutex_unlock (&mb->undo_lock);
  unlock_stripes (mb, ALL_STRIPES);
  free (c.r);
  return reverted;
}

/* splitmix64: tiny, and good enough that every bit is a fair coin. */
static uint64_t
splitmix64 (uint64_t *state)
{
  uint64_t z = (*state += UINT64_C(0x9e3779b97f4a7c15));

  z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
  return z ^ (z >> 31);
}

static bool
keep_random (void *arg, uint64_t i, uint64_t offset, uint64_t len)
{
  return splitmix64 (arg) >> 63;
}

static bool
keep_all (void *arg, uint64_t i, uint64_t offset, uint64_t len)
{
  return true;
}

static bool
keep_none (void *arg, uint64_t i, uint64_t offset, uint64_t len)
{
  return false;
}

uint64_t
mem_backing_crash (struct mem_backing *mb, enum mem_backing_crash_mode mode,
                   uint64_t seed)
{
  switch (mode) {
  case MEM_BACKING_LOSE_ALL:
    return mem_backing_crash_with (mb, keep_none, NULL);
  case MEM_BACKING_KEEP_ALL:
    return mem_backing_crash_with (mb, keep_all, NULL);
  case MEM_BACKING_RANDOM:
    return mem_backing_crash_with (mb, keep_random, &seed);
  }
  die ("mem_backing_crash: bad mode %d", (int) mode);
}

void
mem_backing_track_crash (struct mem_backing *mb, bool on)
{
  pthread_mutex_lock (&mb->undo_lock);
  undo_clear (mb);
  atomic_store (&mb->tracking, on);
  pthread_mutex_unlock (&mb->undo_lock);
}

uint64_t
mem_backing_unflushed (struct mem_backing *mb)
{
  uint64_t n = 0;
  size_t i;

  pthread_mutex_lock (&mb->undo_lock);
  for (i = 0; i < mb->undo_len; i++)
    n += !mb->undo[i]->durable;
  pthread_mutex_unlock (&mb->undo_lock);
  return n;
}

/* ------------------------------------------------------------------------
 * Faults
 * ------------------------------------------------------------------------ */

void
mem_backing_set_read_latency (struct mem_backing *mb, uint32_t usec)
{
  atomic_store (&mb->read_latency, usec);
}

void
mem_backing_set_write_latency (struct mem_backing *mb, uint32_t usec)
{
  atomic_store (&mb->write_latency, usec);
}

void
mem_backing_fail_nth (struct mem_backing *mb, enum mem_backing_op op,
                      uint64_t n, int err)
{
  int i = op_index (op);

  if (n > INT64_MAX)
    die ("mem_backing_fail_nth: n too large");
  /* err first: a request that sees the countdown must see its errno. */
  atomic_store (&mb->nth_err[i], positive_errno (err));
  atomic_store (&mb->nth_countdown[i], (int64_t) n);
}

/* Count one request of kind i against the nth fault; its errno if this
 * is the one. */
static int
take_nth_fault (struct mem_backing *mb, int i)
{
  int64_t v = atomic_load (&mb->nth_countdown[i]);

  while (v > 0)
    if (atomic_compare_exchange_weak (&mb->nth_countdown[i], &v, v - 1))
      return v == 1 ? atomic_load (&mb->nth_err[i]) : 0;
  return 0;
}

int
mem_backing_fail_range (struct mem_backing *mb, unsigned ops,
                        uint64_t offset, uint64_t len, int err)
{
  int i;

  if (!(ops & MEM_BACKING_ANY) || err == 0)
    die ("mem_backing_fail_range: needs ranged ops and an errno");
  pthread_mutex_lock (&mb->fault_lock);
  for (i = 0; i < NR_RANGE_FAULTS; i++) {
    struct range_fault *f = &mb->range_fault[i];

    if (f->ops == 0) {
      *f = (struct range_fault) {
        .ops = ops & MEM_BACKING_ANY,
        .offset = len ? offset : 0,
        .len = clamp_len (len ? offset : 0, len),
        .err = positive_errno (err),
      };
      atomic_fetch_add (&mb->nr_range_faults, 1);
      pthread_mutex_unlock (&mb->fault_lock);
      return i;
    }
  }
  die ("mem_backing_fail_range: more than %d range faults", NR_RANGE_FAULTS);
}

void
mem_backing_fail_range_clear (struct mem_backing *mb, int id)
{
  if (id < 0 || id >= NR_RANGE_FAULTS)
    die ("mem_backing_fail_range_clear: bad id %d", id);
  pthread_mutex_lock (&mb->fault_lock);
  if (mb->range_fault[id].ops) {
    mb->range_fault[id].ops = 0;
    atomic_fetch_sub (&mb->nr_range_faults, 1);
  }
  pthread_mutex_unlock (&mb->fault_lock);
}

void
mem_backing_fail_flush (struct mem_backing *mb, int err)
{
  atomic_store (&mb->flush_err, positive_errno (err));
}

void
mem_backing_clear_faults (struct mem_backing *mb)
{
  int i;

  for (i = 0; i < NR_OPS; i++)
    atomic_store (&mb->nth_countdown[i], 0);
  atomic_store (&mb->flush_err, 0);
  for (i = 0; i < NR_RANGE_FAULTS; i++)
    mem_backing_fail_range_clear (mb, i);
}

static int
range_fault (struct mem_backing *mb, unsigned op, uint64_t offset,
             uint64_t len)
{
  int err = 0, i;

  if (atomic_load (&mb->nr_range_faults) == 0)
    return 0;
  pthread_mutex_lock (&mb->fault_lock);
  for (i = 0; i < NR_RANGE_FAULTS && !err; i++) {
    const struct range_fault *f = &mb->range_fault[i];

    if ((f->ops & op) && overlaps (offset, len, f->offset, f->len))
      err = f->err;
  }
  pthread_mutex_unlock (&mb->fault_lock);
  return err;
}

/* ------------------------------------------------------------------------
 * Gates
 * ------------------------------------------------------------------------ */

struct mem_backing_gate *
mem_backing_gate_arm (struct mem_backing *mb, unsigned ops,
                      enum mem_backing_gate_point point,
                      uint64_t offset, uint64_t len)
{
  struct mem_backing_gate *g = xcalloc (1, sizeof *g), **pp;
  pthread_condattr_t attr;

  if (!(ops & (MEM_BACKING_ANY | MEM_BACKING_FLUSH)))
    die ("mem_backing_gate_arm: no ops");
  g->mb = mb;
  g->ops = ops;
  g->point = point;
  g->offset = len ? offset : 0;
  g->len = clamp_len (g->offset, len);
  g->state = GATE_ARMED;
  g->refs = 1;
  /* wait_hit's timeout must not jump with the wall clock. */
  pthread_condattr_init (&attr);
  pthread_condattr_setclock (&attr, CLOCK_MONOTONIC);
  pthread_cond_init (&g->cond, &attr);
  pthread_condattr_destroy (&attr);

  pthread_mutex_lock (&mb->gate_lock);
  for (pp = &mb->armed; *pp; pp = &(*pp)->next)
    ;
  *pp = g;
  atomic_fetch_add (&mb->nr_armed, 1);
  pthread_mutex_unlock (&mb->gate_lock);
  return g;
}

/* Caller holds gate_lock. */
static void
gate_unlink (struct mem_backing *mb, struct mem_backing_gate *g)
{
  struct mem_backing_gate **pp;

  for (pp = &mb->armed; *pp != g; pp = &(*pp)->next)
    assert (*pp);
  *pp = g->next;
  g->next = NULL;
  atomic_fetch_sub (&mb->nr_armed, 1);
}

/* Caller holds gate_lock. */
static void
gate_put (struct mem_backing_gate *g)
{
  if (--g->refs == 0) {
    pthread_cond_destroy (&g->cond);
    free (g);
  }
}

static bool
gate_matches (const struct mem_backing_gate *g, unsigned op,
              enum mem_backing_gate_point point,
              uint64_t offset, uint64_t len)
{
  if (!(g->ops & op) || g->point != point)
    return false;
  if (op == MEM_BACKING_FLUSH)
    return true;
  return overlaps (offset, len, g->offset, g->len);
}

/* A request reaches a gate point: park it if an armed gate wants it.  No
 * other lock is held here, so a parked request blocks no one. */
static void
gate_pass (struct mem_backing *mb, unsigned op,
           enum mem_backing_gate_point point, uint64_t offset, uint64_t len)
{
  struct mem_backing_gate *g;

  if (atomic_load (&mb->nr_armed) == 0)
    return;
  pthread_mutex_lock (&mb->gate_lock);
  for (g = mb->armed; g; g = g->next)
    if (gate_matches (g, op, point, offset, len))
      break;
  if (g) {
    gate_unlink (mb, g);
    g->state = GATE_HIT;
    g->refs++;
    mb->parked++;
    pthread_cond_broadcast (&g->cond);
    while (g->state != GATE_RELEASED)
      pthread_cond_wait (&g->cond, &mb->gate_lock);
    mb->parked--;
    gate_put (g);
  }
  pthread_mutex_unlock (&mb->gate_lock);
}

bool
mem_backing_gate_wait_hit (struct mem_backing_gate *g, unsigned timeout_ms)
{
  struct mem_backing *mb = g->mb;
  struct timespec deadline;
  bool hit;

  clock_gettime (CLOCK_MONOTONIC, &deadline);
  deadline.tv_sec += timeout_ms / 1000;
  deadline.tv_nsec += (long) (timeout_ms % 1000) * 1000000;
  if (deadline.tv_nsec >= 1000000000) {
    deadline.tv_sec++;
    deadline.tv_nsec -= 1000000000;
  }

  pthread_mutex_lock (&mb->gate_lock);
  while (g->state == GATE_ARMED)
    if (pthread_cond_timedwait (&g->cond, &mb->gate_lock, &deadline)
        == ETIMEDOUT)
      break;
  hit = g->state == GATE_HIT;
  pthread_mutex_unlock (&mb->gate_lock);
  return hit;
}

void
mem_backing_gate_release (struct mem_backing_gate *g)
{
  struct mem_backing *mb = g->mb;

  pthread_mutex_lock (&mb->gate_lock);
  if (g->state == GATE_ARMED)
    gate_unlink (mb, g);
  g->state = GATE_RELEASED;
  pthread_cond_broadcast (&g->cond);
  gate_put (g);
  pthread_mutex_unlock (&mb->gate_lock);
}

/* ------------------------------------------------------------------------
 * Counters
 * ------------------------------------------------------------------------ */

static void
record_read (struct mem_backing *mb, uint64_t offset, uint64_t len)
{
  pthread_mutex_lock (&mb->read_log_lock);
  mb->read_log = grow (mb->read_log, &mb->read_log_cap, mb->read_log_len + 1,
        sizeof *mb->read_log);
  mb->read_log[mb->read_log_len++] = (struct read_rec) { offset, len };
  pthread_mutex_unlock (&mb->read_log_lock);
}

uint64_t
mem_backing_read_count_range (struct mem_backing *mb, uint64_t offset,
                              uint64_t len)
{
  uint64_t n = 0;
  size_t i;

  if (len == 0)
    return 0;
  pthread_mutex_lock (&mb->read_log_lock);
  for (i = 0; i < mb->read_log_len; i++)
    n += overlaps (mb->read_log[i].offset, mb->read_log[i].len, offset, len);
  pthread_mutex_unlock (&mb->read_log_lock);
  return n;
}

void
mem_backing_get_stats (struct mem_backing *mb, struct mem_backing_stats *st)
{
  *st = (struct mem_backing_stats) {
    .reads = atomic_load (&mb->count[OP_READ]),
    .writes = atomic_load (&mb->count[OP_WRITE]),
    .fua_writes = atomic_load (&mb->fua_writes),
    .flushes = atomic_load (&mb->count[OP_FLUSH]),
    .trims = atomic_load (&mb->count[OP_TRIM]),
    .zeros = atomic_load (&mb->count[OP_ZERO]),
    .bytes_read = atomic_load (&mb->bytes_read),
    .bytes_written = atomic_load (&mb->bytes_written),
    .faults = atomic_load (&mb->faults),
    .invalid = atomic_load (&mb->invalid),
  };
}

void
mem_backing_reset_stats (struct mem_backing *mb)
{
  int i;

  for (i = 0; i < NR_OPS; i++)
    atomic_store (&mb->count[i], 0);
  atomic_store (&mb->fua_writes, 0);
  atomic_store (&mb->bytes_read, 0);
  atomic_store (&mb->bytes_written, 0);
  atomic_store (&mb->faults, 0);
  atomic_store (&mb->invalid, 0);
  pthread_mutex_lock (&mb->read_log_lock);
  mb->read_log_len = 0;
  pthread_mutex_unlock (&mb->read_log_lock);
}

uint64_t
mem_backing_allocated_pages (struct mem_backing *mb)
{
  return atomic_load (&mb->allocated_pages);
}

/* ------------------------------------------------------------------------
 * The backing.h calls
 * ------------------------------------------------------------------------ */

struct request {
  unsigned op;                  /* one MEM_BACKING_* bit */
  uint64_t offset, len;         /* not for flush */
  void *rbuf;                   /* read */
  const void *wbuf;             /* write */
  bool fua;
};

/* backing.h: requests never cross size().  Say so loudly if one does. */
static bool
valid_request (struct mem_backing *mb, const char *name, uint32_t count,
               uint64_t offset)
{
  if (count > 0 && offset <= mb->size && count <= mb->size - offset)
    return true;
  atomic_fetch_add (&mb->invalid, 1);
  fprintf (stderr, "mem-backing: invalid %s: count %" PRIu32
           " offset %" PRIu64 " size %" PRIu64 "\n",
           name, count, offset, mb->size);
  return false;
}

static void
count_request (struct mem_backing *mb, const struct request *r)
{
  atomic_fetch_add (&mb->count[op_index (r->op)], 1);
  switch (r->op) {
  case MEM_BACKING_READ:
    atomic_fetch_add (&mb->bytes_read, r->len);
    record_read (mb, r->offset, r->len);
    break;
  case MEM_BACKING_WRITE:
    atomic_fetch_add (&mb->bytes_written, r->len);
    if (r->fua)
      atomic_fetch_add (&mb->fua_writes, 1);
    break;
  }
}

/* Decided on arrival, so "the Nth" is the Nth call made. */
static int
decide_fault (struct mem_backing *mb, const struct request *r)
{
  int err = take_nth_fault (mb, op_index (r->op));

  if (!err && r->op == MEM_BACKING_FLUSH)
    err = atomic_load (&mb->flush_err);
  if (!err && r->op != MEM_BACKING_FLUSH)
    err = range_fault (mb, r->op, r->offset, r->len);
  return err;
}

/* A flush makes durable what was logged before it started work; a
 * failed one (handled by the caller) makes nothing durable. */
static void
do_flush (struct mem_backing *mb)
{
  uint64_t seq = undo_snapshot (mb);

  sleep_usec (atomic_load (&mb->write_latency));
  undo_make_durable (mb, seq);
}

static void
do_read (struct mem_backing *mb, const struct request *r)
{
  uint64_t mask = stripe_mask (r->offset, r->len);

  sleep_usec (atomic_load (&mb->read_latency));
  lock_stripes (mb, mask, false);
  store_read (mb, r->rbuf, r->len, r->offset);
  unlock_stripes (mb, mask);
}

static void
do_modify (struct mem_backing *mb, const struct request *r)
{
  uint64_t mask = stripe_mask (r->offset, r->len);
  struct undo_entry *e;

  sleep_usec (atomic_load (&mb->write_latency));
  lock_stripes (mb, mask, true);
  e = undo_prepare (mb, r->offset, r->len, r->fua);
  if (r->op == MEM_BACKING_WRITE)
    store_write (mb, r->wbuf, r->len, r->offset);
  else
    store_zero (mb, r->len, r->offset);
  undo_commit (mb, e);
  unlock_stripes (mb, mask);
}

/* Every call goes through here: count, decide the fault, gate, sleep,
 * touch the data (unless failing), gate, return. */
static int
run_request (struct mem_backing *mb, const struct request *r)
{
  int err;

  count_request (mb, r);
  err = decide_fault (mb, r);
  gate_pass (mb, r->op, MEM_BACKING_BEFORE_IO, r->offset, r->len);
  if (err)
    atomic_fetch_add (&mb->faults, 1);
  else if (r->op == MEM_BACKING_FLUSH)
    do_flush (mb);
  else if (r->op == MEM_BACKING_READ)
    do_read (mb, r);
  else
    do_modify (mb, r);
  gate_pass (mb, r->op, MEM_BACKING_AFTER_IO, r->offset, r->len);
  return -err;
}

static int
mb_pread (void *opaque, void *buf, uint32_t count, uint64_t offset)
{
  struct mem_backing *mb = opaque;
  struct request r = {
    .op = MEM_BACKING_READ, .offset = offset, .len = count, .rbuf = buf,
  };

  if (!valid_request (mb, "pread", count, offset))
    return -EINVAL;
  return run_request (mb, &r);
}

static int
mb_pwrite (void *opaque, const void *buf, uint32_t count, uint64_t offset,
           bool fua)
{
  struct mem_backing *mb = opaque;
  struct request r = {
    .op = MEM_BACKING_WRITE, .offset = offset, .len = count, .wbuf = buf,
    .fua = fua,
  };

  if (!valid_request (mb, "pwrite", count, offset))
    return -EINVAL;
  return run_request (mb, &r);
}

static int
mb_flush (void *opaque)
{
  struct request r = { .op = MEM_BACKING_FLUSH };

  return run_request (opaque, &r);
}

static int
mb_trim (void *opaque, uint32_t count, uint64_t offset)
{
  struct mem_backing *mb = opaque;
  struct request r = {
    .op = MEM_BACKING_TRIM, .offset = offset, .len = count,
  };

  if (!valid_request (mb, "trim", count, offset))
    return -EINVAL;
  return run_request (mb, &r);
}

/* may_trim changes nothing here: freeing whole pages is always how this
 * store holds zeroes. */
static int
mb_zero (void *opaque, uint32_t count, uint64_t offset, bool may_trim)
{
  struct mem_backing *mb = opaque;
  struct request r = {
    .op = MEM_BACKING_ZERO, .offset = offset, .len = count,
  };

  if (!valid_request (mb, "zero", count, offset))
    return -EINVAL;
  return run_request (mb, &r);
}

static int64_t
mb_size (void *opaque)
{
  const struct mem_backing *mb = opaque;

  return (int64_t) mb->size;
}

static const struct bcf_backing_ops mem_backing_ops = {
  .pread = mb_pread,
  .pwrite = mb_pwrite,
  .flush = mb_flush,
  .trim = mb_trim,
  .zero = mb_zero,
  .size = mb_size,
};

struct bcf_backing
mem_backing_get (struct mem_backing *mb)
{
  return (struct bcf_backing) { .ops = &mem_backing_ops, .opaque = mb };
}

/* ------------------------------------------------------------------------
 * Direct access
 * ------------------------------------------------------------------------ */

static void
check_direct (struct mem_backing *mb, const char *name, size_t len,
              uint64_t offset)
{
  if (offset > mb->size || len > mb->size - offset)
    die ("%s: %zu bytes at %" PRIu64 " outside the store (%" PRIu64 ")",
         name, len, offset, mb->size);
}

void
mem_backing_peek (struct mem_backing *mb, void *buf, size_t len,
                  uint64_t offset)
{
  uint64_t mask;

  check_direct (mb, "mem_backing_peek", len, offset);
  if (len == 0)
    return;
  mask = stripe_mask (offset, len);
  lock_stripes (mb, mask, false);
  store_read (mb, buf, len, offset);
  unlock_stripes (mb, mask);
}

/* Durable, so a crash never reverts it, nor an older write under it. */
void
mem_backing_poke (struct mem_backing *mb, const void *buf, size_t len,
                  uint64_t offset)
{
  uint64_t mask;
  struct undo_entry *e;

  check_direct (mb, "mem_backing_poke", len, offset);
  if (len == 0)
    return;
  mask = stripe_mask (offset, len);
  lock_stripes (mb, mask, true);
  e = undo_prepare (mb, offset, len, true);
  store_write (mb, buf, len, offset);
  undo_commit (mb, e);
  unlock_stripes (mb, mask);
}

/* ------------------------------------------------------------------------
 * Life cycle
 * ------------------------------------------------------------------------ */

struct mem_backing *
mem_backing_new (uint64_t size_bytes)
{
  struct mem_backing *mb = xcalloc (1, sizeof *mb);
  uint64_t npages = (size_bytes >> MB_PAGE_SHIFT)
    + ((size_bytes & (MB_PAGE_SIZE - 1)) != 0);
  pthread_rwlockattr_t attr;
  int i;

  if (size_bytes > INT64_MAX)   /* size() returns int64_t */
    die ("mem_backing_new: size %" PRIu64 " too large", size_bytes);
  mb->size = size_bytes;
  mb->levels = 1;
  while (mb->levels * RADIX_SHIFT < 64 &&
         (UINT64_C(1) << (mb->levels * RADIX_SHIFT)) < npages)
    mb->levels++;
  mb->root = xcalloc (1, sizeof *mb->root);

  /* Writer preference: a stream of readers must not starve a writer
   * that a race test is waiting for. */
  pthread_rwlockattr_init (&attr);
  pthread_rwlockattr_setkind_np (&attr,
                                 PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  for (i = 0; i < NR_STRIPES; i++)
    pthread_rwlock_init (&mb->stripe[i], &attr);
  pthread_rwlockattr_destroy (&attr);
  pthread_mutex_init (&mb->fault_lock, NULL);
  pthread_mutex_init (&mb->gate_lock, NULL);
  pthread_mutex_init (&mb->read_log_lock, NULL);
  pthread_mutex_init (&mb->undo_lock, NULL);
  return mb;
}

static void
free_node (struct radix_node *n, unsigned level)
{
  unsigned i;

  for (i = 0; i < RADIX_FANOUT; i++) {
    void *child = atomic_load_explicit (&n->slot[i], memory_order_relaxed);

    if (child && level > 0)
      free_node (child, level - 1);
    else
      free (child);
  }
  free (n);
}

void
mem_backing_free (struct mem_backing *mb)
{
  struct mem_backing_gate *g, *next;
  int i;

  if (!mb)
    return;
  pthread_mutex_lock (&mb->gate_lock);
  if (mb->parked)
    die ("mem_backing_free: a request is still parked at a gate");
  for (g = mb->armed; g; g = next) {
    next = g->next;
    pthread_cond_destroy (&g->cond);
    free (g);
  }
  pthread_mutex_unlock (&mb->gate_lock);

  undo_clear (mb);
  free (mb->undo);
  free (mb->read_log);
  free_node (mb->root, mb->levels - 1);
  for (i = 0; i < NR_STRIPES; i++)
    pthread_rwlock_destroy (&mb->stripe[i]);
  pthread_mutex_destroy (&mb->fault_lock);
  pthread_mutex_destroy (&mb->gate_lock);
  pthread_mutex_destroy (&mb->read_log_lock);
  pthread_mutex_destroy (&mb->undo_lock);
  free (mb);
}
