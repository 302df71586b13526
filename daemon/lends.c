/* lends.c - a loan's two requests in subletd: Lend, the owner's (its keep list decoded, its
 * loan drafted on the loop or, when the list is long, off it, then waiting its turn for the
 * device, lent and announced), and Borrow, the borrower's (taken now, or when the next offer
 * is posted). handlers.c dispatches them here; the Lend's lists are lend_lists.c's, shared
 * with releases.c's release.
 *
 * Every Lend parks a waiter (waiters.c) at the tail, served when the device is free and its
 * turn comes; a Borrow with a timeout parks one that the next offer may answer.
 *
 * Floor 8 (daemon.h's floors).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "keepwire.h"
#include "log.h"

/* ------------------------------------------------------------------ borrowing */

/* Borrowed, for the borrower c: the window's layout of the loan (b points into the books: send
 * it before the books change), left out when c's window has it already (known_layout).
 * Returns the release pipe's write end for the borrower (rescue). */
static int fill_borrowed(struct sl_conn *c, uint64_t loan, uint64_t known_layout,
                         Sublet__Borrowed *b) {
  struct sl_daemon *d = c->d;
  struct sl_region_info ri;
  struct sl_loan_info li;
  const uint64_t *layout;

  sl_books_loan_info(d->books, loan, &li);
  sl_books_region_info(d->books, li.region_id, &ri);
  sl_books_loan_layout(d->books, loan, &layout, &b->unkept_pages, &b->fresh_pages,
                       &b->kept_pages);
  b->loan = loan;
  b->region = li.region_id;
  b->region_pages = ri.npages;
  b->page_size = sl_device_info(d->dev)->page_size;
  b->has_layout_id = 1;
  b->layout_id = li.layout_id;
  b->layout = known_layout != 0 && known_layout == li.layout_id ? NULL : (uint64_t *)layout;
  b->n_layout = b->layout != NULL ? b->unkept_pages + b->kept_pages : 0;
  b->own_region = ri.owner_client == c->client_id;
  b->has_keep_window = 1;
  b->keep_window = sl_books_kept_window(d->books, c->client_id, li.region_id);
  b->has_pages_version = 1;
  b->pages_version = ri.pages_version;
  sl_info("loan %llu borrowed by pid %d: %llu unkept, %llu fresh, %llu kept pages",
          (unsigned long long)loan, (int)c->peer.pid, (unsigned long long)b->unkept_pages,
          (unsigned long long)b->fresh_pages, (unsigned long long)b->kept_pages);
  return sl_rescue_borrow(d, loan, &c->peer); /* before the borrower can touch a page */
}

/* Answers a Borrow that succeeded with the window's layout. */
static void reply_borrowed(struct sl_conn *c, uint64_t id, uint64_t loan, int rescue,
                           uint64_t known_layout) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Borrowed b = SUBLET__BORROWED__INIT;
  int release_w = fill_borrowed(c, loan, known_layout, &b);

  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_BORROWED;
  rep.borrowed = &b;
  sl_conn_send(c, &rep, &release_w, rescue && release_w >= 0 ? 1 : 0);
  if (release_w >= 0)
    close(release_w); /* sent, or not asked for: the owner reads end-of-file then */
}

/* The Borrow w describes (parked or not): borrowed and answered, or why not. */
static int try_borrow(struct sl_waiter *w, struct sl_err *err) {
  struct sl_conn *c = w->conn;
  uint64_t got;
  int rc = sl_books_borrow(c->d->books, c->client_id, w->loan_id,
                           w->has_token ? w->token : NULL, w->name,
                           sl_daemon_free_pages(c->d, 1), &got, err);

  if (rc == 0)
    reply_borrowed(c, w->req_id, got, w->rescue, w->known_layout);
  return rc;
}

int sl_lends_borrow(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Borrow *m = r->borrow;
  struct sl_waiter ask = {.conn = x->c, .req_id = x->id, .loan_id = m->loan,
                          .has_token = m->has_token, .rescue = m->rescue,
                          .known_layout = m->known_layout}, *w;
  int rc;

  if (m->has_token && m->token.len != SUBLET_TOKEN_SIZE)
    return sl_err_set(&x->err, SUBLET_EINVAL, "a loan's token is %d bytes, not %zu",
                      SUBLET_TOKEN_SIZE, m->token.len);
  if ((rc = sl_daemon_loan_name(&x->err, "a loan name", m->has_name, m->name, ask.name)) != 0)
    return rc;
  if (m->has_token)
    memcpy(ask.token, m->token.data, SUBLET_TOKEN_SIZE);
  rc = try_borrow(&ask, &x->err);
  if (rc != SUBLET_ENOOFFER || m->timeout_ms == 0)
    return rc;
  w = sl_waiters_park(x->c, SL_WAIT_BORROW, x->id, m->timeout_ms);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  w->loan_id = ask.loan_id;
  w->has_token = ask.has_token;
  w->rescue = ask.rescue;
  w->known_layout = ask.known_layout;
  memcpy(w->token, ask.token, SUBLET_TOKEN_SIZE);
  memcpy(w->name, ask.name, sizeof(w->name));
  return 0;
}

void sl_lends_offer_posted(struct sl_daemon *d) {
  struct sl_waiter *w, *next;
  struct sl_err err;

  /* Oldest first (the list is kept in arrival order). A waiter this offer is not for goes
   * on waiting; one it refuses (another user's, say) hears why, and the next one gets a try. */
  for (w = d->waiters; w != NULL; w = next) {
    next = w->next;
    if (w->kind != SL_WAIT_BORROW)
      continue;
    int rc = try_borrow(w, &err);
    if (rc == SUBLET_ENOOFFER)
      continue;
    if (rc != 0)
      sl_conn_send_error(w->conn, w->req_id, &err);
    sl_waiters_done(w);
    if (rc == 0)
      return; /* one loan per device: the offer is taken */
  }
}

/* ------------------------------------------------------------------ lending */

/* Lend.local: the caller borrows its own loan in the same step, so that it is never on
 * offer (a Borrow waiting for the next offer must not take it). Undone if it cannot. */
static int borrow_own(struct sl_req *x, uint64_t loan) {
  uint64_t got;
  int rc = sl_books_borrow(x->d->books, x->c->client_id, loan, NULL, NULL,
                           sl_daemon_free_pages(x->d, 1), &got, &x->err);

  if (rc != 0)
    sl_books_withdraw(x->d->books, x->c->client_id, loan, NULL);
  return rc;
}

/* The save area becomes the owner's user's (an owner's fd never shows another user's bytes);
 * with Lend.rescue, the fds that let the owner restore itself (rescue.c). */
static int lend_setup(struct sl_req *x, uint64_t loan, const struct sl_loan_info *li, int rescue,
                      int fds[3]) {
  int area_fd;
  int rc = rescue ? sl_rescue_lend(x->d, loan, li, x->c->peer.uid, fds, &x->err)
                  : sl_pool_host_claim(x->d->pool, x->c->peer.uid, &area_fd, &x->err);

  if (rc != 0)
    sl_books_withdraw(x->d->books, x->c->client_id, loan, NULL);
  return rc;
}

/* The loan enters the books from the waiter's draft, then is set up and announced. */
static int lend_now(struct sl_req *x, struct sl_waiter *w) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Lent lent = SUBLET__LENT__INIT;
  Sublet__Borrowed b = SUBLET__BORROWED__INIT;
  const struct sl_lend_wait *m = &w->lend;
  struct sl_loan_info li;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan;
  int fds[4] = {-1, -1, -1, -1}, rc;

  if (getrandom(token, sizeof(token), 0) != sizeof(token))
    return sl_err_set(&x->err, SUBLET_EIO, "getrandom: %s", strerror(errno));
  rc = sl_books_lend_draft(x->d->books, x->c->client_id, m->region, m->draft, w->name, token,
                           &loan, &x->err);
  if (rc != 0)
    return rc;
  w->lend.draft = NULL; /* the books' now */
  sl_books_loan_info(x->d->books, loan, &li);
  rc = lend_setup(x, loan, &li, m->rescue, fds);
  if (rc == 0) /* what its saves may need, pinned while the borrower starts (pins.c) */
    sl_pins_ahead(x->d, li.kept_bytes);
  if (rc == 0 && m->local && (rc = borrow_own(x, loan)) != 0 && m->rescue)
    sl_wire_close_fds(fds, 3);
  if (rc != 0)
    return rc;
  lent.loan = loan;
  lent.token.data = token;
  lent.token.len = sizeof(token);
  lent.unkept_pages = li.unkept_pages;
  lent.kept_pages = li.kept_pages;
  lent.kept_bytes = li.kept_bytes;
  if (m->local) { /* its release pipe goes with the rescue fds, as Borrowed's would */
    fds[3] = fill_borrowed(x->c, loan, w->known_layout, &b);
    lent.borrowed = &b;
  }
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_LENT;
  rep.lent = &lent;
  sl_conn_send(x->c, &rep, fds, m->rescue ? (fds[3] >= 0 ? 4 : 3) : 0);
  sl_wire_close_fds(fds, m->rescue ? 3 : 0); /* sent: the owner has its own */
  if (fds[3] >= 0)
    close(fds[3]);
  if (!m->local)
    sl_lends_offer_posted(x->d);
  return 0;
}

/* A waiting Lend's turn (sl_waiters_device_free): lent, or told why not. */
static void serve_lend(struct sl_waiter *w) {
  struct sl_req x = {.c = w->conn, .d = w->d, .id = w->req_id};

  if (lend_now(&x, w) != 0)
    sl_conn_send_error(w->conn, w->req_id, &x.err);
  sl_daemon_check_books(w->d, w->req_id);
}

/* The waiter's draft is there: it is served now if it is first and the device free; else it
 * waits its turn, or (timeout 0) hears at once that the device is busy. */
static void lend_drafted(struct sl_waiter *w) {
  struct sl_err err;
  uint64_t loan = sl_books_current_loan(w->d->books);

  if (w->lend.timeout_ms == 0 && (loan != 0 || !sl_waiters_lend_first(w))) {
    sl_err_set(&err, SUBLET_EBUSY, "the device is busy (%s; %zu lends wait before this one): "
               "one loan at a time; lend with a timeout to wait your turn",
               sl_status_loan_text(w->conn, loan, (char[48]){0}), sl_waiters_lends(w->d) - 1);
    sl_conn_send_error(w->conn, w->req_id, &err);
    sl_waiters_done(w);
    return;
  }
  sl_waiters_device_free(w->d);
}

/* Drafting a loan with a long keep list, off the loop: the ranges (taken over from the
 * request) sorted and merged, the window laid out. */
struct draft_job {
  struct sl_job job; /* first member */
  struct sl_waiter *w; /* NULL once the waiter has gone */
  struct sl_books_config cfg;
  uint64_t npages;
  struct sl_lend_lists lists;
  struct sl_loan *draft;
  double read_s, draft_s; /* of the run: the keep memfd read, then the draft */
};

static void draft_run(struct sl_job *j) {
  struct draft_job *dj = (struct draft_job *)j;
  double t0 = sl_clock_now();
  struct sl_lend_lists *l = &dj->lists;

  j->rc = sl_lend_lists_read(l, &j->err);
  dj->read_s = sl_clock_now() - t0;
  if (j->rc == 0)
    j->rc = sl_lend_lists_draft(l, &dj->cfg, dj->npages, &dj->draft, &j->err);
  dj->draft_s = sl_clock_now() - t0 - dj->read_s;
}

static void draft_done(struct sl_job *j) {
  struct draft_job *dj = (struct draft_job *)j;
  struct sl_waiter *w = dj->w;

  /* Where a long keep list's time goes (issue 23's per-phase notes): the read, the draft. */
  sl_debug("lend draft of %zu keep ranges: read in %.3f ms, drafted in %.3f ms", dj->lists.nkeep,
           1e3 * dj->read_s, 1e3 * dj->draft_s);
  sl_lend_lists_clear(&dj->lists);
  if (w == NULL) {
    sl_books_draft_free(dj->draft);
  } else if (j->rc != 0) {
    w->lend.drafter = NULL;
    sl_conn_send_error(w->conn, w->req_id, &j->err);
    sl_waiters_done(w);
  } else {
    w->lend.drafter = NULL;
    w->lend.draft = dj->draft;
    lend_drafted(w);
  }
  free(dj);
}

/* The keep list goes with the job: the Lend's (protobuf-c allocated it with malloc), or the
 * keep memfd's (x->keep_fd taken). */
static int draft_off_loop(struct sl_req *x, struct sl_waiter *w, Sublet__Lend *m,
                          uint64_t npages) {
  struct draft_job *dj = calloc(1, sizeof(*dj));

  if (dj == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  dj->w = w;
  dj->cfg = *sl_books_cfg(x->d->books);
  dj->npages = npages;
  sl_lend_lists_take(&dj->lists, m, &x->keep_fd);
  dj->job.run = draft_run;
  dj->job.done = draft_done;
  /* Host work of the Lend's user (its turn among that user's), holding the lists meanwhile */
  if (sl_jobs_submit_host(x->d, &dj->job, x->c->peer.uid, sl_lend_lists_bytes(&dj->lists),
                          &x->err) != 0) {
    sl_lend_lists_clear(&dj->lists);
    free(dj);
    return x->err.code;
  }
  w->lend.drafter = &dj->w;
  return 0;
}

/* The text of a waiting Lend's timeout (waiters.c calls it). */
static void lend_timed_out(const struct sl_waiter *w, struct sl_err *err) {
  sl_err_set(err, SUBLET_ETIMEDOUT, "the device was not free within %d ms (%s runs, "
             "%zu other lends wait): nothing was lent; lend again with a longer timeout, or later",
             w->lend.timeout_ms,
             sl_status_loan_text(w->conn, sl_books_current_loan(w->d->books), (char[48]){0}),
             sl_waiters_lends(w->d) - 1);
}

/* Every Lend waits as a waiter, at the tail: served when the device is free and its turn
 * comes (at once, most often), or when its timer fires, or dropped with its connection. */
int sl_lends_lend(struct sl_req *x, const Sublet__Request *r) {
  Sublet__Lend *m = r->lend;
  struct sl_waiter *w;
  uint64_t npages;
  char name[SL_LOAN_NAME_SIZE];
  int timeout = sl_lend_lists_timeout(m);
  int rc = sl_lend_lists_check(m, x->keep_fd, name, &x->err);

  if (rc != 0)
    return rc;
  rc = sl_books_may_lend(x->d->books, x->c->client_id, m->region, &npages, &x->err);
  if (rc != 0)
    return rc;
  w = sl_waiters_park(x->c, SL_WAIT_LEND, x->id, timeout > 0 ? timeout : -1);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  memcpy(w->name, name, sizeof(w->name));
  w->known_layout = m->known_layout;
  w->lend = (struct sl_lend_wait){.region = m->region, .rescue = m->rescue, .local = m->local,
                                  .timeout_ms = timeout, .serve = serve_lend};
  w->timed_out = lend_timed_out;
  if (sl_keepwire_is_long(m, x->keep_fd))
    rc = draft_off_loop(x, w, m, npages);
  else if ((rc = sl_books_draft(sl_books_cfg(x->d->books), npages,
                                (const struct sublet_range *)m->keep, m->n_keep / 2,
                                m->keep_all, m->pinned, m->n_pinned / 2, &w->lend.draft,
                                &x->err)) == 0)
    lend_drafted(w);
  if (rc != 0)
    sl_waiters_done(w);
  return rc;
}
