/* bcachefilter engine: sorted key sets.  See bset.h for the design.
 *
 * The sets are plain sorted arrays: binary search for lookups, memmove
 * for inserts.  A leaf holds at most a node's worth of keys (about 10,000
 * for a 256 KiB node), so an insert moves at most a few hundred KiB of
 * memory, and usually much less; lookups, the hot path, are O(log n) with
 * no indirection.
 */
#include "config.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bset.h"

struct ckey
ckey_make (uint64_t inode, uint64_t end, uint64_t size, bool has_ptr,
           uint64_t ptr, bool dirty)
{
  struct ckey k = { 0 };
  struct bkey *b = ckey_bkey_mut (&k);

  bkey_init (b, inode, end, size);
  SET_KEY_PTRS (b, has_ptr ? 1 : 0);
  SET_KEY_DIRTY (b, dirty ? 1 : 0);
  k.ptr = has_ptr ? ptr : 0;
  return k;
}

void
ckey_cut_front (struct ckey *k, uint64_t n)
{
  uint64_t size = ckey_size (k);

  if (n > size)
    n = size;
  SET_KEY_SIZE (ckey_bkey_mut (k), size - n);
  /* The pointer moves with the start: for data it must name the new
   * first sector; for a check key it keeps the (pointer - start)
   * relation that keyset_replace_matches compares. */
  if (ckey_has_ptr (k))
    k->ptr = MAKE_PTR (PTR_GEN (k->ptr), PTR_OFFSET (k->ptr) + n,
                       PTR_DEV (k->ptr));
}

void
ckey_cut_back (struct ckey *k, uint64_t n)
{
  uint64_t size = ckey_size (k);

  if (n > size)
    n = size;
  SET_KEY_SIZE (ckey_bkey_mut (k), size - n);
  k->low -= n;
}

bool
ckey_from_bkey (const struct bkey *b, struct ckey *out)
{
  if (KEY_PTRS (b) > 1)
    return false;
  out->high = b->high;
  out->low = b->low;
  out->ptr = KEY_PTRS (b) ? b->ptr[0] : 0;
  return true;
}

/* ---- sharing (copy on write) ---------------------------------------------- */

struct keyset_share {
  atomic_uint ref;
  struct ckey *k;             /* the allocation: freed with the last
                                 reference */
};

struct keyset_share *
keyset_share (struct keyset *s)
{
  if (!s->share) {
    s->share = malloc (sizeof *s->share);
    if (!s->share)
      return NULL;
    atomic_init (&s->share->ref, 1);      /* the set's own reference */
    s->share->k = s->k - s->head;         /* the allocation, to free */
  }
  atomic_fetch_add_explicit (&s->share->ref, 1, memory_order_relaxed);
  return s->share;
}

void
keyset_share_put (struct keyset_share *sh)
{
  if (atomic_fetch_sub_explicit (&sh->ref, 1, memory_order_acq_rel) == 1) {
    free (sh->k);
    free (sh);
  }
}

int
keyset_unshare (struct keyset *s)
{
  struct keyset_share *sh = s->share;
  struct ckey *k;

  if (!sh)
    return 0;
  if (atomic_load_explicit (&sh->ref, memory_order_acquire) == 1) {
    /* Every other holder is done with it: it is ours again. */
    free (sh);
    s->share = NULL;
    return 0;
  }
  k = malloc ((s->cap ? s->cap : 1) * sizeof *k);
  if (!k)
    return -ENOMEM;
  if (s->nr)
    memcpy (k + s->head, s->k, s->nr * sizeof *k);
  s->k = k + s->head;
  s->share = NULL;
  keyset_share_put (sh);
  return 0;
}

/* ---- sets ------------------------------------------------------------------ */

static inline void
account (struct keyset *s, const struct ckey *k, int sign)
{
  s->words += (size_t) (sign * (int) bkey_u64s (ckey_bkey (k)));
  s->ndirty += (size_t) (sign * (int) ckey_dirty (k));
}

void
keyset_init (struct keyset *s, bool keep_whiteouts)
{
  s->k = NULL;
  s->nr = s->cap = s->head = 0;
  s->words = s->ndirty = 0;
  s->share = NULL;
  s->keep_whiteouts = keep_whiteouts;
}

/* Let go of the set's array: drop our reference if it is shared, else
 * free it.  The fields are the caller's to reset. */
static void
drop_array (struct keyset *s)
{
  if (s->share)
    keyset_share_put (s->share);
  else if (s->k)
    free (s->k - s->head);
  s->share = NULL;
}

void
keyset_free (struct keyset *s)
{
  drop_array (s);
  s->k = NULL;
  s->nr = s->cap = s->head = 0;
  s->words = s->ndirty = 0;
}

void
keyset_clear (struct keyset *s)
{
  if (s->share)
    keyset_free (s);          /* keep no copy of a shared array */
  else if (s->k) {
    s->k -= s->head;
    s->head = 0;
  }
  s->nr = 0;
  s->words = s->ndirty = 0;
}

/* Make the set's own array hold n keys.  A new array gets the room
 * after the keys (appending), or with centred, half of it before them
 * (inserting anywhere: see insert_at); it is also the set's own copy of
 * a shared one. */
static int
reserve (struct keyset *s, size_t n, bool centred)
{
  size_t cap, head;
  struct ckey *k;

  if (n <= s->cap && (centred || n <= s->cap - s->head))
    return keyset_unshare (s);
  cap = s->cap ? s->cap : 16;
  while (cap < n)
    cap *= 2;
  head = centred ? (cap - s->nr) / 2 : 0;
  k = malloc (cap * sizeof *k);
  if (!k)
    return -ENOMEM;
  if (s->nr)
    memcpy (k + head, s->k, s->nr * sizeof *k);
  drop_array (s);
  s->k = k + head;
  s->head = head;
  s->cap = cap;
  return 0;
}

int
keyset_reserve (struct keyset *s, size_t n)
{
  return reserve (s, n, false);
}

struct ckey *
keyset_steal (struct keyset *s, void **alloc)
{
  struct ckey *k;

  *alloc = NULL;
  if (keyset_unshare (s) < 0)
    return NULL;
  k = s->k;
  if (k)
    *alloc = k - s->head;
  s->k = NULL;
  s->nr = s->cap = s->head = 0;
  s->words = s->ndirty = 0;
  return k;
}

size_t
keyset_search (const struct keyset *s, uint64_t inode, uint64_t sector)
{
  size_t lo = 0, hi = s->nr;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (ckey_cmp_pos (&s->k[mid], inode, sector) <= 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

bool
keyset_contains (const struct keyset *s, const struct ckey *k)
{
  /* Keys do not overlap, so the only candidate is the first one ending
   * after k's start. */
  size_t i = keyset_search (s, ckey_inode (k), ckey_start (k));

  return i < s->nr && s->k[i].high == k->high && s->k[i].low == k->low &&
         (!ckey_has_ptr (k) || s->k[i].ptr == k->ptr);
}

bool
keyset_overlaps (const struct keyset *s, uint64_t inode, uint64_t start,
                 uint64_t end)
{
  size_t i = keyset_search (s, inode, start);

  return i < s->nr && ckey_inode (&s->k[i]) == inode &&
         ckey_start (&s->k[i]) < end;
}

/* Insert at index i, moving the shorter side of the array: the keys
 * before i down into the room before the array, or those from i up into
 * the room after it.  A leaf holds thousands of keys and a miss inserts
 * at a random place, so this halves the bytes moved per insert.  Needs
 * one free slot on either side (reserve). */
static void
insert_at (struct keyset *s, size_t i, const struct ckey *k)
{
  size_t tail_room = s->cap - s->head - s->nr;

  if (s->head > 0 && (i < s->nr - i || tail_room == 0)) {
    memmove (s->k - 1, s->k, i * sizeof *k);
    s->k--;
    s->head--;
  }
  else
    memmove (&s->k[i + 1], &s->k[i], (s->nr - i) * sizeof *k);
  s->k[i] = *k;
  s->nr++;
  account (s, k, 1);
}

/* Remove keys [i, i + n), closing the gap from the shorter side. */
static void
remove_range (struct keyset *s, size_t i, size_t n)
{
  if (n == 0)
    return;                     /* not even a memmove of the tail onto itself */
  for (size_t j = i; j < i + n; j++)
    account (s, &s->k[j], -1);
  if (i < s->nr - i - n) {
    memmove (&s->k[n], &s->k[0], i * sizeof s->k[0]);
    s->k += n;
    s->head += n;
  }
  else
    memmove (&s->k[i], &s->k[i + n], (s->nr - i - n) * sizeof s->k[0]);
  s->nr -= n;
}

int
keyset_insert (struct keyset *s, const struct ckey *k)
{
  const uint64_t inode = ckey_inode (k);
  const uint64_t start = ckey_start (k), end = ckey_end (k);
  bool add = ckey_has_ptr (k) || s->keep_whiteouts;
  size_t i, j;

  if (ckey_size (k) == 0)
    return 0;
  /* At most two new entries: the key itself and the tail of a key it
   * splits.  Reserve first so failure leaves the set untouched. */
  if (reserve (s, s->nr + 2, true) < 0)
    return -ENOMEM;

  i = keyset_search (s, inode, start);

  /* A key that straddles both ends of k is split in two. */
  if (i < s->nr && ckey_inode (&s->k[i]) == inode &&
      ckey_start (&s->k[i]) < start && ckey_end (&s->k[i]) > end) {
    struct ckey tail = s->k[i];

    ckey_cut_front (&tail, end - ckey_start (&tail));
    ckey_cut_back (&s->k[i], ckey_end (&s->k[i]) - start);
    insert_at (s, i + 1, &tail);
    if (add)
      insert_at (s, i + 1, k);
    return 0;
  }

  /* A key starting before k and ending inside it loses its tail. */
  if (i < s->nr && ckey_inode (&s->k[i]) == inode &&
      ckey_start (&s->k[i]) < start) {
    ckey_cut_back (&s->k[i], ckey_end (&s->k[i]) - start);
    i++;
  }

  /* Keys wholly inside k disappear.  k takes the slot of the first one,
   * so that replacing exactly one key (a fill replacing its check key, a
   * write over a cached extent of the same size) moves no other key: in
   * a leaf of thousands of keys, each memmove is most of an insert. */
  j = i;
  while (j < s->nr && ckey_inode (&s->k[j]) == inode &&
         ckey_end (&s->k[j]) <= end)
    j++;
  if (add && j > i) {
    account (s, &s->k[i], -1);
    s->k[i] = *k;
    account (s, k, 1);
    add = false;
    i++;
  }
  remove_range (s, i, j - i);

  /* A key starting inside k and ending after it loses its head. */
  if (i < s->nr && ckey_inode (&s->k[i]) == inode &&
      ckey_start (&s->k[i]) < end)
    ckey_cut_front (&s->k[i], end - ckey_start (&s->k[i]));

  if (add)
    insert_at (s, i, k);
  return 0;
}

bool
ckey_matches (const struct ckey *k, const struct ckey *expect)
{
  if (!ckey_has_ptr (k) || !ckey_has_ptr (expect))
    return false;
  if (ckey_dirty (k) != ckey_dirty (expect))
    return false;
  if (PTR_DEV (k->ptr) != PTR_DEV (expect->ptr) ||
      PTR_GEN (k->ptr) != PTR_GEN (expect->ptr))
    return false;
  /* Same location relation: ptr - start is invariant under trimming. */
  return PTR_OFFSET (k->ptr) - ckey_start (k) ==
         PTR_OFFSET (expect->ptr) - ckey_start (expect);
}

bool
keyset_replace_matches (const struct keyset *s, const struct ckey *k,
                        const struct ckey *expect)
{
  const uint64_t inode = ckey_inode (k);
  uint64_t pos = ckey_start (k);
  const uint64_t end = ckey_end (k);

  if (ckey_size (k) == 0)
    return false;
  for (size_t i = keyset_search (s, inode, pos); pos < end; i++) {
    if (i >= s->nr || ckey_inode (&s->k[i]) != inode ||
        ckey_start (&s->k[i]) > pos)
      return false;           /* a hole: something removed part of it */
    if (!ckey_matches (&s->k[i], expect))
      return false;
    pos = ckey_end (&s->k[i]);
  }
  return true;
}

int
keyset_put (struct keyset *s, const struct ckey *k)
{
  size_t i = keyset_search (s, ckey_inode (k), ckey_end (k));

  if (keyset_unshare (s) < 0)
    return -ENOMEM;
  if (i > 0 && ckey_cmp (&s->k[i - 1], k) == 0) {
    account (s, &s->k[i - 1], -1);
    s->k[i - 1] = *k;
    account (s, k, 1);
    return 0;
  }
  if (reserve (s, s->nr + 1, true) < 0)
    return -ENOMEM;
  insert_at (s, i, k);
  return 0;
}

int
keyset_del (struct keyset *s, const struct ckey *k)
{
  size_t i = keyset_search (s, ckey_inode (k), ckey_end (k));

  if (i > 0 && ckey_cmp (&s->k[i - 1], k) == 0) {
    if (keyset_unshare (s) < 0)
      return -ENOMEM;
    remove_range (s, i - 1, 1);
    return 1;
  }
  return 0;
}

/* Does extent a end before extent b starts (no overlap, a first)? */
static bool
ckey_before (const struct ckey *a, const struct ckey *b)
{
  return ckey_inode (a) != ckey_inode (b) ? ckey_inode (a) < ckey_inode (b)
         : ckey_end (a) <= ckey_start (b);
}

static void
emit (struct keyset *t, const struct ckey *k)
{
  t->k[t->nr++] = *k;
  account (t, k, 1);
}

int
keyset_insert_batch (struct keyset *s, const struct ckey *w, size_t n)
{
  struct keyset t;
  struct ckey cur;
  bool have = false;
  size_t i = 0, j = 0;

  /* Each key of w adds itself and at most one piece of a key it splits. */
  keyset_init (&t, s->keep_whiteouts);
  if (reserve (&t, s->nr + 2 * n, false) < 0)
    return -ENOMEM;
  for (;;) {
    const struct ckey *x = j < n ? &w[j] : NULL;

    if (!have && i < s->nr) {
      cur = s->k[i++];
      have = true;
    }
    if (x && ckey_size (x) == 0) {
      j++;                              /* ignored, as keyset_insert does */
      continue;
    }
    if (!have && !x)
      break;
    if (x && (!have || ckey_before (x, &cur))) {
      if (ckey_has_ptr (x) || t.keep_whiteouts)
        emit (&t, x);
      j++;
      continue;
    }
    if (!x || ckey_before (&cur, x)) {
      emit (&t, &cur);
      have = false;
      continue;
    }
    /* cur overlaps x: its part before x stays, its part inside x goes,
     * and its part after x waits for the next key of w (which may cut
     * it too). */
    if (ckey_start (&cur) < ckey_start (x)) {
      struct ckey head = cur;

      ckey_cut_back (&head, ckey_end (&head) - ckey_start (x));
      emit (&t, &head);
      ckey_cut_front (&cur, ckey_start (x) - ckey_start (&cur));
    }
    if (ckey_end (&cur) <= ckey_end (x))
      have = false;
    else {
      ckey_cut_front (&cur, ckey_end (x) - ckey_start (&cur));
      if (ckey_has_ptr (x) || t.keep_whiteouts)
        emit (&t, x);
      j++;
    }
  }
  drop_array (s);
  *s = t;                       /* t: s's keep_whiteouts, not shared */
  return 0;
}

int
keyset_remove_if (struct keyset *s,
                  int (*drop) (const struct ckey *k, void *arg), void *arg)
{
  size_t i, w = 0;
  int r = 0;

  /* Before drop's side effects: a copy that fails leaves nothing done. */
  if (keyset_unshare (s) < 0)
    return -ENOMEM;
  for (i = 0; i < s->nr; i++) {
    int d = drop (&s->k[i], arg);

    if (d < 0) {
      r = d;
      break;
    }
    if (d > 0) {
      account (s, &s->k[i], -1);
      continue;
    }
    if (w != i)
      s->k[w] = s->k[i];
    w++;
  }
  /* The keys not visited (drop failed) close the gap too. */
  if (w != i && i < s->nr)
    memmove (&s->k[w], &s->k[i], (s->nr - i) * sizeof *s->k);
  s->nr = w + (s->nr - i);
  return r;
}

int
keyset_append (struct keyset *s, const struct ckey *k)
{
  if (keyset_reserve (s, s->nr + 1) < 0)
    return -ENOMEM;
  s->k[s->nr++] = *k;
  account (s, k, 1);
  return 0;
}

const char *
keyset_check (const struct keyset *s, unsigned level)
{
  size_t words = 0, ndirty = 0;

  for (size_t i = 0; i < s->nr; i++) {
    words += bkey_u64s (ckey_bkey (&s->k[i]));
    ndirty += ckey_dirty (&s->k[i]);
  }
  if (words != s->words || ndirty != s->ndirty)
    return "key counters (words, dirty) out of date";
  for (size_t i = 0; i < s->nr; i++) {
    const struct ckey *k = &s->k[i];

    if (level == 0 && ckey_size (k) > ckey_end (k))
      return "key size exceeds its offset";
    if (level == 0 && ckey_size (k) == 0)
      return "zero-size extent";
    if (level == 0 && !ckey_has_ptr (k) && !s->keep_whiteouts)
      return "whiteout in a merged leaf";
    if (i == 0)
      continue;
    if (ckey_cmp (&s->k[i - 1], k) >= 0)
      return "keys out of order";
    if (level == 0 && ckey_inode (&s->k[i - 1]) == ckey_inode (k) &&
        ckey_end (&s->k[i - 1]) > ckey_start (k))
      return "overlapping extents";
  }
  return NULL;
}
