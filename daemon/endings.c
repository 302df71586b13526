/* endings.c - how loans end on the device, and what a client leaves when it goes.
 *
 * A loan ends when its borrower returns it, or when the borrower's connection goes: then only
 * once the borrower's process has fully exited (its GPU work may run until then), watched with
 * a pidfd. Either way the kept bytes come back before the owner hears of it. When the borrower
 * is another user than the owner, the pages it was granted get fresh pages first (books.h),
 * the kept bytes are restored into those, and the owner hears which to map.
 *
 * Never into the old ones (docs/design/isolation.md): that borrower may hold their fds for
 * good. subletd lets go of its own hold of the old ones first (pool_transfer.c: drop_old), so
 * the fresh ones never wait for memory only subletd held. When the device still lacks the
 * memory (other processes map the old pages, or hold the rest), the end stalls: nothing is
 * restored, the region stays getting fresh pages (no Lend, no PagesGet), the save area becomes
 * the end's alone, and the owner's Reclaim gets SUBLET_ENOMEM saying so. A timer tries again
 * while it waits; once the memory is there the end completes like any other.
 *
 * Floor 8 (daemon.h's floors).
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
  struct sl_pool_area *area; /* the save area it restores from, held (end.nreplace > 0) */
  sl_endings_answer_fn answer;
  void *arg;
  struct end_job *next_stalled;
};

/* Ends waiting for the memory of their fresh pages, and the timer that tries them again. */
struct sl_stalled {
  uv_timer_t timer;
  struct end_job *first;
};

#define SL_STALL_RETRY_MS 100

static int stall_keeps(struct sl_daemon *d, struct end_job *ej, const char *why,
                       struct sl_conn *c);
static void stalled_drop(struct sl_daemon *d, struct end_job *ej);
static void on_stall_tick(uv_timer_t *t);

/* The kept bytes are back (or could not be, rc): the books learn which pages are new, the
 * owner is told (with them, to map them where the old ones were), the request that ended the
 * loan answered. */
static int end_finish(struct sl_daemon *d, struct end_job *ej, int rc, const char *why,
                      double seconds, double move_seconds, struct sl_conn *c) {
  struct sl_loan_end *end = &ej->end;
  char size[16];
  int told;

  if (rc != 0 && end->nreplace > 0 && ej->replaced == 0) /* nothing was restored */
    return stall_keeps(d, ej, why, c);
  if (rc != 0) {
    sl_error("loan %llu: restoring kept bytes failed: %s", (unsigned long long)end->loan_id,
             why);
    end->stats.copied_in_bytes = 0; /* nothing came back: the owner's client reports it */
  }
  end->stats.move_seconds += move_seconds; /* the loan's own, then the way back's */
  if (end->nreplace > 0)
    sl_books_pages_replaced(d->books, end, ej->replaced);
  end->stats.replaced_pages = ej->replaced;
  if (end->free_region)
    sl_retire_region(d, end->region_id);
  /* Before the owner hears: all is back. Not in fresh pages the owner has yet to map: if the
   * daemon dies before it has, its library restores from the save area, as mid-loan. */
  sl_rescue_end(d, end->loan_id, rc == 0 && ej->replaced == 0);
  end->stats.copy_in_seconds = seconds;
  sl_info("loan %llu ended: %s copied out and back%s", (unsigned long long)end->loan_id,
          sl_format_size(size, end->stats.copied_out_bytes),
          end->stats.borrower_died ? " (the borrower died)" : "");
  if (ej->replaced > 0)
    sl_info("loan %llu: %zu pages the borrower (uid %u) was granted were replaced by fresh "
            "ones", (unsigned long long)end->loan_id, ej->replaced, (unsigned)end->borrower_uid);
  told = sl_waiters_loan_ended(d, &end->stats, end->owner_client, end->replace, ej->replaced);
  if (ej->answer != NULL)
    ej->answer(c, ej->arg, &end->stats);
  /* Until the owner has mapped its fresh pages, its library would restore from this area if
   * the daemon died: an owner that has not asked yet may take long, and no later loan may
   * save into the area meanwhile (one that asked maps them at once: the area stays). */
  if (ej->replaced > 0 && !told)
    sl_pool_area_detach(d->pool, ej->area);
  sl_pool_area_put(d->pool, ej->area);
  sl_loan_end_clear(end);
  return 0;
}

static void end_restored(struct sl_job *j) {
  struct end_job *ej = (struct end_job *)j;
  struct sl_conn *c = j->conn;
  int kept = end_finish(j->d, ej, j->rc, j->err.msg, j->seconds, j->move_seconds, c);

  if (c != NULL)
    sl_conn_resume(c);
  if (!kept)
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
  /* An end that may stall holds its area: it must outlast the wait, and no later loan of the
   * owner's user may save into it meanwhile (stall_keeps detaches it). */
  if (end->nreplace > 0 && ej->area == NULL) {
    if ((rc = sl_pool_host_reserve(d->pool, 0, err)) != 0)
      return rc;
    ej->area = sl_pool_area_hold(d->pool);
  }
  rc = ej->area != NULL
           ? sl_pool_transfer_new_in(d->pool, ej->area, SL_COPY_TO_DEVICE, end->region_id,
                                     end->restore, end->nrestore, end->unmove, end->nunmove, t,
                                     err)
           : sl_pool_transfer_new(d->pool, SL_COPY_TO_DEVICE, end->region_id, end->restore,
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
  if (!end_finish(d, ej, rc, err.msg, copy, move, c))
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

void sl_endings_start(struct sl_daemon *d, struct sl_loan_end *end, struct sl_conn *c,
                      sl_endings_answer_fn answer, void *arg) {
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
  sl_jobs_submit(d, &ej->job);
}

/* ---- ends that wait for fresh memory ------------------------------------------------------ */

static void stalled_link(struct sl_daemon *d, struct end_job *ej) {
  ej->next_stalled = d->stalled->first;
  d->stalled->first = ej;
  if (!uv_is_active((uv_handle_t *)&d->stalled->timer))
    uv_timer_start(&d->stalled->timer, on_stall_tick, SL_STALL_RETRY_MS, SL_STALL_RETRY_MS);
}

static void stalled_unlink(struct sl_daemon *d, struct end_job *ej) {
  struct end_job **link = &d->stalled->first;

  while (*link != NULL && *link != ej)
    link = &(*link)->next_stalled;
  if (*link != NULL)
    *link = ej->next_stalled;
  if (d->stalled->first == NULL)
    uv_timer_stop(&d->stalled->timer);
}

/* The owner's Reclaims of the loan hear why it has not ended, and (Error.awaits_fresh_pages)
 * that it waits for fresh pages: on CUDA the owner's own process maps the old ones until it
 * remaps, so its library lets go of them and asks again (client/region.c). */
static void tell_owner(struct sl_daemon *d, const struct end_job *ej, const char *why) {
  struct sl_err err = {0};

  sl_err_set(&err, SUBLET_ENOMEM, "loan %llu was returned, but its kept bytes are not back "
             "yet: %s", (unsigned long long)ej->end.loan_id, why);
  sl_waiters_reclaim_failed(d, ej->end.owner_client, ej->end.loan_id, &err, ej->end.nreplace);
}

/* An end of a loan to another user that restored nothing (its fresh pages could not all be
 * made): kept, to be tried again. The borrower's request (c's) is answered: its loan is over;
 * the owner hears that its kept bytes wait. Returns 1: ej is taken. When the daemon stops (or
 * has no host memory to wait with) it is dropped instead, nothing restored: the owner's
 * library restores from its journal, into fresh pages of its own (client/rescue.c). */
static int stall_keeps(struct sl_daemon *d, struct end_job *ej, const char *why,
                       struct sl_conn *c) {
  if (!d->stopping && d->stalled == NULL && (d->stalled = calloc(1, sizeof(*d->stalled))) != NULL)
    uv_timer_init(d->loop, &d->stalled->timer);
  sl_error("loan %llu: its kept bytes wait: %s", (unsigned long long)ej->end.loan_id, why);
  ej->end.stats.replaced_pages = 0;
  if (ej->answer != NULL)
    ej->answer(c, ej->arg, &ej->end.stats);
  ej->answer = NULL;
  tell_owner(d, ej, why);
  if (d->stalled == NULL || d->stopping) {
    stalled_drop(d, ej);
    return 1;
  }
  d->stalled->timer.data = d;
  sl_pool_area_detach(d->pool, ej->area);
  stalled_link(d, ej);
  return 1;
}

/* A stalled end no one waits for any more (its region is gone, or the daemon stops). */
static void stalled_drop(struct sl_daemon *d, struct end_job *ej) {
  sl_books_pages_replaced(d->books, &ej->end, 0);
  sl_rescue_end(d, ej->end.loan_id, 0);
  sl_pool_area_put(d->pool, ej->area);
  sl_loan_end_clear(&ej->end);
  free(ej);
}

/* Is there the memory for the end's fresh pages now? */
static int room_for(struct sl_daemon *d, const struct end_job *ej) {
  uint64_t free_bytes = 0;

  return sl_device_free_bytes(d->dev, &free_bytes, NULL) == 0 &&
         free_bytes / sl_device_info(d->dev)->page_size >= ej->end.nreplace;
}

static void stall_retry(struct sl_daemon *d, struct end_job *ej) {
  memset(&ej->job, 0, sizeof(ej->job));
  ej->replaced = 0;
  ej->job.done = end_restored;
  ej->job.rc = end_transfer(d, ej, &ej->job.transfer, &ej->job.err);
  sl_jobs_submit(d, &ej->job);
}

#define STILL_LACKS                                                                      \
  "the device still lacks the memory for fresh pages in place of the pages a borrower of "  \
  "another user was granted (subletd let go of those; processes that map them, or other "   \
  "memory, hold it); reclaim again once device memory is free"

static void on_stall_tick(uv_timer_t *t) {
  struct sl_daemon *d = t->data;
  struct sl_region_info ri;

  for (struct end_job *ej = d->stalled->first, *next; ej != NULL; ej = next) {
    next = ej->next_stalled;
    if (sl_books_region_info(d->books, ej->end.region_id, &ri) != 0) {
      stalled_unlink(d, ej);
      stalled_drop(d, ej); /* its owner released it, or left */
    } else if (room_for(d, ej)) {
      stalled_unlink(d, ej);
      stall_retry(d, ej); /* back here if it fails again */
    } else {
      tell_owner(d, ej, STILL_LACKS);
    }
  }
}

static void free_stalled(uv_handle_t *h) {
  free(h->data);
}

/* At shutdown: the owners' libraries restore from their journals, into fresh pages. */
static void stalled_free_all(struct sl_daemon *d) {
  if (d->stalled == NULL)
    return;
  while (d->stalled->first != NULL) {
    struct end_job *ej = d->stalled->first;
    stalled_unlink(d, ej);
    stalled_drop(d, ej);
  }
  d->stalled->timer.data = d->stalled;
  uv_close((uv_handle_t *)&d->stalled->timer, free_stalled);
  d->stalled = NULL;
}

static int stalled_has(const struct sl_daemon *d, uint64_t loan_id, uint64_t owner_client) {
  for (const struct end_job *ej = d->stalled != NULL ? d->stalled->first : NULL; ej != NULL;
       ej = ej->next_stalled)
    if (ej->end.loan_id == loan_id && (owner_client == 0 || ej->end.owner_client == owner_client))
      return 1;
  return 0;
}

/* A Reclaim that does not wait (timeout 0: an engine polling in its step loop), of a loan
 * whose end is stalled, hears why at once, with the fresh pages the end waits for, as a
 * waiting one hears at the next retry: otherwise a poller hears only "not ended yet", its
 * library never lets go of the granted pages, and the end waits for ever. Returns 1 when
 * it answered the request. */
int sl_endings_stalled_answer(struct sl_daemon *d, struct sl_conn *c, uint64_t req_id,
                              uint64_t loan_id) {
  struct sl_err err = {0};

  for (struct end_job *ej = d->stalled != NULL ? d->stalled->first : NULL; ej != NULL;
       ej = ej->next_stalled) {
    if (ej->end.loan_id != loan_id || ej->end.owner_client != c->client_id)
      continue;
    sl_err_set(&err, SUBLET_ENOMEM, "loan %llu was returned, but its kept bytes are not back "
               "yet: %s", (unsigned long long)loan_id, STILL_LACKS);
    sl_conn_send_error_fresh(c, req_id, &err, ej->end.nreplace);
    return 1;
  }
  return 0;
}

int sl_endings_pending(const struct sl_daemon *d, uint64_t loan_id, uint64_t owner_client) {
  for (const struct sl_job *j = d->jobs; j != NULL; j = j->next) {
    const struct end_job *ej = (const struct end_job *)j;
    if (j->done == end_restored && ej->end.loan_id == loan_id &&
        (owner_client == 0 || ej->end.owner_client == owner_client))
      return 1;
  }
  return stalled_has(d, loan_id, owner_client);
}

/* Ends loans whose borrower is gone: kept bytes restored, the owner told. When the daemon is
 * going away, a loan whose owner can restore itself is left to it instead: the borrower's
 * process may still touch the pages (it lets go once it sees the daemon go, or exits), which
 * the owner's library waits for and the daemon cannot (it would have to outstay it). A
 * borrower of another user is not waited for: the owner's library gives the pages it was
 * granted fresh memory of its own first (client/rescue.c), since the daemon's fresh pages
 * would die with it. */
static void finish_now(struct sl_daemon *d, const uint64_t *loans, size_t n) {
  for (size_t i = 0; i < n; i++) {
    struct sl_loan_end end = {0};
    if (d->stopping && sl_rescue_has(d, loans[i])) {
      sl_info("loan %llu is left to its owner's library: it restores the kept bytes from the "
              "save area once the borrower has let go (or, another user's, into fresh pages)",
              (unsigned long long)loans[i]);
      continue;
    }
    if (sl_books_loan_finish(d->books, loans[i], &end) == 0)
      sl_endings_start(d, &end, NULL, NULL, NULL);
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

void sl_endings_shutdown(struct sl_daemon *d) {
  stalled_free_all(d);
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

void sl_endings_disconnect(struct sl_conn *c) {
  struct sl_daemon *d = c->d;
  struct sl_client_gone gone = {0};

  sl_waiters_cancel(c);
  while (c->ended != NULL) {
    struct sl_ended *e = c->ended;
    c->ended = e->next;
    sl_waiters_ended_free(e);
  }
  if (c->client_id != 0 && sl_books_client_remove(d->books, c->client_id, &gone) == 0) {
    for (size_t i = 0; i < gone.nfree_regions; i++)
      sl_retire_region(d, gone.free_regions[i]);
    if (gone.ndraining > 0)
      settle_borrower(c, gone.draining_loans, gone.ndraining);
    sl_client_gone_clear(&gone);
  }
  sl_rescue_prune(d, sl_endings_pending);
  if (c->pidfd >= 0)
    close(c->pidfd);
  c->pidfd = -1;
  sl_waiters_device_free(d); /* its offer withdrawn, or its Lend first in line gone */
}
