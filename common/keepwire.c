/* keepwire.c - a Lend's keep list on the wire: the client's encoder, subletd's decoder
 * (keepwire.h says why there are three forms).
 *
 * Floor 2 (floors.h).
 */
#include "keepwire.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The bytes forms are this host's struct sublet_range as it is: a big-endian sender sends
 * varints (a big-endian receiver swaps what it gets). */
#define AS_BYTES (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__)

_Static_assert(sizeof(struct sublet_range) == SL_KEEPWIRE_RANGE_BYTES,
               "struct sublet_range is the wire's (offset, length) pair");

/* ------------------------------------------------------------------ encoder */

void sl_keepwire_tx_init(struct sl_keepwire_tx *tx) {
  *tx = (struct sl_keepwire_tx){.fd = -1};
}

void sl_keepwire_tx_destroy(struct sl_keepwire_tx *tx) {
  if (tx->fd >= 0)
    close(tx->fd);
  tx->fd = -1;
  tx->fd_bytes = 0;
}

enum sl_keepwire_form sl_keepwire_form(size_t n, int keep_all, int bytes_ok, int fd_ok) {
  if (keep_all || n == 0)
    return SL_KEEPWIRE_NONE;
  if (fd_ok && AS_BYTES && n > SL_KEEPWIRE_SHORT_RANGES && n <= SL_KEEPWIRE_FD_MAX_RANGES)
    return SL_KEEPWIRE_FD;
  if (bytes_ok && AS_BYTES && n <= SL_KEEPWIRE_BYTES_MAX_RANGES)
    return SL_KEEPWIRE_BYTES;
  return SL_KEEPWIRE_VARINTS;
}

/* Writes the ranges at the start of tx's memfd. It shrinks when it holds more than twice what
 * this list needs: what a long list once took is not held for good. 0, or -1. */
static int to_memfd(struct sl_keepwire_tx *tx, const struct sublet_range *keep, size_t n) {
  const char *p = (const char *)keep;
  size_t left = n * sizeof(*keep);
  off_t at = 0;

  if (tx->fd < 0 && (tx->fd = memfd_create("sublet-keep", MFD_CLOEXEC)) < 0)
    return -1;
  if (tx->fd_bytes / 2 > left && ftruncate(tx->fd, (off_t)left) == 0)
    tx->fd_bytes = left;
  tx->fd_bytes = tx->fd_bytes > left ? tx->fd_bytes : left;
  while (left > 0) {
    ssize_t w = pwrite(tx->fd, p, left, at);
    if (w < 0 && errno == EINTR)
      continue;
    if (w <= 0)
      return -1;
    p += w;
    at += w;
    left -= (size_t)w;
  }
  return 0;
}

void sl_keepwire_encode(struct sl_keepwire_tx *tx, Sublet__Lend *m,
                        const struct sublet_range *keep, size_t n, int keep_all, int *fd) {
  enum sl_keepwire_form form = sl_keepwire_form(n, keep_all, tx->bytes_ok, tx->fd_ok);

  *fd = -1;
  m->has_keep_all = 1;
  m->keep_all = keep_all != 0;
  if (form == SL_KEEPWIRE_FD && to_memfd(tx, keep, n) != 0)
    form = sl_keepwire_form(n, keep_all, tx->bytes_ok, 0);
  if (form == SL_KEEPWIRE_FD) {
    m->has_keep_fd_ranges = 1;
    m->keep_fd_ranges = n;
    *fd = tx->fd;
  } else if (form == SL_KEEPWIRE_BYTES) {
    m->has_keep_ranges = 1;
    m->keep_ranges.data = (uint8_t *)keep;
    m->keep_ranges.len = n * sizeof(*keep);
  } else if (form == SL_KEEPWIRE_VARINTS) {
    m->keep = (uint64_t *)keep; /* struct sublet_range is two uint64_t: the pairs' layout */
    m->n_keep = 2 * n;
  }
}

/* ------------------------------------------------------------------ decoder */

/* Little-endian u64s to this host's order, in place. */
static void from_le(uint64_t *v, size_t n) {
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
  for (size_t i = 0; i < n; i++)
    v[i] = __builtin_bswap64(v[i]);
#else
  (void)v;
  (void)n;
#endif
}

/* keep_ranges and keep_fd_ranges stand alone: neither with the other, keep or keep_all (keep
 * beside keep_all is ignored, as it always was). Checked before either is read. */
static int forms_check(const Sublet__Lend *m, struct sl_err *err) {
  int packed = m->has_keep_ranges + m->has_keep_fd_ranges;

  if (packed > 1 || (packed == 1 && (m->n_keep > 0 || m->keep_all)))
    return sl_err_set(err, SUBLET_EINVAL, "a Lend has keep, keep_all, keep_ranges or "
                      "keep_fd_ranges, not more than one");
  return 0;
}

/* Lend.keep_ranges becomes Lend.keep: the buffer is taken over as it is (protobuf-c allocated
 * it with malloc, as it does keep). */
static int from_bytes(Sublet__Lend *m, struct sl_err *err) {
  if (!m->has_keep_ranges)
    return 0;
  if (m->keep_ranges.len % SL_KEEPWIRE_RANGE_BYTES != 0)
    return sl_err_set(err, SUBLET_EINVAL, "Lend.keep_ranges holds %d bytes a range, not %zu "
                      "bytes", SL_KEEPWIRE_RANGE_BYTES, m->keep_ranges.len);
  if (m->keep_ranges.len == 0)
    return 0;
  from_le((uint64_t *)m->keep_ranges.data, m->keep_ranges.len / sizeof(uint64_t));
  free(m->keep);
  m->keep = (uint64_t *)m->keep_ranges.data;
  m->n_keep = m->keep_ranges.len / sizeof(uint64_t);
  m->keep_ranges.data = NULL;
  m->keep_ranges.len = 0;
  m->has_keep_ranges = 0;
  return 0;
}

/* Lend.keep_fd_ranges: one keep list, in a memfd that holds them all, open for reading.
 * fcntl's seals answer only for shared memory (a memfd, a tmpfs or hugetlbfs file): a file
 * whose reads could block the reader is refused. */
static int fd_check(const Sublet__Lend *m, int fd, struct sl_err *err) {
  struct stat st;
  int fl;

  if (!m->has_keep_fd_ranges)
    return fd < 0 ? 0 : sl_err_set(err, SUBLET_EPROTO, "a Lend carries an fd only with "
                                   "keep_fd_ranges");
  if (fd < 0)
    return sl_err_set(err, SUBLET_EPROTO, "Lend.keep_fd_ranges without the memfd: send it "
                      "with the frame");
  if (m->keep_fd_ranges == 0 || m->keep_fd_ranges > SL_KEEPWIRE_FD_MAX_RANGES)
    return sl_err_set(err, SUBLET_EINVAL, "Lend.keep_fd_ranges is %llu: 1 to %llu ranges "
                      "(merge adjacent ones)", (unsigned long long)m->keep_fd_ranges,
                      SL_KEEPWIRE_FD_MAX_RANGES);
  if (fcntl(fd, F_GET_SEALS) < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
    return sl_err_set(err, SUBLET_EPROTO, "the fd of Lend.keep_fd_ranges is not a memfd "
                      "(nor other shared memory): send the ranges in a memfd_create file");
  if ((fl = fcntl(fd, F_GETFL)) < 0 || (fl & O_ACCMODE) == O_WRONLY)
    return sl_err_set(err, SUBLET_EPROTO, "the keep memfd is open for writing only: send "
                      "an fd subletd can read");
  if ((uint64_t)st.st_size / SL_KEEPWIRE_RANGE_BYTES < m->keep_fd_ranges)
    return sl_err_set(err, SUBLET_EPROTO, "the keep memfd holds %lld bytes, fewer than %llu "
                      "ranges of %d", (long long)st.st_size,
                      (unsigned long long)m->keep_fd_ranges, SL_KEEPWIRE_RANGE_BYTES);
  return 0;
}

int sl_keepwire_decode(Sublet__Lend *m, int fd, struct sl_err *err) {
  int rc;

  if ((rc = forms_check(m, err)) != 0 || (rc = from_bytes(m, err)) != 0 ||
      (rc = fd_check(m, fd, err)) != 0)
    return rc;
  if (m->n_keep % 2 != 0)
    return sl_err_set(err, SUBLET_EINVAL, "Lend.keep holds (offset, length) pairs: an even "
                      "count, not %zu", m->n_keep);
  return 0;
}

int sl_keepwire_is_long(const Sublet__Lend *m, int fd) {
  return fd >= 0 || (!m->keep_all && m->n_keep / 2 > SL_KEEPWIRE_SHORT_RANGES);
}

int sl_keepwire_read(int fd, size_t n, uint64_t **out, struct sl_err *err) {
  size_t len = n * SL_KEEPWIRE_RANGE_BYTES, got = 0;
  uint8_t *buf = malloc(len > 0 ? len : 1);

  if (buf == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for %zu keep ranges", n);
  while (got < len) {
    ssize_t r = pread(fd, buf + got, len - got, (off_t)got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      free(buf);
      return sl_err_set(err, SUBLET_EPROTO, "the keep memfd ended after %zu of its %zu keep "
                        "ranges (%s): write every range before the Lend",
                        got / SL_KEEPWIRE_RANGE_BYTES, n, r < 0 ? strerror(errno) : "end of file");
    }
    got += (size_t)r;
  }
  from_le((uint64_t *)buf, 2 * n);
  *out = (uint64_t *)buf;
  return 0;
}
