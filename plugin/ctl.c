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
 * gets no answer.  Commands:
 *
 *   stats [--json]                          ops->stats
 *   set cache_mode MODE   (the filter names and checks the modes)
 *                                           ops->set ("cache_mode", MODE)
 *   set sequential_cutoff SIZE              ops->set ("sequential_cutoff",
 *                                           bytes in decimal); SIZE is
 *                                           digits with an optional k, M or
 *                                           G suffix (powers of 1024, either
 *                                           case), 0 disables
 *   trigger_gc (or trigger-gc)              ops->trigger_gc
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
 * One thread serves the socket, one connection at a time: it polls the
 * listening socket and a stop pipe; for a connection it polls the
 * (non-blocking) connection and the stop pipe with the time left until
 * the connection's deadline (CTL_TIMEOUT_MS for reading the command, the
 * same again for writing the reply), so a slow, silent or non-reading
 * client holds the thread for at most that long, and bcf_ctl_stop is
 * served within one poll.  Replies are sent with MSG_NOSIGNAL (no
 * SIGPIPE).  The thread is created with every signal blocked, so signals
 * go to the host's threads.  As a second check behind the 0600 mode, a
 * peer whose uid (SO_PEERCRED) is neither ours nor root's is refused.
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
 * and ops, which are set before it starts and changed only after it has
 * been joined.  The ops are called from the serving thread, one at a
 * time; they must not call bcf_ctl_stop (it would wait for itself).
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

#include "ctl.h"

#define CTL_MAX_LINE    4096    /* bytes, including the newline */
#define CTL_MAX_WORDS   8
#define CTL_TIMEOUT_MS  5000    /* to send the command; again to read the reply */
#define CTL_BACKLOG     16
#define CTL_QUOTE_MAX   40      /* bytes of a client's word quoted back */
#define CTL_ERR_MAX     1024

#define SUN_PATH_MAX (sizeof ((struct sockaddr_un *) NULL)->sun_path)

#define VALID_COMMANDS \
  "stats [--json], set cache_mode MODE, set sequential_cutoff SIZE, " \
  "trigger_gc, show super [--json], help"

static pthread_mutex_t ctl_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  bool running;
  pthread_t thread;
  int listen_fd;
  int stop_rd, stop_wr;                 /* the stop pipe */
  const struct bcf_ctl_ops *ops;
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

  /* cache_mode is passed on as it is: the filter's parser is the one
   * place that knows the modes (and why writeback is refused). */
  if (strcmp (name, "cache_mode") == 0)
    ;
  else if (strcmp (name, "sequential_cutoff") == 0) {
    uint64_t bytes;

    if (!parse_size (value, &bytes)) {
      reply_error (r, "invalid sequential_cutoff '%s': give a size in "
                   "bytes, optionally with a k, M or G suffix (0 disables)",
                   quote (value, q, sizeof q));
      return;
    }
    snprintf (num, sizeof num, "%" PRIu64, bytes);
    value = num;
  }
  else {
    reply_error (r, "unknown setting '%s': valid settings are cache_mode "
                 "and sequential_cutoff", quote (name, q, sizeof q));
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

static const char help_text[] =
  "stats [--json]              hit/miss/bypass counters (total, five_minute, hour, day)\n"
  "set cache_mode MODE         MODE: writethrough, writearound or none\n"
  "set sequential_cutoff SIZE  bytes, or with a k, M or G suffix; 0 disables\n"
  "trigger_gc                  start a garbage collection\n"
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
    else
      reply_error (r, "usage: stats [--json]");
  }
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
           strcmp (word[0], "trigger-gc") == 0) {
    char err[CTL_ERR_MAX] = "";

    if (nw != 1)
      reply_error (r, "usage: trigger_gc (no arguments)");
    else if (ops->trigger_gc == NULL)
      reply_error (r, "trigger_gc is not supported by this filter");
    else if (ops->trigger_gc (err, sizeof err) != 0)
      reply_error (r, "%s", err);
    else
      reply_ok (r, "");
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

/* Wait until fd is ready for events, the deadline passes or stop is
 * requested.  Returns 1 ready, 0 timed out, -1 stop requested or error. */
static int
wait_fd (int fd, short events, uint64_t deadline)
{
  for (;;) {
    struct pollfd pfd[2] = {
      { .fd = fd, .events = events },
      { .fd = ctl.stop_rd, .events = POLLIN },
    };
    uint64_t now = now_ms ();
    int r;

    if (now >= deadline)
      return 0;
    r = poll (pfd, 2, (int) (deadline - now));
    if (r == -1) {
      if (errno == EINTR)
        continue;
      return -1;
    }
    if (pfd[1].revents)
      return -1;
    if (pfd[0].revents)
      return 1;
  }
}

/* Send all of buf before the deadline (best effort). */
static void
send_all (int fd, const char *buf, size_t len, uint64_t deadline)
{
  while (len > 0) {
    ssize_t n = send (fd, buf, len, MSG_NOSIGNAL);

    if (n == -1) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return;
      if (wait_fd (fd, POLLOUT, deadline) != 1)
        return;
      continue;
    }
    buf += n;
    len -= (size_t) n;
  }
}

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

/* Serve one accepted (non-blocking) connection. */
static void
serve_connection (int fd, const struct bcf_ctl_ops *ops)
{
  char line[CTL_MAX_LINE + 1];  /* + 1: room for the NUL */
  struct reply r = { NULL, 0 };
  uint64_t deadline = now_ms () + CTL_TIMEOUT_MS;
  size_t len = 0;
  char *nl = NULL;

  if (!peer_allowed (fd)) {
    reply_error (&r, "permission denied");
    goto send;
  }

  while (nl == NULL) {
    ssize_t n;
    int w;

    if (len == CTL_MAX_LINE) {
      reply_error (&r, "command too long (the limit is %d bytes): valid "
                   "commands: " VALID_COMMANDS, CTL_MAX_LINE - 1);
      goto send;
    }
    n = recv (fd, line + len, CTL_MAX_LINE - len, 0);
    if (n == 0) {               /* end of the command without a newline */
      if (len == 0)
        return;                 /* nothing asked: no answer */
      break;
    }
    if (n == -1) {
      if (errno == EINTR)
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return;
      w = wait_fd (fd, POLLIN, deadline);
      if (w == -1)
        return;                 /* stopping */
      if (w == 0) {
        reply_error (&r, "timed out: no complete command line within %d "
                     "seconds", CTL_TIMEOUT_MS / 1000);
        goto send;
      }
      continue;
    }
    nl = memchr (line + len, '\n', (size_t) n);
    len += (size_t) n;
  }
  if (nl != NULL)
    len = (size_t) (nl - line);

  handle_line (ops, line, len, &r);
  if (r.buf == NULL)
    reply_error (&r, "out of memory");

 send:
  if (r.buf != NULL)
    send_all (fd, r.buf, r.len, now_ms () + CTL_TIMEOUT_MS);
  free (r.buf);
}

static void *
serve (void *arg)
{
  const struct bcf_ctl_ops *ops = arg;

  for (;;) {
    struct pollfd pfd[2] = {
      { .fd = ctl.listen_fd, .events = POLLIN },
      { .fd = ctl.stop_rd, .events = POLLIN },
    };
    int fd;

    if (poll (pfd, 2, -1) == -1) {
      if (errno == EINTR)
        continue;
      break;
    }
    if (pfd[1].revents)
      break;
    if (!(pfd[0].revents & POLLIN))
      continue;

    fd = accept4 (ctl.listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd == -1) {
      /* Out of descriptors or memory: the connection stays queued, so
       * back off instead of spinning (the stop pipe still wakes us). */
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        struct pollfd spfd = { .fd = ctl.stop_rd, .events = POLLIN };

        if (poll (&spfd, 1, 100) == 1)
          break;
      }
      continue;
    }
    serve_connection (fd, ops);
    close (fd);
  }
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
  ctl.path[0] = '\0';
  ctl.ops = NULL;
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
  ctl.ops = ops;

  /* The thread blocks every signal: they are the host's business. */
  sigfillset (&all);
  pthread_sigmask (SIG_SETMASK, &all, &old);
  r = pthread_create (&ctl.thread, NULL, serve, (void *) ops);
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
