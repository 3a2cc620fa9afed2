/* bcachefilter-ctl: talk to a running filter through its control socket.
 *
 * Design
 * ------
 * The filter (nbdkit ... bcache-ctl=PATH) serves a unix socket; the wire
 * protocol is in plugin/ctl.c and bcachefilter-ctl(1): one command line
 * per connection, answered by "ok\n" and the output, or by one line
 * "error: MESSAGE\n", then the server closes.
 *
 * This tool checks the shape of the command line (the command and the
 * number of arguments: usage errors are found before connecting), joins
 * the words into the command line, sends it, reads the whole answer
 * (bounded by a timeout) and prints the output.  The values themselves
 * (mode names, sizes) are checked by the server, which knows what the
 * filter supports; its message is passed on.  A word may not contain
 * white space or control characters, which the one-line protocol cannot
 * carry.
 *
 * flush and detach are made of several commands: the filter starts the
 * work (writeback_flush, detach) and returns at once, since its serving
 * thread never waits for the export; this tool then follows dirty_data
 * in the stats for the progress, and, for detach, detach_status for the
 * outcome, whose message is the final line (follow_writeback).
 *
 * The socket is -s/--socket PATH, else $BCACHEFILTER_CTL.
 *
 * Exit status (also in bcachefilter-ctl(1)):
 *   0  ok
 *   1  the filter answered with an error (printed on stderr), or the
 *      answer was lost, malformed or late, or the output cannot be written
 *   2  usage error
 *   3  cannot connect to the socket
 */

#include <config.h>

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "bcachefilter/request.h"

#define PROGRAM_NAME "bcachefilter-ctl"
#define SOCKET_ENV   "BCACHEFILTER_CTL"

/* Time allowed for the whole exchange.  The filter answers at once
 * except for commands that have to wait for the cache (trigger_gc may
 * wait for a garbage collection already running). */
#define REPLY_TIMEOUT_MS 60000
/* The server accepts lines of up to 4095 bytes. */
#define MAX_LINE 4095

enum {
  EXIT_OK      = 0,
  EXIT_ERROR   = 1,     /* the filter's error, or a broken exchange */
  EXIT_USAGE   = 2,
  EXIT_CONNECT = 3,
};

static void __attribute__ ((format (printf, 1, 2)))
error (const char *fs, ...)
{
  const int saved_errno = errno;   /* for %m in fs */
  va_list args;

  fprintf (stderr, "%s: ", PROGRAM_NAME);
  errno = saved_errno;
  va_start (args, fs);
  vfprintf (stderr, fs, args);
  va_end (args);
  fputc ('\n', stderr);
}

static void
usage (FILE *fp)
{
  fprintf (fp,
           "Usage: %s [-s|--socket PATH] COMMAND [ARGS...]\n"
           "       %s --help | --version\n"
           "Control a running nbdkit bcachefilter filter through its\n"
           "control socket (the filter's bcache-ctl=PATH parameter).\n"
           "\n"
           "Commands:\n"
           "  stats [--json | --prometheus]  the statistics: text, JSON, or\n"
           "                              Prometheus's text exposition format\n"
           "  clear_stats                 counters and histograms from zero\n"
           "  set cache_mode MODE         writethrough, writeback, writearound\n"
           "                              or none\n"
           "  set sequential_cutoff SIZE  bytes, or with a k, M or G suffix;\n"
           "                              0 disables\n"
           "  set sequential_bypass P     auto (not while the export is\n"
           "                              slower than the cache) or always\n"
           "  set congested_read_threshold_us N   cache reads slower than\n"
           "                              this congest it (0 disables)\n"
           "  set congested_write_threshold_us N  ... writes\n"
           "  set writeback_percent N     writeback: dirty share to keep\n"
           "  set writeback_delay S       writeback: pause after a full pass\n"
           "  set writeback_running 0|1   writeback: pause or resume\n"
           "  set writeback_rate_update_seconds S  the rate controller's period\n"
           "  set copy_gc_enabled 0|1     writeback: compact dirty data\n"
           "  flush [--timeout S]         write back all dirty data, showing\n"
           "                              progress; returns when none is left\n"
           "  detach [--timeout S]        write back all dirty data, then pass\n"
           "                              everything through and mark the cache\n"
           "                              detached from its export (before the\n"
           "                              export is used from another host)\n"
           "  detach_status               how a detach stands\n"
           "  trigger-gc                  start a garbage collection\n"
           "  show super [--json]         the cache superblock\n"
           "  help                        the commands the filter knows\n"
           "Options:\n"
           "  -s, --socket PATH  the control socket (default: $%s)\n"
           "  -h, --help         print this help and exit\n"
           "  -V, --version      print the version and exit\n"
           "\n"
           "Exit status: 0 ok, 1 the filter reported an error, 2 usage error,\n"
           "3 cannot connect.  See bcachefilter-ctl(1).\n",
           PROGRAM_NAME, PROGRAM_NAME, SOCKET_ENV);
}

static int __attribute__ ((format (printf, 1, 2)))
usage_error (const char *fs, ...)
{
  va_list args;

  fprintf (stderr, "%s: ", PROGRAM_NAME);
  va_start (args, fs);
  vfprintf (stderr, fs, args);
  va_end (args);
  fprintf (stderr, "\nTry '%s --help'.\n", PROGRAM_NAME);
  return EXIT_USAGE;
}

/* ------------------------------------------------------------------------
 * The command line to send
 * ------------------------------------------------------------------------ */

static bool
is_json (const char *arg)
{
  return strcmp (arg, "--json") == 0;
}

/* Check the command words; on success the words to send are
 * args[0..nargs), with args[0] possibly rewritten (trigger-gc). */
static int
check_command (int nargs, char **args)
{
  const char *cmd = args[0];

  if (strcmp (cmd, "stats") == 0) {
    if (nargs == 1 || (nargs == 2 && (is_json (args[1]) ||
                                      strcmp (args[1], "--prometheus") == 0)))
      return -1;
    return usage_error ("usage: stats [--json | --prometheus]");
  }
  if (strcmp (cmd, "set") == 0) {
    if (nargs != 3)
      return usage_error ("usage: set cache_mode MODE, or set "
                          "sequential_cutoff SIZE");
    if (!bcf_setting_find (args[1]))
      return usage_error ("set: unknown setting '%s': valid settings are "
                          "%s", args[1], bcf_setting_names ());
    return -1;
  }
  if (strcmp (cmd, "writeback_flush") == 0 ||
      strcmp (cmd, "detach_status") == 0 ||
      strcmp (cmd, "clear_stats") == 0) {
    if (nargs != 1)
      return usage_error ("usage: %s (no arguments)", cmd);
    return -1;
  }
  if (strcmp (cmd, "trigger-gc") == 0 || strcmp (cmd, "trigger_gc") == 0) {
    if (nargs != 1)
      return usage_error ("usage: trigger-gc (no arguments)");
    args[0] = (char *) "trigger_gc";
    return -1;
  }
  if (strcmp (cmd, "show") == 0) {
    if ((nargs == 2 || (nargs == 3 && is_json (args[2]))) &&
        strcmp (args[1], "super") == 0)
      return -1;
    return usage_error ("usage: show super [--json]");
  }
  if (strcmp (cmd, "help") == 0) {
    if (nargs != 1)
      return usage_error ("usage: help (no arguments)");
    return -1;
  }
  return usage_error ("unknown command '%s': valid commands are stats, "
                      "clear_stats, set, flush, detach, detach_status, "
                      "trigger-gc, show super and help", cmd);
}

/* Join the words into *linep = "w1 w2 ...\n".  Returns -1 to continue,
 * else the exit status (after a message). */
static int
make_line (int nargs, char **args, char **linep)
{
  size_t len = 0;
  char *line, *p;

  for (int i = 0; i < nargs; i++) {
    if (args[i][0] == '\0')
      return usage_error ("empty argument");
    for (const char *c = args[i]; *c; c++)
      if ((unsigned char) *c <= ' ' || (unsigned char) *c >= 0x7f)
        return usage_error ("argument '%s': only printable ASCII without "
                            "spaces can be sent", args[i]);
    len += strlen (args[i]) + 1;
  }
  if (len > MAX_LINE)
    return usage_error ("the command is too long (%zu bytes, at most %d)",
                        len, MAX_LINE);
  line = p = malloc (len + 1);
  if (line == NULL) {
    error ("out of memory");
    return EXIT_ERROR;
  }
  for (int i = 0; i < nargs; i++) {
    size_t n = strlen (args[i]);

    memcpy (p, args[i], n);
    p += n;
    *p++ = i + 1 < nargs ? ' ' : '\n';
  }
  *p = '\0';
  *linep = line;
  return -1;
}

/* ------------------------------------------------------------------------
 * The exchange
 * ------------------------------------------------------------------------ */

static uint64_t
now_ms (void)
{
  struct timespec ts;

  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000 + (uint64_t) ts.tv_nsec / 1000000;
}

/* Wait for events on fd until the deadline: 1 ready, 0 timeout, -1
 * error. */
static int
wait_fd (int fd, short events, uint64_t deadline)
{
  for (;;) {
    struct pollfd pfd = { .fd = fd, .events = events };
    uint64_t now = now_ms ();
    int r;

    if (now >= deadline)
      return 0;
    r = poll (&pfd, 1, (int) (deadline - now));
    if (r == -1 && errno == EINTR)
      continue;
    return r > 0 ? 1 : r;
  }
}

static int
connect_socket (const char *path)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  int fd;

  if (strlen (path) >= sizeof sun.sun_path) {
    error ("%s: the socket path is too long (at most %zu bytes)", path,
           sizeof sun.sun_path - 1);
    return -1;
  }
  memcpy (sun.sun_path, path, strlen (path) + 1);
  fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd == -1) {
    error ("socket: %m");
    return -1;
  }
  if (connect (fd, (struct sockaddr *) &sun, sizeof sun) == -1) {
    error ("cannot connect to %s: %m (is nbdkit running with "
           "bcache-ctl=%s?)", path, path);
    close (fd);
    return -1;
  }
  return fd;
}

/* Send line and read the whole answer into *reply (NUL-terminated).
 * Returns 0, or -1 after a message. */
static int
exchange (int fd, const char *path, const char *line, char **reply,
          size_t *replylen)
{
  const uint64_t deadline = now_ms () + REPLY_TIMEOUT_MS;
  size_t len = strlen (line), have = 0, cap = 4096;
  char *buf;

  while (len > 0) {
    ssize_t n = send (fd, line, len, MSG_NOSIGNAL | MSG_DONTWAIT);

    if (n == -1) {
      if (errno == EINTR)
        continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (wait_fd (fd, POLLOUT, deadline) != 1) {
          error ("%s: timed out sending the command", path);
          return -1;
        }
        continue;
      }
      error ("%s: sending the command: %m", path);
      return -1;
    }
    line += n;
    len -= (size_t) n;
  }

  buf = malloc (cap);
  if (buf == NULL) {
    error ("out of memory");
    return -1;
  }
  for (;;) {
    ssize_t n;
    int w;

    if (have + 1 == cap) {
      char *nbuf = realloc (buf, cap * 2);

      if (nbuf == NULL) {
        free (buf);
        error ("out of memory");
        return -1;
      }
      buf = nbuf;
      cap *= 2;
    }
    w = wait_fd (fd, POLLIN, deadline);
    if (w != 1) {
      free (buf);
      if (w == 0)
        error ("%s: no answer within %d seconds", path,
               REPLY_TIMEOUT_MS / 1000);
      else
        error ("%s: poll: %m", path);
      return -1;
    }
    n = recv (fd, buf + have, cap - have - 1, MSG_DONTWAIT);
    if (n == 0)
      break;
    if (n == -1) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
        continue;
      /* The server may reset the connection after answering; keep what
       * was read. */
      if (errno == ECONNRESET && have > 0)
        break;
      free (buf);
      error ("%s: reading the answer: %m", path);
      return -1;
    }
    have += (size_t) n;
  }
  buf[have] = '\0';
  *reply = buf;
  *replylen = have;
  return 0;
}

/* Print the answer; returns the exit status. */
static int
print_reply (const char *path, const char *reply, size_t len)
{
  const char *nl = memchr (reply, '\n', len);
  const char *body;
  size_t first;

  if (len == 0) {
    error ("%s: the filter closed the connection without answering",
           path);
    return EXIT_ERROR;
  }
  first = nl ? (size_t) (nl - reply) : len;
  body = nl ? nl + 1 : reply + len;

  if (first == 2 && memcmp (reply, "ok", 2) == 0) {
    size_t bodylen = len - (size_t) (body - reply);

    if (fwrite (body, 1, bodylen, stdout) != bodylen ||
        fflush (stdout) != 0) {
      error ("writing the output: %m");
      return EXIT_ERROR;
    }
    return EXIT_OK;
  }
  if (first >= 7 && memcmp (reply, "error: ", 7) == 0) {
    fprintf (stderr, "%s: %.*s\n", PROGRAM_NAME, (int) (first - 7),
             reply + 7);
    return EXIT_ERROR;
  }
  error ("%s: unexpected answer (not \"ok\" or \"error: ...\"): %.*s",
         path, (int) (first > 80 ? 80 : first), reply);
  return EXIT_ERROR;
}

/* One command, its answer in *reply (after "ok\n"); -1 after a
 * message (the filter's error included). */
static int
command (const char *path, const char *line, char **reply)
{
  size_t len;
  int fd = connect_socket (path), r;

  if (fd == -1)
    return -1;
  r = exchange (fd, path, line, reply, &len);
  close (fd);
  if (r == -1)
    return -1;
  if (strncmp (*reply, "ok\n", 3) != 0) {
    print_reply (path, *reply, len);
    free (*reply);
    return -1;
  }
  return 0;
}

/* A counter from the text stats ("name   value" lines). */
static bool
stat_value (const char *stats, const char *name, uint64_t *v)
{
  size_t n = strlen (name);

  for (const char *p = stats; p && *p; p = strchr (p, '\n'), p = p ? p + 1 : p)
    if (strncmp (p, name, n) == 0 && p[n] == ' ')
      return sscanf (p + n, "%" SCNu64, v) == 1;
  return false;
}

/* How the work a follower waits for stands, asked once per round with
 * the dirty bytes left: 1 done (the final line in msg), -1 failed (why,
 * in msg), 0 going on. */
typedef int (*stand_fn) (const char *path, uint64_t dirty, char *msg,
                         size_t len);

/* flush is done when nothing is dirty. */
static int
flush_stands (const char *path, uint64_t dirty, char *msg, size_t len)
{
  snprintf (msg, len, "flushed: no dirty data left");
  return dirty == 0;
}

/* detach is done when the filter says so (detach_status: "STATE
 * MESSAGE"). */
static int
detach_stands (const char *path, uint64_t dirty, char *msg, size_t len)
{
  char *reply, *nl, *sp;
  int r;

  if (command (path, "detach_status\n", &reply) == -1) {
    snprintf (msg, len, "the filter's detach_status failed (above)");
    return -1;
  }
  if ((nl = strchr (reply + 3, '\n')))
    *nl = '\0';
  sp = strchr (reply + 3, ' ');
  snprintf (msg, len, "%s", sp ? sp + 1 : "no detach is under way");
  if (strncmp (reply + 3, "detached", 8) == 0)
    r = 1;
  else if (strncmp (reply + 3, "draining", 8) == 0)
    r = 0;
  else
    r = -1;                     /* failed, or none: stopped */
  free (reply);
  return r;
}

/* flush and detach: send start_line (which starts the work in the
 * filter and returns at once), then follow dirty_data in the stats and
 * ask stand whether it is done, a few times a second at first, then once
 * a second: the serving thread never waits for the export, so the
 * waiting is done here.  Progress on stderr: a line rewritten in place
 * on a terminal, a line every 10 s otherwise.  The final line on
 * stdout. */
static int
follow_writeback (const char *path, const char *start_line,
                  unsigned timeout_s, stand_fn stand, const char *again)
{
  const bool tty = isatty (STDERR_FILENO);
  const uint64_t start = now_ms ();
  uint64_t first = 0, last_line = 0, errors0 = 0;
  char *reply, msg[2048];

  if (command (path, start_line, &reply) == -1)
    return EXIT_ERROR;
  free (reply);
  for (unsigned i = 0;; i++) {
    uint64_t dirty, errors = 0, now;
    int st;

    if (command (path, "stats\n", &reply) == -1)
      return EXIT_ERROR;
    if (!stat_value (reply, "dirty_data", &dirty)) {
      free (reply);
      error ("%s: the stats have no dirty_data", path);
      return EXIT_ERROR;
    }
    stat_value (reply, "writeback_backing_errors", &errors);
    free (reply);
    if (i == 0) {
      first = dirty;
      errors0 = errors;
    }
    now = now_ms ();
    if ((st = stand (path, dirty, msg, sizeof msg)) != 0) {
      if (tty && i > 0)
        fprintf (stderr, "\r\033[K");
      if (st < 0) {
        error ("%s", msg);
        return EXIT_ERROR;
      }
      printf ("%s (%.1f s)\n", msg, (double) (now - start) / 1000);
      return EXIT_OK;
    }
    if (dirty > 0 && (tty || now - last_line >= 10000)) {
      fprintf (stderr, "%s%" PRIu64 " MiB of dirty data left (%.0f%% "
               "written back)%s%s", tty ? "\r\033[K" : "",
               dirty >> 20, first > dirty ? 100.0 * (double) (first - dirty)
               / (double) first : 0.0,
               errors > errors0 ? ", the export is failing writes: "
               "retrying" : "", tty ? "" : "\n");
      last_line = now;
    }
    if (timeout_s && now - start >= (uint64_t) timeout_s * 1000) {
      if (tty)
        fputc ('\n', stderr);
      error ("%s: %" PRIu64 " bytes still dirty after %u s (%s)", path,
             dirty, timeout_s, again);
      return EXIT_ERROR;
    }
    usleep (i < 10 ? 100000 : 1000000);
  }
}

/* flush|detach [--timeout S]: the seconds, or 0; -1 after a usage
 * error (*status set). */
static long
parse_timeout (int n, char **args, int *status)
{
  char *end;
  unsigned long v;

  if (n == 1)
    return 0;
  if (n != 3 || strcmp (args[1], "--timeout") != 0) {
    *status = usage_error ("usage: %s [--timeout SECONDS]", args[0]);
    return -1;
  }
  v = strtoul (args[2], &end, 10);
  if (*end || end == args[2] || v == 0 || v > 86400 * 365) {
    *status = usage_error ("%s --timeout S: give a number of seconds",
                           args[0]);
    return -1;
  }
  return (long) v;
}

int
main (int argc, char *argv[])
{
  static const struct option long_options[] = {
    { "socket",  required_argument, NULL, 's' },
    { "help",    no_argument,       NULL, 'h' },
    { "version", no_argument,       NULL, 'V' },
    { NULL, 0, NULL, 0 }
  };
  const char *path = NULL;
  char *line = NULL, *reply = NULL;
  size_t replylen;
  int c, fd, r;

  /* "+": stop at the command, so that its own options ("--json") are
   * left to it. */
  while ((c = getopt_long (argc, argv, "+s:hV", long_options, NULL)) != -1) {
    switch (c) {
    case 's': path = optarg; break;
    case 'h': usage (stdout); return EXIT_OK;
    case 'V': printf ("%s %s\n", PROGRAM_NAME, PACKAGE_VERSION); return EXIT_OK;
    default: usage (stderr); return EXIT_USAGE;
    }
  }
  if (optind == argc)
    return usage_error ("missing COMMAND");
  if (path == NULL)
    path = getenv (SOCKET_ENV);
  if (path == NULL || path[0] == '\0')
    return usage_error ("no control socket: give -s PATH or set $%s (the "
                        "filter's bcache-ctl=PATH)", SOCKET_ENV);

  if (strcmp (argv[optind], "flush") == 0 ||
      strcmp (argv[optind], "detach") == 0) {
    const bool flush = strcmp (argv[optind], "flush") == 0;
    long timeout = parse_timeout (argc - optind, &argv[optind], &r);

    if (timeout < 0)
      return r;
    if (flush)
      return follow_writeback (path, "writeback_flush\n", (unsigned) timeout,
                               flush_stands, "the data is kept; run flush "
                               "again");
    return follow_writeback (path, "detach\n", (unsigned) timeout,
                             detach_stands, "the detach goes on in the "
                             "filter; run detach again to follow it");
  }
  r = check_command (argc - optind, &argv[optind]);
  if (r >= 0)
    return r;
  r = make_line (argc - optind, &argv[optind], &line);
  if (r >= 0)
    return r;

  fd = connect_socket (path);
  if (fd == -1) {
    free (line);
    return EXIT_CONNECT;
  }
  r = exchange (fd, path, line, &reply, &replylen);
  close (fd);
  free (line);
  if (r == -1)
    return EXIT_ERROR;
  r = print_reply (path, reply, replylen);
  free (reply);
  return r;
}
