/* bcachefilter engine: what core/metrics.c (the descriptors, snapshots
 * and renderers of bcachefilter/stats.h) needs from core/stats.c.
 *
 * clear_stats rebases the counters that other layers own: their values
 * at the clear are kept with the cache's counters (struct bcf_stats), one
 * per descriptor, and every snapshot subtracts them.
 *
 * Locking: both take the counters' mutex.
 */
#ifndef BCACHEFILTER_METRICS_H
#define BCACHEFILTER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "bcachefilter/stats.h"

/* Keep base[0..n) (copied).  0 or -ENOMEM (the old base stays). */
int bcf_stats_set_base (struct bcf_stats *s, const uint64_t *base, size_t n);
/* base[0..n) gets the kept values (0 past what was kept). */
void bcf_stats_get_base (struct bcf_stats *s, uint64_t *base, size_t n);

#endif /* BCACHEFILTER_METRICS_H */
