/* release_offers.c - release offers: a release that a scheduler in another process starts and
 * ends (PROTOCOL.md "Release offers", docs/design/release.md "Release offers"). subletd is
 * only the meeting point here: the owner's library releases and resumes its region itself
 * (releases.c does that work, on the region owner's connection); this file keeps who offered
 * what, who took it, where each offer is, and the requests that wait on it.
 *
 * An offer goes OFFERED -> (Take) TAKEN -> (the owner reports it released) RELEASED ->
 * (GiveBack, or the taker goes) RETURNING -> (the owner reports it resumed) ENDED. Taken by
 * need (Take.need_bytes, only of an offer whose owner said ReleaseOffer.by_need): RELEASED ->
 * (TakeMore) MORE -> (the owner reports more released, or why not) RELEASED; a need the owner
 * cannot give (its release fails ENEED) puts the offer back to OFFERED. While the
 * owner has nothing to do, its OfferStep waits (SL_WAIT_OFFER_STEP); the taker's TakeWait
 * waits for RELEASED or ENDED. Nothing here blocks: every wait is a waiter (waiters.c), found
 * again by its kind and the offer's id, and answered when the offer moves.
 *
 * Either side may go at any time. The taker gone: the owner is told to resume (at once, or
 * once it has released). The owner gone: the taker hears EOWNERGONE (the owner's memory went
 * back to the driver with its regions). An offer leaves the list once neither side needs it:
 * one that ended waits for its taker's next TakeWait or GiveBack (or the taker's end), so that
 * the taker learns how it ended.
 *
 * Floor 6 (daemon.h's floors).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "log.h"
#include "utf8.h"

#define PH(x) SUBLET__OFFER_PHASE__OFFER_##x
/* Live offers one connection may hold: each costs the daemon host memory, and an owner needs
 * one per tag it pauses, a handful. */
#define SL_OFFERS_PER_CONN 64
/* The bytes of an owner's failure text that reach its taker (PROTOCOL.md, Limits): enough for
 * libsublet's own messages (the longest, a refused need's, has its figures within 300 bytes
 * whatever they are), and the whole error stays within a message's room. */
#define SL_OWNER_TEXT 320

struct release_offer_failure {
  int code;
  char as[80];                 /* "": the owner's code; else what became of it */
  char why[SL_OWNER_TEXT + 1];
};

struct sl_release_offer {
  uint64_t id;
  char name[SL_LOAN_NAME_SIZE];
  uint64_t region;
  struct sl_peer owner;
  struct sl_conn *owner_conn;  /* the offer's connection; NULL once it went or heard ENDED */
  struct sl_conn *taker;       /* NULL: not taken, or the taker went or heard the end */
  struct sl_peer taker_peer;
  Sublet__OfferPhase phase;
  int given_back;              /* the taker gave it back or went: resume once released */
  int taker_gone;              /* ... went without giving it back (a give-back stays one) */
  int by_need;                 /* the owner's library releases by a taker's need */
  int has_need;                /* taken by need: */
  uint64_t need;               /* ... the taker's need in all that the release serves */
  uint64_t more_need;          /* MORE: the taker's need in all that the owner releases for */
  struct sl_err more_failure;  /* code != 0: why the owner could not release more (once) */
  struct sl_conn *refused;     /* a taker whose need the owner could not give (hears it once) */
  struct sl_err refusal;       /* ... what it hears */
  struct sl_err failure;       /* code != 0: how it ended for the taker (owner gone, failure) */
  char trouble[SL_OWNER_TEXT + 1]; /* why the owner's last resume failed (it tries again) */
  Sublet__OfferStats *released, *resumed; /* the owner's reports (owned copies) */
  struct sl_release_offer *next;
};

static const char *phase_name(Sublet__OfferPhase p) {
  switch (p) {
    case PH(OFFERED): return "offered";
    case PH(TAKEN): return "taken";
    case PH(RELEASED): return "released";
    case PH(RETURNING): return "returning";
    case PH(MORE): return "more";
    default: return "ended";
  }
}

/* ------------------------------------------------------------------ the list */

static struct sl_release_offer *find(const struct sl_daemon *d, uint64_t id) {
  struct sl_release_offer *o = d->release_offers;

  while (o != NULL && o->id != id)
    o = o->next;
  return o;
}

/* The text of an offer's waiter's timeout (waiters.c calls it). */
static void offer_timed_out(const struct sl_waiter *w, struct sl_err *err) {
  const struct sl_release_offer *o = find(w->d, w->loan_id);

  if (w->kind == SL_WAIT_TAKE)
    sl_err_set(err, SUBLET_ETIMEDOUT, "no release offer%s%s%s was on offer in time",
               w->name[0] ? " named \"" : "", w->name, w->name[0] ? "\"" : "");
  else if (o != NULL && o->trouble[0] != '\0')
    sl_err_set(err, SUBLET_ETIMEDOUT, "release offer %llu is %s still: the owner's resume "
               "fails (%s); free the memory taken meanwhile", (unsigned long long)o->id,
               phase_name(o->phase), o->trouble);
  else
    sl_err_set(err, SUBLET_ETIMEDOUT, "release offer %llu is %s still",
               (unsigned long long)w->loan_id, o != NULL ? phase_name(o->phase) : "gone");
}

/* A waiter of a release offer's request (SL_WAIT_OFFER_STEP, _TAKE, _TAKE_WAIT; timeout_ms < 0:
 * no timer), whose timeout offer_timed_out tells. */
static struct sl_waiter *park(struct sl_req *x, enum sl_waiter_kind kind, int timeout_ms) {
  struct sl_waiter *w = sl_waiters_park(x->c, kind, x->id, timeout_ms);

  if (w != NULL)
    w->timed_out = offer_timed_out;
  return w;
}

static void offer_free(struct sl_release_offer *o) {
  if (o->released != NULL)
    sublet__offer_stats__free_unpacked(o->released, NULL);
  if (o->resumed != NULL)
    sublet__offer_stats__free_unpacked(o->resumed, NULL);
  free(o);
}

/* Forgets the offers that neither side needs any more. Called last by every handler, so that
 * no offer is freed while a handler still holds it. */
static void sweep(struct sl_daemon *d) {
  struct sl_release_offer **link = &d->release_offers, *o;

  while ((o = *link) != NULL) {
    if (o->owner_conn != NULL || o->taker != NULL || o->refused != NULL) {
      link = &o->next;
      continue;
    }
    *link = o->next;
    offer_free(o);
  }
}

static struct sl_waiter *waiter_of(const struct sl_daemon *d, enum sl_waiter_kind kind,
                                   uint64_t offer) {
  for (struct sl_waiter *w = d->waiters; w != NULL; w = w->next)
    if (w->kind == kind && w->loan_id == offer)
      return w;
  return NULL;
}

/* A copy of an owner's report: its scalars (the plan's lists are the owner's own business). */
static Sublet__OfferStats *stats_copy(const Sublet__OfferStats *m) {
  Sublet__OfferStats top = *m;
  Sublet__ReleaseStats rs;
  Sublet__OfferStats *copy;
  size_t n;
  uint8_t *buf;

  if (m->release != NULL) {
    rs = *m->release;
    rs.n_released = rs.n_moves = rs.n_saves = rs.n_groups = 0;
    top.release = &rs;
  }
  n = sublet__offer_stats__get_packed_size(&top);
  if ((buf = malloc(n + 1)) == NULL)
    return NULL;
  sublet__offer_stats__pack(&top, buf);
  copy = sublet__offer_stats__unpack(NULL, n, buf);
  free(buf);
  return copy;
}

/* ------------------------------------------------------------------ answers */

static void send_state(struct sl_conn *c, uint64_t id, const struct sl_release_offer *o,
                       Sublet__OfferPhase phase) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__OfferState m = SUBLET__OFFER_STATE__INIT;

  m.offer = o->id;
  m.phase = phase;
  m.has_name = o->name[0] != '\0';
  m.name.data = (uint8_t *)o->name;
  m.name.len = strlen(o->name);
  m.has_region = m.has_owner_pid = m.has_owner_uid = 1;
  m.region = o->region;
  m.owner_pid = (uint32_t)o->owner.pid;
  m.owner_uid = (uint32_t)o->owner.uid;
  m.released = o->released;
  m.resumed = o->resumed;
  m.has_taker_gone = 1;
  m.taker_gone = o->taker_gone;
  m.has_need_bytes = o->has_need;
  m.need_bytes = phase == PH(MORE) ? o->more_need : o->need;
  rep.id = id;
  rep.body_case = SUBLET__REPLY__BODY_OFFER;
  rep.offer = &m;
  sl_conn_send(c, &rep, NULL, 0);
}

/* The owner's next task (TAKEN: release; MORE: release more; RETURNING: resume; ENDED:
 * stop), 0 while none. */
static Sublet__OfferPhase task_of(const struct sl_release_offer *o) {
  if (o->phase == PH(TAKEN) || o->phase == PH(MORE) || o->phase == PH(RETURNING) ||
      o->phase == PH(ENDED))
    return o->phase;
  return 0;
}

/* Gives the owner its task: the answer to req_id on c; ENDED is the last it hears. */
static void tell_owner(struct sl_release_offer *o, struct sl_conn *c, uint64_t req_id,
                       Sublet__OfferPhase task) {
  send_state(c, req_id, o, task);
  if (task == PH(ENDED))
    o->owner_conn = NULL;
}

/* The owner's waiting OfferStep hears its task, if it has one now. */
static void nudge_owner(struct sl_daemon *d, struct sl_release_offer *o) {
  Sublet__OfferPhase task = task_of(o);
  struct sl_waiter *w = task != 0 ? waiter_of(d, SL_WAIT_OFFER_STEP, o->id) : NULL;

  if (w == NULL)
    return;
  tell_owner(o, w->conn, w->req_id, task);
  sl_waiters_done(w);
}

/* Is the taker's wait over: the memory released (not given back yet; more of it, if asked),
 * more refused, or the offer over? */
static int settled(const struct sl_release_offer *o) {
  return o->failure.code != 0 || o->more_failure.code != 0 || o->phase == PH(ENDED) ||
         (o->phase == PH(RELEASED) && !o->given_back);
}

/* Tells the taker where its settled offer is; once it has heard the end, it is done with it. */
static void answer_taker(struct sl_release_offer *o, struct sl_conn *c, uint64_t id) {
  if (o->failure.code != 0) {
    sl_conn_send_error(c, id, &o->failure);
  } else if (o->more_failure.code != 0) { /* heard once; the taker holds the offer still */
    sl_conn_send_error(c, id, &o->more_failure);
    o->more_failure.code = 0;
    return;
  } else
    send_state(c, id, o, o->phase);
  if (o->failure.code != 0 || o->phase == PH(ENDED))
    o->taker = NULL;
}

static void nudge_taker(struct sl_daemon *d, struct sl_release_offer *o) {
  struct sl_waiter *w = settled(o) ? waiter_of(d, SL_WAIT_TAKE_WAIT, o->id) : NULL;

  if (w == NULL)
    return;
  answer_taker(o, w->conn, w->req_id);
  sl_waiters_done(w);
}

/* ------------------------------------------------------------------ checks */

/* The owner's uid, root, or --allow-group: Borrow's rule. */
static int may_take(const struct sl_conn *c, const struct sl_release_offer *o) {
  return sl_peer_reaches(&c->peer, o->owner.uid);
}

/* A live offer: its owner still there, not over. */
static int live(const struct sl_release_offer *o) {
  return o->owner_conn != NULL && o->phase != PH(ENDED);
}

/* May c hear of o at all: its owner's uid (root, --allow-group), or its taker? Another user
 * is told of an offer it may not see what it is told of a missing one, word for word. */
static int seen(const struct sl_conn *c, const struct sl_release_offer *o) {
  return o != NULL && (may_take(c, o) || o->taker == c || o->refused == c);
}

/* c took o by a need its owner could not give, and has not heard it yet: it hears it now,
 * whatever it asks of o (TakeWait, TakeMore, GiveBack); o is on offer again. */
static int refusal_pending(const struct sl_conn *c, const struct sl_release_offer *o) {
  return o != NULL && o->refused == c && o->taker != c;
}

static int hear_refusal(struct sl_conn *c, uint64_t id, struct sl_release_offer *o) {
  sl_conn_send_error(c, id, &o->refusal);
  o->refused = NULL;
  sweep(c->d);
  return 0;
}

/* The offer is x's connection's own (the owner's side). */
static int owned(struct sl_req *x, const struct sl_release_offer *o, uint64_t id) {
  if (!seen(x->c, o) || o->owner_conn == NULL)
    return sl_err_set(&x->err, SUBLET_ENOENT, "no release offer %llu: it has ended",
                      (unsigned long long)id);
  if (o->owner_conn != x->c)
    return sl_err_set(&x->err, SUBLET_EPERM, "release offer %llu is not this connection's: "
                      "only the connection that offered it steps it",
                      (unsigned long long)id);
  return 0;
}

/* The offer is x's connection's, as its taker (the scheduler's side). */
static int taken_by(struct sl_req *x, const struct sl_release_offer *o, uint64_t id) {
  if (!seen(x->c, o))
    return sl_err_set(&x->err, SUBLET_ENOENT, "no release offer %llu on this device: it has "
                      "ended (and its taker heard how), or it never was",
                      (unsigned long long)id);
  if (o->taker != x->c)
    return sl_err_set(&x->err, SUBLET_EPERM, "release offer %llu is not this client's: take "
                      "it first (sublet.take), and wait for it or give it back on the "
                      "connection that took it", (unsigned long long)id);
  return 0;
}

/* The offer a taker's request names (TakeWait, GiveBack, TakeMore), once it is x's as its
 * taker and no refusal waits to be heard: NULL when the request is answered or refused
 * already (*rc: 0 when answered, else the refusal's code). */
static struct sl_release_offer *takers_offer(struct sl_req *x, uint64_t id, int *rc) {
  struct sl_release_offer *o = find(x->d, id);

  *rc = refusal_pending(x->c, o) ? 0 : taken_by(x, o, id);
  if (*rc == 0 && refusal_pending(x->c, o)) {
    *rc = hear_refusal(x->c, x->id, o);
    return NULL;
  }
  return *rc == 0 ? o : NULL;
}

/* The region is the caller's process's, and not lent. */
static int may_offer(struct sl_req *x, uint64_t region, struct sl_region_info *ri) {
  const struct sl_peer *p = &x->c->peer;

  if (sl_books_region_info(x->d->books, region, ri) != 0 ||
      (ri->owner.uid != p->uid && !p->trusted))
    return sl_err_set(&x->err, SUBLET_ENOENT, "no region %llu on this device",
                      (unsigned long long)region);
  if (ri->owner.pid != p->pid || ri->owner.uid != p->uid)
    return sl_err_set(&x->err, SUBLET_EPERM, "region %llu is not this process's: a release "
                      "offer is made by the region owner's own process (libsublet opens a "
                      "connection of its own for it)", (unsigned long long)region);
  if (ri->loan_id != 0)
    return sl_err_set(&x->err, SUBLET_EBUSY, "region %llu is lent (loan %llu): offer its "
                      "release once the loan has ended", (unsigned long long)region,
                      (unsigned long long)ri->loan_id);
  return 0;
}

static int room_for_one(struct sl_req *x) {
  size_t n = 0;

  for (const struct sl_release_offer *o = x->d->release_offers; o != NULL; o = o->next)
    n += o->owner_conn == x->c;
  if (n < SL_OFFERS_PER_CONN)
    return 0;
  return sl_err_set(&x->err, SUBLET_EBUSY, "this connection has %zu live release offers, the "
                    "most it may: withdraw some first", n);
}

static int name_free(struct sl_req *x, const char *name) {
  for (const struct sl_release_offer *o = x->d->release_offers; name[0] != '\0' && o != NULL;
       o = o->next)
    if (live(o) && strcmp(o->name, name) == 0)
      return sl_err_set(&x->err, SUBLET_EBUSY, "a release offer named \"%s\" is live already "
                        "(offer %llu, %s): one offer of a name at a time; use another name, "
                        "or offer again once it has ended", name, (unsigned long long)o->id,
                        phase_name(o->phase));
  return 0;
}

/* ------------------------------------------------------------------ the owner's side */

static int offer_new(struct sl_req *x, const struct sl_region_info *ri, const char *name,
                     int by_need, struct sl_release_offer **out) {
  struct sl_release_offer *o = calloc(1, sizeof(*o)), **link = &x->d->release_offers;

  if (o == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  o->id = ++x->d->release_offers_made;
  snprintf(o->name, sizeof(o->name), "%s", name);
  o->region = ri->id;
  o->owner = x->c->peer;
  o->owner_conn = x->c;
  o->phase = PH(OFFERED);
  o->by_need = by_need;
  while (*link != NULL) /* at the tail: a Take without a name gets the oldest */
    link = &(*link)->next;
  *link = o;
  *out = o;
  return 0;
}

static int try_take(struct sl_conn *c, uint64_t id, const char *name, int has_need,
                    uint64_t need, struct sl_err *err);

/* A new offer: the oldest Take waiting for one that it suits takes it. */
static void offer_posted(struct sl_daemon *d) {
  struct sl_waiter *w, *next;
  struct sl_err err;

  for (w = d->waiters; w != NULL; w = next) {
    next = w->next;
    if (w->kind != SL_WAIT_TAKE || w->conn->closed)
      continue;
    if (try_take(w->conn, w->req_id, w->name, w->has_need, w->need_bytes, &err) != 0)
      continue; /* not for it: it goes on waiting */
    sl_waiters_done(w);
    return; /* one offer, one taker */
  }
}

int sl_release_offers_offer(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__ReleaseOffer *m = r->release_offer;
  struct sl_release_offer *o = NULL;
  struct sl_region_info ri;
  char name[SL_LOAN_NAME_SIZE];
  int rc = sl_daemon_loan_name(&x->err, "a release offer's name", m->has_name, m->name, name);

  if (rc == 0)
    rc = may_offer(x, m->region, &ri);
  if (rc == 0)
    rc = name_free(x, name);
  if (rc == 0)
    rc = room_for_one(x);
  if (rc == 0)
    rc = offer_new(x, &ri, name, m->has_by_need && m->by_need, &o);
  if (rc != 0)
    return rc;
  sl_info("release offer %llu (\"%s\") of region %llu by pid %d", (unsigned long long)o->id,
          o->name, (unsigned long long)o->region, (int)o->owner.pid);
  send_state(x->c, x->id, o, PH(OFFERED));
  offer_posted(x->d);
  return 0;
}

/* Released (TAKEN), or released more (MORE: the stats the release's in all now). */
static int reached_released(struct sl_req *x, struct sl_release_offer *o,
                            const Sublet__OfferStats *st) {
  struct sl_release_info ri;
  Sublet__OfferStats *copy;

  if ((o->phase != PH(TAKEN) && o->phase != PH(MORE)) || st == NULL || st->release == NULL ||
      sl_books_release_info(x->d->books, st->release->release, &ri) != 0 ||
      ri.region_id != o->region)
    return sl_err_set(&x->err, SUBLET_EINVAL, "OfferStep of release offer %llu (%s) says "
                      "RELEASED without a live release of region %llu taken: release it first",
                      (unsigned long long)o->id, phase_name(o->phase),
                      (unsigned long long)o->region);
  if ((copy = stats_copy(st)) == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  if (o->released != NULL)
    sublet__offer_stats__free_unpacked(o->released, NULL);
  o->released = copy;
  if (o->phase == PH(MORE))
    o->need = o->more_need;
  o->phase = o->given_back ? PH(RETURNING) : PH(RELEASED);
  nudge_taker(x->d, o);
  return 0;
}

static int reached_ended(struct sl_req *x, struct sl_release_offer *o,
                         const Sublet__OfferStats *st) {
  if (o->phase != PH(RETURNING) || st == NULL)
    return sl_err_set(&x->err, SUBLET_EINVAL, "OfferStep of release offer %llu (%s) says "
                      "resumed, but it was not given back", (unsigned long long)o->id,
                      phase_name(o->phase));
  if ((o->resumed = stats_copy(st)) == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  o->phase = PH(ENDED);
  o->trouble[0] = '\0';
  nudge_taker(x->d, o);
  return 0;
}

/* The owner's failure as the taker hears it: the owner's code when it is one of the
 * protocol's, else EIO naming it; its text printable and at most SL_OWNER_TEXT bytes. The
 * owner is another process, maybe another user's: what it sends goes to the taker and into
 * this daemon's log, where a code no one knows or an escape sequence must not arrive. */
static void owner_failure(struct release_offer_failure *f, const Sublet__OfferStep *m) {
  const char *why = m->failure != NULL ? m->failure : "";

  sl_utf8_printable(f->why, sizeof(f->why), (const uint8_t *)why, strlen(why));
  f->code = sl_err_known(m->failed) ? m->failed : SUBLET_EIO;
  if (f->code == m->failed)
    snprintf(f->as, sizeof(f->as), "%s", "");
  else
    snprintf(f->as, sizeof(f->as), " (its code %d is none of the protocol's: EIO here)",
             (int)m->failed);
}

/* A need the owner could not give (its release by need failed ENEED, nothing released): the
 * taker hears why (now, or at its next request) and lets go; the offer is on offer again. */
static void refuse(struct sl_daemon *d, struct sl_release_offer *o,
                   const struct release_offer_failure *f) {
  struct sl_waiter *w;

  sl_err_set(&o->refusal, f->code, "release offer %llu (\"%s\") cannot give what its taker "
             "needs, and is on offer again%s: %s", (unsigned long long)o->id, o->name, f->as,
             f->why);
  sl_info("%s", o->refusal.msg);
  o->refused = o->taker;
  o->taker = NULL;
  o->phase = PH(OFFERED);
  o->given_back = o->taker_gone = o->has_need = 0;
  o->need = 0;
  if (o->refused != NULL && (w = waiter_of(d, SL_WAIT_TAKE_WAIT, o->id)) != NULL) {
    hear_refusal(w->conn, w->req_id, o);
    sl_waiters_done(w);
  }
  offer_posted(d);
}

/* The owner's release or resume failed: a resume short of memory is tried again (the taker
 * must free it), a release by a need the owner cannot give puts the offer back on offer,
 * more of it that failed leaves it released (the taker hears why), anything else ends the
 * offer and the taker hears why. */
static int reached_failure(struct sl_req *x, struct sl_release_offer *o,
                           const Sublet__OfferStep *m) {
  struct release_offer_failure f;

  owner_failure(&f, m);
  if (o->phase == PH(TAKEN) && o->has_need && f.code == SUBLET_ENEED) {
    refuse(x->d, o, &f);
    return 0;
  }
  if (o->phase == PH(MORE)) {
    if (!o->given_back)
      sl_err_set(&o->more_failure, f.code, "the owner of release offer %llu could not release "
                 "more of it (it stays released as it was)%s: %s", (unsigned long long)o->id,
                 f.as, f.why);
    o->phase = o->given_back ? PH(RETURNING) : PH(RELEASED);
    nudge_taker(x->d, o);
    return 0;
  }
  if (o->phase == PH(RETURNING) && f.code == SUBLET_ENOMEM) {
    snprintf(o->trouble, sizeof(o->trouble), "%s", f.why);
    return 0;
  }
  sl_err_set(&o->failure, f.code, "the owner's %s of release offer %llu failed%s: %s",
             o->phase == PH(TAKEN) ? "release" : "resume", (unsigned long long)o->id, f.as,
             f.why);
  sl_warn("%s", o->failure.msg);
  o->phase = PH(ENDED);
  nudge_taker(x->d, o);
  return 0;
}

static int report(struct sl_req *x, struct sl_release_offer *o, const Sublet__OfferStep *m) {
  if (m->has_failed && m->failed < 0)
    return reached_failure(x, o, m);
  if (!m->has_reached)
    return 0;
  if (m->reached == PH(RELEASED))
    return reached_released(x, o, m->stats);
  if (m->reached == PH(ENDED))
    return reached_ended(x, o, m->stats);
  return sl_err_set(&x->err, SUBLET_EINVAL, "an OfferStep reaches RELEASED or ENDED, not %d",
                    (int)m->reached);
}

/* Answers the step with the owner's task, or parks it until there is one. */
static int next_task(struct sl_req *x, struct sl_release_offer *o, int withdraw) {
  Sublet__OfferPhase task;
  struct sl_waiter *w;

  if (withdraw && o->phase == PH(OFFERED)) {
    o->phase = PH(ENDED);
    sl_info("release offer %llu withdrawn by its owner", (unsigned long long)o->id);
  }
  if ((task = task_of(o)) != 0) {
    tell_owner(o, x->c, x->id, task);
    return 0;
  }
  if ((w = park(x, SL_WAIT_OFFER_STEP, -1)) == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  w->loan_id = o->id;
  return 0;
}

int sl_release_offers_step(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__OfferStep *m = r->offer_step;
  struct sl_release_offer *o = find(x->d, m->offer);
  int rc = owned(x, o, m->offer);

  if (rc == 0)
    rc = report(x, o, m);
  if (rc == 0)
    rc = next_task(x, o, m->withdraw);
  sweep(x->d);
  return rc;
}

/* ------------------------------------------------------------------ the taker's side */

/* The offer c may take by that name ("": any), or why none. */
static struct sl_release_offer *pick(struct sl_conn *c, const char *name, int has_need,
                                     struct sl_err *err) {
  struct sl_release_offer *o, *taken = NULL, *old = NULL;

  for (o = c->d->release_offers; o != NULL; o = o->next) {
    if (!live(o) || !may_take(c, o) || (name[0] != '\0' && strcmp(o->name, name) != 0))
      continue;
    if (o->phase == PH(OFFERED) && has_need && !o->by_need)
      old = o;
    else if (o->phase == PH(OFFERED))
      return o;
    else
      taken = o;
  }
  if (old != NULL) /* it would release everything: refused, the offer stays on offer */
    sl_err_set(err, SUBLET_ENOTSUP, "release offer %llu (\"%s\", pid %d) was made by an owner "
               "whose sublet predates take(need=): upgrade the owner's sublet, or take without "
               "a need", (unsigned long long)old->id, old->name, (int)old->owner.pid);
  else if (taken != NULL && name[0] != '\0')
    sl_err_set(err, SUBLET_EBUSY, "release offer %llu named \"%s\" is taken already (by pid "
               "%d): wait for it to be given back and offered again (take with a timeout)",
               (unsigned long long)taken->id, name, (int)taken->taker_peer.pid);
  else
    sl_err_set(err, SUBLET_ENOOFFER, "no release offer%s%s%s that this user may take is on "
               "offer on this device; check the name, or wait for its owner to offer "
               "(sublet.offer(..., release=True)); another user's offers are on offer only "
               "to root and --allow-group", name[0] ? " named \"" : "", name,
               name[0] ? "\"" : "");
  return NULL;
}

static int try_take(struct sl_conn *c, uint64_t id, const char *name, int has_need,
                    uint64_t need, struct sl_err *err) {
  struct sl_release_offer *o = pick(c, name, has_need, err);

  if (o == NULL)
    return err->code;
  o->taker = c;
  o->taker_peer = c->peer;
  o->phase = PH(TAKEN);
  o->has_need = has_need;
  o->need = has_need ? need : 0;
  sl_info("release offer %llu (\"%s\") taken by pid %d", (unsigned long long)o->id, o->name,
          (int)c->peer.pid);
  send_state(c, id, o, PH(TAKEN));
  nudge_owner(c->d, o);
  return 0;
}

int sl_release_offers_take(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__Take *m = r->take;
  char name[SL_LOAN_NAME_SIZE];
  struct sl_waiter *w;
  int rc = sl_daemon_loan_name(&x->err, "a release offer's name", m->has_name, m->name, name);

  if (rc == 0)
    rc = try_take(x->c, x->id, name, m->has_need_bytes, m->need_bytes, &x->err);
  if ((rc != SUBLET_ENOOFFER && rc != SUBLET_EBUSY) || m->timeout_ms == 0)
    return rc;
  if ((w = park(x, SL_WAIT_TAKE, m->timeout_ms)) == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  memcpy(w->name, name, sizeof(w->name));
  w->has_need = m->has_need_bytes;
  w->need_bytes = m->need_bytes;
  return 0;
}

int sl_release_offers_take_wait(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__TakeWait *m = r->take_wait;
  struct sl_waiter *w;
  int rc;
  struct sl_release_offer *o = takers_offer(x, m->offer, &rc);

  if (o == NULL)
    return rc;
  if (settled(o)) {
    answer_taker(o, x->c, x->id);
    sweep(x->d);
    return 0;
  }
  if (m->timeout_ms == 0)
    return sl_err_set(&x->err, SUBLET_ETIMEDOUT, "release offer %llu is %s still",
                      (unsigned long long)o->id, phase_name(o->phase));
  if ((w = park(x, SL_WAIT_TAKE_WAIT, m->timeout_ms)) == NULL)
    return sl_err_set(&x->err, SUBLET_ENOHOSTMEM, "out of host memory");
  w->loan_id = o->id;
  return 0;
}

/* The owner resumes once it has released (now, if it has). */
static void give_back(struct sl_daemon *d, struct sl_release_offer *o) {
  if (o->given_back)
    return;
  o->given_back = 1;
  if (o->phase == PH(RELEASED))
    o->phase = PH(RETURNING);
  nudge_owner(d, o);
}

int sl_release_offers_give_back(struct sl_req *x, const Sublet__Request *r) {
  int rc;
  struct sl_release_offer *o = takers_offer(x, r->give_back->offer, &rc);

  if (o == NULL)
    return rc;
  if (o->failure.code == 0)
    give_back(x->d, o);
  if (o->failure.code != 0)
    answer_taker(o, x->c, x->id);
  else /* the taker stays: its TakeWait hears the end */
    send_state(x->c, x->id, o, o->phase);
  sweep(x->d);
  return 0;
}

/* The taker needs more (need_bytes in all): its owner releases more of it (the task MORE). */
int sl_release_offers_take_more(struct sl_req *x, const Sublet__Request *r) {
  const Sublet__TakeMore *m = r->take_more;
  int rc;
  struct sl_release_offer *o = takers_offer(x, m->offer, &rc);

  if (o == NULL)
    return rc;
  if (o->failure.code != 0) { /* over: the taker hears how */
    answer_taker(o, x->c, x->id);
    sweep(x->d);
    return 0;
  }
  if (!o->has_need)
    return sl_err_set(&x->err, SUBLET_EINVAL, "release offer %llu was taken without a need: "
                      "its owner released every page it could already",
                      (unsigned long long)o->id);
  if (o->phase == PH(MORE) && !o->given_back && m->need_bytes == o->more_need) {
    send_state(x->c, x->id, o, PH(MORE)); /* asked again (a wait that timed out): wait on */
    return 0;
  }
  if (o->phase != PH(RELEASED) || o->given_back)
    return sl_err_set(&x->err, SUBLET_EBUSY, "release offer %llu is %s%s: ask for more once "
                      "it is released (TakeWait) and before giving it back",
                      (unsigned long long)o->id, phase_name(o->phase),
                      o->given_back ? " (given back)" : "");
  if (m->need_bytes <= o->need) { /* nothing to do */
    send_state(x->c, x->id, o, o->phase);
    return 0;
  }
  o->more_need = m->need_bytes;
  o->more_failure.code = 0;
  o->phase = PH(MORE);
  sl_info("release offer %llu: its taker (pid %d) needs %llu bytes in all, %llu before",
          (unsigned long long)o->id, (int)x->c->peer.pid, (unsigned long long)m->need_bytes,
          (unsigned long long)o->need);
  send_state(x->c, x->id, o, PH(MORE));
  nudge_owner(x->d, o);
  return 0;
}

/* ------------------------------------------------------------------ ends */

static void owner_went(struct sl_daemon *d, struct sl_release_offer *o) {
  o->owner_conn = NULL;
  if (o->phase != PH(ENDED) && o->failure.code == 0)
    sl_err_set(&o->failure, SUBLET_EOWNERGONE, "the owner of release offer %llu (pid %d) "
               "went while it was %s: its memory went back to the driver with its regions, "
               "and there is nothing to give back", (unsigned long long)o->id,
               (int)o->owner.pid, phase_name(o->phase));
  if (o->taker != NULL)
    sl_info("%s", o->failure.msg);
  nudge_taker(d, o);
}

static void taker_went(struct sl_daemon *d, struct sl_release_offer *o) {
  o->taker = NULL;
  if (o->given_back) /* it went after it gave the offer back: nothing was left undone */
    return;
  o->taker_gone = 1;
  if (o->owner_conn != NULL && o->phase != PH(ENDED))
    sl_info("the taker of release offer %llu (pid %d) went without giving it back: its owner "
            "resumes", (unsigned long long)o->id, (int)o->taker_peer.pid);
  give_back(d, o);
}

/* Offers on offer whose region went (the owner's library let go of it) end. */
static void end_orphans(struct sl_daemon *d) {
  struct sl_region_info ri;

  for (struct sl_release_offer *o = d->release_offers; o != NULL; o = o->next) {
    if (o->owner_conn == NULL || o->phase != PH(OFFERED) ||
        sl_books_region_info(d->books, o->region, &ri) == 0)
      continue;
    o->phase = PH(ENDED);
    nudge_owner(d, o);
  }
}

void sl_release_offers_gone(struct sl_conn *c) {
  for (struct sl_release_offer *o = c->d->release_offers; o != NULL; o = o->next) {
    if (o->owner_conn == c)
      owner_went(c->d, o);
    if (o->taker == c)
      taker_went(c->d, o);
    if (o->refused == c)
      o->refused = NULL;
  }
  end_orphans(c->d);
  sweep(c->d);
}

/* ------------------------------------------------------------------ status */

static int visible(const struct sl_conn *c, const struct sl_release_offer *o) {
  return live(o) && (sl_peer_reaches(&c->peer, o->owner.uid) || o->taker == c);
}

static void status_one(const struct sl_release_offer *o, Sublet__ReleaseOfferStatus *s) {
  const Sublet__ReleaseStats *rs = o->released != NULL ? o->released->release : NULL;

  sublet__release_offer_status__init(s);
  s->offer = o->id;
  s->state = (char *)phase_name(o->phase);
  s->name = o->name[0] != '\0' ? (char *)o->name : NULL;
  s->region = o->region;
  s->owner_pid = (uint32_t)o->owner.pid;
  s->owner_uid = (uint32_t)o->owner.uid;
  s->has_taker_pid = s->has_taker_uid = o->taker != NULL;
  s->taker_pid = (uint32_t)o->taker_peer.pid;
  s->taker_uid = (uint32_t)o->taker_peer.uid;
  s->has_released_pages = s->has_kept_bytes = s->has_copied_out_bytes = rs != NULL;
  s->released_pages = rs != NULL ? rs->released_pages : 0;
  s->kept_bytes = rs != NULL ? rs->kept_bytes : 0;
  s->copied_out_bytes = rs != NULL ? rs->copied_out_bytes : 0;
  s->trouble = o->trouble[0] != '\0' ? (char *)o->trouble : NULL;
  s->has_need_bytes = o->has_need;
  s->need_bytes = o->need;
}

/* One block: the pointers, then the messages (freed with sl_release_offers_status_free). */
int sl_release_offers_status(struct sl_conn *c, Sublet__Status *st) {
  size_t n = 0, k = 0;
  Sublet__ReleaseOfferStatus *msgs;
  const struct sl_release_offer *o;

  for (o = c->d->release_offers; o != NULL; o = o->next)
    n += visible(c, o);
  st->release_offers = calloc(1, (n + 1) * (sizeof(*st->release_offers) + sizeof(*msgs)));
  if (st->release_offers == NULL)
    return SUBLET_ENOHOSTMEM;
  msgs = (Sublet__ReleaseOfferStatus *)(st->release_offers + n + 1);
  for (o = c->d->release_offers; o != NULL && k < n; o = o->next) {
    if (!visible(c, o))
      continue;
    status_one(o, &msgs[k]);
    st->release_offers[k] = &msgs[k];
    k++;
  }
  st->n_release_offers = k;
  return 0;
}

void sl_release_offers_status_free(Sublet__Status *st) {
  free(st->release_offers);
  st->release_offers = NULL;
  st->n_release_offers = 0;
}
