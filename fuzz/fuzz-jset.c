/* bcachefilter fuzz target: one journal entry (struct jset).
 *
 * Input: u8 flags | u64 jset_magic | jset bytes.
 *
 * - bch_jset_decode over an exactly-sized heap copy; with
 *   FUZZ_JSET_FIX_CSUM the checksum is recomputed first.
 * - An accepted entry: fields equal the stored bytes, fits in len and in
 *   32 KiB, last_seq <= seq, the embedded keys fit a padded key.  Every
 *   journalled key is decoded (they may be garbage: only no crash).
 * - Round trip: bch_jset_encode of the decoded entry reproduces every
 *   field byte of the input, zeroes the padding, seals a correct checksum,
 *   returns 0 for a buffer one byte too short, and decodes to the same
 *   fields.
 */
#include <config.h>

#include "common.h"

#define JSET_UUID_OFF   40u
#define JSET_ROOT_OFF   104u
#define JSET_LEVEL_OFF  168u
#define JSET_PRIO_OFF   176u

static void
jset_poison (struct bch_jset *j)
{
  memset (j, FUZZ_POISON, sizeof *j);
}

static void
key_matches_bytes (const struct bkey_padded *k, const uint8_t *b)
{
  FUZZ_ASSERT (KEY_PTRS (&k->key) <= BKEY_PAD_PTRS);
  for (unsigned i = 0; i < bkey_u64s (&k->key); i++)
    FUZZ_ASSERT (k->pad[i] == bch_get_le64 (b + 8 * i));
}

static void
jset_matches_bytes (const struct bch_jset *j, const uint8_t *b)
{
  FUZZ_ASSERT (j->csum == bch_get_le64 (b));
  FUZZ_ASSERT (j->magic == bch_get_le64 (b + 8));
  FUZZ_ASSERT (j->seq == bch_get_le64 (b + 16));
  FUZZ_ASSERT (j->version == bch_get_le32 (b + 24));
  FUZZ_ASSERT (j->keys == bch_get_le32 (b + 28));
  FUZZ_ASSERT (j->last_seq == bch_get_le64 (b + 32));
  key_matches_bytes (&j->uuid_bucket, b + JSET_UUID_OFF);
  key_matches_bytes (&j->btree_root, b + JSET_ROOT_OFF);
  FUZZ_ASSERT (j->btree_level == bch_get_le16 (b + JSET_LEVEL_OFF));
  for (unsigned i = 0; i < BCH_MAX_CACHES_PER_SET; i++)
    FUZZ_ASSERT (j->prio_bucket[i] == bch_get_le64 (b + JSET_PRIO_OFF + 8 * i));
}

static bool
all_zero (const uint8_t *p, size_t n)
{
  for (size_t i = 0; i < n; i++)
    if (p[i]) return false;
  return true;
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  struct fuzz_in in = { data, size };
  uint8_t flags = fuzz_u8 (&in);
  uint64_t magic = fuzz_u64 (&in);
  size_t len;
  uint8_t *buf = fuzz_rest (&in, &len);

  if ((flags & FUZZ_JSET_FIX_CSUM) && len >= BCH_JSET_HEADER_SIZE &&
      bch_jset_bytes (bch_get_le32 (buf + 28)) <= len)
    bch_put_le64 (buf, bch_jset_csum (buf, len));

  struct bch_jset j;
  struct bch_diag diag;
  jset_poison (&j);
  enum bch_status st = bch_jset_decode (buf, len, magic, &j, &diag);
  fuzz_log ("bch_jset_decode", st, &diag);
  fuzz_check_diag (st, &diag);

  if (st == BCH_OK) {
    size_t bytes = bch_jset_bytes (j.keys);
    FUZZ_ASSERT (bytes <= len);
    FUZZ_ASSERT (bytes <= BCH_JSET_MAX_BYTES);
    FUZZ_ASSERT (j.magic == magic);
    FUZZ_ASSERT (j.last_seq <= j.seq);
    FUZZ_ASSERT (j.csum == bch_jset_csum (buf, len));
    FUZZ_ASSERT ((const uint8_t *) j.key_words == buf + BCH_JSET_HEADER_SIZE);
    jset_matches_bytes (&j, buf);

    /* The journalled keys: decode what decodes (jset_decode does not
     * promise they are well formed). */
    size_t pos = 0;
    while (pos < j.keys) {
      struct bkey_padded kp;
      struct bch_diag kd;
      enum bch_status kst = bkey_decode (j.key_words + pos,
                                         (j.keys - pos) * 8, &kp, &kd);
      fuzz_check_diag (kst, &kd);
      if (kst != BCH_OK)
        break;
      pos += bkey_u64s (&kp.key);
    }

    /* Round trip. */
    uint8_t *enc = malloc (bytes);
    if (!enc) abort ();
    memset (enc, FUZZ_POISON, BCH_JSET_HEADER_SIZE);
    memcpy (enc + BCH_JSET_HEADER_SIZE, buf + BCH_JSET_HEADER_SIZE,
            bytes - BCH_JSET_HEADER_SIZE);
    struct bch_jset j1 = j;
    j1.csum = ~j.csum;                  /* must be ignored */
    j1.key_words = NULL;                /* the keys are already in place */
    FUZZ_ASSERT (bch_jset_encode (&j1, enc, bytes) == bytes);
    FUZZ_ASSERT (bch_get_le64 (enc) == bch_jset_csum (enc, bytes));

    size_t uuid_end = JSET_UUID_OFF + bkey_bytes (&j.uuid_bucket.key);
    size_t root_end = JSET_ROOT_OFF + bkey_bytes (&j.btree_root.key);
    FUZZ_ASSERT (memcmp (enc + 8, buf + 8, uuid_end - 8) == 0);
    FUZZ_ASSERT (memcmp (enc + JSET_ROOT_OFF, buf + JSET_ROOT_OFF,
                         root_end - JSET_ROOT_OFF) == 0);
    FUZZ_ASSERT (memcmp (enc + JSET_LEVEL_OFF, buf + JSET_LEVEL_OFF, 2) == 0);
    FUZZ_ASSERT (memcmp (enc + JSET_PRIO_OFF, buf + JSET_PRIO_OFF,
                         bytes - JSET_PRIO_OFF) == 0);
    /* Padding is written as zeroes. */
    FUZZ_ASSERT (all_zero (enc + uuid_end, JSET_ROOT_OFF - uuid_end));
    FUZZ_ASSERT (all_zero (enc + root_end, JSET_LEVEL_OFF - root_end));
    FUZZ_ASSERT (all_zero (enc + JSET_LEVEL_OFF + 2, JSET_PRIO_OFF - JSET_LEVEL_OFF - 2));
    /* So with zero padding in the input the whole entry is identical. */
    if (all_zero (buf + uuid_end, JSET_ROOT_OFF - uuid_end) &&
        all_zero (buf + root_end, JSET_LEVEL_OFF - root_end) &&
        all_zero (buf + JSET_LEVEL_OFF + 2, JSET_PRIO_OFF - JSET_LEVEL_OFF - 2))
      FUZZ_ASSERT (memcmp (enc, buf, bytes) == 0);

    struct bch_jset j2;
    struct bch_diag d2;
    jset_poison (&j2);
    enum bch_status st2 = bch_jset_decode (enc, bytes, magic, &j2, &d2);
    fuzz_check_diag (st2, &d2);
    FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);
    jset_matches_bytes (&j2, enc);
    FUZZ_ASSERT (j2.seq == j.seq && j2.last_seq == j.last_seq &&
                 j2.keys == j.keys && j2.version == j.version &&
                 j2.btree_level == j.btree_level);
    FUZZ_ASSERT (memcmp (j2.prio_bucket, j.prio_bucket, sizeof j.prio_bucket) == 0);
    free (enc);

    /* Too small by one byte: refused, nothing written out of bounds. */
    enc = malloc (bytes - 1);
    if (!enc) abort ();
    if (bytes - 1 > BCH_JSET_HEADER_SIZE)
      memcpy (enc + BCH_JSET_HEADER_SIZE, buf + BCH_JSET_HEADER_SIZE,
              bytes - 1 - BCH_JSET_HEADER_SIZE);
    FUZZ_ASSERT (bch_jset_encode (&j1, enc, bytes - 1) == 0);
    free (enc);
  }

  free (buf);
  return 0;
}
