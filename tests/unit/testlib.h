/* bcachefilter tests: helpers shared by the Check unit tests.
 *
 * - test_main: the main of every Check test program (run the suite,
 *   Check's summary, the exit status automake expects);
 * - rnd / rnd_below: the xorshift64* generator every random test uses;
 *   each test seeds rng_state itself (from the printed seed), so a run is
 *   replayed with TEST_SEED.
 * - test_seed: TEST_SEED or the clock, printed first.
 * - test_tmpdir: a fresh directory for cache files, on tmpfs where there
 *   is one (the tests flush often, and fdatasync on a disk file system
 *   would dominate their run time); TEST_TMPDIR overrides.
 * - test_reuse_dev_offset: drive a bucket's reuse through the API, for
 *   the tests of bcache's cache_read_races.
 * - check_msg: an assertion for loops over every block.
 */
#ifndef BCACHEFILTER_TESTLIB_H
#define BCACHEFILTER_TESTLIB_H

#include <stddef.h>
#include <stdint.h>

#include <check.h>

/* Run suite (srunner_run_all; CK_VERBOSITY chooses the output, normal by
 * default) and return the program's exit status: 0 if every test
 * passed, 1 if not.  Each test program's main prints its seed first
 * (test_seed) where it has one, sets up what its suite needs, then
 * returns test_main (its_suite ()) after its own cleanup. */
int test_main (Suite *suite);

/* check_msg (COND, FORMAT, ...): ck_assert_msg for the hot loops (every
 * block after every crash).  Check records the place of every assertion
 * that passes, one write(2) to its parent each: 727,000 in one crash
 * workload, where a system call is dear (a virtual machine's).  This one
 * costs nothing until it fails, and then fails as ck_abort_msg does, at
 * its own line. */
#define check_msg(cond, ...) \
  do { if (!(cond)) ck_abort_msg (__VA_ARGS__); } while (0)

extern uint64_t rng_state;
uint64_t rnd (void);
uint64_t rnd_below (uint64_t n);

/* The seed for this run, printed as "NAME: seed=N (set TEST_SEED to
 * replay)". */
unsigned test_seed (const char *name);

/* Make a fresh directory PREFIX-XXXXXX and store its path in buf; exits
 * with 99 (a hard error for automake) if it cannot. */
void test_tmpdir (char *buf, size_t len, const char *prefix);

struct bcf_cache;
/* Insert clean blocks of random bytes (rnd), block bytes each, at blocks
 * first, first + 1, ... (wrapping after nblk; *next counts the inserts
 * across calls) until one is cached at the device offset dev_offset: the
 * bucket that held it was invalidated, its new gen persisted and the
 * bucket written again.  landed (block bytes) gets what landed there.
 * Fails the test after limit inserts.  Needs a cache whose GC runs
 * (fifo replacement makes it quick). */
void test_reuse_dev_offset (struct bcf_cache *c, uint64_t dev_offset,
                            uint64_t first, uint64_t nblk, uint64_t *next,
                            size_t block, uint8_t *landed, uint64_t limit);

#endif /* BCACHEFILTER_TESTLIB_H */
