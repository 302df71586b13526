/* client.c - libsublet's lowest floor: errors, the conversation with subletd (connecting, the
 * one request path), the device this process maps with.
 * Floor 1 (client.h's floors): it calls no other file of client/. */
#include "client.h"

#include <errno.h>
#include <poll.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "clock.h"
#include "msg.h"

static __thread struct sl_err last_error;

struct sl_err *sl_client_last_error(void) {
  return &last_error;
}

int sl_client_fail(int code, const char *fmt, ...) {
  va_list ap;

  sl_client_last_error()->code = code;
  va_start(ap, fmt);
  vsnprintf(last_error.msg, sizeof(last_error.msg), fmt, ap);
  va_end(ap);
  return code;
}

int sl_client_fail_err(const struct sl_err *err) {
  last_error = *err;
  if (sl_client_last_error()->code == 0)
    sl_client_last_error()->code = SUBLET_EIO;
  return sl_client_last_error()->code;
}

SUBLET_EXPORT const char *sublet_version(void) {
  return SUBLET_VERSION_STRING;
}

SUBLET_EXPORT const char *sublet_strerror(int code) {
  return sl_strerror(code);
}

SUBLET_EXPORT const char *sublet_last_error(void) {
  return last_error.msg;
}

/* ------------------------------------------------------------------ requests */

/* The reply did not come, or not as it should: the conversation is out of step (a late reply
 * would answer the next request). The connection is shut so that every later call fails
 * clearly; the daemon settles the books as for any client that goes. */
static int broken(sublet_client *c, int code, const struct sl_err *err) {
  shutdown(c->sock, SHUT_RDWR);
  return err != NULL ? sl_client_fail_err(err) : code;
}

/* The request's name in the protocol ("region_create"), for messages. */
static const char *request_name(const Sublet__Request *req) {
  const ProtobufCFieldDescriptor *f =
      protobuf_c_message_descriptor_get_field(&sublet__request__descriptor, req->body_case);

  return f != NULL ? f->name : "a request";
}

/* Past its deadline subletd is not answering: it is stopped, overloaded or hung. */
static int not_answering(sublet_client *c, const Sublet__Request *req, int deadline_ms) {
  return broken(c, sl_client_fail(SUBLET_ETIMEDOUT, "subletd at %s did not answer %s within "
                                  "%.1f s; is it stopped (SIGSTOP) or overloaded? (the "
                                  "deadline: $SUBLET_TIMEOUT, sublet_set_timeout)", c->path,
                                  request_name(req), deadline_ms / 1000.0), NULL);
}

void sl_client_wake(sublet_client *c) {
  uint64_t one = 1;

  if (c->wake_fd >= 0 && write(c->wake_fd, &one, sizeof(one)) != sizeof(one))
    return; /* cannot happen: an eventfd holds 2^64 - 2 wakeups */
}

/* Out of host memory, the region is not noted: its window goes at the next borrow, or exit. */
static void note_gone(sublet_client *c, uint64_t region) {
  if (c->ngone == c->capgone) {
    size_t cap = c->capgone ? 2 * c->capgone : 4;
    uint64_t *v = realloc(c->gone, cap * sizeof(*v));
    if (v == NULL)
      return;
    c->gone = v;
    c->capgone = cap;
  }
  c->gone[c->ngone++] = region;
}

/* A notice (PROTOCOL.md, Notices): a region this client kept a window of has gone. It is
 * noted for borrow.c, whose watcher lets go of the region, and the watcher is woken. Returns 1
 * when rep was one (and frees it). */
static int heard(sublet_client *c, const struct sl_frame_header *h, Sublet__Reply *rep) {
  if (rep == NULL || rep->id != 0 || rep->body_case != SUBLET__REPLY__BODY_REGION_GONE ||
      h->nfds != 0)
    return 0;
  note_gone(c, rep->region_gone->region);
  sl_client_wake(c);
  sublet__reply__free_unpacked(rep, NULL);
  return 1;
}

/* The next frame that is not a notice: *rep unpacked (NULL when it is not a Reply), its fds in
 * rxfds. timeout_ms < 0: no limit. */
static int recv_reply(sublet_client *c, struct sl_frame_header *h, Sublet__Reply **rep,
                      int *rxfds, int timeout_ms, struct sl_err *err) {
  int64_t start = sl_clock_ms();
  const uint8_t *payload;
  int rc;

  do {
    rc = sl_wire_recv(&c->rx, c->sock, h, &payload, rxfds, sl_clock_left_ms(start, timeout_ms),
                      err);
    if (rc != 0)
      return rc;
    if (h->version != SUBLET_PROTOCOL_VERSION) {
      sl_wire_close_fds(rxfds, h->nfds);
      return broken(c, sl_client_fail(SUBLET_EVERSION, "subletd speaks protocol %u, this "
                                      "library %d: install matching versions of sublet and "
                                      "subletd", h->version, SUBLET_PROTOCOL_VERSION), NULL);
    }
    *rep = h->kind == SL_WIRE_REPLY ? sl_msg_unpack_reply(payload, h->length, err) : NULL;
  } while (heard(c, h, *rep));
  return 0;
}

int sl_client_read_notices(sublet_client *c) {
  struct sl_frame_header h;
  Sublet__Reply *rep = NULL;
  struct sl_err err = {0};
  int rxfds[SL_WIRE_MAX_FDS];
  int rc = recv_reply(c, &h, &rep, rxfds, 0, &err);

  if (rc == SUBLET_ETIMEDOUT)
    return 0; /* nothing more: what came was notices, or a part of one */
  if (rc != 0)
    return rc == SUBLET_EVERSION ? rc : broken(c, rc, &err);
  sl_wire_close_fds(rxfds, h.nfds);
  if (rep != NULL && rep->id == 0 && rep->body_case == SUBLET__REPLY__BODY_ERROR)
    rc = sl_client_fail(rep->error->code, "%s", rep->error->message);
  else
    rc = sl_client_fail(SUBLET_EPROTO, "subletd sent a reply that no request asked for");
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return broken(c, rc, NULL);
}

/* Sends req with fd, if not -1 (a request that waits in subletd, waits: one sublet_cancel()
 * may give up). */
static int send_request(sublet_client *c, Sublet__Request *req, int fd, int waits,
                        int deadline_ms, struct sl_err *err) {
  int rc;

  pthread_mutex_lock(&c->send_lock);
  req->id = ++c->next_id;
  rc = sl_msg_send_request(c->sock, req, &fd, fd >= 0, deadline_ms, err);
  c->waiting_id = rc == 0 && waits ? req->id : 0;
  pthread_mutex_unlock(&c->send_lock);
  return rc;
}

/* Sends req and receives its reply frame: *rep unpacked, its fds in fds[0..*nfds) (no more
 * than capacity, else the conversation is broken and they are closed). Notices on the way
 * are noted (heard). */
static int exchange(sublet_client *c, Sublet__Request *req, int fd, Sublet__Reply **rep,
                    int *fds, size_t capacity, size_t *nfds, int waits, int deadline_ms,
                    const struct sl_meanwhile *mw) {
  struct sl_frame_header h;
  struct sl_err err = {0};
  int rxfds[SL_WIRE_MAX_FDS];
  int64_t start = sl_clock_ms();
  int rc;

  *rep = NULL;
  rc = send_request(c, req, fd, waits, deadline_ms, &err);
  if (rc == 0 && mw != NULL)
    mw->run(mw->arg);
  if (rc == 0) {
    rc = recv_reply(c, &h, rep, rxfds, sl_clock_left_ms(start, deadline_ms), &err);
    pthread_mutex_lock(&c->send_lock);
    c->waiting_id = 0; /* answered (or lost): nothing left to cancel */
    pthread_mutex_unlock(&c->send_lock);
  } else if (rc == SUBLET_EPIPE) {
    /* Closed on us: subletd may have said why first (a cap reached), in a frame still here */
    struct sl_err sent = err;
    if ((rc = recv_reply(c, &h, rep, rxfds, 0, &err)) != 0) {
      err = sent;
      rc = SUBLET_EPIPE;
    }
  }
  if (rc == SUBLET_ETIMEDOUT)
    return not_answering(c, req, deadline_ms);
  if (rc == SUBLET_EVERSION)
    return rc;
  if (rc != 0)
    return broken(c, rc, &err);
  if (*rep != NULL && (*rep)->id == 0 && (*rep)->body_case == SUBLET__REPLY__BODY_ERROR) {
    /* Not an answer: why subletd closes the connection (a protocol error, a cap reached) */
    sl_wire_close_fds(rxfds, h.nfds);
    rc = sl_client_fail((*rep)->error->code, "%s", (*rep)->error->message);
    sublet__reply__free_unpacked(*rep, NULL);
    *rep = NULL;
    return broken(c, rc, NULL);
  }
  if (*rep == NULL || (*rep)->id != req->id || h.nfds > capacity) {
    sl_wire_close_fds(rxfds, h.nfds);
    if (*rep != NULL)
      sublet__reply__free_unpacked(*rep, NULL);
    *rep = NULL;
    return broken(c, sl_client_fail(SUBLET_EPROTO, "subletd sent an unexpected reply to %s",
                                    request_name(req)), NULL);
  }
  memcpy(fds, rxfds, h.nfds * sizeof(int));
  *nfds = h.nfds;
  return 0;
}

/* What the daemon may take on purpose, plus what it may take to do the work. */
static int deadline_of(const sublet_client *c, int wait_ms) {
  if (wait_ms < 0 || c->timeout_ms < 0)
    return -1;
  return wait_ms > INT_MAX - c->timeout_ms ? INT_MAX : wait_ms + c->timeout_ms;
}

static int call(sublet_client *c, Sublet__Request *req, int fd, Sublet__Reply__BodyCase expect,
                Sublet__Reply **out, int *fds, size_t *nfds, int wait_ms,
                const struct sl_meanwhile *mw) {
  size_t capacity = nfds != NULL ? *nfds : 0, got = 0;
  int none[1], *rxfds = fds != NULL ? fds : none;
  Sublet__Reply *rep = NULL;
  int keep, rc = exchange(c, req, fd, &rep, rxfds, capacity, &got, wait_ms != 0,
                          deadline_of(c, wait_ms), mw);

  if (rc == 0 && rep->body_case == SUBLET__REPLY__BODY_ERROR)
    rc = sl_client_fail(rep->error->code, "%s", rep->error->message);
  else if (rc == 0 && rep->body_case != expect)
    rc = broken(c, sl_client_fail(SUBLET_EPROTO, "subletd answered %s with something else",
                                  request_name(req)), NULL);
  if (rc != 0)
    sl_wire_close_fds(rxfds, got); /* fds come only with a success */
  if (nfds != NULL)
    *nfds = rc == 0 ? got : 0;
  /* The caller gets the reply of a success, and an Error for its details. */
  keep = out != NULL && rep != NULL && (rc == 0 || rep->body_case == SUBLET__REPLY__BODY_ERROR);
  if (!keep && rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  if (out != NULL)
    *out = keep ? rep : NULL;
  return rc;
}

int sl_client_call_fd(sublet_client *c, Sublet__Request *req, int fd,
                      Sublet__Reply__BodyCase expect, Sublet__Reply **out, int *fds,
                      size_t *nfds, int wait_ms) {
  return call(c, req, fd, expect, out, fds, nfds, wait_ms, NULL);
}

int sl_client_call_fd_meanwhile(sublet_client *c, Sublet__Request *req, int fd,
                                Sublet__Reply__BodyCase expect, Sublet__Reply **out, int *fds,
                                size_t *nfds, int wait_ms, const struct sl_meanwhile *mw) {
  return call(c, req, fd, expect, out, fds, nfds, wait_ms, mw);
}

int sl_client_call(sublet_client *c, Sublet__Request *req, Sublet__Reply__BodyCase expect,
                   Sublet__Reply **out, int *fds, size_t *nfds, int wait_ms) {
  return call(c, req, -1, expect, out, fds, nfds, wait_ms, NULL);
}

int sl_client_call_meanwhile(sublet_client *c, Sublet__Request *req,
                             Sublet__Reply__BodyCase expect, Sublet__Reply **out, int *fds,
                             size_t *nfds, const struct sl_meanwhile *mw) {
  return call(c, req, -1, expect, out, fds, nfds, 0, mw);
}

int sl_client_readable(const sublet_client *c) {
  struct pollfd p = {.fd = c->sock, .events = POLLIN};

  return c->rx.len > c->rx.off || poll(&p, 1, 0) != 0; /* buffered: a frame came along */
}

int sl_client_undo(sublet_client *c, Sublet__Request *req, Sublet__Reply__BodyCase expect) {
  struct sl_err saved = *sl_client_last_error();

  sl_client_call(c, req, expect, NULL, NULL, NULL, 0);
  *sl_client_last_error() = saved;
  return 0;
}

int sl_client_ok(sublet_client *c, Sublet__Request *req, int undo) {
  return undo ? sl_client_undo(c, req, SUBLET__REPLY__BODY_OK)
              : sl_client_call(c, req, SUBLET__REPLY__BODY_OK, NULL, NULL, NULL, 0);
}

/* ------------------------------------------------------------------ connecting */

/* A Unix socket's connect fails with EAGAIN while the daemon's backlog is full (a daemon
 * that does not accept: stopped, or flooded): try again until the deadline. */
static int connect_until(int fd, const struct sockaddr_un *addr, int64_t deadline) {
  while (connect(fd, (const struct sockaddr *)addr, sizeof(*addr)) != 0) {
    if (errno != EAGAIN && errno != EINTR)
      return -errno;
    if (sl_clock_ms() >= deadline)
      return SUBLET_ETIMEDOUT;
    usleep(10000);
  }
  return 0;
}

/* stat on the socket failed: a directory on its way is closed to us. When it is the socket's
 * own directory and ours (a chmod of the user daemon's directory), the fix is its mode. */
static int denied_dir(const char *path, const char *own) {
  char dir[PATH_MAX];
  char *slash;
  struct stat st;

  snprintf(dir, sizeof(dir), "%s", path);
  slash = strrchr(dir, '/');
  if (slash == NULL)
    snprintf(dir, sizeof(dir), ".");
  else
    slash[slash == dir] = '\0'; /* "/x.sock" is in "/" */
  if (stat(dir, &st) == 0 && st.st_uid == getuid())
    return sl_client_fail(SUBLET_EACCES, "permission denied on %s: its directory %s is yours, "
                          "but its mode %04o shuts you out; chmod u+rwx %s%s", path, dir,
                          (unsigned)(st.st_mode & 07777), dir, own);
  return sl_client_fail(SUBLET_EACCES, "permission denied on %s: it is in a directory of "
                        "another user's; ask its owner, or use a daemon of your own%s",
                        path, own);
}

/* A daemon is there but its socket's mode (0660, the daemon's group) or directory keeps us
 * out: "start it" would be wrong advice, and so would taking the socket for stale (a second
 * daemon on the same GPU). The fix is the socket's group, or its mode when the socket is ours,
 * or, when $SUBLET_SOCKET chose this socket, unsetting it so that the Python package finds or
 * starts the user's own daemon. */
static int denied(const char *path) {
  const char *env = getenv("SUBLET_SOCKET");
  const char *own = env != NULL && strcmp(env, path) == 0
                        ? " (or use your own daemon: unset SUBLET_SOCKET, and sublet finds the "
                          "system's or starts yours)"
                        : "";
  struct stat st;
  struct group *g;

  if (stat(path, &st) != 0)
    return denied_dir(path, own);
  if (st.st_uid == getuid()) /* no group to join: a chmod shut the owner out */
    return sl_client_fail(SUBLET_EACCES, "permission denied on %s: the socket is yours, but its "
                          "mode %04o shuts you out; chmod u+rw %s (subletd makes it 0660)%s",
                          path, (unsigned)(st.st_mode & 07777), path, own);
  g = getgrgid(st.st_gid);
  return sl_client_fail(SUBLET_EACCES, "permission denied on %s: ask to be added to group %s "
                        "(usermod -aG %s USER, then log in again)%s", path,
                        g != NULL ? g->gr_name : "sublet", g != NULL ? g->gr_name : "sublet", own);
}

static int connect_socket(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd, rc;

  if (strlen(path) >= sizeof(addr.sun_path))
    return sl_client_fail(SUBLET_EINVAL, "socket path %s is too long", path);
  strcpy(addr.sun_path, path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return sl_client_fail(SUBLET_EIO, "socket: %s", strerror(errno));
  rc = connect_until(fd, &addr, sl_clock_ms() + SL_CLIENT_CONNECT_MS);
  if (rc == 0 && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0)
    return fd;
  close(fd);
  if (rc == SUBLET_ETIMEDOUT)
    return sl_client_fail(rc, "subletd at %s did not accept the connection within %d s; is it "
                          "stopped (SIGSTOP) or overloaded?", path, SL_CLIENT_CONNECT_MS / 1000);
  if (rc == -EACCES || rc == -EPERM)
    return denied(path);
  return sl_client_fail(SUBLET_ECONNREFUSED,
                        "cannot reach subletd at %s (%s): start it (subletd --device N, or "
                        "systemctl start subletd@N.socket) or set $SUBLET_SOCKET",
                        path, strerror(rc < 0 ? -rc : errno));
}

/* $SUBLET_TIMEOUT: seconds subletd may take to answer (default SL_CLIENT_TIMEOUT_MS). */
static int timeout_from_env(void) {
  const char *s = getenv("SUBLET_TIMEOUT");
  char *end;
  double v = s != NULL ? strtod(s, &end) : 0;

  if (s == NULL || end == s || *end != '\0' || !(v > 0) || v > INT_MAX / 1000.0)
    return SL_CLIENT_TIMEOUT_MS;
  return (int)(v * 1000);
}

SUBLET_EXPORT int sublet_cancel(sublet_client *c) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Cancel m = SUBLET__CANCEL__INIT;
  struct sl_err err = {0};
  int rc = 0;

  if (!c->can_cancel)
    return sl_client_fail(SUBLET_ENOTSUP, "subletd at %s is too old to cancel a waiting call: "
                          "upgrade it (the call goes on waiting)", c->path);
  pthread_mutex_lock(&c->send_lock);
  if (c->waiting_id != 0) { /* else nothing waits: answered already, or not sent yet */
    m.request = c->waiting_id;
    req.id = ++c->next_id;
    req.body_case = SUBLET__REQUEST__BODY_CANCEL;
    req.cancel = &m;
    rc = sl_msg_send_request(c->sock, &req, NULL, 0, c->timeout_ms, &err);
  }
  pthread_mutex_unlock(&c->send_lock);
  return rc != 0 ? sl_client_fail_err(&err) : 0;
}

SUBLET_EXPORT int sublet_set_timeout(sublet_client *c, int timeout_ms) {
  if (timeout_ms == 0 || timeout_ms < -1)
    return sl_client_fail(SUBLET_EINVAL, "a timeout is a number of milliseconds above 0, or -1 "
                          "(no deadline), not %d", timeout_ms);
  pthread_mutex_lock(&c->lock);
  c->timeout_ms = timeout_ms;
  pthread_mutex_unlock(&c->lock);
  return 0;
}

static void welcome_to_info(const Sublet__Welcome *w, struct sublet_info *info) {
  snprintf(info->daemon_version, sizeof(info->daemon_version), "%s", w->daemon_version);
  snprintf(info->backend, sizeof(info->backend), "%s", w->backend);
  snprintf(info->device_name, sizeof(info->device_name), "%s", w->device_name);
  memcpy(info->device_uuid, w->device_uuid.data,
         w->device_uuid.len < 16 ? w->device_uuid.len : 16);
  info->device_ordinal = w->device_ordinal;
  info->page_size = w->page_size;
  info->total_bytes = w->total_bytes;
  info->free_bytes = w->free_bytes;
  info->client_id = w->client_id;
}

static int hello(sublet_client *c) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello h = SUBLET__HELLO__INIT;
  Sublet__Reply *rep;
  char name[64];
  int rc;

  snprintf(name, sizeof(name), "libsublet %s pid %d", SUBLET_VERSION_STRING, (int)getpid());
  h.protocol = SUBLET_PROTOCOL_VERSION;
  h.client_name = name;
  h.has_notices = h.notices = 1; /* region gone: watch.c hears it even while idle */
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &h;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_WELCOME, &rep, NULL, NULL, 0);
  if (rc == 0)
    welcome_to_info(rep->welcome, &c->info);
  if (rc == 0) {
    c->can_cancel = rep->welcome->cancel;
    c->keep.bytes_ok = rep->welcome->keep_ranges;
    c->keep.fd_ok = rep->welcome->keep_fd;
    c->grow_ok = rep->welcome->grow;
    c->pinned_ok = rep->welcome->pinned;
    c->release_ok = rep->welcome->release;
    c->offer_ok = rep->welcome->release_offer;
    c->early_resume_ok = rep->welcome->early_resume;
    c->pin_ahead_ok = rep->welcome->pin_ahead;
    c->release_need_ok = rep->welcome->release_need;
    c->release_more_ok = rep->welcome->release_more;
    c->take_need_ok = rep->welcome->take_need;
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

int sl_client_open(const char *path, sublet_client **out) {
  const char *env = getenv("SUBLET_SOCKET");
  sublet_client *c;
  int rc;

  if (path == NULL)
    path = env != NULL && env[0] != '\0' ? env : "/run/sublet/gpu0.sock";
  c = calloc(1, sizeof(*c));
  if (c == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  c->sock = connect_socket(path);
  if (c->sock < 0) {
    rc = c->sock;
    free(c);
    return rc;
  }
  pthread_mutex_init(&c->lock, NULL);
  pthread_mutex_init(&c->send_lock, NULL);
  sl_wire_rx_init(&c->rx);
  c->wake_fd = -1;
  sl_keepwire_tx_init(&c->keep);
  snprintf(c->path, sizeof(c->path), "%s", path);
  c->timeout_ms = timeout_from_env();
  rc = hello(c);
  if (rc != 0) {
    sl_client_hang_up(c);
    sl_client_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

void sl_client_hang_up(sublet_client *c) {
  if (c->dev != NULL)
    sl_device_synchronize(c->dev, NULL);
  close(c->sock);
  c->sock = -1;
}

void sl_client_free(sublet_client *c) {
  if (c->dev != NULL)
    sl_device_close(c->dev);
  sl_wire_rx_destroy(&c->rx);
  sl_keepwire_tx_destroy(&c->keep);
  pthread_mutex_destroy(&c->send_lock);
  pthread_mutex_destroy(&c->lock);
  free(c->gone);
  free(c);
}

int sl_client_status(sublet_client *c, Sublet__Reply **rep) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__StatsGet m = SUBLET__STATS_GET__INIT;

  req.body_case = SUBLET__REQUEST__BODY_STATS_GET;
  req.stats_get = &m;
  return sl_client_call(c, &req, SUBLET__REPLY__BODY_STATUS, rep, NULL, NULL, 0);
}

/* Free memory changes: it is asked afresh; the rest is what Welcome said. */
SUBLET_EXPORT int sublet_get_info(sublet_client *c, struct sublet_info *info) {
  Sublet__Reply *rep;
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = sl_client_status(c, &rep);
  if (rc == 0)
    c->info.free_bytes = rep->status->free_bytes;
  *info = c->info;
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_pin_ahead(sublet_client *c, uint64_t bytes, unsigned flags) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__PinAhead m = SUBLET__PIN_AHEAD__INIT;
  int rc;

  if (!c->pin_ahead_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot pin ahead: update it (its "
                          "Lend still pins the save area, from the loan on)");
  if (flags & ~SUBLET_PIN_RELEASE)
    return sl_client_fail(SUBLET_EINVAL, "sublet_pin_ahead: unknown flags %#x", flags);
  m.bytes = bytes;
  m.has_release = m.release = (flags & SUBLET_PIN_RELEASE) != 0;
  req.body_case = SUBLET__REQUEST__BODY_PIN_AHEAD;
  req.pin_ahead = &m;
  pthread_mutex_lock(&c->lock);
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_OK, NULL, NULL, NULL, 0);
  pthread_mutex_unlock(&c->lock);
  return rc;
}

int sl_client_ensure_device(sublet_client *c) {
  struct sl_device_params p = {.backend = c->info.backend,
                               .ordinal = (int)c->info.device_ordinal,
                               .uuid = c->info.device_uuid,
                               .page_size = c->info.page_size,
                               .total_bytes = c->info.total_bytes};
  struct sl_err err = {0};

  if (c->dev != NULL)
    return 0;
  if (sl_device_open(&p, &c->dev, &err) != 0)
    return sl_client_fail_err(&err);
  if (sl_device_info(c->dev)->page_size != c->info.page_size) {
    sl_device_close(c->dev);
    c->dev = NULL;
    return sl_client_fail(SUBLET_EDEVICE, "subletd's pages and this process's differ in size: "
                          "is it the same device and backend? (check $SUBLET_SOCKET)");
  }
  return 0;
}

int sl_client_gone(const sublet_client *c) {
  struct pollfd p = {.fd = c->sock, .events = POLLRDHUP};

  return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

SUBLET_EXPORT int sublet_connected(const sublet_client *c) {
  return !sl_client_gone(c);
}
