/* nbdkit-bcachefilter-filter: the cache's life in the filter
 * (lifecycle.c).
 *
 * One cache serves every connection.  It is claimed and probed in
 * .get_ready (probe.c), opened in .after_fork (journal replay, identity
 * check, the engine's threads, the control socket), and closed in
 * .cleanup (a checkpoint; correctness never depends on it: the engine
 * recovers from a crash at any point).
 *
 * The export's size
 * -----------------
 * The cache records the export it holds: its uuid and its size.  The
 * filter learns the export's real size only from a connection: .prepare
 * asks its own next context (lifecycle_check_export), before the
 * connection's first request, and refuses an export whose size is not
 * the cache's.  .after_fork opens no backend context of its own, because
 * with nbdkit-nbd-plugin (1.32) every context opened outside a client
 * connection (nbdkit_next_context_open with shared=1, the only kind a
 * thread without a connection may use) prints "nbdkit: error: no
 * connection in this thread": the plugin's .open calls
 * nbdkit_export_name() whenever it is not in shared=true mode, and
 * nbdkit hides the client connection from a shared context even when it
 * is opened from a connection's thread.  (The context works all the
 * same.)  So:
 *   - a cache that has recorded its export (every start but the first)
 *     is opened in .after_fork with the size it recorded, which the
 *     probe in .get_ready read;
 *   - a new cache (blank, made by make-bcache, formatted by
 *     bcachefilter-format or forced) has no export yet: .after_fork
 *     formats or opens it without one (uuid slot 0 left unclaimed, size
 *     0: the control socket works, no request can be served), and the
 *     first connection's .prepare attaches it to its export: close and
 *     open again with the export's identity and size, which claims uuid
 *     slot 0 (core/super.c).  Other connections wait for that in their
 *     .prepare.
 * The writeback thread, which has no connection, reaches the export
 * through a shared context of the filter's own (bk_background,
 * backing.c), opened when it is first used: with the nbd plugin that
 * open prints the line above, once, and only in a run that has dirty
 * data to write back (in the clean modes: what a crash left).
 *
 * Locking: cache and req change only in .after_fork, in the one attach
 * (under state_lock for writing, before any connection has passed
 * .prepare) and in .cleanup (after the last connection).  The request
 * callbacks read req without a lock: their connection's .prepare
 * returned after the attach.  The control socket's operations run on its
 * own thread and hold state_lock for reading.
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
/* .prepare: this connection's export has size bytes.  Attach a new cache
 * to it (the first time), then check that it is the export the cache
 * serves.  0, or -1 after nbdkit_error said why not. */
int lifecycle_check_export (int64_t size);

#endif /* BCACHEFILTER_PLUGIN_LIFECYCLE_H */
