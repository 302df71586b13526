/* take.c - libsublet: release offers, the scheduler's side (docs/design/release.md, "Release
 * offers"; the owner's side is release_offer.c, subletd's daemon/release_offers.c).
 *
 * A scheduler takes an offer (Take; with a need: Take.need_bytes), waits until the owner has
 * released it (TakeWait), lets anyone use the memory, asks for more of it (TakeMore, then
 * TakeWait), gives it back (GiveBack) and waits until the owner has resumed (TakeWait). It
 * maps nothing: the memory is the driver's, for any process. Each call is one request on the
 * caller's client, its lock held.
 * Floor 9 (client.h's floors).
 */
#include "client.h"

#include <string.h>

#include "msg.h"

static int no_offers(const sublet_client *c) {
  return sl_client_fail(SUBLET_ENOTSUP, "subletd at %s cannot offer releases (it is older "
                        "than this library): update subletd", c->path);
}

/* One request answered Offer: its state into *rep (the caller frees it). */
static int offer_call(sublet_client *c, Sublet__Request *req, Sublet__Reply **rep,
                      int wait_ms) {
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = c->offer_ok ? sl_client_call(c, req, SUBLET__REPLY__BODY_OFFER, rep, NULL, NULL, wait_ms)
                   : no_offers(c);
  pthread_mutex_unlock(&c->lock);
  return rc;
}

static int take_call(sublet_client *c, const char *name, int by_need, uint64_t need_bytes,
                     int timeout_ms, uint64_t *offer_id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Take m = SUBLET__TAKE__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  m.has_name = name != NULL; /* "" too: subletd refuses it (LoanName is 1 to 63 bytes) */
  m.name.data = (uint8_t *)name;
  m.name.len = m.has_name ? strlen(name) : 0;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
  m.has_need_bytes = by_need;
  m.need_bytes = need_bytes;
  req.body_case = SUBLET__REQUEST__BODY_TAKE;
  req.take = &m;
  rc = offer_call(c, &req, &rep, m.timeout_ms);
  if (rc == 0 && offer_id != NULL)
    *offer_id = rep->offer->offer;
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_take(sublet_client *c, const char *name, int timeout_ms,
                              uint64_t *offer_id) {
  return take_call(c, name, 0, 0, timeout_ms, offer_id);
}

/* A subletd older than take(need=) would ignore Take.need_bytes: the owner would release
 * everything. Nothing is sent to it. */
static int no_take_need(const sublet_client *c) {
  return sl_client_fail(SUBLET_ENOTSUP, "subletd at %s predates take(need=) (it cannot pass a "
                        "taker's need to the owner): upgrade subletd", c->path);
}

SUBLET_EXPORT int sublet_take_need(sublet_client *c, const char *name, uint64_t need_bytes,
                                   int timeout_ms, uint64_t *offer_id) {
  int ok;

  pthread_mutex_lock(&c->lock);
  ok = c->take_need_ok;
  pthread_mutex_unlock(&c->lock);
  if (!ok)
    return no_take_need(c);
  return take_call(c, name, 1, need_bytes, timeout_ms, offer_id);
}

SUBLET_EXPORT int sublet_take_more(sublet_client *c, uint64_t offer_id, uint64_t need_bytes,
                                   int *state) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__TakeMore m = SUBLET__TAKE_MORE__INIT;
  Sublet__Reply *rep = NULL;
  int rc, ok;

  pthread_mutex_lock(&c->lock);
  ok = c->take_need_ok;
  pthread_mutex_unlock(&c->lock);
  if (!ok)
    return no_take_need(c);
  m.offer = offer_id;
  m.need_bytes = need_bytes;
  req.body_case = SUBLET__REQUEST__BODY_TAKE_MORE;
  req.take_more = &m;
  rc = offer_call(c, &req, &rep, 0);
  if (rc == 0 && state != NULL)
    *state = rep->offer->phase;
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_take_wait(sublet_client *c, uint64_t offer_id, int timeout_ms,
                                   int *state, struct sublet_release_stats *stats) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__TakeWait m = SUBLET__TAKE_WAIT__INIT;
  Sublet__Reply *rep = NULL;
  const Sublet__OfferState *s;
  int rc;

  m.offer = offer_id;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms < 0 ? -1 : timeout_ms;
  req.body_case = SUBLET__REQUEST__BODY_TAKE_WAIT;
  req.take_wait = &m;
  rc = offer_call(c, &req, &rep, m.timeout_ms);
  if (rc == 0) {
    s = rep->offer;
    if (state != NULL)
      *state = s->phase;
    if (stats != NULL)
      sl_offer_stats_from(s->phase == SUBLET__OFFER_PHASE__OFFER_ENDED ? s->resumed
                                                                        : s->released,
                          stats);
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_give_back(sublet_client *c, uint64_t offer_id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__GiveBack m = SUBLET__GIVE_BACK__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  m.offer = offer_id;
  req.body_case = SUBLET__REQUEST__BODY_GIVE_BACK;
  req.give_back = &m;
  rc = offer_call(c, &req, &rep, 0);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}
