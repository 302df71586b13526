/* clock.c - the one clock of sublet (see clock.h). Floor 1 (floors.h). */
#include "clock.h"

#include <time.h>

double sl_clock_now(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int64_t sl_clock_ms(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int sl_clock_left_ms(int64_t start_ms, int timeout_ms) {
  int64_t left = timeout_ms - (sl_clock_ms() - start_ms);

  return timeout_ms < 0 ? -1 : left > 0 ? (int)left : 0;
}
