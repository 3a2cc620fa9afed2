/* bcachefilter tests: helpers shared by the Check unit tests; see
 * testlib.h. */
#include "config.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bcachefilter/cache.h"
#include "testlib.h"

int
test_main (Suite *suite)
{
  SRunner *sr = srunner_create (suite);
  int failed;

  srunner_run_all (sr, CK_ENV);
  failed = srunner_ntests_failed (sr);
  srunner_free (sr);
  return failed ? 1 : 0;
}

uint64_t rng_state;

uint64_t
rnd (void)
{
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

uint64_t
rnd_below (uint64_t n)
{
  return n ? rnd () % n : 0;
}

unsigned
test_seed (const char *name)
{
  const char *env = getenv ("TEST_SEED");
  unsigned seed = env ? (unsigned) strtoul (env, NULL, 0)
                  : (unsigned) time (NULL);

  printf ("%s: seed=%u (set TEST_SEED to replay)\n", name, seed);
  fflush (stdout);
  return seed;
}

void
test_tmpdir (char *buf, size_t len, const char *prefix)
{
  const char *dir = getenv ("TEST_TMPDIR");

  if (!dir)
    dir = access ("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  snprintf (buf, len, "%s/%s-XXXXXX", dir, prefix);
  if (!mkdtemp (buf)) {
    perror ("mkdtemp");
    exit (99);
  }
}

void
test_reuse_dev_offset (struct bcf_cache *c, uint64_t dev_offset,
                       uint64_t first, uint64_t nblk, uint64_t *next,
                       size_t block, uint8_t *landed, uint64_t limit)
{
  uint8_t *buf = malloc (block);

  ck_assert_ptr_nonnull (buf);
  for (uint64_t i = 0; i < limit; i++) {
    uint64_t blk = first + (*next)++ % nblk;
    struct bcf_extent e;
    unsigned n;

    for (size_t j = 0; j < block; j += 8) {
      uint64_t x = rnd ();
      memcpy (buf + j, &x, block - j < 8 ? block - j : 8);
    }
    ck_assert_int_eq (bcf_insert (c, blk * block, block, buf, false, false),
                      0);
    ck_assert_int_eq (bcf_lookup (c, blk * block, block, &e, 1, &n), 0);
    ck_assert_int_eq (e.kind, BCF_EXTENT_HIT);
    if (e.dev_offset == dev_offset) {
      memcpy (landed, buf, block);
      free (buf);
      return;
    }
  }
  ck_abort_msg ("device offset %" PRIu64 " was never reused (%" PRIu64
                " inserts)", dev_offset, limit);
}
