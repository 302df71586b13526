/* releases.c - subletd's releases: Lend.release gives a region's pages back to the device's
 * driver, Resume makes them again (docs/design/release.md; the books' side is books_release.c).
 *
 * A release is two jobs off the loop, its connection paused meanwhile: the draft (the keep
 * sorted and merged, the layout: long lists take tens of ms), then the device work (kept bytes
 * moved into the pages that stay, the rest saved, the released pages let go of). Until the
 * client hears Released and unmaps them, its own mapping holds the pages: nothing is lost if
 * anything dies before. A resume is one job: the pages made again (all or none), the saves
 * copied back, the moves undone; the client maps the new pages once it hears Resumed. An
 * early resume (Resume.early) is two: Resumed comes once the first has made the pages, and
 * the connection reads on, so that the owner fetches and maps them while the second copies;
 * then it asks for the end (ResumeEnd), answered when that job is done. Its live release
 * stays until then.
 *
 * Each live release has its own save area (pool.h: a spare of its user's when there is one),
 * whose fd goes to the owner with Released (read-only), with the plan, so that its library
 * can put the kept bytes back itself if subletd dies.
 *
 * Floor 5 (daemon.h's floors).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"

struct release_job;

/* The daemon's side of a live release: its save area, and its resume's job while one runs
 * (an early one's until its owner has heard the end). */
struct sl_live_release {
  uint64_t id;
  struct sl_pool_area *area;
  int area_fd;                 /* the area's (not owned): an increment sends it again */
  struct release_job *resuming;
  struct sl_live_release *next;
};

struct release_job {
  struct sl_job job; /* first member */
  uint64_t req_id, region, npages, stay;
  int by_need;       /* Lend.need_bytes: a release by need (books.h, sl_release_need) */
  uint64_t need_bytes;
  struct sl_lend_lists lists; /* the Lend's, for the draft */
  struct sl_loan *draft;
  struct sl_release_work work;
  struct sl_pool_transfer *transfer; /* run by the job's run, not by jobs.c: a release drops
                                        pages after it */
  size_t made;       /* a resume's pages made again: written by the run */
  struct sl_pool_area *area;
  int area_fd;       /* the area's (not owned) */
  double t0;
  int early;         /* an early resume: 1 while its pages are made, 2 while it copies */
  int ended;         /* ... and its copies are done */
  uint64_t end_req;  /* its ResumeEnd's request, once one waits (job.conn its connection) */
};

static void job_free(struct release_job *rj);

static struct sl_live_release **live_link(struct sl_daemon *d, uint64_t id) {
  struct sl_live_release **link = &d->releases;

  while (*link != NULL && (*link)->id != id)
    link = &(*link)->next;
  return link;
}

size_t sl_releases_of_user(struct sl_daemon *d, uid_t uid) {
  size_t n = 0;

  for (struct sl_live_release *lr = d->releases; lr != NULL; lr = lr->next)
    n += lr->area != NULL && sl_pool_area_uid(lr->area) == uid;
  return n;
}

/* Unlinks release id's record, the caller's now (NULL: none). */
static struct sl_live_release *live_take(struct sl_daemon *d, uint64_t id) {
  struct sl_live_release **link = live_link(d, id), *lr = *link;

  if (lr != NULL)
    *link = lr->next;
  return lr;
}

/* The live releases the books no longer have (their region went, with its owner) give their
 * areas back. */
void sl_releases_prune(struct sl_daemon *d) {
  struct sl_live_release **link = &d->releases, *lr;
  struct sl_release_info ri;

  while ((lr = *link) != NULL) {
    if (sl_books_release_info(d->books, lr->id, &ri) == 0 ||
        (lr->resuming != NULL && !lr->resuming->ended)) { /* its job's end prunes it */
      link = &lr->next;
      continue;
    }
    *link = lr->next;
    if (lr->resuming != NULL) /* an early resume whose owner went before asking its end */
      job_free(lr->resuming);
    sl_pool_area_give(d->pool, lr->area);
    free(lr);
  }
}

uint64_t sl_releases_host_bytes(const struct sl_daemon *d) {
  uint64_t n = 0;

  for (const struct sl_live_release *lr = d->releases; lr != NULL; lr = lr->next)
    n += sl_pool_area_bytes(lr->area);
  return n;
}

static void job_free(struct release_job *rj) {
  sl_pool_transfer_free(rj->transfer);
  sl_lend_lists_clear(&rj->lists);
  sl_books_draft_free(rj->draft);
  sl_release_work_clear(&rj->work);
  if (rj->area != NULL)
    sl_pool_area_give(rj->job.d->pool, rj->area);
  free(rj);
}

/* Answers the request with err and ends the job (its connection reads again). */
static void job_fail(struct release_job *rj, const struct sl_err *err) {
  struct sl_conn *c = rj->job.conn;

  if (c != NULL) {
    sl_conn_send_error(c, rj->req_id, err);
    sl_conn_resume(c);
  }
  job_free(rj);
}

/* ---- the reply ---------------------------------------------------------------------------- */

/* (first, count) pairs of an ascending page list; *n pairs' worth of uint64s. */
static uint64_t *page_runs(const uint64_t *pages, size_t npages, size_t *n) {
  uint64_t *runs = malloc((2 * npages + 2) * sizeof(*runs));
  size_t m = 0;

  if (runs == NULL)
    return NULL;
  for (size_t i = 0; i < npages; i++) {
    if (m > 0 && runs[m - 2] + runs[m - 1] == pages[i]) {
      runs[m - 1]++;
      continue;
    }
    runs[m++] = pages[i];
    runs[m++] = 1;
  }
  *n = m;
  return runs;
}

/* The triples of moves (src, dst, len) and copies (dev, host, len) flattened for the wire. */
static uint64_t *triples(const void *v, size_t n) {
  uint64_t *t = malloc((3 * n + 1) * sizeof(*t));

  if (t != NULL && n > 0)
    memcpy(t, v, 3 * n * sizeof(*t));
  return t;
}

/* The plan a Released carries: the release's own moves and saves (a release's work; an
 * increment's reply: the release's whole plan, books.h sl_books_release_plan). */
struct reply_plan {
  const struct sl_move *moves;
  size_t nmoves;
  const struct sl_copy *saves;
  size_t nsaves;
  uint64_t released_pages;     /* the release's in all (w->released: the increment's) */
};

static int reply_plan_stats(struct release_job *rj, Sublet__Reply__BodyCase body, int fd,
                            const struct reply_plan *plan) {
  const struct sl_release_work *w = &rj->work;
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__ReleaseStats m = SUBLET__RELEASE_STATS__INIT;
  uint64_t *runs, *moves = NULL, *saves = NULL;
  size_t nruns = 0;
  int save = body == SUBLET__REPLY__BODY_RELEASED;

  runs = page_runs(w->released, w->nreleased, &nruns);
  if (save) {
    moves = triples(plan->moves, plan->nmoves);
    saves = triples(plan->saves, plan->nsaves);
  }
  if (runs == NULL || (save && (moves == NULL || saves == NULL))) {
    free(runs);
    free(moves);
    free(saves);
    return SUBLET_ENOHOSTMEM;
  }
  m.release = w->release_id;
  m.region = w->region_id;
  m.released = runs;
  m.n_released = nruns;
  m.has_released_pages = m.has_stayed_pages = m.has_kept_bytes = m.has_moved_bytes = 1;
  m.released_pages = plan->released_pages;
  m.stayed_pages = w->stayed;
  m.has_held_pages = 1;
  m.held_pages = w->held;
  m.kept_bytes = w->kept_bytes;
  m.moved_bytes = w->moved_bytes;
  m.has_copied_out_bytes = m.has_move_seconds = 1;
  m.copied_out_bytes = w->saved_bytes;
  m.move_seconds = rj->job.move_seconds;
  if (save) {
    m.has_copy_out_seconds = 1;
    m.copy_out_seconds = rj->job.seconds;
    m.moves = moves;
    m.n_moves = 3 * plan->nmoves;
    m.saves = saves;
    m.n_saves = 3 * plan->nsaves;
  } else {
    m.groups = w->groups;
    m.n_groups = 2 * w->ngroups;
  }
  if (!save && !(rj->early && !rj->ended)) { /* the copies' figures: not an early first answer */
    m.has_copied_in_bytes = m.has_copy_in_seconds = 1;
    m.copied_in_bytes = w->saved_bytes;
    m.copy_in_seconds = rj->job.seconds;
    m.has_restored = 1;
    m.restored = rj->job.rc == 0;
  }
  rep.id = rj->req_id;
  rep.body_case = body;
  if (save)
    rep.released = &m;
  else
    rep.resumed = &m;
  sl_conn_send(rj->job.conn, &rep, fd >= 0 ? &fd : NULL, fd >= 0);
  free(runs);
  free(moves);
  free(saves);
  return 0;
}

static int reply_stats(struct release_job *rj, Sublet__Reply__BodyCase body, int fd) {
  const struct sl_release_work *w = &rj->work;
  struct reply_plan plan = {w->moves, w->nmoves, w->copies, w->ncopies, w->nreleased};

  return reply_plan_stats(rj, body, fd, &plan);
}

/* ---- releasing ---------------------------------------------------------------------------- */

static void release_run(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;

  j->rc = sl_pool_transfer_run(rj->transfer, &j->seconds, &j->move_seconds, &j->err);
  if (j->rc == 0 && rj->work.nreleased > 0)
    j->rc = sl_pool_transfer_drop(rj->transfer, rj->work.released, rj->work.nreleased, &j->err);
}

static void log_release(const struct release_job *rj, const char *what) {
  uint64_t ps = sl_device_info(rj->job.d->dev)->page_size;
  const struct sl_release_work *w = &rj->work;
  char a[16], b[16], c[16];

  sl_info("release %llu of region %llu %s: %s to the driver, %llu pages stay; %s moved, %s "
          "to the host, %.3f s", (unsigned long long)w->release_id,
          (unsigned long long)w->region_id, what, sl_format_size(a, w->nreleased * ps),
          (unsigned long long)w->stayed, sl_format_size(b, w->moved_bytes),
          sl_format_size(c, w->saved_bytes), sl_clock_now() - rj->t0);
}

/* Moved, saved and let go of: the release is live, the owner told (and given its area). */
static void release_done(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;
  struct sl_live_release *lr = NULL;
  struct sl_daemon *d = j->d;
  int fd = -1;

  sl_pool_transfer_free(rj->transfer);
  rj->transfer = NULL;
  sl_books_release_done(d->books, rj->work.release_id, j->rc == 0 && j->conn != NULL);
  sl_daemon_check_books(d, rj->req_id);
  if (j->rc != 0 || j->conn == NULL) {
    sl_releases_prune(d);
    if (j->rc != 0)
      sl_error("release %llu failed: %s", (unsigned long long)rj->work.release_id, j->err.msg);
    job_fail(rj, &j->err);
    return;
  }
  if ((lr = calloc(1, sizeof(*lr))) == NULL || (fd = sl_rescue_read_only_fd(rj->area_fd)) < 0 ||
      reply_stats(rj, SUBLET__REPLY__BODY_RELEASED, fd) != 0) {
    /* The pages are the driver's already: the release stays, the owner can still resume. */
    sl_error("release %llu: out of host memory for its reply", (unsigned long long)rj->work.release_id);
    sl_conn_close(j->conn);
  }
  if (fd >= 0)
    close(fd);
  if (lr != NULL) {
    *lr = (struct sl_live_release){.id = rj->work.release_id, .area = rj->area,
                                   .area_fd = rj->area_fd, .next = d->releases};
    d->releases = lr;
    rj->area = NULL;
  }
  log_release(rj, "done");
  sl_conn_resume(j->conn);
  job_free(rj);
}

/* The device's free bytes for a release by need: what the driver has, less what subletd is
 * making meanwhile (a region or fresh pages half made are not free to a taker) and less what
 * the driver keeps back from a taker's allocation (a cudaMalloc of every free byte fails: a
 * need counted against all of them left the taker short). */
static int release_free_bytes(struct sl_daemon *d, uint64_t *free_bytes, struct sl_err *err) {
  uint64_t withheld = d->building_bytes + sl_device_info(d->dev)->alloc_headroom;
  int rc = sl_device_free_bytes(d->dev, free_bytes, err);

  if (rc == 0)
    *free_bytes = *free_bytes > withheld ? *free_bytes - withheld : 0;
  return rc;
}

/* The draft is made: the release enters the books, then the device work is queued. */
static int release_begin(struct release_job *rj, struct sl_err *err) {
  struct sl_daemon *d = rj->job.d;
  struct sl_conn *c = rj->job.conn;
  const struct sl_release_work *w = &rj->work;
  struct sl_release_need need = {.need_bytes = rj->need_bytes};
  int rc = 0;

  /* Counted now, on the loop, so that the page choice matches the device as it is. */
  if (rj->by_need && (rc = release_free_bytes(d, &need.free_bytes, err)) != 0)
    return rc;
  rc = sl_books_release_begin(d->books, c->client_id, rj->region, rj->draft, rj->stay,
                              rj->by_need ? &need : NULL, &rj->work, err);
  if (rc != 0)
    return rc;
  rj->draft = NULL; /* the books' now */
  rc = sl_pool_area_take(d->pool, c->peer.uid, &rj->area, &rj->area_fd, err);
  if (rc == 0)
    rc = sl_pool_transfer_new_in(d->pool, rj->area, SL_COPY_TO_HOST, rj->region, w->copies,
                                 w->ncopies, w->moves, w->nmoves, &rj->transfer, err);
  if (rc != 0) {
    sl_books_release_done(d->books, w->release_id, 0);
    return rc;
  }
  return 0;
}

static void draft_run(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;

  j->rc = sl_lend_lists_draft(&rj->lists, sl_books_cfg(j->d->books), rj->npages, &rj->draft,
                              &j->err);
}

static void draft_done(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;
  struct sl_err err = j->err;

  if (j->conn == NULL) { /* the owner went: nothing to release */
    job_free(rj);
    return;
  }
  if (j->rc != 0 || release_begin(rj, &err) != 0) {
    job_fail(rj, &err);
    return;
  }
  j->rc = 0;
  j->run = release_run;
  j->done = release_done;
  sl_jobs_submit(j->d, j); /* the connection stays paused: it is the job's again */
}

static int release_start(struct sl_conn *c, uint64_t id, Sublet__Lend *m, int *keep_fd,
                         struct sl_err *err) {
  struct release_job *rj;
  uint64_t npages;
  int rc = sl_books_may_release(c->d->books, c->client_id, m->region, &npages, err);

  if (rc != 0)
    return rc;
  if ((rj = calloc(1, sizeof(*rj))) == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  rj->req_id = id;
  rj->region = m->region;
  rj->npages = npages;
  rj->stay = m->has_stay_pages ? m->stay_pages : UINT64_MAX;
  rj->by_need = m->has_need_bytes;
  rj->need_bytes = m->need_bytes;
  rj->t0 = sl_clock_now();
  sl_lend_lists_take(&rj->lists, m, keep_fd);
  rj->job.run = draft_run;
  rj->job.done = draft_done;
  rj->job.conn = c;
  if (sl_jobs_submit_host(c->d, &rj->job, c->peer.uid, sl_lend_lists_bytes(&rj->lists),
                          err) != 0) {
    job_free(rj);
    return err->code;
  }
  return 0;
}

/* A Lend with release, routed here by handlers.c: no waiting, a release does not take the
 * device's one loan. */
int sl_releases_lend(struct sl_req *x, const Sublet__Request *r) {
  Sublet__Lend *m = r->lend;
  char name[SL_LOAN_NAME_SIZE];
  int rc = sl_lend_lists_check(m, x->keep_fd, name, &x->err);

  if (rc != 0)
    return rc;
  return release_start(x->c, x->id, m, &x->keep_fd, &x->err);
}

/* ---- more by need ----------------------------------------------------------------------- */

/* An increment is in the books (and, with device work, done): its owner hears Released, the
 * pages this request released, the release's whole plan and figures, and the area again. */
static int more_reply(struct release_job *rj, struct sl_live_release *lr) {
  struct sl_daemon *d = rj->job.d;
  struct reply_plan plan;
  struct sl_release_info ri;
  int fd, rc;

  if (lr == NULL || sl_books_release_info(d->books, rj->work.release_id, &ri) != 0 ||
      sl_books_release_plan(d->books, rj->work.release_id, &plan.moves, &plan.nmoves,
                            &plan.saves, &plan.nsaves) != 0)
    return SUBLET_ENOENT;
  plan.released_pages = ri.released_pages;
  if ((fd = sl_rescue_read_only_fd(lr->area_fd)) < 0)
    return SUBLET_ENOHOSTMEM;
  rc = reply_plan_stats(rj, SUBLET__REPLY__BODY_RELEASED, fd, &plan);
  close(fd);
  return rc;
}

/* The increment's device work is over: the books take it (or, failed, it is as it was). */
static void more_done(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;
  struct sl_daemon *d = j->d;

  sl_pool_transfer_free(rj->transfer);
  rj->transfer = NULL;
  /* Its pages were let go of once the run succeeded, owner or not. */
  sl_books_release_done(d->books, rj->work.release_id, j->rc == 0);
  sl_daemon_check_books(d, rj->req_id);
  if (j->rc != 0 || j->conn == NULL) {
    if (j->rc != 0)
      sl_error("more of release %llu failed: %s", (unsigned long long)rj->work.release_id,
               j->err.msg);
    sl_releases_prune(d);
    job_fail(rj, &j->err);
    return;
  }
  if (more_reply(rj, *live_link(d, rj->work.release_id)) != 0) {
    sl_error("more of release %llu: no reply", (unsigned long long)rj->work.release_id);
    sl_conn_close(j->conn); /* the pages are the driver's: the owner resumes all the same */
  }
  log_release(rj, "made larger");
  sl_conn_resume(j->conn);
  job_free(rj);
}

/* The increment's device work into the release's own area, as a release's. */
static int more_job(struct sl_conn *c, struct release_job *rj, struct sl_err *err) {
  struct sl_daemon *d = c->d;
  struct sl_live_release *lr = *live_link(d, rj->work.release_id);
  const struct sl_release_work *w = &rj->work;
  int rc;

  if (lr == NULL)
    rc = sl_err_set(err, SUBLET_ENOENT, "internal error: release %llu has no save area",
                    (unsigned long long)w->release_id);
  else
    rc = sl_pool_transfer_new_in(d->pool, lr->area, SL_COPY_TO_HOST, w->region_id, w->copies,
                                 w->ncopies, w->moves, w->nmoves, &rj->transfer, err);
  if (rc != 0) {
    sl_books_release_done(d->books, w->release_id, 0);
    return rc;
  }
  rj->job.run = release_run;
  rj->job.done = more_done;
  rj->job.conn = c;
  sl_jobs_submit(d, &rj->job);
  return 0;
}

int sl_releases_more(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__ReleaseMore *m = r->release_more;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  struct sl_daemon *d = c->d;
  struct sl_release_need need = {.need_bytes = m->need_bytes};
  struct release_job *rj = calloc(1, sizeof(*rj));
  int rc = rj == NULL ? sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory")
                      : release_free_bytes(d, &need.free_bytes, err);

  if (rc == 0) {
    rj->lists.keep_fd = -1;
    rj->req_id = id;
    rj->t0 = sl_clock_now();
    rc = sl_books_release_more(d->books, c->client_id, m->release, &need, &rj->work, err);
    sl_daemon_check_books(d, id);
  }
  if (rc == 0 && !rj->work.done)
    return more_job(c, rj, err) == 0 ? 0 : (job_free(rj), err->code);
  if (rc == 0) { /* nothing for the device: answered now */
    rj->job.conn = c;
    rj->job.d = d;
    if (more_reply(rj, *live_link(d, rj->work.release_id)) != 0)
      rc = sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for the reply");
  }
  if (rj != NULL)
    job_free(rj);
  return rc;
}

/* ---- resuming ----------------------------------------------------------------------------- */

/* A resume's job runs its transfer: the pages made and the kept bytes put back, or (an early
 * resume) first the pages alone, then the kept bytes in a second run (early_made). */
static void resume_run(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;

  j->rc = sl_pool_transfer_run(rj->transfer, &j->seconds, &j->move_seconds, &j->err);
}

/* An early resume is over: the books and the live release let go of it, its owner hears the
 * end (c: the ResumeEnd's connection). Copies that failed leave the kept bytes to the owner
 * (Resumed.restored false): the area is not kept as a spare then, the owner reads it. */
static void early_finish(struct release_job *rj, struct sl_conn *c, uint64_t req_id) {
  struct sl_daemon *d = rj->job.d;
  struct sl_live_release *lr = live_take(d, rj->work.release_id);
  int restored = rj->job.rc == 0;

  sl_books_resume_done(d->books, rj->work.release_id, 1);
  sl_daemon_check_books(d, req_id);
  if (lr != NULL) {
    if (restored)
      rj->area = lr->area; /* back with the job, a spare */
    else
      sl_pool_area_drop(d->pool, lr->area);
    free(lr);
  }
  if (restored)
    log_release(rj, "resumed");
  else
    sl_error("release %llu: its kept bytes could not be put back (%s); its owner puts them "
             "back from the save area", (unsigned long long)rj->work.release_id, rj->job.err.msg);
  rj->req_id = req_id;
  rj->job.conn = c;
  if (reply_stats(rj, SUBLET__REPLY__BODY_RESUMED, -1) != 0)
    sl_conn_close(c);
  sl_conn_resume(c);
  job_free(rj);
}

/* An early resume's copies are done: its owner hears so now if its ResumeEnd waits, else when
 * it comes; if the owner went (the release left the books with its region), it ends here. */
static void early_done(struct release_job *rj) {
  struct sl_release_info ri;

  rj->ended = 1;
  if (rj->job.conn != NULL)
    early_finish(rj, rj->job.conn, rj->end_req);
  else if (sl_books_release_info(rj->job.d->books, rj->work.release_id, &ri) != 0)
    sl_releases_prune(rj->job.d); /* frees rj */
}

/* The transfer that puts release's kept bytes back (copies: 0 for none, the pages alone): its
 * copies go into the pages the resume made again (SL_COPY_TO_NEW_PAGES). */
static int restore_transfer(struct sl_daemon *d, struct release_job *rj, int copies,
                            struct sl_err *err) {
  const struct sl_release_work *w = &rj->work;
  struct sl_live_release *lr = *live_link(d, w->release_id);

  if (lr == NULL)
    return sl_err_set(err, SUBLET_ENOENT, "internal error: release %llu has no save area",
                      (unsigned long long)w->release_id);
  return sl_pool_transfer_new_in(d->pool, lr->area, SL_COPY_TO_NEW_PAGES, w->region_id,
                                 copies ? w->copies : NULL, copies ? w->ncopies : 0,
                                 copies ? w->moves : NULL, copies ? w->nmoves : 0,
                                 &rj->transfer, err);
}

/* An early resume's pages are made and the pool's table has them (its transfer settles them
 * as it goes): the owner hears Resumed and fetches them while the second run copies. */
static void early_made(struct release_job *rj) {
  struct sl_daemon *d = rj->job.d;
  struct sl_conn *c = rj->job.conn;

  sl_pool_transfer_free(rj->transfer);
  rj->transfer = NULL;
  sl_books_resume_made(d->books, rj->work.release_id);
  sl_daemon_check_books(d, rj->req_id);
  if (reply_stats(rj, SUBLET__REPLY__BODY_RESUMED, -1) != 0)
    sl_conn_close(c); /* the copies go on: their end finds no owner */
  sl_conn_resume(c);
  rj->job.conn = NULL;
  rj->early = 2;
  rj->job.seconds = rj->job.move_seconds = 0;
  rj->job.rc = restore_transfer(d, rj, 1, &rj->job.err); /* failed: the run is skipped */
  sl_jobs_submit(d, &rj->job);
}

static void resume_done(struct sl_job *j) {
  struct release_job *rj = (struct release_job *)j;
  struct sl_daemon *d = j->d;
  int ok = j->rc == 0 && rj->made == rj->work.nreleased;
  struct sl_live_release *lr = *live_link(d, rj->work.release_id);

  if (rj->early == 2) {
    early_done(rj);
    return;
  }
  if (rj->early == 1 && ok && j->conn != NULL) {
    early_made(rj);
    return;
  }
  if (lr != NULL)
    lr->resuming = NULL;
  sl_books_resume_done(d->books, rj->work.release_id, ok);
  sl_daemon_check_books(d, rj->req_id);
  if (ok && (lr = live_take(d, rj->work.release_id)) != NULL) {
    rj->area = lr->area; /* back with the job, a spare */
    free(lr);
  }
  if (ok)
    log_release(rj, "resumed");
  if (!ok || j->conn == NULL) {
    sl_releases_prune(d);
    job_fail(rj, &j->err);
    return;
  }
  if (reply_stats(rj, SUBLET__REPLY__BODY_RESUMED, -1) != 0)
    sl_conn_close(j->conn);
  sl_conn_resume(j->conn);
  job_free(rj);
}

static int resume_transfer(struct sl_daemon *d, struct release_job *rj, struct sl_err *err) {
  const struct sl_release_work *w = &rj->work;
  int rc = restore_transfer(d, rj, !rj->early, err);

  if (rc == 0 && w->groups != NULL)
    rc = sl_pool_transfer_make_groups(rj->transfer, w->groups, w->ngroups, &rj->made, err);
  else if (rc == 0)
    rc = sl_pool_transfer_replace_all(rj->transfer, w->released, w->nreleased, &rj->made, err);
  return rc;
}

int sl_releases_resume(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Resume *m = r->resume;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  struct sl_daemon *d = c->d;
  uint64_t ps = sl_device_info(d->dev)->page_size, avail = sl_daemon_free_pages(d, 0);
  struct release_job *rj = calloc(1, sizeof(*rj));
  char a[16], b[16];
  int rc;

  if (rj == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  rj->lists.keep_fd = -1;
  rj->early = m->has_early && m->early;
  rc = sl_books_resume_begin(d->books, c->client_id, m->release, m->has_groups && m->groups,
                             &rj->work, err);
  if (rc == 0 && rj->work.nreleased > avail)
    rc = sl_err_set(err, SUBLET_ENOMEM, "release %llu needs %s of device memory back and %s "
                    "is free: whoever took it must free it first; the release goes on (resume "
                    "again)", (unsigned long long)m->release,
                    sl_format_size(a, rj->work.nreleased * ps), sl_format_size(b, avail * ps));
  if (rc == 0)
    rc = resume_transfer(d, rj, err);
  if (rc != 0) {
    if (rj->work.release_id != 0)
      sl_books_resume_done(d->books, rj->work.release_id, 0);
    job_free(rj);
    return rc;
  }
  rj->req_id = id;
  rj->t0 = sl_clock_now();
  rj->job.run = resume_run;
  rj->job.done = resume_done;
  rj->job.conn = c;
  (*live_link(d, rj->work.release_id))->resuming = rj; /* restore_transfer found it */
  sl_jobs_submit(d, &rj->job);
  return 0;
}

int sl_releases_resume_end(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__ResumeEnd *m = r->resume_end;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  struct sl_live_release *lr = *live_link(c->d, m->release);
  struct release_job *rj = lr != NULL ? lr->resuming : NULL;
  struct sl_release_info ri;
  struct sl_region_info gi;

  /* another user's release is refused as a missing one, word for word (books_impl.h) */
  if (sl_books_release_info(c->d->books, m->release, &ri) != 0 ||
      sl_books_region_info(c->d->books, ri.region_id, &gi) != 0 ||
      !sl_peer_reaches(&c->peer, gi.owner.uid))
    return sl_err_set(err, SUBLET_ENOENT, "no release %llu (resumed already, or its region "
                      "has gone)", (unsigned long long)m->release);
  if (ri.owner_client != c->client_id)
    return sl_err_set(err, SUBLET_EPERM, "release %llu belongs to another client; only its "
                      "owner may end its resume", (unsigned long long)m->release);
  if (rj == NULL || rj->early != 2 || rj->job.conn != NULL)
    return sl_err_set(err, SUBLET_EBUSY, "release %llu is %s, not restoring after an early "
                      "Resume: ResumeEnd follows an early Resumed, once",
                      (unsigned long long)m->release, sl_books_release_state_name(ri.state));
  if (rj->ended) {
    early_finish(rj, c, id);
    return 0;
  }
  rj->job.conn = c; /* the connection waits, paused, until the copies are done (jobs.c) */
  rj->end_req = id;
  c->job = &rj->job;
  return 0;
}
