/* check.c - the books' invariants (sl_books_check, declared in books.h): everything the
 * ledger promises, checked from its data alone. Slow on purpose (linear or n log n in pages,
 * ranges and moves): the daemon runs it after every request only with --check, for tests.
 *
 * Floor 4 (books_impl.h).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "books_impl.h"
#include "grow.h"

struct check {
  char *why;
  size_t n;
};

static int broken(struct check *ck, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int broken(struct check *ck, const char *fmt, ...) {
  va_list ap;

  if (ck->why != NULL && ck->n > 0) {
    va_start(ap, fmt);
    vsnprintf(ck->why, ck->n, fmt, ap);
    va_end(ap);
  }
  return SUBLET_EPROTO;
}

static int check_clients(const struct sl_books *b, struct check *ck) {
  const struct sl_loan *l = b->loan;
  uint64_t retained = 0;

  for (size_t i = 0; i < b->nclients; i++) {
    const struct sl_client *c = &b->clients[i];
    if (c->id == 0 || c->id >= b->next_client || (i > 0 && c->id <= c[-1].id))
      return broken(ck, "client %" PRIu64 " out of order or never issued", c->id);
    retained += c->retained_pages;
    if (retained > b->counters.replaced_pages)
      return broken(ck, "clients retain %" PRIu64 " old pages, more than the %" PRIu64
                    " ever replaced", retained, b->counters.replaced_pages);
    if (c->loan_id == 0)
      continue;
    if (l == NULL || l->id != c->loan_id || l->borrower_client != c->id ||
        l->state != SL_LOAN_ACTIVE)
      return broken(ck, "client %" PRIu64 " borrows loan %" PRIu64 " which does not have it "
                    "as its active borrower", c->id, c->loan_id);
  }
  return 0;
}

static int check_region(const struct sl_books *b, const struct sl_region *r, struct check *ck) {
  const struct sl_loan *l = sl_books_find_loan(b, r->loan_id);

  if (r->npages == 0)
    return broken(ck, "region %" PRIu64 " has no pages", r->id);
  if (r->space < r->npages)
    return broken(ck, "region %" PRIu64 " of %" PRIu64 " pages reserves %" PRIu64, r->id,
                  r->npages, r->space);
  if (r->loan_id != 0 && (l == NULL || l->region_id != r->id))
    return broken(ck, "region %" PRIu64 " is lent to loan %" PRIu64 " which does not lend it",
                  r->id, r->loan_id);
  if (r->replacing && r->loan_id != 0)
    return broken(ck, "region %" PRIu64 " is lent again while its pages are being replaced",
                  r->id);
  if (r->layout != NULL && (r->layout_id == 0 || r->layout_id >= b->next_layout))
    return broken(ck, "region %" PRIu64 " keeps a layout of bad id %" PRIu64, r->id,
                  r->layout_id);
  /* U + K of its last loan: npages less the pinned pages (a growth must have dropped it) */
  if (r->layout != NULL && (r->layout_pages > r->npages || r->layout_unkept > r->layout_pages))
    return broken(ck, "region %" PRIu64 " of %" PRIu64 " pages keeps a layout of %" PRIu64,
                  r->id, r->npages, r->layout_pages);
  if (sl_books_find_client(b, r->owner_client) != NULL)
    return 0;
  if (l == NULL || !l->owner_gone)
    return broken(ck, "region %" PRIu64 " outlives its owner client %" PRIu64
                  " without a loan holding it", r->id, r->owner_client);
  return 0;
}

/* Page groups: page 0 begins one, each group's span lies in the region, the pages inside it
 * have span 0; a grouped region is not lent. Spans are dropped once none exceeds a page
 * (except while a resume that makes groups runs: books_release.c, plan_groups). */
static int check_spans(const struct sl_region *r, struct check *ck) {
  for (uint64_t p = 0; r->span != NULL && p < r->npages;) {
    uint32_t n = r->span[p];
    if (n == 0 || n > SL_GROUP_PAGES || n > r->npages - p)
      return broken(ck, "region %" PRIu64 " page %" PRIu64 " begins a group of %u pages",
                    r->id, p, n);
    for (uint64_t q = p + 1; q < p + n; q++)
      if (r->span[q] != 0)
        return broken(ck, "region %" PRIu64 " page %" PRIu64 " inside a group has a span",
                      r->id, q);
    p += n;
  }
  if (r->span != NULL && r->loan_id != 0)
    return broken(ck, "region %" PRIu64 " has page groups and is lent", r->id);
  return 0;
}

static int check_regions(const struct sl_books *b, struct check *ck) {
  uint64_t pages = 0;
  int rc;

  for (size_t i = 0; i < b->nregions; i++) {
    const struct sl_region *r = &b->regions[i];
    if (r->id == 0 || r->id >= b->next_region || (i > 0 && r->id <= r[-1].id))
      return broken(ck, "region %" PRIu64 " out of order or never issued", r->id);
    rc = check_region(b, r, ck);
    if (rc == 0)
      rc = check_spans(r, ck);
    if (rc < 0)
      return rc;
    pages += r->npages;
  }
  if (pages != b->region_pages)
    return broken(ck, "region pages %" PRIu64 " counted as %" PRIu64, pages, b->region_pages);
  return 0;
}

static int check_parties(const struct sl_books *b, const struct sl_loan *l,
                         const struct sl_region *r, struct check *ck) {
  const struct sl_client *borrower = sl_books_find_client(b, l->borrower_client);

  if (r->owner_client != l->owner_client)
    return broken(ck, "loan %" PRIu64 " owner %" PRIu64 " is not its region's owner", l->id,
                  l->owner_client);
  if (l->owner_gone == (sl_books_find_client(b, l->owner_client) != NULL))
    return broken(ck, "loan %" PRIu64 " owner_gone=%d disagrees with the client list", l->id,
                  l->owner_gone);
  if (l->state == SL_LOAN_ACTIVE && (borrower == NULL || borrower->loan_id != l->id))
    return broken(ck, "active loan %" PRIu64 " has no live borrower pointing back", l->id);
  if (l->state == SL_LOAN_DRAINING && (borrower != NULL || l->nallocs != 0))
    return broken(ck, "draining loan %" PRIu64 " keeps a borrower or allocations", l->id);
  if (l->state == SL_LOAN_OFFERED &&
      (l->borrower_client != 0 || l->hwm != 0 || l->fresh != 0 || l->owner_gone))
    return broken(ck, "offered loan %" PRIu64 " already has a borrower or an owner gone", l->id);
  return 0;
}

/* The pinned pairs: ascending, disjoint, within the region, counted right. */
static int check_pinned(const struct sl_loan *l, uint64_t npages, struct check *ck) {
  uint64_t end = 0, pages = 0;

  for (size_t i = 0; i < l->npinned; i++) {
    uint64_t first = l->pinned[2 * i], count = l->pinned[2 * i + 1];
    if (count == 0 || first < end || first >= npages || count > npages - first)
      return broken(ck, "loan %" PRIu64 " pinned pair %zu is empty, out of order or outside "
                    "the region", l->id, i);
    end = first + count;
    pages += count;
  }
  if (pages != l->pinned_pages || (l->npinned > 0 && l->pinned == NULL))
    return broken(ck, "loan %" PRIu64 " counts %" PRIu64 " pinned pages, not %" PRIu64, l->id,
                  l->pinned_pages, pages);
  return 0;
}

/* Does a kept byte lie in a page flags marks pinned? */
static int keep_in_pinned(const struct sl_loan *l, uint64_t ps, const uint8_t *flags) {
  for (size_t i = 0; i < l->nkeep && l->npinned > 0; i++)
    for (uint64_t p = l->keep[i].offset / ps; p * ps < l->keep[i].offset + l->keep[i].length; p++)
      if (flags[p] == SL_PAGE_PINNED)
        return 1;
  return 0;
}

/* Pinned pages are in no window position: each position's page is unkept or kept as its
 * zone says, ascending in its zone; with the counts, every other page is in the window. */
static int check_zones(const struct sl_loan *l, uint64_t npages, const uint8_t *flags,
                       struct check *ck) {
  for (uint64_t i = 0; i < l->unkept + l->kept; i++) {
    uint64_t p = l->pages[i];
    int want = i >= l->unkept ? SL_PAGE_KEPT : SL_PAGE_UNKEPT;
    if (p >= npages || flags[p] != want || (i != l->unkept && i > 0 && p <= l->pages[i - 1]))
      return broken(ck, "loan %" PRIu64 " window page %" PRIu64 " is misplaced", l->id, i);
  }
  if (l->holding != l->kept)
    return broken(ck, "loan %" PRIu64 " counts %" PRIu64 " pages holding kept bytes, not its "
                  "%" PRIu64 " kept ones", l->id, l->holding, l->kept);
  return 0;
}

/* In order: the kept zone is the region's pages from 0 (a pinned tail excepted, which the
 * counts leave out), and holding counts those with kept bytes. */
static int check_in_order(const struct sl_loan *l, const uint8_t *flags, struct check *ck) {
  uint64_t holding = 0;

  if (l->unkept != 0 || (l->npinned > 0 && l->pinned[0] != l->kept))
    return broken(ck, "loan %" PRIu64 " is in order with %" PRIu64 " unkept pages or pinned "
                  "pages before its last", l->id, l->unkept);
  for (uint64_t i = 0; i < l->kept; i++) {
    if (l->pages[i] != i)
      return broken(ck, "loan %" PRIu64 " in order has page %" PRIu64 " at %" PRIu64, l->id,
                    l->pages[i], i);
    holding += flags[i] == SL_PAGE_KEPT;
  }
  if (holding != l->holding)
    return broken(ck, "loan %" PRIu64 " counts %" PRIu64 " pages holding kept bytes, not "
                  "%" PRIu64, l->id, l->holding, holding);
  return 0;
}

static int check_layout(const struct sl_books *b, const struct sl_loan *l, uint64_t npages,
                        struct check *ck) {
  uint64_t bytes = 0, limit = npages * b->cfg.page_size;
  uint8_t *flags;
  int rc = 0;

  for (size_t i = 0; i < l->nkeep; i++) {
    const struct sublet_range *k = &l->keep[i];
    uint64_t prev_end = i > 0 ? k[-1].offset + k[-1].length : 0;
    if (k->length == 0 || k->offset > limit || k->length > limit - k->offset ||
        (i > 0 && k->offset <= prev_end))
      return broken(ck, "loan %" PRIu64 " keep range %zu is not merged or not in the region",
                    l->id, i);
    bytes += k->length;
  }
  if (bytes != l->kept_bytes || l->unkept + l->kept + l->pinned_pages != npages)
    return broken(ck, "loan %" PRIu64 " kept bytes or page counts are off", l->id);
  if ((rc = check_pinned(l, npages, ck)) != 0)
    return rc;
  flags = calloc(npages, 1);
  if (flags == NULL)
    return broken(ck, "out of memory while checking");
  sl_books_mark_pinned_pages(l->pinned, l->npinned, flags);
  if (keep_in_pinned(l, b->cfg.page_size, flags))
    rc = broken(ck, "loan %" PRIu64 " keeps bytes of a pinned page", l->id);
  sl_books_mark_kept_pages(l->keep, l->nkeep, b->cfg.page_size, flags);
  if (rc == 0)
    rc = l->in_order ? check_in_order(l, flags, ck) : check_zones(l, npages, flags, ck);
  free(flags);
  return rc;
}

static int check_allocs(const struct sl_books *b, const struct sl_loan *l, struct check *ck) {
  uint64_t bytes = 0, prev_end = 0, ps = b->cfg.page_size;

  if (l->hwm > sl_books_window_size(l) || l->lo > l->hwm || (!l->in_order && l->lo != 0) ||
      (l->in_order && l->state != SL_LOAN_OFFERED && (l->lo > l->fresh || l->hwm < l->fresh)))
    return broken(ck, "loan %" PRIu64 " handed out [%" PRIu64 ", %" PRIu64 "): not one span "
                  "of its window that a loan %s may have", l->id, l->lo, l->hwm,
                  l->in_order ? "in order" : "not in order");
  prev_end = l->lo;
  for (size_t i = 0; i < l->nallocs; i++) {
    const struct sl_alloc *a = &l->allocs[i];
    if (a->npages == 0 || a->pos < prev_end || a->pos + a->npages > l->hwm)
      return broken(ck, "allocation %" PRIu64 " overlaps another or lies outside [lo, hwm)",
                    a->id);
    if (a->id == 0 || a->id >= b->next_alloc || a->size == 0 || sl_books_pages_for(b, a->size) != a->npages)
      return broken(ck, "allocation %" PRIu64 " has a bad id or size", a->id);
    for (size_t j = 0; j < i; j++)
      if (l->allocs[j].id == a->id)
        return broken(ck, "allocation %" PRIu64 " granted twice", a->id);
    prev_end = a->pos + a->npages;
    bytes += a->npages * ps;
  }
  if (bytes != l->live_bytes || l->stats.peak_bytes < bytes || l->stats.allocations < l->nallocs)
    return broken(ck, "loan %" PRIu64 " live bytes %" PRIu64 " counted as %" PRIu64, l->id,
                  bytes, l->live_bytes);
  return 0;
}

static int check_chunks(const struct sl_books *b, const struct sl_loan *l, struct check *ck) {
  uint64_t start = sl_max_u64(l->lo, l->unkept), pos = start;
  uint64_t end = sl_max_u64(start, sl_min_u64(l->hwm, sl_books_kept_start(l)));

  for (size_t i = 0; i < l->nchunks; i++) {
    const struct sl_chunk *c = &l->chunks[i];
    /* made in the order the span grew: up (ids ascend), or in order down (ids descend) */
    if (c->pos != pos || c->npages == 0 || c->id == 0 || c->id >= b->next_chunk ||
        (i > 0 && (l->in_order ? c->id >= c[-1].id : c->id <= c[-1].id)))
      return broken(ck, "loan %" PRIu64 " fresh chunk %" PRIu64 " is misplaced", l->id, c->id);
    pos += c->npages;
  }
  if (pos != end || l->fresh_chunk_pages != end - start)
    return broken(ck, "loan %" PRIu64 " fresh positions up to %" PRIu64 " are not all backed "
                  "by chunks (%" PRIu64 " are)", l->id, end, pos);
  return 0;
}

/* ---- where the kept bytes of lent pages went ---------------------------------------------- */

struct span {
  uint64_t lo, hi;
};

struct spans {
  struct span *v;
  size_t n, cap;
  int failed; /* out of memory */
};

static void spans_add(struct spans *s, uint64_t lo, uint64_t len) {
  struct span *v = sl_grow(s->v, &s->cap, s->n + 1, sizeof(*v));

  if (v == NULL) {
    s->failed = 1;
    return;
  }
  s->v = v;
  s->v[s->n++] = (struct span){lo, lo + len};
}

static int cmp_span(const void *a, const void *b) {
  const struct span *x = a, *y = b;
  return (x->lo > y->lo) - (x->lo < y->lo);
}

/* Sorts and merges touching spans; returns -1 if two of them overlap. */
static int spans_normalize(struct spans *s) {
  size_t m = 0;
  int overlap = 0;

  if (s->n == 0)
    return 0;
  qsort(s->v, s->n, sizeof(*s->v), cmp_span);
  for (size_t i = 0; i < s->n; i++) {
    if (m > 0 && s->v[m - 1].hi > s->v[i].lo)
      overlap = 1;
    if (m > 0 && s->v[m - 1].hi >= s->v[i].lo)
      s->v[m - 1].hi = sl_max_u64(s->v[m - 1].hi, s->v[i].hi);
    else
      s->v[m++] = s->v[i];
  }
  s->n = m;
  return overlap ? -1 : 0;
}

static int spans_equal(const struct spans *a, const struct spans *b) {
  if (a->n != b->n)
    return 0;
  for (size_t i = 0; i < a->n; i++)
    if (a->v[i].lo != b->v[i].lo || a->v[i].hi != b->v[i].hi)
      return 0;
  return 1;
}

/* The index of page in the ascending pages[lo, hi), or hi. */
static uint64_t find_page(const uint64_t *pages, uint64_t lo, uint64_t hi, uint64_t page) {
  uint64_t end = hi;

  while (lo < hi) {
    uint64_t mid = lo + (hi - lo) / 2;
    if (pages[mid] < page)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < end && pages[lo] == page ? lo : end;
}

/* The kept zone index of the page holding region byte off, or npages when not a zone page.
 * The zone ascends before and after the reached prefix (a loan's ascends throughout; a
 * release's window follows the pages it reached: books_release.c). */
static uint64_t zone_index(const struct sl_plan *p, uint64_t off) {
  uint64_t page = off / p->page_size, i = find_page(p->pages, 0, p->reached, page);

  if (i < p->reached)
    return i;
  i = find_page(p->pages, p->reached, p->npages, page);
  return i < p->npages ? i : p->npages;
}

static int touches_kept(const struct sl_plan *p, uint64_t lo, uint64_t hi) {
  size_t a = sl_plan_keep_after(p, lo);

  return a < p->nkeep && p->keep[a].offset < hi;
}

/* A move takes kept bytes out of lent pages into unkept bytes of one kept page. */
static int move_ok(const struct sl_plan *p, const struct sl_move *m) {
  uint64_t di = zone_index(p, m->dst_off);

  return m->len > 0 && zone_index(p, m->src_off) < p->reached &&
         zone_index(p, m->src_off + m->len - 1) < p->reached && di < p->npages &&
         zone_index(p, m->dst_off + m->len - 1) == di &&
         !touches_kept(p, m->dst_off, m->dst_off + m->len);
}

/* What left the lent kept pages (saved, or moved out) is exactly what they held: their kept
 * bytes and the bytes moved into them before they were lent. */
static int plan_accounting(const struct sl_plan *p, struct spans *have, struct spans *want,
                           struct spans *dsts) {
  uint64_t host = 0, ps = p->page_size;

  for (size_t i = 0; i < p->nsaves; i++) {
    if (p->saves[i].host_off != host || p->saves[i].len == 0)
      return -1;
    host += p->saves[i].len;
    spans_add(have, p->saves[i].dev_off, p->saves[i].len);
  }
  for (size_t i = 0; i < p->nmoves; i++) {
    const struct sl_move *m = &p->moves[i];
    if (!move_ok(p, m))
      return -2;
    spans_add(have, m->src_off, m->len);
    spans_add(dsts, m->dst_off, m->len);
    if (zone_index(p, m->dst_off) < p->reached)
      spans_add(want, m->dst_off, m->len);
  }
  for (uint64_t q = 0; q < p->reached; q++) {
    uint64_t start = p->pages[q] * ps, end = start + ps;
    for (size_t k = sl_plan_keep_after(p, start); k < p->nkeep && p->keep[k].offset < end; k++) {
      uint64_t lo = sl_max_u64(start, p->keep[k].offset);
      spans_add(want, lo, sl_min_u64(end, p->keep[k].offset + p->keep[k].length) - lo);
    }
  }
  return host == p->saved_bytes ? 0 : -1;
}

/* The plan's saves and moves account for the kept bytes of the pages it reached (what names
 * the loan or release whose plan it is, for the message). */
static int check_accounting(const struct sl_plan *p, const char *what, uint64_t id,
                            struct check *ck) {
  struct spans have = {0}, want = {0}, dsts = {0};
  int rc = 0, how = plan_accounting(p, &have, &want, &dsts);

  if (have.failed || want.failed || dsts.failed)
    rc = broken(ck, "out of memory while checking");
  else if (how == -1)
    rc = broken(ck, "%s %" PRIu64 " saves are not packed in host memory", what, id);
  else if (how == -2)
    rc = broken(ck, "%s %" PRIu64 " moves a byte that is not kept in a lent page, or into "
                "kept bytes", what, id);
  else if (spans_normalize(&have) < 0 || spans_normalize(&dsts) < 0)
    rc = broken(ck, "%s %" PRIu64 " saves or moves a byte twice", what, id);
  else if (spans_normalize(&want), !spans_equal(&have, &want))
    rc = broken(ck, "%s %" PRIu64 " lent kept pages whose bytes were neither saved nor "
                "moved (or saved bytes that were not theirs)", what, id);
  free(have.v);
  free(want.v);
  free(dsts.v);
  return rc;
}

static int check_plan(const struct sl_books *b, const struct sl_loan *l, struct check *ck) {
  const struct sl_plan *p = &l->plan;
  uint64_t ks = sl_books_kept_start(l), reached = l->hwm > ks ? l->hwm - ks : 0;

  (void)b;
  if (p->reached != reached || p->npages != l->kept || p->saved_bytes != l->stats.copied_out_bytes ||
      p->moved_bytes != l->stats.moved_bytes || l->stats.copied_in_bytes != 0)
    return broken(ck, "loan %" PRIu64 " plan reached %" PRIu64 " of %" PRIu64 " kept pages "
                  "(hwm says %" PRIu64 ") or its byte counts disagree with the stats", l->id,
                  p->reached, p->npages, reached);
  return check_accounting(p, "loan", l->id, ck);
}

static int check_loan(const struct sl_books *b, struct check *ck) {
  const struct sl_loan *l = b->loan;
  const struct sl_region *r;
  int rc;

  if (l == NULL)
    return 0;
  r = sl_books_find_region(b, l->region_id);
  if (l->id == 0 || l->id >= b->next_loan || l->state < SL_LOAN_OFFERED ||
      l->state > SL_LOAN_DRAINING)
    return broken(ck, "loan %" PRIu64 " has a bad id or state", l->id);
  if (r == NULL || r->loan_id != l->id)
    return broken(ck, "loan %" PRIu64 " region %" PRIu64 " is missing or does not point back",
                  l->id, l->region_id);
  rc = check_parties(b, l, r, ck);
  if (rc == 0)
    rc = check_layout(b, l, r->npages, ck);
  if (rc == 0 && (l->layout_id == 0 || l->layout_id >= b->next_layout))
    rc = broken(ck, "loan %" PRIu64 " has bad layout id %" PRIu64, l->id, l->layout_id);
  /* One id, one layout: a borrower that holds the id is not sent the layout. */
  if (rc == 0 && r->layout != NULL && r->layout_id == l->layout_id &&
      (r->layout_unkept != l->unkept || r->layout_pages != l->unkept + l->kept ||
       memcmp(r->layout, l->pages, r->layout_pages * sizeof(*l->pages)) != 0))
    rc = broken(ck, "loan %" PRIu64 " has the layout id of its region's last loan, not its "
                "layout", l->id);
  if (rc == 0)
    rc = check_allocs(b, l, ck);
  if (rc == 0)
    rc = check_chunks(b, l, ck);
  if (rc == 0)
    rc = check_plan(b, l, ck);
  if (rc == 0 && l->held_alloc != 0 &&
      (l->held_alloc != b->next_alloc || l->state != SL_LOAN_ACTIVE))
    rc = broken(ck, "loan %" PRIu64 " holds allocation %" PRIu64 " that is not the next one "
                "or not in an active loan", l->id, l->held_alloc);
  return rc;
}

static int check_totals(const struct sl_books *b, struct check *ck) {
  const struct sl_loan *l = b->loan;
  const struct sl_books_totals *t = &b->counters;

  if (t->copied_in_bytes > t->copied_out_bytes)
    return broken(ck, "more bytes restored (%" PRIu64 ") than saved (%" PRIu64 ")",
                  t->copied_in_bytes, t->copied_out_bytes);
  if (l == NULL)
    return 0;
  if (t->copied_out_bytes < l->stats.copied_out_bytes ||
      t->served_bytes[SL_SRC_UNKEPT] < l->stats.served_unkept_bytes ||
      t->served_bytes[SL_SRC_FRESH] < l->stats.served_fresh_bytes ||
      t->served_bytes[SL_SRC_KEPT] < l->stats.served_kept_bytes)
    return broken(ck, "device totals are below loan %" PRIu64 "'s own counts", l->id);
  return 0;
}

/* Kept windows (kept.c): a keeper keeps a live region of another client and hears notices;
 * a holder holds a region that is gone, once; every keeper has room to become a holder. */
static int check_kept(const struct sl_books *b, struct check *ck) {
  for (size_t i = 0; i < b->nclients; i++) {
    const struct sl_client *c = &b->clients[i];
    const struct sl_region *r = sl_books_find_region(b, c->kept_region);
    if (c->kept_region != 0 && (r == NULL || r->owner_client == c->id || !c->notices))
      return broken(ck, "client %" PRIu64 " keeps region %" PRIu64 ", which is gone, its own, "
                    "or it hears no notices", c->id, c->kept_region);
    if (c->keeps && c->loan_id == 0)
      return broken(ck, "client %" PRIu64 " keeps the window of no loan", c->id);
  }
  if (b->cap_held < b->nheld + sl_books_kept_keepers(b))
    return broken(ck, "room for %zu held regions, not for every keeper's (%zu)", b->cap_held,
                  b->nheld + sl_books_kept_keepers(b));
  for (size_t i = 0; i < b->nheld; i++) {
    const struct sl_held *h = &b->held[i];
    if (sl_books_find_region(b, h->region_id) != NULL ||
        sl_books_find_client(b, h->holder_client) == NULL)
      return broken(ck, "held region %" PRIu64 " (client %" PRIu64 ") is still in the books, "
                    "or its holder is gone", h->region_id, h->holder_client);
    for (size_t j = i + 1; j < b->nheld; j++)
      if (b->held[j].region_id == h->region_id && b->held[j].holder_client == h->holder_client)
        return broken(ck, "region %" PRIu64 " held twice by client %" PRIu64, h->region_id,
                      h->holder_client);
  }
  return 0;
}

/* Is p one of l's window pages (two ascending runs: unkept, kept)? */
static int in_run(const uint64_t *v, uint64_t n, uint64_t p) {
  size_t i = sl_books_lower_bound(v, (size_t)n, p);

  return i < n && v[i] == p;
}

static int page_in(const struct sl_loan *l, uint64_t p) {
  return in_run(l->pages, l->unkept, p) || in_run(l->pages + l->unkept, l->kept, p);
}

/* Every kept byte of a released page left it: the plan reached each released page that holds
 * one (its zone: books_release.c), and its saves and moves account for them. */
static int check_release_plan(const struct sl_books *b, const struct sl_release *rel,
                              struct check *ck) {
  const struct sl_plan *p = &rel->l->plan;
  uint64_t ps = b->cfg.page_size;

  for (size_t i = 0; i < rel->nreleased; i++) {
    uint64_t start = rel->released[i] * ps;
    if (touches_kept(p, start, start + ps) && zone_index(p, start) >= p->reached)
      return broken(ck, "release %" PRIu64 " lets go of page %" PRIu64 " with its kept bytes",
                    rel->id, rel->released[i]);
  }
  return check_accounting(p, "release", rel->id, ck);
}

/* Releases: ascending ids, each of a live region's owner, its layout sound for the region as
 * it was (a growable one may have grown since), its released pages ascending pages of its own,
 * no page in two releases of a region, no release of a lent region. */
static int check_release(const struct sl_books *b, const struct sl_release *rel,
                         struct check *ck) {
  const struct sl_region *r = sl_books_find_region(b, rel->region_id);
  const struct sl_loan *l = rel->l;
  uint64_t npages = l->unkept + l->kept + l->pinned_pages;
  int rc;

  if (r == NULL || r->owner_client != rel->owner_client || r->loan_id != 0 || npages > r->npages)
    return broken(ck, "release %" PRIu64 " is of no region of its owner, or of a lent one",
                  rel->id);
  if ((rc = check_layout(b, l, npages, ck)) != 0)
    return rc;
  /* By need, pages that hold no kept byte may stay (only the need's pages go). */
  if (rel->stayed > (rel->by_need ? l->unkept + l->kept : l->kept) ||
      rel->held > l->unkept + l->kept - rel->stayed ||
      rel->nreleased != l->unkept + l->kept - rel->stayed - rel->held)
    return broken(ck, "release %" PRIu64 " released or stayed pages are miscounted", rel->id);
  for (size_t i = 1; i < rel->nreleased; i++)
    if (rel->released[i] <= rel->released[i - 1])
      return broken(ck, "release %" PRIu64 " released pages are not ascending", rel->id);
  for (size_t i = 0, j; i < rel->nreleased; i = j) { /* whole groups */
    for (j = i + 1; j < rel->nreleased && rel->released[j] == rel->released[j - 1] + 1; j++)
      ;
    if (!sl_books_whole_groups(r, rel->released[i], rel->released[j - 1] - rel->released[i] + 1))
      return broken(ck, "release %" PRIu64 " releases part of a page group", rel->id);
  }
  return check_release_plan(b, rel, ck);
}

static int check_releases(const struct sl_books *b, struct check *ck) {
  for (size_t i = 0; i < b->nreleases; i++) {
    const struct sl_release *rel = &b->releases[i];
    int rc;
    if (i > 0 && rel->id <= rel[-1].id)
      return broken(ck, "releases are not in id order");
    if ((rc = check_release(b, rel, ck)) != 0)
      return rc;
    for (size_t j = 0; j < i; j++) {
      const struct sl_loan *o = b->releases[j].l;
      if (b->releases[j].region_id != rel->region_id)
        continue;
      for (uint64_t k = 0; k < o->unkept + o->kept; k++)
        if (page_in(rel->l, o->pages[k]))
          return broken(ck, "releases %" PRIu64 " and %" PRIu64 " share page %" PRIu64,
                        b->releases[j].id, rel->id, o->pages[k]);
    }
  }
  return 0;
}

int sl_books_check(const struct sl_books *b, char *why, size_t n) {
  struct check ck = {why, n};
  int rc = check_clients(b, &ck);

  if (rc == 0)
    rc = check_regions(b, &ck);
  if (rc == 0)
    rc = check_loan(b, &ck);
  if (rc == 0)
    rc = check_totals(b, &ck);
  if (rc == 0)
    rc = check_kept(b, &ck);
  if (rc == 0)
    rc = check_releases(b, &ck);
  if (rc == 0 && why != NULL && n > 0)
    why[0] = '\0';
  return rc;
}
