/* nbdkit-bcachefilter-filter: the cache's life in the filter
 * (lifecycle.c).
 *
 * One cache serves every connection.  It is claimed and probed in
 * .get_ready (probe.c), opened in .after_fork (journal replay, identity
 * check, the engine's threads, the control socket), and closed in
 * .cleanup (a checkpoint; correctness never depends on it: the engine
 * recovers from a crash at any point).  Each connection's .prepare
 * checks that its export is the one the cache was opened for.
 *
 * Locking: cache and req are set before the server starts serving and
 * cleared at cleanup, after the last connection; the request callbacks
 * read req without a lock.  The control socket's operations run on its
 * own thread and only read (or set the request layer's settings, which
 * are atomic).
 */
#ifndef BCACHEFILTER_PLUGIN_LIFECYCLE_H
#define BCACHEFILTER_PLUGIN_LIFECYCLE_H

#include <stdint.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#include "bcachefilter/request.h"

/* The request layer, for the request callbacks (bcachefilter.c). */
extern struct bcf_req *req;

int filter_get_ready (int thread_model);
int filter_after_fork (nbdkit_backend *backend);
void filter_cleanup (nbdkit_backend *backend);
/* .prepare: is this connection's export, of size bytes, the one the
 * cache serves?  0, or -1 after nbdkit_error said why not. */
int lifecycle_check_export (int64_t size);

#endif /* BCACHEFILTER_PLUGIN_LIFECYCLE_H */
