/* bcachefilter: write the seed corpora for the fuzz targets.
 *
 *   fuzz-gen-seeds OUTDIR
 *
 * creates OUTDIR/corpus-{sb,bdev,bkey,node,jset,pset,uuid,journal,
 *                        prio-chain}/
 * and writes valid (and a few deliberately broken) structures into them,
 * encoded with the format.c encoders, each prefixed by the target's
 * parameter header (common.h).  Structures are kept small (512-byte
 * blocks, 8 KiB prio buckets, journal buckets and prio "devices" of at
 * most 64 KiB) so the fuzzers stay fast.
 */
#include <config.h>

#include <errno.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "common.h"

static const char *outdir;
static unsigned nseeds;

/* A growable byte string. */
struct out {
  uint8_t *p;
  size_t n;
};

static void
put (struct out *o, const void *p, size_t n)
{
  o->p = realloc (o->p, o->n + n + 1);
  if (!o->p) abort ();
  memcpy (o->p + o->n, p, n);
  o->n += n;
}

static void
put8 (struct out *o, uint8_t v)
{
  put (o, &v, 1);
}

static void
put16 (struct out *o, uint16_t v)
{
  uint8_t b[2];
  bch_put_le16 (b, v);
  put (o, b, 2);
}

static void
put32 (struct out *o, uint32_t v)
{
  uint8_t b[4];
  bch_put_le32 (b, v);
  put (o, b, 4);
}

static void
put64 (struct out *o, uint64_t v)
{
  uint8_t b[8];
  bch_put_le64 (b, v);
  put (o, b, 8);
}

static void
seed (const char *target, const char *name, struct out *o)
{
  char path[4096];
  snprintf (path, sizeof path, "%s/corpus-%s", outdir, target);
  if (mkdir (path, 0777) == -1 && errno != EEXIST) {
    perror (path);
    exit (EXIT_FAILURE);
  }
  snprintf (path, sizeof path, "%s/corpus-%s/seed-%s", outdir, target, name);
  FILE *f = fopen (path, "wb");
  if (!f || fwrite (o->p, 1, o->n, f) != o->n || fclose (f) != 0) {
    perror (path);
    exit (EXIT_FAILURE);
  }
  free (o->p);
  o->p = NULL;
  o->n = 0;
  nseeds++;
}

static const uint8_t set_uuid[16] = {
  0xa1, 0x3b, 0x7b, 0x6b, 0xcd, 0x5e, 0x4b, 0x4f,
  0x9d, 0x27, 0x6c, 0x2e, 0x4b, 0x4b, 0x00, 0x01,
};
static const uint8_t dev_uuid[16] = {
  0x5f, 0x0e, 0x2c, 0x41, 0x8d, 0x3a, 0x4e, 0x10,
  0xb1, 0x22, 0x93, 0x7c, 0x10, 0xaa, 0x42, 0x07,
};

/* A make-bcache style cache superblock: 512 buckets of bucket_size. */
static void
make_sb (struct bch_sb *sb, uint16_t bucket_size)
{
  memset (sb, 0, sizeof *sb);
  sb->offset = BCH_SB_SECTOR;
  sb->version = BCACHE_SB_VERSION_CDEV;
  memcpy (sb->magic, bch_sb_magic, 16);
  memcpy (sb->uuid, dev_uuid, 16);
  memcpy (sb->set_uuid, set_uuid, 16);
  memcpy (sb->label, "fuzz-seed", 9);
  sb->nbuckets = 512;
  sb->block_size = 1;
  sb->bucket_size = bucket_size;
  sb->nr_in_set = 1;
  sb->nr_this_dev = 0;
  sb->first_bucket = (uint16_t) (bucket_size ? 23 / bucket_size + 1 : 1);
}

/* A superblock seed (fuzz-sb, fuzz-bdev: the same input layout). */
static void
area_seed (const char *target, const char *name, const struct bch_sb *sb,
           uint8_t flags, uint64_t device_sectors, size_t area_len,
           void (*mangle) (uint8_t *))
{
  uint8_t area[BCH_SB_AREA_SIZE];
  bch_sb_encode (sb, area);
  if (mangle)
    mangle (area);
  struct out o = { 0 };
  put8 (&o, flags);
  put64 (&o, device_sectors);
  put (&o, area, area_len);
  seed (target, name, &o);
}

static void
sb_seed (const char *name, const struct bch_sb *sb, uint8_t flags,
         uint64_t device_sectors, size_t area_len, void (*mangle) (uint8_t *))
{
  area_seed ("sb", name, sb, flags, device_sectors, area_len, mangle);
}

static void
mangle_nbuckets (uint8_t *area)
{
  bch_put_le64 (area + 184, 100);       /* < 128: invalid */
}

static void
mangle_csum (uint8_t *area)
{
  area[0] ^= 0x40;
}

static void
sb_seeds (void)
{
  struct bch_sb sb;

  make_sb (&sb, 1024);
  sb_seed ("fresh", &sb, 0, 512 * 1024, BCH_SB_AREA_SIZE, NULL);
  sb_seed ("truncated", &sb, 0, 0, BCH_SB_STRUCT_SIZE - 8, NULL);
  sb_seed ("bad-csum", &sb, 0, 0, BCH_SB_AREA_SIZE, mangle_csum);
  sb_seed ("invalid-fixed-csum", &sb, FUZZ_SB_FIX_CSUM, 0, BCH_SB_AREA_SIZE,
           mangle_nbuckets);

  /* After first registration: version 3, SYNC, 4 journal buckets. */
  make_sb (&sb, 1024);
  sb.version = BCACHE_SB_VERSION_CDEV_WITH_UUID;
  sb.flags = BCH_CACHE_SYNC | BCH_CACHE_DISCARD |
    ((uint64_t) BCH_REPLACEMENT_FIFO << BCH_CACHE_REPLACEMENT_SHIFT);
  sb.seq = 2;
  sb.last_mount = 1700000000;
  sb.njournal_buckets = 4;
  for (unsigned i = 0; i < 4; i++)
    sb.d[i] = sb.first_bucket + i;
  sb_seed ("registered", &sb, 0, 512 * 1024 + 16, BCH_SB_AREA_SIZE, NULL);
  sb_seed ("too-small-device", &sb, 0, 512 * 1024 - 1, BCH_SB_AREA_SIZE, NULL);

  /* Small buckets, several devices. */
  make_sb (&sb, 8);
  sb.block_size = 8;
  sb.nbuckets = 4096;
  sb.nr_in_set = 3;
  sb.nr_this_dev = 2;
  sb.njournal_buckets = 32;
  for (unsigned i = 0; i < 32; i++)
    sb.d[i] = sb.first_bucket + i;
  sb_seed ("small-buckets", &sb, 0, 4096 * 8, BCH_SB_AREA_SIZE, NULL);

  /* Version 5 with a log2-encoded large bucket (2^17 sectors). */
  make_sb (&sb, 17);
  sb.version = BCACHE_SB_VERSION_CDEV_WITH_FEATURES;
  sb.feature_incompat = BCH_FEATURE_INCOMPAT_LOG_LARGE_BUCKET;
  sb.first_bucket = 1;
  sb.nbuckets = 128;
  sb_seed ("log-large-bucket", &sb, 0, 128ull << 17, BCH_SB_AREA_SIZE, NULL);

  /* Obsolete large bucket: bucket_size + hi << 16. */
  make_sb (&sb, 0);
  sb.version = BCACHE_SB_VERSION_CDEV_WITH_FEATURES;
  sb.feature_incompat = BCH_FEATURE_INCOMPAT_OBSO_LARGE_BUCKET;
  sb.obso_bucket_size_hi = 2;
  sb.first_bucket = 1;
  sb.nbuckets = 128;
  sb_seed ("obso-large-bucket", &sb, 0, 0, BCH_SB_AREA_SIZE, NULL);

  /* A backing device. */
  make_sb (&sb, 1024);
  sb.version = BCACHE_SB_VERSION_BDEV_WITH_OFFSET;
  sb.nbuckets = 2048;                   /* data_offset */
  sb.flags = 1 | (2ull << 61);          /* writeback, dirty */
  sb_seed ("backing", &sb, 0, 0, BCH_SB_AREA_SIZE, NULL);
}

/* ------------------------------------------------------------------------ */

/* A make-bcache -B superblock: version 1 (data at sector 16), 4 KiB
 * blocks, detached (state none; make-bcache fills set_uuid anyway). */
static void
make_bdev_sb (struct bch_sb *sb)
{
  memset (sb, 0, sizeof *sb);
  sb->offset = BCH_SB_SECTOR;
  sb->version = BCACHE_SB_VERSION_BDEV;
  memcpy (sb->magic, bch_sb_magic, 16);
  memcpy (sb->uuid, dev_uuid, 16);
  memcpy (sb->set_uuid, set_uuid, 16);
  sb->block_size = 8;
  sb->bucket_size = 1024;
}

static void
bdev_seed (const char *name, const struct bch_sb *sb, uint8_t flags,
           uint64_t device_sectors, size_t area_len,
           void (*mangle) (uint8_t *))
{
  area_seed ("bdev", name, sb, flags, device_sectors, area_len, mangle);
}

static void
mangle_data_offset (uint8_t *area)
{
  bch_put_le64 (area + 184, 8);          /* < 16: invalid */
}

static void
bdev_seeds (void)
{
  struct bch_sb sb;

  make_bdev_sb (&sb);
  bdev_seed ("v1-detached", &sb, 0, 1 << 18, BCH_SB_AREA_SIZE, NULL);
  bdev_seed ("truncated", &sb, 0, 0, BCH_SB_STRUCT_SIZE - 8, NULL);
  bdev_seed ("bad-csum", &sb, 0, 0, BCH_SB_AREA_SIZE, mangle_csum);
  bdev_seed ("attach-clean", &sb, 1 << 1, 0, BCH_SB_AREA_SIZE, NULL);

  /* Attached and clean, writearound, labelled. */
  make_bdev_sb (&sb);
  sb.flags = BCH_BDEV_MODE_WRITEAROUND |
             ((uint64_t) BCH_BDEV_STATE_CLEAN << BCH_BDEV_STATE_SHIFT);
  memcpy (sb.label, "vm1-disk", 8);
  bdev_seed ("v1-clean", &sb, 0, 1 << 18, BCH_SB_AREA_SIZE, NULL);

  /* Version 4, data at 1 MiB, writeback with dirty data. */
  make_bdev_sb (&sb);
  sb.version = BCACHE_SB_VERSION_BDEV_WITH_OFFSET;
  sb.nbuckets = 2048;                   /* data_offset */
  sb.flags = BCH_BDEV_MODE_WRITEBACK |
             ((uint64_t) BCH_BDEV_STATE_DIRTY << BCH_BDEV_STATE_SHIFT);
  bdev_seed ("v4-dirty", &sb, 0, 1 << 20, BCH_SB_AREA_SIZE, NULL);
  bdev_seed ("v4-no-data", &sb, 0, 2048, BCH_SB_AREA_SIZE, NULL);
  bdev_seed ("v4-bad-offset-fixed-csum", &sb, FUZZ_SB_FIX_CSUM, 0,
             BCH_SB_AREA_SIZE, mangle_data_offset);
  bdev_seed ("detach", &sb, 0, 0, BCH_SB_AREA_SIZE, NULL);

  /* Version 6 with feature words (kept, not checked). */
  make_bdev_sb (&sb);
  sb.version = BCACHE_SB_VERSION_BDEV_WITH_FEATURES;
  sb.nbuckets = 16;
  sb.feature_incompat = BCH_FEATURE_INCOMPAT_LOG_LARGE_BUCKET;
  bdev_seed ("v6-features", &sb, 0, 0, BCH_SB_AREA_SIZE, NULL);

  /* A cache superblock: not a backing device. */
  make_sb (&sb, 1024);
  bdev_seed ("cache-device", &sb, 0, 0, BCH_SB_AREA_SIZE, NULL);
}

/* ------------------------------------------------------------------------ */

/* Geometry shared by the bkey and node seeds: 1024 buckets of 16 sectors
 * (8 KiB: 8 KiB nodes), first bucket 2. */
#define G_NBUCKETS  1024u
#define G_BUCKET    16u
#define G_FIRST     2u

static void
put_geo (struct out *o, unsigned nr_in_set)
{
  put8 (o, (uint8_t) nr_in_set);
  put64 (o, G_NBUCKETS);
  put64 (o, G_BUCKET);
  put64 (o, G_FIRST);
}

static void
make_extent (struct bkey_padded *k, uint64_t inode, uint64_t end,
             uint64_t size, uint64_t bucket, uint64_t in_bucket, uint8_t gen,
             bool dirty)
{
  memset (k, 0, sizeof *k);
  bkey_init (&k->key, inode, end, size);
  SET_KEY_PTRS (&k->key, 1);
  SET_KEY_DIRTY (&k->key, dirty);
  k->key.ptr[0] = MAKE_PTR (gen, bucket * G_BUCKET + in_bucket, 0);
}

static void
bkey_seed (const char *name, unsigned level, unsigned nr_in_set,
           const struct bkey *k)
{
  uint8_t b[BKEY_PAD_U64S * 8];
  size_t n = bkey_encode (k, b, sizeof b);
  if (n == 0) {
    fprintf (stderr, "gen-seeds: bkey_encode failed for %s\n", name);
    exit (EXIT_FAILURE);
  }
  struct out o = { 0 };
  put8 (&o, (uint8_t) level);
  put_geo (&o, nr_in_set);
  put (&o, b, n);
  seed ("bkey", name, &o);
}

static void
bkey_seeds (void)
{
  struct bkey_padded k;

  make_extent (&k, 1, 1024, 8, 5, 8, 3, true);
  bkey_seed ("dirty-extent", 0, 1, &k.key);

  make_extent (&k, 2, 64, 16, 7, 0, 250, false);
  bkey_seed ("clean-extent", 0, 1, &k.key);

  /* Cache-miss check key. */
  memset (&k, 0, sizeof k);
  bkey_init (&k.key, 1, 4096, 8);
  SET_KEY_PTRS (&k.key, 1);
  k.key.ptr[0] = MAKE_PTR (0, 0, PTR_CHECK_DEV);
  bkey_seed ("check-key", 0, 1, &k.key);

  /* Whiteout (no pointers). */
  memset (&k, 0, sizeof k);
  bkey_init (&k.key, 3, 200, 100);
  bkey_seed ("whiteout", 0, 1, &k.key);

  /* A btree pointer (node = whole 16-sector bucket). */
  make_extent (&k, 0, 0, G_BUCKET, 9, 0, 1, false);
  bkey_max (&k.key);
  SET_KEY_SIZE (&k.key, G_BUCKET);
  SET_KEY_PTRS (&k.key, 1);
  k.key.ptr[0] = MAKE_PTR (1, 9 * G_BUCKET, 0);
  bkey_seed ("btree-ptr", 1, 1, &k.key);

  /* Six pointers on six devices (the most a padded key holds). */
  make_extent (&k, 4, 1000, 4, 10, 4, 7, false);
  SET_KEY_PTRS (&k.key, BKEY_PAD_PTRS);
  for (unsigned i = 0; i < BKEY_PAD_PTRS; i++)
    k.key.ptr[i] = MAKE_PTR ((uint8_t) i, (10 + i) * G_BUCKET + 4, i);
  bkey_seed ("six-ptrs", 0, 8, &k.key);
}

/* ------------------------------------------------------------------------ */

#define NODE_LEN    (G_BUCKET * BCH_SECTOR_SIZE)     /* 8 KiB */

static uint64_t
bset_magic_of_seeds (void)
{
  struct bch_sb sb;
  make_sb (&sb, G_BUCKET);
  return bch_bset_magic (&sb);
}

/* Append a bset with these keys at *off (block aligned), seal it, and
 * advance *off to the next block boundary. */
static void
node_add_bset (uint8_t *node, size_t *off, unsigned block, uint64_t seq,
               uint64_t ptr0, const struct bkey_padded *keys, unsigned nkeys)
{
  uint8_t *b = node + *off;
  size_t w = 0;
  for (unsigned i = 0; i < nkeys; i++)
    w += bkey_encode (&keys[i].key, b + BCH_BSET_HEADER_SIZE + w * 8,
                      NODE_LEN - *off - BCH_BSET_HEADER_SIZE - w * 8) / 8;
  size_t n = bch_bset_seal (b, NODE_LEN - *off, bset_magic_of_seeds (), seq,
                            (uint32_t) w, ptr0);
  if (n == 0) {
    fprintf (stderr, "gen-seeds: bch_bset_seal failed\n");
    exit (EXIT_FAILURE);
  }
  *off += (n + block - 1) / block * block;
}

static void
node_seed (const char *name, uint8_t flags, unsigned block_shift,
           unsigned level, uint64_t ptr0, const uint8_t *node, size_t len)
{
  struct out o = { 0 };
  put8 (&o, flags);
  put8 (&o, (uint8_t) block_shift);
  put8 (&o, (uint8_t) level);
  put8 (&o, 1);                         /* nr_in_set */
  put8 (&o, 0);                         /* stop_after */
  put64 (&o, bset_magic_of_seeds ());
  put64 (&o, ptr0);
  put64 (&o, G_NBUCKETS);
  put64 (&o, G_BUCKET);
  put64 (&o, G_FIRST);
  put (&o, node, len);
  seed ("node", name, &o);
}

static void
node_seeds (void)
{
  static uint8_t node[NODE_LEN];
  struct bkey_padded k[4];
  size_t off;
  uint64_t ptr0 = MAKE_PTR (1, 40 * G_BUCKET, 0);
  const uint64_t seq = 0x1234567890abcdefull;

  /* A fresh root: one empty bset. */
  memset (node, 0, sizeof node);
  off = 0;
  node_add_bset (node, &off, 512, seq, ptr0, NULL, 0);
  node_seed ("empty-root", 0, 0, 0, ptr0, node, NODE_LEN);

  /* A leaf with three bsets in 512-byte blocks. */
  memset (node, 0, sizeof node);
  off = 0;
  make_extent (&k[0], 1, 8, 8, 3, 0, 1, true);
  make_extent (&k[1], 1, 24, 8, 3, 8, 1, false);
  memset (&k[2], 0, sizeof k[2]);
  bkey_init (&k[2].key, 1, 64, 8);
  SET_KEY_PTRS (&k[2].key, 1);
  k[2].key.ptr[0] = MAKE_PTR (0, 0, PTR_CHECK_DEV);
  node_add_bset (node, &off, 512, seq, ptr0, k, 3);
  make_extent (&k[0], 1, 16, 8, 4, 0, 2, true);
  node_add_bset (node, &off, 512, seq, ptr0, k, 1);
  memset (&k[0], 0, sizeof k[0]);
  bkey_init (&k[0].key, 2, 100, 50);    /* whiteout */
  node_add_bset (node, &off, 512, seq, ptr0, k, 1);
  node_seed ("leaf-3-sets", 0, 0, 0, ptr0, node, NODE_LEN);

  /* The same with a stale checksum, resealed by the harness. */
  node[0] ^= 1;
  node_seed ("leaf-fix-csum", FUZZ_NODE_FIX_CSUM, 0, 0, ptr0, node, NODE_LEN);

  /* A stale later block still carrying seq: a corrupted log. */
  node[0] ^= 1;
  bch_put_le64 (node + 7 * 512 + 16, seq);
  node_seed ("leaf-corrupt-tail", 0, 0, 0, ptr0, node, NODE_LEN);

  /* An interior node (level 1) of btree pointers, 4 KiB blocks. */
  memset (node, 0, sizeof node);
  off = 0;
  for (unsigned i = 0; i < 3; i++) {
    memset (&k[i], 0, sizeof k[i]);
    bkey_init (&k[i].key, 1, 1000 * (i + 1), G_BUCKET);
    SET_KEY_PTRS (&k[i].key, 1);
    k[i].key.ptr[0] = MAKE_PTR (1, (50 + i) * G_BUCKET, 0);
  }
  bkey_max (&k[3].key);
  SET_KEY_SIZE (&k[3].key, G_BUCKET);
  SET_KEY_PTRS (&k[3].key, 1);
  k[3].key.ptr[0] = MAKE_PTR (1, 60 * G_BUCKET, 0);
  node_add_bset (node, &off, 4096, seq, ptr0, k, 4);
  node_seed ("interior-4k-blocks", 0, 3, 1, ptr0, node, NODE_LEN);

  /* A version-0 bset (plain bch_crc64), resealed by the harness. */
  memset (node, 0, sizeof node);
  off = 0;
  make_extent (&k[0], 5, 80, 16, 6, 0, 9, false);
  node_add_bset (node, &off, 512, seq, ptr0, k, 1);
  bch_put_le32 (node + 24, 0);
  node_seed ("leaf-version0", FUZZ_NODE_FIX_CSUM, 0, 0, ptr0, node, NODE_LEN);
}

/* ------------------------------------------------------------------------ */

static void
jset_seed (const char *name, uint8_t flags, const struct bch_jset *j,
           const struct bkey_padded *keys, unsigned nkeys, unsigned block)
{
  static uint8_t buf[BCH_JSET_MAX_BYTES];
  memset (buf, 0, sizeof buf);
  size_t w = 0;
  for (unsigned i = 0; i < nkeys; i++)
    w += bkey_encode (&keys[i].key, buf + BCH_JSET_HEADER_SIZE + w * 8,
                      sizeof buf - BCH_JSET_HEADER_SIZE - w * 8) / 8;
  struct bch_jset jj = *j;
  jj.keys = (uint32_t) w;
  size_t n = bch_jset_encode (&jj, buf, sizeof buf);
  if (n == 0) {
    fprintf (stderr, "gen-seeds: bch_jset_encode failed\n");
    exit (EXIT_FAILURE);
  }
  if (flags & FUZZ_JSET_FIX_CSUM)
    buf[0] ^= 0x80;
  struct out o = { 0 };
  put8 (&o, flags);
  put64 (&o, j->magic);
  put (&o, buf, (n + block - 1) / block * block);
  seed ("jset", name, &o);
}

static void
jset_seeds (void)
{
  struct bch_sb sb;
  make_sb (&sb, G_BUCKET);

  struct bch_jset j;
  memset (&j, 0, sizeof j);
  j.magic = bch_jset_magic (&sb);
  j.seq = 1;
  j.version = BCACHE_JSET_VERSION;
  j.last_seq = 1;
  bkey_init (&j.uuid_bucket.key, 0, 0, G_BUCKET);
  SET_KEY_PTRS (&j.uuid_bucket.key, 1);
  j.uuid_bucket.key.ptr[0] = MAKE_PTR (1, 20 * G_BUCKET, 0);
  bkey_max (&j.btree_root.key);
  SET_KEY_SIZE (&j.btree_root.key, G_BUCKET);
  SET_KEY_PTRS (&j.btree_root.key, 1);
  j.btree_root.key.ptr[0] = MAKE_PTR (1, 21 * G_BUCKET, 0);
  j.btree_level = 0;
  j.prio_bucket[0] = 19;

  /* The first (meta) entry after registration. */
  jset_seed ("first-meta", 0, &j, NULL, 0, 512);

  /* An entry with journalled write keys. */
  struct bkey_padded k[3];
  make_extent (&k[0], 1, 8, 8, 30, 0, 1, true);
  make_extent (&k[1], 1, 16, 8, 30, 8, 1, true);
  memset (&k[2], 0, sizeof k[2]);
  bkey_init (&k[2].key, 1, 4096, 2048);         /* bypass invalidation */
  j.seq = 42;
  j.last_seq = 40;
  j.btree_level = 1;
  jset_seed ("keys", 0, &j, k, 3, 512);
  jset_seed ("keys-fix-csum", FUZZ_JSET_FIX_CSUM, &j, k, 3, 4096);

  /* Version 0 (legacy uuid format). */
  j.version = 0;
  jset_seed ("version0", 0, &j, k, 1, 512);
}

/* ------------------------------------------------------------------------ */

#define PSET_BUCKET 8192u

static void
pset_seed (const char *name, uint8_t flags, const struct bch_pset_hdr *h,
           unsigned nused)
{
  static uint8_t buf[PSET_BUCKET];
  static struct bch_bucket_disk e[PSET_BUCKET / 3];
  uint64_t n = bch_prios_per_bucket (PSET_BUCKET);
  for (uint64_t i = 0; i < n; i++) {
    e[i].prio = i < nused ? (uint16_t) (BCH_INITIAL_PRIO - i) : 0;
    e[i].gen = (uint8_t) (i < nused ? 1 + i % 7 : 0);
  }
  if (nused > 4) {
    e[2].prio = BCH_BTREE_PRIO;
    e[3].prio = BCH_BTREE_PRIO;
  }
  bch_pset_encode (h, e, n, buf, sizeof buf);
  if (flags & FUZZ_PSET_FIX_CSUM)
    buf[1] ^= 0x10;
  struct out o = { 0 };
  put8 (&o, flags);
  put64 (&o, h->magic);
  put (&o, buf, sizeof buf);
  seed ("pset", name, &o);
}

static void
pset_seeds (void)
{
  struct bch_sb sb;
  make_sb (&sb, PSET_BUCKET / BCH_SECTOR_SIZE);
  struct bch_pset_hdr h;
  memset (&h, 0, sizeof h);
  h.magic = bch_pset_magic (&sb);
  h.seq = 7;
  h.next_bucket = 0;
  pset_seed ("last", 0, &h, 512);
  h.next_bucket = 33;
  pset_seed ("chained", 0, &h, 2000);
  pset_seed ("chained-fix-csum", FUZZ_PSET_FIX_CSUM, &h, 100);
}

/* ------------------------------------------------------------------------ */

static void
uuid_seed (const char *name, const struct bch_uuid_entry *u, const char *s)
{
  uint8_t b[BCH_UUID_ENTRY_SIZE];
  bch_uuid_entry_encode (u, b);
  struct out o = { 0 };
  put (&o, b, sizeof b);
  put (&o, s, strlen (s));
  seed ("uuid", name, &o);
}

static void
uuid_seeds (void)
{
  struct bch_uuid_entry u;

  memset (&u, 0, sizeof u);
  uuid_seed ("empty", &u, "");

  memcpy (u.uuid, dev_uuid, 16);
  memcpy (u.label, "backing-volume", 14);
  u.first_reg = 1700000000;
  u.last_reg = 1700000500;
  uuid_seed ("backing", &u, "5f0e2c41-8d3a-4e10-b122-937c10aa4207");

  u.flags = BCH_UUID_FLASH_ONLY;
  u.sectors = 1ull << 30;
  uuid_seed ("flash-only", &u, "A13B7B6B-CD5E-4B4F-9D27-6C2E4B4B0001");

  memcpy (u.uuid, bch_invalid_uuid, 16);
  u.invalidated = 1700000900;
  uuid_seed ("invalidated", &u, "a13b7b6bcd5e4b4f9d276c2e4b4b0001");
}

/* ------------------------------------------------------------------------
 * Whole journal buckets (fuzz-journal)
 * ------------------------------------------------------------------------ */

/* A journal entry of `words` recognisable key words at buf + off. */
static size_t
journal_put (uint8_t *buf, size_t off, size_t room, uint64_t seq,
             uint32_t words)
{
  struct bch_sb sb;
  struct bch_jset j;

  make_sb (&sb, G_BUCKET);
  memset (&j, 0, sizeof j);
  j.magic = bch_jset_magic (&sb);
  j.seq = seq;
  j.version = BCACHE_JSET_VERSION;
  j.keys = words;
  j.last_seq = seq > 2 ? seq - 2 : 0;
  bkey_init (&j.uuid_bucket.key, 0, 0, G_BUCKET);
  SET_KEY_PTRS (&j.uuid_bucket.key, 1);
  j.uuid_bucket.key.ptr[0] = MAKE_PTR (1, 20 * G_BUCKET, 0);
  bkey_max (&j.btree_root.key);
  SET_KEY_SIZE (&j.btree_root.key, G_BUCKET);
  SET_KEY_PTRS (&j.btree_root.key, 1);
  j.btree_root.key.ptr[0] = MAKE_PTR (1, 21 * G_BUCKET, 0);
  j.prio_bucket[0] = 19;
  /* Journalled keys: dirty one-pointer extents (3 words each). */
  for (uint32_t w = 0; w + 3 <= words; w += 3) {
    struct bkey_padded k;
    make_extent (&k, 1, 8 * (seq * 100 + w + 1), 8, 30 + w % 50, 0, 1, true);
    bkey_encode (&k.key, buf + off + BCH_JSET_HEADER_SIZE + 8 * w, 24);
  }
  for (uint32_t w = words / 3 * 3; w < words; w++)
    bch_put_le64 (buf + off + BCH_JSET_HEADER_SIZE + 8 * w, 0);
  size_t n = bch_jset_encode (&j, buf + off, room);
  if (n == 0) {
    fprintf (stderr, "gen-seeds: bch_jset_encode failed\n");
    exit (EXIT_FAILURE);
  }
  return n;
}

static void
journal_seed (const char *name, uint8_t flags, unsigned block_shift,
              unsigned bucket_bytes, uint8_t stop_after, uint32_t raw_block,
              const uint8_t *bucket, size_t len)
{
  struct bch_sb sb;
  unsigned block = 512u << block_shift;
  struct out o = { 0 };

  make_sb (&sb, G_BUCKET);
  put8 (&o, flags);
  put8 (&o, (uint8_t) block_shift);
  put16 (&o, (uint16_t) (bucket_bytes / block - 1));
  put8 (&o, stop_after);
  put32 (&o, raw_block);
  put64 (&o, bch_jset_magic (&sb));
  put (&o, bucket, len);
  seed ("journal", name, &o);
}

static void
journal_seeds (void)
{
  static uint8_t b[FUZZ_JOURNAL_MAX_BUCKET];
  size_t off;

  /* 16 KiB bucket, 512-byte blocks: entries of 1, 2 and 3 blocks, garbage,
   * a torn entry, then free space. */
  memset (b, 0, sizeof b);
  off = 0;
  off += (journal_put (b, off, 16384 - off, 10, 0) + 511) / 512 * 512;
  off += (journal_put (b, off, 16384 - off, 11, 60) + 511) / 512 * 512;
  for (unsigned i = 0; i < 512; i++)
    b[off + i] = (uint8_t) (i * 37 + 5);                 /* garbage block */
  off += 512;
  size_t torn = off;
  off += (journal_put (b, off, 16384 - off, 12, 150) + 511) / 512 * 512;
  b[torn + 700] ^= 0x04;                                /* bad csum */
  off += (journal_put (b, off, 16384 - off, 13, 3) + 511) / 512 * 512;
  journal_seed ("mixed-512", 0, 0, 16384, 0, 0, b, 16384);
  journal_seed ("mixed-512-stop", 0, 0, 16384, 2, 0, b, 16384);
  /* The same with the torn entry resealed by the harness. */
  journal_seed ("mixed-512-fix-csum", FUZZ_JOURNAL_FIX_CSUM, 0, 16384, 0, 0,
                b, 16384);
  /* Raw: a ragged length, and a bad block size. */
  journal_seed ("raw-ragged", FUZZ_JOURNAL_RAW, 0, 16384, 0, 512, b, 16000);
  journal_seed ("raw-bad-block", FUZZ_JOURNAL_RAW, 0, 16384, 0, 1536, b,
                16384);
  journal_seed ("raw-ok", FUZZ_JOURNAL_RAW, 0, 16384, 0, 1024, b, 16384);

  /* 64 KiB bucket, 4 KiB blocks, seqs out of order, one entry that claims
   * to run past the end of the bucket. */
  memset (b, 0, sizeof b);
  static const uint64_t seqs[] = { 700, 701, 702, 650, 651 };
  off = 0;
  for (unsigned i = 0; i < 5; i++)
    off += (journal_put (b, off, sizeof b - off, seqs[i], 30 * i) + 4095)
           / 4096 * 4096;
  journal_put (b, 15 * 4096, 4096, 703, (4096 - BCH_JSET_HEADER_SIZE) / 8);
  bch_put_le32 (b + 15 * 4096 + 28, (4096 - BCH_JSET_HEADER_SIZE) / 8 + 1);
  journal_seed ("out-of-order-4k", 0, 3, sizeof b, 0, 0, b, sizeof b);

  /* A bucket full of one 32 KiB entry and 8 KiB of others, 1 KiB blocks. */
  memset (b, 0, sizeof b);
  off = journal_put (b, 0, sizeof b, 900,
                     (BCH_JSET_MAX_BYTES - BCH_JSET_HEADER_SIZE) / 8);
  journal_put (b, off, 1024, 901, 1);
  journal_put (b, off + 1024, 1024, 902, 2);
  journal_seed ("max-entry-1k", 0, 1, 40960, 0, 0, b, 40960);

  /* An entry hiding another in its key words at a block boundary: the
   * walk must jump past the outer one and never report the inner one. */
  memset (b, 0, sizeof b);
  off = journal_put (b, 0, sizeof b, 950, 200);         /* 4 blocks of 512 */
  {
    uint8_t inner[512];
    memset (inner, 0, sizeof inner);
    journal_put (inner, 0, sizeof inner, 951, 0);
    memcpy (b + 1024, inner, BCH_JSET_HEADER_SIZE);
    bch_put_le64 (b, bch_jset_csum (b, sizeof b));      /* reseal outer */
  }
  journal_put (b, 2048, 512, 952, 1);
  journal_seed ("nested-512", 0, 0, 4096, 0, 0, b, 4096);

  /* An empty bucket (free space) of 8 KiB, 2 KiB blocks. */
  memset (b, 0, sizeof b);
  journal_seed ("empty-2k", 0, 2, 8192, 0, 0, b, 8192);
}

/* ------------------------------------------------------------------------
 * Whole prio chains (fuzz-prio-chain)
 * ------------------------------------------------------------------------ */

/* Write a device of ndev buckets of bb bytes holding the chain links[0]
 * -> links[1] -> ... (nlinks buckets, the last pointing at `last_next`),
 * each bucket's entries a recognisable pattern for its segment.  Returns
 * the device bytes (len ndev * bb). */
static uint8_t *
prio_device (size_t bb, unsigned ndev, const uint64_t *links, unsigned nlinks,
             uint64_t last_next, uint64_t seq)
{
  struct bch_sb sb;
  uint8_t *dev = calloc (ndev, bb);
  uint64_t per = bch_prios_per_bucket (bb);
  struct bch_bucket_disk *e = calloc (per, sizeof *e);

  if (!dev || !e) abort ();
  make_sb (&sb, (uint16_t) (bb / BCH_SECTOR_SIZE));
  for (unsigned i = 0; i < nlinks; i++) {
    struct bch_pset_hdr h;
    memset (&h, 0, sizeof h);
    h.magic = bch_pset_magic (&sb);
    h.seq = seq;
    h.next_bucket = i + 1 < nlinks ? links[i + 1] : last_next;
    for (uint64_t j = 0; j < per; j++) {
      e[j].prio = (uint16_t) (j % 5 == 0 ? BCH_BTREE_PRIO
                                         : BCH_INITIAL_PRIO - (j + i) % 1000);
      e[j].gen = (uint8_t) (1 + (j * 7 + i) % 200);
    }
    if (links[i] < ndev)
      bch_pset_encode (&h, e, per, dev + links[i] * bb, bb);
  }
  free (e);
  return dev;
}

static void
prio_chain_seed (const char *name, uint8_t flags, unsigned bucket_shift,
                 uint8_t first_bucket, uint32_t nbuckets, uint64_t head,
                 const uint8_t *dev, size_t len)
{
  struct bch_sb sb;
  size_t bb = (size_t) 4096 << bucket_shift;
  struct out o = { 0 };

  make_sb (&sb, (uint16_t) (bb / BCH_SECTOR_SIZE));
  put8 (&o, flags);
  put8 (&o, (uint8_t) bucket_shift);
  put8 (&o, first_bucket);
  put32 (&o, nbuckets);
  put64 (&o, head);
  put64 (&o, bch_pset_magic (&sb));
  put (&o, dev, len);
  seed ("prio-chain", name, &o);
}

static void
prio_chain_seeds (void)
{
  uint8_t *dev;
  const uint64_t per4 = bch_prios_per_bucket (4096);
  const uint64_t per16 = bch_prios_per_bucket (16384);

  /* 4 KiB buckets, 16 on the device: a chain of 3 (2 -> 5 -> 3) for a
   * cache of 3 * per - 100 buckets (the last prio bucket partly used). */
  {
    static const uint64_t l[] = { 2, 5, 3 };
    dev = prio_device (4096, 16, l, 3, 0, 77);
    prio_chain_seed ("chain-3", 0, 0, 1, (uint32_t) (3 * per4 - 100), 2, dev,
                     16 * 4096);
    /* Stale checksums, resealed by the harness. */
    dev[2 * 4096 + 100] ^= 0x08;
    prio_chain_seed ("chain-3-fix-csum", FUZZ_PRIO_FIX_CSUM, 0, 1,
                     (uint32_t) (3 * per4 - 100), 2, dev, 16 * 4096);
    /* Head before first_bucket. */
    dev[2 * 4096 + 100] ^= 0x08;
    prio_chain_seed ("head-below-first", 0, 0, 3, (uint32_t) (3 * per4), 2,
                     dev, 16 * 4096);
    free (dev);
    /* A cache one prio bucket bigger, the last link pointing past the
     * stored buckets (a hole that reads as zeroes). */
    dev = prio_device (4096, 16, l, 3, 100, 77);
    prio_chain_seed ("chain-into-hole", 0, 0, 1, (uint32_t) (4 * per4), 2,
                     dev, 16 * 4096);
    free (dev);
  }

  /* A cycle 4 -> 6 -> 4 in a cache that needs 5 prio buckets. */
  {
    static const uint64_t l[] = { 4, 6 };
    dev = prio_device (4096, 16, l, 2, 4, 78);
    prio_chain_seed ("cycle", 0, 0, 1, (uint32_t) (5 * per4), 4, dev,
                     16 * 4096);
    free (dev);
  }

  /* A next pointer far outside the cache. */
  {
    static const uint64_t l[] = { 1, 2 };
    dev = prio_device (8192, 8, l, 2, 0, 79);
    bch_pset_encode (&(struct bch_pset_hdr) {
                       .magic = bch_get_le64 (dev + 8192 + 8), .seq = 79,
                       .next_bucket = 1ull << 40 },
                     NULL, 0, dev + 8192, 8192);
    prio_chain_seed ("next-out-of-range", 0, 1, 1,
                     (uint32_t) (3 * bch_prios_per_bucket (8192)), 1, dev,
                     8 * 8192);
    free (dev);
  }

  /* 16 KiB buckets: one prio bucket for a small cache, and a chain of 4
   * using every stored bucket but 0. */
  {
    static const uint64_t l1[] = { 1 };
    dev = prio_device (16384, 2, l1, 1, 0, 80);
    prio_chain_seed ("single-16k", 0, 2, 1, 1000, 1, dev, 2 * 16384);
    free (dev);
    static const uint64_t l4[] = { 3, 1, 2, 0 };
    dev = prio_device (16384, 4, l4, 4, 0, 81);
    prio_chain_seed ("chain-4-16k", 0, 2, 0, (uint32_t) (4 * per16), 3, dev,
                     4 * 16384);
    free (dev);
  }

  /* No buckets at all (nbuckets 0): nothing is read. */
  dev = calloc (1, 4096);
  if (!dev) abort ();
  prio_chain_seed ("empty-cache", 0, 0, 1, 0, 0, dev, 4096);
  free (dev);
}

int
main (int argc, char **argv)
{
  if (argc != 2) {
    fprintf (stderr, "usage: %s OUTDIR\n", argv[0]);
    return EXIT_FAILURE;
  }
  outdir = argv[1];
  sb_seeds ();
  bdev_seeds ();
  bkey_seeds ();
  node_seeds ();
  jset_seeds ();
  pset_seeds ();
  uuid_seeds ();
  journal_seeds ();
  prio_chain_seeds ();
  printf ("gen-seeds: wrote %u seeds under %s\n", nseeds, outdir);
  return EXIT_SUCCESS;
}
