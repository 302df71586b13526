/* idle.c - `--idle-exit SECONDS`: a daemon started on demand (a user's own, see README) leaves
 * by itself once it has served nobody for that long: no connection, no region, no loan, no
 * dead borrower's loan still to finish. A tick checks, rather than every place that could
 * make the daemon idle: leaving a few hundred milliseconds late costs nothing.
 *
 * Floor 4 (daemon.h's floors).
 */
#include "clock.h"
#include "daemon.h"
#include "log.h"

static int idle_now(struct sl_daemon *d) {
  struct sl_books_totals t;

  if (d->conns != NULL || d->drains != NULL || !sl_jobs_idle(d))
    return 0;
  sl_books_totals(d->books, &t);
  return t.clients == 0 && t.regions == 0 && t.loans == 0;
}

static void on_idle_tick(uv_timer_t *t) {
  struct sl_daemon *d = t->data;
  double now = sl_clock_now();

  if (!idle_now(d)) {
    d->idle_since = now;
    return;
  }
  if (now - d->idle_since < d->cfg.idle_exit_seconds)
    return;
  sl_info("no client and no region for %.0f s (--idle-exit): shutting down",
          d->cfg.idle_exit_seconds);
  d->idle_exit(d);
}

void sl_idle_start(struct sl_daemon *d, void (*leave)(struct sl_daemon *d)) {
  double tick = d->cfg.idle_exit_seconds / 4;

  if (d->cfg.idle_exit_seconds <= 0)
    return;
  tick = tick < 0.05 ? 0.05 : tick > 5 ? 5 : tick;
  d->idle_exit = leave;
  d->idle_since = sl_clock_now();
  uv_timer_init(d->loop, &d->idle_timer);
  d->idle_timer.data = d;
  uv_timer_start(&d->idle_timer, on_idle_tick, (uint64_t)(tick * 1000), (uint64_t)(tick * 1000));
}

void sl_idle_stop(struct sl_daemon *d) {
  if (d->cfg.idle_exit_seconds > 0 && !uv_is_closing((uv_handle_t *)&d->idle_timer))
    uv_close((uv_handle_t *)&d->idle_timer, NULL);
}
