/* conn.c - one client's conversation, on top of its transport (transport.c): frames become
 * requests for the request layer, replies become frames.
 *
 * The request layer (handlers.c) is reached only through d->conn_ops, which server.c sets:
 * this file calls nothing above it. Sending only queues and closing is deferred to the loop,
 * so no handler ever runs inside another connection's handler or close.
 *
 * Floor 4 (daemon.h's floors).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "daemon.h"
#include "decode.h"
#include "log.h"
#include "msg.h"

static uint8_t *pack_error(int code, const char *msg, size_t *len) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Error e = SUBLET__ERROR__INIT;
  uint8_t *buf = NULL;

  e.code = code != 0 ? code : SUBLET_EIO;
  e.message = (char *)msg;
  rep.body_case = SUBLET__REPLY__BODY_ERROR;
  rep.error = &e;
  return sl_msg_pack(&rep.base, &buf, len, NULL) == 0 ? buf : NULL;
}

/* The request goes to the request layer; a request answered after a copy (c->job) holds the
 * connection's next ones back. */
static void deliver(struct sl_conn *c, Sublet__Request *req, int *fds, size_t nfds) {
  c->d->conn_ops->request(c, req, fds, nfds);
  sublet__request__free_unpacked(req, NULL);
  if (c->job != NULL) /* answered once its copy is done: read nothing more till then */
    sl_transport_pause(c->t, 1);
}

/* A frame whose decoding would hold the loop for milliseconds (a Lend with millions of keep
 * ranges: 3 million take 50 ms) is decoded off it, the connection paused meanwhile, as the
 * host work of the peer's uid (jobs.c): its turn comes among that user's, and the payload's
 * copy and the decoding's limit count against the user until it is done. */
#define CONN_DECODE_INLINE_BYTES (1u << 20)

struct decode_job {
  struct sl_job job; /* first member */
  uint8_t *payload;
  size_t len, limit;
  uint64_t id;              /* the request's, read undecoded: for a refusal */
  Sublet__Request *req;
  int fds[SL_WIRE_MAX_FDS];
  size_t nfds;
};

static void decode_run(struct sl_job *j) {
  struct decode_job *dj = (struct decode_job *)j;

  dj->req = sl_decode_request(dj->payload, dj->len, dj->limit, &j->err);
  j->rc = dj->req != NULL ? 0 : j->err.code;
}

/* A request too large to decode (or to queue) is answered, and the conversation goes on; a
 * frame that is no request ends it. */
static void refuse_frame(struct sl_conn *c, uint64_t id, const struct sl_err *err) {
  if (err->code == SUBLET_E2BIG || err->code == SUBLET_EBUSY) {
    sl_info("client pid %d: request %llu refused: %s", (int)c->peer.pid,
            (unsigned long long)id, err->msg);
    sl_conn_send_error(c, id, err);
    return;
  }
  sl_warn("client pid %d: %s; disconnecting it", (int)c->peer.pid, err->msg);
  sl_conn_send_error(c, 0, err);
  sl_conn_close(c);
}

static void decode_done(struct sl_job *j) {
  struct decode_job *dj = (struct decode_job *)j;
  struct sl_conn *c = j->conn;

  free(dj->payload);
  if (c == NULL) { /* gone meanwhile */
    sl_wire_close_fds(dj->fds, dj->nfds);
    if (dj->req != NULL)
      sublet__request__free_unpacked(dj->req, NULL);
  } else if (dj->req == NULL) {
    sl_wire_close_fds(dj->fds, dj->nfds);
    refuse_frame(c, dj->id, &j->err);
    sl_conn_resume(c);
  } else {
    deliver(c, dj->req, dj->fds, dj->nfds);
    sl_conn_resume(c);
  }
  free(dj);
}

/* 0 once queued (fds taken), else an error in err (fds still the caller's). */
static int decode_off_loop(struct sl_conn *c, const struct sl_frame_header *h,
                           const uint8_t *payload, int *fds, struct sl_err *err) {
  struct decode_job *dj = calloc(1, sizeof(*dj));

  if (dj == NULL || (dj->payload = malloc(h->length)) == NULL) {
    free(dj);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  }
  memcpy(dj->payload, payload, h->length);
  dj->len = h->length;
  dj->limit = sl_decode_limit(h->length);
  dj->id = sl_decode_request_id(payload, h->length);
  dj->nfds = h->nfds;
  memcpy(dj->fds, fds, h->nfds * sizeof(*fds));
  dj->job.run = decode_run;
  dj->job.done = decode_done;
  dj->job.conn = c;
  if (sl_jobs_submit_host(c->d, &dj->job, c->peer.uid, dj->len + dj->limit, err) != 0) {
    free(dj->payload);
    free(dj);
    return err->code;
  }
  sl_transport_pause(c->t, 1);
  return 0;
}

/* A whole frame: a request of this protocol version goes to the request layer. */
static void on_frame(struct sl_transport *t, const struct sl_frame_header *h,
                     const uint8_t *payload, int *fds) {
  struct sl_conn *c = sl_transport_data(t);
  struct sl_err err = {0};
  Sublet__Request *req = NULL;

  if (h->version != SUBLET_PROTOCOL_VERSION)
    sl_err_set(&err, SUBLET_EVERSION,
               "this subletd speaks protocol %d and the client %d: install matching "
               "versions of sublet and subletd", SUBLET_PROTOCOL_VERSION, h->version);
  else if (h->kind != SL_WIRE_REQUEST)
    sl_err_set(&err, SUBLET_EPROTO, "a client sent a reply frame");
  else if (h->length > CONN_DECODE_INLINE_BYTES &&
           decode_off_loop(c, h, payload, fds, &err) == 0)
    return;
  /* on the loop: a small one, or a large one when no job could be had for it (not over the
   * user's budget: that one is refused) */
  if (err.code == 0 || err.code == SUBLET_ENOHOSTMEM)
    req = sl_decode_request(payload, h->length, sl_decode_limit(h->length), &err);
  if (req == NULL) {
    sl_wire_close_fds(fds, h->nfds);
    refuse_frame(c, sl_decode_request_id(payload, h->length), &err);
    return;
  }
  deliver(c, req, fds, h->nfds);
}

void sl_conn_resume(struct sl_conn *c) {
  if (!c->closed && c->job == NULL)
    sl_transport_pause(c->t, 0);
}

static void on_closed(struct sl_transport *t, const char *why) {
  struct sl_conn *c = sl_transport_data(t);
  struct sl_conn **link;

  if (c == NULL)
    return; /* refused before it had a conversation */
  link = &c->d->conns;
  sl_info("client pid %d: %s", (int)c->peer.pid, why);
  while (*link != c)
    link = &(*link)->next;
  *link = c->next;
  c->closed = 1;
  if (c->job != NULL)
    c->job->conn = NULL; /* the copy goes on; its answer has nobody to go to */
  c->d->conn_ops->gone(c); /* takes over c->pidfd */
  free(c);
}

const struct sl_transport_ops sl_conn_transport_ops = {
    .frame = on_frame, .closed = on_closed, .pack_error = pack_error};

static int conn_new(struct sl_daemon *d, struct sl_transport *t) {
  const struct ucred *peer = sl_transport_peer(t);
  struct sl_conn *c = calloc(1, sizeof(*c));

  if (c == NULL)
    return SUBLET_ENOHOSTMEM;
  c->d = d;
  c->t = t;
  c->peer = (struct sl_peer){.pid = peer->pid, .uid = peer->uid, .gid = peer->gid};
  c->peer.trusted = peer->uid == 0 || (d->cfg.allow_gid != (gid_t)-1 &&
                                       sl_transport_peer_in_group(t, d->cfg.allow_gid));
  /* Held from the start: once the peer has exited, its pid may be reused. */
  c->pidfd = (int)syscall(SYS_pidfd_open, c->peer.pid, 0);
  sl_transport_set_data(t, c);
  c->next = d->conns;
  d->conns = c;
  d->conns_total++;
  sl_debug("connection from pid %d uid %d", (int)c->peer.pid, (int)c->peer.uid);
  return 0;
}

int sl_conn_accept(struct sl_daemon *d) {
  struct sl_transport *t;
  struct sl_err err = {0};
  int rc;

  while ((rc = sl_transports_accept(&d->transports, d->listen_fd, &t, &err)) != -EAGAIN) {
    if (rc == SUBLET_EIO)
      return rc;
    if (rc != 0) {
      sl_warn("refused a connection: %s", err.msg);
      continue;
    }
    if (conn_new(d, t) != 0) {
      sl_transport_set_data(t, NULL);
      sl_warn("refused a connection: out of host memory");
      sl_transport_close_now(t, "out of host memory");
    }
  }
  return 0;
}

void sl_conn_close(struct sl_conn *c) {
  c->closed = 1;
  sl_transport_close(c->t, "closed by subletd");
}

void sl_conn_close_now(struct sl_conn *c) {
  c->closed = 1;
  sl_transport_close_now(c->t, "subletd is shutting down");
}

int sl_conn_send(struct sl_conn *c, Sublet__Reply *rep, const int *fds, size_t nfds) {
  struct sl_err err = {0};
  int copies[SL_WIRE_MAX_FDS];
  uint8_t *buf;
  size_t len, n = 0;
  int rc = nfds <= SL_WIRE_MAX_FDS ? sl_msg_pack(&rep->base, &buf, &len, &err) : SUBLET_E2BIG;

  for (; rc == 0 && n < nfds; n++) /* the queue's own: the caller keeps and closes its fds */
    if ((copies[n] = fcntl(fds[n], F_DUPFD_CLOEXEC, 0)) < 0)
      rc = sl_err_set(&err, SUBLET_ENOHOSTMEM, "cannot duplicate an fd: %s", strerror(errno));
  if (rc == 0)
    return sl_transport_send(c->t, SL_WIRE_REPLY, buf, len, copies, nfds);
  sl_wire_close_fds(copies, n);
  free(buf);
  sl_warn("client pid %d: cannot send a reply (%s); disconnecting it", (int)c->peer.pid,
          err.msg);
  sl_conn_close(c);
  return rc;
}

int sl_conn_send_error(struct sl_conn *c, uint64_t id, const struct sl_err *err) {
  return sl_conn_send_error_fresh(c, id, err, 0);
}

int sl_conn_send_error_fresh(struct sl_conn *c, uint64_t id, const struct sl_err *err,
                             uint64_t awaits_fresh_pages) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Error e = SUBLET__ERROR__INIT;

  e.code = err->code != 0 ? err->code : SUBLET_EIO;
  e.message = (char *)err->msg;
  e.has_awaits_fresh_pages = awaits_fresh_pages > 0;
  e.awaits_fresh_pages = awaits_fresh_pages;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_ERROR;
  rep.error = &e;
  return sl_conn_send(c, &rep, NULL, 0);
}

void sl_conn_send_ok(struct sl_conn *c, uint64_t id) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Ok ok = SUBLET__OK__INIT;

  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_OK;
  rep.ok = &ok;
  sl_conn_send(c, &rep, NULL, 0);
}

/* Pages (ascending) as (first, count) pairs: *runs (the caller frees) gets 2 per run. */
static int page_runs(const uint64_t *pages, size_t n, uint64_t **runs, size_t *nruns) {
  size_t k = 0;

  *runs = n > 0 ? malloc(2 * n * sizeof(**runs)) : NULL;
  if (n > 0 && *runs == NULL)
    return SUBLET_ENOHOSTMEM;
  for (size_t i = 0; i < n; i++) {
    if (k > 0 && (*runs)[k - 2] + (*runs)[k - 1] == pages[i]) {
      (*runs)[k - 1]++;
      continue;
    }
    (*runs)[k++] = pages[i];
    (*runs)[k++] = 1;
  }
  *nruns = k;
  return 0;
}

void sl_conn_send_stats(struct sl_conn *c, uint64_t id, int returned,
                        const struct sublet_loan_stats *s, const uint64_t *replaced, size_t n) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__LoanStats m;
  struct sl_err err;

  sl_msg_stats_to_proto(s, &m);
  if (page_runs(replaced, n, &m.replaced, &m.n_replaced) != 0) {
    sl_err_set(&err, SUBLET_ENOHOSTMEM, "out of host memory for the list of the region's fresh "
               "pages: its mapping in this process is stale, release the region");
    sl_conn_send_error(c, id, &err);
    return;
  }
  rep.id = id;
  rep.body_case = returned ? SUBLET__REPLY__BODY_RETURNED : SUBLET__REPLY__BODY_RECLAIMED;
  if (returned)
    rep.returned = &m;
  else
    rep.reclaimed = &m;
  sl_conn_send(c, &rep, NULL, 0);
  free(m.replaced);
}
