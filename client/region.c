/* region.c - libsublet: regions (a tensor's memory, mapped in the owner's process): created,
 * grown, checksummed and released; this process's side of them let go of when they go.
 * Floor 4 (client.h's floors). */
#include "client.h"

#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

/* ------------------------------------------------------------------ regions */

static uint64_t reserved_pages(const struct sublet_region *r) {
  return r->lead_pages + r->npages + r->trail_pages;
}

/* Unmaps and releases this process's side of a region (not the daemon's). */
static void release_local(struct sublet_region *r) {
  struct sl_device *dev = r->client->dev;

  if (r->base != NULL && r->handles != NULL) {
    sl_device_synchronize(dev, NULL);
    sl_pages_let_go(r->client, r, 0, r->npages); /* a failed map_region() left holes */
  }
  if (r->base != NULL)
    sl_device_unreserve(dev, r->reserved, reserved_pages(r) * r->page_size);
  for (uint64_t i = 0; r->base == NULL && r->handles != NULL && i < r->npages; i++)
    if (r->handles[i] != 0) /* fetched, never mapped */
      sl_device_release(dev, r->handles[i]);
  sl_rescue_free(r->rescue);
  sl_release_forget(r);
  free(r->handles);
  free(r->span);
  free(r);
}

/* Maps every page of the region at r->base, in order, with room for the device's whole memory
 * reserved below it and, beside the region's size, above it (address space only): a loan's
 * fresh zone can then be mapped right below the region or right after it, and a loan that
 * keeps bytes of every page, or its head, is served in place (window.h). A growable region
 * reserves room to grow to r->cap_pages too, and a trail that is lead + cap_pages still once
 * it has: growing maps the new pages in the trail's first pages. */
static int map_region(sublet_client *c, struct sublet_region *r) {
  struct sl_err err = {0};
  uint64_t ps = r->page_size, total = c->info.total_bytes; /* the daemon's device */
  int rc;

  r->lead_pages = total / ps + 1;
  r->trail_pages = r->lead_pages + 2 * r->cap_pages - r->npages;
  rc = sl_device_reserve(c->dev, reserved_pages(r) * ps, &r->reserved, &err);
  if (rc == 0)
    r->base = (char *)r->reserved + r->lead_pages * ps;

  /* On failure release_local() unmaps all pages: unmapping one never mapped is a
   * harmless error. */
  for (uint64_t i = 0; rc == 0 && i < r->npages; i++)
    rc = sl_device_map(c->dev, (char *)r->base + i * ps, ps, r->handles[i], &err);
  if (rc == 0)
    rc = sl_device_set_access(c->dev, r->base, r->npages * ps, &err);
  return rc != 0 ? sl_client_fail_err(&err) : 0;
}

static int region_create_request(sublet_client *c, uint64_t size, int growable,
                                 struct sublet_region *r) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionCreate m = SUBLET__REGION_CREATE__INIT;
  Sublet__Reply *rep;
  int rc;

  m.size = size;
  m.has_growable = m.growable = growable != 0;
  req.body_case = SUBLET__REQUEST__BODY_REGION_CREATE;
  req.region_create = &m;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_REGION_CREATED, &rep, NULL, NULL, 0);
  if (rc == 0) {
    r->id = rep->region_created->region;
    r->npages = rep->region_created->pages;
    r->page_size = rep->region_created->page_size;
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Releases a region in the daemon; undo: after a failed step (sl_client_undo). */
static int region_release_request(sublet_client *c, uint64_t id, int undo) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionRelease m = SUBLET__REGION_RELEASE__INIT;

  m.region = id;
  req.body_case = SUBLET__REQUEST__BODY_REGION_RELEASE;
  req.region_release = &m;
  return sl_client_ok(c, &req, undo);
}

/* The pages a growable region may reach: the device's whole memory (the daemon refuses more). */
static uint64_t cap_for(const sublet_client *c, const struct sublet_region *r, int growable) {
  return growable ? c->info.total_bytes / r->page_size + 1 : r->npages;
}

static int region_create(sublet_client *c, uint64_t size, int growable, sublet_region **out) {
  struct sublet_region *r = calloc(1, sizeof(*r));
  int rc;

  if (r == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  r->client = c;
  pthread_mutex_lock(&c->lock);
  rc = sl_client_ensure_device(c);
  if (rc == 0 && growable && !c->grow_ok)
    rc = sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot grow regions: upgrade it, or "
                        "create the region at its full size");
  if (rc == 0)
    rc = region_create_request(c, size, growable, r);
  if (rc == 0 && (r->cap_pages = cap_for(c, r, growable)) < r->npages)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd made region %llu larger than its device",
                        (unsigned long long)r->id);
  if (rc == 0 && (r->handles = calloc(r->cap_pages, sizeof(sl_handle))) == NULL)
    rc = sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  if (rc == 0)
    rc = sl_pages_fetch(c, r->id, 0, r->npages, r->handles);
  if (rc == 0)
    rc = map_region(c, r);
  if (rc == 0) {
    r->next = c->regions;
    c->regions = r;
    *out = r;
  } else if (r->id != 0) {
    uint64_t id = r->id;
    release_local(r); /* frees r */
    region_release_request(c, id, 1);
  } else {
    free(r);
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}

SUBLET_EXPORT int sublet_region_create(sublet_client *c, uint64_t size, sublet_region **out) {
  return region_create(c, size, 0, out);
}

SUBLET_EXPORT int sublet_region_create_growable(sublet_client *c, uint64_t size,
                                                sublet_region **out) {
  return region_create(c, size, 1, out);
}

/* ---- growing */

/* May r grow now, as this process sees it? Not while a loan of it is in progress or not yet
 * reclaimed (the window to drop would be the loan's), nor while a loan that ended with live
 * allocations was served in place: those may lie where the new pages go. */
static int grow_check(sublet_client *c, const struct sublet_region *r) {
  if (!c->grow_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot grow regions: upgrade it");
  if (r->rescue != NULL)
    return sl_client_fail(SUBLET_EBUSY, "region %llu is lent: it grows once its loan has "
                          "ended (reclaim it first)", (unsigned long long)r->id);
  for (size_t i = 0; i < c->nforfeit; i++)
    if (c->forfeit[i]->region_id == r->id && c->forfeit[i]->own_to > 0)
      return sl_client_fail(SUBLET_EBUSY, "region %llu has allocations of a loan that ended "
                            "with them alive, in its address space: free them before it grows",
                            (unsigned long long)r->id);
  return 0;
}

static int region_grow_request(sublet_client *c, struct sublet_region *r, uint64_t size,
                               uint64_t *npages) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionGrow m = SUBLET__REGION_GROW__INIT;
  Sublet__Reply *rep;
  int rc;

  m.region = r->id;
  m.size = size;
  req.body_case = SUBLET__REQUEST__BODY_REGION_GROW;
  req.region_grow = &m;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_REGION_CREATED, &rep, NULL, NULL, 0);
  if (rc == 0)
    *npages = rep->region_created->pages;
  if (rc == 0 && (rep->region_created->region != r->id || *npages <= r->npages ||
                  *npages > r->cap_pages))
    rc = sl_client_fail(SUBLET_EPROTO, "subletd grew region %llu to %llu pages, which this "
                        "process cannot map (it has %llu, room for %llu): release it",
                        (unsigned long long)r->id, (unsigned long long)*npages,
                        (unsigned long long)r->npages, (unsigned long long)r->cap_pages);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Imports and maps pages [r->npages, npages) after the others, granting access once over
 * them. On failure undoes what it did here (the daemon's region has the pages all the same). */
static int map_new_pages(sublet_client *c, struct sublet_region *r, uint64_t npages) {
  uint64_t ps = r->page_size, from = r->npages, mapped = from;
  struct sl_err err = {0};
  int rc = sl_pages_fetch(c, r->id, from, npages - from, r->handles);

  for (; rc == 0 && mapped < npages; mapped++)
    if (sl_device_map(c->dev, (char *)r->base + mapped * ps, ps, r->handles[mapped], &err) != 0)
      break;
  if (rc == 0 && (mapped < npages || sl_device_set_access(c->dev, (char *)r->base + from * ps,
                                                          (npages - from) * ps, &err) != 0))
    rc = sl_client_fail(err.code, "region %llu grew, but its new pages could not be mapped "
                        "here (%s): release it", (unsigned long long)r->id, err.msg);
  if (rc == 0)
    return 0;
  sl_device_unmap_pages(c->dev, (char *)r->base + from * ps, mapped - from);
  for (uint64_t i = from; i < npages; i++) {
    if (r->handles[i] != 0)
      sl_device_release(c->dev, r->handles[i]);
    r->handles[i] = 0;
  }
  return rc;
}

SUBLET_EXPORT int sublet_region_grow(sublet_region *r, uint64_t size) {
  sublet_client *c = r->client;
  uint64_t npages = 0;
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = grow_check(c, r);
  if (rc == 0) {
    sl_pages_drop_window(c, r); /* it was laid out for the old pages, in the trail the new ones take */
    rc = region_grow_request(c, r, size, &npages);
  }
  if (rc == 0)
    rc = map_new_pages(c, r, npages);
  if (rc == 0) {
    r->trail_pages -= npages - r->npages;
    r->npages = npages;
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}

SUBLET_EXPORT void *sublet_region_addr(const sublet_region *r) {
  return r->base;
}

SUBLET_EXPORT uint64_t sublet_region_size(const sublet_region *r) {
  return r->npages * r->page_size;
}

SUBLET_EXPORT uint64_t sublet_region_id(const sublet_region *r) {
  return r->id;
}

SUBLET_EXPORT int sublet_region_release(sublet_region *r) {
  sublet_client *c = r->client;
  struct sublet_region **link;
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = region_release_request(c, r->id, 0);
  if (rc != 0 && sl_client_gone(c))
    rc = 0; /* the daemon is gone, and its side of the region with it: ours goes too */
  if (rc == 0) {
    sl_pages_drop_window(c, r); /* before the handles it borrows */
    sl_device_synchronize(c->dev, NULL);
    for (link = &c->regions; *link != r; link = &(*link)->next)
      ;
    *link = r->next;
    release_local(r);
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}

struct sublet_region *sl_region_find(sublet_client *c, uint64_t id) {
  for (struct sublet_region *r = c->regions; r != NULL; r = r->next)
    if (r->id == id)
      return r;
  return NULL;
}

void sl_region_forget_all(sublet_client *c) {
  while (c->regions != NULL) {
    struct sublet_region *r = c->regions;
    c->regions = r->next;
    release_local(r);
  }
}

/* A range that does not lie in the region, or -1. */
static ssize_t range_outside(const struct sublet_region *r, const struct sublet_range *ranges,
                             size_t n) {
  uint64_t size = r->npages * r->page_size;

  for (size_t i = 0; i < n; i++)
    if (ranges[i].offset > size || ranges[i].length > size - ranges[i].offset)
      return (ssize_t)i;
  return -1;
}

SUBLET_EXPORT int sublet_region_checksum(sublet_region *r, const struct sublet_range *ranges,
                                         size_t n, uint64_t *sums) {
  sublet_client *c = r->client;
  ssize_t bad = range_outside(r, ranges, n);
  struct sl_err err = {0};
  int rc;

  if (bad >= 0)
    return sl_client_fail(SUBLET_EINVAL, "checksum range %zd (offset %llu, length %llu) reaches "
                          "past the end of the region (%llu bytes): give ranges of the region",
                          bad, (unsigned long long)ranges[bad].offset,
                          (unsigned long long)ranges[bad].length,
                          (unsigned long long)(r->npages * r->page_size));
  pthread_mutex_lock(&c->lock);
  rc = sl_device_hash(c->dev, r->base, ranges, n, sums, &err);
  pthread_mutex_unlock(&c->lock);
  return rc != 0 ? sl_client_fail_err(&err) : 0;
}
