/* pool_transfer.c - a pool's transfers: kept bytes copied between a region and the save area,
 * moved inside the region, and the pages a transfer makes again first (a resume, a loan's
 * fresh pages) or lets go of after (a release). Run off the loop, one at a time (jobs.c).
 *
 * Floor 2 (daemon.h's floors).
 */
#include "pool_impl.h"

#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "grow.h"
#include "log.h"

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

  if (p->area == NULL && (rc = sl_pool_area_new((uid_t)-1, &p->area, err)) != 0)
    return rc;
  return sl_pool_transfer_new_in(p, p->area, dir, region_id, c, n, m, nm, out, err);
}

int sl_pool_transfer_new_in(struct sl_pool *p, struct sl_pool_area *area, enum sl_copy_dir dir,
                            uint64_t region_id, const struct sl_copy *c, size_t n,
                            const struct sl_move *m, size_t nm, struct sl_pool_transfer **out,
                            struct sl_err *err) {
  struct sl_pool_region *r = sl_pool_find_region(p, region_id);
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
    sl_pool_unmap_range(t->pool, r, pages[i], pages[j - 1] + 1);
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

/* A loan's end (MUST_FRESH): subletd lets go of its own mapping and handle of every old page
 * first. They hold nothing of the owner's (a granted page's kept bytes were moved or saved
 * before the grant, and the restore writes into the fresh pages), so keeping them until the
 * fresh ones were made asked the device for both: a borrower that had taken the whole device
 * left an end waiting for memory that only subletd held (issue 41). Where no one else maps
 * them now, their memory is the device's again for the fresh pages. The region is getting
 * fresh pages until the end commits (no PagesGet, Lend or release: books.c), so nothing reads
 * these entries meanwhile; a page dropped by an earlier try is a hole already. */
static int drop_old(struct sl_pool_transfer *t, struct sl_err *err) {
  return t->must == MUST_FRESH ? sl_pool_transfer_drop(t, t->replace, t->nreplace, err) : 0;
}

/* New pages for the region pages of t->replace, all or none: without all of them the run
 * copies nothing (sl_pool_transfer_run). */
static void run_replace(struct sl_pool_transfer *t) {
  struct sl_err err = {0};
  int rc = drop_old(t, &err);

  while (rc == 0 && t->nfresh < t->nreplace) {
    rc = sl_device_create(t->pool->dev, fresh_bytes(t, t->nfresh), &t->fresh[t->nfresh], &err);
    t->nfresh += rc == 0;
  }
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
  if (rc == 0 && host_end > sl_pool_area_ready(t->area)) {
    k = ready_first(t->pieces, t->npieces, sl_pool_area_ready(t->area));
    rc = copy_pieces(t, t->pieces, k, err);
  }
  if (rc == 0)
    rc = sl_pool_area_reserve(t->pool->dev, t->area, host_end, err);
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
                      "place of the %zu pages a borrower of another user was granted (subletd "
                      "let go of those: their memory comes back once no process maps them): "
                      "nothing is restored into pages it may still reach (the kept bytes wait, "
                      "safe); reclaim again once device memory is free", size, t->nreplace);
  return sl_err_set(err, SUBLET_ENOMEM, "the device lacks the memory to make %s again: "
                    "whoever holds it must free it first; the release goes on", size);
}

int sl_pool_transfer_run(struct sl_pool_transfer *t, double *copy_seconds, double *move_seconds,
                         struct sl_err *err) {
  int save = t->dir == SL_COPY_TO_HOST, rc;
  double t0 = sl_clock_now(), t1;

  if (t->region->moved != NULL) /* never: the growth's done ran before this job (pool_impl.h) */
    return sl_err_set(err, SUBLET_EIO, "internal error: region %llu's mapping in subletd is "
                      "moving; nothing was copied (report it)",
                      (unsigned long long)t->region->id);
  if (t->region->unmapped) /* its map ran before (jobs run in order), and failed */
    return sl_err_set(err, SUBLET_EIO, "region %llu's pages are not mapped in subletd (its log "
                      "says why): release the region and make another",
                      (unsigned long long)t->region->id);
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
    sl_pool_region_unmap_release(t->pool, r);
  if (--t->area->busy == 0 && t->area->doomed)
    sl_pool_area_free(t->pool->dev, t->area);
  free(t->copies);
  free(t->moves);
  free(t->pieces);
  free(t);
}
