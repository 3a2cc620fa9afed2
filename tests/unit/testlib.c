/* bcachefilter tests: helpers shared by the Check unit tests; see
 * testlib.h. */
#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

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
