/* pool.c - region pages, fresh chunks and the host save area on the device. */
#include "pool.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

/* The save area grows in pieces of this size, so that it never has to move (saved bytes stay
 * where they are) and pinning is paid once per piece, not per loan. */
#define SL_HOST_PIECE (256ull << 20)

struct pool_region {
  uint64_t id;
  uint64_t npages;
  sl_handle *pages;
  void *base; /* the daemon's own mapping of all pages, contiguous */
  struct pool_region *next;
};

struct pool_chunk {
  uint64_t id;
  uint64_t npages;
  sl_handle handle;
  struct pool_chunk *next;
};

struct sl_pool {
  struct sl_device *dev;
  uint64_t page_size;
  struct pool_region *regions;
  struct pool_chunk *chunks;
  void **host;      /* pieces of SL_HOST_PIECE bytes */
  size_t nhost;
};

int sl_pool_new(struct sl_device *dev, struct sl_pool **out) {
  struct sl_pool *p = calloc(1, sizeof(*p));

  if (p == NULL)
    return SUBLET_ENOMEM;
  p->dev = dev;
  p->page_size = sl_device_info(dev)->page_size;
  *out = p;
  return 0;
}

static struct pool_region *find_region(const struct sl_pool *p, uint64_t id) {
  struct pool_region *r;

  for (r = p->regions; r != NULL; r = r->next)
    if (r->id == id)
      return r;
  return NULL;
}

static void region_unmap_release(struct sl_pool *p, struct pool_region *r, uint64_t created,
                                 uint64_t mapped) {
  if (mapped > 0)
    sl_device_synchronize(p->dev, NULL);
  for (uint64_t i = 0; i < mapped; i++)
    sl_device_unmap_idle(p->dev, (char *)r->base + i * p->page_size, p->page_size);
  for (uint64_t i = 0; i < created; i++)
    sl_device_release(p->dev, r->pages[i]);
  if (r->base != NULL)
    sl_device_unreserve(p->dev, r->base, r->npages * p->page_size);
  free(r->pages);
  free(r);
}

/* Creates the pages and maps them; on failure undoes exactly what was done. */
static int region_build(struct sl_pool *p, struct pool_region *r, struct sl_err *err) {
  uint64_t ps = p->page_size, created = 0, mapped = 0;
  int rc;

  rc = sl_device_reserve(p->dev, r->npages * ps, &r->base, err);
  for (; rc == 0 && created < r->npages; created++)
    rc = sl_device_create(p->dev, ps, &r->pages[created], err);
  if (rc != 0 && created > 0)
    created--; /* the last create failed */
  for (; rc == 0 && mapped < r->npages; mapped++)
    rc = sl_device_map(p->dev, (char *)r->base + mapped * ps, ps, r->pages[mapped], err);
  if (rc != 0 && mapped > 0)
    mapped--;
  if (rc == 0)
    rc = sl_device_set_access(p->dev, r->base, r->npages * ps, err);
  if (rc != 0)
    region_unmap_release(p, r, created, mapped);
  return rc;
}

int sl_pool_region_create(struct sl_pool *p, uint64_t region_id, uint64_t npages,
                          struct sl_err *err) {
  struct pool_region *r = calloc(1, sizeof(*r));
  int rc;

  if (r == NULL || (r->pages = calloc(npages, sizeof(sl_handle))) == NULL) {
    free(r);
    return sl_err_set(err, SUBLET_ENOMEM, "out of host memory for a region's page table");
  }
  r->id = region_id;
  r->npages = npages;
  rc = region_build(p, r, err);
  if (rc != 0)
    return rc; /* region_build freed r */
  r->next = p->regions;
  p->regions = r;
  return 0;
}

void sl_pool_region_destroy(struct sl_pool *p, uint64_t region_id) {
  struct pool_region **link = &p->regions, *r;

  while ((r = *link) != NULL && r->id != region_id)
    link = &r->next;
  if (r == NULL)
    return;
  *link = r->next;
  region_unmap_release(p, r, r->npages, r->npages);
}

int sl_pool_export_pages(struct sl_pool *p, uint64_t region_id, uint64_t first, uint32_t count,
                         int *fds, struct sl_err *err) {
  struct pool_region *r = find_region(p, region_id);
  uint32_t i;
  int rc = 0;

  if (r == NULL || first > r->npages || count > r->npages - first)
    return sl_err_set(err, SUBLET_EINVAL, "pages [%llu, +%u) are not in region %llu",
                      (unsigned long long)first, count, (unsigned long long)region_id);
  for (i = 0; i < count && rc == 0; i++)
    rc = sl_device_export(p->dev, r->pages[first + i], &fds[i], err);
  if (rc != 0) {
    for (uint32_t j = 0; j + 1 < i; j++)
      close(fds[j]);
  }
  return rc;
}

int sl_pool_chunk_create(struct sl_pool *p, uint64_t chunk_id, uint64_t npages, int *fd,
                         struct sl_err *err) {
  struct pool_chunk *c = calloc(1, sizeof(*c));
  int rc;

  if (c == NULL)
    return sl_err_set(err, SUBLET_ENOMEM, "out of host memory");
  rc = sl_device_create(p->dev, npages * p->page_size, &c->handle, err);
  if (rc == 0) {
    rc = sl_device_export(p->dev, c->handle, fd, err);
    if (rc != 0)
      sl_device_release(p->dev, c->handle);
  }
  if (rc != 0) {
    free(c);
    return rc;
  }
  c->id = chunk_id;
  c->npages = npages;
  c->next = p->chunks;
  p->chunks = c;
  return 0;
}

void sl_pool_chunk_release(struct sl_pool *p, uint64_t chunk_id) {
  struct pool_chunk **link = &p->chunks, *c;

  while ((c = *link) != NULL && c->id != chunk_id)
    link = &c->next;
  if (c == NULL)
    return;
  *link = c->next;
  sl_device_release(p->dev, c->handle);
  free(c);
}

uint64_t sl_pool_chunk_pages(const struct sl_pool *p) {
  uint64_t n = 0;

  for (const struct pool_chunk *c = p->chunks; c != NULL; c = c->next)
    n += c->npages;
  return n;
}

int sl_pool_host_reserve(struct sl_pool *p, uint64_t bytes, struct sl_err *err) {
  size_t want = (size_t)((bytes + SL_HOST_PIECE - 1) / SL_HOST_PIECE);
  void **host;
  int rc;

  if (want <= p->nhost)
    return 0;
  host = realloc(p->host, want * sizeof(*host));
  if (host == NULL)
    return sl_err_set(err, SUBLET_ENOMEM, "out of host memory");
  p->host = host;
  for (; p->nhost < want; p->nhost++) {
    rc = sl_device_host_alloc(p->dev, SL_HOST_PIECE, &p->host[p->nhost], err);
    if (rc != 0)
      return rc;
  }
  return 0;
}

uint64_t sl_pool_host_bytes(const struct sl_pool *p) {
  return (uint64_t)p->nhost * SL_HOST_PIECE;
}

static double now_seconds(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Runs the copies, split where they cross host pieces: one batch per piece. */
static int copy_batched(struct sl_pool *p, enum sl_copy_dir dir, struct pool_region *r,
                        const struct sl_copy *c, size_t n, struct sl_err *err) {
  /* Each copy adds at most one entry to a piece's batch: n entries always suffice. */
  struct sl_copy *batch = malloc(n * sizeof(*batch));
  size_t nb = 0;
  uint64_t piece = 0;
  int rc = 0;

  if (batch == NULL)
    return sl_err_set(err, SUBLET_ENOMEM, "out of host memory");
  for (size_t i = 0; i < n && rc == 0; i++) {
    struct sl_copy cur = c[i];
    while (cur.len > 0 && rc == 0) {
      uint64_t pc = cur.host_off / SL_HOST_PIECE, in = cur.host_off % SL_HOST_PIECE;
      uint64_t len = cur.len < SL_HOST_PIECE - in ? cur.len : SL_HOST_PIECE - in;
      if (pc != piece && nb > 0) {
        rc = sl_device_copy(p->dev, dir, r->base, p->host[piece], batch, nb, err);
        nb = 0;
      }
      piece = pc;
      batch[nb++] = (struct sl_copy){cur.dev_off, in, len};
      cur.dev_off += len;
      cur.host_off += len;
      cur.len -= len;
    }
  }
  if (rc == 0 && nb > 0)
    rc = sl_device_copy(p->dev, dir, r->base, p->host[piece], batch, nb, err);
  free(batch);
  return rc;
}

static int no_pages(uint64_t region_id, struct sl_err *err) {
  return sl_err_set(err, SUBLET_ENOENT, "region %llu has no pages in the pool",
                    (unsigned long long)region_id);
}

static int transfer(struct sl_pool *p, enum sl_copy_dir dir, uint64_t region_id,
                    const struct sl_copy *c, size_t n, double *seconds, struct sl_err *err) {
  struct pool_region *r = find_region(p, region_id);
  double t0 = now_seconds();
  int rc;

  if (r == NULL)
    return no_pages(region_id, err);
  if (n == 0)
    return 0;
  rc = sl_pool_host_reserve(p, c[n - 1].host_off + c[n - 1].len, err);
  if (rc == 0)
    rc = copy_batched(p, dir, r, c, n, err);
  if (seconds != NULL)
    *seconds = now_seconds() - t0;
  return rc;
}

int sl_pool_save(struct sl_pool *p, uint64_t region_id, const struct sl_copy *c, size_t n,
                 double *seconds, struct sl_err *err) {
  return transfer(p, SL_COPY_TO_HOST, region_id, c, n, seconds, err);
}

int sl_pool_restore(struct sl_pool *p, uint64_t region_id, const struct sl_copy *c, size_t n,
                    double *seconds, struct sl_err *err) {
  return transfer(p, SL_COPY_TO_DEVICE, region_id, c, n, seconds, err);
}

int sl_pool_move(struct sl_pool *p, uint64_t region_id, const struct sl_move *m, size_t n,
                 double *seconds, struct sl_err *err) {
  struct pool_region *r = find_region(p, region_id);
  double t0 = now_seconds();
  int rc;

  if (n == 0)
    return 0;
  if (r == NULL)
    return no_pages(region_id, err);
  rc = sl_device_move(p->dev, r->base, m, n, err);
  if (seconds != NULL)
    *seconds = now_seconds() - t0;
  return rc;
}

void sl_pool_free(struct sl_pool *p) {
  if (p == NULL)
    return;
  while (p->chunks != NULL)
    sl_pool_chunk_release(p, p->chunks->id);
  while (p->regions != NULL)
    sl_pool_region_destroy(p, p->regions->id);
  for (size_t i = 0; i < p->nhost; i++)
    sl_device_host_free(p->dev, p->host[i], SL_HOST_PIECE);
  free(p->host);
  free(p);
}
