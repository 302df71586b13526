/* tms_start.c - starting this user's subletd for a GPU, for a process whose first region
 * allocation finds none running (slime's trainer allocates under TMS_INIT_ENABLE=1 before any
 * sublet call). It does what sublet's Python package does (sublet/_daemon.py: _user_daemon and
 * _start), so that either finds the other's daemon: in the user's directory, made 0700, the
 * socket GPU-<uuid>.sock, its .pid, .log and .lock; started under the lock, detached (sh runs
 * it in the background, so it is init's child), with --idle-exit $SUBLET_IDLE_EXIT (600 s).
 * The binary: $SUBLETD, else the one beside this library (an installed sublet's
 * sublet/_native/subletd, a build's subletd).
 */
#include "tms.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

#define TMS_POLL_NS 10000000L

static int own_dir(const char *dir) {
  struct stat st;

  if (mkdir(dir, 0700) != 0 && errno != EEXIST)
    goto bad;
  if (lstat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != getuid() ||
      (st.st_mode & 077) != 0)
    goto bad;
  return 0;
bad:
  tms_fail("%s must be a directory of uid %u with mode 0700: remove it, or set "
           "$XDG_RUNTIME_DIR or $SUBLET_SOCKET", dir, (unsigned)getuid());
  return -1;
}

/* $SUBLETD, else subletd beside this library: ../_native/ (a wheel) or here (a build). */
static int find_binary(char *out, size_t n) {
  const char *explicit_path = getenv("SUBLETD");
  static const char *const beside[] = {"%s/../_native/subletd", "%s/subletd"};
  char self[PATH_MAX];
  Dl_info info;

  if (explicit_path != NULL && explicit_path[0] != '\0')
    return snprintf(out, n, "%s", explicit_path) < (int)n && access(out, X_OK) == 0 ? 0 : -1;
  if (dladdr((void *)find_binary, &info) == 0 || info.dli_fname == NULL ||
      snprintf(self, sizeof self, "%s", info.dli_fname) >= (int)sizeof self)
    return -1;
  for (size_t i = 0; i < sizeof beside / sizeof beside[0]; i++)
    if (snprintf(out, n, beside[i], dirname(self)) < (int)n && access(out, X_OK) == 0)
      return 0;
  return -1;
}

/* This process's environment without LD_PRELOAD: the daemon is no torch_memory_saver user. */
static char **daemon_env(void) {
  size_t n = 0, m = 0;
  char **env;

  while (environ[n] != NULL)
    n++;
  if ((env = calloc(n + 1, sizeof *env)) == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++)
    if (strncmp(environ[i], "LD_PRELOAD=", 11) != 0)
      env[m++] = environ[i];
  return env;
}

/* stem + suffix into out (PATH_MAX bytes): 0, or -1 when it would not fit. */
static int suffixed(char *out, const char *stem, const char *suffix) {
  size_t a = strlen(stem), b = strlen(suffix);

  if (a + b >= PATH_MAX)
    return -1;
  memcpy(out, stem, a);
  memcpy(out + a, suffix, b + 1);
  return 0;
}

static int spawn(const char *binary, int device, const char *stem) {
  char dev[16], sock[PATH_MAX], pid[PATH_MAX], log[PATH_MAX];
  const char *idle = getenv("SUBLET_IDLE_EXIT");
  char *argv[] = {"sh", "-c", "log=$1; shift; \"$@\" </dev/null >>\"$log\" 2>&1 &", "sublet",
                  log, (char *)binary, "--device", dev, "--backend", "cuda", "--socket", sock,
                  "--pid-file", pid, "--idle-exit", (char *)(idle && idle[0] ? idle : "600"),
                  NULL};
  char **env = daemon_env();
  pid_t shell;
  int rc, status;

  snprintf(dev, sizeof dev, "%d", device);
  if (suffixed(sock, stem, ".sock") || suffixed(pid, stem, ".pid") || suffixed(log, stem, ".log"))
    rc = ENAMETOOLONG;
  else
    rc = env == NULL ? ENOMEM : posix_spawn(&shell, "/bin/sh", NULL, NULL, argv, env);
  free(env);
  if (rc != 0 || waitpid(shell, &status, 0) < 0 || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0) {
    tms_fail("could not start %s for CUDA device %d (see %s)", binary, device, log);
    return -1;
  }
  return 0;
}

static sublet_client *wait_answering(const char *sock, const char *log) {
  const char *limit = getenv("SUBLET_DAEMON_START_TIMEOUT");
  long polls = (long)((limit && limit[0] ? atof(limit) : 30.0) * 1e9 / TMS_POLL_NS);
  struct timespec pause = {0, TMS_POLL_NS};
  sublet_client *c = NULL;

  for (long i = 0; i <= polls; i++) {
    if (sublet_connect(sock, &c) == 0)
      return c;
    nanosleep(&pause, NULL);
  }
  tms_fail("the subletd started did not answer on %s: its log is %s", sock, log);
  return NULL;
}

sublet_client *tms_start_user_daemon(int device, const char *dir, const char *name) {
  char stem[PATH_MAX], path[PATH_MAX], log[PATH_MAX], binary[PATH_MAX];
  sublet_client *c = NULL;
  int lock = -1;

  if (own_dir(dir) != 0)
    return NULL;
  if (find_binary(binary, sizeof binary) != 0) {
    tms_fail("no subletd beside the preload library: set $SUBLETD to its path");
    return NULL;
  }
  if (snprintf(stem, sizeof stem, "%s/%s", dir, name) >= (int)sizeof stem ||
      suffixed(path, stem, ".lock") || suffixed(log, stem, ".log")) {
    tms_fail("the path of the daemon's socket in %s is too long: set $XDG_RUNTIME_DIR", dir);
    return NULL;
  }
  if ((lock = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600)) < 0 || flock(lock, LOCK_EX) != 0) {
    tms_fail("cannot lock %s: %s", path, strerror(errno));
    goto out;
  }
  suffixed(path, stem, ".sock");
  if (sublet_connect(path, &c) != 0 && spawn(binary, device, stem) == 0)
    c = wait_answering(path, log);
out:
  if (lock >= 0)
    close(lock); /* releases the flock */
  return c;
}
