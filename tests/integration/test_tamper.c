/* test_tamper.c - a client that turns the shared memory subletd gives it against the daemon
 * (issue 25, items 1 and 9). The owner of a loan gets the journal and the host save area as
 * read-only fds, and every client holds its pages' memfds: a real client process (this one)
 * reopens them writable through /proc/self/fd, tries to write, map writable and truncate them,
 * and the daemon must go on serving, the owner's kept bytes intact. Before the fix, writing the
 * journal's counters crashed subletd (or made it write at an offset of the client's choosing)
 * and truncating the save area or a page gave it SIGBUS. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (1u << 20)
#define NOBODY 65534

static uint8_t pattern(uint64_t i) {
  return (uint8_t)((i * 2654435761u) >> 13);
}

/* Bytes [from, from + n) of p that differ from the pattern. */
static uint64_t changed(const uint8_t *p, uint64_t from, uint64_t n) {
  uint64_t bad = 0;

  for (uint64_t i = from; i < from + n; i++)
    bad += p[i] != pattern(i);
  return bad;
}

/* The fds of this process that are memfds named name: up to max into fds; their count. */
static int own_memfds(const char *name, int *fds, int max) {
  char prefix[128], path[300], link[256];
  struct dirent *e;
  DIR *dir = opendir("/proc/self/fd");
  int n = 0;

  snprintf(prefix, sizeof(prefix), "/memfd:%s ", name);
  while (dir != NULL && (e = readdir(dir)) != NULL) {
    ssize_t len;
    snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
    len = readlink(path, link, sizeof(link) - 1);
    if (len <= 0)
      continue;
    link[len] = 0;
    if (strncmp(link, prefix, strlen(prefix)) == 0 && n < max)
      fds[n++] = atoi(e->d_name);
  }
  if (dir != NULL)
    closedir(dir);
  return n;
}

/* What a hostile client tries on fd, which it should only read: NULL when every attempt fails
 * as it must, else the first that got through (all are tried: what one lets through, the next
 * builds on). Reopening writable may itself succeed (a root client passes the file's mode);
 * what it gives must not write, map writable or shrink. It may grow the file (the journal and
 * the save area grow, so they cannot be sealed against it): the daemon must cope. */
static const char *attack(int fd) {
  char path[64];
  const char *broke = NULL;
  struct stat st;
  void *m;
  int rw;

  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  if ((rw = open(path, O_RDWR | O_CLOEXEC)) < 0)
    return errno == EACCES ? NULL : "reopen: not refused with EACCES";
  if (pwrite(rw, "x", 1, 0) != -1 || errno != EPERM)
    broke = "write";
  m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0);
  if (m != MAP_FAILED) { /* what the attack was after: the journal's counters, the area */
    memset(m, 0x7f, 4096);
    munmap(m, 4096);
  }
  if (broke == NULL && (m != MAP_FAILED || errno != EPERM))
    broke = "mmap writable";
  if ((ftruncate(rw, 0) != -1 || errno != EPERM) && broke == NULL)
    broke = "ftruncate to 0";
  if (fstat(rw, &st) == 0 && ftruncate(rw, st.st_size + (300 << 20)) != 0 && errno != EPERM)
    broke = "growing: neither done nor refused"; /* the seals may allow it: the daemon copes */
  close(rw);
  return broke;
}

/* The same as another user, in a child: the file's mode must refuse the reopen itself. */
static int refused_to_other_user(int fd) {
  char path[64];
  int status = 0, rw;
  pid_t pid = fork();

  if (pid == 0) {
    if (setgid(NOBODY) != 0 || setuid(NOBODY) != 0)
      _exit(2);
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    rw = open(path, O_RDWR | O_CLOEXEC);
    _exit(rw < 0 && errno == EACCES ? 0 : 1);
  }
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static int check_fds(const char *name, int want_at_least) {
  int fds[16], n = own_memfds(name, fds, 16);

  if (n < want_at_least) {
    fprintf(stderr, "  %d memfds named %s here, wanted %d\n", n, name, want_at_least);
    return 0;
  }
  for (int i = 0; i < n; i++) {
    const char *broke = attack(fds[i]);
    if (broke != NULL) {
      fprintf(stderr, "  %s (fd %d): %s got through\n", name, fds[i], broke);
      return 0;
    }
    if (geteuid() == 0 && !refused_to_other_user(fds[i])) {
      fprintf(stderr, "  %s (fd %d): another user reopened it writable\n", name, fds[i]);
      return 0;
    }
  }
  return 1;
}

/* An owner lends all of its region to itself and allocates past the free memory, so that kept
 * pages are saved: then it has the journal and the save area, and attacks them. The daemon
 * saves more, restores and answers; the kept bytes come back intact. */
static void test_rescue_fds_cannot_be_written(void) {
  struct sl_test_daemon d;
  struct sublet_loan_stats st;
  sublet_client *c;
  sublet_region *r;
  struct sublet_info info;
  uint64_t loan;
  void *p, *q;

  CHECK(sl_test_daemon_start(&d, PAGE, 16 * PAGE) == 0);
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, 8 * PAGE, &r), 0);
  for (uint64_t i = 0; i < 8 * PAGE; i++)
    ((uint8_t *)sublet_region_addr(r))[i] = pattern(i);
  CHECK_RC(sublet_lend_local(r, NULL, 0, 1, &loan), 0);
  CHECK_RC(sublet_alloc(c, 12 * PAGE, &p), 0); /* 8 free pages, then 4 kept ones saved */
  CHECK(check_fds("sublet-journal", 1));
  CHECK(check_fds("sublet-save-area", 1));
  CHECK_RC(sublet_alloc(c, 4 * PAGE, &q), 0);  /* 4 more saved: the journal appended to */
  memset(p, 0xee, 12 * PAGE);
  memset(q, 0xee, 4 * PAGE);
  CHECK_RC(sublet_free(c, p), 0);
  CHECK_RC(sublet_free(c, q), 0);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 10000, &st), 0);
  CHECK(st.copied_in_bytes == 8 * PAGE);
  CHECK(changed(sublet_region_addr(r), 0, 8 * PAGE) == 0);
  CHECK_RC(sublet_get_info(c, &info), 0);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0); /* 0: a clean shutdown, not a crash */
}

/* A client holds its pages' memfds: truncating one must fail, and the daemon then reads the
 * page (saving it) without SIGBUS (issue 25, item 9). */
static void test_page_memfd_cannot_shrink(void) {
  struct sl_test_daemon d;
  struct sublet_loan_stats st;
  sublet_client *c;
  sublet_region *r;
  int fds[16], n;
  uint64_t loan;
  void *p;

  CHECK(sl_test_daemon_start(&d, PAGE, 8 * PAGE) == 0);
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  for (uint64_t i = 0; i < 4 * PAGE; i++)
    ((uint8_t *)sublet_region_addr(r))[i] = pattern(i);
  n = own_memfds("sublet-page", fds, 16);
  CHECK(n >= 4);
  for (int i = 0; i < n; i++) {
    errno = 0;
    CHECK(ftruncate(fds[i], 0) == -1 && errno == EPERM);
    CHECK(ftruncate(fds[i], 2 * PAGE) == -1 && errno == EPERM);
  }
  CHECK_RC(sublet_lend_local(r, NULL, 0, 1, &loan), 0);
  CHECK_RC(sublet_alloc(c, 8 * PAGE, &p), 0); /* every kept page read by the daemon */
  CHECK_RC(sublet_free(c, p), 0);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 10000, &st), 0);
  CHECK(changed(sublet_region_addr(r), 0, 4 * PAGE) == 0);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* A release's save area: the same attacks on the fd its client gets (releases.c). Half of
 * each page kept, one page staying: some kept bytes move into it, the rest are saved. */
static void test_release_area_cannot_be_written(void) {
  struct sl_test_daemon d;
  struct sublet_release_stats rs;
  sublet_client *c;
  sublet_region *r;
  struct sublet_range keep[4];
  uint64_t id, bad = 0;

  for (int i = 0; i < 4; i++)
    keep[i] = (struct sublet_range){i * (uint64_t)PAGE, PAGE / 2};
  CHECK(sl_test_daemon_start(&d, PAGE, 8 * PAGE) == 0);
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  for (uint64_t i = 0; i < 4 * PAGE; i++)
    ((uint8_t *)sublet_region_addr(r))[i] = pattern(i);
  CHECK_RC(sublet_release(r, NULL, 0, keep, 4, 0, 1, &id, &rs), 0);
  CHECK(rs.copied_out_bytes > 0 && rs.moved_bytes > 0);
  CHECK(check_fds("sublet-save-area", 1));
  CHECK_RC(sublet_resume(r, id, 0, &rs), 0);
  for (int i = 0; i < 4; i++)
    bad += changed(sublet_region_addr(r), keep[i].offset, keep[i].length);
  CHECK(bad == 0);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

int main(void) {
  prctl(PR_SET_DUMPABLE, 1); /* /proc/self/fd stays this process's to open */
  sl_test_run("rescue fds cannot be written", test_rescue_fds_cannot_be_written);
  sl_test_run("page memfds cannot shrink", test_page_memfd_cannot_shrink);
  sl_test_run("a release's save area cannot be written", test_release_area_cannot_be_written);
  return sl_test_summary("test_tamper");
}
