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
 * (journal_scan, which bcf_journal_inspect gives the tools too); the
 * newest valid entry gives root, prios, uuids and last_seq; entries
 * last_seq..newest must all be present, once, with good keys, else the
 * journal is corrupt and open fails (journal_judge: the one rule, so
 * bcachefilter-show and the open never disagree); their keys are
 * replayed in order.  A torn or lost newest entry was never acknowledged
 * as durable, so it is simply absent; but blocks that carry the magic and
 * do not decode are judged too (judge_bad: a torn tail, stale leftovers,
 * or corruption between valid entries), and the open logs a warning
 * saying what it skipped, which bcf_cache_fsck reports again.  The scan
 * and the replay report their progress (opts.progress) once per bucket
 * and once per entry: after a crash the replay can take most of an
 * open.
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

/* The reserve for metadata commits: JOURNAL_RESERVE (engine.h). */

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
journal_room (struct bcf_cache *c, unsigned n)
{
  struct journal *j = &c->journal;
  bool room;

  pthread_mutex_lock (&j->lock);
  room = slots_from (c, j->cur, j->cur_offset, n) >= n;
  pthread_mutex_unlock (&j->lock);
  return room;
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
  /* An entry never claims to need nothing, itself included (the kernel
   * needs last_seq <= seq).  A checkpoint writes the entry it sealed
   * before its commit (journal_flush_sealed), so this never makes a
   * recovery replay keys a committed snapshot holds. */
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
  __atomic_store_n (&j->seq, seq + 1, __ATOMIC_RELEASE); /* journal_open_seq */
  j->cur = bucket;
  j->cur_offset = offset + len;
  j->bucket_seq[bucket] = seq;
  pthread_mutex_unlock (&j->lock);

  r = 0;
  if (preflush) {
    uint64_t tf = bcf_now_ns ();

    r = bcf_io_flush (c->io);
    bcf_time_record (c, &c->stats.journal_preflush, bcf_now_ns () - tf);
  }
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

/* A checkpoint that frees journal space, under ckpt_lock.  The open holds
 * that lock across all of super_open, alone (no background thread, no
 * client yet), and its own metadata work can fill the journal (the
 * write-intent recovery journals a whiteout per clean key it drops, up
 * to a region's worth): then the checkpoint is made under the open's
 * hold, since taking the lock again would wait for ever
 * (test_intent_recover_fills_journal). */
static int
checkpoint_for_room (struct bcf_cache *c)
{
  int r;

  if (c->ckpt_held_by_open)
    return btree_checkpoint (c);
  pthread_mutex_lock (&c->ckpt_lock);
  r = btree_checkpoint (c);
  pthread_mutex_unlock (&c->ckpt_lock);
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
      r = checkpoint_for_room (c);
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
journal_flush_sealed (struct bcf_cache *c, uint64_t seq)
{
  return flush_seq (c, seq, true);
}

/* Without the lock: every write, trim and zero reads it as it returns
 * (request.c, ACKED).  A caller that added a key under the lock reads
 * that key's seq or a later one (the store under the lock came before
 * its unlock, which came before this load). */
uint64_t
journal_open_seq (struct bcf_cache *c)
{
  return __atomic_load_n (&c->journal.seq, __ATOMIC_ACQUIRE);
}

int
journal_meta (struct bcf_cache *c)
{
  return flush_seq (c, journal_open_seq (c), true);
}

int
journal_make_room (struct bcf_cache *c)
{
  return flush_seq (c, journal_open_seq (c), false);
}

/* ---- reading the journal: one scan, one rule ---------------------------------- */

/* Builds a struct bcf_journal_scan (bcachefilter/inspect.h) while
 * bch_journal_bucket_scan walks one bucket after the other. */
struct scan_ctx {
  struct bcf_journal_scan *s;
  size_t cap;
  unsigned index;               /* the journal bucket being walked */
  uint64_t bucket;
  const uint8_t *buf;           /* ... its bytes */
  size_t bucket_bytes;
  struct bch_key_geometry geo;
  int err;
};

static struct bcf_journal_entry *
scan_add (struct scan_ctx *x, size_t offset)
{
  struct bcf_journal_scan *s = x->s;
  struct bcf_journal_entry *e;

  if (s->n == x->cap) {
    size_t nc = x->cap ? 2 * x->cap : 64;
    void *p = realloc (s->entries, nc * sizeof *s->entries);

    if (!p) {
      x->err = -ENOMEM;
      return NULL;
    }
    s->entries = p;
    x->cap = nc;
  }
  e = &s->entries[s->n++];
  memset (e, 0, sizeof *e);
  e->index = x->index;
  e->bucket = x->bucket;
  e->offset = offset;
  return e;
}

/* Decode the key at word *w of a valid entry and check that it points
 * inside the cache (what replay will insert); advances *w. */
static enum bch_status
entry_key (const struct bcf_journal_entry *e, size_t *w,
           const struct bch_key_geometry *geo, struct bkey_padded *b,
           struct bch_diag *d)
{
  const uint8_t *p = (const uint8_t *) e->words;
  size_t left = e->hdr.keys - *w;
  enum bch_status st = bkey_decode (p + 8 * *w, left * 8, b, d);

  if (st == BCH_OK)
    st = bkey_validate (&b->key, left, 0, geo, d);
  if (st == BCH_OK)
    *w += bkey_u64s (&b->key);
  return st;
}

/* Count the keys of an entry up to the first bad one (noted in msg). */
static void
count_keys (struct bcf_journal_entry *e, const struct bch_key_geometry *geo)
{
  size_t w = 0;

  while (w < e->hdr.keys) {
    struct bkey_padded b;
    struct bch_diag d;
    size_t at = w;

    if (entry_key (e, &w, geo, &b, &d) != BCH_OK) {
      snprintf (e->msg, sizeof e->msg, "bad key at word %zu: %s", at, d.msg);
      return;
    }
    e->nkeys++;
  }
}

static int
keep_valid (const struct bch_jset *js, size_t offset, size_t bytes,
            void *opaque)
{
  struct scan_ctx *x = opaque;
  struct bcf_journal_entry *e = scan_add (x, offset);

  if (!e)
    return -1;
  e->bytes = bytes;
  e->hdr = *js;
  e->words = malloc ((size_t) js->keys * 8 + 1);
  if (!e->words) {
    x->err = -ENOMEM;
    return -1;
  }
  memcpy (e->words, js->key_words, (size_t) js->keys * 8);
  e->hdr.key_words = e->words;
  count_keys (e, &x->geo);
  x->s->valid++;
  return 0;
}

static int
keep_bad (size_t offset, const struct bch_diag *why, void *opaque)
{
  const struct scan_ctx *x = opaque;
  struct bcf_journal_entry *e = scan_add (opaque, offset);

  if (!e)
    return -1;
  e->bad = true;
  /* The seq field (byte 16 of a jset), unchecked: the block carries the
   * magic, so the header is likely the entry's, if not its keys. */
  if (offset + 24 <= x->bucket_bytes)
    e->claimed_seq = bch_get_le64 (x->buf + offset + 16);
  snprintf (e->msg, sizeof e->msg, "%s", why->msg);
  return 0;
}

static int
cmp_u64 (const void *a, const void *b)
{
  const uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;
  return x < y ? -1 : x > y;
}

bool
bcf_journal_needed (const struct bcf_journal_scan *s,
                    const struct bcf_journal_entry *e)
{
  return !e->bad && s->newest && e->hdr.seq >= s->newest->hdr.last_seq;
}

/* The seqs of the entries replay needs, sorted: gaps and duplicates. */
static void
find_gaps (struct bcf_journal_scan *s, const uint64_t *seqs, size_t n)
{
  uint64_t expect = s->newest->hdr.last_seq;

  for (size_t i = 0; i < n; i++) {
    if (i > 0 && seqs[i] == seqs[i - 1]) {
      if (s->ndups < BCF_JOURNAL_LISTED &&
          (s->ndups == 0 || s->dups[s->ndups - 1] != seqs[i]))
        s->dups[s->ndups++] = seqs[i];
      continue;
    }
    if (seqs[i] > expect) {
      if (s->ngaps < BCF_JOURNAL_LISTED) {
        s->gaps[s->ngaps].from = expect;
        s->gaps[s->ngaps].to = seqs[i] - 1;
      }
      s->ngaps++;
    }
    expect = seqs[i] + 1;
  }
}

/* The verdict in words, the one message the engine's open and the tools
 * give. */
static void
describe (struct bcf_journal_scan *s)
{
  const struct bcf_journal_entry *nw = s->newest;
  size_t len = 0, size = sizeof s->msg;

  if (s->ngaps) {
    s->status = BCF_JOURNAL_GAP;
    len += (size_t) snprintf (s->msg, size, "journal entr%s ",
                              s->ngaps == 1 && s->gaps[0].from == s->gaps[0].to
                              ? "y" : "ies");
    for (size_t i = 0; i < s->ngaps && i < BCF_JOURNAL_LISTED && len < size;
         i++) {
      if (s->gaps[i].from == s->gaps[i].to)
        len += (size_t) snprintf (s->msg + len, size - len, "%s%" PRIu64,
                                  i ? ", " : "", s->gaps[i].from);
      else
        len += (size_t) snprintf (s->msg + len, size - len,
                                  "%s%" PRIu64 "-%" PRIu64, i ? ", " : "",
                                  s->gaps[i].from, s->gaps[i].to);
    }
    if (len < size)
      snprintf (s->msg + len, size - len, "%s missing: the newest entry, %"
                PRIu64 ", needs every entry from its last_seq %" PRIu64
                " on; the journal is corrupt",
                s->ngaps > BCF_JOURNAL_LISTED ? ", ..." : "", nw->hdr.seq,
                nw->hdr.last_seq);
  }
  else if (s->ndups) {
    s->status = BCF_JOURNAL_DUPLICATE;
    snprintf (s->msg, size, "journal entry %" PRIu64 " is present more than "
              "once: the journal is corrupt", s->dups[0]);
  }
  else if (s->bad_key) {
    s->status = BCF_JOURNAL_BAD_KEY;
    snprintf (s->msg, size, "journal entry %" PRIu64 " (bucket %" PRIu64
              " offset %zu): %s; the journal is corrupt",
              s->bad_key->hdr.seq, s->bad_key->bucket, s->bad_key->offset,
              s->bad_key->msg);
  }
  else
    s->status = BCF_JOURNAL_OK;
}

/* Judge the bad blocks by the seq they claim (bcachefilter/inspect.h),
 * and say what was skipped in s->skipped. */
static void
judge_bad (struct bcf_journal_scan *s)
{
  const struct bcf_journal_entry *torn = NULL, *corrupt = NULL;
  uint64_t oldest = UINT64_MAX;
  size_t len = 0;

  for (size_t i = 0; i < s->n; i++)
    if (!s->entries[i].bad && s->entries[i].hdr.seq < oldest)
      oldest = s->entries[i].hdr.seq;
  for (size_t i = 0; i < s->n; i++) {
    struct bcf_journal_entry *e = &s->entries[i];
    bool copy = false;

    if (!e->bad)
      continue;
    for (size_t k = 0; k < s->n && !copy; k++)
      copy = !s->entries[k].bad && s->entries[k].hdr.seq == e->claimed_seq;
    if (!s->newest || e->claimed_seq > s->newest->hdr.seq || copy) {
      e->why = BCF_JOURNAL_BAD_TORN;
      s->ntorn++;
      if (!torn || e->claimed_seq > torn->claimed_seq)
        torn = e;
    }
    else if (e->claimed_seq < oldest) {
      e->why = BCF_JOURNAL_BAD_STALE;
      s->nstale++;
    }
    else {
      e->why = BCF_JOURNAL_BAD_CORRUPT;
      s->ncorrupt++;
      if (!corrupt)
        corrupt = e;
    }
  }
  s->skipped[0] = '\0';
  if (corrupt)
    len = (size_t) snprintf (s->skipped, sizeof s->skipped,
                             "%zu corrupt journal entr%s skipped, the first "
                             "claiming seq %" PRIu64 " (bucket %" PRIu64
                             " offset %zu: %s), with valid entries older and "
                             "newer: it was durable once, so the journal is "
                             "damaged", s->ncorrupt,
                             s->ncorrupt == 1 ? "y" : "ies",
                             corrupt->claimed_seq, corrupt->bucket,
                             corrupt->offset, corrupt->msg);
  if (torn && len < sizeof s->skipped)
    snprintf (s->skipped + len, sizeof s->skipped - len,
              "%s%zu torn journal entr%s skipped, the newest claiming seq %"
              PRIu64 " (bucket %" PRIu64 " offset %zu: %s): a write cut "
              "short by a crash, never acknowledged; replay starts from "
              "the newest valid entry%s%" PRIu64 "%s", len ? "; " : "",
              s->ntorn, s->ntorn == 1 ? "y" : "ies", torn->claimed_seq,
              torn->bucket, torn->offset, torn->msg,
              s->newest ? ", " : "", s->newest ? s->newest->hdr.seq : 0,
              s->newest ? "" : " (none)");
}

/* The one rule (bcachefilter/inspect.h): the newest valid entry names
 * the oldest entry replay needs; every entry from there on must be there
 * once, with good keys.  Returns 0 or -ENOMEM. */
static int
journal_judge (struct bcf_journal_scan *s)
{
  uint64_t *seqs;
  size_t n = 0;

  for (size_t i = 0; i < s->n; i++) {
    const struct bcf_journal_entry *e = &s->entries[i];
    if (!e->bad && (!s->newest || e->hdr.seq > s->newest->hdr.seq))
      s->newest = e;
  }
  judge_bad (s);
  if (!s->newest) {
    s->status = BCF_JOURNAL_EMPTY;
    snprintf (s->msg, sizeof s->msg, "the journal holds no valid entry "
              "(CACHE_SYNC is set, so there must be one): the journal is "
              "corrupt");
    return 0;
  }
  seqs = malloc (s->valid * sizeof *seqs);
  if (!seqs)
    return -ENOMEM;
  for (size_t i = 0; i < s->n; i++) {
    const struct bcf_journal_entry *e = &s->entries[i];
    if (!bcf_journal_needed (s, e))
      continue;
    seqs[n++] = e->hdr.seq;
    if (e->msg[0] && !s->bad_key)
      s->bad_key = e;
  }
  qsort (seqs, n, sizeof *seqs, cmp_u64);
  find_gaps (s, seqs, n);
  free (seqs);
  describe (s);
  return 0;
}

int
journal_scan (struct bcf_io *io, const struct bch_sb *sb,
              struct bcf_journal_scan *s,
              const struct bcf_cache_opts *progress)
{
  const uint64_t bucket_sectors = bch_sb_bucket_sectors (sb);
  const size_t bucket_bytes = (size_t) bucket_sectors << BCH_SECTOR_SHIFT;
  const unsigned block = (unsigned) sb->block_size << BCH_SECTOR_SHIFT;
  const unsigned nj = sb->njournal_buckets < BCH_SB_JOURNAL_BUCKETS
                      ? sb->njournal_buckets : BCH_SB_JOURNAL_BUCKETS;
  struct scan_ctx x = {
    .s = s,
    .geo = { .nbuckets = sb->nbuckets, .bucket_sectors = bucket_sectors,
             .first_bucket = sb->first_bucket, .nr_in_set = sb->nr_in_set },
  };
  uint8_t *buf;
  int r = 0;

  memset (s, 0, sizeof *s);
  buf = bcf_buf_alloc (bucket_bytes);
  if (!buf)
    return -ENOMEM;
  for (unsigned i = 0; i < nj && r == 0; i++) {
    open_progress (progress, BCF_OPEN_JOURNAL, i, nj);
    x.index = i;
    x.bucket = sb->d[i];
    x.buf = buf;
    x.bucket_bytes = bucket_bytes;
    r = bcf_io_pread (io, buf, bucket_bytes, sb->d[i] * bucket_bytes);
    if (r == 0 &&
        bch_journal_bucket_scan (buf, bucket_bytes, block, bch_jset_magic (sb),
                                 keep_valid, keep_bad, &x, NULL) != BCH_OK)
      r = x.err ? x.err : -EIO;
  }
  bcf_buf_free (buf, bucket_bytes);
  if (r < 0)
    return r;
  open_progress (progress, BCF_OPEN_JOURNAL, nj, nj);
  return journal_judge (s);
}

void
bcf_journal_scan_free (struct bcf_journal_scan *s)
{
  for (size_t i = 0; i < s->n; i++)
    free (s->entries[i].words);
  free (s->entries);
  memset (s, 0, sizeof *s);
}

/* ---- recovery ---------------------------------------------------------------- */

static int
cmp_entry_seq (const void *a, const void *b)
{
  const struct bcf_journal_entry *x = *(const struct bcf_journal_entry *const *) a;
  const struct bcf_journal_entry *y = *(const struct bcf_journal_entry *const *) b;
  return x->hdr.seq < y->hdr.seq ? -1 : x->hdr.seq > y->hdr.seq;
}

/* The entries replay needs, in seq order, into j->replay_order. */
static int
order_for_replay (struct journal *j)
{
  const struct bcf_journal_scan *s = j->replay;
  size_t n = 0;

  j->replay_order = malloc ((s->valid ? s->valid : 1)
                            * sizeof *j->replay_order);
  if (!j->replay_order)
    return -ENOMEM;
  for (size_t i = 0; i < s->n; i++)
    if (bcf_journal_needed (s, &s->entries[i]))
      j->replay_order[n++] = &s->entries[i];
  qsort (j->replay_order, n, sizeof *j->replay_order, cmp_entry_seq);
  j->replay_n = n;
  return 0;
}

/* Continue writing after the newest entry; note the newest entry in each
 * journal bucket, for reuse. */
static void
continue_after (struct journal *j, const struct bcf_journal_scan *s)
{
  const struct bcf_journal_entry *nw = s->newest;

  j->seq = nw->hdr.seq + 1;
  j->durable_seq = nw->hdr.seq;
  j->last_seq = nw->hdr.last_seq;
  j->cur = nw->index;
  j->cur_offset = nw->offset + nw->bytes;
  for (size_t i = 0; i < s->n; i++) {
    const struct bcf_journal_entry *e = &s->entries[i];
    if (!e->bad && e->hdr.seq > j->bucket_seq[e->index])
      j->bucket_seq[e->index] = e->hdr.seq;
  }
}

int
journal_read (struct bcf_cache *c, struct journal_replay *rp, char *err,
              size_t errlen)
{
  struct journal *j = &c->journal;
  const struct bcf_journal_entry *nw;
  int r;

  memset (rp, 0, sizeof *rp);
  j->replay = calloc (1, sizeof *j->replay);
  if (!j->replay)
    return -ENOMEM;
  if ((r = journal_scan (c->io, &c->sb, j->replay, &c->opts)) < 0) {
    snprintf (err, errlen, "reading the journal: %s", strerror (-r));
    goto fail;
  }
  if (j->replay->skipped[0])
    bcf_log (c, BCF_LOG_WARN, "%s: journal: %s", bcf_io_path (c->io),
             j->replay->skipped);
  j->ncorrupt = j->replay->ncorrupt;
  snprintf (j->skipped, sizeof j->skipped, "%s", j->replay->skipped);
  if (j->replay->status != BCF_JOURNAL_OK) {
    snprintf (err, errlen, "%s", j->replay->msg);
    r = -EUCLEAN;
    goto fail;
  }
  if ((r = order_for_replay (j)) < 0)
    goto fail;
  nw = j->replay->newest;
  rp->root = nw->hdr.btree_root;
  rp->uuid_bucket = nw->hdr.uuid_bucket;
  rp->root_level = nw->hdr.btree_level;
  rp->prio_head = nw->hdr.prio_bucket[0];
  rp->first_seq = nw->hdr.last_seq;
  rp->last_seq = nw->hdr.seq;
  rp->entries = j->replay_n;
  continue_after (j, j->replay);
  return 0;

 fail:
  journal_replay_done (c);
  return r;
}

static int
replay_keys (struct bcf_cache *c, const struct bcf_journal_entry *e,
             int (*cb) (struct bcf_cache *, const struct ckey *, uint64_t,
                        void *),
             void *opaque, uint64_t *nkeys, char *err, size_t errlen)
{
  const struct bch_key_geometry geo = {
    .nbuckets = c->sb.nbuckets, .bucket_sectors = c->bucket_sectors,
    .first_bucket = c->sb.first_bucket, .nr_in_set = c->sb.nr_in_set,
  };
  size_t w = 0;

  while (w < e->hdr.keys) {
    struct bkey_padded b;
    struct ckey k;
    struct bch_diag d;
    int r;

    /* journal_judge checked every key already: this cannot fail. */
    if (entry_key (e, &w, &geo, &b, &d) != BCH_OK) {
      snprintf (err, errlen, "journal entry %" PRIu64 ": bad key: %s",
                e->hdr.seq, d.msg);
      return -EUCLEAN;
    }
    if (!ckey_from_bkey (&b.key, &k)) {
      snprintf (err, errlen, "journal entry %" PRIu64 ": key with several "
                "pointers (multi-device cache sets are not supported)",
                e->hdr.seq);
      return -ENOTSUP;
    }
    if ((r = cb (c, &k, e->hdr.seq, opaque)) < 0) {
      snprintf (err, errlen, "replaying journal entry %" PRIu64 ": %s",
                e->hdr.seq, strerror (-r));
      return r;
    }
    (*nkeys)++;
  }
  return 0;
}

int
journal_replay (struct bcf_cache *c,
                int (*cb) (struct bcf_cache *c, const struct ckey *k,
                           uint64_t seq, void *opaque),
                void *opaque, uint64_t *nkeys, char *err, size_t errlen)
{
  struct journal *j = &c->journal;
  uint64_t total = 0, done = 0;
  int r = 0;

  /* Progress in keys: entries differ in size.  Needed entries hold no
   * bad key (journal_judge), so nkeys is what replay_keys feeds. */
  for (size_t i = 0; i < j->replay_n; i++)
    total += j->replay_order[i]->nkeys;
  open_progress (&c->opts, BCF_OPEN_REPLAY, 0, total);
  *nkeys = 0;
  for (size_t i = 0; i < j->replay_n && r == 0; i++) {
    r = replay_keys (c, j->replay_order[i], cb, opaque, nkeys, err, errlen);
    done += j->replay_order[i]->nkeys;
    if (r == 0)
      open_progress (&c->opts, BCF_OPEN_REPLAY, done, total);
  }
  journal_replay_done (c);
  return r;
}

void
journal_replay_done (struct bcf_cache *c)
{
  struct journal *j = &c->journal;

  if (j->replay) {
    bcf_journal_scan_free (j->replay);
    free (j->replay);
  }
  free (j->replay_order);
  j->replay = NULL;
  j->replay_order = NULL;
  j->replay_n = 0;
}
