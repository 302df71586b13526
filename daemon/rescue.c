/* rescue.c - what lets a loan's owner put its kept bytes back itself if subletd dies.
 *
 * Per loan whose owner asked for it (Lend.rescue): the journal (common/journal.h) of what was
 * saved where, the host save area it points into (the pool's memfd), and a release pipe. The
 * owner gets the journal's and the save area's fds read-only and the pipe's read end at Lend;
 * the borrower gets the write end at Borrow, and writes one byte to it once it has stopped
 * touching the loan's pages after losing the daemon (then closes it; its exit closes it too).
 * The daemon holds the write end until a borrower has it, so the owner reads end-of-file at
 * once if the daemon dies before anyone borrowed. Every fd here is the daemon's until sent;
 * sending does not give it away (the receiver gets its own), so the caller closes what it sent.
 *
 * Floor 2 (daemon.h's floors).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "journal.h"
#include "log.h"
#include "seal.h"

struct sl_rescue {
  uint64_t loan_id;
  struct sl_journal *journal;
  int release_w;  /* the release pipe's write end, until a borrower has it; or -1 */
  struct sl_rescue *next;
};

static struct sl_rescue *find(const struct sl_daemon *d, uint64_t loan_id) {
  for (struct sl_rescue *r = d->rescues; r != NULL; r = r->next)
    if (r->loan_id == loan_id)
      return r;
  return NULL;
}

static void rescue_free(struct sl_rescue *r) {
  sl_journal_free(r->journal);
  if (r->release_w >= 0)
    close(r->release_w);
  free(r);
}

/* A read-only fd of the same file, so that the owner cannot write what it only reads. Only a
 * file sealed read-only (common/seal.h) goes out: the fd's mode alone holds nothing, since its
 * holder may reopen it writable through /proc/self/fd (issue 25); anything else fails with
 * EPERM. Where /proc is not mounted, a copy of the fd itself (the seals hold for it too). */
int sl_rescue_read_only_fd(int fd) {
  char path[64];
  int ro;

  if (!sl_seal_is_read_only(fd)) {
    errno = EPERM;
    return -1;
  }
  snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
  ro = open(path, O_RDONLY | O_CLOEXEC);
  return ro >= 0 ? ro : fcntl(fd, F_DUPFD_CLOEXEC, 0);
}

static int pair_fail(int fds[3], struct sl_rescue *r, struct sl_err *err) {
  int e = errno;

  for (int i = 0; i < 3; i++)
    if (fds[i] >= 0)
      close(fds[i]);
  rescue_free(r);
  return sl_err_set(err, SUBLET_EIO, "cannot set up a loan's rescue fds: %s", strerror(e));
}

int sl_rescue_lend(struct sl_daemon *d, uint64_t loan_id, const struct sl_loan_info *li,
                   uid_t owner_uid, int fds[3], struct sl_err *err) {
  struct sl_rescue *r = calloc(1, sizeof(*r));
  int pipefd[2], area_fd, rc;

  fds[0] = fds[1] = fds[2] = -1;
  if (r == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  r->loan_id = loan_id;
  r->release_w = -1;
  /* A save entry per kept range per page: room for all of them at first (it grows if moves,
   * then saves of moved bytes, need more). */
  rc = sl_journal_create(loan_id, li->region_id, li->keep_ranges + li->kept_pages, &r->journal,
                         err);
  if (rc == 0)
    sl_journal_set_owner(r->journal, owner_uid);
  if (rc == 0)
    rc = sl_pool_host_claim(d->pool, owner_uid, &area_fd, err);
  if (rc != 0) {
    rescue_free(r);
    return rc;
  }
  if (pipe2(pipefd, O_CLOEXEC) != 0)
    return pair_fail(fds, r, err);
  r->release_w = pipefd[1];
  fds[2] = pipefd[0];
  fds[0] = sl_rescue_read_only_fd(r->journal->fd);
  fds[1] = sl_rescue_read_only_fd(area_fd);
  if (fds[0] < 0 || fds[1] < 0)
    return pair_fail(fds, r, err);
  r->next = d->rescues;
  d->rescues = r;
  return 0;
}

int sl_rescue_has(const struct sl_daemon *d, uint64_t loan_id) {
  return find(d, loan_id) != NULL;
}

int sl_rescue_borrow(struct sl_daemon *d, uint64_t loan_id, const struct sl_peer *borrower) {
  struct sl_rescue *r = find(d, loan_id);
  int fd;

  if (r == NULL)
    return -1;
  sl_journal_set_borrower(r->journal, borrower->pid, borrower->uid);
  fd = r->release_w;
  r->release_w = -1;
  return fd;
}

/* The region pages of window positions [from, to) (the fresh zone has none), as GRANT
 * entries of runs of consecutive pages. Returns how many it wrote to e. */
static size_t grant_entries(const struct sl_daemon *d, uint64_t loan_id, uint64_t from,
                            uint64_t to, struct sl_journal_entry *e) {
  uint64_t ps = sl_device_info(d->dev)->page_size, u, f, k;
  const uint64_t *pages;
  size_t n = 0;

  if (sl_books_loan_layout(d->books, loan_id, &pages, &u, &f, &k) != 0)
    return 0;
  for (uint64_t pos = from; pos < to; pos++) {
    uint64_t page = pos < u ? pages[pos] : pos >= u + f ? pages[pos - f] : UINT64_MAX;
    if (page == UINT64_MAX)
      continue;
    if (n > 0 && e[n - 1].src + e[n - 1].len == page * ps)
      e[n - 1].len += ps;
    else
      e[n++] = (struct sl_journal_entry){SL_JOURNAL_GRANT, 0, page * ps, 0, ps};
  }
  return n;
}

/* The grant's moves, saves and the region pages it hands out for the first time (positions
 * from the loan's hwm on: those below were granted before), written for one commit: an owner
 * that gives a granted page fresh memory finds in the journal all that page held. They are
 * written where the owner reads them (150,000 moves of kept blocks are 5 MB), uncommitted
 * until sl_rescue_emptied_commit. */
int sl_rescue_emptied_write(struct sl_daemon *d, const struct sl_grant *g, size_t *n,
                            struct sl_err *err) {
  struct sl_rescue *r = find(d, g->loan_id);
  struct sl_loan_info li;
  struct sl_journal_entry *e;
  uint64_t from;

  *n = 0;
  if (r == NULL || sl_books_loan_info(d->books, g->loan_id, &li) != 0)
    return 0; /* an owner that did not ask */
  from = li.hwm > g->pos ? li.hwm : g->pos;
  if ((e = sl_journal_reserve(r->journal, g->nmove + g->nsave + g->npages + 1, err)) == NULL)
    return SUBLET_ENOMEM;
  for (size_t i = 0; i < g->nmove; i++)
    e[(*n)++] = (struct sl_journal_entry){SL_JOURNAL_MOVE, 0, g->move[i].src_off,
                                          g->move[i].dst_off, g->move[i].len};
  for (size_t i = 0; i < g->nsave; i++)
    e[(*n)++] = (struct sl_journal_entry){SL_JOURNAL_SAVE, 0, g->save[i].dev_off,
                                          g->save[i].host_off, g->save[i].len};
  if (from < g->pos + g->npages)
    *n += grant_entries(d, g->loan_id, from, g->pos + g->npages, e + *n);
  return 0;
}

void sl_rescue_emptied_commit(struct sl_daemon *d, uint64_t loan_id, size_t n) {
  struct sl_rescue *r = find(d, loan_id);

  if (r != NULL && n > 0)
    sl_journal_commit(r->journal, n);
}

void sl_rescue_end(struct sl_daemon *d, uint64_t loan_id, int restored) {
  struct sl_rescue **link = &d->rescues, *r;

  while ((r = *link) != NULL && r->loan_id != loan_id)
    link = &r->next;
  if (r == NULL)
    return;
  if (restored)
    sl_journal_end(r->journal);
  *link = r->next;
  rescue_free(r);
}

void sl_rescue_prune(struct sl_daemon *d, sl_rescue_ending_fn ending) {
  uint64_t current = sl_books_current_loan(d->books);

  for (struct sl_rescue **link = &d->rescues, *r; (r = *link) != NULL;) {
    if (r->loan_id == current || ending(d, r->loan_id, 0)) {
      link = &r->next;
      continue;
    }
    *link = r->next; /* withdrawn, or its owner left before anyone borrowed */
    rescue_free(r);
  }
}

void sl_rescue_free_all(struct sl_daemon *d) {
  while (d->rescues != NULL) {
    struct sl_rescue *r = d->rescues;
    d->rescues = r->next;
    rescue_free(r);
  }
}
