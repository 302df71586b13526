/* handlers.c - what subletd does for each request, between the books and the pool (the
 * region requests are regions.c's).
 *
 * Each handler checks its arguments, asks the books, does the device work the books name, and
 * answers. Requests that wait (Borrow with a timeout, Reclaim, every Lend) park a waiter
 * (waiters.c), answered when an offer is posted, the loan ends or the device is free (a Lend's
 * turn), when its timer fires, or when its client cancels it.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"
#include "msg.h"
#include "utf8.h"

struct ctx {
  struct sl_conn *c;
  struct sl_daemon *d;
  uint64_t id;
  struct sl_err err;
  int keep_fd;  /* a Lend's keep memfd: the ctx's until on_lend takes it (-1: none) */
};

/* ---- loan names: UTF-8 of 1 to 63 bytes, no NUL (LoanName in sublet.proto) */

/* Copies a request's loan name into out[64] ("" when absent), or refuses it. */
static int loan_name(struct ctx *x, protobuf_c_boolean has, ProtobufCBinaryData name,
                     char out[64]) {
  size_t len;

  out[0] = '\0';
  if (!has || name.len == 0)
    return 0;
  if (name.len >= 64)
    return sl_err_set(&x->err, SUBLET_EINVAL, "a loan name is at most 63 bytes, not %zu: "
                      "use a shorter name", name.len);
  for (size_t i = 0; i < name.len; i += len) {
    len = name.data[i] == 0 ? 0 : sl_utf8_sequence(name.data + i, name.len - i);
    if (len == 0)
      return sl_err_set(&x->err, SUBLET_EINVAL, "a loan name is UTF-8 text without NUL; "
                        "byte %zu of this one (0x%02x) is not: use another name", i,
                        name.data[i]);
  }
  memcpy(out, name.data, name.len);
  out[name.len] = '\0';
  return 0;
}

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
  rep.id = x->id;
  rep.body_case = SUBLET__REPLY__BODY_WELCOME;
  rep.welcome = &w;
  sl_conn_send(x->c, &rep, NULL, 0);
  return 0;
}

static int fill_borrowed(struct sl_conn *c, uint64_t loan, uint64_t known_layout,
                         Sublet__Borrowed *b);

/* Lend.local: the caller borrows its own loan in the same step, so that it is never on
 * offer (a Borrow waiting for the next offer must not take it). Undone if it cannot. */
static int borrow_own(struct ctx *x, uint64_t loan) {
  uint64_t got;
  int rc = sl_books_borrow(x->d->books, x->c->client_id, loan, NULL, NULL,
                           sl_free_pages(x->d, 1), &got, &x->err);

  if (rc != 0)
    sl_books_withdraw(x->d->books, x->c->client_id, loan, NULL);
  return rc;
}

/* The save area becomes the owner's user's (an owner's fd never shows another user's bytes);
 * with Lend.rescue, the fds that let the owner restore itself (rescue.c). */
static int lend_setup(struct ctx *x, uint64_t loan, const struct sl_loan_info *li, int rescue,
                      int fds[3]) {
  int area_fd;
  int rc = rescue ? sl_rescue_lend(x->d, loan, li, x->c->peer.uid, fds, &x->err)
                  : sl_pool_host_claim(x->d->pool, x->c->peer.uid, &area_fd, &x->err);

  if (rc != 0)
    sl_books_withdraw(x->d->books, x->c->client_id, loan, NULL);
  return rc;
}

/* The loan enters the books from the waiter's draft, then is set up and announced. */
static int lend_now(struct ctx *x, struct sl_waiter *w) {
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
    sl_handle_offer_posted(x->d);
  return 0;
}


/* A waiting Lend's turn (sl_waiters_device_free): lent, or told why not. */
static void serve_lend(struct sl_waiter *w) {
  struct ctx x = {.c = w->conn, .d = w->d, .id = w->req_id};

  if (lend_now(&x, w) != 0)
    sl_conn_send_error(w->conn, w->req_id, &x.err);
  sl_check_books(w->d, w->req_id);
}

/* The waiter's draft is there: it is served now if it is first and the device free; else it
 * waits its turn, or (timeout 0) hears at once that the device is busy. */
static void lend_drafted(struct sl_waiter *w) {
  struct sl_err err;
  uint64_t loan = sl_books_current_loan(w->d->books);

  if (w->lend.timeout_ms == 0 && (loan != 0 || !sl_waiters_lend_first(w))) {
    sl_err_set(&err, SUBLET_EBUSY, "the device is busy (loan %llu; %zu lends wait before "
               "this one): one loan at a time; lend with a timeout to wait your turn",
               (unsigned long long)loan, sl_waiters_lends(w->d) - 1);
    sl_conn_send_error(w->conn, w->req_id, &err);
    sl_waiter_done(w);
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
};

/* Reads n keep ranges from the start of a client's memfd into a buffer of the daemon's own:
 * the client could change the memfd meanwhile, and the draft must check what it uses. */
static int keep_read(int fd, size_t n, uint64_t **out, struct sl_err *err) {
  size_t len = n * sizeof(struct sublet_range), got = 0;
  uint8_t *buf = malloc(len);

  if (buf == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for %zu keep ranges", n);
  while (got < len) {
    ssize_t r = pread(fd, buf + got, len - got, (off_t)got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      free(buf);
      return sl_err_set(err, SUBLET_EPROTO, "the keep memfd ended after %zu of its %zu keep "
                        "ranges (%s): write every range before the Lend",
                        got / sizeof(struct sublet_range), n,
                        r < 0 ? strerror(errno) : "end of file");
    }
    got += (size_t)r;
  }
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
  for (size_t i = 0; i < 2 * n; i++)
    ((uint64_t *)buf)[i] = __builtin_bswap64(((uint64_t *)buf)[i]);
#endif
  *out = (uint64_t *)buf;
  return 0;
}

void sl_lend_lists_take(struct sl_lend_lists *l, Sublet__Lend *m, int *keep_fd) {
  *l = (struct sl_lend_lists){.keep_fd = *keep_fd, .keep_all = m->keep_all,
                              .pinned = m->pinned, .npinned = m->n_pinned / 2};
  *keep_fd = -1;
  m->pinned = NULL;
  m->n_pinned = 0;
  if (l->keep_fd >= 0) { /* read in the job (keep_read) */
    l->nkeep = m->keep_fd_ranges;
  } else {
    l->keep = m->keep;
    l->nkeep = m->n_keep / 2;
    m->keep = NULL;
    m->n_keep = 0;
  }
}

int sl_lend_lists_draft(struct sl_lend_lists *l, const struct sl_books_config *cfg,
                        uint64_t npages, struct sl_loan **draft, struct sl_err *err) {
  int rc;

  if (l->keep_fd >= 0 && l->keep == NULL &&
      (rc = keep_read(l->keep_fd, l->nkeep, &l->keep, err)) != 0)
    return rc;
  return sl_books_draft(cfg, npages, (const struct sublet_range *)l->keep, l->nkeep,
                        l->keep_all, l->pinned, l->npinned, draft, err);
}

void sl_lend_lists_clear(struct sl_lend_lists *l) {
  if (l->keep_fd >= 0)
    close(l->keep_fd);
  free(l->keep);
  free(l->pinned);
  *l = (struct sl_lend_lists){.keep_fd = -1};
}

static void draft_run(struct sl_job *j) {
  struct draft_job *dj = (struct draft_job *)j;

  j->rc = sl_lend_lists_draft(&dj->lists, &dj->cfg, dj->npages, &dj->draft, &j->err);
}

static void draft_done(struct sl_job *j) {
  struct draft_job *dj = (struct draft_job *)j;
  struct sl_waiter *w = dj->w;

  sl_lend_lists_clear(&dj->lists);
  if (w == NULL) {
    sl_books_draft_free(dj->draft);
  } else if (j->rc != 0) {
    w->lend.drafter = NULL;
    sl_conn_send_error(w->conn, w->req_id, &j->err);
    sl_waiter_done(w);
  } else {
    w->lend.drafter = NULL;
    w->lend.draft = dj->draft;
    lend_drafted(w);
  }
  free(dj);
}

/* The keep list goes with the job: the Lend's (protobuf-c allocated it with malloc), or the
 * keep memfd's (x->keep_fd taken). */
static int draft_off_loop(struct ctx *x, struct sl_waiter *w, Sublet__Lend *m, uint64_t npages) {
  struct draft_job *dj = calloc(1, sizeof(*dj));

  if (dj == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  dj->w = w;
  dj->cfg = *sl_books_cfg(x->d->books);
  dj->npages = npages;
  sl_lend_lists_take(&dj->lists, m, &x->keep_fd);
  dj->job.run = draft_run;
  dj->job.done = draft_done;
  w->lend.drafter = &dj->w;
  sl_job_submit(x->d, &dj->job);
  return 0;
}

static int lend_timeout(const Sublet__Lend *m) {
  return m->has_timeout_ms ? m->timeout_ms : 0;
}

/* Lend.keep_ranges becomes Lend.keep: the bytes are the pairs' layout on a little-endian host,
 * so the buffer is taken over as it is (protobuf-c allocated it with malloc, as it does keep). */
static int keep_from_bytes(struct ctx *x, Sublet__Lend *m) {
  if (!m->has_keep_ranges)
    return 0;
  if (m->keep_ranges.len % sizeof(struct sublet_range) != 0)
    return sl_err_set(&x->err, SUBLET_EINVAL, "Lend.keep_ranges holds 16 bytes a range, not "
                      "%zu bytes", m->keep_ranges.len);
  if (m->keep_ranges.len == 0)
    return 0;
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
  for (size_t i = 0; i < m->keep_ranges.len / 8; i++)
    ((uint64_t *)m->keep_ranges.data)[i] = __builtin_bswap64(((uint64_t *)m->keep_ranges.data)[i]);
#endif
  free(m->keep);
  m->keep = (uint64_t *)m->keep_ranges.data;
  m->n_keep = m->keep_ranges.len / sizeof(uint64_t);
  m->keep_ranges.data = NULL;
  m->keep_ranges.len = 0;
  m->has_keep_ranges = 0;
  return 0;
}

/* Lend.keep_fd_ranges: one keep list, in a memfd that holds them all, open for reading.
 * fcntl's seals answer only for shared memory (a memfd, a tmpfs or hugetlbfs file): a file
 * whose reads could block the job is refused. */
static int keep_fd_check(struct ctx *x, const Sublet__Lend *m) {
  struct stat st;
  int fl;

  if (!m->has_keep_fd_ranges)
    return x->keep_fd < 0 ? 0 : sl_err_set(&x->err, SUBLET_EPROTO, "a Lend carries an fd only "
                                           "with keep_fd_ranges");
  if (x->keep_fd < 0)
    return sl_err_set(&x->err, SUBLET_EPROTO, "Lend.keep_fd_ranges without the memfd: send it "
                      "with the frame");
  if (m->keep_fd_ranges == 0 || m->keep_fd_ranges > SL_MSG_KEEP_FD_MAX_RANGES)
    return sl_err_set(&x->err, SUBLET_EINVAL, "Lend.keep_fd_ranges is %llu: 1 to %llu ranges "
                      "(merge adjacent ones)", (unsigned long long)m->keep_fd_ranges,
                      SL_MSG_KEEP_FD_MAX_RANGES);
  if (fcntl(x->keep_fd, F_GET_SEALS) < 0 || fstat(x->keep_fd, &st) != 0 ||
      !S_ISREG(st.st_mode))
    return sl_err_set(&x->err, SUBLET_EPROTO, "the fd of Lend.keep_fd_ranges is not a memfd "
                      "(nor other shared memory): send the ranges in a memfd_create file");
  if ((fl = fcntl(x->keep_fd, F_GETFL)) < 0 || (fl & O_ACCMODE) == O_WRONLY)
    return sl_err_set(&x->err, SUBLET_EPROTO, "the keep memfd is open for writing only: send "
                      "an fd subletd can read");
  if ((uint64_t)st.st_size / sizeof(struct sublet_range) < m->keep_fd_ranges)
    return sl_err_set(&x->err, SUBLET_EPROTO, "the keep memfd holds %lld bytes, fewer than %llu "
                      "ranges of 16", (long long)st.st_size,
                      (unsigned long long)m->keep_fd_ranges);
  return 0;
}

/* keep_ranges and keep_fd_ranges stand alone: neither with the other, keep or keep_all (keep
 * beside keep_all is ignored, as it always was). Checked before either is read. */
static int keep_forms_check(struct ctx *x, const Sublet__Lend *m) {
  int packed = m->has_keep_ranges + m->has_keep_fd_ranges;

  if (packed > 1 || (packed == 1 && (m->n_keep > 0 || m->keep_all)))
    return sl_err_set(&x->err, SUBLET_EINVAL, "a Lend has keep, keep_all, keep_ranges or "
                      "keep_fd_ranges, not more than one");
  return 0;
}

/* Every Lend waits as a waiter, at the tail: served when the device is free and its turn
 * comes (at once, most often), or when its timer fires, or dropped with its connection. */
static int on_lend(struct ctx *x, Sublet__Lend *m) {
  struct sl_waiter *w;
  uint64_t npages;
  char name[64];
  int rc;

  if ((rc = loan_name(x, m->has_name, m->name, name)) != 0)
    return rc;
  if ((rc = keep_forms_check(x, m)) != 0 || (rc = keep_from_bytes(x, m)) != 0 ||
      (rc = keep_fd_check(x, m)) != 0)
    return rc;
  if (m->n_keep % 2 != 0)
    return sl_err_set(&x->err, SUBLET_EINVAL, "Lend.keep holds (offset, length) pairs: "
                      "an even count, not %zu", m->n_keep);
  if (m->n_pinned % 2 != 0)
    return sl_err_set(&x->err, SUBLET_EINVAL, "Lend.pinned holds (first page, count) pairs: "
                      "an even count, not %zu", m->n_pinned);
  if (lend_timeout(m) < -1)
    return sl_err_set(&x->err, SUBLET_EINVAL, "Lend.timeout_ms is 0 (at once), -1 (forever) "
                      "or milliseconds above 0, not %d", lend_timeout(m));
  if (m->release) /* no waiting: a release does not take the device's one loan */
    return sl_releases_start(x->c, x->id, m, &x->keep_fd, &x->err);
  rc = sl_books_may_lend(x->d->books, x->c->client_id, m->region, &npages, &x->err);
  if (rc != 0)
    return rc;
  w = sl_waiter_park(x->c, SL_WAIT_LEND, x->id, lend_timeout(m) > 0 ? lend_timeout(m) : -1);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  memcpy(w->name, name, sizeof(w->name));
  w->known_layout = m->known_layout;
  w->lend = (struct sl_lend_wait){.region = m->region, .rescue = m->rescue, .local = m->local,
                                  .timeout_ms = lend_timeout(m), .serve = serve_lend};
  if (x->keep_fd >= 0 || (!m->keep_all && m->n_keep / 2 > SL_MSG_KEEP_SHORT_RANGES))
    rc = draft_off_loop(x, w, m, npages);
  else if ((rc = sl_books_draft(sl_books_cfg(x->d->books), npages,
                                (const struct sublet_range *)m->keep, m->n_keep / 2,
                                m->keep_all, m->pinned, m->n_pinned / 2, &w->lend.draft,
                                &x->err)) == 0)
    lend_drafted(w);
  if (rc != 0)
    sl_waiter_done(w);
  return rc;
}

static int on_reclaim(struct ctx *x, const Sublet__Reclaim *m) {
  struct sl_ended *e = sl_ended_take(x->c, m->loan);
  struct sl_waiter *w;
  int rc;

  if (e != NULL) {
    sl_conn_send_stats(x->c, x->id, 0, &e->stats, e->replaced, e->nreplaced);
    sl_ended_free(e);
    return 0;
  }
  rc = sl_books_loan_owned(x->d->books, x->c->client_id, m->loan, &x->err);
  if (rc == SUBLET_ENOENT && sl_loan_ending(x->d, m->loan, x->c->client_id))
    rc = 0; /* ended, its restore still running: the reply comes when it is done */
  if (rc != 0)
    return rc;
  if (m->timeout_ms == 0)
    return sl_err_set(&x->err, SUBLET_ETIMEDOUT, "loan %llu has not ended yet",
                      (unsigned long long)m->loan);
  w = sl_waiter_park(x->c, SL_WAIT_RECLAIM, x->id, m->timeout_ms);
  if (w == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  w->loan_id = m->loan;
  return 0;
}

static int on_withdraw(struct ctx *x, const Sublet__Withdraw *m) {
  int rc = sl_books_withdraw(x->d->books, x->c->client_id, m->loan, &x->err);

  if (rc == 0) {
    sl_rescue_prune(x->d);
    sl_conn_send_ok(x->c, x->id);
  }
  return rc;
}

uint64_t sl_free_pages(const struct sl_daemon *d, int keep_reserve) {
  uint64_t ps = sl_device_info(d->dev)->page_size, free_bytes = 0;
  uint64_t taken = d->building_bytes + (keep_reserve ? d->cfg.reserve_bytes : 0);

  if (sl_device_free_bytes(d->dev, &free_bytes, NULL) != 0 || free_bytes <= taken)
    return 0;
  return (free_bytes - taken) / ps;
}

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
  d->copy_out_seconds = 0;
  d->move_seconds = 0;
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
                           sl_free_pages(c->d, 1), &got, err);

  if (rc == 0)
    reply_borrowed(c, w->req_id, got, w->rescue, w->known_layout);
  return rc;
}

static int on_borrow(struct ctx *x, const Sublet__Borrow *m) {
  struct sl_waiter ask = {.conn = x->c, .req_id = x->id, .loan_id = m->loan,
                          .has_token = m->has_token, .rescue = m->rescue,
                          .known_layout = m->known_layout}, *w;
  int rc;

  if (m->has_token && m->token.len != SUBLET_TOKEN_SIZE)
    return sl_err_set(&x->err, SUBLET_EINVAL, "a loan's token is %d bytes, not %zu",
                      SUBLET_TOKEN_SIZE, m->token.len);
  if ((rc = loan_name(x, m->has_name, m->name, ask.name)) != 0)
    return rc;
  if (m->has_token)
    memcpy(ask.token, m->token.data, SUBLET_TOKEN_SIZE);
  rc = try_borrow(&ask, &x->err);
  if (rc != SUBLET_ENOOFFER || m->timeout_ms == 0)
    return rc;
  w = sl_waiter_park(x->c, SL_WAIT_BORROW, x->id, m->timeout_ms);
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

void sl_handle_offer_posted(struct sl_daemon *d) {
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
    sl_waiter_done(w);
    if (rc == 0)
      return; /* one loan per device: the offer is taken */
  }
}

/* An allocation that reaches kept pages: answered once their kept bytes are moved or saved. */
struct alloc_job {
  struct sl_job job; /* first member: the job is the alloc_job */
  uint64_t req_id;
  struct sl_grant g;
  int fd;            /* the fresh chunk's export, or -1 */
};

static void reply_allocated(struct sl_conn *c, uint64_t id, const struct sl_grant *g, int fd) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Allocated a = SUBLET__ALLOCATED__INIT;

  a.alloc = g->alloc_id;
  a.pos = g->pos;
  a.pages = g->npages;
  a.has_fresh_pos = a.has_fresh_pages = g->fresh_npages > 0;
  a.fresh_pos = g->fresh_pos;
  a.fresh_pages = g->fresh_npages;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_ALLOCATED;
  rep.allocated = &a;
  sl_conn_send(c, &rep, &fd, fd >= 0 ? 1 : 0);
}

/* The device work is done (or failed): commit the grant and answer, or undo it. */
static int alloc_finish(struct sl_daemon *d, struct sl_conn *c, uint64_t id, struct sl_grant *g,
                        int fd, int rc, struct sl_err *err) {
  if (rc == 0 && c == NULL)
    rc = SUBLET_EPIPE; /* the borrower went while its kept pages were saved */
  if (rc == 0) /* journaled before the pages are lent: the owner can undo what they lose */
    rc = sl_rescue_emptied(d, g->loan_id, g->move, g->nmove, g->save, g->nsave, err);
  if (rc == 0 && (rc = sl_books_alloc_commit(d->books, g)) != 0)
    rc = sl_err_set(err, rc, "internal error: an allocation's plan went stale");
  if (rc == 0)
    reply_allocated(c, id, g, fd);
  else
    sl_books_alloc_release(d->books, g);
  if (rc != 0 && g->fresh_npages > 0)
    sl_pool_chunk_release(d->pool, g->fresh_chunk_id);
  if (fd >= 0)
    close(fd);
  sl_grant_clear(g);
  return rc;
}

static void alloc_saved(struct sl_job *j) {
  struct alloc_job *aj = (struct alloc_job *)j;
  struct sl_conn *c = j->conn;
  int rc;

  j->d->copy_out_seconds += j->seconds;
  j->d->move_seconds += j->move_seconds;
  rc = alloc_finish(j->d, c, aj->req_id, &aj->g, aj->fd, j->rc, &j->err);
  if (c != NULL && rc != 0)
    sl_conn_send_error(c, aj->req_id, &j->err);
  if (c != NULL)
    sl_conn_resume(c);
  free(aj);
}

/* Holds the grant's positions in the books and saves its kept bytes off the loop. */
static int alloc_save(struct ctx *x, struct sl_grant *g, int fd) {
  struct alloc_job *aj = calloc(1, sizeof(*aj));
  struct sl_loan_info li;
  int rc;

  if (aj == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  sl_books_loan_info(x->d->books, g->loan_id, &li);
  rc = sl_pool_transfer_new(x->d->pool, SL_COPY_TO_HOST, li.region_id, g->save, g->nsave,
                            g->move, g->nmove, &aj->job.transfer, &x->err);
  if (rc == 0)
    rc = sl_books_alloc_hold(x->d->books, g, &x->err);
  if (rc != 0) {
    sl_pool_transfer_free(aj->job.transfer);
    free(aj);
    return rc;
  }
  aj->req_id = x->id;
  aj->g = *g; /* the job owns the grant's arrays now */
  aj->fd = fd;
  aj->job.done = alloc_saved;
  aj->job.conn = x->c;
  sl_job_submit(x->d, &aj->job);
  return 0;
}

/* A small emptying of kept pages, on the loop (sl_jobs_inline): moves first (they fill holes
 * of pages that stay unlent), then saves (which may read bytes a move just wrote). A failure
 * leaves the kept bytes where they were: nothing was granted, and moved copies are copies. */
static int empty_now(struct ctx *x, const struct sl_grant *g) {
  struct sl_pool_transfer *t = NULL;
  struct sl_loan_info li;
  double copy = 0, move = 0;
  int rc;

  sl_books_loan_info(x->d->books, g->loan_id, &li);
  rc = sl_pool_transfer_new(x->d->pool, SL_COPY_TO_HOST, li.region_id, g->save, g->nsave,
                            g->move, g->nmove, &t, &x->err);
  if (rc == 0)
    rc = sl_pool_transfer_run(t, &copy, &move, &x->err);
  sl_pool_transfer_free(t);
  x->d->copy_out_seconds += copy;
  x->d->move_seconds += move;
  return rc;
}

/* Plan, do, commit: the books plan the grant, the pool makes the fresh chunk and (off the
 * loop, unless small) saves the kept bytes, the books commit it. */
static int on_alloc(struct ctx *x, const Sublet__Alloc *m) {
  struct sl_grant g = {0};
  int fd = -1, rc;

  rc = sl_books_alloc_plan(x->d->books, x->c->client_id, m->size, &g, &x->err);
  if (rc == 0 && g.fresh_npages > 0)
    rc = sl_pool_chunk_create(x->d->pool, g.fresh_chunk_id, g.fresh_npages, &fd, &x->err);
  if (rc == 0 && g.nsave + g.nmove > 0 && sl_jobs_inline(x->d, g.save_bytes + g.move_bytes)) {
    rc = empty_now(x, &g);
  } else if (rc == 0 && g.nsave + g.nmove > 0) {
    rc = alloc_save(x, &g, fd);
    if (rc == 0)
      return 0; /* answered once the save is done */
  }
  if (rc != 0) {
    if (fd >= 0) {
      close(fd);
      sl_pool_chunk_release(x->d->pool, g.fresh_chunk_id);
    }
    sl_grant_clear(&g);
    return rc;
  }
  return alloc_finish(x->d, x->c, x->id, &g, fd, 0, &x->err);
}

static int on_free(struct ctx *x, const Sublet__Free *m) {
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

static int on_return(struct ctx *x, const Sublet__Return *m) {
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
    sl_loan_end_start(x->d, &end, x->c, answer_return, ra);
    return 0;
  }
  free(ra->leaks);
  free(ra);
  return rc;
}

static int dispatch(struct ctx *x, const Sublet__Request *r) {
  if (r->body_case != SUBLET__REQUEST__BODY_HELLO && x->c->client_id == 0)
    return sl_err_set(&x->err, SUBLET_EPROTO, "the first request must be Hello");
  if (r->body_case == SUBLET__REQUEST__BODY_CANCEL) { /* no reply of its own */
    sl_waiters_cancel_request(x->c, r->cancel->request);
    return 0;
  }
  if (x->c->waiting)
    return sl_err_set(&x->err, SUBLET_EBUSY, "a Borrow, Reclaim or Lend of this connection is "
                      "still waiting: wait for its reply (or cancel it) before sending more");
  switch (r->body_case) {
    case SUBLET__REQUEST__BODY_HELLO: return on_hello(x, r->hello);
    case SUBLET__REQUEST__BODY_REGION_CREATE:
      return sl_regions_create(x->c, x->id, r->region_create, &x->err);
    case SUBLET__REQUEST__BODY_REGION_GROW:
      return sl_regions_grow(x->c, x->id, r->region_grow, &x->err);
    case SUBLET__REQUEST__BODY_PAGES_GET:
      return sl_regions_pages_get(x->c, x->id, r->pages_get, &x->err);
    case SUBLET__REQUEST__BODY_REGION_RELEASE:
      return sl_regions_release(x->c, x->id, r->region_release, &x->err);
    case SUBLET__REQUEST__BODY_LEND: return on_lend(x, r->lend); /* may take its keep */
    case SUBLET__REQUEST__BODY_RECLAIM: return on_reclaim(x, r->reclaim);
    case SUBLET__REQUEST__BODY_WITHDRAW: return on_withdraw(x, r->withdraw);
    case SUBLET__REQUEST__BODY_BORROW: return on_borrow(x, r->borrow);
    case SUBLET__REQUEST__BODY_ALLOC: return on_alloc(x, r->alloc);
    case SUBLET__REQUEST__BODY_FREE: return on_free(x, r->free);
    case SUBLET__REQUEST__BODY_RETURN: return on_return(x, r->return_);
    case SUBLET__REQUEST__BODY_STATS_GET: return sl_status_reply(x->c, x->id, &x->err);
    case SUBLET__REQUEST__BODY_DROPPED:
      return sl_regions_dropped(x->c, x->id, r->dropped, &x->err);
    case SUBLET__REQUEST__BODY_RESUME:
      return sl_releases_resume(x->c, x->id, r->resume, &x->err);
    default:
      return sl_err_set(&x->err, SUBLET_EPROTO, "unknown request (body %d): this subletd "
                        "is older than the client; upgrade subletd", (int)r->body_case);
  }
}

void sl_handle_request(struct sl_conn *c, const Sublet__Request *req, const int *fds,
                       size_t nfds) {
  struct ctx x = {.c = c, .d = c->d, .id = req->id, .keep_fd = -1};
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
  sl_check_books(c->d, req->id);
  /* Where a loan's time goes, for --log-level debug: the loop's share of each request. */
  sl_debug("pid %d: request %llu (body %d) took %.3f ms on the loop", (int)c->peer.pid,
           (unsigned long long)req->id, (int)req->body_case, 1e3 * (sl_clock_now() - t0));
}

void sl_check_books(struct sl_daemon *d, uint64_t req_id) {
  char why[256];

  if (d->cfg.check_books && sl_books_check(d->books, why, sizeof(why)) != 0) {
    sl_error("books inconsistent after request %llu: %s", (unsigned long long)req_id, why);
    abort(); /* --check is for tests: fail loudly */
  }
}

const struct sl_conn_ops sl_handlers = {.request = sl_handle_request,
                                        .gone = sl_handle_disconnect};
