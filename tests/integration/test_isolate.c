/* test_isolate.c - a loan to another user never leaves that user a way into the owner's live
 * pages: not when the device is full at the loan's end, not when subletd
 * dies or is stopped mid-loan (or after the end, before the owner heard), and a daemon death
 * after a loan has ended does not make the owner wait for the borrower (issue 25, items 2, 3
 * and 7). Real daemon (memfd backend), real sockets, processes of other uids.
 *
 * The borrower is another user (a member of --allow-group). While it borrows it forks a child,
 * the keeper, which inherits the mappings of every page it was granted: like a kept fd, they
 * cannot be revoked. Once the owner has its tensor back, the keeper writes all of them, and
 * every kept byte of the owner's is compared with what it was.
 */
#include <grp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (64u << 10)
#define NPAGES 16
#define TOTAL (40u * PAGE)
#define FILLER (20u * PAGE) /* leaves less free than the pages a borrower is granted */
#define MEMBER_UID 3000
#define GROUP 4242
#define MAX_ALLOCS 64

static const char *const daemon_args[] = {"--allow-group", "4242", NULL};

#include "kept16.h"

/* What the borrower does once it holds the whole window and the keeper is forked. */
enum plan {
  RETURN,      /* frees everything, returns, says 'r', leaves once told 'q' */
  HOLD,        /* says 'b' and holds the loan until told 'q' (the daemon dies meanwhile) */
};

struct borrower_args {
  const char *socket;
  uint64_t loan;
  const uint8_t *token;
  uid_t uid;   /* MEMBER_UID, or 0: the owner's own user */
  enum plan plan;
};

/* In the borrower's child: holds the granted pages' mappings it inherited; each time it is
 * told 'w', writes every byte of them and says 'd'. */
static void keeper(struct pipes *p, void *const *ptrs, size_t n) {
  close(p->to_borrower[0]);
  close(p->from_borrower[1]);
  while (hear(p->to_keeper[0], 'w') == 0) {
    for (size_t i = 0; i < n; i++)
      memset(ptrs[i], 0xEE, PAGE);
    if (say(p->from_keeper[1], 'd') != 0)
      _exit(22);
  }
  _exit(0);
}

static int become(uid_t uid) {
  static const gid_t groups[] = {GROUP};

  return uid == 0 || (setgroups(1, groups) == 0 && setgid(uid) == 0 && setuid(uid) == 0) ? 0 : -1;
}

/* The borrower: takes the whole window, writes it, forks the keeper, then follows its plan.
 * Exits with the failing step. */
static int borrower(struct pipes *p, const struct borrower_args *a) {
  void *ptrs[MAX_ALLOCS];
  sublet_client *c;
  size_t n = 0;

  close(p->to_borrower[1]); /* each end in one process only: a dead one is heard as EOF */
  close(p->from_borrower[0]);
  close(p->to_keeper[1]);
  close(p->from_keeper[0]);
  if (become(a->uid) != 0)
    return 10;
  if (sublet_connect(a->socket, &c) != 0 || sublet_borrow(c, a->loan, a->token, NULL, 0) != 0)
    return 11;
  while (n < MAX_ALLOCS && sublet_alloc(c, PAGE, &ptrs[n]) == 0)
    memset(ptrs[n++], 0xB0, PAGE);
  if (n < NPAGES)
    return 12; /* every region page must have been granted */
  if (fork() == 0)
    keeper(p, ptrs, n);
  if (a->plan == HOLD)
    return say(p->from_borrower[1], 'b') == 0 && hear(p->to_borrower[0], 'q') == 0 ? 0 : 13;
  for (size_t i = 0; i < n; i++)
    if (sublet_free(c, ptrs[i]) != 0)
      return 14;
  if (sublet_return(c, 0, NULL, NULL, 0, NULL) != 0)
    return 15;
  if (say(p->from_borrower[1], 'r') != 0 || hear(p->to_borrower[0], 'q') != 0)
    return 16;
  sublet_disconnect(c);
  return 0;
}

static pid_t start_borrower(struct pipes *p, const struct borrower_args *a) {
  pid_t pid;

  if (pipe(p->to_borrower) != 0 || pipe(p->from_borrower) != 0 || pipe(p->to_keeper) != 0 ||
      pipe(p->from_keeper) != 0)
    return -1;
  if ((pid = fork()) == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(borrower(p, a));
  }
  close(p->to_borrower[0]);
  close(p->from_borrower[1]);
  close(p->to_keeper[0]);
  close(p->from_keeper[1]);
  return pid;
}

/* The test's ends; the keeper sees EOF and leaves. */
static void close_pipes(struct pipes *p) {
  close(p->to_borrower[1]);
  close(p->from_borrower[0]);
  close(p->to_keeper[1]);
  close(p->from_keeper[0]);
}

/* The keeper writes every page it still maps: 0 once it has. */
static int keeper_writes(struct pipes *p) {
  return say(p->to_keeper[1], 'w') == 0 && hear(p->from_keeper[0], 'd') == 0 ? 0 : -1;
}

static int start_daemon(struct sl_test_daemon *d) {
  if (sl_test_daemon_start_ex(d, PAGE, TOTAL,
                              &(struct sl_test_daemon_opts){.args = daemon_args}) != 0)
    return -1;
  chmod(d->dir, 0755);
  chmod(d->socket, 0666);
  return 0;
}

static void make_owner(const struct sl_test_daemon *d, sublet_client **c, sublet_region **r,
                       uint8_t **base) {
  *c = NULL;
  *base = NULL;
  if (sublet_connect(d->socket, c) != 0 || sublet_region_create(*c, NPAGES * PAGE, r) != 0)
    return;
  *base = sublet_region_addr(*r);
  for (uint64_t x = 0; x < NPAGES * PAGE; x++)
    (*base)[x] = pattern(x);
}

/* Item 2: the device is full at the loan's end (a filler region, and the stranger took the
 * free rest): fresh pages in place of the 16 the stranger was granted fit only in the memory
 * of the old ones. subletd lets go of them first (issue 41: it once kept them, and the owner
 * heard ENOMEM until memory was freed elsewhere), so the owner's first Reclaim brings every
 * kept byte back, in fresh pages the keeper cannot reach. */
static void test_full_device_gives_back(void) {
  struct sl_test_daemon d;
  struct sublet_range keep[NPAGES];
  struct sublet_loan_stats st;
  struct pipes p;
  sublet_client *owner;
  sublet_region *r = NULL, *filler = NULL;
  uint8_t *base, token[16];
  uint64_t loan;
  pid_t pid;

  CHECK(start_daemon(&d) == 0);
  make_owner(&d, &owner, &r, &base);
  CHECK(base != NULL);
  CHECK_RC(sublet_region_create(owner, FILLER, &filler), 0);
  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "full", &loan, token), 0);
  pid = start_borrower(&p, &(struct borrower_args){d.socket, loan, token, MEMBER_UID, RETURN});
  CHECK(pid > 0);
  if (hear(p.from_borrower[0], 'r') != 0) {
    borrower_exit(pid);
    CHECK(!"the borrower returned the loan");
  }
  CHECK_RC(sublet_reclaim(owner, loan, 5000, &st), 0);
  CHECK(st.replaced_pages == NPAGES);
  CHECK(sublet_region_addr(r) == base);
  CHECK(kept_changed(base) == 0);
  CHECK(keeper_writes(&p) == 0);
  CHECK(kept_changed(base) == 0);
  CHECK(say(p.to_borrower[1], 'q') == 0);
  CHECK(borrower_exit(pid) == 0);
  CHECK_RC(sublet_region_release(filler), 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(owner);
  close_pipes(&p);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* How subletd goes in item 3's cases. */
enum death { KILL_MID_LOAN, TERM_MID_LOAN, KILL_AFTER_END };

/* Item 3: subletd goes while a stranger borrows (or after it returned, before the owner
 * reclaimed). The owner's library restores the kept bytes itself; the keeper, which still maps
 * every page the stranger was granted, then writes them all, and no kept byte changes. The
 * stranger leaves before the owner reclaims (its exit is what an owner waited for), or
 * (stays) lives on: the owner need not wait for it, its pages are never the owner's again. */
static void one_death(enum death how, int stays) {
  struct sl_test_daemon d;
  struct sublet_range keep[NPAGES];
  struct sublet_loan_stats st;
  struct pipes p;
  sublet_client *owner;
  sublet_region *r = NULL;
  uint8_t *base, token[16];
  uint64_t loan;
  enum plan plan = how == KILL_AFTER_END ? RETURN : HOLD;
  pid_t pid;

  CHECK(start_daemon(&d) == 0);
  make_owner(&d, &owner, &r, &base);
  CHECK(base != NULL);
  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "death", &loan, token), 0);
  pid = start_borrower(&p, &(struct borrower_args){d.socket, loan, token, MEMBER_UID, plan});
  CHECK(pid > 0);
  if (hear(p.from_borrower[0], plan == HOLD ? 'b' : 'r') != 0) {
    borrower_exit(pid);
    CHECK(!"the borrower borrowed the loan");
  }
  if (how == TERM_MID_LOAN)
    CHECK(sl_test_daemon_stop(&d) == 0);
  else
    CHECK(kill(d.pid, SIGKILL) == 0 && waitpid(d.pid, NULL, 0) == d.pid);
  if (!stays) {
    CHECK(say(p.to_borrower[1], 'q') == 0);
    CHECK(borrower_exit(pid) == 0); /* the keeper, its child, lives on */
  }
  CHECK_RC(sublet_reclaim(owner, loan, 5000, &st), SUBLET_EDAEMONDIED);
  CHECK(kept_changed(base) == 0);
  CHECK(keeper_writes(&p) == 0);
  CHECK(kept_changed(base) == 0);
  if (stays) {
    CHECK(say(p.to_borrower[1], 'q') == 0);
    CHECK(borrower_exit(pid) == 0);
  }
  sublet_disconnect(owner);
  close_pipes(&p);
}

static void test_killed_mid_loan(void) {
  one_death(KILL_MID_LOAN, 0);
}

static void test_killed_mid_loan_stranger_stays(void) {
  one_death(KILL_MID_LOAN, 1);
}

static void test_stopped_mid_loan(void) {
  one_death(TERM_MID_LOAN, 0);
}

static void test_killed_after_the_end(void) {
  one_death(KILL_AFTER_END, 0);
}

/* Item 7: the loan has ended (a borrower of the owner's user, in another process that lives
 * on); subletd dies before the owner reclaimed. The journal says the loan ended: the owner
 * hears at once, with every kept byte where it was, and waits for nobody. */
static void test_ended_loan_no_wait(void) {
  struct sl_test_daemon d;
  struct sublet_range keep[NPAGES];
  struct sublet_loan_stats st;
  struct pipes p;
  sublet_client *owner;
  sublet_region *r = NULL;
  uint8_t *base, token[16];
  uint64_t loan;
  pid_t pid;

  CHECK(start_daemon(&d) == 0);
  make_owner(&d, &owner, &r, &base);
  CHECK(base != NULL);
  CHECK_RC(sublet_lend(r, keep, keep_ranges(keep), 0, "ended", &loan, token), 0);
  pid = start_borrower(&p, &(struct borrower_args){d.socket, loan, token, 0, RETURN});
  CHECK(pid > 0);
  if (hear(p.from_borrower[0], 'r') != 0) {
    borrower_exit(pid);
    CHECK(!"the borrower returned the loan");
  }
  CHECK(kill(d.pid, SIGKILL) == 0 && waitpid(d.pid, NULL, 0) == d.pid);
  /* The borrower (and its keeper) live on until told. The journal says the loan had ended,
   * so the owner takes the path that waits for nobody and restores nothing: its message says
   * which path it took. */
  CHECK_RC(sublet_reclaim(owner, loan, 3000, &st), SUBLET_EDAEMONDIED);
  CHECK(strstr(sublet_last_error(), "had ended") != NULL);
  CHECK(st.daemon_died && st.copied_in_bytes == st.copied_out_bytes);
  CHECK(kept_changed(base) == 0);
  CHECK(say(p.to_borrower[1], 'q') == 0);
  CHECK(borrower_exit(pid) == 0);
  sublet_disconnect(owner);
  close_pipes(&p);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  if (geteuid() != 0) {
    printf("isolate: skipped: needs root to become another user in a child\n");
    return 0;
  }
  sl_test_run("a full device: the owner's bytes come back, the stranger gets nothing",
              test_full_device_gives_back);
  sl_test_run("subletd killed mid-loan: the stranger gets nothing", test_killed_mid_loan);
  sl_test_run("subletd killed mid-loan: the owner does not wait for the stranger",
              test_killed_mid_loan_stranger_stays);
  sl_test_run("subletd stopped mid-loan: the stranger gets nothing", test_stopped_mid_loan);
  sl_test_run("subletd killed after the end: the stranger gets nothing",
              test_killed_after_the_end);
  sl_test_run("subletd killed after the end: the owner waits for nobody",
              test_ended_loan_no_wait);
  return sl_test_summary("isolate");
}
