/* books.c - subletd's ledger (the contract is books.h).
 *
 * Plain data. Clients and regions are arrays sorted by id: ids only grow, so appending keeps
 * them sorted and a lookup is a binary search. There is at most one loan. A loan holds its
 * merged keep ranges, the region pages in window order, its live allocations sorted by window
 * position, and the fresh chunks made for it.
 *
 * Work per keep range or per page is linear or n log n (a region may have 51,200 pages and a
 * keep list hundreds of thousands of ranges); work per allocation is linear in the live
 * allocations, which are few. Every call either fully happens or changes nothing: the memory a
 * change needs is obtained before the books are touched.
 *
 * Byte counts of allocations (live_bytes, peak_bytes, served) are page-granular: they count
 * the window pages handed out, which is the memory the borrower takes from the device.
 *
 * Floor 3 (books_impl.h).
 */
#include "books_impl.h"
#include "grow.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const state_names[] = {"", "offered", "active", "draining"};

/* ---- small helpers ---------------------------------------------------------------------- */

static int no_region(struct sl_err *err, uint64_t region_id) {
  return sl_err_set(err, SUBLET_ENOENT,
                    "no region %" PRIu64 " (released, or its owner has gone); create a new one",
                    region_id);
}

static int no_loan(struct sl_err *err, uint64_t loan_id) {
  return sl_err_set(err, SUBLET_ENOENT,
                    "no loan %" PRIu64 " on this device: it has ended or was withdrawn",
                    loan_id);
}

/* The client named in a refusal to client_id: "client N" where it may see uid's, else not. */
static const char *who(const struct sl_books *b, uint64_t client_id, uid_t uid, uint64_t other,
                       char buf[48]) {
  if (sl_books_sees(b, client_id, uid))
    snprintf(buf, 48, "client %" PRIu64, other);
  else
    snprintf(buf, 48, "a client of another user");
  return buf;
}

#define WHO(b, client_id, uid, other) who(b, client_id, uid, other, (char[48]){0})

/* ---- lifetime ----------------------------------------------------------------------------- */

int sl_books_new(const struct sl_books_config *cfg, struct sl_books **out) {
  struct sl_books *b;

  if (cfg == NULL || cfg->page_size == 0 || out == NULL)
    return SUBLET_EINVAL;
  b = calloc(1, sizeof(*b));
  if (b == NULL)
    return SUBLET_ENOHOSTMEM;
  b->cfg = *cfg;
  b->next_client = b->next_region = b->next_loan = b->next_alloc = b->next_chunk = 1;
  b->next_layout = 1;
  *out = b;
  return 0;
}

static void loan_free(struct sl_loan *l) {
  if (l == NULL)
    return;
  sl_plan_release(&l->plan);
  free(l->keep);
  free(l->pages);
  free(l->pinned);
  free(l->allocs);
  free(l->chunks);
  free(l);
}

void sl_books_free(struct sl_books *b) {
  if (b == NULL)
    return;
  loan_free(b->loan);
  sl_books_releases_free(b);
  free(b->clients);
  for (size_t i = 0; i < b->nregions; i++) {
    free(b->regions[i].layout);
    free(b->regions[i].span);
  }
  free(b->regions);
  free(b->held);
  free(b);
}

/* ---- clients ------------------------------------------------------------------------------ */

int sl_books_client_add(struct sl_books *b, const struct sl_peer *peer, uint64_t *client_id) {
  struct sl_client *v;

  if (peer == NULL)
    return SUBLET_EINVAL;
  v = sl_grow(b->clients, &b->cap_clients, b->nclients + 1, sizeof(*v));
  if (v == NULL)
    return SUBLET_ENOHOSTMEM;
  b->clients = v;
  v[b->nclients] = (struct sl_client){.id = b->next_client++, .peer = *peer};
  if (client_id != NULL)
    *client_id = v[b->nclients].id;
  b->nclients++;
  return 0;
}

void sl_client_gone_clear(struct sl_client_gone *gone) {
  if (gone == NULL)
    return;
  free(gone->free_regions);
  free(gone->draining_loans);
  memset(gone, 0, sizeof(*gone));
}

/* ---- regions ------------------------------------------------------------------------------ */

int sl_books_region_add(struct sl_books *b, uint64_t client_id, uint64_t npages,
                        uint64_t *region_id, struct sl_err *err) {
  return sl_books_region_new(b, client_id, npages, 0, region_id, err);
}

int sl_books_region_new(struct sl_books *b, uint64_t client_id, uint64_t npages, int growable,
                        uint64_t *region_id, struct sl_err *err) {
  struct sl_client *c = sl_books_find_client(b, client_id);
  struct sl_region *v;

  if (c == NULL)
    return sl_books_no_client(err, client_id);
  if (npages == 0 || npages > UINT64_MAX / b->cfg.page_size)
    return sl_err_set(err, SUBLET_EINVAL,
                      "a region of %" PRIu64 " pages cannot be made; ask for at least one byte "
                      "and no more than the device holds", npages);
  if (sl_books_space_check(b, c->peer.uid, npages, err) != 0)
    return SUBLET_ENOMEM;
  v = sl_grow(b->regions, &b->cap_regions, b->nregions + 1, sizeof(*v));
  if (v == NULL)
    return sl_books_oom(err);
  b->regions = v;
  v[b->nregions] = (struct sl_region){
      .id = b->next_region++, .owner_client = c->id, .owner = c->peer, .npages = npages,
      .growable = growable != 0, .space = npages};
  if (region_id != NULL)
    *region_id = v[b->nregions].id;
  b->nregions++;
  b->region_pages += npages;
  return 0;
}

/* What a region leaving the books leaves behind: its keepers hold its pages until they let go
 * (kept.c). The caller takes it out of b->regions. */
static void region_forget(struct sl_books *b, struct sl_region *r) {
  sl_books_releases_region_gone(b, r->id);
  sl_books_kept_retire(b, r);
  b->region_pages -= r->npages;
  free(r->layout);
  free(r->span);
}

static void region_delete(struct sl_books *b, struct sl_region *r) {
  size_t i = (size_t)(r - b->regions);

  region_forget(b, r);
  memmove(r, r + 1, (b->nregions - i - 1) * sizeof(*r));
  b->nregions--;
}

int sl_books_region_remove(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           struct sl_err *err) {
  struct sl_region *r = sl_books_region_seen(b, client_id, region_id);

  if (r == NULL)
    return no_region(err, region_id);
  if (r->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM,
                      "region %" PRIu64 " belongs to %s; only its owner may release it",
                      region_id, WHO(b, client_id, r->owner.uid, r->owner_client));
  if (r->loan_id != 0)
    return sl_err_set(err, SUBLET_EBUSY,
                      "region %" PRIu64 " is lent (loan %" PRIu64 "); wait for the loan to end "
                      "(or withdraw it) before releasing the region", region_id, r->loan_id);
  region_delete(b, r);
  return 0;
}

static int replacing_error(const struct sl_region *r, struct sl_err *err) {
  return sl_err_set(err, SUBLET_EBUSY, "region %" PRIu64 " is getting fresh pages after a loan "
                    "to another user: reclaim the loan first (its reply comes once they are in "
                    "place)", r->id);
}

int sl_books_may_grow(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                      uint64_t npages, struct sl_err *err) {
  const struct sl_region *r = sl_books_region_seen(b, client_id, region_id);

  if (r == NULL)
    return no_region(err, region_id);
  if (r->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM, "region %" PRIu64 " belongs to %s; only its owner "
                      "may grow it", region_id,
                      WHO(b, client_id, r->owner.uid, r->owner_client));
  if (!r->growable)
    return sl_err_set(err, SUBLET_EINVAL, "region %" PRIu64 " was not made growable: create "
                      "it growable to grow it", region_id);
  if (r->loan_id != 0)
    return sl_err_set(err, SUBLET_EBUSY, "region %" PRIu64 " is lent: it grows once its loan "
                      "has ended (reclaim loan %" PRIu64 " first)", region_id, r->loan_id);
  if (r->replacing)
    return replacing_error(r, err);
  if (npages <= r->npages || npages > UINT64_MAX / b->cfg.page_size)
    return sl_err_set(err, SUBLET_EINVAL, "region %" PRIu64 " has %" PRIu64 " pages and "
                      "cannot have %" PRIu64 ": a region only grows; ask for more than it has",
                      region_id, r->npages, npages);
  return sl_books_space_check(b, r->owner.uid,
                              sl_books_grow_space(b, region_id, npages) - r->space, err);
}

int sl_books_region_grow(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                         uint64_t npages, struct sl_err *err) {
  struct sl_region *r = sl_books_find_region(b, region_id);
  int rc = sl_books_may_grow(b, client_id, region_id, npages, err);

  if (rc != 0)
    return rc;
  if (sl_books_groups_grow(r, npages) != 0)
    return sl_books_oom(err);
  r->space = sl_books_grow_space(b, region_id, npages);
  b->region_pages += npages - r->npages;
  r->npages = npages;
  /* The last loan's layout covered the old pages only: the next loan's id must be new, or a
   * borrower's window of the old layout would be taken for it. */
  free(r->layout);
  r->layout = NULL;
  r->layout_pages = 0;
  return 0;
}

int sl_books_region_access(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           struct sl_err *err) {
  const struct sl_region *r = sl_books_region_seen(b, client_id, region_id);
  const struct sl_loan *l;

  if (r == NULL)
    return no_region(err, region_id);
  if (r->owner_client == client_id)
    return 0;
  l = sl_books_find_loan(b, r->loan_id);
  if (l != NULL && l->state == SL_LOAN_ACTIVE && l->borrower_client == client_id)
    return 0;
  return sl_err_set(err, SUBLET_EPERM,
                    "client %" PRIu64 " may not use the pages of region %" PRIu64 ": only its "
                    "owner (%s) and the borrower of its loan may; borrow the loan first",
                    client_id, region_id, WHO(b, client_id, r->owner.uid, r->owner_client));
}


/* The window position of region page p in loan l (pages[] holds the unkept pages, then the
 * kept ones, each ascending), or UINT64_MAX for a pinned page: in no window, never granted. */
static uint64_t page_position(const struct sl_loan *l, uint64_t p) {
  size_t i = sl_books_lower_bound(l->pages, l->unkept, p);

  if (i < l->unkept && l->pages[i] == p)
    return i;
  i = sl_books_lower_bound(l->pages + l->unkept, l->kept, p);
  if (i < l->kept && l->pages[l->unkept + i] == p)
    return l->unkept + l->fresh + i;
  return UINT64_MAX;
}

int sl_books_pages_granted(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           uint64_t first, uint64_t count, struct sl_err *err) {
  const struct sl_region *r = sl_books_find_region(b, region_id);
  const struct sl_loan *l;
  uint64_t rel;
  int rc = sl_books_region_access(b, client_id, region_id, err);

  if (rc != 0)
    return rc;
  /* Written so that first + count cannot wrap around */
  if (count == 0 || first >= r->npages || count > r->npages - first)
    return sl_err_set(err, SUBLET_EINVAL,
                      "pages %" PRIu64 " to %" PRIu64 " (+%" PRIu64 ") are not all pages of "
                      "region %" PRIu64 " (%" PRIu64 " pages)", first, first + count - 1, count,
                      region_id, r->npages);
  if (r->replacing)
    return replacing_error(r, err);
  if (sl_books_releases_hold(b, region_id, first, count, &rel))
    return sl_err_set(err, SUBLET_EBUSY, "pages %" PRIu64 " to %" PRIu64 " of region %" PRIu64
                      " include pages released to the driver (release %" PRIu64 "): resume "
                      "it first", first, first + count - 1, region_id, rel);
  if (r->owner_client == client_id)
    return 0;
  l = sl_books_find_loan(b, r->loan_id);
  for (uint64_t p = first; p - first < count; p++)
    if (page_position(l, p) >= l->hwm)
      return sl_err_set(err, SUBLET_EPERM,
                        "page %" PRIu64 " of region %" PRIu64 " was not granted to this "
                        "borrower: a borrower may have only the pages of its allocations",
                        p, region_id);
  return 0;
}

static void region_fill_info(const struct sl_region *r, struct sl_region_info *ri) {
  *ri = (struct sl_region_info){.id = r->id, .owner_client = r->owner_client,
                                .owner = r->owner, .npages = r->npages,
                                .growable = r->growable, .loan_id = r->loan_id,
                                .pages_version = r->pages_version, .replacing = r->replacing,
                                .space = r->space};
}

int sl_books_region_info(const struct sl_books *b, uint64_t region_id,
                         struct sl_region_info *ri) {
  const struct sl_region *r = sl_books_find_region(b, region_id);

  if (r == NULL)
    return SUBLET_ENOENT;
  region_fill_info(r, ri);
  return 0;
}

int sl_books_region_next(const struct sl_books *b, uint64_t after, struct sl_region_info *ri) {
  size_t lo = 0, hi = b->nregions;

  while (lo < hi) { /* the first region with id > after */
    size_t mid = lo + (hi - lo) / 2;
    if (b->regions[mid].id <= after)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == b->nregions)
    return SUBLET_ENOENT;
  region_fill_info(&b->regions[lo], ri);
  return 0;
}

/* ---- keep ranges and the window's page order ---------------------------------------------- */

#define RADIX_BUCKETS ((size_t)1 << 16)

static int cmp_range(const void *a, const void *b) {
  const struct sublet_range *x = a, *y = b;
  return (x->offset > y->offset) - (x->offset < y->offset);
}


static int ranges_sorted(const struct sublet_range *v, size_t n) {
  for (size_t i = 1; i < n; i++)
    if (v[i - 1].offset > v[i].offset)
      return 0;
  return 1;
}

/* One stable pass of the radix sort: by the 16 bits of offset at shift, from src into dst;
 * returns 0 when every range has the same digit (nothing moved: src stays the answer). */
static int radix_pass(const struct sublet_range *src, struct sublet_range *dst, size_t n,
                      int shift, size_t *count) {
  memset(count, 0, RADIX_BUCKETS * sizeof(*count));
  for (size_t i = 0; i < n; i++)
    count[(src[i].offset >> shift) & (RADIX_BUCKETS - 1)]++;
  if (count[(src[0].offset >> shift) & (RADIX_BUCKETS - 1)] == n)
    return 0;
  for (size_t b = 0, sum = 0; b < RADIX_BUCKETS; b++) {
    size_t c = count[b];
    count[b] = sum;
    sum += c;
  }
  for (size_t i = 0; i < n; i++)
    dst[count[(src[i].offset >> shift) & (RADIX_BUCKETS - 1)]++] = src[i];
  return 1;
}

/* Sorts by offset: at once when sorted already (views listed in order), else a radix sort,
 * linear in n (millions of kept ranges in a few milliseconds, where qsort took most of a
 * second on the loop), else, out of memory for its buffers, qsort. */
static void sort_ranges(struct sublet_range *v, size_t n) {
  struct sublet_range *tmp, *src = v, *dst;
  size_t *count;

  if (n < 2 || ranges_sorted(v, n))
    return;
  tmp = n >= 256 ? malloc(n * sizeof(*v)) : NULL;
  count = tmp != NULL ? malloc(RADIX_BUCKETS * sizeof(*count)) : NULL;
  if (count == NULL) {
    free(tmp);
    qsort(v, n, sizeof(*v), cmp_range);
    return;
  }
  dst = tmp;
  for (int shift = 0; shift < 64; shift += 16) {
    if (radix_pass(src, dst, n, shift, count)) {
      struct sublet_range *t = src;
      src = dst;
      dst = t;
    }
  }
  if (src != v)
    memcpy(v, src, n * sizeof(*v));
  free(count);
  free(tmp);
}

/* Sorts and merges in place; drops empty ranges. Returns the new count. */
static size_t keep_merge(struct sublet_range *v, size_t n) {
  size_t m = 0;

  sort_ranges(v, n);
  for (size_t i = 0; i < n; i++) {
    uint64_t end = v[i].offset + v[i].length;
    if (v[i].length == 0)
      continue;
    if (m > 0 && v[m - 1].offset + v[m - 1].length >= v[i].offset) {
      uint64_t prev_end = v[m - 1].offset + v[m - 1].length;
      v[m - 1].length = sl_max_u64(prev_end, end) - v[m - 1].offset;
    } else {
      v[m++] = v[i];
    }
  }
  return m;
}

static int keep_out_of_region(size_t i, const struct sublet_range *r, uint64_t limit,
                               struct sl_err *err) {
  char sz[16];

  return sl_err_set(err, SUBLET_EINVAL, "keep range %zu (offset %" PRIu64 ", length %" PRIu64
                    ") reaches past the end of the region (%s); keep only bytes of the region",
                    i, r->offset, r->length, sl_format_size(sz, limit));
}

static int keep_validate(const struct sublet_range *keep, size_t n, uint64_t limit,
                         struct sl_err *err) {
  for (size_t i = 0; i < n; i++)
    if (keep[i].offset > limit || keep[i].length > limit - keep[i].offset)
      return keep_out_of_region(i, &keep[i], limit, err);
  return 0;
}

/* The keep list checked, copied into l->keep and merged in one pass while it comes sorted
 * (views listed in order, ranges from libsublet: the common case, where a pass each for
 * checking, copying, sorting, merging and counting was most of a 220,000-range draft; the
 * ranges do not fit in a cache). Returns 1 at the first range out of order, l->keep then
 * unfinished. */
static int keep_take_sorted(struct sl_loan *l, const struct sublet_range *keep, size_t n,
                            uint64_t limit, struct sl_err *err) {
  struct sublet_range *v = l->keep;
  uint64_t end = 0, kept = 0; /* end: of v[m - 1] */
  size_t m = 0;

  for (size_t i = 0; i < n; i++) {
    uint64_t lo = keep[i].offset, hi = lo + keep[i].length;
    /* keep_validate's check, on the values loaded already (through a helper taking the
     * range, the pass took 0.72 ms instead of 0.58) */
    if (lo > limit || keep[i].length > limit - lo)
      return keep_out_of_region(i, &keep[i], limit, err);
    if (keep[i].length == 0)
      continue;
    if (m > 0 && lo < v[m - 1].offset)
      return 1;
    if (m > 0 && lo <= end) {
      kept += hi > end ? hi - end : 0;
      end = sl_max_u64(end, hi);
      v[m - 1].length = end - v[m - 1].offset;
    } else {
      v[m++] = keep[i];
      kept += keep[i].length;
      end = hi;
    }
  }
  l->nkeep = m;
  l->kept_bytes = kept;
  return 0;
}

static int loan_set_keep(struct sl_loan *l, const struct sublet_range *keep, size_t nkeep,
                         int keep_all, uint64_t limit, struct sl_err *err) {
  struct sublet_range all = {0, limit};
  int rc;

  if (keep_all) {
    keep = &all;
    nkeep = 1;
  } else if (nkeep > 0 && keep == NULL) {
    return sl_err_set(err, SUBLET_EINVAL, "%zu keep ranges announced but none given", nkeep);
  }
  if (nkeep == 0)
    return 0;
  l->keep = malloc(nkeep * sizeof(*l->keep));
  if (l->keep == NULL)
    return sl_books_oom(err);
  rc = keep_take_sorted(l, keep, nkeep, limit, err);
  if (rc <= 0)
    return rc;
  if ((rc = keep_validate(keep, nkeep, limit, err)) != 0)
    return rc;
  memcpy(l->keep, keep, nkeep * sizeof(*l->keep));
  l->nkeep = keep_merge(l->keep, nkeep);
  l->kept_bytes = 0;
  for (size_t i = 0; i < l->nkeep; i++)
    l->kept_bytes += l->keep[i].length;
  return 0;
}

/* flags[p] = 1 for every page holding a kept byte. Ranges are merged, so consecutive ranges
 * share at most one page and the marking is linear in pages + ranges. */
void sl_books_mark_kept_pages(const struct sublet_range *keep, size_t nkeep,
                              uint64_t page_size, uint8_t *flags) {
  /* Devices' pages are a power of two: shifts then, not the two divisions a range that were
   * most of a 300,000-range Lend (the model tests other sizes too). */
  int pow2 = (page_size & (page_size - 1)) == 0, shift = __builtin_ctzll(page_size);

  for (size_t i = 0; i < nkeep; i++) {
    uint64_t lo = keep[i].offset, hi = keep[i].offset + keep[i].length - 1;
    uint64_t first = pow2 ? lo >> shift : lo / page_size, last = pow2 ? hi >> shift : hi / page_size;
    /* Both ends without a branch: a loop of one or two pages a range mispredicted often. */
    flags[first] = 1;
    flags[last] = 1;
    for (uint64_t p = first + 1; p < last; p++)
      flags[p] = 1;
  }
}

/* flags[p] = SL_PAGE_PINNED for every pinned page ((first, count) pairs, checked). */
void sl_books_mark_pinned_pages(const uint64_t *pinned, size_t npinned, uint8_t *flags) {
  for (size_t i = 0; i < npinned; i++)
    memset(flags + pinned[2 * i], SL_PAGE_PINNED, pinned[2 * i + 1]);
}

/* The window's pages: the unkept ones, then the kept ones; pinned pages are in neither (the
 * keep was checked to lie outside them, so marking kept pages leaves them pinned). */
static int loan_set_layout(const struct sl_books_config *cfg, struct sl_loan *l,
                           uint64_t npages, struct sl_err *err) {
  uint8_t *flags = calloc(npages, 1);
  uint64_t u = 0, k = 0, n = npages - l->pinned_pages;

  l->pages = n <= SIZE_MAX / sizeof(*l->pages) ? malloc((n + 1) * sizeof(*l->pages)) : NULL;
  if (flags == NULL || l->pages == NULL) {
    free(flags);
    return sl_books_oom(err);
  }
  sl_books_mark_pinned_pages(l->pinned, l->npinned, flags);
  sl_books_mark_kept_pages(l->keep, l->nkeep, cfg->page_size, flags);
  for (uint64_t p = 0; p < npages; p++)
    u += flags[p] == SL_PAGE_UNKEPT;
  for (uint64_t p = 0, i = 0; p < npages; p++) {
    if (flags[p] == SL_PAGE_KEPT)
      l->pages[u + k++] = p;
    else if (flags[p] == SL_PAGE_UNKEPT)
      l->pages[i++] = p;
  }
  l->unkept = u;
  l->kept = l->holding = k;
  free(flags);
  return 0;
}

/* The pinned pages are none, or the region's last ones: the window can end before them. */
static int pinned_tail_only(const struct sl_loan *l, uint64_t npages) {
  return l->npinned == 0 ||
         (l->npinned == 1 && l->pinned[0] + l->pinned[1] == npages);
}

/* The unkept pages are the region's last ones, the kept ones its head (a tensor that keeps
 * its first bytes): served in place as it is, the tail first, with nothing moved. */
static int keeps_head(const struct sl_loan *l) {
  return l->unkept > 0 && l->kept > 0 && l->npinned == 0 &&
         l->pages[0] == l->kept && l->pages[l->unkept - 1] == l->kept + l->unkept - 1;
}

/* Lays l out in order (books.h) when it may be: its pages become the region's own, in order
 * (pinned ones excepted), all of them the kept zone. */
static void loan_set_in_order(const struct sl_books_config *cfg, struct sl_loan *l,
                              uint64_t npages) {
  uint64_t n = l->unkept + l->kept;

  if (cfg->no_compact || !pinned_tail_only(l, npages) || keeps_head(l))
    return;
  for (uint64_t p = 0; p < n; p++) /* with U = 0 they were so already */
    l->pages[p] = p;
  l->unkept = 0;
  l->kept = n;
  l->in_order = 1;
  sl_plan_init(&l->plan, cfg->page_size, l->keep, l->nkeep, l->pages, n, 1);
}

/* ---- lending ------------------------------------------------------------------------------ */

static int device_busy(const struct sl_books *b, uint64_t client_id, struct sl_err *err) {
  const struct sl_loan *l = b->loan;

  if (!sl_books_sees(b, client_id, sl_books_loan_uid(b, l)))
    return sl_err_set(err, SUBLET_EBUSY, "this device already has a loan, of another user; "
                      "one loan at a time: wait for it to end");
  return sl_err_set(err, SUBLET_EBUSY,
                    "this device already has loan %" PRIu64 " (region %" PRIu64 ", %s); one "
                    "loan at a time: wait for it to end", l->id, l->region_id,
                    state_names[l->state]);
}

/* Only a region's owner lends it. */
static int owner_check(const struct sl_books *b, uint64_t client_id, const struct sl_region *r,
                       uint64_t region_id, struct sl_err *err) {
  if (sl_books_find_client(b, client_id) == NULL)
    return sl_books_no_client(err, client_id);
  if (r == NULL || !sl_books_sees(b, client_id, r->owner.uid)) /* as missing: books_impl.h */
    return no_region(err, region_id);
  if (r->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM,
                      "region %" PRIu64 " belongs to %s; only its owner may lend it", region_id,
                      WHO(b, client_id, r->owner.uid, r->owner_client));
  return 0;
}

/* A region with live releases is not lent: some of its pages are the driver's; nor one with
 * page groups (books.h). */
static int released_error(const struct sl_books *b, uint64_t region_id, struct sl_err *err) {
  uint64_t rel = 0;
  size_t n = sl_books_releases_of(b, region_id, &rel);
  const struct sl_region *r = sl_books_find_region(b, region_id);

  if (n == 0 && r != NULL)
    return sl_books_grouped_error(r, err);
  return n == 0 ? 0 : sl_err_set(err, SUBLET_EBUSY, "region %" PRIu64 " has %zu live releases "
                                 "(release %" PRIu64 "...): its released pages are the "
                                 "driver's; resume them before lending it", region_id, n, rel);
}

static int lend_check(const struct sl_books *b, uint64_t client_id, const struct sl_region *r,
                      uint64_t region_id, const char *name, const uint8_t *token,
                      struct sl_err *err) {
  int rc = owner_check(b, client_id, r, region_id, err);

  if (rc != 0)
    return rc;
  if (b->loan != NULL)
    return device_busy(b, client_id, err);
  if (r->replacing)
    return replacing_error(r, err);
  if ((rc = released_error(b, region_id, err)) != 0)
    return rc;
  if (name != NULL && strlen(name) >= SL_LOAN_NAME_SIZE)
    return sl_err_set(err, SUBLET_EINVAL, "loan name \"%.20s...\" is too long; use at most "
                      "%d bytes", name, SL_LOAN_NAME_SIZE - 1);
  if (token == NULL)
    return sl_err_set(err, SUBLET_EINVAL, "a loan needs a 16-byte token");
  return 0;
}

static int bad_pinned(size_t i, uint64_t first, uint64_t count, uint64_t end, uint64_t npages,
                      struct sl_err *err) {
  const char *why = count == 0 ? "empty"
                    : i > 0 && first < end ? "out of order or overlapping the one before"
                                           : "not within the region";

  return sl_err_set(err, SUBLET_EINVAL, "pinned pair %zu (first page %" PRIu64 ", %" PRIu64
                    " pages) is %s: pin ascending, disjoint (first, count) pairs of the "
                    "region's %" PRIu64 " pages", i, first, count, why, npages);
}

/* The pinned pages checked and taken: (first, count) pairs, ascending and disjoint (adjacent
 * pairs are fine), within the region. */
static int loan_set_pinned(struct sl_loan *l, const uint64_t *pinned, size_t npinned,
                           uint64_t npages, struct sl_err *err) {
  uint64_t end = 0;

  if (npinned == 0)
    return 0;
  if (pinned == NULL || npinned > SIZE_MAX / (2 * sizeof(*pinned)))
    return sl_err_set(err, SUBLET_EINVAL, "%zu pinned pairs announced but not given", npinned);
  for (size_t i = 0; i < npinned; i++) {
    uint64_t first = pinned[2 * i], count = pinned[2 * i + 1];
    if (count == 0 || first >= npages || count > npages - first || (i > 0 && first < end))
      return bad_pinned(i, first, count, end, npages, err);
    end = first + count;
    l->pinned_pages += count;
  }
  if (l->pinned_pages == npages)
    return sl_err_set(err, SUBLET_EINVAL, "every page of the region is pinned: nothing is "
                      "lent; pin fewer pages, or lend nothing");
  if ((l->pinned = malloc(npinned * 2 * sizeof(*pinned))) == NULL)
    return sl_books_oom(err);
  memcpy(l->pinned, pinned, npinned * 2 * sizeof(*pinned));
  l->npinned = npinned;
  return 0;
}

/* keep_all with pinned pages keeps every byte of the other pages: the pinned ones are the
 * owner's alone. The complement of the pairs, as byte ranges (*out: malloc'd, or NULL when
 * every page is pinned). */
static int unpinned_ranges(const struct sl_loan *l, uint64_t npages, uint64_t ps,
                           struct sublet_range **out, size_t *n, struct sl_err *err) {
  struct sublet_range *v = malloc((l->npinned + 1) * sizeof(*v));
  uint64_t at = 0;

  if (v == NULL)
    return sl_books_oom(err);
  *n = 0;
  for (size_t i = 0; i <= l->npinned; i++) {
    uint64_t first = i < l->npinned ? l->pinned[2 * i] : npages;
    if (first > at)
      v[(*n)++] = (struct sublet_range){at * ps, (first - at) * ps};
    at = i < l->npinned ? first + l->pinned[2 * i + 1] : at;
  }
  *out = v;
  return 0;
}

/* A kept byte in a pinned page is refused: the loan saves, moves and restores kept bytes,
 * and a pinned page is the owner's alone. Both lists are sorted: one pass. */
static int keep_pinned_check(const struct sl_loan *l, uint64_t ps, struct sl_err *err) {
  size_t j = 0;

  for (size_t i = 0; i < l->nkeep && j < l->npinned; i++) {
    uint64_t lo = l->keep[i].offset, hi = lo + l->keep[i].length;
    while (j < l->npinned && l->pinned[2 * j] + l->pinned[2 * j + 1] <= lo / ps)
      j++;
    if (j < l->npinned && l->pinned[2 * j] <= (hi - 1) / ps)
      return sl_err_set(err, SUBLET_EINVAL, "kept bytes [%" PRIu64 ", %" PRIu64 ") lie in "
                        "pinned pages %" PRIu64 " to %" PRIu64 " (pinned pair %zu): a page is "
                        "kept or pinned, not both; keep no byte of a pinned page (the loan "
                        "never touches it anyway)", lo, hi, l->pinned[2 * j],
                        l->pinned[2 * j] + l->pinned[2 * j + 1] - 1, j);
  }
  return 0;
}

static int draft_keep(const struct sl_books_config *cfg, struct sl_loan *l, uint64_t npages,
                      const struct sublet_range *keep, size_t nkeep, int keep_all,
                      struct sl_err *err) {
  struct sublet_range *unpinned = NULL;
  int rc;

  if (keep_all && l->npinned > 0) {
    if ((rc = unpinned_ranges(l, npages, cfg->page_size, &unpinned, &nkeep, err)) != 0)
      return rc;
    keep = unpinned;
    keep_all = 0;
  }
  rc = loan_set_keep(l, keep, nkeep, keep_all, npages * cfg->page_size, err);
  free(unpinned);
  return rc != 0 ? rc : keep_pinned_check(l, cfg->page_size, err);
}

int sl_books_draft(const struct sl_books_config *cfg, uint64_t npages,
                   const struct sublet_range *keep, size_t nkeep, int keep_all,
                   const uint64_t *pinned, size_t npinned, struct sl_loan **out,
                   struct sl_err *err) {
  struct sl_loan *l;
  int rc;

  if (npages == 0 || npages > UINT64_MAX / cfg->page_size)
    return sl_err_set(err, SUBLET_EINVAL, "a region of %" PRIu64 " pages cannot be lent",
                      npages);
  if ((l = calloc(1, sizeof(*l))) == NULL)
    return sl_books_oom(err);
  rc = loan_set_pinned(l, pinned, npinned, npages, err);
  if (rc == 0)
    rc = draft_keep(cfg, l, npages, keep, nkeep, keep_all, err);
  if (rc == 0)
    rc = loan_set_layout(cfg, l, npages, err);
  if (rc < 0) {
    loan_free(l);
    return rc;
  }
  sl_plan_init(&l->plan, cfg->page_size, l->keep, l->nkeep, l->pages + l->unkept, l->kept,
               !cfg->no_compact);
  *out = l;
  return 0;
}

const struct sl_books_config *sl_books_cfg(const struct sl_books *b) {
  return &b->cfg;
}

void sl_books_draft_free(struct sl_loan *draft) {
  if (draft != NULL)
    loan_free(draft);
}

int sl_books_may_lend(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                      uint64_t *npages, struct sl_err *err) {
  const struct sl_region *r = sl_books_region_seen(b, client_id, region_id);
  const struct sl_client *c = sl_books_find_client(b, client_id);
  int rc = owner_check(b, client_id, r, region_id, err);

  if (rc != 0)
    return rc;
  if (r->loan_id != 0)
    return sl_err_set(err, SUBLET_EBUSY, "region %" PRIu64 " is lent already (loan %" PRIu64
                      "): one loan of a region at a time; reclaim it first", region_id,
                      r->loan_id);
  if (r->replacing) /* its owner must reclaim first: it cannot while its Lend waits */
    return replacing_error(r, err);
  if ((rc = released_error(b, region_id, err)) != 0)
    return rc;
  if (c->loan_id != 0)
    return sl_err_set(err, SUBLET_EBUSY, "this client borrows loan %" PRIu64 ": return it "
                      "before lending (the device has one loan at a time)", c->loan_id);
  if (npages != NULL)
    *npages = r->npages;
  return 0;
}

/* Is l's layout the one of r's last loan, over the same pages? The region has the same pages
 * as then (a growth drops the layout), so the same window pages mean the same pinned ones. */
static int same_layout(const struct sl_region *r, const struct sl_loan *l) {
  return r->layout != NULL && r->layout_pages == l->unkept + l->kept &&
         r->layout_unkept == l->unkept &&
         memcmp(r->layout, l->pages, r->layout_pages * sizeof(*l->pages)) == 0;
}

int sl_books_lend_draft(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                        struct sl_loan *l, const char *name,
                        const uint8_t token[SUBLET_TOKEN_SIZE], uint64_t *loan_id,
                        struct sl_err *err) {
  struct sl_region *r = sl_books_find_region(b, region_id);
  int rc = lend_check(b, client_id, r, region_id, name, token, err);

  if (rc == 0 && r->npages != l->unkept + l->kept + l->pinned_pages)
    rc = sl_err_set(err, SUBLET_EINVAL, "internal error: a loan drafted for %" PRIu64 " pages "
                    "lends region %" PRIu64 " of %" PRIu64, l->unkept + l->kept + l->pinned_pages,
                    region_id, r->npages);
  if (rc < 0)
    return rc;
  l->id = b->next_loan++;
  l->region_id = r->id;
  l->state = SL_LOAN_OFFERED;
  l->owner_client = client_id;
  l->stats.loan_id = l->id;
  snprintf(l->name, sizeof(l->name), "%s", name ? name : "");
  memcpy(l->token, token, sizeof(l->token));
  loan_set_in_order(&b->cfg, l, r->npages);
  l->layout_id = same_layout(r, l) ? r->layout_id : b->next_layout++;
  r->loan_id = l->id;
  b->loan = l;
  if (loan_id != NULL)
    *loan_id = l->id;
  return 0;
}

int sl_books_lend(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                  const struct sublet_range *keep, size_t nkeep, int keep_all, const char *name,
                  const uint8_t token[SUBLET_TOKEN_SIZE], uint64_t *loan_id, struct sl_err *err) {
  return sl_books_lend_pinned(b, client_id, region_id, keep, nkeep, keep_all, NULL, 0, name,
                              token, loan_id, err);
}

int sl_books_lend_pinned(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                         const struct sublet_range *keep, size_t nkeep, int keep_all,
                         const uint64_t *pinned, size_t npinned, const char *name,
                         const uint8_t token[SUBLET_TOKEN_SIZE], uint64_t *loan_id,
                         struct sl_err *err) {
  struct sl_region *r = sl_books_find_region(b, region_id);
  struct sl_loan *l = NULL;
  int rc = lend_check(b, client_id, r, region_id, name, token, err);

  if (rc == 0)
    rc = sl_books_draft(&b->cfg, r->npages, keep, nkeep, keep_all, pinned, npinned, &l, err);
  if (rc == 0 && (rc = sl_books_lend_draft(b, client_id, region_id, l, name, token, loan_id,
                                           err)) != 0)
    loan_free(l);
  return rc;
}

/* An ended or withdrawn loan leaves the books; the region is idle again, or gone with its
 * owner. */
static void loan_delete(struct sl_books *b) {
  struct sl_loan *l = b->loan;
  struct sl_region *r = sl_books_find_region(b, l->region_id);
  struct sl_client *c = sl_books_find_client(b, l->borrower_client);

  sl_books_kept_loan_end(b, l);
  if (r != NULL && l->owner_gone) {
    region_delete(b, r);
  } else if (r != NULL) {
    r->loan_id = 0;
    free(r->layout); /* the loan's layout, for the next one's id */
    r->layout = l->pages;
    r->layout_unkept = l->unkept;
    r->layout_id = l->layout_id;
    r->layout_pages = l->unkept + l->kept;
    l->pages = NULL;
  }
  if (c != NULL && c->loan_id == l->id)
    c->loan_id = 0;
  loan_free(l);
  b->loan = NULL;
}

int sl_books_withdraw(struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                      struct sl_err *err) {
  int rc = sl_books_loan_owned(b, client_id, loan_id, err);

  if (rc < 0)
    return rc;
  if (b->loan->state != SL_LOAN_OFFERED)
    return sl_err_set(err, SUBLET_EBUSY,
                      "loan %" PRIu64 " is %s (borrower client %" PRIu64 "); it can no longer "
                      "be withdrawn: reclaim it and wait for the borrower to return it",
                      loan_id, state_names[b->loan->state], b->loan->borrower_client);
  loan_delete(b);
  return 0;
}

int sl_books_loan_owned(const struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                        struct sl_err *err) {
  const struct sl_loan *l = sl_books_loan_seen(b, client_id, loan_id);

  if (l == NULL)
    return no_loan(err, loan_id);
  if (l->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM,
                      "loan %" PRIu64 " was lent by %s, not by client %" PRIu64 "; only its "
                      "owner may withdraw or reclaim it", loan_id,
                      WHO(b, client_id, sl_books_loan_uid(b, l), l->owner_client), client_id);
  return 0;
}

/* ---- borrowing ---------------------------------------------------------------------------- */

/* Tokens are secrets: compare in time that does not depend on where they differ. */
static int token_equal(const uint8_t *a, const uint8_t *b) {
  uint8_t diff = 0;

  for (size_t i = 0; i < SUBLET_TOKEN_SIZE; i++)
    diff |= a[i] ^ b[i];
  return diff == 0;
}

static int loan_not_offered(const struct sl_books *b, uint64_t client_id,
                            const struct sl_loan *l, struct sl_err *err) {
  if (!sl_books_sees(b, client_id, sl_books_loan_uid(b, l)))
    return sl_err_set(err, SUBLET_EBUSY, "loan %" PRIu64 " is not on offer (borrowed "
                      "already); wait for a new offer", l->id);
  return sl_err_set(err, SUBLET_EBUSY,
                    "loan %" PRIu64 " is already borrowed (%s, client %" PRIu64 "); wait for it "
                    "to end and for a new offer", l->id, state_names[l->state],
                    l->borrower_client);
}

static int pick_by_id(const struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                      const uint8_t *token, struct sl_loan **out, struct sl_err *err) {
  struct sl_loan *l = sl_books_find_loan(b, loan_id);

  /* Another user's loan is a missing one to whoever may not see it (sl_books_loan_seen),
   * unless it holds the loan's token: its owner gave it, and it hears how to be let in */
  if (l == NULL || (!sl_books_sees(b, client_id, sl_books_loan_uid(b, l)) &&
                    (token == NULL || !token_equal(token, l->token))))
    return no_loan(err, loan_id);
  if (token == NULL && l->owner_client != client_id)
    return sl_err_set(err, SUBLET_EPERM,
                      "loan %" PRIu64 " was lent by another client; borrow it with the token "
                      "its owner received from lend", loan_id);
  if (token != NULL && !token_equal(token, l->token))
    return sl_err_set(err, SUBLET_EPERM,
                      "wrong token for loan %" PRIu64 "; use the token its owner received "
                      "from lend", loan_id);
  if (l->state != SL_LOAN_OFFERED)
    return loan_not_offered(b, client_id, l, err);
  *out = l;
  return 0;
}

/* By name, another user's loan is none to a client that may not see it: status hides it. */
static int pick_offer(const struct sl_books *b, uint64_t client_id, const char *name,
                      struct sl_loan **out, struct sl_err *err) {
  struct sl_loan *l = b->loan;
  int by_name = name != NULL && name[0] != '\0';

  if (by_name && (l == NULL || strcmp(l->name, name) != 0 ||
                  !sl_books_sees(b, client_id, sl_books_loan_uid(b, l))))
    return sl_err_set(err, SUBLET_ENOOFFER,
                      "no loan named \"%.64s\" that this user may borrow is on offer on this "
                      "device; check the name or wait for its owner to lend (another user's "
                      "loans are on offer only to root and --allow-group)", name);
  if (by_name && l->state != SL_LOAN_OFFERED)
    return loan_not_offered(b, client_id, l, err);
  if (l == NULL || l->state != SL_LOAN_OFFERED)
    return sl_err_set(err, SUBLET_ENOOFFER,
                      "no loan is on offer on this device; wait for an owner to lend");
  *out = l;
  return 0;
}

/* The owner's uid, root, or the group the daemon was told to trust. */
static int borrow_access(const struct sl_books *b, const struct sl_loan *l,
                         const struct sl_client *c, struct sl_err *err) {
  const struct sl_region *r = sl_books_find_region(b, l->region_id);

  if (sl_peer_reaches(&c->peer, r->owner.uid))
    return 0;
  return sl_err_set(err, SUBLET_EPERM,
                    "uid %u may not borrow loan %" PRIu64 ": another user lent it; run both as "
                    "the same user, or run subletd with --allow-group GROUP for a group the "
                    "borrower is in", (unsigned)c->peer.uid, l->id);
}

static int fresh_fits(const struct sl_books *b, const struct sl_loan *l, uint64_t fresh_pages,
                      struct sl_err *err) {
  uint64_t max_pages = UINT64_MAX / b->cfg.page_size;

  if (fresh_pages <= max_pages - l->unkept - l->kept)
    return 0;
  return sl_err_set(err, SUBLET_EINVAL,
                    "%" PRIu64 " fresh pages do not fit a window; ask for fewer", fresh_pages);
}

/* The loan client c may borrow this way, checked in full. */
static int pick_loan(const struct sl_books *b, const struct sl_client *c, uint64_t loan_id,
                     const uint8_t *token, const char *name, uint64_t fresh_pages,
                     struct sl_loan **out, struct sl_err *err) {
  int rc;

  if (c->loan_id != 0)
    return sl_err_set(err, SUBLET_EBUSY,
                      "client %" PRIu64 " already borrows loan %" PRIu64 "; return it before "
                      "borrowing another", c->id, c->loan_id);
  if (loan_id != 0)
    rc = pick_by_id(b, c->id, loan_id, token, out, err);
  else
    rc = pick_offer(b, c->id, name, out, err);
  if (rc == 0)
    rc = borrow_access(b, *out, c, err);
  /* The next offer is one this user may borrow: another user's is not on offer to it. */
  if (rc == SUBLET_EPERM && loan_id == 0 && (name == NULL || name[0] == '\0'))
    return sl_err_set(err, SUBLET_ENOOFFER, "no loan that uid %u may borrow is on offer on "
                      "this device; wait for one", (unsigned)c->peer.uid);
  if (rc == 0)
    rc = fresh_fits(b, *out, fresh_pages, err);
  return rc;
}

/* The fresh zone of a region's next loan when `available` pages of free memory could back it.
 * A borrower keeps its window from one loan of a region to the next only while the zones keep
 * their sizes (client/window.c), so the zone stays as it was while the free memory has not
 * fallen more than `give` pages below it (the daemon gives half its reserve: a CUDA module
 * loaded lazily during the first loan takes a few MiB for good) and has not grown by more
 * than an eighth (at least 1024 pages). A remap of the window costs far more than that. */
static uint64_t steady_fresh(uint64_t last, uint64_t available, uint64_t give) {
  uint64_t slack = last / 8 > 1024 ? last / 8 : 1024;

  if (last == 0)
    return available;
  if (available < last)
    return last - available <= give ? last : available;
  return available - last <= slack ? last : available;
}

int sl_books_borrow(struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                    const uint8_t *token, const char *name, uint64_t fresh_pages,
                    uint64_t *borrowed_loan, struct sl_err *err) {
  struct sl_client *c = sl_books_find_client(b, client_id);
  struct sl_region *region;
  struct sl_loan *l = NULL;
  int rc;

  if (c == NULL)
    return sl_books_no_client(err, client_id);
  rc = pick_loan(b, c, loan_id, token, name, fresh_pages, &l, err);
  if (rc < 0)
    return rc;
  c->keeps = c->notices && sl_books_kept_window(b, c->id, l->region_id);
  if (c->keeps && sl_books_kept_reserve(b) < 0) {
    c->keeps = 0;
    return sl_books_oom(err);
  }
  if (c->kept_region != l->region_id)
    c->kept_region = 0; /* the client lets go of another region's window (Borrowed) */
  region = sl_books_find_region(b, l->region_id);
  l->state = SL_LOAN_ACTIVE;
  l->borrower_client = c->id;
  l->borrower = c->peer;
  l->fresh = region->last_fresh = steady_fresh(region->last_fresh, fresh_pages, b->cfg.fresh_give);
  l->lo = l->hwm = l->in_order ? l->fresh : 0; /* in order: the kept zone's first page on */
  c->loan_id = l->id;
  if (borrowed_loan != NULL)
    *borrowed_loan = l->id;
  return 0;
}

int sl_books_loan_layout(const struct sl_books *b, uint64_t loan_id, const uint64_t **pages,
                         uint64_t *unkept, uint64_t *fresh, uint64_t *kept) {
  const struct sl_loan *l = sl_books_find_loan(b, loan_id);

  if (l == NULL)
    return SUBLET_ENOENT;
  if (pages != NULL)
    *pages = l->pages;
  if (unkept != NULL)
    *unkept = l->unkept;
  if (fresh != NULL)
    *fresh = l->fresh;
  if (kept != NULL)
    *kept = l->kept;
  return 0;
}

/* ---- ending a loan ------------------------------------------------------------------------ */

static int leak_error(const struct sl_loan *l, struct sl_err *err) {
  char sz[16];

  return sl_err_set(err, SUBLET_ELEAK,
                    "%zu allocation%s (%s) of loan %" PRIu64 " still alive; free them before "
                    "returning, or return with force to forfeit them", l->nallocs,
                    l->nallocs == 1 ? " is" : "s are", sl_format_size(sz, l->live_bytes), l->id);
}

static int end_fill_chunks(const struct sl_loan *l, struct sl_loan_end *end) {
  if (l->nchunks == 0)
    return 0;
  end->fresh_chunks = malloc(l->nchunks * sizeof(*end->fresh_chunks));
  if (end->fresh_chunks == NULL)
    return SUBLET_ENOHOSTMEM;
  for (size_t i = 0; i < l->nchunks; i++)
    end->fresh_chunks[i] = l->chunks[i].id;
  end->nfresh = l->nchunks;
  return 0;
}

/* The plan undone (plan.h); nothing when the owner is gone. */
static int end_fill_restore(const struct sl_loan *l, struct sl_loan_end *end) {
  const struct sl_plan *p = &l->plan;

  if (l->owner_gone)
    return 0;
  if (sl_plan_undo(p, &end->restore, &end->nrestore, &end->unmove, &end->nunmove) != 0)
    return SUBLET_ENOHOSTMEM;
  end->stats.copied_in_bytes = p->saved_bytes;
  return 0;
}

/* A borrower of another user may have kept fds of the pages it was granted (window positions
 * below hwm): they get fresh pages, so that it can never reach the owner's bytes again. Their
 * old content is not needed: a granted page's kept bytes were moved to pages never granted or
 * saved to the host before the grant, and the restore reads only those. */
static int end_fill_replace(const struct sl_books *b, const struct sl_loan *l,
                            struct sl_loan_end *end) {
  const struct sl_region *r = sl_books_find_region(b, l->region_id);
  uint64_t unkept = sl_min_u64(l->hwm, l->unkept), kstart = sl_books_kept_start(l);
  uint64_t kept = l->hwm > kstart ? l->hwm - kstart : 0, n = unkept + kept;

  if (l->owner_gone || r == NULL || l->borrower.uid == r->owner.uid || n == 0)
    return 0;
  end->replace = malloc(n * sizeof(*end->replace));
  if (end->replace == NULL)
    return SUBLET_ENOHOSTMEM;
  /* pages[] holds the unkept pages, then the kept ones, each ascending: merge them. */
  for (uint64_t i = 0, j = 0; i < unkept || j < kept;)
    end->replace[end->nreplace++] =
        j == kept || (i < unkept && l->pages[i] < l->pages[l->unkept + j])
            ? l->pages[i++] : l->pages[l->unkept + j++];
  return 0;
}

static int loan_end_build(const struct sl_books *b, const struct sl_loan *l,
                          struct sl_loan_end *end) {
  memset(end, 0, sizeof(*end));
  end->loan_id = l->id;
  end->region_id = l->region_id;
  end->owner_client = l->owner_client;
  end->borrower_client = l->borrower_client;
  end->borrower_uid = l->borrower.uid;
  end->free_region = l->owner_gone;
  end->stats = l->stats;
  end->stats.owner_gone = l->owner_gone;
  if (end_fill_restore(l, end) < 0 || end_fill_chunks(l, end) < 0 ||
      end_fill_replace(b, l, end) < 0) {
    sl_loan_end_clear(end);
    return SUBLET_ENOHOSTMEM;
  }
  return 0;
}

static void loan_end_apply(struct sl_books *b, const struct sl_loan_end *end) {
  struct sl_region *r = sl_books_find_region(b, end->region_id);

  b->counters.loans_ended++;
  b->counters.copied_in_bytes += end->stats.copied_in_bytes;
  if (r != NULL && end->nreplace > 0)
    r->replacing = 1;
  loan_delete(b);
}

void sl_books_pages_replaced(struct sl_books *b, const struct sl_loan_end *end,
                             size_t replaced) {
  struct sl_region *r = sl_books_find_region(b, end->region_id);
  struct sl_client *c = sl_books_find_client(b, end->borrower_client);

  if (r != NULL) {
    r->replacing = 0;
    r->pages_version += replaced > 0;
    if (replaced > 0) { /* a layout id names the pages too: the next loan's is new */
      free(r->layout);
      r->layout = NULL;
    }
  }
  if (c != NULL)
    c->retained_pages += replaced;
  b->counters.replaced_pages += replaced;
}

size_t sl_books_retained(const struct sl_books *b, struct sl_retained *out, size_t n) {
  size_t k = 0;

  for (size_t i = 0; i < b->nclients; i++) {
    const struct sl_client *c = &b->clients[i];
    if (c->retained_pages == 0)
      continue;
    if (k < n)
      out[k] = (struct sl_retained){c->id, c->peer, c->retained_pages};
    k++;
  }
  return k;
}

int sl_books_return(struct sl_books *b, uint64_t client_id, int force, struct sl_loan_end *end,
                    struct sl_err *err) {
  struct sl_loan *l = NULL;
  int leaked, rc;

  memset(end, 0, sizeof(*end));
  rc = sl_books_borrowed_loan(b, client_id, &l, err);
  if (rc < 0)
    return rc;
  if (l->held_alloc != 0)
    return sl_err_set(err, SUBLET_EBUSY, "loan %" PRIu64 " is saving kept bytes for an "
                      "allocation: wait for its reply before returning", l->id);
  leaked = l->nallocs > 0;
  if (leaked && !force)
    return leak_error(l, err);
  if (loan_end_build(b, l, end) < 0)
    return sl_books_oom(err);
  if (leaked)
    leak_error(l, err);
  loan_end_apply(b, end);
  return leaked ? SUBLET_ELEAK : 0;
}

int sl_books_loan_finish(struct sl_books *b, uint64_t loan_id, struct sl_loan_end *end) {
  struct sl_loan *l = sl_books_find_loan(b, loan_id);

  memset(end, 0, sizeof(*end));
  if (l == NULL)
    return SUBLET_ENOENT;
  if (l->state != SL_LOAN_DRAINING)
    return SUBLET_EBUSY;
  if (loan_end_build(b, l, end) < 0)
    return SUBLET_ENOHOSTMEM;
  loan_end_apply(b, end);
  return 0;
}

void sl_loan_end_clear(struct sl_loan_end *end) {
  if (end == NULL)
    return;
  free(end->restore);
  free(end->unmove);
  free(end->fresh_chunks);
  free(end->replace);
  memset(end, 0, sizeof(*end));
}

/* ---- a client leaves ---------------------------------------------------------------------- */

static int gone_reserve(const struct sl_books *b, uint64_t client_id,
                        struct sl_client_gone *g) {
  size_t owned = 0;

  for (size_t i = 0; i < b->nregions; i++)
    owned += b->regions[i].owner_client == client_id;
  owned += sl_books_kept_count(b, client_id); /* gone regions it may be the last holder of */
  /* One loan at most: one draining entry at most. */
  g->free_regions = owned ? malloc(owned * sizeof(uint64_t)) : NULL;
  g->draining_loans = b->loan ? malloc(sizeof(uint64_t)) : NULL;
  if ((owned && !g->free_regions) || (b->loan && !g->draining_loans)) {
    sl_client_gone_clear(g);
    return SUBLET_ENOHOSTMEM;
  }
  return 0;
}

/* The borrower's allocations die with it; the kept bytes already saved stay to be restored
 * once its process has fully exited. */
static void loan_drop_borrower(struct sl_books *b, struct sl_loan *l, struct sl_client_gone *g) {
  l->state = SL_LOAN_DRAINING;
  l->nallocs = 0;
  l->live_bytes = 0;
  l->stats.borrower_died = 1;
  b->counters.borrowers_died++;
  g->draining_loans[g->ndraining++] = l->id;
}

static void loan_drop_client(struct sl_books *b, uint64_t client_id, struct sl_client_gone *g) {
  struct sl_loan *l = b->loan;

  if (l == NULL)
    return;
  if (l->state == SL_LOAN_OFFERED && l->owner_client == client_id) {
    loan_delete(b); /* withdrawn: nobody borrowed it */
    return;
  }
  if (l->state == SL_LOAN_ACTIVE && l->borrower_client == client_id)
    loan_drop_borrower(b, l, g);
  if (l->owner_client == client_id) { /* the borrower hears of it at its next request */
    l->owner_gone = 1;
    l->stats.owner_gone = 1;
  }
}

/* Idle regions of the client go now; a lent one waits for its loan to end. */
static void regions_drop_owner(struct sl_books *b, uint64_t client_id,
                               struct sl_client_gone *g) {
  size_t kept = 0;

  for (size_t i = 0; i < b->nregions; i++) {
    struct sl_region *r = &b->regions[i];
    if (r->owner_client == client_id && r->loan_id == 0) {
      g->free_regions[g->nfree_regions++] = r->id;
      region_forget(b, r);
    } else {
      b->regions[kept++] = *r;
    }
  }
  b->nregions = kept;
}

int sl_books_client_remove(struct sl_books *b, uint64_t client_id, struct sl_client_gone *gone) {
  struct sl_client *c = sl_books_find_client(b, client_id);
  struct sl_client_gone g = {0};
  size_t i;

  if (gone != NULL)
    memset(gone, 0, sizeof(*gone));
  if (c == NULL)
    return SUBLET_ENOENT;
  if (gone_reserve(b, client_id, &g) < 0)
    return SUBLET_ENOHOSTMEM;
  loan_drop_client(b, client_id, &g);
  regions_drop_owner(b, client_id, &g);
  sl_books_kept_client_gone(b, client_id, g.free_regions, &g.nfree_regions);
  i = (size_t)(c - b->clients);
  memmove(c, c + 1, (b->nclients - i - 1) * sizeof(*c));
  b->nclients--;
  if (gone != NULL)
    *gone = g;
  else
    sl_client_gone_clear(&g);
  return 0;
}

/* ---- observation -------------------------------------------------------------------------- */

int sl_books_loan_info(const struct sl_books *b, uint64_t loan_id, struct sl_loan_info *li) {
  const struct sl_loan *l = sl_books_find_loan(b, loan_id);

  if (l == NULL)
    return SUBLET_ENOENT;
  *li = (struct sl_loan_info){
      .id = l->id, .region_id = l->region_id, .state = l->state,
      .owner_client = l->owner_client, .borrower_client = l->borrower_client,
      .borrower = l->borrower, .unkept_pages = l->unkept + l->kept - l->holding,
      .fresh_pages = l->fresh, .kept_pages = l->holding, .pinned_pages = l->pinned_pages,
      .kept_bytes = l->kept_bytes, .keep_ranges = l->nkeep,
      .lo = l->lo, .hwm = l->hwm,
      .live_allocs = l->nallocs, .live_bytes = l->live_bytes,
      .fresh_chunk_pages = l->fresh_chunk_pages, .layout_id = l->layout_id,
      .owner_gone = l->owner_gone,
      .stats = l->stats};
  memcpy(li->name, l->name, sizeof(li->name));
  return 0;
}

int sl_books_loan_time(struct sl_books *b, uint64_t loan_id, double copy_out_seconds,
                       double move_seconds) {
  struct sl_loan *l = sl_books_find_loan(b, loan_id);

  if (l == NULL)
    return SUBLET_ENOENT;
  l->stats.copy_out_seconds += copy_out_seconds;
  l->stats.move_seconds += move_seconds;
  return 0;
}

const char *sl_books_loan_state_name(enum sl_loan_state s) {
  return s >= SL_LOAN_OFFERED && s <= SL_LOAN_DRAINING ? state_names[s] : "?";
}

uint64_t sl_books_current_loan(const struct sl_books *b) {
  return b->loan != NULL ? b->loan->id : 0;
}

uint64_t sl_books_client_loan(const struct sl_books *b, uint64_t client_id) {
  const struct sl_client *c = sl_books_find_client(b, client_id);

  return c != NULL ? c->loan_id : 0;
}

/* clients, regions, region_pages and loans are what exists now; the rest count since start. */
void sl_books_totals(const struct sl_books *b, struct sl_books_totals *t) {
  *t = b->counters;
  t->clients = b->nclients;
  t->regions = b->nregions;
  t->region_pages = b->region_pages;
  t->loans = b->loan != NULL;
  t->retained_pages = 0;
  for (size_t i = 0; i < b->nclients; i++)
    t->retained_pages += b->clients[i].retained_pages;
}
