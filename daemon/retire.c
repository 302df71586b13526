/* retire.c - a region leaves: the clients that kept a window of it hear so (RegionGone), and
 * its pages are released once none of them holds them any more (books.h, kept windows).
 *
 * Until then the pool keeps the region's pages too, so that the device memory they take stays
 * counted (free memory, Status.held) on every backend: on a GPU the pages a borrower imported
 * stay allocated while it holds them whatever the daemon does.
 *
 * Releasing the pages of a large region (unmapping and releasing every one, a driver call
 * each: docs/benchmarks.md) is a job, off the loop; a RegionRelease is answered when it is
 * done, so that the memory is back by the time the client hears so. A small region is freed
 * on the loop.
 *
 * Floor 7 (daemon.h's floors).
 */
#include <stdlib.h>

#include "daemon.h"
#include "log.h"

struct free_job {
  struct sl_job job; /* first member */
  struct sl_pool_region *r;
  uint64_t req_id;   /* answered with Ok once freed, when job.conn is set */
};

static void free_run(struct sl_job *j) {
  sl_pool_region_free(j->d->pool, ((struct free_job *)j)->r); /* NULL: nothing (see below) */
}

static void free_done(struct sl_job *j) {
  struct free_job *fj = (struct free_job *)j;

  if (j->conn != NULL) {
    sl_conn_send_ok(j->conn, fj->req_id);
    sl_conn_resume(j->conn);
  }
  free(fj);
}

/* Regions up to this size are freed on the loop when no job is queued (a few ms on a GPU):
 * then the memory is back before anything that follows is answered, the end of a dead owner's
 * loan included. Larger ones go to a job (their release holds the loop too long). */
#define FREE_INLINE_BYTES (256ull << 20)

/* Frees r, off the loop unless small (or where not even the job can be had); answers c's
 * request then. r NULL: a job still holds the region (the map of its pages, a growth, a
 * transfer), which frees it at its end; the answer is a job of its own behind it, since jobs
 * end in order (jobs.c), so that the memory is back when the client hears so here too (a
 * RegionRelease just after RegionCreated used to be answered while the map still ran, and
 * the free memory the client read next was short by the region). */
static void free_pages(struct sl_daemon *d, struct sl_pool_region *r, struct sl_conn *c,
                       uint64_t req_id) {
  struct free_job *fj = NULL;

  if (r == NULL || !(sl_jobs_idle(d) && sl_pool_region_bytes(d->pool, r) <= FREE_INLINE_BYTES))
    fj = calloc(1, sizeof(*fj));
  if (fj == NULL) {
    sl_pool_region_free(d->pool, r);
    if (c != NULL)
      sl_conn_send_ok(c, req_id);
    return;
  }
  fj->r = r;
  fj->req_id = req_id;
  fj->job.run = free_run;
  fj->job.done = free_done;
  fj->job.conn = c;
  sl_jobs_submit(d, &fj->job);
}

static void send_gone(struct sl_conn *c, uint64_t region_id) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__RegionGone g = SUBLET__REGION_GONE__INIT;

  g.region = region_id;
  rep.id = 0; /* a notice, never an answer (PROTOCOL.md, Notices) */
  rep.body_case = SUBLET__REPLY__BODY_REGION_GONE;
  rep.region_gone = &g;
  sl_conn_send(c, &rep, NULL, 0);
}

void sl_retire_region_for(struct sl_daemon *d, uint64_t region_id, struct sl_conn *answer,
                          uint64_t req_id) {
  size_t holders = sl_books_kept_holders(d->books, region_id), told = 0;
  struct sl_pool_region *r = holders == 0 ? sl_pool_region_take(d->pool, region_id) : NULL;

  sl_releases_prune(d); /* the region's releases left the books with it */
  sl_pins_regions_changed(d);
  if (r != NULL || (holders == 0 && answer != NULL)) {
    free_pages(d, r, answer, req_id);
    return;
  }
  if (answer != NULL)
    sl_conn_send_ok(answer, req_id); /* freed later: by its last holder */
  if (holders == 0)
    return;
  for (struct sl_conn *c = d->conns; c != NULL; c = c->next) {
    if (c->client_id == 0 || !sl_books_kept_holds(d->books, c->client_id, region_id))
      continue;
    send_gone(c, region_id);
    told++;
  }
  sl_info("region %llu gone: its pages go once %zu client(s) that kept its window let go",
          (unsigned long long)region_id, told);
}

void sl_retire_region(struct sl_daemon *d, uint64_t region_id) {
  sl_retire_region_for(d, region_id, NULL, 0);
}
