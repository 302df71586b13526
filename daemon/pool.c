/* pool.c - region pages, fresh chunks and the host save area on the device.
 *
 * The save area is a memfd, so that the owner of the kept bytes in it can be given an fd and
 * read them itself if the daemon dies (daemon/rescue.c). It belongs to one user at a time:
 * a loan of another user's region gets a new one (the old one goes once no copy uses it), so
 * that an owner's fd never shows another user's bytes.
 */
#include "pool.h"

#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "grow.h"
#include "log.h"
#include "seal.h"
#include "wire.h"

/* The save area grows in pieces of this size, so that it never has to move (saved bytes stay
 * where they are) and pinning is paid once per piece, not per loan. */
#define SL_HOST_PIECE (256ull << 20)

struct sl_pool_region {
  uint64_t id;
  uint64_t npages;
  uint64_t cap_pages; /* address space reserved at base, and room in pages: npages, or (a
                         growable region) the device's whole memory, so that growing maps only
                         the new pages and never moves the old ones */
  sl_handle *pages;
  uint32_t *span; /* pages[p] backs span[p] pages (a page group, books.h; 0 inside one, and
                     1 for a released page, which has no handle) */
  void *base;   /* the daemon's own mapping of all pages, contiguous */
  int busy;     /* transfers that hold it: destroying waits for the last */
  int doomed;   /* destroyed while busy: goes when the last transfer is freed */
  struct sl_pool_region *next;
};

/* The host save area: a memfd pinned in pieces of SL_HOST_PIECE bytes. Its clients get it
 * sealed read-only (common/seal.h), so the daemon's one writable mapping, the window, is made
 * before the seal, over all the area may ever hold: a piece is pinned in it as the file grows
 * (a new writable mapping would be refused), and no client can shrink the file under it. */
struct sl_pool_area {
  int fd;         /* owned; sealed read-only */
  uid_t uid;      /* whose kept bytes it holds; (uid_t)-1: nobody's yet */
  char *window;   /* MAP_SHARED of window_bytes, from offset 0; or NULL */
  uint64_t window_bytes;
  /* A running transfer and the pin ahead (sl_pool_pin_step) grow the area on two threads,
   * one piece at a time: whoever sets growing (under grow_lock) pins the next piece, the
   * lock released meanwhile; the other waits on grown for it, and goes on as soon as the
   * pieces it needs are there (a save never waits for more), or pins the next one itself
   * once nobody does. nhost only grows, stored after its piece is pinned: read without the
   * lock (atomically) it says what is usable now. */
  pthread_mutex_t grow_lock;
  pthread_cond_t grown;
  int growing;    /* a thread pins the next piece now (under grow_lock) */
  void **host;    /* the pinned pieces: window + i * SL_HOST_PIECE (the grower's) */
  size_t nhost;
  size_t host_cap; /* host's room */
  size_t pin_target; /* pieces the pin ahead grows it to (atomic; 0: none, or stopped) */
  int busy;       /* transfers (and the pin ahead) that use it */
  int doomed;     /* replaced while busy: freed when the last transfer is */
};

/* Why a transfer makes pages before it copies (it copies nothing unless it made them all). */
enum must_replace {
  MUST_NONE = 0,
  MUST_RESUME = 1, /* a release's resume: the pages were given back to the driver */
  MUST_FRESH = 2,  /* a loan's end: the pages a borrower of another user was granted */
};

struct sl_pool_transfer {
  struct sl_pool *pool;
  struct sl_pool_region *region;
  struct sl_pool_area *area;
  enum sl_copy_dir dir;
  struct sl_copy *copies; /* as given */
  size_t ncopies;
  struct sl_move *moves;  /* inside the region */
  size_t nmoves;
  struct sl_copy *pieces; /* the copies split where they cross host pieces: npieces */
  size_t npieces;
  uint64_t *replace;      /* region pages to give new pages first (sl_pool_transfer_replace) */
  uint32_t *rspan;        /* the pages each new handle backs (a group's): NULL, one each */
  sl_handle *fresh;       /* their new handles: created by the run */
  size_t nreplace, nfresh, nreplaced;
  size_t *replaced;       /* the caller's: nreplaced once the run is done */
  enum must_replace must; /* no copy runs unless every page was made: whose pages they are */
};

struct pool_chunk {
  uint64_t id;
  uint64_t npages;
  sl_handle handle;
  struct pool_chunk *next;
};

/* Save areas that releases gave back, kept (pinned) for the next release of their user. */
#define SL_POOL_SPARES 4

struct sl_pool {
  struct sl_device *dev;
  uint64_t page_size;
  struct sl_pool_region *regions;
  struct pool_chunk *chunks;
  struct sl_pool_area *area;  /* the current save area; NULL until first needed */
  struct sl_pool_area *spares[SL_POOL_SPARES]; /* releases' areas between releases */
};

int sl_pool_new(struct sl_device *dev, struct sl_pool **out) {
  struct sl_pool *p = calloc(1, sizeof(*p));

  if (p == NULL)
    return SUBLET_ENOHOSTMEM;
  p->dev = dev;
  p->page_size = sl_device_info(dev)->page_size;
  *out = p;
  return 0;
}

static struct sl_pool_region *find_region(const struct sl_pool *p, uint64_t id) {
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
static void unmap_range(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to) {
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
    unmap_range(p, r, from, mapped);
  }
  for (uint64_t i = from; i < created; i++) {
    if (r->pages[i] != 0) /* a released page, or one inside a group, has none */
      sl_device_release(p->dev, r->pages[i]);
    r->pages[i] = 0;
  }
}

static void region_unmap_release(struct sl_pool *p, struct sl_pool_region *r) {
  pages_undo(p, r, 0, r->npages, r->npages);
  if (r->base != NULL)
    sl_device_unreserve(p->dev, r->base, r->cap_pages * p->page_size);
  free(r->pages);
  free(r->span);
  free(r);
}

/* Creates pages [from, to) of r and maps them after the others, in r's reservation; touches
 * nothing else of r. On failure undoes exactly what it did. */
static int pages_add(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to,
                     struct sl_err *err) {
  uint64_t ps = p->page_size, created = from, mapped = from;
  int rc = 0;

  for (; created < to; created++) {
    r->span[created] = 1;
    if ((rc = sl_device_create(p->dev, ps, &r->pages[created], err)) != 0)
      break;
  }
  for (; rc == 0 && mapped < to; mapped++)
    if ((rc = sl_device_map(p->dev, (char *)r->base + mapped * ps, ps, r->pages[mapped],
                            err)) != 0)
      break;
  if (rc == 0) /* once over the new span: a call per page costs far more */
    rc = sl_device_set_access(p->dev, (char *)r->base + from * ps, (to - from) * ps, err);
  if (rc != 0)
    pages_undo(p, r, from, created, mapped);
  return rc;
}

int sl_pool_region_build(struct sl_pool *p, uint64_t region_id, uint64_t npages,
                         uint64_t cap_pages, struct sl_pool_region **out, struct sl_err *err) {
  struct sl_pool_region *r = calloc(1, sizeof(*r));
  int rc;

  cap_pages = cap_pages > npages ? cap_pages : npages;
  if (r == NULL || (r->pages = calloc(cap_pages, sizeof(sl_handle))) == NULL ||
      (r->span = calloc(cap_pages, sizeof(*r->span))) == NULL) {
    if (r != NULL)
      free(r->pages);
    free(r);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a region's page table");
  }
  r->id = region_id;
  r->cap_pages = cap_pages;
  rc = sl_device_reserve(p->dev, cap_pages * p->page_size, &r->base, err);
  if (rc == 0 && (rc = pages_add(p, r, 0, npages, err)) == 0)
    r->npages = npages;
  if (rc == 0)
    *out = r;
  else
    region_unmap_release(p, r); /* npages 0: only the reservation */
  return rc;
}

struct sl_pool_region *sl_pool_region_hold(struct sl_pool *p, uint64_t region_id) {
  struct sl_pool_region *r = find_region(p, region_id);

  if (r != NULL)
    r->busy++;
  return r;
}

int sl_pool_region_grow(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages,
                        struct sl_err *err) {
  if (npages <= r->npages || npages > r->cap_pages)
    return sl_err_set(err, SUBLET_EINVAL, "region %llu has room for %llu pages, not %llu: "
                      "create it growable to grow it", (unsigned long long)r->id,
                      (unsigned long long)r->cap_pages, (unsigned long long)npages);
  return pages_add(p, r, r->npages, npages, err);
}

void sl_pool_region_grown(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages,
                          int keep) {
  if (keep)
    r->npages = npages;
  else
    pages_undo(p, r, r->npages, npages, npages);
  if (--r->busy == 0 && r->doomed)
    region_unmap_release(p, r);
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
    region_unmap_release(p, r);
}

int sl_pool_export_pages(struct sl_pool *p, uint64_t region_id, uint64_t first, uint32_t count,
                         int *fds, struct sl_err *err) {
  struct sl_pool_region *r = find_region(p, region_id);
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
  struct sl_pool_region *r = find_region(p, region_id);
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

static void area_free(struct sl_device *dev, struct sl_pool_area *a) {
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

static int area_new(uid_t uid, struct sl_pool_area **out, struct sl_err *err) {
  struct sl_pool_area *a = calloc(1, sizeof(*a));
  int rc;

  if (a == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  pthread_mutex_init(&a->grow_lock, NULL);
  pthread_cond_init(&a->grown, NULL);
  if ((rc = area_open(a)) != 0) {
    area_free(NULL, a); /* nothing pinned yet: no device call */
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
    area_free(p->dev, a);
}

int sl_pool_host_claim(struct sl_pool *p, uid_t uid, int *fd, struct sl_err *err) {
  int rc;

  if (p->area != NULL && p->area->uid != uid && p->area->uid != (uid_t)-1)
    area_drop(p);
  if (p->area == NULL && (rc = area_new(uid, &p->area, err)) != 0)
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
static int area_reserve(struct sl_device *dev, struct sl_pool_area *a, uint64_t bytes,
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

  if (p->area == NULL && (rc = area_new((uid_t)-1, &p->area, err)) != 0)
    return rc;
  return area_reserve(p->dev, p->area, bytes, err);
}

static uint64_t area_bytes(const struct sl_pool_area *a) {
  return a != NULL ? (uint64_t)pinned_pieces(a) * SL_HOST_PIECE : 0;
}

uint64_t sl_pool_host_bytes(const struct sl_pool *p) {
  uint64_t n = area_bytes(p->area);

  for (int i = 0; i < SL_POOL_SPARES; i++)
    n += area_bytes(p->spares[i]);
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

/* The current area's goal: bytes in whole pieces, within the window (pinned bytes cannot
 * pass the host's memory). It only rises: a smaller keep lent later needs no less room. */
int sl_pool_pin_ahead(struct sl_pool *p, uint64_t bytes) {
  struct sl_pool_area *a = p->area;
  size_t want;

  if (a == NULL)
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
  *done = area_bytes(a);
  return a != NULL && pinned_pieces(a) < want;
}

/* The spare of uid holding the most, or -1. */
static int best_spare(const struct sl_pool *p, uid_t uid) {
  int best = -1;

  for (int i = 0; i < SL_POOL_SPARES; i++)
    if (p->spares[i] != NULL && p->spares[i]->uid == uid &&
        (best < 0 || p->spares[i]->nhost > p->spares[best]->nhost))
      best = i;
  return best;
}

int sl_pool_area_take(struct sl_pool *p, uid_t uid, struct sl_pool_area **out, int *fd,
                      struct sl_err *err) {
  int i = best_spare(p, uid), rc;

  if (i >= 0) {
    *out = p->spares[i];
    p->spares[i] = NULL;
  } else if ((rc = area_new(uid, out, err)) != 0) {
    return rc;
  }
  *fd = (*out)->fd;
  return 0;
}

uint64_t sl_pool_area_bytes(const struct sl_pool_area *a) {
  return area_bytes(a);
}

/* Kept as a spare in place of the smallest one (or an empty slot); the loser goes. */
void sl_pool_area_give(struct sl_pool *p, struct sl_pool_area *a) {
  int slot = 0;
  struct sl_pool_area *loser;

  if (a == NULL)
    return;
  for (int i = 1; i < SL_POOL_SPARES; i++)
    if (p->spares[i] == NULL || (p->spares[slot] != NULL &&
                                 p->spares[i]->nhost < p->spares[slot]->nhost))
      slot = i;
  loser = p->spares[slot];
  if (loser != NULL && loser->nhost > a->nhost) {
    loser = a; /* every spare is larger: this one goes */
  } else {
    p->spares[slot] = a;
  }
  if (loser == NULL)
    return;
  if (loser->busy > 0)
    loser->doomed = 1;
  else
    area_free(p->dev, loser);
}

struct sl_pool_area *sl_pool_area_hold(struct sl_pool *p) {
  if (p->area != NULL)
    p->area->busy++;
  return p->area;
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
    area_free(p->dev, a);
}

/* How many pieces the copies make once split where they cross host pieces. */
static size_t count_pieces(const struct sl_copy *c, size_t n) {
  size_t total = 0;

  for (size_t i = 0; i < n; i++)
    if (c[i].len > 0)
      total += (size_t)((c[i].host_off + c[i].len - 1) / SL_HOST_PIECE -
                        c[i].host_off / SL_HOST_PIECE + 1);
  return total;
}

/* Splits copies where they cross host pieces, each pinned on its own (a copy must lie in one
 * pinned range). The pieces sit side by side in the window, so the split copies keep their
 * offsets from its start and run as one call: a call per piece waited for the device after
 * each 256 MiB. */
static int split_pieces(struct sl_pool_transfer *t, const struct sl_copy *c, size_t n,
                        struct sl_err *err) {
  t->pieces = malloc((count_pieces(c, n) + 1) * sizeof(*t->pieces));
  if (t->pieces == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a copy's pieces");
  for (size_t i = 0; i < n; i++) {
    struct sl_copy cur = c[i];
    while (cur.len > 0) {
      uint64_t in = cur.host_off % SL_HOST_PIECE;
      uint64_t len = cur.len < SL_HOST_PIECE - in ? cur.len : SL_HOST_PIECE - in;
      t->pieces[t->npieces++] = (struct sl_copy){cur.dev_off, cur.host_off, len};
      cur.dev_off += len;
      cur.host_off += len;
      cur.len -= len;
    }
  }
  return 0;
}

static int no_pages(uint64_t region_id, struct sl_err *err) {
  return sl_err_set(err, SUBLET_ENOENT, "region %llu has no pages in the pool",
                    (unsigned long long)region_id);
}

int sl_pool_transfer_new(struct sl_pool *p, enum sl_copy_dir dir, uint64_t region_id,
                         const struct sl_copy *c, size_t n, const struct sl_move *m,
                         size_t nm, struct sl_pool_transfer **out, struct sl_err *err) {
  int rc;

  if (p->area == NULL && (rc = area_new((uid_t)-1, &p->area, err)) != 0)
    return rc;
  return sl_pool_transfer_new_in(p, p->area, dir, region_id, c, n, m, nm, out, err);
}

int sl_pool_transfer_new_in(struct sl_pool *p, struct sl_pool_area *area, enum sl_copy_dir dir,
                            uint64_t region_id, const struct sl_copy *c, size_t n,
                            const struct sl_move *m, size_t nm, struct sl_pool_transfer **out,
                            struct sl_err *err) {
  struct sl_pool_region *r = find_region(p, region_id);
  struct sl_pool_transfer *t;

  if (r == NULL)
    return no_pages(region_id, err);
  t = calloc(1, sizeof(*t));
  if (t == NULL || (t->copies = sl_dup(c, n, sizeof(*c))) == NULL) {
    if (t == NULL || n > 0) {
      free(t);
      return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
    }
  }
  t->moves = sl_dup(m, nm, sizeof(*m));
  if (nm > 0 && t->moves == NULL) {
    free(t->copies);
    free(t);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  }
  t->ncopies = n;
  t->nmoves = nm;
  t->pool = p;
  t->region = r;
  t->area = area;
  t->dir = dir;
  r->busy++;
  t->area->busy++;
  *out = t;
  return 0;
}

static int replace_init(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                        size_t *replaced, enum must_replace must, struct sl_err *err) {
  for (size_t i = 0; i < n; i++)
    if (pages[i] >= t->region->npages)
      return sl_err_set(err, SUBLET_EINVAL, "page %llu is not in region %llu",
                        (unsigned long long)pages[i], (unsigned long long)t->region->id);
  t->replace = sl_dup(pages, n, sizeof(*pages));
  t->fresh = n > 0 ? calloc(n, sizeof(*t->fresh)) : NULL;
  if (n > 0 && (t->replace == NULL || t->fresh == NULL))
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for %zu fresh pages", n);
  t->nreplace = n;
  t->replaced = replaced;
  t->must = must;
  *replaced = 0;
  return 0;
}

int sl_pool_transfer_replace(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                             size_t *replaced, struct sl_err *err) {
  return replace_init(t, pages, n, replaced, MUST_FRESH, err);
}

int sl_pool_transfer_replace_all(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                                 size_t *replaced, struct sl_err *err) {
  return replace_init(t, pages, n, replaced, MUST_RESUME, err);
}

int sl_pool_transfer_make_groups(struct sl_pool_transfer *t, const uint64_t *groups, size_t n,
                                 size_t *replaced, struct sl_err *err) {
  uint64_t *heads = malloc((n + 1) * sizeof(*heads));
  int rc = 0;

  if (heads == NULL || (t->rspan = malloc((n + 1) * sizeof(*t->rspan))) == NULL) {
    free(heads);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for %zu groups", n);
  }
  for (size_t i = 0; rc == 0 && i < n; i++) {
    uint64_t first = groups[2 * i], count = groups[2 * i + 1];
    if (count == 0 || count > UINT32_MAX || first >= t->region->npages ||
        count > t->region->npages - first)
      rc = sl_err_set(err, SUBLET_EINVAL, "group [%llu, +%llu) is not in region %llu",
                      (unsigned long long)first, (unsigned long long)count,
                      (unsigned long long)t->region->id);
    heads[i] = first;
    t->rspan[i] = (uint32_t)count;
  }
  if (rc == 0)
    rc = replace_init(t, heads, n, replaced, MUST_RESUME, err);
  free(heads);
  return rc;
}

int sl_pool_transfer_drop(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                          struct sl_err *err) {
  struct sl_pool_region *r = t->region;
  int rc = sl_device_synchronize(t->pool->dev, err);

  for (size_t i = 0; rc == 0 && i < n; i++)
    if (pages[i] >= r->npages)
      rc = sl_err_set(err, SUBLET_EINVAL, "page %llu is not in region %llu",
                      (unsigned long long)pages[i], (unsigned long long)r->id);
  /* pages ascend (the books' order): a run of them goes in one unmap call where the device
   * takes it. That saves calls (memfd: one munmap), not driver time: CUDA's cuMemUnmap costs
   * per mapping however many one call covers (docs/benchmarks.md, 2026-12-03). */
  for (size_t i = 0, j; rc == 0 && i < n; i = j) {
    for (j = i + 1; j < n && pages[j] == pages[j - 1] + 1; j++)
      ;
    unmap_range(t->pool, r, pages[i], pages[j - 1] + 1);
  }
  for (size_t i = 0; rc == 0 && i < n; i++) { /* whole groups (the books see to it) */
    if (r->pages[pages[i]] != 0)
      sl_device_release(t->pool->dev, r->pages[pages[i]]);
    r->pages[pages[i]] = 0;
    r->span[pages[i]] = 1;
  }
  return rc;
}

static void *page_addr(const struct sl_pool_transfer *t, uint64_t page) {
  return (char *)t->region->base + page * t->pool->page_size;
}

/* The bytes the ith new handle backs: a page, or a group's pages. */
static uint64_t fresh_bytes(const struct sl_pool_transfer *t, size_t i) {
  return (t->rspan != NULL ? t->rspan[i] : 1) * t->pool->page_size;
}

/* Puts the old pages back in the daemon's mapping from the nth replaced page down. */
static void unreplace(struct sl_pool_transfer *t, size_t n) {
  struct sl_device *dev = t->pool->dev;
  uint64_t ps = t->pool->page_size;

  while (n-- > 0) {
    void *at = page_addr(t, t->replace[n]);
    sl_device_unmap_idle(dev, at, fresh_bytes(t, n));
    if (t->region->pages[t->replace[n]] != 0 && /* a released page had none */
        sl_device_map(dev, at, ps, t->region->pages[t->replace[n]], NULL) == 0)
      sl_device_set_access(dev, at, ps, NULL);
  }
}

/* Access granted over each run of consecutive replaced pages (t->replace ascends), not over
 * the whole region: another release's pages may be unmapped holes in it, and a range with a
 * hole is refused. A call per run, not per page (a call per page costs far more). */
static int access_runs(struct sl_pool_transfer *t, struct sl_err *err) {
  uint64_t ps = t->pool->page_size, bytes;
  int rc = 0;

  for (size_t i = 0, j; rc == 0 && i < t->nreplace; i = j) {
    bytes = fresh_bytes(t, i);
    for (j = i + 1; j < t->nreplace && t->replace[j] == t->replace[j - 1] +
                                           fresh_bytes(t, j - 1) / ps; j++)
      bytes += fresh_bytes(t, j);
    rc = sl_device_set_access(t->pool->dev, page_addr(t, t->replace[i]), bytes, err);
  }
  return rc;
}

/* Maps the new pages where the old ones were (the device idle: the borrower let go, and the
 * daemon's own copies wait for each other), then grants access run by run. */
static int swap_mappings(struct sl_pool_transfer *t, struct sl_err *err) {
  struct sl_device *dev = t->pool->dev;
  uint64_t ps = t->pool->page_size;
  int rc = sl_device_synchronize(dev, err);

  for (size_t i = 0; rc == 0 && i < t->nreplace; i++) {
    void *at = page_addr(t, t->replace[i]);
    if (t->rspan == NULL) /* a released page or group has no mapping left */
      sl_device_unmap_idle(dev, at, ps);
    rc = sl_device_map(dev, at, fresh_bytes(t, i), t->fresh[i], err);
    if (rc != 0)
      unreplace(t, i + 1); /* this one and those before it: unmapping one not mapped is harmless */
  }
  if (rc == 0 && (rc = access_runs(t, err)) != 0)
    unreplace(t, t->nreplace);
  return rc;
}

/* New pages for the region pages of t->replace, all or none: without all of them the run
 * copies nothing (sl_pool_transfer_run). */
static void run_replace(struct sl_pool_transfer *t) {
  struct sl_err err = {0};
  int rc = 0;

  for (; rc == 0 && t->nfresh < t->nreplace; t->nfresh++)
    rc = sl_device_create(t->pool->dev, fresh_bytes(t, t->nfresh), &t->fresh[t->nfresh], &err);
  if (rc != 0)
    t->nfresh--; /* the last create failed */
  if (rc == 0)
    rc = swap_mappings(t, &err);
  if (rc != 0) {
    sl_warn("region %llu: no fresh memory for %zu pages: %s", (unsigned long long)t->region->id,
            t->nreplace, err.msg);
    return;
  }
  t->nreplaced = t->nreplace;
  *t->replaced = 0;
  for (size_t i = 0; i < t->nreplaced; i++) /* in pages */
    *t->replaced += fresh_bytes(t, i) / t->pool->page_size;
}

/* On the loop: the pool's table takes the new handles, the old ones go (or, when the run
 * could not replace them, the new ones). */
static void settle_replace(struct sl_pool_transfer *t) {
  struct sl_pool_region *r = t->region;

  for (size_t i = 0; i < t->nfresh; i++) {
    sl_handle *page = &r->pages[t->replace[i]];
    if (i < t->nreplaced) {
      uint32_t n = (uint32_t)(fresh_bytes(t, i) / t->pool->page_size);
      if (*page != 0) /* a released page had none */
        sl_device_release(t->pool->dev, *page);
      *page = t->fresh[i];
      memset(&r->span[t->replace[i]], 0, n * sizeof(*r->span));
      r->span[t->replace[i]] = n;
    } else {
      sl_device_release(t->pool->dev, t->fresh[i]);
    }
  }
  free(t->replace);
  free(t->rspan);
  free(t->fresh);
}

/* Puts the pieces that lie wholly in the first ready bytes of the area first; returns how
 * many they are. */
static size_t ready_first(struct sl_copy *pc, size_t n, uint64_t ready) {
  size_t k = 0;

  for (size_t i = 0; i < n; i++) {
    if (pc[i].host_off + pc[i].len <= ready) {
      struct sl_copy tmp = pc[k];
      pc[k++] = pc[i];
      pc[i] = tmp;
    }
  }
  return k;
}

static int copy_pieces(struct sl_pool_transfer *t, const struct sl_copy *pc, size_t n,
                       struct sl_err *err) {
  return n > 0 ? sl_device_copy(t->pool->dev, t->dir, t->region->base, t->area->window, pc, n,
                                err)
               : 0;
}

/* The copies to or from the save area. Off the loop: growing the save area pins host memory
 * (a fraction of a second per GiB), and only the running transfer (and the pin ahead, under
 * the area's lock) touches the area. A save that reaches pieces not pinned yet first copies
 * into those that are, while the pin ahead goes on, then pins the rest (waiting at most for
 * the piece being pinned) and copies into it: two copy calls, not one per piece. */
static int run_copies(struct sl_pool_transfer *t, struct sl_err *err) {
  uint64_t host_end = 0;
  size_t k = 0;
  int rc = 0;

  if (t->ncopies == 0)
    return 0;
  if (t->area == NULL) /* every transfer with copies holds an area (transfer_new_in) */
    return sl_err_set(err, SUBLET_EINVAL, "internal error: copies without a save area");
  for (size_t i = 0; i < t->ncopies; i++)
    if (t->copies[i].host_off + t->copies[i].len > host_end)
      host_end = t->copies[i].host_off + t->copies[i].len;
  rc = split_pieces(t, t->copies, t->ncopies, err);
  if (rc == 0 && host_end > area_bytes(t->area)) {
    k = ready_first(t->pieces, t->npieces, area_bytes(t->area));
    rc = copy_pieces(t, t->pieces, k, err);
  }
  if (rc == 0)
    rc = area_reserve(t->pool->dev, t->area, host_end, err);
  if (rc == 0)
    rc = copy_pieces(t, t->pieces + k, t->npieces - k, err);
  return rc;
}

static int run_moves(struct sl_pool_transfer *t, struct sl_err *err) {
  return t->nmoves > 0 ? sl_device_move(t->pool->dev, t->region->base, t->moves, t->nmoves, err)
                       : 0;
}

static uint64_t replace_bytes(const struct sl_pool_transfer *t) {
  uint64_t n = 0;

  for (size_t i = 0; i < t->nreplace; i++)
    n += fresh_bytes(t, i);
  return n;
}

/* The pages could not all be made: the run copies nothing, and says why. */
static int no_room(const struct sl_pool_transfer *t, struct sl_err *err) {
  char size[16];

  sl_format_size(size, replace_bytes(t));
  if (t->must == MUST_FRESH)
    return sl_err_set(err, SUBLET_ENOMEM, "the device lacks %s of memory for fresh pages in "
                      "place of the %zu pages a borrower of another user was granted: nothing "
                      "is restored into pages it may still reach (the kept bytes wait, safe); "
                      "free device memory and reclaim again", size, t->nreplace);
  return sl_err_set(err, SUBLET_ENOMEM, "the device lacks the memory to make %s again: "
                    "whoever holds it must free it first; the release goes on", size);
}

int sl_pool_transfer_run(struct sl_pool_transfer *t, double *copy_seconds, double *move_seconds,
                         struct sl_err *err) {
  int save = t->dir == SL_COPY_TO_HOST, rc;
  double t0 = sl_clock_now(), t1;

  if (t->nreplace > 0)
    run_replace(t);
  if (t->must != MUST_NONE && t->nreplaced != t->nreplace)
    return no_room(t, err);
  rc = save ? run_moves(t, err) : run_copies(t, err);
  t1 = sl_clock_now();
  if (rc == 0)
    rc = save ? run_copies(t, err) : run_moves(t, err);
  *copy_seconds = save ? sl_clock_now() - t1 : t1 - t0;
  *move_seconds = save ? t1 - t0 : sl_clock_now() - t1;
  return rc;
}

void sl_pool_transfer_free(struct sl_pool_transfer *t) {
  struct sl_pool_region *r;

  if (t == NULL)
    return;
  r = t->region;
  settle_replace(t);
  if (--r->busy == 0 && r->doomed)
    region_unmap_release(t->pool, r);
  if (--t->area->busy == 0 && t->area->doomed)
    area_free(t->pool->dev, t->area);
  free(t->copies);
  free(t->moves);
  free(t->pieces);
  free(t);
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
      area_free(p->dev, p->spares[i]);
  free(p);
}
