/* bcachefilter fuzz target: a btree node (a log of bsets).
 *
 * Input: u8 flags | u8 block_shift | u8 level | u8 nr_in_set |
 *        u8 stop_after | u64 bset_magic | u64 node_ptr0 | u64 nbuckets |
 *        u64 bucket_sectors | u64 first_bucket | node bytes.
 *
 * block bytes = 512 << (block_shift % 4), i.e. every block size a valid
 * superblock allows.  With FUZZ_NODE_FIX_CSUM every bset found at a block
 * boundary is resealed first, so the fuzzer gets past the CRC.  The node
 * is cut to whole blocks unless FUZZ_NODE_RAW_LEN is set.
 *
 * bch_node_walk runs over an exactly-sized heap copy of the node; the
 * callback checks each set's placement and decodes and re-validates every
 * key in it.  On success, the walk's results are checked against the
 * kernel's reader rules (bcache.md §1.5).
 */
#include <config.h>

#include "common.h"

struct walk_ctx {
  const uint8_t *node;
  size_t len;
  unsigned block;
  unsigned level;
  const struct bch_key_geometry *geo;
  uint64_t magic;
  uint64_t node_ptr0;
  unsigned stop_after;
  unsigned count;
  uint64_t seq0;
  size_t next_offset;           /* where the next set must start */
  bool stopped;
};

static size_t
round_up (size_t v, size_t a)
{
  return (v + a - 1) / a * a;
}

static int
walk_cb (const struct bch_node_bset *set, void *opaque)
{
  struct walk_ctx *c = opaque;

  FUZZ_ASSERT (!c->stopped);
  FUZZ_ASSERT (set->offset == c->next_offset);
  FUZZ_ASSERT (set->offset % c->block == 0);
  FUZZ_ASSERT (set->offset < c->len);
  FUZZ_ASSERT (bch_bset_bytes (set->hdr.keys) <= c->len - set->offset);
  FUZZ_ASSERT ((const uint8_t *) set->keys ==
               c->node + set->offset + BCH_BSET_HEADER_SIZE);

  /* The header as decoded is the header as stored. */
  const uint8_t *h = c->node + set->offset;
  FUZZ_ASSERT (set->hdr.csum == bch_get_le64 (h));
  FUZZ_ASSERT (set->hdr.magic == bch_get_le64 (h + 8));
  FUZZ_ASSERT (set->hdr.seq == bch_get_le64 (h + 16));
  FUZZ_ASSERT (set->hdr.version == bch_get_le32 (h + 24));
  FUZZ_ASSERT (set->hdr.keys == bch_get_le32 (h + 28));

  FUZZ_ASSERT (set->hdr.magic == c->magic);
  FUZZ_ASSERT (set->hdr.version <= BCACHE_BSET_VERSION);
  if (c->count == 0)
    c->seq0 = set->hdr.seq;
  else {
    FUZZ_ASSERT (set->hdr.seq == c->seq0);
    FUZZ_ASSERT (set->hdr.keys > 0);        /* empty non-first set */
  }

  /* Every key decodes and (the walk checked it) validates. */
  size_t pos = 0;
  while (pos < set->hdr.keys) {
    size_t avail = set->hdr.keys - pos;
    struct bkey_padded kp;
    struct bch_diag d;
    memset (&kp, FUZZ_POISON, sizeof kp);
    enum bch_status st = bkey_decode (set->keys + pos, avail * 8, &kp, &d);
    fuzz_check_diag (st, &d);
    FUZZ_ASSERT_DIAG (st == BCH_OK, d);
    FUZZ_ASSERT (bkey_u64s (&kp.key) <= avail);
    st = bkey_validate (&kp.key, avail, c->level, c->geo, &d);
    fuzz_check_diag (st, &d);
    FUZZ_ASSERT_DIAG (st == BCH_OK, d);
    pos += bkey_u64s (&kp.key);
  }
  FUZZ_ASSERT (pos == set->hdr.keys);

  /* Resealing the set reproduces it (version 1; a version 0 set comes
   * back as version 1 with the matching checksum); a buffer one byte too
   * short is refused. */
  size_t bytes = bch_bset_bytes (set->hdr.keys);
  uint8_t *copy = malloc (bytes);
  if (!copy) abort ();
  memcpy (copy, h, bytes);
  memset (copy, FUZZ_POISON, BCH_BSET_HEADER_SIZE);
  FUZZ_ASSERT (bch_bset_seal (copy, bytes, set->hdr.magic, set->hdr.seq,
                              set->hdr.keys, c->node_ptr0) == bytes);
  FUZZ_ASSERT (bch_get_le32 (copy + 24) == BCACHE_BSET_VERSION);
  FUZZ_ASSERT (bch_get_le64 (copy) == bch_bset_csum (copy, bytes, c->node_ptr0));
  if (set->hdr.version == BCACHE_BSET_VERSION)
    FUZZ_ASSERT (memcmp (copy, h, bytes) == 0);
  else
    FUZZ_ASSERT (memcmp (copy + 8, h + 8, 16) == 0 &&
                 memcmp (copy + 28, h + 28, bytes - 28) == 0);
  FUZZ_ASSERT (bch_bset_seal (copy, bytes - 1, set->hdr.magic, set->hdr.seq,
                              set->hdr.keys, c->node_ptr0) == 0);
  free (copy);

  c->next_offset = set->offset + round_up (bch_bset_bytes (set->hdr.keys), c->block);
  c->count++;
  if (c->stop_after && c->count == c->stop_after) {
    c->stopped = true;
    return 1;
  }
  return 0;
}

/* Reseal each bset at the block boundaries the reader will visit. */
static void
fix_csums (uint8_t *node, size_t len, unsigned block, uint64_t node_ptr0)
{
  size_t off = 0;
  while (off < len && len - off >= BCH_BSET_HEADER_SIZE) {
    uint32_t keys = bch_get_le32 (node + off + 28);
    size_t bytes = bch_bset_bytes (keys);
    if (bytes > len - off)
      break;
    bch_put_le64 (node + off, bch_bset_csum (node + off, len - off, node_ptr0));
    off += round_up (bytes, block);
  }
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  struct fuzz_in in = { data, size };
  uint8_t flags = fuzz_u8 (&in);
  unsigned block = 512u << (fuzz_u8 (&in) % 4);
  unsigned level = fuzz_u8 (&in);
  struct bch_key_geometry geo;
  geo.nr_in_set = fuzz_u8 (&in);
  unsigned stop_after = fuzz_u8 (&in);
  uint64_t magic = fuzz_u64 (&in);
  uint64_t node_ptr0 = fuzz_u64 (&in);
  geo.nbuckets = fuzz_u64 (&in);
  geo.bucket_sectors = fuzz_u64 (&in);
  geo.first_bucket = fuzz_u64 (&in);
  /* bch_node_walk takes whole blocks only (a ragged length is refused
   * up front), so normally cut the node to whole blocks to spend the
   * time on the walk; FUZZ_NODE_RAW_LEN keeps the ragged length. */
  if (!(flags & FUZZ_NODE_RAW_LEN))
    in.n -= in.n % block;
  size_t len;
  uint8_t *node = fuzz_rest (&in, &len);

  if (flags & FUZZ_NODE_FIX_CSUM)
    fix_csums (node, len, block, node_ptr0);

  struct walk_ctx c = {
    .node = node, .len = len, .block = block, .level = level, .geo = &geo,
    .magic = magic, .node_ptr0 = node_ptr0, .stop_after = stop_after,
  };
  unsigned nsets = 12345;
  size_t written = 12345;
  struct bch_diag diag;
  enum bch_status st = bch_node_walk (node, len, block, magic, node_ptr0,
                                      level, &geo, walk_cb, &c,
                                      &nsets, &written, &diag);
  fuzz_log ("bch_node_walk", st, &diag);
  fuzz_check_diag (st, &diag);

  if (c.stopped)
    FUZZ_ASSERT_DIAG (st == BCH_ERR_INVALID, diag);

  if (st == BCH_OK) {
    FUZZ_ASSERT (!c.stopped);
    FUZZ_ASSERT (nsets >= 1 && nsets == c.count);
    FUZZ_ASSERT (written == c.next_offset);
    FUZZ_ASSERT (written % block == 0);
    FUZZ_ASSERT (written <= round_up (len, block));
    /* No block after the log still carries the node's seq: the kernel
     * (bch_btree_node_read_done, "corrupted btree") compares seq only,
     * whatever the magic. */
    for (size_t off = written; off < len && len - off >= 24; off += block)
      FUZZ_ASSERT (bch_get_le64 (node + off + 16) != c.seq0);
  }

  free (node);
  return 0;
}
