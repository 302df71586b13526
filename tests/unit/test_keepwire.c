/* test_keepwire.c - tests of a Lend's keep list on the wire (common/keepwire.c): every form
 * encoded, packed as a real Request, unpacked and decoded back to the same ranges; the limits
 * that pick a form; and the malformed Lends subletd must refuse, each with its message. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "keepwire.h"
#include "msg.h"
#include "check.h"

/* n ranges, distinct and not sorted (the wire keeps the sender's order). */
static struct sublet_range *ranges(size_t n) {
  struct sublet_range *r = malloc((n > 0 ? n : 1) * sizeof(*r));

  for (size_t i = 0; r != NULL && i < n; i++)
    r[i] = (struct sublet_range){((n - i) * 7919u) << 12, (i % 5 + 1) * 4096 + 1};
  return r;
}

/* The Lend as subletd gets it: packed in a Request by the sender's code, then unpacked. */
static Sublet__Request *through_wire(Sublet__Lend *m) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  struct sl_err err = {0};
  Sublet__Request *got;
  uint8_t *buf;
  size_t len;

  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = m;
  if (sl_msg_pack(&req.base, &buf, &len, &err) != 0) {
    fprintf(stderr, "pack: %s\n", err.msg);
    return NULL;
  }
  got = sl_msg_unpack_request(buf, len, &err);
  free(buf);
  return got;
}

/* The decoded list: m->keep's pairs, or the memfd's read back. *n: ranges; NULL on error. */
static uint64_t *decoded(Sublet__Lend *m, int fd, size_t *n, struct sl_err *err) {
  uint64_t *v = NULL;

  if (sl_keepwire_decode(m, fd, err) != 0)
    return NULL;
  if (fd >= 0) {
    *n = m->keep_fd_ranges;
    return sl_keepwire_read(fd, *n, &v, err) == 0 ? v : NULL;
  }
  *n = m->n_keep / 2;
  v = malloc(m->n_keep * sizeof(*v) + 1);
  if (v != NULL && m->n_keep > 0)
    memcpy(v, m->keep, m->n_keep * sizeof(*v));
  return v;
}

/* Encodes n ranges for a subletd that reads the forms given, checks the form the encoder
 * picked, and that the other side decodes the very ranges. */
static void round_trip(size_t n, int bytes_ok, int fd_ok, enum sl_keepwire_form want) {
  struct sl_keepwire_tx tx;
  struct sublet_range *keep = ranges(n);
  Sublet__Lend m = SUBLET__LEND__INIT;
  Sublet__Request *got;
  struct sl_err err = {0};
  uint64_t *v;
  size_t nv = 0;
  int fd;

  sl_keepwire_tx_init(&tx);
  tx.bytes_ok = bytes_ok;
  tx.fd_ok = fd_ok;
  sl_keepwire_encode(&tx, &m, keep, n, 0, &fd);
  CHECK_EQ(m.has_keep_ranges, want == SL_KEEPWIRE_BYTES);
  CHECK_EQ(m.has_keep_fd_ranges, want == SL_KEEPWIRE_FD);
  CHECK_EQ(m.n_keep > 0, want == SL_KEEPWIRE_VARINTS);
  CHECK_EQ(fd >= 0, want == SL_KEEPWIRE_FD);
  CHECK(m.has_keep_all && !m.keep_all);
  got = through_wire(&m);
  CHECK(got != NULL);
  v = got != NULL ? decoded(got->lend, fd, &nv, &err) : NULL;
  CHECK(v != NULL);
  CHECK_EQ(nv, n);
  CHECK(v != NULL && nv == n && memcmp(v, keep, n * sizeof(*keep)) == 0);
  CHECK(got == NULL || !got->lend->has_keep_ranges); /* one form left: keep, or the fd */
  free(v);
  if (got != NULL)
    sublet__request__free_unpacked(got, NULL);
  sl_keepwire_tx_destroy(&tx);
  CHECK_EQ(tx.fd, -1);
  free(keep);
}

static void test_round_trips(void) {
  round_trip(0, 1, 1, SL_KEEPWIRE_NONE);
  round_trip(1, 0, 0, SL_KEEPWIRE_VARINTS);
  round_trip(1000, 0, 1, SL_KEEPWIRE_VARINTS); /* short: never the memfd */
  round_trip(1000, 1, 1, SL_KEEPWIRE_BYTES);
  round_trip(SL_KEEPWIRE_SHORT_RANGES, 1, 1, SL_KEEPWIRE_BYTES);
  round_trip(SL_KEEPWIRE_SHORT_RANGES + 1, 1, 1, SL_KEEPWIRE_FD);
  round_trip(SL_KEEPWIRE_SHORT_RANGES + 1, 1, 0, SL_KEEPWIRE_BYTES);
  round_trip(SL_KEEPWIRE_SHORT_RANGES + 1, 0, 0, SL_KEEPWIRE_VARINTS);
}

/* keep_all sends no list, whatever keep holds; a decoded keep_all Lend is not long. */
static void test_keep_all(void) {
  struct sl_keepwire_tx tx;
  struct sublet_range *keep = ranges(10);
  Sublet__Lend m = SUBLET__LEND__INIT;
  int fd;

  sl_keepwire_tx_init(&tx);
  tx.bytes_ok = tx.fd_ok = 1;
  sl_keepwire_encode(&tx, &m, keep, 10, 1, &fd);
  CHECK(m.has_keep_all && m.keep_all);
  CHECK(!m.has_keep_ranges && !m.has_keep_fd_ranges && m.n_keep == 0 && fd == -1);
  m.keep = (uint64_t *)keep; /* an old client's keep beside keep_all: ignored, as it was */
  m.n_keep = 2 * (SL_KEEPWIRE_SHORT_RANGES + 1);
  CHECK_EQ(sl_keepwire_decode(&m, -1, NULL), 0);
  CHECK(!sl_keepwire_is_long(&m, -1));
  free(keep);
}

/* The bounds that pick a form, each side of each. */
static void test_limits(void) {
  const size_t s = SL_KEEPWIRE_SHORT_RANGES, f = SL_KEEPWIRE_FD_MAX_RANGES,
               b = SL_KEEPWIRE_BYTES_MAX_RANGES;
  Sublet__Lend m = SUBLET__LEND__INIT;

  CHECK(b * SL_KEEPWIRE_RANGE_BYTES <= SL_WIRE_MAX_PAYLOAD / 2);
  CHECK(s < b && b < f);
  CHECK_EQ(sl_keepwire_form(0, 0, 1, 1), SL_KEEPWIRE_NONE);
  CHECK_EQ(sl_keepwire_form(5, 1, 1, 1), SL_KEEPWIRE_NONE);
  CHECK_EQ(sl_keepwire_form(s, 1, 1, 1), SL_KEEPWIRE_NONE);
  CHECK_EQ(sl_keepwire_form(s, 0, 1, 1), SL_KEEPWIRE_BYTES);
  CHECK_EQ(sl_keepwire_form(s + 1, 0, 1, 1), SL_KEEPWIRE_FD);
  CHECK_EQ(sl_keepwire_form(f, 0, 1, 1), SL_KEEPWIRE_FD);
  CHECK_EQ(sl_keepwire_form(f + 1, 0, 1, 1), SL_KEEPWIRE_VARINTS); /* past both */
  CHECK_EQ(sl_keepwire_form(b, 0, 1, 0), SL_KEEPWIRE_BYTES);
  CHECK_EQ(sl_keepwire_form(b + 1, 0, 1, 0), SL_KEEPWIRE_VARINTS);
  CHECK_EQ(sl_keepwire_form(s + 1, 0, 0, 0), SL_KEEPWIRE_VARINTS);
  m.n_keep = 2 * s;
  CHECK(!sl_keepwire_is_long(&m, -1));
  m.n_keep = 2 * (s + 1);
  CHECK(sl_keepwire_is_long(&m, -1));
  m.n_keep = 0;
  CHECK(sl_keepwire_is_long(&m, 3)); /* a memfd's list is read off the loop, however short */
}

/* The most ranges sent as bytes still fit a frame, with room for the rest of the Lend. */
static void test_bytes_fit_a_frame(void) {
  struct sl_keepwire_tx tx;
  struct sublet_range *keep = ranges(SL_KEEPWIRE_BYTES_MAX_RANGES);
  Sublet__Lend m = SUBLET__LEND__INIT;
  Sublet__Request *got;
  int fd;

  sl_keepwire_tx_init(&tx);
  tx.bytes_ok = 1;
  sl_keepwire_encode(&tx, &m, keep, SL_KEEPWIRE_BYTES_MAX_RANGES, 0, &fd);
  CHECK(m.has_keep_ranges);
  got = through_wire(&m);
  CHECK(got != NULL);
  if (got != NULL) {
    CHECK_EQ(sl_keepwire_decode(got->lend, -1, NULL), 0);
    CHECK_EQ(got->lend->n_keep, 2 * SL_KEEPWIRE_BYTES_MAX_RANGES);
    sublet__request__free_unpacked(got, NULL);
  }
  free(keep);
}

/* The memfd is reused from Lend to Lend, and shrinks when a list needs less than half of it;
 * one that cannot be written sends the list through the socket. */
static void test_memfd_reuse(void) {
  const size_t big = 4 * SL_KEEPWIRE_SHORT_RANGES, small = SL_KEEPWIRE_SHORT_RANGES + 1;
  struct sl_keepwire_tx tx;
  struct sublet_range *keep = ranges(big);
  Sublet__Lend m = SUBLET__LEND__INIT, m2 = SUBLET__LEND__INIT, m3 = SUBLET__LEND__INIT;
  int fd, fd2, fd3;

  sl_keepwire_tx_init(&tx);
  tx.bytes_ok = tx.fd_ok = 1;
  sl_keepwire_encode(&tx, &m, keep, big, 0, &fd);
  CHECK(fd >= 0 && fd == tx.fd);
  CHECK_EQ(lseek(fd, 0, SEEK_END), big * SL_KEEPWIRE_RANGE_BYTES);
  sl_keepwire_encode(&tx, &m2, keep, small, 0, &fd2);
  CHECK_EQ(fd2, fd);
  CHECK_EQ(tx.fd_bytes, small * SL_KEEPWIRE_RANGE_BYTES);
  CHECK_EQ(lseek(fd, 0, SEEK_END), small * SL_KEEPWIRE_RANGE_BYTES);
  sl_keepwire_tx_destroy(&tx);
  tx.fd = open("/dev/null", O_RDONLY | O_CLOEXEC); /* a memfd that will not take the list */
  sl_keepwire_encode(&tx, &m3, keep, small, 0, &fd3);
  CHECK_EQ(fd3, -1);
  CHECK(m3.has_keep_ranges && !m3.has_keep_fd_ranges);
  sl_keepwire_tx_destroy(&tx);
  free(keep);
}

/* ------------------------------------------------------------------ malformed Lends */

/* A memfd holding n ranges. */
static int memfd_of(size_t n) {
  struct sublet_range *keep = ranges(n);
  int fd = memfd_create("test-keep", MFD_CLOEXEC);
  ssize_t len = (ssize_t)(n * sizeof(*keep));

  if (fd < 0 || write(fd, keep, (size_t)len) != len)
    abort();
  free(keep);
  return fd;
}

/* Decodes m with fd; the code it refuses with and a phrase of its message. */
static void refused(Sublet__Lend *m, int fd, int code, const char *phrase, int line) {
  struct sl_err err = {0};
  int rc = sl_keepwire_decode(m, fd, &err);

  check_at(rc == code, "refused with its code", __FILE__, line);
  check_at(strstr(err.msg, phrase) != NULL, phrase, __FILE__, line);
}
#define REFUSED(m, fd, code, phrase) refused(m, fd, code, phrase, __LINE__)

static void test_mixed_forms(void) {
  uint64_t pairs[2] = {0, 4096};
  Sublet__Lend m;

  sublet__lend__init(&m);
  m.has_keep_ranges = m.has_keep_fd_ranges = 1;
  m.keep_fd_ranges = 1;
  REFUSED(&m, -1, SUBLET_EINVAL, "not more than one");
  sublet__lend__init(&m);
  m.has_keep_ranges = 1;
  m.keep = pairs;
  m.n_keep = 2;
  REFUSED(&m, -1, SUBLET_EINVAL, "not more than one");
  sublet__lend__init(&m);
  m.has_keep_fd_ranges = 1;
  m.keep_fd_ranges = 1;
  m.keep_all = 1;
  REFUSED(&m, -1, SUBLET_EINVAL, "not more than one");
}

static void test_bad_shapes(void) {
  uint8_t bytes[17] = {0};
  uint64_t pairs[3] = {0, 4096, 8192};
  Sublet__Lend m;

  sublet__lend__init(&m);
  m.has_keep_ranges = 1;
  m.keep_ranges = (ProtobufCBinaryData){sizeof(bytes), bytes};
  REFUSED(&m, -1, SUBLET_EINVAL, "16 bytes a range, not 17");
  sublet__lend__init(&m);
  m.keep = pairs;
  m.n_keep = 3;
  REFUSED(&m, -1, SUBLET_EINVAL, "an even count, not 3");
  sublet__lend__init(&m);
  m.has_keep_ranges = 1; /* empty: nothing kept */
  CHECK_EQ(sl_keepwire_decode(&m, -1, NULL), 0);
  CHECK_EQ(m.n_keep, 0);
}

static void test_bad_fds(void) {
  int good = memfd_of(4), p[2], wronly;
  char path[64];
  Sublet__Lend m;

  sublet__lend__init(&m);
  REFUSED(&m, good, SUBLET_EPROTO, "only with keep_fd_ranges");
  m.has_keep_fd_ranges = 1;
  m.keep_fd_ranges = 4;
  REFUSED(&m, -1, SUBLET_EPROTO, "without the memfd");
  m.keep_fd_ranges = 0;
  REFUSED(&m, good, SUBLET_EINVAL, "1 to 4194304 ranges");
  m.keep_fd_ranges = SL_KEEPWIRE_FD_MAX_RANGES + 1;
  REFUSED(&m, good, SUBLET_EINVAL, "1 to 4194304 ranges");
  m.keep_fd_ranges = 5;
  REFUSED(&m, good, SUBLET_EPROTO, "fewer than 5 ranges of 16");
  m.keep_fd_ranges = 4;
  CHECK_EQ(sl_keepwire_decode(&m, good, NULL), 0);
  if (pipe2(p, O_CLOEXEC) != 0)
    abort();
  REFUSED(&m, p[0], SUBLET_EPROTO, "is not a memfd");
  snprintf(path, sizeof(path), "/proc/self/fd/%d", good);
  wronly = open(path, O_WRONLY | O_CLOEXEC);
  CHECK(wronly >= 0);
  REFUSED(&m, wronly, SUBLET_EPROTO, "open for writing only");
  close(wronly);
  close(p[0]);
  close(p[1]);
  close(good);
}

/* The memfd is the sender's: shrunk after the check, the read says so (no rubbish read). */
static void test_memfd_shrinks(void) {
  int fd = memfd_of(8);
  struct sl_err err = {0};
  uint64_t *v = NULL;

  CHECK_EQ(ftruncate(fd, 3 * SL_KEEPWIRE_RANGE_BYTES + 5), 0);
  CHECK_EQ(sl_keepwire_read(fd, 8, &v, &err), SUBLET_EPROTO);
  CHECK_MSG(err, "ended after 3 of its 8 keep ranges");
  CHECK(v == NULL);
  close(fd);
}

int main(void) {
  test_round_trips();
  test_keep_all();
  test_limits();
  test_bytes_fit_a_frame();
  test_memfd_reuse();
  test_mixed_forms();
  test_bad_shapes();
  test_bad_fds();
  test_memfd_shrinks();
  return check_report("test_keepwire");
}
