/* clock.h - the one clock of sublet: CLOCK_MONOTONIC, for deadlines, durations and uptime. */
#ifndef SL_CLOCK_H
#define SL_CLOCK_H

#include <stdint.h>

/* Seconds since an arbitrary moment; never goes back. */
double sl_clock_now(void);
/* The same clock in whole milliseconds, for deadlines. */
int64_t sl_clock_ms(void);
/* What is left of timeout_ms since start_ms (sl_clock_ms): -1 when timeout_ms < 0 (no limit),
 * 0 once it has passed. */
int sl_clock_left_ms(int64_t start_ms, int timeout_ms);

#endif
