/* test_gone.c - a borrower in another process that keeps its window between loans lets go of
 * it at once when the region goes (released by its owner, or its owner dies), though it sits
 * idle calling nothing: the daemon tells it (RegionGone). Until it has let go the region's
 * pages are counted as held, by it (Status.held), and the device memory stays taken; then the
 * memory is back. Real subletd (memfd backend: a page is a memfd, so "let go" means no fd and
 * no mapping of one left in the borrower's process).
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (64u << 10)
#define TOTAL (16u << 20)
#define REGION (10u << 20) /* two do not fit on the device */
#define REGION_PAGES (REGION / PAGE)

static struct sl_test_daemon daemon_;

/* The memfd pages (sublet-page) a process holds: open fds, and mappings. */
static int memfd_fds(pid_t pid) {
  return sl_test_count_memfds(pid, "sublet-page");
}

static int memfd_maps(pid_t pid) {
  char path[64], line[512];
  FILE *f;
  int n = 0;

  snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
  if ((f = fopen(path, "r")) == NULL)
    return -1;
  while (fgets(line, sizeof(line), f) != NULL)
    n += strstr(line, "/memfd:sublet-page") != NULL;
  fclose(f);
  return n;
}

/* Pages of gone regions that pid holds, as the daemon's status says (-1: no status). */
static long held_pages(sublet_client *c, pid_t pid) {
  char *json, *p, want[48];
  long pages = 0;

  if (sublet_status_json(c, &json) != 0)
    return -1;
  snprintf(want, sizeof(want), "\"holder_pid\": %d,", (int)pid);
  for (p = strstr(json, "\"held\": ["); p != NULL && (p = strstr(p, "{\"region\"")) != NULL;
       p++) {
    char *end = strchr(p, '}'), *pg = strstr(p, "\"pages\": ");
    if (end != NULL && pg != NULL && pg < end && memmem(p, (size_t)(end - p), want,
                                                        strlen(want)) != NULL)
      pages += atol(pg + 9);
  }
  sublet_string_free(json);
  return pages;
}

/* Waits for pid to hold no memfd page, fd or mapping; *seconds says how long it took, for
 * the log only (a loaded machine may take its time: what the test proves is that the idle
 * borrower lets go at all, calling nothing). Gives up after 60 s, so a borrower that never
 * lets go fails the test rather than hanging it. */
static int lets_go(pid_t pid, double *seconds) {
  double t0 = sl_test_now();

  while (sl_test_now() - t0 < 60.0) {
    if (memfd_fds(pid) == 0 && memfd_maps(pid) == 0) {
      *seconds = sl_test_now() - t0;
      return 1;
    }
    usleep(10000);
  }
  return 0;
}

/* Waits for the daemon to count no page held by pid (Dropped reaches it a moment after the
 * unmapping); gives up after 60 s. */
static long held_pages_settled(sublet_client *c, pid_t pid) {
  double t0 = sl_test_now();
  long held;

  while ((held = held_pages(c, pid)) != 0 && sl_test_now() - t0 < 60.0)
    usleep(10000);
  return held;
}

/* The borrower: two loans by name, each taking the whole region; reports the memfd fds and
 * mappings it holds after each, then sits idle, calling nothing, until it is killed. */
static void idle_borrower(const char *name, int report_fd) {
  sublet_client *c;
  int counts[4];
  void *p;

  prctl(PR_SET_PDEATHSIG, SIGKILL); /* a failed check leaves no idler behind */
  if (sublet_connect(daemon_.socket, &c) != 0)
    _exit(2);
  for (int i = 0; i < 2; i++) {
    if (sublet_borrow(c, 0, NULL, name, 10000) != 0 || sublet_alloc(c, REGION, &p) != 0)
      _exit(3);
    memset(p, 0xEE, REGION);
    if (sublet_free(c, p) != 0 || sublet_return(c, 0, NULL, NULL, 0, NULL) != 0)
      _exit(4);
    counts[2 * i] = memfd_fds(getpid());
    counts[2 * i + 1] = memfd_maps(getpid());
  }
  if (write(report_fd, counts, sizeof(counts)) != sizeof(counts))
    _exit(5);
  for (;;)
    pause();
}

static int read_all(int fd, void *buf, size_t n) {
  size_t got = 0;
  ssize_t r;

  while (got < n && (r = read(fd, (char *)buf + got, n - got)) > 0)
    got += (size_t)r;
  return got == n;
}

/* Lends the region twice under name and waits for each loan to end. */
static int lend_twice(sublet_region *r, sublet_client *c, const char *name) {
  uint8_t token[16];
  uint64_t loan;
  int rc = 0;

  for (int i = 0; i < 2 && rc == 0; i++) {
    memset(sublet_region_addr(r), 0x5A + i, REGION);
    rc = sublet_lend(r, NULL, 0, 0, name, &loan, token);
    if (rc == 0)
      rc = sublet_reclaim(c, loan, 10000, NULL);
  }
  return rc;
}

static void stop_child(pid_t pid) {
  int status;

  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
}

/* The borrower kept its window: the second loan imported nothing. */
static int kept_window(const int counts[4]) {
  printf("  borrower's memfd pages: %d fds, %d mappings after loan 1; %d, %d after loan 2\n",
         counts[0], counts[1], counts[2], counts[3]);
  return counts[0] >= (int)REGION_PAGES && counts[2] == counts[0] && counts[3] == counts[1];
}

static void test_region_released(void) {
  sublet_client *c;
  sublet_region *r, *again;
  int counts[4], pipefd[2], status;
  double took;
  pid_t pid;

  CHECK(pipe(pipefd) == 0);
  if ((pid = fork()) == 0) /* first: it inherits no fd or mapping of the owner's pages */
    idle_borrower("released", pipefd[1]);
  close(pipefd[1]);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, REGION, &r), 0);
  CHECK_RC(lend_twice(r, c, "released"), 0);
  CHECK(read_all(pipefd[0], counts, sizeof(counts)));
  close(pipefd[0]);
  CHECK(kept_window(counts));
  /* Stopped, it cannot let go: the daemon counts the pages as its, and the memory as taken. */
  kill(pid, SIGSTOP);
  CHECK(waitpid(pid, &status, WUNTRACED) == pid && WIFSTOPPED(status));
  CHECK_RC(sublet_region_release(r), 0);
  CHECK(held_pages(c, pid) == REGION_PAGES);
  CHECK_RC(sublet_region_create(c, REGION, &again), SUBLET_ENOMEM);
  CHECK(memfd_fds(pid) == counts[2]);
  /* Running again, idle, it lets go, calling nothing: no fd, no mapping; the memory is back. */
  kill(pid, SIGCONT);
  CHECK(lets_go(pid, &took));
  printf("  the borrower let go %.2f s after it ran again\n", took);
  CHECK(held_pages_settled(c, pid) == 0);
  CHECK_RC(sublet_region_create(c, REGION, &again), 0);
  CHECK_RC(sublet_region_release(again), 0);
  stop_child(pid);
  sublet_disconnect(c);
}

/* The owner, in a process of its own: makes the region, lends it twice, then is killed once
 * the borrower has counted what it holds (a byte on die_fd). */
static void doomed_owner(int die_fd) {
  sublet_client *c;
  sublet_region *r;
  char k;

  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (sublet_connect(daemon_.socket, &c) != 0 || sublet_region_create(c, REGION, &r) != 0 ||
      lend_twice(r, c, "owner-dies") != 0)
    _exit(2);
  if (read(die_fd, &k, 1) != 1)
    _exit(3);
  raise(SIGKILL);
}

static void test_owner_dies(void) {
  sublet_client *c;
  sublet_region *again;
  struct sublet_info info;
  int counts[4], pipefd[2], die[2], status;
  double took;
  pid_t pid, owner;

  CHECK(pipe(pipefd) == 0 && pipe(die) == 0);
  if ((pid = fork()) == 0)
    idle_borrower("owner-dies", pipefd[1]);
  if ((owner = fork()) == 0)
    doomed_owner(die[0]);
  close(pipefd[1]);
  close(die[0]);
  CHECK(read_all(pipefd[0], counts, sizeof(counts)));
  CHECK(kept_window(counts));
  CHECK(write(die[1], "k", 1) == 1);
  waitpid(owner, &status, 0);
  CHECK(WIFSIGNALED(status));
  CHECK(lets_go(pid, &took));
  printf("  the owner died; the idle borrower let go within %.2f s\n", took);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK(held_pages_settled(c, pid) == 0);
  CHECK_RC(sublet_get_info(c, &info), 0);
  CHECK(info.free_bytes == TOTAL);
  CHECK_RC(sublet_region_create(c, REGION, &again), 0);
  CHECK_RC(sublet_region_release(again), 0);
  stop_child(pid);
  close(pipefd[0]);
  close(die[1]);
  sublet_disconnect(c);
}

int main(void) {
  if (sl_test_daemon_start(&daemon_, PAGE, TOTAL) != 0)
    return 1;
  sl_test_run("a released region's idle borrower lets go", test_region_released);
  sl_test_run("a dead owner's idle borrower lets go", test_owner_dies);
  sl_test_daemon_stop(&daemon_);
  return sl_test_summary("gone");
}
