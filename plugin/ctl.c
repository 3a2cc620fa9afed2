/* bcachefilter: the control socket server.  See ctl.h for the interface.
 *
 * Wire protocol (also in bcachefilter-ctl(1))
 * -------------------------------------------
 * A client connects to the unix stream socket and sends one command line:
 * printable ASCII words separated by spaces or tabs, ended by "\n" (an
 * optional "\r" before it is ignored) or by the client shutting down its
 * writing side.  At most CTL_MAX_LINE - 1 bytes before the newline; the
 * whole line must arrive within CTL_TIMEOUT_MS of the connection being
 * accepted.  Anything after the newline is ignored.  The server answers
 *
 *   ok\n
 *   BODY (the command's output, possibly empty)
 *
 * or
 *
 *   error: MESSAGE\n          (one line: what was wrong and what is valid)
 *
 * and closes the connection.  A connection closed before any byte is sent
 * gets no answer.  While CTL_MAX_CONNS connections are being served, new
 * ones wait for a free slot; once every slot has been taken for
 * CTL_QUEUE_MS, waiting and new connections are answered "error: busy:
 * ..." without their line being read, until a slot frees.  Commands:
 *
 *   stats [--json]                          ops->stats
 *   stats --prometheus                      ops->prometheus: the text
 *                                           exposition format 0.0.4
 *   clear_stats                             ops->clear_stats (bcache's):
 *                                           counters and histograms from
 *                                           zero, gauges kept
 *   set cache_mode MODE   (the filter names and checks the modes)
 *                                           ops->set ("cache_mode", MODE)
 *   set sequential_cutoff SIZE              ops->set ("sequential_cutoff",
 *                                           bytes in decimal); SIZE is
 *                                           digits with an optional k, M or
 *                                           G suffix (powers of 1024, either
 *                                           case), 0 disables
 *   set sequential_bypass auto|always       ops->set, as it is
 *   set congested_read_threshold_us N,
 *   set congested_write_threshold_us N,
 *   set writeback_percent N (and the other
 *   writeback_ knobs)                       ops->set; N whole decimal
 *   trigger_gc (or trigger-gc)              ops->trigger_gc
 *   writeback_flush                         ops->writeback_flush (starts
 *                                           it; the client follows
 *                                           dirty_data in the stats)
 *   detach                                  ops->detach (starts it; the
 *                                           client follows detach_status)
 *   detach_status                           ops->detach_status: one line,
 *                                           STATE [MESSAGE], STATE one of
 *                                           none, draining, detached,
 *                                           failed
 *   show super [--json]                     ops->show_super
 *   help                                    the list above
 *
 * Design
 * ------
 * Everything received is untrusted: the line is read into a fixed buffer
 * (no allocation driven by the client), checked byte by byte (printable
 * ASCII and tabs only), split into at most CTL_MAX_WORDS words and
 * matched exactly; words quoted back in error messages are shortened.
 * Messages from the ops are flattened to one line.  The ops write their
 * output to a memory stream, so a failing command sends no partial body.
 *
 * Serving many clients
 * --------------------
 * A monitoring scraper must never wait behind an idle client, and
 * nothing a client does may cost more than its own connection.  One
 * thread serves every connection with a poll(2) loop: each connection
 * is a slot (struct conn) with its own fixed line buffer, its reply and
 * the deadline of its phase (CTL_TIMEOUT_MS to send the command line
 * from the moment it is accepted, the same again to take the reply).
 * The loop polls the stop pipe, the listening socket and every open
 * connection (non-blocking) with the nearest deadline as its timeout;
 * a ready connection is advanced as far as it goes without waiting, a
 * connection past its deadline is answered "timed out" or dropped.  So
 * a silent, dripping or non-reading client holds its slot for at most
 * 2 * CTL_TIMEOUT_MS and delays no one, and bcf_ctl_stop is served
 * within one poll.  A newly accepted connection is read at once: a
 * client that sent its line before being accepted (the usual case) is
 * answered and gone within the same turn of the loop.
 *
 * Why a loop and not a thread per connection: the commands are short
 * (they read counters and set atomics), so running them one at a time
 * costs nothing, and it keeps the rule for the ops as it was (called
 * one at a time, from one thread).  The memory is fixed when the server
 * starts (CTL_MAX_CONNS slots of CTL_MAX_LINE bytes, no allocation
 * driven by a client apart from the reply, bounded by what the ops
 * write), and idle clients cost no threads.  The price: an op that
 * blocks delays every client, hence the rule in ctl.h.
 *
 * Bounds.  At most CTL_MAX_CONNS connections are served at once.  When
 * every slot is taken the listening socket is not polled: further
 * connections wait in the kernel's listen queue (CTL_BACKLOG long, so a
 * burst of connects is queued rather than refused with EAGAIN) for a
 * slot to free.  If none frees within CTL_QUEUE_MS of the last slot
 * being taken, they (and new ones, until a slot frees) are accepted,
 * answered "error: busy: ..." at once, and closed.  At most
 * CTL_MAX_CONNS connections are accepted per turn of the loop, so a
 * stream of new clients does not starve the open ones.  Replies are
 * sent with MSG_NOSIGNAL (no SIGPIPE).  The thread is created with every
 * signal blocked, so signals go to the host's threads.  As a second
 * check behind the 0600 mode, a peer whose uid (SO_PEERCRED) is neither
 * ours nor root's is refused.
 *
 * The socket is created owner-only with no window: the socket inode is
 * fchmod'ed to 0600 before bind (Linux creates the file with the socket
 * inode's mode minus the umask), and after bind the file is checked
 * (a socket, ours, mode exactly 0600) or removed again.  The umask is not
 * touched: it is per process and other threads may be creating files.
 * An existing path is replaced only if it is a stale socket (connect
 * refused); a live socket, or anything else, is refused.  bcf_ctl_stop
 * removes the socket only if it is still the file we created (same device
 * and inode).
 *
 * Locking: ctl_lock serializes bcf_ctl_check_path / start / stop and
 * guards struct ctl.  The serving thread reads only listen_fd, stop_rd
 * and server, which are set before it starts and changed only after it
 * has been joined; struct server is that thread's alone.  The ops are
 * called from the serving thread, one at a time (see ctl.h).
 *
 * This file uses only libc and pthreads (no nbdkit), so that it can be
 * unit tested on its own.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>

#include "bcachefilter/request.h"
#include "ctl.h"

#define CTL_MAX_LINE    4096    /* bytes, including the newline */
#define CTL_MAX_WORDS   8
#define CTL_TIMEOUT_MS  5000    /* to send the command; again to read the reply */
#define CTL_MAX_CONNS   64      /* connections served at once */
#define CTL_QUEUE_MS    500     /* the longest wait for a slot when all are taken */
#define CTL_BACKLOG     4096    /* the listen queue (the kernel caps it at
                                 * net.core.somaxconn) */
#define CTL_ACCEPT_PAUSE_MS 100 /* out of descriptors: retry accepting after */
#define CTL_QUOTE_MAX   40      /* bytes of a client's word quoted back */
#define CTL_ERR_MAX     1024

#define SUN_PATH_MAX (sizeof ((struct sockaddr_un *) NULL)->sun_path)

#define VALID_COMMANDS \
  "stats [--json], set NAME VALUE, trigger_gc, writeback_flush, " \
  "detach, detach_status, show super [--json], stats --prometheus, " \
  "clear_stats, help"

static pthread_mutex_t ctl_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  bool running;
  pthread_t thread;
  int listen_fd;
  int stop_rd, stop_wr;                 /* the stop pipe */
  struct server *server;                /* the serving thread's own */
  char path[SUN_PATH_MAX];
  dev_t dev;                            /* of the socket file we made */
  ino_t ino;
} ctl = { .listen_fd = -1, .stop_rd = -1, .stop_wr = -1 };

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

/* Format a message into err (if there is room) and return -1. */
static int __attribute__ ((format (printf, 3, 4)))
fail (char *err, size_t errlen, const char *fs, ...)
{
  const int saved_errno = errno;   /* for %m in fs */
  va_list args;

  if (err != NULL && errlen > 0) {
    errno = saved_errno;
    va_start (args, fs);
    vsnprintf (err, errlen, fs, args);
    va_end (args);
  }
  errno = saved_errno;
  return -1;
}

static void
close_fd (int *fd)
{
  if (*fd >= 0) {
    close (*fd);
    *fd = -1;
  }
}

static uint64_t
now_ms (void)
{
  struct timespec ts;

  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000 + (uint64_t) ts.tv_nsec / 1000000;
}

static const char *
file_type (mode_t mode)
{
  if (S_ISREG (mode)) return "regular file";
  if (S_ISDIR (mode)) return "directory";
  if (S_ISLNK (mode)) return "symbolic link";
  if (S_ISFIFO (mode)) return "fifo";
  if (S_ISCHR (mode)) return "character device";
  if (S_ISBLK (mode)) return "block device";
  return "special file";
}

/* ------------------------------------------------------------------------
 * The socket path
 * ------------------------------------------------------------------------ */

/* Is there a live server on the socket at path?  1 yes, 0 no (stale:
 * connection refused), -1 error (errno set). */
static int
socket_live (const char *path)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  int fd, r;

  memcpy (sun.sun_path, path, strlen (path) + 1);
  fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd == -1)
    return -1;
  r = connect (fd, (struct sockaddr *) &sun, sizeof sun);
  if (r == 0 || errno == EAGAIN || errno == EINPROGRESS)
    r = 1;                      /* accepted, or queued on a full backlog */
  else if (errno == ECONNREFUSED)
    r = 0;
  else
    r = -1;
  if (r == -1) {
    const int saved_errno = errno;
    close (fd);
    errno = saved_errno;
  }
  else
    close (fd);
  return r;
}

/* bcf_ctl_check_path, with ctl_lock held.  *stale is set when the path
 * holds a stale socket that may be removed. */
static int
check_path_locked (const char *path, bool *stale, char *err, size_t errlen)
{
  char dir[SUN_PATH_MAX];
  const char *slash;
  struct stat st;
  size_t len;

  *stale = false;
  if (path == NULL || path[0] == '\0')
    return fail (err, errlen, "the control socket path is empty");
  len = strlen (path);
  if (len >= SUN_PATH_MAX)
    return fail (err, errlen,
                 "control socket path too long (%zu bytes; a unix socket "
                 "path must be shorter than %zu): choose a shorter path: %s",
                 len, SUN_PATH_MAX, path);
  if (path[len - 1] == '/')
    return fail (err, errlen, "control socket path %s names a directory: "
                 "give the path of the socket file", path);

  /* The directory must exist and be writable. */
  slash = strrchr (path, '/');
  if (slash == NULL)
    strcpy (dir, ".");
  else if (slash == path)
    strcpy (dir, "/");
  else {
    memcpy (dir, path, (size_t) (slash - path));
    dir[slash - path] = '\0';
  }
  if (stat (dir, &st) == -1)
    return fail (err, errlen, "control socket directory %s: %m%s", dir,
                 errno == ENOENT ? " (create it first)" : "");
  if (!S_ISDIR (st.st_mode))
    return fail (err, errlen, "control socket directory %s is not a "
                 "directory", dir);
  if (access (dir, W_OK | X_OK) == -1)
    return fail (err, errlen, "cannot create the control socket in %s: %m",
                 dir);

  /* Nothing there, or a stale socket. */
  if (lstat (path, &st) == -1) {
    if (errno == ENOENT)
      return 0;
    return fail (err, errlen, "control socket %s: %m", path);
  }
  if (!S_ISSOCK (st.st_mode))
    return fail (err, errlen, "%s exists and is a %s, not a socket: "
                 "refusing to replace it; remove it or choose another path",
                 path, file_type (st.st_mode));
  switch (socket_live (path)) {
  case 0:
    *stale = true;
    return 0;
  case 1:
    return fail (err, errlen, "control socket %s is in use by a running "
                 "process (another nbdkit?): stop it or choose another path",
                 path);
  default:
    return fail (err, errlen, "cannot tell whether control socket %s is "
                 "in use: connect: %m; remove it or choose another path",
                 path);
  }
}

int
bcf_ctl_check_path (const char *path, char *err, size_t errlen)
{
  bool stale;
  int r;

  pthread_mutex_lock (&ctl_lock);
  if (ctl.running && path != NULL && strcmp (path, ctl.path) == 0)
    r = 0;                      /* ours */
  else
    r = check_path_locked (path, &stale, err, errlen);
  pthread_mutex_unlock (&ctl_lock);
  return r;
}

/* ------------------------------------------------------------------------
 * Commands
 * ------------------------------------------------------------------------ */

/* A reply being built: "ok\n" + body, or "error: ...\n". */
struct reply {
  char *buf;
  size_t len;
};

/* Make r an error reply.  The message is flattened to one line. */
static void __attribute__ ((format (printf, 2, 3)))
reply_error (struct reply *r, const char *fs, ...)
{
  char msg[CTL_ERR_MAX];
  va_list args;
  int n;

  va_start (args, fs);
  vsnprintf (msg, sizeof msg, fs, args);
  va_end (args);
  for (char *p = msg; *p; p++)
    if ((unsigned char) *p < 0x20 || *p == 0x7f)
      *p = ' ';
  free (r->buf);
  r->buf = NULL;
  r->len = 0;
  n = asprintf (&r->buf, "error: %s\n", msg[0] ? msg : "failed");
  if (n < 0) {
    r->buf = NULL;
    r->len = 0;
  }
  else
    r->len = (size_t) n;
}

/* A client's word, shortened for quoting in a message. */
static const char *
quote (const char *word, char *buf, size_t buflen)
{
  if (strlen (word) < CTL_QUOTE_MAX)
    return word;
  snprintf (buf, buflen, "%.*s...", CTL_QUOTE_MAX - 4, word);
  return buf;
}

/* SIZE: decimal digits, optionally k, M or G (either case, powers of
 * 1024).  Returns false on syntax error or overflow. */
static bool
parse_size (const char *s, uint64_t *out)
{
  uint64_t v = 0, mult = 1;

  if (*s < '0' || *s > '9')
    return false;
  for (; *s >= '0' && *s <= '9'; s++)
    if (__builtin_mul_overflow (v, 10, &v) ||
        __builtin_add_overflow (v, (uint64_t) (*s - '0'), &v))
      return false;
  switch (*s) {
  case '\0': break;
  case 'k': case 'K': mult = UINT64_C (1) << 10; s++; break;
  case 'm': case 'M': mult = UINT64_C (1) << 20; s++; break;
  case 'g': case 'G': mult = UINT64_C (1) << 30; s++; break;
  default: return false;
  }
  if (*s != '\0' || __builtin_mul_overflow (v, mult, &v))
    return false;
  *out = v;
  return true;
}

/* Run an ops function that writes output: the output goes to a memory
 * stream and becomes the body only if the function succeeds. */
static void
run_output (struct reply *r, const char *what,
            int (*fn) (FILE *, bool, char *, size_t), bool json)
{
  char err[CTL_ERR_MAX] = "";
  char *body = NULL;
  size_t bodylen = 0;
  FILE *fp;
  int ret;

  if (fn == NULL) {
    reply_error (r, "%s is not supported by this filter", what);
    return;
  }
  fp = open_memstream (&body, &bodylen);
  if (fp == NULL) {
    reply_error (r, "%s: cannot allocate the output buffer: %m", what);
    return;
  }
  ret = fn (fp, json, err, sizeof err);
  if (fclose (fp) != 0 && ret == 0) {
    ret = -1;
    snprintf (err, sizeof err, "%s: cannot write the output: %m", what);
  }
  if (ret != 0) {
    free (body);
    reply_error (r, "%s", err);
    return;
  }
  free (r->buf);
  r->buf = malloc (3 + bodylen);
  if (r->buf == NULL) {
    free (body);
    reply_error (r, "%s: out of memory", what);
    return;
  }
  memcpy (r->buf, "ok\n", 3);
  memcpy (r->buf + 3, body, bodylen);
  r->len = 3 + bodylen;
  free (body);
}

static void
reply_ok (struct reply *r, const char *body)
{
  size_t n = strlen (body);

  free (r->buf);
  r->buf = malloc (3 + n);
  if (r->buf == NULL) {
    r->len = 0;
    return;
  }
  memcpy (r->buf, "ok\n", 3);
  memcpy (r->buf + 3, body, n);
  r->len = 3 + n;
}

static void
run_set (struct reply *r, const struct bcf_ctl_ops *ops,
         const char *name, const char *value)
{
  char err[CTL_ERR_MAX] = "";
  char num[32], q[CTL_QUOTE_MAX + 8];

  const struct bcf_setting *st = bcf_setting_find (name);

  /* Words are passed on as they are: the filter's parsers are the one
   * place that knows the modes and policies. */
  if (st && st->value == BCF_SETTING_WORD)
    ;
  else if (st && st->value == BCF_SETTING_NUMBER) {
    uint64_t n;

    if (!parse_size (value, &n) || n > UINT32_MAX ||
        strspn (value, "0123456789") != strlen (value)) {
      reply_error (r, "invalid %s '%s': give a whole number", name,
                   quote (value, q, sizeof q));
      return;
    }
  }
  else if (st && st->value == BCF_SETTING_SIZE) {
    uint64_t bytes;

    if (!parse_size (value, &bytes)) {
      reply_error (r, "invalid %s '%s': give a size in bytes, optionally "
                   "with a k, M or G suffix (0 disables)", name,
                   quote (value, q, sizeof q));
      return;
    }
    snprintf (num, sizeof num, "%" PRIu64, bytes);
    value = num;
  }
  else {
    reply_error (r, "unknown setting '%s': valid settings are %s",
                 quote (name, q, sizeof q), bcf_setting_names ());
    return;
  }

  if (ops->set == NULL) {
    reply_error (r, "set is not supported by this filter");
    return;
  }
  if (ops->set (name, value, err, sizeof err) != 0)
    reply_error (r, "%s", err);
  else
    reply_ok (r, "");
}

/* A command without arguments or output that starts something in the
 * filter (fn): "ok" and an empty body, or the filter's error. */
static void
run_action (struct reply *r, const char *what,
            int (*fn) (char *err, size_t errlen), size_t nw)
{
  char err[CTL_ERR_MAX] = "";

  if (nw != 1)
    reply_error (r, "usage: %s (no arguments)", what);
  else if (fn == NULL)
    reply_error (r, "%s is not supported by this filter", what);
  else if (fn (err, sizeof err) != 0)
    reply_error (r, "%s", err);
  else
    reply_ok (r, "");
}

static const char help_text[] =
  "stats [--json]              hit/miss/bypass counters (total, five_minute, hour, day)\n"
  "stats --prometheus          the same in Prometheus's text format\n"
  "clear_stats                 counters and histograms from zero (gauges stay)\n"
  "set cache_mode MODE         MODE: writethrough, writeback, writearound or none\n"
  "set sequential_cutoff SIZE  bytes, or with a k, M or G suffix; 0 disables\n"
  "set sequential_bypass P     auto (not while the export is slower) or always\n"
  "set congested_read_threshold_us N   cache reads slower than this congest\n"
  "set congested_write_threshold_us N  ... writes; 0 disables\n"
  "set writeback_percent N     writeback: dirty share to keep, 0-100\n"
  "set writeback_delay S       writeback: pause after a full pass\n"
  "set writeback_running 0|1   writeback: pause or resume the writeback\n"
  "set writeback_rate_update_seconds S  the rate controller's period, 1-60\n"
  "set copy_gc_enabled 0|1     writeback: compact dirty data (moving GC)\n"
  "trigger_gc                  start a garbage collection\n"
  "writeback_flush             write back everything now, at full speed\n"
  "detach                      write back everything, then pass through and\n"
  "                            mark the cache detached from its export\n"
  "detach_status               how the detach stands\n"
  "show super [--json]         the cache superblock\n"
  "help                        this list\n";

/* Check the line and run the command in it.  line[len] is writable. */
static void
handle_line (const struct bcf_ctl_ops *ops, char *line, size_t len,
             struct reply *r)
{
  char *word[CTL_MAX_WORDS];
  char q[CTL_QUOTE_MAX + 8];
  size_t nw = 0;
  char *p, *save = NULL;

  if (len > 0 && line[len - 1] == '\r')
    len--;
  for (size_t i = 0; i < len; i++) {
    const unsigned char c = (unsigned char) line[i];

    if ((c < 0x20 && c != '\t') || c >= 0x7f) {
      reply_error (r, "invalid byte 0x%02x at offset %zu: a command is one "
                   "line of printable ASCII; valid commands: "
                   VALID_COMMANDS, c, i);
      return;
    }
  }
  line[len] = '\0';

  for (p = strtok_r (line, " \t", &save); p != NULL;
       p = strtok_r (NULL, " \t", &save)) {
    if (nw == CTL_MAX_WORDS) {
      reply_error (r, "too many words; valid commands: " VALID_COMMANDS);
      return;
    }
    word[nw++] = p;
  }

  if (nw == 0)
    reply_error (r, "empty command; valid commands: " VALID_COMMANDS);
  else if (strcmp (word[0], "stats") == 0) {
    if (nw == 1 || (nw == 2 && strcmp (word[1], "--json") == 0))
      run_output (r, "stats", ops->stats, nw == 2);
    else if (nw == 2 && strcmp (word[1], "--prometheus") == 0)
      run_output (r, "stats --prometheus", ops->prometheus, false);
    else
      reply_error (r, "usage: stats [--json], or stats --prometheus");
  }
  else if (strcmp (word[0], "clear_stats") == 0)
    run_action (r, "clear_stats", ops->clear_stats, nw);
  else if (strcmp (word[0], "show") == 0) {
    if ((nw == 2 || (nw == 3 && strcmp (word[2], "--json") == 0)) &&
        strcmp (word[1], "super") == 0)
      run_output (r, "show super", ops->show_super, nw == 3);
    else
      reply_error (r, "usage: show super [--json]");
  }
  else if (strcmp (word[0], "set") == 0) {
    if (nw == 3)
      run_set (r, ops, word[1], word[2]);
    else
      reply_error (r, "usage: set cache_mode MODE, or "
                   "set sequential_cutoff SIZE");
  }
  else if (strcmp (word[0], "trigger_gc") == 0 ||
           strcmp (word[0], "trigger-gc") == 0)
    run_action (r, "trigger_gc", ops->trigger_gc, nw);
  else if (strcmp (word[0], "writeback_flush") == 0)
    run_action (r, "writeback_flush", ops->writeback_flush, nw);
  else if (strcmp (word[0], "detach") == 0)
    run_action (r, "detach", ops->detach, nw);
  else if (strcmp (word[0], "detach_status") == 0) {
    if (nw == 1)
      run_output (r, "detach_status", ops->detach_status, false);
    else
      reply_error (r, "usage: detach_status (no arguments)");
  }
  else if (strcmp (word[0], "help") == 0) {
    if (nw == 1)
      reply_ok (r, help_text);
    else
      reply_error (r, "usage: help (no arguments)");
  }
  else
    reply_error (r, "unknown command '%s'; valid commands: " VALID_COMMANDS,
                 quote (word[0], q, sizeof q));
}

/* ------------------------------------------------------------------------
 * The serving thread
 * ------------------------------------------------------------------------ */

/* A connection being served (a slot of struct server): first its
 * command line is read into line, then the reply r is sent from offset
 * sent.  Each phase has its own deadline. */
struct conn {
  int fd;                       /* -1: the slot is free */
  bool writing;                 /* the reply is ready */
  uint64_t deadline;            /* of the current phase (now_ms) */
  size_t len;                   /* bytes in line */
  size_t sent;                  /* bytes of r sent */
  struct reply r;
  char line[CTL_MAX_LINE + 1];  /* + 1: room for the NUL */
};

/* The serving thread's state: allocated by bcf_ctl_start, then touched
 * by that thread alone until it has been joined (no lock). */
struct server {
  const struct bcf_ctl_ops *ops;
  unsigned nconn;               /* slots in use */
  uint64_t full_since;          /* when the last slot was taken; 0: not full */
  uint64_t accept_after;        /* accepting paused until then (out of fds) */
  struct conn conn[CTL_MAX_CONNS];
};

static bool
peer_allowed (int fd)
{
#ifdef SO_PEERCRED
  struct ucred cred;
  socklen_t len = sizeof cred;

  if (getsockopt (fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
    return cred.uid == geteuid () || cred.uid == 0;
#endif
  return true;                  /* the 0600 mode is the check */
}

/* The reply in c->r is complete: start sending it. */
static void
conn_reply (struct conn *c)
{
  if (c->r.buf == NULL)
    reply_error (&c->r, "out of memory");
  c->writing = true;
  c->sent = 0;
  c->deadline = now_ms () + CTL_TIMEOUT_MS;
}

/* Read what has arrived; once the line is complete (newline or end of
 * file) or too long, build the reply.  Returns false if the connection
 * is finished without an answer (closed before any byte, or broken). */
static bool
conn_read (const struct server *s, struct conn *c)
{
  for (;;) {
    ssize_t n;
    char *nl;

    if (c->len == CTL_MAX_LINE) {
      reply_error (&c->r, "command too long (the limit is %d bytes): valid "
                   "commands: " VALID_COMMANDS, CTL_MAX_LINE - 1);
      conn_reply (c);
      return true;
    }
    n = recv (c->fd, c->line + c->len, CTL_MAX_LINE - c->len, 0);
    if (n == -1) {
      if (errno == EINTR)
        continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;   /* wait for more */
    }
    if (n == 0) {               /* end of the command without a newline */
      if (c->len == 0)
        return false;           /* nothing asked: no answer */
      break;
    }
    nl = memchr (c->line + c->len, '\n', (size_t) n);
    c->len += (size_t) n;
    if (nl != NULL) {
      c->len = (size_t) (nl - c->line);
      break;
    }
  }
  handle_line (s->ops, c->line, c->len, &c->r);
  conn_reply (c);
  return true;
}

/* Send what the socket takes of the reply.  Returns false when the
 * connection is finished: all sent, or the peer is gone. */
static bool
conn_write (struct conn *c)
{
  while (c->sent < c->r.len) {
    ssize_t n = send (c->fd, c->r.buf + c->sent, c->r.len - c->sent,
                      MSG_NOSIGNAL);

    if (n == -1) {
      if (errno == EINTR)
        continue;
      return errno == EAGAIN || errno == EWOULDBLOCK;
    }
    c->sent += (size_t) n;
  }
  return false;
}

/* The connection is ready (or was just accepted): advance it as far as
 * it goes without waiting.  Returns false when it is finished. */
static bool
conn_step (const struct server *s, struct conn *c)
{
  if (!c->writing && !conn_read (s, c))
    return false;
  return c->writing ? conn_write (c) : true;
}

/* The deadline of c's phase has passed: a command line that did not
 * come is answered with an error; a reply not taken is dropped.  Returns
 * false when the connection is finished. */
static bool
conn_expire (struct conn *c)
{
  if (c->writing)
    return false;
  reply_error (&c->r, "timed out: no complete command line within %d "
               "seconds", CTL_TIMEOUT_MS / 1000);
  conn_reply (c);
  return conn_write (c);
}

static void
conn_open (struct server *s, struct conn *c, int fd)
{
  *c = (struct conn) { .fd = fd, .deadline = now_ms () + CTL_TIMEOUT_MS };
  if (++s->nconn == CTL_MAX_CONNS)
    s->full_since = now_ms ();
  if (!peer_allowed (fd)) {
    reply_error (&c->r, "permission denied");
    conn_reply (c);
  }
}

static void
conn_close (struct server *s, struct conn *c)
{
  close_fd (&c->fd);
  free (c->r.buf);
  c->r = (struct reply) { NULL, 0 };
  s->nconn--;
  s->full_since = 0;
}

/* Refuse a connection beyond the bound: one line, without waiting. */
static void
refuse_busy (int fd)
{
  char msg[256];
  int n;

  n = snprintf (msg, sizeof msg, "error: busy: %d control connections are "
                "open, the most served at once, and none finished within "
                "%d ms; try again\n", CTL_MAX_CONNS, CTL_QUEUE_MS);
  if (n > 0)
    (void) send (fd, msg, (size_t) n, MSG_NOSIGNAL | MSG_DONTWAIT);
  close (fd);
}

/* Is this the time to accept?  Not while accepting is paused (out of
 * descriptors), nor while every slot is taken, for up to CTL_QUEUE_MS:
 * new connections wait in the listen queue for a free slot, and after
 * that are accepted and refused.  If not, *wake is lowered to when it
 * will be. */
static bool
accepting (const struct server *s, uint64_t now, uint64_t *wake)
{
  uint64_t from = s->accept_after;

  if (s->nconn == CTL_MAX_CONNS && s->full_since + CTL_QUEUE_MS > from)
    from = s->full_since + CTL_QUEUE_MS;
  if (now >= from)
    return true;
  if (from < *wake)
    *wake = from;
  return false;
}

static struct conn *
free_slot (struct server *s)
{
  for (unsigned i = 0; i < CTL_MAX_CONNS; i++)
    if (s->conn[i].fd == -1)
      return &s->conn[i];
  return NULL;
}

/* A pollfd in pfd (and its connection in polled) for every open
 * connection, waiting to read its line or to send its reply; *wake is
 * lowered to the nearest deadline.  Returns how many. */
static nfds_t
conn_pollfds (struct server *s, struct pollfd *pfd, struct conn **polled,
              uint64_t *wake)
{
  nfds_t n = 0;

  for (unsigned i = 0; i < CTL_MAX_CONNS; i++) {
    struct conn *c = &s->conn[i];

    if (c->fd == -1)
      continue;
    polled[n] = c;
    pfd[n++] = (struct pollfd) {
      .fd = c->fd, .events = c->writing ? POLLOUT : POLLIN,
    };
    if (c->deadline < *wake)
      *wake = c->deadline;
  }
  return n;
}

/* Advance every open connection that is ready now (a poll that does not
 * wait): a client that left, or whose reply went out, frees its slot.
 * accept_queued asks this before it refuses a connection as busy: the
 * accept loop also takes connections that came after the turn's poll,
 * and a client that came after another left was refused while a slot was
 * in fact free (test-ctl's test_slots_full, under load: the server was
 * preempted after refusing one client, whose next client closed an idle
 * connection and connected again before the loop went on). */
static void
reap_ready (struct server *s)
{
  struct pollfd pfd[CTL_MAX_CONNS];
  struct conn *polled[CTL_MAX_CONNS];
  uint64_t ignored = UINT64_MAX;
  nfds_t n = conn_pollfds (s, pfd, polled, &ignored);

  if (poll (pfd, n, 0) <= 0)
    return;
  for (nfds_t i = 0; i < n; i++)
    if (pfd[i].revents && !conn_step (s, polled[i]))
      conn_close (s, polled[i]);
}

/* Accept what the listen queue holds, at most CTL_MAX_CONNS at a time
 * (the open connections get their turn), and serve each as far as it
 * goes at once: a client that sent its line before being accepted is
 * answered here and frees its slot again. */
static void
accept_queued (struct server *s)
{
  for (unsigned i = 0; i < CTL_MAX_CONNS; i++) {
    uint64_t ignored = UINT64_MAX;
    struct conn *c;
    int fd;

    if (!accepting (s, now_ms (), &ignored))
      return;
    fd = accept4 (ctl.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd == -1) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      /* Out of descriptors or memory: the connection stays queued, so
       * pause accepting instead of spinning. */
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM)
        s->accept_after = now_ms () + CTL_ACCEPT_PAUSE_MS;
      return;
    }
    c = free_slot (s);
    if (c == NULL) {
      reap_ready (s);
      c = free_slot (s);
    }
    if (c == NULL) {
      refuse_busy (fd);
      continue;
    }
    conn_open (s, c, fd);
    if (!conn_step (s, c))
      conn_close (s, c);
  }
}

/* One poll(2) over the stop pipe, the listening socket (when accepting)
 * and every open connection, with the nearest deadline as timeout. */
static void *
serve (void *arg)
{
  struct server *s = arg;
  struct pollfd pfd[2 + CTL_MAX_CONNS];
  struct conn *polled[CTL_MAX_CONNS];

  for (;;) {
    uint64_t now = now_ms (), wake = UINT64_MAX;
    nfds_t n = 2;
    int timeout;

    pfd[0] = (struct pollfd) { .fd = ctl.stop_rd, .events = POLLIN };
    pfd[1] = (struct pollfd) { .fd = -1 };      /* -1: ignored by poll */
    if (accepting (s, now, &wake))
      pfd[1] = (struct pollfd) { .fd = ctl.listen_fd, .events = POLLIN };
    n += conn_pollfds (s, pfd + 2, polled, &wake);
    if (wake == UINT64_MAX)
      timeout = -1;
    else
      timeout = wake <= now ? 0
        : wake - now > INT_MAX ? INT_MAX : (int) (wake - now);

    if (poll (pfd, n, timeout) == -1) {
      if (errno == EINTR)
        continue;
      break;
    }
    if (pfd[0].revents)
      break;                    /* bcf_ctl_stop */

    now = now_ms ();
    for (nfds_t i = 2; i < n; i++) {
      struct conn *c = polled[i - 2];
      bool open = pfd[i].revents ? conn_step (s, c) : true;

      if (open && now >= c->deadline)
        open = conn_expire (c);
      if (!open)
        conn_close (s, c);
    }
    if (pfd[1].revents)
      accept_queued (s);
  }

  for (unsigned i = 0; i < CTL_MAX_CONNS; i++)
    if (s->conn[i].fd != -1)
      conn_close (s, &s->conn[i]);
  return NULL;
}

/* ------------------------------------------------------------------------
 * Start and stop
 * ------------------------------------------------------------------------ */

/* Undo a partial start (ctl_lock held). */
static void
cleanup_locked (bool unlink_socket)
{
  struct stat st;

  close_fd (&ctl.listen_fd);
  close_fd (&ctl.stop_rd);
  close_fd (&ctl.stop_wr);
  if (unlink_socket && lstat (ctl.path, &st) == 0 &&
      st.st_dev == ctl.dev && st.st_ino == ctl.ino)
    unlink (ctl.path);
  free (ctl.server);
  ctl.server = NULL;
  ctl.path[0] = '\0';
}

int
bcf_ctl_start (const char *path, const struct bcf_ctl_ops *ops,
               char *err, size_t errlen)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  sigset_t all, old;
  struct stat st;
  int pipefd[2];
  bool stale;
  int r;

  if (ops == NULL)
    return fail (err, errlen, "bcf_ctl_start: no ops");

  pthread_mutex_lock (&ctl_lock);
  if (ctl.running) {
    r = fail (err, errlen, "the control socket is already running at %s",
              ctl.path);
    goto out;
  }
  r = check_path_locked (path, &stale, err, errlen);
  if (r == -1)
    goto out;
  if (stale && unlink (path) == -1 && errno != ENOENT) {
    r = fail (err, errlen, "cannot remove stale control socket %s: %m",
              path);
    goto out;
  }
  strcpy (ctl.path, path);
  memcpy (sun.sun_path, path, strlen (path) + 1);

  ctl.listen_fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK,
                          0);
  if (ctl.listen_fd == -1) {
    r = fail (err, errlen, "control socket: socket: %m");
    goto fail_nofile;
  }
  /* Owner-only from the start (see the header comment).  Where the
   * system does not support this, the check after bind catches it. */
  (void) fchmod (ctl.listen_fd, S_IRUSR | S_IWUSR);
  if (bind (ctl.listen_fd, (struct sockaddr *) &sun, sizeof sun) == -1) {
    r = fail (err, errlen, "control socket %s: bind: %m%s", path,
              errno == EADDRINUSE ? " (created by someone else meanwhile)"
              : "");
    goto fail_nofile;
  }
  if (lstat (path, &st) == -1) {
    r = fail (err, errlen, "control socket %s: lstat after bind: %m", path);
    goto fail_nofile;
  }
  if (!S_ISSOCK (st.st_mode) || st.st_uid != geteuid ()) {
    r = fail (err, errlen, "control socket %s was replaced after bind: "
              "check who else can write to its directory", path);
    goto fail_nofile;
  }
  ctl.dev = st.st_dev;
  ctl.ino = st.st_ino;
  if ((st.st_mode & 07777) != (S_IRUSR | S_IWUSR)) {
    if (st.st_mode & (S_IRWXG | S_IRWXO))
      r = fail (err, errlen, "control socket %s was created with mode %04o, "
                "not 0600 (this system does not honour fchmod before bind): "
                "refusing to serve a socket that others can reach",
                path, (unsigned) (st.st_mode & 07777));
    else
      r = fail (err, errlen, "control socket %s was created with mode %04o, "
                "not 0600: the umask removes owner permissions",
                path, (unsigned) (st.st_mode & 07777));
    goto fail_file;
  }
  if (listen (ctl.listen_fd, CTL_BACKLOG) == -1) {
    r = fail (err, errlen, "control socket %s: listen: %m", path);
    goto fail_file;
  }
  if (pipe2 (pipefd, O_CLOEXEC | O_NONBLOCK) == -1) {
    r = fail (err, errlen, "control socket: pipe: %m");
    goto fail_file;
  }
  ctl.stop_rd = pipefd[0];
  ctl.stop_wr = pipefd[1];
  ctl.server = calloc (1, sizeof *ctl.server);
  if (ctl.server == NULL) {
    r = fail (err, errlen, "control socket: out of memory");
    goto fail_file;
  }
  ctl.server->ops = ops;
  for (unsigned i = 0; i < CTL_MAX_CONNS; i++)
    ctl.server->conn[i].fd = -1;

  /* The thread blocks every signal: they are the host's business. */
  sigfillset (&all);
  pthread_sigmask (SIG_SETMASK, &all, &old);
  r = pthread_create (&ctl.thread, NULL, serve, ctl.server);
  pthread_sigmask (SIG_SETMASK, &old, NULL);
  if (r != 0) {
    errno = r;
    r = fail (err, errlen, "control socket: cannot start its thread: %m");
    goto fail_file;
  }
  ctl.running = true;
  r = 0;
  goto out;

 fail_nofile:
  ctl.dev = 0;
  ctl.ino = 0;
  cleanup_locked (false);
  goto out;
 fail_file:
  cleanup_locked (true);
 out:
  pthread_mutex_unlock (&ctl_lock);
  return r;
}

void
bcf_ctl_stop (void)
{
  pthread_mutex_lock (&ctl_lock);
  if (ctl.running) {
    ssize_t n;

    do
      n = write (ctl.stop_wr, "x", 1);
    while (n == -1 && errno == EINTR);
    pthread_join (ctl.thread, NULL);
    ctl.running = false;
    cleanup_locked (true);
  }
  pthread_mutex_unlock (&ctl_lock);
}
