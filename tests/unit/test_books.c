/* test_books.c - unit tests of subletd's books (daemon/books/books.c).
 *
 * Every path of books.h: lending order, first fit, fresh chunks, the exact kept bytes saved and
 * restored (checked against a byte map), leaks, every error, client removal in every state, a
 * long random sequence checked against a reference model and sl_books_check() after each step,
 * and the speed of a large keep list. The checks are check.h's.
 */
#include "books.h"
#include "plan.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define PS 4096u
#define MiB (1024ull * 1024)

static const uint8_t TOKEN[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const uint8_t WRONG[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17};

/* ---- fixtures ----------------------------------------------------------------------------- */

/* The daemon's --allow-group: the daemon marks the peers in it (and root) as trusted. */
static gid_t allow_gid = (gid_t)-1;

/* Books that save every kept byte of a lent page (no moves): the exact saves below are
 * specified that way; test_compaction and the model cover moves. */
static struct sl_books *books_new(uint64_t page_size, gid_t allow) {
  struct sl_books_config cfg = {.page_size = page_size, .no_compact = 1};
  struct sl_books *b = NULL;

  allow_gid = allow;
  if (sl_books_new(&cfg, &b) != 0)
    abort();
  return b;
}

static uint64_t client(struct sl_books *b, uid_t uid, gid_t gid) {
  struct sl_peer peer = {.pid = 100 + (pid_t)uid, .uid = uid, .gid = gid,
                         .trusted = uid == 0 || (allow_gid != (gid_t)-1 && gid == allow_gid)};
  uint64_t id = 0;

  CHECK_EQ(sl_books_client_add(b, &peer, &id), 0);
  return id;
}

static uint64_t region(struct sl_books *b, uint64_t owner, uint64_t npages) {
  uint64_t id = 0;

  CHECK_EQ(sl_books_region_add(b, owner, npages, &id, NULL), 0);
  return id;
}

static uint64_t lend(struct sl_books *b, uint64_t owner, uint64_t rid,
                     const struct sublet_range *keep, size_t n) {
  uint64_t id = 0;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_lend(b, owner, rid, keep, n, 0, "test", TOKEN, &id, &err), 0);
  return id;
}

static void borrow(struct sl_books *b, uint64_t client_id, uint64_t loan, uint64_t fresh) {
  CHECK_EQ(sl_books_borrow(b, client_id, loan, TOKEN, NULL, fresh, NULL, NULL), 0);
}

/* Plans and commits; returns the alloc id (0 on failure) and the grant's copy in *out. */
static uint64_t alloc(struct sl_books *b, uint64_t client_id, uint64_t size,
                      struct sl_grant *out) {
  struct sl_grant g;
  uint64_t id;

  if (sl_books_alloc_plan(b, client_id, size, &g, NULL) != 0) {
    CHECK(!"alloc_plan");
    return 0;
  }
  CHECK_EQ(sl_books_alloc_commit(b, &g), 0);
  id = g.alloc_id;
  if (out != NULL)
    *out = g;
  else
    sl_grant_clear(&g);
  return id;
}

static struct sl_loan_info info(const struct sl_books *b, uint64_t loan) {
  struct sl_loan_info li;

  memset(&li, 0, sizeof(li));
  CHECK_EQ(sl_books_loan_info(b, loan, &li), 0);
  return li;
}

/* ---- ids and clients ---------------------------------------------------------------------- */

static void test_new_and_ids(void) {
  struct sl_books_config bad = {.page_size = 0};
  struct sl_books *b = NULL;
  struct sl_books_totals t;
  uint64_t a, c, d;

  CHECK_EQ(sl_books_new(&bad, &b), SUBLET_EINVAL);
  CHECK_EQ(sl_books_new(NULL, &b), SUBLET_EINVAL);
  b = books_new(PS, (gid_t)-1);
  CHECK_EQ(sl_books_client_add(b, NULL, NULL), SUBLET_EINVAL);
  a = client(b, 1000, 1000);
  c = client(b, 1000, 1000);
  CHECK_EQ(a, 1);
  CHECK_EQ(c, 2);
  CHECK_EQ(sl_books_client_remove(b, a, NULL), 0);
  CHECK_EQ(sl_books_client_remove(b, a, NULL), SUBLET_ENOENT);
  d = client(b, 1000, 1000);
  CHECK_EQ(d, 3); /* never reused */
  sl_books_totals(b, &t);
  CHECK_EQ(t.clients, 2);
  CHECK_EQ(t.loans, 0);
  CHECK_EQ(sl_books_current_loan(b), 0);
  CHECK_EQ(sl_books_client_loan(b, d), 0);
  CHECK_EQ(sl_books_client_loan(b, 99), 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* ---- regions ------------------------------------------------------------------------------ */

static void test_regions(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), other = client(b, 1000, 1000);
  uint64_t r1, r2, r3, rid = 0;
  struct sl_region_info ri;
  struct sl_books_totals t;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_region_add(b, 77, 4, &rid, &err), SUBLET_ENOENT);
  CHECK_MSG(err, "client 77");
  CHECK_EQ(sl_books_region_add(b, owner, 0, &rid, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_region_add(b, owner, UINT64_MAX / 2, &rid, &err), SUBLET_EINVAL);
  r1 = region(b, owner, 4);
  r2 = region(b, other, 2);
  r3 = region(b, owner, 1);
  CHECK_EQ(r1, 1);
  CHECK_EQ(r3, 3);
  CHECK_EQ(sl_books_region_info(b, r2, &ri), 0);
  CHECK_EQ(ri.owner_client, other);
  CHECK_EQ(ri.npages, 2);
  CHECK_EQ(ri.owner.uid, 1000);
  CHECK_EQ(sl_books_region_info(b, 42, &ri), SUBLET_ENOENT);
  /* iteration in id order */
  CHECK_EQ(sl_books_region_next(b, 0, &ri), 0);
  CHECK_EQ(ri.id, r1);
  CHECK_EQ(sl_books_region_next(b, r1, &ri), 0);
  CHECK_EQ(ri.id, r2);
  CHECK_EQ(sl_books_region_next(b, r2, &ri), 0);
  CHECK_EQ(ri.id, r3);
  CHECK_EQ(sl_books_region_next(b, r3, &ri), SUBLET_ENOENT);
  /* access and removal */
  CHECK_EQ(sl_books_region_access(b, owner, r1, &err), 0);
  CHECK_EQ(sl_books_region_access(b, other, r1, &err), SUBLET_EPERM);
  CHECK_MSG(err, "borrow");
  CHECK_EQ(sl_books_region_access(b, owner, 42, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_remove(b, other, r1, &err), SUBLET_EPERM);
  CHECK_MSG(err, "only its owner");
  CHECK_EQ(sl_books_region_remove(b, owner, 42, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_remove(b, owner, r1, &err), 0);
  CHECK_EQ(sl_books_region_remove(b, owner, r1, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_next(b, 0, &ri), 0);
  CHECK_EQ(ri.id, r2);
  sl_books_totals(b, &t);
  CHECK_EQ(t.regions, 2);
  CHECK_EQ(t.region_pages, 3);
  CHECK_EQ(region(b, owner, 1), 4); /* ids are never reused */
  BOOKS_OK(b);
  sl_books_free(b);
}

/* ---- lending ------------------------------------------------------------------------------ */

static void test_lend_errors(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), other = client(b, 1000, 1000);
  uint64_t r = region(b, owner, 4), r2 = region(b, owner, 2), loan = 0;
  struct sublet_range past = {4 * PS - 10, 11}, wrap = {UINT64_MAX - 5, 10}, ok = {0, 4 * PS};
  char long_name[100];
  struct sl_err err = {0};

  memset(long_name, 'x', sizeof(long_name) - 1);
  long_name[sizeof(long_name) - 1] = '\0';
  CHECK_EQ(sl_books_lend(b, 55, r, NULL, 0, 0, NULL, TOKEN, &loan, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_lend(b, owner, 55, NULL, 0, 0, NULL, TOKEN, &loan, &err), SUBLET_ENOENT);
  CHECK_MSG(err, "region 55");
  CHECK_EQ(sl_books_lend(b, other, r, NULL, 0, 0, NULL, TOKEN, &loan, &err), SUBLET_EPERM);
  CHECK_MSG(err, "only its owner");
  CHECK_EQ(sl_books_lend(b, owner, r, &past, 1, 0, NULL, TOKEN, &loan, &err), SUBLET_EINVAL);
  CHECK_MSG(err, "past the end");
  CHECK_EQ(sl_books_lend(b, owner, r, &wrap, 1, 0, NULL, TOKEN, &loan, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 3, 0, NULL, TOKEN, &loan, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, long_name, TOKEN, &loan, &err),
           SUBLET_EINVAL);
  CHECK_MSG(err, "too long");
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, NULL, NULL, &loan, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_current_loan(b), 0); /* failures leave nothing behind */
  BOOKS_OK(b);
  CHECK_EQ(sl_books_lend(b, owner, r, &ok, 1, 0, "kv", TOKEN, &loan, &err), 0);
  CHECK_EQ(loan, 1);
  CHECK_EQ(sl_books_lend(b, owner, r2, NULL, 0, 0, NULL, TOKEN, &loan, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "loan 1");
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, NULL, TOKEN, &loan, &err), SUBLET_EBUSY);
  CHECK_EQ(sl_books_region_remove(b, owner, r, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "is lent (loan 1)");
  BOOKS_OK(b);
  sl_books_free(b);
}

/* Lending in steps (a long keep list is drafted off the loop): the draft alone changes
 * nothing; may_lend refuses what waiting cannot mend, not a busy device; lend_draft checks
 * everything again and leaves a refused draft to its caller. */
static void test_lend_in_steps(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), other = client(b, 1000, 1000);
  uint64_t r = region(b, owner, 4), r2 = region(b, other, 2), r3 = region(b, owner, 1);
  struct sublet_range keep[2] = {{3 * PS + 5, 10}, {10, PS}};
  struct sl_loan *draft = NULL, *busy = NULL;
  uint64_t npages = 0, loan = 0;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_may_lend(b, other, r, &npages, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_may_lend(b, owner, r, &npages, &err), 0);
  CHECK_EQ(npages, 4);
  CHECK_EQ(sl_books_draft(sl_books_cfg(b), npages, keep, 2, 0, NULL, 0, &draft, &err), 0);
  CHECK_EQ(sl_books_current_loan(b), 0);
  CHECK_EQ(sl_books_lend_draft(b, owner, r, draft, NULL, TOKEN, &loan, &err), 0);
  CHECK_EQ(info(b, loan).kept_pages, 3); /* pages 0, 1 and 3 */
  CHECK_EQ(info(b, loan).kept_bytes, PS + 10);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_may_lend(b, other, r2, &npages, &err), 0); /* busy: it may wait */
  CHECK_EQ(sl_books_draft(sl_books_cfg(b), npages, NULL, 0, 1, NULL, 0, &busy, &err), 0);
  CHECK_EQ(sl_books_lend_draft(b, other, r2, busy, NULL, TOKEN, &loan, &err), SUBLET_EBUSY);
  CHECK_EQ(sl_books_may_lend(b, owner, r, &npages, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "lent already");
  borrow(b, owner, loan, 0); /* its own loan: waiting, it could never return it */
  CHECK_EQ(sl_books_may_lend(b, owner, r3, &npages, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "return it");
  CHECK_EQ(sl_books_draft(sl_books_cfg(b), 0, NULL, 0, 1, NULL, 0, &draft, &err), SUBLET_EINVAL);
  sl_books_draft_free(busy);
  BOOKS_OK(b);
  sl_books_free(b);
}

static void check_layout(const struct sl_books *b, uint64_t loan, const uint64_t *want_unkept,
                         uint64_t nu, const uint64_t *want_kept, uint64_t nk) {
  const uint64_t *pages = NULL;
  uint64_t u = 0, f = 0, k = 0;

  CHECK_EQ(sl_books_loan_layout(b, loan, &pages, &u, &f, &k), 0);
  CHECK_EQ(u, nu);
  CHECK_EQ(k, nk);
  for (uint64_t i = 0; i < nu && i < u; i++)
    CHECK_EQ(pages[i], want_unkept[i]);
  for (uint64_t i = 0; i < nk && i < k; i++)
    CHECK_EQ(pages[u + i], want_kept[i]);
}

static void test_lend_layout(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), r = region(b, owner, 8), loan;
  /* unsorted, overlapping, empty and page-straddling ranges */
  struct sublet_range keep[] = {{5 * PS + 10, 20}, {PS - 1, 2}, {5 * PS, 15}, {3 * PS, 0},
                                {7 * PS + 100, 1}, {PS, 1}};
  const uint64_t unkept[] = {2, 3, 4, 6}, kept[] = {0, 1, 5, 7}, all[] = {0, 1, 2, 3, 4, 5, 6, 7};
  struct sl_loan_info li;
  uint64_t none_loan;

  loan = lend(b, owner, r, keep, 6);
  check_layout(b, loan, unkept, 4, kept, 4);
  li = info(b, loan);
  CHECK_EQ(li.kept_bytes, 30 + 2 + 1); /* [5P, 5P+30), [P-1, P+1), [7P+100] */
  CHECK_EQ(li.state, SL_LOAN_OFFERED);
  CHECK(strcmp(li.name, "test") == 0);
  CHECK_EQ(sl_books_loan_layout(b, 99, NULL, NULL, NULL, NULL), SUBLET_ENOENT);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 1, NULL, TOKEN, &loan, NULL), 0);
  check_layout(b, loan, NULL, 0, all, 8);
  CHECK_EQ(info(b, loan).kept_bytes, 8 * PS);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  none_loan = lend(b, owner, r, NULL, 0);
  check_layout(b, none_loan, all, 8, NULL, 0);
  CHECK_EQ(info(b, none_loan).kept_bytes, 0);
  CHECK(none_loan > loan);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* A sorted keep list is checked, copied and merged in one pass, an unsorted one sorted first:
 * both give the same loan, and a range out of the region is named by its index either way. */
static void test_keep_sorted_or_not(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), r = region(b, owner, 8), loan;
  struct sublet_range sorted[] = {{10, 5}, {12, 10}, {22, 0}, {22, 3}, {PS, 1}, {PS, 0},
                                  {3 * PS - 1, 2}, {3 * PS, 1}, {6 * PS, PS}};
  struct sublet_range reversed[9], bad[] = {{0, 1}, {PS, 1}, {8 * PS, 1}, {2 * PS, 1}};
  const uint64_t unkept[] = {4, 5, 7}, kept[] = {0, 1, 2, 3, 6};
  struct sl_err err = {0};

  for (int i = 0; i < 9; i++)
    reversed[i] = sorted[8 - i];
  for (int pass = 0; pass < 2; pass++) {
    loan = lend(b, owner, r, pass == 0 ? sorted : reversed, 9);
    check_layout(b, loan, unkept, 3, kept, 5);
    CHECK_EQ(info(b, loan).kept_bytes, 15 + 1 + 2 + PS); /* [10, 25), [P], [3P-1, 3P+1), ... */
    CHECK_EQ(info(b, loan).keep_ranges, 4);
    BOOKS_OK(b);
    CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  }
  CHECK_EQ(sl_books_lend(b, owner, r, bad, 3, 0, NULL, TOKEN, &loan, &err), SUBLET_EINVAL);
  CHECK_MSG(err, "keep range 2 ");
  bad[1].offset = 3 * PS; /* now out of order before the bad one */
  CHECK_EQ(sl_books_lend(b, owner, r, bad, 4, 0, NULL, TOKEN, &loan, &err), SUBLET_EINVAL);
  CHECK_MSG(err, "keep range 2 ");
  BOOKS_OK(b);
  sl_books_free(b);
}

static uint64_t layout_id_of(const struct sl_books *b, uint64_t loan) {
  return info(b, loan).layout_id;
}

/* A loan's layout id: the same as the region's last loan's when the layout is the same and no
 * page of the region was replaced since (then the borrower is not sent the layout), else one
 * never given before. */
static void test_layout_ids(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), root = client(b, 0, 0);
  uint64_t r = region(b, owner, 8), r2 = region(b, owner, 8), loan, first, seen[8];
  struct sublet_range k1 = {PS + 5, 10}, k2 = {3 * PS, 10};
  struct sl_loan_end end = {0};
  struct sl_grant g;
  size_t n = 0;

  loan = lend(b, owner, r, &k1, 1);
  first = seen[n++] = layout_id_of(b, loan);
  CHECK(first != 0);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend(b, owner, r, &(struct sublet_range){PS + 100, 1000}, 1); /* same pages kept */
  CHECK_EQ(layout_id_of(b, loan), first);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend(b, owner, r, &k2, 1);
  seen[n++] = layout_id_of(b, loan);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend(b, owner, r, &k1, 1); /* k1's again, but the last loan's was k2's */
  seen[n++] = layout_id_of(b, loan);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend(b, owner, r2, &k1, 1); /* another region: never the same id */
  seen[n++] = layout_id_of(b, loan);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  /* Another user borrows and is granted a page: it is replaced at the end, and the layout,
   * the same, gets a new id all the same (the pages behind it are new). */
  loan = lend(b, owner, r, &k1, 1);
  CHECK_EQ(layout_id_of(b, loan), seen[2]);
  borrow(b, root, loan, 0);
  CHECK_EQ(sl_books_alloc_plan(b, root, PS, &g, NULL), 0);
  CHECK_EQ(sl_books_alloc_commit(b, &g), 0);
  CHECK_EQ(sl_books_return(b, root, 1, &end, NULL), SUBLET_ELEAK);
  sl_grant_clear(&g);
  CHECK(end.nreplace > 0);
  sl_books_pages_replaced(b, &end, end.nreplace);
  sl_loan_end_clear(&end);
  loan = lend(b, owner, r, &k1, 1);
  seen[n++] = layout_id_of(b, loan);
  BOOKS_OK(b);
  for (size_t i = 1; i < n; i++)
    for (size_t j = 0; j < i; j++)
      CHECK(seen[i] != seen[j]);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  sl_books_free(b);
}

/* ---- growable regions --------------------------------------------------------------------- */

static uint64_t growable(struct sl_books *b, uint64_t owner, uint64_t npages) {
  uint64_t id = 0;

  CHECK_EQ(sl_books_region_new(b, owner, npages, 1, &id, NULL), 0);
  return id;
}

static uint64_t region_pages(const struct sl_books *b) {
  struct sl_books_totals t;

  sl_books_totals(b, &t);
  return t.region_pages;
}

/* Each refusal of RegionGrow, and what a growth leaves: the region's pages and the total. */
static void test_grow_rules(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), other = client(b, 1000, 1000);
  uint64_t g = growable(b, owner, 4), fixed = region(b, owner, 4), loan;
  struct sl_region_info ri;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_region_info(b, g, &ri), 0);
  CHECK(ri.growable);
  CHECK_EQ(sl_books_region_info(b, fixed, &ri), 0);
  CHECK(!ri.growable);
  CHECK_EQ(sl_books_region_grow(b, owner, 999, 8, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_grow(b, other, g, 8, &err), SUBLET_EPERM);
  CHECK_MSG(err, "only its owner may grow it");
  CHECK_EQ(sl_books_region_grow(b, owner, fixed, 8, &err), SUBLET_EINVAL);
  CHECK_MSG(err, "create it growable");
  CHECK_EQ(sl_books_region_grow(b, owner, g, 4, &err), SUBLET_EINVAL); /* not larger */
  CHECK_MSG(err, "ask for more than it has");
  CHECK_EQ(sl_books_region_grow(b, owner, g, 3, &err), SUBLET_EINVAL); /* a shrink */
  CHECK_EQ(sl_books_region_grow(b, owner, g, UINT64_MAX, &err), SUBLET_EINVAL);
  CHECK_EQ(region_pages(b), 8);
  loan = lend(b, owner, g, NULL, 0);
  CHECK_EQ(sl_books_may_grow(b, owner, g, 8, &err), SUBLET_EBUSY);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 8, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "is lent: it grows once its loan has ended");
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  CHECK_EQ(sl_books_may_grow(b, owner, g, 8, &err), 0);
  CHECK_EQ(region_pages(b), 8); /* may_grow changes nothing */
  CHECK_EQ(sl_books_region_grow(b, owner, g, 8, &err), 0);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 9, &err), 0);
  CHECK_EQ(sl_books_region_info(b, g, &ri), 0);
  CHECK_EQ(ri.npages, 9);
  CHECK_EQ(region_pages(b), 13);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_region_remove(b, owner, g, NULL), 0);
  CHECK_EQ(region_pages(b), 4);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* Address space (issue 41): a region reserves its pages, a growable one room that doubles as
 * it grows (at most the device, at most what its user's bound leaves), and a user's regions
 * reserve at most SL_USER_SPACE_DEVICES times the device: past it RegionCreate and RegionGrow
 * are SUBLET_ENOMEM naming the bound, for that user only; a gone region a keeper holds still
 * counts (once however many hold it). */
static void loan_round(struct sl_books *b, uint64_t owner, uint64_t borrower, uint64_t rid);

static void test_user_space(void) {
  struct sl_books_config cfg = {.page_size = PS, .device_pages = 16};
  uint64_t limit = 16 * SL_USER_SPACE_DEVICES, owner, twin, keeper, other, g, h, big, id = 0;
  struct sl_books *b = NULL;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_new(&cfg, &b), 0);
  owner = client(b, 1000, 1000);
  twin = client(b, 1000, 1000);
  keeper = client(b, 1000, 1000);
  other = client(b, 2000, 2000);
  g = growable(b, owner, 1);
  CHECK_EQ(sl_books_user_space(b, 1000), 1); /* its page, no more */
  CHECK_EQ(sl_books_grow_space(b, g, 1), 1);
  CHECK_EQ(sl_books_grow_space(b, g, 2), 2); /* doubles */
  CHECK_EQ(sl_books_grow_space(b, g, 3), 3); /* at least what it grows to */
  CHECK_EQ(sl_books_region_grow(b, owner, g, 3, NULL), 0);
  CHECK_EQ(sl_books_grow_space(b, g, 4), 6);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 9, NULL), 0);
  CHECK_EQ(sl_books_grow_space(b, g, 10), 16); /* twice 9, but the device holds 16 */
  CHECK_EQ(sl_books_grow_space(b, g, 17), 17);
  CHECK_EQ(sl_books_region_space(b, g, 16), 0); /* what the daemon reserved for it */
  CHECK_EQ(sl_books_user_space(b, 1000), 16);
  /* the user's other clients nearly fill its bound; another user is not touched */
  CHECK_EQ(sl_books_region_new(b, twin, limit - 16 - 5, 0, &big, NULL), 0);
  CHECK_EQ(sl_books_region_new(b, other, 16, 1, &id, NULL), 0);
  CHECK_EQ(sl_books_region_new(b, twin, 6, 1, &id, &err), SUBLET_ENOMEM);
  CHECK_MSG(err, "times the device's memory");
  CHECK_MSG(err, "release the regions this user no longer needs");
  CHECK_EQ(sl_books_region_new(b, owner, 5, 1, &id, NULL), 0); /* just fits */
  CHECK_EQ(sl_books_region_remove(b, owner, id, NULL), 0);
  h = growable(b, twin, 3);
  CHECK_EQ(sl_books_grow_space(b, h, 4), 5); /* not 6: the bound leaves 5 */
  CHECK_EQ(sl_books_may_grow(b, twin, h, 6, &err), SUBLET_ENOMEM);
  CHECK_EQ(sl_books_region_grow(b, twin, h, 6, &err), SUBLET_ENOMEM);
  CHECK_MSG(err, "subletd's address space");
  CHECK_EQ(sl_books_region_grow(b, twin, h, 5, NULL), 0);
  CHECK_EQ(sl_books_user_space(b, 1000), limit);
  CHECK_EQ(sl_books_region_new(b, other, 16, 0, &id, NULL), 0); /* its own bound */
  BOOKS_OK(b);
  /* a gone region whose pages a keeper holds still counts, until let go */
  sl_books_client_notices(b, keeper);
  loan_round(b, twin, keeper, big);
  CHECK_EQ(sl_books_region_remove(b, twin, big, NULL), 0);
  CHECK_EQ(sl_books_kept_holds(b, keeper, big), 1);
  CHECK_EQ(sl_books_user_space(b, 1000), limit);
  CHECK_EQ(sl_books_region_new(b, twin, 1, 0, &id, &err), SUBLET_ENOMEM);
  CHECK_EQ(sl_books_kept_drop(b, keeper, big, &(int){0}, NULL), 0);
  CHECK_EQ(sl_books_user_space(b, 1000), 21);
  CHECK_EQ(sl_books_region_new(b, twin, 1, 0, &id, NULL), 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* While the last loan's pages are being replaced (a borrower of another user), no growth. */
static void test_grow_while_replacing(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), root = client(b, 0, 0);
  uint64_t g = growable(b, owner, 4), loan = lend(b, owner, g, NULL, 0);
  struct sl_loan_end end = {0};
  struct sl_err err = {0};

  borrow(b, root, loan, 0);
  CHECK(alloc(b, root, PS, NULL) != 0);
  CHECK_EQ(sl_books_return(b, root, 1, &end, NULL), SUBLET_ELEAK);
  CHECK(end.nreplace > 0);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 8, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "reclaim the loan first");
  sl_books_pages_replaced(b, &end, end.nreplace);
  sl_loan_end_clear(&end);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 8, &err), 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* A loan after growth lays out every page, old and new, and never has a layout id of before:
 * a borrower's window of the old layout must not be taken for it. The layout is the same
 * from one loan to the next again once the region stays as it is. */
static void test_grow_then_lend(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), g = growable(b, owner, 4), loan, before, after;
  struct sublet_range keep[2] = {{PS + 1, 10}, {5 * PS + 7, 3}};
  struct sl_loan_end end = {0};
  const uint64_t *pages;
  uint64_t u, f, k;

  loan = lend(b, owner, g, keep, 1);
  before = layout_id_of(b, loan);
  borrow(b, owner, loan, 2);
  CHECK(alloc(b, owner, 3 * PS, NULL) != 0);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 8, NULL), SUBLET_EBUSY); /* borrowed */
  CHECK_EQ(sl_books_return(b, owner, 1, &end, NULL), SUBLET_ELEAK);
  CHECK_EQ(end.nreplace, 0); /* its own user's: nothing replaced */
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_region_grow(b, owner, g, 8, NULL), 0);
  BOOKS_OK(b);
  loan = lend(b, owner, g, keep, 1); /* the same keep: a layout of 4 pages, had it not grown */
  after = layout_id_of(b, loan);
  CHECK(after != before);
  CHECK_EQ(sl_books_loan_layout(b, loan, &pages, &u, &f, &k), 0);
  CHECK_EQ(u + k, 8);
  CHECK_EQ(k, 1);
  CHECK_EQ(pages[u], 1); /* the kept page */
  CHECK_EQ(pages[u - 1], 7); /* a new page among the unkept */
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend(b, owner, g, keep, 1);
  CHECK_EQ(layout_id_of(b, loan), after); /* no growth since: the same id */
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend(b, owner, g, keep, 2); /* keeps a byte of a new page */
  CHECK(layout_id_of(b, loan) != after && layout_id_of(b, loan) != before);
  CHECK_EQ(info(b, loan).kept_pages, 2);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  sl_books_free(b);
}

/* ---- borrowing ---------------------------------------------------------------------------- */

static void test_borrow_paths(void) {
  struct sl_books *b = books_new(PS, 50);
  uint64_t owner = client(b, 1000, 1000), same = client(b, 1000, 1000);
  uint64_t stranger = client(b, 2000, 2000), root = client(b, 0, 0), grouped = client(b, 3000, 50);
  uint64_t r = region(b, owner, 4), loan, got = 0;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_borrow(b, same, 0, NULL, NULL, 0, &got, &err), SUBLET_ENOOFFER);
  CHECK_EQ(sl_books_borrow(b, same, 0, NULL, "kv", 0, &got, &err), SUBLET_ENOOFFER);
  CHECK_MSG(err, "\"kv\"");
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, "kv", TOKEN, &loan, &err), 0);
  CHECK_EQ(sl_books_borrow(b, 99, loan, TOKEN, NULL, 0, &got, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_borrow(b, same, loan + 1, TOKEN, NULL, 0, &got, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_borrow(b, same, loan, NULL, NULL, 0, &got, &err), SUBLET_EPERM);
  CHECK_MSG(err, "token");
  CHECK_EQ(sl_books_borrow(b, same, loan, WRONG, NULL, 0, &got, &err), SUBLET_EPERM);
  CHECK_MSG(err, "wrong token");
  CHECK_EQ(sl_books_borrow(b, owner, loan, WRONG, NULL, 0, &got, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_borrow(b, same, 0, NULL, "other", 0, &got, &err), SUBLET_ENOOFFER);
  CHECK_EQ(sl_books_borrow(b, stranger, loan, TOKEN, NULL, 0, &got, &err), SUBLET_EPERM);
  CHECK_MSG(err, "--allow-group");
  /* by name, another user's loan is none to the stranger: status shows it none */
  CHECK_EQ(sl_books_borrow(b, stranger, 0, NULL, "kv", 0, &got, &err), SUBLET_ENOOFFER);
  /* the next offer is one this user may borrow: to the stranger, nothing is on offer */
  CHECK_EQ(sl_books_borrow(b, stranger, 0, NULL, NULL, 0, &got, &err), SUBLET_ENOOFFER);
  CHECK_EQ(sl_books_borrow(b, same, loan, TOKEN, NULL, UINT64_MAX, &got, &err), SUBLET_EINVAL);
  CHECK_EQ(info(b, loan).state, SL_LOAN_OFFERED);
  BOOKS_OK(b);
  /* each way that works: by id and token, by name, next offer, token NULL for the owner */
  CHECK_EQ(sl_books_borrow(b, same, loan, TOKEN, NULL, 3, &got, &err), 0);
  CHECK_EQ(got, loan);
  CHECK_EQ(sl_books_client_loan(b, same), loan);
  CHECK_EQ(info(b, loan).fresh_pages, 3);
  CHECK_EQ(info(b, loan).borrower_client, same);
  CHECK_EQ(sl_books_region_access(b, same, r, &err), 0);
  CHECK_EQ(sl_books_region_access(b, root, r, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_borrow(b, root, loan, TOKEN, NULL, 0, &got, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "already borrowed");
  CHECK_EQ(sl_books_borrow(b, root, 0, NULL, "kv", 0, &got, &err), SUBLET_EBUSY);
  CHECK_EQ(sl_books_borrow(b, root, 0, NULL, "", 0, &got, &err), SUBLET_ENOOFFER);
  CHECK_EQ(sl_books_borrow(b, same, loan, TOKEN, NULL, 0, &got, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "already borrows");
  CHECK_EQ(sl_books_withdraw(b, owner, loan, &err), SUBLET_EBUSY);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_return(b, same, 0, &(struct sl_loan_end){0}, &err), 0);
  CHECK_EQ(sl_books_client_loan(b, same), 0);

  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, "kv", TOKEN, &loan, &err), 0);
  CHECK_EQ(sl_books_borrow(b, root, 0, NULL, "kv", 0, &got, &err), 0);
  CHECK_EQ(got, loan);
  CHECK_EQ(sl_books_return(b, root, 0, &(struct sl_loan_end){0}, &err), 0);
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, NULL, TOKEN, &loan, &err), 0);
  CHECK_EQ(sl_books_borrow(b, grouped, 0, NULL, NULL, 0, &got, &err), 0);
  CHECK_EQ(got, loan);
  CHECK_EQ(sl_books_return(b, grouped, 0, &(struct sl_loan_end){0}, &err), 0);
  CHECK_EQ(sl_books_lend(b, owner, r, NULL, 0, 0, NULL, TOKEN, &loan, &err), 0);
  CHECK_EQ(sl_books_borrow(b, owner, loan, NULL, NULL, 0, &got, &err), 0);
  CHECK_EQ(sl_books_return(b, owner, 0, &(struct sl_loan_end){0}, &err), 0);
  BOOKS_OK(b);
  sl_books_free(b);

  /* without --allow-group the group grants nothing */
  b = books_new(PS, (gid_t)-1);
  owner = client(b, 1000, 50);
  grouped = client(b, 3000, 50);
  r = region(b, owner, 1);
  loan = lend(b, owner, r, NULL, 0);
  CHECK_EQ(sl_books_borrow(b, grouped, loan, TOKEN, NULL, 0, &got, &err), SUBLET_EPERM);
  sl_books_free(b);
}

/* ---- allocation ---------------------------------------------------------------------------- */

static void check_copy(const struct sl_copy *c, uint64_t dev, uint64_t host, uint64_t len) {
  CHECK_EQ(c->dev_off, dev);
  CHECK_EQ(c->host_off, host);
  CHECK_EQ(c->len, len);
}

static void check_grant(const struct sl_grant *g, uint64_t pos, uint64_t npages, uint64_t chunk,
                        uint64_t fresh_pos, uint64_t fresh_npages, size_t nsave) {
  CHECK_EQ(g->pos, pos);
  CHECK_EQ(g->npages, npages);
  CHECK_EQ(g->fresh_chunk_id, chunk);
  CHECK_EQ(g->fresh_pos, fresh_pos);
  CHECK_EQ(g->fresh_npages, fresh_npages);
  CHECK_EQ(g->nsave, nsave);
}

/* 8 pages, pages 1 and 5 kept: U = 6 (0 2 3 4 6 7), F = 3, K = 2 (1 5). */
static void test_alloc_order(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), user = client(b, 1000, 1000);
  struct sublet_range keep[] = {{5 * PS, PS}, {PS + 200, 50}, {PS + 10, 100}};
  uint64_t loan = lend(b, owner, region(b, owner, 8), keep, 3), ids[6], pair;
  struct sl_grant g;
  struct sl_loan_end end;
  struct sl_loan_info li;
  struct sublet_leak leaks[4];
  struct sl_err err = {0};

  borrow(b, user, loan, 3);
  for (int i = 0; i < 6; i++) {
    ids[i] = alloc(b, user, PS, &g);
    check_grant(&g, (uint64_t)i, 1, 0, 0, 0, 0);
    CHECK_EQ(g.served[SL_SRC_UNKEPT], PS);
    sl_grant_clear(&g);
  }
  pair = alloc(b, user, 2 * PS, &g); /* fresh positions 6, 7: one chunk */
  check_grant(&g, 6, 2, 1, 6, 2, 0);
  CHECK_EQ(g.served[SL_SRC_FRESH], 2 * PS);
  sl_grant_clear(&g);
  alloc(b, user, 2 * PS - 5, &g); /* fresh 8, then kept page 1 */
  check_grant(&g, 8, 2, 2, 8, 1, 2);
  check_copy(&g.save[0], PS + 10, 0, 100);
  check_copy(&g.save[1], PS + 200, 100, 50);
  CHECK_EQ(g.save_bytes, 150);
  CHECK_EQ(g.served[SL_SRC_FRESH], PS);
  CHECK_EQ(g.served[SL_SRC_KEPT], PS);
  CHECK_EQ(g.size, 2 * PS - 5);
  sl_grant_clear(&g);
  alloc(b, user, 1, &g); /* kept page 5, whole */
  check_grant(&g, 10, 1, 0, 0, 0, 1);
  check_copy(&g.save[0], 5 * PS, 150, PS);
  sl_grant_clear(&g);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_alloc_plan(b, user, 1, &g, &err), SUBLET_ENOMEM);
  CHECK_MSG(err, "1 B");
  CHECK_MSG(err, "largest free run is 0 B");
  li = info(b, loan);
  CHECK_EQ(li.hwm, 11);
  CHECK_EQ(li.fresh_chunk_pages, 3);
  CHECK_EQ(li.stats.copied_out_bytes, 150 + PS);
  CHECK_EQ(li.stats.served_unkept_bytes, 6 * PS);
  CHECK_EQ(li.stats.served_fresh_bytes, 3 * PS);
  CHECK_EQ(li.stats.served_kept_bytes, 2 * PS);
  CHECK_EQ(li.live_allocs, 9);
  CHECK_EQ(li.live_bytes, 11 * PS);
  CHECK_EQ(li.stats.peak_bytes, 11 * PS);
  /* a freed fresh run is reused with no new chunk and no save */
  CHECK_EQ(sl_books_free_alloc(b, user, pair, NULL, &err), 0);
  alloc(b, user, PS, &g);
  check_grant(&g, 6, 1, 0, 0, 0, 0);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_alloc_plan(b, user, 2 * PS, &g, &err), SUBLET_ENOMEM);
  CHECK_MSG(err, "8.00 KiB");
  CHECK_MSG(err, "largest free run is 4.00 KiB");
  /* leaks: nothing changes without force */
  CHECK_EQ(sl_books_return(b, user, 0, &end, &err), SUBLET_ELEAK);
  CHECK_MSG(err, "9 allocations are");
  CHECK_MSG(err, "40.0 KiB");
  CHECK_EQ(end.nrestore, 0);
  CHECK_EQ(sl_books_leaks(b, loan, leaks, 4), 9);
  CHECK_EQ(leaks[0].alloc_id, ids[0]);
  CHECK_EQ(leaks[0].size, PS);
  CHECK_EQ(sl_books_leaks(b, loan + 1, leaks, 4), 0);
  CHECK_EQ(sl_books_current_loan(b), loan);
  CHECK_EQ(info(b, loan).live_allocs, 9);
  BOOKS_OK(b);
  for (int i = 0; i < 6; i++)
    CHECK_EQ(sl_books_free_alloc(b, user, ids[i], NULL, &err), 0);
  CHECK_EQ(sl_books_return(b, user, 0, &end, &err), SUBLET_ELEAK);
  CHECK_MSG(err, "3 allocations");
  CHECK_EQ(sl_books_return(b, user, 1, &end, &err), SUBLET_ELEAK); /* forced */
  CHECK_EQ(end.loan_id, loan);
  CHECK_EQ(end.nrestore, 3); /* page 1's two pieces, then page 5 */
  check_copy(&end.restore[0], PS + 10, 0, 100);
  check_copy(&end.restore[1], PS + 200, 100, 50);
  check_copy(&end.restore[2], 5 * PS, 150, PS);
  CHECK_EQ(end.nfresh, 2);
  CHECK_EQ(end.fresh_chunks[0], 1);
  CHECK_EQ(end.fresh_chunks[1], 2);
  CHECK_EQ(end.stats.copied_in_bytes, 150 + PS);
  CHECK_EQ(end.stats.copied_out_bytes, 150 + PS);
  CHECK_EQ(end.stats.allocations, 10);
  CHECK_EQ(end.free_region, 0);
  CHECK_EQ(sl_books_current_loan(b), 0);
  CHECK_EQ(sl_books_client_loan(b, user), 0);
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* A keep range across the boundary of two neighbouring kept pages: one piece when both pages
 * are reached at once; two grants' pieces are coalesced again in the restore list. */
static void test_coalescing(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000);
  struct sublet_range keep = {3 * PS - 10, 20};
  uint64_t r = region(b, owner, 4), loan = lend(b, owner, r, &keep, 1), a;
  struct sl_grant g;
  struct sl_loan_end end;

  borrow(b, owner, loan, 0); /* U = 2 (pages 0, 1), K = 2 (pages 2, 3) */
  a = alloc(b, owner, 4 * PS, &g);
  CHECK_EQ(g.nsave, 1);
  check_copy(&g.save[0], 3 * PS - 10, 0, 20);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_free_alloc(b, owner, a, NULL, NULL), 0);
  CHECK_EQ(sl_books_return(b, owner, 0, &end, NULL), 0);
  CHECK_EQ(end.nrestore, 1);
  sl_loan_end_clear(&end);

  loan = lend(b, owner, r, &keep, 1);
  borrow(b, owner, loan, 0);
  alloc(b, owner, 3 * PS, &g);
  CHECK_EQ(g.nsave, 1);
  check_copy(&g.save[0], 3 * PS - 10, 0, 10);
  sl_grant_clear(&g);
  alloc(b, owner, PS, &g);
  CHECK_EQ(g.nsave, 1);
  check_copy(&g.save[0], 3 * PS, 10, 10);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_return(b, owner, 1, &end, NULL), SUBLET_ELEAK);
  CHECK_EQ(end.nrestore, 1);
  check_copy(&end.restore[0], 3 * PS - 10, 0, 20);
  CHECK_EQ(end.stats.copied_in_bytes, 20);
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
  sl_books_free(b);
}

static void test_first_fit_and_hwm(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000);
  uint64_t loan = lend(b, owner, region(b, owner, 10), NULL, 0), mid;
  struct sl_grant g;

  borrow(b, owner, loan, 0);
  alloc(b, owner, 2 * PS, NULL);
  mid = alloc(b, owner, 3 * PS, NULL);
  alloc(b, owner, 2 * PS, &g);
  CHECK_EQ(g.pos, 5);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_free_alloc(b, owner, mid, NULL, NULL), 0);
  CHECK_EQ(info(b, loan).hwm, 7);
  CHECK_EQ(sl_books_alloc_plan(b, owner, 4 * PS, &g, NULL), SUBLET_ENOMEM);
  alloc(b, owner, 3 * PS, &g); /* the hole is 3 pages: first fit takes it */
  CHECK_EQ(g.pos, 2);
  sl_grant_clear(&g);
  CHECK_EQ(info(b, loan).hwm, 7);
  alloc(b, owner, 2 * PS, &g);
  CHECK_EQ(g.pos, 7);
  sl_grant_clear(&g);
  CHECK_EQ(info(b, loan).hwm, 9);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* Fresh chunks are made once per position; kept pages are saved once. */
static void test_fresh_once(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000);
  struct sublet_range keep = {PS, PS};
  uint64_t loan = lend(b, owner, region(b, owner, 2), &keep, 1), a;
  struct sl_grant g;
  struct sl_loan_info li;

  borrow(b, owner, loan, 4); /* positions: 0 unkept, 1-4 fresh, 5 kept */
  a = alloc(b, owner, 3 * PS, &g);
  check_grant(&g, 0, 3, 1, 1, 2, 0);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_free_alloc(b, owner, a, NULL, NULL), 0);
  a = alloc(b, owner, 5 * PS, &g);
  check_grant(&g, 0, 5, 2, 3, 2, 0);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_free_alloc(b, owner, a, NULL, NULL), 0);
  a = alloc(b, owner, 6 * PS, &g);
  check_grant(&g, 0, 6, 0, 0, 0, 1);
  check_copy(&g.save[0], PS, 0, PS);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_free_alloc(b, owner, a, NULL, NULL), 0);
  alloc(b, owner, 6 * PS, &g);
  check_grant(&g, 0, 6, 0, 0, 0, 0);
  CHECK_EQ(g.served[SL_SRC_UNKEPT], PS);
  CHECK_EQ(g.served[SL_SRC_FRESH], 4 * PS);
  CHECK_EQ(g.served[SL_SRC_KEPT], PS);
  sl_grant_clear(&g);
  li = info(b, loan);
  CHECK_EQ(li.fresh_chunk_pages, 4);
  CHECK_EQ(li.stats.copied_out_bytes, PS);
  CHECK_EQ(li.stats.allocations, 4);
  CHECK_EQ(li.stats.peak_bytes, 6 * PS);
  CHECK_EQ(li.stats.served_fresh_bytes, (2 + 4 + 4 + 4) * PS);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* A region's next loan keeps the fresh zone of its last while the free memory is no more
 * than `fresh_give` pages (here 50) below it and has grown by no more than an eighth (1024
 * pages at least): a borrower's window is kept from loan to loan only while the zones keep
 * their sizes (client/window.c). */
static void test_fresh_zone_steady(void) {
  struct sl_books_config cfg = {.page_size = PS, .fresh_give = 50};
  struct sl_books *b = NULL;
  uint64_t owner, r;
  const uint64_t offered[] = {4000, 4100, 5024, 5025, 4975, 4974, 3000, 3000, 2950};
  const uint64_t zone[] = {4000, 4000, 4000, 5025, 5025, 4974, 3000, 3000, 3000};

  CHECK_EQ(sl_books_new(&cfg, &b), 0);
  owner = client(b, 1000, 1000);
  r = region(b, owner, 2);

  for (size_t i = 0; i < sizeof(zone) / sizeof(zone[0]); i++) {
    uint64_t loan = lend(b, owner, r, NULL, 0);
    borrow(b, owner, loan, offered[i]);
    CHECK_EQ(info(b, loan).fresh_pages, zone[i]);
    CHECK_EQ(sl_books_return(b, owner, 0, &(struct sl_loan_end){0}, NULL), 0);
    BOOKS_OK(b);
  }
  sl_books_free(b);
}

static void test_two_phase(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000);
  uint64_t loan = lend(b, owner, region(b, owner, 4), NULL, 0);
  struct sl_grant g1, g2;
  struct sl_loan_end end;

  borrow(b, owner, loan, 2);
  CHECK_EQ(sl_books_alloc_plan(b, owner, 5 * PS, &g1, NULL), 0);
  sl_grant_clear(&g1); /* the device work failed: nothing happened */
  CHECK_EQ(info(b, loan).hwm, 0);
  CHECK_EQ(info(b, loan).live_allocs, 0);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_alloc_plan(b, owner, 5 * PS, &g1, NULL), 0);
  CHECK_EQ(sl_books_alloc_plan(b, owner, PS, &g2, NULL), 0);
  CHECK_EQ(g1.alloc_id, g2.alloc_id); /* planning takes no id */
  CHECK_EQ(g1.fresh_chunk_id, 1);
  CHECK_EQ(sl_books_alloc_commit(b, &g1), 0);
  CHECK_EQ(sl_books_alloc_commit(b, &g2), SUBLET_EINVAL); /* stale: plan again */
  CHECK_EQ(sl_books_alloc_commit(b, &g1), SUBLET_EINVAL); /* committed twice */
  sl_grant_clear(&g1);
  sl_grant_clear(&g2);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_alloc_plan(b, owner, PS, &g2, NULL), 0);
  CHECK_EQ(sl_books_return(b, owner, 1, &end, NULL), SUBLET_ELEAK);
  sl_loan_end_clear(&end);
  CHECK_EQ(sl_books_alloc_commit(b, &g2), SUBLET_EINVAL); /* the loan ended */
  sl_grant_clear(&g2);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* A grant whose kept bytes are being saved (off the event loop) is held: its positions are
 * neither lent nor free, nothing else is planned, the loan is not returned, until the commit;
 * a release (the save failed) or the loan's end (the borrower left) undoes the hold. */
static void test_held_grant(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  struct sublet_range all = {0, 4 * PS};
  uint64_t owner = client(b, 1000, 1000);
  uint64_t loan = lend(b, owner, region(b, owner, 4), &all, 1);
  struct sl_grant g, g2;
  struct sl_loan_end end;
  struct sl_err err = {0};

  borrow(b, owner, loan, 0);
  CHECK_EQ(sl_books_alloc_plan(b, owner, 2 * PS, &g, NULL), 0);
  CHECK(g.nsave > 0);
  CHECK_EQ(sl_books_alloc_hold(b, &g, NULL), 0);
  CHECK_EQ(sl_books_alloc_hold(b, &g, NULL), SUBLET_EINVAL); /* held once */
  BOOKS_OK(b);
  CHECK_EQ(info(b, loan).hwm, 0); /* not lent: no fd of those pages goes out */
  CHECK_EQ(sl_books_alloc_plan(b, owner, PS, &g2, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "saving");
  CHECK_EQ(sl_books_return(b, owner, 1, &end, &err), SUBLET_EBUSY);
  sl_books_alloc_release(b, &g); /* the save failed */
  sl_grant_clear(&g);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_alloc_plan(b, owner, 2 * PS, &g, NULL), 0);
  CHECK_EQ(sl_books_alloc_hold(b, &g, NULL), 0);
  CHECK_EQ(sl_books_alloc_commit(b, &g), 0);
  CHECK_EQ(info(b, loan).hwm, 2);
  CHECK_EQ(sl_books_alloc_plan(b, owner, PS, &g2, NULL), 0); /* the hold is over */
  CHECK_EQ(sl_books_alloc_hold(b, &g2, NULL), 0);
  CHECK_EQ(sl_books_client_remove(b, owner, NULL), 0); /* the borrower (and owner) leaves */
  sl_books_alloc_release(b, &g2);                      /* harmless: the loan is gone */
  CHECK_EQ(sl_books_alloc_commit(b, &g2), SUBLET_EINVAL);
  sl_grant_clear(&g);
  sl_grant_clear(&g2);
  BOOKS_OK(b);
  sl_books_free(b);
}

static void test_alloc_errors(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), user = client(b, 1000, 1000);
  uint64_t idle = client(b, 1000, 1000);
  uint64_t loan = lend(b, owner, region(b, owner, 4), NULL, 0), a, size = 0;
  struct sl_grant g;
  struct sl_loan_end end;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_alloc_plan(b, 99, PS, &g, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_alloc_plan(b, idle, PS, &g, &err), SUBLET_ENOENT);
  CHECK_MSG(err, "borrow one first");
  CHECK_EQ(sl_books_alloc_plan(b, owner, PS, &g, &err), SUBLET_EPERM);
  CHECK_MSG(err, "does not borrow it");
  borrow(b, user, loan, 0);
  CHECK_EQ(sl_books_alloc_plan(b, user, 0, &g, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_alloc_plan(b, user, UINT64_MAX, &g, &err), SUBLET_ENOMEM);
  CHECK_EQ(g.save, NULL);
  a = alloc(b, user, PS + 1, NULL);
  CHECK_EQ(sl_books_free_alloc(b, 99, a, &size, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_free_alloc(b, user, a + 1, &size, &err), SUBLET_ENOENT);
  CHECK_MSG(err, "no live allocation");
  CHECK_EQ(sl_books_free_alloc(b, owner, a, &size, &err), SUBLET_EPERM);
  CHECK_MSG(err, "belongs to client");
  CHECK_EQ(sl_books_free_alloc(b, user, a, &size, &err), 0);
  CHECK_EQ(size, PS + 1);
  CHECK_EQ(sl_books_free_alloc(b, user, a, &size, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_return(b, owner, 0, &end, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_return(b, idle, 0, &end, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_return(b, 99, 0, &end, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_loan_finish(b, loan, &end), SUBLET_EBUSY);
  CHECK_EQ(sl_books_loan_finish(b, 99, &end), SUBLET_ENOENT);
  CHECK_EQ(sl_books_return(b, user, 0, &end, &err), 0);
  CHECK_EQ(sl_books_free_alloc(b, user, a, &size, &err), SUBLET_ENOENT); /* no loan at all */
  BOOKS_OK(b);
  sl_books_free(b);
}

static void test_withdraw_and_owned(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), other = client(b, 1000, 1000);
  uint64_t r = region(b, owner, 2), loan = lend(b, owner, r, NULL, 0);
  struct sl_region_info ri;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_loan_owned(b, owner, loan, &err), 0);
  CHECK_EQ(sl_books_loan_owned(b, other, loan, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_loan_owned(b, owner, loan + 1, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_withdraw(b, other, loan, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_withdraw(b, owner, loan + 1, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_info(b, r, &ri), 0);
  CHECK_EQ(ri.loan_id, loan);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, &err), 0);
  CHECK_EQ(sl_books_region_info(b, r, &ri), 0);
  CHECK_EQ(ri.loan_id, 0);
  CHECK_EQ(sl_books_loan_info(b, loan, &(struct sl_loan_info){0}), SUBLET_ENOENT);
  CHECK_EQ(lend(b, owner, r, NULL, 0), loan + 1);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* ---- clients leaving ---------------------------------------------------------------------- */

struct scene {
  struct sl_books *b;
  uint64_t owner, user, r, idle_r, loan;
};

/* owner has an idle region and a region lent with page 1 kept; user borrows it and holds the
 * unkept page and the kept one (saved). */
static struct scene scene_active(void) {
  struct scene s;
  struct sublet_range keep = {PS + 8, 8};

  s.b = books_new(PS, (gid_t)-1);
  s.owner = client(s.b, 1000, 1000);
  s.user = client(s.b, 1000, 1000);
  s.idle_r = region(s.b, s.owner, 3);
  s.r = region(s.b, s.owner, 2);
  s.loan = lend(s.b, s.owner, s.r, &keep, 1);
  borrow(s.b, s.user, s.loan, 1);
  alloc(s.b, s.user, 3 * PS, NULL);
  return s;
}

static void test_remove_idle_owner(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t a = client(b, 1000, 1000), other = client(b, 1000, 1000);
  uint64_t r1 = region(b, a, 2), r2 = region(b, other, 1), r3 = region(b, a, 3);
  struct sl_client_gone gone;
  struct sl_books_totals t;

  CHECK_EQ(sl_books_client_remove(b, a, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 2);
  CHECK_EQ(gone.free_regions[0], r1);
  CHECK_EQ(gone.free_regions[1], r3);
  CHECK_EQ(gone.ndraining, 0);
  sl_client_gone_clear(&gone);
  sl_books_totals(b, &t);
  CHECK_EQ(t.regions, 1);
  CHECK_EQ(t.region_pages, 1);
  CHECK_EQ(sl_books_region_info(b, r2, &(struct sl_region_info){0}), 0);
  CHECK_EQ(sl_books_client_remove(b, 99, &gone), SUBLET_ENOENT);
  CHECK_EQ(gone.nfree_regions, 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

static void test_remove_offering_owner(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t a = client(b, 1000, 1000), r = region(b, a, 2);
  struct sl_client_gone gone;

  lend(b, a, r, NULL, 0);
  CHECK_EQ(sl_books_client_remove(b, a, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 1);
  CHECK_EQ(gone.free_regions[0], r);
  CHECK_EQ(gone.ndraining, 0);
  sl_client_gone_clear(&gone);
  CHECK_EQ(sl_books_current_loan(b), 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

static void test_remove_borrower(void) {
  struct scene s = scene_active();
  struct sl_client_gone gone;
  struct sl_loan_end end;
  struct sl_books_totals t;
  struct sl_loan_info li;

  CHECK_EQ(sl_books_client_remove(s.b, s.user, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 0);
  CHECK_EQ(gone.ndraining, 1);
  CHECK_EQ(gone.draining_loans[0], s.loan);
  sl_client_gone_clear(&gone);
  li = info(s.b, s.loan);
  CHECK_EQ(li.state, SL_LOAN_DRAINING);
  CHECK_EQ(li.live_allocs, 0);
  CHECK_EQ(li.stats.borrower_died, 1);
  BOOKS_OK(s.b);
  CHECK_EQ(sl_books_region_remove(s.b, s.owner, s.r, NULL), SUBLET_EBUSY);
  CHECK_EQ(sl_books_loan_finish(s.b, s.loan, &end), 0);
  CHECK_EQ(end.stats.borrower_died, 1);
  CHECK_EQ(end.free_region, 0);
  CHECK_EQ(end.nrestore, 1);
  check_copy(&end.restore[0], PS + 8, 0, 8);
  CHECK_EQ(end.nfresh, 1);
  CHECK_EQ(end.stats.copied_in_bytes, 8);
  sl_loan_end_clear(&end);
  sl_books_totals(s.b, &t);
  CHECK_EQ(t.borrowers_died, 1);
  CHECK_EQ(t.loans_ended, 1);
  CHECK_EQ(t.copied_in_bytes, 8);
  CHECK_EQ(t.copied_out_bytes, 8);
  CHECK_EQ(t.served_bytes[SL_SRC_KEPT], PS);
  CHECK_EQ(sl_books_loan_finish(s.b, s.loan, &end), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_remove(s.b, s.owner, s.r, NULL), 0);
  BOOKS_OK(s.b);
  sl_books_free(s.b);
}

static void test_remove_owner_of_active(void) {
  struct scene s = scene_active();
  struct sl_client_gone gone;
  struct sl_loan_end end;
  struct sl_grant g;
  struct sl_books_totals t;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_client_remove(s.b, s.owner, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 1);
  CHECK_EQ(gone.free_regions[0], s.idle_r);
  CHECK_EQ(gone.ndraining, 0);
  sl_client_gone_clear(&gone);
  CHECK_EQ(info(s.b, s.loan).owner_gone, 1);
  BOOKS_OK(s.b);
  CHECK_EQ(sl_books_alloc_plan(s.b, s.user, PS, &g, &err), SUBLET_EOWNERGONE);
  CHECK_MSG(err, "return the loan");
  CHECK_EQ(sl_books_region_access(s.b, s.user, s.r, &err), 0);
  CHECK_EQ(sl_books_return(s.b, s.user, 1, &end, &err), SUBLET_ELEAK);
  CHECK_EQ(end.free_region, 1);
  CHECK_EQ(end.nrestore, 0);
  CHECK_EQ(end.stats.owner_gone, 1);
  CHECK_EQ(end.stats.copied_in_bytes, 0);
  CHECK_EQ(end.owner_client, s.owner);
  sl_loan_end_clear(&end);
  sl_books_totals(s.b, &t);
  CHECK_EQ(t.regions, 0);
  CHECK_EQ(t.region_pages, 0);
  CHECK_EQ(t.copied_in_bytes, 0);
  BOOKS_OK(s.b);
  sl_books_free(s.b);
}

static void test_remove_self_borrower(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t a = client(b, 1000, 1000), r = region(b, a, 2), loan = lend(b, a, r, NULL, 0);
  struct sl_client_gone gone;
  struct sl_loan_end end;
  struct sl_books_totals t;

  borrow(b, a, loan, 0);
  alloc(b, a, PS, NULL);
  CHECK_EQ(sl_books_client_remove(b, a, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 0);
  CHECK_EQ(gone.ndraining, 1);
  sl_client_gone_clear(&gone);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_loan_finish(b, loan, &end), 0);
  CHECK_EQ(end.free_region, 1);
  CHECK_EQ(end.stats.borrower_died, 1);
  CHECK_EQ(end.stats.owner_gone, 1);
  sl_loan_end_clear(&end);
  sl_books_totals(b, &t);
  CHECK_EQ(t.regions + t.loans + t.clients, 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* Both leave, in either order, before the loan finishes. */
static void test_remove_both(int borrower_first) {
  struct scene s = scene_active();
  struct sl_client_gone gone;
  struct sl_loan_end end;

  CHECK_EQ(sl_books_client_remove(s.b, borrower_first ? s.user : s.owner, &gone), 0);
  sl_client_gone_clear(&gone);
  BOOKS_OK(s.b);
  CHECK_EQ(sl_books_client_remove(s.b, borrower_first ? s.owner : s.user, &gone), 0);
  CHECK_EQ(gone.ndraining, !borrower_first);
  CHECK_EQ(gone.nfree_regions, borrower_first ? 1 : 0);
  sl_client_gone_clear(&gone);
  BOOKS_OK(s.b);
  CHECK_EQ(sl_books_loan_finish(s.b, s.loan, &end), 0);
  CHECK_EQ(end.free_region, 1);
  CHECK_EQ(end.nrestore, 0);
  CHECK_EQ(end.nfresh, 1);
  sl_loan_end_clear(&end);
  CHECK_EQ(sl_books_region_info(s.b, s.r, &(struct sl_region_info){0}), SUBLET_ENOENT);
  BOOKS_OK(s.b);
  sl_books_free(s.b);
}

/* ---- compaction: kept bytes move into holes of kept pages that stay unlent ----------------- */

static void check_move(const struct sl_move *m, uint64_t src, uint64_t dst, uint64_t len) {
  CHECK_EQ(m->src_off, src);
  CHECK_EQ(m->dst_off, dst);
  CHECK_EQ(m->len, len);
}

/* Eight pages of 64 bytes, each keeping its first 8: 64 kept bytes fit in one page. The first
 * seven pages are freed by moves alone, filling page 7's holes in order; reaching page 7 then
 * saves it whole, its own bytes and the moved ones in one piece. The loan's end restores the
 * save and moves everything back. */
static void test_compaction(void) {
  struct sl_books_config cfg = {.page_size = 64};
  struct sl_books *b = NULL;
  struct sublet_range keep[8];
  struct sl_loan_end end;
  struct sl_grant g;
  uint64_t owner, loan, a1, a2, a3;

  CHECK_EQ(sl_books_new(&cfg, &b), 0);
  owner = client(b, 1000, 1000);
  for (int i = 0; i < 8; i++)
    keep[i] = (struct sublet_range){64 * (uint64_t)i, 8};
  loan = lend(b, owner, region(b, owner, 8), keep, 8);
  borrow(b, owner, loan, 0);
  a1 = alloc(b, owner, 64, &g); /* page 0 */
  CHECK_EQ(g.nmove, 1);
  check_move(&g.move[0], 0, 7 * 64 + 8, 8);
  CHECK_EQ(g.nsave, 0);
  sl_grant_clear(&g);
  a2 = alloc(b, owner, 6 * 64, &g); /* pages 1-6: exactly the rest of page 7's holes */
  CHECK_EQ(g.nmove, 6);
  for (uint64_t i = 1; i <= 6; i++)
    check_move(&g.move[i - 1], 64 * i, 7 * 64 + 8 + 8 * i, 8);
  CHECK_EQ(g.move_bytes, 48);
  CHECK_EQ(g.nsave, 0);
  sl_grant_clear(&g);
  CHECK_EQ(info(b, loan).stats.copied_out_bytes, 0);
  BOOKS_OK(b);
  a3 = alloc(b, owner, 64, &g); /* page 7: what cannot stay on the device */
  CHECK_EQ(g.nmove, 0);
  CHECK_EQ(g.nsave, 1);
  check_copy(&g.save[0], 7 * 64, 0, 64);
  sl_grant_clear(&g);
  BOOKS_OK(b);
  CHECK_EQ(info(b, loan).stats.moved_bytes, 56);
  CHECK_EQ(sl_books_free_alloc(b, owner, a1, NULL, NULL), 0);
  CHECK_EQ(sl_books_free_alloc(b, owner, a2, NULL, NULL), 0);
  CHECK_EQ(sl_books_free_alloc(b, owner, a3, NULL, NULL), 0);
  CHECK_EQ(sl_books_return(b, owner, 0, &end, NULL), 0);
  CHECK_EQ(end.nrestore, 1);
  check_copy(&end.restore[0], 7 * 64, 0, 64);
  CHECK_EQ(end.nunmove, 7);
  check_move(&end.unmove[0], 7 * 64 + 8, 0, 8);
  check_move(&end.unmove[6], 7 * 64 + 56, 6 * 64, 8);
  CHECK_EQ(end.stats.copied_in_bytes, 64);
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* sl_plan_must_save never says a reach must save when its step saves nothing: random keeps
 * of 16 pages of 64 bytes, plans stepped at random, every step checked against what it said
 * before. It says so where the kept bytes reached outweigh every hole above the reach (page
 * 0 keeps 40 bytes, page 1 keeps 30: reaching page 0 cannot move 40 bytes into 34 of holes). */
static void test_must_save(void) {
  const uint64_t ps = 64, npages = 16;
  uint64_t pages[16], seed = 7, said = 0, saved = 0;
  struct sublet_range keep[64], two[2] = {{0, 40}, {64, 30}};
  struct sl_plan p;
  struct sl_plan_step s;

  for (uint64_t i = 0; i < npages; i++)
    pages[i] = i;
  sl_plan_init(&p, ps, two, 2, pages, 2, 1);
  CHECK_EQ(sl_plan_must_save(&p, 0, 1), 1);
  CHECK_EQ(sl_plan_must_save(&p, 1, 2), 1); /* holes below the reach take nothing */
  sl_plan_init(&p, ps, two, 2, pages, 3, 1);  /* a third page: 34 + 64 bytes of holes above */
  CHECK_EQ(sl_plan_must_save(&p, 0, 1), 0);
  for (int round = 0; round < 2000; round++) {
    size_t n = 0;
    uint64_t at = 0, reached = 0;
    while (n < 64 && at < npages * ps) { /* sorted, disjoint ranges of 1 to 24 bytes */
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      at += (seed >> 33) % 48;
      uint64_t len = 1 + (seed >> 40) % 24;
      if (at + len > npages * ps)
        break;
      keep[n++] = (struct sublet_range){at, len};
      at += len + 1;
    }
    sl_plan_init(&p, ps, keep, n, pages, npages, round % 5 != 0);
    while (reached < npages) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      uint64_t to = reached + 1 + (seed >> 35) % (npages - reached);
      int must = sl_plan_must_save(&p, reached, to);
      CHECK_EQ(sl_plan_reach(&p, reached, to, &s), 0);
      if (must)
        CHECK(s.saved_bytes > 0);
      said += must;
      saved += s.saved_bytes > 0;
      CHECK_EQ(sl_plan_commit(&p, &s), 0);
      sl_plan_step_clear(&s);
      reached = to;
    }
    sl_plan_release(&p);
  }
  CHECK(said > 0 && said < saved); /* it fired, and only where saving was certain */
}

/* ---- a long random sequence against a reference model -------------------------------------- */

#define M_MAX 4096 /* clients or regions ever made in one run */
#define M_ALLOW_GID 50
#define M_GIVE 2 /* the books' fresh_give: a zone may stay 2 pages above the free memory */

struct m_client {
  uid_t uid;
  gid_t gid;
  int live;
  uint64_t retained; /* old pages of other users' regions it may hold */
};

struct m_region {
  uint64_t owner, npages, last_fresh;
  int live;
  uint64_t pages_version;
};

/* The model keeps everything per byte and per position: slow and obviously right. */
struct m_loan {
  uint64_t id, region, owner, borrower, bytes, ps;
  int state, owner_gone;
  char name[8];
  uint8_t token[16];
  uint8_t *kept;     /* per region byte */
  uint64_t *host_of; /* per region byte: 1 + its offset in the save area; 0: not saved */
  uint64_t *order;   /* region pages: unkept then kept, each ascending; in order: 0, 1, ... */
  int in_order;      /* the window is the region in order (books.h), all of it the kept zone */
  uint64_t u, f, k, lo, hwm, chunk_pages, copied_out, nallocs; /* [lo, hwm): handed out */
  uint64_t holding;  /* region pages with kept bytes */
  uint64_t *owner_of; /* per window position: the alloc id there, 0: free */
  uint64_t *size_of;  /* per alloc id (indexed by id): its size while live */
  /* Compacting books: the device and the save area, byte by byte. Region byte x holds x + 1
   * until the borrower writes it (0); moves, saves and restores carry the values along. */
  uint32_t *dev, *host;
  uint64_t kept_bytes, moved;
};

struct model {
  struct sl_books *b;
  int compact;        /* the books move kept bytes on the device (plan.h) */
  uint64_t ps, next_alloc, next_chunk;
  uint64_t nclients, nregions; /* ids made so far: 1..n */
  struct m_client c[M_MAX + 1];
  struct m_region r[M_MAX + 1];
  struct m_loan *loan;
  struct sl_loan_end pending; /* an end whose fresh pages the daemon is still making */
  uint64_t replaced;
  uint64_t next_loan, loans_ended, died, copied_out, copied_in;
  uint64_t rng;
};

static uint64_t rnd(struct model *m) { /* xorshift64*: reproducible everywhere */
  m->rng ^= m->rng >> 12;
  m->rng ^= m->rng << 25;
  m->rng ^= m->rng >> 27;
  return m->rng * 2685821657736338717ull;
}

static uint64_t below(struct model *m, uint64_t n) {
  return n ? rnd(m) % n : 0;
}

/* Mostly a live client, sometimes any id ever made or one not made yet. */
static uint64_t pick_client(struct model *m) {
  for (int tries = 0; tries < 20 && below(m, 10) != 0; tries++) {
    uint64_t id = 1 + below(m, m->nclients);
    if (m->c[id].live)
      return id;
  }
  return 1 + below(m, m->nclients + 2);
}

static int m_live_client(const struct model *m, uint64_t id) {
  return id >= 1 && id <= m->nclients && m->c[id].live;
}

/* May client cid see what client owner made (books_impl.h, sl_books_sees)? Its uid's, or it
 * is root or in --allow-group. What it may not see is refused as missing, word for word. */
static int m_sees(const struct model *m, uint64_t cid, uint64_t owner) {
  const struct m_client *c = &m->c[cid], *o = &m->c[owner];

  return m_live_client(m, cid) && (c->uid == o->uid || c->uid == 0 || c->gid == M_ALLOW_GID);
}

static int m_live_region(const struct model *m, uint64_t id) {
  return id >= 1 && id <= m->nregions && m->r[id].live;
}

static void m_loan_free(struct model *m) {
  struct m_loan *l = m->loan;

  if (l == NULL)
    return;
  free(l->kept);
  free(l->dev);
  free(l->host);
  free(l->host_of);
  free(l->order);
  free(l->owner_of);
  free(l->size_of);
  free(l);
  m->loan = NULL;
}

static void op_client_add(struct model *m) {
  static const uid_t uids[] = {1000, 1000, 1000, 2000, 0};
  struct m_client *c;

  if (m->nclients >= M_MAX)
    return;
  c = &m->c[++m->nclients];
  c->uid = uids[below(m, 5)];
  c->gid = below(m, 3) == 0 ? M_ALLOW_GID : c->uid;
  c->live = 1;
  CHECK_EQ(client(m->b, c->uid, c->gid), m->nclients);
}

static void op_region_add(struct model *m) {
  uint64_t cid = pick_client(m), npages = 1 + below(m, 12), id = 0;
  int want = m_live_client(m, cid) ? 0 : SUBLET_ENOENT;

  if (m->nregions >= M_MAX)
    return;
  CHECK_EQ(sl_books_region_add(m->b, cid, npages, &id, NULL), want);
  if (want != 0)
    return;
  CHECK_EQ(id, ++m->nregions);
  m->r[id] = (struct m_region){.owner = cid, .npages = npages, .live = 1};
}

static int m_region_lent(const struct model *m, uint64_t rid) {
  return m->loan != NULL && m->loan->region == rid;
}

static void op_region_remove(struct model *m) {
  uint64_t cid = pick_client(m), rid = 1 + below(m, m->nregions + 1);
  int want = 0;

  if (below(m, 2) && m_live_region(m, rid))
    cid = m->r[rid].owner;
  if (!m_live_region(m, rid) || !m_sees(m, cid, m->r[rid].owner))
    want = SUBLET_ENOENT;
  else if (m->r[rid].owner != cid)
    want = SUBLET_EPERM;
  else if (m_region_lent(m, rid))
    want = SUBLET_EBUSY;
  CHECK_EQ(sl_books_region_remove(m->b, cid, rid, NULL), want);
  if (want == 0)
    m->r[rid].live = 0;
}

/* Random keep ranges of a region of `bytes` bytes; one past the end when bad. */
static size_t random_keep(struct model *m, uint64_t bytes, struct sublet_range *v, int bad) {
  size_t n = below(m, 7);

  for (size_t i = 0; i < n; i++) {
    uint64_t off = below(m, bytes + 1);
    uint64_t len = below(m, 4) == 0 ? below(m, bytes - off + 1) : below(m, 3 * m->ps / 2 + 1);
    v[i] = (struct sublet_range){off, len <= bytes - off ? len : bytes - off};
  }
  if (bad)
    v[n++] = (struct sublet_range){below(m, bytes), bytes + 1};
  return n;
}

/* Compacting books lay a loan out in order unless it keeps exactly the region's head (its
 * unkept tail is served as it is): the kept zone is then every page, in the region's order. */
static void m_loan_in_order(const struct model *m, struct m_loan *l) {
  uint64_t n = l->u + l->k;

  if (!m->compact || (l->u > 0 && l->k > 0 && l->order[l->u] == 0 &&
                      l->order[l->u + l->k - 1] == l->k - 1))
    return;
  for (uint64_t p = 0; p < n; p++)
    l->order[p] = p;
  l->u = 0;
  l->k = n;
  l->in_order = 1;
}

static struct m_loan *m_loan_new(struct model *m, uint64_t rid, const struct sublet_range *keep,
                                 size_t n, int keep_all) {
  struct m_loan *l = calloc(1, sizeof(*l));
  uint64_t npages = m->r[rid].npages;

  l->ps = m->ps;
  l->bytes = npages * m->ps;
  l->kept = calloc(l->bytes, 1);
  l->host_of = calloc(l->bytes, sizeof(uint64_t));
  l->order = calloc(npages, sizeof(uint64_t));
  for (size_t i = 0; i < n; i++)
    memset(l->kept + keep[i].offset, 1, keep[i].length);
  if (keep_all)
    memset(l->kept, 1, l->bytes);
  l->dev = calloc(l->bytes, sizeof(uint32_t));
  l->host = calloc(l->bytes, sizeof(uint32_t));
  for (uint64_t x = 0; x < l->bytes; x++) {
    l->dev[x] = (uint32_t)(x + 1);
    l->kept_bytes += l->kept[x];
  }
  for (int pass = 0; pass < 2; pass++) {
    for (uint64_t p = 0; p < npages; p++) {
      if ((memchr(l->kept + p * m->ps, 1, m->ps) != NULL) != pass)
        continue;
      l->order[l->u + l->k] = p;
      *(pass ? &l->k : &l->u) += 1;
    }
  }
  l->holding = l->k;
  m_loan_in_order(m, l);
  return l;
}

static void op_lend(struct model *m) {
  uint64_t rid = 1 + below(m, m->nregions + 1), cid = pick_client(m), id = 0;
  struct m_loan *l;
  struct sublet_range keep[8];
  int bad = below(m, 20) == 0, keep_all = below(m, 10) == 0, want = 0;
  size_t n = 0;
  char name[8];
  uint8_t token[16];

  if (m_live_region(m, rid) && below(m, 4) != 0)
    cid = m->r[rid].owner;
  if (m_live_region(m, rid))
    n = random_keep(m, m->r[rid].npages * m->ps, keep, bad && !keep_all);
  snprintf(name, sizeof(name), "n%d", (int)below(m, 3));
  for (int i = 0; i < 16; i++)
    token[i] = (uint8_t)rnd(m);
  if (!m_live_region(m, rid) || !m_sees(m, cid, m->r[rid].owner))
    want = SUBLET_ENOENT;
  else if (m->r[rid].owner != cid)
    want = SUBLET_EPERM;
  else if (m->loan != NULL || (m->pending.nreplace > 0 && m->pending.region_id == rid))
    want = SUBLET_EBUSY;
  else if (bad && !keep_all)
    want = SUBLET_EINVAL;
  CHECK_EQ(sl_books_lend(m->b, cid, rid, keep, n, keep_all, name, token, &id, NULL), want);
  if (want != 0)
    return;
  l = m->loan = m_loan_new(m, rid, keep, n, keep_all);
  l->id = ++m->next_loan;
  l->region = rid;
  l->owner = cid;
  l->state = SL_LOAN_OFFERED;
  memcpy(l->name, name, sizeof(name));
  memcpy(l->token, token, sizeof(token));
  CHECK_EQ(id, l->id);
}

static void op_withdraw(struct model *m) {
  struct m_loan *l = m->loan;
  uint64_t cid = pick_client(m), lid = l != NULL && below(m, 8) ? l->id : m->next_loan + 1;
  int want = 0;

  if (l != NULL && below(m, 2))
    cid = l->owner;
  if (l == NULL || l->id != lid || !m_sees(m, cid, l->owner))
    want = SUBLET_ENOENT;
  else if (l->owner != cid)
    want = SUBLET_EPERM;
  else if (l->state != SL_LOAN_OFFERED)
    want = SUBLET_EBUSY;
  CHECK_EQ(sl_books_withdraw(m->b, cid, lid, NULL), want);
  if (want == 0)
    m_loan_free(m);
}

static uint64_t m_borrowing(const struct model *m, uint64_t cid) {
  const struct m_loan *l = m->loan;

  return l != NULL && l->state == SL_LOAN_ACTIVE && l->borrower == cid ? l->id : 0;
}

static int m_may_borrow(const struct model *m, uint64_t cid) {
  return m_sees(m, cid, m->loan->owner);
}

/* The books' answer to a borrow, by the rules of books.h. */
static int m_borrow_rc(const struct model *m, uint64_t cid, uint64_t lid, const uint8_t *token,
                       const char *name) {
  const struct m_loan *l = m->loan;

  if (!m_live_client(m, cid))
    return SUBLET_ENOENT;
  if (m_borrowing(m, cid))
    return SUBLET_EBUSY;
  if (lid != 0 && (l == NULL || l->id != lid))
    return SUBLET_ENOENT;
  /* another user's loan is a missing one, unless the caller holds its token */
  if (lid != 0 && !m_may_borrow(m, cid) && (token == NULL || memcmp(token, l->token, 16) != 0))
    return SUBLET_ENOENT;
  if (lid != 0 && token == NULL && l->owner != cid)
    return SUBLET_EPERM;
  if (lid != 0 && token != NULL && memcmp(token, l->token, 16) != 0)
    return SUBLET_EPERM;
  if (lid == 0 && name[0] != '\0' &&
      (l == NULL || strcmp(name, l->name) != 0 || !m_may_borrow(m, cid)))
    return SUBLET_ENOOFFER; /* another user's loan is none to a client that may not see it */
  if (lid == 0 && name[0] == '\0' && (l == NULL || l->state != SL_LOAN_OFFERED))
    return SUBLET_ENOOFFER;
  if (l->state != SL_LOAN_OFFERED)
    return SUBLET_EBUSY;
  if (m_may_borrow(m, cid))
    return 0;
  return lid == 0 ? SUBLET_ENOOFFER : SUBLET_EPERM; /* not on offer to it */
}

static void op_borrow(struct model *m) {
  struct m_loan *l = m->loan;
  uint64_t cid = pick_client(m), lid = 0, fresh = below(m, 5), got = 0, last;
  const uint8_t *token = NULL;
  const char *name = "";
  int mode = (int)below(m, 6), want;

  if (l != NULL && below(m, 3) == 0)
    cid = l->owner;
  if (mode <= 2)
    lid = l != NULL && below(m, 10) ? l->id : m->next_loan + 1;
  if (mode == 0 && l != NULL)
    token = l->token;
  if (mode == 1)
    token = WRONG;
  if (mode == 3)
    name = l != NULL && below(m, 4) ? l->name : "zz";
  want = m_borrow_rc(m, cid, lid, token, name);
  CHECK_EQ(sl_books_borrow(m->b, cid, lid, token, name, fresh, &got, NULL), want);
  if (want != 0)
    return;
  CHECK_EQ(got, l->id);
  l->state = SL_LOAN_ACTIVE;
  l->borrower = cid;
  /* the fresh zone of the region's last loan, unless the free memory fell below it or grew
   * by more than max(an eighth, 1024 pages) */
  last = m->r[l->region].last_fresh;
  l->f = last > 0 && fresh + M_GIVE >= last && fresh <= last + (last / 8 > 1024 ? last / 8 : 1024)
             ? last : fresh;
  m->r[l->region].last_fresh = l->f;
  l->lo = l->hwm = l->in_order ? l->f : 0; /* in order: from the kept zone's first page */
  l->owner_of = calloc(l->u + l->f + l->k + 1, sizeof(uint64_t));
  l->size_of = calloc(1, sizeof(uint64_t));
}

static uint64_t m_window(const struct m_loan *l) {
  return l->u + l->f + l->k;
}

/* First fit among positions [from, to), position by position: the position or UINT64_MAX. */
static uint64_t m_first_fit(const struct m_loan *l, uint64_t from, uint64_t to, uint64_t n) {
  uint64_t run = 0;

  for (uint64_t q = from; q < to; q++) {
    run = l->owner_of[q] ? 0 : run + 1;
    if (run == n)
      return q + 1 - n;
  }
  return UINT64_MAX;
}

/* Would reaching the kept zone up to window position end save bytes to the host? Compacting,
 * the host holds exactly what the unreached kept pages cannot (m_check_host_minimal). */
static int m_up_saves(const struct model *m, const struct m_loan *l, uint64_t end) {
  uint64_t ks = l->u + l->f, reached = end > ks ? end - ks : 0, room;

  if (!m->compact)
    return 1; /* not in order: the top is the only way anyway */
  room = (l->k - (reached > l->hwm - ks ? reached : l->hwm - ks)) * l->ps;
  return (l->kept_bytes > room ? l->kept_bytes - room : 0) > l->copied_out;
}

/* books.h: a gap in [lo, hwm); else the span grows at its top, unless that saves bytes and the
 * bottom can take the run without; a run over nothing live may cover the span both ways. */
static uint64_t m_place(const struct model *m, const struct m_loan *l, uint64_t n) {
  uint64_t w = m_window(l), top = l->hwm, bottom = l->lo, up = UINT64_MAX, down = UINT64_MAX;
  uint64_t pos = m_first_fit(l, l->lo, l->hwm, n);

  if (pos != UINT64_MAX)
    return pos;
  while (top > l->lo && !l->owner_of[top - 1])
    top--;
  while (bottom < l->hwm && !l->owner_of[bottom])
    bottom++;
  if (w - top >= n)
    up = top;
  if (bottom >= n)
    down = bottom - n;
  else if (top == l->lo && w >= n) /* nothing live */
    down = 0;
  if (up != UINT64_MAX && (down == UINT64_MAX || !m_up_saves(m, l, up + n)))
    return up;
  return down;
}

static int m_alloc_rc(const struct model *m, uint64_t cid, uint64_t size, uint64_t *pos) {
  const struct m_loan *l = m->loan;

  if (!m_live_client(m, cid))
    return SUBLET_ENOENT;
  if (!m_borrowing(m, cid))
    return l != NULL && l->owner == cid ? SUBLET_EPERM : SUBLET_ENOENT;
  if (l->owner_gone)
    return SUBLET_EOWNERGONE;
  if (size == 0)
    return SUBLET_EINVAL;
  *pos = m_place(m, l, (size + m->ps - 1) / m->ps);
  return *pos == UINT64_MAX ? SUBLET_ENOMEM : 0;
}

/* The saves must be exactly the kept bytes of the newly reached kept pages, in position order,
 * packed from copied_out in host memory, and coalesced. */
static void m_check_saves(const struct model *m, const struct sl_grant *g, uint64_t lo,
                          uint64_t hi) {
  const struct m_loan *l = m->loan;
  uint8_t *want = calloc(l->bytes, 1);
  uint64_t expected = 0, host = l->copied_out, wrong = 0;

  for (uint64_t q = lo > l->u + l->f ? lo : l->u + l->f; q < hi; q++) {
    uint64_t p = l->order[l->u + (q - l->u - l->f)];
    for (uint64_t x = p * l->ps; x < (p + 1) * l->ps; x++)
      expected += want[x] = l->kept[x];
  }
  for (size_t i = 0; i < g->nsave; i++) {
    const struct sl_copy *c = &g->save[i];
    CHECK(c->len > 0 && c->dev_off + c->len <= l->bytes);
    CHECK_EQ(c->host_off, host);
    if (i > 0)
      CHECK(g->save[i - 1].dev_off + g->save[i - 1].len < c->dev_off);
    for (uint64_t x = c->dev_off; x < c->dev_off + c->len && x < l->bytes; x++) {
      wrong += want[x] != 1; /* not kept, not newly reached, or saved twice */
      want[x] = 2;
    }
    host += c->len;
  }
  CHECK_EQ(wrong, 0);
  CHECK_EQ(host - l->copied_out, expected);
  CHECK_EQ(g->save_bytes, expected);
  free(want);
}

/* Compacting: saves are packed from copied_out; moves take bytes of the pages now reached
 * into unkept bytes of kept pages (where they lead is proven by the restore at the end). */
static void m_check_packed(const struct model *m, const struct sl_grant *g) {
  const struct m_loan *l = m->loan;
  uint64_t host = l->copied_out, moved = 0, wrong = 0;

  for (size_t i = 0; i < g->nsave; i++) {
    CHECK_EQ(g->save[i].host_off, host);
    CHECK(g->save[i].len > 0 && g->save[i].dev_off + g->save[i].len <= l->bytes);
    host += g->save[i].len;
  }
  for (size_t i = 0; i < g->nmove; i++) {
    const struct sl_move *mv = &g->move[i];
    CHECK(mv->len > 0 && mv->src_off + mv->len <= l->bytes && mv->dst_off + mv->len <= l->bytes);
    for (uint64_t x = 0; x < mv->len && mv->dst_off + x < l->bytes; x++)
      wrong += l->kept[mv->dst_off + x] || !l->kept[mv->src_off + x];
    moved += mv->len;
  }
  CHECK_EQ(wrong, 0);
  CHECK_EQ(host - l->copied_out, g->save_bytes);
  CHECK_EQ(moved, g->move_bytes);
}

/* The grant's device work, as the daemon does it: moves, then saves. A failed grant may have
 * done any part of it (stop < 1: a random prefix of each list), which must be harmless. */
static void m_device_work(struct model *m, const struct sl_grant *g, int whole) {
  struct m_loan *l = m->loan;
  size_t nmove = whole ? g->nmove : below(m, g->nmove + 1);
  size_t nsave = whole ? g->nsave : below(m, g->nsave + 1);

  for (size_t i = 0; i < nmove; i++)
    memmove(&l->dev[g->move[i].dst_off], &l->dev[g->move[i].src_off],
            g->move[i].len * sizeof(uint32_t));
  for (size_t i = 0; i < nsave; i++)
    memcpy(&l->host[g->save[i].host_off], &l->dev[g->save[i].dev_off],
           g->save[i].len * sizeof(uint32_t));
}

/* The borrower writes every byte of every region page it holds. */
static void m_scribble(struct m_loan *l) {
  for (uint64_t q = 0; q < l->hwm; q++) {
    uint64_t i = q < l->u ? q : q >= l->u + l->f ? q - l->f : UINT64_MAX;
    if (i != UINT64_MAX)
      memset(&l->dev[l->order[i] * l->ps], 0, l->ps * sizeof(uint32_t));
  }
}

/* Compacting: the host holds only what the unlent kept pages cannot, max(0, kept - room). */
static void m_check_host_minimal(const struct m_loan *l) {
  uint64_t ks = l->u + l->f, reached = l->hwm > ks ? l->hwm - ks : 0;
  uint64_t room = (l->k - reached) * l->ps;

  CHECK_EQ(l->copied_out, l->kept_bytes > room ? l->kept_bytes - room : 0);
}

static void m_check_grant(const struct model *m, const struct sl_grant *g, uint64_t pos,
                          uint64_t n) {
  const struct m_loan *l = m->loan;
  uint64_t lo = pos > l->hwm ? pos : l->hwm, hi = pos + n;
  uint64_t flo = lo > l->u ? lo : l->u, fhi = hi < l->u + l->f ? hi : l->u + l->f;
  uint64_t by_zone[3] = {0};

  if (pos < l->lo) { /* grown at the bottom: in order, fresh positions below lo */
    flo = pos;
    fhi = hi < l->lo ? hi : l->lo;
  }

  CHECK_EQ(g->pos, pos);
  CHECK_EQ(g->npages, n);
  CHECK_EQ(g->alloc_id, m->next_alloc);
  CHECK_EQ(g->fresh_chunk_id, fhi > flo ? m->next_chunk : 0);
  CHECK_EQ(g->fresh_npages, fhi > flo ? fhi - flo : 0);
  if (fhi > flo)
    CHECK_EQ(g->fresh_pos, flo);
  for (uint64_t q = pos; q < hi; q++) {
    int z = q < l->u ? 0 : q < l->u + l->f ? 1 : 2;
    uint64_t p = z == 2 ? l->order[l->u + q - l->u - l->f] : 0;
    if (z == 2 && memchr(l->kept + p * m->ps, 1, m->ps) == NULL)
      z = 0; /* a page of the kept zone that holds no kept byte */
    by_zone[z] += m->ps;
  }
  for (int z = 0; z < 3; z++)
    CHECK_EQ(g->served[z], by_zone[z]);
  if (m->compact)
    m_check_packed(m, g);
  else
    m_check_saves(m, g, lo, hi);
}

static void m_apply_grant(struct model *m, const struct sl_grant *g) {
  struct m_loan *l = m->loan;
  uint64_t *sizes = realloc(l->size_of, (g->alloc_id + 1) * sizeof(uint64_t));

  l->size_of = sizes; /* indexed by alloc id; only live ids are read */
  sizes[g->alloc_id] = g->size;
  for (uint64_t q = g->pos; q < g->pos + g->npages; q++)
    l->owner_of[q] = g->alloc_id;
  for (size_t i = 0; i < g->nsave && !m->compact; i++)
    for (uint64_t x = 0; x < g->save[i].len; x++)
      l->host_of[g->save[i].dev_off + x] = 1 + g->save[i].host_off + x;
  if (g->pos + g->npages > l->hwm)
    l->hwm = g->pos + g->npages;
  if (g->pos < l->lo)
    l->lo = g->pos;
  l->moved += g->move_bytes;
  l->chunk_pages += g->fresh_npages;
  l->copied_out += g->save_bytes;
  m->copied_out += g->save_bytes;
  if (m->compact) {
    m_scribble(l);
    m_check_host_minimal(l);
  }
  l->nallocs++;
  m->next_alloc++;
  m->next_chunk += g->fresh_chunk_id != 0;
}

static void op_alloc(struct model *m) {
  uint64_t cid = pick_client(m), pos = 0, size;
  uint64_t window = m->loan != NULL ? m_window(m->loan) : 1;
  struct sl_grant g;
  int want;

  if (m->loan != NULL && m->loan->state == SL_LOAN_ACTIVE && below(m, 8) != 0)
    cid = m->loan->borrower;
  size = below(m, 5) == 0 ? below(m, (window + 1) * m->ps + 1) : 1 + below(m, 3 * m->ps / 2);
  want = m_alloc_rc(m, cid, size, &pos);
  CHECK_EQ(sl_books_alloc_plan(m->b, cid, size, &g, NULL), want);
  if (want != 0)
    return;
  m_check_grant(m, &g, pos, (size + m->ps - 1) / m->ps);
  if (below(m, 10) != 0) { /* otherwise the device work "failed": nothing is committed */
    m_device_work(m, &g, 1);
    CHECK_EQ(sl_books_alloc_commit(m->b, &g), 0);
    m_apply_grant(m, &g);
  } else {
    m_device_work(m, &g, 0); /* stopped midway (an error, a death): must be harmless */
  }
  sl_grant_clear(&g);
}

/* A live alloc id of the loan, or some id that is not live. */
static uint64_t m_pick_alloc(struct model *m) {
  const struct m_loan *l = m->loan;
  uint64_t w = l != NULL && l->owner_of != NULL ? m_window(l) : 0;

  if (w > 0 && below(m, 8) != 0) {
    uint64_t start = below(m, w);
    for (uint64_t i = 0; i < w; i++)
      if (l->owner_of[(start + i) % w] != 0)
        return l->owner_of[(start + i) % w];
  }
  return below(m, m->next_alloc + 2);
}

static int m_alloc_live(const struct m_loan *l, uint64_t id) {
  for (uint64_t q = 0; l != NULL && l->owner_of != NULL && q < m_window(l); q++)
    if (id != 0 && l->owner_of[q] == id)
      return 1;
  return 0;
}

static void op_free(struct model *m) {
  struct m_loan *l = m->loan;
  uint64_t cid = pick_client(m), aid = m_pick_alloc(m), size = 0;
  int want = 0;

  if (l != NULL && l->state == SL_LOAN_ACTIVE && below(m, 6) != 0)
    cid = l->borrower;
  if (!m_live_client(m, cid) || !m_alloc_live(l, aid) ||
      (l->borrower != cid && !m_sees(m, cid, l->owner)))
    want = SUBLET_ENOENT;
  else if (l->borrower != cid)
    want = SUBLET_EPERM;
  CHECK_EQ(sl_books_free_alloc(m->b, cid, aid, &size, NULL), want);
  if (want != 0)
    return;
  CHECK_EQ(size, l->size_of[aid]);
  for (uint64_t q = 0; q < m_window(l); q++)
    if (l->owner_of[q] == aid)
      l->owner_of[q] = 0;
  l->nallocs--;
}

/* Compacting: restoring, then moving back, gives every kept byte its value, whatever the
 * borrower wrote; nothing when the owner is gone. */
static void m_check_end_compact(struct model *m, const struct sl_loan_end *end) {
  struct m_loan *l = m->loan;
  uint64_t wrong = 0, restored = 0;

  CHECK_EQ(end->stats.moved_bytes, l->moved);
  CHECK_EQ(end->stats.copied_out_bytes, l->copied_out);
  CHECK_EQ(end->stats.copied_in_bytes, l->owner_gone ? 0 : l->copied_out);
  if (l->owner_gone) {
    CHECK_EQ(end->nrestore + end->nunmove, 0);
    return;
  }
  for (size_t i = 0; i < end->nrestore; i++) {
    memcpy(&l->dev[end->restore[i].dev_off], &l->host[end->restore[i].host_off],
           end->restore[i].len * sizeof(uint32_t));
    restored += end->restore[i].len;
  }
  for (size_t i = 0; i < end->nunmove; i++)
    memmove(&l->dev[end->unmove[i].dst_off], &l->dev[end->unmove[i].src_off],
            end->unmove[i].len * sizeof(uint32_t));
  for (uint64_t x = 0; x < l->bytes; x++)
    wrong += l->kept[x] && l->dev[x] != (uint32_t)(x + 1);
  CHECK_EQ(wrong, 0);
  CHECK_EQ(restored, l->copied_out);
}

/* The restore list: every saved byte back to where it came from, coalesced, or nothing when
 * the owner is gone. */
static void m_check_end(struct model *m, const struct sl_loan_end *end) {
  const struct m_loan *l = m->loan;
  uint64_t restored = 0, saved = 0, wrong = 0;

  if (m->compact) {
    m_check_end_compact(m, end);
    return;
  }
  CHECK_EQ(end->loan_id, l->id);
  CHECK_EQ(end->region_id, l->region);
  CHECK_EQ(end->free_region, l->owner_gone);
  CHECK_EQ(end->stats.copied_out_bytes, l->copied_out);
  CHECK_EQ(end->stats.copied_in_bytes, l->owner_gone ? 0 : l->copied_out);
  CHECK_EQ(end->stats.borrower_died, l->state == SL_LOAN_DRAINING);
  for (uint64_t x = 0; x < l->bytes; x++)
    saved += l->host_of[x] != 0;
  CHECK_EQ(saved, l->copied_out);
  for (size_t i = 0; i < end->nrestore; i++) {
    const struct sl_copy *c = &end->restore[i];
    for (uint64_t x = 0; x < c->len && c->dev_off + x < l->bytes; x++)
      wrong += l->host_of[c->dev_off + x] != 1 + c->host_off + x;
    if (i > 0)
      CHECK(end->restore[i - 1].dev_off + end->restore[i - 1].len < c->dev_off);
    restored += c->len;
  }
  CHECK_EQ(wrong, 0);
  CHECK_EQ(restored, l->owner_gone ? 0 : l->copied_out);
  for (size_t i = 1; i < end->nfresh; i++)
    CHECK(end->fresh_chunks[i] > end->fresh_chunks[i - 1]);
  CHECK_EQ(end->nfresh == 0, l->chunk_pages == 0);
}

/* A borrower of another user gets every page it was granted replaced: the region pages at
 * window positions below hwm, ascending; one of the owner's user, none. */
static void m_check_replace(const struct model *m, const struct sl_loan_end *end) {
  const struct m_loan *l = m->loan;
  uint8_t *want = calloc(l->bytes / l->ps + 1, 1);
  uint64_t n = 0, wrong = 0;

  if (want == NULL)
    abort();
  for (uint64_t q = 0; q < l->hwm; q++) {
    if (q >= l->u && q < l->u + l->f)
      continue; /* fresh memory: not the owner's */
    want[l->order[q < l->u ? q : q - l->f]] = 1;
  }
  if (l->owner_gone || m->c[l->borrower].uid == m->c[l->owner].uid)
    memset(want, 0, l->bytes / l->ps + 1);
  for (uint64_t p = 0; p < l->bytes / l->ps; p++)
    n += want[p];
  for (size_t i = 0; i < end->nreplace && i < n; i++)
    wrong += end->replace[i] >= l->bytes / l->ps || !want[end->replace[i]] ||
             (i > 0 && end->replace[i] <= end->replace[i - 1]);
  free(want);
  CHECK_EQ(end->nreplace, n);
  CHECK_EQ(wrong, 0);
}

/* The daemon's fresh pages for an end are made; sometimes they could not be (none then). */
static void m_replaced(struct model *m) {
  struct sl_loan_end *e = &m->pending;
  size_t n = below(m, 4) == 0 ? 0 : e->nreplace;

  if (e->nreplace == 0)
    return;
  sl_books_pages_replaced(m->b, e, n);
  if (m_live_region(m, e->region_id))
    m->r[e->region_id].pages_version += n > 0;
  if (m_live_client(m, e->borrower_client))
    m->c[e->borrower_client].retained += n;
  m->replaced += n;
  sl_loan_end_clear(e);
}

static void op_replaced(struct model *m) {
  m_replaced(m);
}

/* The end's device work: the fresh pages may take a while (op_replaced). */
static void m_end_replace(struct model *m, struct sl_loan_end *end) {
  m_check_replace(m, end);
  if (end->nreplace == 0)
    return;
  m_replaced(m);
  m->pending = *end; /* the model owns its arrays now */
  memset(end, 0, sizeof(*end));
  if (below(m, 2) == 0)
    m_replaced(m);
}

static void m_end_loan(struct model *m) {
  struct m_loan *l = m->loan;

  if (l->owner_gone)
    m->r[l->region].live = 0;
  else
    m->copied_in += l->copied_out;
  m->loans_ended++;
  m_loan_free(m);
}

static void op_return(struct model *m) {
  struct m_loan *l = m->loan;
  uint64_t cid = pick_client(m);
  int force = (int)below(m, 2), want = 0;
  struct sl_loan_end end;

  if (l != NULL && l->state == SL_LOAN_ACTIVE && below(m, 3) == 0)
    cid = l->borrower; /* not too often: loans should live long enough to fill up */
  if (!m_live_client(m, cid))
    want = SUBLET_ENOENT;
  else if (!m_borrowing(m, cid))
    want = l != NULL && l->owner == cid ? SUBLET_EPERM : SUBLET_ENOENT;
  else if (l->nallocs > 0)
    want = SUBLET_ELEAK;
  CHECK_EQ(sl_books_return(m->b, cid, force, &end, NULL), want);
  if (want == 0 || (want == SUBLET_ELEAK && force)) {
    m_check_end(m, &end);
    m_end_replace(m, &end);
    m_end_loan(m);
  }
  sl_loan_end_clear(&end);
}

static void op_finish(struct model *m) {
  struct m_loan *l = m->loan;
  uint64_t lid = l != NULL && below(m, 8) ? l->id : m->next_loan + 1;
  int want = 0;
  struct sl_loan_end end;

  if (l == NULL || l->id != lid)
    want = SUBLET_ENOENT;
  else if (l->state != SL_LOAN_DRAINING)
    want = SUBLET_EBUSY;
  CHECK_EQ(sl_books_loan_finish(m->b, lid, &end), want);
  if (want == 0) {
    m_check_end(m, &end);
    m_end_replace(m, &end);
    m_end_loan(m);
  }
  sl_loan_end_clear(&end);
}

/* What the loan does when client cid leaves; fills the expected draining id. */
static void m_loan_drop_client(struct model *m, uint64_t cid, uint64_t *draining) {
  struct m_loan *l = m->loan;

  if (l == NULL)
    return;
  if (l->state == SL_LOAN_OFFERED && l->owner == cid) {
    m_loan_free(m);
    return;
  }
  if (l->state == SL_LOAN_ACTIVE && l->borrower == cid) {
    l->state = SL_LOAN_DRAINING;
    memset(l->owner_of, 0, m_window(l) * sizeof(uint64_t));
    l->nallocs = 0;
    m->died++;
    *draining = l->id;
  }
  if (l->owner == cid)
    l->owner_gone = 1;
}

static void op_client_remove(struct model *m) {
  uint64_t cid = pick_client(m), draining = 0;
  int want = m_live_client(m, cid) ? 0 : SUBLET_ENOENT;
  struct sl_client_gone gone;
  size_t nfree = 0;

  CHECK_EQ(sl_books_client_remove(m->b, cid, &gone), want);
  if (want != 0)
    return;
  m->c[cid].live = 0;
  m->c[cid].retained = 0; /* counted until it disconnects */
  m_loan_drop_client(m, cid, &draining);
  for (uint64_t rid = 1; rid <= m->nregions; rid++) {
    if (!m->r[rid].live || m->r[rid].owner != cid || m_region_lent(m, rid))
      continue;
    CHECK(nfree < gone.nfree_regions && gone.free_regions[nfree] == rid);
    nfree++;
    m->r[rid].live = 0;
  }
  CHECK_EQ(gone.nfree_regions, nfree);
  CHECK_EQ(gone.ndraining, draining != 0);
  if (gone.ndraining)
    CHECK_EQ(gone.draining_loans[0], draining);
  sl_client_gone_clear(&gone);
}

static void m_compare_loan(const struct model *m) {
  const struct m_loan *l = m->loan;
  struct sl_loan_info li = info(m->b, l->id);
  const uint64_t *pages = NULL;
  uint64_t live = 0, misplaced = 0, zone_u = 0, zone_k = 0;

  CHECK_EQ(li.state, l->state);
  CHECK_EQ(li.region_id, l->region);
  CHECK_EQ(li.owner_client, l->owner);
  CHECK_EQ(li.borrower_client, l->borrower);
  CHECK_EQ(li.owner_gone, l->owner_gone);
  CHECK_EQ(li.unkept_pages, l->u + l->k - l->holding);
  CHECK_EQ(li.fresh_pages, l->f);
  CHECK_EQ(li.kept_pages, l->holding);
  CHECK_EQ(li.lo, l->lo);
  CHECK_EQ(li.hwm, l->hwm);
  CHECK_EQ(li.live_allocs, l->nallocs);
  CHECK_EQ(li.fresh_chunk_pages, l->chunk_pages);
  CHECK_EQ(li.stats.copied_out_bytes, l->copied_out);
  CHECK_EQ(li.stats.moved_bytes, l->moved);
  for (uint64_t q = 0; l->owner_of != NULL && q < m_window(l); q++)
    live += l->owner_of[q] != 0;
  CHECK_EQ(li.live_bytes, live * m->ps);
  CHECK_EQ(sl_books_leaks(m->b, l->id, NULL, 0), l->nallocs);
  CHECK_EQ(sl_books_loan_layout(m->b, l->id, &pages, &zone_u, NULL, &zone_k), 0);
  CHECK_EQ(zone_u, l->u);
  CHECK_EQ(zone_k, l->k);
  for (uint64_t i = 0; pages != NULL && i < l->u + l->k; i++)
    misplaced += pages[i] != l->order[i];
  CHECK_EQ(misplaced, 0);
}

static size_t count_retaining(const struct model *m) {
  size_t n = 0;

  for (uint64_t id = 1; id <= m->nclients; id++)
    n += m->c[id].live && m->c[id].retained > 0;
  return n;
}

static void m_compare(const struct model *m) {
  struct sl_books_totals t;
  struct sl_region_info ri;
  uint64_t clients = 0, regions = 0, pages = 0, wrong = 0, retained = 0;

  BOOKS_OK(m->b);
  for (uint64_t id = 1; id <= m->nclients; id++) {
    clients += m->c[id].live;
    retained += m->c[id].retained;
    wrong += m->c[id].live && sl_books_client_loan(m->b, id) != m_borrowing(m, id);
  }
  for (uint64_t id = 1; id <= m->nregions; id++) {
    int rc = sl_books_region_info(m->b, id, &ri);
    wrong += rc != (m->r[id].live ? 0 : SUBLET_ENOENT);
    wrong += rc == 0 && ri.loan_id != (m_region_lent(m, id) ? m->loan->id : 0);
    wrong += rc == 0 && (ri.owner_client != m->r[id].owner || ri.npages != m->r[id].npages);
    wrong += rc == 0 && ri.pages_version != m->r[id].pages_version;
    wrong += rc == 0 && ri.replacing != (m->pending.nreplace > 0 && m->pending.region_id == id);
    regions += m->r[id].live;
    pages += m->r[id].live ? m->r[id].npages : 0;
  }
  CHECK_EQ(wrong, 0);
  sl_books_totals(m->b, &t);
  CHECK_EQ(t.clients, clients);
  CHECK_EQ(t.regions, regions);
  CHECK_EQ(t.region_pages, pages);
  CHECK_EQ(t.loans, m->loan != NULL);
  CHECK_EQ(t.loans_ended, m->loans_ended);
  CHECK_EQ(t.borrowers_died, m->died);
  CHECK_EQ(t.copied_out_bytes, m->copied_out);
  CHECK_EQ(t.copied_in_bytes, m->copied_in);
  CHECK_EQ(t.replaced_pages, m->replaced);
  CHECK_EQ(t.retained_pages, retained);
  CHECK_EQ(sl_books_retained(m->b, NULL, 0), count_retaining(m));
  CHECK_EQ(sl_books_current_loan(m->b), m->loan != NULL ? m->loan->id : 0);
  if (m->loan != NULL)
    m_compare_loan(m);
}

static void run_model(uint64_t seed, uint64_t page_size, int steps, int compact) {
  static void (*const ops[])(struct model *) = {
      op_client_add, op_client_remove, op_region_add, op_region_add, op_region_remove,
      op_lend, op_lend, op_lend, op_withdraw, op_borrow, op_borrow, op_borrow, op_borrow,
      op_alloc, op_alloc, op_alloc, op_alloc, op_alloc, op_alloc, op_alloc, op_alloc, op_free,
      op_free, op_free, op_free, op_free, op_return, op_return, op_finish, op_finish,
      op_replaced};
  struct model *m = calloc(1, sizeof(*m));
  int before = check_failed;

  struct sl_books_config cfg = {.page_size = page_size, .no_compact = !compact,
                                .fresh_give = M_GIVE};

  allow_gid = M_ALLOW_GID; /* client() marks its peers trusted as the daemon would */
  if (sl_books_new(&cfg, &m->b) != 0)
    abort();
  m->compact = compact;
  m->ps = page_size;
  m->rng = seed;
  m->next_alloc = m->next_chunk = 1;
  for (int i = 0; i < 4; i++)
    op_client_add(m);
  for (int step = 0; step < steps && check_failed - before < 5; step++) {
    ops[below(m, sizeof(ops) / sizeof(ops[0]))](m);
    m_compare(m);
    if (check_failed > before)
      fprintf(stderr, "    model run seed %" PRIu64 " page size %" PRIu64 "%s: step %d\n",
              seed, page_size, compact ? " (compacting)" : "", step);
  }
  CHECK(m->replaced > 0); /* the runs do reach loans to other users that end */
  m_loan_free(m);
  sl_loan_end_clear(&m->pending);
  sl_books_free(m->b);
  free(m);
}

static void test_random_sequences(void) {
  static const uint64_t page_sizes[] = {4096, 64, 3, 1, 512};

  for (uint64_t seed = 1; seed <= 10; seed++) {
    run_model(seed * 0x9e3779b97f4a7c15ull, page_sizes[seed % 5], 10000, 0);
    run_model(seed * 0x9e3779b97f4a7c15ull + 1, page_sizes[seed % 5], 10000, 1);
  }
}

/* ---- scale ---------------------------------------------------------------------------------- */

static double now(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A 100 GiB region of 2 MiB pages with 200,000 scattered 64 KiB keep ranges (a paged KV cache
 * with a third of its blocks live) lends in well under a second, and the whole window's saves
 * add up to the kept bytes. */
/* 100 GiB keeping 200,000 scattered 64 KiB blocks, its whole window allocated in 100 steps:
 * saving only, or compacting (each step moves kept bytes into the holes of the last pages, and
 * reaching those saves them: the host gets every kept byte exactly once either way). */
static void test_large_keep(int compact) {
  const uint64_t ps = 2 * MiB, npages = 51200, block = 64 * 1024, n = 200000;
  struct sl_books_config cfg = {.page_size = ps,
                                .no_compact = !compact};
  struct sl_books *b = NULL;
  uint64_t owner, r, loan = 0, saved = 0, moved = 0, nmoves = 0;
  uint64_t seed = 12345, nblocks = npages * ps / block;
  struct sublet_range *keep = malloc(n * sizeof(*keep));
  struct sl_loan_info li;
  struct sl_grant g;
  double t0, lend_s, alloc_s;

  if (sl_books_new(&cfg, &b) != 0)
    abort();
  owner = client(b, 1000, 1000);
  r = region(b, owner, npages);
  for (uint64_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    keep[i] = (struct sublet_range){(seed >> 20) % nblocks * block, block};
  }
  t0 = now();
  CHECK_EQ(sl_books_lend(b, owner, r, keep, n, 0, NULL, TOKEN, &loan, NULL), 0);
  lend_s = now() - t0;
  CHECK(lend_s < 1.0);
  li = info(b, loan);
  CHECK(li.kept_bytes > 0 && li.kept_bytes <= n * block);
  CHECK_EQ(li.unkept_pages + li.kept_pages, npages);
  borrow(b, owner, loan, 0);
  t0 = now();
  for (int i = 0; i < 100; i++) {
    CHECK_EQ(sl_books_alloc_plan(b, owner, npages / 100 * ps, &g, NULL), 0);
    CHECK_EQ(sl_books_alloc_commit(b, &g), 0);
    saved += g.save_bytes;
    moved += g.move_bytes;
    nmoves += g.nmove;
    sl_grant_clear(&g);
  }
  alloc_s = now() - t0;
  CHECK(alloc_s < 1.0);
  CHECK_EQ(saved, li.kept_bytes);
  CHECK_EQ(info(b, loan).stats.copied_out_bytes, li.kept_bytes);
  CHECK_EQ(moved > 0, compact);
  BOOKS_OK(b);
  printf("books%s: lend of %" PRIu64 " keep ranges over %" PRIu64 " pages: %.3f s; "
         "allocating the whole window: %.3f s (%" PRIu64 " moves, %.1f GiB moved)\n",
         compact ? " (compacting)" : "", n, npages, lend_s, alloc_s, nmoves,
         (double)moved / (1024.0 * MiB));
  free(keep);
  sl_books_free(b);
}

/* A borrower gets fds only of pages it was granted: a kept page not yet saved stays out of its
 * reach; the owner may have any. */
static void test_pages_granted(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), user = client(b, 1000, 1000);
  struct sublet_range keep[] = {{0, PS}, {3 * PS, PS}}; /* pages 0 and 3 kept */
  uint64_t r = region(b, owner, 4);
  uint64_t loan = lend(b, owner, r, keep, 2);
  struct sl_grant g;
  struct sl_err err = {0};

  borrow(b, user, loan, 1);
  CHECK_EQ(sl_books_pages_granted(b, owner, r, 0, 4, &err), 0);
  CHECK_EQ(sl_books_pages_granted(b, user, r, 1, 1, &err), SUBLET_EPERM); /* nothing yet */
  CHECK_MSG(err, "not granted");
  alloc(b, user, 2 * PS, &g); /* unkept pages 1 and 2 */
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_pages_granted(b, user, r, 1, 2, &err), 0);
  CHECK_EQ(sl_books_pages_granted(b, user, r, 0, 1, &err), SUBLET_EPERM); /* kept, unsaved */
  CHECK_EQ(sl_books_pages_granted(b, user, r, 3, 2, &err), SUBLET_EINVAL); /* past the end */
  /* first + count wraps around to a granted page: refused, the owner's asking too */
  CHECK_EQ(sl_books_pages_granted(b, user, r, UINT64_MAX, 3, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_pages_granted(b, user, r, 1, UINT64_MAX, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_pages_granted(b, owner, r, UINT64_MAX - 1, 4, &err), SUBLET_EINVAL);
  CHECK_EQ(sl_books_pages_granted(b, owner, r, 0, 0, &err), SUBLET_EINVAL);
  alloc(b, user, 2 * PS, &g); /* the fresh page, then kept page 0 (saved first) */
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_pages_granted(b, user, r, 0, 1, &err), 0);
  CHECK_EQ(sl_books_pages_granted(b, user, r, 3, 1, &err), SUBLET_EPERM);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* ---- pinned pages ------------------------------------------------------------------------- */

static uint64_t lend_pinned(struct sl_books *b, uint64_t owner, uint64_t rid,
                            const struct sublet_range *keep, size_t n, const uint64_t *pinned,
                            size_t npinned) {
  uint64_t id = 0;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_lend_pinned(b, owner, rid, keep, n, 0, pinned, npinned, "test", TOKEN, &id,
                                &err), 0);
  return id;
}

/* A pool's arena of 10 pages: "w" in pages 0-2 and 7 (pinned), "kv" in 3-6 sharing pages 3
 * and 6 with kept bytes of another tag, 8-9 free (lent). The window is the other 6 pages; a
 * borrower asking for all memory gets them and the fresh ones, never a pinned page, and
 * reaching kept page 3 moves its bytes into page 6's holes, never into a pinned page. */
static void test_pinned_layout_and_grants(void) {
  struct sl_books_config cfg = {.page_size = 64}; /* compacting: the plan moves kept bytes */
  struct sl_books *b = NULL;
  uint64_t owner, user, r, loan, fresh = 2;
  const uint64_t pinned[] = {0, 3, 7, 1}, unkept[] = {4, 5, 8, 9}, kept[] = {3, 6};
  struct sublet_range keep[] = {{3 * 64, 4}, {6 * 64 + 60, 4}};
  struct sl_loan_end end;
  struct sl_grant g;
  struct sl_err err = {0};

  CHECK_EQ(sl_books_new(&cfg, &b), 0);
  owner = client(b, 1000, 1000);
  user = client(b, 0, 0); /* another user: its granted pages are replaced at the end */
  r = region(b, owner, 10);
  loan = lend_pinned(b, owner, r, keep, 2, pinned, 2);
  check_layout(b, loan, unkept, 4, kept, 2);
  CHECK_EQ(info(b, loan).pinned_pages, 4);
  BOOKS_OK(b);
  borrow(b, user, loan, fresh);
  CHECK_EQ(info(b, loan).unkept_pages + info(b, loan).fresh_pages + info(b, loan).kept_pages,
           6 + fresh);
  /* U + F, then kept page 3: its bytes move into page 6's holes */
  alloc(b, user, (4 + fresh + 1) * 64, &g);
  CHECK_EQ(g.nmove, 1);
  CHECK(g.nmove == 1 && g.move[0].src_off / 64 == 3 && g.move[0].dst_off / 64 == 6);
  CHECK_EQ(g.nsave, 0);
  sl_grant_clear(&g);
  /* The rest: the loan is full after U + F + K pages, 4 short of the region and the fresh. */
  alloc(b, user, 64, &g);
  for (size_t i = 0; i < g.nsave; i++)
    CHECK_EQ(g.save[i].dev_off / 64, 6);
  CHECK_EQ(g.nmove, 0);
  sl_grant_clear(&g);
  CHECK_EQ(sl_books_alloc_plan(b, user, 1, &g, &err), SUBLET_ENOMEM);
  BOOKS_OK(b);
  for (uint64_t p = 0; p < 10; p++) /* the borrower may have fds of granted pages only */
    CHECK_EQ(sl_books_pages_granted(b, user, r, p, 1, NULL),
             p < 3 || p == 7 ? SUBLET_EPERM : 0);
  CHECK_EQ(sl_books_pages_granted(b, owner, r, 0, 10, NULL), 0);
  CHECK_EQ(sl_books_return(b, user, 1, &end, NULL), SUBLET_ELEAK);
  for (size_t i = 0; i < end.nreplace; i++) /* another user: its granted pages only */
    CHECK(end.replace[i] >= 3 && end.replace[i] != 7);
  CHECK_EQ(end.nreplace, 6);
  for (size_t i = 0; i < end.nrestore; i++) /* the restore, too, touches kept pages only */
    CHECK_EQ(end.restore[i].dev_off / 64, 6);
  CHECK(end.nunmove == 1 && end.unmove[0].dst_off / 64 == 3);
  sl_books_pages_replaced(b, &end, end.nreplace);
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* keep and pinned are disjoint by page; keep_all keeps the unpinned pages whole. */
static void test_pinned_refusals(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), r = region(b, owner, 8), loan = 0;
  const uint64_t pinned[] = {2, 2, 6, 1}, all_kept[] = {0, 1, 4, 5, 7};
  const uint64_t bad[][4] = {{3, 1, 2, 1}, {2, 2, 3, 1}, {2, 0, 0, 0}, {8, 1, 0, 0},
                             {7, 2, 0, 0}, {UINT64_MAX, 2, 0, 0}, {0, 8, 0, 0}};
  const char *why[] = {"pinned pair 1 (first page 2, 1 pages) is out of order",
                       "pinned pair 1 (first page 3, 1 pages) is out of order",
                       "pinned pair 0 (first page 2, 0 pages) is empty",
                       "pinned pair 0 (first page 8, 1 pages) is not within",
                       "pinned pair 0 (first page 7, 2 pages) is not within",
                       "is not within", "every page of the region is pinned"};
  struct sublet_range in_pin = {3 * PS + 10, 1}, across = {PS + 100, PS}, fine = {5 * PS, PS};
  struct sl_err err = {0};

  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    CHECK_EQ(sl_books_lend_pinned(b, owner, r, NULL, 0, 0, bad[i], bad[i][2] ? 2 : 1, NULL,
                                  TOKEN, &loan, &err), SUBLET_EINVAL);
    check_at(strstr(err.msg, why[i]) != NULL, why[i], __FILE__, __LINE__);
  }
  CHECK_EQ(sl_books_lend_pinned(b, owner, r, &in_pin, 1, 0, pinned, 2, NULL, TOKEN, &loan,
                                &err), SUBLET_EINVAL);
  CHECK_MSG(err, "kept bytes [12298, 12299) lie in pinned pages 2 to 3 (pinned pair 0)");
  CHECK_EQ(sl_books_lend_pinned(b, owner, r, &across, 1, 0, pinned, 2, NULL, TOKEN, &loan,
                                &err), SUBLET_EINVAL); /* from page 1 into pinned page 2 */
  CHECK_MSG(err, "pinned pages 2 to 3");
  CHECK_EQ(sl_books_current_loan(b), 0);
  BOOKS_OK(b);
  loan = lend_pinned(b, owner, r, &fine, 1, (const uint64_t[]){2, 2, 4, 1}, 2); /* adjacent */
  check_layout(b, loan, (const uint64_t[]){0, 1, 6, 7}, 4, (const uint64_t[]){5}, 1);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  CHECK_EQ(sl_books_lend_pinned(b, owner, r, NULL, 0, 1, pinned, 2, NULL, TOKEN, &loan, &err),
           0);
  check_layout(b, loan, NULL, 0, all_kept, 5);
  CHECK_EQ(info(b, loan).kept_bytes, 5 * PS);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* The pinned set is part of the layout: another set, another id; the same again, the same. */
static void test_pinned_layout_ids(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), r = region(b, owner, 8), loan, none, p1, p2;
  const uint64_t pin1[] = {6, 2}, pin2[] = {5, 1};
  struct sublet_range keep = {PS, 1};

  loan = lend_pinned(b, owner, r, &keep, 1, NULL, 0);
  none = layout_id_of(b, loan);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend_pinned(b, owner, r, &keep, 1, pin1, 1);
  p1 = layout_id_of(b, loan);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend_pinned(b, owner, r, &keep, 1, pin1, 1);
  CHECK_EQ(layout_id_of(b, loan), p1);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend_pinned(b, owner, r, &keep, 1, pin2, 1); /* same U? no: same K, other pages */
  p2 = layout_id_of(b, loan);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_withdraw(b, owner, loan, NULL), 0);
  loan = lend_pinned(b, owner, r, &keep, 1, NULL, 0);
  CHECK(layout_id_of(b, loan) != none); /* the last loan's was p2's */
  CHECK(none != p1 && p1 != p2 && none != p2);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* ---- kept windows (kept.c) ---------------------------------------------------------------- */

/* A borrower's loan of the region: borrowed, nothing allocated, returned. */
static void loan_round(struct sl_books *b, uint64_t owner, uint64_t borrower, uint64_t rid) {
  struct sl_loan_end end;

  borrow(b, borrower, lend(b, owner, rid, NULL, 0), 4);
  CHECK_EQ(sl_books_return(b, borrower, 0, &end, NULL), 0);
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
}

/* A borrower of the owner's uid that hears notices keeps the window after its loan; when the
 * region goes it holds its pages until it says Dropped; a client that does not hear notices
 * (an older library) never does, so its region goes at once, as before. */
static void test_kept_region_released(void) {
  struct sl_books *b = books_new(PS, (gid_t)-1);
  uint64_t owner = client(b, 1000, 1000), hears = client(b, 1000, 1000);
  uint64_t old = client(b, 1000, 1000), other = client(b, 2000, 2000);
  uint64_t rid = region(b, owner, 8);
  struct sl_held_info h[2];
  struct sl_err err = {0};
  int last = -1;

  sl_books_client_notices(b, hears);
  sl_books_client_notices(b, other);
  CHECK(sl_books_kept_window(b, hears, rid) && sl_books_kept_window(b, old, rid));
  CHECK(!sl_books_kept_window(b, owner, rid) && !sl_books_kept_window(b, other, rid));
  loan_round(b, owner, hears, rid);
  loan_round(b, owner, old, rid);
  CHECK_EQ(sl_books_region_remove(b, owner, rid, NULL), 0);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_kept_holders(b, rid), 1);
  CHECK(sl_books_kept_holds(b, hears, rid) && !sl_books_kept_holds(b, old, rid));
  CHECK_EQ(sl_books_kept_held(b, h, 2), 1);
  CHECK_EQ(h[0].region_id, rid);
  CHECK_EQ(h[0].npages, 8);
  CHECK_EQ(h[0].holder_client, hears);
  CHECK_EQ(sl_books_kept_drop(b, old, rid, &last, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_kept_drop(b, hears, rid, &last, NULL), 0);
  CHECK_EQ(last, 1);
  CHECK_EQ(sl_books_kept_holders(b, rid), 0);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* An owner and two borrowers of its uid that hear notices, each of which kept the window of
 * the owner's region after a loan of it. */
struct kept_scene {
  struct sl_books *b;
  uint64_t owner, k1, k2, rid;
};

static struct kept_scene kept_scene(void) {
  struct kept_scene k = {.b = books_new(PS, (gid_t)-1)};

  k.owner = client(k.b, 1000, 1000);
  k.k1 = client(k.b, 1000, 1000);
  k.k2 = client(k.b, 1000, 1000);
  k.rid = region(k.b, k.owner, 4);
  sl_books_client_notices(k.b, k.k1);
  sl_books_client_notices(k.b, k.k2);
  loan_round(k.b, k.owner, k.k1, k.rid);
  loan_round(k.b, k.owner, k.k2, k.rid);
  return k;
}

/* The owner leaves: its idle region goes and the keeper holds it; the keeper leaving, last,
 * releases it. A keeper that borrows another region lets go of the first (the library does). */
static void test_kept_owner_gone(void) {
  struct kept_scene k = kept_scene();
  struct sl_books *b = k.b;
  uint64_t owner = k.owner, k1 = k.k1, k2 = k.k2, r1 = k.rid, r2 = region(b, owner, 2);
  struct sl_client_gone gone;

  loan_round(b, owner, k2, r2); /* k2 now keeps r2 only */
  CHECK_EQ(sl_books_client_remove(b, owner, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 2);
  sl_client_gone_clear(&gone);
  BOOKS_OK(b);
  CHECK(sl_books_kept_holds(b, k1, r1) && !sl_books_kept_holds(b, k2, r1));
  CHECK(sl_books_kept_holds(b, k2, r2));
  CHECK_EQ(sl_books_client_remove(b, k1, &gone), 0);
  CHECK_EQ(gone.nfree_regions, 1); /* its last holder: r1's pages go now */
  CHECK_EQ(gone.free_regions[0], r1);
  sl_client_gone_clear(&gone);
  CHECK_EQ(sl_books_kept_holders(b, r2), 1);
  BOOKS_OK(b);
  sl_books_free(b);
}

/* The owner dies mid-loan: its borrower lets go itself at the end (Returned says owner_gone),
 * so it holds nothing of the region afterwards; another keeper does. */
static void test_kept_owner_gone_mid_loan(void) {
  struct kept_scene k = kept_scene();
  struct sl_books *b = k.b;
  uint64_t owner = k.owner, k1 = k.k1, k2 = k.k2, rid = k.rid;
  struct sl_client_gone gone;
  struct sl_loan_end end;

  borrow(b, k1, lend(b, owner, rid, NULL, 0), 4);
  CHECK_EQ(sl_books_client_remove(b, owner, &gone), 0);
  sl_client_gone_clear(&gone);
  CHECK_EQ(sl_books_return(b, k1, 0, &end, NULL), 0);
  CHECK(end.free_region);
  sl_loan_end_clear(&end);
  BOOKS_OK(b);
  CHECK(!sl_books_kept_holds(b, k1, rid) && sl_books_kept_holds(b, k2, rid));
  sl_books_free(b);
}

int main(void) {
  test_new_and_ids();
  test_pages_granted();
  test_regions();
  test_lend_errors();
  test_lend_in_steps();
  test_lend_layout();
  test_keep_sorted_or_not();
  test_layout_ids();
  test_pinned_layout_and_grants();
  test_pinned_refusals();
  test_pinned_layout_ids();
  test_grow_rules();
  test_grow_while_replacing();
  test_user_space();
  test_grow_then_lend();
  test_borrow_paths();
  test_alloc_order();
  test_coalescing();
  test_first_fit_and_hwm();
  test_fresh_once();
  test_fresh_zone_steady();
  test_two_phase();
  test_held_grant();
  test_alloc_errors();
  test_withdraw_and_owned();
  test_remove_idle_owner();
  test_remove_offering_owner();
  test_remove_borrower();
  test_remove_owner_of_active();
  test_remove_self_borrower();
  test_remove_both(1);
  test_remove_both(0);
  test_compaction();
  test_must_save();
  test_random_sequences();
  test_large_keep(0);
  test_large_keep(1);
  test_kept_region_released();
  test_kept_owner_gone();
  test_kept_owner_gone_mid_loan();
  return check_report("books");
}
