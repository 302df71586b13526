/* test_transport.c - what a hostile or careless client can take from subletd: nothing that
 * others need. Real daemons (memfd backend), real sockets, client processes.
 *
 * Deaf clients (flooding requests, reading nothing) and an fd hoarder (1,229 PagesGet over 4
 * connections, reading none) run beside a well-behaved client cycling loans: it is served
 * beside them, not after them, and never disconnected. The daemon runs as an unprivileged user
 * with a small open-files limit, so that the kernel's limit on fds in flight (ETOOMANYREFS:
 * charged to the daemon's user, shared by all its connections) is within the hoarder's reach.
 */
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "msg.h"
#include "raw.h"
#include "sublet.h"
#include "wire.h"

#define PAGE (64u << 10)
#define NOBODY 65534
#define HOARDER_UID 4242 /* another user than the good client's: fds are capped per user */
#define GOOD_PAIR 2 /* the well-behaved client's two connections */

static uint8_t pattern(uint64_t i) {
  return (uint8_t)((i * 2654435761u) >> 13);
}

/* Floods StatsGet and never reads, once connected (said on ready_fd); exits 0 once the
 * daemon has hung up on it. */
static void deaf_flooder(const char *path, int ready_fd) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__StatsGet stats = SUBLET__STATS_GET__INIT;
  struct sl_wire_rx rx;
  int fd = sl_raw_connect(path);

  sl_wire_rx_init(&rx);
  if (fd < 0 || sl_raw_hello(fd, &rx) != 0 || write(ready_fd, "x", 1) != 1)
    _exit(2);
  req.body_case = SUBLET__REQUEST__BODY_STATS_GET;
  req.stats_get = &stats;
  for (uint64_t id = 2;; id++) {
    req.id = id;
    if (sl_msg_send_request(fd, &req, NULL, 0, 20000, NULL) != 0)
      _exit(0); /* hung up on: what it should do */
  }
}

/* 4 connections of another user, each with a region of 16 pages, send 1,229 PagesGet of 16
 * pages in all and read no reply; they hold their sockets open until killed. */
static void fd_hoarder(const char *path, int ready_fd) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
  struct sl_wire_rx rx[4];
  int fds[4];

  if (sl_raw_become(HOARDER_UID) != 0)
    _exit(5);
  for (int i = 0; i < 4; i++) {
    sl_wire_rx_init(&rx[i]);
    fds[i] = sl_raw_connect(path);
    if (fds[i] < 0 || sl_raw_hello(fds[i], &rx[i]) != 0 ||
        (pg.region = sl_raw_region(fds[i], &rx[i], 2, 16 * PAGE)) == 0)
      _exit(3);
    pg.first = 0;
    pg.count = 16;
    req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
    req.pages_get = &pg;
    for (int k = 0; k < 1229 / 4 + (i < 1229 % 4); k++) {
      req.id = 3 + (uint64_t)k;
      if (sl_msg_send_request(fds[i], &req, NULL, 0, 2000, NULL) != 0)
        break; /* hung up on already */
    }
  }
  if (write(ready_fd, "x", 1) != 1)
    _exit(4);
  pause();
  _exit(0);
}

/* One loan between two connections of this process: lend with a kept range (pages 1 to 3 of
 * 8), borrow with the token, take the whole window (5 unkept pages, 4 of free memory, 3 kept:
 * fds of each kind), write over it, give it back, reclaim; the kept bytes must be back.
 * Returns 0 or the failing call's code. */
#define WINDOW (12 * PAGE)
static int loan_cycle(sublet_client *owner, sublet_client *borrower, sublet_region *r) {
  struct sublet_range keep = {PAGE + 100, 2 * PAGE};
  const uint8_t *base = sublet_region_addr(r);
  uint64_t loan;
  uint8_t token[16];
  void *p;
  int rc;

  if ((rc = sublet_lend(r, &keep, 1, 0, NULL, &loan, token)) != 0 ||
      (rc = sublet_borrow(borrower, loan, token, NULL, 0)) != 0 ||
      (rc = sublet_alloc(borrower, WINDOW, &p)) != 0)
    return rc;
  memset(p, 0xEE, WINDOW);
  if ((rc = sublet_free(borrower, p)) != 0 ||
      (rc = sublet_return(borrower, 0, NULL, NULL, 0, NULL)) != 0 ||
      (rc = sublet_reclaim(owner, loan, 5000, NULL)) != 0)
    return rc;
  for (uint64_t i = keep.offset; i < keep.offset + keep.length; i++)
    if (base[i] != pattern(i))
      return SUBLET_EIO;
  return 0;
}

/* The daemon's count of connected clients, every user's (-1: no status). */
static long clients(sublet_client *c) {
  char *json, *at;
  long n = -1;

  if (sublet_status_json(c, &json) != 0)
    return -1;
  if ((at = strstr(json, "\"clients\": ")) != NULL)
    n = strtol(at + strlen("\"clients\": "), NULL, 10);
  sublet_string_free(json);
  return n;
}

/* Cycles loans while the daemon counts more than `until` clients, or for `seconds` at most;
 * returns the worst cycle's time (for the log), *rc the first failure. *beside counts the
 * cycles after which the daemon still counted more than the good pair: served while another
 * client was still connected. */
static double cycle_while(sublet_client *owner, sublet_client *borrower, sublet_region *r,
                          long until, double seconds, int *cycles, int *beside, int *rc) {
  double start = sl_test_now(), worst = 0;

  *cycles = *beside = *rc = 0;
  while (sl_test_now() < start + seconds && *rc == 0 && clients(owner) > until) {
    double t0 = sl_test_now(), took;
    *rc = loan_cycle(owner, borrower, r);
    took = sl_test_now() - t0;
    worst = took > worst ? took : worst;
    if (getenv("SUBLET_TEST_SLOW") && took > 0.02)
      printf("  slow cycle at %.3f s: %.1f ms\n", t0 - start, took * 1e3);
    *beside += *rc == 0 && clients(owner) > GOOD_PAIR;
    (*cycles)++;
  }
  return worst;
}

static void test_hostile_clients_beside_a_good_one(void) {
  /* 256 pages: 64 for the hoarder's regions, 8 for the owner's, 4 free for the loan */
  static const char *const args[] = {"--reserve", "11796480", NULL};
  struct sl_test_daemon d;
  sublet_client *owner, *borrower;
  sublet_region *r;
  uint64_t size = 8 * PAGE;
  pid_t deaf[4], hoarder;
  double worst, quiet;
  int pipefd[2], status, cycles = 0, beside = 0, rc = 0;
  char x;

  CHECK(sl_test_daemon_start_ex(&d, PAGE, 256 * PAGE,
                                &(struct sl_test_daemon_opts){args, NOBODY, 2048}) == 0);
  chmod(d.dir, 0755); /* the hoarder is another user */
  chmod(d.socket, 0666);
  CHECK_RC(sublet_connect(d.socket, &owner), 0);
  CHECK_RC(sublet_connect(d.socket, &borrower), 0);
  CHECK_RC(sublet_region_create(owner, size, &r), 0);
  for (uint64_t i = 0; i < size; i++)
    ((uint8_t *)sublet_region_addr(r))[i] = pattern(i);
  /* Alone first: the worst cycle of a quiet daemon, for the log. */
  quiet = cycle_while(owner, borrower, r, 0, 1.0, &cycles, &beside, &rc);
  CHECK_RC(rc, 0);
  CHECK(pipe(pipefd) == 0);
  if ((hoarder = sl_test_child()) == 0)
    fd_hoarder(d.socket, pipefd[1]);
  CHECK(read(pipefd[0], &x, 1) == 1);
  for (int i = 0; i < 4; i++)
    if ((deaf[i] = sl_test_child()) == 0)
      deaf_flooder(d.socket, pipefd[1]);
  for (int i = 0; i < 4; i++) /* cycled from their flood on, not from their fork and connect */
    CHECK(read(pipefd[0], &x, 1) == 1);
  /* Cycles until the daemon has cut every hostile connection off (output nobody takes, fds
   * nobody receives: its patience runs out; 30 s: a hang guard). Those after which hostile
   * ones were still connected were served beside them: a daemon taken up by them (unbounded,
   * they cost seconds a cycle and disconnected the good client) serves the good one after
   * them, if at all. */
  worst = cycle_while(owner, borrower, r, GOOD_PAIR, 30.0, &cycles, &beside, &rc);
  printf("  %d loan cycles beside 4 deaf clients and an fd hoarder, %d of them before they were "
         "cut off: worst %.1f ms (%s); alone before: worst %.1f ms\n", cycles, beside,
         worst * 1e3, rc == 0 ? "all served" : sublet_last_error(), quiet * 1e3);
  CHECK_RC(rc, 0);
  CHECK(beside > 0);
  CHECK(clients(owner) == GOOD_PAIR);
  for (int i = 0; i < 4; i++) { /* each was hung up on */
    CHECK(waitpid(deaf[i], &status, 0) == deaf[i]);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  kill(hoarder, SIGKILL);
  waitpid(hoarder, &status, 0);
  CHECK_RC(loan_cycle(owner, borrower, r), 0);
  sublet_disconnect(borrower);
  sublet_disconnect(owner);
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* A frame begun and never finished costs its connection after the deadline (2 s), not the
 * daemon's memory for ever; others are served meanwhile. The order shows it: another client is
 * answered while the connection with the partial frame is still open and told nothing, then
 * that connection is cut off with an Error that names the deadline. */
static void test_partial_frame_deadline(void) {
  struct sl_test_daemon d;
  uint8_t head[SL_WIRE_HEADER];
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REQUEST,
                              SL_WIRE_MAX_PAYLOAD, 0};
  static uint8_t part[1u << 20];
  struct sublet_info info;
  sublet_client *c;
  struct pollfd pfd;
  double t0, took;
  char buf[4096];
  size_t got = 0;
  ssize_t n = -1;
  int fd;

  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  fd = sl_raw_connect(d.socket);
  CHECK(fd >= 0);
  sl_wire_header_encode(&h, head);
  CHECK(write(fd, head, sizeof(head)) == sizeof(head));
  CHECK(write(fd, part, sizeof(part)) == sizeof(part)); /* 1 MiB of 32 */
  t0 = sl_test_now();
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_get_info(c, &info), 0);
  pfd = (struct pollfd){.fd = fd, .events = POLLIN};
  CHECK(poll(&pfd, 1, 0) == 0); /* answered while the partial frame waits: not cut off yet */
  /* The Error that says why, then EOF; 30 s: a hang guard. */
  while (poll(&pfd, 1, 30000) == 1 && (n = read(fd, buf + got, sizeof(buf) - 1 - got)) > 0)
    got += (size_t)n;
  took = sl_test_now() - t0;
  buf[got] = '\0';
  printf("  a partial frame was cut off after %.2f s\n", took);
  CHECK(n == 0);
  CHECK(memmem(buf, got, "a frame stayed incomplete for 2000 ms", 37) != NULL);
  CHECK_RC(sublet_get_info(c, &info), 0); /* the other client was never disturbed */
  close(fd);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* Connections are capped per user: the one over the cap is told why, the others go on. */
static void test_connection_cap(void) {
  static const char *const args[] = {"--max-user-connections", "4", NULL};
  struct sl_test_daemon d;
  sublet_client *c[5];
  struct sublet_info info;

  CHECK(sl_test_daemon_start_ex(&d, PAGE, 64 * PAGE, &(struct sl_test_daemon_opts){.args = args}) == 0);
  for (int i = 0; i < 4; i++)
    CHECK_RC(sublet_connect(d.socket, &c[i]), 0);
  CHECK_RC(sublet_connect(d.socket, &c[4]), SUBLET_EBUSY);
  CHECK(strstr(sublet_last_error(), "limit per user") != NULL);
  for (int i = 0; i < 4; i++)
    CHECK_RC(sublet_get_info(c[i], &info), 0);
  sublet_disconnect(c[3]);
  CHECK_UNTIL(sl_test_status_number(c[0], "clients") == 3); /* the daemon counts the close */
  CHECK_RC(sublet_connect(d.socket, &c[3]), 0);
  for (int i = 0; i < 4; i++)
    sublet_disconnect(c[i]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* A flood of connections fills the daemon's fd table: the one that finds it full is told so
 * (a spare fd is given up to accept it), the connected clients go on, and once some leave, a
 * new one is served: accepting never stalls. */
static void test_fd_table_full(void) {
  struct sl_test_daemon d;
  struct sublet_info info;
  sublet_client *c[64], *late;
  int n = 0, rc = 0;

  CHECK(sl_test_daemon_start_ex(&d, PAGE, 64 * PAGE, &(struct sl_test_daemon_opts){.nofile = 64})
        == 0);
  while (n < 64 && (rc = sublet_connect(d.socket, &c[n])) == 0)
    n++;
  printf("  %d clients connected, the next one: %s\n", n, sublet_last_error());
  CHECK(n > 4 && n < 64);
  CHECK_RC(rc, SUBLET_ENOHOSTMEM);
  CHECK(strstr(sublet_last_error(), "file descriptor") != NULL);
  CHECK_RC(sublet_get_info(c[0], &info), 0);
  for (int i = n / 2; i < n; i++)
    sublet_disconnect(c[i]);
  /* The daemon closes them (their fds go back before it accepts again). */
  CHECK_UNTIL(sl_test_status_number(c[0], "clients") == n / 2);
  CHECK_RC(sublet_connect(d.socket, &late), 0);
  CHECK_RC(sublet_get_info(late, &info), 0);
  sublet_disconnect(late);
  for (int i = 0; i < n / 2; i++)
    sublet_disconnect(c[i]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* A call to a daemon that does not answer (SIGSTOP) fails with ETIMEDOUT at its deadline, and
 * says so; Reclaim's deadline is its own wait plus the same. The message names the deadline
 * the call kept; a call never gives up before it (a loaded machine can only make it later, so
 * only that side of the time is checked). */
static void test_stopped_daemon(void) {
  struct sl_test_daemon d;
  struct sublet_info info;
  sublet_client *a, *b, *c;
  double t0, took[3];
  char why[3][512];

  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  CHECK_RC(sublet_connect(d.socket, &a), 0);
  CHECK_RC(sublet_connect(d.socket, &b), 0);
  CHECK_RC(sublet_set_timeout(a, 300), 0);
  CHECK_RC(sublet_set_timeout(b, 300), 0);
  kill(d.pid, SIGSTOP);
  t0 = sl_test_now();
  CHECK_RC(sublet_get_info(a, &info), SUBLET_ETIMEDOUT);
  took[0] = sl_test_now() - t0;
  CHECK(strstr(sublet_last_error(), "did not answer") != NULL);
  CHECK(strstr(sublet_last_error(), d.socket) != NULL);
  snprintf(why[0], sizeof(why[0]), "%s", sublet_last_error());
  t0 = sl_test_now();
  CHECK_RC(sublet_reclaim(b, 1, 200, NULL), SUBLET_ETIMEDOUT);
  took[1] = sl_test_now() - t0;
  snprintf(why[1], sizeof(why[1]), "%s", sublet_last_error());
  setenv("SUBLET_TIMEOUT", "0.3", 1);
  t0 = sl_test_now();
  CHECK_RC(sublet_connect(d.socket, &c), SUBLET_ETIMEDOUT); /* accepted by the kernel, no Hello */
  took[2] = sl_test_now() - t0;
  snprintf(why[2], sizeof(why[2]), "%s", sublet_last_error());
  unsetenv("SUBLET_TIMEOUT");
  kill(d.pid, SIGCONT);
  printf("  stopped daemon: info after %.2f s, reclaim(200 ms) after %.2f s, connect after "
         "%.2f s\n", took[0], took[1], took[2]);
  CHECK(strstr(why[0], "within 0.3 s") != NULL);
  CHECK(strstr(why[1], "within 0.5 s") != NULL); /* 200 ms of its own, then 300 */
  CHECK(strstr(why[2], "within 0.3 s") != NULL);
  CHECK(took[0] >= 0.29 && took[1] >= 0.49 && took[2] >= 0.29); /* not before (ms rounding) */
  CHECK_RC(sublet_get_info(a, &info), SUBLET_EPIPE); /* the conversation was given up */
  sublet_disconnect(a);
  sublet_disconnect(b);
  CHECK_RC(sublet_connect(d.socket, &c), 0); /* it answers again */
  CHECK_RC(sublet_get_info(c, &info), 0);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* In a child: becomes uid (primary group uid) with the supplementary groups given, connects,
 * looks at the status and tries to borrow the loan. Exits 0 when what it sees and may do
 * matches `trusted`, else the step that differed. */
static int stranger(const char *path, uid_t uid, const gid_t *groups, size_t ngroups,
                    uint64_t loan, const uint8_t *token, int trusted) {
  sublet_client *c;
  char *json = NULL;
  void *p;
  int rc, sees;

  if (setgroups(ngroups, groups) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
    return 10;
  if (sublet_connect(path, &c) != 0 || sublet_status_json(c, &json) != 0)
    return 11;
  sees = strstr(json, "\"owner_uid\": 0") != NULL && strstr(json, "\"grp\"") != NULL;
  sublet_string_free(json);
  if (sees != trusted)
    return 12; /* a stranger sees nothing of root's regions and loan; the group sees all */
  rc = sublet_borrow(c, loan, token, NULL, 0);
  if (rc != (trusted ? 0 : SUBLET_EPERM))
    return 13;
  if (trusted && (sublet_alloc(c, PAGE, &p) != 0 || sublet_free(c, p) != 0 ||
                  sublet_return(c, 0, NULL, NULL, 0, NULL) != 0))
    return 14;
  sublet_disconnect(c);
  return 0;
}

/* --allow-group counts supplementary groups: a member whose primary group is another one may
 * borrow another user's loan and see its regions; a stranger may do neither. */
static void test_allowed_group_by_supplementary_membership(void) {
  static const char *const args[] = {"--allow-group", "4242", NULL};
  static const gid_t member[] = {4243, 4242}, other[] = {4243};
  struct sl_test_daemon d;
  sublet_client *owner;
  sublet_region *r;
  uint64_t loan;
  uint8_t token[16];
  int status;
  pid_t pid;

  if (geteuid() != 0) {
    printf("  skipped: needs root to become other users in a child\n");
    return;
  }
  CHECK(sl_test_daemon_start_ex(&d, PAGE, 64 * PAGE, &(struct sl_test_daemon_opts){.args = args}) == 0);
  chmod(d.dir, 0755);
  chmod(d.socket, 0666);
  CHECK_RC(sublet_connect(d.socket, &owner), 0);
  CHECK_RC(sublet_region_create(owner, 4 * PAGE, &r), 0);
  for (int round = 0; round < 2; round++) {
    int trusted = round == 1;
    CHECK_RC(sublet_lend(r, NULL, 0, 1, "grp", &loan, token), 0);
    if ((pid = sl_test_child()) == 0)
      _exit(stranger(d.socket, trusted ? 2000 : 3000, trusted ? member : other,
                     trusted ? 2 : 1, loan, token, trusted));
    CHECK(waitpid(pid, &status, 0) == pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
      fprintf(stderr, "  the %s child failed at step %d\n", trusted ? "member" : "stranger",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (trusted)
      CHECK_RC(sublet_reclaim(owner, loan, 5000, NULL), 0);
    else
      CHECK_RC(sublet_withdraw(owner, loan), 0);
  }
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(owner);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* SIGHUP (a closed terminal, a reload by habit) leaves the daemon serving, its loan going on. */
static void test_sighup_is_harmless(void) {
  struct sl_test_daemon d;
  struct sublet_info info;
  sublet_client *c;
  sublet_region *r;
  uint64_t loan;

  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &loan, NULL), 0);
  kill(d.pid, SIGHUP);
  usleep(100000);
  CHECK_RC(sublet_get_info(c, &info), 0);
  CHECK_RC(sublet_withdraw(c, loan), 0);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  sl_test_run("hostile clients beside a good one", test_hostile_clients_beside_a_good_one);
  sl_test_run("partial frame deadline", test_partial_frame_deadline);
  sl_test_run("connection cap", test_connection_cap);
  sl_test_run("fd table full", test_fd_table_full);
  sl_test_run("stopped daemon", test_stopped_daemon);
  sl_test_run("SIGHUP is harmless", test_sighup_is_harmless);
  sl_test_run("allowed group by supplementary membership",
              test_allowed_group_by_supplementary_membership);
  return sl_test_summary("transport");
}
