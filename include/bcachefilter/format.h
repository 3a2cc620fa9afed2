/* bcachefilter: bcache's on-disk format.
 *
 * Design
 * ------
 * Every structure bcache writes to a cache device, with the exact offsets,
 * bit fields, checksums and magics of Linux's drivers/md/bcache (see
 * shared/research/bcache.md §1).  All functions here are pure: they encode
 * host structures into caller-supplied buffers, or decode and validate
 * buffers that are treated as UNTRUSTED input (read from a cache device
 * that may be corrupt, foreign or truncated).  A decoder never reads
 * outside the length it is given, never crashes on any byte pattern, and
 * reports a precise reason in a struct bch_diag.  There is no locking and
 * no global state, so every function is safe to call from any thread and
 * every decoder is a fuzz target.
 *
 * Byte order: the superblock is little-endian by definition; bsets, jsets,
 * prio sets and uuid entries are stored by the kernel in CPU order, which
 * on every platform bcache runs on is little-endian.  We always encode and
 * decode little-endian explicitly, so this code is correct on any host.
 *
 * Units: "sectors" are 512 bytes.  Bucket and block sizes are in sectors,
 * as on disk.
 */
#ifndef BCACHEFILTER_FORMAT_H
#define BCACHEFILTER_FORMAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

/* ------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------ */

/* Why a decode or validation failed.  Distinct values let tools give
 * distinct exit codes (bcachefilter-show(1) documents them). */
enum bch_status {
  BCH_OK = 0,
  BCH_ERR_TRUNCATED,    /* input shorter than the structure needs */
  BCH_ERR_MAGIC,        /* wrong magic: not this structure / not bcache */
  BCH_ERR_BACKING,      /* a bcache backing-device superblock, not a cache */
  BCH_ERR_CSUM,         /* checksum mismatch */
  BCH_ERR_VERSION,      /* unsupported structure version */
  BCH_ERR_FEATURES,     /* unknown compat / incompat / ro_compat bits */
  BCH_ERR_INVALID,      /* a field is out of range or inconsistent */
};

/* A status plus a human-readable reason ("bucket_size 1000 is not a power
 * of two"). */
struct bch_diag {
  enum bch_status status;
  char msg[256];
};

/* Name of a status ("bad checksum", ...), never NULL. */
const char *bch_status_name (enum bch_status s);

/* ------------------------------------------------------------------------
 * CRC-64/WE (bcache's bch_crc64): ECMA-182 polynomial 0x42F0E1EBA9EA3693,
 * MSB first, init ~0, xorout ~0.  check("123456789") = 0x62EC59E3F1A4F00A.
 * ------------------------------------------------------------------------ */

/* The raw kernel crc64_be(): no initial value or final xor applied. */
uint64_t bch_crc64_update (uint64_t crc, const void *data, size_t len);
/* bch_crc64(): crc64_be(~0, data) ^ ~0. */
uint64_t bch_crc64 (const void *data, size_t len);

/* ------------------------------------------------------------------------
 * Constants
 * ------------------------------------------------------------------------ */

#define BCH_SECTOR_SHIFT        9
#define BCH_SECTOR_SIZE         512u
#define BCH_SB_SECTOR           8u          /* superblock at byte 4096 */
#define BCH_SB_OFFSET           4096u
#define BCH_SB_AREA_SIZE        4096u       /* bytes read/written there */
#define BCH_SB_STRUCT_SIZE      2264u       /* sizeof (struct cache_sb_disk) */
#define BCH_SB_LABEL_SIZE       32u
#define BCH_SB_JOURNAL_BUCKETS  256u        /* size of d[] */
#define BCH_MAX_CACHES_PER_SET  8u
#define BCH_PAGE_SECTORS        8u          /* PAGE_SIZE / 512 with 4 KiB pages */
#define BCH_PAGE_SIZE           4096u

/* Superblock versions. */
#define BCACHE_SB_VERSION_CDEV                  0
#define BCACHE_SB_VERSION_BDEV                  1
#define BCACHE_SB_VERSION_CDEV_WITH_UUID        3
#define BCACHE_SB_VERSION_BDEV_WITH_OFFSET      4
#define BCACHE_SB_VERSION_CDEV_WITH_FEATURES    5
#define BCACHE_SB_VERSION_BDEV_WITH_FEATURES    6
#define BCACHE_SB_MAX_VERSION                   6

/* Incompat feature bits (features.h).  No compat or ro_compat bits exist. */
#define BCH_FEATURE_INCOMPAT_OBSO_LARGE_BUCKET  0x0001ull
#define BCH_FEATURE_INCOMPAT_LOG_LARGE_BUCKET   0x0002ull
/* bcachefilter's own, the highest bit (far from the kernel's, which it
 * does not know, so it refuses the cache: research/bcache.md §1.2): set
 * while write-intent regions may be marked (core/intent.c).  Their clean
 * data may be older than the backing store after a crash, which only
 * the filter's recovery knows to drop; a kernel must not serve it. */
#define BCF_FEATURE_INCOMPAT_WRITE_INTENT       0x8000000000000000ull
#define BCH_FEATURE_COMPAT_SUPP                 0ull
#define BCH_FEATURE_RO_COMPAT_SUPP              0ull
#define BCH_FEATURE_INCOMPAT_SUPP \
  (BCH_FEATURE_INCOMPAT_OBSO_LARGE_BUCKET | \
   BCH_FEATURE_INCOMPAT_LOG_LARGE_BUCKET | BCF_FEATURE_INCOMPAT_WRITE_INTENT)

/* The superblock magic, bytes 24..39. */
extern const uint8_t bch_sb_magic[16];

/* XOR constants giving each structure's magic from set_magic. */
#define BCH_JSET_MAGIC_XOR  0x245235c1a3625032ull
#define BCH_PSET_MAGIC_XOR  0x6750e15f87337f91ull
#define BCH_BSET_MAGIC_XOR  0x90135c78b99e07f5ull

/* Superblock flags (cache devices). */
#define BCH_CACHE_SYNC              (1ull << 0)
#define BCH_CACHE_DISCARD           (1ull << 1)
#define BCH_CACHE_REPLACEMENT_SHIFT 2
#define BCH_CACHE_REPLACEMENT_MASK  (7ull << BCH_CACHE_REPLACEMENT_SHIFT)
enum bch_replacement {
  BCH_REPLACEMENT_LRU = 0,
  BCH_REPLACEMENT_FIFO = 1,
  BCH_REPLACEMENT_RANDOM = 2,
};

/* ------------------------------------------------------------------------
 * Cache superblock (struct cache_sb_disk), decoded to host order.
 * ------------------------------------------------------------------------ */
struct bch_sb {
  uint64_t csum;                /* as stored */
  uint64_t offset;              /* must be 8 */
  uint64_t version;
  uint8_t  magic[16];
  uint8_t  uuid[16];
  uint8_t  set_uuid[16];
  uint8_t  label[BCH_SB_LABEL_SIZE];
  uint64_t flags;
  uint64_t seq;
  uint64_t feature_compat;
  uint64_t feature_incompat;
  uint64_t feature_ro_compat;
  uint64_t nbuckets;            /* cache devices; data_offset for backing */
  uint16_t block_size;          /* sectors */
  uint16_t bucket_size;         /* sectors (or log2 with LOG_LARGE_BUCKET) */
  uint16_t nr_in_set;
  uint16_t nr_this_dev;
  uint32_t last_mount;
  uint16_t first_bucket;
  uint16_t njournal_buckets;    /* "keys" */
  uint64_t d[BCH_SB_JOURNAL_BUCKETS];
  uint16_t obso_bucket_size_hi;
};

static inline bool
bch_sb_is_backing (const struct bch_sb *sb)
{
  return sb->version == BCACHE_SB_VERSION_BDEV ||
         sb->version == BCACHE_SB_VERSION_BDEV_WITH_OFFSET ||
         sb->version == BCACHE_SB_VERSION_BDEV_WITH_FEATURES;
}

/* set_magic: the first 8 bytes of set_uuid read as a little-endian u64. */
uint64_t bch_set_magic (const struct bch_sb *sb);
static inline uint64_t bch_jset_magic (const struct bch_sb *sb)
{ return bch_set_magic (sb) ^ BCH_JSET_MAGIC_XOR; }
static inline uint64_t bch_pset_magic (const struct bch_sb *sb)
{ return bch_set_magic (sb) ^ BCH_PSET_MAGIC_XOR; }
static inline uint64_t bch_bset_magic (const struct bch_sb *sb)
{ return bch_set_magic (sb) ^ BCH_BSET_MAGIC_XOR; }

static inline unsigned
bch_sb_replacement (const struct bch_sb *sb)
{
  return (sb->flags & BCH_CACHE_REPLACEMENT_MASK) >> BCH_CACHE_REPLACEMENT_SHIFT;
}

/* The superblock checksum: bch_crc64 over bytes [8, 208 + 8 * keys) of
 * the encoded area.  keys is read from the buffer (bytes 206..207) and
 * clamped to 256 so that this never reads out of bounds.  len must be
 * >= BCH_SB_STRUCT_SIZE. */
uint64_t bch_sb_csum (const void *buf, size_t len);

/* Decode the 4096-byte area found at byte 4096 of a device.  Checks, in
 * this order: length, magic (BCH_ERR_MAGIC), offset, version (unknown:
 * BCH_ERR_VERSION), backing device (BCH_ERR_BACKING; sb is still filled
 * in), feature bits (BCH_ERR_FEATURES; below version 5 there are no
 * feature fields and those words are ignored, as the kernel does),
 * checksum (BCH_ERR_CSUM), then the cache geometry rules of
 * bch_sb_validate with device_sectors unknown.
 * njournal_buckets > 256 is BCH_ERR_INVALID, before the checksum.  On
 * every error after the length check *sb is filled in (feature words
 * zeroed below version 5), so tools can print what is there. */
enum bch_status bch_sb_decode (const void *buf, size_t len,
                               struct bch_sb *sb, struct bch_diag *diag);

/* Validate a cache superblock's geometry as the kernel does at
 * registration (bcache.md §1.2).  device_sectors == 0 skips the size
 * check; a device smaller than nbuckets * bucket_size gives
 * BCH_ERR_TRUNCATED, every other violation BCH_ERR_INVALID. */
enum bch_status bch_sb_validate (const struct bch_sb *sb,
                                 uint64_t device_sectors,
                                 struct bch_diag *diag);

/* Encode into buf (BCH_SB_AREA_SIZE bytes, fully written, unused bytes
 * zero) and set the checksum.  The csum field of *sb is ignored.  Also
 * for a backing superblock from bch_bdev_sb_decode, which keeps every
 * field this writes. */
void bch_sb_encode (const struct bch_sb *sb, void *buf);

/* ------------------------------------------------------------------------
 * Backing-device superblock (make-bcache -B): the same struct
 * cache_sb_disk at byte 4096, versions 1, 4 and 6.  Decoded into struct
 * bch_sb, where the field at byte 184 (nbuckets) is data_offset.
 * ------------------------------------------------------------------------ */

/* Data starts here (sectors) on a version 1 backing device, and at least
 * here on the others (BDEV_DATA_START_DEFAULT). */
#define BCH_BDEV_DATA_START_DEFAULT 16u

/* Backing-device flags: bits 0-3 cache mode, bits 61-62 state. */
#define BCH_BDEV_CACHE_MODE_MASK  0xfull
#define BCH_BDEV_STATE_SHIFT      61
#define BCH_BDEV_STATE_MASK       (3ull << BCH_BDEV_STATE_SHIFT)
enum bch_bdev_cache_mode {
  BCH_BDEV_MODE_WRITETHROUGH = 0,
  BCH_BDEV_MODE_WRITEBACK = 1,
  BCH_BDEV_MODE_WRITEAROUND = 2,
  BCH_BDEV_MODE_NONE = 3,
};
/* BDEV_STATE (research/bcache.md §1.2, §2.5): none = attached to no
 * cache set (set_uuid means nothing then: make-bcache -B fills it with a
 * random uuid); clean = attached to cache set set_uuid, which holds no
 * dirty data for it; dirty = that cache set holds data for it that the
 * device does not have yet; stale = treated as none. */
enum bch_bdev_state {
  BCH_BDEV_STATE_NONE = 0,
  BCH_BDEV_STATE_CLEAN = 1,
  BCH_BDEV_STATE_DIRTY = 2,
  BCH_BDEV_STATE_STALE = 3,
};

static inline unsigned
bch_bdev_state (const struct bch_sb *sb)
{
  return (unsigned) ((sb->flags & BCH_BDEV_STATE_MASK) >> BCH_BDEV_STATE_SHIFT);
}

static inline unsigned
bch_bdev_cache_mode (const struct bch_sb *sb)
{
  return (unsigned) (sb->flags & BCH_BDEV_CACHE_MODE_MASK);
}

/* "none", "clean", "dirty", "stale" (never NULL). */
const char *bch_bdev_state_name (unsigned state);

/* Where the data begins, in sectors: 16 for version 1, else the stored
 * data_offset. */
uint64_t bch_bdev_data_offset (const struct bch_sb *sb);

/* Decode and validate the 4096-byte area at byte 4096 of a backing
 * device, as the kernel's read_super does for one (UNTRUSTED input: the
 * device is a remote export).  Checks, in this order: length
 * (BCH_ERR_TRUNCATED), magic (BCH_ERR_MAGIC: no bcache superblock),
 * offset, version (a cache device's, or an unknown one: BCH_ERR_VERSION;
 * sb is filled in), checksum (BCH_ERR_CSUM), then BCH_ERR_INVALID for:
 * a zero uuid, data_offset below 16 (versions 4 and 6), a cache mode
 * above 3, and, if device_sectors is non-zero, a data_offset that leaves
 * no data (>= device_sectors).  Feature words are kept as stored and not
 * checked (the kernel checks them only on cache devices).  On every
 * error after the length check *sb is filled in. */
enum bch_status bch_bdev_sb_decode (const void *buf, size_t len,
                                    uint64_t device_sectors,
                                    struct bch_sb *sb, struct bch_diag *diag);

/* Rewrite, in place, the set_uuid and BDEV_STATE of a backing
 * superblock area (BCH_SB_AREA_SIZE bytes that bch_bdev_sb_decode
 * accepted), keeping every other byte, and recompute its checksum: what
 * the kernel writes on attach (set_uuid = the cache set, clean), detach
 * (zero, none), and when dirty data appears or is written back. */
void bch_bdev_sb_set_state (void *buf, const uint8_t set_uuid[16],
                            unsigned state);

/* Effective bucket size in sectors, honouring the large-bucket feature
 * bits (0 if the encoding is nonsense). */
uint64_t bch_sb_bucket_sectors (const struct bch_sb *sb);

/* Bytes of one btree node for a bucket of this many sectors (bcache's
 * btree_pages rule: 512 KiB and 1 MiB buckets give 256 KiB nodes). */
uint64_t bch_btree_node_bytes (uint64_t bucket_sectors);

/* Number of journal buckets the kernel chooses at first registration:
 * clamp(nbuckets >> 7, 2, 256). */
unsigned bch_journal_buckets_for (uint64_t nbuckets);

/* The fewest buckets a cache may have for the Linux kernel to register
 * it.  The superblock rule is 128 (bch_sb_validate), but the kernel's
 * cache_alloc sizes its free lists as roundup_pow_of_two (nbuckets) >>
 * 10 and refuses a cache where that is 0 ("ca->sb.nbuckets is too
 * small"): it needs more than 512 buckets.  What bcachefilter formats
 * has at least this many (bcachefilter-format, the filter's bcache-size=
 * and format path); the engine itself still opens caches of 128 and up,
 * as made-elsewhere caches (make-bcache) may be that small. */
#define BCH_KERNEL_MIN_NBUCKETS 513u

/* The bucket size to format a device of device_sectors with when none is
 * asked for: 1024 sectors (512 KiB, make-bcache's default), halved while
 * that leaves BCH_KERNEL_MIN_NBUCKETS buckets or fewer, but never below
 * BCH_PAGE_SECTORS or block_sectors.  (The result may still be too small
 * for a tiny device: the caller checks the bucket count.) */
unsigned bch_default_bucket_sectors (uint64_t device_sectors,
                                     unsigned block_sectors);

/* ------------------------------------------------------------------------
 * bkey
 *
 * high:  63 header bit | 60-62 PTRS | 58-59 pad | 56-57 CSUM | 55 pad |
 *        36 DIRTY | 20-35 SIZE | 0-19 INODE
 * low:   OFFSET (sector of the extent END, exclusive)
 * ptr:   51-62 DEV | 8-50 OFFSET | 0-7 GEN
 * ------------------------------------------------------------------------ */

#define BKEY_MAX_PTRS        7u     /* 3-bit field */
#define BKEY_PAD_PTRS        6u     /* pointers that fit in a padded key */
#define BKEY_PAD_U64S        8u     /* KEY_MAX_U64S / BKEY_PAD */
#define BKEY_MAX_SIZE        0xffffu
#define BKEY_MAX_INODE       0xfffffu
#define BKEY_MAX_OFFSET      0x7fffffffffffffffull
#define PTR_CHECK_DEV        4095u
#define PTR_MAX_OFFSET       ((1ull << 43) - 1)
#define BUCKET_GC_GEN_MAX    96u

struct bkey {
  uint64_t high;
  uint64_t low;
  uint64_t ptr[];
};

/* A key with room for BKEY_PAD_PTRS pointers (8 u64s, like BKEY_PADDED).
 * As in the kernel, a union with a struct ending in a flexible array;
 * clang warns about that by default (GCC accepts it as an extension). */
#if defined (__clang__)
#pragma clang diagnostic ignored "-Wgnu-variable-sized-type-not-at-end"
#endif
struct bkey_padded {
  union {
    struct bkey key;
    uint64_t pad[BKEY_PAD_U64S];
  };
};

#define BCH_BITMASK(name, field, offset, bits)                          \
  static inline uint64_t name (const struct bkey *k)                    \
  { return (k->field >> (offset)) & ((1ull << (bits)) - 1); }           \
  static inline void SET_##name (struct bkey *k, uint64_t v)            \
  {                                                                     \
    const uint64_t m = ((1ull << (bits)) - 1) << (offset);              \
    k->field = (k->field & ~m) | ((v << (offset)) & m);                 \
  }
BCH_BITMASK (KEY_PTRS,  high, 60, 3)
BCH_BITMASK (KEY_CSUM,  high, 56, 2)
BCH_BITMASK (KEY_DIRTY, high, 36, 1)
BCH_BITMASK (KEY_SIZE,  high, 20, 16)
BCH_BITMASK (KEY_INODE, high, 0, 20)
#undef BCH_BITMASK

static inline uint64_t KEY_OFFSET (const struct bkey *k) { return k->low; }
static inline void SET_KEY_OFFSET (struct bkey *k, uint64_t v) { k->low = v; }
static inline uint64_t KEY_START (const struct bkey *k)
{ return KEY_OFFSET (k) - KEY_SIZE (k); }

static inline uint64_t PTR_DEV (uint64_t p)    { return (p >> 51) & 0xfff; }
static inline uint64_t PTR_OFFSET (uint64_t p) { return (p >> 8) & PTR_MAX_OFFSET; }
static inline uint8_t  PTR_GEN (uint64_t p)    { return (uint8_t) (p & 0xff); }
static inline uint64_t MAKE_PTR (uint8_t gen, uint64_t offset, uint64_t dev)
{
  return ((dev & 0xfff) << 51) | ((offset & PTR_MAX_OFFSET) << 8) | gen;
}

/* KEY(inode, offset, size): the header bit is always set, like the
 * kernel's KEY() constructor. */
static inline void
bkey_init (struct bkey *k, uint64_t inode, uint64_t offset, uint64_t size)
{
  k->high = (1ull << 63);
  SET_KEY_INODE (k, inode);
  SET_KEY_SIZE (k, size);
  k->low = offset;
}

/* Number of u64 words of a key (bcache's bkey_u64s). */
static inline unsigned bkey_u64s (const struct bkey *k)
{ return 2 + (unsigned) KEY_PTRS (k); }
static inline size_t bkey_bytes (const struct bkey *k)
{ return bkey_u64s (k) * sizeof (uint64_t); }

/* Order keys by (inode, offset). */
static inline int
bkey_cmp (const struct bkey *l, const struct bkey *r)
{
  if (KEY_INODE (l) != KEY_INODE (r))
    return KEY_INODE (l) < KEY_INODE (r) ? -1 : 1;
  if (KEY_OFFSET (l) != KEY_OFFSET (r))
    return KEY_OFFSET (l) < KEY_OFFSET (r) ? -1 : 1;
  return 0;
}

/* bcache's staleness rule: (bucket_gen - ptr_gen) mod 256 in 1..128.
 * Returns the distance when stale, 0 when current.  (Distances above 128
 * mean the pointer is "from the future", which bcache also treats as not
 * stale; a gen that wrapped that far is a bug the gen-wrap guard
 * prevents.) */
static inline unsigned
bch_gen_after (uint8_t a, uint8_t b)
{
  unsigned r = (uint8_t) (a - b);
  return r > 128u ? 0 : r;
}
static inline unsigned
bch_ptr_stale (uint8_t bucket_gen, uint64_t ptr)
{
  return bch_gen_after (bucket_gen, PTR_GEN (ptr));
}

/* A pointer a reader may use: a real cache device (dev < 8), not the
 * check-key device.  Staleness must be tested separately. */
static inline bool
bch_ptr_is_data (uint64_t ptr)
{
  return PTR_DEV (ptr) < BCH_MAX_CACHES_PER_SET;
}

/* Is this key a cache-miss placeholder (check key)? */
static inline bool
bkey_is_check (const struct bkey *k)
{
  return KEY_PTRS (k) == 1 && PTR_DEV (k->ptr[0]) == PTR_CHECK_DEV;
}

/* The greatest key (inode 0xfffff, offset 2^63-1): the root's key. */
void bkey_max (struct bkey *k);

/* Structural validation of a key read from disk.  avail_u64s is the
 * number of words from k to the end of its bset; level > 0 means the key
 * is a btree pointer (needs >= 1 pointer, no dirty bit).  Checks: the
 * key fits, size <= offset, KEY_CSUM unused, every pointer's device is
 * < nr_in_set or PTR_CHECK_DEV (leaves only) and, if nbuckets/bucket
 * sectors are non-zero, that the extent lies inside one bucket past
 * first_bucket. */
struct bch_key_geometry {
  uint64_t nbuckets;
  uint64_t bucket_sectors;
  uint64_t first_bucket;
  unsigned nr_in_set;
};
enum bch_status bkey_validate (const struct bkey *k, size_t avail_u64s,
                               unsigned level,
                               const struct bch_key_geometry *geo,
                               struct bch_diag *diag);

/* Encode / decode one key to / from little-endian bytes.  bkey_decode
 * checks only that the key fits in len bytes; use bkey_validate for the
 * rest.  out must have room for BKEY_PAD_U64S words. */
size_t bkey_encode (const struct bkey *k, void *buf, size_t len);
enum bch_status bkey_decode (const void *buf, size_t len,
                             struct bkey_padded *out, struct bch_diag *diag);

/* ------------------------------------------------------------------------
 * struct bset (32-byte header, then keys) and btree nodes as logs of bsets
 * ------------------------------------------------------------------------ */

#define BCH_BSET_HEADER_SIZE   32u
#define BCACHE_BSET_CSUM       1u   /* version 1: csum seeded by node ptr */
#define BCACHE_BSET_VERSION    1u

struct bch_bset_hdr {
  uint64_t csum;
  uint64_t magic;
  uint64_t seq;
  uint32_t version;
  uint32_t keys;                  /* u64 words of keys */
};

/* Bytes occupied by a bset with this many key words, unpadded. */
static inline size_t bch_bset_bytes (uint32_t keys)
{ return BCH_BSET_HEADER_SIZE + (size_t) keys * 8; }

/* Checksum of an encoded bset (header + keys, at least bch_bset_bytes
 * long): version 1 seeds crc64_be with node_ptr0 (the raw first pointer
 * of the node's key in its parent) and xors ~0; version 0 is bch_crc64. */
uint64_t bch_bset_csum (const void *bset, size_t len, uint64_t node_ptr0);

/* Write a bset header (with checksum) in front of keys already placed at
 * buf + 32.  len is the buffer size; returns the unpadded size written or
 * 0 if it does not fit. */
size_t bch_bset_seal (void *buf, size_t len, uint64_t magic, uint64_t seq,
                      uint32_t keys, uint64_t node_ptr0);

/* One bset found while walking a node. */
struct bch_node_bset {
  struct bch_bset_hdr hdr;
  size_t offset;                  /* byte offset of the bset in the node */
  const uint64_t *keys;           /* pointer into the node buffer; keys are
                                     little-endian words (decode with
                                     bkey_decode) */
};

/* Walk a btree node buffer (the whole node, len bytes) as bcache's
 * bch_btree_node_read_done does: the first bset at 0, each later one at
 * the next block boundary, while seq matches and version <= 1; check
 * magic and checksum of each, reject a first set with seq 0 and an empty
 * non-first set, and fail if a block past the last accepted set still
 * carries the node's seq (a corrupted log).  Calls cb for each bset in order; a non-zero return
 * from cb stops the walk and is returned as BCH_ERR_INVALID.  *nsets and
 * *written_bytes (block-rounded) are set on success.  Each key in every
 * set is checked with bkey_validate (level, geo). */
typedef int (*bch_node_bset_cb) (const struct bch_node_bset *set, void *opaque);
enum bch_status bch_node_walk (const void *node, size_t len,
                               unsigned block_bytes, uint64_t bset_magic,
                               uint64_t node_ptr0, unsigned level,
                               const struct bch_key_geometry *geo,
                               bch_node_bset_cb cb, void *opaque,
                               unsigned *nsets, size_t *written_bytes,
                               struct bch_diag *diag);

/* ------------------------------------------------------------------------
 * struct jset (journal entry): 240-byte header, then keys
 * ------------------------------------------------------------------------ */

#define BCH_JSET_HEADER_SIZE   240u
#define BCACHE_JSET_VERSION    1u
#define BCH_JSET_MAX_BYTES     (BCH_PAGE_SIZE << 3)   /* 32 KiB */

struct bch_jset {
  uint64_t csum;
  uint64_t magic;
  uint64_t seq;
  uint32_t version;
  uint32_t keys;                  /* u64 words of keys */
  uint64_t last_seq;
  struct bkey_padded uuid_bucket;
  struct bkey_padded btree_root;
  uint16_t btree_level;
  uint64_t prio_bucket[BCH_MAX_CACHES_PER_SET];
  const uint64_t *key_words;      /* decode: points into the buffer */
};

static inline size_t bch_jset_bytes (uint32_t keys)
{ return BCH_JSET_HEADER_SIZE + (size_t) keys * 8; }

/* csum_set over [8, 240 + 8 * keys). */
uint64_t bch_jset_csum (const void *buf, size_t len);

/* Encode the header of j into buf, followed by the key words already
 * placed at buf + 240 (j->keys of them), and seal with the checksum.
 * Returns the unpadded size or 0 if it does not fit. */
size_t bch_jset_encode (const struct bch_jset *j, void *buf, size_t len);

/* Decode and verify one jset at the start of buf (len bytes available).
 * Checks magic (BCH_ERR_MAGIC: no entry here), version, size (fits in len
 * and in BCH_JSET_MAX_BYTES), checksum, last_seq <= seq, and that the
 * embedded uuid/root keys are well formed. */
enum bch_status bch_jset_decode (const void *buf, size_t len,
                                 uint64_t jset_magic, struct bch_jset *j,
                                 struct bch_diag *diag);

/* Walk a whole journal bucket (len bytes) block by block, as the engine's
 * journal read does (core/journal.c, journal_scan): at each offset where a
 * 240-byte header still fits, an entry that bch_jset_decode accepts (with
 * len - offset bytes available) is passed to cb with its byte offset and
 * its size rounded up to block_bytes, and the walk resumes just past it;
 * anything else (garbage, a torn entry with a bad checksum, free space,
 * an entry claiming to run past the bucket) is skipped one block at a
 * time.  Entries are reported in bucket order, whatever their seq; they
 * are block aligned, lie inside the bucket and do not overlap.  j and its
 * key_words (pointing into the bucket) are valid only during the call.
 * Never reads outside [bucket, bucket + len).  block_bytes must be a
 * power of two >= 512 and len a multiple of it (0 is an empty bucket),
 * else BCH_ERR_INVALID before anything is read.  A non-zero return from
 * cb stops the walk and is returned as BCH_ERR_INVALID.  A bucket with no
 * valid entry is BCH_OK with no call. */
typedef int (*bch_jset_cb) (const struct bch_jset *j, size_t offset,
                            size_t bytes, void *opaque);
enum bch_status bch_journal_bucket_walk (const void *bucket, size_t len,
                                         unsigned block_bytes,
                                         uint64_t jset_magic, bch_jset_cb cb,
                                         void *opaque, struct bch_diag *diag);
/* The same walk, also telling bad (if not NULL) about every block that
 * carries the jset magic but does not decode (a torn or corrupt entry):
 * its byte offset and why.  Free space and garbage without the magic are
 * not reported.  A non-zero return from bad stops the walk, as for cb. */
typedef int (*bch_jset_bad_cb) (size_t offset, const struct bch_diag *why,
                                void *opaque);
enum bch_status bch_journal_bucket_scan (const void *bucket, size_t len,
                                         unsigned block_bytes,
                                         uint64_t jset_magic, bch_jset_cb cb,
                                         bch_jset_bad_cb bad, void *opaque,
                                         struct bch_diag *diag);

/* ------------------------------------------------------------------------
 * struct prio_set: 40-byte header, then {prio u16, gen u8} per bucket
 * ------------------------------------------------------------------------ */

#define BCH_PSET_HEADER_SIZE   40u
#define BCH_BUCKET_DISK_SIZE   3u
#define BCH_INITIAL_PRIO       32768u
#define BCH_BTREE_PRIO         65535u

struct bch_bucket_disk {
  uint16_t prio;
  uint8_t  gen;
};

struct bch_pset_hdr {
  uint64_t csum;
  uint64_t magic;
  uint64_t seq;
  uint32_t version;
  uint64_t next_bucket;
};

/* Bytes of a bucket bcache uses for metadata (meta_bucket_bytes): the
 * bucket, capped at MAX_ORDER pages (4 MiB) for huge buckets. */
static inline uint64_t bch_meta_bucket_bytes (uint64_t bucket_bytes)
{ return bucket_bytes < ((uint64_t) BCH_PAGE_SIZE << 10) ? bucket_bytes
         : (uint64_t) BCH_PAGE_SIZE << 10; }
/* Entries per prio bucket: (meta bucket bytes - 40) / 3 (174,749 for
 * 512 KiB buckets). */
static inline uint64_t bch_prios_per_bucket (uint64_t bucket_bytes)
{ uint64_t b = bch_meta_bucket_bytes (bucket_bytes);
  return b > BCH_PSET_HEADER_SIZE ?
         (b - BCH_PSET_HEADER_SIZE) / BCH_BUCKET_DISK_SIZE : 0; }
/* Prio buckets needed for nbuckets buckets. */
uint64_t bch_prio_buckets (uint64_t nbuckets, uint64_t bucket_bytes);

/* Bytes of the prio bucket covered by its checksum: the bucket, capped at
 * bcache's MAX_ORDER pages (4 MiB) for huge buckets. */
uint64_t bch_pset_csum_bytes (uint64_t bucket_bytes);

/* Encode a prio bucket (len = bucket bytes): header, n entries, zero
 * fill, checksum. */
void bch_pset_encode (const struct bch_pset_hdr *h,
                      const struct bch_bucket_disk *entries, size_t n,
                      void *buf, size_t len);

/* Decode a prio bucket: magic, checksum.  Entries are not copied: read
 * them with bch_pset_entry.  len = bucket bytes. */
enum bch_status bch_pset_decode (const void *buf, size_t len,
                                 uint64_t pset_magic, struct bch_pset_hdr *h,
                                 struct bch_diag *diag);
/* Entry i of an encoded prio bucket (i < bch_prios_per_bucket (len)). */
struct bch_bucket_disk bch_pset_entry (const void *buf, size_t i);

/* ------------------------------------------------------------------------
 * struct uuid_entry (128 bytes each; the uuid bucket has no checksum)
 * ------------------------------------------------------------------------ */

#define BCH_UUID_ENTRY_SIZE    128u
#define BCH_UUID_FLASH_ONLY    1u

struct bch_uuid_entry {
  uint8_t  uuid[16];
  uint8_t  label[32];
  uint32_t first_reg;
  uint32_t last_reg;
  uint32_t invalidated;
  uint32_t flags;
  uint64_t sectors;
};

/* bcache's "invalid" uuid written over a detached slot. */
extern const uint8_t bch_invalid_uuid[16];

/* bcache's detach of a slot (bcache_device_detach): the uuid and the
 * first 16 bytes of the label become the invalid uuid, invalidated is
 * now; the rest (sectors, the label's tail) is left as it was. */
void bch_uuid_entry_invalidate (struct bch_uuid_entry *u, uint32_t now);
/* Was the slot detached (its uuid is the invalid uuid)? */
bool bch_uuid_entry_detached (const struct bch_uuid_entry *u);
/* Does the slot name a device (neither empty nor detached)? */
bool bch_uuid_entry_live (const struct bch_uuid_entry *u);

void bch_uuid_entry_encode (const struct bch_uuid_entry *u, void *buf128);
void bch_uuid_entry_decode (const void *buf128, struct bch_uuid_entry *u);
static inline uint64_t bch_uuids_per_bucket (uint64_t bucket_bytes)
{ return bch_meta_bucket_bytes (bucket_bytes) / BCH_UUID_ENTRY_SIZE; }

/* ------------------------------------------------------------------------
 * Little-endian helpers (shared by everything that touches disk bytes)
 * ------------------------------------------------------------------------ */
static inline uint16_t bch_get_le16 (const void *p)
{ const uint8_t *b = p; return (uint16_t) (b[0] | b[1] << 8); }
static inline uint32_t bch_get_le32 (const void *p)
{ const uint8_t *b = p;
  return (uint32_t) b[0] | (uint32_t) b[1] << 8 | (uint32_t) b[2] << 16 | (uint32_t) b[3] << 24; }
static inline uint64_t bch_get_le64 (const void *p)
{ const uint8_t *b = p; return (uint64_t) bch_get_le32 (b) | (uint64_t) bch_get_le32 (b + 4) << 32; }
static inline void bch_put_le16 (void *p, uint16_t v)
{ uint8_t *b = p; b[0] = (uint8_t) v; b[1] = (uint8_t) (v >> 8); }
static inline void bch_put_le32 (void *p, uint32_t v)
{ uint8_t *b = p; for (int i = 0; i < 4; i++) b[i] = (uint8_t) (v >> (8 * i)); }
static inline void bch_put_le64 (void *p, uint64_t v)
{ uint8_t *b = p; for (int i = 0; i < 8; i++) b[i] = (uint8_t) (v >> (8 * i)); }

/* Format a 16-byte uuid as 8-4-4-4-12 hex into out (37 bytes). */
void bch_uuid_unparse (const uint8_t uuid[16], char out[37]);
/* Parse; returns 0 or -1. */
int bch_uuid_parse (const char *s, uint8_t uuid[16]);
/* Are all n bytes at p zero?  (A blank device, an empty uuid slot.) */
bool bch_is_zero (const void *p, size_t n);
static inline bool bch_uuid_is_zero (const uint8_t uuid[16])
{ return bch_is_zero (uuid, 16); }

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_FORMAT_H */
