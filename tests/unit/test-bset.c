/* Unit tests for core/bset: sorted extent sets.
 *
 * The main test is model based: a long random mix of extent inserts,
 * whiteouts, check keys and replaces is applied both to a keyset and to a
 * reference "one slot per sector" map, and after every operation the set
 * is expanded sector by sector and compared with the map.  The seed comes
 * from TEST_SEED or the clock and is printed first, so any failure can be
 * replayed exactly.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <check.h>

#include "bset.h"
#include "testlib.h"

static unsigned seed;

/* ---- The reference model ------------------------------------------------ */
#define M_INODES  3
#define M_SECTORS 2048

/* What a sector holds: nothing, or the pointer of its own sector. */
struct slot {
  bool present;
  bool dirty;
  uint64_t dev, gen, offset;   /* pointer to this very sector */
};
static struct slot model[M_INODES][M_SECTORS];

static void
model_insert (const struct ckey *k)
{
  uint64_t ino = ckey_inode (k);
  for (uint64_t s = ckey_start (k); s < ckey_end (k); s++) {
    struct slot *sl = &model[ino][s];
    sl->present = ckey_has_ptr (k);
    if (sl->present) {
      sl->dirty = ckey_dirty (k);
      sl->dev = PTR_DEV (k->ptr);
      sl->gen = PTR_GEN (k->ptr);
      sl->offset = PTR_OFFSET (k->ptr) + (s - ckey_start (k));
    }
  }
}

static bool
model_replace_matches (const struct ckey *k, const struct ckey *expect)
{
  uint64_t ino = ckey_inode (k);
  for (uint64_t s = ckey_start (k); s < ckey_end (k); s++) {
    const struct slot *sl = &model[ino][s];
    if (!sl->present || sl->dirty != ckey_dirty (expect) ||
        sl->dev != PTR_DEV (expect->ptr) || sl->gen != PTR_GEN (expect->ptr) ||
        sl->offset - s != PTR_OFFSET (expect->ptr) - ckey_start (expect))
      return false;
  }
  return ckey_size (k) > 0;
}

/* Expand the set and compare with the model, sector by sector. */
static void
compare (const struct keyset *set, uint64_t op)
{
  static struct slot got[M_INODES][M_SECTORS];
  const char *why = keyset_check (set, 0);

  ck_assert_msg (why == NULL, "seed %u op %" PRIu64 ": %s", seed, op, why);
  memset (got, 0, sizeof got);
  for (size_t i = 0; i < set->nr; i++) {
    const struct ckey *k = &set->k[i];
    for (uint64_t s = ckey_start (k); s < ckey_end (k); s++) {
      struct slot *sl = &got[ckey_inode (k)][s];
      sl->present = true;
      sl->dirty = ckey_dirty (k);
      sl->dev = PTR_DEV (k->ptr);
      sl->gen = PTR_GEN (k->ptr);
      sl->offset = PTR_OFFSET (k->ptr) + (s - ckey_start (k));
    }
  }
  for (int i = 0; i < M_INODES; i++)
    for (int s = 0; s < M_SECTORS; s++) {
      const struct slot *a = &model[i][s], *b = &got[i][s];
      check_msg (a->present == b->present &&
                 (!a->present ||
                  (a->dirty == b->dirty && a->dev == b->dev &&
                   a->gen == b->gen && a->offset == b->offset)),
                 "seed %u op %" PRIu64 ": inode %d sector %d differs "
                 "(model %s, set %s)", seed, op, i, s,
                 a->present ? "data" : "hole",
                 b->present ? "data" : "hole");
    }
}

static struct ckey
random_extent (bool allow_whiteout)
{
  uint64_t ino = rnd_below (M_INODES);
  uint64_t size = 1 + (rnd () % 4 == 0 ? rnd_below (512) : rnd_below (16));
  uint64_t start = rnd_below (M_SECTORS - size);
  bool ptr = !allow_whiteout || rnd_below (5) != 0;
  return ckey_make (ino, start + size, size, ptr,
                    MAKE_PTR ((uint8_t) rnd (), rnd_below (1ull << 40), 0),
                    rnd_below (3) == 0);
}

/* keyset_insert (set, k) must succeed (op: for the message). */
static void
insert_ok (struct keyset *set, const struct ckey *k, uint64_t op)
{
  int r = keyset_insert (set, k);

  check_msg (r == 0, "seed %u op %" PRIu64 ": keyset_insert: %d", seed, op,
             r);
}

START_TEST (test_model_random)
{
  struct keyset set;
  struct ckey pending[8];
  unsigned npending = 0;
  const uint64_t ops = getenv ("TEST_BSET_OPS")
                       ? strtoull (getenv ("TEST_BSET_OPS"), NULL, 0) : 2000000;

  memset (model, 0, sizeof model);
  keyset_init (&set, false);
  rng_state = seed * 0x9E3779B97F4A7C15ull + 1;

  for (uint64_t op = 0; op < ops; op++) {
    unsigned what = (unsigned) rnd_below (10);

    if (what < 5) {                     /* write or whiteout */
      struct ckey k = random_extent (true);
      model_insert (&k);
      insert_ok (&set, &k, op);
    }
    else if (what < 7 && npending < 8) { /* read miss: check key */
      struct ckey c = random_extent (false);
      c = ckey_make (ckey_inode (&c), ckey_end (&c), ckey_size (&c), true,
                     MAKE_PTR (0, rnd_below (1ull << 40), PTR_CHECK_DEV),
                     false);
      model_insert (&c);
      insert_ok (&set, &c, op);
      pending[npending++] = c;
    }
    else if (npending > 0) {            /* miss completes: replace */
      unsigned idx = (unsigned) rnd_below (npending);
      struct ckey c = pending[idx];
      struct ckey data = ckey_make (ckey_inode (&c), ckey_end (&c),
                                    ckey_size (&c), true,
                                    MAKE_PTR (1, rnd_below (1ull << 40), 0),
                                    false);
      bool want = model_replace_matches (&data, &c);
      bool got = keyset_replace_matches (&set, &data, &c);

      check_msg (want == got, "seed %u op %" PRIu64
                 ": replace_matches %d, model says %d", seed, op, got,
                 want);
      if (got) {
        model_insert (&data);
        insert_ok (&set, &data, op);
      }
      pending[idx] = pending[--npending];
    }
    if (op % 10007 == 0 || op == ops - 1)
      compare (&set, op);
  }
  printf ("test-bset: model: %" PRIu64 " operations, %zu keys at the end\n",
          ops, set.nr);
  keyset_free (&set);
}
END_TEST

/* Two sets hold the same keys, the same way. */
static void
assert_same_set (const struct keyset *a, const struct keyset *b,
                 unsigned round)
{
  const char *why = keyset_check (b, 0);

  ck_assert_msg (why == NULL, "seed %u round %u: %s", seed, round, why);
  ck_assert_msg (a->nr == b->nr, "seed %u round %u: %zu keys, expected %zu",
                 seed, round, b->nr, a->nr);
  for (size_t i = 0; i < a->nr; i++)
    check_msg (memcmp (&a->k[i], &b->k[i], sizeof a->k[i]) == 0,
               "seed %u round %u: key %zu differs", seed, round, i);
  ck_assert_uint_eq (a->words, b->words);
  ck_assert_uint_eq (a->ndirty, b->ndirty);
}

/* A random set of a few hundred keys, the same in a and b. */
static void
random_twin_sets (struct keyset *a, struct keyset *b, bool keep_whiteouts)
{
  unsigned n = (unsigned) rnd_below (400);

  keyset_init (a, keep_whiteouts);
  keyset_init (b, keep_whiteouts);
  for (unsigned i = 0; i < n; i++) {
    struct ckey k = random_extent (true);
    insert_ok (a, &k, i);
    insert_ok (b, &k, i);
  }
}

/* keyset_insert_batch (GC's whiteouts into a node's open set) leaves the
 * set exactly as the inserts one by one would: splits, trims, keys
 * covered whole, whiteouts kept or not, zero-size keys, keys between
 * and around the set's. */
START_TEST (test_insert_batch)
{
  rng_state = seed * 0x9E3779B97F4A7C15ull + 3;
  for (unsigned round = 0; round < 1000; round++) {
    struct keyset a, b;
    struct ckey w[M_INODES * M_SECTORS / 2];
    size_t n = 0;

    random_twin_sets (&a, &b, rnd_below (2) == 0);
    /* Sorted, not overlapping one another: a walk of every inode. */
    for (uint64_t ino = 0; ino < M_INODES; ino++)
      for (uint64_t pos = rnd_below (64); pos < M_SECTORS; ) {
        uint64_t size = rnd_below (8) == 0 ? 0 : 1 + rnd_below (48);
        if (pos + size > M_SECTORS)
          break;
        if (rnd_below (3) == 0)
          w[n++] = ckey_make (ino, pos + size, size, rnd_below (4) == 0,
                              MAKE_PTR (2, rnd_below (1ull << 40), 0),
                              rnd_below (3) == 0);
        pos += size + rnd_below (64);
      }
    for (size_t i = 0; i < n; i++)
      insert_ok (&a, &w[i], i);
    ck_assert_int_eq (keyset_insert_batch (&b, w, n), 0);
    assert_same_set (&a, &b, round);
    keyset_free (&a);
    keyset_free (&b);
  }
}
END_TEST

/* Drop keys by a rule of their own bits: every third, say. */
static int
drop_some (const struct ckey *k, void *arg)
{
  unsigned *calls = arg;

  if (calls[1] && ++calls[0] == calls[1])
    return -ENOMEM;             /* the walk stops here */
  return (k->ptr ^ k->low) % 3 == 0;
}

/* keyset_remove_if (GC's stale keys out of a leaf) leaves the set as a
 * whiteout over each dropped key would, also when drop fails midway. */
START_TEST (test_remove_if)
{
  rng_state = seed * 0x9E3779B97F4A7C15ull + 5;
  for (unsigned round = 0; round < 1000; round++) {
    struct keyset a, b;
    unsigned calls[2] = { 0, 0 };
    size_t visited;

    random_twin_sets (&a, &b, false);
    if (rnd_below (4) == 0 && b.nr > 0)
      calls[1] = 1 + (unsigned) rnd_below (b.nr);
    visited = calls[1] ? calls[1] - 1 : a.nr;
    /* The model: a whiteout over each key drop_some takes, in order. */
    {
      struct ckey gone[400 * 3];
      size_t ngone = 0;
      for (size_t i = 0; i < visited; i++)
        if ((a.k[i].ptr ^ a.k[i].low) % 3 == 0)
          gone[ngone++] = a.k[i];
      for (size_t i = 0; i < ngone; i++) {
        struct ckey wo = ckey_make (ckey_inode (&gone[i]), ckey_end (&gone[i]),
                                    ckey_size (&gone[i]), false, 0, false);
        insert_ok (&a, &wo, i);
      }
    }
    ck_assert_int_eq (keyset_remove_if (&b, drop_some, calls),
                      calls[1] ? -ENOMEM : 0);
    assert_same_set (&a, &b, round);
    keyset_free (&a);
    keyset_free (&b);
  }
}
END_TEST

/* Whiteouts are kept in an open set and override older keys on merge. */
START_TEST (test_whiteouts_kept)
{
  struct keyset open;
  struct ckey a = ckey_make (0, 100, 100, true, MAKE_PTR (0, 1000, 0), false);
  struct ckey w = ckey_make (0, 60, 20, false, 0, false);

  keyset_init (&open, true);
  ck_assert_int_eq (keyset_insert (&open, &a), 0);
  ck_assert_int_eq (keyset_insert (&open, &w), 0);
  ck_assert_uint_eq (open.nr, 3);
  ck_assert_uint_eq (ckey_end (&open.k[0]), 40);
  ck_assert (!ckey_has_ptr (&open.k[1]));
  ck_assert_uint_eq (ckey_start (&open.k[2]), 60);
  /* The tail's pointer moved with its start. */
  ck_assert_uint_eq (PTR_OFFSET (open.k[2].ptr), 1060);
  ck_assert_ptr_null (keyset_check (&open, 0));
  keyset_free (&open);
}
END_TEST

/* Splitting a key in the middle keeps both ends, pointers adjusted. */
START_TEST (test_split_middle)
{
  struct keyset s;
  struct ckey a = ckey_make (2, 200, 100, true, MAKE_PTR (7, 5000, 0), true);
  struct ckey b = ckey_make (2, 150, 10, true, MAKE_PTR (8, 9000, 0), false);

  keyset_init (&s, false);
  ck_assert_int_eq (keyset_insert (&s, &a), 0);
  ck_assert_int_eq (keyset_insert (&s, &b), 0);
  ck_assert_uint_eq (s.nr, 3);
  ck_assert_uint_eq (ckey_start (&s.k[0]), 100);
  ck_assert_uint_eq (ckey_end (&s.k[0]), 140);
  ck_assert_uint_eq (PTR_OFFSET (s.k[0].ptr), 5000);
  ck_assert_uint_eq (ckey_start (&s.k[2]), 150);
  ck_assert_uint_eq (ckey_end (&s.k[2]), 200);
  ck_assert_uint_eq (PTR_OFFSET (s.k[2].ptr), 5050);
  ck_assert (ckey_dirty (&s.k[2]));
  ck_assert_uint_eq (PTR_GEN (s.k[2].ptr), 7);
  keyset_free (&s);
}
END_TEST

/* keyset_contains finds exactly the keys the set holds: pieces cut by
 * later inserts as they were cut, and nothing that differs in range,
 * pointer or flags. */
START_TEST (test_contains)
{
  struct keyset s;
  struct ckey a = ckey_make (2, 200, 100, true, MAKE_PTR (7, 5000, 0), true);
  struct ckey b = ckey_make (2, 150, 10, true, MAKE_PTR (8, 9000, 0), false);
  struct ckey front = a, back = a, other = b, dirty = b;

  ckey_cut_back (&front, 60);            /* [100, 140) at 5000 */
  ckey_cut_front (&back, 50);            /* [150, 200) at 5050 */
  other.ptr = MAKE_PTR (8, 9001, 0);
  SET_KEY_DIRTY (ckey_bkey_mut (&dirty), true);

  keyset_init (&s, true);
  ck_assert (!keyset_contains (&s, &a));
  ck_assert_int_eq (keyset_insert (&s, &a), 0);
  ck_assert (keyset_contains (&s, &a));
  ck_assert_int_eq (keyset_insert (&s, &b), 0);
  ck_assert (!keyset_contains (&s, &a));
  ck_assert (keyset_contains (&s, &front));
  ck_assert (keyset_contains (&s, &b));
  ck_assert (keyset_contains (&s, &back));
  ck_assert (!keyset_contains (&s, &other));
  ck_assert (!keyset_contains (&s, &dirty));
  keyset_free (&s);
}
END_TEST

/* A replace against a check key fails once anything touched the range,
 * even a write that was later overwritten by identical-looking data. */
START_TEST (test_replace_collision)
{
  struct keyset s;
  struct ckey chk = ckey_make (0, 64, 64, true,
                               MAKE_PTR (0, 12345, PTR_CHECK_DEV), false);
  struct ckey data = ckey_make (0, 64, 64, true, MAKE_PTR (1, 800, 0), false);
  struct ckey w = ckey_make (0, 10, 2, false, 0, false);

  keyset_init (&s, false);
  ck_assert_int_eq (keyset_insert (&s, &chk), 0);
  ck_assert (keyset_replace_matches (&s, &data, &chk));
  ck_assert_int_eq (keyset_insert (&s, &w), 0);
  ck_assert (!keyset_replace_matches (&s, &data, &chk));
  /* Another miss's check key over the same range does not match ours. */
  keyset_clear (&s);
  ck_assert_int_eq (keyset_insert (&s, &chk), 0);
  struct ckey chk2 = ckey_make (0, 64, 64, true,
                                MAKE_PTR (0, 999, PTR_CHECK_DEV), false);
  ck_assert_int_eq (keyset_insert (&s, &chk2), 0);
  ck_assert (!keyset_replace_matches (&s, &data, &chk));
  keyset_free (&s);
}
END_TEST

START_TEST (test_interior_put_del)
{
  struct keyset s;
  struct ckey a = ckey_make (0, 100, 0, true, MAKE_PTR (1, 1024, 0), false);
  struct ckey b = ckey_make (0, 50, 0, true, MAKE_PTR (1, 2048, 0), false);
  struct ckey a2 = ckey_make (0, 100, 0, true, MAKE_PTR (2, 4096, 0), false);

  keyset_init (&s, false);
  ck_assert_int_eq (keyset_put (&s, &a), 0);
  ck_assert_int_eq (keyset_put (&s, &b), 0);
  ck_assert_int_eq (keyset_put (&s, &a2), 0);
  ck_assert_uint_eq (s.nr, 2);
  ck_assert_uint_eq (s.k[1].ptr, a2.ptr);
  ck_assert_uint_eq (keyset_search (&s, 0, 50), 1);
  ck_assert_uint_eq (keyset_search (&s, 0, 49), 0);
  ck_assert (keyset_del (&s, &b));
  ck_assert (!keyset_del (&s, &b));
  ck_assert_uint_eq (s.nr, 1);
  keyset_free (&s);
}
END_TEST

static Suite *
bset_suite (void)
{
  Suite *s = suite_create ("bset");
  TCase *tc = tcase_create ("keyset");

  tcase_set_timeout (tc, 600);
  tcase_add_test (tc, test_whiteouts_kept);
  tcase_add_test (tc, test_split_middle);
  tcase_add_test (tc, test_contains);
  tcase_add_test (tc, test_replace_collision);
  tcase_add_test (tc, test_interior_put_del);
  tcase_add_test (tc, test_model_random);
  tcase_add_test (tc, test_insert_batch);
  tcase_add_test (tc, test_remove_if);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  seed = test_seed ("test-bset");
  return test_main (bset_suite ());
}
