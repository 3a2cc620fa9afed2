/* bcachefilter fuzz target: a whole journal bucket.
 *
 * Input: u8 flags | u8 block_shift | u16 bucket_blocks | u8 stop_after |
 *        u32 raw_block | u64 jset_magic | bucket bytes (common.h).
 *
 * block bytes = 512 << (block_shift % 4) and the bucket is a whole number
 * of blocks up to 64 KiB; the rest of the input is cut or zero-padded to
 * the bucket (free space reads as zeroes).  With FUZZ_JOURNAL_RAW the
 * block size is raw_block and the length is the input's, so parameter
 * checking is fuzzed too.  With FUZZ_JOURNAL_FIX_CSUM every entry the
 * walk will meet is resealed first, so the fuzzer gets past the CRC.
 *
 * bch_journal_bucket_walk runs over an exactly-sized heap copy of the
 * bucket.  The callback checks that each entry is block aligned, inside
 * the bucket, after the previous one (no overlap), of the block-rounded
 * size of its keys, and that bch_jset_decode at its offset (over the rest
 * of the bucket and over an exactly-sized copy of the entry alone) gives
 * the same entry.  After the walk, the list of entries must equal what
 * the engine's loop, written out here, finds.  bch_journal_bucket_scan
 * (the walk core/journal.c's journal_scan uses) must find the same
 * entries, and report as bad only blocks that carry the magic but do not
 * decode, with the decoder's reason.
 */
#include <config.h>

#include "common.h"

#define MAX_ENTRIES (FUZZ_JOURNAL_MAX_BUCKET / BCH_SECTOR_SIZE)

struct entry {
  size_t offset;
  size_t bytes;
  uint64_t seq;
};

struct walk_ctx {
  const uint8_t *bucket;
  size_t len;
  unsigned block;
  uint64_t magic;
  unsigned stop_after;
  unsigned count;
  size_t next_offset;           /* entries start at or after this */
  bool stopped;
  struct entry e[MAX_ENTRIES];
};

static size_t
round_up (size_t v, size_t a)
{
  return (v + a - 1) / a * a;
}

/* bch_journal_bucket_scan's callbacks: count the valid entries; check
 * each bad block (aligned, inside, not decodable, not free space, the
 * reason being the decoder's). */
struct scan_ctx {
  const uint8_t *bucket;
  size_t len;
  unsigned block;
  uint64_t magic;
  unsigned valid, bad;
};

static int
scan_valid (const struct bch_jset *j, size_t offset, size_t bytes,
            void *opaque)
{
  ((struct scan_ctx *) opaque)->valid++;
  return 0;
}

static int
scan_bad (size_t offset, const struct bch_diag *why, void *opaque)
{
  struct scan_ctx *c = opaque;
  struct bch_jset j;
  struct bch_diag d;
  enum bch_status st;

  FUZZ_ASSERT (offset % c->block == 0);
  FUZZ_ASSERT (offset < c->len);
  st = bch_jset_decode (c->bucket + offset, c->len - offset, c->magic, &j,
                        &d);
  FUZZ_ASSERT (st != BCH_OK && st != BCH_ERR_MAGIC);
  FUZZ_ASSERT (why->status == st && strcmp (why->msg, d.msg) == 0);
  c->bad++;
  return 0;
}

static void
same_jset (const struct bch_jset *a, const struct bch_jset *b)
{
  FUZZ_ASSERT (a->csum == b->csum);
  FUZZ_ASSERT (a->magic == b->magic);
  FUZZ_ASSERT (a->seq == b->seq);
  FUZZ_ASSERT (a->version == b->version);
  FUZZ_ASSERT (a->keys == b->keys);
  FUZZ_ASSERT (a->last_seq == b->last_seq);
  FUZZ_ASSERT (memcmp (a->uuid_bucket.pad, b->uuid_bucket.pad,
                       sizeof a->uuid_bucket.pad) == 0);
  FUZZ_ASSERT (memcmp (a->btree_root.pad, b->btree_root.pad,
                       sizeof a->btree_root.pad) == 0);
  FUZZ_ASSERT (a->btree_level == b->btree_level);
  FUZZ_ASSERT (memcmp (a->prio_bucket, b->prio_bucket,
                       sizeof a->prio_bucket) == 0);
}

static int
walk_cb (const struct bch_jset *j, size_t offset, size_t bytes, void *opaque)
{
  struct walk_ctx *c = opaque;

  FUZZ_ASSERT (!c->stopped);
  FUZZ_ASSERT (c->count < MAX_ENTRIES);
  /* Placement: aligned, inside, after the previous entry. */
  FUZZ_ASSERT (offset % c->block == 0);
  FUZZ_ASSERT (bytes % c->block == 0);
  FUZZ_ASSERT (offset >= c->next_offset);
  FUZZ_ASSERT (offset < c->len);
  FUZZ_ASSERT (bytes > 0 && bytes <= c->len - offset);
  FUZZ_ASSERT (bytes == round_up (bch_jset_bytes (j->keys), c->block));
  FUZZ_ASSERT (bch_jset_bytes (j->keys) <= BCH_JSET_MAX_BYTES);
  FUZZ_ASSERT (j->magic == c->magic);
  FUZZ_ASSERT (j->last_seq <= j->seq);
  FUZZ_ASSERT ((const uint8_t *) j->key_words ==
               c->bucket + offset + BCH_JSET_HEADER_SIZE);

  /* Re-decoding at that offset gives the same entry ... */
  struct bch_jset j2;
  struct bch_diag d2;
  memset (&j2, FUZZ_POISON, sizeof j2);
  enum bch_status st = bch_jset_decode (c->bucket + offset, c->len - offset,
                                        c->magic, &j2, &d2);
  fuzz_check_diag (st, &d2);
  FUZZ_ASSERT_DIAG (st == BCH_OK, d2);
  same_jset (j, &j2);
  FUZZ_ASSERT (j2.key_words == j->key_words);

  /* ... and so does the entry alone, in an exactly-sized buffer: it does
   * not depend on bytes outside its extent. */
  size_t n = bch_jset_bytes (j->keys);
  uint8_t *copy = malloc (n);
  if (!copy) abort ();
  memcpy (copy, c->bucket + offset, n);
  memset (&j2, FUZZ_POISON, sizeof j2);
  st = bch_jset_decode (copy, n, c->magic, &j2, &d2);
  fuzz_check_diag (st, &d2);
  FUZZ_ASSERT_DIAG (st == BCH_OK, d2);
  same_jset (j, &j2);
  FUZZ_ASSERT (memcmp (j2.key_words, j->key_words, (size_t) j->keys * 8) == 0);
  free (copy);

  c->e[c->count] = (struct entry) { offset, bytes, j->seq };
  c->next_offset = offset + bytes;
  c->count++;
  if (c->stop_after && c->count == c->stop_after) {
    c->stopped = true;
    return 1;
  }
  return 0;
}

/* The engine's scan_bucket loop (core/journal.c), minus the I/O. */
static unsigned
reference_scan (const uint8_t *buf, size_t len, unsigned block,
                uint64_t magic, struct entry *out)
{
  uint64_t off = 0;
  unsigned n = 0;

  while (off + BCH_JSET_HEADER_SIZE <= len) {
    struct bch_jset js;
    size_t l;

    if (bch_jset_decode (buf + off, len - off, magic, &js, NULL) != BCH_OK) {
      off += block;
      continue;
    }
    l = bch_jset_bytes (js.keys);
    l = (l + block - 1) / block * block;
    FUZZ_ASSERT (n < MAX_ENTRIES);
    out[n++] = (struct entry) { off, l, js.seq };
    off += l;
  }
  return n;
}

/* Reseal each entry the walk will meet: at each block boundary, a header
 * with the magic, a known version and a size that fits gets a fresh
 * checksum, and the walk goes on past it. */
static void
fix_csums (uint8_t *b, size_t len, unsigned block, uint64_t magic)
{
  size_t off = 0;

  while (len - off >= BCH_JSET_HEADER_SIZE) {
    uint8_t *p = b + off;
    uint32_t keys = bch_get_le32 (p + 28);
    size_t bytes = bch_jset_bytes (keys);

    if (bch_get_le64 (p + 8) == magic &&
        bch_get_le32 (p + 24) <= BCACHE_JSET_VERSION &&
        keys <= BCH_JSET_MAX_BYTES / 8 && bytes <= BCH_JSET_MAX_BYTES &&
        bytes <= len - off) {
      bch_put_le64 (p, bch_jset_csum (p, len - off));
      off += round_up (bytes, block);
    }
    else
      off += block;
  }
}

static bool
is_power_of_2 (uint64_t x)
{
  return x && !(x & (x - 1));
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  struct fuzz_in in = { data, size };
  uint8_t flags = fuzz_u8 (&in);
  unsigned block = 512u << (fuzz_u8 (&in) % 4);
  unsigned bucket_blocks = fuzz_u16 (&in);
  unsigned stop_after = fuzz_u8 (&in);
  uint32_t raw_block = fuzz_u32 (&in);
  uint64_t magic = fuzz_u64 (&in);
  bool params_ok = true;
  size_t len;
  uint8_t *bucket;

  if (flags & FUZZ_JOURNAL_RAW) {
    block = raw_block;
    if (in.n > FUZZ_JOURNAL_MAX_BUCKET)
      in.n = FUZZ_JOURNAL_MAX_BUCKET;
    bucket = fuzz_rest (&in, &len);
    params_ok = is_power_of_2 (block) && block >= BCH_SECTOR_SIZE &&
                len % block == 0;
  }
  else {
    len = (size_t) block * (1 + bucket_blocks % (FUZZ_JOURNAL_MAX_BUCKET / block));
    bucket = malloc (len);
    if (!bucket) abort ();
    size_t n = in.n < len ? in.n : len;
    memcpy (bucket, in.p, n);
    memset (bucket + n, 0, len - n);
  }

  if ((flags & FUZZ_JOURNAL_FIX_CSUM) && params_ok)
    fix_csums (bucket, len, block, magic);

  struct walk_ctx *c = malloc (sizeof *c);
  if (!c) abort ();
  memset (c, 0, sizeof *c);
  c->bucket = bucket;
  c->len = len;
  c->block = block;
  c->magic = magic;
  c->stop_after = stop_after;

  struct bch_diag diag;
  memset (&diag, FUZZ_POISON, sizeof diag);
  enum bch_status st = bch_journal_bucket_walk (bucket, len, block, magic,
                                                walk_cb, c, &diag);
  fuzz_log ("bch_journal_bucket_walk", st, &diag);
  fuzz_check_diag (st, &diag);

  if (!params_ok) {
    FUZZ_ASSERT_DIAG (st == BCH_ERR_INVALID, diag);
    FUZZ_ASSERT (c->count == 0);
  }
  else if (c->stopped) {
    FUZZ_ASSERT_DIAG (st == BCH_ERR_INVALID, diag);
    FUZZ_ASSERT (c->count == stop_after);
  }
  else {
    FUZZ_ASSERT_DIAG (st == BCH_OK, diag);
    FUZZ_ASSERT (diag.status == BCH_OK && diag.msg[0] == '\0');
  }

  if (params_ok) {
    /* Exactly the entries the engine's loop finds, in the same order (a
     * prefix of them when the callback stopped the walk). */
    static struct entry ref[MAX_ENTRIES];
    unsigned nref = reference_scan (bucket, len, block, magic, ref);
    if (c->stopped)
      FUZZ_ASSERT (c->count <= nref);
    else
      FUZZ_ASSERT (c->count == nref);
    for (unsigned i = 0; i < c->count; i++)
      FUZZ_ASSERT (c->e[i].offset == ref[i].offset &&
                   c->e[i].bytes == ref[i].bytes &&
                   c->e[i].seq == ref[i].seq);

    /* Without a callback the walk says the same. */
    struct bch_diag d2;
    enum bch_status st2 = bch_journal_bucket_walk (bucket, len, block, magic,
                                                   NULL, NULL, &d2);
    fuzz_check_diag (st2, &d2);
    FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);

    /* With a bad-block callback: the same entries. */
    struct scan_ctx sc = { .bucket = bucket, .len = len, .block = block,
                           .magic = magic };
    st2 = bch_journal_bucket_scan (bucket, len, block, magic, scan_valid,
                                   scan_bad, &sc, &d2);
    fuzz_check_diag (st2, &d2);
    FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);
    FUZZ_ASSERT (sc.valid == nref);
  }

  free (c);
  free (bucket);
  return 0;
}
