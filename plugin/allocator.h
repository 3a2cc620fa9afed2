/* nbdkit-bcachefilter-filter: the process's allocator, as it reports
 * itself (allocator.c).
 *
 * The filter must not link jemalloc (nbdkit dlopens it, and jemalloc
 * needs static TLS), but nbdkit can run under
 * LD_PRELOAD=libjemalloc.so.2.  Then jemalloc's mallctl is in the
 * process, found at run time with dlsym (RTLD_DEFAULT), and the
 * statistics show jemalloc's own figures; under glibc's malloc there is
 * no mallctl and nothing is shown.
 *
 * Locking: none; mallctl is thread-safe.
 */
#ifndef BCACHEFILTER_PLUGIN_ALLOCATOR_H
#define BCACHEFILTER_PLUGIN_ALLOCATOR_H

#include <stdbool.h>
#include <stddef.h>

struct allocator_stats {
  const char *name;             /* "jemalloc" */
  size_t allocated;             /* jemalloc's stats.allocated: bytes the
                                 * program has allocated */
  size_t resident;              /* stats.resident: bytes in physically
                                 * resident data pages it maps */
};

/* Fill *s and return true if the allocator is jemalloc and its figures
 * could be read (after refreshing its "epoch", so they are current);
 * return false otherwise. */
bool allocator_stats (struct allocator_stats *s);

#endif /* BCACHEFILTER_PLUGIN_ALLOCATOR_H */
