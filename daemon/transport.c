/* transport.c - client connections below the protocol: a receive buffer, an output queue
 * flushed when the socket is writable, the bounds of transport.h, and deferred closes. What
 * each connection holds of its uid's bounds and the daemon's is counted by users.c.
 *
 * libuv cannot pass fds over its streams, so each socket is watched with a uv_poll_t and
 * read and written with recvmsg/sendmsg (common/wire.c). One uv_timer_t per connection serves
 * its deadlines (a partial frame, output the client does not take), the retries of a frame
 * whose fds must wait, and the deferred close.
 *
 * Fd ownership: the transport owns its socket, the fds queued in its receive buffer and those
 * of queued frames; fds handed to ops->frame are the callee's. A transport closed while its
 * client still holds fds it sent lingers (its socket shut down, still open) until they are
 * taken: the kernel counts them against the daemon's user until then.
 *
 * Floor 2 (daemon.h's floors).
 */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "log.h"

/* A retry of output that waits: fds the client has not taken yet, or ETOOMANYREFS. */
#define RETRY_MS 5
/* One wakeup reads at most this many times and hands out at most this many frames, so that a
 * client that floods requests gets its turn like the others, not the loop: the rest waits
 * in its buffer for the next turn (the timer at 0 ms). */
#define READS_PER_WAKEUP 16
#define FRAMES_PER_TURN 16
/* How often a lingering connection's socket is looked at: has its client taken its fds? */
#define LINGER_MS 100

/* A queued frame; payload and fds are the item's until written. */
struct tx_item {
  struct tx_item *next;
  struct sl_wire_out out;
  uint8_t *payload;
  size_t nfds;              /* fds still held: 0 once they went with the first byte */
  int fds[SL_WIRE_MAX_FDS];
};

struct sl_transport {
  struct sl_transports *set;
  struct sl_users_conn share; /* its part in its uid's counts and the daemon's (users.c) */
  int fd;
  struct ucred peer;
  uv_poll_t poll;
  uv_timer_t timer;
  int handles;              /* open libuv handles: t is freed when the last one has closed */
  int events;               /* what poll watches now */
  struct sl_wire_rx rx;
  struct tx_item *head, **tail;
  size_t tx_bytes;
  int fds_wait;             /* enum sl_users_fds: the head frame's fds wait for earlier ones */
  int refs_wait;            /* the head frame met ETOOMANYREFS */
  uint64_t refs_since;      /* loop ms when it first did */
  int lingering;            /* closed, its fds still in the client's socket */
  uint64_t progress;        /* loop ms when the client last took something, or output began */
  uint64_t partial_since;   /* loop ms when an incomplete frame began; 0: none */
  int backlog;              /* whole frames wait in rx for the next turn */
  int paused;               /* the layer above reads nothing now (sl_transport_pause) */
  int closing;
  char why[512];
  void *data;
};

static void update(struct sl_transport *t);
static void teardown(struct sl_transport *t, int may_linger);
static void release(struct sl_transport *t);

/* ------------------------------------------------------------------ the set */

static struct sl_transport *of_share(struct sl_users_conn *c) {
  return (struct sl_transport *)((char *)c - offsetof(struct sl_transport, share));
}

/* Bytes still in the socket that the client has not taken (for a Unix socket, SIOCOUTQ
 * counts what the receiver has not consumed yet, its fds included). */
static int socket_drained(const struct sl_transport *t) {
  int n = 0;

  return ioctl(t->fd, SIOCOUTQ, &n) == 0 && n == 0;
}

/* users.c asks: once its socket is empty the client has taken every fd sent on it. */
static int fds_taken(struct sl_users_conn *c) {
  struct sl_transport *t = of_share(c);

  if (!socket_drained(t))
    return 0;
  t->progress = uv_now(t->set->loop);
  return 1;
}

int sl_transports_init(struct sl_transports *s, uv_loop_t *loop,
                       const struct sl_transport_limits *lim,
                       const struct sl_transport_ops *ops) {
  memset(s, 0, sizeof(*s));
  s->loop = loop;
  s->lim = *lim;
  s->ops = ops;
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  sl_users_init(&s->users, &lim->users, fds_taken);
  return 0;
}

/* Ends the lingering connections: at shutdown, their clients' fds are the kernel's to count. */
void sl_transports_destroy(struct sl_transports *s) {
  struct sl_users_uid *u = s->users.list, *next;

  for (; u != NULL; u = next) {
    struct sl_users_conn *c = u->list, *c_next;
    next = u->next; /* u goes with its last connection */
    for (; c != NULL; c = c_next) {
      c_next = c->next;
      if (of_share(c)->lingering)
        release(of_share(c));
    }
  }
  if (s->spare_fd >= 0)
    close(s->spare_fd);
  s->spare_fd = -1;
}

/* ------------------------------------------------------------------ accepting */

static void refuse(struct sl_transports *s, int fd, int code, const char *msg) {
  size_t len = 0;
  uint8_t *payload = s->ops->pack_error(code, msg, &len);
  struct sl_wire_out o;

  /* Best effort, never waiting: a fresh socket's buffer takes one small frame. */
  if (payload != NULL && sl_wire_out_init(&o, SL_WIRE_REPLY, payload, len, NULL, 0, NULL) == 0)
    sl_wire_out_write(&o, fd, NULL);
  free(payload);
  close(fd);
}

/* The fd table is full: give up the spare fd to take the connection off the backlog, tell the
 * client, and take the spare back. */
static int accept_without_fds(struct sl_transports *s, int listen_fd, struct sl_err *err) {
  int fd;

  if (s->spare_fd < 0)
    return sl_err_set(err, SUBLET_EIO, "accept: %s (raise LimitNOFILE)", strerror(EMFILE));
  close(s->spare_fd);
  fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
  sl_err_set(err, SUBLET_ENOHOSTMEM, "subletd has no file descriptor left for a connection: "
             "try again later; its administrator may raise LimitNOFILE");
  if (fd >= 0)
    refuse(s, fd, err->code, err->msg);
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  /* With the table full accept fails even when nobody is waiting: then there was nobody */
  return fd >= 0 ? err->code : -EAGAIN;
}

static void on_io(uv_poll_t *h, int status, int events);

static int transport_new(struct sl_transports *s, int fd, const struct ucred *peer,
                         struct sl_transport **out, struct sl_err *err) {
  struct sl_transport *t = calloc(1, sizeof(*t));

  if (t == NULL || sl_users_join(&s->users, &t->share, peer->uid) != 0) {
    free(t);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "subletd is out of host memory");
  }
  t->set = s;
  t->fd = fd;
  t->peer = *peer;
  t->tail = &t->head;
  sl_wire_rx_init(&t->rx);
  uv_poll_init(s->loop, &t->poll, fd);
  uv_timer_init(s->loop, &t->timer);
  t->poll.data = t->timer.data = t;
  t->handles = 2;
  update(t);
  *out = t;
  return 0;
}

int sl_transports_accept(struct sl_transports *s, int listen_fd, struct sl_transport **out,
                         struct sl_err *err) {
  struct ucred peer;
  socklen_t len = sizeof(peer);
  int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK), rc;

  *out = NULL;
  if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ||
                 errno == ECONNABORTED))
    return -EAGAIN;
  if (fd < 0 && (errno == EMFILE || errno == ENFILE))
    return accept_without_fds(s, listen_fd, err);
  if (fd < 0)
    return sl_err_set(err, SUBLET_EIO, "accept: %s", strerror(errno));
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
    close(fd);
    return sl_err_set(err, SUBLET_EIO, "SO_PEERCRED: %s", strerror(errno));
  }
  rc = sl_users_admit(&s->users, peer.uid, err);
  if (rc == 0)
    rc = transport_new(s, fd, &peer, out, err);
  if (rc != 0)
    refuse(s, fd, rc, err->msg);
  return rc;
}

void *sl_transport_data(const struct sl_transport *t) {
  return t->data;
}

void sl_transport_set_data(struct sl_transport *t, void *data) {
  t->data = data;
}

const struct ucred *sl_transport_peer(const struct sl_transport *t) {
  return &t->peer;
}

void sl_transport_pause(struct sl_transport *t, int on) {
  t->paused = on;
  if (!on)
    t->backlog = 1; /* pumped from the loop, at the timer's next turn */
  update(t);
}

int sl_transport_peer_in_group(const struct sl_transport *t, gid_t gid) {
  return sl_users_peer_in_group(t->fd, &t->peer, gid);
}

/* ------------------------------------------------------------------ sending */

static void item_free(struct tx_item *it) {
  sl_wire_close_fds(it->fds, it->nfds);
  free(it->payload);
  free(it);
}

/* May a frame with n fds go now? Sets t->fds_wait to the bound it waits for. */
static int fds_may_go(struct sl_transport *t, size_t n) {
  t->fds_wait = sl_users_fds_may_go(&t->set->users, &t->share, n, uv_now(t->set->loop));
  return t->fds_wait == SL_USERS_FDS_GO;
}

/* Writes the head frame once; returns 1 to go on with the next one, 0 to stop. */
static int write_head(struct sl_transport *t) {
  struct tx_item *it = t->head;
  struct sl_err err = {0};
  size_t before = it->out.done;
  int rc;

  if (before == 0 && it->nfds > 0 && !fds_may_go(t, it->nfds))
    return 0;
  t->fds_wait = SL_USERS_FDS_GO;
  t->refs_wait = 0;
  rc = sl_wire_out_write(&it->out, t->fd, &err);
  if (it->out.done > before) {
    t->progress = uv_now(t->set->loop);
    t->tx_bytes -= it->out.done - before;
    sl_users_fds_sent(&t->set->users, &t->share, (unsigned)it->nfds);
    sl_wire_close_fds(it->fds, it->nfds); /* sent: the kernel holds its own references */
    it->nfds = 0;
  }
  if (rc == SL_WIRE_OUT_REFS && t->refs_since == 0)
    t->refs_since = uv_now(t->set->loop);
  if (rc != SL_WIRE_OUT_REFS)
    t->refs_since = 0;
  if (rc == SL_WIRE_OUT_REFS)
    t->refs_wait = 1;
  if (rc < 0)
    sl_transport_close(t, err.msg);
  if (rc != SL_WIRE_OUT_DONE)
    return 0;
  t->head = it->next;
  if (t->head == NULL)
    t->tail = &t->head;
  item_free(it);
  return 1;
}

static void flush(struct sl_transport *t) {
  while (t->head != NULL && write_head(t))
    ;
}

int sl_transport_send(struct sl_transport *t, uint16_t kind, uint8_t *payload, size_t len,
                      int *fds, size_t nfds) {
  struct tx_item *it = calloc(1, sizeof(*it));
  int rc = SUBLET_EPIPE;

  if (it != NULL && !t->closing)
    rc = sl_wire_out_init(&it->out, kind, payload, len, it->fds, nfds, NULL);
  if (rc != 0) {
    sl_wire_close_fds(fds, nfds);
    free(payload);
    free(it);
    return it == NULL ? SUBLET_ENOHOSTMEM : rc;
  }
  if (nfds > 0)
    memcpy(it->fds, fds, nfds * sizeof(int));
  it->nfds = nfds;
  it->payload = payload;
  if (t->head == NULL)
    t->progress = uv_now(t->set->loop); /* the client's time to take it starts now */
  *t->tail = it;
  t->tail = &it->next;
  t->tx_bytes += SL_WIRE_HEADER + len;
  if (t->tx_bytes > t->set->lim.tx_max) {
    sl_transport_close(t, "the client does not read its replies (output queue full)");
    return SUBLET_EPIPE;
  }
  flush(t);
  update(t);
  return 0;
}

/* ------------------------------------------------------------------ receiving */

/* Frames queued and not begun are dropped: the Error that says why the client is cut off
 * goes first (one begun must be finished before it). */
static void drop_unbegun(struct sl_transport *t) {
  struct tx_item **link = &t->head;

  if (*link != NULL && (*link)->out.done > 0)
    link = &(*link)->next;
  while (*link != NULL) {
    struct tx_item *it = *link;
    *link = it->next;
    t->tx_bytes -= it->out.len + SL_WIRE_HEADER - it->out.done;
    item_free(it);
  }
  t->tail = link;
  t->fds_wait = SL_USERS_FDS_GO;
  t->refs_wait = 0;
}

/* Tells the client why (an Error frame with id 0, where its socket takes it) and closes. */
static void protocol_error(struct sl_transport *t, const struct sl_err *err) {
  size_t len = 0;
  uint8_t *payload = t->set->ops->pack_error(err->code, err->msg, &len);

  if (payload != NULL)
    sl_transport_send(t, SL_WIRE_REPLY, payload, len, NULL, 0);
  sl_transport_close(t, err->msg);
}

/* A connection over a bound: counted, told, closed. */
static void cut_off(struct sl_transport *t, int code, const char *why) {
  struct sl_err err = {.code = code};

  snprintf(err.msg, sizeof(err.msg), "%s", why);
  t->set->cut_off++;
  drop_unbegun(t);
  protocol_error(t, &err);
}

/* Counts the receive buffer against the uid's cap. Over it, the uid's connection that holds
 * the most is cut off (its buffer no longer counts), until under: the one that read last is
 * often a small one. Returns nonzero when t itself was cut off. */
static int charge_rx(struct sl_transport *t) {
  const struct sl_users *users = &t->set->users;
  struct sl_users_conn *h;
  char why[160], a[32];

  sl_users_rx_set(&t->share, t->rx.cap);
  while ((h = sl_users_rx_over(users, &t->share)) != NULL) {
    snprintf(why, sizeof(why), "the receive buffers of uid %u's connections are over their cap "
             "(%s) and this one held the most: send large requests one at a time",
             (unsigned)t->peer.uid, sl_format_size(a, users->lim.rx_per_user));
    cut_off(of_share(h), SUBLET_ENOHOSTMEM, why);
    if (h == &t->share)
      return 1;
  }
  return 0;
}

/* A client whose replies pile up, or whose fds wait, is not read: it cannot make the daemon
 * queue without bound, in bytes or in fds (queued fds are open files of the daemon). */
static int may_read(const struct sl_transport *t) {
  return !t->closing && !t->paused && t->tx_bytes <= t->set->lim.tx_high && !t->fds_wait;
}

/* Hands out the whole frames buffered, a turn's worth, while the client's replies do not
 * pile up. Sets t->backlog when frames are left for the next turn. */
static void pump(struct sl_transport *t) {
  struct sl_frame_header h;
  const uint8_t *payload;
  int fds[SL_WIRE_MAX_FDS];
  struct sl_err err = {0};
  int rc = 1, n = 0;

  t->backlog = 0;
  while (may_read(t) && (t->backlog = n == FRAMES_PER_TURN) == 0 &&
         (rc = sl_wire_rx_next(&t->rx, &h, &payload, fds, &err)) == 1) {
    t->partial_since = 0;
    n++;
    t->set->ops->frame(t, &h, payload, fds);
  }
  if (rc < 0)
    protocol_error(t, &err);
  else if (rc == 0 && t->rx.len > t->rx.off && t->partial_since == 0)
    t->partial_since = uv_now(t->set->loop);
  if (!t->closing) { /* a large request handed out holds no buffer meanwhile */
    sl_wire_rx_trim(&t->rx);
    charge_rx(t);
  }
}


static void read_some(struct sl_transport *t) {
  struct sl_err err = {0};
  int n;

  for (int i = 0; i < READS_PER_WAKEUP && may_read(t); i++) {
    n = sl_wire_rx_read(&t->rx, t->fd, &err);
    if (charge_rx(t))
      return;
    if (n == -EAGAIN)
      return;
    if (n <= 0) { /* a client that dies resets its connection: routine */
      sl_transport_close(t, n == 0 ? "the client closed the connection" : err.msg);
      return;
    }
    pump(t);
    if (t->backlog)
      return;
  }
}

/* ------------------------------------------------------------------ the loop */

static void on_io(uv_poll_t *h, int status, int events) {
  struct sl_transport *t = h->data;

  if (status < 0) {
    sl_transport_close(t, uv_strerror(status));
    return;
  }
  if (events & UV_WRITABLE)
    flush(t);
  if (events & UV_READABLE)
    read_some(t);
  else if (events & UV_DISCONNECT)
    sl_transport_close(t, "the client hung up");
  if (!t->closing && !t->backlog)
    pump(t); /* frames held back while replies piled up */
  update(t);
}

static uint64_t deadline_of(const struct sl_transport *t) {
  const struct sl_transport_limits *lim = &t->set->lim;
  uint64_t when = UINT64_MAX;

  if (t->partial_since != 0)
    when = t->partial_since + lim->frame_ms;
  if (t->head != NULL && !t->refs_wait && t->progress + lim->stall_ms < when)
    when = t->progress + lim->stall_ms;
  if (t->refs_wait && t->refs_since + lim->stall_ms < when)
    when = t->refs_since + lim->stall_ms;
  if (t->fds_wait || t->refs_wait)
    when = when < uv_now(t->set->loop) + RETRY_MS ? when : uv_now(t->set->loop) + RETRY_MS;
  if (t->backlog)
    when = 0; /* the next turn */
  return when;
}

/* What a client whose output stalled is told: what it, or its uid, did not take. */
static void stall_message(const struct sl_transport *t, char *why, size_t size) {
  const struct sl_transports *s = t->set;

  if (t->fds_wait == SL_USERS_FDS_USER)
    snprintf(why, size, "uid %u's connections hold %u fds sent by subletd and not yet "
             "received (the limit per user is %u), and this one's reply waited %u ms for "
             "them: a process of this uid does not read its replies", (unsigned)t->peer.uid,
             t->share.uid->fds_in_flight, s->users.lim.fds_per_user, s->lim.stall_ms);
  else if (t->fds_wait == SL_USERS_FDS_ALL)
    snprintf(why, size, "clients hold %u fds sent by subletd and not yet received (its "
             "budget is %u, half its open-files limit), and this one's reply waited %u ms for "
             "them: its administrator may raise LimitNOFILE", s->users.fds_in_flight,
             s->users.fds_budget, s->lim.stall_ms);
  else
    snprintf(why, size, "the client took no reply%s for %u ms",
             t->fds_wait ? " (nor the fds sent before)" : "", s->lim.stall_ms);
}

/* Cuts the connection off once a deadline of transport.h has passed. */
static void check_deadlines(struct sl_transport *t, uint64_t now) {
  const struct sl_transport_limits *lim = &t->set->lim;
  char why[320];

  if (t->partial_since != 0 && now >= t->partial_since + lim->frame_ms) {
    snprintf(why, sizeof(why), "a frame stayed incomplete for %u ms", lim->frame_ms);
    cut_off(t, SUBLET_ETIMEDOUT, why);
  } else if (t->refs_wait && now >= t->refs_since + lim->stall_ms) {
    snprintf(why, sizeof(why), "subletd could not pass fds to this client for %u ms: the "
             "kernel's limit on fds in flight for subletd's user (its open-files limit) is "
             "spent, by other processes of that user; its administrator may raise "
             "LimitNOFILE", lim->stall_ms);
    cut_off(t, SUBLET_EBUSY, why);
  } else if (t->head != NULL && !t->refs_wait && now >= t->progress + lim->stall_ms) {
    stall_message(t, why, sizeof(why));
    cut_off(t, SUBLET_ETIMEDOUT, why);
  }
}

static void on_timer(uv_timer_t *h) {
  struct sl_transport *t = h->data;

  if (t->closing) {
    teardown(t, 1);
    return;
  }
  if (t->fds_wait || t->refs_wait)
    flush(t);
  if (t->backlog)
    pump(t);
  if (!t->closing)
    check_deadlines(t, uv_now(t->set->loop));
  update(t);
}

/* Watches what the connection's state asks for: writable while output can go, readable while
 * its replies do not pile up, and the timer at the nearest deadline. */
static void update(struct sl_transport *t) {
  uint64_t when, now = uv_now(t->set->loop);
  int events = UV_DISCONNECT;

  if (t->closing)
    return;
  if (t->head != NULL && !t->fds_wait && !t->refs_wait)
    events |= UV_WRITABLE;
  if (may_read(t) && !t->backlog)
    events |= UV_READABLE;
  if (events != t->events) {
    uv_poll_start(&t->poll, events, on_io);
    t->events = events;
  }
  when = deadline_of(t);
  if (when == UINT64_MAX)
    uv_timer_stop(&t->timer);
  else
    uv_timer_start(&t->timer, on_timer, when > now ? when - now : 0, 0);
}

/* ------------------------------------------------------------------ closing */

static void on_handle_closed(uv_handle_t *h) {
  struct sl_transport *t = h->data;

  if (--t->handles > 0)
    return;
  close(t->fd);
  free(t);
}

void sl_transport_close(struct sl_transport *t, const char *why) {
  if (t->closing)
    return;
  t->closing = 1;
  snprintf(t->why, sizeof(t->why), "%s", why);
  sl_users_rx_set(&t->share, 0); /* it reads nothing more: not its uid's to count now */
  uv_poll_stop(&t->poll);
  uv_timer_start(&t->timer, on_timer, 0, 0);
}

/* The transport is gone for good: its fds in flight no longer count, nor it for its user. */
static void release(struct sl_transport *t) {
  t->lingering = 0;
  sl_users_leave(&t->set->users, &t->share);
  uv_close((uv_handle_t *)&t->poll, on_handle_closed);
  uv_close((uv_handle_t *)&t->timer, on_handle_closed);
}

static void on_linger(uv_timer_t *h) {
  struct sl_transport *t = h->data;

  sl_users_fds_refresh(&t->set->users, &t->share);
  if (t->share.fds_in_flight == 0) {
    uv_timer_stop(&t->timer);
    release(t);
  }
}

/* The client still holds fds sent on t, which the kernel counts against the daemon's user
 * until it reads or closes: t stays counted, its socket shut down (the client sees the end)
 * and open, looked at until they are taken. */
static void linger(struct sl_transport *t) {
  shutdown(t->fd, SHUT_RDWR);
  t->lingering = 1;
  uv_timer_start(&t->timer, on_linger, LINGER_MS, LINGER_MS);
}

static void teardown(struct sl_transport *t, int may_linger) {
  struct sl_transports *s = t->set;

  t->fds_wait = SL_USERS_FDS_GO;
  t->refs_wait = 0;
  if (t->head != NULL && t->head->out.done == 0)
    flush(t); /* one last try, never waiting: often the Error that says why */
  uv_poll_stop(&t->poll);
  uv_timer_stop(&t->timer);
  s->ops->closed(t, t->why);
  while (t->head != NULL) {
    struct tx_item *it = t->head;
    t->head = it->next;
    item_free(it);
  }
  sl_users_rx_set(&t->share, 0);
  sl_wire_rx_destroy(&t->rx);
  sl_users_fds_refresh(&s->users, &t->share);
  if (may_linger && t->share.fds_in_flight > 0)
    linger(t);
  else
    release(t);
}

void sl_transport_close_now(struct sl_transport *t, const char *why) {
  sl_transport_close(t, why);
  if (!uv_is_closing((uv_handle_t *)&t->timer))
    teardown(t, 0);
}
