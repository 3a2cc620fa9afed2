/* bcachefilter fuzz target: cache superblock.
 *
 * Input: u8 flags | u64 device_sectors | superblock area (any length).
 *
 * - bch_sb_decode on the area (in an exactly-sized heap buffer); with
 *   FUZZ_SB_FIX_CSUM the checksum is recomputed first so the fuzzer gets
 *   past the CRC to the geometry rules.
 * - bch_sb_validate with device_sectors from the input, plus an oracle of
 *   the documented rules (bcache.md §1.2) for every superblock accepted.
 * - decode(encode(x)) == x for every field, and the encoding reproduces
 *   the input's field bytes.
 * - The geometry helpers (bucket sectors, node bytes, journal buckets).
 */
#include <config.h>

#include "common.h"

static void
sb_poison (struct bch_sb *sb)
{
  memset (sb, FUZZ_POISON, sizeof *sb);
}

/* Every field except csum. */
static void
sb_assert_same (const struct bch_sb *a, const struct bch_sb *b)
{
  FUZZ_ASSERT (a->offset == b->offset);
  FUZZ_ASSERT (a->version == b->version);
  FUZZ_ASSERT (memcmp (a->magic, b->magic, sizeof a->magic) == 0);
  FUZZ_ASSERT (memcmp (a->uuid, b->uuid, sizeof a->uuid) == 0);
  FUZZ_ASSERT (memcmp (a->set_uuid, b->set_uuid, sizeof a->set_uuid) == 0);
  FUZZ_ASSERT (memcmp (a->label, b->label, sizeof a->label) == 0);
  FUZZ_ASSERT (a->flags == b->flags);
  FUZZ_ASSERT (a->seq == b->seq);
  FUZZ_ASSERT (a->feature_compat == b->feature_compat);
  FUZZ_ASSERT (a->feature_incompat == b->feature_incompat);
  FUZZ_ASSERT (a->feature_ro_compat == b->feature_ro_compat);
  FUZZ_ASSERT (a->nbuckets == b->nbuckets);
  FUZZ_ASSERT (a->block_size == b->block_size);
  FUZZ_ASSERT (a->bucket_size == b->bucket_size);
  FUZZ_ASSERT (a->nr_in_set == b->nr_in_set);
  FUZZ_ASSERT (a->nr_this_dev == b->nr_this_dev);
  FUZZ_ASSERT (a->last_mount == b->last_mount);
  FUZZ_ASSERT (a->first_bucket == b->first_bucket);
  FUZZ_ASSERT (a->njournal_buckets == b->njournal_buckets);
  for (unsigned i = 0; i < a->njournal_buckets && i < BCH_SB_JOURNAL_BUCKETS; i++)
    FUZZ_ASSERT (a->d[i] == b->d[i]);
  FUZZ_ASSERT (a->obso_bucket_size_hi == b->obso_bucket_size_hi);
}

static bool
is_pow2 (uint64_t v)
{
  return v && !(v & (v - 1));
}

/* The registration rules of bcache.md §1.2 for a cache device, checked on
 * every superblock the code accepts. */
static void
sb_oracle (const struct bch_sb *sb, uint64_t device_sectors)
{
  uint64_t bs = bch_sb_bucket_sectors (sb);

  FUZZ_ASSERT (sb->offset == BCH_SB_SECTOR);
  FUZZ_ASSERT (memcmp (sb->magic, bch_sb_magic, 16) == 0);
  FUZZ_ASSERT (!bch_sb_is_backing (sb));
  FUZZ_ASSERT (sb->version <= BCACHE_SB_MAX_VERSION && sb->version != 2);
  /* Feature words only mean something from version 5 on (the kernel
   * ignores them before). */
  if (sb->version >= BCACHE_SB_VERSION_CDEV_WITH_FEATURES) {
    FUZZ_ASSERT ((sb->feature_incompat & ~BCH_FEATURE_INCOMPAT_SUPP) == 0);
    FUZZ_ASSERT ((sb->feature_compat & ~BCH_FEATURE_COMPAT_SUPP) == 0);
    FUZZ_ASSERT ((sb->feature_ro_compat & ~BCH_FEATURE_RO_COMPAT_SUPP) == 0);
  }
  FUZZ_ASSERT (!bch_uuid_is_zero (sb->uuid));
  FUZZ_ASSERT (!bch_uuid_is_zero (sb->set_uuid));
  FUZZ_ASSERT (sb->nbuckets >= 128 && sb->nbuckets <= (uint64_t) INT64_MAX);
  FUZZ_ASSERT (is_pow2 (sb->block_size) && sb->block_size <= BCH_PAGE_SECTORS);
  FUZZ_ASSERT (is_pow2 (bs) && bs >= BCH_PAGE_SECTORS);
  FUZZ_ASSERT (sb->nr_in_set >= 1 && sb->nr_in_set <= BCH_MAX_CACHES_PER_SET);
  FUZZ_ASSERT (sb->nr_this_dev < sb->nr_in_set);
  FUZZ_ASSERT (sb->njournal_buckets <= BCH_SB_JOURNAL_BUCKETS);
  FUZZ_ASSERT ((uint64_t) sb->first_bucket + sb->njournal_buckets <= sb->nbuckets);
  FUZZ_ASSERT ((uint64_t) sb->first_bucket * bs >= 16);
  for (unsigned i = 0; i < sb->njournal_buckets; i++)
    FUZZ_ASSERT (sb->d[i] == (uint64_t) sb->first_bucket + i);
  if (device_sectors) {
    /* nbuckets * bs <= device_sectors, without overflowing. */
    FUZZ_ASSERT (sb->nbuckets <= device_sectors / bs);
  }

  /* A node fits in its bucket and is a whole number of pages. */
  uint64_t nb = bch_btree_node_bytes (bs);
  FUZZ_ASSERT (nb > 0 && nb <= bs * BCH_SECTOR_SIZE && nb % BCH_PAGE_SIZE == 0);
}

/* Helpers that take any field values: must not crash or hit UB. */
static void
sb_helpers (const struct bch_sb *sb)
{
  uint64_t bs = bch_sb_bucket_sectors (sb);
  (void) bch_btree_node_bytes (bs);
  (void) bch_btree_node_bytes (sb->nbuckets);
  unsigned j = bch_journal_buckets_for (sb->nbuckets);
  uint64_t want = sb->nbuckets >> 7;
  want = want < 2 ? 2 : want > 256 ? 256 : want;
  FUZZ_ASSERT (j == want);
  (void) bch_set_magic (sb);
  (void) bch_sb_replacement (sb);
  (void) bch_prio_buckets (sb->nbuckets, bs * BCH_SECTOR_SIZE);
  (void) bch_pset_csum_bytes (bs * BCH_SECTOR_SIZE);
  char s[37];
  bch_uuid_unparse (sb->uuid, s);
  FUZZ_ASSERT (s[36] == '\0' && strlen (s) == 36);
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

  if ((flags & FUZZ_SB_FIX_CSUM) && len >= BCH_SB_STRUCT_SIZE)
    bch_put_le64 (buf, bch_sb_csum (buf, len));

  struct bch_sb sb;
  struct bch_diag diag;
  sb_poison (&sb);
  memset (&diag, FUZZ_POISON, sizeof diag);
  enum bch_status st = bch_sb_decode (buf, len, &sb, &diag);
  fuzz_log ("bch_sb_decode", st, &diag);
  fuzz_check_diag (st, &diag);

  /* Documented: *sb is filled in on BACKING, CSUM and later errors.  An
   * early INVALID (e.g. offset) leaves it unspecified, so only treat an
   * INVALID sb as filled if the earlier checks visibly passed. */
  bool filled = st == BCH_OK || st == BCH_ERR_CSUM ||
    (st == BCH_ERR_INVALID && sb.offset == BCH_SB_SECTOR &&
     sb.version <= BCACHE_SB_MAX_VERSION && sb.version != 2 &&
     !bch_sb_is_backing (&sb) &&
     memcmp (sb.magic, bch_sb_magic, 16) == 0);

  if (st == BCH_ERR_TRUNCATED)
    FUZZ_ASSERT (len < BCH_SB_AREA_SIZE);
  if (st == BCH_OK || st == BCH_ERR_CSUM) {
    FUZZ_ASSERT (len >= BCH_SB_STRUCT_SIZE);
    FUZZ_ASSERT (sb.csum == bch_get_le64 (buf));
    FUZZ_ASSERT ((st == BCH_OK) == (sb.csum == bch_sb_csum (buf, len)));
  }
  if (st == BCH_OK || st == BCH_ERR_BACKING)
    FUZZ_ASSERT (memcmp (sb.magic, bch_sb_magic, 16) == 0);
  if (st == BCH_ERR_BACKING)
    FUZZ_ASSERT (bch_sb_is_backing (&sb));

  if (filled || st == BCH_ERR_BACKING)
    sb_helpers (&sb);

  if (st == BCH_OK) {
    sb_oracle (&sb, 0);

    /* decode ran the validate rules with the size unknown. */
    struct bch_diag vdiag;
    enum bch_status vst = bch_sb_validate (&sb, 0, &vdiag);
    fuzz_check_diag (vst, &vdiag);
    FUZZ_ASSERT_DIAG (vst == BCH_OK, vdiag);

    vst = bch_sb_validate (&sb, device_sectors, &vdiag);
    fuzz_log ("bch_sb_validate", vst, &vdiag);
    fuzz_check_diag (vst, &vdiag);
    FUZZ_ASSERT (vst == BCH_OK || vst == BCH_ERR_INVALID ||
                 vst == BCH_ERR_TRUNCATED);
    if (vst == BCH_OK)
      sb_oracle (&sb, device_sectors);
    else
      /* Only the size check can fail now (format.c: TRUNCATED). */
      FUZZ_ASSERT (device_sectors != 0 &&
                   sb.nbuckets > device_sectors / bch_sb_bucket_sectors (&sb));
  }
  else if (filled) {
    /* Validation of an arbitrary filled-in sb must not crash either. */
    struct bch_diag vdiag;
    enum bch_status vst = bch_sb_validate (&sb, device_sectors, &vdiag);
    fuzz_check_diag (vst, &vdiag);
    if (vst == BCH_OK)
      sb_oracle (&sb, device_sectors);
  }

  /* Round trip. */
  if (filled) {
    uint8_t *enc = malloc (BCH_SB_AREA_SIZE);
    if (!enc) abort ();
    memset (enc, FUZZ_POISON, BCH_SB_AREA_SIZE);
    bch_sb_encode (&sb, enc);

    /* Unused bytes are zero: pad[5] and everything after the struct. */
    for (size_t i = 144; i < 184; i++)
      FUZZ_ASSERT (enc[i] == 0);
    for (size_t i = 2258; i < BCH_SB_AREA_SIZE; i++)
      FUZZ_ASSERT (enc[i] == 0);
    FUZZ_ASSERT (bch_get_le64 (enc) == bch_sb_csum (enc, BCH_SB_AREA_SIZE));

    struct bch_sb sb2;
    struct bch_diag d2;
    sb_poison (&sb2);
    enum bch_status st2 = bch_sb_decode (enc, BCH_SB_AREA_SIZE, &sb2, &d2);
    fuzz_check_diag (st2, &d2);
    if (st == BCH_OK)
      FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);
    else
      /* The checksum is now right; the geometry verdict is unchanged. */
      FUZZ_ASSERT_DIAG (st2 == BCH_OK || st2 == BCH_ERR_INVALID, d2);
    if (st == BCH_ERR_INVALID)
      FUZZ_ASSERT_DIAG (st2 == BCH_ERR_INVALID, d2);
    sb_assert_same (&sb, &sb2);
    FUZZ_ASSERT (sb2.csum == bch_get_le64 (enc));

    /* The encoding reproduces the input's field bytes. */
    if (len >= BCH_SB_STRUCT_SIZE) {
      size_t dend = 208 + 8 * (size_t) (sb.njournal_buckets < BCH_SB_JOURNAL_BUCKETS ?
                                        sb.njournal_buckets : BCH_SB_JOURNAL_BUCKETS);
      /* Below version 5 the feature words (120..143) are not fields:
       * decode ignores them, so they encode as zero. */
      size_t fend = sb.version >= BCACHE_SB_VERSION_CDEV_WITH_FEATURES
                    ? 144 : 120;
      FUZZ_ASSERT (memcmp (enc + 8, buf + 8, fend - 8) == 0);
      FUZZ_ASSERT (memcmp (enc + 184, buf + 184, dend - 184) == 0);
      FUZZ_ASSERT (memcmp (enc + 2256, buf + 2256, 2) == 0);
      /* And, when the input's pad is zero, the same checksum. */
      bool pad_zero = true;
      for (size_t i = 144; i < 184; i++)
        pad_zero &= buf[i] == 0;
      for (size_t i = fend; i < 144; i++)
        pad_zero &= buf[i] == 0;
      if (pad_zero && st == BCH_OK)
        FUZZ_ASSERT (memcmp (enc, buf, 8) == 0);
    }
    free (enc);
  }

  free (buf);
  return 0;
}
