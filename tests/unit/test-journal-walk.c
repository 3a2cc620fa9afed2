/* bcachefilter: unit tests for bch_journal_bucket_walk (core/format.c).
 *
 * The walk must find journal entries in a whole bucket exactly as the
 * engine's journal read (core/journal.c, scan_bucket) and the kernel's
 * journal_read_bucket do (bcache.md §1.6): try each block boundary, take
 * a valid entry and jump past its block-rounded size, skip anything else
 * one block at a time.  What is tested:
 *
 *  - several entries of different sizes (1, 2 and 9 blocks) back to back
 *    at block boundaries, with 512-byte and 4 KiB blocks; offsets, sizes,
 *    header fields and key words as given to the callback;
 *  - garbage blocks between entries (including a block that carries the
 *    journal magic but nothing valid), free space at the end;
 *  - a torn entry (bad checksum) is skipped block by block, and a valid
 *    entry sitting at a block boundary inside its extent is still found;
 *  - an entry whose size claims to run past the bucket (and one past the
 *    32 KiB maximum) is ignored, while one ending exactly at the bucket's
 *    end is taken;
 *  - entries out of seq order come back in bucket order;
 *  - an empty (zeroed) bucket and a zero-length bucket;
 *  - parameter errors (block size, ragged length) and a callback that
 *    stops the walk;
 *  - randomised buckets compared with a reference implementation of the
 *    scan_bucket loop written here.  The seed comes from $TEST_SEED or the
 *    clock and is printed first.
 *
 * Buckets are passed as exactly-sized heap buffers, so a sanitizer build
 * reports any read past the end.
 */
#include "config.h"

#include <check.h>

#include "bcachefilter/format.h"
#include "testlib.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static unsigned run_seed;

#define KiB 1024u
/* Any set magic will do; this is the jset magic of a set_uuid starting
 * 88 77 66 55 44 33 22 11. */
#define MAGIC (0x1122334455667788ull ^ BCH_JSET_MAGIC_XOR)

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

/* A heap buffer of exactly len bytes (at least one allocated). */
static uint8_t *
exact_alloc (size_t len)
{
  uint8_t *p = malloc (len ? len : 1);
  ck_assert_ptr_nonnull (p);
  memset (p, 0, len ? len : 1);
  return p;
}

static size_t
round_up (size_t x, size_t to)
{
  return (x + to - 1) / to * to;
}

/* Key word i of the entry with this seq: recognisable, never the magic. */
static uint64_t
key_word (uint64_t seq, uint32_t i)
{
  return (seq << 32) | (0x5a000000u + i);
}

/* Write a journal entry with `words` key words at buf + off (room bytes
 * available from there); returns its unpadded size. */
static size_t
put_entry (uint8_t *buf, size_t off, size_t room, uint64_t seq,
           uint32_t words)
{
  struct bch_jset j;
  uint64_t p = MAKE_PTR (1, 5 * 1024, 0);
  size_t n;

  ck_assert_uint_ge (room, bch_jset_bytes (words));
  memset (&j, 0, sizeof j);
  j.magic = MAGIC;
  j.seq = seq;
  j.version = BCACHE_JSET_VERSION;
  j.keys = words;
  j.last_seq = seq > 3 ? seq - 3 : 0;
  bkey_init (&j.uuid_bucket.key, 0, 0, 1024);
  SET_KEY_PTRS (&j.uuid_bucket.key, 1);
  j.uuid_bucket.key.ptr[0] = p;
  bkey_max (&j.btree_root.key);
  SET_KEY_SIZE (&j.btree_root.key, 512);
  SET_KEY_PTRS (&j.btree_root.key, 1);
  j.btree_root.key.ptr[0] = MAKE_PTR (2, 6 * 1024, 0);
  j.prio_bucket[0] = 7;
  for (uint32_t i = 0; i < words; i++)
    bch_put_le64 (buf + off + BCH_JSET_HEADER_SIZE + 8 * i,
                  key_word (seq, i));
  n = bch_jset_encode (&j, buf + off, room);
  ck_assert_uint_eq (n, bch_jset_bytes (words));
  return n;
}

/* What the callback saw. */
#define MAX_SEEN 256
struct seen {
  unsigned n;
  unsigned stop_at;             /* return 1 at this call (1-based), 0: never */
  bool any_keys;                /* don't check the key words' pattern */
  const uint8_t *bucket;
  struct {
    uint64_t seq;
    uint32_t keys;
    size_t offset;
    size_t bytes;
  } e[MAX_SEEN];
};

static int
record (const struct bch_jset *j, size_t offset, size_t bytes, void *opaque)
{
  struct seen *s = opaque;

  ck_assert_uint_lt (s->n, MAX_SEEN);
  /* The callback sees a fully decoded entry pointing into the bucket. */
  ck_assert_uint_eq (j->magic, MAGIC);
  ck_assert_ptr_eq ((const void *) j->key_words,
                    s->bucket + offset + BCH_JSET_HEADER_SIZE);
  for (uint32_t i = 0; i < j->keys && !s->any_keys; i++)
    ck_assert_uint_eq (bch_get_le64 (s->bucket + offset +
                                     BCH_JSET_HEADER_SIZE + 8 * i),
                       key_word (j->seq, i));
  s->e[s->n].seq = j->seq;
  s->e[s->n].keys = j->keys;
  s->e[s->n].offset = offset;
  s->e[s->n].bytes = bytes;
  s->n++;
  return s->stop_at && s->n == s->stop_at;
}

static enum bch_status
walk (const uint8_t *bucket, size_t len, unsigned block, struct seen *s,
      struct bch_diag *diag)
{
  unsigned stop_at = s->stop_at;
  bool any_keys = s->any_keys;

  memset (s, 0, sizeof *s);
  s->stop_at = stop_at;
  s->any_keys = any_keys;
  s->bucket = bucket;
  return bch_journal_bucket_walk (bucket, len, block, MAGIC, record, s, diag);
}

static void
expect (const struct seen *s, unsigned i, uint64_t seq, size_t offset,
        size_t bytes)
{
  ck_assert_uint_gt (s->n, i);
  ck_assert_msg (s->e[i].seq == seq && s->e[i].offset == offset &&
                 s->e[i].bytes == bytes,
                 "entry %u: seq %" PRIu64 " at %zu (%zu bytes), expected "
                 "seq %" PRIu64 " at %zu (%zu bytes)", i, s->e[i].seq,
                 s->e[i].offset, s->e[i].bytes, seq, offset, bytes);
}

static void
fill_garbage (uint8_t *p, size_t n, unsigned seed)
{
  for (size_t i = 0; i < n; i++)
    p[i] = (uint8_t) (0xa7 ^ (i * 31 + seed));
}

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

/* Entries of 1, 2 and 9 blocks back to back, then free space. */
START_TEST (test_walk_sizes)
{
  static const unsigned blocks[] = { 512, 4096 };

  for (unsigned bi = 0; bi < 2; bi++) {
    const unsigned block = blocks[bi];
    const size_t len = 64 * KiB;
    uint8_t *b = exact_alloc (len);
    /* 0 words: 240 bytes; 40 words: 560; 500 words: 4240. */
    static const uint32_t words[] = { 0, 40, 500, 3 };
    size_t off = 0, offs[4], sizes[4];
    struct seen s = { 0 };
    struct bch_diag d;
    enum bch_status st;

    for (unsigned i = 0; i < 4; i++) {
      size_t n = put_entry (b, off, len - off, 100 + i, words[i]);
      offs[i] = off;
      sizes[i] = round_up (n, block);
      off += sizes[i];
    }
    st = walk (b, len, block, &s, &d);
    ck_assert_msg (st == BCH_OK, "%s: %s", bch_status_name (st), d.msg);
    ck_assert_int_eq (d.status, BCH_OK);
    ck_assert_uint_eq (s.n, 4);
    for (unsigned i = 0; i < 4; i++) {
      expect (&s, i, 100 + i, offs[i], sizes[i]);
      ck_assert_uint_eq (s.e[i].keys, words[i]);
    }
    if (block == 512) {
      ck_assert_uint_eq (sizes[0], 512);
      ck_assert_uint_eq (sizes[1], 1024);
      ck_assert_uint_eq (sizes[2], 9 * 512);
    }
    else {
      ck_assert_uint_eq (sizes[0], 4096);
      ck_assert_uint_eq (sizes[2], 8192);
    }
    /* A NULL callback walks the same bucket without complaint. */
    ck_assert_int_eq (bch_journal_bucket_walk (b, len, block, MAGIC, NULL,
                                               NULL, &d), BCH_OK);
    /* So does a NULL diag. */
    ck_assert_int_eq (walk (b, len, block, &s, NULL), BCH_OK);
    ck_assert_uint_eq (s.n, 4);
    /* The wrong magic finds nothing. */
    ck_assert_int_eq (bch_journal_bucket_walk (b, len, block, MAGIC ^ 1,
                                               record, &s, &d), BCH_OK);
    free (b);
  }
}
END_TEST

/* Garbage between entries, including a block with the right magic. */
START_TEST (test_walk_garbage_between)
{
  const unsigned block = 512;
  const size_t len = 16 * KiB;
  uint8_t *b = exact_alloc (len);
  struct seen s = { 0 };
  struct bch_diag d;

  put_entry (b, 0, len, 7, 10);                         /* block 0 */
  fill_garbage (b + 512, 3 * 512, 1);                   /* blocks 1-3 */
  put_entry (b, 4 * 512, len - 4 * 512, 8, 70);         /* blocks 4-5 */
  fill_garbage (b + 6 * 512, 512, 2);                   /* block 6 */
  bch_put_le64 (b + 6 * 512 + 8, MAGIC);                /* magic, junk */
  put_entry (b, 7 * 512, len - 7 * 512, 9, 0);          /* block 7 */
  fill_garbage (b + 20 * 512, 512, 3);                  /* block 20 */
  put_entry (b, 21 * 512, len - 21 * 512, 10, 1);       /* block 21 */

  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 4);
  expect (&s, 0, 7, 0, 512);
  expect (&s, 1, 8, 4 * 512, 1024);
  expect (&s, 2, 9, 7 * 512, 512);
  expect (&s, 3, 10, 21 * 512, 512);
  free (b);
}
END_TEST

/* A torn entry is skipped block by block: what follows it is found, and
 * so is a valid entry at a block boundary inside its extent. */
START_TEST (test_walk_torn_entry)
{
  const unsigned block = 512;
  const size_t len = 16 * KiB;
  uint8_t *b = exact_alloc (len);
  struct seen s = { 0 };
  struct bch_diag d;

  put_entry (b, 0, len, 20, 2);                         /* block 0 */
  put_entry (b, 512, len - 512, 21, 250);               /* blocks 1-5 */
  b[512 + BCH_JSET_HEADER_SIZE + 8 * 249] ^= 0x01;      /* torn tail */
  put_entry (b, 6 * 512, len - 6 * 512, 22, 5);         /* block 6 */

  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 2);
  expect (&s, 0, 20, 0, 512);
  expect (&s, 1, 22, 6 * 512, 512);

  /* The torn entry's csum really is bad. */
  {
    struct bch_jset j;
    ck_assert_int_eq (bch_jset_decode (b + 512, len - 512, MAGIC, &j, &d),
                      BCH_ERR_CSUM);
  }

  /* A valid small entry written over block 3 of the torn one (which is
   * what a later, shorter write over a torn region looks like). */
  put_entry (b, 3 * 512, 512, 30, 1);
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 3);
  expect (&s, 0, 20, 0, 512);
  expect (&s, 1, 30, 3 * 512, 512);
  expect (&s, 2, 22, 6 * 512, 512);

  /* But inside a VALID entry's extent, blocks are not looked at: an
   * entry whose key words happen to hold another entry hides it. */
  memset (b, 0, len);
  put_entry (b, 0, len, 40, 200);                       /* blocks 0-3 */
  {
    uint8_t inner[512];
    memset (inner, 0, sizeof inner);
    put_entry (inner, 0, sizeof inner, 41, 0);
    /* Make the inner entry part of the outer one's key words and reseal
     * the outer one. */
    memcpy (b + 2 * 512, inner, 240);
    bch_put_le64 (b, bch_jset_csum (b, len));
  }
  s.any_keys = true;            /* the outer entry's words were replaced */
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 1);
  expect (&s, 0, 40, 0, 4 * 512);
  free (b);
}
END_TEST

/* Entries whose size claims past the bucket are ignored; one ending
 * exactly at the end is taken. */
START_TEST (test_walk_size_past_bucket)
{
  const unsigned block = 512;
  const size_t len = 8 * KiB;                           /* 16 blocks */
  uint8_t *b = exact_alloc (len);
  struct seen s = { 0 };
  struct bch_diag d;

  put_entry (b, 0, len, 50, 4);                         /* block 0 */
  /* Block 14: claims 2 blocks + 1 word, i.e. 8 bytes past the end. */
  {
    static uint8_t big[2 * 512 + 8];
    memset (big, 0, sizeof big);
    put_entry (big, 0, sizeof big, 51, (2 * 512 + 8 - 240) / 8);
    memcpy (b + 14 * 512, big, 2 * 512);                /* cut by the end */
  }
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 1);
  expect (&s, 0, 50, 0, 512);

  /* One word fewer: it ends exactly at the bucket's end. */
  memset (b + 14 * 512, 0, 2 * 512);
  put_entry (b, 14 * 512, 2 * 512, 52, (2 * 512 - 240) / 8);
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 2);
  expect (&s, 1, 52, 14 * 512, 1024);

  /* An entry claiming more than the 32 KiB maximum, in an 80 KiB bucket
   * that would hold it: ignored (the kernel refuses such entries). */
  {
    const size_t blen = 80 * KiB;
    uint8_t *bb = exact_alloc (blen);
    uint32_t words = (BCH_JSET_MAX_BYTES - BCH_JSET_HEADER_SIZE) / 8;

    put_entry (bb, 0, blen, 60, words);                 /* exactly 32 KiB */
    put_entry (bb, 33 * KiB, blen - 33 * KiB, 61, 0);
    bch_put_le32 (bb + 33 * KiB + 28, words + 1);       /* 32 KiB + 8 */
    for (uint32_t i = 0; i <= words; i++)
      bch_put_le64 (bb + 33 * KiB + BCH_JSET_HEADER_SIZE + 8 * i,
                    key_word (61, i));
    bch_put_le64 (bb + 33 * KiB, bch_jset_csum (bb + 33 * KiB,
                                                blen - 33 * KiB));
    ck_assert_int_eq (walk (bb, blen, block, &s, &d), BCH_OK);
    ck_assert_uint_eq (s.n, 1);
    expect (&s, 0, 60, 0, 32 * KiB);
    free (bb);
  }
  free (b);
}
END_TEST

/* Entries come back in bucket order, not seq order. */
START_TEST (test_walk_bucket_order)
{
  const unsigned block = 4096;
  const size_t len = 32 * KiB;
  uint8_t *b = exact_alloc (len);
  struct seen s = { 0 };
  struct bch_diag d;
  static const uint64_t seqs[] = { 1000, 5, 700, 6, 2 };

  for (unsigned i = 0; i < 5; i++)
    put_entry (b, i * 4096, len - i * 4096, seqs[i], i * 50);
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 5);
  for (unsigned i = 0; i < 5; i++)
    expect (&s, i, seqs[i], i * 4096, 4096);
  free (b);
}
END_TEST

START_TEST (test_walk_empty)
{
  static const unsigned blocks[] = { 512, 1024, 2048, 4096 };
  struct seen s = { 0 };
  struct bch_diag d;

  for (unsigned i = 0; i < 4; i++) {
    uint8_t *b = exact_alloc (16 * KiB);
    memset (&d, 0x55, sizeof d);
    ck_assert_int_eq (walk (b, 16 * KiB, blocks[i], &s, &d), BCH_OK);
    ck_assert_int_eq (d.status, BCH_OK);
    ck_assert_str_eq (d.msg, "");
    ck_assert_uint_eq (s.n, 0);
    /* A bucket of one block. */
    ck_assert_int_eq (walk (b, blocks[i], blocks[i], &s, &d), BCH_OK);
    ck_assert_uint_eq (s.n, 0);
    free (b);
  }
  /* Zero length: nothing to read. */
  {
    uint8_t *b = exact_alloc (0);
    ck_assert_int_eq (walk (b, 0, 512, &s, &d), BCH_OK);
    ck_assert_uint_eq (s.n, 0);
    free (b);
  }
}
END_TEST

START_TEST (test_walk_bad_params)
{
  static const unsigned bad_blocks[] = { 0, 1, 256, 511, 513, 1000, 3072,
                                         0x80000001u };
  const size_t len = 8 * KiB;
  uint8_t *b = exact_alloc (len);
  struct seen s = { 0 };
  struct bch_diag d;

  put_entry (b, 0, len, 1, 0);
  for (unsigned i = 0; i < sizeof bad_blocks / sizeof bad_blocks[0]; i++) {
    memset (&d, 0, sizeof d);
    ck_assert_int_eq (walk (b, len, bad_blocks[i], &s, &d), BCH_ERR_INVALID);
    ck_assert_int_eq (d.status, BCH_ERR_INVALID);
    ck_assert_str_ne (d.msg, "");
    ck_assert_uint_eq (s.n, 0);
  }
  /* A ragged length, checked before anything is read. */
  ck_assert_int_eq (walk (b, len - 1, 512, &s, &d), BCH_ERR_INVALID);
  ck_assert_uint_eq (s.n, 0);
  ck_assert_int_eq (walk (b, 512 + 256, 512, &s, &d), BCH_ERR_INVALID);
  ck_assert_int_eq (walk (b, 240, 512, &s, &d), BCH_ERR_INVALID);
  ck_assert_int_eq (walk (b, 4096, 8192, &s, &d), BCH_ERR_INVALID);
  ck_assert_uint_eq (s.n, 0);
  /* Large power-of-two blocks are fine. */
  ck_assert_int_eq (walk (b, len, 8192, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 1);
  expect (&s, 0, 1, 0, 8192);
  free (b);
}
END_TEST

START_TEST (test_walk_callback_stops)
{
  const unsigned block = 512;
  const size_t len = 8 * KiB;
  uint8_t *b = exact_alloc (len);
  struct seen s = { 0 };
  struct bch_diag d;

  for (unsigned i = 0; i < 4; i++)
    put_entry (b, i * 1024, len - i * 1024, 300 + i, 1);
  s.stop_at = 2;
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_ERR_INVALID);
  ck_assert_int_eq (d.status, BCH_ERR_INVALID);
  ck_assert_msg (strstr (d.msg, "301") != NULL, "diag: %s", d.msg);
  ck_assert_uint_eq (s.n, 2);
  s.stop_at = 0;
  ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
  ck_assert_uint_eq (s.n, 4);
  free (b);
}
END_TEST

/* The engine's scan_bucket loop (core/journal.c), written out again. */
static unsigned
reference_scan (const uint8_t *buf, size_t len, unsigned block,
                struct seen *out)
{
  size_t off = 0;

  out->n = 0;
  while (off + BCH_JSET_HEADER_SIZE <= len) {
    struct bch_jset js;
    size_t l;

    if (bch_jset_decode (buf + off, len - off, MAGIC, &js, NULL) != BCH_OK) {
      off += block;
      continue;
    }
    l = (bch_jset_bytes (js.keys) + block - 1) / block * block;
    out->e[out->n].seq = js.seq;
    out->e[out->n].keys = js.keys;
    out->e[out->n].offset = off;
    out->e[out->n].bytes = l;
    out->n++;
    off += l;
  }
  return out->n;
}

/* Random buckets: entries of random sizes at random block boundaries,
 * overlapping writes, garbage, torn entries; the walk must agree with the
 * reference loop and its entries must be aligned and disjoint. */
START_TEST (test_walk_random)
{
  unsigned rs = run_seed + 77;

  for (unsigned iter = 0; iter < 300; iter++) {
    const unsigned block = 512u << (rand_r (&rs) % 4);
    const size_t len = block * (1 + (size_t) rand_r (&rs) % (65536 / block));
    uint8_t *b = exact_alloc (len);
    unsigned nput = (unsigned) rand_r (&rs) % 12;
    static struct seen s, r;
    struct bch_diag d;

    for (unsigned k = 0; k < nput; k++) {
      size_t nblocks = len / block;
      size_t off = (size_t) (rand_r (&rs) % nblocks) * block;
      size_t room = len - off;
      uint32_t words = (uint32_t) rand_r (&rs) % 600;

      if (rand_r (&rs) % 5 == 0) {
        fill_garbage (b + off, room < block ? room : block,
                      (unsigned) rand_r (&rs));
        continue;
      }
      if (bch_jset_bytes (words) > room)
        words = (uint32_t) ((room - BCH_JSET_HEADER_SIZE) / 8);
      put_entry (b, off, room, 1 + (uint64_t) rand_r (&rs) % 1000, words);
      if (rand_r (&rs) % 6 == 0)                        /* tear it */
        b[off + 8 + (size_t) rand_r (&rs) % (bch_jset_bytes (words) - 8)] ^= 0x20;
    }
    s.stop_at = 0;
    ck_assert_int_eq (walk (b, len, block, &s, &d), BCH_OK);
    reference_scan (b, len, block, &r);
    ck_assert_uint_eq (s.n, r.n);
    for (unsigned i = 0; i < s.n; i++) {
      expect (&s, i, r.e[i].seq, r.e[i].offset, r.e[i].bytes);
      ck_assert_uint_eq (s.e[i].offset % block, 0);
      ck_assert_uint_eq (s.e[i].bytes % block, 0);
      ck_assert_uint_le (s.e[i].offset + s.e[i].bytes, len);
      if (i > 0)
        ck_assert_uint_ge (s.e[i].offset,
                           s.e[i - 1].offset + s.e[i - 1].bytes);
    }
    free (b);
  }
}
END_TEST

static Suite *
journal_walk_suite (void)
{
  Suite *s = suite_create ("journal-walk");
  TCase *t = tcase_create ("walk");

  tcase_add_test (t, test_walk_sizes);
  tcase_add_test (t, test_walk_garbage_between);
  tcase_add_test (t, test_walk_torn_entry);
  tcase_add_test (t, test_walk_size_past_bucket);
  tcase_add_test (t, test_walk_bucket_order);
  tcase_add_test (t, test_walk_empty);
  tcase_add_test (t, test_walk_bad_params);
  tcase_add_test (t, test_walk_callback_stops);
  tcase_add_test (t, test_walk_random);
  suite_add_tcase (s, t);
  return s;
}

int
main (void)
{
  run_seed = test_seed ("test-journal-walk");
  return test_main (journal_walk_suite ());
}
