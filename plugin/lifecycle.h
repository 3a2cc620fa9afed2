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
 *     slot 0 (core/super.c), keeping what the control socket set
 *     meanwhile (current_settings).  Other connections wait for that in their
 *     .prepare.  A failure there shuts the server down, with the reason
 *     in the log;
 *   - a bcache backing device is known only from the export itself: with
 *     bcache-backing-device=auto the first connection of such a cache
 *     reads the export's first 8 KiB (bcf_bdev_probe).  A backing
 *     superblock there makes the device's uuid the identity and its data
 *     region what the clients see (data_offset: .get_size and block
 *     status are shifted, and the request layer adds it to every
 *     request, so keys are at the device's sectors, as the kernel's
 *     are); the device is marked attached once the cache is open
 *     (core/bdev.c).  A cache that holds a backing device's data (its
 *     entry records no size) is not opened at all before that
 *     connection, as its slot is someone's: until then the control
 *     socket answers that the cache is not open.  A cache that recorded
 *     its export's size holds a plain export, served whole as before,
 *     without that read.
 * The writeback thread, which has no connection, reaches the export
 * through a shared context of the filter's own (bk_background,
 * backing.c), opened when it is first used: with the nbd plugin that
 * open prints the line above, once, and only in a run that has dirty
 * data to write back (in the clean modes: what a crash left).
 *
 * Detach
 * ------
 * bcachefilter-ctl detach (before the export is used from another host):
 * a thread of its own drains the request layer (no new dirty data,
 * everything written back: bcf_req_detach_drain, which argues the
 * ordering), detaches a bcache backing device on its superblock
 * (bcf_bdev_detach, as the kernel's detach does), then marks the cache
 * detached and passes everything through for the rest of the process
 * (bcf_req_detach_finish; the next start begins with nothing cached for
 * the export).  The control socket starts it and reads how it stands
 * (detach_status), so its serving thread never waits for the export.  A
 * failure before the mark (the export fails the writeback, or the
 * superblock write) leaves everything as it was.  .cleanup stops a drain
 * under way (nothing changes) and joins the thread before closing.
 *
 * Locking: cache and req change only in .after_fork, in the one attach
 * (under state_lock for writing, before any connection has passed
 * .prepare) and in .cleanup (after the last connection).  The request
 * callbacks read req without a lock: their connection's .prepare
 * returned after the attach.  The control socket's operations run on its
 * own thread and hold state_lock for reading, as the detach thread does
 * for its whole run; detach_lock guards the detach's phase and message.
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
/* .prepare: the first connection attaches a new cache to its export
 * (and learns whether that is a bcache backing device); every connection
 * then checks that its export is the one the cache serves.  0, or -1
 * after nbdkit_error said why not. */
int lifecycle_check_export (nbdkit_next *next);
/* Where the clients' bytes begin in the export: a bcache backing
 * device's data offset, else 0.  Constant once a connection passed
 * .prepare. */
uint64_t lifecycle_data_offset (void);

#endif /* BCACHEFILTER_PLUGIN_LIFECYCLE_H */
