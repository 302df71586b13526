/* fuzz_wire.c - fuzzes the frame receiver (common/wire.c) through a real socketpair, with real
 * fds riding the stream.
 *
 * The input is a script of writes. Each record is a control byte (bits 0-5: the length, 63
 * meaning that a u16 length follows; bits 6-7: how many fds ride the write) and that many bytes.
 * After each write the receiver reads and takes frames until it would block, so the chunking of
 * the stream, and where fds land in it, come from the input. Then the writer hangs up and the
 * receiver reads to EOF. Every fd must be closed at the end: the count of open fds is checked.
 */
#include "fuzz.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "sublet.pb-c.h"
#include "wire.h"

#define FDS_PER_WRITE 3

struct feed {
  int sv[2];            /* sv[0] writes, sv[1] reads; both non-blocking, the feed owns them */
  int memfd;            /* the file whose fds ride the writes; the feed owns it */
  int done;             /* the receiver met EOF or an error: nothing more is written */
  struct sl_wire_rx rx; /* owns the fds it has queued */
};

static void feed_open(struct feed *f) {
  memset(f, 0, sizeof(*f));
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, f->sv) != 0)
    abort();
  f->memfd = memfd_create("fuzz-wire", MFD_CLOEXEC);
  if (f->memfd < 0)
    abort();
  sl_wire_rx_init(&f->rx);
}

static void feed_close(struct feed *f) {
  sl_wire_rx_destroy(&f->rx);
  close(f->sv[0]);
  close(f->sv[1]);
  close(f->memfd);
}

static void feed_write(struct feed *f, const uint8_t *data, size_t len, size_t nfds) {
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int) * FDS_PER_WRITE)];
  } ctl;
  int fds[FDS_PER_WRITE] = {f->memfd, f->memfd, f->memfd};
  struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};

  if (nfds > 0) {
    memset(&ctl, 0, sizeof(ctl));
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    *c = (struct cmsghdr){.cmsg_len = CMSG_LEN(sizeof(int) * nfds), .cmsg_level = SOL_SOCKET,
                          .cmsg_type = SCM_RIGHTS};
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  if (sendmsg(f->sv[0], &msg, MSG_NOSIGNAL) < 0)
    f->done = 1; /* the socket buffer is full: the receiver refused to take more */
}

/* What a caller does with a frame: reads its payload, checks and closes its fds. */
static void use_frame(const struct sl_frame_header *h, const uint8_t *payload, int *fds) {
  volatile uint8_t sum = 0;

  for (uint32_t i = 0; i < h->length; i++)
    sum += payload[i];
  (void)sum;
  for (uint32_t i = 0; i < h->nfds; i++)
    if (!(fcntl(fds[i], F_GETFD) & FD_CLOEXEC))
      abort(); /* not an open fd, or one without CLOEXEC */
  sl_wire_close_fds(fds, h->nfds);
}

/* Takes frames and reads, alternately, until the receiver would block. */
static void feed_take(struct feed *f) {
  struct sl_frame_header h;
  const uint8_t *payload;
  int fds[SL_WIRE_MAX_FDS];
  struct sl_err err;
  int rc;

  while (!f->done) {
    rc = sl_wire_rx_next(&f->rx, &h, &payload, fds, &err);
    if (rc == 1) {
      use_frame(&h, payload, fds);
      continue;
    }
    if (f->rx.cap > SL_WIRE_HEADER + SL_WIRE_MAX_PAYLOAD)
      abort();
    if (rc == 0)
      rc = sl_wire_rx_read(&f->rx, f->sv[1], &err);
    if (rc == -EAGAIN)
      return;
    f->done = rc <= 0;
  }
}

/* Takes the next record off the script; returns 0 at its end. */
static int next_record(const uint8_t **data, size_t *size, const uint8_t **bytes, size_t *len,
                       size_t *nfds) {
  const uint8_t *p = *data, *end = *data + *size;

  if (p == end)
    return 0;
  *nfds = *p >> 6;
  *len = *p++ & 0x3f;
  if (*len == 0x3f && end - p >= 2) {
    *len = (size_t)p[0] | ((size_t)p[1] << 8);
    p += 2;
  }
  if (*len > (size_t)(end - p))
    *len = (size_t)(end - p);
  *bytes = p;
  *size = (size_t)(end - p) - *len;
  *data = p + *len;
  return 1;
}

static int count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;

  while (d != NULL && readdir(d) != NULL)
    n++;
  if (d != NULL)
    closedir(d);
  return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int open_before = count_open_fds();
  const uint8_t *bytes;
  size_t len, nfds;
  struct feed f;

  feed_open(&f);
  while (!f.done && next_record(&data, &size, &bytes, &len, &nfds)) {
    /* fds need at least one byte to ride */
    feed_write(&f, bytes, len, len > 0 ? nfds : 0);
    feed_take(&f);
  }
  shutdown(f.sv[0], SHUT_WR);
  feed_take(&f);
  feed_close(&f);
  if (count_open_fds() != open_before) {
    fprintf(stderr, "fuzz_wire: fds leaked: %d open before, %d after\n", open_before,
            count_open_fds());
    abort();
  }
  return 0;
}

/* ------------------------------------------------------------------ seeds */

struct script {
  uint8_t *buf;
  size_t cap, len;
};

static void put_record(struct script *s, const uint8_t *bytes, size_t len, size_t nfds) {
  if (s->len + 3 + len > s->cap)
    return;
  if (len < 0x3f) {
    s->buf[s->len++] = (uint8_t)(nfds << 6 | len);
  } else {
    s->buf[s->len++] = (uint8_t)(nfds << 6 | 0x3f);
    s->buf[s->len++] = (uint8_t)len;
    s->buf[s->len++] = (uint8_t)(len >> 8);
  }
  memcpy(s->buf + s->len, bytes, len);
  s->len += len;
}

/* A frame written in pieces of `piece` bytes (at most 65535): its header announces `nfds` fds,
 * and `sent` of them ride its first piece. */
static void put_frame(struct script *s, uint16_t kind, const uint8_t *payload, size_t len,
                      uint32_t nfds, size_t sent, size_t piece) {
  struct sl_frame_header h = {SL_WIRE_MAGIC, 1, kind, (uint32_t)len, nfds};
  uint8_t *frame = malloc(SL_WIRE_HEADER + len);

  sl_wire_header_encode(&h, frame);
  memcpy(frame + SL_WIRE_HEADER, payload, len);
  for (size_t at = 0; at < SL_WIRE_HEADER + len; at += piece) {
    size_t n = SL_WIRE_HEADER + len - at < piece ? SL_WIRE_HEADER + len - at : piece;
    put_record(s, frame + at, n, at == 0 ? sent : 0);
  }
  free(frame);
}

/* A real request as payload: Hello. */
static size_t hello_payload(uint8_t *out) {
  Sublet__Hello hello = SUBLET__HELLO__INIT;
  Sublet__Request req = SUBLET__REQUEST__INIT;

  hello.protocol = 1;
  hello.client_name = "fuzz";
  req.id = 1;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &hello;
  return sublet__request__pack(&req, out);
}

size_t sl_fuzz_seed(unsigned i, uint8_t *buf, size_t cap) {
  static uint8_t payload[20000];
  struct script s = {buf, cap, 0};
  size_t hello = hello_payload(payload);

  for (size_t k = hello; k < sizeof(payload); k++)
    payload[k] = (uint8_t)(k * 7);
  if (i == 0)
    put_frame(&s, SL_WIRE_REQUEST, payload, hello, 0, 0, 1000);
  else if (i == 1)
    put_frame(&s, SL_WIRE_REPLY, payload, 40, 3, 3, 5);
  else if (i == 2)
    for (uint32_t k = 0; k < 4; k++)
      put_frame(&s, SL_WIRE_REQUEST, payload, 20 * k, k, k, 1 + 16 * k);
  else if (i == 3)
    put_frame(&s, SL_WIRE_REPLY, payload, sizeof(payload), 1, 1, 8000);
  else if (i == 4)
    put_frame(&s, SL_WIRE_REPLY, payload, 8, 2, 1, 7); /* one fd fewer than announced */
  return s.len;
}
