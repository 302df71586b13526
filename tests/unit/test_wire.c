/* test_wire.c - tests of the framing layer (common/wire.c) over real Unix socketpairs, with
 * memfds as the fds passed: each memfd holds its own tag, so a received fd is checked to be
 * the very file that was sent. Every test also checks that it leaves no fd open.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <dirent.h>

#include "check.h"
#include "wire.h"

#define POOL 253

/* ------------------------------------------------------------------ helpers */

static int count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;

  if (d == NULL)
    return -1;
  while (readdir(d) != NULL)
    n++;
  closedir(d);
  return n;
}

/* A memfd whose content is its tag. The caller owns it. */
static int tagged_memfd(int tag) {
  int fd = memfd_create("wire-test", MFD_CLOEXEC);
  char text[32];
  int len = snprintf(text, sizeof(text), "memfd %d", tag);

  if (fd < 0 || write(fd, text, (size_t)len) != len)
    abort();
  return fd;
}

static int memfd_tag(int fd) {
  char text[32] = {0};
  int tag = -1;

  if (pread(fd, text, sizeof(text) - 1, 0) > 0)
    sscanf(text, "memfd %d", &tag);
  return tag;
}

static int is_cloexec(int fd) {
  int flags = fcntl(fd, F_GETFD);
  return flags >= 0 && (flags & FD_CLOEXEC) != 0;
}

static void make_pair(int sv[2], int nonblocking_receiver) {
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    abort();
  if (nonblocking_receiver)
    fcntl(sv[1], F_SETFL, fcntl(sv[1], F_GETFL) | O_NONBLOCK);
}

static void close_pair(int sv[2]) {
  close(sv[0]);
  close(sv[1]);
}

static void fill_pattern(uint8_t *p, size_t len, unsigned seed) {
  for (size_t i = 0; i < len; i++)
    p[i] = (uint8_t)((i * 131u + seed * 7u + (i >> 9)) & 0xff);
}

static int check_pattern(const uint8_t *p, size_t len, unsigned seed) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != (uint8_t)((i * 131u + seed * 7u + (i >> 9)) & 0xff))
      return 0;
  return 1;
}

/* Writes bytes as they are, fds (if any) on the first byte: to build what sl_wire_send never
 * would. */
static void send_bytes(int sock, const void *data, size_t len, const int *fds, size_t nfds) {
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * POOL)];
  } ctl;
  struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};

  if (nfds > 0) {
    memset(&ctl, 0, sizeof(ctl));
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  if (sendmsg(sock, &msg, MSG_NOSIGNAL) != (ssize_t)len)
    abort();
}

static void send_header(int sock, uint32_t magic, uint16_t kind, uint32_t length, uint32_t nfds,
                        const int *fds, size_t fds_sent) {
  uint8_t head[SL_WIRE_HEADER];
  struct sl_frame_header h = {magic, SUBLET_PROTOCOL_VERSION, kind, length, nfds};

  sl_wire_header_encode(&h, head);
  send_bytes(sock, head, sizeof(head), fds, fds_sent);
}

/* Reads what is there and tries to take a frame: the receiver's answer to a malformed input. */
static int read_and_next(struct sl_wire_rx *rx, int sock, struct sl_frame_header *h,
                         const uint8_t **payload, int *fds, struct sl_err *err) {
  int rc = sl_wire_rx_read(rx, sock, err);
  return rc < 0 ? rc : sl_wire_rx_next(rx, h, payload, fds, err);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ header */

static void test_header_layout(void) {
  struct sl_frame_header h = {SL_WIRE_MAGIC, 0x0201, SL_WIRE_REPLY, 0x01020304, 7}, back;
  const uint8_t want[SL_WIRE_HEADER] = {0x54, 0x42, 0x4c, 0x53, 0x01, 0x02, 0x02, 0x00,
                                        0x04, 0x03, 0x02, 0x01, 0x07, 0x00, 0x00, 0x00};
  uint8_t out[SL_WIRE_HEADER];

  sl_wire_header_encode(&h, out);
  CHECK(memcmp(out, want, sizeof(want)) == 0);
  CHECK(sl_wire_header_decode(out, &back, NULL) == 0);
  CHECK(memcmp(&h, &back, sizeof(h)) == 0);
}

static int decode_fields(uint32_t magic, uint16_t version, uint16_t kind, uint32_t length,
                         uint32_t nfds, struct sl_err *err) {
  struct sl_frame_header h = {magic, version, kind, length, nfds}, back;
  uint8_t bytes[SL_WIRE_HEADER];

  sl_wire_header_encode(&h, bytes);
  sl_err_clear(err);
  return sl_wire_header_decode(bytes, &back, err);
}

static void test_header_bounds(void) {
  struct sl_err err;

  CHECK(decode_fields(0x534c4255, 1, 1, 0, 0, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "magic") != NULL && err.code == SUBLET_EPROTO);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 0, 0, 0, &err) == SUBLET_EPROTO);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 3, 0, 0, &err) == SUBLET_EPROTO);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 1, 40u << 20, 0, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "40.0 MiB exceeds the 32 MiB limit") != NULL);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 1, SL_WIRE_MAX_PAYLOAD + 1, 0, &err) == SUBLET_EPROTO);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 2, SL_WIRE_MAX_PAYLOAD, 0, &err) == 0);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 1, 0, SL_WIRE_MAX_FDS, &err) == 0);
  CHECK(decode_fields(SL_WIRE_MAGIC, 1, 1, 0, SL_WIRE_MAX_FDS + 1, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "254 fds") != NULL);
  /* Another version decodes: the daemon answers it with EVERSION. */
  CHECK(decode_fields(SL_WIRE_MAGIC, 9, 1, 0, 0, &err) == 0);
}

static void test_send_bounds(void) {
  static const uint8_t byte;
  int fds[SL_WIRE_MAX_FDS + 1] = {0};
  struct sl_err err;
  char c;
  int sv[2];

  make_pair(sv, 1);
  /* Checked before anything is read or written: the payload pointer is never touched. */
  CHECK(sl_wire_send(sv[0], 1, &byte, SL_WIRE_MAX_PAYLOAD + 1, NULL, 0, -1, &err) ==
        SUBLET_E2BIG);
  CHECK(strstr(err.msg, "exceeds the 32 MiB limit") != NULL);
  CHECK(sl_wire_send(sv[0], 1, NULL, 0, fds, SL_WIRE_MAX_FDS + 1, -1, &err) == SUBLET_E2BIG);
  CHECK(sl_wire_send(sv[0], 3, NULL, 0, NULL, 0, -1, &err) == SUBLET_EINVAL);
  CHECK(recv(sv[1], &c, 1, MSG_DONTWAIT) < 0 && errno == EAGAIN);
  close_pair(sv);
}

/* ------------------------------------------------------------------ round trips */

/* Frame i: a payload of (i * 97) % 5000 bytes and fds pool[(i + j) % POOL], j < nfds. */
static void send_numbered(int sock, const int *pool, int i, int nfds) {
  size_t len = ((size_t)i * 97) % 5000;
  uint8_t *payload = malloc(len + 1);
  int fds[POOL];

  fill_pattern(payload, len, (unsigned)i);
  for (int j = 0; j < nfds; j++)
    fds[j] = pool[(i + j) % POOL];
  CHECK(sl_wire_send(sock, SL_WIRE_REQUEST, payload, len, fds, (size_t)nfds, -1, NULL) == 0);
  free(payload);
}

static void check_numbered(const struct sl_frame_header *h, const uint8_t *payload, int *fds,
                           int i, int nfds) {
  CHECK(h->version == SUBLET_PROTOCOL_VERSION && h->kind == SL_WIRE_REQUEST);
  CHECK(h->length == ((size_t)i * 97) % 5000);
  CHECK(check_pattern(payload, h->length, (unsigned)i));
  CHECK(h->nfds == (uint32_t)nfds);
  for (uint32_t j = 0; j < h->nfds && j < (uint32_t)nfds; j++) {
    CHECK(memfd_tag(fds[j]) == (i + (int)j) % POOL);
    CHECK(is_cloexec(fds[j]));
  }
  sl_wire_close_fds(fds, h->nfds);
}

static void test_round_trip_fds(void) {
  int pool[POOL], fds[SL_WIRE_MAX_FDS], sv[2];
  struct sl_wire_rx rx;
  struct sl_frame_header h;
  const uint8_t *payload;

  for (int i = 0; i < POOL; i++)
    pool[i] = tagged_memfd(i);
  make_pair(sv, 0);
  sl_wire_rx_init(&rx);
  /* Frames go three at a time, so that reads see several frames and their fds queued. */
  for (int first = 0; first <= SL_WIRE_MAX_FDS; first += 3) {
    for (int i = first; i < first + 3 && i <= SL_WIRE_MAX_FDS; i++)
      send_numbered(sv[0], pool, i, i);
    for (int i = first; i < first + 3 && i <= SL_WIRE_MAX_FDS; i++) {
      CHECK(sl_wire_recv(&rx, sv[1], &h, &payload, fds, 1000, NULL) == 0);
      check_numbered(&h, payload, fds, i, i);
    }
  }
  CHECK(rx.nfds == 0);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  sl_wire_close_fds(pool, POOL);
}

/* Batches of small frames: one read takes many frames at once, their fds queued together. */
static void test_many_small_frames(void) {
  int sv[2], fds[SL_WIRE_MAX_FDS], pool[POOL], got = 0;
  struct sl_wire_rx rx;
  struct sl_frame_header h;
  const uint8_t *payload;

  for (int i = 0; i < POOL; i++)
    pool[i] = tagged_memfd(i);
  make_pair(sv, 1);
  sl_wire_rx_init(&rx);
  for (int batch = 1; batch <= 8; batch++) {
    for (int i = got; i < batch * 50; i++)
      send_numbered(sv[0], pool, i, i % 3);
    while (got < batch * 50 && sl_wire_rx_read(&rx, sv[1], NULL) > 0) {
      while (sl_wire_rx_next(&rx, &h, &payload, fds, NULL) == 1) {
        check_numbered(&h, payload, fds, got, got % 3);
        got++;
      }
    }
  }
  CHECK(got == 400);
  CHECK(sl_wire_rx_read(&rx, sv[1], NULL) == -EAGAIN);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  sl_wire_close_fds(pool, POOL);
}

/* Frames written a few bytes at a time, the fds on each frame's first piece; the receiver reads
 * after every piece and must hand out each frame only once it is whole. */
static void test_split_reads(void) {
  int pool[2] = {tagged_memfd(0), tagged_memfd(1)}, fds[SL_WIRE_MAX_FDS], sv[2];
  uint8_t frame[SL_WIRE_HEADER + 300];
  struct sl_frame_header want = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REPLY, 300, 2};
  struct sl_frame_header h;
  struct sl_wire_rx rx;
  const uint8_t *payload;
  unsigned step = 1;

  make_pair(sv, 1);
  sl_wire_rx_init(&rx);
  for (int k = 0; k < 5; k++) {
    sl_wire_header_encode(&want, frame);
    fill_pattern(frame + SL_WIRE_HEADER, 300, (unsigned)k);
    for (size_t at = 0; at < sizeof(frame); at += step, step = step % 7 + 1) {
      size_t n = at + step < sizeof(frame) ? step : sizeof(frame) - at;
      send_bytes(sv[0], frame + at, n, pool, at == 0 ? 2 : 0);
      CHECK(sl_wire_rx_read(&rx, sv[1], NULL) == (int)n);
      int rc = sl_wire_rx_next(&rx, &h, &payload, fds, NULL);
      CHECK(rc == (at + n == sizeof(frame) ? 1 : 0));
    }
    CHECK(memcmp(&h, &want, sizeof(h)) == 0 && check_pattern(payload, 300, (unsigned)k));
    CHECK(memfd_tag(fds[0]) == 0 && memfd_tag(fds[1]) == 1);
    sl_wire_close_fds(fds, 2);
  }
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  sl_wire_close_fds(pool, 2);
}

/* ------------------------------------------------------------------ large payloads */

struct big_send {
  int sock;
  size_t len;
  int fd;
  int rc;
};

static void *big_sender(void *arg) {
  struct big_send *s = arg;
  uint8_t *payload = malloc(s->len);

  fill_pattern(payload, s->len, (unsigned)s->len);
  s->rc = sl_wire_send(s->sock, SL_WIRE_REPLY, payload, s->len, &s->fd, 1, -1, NULL);
  free(payload);
  return NULL;
}

/* Polls and reads a non-blocking socket until one frame is whole. */
static int recv_polling(struct sl_wire_rx *rx, int sock, struct sl_frame_header *h,
                        const uint8_t **payload, int *fds) {
  struct pollfd pfd = {.fd = sock, .events = POLLIN};
  int rc;

  while ((rc = sl_wire_rx_next(rx, h, payload, fds, NULL)) == 0) {
    if (poll(&pfd, 1, 10000) != 1)
      return SUBLET_ETIMEDOUT;
    rc = sl_wire_rx_read(rx, sock, NULL);
    if (rc <= 0 && rc != -EAGAIN)
      return rc < 0 ? rc : SUBLET_EPIPE;
  }
  return rc;
}

static void test_large_payloads(void) {
  const size_t sizes[] = {(3u << 20) + 5, 7u << 20, SL_WIRE_MAX_PAYLOAD, 100};
  int sv[2], fds[SL_WIRE_MAX_FDS];
  struct sl_wire_rx rx;
  struct sl_frame_header h;
  const uint8_t *payload;

  make_pair(sv, 1);
  fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK); /* the sender polls too */
  sl_wire_rx_init(&rx);
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
    struct big_send s = {sv[0], sizes[i], tagged_memfd((int)i), -1};
    pthread_t t;
    pthread_create(&t, NULL, big_sender, &s);
    CHECK(recv_polling(&rx, sv[1], &h, &payload, fds) == 1);
    pthread_join(t, NULL);
    CHECK(s.rc == 0);
    CHECK(h.length == sizes[i] && check_pattern(payload, h.length, (unsigned)h.length));
    CHECK(h.nfds == 1 && memfd_tag(fds[0]) == (int)i);
    CHECK(rx.cap <= SL_WIRE_HEADER + SL_WIRE_MAX_PAYLOAD);
    sl_wire_close_fds(fds, h.nfds);
    close(s.fd);
  }
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
}

/* ------------------------------------------------------------------ malformed input */

/* Sends a header (with fds_sent of nfds_sent memfds) and expects the receiver to refuse it. */
static int refused(uint32_t magic, uint16_t kind, uint32_t length, uint32_t nfds,
                   size_t fds_sent, struct sl_err *err) {
  int pool[4] = {tagged_memfd(0), tagged_memfd(1), tagged_memfd(2), tagged_memfd(3)};
  int fds[SL_WIRE_MAX_FDS], sv[2], rc;
  struct sl_wire_rx rx;
  struct sl_frame_header h;
  const uint8_t *payload;

  make_pair(sv, 1);
  sl_wire_rx_init(&rx);
  send_header(sv[0], magic, kind, length, nfds, pool, fds_sent);
  sl_err_clear(err);
  rc = read_and_next(&rx, sv[1], &h, &payload, fds, err);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  sl_wire_close_fds(pool, 4);
  return rc;
}

static void test_malformed_headers(void) {
  struct sl_err err;

  CHECK(refused(0x12345678, 1, 0, 0, 0, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "bad frame magic 0x12345678") != NULL);
  CHECK(refused(SL_WIRE_MAGIC, 1, 40u << 20, 0, 0, &err) == SUBLET_EPROTO);
  CHECK(strcmp(err.msg, "frame of 40.0 MiB exceeds the 32 MiB limit") == 0);
  CHECK(refused(SL_WIRE_MAGIC, 1, 0, SL_WIRE_MAX_FDS + 1, 0, &err) == SUBLET_EPROTO);
  CHECK(refused(SL_WIRE_MAGIC, 7, 0, 0, 0, &err) == SUBLET_EPROTO);
  /* The header says 3 fds; one came. */
  CHECK(refused(SL_WIRE_MAGIC, 1, 10, 3, 1, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "announces 3 fds but 1 arrived") != NULL);
  /* The frame is still incomplete and already more fds than it announced are there. */
  CHECK(refused(SL_WIRE_MAGIC, 1, 10, 1, 3, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "3 fds arrived with a frame that announces 1") != NULL);
}

/* A whole frame with more fds than its header says: it is handed out with its own, and the
 * receiver's next call reports the rest. */
static void test_extra_fds(void) {
  int pool[3] = {tagged_memfd(0), tagged_memfd(1), tagged_memfd(2)};
  int fds[SL_WIRE_MAX_FDS], sv[2];
  uint8_t frame[SL_WIRE_HEADER + 4] = {0};
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REQUEST, 4, 1};
  struct sl_wire_rx rx;
  struct sl_err err;
  const uint8_t *payload;

  make_pair(sv, 1);
  sl_wire_rx_init(&rx);
  sl_wire_header_encode(&h, frame);
  send_bytes(sv[0], frame, sizeof(frame), pool, 3);
  CHECK(read_and_next(&rx, sv[1], &h, &payload, fds, &err) == 1);
  CHECK(h.nfds == 1 && memfd_tag(fds[0]) == 0);
  sl_wire_close_fds(fds, h.nfds);
  CHECK(sl_wire_rx_next(&rx, &h, &payload, fds, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "2 fds arrived that no frame announced") != NULL);
  CHECK(rx.nfds == 0);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  sl_wire_close_fds(pool, 3);
}

static void test_fds_where_none_expected(void) {
  int pool[1] = {tagged_memfd(0)}, sv[2];
  uint8_t frame[SL_WIRE_HEADER];
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REPLY, 0, 1};
  struct sl_wire_rx rx;
  const uint8_t *payload;

  make_pair(sv, 1);
  sl_wire_rx_init(&rx);
  sl_wire_header_encode(&h, frame);
  send_bytes(sv[0], frame, sizeof(frame), pool, 1);
  CHECK(read_and_next(&rx, sv[1], &h, &payload, NULL, NULL) == SUBLET_EPROTO);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  close(pool[0]);
}

/* SO_PASSCRED's credentials take control space, so 253 fds no longer fit: MSG_CTRUNC. The fds
 * that did arrive must be closed. */
static void test_truncated_fds(void) {
  int pool[POOL], fds[SL_WIRE_MAX_FDS], sv[2], one = 1;
  struct sl_wire_rx rx;
  struct sl_err err;
  struct sl_frame_header h;
  const uint8_t *payload;

  for (int i = 0; i < POOL; i++)
    pool[i] = tagged_memfd(i);
  make_pair(sv, 1);
  setsockopt(sv[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
  sl_wire_rx_init(&rx);
  CHECK(sl_wire_send(sv[0], SL_WIRE_REQUEST, "x", 1, pool, POOL, -1, NULL) == 0);
  CHECK(read_and_next(&rx, sv[1], &h, &payload, fds, &err) == SUBLET_EPROTO);
  CHECK(strstr(err.msg, "truncated") != NULL);
  CHECK(rx.nfds == 0);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
  sl_wire_close_fds(pool, POOL);
}

/* ------------------------------------------------------------------ end of stream, time */

static void test_eof(void) {
  uint8_t frame[SL_WIRE_HEADER + 8] = {0};
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REPLY, 8, 0};
  struct sl_wire_rx rx;
  struct sl_err err;
  const uint8_t *payload;
  int sv[2];

  make_pair(sv, 0);
  sl_wire_rx_init(&rx);
  sl_wire_header_encode(&h, frame);
  send_bytes(sv[0], frame, sizeof(frame) - 3, NULL, 0);
  shutdown(sv[0], SHUT_WR);
  CHECK(sl_wire_recv(&rx, sv[1], &h, &payload, NULL, 1000, &err) == SUBLET_EPIPE);
  CHECK(strcmp(err.msg, "subletd closed the connection in the middle of a frame") == 0);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);

  make_pair(sv, 0);
  sl_wire_rx_init(&rx);
  close(sv[0]);
  CHECK(sl_wire_recv(&rx, sv[1], &h, &payload, NULL, 1000, &err) == SUBLET_EPIPE);
  CHECK(strcmp(err.msg, "subletd closed the connection") == 0);
  sl_wire_rx_destroy(&rx);
  close(sv[1]);
}

/* A deadline is kept: the call gives up with ETIMEDOUT and names it, never before it (a loaded
 * machine can only make it later, so only that side of the time is checked; 30 s: a hang
 * guard, which a deadline misread a thousandfold would fail). */
static void test_timeout(void) {
  struct sl_wire_rx rx;
  struct sl_err err;
  struct sl_frame_header h;
  const uint8_t *payload;
  int sv[2];
  double start = now_s(), took;

  make_pair(sv, 0);
  sl_wire_rx_init(&rx);
  send_bytes(sv[0], "TBLS", 4, NULL, 0); /* part of a header: still not a frame */
  CHECK(sl_wire_recv(&rx, sv[1], &h, &payload, NULL, 50, &err) == SUBLET_ETIMEDOUT);
  took = now_s() - start;
  CHECK(strstr(err.msg, "50 ms") != NULL);
  CHECK(took >= 0.045 && took < 30.0); /* not before it (ms rounding) */
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
}

/* A peer that stops reading: the sender gives up at its deadline instead of stalling for ever
 * (the time as in test_timeout). */
static void test_send_to_a_peer_that_does_not_read(void) {
  size_t len = 8u << 20; /* far more than the socket buffers hold */
  uint8_t *big = calloc(1, len);
  struct sl_err err;
  double start = now_s(), took;
  int sv[2];

  make_pair(sv, 0);
  fcntl(sv[0], F_SETFL, fcntl(sv[0], F_GETFL) | O_NONBLOCK); /* as the daemon's sockets are */
  CHECK(big != NULL);
  CHECK(sl_wire_send(sv[0], SL_WIRE_REPLY, big, len, NULL, 0, 500, &err) == SUBLET_ETIMEDOUT);
  took = now_s() - start;
  CHECK(strstr(err.msg, "not reading") != NULL);
  CHECK(strstr(err.msg, "within 500 ms") != NULL);
  CHECK(took >= 0.45 && took < 30.0); /* not before it */
  free(big);
  close_pair(sv);
}

static void test_send_to_closed_peer(void) {
  struct sl_err err;
  int sv[2];

  make_pair(sv, 0);
  close(sv[1]);
  CHECK(sl_wire_send(sv[0], SL_WIRE_REQUEST, "hello", 5, NULL, 0, -1, &err) == SUBLET_EPIPE);
  close(sv[0]);
}

/* Another version is a frame like any other: the caller answers it. */
/* One size parser for options and the environment (error.h): units, and what it refuses. */
static void test_parse_size(void) {
  static const char *const bad[] = {"", "-1", " 1", "+1", "1.5G", "1X", "1GB extra", "G",
                                    "16E", "18446744073709551616", "17179869184G", NULL};
  uint64_t v = 0;

  CHECK(sl_parse_size("4096", &v) == 0 && v == 4096);
  CHECK(sl_parse_size("512K", &v) == 0 && v == 512u << 10);
  CHECK(sl_parse_size("2m", &v) == 0 && v == 2u << 20);
  CHECK(sl_parse_size("16GiB", &v) == 0 && v == 16ull << 30);
  CHECK(sl_parse_size("1TB", &v) == 0 && v == 1ull << 40);
  CHECK(sl_parse_size("16777215T", &v) == 0 && v == 16777215ull << 40);
  CHECK(sl_parse_size("18446744073709551615", &v) == 0 && v == UINT64_MAX);
  for (int i = 0; bad[i] != NULL; i++)
    CHECK(sl_parse_size(bad[i], &v) == -1);
}

static void test_other_version_passes(void) {
  uint8_t frame[SL_WIRE_HEADER];
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION + 1, SL_WIRE_REQUEST, 0, 0};
  struct sl_wire_rx rx;
  const uint8_t *payload;
  int sv[2];

  make_pair(sv, 1);
  sl_wire_rx_init(&rx);
  sl_wire_header_encode(&h, frame);
  send_bytes(sv[0], frame, sizeof(frame), NULL, 0);
  memset(&h, 0, sizeof(h));
  CHECK(read_and_next(&rx, sv[1], &h, &payload, NULL, NULL) == 1);
  CHECK(h.version == SUBLET_PROTOCOL_VERSION + 1 && h.length == 0);
  sl_wire_rx_destroy(&rx);
  close_pair(sv);
}

/* ------------------------------------------------------------------ runner */

static void run(const char *name, void (*test)(void)) {
  int before = count_open_fds(), failed = check_failed;

  test();
  if (count_open_fds() != before)
    fprintf(stderr, "%s: %d fds open before, %d after\n", name, before, count_open_fds());
  CHECK(count_open_fds() == before);
  if (check_failed != failed)
    fprintf(stderr, "FAIL %s\n", name);
}

int main(void) {
  int before = count_open_fds();

  run("header_layout", test_header_layout);
  run("parse_size", test_parse_size);
  run("header_bounds", test_header_bounds);
  run("send_bounds", test_send_bounds);
  run("round_trip_fds", test_round_trip_fds);
  run("many_small_frames", test_many_small_frames);
  run("split_reads", test_split_reads);
  run("large_payloads", test_large_payloads);
  run("malformed_headers", test_malformed_headers);
  run("extra_fds", test_extra_fds);
  run("fds_where_none_expected", test_fds_where_none_expected);
  run("truncated_fds", test_truncated_fds);
  run("eof", test_eof);
  run("timeout", test_timeout);
  run("send_to_a_peer_that_does_not_read", test_send_to_a_peer_that_does_not_read);
  run("send_to_closed_peer", test_send_to_closed_peer);
  run("other_version_passes", test_other_version_passes);
  if (count_open_fds() != before)
    fprintf(stderr, "FAIL no_fd_leak: %d fds open before, %d after\n", before,
            count_open_fds());
  CHECK(count_open_fds() == before);
  return check_report("wire");
}
