/* bcachefilter engine: the writeback thread (core/writeback.c says how it
 * orders itself against foreground writes and the backing store).
 *
 * Created by the request layer (core/request.c), which owns the
 * in-flight write tracker the writeback registers in, with a backing
 * store of its own for background I/O (the filter opens a backend
 * context for it).
 */
#ifndef BCACHEFILTER_WRITEBACK_H
#define BCACHEFILTER_WRITEBACK_H

#include <stdbool.h>
#include <stdint.h>

#include "bcachefilter/backing.h"
#include "bcachefilter/cache.h"
#include "bypass.h"

struct bcf_writeback;

struct bcf_writeback_stats {
  uint64_t keys_done;           /* extents written back and marked clean */
  uint64_t keys_failed;         /* ... replaced by a newer write first */
  uint64_t bytes_written;       /* marked clean after the backing flush */
  uint64_t backing_errors;      /* backing writes / flushes that failed */
  uint64_t read_errors;         /* cache reads of dirty data that failed */
  uint64_t retries;             /* passes given up after an error */
};

/* drain: the clean modes (write back what is dirty, then look again only
 * now and then).  b must stay valid for the writeback's life. */
struct bcf_writeback *bcf_writeback_new (struct bcf_cache *c,
                                         struct bcf_bypass *tracker,
                                         const struct bcf_backing *b,
                                         bool drain);
/* Start the thread; 0 or -errno. */
int bcf_writeback_start (struct bcf_writeback *wb);
/* Stop the thread (waits for the batch in progress) and free. */
void bcf_writeback_free (struct bcf_writeback *wb);
/* Wake the thread now (new dirty data, a flush wants it). */
void bcf_writeback_kick (struct bcf_writeback *wb);
/* One pass over every dirty extent, in the calling thread (the thread
 * does the same; tests call it without the thread).  Returns 0 or the
 * backing store's -errno (dirty data stays dirty). */
int bcf_writeback_pass (struct bcf_writeback *wb);
void bcf_writeback_get_stats (struct bcf_writeback *wb,
                              struct bcf_writeback_stats *st);

#endif /* BCACHEFILTER_WRITEBACK_H */
