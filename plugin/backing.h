/* nbdkit-bcachefilter-filter: the backing store as the engine sees it
 * (backing.c).
 *
 * The engine reaches the export only through struct bcf_backing
 * (bcachefilter/backing.h).  Each request wraps its connection's
 * nbdkit_next in a struct bk on the stack, so the request path can reach
 * the export without knowing nbdkit: FUA where the plugin has it natively
 * (else a write and a flush), the client's FAST_ZERO flag passed on, and
 * nbdkit's errors turned into negative errnos.
 *
 * Locking: none for a struct bk, which lives for one request, on its
 * thread.  The background store opens its context under bg_lock.  When
 * the export's thread model is not PARALLEL, every call into it takes
 * plugin_lock (inside bg_lock), held for that call only (backing.c says
 * why).
 */
#ifndef BCACHEFILTER_PLUGIN_BACKING_H
#define BCACHEFILTER_PLUGIN_BACKING_H

#include <stdbool.h>
#include <stdint.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#include "bcachefilter/backing.h"

struct bk {
  nbdkit_next *next;
  uint32_t flags;               /* of the client request (FAST_ZERO) */
  bool fua_native;
  /* The export can flush.  If it cannot, nbdkit offers no flush to the
   * clients either, and its writes are as durable as they get: a flush
   * is a no-op. */
  bool can_flush;
};

/* The thread model nbdkit chose for the chain (.get_ready): anything
 * but PARALLEL serialises the filter's calls into the export. */
void bk_set_thread_model (int thread_model);
/* next->get_size and next->extents, serialised as the model needs (the
 * filter's other calls into the export go through struct bk). */
int64_t bk_next_get_size (nbdkit_next *next);
int bk_next_extents (nbdkit_next *next, uint32_t count, uint64_t offset,
                     uint32_t flags, struct nbdkit_extents *extents,
                     int *err);

/* A request's view of the backing store: b calls next through k. */
void bk_init (struct bk *k, struct bcf_backing *b, nbdkit_next *next,
              uint32_t flags);

/* The background backing store: a context of the filter's own on the
 * export, for the work that has no client connection to use (the
 * writeback thread).  It is opened when it is first used, not in
 * .after_fork: with nbdkit-nbd-plugin every open of such a context
 * prints "error: no connection in this thread" (lifecycle.h; opening it
 * from a client connection's thread does not help: nbdkit 1.32 gives a
 * shared context no connection either, tried), and most
 * runs never use it (the writeback thread writes only dirty data, which
 * in the clean modes exists only where a crash left some).  A call that
 * cannot open it fails with -EIO (the writeback tries again later).
 * bk_background_init gives it the backend (from .after_fork, valid until
 * .cleanup); bk_background_close closes it once nothing uses it. */
void bk_background_init (nbdkit_backend *backend);
const struct bcf_backing *bk_background (void);
void bk_background_close (void);

#endif /* BCACHEFILTER_PLUGIN_BACKING_H */
