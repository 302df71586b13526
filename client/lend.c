/* lend.c - libsublet: the owner's lending: the Lend itself, offers, a local lend (the region
 * lent to its own client and borrowed in the same step), and the loan's end (Reclaim,
 * Withdraw, and the rescue when subletd died).
 * Floor 6 (client.h's floors). */
#include "client.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "msg.h"

/* ------------------------------------------------------------------ lending */

/* What one Lend asks (sublet_lend_pinned's arguments, pinned converted to page pairs). */
struct sl_lend_args {
  const struct sublet_range *keep;
  size_t nkeep;
  int keep_all;
  uint64_t *pinned; /* (first, count) pairs of region pages, ascending, merged */
  size_t npinned;   /* pairs */
  int local;        /* borrowed by this client in the same step (lend_local) */
  const char *name;
  int timeout_ms;
  uint64_t known_layout; /* local: the layout id of the window this client holds (0: none) */
};

/* Why r cannot be lent as a asks (SUBLET_E*, the thread's last error), or 0. */
static int lend_refused(const sublet_region *r, const struct sl_lend_args *a) {
  /* A plan of a pool arena's pages made while allocations could still take its free pages
   * would lend another tag's new tensor (pool.c, "Loans of the arena"). */
  if (r->torch_blocks && !atomic_load(&r->pool_held))
    return sl_client_fail(SUBLET_EINVAL, "region %llu is a pool arena: lend it under "
                          "sublet_pool_hold(), reading its segments after that call, and "
                          "sublet_pool_unhold() once the loan is reclaimed",
                          (unsigned long long)r->id);
  /* An older subletd would ignore the pinned pages and lend them: the owner's bytes. */
  if (a->npinned > 0 && !r->client->pinned_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot pin pages of a loan (it is "
                          "older than this library): update subletd, or lend without pinned");
  return 0;
}

/* The Lend for a: its keep ranges in the form r's subletd reads best (*keep_fd: the memfd to
 * send with it, or -1). */
static void lend_message(sublet_region *r, const struct sl_lend_args *a, Sublet__Lend *m,
                         int *keep_fd) {
  m->region = r->id;
  sl_keepwire_encode(&r->client->keep, m, a->keep, a->nkeep, a->keep_all, keep_fd);
  m->pinned = a->pinned;
  m->n_pinned = 2 * a->npinned;
  m->has_name = a->name != NULL;
  m->name.data = (uint8_t *)a->name;
  m->name.len = a->name != NULL ? strlen(a->name) : 0;
  m->has_rescue = m->rescue = 1; /* if the daemon dies, this library restores (rescue.c) */
  m->has_local = m->local = a->local != 0;
  m->known_layout = a->known_layout;
  m->has_known_layout = m->known_layout != 0;
  m->has_timeout_ms = a->timeout_ms != 0;
  m->timeout_ms = a->timeout_ms < 0 ? -1 : a->timeout_ms;
}

/* Sends Lend (the caller holds c->lock) and takes Lent's fds: the three of the rescue (kept in
 * r->rescue) and, local (lend_local), Borrowed's release pipe (*release_fd, or -1). */
static int lend_request(sublet_region *r, const struct sl_lend_args *a, Sublet__Reply **rep,
                        int *release_fd) {
  sublet_client *c = r->client;
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;
  int fds[4], keep_fd;
  size_t nfds = 4;
  int rc;

  *release_fd = -1;
  if ((rc = lend_refused(r, a)) != 0)
    return rc;
  lend_message(r, a, &m, &keep_fd);
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  /* The owner's last writes must be in memory before anyone saves or overwrites them. */
  sl_device_synchronize(c->dev, NULL);
  /* The daemon answers by the timeout: the deadline only guards against a lost daemon. */
  rc = sl_client_call_fd(c, &req, keep_fd, SUBLET__REPLY__BODY_LENT, rep, fds, &nfds,
                         m.timeout_ms);
  if (rc == 0 && (nfds < 3 || nfds > 3u + (a->local != 0) ||
                  (a->local && (*rep)->lent->borrowed == NULL))) {
    sl_wire_close_fds(fds, nfds);
    return sl_client_fail(SUBLET_EPROTO, "subletd answered Lend with %zu fds%s: is it older "
                          "than this library?", nfds, a->local ? " and no window" : "");
  }
  if (rc != 0)
    return rc;
  *release_fd = nfds == 4 ? fds[3] : -1;
  sl_rescue_free(r->rescue); /* a new loan of the region: an earlier one has ended */
  r->rescue = NULL;
  if ((rc = sl_rescue_new((*rep)->lent->loan, fds, &r->rescue)) != 0)
    sl_wire_close_fds(fds, 3);
  return rc;
}

/* An offer: the loan's id and token. */
static int lend_offer(sublet_region *r, const struct sl_lend_args *a, uint64_t *loan_id,
                      uint8_t token[SUBLET_TOKEN_SIZE]) {
  Sublet__Reply *rep = NULL;
  int release_fd, rc = lend_request(r, a, &rep, &release_fd);

  if (rc == 0) {
    *loan_id = rep->lent->loan;
    if (token != NULL)
      memcpy(token, rep->lent->token.data, SUBLET_TOKEN_SIZE);
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* An offer of r (not local): pinned converted, then the Lend under c->lock. */
static int lend_pinned_offer(sublet_region *r, const struct sl_lend_args *a,
                             const struct sublet_range *pinned, size_t npinned,
                             uint64_t *loan_id, uint8_t token[SUBLET_TOKEN_SIZE]) {
  struct sl_lend_args own = *a;
  int rc = sl_pages_pairs(r, pinned, npinned, &own.pinned, &own.npinned);

  if (rc != 0)
    return rc;
  pthread_mutex_lock(&r->client->lock);
  rc = lend_offer(r, &own, loan_id, token);
  pthread_mutex_unlock(&r->client->lock);
  free(own.pinned);
  return rc;
}

SUBLET_EXPORT int sublet_lend(sublet_region *r, const struct sublet_range *keep, size_t n,
                              int keep_all, const char *name, uint64_t *loan_id,
                              uint8_t token[SUBLET_TOKEN_SIZE]) {
  return sublet_lend_wait(r, keep, n, keep_all, name, 0, loan_id, token);
}

SUBLET_EXPORT int sublet_lend_wait(sublet_region *r, const struct sublet_range *keep, size_t n,
                                   int keep_all, const char *name, int timeout_ms,
                                   uint64_t *loan_id, uint8_t token[SUBLET_TOKEN_SIZE]) {
  struct sl_lend_args a = {.keep = keep, .nkeep = n, .keep_all = keep_all, .name = name,
                          .timeout_ms = timeout_ms};

  return lend_pinned_offer(r, &a, NULL, 0, loan_id, token);
}

/* ------------------------------------------------------------------ local lends */

/* A local loan, borrowed at once (the caller holds c->lock): *lent is its id once lent, even
 * when the borrow failed. */
static int lend_local(sublet_region *r, struct sl_lend_args *a, uint64_t *lent) {
  Sublet__Reply *rep = NULL;
  int release_fd = -1, rc = sl_borrow_check_idle(r->client);

  a->known_layout = sl_borrow_known_layout(r->client);
  if (rc == 0)
    rc = lend_request(r, a, &rep, &release_fd);
  if (rc == 0) {
    *lent = rep->lent->loan;
    rc = sl_borrow_take(r->client, rep->lent->borrowed, release_fd);
  } else if (release_fd >= 0) {
    close(release_fd);
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* The region lent to its own client: pinned converted, then the Lend under the lock. */
static int lend_here(sublet_region *r, struct sl_lend_args *a, const struct sublet_range *pinned,
                     size_t npinned, uint64_t *loan_id) {
  sublet_client *c = r->client;
  uint64_t lent = 0;
  int rc = sl_pages_pairs(r, pinned, npinned, &a->pinned, &a->npinned);

  if (rc != 0)
    return rc;
  pthread_mutex_lock(&c->lock);
  rc = lend_local(r, a, &lent);
  pthread_mutex_unlock(&c->lock);
  free(a->pinned);
  if (rc == 0)
    *loan_id = lent;
  else if (lent != 0) { /* lent, then given straight back: its end is ours to take */
    struct sl_err saved = *sl_client_last_error();
    sublet_reclaim(c, lent, -1, NULL);
    *sl_client_last_error() = saved;
  }
  return rc;
}

SUBLET_EXPORT int sublet_lend_pinned(sublet_region *r, const struct sublet_range *keep,
                                     size_t n, int keep_all, const struct sublet_range *pinned,
                                     size_t npinned, int local, const char *name,
                                     int timeout_ms, uint64_t *loan_id,
                                     uint8_t token[SUBLET_TOKEN_SIZE]) {
  struct sl_lend_args a = {.keep = keep, .nkeep = n, .keep_all = keep_all, .local = local != 0,
                           .name = name, .timeout_ms = timeout_ms};

  if (local)
    return lend_here(r, &a, pinned, npinned, loan_id);
  return lend_pinned_offer(r, &a, pinned, npinned, loan_id, token);
}

SUBLET_EXPORT int sublet_lend_local(sublet_region *r, const struct sublet_range *keep, size_t n,
                                    int keep_all, uint64_t *loan_id) {
  return sublet_lend_local_wait(r, keep, n, keep_all, 0, loan_id);
}

SUBLET_EXPORT int sublet_lend_local_wait(sublet_region *r, const struct sublet_range *keep,
                                         size_t n, int keep_all, int timeout_ms,
                                         uint64_t *loan_id) {
  return sublet_lend_pinned(r, keep, n, keep_all, NULL, 0, 1, NULL, timeout_ms, loan_id, NULL);
}

/* ------------------------------------------------------------------ a loan's end */

/* The region whose loan this is, if this library can restore it without the daemon. */
static struct sublet_region *rescuable(sublet_client *c, uint64_t loan_id) {
  for (struct sublet_region *r = c->regions; r != NULL; r = r->next)
    if (r->rescue != NULL && sl_rescue_loan(r->rescue) == loan_id)
      return r;
  return NULL;
}

/* The loan is over, one way or the other: its rescue fds go. */
static void loan_over(sublet_client *c, uint64_t loan_id) {
  struct sublet_region *r = rescuable(c, loan_id);

  if (r != NULL) {
    sl_rescue_free(r->rescue);
    r->rescue = NULL;
  }
}

/* The loan's end gave the region fresh pages (Reclaimed.replaced): they are mapped now. */
static int replaced_pages(sublet_client *c, uint64_t loan_id, const Sublet__LoanStats *m) {
  struct sublet_region *r = rescuable(c, loan_id);

  if (r == NULL)
    return sl_client_fail(SUBLET_EPROTO, "subletd replaced pages of loan %llu, whose region "
                          "this client does not know", (unsigned long long)loan_id);
  return sl_pages_remap(c, r, m->replaced, m->n_replaced);
}

/* *awaits_fresh: subletd said the loan's end waits for memory for fresh pages
 * (Error.awaits_fresh_pages; an older subletd never says it). */
static int reclaim_request(sublet_client *c, uint64_t loan_id, int timeout_ms,
                           struct sublet_loan_stats *stats, int *awaits_fresh) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Reclaim m = SUBLET__RECLAIM__INIT;
  Sublet__Reply *rep;
  int rc;

  m.loan = loan_id;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms;
  req.body_case = SUBLET__REQUEST__BODY_RECLAIM;
  req.reclaim = &m;
  /* The daemon answers at the timeout; the socket wait only guards against a lost daemon. */
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_RECLAIMED, &rep, NULL, NULL, timeout_ms);
  *awaits_fresh = rc == SUBLET_ENOMEM && rep != NULL &&
                  rep->body_case == SUBLET__REPLY__BODY_ERROR && rep->error->awaits_fresh_pages > 0;
  if (rc == 0 && stats != NULL)
    sl_msg_stats_from_proto(rep->reclaimed, stats);
  if (rc == 0 && rep->reclaimed->n_replaced > 0)
    rc = replaced_pages(c, loan_id, rep->reclaimed);
  /* Everything saved comes back: anything less means the daemon's restore failed. */
  if (rc == 0 && rep->reclaimed->copied_in_bytes != rep->reclaimed->copied_out_bytes)
    rc = sl_client_fail(SUBLET_EDEVICE, "subletd could not restore the kept bytes of loan "
                        "%llu (its log says why): the tensor's kept data is not intact",
                        (unsigned long long)loan_id);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Reclaim, and once more when the loan's end (a borrower of another user) waits for device
 * memory for its fresh pages: on CUDA a page's memory is freed only once every process has let
 * go of it, and this process still maps and holds the old pages the borrower was granted (it
 * remaps them only at Reclaimed), so on a device that cannot hold them twice the end would wait
 * for memory this very process holds, for ever. Those pages hold nothing of the owner's (their
 * kept bytes were moved or saved before the grant; the restore writes into the fresh pages),
 * so this process lets go of them (the journal's GRANT entries, as its rescue does) and asks
 * again within what is left of the timeout. The holes stay until the Reclaim that succeeds
 * maps the fresh pages there (remap_page), or the rescue makes pages of its own if subletd
 * dies first; while the borrower still maps the old pages, the end still waits: ENOMEM, and a
 * later Reclaim finds the pages let go of already. */
static int reclaim_fresh(sublet_client *c, uint64_t loan_id, int timeout_ms,
                         struct sublet_loan_stats *stats) {
  int64_t t0 = sl_clock_ms();
  int fresh = 0, rc = reclaim_request(c, loan_id, timeout_ms, stats, &fresh), left;
  struct sublet_region *r = fresh ? rescuable(c, loan_id) : NULL;
  struct sl_err first;

  if (r == NULL)
    return rc;
  first = *sl_client_last_error();
  sl_pages_drop_window(c, r); /* it would map the pages let go of (none for another user) */
  if (sl_rescue_let_go_granted(r) != 1) {
    *sl_client_last_error() = first; /* the ENOMEM, with subletd's why: reclaim again */
    return rc;
  }
  /* No time left to ask: the end may well complete now, so "call again" (ETIMEDOUT), as any
   * wait that ran out says, not ENOMEM (which a caller takes for "free memory first"). */
  if ((left = sl_clock_left_ms(t0, timeout_ms)) == 0)
    return sl_client_fail(SUBLET_ETIMEDOUT, "loan %llu has not ended yet: its end waited for "
                          "memory for fresh pages, and this process has let go of the old "
                          "pages it mapped: reclaim again", (unsigned long long)loan_id);
  return reclaim_request(c, loan_id, left, stats, &fresh);
}

SUBLET_EXPORT int sublet_reclaim(sublet_client *c, uint64_t loan_id, int timeout_ms,
                                 struct sublet_loan_stats *stats) {
  struct sublet_region *r;
  int rc = SUBLET_EPIPE;

  pthread_mutex_lock(&c->lock);
  if (!sl_client_gone(c))
    rc = reclaim_fresh(c, loan_id, timeout_ms, stats);
  r = rc != 0 && sl_client_gone(c) ? rescuable(c, loan_id) : NULL;
  if (rc == 0 || rc == SUBLET_EDEVICE)
    loan_over(c, loan_id);
  pthread_mutex_unlock(&c->lock);
  if (r == NULL)
    return rc;
  /* The daemon is gone: this library puts the kept bytes back itself. Unlocked, because the
   * borrower may be this very client, letting go of the loan's pages (watch.c). */
  rc = sl_rescue_run(r, timeout_ms, stats);
  if (rc == SUBLET_EDAEMONDIED) {
    pthread_mutex_lock(&c->lock);
    loan_over(c, loan_id);
    pthread_mutex_unlock(&c->lock);
  }
  return rc;
}

SUBLET_EXPORT int sublet_withdraw(sublet_client *c, uint64_t loan_id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Withdraw m = SUBLET__WITHDRAW__INIT;
  int rc;

  m.loan = loan_id;
  req.body_case = SUBLET__REQUEST__BODY_WITHDRAW;
  req.withdraw = &m;
  pthread_mutex_lock(&c->lock);
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_OK, NULL, NULL, NULL, 0);
  if (rc == 0)
    loan_over(c, loan_id);
  pthread_mutex_unlock(&c->lock);
  return rc;
}
