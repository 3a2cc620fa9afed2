/* bcachefilter engine: the journal.
 *
 * Design
 * ------
 * bcache's journal (research/bcache.md §1.6): a ring of njournal_buckets
 * buckets at first_bucket + i, holding jsets padded to the block size and
 * never crossing a bucket.  Leaf inserts (writes and invalidations) are
 * journalled; replace inserts (cache-miss fills) are not.  Every entry also
 * carries the committed btree root, the uuid bucket and the head of the
 * prio chain, so the newest entry is where recovery starts.
 *
 * Keys are added to the open entry in memory while the caller holds the
 * btree lock for writing, so the journal's order is the btree's order
 * (replay must reproduce it: with overlapping extents, order is content).
 * The open entry is written after journal_delay_ms (the timer thread), at
 * once when a FLUSH/FUA waits for it, or when it is full.
 *
 * Writing an entry: flush the device (PREFLUSH: the data the keys point at
 * must be durable before the keys), then write the entry as a FUA write
 * (RWF_DSYNC), durable when it completes, as bcache does: one device
 * round trip instead of a write and a second flush, and on a device
 * with FUA no flush of everything else in its write cache.
 * The PREFLUSH is skipped when no key in the entry points at data: an
 * entry of whiteouts only (the invalidations a write to a cached range
 * makes durable before its backing write, DESIGN.md) depends on no other
 * write, and the metadata every entry names (root, prio chain, uuid
 * bucket) is flushed before it is published (btree_checkpoint,
 * alloc_prio_write, uuid_write), so no entry can name
 * metadata that is not durable.  On this host that is one
 * fdatasync (~0.2 ms) less on every write to a cached range.
 * Entries are written one at a time, in seq order, each only after the
 * previous one is durable — so after a crash the durable entries are a
 * prefix of the written ones and a gap can only mean corruption.
 *
 * Space: an entry may reuse a bucket only when every entry in it is older
 * than last_seq (what the committed btree already holds).  Ordinary
 * entries leave room for JOURNAL_RESERVE maximum-size entries, which only
 * metadata commits may use: a checkpoint, and the prio write a checkpoint
 * may need first when it runs short of btree buckets.  So the checkpoint
 * that empties the ring can always commit.  When an ordinary entry finds
 * no room, the writer runs a checkpoint (btree.c), which raises last_seq,
 * and tries again.
 *
 * Recovery (journal_read): every journal bucket is scanned block by block
 * for valid entries; the newest valid one gives root, prios, uuids and
 * last_seq; entries last_seq..newest must all be present (else the
 * journal is corrupt and open fails); their keys are replayed in order.
 * A torn or lost newest entry was never acknowledged as durable, so it is
 * simply absent.
 *
 * Locking: journal.lock protects all fields; the writer sets `writing`
 * and does its I/O without the lock.  journal.lock is taken inside
 * tree_lock and never held while taking tree_lock.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

int
journal_init (struct bcf_cache *c)
{
  struct journal *j = &c->journal;

  memset (j, 0, sizeof *j);
  pthread_mutex_init (&j->lock, NULL);
  pthread_cond_init (&j->wait, NULL);
  j->nbuckets = c->sb.njournal_buckets;
  j->max_entry_bytes = BCH_JSET_MAX_BYTES < c->bucket_bytes ?
                       BCH_JSET_MAX_BYTES : c->bucket_bytes;
  j->pending_cap = (j->max_entry_bytes - BCH_JSET_HEADER_SIZE) / 8;
  j->pending = calloc (j->pending_cap, 8);
  j->buf = bcf_buf_alloc (j->max_entry_bytes);
  j->seq = 1;
  j->last_seq = 1;
  if (!j->pending || !j->buf)
    return -ENOMEM;
  return 0;
}

void
journal_free (struct bcf_cache *c)
{
  struct journal *j = &c->journal;

  journal_replay_done (c);
  free (j->pending);
  if (j->buf)
    bcf_buf_free (j->buf, j->max_entry_bytes);
  j->pending = NULL;
  j->buf = NULL;
  pthread_mutex_destroy (&j->lock);
  pthread_cond_destroy (&j->wait);
}

uint64_t
journal_add_key_locked (struct bcf_cache *c, const struct ckey *k)
{
  struct journal *j = &c->journal;
  uint64_t seq = 0;
  uint8_t tmp[3 * 8];
  size_t bytes;

  pthread_mutex_lock (&j->lock);
  bytes = bkey_encode (ckey_bkey (k), tmp, sizeof tmp);
  if (!j->sealed && j->pending_words + bytes / 8 <= j->pending_cap) {
    memcpy (j->pending + j->pending_words, tmp, bytes);
    j->pending_words += bytes / 8;
    j->pending_dirty = true;
    if (ckey_has_ptr (k) && !ckey_is_check (k))
      j->pending_data = true;
    seq = j->seq;
  }
  pthread_mutex_unlock (&j->lock);
  return seq;
}

uint64_t
journal_seal_locked (struct bcf_cache *c)
{
  struct journal *j = &c->journal;
  uint64_t s;

  pthread_mutex_lock (&j->lock);
  if (j->pending_dirty) {
    /* The snapshot holds this entry's keys: no more keys may join it. */
    j->sealed = true;
    s = j->seq;
  }
  else
    s = j->seq - 1;
  pthread_mutex_unlock (&j->lock);
  return s;
}

void
journal_set_last_seq (struct bcf_cache *c, uint64_t last_seq)
{
  struct journal *j = &c->journal;

  pthread_mutex_lock (&j->lock);
  if (last_seq > j->last_seq)
    j->last_seq = last_seq;
  pthread_mutex_unlock (&j->lock);
}

unsigned
journal_used_percent (struct bcf_cache *c)
{
  struct journal *j = &c->journal;
  unsigned used = 0;

  pthread_mutex_lock (&j->lock);
  for (unsigned b = 0; b < j->nbuckets; b++)
    if (j->bucket_seq[b] >= j->last_seq)
      used++;
  pthread_mutex_unlock (&j->lock);
  return j->nbuckets ? used * 100 / j->nbuckets : 0;
}

static bool
bucket_reusable (const struct journal *j, unsigned b)
{
  return j->bucket_seq[b] < j->last_seq;
}

/* How many maximum-size entries fit from (bucket, offset) on, counting
 * the free buckets that follow; stops counting at `enough`.  Under
 * journal.lock. */
static unsigned
slots_from (struct bcf_cache *c, unsigned bucket, uint64_t offset,
            unsigned enough)
{
  struct journal *j = &c->journal;
  const uint64_t max = j->max_entry_bytes;
  unsigned n = (unsigned) ((c->bucket_bytes - offset) / max);

  for (unsigned k = 1; k < j->nbuckets && n < enough; k++) {
    if (!bucket_reusable (j, (bucket + k) % j->nbuckets))
      break;
    n += (unsigned) (c->bucket_bytes / max);
  }
  return n;
}

/* Entries that commit metadata (checkpoints, prio writes) may use the
 * last JOURNAL_RESERVE slots; ordinary entries may not, so a checkpoint
 * can always commit and empty the ring. */
#define JOURNAL_RESERVE 2

/* Where does an entry of len bytes go?  Moves to the next bucket if it
 * does not fit in this one.  -ENOSPC if there is no room (for ordinary
 * entries: no room outside the reserve).  Under journal.lock. */
static int
journal_place (struct bcf_cache *c, size_t len, bool meta,
               unsigned *bucket, uint64_t *offset)
{
  struct journal *j = &c->journal;

  if (j->cur_offset + len <= c->bucket_bytes) {
    *bucket = j->cur;
    *offset = j->cur_offset;
  }
  else {
    unsigned next = (j->cur + 1) % j->nbuckets;
    if (!bucket_reusable (j, next))
      return -ENOSPC;
    *bucket = next;
    *offset = 0;
  }
  if (!meta && slots_from (c, *bucket, *offset + len, JOURNAL_RESERVE) <
      JOURNAL_RESERVE)
    return -ENOSPC;
  return 0;
}

bool
journal_tight (struct bcf_cache *c)
{
  struct journal *j = &c->journal;
  bool tight;

  pthread_mutex_lock (&j->lock);
  tight = slots_from (c, j->cur, j->cur_offset, JOURNAL_RESERVE + 1) <
          JOURNAL_RESERVE + 1;
  pthread_mutex_unlock (&j->lock);
  return tight;
}

/* Write the open entry.  Called with journal.lock held and !writing;
 * returns with it held. */
static int
journal_write_locked (struct bcf_cache *c, bool meta)
{
  struct journal *j = &c->journal;
  struct bch_jset js = { 0 };
  size_t bytes, len;
  unsigned bucket;
  uint64_t offset, seq = j->seq, t0 = bcf_now_ns ();
  uint8_t *buf = j->buf;
  bool preflush = meta || j->pending_data;
  int r;

  bytes = bch_jset_bytes ((uint32_t) j->pending_words);
  len = (bytes + c->block_bytes - 1) / c->block_bytes * c->block_bytes;
  r = journal_place (c, len, meta, &bucket, &offset);
  if (r < 0)
    return r;

  js.magic = bch_jset_magic (&c->sb);
  js.seq = seq;
  js.version = BCACHE_JSET_VERSION;
  js.keys = (uint32_t) j->pending_words;
  /* A checkpoint that sealed this very entry sets last_seq = seq + 1;
   * an entry never claims to need nothing, itself included (replaying
   * keys the tree already holds is harmless: see btree.c). */
  js.last_seq = j->last_seq <= seq ? j->last_seq : seq;
  bkey_init (&js.uuid_bucket.key, 0, 0, 0);
  SET_KEY_PTRS (&js.uuid_bucket.key, 1);
  SET_KEY_SIZE (&js.uuid_bucket.key, c->bucket_sectors);
  js.uuid_bucket.key.ptr[0] =
    bucket_ptr (c, c->uuid_bucket, c->alloc.buckets[c->uuid_bucket].gen);
  memcpy (&js.btree_root.key, ckey_bkey (&c->committed_root), 16);
  js.btree_root.key.ptr[0] = c->committed_root.ptr;
  js.btree_level = (uint16_t) c->committed_level;
  pthread_mutex_lock (&c->alloc.lock);
  js.prio_bucket[0] = c->alloc.nprio ? c->alloc.prio_buckets[0] : 0;
  pthread_mutex_unlock (&c->alloc.lock);

  memset (buf, 0, len);
  memcpy (buf + BCH_JSET_HEADER_SIZE, j->pending, j->pending_words * 8);
  bch_jset_encode (&js, buf, len);

  /* The entry is ours now: new keys go to the next one. */
  j->writing = true;
  j->pending_words = 0;
  j->pending_dirty = false;
  j->pending_data = false;
  j->sealed = false;
  j->seq++;
  j->cur = bucket;
  j->cur_offset = offset + len;
  j->bucket_seq[bucket] = seq;
  pthread_mutex_unlock (&j->lock);

  r = preflush ? bcf_io_flush (c->io) : 0;
  if (r == 0)
    r = bcf_io_pwrite_fua (c->io, buf, len,
                           c->sb.d[bucket] * c->bucket_bytes + offset);

  pthread_mutex_lock (&j->lock);
  j->writing = false;
  if (r == 0) {
    /* Atomic: the dirty-write path reads it without the lock (a hint
     * whether an entry may still be pending: extent.c). */
    __atomic_store_n (&j->durable_seq, seq, __ATOMIC_RELAXED);
    j->writes++;
  }
  else {
    bcf_log (c, BCF_LOG_ERROR, "journal write (seq %" PRIu64 ") failed: %s; "
             "the cache is now read-only", seq, strerror (-r));
    c->failed = true;
  }
  pthread_cond_broadcast (&j->wait);
  bcf_time_record (c, &c->stats.journal_write, bcf_now_ns () - t0);
  return r;
}

/* Make every entry up to seq durable.  meta: the caller commits metadata
 * (holds ckpt_lock): write the open entry even if it holds no keys, and
 * use the journal's reserve.  An ordinary write that finds no room commits
 * the btree (a checkpoint) and tries again. */
static int
flush_seq (struct bcf_cache *c, uint64_t seq, bool meta)
{
  struct journal *j = &c->journal;
  unsigned checkpoints = 0;
  int r = 0;

  pthread_mutex_lock (&j->lock);
  for (;;) {
    /* Durable first: what is on disk stays so after a later failure, and
     * a caller waiting only for entries written before it (a durable
     * invalidation waits for its leaf's jseq) must not fail for them. */
    if (j->durable_seq >= seq)
      break;
    if (c->failed) {
      r = -EIO;
      break;
    }
    if (j->writing) {
      pthread_cond_wait (&j->wait, &j->lock);
      continue;
    }
    if (!meta && !j->pending_dirty)
      break;          /* nothing in the open entry: all before is durable */
    r = journal_write_locked (c, meta);
    if (r == -ENOSPC && !meta && checkpoints++ < 3) {
      pthread_mutex_unlock (&j->lock);
      pthread_mutex_lock (&c->ckpt_lock);
      r = btree_checkpoint (c);
      pthread_mutex_unlock (&c->ckpt_lock);
      pthread_mutex_lock (&j->lock);
      if (r == 0)
        continue;
    }
    if (r < 0)
      break;
  }
  pthread_mutex_unlock (&j->lock);
  return r;
}

int
journal_flush_seq (struct bcf_cache *c, uint64_t seq)
{
  return flush_seq (c, seq, false);
}

int
journal_meta (struct bcf_cache *c)
{
  uint64_t seq;

  pthread_mutex_lock (&c->journal.lock);
  seq = c->journal.seq;
  pthread_mutex_unlock (&c->journal.lock);
  return flush_seq (c, seq, true);
}

int
journal_make_room (struct bcf_cache *c)
{
  uint64_t seq;

  pthread_mutex_lock (&c->journal.lock);
  seq = c->journal.seq;
  pthread_mutex_unlock (&c->journal.lock);
  return flush_seq (c, seq, false);
}

/* ---- recovery ---------------------------------------------------------------- */

struct jentry {
  uint64_t seq;
  unsigned bucket;
  uint64_t offset;
  size_t len;
  struct bch_jset hdr;
  uint64_t *keys;               /* copied key words */
};

static int
cmp_jentry (const void *a, const void *b)
{
  const struct jentry *x = a, *y = b;
  return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Scan one journal bucket (bch_journal_bucket_walk), keeping a copy of
 * every valid entry. */
struct scan_ctx {
  unsigned bucket;
  struct jentry **ents;
  size_t *n, *cap;
  int err;
};

static int
keep_entry (const struct bch_jset *js, size_t offset, size_t bytes,
            void *opaque)
{
  struct scan_ctx *s = opaque;
  struct jentry *e;

  if (*s->n == *s->cap) {
    size_t nc = *s->cap ? *s->cap * 2 : 64;
    void *p = realloc (*s->ents, nc * sizeof **s->ents);
    if (!p)
      return s->err = -ENOMEM;
    *s->ents = p;
    *s->cap = nc;
  }
  e = &(*s->ents)[*s->n];
  *e = (struct jentry) {
    .seq = js->seq, .bucket = s->bucket, .offset = offset, .len = bytes,
    .hdr = *js, .keys = malloc (js->keys * 8 + 1),
  };
  if (!e->keys)
    return s->err = -ENOMEM;
  memcpy (e->keys, js->key_words, js->keys * 8);
  e->hdr.key_words = NULL;
  (*s->n)++;
  return 0;
}

static int
scan_bucket (struct bcf_cache *c, unsigned b, uint8_t *buf,
             struct jentry **ents, size_t *n, size_t *cap)
{
  struct scan_ctx s = { .bucket = b, .ents = ents, .n = n, .cap = cap };
  int r;

  r = bcf_io_pread (c->io, buf, c->bucket_bytes,
                    c->sb.d[b] * c->bucket_bytes);
  if (r < 0)
    return r;
  if (bch_journal_bucket_walk (buf, c->bucket_bytes, c->block_bytes,
                               bch_jset_magic (&c->sb), keep_entry, &s, NULL)
      != BCH_OK)
    return s.err ? s.err : -EIO;
  return 0;
}

static int
replay_keys (struct bcf_cache *c, const struct jentry *e,
             int (*cb) (struct bcf_cache *, const struct ckey *, uint64_t,
                        void *),
             void *opaque, uint64_t *nkeys, char *err, size_t errlen)
{
  const uint8_t *p = (const uint8_t *) e->keys;
  size_t w = 0;

  while (w < e->hdr.keys) {
    struct bkey_padded b;
    struct ckey k;
    struct bch_diag d;
    int r;

    const struct bch_key_geometry geo = {
      .nbuckets = c->sb.nbuckets, .bucket_sectors = c->bucket_sectors,
      .first_bucket = c->sb.first_bucket, .nr_in_set = 1,
    };

    if (bkey_decode (p + 8 * w, (e->hdr.keys - w) * 8, &b, &d) != BCH_OK ||
        bkey_validate (&b.key, e->hdr.keys - w, 0, &geo, &d) != BCH_OK) {
      snprintf (err, errlen, "journal entry %" PRIu64 ": bad key: %s",
                e->seq, d.msg);
      return -EUCLEAN;
    }
    w += bkey_u64s (&b.key);
    if (!ckey_from_bkey (&b.key, &k)) {
      snprintf (err, errlen, "journal entry %" PRIu64 ": key with several "
                "pointers (multi-device cache sets are not supported)",
                e->seq);
      return -ENOTSUP;
    }
    if ((r = cb (c, &k, e->seq, opaque)) < 0) {
      snprintf (err, errlen, "replaying journal entry %" PRIu64 ": %s",
                e->seq, strerror (-r));
      return r;
    }
    (*nkeys)++;
  }
  return 0;
}

int
journal_read (struct bcf_cache *c, struct journal_replay *rp, char *err,
              size_t errlen)
{
  struct journal *j = &c->journal;
  struct jentry *ents = NULL;
  size_t n = 0, cap = 0, first;
  const struct jentry *newest;
  uint8_t *buf;
  int r = 0;

  memset (rp, 0, sizeof *rp);
  buf = bcf_buf_alloc (c->bucket_bytes);
  if (!buf)
    return -ENOMEM;
  for (unsigned b = 0; b < j->nbuckets && r == 0; b++)
    r = scan_bucket (c, b, buf, &ents, &n, &cap);
  bcf_buf_free (buf, c->bucket_bytes);
  if (r < 0) {
    snprintf (err, errlen, "reading the journal: %s", strerror (-r));
    goto fail;
  }
  if (n == 0) {
    snprintf (err, errlen, "the journal holds no valid entry (CACHE_SYNC is "
              "set, so there must be one): the cache is corrupt");
    r = -EUCLEAN;
    goto fail;
  }
  qsort (ents, n, sizeof *ents, cmp_jentry);
  newest = &ents[n - 1];

  /* Entries last_seq..newest must all be there, each once. */
  for (first = n - 1; first > 0 && ents[first - 1].seq >= newest->hdr.last_seq;)
    first--;
  if (ents[first].seq > newest->hdr.last_seq) {
    snprintf (err, errlen, "journal entries %" PRIu64 "..%" PRIu64
              " are missing (newest entry %" PRIu64 " needs them): the "
              "journal is corrupt", newest->hdr.last_seq,
              ents[first].seq - 1, newest->seq);
    r = -EUCLEAN;
    goto fail;
  }
  for (size_t i = first + 1; i < n; i++)
    if (ents[i].seq != ents[i - 1].seq + 1) {
      snprintf (err, errlen, "journal entry %" PRIu64 " is missing (found "
                "%" PRIu64 " and %" PRIu64 "): the journal is corrupt",
                ents[i - 1].seq + 1, ents[i - 1].seq, ents[i].seq);
      r = -EUCLEAN;
      goto fail;
    }

  rp->root = newest->hdr.btree_root;
  rp->uuid_bucket = newest->hdr.uuid_bucket;
  rp->root_level = newest->hdr.btree_level;
  rp->prio_head = newest->hdr.prio_bucket[0];
  rp->first_seq = ents[first].seq;
  rp->last_seq = newest->seq;
  rp->entries = n - first;

  /* Continue after the newest entry. */
  j->seq = newest->seq + 1;
  j->durable_seq = newest->seq;
  j->last_seq = newest->hdr.last_seq;
  j->cur = newest->bucket;
  j->cur_offset = newest->offset + newest->len;
  for (size_t i = 0; i < n; i++)
    if (ents[i].seq > j->bucket_seq[ents[i].bucket])
      j->bucket_seq[ents[i].bucket] = ents[i].seq;

  j->replay = ents;
  j->replay_n = n;
  j->replay_first = first;
  return 0;

 fail:
  for (size_t i = 0; i < n; i++)
    free (ents[i].keys);
  free (ents);
  return r;
}

int
journal_replay (struct bcf_cache *c,
                int (*cb) (struct bcf_cache *c, const struct ckey *k,
                           uint64_t seq, void *opaque),
                void *opaque, uint64_t *nkeys, char *err, size_t errlen)
{
  struct journal *j = &c->journal;
  struct jentry *ents = j->replay;
  int r = 0;

  *nkeys = 0;
  for (size_t i = j->replay_first; i < j->replay_n && r == 0; i++)
    r = replay_keys (c, &ents[i], cb, opaque, nkeys, err, errlen);
  journal_replay_done (c);
  return r;
}

void
journal_replay_done (struct bcf_cache *c)
{
  struct journal *j = &c->journal;
  struct jentry *ents = j->replay;

  for (size_t i = 0; i < j->replay_n; i++)
    free (ents[i].keys);
  free (ents);
  j->replay = NULL;
  j->replay_n = j->replay_first = 0;
}
