/* bcachefilter: sequential stream detection for the sequential cutoff.
 *
 * bcache's check_should_bypass(): a small table of recent requests keyed
 * by where each ended; a request that starts where a recent one ended
 * continues that stream, and its byte count is the stream's so far plus
 * its own.  Streams not continued for 5 seconds are forgotten, and the
 * table replaces its least recently used entry.  Unlike bcache, a request
 * that starts within BCF_SEQDETECT_WINDOW bytes of a stream's end, before
 * or after it, continues it too, counting only the bytes by which it moves
 * the end forward: an NBD client's requests in flight reach the filter
 * out of order (seqdetect.c).  Safe for many threads.
 */
#ifndef BCACHEFILTER_SEQDETECT_H
#define BCACHEFILTER_SEQDETECT_H

#include <stdint.h>

struct bcf_seqdetect;

/* How far out of order a stream's requests may arrive: 32 requests of
 * 4 KiB in flight. */
#define BCF_SEQDETECT_WINDOW (UINT64_C (128) << 10)

struct bcf_seqdetect *bcf_seqdetect_new (void);
void bcf_seqdetect_free (struct bcf_seqdetect *s);

/* Account the request [offset, offset + len) and return the number of
 * bytes of the sequential stream it belongs to, itself included (len for
 * a request that continues no stream; the stream's count unchanged for
 * one wholly behind its end). */
uint64_t bcf_seqdetect_account (struct bcf_seqdetect *s, uint64_t offset,
                                uint64_t len);

/* Tests only: the clock (monotonic nanoseconds) used for expiry; NULL
 * restores the real one. */
void bcf_seqdetect_test_clock (struct bcf_seqdetect *s,
                               uint64_t (*now_ns) (void));

#endif /* BCACHEFILTER_SEQDETECT_H */
