/* wire.c - frames over a Unix stream socket, with fds passed beside them (SCM_RIGHTS).
 *
 * The sender writes a frame whole, its fds riding the first byte. The receiver buffers bytes
 * and queues fds as they arrive, and hands out a frame once all of it is buffered. A frame's
 * bytes are dropped at the next read, not when it is handed out, so that the caller can parse
 * its payload in place.
 *
 * Who owns which fd: those passed to sl_wire_send stay the caller's; those in the receiver's
 * queue are the receiver's (sl_wire_rx_destroy closes them); those handed out with a frame are
 * the caller's. Every error path closes the fds it owns.
 *
 * Floor 2 (floors.h).
 */
#include "wire.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"

/* The buffer never holds more than one frame of the largest size. */
#define RX_LIMIT ((size_t)SL_WIRE_HEADER + SL_WIRE_MAX_PAYLOAD)
/* Free space wanted before a read: large frames arrive in few reads, small clients stay small. */
#define RX_CHUNK ((size_t)64 << 10)
/* An idle connection gives back a buffer grown past this by a large frame. */
#define RX_KEEP ((size_t)1 << 20)
/* Bounds the queue against a peer that sends fds with no frames to claim them: fds are a scarce
 * resource of the daemon (its open files limit), so the bound is a few frames' worth. */
#define RX_MAX_QUEUED (4 * SL_WIRE_MAX_FDS)
/* Control space for one frame's fds. */
#define CTL_SIZE CMSG_SPACE(sizeof(int) * SL_WIRE_MAX_FDS)

/* ------------------------------------------------------------------ header */

static void put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}

static void put_u32(uint8_t *p, uint32_t v) {
  put_u16(p, (uint16_t)v);
  put_u16(p + 2, (uint16_t)(v >> 16));
}

static uint16_t get_u16(const uint8_t *p) {
  return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)get_u16(p) | ((uint32_t)get_u16(p + 2) << 16);
}

void sl_wire_header_encode(const struct sl_frame_header *h, uint8_t out[SL_WIRE_HEADER]) {
  put_u32(out + 0, h->magic);
  put_u16(out + 4, h->version);
  put_u16(out + 6, h->kind);
  put_u32(out + 8, h->length);
  put_u32(out + 12, h->nfds);
}

int sl_wire_header_decode(const uint8_t in[SL_WIRE_HEADER], struct sl_frame_header *h,
                          struct sl_err *err) {
  char size[16];

  h->magic = get_u32(in + 0);
  h->version = get_u16(in + 4);
  h->kind = get_u16(in + 6);
  h->length = get_u32(in + 8);
  h->nfds = get_u32(in + 12);
  if (h->magic != SL_WIRE_MAGIC)
    return sl_err_set(err, SUBLET_EPROTO,
                      "bad frame magic 0x%08x (expected 0x%08x): the peer does not speak the "
                      "sublet protocol", h->magic, SL_WIRE_MAGIC);
  if (h->kind != SL_WIRE_REQUEST && h->kind != SL_WIRE_REPLY)
    return sl_err_set(err, SUBLET_EPROTO, "bad frame kind %u (1 = request, 2 = reply)",
                      h->kind);
  if (h->length > SL_WIRE_MAX_PAYLOAD)
    return sl_err_set(err, SUBLET_EPROTO, "frame of %s exceeds the 32 MiB limit",
                      sl_format_size(size, h->length));
  if (h->nfds > SL_WIRE_MAX_FDS)
    return sl_err_set(err, SUBLET_EPROTO, "frame announces %u fds, more than the %d allowed",
                      h->nfds, SL_WIRE_MAX_FDS);
  return 0;
}

void sl_wire_close_fds(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (fds[i] >= 0)
      close(fds[i]);
    fds[i] = -1;
  }
}

/* ------------------------------------------------------------------ waiting */

/* Waits until sock is ready for events; deadline_ms < 0: no limit. Readiness includes hangup
 * and errors: the next read or write reports those. */
static int wait_ready(int sock, short events, int64_t deadline_ms) {
  struct pollfd pfd = {.fd = sock, .events = events};
  int timeout, n;

  for (;;) {
    timeout = -1;
    if (deadline_ms >= 0) {
      int64_t left = deadline_ms - sl_clock_ms();
      timeout = left > 0 ? (int)left : 0;
    }
    n = poll(&pfd, 1, timeout);
    if (n > 0)
      return 0;
    if (n == 0)
      return SUBLET_ETIMEDOUT;
    if (errno != EINTR)
      return SUBLET_EIO;
  }
}

/* ------------------------------------------------------------------ sending */

static int send_check(uint16_t kind, size_t len, size_t nfds, struct sl_err *err) {
  char size[16];

  if (kind != SL_WIRE_REQUEST && kind != SL_WIRE_REPLY)
    return sl_err_set(err, SUBLET_EINVAL, "bad frame kind %u (1 = request, 2 = reply)", kind);
  if (len > SL_WIRE_MAX_PAYLOAD)
    return sl_err_set(err, SUBLET_E2BIG, "frame of %s exceeds the 32 MiB limit",
                      sl_format_size(size, len));
  if (nfds > SL_WIRE_MAX_FDS)
    return sl_err_set(err, SUBLET_E2BIG, "%zu fds in one frame, more than the %d allowed", nfds,
                      SL_WIRE_MAX_FDS);
  return 0;
}

/* One sendmsg; fds (if any) go as SCM_RIGHTS with the first byte written. */
static ssize_t send_some(int sock, struct iovec *iov, int iovcnt, const int *fds, size_t nfds) {
  union {
    struct cmsghdr align;
    char buf[CTL_SIZE];
  } ctl;
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)iovcnt};
  struct cmsghdr *cmsg;

  if (nfds > 0) {
    memset(&ctl, 0, sizeof(ctl));
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * nfds);
  }
  return sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

int sl_wire_out_init(struct sl_wire_out *o, uint16_t kind, const void *payload, size_t len,
                     const int *fds, size_t nfds, struct sl_err *err) {
  int rc = send_check(kind, len, nfds, err);

  if (rc < 0)
    return rc;
  sl_wire_header_encode(&(struct sl_frame_header){SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, kind,
                                                  (uint32_t)len, (uint32_t)nfds},
                        o->head);
  o->payload = payload;
  o->len = len;
  o->done = 0;
  o->fds = fds;
  o->nfds = nfds;
  return 0;
}

/* The iovecs of what is left to write. */
static int out_iov(const struct sl_wire_out *o, struct iovec iov[2]) {
  int n = 0;

  if (o->done < SL_WIRE_HEADER)
    iov[n++] = (struct iovec){.iov_base = (uint8_t *)o->head + o->done,
                              .iov_len = SL_WIRE_HEADER - o->done};
  if (o->len > 0 && o->done < SL_WIRE_HEADER + o->len) {
    size_t skip = o->done > SL_WIRE_HEADER ? o->done - SL_WIRE_HEADER : 0;
    iov[n++] = (struct iovec){.iov_base = (uint8_t *)o->payload + skip, .iov_len = o->len - skip};
  }
  return n;
}

int sl_wire_out_write(struct sl_wire_out *o, int sock, struct sl_err *err) {
  struct iovec iov[2];
  ssize_t n;

  do {
    int iovcnt = out_iov(o, iov);
    if (iovcnt == 0)
      return SL_WIRE_OUT_DONE;
    n = send_some(sock, iov, iovcnt, o->done == 0 ? o->fds : NULL, o->done == 0 ? o->nfds : 0);
    if (n > 0)
      o->done += (size_t)n; /* the fds went with the first byte: the kernel holds its own */
  } while (n > 0 || (n < 0 && errno == EINTR));
  if (errno == EAGAIN || errno == EWOULDBLOCK)
    return SL_WIRE_OUT_AGAIN;
  if (errno == ETOOMANYREFS)
    return SL_WIRE_OUT_REFS;
  if (errno == EPIPE || errno == ECONNRESET)
    return sl_err_set(err, SUBLET_EPIPE, "the peer closed the connection");
  return sl_err_set(err, SUBLET_EIO, "cannot send a frame: %s", strerror(errno));
}

int sl_wire_send(int sock, uint16_t kind, const void *payload, size_t len, const int *fds,
                 size_t nfds, int timeout_ms, struct sl_err *err) {
  int64_t deadline = timeout_ms < 0 ? -1 : sl_clock_ms() + timeout_ms;
  struct sl_wire_out o;
  int rc = sl_wire_out_init(&o, kind, payload, len, fds, nfds, err);

  if (rc < 0)
    return rc;
  while ((rc = sl_wire_out_write(&o, sock, err)) == SL_WIRE_OUT_AGAIN) {
    rc = wait_ready(sock, POLLOUT, deadline);
    if (rc == SUBLET_ETIMEDOUT)
      return sl_err_set(err, rc, "the peer took no frame within %d ms: it is not reading "
                        "(stopped or overloaded?)", timeout_ms);
    if (rc < 0)
      return sl_err_set(err, rc, "poll: %s", strerror(errno));
  }
  if (rc == SL_WIRE_OUT_REFS)
    return sl_err_set(err, SUBLET_EIO, "cannot send fds: too many in flight (ETOOMANYREFS)");
  return rc == SL_WIRE_OUT_DONE ? 0 : rc;
}

/* ------------------------------------------------------------------ receiving */

void sl_wire_rx_init(struct sl_wire_rx *rx) {
  memset(rx, 0, sizeof(*rx));
}

void sl_wire_rx_destroy(struct sl_wire_rx *rx) {
  sl_wire_close_fds(rx->fds, rx->nfds);
  free(rx->fds);
  free(rx->buf);
  memset(rx, 0, sizeof(*rx));
}

/* Fds arrive with the first byte of their frame, so fds queued when no byte is left unclaimed
 * belong to no frame: the peer sent more than its frames announced. */
static int rx_check_between(struct sl_wire_rx *rx, struct sl_err *err) {
  size_t n = rx->nfds;

  if (rx->off < rx->len || n == 0)
    return 0;
  sl_wire_close_fds(rx->fds, n);
  rx->nfds = 0;
  return sl_err_set(err, SUBLET_EPROTO, "%zu fds arrived that no frame announced", n);
}

/* While the first frame is incomplete every queued fd is its own: no more than it announced. */
static int rx_check_pending(const struct sl_wire_rx *rx, size_t announced, struct sl_err *err) {
  if (rx->nfds <= announced)
    return 0;
  return sl_err_set(err, SUBLET_EPROTO, "%zu fds arrived with a frame that announces %zu",
                    rx->nfds, announced);
}

/* Drops the bytes handed out already, then makes free space for the next read. */
static int rx_make_room(struct sl_wire_rx *rx, struct sl_err *err) {
  size_t want, cap;
  uint8_t *buf;

  if (rx->off > 0) {
    rx->len -= rx->off;
    memmove(rx->buf, rx->buf + rx->off, rx->len);
    rx->off = 0;
  }
  if (rx->len == 0 && rx->cap > RX_KEEP) {
    free(rx->buf);
    rx->buf = NULL;
    rx->cap = 0;
  }
  want = rx->len + RX_CHUNK < RX_LIMIT ? rx->len + RX_CHUNK : RX_LIMIT;
  if (rx->cap >= want)
    return rx->len < rx->cap ? 0 : sl_err_set(err, SUBLET_EINVAL,
                                              "receive buffer full: take the buffered frames "
                                              "with sl_wire_rx_next before reading again");
  cap = rx->cap * 2 > want ? rx->cap * 2 : want;
  cap = cap < RX_LIMIT ? cap : RX_LIMIT;
  buf = realloc(rx->buf, cap);
  if (buf == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a receive buffer");
  rx->buf = buf;
  rx->cap = cap;
  return 0;
}

/* Takes ownership of n received fds: queues them, or closes them when it cannot. */
static int rx_queue_fds(struct sl_wire_rx *rx, int *fds, size_t n, struct sl_err *err) {
  if (rx->fds == NULL)
    rx->fds = malloc(sizeof(int) * RX_MAX_QUEUED);
  if (rx->fds == NULL || rx->nfds + n > RX_MAX_QUEUED) {
    sl_wire_close_fds(fds, n);
    if (rx->fds == NULL)
      return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for received fds");
    return sl_err_set(err, SUBLET_EPROTO, "more than %d fds arrived that no frame claimed",
                      RX_MAX_QUEUED);
  }
  memcpy(rx->fds + rx->nfds, fds, sizeof(int) * n);
  rx->nfds += n;
  return 0;
}

/* Takes the fds of every SCM_RIGHTS message received. After MSG_CTRUNC some fds were lost
 * (the kernel closed them): the stream cannot be trusted, and those that came are closed. */
static int rx_take_fds(struct sl_wire_rx *rx, struct msghdr *msg, struct sl_err *err) {
  int truncated = (msg->msg_flags & MSG_CTRUNC) != 0;
  int fds[CTL_SIZE / sizeof(int)];
  int rc = 0;

  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c != NULL; c = CMSG_NXTHDR(msg, c)) {
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
      continue;
    memcpy(fds, CMSG_DATA(c), sizeof(int) * n); /* CMSG_DATA may be unaligned for int */
    if (truncated || rc < 0)
      sl_wire_close_fds(fds, n);
    else
      rc = rx_queue_fds(rx, fds, n, err);
  }
  if (truncated)
    return sl_err_set(err, SUBLET_EPROTO,
                      "file descriptors were truncated in transit (more than %d in one message)",
                      SL_WIRE_MAX_FDS);
  return rc;
}

static int rx_recv_failed(int errnum, struct sl_err *err) {
  if (errnum == EAGAIN || errnum == EWOULDBLOCK)
    return -EAGAIN;
  if (errnum == ECONNRESET)
    return sl_err_set(err, SUBLET_EPIPE, "the peer reset the connection");
  return sl_err_set(err, SUBLET_EIO, "cannot receive: %s", strerror(errnum));
}

/* One recvmsg into the free space. The control buffer fits one frame's fds: more (or fds
 * beside SO_PASSCRED's credentials) truncates, which rx_take_fds reports. */
static int rx_recv(struct sl_wire_rx *rx, int sock, struct sl_err *err) {
  union {
    struct cmsghdr align;
    char buf[CTL_SIZE];
  } ctl;
  struct iovec iov = {.iov_base = rx->buf + rx->len, .iov_len = rx->cap - rx->len};
  struct msghdr msg;
  ssize_t n;
  int rc;

  do {
    msg = (struct msghdr){.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                          .msg_controllen = sizeof(ctl.buf)};
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0)
    return rx_recv_failed(errno, err);
  rx->len += (size_t)n;
  rc = rx_take_fds(rx, &msg, err);
  return rc < 0 ? rc : (int)n;
}

void sl_wire_rx_trim(struct sl_wire_rx *rx) {
  if (rx->off < rx->len || rx->cap <= RX_KEEP)
    return;
  free(rx->buf);
  rx->buf = NULL;
  rx->len = rx->off = rx->cap = 0;
}

int sl_wire_rx_read(struct sl_wire_rx *rx, int sock, struct sl_err *err) {
  int rc = rx_check_between(rx, err);

  if (rc == 0)
    rc = rx_make_room(rx, err);
  if (rc == 0)
    rc = rx_recv(rx, sock, err);
  return rc;
}

/* Gives the caller the first frame, complete and checked, and its fds. */
static int rx_hand_out(struct sl_wire_rx *rx, const struct sl_frame_header *h,
                       const uint8_t **payload, int *fds, struct sl_err *err) {
  if (h->nfds > 0 && fds == NULL)
    return sl_err_set(err, SUBLET_EPROTO, "frame carries %u fds where none are expected",
                      h->nfds);
  if (h->nfds > 0) {
    memcpy(fds, rx->fds, sizeof(int) * h->nfds);
    rx->nfds -= h->nfds;
    memmove(rx->fds, rx->fds + h->nfds, sizeof(int) * rx->nfds);
  }
  *payload = rx->buf + rx->off + SL_WIRE_HEADER;
  rx->off += SL_WIRE_HEADER + h->length;
  return 1;
}

int sl_wire_rx_next(struct sl_wire_rx *rx, struct sl_frame_header *h, const uint8_t **payload,
                    int *fds, struct sl_err *err) {
  size_t have = rx->len - rx->off;
  int rc = rx_check_between(rx, err);

  if (rc < 0)
    return rc;
  if (have < SL_WIRE_HEADER)
    return rx_check_pending(rx, SL_WIRE_MAX_FDS, err);
  rc = sl_wire_header_decode(rx->buf + rx->off, h, err);
  if (rc < 0)
    return rc;
  if (h->nfds > rx->nfds)
    return sl_err_set(err, SUBLET_EPROTO, "frame announces %u fds but %zu arrived with it",
                      h->nfds, rx->nfds);
  if (have < SL_WIRE_HEADER + (size_t)h->length)
    return rx_check_pending(rx, h->nfds, err);
  return rx_hand_out(rx, h, payload, fds, err);
}

/* ------------------------------------------------------------------ blocking receive */

static int recv_eof(const struct sl_wire_rx *rx, struct sl_err *err) {
  if (rx->off < rx->len)
    return sl_err_set(err, SUBLET_EPIPE,
                      "subletd closed the connection in the middle of a frame");
  return sl_err_set(err, SUBLET_EPIPE, "subletd closed the connection");
}

int sl_wire_recv(struct sl_wire_rx *rx, int sock, struct sl_frame_header *h,
                 const uint8_t **payload, int *fds, int timeout_ms, struct sl_err *err) {
  int64_t deadline = timeout_ms < 0 ? -1 : sl_clock_ms() + timeout_ms;
  int rc;

  for (;;) {
    rc = sl_wire_rx_next(rx, h, payload, fds, err);
    if (rc != 0)
      return rc < 0 ? rc : 0;
    rc = wait_ready(sock, POLLIN, deadline);
    if (rc == SUBLET_ETIMEDOUT)
      return sl_err_set(err, rc, "no reply from subletd within %d ms", timeout_ms);
    if (rc < 0)
      return sl_err_set(err, rc, "cannot wait for subletd: %s", strerror(errno));
    rc = sl_wire_rx_read(rx, sock, err);
    if (rc == 0)
      return recv_eof(rx, err);
    if (rc < 0 && rc != -EAGAIN)
      return rc;
  }
}
