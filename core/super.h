/* bcachefilter engine: format, first registration, open (see super.c). */
#ifndef BCACHEFILTER_SUPER_H
#define BCACHEFILTER_SUPER_H

#include <stdbool.h>
#include <stddef.h>

struct bcf_cache;

/* Open the cache on c->io according to c->opts.format: format a blank
 * device, register a make-bcache one, or open a live cache (read the
 * journal, prios, uuids and btree, replay, mark, checkpoint).  Returns 0
 * or -errno with a message in err. */
int super_open (struct bcf_cache *c, char *err, size_t errlen);
/* Free what super_open built. */
void super_close_state (struct bcf_cache *c);
/* CACHE_SYNC off and a new set uuid, on disk (bcf_cache_abandon, a
 * detached export's restart).  Under ckpt_lock; takes super_lock. */
int super_abandon (struct bcf_cache *c);
/* Invalidate the export's uuid slot on disk (bcf_cache_detach), with
 * ckpt_lock held.  Returns 0, -ENOENT if the slot names no export, or
 * -errno (nothing changed). */
int super_detach (struct bcf_cache *c);
/* Set or clear BCF_FEATURE_INCOMPAT_WRITE_INTENT in the superblock on
 * disk (the version is 5 while it is set), durably.  Takes super_lock,
 * not ckpt_lock: it never waits for a checkpoint (engine.h).  Returns 0
 * or -errno (the superblock in memory is then unchanged). */
int super_set_write_intent (struct bcf_cache *c, bool on);

#endif
