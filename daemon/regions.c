/* regions.c - subletd's region requests: RegionCreate, RegionGrow, PagesGet, RegionRelease and
 * Dropped (handlers.c dispatches them here).
 *
 * Creating or growing a region's pages takes the device seconds for tens of GiB (2 s for 64 GiB
 * on an H200, most of it mapping them in the daemon): a job, off the loop, with the connection
 * paused meanwhile (its owner can neither lend nor release the region until it is done). A new
 * region is answered once its pages are made, and mapped in the daemon by a second job while
 * its owner fetches and maps them (PagesGet is served meanwhile: it needs handles, not the
 * daemon's mapping); every transfer of the region is a job after that one (jobs run in order).
 * building_bytes keeps the pages being made out of the free memory that a loan measures
 * meanwhile.
 *
 * Address space: a region reserves in the daemon what it holds, a growable one room that
 * doubles as it grows (the books decide it and bound it per user: books_space.c; the pool
 * moves the daemon's mapping when a growth passes it).
 *
 * Floor 8 (daemon.h's floors).
 */
#include <stdlib.h>

#include "daemon.h"
#include "log.h"

static void reply_region_created(struct sl_conn *c, uint64_t req_id, uint64_t region,
                                 uint64_t npages, const char *what) {
  uint64_t ps = sl_device_info(c->d->dev)->page_size;
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__RegionCreated m = SUBLET__REGION_CREATED__INIT;
  char a[16];

  m.region = region;
  m.pages = npages;
  m.page_size = ps;
  rep.id = req_id;
  rep.body_case = SUBLET__REPLY__BODY_REGION_CREATED;
  rep.region_created = &m;
  sl_info("region %llu: %s%s for pid %d", (unsigned long long)region, what,
          sl_format_size(a, npages * ps), (int)c->peer.pid);
  sl_conn_send(c, &rep, NULL, 0);
}

/* ---- RegionCreate: the books hold the pages from the start, the job makes them */

struct region_job {
  struct sl_job job; /* first member */
  uint64_t req_id, region, npages, bytes;
  int growable;
  struct sl_pool_region *built;
};

/* Pages are made off the loop; meanwhile the connection waits and their bytes are kept out
 * of the free memory a loan measures (building_bytes; the job's done gives them back). */
static void submit_build(struct sl_conn *c, struct sl_job *job, void (*run)(struct sl_job *),
                         void (*done)(struct sl_job *), uint64_t bytes) {
  job->run = run;
  job->done = done;
  job->conn = c;
  c->d->building_bytes += bytes;
  sl_jobs_submit(c->d, job);
}

static void region_build_run(struct sl_job *j) {
  struct region_job *rj = (struct region_job *)j;

  j->rc = sl_pool_region_make(j->d->pool, rj->region, rj->npages, rj->npages, &rj->built,
                              &j->err);
}

/* ---- the daemon's own mapping of a new region, after its reply */

struct map_job {
  struct sl_job job; /* first member; no connection: the owner's reads on meanwhile */
  struct sl_pool_region *r; /* held until mapped */
  uint64_t region;
};

static void map_run(struct sl_job *j) {
  struct map_job *mj = (struct map_job *)j;

  j->rc = sl_pool_region_map(j->d->pool, mj->r, &j->err);
}

static void map_failed(uint64_t region, const struct sl_err *err) {
  sl_error("region %llu: its pages could not be mapped in subletd, so it cannot be lent or "
           "released: %s", (unsigned long long)region, err->msg);
}

static void map_done(struct sl_job *j) {
  struct map_job *mj = (struct map_job *)j;

  if (j->rc != 0)
    map_failed(mj->region, &j->err);
  sl_pool_region_put(j->d->pool, mj->r);
  free(mj);
}

static void submit_map(struct sl_daemon *d, uint64_t region) {
  struct map_job *mj = calloc(1, sizeof(*mj));
  struct sl_pool_region *r = sl_pool_region_hold(d->pool, region);
  struct sl_err err = {0};

  if (mj == NULL) { /* on the loop, then */
    if (sl_pool_region_map(d->pool, r, &err) != 0)
      map_failed(region, &err);
    sl_pool_region_put(d->pool, r);
    return;
  }
  mj->r = r;
  mj->region = region;
  mj->job.run = map_run;
  mj->job.done = map_done;
  sl_jobs_submit(d, &mj->job);
}

static void region_built(struct sl_job *j) {
  struct region_job *rj = (struct region_job *)j;
  struct sl_conn *c = j->conn;
  struct sl_daemon *d = j->d;

  d->building_bytes -= rj->bytes;
  if (j->rc == 0) {
    sl_pool_region_add(d->pool, rj->built);
    if (c != NULL) {
      reply_region_created(c, rj->req_id, rj->region, rj->npages,
                           rj->growable ? "growable, " : "");
      submit_map(d, rj->region);
    } else { /* its client went meanwhile, and the region left the books with it */
      sl_retire_region(d, rj->region);
    }
  } else if (c != NULL) {
    sl_books_region_remove(d->books, c->client_id, rj->region, NULL);
    sl_conn_send_error(c, rj->req_id, &j->err);
  }
  if (c != NULL)
    sl_conn_resume(c);
  free(rj);
}

int sl_regions_create(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__RegionCreate *m = r->region_create;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  const struct sl_device_info *info = sl_device_info(c->d->dev);
  uint64_t ps = info->page_size, total = info->total_bytes;
  struct region_job *rj;
  char a[16], b[16];
  int rc;

  if (m->size == 0 || m->size > total)
    return sl_err_set(err, m->size == 0 ? SUBLET_EINVAL : SUBLET_ENOMEM,
                      "a region of %s cannot be made on a device of %s",
                      sl_format_size(a, m->size), sl_format_size(b, total));
  rj = calloc(1, sizeof(*rj));
  if (rj == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  rj->npages = (m->size + ps - 1) / ps;
  rj->growable = m->growable;
  rj->bytes = rj->npages * ps;
  rc = sl_books_region_new(c->d->books, c->client_id, rj->npages, m->growable, &rj->region,
                           err);
  if (rc != 0) {
    free(rj);
    return rc;
  }
  rj->req_id = id;
  submit_build(c, &rj->job, region_build_run, region_built, rj->bytes);
  return 0;
}

/* ---- RegionGrow: checked first, the job makes the new pages, then the books take them */

struct grow_job {
  struct sl_job job; /* first member */
  uint64_t req_id, region, npages, space, bytes;
  struct sl_pool_region *r; /* held until grown */
};

static void grow_run(struct sl_job *j) {
  struct grow_job *gj = (struct grow_job *)j;

  j->rc = sl_pool_region_grow(j->d->pool, gj->r, gj->npages, gj->space, &j->err);
}

/* The books take the new pages, or the pool undoes them: also when the owner went meanwhile
 * (the region left the books with it; the pool frees it once the hold ends, or keeps its old
 * pages for the clients that kept its window). The books count what the pool reserves now. */
static void grow_done(struct sl_job *j) {
  struct grow_job *gj = (struct grow_job *)j;
  struct sl_conn *c = j->conn;
  struct sl_daemon *d = j->d;
  int rc = c != NULL ? j->rc : SUBLET_EPIPE;

  d->building_bytes -= gj->bytes;
  if (rc == 0)
    rc = sl_books_region_grow(d->books, c->client_id, gj->region, gj->npages, &j->err);
  sl_books_region_space(d->books, gj->region,
                        sl_pool_region_grown(d->pool, gj->r, gj->npages, rc == 0));
  if (c != NULL && rc == 0)
    reply_region_created(c, gj->req_id, gj->region, gj->npages, "grown to ");
  else if (c != NULL)
    sl_conn_send_error(c, gj->req_id, &j->err);
  if (c != NULL)
    sl_conn_resume(c);
  free(gj);
}

int sl_regions_grow(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__RegionGrow *m = r->region_grow;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  const struct sl_device_info *info = sl_device_info(c->d->dev);
  uint64_t ps = info->page_size, npages = (m->size / ps) + (m->size % ps != 0);
  struct sl_region_info ri;
  struct grow_job *gj;
  char a[16], b[16];
  int rc;

  if (m->size > info->total_bytes)
    return sl_err_set(err, SUBLET_ENOMEM, "region %llu cannot grow to %s on a device of %s: "
                      "ask for at most the device's memory", (unsigned long long)m->region,
                      sl_format_size(a, m->size), sl_format_size(b, info->total_bytes));
  if ((rc = sl_books_may_grow(c->d->books, c->client_id, m->region, npages, err)) != 0)
    return rc;
  sl_books_region_info(c->d->books, m->region, &ri);
  if ((gj = calloc(1, sizeof(*gj))) == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  if ((gj->r = sl_pool_region_hold(c->d->pool, m->region)) == NULL) {
    free(gj);
    return sl_err_set(err, SUBLET_ENOENT, "internal error: region %llu has no pages in the "
                      "pool; release it and make another", (unsigned long long)m->region);
  }
  gj->req_id = id;
  gj->region = m->region;
  gj->npages = npages;
  gj->space = sl_books_grow_space(c->d->books, m->region, npages);
  gj->bytes = (npages - ri.npages) * ps;
  sl_books_region_space(c->d->books, m->region, gj->space); /* counted while it is made */
  submit_build(c, &gj->job, grow_run, grow_done, gj->bytes);
  return 0;
}

/* ---- pages, release, drop */

int sl_regions_pages_get(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__PagesGet *m = r->pages_get;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__Pages pages = SUBLET__PAGES__INIT;
  int fds[SL_WIRE_MAX_FDS], groups = m->has_groups && m->groups;
  uint32_t spans[SL_WIRE_MAX_FDS];
  size_t n = m->count;
  int rc;

  if (m->count == 0 || (!groups && m->count > SL_WIRE_MAX_FDS))
    return sl_err_set(err, SUBLET_E2BIG, "PagesGet asks for %u pages: 1 to %d per request",
                      m->count, SL_WIRE_MAX_FDS);
  rc = sl_books_pages_granted(c->d->books, c->client_id, m->region, m->first, m->count, err);
  if (rc == 0)
    rc = sl_books_pages_as_groups(c->d->books, m->region, m->first, m->count, groups, err);
  if (rc == 0 && groups)
    rc = sl_pool_export_groups(c->d->pool, m->region, m->first, m->count, fds, spans, &n, err);
  else if (rc == 0)
    rc = sl_pool_export_pages(c->d->pool, m->region, m->first, m->count, fds, err);
  if (rc != 0)
    return rc;
  pages.region = m->region;
  pages.first = m->first;
  pages.count = m->count;
  pages.spans = groups ? spans : NULL;
  pages.n_spans = groups ? n : 0;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_PAGES;
  rep.pages = &pages;
  sl_conn_send(c, &rep, fds, n);
  sl_wire_close_fds(fds, n); /* sent: the client has its own copies now */
  return 0;
}

int sl_regions_release(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__RegionRelease *m = r->region_release;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  int rc = sl_books_region_remove(c->d->books, c->client_id, m->region, err);

  if (rc != 0)
    return rc;
  sl_retire_region_for(c->d, m->region, c, id);
  return 0;
}

int sl_regions_dropped(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Dropped *m = r->dropped;
  struct sl_conn *c = x->c;
  uint64_t id = x->id;
  struct sl_err *err = &x->err;
  int last, rc = sl_books_kept_drop(c->d->books, c->client_id, m->region, &last, err);

  if (rc != 0)
    return rc;
  sl_debug("pid %d let go of region %llu%s", (int)c->peer.pid, (unsigned long long)m->region,
           last ? ", its last holder: its pages go" : "");
  if (last)
    sl_retire_region(c->d, m->region); /* nobody holds its pages now */
  sl_conn_send_ok(c, id);
  return 0;
}
