/* nbdkit-bcachefilter-filter: the control socket's renderers (see
 * render.h). */
#include "config.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>

#include "bcachefilter/format.h"
#include "bcachefilter/stats.h"
#include "allocator.h"
#include "render.h"

/* A time stat: count, average, max and the log-scale histogram (JSON:
 * "hist_us", an object from each non-empty bucket's lower bound in
 * microseconds to its count; text: "floor_us:count" pairs). */
static void
print_time_stat (FILE *fp, bool json, const char *name,
                 const struct bcf_time_stat *t, bool *first)
{
  bool hfirst = true;

  if (json)
    fprintf (fp, "%s\"%s\": {\"count\": %" PRIu64 ", \"total_ns\": %" PRIu64
             ", \"max_ns\": %" PRIu64 ", \"last_ns\": %" PRIu64
             ", \"hist_us\": {",
             *first ? "" : ", ", name, t->count, t->total_ns, t->max_ns,
             t->last_ns);
  else
    fprintf (fp, "%-28s count %" PRIu64 ", avg %.3f ms, max %.3f ms", name,
             t->count, t->count ? t->total_ns / 1e6 / (double) t->count : 0.0,
             t->max_ns / 1e6);
  for (unsigned i = 0; i < BCF_TIME_HIST; i++) {
    if (!t->hist[i])
      continue;
    if (json)
      fprintf (fp, "%s\"%" PRIu64 "\": %" PRIu64, hfirst ? "" : ", ",
               bcf_time_hist_floor_us (i), t->hist[i]);
    else
      fprintf (fp, "%s%" PRIu64 "us:%" PRIu64, hfirst ? ", hist " : " ",
               bcf_time_hist_floor_us (i), t->hist[i]);
    hfirst = false;
  }
  fprintf (fp, json ? "}}" : "\n");
  *first = false;
}

static void
print_u64 (FILE *fp, bool json, const char *name, uint64_t v, bool *first)
{
  if (json)
    fprintf (fp, "%s\"%s\": %" PRIu64, *first ? "" : ", ", name, v);
  else
    fprintf (fp, "%-28s %" PRIu64 "\n", name, v);
  *first = false;
}

static void
print_i64 (FILE *fp, bool json, const char *name, int64_t v, bool *first)
{
  if (json)
    fprintf (fp, "%s\"%s\": %" PRIi64, *first ? "" : ", ", name, v);
  else
    fprintf (fp, "%-28s %" PRIi64 "\n", name, v);
  *first = false;
}

static void
print_views (FILE *fp, bool json, struct bcf_req *req)
{
  struct bcf_stats *s = bcf_req_counters (req);

  if (json)
    fprintf (fp, "\"views\": {");
  for (int v = 0; v < BCF_VIEW__COUNT; v++) {
    uint64_t c[BCF_STAT__COUNT];
    bool first = true;
    uint64_t lookups;

    bcf_stats_get (s, (enum bcf_stat_view) v, c);
    lookups = c[BCF_STAT_HITS] + c[BCF_STAT_MISSES];
    if (json)
      fprintf (fp, "%s\"%s\": {", v ? ", " : "",
               bcf_stat_view_name ((enum bcf_stat_view) v));
    else
      fprintf (fp, "[%s]\n", bcf_stat_view_name ((enum bcf_stat_view) v));
    for (int k = 0; k < BCF_STAT__COUNT; k++)
      print_u64 (fp, json, bcf_stat_name ((enum bcf_stat_counter) k), c[k],
                 &first);
    print_u64 (fp, json, "cache_hit_ratio",
               lookups ? c[BCF_STAT_HITS] * 100 / lookups : 0, &first);
    if (json)
      fprintf (fp, "}");
  }
  if (json)
    fprintf (fp, "}, ");
}

/* jemalloc's own figures when it is the allocator (allocator.h); nothing
 * otherwise. */
static void
print_allocator (FILE *fp, bool json)
{
  struct allocator_stats a;
  bool first = false;

  if (!allocator_stats (&a))
    return;
  if (json)
    fprintf (fp, ", \"allocator\": {\"name\": \"%s\"", a.name);
  else
    fprintf (fp, "[allocator]\n%-28s %s\n", "allocator", a.name);
  print_u64 (fp, json, "allocated", a.allocated, &first);
  print_u64 (fp, json, "resident", a.resident, &first);
  if (json)
    fprintf (fp, "}");
}

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

void
render_stats (FILE *fp, bool json, struct bcf_cache *cache,
              struct bcf_req *req)
{
  struct bcf_cache_stats st;
  struct bcf_req_stats rs;
  bool first = true;
  uint64_t c[BCF_STAT__COUNT];

  bcf_cache_stats (cache, &st);
  bcf_req_get_stats (req, &rs);
  bcf_stats_get (bcf_req_counters (req), BCF_VIEW_TOTAL, c);

  if (json) {
    fprintf (fp, "{\"cache_mode\": \"%s\", \"sequential_cutoff\": %" PRIu64
             ", \"sequential_bypass\": \"%s\", \"passthrough\": %s, "
             "\"detach\": \"%s\", ",
             bcf_cache_mode_name (bcf_req_mode (req)),
             bcf_req_sequential_cutoff (req),
             bcf_sequential_bypass_name (bcf_req_sequential_bypass (req)),
             rs.passthrough ? "true" : "false", detach_name (rs.detach));
    /* The totals at the top level too, under bcache's names. */
    for (int k = 0; k < BCF_STAT__COUNT; k++)
      fprintf (fp, "\"%s\": %" PRIu64 ", ",
               bcf_stat_name ((enum bcf_stat_counter) k), c[k]);
    print_views (fp, json, req);
    fprintf (fp, "\"engine\": {");
  }
  else {
    fprintf (fp, "%-28s %s\n", "cache_mode",
             bcf_cache_mode_name (bcf_req_mode (req)));
    fprintf (fp, "%-28s %" PRIu64 "\n", "sequential_cutoff",
             bcf_req_sequential_cutoff (req));
    fprintf (fp, "%-28s %s\n", "sequential_bypass",
             bcf_sequential_bypass_name (bcf_req_sequential_bypass (req)));
    fprintf (fp, "%-28s %s\n", "passthrough", rs.passthrough ? "yes" : "no");
    fprintf (fp, "%-28s %s\n", "detach", detach_name (rs.detach));
    print_views (fp, json, req);
    fprintf (fp, "[cache]\n");
  }
  if (!json)      /* at the top level in JSON */
    print_u64 (fp, json, "device_errors", rs.device_errors, &first);
  print_u64 (fp, json, "io_errors", rs.io_errors, &first);
  print_u64 (fp, json, "io_error_limit", rs.io_error_limit, &first);
  print_u64 (fp, json, "io_error_halflife", rs.io_error_halflife, &first);
  print_u64 (fp, json, "nbuckets", st.nbuckets, &first);
  print_u64 (fp, json, "bucket_bytes", st.bucket_bytes, &first);
  print_u64 (fp, json, "block_bytes", st.block_bytes, &first);
  print_u64 (fp, json, "buckets_free", st.buckets_free, &first);
  print_u64 (fp, json, "buckets_clean", st.buckets_clean, &first);
  print_u64 (fp, json, "buckets_dirty", st.buckets_dirty, &first);
  print_u64 (fp, json, "buckets_meta", st.buckets_meta, &first);
  print_u64 (fp, json, "dirty_data", st.dirty_sectors << 9, &first);
  print_u64 (fp, json, "btree_nodes", st.btree_nodes, &first);
  print_u64 (fp, json, "btree_depth", st.btree_depth, &first);
  print_u64 (fp, json, "btree_keys", st.btree_keys, &first);
  print_u64 (fp, json, "btree_cache_bytes", st.btree_cache_bytes, &first);
  print_u64 (fp, json, "btree_evictions", st.btree_evictions, &first);
  print_u64 (fp, json, "btree_loads", st.btree_loads, &first);
  print_u64 (fp, json, "journal_seq", st.journal_seq, &first);
  print_u64 (fp, json, "journal_last_seq", st.journal_last_seq, &first);
  print_u64 (fp, json, "journal_writes", st.journal_writes, &first);
  print_u64 (fp, json, "inserts", st.inserts, &first);
  print_u64 (fp, json, "dirty_inserts", st.dirty_inserts, &first);
  print_u64 (fp, json, "intent_regions", st.intent_regions, &first);
  print_u64 (fp, json, "intent_marks", st.intent_marks, &first);
  print_u64 (fp, json, "intent_clears", st.intent_clears, &first);
  print_u64 (fp, json, "intent_dropped", st.intent_dropped, &first);
  print_u64 (fp, json, "invalidates", st.invalidates, &first);
  print_u64 (fp, json, "export_flushes", st.export_flushes, &first);
  print_u64 (fp, json, "export_flush_errors", st.export_flush_errors,
             &first);
  print_u64 (fp, json, "gc_passes", st.gc_passes, &first);
  print_u64 (fp, json, "gc_slices", st.gc_slices, &first);
  print_u64 (fp, json, "gc_nodes", st.gc_nodes, &first);
  print_u64 (fp, json, "gc_coalesced", st.gc_coalesced, &first);
  print_u64 (fp, json, "gc_slice_nodes_last", st.gc_slice_nodes_last, &first);
  print_u64 (fp, json, "gc_slice_nodes_max", st.gc_slice_nodes_max, &first);
  print_u64 (fp, json, "gc_slices_busy", st.gc_slices_busy, &first);
  print_u64 (fp, json, "requests_in_flight", st.requests_in_flight, &first);
  print_time_stat (fp, json, "gc", &st.gc, &first);
  print_time_stat (fp, json, "btree_split", &st.btree_split, &first);
  print_time_stat (fp, json, "journal_write", &st.journal_write, &first);
  print_time_stat (fp, json, "alloc_wait", &st.alloc_wait, &first);
  print_time_stat (fp, json, "checkpoint", &st.checkpoint, &first);
  print_time_stat (fp, json, "gc_slice_locked", &st.gc_slice_locked, &first);
  print_time_stat (fp, json, "checkpoint_locked", &st.ckpt_locked, &first);
  print_time_stat (fp, json, "lookup_lock_wait", &st.lookup_lock_wait,
                   &first);
  print_u64 (fp, json, "tracker_bytes", rs.bypass_bytes_now, &first);
  print_u64 (fp, json, "tracker_peak_bytes", rs.bypass_bytes_peak, &first);
  print_u64 (fp, json, "tracker_pages", rs.bypass_pages, &first);
  print_u64 (fp, json, "tracker_reserve_uses", rs.bypass_reserve_uses, &first);
  print_u64 (fp, json, "tracker_in_flight", rs.bypass_in_flight, &first);
  print_u64 (fp, json, "fills_dropped", rs.fills_dropped, &first);
  print_u64 (fp, json, "fill_queue_bytes", rs.fill_queue_bytes, &first);
  print_u64 (fp, json, "write_inserts", rs.write_inserts, &first);
  print_u64 (fp, json, "write_collisions", rs.write_collisions, &first);
  print_u64 (fp, json, "write_waits", rs.write_waits, &first);
  print_u64 (fp, json, "write_wait_ns", rs.write_wait_ns, &first);
  print_u64 (fp, json, "write_wait_max_ns", rs.write_wait_max_ns, &first);
  print_u64 (fp, json, "writes_in_flight_peak", rs.writes_in_flight_peak,
             &first);
  print_u64 (fp, json, "tracker_exact_checks", rs.bypass_exact_checks,
             &first);
  print_u64 (fp, json, "bypass_sequential", rs.bypass_sequential, &first);
  print_u64 (fp, json, "bypass_congested", rs.bypass_congested, &first);
  print_u64 (fp, json, "sequential_cached", rs.sequential_cached, &first);
  print_u64 (fp, json, "export_read_ns_per_kib", rs.export_read_ns_per_kib,
             &first);
  print_u64 (fp, json, "cache_read_ns_per_kib", rs.cache_read_ns_per_kib,
             &first);
  print_u64 (fp, json, "congested", st.congested, &first);
  print_u64 (fp, json, "congested_read_threshold_us",
             st.congested_read_threshold_us, &first);
  print_u64 (fp, json, "congested_write_threshold_us",
             st.congested_write_threshold_us, &first);
  print_u64 (fp, json, "writeback_keys_done", rs.writeback_keys_done,
             &first);
  print_u64 (fp, json, "writeback_keys_failed", rs.writeback_keys_failed,
             &first);
  print_u64 (fp, json, "writeback_bytes", rs.writeback_bytes, &first);
  print_u64 (fp, json, "writeback_backing_errors",
             rs.writeback_backing_errors, &first);
  print_u64 (fp, json, "writeback_read_errors", rs.writeback_read_errors,
             &first);
  print_u64 (fp, json, "writeback_writes", rs.writeback_writes, &first);
  print_u64 (fp, json, "writeback_cutoff_writes",
             rs.writeback_cutoff_writes, &first);
  print_u64 (fp, json, "writeback_percent", rs.writeback_percent, &first);
  print_u64 (fp, json, "writeback_delay", rs.writeback_delay, &first);
  print_u64 (fp, json, "writeback_running", rs.writeback_running, &first);
  print_u64 (fp, json, "writeback_flushing", rs.writeback_flushing, &first);
  print_u64 (fp, json, "writeback_rate_update_seconds",
             rs.writeback_update_seconds, &first);
  print_u64 (fp, json, "cache_available_percent", 100 - rs.cache_in_use,
             &first);
  /* bcache's writeback_rate (bytes/s here) and writeback_rate_debug. */
  print_u64 (fp, json, "writeback_rate", (uint64_t) rs.wb_rate << 9, &first);
  print_i64 (fp, json, "writeback_rate_target", rs.wb_target * 512, &first);
  print_i64 (fp, json, "writeback_rate_dirty", rs.wb_dirty * 512, &first);
  print_i64 (fp, json, "writeback_rate_proportional",
             rs.wb_proportional * 512, &first);
  print_i64 (fp, json, "writeback_rate_integral", rs.wb_integral * 512,
             &first);
  print_i64 (fp, json, "writeback_rate_change", rs.wb_change * 512, &first);
  print_u64 (fp, json, "writeback_rate_next_io_ns", rs.wb_next_io_ns,
             &first);
  print_u64 (fp, json, "writeback_rate_at_max", rs.wb_at_max, &first);
  if (json)
    fprintf (fp, "}, \"device_errors\": %" PRIu64, rs.device_errors);
  print_allocator (fp, json);
  if (json)
    fprintf (fp, "}\n");
}

/* A JSON string literal (paths may hold anything). */
static void
json_string (FILE *fp, const char *s)
{
  fputc ('"', fp);
  for (; *s; s++) {
    unsigned char ch = (unsigned char) *s;
    if (ch == '"' || ch == '\\')
      fprintf (fp, "\\%c", ch);
    else if (ch < 0x20)
      fprintf (fp, "\\u%04x", ch);
    else
      fputc (ch, fp);
  }
  fputc ('"', fp);
}

void
render_super (FILE *fp, bool json, const struct bcf_cache *cache,
              const char *path, uint64_t export_size)
{
  const struct bch_sb *sb = bcf_cache_super (cache);
  char set_uuid[37], uuid[37];

  bch_uuid_unparse (sb->set_uuid, set_uuid);
  bch_uuid_unparse (sb->uuid, uuid);
  if (json) {
    fprintf (fp, "{\"path\": ");
    json_string (fp, path);
    fprintf (fp, ", \"version\": %" PRIu64 ", "
             "\"cset_uuid\": \"%s\", \"dev_uuid\": \"%s\", "
             "\"block_size\": %u, \"bucket_size\": %u, \"nbuckets\": %" PRIu64
             ", \"first_bucket\": %u, \"njournal_buckets\": %u, "
             "\"sync\": %s, \"io\": \"%s\", \"direct\": %s, "
             "\"export_size\": %" PRIu64 "}\n",
             sb->version, set_uuid, uuid,
             (unsigned) sb->block_size << 9, (unsigned) sb->bucket_size << 9,
             sb->nbuckets, sb->first_bucket, sb->njournal_buckets,
             sb->flags & BCH_CACHE_SYNC ? "true" : "false",
             bcf_cache_io_name (cache),
             bcf_cache_io_direct (cache) ? "true" : "false", export_size);
  }
  else
    fprintf (fp, "path                 %s\n"
             "sb.version           %" PRIu64 "\n"
             "cset.uuid            %s\n"
             "dev.uuid             %s\n"
             "dev.sectors_per_block %u\n"
             "dev.sectors_per_bucket %u\n"
             "dev.cache.first_bucket %u\n"
             "dev.cache.nbuckets   %" PRIu64 "\n"
             "journal_buckets      %u\n"
             "cache_sync           %s\n"
             "io                   %s%s\n"
             "export_size          %" PRIu64 "\n",
             path, sb->version, set_uuid, uuid,
             (unsigned) sb->block_size, (unsigned) sb->bucket_size,
             sb->first_bucket, sb->nbuckets, sb->njournal_buckets,
             sb->flags & BCH_CACHE_SYNC ? "yes" : "no",
             bcf_cache_io_name (cache),
             bcf_cache_io_direct (cache) ? ", O_DIRECT" : "", export_size);
}
