/* nbdkit-bcachefilter-filter: the backing store as the engine sees it
 * (see backing.h). */
#include "config.h"

#include <errno.h>
#include <pthread.h>

#include "backing.h"

/* ---- the plugin's thread model -------------------------------------------------- */

/* nbdkit serialises the clients' requests as the plugin's thread model
 * asks (it runs the whole chain under the strictest model of its
 * layers), but not the calls the filter's own threads make on its own
 * context (the writeback thread and its writers): nbdkit-filter(3)
 * leaves those to the filter.  So under any model but PARALLEL every
 * call the filter makes into the export takes plugin_lock: one call in
 * the plugin at a time, the strictest model's rule
 * (SERIALIZE_ALL_REQUESTS), whichever serialising model the plugin
 * asked for.  It is held for one call only, and nothing waits for the
 * filter's own locks while holding it, so it adds no lock cycle.  With
 * PARALLEL (nbd, file, memory: the usual exports) it costs one branch. */
static bool serialise;
static pthread_mutex_t plugin_lock = PTHREAD_MUTEX_INITIALIZER;

void
bk_set_thread_model (int thread_model)
{
  serialise = thread_model != NBDKIT_THREAD_MODEL_PARALLEL;
  if (serialise)
    nbdkit_debug ("bcachefilter: the export's thread model is not "
                  "parallel: the filter's calls into it are serialised, "
                  "its background writes included");
}

static void
plugin_enter (void)
{
  if (serialise)
    pthread_mutex_lock (&plugin_lock);
}

static void
plugin_leave (void)
{
  if (serialise)
    pthread_mutex_unlock (&plugin_lock);
}

/* One call into next, serialised as the thread model needs. */
#define PLUGIN_CALL(call) \
  ({ plugin_enter (); __auto_type r_ = (call); plugin_leave (); r_; })

int64_t
bk_next_get_size (nbdkit_next *next)
{
  return PLUGIN_CALL (next->get_size (next));
}

int
bk_next_extents (nbdkit_next *next, uint32_t count, uint64_t offset,
                 uint32_t flags, struct nbdkit_extents *extents, int *err)
{
  return PLUGIN_CALL (next->extents (next, count, offset, flags, extents,
                                     err));
}

/* ---- a request's backing store ----------------------------------------------------- */

static int
bk_err (int e)
{
  return -(e ? e : EIO);
}

static int
bk_pread (void *opaque, void *buf, uint32_t count, uint64_t offset)
{
  struct bk *k = opaque;
  int e = 0;

  return PLUGIN_CALL (k->next->pread (k->next, buf, count, offset, 0, &e))
         == -1 ? bk_err (e) : 0;
}

static int
bk_pwrite (void *opaque, const void *buf, uint32_t count, uint64_t offset,
           bool fua)
{
  struct bk *k = opaque;
  uint32_t f = fua && k->fua_native ? NBDKIT_FLAG_FUA : 0;
  int e = 0;

  if (PLUGIN_CALL (k->next->pwrite (k->next, buf, count, offset, f, &e))
      == -1)
    return bk_err (e);
  if (fua && !k->fua_native &&
      PLUGIN_CALL (k->next->flush (k->next, 0, &e)) == -1)
    return bk_err (e);
  return 0;
}

static int
bk_flush (void *opaque)
{
  struct bk *k = opaque;
  int e = 0;

  if (!k->can_flush)
    return 0;
  return PLUGIN_CALL (k->next->flush (k->next, 0, &e)) == -1
         ? bk_err (e) : 0;
}

static int
bk_trim (void *opaque, uint32_t count, uint64_t offset)
{
  struct bk *k = opaque;
  int e = 0;

  return PLUGIN_CALL (k->next->trim (k->next, count, offset, 0, &e)) == -1
         ? bk_err (e) : 0;
}

static int
bk_zero (void *opaque, uint32_t count, uint64_t offset, bool may_trim)
{
  struct bk *k = opaque;
  uint32_t f = (may_trim ? NBDKIT_FLAG_MAY_TRIM : 0) |
               (k->flags & NBDKIT_FLAG_FAST_ZERO);
  int e = 0;

  return PLUGIN_CALL (k->next->zero (k->next, count, offset, f, &e)) == -1
         ? bk_err (e) : 0;
}

static int64_t
bk_size (void *opaque)
{
  struct bk *k = opaque;
  int64_t s = bk_next_get_size (k->next);

  return s < 0 ? -EIO : s;
}

static const struct bcf_backing_ops bk_ops = {
  .pread = bk_pread, .pwrite = bk_pwrite, .flush = bk_flush,
  .trim = bk_trim, .zero = bk_zero, .size = bk_size,
};

/* What a request needs to know of next (asking is cheap: nbdkit caches
 * the answers per context). */
static void
bk_set (struct bk *k, nbdkit_next *next, uint32_t flags)
{
  k->next = next;
  k->flags = flags;
  k->fua_native = PLUGIN_CALL (next->can_fua (next)) == NBDKIT_FUA_NATIVE;
  k->can_flush = PLUGIN_CALL (next->can_flush (next)) == 1;
}

void
bk_init (struct bk *k, struct bcf_backing *b, nbdkit_next *next,
         uint32_t flags)
{
  bk_set (k, next, flags);
  b->ops = &bk_ops;
  b->opaque = k;
}

/* ---- the background backing store ------------------------------------------------- */

static nbdkit_backend *bg_backend;
static pthread_mutex_t bg_lock = PTHREAD_MUTEX_INITIALIZER;
static nbdkit_next *bg_next;
static struct bk bg_bk;

/* Open the context if it is not open yet.  nbdkit 1.32 wants prepare and
 * get_size before any I/O on it (DESIGN.md "Concurrency"), and aborts
 * when X is used on a context that was never asked can_X (a client's
 * connection asks during the handshake; ours must ask itself).  Returns
 * 0, or -1 after nbdkit_error. */
static int
bg_open_plugin_locked (void)
{
  bg_next = nbdkit_next_context_open (bg_backend, 0, "", 1);
  if (!bg_next) {
    nbdkit_error ("bcachefilter: cannot open the export from the filter "
                  "(for background writes)");
    return -1;
  }
  if (bg_next->prepare (bg_next) == -1 || bg_next->get_size (bg_next) < 0 ||
      bg_next->can_write (bg_next) == -1 || bg_next->can_trim (bg_next) == -1 ||
      bg_next->can_zero (bg_next) == -1) {
    nbdkit_error ("bcachefilter: cannot prepare the filter's own context on "
                  "the export (for background writes)");
    bg_next->finalize (bg_next);
    nbdkit_next_context_close (bg_next);
    bg_next = NULL;
    return -1;
  }
  return 0;
}

static int
bg_open_locked (void)
{
  int r;

  if (bg_next)
    return 0;
  if (!bg_backend)
    return -1;
  /* Opening and preparing are calls into the plugin too. */
  plugin_enter ();
  r = bg_open_plugin_locked ();
  plugin_leave ();
  if (r == 0)
    bk_set (&bg_bk, bg_next, 0);
  return r;
}

/* The open context, or NULL. */
static struct bk *
bg_get (void)
{
  struct bk *k;

  pthread_mutex_lock (&bg_lock);
  k = bg_open_locked () == 0 ? &bg_bk : NULL;
  pthread_mutex_unlock (&bg_lock);
  return k;
}

static int
bg_pread (void *opaque, void *buf, uint32_t count, uint64_t offset)
{
  struct bk *k = bg_get ();
  return k ? bk_pread (k, buf, count, offset) : -EIO;
}

static int
bg_pwrite (void *opaque, const void *buf, uint32_t count, uint64_t offset,
           bool fua)
{
  struct bk *k = bg_get ();
  return k ? bk_pwrite (k, buf, count, offset, fua) : -EIO;
}

static int
bg_flush (void *opaque)
{
  struct bk *k = bg_get ();
  return k ? bk_flush (k) : -EIO;
}

static int
bg_trim (void *opaque, uint32_t count, uint64_t offset)
{
  struct bk *k = bg_get ();
  return k ? bk_trim (k, count, offset) : -EIO;
}

static int
bg_zero (void *opaque, uint32_t count, uint64_t offset, bool may_trim)
{
  struct bk *k = bg_get ();
  return k ? bk_zero (k, count, offset, may_trim) : -EIO;
}

static int64_t
bg_size (void *opaque)
{
  struct bk *k = bg_get ();
  return k ? bk_size (k) : -EIO;
}

static const struct bcf_backing_ops bg_ops = {
  .pread = bg_pread, .pwrite = bg_pwrite, .flush = bg_flush,
  .trim = bg_trim, .zero = bg_zero, .size = bg_size,
};
static const struct bcf_backing bg_backing = { .ops = &bg_ops };

void
bk_background_init (nbdkit_backend *backend)
{
  bg_backend = backend;
}

const struct bcf_backing *
bk_background (void)
{
  return &bg_backing;
}

void
bk_background_close (void)
{
  pthread_mutex_lock (&bg_lock);
  if (bg_next) {
    plugin_enter ();
    bg_next->finalize (bg_next);
    nbdkit_next_context_close (bg_next);
    plugin_leave ();
    bg_next = NULL;
  }
  bg_backend = NULL;
  pthread_mutex_unlock (&bg_lock);
}
