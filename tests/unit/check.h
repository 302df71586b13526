/* check.h - the C unit tests' checks: CHECK counts, CHECK_EQ prints both sides, CHECK_MSG looks
 * for a phrase in an sl_err's message; check_report() prints the tally and gives main's exit
 * code. One header so that a test file needs no macros of its own. (The integration tests'
 * CHECK and CHECK_RC are harness.h's: their tally spans harness.c and the test, per test.) */
#ifndef SL_TEST_CHECK_H
#define SL_TEST_CHECK_H

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

/* The tally, one a test program: a test of several files defines SL_CHECK_SHARED before this
 * header in each file but its main's, and they count into main's (books_fixtures.c). */
extern int check_passed, check_failed;
/* When set, printed under each failure: the test's last error message (test_device.c). */
extern const char *check_note;
#ifndef SL_CHECK_SHARED
int check_passed, check_failed;
const char *check_note;
#endif

static inline void check_at(int ok, const char *what, const char *file, int line) {
  if (ok) {
    check_passed++;
    return;
  }
  if (check_failed++ >= 30)
    return;
  fprintf(stderr, "%s:%d: FAILED: %s\n", file, line, what);
  if (check_note != NULL && check_note[0] != '\0')
    fprintf(stderr, "    last error: %s\n", check_note);
}

#define CHECK(cond) check_at(!!(cond), #cond, __FILE__, __LINE__)
#define CHECK_EQ(a, b)                                                                        \
  do {                                                                                        \
    uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                                          \
    check_at(a_ == b_, #a " == " #b, __FILE__, __LINE__);                                     \
    if (a_ != b_ && check_failed <= 30)                                                       \
      fprintf(stderr, "    %" PRIu64 " != %" PRIu64 "\n", a_, b_);                            \
  } while (0)
#define CHECK_MSG(err, text) check_at(strstr((err).msg, text) != NULL, "message has " text,   \
                                      __FILE__, __LINE__)

/* "N passed, N failed" alone on a line (what CI reads); 0 when nothing failed. */
static inline int check_report(const char *name) {
  printf("%s: %d passed, %d failed\n", name, check_passed, check_failed);
  return check_failed != 0;
}

/* The books' tests (books.h included before this header). */
#ifdef SL_BOOKS_H
#include <stdlib.h>

/* BOOKS_OK: the books pass sl_books_check(); why not, printed under the failure. */
static inline void books_ok_at(const struct sl_books *b, const char *file, int line) {
  char why[256] = "";
  int rc = sl_books_check(b, why, sizeof(why));

  check_at(rc == 0, "sl_books_check", file, line);
  if (rc != 0 && check_failed <= 30)
    fprintf(stderr, "    %s\n", why);
}
#define BOOKS_OK(b) books_ok_at(b, __FILE__, __LINE__)

/* A release played on a byte map of npages pages of `page` bytes (byte i holds
 * i * mul + i / page): the begin's moves and saves applied, the released pages overwritten
 * (they are the driver's), the undo applied. Is every kept byte back? */

static inline int check_kept_back(const struct sl_release_work *begin,
                                  const struct sl_release_work *undo,
                                  const struct sublet_range *keep, size_t n, uint64_t npages,
                                  uint64_t page, unsigned mul) {
  uint64_t size = npages * page;
  uint8_t *dev = malloc(size), *orig = malloc(size), *host = calloc(1, size + 1);
  int ok = 1;

  for (uint64_t i = 0; i < size; i++)
    orig[i] = dev[i] = (uint8_t)(i * mul + i / page);
  for (size_t i = 0; i < begin->nmoves; i++)
    memmove(dev + begin->moves[i].dst_off, dev + begin->moves[i].src_off, begin->moves[i].len);
  for (size_t i = 0; i < begin->ncopies; i++)
    memcpy(host + begin->copies[i].host_off, dev + begin->copies[i].dev_off, begin->copies[i].len);
  for (size_t i = 0; i < begin->nreleased; i++)
    memset(dev + begin->released[i] * page, 0xAB, page);
  for (size_t i = 0; i < undo->ncopies; i++)
    memcpy(dev + undo->copies[i].dev_off, host + undo->copies[i].host_off, undo->copies[i].len);
  for (size_t i = 0; i < undo->nmoves; i++)
    memmove(dev + undo->moves[i].dst_off, dev + undo->moves[i].src_off, undo->moves[i].len);
  for (size_t i = 0; i < n; i++)
    ok &= memcmp(dev + keep[i].offset, orig + keep[i].offset, keep[i].length) == 0;
  free(dev);
  free(orig);
  free(host);
  return ok;
}
#endif

#endif
