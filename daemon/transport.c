/* transport.c - client connections below the protocol: a receive buffer, an output queue
 * flushed when the socket is writable, the bounds of transport.h, and deferred closes.
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
#include <sys/resource.h>
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
/* How often a lingering connection's socket is looked at: has its client taken its fds? */
#define LINGER_MS 100
/* A user with fewer connections than this may take the last ones kept (reserve_of). */
#define RESERVE_FEW 4

struct sl_transport_user {
  struct sl_transport_user *next;
  uid_t uid;
  unsigned conns;           /* lingering ones too */
  size_t rx_bytes;
  unsigned fds_in_flight;   /* of all its connections */
  struct sl_transport *list; /* its connections (t->user_next) */
};

/* Why a frame's fds wait (tx_item's head), for the message of a cut-off. */
enum fds_wait { FDS_GO, FDS_CONN, FDS_USER, FDS_ALL };

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
  struct sl_transport *user_next;
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
  int fds_wait;             /* enum fds_wait: the head frame's fds wait for earlier ones */
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

/* ------------------------------------------------------------------ the set, per-uid counts */

/* The kernel refuses fds in flight (ETOOMANYREFS) once the daemon's user has more than its
 * open-files limit in flight, over all its processes (a daemon per GPU, the same user): this
 * daemon takes half, and one uid at most a quarter of that (never less than one frame's). */
static void fds_budget_init(struct sl_transports *s) {
  struct rlimit rl;
  rlim_t half = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rl.rlim_cur / 2 : 512;
  unsigned quarter;

  s->fds_budget = half > SL_WIRE_MAX_FDS ? (half < UINT32_MAX ? (unsigned)half : UINT32_MAX)
                                         : SL_WIRE_MAX_FDS;
  quarter = s->fds_budget / 4 > SL_WIRE_MAX_FDS ? s->fds_budget / 4 : SL_WIRE_MAX_FDS;
  if (s->lim.fds_per_user > quarter)
    s->lim.fds_per_user = quarter;
}

int sl_transports_init(struct sl_transports *s, uv_loop_t *loop,
                       const struct sl_transport_limits *lim,
                       const struct sl_transport_ops *ops) {
  memset(s, 0, sizeof(*s));
  s->loop = loop;
  s->lim = *lim;
  s->ops = ops;
  s->spare_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  fds_budget_init(s);
  return 0;
}

/* Ends the lingering connections: at shutdown, their clients' fds are the kernel's to count. */
void sl_transports_destroy(struct sl_transports *s) {
  struct sl_transport_user *u = s->users, *next;

  for (; u != NULL; u = next) {
    struct sl_transport *t = u->list, *t_next;
    next = u->next; /* u goes with its last connection */
    for (; t != NULL; t = t_next) {
      t_next = t->user_next;
      if (t->lingering)
        release(t);
    }
  }
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

/* t leaves its user's connections; the user goes with its last one. */
static void user_drop(struct sl_transports *s, struct sl_transport *t) {
  struct sl_transport_user *u = t->user, **link = &s->users;
  struct sl_transport **tl = &u->list;

  while (*tl != t)
    tl = &(*tl)->user_next;
  *tl = t->user_next;
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

/* The last connections of --max-connections (an eighth) are kept for users with fewer than
 * RESERVE_FEW: one user, or a few, cannot take them all from the others. */
static unsigned reserve_of(const struct sl_transport_limits *lim) {
  return lim->conns >= 2 ? (lim->conns + 7) / 8 : 0;
}

static int admit(struct sl_transports *s, const struct ucred *peer, struct sl_err *err) {
  struct sl_transport_user *u = user_of(s, peer->uid);
  unsigned held = u != NULL ? u->conns : 0, reserve = reserve_of(&s->lim);

  if (s->nconns >= s->lim.conns)
    return sl_err_set(err, SUBLET_EBUSY, "subletd serves %u connections, its limit: try again "
                      "later (its administrator may raise --max-connections)", s->nconns);
  if (s->nconns >= s->lim.conns - reserve && held >= RESERVE_FEW)
    return sl_err_set(err, SUBLET_EBUSY, "subletd serves %u connections; the last %u of its "
                      "limit are kept for users with fewer than %d and uid %u has %u: close "
                      "some (or its administrator may raise --max-connections)", s->nconns,
                      reserve, RESERVE_FEW, (unsigned)peer->uid, held);
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

static void user_link(struct sl_transport_user *u, struct sl_transport *t) {
  t->user = u;
  t->user_next = u->list;
  u->list = t;
}

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
  user_link(u, t);
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

static void fds_sent(struct sl_transport *t, unsigned n) {
  t->fds_in_flight += n;
  t->user->fds_in_flight += n;
  t->set->fds_in_flight += n;
}

/* Once its socket is empty the client has taken every fd sent on it. */
static void fds_refresh(struct sl_transport *t) {
  if (t->fds_in_flight == 0 || !socket_drained(t))
    return;
  t->user->fds_in_flight -= t->fds_in_flight;
  t->set->fds_in_flight -= t->fds_in_flight;
  t->fds_in_flight = 0;
  t->progress = uv_now(t->set->loop);
}

static void fds_refresh_user(struct sl_transport_user *u) {
  for (struct sl_transport *t = u->list; t != NULL; t = t->user_next)
    fds_refresh(t);
}

/* Every holder's socket, once a loop tick at most (a waiting frame retries every RETRY_MS). */
static void fds_refresh_all(struct sl_transports *s) {
  if (s->fds_scanned == uv_now(s->loop))
    return;
  s->fds_scanned = uv_now(s->loop);
  for (struct sl_transport_user *u = s->users; u != NULL; u = u->next)
    if (u->fds_in_flight > 0)
      fds_refresh_user(u);
}

/* Which bound n more fds of t's would cross (FDS_GO: none). A frame goes whatever its size
 * when nothing is in flight at that level: a frame of 253 fds is never held for ever. */
static enum fds_wait fds_over(const struct sl_transport *t, size_t n) {
  const struct sl_transports *s = t->set;

  if (t->fds_in_flight > 0 && t->fds_in_flight + n > s->lim.fds_in_flight)
    return FDS_CONN;
  if (t->user->fds_in_flight > 0 && t->user->fds_in_flight + n > s->lim.fds_per_user)
    return FDS_USER;
  if (s->fds_in_flight > 0 && s->fds_in_flight + n > s->fds_budget)
    return FDS_ALL;
  return FDS_GO;
}

/* May a frame with n fds go now? Sets t->fds_wait to the bound it waits for. */
static int fds_may_go(struct sl_transport *t, size_t n) {
  enum fds_wait w = fds_over(t, n);

  if (w == FDS_CONN)
    fds_refresh(t);
  else if (w == FDS_USER)
    fds_refresh_user(t->user);
  else if (w == FDS_ALL)
    fds_refresh_all(t->set);
  t->fds_wait = w == FDS_GO ? FDS_GO : fds_over(t, n);
  return t->fds_wait == FDS_GO;
}

/* Writes the head frame once; returns 1 to go on with the next one, 0 to stop. */
static int write_head(struct sl_transport *t) {
  struct tx_item *it = t->head;
  struct sl_err err = {0};
  size_t before = it->out.done;
  int rc;

  if (before == 0 && it->nfds > 0 && !fds_may_go(t, it->nfds))
    return 0;
  t->fds_wait = FDS_GO;
  t->refs_wait = 0;
  rc = sl_wire_out_write(&it->out, t->fd, &err);
  if (it->out.done > before) {
    t->progress = uv_now(t->set->loop);
    t->tx_bytes -= it->out.done - before;
    fds_sent(t, (unsigned)it->nfds);
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
  t->fds_wait = FDS_GO;
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

static void rx_uncharge(struct sl_transport *t) {
  t->user->rx_bytes -= t->rx_charged;
  t->rx_charged = 0;
}

/* The uid's open connection with the largest receive buffer. */
static struct sl_transport *rx_holder(struct sl_transport_user *u) {
  struct sl_transport *best = NULL;

  for (struct sl_transport *t = u->list; t != NULL; t = t->user_next)
    if (!t->closing && (best == NULL || t->rx_charged > best->rx_charged))
      best = t;
  return best;
}

/* Counts the receive buffer against the uid's cap. Over it, the uid's connection that holds
 * the most is cut off (its buffer no longer counts), until under: the one that read last is
 * often a small one. Returns nonzero when t itself was cut off. */
static int charge_rx(struct sl_transport *t) {
  struct sl_transport_user *u = t->user;
  char why[160], a[32];

  u->rx_bytes = u->rx_bytes - t->rx_charged + t->rx.cap;
  t->rx_charged = t->rx.cap;
  while (u->rx_bytes > t->set->lim.rx_per_user) {
    struct sl_transport *h = rx_holder(u);
    snprintf(why, sizeof(why), "the receive buffers of uid %u's connections are over their cap "
             "(%s) and this one held the most: send large requests one at a time",
             (unsigned)u->uid, sl_format_size(a, t->set->lim.rx_per_user));
    cut_off(h, SUBLET_ENOHOSTMEM, why);
    if (h == t)
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

  if (t->fds_wait == FDS_USER)
    snprintf(why, size, "uid %u's connections hold %u fds sent by subletd and not yet "
             "received (the limit per user is %u), and this one's reply waited %u ms for "
             "them: a process of this uid does not read its replies", (unsigned)t->peer.uid,
             t->user->fds_in_flight, s->lim.fds_per_user, s->lim.stall_ms);
  else if (t->fds_wait == FDS_ALL)
    snprintf(why, size, "clients hold %u fds sent by subletd and not yet received (its "
             "budget is %u, half its open-files limit), and this one's reply waited %u ms for "
             "them: its administrator may raise LimitNOFILE", s->fds_in_flight, s->fds_budget,
             s->lim.stall_ms);
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
  rx_uncharge(t); /* it reads nothing more: its buffer is not its uid's to count now */
  uv_poll_stop(&t->poll);
  uv_timer_start(&t->timer, on_timer, 0, 0);
}

/* The transport is gone for good: its fds in flight no longer count, nor it for its user. */
static void release(struct sl_transport *t) {
  struct sl_transports *s = t->set;

  s->fds_in_flight -= t->fds_in_flight;
  t->user->fds_in_flight -= t->fds_in_flight;
  t->fds_in_flight = 0;
  t->lingering = 0;
  user_drop(s, t);
  s->nconns--;
  uv_close((uv_handle_t *)&t->poll, on_handle_closed);
  uv_close((uv_handle_t *)&t->timer, on_handle_closed);
}

static void on_linger(uv_timer_t *h) {
  struct sl_transport *t = h->data;

  fds_refresh(t);
  if (t->fds_in_flight == 0) {
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

  t->fds_wait = FDS_GO;
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
  rx_uncharge(t);
  sl_wire_rx_destroy(&t->rx);
  fds_refresh(t);
  if (may_linger && t->fds_in_flight > 0)
    linger(t);
  else
    release(t);
}

void sl_transport_close_now(struct sl_transport *t, const char *why) {
  sl_transport_close(t, why);
  if (!uv_is_closing((uv_handle_t *)&t->timer))
    teardown(t, 0);
}
