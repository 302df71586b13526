/* bench_rtt.c - the allocate/free round trip through subletd, alone and with other clients.
 *
 * One borrower times sublet_alloc + sublet_free pairs (each a request and a reply over the
 * socket, plus mapping the first time a position is granted) while N-1 other client
 * processes keep the daemon busy with their own requests (stats, region create/release).
 * Prints p50 and p99 per client count.
 *
 *   bench_rtt SOCKET [ITERATIONS]     (a running subletd; the memfd backend is fine)
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"
#include "sublet.h"

/* A background client: requests as fast as the daemon answers, until killed. */
static void busy_client(const char *sock) {
  sublet_client *c;
  struct sublet_loan_stats st;

  if (sublet_connect(sock, &c) != 0)
    _exit(1);
  for (;;) {
    sublet_region *r;
    sublet_loan_stats(c, &st);
    if (sublet_region_create(c, 1, &r) == 0)
      sublet_region_release(r);
  }
}

static int measure(const char *sock, int iterations, double *p50, double *p99) {
  double *t = calloc((size_t)iterations, sizeof(double));
  sublet_client *c;
  sublet_region *r;
  uint64_t loan;
  void *p;

  if (t == NULL || sublet_connect(sock, &c) != 0 || sublet_region_create(c, 64ull << 20, &r) ||
      sublet_lend(r, NULL, 0, 0, NULL, &loan, NULL) || sublet_borrow(c, loan, NULL, NULL, 0)) {
    fprintf(stderr, "bench_rtt: %s\n", sublet_last_error());
    return 1;
  }
  for (int i = 0; i < iterations; i++) {
    double t0 = now();
    if (sublet_alloc(c, 2ull << 20, &p) != 0 || sublet_free(c, p) != 0) {
      fprintf(stderr, "bench_rtt: %s\n", sublet_last_error());
      return 1;
    }
    t[i] = now() - t0;
  }
  qsort(t, (size_t)iterations, sizeof(double), cmp_double);
  *p50 = t[iterations / 2];
  *p99 = t[iterations * 99 / 100];
  sublet_return(c, 0, NULL, NULL, 0, NULL);
  sublet_reclaim(c, loan, 1000, NULL);
  sublet_region_release(r);
  sublet_disconnect(c);
  free(t);
  return 0;
}

int main(int argc, char **argv) {
  static const int clients[] = {1, 8, 64};
  int iterations = argc > 2 ? atoi(argv[2]) : 20000;

  if (argc < 2) {
    fprintf(stderr, "usage: bench_rtt SOCKET [ITERATIONS]\n");
    return 2;
  }
  printf("%-8s %12s %12s   (allocate + free of 2 MiB through subletd)\n", "clients",
         "p50 (us)", "p99 (us)");
  for (size_t k = 0; k < sizeof(clients) / sizeof(clients[0]); k++) {
    pid_t pids[64];
    double p50, p99;
    int n = clients[k] - 1, rc;
    for (int i = 0; i < n; i++)
      if ((pids[i] = fork()) == 0)
        busy_client(argv[1]);
    usleep(100000);
    rc = measure(argv[1], iterations, &p50, &p99);
    for (int i = 0; i < n; i++) {
      kill(pids[i], SIGKILL);
      waitpid(pids[i], NULL, 0);
    }
    if (rc != 0)
      return 1;
    printf("%-8d %12.1f %12.1f\n", clients[k], p50 * 1e6, p99 * 1e6);
  }
  return 0;
}
