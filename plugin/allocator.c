/* nbdkit-bcachefilter-filter: jemalloc's figures when it is the
 * allocator (see allocator.h). */
#include "config.h"

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "allocator.h"

typedef int (*mallctl_fn) (const char *name, void *oldp, size_t *oldlenp,
                           void *newp, size_t newlen);

static int
read_size (mallctl_fn ctl, const char *name, size_t *v)
{
  size_t len = sizeof *v;

  return ctl (name, v, &len, NULL, 0);
}

bool
allocator_stats (struct allocator_stats *s)
{
  mallctl_fn ctl = (mallctl_fn) dlsym (RTLD_DEFAULT, "mallctl");
  uint64_t epoch = 1;
  size_t len = sizeof epoch;

  if (ctl == NULL)
    return false;
  /* jemalloc's statistics are a snapshot taken when "epoch" is
   * written. */
  if (ctl ("epoch", &epoch, &len, &epoch, len) != 0)
    return false;
  /* A jemalloc built without --enable-stats has no stats.* (ENOENT). */
  if (read_size (ctl, "stats.allocated", &s->allocated) != 0 ||
      read_size (ctl, "stats.resident", &s->resident) != 0)
    return false;
  s->name = "jemalloc";
  return true;
}
