/* bcachefilter: the control socket (bcache-ctl=PATH).
 *
 * A unix stream socket, created with owner-only permissions (0600), served
 * by one thread that multiplexes up to 64 connections at once (poll(2),
 * a deadline per connection), so an idle or slow client holds only its
 * own connection.  The filter supplies what the commands do through
 * struct bcf_ctl_ops; this module owns the socket, the wire protocol
 * (documented in ctl.c and bcachefilter-ctl(1)) and the parsing of
 * commands, and never touches the cache itself.
 *
 * Commands (one per connection):
 *   stats [--json | --prometheus]
 *   clear_stats
 *   set cache_mode writethrough|writearound|none|writeback
 *   set sequential_cutoff SIZE          (bytes, or with k/M/G suffix; 0 off)
 *   set sequential_bypass auto|always
 *   set congested_read_threshold_us|congested_write_threshold_us N
 *   set writeback_percent|writeback_delay|writeback_running|
 *       writeback_rate_update_seconds|copy_gc_enabled N
 *   trigger_gc
 *   writeback_flush
 *   detach
 *   detach_status
 *   show super [--json]
 */
#ifndef BCACHEFILTER_PLUGIN_CTL_H
#define BCACHEFILTER_PLUGIN_CTL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

/* The rule for the ops: they are called from the serving thread, one at
 * a time (never two at once), concurrently with the host's other threads
 * (NBD requests, the cache's background threads).  Since that thread
 * serves every client, an op must return promptly: read counters, take
 * short locks, set atomics; never wait for I/O or for background work (a
 * GC pass, a flush).  An op must not call bcf_ctl_start or bcf_ctl_stop
 * (stop would wait for the thread the op runs in). */
struct bcf_ctl_ops {
  /* Write the output of the command to fp.  Return 0, or -1 with a
   * message in err (what was wrong, and what to do). */
  int (*stats) (FILE *fp, bool json, char *err, size_t errlen);
  int (*set) (const char *name, const char *value, char *err, size_t errlen);
  int (*trigger_gc) (char *err, size_t errlen);
  /* Start a full-speed writeback of everything dirty; returns at once. */
  int (*writeback_flush) (char *err, size_t errlen);
  /* Start detaching the cache from its export (or let the caller follow
   * the detach under way or done); returns at once. */
  int (*detach) (char *err, size_t errlen);
  /* One line: how the detach stands ("none", "draining ...", "detached
   * ...", "failed ..."), and what it did or why it failed. */
  int (*detach_status) (FILE *fp, bool json, char *err, size_t errlen);
  int (*show_super) (FILE *fp, bool json, char *err, size_t errlen);
  /* stats --prometheus: the statistics in Prometheus's text exposition
   * format (json is false). */
  int (*prometheus) (FILE *fp, bool json, char *err, size_t errlen);
  /* bcache's clear_stats: counters and histograms start from zero. */
  int (*clear_stats) (char *err, size_t errlen);
};

/* Check that a control socket could be created at path (length fits
 * sun_path, the directory exists and is writable, nothing but a stale
 * socket is there).  For .config_complete/.get_ready.  Returns 0, or -1
 * with the reason in err. */
int bcf_ctl_check_path (const char *path, char *err, size_t errlen);

/* Create the socket and start the serving thread.  Returns 0, or -1 with
 * the reason in err. */
int bcf_ctl_start (const char *path, const struct bcf_ctl_ops *ops,
                   char *err, size_t errlen);
/* Stop the thread and remove the socket (idempotent). */
void bcf_ctl_stop (void);

#endif /* BCACHEFILTER_PLUGIN_CTL_H */
