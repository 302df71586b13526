/* window.c - the borrower's address window (see window.h).
 * Floor 1 (client.h's floors). */
#include "window.h"

#include <stdlib.h>
#include <string.h>

#include "clock.h"

#define POS_UNMAPPED (-1)
#define POS_FRESH (-2)

static uint64_t window_pages(const struct sl_window *w) {
  return w->unkept + w->fresh + w->kept;
}

/* Is window position p the region's own mapping (served in place)? */
static int own_position(const struct sl_window *w, uint64_t p) {
  return p >= w->own_from && p < w->own_to;
}

/* Served below the region: the kept zone is the region's pages 0..n-1 in order, with nothing
 * unkept before it, and the fresh zone fits in the address space reserved below. The region's
 * last pages may be pinned (in no window): the window ends before their addresses, so no
 * allocation can land on them. */
static int lead_alias(const struct sl_window *w, const struct sl_window_own *own) {
  if (w->unkept != 0 || w->kept == 0 || w->kept > w->region_pages ||
      w->fresh > own->lead_pages)
    return 0;
  for (uint64_t i = 0; i < w->kept; i++)
    if (w->layout[i] != i)
      return 0;
  return 1;
}

/* Served from inside the region on: the unkept zone is the region's last pages in order (a
 * tensor that keeps its head), and the fresh and kept zones fit in the address space reserved
 * above it. */
static int tail_alias(const struct sl_window *w, const struct sl_window_own *own) {
  uint64_t first = w->region_pages - w->unkept;

  if (w->unkept == 0 || w->unkept > w->region_pages || w->fresh + w->kept > own->trail_pages)
    return 0;
  for (uint64_t i = 0; i < w->unkept; i++)
    if (w->layout[i] != first + i)
      return 0;
  return 1;
}

/* Lays the window over the region's own mapping, from base: positions [from, to) are the
 * region's pages, mapped already; the others lie in the region's reservation, its own. */
static void alias(struct sl_window *w, void *base, uint64_t from, uint64_t to) {
  w->base = base;
  w->own_from = from;
  w->own_to = to;
  for (uint64_t p = from; p < to; p++)
    w->mapped[p] = sl_window_page_at(w, p);
}

static void try_alias(struct sl_window *w, const struct sl_window_own *own) {
  char *region = own != NULL ? own->base : NULL;

  if (own == NULL || !own->in_place)
    return;
  if (lead_alias(w, own)) {
    alias(w, region - w->fresh * w->page_size, w->fresh, window_pages(w));
    w->room = own->lead_pages;
  }
  else if (tail_alias(w, own))
    alias(w, region + (w->region_pages - w->unkept) * w->page_size, 0, w->unkept);
}

/* With no unkept zone, room pages for the fresh zone below the kept zone: base lies where the
 * fresh zone of this loan starts. */
static int reserve(struct sl_window *w, uint64_t room, struct sl_err *err) {
  int rc;

  w->room = w->unkept == 0 && room > w->fresh ? room : w->fresh;
  w->reserved_pages = w->unkept == 0 ? w->room + w->kept : window_pages(w);
  rc = sl_device_reserve(w->dev, w->reserved_pages * w->page_size, &w->reserved, err);
  if (rc == 0)
    w->base = (char *)w->reserved + (w->reserved_pages - window_pages(w)) * w->page_size;
  return rc;
}

/* Another fresh zone for a window with no unkept zone (and no chunk mapped: the last loan
 * ended): the kept zone's positions shift, its addresses and mappings stay. */
static int refresh(struct sl_window *w, uint64_t fresh) {
  int64_t *mapped = malloc((fresh + w->kept + 1) * sizeof(*mapped));

  if (mapped == NULL)
    return 0;
  for (uint64_t p = 0; p < fresh; p++)
    mapped[p] = POS_UNMAPPED;
  memcpy(mapped + fresh, w->mapped + w->fresh, w->kept * sizeof(*mapped));
  free(w->mapped);
  w->mapped = mapped;
  w->base = (char *)w->base + ((int64_t)w->fresh - (int64_t)fresh) * (int64_t)w->page_size;
  if (w->own_to > 0) { /* aliased: the kept zone is the region's own mapping */
    w->own_from = fresh;
    w->own_to = fresh + w->kept;
  }
  w->fresh = fresh;
  return 1;
}

int sl_window_new(struct sl_device *dev, uint64_t page_size, uint64_t region_id,
                  uint64_t region_pages, uint64_t unkept, uint64_t fresh, uint64_t kept,
                  const uint64_t *layout, const struct sl_window_own *own, uint64_t room,
                  struct sl_window **out, struct sl_err *err) {
  struct sl_window *w = calloc(1, sizeof(*w));
  sl_handle *handles = own != NULL ? own->handles : NULL;
  uint64_t total = unkept + fresh + kept;
  int rc = 0;

  if (w == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  w->dev = dev;
  w->page_size = page_size;
  w->region_id = region_id;
  w->region_pages = region_pages;
  w->unkept = unkept;
  w->fresh = fresh;
  w->kept = kept;
  w->region_base = own != NULL && own->in_place ? own->base : NULL; /* direct runs too */
  w->layout = malloc((unkept + kept + 1) * sizeof(*w->layout));
  w->mapped = malloc((total + 1) * sizeof(*w->mapped));
  w->owns_handles = handles == NULL;
  w->handles = handles != NULL ? handles : calloc(region_pages + 1, sizeof(*w->handles));
  if (w->layout == NULL || w->mapped == NULL || w->handles == NULL) {
    sl_window_free(w);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a window of %llu pages",
                      (unsigned long long)total);
  }
  memcpy(w->layout, layout, (unkept + kept) * sizeof(*layout));
  for (uint64_t i = 0; i < total; i++)
    w->mapped[i] = POS_UNMAPPED;
  try_alias(w, own);
  if (w->base == NULL && total > 0)
    rc = reserve(w, room, err);
  if (rc != 0) {
    sl_window_free(w);
    return rc;
  }
  *out = w;
  return 0;
}

int sl_window_adopt(struct sl_window *w, uint64_t region_id, uint64_t unkept, uint64_t fresh,
                    uint64_t kept, const uint64_t *layout) {
  if (w->region_id != region_id || w->unkept != unkept || w->kept != kept || w->nallocs != 0)
    return 0;
  if (w->fresh != fresh && (unkept != 0 || fresh > w->room || w->nchunks != 0 || !refresh(w, fresh)))
    return 0;
  /* Served in place, it can take only a layout with the same pages there. */
  for (uint64_t p = w->own_from; p < w->own_to; p++)
    if ((uint64_t)w->mapped[p] != layout[p < unkept ? p : p - fresh])
      return 0;
  /* Positions whose page changed are remapped lazily by sl_window_map_run. */
  if (layout != w->layout) /* else the layout is w's own, left out of Borrowed */
    memcpy(w->layout, layout, (unkept + kept) * sizeof(*layout));
  return 1;
}

int64_t sl_window_page_at(const struct sl_window *w, uint64_t pos) {
  if (pos < w->unkept)
    return (int64_t)w->layout[pos];
  if (pos < w->unkept + w->fresh)
    return -1;
  return (int64_t)w->layout[pos - w->fresh];
}

void *sl_window_direct(const struct sl_window *w, uint64_t pos, uint64_t n) {
  int64_t first = n > 0 ? sl_window_page_at(w, pos) : -1;

  if (w->region_base == NULL || first < 0)
    return NULL;
  for (uint64_t i = 1; i < n; i++)
    if (sl_window_page_at(w, pos + i) != first + (int64_t)i)
      return NULL;
  return (char *)w->region_base + (uint64_t)first * w->page_size;
}

static void *pos_addr(const struct sl_window *w, uint64_t pos) {
  return (char *)w->base + pos * w->page_size;
}

static int map_position(struct sl_window *w, uint64_t pos, int64_t page, struct sl_err *err) {
  int rc;

  if (own_position(w, pos)) /* the region's own mapping: never remapped here */
    return sl_err_set(err, SUBLET_EPROTO, "position %llu of a loan served in place moved",
                      (unsigned long long)pos);
  /* A page changed since the last loan, which ended synchronised: nothing uses it now. */
  if (w->mapped[pos] >= 0)
    sl_device_unmap_idle(w->dev, pos_addr(w, pos), w->page_size);
  w->mapped[pos] = POS_UNMAPPED;
  if (w->handles[page] == 0)
    return sl_err_set(err, SUBLET_EPROTO, "no handle for region page %lld",
                      (long long)page);
  rc = sl_device_map(w->dev, pos_addr(w, pos), w->page_size, w->handles[page], err);
  if (rc == 0) {
    w->mapped[pos] = page;
    w->mapped_pages++;
  }
  return rc;
}

int sl_window_map_run(struct sl_window *w, uint64_t pos, uint64_t n, struct sl_err *err) {
  uint64_t first = UINT64_MAX, last = 0;
  double t0 = sl_clock_now();
  int rc = 0;

  if (pos > window_pages(w) || n > window_pages(w) - pos)
    return sl_err_set(err, SUBLET_EPROTO, "subletd granted positions outside the window");
  for (uint64_t p = pos; p < pos + n && rc == 0; p++) {
    int64_t page = sl_window_page_at(w, p);
    if (page < 0) {
      if (w->mapped[p] != POS_FRESH)
        rc = sl_err_set(err, SUBLET_EPROTO, "fresh position %llu has no chunk",
                        (unsigned long long)p);
      continue;
    }
    if (w->mapped[p] == page)
      continue;
    rc = map_position(w, p, page, err);
    first = p < first ? p : first;
    last = p;
  }
  /* One access call over the newly mapped span: per-page calls cost far more. */
  if (rc == 0 && first != UINT64_MAX)
    rc = sl_device_set_access(w->dev, pos_addr(w, first), (last - first + 1) * w->page_size,
                              err);
  w->map_seconds += sl_clock_now() - t0;
  return rc;
}

/* Pages between asks to stop: a few ms of mapping (docs/benchmarks.md). */
#define PREMAP_RUN 256

/* The pages this loan's allocations hold, wherever they lie. */
static uint64_t pages_held(const struct sl_window *w) {
  uint64_t n = 0;

  for (size_t i = 0; i < w->nallocs; i++)
    n += (w->allocs[i].size + w->page_size - 1) / w->page_size;
  return n;
}

/* May position p be mapped ahead: a kept page with a handle here, not mapped to it yet? */
static int premappable(const struct sl_window *w, uint64_t p) {
  int64_t page = sl_window_page_at(w, p);

  return page >= 0 && !own_position(w, p) && w->mapped[p] != page && w->handles[page] != 0;
}

/* Maps positions [from, to), all premappable, with one access call; undone if it fails. */
static void premap_run(struct sl_window *w, uint64_t from, uint64_t to) {
  uint64_t p;

  for (p = from; p < to; p++)
    if (map_position(w, p, sl_window_page_at(w, p), NULL) != 0)
      break;
  if (p == to && to > from &&
      sl_device_set_access(w->dev, pos_addr(w, from), (to - from) * w->page_size, NULL) == 0)
    return;
  while (p-- > from) { /* mapped without access: map_run would take it as done */
    sl_device_unmap_idle(w->dev, pos_addr(w, p), w->page_size);
    w->mapped[p] = POS_UNMAPPED;
    w->mapped_pages--;
  }
}

void sl_window_premap(struct sl_window *w, uint64_t npages, int (*stop)(void *), void *arg) {
  uint64_t free_uf = w->unkept + w->fresh, held = pages_held(w), p = free_uf;
  uint64_t end = window_pages(w);
  double t0 = sl_clock_now();

  free_uf = held < free_uf ? free_uf - held : 0;
  if (npages <= free_uf)
    return;
  end = npages - free_uf < end - p ? p + (npages - free_uf) : end;
  while (p < end && !stop(arg)) {
    uint64_t from;
    while (p < end && !premappable(w, p))
      p++;
    for (from = p; p < end && p - from < PREMAP_RUN && premappable(w, p); p++)
      ;
    premap_run(w, from, p);
  }
  w->map_seconds += sl_clock_now() - t0;
}

int sl_window_add_chunk(struct sl_window *w, uint64_t pos, uint64_t npages, sl_handle h,
                        struct sl_err *err) {
  double t0 = sl_clock_now();
  int rc;

  if (pos < w->unkept || pos + npages > w->unkept + w->fresh || npages == 0) {
    sl_device_release(w->dev, h);
    return sl_err_set(err, SUBLET_EPROTO, "subletd sent a fresh chunk outside the fresh zone");
  }
  if (w->nchunks == w->chunkcap) {
    size_t cap = w->chunkcap ? 2 * w->chunkcap : 8;
    struct sl_window_chunk *c = realloc(w->chunks, cap * sizeof(*c));
    if (c == NULL) {
      sl_device_release(w->dev, h);
      return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
    }
    w->chunks = c;
    w->chunkcap = cap;
  }
  rc = sl_device_map(w->dev, pos_addr(w, pos), npages * w->page_size, h, err);
  if (rc == 0)
    rc = sl_device_set_access(w->dev, pos_addr(w, pos), npages * w->page_size, err);
  if (rc != 0) {
    sl_device_release(w->dev, h);
    return rc;
  }
  w->chunks[w->nchunks++] = (struct sl_window_chunk){pos, npages, h};
  for (uint64_t p = pos; p < pos + npages; p++)
    w->mapped[p] = POS_FRESH;
  w->map_seconds += sl_clock_now() - t0;
  return 0;
}

void sl_window_take_handles(struct sl_window *w, struct sl_window *from) {
  if (!w->owns_handles || !from->owns_handles || w->region_id != from->region_id ||
      w->region_pages != from->region_pages)
    return;
  free(w->handles);
  w->handles = from->handles; /* from's mappings go with from; the handles are w's now */
  from->handles = NULL;
}

void sl_window_drop_chunks(struct sl_window *w) {
  if (w->nchunks > 0)
    sl_device_synchronize(w->dev, NULL);
  for (size_t i = 0; i < w->nchunks; i++) {
    struct sl_window_chunk *c = &w->chunks[i];
    sl_device_unmap_idle(w->dev, pos_addr(w, c->pos), c->npages * w->page_size);
    sl_device_release(w->dev, c->handle);
    for (uint64_t p = c->pos; p < c->pos + c->npages; p++)
      w->mapped[p] = POS_UNMAPPED;
  }
  w->nchunks = 0;
}

static int mapped_here(const struct sl_window *w, uint64_t p) {
  return w->mapped[p] >= 0 && !own_position(w, p);
}

/* The pages this window mapped, a run of adjacent ones at a time. */
static void unmap_pages(struct sl_window *w) {
  for (uint64_t p = 0, end; p < window_pages(w); p = end) {
    for (end = p + 1; mapped_here(w, p) && end < window_pages(w) && mapped_here(w, end); end++)
      ;
    if (mapped_here(w, p))
      sl_device_unmap_pages(w->dev, pos_addr(w, p), end - p);
  }
}

void sl_window_free(struct sl_window *w) {
  if (w == NULL)
    return;
  if (w->base != NULL) {
    sl_window_drop_chunks(w);
    sl_device_synchronize(w->dev, NULL);
    unmap_pages(w);
    if (w->reserved != NULL) /* not aliased: the reservation is the window's */
      sl_device_unreserve(w->dev, w->reserved, w->reserved_pages * w->page_size);
  }
  if (w->owns_handles && w->handles != NULL)
    for (uint64_t i = 0; i < w->region_pages; i++)
      if (w->handles[i] != 0)
        sl_device_release(w->dev, w->handles[i]);
  if (w->owns_handles)
    free(w->handles);
  free(w->layout);
  free(w->mapped);
  free(w->chunks);
  free(w->allocs);
  free(w);
}

int sl_window_alloc_add(struct sl_window *w, void *ptr, uint64_t size, uint64_t id) {
  if (w->nallocs == w->alloccap) {
    size_t cap = w->alloccap ? 2 * w->alloccap : 16;
    struct sl_window_alloc *a = realloc(w->allocs, cap * sizeof(*a));
    if (a == NULL)
      return SUBLET_ENOHOSTMEM;
    w->allocs = a;
    w->alloccap = cap;
  }
  w->allocs[w->nallocs++] = (struct sl_window_alloc){ptr, size, id};
  return 0;
}

int sl_window_alloc_take(struct sl_window *w, void *ptr, struct sl_window_alloc *a) {
  for (size_t i = 0; i < w->nallocs; i++) {
    if (w->allocs[i].ptr == ptr) {
      *a = w->allocs[i];
      w->allocs[i] = w->allocs[--w->nallocs];
      return 1;
    }
  }
  return 0;
}
