/* nbdkit-bcachefilter-filter: the checks before nbdkit forks (probe.c).
 *
 * .get_ready runs before nbdkit forks into the background and starts
 * serving, so whatever would make the cache unusable is refused there,
 * with a message, while the operator still sees nbdkit fail to start:
 * a cache file that cannot be created, a device another process holds,
 * and everything the engine's open would refuse, found by the engine's
 * own classification (bcf_device_probe, bcachefilter/probe.h).
 *
 * Locking: called once, before any other thread exists.
 */
#ifndef BCACHEFILTER_PLUGIN_PROBE_H
#define BCACHEFILTER_PLUGIN_PROBE_H

#include "bcachefilter/claim.h"
#include "bcachefilter/probe.h"

/* Make sure the cache can be created (if it is missing), claim it
 * (bcachefilter/claim.h; claiming a missing file creates it) and probe
 * it: 0 with the claim in *claim and what the device holds in *v, or -1
 * after nbdkit_error said why the cache cannot be used. */
int probe_cache (struct bcf_claim **claim, struct bcf_device_verdict *v);

/* The bucket size (sectors) a format of a device of size bytes gets:
 * bcache-bucket-size=, or the engine's default, which shrinks on a small
 * device so that the Linux kernel can register the cache (more than 512
 * buckets).  The filter passes it to the engine itself: the default is
 * not a warning for an operator (nothing in the log but debug lines). */
unsigned probe_format_bucket_sectors (uint64_t size);

#endif /* BCACHEFILTER_PLUGIN_PROBE_H */
