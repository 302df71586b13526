/* bench_save_rtt.c - another client's round trip while subletd saves a large loan's kept bytes.
 *
 * The owner keeps all of a region of N GiB and borrows it itself; one allocation of the whole
 * region makes the daemon save every kept byte to host memory (off its event loop). Meanwhile
 * another client times StatsGet round trips. Prints the save's time and rate beside the host
 * link's limit, and the other client's round trips during the save beside those of an idle
 * daemon. Start the daemon so that the loan takes no free memory (it then goes straight to the
 * kept pages):
 *
 *   subletd --device 0 --socket /tmp/s.sock --reserve 1T &
 *   sublet_bench_save_rtt /tmp/s.sock 16
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "sublet.h"

#define MAX_TRIPS 1000000
#define LINK_GBPS 55.0 /* pinned host link of an H200 (PCIe 5 x16), measured */

struct trips {
  sublet_client *c;
  double *t;
  size_t n;
  volatile int stop;
};

static void *time_trips(void *arg) {
  struct trips *tr = arg;
  struct sublet_info info;

  while (!tr->stop && tr->n < MAX_TRIPS) {
    double t0 = now();
    if (sublet_get_info(tr->c, &info) != 0)
      break;
    tr->t[tr->n++] = now() - t0;
    nanosleep(&(struct timespec){0, 100000}, NULL); /* a client, not a CPU hog */
  }
  return NULL;
}

static void report(const char *what, struct trips *tr) {
  qsort(tr->t, tr->n, sizeof(double), cmp_double);
  if (tr->n == 0) {
    printf("%-24s no round trip completed\n", what);
    return;
  }
  printf("%-24s %7zu round trips: p50 %.0f us, p99 %.0f us, max %.0f us\n", what, tr->n,
         tr->t[tr->n / 2] * 1e6, tr->t[tr->n * 99 / 100] * 1e6, tr->t[tr->n - 1] * 1e6);
}

/* Idle round trips for a baseline, over a fixed time. */
static void idle_trips(struct trips *tr, double seconds) {
  pthread_t t;

  tr->n = 0;
  tr->stop = 0;
  pthread_create(&t, NULL, time_trips, tr);
  struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
  nanosleep(&ts, NULL);
  tr->stop = 1;
  pthread_join(t, NULL);
}

static int fail(const char *what) {
  fprintf(stderr, "bench_save_rtt: %s: %s\n", what, sublet_last_error());
  return 1;
}

int main(int argc, char **argv) {
  uint64_t gib = argc > 2 ? strtoull(argv[2], NULL, 10) : 16, size = gib << 30, loan;
  struct trips tr = {.t = calloc(MAX_TRIPS, sizeof(double))};
  struct sublet_loan_stats st;
  sublet_client *owner;
  sublet_region *r;
  pthread_t t;
  double t0, secs;
  void *p;

  if (argc < 2 || tr.t == NULL) {
    fprintf(stderr, "usage: sublet_bench_save_rtt SOCKET [GiB, default 16]\n");
    return 2;
  }
  if (sublet_connect(argv[1], &owner) != 0 || sublet_connect(argv[1], &tr.c) != 0)
    return fail("connect");
  if (sublet_region_create(owner, size, &r) != 0)
    return fail("region_create");
  idle_trips(&tr, 1.0);
  report("idle daemon", &tr);
  if (sublet_lend(r, NULL, 0, 1, NULL, &loan, NULL) != 0 ||
      sublet_borrow(owner, loan, NULL, NULL, 0) != 0)
    return fail("lend/borrow");
  tr.n = 0;
  tr.stop = 0;
  pthread_create(&t, NULL, time_trips, &tr);
  t0 = now();
  if (sublet_alloc(owner, size, &p) != 0)
    return fail("alloc (start subletd with --reserve 1T so that the loan takes no free memory)");
  secs = now() - t0;
  tr.stop = 1;
  pthread_join(t, NULL);
  sublet_loan_stats(owner, &st);
  printf("save of %.2f GiB: %.3f s in the allocation, %.3f s copying = %.1f GB/s "
         "(limit %.0f GB/s: %.3f s)\n", (double)st.copied_out_bytes / (1 << 30), secs,
         st.copy_out_seconds, (double)st.copied_out_bytes / st.copy_out_seconds / 1e9,
         LINK_GBPS, (double)st.copied_out_bytes / (LINK_GBPS * 1e9));
  report("during the save", &tr);
  sublet_free(owner, p);
  sublet_return(owner, 0, &st, NULL, 0, NULL);
  sublet_reclaim(owner, loan, -1, &st);
  sublet_region_release(r);
  sublet_disconnect(tr.c);
  sublet_disconnect(owner);
  return 0;
}
