/* region.c - libsublet: regions (a tensor's memory, mapped in the owner's process) and
 * lending them: the Lend itself, and offers (a local lend, which borrows too, is borrow.c's:
 * this file calls nothing above it). */
#include "client.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "clock.h"
#include "msg.h"

/* ------------------------------------------------------------------ regions */

/* Imports pages [first, first+n) of a region, n <= SL_WIRE_MAX_FDS, into out[0..n). */
static int fetch_batch(sublet_client *c, uint64_t region, uint64_t first, uint32_t n,
                       sl_handle *out) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
  struct sl_err err = {0};
  int fds[SL_WIRE_MAX_FDS];
  size_t nfds = SL_WIRE_MAX_FDS;
  int rc;

  pg.region = region;
  pg.first = first;
  pg.count = n;
  req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
  req.pages_get = &pg;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_PAGES, NULL, fds, &nfds, 0);
  if (rc == 0 && nfds != n)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd sent %zu fds for %u pages", nfds, n);
  for (size_t i = 0; i < nfds; i++) {
    /* Import, then close at once: never hold one fd per page. */
    if (rc == 0 && sl_device_import(c->dev, fds[i], &out[i], &err) != 0)
      rc = sl_client_fail_err(&err);
    close(fds[i]);
  }
  return rc;
}

/* Imports pages [first, first+count) of a region into handles[first..]. */
int sl_region_fetch_pages(sublet_client *c, uint64_t region, uint64_t first, uint64_t count,
                          sl_handle *handles) {
  while (count > 0) {
    uint32_t n = count < SL_WIRE_MAX_FDS ? (uint32_t)count : SL_WIRE_MAX_FDS;
    int rc = fetch_batch(c, region, first, n, &handles[first]);

    if (rc != 0)
      return rc;
    first += n;
    count -= n;
  }
  return 0;
}

/* Maps the new page h at page p's address in place of the old one, which goes. Takes h. A
 * page without a handle is a hole (released, or let go of while its loan's end waited for
 * fresh pages): nothing is mapped there to unmap, and the driver's refusal would cost a call. */
static int remap_page(sublet_client *c, struct sublet_region *r, uint64_t p, sl_handle h) {
  void *at = (char *)r->base + p * r->page_size;
  struct sl_err err = {0};

  if (r->handles[p] != 0)
    sl_device_unmap_idle(c->dev, at, r->page_size);
  if (sl_device_map(c->dev, at, r->page_size, h, &err) != 0) {
    sl_device_release(c->dev, h);
    return sl_client_fail(err.code, "mapping the fresh page %llu of region %llu failed (%s): "
                          "the tensor has a hole there, release it",
                          (unsigned long long)p, (unsigned long long)r->id, err.msg);
  }
  if (r->handles[p] != 0) /* a released page has none */
    sl_device_release(c->dev, r->handles[p]);
  r->handles[p] = h;
  return 0;
}

/* Pages [first, first+count) remapped, a PagesGet's worth at a time; access is granted once
 * per batch (a call per page costs far more). */
static int remap_run(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count) {
  struct sl_err err = {0};

  while (count > 0) {
    uint32_t n = count < SL_WIRE_MAX_FDS ? (uint32_t)count : SL_WIRE_MAX_FDS, i;
    sl_handle fresh[SL_WIRE_MAX_FDS] = {0};
    int rc = fetch_batch(c, r->id, first, n, fresh);

    for (i = 0; rc == 0 && i < n; i++)
      rc = remap_page(c, r, first + i, fresh[i]);
    for (uint32_t j = i; j < n; j++) /* what a failure left unmapped */
      if (fresh[j] != 0)
        sl_device_release(c->dev, fresh[j]);
    i = rc != 0 && i > 0 ? i - 1 : i; /* the pages mapped */
    if (i > 0 && sl_device_set_access(c->dev, (char *)r->base + first * r->page_size,
                                      i * r->page_size, &err) != 0 && rc == 0)
      rc = sl_client_fail_err(&err);
    if (rc != 0)
      return rc;
    first += n;
    count -= n;
  }
  return 0;
}

/* ------------------------------------------------------------------ page groups */

/* Does r->handles[p] hold a reference of this process's own (not a group's, held at its head)? */
static int owns_handle(const struct sublet_region *r, uint64_t p) {
  return r->handles[p] != 0 && (r->span == NULL || r->span[p] != 0);
}

/* The pages of the mapping that begins at page p. */
static uint32_t span_at(const struct sublet_region *r, uint64_t p) {
  return r->span == NULL || r->span[p] == 0 ? 1 : r->span[p];
}

static void unmap_run(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count,
                      uint8_t *unmapped) {
  uint64_t ps = r->page_size;

  /* One call where the device takes it (it is far cheaper), else mapping by mapping: what is
   * not mapped (a released page) fails harmlessly. */
  if (sl_device_unmap_idle(c->dev, (char *)r->base + first * ps, count * ps) == 0) {
    if (unmapped != NULL)
      memset(unmapped + first, 1, count);
    return;
  }
  for (uint64_t p = first; p < first + count; p += span_at(r, p))
    if (sl_device_unmap_idle(c->dev, (char *)r->base + p * ps, span_at(r, p) * ps) == 0 &&
        unmapped != NULL)
      memset(unmapped + p, 1, span_at(r, p));
}

void sl_region_unmap(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count,
                     uint8_t *unmapped) {
  uint64_t p = first, end = first + count, from;

  if (unmapped == NULL) {
    unmap_run(c, r, first, count, NULL);
    return;
  }
  while (p < end) { /* the runs not unmapped yet: a call over an unmapped one fails slowly */
    for (; p < end && unmapped[p]; p++)
      ;
    for (from = p; p < end && !unmapped[p]; p++)
      ;
    if (p > from)
      unmap_run(c, r, from, p - from, unmapped);
  }
}

int sl_region_map_again(sublet_client *c, struct sublet_region *r, uint8_t *unmapped) {
  uint64_t ps = r->page_size, p = 0, from;
  struct sl_err err = {0};
  int rc = 0;

  while (p < r->npages) { /* runs of marked pages with handles (a released one has none) */
    for (; p < r->npages && (!unmapped[p] || r->handles[p] == 0); p++)
      unmapped[p] = 0;
    for (from = p; rc == 0 && p < r->npages && unmapped[p] && r->handles[p] != 0;
         p += span_at(r, p))
      if (owns_handle(r, p))
        rc = sl_device_map(c->dev, (char *)r->base + p * ps, span_at(r, p) * ps, r->handles[p],
                           &err);
    if (rc == 0 && p > from)
      rc = sl_device_set_access(c->dev, (char *)r->base + from * ps, (p - from) * ps, &err);
    if (rc != 0)
      return sl_client_fail(err.code, "mapping region %llu's pages again failed (%s): the "
                            "tensor has holes, release it", (unsigned long long)r->id, err.msg);
    memset(unmapped + from, 0, p - from);
  }
  return 0;
}

void sl_region_drop_handles(sublet_client *c, struct sublet_region *r, uint64_t first,
                            uint64_t count) {
  for (uint64_t p = first; p < first + count; p++) {
    if (owns_handle(r, p))
      sl_device_release(c->dev, r->handles[p]);
    r->handles[p] = 0;
    if (r->span != NULL)
      r->span[p] = 1;
  }
}

void sl_region_let_go(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count) {
  sl_region_unmap(c, r, first, count, NULL);
  sl_region_drop_handles(c, r, first, count);
}

static int spans_ensure(struct sublet_region *r) {
  if (r->span != NULL)
    return 0;
  if ((r->span = malloc(r->cap_pages * sizeof(*r->span))) == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  for (uint64_t p = 0; p < r->cap_pages; p++)
    r->span[p] = 1;
  return 0;
}

/* Maps the group handle h at page first (span pages): this process's now. Takes h. */
static int map_group(sublet_client *c, struct sublet_region *r, uint64_t first, uint32_t span,
                     sl_handle h) {
  struct sl_err err = {0};

  if (sl_device_map(c->dev, (char *)r->base + first * r->page_size, span * r->page_size, h,
                    &err) != 0) {
    sl_device_release(c->dev, h);
    return sl_client_fail(err.code, "mapping pages %llu to %llu of region %llu again failed "
                          "(%s): the tensor has a hole there, release it",
                          (unsigned long long)first, (unsigned long long)(first + span - 1),
                          (unsigned long long)r->id, err.msg);
  }
  for (uint32_t i = 0; i < span; i++) {
    r->handles[first + i] = h;
    r->span[first + i] = i == 0 ? span : 0;
  }
  return 0;
}

/* Does the Pages reply give the groups asked for, in order? */
static int spans_match(const Sublet__Pages *pg, const uint64_t *groups, size_t n, size_t nfds) {
  if (pg == NULL || pg->n_spans != n || nfds != n)
    return 0;
  for (size_t i = 0; i < n; i++)
    if (pg->spans[i] != groups[2 * i + 1])
      return 0;
  return 1;
}

/* n adjacent groups ((first, count) pairs, n <= SL_WIRE_MAX_FDS) fetched in one PagesGet,
 * imported and mapped; access granted once over them. */
static int map_group_batch(sublet_client *c, struct sublet_region *r, const uint64_t *groups,
                           size_t n, uint64_t npages) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
  Sublet__Reply *rep = NULL;
  struct sl_err err = {0};
  int fds[SL_WIRE_MAX_FDS];
  size_t nfds = SL_WIRE_MAX_FDS, i = 0;
  sl_handle h;
  int rc;

  pg.region = r->id;
  pg.first = groups[0];
  pg.count = (uint32_t)npages;
  pg.has_groups = pg.groups = 1;
  req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
  req.pages_get = &pg;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_PAGES, &rep, fds, &nfds, 0);
  if (rc == 0 && !spans_match(rep->pages, groups, n, nfds))
    rc = sl_client_fail(SUBLET_EPROTO, "subletd sent other groups than region %llu's resume "
                        "named", (unsigned long long)r->id);
  for (; rc == 0 && i < nfds; i++) { /* import, then close at once (never an fd per page) */
    if ((rc = sl_device_import(c->dev, fds[i], &h, &err)) != 0)
      rc = sl_client_fail_err(&err);
    close(fds[i]);
    if (rc == 0)
      rc = map_group(c, r, groups[2 * i], (uint32_t)groups[2 * i + 1], h);
  }
  sl_wire_close_fds(fds + i, rc == 0 ? 0 : nfds - i);
  if (rc == 0 && sl_device_set_access(c->dev, (char *)r->base + groups[0] * r->page_size,
                                      npages * r->page_size, &err) != 0)
    rc = sl_client_fail_err(&err);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

int sl_region_map_groups(sublet_client *c, struct sublet_region *r, const uint64_t *groups,
                         size_t n) {
  int rc = spans_ensure(r);

  for (size_t i = 0; i < n && rc == 0; i++)
    if (groups[2 * i + 1] == 0 || groups[2 * i + 1] > UINT32_MAX || groups[2 * i] >= r->npages ||
        groups[2 * i + 1] > r->npages - groups[2 * i])
      rc = sl_client_fail(SUBLET_EPROTO, "subletd sent a group outside region %llu",
                          (unsigned long long)r->id);
  sl_region_drop_window(c, r);
  for (size_t i = 0, j; rc == 0 && i < n; i = j) {
    uint64_t pages = groups[2 * i + 1];
    for (j = i + 1; j < n && j - i < SL_WIRE_MAX_FDS &&
                    groups[2 * j] == groups[2 * j - 2] + groups[2 * j - 1] &&
                    pages + groups[2 * j + 1] <= UINT32_MAX; j++)
      pages += groups[2 * j + 1];
    rc = map_group_batch(c, r, &groups[2 * i], j - i, pages);
  }
  return rc;
}

/* The window of a loan of r in this process (r's owner) maps r's pages with r's own handles:
 * it goes before those pages or handles change. */
void sl_region_drop_window(sublet_client *c, const struct sublet_region *r) {
  if (c->win != NULL && c->win->region_id == r->id && !c->win->owns_handles) {
    sl_window_free(c->win);
    c->win = NULL;
  }
}

/* After a loan to another user the daemon gave the pages that borrower was granted fresh
 * pages, with the kept bytes restored into them, so that it cannot reach this memory again:
 * they take the old ones' place in this process's mapping, at the same addresses (the
 * tensor's pointers stay valid). runs: n (first, count) pairs of region pages. */
int sl_region_remap(sublet_client *c, struct sublet_region *r, const uint64_t *runs, size_t n) {
  int rc = 0;

  sl_region_drop_window(c, r); /* it maps the old pages */
  sl_device_synchronize(c->dev, NULL);
  for (size_t i = 0; rc == 0 && i + 1 < n; i += 2) {
    if (runs[i] >= r->npages || runs[i + 1] > r->npages - runs[i])
      return sl_client_fail(SUBLET_EPROTO, "subletd sent fresh pages outside region %llu",
                            (unsigned long long)r->id);
    rc = remap_run(c, r, runs[i], runs[i + 1]);
  }
  return rc;
}

static uint64_t reserved_pages(const struct sublet_region *r) {
  return r->lead_pages + r->npages + r->trail_pages;
}

/* Unmaps and releases this process's side of a region (not the daemon's). */
static void release_local(struct sublet_region *r) {
  struct sl_device *dev = r->client->dev;

  if (r->base != NULL && r->handles != NULL) {
    sl_device_synchronize(dev, NULL);
    sl_region_let_go(r->client, r, 0, r->npages); /* a failed map_region() left holes */
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
  return undo ? sl_client_undo(c, &req, SUBLET__REPLY__BODY_OK)
              : sl_client_call(c, &req, SUBLET__REPLY__BODY_OK, NULL, NULL, NULL, 0);
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
    rc = sl_region_fetch_pages(c, r->id, 0, r->npages, r->handles);
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
  int rc = sl_region_fetch_pages(c, r->id, from, npages - from, r->handles);

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
    sl_region_drop_window(c, r); /* it was laid out for the old pages, in the trail the new ones take */
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
    sl_region_drop_window(c, r); /* before the handles it borrows */
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

/* ------------------------------------------------------------------ lending */

static int cmp_pair(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

  return (x > y) - (x < y);
}

static int pinned_bad(const struct sublet_region *r, size_t i, const struct sublet_range *p) {
  return sl_client_fail(SUBLET_EINVAL, "range %zu (offset %llu, length %llu) is not whole pages of "
                        "the region (%llu pages of %llu bytes): give page-aligned ranges of "
                        "it", i, (unsigned long long)p->offset,
                        (unsigned long long)p->length, (unsigned long long)r->npages,
                        (unsigned long long)r->page_size);
}

/* The pinned byte ranges as the daemon wants them: (first page, count) pairs, sorted and
 * merged (any order and overlap is fine here; empty ranges pin nothing). *out: malloc'd. */
int sl_region_page_pairs(const struct sublet_region *r, const struct sublet_range *pinned,
                         size_t n, uint64_t **out, size_t *nout) {
  uint64_t ps = r->page_size, *v = n > 0 ? malloc(2 * n * sizeof(*v)) : NULL;
  size_t m = 0;

  *out = NULL;
  *nout = 0;
  if (n > 0 && pinned == NULL)
    return sl_client_fail(SUBLET_EINVAL, "%zu pinned ranges announced but none given", n);
  if (n > 0 && v == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory for %zu pinned ranges", n);
  for (size_t i = 0; i < n; i++) {
    const struct sublet_range *p = &pinned[i];
    if (p->offset % ps != 0 || p->length % ps != 0 || p->offset / ps > r->npages ||
        p->length / ps > r->npages - p->offset / ps) {
      free(v);
      return pinned_bad(r, i, p);
    }
    if (p->length > 0) {
      v[2 * m] = p->offset / ps;
      v[2 * m++ + 1] = p->length / ps;
    }
  }
  if (m > 1)
    qsort(v, m, 2 * sizeof(*v), cmp_pair);
  for (size_t i = 0; i < m; i++) {
    uint64_t *last = *nout > 0 ? &v[2 * (*nout - 1)] : NULL;
    if (last != NULL && v[2 * i] <= last[0] + last[1]) {
      uint64_t end = v[2 * i] + v[2 * i + 1];
      last[1] = end > last[0] + last[1] ? end - last[0] : last[1];
    } else {
      v[2 * *nout] = v[2 * i];
      v[2 * (*nout)++ + 1] = v[2 * i + 1];
    }
  }
  *out = v;
  return 0;
}

/* Local: borrowed by this client in the same step (borrow.c's sublet_lend_pinned). */
int sl_region_lend(sublet_region *r, const struct sl_lend_args *a, Sublet__Reply **rep,
                   int *release_fd) {
  sublet_client *c = r->client;
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;
  int fds[4], keep_fd;
  size_t nfds = 4;
  int rc;

  *release_fd = -1;
  /* A plan of a pool arena's pages made while allocations could still take its free pages
   * would lend another tag's new tensor (pool.c, "Loans of the arena"). */
  if (r->torch_blocks && !atomic_load(&r->pool_held))
    return sl_client_fail(SUBLET_EINVAL, "region %llu is a pool arena: lend it under "
                          "sublet_pool_hold(), reading its segments after that call, and "
                          "sublet_pool_unhold() once the loan is reclaimed",
                          (unsigned long long)r->id);
  /* An older subletd would ignore the pinned pages and lend them: the owner's bytes. */
  if (a->npinned > 0 && !c->pinned_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot pin pages of a loan (it is "
                          "older than this library): update subletd, or lend without pinned");
  m.region = r->id;
  sl_keepwire_encode(&c->keep, &m, a->keep, a->nkeep, a->keep_all, &keep_fd);
  m.pinned = a->pinned;
  m.n_pinned = 2 * a->npinned;
  m.has_name = a->name != NULL;
  m.name.data = (uint8_t *)a->name;
  m.name.len = a->name != NULL ? strlen(a->name) : 0;
  m.has_rescue = m.rescue = 1; /* if the daemon dies, this library restores (rescue.c) */
  m.has_local = m.local = a->local != 0;
  m.known_layout = a->known_layout;
  m.has_known_layout = m.known_layout != 0;
  m.has_timeout_ms = a->timeout_ms != 0;
  m.timeout_ms = a->timeout_ms < 0 ? -1 : a->timeout_ms;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  /* The owner's last writes must be in memory before anyone saves or overwrites them. */
  sl_device_synchronize(c->dev, NULL);
  /* The daemon answers by the timeout: the deadline only guards against a lost daemon. */
  rc = sl_client_call_fd(c, &req, keep_fd, SUBLET__REPLY__BODY_LENT, rep, fds, &nfds,
                         m.timeout_ms);
  if (rc == 0 && (nfds < 3 || nfds > 3u + (a->local != 0) ||
                  (a->local && (*rep)->lent->borrowed == NULL))) {
    sl_wire_close_fds(fds, nfds);
    return sl_client_fail(SUBLET_EPROTO, "subletd answered Lend with %zu fds%s: is it older "
                          "than this library?", nfds, a->local ? " and no window" : "");
  }
  if (rc != 0)
    return rc;
  *release_fd = nfds == 4 ? fds[3] : -1;
  sl_rescue_free(r->rescue); /* a new loan of the region: an earlier one has ended */
  r->rescue = NULL;
  if ((rc = sl_rescue_new((*rep)->lent->loan, fds, &r->rescue)) != 0)
    sl_wire_close_fds(fds, 3);
  return rc;
}

/* An offer: the loan's id and token. */
static int lend_offer(sublet_region *r, const struct sl_lend_args *a, uint64_t *loan_id,
                      uint8_t token[SUBLET_TOKEN_SIZE]) {
  Sublet__Reply *rep = NULL;
  int release_fd, rc = sl_region_lend(r, a, &rep, &release_fd);

  if (rc == 0) {
    *loan_id = rep->lent->loan;
    if (token != NULL)
      memcpy(token, rep->lent->token.data, SUBLET_TOKEN_SIZE);
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

int sl_region_offer(sublet_region *r, const struct sl_lend_args *a,
                    const struct sublet_range *pinned, size_t npinned, uint64_t *loan_id,
                    uint8_t token[SUBLET_TOKEN_SIZE]) {
  struct sl_lend_args own = *a;
  int rc = sl_region_page_pairs(r, pinned, npinned, &own.pinned, &own.npinned);

  if (rc != 0)
    return rc;
  pthread_mutex_lock(&r->client->lock);
  rc = lend_offer(r, &own, loan_id, token);
  pthread_mutex_unlock(&r->client->lock);
  free(own.pinned);
  return rc;
}

SUBLET_EXPORT int sublet_lend(sublet_region *r, const struct sublet_range *keep, size_t n,
                              int keep_all, const char *name, uint64_t *loan_id,
                              uint8_t token[SUBLET_TOKEN_SIZE]) {
  return sublet_lend_wait(r, keep, n, keep_all, name, 0, loan_id, token);
}

SUBLET_EXPORT int sublet_lend_wait(sublet_region *r, const struct sublet_range *keep, size_t n,
                                   int keep_all, const char *name, int timeout_ms,
                                   uint64_t *loan_id, uint8_t token[SUBLET_TOKEN_SIZE]) {
  struct sl_lend_args a = {.keep = keep, .nkeep = n, .keep_all = keep_all, .name = name,
                          .timeout_ms = timeout_ms};

  return sl_region_offer(r, &a, NULL, 0, loan_id, token);
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

/* The region whose loan this is, if this library can restore it without the daemon. */
static struct sublet_region *rescuable(sublet_client *c, uint64_t loan_id) {
  for (struct sublet_region *r = c->regions; r != NULL; r = r->next)
    if (r->rescue != NULL && sl_rescue_loan(r->rescue) == loan_id)
      return r;
  return NULL;
}

/* The loan is over, one way or the other: its rescue fds go. */
static void loan_over(sublet_client *c, uint64_t loan_id) {
  struct sublet_region *r = rescuable(c, loan_id);

  if (r != NULL) {
    sl_rescue_free(r->rescue);
    r->rescue = NULL;
  }
}

/* The loan's end gave the region fresh pages (Reclaimed.replaced): they are mapped now. */
static int replaced_pages(sublet_client *c, uint64_t loan_id, const Sublet__LoanStats *m) {
  struct sublet_region *r = rescuable(c, loan_id);

  if (r == NULL)
    return sl_client_fail(SUBLET_EPROTO, "subletd replaced pages of loan %llu, whose region "
                          "this client does not know", (unsigned long long)loan_id);
  return sl_region_remap(c, r, m->replaced, m->n_replaced);
}

/* *awaits_fresh: subletd said the loan's end waits for memory for fresh pages
 * (Error.awaits_fresh_pages; an older subletd never says it). */
static int reclaim_request(sublet_client *c, uint64_t loan_id, int timeout_ms,
                           struct sublet_loan_stats *stats, int *awaits_fresh) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Reclaim m = SUBLET__RECLAIM__INIT;
  Sublet__Reply *rep;
  int rc;

  m.loan = loan_id;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms;
  req.body_case = SUBLET__REQUEST__BODY_RECLAIM;
  req.reclaim = &m;
  /* The daemon answers at the timeout; the socket wait only guards against a lost daemon. */
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_RECLAIMED, &rep, NULL, NULL, timeout_ms);
  *awaits_fresh = rc == SUBLET_ENOMEM && rep != NULL &&
                  rep->body_case == SUBLET__REPLY__BODY_ERROR && rep->error->awaits_fresh_pages > 0;
  if (rc == 0 && stats != NULL)
    sl_msg_stats_from_proto(rep->reclaimed, stats);
  if (rc == 0 && rep->reclaimed->n_replaced > 0)
    rc = replaced_pages(c, loan_id, rep->reclaimed);
  /* Everything saved comes back: anything less means the daemon's restore failed. */
  if (rc == 0 && rep->reclaimed->copied_in_bytes != rep->reclaimed->copied_out_bytes)
    rc = sl_client_fail(SUBLET_EDEVICE, "subletd could not restore the kept bytes of loan "
                        "%llu (its log says why): the tensor's kept data is not intact",
                        (unsigned long long)loan_id);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Reclaim, and once more when the loan's end (a borrower of another user) waits for device
 * memory for its fresh pages: on CUDA a page's memory is freed only once every process has let
 * go of it, and this process still maps and holds the old pages the borrower was granted (it
 * remaps them only at Reclaimed), so on a device that cannot hold them twice the end would wait
 * for memory this very process holds, for ever. Those pages hold nothing of the owner's (their
 * kept bytes were moved or saved before the grant; the restore writes into the fresh pages),
 * so this process lets go of them (the journal's GRANT entries, as its rescue does) and asks
 * again within what is left of the timeout. The holes stay until the Reclaim that succeeds
 * maps the fresh pages there (remap_page), or the rescue makes pages of its own if subletd
 * dies first; while the borrower still maps the old pages, the end still waits: ENOMEM, and a
 * later Reclaim finds the pages let go of already. */
static int reclaim_fresh(sublet_client *c, uint64_t loan_id, int timeout_ms,
                         struct sublet_loan_stats *stats) {
  int64_t t0 = sl_clock_ms();
  int fresh = 0, rc = reclaim_request(c, loan_id, timeout_ms, stats, &fresh), left;
  struct sublet_region *r = fresh ? rescuable(c, loan_id) : NULL;
  struct sl_err first;

  if (r == NULL)
    return rc;
  first = *sl_client_last_error();
  sl_region_drop_window(c, r); /* it would map the pages let go of (none for another user) */
  if (sl_rescue_let_go_granted(r) != 1) {
    *sl_client_last_error() = first; /* the ENOMEM, with subletd's why: reclaim again */
    return rc;
  }
  /* No time left to ask: the end may well complete now, so "call again" (ETIMEDOUT), as any
   * wait that ran out says, not ENOMEM (which a caller takes for "free memory first"). */
  if ((left = sl_clock_left_ms(t0, timeout_ms)) == 0)
    return sl_client_fail(SUBLET_ETIMEDOUT, "loan %llu has not ended yet: its end waited for "
                          "memory for fresh pages, and this process has let go of the old "
                          "pages it mapped: reclaim again", (unsigned long long)loan_id);
  return reclaim_request(c, loan_id, left, stats, &fresh);
}

SUBLET_EXPORT int sublet_reclaim(sublet_client *c, uint64_t loan_id, int timeout_ms,
                                 struct sublet_loan_stats *stats) {
  struct sublet_region *r;
  int rc = SUBLET_EPIPE;

  pthread_mutex_lock(&c->lock);
  if (!sl_client_gone(c))
    rc = reclaim_fresh(c, loan_id, timeout_ms, stats);
  r = rc != 0 && sl_client_gone(c) ? rescuable(c, loan_id) : NULL;
  if (rc == 0 || rc == SUBLET_EDEVICE)
    loan_over(c, loan_id);
  pthread_mutex_unlock(&c->lock);
  if (r == NULL)
    return rc;
  /* The daemon is gone: this library puts the kept bytes back itself. Unlocked, because the
   * borrower may be this very client, letting go of the loan's pages (watch.c). */
  rc = sl_rescue_run(r, timeout_ms, stats);
  if (rc == SUBLET_EDAEMONDIED) {
    pthread_mutex_lock(&c->lock);
    loan_over(c, loan_id);
    pthread_mutex_unlock(&c->lock);
  }
  return rc;
}

SUBLET_EXPORT int sublet_withdraw(sublet_client *c, uint64_t loan_id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Withdraw m = SUBLET__WITHDRAW__INIT;
  int rc;

  m.loan = loan_id;
  req.body_case = SUBLET__REQUEST__BODY_WITHDRAW;
  req.withdraw = &m;
  pthread_mutex_lock(&c->lock);
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_OK, NULL, NULL, NULL, 0);
  if (rc == 0)
    loan_over(c, loan_id);
  pthread_mutex_unlock(&c->lock);
  return rc;
}
