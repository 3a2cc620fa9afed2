/* bcachefilter engine: one writer per cache device
 * (include/bcachefilter/claim.h says what and why).
 *
 * Design
 * ------
 * A claim is one descriptor, opened read-write and locked: flock
 * (LOCK_EX | LOCK_NB) for every device, and O_EXCL at open for block
 * devices.  It is taken before anything reads or writes the device and
 * is the only thing that holds the lock: the engine's I/O descriptors
 * are opened separately (O_DIRECT, no O_EXCL, which would conflict with
 * the claim's own exclusive open) and checked to be the same inode
 * (bcf_claim_covers_fd).
 *
 * Creating a cache file is part of claiming it, so that two proxies
 * started at once on a missing file cannot both format it: the file is
 * created, then locked, and only the lock holder gives it its size.  An
 * existing empty file is sized by whoever claims it (its creator may have
 * died between creating and sizing it).
 *
 * Naming the holder: a refused flock does not say who holds the lock, so
 * /proc is searched for a descriptor of the same inode whose fdinfo has a
 * "lock: ... FLOCK ... WRITE" line (the holder may be several processes
 * for a moment: nbdkit's parent and child share the descriptor until the
 * parent exits).  Only processes we may read are seen (same user, or
 * root); otherwise the message says the holder could not be named.
 *
 * Locking: none (a claim is used by one thread at a time).
 */
#include "config.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "bcachefilter/claim.h"

struct bcf_claim {
  int fd;
  char *path;
  struct stat st;
};

/* ---- naming the holder ------------------------------------------------------ */

/* Does /proc/pid/fdinfo/fd list a write flock? */
static bool
fd_has_write_flock (const char *pid, const char *fd)
{
  char path[600], line[256];
  bool found = false;
  FILE *f;

  snprintf (path, sizeof path, "/proc/%s/fdinfo/%s", pid, fd);
  if (!(f = fopen (path, "re")))
    return false;
  while (!found && fgets (line, sizeof line, f))
    found = strncmp (line, "lock:", 5) == 0 && strstr (line, "FLOCK") &&
            strstr (line, "WRITE");
  fclose (f);
  return found;
}

static void
read_comm (const char *pid, char *comm, size_t len)
{
  char path[320];
  FILE *f;

  snprintf (path, sizeof path, "/proc/%s/comm", pid);
  comm[0] = '\0';
  if ((f = fopen (path, "re"))) {
    if (fgets (comm, (int) len, f))
      comm[strcspn (comm, "\n")] = '\0';
    fclose (f);
  }
}

/* Does the open file st describe the device of the claim-like stat
 * want?  Same inode for files; the same device for block devices (any
 * node of it). */
static bool
same_device (const struct stat *want, const struct stat *st)
{
  if (S_ISBLK (want->st_mode))
    return S_ISBLK (st->st_mode) && st->st_rdev == want->st_rdev;
  return st->st_dev == want->st_dev && st->st_ino == want->st_ino;
}

/* Search /proc for another process holding the device.  With
 * need_flock, only descriptors carrying a write flock count (the holder
 * of a refused flock); without, any descriptor (the O_EXCL holder of a
 * block device, which fdinfo does not show).  Writes "pid N (comm)" and
 * the name it opened the device by into out; false if none was seen. */
static bool
find_holder (const struct stat *want, bool need_flock, char *out,
             size_t outlen)
{
  char self[32];
  DIR *proc;
  struct dirent *p;
  bool found = false;

  snprintf (self, sizeof self, "%d", (int) getpid ());
  if (!(proc = opendir ("/proc")))
    return false;
  while (!found && (p = readdir (proc))) {
    char fddir[320];
    DIR *fds;
    struct dirent *f;

    if (p->d_name[0] < '0' || p->d_name[0] > '9' ||
        strcmp (p->d_name, self) == 0)
      continue;
    snprintf (fddir, sizeof fddir, "/proc/%s/fd", p->d_name);
    if (!(fds = opendir (fddir)))
      continue;
    while (!found && (f = readdir (fds))) {
      struct stat st;
      char link[640], target[512] = "", comm[64];
      ssize_t n;

      if (f->d_name[0] == '.' ||
          fstatat (dirfd (fds), f->d_name, &st, 0) == -1 ||
          !same_device (want, &st) ||
          (need_flock && !fd_has_write_flock (p->d_name, f->d_name)))
        continue;
      snprintf (link, sizeof link, "%s/%s", fddir, f->d_name);
      n = readlink (link, target, sizeof target - 1);
      target[n > 0 ? n : 0] = '\0';
      read_comm (p->d_name, comm, sizeof comm);
      snprintf (out, outlen, "pid %s (%s)%s%s", p->d_name,
                comm[0] ? comm : "?", target[0] ? ", which opened it as " : "",
                target);
      found = true;
    }
    closedir (fds);
  }
  closedir (proc);
  return found;
}

/* The message of a refused claim. */
static void
in_use_message (const char *path, const struct stat *st, bool excl_refused,
                char *err, size_t errlen)
{
  char holder[640];

  if (find_holder (st, !excl_refused, holder, sizeof holder))
    snprintf (err, errlen, "%s is in use by another process: %s.  A cache "
              "has one writer at a time; stop that one first, or give this "
              "one a cache of its own", path, holder);
  else if (excl_refused)
    snprintf (err, errlen, "%s is in use: it is mounted, held by the "
              "kernel (its bcache, md or LVM) or opened exclusively by "
              "another program; a cache has one writer at a time", path);
  else
    snprintf (err, errlen, "%s is in use by another process (its pid "
              "could not be read: run as the same user or as root to see "
              "it, or look in /proc/locks); a cache has one writer at a "
              "time", path);
}

/* ---- creating a cache file ---------------------------------------------------- */

/* fsync the directory holding path, so a new entry survives a crash. */
static int
sync_parent_dir (const char *path)
{
  char *dir = strdup (path), *slash;
  int fd, r;

  if (!dir)
    return -1;
  slash = strrchr (dir, '/');
  if (!slash)
    strcpy (dir, ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  fd = open (dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  free (dir);
  if (fd == -1)
    return -1;
  r = fsync (fd);
  close (fd);
  return r;
}

/* Give the claimed, empty file fd its size: allocated, not sparse (a
 * cache is written everywhere anyway, and a full filesystem should show
 * now), then made durable with its directory entry. */
static int
size_file (int fd, const char *path, uint64_t size, char *err, size_t errlen)
{
  int r;

  if (fallocate (fd, 0, 0, (off_t) size) == -1 &&
      ((errno != EOPNOTSUPP && errno != ENOSYS) ||
       ftruncate (fd, (off_t) size) == -1)) {
    r = -errno;
    snprintf (err, errlen, "cannot allocate %" PRIu64 " bytes for %s: %s",
              size, path, strerror (errno));
    return r;
  }
  if (fsync (fd) == -1 || sync_parent_dir (path) == -1) {
    r = -errno;
    snprintf (err, errlen, "cannot sync new file %s: %s", path,
              strerror (errno));
    return r;
  }
  return 0;
}

/* ---- API -------------------------------------------------------------------- */

int
bcf_claim_open (const char *path, uint64_t create_size, struct bcf_claim **cp,
                char *err, size_t errlen)
{
  struct bcf_claim *cl;
  struct stat st;
  bool created = false;
  int fd, r;

  *cp = NULL;
  if (stat (path, &st) == -1) {
    if (errno != ENOENT || create_size == 0) {
      r = -errno;
      snprintf (err, errlen, "cannot open %s: %s", path, strerror (errno));
      return r;
    }
    fd = open (path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    created = fd >= 0;
    if (fd == -1 && errno == EEXIST)    /* created by someone else just now */
      fd = open (path, O_RDWR | O_CLOEXEC);
    if (fd == -1) {
      r = -errno;
      snprintf (err, errlen, "cannot create %s: %s", path, strerror (errno));
      return r;
    }
  }
  else {
    fd = open (path, O_RDWR | O_CLOEXEC | (S_ISBLK (st.st_mode) ? O_EXCL : 0));
    if (fd == -1) {
      r = -errno;
      if (errno == EBUSY && S_ISBLK (st.st_mode))
        in_use_message (path, &st, true, err, errlen);
      else
        snprintf (err, errlen, "cannot open %s for reading and writing: %s",
                  path, strerror (errno));
      return r;
    }
  }
  if (fstat (fd, &st) == -1) {
    r = -errno;
    snprintf (err, errlen, "cannot stat %s: %s", path, strerror (errno));
    close (fd);
    return r;
  }
  if (!S_ISREG (st.st_mode) && !S_ISBLK (st.st_mode)) {
    snprintf (err, errlen, "%s: not a regular file or block device", path);
    close (fd);
    return -EINVAL;
  }
  if (flock (fd, LOCK_EX | LOCK_NB) == -1) {
    r = errno == EWOULDBLOCK ? -EBUSY : -errno;
    if (r == -EBUSY)
      in_use_message (path, &st, false, err, errlen);
    else
      snprintf (err, errlen, "cannot lock %s: %s", path, strerror (errno));
    close (fd);
    return r;
  }
  if (S_ISREG (st.st_mode) && st.st_size == 0 && create_size &&
      (r = size_file (fd, path, create_size, err, errlen)) < 0) {
    if (created)
      unlink (path);
    close (fd);
    return r;
  }
  cl = calloc (1, sizeof *cl);
  if (!cl || !(cl->path = strdup (path))) {
    free (cl);
    close (fd);
    snprintf (err, errlen, "out of memory");
    return -ENOMEM;
  }
  cl->fd = fd;
  cl->st = st;
  *cp = cl;
  return 0;
}

void
bcf_claim_release (struct bcf_claim *cl)
{
  if (!cl)
    return;
  close (cl->fd);               /* releases the flock and the O_EXCL hold */
  free (cl->path);
  free (cl);
}

const char *
bcf_claim_path (const struct bcf_claim *cl)
{
  return cl->path;
}

bool
bcf_claim_covers_fd (const struct bcf_claim *cl, int fd)
{
  struct stat st;

  return fstat (fd, &st) == 0 && same_device (&cl->st, &st);
}

int
bcf_claim_probe (const char *path, char *holder, size_t holderlen)
{
  struct stat st;
  int fd, r = 0;

  holder[0] = '\0';
  if (stat (path, &st) == -1 ||
      (fd = open (path, O_RDONLY | O_CLOEXEC)) == -1) {
    r = -errno;
    snprintf (holder, holderlen, "%s: %s", path, strerror (errno));
    return r;
  }
  /* A shared lock is refused only while a writer holds its exclusive
   * one; we let go of it at once, so a writer starting now is not
   * refused because of us. */
  if (flock (fd, LOCK_SH | LOCK_NB) == -1) {
    if (errno == EWOULDBLOCK) {
      r = 1;
      if (!find_holder (&st, true, holder, holderlen))
        snprintf (holder, holderlen, "another process");
    }
  }
  else
    flock (fd, LOCK_UN);
  close (fd);
  /* A block device held with O_EXCL by the kernel or another program.
   * (This open claims the device for an instant itself: a writer
   * starting in that instant is refused and may simply be started
   * again.) */
  if (r == 0 && S_ISBLK (st.st_mode)) {
    fd = open (path, O_RDONLY | O_EXCL | O_CLOEXEC);
    if (fd == -1 && errno == EBUSY) {
      r = 1;
      if (!find_holder (&st, false, holder, holderlen))
        snprintf (holder, holderlen, "the kernel (mounted, bcache, md or "
                  "LVM) or another program");
    }
    else if (fd >= 0)
      close (fd);
  }
  return r;
}
