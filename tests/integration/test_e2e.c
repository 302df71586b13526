/* test_e2e.c - sublet end to end: a real subletd (memfd backend), real sockets, client
 * processes through libsublet. Kept bytes must come back bit-identical whatever the borrower
 * does, and the bytes copied must equal the kept bytes of the kept pages handed out. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"
#include "keepwire.h"
#include "msg.h"
#include "wire.h"

#define PAGE (64u << 10)
#define TOTAL (16u << 20)
#define REGION_PAGES 64

static struct sl_test_daemon daemon_;

static uint8_t pattern(uint64_t i) {
  return (uint8_t)((i * 2654435761u) >> 13);
}

static void fill(uint8_t *p, uint64_t n) {
  for (uint64_t i = 0; i < n; i++)
    p[i] = pattern(i);
}

/* Every kept byte equals the pattern. */
static int kept_intact(const uint8_t *p, const struct sublet_range *keep, size_t n) {
  for (size_t k = 0; k < n; k++)
    for (uint64_t i = keep[k].offset; i < keep[k].offset + keep[k].length; i++)
      if (p[i] != pattern(i))
        return 0;
  return 1;
}

/* Bytes kept in the region's kept pages: with all kept pages handed out, all kept bytes. */
static uint64_t kept_bytes(const struct sublet_range *keep, size_t n, uint64_t size) {
  uint8_t *mark = calloc(size, 1);
  uint64_t total = 0;

  for (size_t k = 0; k < n; k++)
    memset(mark + keep[k].offset, 1, keep[k].length);
  for (uint64_t i = 0; i < size; i++)
    total += mark[i];
  free(mark);
  return total;
}

static int connect_client(sublet_client **c) {
  return sublet_connect(daemon_.socket, c);
}

/* Allocates all the loan can give, writing over every byte; returns bytes taken. */
static uint64_t take_everything(sublet_client *c, void **ptrs, size_t *n, size_t max) {
  uint64_t size = 8 * PAGE, taken = 0;
  void *p;

  *n = 0;
  while (size >= PAGE && *n < max) {
    if (sublet_alloc(c, size, &p) != 0) {
      size /= 2;
      continue;
    }
    memset(p, 0xEE, size);
    ptrs[(*n)++] = p;
    taken += size;
  }
  return taken;
}

static void free_all(sublet_client *c, void **ptrs, size_t n) {
  for (size_t i = 0; i < n; i++)
    sublet_free(c, ptrs[i]);
}

/* ------------------------------------------------------------------ tests */

static void test_hello(void) {
  sublet_client *c;
  struct sublet_info info;

  CHECK_RC(connect_client(&c), 0);
  sublet_get_info(c, &info);
  CHECK(strcmp(info.backend, "memfd") == 0);
  CHECK(info.page_size == PAGE);
  CHECK(info.total_bytes == TOTAL);
  CHECK(info.free_bytes == TOTAL);
  sublet_disconnect(c);
}

/* Lends with a keep set, the borrower (same client) takes fill_pages pages or everything. */
static void lend_in_process(const struct sublet_range *keep, size_t nkeep, int keep_all,
                            int everything) {
  sublet_client *c;
  sublet_region *r;
  struct sublet_loan_stats st;
  uint64_t loan, size = REGION_PAGES * PAGE, expect;
  void *ptrs[1024];
  size_t n;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, size, &r), 0);
  fill(sublet_region_addr(r), size);
  CHECK_RC(sublet_lend(r, keep, nkeep, keep_all, NULL, &loan, NULL), 0);
  /* A long list went in the client's keep memfd (this subletd reads one); a short one, or one
   * longer than a memfd may hold, through the socket. */
  CHECK(sl_test_count_memfds(getpid(), "sublet-keep") ==
        (!keep_all && nkeep > SL_KEEPWIRE_SHORT_RANGES && nkeep <= SL_KEEPWIRE_FD_MAX_RANGES));
  CHECK_RC(sublet_borrow(c, loan, NULL, NULL, 0), 0);
  if (everything) {
    uint64_t taken = take_everything(c, ptrs, &n, 1024);
    CHECK(taken == TOTAL); /* unkept + fresh + kept: the whole "device" */
  } else {
    CHECK_RC(sublet_alloc(c, PAGE, &ptrs[0]), 0);
    memset(ptrs[0], 0xEE, PAGE);
    n = 1;
  }
  free_all(c, ptrs, n);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 1000, &st), 0);
  /* One page comes from unkept or fresh pages: nothing copied. Everything: all kept bytes. */
  expect = !everything ? 0 : keep_all ? size : kept_bytes(keep, nkeep, size);
  CHECK(st.copied_out_bytes == expect);
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
  if (keep_all) {
    struct sublet_range all = {0, size};
    CHECK(kept_intact(sublet_region_addr(r), &all, 1));
  } else {
    CHECK(kept_intact(sublet_region_addr(r), keep, nkeep));
  }
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

static void test_keep_nothing(void) {
  lend_in_process(NULL, 0, 0, 1);
}

static void test_keep_all(void) {
  lend_in_process(NULL, 0, 1, 1);
}

static void test_keep_one_range(void) {
  struct sublet_range k = {PAGE * 3 + 100, PAGE * 2};
  lend_in_process(&k, 1, 0, 1);
}

/* Scattered small blocks, as a paged KV cache keeps them: only their bytes move. */
static void test_keep_scattered_blocks(void) {
  struct sublet_range keep[400];
  size_t n = 0;

  srand(7);
  for (uint64_t off = 0; off + 4096 <= REGION_PAGES * PAGE && n < 400; off += 4096)
    if (rand() % 10 < 3)
      keep[n++] = (struct sublet_range){off, 4096};
  lend_in_process(keep, n, 0, 1);
}

static void test_unkept_first(void) {
  struct sublet_range k = {0, PAGE * 8}; /* the first 8 pages are kept */
  lend_in_process(&k, 1, 0, 0);          /* one page: from the unkept ones, nothing copied */
}

/* In the owner's process, a run of consecutive unkept pages is served inside the tensor's own
 * mapping (no mapping paid); so is a run from the region's unkept tail into free memory, which
 * lies right after the region's last page (its trailing reservation: window.h). */
static void test_direct_runs(void) {
  struct sublet_range keep = {0, 4 * PAGE};
  sublet_client *c;
  sublet_region *r;
  uint64_t loan;
  uint8_t *base;
  void *p, *q;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, 16 * PAGE, &r), 0);
  base = sublet_region_addr(r);
  fill(base, 16 * PAGE);
  CHECK_RC(sublet_lend(r, &keep, 1, 0, NULL, &loan, NULL), 0);
  CHECK_RC(sublet_borrow(c, loan, NULL, NULL, 0), 0);
  CHECK_RC(sublet_alloc(c, 8 * PAGE, &p), 0);
  CHECK((uint8_t *)p == base + 4 * PAGE); /* unkept pages 4..11, in place */
  memset(p, 0xEE, 8 * PAGE);
  CHECK_RC(sublet_alloc(c, 8 * PAGE, &q), 0); /* pages 12..15 and 4 fresh ones */
  CHECK((uint8_t *)q == base + 12 * PAGE);
  memset(q, 0xDD, 8 * PAGE);
  CHECK(base[12 * PAGE] == 0xDD && base[19 * PAGE] == 0xDD);
  CHECK_RC(sublet_free(c, p), 0);
  CHECK_RC(sublet_free(c, q), 0);
  CHECK_RC(sublet_return(c, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 1000, NULL), 0);
  CHECK(kept_intact(base, &keep, 1));
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

static void test_random_keeps(void) {
  for (int round = 0; round < 20; round++) {
    struct sublet_range keep[32];
    size_t n = (size_t)(rand() % 32);
    for (size_t i = 0; i < n; i++) {
      uint64_t off = (uint64_t)rand() % (REGION_PAGES * PAGE - 1);
      uint64_t len = 1 + (uint64_t)rand() % (3 * PAGE);
      if (off + len > REGION_PAGES * PAGE)
        len = REGION_PAGES * PAGE - off;
      keep[i] = (struct sublet_range){off, len};
    }
    lend_in_process(keep, n, 0, 1);
    if (sl_test_failed)
      return;
  }
}

/* A borrower in another process: by loan id and token. */
static void borrower_child(uint64_t loan, const uint8_t token[16], int die, int ready_fd) {
  sublet_client *c;
  void *ptrs[1024];
  size_t n;

  if (sublet_connect(daemon_.socket, &c) != 0 || sublet_borrow(c, loan, token, NULL, 0) != 0) {
    fprintf(stderr, "child: %s\n", sublet_last_error());
    _exit(2);
  }
  take_everything(c, ptrs, &n, 1024);
  if (die) {
    if (write(ready_fd, "x", 1) != 1)
      _exit(3);
    pause(); /* killed here, mid-loan, holding everything */
  }
  free_all(c, ptrs, n);
  _exit(sublet_return(c, 0, NULL, NULL, 0, NULL) == 0 ? 0 : 4);
}

static void cross_process(int kill_it) {
  struct sublet_range keep[2] = {{PAGE * 5, PAGE * 3 + 17}, {PAGE * 40 + 5, 1000}};
  sublet_client *c;
  sublet_region *r;
  struct sublet_loan_stats st;
  uint8_t token[16];
  uint64_t loan, size = REGION_PAGES * PAGE;
  int pipefd[2], status;
  char x;
  pid_t pid;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, size, &r), 0);
  fill(sublet_region_addr(r), size);
  CHECK_RC(sublet_lend(r, keep, 2, 0, "cross", &loan, token), 0);
  CHECK(pipe(pipefd) == 0);
  pid = fork();
  if (pid == 0)
    borrower_child(loan, token, kill_it, pipefd[1]);
  if (kill_it) {
    CHECK(read(pipefd[0], &x, 1) == 1);
    kill(pid, SIGKILL);
  }
  waitpid(pid, &status, 0);
  CHECK_RC(sublet_reclaim(c, loan, 10000, &st), 0);
  if (kill_it) {
    CHECK(WIFSIGNALED(status));
    CHECK(st.borrower_died);
    printf("  borrower pid %d killed mid-loan: borrower_died=%d, %llu kept bytes saved and "
           "restored, data intact=%d\n", (int)pid, st.borrower_died,
           (unsigned long long)st.copied_in_bytes,
           kept_intact(sublet_region_addr(r), keep, 2));
  } else {
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  CHECK(st.copied_out_bytes == kept_bytes(keep, 2, size));
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
  CHECK(kept_intact(sublet_region_addr(r), keep, 2));
  close(pipefd[0]);
  close(pipefd[1]);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

static void test_cross_process(void) {
  cross_process(0);
}

/* Does any allocation of ptrs[0..n) (size bytes each, or less) touch [lo, hi)? */
static int touches(void **ptrs, size_t n, const uint8_t *lo, const uint8_t *hi) {
  for (size_t i = 0; i < n; i++)
    if ((const uint8_t *)ptrs[i] < hi && (const uint8_t *)ptrs[i] + PAGE > lo)
      return 1;
  return 0;
}

static int all_bytes(const uint8_t *p, uint64_t n, uint8_t v) {
  for (uint64_t i = 0; i < n; i++)
    if (p[i] != v)
      return 0;
  return 1;
}

/* The owner pins pages it uses during the loan (a pool's other tags): the borrower, taking
 * everything, never gets them, nor their addresses; the owner's writes to them during the
 * loan are what they hold after it. Offered and borrowed, then local; keep_all with the
 * region's tail pinned (served in place below the region), then pinned pages in the middle. */
static void lend_pinned_once(int local, int keep_all) {
  struct sublet_range keep = {5 * PAGE + 100, 3000};
  struct sublet_range pins[2] = {{60 * PAGE, 4 * PAGE}, {10 * PAGE, 10 * PAGE}};
  size_t npins = keep_all ? 1 : 2;
  uint64_t size = REGION_PAGES * PAGE, pinned = keep_all ? 4 * PAGE : 14 * PAGE, loan, taken;
  sublet_client *c;
  sublet_region *r;
  struct sublet_loan_stats st;
  void *ptrs[1024];
  uint8_t *base;
  size_t n;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, size, &r), 0);
  base = sublet_region_addr(r);
  fill(base, size);
  CHECK_RC(sublet_lend_pinned(r, &keep, keep_all ? 0 : 1, keep_all, pins, npins, local, NULL,
                              0, &loan, NULL), 0);
  if (!local)
    CHECK_RC(sublet_borrow(c, loan, NULL, NULL, 0), 0);
  for (size_t i = 0; i < npins; i++)
    memset(base + pins[i].offset, 0x5A, pins[i].length);
  taken = take_everything(c, ptrs, &n, 1024);
  CHECK(taken == TOTAL - pinned); /* the whole "device" but the pinned pages */
  for (size_t i = 0; i < npins; i++) {
    CHECK(!touches(ptrs, n, base + pins[i].offset, base + pins[i].offset + pins[i].length));
    CHECK(all_bytes(base + pins[i].offset, pins[i].length, 0x5A));
    memset(base + pins[i].offset, 0xA5, pins[i].length);
  }
  free_all(c, ptrs, n);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 1000, &st), 0);
  CHECK(st.served_unkept_bytes + st.served_kept_bytes == size - pinned);
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
  for (size_t i = 0; i < npins; i++) /* no restore over the owner's writes */
    CHECK(all_bytes(base + pins[i].offset, pins[i].length, 0xA5));
  if (keep_all) {
    struct sublet_range unpinned = {0, 60 * PAGE};
    CHECK(kept_intact(base, &unpinned, 1));
  } else {
    CHECK(kept_intact(base, &keep, 1));
  }
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

static void test_pinned_pages(void) {
  for (int local = 0; local < 2; local++)
    for (int keep_all = 0; keep_all < 2; keep_all++)
      lend_pinned_once(local, keep_all);
}

/* Pinned ranges of part pages, past the region, or over kept bytes: refused, nothing lent. */
static void test_pinned_refusals(void) {
  struct sublet_range half = {PAGE / 2, PAGE}, past = {60 * PAGE, 8 * PAGE};
  struct sublet_range pin = {4 * PAGE, 2 * PAGE}, keep = {5 * PAGE + 1, 10}, all = {0, 64 * PAGE};
  sublet_client *c;
  sublet_region *r;
  uint64_t loan = 0;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, REGION_PAGES * PAGE, &r), 0);
  CHECK_RC(sublet_lend_pinned(r, NULL, 0, 0, &half, 1, 1, NULL, 0, &loan, NULL), SUBLET_EINVAL);
  CHECK(strstr(sublet_last_error(), "whole pages") != NULL);
  CHECK_RC(sublet_lend_pinned(r, NULL, 0, 0, &past, 1, 0, NULL, 0, &loan, NULL), SUBLET_EINVAL);
  CHECK_RC(sublet_lend_pinned(r, &keep, 1, 0, &pin, 1, 0, NULL, 0, &loan, NULL), SUBLET_EINVAL);
  CHECK(strstr(sublet_last_error(), "pinned pages 4 to 5") != NULL);
  CHECK_RC(sublet_lend_pinned(r, NULL, 0, 0, &all, 1, 0, NULL, 0, &loan, NULL), SUBLET_EINVAL);
  CHECK(strstr(sublet_last_error(), "every page") != NULL);
  CHECK(loan == 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* The borrower of test_window_kept: three loans by name; the fds it holds at the start and
 * after each loan go to report_fd as they are counted. */
static void kept_window_child(int report_fd) {
  sublet_client *c;
  void *p;
  int fds;

  if (sublet_connect(daemon_.socket, &c) != 0)
    _exit(2);
  fds = sl_test_count_fds(getpid());
  for (int i = 1; i <= 4; i++) {
    if (write(report_fd, &fds, sizeof(fds)) != sizeof(fds))
      _exit(5);
    if (i == 4)
      break;
    if (sublet_borrow(c, 0, NULL, "again", 10000) != 0 ||
        sublet_alloc(c, (i < 3 ? REGION_PAGES : 2) * PAGE, &p) != 0)
      _exit(3);
    memset(p, 0xEE, (i < 3 ? REGION_PAGES : 2) * PAGE);
    if (sublet_free(c, p) != 0 || sublet_return(c, 0, NULL, NULL, 0, NULL) != 0)
      _exit(4);
    fds = sl_test_count_fds(getpid());
  }
  _exit(0);
}

/* Reads n ints from a pipe that a child writes one at a time. */
static int read_ints(int fd, int *v, size_t n) {
  size_t got = 0;
  ssize_t r;

  while (got < n * sizeof(int) && (r = read(fd, (char *)v + got, n * sizeof(int) - got)) > 0)
    got += (size_t)r;
  return got == n * sizeof(int);
}

/* A borrower in another process (of the owner's uid) keeps its imported pages and its window
 * from one loan of a region to the next: the second loan imports nothing. A loan of another
 * region lets the first one's pages go. */
static void test_window_kept(void) {
  sublet_client *c;
  sublet_region *r, *other;
  uint8_t token[16];
  uint64_t loan, size = REGION_PAGES * PAGE;
  int pipefd[2], fds[4], status;
  pid_t pid;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, size, &r), 0);
  CHECK(pipe(pipefd) == 0);
  if ((pid = fork()) == 0)
    kept_window_child(pipefd[1]);
  for (int i = 0; i < 2; i++) {
    fill(sublet_region_addr(r), size);
    CHECK_RC(sublet_lend(r, NULL, 0, 0, "again", &loan, token), 0);
    CHECK_RC(sublet_reclaim(c, loan, 10000, NULL), 0);
  }
  /* Counted before the region goes: then the borrower lets go of it at once. */
  CHECK(read_ints(pipefd[0], fds, 3));
  CHECK_RC(sublet_region_release(r), 0);
  CHECK_RC(sublet_region_create(c, 2 * PAGE, &other), 0);
  CHECK_RC(sublet_lend(other, NULL, 0, 0, "again", &loan, token), 0);
  CHECK_RC(sublet_reclaim(c, loan, 10000, NULL), 0);
  CHECK(read_ints(pipefd[0], &fds[3], 1));
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  printf("  borrower's fds: %d at start, %d, %d and %d after each loan\n", fds[0], fds[1],
         fds[2], fds[3]);
  CHECK(fds[1] >= fds[0] + REGION_PAGES); /* the region's pages, kept after the loan */
  CHECK(fds[2] == fds[1]);                /* the next loan imported nothing */
  /* Another region: the first one's pages went; 2 pages of it, and the watcher's eventfd
   * while a window is kept (a region that goes is let go of at once: test_region_gone). */
  CHECK(fds[3] <= fds[0] + 3);
  CHECK_RC(sublet_region_release(other), 0);
  sublet_disconnect(c);
  close(pipefd[0]);
  close(pipefd[1]);
}

static void test_borrower_killed(void) {
  cross_process(1);
}

/* The device is whole again afterwards: nothing leaked. */
static void test_free_memory_back(void) {
  sublet_client *c;
  struct sublet_info info;

  CHECK_RC(connect_client(&c), 0);
  sublet_get_info(c, &info);
  CHECK(info.free_bytes == TOTAL);
  sublet_disconnect(c);
}

static void test_leak_reported(void) {
  sublet_client *c;
  sublet_region *r;
  struct sublet_loan_stats st;
  struct sublet_leak leaks[4];
  size_t nleaks;
  uint64_t loan;
  void *p, *q;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, 8 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &loan, NULL), 0);
  CHECK_RC(sublet_borrow(c, loan, NULL, NULL, 0), 0);
  CHECK_RC(sublet_alloc(c, 3 * PAGE, &p), 0);
  CHECK_RC(sublet_alloc(c, PAGE, &q), 0);
  CHECK_RC(sublet_free(c, q), 0);
  CHECK_RC(sublet_return(c, 0, &st, leaks, 4, &nleaks), SUBLET_ELEAK);
  CHECK(nleaks == 1 && leaks[0].size == 3 * PAGE && leaks[0].ptr == p);
  CHECK(strstr(sublet_last_error(), "alive") != NULL || strstr(sublet_last_error(), "leak"));
  /* The loan goes on: the leak can still be freed and the loan returned cleanly. */
  CHECK_RC(sublet_free(c, p), 0);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  /* Forced: the loan ends all the same, kept data restored. */
  fill(sublet_region_addr(r), 8 * PAGE);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &loan, NULL), 0);
  CHECK_RC(sublet_borrow(c, loan, NULL, NULL, 0), 0);
  CHECK_RC(sublet_alloc(c, TOTAL, &p), 0); /* everything: kept pages saved */
  memset(p, 0, TOTAL);
  CHECK_RC(sublet_return(c, 1, &st, leaks, 4, &nleaks), SUBLET_ELEAK);
  CHECK(nleaks == 1 && st.copied_in_bytes == 8 * PAGE);
  {
    struct sublet_range all = {0, 8 * PAGE};
    CHECK(kept_intact(sublet_region_addr(r), &all, 1));
  }
  CHECK_RC(sublet_free(c, p), 0); /* the forfeit allocation: forgotten locally */
  CHECK_RC(sublet_reclaim(c, loan, 0, &st), 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

static void test_errors(void) {
  sublet_client *c, *other;
  sublet_region *r;
  uint64_t loan;
  uint8_t token[16], bad[16] = {0};
  void *p;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(connect_client(&other), 0);
  CHECK_RC(sublet_alloc(c, PAGE, &p), SUBLET_ENOENT);          /* no loan */
  CHECK_RC(sublet_region_create(c, 0, &r), SUBLET_EINVAL);
  CHECK_RC(sublet_region_create(c, 2ull * TOTAL, &r), SUBLET_ENOMEM);
  CHECK(strstr(sublet_last_error(), "MiB") != NULL);           /* sizes said readably */
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 0, "errs", &loan, token), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 0, NULL, &loan, token), SUBLET_EBUSY); /* one at a time */
  CHECK_RC(sublet_borrow(other, loan, bad, NULL, 0), SUBLET_EPERM);       /* wrong token */
  CHECK_RC(sublet_borrow(other, loan, NULL, NULL, 0), SUBLET_EPERM);      /* no token */
  CHECK_RC(sublet_borrow(other, loan + 100, token, NULL, 0), SUBLET_ENOENT);
  CHECK_RC(sublet_borrow(other, 0, NULL, "nobody", 0), SUBLET_ENOOFFER);
  CHECK_RC(sublet_borrow(other, 0, NULL, "errs", 50), 0);                 /* by name */
  CHECK_RC(sublet_borrow(c, loan, NULL, NULL, 0), SUBLET_EBUSY);          /* taken */
  CHECK_RC(sublet_region_release(r), SUBLET_EBUSY);                       /* lent */
  CHECK_RC(sublet_alloc(other, 2ull * TOTAL, &p), SUBLET_ENOMEM);
  CHECK_RC(sublet_return(other, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 1000, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 1000, NULL), SUBLET_ENOENT);           /* already taken */
  CHECK_RC(sublet_borrow(other, 0, NULL, NULL, 100), SUBLET_ETIMEDOUT);   /* nothing offered */
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(other);
  sublet_disconnect(c);
}

/* Raw frames: whatever a hostile or broken client sends, the daemon answers or disconnects
 * it, and goes on serving the others. */
static int raw_connect(void) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);

  strcpy(addr.sun_path, daemon_.socket);
  if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0)
    return -1;
  return fd;
}

/* Sends bytes; returns 1 if the daemon then closed the connection (after any reply). */
static int closed_after(int fd, const void *buf, size_t len) {
  char reply[4096];
  ssize_t n;

  if (write(fd, buf, len) != (ssize_t)len)
    return 1;
  shutdown(fd, SHUT_WR);
  while ((n = read(fd, reply, sizeof(reply))) > 0)
    ;
  close(fd);
  return n == 0;
}

static void test_malformed_input(void) {
  uint8_t frame[SL_WIRE_HEADER + 8];
  struct sl_frame_header h = {SL_WIRE_MAGIC, SUBLET_PROTOCOL_VERSION, SL_WIRE_REQUEST, 8, 0};
  sublet_client *c;

  CHECK(closed_after(raw_connect(), "garbage, not a frame at all....", 32));
  h.length = SL_WIRE_MAX_PAYLOAD + 1; /* too large */
  sl_wire_header_encode(&h, frame);
  CHECK(closed_after(raw_connect(), frame, SL_WIRE_HEADER));
  h.length = 8;
  h.nfds = 3; /* fds announced, none sent */
  sl_wire_header_encode(&h, frame);
  memset(frame + SL_WIRE_HEADER, 0xff, 8);
  CHECK(closed_after(raw_connect(), frame, sizeof(frame)));
  h.nfds = 0; /* a payload that is no Request */
  sl_wire_header_encode(&h, frame);
  CHECK(closed_after(raw_connect(), frame, sizeof(frame)));
  h.version = 99;
  sl_wire_header_encode(&h, frame);
  CHECK(closed_after(raw_connect(), frame, sizeof(frame)));
  CHECK_RC(connect_client(&c), 0); /* still serving */
  sublet_disconnect(c);
}

/* A client that sends requests and never reads the replies: the daemon gives up on it after
 * SL_WIRE_SEND_TIMEOUT_MS instead of stalling, and goes on serving the others. */
static void flood_without_reading(void) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello hello = SUBLET__HELLO__INIT;
  Sublet__StatsGet stats = SUBLET__STATS_GET__INIT;
  int fd = raw_connect();

  hello.protocol = SUBLET_PROTOCOL_VERSION;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &hello;
  if (fd < 0 || sl_msg_send_request(fd, &req, NULL, 0, -1, NULL) != 0)
    _exit(2);
  req.body_case = SUBLET__REQUEST__BODY_STATS_GET;
  req.stats_get = &stats;
  for (uint64_t id = 2;; id++) {
    req.id = id;
    if (sl_msg_send_request(fd, &req, NULL, 0, -1, NULL) != 0)
      _exit(0); /* the daemon hung up on us: what it should do */
  }
}

static void test_client_that_never_reads(void) {
  struct sublet_info info;
  sublet_client *c;
  int status;
  pid_t pid = fork();

  if (pid == 0)
    flood_without_reading();
  usleep(200000);
  CHECK_RC(connect_client(&c), 0); /* answered, at worst after the send timeout */
  CHECK_RC(sublet_get_info(c, &info), 0);
  sublet_disconnect(c);
  waitpid(pid, &status, 0); /* the flooder ends once the daemon hangs up on it */
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* A waiting Borrow whose client stopped reading: answering it at its timeout fails, which
 * closes the connection, which ends its waiters: the waiter must be ended once. */
static void test_waiter_of_a_client_gone_deaf(void) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello hello = SUBLET__HELLO__INIT;
  Sublet__Borrow borrow = SUBLET__BORROW__INIT;
  struct sublet_info info;
  sublet_client *c;
  int fd = raw_connect();

  CHECK(fd >= 0);
  hello.protocol = SUBLET_PROTOCOL_VERSION;
  req.id = 1;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &hello;
  CHECK(sl_msg_send_request(fd, &req, NULL, 0, -1, NULL) == 0);
  borrow.has_name = 1;
  borrow.name.data = (uint8_t *)"nobody";
  borrow.name.len = 6;
  borrow.has_timeout_ms = 1;
  borrow.timeout_ms = 100;
  req.id = 2;
  req.body_case = SUBLET__REQUEST__BODY_BORROW;
  req.borrow = &borrow;
  CHECK(sl_msg_send_request(fd, &req, NULL, 0, -1, NULL) == 0);
  shutdown(fd, SHUT_RD); /* open, but no longer reading: the timeout's reply fails */
  usleep(300000);
  close(fd);
  CHECK_RC(connect_client(&c), 0); /* still serving */
  CHECK_RC(sublet_get_info(c, &info), 0);
  sublet_disconnect(c);
}

/* The Status reply names the loan in progress (its name lives as long as the reply). */
static void test_status_names_the_loan(void) {
  sublet_client *c;
  sublet_region *r;
  uint64_t loan;
  char *json = NULL;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, 2 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, "named-loan", &loan, NULL), 0);
  CHECK_RC(sublet_status_json(c, &json), 0);
  CHECK(strstr(json, "\"name\": \"named-loan\"") != NULL);
  CHECK(strstr(json, "\"state\": \"offered\"") != NULL);
  sublet_string_free(json);
  CHECK_RC(sublet_withdraw(c, loan), 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* subletd stopped mid-loan restores the kept bytes before it goes, even when the borrower's
 * connection is older than the owner's (a scheduler waiting for an offer). */
static void test_shutdown_mid_loan_restores(void) {
  struct sublet_range keep = {0, 16 * PAGE};
  struct sublet_loan_stats st;
  struct sl_test_daemon d2;
  sublet_client *owner, *borrower;
  sublet_region *r;
  uint64_t loan;
  uint8_t token[16];
  void *p;

  CHECK(sl_test_daemon_start(&d2, PAGE, 32 * PAGE) == 0);
  CHECK_RC(sublet_connect(d2.socket, &borrower), 0); /* the older connection */
  CHECK_RC(sublet_connect(d2.socket, &owner), 0);
  CHECK_RC(sublet_region_create(owner, 16 * PAGE, &r), 0);
  fill(sublet_region_addr(r), 16 * PAGE);
  CHECK_RC(sublet_lend(r, &keep, 1, 0, NULL, &loan, token), 0);
  CHECK_RC(sublet_borrow(borrower, loan, token, NULL, 0), 0);
  CHECK_RC(sublet_alloc(borrower, 32 * PAGE, &p), 0); /* everything: all kept pages saved */
  memset(p, 0xEE, 32 * PAGE);
  CHECK(sl_test_daemon_stop(&d2) == 0);
  /* Left to the owner's library: it restores once the borrower (here, in this process) has
   * let go of the pages on seeing the daemon go. The owner's mapping outlives the daemon. */
  CHECK_RC(sublet_reclaim(owner, loan, 10000, &st), SUBLET_EDAEMONDIED);
  CHECK(st.daemon_died && st.copied_in_bytes == 16 * PAGE);
  CHECK(kept_intact(sublet_region_addr(r), &keep, 1));
  sublet_disconnect(borrower);
  sublet_disconnect(owner);
}

static void test_many_connections(void) {
  int fds0, fds1;
  long rss0, rss1;

  for (int i = 0; i < 200; i++) { /* warm up allocator caches */
    sublet_client *c;
    CHECK_RC(connect_client(&c), 0);
    sublet_disconnect(c);
  }
  fds0 = sl_test_count_fds(daemon_.pid);
  rss0 = sl_test_rss_kib(daemon_.pid);
  for (int i = 0; i < 3000; i++) {
    sublet_client *c;
    sublet_region *r;
    CHECK_RC(connect_client(&c), 0);
    if (i % 10 == 0)
      CHECK_RC(sublet_region_create(c, PAGE, &r), 0); /* freed by the disconnect */
    sublet_disconnect(c);
  }
  SL_TEST_UNTIL(sl_test_count_fds(daemon_.pid) <= fds0); /* the daemon closes them in turn */
  fds1 = sl_test_count_fds(daemon_.pid);
  rss1 = sl_test_rss_kib(daemon_.pid);
  printf("  3000 connections: daemon fds %d -> %d, RSS %ld -> %ld KiB\n", fds0, fds1, rss0,
         rss1);
  CHECK(fds1 <= fds0); /* the warm-up's last closes may still be in flight at fds0 */
#ifndef __SANITIZE_ADDRESS__ /* ASan's quarantine holds freed memory: RSS says nothing there */
  CHECK(rss1 - rss0 < 2048);
#endif
}

static void test_owner_dies(void) {
  sublet_client *c;
  pid_t pid = fork();
  int status;

  if (pid == 0) {
    sublet_client *oc;
    sublet_region *r;
    if (sublet_connect(daemon_.socket, &oc) != 0 || sublet_region_create(oc, 32 * PAGE, &r))
      _exit(2);
    raise(SIGKILL);
  }
  waitpid(pid, &status, 0);
  CHECK_RC(connect_client(&c), 0);
  CHECK_UNTIL(sl_test_free_bytes(c) == TOTAL); /* once the daemon has seen its connection go */
  sublet_disconnect(c);
}

/* A borrower that waits (up to a minute: the tests reap those still waiting) for an offer by
 * name: exits 0 when it got it and gave it back, else 1. */
static void waiting_borrower(const char *name) {
  sublet_client *c;
  int rc;

  if (sublet_connect(daemon_.socket, &c) != 0)
    _exit(1);
  rc = sublet_borrow(c, 0, NULL, name, 60000);
  if (rc == 0)
    rc = sublet_return(c, 0, NULL, NULL, 0, NULL);
  _exit(rc == 0 ? 0 : 1);
}

/* Borrows waiting for an offer, everyone's (the daemon's status; -1: it cannot say). */
static long long borrows_waiting(sublet_client *c) {
  return sl_test_status_number(c, "borrows_waiting");
}

/* The next offer (no name, no id) goes to exactly one of the borrowers waiting for it: once
 * all four wait, one lend leaves three waiting, and still three once the loan has ended. */
static void test_next_offer_taken_once(void) {
  sublet_client *c;
  sublet_region *r;
  uint8_t token[16];
  uint64_t loan;
  pid_t kids[4];

  CHECK_RC(connect_client(&c), 0);
  for (size_t i = 0; i < 4; i++)
    if ((kids[i] = fork()) == 0)
      waiting_borrower(NULL);
  CHECK_UNTIL(borrows_waiting(c) == 4);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &loan, token), 0);
  SL_TEST_UNTIL(borrows_waiting(c) == 3);
  CHECK_RC(sublet_reclaim(c, loan, 5000, NULL), 0); /* one borrowed it and gave it back */
  CHECK(borrows_waiting(c) == 3);
  for (size_t i = 0; i < 4; i++)
    sl_test_reap(kids[i]);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* Sends one raw request and returns its reply's Error code (0 for another reply, 1 when no
 * reply came). */
/* Sends req (with sendfd, if not -1, and the next id) on a raw connection and returns its
 * reply (the caller frees it; NULL when none came), its fds closed. */
static Sublet__Reply *raw_reply(int fd, struct sl_wire_rx *rx, Sublet__Request *req,
                                int sendfd) {
  static uint64_t next_id = 1;
  struct sl_frame_header h;
  const uint8_t *payload;
  int fds[SL_WIRE_MAX_FDS];

  req->id = next_id++;
  if (sl_msg_send_request(fd, req, &sendfd, sendfd >= 0, -1, NULL) != 0 ||
      sl_wire_recv(rx, fd, &h, &payload, fds, 5000, NULL) != 0)
    return NULL;
  sl_wire_close_fds(fds, h.nfds);
  return sl_msg_unpack_reply(payload, h.length, NULL);
}

static int raw_call(int fd, struct sl_wire_rx *rx, Sublet__Request *req, int sendfd) {
  Sublet__Reply *rep = raw_reply(fd, rx, req, sendfd);
  int code = rep == NULL ? 1 : rep->body_case == SUBLET__REPLY__BODY_ERROR ? rep->error->code : 0;

  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return code;
}

/* Says Hello, then sends lend (with sendfd, if not -1), on a raw connection of its own: the
 * Lend's Error code (0 for another reply, 1 for none). */
static int raw_lend_fd(Sublet__Lend *lend, int sendfd) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello hello = SUBLET__HELLO__INIT;
  struct sl_wire_rx rx;
  int fd = raw_connect(), code;

  sl_wire_rx_init(&rx);
  hello.protocol = SUBLET_PROTOCOL_VERSION;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &hello;
  code = raw_call(fd, &rx, &req, -1);
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = lend;
  if (code == 0)
    code = raw_call(fd, &rx, &req, sendfd);
  sl_wire_rx_destroy(&rx);
  close(fd);
  return code;
}

static int raw_lend(Sublet__Lend *lend) {
  return raw_lend_fd(lend, -1);
}

/* A NUL cannot pass through the C API: it is sent raw. The name is checked first, so the
 * region need not exist. */
static int raw_lend_named(const char *name, size_t len) {
  Sublet__Lend lend = SUBLET__LEND__INIT;

  lend.region = 0; /* no region has id 0 */
  lend.has_name = 1;
  lend.name.data = (uint8_t *)name;
  lend.name.len = len;
  return raw_lend(&lend);
}

/* A raw Lend of region 0 with keep_ranges of len bytes (and keep too, when both): the shape is
 * checked before the region, so a good one fails only for want of region 0. */
static int raw_lend_ranges(size_t len, int both) {
  static uint64_t pairs[4] = {0, 4096, 65536, 100};
  Sublet__Lend lend = SUBLET__LEND__INIT;

  lend.has_keep_ranges = 1;
  lend.keep_ranges = (ProtobufCBinaryData){len, (uint8_t *)pairs};
  lend.keep = both ? pairs : NULL;
  lend.n_keep = both ? 2 : 0;
  return raw_lend(&lend);
}

/* Lend.keep_ranges (16-byte pairs, what the library sends a daemon that announces it): a length
 * that is not whole pairs, or keep beside it, is EINVAL; whole pairs are read (the library's
 * lends in every other test go this way). */
static void test_keep_ranges_shape(void) {
  CHECK(raw_lend_ranges(17, 0) == SUBLET_EINVAL);
  CHECK(raw_lend_ranges(32, 1) == SUBLET_EINVAL);
  CHECK(raw_lend_ranges(32, 0) == SUBLET_ENOENT); /* no region 0 */
  CHECK(raw_lend_ranges(0, 0) == SUBLET_ENOENT);
}

/* A raw Lend of region 0 whose keep_fd_ranges says n (0: unset), with fd (-1: none), and
 * keep too when both: the shape is checked before the region. */
static int raw_lend_keep_fd(uint64_t n, int fd, int both) {
  static uint64_t pairs[2] = {0, 4096};
  Sublet__Lend lend = SUBLET__LEND__INIT;

  lend.has_keep_fd_ranges = n > 0;
  lend.keep_fd_ranges = n;
  lend.keep = both ? pairs : NULL;
  lend.n_keep = both ? 2 : 0;
  return raw_lend_fd(&lend, fd);
}

/* Sends req raw: was the reply want? */
static int raw_expect(int fd, struct sl_wire_rx *rx, Sublet__Request *req,
                      Sublet__Reply__BodyCase want) {
  Sublet__Reply *rep = raw_reply(fd, rx, req, -1);
  int ok = rep != NULL && rep->body_case == want;

  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return ok;
}

/* What a raw test reads of Borrowed. */
struct raw_borrowed {
  size_t n_layout;
  uint64_t layout_id, kept_pages; /* Lent's: pages that hold kept bytes */
};

/* Sends lend (made local here; with sendfd unless -1) on a raw connection, then ends the loan
 * it made (Return, then Reclaim as its owner): the Lend's Error code in *code (0: lent, what
 * Borrowed said in *got; 1: no reply). */
static void raw_local_lend(int fd, struct sl_wire_rx *rx, Sublet__Lend *lend, int sendfd,
                           int *code, struct raw_borrowed *got) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Return ret = SUBLET__RETURN__INIT;
  Sublet__Reclaim reclaim = SUBLET__RECLAIM__INIT;
  Sublet__Reply *rep;

  *code = 1;
  lend->has_local = lend->local = 1;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = lend;
  if ((rep = raw_reply(fd, rx, &req, sendfd)) == NULL)
    return;
  if (rep->body_case == SUBLET__REPLY__BODY_ERROR)
    *code = rep->error->code;
  if (rep->body_case == SUBLET__REPLY__BODY_LENT && rep->lent->borrowed != NULL) {
    *code = 0;
    *got = (struct raw_borrowed){rep->lent->borrowed->n_layout, rep->lent->borrowed->layout_id,
                                 rep->lent->kept_pages};
    reclaim.loan = rep->lent->loan;
  }
  sublet__reply__free_unpacked(rep, NULL);
  if (*code != 0)
    return;
  req.body_case = SUBLET__REQUEST__BODY_RETURN;
  req.return_ = &ret;
  CHECK(raw_expect(fd, rx, &req, SUBLET__REPLY__BODY_RETURNED));
  req.body_case = SUBLET__REQUEST__BODY_RECLAIM;
  req.reclaim = &reclaim;
  CHECK(raw_expect(fd, rx, &req, SUBLET__REPLY__BODY_RECLAIMED));
}

/* A local Lend of region with one keep range of 100 bytes at keep_at, naming known as the
 * layout its window has: Borrowed's layout length and id. */
static void raw_local_loan(int fd, struct sl_wire_rx *rx, uint64_t region, uint64_t keep_at,
                           uint64_t known, size_t *n_layout, uint64_t *layout_id) {
  Sublet__Lend lend = SUBLET__LEND__INIT;
  uint64_t keep[2] = {keep_at, 100};
  struct raw_borrowed got = {0};
  int code;

  lend.region = region;
  lend.keep = keep;
  lend.n_keep = 2;
  lend.has_known_layout = known != 0;
  lend.known_layout = known;
  raw_local_lend(fd, rx, &lend, -1, &code, &got);
  CHECK(code == 0);
  *n_layout = got.n_layout;
  *layout_id = got.layout_id;
}

/* A local Lend of region whose n keep ranges are in memfd: the Lend's Error code, and when
 * lent, Lent's kept pages (those that hold kept bytes) in *kept. */
static void raw_local_lend_memfd(int fd, struct sl_wire_rx *rx, uint64_t region, int memfd,
                                 uint64_t n, int *code, uint64_t *kept) {
  Sublet__Lend lend = SUBLET__LEND__INIT;
  struct raw_borrowed got = {0};

  lend.region = region;
  lend.has_keep_fd_ranges = 1;
  lend.keep_fd_ranges = n;
  raw_local_lend(fd, rx, &lend, memfd, code, &got);
  *kept = got.kept_pages;
}

/* A raw connection (*fd; rx initialised) that said Hello and made a region of npages (its id
 * in *region, 0 when none was made). */
static void raw_session(struct sl_wire_rx *rx, uint64_t npages, int *fd, uint64_t *region) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello hello = SUBLET__HELLO__INIT;
  Sublet__RegionCreate create = SUBLET__REGION_CREATE__INIT;
  Sublet__Reply *rep;

  sl_wire_rx_init(rx);
  *region = 0;
  CHECK((*fd = raw_connect()) >= 0);
  hello.protocol = SUBLET_PROTOCOL_VERSION;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &hello;
  CHECK(raw_expect(*fd, rx, &req, SUBLET__REPLY__BODY_WELCOME));
  create.size = npages * PAGE;
  req.body_case = SUBLET__REQUEST__BODY_REGION_CREATE;
  req.region_create = &create;
  rep = raw_reply(*fd, rx, &req, -1);
  CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_REGION_CREATED);
  *region = rep->region_created->region;
  sublet__reply__free_unpacked(rep, NULL);
}

/* A long keep list goes in a memfd (Lend.keep_fd_ranges). Through the library, every kept
 * byte comes back after a loan that takes the whole device, and a list too long for a memfd
 * goes through the socket. Raw: subletd lends what the memfd holds (pages 0 and 2 of 4
 * kept), checks it (a range past the region is EINVAL, from the draft job), and closes its
 * copies; a memfd too short for its count, an fd that is no memfd or that it cannot read, a
 * missing one, one sent without keep_fd_ranges, keep beside it, or too many ranges are
 * refused, and subletd goes on. */
static void test_keep_in_a_memfd(void) {
  static struct sublet_range keep[100000], many[SL_KEEPWIRE_FD_MAX_RANGES + 1];
  struct sublet_range two[2] = {{100, 50}, {2 * PAGE + 7, 9}};
  char path[64];
  struct sl_wire_rx rx;
  uint64_t region, kept = 0;
  int mfd = memfd_create("keep", MFD_CLOEXEC), pipefd[2], wronly, fd, code;

  for (size_t i = 0; i < 100000; i++)
    keep[i] = (struct sublet_range){i * 40, 3};
  lend_in_process(keep, 100000, 0, 1);
  for (size_t i = 0; i < SL_KEEPWIRE_FD_MAX_RANGES + 1; i++) /* overlapping: merged */
    many[i] = (struct sublet_range){(i % 4096) * 1000, 10};
  lend_in_process(many, SL_KEEPWIRE_FD_MAX_RANGES + 1, 0, 0);
  raw_session(&rx, 4, &fd, &region);
  CHECK(mfd >= 0 && pwrite(mfd, two, sizeof(two), 0) == (ssize_t)sizeof(two));
  raw_local_lend_memfd(fd, &rx, region, mfd, 2, &code, &kept);
  CHECK(code == 0 && kept == 2);
  two[1].offset = 4 * PAGE;
  CHECK(pwrite(mfd, two, sizeof(two), 0) == (ssize_t)sizeof(two));
  raw_local_lend_memfd(fd, &rx, region, mfd, 2, &code, &kept);
  CHECK(code == SUBLET_EINVAL);
  CHECK(sl_test_count_memfds(daemon_.pid, "keep") == 0);
  snprintf(path, sizeof(path), "/proc/self/fd/%d", mfd);
  CHECK(pipe(pipefd) == 0 && (wronly = open(path, O_WRONLY | O_CLOEXEC)) >= 0);
  CHECK(raw_lend_keep_fd(3, mfd, 0) == SUBLET_EPROTO); /* 32 bytes hold 2 ranges */
  CHECK(raw_lend_keep_fd(2, pipefd[0], 0) == SUBLET_EPROTO);
  CHECK(raw_lend_keep_fd(2, wronly, 0) == SUBLET_EPROTO);
  CHECK(raw_lend_keep_fd(2, -1, 0) == SUBLET_EPROTO);
  CHECK(raw_lend_keep_fd(0, mfd, 0) == SUBLET_EPROTO);
  CHECK(raw_lend_keep_fd(2, mfd, 1) == SUBLET_EINVAL);
  CHECK(raw_lend_keep_fd(SL_KEEPWIRE_FD_MAX_RANGES + 1, mfd, 0) == SUBLET_EINVAL);
  CHECK(sl_test_count_memfds(daemon_.pid, "keep") == 0);
  sl_wire_rx_destroy(&rx);
  close(fd);
  close(mfd);
  close(wronly);
  close(pipefd[0]);
  close(pipefd[1]);
}

/* A borrower whose window has the loan's layout (known_layout: the id it was given) is not
 * sent it again; a loan with another layout, or a borrower that names another id, is. */
static void test_layout_left_out_when_known(void) {
  struct sl_wire_rx rx;
  uint64_t region, id1 = 0, id2 = 0, id3 = 0, id4 = 0;
  size_t n1 = 0, n2 = 9, n3 = 0, n4 = 0;
  int fd;

  raw_session(&rx, 4, &fd, &region);

  raw_local_loan(fd, &rx, region, 0, 0, &n1, &id1);
  CHECK(n1 == 4 && id1 != 0);
  raw_local_loan(fd, &rx, region, 50, id1, &n2, &id2); /* the same pages kept: left out */
  CHECK(n2 == 0 && id2 == id1);
  raw_local_loan(fd, &rx, region, 50, id1 + 1000, &n3, &id3); /* it names another id */
  CHECK(n3 == 4 && id3 == id1);
  raw_local_loan(fd, &rx, region, 2 * PAGE, id1, &n4, &id4); /* another layout */
  CHECK(n4 == 4 && id4 != id1);
  sl_wire_rx_destroy(&rx);
  close(fd);
}

/* A loan's name is UTF-8 of 1 to 63 bytes without NUL: any other is refused with EINVAL (so
 * that `sublet status` and the daemon's logs can always print it), and the daemon goes on. */
static void test_loan_names(void) {
  static const char *const bad[] = {"kv\xff\xfe", "\xc0\xaf" /* overlong '/' */,
                                    "\xed\xa0\x80" /* a surrogate */, "kv\xe2\x82" /* cut */,
                                    "\xf4\x90\x80\x80" /* above U+10FFFF */};
  const char *good = "kv-\xc3\xbc-\xe6\x97\xa5-\xf0\x9f\x99\x82"; /* kv-ü-日-🙂 */
  char long_name[65], *json;
  sublet_client *c;
  sublet_region *r;
  uint8_t token[16];
  uint64_t loan;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    CHECK_RC(sublet_lend(r, NULL, 0, 1, bad[i], &loan, token), SUBLET_EINVAL);
    CHECK(strstr(sublet_last_error(), "UTF-8") != NULL);
    CHECK_RC(sublet_borrow(c, 0, NULL, bad[i], 0), SUBLET_EINVAL);
  }
  memset(long_name, 'n', 64);
  long_name[64] = '\0';
  CHECK_RC(sublet_lend(r, NULL, 0, 1, long_name, &loan, token), SUBLET_EINVAL);
  CHECK(raw_lend_named("kv\0x", 4) == SUBLET_EINVAL);
  CHECK(raw_lend_named("kv", 2) == SUBLET_ENOENT); /* the same, without the NUL: no region 0 */
  CHECK_RC(sublet_lend(r, NULL, 0, 1, good, &loan, token), 0);
  CHECK_RC(sublet_status_json(c, &json), 0);
  CHECK(strstr(json, good) != NULL);
  sublet_string_free(json);
  CHECK_RC(sublet_withdraw(c, loan), 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* Borrowers waiting for the same offer are served in the order they asked. */
static void test_waiting_borrowers_first_come_first_served(void) {
  sublet_client *c;
  sublet_region *r;
  uint8_t token[16];
  uint64_t loan;
  int first;
  pid_t a, b, done = 0;

  CHECK_RC(connect_client(&c), 0);
  if ((a = fork()) == 0)
    waiting_borrower("queue");
  CHECK_UNTIL(borrows_waiting(c) == 1); /* a asks first */
  if ((b = fork()) == 0)
    waiting_borrower("queue");
  CHECK_UNTIL(borrows_waiting(c) == 2);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, "queue", &loan, token), 0);
  SL_TEST_UNTIL((done = waitpid(a, &first, WNOHANG)) == a);
  CHECK(done == a && WIFEXITED(first) && WEXITSTATUS(first) == 0); /* asked first: got it */
  CHECK(borrows_waiting(c) == 1);                                   /* b still waits */
  sl_test_reap(b);
  CHECK_RC(sublet_reclaim(c, loan, 5000, NULL), 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* Waits for the next offer (any), writes the id of the loan it got to fd, returns it. */
static void next_offer_taker(int fd) {
  struct sublet_loan_stats st = {0};
  sublet_client *c;

  if (sublet_connect(daemon_.socket, &c) != 0 || sublet_borrow(c, 0, NULL, NULL, 30000) != 0)
    _exit(2);
  sublet_loan_stats(c, &st);
  if (write(fd, &st.loan_id, sizeof(st.loan_id)) != sizeof(st.loan_id))
    _exit(3);
  _exit(sublet_return(c, 0, NULL, NULL, 0, NULL) == 0 ? 0 : 4);
}

/* One local lend: borrowed at once by its own client, used, returned, reclaimed intact. */
static void lend_locally_once(sublet_client *c, sublet_region *r, uint64_t i, uint64_t *loan) {
  struct sublet_range keep = {(i % (REGION_PAGES - 1)) * PAGE + 100, PAGE};
  struct sublet_loan_stats st;
  void *p;

  fill(sublet_region_addr(r), REGION_PAGES * PAGE); /* the last loan wrote over its unkept */
  CHECK_RC(sublet_lend_local(r, &keep, 1, 0, loan), 0);
  CHECK_RC(sublet_lend_local(r, &keep, 1, 0, loan), SUBLET_EBUSY); /* one loan at a time */
  CHECK_RC(sublet_alloc(c, 3 * PAGE, &p), 0);
  memset(p, (int)i, 3 * PAGE);
  CHECK_RC(sublet_free(c, p), 0);
  CHECK_RC(sublet_return(c, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, *loan, 1000, &st), 0);
  CHECK(kept_intact(sublet_region_addr(r), &keep, 1));
}

/* A process waiting for the next offer never gets a local lend: 100 of them go by, and it
 * takes the one real offer that follows. */
static void test_local_lends_are_never_offers(void) {
  struct sublet_range all = {0, REGION_PAGES * PAGE};
  uint64_t loan = 0, taken = 0, offered;
  sublet_client *c;
  sublet_region *r;
  int fds[2], status;
  pid_t pid;

  CHECK(pipe(fds) == 0);
  if ((pid = fork()) == 0)
    next_offer_taker(fds[1]);
  close(fds[1]);
  CHECK_RC(connect_client(&c), 0);
  CHECK_UNTIL(borrows_waiting(c) == 1); /* its Borrow is parked */
  CHECK_RC(sublet_region_create(c, REGION_PAGES * PAGE, &r), 0);
  for (uint64_t i = 0; i < 100 && sl_test_failed == 0; i++)
    lend_locally_once(c, r, i, &loan);
  CHECK(waitpid(pid, &status, WNOHANG) == 0); /* still waiting */
  fill(sublet_region_addr(r), REGION_PAGES * PAGE);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &offered, NULL), 0);
  CHECK(read(fds[0], &taken, sizeof(taken)) == sizeof(taken));
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(taken == offered && offered > loan);
  CHECK_RC(sublet_reclaim(c, offered, 5000, NULL), 0);
  CHECK(kept_intact(sublet_region_addr(r), &all, 1));
  close(fds[0]);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* The owner dies while another process borrows: the borrower hears of it at its next
 * allocation, returns cleanly, and the region is freed then. */
static void test_owner_killed_mid_loan(void) {
  struct { uint64_t loan; uint8_t token[16]; } offer;
  struct sublet_loan_stats st;
  struct sublet_info info;
  sublet_client *c;
  int pipefd[2], status;
  void *p, *q;
  pid_t pid;

  CHECK(pipe(pipefd) == 0);
  pid = fork();
  if (pid == 0) {
    sublet_client *oc;
    sublet_region *r;
    if (sublet_connect(daemon_.socket, &oc) != 0 || sublet_region_create(oc, 16 * PAGE, &r) ||
        sublet_lend(r, NULL, 0, 1, "doomed", &offer.loan, offer.token) ||
        write(pipefd[1], &offer, sizeof(offer)) != sizeof(offer))
      _exit(2);
    pause();
  }
  close(pipefd[1]); /* the child's: a child that failed is then an end of file, not a hang */
  CHECK(read(pipefd[0], &offer, sizeof(offer)) == sizeof(offer));
  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_borrow(c, offer.loan, offer.token, NULL, 0), 0);
  CHECK_RC(sublet_alloc(c, 20 * PAGE, &p), 0); /* into the kept pages: they are saved */
  memset(p, 0xAB, 20 * PAGE);
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  /* The daemon counts the owner gone when it sees its connection go (c alone is left): asked
   * before, an allocation would be served. */
  CHECK_UNTIL(sl_test_status_number(c, "clients") == 1);
  CHECK_RC(sublet_alloc(c, PAGE, &q), SUBLET_EOWNERGONE);
  CHECK(strstr(sublet_last_error(), "owner") != NULL);
  CHECK(((uint8_t *)p)[20 * PAGE - 1] == 0xAB); /* what it holds stays usable until it returns */
  CHECK_RC(sublet_free(c, p), 0);
  CHECK_RC(sublet_return(c, 0, &st, NULL, 0, NULL), 0);
  CHECK(st.owner_gone);
  sublet_get_info(c, &info);
  CHECK(info.free_bytes == TOTAL); /* the dead owner's region went with the loan's end */
  sublet_disconnect(c);
  close(pipefd[0]);
}

/* Another user: kept out by the socket's mode, and refused by the books if let in. */
/* ------------------------------------------------------------------ growable regions */

/* Grows r to npages, in place: its address stays, its first old_pages keep their pattern, and
 * the new pages are written with theirs. */
static void grow_and_fill(sublet_region *r, uint64_t old_pages, uint64_t npages) {
  struct sublet_range old = {0, old_pages * PAGE};
  uint8_t *base = sublet_region_addr(r);
  uint64_t i;

  CHECK_RC(sublet_region_grow(r, npages * PAGE - PAGE / 2), 0); /* rounded up to pages */
  CHECK(sublet_region_addr(r) == base);
  CHECK(sublet_region_size(r) == npages * PAGE);
  CHECK(kept_intact(base, &old, 1));
  for (i = old_pages * PAGE; i < npages * PAGE; i++)
    base[i] = pattern(i);
}

/* A local loan of r that takes the whole device (overwriting every byte it gets), then its
 * end: every kept byte comes back, and only kept bytes were copied. r is filled anew after. */
static void lend_everything(sublet_client *c, sublet_region *r, const struct sublet_range *keep,
                            size_t n) {
  struct sublet_loan_stats st;
  void *ptrs[1024];
  uint64_t loan;
  size_t got;

  CHECK_RC(sublet_lend_local(r, keep, n, 0, &loan), 0);
  CHECK_RC(sublet_region_grow(r, 2 * sublet_region_size(r)), SUBLET_EBUSY); /* borrowed */
  CHECK(strstr(sublet_last_error(), "grows once its loan has ended") != NULL);
  CHECK(take_everything(c, ptrs, &got, 1024) == TOTAL);
  free_all(c, ptrs, got);
  CHECK_RC(sublet_return(c, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 1000, &st), 0);
  CHECK(st.copied_out_bytes == kept_bytes(keep, n, sublet_region_size(r)));
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
  CHECK(kept_intact(sublet_region_addr(r), keep, n));
  fill(sublet_region_addr(r), sublet_region_size(r)); /* the loan wrote over the unkept bytes */
}

/* A region grows several times in place, its bytes intact and the new pages writable; a loan
 * keeps bytes across old and new pages and gives them back; after another growth the next
 * loan (a new layout over more pages) does too, and the region can still grow to the whole
 * device. */
static void test_growable_region(void) {
  struct sublet_range keep[3] = {{2 * PAGE + 100, 10 * PAGE}, {29 * PAGE + 5, 300},
                                 {3 * PAGE, 7}};
  struct sublet_range more[2] = {{PAGE - 3, 6}, {40 * PAGE + 9, 2 * PAGE}};
  sublet_client *c;
  sublet_region *r;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create_growable(c, 3 * PAGE + 1, &r), 0);
  CHECK(sublet_region_size(r) == 4 * PAGE);
  fill(sublet_region_addr(r), 4 * PAGE);
  grow_and_fill(r, 4, 5);
  grow_and_fill(r, 5, 13);
  grow_and_fill(r, 13, 32);
  lend_everything(c, r, keep, 3);
  grow_and_fill(r, 32, 48);
  lend_everything(c, r, more, 2);
  grow_and_fill(r, 48, TOTAL / PAGE);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* The borrower of test_growable_kept_window: two loans by name, each taken whole. */
static void grown_borrower(void) {
  sublet_client *c;
  void *ptrs[1024];
  size_t n;

  if (sublet_connect(daemon_.socket, &c) != 0)
    _exit(2);
  for (int i = 0; i < 2; i++) {
    if (sublet_borrow(c, 0, NULL, "grown", 10000) != 0)
      _exit(3);
    if (take_everything(c, ptrs, &n, 1024) != TOTAL)
      _exit(4);
    free_all(c, ptrs, n);
    if (sublet_return(c, 0, NULL, NULL, 0, NULL) != 0)
      _exit(5);
  }
  _exit(0);
}

/* A borrower in another process keeps its window of the region after a loan; the region
 * grows; the next loan (a new layout, over more pages) is served from a new window all the
 * same, and every kept byte, old pages' and new ones', comes back. */
static void test_growable_kept_window(void) {
  struct sublet_range first = {2 * PAGE + 9, 100};
  struct sublet_range second[2] = {{3 * PAGE, 50}, {20 * PAGE + 1, 7}};
  struct sublet_loan_stats st;
  sublet_client *c;
  sublet_region *r;
  uint64_t loan;
  int status;
  pid_t pid;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create_growable(c, 8 * PAGE, &r), 0);
  fill(sublet_region_addr(r), 8 * PAGE);
  if ((pid = fork()) == 0)
    grown_borrower();
  CHECK_RC(sublet_lend(r, &first, 1, 0, "grown", &loan, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 10000, &st), 0);
  CHECK(kept_intact(sublet_region_addr(r), &first, 1));
  CHECK_RC(sublet_region_grow(r, 24 * PAGE), 0);
  fill(sublet_region_addr(r), 24 * PAGE);
  CHECK_RC(sublet_lend(r, second, 2, 0, "grown", &loan, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, 10000, &st), 0);
  CHECK(st.copied_out_bytes == kept_bytes(second, 2, 24 * PAGE));
  CHECK(st.copied_in_bytes == st.copied_out_bytes);
  CHECK(kept_intact(sublet_region_addr(r), second, 2));
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
}

/* RegionGrow on a raw connection: its Error code (0 for another reply, 1 for none). */
static int raw_grow(int fd, struct sl_wire_rx *rx, uint64_t region, uint64_t size) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionGrow grow = SUBLET__REGION_GROW__INIT;

  grow.region = region;
  grow.size = size;
  req.body_case = SUBLET__REQUEST__BODY_REGION_GROW;
  req.region_grow = &grow;
  return raw_call(fd, rx, &req, -1);
}

/* Releases a raw connection's region: answered once its pages are free again. */
static void raw_release(int fd, struct sl_wire_rx *rx, uint64_t region) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionRelease release = SUBLET__REGION_RELEASE__INIT;

  release.region = region;
  req.body_case = SUBLET__REQUEST__BODY_REGION_RELEASE;
  req.region_release = &release;
  CHECK(raw_call(fd, rx, &req, -1) == 0);
}

/* subletd refuses a growth while the region is offered (the library refuses it before it
 * asks), and another client's growth of a region not its own. */
static void raw_grow_refusals(sublet_region *theirs) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend lend = SUBLET__LEND__INIT;
  Sublet__Withdraw withdraw = SUBLET__WITHDRAW__INIT;
  Sublet__RegionCreate create = SUBLET__REGION_CREATE__INIT;
  struct sl_wire_rx rx;
  Sublet__Reply *rep;
  uint64_t region, mine;
  int fd;

  raw_session(&rx, 2, &fd, &region);
  CHECK(region != 0);
  CHECK(raw_grow(fd, &rx, sublet_region_id(theirs), 8 * PAGE) == SUBLET_EPERM);
  CHECK(raw_grow(fd, &rx, region, 8 * PAGE) == SUBLET_EINVAL); /* not growable */
  create.size = 2 * PAGE;
  create.has_growable = create.growable = 1;
  req.body_case = SUBLET__REQUEST__BODY_REGION_CREATE;
  req.region_create = &create;
  rep = raw_reply(fd, &rx, &req, -1);
  CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_REGION_CREATED);
  mine = rep->region_created->region;
  sublet__reply__free_unpacked(rep, NULL);
  lend.region = mine;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &lend;
  rep = raw_reply(fd, &rx, &req, -1);
  CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_LENT);
  withdraw.loan = rep->lent->loan;
  sublet__reply__free_unpacked(rep, NULL);
  CHECK(raw_grow(fd, &rx, mine, 8 * PAGE) == SUBLET_EBUSY);
  req.body_case = SUBLET__REQUEST__BODY_WITHDRAW;
  req.withdraw = &withdraw;
  CHECK(raw_call(fd, &rx, &req, -1) == 0);
  CHECK(raw_grow(fd, &rx, mine, 8 * PAGE) == 0);
  CHECK(raw_grow(fd, &rx, mine, 0) == SUBLET_EINVAL);
  raw_release(fd, &rx, mine);
  raw_release(fd, &rx, region);
  close(fd);
  sl_wire_rx_destroy(&rx);
}

/* What may not grow: a region made without growable, a size not above the region's, one past
 * the device, one the free memory cannot give (the region stays as it was, and grows later),
 * a lent region; and another client's region (raw). */
static void test_growable_refusals(void) {
  struct sublet_range all = {0, 4 * PAGE};
  sublet_client *c;
  sublet_region *r, *fixed, *big;
  uint64_t loan;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &fixed), 0);
  CHECK_RC(sublet_region_grow(fixed, 8 * PAGE), SUBLET_EINVAL);
  CHECK(strstr(sublet_last_error(), "growable") != NULL);
  CHECK(sublet_region_size(fixed) == 4 * PAGE);
  CHECK_RC(sublet_region_create_growable(c, 4 * PAGE, &r), 0);
  fill(sublet_region_addr(r), 4 * PAGE);
  CHECK_RC(sublet_region_grow(r, 4 * PAGE), SUBLET_EINVAL); /* not larger */
  CHECK_RC(sublet_region_grow(r, 2 * PAGE), SUBLET_EINVAL); /* a shrink */
  CHECK_RC(sublet_region_grow(r, TOTAL + 1), SUBLET_ENOMEM);
  CHECK(strstr(sublet_last_error(), "device") != NULL);
  CHECK_RC(sublet_region_grow(r, TOTAL), SUBLET_ENOMEM); /* the other region takes 4 pages */
  CHECK(sublet_region_size(r) == 4 * PAGE && kept_intact(sublet_region_addr(r), &all, 1));
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &loan, NULL), 0);
  CHECK_RC(sublet_region_grow(r, 8 * PAGE), SUBLET_EBUSY); /* offered */
  CHECK_RC(sublet_withdraw(c, loan), 0);
  raw_grow_refusals(r);
  CHECK_RC(sublet_region_grow(r, TOTAL - 4 * PAGE), 0); /* all that is free */
  CHECK(kept_intact(sublet_region_addr(r), &all, 1));
  CHECK_RC(sublet_region_create_growable(c, PAGE, &big), SUBLET_ENOMEM); /* nothing free */
  CHECK_RC(sublet_region_release(r), 0);
  CHECK_RC(sublet_region_release(fixed), 0);
  sublet_disconnect(c);
}

static int other_user_child(uint64_t loan, const uint8_t token[16]) {
  sublet_client *c;
  int rc;

  if (setgid(65534) != 0 || setuid(65534) != 0)
    return 10;
  /* Denied, not "cannot reach, start it": a daemon lives there, and the fix is its group. */
  rc = sublet_connect(daemon_.socket, &c);
  if (rc != SUBLET_EACCES)
    return 11;
  if (strstr(sublet_last_error(), "permission denied on") == NULL ||
      strstr(sublet_last_error(), "ask to be added to group") == NULL ||
      strstr(sublet_last_error(), "start it") != NULL)
    return 12;
  /* The test opens the socket to everyone: the books must refuse all the same. */
  if (write(3, "go", 2) != 2 || read(4, &rc, 1) != 1)
    return 13;
  if (sublet_connect(daemon_.socket, &c) != 0)
    return 14;
  rc = sublet_borrow(c, loan, token, NULL, 0);
  if (rc != SUBLET_EPERM || strstr(sublet_last_error(), "allow-group") == NULL)
    return 15;
  /* The next offer is one this user may borrow: another user's is not on offer to it. */
  if (sublet_borrow(c, 0, NULL, NULL, 0) != SUBLET_ENOOFFER)
    return 16;
  sublet_disconnect(c);
  return 0;
}

static void test_other_user_refused(void) {
  sublet_client *c;
  sublet_region *r;
  uint8_t token[16];
  uint64_t loan;
  int to_parent[2], to_child[2], status;
  char buf[2];
  pid_t pid;

  if (geteuid() != 0) {
    printf("  skipped: needs root to drop privileges in a child\n");
    return;
  }
  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_region_create(c, 4 * PAGE, &r), 0);
  CHECK_RC(sublet_lend(r, NULL, 0, 1, NULL, &loan, token), 0);
  CHECK(pipe(to_parent) == 0 && pipe(to_child) == 0);
  chmod(daemon_.dir, 0755);
  pid = fork();
  if (pid == 0) {
    dup2(to_parent[1], 3);
    dup2(to_child[0], 4);
    _exit(other_user_child(loan, token));
  }
  CHECK(read(to_parent[0], buf, 2) == 2);
  chmod(daemon_.socket, 0666);
  CHECK(write(to_child[1], "x", 1) == 1);
  waitpid(pid, &status, 0);
  chmod(daemon_.socket, 0660);
  CHECK(WIFEXITED(status));
  if (WEXITSTATUS(status) != 0)
    fprintf(stderr, "other-user child failed at step %d\n", WEXITSTATUS(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK_RC(sublet_withdraw(c, loan), 0);
  CHECK_RC(sublet_region_release(r), 0);
  sublet_disconnect(c);
  close(to_parent[0]);
  close(to_parent[1]);
  close(to_child[0]);
  close(to_child[1]);
}

/* A loan of the pools' arena is planned under the hold: from sublet_pool_hold() to
 * sublet_pool_unhold() no pool allocation of any tag is served (the free page between two
 * segments, which the loan lends, stays free), the layout id says whether a plan read before
 * the hold still holds, and a Lend of the arena without the hold is refused. */
static void test_pool_hold(void) {
  struct sublet_range pin = {0, PAGE};
  sublet_client *c;
  sublet_region *r;
  void *a, *b, *hole, *late;
  uint64_t layout, held, loan;

  CHECK_RC(connect_client(&c), 0);
  CHECK_RC(sublet_pool_alloc(c, 1, PAGE, &a), 0);
  CHECK_RC(sublet_pool_alloc(c, 1, PAGE, &hole), 0);
  CHECK_RC(sublet_pool_alloc(c, 1, PAGE, &b), 0);
  CHECK_RC(sublet_pool_free(c, hole), 0);           /* page 1: free, lent with tag 1 */
  r = sublet_pool_region(c);
  layout = sublet_pool_layout(c);
  CHECK_RC(sublet_lend_pinned(r, NULL, 0, 0, NULL, 0, 1, NULL, 0, &loan, NULL), SUBLET_EINVAL);
  CHECK(strstr(sublet_last_error(), "sublet_pool_hold") != NULL);
  CHECK_RC(sublet_pool_hold(c, &held), 0);
  CHECK(held == layout);
  CHECK_RC(sublet_pool_hold(c, NULL), SUBLET_EBUSY);  /* one loan of the arena at a time */
  CHECK_RC(sublet_pool_alloc(c, 2, PAGE, &late), SUBLET_EBUSY);
  CHECK(strstr(sublet_last_error(), "being lent") != NULL);
  CHECK(sublet_pool_layout(c) == held);
  CHECK_RC(sublet_lend_pinned(r, NULL, 0, 1, &pin, 1, 1, NULL, 0, &loan, NULL), 0);
  CHECK_RC(sublet_return(c, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, -1, NULL), 0);
  CHECK_RC(sublet_pool_alloc(c, 2, PAGE, &late), SUBLET_EBUSY); /* held until unheld */
  CHECK_RC(sublet_pool_unhold(c), 0);
  CHECK_RC(sublet_pool_alloc(c, 2, PAGE, &late), 0);
  CHECK(late == hole);                              /* first fit: the free page again */
  CHECK(sublet_pool_layout(c) != held);
  CHECK_RC(sublet_pool_free(c, late), 0);
  CHECK_RC(sublet_pool_free(c, a), 0);
  CHECK_RC(sublet_pool_free(c, b), 0);
  sublet_disconnect(c);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  srand(1);
  if (sl_test_daemon_start(&daemon_, PAGE, TOTAL) != 0)
    return 1;
  sl_test_run("hello", test_hello);
  sl_test_run("keep nothing", test_keep_nothing);
  sl_test_run("keep all", test_keep_all);
  sl_test_run("keep one range", test_keep_one_range);
  sl_test_run("keep scattered 4 KiB blocks", test_keep_scattered_blocks);
  sl_test_run("unkept pages first", test_unkept_first);
  sl_test_run("consecutive unkept pages in place", test_direct_runs);
  sl_test_run("keep ranges as bytes: shape checked", test_keep_ranges_shape);
  sl_test_run("keep ranges in a memfd: read, and checked", test_keep_in_a_memfd);
  sl_test_run("a layout the borrower has is left out", test_layout_left_out_when_known);
  sl_test_run("random keep sets", test_random_keeps);
  sl_test_run("pinned pages: never lent, the owner's writes kept", test_pinned_pages);
  sl_test_run("pinned pages refused", test_pinned_refusals);
  sl_test_run("borrower in another process", test_cross_process);
  sl_test_run("borrower killed mid-loan", test_borrower_killed);
  sl_test_run("another process keeps its window", test_window_kept);
  sl_test_run("free memory back", test_free_memory_back);
  sl_test_run("leak reported", test_leak_reported);
  sl_test_run("errors", test_errors);
  sl_test_run("malformed input", test_malformed_input);
  sl_test_run("client that never reads", test_client_that_never_reads);
  sl_test_run("waiter of a client gone deaf", test_waiter_of_a_client_gone_deaf);
  sl_test_run("status names the loan", test_status_names_the_loan);
  sl_test_run("shutdown mid-loan restores", test_shutdown_mid_loan_restores);
  sl_test_run("owner dies", test_owner_dies);
  sl_test_run("owner killed mid-loan", test_owner_killed_mid_loan);
  sl_test_run("waiting borrowers in order", test_waiting_borrowers_first_come_first_served);
  sl_test_run("loan names", test_loan_names);
  sl_test_run("the next offer is taken once", test_next_offer_taken_once);
  sl_test_run("local lends are never offers", test_local_lends_are_never_offers);
  sl_test_run("other user refused", test_other_user_refused);
  sl_test_run("a growable region grows in place", test_growable_region);
  sl_test_run("a kept window of a region that grew", test_growable_kept_window);
  sl_test_run("growth refused", test_growable_refusals);
  sl_test_run("a loan of the pools is planned under their hold", test_pool_hold);
  sl_test_run("many connections", test_many_connections);
  sl_test_run("free memory back at the end", test_free_memory_back);
  if (sl_test_daemon_stop(&daemon_) != 0) {
    fprintf(stderr, "subletd did not exit cleanly\n");
    sl_test_failed++;
  }
  return sl_test_summary("e2e");
}
