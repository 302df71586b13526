/* allocs.c - a borrower's Alloc in subletd: the books plan the grant, the pool makes its
 * fresh chunk and empties the kept pages it reaches (their kept bytes moved or saved: on the
 * loop when small, else off it with the connection paused), the books commit it. handlers.c
 * dispatches it here.
 *
 * Floor 5 (daemon.h's floors).
 */
#include <stdlib.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"

/* An allocation that reaches kept pages: answered once their kept bytes are moved or saved. */
struct alloc_job {
  struct sl_job job; /* first member: the job is the alloc_job */
  uint64_t req_id;
  struct sl_grant g;
  int fd;            /* the fresh chunk's export, or -1 */
  size_t journaled;  /* the grant's journal entries, written while the job runs */
  int journal_rc;    /* ... or why they could not be (journal_err) */
  struct sl_err journal_err;
};

static void reply_allocated(struct sl_conn *c, uint64_t id, const struct sl_grant *g, int fd) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Allocated a = SUBLET__ALLOCATED__INIT;

  a.alloc = g->alloc_id;
  a.pos = g->pos;
  a.pages = g->npages;
  a.has_fresh_pos = a.has_fresh_pages = g->fresh_npages > 0;
  a.fresh_pos = g->fresh_pos;
  a.fresh_pages = g->fresh_npages;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_ALLOCATED;
  rep.allocated = &a;
  sl_conn_send(c, &rep, &fd, fd >= 0 ? 1 : 0);
}

/* The device work is done (or failed): commit the grant (its journal entries, journaled, were
 * written) and answer, or undo it. */
static int alloc_finish(struct sl_daemon *d, struct sl_conn *c, uint64_t id, struct sl_grant *g,
                        int fd, size_t journaled, int rc, struct sl_err *err) {
  if (rc == 0 && c == NULL)
    rc = SUBLET_EPIPE; /* the borrower went while its kept pages were saved */
  if (rc == 0) /* journaled before the pages are lent: the owner can undo what they lose */
    sl_rescue_emptied_commit(d, g->loan_id, journaled);
  if (rc == 0 && (rc = sl_books_alloc_commit(d->books, g)) != 0)
    rc = sl_err_set(err, rc, "internal error: an allocation's plan went stale");
  if (rc == 0)
    reply_allocated(c, id, g, fd);
  else
    sl_books_alloc_release(d->books, g);
  if (rc != 0 && g->fresh_npages > 0)
    sl_pool_chunk_release(d->pool, g->fresh_chunk_id);
  if (fd >= 0)
    close(fd);
  sl_grant_clear(g);
  return rc;
}

static void alloc_saved(struct sl_job *j) {
  struct alloc_job *aj = (struct alloc_job *)j;
  struct sl_conn *c = j->conn;
  int rc;

  sl_books_loan_time(j->d->books, aj->g.loan_id, j->seconds, j->move_seconds);
  if (j->rc == 0 && aj->journal_rc != 0) {
    j->rc = aj->journal_rc;
    j->err = aj->journal_err;
  }
  rc = alloc_finish(j->d, c, aj->req_id, &aj->g, aj->fd, aj->journaled, j->rc, &j->err);
  if (c != NULL && rc != 0)
    sl_conn_send_error(c, aj->req_id, &j->err);
  if (c != NULL)
    sl_conn_resume(c);
  free(aj);
}

/* Holds the grant's positions in the books and saves its kept bytes off the loop. */
static int alloc_save(struct sl_req *x, struct sl_grant *g, int fd) {
  struct alloc_job *aj = calloc(1, sizeof(*aj));
  struct sl_loan_info li;
  int rc;

  if (aj == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  sl_books_loan_info(x->d->books, g->loan_id, &li);
  rc = sl_pool_transfer_new(x->d->pool, SL_COPY_TO_HOST, li.region_id, g->save, g->nsave,
                            g->move, g->nmove, &aj->job.transfer, &x->err);
  if (rc == 0)
    rc = sl_books_alloc_hold(x->d->books, g, &x->err);
  if (rc != 0) {
    sl_pool_transfer_free(aj->job.transfer);
    free(aj);
    return rc;
  }
  aj->req_id = x->id;
  aj->g = *g; /* the job owns the grant's arrays now */
  aj->fd = fd;
  aj->job.done = alloc_saved;
  aj->job.conn = x->c;
  sl_jobs_submit(x->d, &aj->job);
  /* The loop writes the entries while the job moves and saves (2 to 3 ms for 124,000 moves:
   * the journal's fresh pages), and commits them when it is done. */
  aj->journal_rc = sl_rescue_emptied_write(x->d, &aj->g, &aj->journaled, &aj->journal_err);
  return 0;
}

/* A small emptying of kept pages, on the loop (sl_jobs_inline): moves first (they fill holes
 * of pages that stay unlent), then saves (which may read bytes a move just wrote). A failure
 * leaves the kept bytes where they were: nothing was granted, and moved copies are copies. */
static int empty_now(struct sl_req *x, const struct sl_grant *g) {
  struct sl_pool_transfer *t = NULL;
  struct sl_loan_info li;
  double copy = 0, move = 0;
  int rc;

  sl_books_loan_info(x->d->books, g->loan_id, &li);
  rc = sl_pool_transfer_new(x->d->pool, SL_COPY_TO_HOST, li.region_id, g->save, g->nsave,
                            g->move, g->nmove, &t, &x->err);
  if (rc == 0)
    rc = sl_pool_transfer_run(t, &copy, &move, &x->err);
  sl_pool_transfer_free(t);
  sl_books_loan_time(x->d->books, g->loan_id, copy, move);
  return rc;
}

/* Where a long keep's Alloc spends the loop, for --log-level debug (issue 23's notes). */
static void log_plan(const struct sl_grant *g, double plan_s, double chunk_s) {
  if (g->nmove + g->nsave > 0)
    sl_debug("alloc %llu: planned in %.3f ms (%zu moves, %zu saves), its fresh chunk of %llu "
             "pages made in %.3f ms", (unsigned long long)g->alloc_id, 1e3 * plan_s, g->nmove,
             g->nsave, (unsigned long long)g->fresh_npages, 1e3 * chunk_s);
}

/* Plan, do, commit: the books plan the grant, the pool makes the fresh chunk and (off the
 * loop, unless small) saves the kept bytes, the books commit it. */
int sl_allocs_alloc(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Alloc *m = r->alloc;
  struct sl_grant g = {0};
  double t0 = sl_clock_now(), t1, t2;
  size_t journaled = 0;
  int fd = -1, rc;

  rc = sl_books_alloc_plan(x->d->books, x->c->client_id, m->size, &g, &x->err);
  t1 = sl_clock_now();
  if (rc == 0 && g.fresh_npages > 0)
    rc = sl_pool_chunk_create(x->d->pool, g.fresh_chunk_id, g.fresh_npages, &fd, &x->err);
  t2 = sl_clock_now();
  if (rc == 0)
    log_plan(&g, t1 - t0, t2 - t1);
  if (rc == 0 && g.nsave + g.nmove > 0 && sl_jobs_inline(x->d, g.save_bytes + g.move_bytes)) {
    rc = empty_now(x, &g);
  } else if (rc == 0 && g.nsave + g.nmove > 0) {
    rc = alloc_save(x, &g, fd);
    if (rc == 0)
      return 0; /* answered once the save is done */
  }
  if (rc != 0) {
    if (fd >= 0) {
      close(fd);
      sl_pool_chunk_release(x->d->pool, g.fresh_chunk_id);
    }
    sl_grant_clear(&g);
    return rc;
  }
  rc = sl_rescue_emptied_write(x->d, &g, &journaled, &x->err);
  return alloc_finish(x->d, x->c, x->id, &g, fd, journaled, rc, &x->err);
}
