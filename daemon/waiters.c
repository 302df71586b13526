/* waiters.c - requests that wait: a Borrow until an offer is posted, a Reclaim until its
 * loan ends, a Lend until the device is free (one loan per device); and the ends an owner has
 * not asked about yet.
 *
 * A waiter is answered exactly once: by the event it waits for, by its timer, or not at all
 * when its connection goes first (then it is only freed). Waiters are kept in arrival order,
 * and each kind is served oldest first: owners get the device in the order they asked, among
 * the Lends whose loans are drafted (first_lend).
 *
 * Floor 5 (daemon.h's floors).
 */
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "log.h"

static void free_waiter(uv_handle_t *h) {
  free(h->data);
}

void sl_waiters_done(struct sl_waiter *w) {
  struct sl_waiter **link = &w->d->waiters;

  /* Answering a waiter can close its conn, which ends the conn's waiters: this one too. */
  if (uv_is_closing((uv_handle_t *)&w->timer))
    return;
  while (*link != NULL && *link != w)
    link = &(*link)->next;
  if (*link != NULL)
    *link = w->next;
  w->conn->waiting = 0;
  if (w->lend.drafter != NULL) /* its draft, still being made, has nobody to go to */
    *w->lend.drafter = NULL;
  sl_books_draft_free(w->lend.draft);
  w->lend.draft = NULL;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, free_waiter);
}

static void on_wait_timeout(uv_timer_t *t) {
  struct sl_waiter *w = t->data;
  struct sl_err err;

  if (w->timed_out != NULL)
    w->timed_out(w, &err);
  else if (w->kind == SL_WAIT_RECLAIM)
    sl_err_set(&err, SUBLET_ETIMEDOUT, "loan %llu has not ended yet; it goes on",
               (unsigned long long)w->loan_id);
  else
    sl_err_set(&err, SUBLET_ETIMEDOUT, "no loan was offered in time%s%s",
               w->name[0] ? " under the name " : "", w->name);
  sl_conn_send_error(w->conn, w->req_id, &err);
  sl_waiters_done(w);
}

struct sl_waiter *sl_waiters_park(struct sl_conn *c, enum sl_waiter_kind kind, uint64_t req_id,
                                  int timeout_ms) {
  struct sl_waiter *w = calloc(1, sizeof(*w));

  if (w == NULL)
    return NULL;
  w->d = c->d;
  w->conn = c;
  w->kind = kind;
  w->req_id = req_id;
  uv_timer_init(c->d->loop, &w->timer);
  w->timer.data = w;
  if (timeout_ms >= 0)
    uv_timer_start(&w->timer, on_wait_timeout, (uint64_t)timeout_ms, 0);
  /* At the tail: the list stays oldest first, and the oldest waiter is served first. */
  struct sl_waiter **link = &c->d->waiters;
  while (*link != NULL)
    link = &(*link)->next;
  *link = w;
  c->waiting = 1;
  return w;
}

void sl_waiters_cancel(struct sl_conn *c) {
  struct sl_waiter *w = c->d->waiters, *next;

  for (; w != NULL; w = next) {
    next = w->next;
    if (w->conn == c)
      sl_waiters_done(w);
  }
}

int sl_waiters_cancel_request(struct sl_conn *c, uint64_t req_id) {
  struct sl_err err;

  for (struct sl_waiter *w = c->d->waiters; w != NULL; w = w->next) {
    if (w->conn != c || w->req_id != req_id)
      continue;
    sl_err_set(&err, SUBLET_ECANCELED, "cancelled by the client%s",
               w->kind == SL_WAIT_LEND ? ": nothing was lent" : "");
    sl_conn_send_error(c, req_id, &err);
    sl_waiters_done(w);
    return 1;
  }
  return 0;
}

/* The device's line holds the Lends whose loans are drafted, oldest first. A Lend whose keep
 * list is still being read and sorted (off the loop, for as long as its user's turns take)
 * has no place in it yet: it would hold every owner behind it, another user's too, for a
 * draft that is none of theirs. It takes its place, by its arrival, once drafted. */
static struct sl_waiter *first_lend(const struct sl_daemon *d) {
  for (struct sl_waiter *w = d->waiters; w != NULL; w = w->next)
    if (w->kind == SL_WAIT_LEND && w->lend.draft != NULL)
      return w;
  return NULL;
}

int sl_waiters_lend_first(const struct sl_waiter *w) {
  return first_lend(w->d) == w;
}

size_t sl_waiters_count(const struct sl_daemon *d, enum sl_waiter_kind kind) {
  size_t n = 0;

  for (const struct sl_waiter *w = d->waiters; w != NULL; w = w->next)
    n += w->kind == kind;
  return n;
}

size_t sl_waiters_lends(const struct sl_daemon *d) {
  return sl_waiters_count(d, SL_WAIT_LEND);
}

void sl_waiters_device_free(struct sl_daemon *d) {
  struct sl_waiter *w;

  /* From the head each time: serving one posts an offer, which answers Borrow waiters. */
  while (!d->stopping && sl_books_current_loan(d->books) == 0 && (w = first_lend(d)) != NULL) {
    if (!w->conn->closed) /* a closing connection's Lend would only be withdrawn */
      w->lend.serve(w);
    sl_waiters_done(w);
  }
}

static struct sl_conn *conn_of_client(struct sl_daemon *d, uint64_t client_id) {
  for (struct sl_conn *c = d->conns; c != NULL; c = c->next)
    if (c->client_id == client_id)
      return c;
  return NULL;
}

/* The owner learns of the end through its waiting Reclaim, or its next one. */
int sl_waiters_loan_ended(struct sl_daemon *d, const struct sublet_loan_stats *s,
                          uint64_t owner_client, const uint64_t *replaced, size_t n) {
  struct sl_conn *owner = conn_of_client(d, owner_client);
  struct sl_ended *e;

  if (owner == NULL)
    return 0;
  for (struct sl_waiter *w = d->waiters; w != NULL; w = w->next) {
    if (w->kind == SL_WAIT_RECLAIM && w->conn == owner && w->loan_id == s->loan_id) {
      sl_conn_send_stats(owner, w->req_id, 0, s, replaced, n);
      sl_waiters_done(w);
      return 1;
    }
  }
  e = calloc(1, sizeof(*e));
  if (e != NULL && n > 0 && (e->replaced = malloc(n * sizeof(*replaced))) == NULL) {
    free(e);
    e = NULL;
  }
  if (e == NULL) {
    sl_error("out of host memory: the owner of loan %llu will not hear of its end",
             (unsigned long long)s->loan_id);
    return 0;
  }
  e->stats = *s;
  if (n > 0)
    memcpy(e->replaced, replaced, n * sizeof(*replaced));
  e->nreplaced = n;
  e->next = owner->ended;
  owner->ended = e;
  return 0;
}

void sl_waiters_reclaim_failed(struct sl_daemon *d, uint64_t owner_client, uint64_t loan_id,
                               const struct sl_err *err, uint64_t fresh_pages) {
  struct sl_conn *owner = conn_of_client(d, owner_client);

  for (struct sl_waiter *w = d->waiters; owner != NULL && w != NULL; w = w->next) {
    if (w->kind == SL_WAIT_RECLAIM && w->conn == owner && w->loan_id == loan_id) {
      sl_conn_send_error_fresh(owner, w->req_id, err, fresh_pages);
      sl_waiters_done(w);
      return; /* a connection waits for one request at a time */
    }
  }
}

struct sl_ended *sl_waiters_ended_take(struct sl_conn *c, uint64_t loan) {
  for (struct sl_ended **link = &c->ended; *link != NULL; link = &(*link)->next) {
    struct sl_ended *e = *link;
    if (e->stats.loan_id == loan) {
      *link = e->next;
      return e;
    }
  }
  return NULL;
}

void sl_waiters_ended_free(struct sl_ended *e) {
  if (e != NULL)
    free(e->replaced);
  free(e);
}
