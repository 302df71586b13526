/* bench_util.h - what the daemon's benchmarks share: a clock and a sort order for timings. */
#ifndef SL_BENCH_UTIL_H
#define SL_BENCH_UTIL_H

#include <time.h>

static inline double now(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#endif
