/* test_isolation.c - what one user can take from another through subletd's shared budgets
 * (issue 25, items 4, 5, 6, 8, 10 and 12): fds in flight, the host work queue, decoded
 * requests, receive buffers, connections and what refusals say. Real daemons (memfd backend),
 * real sockets, hostile clients as real separate users (children that setuid), beside a
 * well-behaved client of another user. Each test failed before its fix: the good client timed
 * out, waited seconds, was cut off, refused, or was told another user's ids.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "msg.h"
#include "raw.h"
#include "sublet.h"
#include "wire.h"

#define PAGE (64u << 10)
#define MiB (1ull << 20)

static uint8_t pattern(uint64_t i) {
  return (uint8_t)((i * 2654435761u) >> 13);
}

/* Its exit code, or -1. */
static int wait_exit(pid_t pid) {
  int status;

  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
    return -1;
  return WEXITSTATUS(status);
}

static int start_as(struct sl_test_daemon *d, uint64_t pages, const char *const *args,
                    uid_t uid, unsigned nofile) {
  if (sl_test_daemon_start_ex(d, PAGE, pages * PAGE,
                              &(struct sl_test_daemon_opts){args, uid, nofile}) != 0)
    return -1;
  chmod(d->dir, 0755); /* the other users' clients connect too */
  chmod(d->socket, 0666);
  return 0;
}

/* The peak of the process's resident memory (VmHWM), in KiB. */
static long peak_kib(pid_t pid) {
  char path[64], line[256];
  long kib = -1;
  FILE *f;

  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  if ((f = fopen(path, "r")) == NULL)
    return -1;
  while (fgets(line, sizeof(line), f) != NULL)
    if (sscanf(line, "VmHWM: %ld", &kib) == 1)
      break;
  fclose(f);
  return kib;
}

/* ------------------------------------------------------------------ a good client's loans */

struct good {
  sublet_client *owner, *borrower;
  sublet_region *r;
};

static int good_start(struct good *g, const char *path, int timeout_ms) {
  uint8_t *p;

  if (sublet_connect(path, &g->owner) != 0 || sublet_connect(path, &g->borrower) != 0 ||
      sublet_set_timeout(g->owner, timeout_ms) != 0 ||
      sublet_set_timeout(g->borrower, timeout_ms) != 0 ||
      sublet_region_create(g->owner, 8 * PAGE, &g->r) != 0)
    return -1;
  p = sublet_region_addr(g->r);
  for (uint64_t i = 0; i < 8 * PAGE; i++)
    p[i] = pattern(i);
  return 0;
}

static void good_stop(struct good *g) {
  sublet_disconnect(g->borrower);
  sublet_disconnect(g->owner);
}

/* One loan: lend keeping pages 1 to 3, borrow with the token, take 4 unkept pages (their
 * fds come in replies), write, give back, reclaim, the kept bytes intact. 0 or the code. */
static int loan_cycle_waiting(struct good *g, int lend_ms) {
  struct sublet_range keep = {PAGE + 100, 2 * PAGE};
  const uint8_t *base = sublet_region_addr(g->r);
  uint8_t token[16];
  uint64_t loan;
  void *p;
  int rc;

  if ((rc = sublet_lend_wait(g->r, &keep, 1, 0, NULL, lend_ms, &loan, token)) != 0 ||
      (rc = sublet_borrow(g->borrower, loan, token, NULL, 0)) != 0 ||
      (rc = sublet_alloc(g->borrower, 4 * PAGE, &p)) != 0)
    return rc;
  memset(p, 0xEE, 4 * PAGE);
  if ((rc = sublet_free(g->borrower, p)) != 0 ||
      (rc = sublet_return(g->borrower, 0, NULL, NULL, 0, NULL)) != 0 ||
      (rc = sublet_reclaim(g->owner, loan, 5000, NULL)) != 0)
    return rc;
  for (uint64_t i = keep.offset; i < keep.offset + keep.length; i++)
    if (base[i] != pattern(i))
      return SUBLET_EIO;
  return 0;
}

/* The Lend at once (EBUSY while the device is lent). */
static int loan_cycle(struct good *g) {
  return loan_cycle_waiting(g, 0);
}

/* Cycles for `seconds`: the worst cycle's time; *rc the first failure. */
static double cycle_for(struct good *g, double seconds, int *cycles, int *rc) {
  double start = sl_test_now(), worst = 0;

  for (*cycles = 0, *rc = 0; sl_test_now() < start + seconds && *rc == 0; (*cycles)++) {
    double t0 = sl_test_now(), took;
    *rc = loan_cycle(g);
    took = sl_test_now() - t0;
    worst = took > worst ? took : worst;
  }
  return worst;
}

/* ------------------------------------------------------------------ item 4: fds in flight */

#define FD_DAEMON_UID 4100
#define FD_HOARDER_UID 4101
#define HOARD_CONNS 16

/* 16 connections of another user, each with a region of 16 pages, ask for its pages 20 times
 * (5,120 fds in all) and read nothing; the sockets stay open until killed. */
static void fd_hoarder(const char *path, int ready_fd) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
  struct sl_wire_rx rx;

  if (sl_raw_become(FD_HOARDER_UID) != 0)
    _exit(5);
  for (int i = 0; i < HOARD_CONNS; i++) {
    int fd = sl_raw_connect(path);
    sl_wire_rx_init(&rx);
    if (fd < 0 || sl_raw_hello(fd, &rx) != 0 ||
        (pg.region = sl_raw_region(fd, &rx, 2, 16 * PAGE)) == 0)
      _exit(6);
    pg.first = 0;
    pg.count = 16;
    req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
    req.pages_get = &pg;
    for (int k = 0; k < 20; k++) {
      req.id = 3 + (uint64_t)k;
      if (sl_raw_send(fd, &req, NULL, 0) != 0)
        break; /* hung up on already */
    }
  }
  if (write(ready_fd, "x", 1) != 1)
    _exit(7);
  pause();
  _exit(0);
}

/* The daemon runs as its own user with 2,048 open files, so the kernel refuses fds in flight
 * past 2,048 for it (ETOOMANYREFS). Capped per connection only (253), the hoarder's 16
 * connections took 4,048: every reply with fds waited, and the good client timed out. Now
 * every cycle is served while the hoard stands: a reply whose fds the kernel refused would
 * fail the cycle after the daemon's 2 s patience (EBUSY), and one that waited would run into
 * the client's deadline (a hang guard, far past that patience). */
static void test_fd_hoard_of_one_user(void) {
  struct sl_test_daemon d;
  struct good g;
  double worst;
  int pipefd[2], cycles, rc;
  pid_t hoarder;
  char x;

  CHECK(start_as(&d, 512, NULL, FD_DAEMON_UID, 2048) == 0);
  CHECK(good_start(&g, d.socket, 30000) == 0);
  CHECK(pipe(pipefd) == 0);
  if ((hoarder = sl_test_child()) == 0)
    fd_hoarder(d.socket, pipefd[1]);
  CHECK(read(pipefd[0], &x, 1) == 1);
  worst = cycle_for(&g, 4.0, &cycles, &rc); /* past the daemon's 2 s patience */
  printf("  %d loan cycles beside another user's fd hoard: worst %.1f ms (%s)\n", cycles,
         worst * 1e3, rc == 0 ? "all served" : sublet_last_error());
  CHECK_RC(rc, 0);
  CHECK(cycles > 0);
  sl_test_reap(hoarder);
  CHECK_RC(loan_cycle(&g), 0);
  good_stop(&g);
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

#define REFS_DAEMON_UID 4110

/* Another process of the daemon's user takes the kernel's budget of fds in flight for that
 * user: it sends 253 fds at a time into a socket it never reads until the kernel refuses.
 * Says on ready_fd how many it sent (0: the kernel never refused). */
static void refs_hog(int ready_fd) {
  char byte = 'x', ctl[CMSG_SPACE(sizeof(int) * SL_WIRE_MAX_FDS)];
  int sv[2], fds[SL_WIRE_MAX_FDS], null_fd, sent = 0, refused = 0;

  setrlimit(RLIMIT_NOFILE, &(struct rlimit){2048, 2048});
  if (sl_raw_become(REFS_DAEMON_UID) != 0 || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 ||
      (null_fd = open("/dev/null", O_RDONLY)) < 0)
    _exit(5);
  for (int i = 0; i < SL_WIRE_MAX_FDS; i++)
    fds[i] = null_fd;
  for (int i = 0; i < 40 && !refused; i++) {
    struct iovec iov = {&byte, 1};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                         .msg_controllen = sizeof(ctl)};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(fds));
    memcpy(CMSG_DATA(c), fds, sizeof(fds));
    if (sendmsg(sv[0], &msg, MSG_DONTWAIT) == 1)
      sent += SL_WIRE_MAX_FDS;
    else
      refused = errno == ETOOMANYREFS;
  }
  sent = refused ? sent : 0;
  if (write(ready_fd, &sent, sizeof(sent)) != sizeof(sent))
    _exit(6);
  pause();
  _exit(0);
}

/* A reply whose fds the kernel refuses (ETOOMANYREFS, the budget spent by another process of
 * the daemon's user) waited with no deadline: the client's call ran to its own. It fails after
 * the daemon's 2 s now, typed and saying what to raise; the daemon serves on. The client's
 * deadline is a hang guard: running into it would be ETIMEDOUT, not the daemon's EBUSY. */
static void test_fds_refused_by_the_kernel(void) {
  struct sl_test_daemon d;
  struct good g;
  double t0, took;
  int pipefd[2], sent = 0, rc;
  pid_t hog;

  CHECK(start_as(&d, 64, NULL, REFS_DAEMON_UID, 2048) == 0);
  CHECK(good_start(&g, d.socket, 30000) == 0);
  CHECK_RC(loan_cycle(&g), 0);
  CHECK(pipe(pipefd) == 0);
  if ((hog = sl_test_child()) == 0)
    refs_hog(pipefd[1]);
  CHECK(read(pipefd[0], &sent, sizeof(sent)) == sizeof(sent));
  if (sent == 0) {
    printf("  skipped: this kernel does not limit fds in flight per user\n");
    sl_test_reap(hog);
    good_stop(&g);
    CHECK(sl_test_daemon_stop(&d) == 0);
    return;
  }
  t0 = sl_test_now();
  rc = loan_cycle(&g);
  took = sl_test_now() - t0;
  printf("  with %d fds in flight for the daemon's user: %.2f s, %s\n", sent, took,
         sublet_last_error());
  CHECK_RC(rc, SUBLET_EBUSY);
  CHECK(strstr(sublet_last_error(), "LimitNOFILE") != NULL);
  sl_test_reap(hog);
  good_stop(&g);
  CHECK(good_start(&g, d.socket, 30000) == 0);
  CHECK_RC(loan_cycle(&g), 0);
  good_stop(&g);
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ item 5: host work */

/* Issue 25 item 5 (one job queue for all: another user's calls waited behind every long keep
 * list, 27 to 29 s) and issue 41 item 4 (a Lend kept its place in the device's line while its
 * keep list was read and sorted: another user's loan cycle waited for those drafts, about
 * 2 s). Shown by order: what the victim gets done while the attacker's drafts go on. */

#define JOBS_ATTACKER_UID 4201
#define JOBS_CONNS 6
/* 32 MiB a list: the attacker's 6 fit its 256 MiB of large requests in progress, so each Lend
 * it sends is drafted (none refused before its draft), each draft a long sort. */
#define JOBS_RANGES (1u << 21)
#define JOBS_REGION (2ull * JOBS_RANGES) /* room for them, one byte in two */
#define VICTIM_CYCLES 10

/* A memfd of JOBS_RANGES one-byte ranges at even offsets, shuffled: a costly sort. */
static int shuffled_keep_memfd(void) {
  uint64_t *v = malloc(2 * JOBS_RANGES * sizeof(uint64_t)), state = 88172645463325252ull;
  int fd = memfd_create("test-keep", MFD_CLOEXEC);
  size_t bytes = 2 * JOBS_RANGES * sizeof(uint64_t);

  if (v == NULL || fd < 0)
    return -1;
  for (uint64_t i = 0; i < JOBS_RANGES; i++) {
    v[2 * i] = 2 * i;
    v[2 * i + 1] = 1;
  }
  for (uint64_t i = JOBS_RANGES - 1; i > 0; i--) {
    uint64_t j, a, b;
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    j = state % (i + 1);
    a = v[2 * i], b = v[2 * j];
    v[2 * i] = b, v[2 * j] = a;
  }
  if (write(fd, v, bytes) != (ssize_t)bytes)
    return -1;
  free(v);
  return fd;
}

/* A Lend of the whole list that waits its turn for as long as it takes. */
static int send_long_lend(int fd, uint64_t id, uint64_t region, int keep_fd) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;

  m.region = region;
  m.has_keep_fd_ranges = 1;
  m.keep_fd_ranges = JOBS_RANGES;
  m.has_timeout_ms = 1;
  m.timeout_ms = -1;
  req.id = id;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  return sl_raw_send(fd, &req, &keep_fd, 1);
}

/* The attacker's answer on one connection: a Lent (drafted: written to drafted_fd, withdrawn)
 * or a refusal before any draft (EBUSY: its large requests' limit); then its next Lend. */
static void long_lists_answer(int fd, struct sl_wire_rx *rx, Sublet__Reply *rep, uint64_t *id,
                              uint64_t region, int keep_fd, int drafted_fd) {
  Sublet__Request wd = SUBLET__REQUEST__INIT;
  Sublet__Withdraw w = SUBLET__WITHDRAW__INIT;

  if (rep->body_case == SUBLET__REPLY__BODY_LENT) {
    w.loan = rep->lent->loan;
    wd.id = (*id)++;
    wd.body_case = SUBLET__REQUEST__BODY_WITHDRAW;
    wd.withdraw = &w;
    if (write(drafted_fd, "d", 1) != 1 || sl_raw_send(fd, &wd, NULL, 0) != 0)
      _exit(8);
    sublet__reply__free_unpacked(rep, NULL);
    if ((rep = sl_raw_reply(fd, rx, 30000)) == NULL)
      _exit(8);
  } else if (rep->body_case != SUBLET__REPLY__BODY_ERROR || rep->error->code != SUBLET_EBUSY) {
    _exit(10);
  } else {
    usleep(1000);
  }
  sublet__reply__free_unpacked(rep, NULL);
  if (send_long_lend(fd, (*id)++, region, keep_fd) != 0)
    _exit(9);
}

/* Connections of another user keep a Lend with a long keep list each in subletd's hands: as
 * soon as one is answered it is sent again (a loan lent is withdrawn first). */
static void long_lists(const char *path, int keep_fd, int ready_fd, int drafted_fd) {
  struct sl_wire_rx rx[JOBS_CONNS];
  uint64_t region[JOBS_CONNS], id = 10;
  int fds[JOBS_CONNS];

  if (sl_raw_become(JOBS_ATTACKER_UID) != 0)
    _exit(5);
  for (int i = 0; i < JOBS_CONNS; i++) {
    sl_wire_rx_init(&rx[i]);
    if ((fds[i] = sl_raw_connect(path)) < 0 || sl_raw_hello(fds[i], &rx[i]) != 0 ||
        (region[i] = sl_raw_region(fds[i], &rx[i], 2, JOBS_REGION)) == 0 ||
        send_long_lend(fds[i], id++, region[i], keep_fd) != 0)
      _exit(6);
  }
  if (write(ready_fd, "x", 1) != 1)
    _exit(7);
  for (;;) {
    struct pollfd p[JOBS_CONNS];
    for (int i = 0; i < JOBS_CONNS; i++)
      p[i] = (struct pollfd){fds[i], POLLIN, 0};
    if (poll(p, JOBS_CONNS, -1) < 0)
      _exit(11);
    for (int i = 0; i < JOBS_CONNS; i++) {
      Sublet__Reply *rep;
      if ((p[i].revents & POLLIN) && (rep = sl_raw_reply(fds[i], &rx[i], 30000)) != NULL)
        long_lists_answer(fds[i], &rx[i], rep, &id, region[i], keep_fd, drafted_fd);
    }
  }
}

/* The attacker's Lends drafted (and lent) so far: what drafted_fd (non-blocking) has said. */
static int drafted(int drafted_fd, int *count) {
  char buf[64];
  ssize_t n;

  while ((n = read(drafted_fd, buf, sizeof(buf))) > 0)
    *count += (int)n;
  return *count;
}

/* One Lend of the longest list as the victim's user would make it: 0 once it is answered. */
static int one_long_lend(const char *path, int keep_fd) {
  struct sl_wire_rx rx;
  Sublet__Reply *rep = NULL;
  uint64_t region;
  int fd = sl_raw_connect(path), rc = -1;

  sl_wire_rx_init(&rx);
  if (fd >= 0 && sl_raw_hello(fd, &rx) == 0 &&
      (region = sl_raw_region(fd, &rx, 2, JOBS_REGION)) != 0 &&
      send_long_lend(fd, 3, region, keep_fd) == 0 && (rep = sl_raw_reply(fd, &rx, 60000)) != NULL)
    rc = rep->body_case == SUBLET__REPLY__BODY_LENT ? 0 : 1;
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  sl_wire_rx_destroy(&rx);
  if (fd >= 0)
    close(fd);
  return rc;
}

/* Another user keeps 6 long keep lists in subletd's hands, each drafted in turn (a long sort)
 * then lent and withdrawn. The victim's loan cycles (a region made and released, a Lend that
 * waits its turn, a borrow, an allocation, the return and the reclaim) need no draft: 10 of
 * them are done while fewer than 6 of the attacker's drafts are. Before, the victim's Lend
 * waited in the device's line behind every attacker Lend whose draft was pending (its first
 * cycle alone took all 6). Its own long list waits for one attacker job at most (users take
 * turns), not for the queue: fewer than 6 attacker drafts are done meanwhile. */
static void test_long_keep_lists_of_one_user(void) {
  struct sl_test_daemon d;
  struct good g;
  sublet_region *r;
  int ready[2], drafts[2], keep_fd = shuffled_keep_memfd(), count = 0, at, cycles = 0;
  int during_own;
  pid_t attacker;
  char x;

  CHECK(keep_fd >= 0);
  CHECK(start_as(&d, 4096, NULL, 0, 0) == 0);
  CHECK(good_start(&g, d.socket, 30000) == 0); /* the deadline: a hang guard */
  CHECK(pipe(ready) == 0 && pipe(drafts) == 0);
  CHECK(fcntl(drafts[0], F_SETFL, O_NONBLOCK) == 0);
  if ((attacker = sl_test_child()) == 0)
    long_lists(d.socket, keep_fd, ready[1], drafts[1]);
  CHECK(read(ready[0], &x, 1) == 1);
  at = drafted(drafts[0], &count);
  while (cycles < VICTIM_CYCLES && drafted(drafts[0], &count) - at < JOBS_CONNS) {
    CHECK_RC(sublet_region_create(g.owner, 4 * PAGE, &r), 0);
    CHECK_RC(sublet_region_release(r), 0);
    CHECK_RC(loan_cycle_waiting(&g, 30000), 0);
    cycles++;
  }
  printf("  the victim's loan cycles: %d while the attacker's drafts done went %d -> %d\n",
         cycles, at, count);
  CHECK(cycles == VICTIM_CYCLES);
  at = drafted(drafts[0], &count);
  CHECK(one_long_lend(d.socket, keep_fd) == 0);
  during_own = drafted(drafts[0], &count) - at;
  printf("  the attacker's drafts done during the victim's own long Lend: %d\n", during_own);
  CHECK(during_own < JOBS_CONNS);
  sl_test_reap(attacker);
  good_stop(&g);
  close(keep_fd);
  for (int i = 0; i < 2; i++)
    close(ready[i]), close(drafts[i]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ item 6: decoded size */

/* Sends a payload as a request frame and reads the reply: its code (0 when no Error), and
 * the id it answered; -1000 when none came. */
static int send_payload(int fd, struct sl_wire_rx *rx, const uint8_t *p, size_t len,
                        uint64_t *id, char *msg, size_t msg_size) {
  Sublet__Reply *rep;
  int code;

  if (sl_wire_send(fd, SL_WIRE_REQUEST, p, len, NULL, 0, 10000, NULL) != 0 ||
      (rep = sl_raw_reply(fd, rx, 20000)) == NULL)
    return -1000;
  *id = rep->id;
  code = rep->body_case == SUBLET__REPLY__BODY_ERROR ? rep->error->code : 0;
  snprintf(msg, msg_size, "%s", code != 0 && rep->error->message ? rep->error->message : "");
  sublet__reply__free_unpacked(rep, NULL);
  return code;
}

/* The connection answers a StatsGet. */
static int still_talking(int fd, struct sl_wire_rx *rx) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__StatsGet sg = SUBLET__STATS_GET__INIT;
  Sublet__Reply *rep;
  int ok;

  req.id = 90;
  req.body_case = SUBLET__REQUEST__BODY_STATS_GET;
  req.stats_get = &sg;
  if (sl_raw_send(fd, &req, NULL, 0) != 0 || (rep = sl_raw_reply(fd, rx, 5000)) == NULL)
    return 0;
  ok = rep->id == 90;
  sublet__reply__free_unpacked(rep, NULL);
  return ok;
}

/* A Lend of 8 MiB of packed one-byte varints (8 million keep values, 64 MiB decoded). */
static uint8_t *varint_flood(size_t *len) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;
  size_t n = 8 * MiB;
  uint64_t *keep = malloc(n * sizeof(uint64_t));
  uint8_t *buf = NULL;

  for (size_t i = 0; keep != NULL && i < n; i++)
    keep[i] = 1;
  m.region = 1;
  m.keep = keep;
  m.n_keep = n;
  req.id = 77;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  if (keep != NULL && sl_msg_pack(&req.base, &buf, len, NULL) != 0)
    buf = NULL;
  free(keep);
  return buf;
}

/* A Request of id 78 and 1.4 million tiny unknown fields (field 1000, varint 0): 4 MiB. */
static uint8_t *unknown_flood(size_t *len) {
  size_t n = 4 * MiB / 3;
  uint8_t *buf = malloc(2 + 3 * n);

  if (buf == NULL)
    return NULL;
  buf[0] = 0x08; /* field 1 (id), varint */
  buf[1] = 78;
  for (size_t i = 0; i < n; i++) {
    buf[2 + 3 * i] = 0xC0; /* field 1000, varint: key 8000 */
    buf[3 + 3 * i] = 0x3E;
    buf[4 + 3 * i] = 0x00;
  }
  *len = 2 + 3 * n;
  return buf;
}

/* Decoded without bound, 8 MiB of varints took 64 MiB of the daemon's memory and a flood of
 * unknown fields more. Now past a request's limit it is refused, typed, with its id, before
 * the memory is taken, and the conversation goes on. */
static void test_decoded_size_bound(void) {
  struct sl_test_daemon d;
  struct sl_wire_rx rx;
  struct sublet_info info;
  sublet_client *c;
  size_t len[2];
  uint8_t *flood[2] = {varint_flood(&len[0]), unknown_flood(&len[1])};
  uint64_t id = 0;
  long peak0, peak1;
  char msg[512] = "";
  int fd, code;

  CHECK(flood[0] != NULL && flood[1] != NULL);
  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  fd = sl_raw_connect(d.socket);
  sl_wire_rx_init(&rx);
  CHECK(fd >= 0 && sl_raw_hello(fd, &rx) == 0);
  peak0 = peak_kib(d.pid);
  for (int i = 0; i < 2; i++) {
    code = send_payload(fd, &rx, flood[i], len[i], &id, msg, sizeof(msg));
    printf("  %s of %zu bytes: %d, id %llu, %s\n", i == 0 ? "varints" : "unknown fields",
           len[i], code, (unsigned long long)id, msg);
    CHECK_RC(code, SUBLET_E2BIG);
    CHECK(id == 77u + (unsigned)i);
    CHECK(strstr(msg, "keep_fd_ranges") != NULL);
  }
  peak1 = peak_kib(d.pid);
  printf("  the daemon's peak memory grew by %ld KiB\n", peak1 - peak0);
#ifndef __SANITIZE_ADDRESS__ /* ASan's own cost of each allocation is not counted */
  CHECK(peak1 - peak0 < 48 * 1024); /* the frames and their copies; 64 MiB more decoded */
#endif
  CHECK(still_talking(fd, &rx));
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_get_info(c, &info), 0);
  sublet_disconnect(c);
  sl_wire_rx_destroy(&rx);
  close(fd);
  free(flood[0]);
  free(flood[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ item 8: receive buffers */

/* Has the daemon read all that was written on each of the n sockets (none left queued)? */
static int all_read(const int *fds, int n) {
  for (int i = 0; i < n; i++) {
    int queued;
    if (ioctl(fds[i], SIOCOUTQ, &queued) != 0 || queued != 0)
      return 0;
  }
  return 1;
}

/* Four connections each begin a frame of the largest size and send all of it but a byte:
 * their buffers fill the uid's 128 MiB. Then a small client of the same uid says Hello. The
 * small one was cut off; now the connection that holds the most is, told why. */
static void test_receive_buffers_cut_the_holder(void) {
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REQUEST,
                              SL_WIRE_MAX_PAYLOAD, 0};
  uint8_t head[SL_WIRE_HEADER];
  uint8_t *part = calloc(1, SL_WIRE_MAX_PAYLOAD);
  struct sl_test_daemon d;
  struct sublet_info info;
  sublet_client *c;
  int holders[4], told = 0, rc;
  double t0;

  CHECK(part != NULL);
  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  sl_wire_header_encode(&h, head);
  t0 = sl_test_now();
  for (int i = 0; i < 4; i++) {
    holders[i] = sl_raw_connect(d.socket);
    CHECK(holders[i] >= 0);
    CHECK(write(holders[i], head, sizeof(head)) == sizeof(head));
    CHECK(write(holders[i], part, SL_WIRE_MAX_PAYLOAD - 1) == SL_WIRE_MAX_PAYLOAD - 1);
  }
  CHECK_UNTIL(all_read(holders, 4)); /* the daemon has read them (or cut them off) */
  rc = sublet_connect(d.socket, &c);
  printf("  the small client, %.2f s after the first holder began: %s\n", sl_test_now() - t0,
         rc == 0 ? "served" : sublet_last_error());
  if (sl_test_now() - t0 > 1.5) { /* the holders' 2 s for a frame may have passed: no test then */
    printf("  skipped: this machine took too long to fill the buffers\n");
    if (rc == 0)
      sublet_disconnect(c);
    for (int i = 0; i < 4; i++)
      close(holders[i]);
    free(part);
    CHECK(sl_test_daemon_stop(&d) == 0);
    return;
  }
  CHECK_RC(rc, 0);
  CHECK_RC(sublet_get_info(c, &info), 0);
  for (int i = 0; i < 4; i++) {
    char buf[4096];
    struct pollfd p = {holders[i], POLLIN, 0};
    ssize_t n = poll(&p, 1, 200) == 1 ? read(holders[i], buf, sizeof(buf) - 1) : -1;
    if (n > SL_WIRE_HEADER) {
      buf[n] = 0;
      told += memmem(buf, (size_t)n, "held the most", 13) != NULL;
    }
  }
  printf("  holders told they held the most: %d\n", told);
  CHECK(told == 1);
  sublet_disconnect(c);
  for (int i = 0; i < 4; i++)
    close(holders[i]);
  free(part);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ item 10: connections */

#define CONNS_HOG_UID 4301

/* Connects as another user until refused; says how many it got and whether the refusal
 * named the reserve, then holds them. */
static void conn_hog(const char *path, int ready_fd) {
  sublet_client *c[32];
  int n = 0, said[2];

  if (sl_raw_become(CONNS_HOG_UID) != 0)
    _exit(5);
  while (n < 32 && sublet_connect(path, &c[n]) == 0)
    n++;
  said[0] = n;
  said[1] = strstr(sublet_last_error(), "kept for users") != NULL;
  if (write(ready_fd, said, sizeof(said)) != sizeof(said))
    _exit(6);
  pause();
  _exit(0);
}

/* With room for 8 connections, one user took all 8 and the next user was refused. The last
 * of them are kept for users with few connections now: the hog gets 7, another user gets in. */
static void test_connection_reserve(void) {
  static const char *const args[] = {"--max-connections", "8", "--max-user-connections",
                                     "100", NULL};
  struct sl_test_daemon d;
  struct sublet_info info;
  sublet_client *c;
  int pipefd[2], said[2];
  pid_t hog;

  CHECK(start_as(&d, 64, args, 0, 0) == 0);
  CHECK(pipe(pipefd) == 0);
  if ((hog = sl_test_child()) == 0)
    conn_hog(d.socket, pipefd[1]);
  CHECK(read(pipefd[0], said, sizeof(said)) == sizeof(said));
  printf("  one user got %d of 8 connections\n", said[0]);
  CHECK(said[0] == 7);
  CHECK(said[1]);
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(sublet_get_info(c, &info), 0);
  sublet_disconnect(c);
  sl_test_reap(hog);
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ item 12: refusals */

#define STRANGER_UID 4401

struct secrets {
  uint64_t loan, region, owner_client;
  uint8_t token[16];
};

/* Whether msg names what status hides from the stranger: the owner's uid, client, region
 * (unless asked by id), loan (unless asked by id). Prints the leak. */
static int leaks(const char *what, const char *msg, const struct secrets *s, int asked_ids) {
  char client[48], loan[48], region[48];
  int bad;

  snprintf(client, sizeof(client), "client %llu", (unsigned long long)s->owner_client);
  snprintf(loan, sizeof(loan), "loan %llu", (unsigned long long)s->loan);
  snprintf(region, sizeof(region), "region %llu", (unsigned long long)s->region);
  bad = strstr(msg, "uid 0") != NULL || strstr(msg, client) != NULL ||
        (!asked_ids && (strstr(msg, loan) != NULL || strstr(msg, region) != NULL));
  if (bad)
    fprintf(stderr, "  %s told the stranger: %s\n", what, msg);
  return bad;
}

/* A raw request on the stranger's connection: the refusal's message into msg. */
static int raw_refusal(int fd, struct sl_wire_rx *rx, Sublet__Request *req, char *msg,
                       size_t size) {
  Sublet__Reply *rep;
  int code = -1;

  msg[0] = 0;
  if (sl_raw_send(fd, req, NULL, 0) == 0 && (rep = sl_raw_reply(fd, rx, 5000)) != NULL) {
    if (rep->body_case == SUBLET__REPLY__BODY_ERROR) {
      code = rep->error->code;
      snprintf(msg, size, "%s", rep->error->message ? rep->error->message : "");
    }
    sublet__reply__free_unpacked(rep, NULL);
  }
  return code;
}

/* The stranger's raw requests on the owner's region: release it, take its pages. */
static int stranger_raw(const char *path, const struct secrets *s) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionRelease rr = SUBLET__REGION_RELEASE__INIT;
  Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
  struct sl_wire_rx rx;
  char msg[512];
  int fd = sl_raw_connect(path), n = 0;

  sl_wire_rx_init(&rx);
  if (fd < 0 || sl_raw_hello(fd, &rx) != 0)
    return 20;
  rr.region = pg.region = s->region;
  pg.count = 1;
  req.id = 2;
  req.body_case = SUBLET__REQUEST__BODY_REGION_RELEASE;
  req.region_release = &rr;
  n += raw_refusal(fd, &rx, &req, msg, sizeof(msg)) != SUBLET_ENOENT || /* as if missing */
       leaks("RegionRelease", msg, s, 1);
  req.id = 3;
  req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
  req.pages_get = &pg;
  n += raw_refusal(fd, &rx, &req, msg, sizeof(msg)) != SUBLET_ENOENT ||
       leaks("PagesGet", msg, s, 1);
  sl_wire_rx_destroy(&rx);
  close(fd);
  return n;
}

/* In the stranger's process: every refusal it gets about root's loan and region. Exits with
 * the number of refusals that said too much (or failed otherwise). */
static int stranger(const char *path, const struct secrets *s) {
  sublet_client *c;
  sublet_region *mine;
  uint8_t wrong[16] = {0};
  uint64_t loan;
  int n = 0;

  if (sl_raw_become(STRANGER_UID) != 0 || sublet_connect(path, &c) != 0)
    return 100;
  n += sublet_borrow(c, 0, NULL, "secret-name", 0) == 0 ||
       leaks("borrow by name", sublet_last_error(), s, 0);
  n += sublet_borrow(c, 0, NULL, NULL, 0) == 0 || leaks("borrow next", sublet_last_error(), s, 0);
  n += sublet_borrow(c, s->loan, wrong, NULL, 0) != SUBLET_ENOENT || /* as if missing */
       leaks("borrow, wrong token", sublet_last_error(), s, 1);
  n += sublet_borrow(c, s->loan, s->token, NULL, 0) != SUBLET_EPERM || /* it was given it */
       leaks("borrow with the token", sublet_last_error(), s, 1);
  n += sublet_withdraw(c, s->loan) != SUBLET_ENOENT ||
       leaks("withdraw", sublet_last_error(), s, 1);
  if (sublet_region_create(c, PAGE, &mine) != 0)
    return 101;
  n += sublet_lend(mine, NULL, 0, 1, NULL, &loan, NULL) != SUBLET_EBUSY ||
       leaks("lend while the device is lent", sublet_last_error(), s, 0);
  n += stranger_raw(path, s);
  sublet_disconnect(c);
  return n;
}

/* Status shows a stranger nothing of root's regions and loan; its refusals named the loan's
 * id, the owner's uid and client, the region. They say only what the stranger gave now. */
static void test_refusals_say_what_status_shows(void) {
  struct sl_test_daemon d;
  struct sublet_info info;
  struct secrets s;
  sublet_client *owner;
  sublet_region *r;
  pid_t pid;
  int leaked;

  CHECK(start_as(&d, 64, NULL, 0, 0) == 0);
  CHECK_RC(sublet_connect(d.socket, &owner), 0);
  CHECK_RC(sublet_get_info(owner, &info), 0);
  CHECK_RC(sublet_region_create(owner, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, "secret-name", &s.loan, s.token), 0);
  s.region = sublet_region_id(r);
  s.owner_client = info.client_id;
  if ((pid = sl_test_child()) == 0)
    _exit(stranger(d.socket, &s));
  leaked = wait_exit(pid);
  printf("  refusals that said too much: %d\n", leaked);
  CHECK(leaked == 0);
  CHECK_RC(sublet_withdraw(owner, s.loan), 0);
  sublet_disconnect(owner);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ issue 41 item 8: ids */

#define PROBER_UID 4402
#define PROBES 18
#define PROBE_TOKEN 8 /* the Borrow with the loan's token */

/* What another user may name by id: root's region (lent: its loan, an allocation in it),
 * a region released to the driver (its release), a region offered for release (the offer). */
struct ids {
  uint64_t region, loan, alloc, released_region, release, offered_region, offer;
  uint8_t token[16];
};

struct refusal {
  int code;
  char msg[512];
};

/* Probe k (0 .. PROBES - 1): one request naming one of the ids; its name into *what. */
static void probe_request(const struct ids *s, int k, Sublet__Request *req, const char **what) {
  static Sublet__RegionGrow grow;
  static Sublet__PagesGet pages;
  static Sublet__RegionRelease rr;
  static Sublet__Lend lend;
  static Sublet__ReleaseOffer ro;
  static Sublet__Reclaim reclaim;
  static Sublet__Withdraw wd;
  static Sublet__Borrow borrow;
  static Sublet__Free fr;
  static Sublet__Resume resume;
  static Sublet__ResumeEnd re;
  static Sublet__OfferStep step;
  static Sublet__TakeWait tw;
  static Sublet__GiveBack gb;
  static Sublet__Dropped dr;
  static uint8_t wrong[16];

  sublet__region_grow__init(&grow), sublet__pages_get__init(&pages);
  sublet__region_release__init(&rr), sublet__lend__init(&lend);
  sublet__release_offer__init(&ro), sublet__reclaim__init(&reclaim);
  sublet__withdraw__init(&wd), sublet__borrow__init(&borrow), sublet__free__init(&fr);
  sublet__resume__init(&resume), sublet__resume_end__init(&re);
  sublet__offer_step__init(&step), sublet__take_wait__init(&tw);
  sublet__give_back__init(&gb), sublet__dropped__init(&dr);
  grow.region = pages.region = rr.region = lend.region = dr.region = s->region;
  grow.size = 16 * PAGE;
  pages.count = 1;
  lend.has_keep_all = lend.keep_all = 1;
  reclaim.loan = wd.loan = borrow.loan = s->loan;
  borrow.has_loan = 1;
  reclaim.has_timeout_ms = tw.has_timeout_ms = 1; /* 0: answered at once */
  reclaim.timeout_ms = tw.timeout_ms = 0;
  fr.alloc = s->alloc;
  resume.release = re.release = s->release;
  step.offer = tw.offer = gb.offer = s->offer;
  ro.region = s->offered_region;
  switch (k) {
    case 0: *what = "RegionGrow", req->body_case = SUBLET__REQUEST__BODY_REGION_GROW,
            req->region_grow = &grow; break;
    case 1: *what = "PagesGet", req->body_case = SUBLET__REQUEST__BODY_PAGES_GET,
            req->pages_get = &pages; break;
    case 2: *what = "RegionRelease", req->body_case = SUBLET__REQUEST__BODY_REGION_RELEASE,
            req->region_release = &rr; break;
    case 3: *what = "Lend", req->body_case = SUBLET__REQUEST__BODY_LEND, req->lend = &lend;
            break;
    case 4: *what = "Lend release", lend.region = s->released_region;
            lend.has_release = lend.release = 1;
            req->body_case = SUBLET__REQUEST__BODY_LEND, req->lend = &lend; break;
    case 5: *what = "ReleaseOffer", req->body_case = SUBLET__REQUEST__BODY_RELEASE_OFFER,
            req->release_offer = &ro; break;
    case 6: *what = "Reclaim", req->body_case = SUBLET__REQUEST__BODY_RECLAIM,
            req->reclaim = &reclaim; break;
    case 7: *what = "Withdraw", req->body_case = SUBLET__REQUEST__BODY_WITHDRAW,
            req->withdraw = &wd; break;
    case 8: *what = "Borrow, the token", borrow.has_token = 1;
            borrow.token = (ProtobufCBinaryData){16, (uint8_t *)s->token};
            req->body_case = SUBLET__REQUEST__BODY_BORROW, req->borrow = &borrow; break;
    case 9: *what = "Borrow, a wrong token", borrow.has_token = 1;
            borrow.token = (ProtobufCBinaryData){16, wrong};
            req->body_case = SUBLET__REQUEST__BODY_BORROW, req->borrow = &borrow; break;
    case 10: *what = "Borrow, no token", req->body_case = SUBLET__REQUEST__BODY_BORROW,
             req->borrow = &borrow; break;
    case 11: *what = "Free", req->body_case = SUBLET__REQUEST__BODY_FREE, req->free = &fr;
             break;
    case 12: *what = "Resume", req->body_case = SUBLET__REQUEST__BODY_RESUME,
             req->resume = &resume; break;
    case 13: *what = "ResumeEnd", req->body_case = SUBLET__REQUEST__BODY_RESUME_END,
             req->resume_end = &re; break;
    case 14: *what = "OfferStep", req->body_case = SUBLET__REQUEST__BODY_OFFER_STEP,
             req->offer_step = &step; break;
    case 15: *what = "TakeWait", req->body_case = SUBLET__REQUEST__BODY_TAKE_WAIT,
             req->take_wait = &tw; break;
    case 16: *what = "GiveBack", req->body_case = SUBLET__REQUEST__BODY_GIVE_BACK,
             req->give_back = &gb; break;
    default: *what = "Dropped", req->body_case = SUBLET__REQUEST__BODY_DROPPED,
             req->dropped = &dr; break;
  }
}

/* Every probe once on fd: each refusal into out (code 0: it was not refused). */
static void probe_all(int fd, struct sl_wire_rx *rx, const struct ids *s, uint64_t *id,
                      struct refusal out[PROBES]) {
  for (int k = 0; k < PROBES; k++) {
    Sublet__Request req = SUBLET__REQUEST__INIT;
    const char *what;
    probe_request(s, k, &req, &what);
    req.id = (*id)++;
    out[k].code = raw_refusal(fd, rx, &req, out[k].msg, sizeof(out[k].msg));
  }
}

/* The other user: probes while root's objects live, waits for them to go, probes again with
 * the same ids. Exits with the number of probes whose refusals differ (or that got through). */
static int prober(const char *path, const struct ids *s, int ready_fd, int gone_fd) {
  static struct refusal live[PROBES], missing[PROBES];
  struct sl_wire_rx rx;
  uint64_t id = 2;
  int fd, n = 0;
  char x;

  if (sl_raw_become(PROBER_UID) != 0 || (fd = sl_raw_open(path, &rx)) < 0)
    return 100;
  probe_all(fd, &rx, s, &id, live);
  if (write(ready_fd, "x", 1) != 1 || read(gone_fd, &x, 1) != 1)
    return 101;
  probe_all(fd, &rx, s, &id, missing);
  for (int k = 0; k < PROBES; k++) {
    Sublet__Request req = SUBLET__REQUEST__INIT;
    const char *what;
    int same = live[k].code == missing[k].code && strcmp(live[k].msg, missing[k].msg) == 0;
    probe_request(s, k, &req, &what);
    /* The loan's token (its owner gave it) is told how to be let in: no id is news to it */
    int told = k == PROBE_TOKEN && (live[k].code == SUBLET_EBUSY || live[k].code == SUBLET_EPERM);
    n += (!same && !told) || live[k].code >= 0;
    if ((!same && !told) || getenv("SUBLET_TEST_VERBOSE") != NULL)
      fprintf(stderr, "  %s: existing %d \"%s\"\n  %*s  missing  %d \"%s\"\n", what,
              live[k].code, live[k].msg, (int)strlen(what), "", missing[k].code,
              missing[k].msg);
  }
  sl_wire_rx_destroy(&rx);
  close(fd);
  return n;
}

/* Another user told root's live ids from missing ones by the refusal's words (EPERM "belongs
 * to ...", "wrong token", "not this client's"). Now, for every request that takes a region,
 * loan, allocation, release or release offer id, its refusal of another user's live id is
 * byte for byte its refusal of that id once it is gone; only a Borrow with the loan's own
 * token (the owner gave it) hears what keeps it out. */
static void test_foreign_ids_refused_as_missing(void) {
  struct sl_test_daemon d;
  struct ids s = {0};
  sublet_client *owner, *borrower;
  sublet_region *r, *released, *offered;
  sublet_release_offer *o;
  int ready[2], gone[2], differ;
  pid_t pid;
  void *p;
  char x;

  CHECK(start_as(&d, 64, NULL, 0, 0) == 0);
  CHECK_RC(sublet_connect(d.socket, &owner), 0);
  CHECK_RC(sublet_connect(d.socket, &borrower), 0);
  CHECK_RC(sublet_region_create(owner, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_region_create(owner, 4 * PAGE, &released), 0);
  CHECK_RC(sublet_region_create(owner, 4 * PAGE, &offered), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, "ids", &s.loan, s.token), 0);
  CHECK_RC(sublet_borrow(borrower, s.loan, s.token, NULL, 0), 0);
  CHECK_RC(sublet_alloc(borrower, PAGE, &p), 0);
  s.alloc = 1; /* the daemon's first */
  CHECK_RC(sublet_release(released, NULL, 0, NULL, 0, 0, 0, &s.release, NULL), 0);
  CHECK_RC(sublet_offer_release(offered, NULL, 0, NULL, 0, 0, 0, "ids-offer", &o), 0);
  s.region = sublet_region_id(r);
  s.released_region = sublet_region_id(released);
  s.offered_region = sublet_region_id(offered);
  s.offer = sublet_release_offer_id(o);
  CHECK(pipe(ready) == 0 && pipe(gone) == 0);
  if ((pid = sl_test_child()) == 0)
    _exit(prober(d.socket, &s, ready[1], gone[0]));
  CHECK(read(ready[0], &x, 1) == 1);
  CHECK_RC(sublet_free(borrower, p), 0);
  CHECK_RC(sublet_return(borrower, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(owner, s.loan, 30000, NULL), 0);
  CHECK_RC(sublet_resume(released, s.release, 0, NULL), 0);
  CHECK_RC(sublet_release_offer_withdraw(o), 0);
  sublet_release_offer_free(o);
  CHECK_RC(sublet_region_release(r), 0);
  CHECK_RC(sublet_region_release(released), 0);
  CHECK_RC(sublet_region_release(offered), 0);
  CHECK(write(gone[1], "x", 1) == 1);
  differ = wait_exit(pid);
  printf("  requests whose refusal told a live id from a missing one: %d of %d\n", differ,
         PROBES);
  CHECK(differ == 0);
  sublet_disconnect(borrower);
  sublet_disconnect(owner);
  for (int i = 0; i < 2; i++)
    close(ready[i]), close(gone[i]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  if (geteuid() != 0) {
    printf("isolation: skipped, needs root to run clients as other users\n");
    return 77;
  }
  sl_test_run("fd hoard of one user", test_fd_hoard_of_one_user);
  sl_test_run("fds refused by the kernel", test_fds_refused_by_the_kernel);
  sl_test_run("long keep lists of one user", test_long_keep_lists_of_one_user);
  sl_test_run("decoded size bound", test_decoded_size_bound);
  sl_test_run("receive buffers cut the holder", test_receive_buffers_cut_the_holder);
  sl_test_run("connection reserve", test_connection_reserve);
  sl_test_run("refusals say what status shows", test_refusals_say_what_status_shows);
  sl_test_run("foreign ids refused as missing", test_foreign_ids_refused_as_missing);
  return sl_test_summary("isolation");
}
