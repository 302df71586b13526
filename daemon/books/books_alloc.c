/* books_alloc.c - a loan's allocations in the books (the contract is books.h): where in the
 * window a borrower's allocation goes, the plan of what that costs (kept bytes moved out of
 * the way, saved to the host, fresh pages made), its commit, and its free.
 *
 * An in-order loan (books.c, loan_set_in_order) hands out the span [lo, hwm) of its window
 * first fit; past it, the span grows up through region pages (their kept bytes moved into
 * holes on the device) or, where that would save to the host and fresh memory below fits,
 * down. Pure C on the books' data; check.c checks the result after every step (the unit
 * tests, and subletd --check).
 *
 * Floor 2 (books_impl.h).
 */
#include "books_impl.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The ACTIVE loan client_id borrows. */
int sl_books_borrowed_loan(const struct sl_books *b, uint64_t client_id, struct sl_loan **out,
                           struct sl_err *err) {
  const struct sl_client *c = sl_books_find_client(b, client_id);

  if (c == NULL)
    return sl_books_no_client(err, client_id);
  if (c->loan_id == 0 && b->loan != NULL && b->loan->owner_client == client_id)
    return sl_err_set(err, SUBLET_EPERM,
                      "client %" PRIu64 " lent loan %" PRIu64 " but does not borrow it; borrow "
                      "it first", client_id, b->loan->id);
  if (c->loan_id == 0)
    return sl_err_set(err, SUBLET_ENOENT,
                      "client %" PRIu64 " borrows no loan; borrow one first", client_id);
  *out = sl_books_find_loan(b, c->loan_id);
  return 0;
}

static int no_room(const struct sl_books *b, const struct sl_loan *l, uint64_t size,
                   uint64_t largest, struct sl_err *err) {
  uint64_t ps = b->cfg.page_size;
  char asked[16], run[16], win[16], used[16];

  return sl_err_set(err, SUBLET_ENOMEM,
                    "cannot allocate %s from loan %" PRIu64 ": its largest free run is %s "
                    "(window %s, %s in use); free memory first, keep less, or borrow with "
                    "more fresh pages", sl_format_size(asked, size), l->id,
                    sl_format_size(run, largest * ps),
                    sl_format_size(win, sl_books_window_size(l) * ps), sl_format_size(used, l->live_bytes));
}

/* Kept zone indices [from, to) of an in-order loan whose pages hold no kept byte. Its pages
 * ascend, so the keep ranges are walked, not searched per page (a search per page was a
 * quarter of a 48 GiB allocation's plan: 4 of 16 ms for 20,000 pages over 220,000 ranges). */
static uint64_t empty_pages(const struct sl_loan *l, uint64_t ps, uint64_t from, uint64_t to) {
  uint64_t n = 0;
  size_t i = from < to ? sl_plan_keep_after(&l->plan, l->pages[l->unkept + from] * ps) : 0;

  for (uint64_t k = from; k < to; k++)
    n += sl_plan_page_kept(&l->plan, k, &i) == 0;
  return n;
}

/* Bytes by source: unkept pages (in order: kept zone pages that hold no kept byte), fresh,
 * kept pages. */
static void plan_served(const struct sl_books *b, const struct sl_loan *l, struct sl_grant *g) {
  uint64_t ps = b->cfg.page_size, end = g->pos + g->npages, ks = sl_books_kept_start(l);
  uint64_t kept = sl_books_overlap(g->pos, end, ks, sl_books_window_size(l)), empty = 0;

  if (l->in_order && kept > 0)
    empty = empty_pages(l, ps, sl_max_u64(g->pos, ks) - ks, end - ks);
  g->served[SL_SRC_UNKEPT] = (sl_books_overlap(g->pos, end, 0, l->unkept) + empty) * ps;
  g->served[SL_SRC_FRESH] = sl_books_overlap(g->pos, end, l->unkept, ks) * ps;
  g->served[SL_SRC_KEPT] = (kept - empty) * ps;
}

/* The fresh positions of [from, to) (none when to <= from), as g's new chunk. */
static void plan_chunk(const struct sl_books *b, const struct sl_loan *l, uint64_t from,
                       uint64_t to, struct sl_grant *g) {
  uint64_t lo = sl_max_u64(from, l->unkept), hi = sl_min_u64(to, sl_books_kept_start(l));

  if (to <= from || hi <= lo)
    return;
  g->fresh_chunk_id = b->next_chunk;
  g->fresh_pos = lo;
  g->fresh_npages = hi - lo;
}

/* The positions no allocation reached before, those of [pos, end) outside [lo, hwm): below
 * lo (in order: fresh ones only) and from hwm on. Fresh ones need a chunk (at most one of the
 * two parts has any), and the kept bytes of kept pages among them must leave (moved or
 * saved: plan.h). */
static int plan_new_positions(const struct sl_books *b, const struct sl_loan *l,
                              struct sl_grant *g) {
  uint64_t lo = sl_max_u64(g->pos, l->hwm), hi = g->pos + g->npages;
  uint64_t ks = sl_books_kept_start(l);
  struct sl_plan_step s;
  int rc;

  plan_chunk(b, l, g->pos, sl_min_u64(hi, l->lo), g);
  plan_chunk(b, l, lo, hi, g);
  if (hi <= sl_max_u64(lo, ks))
    return 0; /* no kept page is reached for the first time */
  rc = sl_plan_reach(&l->plan, sl_max_u64(lo, ks) - ks, hi - ks, &s);
  g->kept_from = s.from;
  g->kept_to = s.to;
  g->move = s.moves;
  g->nmove = s.nmoves;
  g->move_bytes = s.moved_bytes;
  g->save = s.saves;
  g->nsave = s.nsaves;
  g->save_bytes = s.saved_bytes;
  g->sink = s.sink;
  g->sink_off = s.sink_off;
  return rc;
}

/* Where a grant may go (place() picks): the first gap among the positions handed out that
 * fits, and the runs that grow the handed-out span at its top and at its bottom. */
struct fits {
  uint64_t inner, up, down; /* positions, UINT64_MAX: none */
  uint64_t largest;         /* the longest run there is, for the error */
};

static struct fits find_fits(const struct sl_loan *l, uint64_t n) {
  struct fits f = {UINT64_MAX, UINT64_MAX, UINT64_MAX, 0};
  uint64_t start = l->lo, window = sl_books_window_size(l);
  uint64_t bottom = l->nallocs > 0 ? l->allocs[0].pos : l->hwm;

  for (size_t i = 0; i <= l->nallocs; i++) {
    uint64_t end = i < l->nallocs ? l->allocs[i].pos : l->hwm;
    if (f.inner == UINT64_MAX && end - start >= n)
      f.inner = start;
    f.largest = sl_max_u64(f.largest, end - start);
    if (i < l->nallocs)
      start = l->allocs[i].pos + l->allocs[i].npages;
  }
  /* start: the top's free run; bottom: where the bottom's ends (below lo nothing is live) */
  if (window - start >= n)
    f.up = start;
  if (bottom >= n)
    f.down = bottom - n;
  else if (l->nallocs == 0 && window >= n)
    f.down = 0; /* nothing live: the run may cover the span and grow both ways */
  f.largest = sl_max_u64(f.largest, sl_max_u64(window - start, l->nallocs ? bottom : window));
  return f;
}

/* Plans g at pos: its sources, and what its new positions need. */
static int plan_at(const struct sl_books *b, const struct sl_loan *l, uint64_t pos,
                   struct sl_grant *g, struct sl_err *err) {
  g->pos = pos;
  plan_served(b, l, g);
  return plan_new_positions(b, l, g) < 0 ? sl_books_oom(err) : 0;
}

/* g as before plan_at: its identity only. */
static void grant_reset(struct sl_grant *g) {
  struct sl_grant id = {.loan_id = g->loan_id, .alloc_id = g->alloc_id, .size = g->size,
                        .npages = g->npages};

  sl_grant_clear(g);
  *g = id;
}

/* Must a run of n positions at pos save bytes to the host (sl_plan_must_save over the kept
 * pages it reaches for the first time)? Then place() need not plan it to find out. */
static int must_save_at(const struct sl_loan *l, uint64_t pos, uint64_t n) {
  uint64_t ks = sl_books_kept_start(l), lo = sl_max_u64(sl_max_u64(pos, l->hwm), ks);

  return pos + n > lo && sl_plan_must_save(&l->plan, lo - ks, pos + n - ks);
}

/* A gap handed out before if one fits; else the top, unless it saves bytes to the host and
 * the bottom can take the run (in order: fresh pages) without. A top that must save is not
 * planned at all: that plan, thrown away, took 5 ms of a 48 GiB allocation of 220,000 kept
 * blocks. */
static int place(const struct sl_books *b, const struct sl_loan *l, struct sl_grant *g,
                 struct sl_err *err) {
  struct fits f = find_fits(l, g->npages);
  int rc;

  if (f.inner != UINT64_MAX)
    return plan_at(b, l, f.inner, g, err);
  if (f.up != UINT64_MAX && f.down != UINT64_MAX && must_save_at(l, f.up, g->npages))
    f.up = UINT64_MAX;
  if (f.up != UINT64_MAX) {
    if ((rc = plan_at(b, l, f.up, g, err)) < 0 || g->save_bytes == 0 || f.down == UINT64_MAX)
      return rc;
    grant_reset(g);
  }
  if (f.down != UINT64_MAX)
    return plan_at(b, l, f.down, g, err);
  return no_room(b, l, g->size, f.largest, err);
}

int sl_books_alloc_plan(const struct sl_books *b, uint64_t client_id, uint64_t size,
                        struct sl_grant *g, struct sl_err *err) {
  struct sl_loan *l = NULL;
  int rc;

  memset(g, 0, sizeof(*g));
  rc = sl_books_borrowed_loan(b, client_id, &l, err);
  if (rc < 0)
    return rc;
  if (l->owner_gone)
    return sl_err_set(err, SUBLET_EOWNERGONE,
                      "the owner of loan %" PRIu64 " has gone; nothing more can be allocated: "
                      "free what you hold and return the loan", l->id);
  if (size == 0)
    return sl_err_set(err, SUBLET_EINVAL, "cannot allocate 0 bytes; ask for at least one");
  if (l->held_alloc != 0)
    return sl_err_set(err, SUBLET_EBUSY, "loan %" PRIu64 " is saving kept bytes for the last "
                      "allocation: wait for its reply before asking for another", l->id);
  g->loan_id = l->id;
  g->alloc_id = b->next_alloc;
  g->size = size;
  g->npages = sl_books_pages_for(b, size);
  if ((rc = place(b, l, g, err)) < 0)
    sl_grant_clear(g);
  return rc;
}

/* Nothing was committed since the plan (ids match) and its positions are still free. */
static int grant_current(const struct sl_books *b, const struct sl_grant *g, size_t *index) {
  const struct sl_loan *l = b->loan;
  uint64_t end = g->pos + g->npages;
  size_t i = 0;

  if (l == NULL || l->id != g->loan_id || l->state != SL_LOAN_ACTIVE)
    return 0;
  if (g->alloc_id != b->next_alloc || g->npages == 0 || end > sl_books_window_size(l) || end < g->pos)
    return 0;
  if (g->fresh_chunk_id != 0 && g->fresh_chunk_id != b->next_chunk)
    return 0;
  while (i < l->nallocs && l->allocs[i].pos < g->pos)
    i++;
  if (i > 0 && l->allocs[i - 1].pos + l->allocs[i - 1].npages > g->pos)
    return 0;
  if (i < l->nallocs && l->allocs[i].pos < end)
    return 0;
  *index = i;
  return 1;
}

static void loan_count_grant(struct sl_books *b, struct sl_loan *l, const struct sl_grant *g) {
  l->lo = sl_min_u64(l->lo, g->pos);
  l->hwm = sl_max_u64(l->hwm, g->pos + g->npages);
  l->live_bytes += g->npages * b->cfg.page_size;
  l->stats.peak_bytes = sl_max_u64(l->stats.peak_bytes, l->live_bytes);
  l->stats.allocations++;
  l->stats.copied_out_bytes += g->save_bytes;
  b->counters.copied_out_bytes += g->save_bytes;
  l->stats.moved_bytes += g->move_bytes;
  b->counters.moved_bytes += g->move_bytes;
  l->stats.served_unkept_bytes += g->served[SL_SRC_UNKEPT];
  l->stats.served_fresh_bytes += g->served[SL_SRC_FRESH];
  l->stats.served_kept_bytes += g->served[SL_SRC_KEPT];
  for (int s = SL_SRC_UNKEPT; s <= SL_SRC_KEPT; s++)
    b->counters.served_bytes[s] += g->served[s];
}

/* The grant's moves and saves go into the loan's plan: the last step that can fail. */
static int grant_commit_plan(struct sl_loan *l, const struct sl_grant *g) {
  struct sl_plan_step s = {g->kept_from, g->kept_to, g->move, g->nmove, g->move_bytes,
                           g->save, g->nsave, g->save_bytes, g->sink, g->sink_off};

  return sl_plan_commit(&l->plan, &s);
}

int sl_books_alloc_commit(struct sl_books *b, struct sl_grant *g) {
  struct sl_loan *l = b->loan;
  struct sl_alloc *allocs;
  struct sl_chunk *chunks;
  size_t i;

  if (!grant_current(b, g, &i) || (l->held_alloc != 0 && l->held_alloc != g->alloc_id))
    return SUBLET_EINVAL; /* stale or foreign grant: plan again */
  allocs = sl_grow(l->allocs, &l->cap_allocs, l->nallocs + 1, sizeof(*allocs));
  if (allocs == NULL)
    return SUBLET_ENOHOSTMEM;
  l->allocs = allocs;
  chunks = sl_grow(l->chunks, &l->cap_chunks, l->nchunks + 1, sizeof(*chunks));
  if (chunks == NULL)
    return SUBLET_ENOHOSTMEM;
  l->chunks = chunks;
  if (g->kept_to > g->kept_from && grant_commit_plan(l, g) < 0)
    return SUBLET_ENOHOSTMEM;
  memmove(&allocs[i + 1], &allocs[i], (l->nallocs - i) * sizeof(*allocs));
  allocs[i] = (struct sl_alloc){g->alloc_id, g->pos, g->npages, g->size};
  l->nallocs++;
  b->next_alloc++;
  if (g->fresh_chunk_id != 0) {
    size_t at = g->fresh_pos < l->lo ? 0 : l->nchunks; /* below every other one, or above */
    memmove(&chunks[at + 1], &chunks[at], (l->nchunks - at) * sizeof(*chunks));
    chunks[at] = (struct sl_chunk){g->fresh_chunk_id, g->fresh_pos, g->fresh_npages};
    l->nchunks++;
    l->fresh_chunk_pages += g->fresh_npages;
    b->next_chunk++;
  }
  l->held_alloc = 0;
  loan_count_grant(b, l, g);
  return 0;
}

int sl_books_alloc_hold(struct sl_books *b, const struct sl_grant *g, struct sl_err *err) {
  size_t i;

  if (!grant_current(b, g, &i) || b->loan->held_alloc != 0)
    return sl_err_set(err, SUBLET_EINVAL, "internal error: holding a stale allocation plan");
  b->loan->held_alloc = g->alloc_id;
  return 0;
}

void sl_books_alloc_release(struct sl_books *b, const struct sl_grant *g) {
  if (b->loan != NULL && b->loan->id == g->loan_id && b->loan->held_alloc == g->alloc_id)
    b->loan->held_alloc = 0;
}

void sl_grant_clear(struct sl_grant *g) {
  if (g == NULL)
    return;
  free(g->save);
  free(g->move);
  memset(g, 0, sizeof(*g));
}

static void alloc_remove(struct sl_books *b, struct sl_loan *l, size_t i) {
  l->live_bytes -= l->allocs[i].npages * b->cfg.page_size;
  memmove(&l->allocs[i], &l->allocs[i + 1], (l->nallocs - i - 1) * sizeof(*l->allocs));
  l->nallocs--;
}

static size_t alloc_index(const struct sl_loan *l, uint64_t alloc_id) {
  size_t i = 0;

  while (i < l->nallocs && l->allocs[i].id != alloc_id)
    i++;
  return i;
}

int sl_books_free_alloc(struct sl_books *b, uint64_t client_id, uint64_t alloc_id,
                        uint64_t *size, struct sl_err *err) {
  struct sl_loan *l = b->loan;
  size_t i = l != NULL ? alloc_index(l, alloc_id) : 0;

  if (sl_books_find_client(b, client_id) == NULL)
    return sl_books_no_client(err, client_id);
  /* Another user's allocation is refused as a missing one, word for word (books_impl.h) */
  if (l == NULL || i == l->nallocs ||
      (l->borrower_client != client_id && !sl_books_sees(b, client_id, sl_books_loan_uid(b, l))))
    return sl_err_set(err, SUBLET_ENOENT,
                      "no live allocation %" PRIu64 ": it was freed already or never granted",
                      alloc_id);
  if (l->borrower_client != client_id)
    return sl_err_set(err, SUBLET_EPERM,
                      "allocation %" PRIu64 " belongs to client %" PRIu64 ", the borrower of "
                      "loan %" PRIu64 "; only it may free it", alloc_id, l->borrower_client,
                      l->id);
  if (size != NULL)
    *size = l->allocs[i].size;
  alloc_remove(b, l, i);
  return 0;
}

size_t sl_books_leaks(const struct sl_books *b, uint64_t loan_id, struct sublet_leak *out,
                      size_t n) {
  const struct sl_loan *l = sl_books_find_loan(b, loan_id);

  if (l == NULL)
    return 0;
  for (size_t i = 0; i < n && i < l->nallocs && out != NULL; i++)
    out[i] = (struct sublet_leak){.alloc_id = l->allocs[i].id, .size = l->allocs[i].size};
  return l->nallocs;
}
