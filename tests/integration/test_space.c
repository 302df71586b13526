/* test_space.c - subletd's address space is no user's to take (issue 41, item 3). Every
 * region's pages are mapped in the daemon too; a growable region once reserved the device's
 * whole memory there, with no bound per user, and one client's one-page growable regions took
 * it all: every other user's growable RegionCreate (every process's pool) failed until that
 * client went. Real daemons (memfd backend), the hostile client and the pool's user as real
 * separate users (children that setuid), the pool's tensors compared bit for bit.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "raw.h"
#include "sublet.h"
#include "wire.h"

#define KiB (1ull << 10)
#define MiB (1ull << 20)
#define TiB (1ull << 40)

#define HOSTILE_UID 4200
#define POOL_UID 4201

static uint8_t pattern(uint64_t i, uint8_t seed) {
  return (uint8_t)(((i + seed) * 2654435761u) >> 13);
}

/* Its exit code, or -1. */
static int wait_exit(pid_t pid) {
  int status;

  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
    return -1;
  return WEXITSTATUS(status);
}

static int start(struct sl_test_daemon *d, uint64_t page, uint64_t total) {
  if (sl_test_daemon_start(d, page, total) != 0)
    return -1;
  chmod(d->dir, 0755); /* the other users' clients connect too */
  chmod(d->socket, 0666);
  return 0;
}

/* The child's tensor of n bytes at p, filled with seed's pattern; 1 if it reads back. */
static int fill_check(uint8_t *p, uint64_t n, uint8_t seed) {
  for (uint64_t i = 0; i < n; i++)
    p[i] = pattern(i, seed);
  for (uint64_t i = 0; i < n; i++)
    if (p[i] != pattern(i, seed))
      return 0;
  return 1;
}

/* As POOL_UID, in a child: a pool of two tags whose second tensor grows the region (its
 * RegionCreate and RegionGrow are the calls a full address space refused), then the first
 * tensor compared again. Exit 0, else 1 with the failing call's message on stderr. */
static void pool_user(const char *path, uint64_t page) {
  sublet_client *c;
  uint8_t *a, *b;
  int ok;

  if (sl_raw_become(POOL_UID) != 0)
    _exit(2);
  if (sublet_connect(path, &c) != 0 || sublet_pool_alloc(c, 1, 3 * page, (void **)&a) != 0 ||
      !fill_check(a, 3 * page, 1) || sublet_pool_alloc(c, 2, 40 * page, (void **)&b) != 0 ||
      !fill_check(b, 40 * page, 2)) {
    fprintf(stderr, "  the other user's pool: %s\n", sublet_last_error());
    _exit(1);
  }
  ok = 1;
  for (uint64_t i = 0; i < 3 * page; i++)
    ok &= a[i] == pattern(i, 1);
  sublet_disconnect(c);
  _exit(ok ? 0 : 3);
}

static int pool_works(const char *path, uint64_t page) {
  pid_t pid = sl_test_child();

  if (pid == 0)
    pool_user(path, page);
  return wait_exit(pid) == 0;
}

/* ---------------------------------------------------- one client's one-page growable regions */

#define GROWABLES 64
#define BIG_DEVICE (16 * TiB) /* memfd pages are counted, not backed: 8 such reservations
                                 filled the daemon's 128 TiB */

/* RegionCreate growable of size bytes on a raw connection: 0 when made. */
static int raw_growable(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t size) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionCreate rc = SUBLET__REGION_CREATE__INIT;
  Sublet__Reply *rep;
  int made;

  rc.size = size;
  rc.has_growable = rc.growable = 1;
  req.id = id;
  req.body_case = SUBLET__REQUEST__BODY_REGION_CREATE;
  req.region_create = &rc;
  if (sl_raw_send(fd, &req, NULL, 0) != 0 || (rep = sl_raw_reply(fd, rx, 10000)) == NULL)
    return -1;
  made = rep->body_case == SUBLET__REPLY__BODY_REGION_CREATED;
  if (!made && rep->body_case == SUBLET__REPLY__BODY_ERROR)
    fprintf(stderr, "  region %d refused: %s\n", (int)id, rep->error->message);
  sublet__reply__free_unpacked(rep, NULL);
  return made ? 0 : -1;
}

/* As HOSTILE_UID: one connection asks for GROWABLES one-page growable regions and keeps them;
 * says on ready_fd how many were made. */
static void growable_hoarder(const char *path, int ready_fd) {
  struct sl_wire_rx rx;
  int fd, made = 0;

  if (sl_raw_become(HOSTILE_UID) != 0)
    _exit(5);
  sl_wire_rx_init(&rx);
  if ((fd = sl_raw_open(path, &rx)) < 0)
    _exit(6);
  while (made < GROWABLES && raw_growable(fd, &rx, 2 + (uint64_t)made, 2 * MiB) == 0)
    made++;
  if (write(ready_fd, &made, sizeof(made)) != sizeof(made))
    _exit(7);
  pause();
  _exit(0);
}

/* On a device of 16 TiB, one client's 64 one-page growable regions reserve 64 pages of the
 * daemon's address space, not 64 devices; another user's pool is made, grows and keeps its
 * bits beside them. Before: the 8th region was refused ("reserve of ... address space"), and
 * so was the pool's RegionCreate. */
static void test_growable_regions_of_one_client(void) {
  struct sl_test_daemon d;
  int pipefd[2], made = -1, pool;
  pid_t hoarder;

  CHECK(start(&d, 2 * MiB, BIG_DEVICE) == 0);
  CHECK(pipe(pipefd) == 0);
  if ((hoarder = sl_test_child()) == 0)
    growable_hoarder(d.socket, pipefd[1]);
  CHECK(read(pipefd[0], &made, sizeof(made)) == sizeof(made));
  pool = pool_works(d.socket, 2 * MiB);
  printf("  one client's one-page growable regions on a 16 TiB device: %d of %d made; another "
         "user's pool beside them: %s\n", made, GROWABLES, pool ? "works" : "fails");
  CHECK(made == GROWABLES);
  CHECK(pool);
  sl_test_reap(hoarder);
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------------ a user's bound */

#define SMALL_PAGE (64 * KiB)
#define SMALL_DEVICE (4 * MiB)
#define HALF (SMALL_DEVICE / 2)
#define BOUND_REGIONS 16 /* of half the device: 8 devices, SL_USER_SPACE_DEVICES */
#define TRIES 24

struct bound_seen {
  int made, rc, named, twin_rc;
};

/* As HOSTILE_UID: growable regions of half the device, each released whole (its pages given
 * back to the driver: the device stays free, the region's place stays), until one is refused;
 * then a second client of the same user asks for one page. Says what it saw on ready_fd. */
static void region_hoarder(const char *path, int ready_fd) {
  struct bound_seen s = {0};
  struct sublet_release_stats st;
  sublet_client *c, *twin;
  sublet_region *r;
  uint64_t rel;

  if (sl_raw_become(HOSTILE_UID) != 0 || sublet_connect(path, &c) != 0 ||
      sublet_connect(path, &twin) != 0)
    _exit(5);
  for (; s.made < TRIES; s.made++) {
    if ((s.rc = sublet_region_create_growable(c, HALF, &r)) != 0)
      break;
    if (sublet_release(r, NULL, 0, NULL, 0, 0, 0, &rel, &st) != 0)
      _exit(6);
  }
  s.named = s.rc != 0 && strstr(sublet_last_error(), "times the device's memory") != NULL;
  if (s.rc != 0)
    printf("  refused: %s\n", sublet_last_error());
  s.twin_rc = sublet_region_create(twin, SMALL_PAGE, &r);
  fflush(stdout);
  if (write(ready_fd, &s, sizeof(s)) != sizeof(s))
    _exit(7);
  pause();
  _exit(0);
}

/* As HOSTILE_UID again, once the hoarder was killed: a region of half the device, asked for
 * until the daemon has seen the hoarder's connection go (10 s at most). */
static void region_after(const char *path) {
  double deadline = sl_test_now() + 10;
  sublet_client *c;
  sublet_region *r;
  int rc;

  if (sl_raw_become(HOSTILE_UID) != 0 || sublet_connect(path, &c) != 0)
    _exit(5);
  while ((rc = sublet_region_create_growable(c, HALF, &r)) == SUBLET_ENOMEM &&
         sl_test_now() < deadline)
    usleep(20000);
  _exit(rc == 0 ? 0 : 1);
}

/* A user's regions reserve at most 8 times the device: the 17th region of half the device is
 * refused with SUBLET_ENOMEM naming the bound, though the device is free (the others' pages
 * were released), and so is the same user's other client; another user's pool is made and
 * grows; once the hoarder has gone its user makes regions again. Before: 24 of 24 made, no
 * bound. */
static void test_bound_of_one_user(void) {
  struct sl_test_daemon d;
  struct bound_seen s = {-1, 0, 0, 0};
  int pipefd[2];
  pid_t hoarder, after;

  CHECK(start(&d, SMALL_PAGE, SMALL_DEVICE) == 0);
  CHECK(pipe(pipefd) == 0);
  if ((hoarder = sl_test_child()) == 0)
    region_hoarder(d.socket, pipefd[1]);
  CHECK(read(pipefd[0], &s, sizeof(s)) == sizeof(s));
  printf("  growable regions of half the device, released whole, before a refusal: %d of %d "
         "(code %d; the same user's other client: %d)\n", s.made, TRIES, s.rc, s.twin_rc);
  CHECK(s.made == BOUND_REGIONS);
  CHECK_RC(s.rc, SUBLET_ENOMEM);
  CHECK(s.named);
  CHECK_RC(s.twin_rc, SUBLET_ENOMEM);
  CHECK(pool_works(d.socket, SMALL_PAGE));
  sl_test_reap(hoarder);
  if ((after = sl_test_child()) == 0)
    region_after(d.socket);
  CHECK(wait_exit(after) == 0);
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  if (geteuid() != 0) {
    printf("space: skipped, needs root to run clients as other users\n");
    return 77;
  }
  sl_test_run("growable regions of one client", test_growable_regions_of_one_client);
  sl_test_run("bound of one user", test_bound_of_one_user);
  return sl_test_summary("space");
}
