/* books_release.c - the books' releases: region pages given back to the device's driver until
 * a resume (books.h, "Releases"; docs/design/release.md). Plain C, like the rest of the books.
 *
 * A release reuses a loan's draft and plan. Of the region's U + K pages that are not pinned
 * (U holding no kept byte, K some), T stay: as many as the kept bytes fill (ceil(kept bytes /
 * page)), at most the caller's stay. They are the window of T consecutive pages (pinned ones
 * skipped) that holds the most kept bytes: moving a kept byte on the GPU costs far less than
 * a page group's handle (a 2 MiB page's mapping costs what moving 30 MiB would), so the pages
 * that stay are chosen to leave the released ones as one or two runs, whatever the keep
 * (rows of a KV cache kept in place left 2,560 runs at 64 GiB, 3.4 s of handles a resume).
 * The plan runs over a zone of the kept pages outside the window, then the window's pages,
 * each ascending: its one step reaches the former and sends their kept bytes into the holes
 * of the window, and to the host for what those cannot hold (plan.h). Every page outside the
 * window is released, less the pages of groups it would not release whole (books.h, "Page
 * groups"): those are held.
 *
 * Floor 3 (books_impl.h).
 */
#include <inttypes.h>
#include <string.h>

#include "books_impl.h"
#include "grow.h"

#define SL_SWAP(a, b) do { void *t_ = (a); (a) = (b); (b) = t_; } while (0)

static const char *const rel_state_names[] = {"", "releasing", "released", "resuming",
                                              "restoring"};

static struct sl_release *find_release(const struct sl_books *b, uint64_t id) {
  return sl_books_find_by_id(b->releases, b->nreleases, sizeof(*b->releases), id);
}

/* A release named by client_id, or NULL: none, or another user's it may not see (refused as
 * a missing one, word for word: sl_books_region_seen). */
static struct sl_release *release_seen(const struct sl_books *b, uint64_t client_id,
                                       uint64_t id) {
  struct sl_release *rel = find_release(b, id);
  const struct sl_region *r = rel != NULL ? sl_books_find_region(b, rel->region_id) : NULL;

  return r != NULL && sl_books_sees(b, client_id, r->owner.uid) ? rel : NULL;
}

static void more_free(struct sl_release_more *m) {
  if (m == NULL)
    return;
  free(m->released);
  free(m->zone);
  free(m->moves);
  free(m->saves);
  free(m);
}

static void release_free(struct sl_release *rel) {
  more_free(rel->more);
  sl_books_draft_free(rel->l);
  free(rel->released);
  free(rel->groups);
  free(rel->zone);
}

static void release_delete(struct sl_books *b, struct sl_release *rel) {
  size_t i = (size_t)(rel - b->releases);

  release_free(rel);
  memmove(rel, rel + 1, (b->nreleases - i - 1) * sizeof(*rel));
  b->nreleases--;
}

void sl_books_releases_free(struct sl_books *b) {
  for (size_t i = 0; i < b->nreleases; i++)
    release_free(&b->releases[i]);
  free(b->releases);
  b->releases = NULL;
  b->nreleases = b->cap_releases = 0;
}

void sl_books_releases_region_gone(struct sl_books *b, uint64_t region_id) {
  for (size_t i = b->nreleases; i-- > 0;)
    if (b->releases[i].region_id == region_id)
      release_delete(b, &b->releases[i]);
}

size_t sl_books_releases_of(const struct sl_books *b, uint64_t region_id, uint64_t *first_id) {
  size_t n = 0;

  for (size_t i = 0; i < b->nreleases; i++)
    if (b->releases[i].region_id == region_id && n++ == 0 && first_id != NULL)
      *first_id = b->releases[i].id;
  return n;
}

/* Does rel's released list hold a page of [first, first + count)? (Binary search.) */
static int holds_pages(const struct sl_release *rel, uint64_t first, uint64_t count) {
  size_t i = sl_books_lower_bound(rel->released, rel->nreleased, first);

  return i < rel->nreleased && rel->released[i] - first < count;
}

int sl_books_releases_hold(const struct sl_books *b, uint64_t region_id, uint64_t first,
                           uint64_t count, uint64_t *release_id) {
  for (size_t i = 0; i < b->nreleases; i++) {
    const struct sl_release *rel = &b->releases[i];
    if (rel->region_id == region_id && rel->state != SL_REL_RESTORING &&
        holds_pages(rel, first, count)) {
      *release_id = rel->id;
      return 1;
    }
  }
  return 0;
}

uint64_t sl_books_region_released(const struct sl_books *b, uint64_t region_id) {
  uint64_t n = 0;

  for (size_t i = 0; i < b->nreleases; i++)
    if (b->releases[i].region_id == region_id)
      n += b->releases[i].nreleased;
  return n;
}

/* ---- page groups -------------------------------------------------------------------------- */

uint32_t sl_books_span(const struct sl_region *r, uint64_t p) {
  return r->span == NULL ? 1 : r->span[p];
}

/* The first page of p's group. */
static uint64_t group_head(const struct sl_region *r, uint64_t p) {
  while (p > 0 && sl_books_span(r, p) == 0)
    p--;
  return p;
}

int sl_books_whole_groups(const struct sl_region *r, uint64_t first, uint64_t count) {
  uint64_t end = first + count;

  return sl_books_span(r, first) != 0 && (end == r->npages || sl_books_span(r, end) != 0);
}

int sl_books_grouped_error(const struct sl_region *r, struct sl_err *err) {
  if (r->span == NULL)
    return 0;
  return sl_err_set(err, SUBLET_EBUSY, "region %" PRIu64 " was made again by a resume as "
                    "allocations of several pages (page groups), which a borrower cannot map "
                    "page by page: release it and resume page by page (Python: "
                    "resume(groups=False); C: SUBLET_RESUME_PAGES) before lending it", r->id);
}

int sl_books_groups_grow(struct sl_region *r, uint64_t npages) {
  uint32_t *v;

  if (r->span == NULL)
    return 0;
  if ((v = realloc(r->span, npages * sizeof(*v))) == NULL)
    return SUBLET_ENOHOSTMEM;
  for (uint64_t p = r->npages; p < npages; p++)
    v[p] = 1;
  r->span = v;
  return 0;
}

int sl_books_pages_as_groups(const struct sl_books *b, uint64_t region_id, uint64_t first,
                             uint64_t count, int groups, struct sl_err *err) {
  const struct sl_region *r = sl_books_find_region(b, region_id);

  if (r == NULL || first >= r->npages || count > r->npages - first)
    return sl_err_set(err, SUBLET_EINVAL, "pages [%" PRIu64 ", +%" PRIu64 ") are not in region "
                      "%" PRIu64, first, count, region_id);
  if (groups && !sl_books_whole_groups(r, first, count))
    return sl_err_set(err, SUBLET_EINVAL, "pages [%" PRIu64 ", +%" PRIu64 ") of region %" PRIu64
                      " are not whole page groups: ask from a group's first page to a group's "
                      "end", first, count, region_id);
  for (uint64_t p = first; !groups && p - first < count; p++)
    if (sl_books_span(r, p) != 1)
      return sl_err_set(err, SUBLET_EBUSY, "page %" PRIu64 " of region %" PRIu64 " is in a page "
                        "group, which this library cannot map (it is older than subletd): "
                        "update it", p, region_id);
  return 0;
}

/* Takes out of rel->released the pages of groups it does not hold whole: they are held. The
 * pages of a group are consecutive entries (both ascend), so a group is whole when all its
 * span are there. */
static void keep_whole_groups(const struct sl_region *r, struct sl_release *rel) {
  size_t o = 0;

  for (size_t i = 0, j; r->span != NULL && i < rel->nreleased; i = j) {
    uint64_t head = group_head(r, rel->released[i]), n = sl_books_span(r, head);
    for (j = i; j < rel->nreleased && rel->released[j] < head + n; j++)
      ;
    if (rel->released[i] == head && j - i == n) {
      memmove(&rel->released[o], &rel->released[i], n * sizeof(*rel->released));
      o += n;
    }
  }
  if (r->span != NULL) {
    rel->held = rel->nreleased - o;
    rel->nreleased = o;
  }
}

/* The length of the run of consecutive pages that begins at pages[i]. */
static size_t run_length(const uint64_t *pages, size_t npages, size_t i) {
  size_t j = i + 1;

  while (j < npages && pages[j] == pages[j - 1] + 1)
    j++;
  return j - i;
}

/* The pages of each group a resume makes of a run of len released pages: a sixteenth of the
 * run, so that a later release whose boundary falls inside a group holds back at most that
 * much of a long run (books.h); but at least 16 pages (a short run is one group: rows of
 * whole pages kept leave runs of a few pages between them, and a handle costs 0.26 ms to
 * make, export, import and map however small), at most SL_GROUP_PAGES. */
static uint64_t group_size(uint64_t len) {
  uint64_t size = len / 16, least = len < 16 ? len : 16;

  size = size < least ? least : size;
  return size > SL_GROUP_PAGES ? SL_GROUP_PAGES : size;
}

/* The groups a resume makes of the released pages, as (first, count) pairs (*n of them), each
 * run of them cut by group_size. */
static uint64_t *make_groups(const uint64_t *pages, size_t npages, size_t *n) {
  uint64_t *g = malloc((2 * npages + 2) * sizeof(*g));
  size_t m = 0;

  if (g == NULL)
    return NULL;
  for (size_t i = 0, len; i < npages; i += len) {
    uint64_t size;
    len = run_length(pages, npages, i);
    size = group_size(len);
    for (uint64_t at = 0; at < len; at += size, m++) {
      g[2 * m] = pages[i] + at;
      g[2 * m + 1] = len - at < size ? len - at : size;
    }
  }
  *n = m;
  return g;
}

/* A region left with no group larger than a page has no spans. */
static void drop_spans(struct sl_region *r) {
  for (uint64_t p = 0; r->span != NULL && p < r->npages; p++)
    if (r->span[p] != 1)
      return;
  free(r->span);
  r->span = NULL;
}

/* At a resume's begin: its groups, and the region's spans to note them in (allocated now, so
 * that the books cannot fail to agree with the pool once it has made them). */
static int plan_groups(struct sl_region *r, struct sl_release *rel) {
  rel->groups = make_groups(rel->released, rel->nreleased, &rel->ngroups);
  if (rel->groups == NULL)
    return SUBLET_ENOHOSTMEM;
  if (r->span != NULL)
    return 0;
  if ((r->span = malloc(r->npages * sizeof(*r->span))) == NULL)
    return SUBLET_ENOHOSTMEM;
  for (uint64_t p = 0; p < r->npages; p++)
    r->span[p] = 1;
  return 0;
}

/* After a resume: the released pages are its groups, or pages of their own again. */
static void apply_groups(struct sl_region *r, const struct sl_release *rel) {
  for (size_t i = 0; r->span != NULL && i < rel->nreleased; i++)
    r->span[rel->released[i]] = 1;
  for (size_t i = 0; r->span != NULL && i < rel->ngroups; i++) {
    uint64_t first = rel->groups[2 * i], n = rel->groups[2 * i + 1];
    memset(&r->span[first], 0, n * sizeof(*r->span));
    r->span[first] = (uint32_t)n;
  }
  drop_spans(r);
}

/* ---- beginning ---------------------------------------------------------------------------- */

int sl_books_may_release(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                         uint64_t *npages, struct sl_err *err) {
  const struct sl_region *r = sl_books_region_seen(b, client_id, region_id);

  if (r == NULL)
    return sl_err_set(err, SUBLET_ENOENT, "no region %" PRIu64 " (released, or its owner has "
                      "gone)", region_id);
  if (r->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM, "region %" PRIu64 " belongs to another client; only "
                      "its owner may release its pages", region_id);
  if (r->loan_id != 0 || r->replacing)
    return sl_err_set(err, SUBLET_EBUSY, "region %" PRIu64 " is lent (loan %" PRIu64 "): its "
                      "pages are released once the loan has ended; reclaim it first",
                      region_id, r->loan_id);
  *npages = r->npages;
  return 0;
}

/* A page of the draft that another live release of the region has, or UINT64_MAX. */
static uint64_t overlap(const struct sl_books *b, uint64_t region_id, const struct sl_loan *l,
                        uint64_t npages) {
  uint8_t *mine = calloc(npages, 1);
  uint64_t hit = UINT64_MAX;

  if (mine == NULL)
    return npages; /* reported as out of memory by the caller */
  for (uint64_t i = 0; i < l->unkept + l->kept; i++)
    mine[l->pages[i]] = 1;
  for (size_t i = 0; hit == UINT64_MAX && i < b->nreleases; i++) {
    const struct sl_loan *o = b->releases[i].l;
    if (b->releases[i].region_id != region_id)
      continue;
    for (uint64_t j = 0; j < o->unkept + o->kept; j++)
      if (o->pages[j] < npages && mine[o->pages[j]]) {
        hit = o->pages[j];
        break;
      }
  }
  free(mine);
  return hit;
}

/* The region pages a release may let go of, ascending: l->pages' two ascending runs (unkept,
 * kept) merged; the pinned pages are in neither. */
static uint64_t *region_pages(const struct sl_loan *l, size_t *n) {
  const uint64_t *u = l->pages, *k = l->pages + l->unkept;
  uint64_t nu = l->unkept, nk = l->kept, i = 0, j = 0, o = 0;
  uint64_t *out = malloc((nu + nk + 1) * sizeof(*out));

  if (out == NULL)
    return NULL;
  while (i < nu || j < nk)
    out[o++] = j >= nk || (i < nu && u[i] < k[j]) ? u[i++] : k[j++];
  *n = (size_t)o;
  return out;
}

/* How many pages stay: as many as the kept bytes fill, at most stay, at most K. */
static uint64_t stay_count(const struct sl_books *b, const struct sl_loan *l, uint64_t stay) {
  uint64_t need = sl_books_pages_for(b, l->kept_bytes);

  need = need < l->kept ? need : l->kept;
  return stay < need ? stay : need;
}

/* The bytes of the ascending, disjoint ranges keep[0, nkeep) in each of pages[0, n)
 * (ascending region pages of page size ps). */
static uint64_t *bytes_per_page(const struct sublet_range *keep, size_t nkeep,
                                const uint64_t *pages, size_t n, uint64_t ps) {
  uint64_t *kb = calloc(n + 1, sizeof(*kb));
  size_t k = 0;

  if (kb == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++) {
    uint64_t start = pages[i] * ps, end = start + ps;
    while (k < nkeep && keep[k].offset + keep[k].length <= start)
      k++;
    for (size_t j = k; j < nkeep && keep[j].offset < end; j++) {
      uint64_t lo = keep[j].offset > start ? keep[j].offset : start;
      uint64_t hi = keep[j].offset + keep[j].length;
      kb[i] += (hi < end ? hi : end) - lo;
    }
  }
  return kb;
}

/* The kept bytes of each of pages[0, n). */
static uint64_t *kept_per_page(const struct sl_loan *l, const uint64_t *pages, size_t n,
                               uint64_t ps) {
  return bytes_per_page(l->keep, l->nkeep, pages, n, ps);
}

/* The first of the w consecutive entries of kb[0, n) that hold the most kept bytes; the last
 * such on ties (w <= n). */
static size_t best_window(const uint64_t *kb, size_t n, size_t w) {
  uint64_t sum = 0, best;
  size_t at = 0;

  for (size_t i = 0; i < w; i++)
    sum += kb[i];
  best = sum;
  for (size_t s = 1; s + w <= n; s++) {
    sum += kb[s + w - 1] - kb[s - 1];
    if (sum >= best) {
      best = sum;
      at = s;
    }
  }
  return at;
}

/* The plan's zone: the pages outside [at, at + w) that hold kept bytes, then the window's,
 * each ascending; *reach: how many come before the window. */
static uint64_t *stay_zone(const uint64_t *pages, const uint64_t *kb, size_t n, size_t at,
                           size_t w, size_t *nzone, size_t *reach) {
  uint64_t *z = malloc((n + 1) * sizeof(*z));
  size_t m = 0;

  if (z == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++)
    if ((i < at || i >= at + w) && kb[i] > 0)
      z[m++] = pages[i];
  *reach = m;
  memcpy(z + m, pages + at, w * sizeof(*z));
  *nzone = m + w;
  return z;
}

/* Chooses the pages that stay (the file's opening says how): rel->stayed, rel->zone and the
 * plan over it, and rel->released, every other page. */
static int choose_stay(const struct sl_books *b, struct sl_release *rel, uint64_t stay,
                       size_t *reach) {
  struct sl_loan *l = rel->l;
  uint64_t ps = b->cfg.page_size, *kb = NULL;
  size_t n = 0, at = 0, nzone = 0;
  uint64_t *pages = region_pages(l, &n);

  rel->stayed = stay_count(b, l, stay);
  if (pages != NULL && (kb = kept_per_page(l, pages, n, ps)) != NULL) {
    at = best_window(kb, n, rel->stayed);
    rel->zone = stay_zone(pages, kb, n, at, rel->stayed, &nzone, reach);
  }
  free(kb);
  if (rel->zone == NULL) {
    free(pages);
    return SUBLET_ENOHOSTMEM;
  }
  memmove(pages + at, pages + at + rel->stayed, (n - at - rel->stayed) * sizeof(*pages));
  rel->released = pages;
  rel->nreleased = n - rel->stayed;
  sl_plan_release(&l->plan);
  sl_plan_init(&l->plan, ps, l->keep, l->nkeep, rel->zone, nzone, l->plan.compact);
  return 0;
}

/* ---- releases by need --------------------------------------------------------------------- */

/* The units of pages[0, n) that a release may give back whole, their kept bytes from kb; the
 * entries of a group the release does not hold whole (a page of it pinned) make none. */
static struct sl_need_unit *need_units(const struct sl_region *r, const uint64_t *pages,
                                       const uint64_t *kb, size_t n, size_t *nunits) {
  struct sl_need_unit *u = malloc((n + 1) * sizeof(*u));
  size_t m = 0;

  for (size_t i = 0, j; u != NULL && i < n; i = j) {
    uint64_t head = group_head(r, pages[i]), span = sl_books_span(r, head), kept = 0;
    for (j = i; j < n && pages[j] < head + span; j++)
      kept += kb[j];
    if (pages[i] == head && j - i == span)
      u[m++] = (struct sl_need_unit){i, span, kept, i > 0 && pages[i - 1] + 1 == pages[i]};
  }
  *nunits = m;
  return u;
}

/* The pages a release by need must give back: those the need takes beyond the free bytes, at
 * least those beyond the stay; refused (before anything moves) when the units cannot. */
static int need_count(const struct sl_books *b, const struct sl_release *rel, uint64_t n,
                      uint64_t can_give, uint64_t stay, uint64_t *count, struct sl_err *err) {
  uint64_t ps = b->cfg.page_size, need = rel->need.need_bytes, free_bytes = rel->need.free_bytes;
  uint64_t pages = need > free_bytes ? sl_books_pages_for(b, need - free_bytes) : 0;

  if (pages > can_give)
    return sl_err_set(err, SUBLET_ENEED, "a release by need of %" PRIu64 " bytes from region %"
                      PRIu64 " was refused, nothing moved: the device has %" PRIu64 " bytes "
                      "free and the release can give at most %" PRIu64 " bytes (%" PRIu64
                      " pages), %" PRIu64 " in all, %" PRIu64 " short. Ask for at most %"
                      PRIu64 " bytes, release more with it (other tags or tensors), or free "
                      "memory on the device first", need, rel->region_id, free_bytes,
                      can_give * ps, can_give, free_bytes + can_give * ps,
                      need - free_bytes - can_give * ps, free_bytes + can_give * ps);
  if (stay != UINT64_MAX && n > stay && n - stay > pages)
    pages = n - stay;
  *count = pages < can_give ? pages : can_give;
  return 0;
}

/* Marks released[i] for the units need_pick.c chooses for count pages of pages[0, n). */
static int need_pick(const struct sl_need_unit *u, size_t nunits, uint64_t count,
                     const uint64_t *kb, size_t n, uint64_t ps, uint8_t *released) {
  struct sl_need_choice c = {.units = u, .nunits = nunits, .count = count, .npages = n,
                             .page_size = ps};

  for (size_t i = 0; i < n; i++)
    c.kept_all += kb[i];
  return sl_need_pick(&c, released);
}

/* The released pages (ascending), and the plan's zone: the released ones that hold kept
 * bytes, then every page that stays, each ascending (*reach: the former's count). */
static int need_lists(struct sl_release *rel, const uint64_t *pages, const uint64_t *kb,
                      const uint8_t *released, size_t n, size_t *nzone, size_t *reach) {
  size_t m = 0, z = 0;

  rel->released = malloc((n + 1) * sizeof(*rel->released));
  rel->zone = malloc((n + 1) * sizeof(*rel->zone));
  if (rel->released == NULL || rel->zone == NULL)
    return SUBLET_ENOHOSTMEM;
  for (size_t i = 0; i < n; i++) {
    if (released[i])
      rel->released[m++] = pages[i];
    if (released[i] && kb[i] > 0)
      rel->zone[z++] = pages[i];
  }
  *reach = z;
  for (size_t i = 0; i < n; i++)
    if (!released[i])
      rel->zone[z++] = pages[i];
  rel->nreleased = m;
  rel->stayed = n - m;
  *nzone = z;
  return 0;
}

/* choose_stay for a release by need (books.h, sl_release_need). */
static int choose_need(const struct sl_books *b, struct sl_release *rel, uint64_t stay,
                       size_t *reach, struct sl_err *err) {
  const struct sl_region *r = sl_books_find_region(b, rel->region_id);
  struct sl_loan *l = rel->l;
  struct sl_need_unit *u = NULL;
  uint64_t *kb = NULL, can_give = 0, count = 0;
  size_t n = 0, nunits = 0, nzone = 0;
  uint64_t *pages = region_pages(l, &n);
  uint8_t *released = calloc(n + 1, 1);
  int rc = SUBLET_ENOHOSTMEM;

  if (pages != NULL && released != NULL &&
      (kb = kept_per_page(l, pages, n, b->cfg.page_size)) != NULL &&
      (u = need_units(r, pages, kb, n, &nunits)) != NULL) {
    for (size_t i = 0; i < nunits; i++)
      can_give += u[i].size;
    rc = need_count(b, rel, n, can_give, stay, &count, err);
  }
  if (rc == 0)
    rc = need_pick(u, nunits, count, kb, n, b->cfg.page_size, released);
  if (rc == 0)
    rc = need_lists(rel, pages, kb, released, n, &nzone, reach);
  if (rc == 0) {
    sl_plan_release(&l->plan);
    sl_plan_init(&l->plan, b->cfg.page_size, l->keep, l->nkeep, rel->zone, nzone,
                 l->plan.compact);
  }
  free(pages);
  free(kb);
  free(u);
  free(released);
  return rc;
}

/* The work of the begin: the step's moves and saves, and the released pages. */
static int begin_work(const struct sl_release *rel, const struct sl_plan_step *s,
                      struct sl_release_work *w) {
  *w = (struct sl_release_work){.release_id = rel->id, .region_id = rel->region_id,
                                .nmoves = s->nmoves, .ncopies = s->nsaves,
                                .nreleased = rel->nreleased,
                                .stayed = rel->stayed + rel->held, .held = rel->held,
                                .kept_bytes = rel->l->kept_bytes,
                                .moved_bytes = s->moved_bytes, .saved_bytes = s->saved_bytes,
                                .by_need = rel->by_need};
  w->moves = sl_dup(s->moves, s->nmoves, sizeof(*s->moves));
  w->copies = sl_dup(s->saves, s->nsaves, sizeof(*s->saves));
  w->released = sl_dup(rel->released, rel->nreleased, sizeof(*rel->released));
  if ((s->nmoves && w->moves == NULL) || (s->nsaves && w->copies == NULL) ||
      (rel->nreleased && w->released == NULL)) {
    sl_release_work_clear(w);
    return SUBLET_ENOHOSTMEM;
  }
  return 0;
}

/* Plans rel (its draft in rel->l) and commits the plan's step; fills w. */
static int plan_release(struct sl_books *b, struct sl_release *rel, uint64_t stay,
                        struct sl_release_work *w, struct sl_err *err) {
  struct sl_loan *l = rel->l;
  struct sl_plan_step s = {0};
  size_t reach = 0;
  int rc = rel->by_need ? choose_need(b, rel, stay, &reach, err)
                        : choose_stay(b, rel, stay, &reach);

  if (rc == SUBLET_ENEED)
    return rc; /* err says why */
  if (rc == 0 && reach > 0 && (rc = sl_plan_reach(&l->plan, 0, reach, &s)) == 0)
    rc = sl_plan_commit(&l->plan, &s);
  if (rc == 0)
    keep_whole_groups(sl_books_find_region(b, rel->region_id), rel);
  rel->moved_total = l->plan.moved_bytes;
  if (rc == 0)
    rc = begin_work(rel, &s, w);
  sl_plan_step_clear(&s);
  return rc != 0 ? sl_err_set(err, rc, "out of host memory planning a release") : 0;
}

int sl_books_release_begin(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           struct sl_loan *draft, uint64_t stay,
                           const struct sl_release_need *need, struct sl_release_work *w,
                           struct sl_err *err) {
  struct sl_release *v, *rel;
  uint64_t npages, hit;
  int rc = sl_books_may_release(b, client_id, region_id, &npages, err);

  if (rc != 0)
    return rc;
  if (draft->unkept + draft->kept + draft->pinned_pages != npages)
    return sl_err_set(err, SUBLET_EINVAL, "the release was drafted for another size of region "
                      "%" PRIu64 " (it grew meanwhile): release again", region_id);
  if ((hit = overlap(b, region_id, draft, npages)) != UINT64_MAX)
    return hit == npages ? sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory")
                         : sl_err_set(err, SUBLET_EBUSY, "page %" PRIu64 " of region %" PRIu64
                                      " is released already: resume that release first, or "
                                      "release other pages", hit, region_id);
  v = sl_grow(b->releases, &b->cap_releases, b->nreleases + 1, sizeof(*v));
  if (v == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  b->releases = v;
  rel = &v[b->nreleases];
  *rel = (struct sl_release){.id = b->next_loan, .region_id = region_id,
                             .owner_client = client_id, .state = SL_REL_RELEASING, .l = draft,
                             .by_need = need != NULL};
  if (need != NULL)
    rel->need = *need;
  if ((rc = plan_release(b, rel, stay, w, err)) != 0) {
    free(rel->released);
    free(rel->zone);
    return rc; /* the draft stays the caller's */
  }
  b->next_loan++;
  b->nreleases++;
  return 0;
}

static void more_done(struct sl_release *rel, int ok);

void sl_books_release_done(struct sl_books *b, uint64_t release_id, int ok) {
  struct sl_release *rel = find_release(b, release_id);

  if (rel != NULL && rel->state == SL_REL_RELEASING && rel->more != NULL)
    more_done(rel, ok); /* an increment: the release stays either way */
  else if (rel != NULL && rel->state == SL_REL_RELEASING && ok)
    rel->state = SL_REL_RELEASED;
  else if (rel != NULL && rel->state == SL_REL_RELEASING)
    release_delete(b, rel);
}

/* ---- more by need: an increment of a live release by need ---------------------------------
 *
 * The first need's plan reached the released pages; the increment plans afresh over the
 * pages that stay, what they hold now (their kept bytes and the bytes moved into them) as its
 * keep: the pages it releases (sl_books_release_more says which) are reached, their bytes
 * moved into holes of the others or saved. Then the release's plan is made flat again (struct
 * sl_release_more): a byte moved by the first step and again by this one is one move from its
 * first place to its last; one moved and now saved, one save from its first place. So every
 * move reads a place nothing writes at the resume and writes a released page, and the resume
 * runs them in any order, as for one step. */

static int range_cmp(const void *a, const void *b) {
  const struct sublet_range *x = a, *y = b;

  return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Where the release's kept bytes are on the device now: its keep and the holes its moves
 * filled, ascending, neighbours joined (*n ranges). */
static struct sublet_range *occupancy(const struct sl_loan *l, size_t *n) {
  const struct sl_plan *p = &l->plan;
  size_t all = l->nkeep + p->nmoves, m = 0;
  struct sublet_range *v = malloc((all + 1) * sizeof(*v));

  if (v == NULL)
    return NULL;
  for (size_t i = 0; i < l->nkeep; i++)
    v[i] = l->keep[i];
  for (size_t i = 0; i < p->nmoves; i++)
    v[l->nkeep + i] = (struct sublet_range){p->moves[i].dst_off, p->moves[i].len};
  qsort(v, all, sizeof(*v), range_cmp);
  for (size_t i = 0; i < all; i++) {
    if (m > 0 && v[m - 1].offset + v[m - 1].length == v[i].offset)
      v[m - 1].length += v[i].length;
    else
      v[m++] = v[i];
  }
  *n = m;
  return v;
}

/* The pages of the release's set that stay, ascending (*ns). */
static uint64_t *staying(const struct sl_release *rel, size_t *ns) {
  size_t n = 0, m = 0, j = 0;
  uint64_t *pages = region_pages(rel->l, &n);

  for (size_t i = 0; pages != NULL && i < n; i++) {
    while (j < rel->nreleased && rel->released[j] < pages[i])
      j++;
    if (j == rel->nreleased || rel->released[j] != pages[i])
      pages[m++] = pages[i];
  }
  *ns = m;
  return pages;
}

/* The pages the increase of the need takes beyond the free bytes; refused (before anything
 * moves) when the pages that stay cannot give them. */
static int more_count(const struct sl_books *b, const struct sl_release *rel,
                      const struct sl_release_need *need, uint64_t can_give, uint64_t *count,
                      struct sl_err *err) {
  uint64_t ps = b->cfg.page_size, had = rel->need.need_bytes, f = need->free_bytes;
  uint64_t more = need->need_bytes - had, pages = more > f ? sl_books_pages_for(b, more - f) : 0;

  if (pages > can_give)
    return sl_err_set(err, SUBLET_ENEED, "more of release %" PRIu64 " by need, %" PRIu64
                      " bytes in all (%" PRIu64 " more than its %" PRIu64 "), was refused, "
                      "nothing moved: the device has %" PRIu64 " bytes free and the pages that "
                      "stay can give at most %" PRIu64 " bytes (%" PRIu64 " pages), %" PRIu64
                      " short. Ask for at most %" PRIu64 " bytes in all, or free memory on the "
                      "device first", rel->id, need->need_bytes, more, had, f, can_give * ps,
                      can_give, more - f - can_give * ps, had + f + can_give * ps);
  *count = pages;
  return 0;
}

/* The increment's step: a plan over the pages that stay, the picked ones holding bytes first,
 * then the others, each ascending, with what they hold (occ) as its keep. */
static int more_step(const struct sl_books *b, const struct sublet_range *occ, size_t nocc,
                     const uint64_t *stay, const uint64_t *kb, const uint8_t *pick, size_t ns,
                     int compact, struct sl_plan_step *s) {
  uint64_t *zone = malloc((ns + 1) * sizeof(*zone));
  struct sl_plan p;
  size_t z = 0, reach;
  int rc = 0;

  memset(s, 0, sizeof(*s));
  if (zone == NULL)
    return SUBLET_ENOHOSTMEM;
  for (size_t i = 0; i < ns; i++)
    if (pick[i] && kb[i] > 0)
      zone[z++] = stay[i];
  reach = z;
  for (size_t i = 0; i < ns; i++)
    if (!pick[i])
      zone[z++] = stay[i];
  sl_plan_init(&p, b->cfg.page_size, occ, nocc, zone, z, compact);
  if (reach > 0)
    rc = sl_plan_reach(&p, 0, reach, s);
  sl_plan_release(&p);
  free(zone);
  return rc;
}

/* The flat plan being made: moves and saves, neighbours joined (a move within one page). */
struct flat {
  uint64_t ps;
  struct sl_move *moves;
  size_t nmoves, cap_moves;
  struct sl_copy *saves;
  size_t nsaves, cap_saves;
};

static int flat_move(struct flat *f, uint64_t src, uint64_t dst, uint64_t len) {
  struct sl_move *last = f->nmoves ? &f->moves[f->nmoves - 1] : NULL, *v;

  if (last && last->src_off + last->len == src && last->dst_off + last->len == dst &&
      dst % f->ps != 0) {
    last->len += len;
    return 0;
  }
  if ((v = sl_grow(f->moves, &f->cap_moves, f->nmoves + 1, sizeof(*v))) == NULL)
    return SUBLET_ENOHOSTMEM;
  f->moves = v;
  v[f->nmoves++] = (struct sl_move){src, dst, len};
  return 0;
}

static int flat_save(struct flat *f, uint64_t dev, uint64_t host, uint64_t len) {
  struct sl_copy *last = f->nsaves ? &f->saves[f->nsaves - 1] : NULL, *v;

  if (last && last->dev_off + last->len == dev && last->host_off + last->len == host) {
    last->len += len;
    return 0;
  }
  if ((v = sl_grow(f->saves, &f->cap_saves, f->nsaves + 1, sizeof(*v))) == NULL)
    return SUBLET_ENOHOSTMEM;
  f->saves = v;
  v[f->nsaves++] = (struct sl_copy){dev, host, len};
  return 0;
}

static int move_dst_cmp(const void *a, const void *b) {
  const struct sl_move *x = a, *y = b;

  return x->dst_off < y->dst_off ? -1 : x->dst_off > y->dst_off;
}

static int page_listed(const uint64_t *pages, size_t n, uint64_t page) {
  size_t i = sl_books_lower_bound(pages, n, page);

  return i < n && pages[i] == page;
}

/* The plan's moves into the pages the increment releases (added), by destination. */
static struct sl_move *moved_into(const struct sl_plan *p, const uint64_t *added,
                                  size_t nadded, size_t *n) {
  struct sl_move *v = malloc((p->nmoves + 1) * sizeof(*v));
  size_t m = 0;

  for (size_t i = 0; v != NULL && i < p->nmoves; i++)
    if (page_listed(added, nadded, p->moves[i].dst_off / p->page_size))
      v[m++] = p->moves[i];
  if (v != NULL)
    qsort(v, m, sizeof(*v), move_dst_cmp);
  *n = m;
  return v;
}

/* The first of in[0, n) (by destination, disjoint) ending after x. */
static size_t move_after(const struct sl_move *in, size_t n, uint64_t x) {
  size_t lo = 0, hi = n;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (in[mid].dst_off + in[mid].len <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* [cur, cur + len) goes to `to` (a region offset; save: a host offset), in pieces named by
 * where each byte was at the release's start: one moved there before by its move's source,
 * any other by itself. */
static int flat_emit(struct flat *f, const struct sl_move *in, size_t nin, uint64_t cur,
                     uint64_t len, uint64_t to, int save) {
  size_t i = move_after(in, nin, cur);
  int rc = 0;

  while (rc == 0 && len > 0) {
    uint64_t from = cur, n = len;
    if (i < nin && in[i].dst_off <= cur) {
      from = in[i].src_off + (cur - in[i].dst_off);
      n = sl_min_u64(len, in[i].dst_off + in[i].len - cur);
    } else if (i < nin) {
      n = sl_min_u64(len, in[i].dst_off - cur);
    }
    rc = save ? flat_save(f, from, to, n) : flat_move(f, from, to, n);
    cur += n;
    to += n;
    len -= n;
    if (i < nin && cur >= in[i].dst_off + in[i].len)
      i++;
  }
  return rc;
}

/* The release's plan with the step s over the pages added, made flat (the file's part says
 * how); host offsets of the step after the plan's. */
static int flatten(const struct sl_plan *p, const struct sl_plan_step *s, const uint64_t *added,
                   size_t nadded, struct sl_release_more *m) {
  struct flat f = {.ps = p->page_size};
  size_t nin = 0;
  struct sl_move *in = moved_into(p, added, nadded, &nin);
  int rc = in == NULL ? SUBLET_ENOHOSTMEM : 0;

  for (size_t i = 0; rc == 0 && i < p->nmoves; i++)
    if (!page_listed(added, nadded, p->moves[i].dst_off / p->page_size))
      rc = flat_move(&f, p->moves[i].src_off, p->moves[i].dst_off, p->moves[i].len);
  for (size_t i = 0; rc == 0 && i < s->nmoves; i++)
    rc = flat_emit(&f, in, nin, s->moves[i].src_off, s->moves[i].len, s->moves[i].dst_off, 0);
  for (size_t i = 0; rc == 0 && i < p->nsaves; i++)
    rc = flat_save(&f, p->saves[i].dev_off, p->saves[i].host_off, p->saves[i].len);
  for (size_t i = 0; rc == 0 && i < s->nsaves; i++)
    rc = flat_emit(&f, in, nin, s->saves[i].dev_off, s->saves[i].len,
                   p->saved_bytes + s->saves[i].host_off, 1);
  free(in);
  m->moves = f.moves;
  m->nmoves = f.nmoves;
  m->saves = f.saves;
  m->nsaves = f.nsaves;
  for (size_t i = 0; i < f.nmoves; i++)
    m->moved_bytes += f.moves[i].len;
  m->saved_bytes = p->saved_bytes + s->saved_bytes;
  return rc;
}

/* Every released page then (the release's and the added, merged) and the zone: those holding
 * kept bytes of the keep, then the pages that still stay (stay less pick), each ascending. */
static int more_pages(const struct sl_release *rel, const uint64_t *added, size_t nadded,
                      const uint64_t *stay, const uint8_t *pick, size_t ns, uint64_t ps,
                      struct sl_release_more *m) {
  size_t n = rel->nreleased + nadded, i = 0, j = 0, z = 0;
  uint64_t *kb = NULL;

  m->released = malloc((n + 1) * sizeof(*m->released));
  m->zone = malloc((n + ns + 1) * sizeof(*m->zone));
  if (m->released == NULL || m->zone == NULL)
    return SUBLET_ENOHOSTMEM;
  for (size_t o = 0; o < n; o++)
    m->released[o] = j == nadded || (i < rel->nreleased && rel->released[i] < added[j])
                         ? rel->released[i++] : added[j++];
  m->nreleased = n;
  m->added = nadded;
  if ((kb = kept_per_page(rel->l, m->released, n, ps)) == NULL)
    return SUBLET_ENOHOSTMEM;
  for (i = 0; i < n; i++)
    if (kb[i] > 0)
      m->zone[z++] = m->released[i];
  m->reached = z;
  for (i = 0; i < ns; i++)
    if (!pick[i])
      m->zone[z++] = stay[i];
  m->nzone = z;
  free(kb);
  return 0;
}

/* What the release becomes with the pages picked of stay and the step s (rel->more). */
static int more_build(const struct sl_books *b, struct sl_release *rel, const uint64_t *stay,
                      const uint8_t *pick, size_t ns, const struct sl_plan_step *s,
                      const struct sl_release_need *need) {
  struct sl_release_more *m = calloc(1, sizeof(*m));
  uint64_t *added = malloc((ns + 1) * sizeof(*added));
  size_t nadded = 0;
  int rc = m == NULL || added == NULL ? SUBLET_ENOHOSTMEM : 0;

  for (size_t i = 0; rc == 0 && i < ns; i++)
    if (pick[i])
      added[nadded++] = stay[i];
  if (rc == 0)
    rc = more_pages(rel, added, nadded, stay, pick, ns, b->cfg.page_size, m);
  if (rc == 0)
    rc = flatten(&rel->l->plan, s, added, nadded, m);
  free(added);
  if (rc != 0) {
    more_free(m);
    return rc;
  }
  m->need = *need;
  m->step_moved = s->moved_bytes;
  rel->more = m;
  return 0;
}

/* Chooses and plans the increment (rel->more), or notes a need the free bytes cover. */
static int more_plan(const struct sl_books *b, struct sl_release *rel,
                     const struct sl_release_need *need, struct sl_plan_step *s,
                     struct sl_err *err) {
  const struct sl_region *r = sl_books_find_region(b, rel->region_id);
  uint64_t *kb = NULL, can_give = 0, count = 0;
  size_t ns = 0, nocc = 0, nunits = 0;
  uint64_t *stay = staying(rel, &ns);
  struct sublet_range *occ = occupancy(rel->l, &nocc);
  uint8_t *pick = calloc(ns + 1, 1);
  struct sl_need_unit *u = NULL;
  int rc = SUBLET_ENOHOSTMEM;

  if (stay != NULL && occ != NULL && pick != NULL &&
      (kb = bytes_per_page(occ, nocc, stay, ns, b->cfg.page_size)) != NULL &&
      (u = need_units(r, stay, kb, ns, &nunits)) != NULL) {
    for (size_t i = 0; i < nunits; i++)
      can_give += u[i].size;
    rc = more_count(b, rel, need, can_give, &count, err);
  }
  if (rc == 0 && count > 0)
    rc = need_pick(u, nunits, count, kb, ns, b->cfg.page_size, pick);
  if (rc == 0 && count > 0)
    rc = more_step(b, occ, nocc, stay, kb, pick, ns, rel->l->plan.compact, s);
  if (rc == 0 && count > 0)
    rc = more_build(b, rel, stay, pick, ns, s, need);
  free(stay);
  free(occ);
  free(pick);
  free(kb);
  free(u);
  return rc;
}

/* The release's figures in all, as a release's work says them (an increment's: w's lists). */
static void more_figures(const struct sl_release *rel, struct sl_release_work *w) {
  const struct sl_release_more *m = rel->more;

  w->release_id = rel->id;
  w->region_id = rel->region_id;
  w->kept_bytes = rel->l->kept_bytes;
  w->by_need = 1;
  w->stayed = rel->stayed + rel->held - (m != NULL ? m->added : 0);
  w->moved_bytes = rel->moved_total + (m != NULL ? m->step_moved : 0);
  w->saved_bytes = m != NULL ? m->saved_bytes : rel->l->plan.saved_bytes;
  w->done = m == NULL;
}

/* The increment's device work: the step's moves and saves, its pages. */
static int more_work(const struct sl_release *rel, const struct sl_plan_step *s,
                     struct sl_release_work *w) {
  const struct sl_release_more *m = rel->more;
  uint64_t base = rel->l->plan.saved_bytes;

  w->moves = sl_dup(s->moves, s->nmoves, sizeof(*s->moves));
  w->copies = sl_dup(s->saves, s->nsaves, sizeof(*s->saves));
  w->released = malloc((m->added + 1) * sizeof(*w->released));
  if ((s->nmoves && w->moves == NULL) || (s->nsaves && w->copies == NULL) || !w->released)
    return SUBLET_ENOHOSTMEM;
  w->nmoves = s->nmoves;
  w->ncopies = s->nsaves;
  for (size_t i = 0; i < s->nsaves; i++)
    w->copies[i].host_off += base;
  for (size_t i = 0; i < m->nreleased; i++)
    if (!page_listed(rel->released, rel->nreleased, m->released[i]))
      w->released[w->nreleased++] = m->released[i];
  return 0;
}

static int may_more(const struct sl_release *rel, uint64_t client_id, uint64_t release_id,
                    struct sl_err *err) {
  if (rel == NULL)
    return sl_err_set(err, SUBLET_ENOENT, "no release %" PRIu64 " (resumed already, or its "
                      "region has gone)", release_id);
  if (rel->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM, "release %" PRIu64 " belongs to another client; only "
                      "its owner may release more of it", release_id);
  if (!rel->by_need)
    return sl_err_set(err, SUBLET_EINVAL, "release %" PRIu64 " was not made by need: it gave "
                      "back every page it could already", release_id);
  if (rel->state != SL_REL_RELEASED)
    return sl_err_set(err, SUBLET_EBUSY, "release %" PRIu64 " is %s: wait for that to finish",
                      release_id, rel_state_names[rel->state]);
  return 0;
}

int sl_books_release_more(struct sl_books *b, uint64_t client_id, uint64_t release_id,
                          const struct sl_release_need *need, struct sl_release_work *w,
                          struct sl_err *err) {
  struct sl_release *rel = release_seen(b, client_id, release_id);
  struct sl_plan_step s = {0};
  int rc = may_more(rel, client_id, release_id, err);

  memset(w, 0, sizeof(*w));
  if (rc != 0)
    return rc;
  if (need->need_bytes > rel->need.need_bytes &&
      (rc = more_plan(b, rel, need, &s, err)) != 0) {
    sl_plan_step_clear(&s);
    return rc == SUBLET_ENEED ? rc : sl_err_set(err, rc, "out of host memory planning more "
                                                "of a release");
  }
  if (need->need_bytes > rel->need.need_bytes && rel->more == NULL) {
    rel->need = *need; /* the free bytes cover it: noted, nothing to do */
    rel->increments++;
  }
  more_figures(rel, w);
  if (rel->more != NULL && (rc = more_work(rel, &s, w)) != 0) {
    more_free(rel->more);
    rel->more = NULL;
    sl_release_work_clear(w);
    rc = sl_err_set(err, rc, "out of host memory planning more of a release");
  }
  sl_plan_step_clear(&s);
  if (rc == 0 && rel->more != NULL)
    rel->state = SL_REL_RELEASING;
  return rc;
}

/* An increment's work is over: the release takes what it made (ok), or stays as it was. */
static void more_done(struct sl_release *rel, int ok) {
  struct sl_release_more *m = rel->more;
  struct sl_plan *p = &rel->l->plan;

  rel->more = NULL;
  rel->state = SL_REL_RELEASED;
  if (ok) {
    SL_SWAP(rel->released, m->released);
    rel->nreleased = m->nreleased;
    SL_SWAP(rel->zone, m->zone);
    SL_SWAP(p->moves, m->moves);
    SL_SWAP(p->saves, m->saves);
    p->nmoves = p->cap_moves = m->nmoves;
    p->nsaves = p->cap_saves = m->nsaves;
    p->moved_bytes = m->moved_bytes;
    p->saved_bytes = m->saved_bytes;
    p->pages = rel->zone;
    p->npages = m->nzone;
    p->reached = m->reached;
    p->sink = p->npages > 0 ? p->npages - 1 : 0;
    p->sink_off = 0;
    rel->stayed -= m->added;
    rel->need = m->need;
    rel->moved_total += m->step_moved;
    rel->increments++;
  }
  more_free(m);
}

int sl_books_release_plan(const struct sl_books *b, uint64_t release_id,
                          const struct sl_move **moves, size_t *nmoves,
                          const struct sl_copy **saves, size_t *nsaves) {
  const struct sl_release *rel = find_release(b, release_id);

  if (rel == NULL)
    return SUBLET_ENOENT;
  *moves = rel->l->plan.moves;
  *nmoves = rel->l->plan.nmoves;
  *saves = rel->l->plan.saves;
  *nsaves = rel->l->plan.nsaves;
  return 0;
}

/* ---- resuming ----------------------------------------------------------------------------- */

/* The undoing of rel's plan, and the groups to make (groups) or none. */
static int resume_work(struct sl_books *b, struct sl_release *rel, int groups,
                       struct sl_release_work *w) {
  struct sl_plan *p = &rel->l->plan;
  int rc = 0;

  *w = (struct sl_release_work){.release_id = rel->id, .region_id = rel->region_id,
                                .nreleased = rel->nreleased, .stayed = rel->stayed + rel->held,
                                .held = rel->held,
                                .kept_bytes = rel->l->kept_bytes,
                                .moved_bytes = p->moved_bytes, .saved_bytes = p->saved_bytes};
  free(rel->groups);
  rel->groups = NULL;
  rel->ngroups = 0;
  if (groups && rel->nreleased > 0)
    rc = plan_groups(sl_books_find_region(b, rel->region_id), rel);
  w->released = sl_dup(rel->released, rel->nreleased, sizeof(*rel->released));
  w->groups = sl_dup(rel->groups, 2 * rel->ngroups, sizeof(*rel->groups));
  w->ngroups = rel->ngroups;
  if (rc != 0 || (rel->nreleased && w->released == NULL) || (w->ngroups && !w->groups) ||
      sl_plan_undo(p, &w->copies, &w->ncopies, &w->moves, &w->nmoves) != 0) {
    sl_release_work_clear(w);
    return SUBLET_ENOHOSTMEM;
  }
  return 0;
}

int sl_books_resume_begin(struct sl_books *b, uint64_t client_id, uint64_t release_id,
                          int groups, struct sl_release_work *w, struct sl_err *err) {
  struct sl_release *rel = release_seen(b, client_id, release_id);

  if (rel == NULL)
    return sl_err_set(err, SUBLET_ENOENT, "no release %" PRIu64 " (resumed already, or its "
                      "region has gone)", release_id);
  if (rel->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM, "release %" PRIu64 " belongs to another client; only "
                      "its owner may resume it", release_id);
  if (rel->state != SL_REL_RELEASED)
    return sl_err_set(err, SUBLET_EBUSY, "release %" PRIu64 " is %s: wait for that to finish",
                      release_id, rel_state_names[rel->state]);
  if (resume_work(b, rel, groups, w) != 0)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory");
  rel->state = SL_REL_RESUMING;
  return 0;
}

/* The region's pages changed: a kept window's layout of it is stale (books.h, layout_id). */
static void pages_changed(struct sl_books *b, uint64_t region_id) {
  struct sl_region *r = sl_books_find_region(b, region_id);

  if (r == NULL)
    return;
  r->pages_version++;
  free(r->layout);
  r->layout = NULL;
}

int sl_books_resume_made(struct sl_books *b, uint64_t release_id) {
  struct sl_release *rel = find_release(b, release_id);
  struct sl_region *r;

  if (rel == NULL)
    return SUBLET_ENOENT;
  if (rel->state != SL_REL_RESUMING)
    return SUBLET_EBUSY;
  if ((r = sl_books_find_region(b, rel->region_id)) != NULL)
    apply_groups(r, rel);
  pages_changed(b, rel->region_id);
  rel->state = SL_REL_RESTORING;
  return 0;
}

void sl_books_resume_done(struct sl_books *b, uint64_t release_id, int ok) {
  struct sl_release *rel = find_release(b, release_id);
  struct sl_region *r;

  if (rel != NULL && rel->state == SL_REL_RESTORING) { /* the owner has the pages already */
    release_delete(b, rel);
    return;
  }
  if (rel == NULL || rel->state != SL_REL_RESUMING)
    return;
  r = sl_books_find_region(b, rel->region_id);
  if (!ok) {
    rel->state = SL_REL_RELEASED;
    if (r != NULL)
      drop_spans(r); /* plan_groups may have made them */
    return;
  }
  if (r != NULL)
    apply_groups(r, rel);
  pages_changed(b, rel->region_id);
  release_delete(b, rel);
}

void sl_release_work_clear(struct sl_release_work *w) {
  free(w->groups);
  free(w->moves);
  free(w->copies);
  free(w->released);
  memset(w, 0, sizeof(*w));
}

/* ---- observation -------------------------------------------------------------------------- */

static void fill_info(const struct sl_books *b, const struct sl_release *rel,
                      struct sl_release_info *ri) {
  const struct sl_region *r = sl_books_find_region(b, rel->region_id);
  const struct sl_loan *l = rel->l;

  *ri = (struct sl_release_info){
      .id = rel->id, .region_id = rel->region_id, .owner_client = rel->owner_client,
      .state = rel->state, .pages = l->unkept + l->kept, .released_pages = rel->nreleased,
      .stayed_pages = rel->stayed + rel->held, .kept_bytes = l->kept_bytes,
      .moved_bytes = rel->moved_total, .saved_bytes = l->plan.saved_bytes,
      .by_need = rel->by_need, .need_bytes = rel->need.need_bytes,
      .free_bytes = rel->need.free_bytes, .increments = rel->increments};
  if (r != NULL)
    ri->owner = r->owner;
}

int sl_books_release_info(const struct sl_books *b, uint64_t release_id,
                          struct sl_release_info *ri) {
  const struct sl_release *rel = find_release(b, release_id);

  if (rel == NULL)
    return SUBLET_ENOENT;
  fill_info(b, rel, ri);
  return 0;
}

int sl_books_release_next(const struct sl_books *b, uint64_t after,
                          struct sl_release_info *ri) {
  for (size_t i = 0; i < b->nreleases; i++)
    if (b->releases[i].id > after) {
      fill_info(b, &b->releases[i], ri);
      return 0;
    }
  return SUBLET_ENOENT;
}

const char *sl_books_release_state_name(enum sl_release_state s) {
  return s >= SL_REL_RELEASING && s <= SL_REL_RESTORING ? rel_state_names[s] : "?";
}
