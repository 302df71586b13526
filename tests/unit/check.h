/* check.h - the C unit tests' checks: CHECK counts, CHECK_EQ prints both sides, CHECK_MSG looks
 * for a phrase in an sl_err's message; check_report() prints the tally and gives main's exit
 * code. One header so that a test file needs no macros of its own. (The integration tests'
 * CHECK and CHECK_RC are harness.h's: their tally spans harness.c and the test, per test.) */
#ifndef SL_TEST_CHECK_H
#define SL_TEST_CHECK_H

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

static int check_passed, check_failed;
/* When set, printed under each failure: the test's last error message (test_device.c). */
static const char *check_note;

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

#endif
