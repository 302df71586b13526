/* fuzz_books.c - fuzzes the books (daemon/books/books.h) with scripts of hostile clients: the input is
 * a script of operations, each made by one of 8 clients with arguments the script chooses
 * (small numbers that name real ids and pages, or the values that break arithmetic:
 * UINT64_MAX, 2^63, ...), and sl_books_check must hold after every step. Whatever a client
 * asks, the books refuse it on their own or stay consistent: the handlers' checks are not
 * there to lean on.
 *
 * Script: one byte per operation (its number modulo OPS), one byte for the client (modulo 8),
 * then the bytes of its arguments (arg() below). The script ends where the input does.
 */
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "books.h"

#define CLIENTS 8
#define PAGE 64
#define MAX_KEEP 16
#define MAX_PINNED 4

struct script {
  const uint8_t *p, *end;
  struct sl_books *b;
  uint64_t client[CLIENTS]; /* 0: not connected */
  uint64_t draining[4];     /* loans whose borrower went, to finish */
  size_t ndraining;
};

static const uint64_t interesting[16] = {
    0, 1, 2, 3, 63, 64, 65, 4096, UINT32_MAX, (uint64_t)1 << 32, (uint64_t)1 << 63,
    UINT64_MAX / PAGE, UINT64_MAX / PAGE + 1, UINT64_MAX - 64, UINT64_MAX - 1, UINT64_MAX};

static uint8_t byte(struct script *s) {
  return s->p < s->end ? *s->p++ : 0;
}

/* A byte below 0x80 is itself (ids, pages and sizes that exist); above, an interesting value. */
static uint64_t arg(struct script *s) {
  uint8_t v = byte(s);

  return v < 0x80 ? v : interesting[v & 15];
}

static uint64_t client_of(struct script *s) {
  return s->client[byte(s) % CLIENTS];
}

static void op_connect(struct script *s) {
  uint8_t slot = byte(s) % CLIENTS, who = byte(s);
  struct sl_peer peer = {.pid = 100 + slot, .uid = who % 3 == 0 ? 0 : 1000 + who % 2,
                         .gid = 1000, .trusted = who % 3 == 0 || who % 5 == 0};

  if (s->client[slot] == 0 && sl_books_client_add(s->b, &peer, &s->client[slot]) == 0 &&
      who & 4)
    sl_books_client_notices(s->b, s->client[slot]); /* it may keep windows (kept.c) */
}

static void op_disconnect(struct script *s) {
  uint8_t slot = byte(s) % CLIENTS;
  struct sl_client_gone gone = {0};

  if (sl_books_client_remove(s->b, s->client[slot], &gone) == 0) {
    for (size_t i = 0; i < gone.ndraining && s->ndraining < 4; i++)
      s->draining[s->ndraining++] = gone.draining_loans[i];
    s->client[slot] = 0;
  }
  sl_client_gone_clear(&gone);
}

/* The daemon asks for no region larger than its device (handlers.c checks the size first):
 * sizes past the books' own bound must be refused by the books, those between would only be
 * allocations that fail. */
#define DEVICE_PAGES 4096
static void op_region_add(struct script *s) {
  uint64_t c = client_of(s), npages = arg(s), id;

  if (npages <= DEVICE_PAGES || npages > UINT64_MAX / PAGE)
    sl_books_region_add(s->b, c, npages, &id, NULL);
}

static void op_region_add_growable(struct script *s) {
  uint64_t c = client_of(s), npages = arg(s), id;

  if (npages <= DEVICE_PAGES || npages > UINT64_MAX / PAGE)
    sl_books_region_new(s->b, c, npages, 1, &id, NULL);
}

/* A growth must leave the region at exactly the pages asked, or as it was. */
static void op_region_grow(struct script *s) {
  uint64_t c = client_of(s), r = arg(s), npages = arg(s);
  struct sl_region_info ri;

  if (npages > DEVICE_PAGES && npages <= UINT64_MAX / PAGE)
    return;
  if (sl_books_region_grow(s->b, c, r, npages, NULL) == 0 &&
      (sl_books_region_info(s->b, r, &ri) != 0 || ri.npages != npages || !ri.growable)) {
    fprintf(stderr, "fuzz_books: region %llu grew to other than %llu pages\n",
            (unsigned long long)r, (unsigned long long)npages);
    abort();
  }
}

static void op_region_remove(struct script *s) {
  uint64_t c = client_of(s);

  sl_books_region_remove(s->b, c, arg(s), NULL);
}

/* Pages granted must be pages of the region, however first + count wraps. */
static void op_pages(struct script *s) {
  uint64_t c = client_of(s), r = arg(s), first = arg(s), count = arg(s);
  struct sl_region_info ri;

  sl_books_region_access(s->b, c, r, NULL);
  if (sl_books_pages_granted(s->b, c, r, first, count, NULL) == 0 &&
      (sl_books_region_info(s->b, r, &ri) != 0 || count == 0 || first >= ri.npages ||
       count > ri.npages - first)) {
    fprintf(stderr, "fuzz_books: pages [%llu, +%llu) of region %llu granted\n",
            (unsigned long long)first, (unsigned long long)count, (unsigned long long)r);
    abort();
  }
}

static void op_lend(struct script *s) {
  static const uint8_t token[16] = {7};
  struct sublet_range keep[MAX_KEEP];
  uint64_t c = client_of(s), r = arg(s), loan;
  size_t n = byte(s) % (MAX_KEEP + 1);
  uint8_t flags = byte(s);

  uint64_t pinned[2 * MAX_PINNED];
  size_t npinned = flags & 4 ? byte(s) % (MAX_PINNED + 1) : 0;

  for (size_t i = 0; i < n; i++) {
    keep[i].offset = arg(s);
    keep[i].length = arg(s);
  }
  /* Pairs the script chooses: out of order, overlapping, empty, past the region, over kept
   * bytes, all of them to be refused; or pages the loan must then never touch. */
  for (size_t i = 0; i < 2 * npinned; i++)
    pinned[i] = arg(s);
  sl_books_lend_pinned(s->b, c, r, keep, n, flags & 1, pinned, npinned,
                       flags & 2 ? "kv" : NULL, token, &loan, NULL);
}

static void op_withdraw(struct script *s) {
  uint64_t c = client_of(s);

  sl_books_loan_owned(s->b, c, arg(s), NULL);
  sl_books_withdraw(s->b, c, arg(s), NULL);
}

static void op_borrow(struct script *s) {
  static const uint8_t token[16] = {7}, wrong[16] = {8};
  uint64_t c = client_of(s), loan = arg(s), fresh = arg(s), got;
  uint8_t how = byte(s);
  const uint64_t *pages;
  uint64_t u, f, k;

  if (sl_books_borrow(s->b, c, loan, how & 1 ? token : how & 2 ? wrong : NULL,
                      how & 4 ? "kv" : NULL, fresh, &got, NULL) == 0)
    sl_books_loan_layout(s->b, got, &pages, &u, &f, &k);
}

/* The daemon's plan / do / commit; the device work fails when the script says so. */
static void op_alloc(struct script *s) {
  uint64_t c = client_of(s), size = arg(s) * (byte(s) % 4 == 0 ? PAGE : 1);
  int device_ok = byte(s) % 8 != 0;
  struct sl_grant g = {0};

  if (sl_books_alloc_plan(s->b, c, size, &g, NULL) == 0 && device_ok)
    sl_books_alloc_commit(s->b, &g);
  sl_grant_clear(&g);
}

static void op_free(struct script *s) {
  uint64_t c = client_of(s), size;

  sl_books_free_alloc(s->b, c, arg(s), &size, NULL);
}

/* The daemon's fresh pages for a loan to another user: made (all), or not (none). */
static void end_replaced(struct script *s, struct sl_loan_end *end) {
  if (end->nreplace > 0)
    sl_books_pages_replaced(s->b, end, byte(s) & 1 ? end->nreplace : 0);
  sl_loan_end_clear(end);
}

static void op_return(struct script *s) {
  uint64_t c = client_of(s);
  uint64_t loan = sl_books_client_loan(s->b, c);
  struct sublet_leak leaks[4];
  struct sl_loan_end end = {0};

  if (loan != 0)
    sl_books_leaks(s->b, loan, leaks, 4);
  sl_books_return(s->b, c, byte(s) & 1, &end, NULL);
  end_replaced(s, &end);
}

static void op_finish(struct script *s) {
  struct sl_loan_end end = {0};
  uint64_t loan = s->ndraining > 0 ? s->draining[--s->ndraining] : arg(s);

  sl_books_loan_finish(s->b, loan, &end);
  end_replaced(s, &end);
}

static void op_look(struct script *s) {
  struct sl_region_info ri;
  struct sl_loan_info li;
  struct sl_books_totals t;

  sl_books_region_info(s->b, arg(s), &ri);
  sl_books_region_next(s->b, arg(s), &ri);
  sl_books_loan_info(s->b, arg(s), &li);
  sl_books_loan_info(s->b, sl_books_current_loan(s->b), &li);
  sl_books_totals(s->b, &t);
}

/* A client says it let go of a region's window (Dropped), kept or not, gone or not. */
static void op_drop(struct script *s) {
  uint64_t c = client_of(s), region = arg(s);
  struct sl_held_info held[4];
  int last;

  sl_books_kept_drop(s->b, c, region, &last, NULL);
  sl_books_kept_held(s->b, held, 4);
}

static void (*const ops[])(struct script *) = {
    op_connect, op_connect, op_disconnect, op_region_add, op_region_add, op_region_remove,
    op_pages,   op_lend,    op_lend,       op_withdraw,   op_borrow,     op_borrow,
    op_alloc,   op_alloc,   op_alloc,      op_free,       op_free,       op_return,
    op_finish,  op_look,    op_drop,       op_region_add_growable,       op_region_grow};
#define OPS (sizeof(ops) / sizeof(ops[0]))

/* $SUBLET_FUZZ_TRACE: what each step left, to read a script (a crash's, a seed). */
static void trace_step(const struct script *s, int step, unsigned op) {
  struct sl_books_totals t;
  struct sl_loan_info li = {0};

  sl_books_totals(s->b, &t);
  sl_books_loan_info(s->b, sl_books_current_loan(s->b), &li);
  fprintf(stderr, "step %d op %u: %llu clients, %llu regions, loan %llu state %d hwm %llu "
          "live %llu allocs, %llu bytes saved\n", step, op, (unsigned long long)t.clients,
          (unsigned long long)t.regions, (unsigned long long)li.id, (int)li.state,
          (unsigned long long)li.hwm, (unsigned long long)li.live_allocs,
          (unsigned long long)t.copied_out_bytes);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int trace = -1;
  struct sl_books_config cfg = {.page_size = PAGE, .no_compact = size > 0 && data[0] & 1};
  struct script s = {.p = data, .end = data + size};
  char why[256];

  if (trace < 0)
    trace = getenv("SUBLET_FUZZ_TRACE") != NULL;
  if (sl_books_new(&cfg, &s.b) != 0)
    abort();
  byte(&s); /* the configuration's byte */
  for (int step = 0; s.p < s.end; step++) {
    unsigned op = byte(&s) % OPS;
    ops[op](&s);
    if (trace)
      trace_step(&s, step, op);
    if (sl_books_check(s.b, why, sizeof(why)) != 0) {
      fprintf(stderr, "fuzz_books: step %d broke the books: %s\n", step, why);
      abort();
    }
  }
  sl_books_free(s.b);
  return 0;
}

/* ------------------------------------------------------------------ seeds */

/* Op numbers, as ops[] lists them. */
enum { CONNECT = 0, DISCONNECT = 2, REGION_ADD = 3, REGION_REMOVE = 5, PAGES = 6, LEND = 7,
       WITHDRAW = 9, BORROW = 10, ALLOC = 12, FREE = 15, RETURN = 17, FINISH = 18, LOOK = 19,
       DROP = 20 };
#define BIG(k) (0x80 | (k)) /* interesting[k] */

/* Whole stories: two clients, a region of 16 pages, a loan with kept ranges, a borrow by
 * token, allocations through the unkept, fresh and kept pages, pages asked for, a free, a
 * return; then the same with the borrower going mid-loan, the owner going, and hostile
 * arguments (page ranges and keep ranges that wrap around, sizes that overflow). */
static const uint8_t story_loan[] = {
    0, CONNECT, 0, 1, CONNECT, 1, 1, REGION_ADD, 0, 16,
    LEND, 0, 1, 2, 0, 5, 10, 100, 70,
    BORROW, 1, 1, 2, 1,
    ALLOC, 1, 4, 0, 1, ALLOC, 1, 12, 0, 1, ALLOC, 1, 4, 0, 0, ALLOC, 1, 2, 0, 1,
    PAGES, 1, 1, 0, 4, FREE, 1, 1, LOOK, 1, 1, 1, RETURN, 1, 1, LOOK, 1, 1, 1};
static const uint8_t story_borrower_goes[] = {
    1, CONNECT, 0, 1, CONNECT, 1, 1, REGION_ADD, 0, 16,
    LEND, 0, 1, 1, 0, 0, 100,
    BORROW, 1, 1, 0, 1, ALLOC, 1, 8, 0, 1, ALLOC, 1, 8, 0, 1,
    DISCONNECT, 1, FINISH, LOOK, 1, 1, 1, REGION_REMOVE, 0, 1};
static const uint8_t story_owner_goes[] = {
    0, CONNECT, 0, 1, CONNECT, 1, 1, REGION_ADD, 0, 16,
    LEND, 0, 1, 0, 1, BORROW, 1, 1, 4, 1, ALLOC, 1, 16, 0, 1,
    DISCONNECT, 0, FREE, 1, 1, RETURN, 1, 0, RETURN, 1, 1};
static const uint8_t story_hostile[] = {
    0, CONNECT, 0, 1, CONNECT, 1, 2, REGION_ADD, 0, BIG(11), REGION_ADD, 0, BIG(12),
    REGION_ADD, 0, BIG(15), REGION_ADD, 0, 8,
    LEND, 0, 2, 3, 0, BIG(15), 1, 1, BIG(15), BIG(14), BIG(2),
    LEND, 0, 2, 2, 0, 3, 5, 1, 4,
    BORROW, 1, 1, BIG(15), 1, BORROW, 1, 1, 2, 1, ALLOC, 1, BIG(15), 1, 1, ALLOC, 1, BIG(13), 0, 1,
    ALLOC, 1, 3, 0, 1,
    PAGES, 1, 2, BIG(15), 2, PAGES, 1, 2, BIG(14), BIG(3), PAGES, 0, 2, BIG(13), BIG(6),
    PAGES, 1, 2, 0, BIG(15), WITHDRAW, 0, BIG(15), BIG(15), FREE, 1, BIG(15),
    RETURN, 1, 0, FREE, 1, 1, RETURN, 1, 0, FINISH, BIG(15)};

/* Kept windows: two borrowers of the owner's uid that hear notices keep the region after
 * their loans; the owner releases it, one says Dropped (twice), the owner goes, the other
 * goes. */
static const uint8_t story_kept[] = {
    0, CONNECT, 0, 1, CONNECT, 1, 5, CONNECT, 2, 5, REGION_ADD, 0, 8, REGION_ADD, 0, 4,
    LEND, 0, 1, 0, 0, BORROW, 1, 1, 0, 1, ALLOC, 1, 4, 0, 1, FREE, 1, 1, RETURN, 1, 0,
    LEND, 0, 1, 0, 0, BORROW, 2, 2, 0, 1, RETURN, 2, 0,
    LEND, 0, 2, 0, 0, BORROW, 2, 3, 0, 1, RETURN, 2, 0,
    REGION_REMOVE, 0, 1, DROP, 1, 1, DROP, 1, 1, DISCONNECT, 0, DISCONNECT, 2, DROP, 1, 2};

static const struct {
  const uint8_t *data;
  size_t len;
} seeds[] = {
    {story_loan, sizeof(story_loan)},
    {story_borrower_goes, sizeof(story_borrower_goes)},
    {story_owner_goes, sizeof(story_owner_goes)},
    {story_hostile, sizeof(story_hostile)},
    {story_kept, sizeof(story_kept)},
};

size_t sl_fuzz_seed(unsigned i, uint8_t *buf, size_t cap) {
  if (i >= sizeof(seeds) / sizeof(seeds[0]) || cap < seeds[i].len)
    return 0;
  memcpy(buf, seeds[i].data, seeds[i].len);
  return seeds[i].len;
}
