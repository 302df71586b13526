/* test_fresh.c - a borrower of another user cannot touch the owner's memory after the loan.
 * Real daemon (memfd backend), real sockets, processes of other uids.
 *
 * The borrower is another user (a member of --allow-group). While it borrows, it forks a
 * child, which inherits the mappings of every page it was granted (a mapping in a child, like
 * a kept fd, cannot be revoked). After the loan has ended and the owner has reclaimed, that
 * child writes all of them: the owner's kept bytes stay as they were, every one compared
 * bytewise, at the same addresses, because the end of the loan gave the owner fresh pages.
 * The old pages count against the borrower until it disconnects. A borrower of the owner's
 * own user costs no fresh page. A borrower that took the whole device (more than the device
 * holds beside the region) gives the owner its kept bytes back all the same, returned or
 * exited: subletd lets go of the old pages before it makes the fresh ones (issue 41).
 * On CUDA the owner's own process maps the old pages too, until it remaps: with
 * $SUBLET_MEMFD_MAPPED the memfd backend counts a page while any process maps it, as a GPU
 * does, and the owner's library, told that the end waits for fresh pages
 * (Error.awaits_fresh_pages), lets go of them and asks again: the bytes come back at the first
 * reclaim; while the borrower still maps them the end waits (ENOMEM), and the holes it leaves
 * are filled by a later reclaim, by the rescue when subletd dies, or go with the region.
 */
#include <grp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (64u << 10)
#define NPAGES 16
#define TOTAL (40u * PAGE)
#define MEMBER_UID 3000
#define GROUP 4242
#define MAX_ALLOCS 64

static struct sl_test_daemon daemon_;

#include "kept16.h"

/* In the borrower's child: holds the granted pages' mappings it inherited; once told, after
 * the loan, writes every byte of them. */
static void keeper(struct pipes *p, void *const *ptrs, size_t n) {
  close(p->to_borrower[0]);
  close(p->from_borrower[1]);
  if (hear(p->to_keeper[0], 'w') != 0)
    _exit(20);
  for (size_t i = 0; i < n; i++)
    memset(ptrs[i], 0xEE, PAGE);
  for (size_t i = 0; i < n; i++)
    if (((uint8_t *)ptrs[i])[PAGE - 1] != 0xEE)
      _exit(21);
  _exit(say(p->from_keeper[1], 'd') == 0 ? 0 : 22);
}

/* The borrower: another uid, in the allowed group. Takes the whole window, writes it, forks
 * the keeper, returns the loan, and disconnects only when told. Exits with the failing step. */
static int borrower(struct pipes *p, uint64_t loan, const uint8_t *token) {
  static const gid_t groups[] = {GROUP};
  void *ptrs[MAX_ALLOCS];
  struct sublet_loan_stats st;
  sublet_client *c;
  size_t n = 0;
  pid_t pid;

  close(p->to_borrower[1]); /* each end in one process only: a dead one is heard as EOF */
  close(p->from_borrower[0]);
  close(p->to_keeper[1]);
  close(p->from_keeper[0]);
  if (setgroups(1, groups) != 0 || setgid(MEMBER_UID) != 0 || setuid(MEMBER_UID) != 0)
    return 10;
  if (sublet_connect(daemon_.socket, &c) != 0 || sublet_borrow(c, loan, token, NULL, 0) != 0)
    return 11;
  while (n < MAX_ALLOCS && sublet_alloc(c, PAGE, &ptrs[n]) == 0)
    memset(ptrs[n++], 0xB0, PAGE);
  if (n < NPAGES)
    return 12; /* every region page must have been granted */
  if ((pid = fork()) == 0)
    keeper(p, ptrs, n);
  for (size_t i = 0; i < n; i++)
    if (sublet_free(c, ptrs[i]) != 0)
      return 13;
  if (sublet_return(c, 0, &st, NULL, 0, NULL) != 0 || st.replaced_pages != NPAGES)
    return 14; /* the loan's end gave the owner fresh pages for all it was granted */
  if (say(p->from_borrower[1], 'r') != 0 || hear(p->to_borrower[0], 'q') != 0)
    return 15;
  sublet_disconnect(c);
  return 0;
}

static pid_t start_borrower(struct pipes *p, uint64_t loan, const uint8_t *token) {
  pid_t pid = fork();

  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(borrower(p, loan, token));
  }
  close(p->to_borrower[0]);
  close(p->from_borrower[1]);
  close(p->to_keeper[0]);
  close(p->from_keeper[1]);
  return pid;
}

/* Does the status show old pages held by the member's uid (bytes > 0: that many)? */
static int status_retained(sublet_client *c, uint64_t bytes) {
  char want[96], *json = NULL;
  int found;

  if (sublet_status_json(c, &json) != 0)
    return -1;
  snprintf(want, sizeof(want), "\"uid\": %u, \"bytes\": %llu}", MEMBER_UID,
           (unsigned long long)bytes);
  found = bytes > 0 ? strstr(json, want) != NULL : strstr(json, "\"retained\": []") != NULL;
  if (!found)
    fprintf(stderr, "  status: %s\n", json);
  sublet_string_free(json);
  return found;
}

static int retained_none(sublet_client *c) {
  char *json = NULL;
  int none = sublet_status_json(c, &json) == 0 && strstr(json, "\"retained\": []") != NULL;

  sublet_string_free(json);
  return none;
}

static void make_owner(sublet_client **c, sublet_region **r, uint8_t **base) {
  *c = NULL;
  if (sublet_connect(daemon_.socket, c) != 0 || sublet_region_create(*c, NPAGES * PAGE, r) != 0)
    return;
  *base = sublet_region_addr(*r);
  for (uint64_t x = 0; x < NPAGES * PAGE; x++)
    (*base)[x] = pattern(x);
}

/* The test's ends. */
static void close_pipes(struct pipes *p) {
  close(p->to_borrower[1]);
  close(p->from_borrower[0]);
  close(p->to_keeper[1]);
  close(p->from_keeper[0]);
}

static void test_other_user_gets_nothing_after_the_loan(void) {
  struct sublet_range keep[NPAGES];
  struct sublet_loan_stats st;
  struct pipes p;
  sublet_client *owner;
  sublet_region *r = NULL;
  uint8_t *base = NULL, token[16];
  uint64_t loan;
  pid_t pid;

  make_owner(&owner, &r, &base);
  CHECK(owner != NULL && base != NULL);
  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "fresh", &loan, token), 0);
  CHECK(pipe(p.to_borrower) == 0 && pipe(p.from_borrower) == 0 && pipe(p.to_keeper) == 0 &&
        pipe(p.from_keeper) == 0);
  pid = start_borrower(&p, loan, token);
  CHECK(pid > 0);
  if (hear(p.from_borrower[0], 'r') != 0) {
    borrower_exit(pid);
    CHECK(!"the borrower returned the loan");
  }
  CHECK_RC(sublet_reclaim(owner, loan, 5000, &st), 0);
  CHECK(st.replaced_pages == NPAGES); /* every page was granted */
  CHECK(sublet_region_addr(r) == base);
  CHECK(kept_changed(base) == 0);
  CHECK(status_retained(owner, NPAGES * PAGE) == 1);
  /* The loan is over and reclaimed: the borrower's child writes what it still maps. */
  CHECK(say(p.to_keeper[1], 'w') == 0 && hear(p.from_keeper[0], 'd') == 0);
  CHECK(kept_changed(base) == 0);
  CHECK(say(p.to_borrower[1], 'q') == 0);
  CHECK(borrower_exit(pid) == 0);
  SL_TEST_UNTIL(retained_none(owner)); /* the daemon sees the borrower's connection go */
  CHECK(status_retained(owner, 0) == 1); /* counted until the borrower disconnected */
  /* The region goes on: a local loan through the new pages, every kept byte back. */
  CHECK_RC(sublet_lend_local(r, keep, keep_ranges(keep), 0, &loan), 0);
  for (void *q; sublet_alloc(owner, PAGE, &q) == 0;)
    memset(q, 0x5A, PAGE);
  CHECK_RC(sublet_return(owner, 1, NULL, NULL, 0, NULL), SUBLET_ELEAK);
  CHECK_RC(sublet_reclaim(owner, loan, 5000, &st), 0);
  CHECK(st.replaced_pages == 0);
  CHECK(kept_changed(base) == 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(owner);
  close_pipes(&p);
}

/* A borrower of the owner's own user (another process's client) costs no fresh page. */
static void test_same_user_pays_nothing(void) {
  struct sublet_range keep[NPAGES];
  struct sublet_loan_stats st;
  sublet_client *owner, *other;
  sublet_region *r = NULL;
  uint8_t *base = NULL, token[16];
  uint64_t loan;
  void *q;

  make_owner(&owner, &r, &base);
  CHECK(owner != NULL && base != NULL);
  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "same", &loan, token), 0);
  CHECK_RC(sublet_connect(daemon_.socket, &other), 0);
  CHECK_RC(sublet_borrow(other, loan, token, NULL, 0), 0);
  while (sublet_alloc(other, PAGE, &q) == 0)
    memset(q, 0xC3, PAGE);
  CHECK_RC(sublet_return(other, 1, NULL, NULL, 0, NULL), SUBLET_ELEAK);
  CHECK_RC(sublet_reclaim(owner, loan, 5000, &st), 0);
  CHECK(st.replaced_pages == 0);
  CHECK(kept_changed(base) == 0);
  CHECK(status_retained(owner, 0) == 1);
  sublet_disconnect(other);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(owner);
}

/* In a child: another user in the allowed group borrows the loan, writes its whole window and
 * returns it. Exits with the failing step. */
static int stranger_loan(uint64_t loan, const uint8_t *token) {
  static const gid_t groups[] = {GROUP};
  sublet_client *c;
  void *q;

  if (setgroups(1, groups) != 0 || setgid(MEMBER_UID) != 0 || setuid(MEMBER_UID) != 0)
    return 10;
  if (sublet_connect(daemon_.socket, &c) != 0 || sublet_borrow(c, loan, token, NULL, 0) != 0)
    return 11;
  while (sublet_alloc(c, PAGE, &q) == 0)
    memset(q, 0xB0, PAGE);
  if (sublet_return(c, 1, NULL, NULL, 0, NULL) != SUBLET_ELEAK)
    return 12;
  sublet_disconnect(c);
  return 0;
}

/* A borrower of the owner's user (another client) lends, borrows the whole window, writes it
 * with value and returns, keeping its window for the next loan. */
static void same_user_loan(sublet_region *r, sublet_client *owner, sublet_client *b,
                           uint8_t value, struct sublet_loan_stats *st) {
  struct sublet_range keep[NPAGES];
  void *ptrs[MAX_ALLOCS];
  uint8_t token[16];
  uint64_t loan;
  size_t n = 0;

  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "same", &loan, token), 0);
  CHECK_RC(sublet_borrow(b, loan, token, NULL, 0), 0);
  while (n < MAX_ALLOCS && sublet_alloc(b, PAGE, &ptrs[n]) == 0)
    memset(ptrs[n++], value, PAGE);
  for (size_t i = 0; i < n; i++) /* freed, not forfeit: the window is kept */
    CHECK_RC(sublet_free(b, ptrs[i]), 0);
  CHECK_RC(sublet_return(b, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(owner, loan, 5000, st), 0);
}

/* A borrower of the owner's user keeps its window from one loan to the next; a loan to another
 * user in between gives the region fresh pages, and that window is stale: the next loan maps
 * the region's pages as they are now (its writes land in the owner's unkept bytes). */
static void test_kept_window_follows_fresh_pages(void) {
  struct sublet_range keep[NPAGES];
  struct sublet_loan_stats st;
  sublet_client *owner, *same;
  sublet_region *r = NULL;
  uint8_t *base = NULL, token[16];
  uint64_t loan, unkept_not_written = 0;
  pid_t pid;

  make_owner(&owner, &r, &base);
  CHECK(owner != NULL && base != NULL);
  CHECK_RC(sublet_connect(daemon_.socket, &same), 0);
  same_user_loan(r, owner, same, 0x11, &st);
  CHECK(st.replaced_pages == 0);
  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "stranger", &loan, token), 0);
  if ((pid = fork()) == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(stranger_loan(loan, token));
  }
  CHECK(borrower_exit(pid) == 0);
  CHECK_RC(sublet_reclaim(owner, loan, 5000, &st), 0);
  CHECK(st.replaced_pages == NPAGES);
  same_user_loan(r, owner, same, 0x77, &st);
  CHECK(st.replaced_pages == 0);
  CHECK(kept_changed(base) == 0);
  for (uint64_t p = 1; p < NPAGES; p += 2) /* odd pages but 9 keep nothing */
    for (uint64_t x = 0; p != 9 && x < PAGE; x++)
      unkept_not_written += base[p * PAGE + x] != 0x77;
  /* Every unkept byte was written but those that took kept bytes moved out of the way (the
   * restore brings those back there before moving them home); a stale window would have
   * written none of them. */
  CHECK(unkept_not_written <= st.moved_bytes);
  sublet_disconnect(same);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(owner);
}

/* ------------------------------------------- a borrower of another user takes the whole device */

#define FULL_TOTAL (24u * PAGE) /* the region's 16 pages and 8 more: less than twice the region */

/* In a child: another user in the allowed group borrows the loan and takes the whole device
 * (every region page and all free memory), writes it, then returns and stays connected until
 * told (hold_fd), or (returns 0) exits without returning. Exits with the failing step. */
static int whole_device_loan(uint64_t loan, const uint8_t *token, int returns, int hold_fd) {
  static const gid_t groups[] = {GROUP};
  sublet_client *c;
  size_t n = 0;
  void *q;

  if (setgroups(1, groups) != 0 || setgid(MEMBER_UID) != 0 || setuid(MEMBER_UID) != 0)
    return 10;
  if (sublet_connect(daemon_.socket, &c) != 0 || sublet_borrow(c, loan, token, NULL, 0) != 0)
    return 11;
  for (; sublet_alloc(c, PAGE, &q) == 0; n++)
    memset(q, 0xB0, PAGE);
  if (n * PAGE != FULL_TOTAL)
    return 12; /* the whole device: the region's pages and every free one */
  if (!returns)
    return 0; /* its process goes, the loan with it: the daemon ends it once it has exited */
  if (sublet_return(c, 1, NULL, NULL, 0, NULL) != SUBLET_ELEAK)
    return 13;
  if (say(hold_fd, 'r') != 0 || hear(hold_fd, 'q') != 0)
    return 14; /* connected, its pages' fds still open, while the owner reclaims */
  sublet_disconnect(c);
  return 0;
}

/* One loan to a borrower that takes the whole device: the owner's side of it. */
struct whole {
  sublet_client *owner;
  sublet_region *r;
  uint8_t *base;
  uint64_t loan;
  pid_t pid;
  int sv; /* the test's end of the pipe to the borrower */
};

/* The owner lends its pattern; the borrower (returns: and stays connected, holding what it
 * took) has taken the whole device when this returns 0. */
static int whole_start(struct whole *w, int returns) {
  struct sublet_range keep[NPAGES];
  uint8_t token[16];
  int sv[2];

  *w = (struct whole){.sv = -1};
  make_owner(&w->owner, &w->r, &w->base);
  if (w->owner == NULL || w->base == NULL ||
      sublet_lend(w->r, keep, keep_ranges(keep), 0, "whole", &w->loan, token) != 0 ||
      socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0)
    return -1;
  if ((w->pid = fork()) == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(sv[0]);
    _exit(whole_device_loan(w->loan, token, returns, sv[1]));
  }
  close(sv[1]);
  w->sv = sv[0];
  return returns ? hear(w->sv, 'r') : borrower_exit(w->pid);
}

/* The owner's reclaim succeeds: every granted page fresh, every kept byte back in place. */
static void whole_reclaimed(struct whole *w) {
  struct sublet_loan_stats st;
  int rc = sublet_reclaim(w->owner, w->loan, 10000, &st);

  if (rc != 0)
    fprintf(stderr, "  reclaim: %s\n", sublet_last_error());
  CHECK_RC(rc, 0);
  CHECK(st.replaced_pages == NPAGES);
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
}

/* The borrower still connected (held) goes; the region is released. */
static void whole_finish(struct whole *w, int held) {
  if (held) {
    CHECK(say(w->sv, 'q') == 0);
    CHECK(borrower_exit(w->pid) == 0);
  }
  close(w->sv);
  CHECK_RC(sublet_region_release(w->r), 0);
  sublet_disconnect(w->owner);
}

/* The borrower (another user) took the whole device, so the fresh pages of the loan's end
 * (one per page it was granted: 16) fit only once subletd lets go of the old ones: the owner's
 * reclaim completes, every kept byte back, whether the borrower returned (and is still
 * connected) or exited. Before: the end waited for 16 free pages while subletd held the old
 * 16 and 8 were free, and the owner's Reclaim got ENOMEM ("free device memory and reclaim
 * again") until the daemon restarted. */
static void whole_device_case(int returns) {
  struct whole w;

  CHECK(whole_start(&w, returns) == 0);
  whole_reclaimed(&w);
  CHECK(sublet_region_addr(w.r) == w.base);
  CHECK(kept_changed(w.base) == 0);
  whole_finish(&w, returns);
}

static void test_whole_device_borrower_returns(void) {
  whole_device_case(1);
}

static void test_whole_device_borrower_exits(void) {
  whole_device_case(0);
}

/* ------------------------------- the same, with the owner's own mapping counted (as on CUDA) */

/* What comes after the owner's first reclaim, while the borrower still maps its pages. */
enum after_wait { THEN_EXITS, THEN_DAEMON_DIES, THEN_RELEASED };

/* The borrower (another user) took the whole device, returned and still maps the old pages.
 * The owner's reclaim gets ENOMEM, having let go of the granted pages (holes now); then the
 * borrower exits and a reclaim maps fresh pages into the holes, or subletd is killed and the
 * owner's rescue makes pages of its own there, or the region is released with its holes. */
static void mapped_wait_case(enum after_wait then) {
  struct sublet_loan_stats st;
  struct whole w;
  int status, rc;

  CHECK(whole_start(&w, 1) == 0);
  CHECK_RC(sublet_reclaim(w.owner, w.loan, 2000, &st), SUBLET_ENOMEM); /* the borrower maps */
  CHECK(strstr(sublet_last_error(), "kept bytes are not back yet") != NULL);
  if (then == THEN_DAEMON_DIES) {
    kill(daemon_.pid, SIGKILL);
    CHECK(waitpid(daemon_.pid, &status, 0) == daemon_.pid);
    rc = sublet_reclaim(w.owner, w.loan, 10000, &st); /* the rescue: its pages made anew here */
    if (rc != SUBLET_EDAEMONDIED)
      fprintf(stderr, "  rescue: %s\n", sublet_last_error());
    CHECK_RC(rc, SUBLET_EDAEMONDIED);
    CHECK(st.daemon_died && st.copied_in_bytes > 0);
  } else if (then == THEN_EXITS) {
    CHECK(say(w.sv, 'q') == 0);
    CHECK(borrower_exit(w.pid) == 0);
    whole_reclaimed(&w);
  }
  if (then != THEN_RELEASED) {
    CHECK(sublet_region_addr(w.r) == w.base);
    CHECK(kept_changed(w.base) == 0);
  }
  whole_finish(&w, then != THEN_EXITS);
}

/* The borrower took the whole device and exited: only the owner's own mapping holds the old
 * pages. Before its library let go of them, the Reclaim got ENOMEM for ever. */
static void test_mapped_borrower_exits(void) {
  whole_device_case(0);
}

static void test_mapped_borrower_maps_then_exits(void) {
  mapped_wait_case(THEN_EXITS);
}

/* An owner that polls (Reclaim with no wait, as an engine's step loop does) hears at once that
 * the end waits for fresh pages, so its library lets go of the granted pages, and a later poll
 * finds the loan ended: every kept byte back. Before: a poll heard only "not ended yet"
 * (ETIMEDOUT), the library never let go, and the end waited for ever. */
static void test_mapped_owner_polls(void) {
  struct sublet_loan_stats st;
  struct whole w;
  int rc = SUBLET_ETIMEDOUT;

  CHECK(whole_start(&w, 0) == 0);
  for (int i = 0; i < 2000 && rc != 0; i++) { /* 20 s: liveness, not speed */
    rc = sublet_reclaim(w.owner, w.loan, 0, &st);
    if (rc != 0)
      usleep(10 * 1000);
  }
  if (rc != 0)
    fprintf(stderr, "  poll: %s\n", sublet_last_error());
  CHECK_RC(rc, 0);
  CHECK(st.replaced_pages == NPAGES);
  CHECK(sublet_region_addr(w.r) == w.base);
  CHECK(kept_changed(w.base) == 0);
  whole_finish(&w, 0);
}

static void test_mapped_borrower_maps_then_released(void) {
  mapped_wait_case(THEN_RELEASED);
}

static void test_mapped_borrower_maps_then_daemon_dies(void) {
  mapped_wait_case(THEN_DAEMON_DIES);
}

int main(void) {
  static const char *const args[] = {"--allow-group", "4242", NULL};

  signal(SIGPIPE, SIG_IGN);
  if (geteuid() != 0) {
    printf("fresh: skipped: needs root to become another user in a child\n");
    return 0;
  }
  if (sl_test_daemon_start_ex(&daemon_, PAGE, TOTAL,
                              &(struct sl_test_daemon_opts){.args = args}) != 0)
    return 1;
  chmod(daemon_.dir, 0755);
  chmod(daemon_.socket, 0666);
  sl_test_run("another user's borrower gets nothing after the loan",
              test_other_user_gets_nothing_after_the_loan);
  sl_test_run("a borrower of the owner's user pays nothing", test_same_user_pays_nothing);
  sl_test_run("a kept window follows the fresh pages", test_kept_window_follows_fresh_pages);
  if (sl_test_daemon_stop(&daemon_) != 0)
    sl_test_failed++;
  if (sl_test_daemon_start_ex(&daemon_, PAGE, FULL_TOTAL,
                              &(struct sl_test_daemon_opts){.args = args}) != 0)
    return 1;
  chmod(daemon_.dir, 0755);
  chmod(daemon_.socket, 0666);
  sl_test_run("a borrower of another user takes the whole device and returns",
              test_whole_device_borrower_returns);
  sl_test_run("a borrower of another user takes the whole device and exits",
              test_whole_device_borrower_exits);
  if (sl_test_daemon_stop(&daemon_) != 0)
    sl_test_failed++;
  setenv("SUBLET_MEMFD_MAPPED", "1", 1); /* the daemon's device, and this process's */
  if (sl_test_daemon_start_ex(&daemon_, PAGE, FULL_TOTAL,
                              &(struct sl_test_daemon_opts){.args = args}) != 0)
    return 1;
  chmod(daemon_.dir, 0755);
  chmod(daemon_.socket, 0666);
  sl_test_run("mapped pages counted: the borrower takes the whole device and exits",
              test_mapped_borrower_exits);
  sl_test_run("mapped pages counted: the owner polls with no wait", test_mapped_owner_polls);
  sl_test_run("mapped pages counted: the borrower still maps, then exits",
              test_mapped_borrower_maps_then_exits);
  sl_test_run("mapped pages counted: the borrower still maps, the region is released",
              test_mapped_borrower_maps_then_released);
  sl_test_run("mapped pages counted: the borrower still maps, subletd dies",
              test_mapped_borrower_maps_then_daemon_dies); /* last: the daemon is gone */
  unsetenv("SUBLET_MEMFD_MAPPED");
  rmdir(daemon_.dir);
  return sl_test_summary("fresh");
}
