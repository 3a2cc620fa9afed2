/* bcachefilter fuzz target: one bkey.
 *
 * Input: u8 level | u8 nr_in_set | u64 nbuckets | u64 bucket_sectors |
 *        u64 first_bucket | key bytes.
 *
 * - bkey_decode into an exactly-sized heap struct bkey_padded (so a key
 *   longer than 8 words is an ASan overflow) and check it copied the
 *   words verbatim.
 * - bkey_encode of the decoded key reproduces the input bytes; encoding
 *   into a buffer one byte too short returns 0 and writes nothing past it.
 * - bkey_validate both on the decoded key and in place on the raw words
 *   (exactly-sized buffer: validate must not read past avail_u64s); the
 *   two verdicts agree, and an accepted key satisfies the documented rules.
 */
#include <config.h>

#include "common.h"

/* The rules of format.h / bcache.md §1.4 for an accepted key. */
static void
bkey_oracle (const struct bkey *k, size_t avail, unsigned level,
             const struct bch_key_geometry *geo)
{
  FUZZ_ASSERT (bkey_u64s (k) <= avail);
  if (level == 0)               /* btree pointers carry the node size */
    FUZZ_ASSERT (KEY_SIZE (k) <= KEY_OFFSET (k));
  FUZZ_ASSERT (KEY_CSUM (k) == 0);
  if (level > 0) {
    FUZZ_ASSERT (KEY_PTRS (k) >= 1);
    FUZZ_ASSERT (!KEY_DIRTY (k));
  }
  for (unsigned i = 0; i < KEY_PTRS (k); i++) {
    uint64_t p = k->ptr[i];
    uint64_t dev = PTR_DEV (p);
    if (dev == PTR_CHECK_DEV) {
      FUZZ_ASSERT (level == 0);
      continue;
    }
    FUZZ_ASSERT (dev < geo->nr_in_set);
    if (geo->nbuckets && geo->bucket_sectors) {
      uint64_t off = PTR_OFFSET (p);
      uint64_t b = off / geo->bucket_sectors;
      FUZZ_ASSERT (b >= geo->first_bucket);
      FUZZ_ASSERT (b < geo->nbuckets);
      FUZZ_ASSERT (off % geo->bucket_sectors + KEY_SIZE (k) <= geo->bucket_sectors);
    }
  }
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  struct fuzz_in in = { data, size };
  unsigned level = fuzz_u8 (&in);
  struct bch_key_geometry geo;
  geo.nr_in_set = fuzz_u8 (&in);
  geo.nbuckets = fuzz_u64 (&in);
  geo.bucket_sectors = fuzz_u64 (&in);
  geo.first_bucket = fuzz_u64 (&in);
  size_t len;
  uint8_t *buf = fuzz_rest (&in, &len);

  /* Decode. */
  struct bkey_padded *kp = malloc (sizeof *kp);
  if (!kp) abort ();
  memset (kp, FUZZ_POISON, sizeof *kp);
  struct bch_diag diag;
  enum bch_status st = bkey_decode (buf, len, kp, &diag);
  fuzz_log ("bkey_decode", st, &diag);
  fuzz_check_diag (st, &diag);
  FUZZ_ASSERT (st == BCH_OK || st == BCH_ERR_TRUNCATED || st == BCH_ERR_INVALID);
  if (len >= 16 && (size_t) (2 + ((bch_get_le64 (buf) >> 60) & 7)) * 8 <= len &&
      ((bch_get_le64 (buf) >> 60) & 7) <= BKEY_PAD_PTRS)
    /* It fits in the input and in a padded key: nothing else is checked. */
    FUZZ_ASSERT_DIAG (st == BCH_OK, diag);

  size_t nwords = 0;
  if (st == BCH_OK) {
    const struct bkey *k = &kp->key;
    nwords = bkey_u64s (k);
    FUZZ_ASSERT (nwords <= BKEY_PAD_U64S);
    FUZZ_ASSERT (nwords * 8 <= len);
    for (size_t i = 0; i < nwords; i++)
      FUZZ_ASSERT (kp->pad[i] == bch_get_le64 (buf + 8 * i));

    /* Round trip. */
    size_t bytes = bkey_bytes (k);
    uint8_t *enc = malloc (bytes);
    if (!enc) abort ();
    FUZZ_ASSERT (bkey_encode (k, enc, bytes) == bytes);
    FUZZ_ASSERT (memcmp (enc, buf, bytes) == 0);
    free (enc);
    enc = malloc (bytes - 1);
    if (!enc) abort ();
    FUZZ_ASSERT (bkey_encode (k, enc, bytes - 1) == 0);
    free (enc);

    struct bkey_padded kp2;
    struct bch_diag d2;
    memset (&kp2, FUZZ_POISON, sizeof kp2);
    FUZZ_ASSERT (bkey_decode (buf, bytes, &kp2, &d2) == BCH_OK);
    FUZZ_ASSERT (memcmp (kp2.pad, kp->pad, bytes) == 0);

    /* Helpers over any key. */
    (void) KEY_START (k);
    (void) bkey_is_check (k);
    for (unsigned i = 0; i < KEY_PTRS (k); i++) {
      (void) bch_ptr_is_data (k->ptr[i]);
      (void) bch_ptr_stale ((uint8_t) level, k->ptr[i]);
      uint64_t p = k->ptr[i];
      FUZZ_ASSERT (MAKE_PTR (PTR_GEN (p), PTR_OFFSET (p), PTR_DEV (p)) ==
                   (p & ~(1ull << 63)));
    }
    struct bkey_padded mx;
    bkey_max (&mx.key);
    FUZZ_ASSERT (bkey_cmp (k, &mx.key) <= 0 || KEY_OFFSET (k) > BKEY_MAX_OFFSET);

    /* Validate the decoded key with exactly its own length available. */
    struct bch_diag vd;
    enum bch_status vst = bkey_validate (k, nwords, level, &geo, &vd);
    fuzz_log ("bkey_validate", vst, &vd);
    fuzz_check_diag (vst, &vd);
    FUZZ_ASSERT (vst == BCH_OK || vst == BCH_ERR_INVALID || vst == BCH_ERR_TRUNCATED);
    if (vst == BCH_OK)
      bkey_oracle (k, nwords, level, &geo);

    /* ... and with less than its length. */
    vst = bkey_validate (k, nwords - 1, level, &geo, &vd);
    fuzz_check_diag (vst, &vd);
    FUZZ_ASSERT (vst != BCH_OK);
  }

  /* Validate in place over the raw words, exactly sized. */
  size_t avail = len / 8;
  if (avail > 0) {
    uint64_t *words = malloc (avail * 8);
    if (!words) abort ();
    for (size_t i = 0; i < avail; i++)
      words[i] = bch_get_le64 (buf + 8 * i);
    const struct bkey *k = (const struct bkey *) words;
    struct bch_diag vd;
    enum bch_status vst = bkey_validate (k, avail, level, &geo, &vd);
    fuzz_check_diag (vst, &vd);
    if (vst == BCH_OK)
      bkey_oracle (k, avail, level, &geo);
    if (st == BCH_OK) {
      /* Same key, more room after it: same verdict. */
      struct bch_diag vd2;
      enum bch_status vst2 = bkey_validate (&kp->key, nwords, level, &geo, &vd2);
      FUZZ_ASSERT (vst == vst2);
    }
    free (words);
  }

  free (kp);
  free (buf);
  return 0;
}
