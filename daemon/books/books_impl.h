/* books_impl.h - the books' data, shared by books.c (the ledger's operations),
 * books_alloc.c (a loan's allocations), books_release.c, need_pick.c, kept.c and
 * books_space.c, and check.c (its invariants). Nothing else includes it: the contract is
 * books.h.
 *
 * The files stand on floors, lowest first: a file calls functions of files on lower floors
 * only (tests/check-floors, ctest check_floors_books; each file's opening comment names its
 * floor). The ledger and its releases are one unit: a release holds a loan's draft, which the
 * ledger frees.
 *
 *   floor 1: books_space.c kept.c need_pick.c plan.c   address space; kept windows; a need's
 *            pages; where kept bytes go
 *   floor 2: books_alloc.c                    a loan's allocations
 *   floor 3: books.c+books_release.c          the ledger; releases
 *   floor 4: check.c                          the invariants
 */
#ifndef SL_BOOKS_IMPL_H
#define SL_BOOKS_IMPL_H

#include <inttypes.h>
#include <stdlib.h>

#include "books.h"
#include "grow.h"
#include "plan.h"

struct sl_client {
  uint64_t id; /* first member: find_by_id() reads it */
  struct sl_peer peer;
  uint64_t loan_id; /* the loan it borrows; 0: none */
  uint64_t retained_pages; /* old region pages it was granted as a borrower of another user
                              and may still hold (fds cannot be revoked): counted until it
                              disconnects */
  int notices;      /* hears notices (Hello.notices): it may keep a window (kept.c) */
  int keeps;        /* keeps its window after the loan it borrows */
  uint64_t kept_region; /* a live region whose window it kept after a loan; 0: none */
};

/* A gone region whose pages a client still holds (kept.c). */
struct sl_held {
  uint64_t region_id, npages, space, holder_client;
  struct sl_peer owner, holder;
};

struct sl_region {
  uint64_t id; /* first member: find_by_id() reads it */
  uint64_t owner_client;
  struct sl_peer owner;
  uint64_t npages;
  int growable;         /* made to grow (sl_books_region_grow) */
  uint64_t loan_id;
  uint64_t last_fresh; /* the fresh zone of its last loan (books.c: steady_fresh) */
  uint64_t pages_version; /* how many times its lent pages were replaced (books.h) */
  int replacing;        /* its last loan's pages are being replaced: no Lend, no PagesGet */
  uint64_t *layout;     /* its last loan's pages (sl_loan.pages), owned; NULL: none since its
                           pages were last replaced */
  uint64_t layout_unkept, layout_id; /* that loan's U and layout id (books.h) */
  uint64_t layout_pages; /* that loan's U + K: npages less its pinned pages (a growth drops
                            the layout) */
  uint32_t *span;       /* page groups (books.h, "Page groups"): span[p] pages share page p's
                           allocation, 0 inside a group; NULL while every page is its own */
  uint64_t space;       /* pages of subletd's address space reserved for it (books_space.c) */
};

struct sl_alloc {
  uint64_t id, pos, npages, size;
};

struct sl_chunk {
  uint64_t id, pos, npages;
};

struct sl_loan {
  uint64_t id, region_id;
  enum sl_loan_state state;
  uint64_t owner_client, borrower_client;
  struct sl_peer borrower;
  char name[SL_LOAN_NAME_SIZE];
  uint8_t token[SUBLET_TOKEN_SIZE];
  struct sublet_range *keep; /* merged: ascending, disjoint, not adjacent, none empty */
  size_t nkeep;
  uint64_t kept_bytes;
  uint64_t *pages; /* unkept region pages, then kept ones, each ascending: U + K of them */
  uint64_t *pinned; /* (first, count) pairs of region pages the loan never touches (the
                       owner's, in use during the loan): ascending, disjoint, none kept */
  size_t npinned;   /* pairs */
  uint64_t pinned_pages; /* their pages: U + K + pinned_pages is the region's npages */
  uint64_t layout_id; /* names pages and U (books.h, sl_loan_info.layout_id) */
  uint64_t unkept, fresh, kept;
  int in_order;       /* pages are the region's own, in order (books.h, "In order") */
  uint64_t holding;   /* window pages that hold kept bytes */
  uint64_t lo, hwm;   /* window positions [lo, hwm) have been handed out */
  struct sl_alloc *allocs; /* ascending pos */
  size_t nallocs, cap_allocs;
  uint64_t live_bytes;
  struct sl_chunk *chunks; /* ascending pos, covering the fresh positions in [lo, hwm) */
  size_t nchunks, cap_chunks;
  uint64_t fresh_chunk_pages;
  uint64_t held_alloc; /* a grant whose kept bytes are being saved: 0, or its alloc id */
  int owner_gone;
  struct sl_plan plan;       /* where the kept zone's bytes went: moves and saves */
  struct sublet_loan_stats stats;
};

/* A live release (books_release.c). Its draft holds the keep, the pages (unkept, then kept:
 * U + K of them, the region's less the pinned ones) and the plan over zone, whose one
 * committed step reached the kept pages outside the window of pages that stay. */
struct sl_release {
  uint64_t id; /* first member: find_by_id() reads it */
  uint64_t region_id, owner_client;
  enum sl_release_state state;
  struct sl_loan *l;
  uint64_t stayed;
  uint64_t held;      /* pages kept back whole with a group that stays (books.h) */
  uint64_t *groups;   /* the groups its resume makes, (first, count) pairs: owned */
  size_t ngroups;     /* pairs */
  uint64_t *released; /* ascending region pages */
  size_t nreleased;
  uint64_t *zone;     /* the plan's kept zone (books_release.c): owned, the plan points in */
  int by_need;        /* a release by need (books.h): its stayed pages may hold nothing */
  struct sl_release_need need;
  uint64_t moved_total; /* bytes its steps moved on the device, every increment's */
  uint64_t increments;  /* needs after the first (sl_books_release_more) made */
  struct sl_release_more *more; /* an increment whose device work runs (RELEASING): owned */
};

/* An increment of a release by need while its device work runs (books_release.c): what the
 * release becomes if the work succeeds. Its plan is flat: each move takes a kept byte from
 * where it was at the release's start (a released page) to where it is now (a hole of a page
 * that stays), each save from there to the host, so that a resume undoes them in any order. */
struct sl_release_more {
  uint64_t *released;  /* every released page then, ascending */
  size_t nreleased, added;
  uint64_t *zone;      /* the released pages with kept bytes, then the pages that stay */
  size_t nzone, reached;
  struct sl_move *moves;
  size_t nmoves;
  struct sl_copy *saves;
  size_t nsaves;
  uint64_t moved_bytes, saved_bytes, step_moved;
  struct sl_release_need need;
};

struct sl_books {
  struct sl_books_config cfg;
  struct sl_client *clients;
  size_t nclients, cap_clients;
  struct sl_region *regions;
  size_t nregions, cap_regions;
  uint64_t region_pages;
  struct sl_loan *loan;
  struct sl_held *held; /* room for every keeper too: a region goes without allocating */
  struct sl_release *releases; /* ascending id */
  size_t nreleases, cap_releases;
  size_t nheld, cap_held;
  uint64_t next_client, next_region, next_loan, next_alloc, next_chunk, next_layout;
  struct sl_books_totals counters; /* only the counters; the gauges are computed */
};

/* The first index of sorted a[0..n) whose value is not below v. */
static inline size_t sl_books_lower_bound(const uint64_t *a, size_t n, uint64_t v) {
  size_t lo = 0, hi = n;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (a[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static inline int sl_books_cmp_id(const void *key, const void *elem) {
  uint64_t a = *(const uint64_t *)key, b = *(const uint64_t *)elem;
  return (a > b) - (a < b);
}

static inline void *sl_books_find_by_id(const void *base, size_t n, size_t size, uint64_t id) {
  return n ? bsearch(&id, base, n, size, sl_books_cmp_id) : NULL;
}

/* Like strchr, these hand a mutable element out of const books: callers that got the books
 * const only read it. */
static inline struct sl_client *sl_books_find_client(const struct sl_books *b, uint64_t id) {
  return sl_books_find_by_id(b->clients, b->nclients, sizeof(*b->clients), id);
}

static inline struct sl_region *sl_books_find_region(const struct sl_books *b, uint64_t id) {
  return sl_books_find_by_id(b->regions, b->nregions, sizeof(*b->regions), id);
}

static inline struct sl_loan *sl_books_find_loan(const struct sl_books *b, uint64_t id) {
  return b->loan != NULL && b->loan->id == id ? b->loan : NULL;
}

static inline uint64_t sl_books_window_size(const struct sl_loan *l) {
  return l->unkept + l->fresh + l->kept;
}

static inline uint64_t sl_books_kept_start(const struct sl_loan *l) {
  return l->unkept + l->fresh;
}

static inline uint64_t sl_books_pages_for(const struct sl_books *b, uint64_t size) {
  return size / b->cfg.page_size + (size % b->cfg.page_size != 0);
}

/* Shared by books.c and books_alloc.c. */
static inline int sl_books_oom(struct sl_err *err) {
  return sl_err_set(err, SUBLET_ENOHOSTMEM, "subletd is out of host memory; free some and retry");
}

/* Length of [a0, a1) ∩ [b0, b1). */
static inline uint64_t sl_books_overlap(uint64_t a0, uint64_t a1, uint64_t b0, uint64_t b1) {
  uint64_t lo = sl_max_u64(a0, b0), hi = sl_min_u64(a1, b1);
  return hi > lo ? hi - lo : 0;
}

static inline int sl_books_no_client(struct sl_err *err, uint64_t client_id) {
  return sl_err_set(err, SUBLET_ENOENT,
                    "no client %" PRIu64 " (disconnected?); reconnect to subletd", client_id);
}

/* Does client_id see what uid holds? sl_peer_reaches (books.h), status's rule too. A refusal
 * says no more to it than status would show it. */
static inline int sl_books_sees(const struct sl_books *b, uint64_t client_id, uid_t uid) {
  const struct sl_client *c = sl_books_find_client(b, client_id);

  return c != NULL && sl_peer_reaches(&c->peer, uid);
}

static inline uid_t sl_books_loan_uid(const struct sl_books *b, const struct sl_loan *l) {
  const struct sl_region *r = sl_books_find_region(b, l->region_id);

  return r != NULL ? r->owner.uid : (uid_t)-1;
}

/* The region or loan that client_id names by id in a request, or NULL: none, or one of a user
 * it may not see. The refusal is then the one for a missing id, word for word: a user must
 * not tell another user's ids from free ones by what it is told (status hides them too). */
static inline struct sl_region *sl_books_region_seen(const struct sl_books *b,
                                                      uint64_t client_id, uint64_t id) {
  struct sl_region *r = sl_books_find_region(b, id);

  return r != NULL && sl_books_sees(b, client_id, r->owner.uid) ? r : NULL;
}

static inline struct sl_loan *sl_books_loan_seen(const struct sl_books *b, uint64_t client_id,
                                                 uint64_t id) {
  struct sl_loan *l = sl_books_find_loan(b, id);

  return l != NULL && sl_books_sees(b, client_id, sl_books_loan_uid(b, l)) ? l : NULL;
}

/* books_alloc.c, for books.c: the ACTIVE loan client_id borrows. */
int sl_books_borrowed_loan(const struct sl_books *b, uint64_t client_id, struct sl_loan **out,
                           struct sl_err *err);

/* kept.c, for books.c: room for one more keeper; the loan's end makes its borrower one (or
 * not: the region goes); a region leaves and its keepers become holders; a client leaves. */
/* books_space.c: may uid's regions reserve more pages of address space? 0, or SUBLET_ENOMEM
 * naming the bound. */
int sl_books_space_check(const struct sl_books *b, uid_t uid, uint64_t more,
                         struct sl_err *err);

int sl_books_kept_reserve(struct sl_books *b);
void sl_books_kept_loan_end(struct sl_books *b, const struct sl_loan *l);
void sl_books_kept_retire(struct sl_books *b, const struct sl_region *r);
size_t sl_books_kept_count(const struct sl_books *b, uint64_t client_id);
void sl_books_kept_client_gone(struct sl_books *b, uint64_t client_id, uint64_t *freed,
                               size_t *nfreed);
size_t sl_books_kept_keepers(const struct sl_books *b);

/* books_release.c, for books.c and check.c: a region leaves (its releases with it); does a
 * live release hold region pages [first, first + count) released (PagesGet refuses them);
 * the region's live releases (a lend refuses them); the books go. */
void sl_books_releases_region_gone(struct sl_books *b, uint64_t region_id);
int sl_books_releases_hold(const struct sl_books *b, uint64_t region_id, uint64_t first,
                           uint64_t count, uint64_t *release_id);
size_t sl_books_releases_of(const struct sl_books *b, uint64_t region_id, uint64_t *first_id);
void sl_books_releases_free(struct sl_books *b);
/* Page groups (books_release.c): the pages of p's group; why a region cannot be lent (0: it
 * can); a grown region's new pages are their own groups; is [first, first + count) whole
 * groups? */
uint32_t sl_books_span(const struct sl_region *r, uint64_t p);
int sl_books_grouped_error(const struct sl_region *r, struct sl_err *err);
int sl_books_groups_grow(struct sl_region *r, uint64_t npages);
int sl_books_whole_groups(const struct sl_region *r, uint64_t first, uint64_t count);

/* A page of a loan's region: in the window unkept or kept, or pinned (in no window). */
enum { SL_PAGE_UNKEPT = 0, SL_PAGE_KEPT = 1, SL_PAGE_PINNED = 2 };

/* flags[p] = SL_PAGE_KEPT for every page holding a kept byte (books.c). */
void sl_books_mark_kept_pages(const struct sublet_range *keep, size_t nkeep,
                              uint64_t page_size, uint8_t *flags);
/* flags[p] = SL_PAGE_PINNED for every page of the (first, count) pairs (books.c). */
void sl_books_mark_pinned_pages(const uint64_t *pinned, size_t npinned, uint8_t *flags);

/* What a release by need may give back (need_pick.c): a whole page group, or a page of a
 * region without groups; entries [first, first + size) of the candidate pages (ascending),
 * holding kept bytes; joins: its first page follows the previous unit's last. */
struct sl_need_unit {
  size_t first;
  uint64_t size, kept;
  int joins;
};

/* A choice to make: count pages at least, of units[0, nunits), among npages candidates of
 * page_size bytes holding kept_all kept bytes in all. */
struct sl_need_choice {
  const struct sl_need_unit *units;
  size_t nunits;
  uint64_t count, npages, page_size, kept_all;
};

/* Marks released[] for every page of the units chosen (need_pick.c says how): 0, or
 * SUBLET_ENOHOSTMEM. The cost of a set of units: the test's reference compares with it. */
int sl_need_pick(const struct sl_need_choice *c, uint8_t *released);
uint64_t sl_need_pick_cost(const struct sl_need_choice *c, uint64_t pages, uint64_t kept,
                           uint64_t runs);

#endif
