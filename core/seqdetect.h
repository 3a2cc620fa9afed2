/* bcachefilter: sequential stream detection for the sequential cutoff.
 *
 * bcache's check_should_bypass(): a small table of recent requests keyed
 * by where each ended; a request that starts where a recent one ended
 * continues that stream, and its byte count is the stream's so far plus
 * its own.  Streams not continued for 5 seconds are forgotten, and the
 * table replaces its least recently used entry.  Safe for many threads.
 */
#ifndef BCACHEFILTER_SEQDETECT_H
#define BCACHEFILTER_SEQDETECT_H

#include <stdint.h>

struct bcf_seqdetect;

struct bcf_seqdetect *bcf_seqdetect_new (void);
void bcf_seqdetect_free (struct bcf_seqdetect *s);

/* Account the request [offset, offset + len) and return the number of
 * bytes of the sequential stream it belongs to, itself included (len for
 * a request that continues no stream). */
uint64_t bcf_seqdetect_account (struct bcf_seqdetect *s, uint64_t offset,
                                uint64_t len);

/* Tests only: the clock (monotonic nanoseconds) used for expiry; NULL
 * restores the real one. */
void bcf_seqdetect_test_clock (struct bcf_seqdetect *s,
                               uint64_t (*now_ns) (void));

#endif /* BCACHEFILTER_SEQDETECT_H */
