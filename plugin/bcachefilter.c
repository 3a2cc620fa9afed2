/* nbdkit-bcachefilter-filter: a persistent SSD cache in bcache's on-disk
 * format in front of any NBD export.
 *
 * Design
 * ------
 * The filter is the glue between nbdkit and the engine (core/, through
 * its public API in include/bcachefilter/), in the manner of nbdkit's
 * own filters, one job per file:
 *
 *   params.c     the bcache-* parameters and --help (.config,
 *                .config_complete)
 *   probe.c      the checks before nbdkit forks (.get_ready): claim the
 *                cache device and refuse what the engine would refuse
 *   lifecycle.c  the cache's life: open (.after_fork), close (.cleanup),
 *                the export check of each connection, the control
 *                socket's operations
 *   backing.c    the export as the engine sees it (struct bcf_backing
 *                over a connection's nbdkit_next)
 *   (core/bdev.c holds what a bcache backing device as the export needs;
 *   here .get_size and block status show only its data region)
 *   render.c     the control socket's output: the statistics (the
 *                engine renders them: text, JSON, Prometheus) and the
 *                superblock
 *   allocator.c  jemalloc's figures for them, when nbdkit runs under
 *                LD_PRELOAD=libjemalloc.so.2
 *   ctl.c        the control socket's server
 *   this file    the per-connection callbacks: each NBD request mapped
 *                onto the request path (core/request.c, which holds the
 *                cache-miss protocol and the write ordering)
 *
 * Locking: the request path is safe for the PARALLEL thread model; the
 * callbacks here keep no state of their own (lifecycle.h says when req
 * may be read).
 */
#include "config.h"

#include <errno.h>
#include <stdint.h>

#define NBDKIT_API_VERSION 2
#include <nbdkit-filter.h>

#include "bcachefilter/request.h"
#include "backing.h"
#include "lifecycle.h"
#include "params.h"

/* ---- connections ------------------------------------------------------------------ */

static int
filter_thread_model (void)
{
  return NBDKIT_THREAD_MODEL_PARALLEL;
}

static void *
filter_open (nbdkit_next_open *next, nbdkit_context *nxdata, int readonly,
          const char *exportname, int is_tls)
{
  if (next (nxdata, readonly, exportname) == -1)
    return NULL;
  return NBDKIT_HANDLE_NOT_NEEDED;
}

static int
filter_prepare (nbdkit_next *next, void *handle, int readonly)
{
  return lifecycle_check_export (next);
}

/* A bcache backing device's clients see its data region only. */
static int64_t
filter_get_size (nbdkit_next *next, void *handle)
{
  int64_t size = bk_next_get_size (next);

  return size == -1 ? -1 : size - (int64_t) lifecycle_data_offset ();
}

static int
filter_can_cache (nbdkit_next *next, void *handle)
{
  return NBDKIT_CACHE_NATIVE;
}

static int
result (int r, int *err)
{
  if (r < 0) {
    *err = -r == ERANGE ? EINVAL : -r;
    return -1;
  }
  return 0;
}

static int
filter_pread (nbdkit_next *next, void *handle, void *buf, uint32_t count,
           uint64_t offset, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_read (req, &b, buf, count, offset), err);
}

static int
filter_pwrite (nbdkit_next *next, void *handle, const void *buf, uint32_t count,
            uint64_t offset, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_write (req, &b, buf, count, offset,
                                flags & NBDKIT_FLAG_FUA), err);
}

static int
filter_flush (nbdkit_next *next, void *handle, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_flush (req, &b), err);
}

static int
filter_trim (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
          uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_trim (req, &b, count, offset,
                               flags & NBDKIT_FLAG_FUA), err);
}

static int
filter_zero (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
          uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_zero (req, &b, count, offset,
                               flags & NBDKIT_FLAG_MAY_TRIM,
                               flags & NBDKIT_FLAG_FUA), err);
}

static int
filter_cache_op (nbdkit_next *next, void *handle, uint32_t count,
              uint64_t offset, uint32_t flags, int *err)
{
  struct bk k;
  struct bcf_backing b;

  bk_init (&k, &b, next, flags);
  return result (bcf_req_prefetch (req, &b, count, offset), err);
}

/* The export's block status for a data region that begins shift bytes
 * into it: asked at the shifted offset, answered shifted back. */
static int
shifted_extents (nbdkit_next *next, uint32_t count, uint64_t offset,
                 uint64_t shift, uint32_t flags,
                 struct nbdkit_extents *extents, int *err)
{
  struct nbdkit_extents *e;
  int64_t size = bk_next_get_size (next);
  int r = 0;

  if (size == -1) {
    *err = EIO;
    return -1;
  }
  e = nbdkit_extents_new (offset + shift, (uint64_t) size);
  if (!e) {
    *err = errno;
    return -1;
  }
  if (bk_next_extents (next, count, offset + shift, flags, e, err) == -1)
    r = -1;
  for (size_t i = 0; r == 0 && i < nbdkit_extents_count (e); i++) {
    struct nbdkit_extent x = nbdkit_get_extent (e, i);
    if (nbdkit_add_extent (extents, x.offset - shift, x.length,
                           x.type) == -1) {
      *err = errno;
      r = -1;
    }
  }
  nbdkit_extents_free (e);
  return r;
}

/* Block status: the backing store's answer, unless the cache holds data
 * there that the backing store does not have yet (dirty): then all data,
 * so no client skips it as a hole or zeroes. */
static int
filter_extents (nbdkit_next *next, void *handle, uint32_t count, uint64_t offset,
             uint32_t flags, struct nbdkit_extents *extents, int *err)
{
  int d = bcf_req_has_dirty (req, count, offset);

  if (d < 0) {
    *err = -d;
    return -1;
  }
  if (d > 0)
    return nbdkit_add_extent (extents, offset, count, 0);
  if (lifecycle_data_offset ())
    return shifted_extents (next, count, offset, lifecycle_data_offset (),
                            flags, extents, err);
  return bk_next_extents (next, count, offset, flags, extents, err);
}

static struct nbdkit_filter filter = {
  .name = "bcachefilter",
  .longname = "bcachefilter " PACKAGE_VERSION ": a persistent cache in "
              "bcache's on-disk format",
  .load = filter_load,
  .unload = filter_unload,
  .config = filter_config,
  .config_complete = filter_config_complete,
  .config_help = filter_config_help,
  .thread_model = filter_thread_model,
  .get_ready = filter_get_ready,
  .after_fork = filter_after_fork,
  .cleanup = filter_cleanup,
  .open = filter_open,
  .prepare = filter_prepare,
  .get_size = filter_get_size,
  .can_cache = filter_can_cache,
  .pread = filter_pread,
  .pwrite = filter_pwrite,
  .flush = filter_flush,
  .trim = filter_trim,
  .zero = filter_zero,
  .extents = filter_extents,
  .cache = filter_cache_op,
};

NBDKIT_REGISTER_FILTER (filter)
