/* harness.c - a real subletd process for integration tests. */
#include "harness.h"

#include <dirent.h>
#include <grp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int sl_test_failed, sl_test_passed;

static int socket_accepts(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), ok;

  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
  ok = fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

/* In the child: becomes what o asks for, then runs subletd. */
static void exec_daemon(const struct sl_test_daemon *d, const struct sl_test_daemon_opts *o) {
  const char *bin = getenv("SUBLETD") ? getenv("SUBLETD") : "./subletd";
  const char *argv[32] = {"subletd", "--backend", "memfd", "--socket", d->socket, "--check",
                          "--log-level",
                          getenv("SUBLET_TEST_LOG") ? getenv("SUBLET_TEST_LOG") : "warn"};
  size_t n = 8;

  for (size_t i = 0; o->args != NULL && o->args[i] != NULL && n < 31; i++)
    argv[n++] = o->args[i];
  argv[n] = NULL;
  if (o->nofile > 0)
    setrlimit(RLIMIT_NOFILE, &(struct rlimit){o->nofile, o->nofile});
  if (o->uid != 0 && (setgroups(0, NULL) != 0 || setgid(o->uid) != 0 || setuid(o->uid) != 0)) {
    perror("setuid for subletd");
    _exit(127);
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* a test that fails early leaves no daemon behind */
  execv(bin, (char *const *)argv);
  perror("exec subletd");
  _exit(127);
}

int sl_test_daemon_start(struct sl_test_daemon *d, uint64_t page_size, uint64_t total) {
  return sl_test_daemon_start_ex(d, page_size, total, &(struct sl_test_daemon_opts){0});
}

int sl_test_daemon_start_ex(struct sl_test_daemon *d, uint64_t page_size, uint64_t total,
                            const struct sl_test_daemon_opts *o) {
  char ps[32], tot[32];

  snprintf(d->dir, sizeof(d->dir), "/tmp/sublet-test-XXXXXX");
  if (mkdtemp(d->dir) == NULL)
    return -1;
  snprintf(d->socket, sizeof(d->socket), "%s/gpu0.sock", d->dir);
  snprintf(ps, sizeof(ps), "%llu", (unsigned long long)page_size);
  snprintf(tot, sizeof(tot), "%llu", (unsigned long long)total);
  if (o->uid != 0 && chown(d->dir, o->uid, o->uid) != 0)
    return -1;
  d->pid = fork();
  if (d->pid == 0) {
    setenv("SUBLET_MEMFD_PAGE_SIZE", ps, 1);
    setenv("SUBLET_MEMFD_TOTAL", tot, 1);
    exec_daemon(d, o);
  }
  for (int i = 0; i < 500; i++) { /* until it accepts: the file exists a moment earlier */
    if (socket_accepts(d->socket))
      return 0;
    usleep(10000);
  }
  fprintf(stderr, "subletd did not create %s\n", d->socket);
  return -1;
}

int sl_test_daemon_stop(struct sl_test_daemon *d) {
  int status = 0;

  kill(d->pid, SIGTERM);
  waitpid(d->pid, &status, 0);
  rmdir(d->dir);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int sl_test_count_fds(pid_t pid) {
  char path[64];
  struct dirent *e;
  DIR *dir;
  int n = 0;

  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  dir = opendir(path);
  if (dir == NULL)
    return -1;
  while ((e = readdir(dir)) != NULL)
    n += e->d_name[0] != '.';
  closedir(dir);
  return n;
}

int sl_test_count_memfds(pid_t pid, const char *name) {
  char path[64], link[256], prefix[128];
  struct dirent *e;
  DIR *dir;
  int n = 0;

  snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
  snprintf(prefix, sizeof(prefix), "/memfd:%s", name);
  if ((dir = opendir(path)) == NULL)
    return -1;
  while ((e = readdir(dir)) != NULL) {
    char fd[sizeof(path) + 256];
    ssize_t len;
    snprintf(fd, sizeof(fd), "%s/%s", path, e->d_name);
    len = readlink(fd, link, sizeof(link) - 1);
    n += len > 0 && strncmp(link, prefix, strlen(prefix)) == 0;
  }
  closedir(dir);
  return n;
}

long sl_test_rss_kib(pid_t pid) {
  char path[64], line[256];
  long kib = -1;
  FILE *f;

  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  f = fopen(path, "r");
  if (f == NULL)
    return -1;
  while (fgets(line, sizeof(line), f) != NULL)
    if (sscanf(line, "VmRSS: %ld", &kib) == 1)
      break;
  fclose(f);
  return kib;
}

void sl_test_run(const char *name, void (*fn)(void)) {
  int before = sl_test_failed;
  struct timespec t0, t1;

  clock_gettime(CLOCK_MONOTONIC, &t0);
  fn();
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (sl_test_failed == before)
    sl_test_passed++;
  printf("%-40s %s (%.2f s)\n", name, sl_test_failed == before ? "ok" : "FAILED",
         (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
  fflush(stdout);
}

int sl_test_summary(const char *suite) {
  printf("%s: %d passed, %d failed\n", suite, sl_test_passed, sl_test_failed);
  return sl_test_failed == 0 ? 0 : 1;
}

uint64_t sl_test_free_bytes(sublet_client *c) {
  struct sublet_info info;

  return sublet_get_info(c, &info) == 0 ? info.free_bytes : 0;
}

long long sl_test_status_number(sublet_client *c, const char *key) {
  char want[64], *json, *at;
  long long n = -1;

  if (sublet_status_json(c, &json) != 0)
    return -1;
  snprintf(want, sizeof(want), "\"%s\": ", key);
  if ((at = strstr(json, want)) != NULL)
    n = strtoll(at + strlen(want), NULL, 10);
  sublet_string_free(json);
  return n;
}

double sl_test_now(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

pid_t sl_test_child(void) {
  pid_t pid = fork();

  if (pid == 0)
    prctl(PR_SET_PDEATHSIG, SIGKILL);
  return pid;
}

void sl_test_reap(pid_t pid) {
  int status;

  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
}
