/* nbdkit-bcachefilter-filter: the control socket's renderers (render.c).
 *
 * The only place in the filter that turns the cache's state into text:
 * the statistics (bcachefilter-ctl stats) and the superblock (show
 * super), each as aligned "name value" text or as one JSON object.  The
 * engine's figures come from its public calls (bcf_cache_stats,
 * bcf_req_get_stats, the decayed counters of bcachefilter/stats.h).
 *
 * Locking: none here; the calls they make take the engine's locks, and
 * the caller keeps the cache open while they run.
 */
#ifndef BCACHEFILTER_PLUGIN_RENDER_H
#define BCACHEFILTER_PLUGIN_RENDER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "bcachefilter/cache.h"
#include "bcachefilter/request.h"

/* The statistics of cache c and request layer r. */
void render_stats (FILE *fp, bool json, struct bcf_cache *c,
                   struct bcf_req *r);
/* The superblock of c (at path, in front of an export of export_size
 * bytes) and how the device is driven. */
void render_super (FILE *fp, bool json, const struct bcf_cache *c,
                   const char *path, uint64_t export_size);

#endif /* BCACHEFILTER_PLUGIN_RENDER_H */
