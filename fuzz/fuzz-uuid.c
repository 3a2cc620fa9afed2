/* bcachefilter fuzz target: struct uuid_entry, and uuid strings.
 *
 * Input: 128 bytes of uuid entry (zero-extended if shorter) | a string.
 *
 * - bch_uuid_entry_decode / encode: the 72 bytes of fields (uuid, label,
 *   first_reg, last_reg, invalidated, flags, sectors) round-trip byte for
 *   byte; the 56 pad bytes (72..127) are written as zeroes whatever the
 *   input had; decode(encode(decode(x))) == decode(x).
 * - bch_uuid_parse on the rest of the input as a NUL-terminated string;
 *   an accepted string is the canonical 36-character form (any case) and
 *   bch_uuid_unparse gives it back.
 */
#include <config.h>

#include <strings.h>

#include "common.h"

#define UUID_FIELDS_BYTES 72u

static void
entry_same (const struct bch_uuid_entry *a, const struct bch_uuid_entry *b)
{
  FUZZ_ASSERT (memcmp (a->uuid, b->uuid, 16) == 0);
  FUZZ_ASSERT (memcmp (a->label, b->label, 32) == 0);
  FUZZ_ASSERT (a->first_reg == b->first_reg);
  FUZZ_ASSERT (a->last_reg == b->last_reg);
  FUZZ_ASSERT (a->invalidated == b->invalidated);
  FUZZ_ASSERT (a->flags == b->flags);
  FUZZ_ASSERT (a->sectors == b->sectors);
}

static void
entry_matches_bytes (const struct bch_uuid_entry *u, const uint8_t *b)
{
  FUZZ_ASSERT (memcmp (u->uuid, b, 16) == 0);
  FUZZ_ASSERT (memcmp (u->label, b + 16, 32) == 0);
  FUZZ_ASSERT (u->first_reg == bch_get_le32 (b + 48));
  FUZZ_ASSERT (u->last_reg == bch_get_le32 (b + 52));
  FUZZ_ASSERT (u->invalidated == bch_get_le32 (b + 56));
  FUZZ_ASSERT (u->flags == bch_get_le32 (b + 60));
  FUZZ_ASSERT (u->sectors == bch_get_le64 (b + 64));
}

static void
unparse_parse (const uint8_t uuid[16])
{
  char s[37];
  uint8_t back[16];
  memset (s, FUZZ_POISON, sizeof s);
  bch_uuid_unparse (uuid, s);
  FUZZ_ASSERT (s[36] == '\0' && strlen (s) == 36);
  FUZZ_ASSERT (bch_uuid_parse (s, back) == 0);
  FUZZ_ASSERT (memcmp (back, uuid, 16) == 0);
}

int LLVMFuzzerTestOneInput (const uint8_t *data, size_t size);

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
  /* The entry. */
  uint8_t *in = calloc (1, BCH_UUID_ENTRY_SIZE);
  if (!in) abort ();
  size_t n = size < BCH_UUID_ENTRY_SIZE ? size : BCH_UUID_ENTRY_SIZE;
  memcpy (in, data, n);

  struct bch_uuid_entry u, u2;
  memset (&u, FUZZ_POISON, sizeof u);
  bch_uuid_entry_decode (in, &u);
  entry_matches_bytes (&u, in);

  uint8_t *out = malloc (BCH_UUID_ENTRY_SIZE);
  if (!out) abort ();
  memset (out, FUZZ_POISON, BCH_UUID_ENTRY_SIZE);
  bch_uuid_entry_encode (&u, out);
  FUZZ_ASSERT (memcmp (out, in, UUID_FIELDS_BYTES) == 0);
  for (size_t i = UUID_FIELDS_BYTES; i < BCH_UUID_ENTRY_SIZE; i++)
    FUZZ_ASSERT (out[i] == 0);

  memset (&u2, FUZZ_POISON, sizeof u2);
  bch_uuid_entry_decode (out, &u2);
  entry_same (&u, &u2);

  unparse_parse (u.uuid);
  unparse_parse (bch_invalid_uuid);
  (void) bch_uuid_is_zero (u.uuid);

  free (out);
  free (in);

  /* The string. */
  size_t slen = size - n;
  char *s = malloc (slen + 1);
  if (!s) abort ();
  memcpy (s, data + n, slen);
  s[slen] = '\0';
  uint8_t parsed[16];
  if (bch_uuid_parse (s, parsed) == 0) {
    char back[37];
    bch_uuid_unparse (parsed, back);
    FUZZ_ASSERT (strlen (s) == 36);
    FUZZ_ASSERT (strcasecmp (s, back) == 0);
  }
  free (s);
  return 0;
}
