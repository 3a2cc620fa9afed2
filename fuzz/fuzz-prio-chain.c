/* bcachefilter fuzz target: a whole prio chain on a tiny device.
 *
 * Input: u8 flags | u8 bucket_shift | u8 first_bucket | u32 nbuckets |
 *        u64 head | u64 pset_magic | device bytes (common.h).
 *
 * bucket bytes = 4 KiB << (bucket_shift % 3) (4, 8 or 16 KiB).  The cache
 * has nbuckets buckets (taken modulo 66 * prios_per_bucket + 1, so the
 * chain needs up to 66 prio buckets, past the engine's limit of 64); the
 * device bytes are its first buckets (at most 64 KiB, cut to whole
 * buckets), each kept as an exactly-sized heap image, and every later
 * bucket reads as zeroes.  With FUZZ_PRIO_FIX_CSUM every stored bucket is
 * resealed first, so the fuzzer can rewire next_bucket pointers freely.
 *
 * The chain is followed from head exactly as the engine's
 * alloc_prio_read (core/alloc.c) does: bch_prio_buckets (nbuckets)
 * iterations at most (after alloc_init's refusal of more than 64), each
 * checking the bucket is in [first_bucket, nbuckets), reading it into an
 * exactly-sized buffer, stopping at the first bch_pset_decode error, and
 * copying its entries with bch_pset_entry into an exactly-sized table of
 * nbuckets entries; then next_bucket.  ASan reports any read or write
 * out of range; the assertions check that the loop terminates within the
 * expected number of buckets even on a cyclic chain, that the entries
 * read cover [0, nbuckets) exactly once when the chain is complete, and
 * that each entry equals the bytes on the device.
 */
#include <config.h>

#include "common.h"

/* The engine's array of prio buckets (struct alloc_state.prio_buckets). */
#define ENGINE_MAX_PRIO_BUCKETS 64u

static void
read_bucket (uint8_t *const *dev, uint64_t ndev, uint64_t bucket,
             uint8_t *buf, size_t bucket_bytes)
{
  if (bucket < ndev)
    memcpy (buf, dev[bucket], bucket_bytes);
  else
    memset (buf, 0, bucket_bytes);      /* beyond the stored buckets */
}

/* alloc_prio_read's loop over the chain starting at head. */
static void
follow_chain (uint8_t *const *dev, uint64_t ndev, size_t bb,
              uint64_t first_bucket, uint64_t nbuckets, uint64_t head,
              uint64_t magic)
{
  const uint64_t per = bch_prios_per_bucket (bb);
  const uint64_t nprio = bch_prio_buckets (nbuckets, bb);
  FUZZ_ASSERT (nprio <= FUZZ_PRIO_MAX_CHAIN);
  FUZZ_ASSERT (nprio * per >= nbuckets);
  FUZZ_ASSERT (nprio == 0 || (nprio - 1) * per < nbuckets);
  if (nprio > ENGINE_MAX_PRIO_BUCKETS)
    return;                     /* alloc_init refuses such a cache (EFBIG) */

  struct bch_bucket_disk *table = malloc ((nbuckets ? nbuckets : 1) *
                                          sizeof *table);
  uint64_t *chain = malloc ((nprio ? nprio : 1) * sizeof *chain);
  uint8_t *buf = malloc (bb);
  if (!table || !chain || !buf) abort ();

  uint64_t bucket = head, nchain = 0, covered = 0, iterations = 0;
  uint64_t max_seq = 0;
  bool complete = true, cyclic = false;
  for (uint64_t i = 0; i < nprio; i++) {
    struct bch_pset_hdr h;
    struct bch_diag d;
    uint64_t first = i * per;
    uint64_t n = first + per <= nbuckets ? per : nbuckets - first;

    iterations++;
    FUZZ_ASSERT (iterations <= nprio);
    FUZZ_ASSERT (first < nbuckets && n >= 1 && n <= per);
    if (bucket < first_bucket || bucket >= nbuckets) {
      if (fuzz_verbose ())
        fprintf (stderr, "prio chain: bucket %llu out of range\n",
                 (unsigned long long) bucket);
      complete = false;
      break;
    }
    read_bucket (dev, ndev, bucket, buf, bb);
    memset (&h, FUZZ_POISON, sizeof h);
    enum bch_status st = bch_pset_decode (buf, bb, magic, &h, &d);
    fuzz_log ("bch_pset_decode", st, &d);
    fuzz_check_diag (st, &d);
    if (st != BCH_OK) {
      complete = false;
      break;
    }
    FUZZ_ASSERT (h.magic == magic);
    FUZZ_ASSERT (h.next_bucket == bch_get_le64 (buf + 32));
    for (uint64_t j = 0; j < n; j++) {
      struct bch_bucket_disk e = bch_pset_entry (buf, j);
      const uint8_t *raw = buf + BCH_PSET_HEADER_SIZE + BCH_BUCKET_DISK_SIZE * j;
      FUZZ_ASSERT (e.prio == bch_get_le16 (raw) && e.gen == raw[2]);
      if (bucket < ndev)
        FUZZ_ASSERT (memcmp (raw, dev[bucket] + (raw - buf), 3) == 0);
      table[first + j] = e;
    }
    covered += n;
    for (uint64_t k = 0; k < nchain; k++)
      if (chain[k] == bucket)
        cyclic = true;
    chain[nchain++] = bucket;
    if (h.seq > max_seq)
      max_seq = h.seq;
    bucket = h.next_bucket;
  }

  FUZZ_ASSERT (iterations <= nprio && nchain <= nprio);
  if (complete) {
    /* Every bucket's prio and gen came from the chain, exactly once. */
    FUZZ_ASSERT (nchain == nprio);
    FUZZ_ASSERT (covered == nbuckets);
  }
  else
    FUZZ_ASSERT (nchain < nprio && covered < nbuckets);
  for (uint64_t k = 0; k < nchain; k++)
    FUZZ_ASSERT (chain[k] >= first_bucket && chain[k] < nbuckets);
  if (fuzz_verbose ())
    fprintf (stderr, "prio chain: %llu of %llu buckets read%s%s, max seq "
             "%llu\n", (unsigned long long) nchain,
             (unsigned long long) nprio, complete ? "" : " (incomplete)",
             cyclic ? " (cyclic: the engine accepts it)" : "",
             (unsigned long long) max_seq);

  free (buf);
  free (chain);
  free (table);
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  struct fuzz_in in = { data, size };
  uint8_t flags = fuzz_u8 (&in);
  const size_t bb = (size_t) 4096 << (fuzz_u8 (&in) % 3);
  const uint64_t first_bucket = fuzz_u8 (&in);
  const uint64_t per = bch_prios_per_bucket (bb);
  const uint64_t nbuckets = fuzz_u32 (&in) % (FUZZ_PRIO_MAX_CHAIN * per + 1);
  const uint64_t head = fuzz_u64 (&in);
  const uint64_t magic = fuzz_u64 (&in);

  FUZZ_ASSERT (per > 0 && BCH_PSET_HEADER_SIZE + per * BCH_BUCKET_DISK_SIZE <= bb);

  /* The stored buckets: one exactly-sized heap image each. */
  uint64_t ndev = (in.n < FUZZ_PRIO_MAX_DEVICE ? in.n : FUZZ_PRIO_MAX_DEVICE) / bb;
  uint8_t *dev[FUZZ_PRIO_MAX_DEVICE / 4096];
  for (uint64_t b = 0; b < ndev; b++) {
    dev[b] = malloc (bb);
    if (!dev[b]) abort ();
    memcpy (dev[b], in.p + b * bb, bb);
    if (flags & FUZZ_PRIO_FIX_CSUM)
      bch_put_le64 (dev[b], bch_crc64 (dev[b] + 8,
                                       bch_pset_csum_bytes (bb) - 8));
  }

  follow_chain (dev, ndev, bb, first_bucket, nbuckets, head, magic);

  for (uint64_t b = 0; b < ndev; b++)
    free (dev[b]);
  return 0;
}
