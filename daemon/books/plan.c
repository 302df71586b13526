/* plan.c - where kept bytes go when their page is handed out (the contract is plan.h).
 *
 * Work is linear in the pieces a step makes and the pages it reaches, with one binary search
 * per step: a 64 GiB region keeping 300,000 scattered blocks makes about as many moves, once.
 *
 * Floor 1 (books_impl.h).
 */
#include "plan.h"

#include "grow.h"

#include <stdlib.h>
#include <string.h>

/* A growing list; neighbours contiguous in both address spaces merge as they come. */
struct move_list {
  struct sl_move *v;
  size_t n, cap;
  uint64_t bytes;
};

struct save_list {
  struct sl_copy *v;
  size_t n, cap;
  uint64_t bytes, host_off; /* host_off: where the next saved byte goes */
};

/* The filling cursor of a step: the next hole, and the lowest index it may use. k is the first
 * keep range that ends after the hole, while the cursor stays in page k_sink: holes of one page
 * are then found walking, not by a search each (a search per move cost 8 to 23 ms of the loop
 * for the 100,000 to 300,000 moves of a KV cache's scattered blocks). */
struct cursor {
  uint64_t sink, off, floor;
  size_t k;
  uint64_t k_sink; /* UINT64_MAX: k not known */
};

static int move_add(struct move_list *l, uint64_t src, uint64_t dst, uint64_t len) {
  struct sl_move *last = l->n ? &l->v[l->n - 1] : NULL;
  struct sl_move *v;

  l->bytes += len;
  if (last && last->src_off + last->len == src && last->dst_off + last->len == dst) {
    last->len += len;
    return 0;
  }
  v = sl_grow(l->v, &l->cap, l->n + 1, sizeof(*v));
  if (v == NULL)
    return SUBLET_ENOHOSTMEM;
  l->v = v;
  v[l->n++] = (struct sl_move){src, dst, len};
  return 0;
}

static int save_add(struct save_list *l, uint64_t dev_off, uint64_t len) {
  struct sl_copy *last = l->n ? &l->v[l->n - 1] : NULL;
  struct sl_copy *v;

  l->bytes += len;
  l->host_off += len;
  if (last && last->dev_off + last->len == dev_off) { /* host side is always contiguous */
    last->len += len;
    return 0;
  }
  v = sl_grow(l->v, &l->cap, l->n + 1, sizeof(*v));
  if (v == NULL)
    return SUBLET_ENOHOSTMEM;
  l->v = v;
  v[l->n++] = (struct sl_copy){dev_off, l->host_off - len, len};
  return 0;
}

void sl_plan_init(struct sl_plan *p, uint64_t page_size, const struct sublet_range *keep,
                  size_t nkeep, const uint64_t *pages, uint64_t npages, int compact) {
  memset(p, 0, sizeof(*p));
  p->compact = compact;
  p->page_size = page_size;
  p->keep = keep;
  p->nkeep = nkeep;
  p->pages = pages;
  p->npages = npages;
  p->sink = npages > 0 ? npages - 1 : 0;
}

void sl_plan_release(struct sl_plan *p) {
  free(p->moves);
  free(p->saves);
  p->moves = NULL;
  p->saves = NULL;
  p->nmoves = p->nsaves = p->cap_moves = p->cap_saves = 0;
}

size_t sl_plan_keep_after(const struct sl_plan *p, uint64_t off) {
  size_t lo = 0, hi = p->nkeep;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (p->keep[mid].offset + p->keep[mid].length <= off)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static uint64_t page_start(const struct sl_plan *p, uint64_t i) {
  return p->pages[i] * p->page_size;
}

static uint64_t keep_end(const struct sl_plan *p, size_t k) {
  return p->keep[k].offset + p->keep[k].length;
}

/* sl_plan_keep_after(p, off) found from k, its answer for an offset at or above off: ranges
 * end in ascending order, so it walks back over the few between (a binary search a page was
 * most of a step's work: 4,600 pages of scattered blocks cost 0.7 ms in searches alone). */
static size_t keep_after_below(const struct sl_plan *p, size_t k, uint64_t off) {
  while (k > 0 && keep_end(p, k - 1) > off)
    k--;
  return k;
}

/* The same from k, its answer for an offset at or below off. */
static size_t keep_after_above(const struct sl_plan *p, size_t k, uint64_t off) {
  while (k < p->nkeep && keep_end(p, k) <= off)
    k++;
  return k;
}

/* The first keep range ending after x, the cursor's hole in its current page: known while it
 * stays in one page, walked back to when it went down one page, searched otherwise. */
static size_t cursor_keep(const struct sl_plan *p, const struct cursor *c, uint64_t x) {
  if (c->k_sink == c->sink)
    return c->k;
  if (c->k_sink == c->sink + 1)
    return keep_after_below(p, c->k, x);
  return sl_plan_keep_after(p, x);
}

/* The next free hole at or after the cursor, as [*at, *at + *len); 0 when none is left above
 * the cursor's floor. Exhausted pages are left behind, downwards. */
static int next_hole(const struct sl_plan *p, struct cursor *c, uint64_t *at, uint64_t *len) {
  while (c->sink >= c->floor && c->sink < p->npages) {
    uint64_t start = page_start(p, c->sink), end = start + p->page_size, x = start + c->off;
    size_t k = cursor_keep(p, c, x);
    if (k < p->nkeep && p->keep[k].offset <= x) { /* inside a kept range: skip it */
      x = p->keep[k].offset + p->keep[k].length;
      k++;
    }
    if (x < end) {
      *at = x;
      *len = sl_min_u64(end, k < p->nkeep ? p->keep[k].offset : end) - x;
      c->off = x - start;
      c->k = k; /* place() uses at most the hole: k stays the first range ending after it */
      c->k_sink = c->sink;
      return 1;
    }
    if (c->sink == 0)
      break;
    c->k = k; /* an upper bound for the page below: cursor_keep walks back from it */
    c->k_sink = c->sink;
    c->sink--;
    c->off = 0;
  }
  return 0;
}

/* Moves [src, src+len) into holes above the floor; what does not fit is saved. */
static int place(const struct sl_plan *p, struct cursor *c, uint64_t src, uint64_t len,
                 struct move_list *ml, struct save_list *sl) {
  uint64_t at, hole;

  while (len > 0 && next_hole(p, c, &at, &hole)) {
    uint64_t n = sl_min_u64(len, hole);
    if (move_add(ml, src, at, n) < 0)
      return SUBLET_ENOHOSTMEM;
    c->off += n;
    src += n;
    len -= n;
  }
  return len > 0 ? save_add(sl, src, len) : 0;
}

/* The first move whose destination lies in region page pg or below (moves descend by page). */
static size_t moves_into(const struct sl_plan *p, uint64_t pg) {
  size_t lo = 0, hi = p->nmoves;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (p->moves[mid].dst_off / p->page_size > pg)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* Page i holds moved bytes: its own kept bytes and the moved ones go to the host, merged in
 * address order so that a dense page copies in few long pieces. */
static int save_dense(const struct sl_plan *p, uint64_t i, size_t k, struct save_list *sl) {
  uint64_t start = page_start(p, i), end = start + p->page_size, pg = p->pages[i];
  size_t m = moves_into(p, pg);
  int rc = 0;

  while (rc == 0) {
    int have_k = k < p->nkeep && p->keep[k].offset < end;
    int have_m = m < p->nmoves && p->moves[m].dst_off / p->page_size == pg;
    if (!have_k && !have_m)
      break;
    if (have_k && (!have_m || p->keep[k].offset < p->moves[m].dst_off)) {
      uint64_t lo = p->keep[k].offset > start ? p->keep[k].offset : start;
      rc = save_add(sl, lo, sl_min_u64(end, p->keep[k].offset + p->keep[k].length) - lo);
      k++;
    } else {
      rc = save_add(sl, p->moves[m].dst_off, p->moves[m].len);
      m++;
    }
  }
  return rc;
}

/* The kept bytes of page i leave it, moved above the floor or saved; k is the first keep
 * range ending after the page's start. */
static int empty_page(const struct sl_plan *p, uint64_t i, size_t k, struct cursor *c,
                      struct move_list *ml, struct save_list *sl) {
  uint64_t start = page_start(p, i), end = start + p->page_size;
  uint64_t lowest_filled = p->sink_off > 0 ? p->sink : p->sink + 1;
  int rc = 0;

  if (i >= lowest_filled && p->nmoves > 0)
    return save_dense(p, i, k, sl);
  for (; rc == 0 && k < p->nkeep && p->keep[k].offset < end; k++) {
    uint64_t lo = p->keep[k].offset > start ? p->keep[k].offset : start;
    rc = place(p, c, lo, sl_min_u64(end, p->keep[k].offset + p->keep[k].length) - lo, ml, sl);
  }
  return rc;
}

int sl_plan_reach(const struct sl_plan *p, uint64_t from, uint64_t to, struct sl_plan_step *s) {
  struct cursor c = {p->sink, p->sink_off, p->compact ? to : p->npages, 0, UINT64_MAX};
  struct move_list ml = {0};
  struct save_list sl = {.host_off = p->saved_bytes};
  size_t k;
  int rc = 0;

  memset(s, 0, sizeof(*s));
  if (from != p->reached || to <= from || to > p->npages)
    return SUBLET_EINVAL;
  /* The kept zone's pages ascend, so the first range ending after each page's start does. */
  k = sl_plan_keep_after(p, page_start(p, from));
  for (uint64_t i = from; i < to && rc == 0; i++) {
    k = keep_after_above(p, k, page_start(p, i));
    rc = empty_page(p, i, k, &c, &ml, &sl);
  }
  *s = (struct sl_plan_step){from, to, ml.v, ml.n, ml.bytes, sl.v, sl.n, sl.bytes, c.sink,
                             c.off};
  if (rc < 0)
    sl_plan_step_clear(s);
  return rc;
}

uint64_t sl_plan_page_kept(const struct sl_plan *p, uint64_t i, size_t *k) {
  uint64_t start = page_start(p, i), end = start + p->page_size, bytes = 0;

  *k = keep_after_above(p, *k, start);
  for (size_t j = *k; j < p->nkeep && p->keep[j].offset < end; j++)
    bytes += sl_min_u64(end, keep_end(p, j)) - sl_max_u64(start, p->keep[j].offset);
  return bytes;
}

/* Kept bytes in kept zone indices [from, to), walking k as sl_plan_page_kept does. */
static uint64_t kept_in(const struct sl_plan *p, uint64_t from, uint64_t to, size_t *k) {
  uint64_t bytes = 0;

  for (uint64_t i = from; i < to; i++)
    bytes += sl_plan_page_kept(p, i, k);
  return bytes;
}

int sl_plan_must_save(const struct sl_plan *p, uint64_t from, uint64_t to) {
  uint64_t need, holes;
  size_t k;

  if (to <= from || to > p->npages)
    return 0;
  k = sl_plan_keep_after(p, page_start(p, from));
  need = kept_in(p, from, to, &k);
  if (!p->compact)
    return need > 0;
  holes = (p->npages - to) * p->page_size - kept_in(p, to, p->npages, &k);
  return need > holes;
}

int sl_plan_commit(struct sl_plan *p, const struct sl_plan_step *s) {
  struct sl_move *mv;
  struct sl_copy *sv;

  if (s->from != p->reached)
    return SUBLET_EINVAL;
  mv = sl_grow(p->moves, &p->cap_moves, p->nmoves + s->nmoves, sizeof(*mv));
  if (mv == NULL && s->nmoves > 0)
    return SUBLET_ENOHOSTMEM;
  p->moves = mv;
  sv = sl_grow(p->saves, &p->cap_saves, p->nsaves + s->nsaves, sizeof(*sv));
  if (sv == NULL && s->nsaves > 0)
    return SUBLET_ENOHOSTMEM;
  p->saves = sv;
  if (s->nmoves)
    memcpy(mv + p->nmoves, s->moves, s->nmoves * sizeof(*mv));
  p->nmoves += s->nmoves;
  for (size_t i = 0; i < s->nsaves; i++) { /* two steps' pieces may join */
    struct sl_copy *last = p->nsaves ? &sv[p->nsaves - 1] : NULL;
    if (last && last->dev_off + last->len == s->saves[i].dev_off &&
        last->host_off + last->len == s->saves[i].host_off)
      last->len += s->saves[i].len;
    else
      sv[p->nsaves++] = s->saves[i];
  }
  p->moved_bytes += s->moved_bytes;
  p->saved_bytes += s->saved_bytes;
  p->sink = s->sink;
  p->sink_off = s->sink_off;
  p->reached = s->to;
  return 0;
}

void sl_plan_step_clear(struct sl_plan_step *s) {
  if (s == NULL)
    return;
  free(s->moves);
  free(s->saves);
  memset(s, 0, sizeof(*s));
}

int sl_plan_undo(const struct sl_plan *p, struct sl_copy **restore, size_t *nrestore,
                 struct sl_move **unmove, size_t *nunmove) {
  struct sl_copy *r = p->nsaves ? malloc(p->nsaves * sizeof(*r)) : NULL;
  struct sl_move *m = p->nmoves ? malloc(p->nmoves * sizeof(*m)) : NULL;

  if ((p->nsaves && r == NULL) || (p->nmoves && m == NULL)) {
    free(r);
    free(m);
    return SUBLET_ENOHOSTMEM;
  }
  if (p->nsaves)
    memcpy(r, p->saves, p->nsaves * sizeof(*r));
  for (size_t i = 0; i < p->nmoves; i++)
    m[i] = (struct sl_move){p->moves[i].dst_off, p->moves[i].src_off, p->moves[i].len};
  *restore = r;
  *nrestore = p->nsaves;
  *unmove = m;
  *nunmove = p->nmoves;
  return 0;
}
