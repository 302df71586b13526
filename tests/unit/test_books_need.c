/* test_books_need.c - releases by need in the books (daemon/books/books_release.c, issue 42): a
 * property test of the page choice against a reference, and the refusal.
 *
 * The reference, for a region without page groups: a need of N bytes with F free takes
 * R = ceil(max(0, N - F) / page) pages; exactly R are released (never more): the R with the
 * fewest kept bytes, or R consecutive ones, whichever costs less (need_pick.c's cost: bytes
 * moved, host bytes, runs of released pages), so the choice costs what the cheaper of the
 * R smallest counts and the cheapest window of R does. The pages that stay have
 * (n - R) x page - (K - Kr) bytes of holes (Kr: the released pages' kept bytes), so the host
 * gets exactly max(0, Kr - holes) = max(0, K - (n - R) x page), the rest moves; every kept
 * byte comes back (a byte map), and the books check after each step. With page groups (a
 * resume's), whole groups go: at least R pages, fewer than R plus a group, the host figure
 * the same rule over the pages that stay.
 */
#include "books.h"
#include "books_impl.h"

#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "books_fixtures.h"

#define PS 4096u

static uint64_t rnd(uint64_t *s) { /* xorshift64: the same cases on every machine */
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

struct fixture {
  struct sl_books *b;
  uint64_t owner, region, npages;
  struct sublet_range keep[512];
  size_t nkeep;
  uint64_t kb[64];       /* kept bytes per page */
  uint64_t kept;         /* all of them */
};

static void fixture_new(struct fixture *f, uint64_t npages) {
  struct sl_books_config cfg = {.page_size = PS};
  struct sl_peer peer = {.pid = 100, .uid = 1000, .gid = 1000};

  memset(f, 0, sizeof(*f));
  if (sl_books_new(&cfg, &f->b) != 0)
    abort();
  CHECK_EQ(sl_books_client_add(f->b, &peer, &f->owner), 0);
  CHECK_EQ(sl_books_region_new(f->b, f->owner, npages, 0, &f->region, NULL), 0);
  f->npages = npages;
}

/* Random keep ranges: each page empty, full, or a few runs of bytes (odd lengths too). */
static void random_keep(struct fixture *f, uint64_t *s) {
  f->nkeep = 0;
  f->kept = 0;
  for (uint64_t p = 0; p < f->npages; p++) {
    uint64_t kind = rnd(s) % 4, at = p * PS, end = at + PS;
    f->kb[p] = 0;
    if (kind == 0)
      continue;
    if (kind == 1) {
      f->keep[f->nkeep++] = (struct sublet_range){at, PS};
      f->kb[p] = PS;
      continue;
    }
    for (int r = 0; r < 3 && at < end; r++) {
      uint64_t gap = rnd(s) % 900, len = 1 + rnd(s) % 1500;
      at += gap;
      if (at >= end)
        break;
      len = len < end - at ? len : end - at;
      f->keep[f->nkeep++] = (struct sublet_range){at, len};
      f->kb[p] += len;
      at += len + 1;
    }
  }
  for (uint64_t p = 0; p < f->npages; p++)
    f->kept += f->kb[p];
}

static int release_need(struct fixture *f, const struct sl_release_need *need, uint64_t stay,
                        struct sl_release_work *w, struct sl_err *err) {
  return release(f->b, f->owner, f->region, f->keep, f->nkeep, NULL, 0, stay, need, w, err);
}

/* The begin's moves and saves on a byte map, the released pages overwritten, the undo: is
 * every kept byte back? */
static int kept_back(const struct fixture *f, const struct sl_release_work *w,
                     const struct sl_release_work *u) {
  return check_kept_back(w, u, f->keep, f->nkeep, f->npages, PS, 13);
}

/* Runs of the chosen candidates (took[i]), pg[] their pages, ascending. */
static uint64_t runs_of(const uint8_t *took, const uint64_t *pg, size_t n) {
  uint64_t runs = 0;

  for (size_t i = 0; i < n; i++)
    runs += took[i] && (i == 0 || !took[i - 1] || pg[i - 1] + 1 != pg[i]);
  return runs;
}

static const uint64_t *by_kept; /* for by_kept_cmp: the counts being sorted */

static int by_kept_cmp(const void *a, const void *b) {
  size_t x = *(const size_t *)a, y = *(const size_t *)b;

  if (by_kept[x] != by_kept[y])
    return by_kept[x] < by_kept[y] ? -1 : 1;
  return x < y ? -1 : x > y;
}

/* The reference's least cost of releasing `want` of n candidates (kept counts v[], pages
 * pg[], ascending): the want fewest-kept ones, or any want consecutive ones. */
static uint64_t least_cost(const uint64_t *v, const uint64_t *pg, size_t n, uint64_t want,
                           uint64_t kept_all) {
  struct sl_need_choice c = {.count = want, .npages = n, .page_size = PS, .kept_all = kept_all};
  uint8_t took[64] = {0};
  size_t idx[64];
  uint64_t kept = 0, best;

  for (size_t i = 0; i < n; i++)
    idx[i] = i;
  by_kept = v;
  qsort(idx, n, sizeof(*idx), by_kept_cmp);
  for (uint64_t i = 0; i < want; i++) {
    took[idx[i]] = 1;
    kept += v[idx[i]];
  }
  best = sl_need_pick_cost(&c, want, kept, runs_of(took, pg, n));
  for (size_t at = 0; want > 0 && at + want <= n; at++) {
    uint8_t w[64] = {0};
    kept = 0;
    for (size_t i = at; i < at + want; i++) {
      w[i] = 1;
      kept += v[i];
    }
    uint64_t cost = sl_need_pick_cost(&c, want, kept, runs_of(w, pg, n));
    best = cost < best ? cost : best;
  }
  return best;
}

/* The cost of the release's choice among the candidates pg[0, n) (kept counts v[]). */
static uint64_t chosen_cost(const struct sl_release_work *w, const uint64_t *v,
                            const uint64_t *pg, size_t n, uint64_t kept_all) {
  struct sl_need_choice c = {.npages = n, .page_size = PS, .kept_all = kept_all};
  uint8_t took[64] = {0};
  uint64_t kept = 0;

  for (size_t r = 0; r < w->nreleased; r++)
    for (size_t i = 0; i < n; i++)
      if (pg[i] == w->released[r]) {
        took[i] = 1;
        kept += v[i];
      }
  return sl_need_pick_cost(&c, w->nreleased, kept, runs_of(took, pg, n));
}

static uint64_t released_kept(const struct fixture *f, const struct sl_release_work *w) {
  uint64_t sum = 0;

  for (size_t i = 0; i < w->nreleased; i++)
    sum += f->kb[w->released[i]];
  return sum;
}

/* The release's figures against the rule, for `want` pages released (0 .. npages). */
static void check_figures(const struct fixture *f, const struct sl_release_work *w,
                          uint64_t want, int exact) {
  uint64_t stayed = f->npages - w->nreleased, kr = released_kept(f, w);
  uint64_t host = f->kept > stayed * PS ? f->kept - stayed * PS : 0;

  if (exact) {
    uint64_t pg[64];
    for (uint64_t p = 0; p < f->npages; p++)
      pg[p] = p;
    CHECK_EQ(w->nreleased, want);
    CHECK_EQ(chosen_cost(w, f->kb, pg, f->npages, f->kept),
             least_cost(f->kb, pg, f->npages, want, f->kept));
  } else {
    CHECK(w->nreleased >= want);
    CHECK(w->nreleased < want + SL_GROUP_PAGES);
  }
  CHECK_EQ(w->stayed, stayed);
  CHECK_EQ(w->held, 0);
  CHECK_EQ(w->saved_bytes, host);
  CHECK_EQ(w->moved_bytes, kr - host);
  CHECK(w->by_need);
}

/* One release by need and its resume (groups: made again as page groups). */
static void one_cycle(struct fixture *f, uint64_t *s, int groups, int exact) {
  struct sl_release_need need = {.need_bytes = rnd(s) % ((f->npages + 2) * PS),
                                 .free_bytes = rnd(s) % 4 == 0 ? 0 : rnd(s) % (3 * PS)};
  uint64_t stay = rnd(s) % 5 == 0 ? rnd(s) % (f->npages + 1) : UINT64_MAX;
  uint64_t short_by = need.need_bytes > need.free_bytes ? need.need_bytes - need.free_bytes : 0;
  uint64_t want = (short_by + PS - 1) / PS;
  struct sl_release_work w = {0}, u = {0};
  struct sl_err err = {0};
  int rc;

  random_keep(f, s);
  rc = release_need(f, &need, stay, &w, &err);
  BOOKS_OK(f->b);
  if (want > f->npages) { /* more than free + every page: refused, nothing entered */
    CHECK_EQ(rc, SUBLET_ENEED);
    CHECK(strstr(err.msg, "refused, nothing moved") != NULL);
    CHECK_EQ(sl_books_region_released(f->b, f->region), 0);
    return;
  }
  CHECK_EQ(rc, 0);
  if (stay != UINT64_MAX && f->npages - stay > want)
    want = f->npages - stay; /* at most stay pages stay, as without a need */
  check_figures(f, &w, want, exact);
  sl_books_release_done(f->b, w.release_id, 1);
  BOOKS_OK(f->b);
  CHECK_EQ(sl_books_resume_begin(f->b, f->owner, w.release_id, groups, &u, NULL), 0);
  CHECK(kept_back(f, &w, &u));
  sl_books_resume_done(f->b, w.release_id, 1);
  BOOKS_OK(f->b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
}

/* Regions without groups (each resume page by page): the choice exactly as the reference. */
static void test_choice_against_the_reference(void) {
  uint64_t s = 0x9E3779B97F4A7C15ull;

  for (int round = 0; round < 400; round++) {
    struct fixture f;
    fixture_new(&f, 1 + rnd(&s) % 40);
    for (int cycle = 0; cycle < 3; cycle++)
      one_cycle(&f, &s, 0, 1);
    sl_books_free(f.b);
  }
}

/* Resumes make page groups: later releases by need give back whole groups. */
static void test_groups(void) {
  uint64_t s = 0xD1B54A32D192ED03ull;

  for (int round = 0; round < 200; round++) {
    struct fixture f;
    fixture_new(&f, 16 + rnd(&s) % 48);
    for (int cycle = 0; cycle < 4; cycle++)
      one_cycle(&f, &s, 1, 0);
    sl_books_free(f.b);
  }
}

/* Every page kept whole; a first need of 48 of 64 pages, resumed as page groups (16 pages
 * each: a sixteenth of the run, at least 16). A need of 20 pages then goes to the host to the
 * page: a group and 4 of the pages never released, one run (the fewest-kept choice, ties by
 * page, took two groups: 12 pages, 48 KiB, more each way). */
static void test_groups_and_single_pages_meet_a_need_to_the_page(void) {
  struct fixture f;
  struct sl_release_need first = {.need_bytes = 48 * PS}, then = {.need_bytes = 20 * PS};
  struct sl_release_work w = {0}, u = {0};

  fixture_new(&f, 64);
  f.keep[0] = (struct sublet_range){0, 64 * PS};
  f.nkeep = 1;
  CHECK_EQ(release_need(&f, &first, UINT64_MAX, &w, NULL), 0);
  CHECK_EQ(w.nreleased, 48);
  sl_books_release_done(f.b, w.release_id, 1);
  CHECK_EQ(sl_books_resume_begin(f.b, f.owner, w.release_id, 1, &u, NULL), 0);
  sl_books_resume_done(f.b, w.release_id, 1);
  BOOKS_OK(f.b);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
  CHECK_EQ(release_need(&f, &then, UINT64_MAX, &w, NULL), 0);
  CHECK_EQ(w.nreleased, 20);
  CHECK_EQ(w.saved_bytes, 20 * PS);       /* K - stayed x page: 64 - 44 pages */
  for (size_t i = 1; i < w.nreleased; i++)
    CHECK_EQ(w.released[i], w.released[i - 1] + 1);
  sl_books_release_done(f.b, w.release_id, 1);
  BOOKS_OK(f.b);
  sl_release_work_clear(&w);
  sl_books_free(f.b);
}

/* The figures of a refusal, and a need the free bytes cover releasing nothing. */
static void test_refusal_and_free_enough(void) {
  struct fixture f;
  struct sl_release_need need = {.need_bytes = 11 * PS + 1, .free_bytes = 3 * PS};
  struct sl_release_work w = {0};
  struct sl_err err = {0};

  fixture_new(&f, 8);
  f.keep[0] = (struct sublet_range){0, 8 * PS};
  f.nkeep = 1;
  CHECK_EQ(release_need(&f, &need, UINT64_MAX, &w, &err), SUBLET_ENEED);
  CHECK(strstr(err.msg, "45057 bytes") != NULL);                 /* the need */
  CHECK(strstr(err.msg, "12288 bytes free") != NULL);            /* the free bytes */
  CHECK(strstr(err.msg, "at most 32768 bytes (8 pages)") != NULL); /* what it can give */
  CHECK(strstr(err.msg, "1 short") != NULL);
  CHECK_EQ(sl_books_region_released(f.b, f.region), 0);
  BOOKS_OK(f.b);
  need.need_bytes = 3 * PS; /* free covers it: nothing released, nothing moved */
  CHECK_EQ(release_need(&f, &need, UINT64_MAX, &w, &err), 0);
  CHECK_EQ(w.nreleased, 0);
  CHECK_EQ(w.moved_bytes + w.saved_bytes, 0);
  BOOKS_OK(f.b);
  sl_release_work_clear(&w);
  sl_books_free(f.b);
}

/* ---- increments: need, need, ..., resume ------------------------------------------------
 *
 * The reference of an increment: the taker now needs N' bytes in all, N before; with F free
 * now, R' = ceil(max(0, N' - N - F) / page) more pages go (N' <= N: nothing), of the
 * pages that stay, chosen as the first need's are over their bytes now (their kept bytes and
 * the bytes moved into them), and the host holds max(0, K - S x page) in all, S the pages
 * that still stay. A byte map follows the device through every step (moves, then saves, then
 * the released pages overwritten) and the resume: every kept byte back. */

struct device_map {
  uint8_t *dev, *orig, *host, *occ; /* occ: 1 where the device holds a kept byte now */
  uint64_t size;
};

static void map_new(struct device_map *m, const struct fixture *f) {
  m->size = f->npages * PS;
  m->dev = malloc(m->size);
  m->orig = malloc(m->size);
  m->host = calloc(1, m->size + 1);
  m->occ = calloc(1, m->size);
  for (uint64_t i = 0; i < m->size; i++)
    m->orig[i] = m->dev[i] = (uint8_t)(i * 29 + i / PS);
  for (size_t i = 0; i < f->nkeep; i++)
    memset(m->occ + f->keep[i].offset, 1, f->keep[i].length);
}

static void map_free(struct device_map *m) {
  free(m->dev);
  free(m->orig);
  free(m->host);
  free(m->occ);
}

/* One step's device work on the map: moves, saves, then its released pages overwritten. */
static void map_step(struct device_map *m, const struct sl_release_work *w) {
  for (size_t i = 0; i < w->nmoves; i++) {
    CHECK(w->moves[i].dst_off + w->moves[i].len <= m->size);
    memmove(m->dev + w->moves[i].dst_off, m->dev + w->moves[i].src_off, w->moves[i].len);
    memset(m->occ + w->moves[i].dst_off, 1, w->moves[i].len);
  }
  for (size_t i = 0; i < w->ncopies; i++)
    memcpy(m->host + w->copies[i].host_off, m->dev + w->copies[i].dev_off, w->copies[i].len);
  for (size_t i = 0; i < w->nreleased; i++) {
    memset(m->dev + w->released[i] * PS, 0xAB, PS);
    memset(m->occ + w->released[i] * PS, 0, PS);
  }
}

/* The resume's undoing on the map: is every kept byte back? */
static int map_resumed(struct device_map *m, const struct fixture *f,
                       const struct sl_release_work *u) {
  int ok = 1;

  for (size_t i = 0; i < u->ncopies; i++)
    memcpy(m->dev + u->copies[i].dev_off, m->host + u->copies[i].host_off, u->copies[i].len);
  for (size_t i = 0; i < u->nmoves; i++)
    memmove(m->dev + u->moves[i].dst_off, m->dev + u->moves[i].src_off, u->moves[i].len);
  for (size_t i = 0; i < f->nkeep; i++)
    ok &= memcmp(m->dev + f->keep[i].offset, m->orig + f->keep[i].offset, f->keep[i].length) == 0;
  return ok;
}

static uint64_t page_occ(const struct device_map *m, uint64_t page) {
  uint64_t n = 0;

  for (uint64_t i = page * PS; i < (page + 1) * PS; i++)
    n += m->occ[i];
  return n;
}

/* The pages of the set that stay (not gone), pg[] if given, and their bytes now. */
static size_t staying_occ(const struct fixture *f, const struct device_map *m,
                          const uint8_t *gone, uint64_t *occ, uint64_t *pg) {
  size_t ns = 0;

  for (uint64_t p = 0; p < f->npages; p++)
    if (!gone[p]) {
      if (pg != NULL)
        pg[ns] = p;
      occ[ns++] = page_occ(m, p);
    }
  return ns;
}

/* An increment's figures against the reference (exact: no page groups). */
static void check_increment(const struct fixture *f, const struct device_map *m,
                            const uint8_t *gone, const struct sl_release_work *w, uint64_t want,
                            int exact) {
  uint64_t occ[64], pg[64], on_device = 0, stayed;
  size_t ns = staying_occ(f, m, gone, occ, pg);

  for (size_t i = 0; i < w->nreleased; i++)
    CHECK(!gone[w->released[i]]);
  for (size_t i = 0; i < ns; i++)
    on_device += occ[i];
  if (exact) {
    CHECK_EQ(w->nreleased, want);
    CHECK_EQ(chosen_cost(w, occ, pg, ns, on_device), least_cost(occ, pg, ns, want, on_device));
  } else {
    CHECK(w->nreleased >= want && w->nreleased < want + SL_GROUP_PAGES);
  }
  stayed = ns - w->nreleased;
  CHECK_EQ(w->stayed, stayed);
  CHECK_EQ(w->saved_bytes, f->kept > stayed * PS ? f->kept - stayed * PS : 0);
}

/* One increment of release id (its need *had, now): refused, nothing to do, or more pages. */
static void one_increment(struct fixture *f, uint64_t *s, uint64_t id, uint64_t *had,
                          struct device_map *m, uint8_t *gone, int exact) {
  struct sl_release_need need = {.need_bytes = *had + rnd(s) % ((f->npages / 2 + 2) * PS),
                                 .free_bytes = rnd(s) % 3 == 0 ? 0 : rnd(s) % (2 * PS)};
  uint64_t occ[64], ns = staying_occ(f, m, gone, occ, NULL), want, moved0;
  struct sl_release_work w = {0};
  struct sl_release_info ri;
  struct sl_err err = {0};
  int rc;

  if (rnd(s) % 5 == 0)
    need.need_bytes = *had - (*had > 0 ? rnd(s) % (*had + 1) : 0); /* not more: a no-op */
  want = need.need_bytes > *had + need.free_bytes
             ? (need.need_bytes - *had - need.free_bytes + PS - 1) / PS : 0;
  CHECK_EQ(sl_books_release_info(f->b, id, &ri), 0);
  moved0 = ri.moved_bytes;
  rc = sl_books_release_more(f->b, f->owner, id, &need, &w, &err);
  BOOKS_OK(f->b);
  if (exact && want > ns) { /* more than the pages that stay: refused, nothing changed */
    CHECK_EQ(rc, SUBLET_ENEED);
    CHECK(strstr(err.msg, "refused, nothing moved") != NULL);
    CHECK_EQ(sl_books_region_released(f->b, f->region), f->npages - ns);
    return;
  }
  if (rc == SUBLET_ENEED) /* page groups: fewer pages to give than pages that stay */
    return;
  CHECK_EQ(rc, 0);
  CHECK_EQ(w.done, need.need_bytes <= *had || want == 0);
  if (!w.done) {
    check_increment(f, m, gone, &w, want, exact);
    map_step(m, &w);
    for (size_t i = 0; i < w.nreleased; i++)
      gone[w.released[i]] = 1;
    sl_books_release_done(f->b, id, 1);
    BOOKS_OK(f->b);
  }
  CHECK_EQ(sl_books_release_info(f->b, id, &ri), 0);
  CHECK_EQ(ri.state, SL_REL_RELEASED);
  CHECK_EQ(ri.moved_bytes, moved0 + (w.done ? 0 : w.moved_bytes - moved0));
  CHECK_EQ(ri.need_bytes, need.need_bytes > *had ? need.need_bytes : *had);
  if (need.need_bytes > *had)
    *had = need.need_bytes;
  sl_release_work_clear(&w);
}

/* A release by need, a few increments, the resume: every kept byte back. */
static void need_sequence(struct fixture *f, uint64_t *s, int groups, int exact) {
  struct sl_release_need need = {.need_bytes = rnd(s) % ((f->npages / 2 + 1) * PS),
                                 .free_bytes = rnd(s) % (2 * PS)};
  struct sl_release_work w = {0}, u = {0};
  struct device_map m;
  uint8_t gone[64] = {0};
  uint64_t had = need.need_bytes;

  random_keep(f, s);
  CHECK_EQ(release_need(f, &need, UINT64_MAX, &w, NULL), 0);
  map_new(&m, f);
  map_step(&m, &w);
  for (size_t i = 0; i < w.nreleased; i++)
    gone[w.released[i]] = 1;
  sl_books_release_done(f->b, w.release_id, 1);
  BOOKS_OK(f->b);
  for (int step = 0, steps = 1 + (int)(rnd(s) % 5); step < steps; step++)
    one_increment(f, s, w.release_id, &had, &m, gone, exact);
  CHECK_EQ(sl_books_resume_begin(f->b, f->owner, w.release_id, groups, &u, NULL), 0);
  CHECK(map_resumed(&m, f, &u));
  sl_books_resume_done(f->b, w.release_id, 1);
  BOOKS_OK(f->b);
  map_free(&m);
  sl_release_work_clear(&w);
  sl_release_work_clear(&u);
}

static void test_increments_against_the_reference(void) {
  uint64_t s = 0xA0761D6478BD642Full;

  for (int round = 0; round < 400; round++) {
    struct fixture f;
    fixture_new(&f, 1 + rnd(&s) % 40);
    for (int cycle = 0; cycle < 3; cycle++)
      need_sequence(&f, &s, 0, 1);
    sl_books_free(f.b);
  }
}

static void test_increments_with_groups(void) {
  uint64_t s = 0xE7037ED1A0B428DBull;

  for (int round = 0; round < 150; round++) {
    struct fixture f;
    fixture_new(&f, 16 + rnd(&s) % 48);
    for (int cycle = 0; cycle < 4; cycle++)
      need_sequence(&f, &s, 1, 0);
    sl_books_free(f.b);
  }
}

/* The figures of a refused increment; a release not by need, or resuming, is refused too;
 * a failed increment's work leaves the release as it was. */
static void test_increment_refusals(void) {
  struct fixture f;
  struct sl_release_need need = {.need_bytes = 2 * PS, .free_bytes = 0};
  struct sl_release_work w = {0}, more = {0};
  struct sl_err err = {0};

  fixture_new(&f, 8);
  f.keep[0] = (struct sublet_range){0, 8 * PS};
  f.nkeep = 1;
  CHECK_EQ(release_need(&f, &need, UINT64_MAX, &w, NULL), 0);
  CHECK_EQ(sl_books_release_more(f.b, f.owner, w.release_id, &need, &more, &err), SUBLET_EBUSY);
  sl_books_release_done(f.b, w.release_id, 1);
  need = (struct sl_release_need){.need_bytes = 2 * PS + 7 * PS + 1, .free_bytes = PS};
  CHECK_EQ(sl_books_release_more(f.b, f.owner, w.release_id, &need, &more, &err), SUBLET_ENEED);
  CHECK(strstr(err.msg, "36865 bytes in all (28673 more than its 8192)") != NULL);
  CHECK(strstr(err.msg, "4096 bytes free") != NULL);
  CHECK(strstr(err.msg, "at most 24576 bytes (6 pages)") != NULL);
  CHECK(strstr(err.msg, " 1 short") != NULL);
  CHECK(strstr(err.msg, "at most 36864 bytes in all") != NULL);
  need.need_bytes = 2 * PS + 3 * PS; /* 2 more pages: planned, then the work fails */
  CHECK_EQ(sl_books_release_more(f.b, f.owner, w.release_id, &need, &more, &err), 0);
  CHECK_EQ(more.nreleased, 2);
  BOOKS_OK(f.b);
  sl_books_release_done(f.b, w.release_id, 0);
  BOOKS_OK(f.b);
  CHECK_EQ(sl_books_region_released(f.b, f.region), 2);
  sl_release_work_clear(&more);
  CHECK_EQ(sl_books_resume_begin(f.b, f.owner, w.release_id, 0, &more, NULL), 0);
  sl_books_resume_done(f.b, w.release_id, 1);
  sl_release_work_clear(&more);
  sl_release_work_clear(&w);
  CHECK_EQ(release_need(&f, NULL, UINT64_MAX, &w, NULL), 0); /* not by need */
  sl_books_release_done(f.b, w.release_id, 1);
  CHECK_EQ(sl_books_release_more(f.b, f.owner, w.release_id, &need, &more, &err), SUBLET_EINVAL);
  BOOKS_OK(f.b);
  sl_release_work_clear(&w);
  sl_books_free(f.b);
}

int main(void) {
  test_choice_against_the_reference();
  test_groups();
  test_groups_and_single_pages_meet_a_need_to_the_page();
  test_refusal_and_free_enough();
  test_increments_against_the_reference();
  test_increments_with_groups();
  test_increment_refusals();
  return check_report("books_need");
}
