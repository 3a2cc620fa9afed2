/* bcachefilter: helpers shared by the libFuzzer targets and gen-seeds.
 *
 * Every target reads a small fixed-size "parameter header" from the start
 * of the fuzz input (geometry, magic, flags ...) and treats the rest as
 * the on-disk bytes under test.  The header layouts are defined here so
 * that gen-seeds.c writes seeds the targets parse the same way.
 *
 * The bytes under test are always copied into a heap buffer of exactly
 * their length, so AddressSanitizer reports any read past the end.
 */
#ifndef BCACHEFILTER_FUZZ_COMMON_H
#define BCACHEFILTER_FUZZ_COMMON_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bcachefilter/format.h"

/* A failed property: print why (the fuzzer shows stderr with the crash)
 * and trap, so libFuzzer records the input as a crash artifact. */
#define FUZZ_ASSERT(cond)                                               \
  do {                                                                  \
    if (!(cond)) {                                                      \
      fprintf (stderr, "%s:%d: fuzz assertion failed: %s\n",            \
               __FILE__, __LINE__, #cond);                              \
      __builtin_trap ();                                                \
    }                                                                   \
  } while (0)

/* As FUZZ_ASSERT, with the decoder's diagnostic in the message. */
#define FUZZ_ASSERT_DIAG(cond, diag)                                    \
  do {                                                                  \
    if (!(cond)) {                                                      \
      fprintf (stderr, "%s:%d: fuzz assertion failed: %s "              \
               "(status %d, diag \"%.256s\")\n",                        \
               __FILE__, __LINE__, #cond, (int) (diag).status,          \
               (diag).msg);                                             \
      __builtin_trap ();                                                \
    }                                                                   \
  } while (0)

/* FUZZ_VERBOSE=1 in the environment makes the targets print each
 * decoder's verdict: useful when replaying a single input. */
static inline bool
fuzz_verbose (void)
{
  static int v = -1;
  if (v < 0)
    v = getenv ("FUZZ_VERBOSE") != NULL;
  return v;
}

static inline void
fuzz_log (const char *what, enum bch_status st, const struct bch_diag *d)
{
  if (fuzz_verbose ())
    fprintf (stderr, "%s: %s%s%.256s\n", what, bch_status_name (st),
             st != BCH_OK ? ": " : "", st != BCH_OK ? d->msg : "");
}

/* Consume bytes from the front of the input; reads past the end give 0
 * so that every input, however short, is usable. */
struct fuzz_in {
  const uint8_t *p;
  size_t n;
};

static inline uint8_t
fuzz_u8 (struct fuzz_in *in)
{
  if (in->n == 0) return 0;
  in->n--;
  return *in->p++;
}

static inline uint16_t
fuzz_u16 (struct fuzz_in *in)
{
  uint16_t v = fuzz_u8 (in);
  return (uint16_t) (v | (uint16_t) fuzz_u8 (in) << 8);
}

static inline uint32_t
fuzz_u32 (struct fuzz_in *in)
{
  uint32_t v = fuzz_u16 (in);
  return v | (uint32_t) fuzz_u16 (in) << 16;
}

static inline uint64_t
fuzz_u64 (struct fuzz_in *in)
{
  uint64_t v = fuzz_u32 (in);
  return v | (uint64_t) fuzz_u32 (in) << 32;
}

/* Copy the remaining input into an exactly-sized heap buffer (at least
 * one byte is allocated so that a zero-length buffer is still a valid,
 * unreadable pointer).  The caller frees it. */
static inline uint8_t *
fuzz_rest (struct fuzz_in *in, size_t *len)
{
  uint8_t *b = malloc (in->n ? in->n : 1);
  if (!b) abort ();
  if (in->n) memcpy (b, in->p, in->n);
  *len = in->n;
  in->p += in->n;
  in->n = 0;
  return b;
}

/* On failure a diag must carry the returned status and a non-empty,
 * terminated message. */
static inline void
fuzz_check_diag (enum bch_status st, const struct bch_diag *d)
{
  FUZZ_ASSERT ((unsigned) st <= (unsigned) BCH_ERR_INVALID);
  FUZZ_ASSERT (bch_status_name (st) != NULL);
  if (st == BCH_OK)
    return;                     /* a decoder need not touch diag on success */
  FUZZ_ASSERT (d->status == st);
  FUZZ_ASSERT (memchr (d->msg, '\0', sizeof d->msg) != NULL);
  FUZZ_ASSERT (d->msg[0] != '\0');
}

/* Byte used to poison a struct before a decoder fills it, so that a
 * decoder leaving fields unset is visible in round-trip comparisons. */
#define FUZZ_POISON 0xa5

/* ------------------------------------------------------------------------
 * Parameter headers (little-endian), one per target.
 * ------------------------------------------------------------------------ */

/* fuzz-sb:   u8 flags | u64 device_sectors | superblock area bytes */
#define FUZZ_SB_FIX_CSUM        0x01   /* recompute csum before decoding */
#define FUZZ_SB_HDR             9u

/* fuzz-bkey: u8 level | u8 nr_in_set | u64 nbuckets | u64 bucket_sectors |
 *            u64 first_bucket | key bytes */
#define FUZZ_BKEY_HDR           26u

/* fuzz-node: u8 flags | u8 block_shift (block = 512 << (v % 4)) | u8 level |
 *            u8 nr_in_set | u8 stop_after (cb returns 1 at that set if !0) |
 *            u64 bset_magic | u64 node_ptr0 | u64 nbuckets |
 *            u64 bucket_sectors | u64 first_bucket | node bytes */
#define FUZZ_NODE_FIX_CSUM      0x01   /* reseal every bset before walking */
#define FUZZ_NODE_RAW_LEN       0x02   /* don't cut the node to whole blocks */
#define FUZZ_NODE_HDR           45u

/* fuzz-jset: u8 flags | u64 jset_magic | jset bytes */
#define FUZZ_JSET_FIX_CSUM      0x01
#define FUZZ_JSET_HDR           9u

/* fuzz-pset: u8 flags | u64 pset_magic | prio bucket bytes */
#define FUZZ_PSET_FIX_CSUM      0x01
#define FUZZ_PSET_HDR           9u

/* fuzz-uuid: 128 bytes uuid entry | NUL-free string for bch_uuid_parse */
#define FUZZ_UUID_HDR           0u

/* fuzz-journal: u8 flags | u8 block_shift (block = 512 << (v % 4)) |
 *            u16 bucket_blocks (bucket = block * (1 + v % (64 KiB / block))) |
 *            u8 stop_after (cb returns 1 at that entry if !0) |
 *            u32 raw_block (block bytes with FUZZ_JOURNAL_RAW) |
 *            u64 jset_magic | bucket bytes (cut or zero-padded to the
 *            bucket; with FUZZ_JOURNAL_RAW taken as they are, <= 64 KiB) */
#define FUZZ_JOURNAL_FIX_CSUM   0x01   /* reseal entries the walk would meet */
#define FUZZ_JOURNAL_RAW        0x02   /* raw block size and length */
#define FUZZ_JOURNAL_HDR        17u
#define FUZZ_JOURNAL_MAX_BUCKET 65536u

/* fuzz-prio-chain: u8 flags | u8 bucket_shift (bucket = 4 KiB << (v % 3)) |
 *            u8 first_bucket | u32 nbuckets (taken modulo
 *            66 * prios_per_bucket + 1) | u64 head | u64 pset_magic |
 *            device bytes (cut to whole buckets, at most 64 KiB: the first
 *            buckets of a cache of nbuckets buckets; the rest read as
 *            zeroes) */
#define FUZZ_PRIO_FIX_CSUM      0x01   /* reseal every stored bucket */
#define FUZZ_PRIO_HDR           23u
#define FUZZ_PRIO_MAX_DEVICE    65536u
#define FUZZ_PRIO_MAX_CHAIN     66u    /* > the engine's 64-bucket limit */

#endif /* BCACHEFILTER_FUZZ_COMMON_H */
