/* nbdkit-bcachefilter-filter: the backing store as the engine sees it
 * (see backing.h). */
#include "config.h"

#include <errno.h>

#include "backing.h"

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

  return k->next->pread (k->next, buf, count, offset, 0, &e) == -1
         ? bk_err (e) : 0;
}

static int
bk_pwrite (void *opaque, const void *buf, uint32_t count, uint64_t offset,
           bool fua)
{
  struct bk *k = opaque;
  uint32_t f = fua && k->fua_native ? NBDKIT_FLAG_FUA : 0;
  int e = 0;

  if (k->next->pwrite (k->next, buf, count, offset, f, &e) == -1)
    return bk_err (e);
  if (fua && !k->fua_native &&
      k->next->flush (k->next, 0, &e) == -1)
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
  return k->next->flush (k->next, 0, &e) == -1 ? bk_err (e) : 0;
}

static int
bk_trim (void *opaque, uint32_t count, uint64_t offset)
{
  struct bk *k = opaque;
  int e = 0;

  return k->next->trim (k->next, count, offset, 0, &e) == -1
         ? bk_err (e) : 0;
}

static int
bk_zero (void *opaque, uint32_t count, uint64_t offset, bool may_trim)
{
  struct bk *k = opaque;
  uint32_t f = (may_trim ? NBDKIT_FLAG_MAY_TRIM : 0) |
               (k->flags & NBDKIT_FLAG_FAST_ZERO);
  int e = 0;

  return k->next->zero (k->next, count, offset, f, &e) == -1
         ? bk_err (e) : 0;
}

static int64_t
bk_size (void *opaque)
{
  struct bk *k = opaque;
  int64_t s = k->next->get_size (k->next);

  return s < 0 ? -EIO : s;
}

static const struct bcf_backing_ops bk_ops = {
  .pread = bk_pread, .pwrite = bk_pwrite, .flush = bk_flush,
  .trim = bk_trim, .zero = bk_zero, .size = bk_size,
};

void
bk_init (struct bk *k, struct bcf_backing *b, nbdkit_next *next,
         uint32_t flags)
{
  k->next = next;
  k->flags = flags;
  k->fua_native = next->can_fua (next) == NBDKIT_FUA_NATIVE;
  k->can_flush = next->can_flush (next) == 1;
  b->ops = &bk_ops;
  b->opaque = k;
}

/* ---- the background backing store ------------------------------------------------- */

/* nbdkit 1.32: prepare and get_size before any I/O on it, see DESIGN.md
 * "Concurrency". */
static nbdkit_next *bg_next;
static struct bk bg_bk;
static struct bcf_backing bg_backing;

const struct bcf_backing *
bk_background_open (nbdkit_backend *backend, int64_t *size)
{
  bg_next = nbdkit_next_context_open (backend, 0, "", 1);
  if (!bg_next) {
    nbdkit_error ("bcachefilter: cannot open the export from the filter "
                  "(to learn its size and for background writes)");
    return NULL;
  }
  if (bg_next->prepare (bg_next) == -1) {
    nbdkit_next_context_close (bg_next);
    bg_next = NULL;
    return NULL;
  }
  *size = bg_next->get_size (bg_next);
  if (*size < 0) {
    nbdkit_error ("bcachefilter: cannot get the size of the export");
    bk_background_close ();
    return NULL;
  }
  /* nbdkit checks that a context was asked can_X before X is used on it
   * (a client's connection asks during the handshake; ours must ask
   * itself), else it aborts. */
  if (bg_next->can_write (bg_next) == -1 || bg_next->can_trim (bg_next) == -1 ||
      bg_next->can_zero (bg_next) == -1) {
    nbdkit_error ("bcachefilter: cannot ask the export what it can do");
    bk_background_close ();
    return NULL;
  }
  bk_init (&bg_bk, &bg_backing, bg_next, 0);
  return &bg_backing;
}

void
bk_background_close (void)
{
  if (bg_next) {
    bg_next->finalize (bg_next);
    nbdkit_next_context_close (bg_next);
    bg_next = NULL;
  }
}

