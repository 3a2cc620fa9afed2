/* bcachefilter engine: the one table of statistics, snapshots, and the
 * text, JSON and Prometheus renderers (include/bcachefilter/stats.h).
 *
 * Design
 * ------
 * STATS below lists every statistic once: its name (bcache's spelling
 * where bcache has one, and the key every output used before this table
 * existed, so nothing that reads them breaks), kind, unit, section, flags,
 * which part of a snapshot it needs (the request layer, the allocator),
 * how to read it, and a one-line help.  The list expands into the public
 * descriptor array (bcf_stat_descs) and a parallel array of getters, so
 * the two cannot drift apart.
 *
 * A snapshot (struct bcf_snapshot) copies every figure once, through the
 * engine's public calls (bcf_cache_stats, bcf_req_get_stats, the decayed
 * counters), and derives the few that are shown in other units (dirty
 * data in bytes, the writeback rate in bytes per second).  A getter is
 * then only an offset into the snapshot and a type; bcf_stat_get turns it
 * into a struct bcf_stat_value.  The three renderers walk the table in
 * order and never name a statistic:
 *
 *   text        "%-28s value" lines: the settings (section TOP), one
 *               [view] block per view of bcache's counters (VIEWS), then
 *               [cache] (ENGINE) and [allocator];
 *   JSON        one object built with json-c: the settings, the totals of
 *               bcache's counters, "views" (an object per view),
 *               "engine", then what is flagged BCF_STAT_JSON_TOP
 *               (device_errors), then "allocator" — the layout the
 *               hand-written writer had;
 *   Prometheus  the text exposition format: every family with # HELP and
 *               # TYPE, names prefixed "bcachefilter_", durations in
 *               seconds and byte figures suffixed "_bytes", counters
 *               suffixed "_total", bcache's decayed views as a gauge
 *               family per counter with a "view" label (a decayed view
 *               goes down, so it cannot be a counter), time stats and
 *               latencies as histograms (le in seconds) with a "_max"
 *               gauge, and states as a gauge of 1 labelled with the word.
 *
 * clear_stats (bcf_stats_clear_all) zeroes what it may write without
 * disturbing anyone (the decayed counters and latency histograms of
 * core/stats.c, the engine's time stats) and rebases the counters of the
 * other layers: it stores their current values with the cache's counters
 * (core/metrics.h), and every snapshot subtracts them.  The engine, the
 * request layer and the writeback read some of their counters for their
 * own logic; none of them sees a counter go backwards.
 *
 * Locking: none here.  A snapshot is taken through calls that take the
 * engine's locks briefly; rendering touches only the snapshot.
 */
#include "config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <json.h>

#include "bcachefilter/request.h"
#include "bcachefilter/stats.h"
#include "metrics.h"

#define PROM_PREFIX "bcachefilter_"

/* Everything a renderer shows, read at one time. */
struct bcf_snapshot {
  bool have_req, have_alloc;
  struct bcf_cache_stats cache;
  struct bcf_req_stats req;
  const char *cache_mode, *sequential_bypass, *detach;
  uint64_t sequential_cutoff;
  uint64_t views[BCF_VIEW__COUNT][BCF_STAT__COUNT];
  struct bcf_time_stat lat[BCF_LAT__COUNT];
  /* Derived (shown in other units than kept). */
  uint64_t dirty_data, cache_available_percent, writeback_rate;
  int64_t wb_target, wb_dirty, wb_proportional, wb_integral, wb_change;
  /* The allocator (bcf_snapshot_set_allocator). */
  const char *alloc_name;
  uint64_t allocated, resident;
  /* The counters' values at the last clear_stats (one per descriptor). */
  uint64_t *base;
};

/* How a getter reads the snapshot. */
enum getter_type {
  G_U64,                        /* uint64_t */
  G_UINT,                       /* unsigned */
  G_I64,                        /* int64_t */
  G_BOOL,                       /* bool, shown as yes/no, true/false */
  G_BOOL01,                     /* bool, shown as the number 0 or 1 */
  G_STR,                        /* const char * */
  G_TIME,                       /* struct bcf_time_stat */
  G_VIEW,                       /* views[view][arg]; arg BCF_STAT__COUNT:
                                   the hit ratio */
};

enum need { N_CACHE, N_REQ, N_ALLOC };

struct getter {
  enum getter_type type;
  size_t off;
  int arg;
  enum need need;
  const char *json_key;         /* NULL: the name */
};

#define AT(f) offsetof (struct bcf_snapshot, f)
#define U64(f)    { G_U64, AT (f), 0
#define UINT(f)   { G_UINT, AT (f), 0
#define I64(f)    { G_I64, AT (f), 0
#define BOOL(f)   { G_BOOL, AT (f), 0
#define BOOL01(f) { G_BOOL01, AT (f), 0
#define STR(f)    { G_STR, AT (f), 0
#define TIME(f)   { G_TIME, AT (f), 0
#define VIEW(k)   { G_VIEW, 0, (k)

/* X (name, kind, unit, section, flags, getter, need, help) */
#define STATS(X)                                                            \
  X (cache_mode, STATE, NONE, TOP, 0, STR (cache_mode), N_REQ,              \
     "The cache mode: writethrough, writeback, writearound or none "        \
     "(bcache's cache_mode).")                                              \
  X (sequential_cutoff, GAUGE, BYTES, TOP, 0, U64 (sequential_cutoff),      \
     N_REQ, "Requests continuing a stream of at least this many bytes "     \
     "bypass the cache; 0: none do (bcache's sequential_cutoff).")          \
  X (sequential_bypass, STATE, NONE, TOP, 0, STR (sequential_bypass),       \
     N_REQ, "When a stream past the cutoff goes around the cache: auto "    \
     "(while the export is no slower than the cache) or always.")           \
  X (passthrough, STATE, NONE, TOP, 0, BOOL (req.passthrough), N_REQ,       \
     "Whether too many cache-device errors switched the cache off.")        \
  X (detach, STATE, NONE, TOP, 0, STR (detach), N_REQ,                      \
     "How a detach stands: none, draining or detached.")                    \
  X (cache_hits, COUNTER, NONE, VIEWS, 0, VIEW (BCF_STAT_HITS), N_CACHE,    \
     "Reads served wholly from the cache (bcache's cache_hits).")           \
  X (cache_misses, COUNTER, NONE, VIEWS, 0, VIEW (BCF_STAT_MISSES),         \
     N_CACHE, "Reads that needed the backing store (bcache's "              \
     "cache_misses).")                                                      \
  X (cache_bypass_hits, COUNTER, NONE, VIEWS, 0,                            \
     VIEW (BCF_STAT_BYPASS_HITS), N_CACHE,                                  \
     "Reads that bypassed the cache and were served from it.")              \
  X (cache_bypass_misses, COUNTER, NONE, VIEWS, 0,                          \
     VIEW (BCF_STAT_BYPASS_MISSES), N_CACHE,                                \
     "Reads that bypassed the cache and were served from the export.")      \
  X (cache_miss_collisions, COUNTER, NONE, VIEWS, 0,                        \
     VIEW (BCF_STAT_MISS_COLLISIONS), N_CACHE,                              \
     "Misses not cached because the range changed meanwhile.")              \
  X (cache_read_races, COUNTER, NONE, VIEWS, 0,                             \
     VIEW (BCF_STAT_READ_RACES), N_CACHE,                                   \
     "Hits whose bucket was reused while they were read (served from the "  \
     "export).")                                                            \
  X (bypassed, COUNTER, BYTES, VIEWS, 0, VIEW (BCF_STAT_BYPASSED_BYTES),    \
     N_CACHE, "Bytes of requests that went around the cache.")              \
  X (cache_hit_ratio, GAUGE, PERCENT, VIEWS, 0, VIEW (BCF_STAT__COUNT),     \
     N_CACHE, "Hits per 100 reads, bypassed reads excluded.")               \
  X (device_errors, COUNTER, NONE, ENGINE, BCF_STAT_JSON_TOP,               \
     U64 (cache.device_errors), N_CACHE,                                    \
     "Cache-device I/Os that failed (each is served from the export).")     \
  X (io_errors, GAUGE, NONE, ENGINE, 0, U64 (req.io_errors), N_REQ,         \
     "Cache-device errors, decayed by the half-life (bcache's io_errors).") \
  X (io_error_limit, GAUGE, NONE, ENGINE, 0, U64 (req.io_error_limit),      \
     N_REQ, "io_errors at which the cache is switched off.")                \
  X (io_error_halflife, GAUGE, NONE, ENGINE, 0,                             \
     U64 (req.io_error_halflife), N_REQ,                                    \
     "Cache-device I/Os after which an error counts half; 0: never.")       \
  X (nbuckets, GAUGE, NONE, ENGINE, 0, U64 (cache.nbuckets), N_CACHE,       \
     "Buckets of the cache device.")                                        \
  X (bucket_bytes, GAUGE, BYTES, ENGINE, 0, U64 (cache.bucket_bytes),       \
     N_CACHE, "The size of a bucket.")                                      \
  X (block_bytes, GAUGE, BYTES, ENGINE, 0, U64 (cache.block_bytes),         \
     N_CACHE, "The size of a cache block.")                                 \
  X (buckets_free, GAUGE, NONE, ENGINE, 0, U64 (cache.buckets_free),        \
     N_CACHE, "Buckets that hold nothing.")                                 \
  X (buckets_clean, GAUGE, NONE, ENGINE, 0, U64 (cache.buckets_clean),      \
     N_CACHE, "Buckets that hold clean data only.")                         \
  X (buckets_dirty, GAUGE, NONE, ENGINE, 0, U64 (cache.buckets_dirty),      \
     N_CACHE, "Buckets that hold dirty data.")                              \
  X (buckets_meta, GAUGE, NONE, ENGINE, 0, U64 (cache.buckets_meta),        \
     N_CACHE, "Buckets of metadata: journal, btree, prios, uuids.")         \
  X (dirty_data, GAUGE, BYTES, ENGINE, 0, U64 (dirty_data), N_CACHE,        \
     "Data the cache holds that the export does not have yet (bcache's "    \
     "dirty_data).")                                                        \
  X (btree_nodes, GAUGE, NONE, ENGINE, 0, U64 (cache.btree_nodes),          \
     N_CACHE, "Nodes of the btree.")                                        \
  X (btree_depth, GAUGE, NONE, ENGINE, 0, U64 (cache.btree_depth),          \
     N_CACHE, "Levels of the btree.")                                       \
  X (btree_keys, GAUGE, NONE, ENGINE, 0, U64 (cache.btree_keys), N_CACHE,   \
     "Keys in the btree's leaves.")                                         \
  X (btree_cache_bytes, GAUGE, BYTES, ENGINE, 0,                            \
     U64 (cache.btree_cache_bytes), N_CACHE,                                \
     "Memory of the btree node cache.")                                     \
  X (btree_evictions, COUNTER, NONE, ENGINE, 0,                             \
     U64 (cache.btree_evictions), N_CACHE,                                  \
     "Btree nodes evicted from the node cache.")                            \
  X (btree_loads, COUNTER, NONE, ENGINE, 0, U64 (cache.btree_loads),        \
     N_CACHE, "Btree nodes read into the node cache.")                      \
  X (journal_seq, GAUGE, NONE, ENGINE, 0, U64 (cache.journal_seq),          \
     N_CACHE, "The sequence number of the open journal entry.")             \
  X (journal_last_seq, GAUGE, NONE, ENGINE, 0,                              \
     U64 (cache.journal_last_seq), N_CACHE,                                 \
     "The oldest journal entry still needed.")                              \
  X (journal_writes, COUNTER, NONE, ENGINE, 0, U64 (cache.journal_writes),  \
     N_CACHE, "Journal entries written.")                                   \
  X (inserts, COUNTER, NONE, ENGINE, 0, U64 (cache.inserts), N_CACHE,       \
     "Data inserted into the cache: fills and written data.")               \
  X (dirty_inserts, COUNTER, NONE, ENGINE, 0, U64 (cache.dirty_inserts),    \
     N_CACHE, "Writes inserted as dirty keys.")                             \
  X (intent_regions, GAUGE, NONE, ENGINE, 0, U64 (cache.intent_regions),    \
     N_CACHE, "Write-intent regions marked now.")                           \
  X (intent_marks, COUNTER, NONE, ENGINE, 0, U64 (cache.intent_marks),      \
     N_CACHE, "Write-intent regions marked.")                               \
  X (intent_clears, COUNTER, NONE, ENGINE, 0, U64 (cache.intent_clears),    \
     N_CACHE, "Write-intent regions cleared.")                              \
  X (intent_dropped, COUNTER, NONE, ENGINE, 0,                              \
     U64 (cache.intent_dropped), N_CACHE,                                   \
     "Clean extents dropped at open in regions a crash left marked.")       \
  X (invalidates, COUNTER, NONE, ENGINE, 0, U64 (cache.invalidates),        \
     N_CACHE, "Ranges invalidated.")                                        \
  X (invalidates_marked, COUNTER, NONE, ENGINE, 0,                          \
     U64 (cache.invalidates_marked), N_CACHE,                               \
     "Invalidations by bypassing writes that a write-intent mark made "     \
     "durable instead of a journal wait.")                                  \
  X (export_flushes, COUNTER, NONE, ENGINE, 0,                              \
     U64 (cache.export_flushes), N_CACHE,                                   \
     "Flushes of the export a checkpoint made before writing clean keys.")  \
  X (export_flush_errors, COUNTER, NONE, ENGINE, 0,                         \
     U64 (cache.export_flush_errors), N_CACHE,                              \
     "Those flushes of the export that failed.")                            \
  X (export_flushes_skipped, COUNTER, NONE, ENGINE, 0,                      \
     U64 (cache.export_flushes_skipped), N_CACHE,                           \
     "Flushes of the export not sent: an earlier one covered every "        \
     "change.")                                                             \
  X (gc_passes, COUNTER, NONE, ENGINE, 0, U64 (cache.gc_passes), N_CACHE,   \
     "Garbage collection passes.")                                          \
  X (gc_slices, COUNTER, NONE, ENGINE, 0, U64 (cache.gc_slices), N_CACHE,   \
     "Garbage collection slices (each holds the index lock once).")         \
  X (gc_nodes, COUNTER, NONE, ENGINE, 0, U64 (cache.gc_nodes), N_CACHE,     \
     "Btree nodes walked by garbage collection.")                           \
  X (gc_coalesced, COUNTER, NONE, ENGINE, 0, U64 (cache.gc_coalesced),      \
     N_CACHE, "Btree nodes merged by garbage collection.")                  \
  X (moving_gc_runs, COUNTER, NONE, ENGINE, 0, U64 (cache.moving_gc_runs), \
     N_CACHE, "Moving GC runs (dirty data compacted into fewer buckets).") \
  X (moving_gc_keys, COUNTER, NONE, ENGINE, 0, U64 (cache.moving_gc_keys), \
     N_CACHE, "Dirty extents moving GC copied to fresh buckets.")           \
  X (moving_gc_bytes, COUNTER, BYTES, ENGINE, 0,                            \
     U64 (cache.moving_gc_bytes), N_CACHE, "Their bytes.")                  \
  X (moving_gc_collisions, COUNTER, NONE, ENGINE, 0,                        \
     U64 (cache.moving_gc_collisions), N_CACHE,                             \
     "Extents changed by a write, trim or clean mark while moving GC "      \
     "copied them (left as the change made them).")                         \
  X (gc_slice_nodes_last, GAUGE, NONE, ENGINE, 0,                           \
     U64 (cache.gc_slice_nodes_last), N_CACHE,                              \
     "Nodes walked by the last garbage collection slice.")                  \
  X (gc_slice_nodes_max, GAUGE, NONE, ENGINE, 0,                            \
     U64 (cache.gc_slice_nodes_max), N_CACHE,                               \
     "The most nodes a garbage collection slice walked.")                   \
  X (gc_slices_busy, COUNTER, NONE, ENGINE, 0, U64 (cache.gc_slices_busy),  \
     N_CACHE, "Slices cut short because requests were in flight.")          \
  X (requests_in_flight, GAUGE, NONE, ENGINE, 0,                            \
     U64 (cache.requests_in_flight), N_CACHE,                               \
     "Client requests in the engine now.")                                  \
  X (gc, TIME, NS, ENGINE, 0, TIME (cache.gc), N_CACHE,                     \
     "Garbage collection passes (bcache's btree_gc time stats).")           \
  X (btree_split, TIME, NS, ENGINE, 0, TIME (cache.btree_split), N_CACHE,   \
     "Btree node splits (bcache's btree_split time stats).")                \
  X (journal_write, TIME, NS, ENGINE, 0, TIME (cache.journal_write),        \
     N_CACHE, "Journal writes.")                                            \
  X (alloc_wait, TIME, NS, ENGINE, 0, TIME (cache.alloc_wait), N_CACHE,     \
     "Waits for a free bucket.")                                            \
  X (checkpoint, TIME, NS, ENGINE, 0, TIME (cache.checkpoint), N_CACHE,     \
     "Checkpoints (the btree written, a new root committed).")              \
  X (gc_slice_locked, TIME, NS, ENGINE, 0, TIME (cache.gc_slice_locked),    \
     N_CACHE, "How long garbage collection held the index lock, each "      \
     "hold (one leaf of a slice).")                                         \
  X (checkpoint_locked, TIME, NS, ENGINE, 0, TIME (cache.ckpt_locked),      \
     N_CACHE, "How long each of a checkpoint's two holds of the index "     \
     "lock lasted.")                                                        \
  X (lookup_lock_wait, TIME, NS, ENGINE, 0, TIME (cache.lookup_lock_wait),  \
     N_CACHE, "How long lookups that found the index lock taken waited.")   \
  X (update_locked, TIME, NS, ENGINE, 0, TIME (cache.update_locked),        \
     N_CACHE, "How long each other hold of the index lock for writing "     \
     "lasted (inserts, replaces, clean marks, node loads).")                \
  X (update_lock_wait, TIME, NS, ENGINE, 0, TIME (cache.update_lock_wait),  \
     N_CACHE, "How long those writers that found the index lock taken "     \
     "waited.")                                                             \
  X (intent_mark, TIME, NS, ENGINE, 0, TIME (cache.intent_mark), N_CACHE,   \
     "How long marking a write-intent region durably took (the write "      \
     "that needed it waited).")                                             \
  X (cache_write, TIME, NS, ENGINE, 0, TIME (cache.cache_write), N_CACHE,   \
     "How long each write waited for its data's write to the cache "      \
     "device (beyond its export write, where the two run side by side).")  \
  X (journal_preflush, TIME, NS, ENGINE, 0, TIME (cache.journal_preflush),  \
     N_CACHE, "How long each device flush before a journal entry took "    \
     "(part of journal_write).")                                            \
  X (prio_write, TIME, NS, ENGINE, 0, TIME (cache.prio_write), N_CACHE,     \
     "How long each write of the prio buckets and their journal entry "    \
     "took.")                                                               \
  X (tracker_bytes, GAUGE, BYTES, ENGINE, 0, U64 (req.bypass_bytes_now),    \
     N_REQ, "Memory of the in-flight write tracker now.")                   \
  X (tracker_peak_bytes, GAUGE, BYTES, ENGINE, 0,                           \
     U64 (req.bypass_bytes_peak), N_REQ,                                    \
     "The most memory the in-flight write tracker used.")                   \
  X (tracker_pages, GAUGE, NONE, ENGINE, 0, U64 (req.bypass_pages), N_REQ,  \
     "Pages of the in-flight write tracker.")                               \
  X (tracker_reserve_uses, COUNTER, NONE, ENGINE, 0,                        \
     U64 (req.bypass_reserve_uses), N_REQ,                                  \
     "Times the write tracker used its reserve (out of memory).")           \
  X (tracker_in_flight, GAUGE, NONE, ENGINE, 0, U64 (req.bypass_in_flight), \
     N_REQ, "Writes in flight in the tracker now.")                         \
  X (fills_dropped, COUNTER, NONE, ENGINE, 0, U64 (req.fills_dropped),      \
     N_REQ, "Misses not cached because the fill queue was full.")           \
  X (fill_queue_bytes, GAUGE, BYTES, ENGINE, 0, U64 (req.fill_queue_bytes), \
     N_REQ, "Data waiting to be written to the cache.")                     \
  X (write_inserts, COUNTER, NONE, ENGINE, 0, U64 (req.write_inserts),      \
     N_REQ, "Written-through writes whose data is cached.")                 \
  X (write_collisions, COUNTER, NONE, ENGINE, 0,                            \
     U64 (req.write_collisions), N_REQ,                                     \
     "Writes whose data could not be cached (no room, an error, a failed "  \
     "export write).")                                                      \
  X (write_waits, COUNTER, NONE, ENGINE, 0, U64 (req.write_waits), N_REQ,   \
     "Writes that waited for an overlapping write in flight.")              \
  X (write_wait_ns, COUNTER, NS, ENGINE, 0, U64 (req.write_wait_ns), N_REQ, \
     "Time writes spent waiting for overlapping writes.")                   \
  X (write_wait_max_ns, GAUGE, NS, ENGINE, 0, U64 (req.write_wait_max_ns),  \
     N_REQ, "The longest such wait.")                                       \
  X (write_absorbed, COUNTER, NONE, ENGINE, 0, U64 (req.write_absorbed),    \
     N_REQ, "Waiting writes that a later write covering them stood in "     \
     "for.")                                                                \
  X (writes_in_flight_peak, GAUGE, NONE, ENGINE, 0,                         \
     U64 (req.writes_in_flight_peak), N_REQ,                                \
     "The most writes in flight at once.")                                  \
  X (tracker_exact_checks, COUNTER, NONE, ENGINE, 0,                        \
     U64 (req.bypass_exact_checks), N_REQ,                                  \
     "Misses near a write in flight whose exact ranges were compared.")     \
  X (bypass_sequential, COUNTER, NONE, ENGINE, 0,                           \
     U64 (req.bypass_sequential), N_REQ,                                    \
     "Requests that bypassed the cache as part of a sequential stream.")    \
  X (bypass_congested, COUNTER, NONE, ENGINE, 0,                            \
     U64 (req.bypass_congested), N_REQ,                                     \
     "Requests that bypassed the cache because it was congested.")          \
  X (sequential_cached, COUNTER, NONE, ENGINE, 0,                           \
     U64 (req.sequential_cached), N_REQ,                                    \
     "Stream requests cached because the export is slower than the "        \
     "cache.")                                                              \
  X (export_read_ns_per_kib, GAUGE, NONE, ENGINE, 0,                        \
     U64 (req.export_read_ns_per_kib), N_REQ,                               \
     "Nanoseconds per KiB read from the export (average; 0: not yet).")     \
  X (cache_read_ns_per_kib, GAUGE, NONE, ENGINE, 0,                         \
     U64 (req.cache_read_ns_per_kib), N_REQ,                                \
     "Nanoseconds per KiB read from the cache (average; 0: not yet).")      \
  X (congested, GAUGE, NONE, ENGINE, 0, UINT (cache.congested), N_CACHE,    \
     "From which stream size in sectors requests bypass the congested "     \
     "cache; 0: not congested.")                                            \
  X (congested_read_threshold_us, GAUGE, US, ENGINE, 0,                     \
     UINT (cache.congested_read_threshold_us), N_CACHE,                     \
     "Cache reads slower than this congest the cache; 0: never.")           \
  X (congested_write_threshold_us, GAUGE, US, ENGINE, 0,                    \
     UINT (cache.congested_write_threshold_us), N_CACHE,                    \
     "Cache writes slower than this congest the cache; 0: never.")          \
  X (writeback_keys_done, COUNTER, NONE, ENGINE, 0,                         \
     U64 (req.writeback_keys_done), N_REQ, "Dirty extents written back.")   \
  X (writeback_keys_failed, COUNTER, NONE, ENGINE, 0,                       \
     U64 (req.writeback_keys_failed), N_REQ,                                \
     "Dirty extents whose writeback failed (retried).")                     \
  X (writeback_bytes, COUNTER, BYTES, ENGINE, 0, U64 (req.writeback_bytes), \
     N_REQ, "Dirty data written back.")                                     \
  X (writeback_backing_errors, COUNTER, NONE, ENGINE, 0,                    \
     U64 (req.writeback_backing_errors), N_REQ,                             \
     "Writebacks the export failed.")                                       \
  X (writeback_read_errors, COUNTER, NONE, ENGINE, 0,                       \
     U64 (req.writeback_read_errors), N_REQ,                                \
     "Writebacks whose read of the cache failed.")                          \
  X (writeback_gc_requests, COUNTER, NONE, ENGINE, 0,                       \
     U64 (req.writeback_gc_requests), N_REQ,                                \
     "GCs the writeback asked for to count the buckets it cleaned.")        \
  X (writeback_writes, COUNTER, NONE, ENGINE, 0,                            \
     U64 (req.writeback_writes), N_REQ,                                     \
     "Writes acknowledged from the cache (writeback mode).")                \
  X (writeback_cutoff_writes, COUNTER, NONE, ENGINE, 0,                     \
     U64 (req.writeback_cutoff_writes), N_REQ,                              \
     "Writes written through in writeback mode: the cache was too full.")   \
  X (writeback_percent, GAUGE, PERCENT, ENGINE, 0,                          \
     UINT (req.writeback_percent), N_REQ,                                   \
     "The share of the cache dirty data is written back down to.")          \
  X (writeback_delay, GAUGE, SECONDS, ENGINE, 0,                            \
     UINT (req.writeback_delay), N_REQ,                                     \
     "The writeback's pause after a full pass.")                            \
  X (writeback_running, GAUGE, NONE, ENGINE, 0,                             \
     BOOL01 (req.writeback_running), N_REQ,                                 \
     "1 while the writeback runs, 0 while it is paused.")                   \
  X (copy_gc_enabled, GAUGE, NONE, ENGINE, 0,                               \
     BOOL01 (req.copy_gc_enabled), N_REQ,                                   \
     "1 while moving GC compacts dirty data between writeback batches.")   \
  X (writeback_flushing, GAUGE, NONE, ENGINE, 0,                            \
     BOOL01 (req.writeback_flushing), N_REQ,                                \
     "1 while everything dirty is written back at full speed.")             \
  X (writeback_rate_update_seconds, GAUGE, SECONDS, ENGINE, 0,              \
     UINT (req.writeback_update_seconds), N_REQ,                            \
     "The writeback rate controller's period.")                             \
  X (cache_available_percent, GAUGE, PERCENT, ENGINE, 0,                    \
     U64 (cache_available_percent), N_REQ,                                  \
     "The share of buckets neither dirty nor metadata.")                    \
  X (writeback_rate, GAUGE, NONE, ENGINE, 0, U64 (writeback_rate), N_REQ,   \
     "The writeback rate, bytes per second (bcache's writeback_rate).")     \
  X (writeback_rate_target, GAUGE, BYTES, ENGINE, 0, I64 (wb_target),       \
     N_REQ, "The dirty data the writeback aims at.")                        \
  X (writeback_rate_dirty, GAUGE, BYTES, ENGINE, 0, I64 (wb_dirty), N_REQ,  \
     "The dirty data the rate controller saw.")                             \
  X (writeback_rate_proportional, GAUGE, BYTES, ENGINE, 0,                  \
     I64 (wb_proportional), N_REQ,                                          \
     "The rate controller's proportional term.")                            \
  X (writeback_rate_integral, GAUGE, BYTES, ENGINE, 0, I64 (wb_integral),   \
     N_REQ, "The rate controller's integral term.")                         \
  X (writeback_rate_change, GAUGE, BYTES, ENGINE, 0, I64 (wb_change),       \
     N_REQ, "The rate controller's last change of the rate.")               \
  X (writeback_rate_next_io_ns, GAUGE, NS, ENGINE, 0,                       \
     U64 (req.wb_next_io_ns), N_REQ,                                        \
     "How long until the rate limiter lets the next writeback go.")         \
  X (writeback_rate_at_max, GAUGE, NONE, ENGINE, 0,                         \
     BOOL01 (req.wb_at_max), N_REQ,                                         \
     "1 while the writeback runs at full speed (idle boost).")              \
  X (latency_read_hit, HISTOGRAM, NS, ENGINE, 0,                            \
     TIME (lat[BCF_LAT_READ_HIT]), N_CACHE,                                 \
     "Reads served wholly from the cache, entry to return (one in eight "   \
     "timed).")                                                             \
  X (latency_read_miss, HISTOGRAM, NS, ENGINE, 0,                           \
     TIME (lat[BCF_LAT_READ_MISS]), N_CACHE,                                \
     "Reads that needed the export, entry to return (one in eight "         \
     "timed).")                                                             \
  X (latency_write, HISTOGRAM, NS, ENGINE, 0, TIME (lat[BCF_LAT_WRITE]),    \
     N_CACHE, "Writes, entry to return.")                                   \
  X (latency_flush, HISTOGRAM, NS, ENGINE, 0, TIME (lat[BCF_LAT_FLUSH]),    \
     N_CACHE, "Flushes, entry to return.")                                  \
  X (allocator, STATE, NONE, ALLOCATOR, 0, STR (alloc_name), N_ALLOC,       \
     "The allocator the process runs under, when it reports itself.")       \
  X (allocated, GAUGE, BYTES, ALLOCATOR, 0, U64 (allocated), N_ALLOC,       \
     "Bytes the process has allocated (jemalloc's stats.allocated).")       \
  X (resident, GAUGE, BYTES, ALLOCATOR, 0, U64 (resident), N_ALLOC,         \
     "Bytes in resident pages the allocator maps (stats.resident).")

#define DESC(name, kind, unit, section, flags, get, need, help)         \
  { #name, BCF_KIND_##kind, BCF_UNIT_##unit, BCF_SECTION_##section,     \
    flags, help },
static const struct bcf_stat_desc descs[] = { STATS (DESC) };

#define GETTER(name, kind, unit, section, flags, get, need, help)       \
  get, need, NULL },
static const struct getter getters[] = { STATS (GETTER) };

#define NDESC (sizeof descs / sizeof descs[0])

/* The allocator's name is "name" inside its JSON object. */
static const char *
json_key (size_t i)
{
  return descs[i].section == BCF_SECTION_ALLOCATOR &&
    descs[i].kind == BCF_KIND_STATE ? "name" : descs[i].name;
}

const struct bcf_stat_desc *
bcf_stat_descs (size_t *n)
{
  *n = NDESC;
  return descs;
}

const struct bcf_stat_desc *
bcf_stat_find (const char *name)
{
  for (size_t i = 0; i < NDESC; i++)
    if (strcmp (descs[i].name, name) == 0)
      return &descs[i];
  return NULL;
}

/* ---- Snapshots ------------------------------------------------------------ */

static const char *
detach_name (enum bcf_detach_state d)
{
  switch (d) {
  case BCF_DETACH_NONE: return "none";
  case BCF_DETACH_DRAINING: return "draining";
  case BCF_DETACH_DONE: return "detached";
  }
  return "unknown";
}

/* Is descriptor i rebased by clear_stats (a counter another layer owns)? */
static bool
rebased (size_t i)
{
  return descs[i].kind == BCF_KIND_COUNTER && getters[i].type != G_VIEW;
}

static uint64_t raw_u64 (const struct bcf_snapshot *s, size_t i);

struct bcf_snapshot *
bcf_snapshot_take (struct bcf_cache *c, struct bcf_req *r)
{
  struct bcf_snapshot *s = calloc (1, sizeof *s);
  struct bcf_stats *counters = bcf_cache_counters (c);

  if (s == NULL || (s->base = calloc (NDESC, sizeof *s->base)) == NULL) {
    free (s);
    return NULL;
  }
  bcf_cache_stats (c, &s->cache);
  s->dirty_data = s->cache.dirty_sectors << 9;
  if (r) {
    s->have_req = true;
    bcf_req_get_stats (r, &s->req);
    s->cache_mode = bcf_cache_mode_name (bcf_req_mode (r));
    s->sequential_cutoff = bcf_req_sequential_cutoff (r);
    s->sequential_bypass =
      bcf_sequential_bypass_name (bcf_req_sequential_bypass (r));
    s->detach = detach_name (s->req.detach);
    s->cache_available_percent = 100 - s->req.cache_in_use;
    /* bcache's writeback_rate (bytes/s here) and writeback_rate_debug. */
    s->writeback_rate = (uint64_t) s->req.wb_rate << 9;
    s->wb_target = s->req.wb_target * 512;
    s->wb_dirty = s->req.wb_dirty * 512;
    s->wb_proportional = s->req.wb_proportional * 512;
    s->wb_integral = s->req.wb_integral * 512;
    s->wb_change = s->req.wb_change * 512;
  }
  for (int v = 0; v < BCF_VIEW__COUNT; v++)
    bcf_stats_get (counters, (enum bcf_stat_view) v, s->views[v]);
  for (int k = 0; k < BCF_LAT__COUNT; k++)
    bcf_stats_latency_get (counters, (enum bcf_latency) k, &s->lat[k]);
  bcf_stats_get_base (counters, s->base, NDESC);
  return s;
}

void
bcf_snapshot_set_allocator (struct bcf_snapshot *s, const char *name,
                            uint64_t allocated, uint64_t resident)
{
  s->have_alloc = true;
  s->alloc_name = name;
  s->allocated = allocated;
  s->resident = resident;
}

void
bcf_snapshot_free (struct bcf_snapshot *s)
{
  if (s) {
    free (s->base);
    free (s);
  }
}

static const void *
field (const struct bcf_snapshot *s, size_t i)
{
  return (const char *) s + getters[i].off;
}

/* A counter's value as kept, before the clear_stats base is taken off. */
static uint64_t
raw_u64 (const struct bcf_snapshot *s, size_t i)
{
  return *(const uint64_t *) field (s, i);
}

static bool
present (const struct bcf_snapshot *s, size_t i)
{
  switch (getters[i].need) {
  case N_CACHE: return true;
  case N_REQ: return s->have_req;
  case N_ALLOC: return s->have_alloc;
  }
  return false;
}

static bool
get (const struct bcf_snapshot *s, size_t i, enum bcf_stat_view v,
     struct bcf_stat_value *out)
{
  const struct getter *g = &getters[i];

  memset (out, 0, sizeof *out);
  if (!present (s, i))
    return false;
  out->type = BCF_VALUE_U64;
  switch (g->type) {
  case G_U64:
    out->u = raw_u64 (s, i);
    if (rebased (i))
      out->u = out->u > s->base[i] ? out->u - s->base[i] : 0;
    break;
  case G_UINT:
    out->u = *(const unsigned *) field (s, i);
    break;
  case G_I64:
    out->type = BCF_VALUE_I64;
    out->i = *(const int64_t *) field (s, i);
    break;
  case G_BOOL:
    out->type = BCF_VALUE_BOOL;
    out->b = *(const bool *) field (s, i);
    break;
  case G_BOOL01:
    out->u = *(const bool *) field (s, i);
    break;
  case G_STR:
    out->type = BCF_VALUE_STR;
    out->s = *(const char *const *) field (s, i);
    break;
  case G_TIME:
    out->type = BCF_VALUE_TIME;
    out->t = *(const struct bcf_time_stat *) field (s, i);
    break;
  case G_VIEW:
    if ((unsigned) v >= BCF_VIEW__COUNT)
      return false;
    if (g->arg < BCF_STAT__COUNT)
      out->u = s->views[v][g->arg];
    else {
      uint64_t lookups = s->views[v][BCF_STAT_HITS] +
                         s->views[v][BCF_STAT_MISSES];
      out->u = lookups ? s->views[v][BCF_STAT_HITS] * 100 / lookups : 0;
    }
    break;
  }
  return true;
}

bool
bcf_stat_get (const struct bcf_snapshot *s, const struct bcf_stat_desc *d,
              enum bcf_stat_view v, struct bcf_stat_value *out)
{
  if (d == NULL || d < descs || d >= descs + NDESC) {
    memset (out, 0, sizeof *out);
    return false;
  }
  return get (s, (size_t) (d - descs), v, out);
}

int
bcf_stats_clear_all (struct bcf_cache *c, struct bcf_req *r)
{
  struct bcf_snapshot *s = bcf_snapshot_take (c, r);
  int err;

  if (s == NULL)
    return -ENOMEM;
  /* The new base: what the counters hold now, before any base. */
  for (size_t i = 0; i < NDESC; i++)
    s->base[i] = rebased (i) && present (s, i) ? raw_u64 (s, i) : 0;
  err = bcf_stats_set_base (bcf_cache_counters (c), s->base, NDESC);
  bcf_snapshot_free (s);
  if (err < 0)
    return err;
  bcf_stats_clear (bcf_cache_counters (c));
  bcf_cache_clear_time_stats (c);
  return 0;
}

/* ---- Text ----------------------------------------------------------------- */

static void
text_time (FILE *fp, const char *name, enum bcf_stat_kind kind,
           const struct bcf_time_stat *t)
{
  bool first = true;

  if (kind == BCF_KIND_HISTOGRAM) {
    fprintf (fp, "%-28s count %" PRIu64 ", p50 %.3f ms, p99 %.3f ms, "
             "max %.3f ms\n", name, t->count,
             bcf_time_stat_quantile_ns (t, 0.5) / 1e6,
             bcf_time_stat_quantile_ns (t, 0.99) / 1e6, t->max_ns / 1e6);
    return;
  }
  fprintf (fp, "%-28s count %" PRIu64 ", avg %.3f ms, max %.3f ms", name,
           t->count, t->count ? t->total_ns / 1e6 / (double) t->count : 0.0,
           t->max_ns / 1e6);
  for (unsigned b = 0; b < BCF_TIME_HIST; b++) {
    if (!t->hist[b])
      continue;
    fprintf (fp, "%s%" PRIu64 "us:%" PRIu64, first ? ", hist " : " ",
             bcf_time_hist_floor_us (b), t->hist[b]);
    first = false;
  }
  fputc ('\n', fp);
}

static void
text_value (FILE *fp, size_t i, const struct bcf_stat_value *v)
{
  const char *name = descs[i].name;

  switch (v->type) {
  case BCF_VALUE_U64:
    fprintf (fp, "%-28s %" PRIu64 "\n", name, v->u);
    break;
  case BCF_VALUE_I64:
    fprintf (fp, "%-28s %" PRIi64 "\n", name, v->i);
    break;
  case BCF_VALUE_BOOL:
    fprintf (fp, "%-28s %s\n", name, v->b ? "yes" : "no");
    break;
  case BCF_VALUE_STR:
    fprintf (fp, "%-28s %s\n", name, v->s);
    break;
  case BCF_VALUE_TIME:
    text_time (fp, name, descs[i].kind, &v->t);
    break;
  }
}

/* Every statistic of a section, in table order. */
static void
text_section (FILE *fp, const struct bcf_snapshot *s,
              enum bcf_stat_section sec, enum bcf_stat_view view)
{
  struct bcf_stat_value v;

  for (size_t i = 0; i < NDESC; i++)
    if (descs[i].section == sec && get (s, i, view, &v))
      text_value (fp, i, &v);
}

static void
render_text (const struct bcf_snapshot *s, FILE *fp)
{
  text_section (fp, s, BCF_SECTION_TOP, BCF_VIEW_TOTAL);
  for (int v = 0; v < BCF_VIEW__COUNT; v++) {
    fprintf (fp, "[%s]\n", bcf_stat_view_name ((enum bcf_stat_view) v));
    text_section (fp, s, BCF_SECTION_VIEWS, (enum bcf_stat_view) v);
  }
  fprintf (fp, "[cache]\n");
  text_section (fp, s, BCF_SECTION_ENGINE, BCF_VIEW_TOTAL);
  if (s->have_alloc) {
    fprintf (fp, "[allocator]\n");
    text_section (fp, s, BCF_SECTION_ALLOCATOR, BCF_VIEW_TOTAL);
  }
}

/* ---- JSON ----------------------------------------------------------------- */

/* A time stat: count, total, max, last and the histogram ("hist_us": the
 * lower bound of each non-empty bucket in us to its count); a latency
 * histogram has p50 and p99 instead of last. */
static json_object *
json_time (enum bcf_stat_kind kind, const struct bcf_time_stat *t)
{
  json_object *o = json_object_new_object ();
  json_object *h = json_object_new_object ();

  json_object_object_add (o, "count", json_object_new_uint64 (t->count));
  json_object_object_add (o, "total_ns",
                          json_object_new_uint64 (t->total_ns));
  if (kind == BCF_KIND_HISTOGRAM) {
    json_object_object_add (o, "p50_ns", json_object_new_uint64
                            (bcf_time_stat_quantile_ns (t, 0.5)));
    json_object_object_add (o, "p99_ns", json_object_new_uint64
                            (bcf_time_stat_quantile_ns (t, 0.99)));
  }
  json_object_object_add (o, "max_ns", json_object_new_uint64 (t->max_ns));
  if (kind != BCF_KIND_HISTOGRAM)
    json_object_object_add (o, "last_ns",
                            json_object_new_uint64 (t->last_ns));
  for (unsigned b = 0; b < BCF_TIME_HIST; b++) {
    char key[24];

    if (!t->hist[b])
      continue;
    snprintf (key, sizeof key, "%" PRIu64, bcf_time_hist_floor_us (b));
    json_object_object_add (h, key, json_object_new_uint64 (t->hist[b]));
  }
  json_object_object_add (o, "hist_us", h);
  return o;
}

static json_object *
json_value (size_t i, const struct bcf_stat_value *v)
{
  switch (v->type) {
  case BCF_VALUE_U64: return json_object_new_uint64 (v->u);
  case BCF_VALUE_I64: return json_object_new_int64 (v->i);
  case BCF_VALUE_BOOL: return json_object_new_boolean (v->b);
  case BCF_VALUE_STR: return json_object_new_string (v->s);
  case BCF_VALUE_TIME: return json_time (descs[i].kind, &v->t);
  }
  return NULL;
}

/* Add to o the statistics of a section for which want (flags) holds. */
static void
json_section (json_object *o, const struct bcf_snapshot *s,
              enum bcf_stat_section sec, enum bcf_stat_view view,
              unsigned flag, bool with_flag)
{
  struct bcf_stat_value v;

  for (size_t i = 0; i < NDESC; i++)
    if (descs[i].section == sec &&
        ((descs[i].flags & flag) != 0) == with_flag &&
        !(sec == BCF_SECTION_VIEWS && view == BCF_VIEW__COUNT &&
          getters[i].arg == BCF_STAT__COUNT) &&
        get (s, i, view == BCF_VIEW__COUNT ? BCF_VIEW_TOTAL : view, &v))
      json_object_object_add (o, json_key (i), json_value (i, &v));
}

static int
render_json (const struct bcf_snapshot *s, FILE *fp)
{
  json_object *root = json_object_new_object ();
  json_object *views = json_object_new_object ();
  json_object *engine = json_object_new_object ();
  int r = 0;

  json_section (root, s, BCF_SECTION_TOP, BCF_VIEW_TOTAL, 0, false);
  /* The totals at the top level too, under bcache's names (without the
   * ratio: BCF_VIEW__COUNT). */
  json_section (root, s, BCF_SECTION_VIEWS, BCF_VIEW__COUNT, 0, false);
  for (int v = 0; v < BCF_VIEW__COUNT; v++) {
    json_object *one = json_object_new_object ();

    json_section (one, s, BCF_SECTION_VIEWS, (enum bcf_stat_view) v, 0,
                  false);
    json_object_object_add (views,
                            bcf_stat_view_name ((enum bcf_stat_view) v),
                            one);
  }
  json_object_object_add (root, "views", views);
  json_section (engine, s, BCF_SECTION_ENGINE, BCF_VIEW_TOTAL,
                BCF_STAT_JSON_TOP, false);
  json_object_object_add (root, "engine", engine);
  json_section (root, s, BCF_SECTION_ENGINE, BCF_VIEW_TOTAL,
                BCF_STAT_JSON_TOP, true);
  if (s->have_alloc) {
    json_object *alloc = json_object_new_object ();

    json_section (alloc, s, BCF_SECTION_ALLOCATOR, BCF_VIEW_TOTAL, 0, false);
    json_object_object_add (root, "allocator", alloc);
  }
  if (fprintf (fp, "%s\n", json_object_to_json_string_ext
               (root, JSON_C_TO_STRING_SPACED |
                JSON_C_TO_STRING_NOSLASHESCAPE)) < 0)
    r = -1;
  json_object_put (root);
  return r;
}

/* ---- Prometheus ----------------------------------------------------------- */

static const char *
unit_word (enum bcf_stat_unit u)
{
  switch (u) {
  case BCF_UNIT_BYTES: return "bytes";
  case BCF_UNIT_NS: case BCF_UNIT_US: case BCF_UNIT_SECONDS:
    return "seconds";
  case BCF_UNIT_PERCENT: return "percent";
  case BCF_UNIT_NONE: break;
  }
  return NULL;
}

static bool
ends_with (const char *s, size_t len, const char *end)
{
  size_t n = strlen (end);

  return len >= n && memcmp (s + len - n, end, n) == 0;
}

/* The family name: prefix, the name without a _ns or _us suffix, the
 * unit's word unless the name ends with it, and suffix ("_total" for a
 * counter, "" or e.g. "_decayed"). */
static void
prom_name (char *buf, size_t len, size_t i, const char *suffix)
{
  const struct bcf_stat_desc *d = &descs[i];
  const char *word = unit_word (d->unit);
  size_t n = strlen (d->name);

  if (d->unit == BCF_UNIT_NS || d->unit == BCF_UNIT_US)
    n -= ends_with (d->name, n, "_ns") || ends_with (d->name, n, "_us")
      ? 3 : 0;
  if (word && ends_with (d->name, n, word))
    word = NULL;
  snprintf (buf, len, PROM_PREFIX "%.*s%s%s%s", (int) n, d->name,
            word ? "_" : "", word ? word : "", suffix);
}

/* A figure in the family's unit (seconds for durations). */
static double
prom_scale (size_t i, double x)
{
  switch (descs[i].unit) {
  case BCF_UNIT_NS: return x / 1e9;
  case BCF_UNIT_US: return x / 1e6;
  default: return x;
  }
}

static void
prom_header (FILE *fp, const char *name, const char *help, const char *type)
{
  fprintf (fp, "# HELP %s ", name);
  for (; *help; help++)         /* the format's escapes: \\ and \n */
    if (*help == '\\')
      fputs ("\\\\", fp);
    else if (*help == '\n')
      fputs ("\\n", fp);
    else
      fputc (*help, fp);
  fprintf (fp, "\n# TYPE %s %s\n", name, type);
}

static void
prom_label_value (FILE *fp, const char *s)
{
  fputc ('"', fp);
  for (; *s; s++)
    if (*s == '\\' || *s == '"')
      fprintf (fp, "\\%c", *s);
    else if (*s == '\n')
      fputs ("\\n", fp);
    else
      fputc (*s, fp);
  fputc ('"', fp);
}

static void
prom_number (FILE *fp, size_t i, const struct bcf_stat_value *v)
{
  const bool scaled = descs[i].unit == BCF_UNIT_NS ||
                      descs[i].unit == BCF_UNIT_US;
  const double x = v->type == BCF_VALUE_I64 ? (double) v->i : (double) v->u;

  if (scaled)
    fprintf (fp, "%.9g\n", prom_scale (i, x));
  else if (v->type == BCF_VALUE_I64)
    fprintf (fp, "%" PRIi64 "\n", v->i);
  else
    fprintf (fp, "%" PRIu64 "\n", v->u);
}

static void
prom_histogram (FILE *fp, size_t i, const struct bcf_time_stat *t)
{
  char name[128];
  uint64_t cum = 0;

  prom_name (name, sizeof name, i, "");
  prom_header (fp, name, descs[i].help, "histogram");
  /* Bucket b holds [floor (b), floor (b + 1)) us: its le is floor
   * (b + 1); the last one has no upper bound. */
  for (unsigned b = 0; b + 1 < BCF_TIME_HIST; b++) {
    cum += t->hist[b];
    fprintf (fp, "%s_bucket{le=\"%.9g\"} %" PRIu64 "\n", name,
             bcf_time_hist_floor_us (b + 1) / 1e6, cum);
  }
  fprintf (fp, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, t->count);
  fprintf (fp, "%s_sum %.9g\n%s_count %" PRIu64 "\n", name,
           t->total_ns / 1e9, name, t->count);
  prom_name (name, sizeof name, i, "");
  strncat (name, "_max", sizeof name - strlen (name) - 1);
  prom_header (fp, name, "The longest of them.", "gauge");
  fprintf (fp, "%s %.9g\n", name, t->max_ns / 1e9);
}

static void
prom_one (FILE *fp, const struct bcf_snapshot *s, size_t i)
{
  const struct bcf_stat_desc *d = &descs[i];
  struct bcf_stat_value v;
  char name[128];

  if (!get (s, i, BCF_VIEW_TOTAL, &v))
    return;
  if (getters[i].type == G_VIEW) {
    bool counter = d->kind == BCF_KIND_COUNTER;

    if (counter) {
      prom_name (name, sizeof name, i, "_total");
      prom_header (fp, name, d->help, "counter");
      fprintf (fp, "%s ", name);
      prom_number (fp, i, &v);
    }
    /* bcache's decayed views (the hit ratio: every view) as labels. */
    prom_name (name, sizeof name, i, counter ? "_decayed" : "");
    prom_header (fp, name, counter
                 ? "bcache's exponentially decayed views of the counter "
                   "of the same name (stats_five_minute, stats_hour, "
                   "stats_day)." : d->help, "gauge");
    for (int view = counter ? 1 : 0; view < BCF_VIEW__COUNT; view++) {
      get (s, i, (enum bcf_stat_view) view, &v);
      fprintf (fp, "%s{view=\"%s\"} ", name,
               bcf_stat_view_name ((enum bcf_stat_view) view));
      prom_number (fp, i, &v);
    }
    return;
  }
  switch (v.type) {
  case BCF_VALUE_TIME:
    prom_histogram (fp, i, &v.t);
    return;
  case BCF_VALUE_STR:
    prom_name (name, sizeof name, i, "");
    prom_header (fp, name, d->help, "gauge");
    fprintf (fp, "%s{%s=", name, d->name);
    prom_label_value (fp, v.s);
    fputs ("} 1\n", fp);
    return;
  case BCF_VALUE_BOOL:
    v.type = BCF_VALUE_U64;
    v.u = v.b;
    break;
  case BCF_VALUE_U64: case BCF_VALUE_I64:
    break;
  }
  prom_name (name, sizeof name, i,
             d->kind == BCF_KIND_COUNTER ? "_total" : "");
  prom_header (fp, name, d->help,
               d->kind == BCF_KIND_COUNTER ? "counter" : "gauge");
  fprintf (fp, "%s ", name);
  prom_number (fp, i, &v);
}

static void
render_prometheus (const struct bcf_snapshot *s, FILE *fp)
{
  for (size_t i = 0; i < NDESC; i++)
    prom_one (fp, s, i);
}

int
bcf_snapshot_render (const struct bcf_snapshot *s, enum bcf_stats_format f,
                     FILE *fp)
{
  switch (f) {
  case BCF_STATS_TEXT:
    render_text (s, fp);
    break;
  case BCF_STATS_JSON:
    if (render_json (s, fp) < 0)
      return -1;
    break;
  case BCF_STATS_PROMETHEUS:
    render_prometheus (s, fp);
    break;
  default:
    errno = EINVAL;
    return -1;
  }
  return ferror (fp) ? -1 : 0;
}
