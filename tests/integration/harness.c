/* harness.c - a real subletd process for integration tests. */
#include "harness.h"

#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int sl_test_failed, sl_test_passed;

/* The socket file exists from bind(); connections are accepted only after listen(). */
static int accepts(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), ok;

  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
  ok = fd >= 0 && connect(fd, (struct sockaddr *)&addr, sizeof(addr)) == 0;
  if (fd >= 0)
    close(fd);
  return ok;
}

int sl_test_daemon_start(struct sl_test_daemon *d, uint64_t page_size, uint64_t total) {
  const char *bin = getenv("SUBLETD") ? getenv("SUBLETD") : "./subletd";
  char ps[32], tot[32];

  snprintf(d->dir, sizeof(d->dir), "/tmp/sublet-test-XXXXXX");
  if (mkdtemp(d->dir) == NULL)
    return -1;
  snprintf(d->socket, sizeof(d->socket), "%s/gpu0.sock", d->dir);
  snprintf(ps, sizeof(ps), "%llu", (unsigned long long)page_size);
  snprintf(tot, sizeof(tot), "%llu", (unsigned long long)total);
  d->pid = fork();
  if (d->pid == 0) {
    setenv("SUBLET_MEMFD_PAGE_SIZE", ps, 1);
    setenv("SUBLET_MEMFD_TOTAL", tot, 1);
    execl(bin, "subletd", "--backend", "memfd", "--socket", d->socket, "--check",
          "--log-level", getenv("SUBLET_TEST_LOG") ? getenv("SUBLET_TEST_LOG") : "warn",
          (char *)NULL);
    perror("exec subletd");
    _exit(127);
  }
  for (int i = 0; i < 500; i++) {
    if (accepts(d->socket))
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
