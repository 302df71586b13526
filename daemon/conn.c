/* conn.c - one client connection: reading frames, sending replies, closing.
 *
 * libuv cannot pass arbitrary fds over its pipes, so each client socket is watched with a
 * uv_poll_t and read with recvmsg (wire.c) here. A malformed frame, a wrong fd count or a
 * client that cannot take its reply ends that connection only; the daemon goes on.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"
#include "msg.h"

static void on_readable(uv_poll_t *h, int status, int events);

static int read_peer(int fd, struct sl_peer *peer) {
  struct ucred cred;
  socklen_t len = sizeof(cred);

  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
    return -errno;
  peer->pid = cred.pid;
  peer->uid = cred.uid;
  peer->gid = cred.gid;
  return 0;
}

void sl_conn_accept(struct sl_daemon *d, int fd) {
  struct sl_conn *c = calloc(1, sizeof(*c));

  if (c == NULL || read_peer(fd, &c->peer) != 0) {
    sl_warn("refusing a connection: %s", c == NULL ? "out of memory" : strerror(errno));
    free(c);
    close(fd);
    return;
  }
  c->d = d;
  c->fd = fd;
  /* Held from the start: once the peer has exited, its pid may be reused. */
  c->pidfd = (int)syscall(SYS_pidfd_open, c->peer.pid, 0);
  sl_wire_rx_init(&c->rx);
  uv_poll_init(d->loop, &c->poll, fd);
  c->poll.data = c;
  uv_poll_start(&c->poll, UV_READABLE | UV_DISCONNECT, on_readable);
  c->next = d->conns;
  d->conns = c;
  d->conns_total++;
  sl_debug("connection from pid %d uid %d", (int)c->peer.pid, (int)c->peer.uid);
}

static void free_conn(uv_handle_t *h) {
  struct sl_conn *c = h->data;

  sl_wire_rx_destroy(&c->rx);
  close(c->fd);
  free(c);
}

void sl_conn_close(struct sl_conn *c) {
  struct sl_daemon *d = c->d;
  struct sl_conn **link = &d->conns;

  while (*link != NULL && *link != c)
    link = &(*link)->next;
  if (*link == NULL)
    return; /* already closed */
  *link = c->next;
  c->closed = 1;
  if (c->job != NULL)
    c->job->conn = NULL; /* the copy goes on; its answer has nobody to go to */
  sl_handle_disconnect(c); /* takes over c->pidfd */
  uv_poll_stop(&c->poll);
  uv_close((uv_handle_t *)&c->poll, free_conn);
}

/* Dispatches every whole frame buffered; returns nonzero once the conn is closed. */
static int drain_frames(struct sl_conn *c) {
  struct sl_frame_header h;
  const uint8_t *payload;
  int fds[SL_WIRE_MAX_FDS];
  struct sl_err err = {0};
  int rc;

  while ((rc = sl_wire_rx_next(&c->rx, &h, &payload, fds, &err)) == 1) {
    Sublet__Request *req = NULL;
    if (h.version != SUBLET_PROTOCOL_VERSION)
      sl_err_set(&err, SUBLET_EVERSION,
                 "this subletd speaks protocol %d and the client %d: install matching "
                 "versions of sublet and subletd", SUBLET_PROTOCOL_VERSION, h.version);
    else if (h.kind == SL_WIRE_REQUEST)
      req = sl_msg_unpack_request(payload, h.length, &err);
    else
      sl_err_set(&err, SUBLET_EPROTO, "a client sent a reply frame");
    if (req == NULL) {
      sl_wire_close_fds(fds, h.nfds);
      break;
    }
    sl_handle_request(c, req, fds, h.nfds);
    sublet__request__free_unpacked(req, NULL);
    if (c->closed)
      return 1;
    if (c->job != NULL) { /* answered once its copy is done: read nothing more till then */
      uv_poll_stop(&c->poll);
      return 1;
    }
  }
  if (rc == 1 || rc < 0) {
    sl_warn("client pid %d: %s; disconnecting it", (int)c->peer.pid, err.msg);
    sl_conn_send_error(c, 0, &err);
    sl_conn_close(c);
    return 1;
  }
  return 0;
}

static void on_readable(uv_poll_t *h, int status, int events) {
  struct sl_conn *c = h->data;
  struct sl_err err = {0};
  int n;

  /* Bounded per wakeup so that one busy client cannot starve the others. */
  for (int i = 0; i < 16; i++) {
    n = sl_wire_rx_read(&c->rx, c->fd, &err);
    if (n == -EAGAIN)
      return;
    if (n <= 0) {
      if (n < 0) /* a client that dies resets its connection: routine, not a warning */
        sl_info("client pid %d: %s", (int)c->peer.pid, err.msg);
      sl_conn_close(c);
      return;
    }
    if (drain_frames(c))
      return;
  }
}

void sl_conn_resume(struct sl_conn *c) {
  if (c->closed || c->job != NULL)
    return;
  if (drain_frames(c) == 0) /* frames that came with the one that waited */
    uv_poll_start(&c->poll, UV_READABLE | UV_DISCONNECT, on_readable);
}

int sl_conn_send(struct sl_conn *c, Sublet__Reply *rep, const int *fds, size_t nfds) {
  struct sl_err err = {0};
  int rc = sl_msg_send_reply(c->fd, rep, fds, nfds, &err);

  if (rc != 0) {
    sl_info("client pid %d: cannot send a reply (%s); disconnecting it", (int)c->peer.pid,
            err.msg);
    sl_conn_close(c);
  }
  return rc;
}

int sl_conn_send_error(struct sl_conn *c, uint64_t id, const struct sl_err *err) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Error e = SUBLET__ERROR__INIT;

  e.code = err->code != 0 ? err->code : SUBLET_EIO;
  e.message = (char *)err->msg;
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

void sl_conn_send_stats(struct sl_conn *c, uint64_t id, int returned,
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
