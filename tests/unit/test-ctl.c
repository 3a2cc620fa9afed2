/* Unit tests for plugin/ctl.c (the control socket) and for
 * tools/bcachefilter-ctl.
 *
 * The server is started on a socket in a fresh temporary directory with a
 * test ops table that records what it was called with and answers with
 * fixed output (or fails on request).  It is driven two ways: by raw
 * socket I/O (well-formed and malformed lines, an overlong line, a line
 * without newline that must time out, binary garbage, many concurrent
 * clients) and by running the built bcachefilter-ctl binary (found
 * through BUILDDIR), whose output and exit status are checked.  The socket
 * file itself is checked too: mode 0600 whatever the umask, a stale socket
 * is replaced, a live one or any other file is refused, stop removes it.
 * Under load: idle and half-line clients held open delay no one, a burst
 * of 300 non-blocking connects is queued and answered, and with every
 * slot taken a new client waits for one, then is told "busy"; stop stays
 * prompt with all the slots taken.
 */
#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <spawn.h>
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
#include <sys/un.h>
#include <sys/wait.h>

#include <check.h>

#include "ctl.h"
#include "testlib.h"

#define CTL_BIN BUILDDIR "/../tools/bcachefilter-ctl"

extern char **environ;

/* ---- The recording ops ---------------------------------------------------- */

/* Written by the server thread under rec_lock; the test reads the
 * snapshot "seen", taken under the lock after each exchange. */
struct record {
  int stats, set, gc, super;        /* calls */
  int prometheus, clear;            /* ... of the statistics' commands */
  bool json;                        /* of the last stats / show_super */
  char name[64], value[64];         /* of the last set */
  bool fail;                        /* make every call fail */
};
static pthread_mutex_t rec_lock = PTHREAD_MUTEX_INITIALIZER;
static struct record rec, seen;

static void
look (void)
{
  pthread_mutex_lock (&rec_lock);
  seen = rec;
  pthread_mutex_unlock (&rec_lock);
}

static bool
rec_fail (void)
{
  bool f;

  pthread_mutex_lock (&rec_lock);
  f = rec.fail;
  pthread_mutex_unlock (&rec_lock);
  return f;
}

static void
set_fail (bool f)
{
  pthread_mutex_lock (&rec_lock);
  rec.fail = f;
  pthread_mutex_unlock (&rec_lock);
}

static int
op_stats (FILE *fp, bool json, char *err, size_t errlen)
{
  pthread_mutex_lock (&rec_lock);
  rec.stats++;
  rec.json = json;
  pthread_mutex_unlock (&rec_lock);
  fputs (json ? "{\"cache_hits\":1}\n" : "cache_hits 1\n", fp);
  if (rec_fail ()) {
    snprintf (err, errlen, "disk on fire\nsecond line");
    return -1;
  }
  return 0;
}

static int
op_set (const char *name, const char *value, char *err, size_t errlen)
{
  pthread_mutex_lock (&rec_lock);
  rec.set++;
  snprintf (rec.name, sizeof rec.name, "%s", name);
  snprintf (rec.value, sizeof rec.value, "%s", value);
  pthread_mutex_unlock (&rec_lock);
  if (rec_fail ()) {
    snprintf (err, errlen, "cannot set %s", name);
    return -1;
  }
  return 0;
}

static int
op_gc (char *err, size_t errlen)
{
  pthread_mutex_lock (&rec_lock);
  rec.gc++;
  pthread_mutex_unlock (&rec_lock);
  if (rec_fail ()) {
    snprintf (err, errlen, "gc failed");
    return -1;
  }
  return 0;
}

static int
op_super (FILE *fp, bool json, char *err, size_t errlen)
{
  pthread_mutex_lock (&rec_lock);
  rec.super++;
  rec.json = json;
  pthread_mutex_unlock (&rec_lock);
  fputs (json ? "{\"sb\":{}}\n" : "sb.magic\t\tok\n", fp);
  return 0;
}

static int
op_prometheus (FILE *fp, bool json, char *err, size_t errlen)
{
  pthread_mutex_lock (&rec_lock);
  rec.prometheus++;
  rec.json = json;
  pthread_mutex_unlock (&rec_lock);
  fputs ("# HELP bcachefilter_x X.\n# TYPE bcachefilter_x gauge\n"
         "bcachefilter_x 1\n", fp);
  return 0;
}

static int
op_clear (char *err, size_t errlen)
{
  pthread_mutex_lock (&rec_lock);
  rec.clear++;
  pthread_mutex_unlock (&rec_lock);
  if (rec_fail ()) {
    snprintf (err, errlen, "cannot clear");
    return -1;
  }
  return 0;
}

static const struct bcf_ctl_ops ops = {
  .stats = op_stats, .set = op_set, .trigger_gc = op_gc,
  .show_super = op_super,
};

/* ---- Fixture: a temporary directory and the socket path ------------------- */

static char dir[64];
static char sock[128];

static void
setup (void)
{
  strcpy (dir, "/tmp/test-ctl-XXXXXX");
  ck_assert_ptr_nonnull (mkdtemp (dir));
  snprintf (sock, sizeof sock, "%s/ctl.sock", dir);
  pthread_mutex_lock (&rec_lock);
  memset (&rec, 0, sizeof rec);
  pthread_mutex_unlock (&rec_lock);
  look ();
}

static void
teardown (void)
{
  char cmd[256];

  bcf_ctl_stop ();
  snprintf (cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system (cmd) != 0)
    fprintf (stderr, "cannot remove %s\n", dir);
}

static void
start (void)
{
  char err[256] = "";

  ck_assert_msg (bcf_ctl_start (sock, &ops, err, sizeof err) == 0,
                 "bcf_ctl_start: %s", err);
}

/* ---- Raw socket I/O ------------------------------------------------------- */

static int
connect_to (const char *path)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  int fd = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

  ck_assert_int_ge (fd, 0);
  strcpy (sun.sun_path, path);
  ck_assert_msg (connect (fd, (struct sockaddr *) &sun, sizeof sun) == 0,
                 "connect %s: %s", path, strerror (errno));
  return fd;
}

/* Read until EOF (at most timeout_ms); returns the bytes, NUL-terminated. */
static char *
read_all (int fd, int timeout_ms)
{
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc (cap);

  ck_assert_ptr_nonnull (buf);
  for (;;) {
    struct pollfd pfd = { .fd = fd, .events = POLLIN };
    ssize_t n;

    ck_assert_msg (poll (&pfd, 1, timeout_ms) == 1, "no answer in time");
    n = read (fd, buf + len, cap - len - 1);
    if (n == -1 && errno == ECONNRESET)
      break;
    ck_assert_int_ge (n, 0);
    if (n == 0)
      break;
    len += (size_t) n;
    ck_assert_uint_lt (len, cap - 1);
  }
  buf[len] = '\0';
  return buf;
}

static void
write_all (int fd, const void *data, size_t len)
{
  const char *p = data;

  while (len > 0) {
    ssize_t n = send (fd, p, len, MSG_NOSIGNAL);

    if (n == -1 && errno == EINTR)
      continue;
    ck_assert_int_gt (n, 0);
    p += n;
    len -= (size_t) n;
  }
}

/* Send len bytes (and shut down writing if shut), return the answer. */
static char *
talk (const void *data, size_t len, bool shut)
{
  int fd = connect_to (sock);
  char *r;

  write_all (fd, data, len);
  if (shut)
    shutdown (fd, SHUT_WR);
  r = read_all (fd, 20000);
  close (fd);
  return r;
}

static char *
cmd (const char *line)
{
  return talk (line, strlen (line), false);
}

static void
expect_reply (const char *line, const char *want)
{
  char *r = cmd (line);

  ck_assert_msg (strcmp (r, want) == 0, "%s -> [%s], want [%s]", line, r,
                 want);
  free (r);
  look ();
}

static void
expect_prefix (const char *line, const char *want)
{
  char *r = cmd (line);

  ck_assert_msg (strncmp (r, want, strlen (want)) == 0,
                 "[%s] -> [%s], want prefix [%s]", line, r, want);
  if (strncmp (want, "error:", 6) == 0)
    ck_assert_msg (strchr (r, '\n') == r + strlen (r) - 1,
                   "[%s] -> [%s]: not one line", line, r);
  free (r);
  look ();
}

/* ---- Running bcachefilter-ctl --------------------------------------------- */

struct run {
  int status;
  char *out, *err;
};

static char *
slurp (const char *path)
{
  FILE *fp = fopen (path, "r");
  char *buf = calloc (1, 1 << 16);
  size_t n;

  ck_assert_ptr_nonnull (fp);
  ck_assert_ptr_nonnull (buf);
  n = fread (buf, 1, (1 << 16) - 1, fp);
  buf[n] = '\0';
  fclose (fp);
  return buf;
}

/* Run bcachefilter-ctl with the arguments (NULL-terminated) and with
 * BCACHEFILTER_CTL=env_socket in its environment (unset if NULL). */
static struct run
run_ctl (const char *env_socket, ...)
{
  char *argv[16], *envp[256], envbuf[256], out[128], errp[128];
  posix_spawn_file_actions_t fa;
  struct run res;
  va_list args;
  int n = 0, e = 0, st;
  pid_t pid;

  ck_assert_msg (access (CTL_BIN, X_OK) == 0,
                 "%s not found: build tools/bcachefilter-ctl first", CTL_BIN);
  argv[n++] = (char *) "bcachefilter-ctl";
  va_start (args, env_socket);
  while ((argv[n] = va_arg (args, char *)) != NULL)
    n++;
  va_end (args);

  for (char **ep = environ; *ep && e < 250; ep++)
    if (strncmp (*ep, "BCACHEFILTER_CTL=", 17) != 0)
      envp[e++] = *ep;
  if (env_socket) {
    snprintf (envbuf, sizeof envbuf, "BCACHEFILTER_CTL=%s", env_socket);
    envp[e++] = envbuf;
  }
  envp[e] = NULL;

  snprintf (out, sizeof out, "%s/stdout", dir);
  snprintf (errp, sizeof errp, "%s/stderr", dir);
  posix_spawn_file_actions_init (&fa);
  posix_spawn_file_actions_addopen (&fa, 1, out,
                                    O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_addopen (&fa, 2, errp,
                                    O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ck_assert_int_eq (posix_spawn (&pid, CTL_BIN, &fa, NULL, argv, envp), 0);
  posix_spawn_file_actions_destroy (&fa);
  ck_assert_int_eq (waitpid (pid, &st, 0), pid);
  ck_assert_msg (WIFEXITED (st), "bcachefilter-ctl died: %d", st);
  res.status = WEXITSTATUS (st);
  res.out = slurp (out);
  res.err = slurp (errp);
  look ();
  return res;
}

static void
free_run (struct run *r)
{
  free (r->out);
  free (r->err);
}

/* ---- The socket file ------------------------------------------------------ */

/* Make a stale socket at path: bound, then closed without unlinking. */
static void
make_stale (const char *path)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  int fd = socket (AF_UNIX, SOCK_STREAM, 0);

  strcpy (sun.sun_path, path);
  ck_assert_int_eq (bind (fd, (struct sockaddr *) &sun, sizeof sun), 0);
  close (fd);
}

static void
check_mode_0600 (void)
{
  struct stat st;

  ck_assert_int_eq (lstat (sock, &st), 0);
  ck_assert (S_ISSOCK (st.st_mode));
  ck_assert_uint_eq (st.st_uid, geteuid ());
  ck_assert_msg ((st.st_mode & 07777) == 0600, "mode %o",
                 (unsigned) (st.st_mode & 07777));
}

START_TEST (test_start_stop)
{
  char err[256];
  mode_t old = umask (0);       /* the most permissive umask */

  start ();
  umask (old);
  check_mode_0600 ();
  expect_prefix ("help\n", "ok\n");

  /* A second start is refused, check_path accepts our own socket. */
  ck_assert_int_eq (bcf_ctl_start (sock, &ops, err, sizeof err), -1);
  ck_assert_ptr_nonnull (strstr (err, "already running"));
  ck_assert_int_eq (bcf_ctl_check_path (sock, err, sizeof err), 0);

  bcf_ctl_stop ();
  ck_assert_int_eq (access (sock, F_OK), -1);
  bcf_ctl_stop ();              /* idempotent */

  /* And again, with a restrictive umask. */
  old = umask (077);
  start ();
  umask (old);
  check_mode_0600 ();
  expect_prefix ("help\n", "ok\n");
  bcf_ctl_stop ();
  ck_assert_int_eq (access (sock, F_OK), -1);
}
END_TEST

START_TEST (test_stale_replaced)
{
  char err[256] = "";

  make_stale (sock);
  ck_assert_int_eq (bcf_ctl_check_path (sock, err, sizeof err), 0);
  start ();
  check_mode_0600 ();
  expect_reply ("stats\n", "ok\ncache_hits 1\n");
}
END_TEST

START_TEST (test_live_refused)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  int fd = socket (AF_UNIX, SOCK_STREAM, 0);
  char err[256] = "";
  struct stat a, b;

  strcpy (sun.sun_path, sock);
  ck_assert_int_eq (bind (fd, (struct sockaddr *) &sun, sizeof sun), 0);
  ck_assert_int_eq (listen (fd, 4), 0);
  ck_assert_int_eq (lstat (sock, &a), 0);

  ck_assert_int_eq (bcf_ctl_check_path (sock, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "in use") != NULL, "%s", err);
  err[0] = '\0';
  ck_assert_int_eq (bcf_ctl_start (sock, &ops, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "in use") != NULL, "%s", err);
  ck_assert_int_eq (lstat (sock, &b), 0);
  ck_assert_uint_eq (a.st_ino, b.st_ino);
  close (fd);
}
END_TEST

START_TEST (test_non_socket_refused)
{
  char err[256] = "", buf[16] = "";
  char other[160];
  FILE *fp = fopen (sock, "w");

  /* A regular file is left alone. */
  ck_assert_ptr_nonnull (fp);
  fputs ("precious", fp);
  fclose (fp);
  ck_assert_int_eq (bcf_ctl_start (sock, &ops, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "regular file") != NULL &&
                 strstr (err, "not a socket") != NULL, "%s", err);
  fp = fopen (sock, "r");
  ck_assert_ptr_nonnull (fp);
  ck_assert_ptr_nonnull (fgets (buf, sizeof buf, fp));
  fclose (fp);
  ck_assert_str_eq (buf, "precious");
  ck_assert_int_eq (unlink (sock), 0);

  /* A directory. */
  ck_assert_int_eq (mkdir (sock, 0700), 0);
  ck_assert_int_eq (bcf_ctl_start (sock, &ops, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "directory") != NULL, "%s", err);
  ck_assert_int_eq (rmdir (sock), 0);

  /* A symbolic link, even one to a stale socket. */
  snprintf (other, sizeof other, "%s/other.sock", dir);
  make_stale (other);
  ck_assert_int_eq (symlink (other, sock), 0);
  ck_assert_int_eq (bcf_ctl_start (sock, &ops, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "symbolic link") != NULL, "%s", err);
  ck_assert_int_eq (access (other, F_OK), 0);
}
END_TEST

START_TEST (test_check_path)
{
  char err[256] = "", path[300];

  memset (path, 'a', sizeof path - 1);
  path[0] = '/';
  path[sizeof path - 1] = '\0';
  ck_assert_int_eq (bcf_ctl_check_path (path, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "too long") != NULL, "%s", err);

  ck_assert_int_eq (bcf_ctl_check_path ("", err, sizeof err), -1);
  ck_assert_int_eq (bcf_ctl_check_path (NULL, err, sizeof err), -1);

  snprintf (path, sizeof path, "%s/missing/ctl.sock", dir);
  ck_assert_int_eq (bcf_ctl_check_path (path, err, sizeof err), -1);
  ck_assert_msg (strstr (err, "create it first") != NULL, "%s", err);
  ck_assert_int_eq (bcf_ctl_start (path, &ops, err, sizeof err), -1);

  snprintf (path, sizeof path, "%s/", dir);
  ck_assert_int_eq (bcf_ctl_check_path (path, err, sizeof err), -1);

  /* A good path; checking creates nothing. */
  ck_assert_int_eq (bcf_ctl_check_path (sock, err, sizeof err), 0);
  ck_assert_int_eq (access (sock, F_OK), -1);

  /* An unwritable directory (root may write anywhere: skip). */
  if (geteuid () != 0) {
    snprintf (path, sizeof path, "%s/ro", dir);
    ck_assert_int_eq (mkdir (path, 0500), 0);
    strcat (path, "/ctl.sock");
    ck_assert_int_eq (bcf_ctl_check_path (path, err, sizeof err), -1);
  }

  /* Tiny error buffers are fine. */
  ck_assert_int_eq (bcf_ctl_check_path ("", err, 1), -1);
  ck_assert_int_eq (bcf_ctl_check_path ("", NULL, 0), -1);
}
END_TEST

/* ---- Commands ------------------------------------------------------------- */

START_TEST (test_commands)
{
  start ();

  expect_reply ("stats\n", "ok\ncache_hits 1\n");
  ck_assert_int_eq (seen.stats, 1);
  ck_assert (!seen.json);
  expect_reply ("stats --json\n", "ok\n{\"cache_hits\":1}\n");
  ck_assert (seen.json);
  expect_reply ("show super\n", "ok\nsb.magic\t\tok\n");
  ck_assert (!seen.json);
  expect_reply ("show super --json\n", "ok\n{\"sb\":{}}\n");
  ck_assert (seen.json);
  ck_assert_int_eq (seen.super, 2);

  expect_reply ("set cache_mode writeback\n", "ok\n");
  ck_assert_str_eq (seen.name, "cache_mode");
  ck_assert_str_eq (seen.value, "writeback");
  expect_reply ("set cache_mode none\n", "ok\n");
  ck_assert_str_eq (seen.value, "none");

  static const struct { const char *in, *bytes; } sizes[] = {
    { "0", "0" }, { "4096", "4096" }, { "1k", "1024" }, { "4K", "4096" },
    { "4M", "4194304" }, { "2m", "2097152" }, { "1G", "1073741824" },
    { "007", "7" }, { "18446744073709551615", "18446744073709551615" },
    { "17179869183G", "18446744072635809792" },
  };
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    char line[64];

    snprintf (line, sizeof line, "set sequential_cutoff %s\n", sizes[i].in);
    expect_reply (line, "ok\n");
    ck_assert_str_eq (seen.name, "sequential_cutoff");
    ck_assert_str_eq (seen.value, sizes[i].bytes);
  }
  ck_assert_int_eq (seen.set, 2 + (int) (sizeof sizes / sizeof sizes[0]));

  expect_reply ("trigger_gc\n", "ok\n");
  expect_reply ("trigger-gc\n", "ok\n");
  ck_assert_int_eq (seen.gc, 2);
  expect_prefix ("help\n", "ok\nstats [--json]");

  /* Separators and line ends. */
  expect_reply ("  stats \t --json   \n", "ok\n{\"cache_hits\":1}\n");
  expect_reply ("stats\r\n", "ok\ncache_hits 1\n");
  /* Only the first line counts. */
  expect_reply ("trigger_gc\nset cache_mode none\n", "ok\n");
  ck_assert_str_eq (seen.value, "18446744072635809792");
}
END_TEST

/* stats --prometheus and clear_stats reach their ops; their usage, and
 * a filter without them; and through the tool. */
START_TEST (test_stats_commands)
{
  static const struct bcf_ctl_ops more = {
    .stats = op_stats, .prometheus = op_prometheus, .clear_stats = op_clear,
  };
  static const char prom[] =
    "# HELP bcachefilter_x X.\n# TYPE bcachefilter_x gauge\nbcachefilter_x 1\n";
  char err[256], expect[256];
  struct run r;

  ck_assert_int_eq (bcf_ctl_start (sock, &more, err, sizeof err), 0);
  snprintf (expect, sizeof expect, "ok\n%s", prom);
  expect_reply ("stats --prometheus\n", expect);
  ck_assert_int_eq (seen.prometheus, 1);
  ck_assert (!seen.json);
  ck_assert_int_eq (seen.stats, 0);
  expect_reply ("clear_stats\n", "ok\n");
  ck_assert_int_eq (seen.clear, 1);
  expect_reply ("clear_stats\n", "ok\n");
  ck_assert_int_eq (seen.clear, 2);
  expect_prefix ("clear_stats now\n", "error: usage: clear_stats (no "
                 "arguments)");
  expect_prefix ("stats --prometheus --json\n",
                 "error: usage: stats [--json], or stats --prometheus");
  expect_prefix ("stats --Prometheus\n", "error: usage: stats");
  expect_prefix ("frobnicate\n", "error: unknown command 'frobnicate'; "
                 "valid commands: stats [--json], set NAME VALUE, trigger_gc, "
                 "writeback_flush, detach, detach_status, show super [--json], "
                 "stats --prometheus, clear_stats, help");
  ck_assert_int_eq (seen.clear, 2);
  ck_assert_int_eq (seen.prometheus, 1);
  set_fail (true);
  expect_reply ("clear_stats\n", "error: cannot clear\n");
  set_fail (false);

  r = run_ctl (sock, "stats", "--prometheus", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, prom);
  free_run (&r);
  r = run_ctl (sock, "clear_stats", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "");
  ck_assert_int_eq (seen.clear, 4);
  free_run (&r);
  r = run_ctl (sock, "clear_stats", "now", NULL);
  ck_assert_int_eq (r.status, 2);
  ck_assert_int_eq (seen.clear, 4);
  free_run (&r);
  r = run_ctl (sock, "stats", "--prometheus", "--json", NULL);
  ck_assert_int_eq (r.status, 2);
  ck_assert_int_eq (seen.prometheus, 2);
  free_run (&r);
  bcf_ctl_stop ();

  /* Not there: said so. */
  start ();
  expect_prefix ("stats --prometheus\n",
                 "error: stats --prometheus is not supported");
  expect_prefix ("clear_stats\n", "error: clear_stats is not supported");
}
END_TEST

START_TEST (test_bad_commands)
{
  int set_before;

  start ();
  set_before = seen.set;

  expect_prefix ("\n", "error: empty command; valid commands: stats");
  expect_prefix ("   \t \n", "error: empty command");
  expect_prefix ("frobnicate\n", "error: unknown command 'frobnicate'; "
                 "valid commands: stats [--json], set NAME VALUE");
  expect_prefix ("STATS\n", "error: unknown command 'STATS'");
  expect_prefix ("stats --xml\n", "error: usage: stats [--json]");
  expect_prefix ("stats --json extra\n", "error: usage: stats [--json]");
  expect_prefix ("show\n", "error: usage: show super [--json]");
  expect_prefix ("show journal\n", "error: usage: show super [--json]");
  expect_prefix ("show super --json x\n", "error: usage: show super");
  expect_prefix ("trigger_gc now\n", "error: usage: trigger_gc");
  expect_prefix ("help me\n", "error: usage: help");
  expect_prefix ("set\n", "error: usage: set cache_mode MODE");
  expect_prefix ("set cache_mode\n", "error: usage: set cache_mode MODE");
  expect_prefix ("set cache_mode a b\n", "error: usage: set");
  expect_prefix ("set readahead 1\n", "error: unknown setting 'readahead': "
                 "valid settings are cache_mode, sequential_cutoff, "
                 "sequential_bypass, congested_read_threshold_us, "
                 "congested_write_threshold_us, writeback_percent");
  static const char *const bad_sizes[] = {
    "", "-1", "+1", "1.5M", "1T", "1KB", "1Ki", "M", "0x10", "1 k",
    "18446744073709551616", "17179869184G", "99999999999999999999999",
  };
  for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
    char line[64];

    snprintf (line, sizeof line, "set sequential_cutoff %s\n", bad_sizes[i]);
    expect_prefix (line, bad_sizes[i][0] == '\0' || strchr (bad_sizes[i], ' ')
                   ? "error: usage: set" : "error: invalid sequential_cutoff");
  }
  expect_prefix ("a b c d e f g h i\n", "error: too many words");
  ck_assert_int_eq (seen.set, set_before);       /* never reached the ops */
  ck_assert_int_eq (seen.stats, 0);
}
END_TEST

START_TEST (test_ops_errors)
{
  static const struct bcf_ctl_ops none = { 0 };
  char err[256];

  start ();
  set_fail (true);
  /* The partial output is dropped, the message flattened to one line. */
  expect_reply ("stats\n", "error: disk on fire second line\n");
  expect_reply ("set cache_mode writethrough\n",
                "error: cannot set cache_mode\n");
  expect_reply ("trigger_gc\n", "error: gc failed\n");
  set_fail (false);
  bcf_ctl_stop ();

  ck_assert_int_eq (bcf_ctl_start (sock, &none, err, sizeof err), 0);
  expect_prefix ("stats\n", "error: stats is not supported");
  expect_prefix ("show super\n", "error: show super is not supported");
  expect_prefix ("set cache_mode none\n", "error: set is not supported");
  expect_prefix ("trigger_gc\n", "error: trigger_gc is not supported");
  ck_assert_int_eq (bcf_ctl_start (sock, NULL, err, sizeof err), -1);
}
END_TEST

/* ---- Untrusted input ------------------------------------------------------ */

START_TEST (test_malformed)
{
  unsigned char garbage[512];
  char *big, *r;
  uint64_t x = 0x9e3779b97f4a7c15ull;

  start ();

  /* Binary garbage, with NULs, ending in a newline. */
  for (size_t i = 0; i < sizeof garbage; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    garbage[i] = (unsigned char) x;
  }
  garbage[0] = 's';             /* not a newline first */
  garbage[5] = 0;
  garbage[sizeof garbage - 1] = '\n';
  r = talk (garbage, sizeof garbage, false);
  ck_assert_msg (strncmp (r, "error: invalid byte 0x", 22) == 0, "%s", r);
  free (r);

  r = talk ("stats\0--json\n", 13, false);
  ck_assert_msg (strncmp (r, "error: invalid byte 0x00 at offset 5", 36) == 0,
                 "%s", r);
  free (r);
  expect_prefix ("stats\x1b[2J\n", "error: invalid byte 0x1b");
  expect_prefix ("st\xc3\xa4ts\n", "error: invalid byte 0xc3 at offset 2");
  expect_prefix ("stats\r\r\n", "error: invalid byte 0x0d");

  /* The longest line accepted: 4095 bytes and the newline.  The word is
   * quoted back shortened. */
  big = malloc (8192);
  ck_assert_ptr_nonnull (big);
  memset (big, 'a', 8192);
  big[4095] = '\n';
  r = talk (big, 4096, false);
  ck_assert_msg (strncmp (r, "error: unknown command 'aaa", 27) == 0, "%s", r);
  ck_assert_ptr_nonnull (strstr (r, "...'"));
  ck_assert_uint_lt (strlen (r), 400);
  free (r);
  /* One byte more is too long, with or without a newline, and whatever
   * follows is not read. */
  big[4095] = 'a';
  big[4096] = '\n';
  r = talk (big, 4097, false);
  ck_assert_msg (strncmp (r, "error: command too long", 23) == 0, "%s", r);
  free (r);
  r = talk (big, 8192, false);
  ck_assert_msg (strncmp (r, "error: command too long", 23) == 0, "%s", r);
  free (r);
  free (big);

  /* A command ended by shutting down the writing side. */
  r = talk ("stats --json", 12, true);
  ck_assert_str_eq (r, "ok\n{\"cache_hits\":1}\n");
  free (r);

  /* A client that sends nothing gets nothing, and hurts no one. */
  r = talk ("", 0, true);
  ck_assert_str_eq (r, "");
  free (r);
  close (connect_to (sock));
  expect_reply ("stats\n", "ok\ncache_hits 1\n");

  /* A client that never reads its answer. */
  {
    int fd = connect_to (sock);

    write_all (fd, "help\n", 5);
    shutdown (fd, SHUT_RD);
    expect_prefix ("help\n", "ok\n");
    close (fd);
  }
}
END_TEST

static uint64_t
ms_now (void)
{
  struct timespec ts;

  clock_gettime (CLOCK_MONOTONIC, &ts);
  return (uint64_t) ts.tv_sec * 1000 + (uint64_t) ts.tv_nsec / 1000000;
}

START_TEST (test_timeout)
{
  uint64_t t0, dt;
  int fd;
  char *r;

  start ();

  /* No newline, no EOF: the server gives up after 5 s. */
  fd = connect_to (sock);
  write_all (fd, "stats", 5);
  t0 = ms_now ();
  r = read_all (fd, 20000);
  dt = ms_now () - t0;
  close (fd);
  ck_assert_msg (strncmp (r, "error: timed out", 16) == 0, "%s", r);
  ck_assert_msg (dt >= 4500 && dt < 10000, "timed out after %" PRIu64 " ms",
                 dt);
  free (r);
  look ();
  ck_assert_int_eq (seen.stats, 0);

  /* Dripping a byte every 0.7 s does not extend the deadline. */
  fd = connect_to (sock);
  t0 = ms_now ();
  for (int i = 0; i < 20; i++) {
    struct pollfd pfd = { .fd = fd, .events = POLLIN };

    if (poll (&pfd, 1, 700) == 1)
      break;                    /* the answer */
    write_all (fd, "s", 1);
  }
  r = read_all (fd, 20000);
  dt = ms_now () - t0;
  close (fd);
  ck_assert_msg (strncmp (r, "error: timed out", 16) == 0, "%s", r);
  ck_assert_msg (dt >= 4500 && dt < 10000, "%" PRIu64 " ms", dt);
  free (r);

  /* The server still works. */
  expect_reply ("stats\n", "ok\ncache_hits 1\n");
}
END_TEST

/* Stop is prompt even while a silent client holds the thread. */
START_TEST (test_stop_prompt)
{
  uint64_t t0;
  int fd;

  start ();
  fd = connect_to (sock);
  write_all (fd, "sta", 3);
  usleep (100000);
  t0 = ms_now ();
  bcf_ctl_stop ();
  ck_assert_uint_lt (ms_now () - t0, 1000);
  ck_assert_int_eq (access (sock, F_OK), -1);
  close (fd);
}
END_TEST

#define CLIENTS 24
#define ROUNDS  20

static void *
client (void *arg)
{
  for (int i = 0; i < ROUNDS; i++) {
    const char *line = i % 2 ? "stats\n" : "set sequential_cutoff 1k\n";
    int fd = connect_to (sock);
    char *r;

    write_all (fd, line, strlen (line));
    r = read_all (fd, 30000);
    close (fd);
    if (strcmp (r, i % 2 ? "ok\ncache_hits 1\n" : "ok\n") != 0) {
      fprintf (stderr, "client: unexpected answer [%s]\n", r);
      free (r);
      return (void *) 1;
    }
    free (r);
  }
  return NULL;
}

START_TEST (test_many_clients)
{
  pthread_t t[CLIENTS];

  start ();
  for (int i = 0; i < CLIENTS; i++)
    ck_assert_int_eq (pthread_create (&t[i], NULL, client, NULL), 0);
  for (int i = 0; i < CLIENTS; i++) {
    void *ret;

    pthread_join (t[i], &ret);
    ck_assert_ptr_null (ret);
  }
  look ();
  ck_assert_int_eq (seen.stats, CLIENTS * ROUNDS / 2);
  ck_assert_int_eq (seen.set, CLIENTS * ROUNDS / 2);
  ck_assert_str_eq (seen.value, "1024");
}
END_TEST

/* ---- Many clients at once: none waits behind another ---------------------- */

/* The documented bounds (ctl.c, bcachefilter-ctl(1)). */
#define SLOTS     64            /* connections served at once */
#define QUEUE_MS  500           /* the wait for a slot before "busy" */
#define PROMPT_MS 1000          /* "promptly": a correctness bound */

/* Open n connections that send nothing (yet).  Returns the time just
 * before the last connect (the server cannot have accepted it sooner). */
static uint64_t
open_idle (int *fd, int n)
{
  uint64_t last = 0;

  for (int i = 0; i < n; i++) {
    last = ms_now ();
    fd[i] = connect_to (sock);
  }
  usleep (100000);              /* let the server accept them */
  return last;
}

static void
close_all (int *fd, int n)
{
  for (int i = 0; i < n; i++)
    close (fd[i]);
}

/* cmd(line), answered within PROMPT_MS (else the test fails). */
static void
expect_prompt (const char *line, const char *want)
{
  uint64_t t0 = ms_now ();
  int fd = connect_to (sock);
  char *r;

  write_all (fd, line, strlen (line));
  r = read_all (fd, PROMPT_MS);
  close (fd);
  ck_assert_msg (ms_now () - t0 < PROMPT_MS, "%s answered after %" PRIu64
                 " ms", line, ms_now () - t0);
  ck_assert_msg (strcmp (r, want) == 0, "%s -> [%s], want [%s]", line, r,
                 want);
  free (r);
}

/* Three idle connections held open: stats is answered at once, through
 * the socket and through bcachefilter-ctl.  (One connection at a time,
 * this waited 3 x 5 s.) */
START_TEST (test_idle_clients)
{
  int idle[3];
  uint64_t t0;
  struct run r;

  start ();
  open_idle (idle, 3);
  expect_prompt ("stats\n", "ok\ncache_hits 1\n");
  t0 = ms_now ();
  r = run_ctl (sock, "stats", NULL);
  ck_assert_msg (ms_now () - t0 < PROMPT_MS, "bcachefilter-ctl stats took %"
                 PRIu64 " ms", ms_now () - t0);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "cache_hits 1\n");
  free_run (&r);
  close_all (idle, 3);
}
END_TEST

/* A client that sends half a line and stalls holds only its own slot:
 * others are answered meanwhile, and it is answered when it finishes
 * its line. */
START_TEST (test_half_line)
{
  int fd;
  char *r;

  start ();
  fd = connect_to (sock);
  write_all (fd, "sta", 3);
  usleep (100000);
  for (int i = 0; i < 5; i++)
    expect_prompt ("stats --json\n", "ok\n{\"cache_hits\":1}\n");
  write_all (fd, "ts\n", 3);
  r = read_all (fd, PROMPT_MS);
  ck_assert_str_eq (r, "ok\ncache_hits 1\n");
  free (r);
  close (fd);
  look ();
  ck_assert_int_eq (seen.stats, 6);
}
END_TEST

/* BURST simultaneous connects: non-blocking, all in a row before any
 * line is sent (the harshest case for the listen queue; with a backlog
 * of 16 most got EAGAIN), then the lines, then the answers.  None may be
 * refused at connect; every one is answered, with the output or (the
 * documented bound) "error: busy". */
#define BURST 300

START_TEST (test_burst)
{
  struct sockaddr_un sun = { .sun_family = AF_UNIX };
  static int fd[BURST];
  static char buf[BURST][256];
  static size_t len[BURST];
  int open_left = BURST, ok = 0, busy = 0;
  uint64_t deadline;

  start ();
  strcpy (sun.sun_path, sock);
  for (int i = 0; i < BURST; i++) {
    fd[i] = socket (AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    ck_assert_int_ge (fd[i], 0);
    ck_assert_msg (connect (fd[i], (struct sockaddr *) &sun, sizeof sun) == 0,
                   "connect %d of %d: %s", i + 1, BURST, strerror (errno));
  }
  /* A connection refused as busy may be closed already (EPIPE): its
   * answer is what counts. */
  for (int i = 0; i < BURST; i++) {
    ssize_t n = send (fd[i], "stats\n", 6, MSG_NOSIGNAL);

    len[i] = 0;
    ck_assert_msg (n == 6 || (n == -1 && (errno == EPIPE ||
                                           errno == ECONNRESET)),
                   "send %d: %s", i, strerror (errno));
  }

  /* Collect the answers (each ends with the server closing). */
  deadline = ms_now () + 30000;
  while (open_left > 0) {
    struct pollfd pfd[BURST];
    int map[BURST], n = 0;

    for (int i = 0; i < BURST; i++)
      if (fd[i] >= 0) {
        pfd[n] = (struct pollfd) { .fd = fd[i], .events = POLLIN };
        map[n++] = i;
      }
    ck_assert_msg (ms_now () < deadline, "%d of %d connections unanswered "
                   "after 30 s", open_left, BURST);
    ck_assert_int_ge (poll (pfd, (nfds_t) n, 1000), 0);
    for (int j = 0; j < n; j++) {
      int i = map[j];
      ssize_t got;

      if (!pfd[j].revents)
        continue;
      got = recv (fd[i], buf[i] + len[i], sizeof buf[i] - 1 - len[i], 0);
      if (got > 0) {
        len[i] += (size_t) got;
        ck_assert_uint_lt (len[i], sizeof buf[i] - 1);
        continue;
      }
      ck_assert_msg (got == 0 || (errno == ECONNRESET && len[i] > 0),
                     "connection %d: recv: %s", i, strerror (errno));
      buf[i][len[i]] = '\0';
      if (strcmp (buf[i], "ok\ncache_hits 1\n") == 0)
        ok++;
      else if (strncmp (buf[i], "error: busy: ", 13) == 0)
        busy++;
      else
        ck_abort_msg ("connection %d: unexpected answer [%s]", i, buf[i]);
      close (fd[i]);
      fd[i] = -1;
      open_left--;
    }
  }
  printf ("test_burst: %d connects, %d answered ok, %d busy\n", BURST, ok,
          busy);
  ck_assert_int_eq (ok + busy, BURST);
  look ();
  ck_assert_int_eq (seen.stats, ok);
  /* And the server is still well. */
  expect_prompt ("stats\n", "ok\ncache_hits 1\n");
}
END_TEST

/* The bound: with every slot held by an idle client, a new connection
 * waits QUEUE_MS for a slot, then is told "busy" in one line; once a
 * slot frees, clients are served again; stop is prompt with all the
 * slots taken. */
START_TEST (test_slots_full)
{
  static int idle[SLOTS];
  uint64_t full, t0, t1;
  char *r;
  int fd;

  start ();
  /* "busy" comes QUEUE_MS after the last slot was taken, not sooner. */
  full = open_idle (idle, SLOTS);
  t0 = ms_now ();
  fd = connect_to (sock);
  write_all (fd, "stats\n", 6);
  r = read_all (fd, 5000);
  t1 = ms_now ();
  close (fd);
  ck_assert_msg (strncmp (r, "error: busy: 64 control connections", 35) == 0,
                 "[%s]", r);
  ck_assert_msg (strchr (r, '\n') == r + strlen (r) - 1, "not one line: [%s]",
                 r);
  ck_assert_msg (t1 >= full + QUEUE_MS && t1 - t0 < QUEUE_MS + PROMPT_MS,
                 "busy after %" PRIu64 " ms, %" PRIu64 " ms after the slots "
                 "were full", t1 - t0, t1 - full);
  free (r);
  look ();
  ck_assert_int_eq (seen.stats, 0);

  /* One idle client leaves: the next client gets its slot. */
  close (idle[0]);
  expect_prompt ("stats\n", "ok\ncache_hits 1\n");

  /* A client that came while all were taken is served when a slot
   * frees within QUEUE_MS. */
  idle[0] = connect_to (sock);
  usleep (100000);
  fd = connect_to (sock);
  write_all (fd, "stats\n", 6);
  usleep (100000);
  close (idle[1]);
  r = read_all (fd, PROMPT_MS);
  ck_assert_str_eq (r, "ok\ncache_hits 1\n");
  free (r);
  close (fd);
  idle[1] = connect_to (sock);

  t0 = ms_now ();
  bcf_ctl_stop ();
  ck_assert_uint_lt (ms_now () - t0, PROMPT_MS);
  ck_assert_int_eq (access (sock, F_OK), -1);
  close_all (idle, SLOTS);
}
END_TEST

/* ---- bcachefilter-ctl ----------------------------------------------------- */

START_TEST (test_cli)
{
  struct run r;

  start ();

  r = run_ctl (NULL, "-s", sock, "stats", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "cache_hits 1\n");
  ck_assert_str_eq (r.err, "");
  free_run (&r);

  r = run_ctl (sock, "stats", "--json", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "{\"cache_hits\":1}\n");
  free_run (&r);

  r = run_ctl ("/nonexistent", "--socket", sock, "set", "cache_mode",
               "writearound", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "");
  ck_assert_str_eq (seen.value, "writearound");
  free_run (&r);

  r = run_ctl (sock, "set", "sequential_cutoff", "8M", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (seen.name, "sequential_cutoff");
  ck_assert_str_eq (seen.value, "8388608");
  free_run (&r);

  r = run_ctl (NULL, "--socket=x", "-s", sock, "trigger-gc", NULL);
  ck_assert_int_eq (r.status, 0);
  free_run (&r);
  r = run_ctl (sock, "trigger_gc", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_int_eq (seen.gc, 2);
  free_run (&r);

  r = run_ctl (sock, "show", "super", "--json", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "{\"sb\":{}}\n");
  free_run (&r);
  r = run_ctl (sock, "help", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_ptr_nonnull (strstr (r.out, "trigger_gc"));
  free_run (&r);

  /* The filter's errors: exit 1, the message on stderr. */
  r = run_ctl (sock, "set", "sequential_cutoff", "lots", NULL);
  ck_assert_int_eq (r.status, 1);
  ck_assert_str_eq (r.out, "");
  ck_assert_msg (strncmp (r.err, "bcachefilter-ctl: invalid "
                          "sequential_cutoff 'lots'", 43) == 0, "%s", r.err);
  free_run (&r);
  set_fail (true);
  r = run_ctl (sock, "set", "cache_mode", "fast", NULL);
  ck_assert_int_eq (r.status, 1);
  ck_assert_str_eq (r.err, "bcachefilter-ctl: cannot set cache_mode\n");
  set_fail (false);
  ck_assert_int_eq (r.status, 1);
  free_run (&r);
  set_fail (true);
  r = run_ctl (sock, "stats", NULL);
  ck_assert_int_eq (r.status, 1);
  ck_assert_str_eq (r.out, "");
  ck_assert_str_eq (r.err, "bcachefilter-ctl: disk on fire second line\n");
  free_run (&r);
  set_fail (false);

  /* Usage errors: exit 2, nothing sent. */
  {
    int before = seen.stats + seen.set + seen.gc + seen.super;

    r = run_ctl (sock, NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "frob", NULL);
    ck_assert_int_eq (r.status, 2);
    ck_assert_ptr_nonnull (strstr (r.err, "unknown command 'frob'"));
    free_run (&r);
    r = run_ctl (sock, "stats", "--xml", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "set", "cache_mode", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "set", "color", "red", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "set", "cache_mode", "write back", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "show", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "trigger-gc", "now", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (sock, "--bogus", "stats", NULL);
    ck_assert_int_eq (r.status, 2);
    free_run (&r);
    r = run_ctl (NULL, "stats", NULL);      /* no socket given */
    ck_assert_int_eq (r.status, 2);
    ck_assert_ptr_nonnull (strstr (r.err, "BCACHEFILTER_CTL"));
    free_run (&r);
    ck_assert_int_eq (seen.stats + seen.set + seen.gc + seen.super, before);
  }

  /* Cannot connect: exit 3, with a hint. */
  {
    char stale[160];

    r = run_ctl (NULL, "-s", "/nonexistent/ctl.sock", "stats", NULL);
    ck_assert_int_eq (r.status, 3);
    ck_assert_msg (strstr (r.err, "bcache-ctl=/nonexistent/ctl.sock") != NULL,
                   "%s", r.err);
    free_run (&r);
    snprintf (stale, sizeof stale, "%s/stale.sock", dir);
    make_stale (stale);
    r = run_ctl (stale, "stats", NULL);
    ck_assert_int_eq (r.status, 3);
    ck_assert_ptr_nonnull (strstr (r.err, "Connection refused"));
    free_run (&r);
  }

  r = run_ctl (NULL, "--help", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_ptr_nonnull (strstr (r.out, "Usage: bcachefilter-ctl"));
  free_run (&r);
  r = run_ctl (NULL, "-V", NULL);
  ck_assert_int_eq (r.status, 0);
  ck_assert_str_eq (r.out, "bcachefilter-ctl " PACKAGE_VERSION "\n");
  free_run (&r);
}
END_TEST

static Suite *
ctl_suite (void)
{
  Suite *s = suite_create ("ctl");
  TCase *tc = tcase_create ("ctl");

  tcase_set_timeout (tc, 600);
  tcase_add_checked_fixture (tc, setup, teardown);
  tcase_add_test (tc, test_start_stop);
  tcase_add_test (tc, test_stale_replaced);
  tcase_add_test (tc, test_live_refused);
  tcase_add_test (tc, test_non_socket_refused);
  tcase_add_test (tc, test_check_path);
  tcase_add_test (tc, test_commands);
  tcase_add_test (tc, test_stats_commands);
  tcase_add_test (tc, test_bad_commands);
  tcase_add_test (tc, test_ops_errors);
  tcase_add_test (tc, test_malformed);
  tcase_add_test (tc, test_timeout);
  tcase_add_test (tc, test_stop_prompt);
  tcase_add_test (tc, test_many_clients);
  tcase_add_test (tc, test_idle_clients);
  tcase_add_test (tc, test_half_line);
  tcase_add_test (tc, test_burst);
  tcase_add_test (tc, test_slots_full);
  tcase_add_test (tc, test_cli);
  suite_add_tcase (s, tc);
  return s;
}

int
main (void)
{
  return test_main (ctl_suite ());
}
