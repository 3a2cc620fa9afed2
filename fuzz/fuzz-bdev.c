/* bcachefilter fuzz target: backing-device superblock (make-bcache -B).
 *
 * Input: u8 flags | u64 device_sectors | superblock area (any length).
 *
 * The area comes from a remote export (the filter's backing store), so it
 * is untrusted like a cache device.
 *
 * - bch_bdev_sb_decode on the area (in an exactly-sized heap buffer);
 *   with FUZZ_SB_FIX_CSUM the checksum is recomputed first so the fuzzer
 *   gets past the CRC to the field rules.
 * - Every superblock accepted satisfies the rules of bch_bdev_sb_decode
 *   (an oracle written out here), and decode(encode(x)) == x with the
 *   encoding reproducing the input's field bytes.
 * - bch_bdev_sb_set_state on an accepted area (set_uuid and state taken
 *   from the input's flags and tail) gives an area that decodes to the
 *   new set_uuid and state, with every other byte unchanged.
 */
#include <config.h>

#include "common.h"

/* Every field except csum, set_uuid and flags. */
static void
bdev_assert_same_fields (const struct bch_sb *a, const struct bch_sb *b)
{
  FUZZ_ASSERT (a->offset == b->offset);
  FUZZ_ASSERT (a->version == b->version);
  FUZZ_ASSERT (memcmp (a->magic, b->magic, 16) == 0);
  FUZZ_ASSERT (memcmp (a->uuid, b->uuid, 16) == 0);
  FUZZ_ASSERT (memcmp (a->label, b->label, sizeof a->label) == 0);
  FUZZ_ASSERT (a->seq == b->seq);
  FUZZ_ASSERT (a->feature_compat == b->feature_compat);
  FUZZ_ASSERT (a->feature_incompat == b->feature_incompat);
  FUZZ_ASSERT (a->feature_ro_compat == b->feature_ro_compat);
  FUZZ_ASSERT (a->nbuckets == b->nbuckets);
  FUZZ_ASSERT (a->block_size == b->block_size);
  FUZZ_ASSERT (a->bucket_size == b->bucket_size);
  FUZZ_ASSERT (a->last_mount == b->last_mount);
  FUZZ_ASSERT (a->first_bucket == b->first_bucket);
  FUZZ_ASSERT (a->njournal_buckets == b->njournal_buckets);
  for (unsigned i = 0; i < BCH_SB_JOURNAL_BUCKETS; i++)
    FUZZ_ASSERT (a->d[i] == b->d[i]);
  FUZZ_ASSERT (a->obso_bucket_size_hi == b->obso_bucket_size_hi);
}

/* The rules bch_bdev_sb_decode documents, on every area it accepts. */
static void
bdev_oracle (const struct bch_sb *sb, const uint8_t *buf, size_t len,
             uint64_t device_sectors)
{
  uint64_t data = bch_bdev_data_offset (sb);

  FUZZ_ASSERT (len >= BCH_SB_STRUCT_SIZE);
  FUZZ_ASSERT (memcmp (sb->magic, bch_sb_magic, 16) == 0);
  FUZZ_ASSERT (sb->offset == BCH_SB_SECTOR);
  FUZZ_ASSERT (bch_sb_is_backing (sb));
  FUZZ_ASSERT (sb->csum == bch_get_le64 (buf));
  FUZZ_ASSERT (sb->csum == bch_sb_csum (buf, len));
  FUZZ_ASSERT (!bch_uuid_is_zero (sb->uuid));
  FUZZ_ASSERT (data >= BCH_BDEV_DATA_START_DEFAULT);
  if (sb->version == BCACHE_SB_VERSION_BDEV)
    FUZZ_ASSERT (data == BCH_BDEV_DATA_START_DEFAULT);
  else
    FUZZ_ASSERT (data == bch_get_le64 (buf + 184));
  FUZZ_ASSERT (bch_bdev_cache_mode (sb) <= BCH_BDEV_MODE_NONE);
  FUZZ_ASSERT (bch_bdev_state (sb) <= BCH_BDEV_STATE_STALE);
  FUZZ_ASSERT (strcmp (bch_bdev_state_name (bch_bdev_state (sb)),
                       "invalid") != 0);
  if (device_sectors)
    FUZZ_ASSERT (data < device_sectors);
}

/* decode (encode (sb)) == sb, and the encoding has the input's field
 * bytes (a backing superblock keeps its feature words as stored). */
static void
bdev_roundtrip (const struct bch_sb *sb, const uint8_t *buf, size_t len)
{
  uint8_t *enc = malloc (BCH_SB_AREA_SIZE);
  struct bch_sb sb2;
  struct bch_diag d2;
  enum bch_status st2;
  size_t dend = 208 + 8 * (size_t) (sb->njournal_buckets < BCH_SB_JOURNAL_BUCKETS
                                    ? sb->njournal_buckets
                                    : BCH_SB_JOURNAL_BUCKETS);

  if (!enc)
    abort ();
  memset (enc, FUZZ_POISON, BCH_SB_AREA_SIZE);
  bch_sb_encode (sb, enc);
  st2 = bch_bdev_sb_decode (enc, BCH_SB_AREA_SIZE, 0, &sb2, &d2);
  fuzz_check_diag (st2, &d2);
  FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);
  bdev_assert_same_fields (sb, &sb2);
  FUZZ_ASSERT (memcmp (sb->set_uuid, sb2.set_uuid, 16) == 0);
  FUZZ_ASSERT (sb->flags == sb2.flags);
  FUZZ_ASSERT (memcmp (enc + 8, buf + 8, 144 - 8) == 0);
  FUZZ_ASSERT (memcmp (enc + 184, buf + 184, dend - 184) == 0);
  FUZZ_ASSERT (memcmp (enc + 2256, buf + 2256, 2) == 0);
  (void) len;
  free (enc);
}

/* bch_bdev_sb_set_state changes set_uuid, the state bits and the
 * checksum, nothing else; the result decodes. */
static void
bdev_set_state (const struct bch_sb *sb, const uint8_t *buf, size_t len,
                const uint8_t set_uuid[16], unsigned state)
{
  uint8_t *area = calloc (1, BCH_SB_AREA_SIZE);
  struct bch_sb sb2;
  struct bch_diag d2;
  enum bch_status st2;

  if (!area)
    abort ();
  memcpy (area, buf, len < BCH_SB_AREA_SIZE ? len : BCH_SB_AREA_SIZE);
  bch_bdev_sb_set_state (area, set_uuid, state);
  st2 = bch_bdev_sb_decode (area, BCH_SB_AREA_SIZE, 0, &sb2, &d2);
  fuzz_check_diag (st2, &d2);
  FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);
  FUZZ_ASSERT (memcmp (sb2.set_uuid, set_uuid, 16) == 0);
  FUZZ_ASSERT (bch_bdev_state (&sb2) == state);
  FUZZ_ASSERT ((sb2.flags & ~BCH_BDEV_STATE_MASK) ==
               (sb->flags & ~BCH_BDEV_STATE_MASK));
  bdev_assert_same_fields (sb, &sb2);
  for (size_t i = 8; i < BCH_SB_AREA_SIZE && i < len; i++)
    if ((i < 56 || i >= 72) && (i < 104 || i >= 112))
      FUZZ_ASSERT (area[i] == buf[i]);
  free (area);
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  struct fuzz_in in = { data, size };
  uint8_t flags = fuzz_u8 (&in);
  uint64_t device_sectors = fuzz_u64 (&in);
  size_t len;
  uint8_t *buf = fuzz_rest (&in, &len);
  struct bch_sb sb;
  struct bch_diag diag;
  enum bch_status st;

  if ((flags & FUZZ_SB_FIX_CSUM) && len >= BCH_SB_STRUCT_SIZE)
    bch_put_le64 (buf, bch_sb_csum (buf, len));

  memset (&sb, FUZZ_POISON, sizeof sb);
  memset (&diag, FUZZ_POISON, sizeof diag);
  st = bch_bdev_sb_decode (buf, len, device_sectors, &sb, &diag);
  fuzz_log ("bch_bdev_sb_decode", st, &diag);
  fuzz_check_diag (st, &diag);

  if (st == BCH_ERR_TRUNCATED)
    FUZZ_ASSERT (len < BCH_SB_STRUCT_SIZE);
  if (st == BCH_ERR_VERSION)
    FUZZ_ASSERT (!bch_sb_is_backing (&sb));
  if (st != BCH_ERR_TRUNCATED)
    (void) bch_bdev_state_name (bch_bdev_state (&sb));

  if (st == BCH_OK) {
    uint8_t set_uuid[16];

    bdev_oracle (&sb, buf, len, device_sectors);
    bdev_roundtrip (&sb, buf, len);
    /* The new set_uuid: the last 16 bytes of the input, whatever they
     * are (zero for a detach included). */
    memcpy (set_uuid, buf + len - 16, 16);
    bdev_set_state (&sb, buf, len, set_uuid, (flags >> 1) & 3);
  }
  free (buf);
  return 0;
}
