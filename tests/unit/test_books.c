/* test_books.c - unit tests of subletd's books (daemon/books/books.c).
 *
 * Every path of books.h: lending order, first fit, fresh chunks, the exact kept bytes saved and
 * restored (checked against a byte map), leaks, every error, client removal in every state, a
 * long random sequence checked against a reference model (books_model.c) and sl_books_check()
 * after each step, and the speed of a large keep list. The checks are check.h's, the fixtures
 * shared with the other books tests books_fixtures.h's.
 */
#include "books.h"
#include "plan.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "books_fixtures.h"
#include "books_model.h"

#define PS 4096u
#define MiB (1024ull * 1024)

/* ---- fixtures ----------------------------------------------------------------------------- */

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

static void test_random_sequences(void) {
  static const uint64_t page_sizes[] = {4096, 64, 3, 1, 512};

  for (uint64_t seed = 1; seed <= 10; seed++) {
    books_model_run(seed * 0x9e3779b97f4a7c15ull, page_sizes[seed % 5], 10000, 0);
    books_model_run(seed * 0x9e3779b97f4a7c15ull + 1, page_sizes[seed % 5], 10000, 1);
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
