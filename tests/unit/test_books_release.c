/* test_books_release.c - unit tests of the books' releases (daemon/books/books_release.c).
 *
 * What a release gives back and where its kept bytes go (into the holes of the pages that
 * stay, the host only past `stay`), the exact bytes against a byte map, releases side by side
 * on disjoint pages, every refusal, the resume and its failure, an owner that goes, and page
 * groups; the books checked after every step.
 */
#include "books.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "books_fixtures.h"

#define PS 4096u
#define NONE UINT64_MAX

static struct sl_books *books_new(void) {
  struct sl_books_config cfg = {.page_size = PS};
  struct sl_books *b = NULL;

  if (sl_books_new(&cfg, &b) != 0)
    abort();
  return b;
}

static uint64_t region(struct sl_books *b, uint64_t owner, uint64_t npages, int growable) {
  uint64_t id = 0;

  CHECK_EQ(sl_books_region_new(b, owner, npages, growable, &id, NULL), 0);
  return id;
}

/* The byte map of a region: the begin's moves and saves applied, the released pages
 * overwritten (they are the driver's), the undo applied: is every kept byte back? */
static int kept_back(const struct sl_release_work *begin, const struct sl_release_work *undo,
                     const struct sublet_range *keep, size_t n, uint64_t npages) {
  return check_kept_back(begin, undo, keep, n, npages, PS, 7);
}

/* 16 pages; the first 1024 bytes of each of pages 0..7 kept (8 kept pages, 8 unkept). */
static const struct sublet_range KEEP8[] = {{0 * PS, 1024}, {1 * PS, 1024}, {2 * PS, 1024},
                                            {3 * PS, 1024}, {4 * PS, 1024}, {5 * PS, 1024},
                                            {6 * PS, 1024}, {7 * PS, 1024}};

static void check_round_trip(uint64_t stay, uint64_t want_stayed, uint64_t want_saved) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 16, 0);
  struct sl_release_work w = {0}, u = {0};
  struct sl_release_info ri;

  CHECK_EQ(release(b, o, r, KEEP8, 8, NULL, 0, stay, NULL, &w, NULL), 0);
  BOOKS_OK(b);
  CHECK_EQ(w.stayed, want_stayed);
  CHECK_EQ(w.nreleased, 16 - want_stayed);
  CHECK_EQ(w.kept_bytes, 8 * 1024);
  CHECK_EQ(w.saved_bytes, want_saved);
  CHECK_EQ(w.moved_bytes + w.saved_bytes, (8 - want_stayed) * 1024); /* released pages' bytes */
  CHECK_EQ(sl_books_region_released(b, r), 16 - want_stayed);
  CHECK_EQ(sl_books_release_info(b, w.release_id, &ri), 0);
  CHECK_EQ(ri.state, SL_REL_RELEASING);
  sl_books_release_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_release_info(b, w.release_id, &ri), 0);
  CHECK_EQ(ri.state, SL_REL_RELEASED);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 0, &u, NULL), 0);
  BOOKS_OK(b);
  CHECK_EQ(u.nreleased, w.nreleased);
  CHECK(kept_back(&w, &u, KEEP8, 8, 16));
  sl_books_resume_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_release_info(b, w.release_id, &ri), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_released(b, r), 0);
  BOOKS_OK(b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  sl_books_free(b);
}

/* Kept bytes that fit stay on the GPU; fewer pages allowed send the rest to the host. */
static void test_where_kept_bytes_go(void) {
  check_round_trip(NONE, 2, 0);            /* 8 KiB kept fill 2 pages: nothing to the host */
  check_round_trip(5, 2, 0);               /* more allowed than needed: still 2 */
  check_round_trip(1, 1, 7 * 1024 - 3072); /* 1 page: its 3 KiB of holes, the rest saved */
  check_round_trip(0, 0, 8 * 1024);        /* nothing stays: every kept byte saved */
}

/* The pages that stay are consecutive: the window of as many pages as the kept bytes fill
 * that holds the most of them (the highest on ties); every other page is released, ascending. */
static void test_the_pages_that_stay_are_one_window(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 16, 0);
  struct sl_release_work w = {0};
  const struct sublet_range keep[] = {{3 * PS, 4096}, {9 * PS + 100, 10}, {12 * PS, 4096}};

  CHECK_EQ(release(b, o, r, keep, 3, NULL, 0, NONE, NULL, &w, NULL), 0);
  /* B = 8202 bytes fill 3 pages: 12..14 hold 4096 of them, as many as any window */
  CHECK_EQ(w.stayed, 3);
  CHECK_EQ(w.nreleased, 13);
  for (size_t i = 1; i < w.nreleased; i++)
    CHECK(w.released[i] > w.released[i - 1]);
  for (size_t i = 0; i < w.nreleased; i++)
    CHECK(w.released[i] < 12 || w.released[i] > 14);
  CHECK_EQ(w.moved_bytes, 4096 + 10);
  CHECK_EQ(w.saved_bytes, 0);
  BOOKS_OK(b);
  sl_release_work_clear(&w);
  sl_books_free(b);
}

/* The runs of released pages in w (a resume makes each again as its own handles). */
static size_t released_runs(const struct sl_release_work *w) {
  size_t runs = w->nreleased > 0;

  for (size_t i = 1; i < w->nreleased; i++)
    runs += w->released[i] != w->released[i - 1] + 1;
  return runs;
}

/* Rows kept in place (3 KiB at the start of every other page, as a KV cache's live rows) are
 * gathered into one window rather than left in 16 pages between 16 released runs: the
 * released pages make at most two runs, the kept bytes moved on the device, none saved. */
static void test_rows_are_gathered(void) {
  enum { N = 32 };
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, N, 0);
  struct sl_release_work w = {0}, u = {0};
  struct sublet_range rows[N / 2];

  for (size_t i = 0; i < N / 2; i++)
    rows[i] = (struct sublet_range){2 * i * PS, 3072};
  CHECK_EQ(release(b, o, r, rows, N / 2, NULL, 0, NONE, NULL, &w, NULL), 0);
  BOOKS_OK(b);
  CHECK_EQ(w.stayed, 12); /* 16 x 3 KiB fill 12 pages */
  CHECK(released_runs(&w) <= 2);
  CHECK_EQ(w.saved_bytes, 0);
  CHECK_EQ(w.moved_bytes, 10 * 3072); /* the window's 6 rows stay where they are */
  sl_books_release_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 1, &u, NULL), 0);
  CHECK(kept_back(&w, &u, rows, N / 2, N));
  CHECK(u.ngroups <= 2);
  sl_books_resume_done(b, u.release_id, 1);
  BOOKS_OK(b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  sl_books_free(b);
}

/* Two tags of one arena: disjoint releases live at once; an overlap is refused. */
static void test_side_by_side(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 16, 1);
  const uint64_t pin_hi[] = {8, 8}, pin_lo[] = {0, 8}, pin_mid[] = {0, 4, 12, 4};
  struct sl_release_work w1 = {0}, w2 = {0}, w3 = {0}, u = {0};
  struct sl_err err = {0};

  CHECK_EQ(release(b, o, r, NULL, 0, pin_hi, 1, NONE, NULL, &w1, NULL), 0); /* pages 0..7 */
  sl_books_release_done(b, w1.release_id, 1);
  CHECK_EQ(release(b, o, r, NULL, 0, pin_mid, 2, NONE, NULL, &w3, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "released already");
  CHECK_EQ(release(b, o, r, NULL, 0, pin_lo, 1, NONE, NULL, &w2, NULL), 0); /* pages 8..15 */
  sl_books_release_done(b, w2.release_id, 1);
  CHECK_EQ(sl_books_region_released(b, r), 16);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_region_grow(b, o, r, 20, NULL), 0); /* a pool grows meanwhile */
  BOOKS_OK(b);
  CHECK_EQ(sl_books_resume_begin(b, o, w1.release_id, 0, &u, NULL), 0);
  sl_books_resume_done(b, w1.release_id, 1);
  sl_release_work_clear(&u);
  CHECK_EQ(sl_books_region_released(b, r), 8);
  BOOKS_OK(b);
  sl_release_work_clear(&w1);
  sl_release_work_clear(&w2);
  sl_books_free(b);
}

/* What a live release refuses: lending the region, its released pages' fds, others' hands. */
static void test_refusals(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), same = client(b, 1000, 1000), other = client(b, 1001, 1001);
  uint64_t r = region(b, o, 16, 0), loan;
  struct sl_release_work w = {0}, u = {0};
  struct sl_err err = {0};
  const uint8_t token[16] = {1};

  CHECK_EQ(release(b, same, r, KEEP8, 8, NULL, 0, NONE, NULL, &w, &err), SUBLET_EPERM);
  /* another user's region is refused as a missing one, word for word (issue 41) */
  CHECK_EQ(release(b, other, r, KEEP8, 8, NULL, 0, NONE, NULL, &w, &err), SUBLET_ENOENT);
  CHECK_EQ(release(b, o, r + 99, KEEP8, 8, NULL, 0, NONE, NULL, &w, &err), SUBLET_ENOENT);
  CHECK_EQ(release(b, o, r, KEEP8, 8, NULL, 0, NONE, NULL, &w, NULL), 0);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 0, &u, &err), SUBLET_EBUSY); /* releasing */
  CHECK_MSG(err, "releasing");
  sl_books_release_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_lend(b, o, r, NULL, 0, 1, "x", token, &loan, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "resume them before lending");
  CHECK_EQ(sl_books_pages_granted(b, o, r, w.released[0], 1, &err), SUBLET_EBUSY);
  CHECK_EQ(sl_books_pages_granted(b, o, r, 7, 1, NULL), 0); /* a kept page that stayed */
  CHECK_EQ(sl_books_resume_begin(b, same, w.release_id, 0, &u, &err), SUBLET_EPERM);
  CHECK_EQ(sl_books_resume_begin(b, other, w.release_id, 0, &u, &err), SUBLET_ENOENT);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id + 50, 0, &u, &err), SUBLET_ENOENT);
  /* A resume that failed (the device had no memory): released again, resumable again */
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 0, &u, NULL), 0);
  sl_books_resume_done(b, w.release_id, 0);
  sl_release_work_clear(&u);
  CHECK_EQ(sl_books_region_released(b, r), w.nreleased);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 0, &u, NULL), 0);
  sl_books_resume_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_lend(b, o, r, NULL, 0, 1, "x", token, &loan, NULL), 0);
  CHECK_EQ(release(b, o, r, KEEP8, 8, NULL, 0, NONE, NULL, &w, &err), SUBLET_EBUSY); /* lent */
  BOOKS_OK(b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  sl_books_free(b);
}

/* A failed begin leaves nothing; an owner that goes takes its releases along. */
static void test_failure_and_owner_gone(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 16, 0);
  struct sl_release_work w = {0}, w2 = {0};
  struct sl_release_info ri;
  struct sl_client_gone gone;

  CHECK_EQ(release(b, o, r, KEEP8, 8, NULL, 0, NONE, NULL, &w, NULL), 0);
  sl_books_release_done(b, w.release_id, 0); /* the device work failed */
  CHECK_EQ(sl_books_release_info(b, w.release_id, &ri), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_released(b, r), 0);
  CHECK_EQ(release(b, o, r, KEEP8, 8, NULL, 0, 0, NULL, &w2, NULL), 0);
  sl_books_release_done(b, w2.release_id, 1);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_client_remove(b, o, &gone), 0);
  CHECK_EQ(sl_books_release_info(b, w2.release_id, &ri), SUBLET_ENOENT);
  sl_books_release_done(b, w2.release_id, 1); /* a job that ends after: nothing to do */
  BOOKS_OK(b);
  sl_client_gone_clear(&gone);
  sl_release_work_clear(&w);
  sl_release_work_clear(&w2);
  sl_books_free(b);
}

/* Releases all of region r keeping keep[0..n) (stay as many as needed), then resumes it with
 * or without groups; the kept bytes come back; w is the release's work. */
static void cycle(struct sl_books *b, uint64_t o, uint64_t r, const struct sublet_range *keep,
                  size_t n, int groups, struct sl_release_work *w, struct sl_release_work *u) {
  CHECK_EQ(release(b, o, r, keep, n, NULL, 0, NONE, NULL, w, NULL), 0);
  BOOKS_OK(b);
  sl_books_release_done(b, w->release_id, 1);
  CHECK_EQ(sl_books_resume_begin(b, o, w->release_id, groups, u, NULL), 0);
  BOOKS_OK(b);
  CHECK(kept_back(w, u, keep, n, 64));
  sl_books_resume_done(b, w->release_id, 1);
  BOOKS_OK(b);
}

/* Page groups (books.h): a resume makes each run of released pages again as groups of a
 * sixteenth of it; a later release gives back whole groups only and holds the rest of a group
 * one of whose pages stays; a grouped region is not lent, and PagesGet must ask for whole
 * groups; a resume page by page undoes them. */
static void test_page_groups(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 64, 0), loan;
  struct sl_release_work w = {0}, u = {0};
  static const struct sublet_range keep5[] = {{5 * PS + 100, 200}};
  uint8_t token[SUBLET_TOKEN_SIZE] = {1};
  struct sl_err err;

  cycle(b, o, r, NULL, 0, 1, &w, &u);                 /* 64 pages released: 4 groups of 16 */
  CHECK_EQ(w.nreleased, 64);
  CHECK_EQ(u.ngroups, 4);
  CHECK_EQ(u.groups[0], 0);
  CHECK_EQ(u.groups[1], 16);
  CHECK_EQ(u.groups[6], 48);
  CHECK_EQ(sl_books_pages_as_groups(b, r, 0, 32, 1, NULL), 0);
  CHECK_EQ(sl_books_pages_as_groups(b, r, 2, 2, 1, &err), SUBLET_EINVAL); /* inside a group */
  CHECK_EQ(sl_books_pages_as_groups(b, r, 0, 4, 0, &err), SUBLET_EBUSY);  /* an old library */
  CHECK_EQ(sl_books_lend(b, o, r, NULL, 0, 0, "x", token, &loan, &err), SUBLET_EBUSY);
  CHECK(strstr(err.msg, "groups=False") != NULL);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);

  cycle(b, o, r, keep5, 1, 1, &w, &u);                /* page 5 stays: its group [0, 16) too */
  CHECK_EQ(w.nreleased, 48);
  CHECK_EQ(w.stayed, 16);
  CHECK_EQ(w.held, 15);
  CHECK_EQ(w.released[0], 16);
  CHECK_EQ(u.ngroups, 3);                             /* the run [16, 64) cut again */
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);

  cycle(b, o, r, NULL, 0, 1, &w, &u);                 /* a 64-page run: 4 groups of 16 */
  CHECK_EQ(u.ngroups, 4);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  static const struct sublet_range keep40[] = {{40 * PS, 3 * PS}};
  cycle(b, o, r, keep40, 1, 1, &w, &u);               /* whole pages 40-42 kept: [32, 48) held */
  CHECK_EQ(w.nreleased, 48);
  CHECK_EQ(w.held, 13);
  CHECK_EQ(u.ngroups, 2 + 1);                         /* [0, 32): 2 groups, [48, 64): 1 */
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);

  cycle(b, o, r, NULL, 0, 0, &w, &u);                 /* all of it, page by page */
  CHECK_EQ(w.nreleased, 64);
  CHECK_EQ(u.ngroups, 0);
  CHECK(u.groups == NULL);
  CHECK_EQ(sl_books_pages_as_groups(b, r, 2, 2, 0, NULL), 0);
  CHECK_EQ(sl_books_lend(b, o, r, NULL, 0, 0, "x", token, &loan, NULL), 0);
  BOOKS_OK(b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  sl_books_free(b);
}

/* A resume that fails leaves the region as it was: no spans made for nothing. */
static void test_groups_resume_fails(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 64, 0), loan;
  struct sl_release_work w = {0}, u = {0};
  uint8_t token[SUBLET_TOKEN_SIZE] = {2};

  CHECK_EQ(release(b, o, r, NULL, 0, NULL, 0, NONE, NULL, &w, NULL), 0);
  sl_books_release_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 1, &u, NULL), 0);
  sl_books_resume_done(b, w.release_id, 0);
  BOOKS_OK(b);
  sl_release_work_clear(&u);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 0, &u, NULL), 0);
  sl_books_resume_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_lend(b, o, r, NULL, 0, 0, "y", token, &loan, NULL), 0);
  BOOKS_OK(b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  sl_books_free(b);
}

/* An early resume: once its pages are made (resume_made) the owner may fetch them, groups and
 * all, while the release, "restoring", still refuses a loan, another resume and others' hands;
 * its end deletes it whatever the copies did (the owner holds the pages). */
static void test_early_resume(void) {
  struct sl_books *b = books_new();
  uint64_t o = client(b, 1000, 1000), r = region(b, o, 64, 0), loan;
  struct sl_release_work w = {0}, u = {0}, v = {0};
  struct sl_release_info ri;
  uint8_t token[SUBLET_TOKEN_SIZE] = {3};
  struct sl_err err = {0};

  CHECK_EQ(release(b, o, r, NULL, 0, NULL, 0, NONE, NULL, &w, NULL), 0);
  sl_books_release_done(b, w.release_id, 1);
  CHECK_EQ(sl_books_resume_made(b, w.release_id), SUBLET_EBUSY); /* not resuming */
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 1, &u, NULL), 0);
  CHECK_EQ(sl_books_pages_granted(b, o, r, 0, 64, &err), SUBLET_EBUSY); /* not made yet */
  CHECK_EQ(sl_books_resume_made(b, w.release_id), 0);
  BOOKS_OK(b);
  CHECK_EQ(sl_books_release_info(b, w.release_id, &ri), 0);
  CHECK_EQ(ri.state, SL_REL_RESTORING);
  CHECK(strcmp(sl_books_release_state_name(ri.state), "restoring") == 0);
  CHECK_EQ(sl_books_pages_granted(b, o, r, 0, 64, NULL), 0);
  CHECK_EQ(sl_books_pages_as_groups(b, r, 0, 64, 1, NULL), 0);
  CHECK_EQ(sl_books_resume_begin(b, o, w.release_id, 1, &v, &err), SUBLET_EBUSY);
  CHECK_MSG(err, "restoring");
  CHECK_EQ(sl_books_lend(b, o, r, NULL, 0, 0, "x", token, &loan, &err), SUBLET_EBUSY);
  sl_books_resume_done(b, w.release_id, 0); /* copies failed: over all the same */
  BOOKS_OK(b);
  CHECK_EQ(sl_books_release_info(b, w.release_id, &ri), SUBLET_ENOENT);
  CHECK_EQ(sl_books_region_released(b, r), 0);
  CHECK_EQ(sl_books_resume_made(b, w.release_id), SUBLET_ENOENT);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  sl_books_free(b);
}

int main(void) {
  test_where_kept_bytes_go();
  test_the_pages_that_stay_are_one_window();
  test_rows_are_gathered();
  test_side_by_side();
  test_refusals();
  test_failure_and_owner_gone();
  test_page_groups();
  test_groups_resume_fails();
  test_early_resume();
  return check_report("books_release");
}
