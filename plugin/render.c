/* nbdkit-bcachefilter-filter: the control socket's renderers (see
 * render.h): the statistics through the engine's one table
 * (bcachefilter/stats.h), with the allocator's figures added; the
 * superblock here. */
#include "config.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>

#include <json.h>

#include "bcachefilter/format.h"
#include "bcachefilter/stats.h"
#include "allocator.h"
#include "render.h"

int
render_stats (FILE *fp, enum bcf_stats_format f, struct bcf_cache *cache,
              struct bcf_req *req)
{
  struct bcf_snapshot *snap = bcf_snapshot_take (cache, req);
  struct allocator_stats a;
  int r;

  if (snap == NULL)
    return -1;
  if (allocator_stats (&a))
    bcf_snapshot_set_allocator (snap, a.name, a.allocated, a.resident);
  r = bcf_snapshot_render (snap, f, fp);
  bcf_snapshot_free (snap);
  return r;
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
    json_object *o = json_object_new_object ();

    json_object_object_add (o, "path", json_object_new_string (path));
    json_object_object_add (o, "version", json_object_new_uint64 (sb->version));
    json_object_object_add (o, "cset_uuid", json_object_new_string (set_uuid));
    json_object_object_add (o, "dev_uuid", json_object_new_string (uuid));
    json_object_object_add (o, "block_size", json_object_new_uint64
                            ((uint64_t) sb->block_size << 9));
    json_object_object_add (o, "bucket_size", json_object_new_uint64
                            ((uint64_t) sb->bucket_size << 9));
    json_object_object_add (o, "nbuckets", json_object_new_uint64 (sb->nbuckets));
    json_object_object_add (o, "first_bucket",
                            json_object_new_uint64 (sb->first_bucket));
    json_object_object_add (o, "njournal_buckets",
                            json_object_new_uint64 (sb->njournal_buckets));
    json_object_object_add (o, "sync", json_object_new_boolean
                            (sb->flags & BCH_CACHE_SYNC));
    json_object_object_add (o, "io", json_object_new_string
                            (bcf_cache_io_name (cache)));
    json_object_object_add (o, "direct", json_object_new_boolean
                            (bcf_cache_io_direct (cache)));
    json_object_object_add (o, "export_size",
                            json_object_new_uint64 (export_size));
    fprintf (fp, "%s\n", json_object_to_json_string_ext
             (o, JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE));
    json_object_put (o);
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
