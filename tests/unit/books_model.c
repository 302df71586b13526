/* books_model.c - the books' reference model (the contract is books_model.h): the model's
 * clients, regions and one loan, each operation done on both sides with the answer the rules of
 * books.h give, and the comparison of the two after every step.
 */
#define SL_CHECK_SHARED /* the checks count into the test's tally */
#include "books_model.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "books.h"
#include "check.h"
#include "books_fixtures.h"

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

void books_model_run(uint64_t seed, uint64_t page_size, int steps, int compact) {
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
