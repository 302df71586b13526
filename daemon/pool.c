/* pool.c - region pages, fresh chunks and the host save area on the device (transfers, the
 * copies and moves between them, are pool_transfer.c's).
 *
 * The save area is a memfd, so that the owner of the kept bytes in it can be given an fd and
 * read them itself if the daemon dies (daemon/rescue.c). It belongs to one user at a time:
 * a loan of another user's region gets a new one (the old one goes once no copy uses it), so
 * that an owner's fd never shows another user's bytes.
 *
 * Floor 1 (daemon.h's floors).
 */
#include "pool_impl.h"

#include <errno.h>
#include <sys/mman.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "grow.h"
#include "log.h"
#include "seal.h"
#include "wire.h"

int sl_pool_new(struct sl_device *dev, struct sl_pool **out) {
  struct sl_pool *p = calloc(1, sizeof(*p));

  if (p == NULL)
    return SUBLET_ENOHOSTMEM;
  p->dev = dev;
  p->page_size = sl_device_info(dev)->page_size;
  *out = p;
  return 0;
}

struct sl_pool_region *sl_pool_find_region(const struct sl_pool *p, uint64_t id) {
  struct sl_pool_region *r;

  for (r = p->regions; r != NULL; r = r->next)
    if (r->id == id)
      return r;
  return NULL;
}

static uint32_t span_of(const struct sl_pool_region *r, uint64_t page) {
  return r->span[page] != 0 ? r->span[page] : 1;
}

/* Unmaps pages [from, to) of the daemon's mapping (the device idle): in one call where the
 * device takes it, else mapping by mapping, a group's as one. */
void sl_pool_unmap_range(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to) {
  uint64_t ps = p->page_size;

  if (to == from || sl_device_unmap_idle(p->dev, (char *)r->base + from * ps, (to - from) * ps) == 0)
    return;
  for (uint64_t i = from; i < to; i += span_of(r, i))
    sl_device_unmap_idle(p->dev, (char *)r->base + i * ps, span_of(r, i) * ps);
}

/* Undoes pages_add's work on pages [from, ...): unmaps those mapped, releases those created. */
static void pages_undo(struct sl_pool *p, struct sl_pool_region *r, uint64_t from,
                       uint64_t created, uint64_t mapped) {
  if (mapped > from) {
    sl_device_synchronize(p->dev, NULL);
    sl_pool_unmap_range(p, r, from, mapped);
  }
  for (uint64_t i = from; i < created; i++) {
    if (r->pages[i] != 0) /* a released page, or one inside a group, has none */
      sl_device_release(p->dev, r->pages[i]);
    r->pages[i] = 0;
  }
}

/* The loop takes over a growth's new table (r->moved): the old arrays go (their mapping and
 * reservation went already). */
static void moved_take(struct sl_pool_region *r) {
  struct sl_pool_region *m = r->moved;

  if (m == NULL)
    return;
  free(r->pages);
  free(r->span);
  r->pages = m->pages;
  r->span = m->span;
  r->base = m->base;
  r->cap_pages = m->cap_pages;
  r->moved = NULL;
  free(m);
}

void sl_pool_region_unmap_release(struct sl_pool *p, struct sl_pool_region *r) {
  moved_take(r); /* none is pending here (a growth holds the region until its done): safety */
  pages_undo(p, r, 0, r->npages, r->npages);
  if (r->base != NULL)
    sl_device_unreserve(p->dev, r->base, r->cap_pages * p->page_size);
  free(r->pages);
  free(r->span);
  free(r);
}

/* Maps pages [from, to) of r in the daemon's mapping; *mapped: how far it got. */
static int pages_map(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to,
                     uint64_t *mapped, struct sl_err *err) {
  uint64_t ps = p->page_size;
  int rc = 0;

  for (*mapped = from; rc == 0 && *mapped < to; ++*mapped)
    if ((rc = sl_device_map(p->dev, (char *)r->base + *mapped * ps, ps, r->pages[*mapped],
                            err)) != 0)
      break;
  if (rc == 0) /* once over the new span: a call per page costs far more */
    rc = sl_device_set_access(p->dev, (char *)r->base + from * ps, (to - from) * ps, err);
  return rc;
}

/* Creates pages [from, to) of r, and (map) maps them after the others, in r's reservation;
 * touches nothing else of r. On failure undoes exactly what it did. */
static int pages_add(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to,
                     int map, struct sl_err *err) {
  uint64_t created = from, mapped = from;
  int rc = 0;

  for (; created < to; created++) {
    r->span[created] = 1;
    if ((rc = sl_device_create(p->dev, p->page_size, &r->pages[created], err)) != 0)
      break;
  }
  if (rc == 0 && map)
    rc = pages_map(p, r, from, to, &mapped, err);
  if (rc != 0)
    pages_undo(p, r, from, created, mapped);
  return rc;
}

/* A region (or a growth's table) with page arrays for cap_pages pages, or NULL. */
static struct sl_pool_region *table_new(uint64_t cap_pages, struct sl_err *err) {
  struct sl_pool_region *r = calloc(1, sizeof(*r));

  if (r == NULL || (r->pages = calloc(cap_pages, sizeof(sl_handle))) == NULL ||
      (r->span = calloc(cap_pages, sizeof(*r->span))) == NULL) {
    if (r != NULL)
      free(r->pages);
    free(r);
    sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a region's page table");
    return NULL;
  }
  return r;
}

int sl_pool_region_make(struct sl_pool *p, uint64_t region_id, uint64_t npages,
                        uint64_t cap_pages, struct sl_pool_region **out, struct sl_err *err) {
  struct sl_pool_region *r;
  int rc;

  cap_pages = cap_pages > npages ? cap_pages : npages;
  if ((r = table_new(cap_pages, err)) == NULL)
    return SUBLET_ENOHOSTMEM;
  r->id = region_id;
  r->cap_pages = cap_pages;
  r->unmapped = 1;
  rc = sl_device_reserve(p->dev, cap_pages * p->page_size, &r->base, err);
  if (rc == 0 && (rc = pages_add(p, r, 0, npages, 0, err)) == 0)
    r->npages = npages;
  if (rc == 0)
    *out = r;
  else
    sl_pool_region_unmap_release(p, r); /* npages 0: only the reservation */
  return rc;
}

int sl_pool_region_map(struct sl_pool *p, struct sl_pool_region *r, struct sl_err *err) {
  uint64_t mapped = 0;
  int rc = pages_map(p, r, 0, r->npages, &mapped, err);

  if (rc == 0)
    r->unmapped = 0;
  else
    sl_pool_unmap_range(p, r, 0, mapped);
  return rc;
}

struct sl_pool_region *sl_pool_region_hold(struct sl_pool *p, uint64_t region_id) {
  struct sl_pool_region *r = sl_pool_find_region(p, region_id);

  if (r != NULL)
    r->busy++;
  return r;
}

/* Access to pages [from, to) of r's mapping, all mapped: one call. */
static int grant_run(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to,
                     struct sl_err *err) {
  uint64_t ps = p->page_size;

  return to > from ? sl_device_set_access(p->dev, (char *)r->base + from * ps, (to - from) * ps,
                                          err)
                   : 0;
}

/* Maps every page r has at r->base (a reservation just made), a group as one, then grants
 * access run by run: a released page is a hole, and a range with a hole is refused. *mapped:
 * how far it got, for the undo. */
static int table_map(struct sl_pool *p, struct sl_pool_region *r, uint64_t *mapped,
                     struct sl_err *err) {
  uint64_t ps = p->page_size, run = 0, i;
  int rc = 0;

  for (i = 0; rc == 0 && i < r->npages; i += span_of(r, i)) {
    *mapped = i + span_of(r, i);
    if (r->pages[i] != 0) /* else released: a hole, which ends a run */
      rc = sl_device_map(p->dev, (char *)r->base + i * ps, span_of(r, i) * ps, r->pages[i], err);
    else if ((rc = grant_run(p, r, run, i, err)) == 0)
      run = i + 1;
  }
  return rc != 0 ? rc : grant_run(p, r, run, r->npages, err);
}

/* Undoes what relocate made of m: its mapping, its reservation, its arrays. */
static void moved_free(struct sl_pool *p, struct sl_pool_region *m, uint64_t mapped) {
  if (m->base != NULL) {
    sl_device_synchronize(p->dev, NULL);
    sl_pool_unmap_range(p, m, 0, mapped);
    sl_device_unreserve(p->dev, m->base, m->cap_pages * p->page_size);
  }
  free(m->pages);
  free(m->span);
  free(m);
}

/* A growth past the reservation: the region's table moves to a reservation of cap pages, its
 * pages mapped there (the same handles: nothing is copied, and the owner's addresses are its
 * own), then the old mapping and reservation go; r->moved holds the new table for the loop
 * (moved_take, in the growth's done). The daemon's mapping is read by transfers only, and
 * none runs between this job and that done (pool_impl.h, "Threads"). All or nothing. */
static int relocate(struct sl_pool *p, struct sl_pool_region *r, uint64_t cap, struct sl_err *err) {
  struct sl_pool_region *m = table_new(cap, err);
  uint64_t mapped = 0;
  int rc;

  if (m == NULL)
    return SUBLET_ENOHOSTMEM;
  memcpy(m->pages, r->pages, r->npages * sizeof(*m->pages));
  memcpy(m->span, r->span, r->npages * sizeof(*m->span));
  m->id = r->id;
  m->npages = r->npages;
  m->cap_pages = cap;
  m->unmapped = r->unmapped;
  rc = sl_device_reserve(p->dev, cap * p->page_size, &m->base, err);
  if (rc == 0 && !r->unmapped)
    rc = table_map(p, m, &mapped, err);
  if (rc != 0) {
    moved_free(p, m, mapped);
    return rc;
  }
  sl_device_synchronize(p->dev, NULL);
  if (!r->unmapped)
    sl_pool_unmap_range(p, r, 0, r->npages);
  sl_device_unreserve(p->dev, r->base, r->cap_pages * p->page_size);
  r->moved = m;
  return 0;
}

int sl_pool_region_grow(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages,
                        uint64_t cap_pages, struct sl_err *err) {
  int rc = 0;

  if (npages <= r->npages || npages > sl_max_u64(cap_pages, r->cap_pages))
    return sl_err_set(err, SUBLET_EINVAL, "region %llu has room for %llu pages, not %llu: "
                      "create it growable to grow it", (unsigned long long)r->id,
                      (unsigned long long)sl_max_u64(cap_pages, r->cap_pages),
                      (unsigned long long)npages);
  if (npages > r->cap_pages)
    rc = relocate(p, r, cap_pages, err);
  return rc != 0 ? rc : pages_add(p, r->moved != NULL ? r->moved : r, r->npages, npages, 1, err);
}

uint64_t sl_pool_region_grown(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages,
                              int keep) {
  uint64_t cap;

  moved_take(r); /* a move stays, whatever became of the new pages: the old pages are there */
  if (keep)
    r->npages = npages;
  else if (npages <= r->cap_pages) /* else it never got the room: nothing was made */
    pages_undo(p, r, r->npages, npages, npages);
  cap = r->cap_pages;
  sl_pool_region_put(p, r);
  return cap;
}

void sl_pool_region_put(struct sl_pool *p, struct sl_pool_region *r) {
  if (--r->busy == 0 && r->doomed)
    sl_pool_region_unmap_release(p, r);
}

void sl_pool_region_add(struct sl_pool *p, struct sl_pool_region *r) {
  r->next = p->regions;
  p->regions = r;
}

struct sl_pool_region *sl_pool_region_take(struct sl_pool *p, uint64_t region_id) {
  struct sl_pool_region **link = &p->regions, *r;

  while ((r = *link) != NULL && r->id != region_id)
    link = &r->next;
  if (r == NULL)
    return NULL;
  *link = r->next;
  if (r->busy > 0) {
    r->doomed = 1; /* a transfer still copies to or from it: freed with the last one */
    return NULL;
  }
  return r;
}

uint64_t sl_pool_region_bytes(const struct sl_pool *p, const struct sl_pool_region *r) {
  return r->npages * p->page_size;
}

void sl_pool_region_free(struct sl_pool *p, struct sl_pool_region *r) {
  if (r != NULL)
    sl_pool_region_unmap_release(p, r);
}

int sl_pool_export_pages(struct sl_pool *p, uint64_t region_id, uint64_t first, uint32_t count,
                         int *fds, struct sl_err *err) {
  struct sl_pool_region *r = sl_pool_find_region(p, region_id);
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

int sl_pool_export_groups(struct sl_pool *p, uint64_t region_id, uint64_t first, uint64_t count,
                          int *fds, uint32_t *spans, size_t *n, struct sl_err *err) {
  struct sl_pool_region *r = sl_pool_find_region(p, region_id);
  int rc = 0;

  *n = 0;
  if (r == NULL || first > r->npages || count > r->npages - first)
    return sl_err_set(err, SUBLET_EINVAL, "pages [%llu, +%llu) are not in region %llu",
                      (unsigned long long)first, (unsigned long long)count,
                      (unsigned long long)region_id);
  for (uint64_t i = first; rc == 0 && i < first + count; i += spans[*n - 1]) {
    if (*n == SL_WIRE_MAX_FDS)
      rc = sl_err_set(err, SUBLET_E2BIG, "pages [%llu, +%llu) are more than %d groups: ask "
                      "for fewer", (unsigned long long)first, (unsigned long long)count,
                      SL_WIRE_MAX_FDS);
    else if ((rc = sl_device_export(p->dev, r->pages[i], &fds[*n], err)) == 0)
      spans[(*n)++] = span_of(r, i);
  }
  if (rc != 0) {
    sl_wire_close_fds(fds, *n);
    *n = 0;
  }
  return rc;
}

int sl_pool_chunk_create(struct sl_pool *p, uint64_t chunk_id, uint64_t npages, int *fd,
                         struct sl_err *err) {
  struct pool_chunk *c = calloc(1, sizeof(*c));
  int rc;

  if (c == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
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

void sl_pool_area_free(struct sl_device *dev, struct sl_pool_area *a) {
  for (size_t i = 0; i < a->nhost; i++)
    sl_device_host_unpin(dev, a->host[i], SL_HOST_PIECE);
  pthread_mutex_destroy(&a->grow_lock);
  pthread_cond_destroy(&a->grown);
  free(a->host);
  if (a->window != NULL)
    munmap(a->window, a->window_bytes);
  if (a->fd >= 0)
    close(a->fd);
  free(a);
}

/* The window: as much as the host's memory (pinned bytes cannot pass it), in whole pieces.
 * Address space only: MAP_NORESERVE, and nothing is touched past the file's end. */
static uint64_t area_window_bytes(void) {
  uint64_t ram = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);

  return (ram + SL_HOST_PIECE - 1) / SL_HOST_PIECE * SL_HOST_PIECE;
}

/* The memfd, its window, then the seal: 0 or a negative errno. */
static int area_open(struct sl_pool_area *a) {
  void *w;

  if ((a->fd = sl_seal_memfd("sublet-save-area")) < 0)
    return a->fd;
  a->window_bytes = area_window_bytes();
  w = mmap(NULL, a->window_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, a->fd, 0);
  if (w == MAP_FAILED)
    return -errno;
  a->window = w;
  return sl_seal_read_only(a->fd);
}

int sl_pool_area_new(uid_t uid, struct sl_pool_area **out, struct sl_err *err) {
  struct sl_pool_area *a = calloc(1, sizeof(*a));
  int rc;

  if (a == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  pthread_mutex_init(&a->grow_lock, NULL);
  pthread_cond_init(&a->grown, NULL);
  if ((rc = area_open(a)) != 0) {
    sl_pool_area_free(NULL, a); /* nothing pinned yet: no device call */
    return sl_err_set(err, SUBLET_ENOMEM, "cannot make the save area: %s%s", strerror(-rc),
                      rc == -EINVAL ? " (sealing it read-only needs Linux 5.1 or later)" : "");
  }
  a->uid = uid;
  *out = a;
  return 0;
}

/* Gives up the current area: at once, or when the last copy that uses it is done. */
static void area_drop(struct sl_pool *p) {
  struct sl_pool_area *a = p->area;

  p->area = NULL;
  if (a != NULL)
    __atomic_store_n(&a->pin_target, 0, __ATOMIC_RELAXED); /* the pin ahead stops */
  if (a != NULL && a->busy > 0)
    a->doomed = 1;
  else if (a != NULL)
    sl_pool_area_free(p->dev, a);
}

int sl_pool_host_claim(struct sl_pool *p, uid_t uid, int *fd, struct sl_err *err) {
  int rc;

  if (p->area != NULL && p->area->uid != uid && p->area->uid != (uid_t)-1)
    area_drop(p);
  if (p->area == NULL && (rc = sl_pool_area_new(uid, &p->area, err)) != 0)
    return rc;
  p->area->uid = uid;
  *fd = p->area->fd;
  return 0;
}

/* gcc 12 to 14 at -O3 take an atomic load of a member for a write into a zero-sized object
 * (a false -Wstringop-overflow, gcc PR 104475's kind): silenced here only. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
static size_t pinned_pieces(const struct sl_pool_area *a) {
  return __atomic_load_n(&a->nhost, __ATOMIC_ACQUIRE);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* One more piece, pinned at its place in the window (by the thread that set growing). The
 * file only grows (a client may have grown it further: no error, and a shrink would be
 * refused). */
static int grow_piece(struct sl_device *dev, struct sl_pool_area *a, struct sl_err *err) {
  size_t n = a->nhost;
  void *piece = a->window + n * SL_HOST_PIECE;
  void **host;
  int rc;

  if (n == a->host_cap) {
    host = realloc(a->host, (2 * n + 8) * sizeof(*host));
    if (host == NULL)
      return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
    a->host = host;
    a->host_cap = 2 * n + 8;
  }
  if ((rc = sl_seal_grow_to(a->fd, (n + 1) * SL_HOST_PIECE)) != 0)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "cannot grow the save area to %zu pieces: %s",
                      n + 1, strerror(-rc));
  if ((rc = sl_device_host_pin(dev, piece, SL_HOST_PIECE, err)) != 0)
    return rc;
  a->host[n] = piece;
  __atomic_store_n(&a->nhost, n + 1, __ATOMIC_RELEASE);
  return 0;
}

/* Toward want pieces: waits while another thread pins one and fewer than want are there;
 * then, if still short, pins the next piece itself. 0 once a piece was added or want are
 * there, or an error of its own pin. */
static int grow_next(struct sl_device *dev, struct sl_pool_area *a, size_t want,
                     struct sl_err *err) {
  int rc = 0;

  pthread_mutex_lock(&a->grow_lock);
  while (a->growing && a->nhost < want)
    pthread_cond_wait(&a->grown, &a->grow_lock);
  if (a->nhost >= want) {
    pthread_mutex_unlock(&a->grow_lock);
    return 0;
  }
  a->growing = 1;
  pthread_mutex_unlock(&a->grow_lock);
  rc = grow_piece(dev, a, err); /* the lock free meanwhile: a waiter may see nhost at once */
  pthread_mutex_lock(&a->grow_lock);
  a->growing = 0;
  pthread_cond_broadcast(&a->grown);
  pthread_mutex_unlock(&a->grow_lock);
  return rc;
}

/* Grows an area to hold bytes, a piece at a time: the pieces the pin ahead pins meanwhile
 * are not pinned again, and the wait ends as soon as the bytes are there. */
int sl_pool_area_reserve(struct sl_device *dev, struct sl_pool_area *a, uint64_t bytes,
                        struct sl_err *err) {
  size_t want = (size_t)((bytes + SL_HOST_PIECE - 1) / SL_HOST_PIECE);
  int rc = 0;

  if (want <= pinned_pieces(a))
    return 0;
  if (want * SL_HOST_PIECE > a->window_bytes)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "the save area cannot grow to %zu pieces of %llu "
                      "bytes: past the host's memory", want, SL_HOST_PIECE);
  while (rc == 0 && pinned_pieces(a) < want)
    rc = grow_next(dev, a, want, err);
  return rc;
}

int sl_pool_host_reserve(struct sl_pool *p, uint64_t bytes, struct sl_err *err) {
  int rc;

  if (p->area == NULL && (rc = sl_pool_area_new((uid_t)-1, &p->area, err)) != 0)
    return rc;
  return sl_pool_area_reserve(p->dev, p->area, bytes, err);
}

uint64_t sl_pool_area_ready(const struct sl_pool_area *a) {
  return a != NULL ? (uint64_t)pinned_pieces(a) * SL_HOST_PIECE : 0;
}

uint64_t sl_pool_host_bytes(const struct sl_pool *p) {
  uint64_t n = sl_pool_area_ready(p->area);

  for (int i = 0; i < SL_POOL_SPARES; i++)
    n += sl_pool_area_ready(p->spares[i]);
  return n;
}

const struct sl_pool_area *sl_pool_host_area(const struct sl_pool *p) {
  return p->area;
}

int sl_pool_host_owner(const struct sl_pool *p, uid_t *uid) {
  if (p->area == NULL || p->area->uid == (uid_t)-1)
    return -1;
  *uid = p->area->uid;
  return 0;
}

void sl_pool_host_release(struct sl_pool *p) {
  area_drop(p);
}

/* ------------------------------------------------------------------ pinning ahead */

/* An area's goal: bytes in whole pieces, within the window (pinned bytes cannot pass the
 * host's memory). It only rises: a smaller keep lent later needs no less room. */
int sl_pool_pin_ahead(struct sl_pool *p, struct sl_pool_area *a, uint64_t bytes) {
  size_t want;

  if (a == NULL && (a = p->area) == NULL)
    return 0;
  if (bytes > a->window_bytes)
    bytes = a->window_bytes;
  want = (size_t)((bytes + SL_HOST_PIECE - 1) / SL_HOST_PIECE);
  if (want > __atomic_load_n(&a->pin_target, __ATOMIC_RELAXED))
    __atomic_store_n(&a->pin_target, want, __ATOMIC_RELAXED);
  return pinned_pieces(a) < __atomic_load_n(&a->pin_target, __ATOMIC_RELAXED);
}

int sl_pool_pin_step(struct sl_pool *p, struct sl_pool_area *a, struct sl_err *err) {
  size_t n = pinned_pieces(a);
  int rc;

  if (n >= __atomic_load_n(&a->pin_target, __ATOMIC_RELAXED))
    return 0;
  if ((rc = grow_next(p->dev, a, n + 1, err)) != 0) /* a save may have pinned it meanwhile */
    return rc;
  return pinned_pieces(a) < __atomic_load_n(&a->pin_target, __ATOMIC_RELAXED);
}

void sl_pool_pin_stop(struct sl_pool_area *a) {
  if (a != NULL)
    __atomic_store_n(&a->pin_target, 0, __ATOMIC_RELAXED);
}

int sl_pool_pin_progress(const struct sl_pool_area *a, uint64_t *target, uint64_t *done) {
  size_t want = a != NULL ? __atomic_load_n(&a->pin_target, __ATOMIC_RELAXED) : 0;

  *target = (uint64_t)want * SL_HOST_PIECE;
  *done = sl_pool_area_ready(a);
  return a != NULL && pinned_pieces(a) < want;
}

/* The spare of uid holding the most, or -1. */
static int best_spare(const struct sl_pool *p, uid_t uid) {
  int best = -1;

  for (int i = 0; i < SL_POOL_SPARES; i++)
    if (p->spares[i] != NULL && p->spares[i]->uid == uid &&
        (best < 0 || pinned_pieces(p->spares[i]) > pinned_pieces(p->spares[best])))
      best = i;
  return best;
}

int sl_pool_area_take(struct sl_pool *p, uid_t uid, struct sl_pool_area **out, int *fd,
                      struct sl_err *err) {
  int i = best_spare(p, uid), rc;

  if (i >= 0) {
    *out = p->spares[i];
    p->spares[i] = NULL;
  } else if ((rc = sl_pool_area_new(uid, out, err)) != 0) {
    return rc;
  }
  *fd = (*out)->fd;
  return 0;
}

uint64_t sl_pool_area_bytes(const struct sl_pool_area *a) {
  return sl_pool_area_ready(a);
}

void sl_pool_area_drop(struct sl_pool *p, struct sl_pool_area *a) {
  if (a == NULL)
    return;
  __atomic_store_n(&a->pin_target, 0, __ATOMIC_RELAXED); /* a pin ahead of it stops */
  if (a->busy > 0)
    a->doomed = 1; /* freed by the last transfer that uses it */
  else
    sl_pool_area_free(p->dev, a);
}

_Static_assert(SL_POOL_AREA_USERS_MAX == 1 + SL_POOL_SPARES, "pool.h's bound on area users");

uid_t sl_pool_area_uid(const struct sl_pool_area *a) {
  return a->uid;
}

size_t sl_pool_area_users(const struct sl_pool *p, int loans, uid_t *uids) {
  size_t n = 0;

  if (loans && p->area != NULL && p->area->uid != (uid_t)-1)
    uids[n++] = p->area->uid;
  for (int i = 0; i < SL_POOL_SPARES; i++)
    if (p->spares[i] != NULL)
      uids[n++] = p->spares[i]->uid;
  return n;
}

void sl_pool_spares_drop(struct sl_pool *p, uid_t uid) {
  for (int i = 0; i < SL_POOL_SPARES; i++) {
    if (p->spares[i] != NULL && p->spares[i]->uid == uid) {
      sl_pool_area_drop(p, p->spares[i]);
      p->spares[i] = NULL;
    }
  }
}

/* An empty spare slot, else the one holding the fewest pinned pieces. */
static int free_or_smallest_slot(const struct sl_pool *p) {
  int slot = 0;

  for (int i = 1; i < SL_POOL_SPARES && p->spares[slot] != NULL; i++)
    if (p->spares[i] == NULL || pinned_pieces(p->spares[i]) < pinned_pieces(p->spares[slot]))
      slot = i;
  return slot;
}

/* Kept as a spare in place of the smallest one (or an empty slot); the loser goes. */
void sl_pool_area_give(struct sl_pool *p, struct sl_pool_area *a) {
  int slot = free_or_smallest_slot(p);
  struct sl_pool_area *loser;

  if (a == NULL)
    return;
  loser = p->spares[slot];
  if (loser != NULL && pinned_pieces(loser) > pinned_pieces(a)) {
    loser = a; /* every spare is larger: this one goes */
  } else {
    p->spares[slot] = a;
  }
  sl_pool_area_drop(p, loser);
}

struct sl_pool_area *sl_pool_area_hold(struct sl_pool *p) {
  return sl_pool_area_ref(p->area);
}

struct sl_pool_area *sl_pool_area_ref(struct sl_pool_area *a) {
  if (a != NULL)
    a->busy++;
  return a;
}

static int below_goal(const struct sl_pool_area *a) {
  return a != NULL && pinned_pieces(a) < __atomic_load_n(&a->pin_target, __ATOMIC_RELAXED);
}

struct sl_pool_area *sl_pool_area_to_pin(struct sl_pool *p) {
  if (below_goal(p->area))
    return p->area;
  for (int i = 0; i < SL_POOL_SPARES; i++)
    if (below_goal(p->spares[i]))
      return p->spares[i];
  return NULL;
}

/* A spare for uid's next release to pin ahead: its largest, else a new one in a free slot or
 * in place of the smallest spare (which holds nothing: an idle area, only pinned). */
int sl_pool_spare_of(struct sl_pool *p, uid_t uid, struct sl_pool_area **out,
                     struct sl_err *err) {
  int i = best_spare(p, uid), slot = free_or_smallest_slot(p), rc;

  if (i >= 0) {
    *out = p->spares[i];
    return 0;
  }
  if ((rc = sl_pool_area_new(uid, out, err)) != 0)
    return rc;
  sl_pool_area_drop(p, p->spares[slot]);
  p->spares[slot] = *out;
  return 0;
}

void sl_pool_area_detach(struct sl_pool *p, struct sl_pool_area *a) {
  if (a == NULL)
    return;
  if (p->area == a)
    p->area = NULL; /* the next loan claims a new one */
  __atomic_store_n(&a->pin_target, 0, __ATOMIC_RELAXED); /* the pin ahead stops */
  a->doomed = 1;    /* freed at the last put */
}

void sl_pool_area_put(struct sl_pool *p, struct sl_pool_area *a) {
  if (a != NULL && --a->busy == 0 && a->doomed)
    sl_pool_area_free(p->dev, a);
}

void sl_pool_free(struct sl_pool *p) {
  if (p == NULL)
    return;
  while (p->chunks != NULL)
    sl_pool_chunk_release(p, p->chunks->id);
  while (p->regions != NULL)
    sl_pool_region_free(p, sl_pool_region_take(p, p->regions->id));
  area_drop(p);
  for (int i = 0; i < SL_POOL_SPARES; i++)
    if (p->spares[i] != NULL)
      sl_pool_area_free(p->dev, p->spares[i]);
  free(p);
}
