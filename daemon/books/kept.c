/* kept.c - the books of kept windows: which clients keep a region's pages between its loans,
 * and which still hold the pages of a region that has gone (the contract is books.h).
 *
 * A keeper is a client with kept_region set: a borrower in another process, of the owner's
 * uid, that hears notices, after a loan of that live region. When the region leaves the books,
 * each of its keepers becomes a holder (an sl_held entry) until it says Dropped or leaves; the
 * daemon releases the region's pages when its last holder is gone. The held array always has
 * room for every keeper to become a holder, so a region leaves without allocating.
 *
 * Floor 1 (books_impl.h).
 */
#include "books_impl.h"
#include "grow.h"

#include <inttypes.h>

size_t sl_books_kept_keepers(const struct sl_books *b) {
  size_t n = 0;

  for (size_t i = 0; i < b->nclients; i++)
    n += b->clients[i].kept_region != 0;
  return n;
}

int sl_books_kept_reserve(struct sl_books *b) {
  struct sl_held *v = sl_grow(b->held, &b->cap_held, b->nheld + sl_books_kept_keepers(b) + 1, sizeof(*v));

  if (v == NULL)
    return SUBLET_ENOHOSTMEM;
  b->held = v;
  return 0;
}

int sl_books_kept_window(const struct sl_books *b, uint64_t client_id, uint64_t region_id) {
  const struct sl_client *c = sl_books_find_client(b, client_id);
  const struct sl_region *r = sl_books_find_region(b, region_id);

  return c != NULL && r != NULL && r->owner_client != c->id && r->owner.uid == c->peer.uid;
}

void sl_books_client_notices(struct sl_books *b, uint64_t client_id) {
  struct sl_client *c = sl_books_find_client(b, client_id);

  if (c != NULL)
    c->notices = 1;
}

/* Called before the loan leaves the books: its borrower keeps the window if it said it would
 * and the region stays (with its owner gone the borrower lets go itself: Returned says so). */
void sl_books_kept_loan_end(struct sl_books *b, const struct sl_loan *l) {
  struct sl_client *c = sl_books_find_client(b, l->borrower_client);

  if (c == NULL)
    return;
  c->kept_region = c->keeps && !l->owner_gone ? l->region_id : 0;
  c->keeps = 0;
}

void sl_books_kept_retire(struct sl_books *b, const struct sl_region *r) {
  for (size_t i = 0; i < b->nclients; i++) {
    struct sl_client *c = &b->clients[i];
    if (c->kept_region != r->id)
      continue;
    b->held[b->nheld++] = (struct sl_held){.region_id = r->id, .npages = r->npages,
                                           .space = r->space,
                                           .holder_client = c->id, .owner = r->owner,
                                           .holder = c->peer};
    c->kept_region = 0;
  }
}

static struct sl_held *held_find(const struct sl_books *b, uint64_t client_id,
                                 uint64_t region_id) {
  for (size_t i = 0; i < b->nheld; i++)
    if (b->held[i].holder_client == client_id && b->held[i].region_id == region_id)
      return &b->held[i];
  return NULL;
}

int sl_books_kept_holds(const struct sl_books *b, uint64_t client_id, uint64_t region_id) {
  return held_find(b, client_id, region_id) != NULL;
}

size_t sl_books_kept_holders(const struct sl_books *b, uint64_t region_id) {
  size_t n = 0;

  for (size_t i = 0; i < b->nheld; i++)
    n += b->held[i].region_id == region_id;
  return n;
}

static void held_remove(struct sl_books *b, struct sl_held *h) {
  *h = b->held[--b->nheld];
}

int sl_books_kept_drop(struct sl_books *b, uint64_t client_id, uint64_t region_id, int *last,
                       struct sl_err *err) {
  struct sl_client *c = sl_books_find_client(b, client_id);
  struct sl_held *h = held_find(b, client_id, region_id);

  *last = 0;
  if (h != NULL) {
    held_remove(b, h);
    *last = sl_books_kept_holders(b, region_id) == 0;
    return 0;
  }
  if (c != NULL && c->kept_region == region_id && region_id != 0) {
    c->kept_region = 0;
    return 0;
  }
  return sl_err_set(err, SUBLET_ENOENT, "client %" PRIu64 " kept no window of region %" PRIu64
                    ": nothing to drop", client_id, region_id);
}

size_t sl_books_kept_count(const struct sl_books *b, uint64_t client_id) {
  size_t n = 0;

  for (size_t i = 0; i < b->nheld; i++)
    n += b->held[i].holder_client == client_id;
  return n;
}

/* The client's held entries go; freed[] (room for sl_books_kept_count) gets the regions it was
 * the last holder of. */
void sl_books_kept_client_gone(struct sl_books *b, uint64_t client_id, uint64_t *freed,
                               size_t *nfreed) {
  size_t i = 0;

  while (i < b->nheld) {
    struct sl_held *h = &b->held[i];
    uint64_t region = h->region_id;
    if (h->holder_client != client_id) {
      i++;
      continue;
    }
    held_remove(b, h);
    if (sl_books_kept_holders(b, region) == 0)
      freed[(*nfreed)++] = region;
  }
}

size_t sl_books_kept_held(const struct sl_books *b, struct sl_held_info *out, size_t n) {
  for (size_t i = 0; i < b->nheld && i < n; i++)
    out[i] = (struct sl_held_info){.region_id = b->held[i].region_id,
                                   .npages = b->held[i].npages, .owner = b->held[i].owner,
                                   .holder_client = b->held[i].holder_client,
                                   .holder = b->held[i].holder};
  return b->nheld;
}
