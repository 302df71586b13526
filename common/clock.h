/* clock.h - the one clock of sublet: CLOCK_MONOTONIC, for deadlines, durations and uptime. */
#ifndef SL_CLOCK_H
#define SL_CLOCK_H

#include <stdint.h>

/* Seconds since an arbitrary moment; never goes back. */
double sl_clock_now(void);
/* The same clock in whole milliseconds, for deadlines. */
int64_t sl_clock_ms(void);

#endif
