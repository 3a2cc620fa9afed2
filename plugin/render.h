/* nbdkit-bcachefilter-filter: the control socket's renderers (render.c).
 *
 * The only place in the filter that turns the cache's state into text:
 * the statistics (bcachefilter-ctl stats) and the superblock (show
 * super).  The statistics are a snapshot of the engine's rendered by the
 * engine's own renderers (bcachefilter/stats.h: text, JSON or
 * Prometheus), with the process's allocator added; the superblock is
 * aligned "name value" text or one JSON object (json-c).
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
#include "bcachefilter/stats.h"

/* The statistics of cache c and request layer r in format f.  0, or -1
 * (out of memory, a write error). */
int render_stats (FILE *fp, enum bcf_stats_format f, struct bcf_cache *c,
                  struct bcf_req *r);
/* The superblock of c (at path, in front of an export of export_size
 * bytes) and how the device is driven. */
void render_super (FILE *fp, bool json, const struct bcf_cache *c,
                   const char *path, uint64_t export_size);

#endif /* BCACHEFILTER_PLUGIN_RENDER_H */
