/* bcachefilter engine: the state shared by the core modules.
 *
 * Design
 * ------
 * struct bcf_cache is one cache set of one device.  Each module owns a
 * part of it (alloc: buckets and free lists; btree: nodes; journal: the
 * journal ring; gc: marks) and the functions declared here are how the
 * modules call each other.
 *
 * Locking (the whole engine; each module's header comment refines it)
 * -------
 *   tree_lock (rwlock)      the btree: shape, every node's key sets, the
 *                           node cache.  Readers: lookups.  Writers:
 *                           inserts, splits, checkpoint snapshots, GC
 *                           slices.  NEVER held across device or backing
 *                           I/O, and never taken while holding any of the
 *                           locks below.
 *   journal.lock (mutex)    the pending journal entry, sequence numbers,
 *                           ring space.  Taken inside tree_lock (inserts
 *                           add their key to the journal while holding the
 *                           tree lock, so journal order == tree order).
 *   alloc.lock (mutex)      bucket array, free lists, open buckets.  Taken
 *                           inside tree_lock or journal.lock, never around
 *                           them.
 *   ckpt_lock (mutex)       serialises checkpoints and prio writes (both
 *                           write metadata and then a journal entry that
 *                           points at it); held across I/O, taken before
 *                           any of the above.
 *   super_lock (mutex)      the superblock's changes while open (the
 *                           write-intent bit, abandon) and their writes;
 *                           held across that write, taken inside
 *                           ckpt_lock or intent.sb_lock, never around
 *                           another lock.  Not ckpt_lock: the bit's
 *                           write must not wait for a checkpoint's I/O
 *                           (every write into an unmarked region waits
 *                           for the bit).
 *   stats                   atomics; the time stats under
 *                           stats.time_lock (a leaf lock).
 *   inflight                sharded atomics (request.c counts, GC reads).
 */
#ifndef BCACHEFILTER_ENGINE_H
#define BCACHEFILTER_ENGINE_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/format.h"
#include "bcachefilter/inspect.h"
#include "bset.h"
#include "io.h"
#include "util.h"

struct bcf_cache;
struct btree_node;

/* ---- Buckets and the allocator (alloc.c) --------------------------------- */

enum gc_mark {
  GC_MARK_FREE = 0,         /* nothing live */
  GC_MARK_RECLAIMABLE = 1,  /* clean cached data */
  GC_MARK_DIRTY = 2,        /* dirty data: never invalidated */
  GC_MARK_METADATA = 3,     /* btree, prio, uuid, journal */
};

enum alloc_reserve {
  RESERVE_BTREE = 0,
  RESERVE_PRIO,
  RESERVE_MOVINGGC,
  RESERVE_NONE,
  RESERVE_NR,
};

struct bucket {
  uint8_t gen;              /* current generation */
  uint8_t disk_gen;         /* generation persisted in the prio buckets */
  uint8_t last_gc;          /* oldest gen still referenced (from GC) */
  uint8_t mark;             /* enum gc_mark */
  uint16_t prio;
  uint8_t state;            /* BUCKET_* below */
  uint8_t gc_flags;         /* GC bookkeeping (gc.c; BUCKET_DIRTIED) */
  uint16_t pin;             /* data writes in flight into the bucket */
  uint32_t sectors_used;
};

enum {
  BUCKET_AVAILABLE = 0,     /* holds data or nothing; may be invalidated */
  BUCKET_FREE_INC,          /* invalidated, gen not yet persisted */
  BUCKET_FREE,              /* on a free list, gen persisted */
  BUCKET_OPEN,              /* being filled with data */
  BUCKET_IN_USE,            /* allocated: metadata, or a closed data bucket */
};

struct fifo {
  uint64_t *data;
  size_t size, front, nr;
};

struct open_bucket {
  uint64_t bucket;          /* bucket number, or UINT64_MAX if none */
  uint32_t sectors_free;    /* sectors left to append */
  bool dirty;               /* holds dirty data */
};

#define NR_OPEN_BUCKETS 4
#define BCF_INFLIGHT_SHARDS 16      /* shards of bcf_cache.inflight */

/* One shard of the in-flight count (bcf_inflight_enter, gc.c), padded to
 * a cache line.  Not declared aligned: struct bcf_cache comes from
 * calloc, which promises 16 bytes, so a line may hold parts of two
 * shards, never of three. */
struct bcf_inflight {
  atomic_int_fast64_t n;
  atomic_uint_fast64_t entered; /* ever: bcf_cache_requests (idle boost) */
  char pad[64 - sizeof (atomic_int_fast64_t) - sizeof (atomic_uint_fast64_t)];
};

struct alloc_state {
  pthread_mutex_t lock;
  pthread_cond_t wait;      /* a bucket became free */
  struct bucket *buckets;
  uint64_t nbuckets;
  struct fifo free[RESERVE_NR];
  struct fifo free_inc;
  struct open_bucket open[NR_OPEN_BUCKETS];
  unsigned next_open;       /* round-robin for new open buckets */
  uint64_t fifo_cursor;     /* fifo replacement policy */
  uint64_t rand_state;      /* random replacement policy */
  uint64_t prio_buckets[64];/* current prio chain, head first */
  unsigned nprio;
  uint64_t prio_seq;
  atomic_uint waiting;      /* threads waiting for a bucket (GC pacing) */
  /* Buckets with gen != disk_gen; the rule is in alloc.c's header. */
  atomic_uint_fast64_t unpersisted;
  /* Times a bucket became marked dirty or metadata, the buckets the
   * writeback's cutoffs count (bcf_cache_in_use_marks). */
  atomic_uint_fast64_t in_use_marks;
  uint64_t sectors_to_gc;   /* GC trigger countdown */
  uint64_t rescale_sectors; /* prio decay countdown */
};

int alloc_init (struct bcf_cache *c);
void alloc_free (struct bcf_cache *c);
/* Is some bucket's gen bumped in memory but not yet persisted?  While it
 * is, keys dropped from memory as stale (GC, a miss's check key over a
 * stale extent) may be valid on disk after a crash, so an invalidation
 * that finds nothing cached must still be journalled.  Acquire load: a
 * caller that saw a bumped gen, or a key dropped because of one (through
 * tree_lock), sees the count that includes it, until that gen is
 * persisted. */
bool alloc_gens_unpersisted (struct bcf_cache *c);
/* Pop a bucket from the reserve (falling back to RESERVE_NONE for the
 * others).  Never waits, never does I/O: -EAGAIN if the lists are empty.
 * The bucket gets mark, prio and used = bucket size. */
int alloc_bucket_nowait (struct bcf_cache *c, enum alloc_reserve r,
                         uint64_t *bucket);
/* Refill the free lists: invalidate buckets by policy into free_inc,
 * persist their gens (prio write + journal entry), move them to the free
 * lists.  Does I/O; call with no lock held.  Returns 0, -ENOSPC if
 * nothing could be invalidated (GC needed), or -errno. */
int alloc_refill (struct bcf_cache *c);
/* The same, from inside a checkpoint (the caller holds ckpt_lock). */
int alloc_refill_ckpt_locked (struct bcf_cache *c);
/* The allocator thread's refill: only while alloc_lists_low; returns 1
 * when there was nothing to do.  (It used to call alloc_refill, which
 * returns 0 at once while the data list is not empty: the thread spun on
 * the allocator's locks whenever that list was under half full.) */
int alloc_refill_background (struct bcf_cache *c);
bool alloc_lists_low (struct alloc_state *a);
/* Open and first registration: put every bucket that nothing references
 * (mark FREE after the initial mark) on the free lists, gens bumped; the
 * caller then persists them with alloc_prio_write. */
void alloc_fill_from_unused (struct bcf_cache *c);
/* Allocate sectors for data: appended to an open bucket.  *ptr gets the
 * pointer (gen, device sector).  May refill (I/O): call with no lock.
 * Returns 0, -ENOSPC, or -errno. */
int alloc_sectors (struct bcf_cache *c, uint32_t sectors, bool dirty,
                   uint64_t *ptr);
/* The data write to ptr (from alloc_sectors) has finished and its key is
 * inserted or abandoned: unpin the bucket. */
/* A dirty key pointing into ptr's bucket went into the tree: mark the
 * bucket dirty now, and tell a GC pass in progress (BUCKET_DIRTIED in
 * gc_flags) that its marks for the bucket may predate the key.  Under
 * tree_lock (alloc.lock nests inside). */
void alloc_mark_dirty (struct bcf_cache *c, uint64_t ptr);
enum { BUCKET_DIRTIED = 1 << 7 };
void alloc_put (struct bcf_cache *c, uint64_t ptr);
/* A metadata bucket (old btree node, old prio bucket) is no longer
 * referenced by anything on disk: make it invalidatable. */
void alloc_release_meta (struct bcf_cache *c, uint64_t bucket);
/* Write all gens and prios to fresh prio buckets, then a journal entry
 * pointing at them (the caller holds ckpt_lock). */
int alloc_prio_write (struct bcf_cache *c);
/* The same, committing the btree first (a checkpoint, which raises
 * last_seq) where the journal is too tight for the prio write's commit
 * and what follows it; may_checkpoint is false inside a checkpoint.  The
 * one place of that rule: the allocator's refill and the open use it. */
int alloc_prio_write_with_room (struct bcf_cache *c, bool may_checkpoint);
/* Read the prio chain starting at bucket head into the bucket array. */
int alloc_prio_read (struct bcf_cache *c, uint64_t head);
/* Cache hit on a bucket: reset its prio. */
void alloc_touch (struct bcf_cache *c, uint64_t bucket);
/* Is this pointer stale (bucket reused since)? */
bool ptr_stale (struct bcf_cache *c, uint64_t ptr);
/* Counters for stats. */
void alloc_count (struct bcf_cache *c, uint64_t *free, uint64_t *clean,
                  uint64_t *dirty, uint64_t *meta);

/* ---- The btree (btree.c) --------------------------------------------------- */

struct btree_node {
  struct ckey key;          /* this node's key in its parent: offset = the
                               greatest key it may hold, ptr = location */
  unsigned level;
  struct keyset keys;       /* merged view (whiteouts dropped) */
  struct keyset open;       /* not yet written (leaves keep whiteouts; in
                               interior nodes a key without pointer deletes
                               the child key at that position) */
  uint64_t seq;             /* the node's bset seq */
  size_t written;           /* bytes of the node on disk (block multiple) */
  bool rewrite;             /* must be written whole at key.ptr (new node,
                               or compacted into a new bucket) */
  bool evicted;             /* clean leaf whose keys were dropped from
                               memory: load it (btree_load_evicted) before
                               use */
  /* Leaves, for the durable inserts of extent.c (bcf_invalidate and the
   * dirty-key writes say why): removal_seq is the newest journal entry
   * holding an insert here (or in the leaves this one was split or merged
   * from) that removed a key a crash could bring back; never lowered.
   * A range that looks empty may be empty because of such an entry, so
   * a write there must not reach the backing store before it is durable.
   * open_jdata: the open set may hold a data key that a crash brings
   * back though no checkpoint wrote it: one a journal entry holds, or
   * the clean copy of a dirty key (btree_mark_clean_locked), which comes
   * back dirty.  dcopies: those of them that come back dirty (the
   * journalled dirty keys and such clean copies inserted since the open
   * set was last captured; nothing but the capture removes them, so a
   * range whose key left memory since still shows it): btree.c's
   * btree_range_returns_dirty_locked.  At most as many keys as went into the
   * open set since its capture. */
  uint64_t removal_seq;
  bool open_jdata;
  struct keyset dcopies;
  uint64_t last_use;        /* lru_clock at the last use (atomic) */
  struct btree_node *hash_next;
};

struct btree {
  struct btree_node *root;
  struct btree_node **hash;   /* by bucket */
  size_t hash_size;
  size_t nnodes;
  uint64_t nkeys;             /* keys in leaves (merged) */
  size_t max_leaf_keys;       /* split threshold */
  size_t node_bytes;
  /* Buckets of nodes freed by splits/compaction, waiting for a committed
   * root that no longer references them (see checkpoint in btree.c). */
  struct { uint64_t bucket; uint64_t epoch; } *dead;
  size_t ndead, dead_cap;
  uint64_t epoch;             /* incremented at each checkpoint snapshot */
  uint64_t lru_clock;         /* incremented at each eviction pass */
  size_t cache_bytes;         /* key memory of loaded nodes (counted at
                                 each eviction pass, plus reloads since) */
  uint64_t evictions, loads;  /* node cache counters (atomic) */
  /* Leaf inserts, and their count at the last checkpoint snapshot: the
   * tree has keys no checkpoint captured iff they differ. */
  uint64_t leaf_inserts, leaf_inserts_captured;
  /* A checkpoint took open sets and has not committed yet: until it
   * does, a removal no open set holds may not be durable (extent.c's
   * range_state_locked).  Under tree_lock. */
  bool ckpt_uncommitted;
  /* Sectors of dirty data in the merged leaves, kept exact by every
   * insert (leaf_insert), so that "is there dirty data" costs nothing
   * (block status, abandon, stats).  Leaves holding dirty keys are never
   * evicted, so no dirty key is ever out of memory. */
  uint64_t dirty_sectors;
};

int btree_init (struct bcf_cache *c);
void btree_free (struct bcf_cache *c);
/* Has the tree keys that no checkpoint captured?  Takes tree_lock. */
bool btree_has_uncaptured (struct bcf_cache *c);
/* First registration: an empty root leaf covering everything. */
int btree_new_root (struct bcf_cache *c);
/* Load the tree whose root key is given (open), reporting
 * BCF_OPEN_BTREE. */
int btree_load (struct bcf_cache *c, const struct ckey *root, unsigned level,
                char *err, size_t errlen);
/* Extent insert, under tree_lock held for writing; jseq is the journal
 * entry holding k, 0 if k is not journalled.  Returns 0, -EAGAIN (a
 * split needs btree buckets: drop the lock, alloc_refill, retry) or
 * -ENOMEM. */
int btree_insert_locked (struct bcf_cache *c, const struct ckey *k,
                         uint64_t jseq);
/* The insert of [start, end) that journal entry seq holds removed keys a
 * crash could bring back: raise removal_seq of the leaves of the range.
 * Under tree_lock (write). */
void btree_note_removal_locked (struct bcf_cache *c, uint64_t inode,
                                uint64_t start, uint64_t end, uint64_t seq);
/* The newest removal_seq of the leaves of [start, end) (tree_lock, any). */
uint64_t btree_removal_seq_locked (struct bcf_cache *c, uint64_t inode,
                                   uint64_t start, uint64_t end);
/* Mark clean every piece of [start, end) of dirty key `dirty` that is
 * still in the tree: keys that are offset-adjusted copies of it (same
 * pointer relation and gen, dirty); parts that newer inserts replaced
 * are left alone.  Not journalled (a crash that loses it finds the key
 * dirty and writes the same data back).  Returns the sectors marked
 * clean, or -errno.  Under tree_lock (write); the leaves must be loaded
 * (they are: a leaf holding dirty keys is never evicted). */
int64_t btree_mark_clean_locked (struct bcf_cache *c, const struct ckey *dirty);
/* Does leaf n's open set (what changed since a checkpoint took it) hold
 * a key or whiteout overlapping [start, end)?  Under tree_lock (any). */
bool btree_open_overlaps_locked (struct bcf_cache *c,
                                 const struct btree_node *n, uint64_t inode,
                                 uint64_t start, uint64_t end);
/* Could a crash bring back dirty data in [start, end) (a dirty key, or
 * one the leaves' dcopies record, or a capture not committed yet)?
 * Under tree_lock (any); btree.c says why. */
bool btree_range_returns_dirty_locked (struct bcf_cache *c, uint64_t inode,
                                       uint64_t start, uint64_t end);
/* Is any dirty key in [start, end)?  Under tree_lock (any). */
bool btree_range_dirty_locked (struct bcf_cache *c, uint64_t inode,
                               uint64_t start, uint64_t end);
/* Does [start, end) of k hold, without holes, only offset-adjusted
 * pieces of expect (keyset_replace_matches in every leaf)?  False if a
 * leaf of the range is not in memory.  Under tree_lock (any). */
bool btree_range_matches_locked (struct bcf_cache *c, const struct ckey *k,
                                 const struct ckey *expect);
/* Replace insert: k only if [start, end) still holds expect.  Returns 0,
 * -EEXIST (collision), -EAGAIN or -ENOMEM.  Under tree_lock (write). */
int btree_replace_locked (struct bcf_cache *c, const struct ckey *k,
                          const struct ckey *expect);
/* GC: merge leaf n with its right sibling if both fit in 2/3 of a node.
 * 1 merged, 0 not, -errno (tree_lock held for writing). */
int btree_coalesce_locked (struct bcf_cache *c, struct btree_node *n);
/* Find the leaf holding position (inode, sector): the leaf whose range
 * (previous key, key] contains sector.  Under tree_lock (any). */
struct btree_node *btree_find_leaf (struct bcf_cache *c, uint64_t inode,
                                    uint64_t sector);
/* The child an interior key points to (NULL if not in memory). */
struct btree_node *btree_child (struct bcf_cache *c, const struct ckey *k);
/* The node cache.  Leaves that are clean (nothing unwritten) may have
 * their keys dropped from memory when the cache is over its bound
 * (opts.node_cache_bytes); they are read back on use.  Nothing reads an
 * evicted leaf's keys: code that needs the leaves over a range checks
 * btree_range_loaded under tree_lock; if it says no, the caller drops the
 * lock, calls btree_load_evicted (I/O, no lock held) and tries again. */
bool btree_range_loaded (struct bcf_cache *c, uint64_t inode, uint64_t start,
                         uint64_t end, struct ckey *need);
int btree_load_evicted (struct bcf_cache *c, const struct ckey *key);
/* Note a use of leaf n (LRU); any lock. */
void btree_touch (struct bcf_cache *c, struct btree_node *n);
/* Drop clean leaves until the node cache is under its bound (caller holds
 * tree_lock for writing).  Runs at every checkpoint. */
void btree_evict_locked (struct bcf_cache *c);
/* The same between checkpoints (no lock held): if reloads of evicted
 * leaves took the node cache over its bound, evict.  The journal thread
 * calls it at each tick, so a read-only workload (no checkpoints) does
 * not grow the cache to the whole tree. */
void btree_evict_maybe (struct bcf_cache *c);
/* Visit every node, parents before children (fsck, GC, stats). */
typedef int (*btree_visit_fn) (struct bcf_cache *c, struct btree_node *n,
                               void *opaque);
int btree_visit (struct bcf_cache *c, btree_visit_fn fn, void *opaque);
/* Sectors of dirty data (tree.dirty_sectors; under tree_lock). */
uint64_t btree_dirty_sectors (struct bcf_cache *c);
/* The same counted by walking every leaf (open, fsck). */
uint64_t btree_count_dirty_sectors (struct bcf_cache *c);
/* The checkpoint: write every dirty node and commit a new root through
 * the journal (caller holds ckpt_lock, no other lock). */
int btree_checkpoint (struct bcf_cache *c);
/* The export barrier (cache.c): the export's changes counted so far, and
 * a flush of the export covering `changes` if none did yet. */
uint64_t export_changes_now (struct bcf_cache *c);
int export_barrier (struct bcf_cache *c, uint64_t changes);
/* Encode a whole node / decode a node buffer (also used by fsck). */
int btree_node_read (struct bcf_cache *c, struct btree_node *n, char *err,
                     size_t errlen);

/* ---- The journal (journal.c) ------------------------------------------------ */

struct journal {
  pthread_mutex_t lock;
  pthread_cond_t wait;
  uint64_t seq;               /* seq of the pending (open) entry; changed
                                 under lock with an atomic store, read
                                 without it by journal_open_seq */
  uint64_t durable_seq;       /* newest entry known durable */
  uint64_t last_seq;          /* oldest entry still needed (committed) */
  uint64_t *pending;          /* key words of the open entry */
  size_t pending_words, pending_cap;
  bool writing;               /* a thread is writing an entry */
  bool pending_dirty;         /* the open entry holds keys */
  bool pending_data;          /* ... and one of them points at data */
  bool sealed;                /* a checkpoint snapshot took the open
                                 entry's keys: it takes no more */
  /* Ring position: the next entry goes to bucket cur at block offset. */
  unsigned cur;
  uint64_t cur_offset;        /* bytes into the journal bucket */
  /* Newest entry seq written into each journal bucket (0 = none). */
  uint64_t bucket_seq[BCH_SB_JOURNAL_BUCKETS];
  unsigned nbuckets;
  size_t max_entry_bytes;
  void *buf;                  /* entry write buffer (aligned) */
  /* Kept by journal_read for journal_replay: the scan, and the entries
   * replay needs in seq order. */
  struct bcf_journal_scan *replay;
  const struct bcf_journal_entry **replay_order;
  size_t replay_n;
  /* What the open's scan skipped (journal_judge): fsck reports it. */
  size_t ncorrupt;
  char skipped[768];
  uint64_t writes;
};

int journal_init (struct bcf_cache *c);
void journal_free (struct bcf_cache *c);
/* Add a key to the open entry (caller holds tree_lock for writing).
 * Returns the seq it went into, or 0 if the entry is full (-EAGAIN
 * semantics: drop the tree lock, journal_make_room, retry). */
uint64_t journal_add_key_locked (struct bcf_cache *c, const struct ckey *k);
/* Make room for more keys: write the open entry, checkpointing first if
 * the ring is full.  Call with no lock held. */
int journal_make_room (struct bcf_cache *c);
/* Write the open entry (if it has keys or force) and wait until every
 * entry up to seq is durable. */
int journal_flush_seq (struct bcf_cache *c, uint64_t seq);
/* Write an entry with no keys carrying the committed root, uuid and prio
 * pointers, and wait for it (root / prio / uuid changes). */
int journal_meta (struct bcf_cache *c);
/* A checkpoint's sealed entry seq: make it durable (from the journal's
 * reserve; the caller holds ckpt_lock) before the commit entry. */
int journal_flush_sealed (struct bcf_cache *c, uint64_t seq);
/* Close the open entry so that keys added from now on get a new seq;
 * returns the seq of the closed entry (checkpoint snapshot; caller holds
 * tree_lock for writing). */
uint64_t journal_seal_locked (struct bcf_cache *c);
/* Set last_seq after a checkpoint committed everything below it. */
void journal_set_last_seq (struct bcf_cache *c, uint64_t last_seq);
/* Read every journal bucket of the device whose superblock is sb, and
 * judge the entries (the one rule: bcachefilter/inspect.h).  Returns 0
 * with the entries and the verdict in *s (free it with
 * bcf_journal_scan_free), or -errno if the device could not be read.
 * Reports BCF_OPEN_JOURNAL through progress->progress (progress may be
 * NULL). */
int journal_scan (struct bcf_io *io, const struct bch_sb *sb,
                  struct bcf_journal_scan *s,
                  const struct bcf_cache_opts *progress);
/* Read the journal at open: journal_scan, refused with its message
 * unless the verdict is OK; the newest entry gives the root, uuid and
 * prio pointers; the entries replay needs are kept for journal_replay. */
struct journal_replay {
  struct bkey_padded root, uuid_bucket;
  unsigned root_level;
  uint64_t prio_head;
  uint64_t first_seq, last_seq;   /* entries to replay */
  uint64_t entries;
};
int journal_read (struct bcf_cache *c, struct journal_replay *r,
                  char *err, size_t errlen);
/* Feed the kept keys, in order, to cb with the seq of the entry holding
 * each (reporting BCF_OPEN_REPLAY after each entry); then drop them. */
int journal_replay (struct bcf_cache *c,
                    int (*cb) (struct bcf_cache *c, const struct ckey *k,
                               uint64_t seq, void *opaque),
                    void *opaque, uint64_t *nkeys, char *err, size_t errlen);
void journal_replay_done (struct bcf_cache *c);
/* Entries that commit metadata (checkpoints, prio writes) may use the
 * last JOURNAL_RESERVE maximum-size slots of the ring; ordinary entries
 * may not, so a checkpoint can always commit and empty the ring: the
 * prio write it may need, the entry it sealed, and its commit. */
#define JOURNAL_RESERVE 3
/* Would an ordinary entry (not a checkpoint or prio commit) fail to find
 * room while keeping the reserve?  Then commit the btree first. */
bool journal_tight (struct bcf_cache *c);
/* The seq of the open entry (flushing up to it makes everything
 * journalled so far durable). */
uint64_t journal_open_seq (struct bcf_cache *c);
/* Is there room for n more maximum-size entries, reserve included? */
bool journal_room (struct bcf_cache *c, unsigned n);
/* How full the ring is (0..100). */
unsigned journal_used_percent (struct bcf_cache *c);

/* ---- GC (gc.c) --------------------------------------------------------------- */

struct gc_state {
  pthread_mutex_t lock;
  pthread_cond_t wake;
  bool running;               /* a pass is in progress */
  bool requested;
  bool mark_valid;
  uint64_t pos_inode, pos_sector;   /* resume position */
  /* The slice rule (gc.c): nodes_min per slice while foreground requests
   * are in flight, else max(nodes_min, nodes / idle_div).  gc_init sets
   * bcache's 10 and 128; tests lower them to see the rule on a small
   * tree. */
  unsigned nodes_min, idle_div;
  /* Test hook: called between slices with the pass's progress. */
  void (*slice_hook) (struct bcf_cache *c, unsigned slice, void *opaque);
  void *slice_hook_opaque;
};

/* fsck.c: bcf_cache_fsck (bcachefilter/inspect.h). */
/* Test hooks: the device (to arm faults), and a simulated power loss
 * (bcf_io_crash on the device, then the engine is freed without any
 * further I/O). */
struct bcf_io *bcf_cache_test_io (struct bcf_cache *c);
int bcf_cache_test_crash (struct bcf_cache *c, uint64_t seed, int mode);

int gc_init (struct bcf_cache *c);
/* Ask for a GC pass (wakes the GC thread; a no-op without threads). */
void gc_request (struct bcf_cache *c);
void gc_free (struct bcf_cache *c);

/* ---- Moving GC (movinggc.c; the copy is extent.c's) ----------------------------- */

/* Move n dirty extents to new cache space, each only if its range still
 * holds it exactly; buf holds their data (the sum of the lengths); res[i]
 * gets 0, -EEXIST (the range changed), or -errno. */
void extent_move_dirty (struct bcf_cache *c, const struct bcf_extent *e,
                        unsigned n, uint8_t *buf, int *res);

/* ---- Write-intent regions (intent.c) ------------------------------------------- */

#define INTENT_INODE 0xffffeull           /* beyond every uuid slot */
#define INTENT_REGION_SECTORS 32768ull    /* 16 MiB (fits KEY_SIZE) */
#define INTENT_QUIET_MS 5000              /* idle before a mark is cleared */

struct region;

struct intent {
  pthread_mutex_t lock;
  pthread_cond_t cond;          /* a region changed state */
  struct region **hash;         /* marked regions, by index */
  unsigned nregions;
  uint64_t last_clear_seq;      /* journal entry of the newest clear */
  bool clear_failed;            /* a mark may be left: keep the bit */
  /* sb_lock (taken before ckpt_lock, never inside intent.lock) orders
   * the superblock's write-intent bit: sb_flag says it is set on disk.
   * It mirrors c->sb's bit so that marking a region takes ckpt_lock
   * (held by a checkpoint across its I/O) only when the bit changes. */
  pthread_mutex_t sb_lock;
  bool sb_flag;
};

int intent_init (struct bcf_cache *c);
void intent_free (struct bcf_cache *c);
/* Sectors [start, end) of a write whose dirty keys are inserted (or,
 * for bcf_write_begin_through, are to be): make the regions of the range
 * durably marked (a journal wait for a region not marked yet), counting
 * the write in them until intent_write_end.  Then the write needs no
 * journal wait before its backing write.
 * Returns 0 or -errno (then nothing is counted). */
int intent_write_begin (struct bcf_cache *c, uint64_t start, uint64_t end);
void intent_write_end (struct bcf_cache *c, uint64_t start, uint64_t end);
/* Clear the marks of regions no write holds that have been quiet for
 * quiet_ns (the journal thread; 0 at close) and whose last write ended
 * before the last committed checkpoint began.  No lock held. */
void intent_tick (struct bcf_cache *c, uint64_t quiet_ns);
void intent_clear_all (struct bcf_cache *c);
/* Regions marked now; intent_list: their numbers (up to max). */
unsigned intent_marked (struct bcf_cache *c);
unsigned intent_list (struct bcf_cache *c, uint64_t *out, unsigned max);
/* Open, after the journal replay: drop the clean keys of every region a
 * mark survived in (they may be older than the backing store), keep its
 * dirty keys, clear the marks.  *regions, *dropped: how many. */
int intent_recover (struct bcf_cache *c, uint64_t *regions,
                    uint64_t *dropped);

/* ---- The cache set -------------------------------------------------------------- */

struct bcf_cache {
  struct bcf_cache_opts opts;
  struct bcf_io *io;
  struct bch_sb sb;
  uint64_t bucket_sectors;
  uint64_t bucket_bytes;
  unsigned block_bytes;
  uint64_t set_magic;
  uint64_t backing_sectors;
  struct bch_uuid_entry owner;    /* our slot as read at open (zero: none) */
  unsigned inode;                 /* our slot in the uuid array */
  struct bch_uuid_entry *uuids;   /* the uuid array (nr_uuids entries), as
                                     on disk; rewritten whole */
  unsigned nr_uuids;
  uint64_t uuid_bucket;           /* bucket holding the uuid array */

  pthread_rwlock_t tree_lock;
  uint64_t tree_locked_ns;        /* when the writer holding tree_lock took
                                     it (tree_wrlock; only it touches it) */
  pthread_mutex_t ckpt_lock;
  /* bcf_cache_open holds ckpt_lock across super_open, alone (no other
   * thread uses the cache yet): a checkpoint it needs on the way is made
   * under that hold (journal.c, checkpoint_for_room).  Written only by
   * the opener, with ckpt_lock held. */
  bool ckpt_held_by_open;
  pthread_mutex_t super_lock;
  struct btree tree;
  struct alloc_state alloc;
  struct journal journal;
  struct gc_state gc;
  struct intent intent;

  /* The root the newest durable journal entry points to. */
  struct ckey committed_root;
  unsigned committed_level;

  atomic_bool failed;             /* metadata write failed: read-only */
  atomic_bool lost_logged;        /* bcf_cache_check_device said so */
  atomic_uint_fast64_t ckpt_done_ns;  /* bcf_now_ns of the last checkpoint
                                         that committed */
  atomic_uint_fast64_t ckpt_begun_ns; /* ... and when it began: everything
                                         inserted before is in a committed
                                         node (intent.c's clear rule) */
  /* The export barrier (cache.c, export_barrier): a clean key says the
   * export has the data durably, so a checkpoint flushes the export
   * before it writes nodes holding clean keys of data the export may not
   * have flushed yet.  export_changes counts the export's writes, trims
   * and zeroes as they complete (bcf_cache_export_changed); export_flushed
   * is the count a successful flush of `export` covered.  export_lock
   * serialises the flushes (a second barrier waits for the first and
   * usually finds it covered), held across that I/O and inside ckpt_lock
   * only. */
  atomic_uint_fast64_t export_changes;
  uint64_t export_flushed;
  const struct bcf_backing *export;
  pthread_mutex_t export_lock;
  /* Foreground requests in the engine now, counted by request.c's entry
   * points (bcf_req_read, _write, _trim, ...) and read by GC's slice rule
   * (gc.c).  Sharded by thread, a cache line's worth each, so that
   * requests on different threads do not all bounce one line; a request
   * leaves the shard it entered.  bcf_inflight sums them. */
  struct bcf_inflight inflight[BCF_INFLIGHT_SHARDS];

  /* Test hook (NULL in production): called by bcf_read_hit after the
   * device read and before the gen recheck, with no lock held, so a test
   * can reuse the bucket while the read is "in flight". */
  void (*test_read_hook) (struct bcf_cache *c, const struct bcf_extent *e,
                          void *opaque);
  void *test_read_hook_opaque;
  /* Test hook (NULL in production): called by extent_move_dirty once
   * the batch is read and written to its new place, before the inserts,
   * with no lock held, so a test can change a range under a move. */
  void (*test_move_hook) (struct bcf_cache *c, void *opaque);
  void *test_move_hook_opaque;
  /* Test hook (NULL in production): called by alloc_prio_write after it
   * published a new prio chain and before the metadata commit, the
   * window in which any ordinary journal entry already names the new
   * chain. */
  void (*test_prio_hook) (struct bcf_cache *c, void *opaque);
  void *test_prio_hook_opaque;
  /* Test hook (NULL in production): called by btree_checkpoint after its
   * snapshot captured the open sets and before it writes anything (no
   * btree lock held): captured keys are on their way to disk. */
  void (*test_ckpt_hook) (struct bcf_cache *c, void *opaque);
  void *test_ckpt_hook_opaque;

  /* Background threads. */
  bool threads_running;
  atomic_bool stopping;
  pthread_t journal_thread, gc_thread, alloc_thread;

  /* The decayed counters and latency histograms (stats.h), which the
   * request layer counts into too: miss collisions and read races are
   * counted there, once.  Device errors are the I/O layer's count. */
  struct bcf_stats *counters;
  struct {
    atomic_uint_fast64_t inserts, invalidates, invalidates_marked;
    atomic_uint_fast64_t dirty_inserts;
    atomic_uint_fast64_t export_flushes, export_flush_errors;
    atomic_uint_fast64_t export_flushes_skipped;
    atomic_uint_fast64_t intent_marks, intent_clears, intent_dropped;
    atomic_uint_fast64_t gc_passes, gc_slices, gc_nodes, gc_coalesced;
    atomic_uint_fast64_t moving_gc_runs, moving_gc_keys, moving_gc_bytes;
    atomic_uint_fast64_t moving_gc_collisions;
    struct bcf_time_stat gc, btree_split, journal_write, alloc_wait,
                         checkpoint;
    /* Each hold of tree_lock for writing by a checkpoint (the snapshot,
     * the release of dead buckets): how long it blocked lookups. */
    struct bcf_time_stat ckpt_locked;
    /* Each hold of tree_lock for writing by GC (one leaf of a slice);
     * the wait of a lookup that found tree_lock taken. */
    struct bcf_time_stat gc_slice_locked, lookup_lock_wait;
    /* Each other hold of tree_lock for writing (tree_wrunlock): inserts,
     * replaces, clean marks, intent marks, node loads and evictions; and
     * the wait of each of those writers that found it taken. */
    struct bcf_time_stat update_locked, update_lock_wait;
    /* Each write-intent region made durably marked (intent.c's
     * region_enter): what the write that needed it waited. */
    struct bcf_time_stat intent_mark;
    /* Each write of a request's data to the device: what the request
     * waited for it (extent.c's write_pieces; bcf_write_over_end, where
     * it ran beside the backing write, only what remained after that). */
    struct bcf_time_stat cache_write;
    /* Each device flush a journal write made before its entry (part of
     * journal_write: the rest is the entry's own write), and each prio
     * write (the buckets' gens and prios, then their journal entry). */
    struct bcf_time_stat journal_preflush, prio_write;
    atomic_uint_fast64_t gc_slice_nodes_last, gc_slice_nodes_max;
    atomic_uint_fast64_t gc_slices_busy;
    pthread_mutex_t time_lock;
  } stats;
};

/* Logging through opts.log (util.h). */
#define bcf_log(c, level, ...) \
  bcf_log_to ((c)->opts.log, (c)->opts.log_opaque, (level), __VA_ARGS__)
/* Progress of a step of the open through opts.progress, if the caller
 * asked for it (o may be NULL: a scan for the tools).  Called with no
 * lock held (the callback's contract, bcachefilter/cache.h). */
static inline void
open_progress (const struct bcf_cache_opts *o, enum bcf_open_step step,
               uint64_t done, uint64_t total)
{
  if (o && o->progress)
    o->progress (o->progress_opaque, step, done, total);
}
/* Record one duration in one of the cache's time stats. */
static inline void
bcf_time_record (struct bcf_cache *c, struct bcf_time_stat *t, uint64_t ns)
{
  bcf_time_stat_add (t, &c->stats.time_lock, ns);
}

/* tree_lock for writing, every hold timed: a lookup that waited long
 * (lookup_lock_wait) can then be matched to the kind of holder that made
 * it wait.  tree_wrunlock_into records the hold in the given stat (GC, a
 * checkpoint), tree_wrunlock in update_locked (every other writer).  The
 * time of taking lives in the cache: only the writer that holds the lock
 * touches it.  The cost is two clock reads per hold (~0.4 us here),
 * against the 100-200 us a request costs the front end.
 *
 * A writer that finds the lock taken has its wait timed into *wait (if
 * not NULL): the default rwlock prefers readers, so a steady stream of
 * lookups can keep an insert waiting, and only this shows it.  The
 * uncontended case costs one trylock. */
static inline void
tree_wrlock_timing (struct bcf_cache *c, struct bcf_time_stat *wait)
{
  if (pthread_rwlock_trywrlock (&c->tree_lock) != 0) {
    uint64_t t0 = bcf_now_ns ();

    pthread_rwlock_wrlock (&c->tree_lock);
    if (wait)
      bcf_time_record (c, wait, bcf_now_ns () - t0);
  }
  c->tree_locked_ns = bcf_now_ns ();
}

/* A foreground lookup takes tree_lock for reading; when a writer (an
 * insert, GC, a checkpoint snapshot) has it, the wait is timed
 * (lookup_lock_wait), as tree_wrlock_timing times a writer's.  The
 * uncontended case costs one trylock. */
static inline void
lookup_rdlock (struct bcf_cache *c)
{
  uint64_t t0;

  if (pthread_rwlock_tryrdlock (&c->tree_lock) == 0)
    return;
  t0 = bcf_now_ns ();
  pthread_rwlock_rdlock (&c->tree_lock);
  bcf_time_record (c, &c->stats.lookup_lock_wait, bcf_now_ns () - t0);
}

/* For the writers whose holds go to update_locked (tree_wrunlock): their
 * waits go to update_lock_wait.  GC and checkpoints, which run in the
 * background, take it with tree_wrlock_timing (c, NULL). */
static inline void
tree_wrlock (struct bcf_cache *c)
{
  tree_wrlock_timing (c, &c->stats.update_lock_wait);
}

static inline void
tree_wrunlock_into (struct bcf_cache *c, struct bcf_time_stat *t)
{
  bcf_time_record (c, t, bcf_now_ns () - c->tree_locked_ns);
  pthread_rwlock_unlock (&c->tree_lock);
}

static inline void
tree_wrunlock (struct bcf_cache *c)
{
  tree_wrunlock_into (c, &c->stats.update_locked);
}

/* Foreground requests in flight now (the sum of the shards; a snapshot,
 * good enough for a heuristic). */
static inline uint64_t
bcf_inflight (struct bcf_cache *c)
{
  int_fast64_t n = 0;

  for (unsigned i = 0; i < BCF_INFLIGHT_SHARDS; i++)
    n += atomic_load_explicit (&c->inflight[i].n, memory_order_relaxed);
  return n > 0 ? (uint64_t) n : 0;
}

/* Pointer helpers. */
static inline uint64_t
bucket_of_ptr (const struct bcf_cache *c, uint64_t ptr)
{
  return PTR_OFFSET (ptr) / c->bucket_sectors;
}
static inline uint64_t
bucket_ptr (const struct bcf_cache *c, uint64_t bucket, uint8_t gen)
{
  return MAKE_PTR (gen, bucket * c->bucket_sectors, 0);
}

#endif /* BCACHEFILTER_ENGINE_H */
