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

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "bcachefilter/backing.h"
#include "bcachefilter/cache.h"
#include "bypass.h"

struct bcf_writeback;

/* bcache's writeback rate controller (research/bcache.md §2.5), as a
 * value the thread updates every update_seconds and tests drive by hand.
 * Rates in sectors per second, amounts in sectors, as bcache's sysfs
 * writeback_rate_debug shows them. */
#define BCF_WB_P_TERM_INVERSE   40
#define BCF_WB_I_TERM_INVERSE   10000
#define BCF_WB_RATE_MINIMUM     8
#define BCF_WB_RATE_INITIAL     1024
#define BCF_WB_RATE_MAX         1000000000ll    /* NSEC_PER_SEC */
#define BCF_WB_UPDATE_SECONDS   5
#define BCF_WB_IDLE_ROUNDS      6       /* rounds without I/O: full speed */
#define BCF_WB_FRAGMENT_LOW     50      /* in_use thresholds of the */
#define BCF_WB_FRAGMENT_MID     57      /* fragmentation boost */
#define BCF_WB_FRAGMENT_HIGH    64
#define BCF_WB_FP_TERM_LOW      1
#define BCF_WB_FP_TERM_MID      10
#define BCF_WB_FP_TERM_HIGH     1000
#define BCF_WB_CUTOFF           40      /* bcache's cutoff_writeback */
#define BCF_WB_CUTOFF_SYNC      70      /* ... cutoff_writeback_sync */
#define BCF_WB_MOVE_MARGIN      5       /* moving GC starts this far below
                                           the cutoff (writeback.c) */
#define BCF_WB_MOVE_HEADROOM    2       /* a run's copies stop this far
                                           below it (bcf_wb_move_budget) */
#define BCF_WB_MOVE_MAX_SHARE   16      /* a run copies at most 1/16 of the
                                           cache, */
#define BCF_WB_MOVE_MIN_SHARE   128     /* and may copy 1/128 of it even
                                           past the headroom */

struct bcf_wb_pi {
  int64_t rate;                 /* sectors/s */
  int64_t integral;             /* unscaled, as bcache keeps it */
  int64_t proportional, integral_scaled, change;
  int64_t target, dirty;
  uint64_t next_ns;             /* the rate limiter: next I/O may start */
  unsigned idle_rounds;         /* update rounds without front-end I/O */
  bool at_max;                  /* idle boost in effect */
};

/* What one update round sees. */
struct bcf_wb_pi_input {
  int64_t dirty, target;        /* sectors */
  unsigned in_use;              /* % of buckets not reclaimable */
  int64_t dirty_buckets, bucket_sectors;   /* fragmentation boost */
  unsigned update_seconds;
  bool idle;                    /* no front-end I/O since the last round */
  uint64_t now_ns;
};

/* How many bytes one moving-GC run may copy in a cache of capacity
 * bytes with in_use % of its buckets in use, when the writes meet their
 * cutoff at cutoff % (writeback.c, move_between_batches_locked). */
uint64_t bcf_wb_move_budget (uint64_t capacity, unsigned in_use,
                             unsigned cutoff);

void bcf_wb_pi_init (struct bcf_wb_pi *pi, uint64_t now_ns);
/* bcache's __update_writeback_rate, plus its idle boost. */
void bcf_wb_pi_update (struct bcf_wb_pi *pi, const struct bcf_wb_pi_input *in);
/* bcache's bch_next_delay: done sectors were just written; how long to
 * wait before the next (ns; 0: go on). */
uint64_t bcf_wb_pi_next_delay (struct bcf_wb_pi *pi, uint64_t done,
                               uint64_t now_ns);

/* Run-time settings (bcache's sysfs names). */
struct bcf_writeback_tunables {
  bool writeback;               /* writeback mode: rate controlled;
                                   false: drain whatever is dirty */
  bool running;                 /* writeback_running */
  unsigned percent;             /* writeback_percent */
  unsigned delay_s;             /* writeback_delay: after a full pass */
  unsigned update_seconds;      /* writeback_rate_update_seconds */
  bool copy_gc;                 /* copy_gc_enabled: moving GC between
                                   batches (bcache's, off there) */
  unsigned writes_cutoff;       /* the cutoff the writes meet first
                                   (cutoff_writeback_sync where every
                                   write is sync, else cutoff_writeback):
                                   moving GC runs from
                                   BCF_WB_MOVE_MARGIN below it */
};

struct bcf_writeback_stats {
  uint64_t keys_done;           /* extents written back and marked clean */
  uint64_t keys_failed;         /* ... replaced by a newer write first */
  uint64_t bytes_written;       /* marked clean after the backing flush */
  uint64_t backing_errors;      /* backing writes / flushes that failed */
  uint64_t read_errors;         /* cache reads of dirty data that failed */
  uint64_t retries;             /* passes given up after an error */
  uint64_t gc_requests;         /* GCs asked for to count the buckets it
                                   cleaned (gc_after_cleaning_locked) */
  struct bcf_wb_pi rate;        /* the controller, as last updated */
  unsigned in_use;              /* % of buckets dirty or metadata */
  bool flushing;                /* a flush waits: full speed */
};

/* drain: the clean modes (write back what is dirty, then look again only
 * now and then); otherwise writeback mode, rate controlled.  b must stay
 * valid for the writeback's life. */
struct bcf_writeback *bcf_writeback_new (struct bcf_cache *c,
                                         struct bcf_bypass *tracker,
                                         const struct bcf_backing *b,
                                         bool drain);
void bcf_writeback_get_tunables (struct bcf_writeback *wb,
                                 struct bcf_writeback_tunables *t);
/* Applies t (percent ≤ 100, update_seconds 1..60: else -EINVAL) and
 * wakes the thread. */
int bcf_writeback_set_tunables (struct bcf_writeback *wb,
                                const struct bcf_writeback_tunables *t);
/* The buckets in use (dirty or metadata), in %, rounded up: as last
 * counted (bcache's gc_stats.in_use), plus the buckets marked since.
 * The request path's cutoffs read it. */
unsigned bcf_writeback_in_use (struct bcf_writeback *wb);
/* Would bcache's refill_dirty have scanned the whole index: fewer dirty
 * extents than its keybuf holds (500)?  Then the thread sleeps
 * writeback_delay at the end of a pass. */
bool bcf_writeback_searched_full_index (struct bcf_writeback *wb);
/* Write back everything at full speed, and wait until nothing is dirty,
 * the backing store fails (its -errno), or timeout_ms passed (-ETIMEDOUT;
 * 0: no limit).  progress, if not NULL, is called about once a second
 * with the dirty bytes left. */
int bcf_writeback_flush (struct bcf_writeback *wb, unsigned timeout_ms,
                         void (*progress) (void *opaque, uint64_t dirty),
                         void *opaque);
/* Start the thread; 0 or -errno. */
int bcf_writeback_start (struct bcf_writeback *wb);
/* Stop the thread (waits for the batch in progress) and free. */
void bcf_writeback_free (struct bcf_writeback *wb);
/* Write back at full speed, ignoring the rate and writeback_running,
 * until nothing is dirty (bcachefilter-ctl flush); returns at once. */
void bcf_writeback_hurry (struct bcf_writeback *wb);
/* Wake the thread now (new dirty data, a flush wants it). */
void bcf_writeback_kick (struct bcf_writeback *wb);
/* One pass over every dirty extent, in the calling thread (the thread
 * does the same; tests call it without the thread).  Returns 0 or the
 * backing store's -errno (dirty data stays dirty). */
int bcf_writeback_pass (struct bcf_writeback *wb);
void bcf_writeback_get_stats (struct bcf_writeback *wb,
                              struct bcf_writeback_stats *st);

#endif /* BCACHEFILTER_WRITEBACK_H */
