/* endings.c - how loans end on the device, and what a client leaves when it goes.
 *
 * A loan ends when its borrower returns it, or when the borrower's connection goes: then only
 * once the borrower's process has fully exited (its GPU work may run until then), watched with
 * a pidfd. Either way the kept bytes come back before the owner hears of it. When the borrower
 * is another user than the owner, the pages it was granted get fresh pages first (books.h),
 * the kept bytes are restored into those, and the owner hears which to map.
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon.h"
#include "log.h"

/* A loan's end on the device: its kept bytes copied back (off the loop), then the rest. */
struct end_job {
  struct sl_job job; /* first member */
  struct sl_loan_end end;
  size_t replaced;   /* of end.replace: written by the transfer's run */
  sl_loan_answer_fn answer;
  void *arg;
};

/* The kept bytes are back (or could not be, rc): the books learn which pages are new, the
 * owner is told (with them, to map them where the old ones were), the request that ended the
 * loan answered. */
static void end_finish(struct sl_daemon *d, struct end_job *ej, int rc, const char *why,
                       double seconds, double move_seconds, struct sl_conn *c) {
  struct sl_loan_end *end = &ej->end;
  char size[16];

  if (rc != 0) {
    sl_error("loan %llu: restoring kept bytes failed: %s", (unsigned long long)end->loan_id,
             why);
    end->stats.copied_in_bytes = 0; /* nothing came back: the owner's client reports it */
  }
  end->stats.move_seconds = d->move_seconds + move_seconds;
  if (end->nreplace > 0)
    sl_books_pages_replaced(d->books, end, ej->replaced);
  end->stats.replaced_pages = ej->replaced;
  if (end->free_region)
    sl_retire_region(d, end->region_id);
  /* Before the owner hears: all is back. Not in fresh pages the owner has yet to map: if the
   * daemon dies before it has, its library restores from the save area, as mid-loan. */
  sl_rescue_end(d, end->loan_id, rc == 0 && ej->replaced == 0);
  end->stats.copy_in_seconds = seconds;
  end->stats.copy_out_seconds = d->copy_out_seconds;
  sl_info("loan %llu ended: %s copied out and back%s", (unsigned long long)end->loan_id,
          sl_format_size(size, end->stats.copied_out_bytes),
          end->stats.borrower_died ? " (the borrower died)" : "");
  if (ej->replaced > 0)
    sl_info("loan %llu: %zu pages the borrower (uid %u) was granted were replaced by fresh "
            "ones", (unsigned long long)end->loan_id, ej->replaced, (unsigned)end->borrower_uid);
  sl_waiters_loan_ended(d, &end->stats, end->owner_client, end->replace, ej->replaced);
  if (ej->answer != NULL)
    ej->answer(c, ej->arg, &end->stats);
  sl_loan_end_clear(end);
}

static void end_restored(struct sl_job *j) {
  struct end_job *ej = (struct end_job *)j;
  struct sl_conn *c = j->conn;

  end_finish(j->d, ej, j->rc, j->err.msg, j->seconds, j->move_seconds, c);
  if (c != NULL)
    sl_conn_resume(c);
  free(ej);
}

/* The device work of the end: fresh pages for the borrower's (another user's), then the kept
 * bytes back; *t stays NULL when there is none. */
static int end_transfer(struct sl_daemon *d, struct end_job *ej, struct sl_pool_transfer **t,
                        struct sl_err *err) {
  const struct sl_loan_end *end = &ej->end;
  int rc;

  *t = NULL;
  if (end->nrestore + end->nunmove + end->nreplace == 0)
    return 0;
  rc = sl_pool_transfer_new(d->pool, SL_COPY_TO_DEVICE, end->region_id, end->restore,
                            end->nrestore, end->unmove, end->nunmove, t, err);
  if (rc == 0 && end->nreplace > 0)
    rc = sl_pool_transfer_replace(*t, end->replace, end->nreplace, &ej->replaced, err);
  if (rc != 0) {
    sl_pool_transfer_free(*t);
    *t = NULL;
  }
  return rc;
}

/* A small end, on the loop (sl_jobs_inline). */
static void end_now(struct sl_daemon *d, struct end_job *ej, struct sl_conn *c) {
  struct sl_pool_transfer *t = NULL;
  struct sl_err err = {0};
  double copy = 0, move = 0;
  int rc = end_transfer(d, ej, &t, &err);

  if (rc == 0 && t != NULL)
    rc = sl_pool_transfer_run(t, &copy, &move, &err);
  sl_pool_transfer_free(t);
  end_finish(d, ej, rc, err.msg, copy, move, c);
  free(ej);
}

/* What the end costs on the device, in bytes, for sl_jobs_inline. */
static uint64_t end_bytes(const struct sl_daemon *d, const struct sl_loan_end *end) {
  return end->stats.copied_in_bytes + end->stats.moved_bytes +
         end->nreplace * sl_device_info(d->dev)->page_size;
}

/* The borrower is done with the loan's fresh memory (it returned, or its process is gone):
 * it goes first, which makes room for the fresh pages of the end. */
static void release_fresh(struct sl_daemon *d, struct sl_loan_end *end) {
  for (size_t i = 0; i < end->nfresh; i++)
    sl_pool_chunk_release(d->pool, end->fresh_chunks[i]);
  end->nfresh = 0;
}

void sl_loan_end_start(struct sl_daemon *d, struct sl_loan_end *end, struct sl_conn *c,
                       sl_loan_answer_fn answer, void *arg) {
  struct end_job *ej = calloc(1, sizeof(*ej));

  release_fresh(d, end);
  if (ej == NULL) { /* cannot even queue it: the owner hears that nothing came back */
    sl_error("loan %llu: out of host memory for its restore", (unsigned long long)end->loan_id);
    end->stats.copied_in_bytes = 0;
    if (end->nreplace > 0)
      sl_books_pages_replaced(d->books, end, 0);
    sl_waiters_loan_ended(d, &end->stats, end->owner_client, NULL, 0);
    if (answer != NULL)
      answer(c, arg, &end->stats);
    sl_loan_end_clear(end);
    return;
  }
  ej->end = *end; /* the job owns the end's arrays now */
  memset(end, 0, sizeof(*end));
  ej->answer = answer;
  ej->arg = arg;
  if (sl_jobs_inline(d, end_bytes(d, &ej->end))) {
    end_now(d, ej, c);
    return;
  }
  ej->job.done = end_restored;
  ej->job.conn = c;
  ej->job.rc = end_transfer(d, ej, &ej->job.transfer, &ej->job.err);
  sl_job_submit(d, &ej->job);
}

int sl_loan_ending(const struct sl_daemon *d, uint64_t loan_id, uint64_t owner_client) {
  for (const struct sl_job *j = d->jobs; j != NULL; j = j->next) {
    const struct end_job *ej = (const struct end_job *)j;
    if (j->done == end_restored && ej->end.loan_id == loan_id &&
        (owner_client == 0 || ej->end.owner_client == owner_client))
      return 1;
  }
  return 0;
}

/* Ends loans whose borrower is gone: kept bytes restored, the owner told. When the daemon is
 * going away, a loan whose owner can restore itself is left to it instead: the borrower's
 * process may still touch the pages (it lets go once it sees the daemon go, or exits), which
 * the owner's library waits for and the daemon cannot (it would have to outstay it). */
static void finish_now(struct sl_daemon *d, const uint64_t *loans, size_t n) {
  for (size_t i = 0; i < n; i++) {
    struct sl_loan_end end = {0};
    if (d->stopping && sl_rescue_has(d, loans[i])) {
      sl_info("loan %llu is left to its owner's library: it restores the kept bytes from the "
              "save area once the borrower has let go", (unsigned long long)loans[i]);
      continue;
    }
    if (sl_books_loan_finish(d->books, loans[i], &end) == 0)
      sl_loan_end_start(d, &end, NULL, NULL, NULL);
  }
  sl_waiters_device_free(d); /* the next owner in line lends */
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
    return SUBLET_ENOHOSTMEM;
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
    sl_ended_free(e);
  }
  if (c->client_id != 0 && sl_books_client_remove(d->books, c->client_id, &gone) == 0) {
    for (size_t i = 0; i < gone.nfree_regions; i++)
      sl_retire_region(d, gone.free_regions[i]);
    if (gone.ndraining > 0)
      settle_borrower(c, gone.draining_loans, gone.ndraining);
    sl_client_gone_clear(&gone);
  }
  sl_rescue_prune(d);
  if (c->pidfd >= 0)
    close(c->pidfd);
  c->pidfd = -1;
  sl_waiters_device_free(d); /* its offer withdrawn, or its Lend first in line gone */
}
