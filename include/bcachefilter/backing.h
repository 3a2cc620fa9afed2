/* bcachefilter: the backing store, as the engine sees it.
 *
 * Design
 * ------
 * The engine (core/) never talks to nbdkit or libnbd.  Everything it needs
 * from the store it caches (the remote export) comes through this struct
 * of calls, so the filter plugs in nbdkit's next_ops and the tests plug in
 * an in-memory store that can inject latency, errors and pauses.
 *
 * Contract for implementations:
 * - every call may be made from many threads at once;
 * - calls return 0 on success or a negative errno (-EIO, -ENOSPC, ...);
 * - offsets and counts are in bytes; requests never cross size();
 * - pwrite with fua=true, and flush, return only once the data is durable
 *   on the backing store;
 * - zero with may_trim=true may deallocate (reads return zeroes after).
 */
#ifndef BCACHEFILTER_BACKING_H
#define BCACHEFILTER_BACKING_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

struct bcf_backing_ops {
  int (*pread) (void *opaque, void *buf, uint32_t count, uint64_t offset);
  int (*pwrite) (void *opaque, const void *buf, uint32_t count,
                 uint64_t offset, bool fua);
  int (*flush) (void *opaque);
  int (*trim) (void *opaque, uint32_t count, uint64_t offset);
  int (*zero) (void *opaque, uint32_t count, uint64_t offset, bool may_trim);
  /* Size in bytes, or a negative errno. */
  int64_t (*size) (void *opaque);
};

struct bcf_backing {
  const struct bcf_backing_ops *ops;
  void *opaque;
};

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_BACKING_H */
