/* pages.c - libsublet: a region's pages in the owner's process: fetched (PagesGet) and mapped,
 * remapped when fresh pages replace them, mapped as groups at a resume, unmapped and let go of
 * (releases, rescues); byte ranges as page pairs; the loan's window that maps the region's own
 * handles dropped before they change.
 * Floor 2 (client.h's floors). */
#include "client.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
int sl_pages_fetch(sublet_client *c, uint64_t region, uint64_t first, uint64_t count,
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

void sl_pages_unmap(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count,
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

int sl_pages_map_again(sublet_client *c, struct sublet_region *r, uint8_t *unmapped) {
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

void sl_pages_drop_handles(sublet_client *c, struct sublet_region *r, uint64_t first,
                           uint64_t count) {
  for (uint64_t p = first; p < first + count; p++) {
    if (owns_handle(r, p))
      sl_device_release(c->dev, r->handles[p]);
    r->handles[p] = 0;
    if (r->span != NULL)
      r->span[p] = 1;
  }
}

void sl_pages_let_go(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count) {
  sl_pages_unmap(c, r, first, count, NULL);
  sl_pages_drop_handles(c, r, first, count);
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

int sl_pages_map_groups(sublet_client *c, struct sublet_region *r, const uint64_t *groups,
                        size_t n) {
  int rc = spans_ensure(r);

  for (size_t i = 0; i < n && rc == 0; i++)
    if (groups[2 * i + 1] == 0 || groups[2 * i + 1] > UINT32_MAX || groups[2 * i] >= r->npages ||
        groups[2 * i + 1] > r->npages - groups[2 * i])
      rc = sl_client_fail(SUBLET_EPROTO, "subletd sent a group outside region %llu",
                          (unsigned long long)r->id);
  sl_pages_drop_window(c, r);
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
void sl_pages_drop_window(sublet_client *c, const struct sublet_region *r) {
  if (c->win != NULL && c->win->region_id == r->id && !c->win->owns_handles) {
    sl_window_free(c->win);
    c->win = NULL;
  }
}

/* After a loan to another user the daemon gave the pages that borrower was granted fresh
 * pages, with the kept bytes restored into them, so that it cannot reach this memory again:
 * they take the old ones' place in this process's mapping, at the same addresses (the
 * tensor's pointers stay valid). runs: n (first, count) pairs of region pages. */
int sl_pages_remap(sublet_client *c, struct sublet_region *r, const uint64_t *runs, size_t n) {
  int rc = 0;

  sl_pages_drop_window(c, r); /* it maps the old pages */
  sl_device_synchronize(c->dev, NULL);
  for (size_t i = 0; rc == 0 && i + 1 < n; i += 2) {
    if (runs[i] >= r->npages || runs[i + 1] > r->npages - runs[i])
      return sl_client_fail(SUBLET_EPROTO, "subletd sent fresh pages outside region %llu",
                            (unsigned long long)r->id);
    rc = remap_run(c, r, runs[i], runs[i + 1]);
  }
  return rc;
}

/* ------------------------------------------------------------------ page pairs */

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
int sl_pages_pairs(const struct sublet_region *r, const struct sublet_range *pinned,
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
