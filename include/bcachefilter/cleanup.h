/* bcachefilter: scoped cleanup attributes (nbdkit's CLEANUP_FREE habit).
 *
 * A variable declared CLEANUP_FREE is freed, and one declared
 * CLEANUP_CLOSE (an fd, or -1) is closed, when it goes out of scope, so
 * early returns cannot leak.  Header-only; the engine (core/util.h), the
 * filter and the tools share this one definition.
 */
#ifndef BCACHEFILTER_CLEANUP_H
#define BCACHEFILTER_CLEANUP_H

#include <stdlib.h>
#include <unistd.h>

static inline void
bcf_cleanup_free (void *ptr)
{
  free (*(void **) ptr);
}
#define CLEANUP_FREE __attribute__ ((cleanup (bcf_cleanup_free)))

static inline void
bcf_cleanup_close (int *fd)
{
  if (*fd >= 0)
    close (*fd);
}
#define CLEANUP_CLOSE __attribute__ ((cleanup (bcf_cleanup_close)))

#endif /* BCACHEFILTER_CLEANUP_H */
