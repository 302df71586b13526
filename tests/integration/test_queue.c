/* test_queue.c - owners wait their turn: while a loan runs on the device, Lends wait for it (up
 * to their timeout), and are served in the order they arrived; a waiter that times out or
 * goes leaves the line, and the line moves on. A Lend with millions of keep ranges is worked
 * out off the daemon's loop: another client's round trip stays short meanwhile.
 *
 * A real subletd (memfd backend), owners in child processes through libsublet. Every kept byte
 * is compared after every loan.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (64u << 10)
#define TOTAL (160u << 20)
#define REGION_PAGES 4

static struct sl_test_daemon daemon_;

/* The byte at offset i of owner `who`'s region in its loan `n`. */
static uint8_t pattern(unsigned who, unsigned n, uint64_t i) {
  return (uint8_t)(((i + 1) * 2654435761u + who * 40503u + n * 977u) >> 11);
}

static void fill(uint8_t *p, uint64_t size, unsigned who, unsigned n) {
  for (uint64_t i = 0; i < size; i++)
    p[i] = pattern(who, n, i);
}

static int intact(const uint8_t *p, const struct sublet_range *keep, size_t nkeep,
                  unsigned who, unsigned n) {
  for (size_t k = 0; k < nkeep; k++)
    for (uint64_t i = keep[k].offset; i < keep[k].offset + keep[k].length; i++)
      if (p[i] != pattern(who, n, i))
        return 0;
  return 1;
}

/* "lends_waiting" of the daemon's status, or -1. */
static long lends_waiting(sublet_client *c) {
  return (long)sl_test_status_number(c, "lends_waiting");
}

/* The same, asked on a connection of its own. */
static long lends_waiting_anyone(void) {
  sublet_client *c;
  long n;

  if (sublet_connect(daemon_.socket, &c) != 0)
    return -1;
  n = lends_waiting(c);
  sublet_disconnect(c);
  return n;
}

/* Waits (up to 30 s) until n Lends wait for the device. */
static int wait_for_line(sublet_client *c, long n) {
  SL_TEST_UNTIL(lends_waiting(c) == n);
  return lends_waiting(c) == n;
}

/* Reads one report of a child, or fails after 60 s (a child that never reports). */
static int read_report(int fd, void *out, size_t n) {
  struct pollfd p = {.fd = fd, .events = POLLIN};

  return poll(&p, 1, 60000) == 1 && read(fd, out, n) == (ssize_t)n;
}

/* The device's loan, held by a child process: the processes that fork never borrow (a child
 * forked beside the library's watch thread could inherit a lock it holds). Its loan id comes
 * back; writing a byte to *release ends the loan (the child returns and reclaims it). */
static pid_t hold_device(uint64_t *loan, int *release) {
  int up[2], down[2];
  pid_t pid;

  if (pipe(up) != 0 || pipe(down) != 0)
    return -1;
  if ((pid = fork()) == 0) {
    sublet_client *c;
    sublet_region *r;
    uint64_t id = 0;
    char go;
    if (sublet_connect(daemon_.socket, &c) != 0 ||
        sublet_region_create(c, REGION_PAGES * PAGE, &r) != 0 ||
        sublet_lend_local(r, NULL, 0, 1, &id) != 0)
      id = 0;
    if (write(up[1], &id, sizeof(id)) != sizeof(id) || id == 0 || read(down[0], &go, 1) != 1)
      _exit(2);
    _exit(sublet_return(c, 0, NULL, NULL, 0, NULL) == 0 &&
          sublet_reclaim(c, id, 10000, NULL) == 0 ? 0 : 3);
  }
  close(up[1]);
  close(down[0]);
  *release = down[1];
  if (!read_report(up[0], loan, sizeof(*loan)) || *loan == 0) {
    kill(pid, SIGKILL);
    pid = -1;
  }
  close(up[0]);
  return pid;
}

/* Ends the holder's loan and waits for it: 1 if all went well. */
static int release_device(pid_t holder, int release) {
  int status;

  if (write(release, "x", 1) != 1)
    return 0;
  close(release);
  return waitpid(holder, &status, 0) == holder && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

/* One local loan that overwrites all of the region (kept pages included: the daemon has no
 * fresh memory to give): the kept bytes must come back. */
static int one_loan(sublet_client *c, sublet_region *r, unsigned who, unsigned n,
                    int timeout_ms, uint64_t *loan) {
  struct sublet_range keep[2] = {{100 + n, PAGE + 7 * who}, {3 * PAGE - 50, 30}};
  uint64_t size = REGION_PAGES * PAGE;
  void *p;
  int rc;

  fill(sublet_region_addr(r), size, who, n);
  if ((rc = sublet_lend_local_wait(r, keep, 2, 0, timeout_ms, loan)) != 0)
    return rc;
  if ((rc = sublet_alloc(c, size, &p)) == 0) {
    memset(p, 0xEE, size);
    sublet_free(c, p);
  }
  if (rc == 0)
    rc = sublet_return(c, 0, NULL, NULL, 0, NULL);
  if (rc == 0)
    rc = sublet_reclaim(c, *loan, 10000, NULL);
  if (rc == 0 && !intact(sublet_region_addr(r), keep, 2, who, n))
    rc = SUBLET_EIO;
  return rc;
}

/* ------------------------------------------------------------------ many owners at once */

#define OWNERS 16
#define LOANS 20

/* An owner process: LOANS loans, each waiting its turn; exits 0 if all went well. */
static void owner_process(unsigned who) {
  sublet_client *c;
  sublet_region *r;
  uint64_t loan;

  if (sublet_connect(daemon_.socket, &c) != 0 ||
      sublet_region_create(c, REGION_PAGES * PAGE, &r) != 0)
    _exit(2);
  for (unsigned n = 0; n < LOANS; n++) {
    int rc = one_loan(c, r, who, n, 60000, &loan);
    if (rc != 0) {
      fprintf(stderr, "owner %u, loan %u: %s (%s)\n", who, n, sublet_strerror(rc),
              sublet_last_error());
      _exit(rc == SUBLET_EBUSY ? 3 : 4);
    }
  }
  _exit(sublet_region_release(r) == 0 ? 0 : 5);
}

static void test_owners_lend_at_once(void) {
  pid_t pids[OWNERS];
  int status, ok = 0;

  for (unsigned i = 0; i < OWNERS; i++)
    if ((pids[i] = fork()) == 0)
      owner_process(i);
  for (unsigned i = 0; i < OWNERS; i++) {
    waitpid(pids[i], &status, 0);
    ok += WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  CHECK(ok == OWNERS); /* 320 loans, no busy error, every kept byte back */
}

/* ------------------------------------------------------------------ the order of the line */

/* An owner in line: lends locally with timeout_ms, writes its rank and the loan (or 0 and the
 * error) to fd when served, gives the loan back, exits. */
static void waiting_owner(unsigned rank, int timeout_ms, int fd) {
  struct { unsigned rank; int rc; uint64_t loan; } out = {rank, 0, 0};
  sublet_client *c;
  sublet_region *r;

  if (sublet_connect(daemon_.socket, &c) != 0 ||
      sublet_region_create(c, REGION_PAGES * PAGE, &r) != 0)
    _exit(2);
  out.rc = one_loan(c, r, rank, 0, timeout_ms, &out.loan);
  if (write(fd, &out, sizeof(out)) != sizeof(out))
    _exit(3);
  _exit(0);
}

/* The device is held; owners join the line one after the other (each seen waiting before
 * the next comes); then they are served in that order: their loans' ids rise with rank. */
static void test_served_in_arrival_order(void) {
  struct { unsigned rank; int rc; uint64_t loan; } got[8], one;
  sublet_client *c, *other;
  sublet_region *r2;
  uint64_t held, none;
  pid_t pids[8], holder;
  int fds[2], release, status;

  CHECK(pipe(fds) == 0);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK((holder = hold_device(&held, &release)) > 0);
  for (unsigned i = 0; i < 8; i++) {
    if ((pids[i] = fork()) == 0)
      waiting_owner(i, 30000, fds[1]);
    CHECK(wait_for_line(c, i + 1));
  }
  /* Without a timeout, an owner is told at once that the device is busy. */
  CHECK_RC(sublet_connect(daemon_.socket, &other), 0);
  CHECK_RC(sublet_region_create(other, REGION_PAGES * PAGE, &r2), 0);
  CHECK_RC(sublet_lend(r2, NULL, 0, 1, NULL, &none, NULL), SUBLET_EBUSY);
  CHECK(strstr(sublet_last_error(), "lend with a timeout") != NULL);
  sublet_disconnect(other);
  CHECK(release_device(holder, release));
  for (unsigned i = 0; i < 8; i++) { /* they report when done: sorted by rank */
    CHECK(read_report(fds[0], &one, sizeof(one)));
    CHECK(one.rank < 8);
    got[one.rank] = one;
  }
  for (unsigned i = 0; i < 8; i++) {
    CHECK_RC(got[i].rc, 0);
    CHECK(got[i].loan > held && (i == 0 || got[i].loan > got[i - 1].loan)); /* in order */
    waitpid(pids[i], &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  close(fds[0]);
  close(fds[1]);
  sublet_disconnect(c);
}

/* ------------------------------------------------------------------ leaving the line */

/* The first in line times out: it hears ETIMEDOUT (nothing lent), the line moves on; the one
 * behind it, killed while waiting, is dropped; the last gets the device when it frees up. */
static void test_timeout_and_disconnect_leave_the_line(void) {
  struct { unsigned rank; int rc; uint64_t loan; } got;
  sublet_client *c;
  uint64_t held;
  pid_t timing_out, killed, last, holder;
  int fds[2], release, status;
  double t0;

  CHECK(pipe(fds) == 0);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK((holder = hold_device(&held, &release)) > 0);
  t0 = sl_test_now();
  if ((timing_out = fork()) == 0)
    waiting_owner(0, 500, fds[1]);
  CHECK(wait_for_line(c, 1));
  if ((killed = fork()) == 0)
    waiting_owner(1, -1, fds[1]);
  CHECK(wait_for_line(c, 2));
  if ((last = fork()) == 0)
    waiting_owner(2, 30000, fds[1]);
  CHECK(wait_for_line(c, 3));
  CHECK(read_report(fds[0], &got, sizeof(got)));
  CHECK(got.rank == 0 && got.rc == SUBLET_ETIMEDOUT && got.loan == 0);
  CHECK(sl_test_now() - t0 >= 0.5);
  CHECK(wait_for_line(c, 2));
  kill(killed, SIGKILL);
  waitpid(killed, &status, 0);
  CHECK(wait_for_line(c, 1)); /* dropped with its connection */
  CHECK(release_device(holder, release));
  CHECK(read_report(fds[0], &got, sizeof(got)));
  CHECK(got.rank == 2 && got.rc == 0 && got.loan > held);
  waitpid(timing_out, &status, 0);
  waitpid(last, &status, 0);
  CHECK(lends_waiting(c) == 0);
  close(fds[0]);
  close(fds[1]);
  sublet_disconnect(c);
}

/* ------------------------------------------------------------------ cancelling */

struct waiting_lend {
  sublet_region *r;
  int rc;
  uint64_t loan;
};

static void *lend_and_wait(void *arg) {
  struct waiting_lend *wl = arg;

  wl->rc = sublet_lend_wait(wl->r, NULL, 0, 1, NULL, -1, &wl->loan, NULL);
  return NULL;
}

/* A Lend waiting forever is cancelled from another thread (as Ctrl-C does in Python): it
 * returns ECANCELED, leaves the line, and its client goes on working. */
static void test_cancel_a_waiting_lend(void) {
  struct waiting_lend wl = {0};
  sublet_client *c;
  uint64_t held;
  pthread_t th;
  pid_t holder;
  int release;

  CHECK((holder = hold_device(&held, &release)) > 0);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, REGION_PAGES * PAGE, &wl.r), 0);
  CHECK_RC(sublet_cancel(c), 0); /* nothing waits: nothing happens */
  CHECK(pthread_create(&th, NULL, lend_and_wait, &wl) == 0);
  SL_TEST_UNTIL(lends_waiting_anyone() == 1);
  CHECK_RC(sublet_cancel(c), 0);
  pthread_join(th, NULL);
  CHECK_RC(wl.rc, SUBLET_ECANCELED);
  CHECK(lends_waiting_anyone() == 0);
  CHECK(release_device(holder, release));
  CHECK_RC(sublet_lend_wait(wl.r, NULL, 0, 1, NULL, 1000, &wl.loan, NULL), 0);
  CHECK(wl.loan > held);
  CHECK_RC(sublet_withdraw(c, wl.loan), 0);
  sublet_region_release(wl.r);
  sublet_disconnect(c);
}

/* ------------------------------------------------------------------ a long keep list */

#define MANY_RANGES 3000000u
#define BIG_REGION (64u << 20)

/* Another client's round trips while a long call of this one is worked out. Each trip says
 * what it saw; `during` counts the trips that saw the call in the daemon's hands, half done:
 * answered, so, while the long work went on off the loop (on the loop, nothing is answered
 * until it is done, and no trip could see it half done). */
struct pinger {
  volatile int stop;
  unsigned trips, during;
  const char *socket;  /* NULL: the suite's daemon */
  int lends;           /* asks Status: a Lend waits (being drafted) */
  uint64_t lo, hi;     /* else asks Info: free bytes strictly between (pages being made) */
};

static void *ping(void *arg) {
  struct pinger *p = arg;
  struct sublet_info info;
  sublet_client *c;

  if (sublet_connect(p->socket != NULL ? p->socket : daemon_.socket, &c) != 0)
    return NULL;
  while (!p->stop) {
    if (p->lends) {
      long n = lends_waiting(c);
      if (n < 0)
        break;
      p->during += n > 0;
    } else {
      if (sublet_get_info(c, &info) != 0)
        break;
      p->during += info.free_bytes > p->lo && info.free_bytes < p->hi;
    }
    p->trips++;
  }
  sublet_disconnect(c);
  return NULL;
}

/* 3 million 8-byte ranges in shuffled order (the daemon sorts them): the Lend is decoded and
 * worked out off the loop, so another client is answered meanwhile (it sees the Lend waiting
 * while its keep list is drafted); the loan then keeps exactly those bytes. */
static void test_millions_of_ranges_off_the_loop(void) {
  struct sublet_range *keep = malloc(MANY_RANGES * sizeof(*keep));
  struct pinger p = {.lends = 1};
  struct sublet_loan_stats st;
  sublet_client *c;
  sublet_region *r;
  pthread_t th;
  uint64_t loan;

  CHECK(keep != NULL);
  for (uint32_t i = 0; i < MANY_RANGES; i++)
    keep[i] = (struct sublet_range){(uint64_t)i * 16, 8};
  for (uint32_t i = MANY_RANGES - 1; i > 0; i--) {
    uint32_t j = (uint32_t)rand() % (i + 1);
    struct sublet_range t = keep[i];
    keep[i] = keep[j];
    keep[j] = t;
  }
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, BIG_REGION, &r), 0);
  fill(sublet_region_addr(r), BIG_REGION, 99, 0);
  CHECK(lends_waiting(c) == 0);
  CHECK(pthread_create(&th, NULL, ping, &p) == 0);
  CHECK_RC(sublet_lend_local_wait(r, keep, MANY_RANGES, 0, 30000, &loan), 0);
  p.stop = 1;
  pthread_join(th, NULL);
  fprintf(stderr, "  another client's round trips during the Lend: %u, %u of them while it "
          "was drafted\n", p.trips, p.during);
  CHECK(p.during > 0);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 30000, &st), 0);
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
  CHECK(intact(sublet_region_addr(r), keep, MANY_RANGES, 99, 0));
  free(keep);
  sublet_region_release(r);
  sublet_disconnect(c);
}

/* Creating a region's pages runs off the loop, and so does releasing a large one (more than
 * 256 MiB): another client is answered meanwhile (it sees the device's free memory partway
 * down, some pages made and some not), and the release is answered once the memory is back.
 * This daemon's memfd pages take as long to create as a GPU's ($SUBLET_MEMFD_CREATE; 2 s for
 * 64 GiB on an H200), and before the job the loop was held that long. */
#define SLOW_TOTAL (512ull << 20)
#define SLOW_REGION (320ull << 20) /* untouched memfd pages: no memory of the machine's */

static void test_region_pages_made_off_the_loop(void) {
  static const char *const reserve[] = {"--reserve", "0", NULL};
  struct sl_test_daemon slow;
  struct pinger p = {.lo = SLOW_TOTAL - SLOW_REGION, .hi = SLOW_TOTAL};
  struct sublet_info info;
  sublet_client *c;
  sublet_region *r;
  pthread_t th;
  double t;

  setenv("SUBLET_MEMFD_CREATE", "1G", 1); /* 320 MiB: 0.3 s */
  CHECK(sl_test_daemon_start_ex(&slow, PAGE, SLOW_TOTAL,
                                &(struct sl_test_daemon_opts){.args = reserve}) == 0);
  unsetenv("SUBLET_MEMFD_CREATE");
  p.socket = slow.socket;
  CHECK_RC(sublet_connect(slow.socket, &c), 0);
  CHECK(pthread_create(&th, NULL, ping, &p) == 0);
  t = sl_test_now();
  CHECK_RC(sublet_region_create(c, SLOW_REGION, &r), 0);
  t = sl_test_now() - t;
  p.stop = 1;
  pthread_join(th, NULL);
  CHECK_RC(sublet_get_info(c, &info), 0);
  CHECK(info.free_bytes == SLOW_TOTAL - SLOW_REGION);
  CHECK_RC(sublet_region_release(r), 0); /* a job: answered once the pages are gone */
  CHECK_RC(sublet_get_info(c, &info), 0);
  CHECK(info.free_bytes == SLOW_TOTAL);
  fprintf(stderr, "  region of 320 MiB made in %.2f s; another client's round trips meanwhile: "
          "%u, %u of them with the pages partway made\n", t, p.trips, p.during);
  CHECK(p.during > 0);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&slow) == 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  srand(9);
  /* No fresh memory: a borrower takes the owner's kept pages, and their bytes must come back. */
  static const char *const reserve[] = {"--reserve", "160M", NULL};
  if (sl_test_daemon_start_ex(&daemon_, PAGE, TOTAL,
                              &(struct sl_test_daemon_opts){.args = reserve}) != 0)
    return 1;
  sl_test_run("owners lend at once and wait their turn", test_owners_lend_at_once);
  sl_test_run("served in arrival order", test_served_in_arrival_order);
  sl_test_run("timeout and disconnect leave the line", test_timeout_and_disconnect_leave_the_line);
  sl_test_run("cancel a waiting lend", test_cancel_a_waiting_lend);
  sl_test_run("millions of keep ranges off the loop", test_millions_of_ranges_off_the_loop);
  sl_test_run("region pages made off the loop", test_region_pages_made_off_the_loop);
  if (sl_test_daemon_stop(&daemon_) != 0)
    sl_test_failed++;
  return sl_test_summary("queue");
}
