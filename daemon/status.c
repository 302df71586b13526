/* status.c - the daemon's Status reply: the device, its regions, the gone regions a client
 * that kept their window still holds, the loan in progress and the totals since start
 * (`sublet status` shows it).
 *
 * A client sees only what it may: the regions of its own user and the loan of one of them (or
 * that it borrows); root and the --allow-group group see every user's. The device and the
 * totals are everyone's.
 *
 * Floor 7 (daemon.h's floors).
 */
#include <stdio.h>
#include <stdlib.h>

#include "clock.h"
#include "daemon.h"
#include "msg.h"

static int may_see(const struct sl_conn *c, uid_t uid) {
  return sl_peer_reaches(&c->peer, uid);
}

/* Fills the Status message's regions; the arrays are freed by the caller. */
static int status_regions(struct sl_conn *c, Sublet__Status *st, Sublet__RegionStatus **msgs) {
  struct sl_daemon *d = c->d;
  struct sl_books_totals t;
  struct sl_region_info ri;
  uint64_t after = 0;
  size_t n = 0;

  sl_books_totals(d->books, &t);
  *msgs = calloc(t.regions + 1, sizeof(**msgs));
  st->regions = calloc(t.regions + 1, sizeof(*st->regions));
  if (*msgs == NULL || st->regions == NULL)
    return SUBLET_ENOHOSTMEM;
  for (; n < t.regions && sl_books_region_next(d->books, after, &ri) == 0; after = ri.id) {
    Sublet__RegionStatus *r = &(*msgs)[n];
    if (!may_see(c, ri.owner.uid))
      continue;
    sublet__region_status__init(r);
    r->region = ri.id;
    r->owner_pid = (uint32_t)ri.owner.pid;
    r->owner_uid = (uint32_t)ri.owner.uid;
    r->pages = ri.npages;
    r->has_loan = ri.loan_id != 0;
    r->loan = ri.loan_id;
    r->released_pages = sl_books_region_released(d->books, ri.id);
    r->has_released_pages = r->released_pages != 0;
    st->regions[n++] = r;
  }
  st->n_regions = n;
  return 0;
}

/* The live releases the client may see; the arrays are freed by the caller. */
static int status_releases(struct sl_conn *c, Sublet__Status *st, Sublet__ReleaseStatus **msgs) {
  struct sl_books *books = c->d->books;
  struct sl_release_info ri;
  size_t n = 0, cap = 0;
  uint64_t after = 0;

  for (; sl_books_release_next(books, after, &ri) == 0; after = ri.id)
    cap++;
  *msgs = calloc(cap + 1, sizeof(**msgs));
  st->releases = calloc(cap + 1, sizeof(*st->releases));
  if (*msgs == NULL || st->releases == NULL)
    return SUBLET_ENOHOSTMEM;
  for (after = 0; n < cap && sl_books_release_next(books, after, &ri) == 0; after = ri.id) {
    Sublet__ReleaseStatus *r = &(*msgs)[n];
    if (!may_see(c, ri.owner.uid))
      continue;
    sublet__release_status__init(r);
    r->release = ri.id;
    r->region = ri.region_id;
    r->state = (char *)sl_books_release_state_name(ri.state);
    r->released_pages = ri.released_pages;
    r->stayed_pages = ri.stayed_pages;
    r->kept_bytes = ri.kept_bytes;
    r->copied_out_bytes = ri.saved_bytes;
    r->moved_bytes = ri.moved_bytes;
    r->has_need_bytes = r->has_free_bytes = ri.by_need;
    r->need_bytes = ri.need_bytes;
    r->free_bytes = ri.free_bytes;
    r->has_need_increments = ri.by_need;
    r->need_increments = ri.increments;
    st->releases[n++] = r;
  }
  st->n_releases = n;
  return 0;
}

/* The borrowers that may still hold old pages, those the client may see; *msgs is the
 * caller's to free. */
static int status_retained(struct sl_conn *c, Sublet__Status *st, Sublet__RetainedStatus **msgs) {
  struct sl_books *books = c->d->books;
  uint64_t ps = sl_device_info(c->d->dev)->page_size;
  size_t n = sl_books_retained(books, NULL, 0), k = 0;
  struct sl_retained *all = calloc(n + 1, sizeof(*all));

  *msgs = calloc(n + 1, sizeof(**msgs));
  st->retained = calloc(n + 1, sizeof(*st->retained));
  if (all == NULL || *msgs == NULL || st->retained == NULL) {
    free(all);
    return SUBLET_ENOHOSTMEM;
  }
  sl_books_retained(books, all, n);
  for (size_t i = 0; i < n; i++) {
    Sublet__RetainedStatus *m = &(*msgs)[k];
    if (!may_see(c, all[i].peer.uid))
      continue;
    sublet__retained_status__init(m);
    m->pid = (uint32_t)all[i].peer.pid;
    m->uid = (uint32_t)all[i].peer.uid;
    m->bytes = all[i].pages * ps;
    st->retained[k++] = m;
  }
  st->n_retained = k;
  free(all);
  return 0;
}

/* The gone regions still held by a client that kept their window, those the client may see;
 * *msgs is the caller's to free. */
static int status_held(struct sl_conn *c, Sublet__Status *st, Sublet__HeldStatus **msgs) {
  size_t n = sl_books_kept_held(c->d->books, NULL, 0), k = 0;
  struct sl_held_info *all = calloc(n + 1, sizeof(*all));

  *msgs = calloc(n + 1, sizeof(**msgs));
  st->held = calloc(n + 1, sizeof(*st->held));
  if (all == NULL || *msgs == NULL || st->held == NULL) {
    free(all);
    return SUBLET_ENOHOSTMEM;
  }
  sl_books_kept_held(c->d->books, all, n);
  for (size_t i = 0; i < n; i++) {
    Sublet__HeldStatus *h = &(*msgs)[k];
    if (!may_see(c, all[i].owner.uid))
      continue;
    sublet__held_status__init(h);
    h->region = all[i].region_id;
    h->pages = all[i].npages;
    h->owner_uid = (uint32_t)all[i].owner.uid;
    h->holder_pid = (uint32_t)all[i].holder.pid;
    h->holder_uid = (uint32_t)all[i].holder.uid;
    st->held[k++] = h;
  }
  st->n_held = k;
  free(all);
  return 0;
}

/* ls points into li (its name): li must live until the reply is sent. */
static void status_loan(struct sl_daemon *d, struct sl_loan_info *li, Sublet__LoanStatus *ls,
                        Sublet__LoanStats *stats) {
  sl_books_loan_info(d->books, sl_books_current_loan(d->books), li);
  sl_msg_stats_to_proto(&li->stats, stats);
  ls->loan = li->id;
  ls->region = li->region_id;
  ls->state = (char *)sl_books_loan_state_name(li->state);
  ls->name = li->name;
  ls->has_borrower_pid = ls->has_borrower_uid = li->borrower_client != 0;
  ls->borrower_pid = (uint32_t)li->borrower.pid;
  ls->borrower_uid = (uint32_t)li->borrower.uid;
  ls->unkept_pages = li->unkept_pages;
  ls->fresh_pages = li->fresh_pages;
  ls->kept_pages = li->kept_pages;
  ls->has_pinned_pages = li->pinned_pages != 0;
  ls->pinned_pages = li->pinned_pages;
  ls->live_bytes = li->live_bytes;
  ls->stats = stats;
  ls->has_local = 1;
  ls->local = li->borrower_client != 0 && li->borrower_client == li->owner_client;
}

/* The loan of a region the client may see, or that it borrows. */
static int loan_visible(const struct sl_conn *c, uint64_t loan) {
  struct sl_loan_info li;
  struct sl_region_info ri;

  if (loan == 0 || sl_books_loan_info(c->d->books, loan, &li) != 0)
    return 0;
  if (li.borrower_client == c->client_id)
    return 1;
  return sl_books_region_info(c->d->books, li.region_id, &ri) == 0 && may_see(c, ri.owner.uid);
}

const char *sl_status_loan_text(const struct sl_conn *c, uint64_t loan, char buf[48]) {
  if (loan == 0)
    snprintf(buf, 48, "no loan yet");
  else if (loan_visible(c, loan))
    snprintf(buf, 48, "loan %llu", (unsigned long long)loan);
  else
    snprintf(buf, 48, "a loan of another user");
  return buf;
}

static void status_device(struct sl_daemon *d, Sublet__Status *st) {
  const struct sl_device_info *info = sl_device_info(d->dev);
  struct sl_books_totals t;

  sl_books_totals(d->books, &t);
  sl_device_free_bytes(d->dev, &st->free_bytes, NULL);
  st->daemon_version = (char *)SUBLET_VERSION_STRING;
  st->uptime_seconds = sl_clock_now() - d->started;
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
  st->host_bytes = sl_pool_host_bytes(d->pool) + sl_releases_host_bytes(d);
  st->has_replaced_bytes = 1;
  st->replaced_bytes = t.replaced_pages * info->page_size;
  st->has_lends_waiting = 1;
  st->lends_waiting = sl_waiters_lends(d);
  st->has_borrows_waiting = 1;
  st->borrows_waiting = sl_waiters_count(d, SL_WAIT_BORROW);
  st->has_pin_target_bytes = st->has_pin_done_bytes =
      sl_pins_progress(d, &st->pin_target_bytes, &st->pin_done_bytes);
}

int sl_status_reply(struct sl_req *x, const Sublet__Request *r) {
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Status st = SUBLET__STATUS__INIT;
  Sublet__LoanStatus ls = SUBLET__LOAN_STATUS__INIT;
  Sublet__LoanStats stats;
  struct sl_loan_info li;
  Sublet__RegionStatus *regions = NULL;
  Sublet__RetainedStatus *retained = NULL;
  Sublet__HeldStatus *held = NULL;
  Sublet__ReleaseStatus *releases = NULL;
  int rc;

  status_device(c->d, &st);
  rc = status_regions(c, &st, &regions);
  if (rc == 0)
    rc = status_retained(c, &st, &retained);
  if (rc == 0)
    rc = status_held(c, &st, &held);
  if (rc == 0)
    rc = status_releases(c, &st, &releases);
  if (rc == 0)
    rc = sl_release_offers_status(c, &st);
  if (rc == 0) {
    if (loan_visible(c, sl_books_current_loan(c->d->books))) {
      status_loan(c->d, &li, &ls, &stats);
      st.loan = &ls;
    }
    rep.id = id;
    rep.body_case = SUBLET__REPLY__BODY_STATUS;
    rep.status = &st;
    sl_conn_send(c, &rep, NULL, 0);
  }
  free(regions);
  free(st.regions);
  free(retained);
  free(st.retained);
  free(held);
  free(st.held);
  free(releases);
  free(st.releases);
  sl_release_offers_status_free(&st);
  return rc != 0 ? sl_err_set(err, rc, "out of host memory") : 0;
}
