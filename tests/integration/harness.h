/* harness.h - starting a real subletd for integration tests, and a tiny assert framework. */
#ifndef SL_HARNESS_H
#define SL_HARNESS_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <unistd.h>

#include "sublet.h"

extern int sl_test_failed, sl_test_passed;

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);        \
      sl_test_failed++;                                                               \
      return;                                                                         \
    }                                                                                 \
  } while (0)

#define CHECK_RC(expr, want)                                                            \
  do {                                                                                  \
    int rc_ = (expr);                                                                   \
    if (rc_ != (want)) {                                                                \
      fprintf(stderr, "%s:%d: %s returned %d, wanted %d (%s)\n", __FILE__, __LINE__,    \
              #expr, rc_, (want), sublet_last_error());                                 \
      sl_test_failed++;                                                                 \
      return;                                                                           \
    }                                                                                   \
  } while (0)

/* Seconds on the monotonic clock. */
double sl_test_now(void);
/* Waits for what the daemon reaches in its own time (a dead client's connection seen, its
 * pages freed): evaluates cond every 10 ms until it holds or 30 s have passed. The caller then
 * CHECKs cond: one never reached fails there, and no check depends on how long it took. */
#define SL_TEST_UNTIL(cond)                                                           \
  for (double sl_until_ = sl_test_now() + 30; !(cond) && sl_test_now() < sl_until_;)  \
    usleep(10000)
/* SL_TEST_UNTIL(cond), then CHECK(cond). */
#define CHECK_UNTIL(cond)                                                             \
  do {                                                                                \
    SL_TEST_UNTIL(cond);                                                              \
    CHECK(cond);                                                                      \
  } while (0)
/* The device's free bytes, asked on c (0 when it cannot say). */
uint64_t sl_test_free_bytes(sublet_client *c);
/* The number the daemon's status gives for key ("clients", "lends_waiting"), asked on c; -1
 * when it cannot say. */
long long sl_test_status_number(sublet_client *c, const char *key);
/* fork(), the child set to die with this process whatever check fails first (a hoarder or a
 * keeper left behind would hold fds and pages). */
pid_t sl_test_child(void);
/* Kills and reaps a child. */
void sl_test_reap(pid_t pid);

struct sl_test_daemon {
  pid_t pid;
  char socket[108];
  char dir[64];
};

/* Starts subletd ($SUBLETD, else ./subletd) on the memfd backend with pages of page_size and
 * total bytes of "device" memory, --check on; waits for its socket. */
int sl_test_daemon_start(struct sl_test_daemon *d, uint64_t page_size, uint64_t total);
/* The same with more: extra options (NULL-terminated, may be NULL), run as uid (0: as the
 * caller; the socket's directory is given to it), with an open-files limit (0: unchanged). */
struct sl_test_daemon_opts {
  const char *const *args;
  uid_t uid;
  unsigned nofile;
};
int sl_test_daemon_start_ex(struct sl_test_daemon *d, uint64_t page_size, uint64_t total,
                            const struct sl_test_daemon_opts *o);
/* SIGTERM, then waits; returns its exit status (0 after a clean shutdown). */
int sl_test_daemon_stop(struct sl_test_daemon *d);
int sl_test_count_fds(pid_t pid);
/* The fds of pid that are memfds whose name begins with name (-1: /proc cannot say). */
int sl_test_count_memfds(pid_t pid, const char *name);
long sl_test_rss_kib(pid_t pid);
void sl_test_run(const char *name, void (*fn)(void));
int sl_test_summary(const char *suite);

#endif
