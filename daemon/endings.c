/* endings.c - how loans end on the device, and what a client leaves when it goes.
 *
 * A loan ends when its borrower returns it, or when the borrower's connection goes: then only
 * once the borrower's process has fully exited (its GPU work may run until then), watched with
 * a pidfd. Either way the kept bytes come back before the owner hears of it.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"

/* Carries out a loan's end on the device: the kept bytes back, fresh memory released. The
 * final stats go to the owner and, if out is not NULL, to the caller. */
void sl_loan_end_apply(struct sl_daemon *d, struct sl_loan_end *end,
                        struct sublet_loan_stats *out) {
  struct sl_err err = {0};
  double secs = 0;
  char size[16];

  double move_secs = 0;

  /* Saves first: they bring back the bytes that were moved into pages lent later. */
  if ((end->nrestore > 0 &&
       sl_pool_restore(d->pool, end->region_id, end->restore, end->nrestore, &secs, &err) != 0) ||
      sl_pool_move(d->pool, end->region_id, end->unmove, end->nunmove, &move_secs, &err) != 0) {
    sl_error("loan %llu: restoring kept bytes failed: %s", (unsigned long long)end->loan_id,
             err.msg);
    end->stats.copied_in_bytes = 0; /* nothing came back: the owner's client reports it */
  }
  end->stats.move_seconds = d->move_seconds + move_secs;
  for (size_t i = 0; i < end->nfresh; i++)
    sl_pool_chunk_release(d->pool, end->fresh_chunks[i]);
  if (end->free_region)
    sl_pool_region_destroy(d->pool, end->region_id);
  end->stats.copy_in_seconds = secs;
  end->stats.copy_out_seconds = d->copy_out_seconds;
  sl_info("loan %llu ended: %s copied out and back%s", (unsigned long long)end->loan_id,
          sl_format_size(size, end->stats.copied_out_bytes),
          end->stats.borrower_died ? " (the borrower died)" : "");
  sl_waiters_loan_ended(d, &end->stats, end->owner_client);
  if (out != NULL)
    *out = end->stats;
  sl_loan_end_clear(end);
}

/* Ends loans whose borrower is gone: kept bytes restored, the owner told. */
static void finish_now(struct sl_daemon *d, const uint64_t *loans, size_t n) {
  for (size_t i = 0; i < n; i++) {
    struct sl_loan_end end = {0};
    if (sl_books_loan_finish(d->books, loans[i], &end) == 0)
      sl_loan_end_apply(d, &end, NULL);
  }
}

static void drain_done(struct sl_drain *dr) {
  struct sl_daemon *d = dr->d;
  struct sl_drain **link = &d->drains;

  finish_now(d, dr->loans, dr->nloans);
  while (*link != NULL && *link != dr)
    link = &(*link)->next;
  if (*link != NULL)
    *link = dr->next;
}

static void free_drain(uv_handle_t *h) {
  struct sl_drain *dr = h->data;

  if (dr->pidfd >= 0)
    close(dr->pidfd);
  free(dr->loans);
  free(dr);
}

static void on_drain_exit(uv_poll_t *h, int status, int events) {
  struct sl_drain *dr = h->data;

  sl_info("borrower pid %d has exited: restoring its loan's kept bytes", (int)dr->pid);
  drain_done(dr);
  uv_poll_stop(h);
  uv_close((uv_handle_t *)h, free_drain);
}

/* Without a pidfd: poll until the pid is gone (kill(pid, 0) fails with ESRCH). */
static void on_drain_tick(uv_timer_t *t) {
  struct sl_drain *dr = t->data;

  if (kill(dr->pid, 0) == 0 || errno != ESRCH)
    return;
  drain_done(dr);
  uv_timer_stop(t);
  uv_close((uv_handle_t *)t, free_drain);
}

/* The borrower died: its GPU work may run until its process is gone, so restore only then. */
static int drain_after_exit(struct sl_conn *c, uint64_t *loans, size_t n) {
  struct sl_daemon *d = c->d;
  struct sl_drain *dr = calloc(1, sizeof(*dr));

  if (dr == NULL || (dr->loans = malloc(n * sizeof(*loans))) == NULL) {
    free(dr);
    return SUBLET_ENOMEM;
  }
  dr->d = d;
  dr->pid = c->peer.pid;
  dr->pidfd = c->pidfd;
  c->pidfd = -1;
  memcpy(dr->loans, loans, n * sizeof(*loans));
  dr->nloans = n;
  dr->next = d->drains;
  d->drains = dr;
  if (dr->pidfd >= 0) {
    uv_poll_init(d->loop, &dr->poll, dr->pidfd);
    dr->poll.data = dr;
    uv_poll_start(&dr->poll, UV_READABLE, on_drain_exit);
  } else {
    uv_timer_init(d->loop, &dr->timer);
    dr->timer.data = dr;
    uv_timer_start(&dr->timer, on_drain_tick, 10, 10);
  }
  return 0;
}

void sl_handle_shutdown(struct sl_daemon *d) {
  while (d->drains != NULL) {
    struct sl_drain *dr = d->drains;
    drain_done(dr); /* unlinks dr */
    if (dr->pidfd >= 0) {
      uv_poll_stop(&dr->poll);
      uv_close((uv_handle_t *)&dr->poll, free_drain);
    } else {
      uv_timer_stop(&dr->timer);
      uv_close((uv_handle_t *)&dr->timer, free_drain);
    }
  }
}

/* A borrower left mid-loan: its loans end once its process has exited, or at once when the
 * daemon is going away, or when there is no process it can watch (a pid from another pid
 * namespace reads as 0). */
static void settle_borrower(struct sl_conn *c, uint64_t *loans, size_t n) {
  if (c->d->stopping) {
    finish_now(c->d, loans, n);
    return;
  }
  if (c->peer.pid <= 0) {
    sl_warn("a borrower left mid-loan and its process cannot be watched: restoring now");
    finish_now(c->d, loans, n);
    return;
  }
  sl_warn("borrower pid %d left mid-loan; its loan ends once the process has exited",
          (int)c->peer.pid);
  if (drain_after_exit(c, loans, n) != 0) {
    sl_error("out of memory watching pid %d: restoring now", (int)c->peer.pid);
    finish_now(c->d, loans, n);
  }
}

void sl_handle_disconnect(struct sl_conn *c) {
  struct sl_daemon *d = c->d;
  struct sl_client_gone gone = {0};

  sl_waiters_cancel(c);
  while (c->ended != NULL) {
    struct sl_ended *e = c->ended;
    c->ended = e->next;
    free(e);
  }
  if (c->client_id != 0 && sl_books_client_remove(d->books, c->client_id, &gone) == 0) {
    for (size_t i = 0; i < gone.nfree_regions; i++)
      sl_pool_region_destroy(d->pool, gone.free_regions[i]);
    if (gone.ndraining > 0)
      settle_borrower(c, gone.draining_loans, gone.ndraining);
    sl_client_gone_clear(&gone);
  }
  if (c->pidfd >= 0)
    close(c->pidfd);
  c->pidfd = -1;
}
