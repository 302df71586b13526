/* transport.c - client connections below the protocol: a receive buffer, an output queue
 * flushed when the socket is writable, the bounds of transport.h, and deferred closes.
 *
 * libuv cannot pass fds over its streams, so each socket is watched with a uv_poll_t and
 * read and written with recvmsg/sendmsg (common/wire.c). One uv_timer_t per connection serves
 * its deadlines (a partial frame, output the client does not take), the retries of a frame
 * whose fds must wait, and the deferred close.
 *
 * Fd ownership: the transport owns its socket, the fds queued in its receive buffer and those
 * of queued frames; fds handed to ops->frame are the callee's.
 */
#include "transport.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/sockios.h>
#include <pwd.h>
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
/* Supplementary groups read for --allow-group; a peer in more (the kernel allows 65536) is
 * judged by its first ones. */
#define NGROUPS_MAX_READ 1024

struct sl_transport_user {
  struct sl_transport_user *next;
  uid_t uid;
  unsigned conns;
  size_t rx_bytes;
};

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
  struct sl_transport_user *user;
  int fd;
  struct ucred peer;
  uv_poll_t poll;
  uv_timer_t timer;
  int handles;              /* open libuv handles: t is freed when the last one has closed */
  int events;               /* what poll watches now */
  struct sl_wire_rx rx;
  size_t rx_charged;        /* rx.cap as counted in user->rx_bytes */
  struct tx_item *head, **tail;
  size_t tx_bytes;
  unsigned fds_in_flight;   /* sent since the socket was last seen empty */
  int fds_wait;             /* the head frame's fds wait until the client takes earlier ones */
  int refs_wait;            /* the head frame met ETOOMANYREFS */
  uint64_t progress;        /* loop ms when the client last took something, or output began */
  uint64_t partial_since;   /* loop ms when an incomplete frame began; 0: none */
  int backlog;              /* whole frames wait in rx for the next turn */
  int paused;               /* the layer above reads nothing now (sl_transport_pause) */
  int closing;
  char why[512];
  void *data;
};

static void update(struct sl_transport *t);
static void teardown(struct sl_transport *t);

/* ------------------------------------------------------------------ the set, per-uid counts */

int sl_transports_init(struct sl_transports *s, uv_loop_t *loop,
                       const struct sl_transport_limits *lim,
                       const struct sl_transport_ops *ops) {
  memset(s, 0, sizeof(*s));
  s->loop = loop;
  s->lim = *lim;
  s->ops = ops;
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return 0;
}

void sl_transports_destroy(struct sl_transports *s) {
  if (s->spare_fd >= 0)
    close(s->spare_fd);
  s->spare_fd = -1;
}

static struct sl_transport_user *user_of(struct sl_transports *s, uid_t uid) {
  for (struct sl_transport_user *u = s->users; u != NULL; u = u->next)
    if (u->uid == uid)
      return u;
  return NULL;
}

static void user_drop(struct sl_transports *s, struct sl_transport_user *u) {
  struct sl_transport_user **link = &s->users;

  if (--u->conns > 0)
    return;
  while (*link != u)
    link = &(*link)->next;
  *link = u->next;
  free(u);
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

static int admit(struct sl_transports *s, const struct ucred *peer, struct sl_err *err) {
  struct sl_transport_user *u = user_of(s, peer->uid);

  if (s->nconns >= s->lim.conns)
    return sl_err_set(err, SUBLET_EBUSY, "subletd serves %u connections, its limit: try again "
                      "later (its administrator may raise --max-connections)", s->nconns);
  if (u != NULL && u->conns >= s->lim.conns_per_user)
    return sl_err_set(err, SUBLET_EBUSY, "uid %u has %u connections to subletd, the limit per "
                      "user: close some (or raise --max-user-connections)", (unsigned)peer->uid,
                      u->conns);
  return 0;
}

static struct sl_transport_user *user_add(struct sl_transports *s, uid_t uid) {
  struct sl_transport_user *u = user_of(s, uid);

  if (u == NULL && (u = calloc(1, sizeof(*u))) != NULL) {
    u->uid = uid;
    u->next = s->users;
    s->users = u;
  }
  if (u != NULL)
    u->conns++;
  return u;
}

static void on_io(uv_poll_t *h, int status, int events);

static int transport_new(struct sl_transports *s, int fd, const struct ucred *peer,
                         struct sl_transport **out, struct sl_err *err) {
  struct sl_transport *t = calloc(1, sizeof(*t));
  struct sl_transport_user *u = t != NULL ? user_add(s, peer->uid) : NULL;

  if (u == NULL) {
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
  t->user = u;
  s->nconns++;
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
  rc = admit(s, &peer, err);
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

/* The peer's supplementary groups; returns their count (0 when none can be read). */
static size_t peer_groups(const struct sl_transport *t, gid_t *groups, size_t max) {
  socklen_t len = (socklen_t)(max * sizeof(gid_t));
  struct passwd *pw;
  int n = (int)max;

  if (getsockopt(t->fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0)
    return len / sizeof(gid_t);
  if (errno != ENOPROTOOPT || (pw = getpwuid(t->peer.uid)) == NULL ||
      getgrouplist(pw->pw_name, t->peer.gid, groups, &n) < 0)
    return 0;
  return (size_t)n;
}

int sl_transport_peer_in_group(const struct sl_transport *t, gid_t gid) {
  gid_t groups[NGROUPS_MAX_READ];
  size_t n;

  if (t->peer.gid == gid)
    return 1;
  n = peer_groups(t, groups, NGROUPS_MAX_READ);
  for (size_t i = 0; i < n; i++)
    if (groups[i] == gid)
      return 1;
  return 0;
}

int sl_transport_closing(const struct sl_transport *t) {
  return t->closing;
}

/* ------------------------------------------------------------------ sending */

static void item_free(struct tx_item *it) {
  sl_wire_close_fds(it->fds, it->nfds);
  free(it->payload);
  free(it);
}

/* Bytes still in the socket that the client has not taken (for a Unix socket, SIOCOUTQ
 * counts what the receiver has not consumed yet, its fds included). */
static int socket_drained(const struct sl_transport *t) {
  int n = 0;

  return ioctl(t->fd, SIOCOUTQ, &n) == 0 && n == 0;
}

/* May a frame with n fds go now? Only while this connection's fds in flight stay within its
 * cap; once its socket is empty the client has taken them all. */
static int fds_may_go(struct sl_transport *t, size_t n) {
  if (t->fds_in_flight + n <= t->set->lim.fds_in_flight)
    return 1;
  if (!socket_drained(t))
    return 0;
  t->fds_in_flight = 0;
  t->progress = uv_now(t->set->loop);
  return 1;
}

/* Writes the head frame once; returns 1 to go on with the next one, 0 to stop. */
static int write_head(struct sl_transport *t) {
  struct tx_item *it = t->head;
  struct sl_err err = {0};
  size_t before = it->out.done;
  int rc;

  if (before == 0 && it->nfds > 0 && !fds_may_go(t, it->nfds)) {
    t->fds_wait = 1;
    return 0;
  }
  t->fds_wait = t->refs_wait = 0;
  rc = sl_wire_out_write(&it->out, t->fd, &err);
  if (it->out.done > before) {
    t->progress = uv_now(t->set->loop);
    t->tx_bytes -= it->out.done - before;
    t->fds_in_flight += (unsigned)it->nfds;
    sl_wire_close_fds(it->fds, it->nfds); /* sent: the kernel holds its own references */
    it->nfds = 0;
  }
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

/* Counts the receive buffer against the uid's cap; returns nonzero when over it. */
static int charge_rx(struct sl_transport *t) {
  struct sl_transport_user *u = t->user;

  u->rx_bytes = u->rx_bytes - t->rx_charged + t->rx.cap;
  t->rx_charged = t->rx.cap;
  return u->rx_bytes > t->set->lim.rx_per_user;
}

static void protocol_error(struct sl_transport *t, const struct sl_err *err) {
  size_t len = 0;
  uint8_t *payload = t->set->ops->pack_error(err->code, err->msg, &len);

  if (payload != NULL)
    sl_transport_send(t, SL_WIRE_REPLY, payload, len, NULL, 0);
  sl_transport_close(t, err->msg);
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
}


static void read_some(struct sl_transport *t) {
  struct sl_err err = {0};
  int n;

  for (int i = 0; i < READS_PER_WAKEUP && may_read(t); i++) {
    n = sl_wire_rx_read(&t->rx, t->fd, &err);
    if (charge_rx(t)) {
      sl_transport_close(t, "the receive buffers of this uid's connections are over their cap");
      return;
    }
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
  if (t->fds_wait || t->refs_wait)
    when = when < uv_now(t->set->loop) + RETRY_MS ? when : uv_now(t->set->loop) + RETRY_MS;
  if (t->backlog)
    when = 0; /* the next turn */
  return when;
}

static void on_timer(uv_timer_t *h) {
  struct sl_transport *t = h->data;
  const struct sl_transport_limits *lim = &t->set->lim;
  uint64_t now = uv_now(t->set->loop);
  char why[96];

  if (t->closing) {
    teardown(t);
    return;
  }
  if (t->fds_wait || t->refs_wait)
    flush(t);
  if (t->backlog)
    pump(t);
  if (t->partial_since != 0 && now >= t->partial_since + lim->frame_ms) {
    snprintf(why, sizeof(why), "a frame stayed incomplete for %u ms", lim->frame_ms);
    t->set->cut_off++;
    sl_transport_close(t, why);
  } else if (t->head != NULL && !t->refs_wait && now >= t->progress + lim->stall_ms) {
    snprintf(why, sizeof(why), "the client took no reply%s for %u ms",
             t->fds_wait ? " (nor the fds sent before)" : "", lim->stall_ms);
    t->set->cut_off++;
    sl_transport_close(t, why);
  }
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
  uv_poll_stop(&t->poll);
  uv_timer_start(&t->timer, on_timer, 0, 0);
}

static void teardown(struct sl_transport *t) {
  struct sl_transports *s = t->set;

  t->fds_wait = t->refs_wait = 0;
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
  t->user->rx_bytes -= t->rx_charged;
  user_drop(s, t->user);
  s->nconns--;
  sl_wire_rx_destroy(&t->rx);
  uv_close((uv_handle_t *)&t->poll, on_handle_closed);
  uv_close((uv_handle_t *)&t->timer, on_handle_closed);
}

void sl_transport_close_now(struct sl_transport *t, const char *why) {
  sl_transport_close(t, why);
  if (!uv_is_closing((uv_handle_t *)&t->timer))
    teardown(t);
}
