/* handlers.c - what subletd does for each request, between the books and the pool: the
 * dispatch, a table of one handler per request (sl_handlers_fn, indexed by the request's body
 * case, as dbus-broker's driver table), and the small handlers. The larger requests have files
 * of their own: Lend and Borrow lends.c's, Alloc allocs.c's, the region requests regions.c's,
 * a Lend with release, Resume and ReleaseMore releases.c's, release offers release_offers.c's.
 *
 * Each handler checks its arguments, asks the books, does the device work the books name, and
 * answers. Requests that wait (Borrow with a timeout, Reclaim, every Lend) park a waiter
 * (waiters.c), answered when an offer is posted, the loan ends or the device is free (a Lend's
 * turn), when its timer fires, or when its client cancels it.
 *
 * Floor 9 (daemon.h's floors).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"
#include "msg.h"

static int on_hello(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Hello *m = r->hello;
  const struct sl_device_info *info = sl_device_info(x->d->dev);
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Welcome w = SUBLET__WELCOME__INIT;
  uint64_t free_bytes = 0;
  int rc;

  if (m->protocol != SUBLET_PROTOCOL_VERSION)
    return sl_err_set(&x->err, SUBLET_EVERSION,
                      "subletd speaks protocol %d, the client %u: install matching versions "
                      "of sublet and subletd", SUBLET_PROTOCOL_VERSION, m->protocol);
  if (x->c->client_id != 0)
    return sl_err_set(&x->err, SUBLET_EPROTO, "Hello sent twice on one connection");
  rc = sl_device_free_bytes(x->d->dev, &free_bytes, &x->err);
  if (rc == 0)
    rc = sl_books_client_add(x->d->books, &x->c->peer, &x->c->client_id);
  if (rc != 0)
    return rc;
  if (m->client_name != NULL)
    snprintf(x->c->name, sizeof(x->c->name), "%s", m->client_name);
  if (m->notices)
    sl_books_client_notices(x->d->books, x->c->client_id);
  w.has_notices = w.notices = m->notices;
  w.protocol = SUBLET_PROTOCOL_VERSION;
  w.daemon_version = (char *)SUBLET_VERSION_STRING;
  w.backend = (char *)info->backend;
  w.device_uuid.data = (uint8_t *)info->uuid;
  w.device_uuid.len = sizeof(info->uuid);
  w.device_name = (char *)info->name;
  w.device_ordinal = (uint32_t)info->ordinal;
  w.page_size = info->page_size;
  w.total_bytes = info->total_bytes;
  w.free_bytes = free_bytes;
  w.client_id = x->c->client_id;
  w.has_cancel = w.cancel = 1;
  w.has_keep_ranges = w.keep_ranges = 1;
  w.has_keep_fd = w.keep_fd = 1;
  w.has_grow = w.grow = 1;
  w.has_pinned = w.pinned = 1;
  w.has_release = w.release = 1;
  w.has_release_offer = w.release_offer = 1;
  w.has_early_resume = w.early_resume = 1;
  w.has_pin_ahead = w.pin_ahead = 1;
  w.has_release_need = w.release_need = 1;
  w.has_release_more = w.release_more = 1;
  w.has_take_need = w.take_need = 1;
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_WELCOME;
  rep.welcome = &w;
  sl_conn_send(x->c, &rep, NULL, 0);
  return 0;
}

static int on_pin_ahead(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__PinAhead *m = r->pin_ahead;
  int rc = sl_pins_request(x->d, x->c->peer.uid, m->bytes, m->release, &x->err);

  if (rc == 0)
    sl_conn_send_ok(x->c, x->id);
  return rc;
}

static int on_reclaim(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Reclaim *m = r->reclaim;
  struct sl_ended *e = sl_waiters_ended_take(x->c, m->loan);
  struct sl_waiter *w;
  int rc;

  if (e != NULL) {
    sl_conn_send_stats(x->c, x->id, 0, &e->stats, e->replaced, e->nreplaced);
    sl_waiters_ended_free(e);
    return 0;
  }
  rc = sl_books_loan_owned(x->d->books, x->c->client_id, m->loan, &x->err);
  if (rc == SUBLET_ENOENT && sl_endings_pending(x->d, m->loan, x->c->client_id))
    rc = 0; /* ended, its restore still running: the reply comes when it is done */
  if (rc != 0)
    return rc;
  if (m->timeout_ms == 0 && sl_endings_stalled_answer(x->d, x->c, x->id, m->loan))
    return 0;
  if (m->timeout_ms == 0)
    return sl_err_set(&x->err, SUBLET_ETIMEDOUT, "loan %llu has not ended yet",
                      (unsigned long long)m->loan);
  w = sl_waiters_park(x->c, SL_WAIT_RECLAIM, x->id, m->timeout_ms);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  w->loan_id = m->loan;
  return 0;
}

static int on_withdraw(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Withdraw *m = r->withdraw;
  int rc = sl_books_withdraw(x->d->books, x->c->client_id, m->loan, &x->err);

  if (rc == 0) {
    sl_rescue_prune(x->d, sl_endings_pending);
    sl_conn_send_ok(x->c, x->id);
  }
  return rc;
}

static int on_free(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Free *m = r->free;
  uint64_t size;
  int rc = sl_books_free_alloc(x->d->books, x->c->client_id, m->alloc, &size, &x->err);

  if (rc == 0)
    sl_conn_send_ok(x->c, x->id);
  return rc;
}

/* Answers ELEAK with the live allocations (listed before a forced end forgets them) and, when
 * the loan ended all the same, its stats. */
static void reply_leaks(struct sl_conn *c, uint64_t id, const char *msg,
                        const struct sublet_leak *leaks, size_t n,
                        const struct sublet_loan_stats *ended) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Error e = SUBLET__ERROR__INIT;
  Sublet__LoanStats st;
  Sublet__Leak *msgs = calloc(n + 1, sizeof(*msgs));
  Sublet__Leak **ptrs = calloc(n + 1, sizeof(*ptrs));

  for (size_t i = 0; msgs != NULL && ptrs != NULL && i < n; i++) {
    sublet__leak__init(&msgs[i]);
    msgs[i].alloc = leaks[i].alloc_id;
    msgs[i].size = leaks[i].size;
    ptrs[i] = &msgs[i];
    e.n_leaks = i + 1;
  }
  e.leaks = ptrs;
  if (ended != NULL) {
    sl_msg_stats_to_proto(ended, &st);
    e.stats = &st;
  }
  e.code = SUBLET_ELEAK;
  e.message = (char *)msg;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_ERROR;
  rep.error = &e;
  sl_conn_send(c, &rep, NULL, 0);
  free(msgs);
  free(ptrs);
}

/* A Return's answer, given once the loan's kept bytes are back. */
struct return_answer {
  uint64_t id;
  int leaked;
  char msg[sizeof(((struct sl_err *)0)->msg)];
  struct sublet_leak *leaks;
  size_t nleaks;
};

static void answer_return(struct sl_conn *c, void *arg, const struct sublet_loan_stats *s) {
  struct return_answer *ra = arg;

  if (c != NULL && ra->leaked)
    reply_leaks(c, ra->id, ra->msg, ra->leaks, ra->nleaks, s);
  else if (c != NULL)
    sl_conn_send_stats(c, ra->id, 1, s, NULL, 0);
  free(ra->leaks);
  free(ra);
}

static int on_return(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Return *m = r->return_;
  uint64_t loan = sl_books_client_loan(x->d->books, x->c->client_id);
  size_t nleaks = loan != 0 ? sl_books_leaks(x->d->books, loan, NULL, 0) : 0;
  struct return_answer *ra = calloc(1, sizeof(*ra));
  struct sl_loan_end end = {0};
  int rc;

  if (ra == NULL || (ra->leaks = calloc(nleaks + 1, sizeof(*ra->leaks))) == NULL) {
    free(ra);
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  }
  ra->nleaks = sl_books_leaks(x->d->books, loan, ra->leaks, nleaks);
  rc = sl_books_return(x->d->books, x->c->client_id, m->force, &end, &x->err);
  if (rc == SUBLET_ELEAK && end.loan_id == 0) { /* not forced: the loan goes on */
    reply_leaks(x->c, x->id, x->err.msg, ra->leaks, ra->nleaks, NULL);
    rc = 0;
  } else if (end.loan_id != 0) { /* answered once the kept bytes are back */
    ra->id = x->id;
    ra->leaked = rc == SUBLET_ELEAK;
    snprintf(ra->msg, sizeof(ra->msg), "%s", x->err.msg);
    sl_endings_start(x->d, &end, x->c, answer_return, ra);
    return 0;
  }
  free(ra->leaks);
  free(ra);
  return rc;
}

/* A Lend lends, or (release) releases: releases.c's, which needs no turn on the device. */
static int on_lend(struct sl_req *x, const Sublet__Request *r) {
  return r->lend->release ? sl_releases_lend(x, r) : sl_lends_lend(x, r);
}

/* Every request's handler, by its body's case (sublet.proto's field number). Cancel is not
 * here: dispatch answers it before the one-wait check, and it has no reply of its own. */
static const sl_handlers_fn handlers[] = {
  [SUBLET__REQUEST__BODY_HELLO] = on_hello,
  [SUBLET__REQUEST__BODY_REGION_CREATE] = sl_regions_create,
  [SUBLET__REQUEST__BODY_REGION_GROW] = sl_regions_grow,
  [SUBLET__REQUEST__BODY_PAGES_GET] = sl_regions_pages_get,
  [SUBLET__REQUEST__BODY_REGION_RELEASE] = sl_regions_release,
  [SUBLET__REQUEST__BODY_DROPPED] = sl_regions_dropped,
  [SUBLET__REQUEST__BODY_LEND] = on_lend, /* may take its keep */
  [SUBLET__REQUEST__BODY_RECLAIM] = on_reclaim,
  [SUBLET__REQUEST__BODY_WITHDRAW] = on_withdraw,
  [SUBLET__REQUEST__BODY_BORROW] = sl_lends_borrow,
  [SUBLET__REQUEST__BODY_ALLOC] = sl_allocs_alloc,
  [SUBLET__REQUEST__BODY_FREE] = on_free,
  [SUBLET__REQUEST__BODY_RETURN] = on_return,
  [SUBLET__REQUEST__BODY_STATS_GET] = sl_status_reply,
  [SUBLET__REQUEST__BODY_RESUME] = sl_releases_resume,
  [SUBLET__REQUEST__BODY_RESUME_END] = sl_releases_resume_end,
  [SUBLET__REQUEST__BODY_RELEASE_MORE] = sl_releases_more,
  [SUBLET__REQUEST__BODY_RELEASE_OFFER] = sl_release_offers_offer,
  [SUBLET__REQUEST__BODY_OFFER_STEP] = sl_release_offers_step,
  [SUBLET__REQUEST__BODY_TAKE] = sl_release_offers_take,
  [SUBLET__REQUEST__BODY_TAKE_WAIT] = sl_release_offers_take_wait,
  [SUBLET__REQUEST__BODY_GIVE_BACK] = sl_release_offers_give_back,
  [SUBLET__REQUEST__BODY_TAKE_MORE] = sl_release_offers_take_more,
  [SUBLET__REQUEST__BODY_PIN_AHEAD] = on_pin_ahead,
};

static int dispatch(struct sl_req *x, const Sublet__Request *r) {
  size_t body = (size_t)r->body_case;

  if (r->body_case != SUBLET__REQUEST__BODY_HELLO && x->c->client_id == 0)
    return sl_err_set(&x->err, SUBLET_EPROTO, "the first request must be Hello");
  if (r->body_case == SUBLET__REQUEST__BODY_CANCEL) { /* no reply of its own */
    sl_waiters_cancel_request(x->c, r->cancel->request);
    return 0;
  }
  if (x->c->waiting)
    return sl_err_set(&x->err, SUBLET_EBUSY, "a Borrow, Reclaim or Lend of this connection is "
                      "still waiting: wait for its reply (or cancel it) before sending more");
  if (body >= sizeof(handlers) / sizeof(handlers[0]) || handlers[body] == NULL)
    return sl_err_set(&x->err, SUBLET_EPROTO, "unknown request (body %d): this subletd "
                      "is older than the client; upgrade subletd", (int)r->body_case);
  return handlers[body](x, r);
}

void sl_handlers_request(struct sl_conn *c, const Sublet__Request *req, const int *fds,
                         size_t nfds) {
  struct sl_req x = {.c = c, .d = c->d, .id = req->id, .keep_fd = -1};
  double t0 = sl_clock_now();
  int rc;

  /* The one fd a request may carry is a Lend's keep memfd; any other that came is closed, and
   * that is an error. */
  if (nfds == 1 && req->body_case == SUBLET__REQUEST__BODY_LEND) {
    x.keep_fd = fds[0];
    rc = dispatch(&x, req);
  } else if (nfds > 0) {
    sl_wire_close_fds((int *)fds, nfds);
    rc = sl_err_set(&x.err, SUBLET_EPROTO, "this request carries no fds, it had %zu", nfds);
  } else {
    rc = dispatch(&x, req);
  }
  if (x.keep_fd >= 0)
    close(x.keep_fd); /* not taken: the Lend failed, or it was not one */
  if (rc != 0) {
    sl_debug("pid %d: request %llu failed: %s", (int)c->peer.pid, (unsigned long long)req->id,
             x.err.msg);
    sl_conn_send_error(c, req->id, &x.err);
    if (rc == SUBLET_EVERSION)
      sl_conn_close(c); /* PROTOCOL.md: answered, then the connection closes */
  }
  sl_waiters_device_free(c->d); /* it may have ended the loan, or left a Lend first */
  sl_daemon_check_books(c->d, req->id);
  /* Where a loan's time goes, for --log-level debug: the loop's share of each request. */
  sl_debug("pid %d: request %llu (body %d) took %.3f ms on the loop", (int)c->peer.pid,
           (unsigned long long)req->id, (int)req->body_case, 1e3 * (sl_clock_now() - t0));
}

/* A connection went: its part in the books, then in the release offers (an owner's or a
 * taker's: the other side hears of it). */
static void on_gone(struct sl_conn *c) {
  sl_endings_disconnect(c);
  sl_release_offers_gone(c);
}

const struct sl_conn_ops sl_handlers = {.request = sl_handlers_request, .gone = on_gone};
