/* bcachefilter fuzz target: a prio bucket (struct prio_set + entries).
 *
 * Input: u8 flags | u64 pset_magic | bucket bytes (len = bucket size).
 *
 * - bch_pset_decode over an exactly-sized heap copy; with
 *   FUZZ_PSET_FIX_CSUM the checksum (bch_crc64 over [8, csum_bytes)) is
 *   recomputed first.
 * - Every entry i < bch_prios_per_bucket (len) is read with bch_pset_entry
 *   and must equal the stored bytes.
 * - Round trip: bch_pset_encode of the decoded header and entries
 *   reproduces the input's field bytes, zero-fills pad and tail, and
 *   decodes to the same header.
 * - CRC-64: the check value, and incremental == one-shot over the input.
 */
#include <config.h>

#include "common.h"

static uint64_t
pset_csum (const uint8_t *buf, size_t len)
{
  uint64_t n = bch_pset_csum_bytes (len);
  if (n > len) n = len;
  return bch_crc64 (buf + 8, n - 8);
}

static void
hdr_matches_bytes (const struct bch_pset_hdr *h, const uint8_t *b)
{
  FUZZ_ASSERT (h->csum == bch_get_le64 (b));
  FUZZ_ASSERT (h->magic == bch_get_le64 (b + 8));
  FUZZ_ASSERT (h->seq == bch_get_le64 (b + 16));
  FUZZ_ASSERT (h->version == bch_get_le32 (b + 24));
  FUZZ_ASSERT (h->next_bucket == bch_get_le64 (b + 32));
}

static void
crc_checks (const uint8_t *buf, size_t len)
{
  static bool once;
  if (!once) {
    FUZZ_ASSERT (bch_crc64 ("123456789", 9) == 0x62EC59E3F1A4F00Aull);
    once = true;
  }
  size_t cut = len ? buf[0] % (len + 1) : 0;
  uint64_t whole = bch_crc64_update (~0ull, buf, len);
  uint64_t parts = bch_crc64_update (bch_crc64_update (~0ull, buf, cut),
                                     buf + cut, len - cut);
  FUZZ_ASSERT (whole == parts);
  FUZZ_ASSERT (bch_crc64 (buf, len) == (whole ^ ~0ull));
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

  crc_checks (buf, len);

  if ((flags & FUZZ_PSET_FIX_CSUM) && len >= BCH_PSET_HEADER_SIZE)
    bch_put_le64 (buf, pset_csum (buf, len));

  struct bch_pset_hdr h;
  struct bch_diag diag;
  memset (&h, FUZZ_POISON, sizeof h);
  enum bch_status st = bch_pset_decode (buf, len, magic, &h, &diag);
  fuzz_log ("bch_pset_decode", st, &diag);
  fuzz_check_diag (st, &diag);

  /* Entries can be read whatever the verdict. */
  uint64_t n = bch_prios_per_bucket (len);
  struct bch_bucket_disk *e = malloc ((n ? n : 1) * sizeof *e);
  if (!e) abort ();
  for (uint64_t i = 0; i < n; i++) {
    e[i] = bch_pset_entry (buf, i);
    FUZZ_ASSERT (e[i].prio == bch_get_le16 (buf + BCH_PSET_HEADER_SIZE + 3 * i));
    FUZZ_ASSERT (e[i].gen == buf[BCH_PSET_HEADER_SIZE + 3 * i + 2]);
  }

  if (st == BCH_OK) {
    FUZZ_ASSERT (len >= BCH_PSET_HEADER_SIZE);
    FUZZ_ASSERT (h.magic == magic);
    FUZZ_ASSERT (h.csum == pset_csum (buf, len));
    hdr_matches_bytes (&h, buf);

    /* Round trip. */
    uint8_t *enc = malloc (len);
    if (!enc) abort ();
    memset (enc, FUZZ_POISON, len);
    struct bch_pset_hdr h1 = h;
    h1.csum = ~h.csum;                  /* must be ignored */
    bch_pset_encode (&h1, e, n, enc, len);
    size_t used = BCH_PSET_HEADER_SIZE + 3 * n;
    FUZZ_ASSERT (memcmp (enc + 8, buf + 8, 20) == 0);
    FUZZ_ASSERT (memcmp (enc + 32, buf + 32, used - 32) == 0);
    for (size_t i = 28; i < 32; i++)
      FUZZ_ASSERT (enc[i] == 0);
    for (size_t i = used; i < len; i++)
      FUZZ_ASSERT (enc[i] == 0);
    FUZZ_ASSERT (bch_get_le64 (enc) == pset_csum (enc, len));

    bool zero_pad = bch_get_le32 (buf + 28) == 0;
    for (size_t i = used; i < len && zero_pad; i++)
      zero_pad = buf[i] == 0;
    if (zero_pad)
      FUZZ_ASSERT (memcmp (enc, buf, len) == 0);

    struct bch_pset_hdr h2;
    struct bch_diag d2;
    memset (&h2, FUZZ_POISON, sizeof h2);
    enum bch_status st2 = bch_pset_decode (enc, len, magic, &h2, &d2);
    fuzz_check_diag (st2, &d2);
    FUZZ_ASSERT_DIAG (st2 == BCH_OK, d2);
    hdr_matches_bytes (&h2, enc);
    FUZZ_ASSERT (h2.seq == h.seq && h2.version == h.version &&
                 h2.next_bucket == h.next_bucket);
    free (enc);
  }

  free (e);
  free (buf);
  return 0;
}
