/* test_property.c - thousands of random loans against a real subletd (memfd backend), through
 * the pair PyTorch calls (sublet_torch_alloc / sublet_torch_free).
 *
 * Every loan has a new random keep set (ranges of any size and alignment, a few bytes of
 * every page (served in place in the owner's process: client/window.h), everything, or
 * nothing) and a random borrower: allocations of random sizes (some too large to fit) and
 * frees in random order, every allocated byte written; some allocations outlive the loan
 * (a forced return) and are freed after it ended, right away or during the next loan. The
 * first part lends in the owner's process (sublet_lend_local: one window kept from loan to
 * loan), the second to a borrower in another process. After every loan: every kept byte is
 * what it was before, everything saved came back, the daemon's books hold (subletd --check
 * verifies them after every request; the status shows no loan and all device memory free
 * but the region's). At the end neither the daemon's fds nor the owner's have grown.
 *
 *   SUBLET_PROPERTY_LOANS  loans in all (default 10000; a third across processes)
 *   SUBLET_PROPERTY_SEED   the random seed (default: printed, from the clock)
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE 4096u
#define REGION_PAGES 32u
#define REGION (REGION_PAGES * PAGE)
#define TOTAL (64u * PAGE)
#define MAX_KEEP REGION_PAGES
#define MAX_LIVE 48

static struct sl_test_daemon daemon_;

/* --- randomness: splitmix64, so that a seed replays a run */

static uint64_t next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t below(uint64_t *s, uint64_t n) {
  return next(s) % n;
}

/* --- keep sets and what they hold */

struct keep {
  struct sublet_range r[MAX_KEEP];
  size_t n;
  int all;
  uint8_t before[MAX_KEEP * REGION]; /* the kept bytes before the loan, range after range */
};

static void pick_keep(uint64_t *s, struct keep *k) {
  static const uint64_t longest[] = {16, PAGE, 3 * PAGE, REGION};
  uint64_t kind = below(s, 10);

  k->all = kind == 0;
  if (kind == 2) { /* a few bytes of every page: a KV cache's scattered live blocks */
    k->n = REGION_PAGES;
    for (size_t i = 0; i < k->n; i++)
      k->r[i] = (struct sublet_range){i * PAGE + below(s, PAGE - 64), 1 + below(s, 64)};
    return;
  }
  k->n = kind <= 1 ? 0 : 1 + below(s, 8);
  for (size_t i = 0; i < k->n; i++) {
    uint64_t off = below(s, REGION), most = longest[below(s, 4)];
    k->r[i].offset = off;
    k->r[i].length = 1 + below(s, REGION - off < most ? REGION - off : most);
  }
}

static void remember(const uint8_t *region, struct keep *k) {
  size_t at = 0;

  if (k->all)
    memcpy(k->before, region, REGION);
  for (size_t i = 0; i < k->n; i++) {
    memcpy(k->before + at, region + k->r[i].offset, k->r[i].length);
    at += k->r[i].length;
  }
}

/* Every kept byte is what it was. Overlapping ranges were remembered alike. */
static int kept_intact(const uint8_t *region, const struct keep *k) {
  size_t at = 0;

  if (k->all)
    return memcmp(k->before, region, REGION) == 0;
  for (size_t i = 0; i < k->n; i++) {
    if (memcmp(k->before + at, region + k->r[i].offset, k->r[i].length) != 0)
      return 0;
    at += k->r[i].length;
  }
  return 1;
}

/* --- the borrower: PyTorch's pair, bound to the borrowing client */

struct alloc {
  void *p;
  ssize_t size;
};

struct borrower {
  uint64_t seed;
  struct alloc live[MAX_LIVE];
  size_t nlive;
  struct alloc late[2 * MAX_LIVE]; /* alive at the end of the last loan: freed after it */
  size_t nlate;
  uint64_t allocs, refused;
};

static ssize_t pick_size(uint64_t *s) {
  switch (below(s, 8)) {
    case 0: return 1 + (ssize_t)below(s, 64);
    case 1: return 2 * TOTAL; /* never fits: refused, and the loan goes on */
    case 2: case 3: return 1 + (ssize_t)below(s, PAGE);
    default: return (ssize_t)(PAGE * (1 + below(s, 6)) - below(s, 2) * below(s, PAGE));
  }
}

static void free_one(struct alloc *set, size_t *n, size_t i) {
  sublet_torch_free(set[i].p, set[i].size, 0, NULL);
  set[i] = set[--*n];
}

static void free_late(struct borrower *b) {
  while (b->nlate > 0)
    free_one(b->late, &b->nlate, below(&b->seed, b->nlate));
}

/* Allocations and frees in random order, every byte written; some left alive. One loan in
 * four takes all it can (kept pages too, saved first). */
static void use_loan(struct borrower *b) {
  uint64_t ops = below(&b->seed, 4) == 0 ? 4 * MAX_LIVE : 1 + below(&b->seed, 24);
  int refusals = 0;

  if (below(&b->seed, 2) == 0)
    free_late(b); /* the last loan's leftovers die during this one */
  for (uint64_t op = 0; op < ops; op++) {
    if (b->nlive > 0 && (b->nlive == MAX_LIVE || (ops < MAX_LIVE && below(&b->seed, 3) == 0))) {
      free_one(b->live, &b->nlive, below(&b->seed, b->nlive));
      continue;
    }
    ssize_t size = pick_size(&b->seed);
    void *p = sublet_torch_alloc(size, 0, NULL);
    b->allocs++;
    if (p == NULL) {
      b->refused++;
      if (size < 2 * TOTAL && ++refusals == 2)
        break; /* full */
      continue;
    }
    memset(p, (int)(0xA0 + op), (size_t)size);
    b->live[b->nlive++] = (struct alloc){p, size};
  }
  if (below(&b->seed, 4) != 0) /* else: a leak */
    while (b->nlive > 0)
      free_one(b->live, &b->nlive, below(&b->seed, b->nlive));
}

/* Ends the borrowing: ELEAK while allocations live (the loan goes on), then by force; the
 * leftovers are freed once the loan has ended. Returns 0 or the failing step's code. */
static int give_back(sublet_client *c, struct borrower *b) {
  struct sublet_loan_stats st;
  size_t nleaks = 0;
  int rc = sublet_return(c, 0, &st, NULL, 0, &nleaks);

  if (b->nlive == 0)
    return rc;
  if (rc != SUBLET_ELEAK || nleaks != b->nlive)
    return rc != 0 ? rc : -1;
  rc = sublet_return(c, 1, &st, NULL, 0, NULL);
  if (rc != SUBLET_ELEAK)
    return rc != 0 ? rc : -1;
  memcpy(b->late + b->nlate, b->live, b->nlive * sizeof(b->live[0]));
  b->nlate += b->nlive;
  b->nlive = 0;
  if (b->nlate > MAX_LIVE / 2 || below(&b->seed, 2) == 0)
    free_late(b);
  return 0;
}

static int borrow_once(sublet_client *c, struct borrower *b) {
  int rc = sublet_torch_bind(0, c);

  if (rc == 0) {
    use_loan(b);
    sublet_torch_bind(0, NULL);
    rc = give_back(c, b);
  }
  return rc;
}

/* --- the owner's checks after each loan */

static uint64_t json_number(const char *json, const char *key) {
  const char *at = strstr(json, key);
  return at != NULL ? strtoull(at + strlen(key), NULL, 10) : UINT64_MAX;
}

/* No loan left, all device memory free but the region, everything saved came back. */
static int books_settled(sublet_client *c, uint64_t loans) {
  char *json = NULL;
  int ok;

  if (sublet_status_json(c, &json) != 0)
    return 0;
  ok = strstr(json, "\"loan\": null") != NULL &&
       json_number(json, "\"free_bytes\": ") == TOTAL - REGION &&
       json_number(json, "\"loans_ended\": ") == loans &&
       json_number(json, "\"copied_out_bytes\": ") == json_number(json, "\"copied_in_bytes\": ");
  sublet_string_free(json);
  return ok;
}

static int settled(sublet_client *c, sublet_region *r, const struct keep *k,
                   const struct sublet_loan_stats *st, uint64_t loans) {
  return kept_intact(sublet_region_addr(r), k) && st->copied_in_bytes == st->copied_out_bytes &&
         books_settled(c, loans);
}

/* --- the two parts */

static uint64_t seed, loans_ended; /* loans_ended: as the daemon's totals count them */

static void lend_in_process(uint64_t count) {
  struct keep *k = calloc(1, sizeof(*k));
  struct borrower b = {.seed = seed ^ 1};
  struct sublet_loan_stats st;
  sublet_client *c;
  sublet_region *r;
  uint64_t loan, s = seed, copying = 0;
  int fds_before;

  CHECK(k != NULL);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, REGION, &r), 0);
  memset(sublet_region_addr(r), 0x5C, REGION);
  fds_before = sl_test_count_fds(getpid());
  for (uint64_t i = 0; i < count; i++) {
    pick_keep(&s, k);
    remember(sublet_region_addr(r), k);
    CHECK_RC(sublet_lend_local(r, k->r, k->n, k->all, &loan), 0);
    CHECK_RC(borrow_once(c, &b), 0);
    CHECK_RC(sublet_reclaim(c, loan, -1, &st), 0);
    copying += st.copied_out_bytes > 0;
    loans_ended++;
    CHECK(settled(c, r, k, &st, loans_ended));
    /* New bytes for the next loan, so that a restore of stale bytes would show. */
    ((uint8_t *)sublet_region_addr(r))[below(&s, REGION)] ^= 0xFF;
  }
  free_late(&b);
  CHECK(sl_test_count_fds(getpid()) == fds_before);
  printf("  %llu loans in the owner's process (%llu copied kept bytes out and back): %llu "
         "allocations (%llu refused)\n", (unsigned long long)count,
         (unsigned long long)copying, (unsigned long long)b.allocs,
         (unsigned long long)b.refused);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
  free(k);
}

/* The other process: borrows `count` loans named "prop", one after another. */
static int borrower_process(uint64_t count) {
  struct borrower b = {.seed = seed ^ 2};
  sublet_client *c;
  int rc = sublet_connect(daemon_.socket, &c);

  for (uint64_t i = 0; rc == 0 && i < count; i++) {
    rc = sublet_borrow(c, 0, NULL, "prop", 60000);
    if (rc == 0)
      rc = borrow_once(c, &b);
  }
  free_late(&b);
  if (rc != 0)
    fprintf(stderr, "borrower: %s\n", sublet_last_error());
  sublet_disconnect(c);
  return rc == 0 ? 0 : 1;
}

static void lend_across_processes(uint64_t count) {
  struct keep *k = calloc(1, sizeof(*k));
  struct sublet_loan_stats st;
  sublet_client *c;
  sublet_region *r;
  uint64_t loan, s = seed ^ 3, copying = 0;
  int status;
  pid_t pid;

  CHECK(k != NULL);
  CHECK_RC(sublet_connect(daemon_.socket, &c), 0);
  CHECK_RC(sublet_region_create(c, REGION, &r), 0);
  memset(sublet_region_addr(r), 0x3A, REGION);
  if ((pid = fork()) == 0)
    _exit(borrower_process(count));
  for (uint64_t i = 0; i < count && sl_test_failed == 0; i++) {
    pick_keep(&s, k);
    remember(sublet_region_addr(r), k);
    CHECK_RC(sublet_lend(r, k->r, k->n, k->all, "prop", &loan, NULL), 0);
    CHECK_RC(sublet_reclaim(c, loan, 60000, &st), 0);
    copying += st.copied_out_bytes > 0;
    loans_ended++;
    CHECK(settled(c, r, k, &st, loans_ended));
    ((uint8_t *)sublet_region_addr(r))[below(&s, REGION)] ^= 0xFF;
  }
  if (sl_test_failed != 0)
    kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  printf("  %llu loans borrowed by another process (%llu copied kept bytes out and back)\n",
         (unsigned long long)count, (unsigned long long)copying);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
  free(k);
}

static uint64_t nloans;

static void test_random_loans(void) {
  uint64_t across = nloans / 3, local = nloans - across;
  int fds = sl_test_count_fds(daemon_.pid);

  lend_in_process(local);
  if (sl_test_failed == 0)
    lend_across_processes(across);
  SL_TEST_UNTIL(sl_test_count_fds(daemon_.pid) <= fds + 1); /* the last disconnection seen */
  printf("  daemon fds %d -> %d\n", fds, sl_test_count_fds(daemon_.pid));
  /* One may stay: the host save area the daemon keeps for the user's next loans. Thousands
   * of loans must not add more. */
  CHECK(sl_test_count_fds(daemon_.pid) <= fds + 1);
}

int main(void) {
  const char *n = getenv("SUBLET_PROPERTY_LOANS"), *s = getenv("SUBLET_PROPERTY_SEED");

  setvbuf(stdout, NULL, _IOLBF, 0);
  nloans = n != NULL ? strtoull(n, NULL, 10) : 10000;
  seed = s != NULL ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
  printf("property: %llu loans, SUBLET_PROPERTY_SEED=%llu\n", (unsigned long long)nloans,
         (unsigned long long)seed);
  if (sl_test_daemon_start(&daemon_, PAGE, TOTAL) != 0)
    return 1;
  sl_test_run("random loans", test_random_loans);
  if (sl_test_daemon_stop(&daemon_) != 0)
    sl_test_failed++;
  return sl_test_summary("property");
}
