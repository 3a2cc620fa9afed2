/* bcachefilter: one writer per cache device (DESIGN.md "One writer per
 * cache, one cache per export").
 *
 * Two processes writing one cache corrupt it silently: each keeps its own
 * btree, allocator and journal position in memory, and each overwrites
 * buckets the other still points at.  So a writer claims the device
 * before it reads or writes anything, and holds the claim for as long as
 * it uses the device:
 *
 * - a regular file: an exclusive, non-blocking flock(2).  The lock
 *   belongs to the open file description, so it survives fork(2) (nbdkit
 *   claims in .get_ready and forks into the background after) and is
 *   released only when the last descriptor for it closes, including at
 *   process exit or kill -9.  It is taken on the inode, so a hard link or
 *   a symlink to the same file is refused too.
 * - a block device: open(2) with O_EXCL (the kernel refuses it while the
 *   device is mounted, held by the kernel's bcache, md, LVM or another
 *   exclusive opener), plus the same flock on the device node, so that a
 *   second bcachefilter on the same node is named in the message.
 *
 * A refused claim says who holds the device where /proc can tell: every
 * process with a descriptor for the same inode whose fdinfo lists a
 * FLOCK WRITE lock (readable for processes of the same user, or as root).
 *
 * Readers (bcachefilter-show) take no claim: they ask bcf_claim_probe
 * whether a writer holds the device, and say their view may be stale.
 */
#ifndef BCACHEFILTER_CLAIM_H
#define BCACHEFILTER_CLAIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What is declared here is libbcachecore's API: exported from the
 * shared library, which hides everything else (core/Makefile.am). */
#pragma GCC visibility push(default)

struct bcf_claim;

/* Claim the cache device at path for writing.  If path does not exist
 * and create_size is not zero, create a regular file of that size first
 * (space allocated up front, so a full filesystem shows now and not as
 * write errors later); an existing empty file claimed with create_size
 * is given that size too (a creator that died before allocating it).
 * Returns 0 and sets *cp, or a negative errno with the reason in err:
 * -EBUSY when another process holds the device (err names it where it
 * can be known). */
int bcf_claim_open (const char *path, uint64_t create_size,
                    struct bcf_claim **cp, char *err, size_t errlen);
/* Release the claim (close its descriptor).  NULL is allowed. */
void bcf_claim_release (struct bcf_claim *cl);
const char *bcf_claim_path (const struct bcf_claim *cl);
/* Does fd refer to the device the claim holds (same inode, or the same
 * block device)?  Checked by every open that relies on a claim made
 * earlier, in case the path was replaced meanwhile. */
bool bcf_claim_covers_fd (const struct bcf_claim *cl, int fd);

/* Is the device at path claimed by a writer?  Returns 1 (with who holds
 * it, if known, in holder: "pid 1234 (nbdkit)"), 0, or a negative errno
 * (the path cannot be opened) with the reason in holder.  Takes no
 * claim and changes nothing. */
int bcf_claim_probe (const char *path, char *holder, size_t holderlen);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif

#endif /* BCACHEFILTER_CLAIM_H */
