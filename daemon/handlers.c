/* handlers.c - what subletd does for each request, between the books and the pool.
 *
 * Each handler checks its arguments, asks the books, does the device work the books name, and
 * answers. Requests that wait (Borrow with a timeout, Reclaim) park a waiter, answered when
 * an offer is posted or the loan ends, or when its timer fires.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "msg.h"

enum waiter_kind { WAIT_RECLAIM, WAIT_BORROW };

struct sl_waiter {
  struct sl_daemon *d;
  struct sl_conn *conn;
  enum waiter_kind kind;
  uint64_t req_id;
  uint64_t loan_id;
  uint8_t token[16];
  int has_token;
  char name[64];
  uv_timer_t timer;
  struct sl_waiter *next;
};

struct sl_ended {
  struct sublet_loan_stats stats;
  struct sl_ended *next;
};

/* ------------------------------------------------------------------ replies */

static void reply_ok(struct sl_conn *c, uint64_t id) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Ok ok = SUBLET__OK__INIT;

  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_OK;
  rep.ok = &ok;
  sl_conn_send(c, &rep, NULL, 0);
}

static void reply_stats(struct sl_conn *c, uint64_t id, int returned,
                        const struct sublet_loan_stats *s) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__LoanStats m;

  sl_msg_stats_to_proto(s, &m);
  rep.id = id;
  rep.body_case = returned ? SUBLET__REPLY__BODY_RETURNED : SUBLET__REPLY__BODY_RECLAIMED;
  if (returned)
    rep.returned = &m;
  else
    rep.reclaimed = &m;
  sl_conn_send(c, &rep, NULL, 0);
}

/* ------------------------------------------------------------------ waiters */

static void free_waiter(uv_handle_t *h) {
  free(h->data);
}

static void unlink_waiter(struct sl_waiter *w) {
  struct sl_waiter **link = &w->d->waiters;

  while (*link != NULL && *link != w)
    link = &(*link)->next;
  if (*link != NULL)
    *link = w->next;
  w->conn->waiting = 0;
  uv_timer_stop(&w->timer);
  uv_close((uv_handle_t *)&w->timer, free_waiter);
}

static void on_wait_timeout(uv_timer_t *t) {
  struct sl_waiter *w = t->data;
  struct sl_err err;

  if (w->kind == WAIT_RECLAIM)
    sl_err_set(&err, SUBLET_ETIMEDOUT, "loan %llu has not ended yet; it goes on",
               (unsigned long long)w->loan_id);
  else
    sl_err_set(&err, SUBLET_ETIMEDOUT, "no loan was offered in time%s%s",
               w->name[0] ? " under the name " : "", w->name);
  sl_conn_send_error(w->conn, w->req_id, &err);
  unlink_waiter(w);
}

static struct sl_waiter *park(struct sl_conn *c, enum waiter_kind kind, uint64_t req_id,
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
  w->next = c->d->waiters;
  c->d->waiters = w;
  c->waiting = 1;
  return w;
}

static void cancel_waiters(struct sl_conn *c) {
  struct sl_waiter *w = c->d->waiters, *next;

  for (; w != NULL; w = next) {
    next = w->next;
    if (w->conn == c)
      unlink_waiter(w);
  }
}

/* ------------------------------------------------------------------ loan ends */

static struct sl_conn *conn_of_client(struct sl_daemon *d, uint64_t client_id) {
  for (struct sl_conn *c = d->conns; c != NULL; c = c->next)
    if (c->client_id == client_id)
      return c;
  return NULL;
}

/* The owner learns of the end through its waiting Reclaim, or its next one. */
static void tell_owner(struct sl_daemon *d, const struct sublet_loan_stats *s,
                       uint64_t owner_client) {
  struct sl_conn *owner = conn_of_client(d, owner_client);
  struct sl_ended *e;

  if (owner == NULL)
    return;
  for (struct sl_waiter *w = d->waiters; w != NULL; w = w->next) {
    if (w->kind == WAIT_RECLAIM && w->conn == owner && w->loan_id == s->loan_id) {
      reply_stats(owner, w->req_id, 0, s);
      unlink_waiter(w);
      return;
    }
  }
  e = calloc(1, sizeof(*e));
  if (e == NULL)
    return;
  e->stats = *s;
  e->next = owner->ended;
  owner->ended = e;
}

/* Carries out a loan's end on the device: the kept bytes back, fresh memory released. The
 * final stats go to the owner and, if out is not NULL, to the caller. */
static void finish_loan(struct sl_daemon *d, struct sl_loan_end *end,
                        struct sublet_loan_stats *out) {
  struct sl_err err = {0};
  double secs = 0;
  char size[16];

  if (end->nrestore > 0 &&
      sl_pool_restore(d->pool, end->region_id, end->restore, end->nrestore, &secs, &err) != 0)
    sl_error("loan %llu: restoring kept bytes failed: %s", (unsigned long long)end->loan_id,
             err.msg);
  for (size_t i = 0; i < end->nfresh; i++)
    sl_pool_chunk_release(d->pool, end->fresh_chunks[i]);
  if (end->free_region)
    sl_pool_region_destroy(d->pool, end->region_id);
  end->stats.copy_in_seconds = secs;
  end->stats.copy_out_seconds = d->copy_out_seconds;
  sl_info("loan %llu ended: %s copied out and back%s", (unsigned long long)end->loan_id,
          sl_format_size(size, end->stats.copied_out_bytes),
          end->stats.borrower_died ? " (the borrower died)" : "");
  tell_owner(d, &end->stats, end->owner_client);
  if (out != NULL)
    *out = end->stats;
  sl_loan_end_clear(end);
}

static void drain_done(struct sl_drain *dr) {
  struct sl_daemon *d = dr->d;
  struct sl_drain **link = &d->drains;

  for (size_t i = 0; i < dr->nloans; i++) {
    struct sl_loan_end end = {0};
    if (sl_books_loan_finish(d->books, dr->loans[i], &end) == 0)
      finish_loan(d, &end, NULL);
  }
  while (*link != NULL && *link != dr)
    link = &(*link)->next;
  if (*link != NULL)
    *link = dr->next;
}

static void free_drain(uv_handle_t *h) {
  struct sl_drain *dr = h->data;

  if (dr->pidfd >= 0)
    close(dr->pidfd);
  free(dr->loans);
  free(dr);
}

static void on_drain_exit(uv_poll_t *h, int status, int events) {
  struct sl_drain *dr = h->data;

  sl_info("borrower pid %d has exited: restoring its loan's kept bytes", (int)dr->pid);
  drain_done(dr);
  uv_poll_stop(h);
  uv_close((uv_handle_t *)h, free_drain);
}

/* Without a pidfd: poll until the pid is gone (kill(pid, 0) fails with ESRCH). */
static void on_drain_tick(uv_timer_t *t) {
  struct sl_drain *dr = t->data;

  if (kill(dr->pid, 0) == 0 || errno != ESRCH)
    return;
  drain_done(dr);
  uv_timer_stop(t);
  uv_close((uv_handle_t *)t, free_drain);
}

/* The borrower died: its GPU work may run until its process is gone, so restore only then. */
static void drain_after_exit(struct sl_conn *c, uint64_t *loans, size_t n) {
  struct sl_daemon *d = c->d;
  struct sl_drain *dr = calloc(1, sizeof(*dr));

  if (dr == NULL)
    return;
  dr->d = d;
  dr->pid = c->peer.pid;
  dr->pidfd = c->pidfd;
  c->pidfd = -1;
  dr->loans = malloc(n * sizeof(*loans));
  memcpy(dr->loans, loans, n * sizeof(*loans));
  dr->nloans = n;
  dr->next = d->drains;
  d->drains = dr;
  if (dr->pidfd >= 0) {
    uv_poll_init(d->loop, &dr->poll, dr->pidfd);
    dr->poll.data = dr;
    uv_poll_start(&dr->poll, UV_READABLE, on_drain_exit);
  } else {
    uv_timer_init(d->loop, &dr->timer);
    dr->timer.data = dr;
    uv_timer_start(&dr->timer, on_drain_tick, 10, 10);
  }
}

void sl_handle_shutdown(struct sl_daemon *d) {
  while (d->drains != NULL) {
    struct sl_drain *dr = d->drains;
    drain_done(dr); /* unlinks dr */
    if (dr->pidfd >= 0) {
      uv_poll_stop(&dr->poll);
      uv_close((uv_handle_t *)&dr->poll, free_drain);
    } else {
      uv_timer_stop(&dr->timer);
      uv_close((uv_handle_t *)&dr->timer, free_drain);
    }
  }
}

void sl_handle_disconnect(struct sl_conn *c) {
  struct sl_daemon *d = c->d;
  struct sl_client_gone gone = {0};

  cancel_waiters(c);
  while (c->ended != NULL) {
    struct sl_ended *e = c->ended;
    c->ended = e->next;
    free(e);
  }
  if (c->client_id != 0 && sl_books_client_remove(d->books, c->client_id, &gone) == 0) {
    for (size_t i = 0; i < gone.nfree_regions; i++)
      sl_pool_region_destroy(d->pool, gone.free_regions[i]);
    if (gone.ndraining > 0 && d->stopping) {
      for (size_t i = 0; i < gone.ndraining; i++) {
        struct sl_loan_end end = {0};
        if (sl_books_loan_finish(d->books, gone.draining_loans[i], &end) == 0)
          finish_loan(d, &end, NULL);
      }
    } else if (gone.ndraining > 0) {
      sl_warn("borrower pid %d left mid-loan; its loan ends once the process has exited",
              (int)c->peer.pid);
      drain_after_exit(c, gone.draining_loans, gone.ndraining);
    }
    sl_client_gone_clear(&gone);
  }
  if (c->pidfd >= 0)
    close(c->pidfd);
  c->pidfd = -1;
}

/* ------------------------------------------------------------------ requests */

struct ctx {
  struct sl_conn *c;
  struct sl_daemon *d;
  uint64_t id;
  struct sl_err err;
};

static int on_hello(struct ctx *x, const Sublet__Hello *m) {
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
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_WELCOME;
  rep.welcome = &w;
  sl_conn_send(x->c, &rep, NULL, 0);
  return 0;
}

static int on_region_create(struct ctx *x, const Sublet__RegionCreate *m) {
  uint64_t ps = sl_device_info(x->d->dev)->page_size, total = sl_device_info(x->d->dev)->total_bytes;
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__RegionCreated rc_msg = SUBLET__REGION_CREATED__INIT;
  uint64_t npages, region;
  char a[16], b[16];
  int rc;

  if (m->size == 0 || m->size > total)
    return sl_err_set(&x->err, m->size == 0 ? SUBLET_EINVAL : SUBLET_ENOMEM,
                      "a region of %s cannot be made on a device of %s",
                      sl_format_size(a, m->size), sl_format_size(b, total));
  npages = (m->size + ps - 1) / ps;
  rc = sl_books_region_add(x->d->books, x->c->client_id, npages, &region, &x->err);
  if (rc != 0)
    return rc;
  rc = sl_pool_region_create(x->d->pool, region, npages, &x->err);
  if (rc != 0) {
    sl_books_region_remove(x->d->books, x->c->client_id, region, NULL);
    return rc;
  }
  rc_msg.region = region;
  rc_msg.pages = npages;
  rc_msg.page_size = ps;
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_REGION_CREATED;
  rep.region_created = &rc_msg;
  sl_info("region %llu: %s for pid %d", (unsigned long long)region,
          sl_format_size(a, npages * ps), (int)x->c->peer.pid);
  sl_conn_send(x->c, &rep, NULL, 0);
  return 0;
}

static int on_pages_get(struct ctx *x, const Sublet__PagesGet *m) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Pages pages = SUBLET__PAGES__INIT;
  int fds[SL_WIRE_MAX_FDS];
  int rc;

  if (m->count == 0 || m->count > SL_WIRE_MAX_FDS)
    return sl_err_set(&x->err, SUBLET_E2BIG, "PagesGet asks for %u pages: 1 to %d per request",
                      m->count, SL_WIRE_MAX_FDS);
  rc = sl_books_region_access(x->d->books, x->c->client_id, m->region, &x->err);
  if (rc == 0)
    rc = sl_pool_export_pages(x->d->pool, m->region, m->first, m->count, fds, &x->err);
  if (rc != 0)
    return rc;
  pages.region = m->region;
  pages.first = m->first;
  pages.count = m->count;
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_PAGES;
  rep.pages = &pages;
  sl_conn_send(x->c, &rep, fds, m->count);
  sl_wire_close_fds(fds, m->count); /* sent: the client has its own copies now */
  return 0;
}

static int on_region_release(struct ctx *x, const Sublet__RegionRelease *m) {
  int rc = sl_books_region_remove(x->d->books, x->c->client_id, m->region, &x->err);

  if (rc != 0)
    return rc;
  sl_pool_region_destroy(x->d->pool, m->region);
  reply_ok(x->c, x->id);
  return 0;
}

static int on_lend(struct ctx *x, const Sublet__Lend *m) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Lent lent = SUBLET__LENT__INIT;
  struct sl_loan_info li;
  uint8_t token[16];
  uint64_t loan;
  int rc;

  if (m->n_keep % 2 != 0)
    return sl_err_set(&x->err, SUBLET_EINVAL, "Lend.keep holds (offset, length) pairs: "
                      "an even count, not %zu", m->n_keep);
  if (getrandom(token, sizeof(token), 0) != sizeof(token))
    return sl_err_set(&x->err, SUBLET_EIO, "getrandom: %s", strerror(errno));
  rc = sl_books_lend(x->d->books, x->c->client_id, m->region,
                     (const struct sublet_range *)m->keep, m->n_keep / 2, m->keep_all, m->name,
                     token, &loan, &x->err);
  if (rc != 0)
    return rc;
  sl_books_loan_info(x->d->books, loan, &li);
  lent.loan = loan;
  lent.token.data = token;
  lent.token.len = sizeof(token);
  lent.unkept_pages = li.unkept_pages;
  lent.kept_pages = li.kept_pages;
  lent.kept_bytes = li.kept_bytes;
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_LENT;
  rep.lent = &lent;
  sl_conn_send(x->c, &rep, NULL, 0);
  sl_handle_offer_posted(x->d);
  return 0;
}

static int take_ended(struct sl_conn *c, uint64_t loan, struct sublet_loan_stats *s) {
  for (struct sl_ended **link = &c->ended; *link != NULL; link = &(*link)->next) {
    struct sl_ended *e = *link;
    if (e->stats.loan_id == loan) {
      *s = e->stats;
      *link = e->next;
      free(e);
      return 1;
    }
  }
  return 0;
}

static int on_reclaim(struct ctx *x, const Sublet__Reclaim *m) {
  struct sublet_loan_stats s;
  struct sl_waiter *w;
  int rc;

  if (take_ended(x->c, m->loan, &s)) {
    reply_stats(x->c, x->id, 0, &s);
    return 0;
  }
  rc = sl_books_loan_owned(x->d->books, x->c->client_id, m->loan, &x->err);
  if (rc != 0)
    return rc;
  if (m->timeout_ms == 0)
    return sl_err_set(&x->err, SUBLET_ETIMEDOUT, "loan %llu has not ended yet",
                      (unsigned long long)m->loan);
  w = park(x->c, WAIT_RECLAIM, x->id, m->timeout_ms);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOMEM, "out of host memory");
  w->loan_id = m->loan;
  return 0;
}

static int on_withdraw(struct ctx *x, const Sublet__Withdraw *m) {
  int rc = sl_books_withdraw(x->d->books, x->c->client_id, m->loan, &x->err);

  if (rc == 0)
    reply_ok(x->c, x->id);
  return rc;
}

static uint64_t fresh_pages_available(struct sl_daemon *d) {
  uint64_t ps = sl_device_info(d->dev)->page_size, free_bytes = 0;

  if (sl_device_free_bytes(d->dev, &free_bytes, NULL) != 0 ||
      free_bytes <= d->cfg.reserve_bytes)
    return 0;
  return (free_bytes - d->cfg.reserve_bytes) / ps;
}

/* Answers a Borrow that succeeded with the window's layout. */
static void reply_borrowed(struct sl_conn *c, uint64_t id, uint64_t loan) {
  struct sl_daemon *d = c->d;
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Borrowed b = SUBLET__BORROWED__INIT;
  struct sl_region_info ri;
  struct sl_loan_info li;
  const uint64_t *layout;

  sl_books_loan_info(d->books, loan, &li);
  sl_books_region_info(d->books, li.region_id, &ri);
  sl_books_loan_layout(d->books, loan, &layout, &b.unkept_pages, &b.fresh_pages,
                       &b.kept_pages);
  b.loan = loan;
  b.region = li.region_id;
  b.region_pages = ri.npages;
  b.page_size = sl_device_info(d->dev)->page_size;
  b.layout = (uint64_t *)layout;
  b.n_layout = b.unkept_pages + b.kept_pages;
  b.own_region = ri.owner_client == c->client_id;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_BORROWED;
  rep.borrowed = &b;
  d->copy_out_seconds = 0;
  sl_info("loan %llu borrowed by pid %d: %llu unkept, %llu fresh, %llu kept pages",
          (unsigned long long)loan, (int)c->peer.pid, (unsigned long long)b.unkept_pages,
          (unsigned long long)b.fresh_pages, (unsigned long long)b.kept_pages);
  sl_conn_send(c, &rep, NULL, 0);
}

static int try_borrow(struct sl_conn *c, uint64_t id, uint64_t loan, const uint8_t *token,
                      const char *name, struct sl_err *err) {
  uint64_t got;
  int rc = sl_books_borrow(c->d->books, c->client_id, loan, token, name,
                           fresh_pages_available(c->d), &got, err);

  if (rc == 0)
    reply_borrowed(c, id, got);
  return rc;
}

static int on_borrow(struct ctx *x, const Sublet__Borrow *m) {
  const uint8_t *token = m->has_token ? m->token.data : NULL;
  struct sl_waiter *w;
  int rc;

  if (m->has_token && m->token.len != 16)
    return sl_err_set(&x->err, SUBLET_EINVAL, "a loan's token is 16 bytes, not %zu",
                      m->token.len);
  rc = try_borrow(x->c, x->id, m->loan, token, m->name, &x->err);
  if (rc != SUBLET_ENOOFFER || m->timeout_ms == 0)
    return rc;
  w = park(x->c, WAIT_BORROW, x->id, m->timeout_ms);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOMEM, "out of host memory");
  w->loan_id = m->loan;
  w->has_token = token != NULL;
  if (token != NULL)
    memcpy(w->token, token, 16);
  snprintf(w->name, sizeof(w->name), "%s", m->name ? m->name : "");
  return 0;
}

void sl_handle_offer_posted(struct sl_daemon *d) {
  struct sl_waiter *w, *next;
  struct sl_err err;

  /* Oldest first: waiters are pushed at the head, so walk to find the last match. */
  for (w = d->waiters; w != NULL; w = next) {
    next = w->next;
    if (w->kind != WAIT_BORROW)
      continue;
    int rc = try_borrow(w->conn, w->req_id, w->loan_id, w->has_token ? w->token : NULL,
                        w->name, &err);
    if (rc == SUBLET_ENOOFFER)
      continue;
    if (rc != 0)
      sl_conn_send_error(w->conn, w->req_id, &err);
    unlink_waiter(w);
    return; /* one loan per device: the offer is taken */
  }
}

static int on_alloc(struct ctx *x, const Sublet__Alloc *m) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Allocated a = SUBLET__ALLOCATED__INIT;
  struct sl_grant g = {0};
  double secs = 0;
  int fd = -1, rc;

  rc = sl_books_alloc_plan(x->d->books, x->c->client_id, m->size, &g, &x->err);
  if (rc == 0 && g.fresh_npages > 0)
    rc = sl_pool_chunk_create(x->d->pool, g.fresh_chunk_id, g.fresh_npages, &fd, &x->err);
  if (rc == 0 && g.nsave > 0) {
    struct sl_loan_info li;
    sl_books_loan_info(x->d->books, g.loan_id, &li);
    rc = sl_pool_save(x->d->pool, li.region_id, g.save, g.nsave, &secs, &x->err);
    x->d->copy_out_seconds += secs;
    if (rc != 0 && fd >= 0)
      sl_pool_chunk_release(x->d->pool, g.fresh_chunk_id);
  }
  if (rc != 0) {
    if (fd >= 0)
      close(fd);
    sl_grant_clear(&g);
    return rc;
  }
  a.alloc = g.alloc_id;
  a.pos = g.pos;
  a.pages = g.npages;
  a.has_fresh_pos = a.has_fresh_pages = g.fresh_npages > 0;
  a.fresh_pos = g.fresh_pos;
  a.fresh_pages = g.fresh_npages;
  rc = sl_books_alloc_commit(x->d->books, &g);
  if (rc != 0) { /* cannot happen on one thread: nothing ran between plan and commit */
    if (fd >= 0) {
      close(fd);
      sl_pool_chunk_release(x->d->pool, g.fresh_chunk_id);
    }
    sl_grant_clear(&g);
    return sl_err_set(&x->err, rc, "internal error: an allocation's plan went stale");
  }
  sl_grant_clear(&g);
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_ALLOCATED;
  rep.allocated = &a;
  sl_conn_send(x->c, &rep, &fd, fd >= 0 ? 1 : 0);
  if (fd >= 0)
    close(fd);
  return 0;
}

static int on_free(struct ctx *x, const Sublet__Free *m) {
  uint64_t size;
  int rc = sl_books_free_alloc(x->d->books, x->c->client_id, m->alloc, &size, &x->err);

  if (rc == 0)
    reply_ok(x->c, x->id);
  return rc;
}

/* Answers ELEAK with the live allocations (listed before a forced end forgets them) and, when
 * the loan ended all the same, its stats. */
static void reply_leaks(struct ctx *x, const struct sublet_leak *leaks, size_t n,
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
  e.message = x->err.msg;
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_ERROR;
  rep.error = &e;
  sl_conn_send(x->c, &rep, NULL, 0);
  free(msgs);
  free(ptrs);
}

static int on_return(struct ctx *x, const Sublet__Return *m) {
  uint64_t loan = sl_books_client_loan(x->d->books, x->c->client_id);
  size_t nleaks = loan != 0 ? sl_books_leaks(x->d->books, loan, NULL, 0) : 0;
  struct sublet_leak *leaks = calloc(nleaks + 1, sizeof(*leaks));
  struct sublet_loan_stats s = {0};
  struct sl_loan_end end = {0};
  int rc;

  if (leaks == NULL)
    return sl_err_set(&x->err, SUBLET_ENOMEM, "out of host memory");
  nleaks = sl_books_leaks(x->d->books, loan, leaks, nleaks);
  rc = sl_books_return(x->d->books, x->c->client_id, m->force, &end, &x->err);
  if (end.loan_id != 0)
    finish_loan(x->d, &end, &s);
  if (rc == SUBLET_ELEAK)
    reply_leaks(x, leaks, nleaks, s.loan_id != 0 ? &s : NULL);
  else if (rc == 0)
    reply_stats(x->c, x->id, 1, &s);
  free(leaks);
  return rc == SUBLET_ELEAK ? 0 : rc;
}

static const char *loan_state_name(enum sl_loan_state s) {
  return s == SL_LOAN_OFFERED ? "offered" : s == SL_LOAN_ACTIVE ? "active" : "draining";
}

/* Fills the Status message's regions; the arrays are freed by the caller. */
static int status_regions(struct sl_daemon *d, Sublet__Status *st, Sublet__RegionStatus **msgs) {
  struct sl_books_totals t;
  struct sl_region_info ri;
  uint64_t after = 0;
  size_t n = 0;

  sl_books_totals(d->books, &t);
  *msgs = calloc(t.regions + 1, sizeof(**msgs));
  st->regions = calloc(t.regions + 1, sizeof(*st->regions));
  if (*msgs == NULL || st->regions == NULL)
    return SUBLET_ENOMEM;
  while (n < t.regions && sl_books_region_next(d->books, after, &ri) == 0) {
    Sublet__RegionStatus *r = &(*msgs)[n];
    sublet__region_status__init(r);
    r->region = ri.id;
    r->owner_pid = (uint32_t)ri.owner.pid;
    r->owner_uid = (uint32_t)ri.owner.uid;
    r->pages = ri.npages;
    r->has_loan = ri.loan_id != 0;
    r->loan = ri.loan_id;
    st->regions[n++] = r;
    after = ri.id;
  }
  st->n_regions = n;
  return 0;
}

static void status_loan(struct sl_daemon *d, Sublet__LoanStatus *ls, Sublet__LoanStats *stats) {
  struct sl_loan_info li;

  sl_books_loan_info(d->books, sl_books_current_loan(d->books), &li);
  li.stats.copy_out_seconds = d->copy_out_seconds;
  sl_msg_stats_to_proto(&li.stats, stats);
  ls->loan = li.id;
  ls->region = li.region_id;
  ls->state = (char *)loan_state_name(li.state);
  ls->name = li.name;
  ls->has_borrower_pid = ls->has_borrower_uid = li.borrower_client != 0;
  ls->borrower_pid = (uint32_t)li.borrower.pid;
  ls->borrower_uid = (uint32_t)li.borrower.uid;
  ls->unkept_pages = li.unkept_pages;
  ls->fresh_pages = li.fresh_pages;
  ls->kept_pages = li.kept_pages;
  ls->live_bytes = li.live_bytes;
  ls->stats = stats;
}

static void status_device(struct sl_daemon *d, Sublet__Status *st) {
  const struct sl_device_info *info = sl_device_info(d->dev);
  struct sl_books_totals t;

  sl_books_totals(d->books, &t);
  sl_device_free_bytes(d->dev, &st->free_bytes, NULL);
  st->daemon_version = (char *)SUBLET_VERSION_STRING;
  st->uptime_seconds = sl_now() - d->started;
  st->backend = (char *)info->backend;
  st->device_uuid.data = (uint8_t *)info->uuid;
  st->device_uuid.len = sizeof(info->uuid);
  st->device_name = (char *)info->name;
  st->device_ordinal = (uint32_t)info->ordinal;
  st->page_size = info->page_size;
  st->total_bytes = info->total_bytes;
  st->clients = t.clients;
  st->loans_ended = t.loans_ended;
  st->borrowers_died = t.borrowers_died;
  st->copied_out_bytes = t.copied_out_bytes;
  st->copied_in_bytes = t.copied_in_bytes;
  st->served_unkept_bytes = t.served_bytes[SL_SRC_UNKEPT];
  st->served_fresh_bytes = t.served_bytes[SL_SRC_FRESH];
  st->served_kept_bytes = t.served_bytes[SL_SRC_KEPT];
  st->host_bytes = sl_pool_host_bytes(d->pool);
}

static int on_stats(struct ctx *x) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Status st = SUBLET__STATUS__INIT;
  Sublet__LoanStatus ls = SUBLET__LOAN_STATUS__INIT;
  Sublet__LoanStats stats;
  Sublet__RegionStatus *regions = NULL;
  int rc;

  status_device(x->d, &st);
  rc = status_regions(x->d, &st, &regions);
  if (rc == 0) {
    if (sl_books_current_loan(x->d->books) != 0) {
      status_loan(x->d, &ls, &stats);
      st.loan = &ls;
    }
    rep.id = x->id;
    rep.body_case = SUBLET__REPLY__BODY_STATUS;
    rep.status = &st;
    sl_conn_send(x->c, &rep, NULL, 0);
  }
  free(regions);
  free(st.regions);
  return rc != 0 ? sl_err_set(&x->err, rc, "out of host memory") : 0;
}

static int dispatch(struct ctx *x, const Sublet__Request *r) {
  if (r->body_case != SUBLET__REQUEST__BODY_HELLO && x->c->client_id == 0)
    return sl_err_set(&x->err, SUBLET_EPROTO, "the first request must be Hello");
  if (x->c->waiting)
    return sl_err_set(&x->err, SUBLET_EBUSY, "a Borrow or Reclaim of this connection is "
                      "still waiting: wait for its reply before sending more");
  switch (r->body_case) {
    case SUBLET__REQUEST__BODY_HELLO: return on_hello(x, r->hello);
    case SUBLET__REQUEST__BODY_REGION_CREATE: return on_region_create(x, r->region_create);
    case SUBLET__REQUEST__BODY_PAGES_GET: return on_pages_get(x, r->pages_get);
    case SUBLET__REQUEST__BODY_REGION_RELEASE: return on_region_release(x, r->region_release);
    case SUBLET__REQUEST__BODY_LEND: return on_lend(x, r->lend);
    case SUBLET__REQUEST__BODY_RECLAIM: return on_reclaim(x, r->reclaim);
    case SUBLET__REQUEST__BODY_WITHDRAW: return on_withdraw(x, r->withdraw);
    case SUBLET__REQUEST__BODY_BORROW: return on_borrow(x, r->borrow);
    case SUBLET__REQUEST__BODY_ALLOC: return on_alloc(x, r->alloc);
    case SUBLET__REQUEST__BODY_FREE: return on_free(x, r->free);
    case SUBLET__REQUEST__BODY_RETURN: return on_return(x, r->return_);
    case SUBLET__REQUEST__BODY_STATS_GET: return on_stats(x);
    default:
      return sl_err_set(&x->err, SUBLET_EPROTO, "unknown request (body %d): this subletd "
                        "is older than the client; upgrade subletd", (int)r->body_case);
  }
}

void sl_handle_request(struct sl_conn *c, const Sublet__Request *req, const int *fds,
                       size_t nfds) {
  struct ctx x = {.c = c, .d = c->d, .id = req->id};
  int rc;

  /* No request carries fds: any that came are closed, and that is an error. */
  if (nfds > 0) {
    sl_wire_close_fds((int *)fds, nfds);
    rc = sl_err_set(&x.err, SUBLET_EPROTO, "requests carry no fds, this one had %zu", nfds);
  } else {
    rc = dispatch(&x, req);
  }
  if (rc != 0 && !c->closed) {
    sl_debug("pid %d: request %llu failed: %s", (int)c->peer.pid, (unsigned long long)req->id,
             x.err.msg);
    sl_conn_send_error(c, req->id, &x.err);
  }
  if (c->d->cfg.check_books) {
    char why[256];
    if (sl_books_check(c->d->books, why, sizeof(why)) != 0) {
      sl_error("books inconsistent after request %llu: %s", (unsigned long long)req->id, why);
      abort(); /* --check is for tests: fail loudly */
    }
  }
}
