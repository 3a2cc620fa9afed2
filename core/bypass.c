/* bcachefilter engine: the in-flight backing-write tracker.  See
 * bypass.h for what it is for.
 *
 * Layout.  One 32-bit word per 32 MiB chunk of the backing store.  The
 * words live in 4 KiB pages of 1024 words (32 GiB of backing store per
 * page); the page table is an array of npages atomic pointers (8 bytes
 * per 32 GiB: 256 B per TiB) and a NULL entry means "no write registered
 * anywhere in these 32 GiB".  A page is allocated when the first write
 * registers in it and leaves the table again when the last one ends.
 * Memory: page table alone when idle (plus a reserve of at most
 * BYPASS_RESERVE pages), table + npages * 4 KiB at peak (the reserve is
 * kept to min (BYPASS_RESERVE, npages - live pages), so it is empty when
 * every page is live).  bcf_bypass_get_mem reports the figures.
 *
 * The word: the number of writes registered in the chunk (32 bits; a
 * chunk would need 2^32 writes in flight at once to overflow).
 *
 * The exact ranges: every token is linked, in registration order, into
 * a list under t->lock (prev/next live in the token, on the writer's
 * stack), with its byte range, its seq and its done flag.
 *
 * Locking.  begin, wait_turn, done, end, get_mem and busy's exact check
 * serialise on t->lock; all changes to the table and the words happen
 * under it (made with atomic stores, because busy's fast path reads them
 * without the lock).  begin is all-or-nothing for the counters: under
 * the lock it first holds every page the range lacks, then links the
 * pages and increments the words without dropping the lock, so a waiting
 * begin never holds a partial registration.  Pages come from, in order:
 * the retired list, malloc, the reserve (counted in reserve_uses);
 * reserve pages that could never be needed (live + reserve = npages) are
 * used first.  If all fail, begin unlinks the (still empty) pages it
 * linked and waits on t->cond (woken by every end, and every 10 ms to
 * retry malloc).  It never fails and never skips tracking.  Unlinked
 * pages refill the reserve first; the rest are retired.
 *
 * wait_turn waits on t->order (broadcast by done and end) while an
 * earlier token in the list overlaps its range and is not done.  The
 * list is in registration order, so "earlier" is "before it in the
 * list", and a token only ever waits for tokens before it: waits form no
 * cycle.
 *
 * Absorption (bypass.h).  wait_turn_write first looks, under the lock,
 * for earlier tokens that are waiting (in wait_turn_write, before their
 * turn), absorbable, not absorbed yet, and inside its range, and takes
 * them over: absorber = it, done = true.  Why that keeps the ordering:
 *  - an absorbed token P never writes: its waiter sees P->absorber when
 *    it wakes (it checks before its turn, under the lock, and a token is
 *    absorbed only while waiting is set, which the waiter clears under
 *    the same lock when its turn comes), and then only waits for
 *    absorbed_done.  So done = true is true of P: later overlapping
 *    writes need not wait for it;
 *  - whatever P waited for overlaps P, so it overlaps its absorber A (P
 *    is inside A), registered earlier than A: A waits for it;
 *  - P completes only when A ends (end_write sets absorbed_done and
 *    absorbed_rc of every token whose absorber it is, under the lock,
 *    before A leaves the list), so P is acknowledged after A's data
 *    landed, over all of P's range;
 *  - A may itself be absorbed later by B: then A never writes either,
 *    and its waiter, woken by B's end, ends A with B's result, which
 *    reaches P.  Absorbers are always later than what they absorb, so
 *    these waits form no cycle; and the chain ends with the one write
 *    that got its turn, which no one can absorb any more.
 * A token absorbed while a write between the two registrations overlaps
 * it lets that write go first: P and it were both in flight, so the
 * order "that write, then P, then A over P" is one the client allows, and
 * A lands last over P's range as that order says.
 *
 * busy's exact check: a miss whose chunks have a non-zero count takes
 * t->lock and looks for a token whose byte range overlaps.  Every token
 * whose increment the fast path saw is in the list by then: the token is
 * linked in the same critical section as its increment, and the reader's
 * load of the increment happens after that section began, so its
 * acquisition of t->lock comes after the registering thread's release.
 *
 * busy()'s fast path is lock-free.  The guarantee it gives: if W does
 * begin() and
 * then releases a mutex M, and R later acquires M and calls busy(), R
 * sees W's registration (unless W ended meanwhile).  Argument: W's store
 * of the page pointer (if W linked the page) and W's store to the word
 * are sequenced before W's unlock of M, which synchronises with R's lock
 * of M, which is sequenced before R's loads.  So both stores happen
 * before R's loads and by write-read coherence R's load of the pointer
 * returns W's page or a later value of the entry, and its load of the
 * word returns W's increment or a later value.  A later pointer value
 * means the page was unlinked, which needs every count in it to be 0,
 * hence W's end; a later word value is another registration or an end.
 * (Later-unlinked pages can be relinked elsewhere, see below: a reader
 * holding such a stale pointer reads counts of another chunk — a false
 * "busy" at worst, and only for writes that are concurrent with it.)  So
 * for the guarantee the word loads can be relaxed; the pointer load is
 * acquire at least so that the zeroing of a freshly linked page (relaxed
 * atomic stores before the release store of the pointer) is seen.
 *
 * Reclamation.  busy() may read a page that end() is unlinking.  Pages
 * are only ever handed back to malloc after a grace period: busy()
 * increments the global atomic t->readers before loading any page
 * pointer and decrements it after its last word load; an unlinked page
 * goes to the reserve or the retired list (never straight to free), and
 * the retired list is freed only by a thread (holding t->lock) that
 * loads t->readers == 0 after the unlink.  Reuse inside the tracker
 * (reserve, retired, relinking) is safe without a grace period because
 * every access to page memory is atomic (the retired-list link is also
 * kept in the page's first two words with atomic stores).  Why the free
 * is safe: the reader's increment and pointer load and the freer's
 * unlinking store (NULL) and load of t->readers are all seq_cst, so they
 * lie in one total order S.  If the reader's pointer load returned the
 * page, it precedes the NULL store in S, so the reader's increment
 * precedes the freer's readers load in S, and that load (reading the
 * latest modification before it) can only return 0 if the reader's
 * decrement also came before it; that decrement is a seq_cst RMW, so the
 * load synchronises with it and the reader's word loads happen before
 * free().  Otherwise the reader loaded NULL or a newer pointer and never
 * touches the page.  The freer never waits for readers: if some are
 * active, the retired pages stay (and are reused first) until a later
 * begin, end or get_mem sees t->readers == 0.  Memory stays bounded
 * anyway: malloc is only called when the retired list is empty and
 * live + reserve <= npages always holds, so live + reserve + retired
 * never exceeds npages.  A read-miss pays two atomic
 * RMWs on a shared counter, next to a backing read of about 1 ms, and
 * in a chunk where a write is in flight, one lock and a walk of the
 * writes in flight (a few dozen at the queue depths NBD clients use).
 */
#include "config.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bypass.h"
#include "util.h"

#define CHUNK_SIZE    (UINT64_C (1) << BCF_BYPASS_CHUNK_SHIFT)
#define PAGE_WORDS    1024
#define PAGE_SHIFT    10              /* log2 (PAGE_WORDS) */
#define PAGE_BYTES    (PAGE_WORDS * sizeof (uint32_t))
#define BYPASS_RESERVE 4
#define RETRY_NS      (10 * 1000 * 1000)

struct page {
  _Atomic uint32_t w[PAGE_WORDS];
};

_Static_assert (sizeof (struct page) == 4096, "a page is 4 KiB");

struct bcf_bypass {
  uint64_t size, nchunks, npages;
  _Atomic (struct page *) *table;

  /* busy() callers in flight: the reclamation grace period. */
  _Atomic uint64_t readers;
  atomic_bool disabled;             /* tests: busy() says false */

  pthread_mutex_t lock;             /* everything below */
  pthread_cond_t cond;              /* an end happened (pages) */
  pthread_cond_t order;             /* a done or an end happened */
  unsigned waiters;
  /* The exact ranges, oldest first. */
  struct bcf_bypass_token *head, *tail;
  uint64_t next_seq;
  atomic_bool no_ordering;          /* tests: wait_turn returns at once */
  uint64_t in_flight_peak, exact_checks, waits, wait_ns, wait_max_ns;
  uint64_t absorbed, waiting;
  struct page *reserve[BYPASS_RESERVE];
  uint64_t nreserve;
  struct page *retired;             /* linked through w[0], w[1] */
  uint64_t nretired;
  uint64_t live;                    /* pages in the table */
  uint64_t peak_bytes, reserve_uses, in_flight;
  bool fail_alloc;                  /* tests: page malloc fails */
};

/* ---- Pages (all under t->lock) ------------------------------------------ */

static uint64_t
mem_bytes (const struct bcf_bypass *t)
{
  return t->npages * sizeof t->table[0] +
    (t->live + t->nreserve + t->nretired) * PAGE_BYTES;
}

static void
note_peak (struct bcf_bypass *t)
{
  uint64_t b = mem_bytes (t);

  if (b > t->peak_bytes)
    t->peak_bytes = b;
}

static struct page *
page_malloc (struct bcf_bypass *t)
{
  if (t->fail_alloc)
    return NULL;
  return malloc (sizeof (struct page));
}

static uint64_t
reserve_target (const struct bcf_bypass *t)
{
  uint64_t room = t->npages - t->live;

  return room < BYPASS_RESERVE ? room : BYPASS_RESERVE;
}

static void
retire (struct bcf_bypass *t, struct page *p)
{
  uintptr_t next = (uintptr_t) t->retired;

  /* Stale readers may still read p: atomic stores only. */
  atomic_store_explicit (&p->w[0], (uint32_t) next, memory_order_relaxed);
  atomic_store_explicit (&p->w[1], (uint32_t) ((uint64_t) next >> 32),
                         memory_order_relaxed);
  t->retired = p;
  t->nretired++;
}

static struct page *
unretire (struct bcf_bypass *t)
{
  struct page *p = t->retired;
  uint64_t next;

  if (p == NULL)
    return NULL;
  next = atomic_load_explicit (&p->w[0], memory_order_relaxed) |
    (uint64_t) atomic_load_explicit (&p->w[1], memory_order_relaxed) << 32;
  t->retired = (struct page *) (uintptr_t) next;
  t->nretired--;
  return p;
}

/* Free the retired pages if no busy() can still be reading them. */
static void
drain_retired (struct bcf_bypass *t)
{
  struct page *p;

  if (t->retired == NULL ||
      atomic_load_explicit (&t->readers, memory_order_seq_cst) != 0)
    return;
  while ((p = unretire (t)) != NULL)
    free (p);
}

/* Keep the reserve at its target: surplus goes to the retired list,
 * shortfall is refilled by malloc while it works. */
static void
reserve_adjust (struct bcf_bypass *t)
{
  uint64_t target = reserve_target (t);

  while (t->nreserve > target)
    retire (t, t->reserve[--t->nreserve]);
  while (t->nreserve < target) {
    struct page *p = unretire (t);

    if (p == NULL && (p = page_malloc (t)) == NULL)
      break;
    t->reserve[t->nreserve++] = p;
  }
}

/* A page to link, or NULL: from the retired list, malloc, or the
 * reserve.  Reserve pages beyond what the unlinked slots could ever need
 * are surplus and used first, so that live + reserve <= npages. */
static struct page *
page_get (struct bcf_bypass *t, uint64_t *uses)
{
  struct page *p;

  if (t->nreserve > 0 && t->live + t->nreserve >= t->npages)
    return t->reserve[--t->nreserve];
  if ((p = unretire (t)) != NULL || (p = page_malloc (t)) != NULL)
    return p;
  if (t->nreserve > 0) {
    (*uses)++;
    return t->reserve[--t->nreserve];
  }
  return NULL;
}

static void
page_link (struct bcf_bypass *t, uint64_t pg, struct page *p)
{
  for (unsigned i = 0; i < PAGE_WORDS; i++)
    atomic_store_explicit (&p->w[i], 0, memory_order_relaxed);
  atomic_store_explicit (&t->table[pg], p, memory_order_seq_cst);
  t->live++;
}

/* Unlink page pg if no write is registered in it. */
static void
page_maybe_unlink (struct bcf_bypass *t, uint64_t pg)
{
  struct page *p = atomic_load_explicit (&t->table[pg], memory_order_relaxed);

  for (unsigned i = 0; i < PAGE_WORDS; i++)
    if (atomic_load_explicit (&p->w[i], memory_order_relaxed))
      return;
  atomic_store_explicit (&t->table[pg], NULL, memory_order_seq_cst);
  t->live--;
  if (t->nreserve < reserve_target (t))
    t->reserve[t->nreserve++] = p;
  else
    retire (t, p);
}

/* ---- Ranges ------------------------------------------------------------- */

/* Chunks [*first, *first + *n) overlapping [offset, offset + len),
 * clamped to the size. */
static void
chunk_range (const struct bcf_bypass *t, uint64_t offset, uint64_t len,
             uint64_t *first, uint64_t *n)
{
  uint64_t last;

  *first = *n = 0;
  if (len == 0 || offset >= t->size)
    return;
  if (len > t->size - offset)
    len = t->size - offset;
  *first = offset >> BCF_BYPASS_CHUNK_SHIFT;
  last = (offset + len - 1) >> BCF_BYPASS_CHUNK_SHIFT;
  *n = last - *first + 1;
}

static _Atomic uint32_t *
word_of (struct bcf_bypass *t, uint64_t c)
{
  struct page *p = atomic_load_explicit (&t->table[c >> PAGE_SHIFT],
                                         memory_order_relaxed);

  return &p->w[c & (PAGE_WORDS - 1)];
}

/* ---- API ---------------------------------------------------------------- */

struct bcf_bypass *
bcf_bypass_new (uint64_t size)
{
  struct bcf_bypass *t = calloc (1, sizeof *t);

  if (t == NULL)
    return NULL;
  t->size = size;
  t->nchunks = size / CHUNK_SIZE + (size % CHUNK_SIZE != 0);
  t->npages = (t->nchunks + PAGE_WORDS - 1) / PAGE_WORDS;
  if (t->npages > 0) {
    t->table = calloc (t->npages, sizeof t->table[0]);
    if (t->table == NULL) {
      free (t);
      return NULL;
    }
    for (uint64_t i = 0; i < t->npages; i++)
      atomic_init (&t->table[i], NULL);
  }
  atomic_init (&t->readers, 0);
  atomic_init (&t->disabled, false);
  pthread_mutex_init (&t->lock, NULL);
  bcf_cond_init_monotonic (&t->cond);
  pthread_cond_init (&t->order, NULL);
  atomic_init (&t->no_ordering, false);
  reserve_adjust (t);
  note_peak (t);
  return t;
}

void
bcf_bypass_free (struct bcf_bypass *t)
{
  struct page *p;

  if (t == NULL)
    return;
  for (uint64_t i = 0; i < t->npages; i++)
    free (atomic_load_explicit (&t->table[i], memory_order_relaxed));
  while (t->nreserve > 0)
    free (t->reserve[--t->nreserve]);
  while ((p = unretire (t)) != NULL)
    free (p);
  free (t->table);
  pthread_cond_destroy (&t->cond);
  pthread_cond_destroy (&t->order);
  pthread_mutex_destroy (&t->lock);
  free (t);
}

static void
wait_a_bit (struct bcf_bypass *t)
{
  struct timespec ts = bcf_ns_to_timespec (bcf_now_ns () + RETRY_NS);

  t->waiters++;
  pthread_cond_timedwait (&t->cond, &t->lock, &ts);
  t->waiters--;
}

/* Under the lock: link a page into every page slot of the range that
 * lacks one, all or nothing.  False (nothing changed) if pages ran out.
 * Linking empty pages early is harmless: readers see zero counts. */
static bool
range_pages (struct bcf_bypass *t, uint64_t first, uint64_t n)
{
  uint64_t pg0 = first >> PAGE_SHIFT, pg1 = (first + n - 1) >> PAGE_SHIFT;
  uint64_t uses = 0;

  for (uint64_t pg = pg0; pg <= pg1; pg++) {
    struct page *p;

    if (atomic_load_explicit (&t->table[pg], memory_order_relaxed) != NULL)
      continue;
    if ((p = page_get (t, &uses)) == NULL) {
      /* Outside begin's critical section every linked page holds a
       * registration, so the empty pages before pg are the ones we
       * just linked: take them out again. */
      for (uint64_t q = pg0; q < pg; q++)
        page_maybe_unlink (t, q);
      return false;
    }
    page_link (t, pg, p);
  }
  t->reserve_uses += uses;      /* only for a begin that went through */
  return true;
}

/* Link tok at the tail of the in-flight list.  Under the lock. */
static void
list_add (struct bcf_bypass *t, struct bcf_bypass_token *tok)
{
  tok->seq = ++t->next_seq;
  tok->done = false;
  tok->waiting = false;
  tok->absorbed_done = false;
  tok->absorbed_rc = 0;
  tok->absorber = NULL;
  tok->next = NULL;
  tok->prev = t->tail;
  if (t->tail)
    t->tail->next = tok;
  else
    t->head = tok;
  t->tail = tok;
}

static void
list_del (struct bcf_bypass *t, struct bcf_bypass_token *tok)
{
  if (tok->prev)
    tok->prev->next = tok->next;
  else
    t->head = tok->next;
  if (tok->next)
    tok->next->prev = tok->prev;
  else
    t->tail = tok->prev;
  tok->prev = tok->next = NULL;
}

/* Does tok's range overlap [start, end)?  Empty ranges overlap nothing. */
static bool
overlaps (const struct bcf_bypass_token *tok, uint64_t start, uint64_t end)
{
  return tok->start < tok->end && start < end &&
         tok->start < end && start < tok->end;
}

void
bcf_bypass_begin (struct bcf_bypass *t, uint64_t offset, uint64_t len,
                  struct bcf_bypass_token *tok)
{
  bcf_bypass_begin_write (t, offset, len, 0, tok);
}

void
bcf_bypass_begin_write (struct bcf_bypass *t, uint64_t offset, uint64_t len,
                        unsigned flags, struct bcf_bypass_token *tok)
{
  uint64_t first, n;

  tok->flags = flags;

  chunk_range (t, offset, len, &first, &n);
  tok->first = first;
  tok->nchunks = n;
  tok->start = offset < t->size ? offset : t->size;
  tok->end = len > t->size - tok->start ? t->size : tok->start + len;

  pthread_mutex_lock (&t->lock);
  t->in_flight++;
  if (t->in_flight > t->in_flight_peak)
    t->in_flight_peak = t->in_flight;
  while (n > 0 && !range_pages (t, first, n)) {
    /* Out of pages: let the retired ones go if possible, then wait for
     * an end (or 10 ms, for malloc to work again).  Not in the list yet:
     * a writer waiting for a page is not registered, so no later writer
     * waits for it (which could wait for ever, if every page holder did). */
    drain_retired (t);
    wait_a_bit (t);
  }
  /* Registered: in the list and in the counters, in one critical
   * section (busy's exact check relies on it). */
  list_add (t, tok);
  if (n == 0) {
    pthread_mutex_unlock (&t->lock);
    return;
  }
  for (uint64_t c = first; c < first + n; c++) {
    _Atomic uint32_t *w = word_of (t, c);

    atomic_store_explicit (w, atomic_load_explicit (w, memory_order_relaxed)
                           + 1, memory_order_relaxed);
  }
  reserve_adjust (t);
  drain_retired (t);
  note_peak (t);
  pthread_mutex_unlock (&t->lock);
}

/* An earlier overlapping write that is not done yet?  Under the lock. */
static bool
must_wait (const struct bcf_bypass_token *tok)
{
  for (const struct bcf_bypass_token *p = tok->prev; p; p = p->prev)
    if (!p->done && overlaps (p, tok->start, tok->end))
      return true;
  return false;
}

/* Take over the earlier writes tok covers that are still waiting
 * (absorption: see the top of the file).  Under the lock. */
static void
absorb_earlier (struct bcf_bypass *t, struct bcf_bypass_token *tok)
{
  bool any = false;

  if (!(tok->flags & BCF_BYPASS_ABSORB))
    return;
  for (struct bcf_bypass_token *p = tok->prev; p; p = p->prev)
    if (p->waiting && !p->absorber && (p->flags & BCF_BYPASS_ABSORB) &&
        p->start < p->end && tok->start <= p->start && p->end <= tok->end &&
        (!(p->flags & BCF_BYPASS_FUA) || (tok->flags & BCF_BYPASS_FUA))) {
      p->absorber = tok;
      p->done = true;
      t->absorbed++;
      any = true;
    }
  /* Writes registered between an absorbed one and tok may wait for it
   * (a flush-like barrier over the whole store, say, which tok then
   * waits for): done changed, so they look again now. */
  if (any)
    pthread_cond_broadcast (&t->order);
}

/* Count a wait that took waited ns.  Under the lock. */
static void
count_wait (struct bcf_bypass *t, uint64_t waited)
{
  t->waits++;
  t->wait_ns += waited;
  if (waited > t->wait_max_ns)
    t->wait_max_ns = waited;
}

/* Under the lock: wait until tok's turn, or, if a later write absorbed
 * it, until that one ended; count the wait.  client: a wait_turn_write
 * (counted in t->waiting, and absorbable while it waits if its flags
 * say so).  Returns the nanoseconds waited. */
static uint64_t
wait_locked (struct bcf_bypass *t, struct bcf_bypass_token *tok, bool client)
{
  uint64_t t0, waited;

  if (!must_wait (tok))
    return 0;
  t0 = bcf_now_ns ();
  if (client) {
    tok->waiting = true;
    t->waiting++;
  }
  do
    pthread_cond_wait (&t->order, &t->lock);
  while (!tok->absorber && must_wait (tok));
  if (client) {
    tok->waiting = false;
    t->waiting--;
  }
  while (tok->absorber && !tok->absorbed_done)
    pthread_cond_wait (&t->order, &t->lock);
  waited = bcf_now_ns () - t0;
  count_wait (t, waited);
  return waited;
}

bool
bcf_bypass_wait_turn_write (struct bcf_bypass *t,
                            struct bcf_bypass_token *tok, int *rc)
{
  bool absorbed;

  if (atomic_load_explicit (&t->no_ordering, memory_order_relaxed))
    return false;
  pthread_mutex_lock (&t->lock);
  absorb_earlier (t, tok);
  wait_locked (t, tok, true);
  absorbed = tok->absorber != NULL;
  if (absorbed)
    *rc = tok->absorbed_rc;
  pthread_mutex_unlock (&t->lock);
  return absorbed;
}

uint64_t
bcf_bypass_wait_turn (struct bcf_bypass *t, struct bcf_bypass_token *tok)
{
  uint64_t waited;

  if (atomic_load_explicit (&t->no_ordering, memory_order_relaxed))
    return 0;
  pthread_mutex_lock (&t->lock);
  waited = wait_locked (t, tok, false);
  pthread_mutex_unlock (&t->lock);
  return waited;
}

void
bcf_bypass_done (struct bcf_bypass *t, struct bcf_bypass_token *tok)
{
  pthread_mutex_lock (&t->lock);
  tok->done = true;
  pthread_cond_broadcast (&t->order);
  pthread_mutex_unlock (&t->lock);
}

void
bcf_bypass_end (struct bcf_bypass *t, struct bcf_bypass_token *tok)
{
  bcf_bypass_end_write (t, tok, -EIO);
}

void
bcf_bypass_end_write (struct bcf_bypass *t, struct bcf_bypass_token *tok,
                      int rc)
{
  uint64_t first = tok->first, n = tok->nchunks;
  bool page_emptied = false;

  pthread_mutex_lock (&t->lock);
  t->in_flight--;
  /* What tok absorbed completes with its result (all of it is earlier
   * in the list, still linked: each waits for this). */
  for (struct bcf_bypass_token *p = tok->flags & BCF_BYPASS_ABSORB ? tok->prev
                                   : NULL; p; p = p->prev)
    if (p->absorber == tok) {
      p->absorbed_rc = rc;
      p->absorbed_done = true;
    }
  list_del (t, tok);
  pthread_cond_broadcast (&t->order);
  for (uint64_t c = first; c < first + n; c++) {
    _Atomic uint32_t *w = word_of (t, c);
    uint32_t old = atomic_load_explicit (w, memory_order_relaxed);

    atomic_store_explicit (w, old - 1, memory_order_relaxed);
    if (old == 1)
      page_emptied = true;
    /* At the last chunk of each page, unlink it if now empty. */
    if (page_emptied &&
        ((c & (PAGE_WORDS - 1)) == PAGE_WORDS - 1 || c == first + n - 1)) {
      page_maybe_unlink (t, c >> PAGE_SHIFT);
      page_emptied = false;
    }
  }
  if (n > 0) {
    reserve_adjust (t);
    drain_retired (t);
  }
  if (t->waiters)
    pthread_cond_broadcast (&t->cond);
  pthread_mutex_unlock (&t->lock);
}

/* The exact check behind the counters: a token overlapping the range?
 * Under no lock (takes it). */
static bool
exact_busy (struct bcf_bypass *t, uint64_t offset, uint64_t len)
{
  uint64_t start = offset, end = len > UINT64_MAX - offset ? UINT64_MAX
                                                           : offset + len;
  bool busy = false;

  pthread_mutex_lock (&t->lock);
  t->exact_checks++;
  for (const struct bcf_bypass_token *p = t->head; p && !busy; p = p->next)
    busy = overlaps (p, start, end);
  pthread_mutex_unlock (&t->lock);
  return busy;
}

bool
bcf_bypass_busy (struct bcf_bypass *t, uint64_t offset, uint64_t len)
{
  uint64_t first, n;
  bool busy = false;

  if (atomic_load_explicit (&t->disabled, memory_order_relaxed))
    return false;
  chunk_range (t, offset, len, &first, &n);
  if (n == 0)
    return false;

  atomic_fetch_add_explicit (&t->readers, 1, memory_order_seq_cst);
  for (uint64_t c = first; c < first + n && !busy; ) {
    uint64_t pg = c >> PAGE_SHIFT;
    uint64_t pg_end = (pg + 1) << PAGE_SHIFT;
    uint64_t stop = first + n < pg_end ? first + n : pg_end;
    struct page *p = atomic_load_explicit (&t->table[pg],
                                           memory_order_seq_cst);

    if (p != NULL) {
      for (; c < stop; c++)
        if (atomic_load_explicit (&p->w[c & (PAGE_WORDS - 1)],
                                  memory_order_relaxed)) {
          busy = true;
          break;
        }
    }
    c = stop;
  }
  atomic_fetch_sub_explicit (&t->readers, 1, memory_order_seq_cst);
  /* A write in the chunks: does one really overlap? */
  return busy && exact_busy (t, offset, len);
}

void
bcf_bypass_get_mem (struct bcf_bypass *t, struct bcf_bypass_mem *m)
{
  pthread_mutex_lock (&t->lock);
  drain_retired (t);
  m->bytes = mem_bytes (t);
  m->peak_bytes = t->peak_bytes;
  m->pages = t->live;
  m->reserve_pages = t->nreserve;
  m->reserve_uses = t->reserve_uses;
  m->in_flight = t->in_flight;
  m->in_flight_peak = t->in_flight_peak;
  m->exact_checks = t->exact_checks;
  m->waits = t->waits;
  m->absorbed = t->absorbed;
  m->waiting = t->waiting;
  m->wait_ns = t->wait_ns;
  m->wait_max_ns = t->wait_max_ns;
  pthread_mutex_unlock (&t->lock);
}

void
bcf_bypass_test_disable (struct bcf_bypass *t, bool disabled)
{
  atomic_store (&t->disabled, disabled);
}

void
bcf_bypass_test_disable_ordering (struct bcf_bypass *t, bool disabled)
{
  atomic_store (&t->no_ordering, disabled);
}

void
bcf_bypass_test_fail_alloc (struct bcf_bypass *t, bool fail)
{
  pthread_mutex_lock (&t->lock);
  t->fail_alloc = fail;
  pthread_mutex_unlock (&t->lock);
}
