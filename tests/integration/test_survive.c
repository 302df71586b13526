/* test_survive.c - subletd under copies that take long and deaths it does not choose: other
 * clients are served while kept bytes are saved, and no kept byte is lost when the daemon
 * itself is killed. A real subletd (memfd backend), real processes, through libsublet. The
 * memfd backend's copies are paced to $SUBLET_MEMFD_LINK so that a save lasts long enough to
 * be watched, and killed, in the middle. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (1u << 20)

static uint8_t pattern(uint64_t i, unsigned seed) {
  return (uint8_t)(((i + seed) * 2654435761u) >> 13);
}

static void fill(uint8_t *p, uint64_t n, unsigned seed) {
  for (uint64_t i = 0; i < n; i++)
    p[i] = pattern(i, seed);
}

/* Kept bytes that differ from the pattern, bit for bit. */
static uint64_t kept_changed(const uint8_t *p, const struct sublet_range *keep, size_t n,
                             unsigned seed) {
  uint64_t bad = 0;

  for (size_t k = 0; k < n; k++)
    for (uint64_t i = keep[k].offset; i < keep[k].offset + keep[k].length; i++)
      bad += p[i] != pattern(i, seed);
  return bad;
}

static double now(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ copies off the loop */

struct big_alloc {
  sublet_client *c;
  uint64_t size;
  void *p;
  int rc;
  double seconds;
  volatile int done;
};

static void *alloc_thread(void *arg) {
  struct big_alloc *a = arg;
  double t0 = now();

  a->rc = sublet_alloc(a->c, a->size, &a->p);
  a->seconds = now() - t0;
  a->done = 1;
  return NULL;
}

/* A number of the daemon's status (the first `"key": `), or -1. */
static long long status_count(const char *json, const char *key) {
  char quoted[64];
  const char *at;

  snprintf(quoted, sizeof(quoted), "\"%s\": ", key);
  return (at = strstr(json, quoted)) != NULL ? strtoll(at + strlen(quoted), NULL, 10) : -1;
}

/* A borrower's allocation saves 64 MiB of kept bytes over a 128 MiB/s link (half a second);
 * meanwhile another client's requests are answered as if nothing were going on. The other
 * client shows it by what it sees: the allocation's fresh pages made (the device's free memory
 * gone) but nothing granted yet (the loan's live bytes still 0), i.e. the Alloc in the
 * daemon's hands with its save under way. A loop blocked by the save answers nothing between
 * the two, so no Status could see them so. */
static void test_others_served_during_a_save(void) {
  struct sublet_range keep = {0, 64 * PAGE};
  struct sl_test_daemon d;
  sublet_client *owner, *borrower, *other;
  struct sublet_info info;
  struct big_alloc a = {0};
  struct sublet_loan_stats st;
  sublet_region *r;
  pthread_t t;
  uint64_t loan, trips = 0, during = 0;
  char *json;

  setenv("SUBLET_MEMFD_LINK", "128M", 1);
  CHECK(sl_test_daemon_start(&d, PAGE, 96 * PAGE) == 0);
  unsetenv("SUBLET_MEMFD_LINK");
  CHECK_RC(sublet_connect(d.socket, &owner), 0);
  CHECK_RC(sublet_connect(d.socket, &borrower), 0);
  CHECK_RC(sublet_connect(d.socket, &other), 0);
  CHECK_RC(sublet_region_create(owner, 64 * PAGE, &r), 0);
  fill(sublet_region_addr(r), 64 * PAGE, 1);
  CHECK_RC(sublet_lend(r, &keep, 1, 0, NULL, &loan, NULL), 0);
  CHECK_RC(sublet_borrow(owner, loan, NULL, NULL, 0), 0);
  CHECK_RC(sublet_get_info(other, &info), 0);
  CHECK(info.free_bytes == 32 * PAGE); /* the fresh pages the allocation takes first */
  a.c = owner;
  a.size = 96 * PAGE; /* 32 fresh pages, then all 64 kept ones: all of it saved */
  CHECK(pthread_create(&t, NULL, alloc_thread, &a) == 0);
  while (!a.done) {
    long long free_bytes, live;
    if (sublet_status_json(other, &json) != 0)
      break;
    free_bytes = status_count(json, "free_bytes");
    live = status_count(json, "live_bytes");
    sublet_string_free(json);
    during += free_bytes == 0 && live == 0;
    trips++;
  }
  pthread_join(t, NULL);
  printf("  a 64 MiB save took %.2f s; meanwhile %llu round trips of another client, %llu of "
         "them with the save under way\n", a.seconds, (unsigned long long)trips,
         (unsigned long long)during);
  CHECK_RC(a.rc, 0);
  CHECK_RC(sublet_loan_stats(owner, &st), 0);
  CHECK(st.copied_out_bytes == 64 * PAGE); /* every kept byte went through the paced link */
  CHECK(during > 0); /* answered mid-save: the loop was free */
  memset(a.p, 0xEE, 96 * PAGE);
  CHECK_RC(sublet_free(owner, a.p), 0);
  CHECK_RC(sublet_return(owner, 0, &st, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(owner, loan, 10000, &st), 0);
  CHECK(st.copied_in_bytes == 64 * PAGE);
  CHECK(kept_changed(sublet_region_addr(r), &keep, 1, 1) == 0);
  sublet_disconnect(other);
  sublet_disconnect(borrower);
  sublet_disconnect(owner);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* ------------------------------------------------------------------ the daemon's death */

#define KPAGE (64u << 10)
#define KPAGES 32 /* a 2 MiB region: all of the daemon's memory, so the loan has no free pages */

enum moment { BEFORE_SAVE, MID_SAVE, BORROWER_WRITING, MID_RESTORE, MOMENTS };
static const char *const moment_names[] = {"before the first save", "mid-save",
                                           "while the borrower writes", "during the restore"};

/* The borrower, in a process of its own: takes everything (every kept page is saved), writes
 * over all of it, returns. It tells the owner's killer where it is through `phase`. */
static void borrower(const char *sock, uint64_t loan, const uint8_t token[16], int phase,
                     uint64_t take, int first_wait_ms) {
  sublet_client *c;
  void *p;

  if (sublet_connect(sock, &c) != 0 || sublet_borrow(c, loan, token, NULL, 0) != 0)
    _exit(2);
  if (write(phase, "b", 1) != 1)
    _exit(3); /* "b": then it allocates, i.e. makes the daemon save (and move) */
  for (int ms = 0; ms < first_wait_ms && sublet_connected(c); ms++)
    usleep(1000); /* before the first save: it waits for the daemon's end (up to 5 s) */
  if (sublet_alloc(c, take, &p) != 0)
    _exit(3);
  if (write(phase, "w", 1) != 1)
    _exit(4);
  for (int i = 0; i < 20; i++) /* its pages go (unmapped) once the daemon is gone */
    memset(p, 0xEE + i, take);
  if (write(phase, "r", 1) != 1)
    _exit(5);
  sublet_free(c, p);
  sublet_return(c, 0, NULL, NULL, 0, NULL);
  _exit(0);
}

struct killer {
  pid_t daemon;
  int phase;          /* read end of the borrower's phases */
  enum moment when;
  unsigned delay_us;
};

static void *kill_daemon(void *arg) {
  struct killer *k = arg;
  const char want = k->when == BEFORE_SAVE ? 'b' : k->when == MID_SAVE ? 'b'
                    : k->when == BORROWER_WRITING ? 'w' : 'r';
  char got = 0;

  while (got != want && read(k->phase, &got, 1) == 1)
    ;
  if (k->when == MID_SAVE)
    usleep(50000); /* the borrower allocates 50 ms after "b" (5 s before the first save) */
  if (k->when != BEFORE_SAVE)
    usleep(k->delay_us);
  kill(k->daemon, SIGKILL);
  return NULL;
}

struct outcome {
  int rescued, ended_normally;
  uint64_t moved; /* kept bytes the daemon had moved on the device, moved back by the owner */
};

/* Pages with a kept byte in them. */
static uint64_t kept_page_count(const struct sublet_range *keep, size_t n) {
  uint64_t count = 0;

  for (uint64_t p = 0; p < KPAGES; p++)
    for (size_t i = 0; i < n; i++)
      if (keep[i].offset < (p + 1) * KPAGE && keep[i].offset + keep[i].length > p * KPAGE) {
        count++;
        break;
      }
  return count;
}

/* One loan whose daemon is killed at a moment; every kept byte must be back. */
static void one_death(enum moment when, unsigned seed, struct outcome *out) {
  struct sublet_range keep[4];
  struct sl_test_daemon d;
  struct sublet_loan_stats st;
  struct killer k = {.when = when, .delay_us = (unsigned)(rand() % 60000)};
  sublet_client *owner;
  sublet_region *r;
  pthread_t t;
  uint64_t loan;
  uint8_t token[16];
  int phase[2], status, rc;
  pid_t child;

  uint64_t take = KPAGES * KPAGE;

  for (int i = 0; i < 4; i++) { /* small ranges: kept pages have holes for moves */
    keep[i].offset = (uint64_t)(rand() % (KPAGES * KPAGE));
    keep[i].length = 1 + (uint64_t)(rand() % (KPAGES * KPAGE / 4));
    if (keep[i].length > KPAGES * KPAGE - keep[i].offset)
      keep[i].length = KPAGES * KPAGE - keep[i].offset;
  }
  if (seed / MOMENTS % 2) /* half of the kept pages stay unlent: their holes take moved bytes */
    take -= kept_page_count(keep, 4) / 2 * KPAGE;
  CHECK(sl_test_daemon_start(&d, KPAGE, KPAGES * KPAGE) == 0);
  k.daemon = d.pid;
  CHECK_RC(sublet_connect(d.socket, &owner), 0);
  CHECK_RC(sublet_region_create(owner, KPAGES * KPAGE, &r), 0);
  fill(sublet_region_addr(r), KPAGES * KPAGE, seed);
  CHECK_RC(sublet_lend(r, keep, 4, 0, NULL, &loan, token), 0);
  CHECK(pipe(phase) == 0);
  child = fork();
  if (child == 0) {
    close(phase[0]);
    borrower(d.socket, loan, token, phase[1], take, when == BEFORE_SAVE ? 5000 : 50);
  }
  close(phase[1]);
  k.phase = phase[0];
  CHECK(pthread_create(&t, NULL, kill_daemon, &k) == 0);
  rc = sublet_reclaim(owner, loan, 20000, &st);
  pthread_join(t, NULL);
  waitpid(child, &status, 0);
  waitpid(d.pid, &status, 0);
  rmdir(d.dir);
  close(phase[0]);
  if (rc != 0 && rc != SUBLET_EDAEMONDIED)
    fprintf(stderr, "  %s: %s\n", moment_names[when], sublet_last_error());
  CHECK(rc == 0 || rc == SUBLET_EDAEMONDIED); /* ended before the kill, or told of it */
  CHECK(rc == 0 || (st.daemon_died && strstr(sublet_last_error(), "restored") != NULL));
  CHECK(kept_changed(sublet_region_addr(r), keep, 4, seed) == 0);
  CHECK(sublet_connected(owner) == 0);
  CHECK_RC(sublet_region_release(r), 0); /* the daemon's side is gone: ours goes quietly */
  sublet_disconnect(owner);
  out->rescued += rc == SUBLET_EDAEMONDIED;
  out->moved += rc == SUBLET_EDAEMONDIED ? st.moved_bytes : 0;
  out->ended_normally += rc == 0;
}

/* subletd SIGKILLed at random moments of 100 loans: the owner gets every kept byte back. */
static void test_daemon_killed_mid_loan(void) {
  struct outcome per[MOMENTS] = {{0}};
  int before = sl_test_failed;

  setenv("SUBLET_MEMFD_LINK", "16M", 1); /* a 1 MiB save or restore takes 62 ms */
  for (int i = 0; i < 100 && sl_test_failed == before; i++)
    one_death((enum moment)(i % MOMENTS), (unsigned)i, &per[i % MOMENTS]);
  unsetenv("SUBLET_MEMFD_LINK");
  for (int m = 0; m < MOMENTS; m++)
    printf("  killed %-26s restored by the owner %2d (moved back %6llu bytes), ended "
           "before the kill %2d\n", moment_names[m], per[m].rescued,
           (unsigned long long)per[m].moved, per[m].ended_normally);
  CHECK(sl_test_failed == before);
  /* A late kill may find the loan ended (then the daemon restored): on a loaded machine up to
   * half of them do (49 of 75 were rescued in one CI run), so a third is the floor that still
   * says these moments were hit. */
  CHECK(per[BEFORE_SAVE].rescued == 25);
  CHECK(per[MID_SAVE].rescued + per[BORROWER_WRITING].rescued + per[MID_RESTORE].rescued >= 25);
  CHECK(per[MID_SAVE].moved + per[BORROWER_WRITING].moved > 0); /* moves were undone too */
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  srand(9);
  sl_test_run("others served during a save", test_others_served_during_a_save);
  sl_test_run("daemon killed mid-loan, 100 times", test_daemon_killed_mid_loan);
  return sl_test_summary("survive");
}
