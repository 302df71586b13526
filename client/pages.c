/* pages.c - libsublet: fetching a region's pages from subletd, a PagesGet's worth of fds at a
 * time, and importing them.
 *
 * A new region is fetched as a pipeline: while this thread asks for the next batch (and the
 * daemon exports it), a helper thread imports the last one and maps it in place. Both sides
 * cost per 2 MiB handle (on an H200 the daemon's export about 0.017 s per GiB, the import,
 * map and access here about 0.03), so done one after the other they added up; side by side
 * the slower one sets the pace. The helper owns the fds it is handed and closes each after
 * its import; fds never pile up (two batches at most are in flight).
 */
#include "client.h"

#include <pthread.h>
#include <unistd.h>

#include "msg.h"

/* Asks for pages [first, first+n), n <= SL_WIRE_MAX_FDS; their fds land in fds[0..n), the
 * caller's to close. */
static int receive_batch(sublet_client *c, uint64_t region, uint64_t first, uint32_t n,
                         int *fds) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
  size_t nfds = SL_WIRE_MAX_FDS;
  int rc;

  pg.region = region;
  pg.first = first;
  pg.count = n;
  req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
  req.pages_get = &pg;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_PAGES, NULL, fds, &nfds, 0);
  if (rc == 0 && nfds != n) {
    sl_wire_close_fds(fds, nfds);
    rc = sl_client_fail(SUBLET_EPROTO, "subletd sent %zu fds for %u pages", nfds, n);
  }
  return rc;
}

/* Imports n fds into out[0..n) and closes them all, whatever happens: never one fd per page
 * held. Returns 0 or the first failure (err). */
static int import_batch(struct sl_device *dev, int *fds, uint32_t n, sl_handle *out,
                        struct sl_err *err) {
  int rc = 0;

  for (uint32_t i = 0; i < n; i++) {
    if (rc == 0)
      rc = sl_device_import(dev, fds[i], &out[i], err);
    close(fds[i]);
  }
  return rc;
}

int sl_pages_fetch_batch(sublet_client *c, uint64_t region, uint64_t first, uint32_t n,
                         sl_handle *out) {
  int fds[SL_WIRE_MAX_FDS];
  struct sl_err err = {0};
  int rc = receive_batch(c, region, first, n, fds);

  if (rc == 0 && import_batch(c->dev, fds, n, out, &err) != 0)
    rc = sl_client_fail_err(&err);
  return rc;
}

int sl_pages_fetch(sublet_client *c, uint64_t region, uint64_t first, uint64_t count,
                   sl_handle *handles) {
  while (count > 0) {
    uint32_t n = count < SL_WIRE_MAX_FDS ? (uint32_t)count : SL_WIRE_MAX_FDS;
    int rc = sl_pages_fetch_batch(c, region, first, n, &handles[first]);

    if (rc != 0)
      return rc;
    first += n;
    count -= n;
  }
  return 0;
}

/* ------------------------------------------------------------------ the pipeline */

#define PIPE_SLOTS 2

struct pipe_batch {
  uint64_t first;
  uint32_t n;
  int fds[SL_WIRE_MAX_FDS];
};

struct pipe {
  pthread_mutex_t lock;
  pthread_cond_t changed;
  struct pipe_batch slot[PIPE_SLOTS];
  unsigned head, count; /* queued batches: slot[head], ... */
  int closed;           /* no more batches come */
  /* the helper's: */
  struct sl_device *dev;
  sl_handle *handles;
  char *base;
  uint64_t page_size;
  int rc;
  struct sl_err err;
};

/* Imports batch b, maps it at its place and gives it access (one call a batch: a call per
 * page costs far more). After a failure it only closes fds. */
static void pipe_take(struct pipe *p, struct pipe_batch *b) {
  char *at = p->base + b->first * p->page_size;

  if (p->rc == 0)
    p->rc = import_batch(p->dev, b->fds, b->n, &p->handles[b->first], &p->err);
  else
    sl_wire_close_fds(b->fds, b->n);
  for (uint32_t i = 0; p->rc == 0 && i < b->n; i++)
    p->rc = sl_device_map(p->dev, at + i * p->page_size, p->page_size,
                          p->handles[b->first + i], &p->err);
  if (p->rc == 0)
    p->rc = sl_device_set_access(p->dev, at, b->n * p->page_size, &p->err);
}

static void *pipe_helper(void *arg) {
  struct pipe *p = arg;
  struct pipe_batch b;

  pthread_mutex_lock(&p->lock);
  for (;;) {
    while (p->count == 0 && !p->closed)
      pthread_cond_wait(&p->changed, &p->lock);
    if (p->count == 0)
      break;
    b = p->slot[p->head];
    p->head = (p->head + 1) % PIPE_SLOTS;
    p->count--;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    pipe_take(p, &b); /* the driver's work, outside the lock */
    pthread_mutex_lock(&p->lock);
  }
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

/* Hands a received batch to the helper once a slot is free; the helper owns its fds then. */
static void pipe_put(struct pipe *p, const struct pipe_batch *b) {
  pthread_mutex_lock(&p->lock);
  while (p->count == PIPE_SLOTS)
    pthread_cond_wait(&p->changed, &p->lock);
  p->slot[(p->head + p->count) % PIPE_SLOTS] = *b;
  p->count++;
  pthread_cond_broadcast(&p->changed);
  pthread_mutex_unlock(&p->lock);
}

/* This thread's side: every batch asked for and handed over, or the first failure. */
static int pipe_feed(sublet_client *c, struct pipe *p, uint64_t region, uint64_t npages) {
  struct pipe_batch b;
  int rc = 0;

  for (uint64_t first = 0; rc == 0 && first < npages; first += b.n) {
    b.first = first;
    b.n = npages - first < SL_WIRE_MAX_FDS ? (uint32_t)(npages - first) : SL_WIRE_MAX_FDS;
    rc = receive_batch(c, region, first, b.n, b.fds);
    if (rc == 0)
      pipe_put(p, &b);
  }
  pthread_mutex_lock(&p->lock);
  p->closed = 1;
  pthread_cond_broadcast(&p->changed);
  pthread_mutex_unlock(&p->lock);
  return rc;
}

int sl_pages_fetch_map(sublet_client *c, uint64_t region, uint64_t npages, sl_handle *handles,
                       void *base, uint64_t page_size) {
  struct pipe p = {.dev = c->dev, .handles = handles, .base = base, .page_size = page_size};
  pthread_t helper;
  int rc;

  pthread_mutex_init(&p.lock, NULL);
  pthread_cond_init(&p.changed, NULL);
  if (pthread_create(&helper, NULL, pipe_helper, &p) != 0) {
    rc = sl_pages_fetch(c, region, 0, npages, handles); /* no thread: one after the other */
    for (uint64_t i = 0; rc == 0 && i < npages; i++)
      if (sl_device_map(c->dev, (char *)base + i * page_size, page_size, handles[i], &p.err))
        rc = sl_client_fail_err(&p.err);
    if (rc == 0 && sl_device_set_access(c->dev, base, npages * page_size, &p.err) != 0)
      rc = sl_client_fail_err(&p.err);
  } else {
    rc = pipe_feed(c, &p, region, npages);
    pthread_join(helper, NULL);
    if (rc == 0 && p.rc != 0)
      rc = sl_client_fail_err(&p.err);
  }
  pthread_cond_destroy(&p.changed);
  pthread_mutex_destroy(&p.lock);
  return rc;
}
