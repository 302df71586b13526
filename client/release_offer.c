/* release_offer.c - libsublet: release offers, the owner's side (docs/design/release.md,
 * "Release offers"; subletd's side is daemon/release_offers.c, the scheduler's take.c).
 *
 * The owner offers a release; a thread of this library, on a connection of the offer's own
 * (the owner's client may be busy with anything meanwhile, and a waiting request holds a
 * connection), steps the offer: it waits for a task (OfferStep), does it with the owner's own
 * client, and reports. Taken: it releases (sublet_release, with the lists copied at the
 * offer; taken by need: sublet_release_need, with the taker's need). Asked for more (the task
 * MORE, a taker's TakeMore): sublet_release_more on the live release, nothing resumed. Given
 * back, or the taker gone: it resumes (sublet_resume). If subletd dies while the
 * memory is released, the thread resumes alone (release.c: from the save area and the plan),
 * so the owner gets its kept bytes back whatever happens to the daemon or the taker.
 *
 * The owner waits on o->cond for the end; withdrawing cancels the thread's waiting step
 * (sublet_cancel) until the thread has sent a step that withdraws, or the offer was taken.
 * Floor 8 (client.h's floors).
 */
#include "client.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "msg.h"

#define PH(x) SUBLET__OFFER_PHASE__OFFER_##x

struct sublet_release_offer {
  sublet_region *r;
  sublet_client *ev;            /* the offer's own connection; owned */
  pthread_t thread;
  pthread_mutex_t mu;           /* guards what follows the lists */
  pthread_cond_t cond;          /* done, state changes */
  uint64_t id;
  struct sublet_range *pages, *keep; /* copies (owned); NULL/0: as sublet_release */
  size_t npages, nkeep;
  int keep_all;
  uint64_t stay;
  int state;                    /* enum sublet_offer_state */
  int withdraw;                 /* asked: the thread's next step withdraws while on offer */
  int done;                     /* the thread has finished: rc and msg say how */
  int rc;
  char msg[sizeof(((struct sl_err *)0)->msg)];
  int taker_gone;
  int task_by_need;             /* the last task came with the taker's need (OfferState) */
  uint64_t task_need;           /* ... that need, in all */
  uint64_t release_id;          /* the live release (the thread's), 0: none */
  int resume_failures;          /* in a row, out of memory: the thread waits before the next */
  struct sublet_release_stats released, resumed;
};

/* What the thread reports in its next step. */
struct report {
  Sublet__OfferPhase reached;   /* 0: nothing */
  struct sublet_release_stats stats;
  int failed;                   /* 0, or the code of a failed release or resume */
  char failure[sizeof(((struct sl_err *)0)->msg)];
};

/* ------------------------------------------------------------------ stats on the wire */

void sl_offer_stats_from(const Sublet__OfferStats *m, struct sublet_release_stats *s) {
  const Sublet__ReleaseStats *r = m != NULL ? m->release : NULL;

  memset(s, 0, sizeof(*s));
  if (m == NULL)
    return;
  s->seconds = m->seconds;
  s->map_seconds = m->map_seconds;
  s->allocations = m->allocations;
  s->daemon_died = m->daemon_died;
  if (r != NULL)
    sl_release_stats_from(r, s);
}

/* The report's stats into m and rs (the caller's, filled in place: nothing to free). */
static void stats_to(const struct report *rp, uint64_t region, Sublet__OfferStats *m,
                     Sublet__ReleaseStats *rs) {
  const struct sublet_release_stats *s = &rp->stats;

  rs->release = s->release_id;
  rs->region = region;
  rs->has_released_pages = rs->has_stayed_pages = rs->has_held_pages = 1;
  rs->released_pages = s->released_pages;
  rs->stayed_pages = s->stayed_pages;
  rs->held_pages = s->held_pages;
  rs->has_kept_bytes = rs->has_moved_bytes = rs->has_copied_out_bytes = 1;
  rs->kept_bytes = s->kept_bytes;
  rs->moved_bytes = s->moved_bytes;
  rs->copied_out_bytes = s->copied_out_bytes;
  rs->has_copied_in_bytes = rs->has_move_seconds = 1;
  rs->copied_in_bytes = s->copied_in_bytes;
  rs->move_seconds = s->move_seconds;
  if (rp->reached == PH(RELEASED))
    rs->has_copy_out_seconds = 1, rs->copy_out_seconds = s->copy_seconds;
  else
    rs->has_copy_in_seconds = 1, rs->copy_in_seconds = s->copy_seconds;
  m->release = rs;
  m->has_seconds = m->has_map_seconds = m->has_allocations = m->has_daemon_died = 1;
  m->seconds = s->seconds;
  m->map_seconds = s->map_seconds;
  m->allocations = s->allocations;
  m->daemon_died = s->daemon_died;
}

/* ------------------------------------------------------------------ the thread */

static void set_state(struct sublet_release_offer *o, int state) {
  pthread_mutex_lock(&o->mu);
  o->state = state;
  pthread_cond_broadcast(&o->cond);
  pthread_mutex_unlock(&o->mu);
}

static int withdrawing(struct sublet_release_offer *o) {
  int w;

  pthread_mutex_lock(&o->mu);
  w = o->withdraw && o->state == SUBLET_OFFER_OFFERED;
  pthread_mutex_unlock(&o->mu);
  return w;
}

/* One OfferStep: rp reported (then cleared), the answer's task into *task. */
static int step_once(struct sublet_release_offer *o, struct report *rp, int *task) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__OfferStep m = SUBLET__OFFER_STEP__INIT;
  Sublet__OfferStats st = SUBLET__OFFER_STATS__INIT;
  Sublet__ReleaseStats rs = SUBLET__RELEASE_STATS__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  m.offer = o->id;
  m.has_reached = rp->reached != 0;
  m.reached = rp->reached;
  if (rp->reached != 0) {
    stats_to(rp, o->r->id, &st, &rs);
    m.stats = &st;
  }
  m.has_failed = rp->failed != 0;
  m.failed = rp->failed;
  m.failure = rp->failed != 0 ? rp->failure : NULL;
  m.has_withdraw = m.withdraw = withdrawing(o);
  req.body_case = SUBLET__REQUEST__BODY_OFFER_STEP;
  req.offer_step = &m;
  pthread_mutex_lock(&o->ev->lock);
  rc = sl_client_call(o->ev, &req, SUBLET__REPLY__BODY_OFFER, &rep, NULL, NULL, -1);
  pthread_mutex_unlock(&o->ev->lock);
  if (rc == 0 || rc == SUBLET_ECANCELED) /* cancelled: the report was taken all the same */
    memset(rp, 0, sizeof(*rp));
  if (rc == 0) {
    *task = rep->offer->phase;
    o->taker_gone = rep->offer->taker_gone;
    o->task_by_need = rep->offer->has_need_bytes;
    o->task_need = rep->offer->need_bytes;
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Steps until there is a task; a cancelled wait (a withdraw asked) steps again. */
static int step(struct sublet_release_offer *o, struct report *rp, int *task) {
  int rc;

  while ((rc = step_once(o, rp, task)) == SUBLET_ECANCELED)
    ;
  return rc;
}

static void failed(struct report *rp, int rc) {
  rp->failed = rc;
  snprintf(rp->failure, sizeof(rp->failure), "%s", sublet_last_error());
}

/* Taken: the release, as sublet_release (taken by need: as sublet_release_need). A need the
 * offer cannot give (ENEED, nothing released) puts it back on offer: subletd does the same. */
static void do_release(struct sublet_release_offer *o, struct report *rp) {
  struct sublet_release_stats st;
  uint64_t id = 0;
  int rc;

  set_state(o, SUBLET_OFFER_TAKEN);
  if (o->task_by_need)
    rc = sublet_release_need(o->r, o->pages, o->npages, o->keep, o->nkeep, o->keep_all, o->stay,
                             o->task_need, &id, &st);
  else
    rc = sublet_release(o->r, o->pages, o->npages, o->keep, o->nkeep, o->keep_all, o->stay,
                        &id, &st);
  if (rc != 0) {
    failed(rp, rc);
    if (rc == SUBLET_ENEED && o->task_by_need)
      set_state(o, SUBLET_OFFER_OFFERED);
    return;
  }
  pthread_mutex_lock(&o->mu);
  o->release_id = id;
  o->released = st;
  o->state = SUBLET_OFFER_RELEASED;
  pthread_cond_broadcast(&o->cond);
  pthread_mutex_unlock(&o->mu);
  rp->reached = PH(RELEASED);
  rp->stats = st;
}

/* The taker needs more: more of the live release (sublet_release_more), nothing resumed. Its
 * failure (ENEED with the figures, or another) leaves the release as it was: reported, the
 * offer stays released. */
static void do_more(struct sublet_release_offer *o, struct report *rp) {
  struct sublet_release_stats st;
  int rc = sublet_release_more(o->r, o->release_id, o->task_need, &st);

  if (rc != 0) {
    failed(rp, rc);
    return;
  }
  pthread_mutex_lock(&o->mu);
  o->released = st;
  pthread_mutex_unlock(&o->mu);
  rp->reached = PH(RELEASED);
  rp->stats = st;
}

/* The resume: 0 (or SUBLET_EDAEMONDIED: done here) and the stats kept; else its code. */
static int resume(struct sublet_release_offer *o) {
  struct sublet_release_stats st;
  int rc = sublet_resume(o->r, o->release_id, 0, &st);

  if (rc == 0 || rc == SUBLET_EDAEMONDIED) {
    pthread_mutex_lock(&o->mu);
    o->release_id = 0;
    o->resumed = st;
    pthread_mutex_unlock(&o->mu);
  }
  return rc;
}

/* Given back: the resume; out of memory, tried again after a pause that grows (10 ms to
 * 0.5 s: whoever took the memory must free it first). */
static void do_resume(struct sublet_release_offer *o, struct report *rp) {
  int rc, shift = o->resume_failures < 6 ? o->resume_failures : 6;

  set_state(o, SUBLET_OFFER_RETURNING);
  if (o->resume_failures > 0)
    usleep((useconds_t)(10000u << shift) > 500000u ? 500000u : (10000u << shift));
  rc = resume(o);
  o->resume_failures = rc == SUBLET_ENOMEM ? o->resume_failures + 1 : 0;
  if (rc == 0 || rc == SUBLET_EDAEMONDIED) {
    rp->reached = PH(ENDED);
    rp->stats = o->resumed;
  } else {
    failed(rp, rc);
  }
}

static void finish(struct sublet_release_offer *o, int rc, const char *msg) {
  pthread_mutex_lock(&o->mu);
  o->done = 1;
  o->rc = rc;
  o->state = SUBLET_OFFER_ENDED;
  snprintf(o->msg, sizeof(o->msg), "%s", rc != 0 ? msg : "");
  pthread_cond_broadcast(&o->cond);
  pthread_mutex_unlock(&o->mu);
}

/* The daemon answered ENDED: how the offer ended for the owner. */
static void ended(struct sublet_release_offer *o, const struct report *last) {
  char msg[sizeof(o->msg)];
  int was = o->state, withdrawn;

  pthread_mutex_lock(&o->mu);
  withdrawn = o->withdraw;
  pthread_mutex_unlock(&o->mu);

  if (last->failed != 0)
    finish(o, last->failed, last->failure);
  else if (o->resumed.daemon_died)
    finish(o, SUBLET_EDAEMONDIED, "subletd died while the memory was released; this process "
           "made its pages again and put the kept bytes back (its memory is its own now)");
  else if (was == SUBLET_OFFER_OFFERED)
    finish(o, SUBLET_ECANCELED, withdrawn ? "the release offer was withdrawn" : "the release "
           "offer ended before anyone took it: its region went");
  else if (o->taker_gone) {
    snprintf(msg, sizeof(msg), "the taker of release offer %llu went without giving it back; "
             "the memory was resumed and the kept bytes are back", (unsigned long long)o->id);
    finish(o, SUBLET_EBORROWERDIED, msg);
  } else {
    finish(o, 0, "");
  }
}

/* The offer's connection failed (subletd died, or refused a step): a release still live is
 * resumed here all the same (alone, if subletd is gone), and the offer is over. */
static void lost(struct sublet_release_offer *o, int rc) {
  char why[sizeof(o->msg) / 2], msg[sizeof(o->msg)];
  int dead = sl_client_gone(o->ev), rrc;

  snprintf(why, sizeof(why), "%s", sublet_last_error());
  if (o->resumed.daemon_died)
    finish(o, SUBLET_EDAEMONDIED, "subletd died while the memory was released; this process "
           "made its pages again and put the kept bytes back (its memory is its own now)");
  else if (o->release_id == 0 && o->resumed.release_id != 0)
    finish(o, 0, ""); /* resumed, only the report was lost: the owner has everything back */
  else if (o->release_id == 0 && dead)
    finish(o, SUBLET_EDAEMONDIED, "subletd died (or closed the release offer's connection) "
           "before the memory was released: nothing was released, the tensor is intact");
  else if (o->release_id == 0)
    finish(o, rc, why);
  else if ((rrc = resume(o)) != 0) /* SUBLET_EDAEMONDIED: resumed alone, its message says so */
    finish(o, rrc, sublet_last_error());
  else {
    snprintf(msg, sizeof(msg), "the release offer failed while released (%s); the memory was "
             "resumed and the kept bytes are back", why);
    finish(o, dead ? SUBLET_EDAEMONDIED : rc, msg);
  }
}

static void *run(void *arg) {
  struct sublet_release_offer *o = arg;
  struct report rp = {0}, last = {0};
  int task = 0, rc;

  for (;;) {
    last = rp;
    if ((rc = step(o, &rp, &task)) != 0) {
      lost(o, rc);
      return NULL;
    }
    if (task == PH(ENDED))
      break;
    if (task == PH(TAKEN))
      do_release(o, &rp);
    else if (task == PH(MORE))
      do_more(o, &rp);
    else if (task == PH(RETURNING))
      do_resume(o, &rp);
  }
  ended(o, &last);
  return NULL;
}

/* ------------------------------------------------------------------ offering */

static int copy_ranges(const struct sublet_range *src, size_t n, struct sublet_range **dst) {
  *dst = NULL;
  if (src == NULL || n == 0)
    return 0;
  if ((*dst = malloc(n * sizeof(*src))) == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  memcpy(*dst, src, n * sizeof(*src));
  return 0;
}

static int offer_request(struct sublet_release_offer *o, const char *name) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__ReleaseOffer m = SUBLET__RELEASE_OFFER__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  if (!o->ev->offer_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot offer releases (it is older "
                          "than this library): update subletd");
  m.region = o->r->id;
  m.has_name = name != NULL; /* "" too: subletd refuses it (LoanName is 1 to 63 bytes) */
  m.name.data = (uint8_t *)name;
  m.name.len = m.has_name ? strlen(name) : 0;
  /* A taker's need reaches this library (Take.need_bytes, TakeMore): it releases by need. */
  m.has_by_need = m.by_need = o->ev->take_need_ok && o->r->client->release_need_ok &&
                              o->r->client->release_more_ok;
  req.body_case = SUBLET__REQUEST__BODY_RELEASE_OFFER;
  req.release_offer = &m;
  pthread_mutex_lock(&o->ev->lock);
  rc = sl_client_call(o->ev, &req, SUBLET__REPLY__BODY_OFFER, &rep, NULL, NULL, 0);
  pthread_mutex_unlock(&o->ev->lock);
  if (rc == 0)
    o->id = rep->offer->offer;
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

static struct sublet_release_offer *offer_new(sublet_region *r) {
  struct sublet_release_offer *o = calloc(1, sizeof(*o));
  pthread_condattr_t attr;

  if (o == NULL)
    return NULL;
  o->r = r;
  o->state = SUBLET_OFFER_OFFERED;
  pthread_mutex_init(&o->mu, NULL);
  pthread_condattr_init(&attr);
  pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
  pthread_cond_init(&o->cond, &attr);
  pthread_condattr_destroy(&attr);
  return o;
}

/* Frees what the offer holds; its thread has ended or never started. */
static void offer_destroy(struct sublet_release_offer *o) {
  if (o->ev != NULL)
    sublet_disconnect(o->ev); /* subletd forgets an offer whose connection closed */
  pthread_cond_destroy(&o->cond);
  pthread_mutex_destroy(&o->mu);
  free(o->pages);
  free(o->keep);
  free(o);
}

SUBLET_EXPORT int sublet_offer_release(sublet_region *r, const struct sublet_range *pages,
                                       size_t npages, const struct sublet_range *keep,
                                       size_t nkeep, int keep_all, uint64_t stay_pages,
                                       const char *name, sublet_release_offer **out) {
  struct sublet_release_offer *o;
  int rc;

  if (!r->client->offer_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "subletd at %s cannot offer releases (it is older "
                          "than this library): update subletd", r->client->path);
  /* Its pages, read from the pools' segments, must stay those of the tag until the release
   * is made (when taken): held from before they were read until the offer ends (pool.c). */
  if (r->torch_blocks && !atomic_load(&r->pool_held))
    return sl_client_fail(SUBLET_EINVAL, "region %llu is a pool arena: offer its release "
                          "under sublet_pool_hold(), reading its segments after that call, and "
                          "sublet_pool_unhold() once the offer has ended",
                          (unsigned long long)r->id);
  if ((o = offer_new(r)) == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  o->npages = pages != NULL ? npages : 0;
  o->nkeep = keep_all ? 0 : nkeep;
  o->keep_all = keep_all;
  o->stay = stay_pages;
  rc = copy_ranges(pages, o->npages, &o->pages);
  if (rc == 0)
    rc = copy_ranges(keep_all ? NULL : keep, o->nkeep, &o->keep);
  if (rc == 0)
    rc = sl_client_open(r->client->path, &o->ev);
  if (rc == 0)
    rc = offer_request(o, name);
  if (rc == 0 && (rc = pthread_create(&o->thread, NULL, run, o)) != 0)
    rc = sl_client_fail(SUBLET_EIO, "pthread_create: %s", strerror(rc));
  if (rc != 0) {
    offer_destroy(o);
    return rc;
  }
  *out = o;
  return 0;
}

SUBLET_EXPORT uint64_t sublet_release_offer_id(const sublet_release_offer *o) {
  return o->id;
}

SUBLET_EXPORT int sublet_release_offer_state(sublet_release_offer *o) {
  int state;

  pthread_mutex_lock(&o->mu);
  state = o->state;
  pthread_mutex_unlock(&o->mu);
  return state;
}

/* Waits on o->cond until done or the deadline (ms, from sl_clock_ms; < 0: none). mu held. */
static void wait_done(struct sublet_release_offer *o, int64_t deadline) {
  struct timespec ts;
  int64_t ms;

  while (!o->done) {
    if (deadline < 0) {
      pthread_cond_wait(&o->cond, &o->mu);
      continue;
    }
    if ((ms = deadline - sl_clock_ms()) <= 0)
      return;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += ms / 1000;
    ts.tv_nsec += (ms % 1000) * 1000000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&o->cond, &o->mu, &ts);
  }
}

SUBLET_EXPORT int sublet_release_offer_wait(sublet_release_offer *o, int timeout_ms,
                                            struct sublet_release_stats *released,
                                            struct sublet_release_stats *resumed) {
  int rc, state;

  pthread_mutex_lock(&o->mu);
  wait_done(o, timeout_ms < 0 ? -1 : sl_clock_ms() + timeout_ms);
  if (released != NULL)
    *released = o->released;
  if (resumed != NULL)
    *resumed = o->resumed;
  rc = o->done ? o->rc : SUBLET_ETIMEDOUT;
  state = o->state;
  if (rc != 0 && o->done)
    sl_client_fail(rc, "%s", o->msg);
  pthread_mutex_unlock(&o->mu);
  if (rc == SUBLET_ETIMEDOUT && state != SUBLET_OFFER_ENDED)
    return sl_client_fail(rc, "release offer %llu is not over yet (state %d)",
                          (unsigned long long)o->id, state);
  return rc;
}

SUBLET_EXPORT int sublet_release_offer_withdraw(sublet_release_offer *o) {
  int rc = 0;

  pthread_mutex_lock(&o->mu);
  while (!o->done && o->state == SUBLET_OFFER_OFFERED) {
    o->withdraw = 1;
    pthread_mutex_unlock(&o->mu);
    sublet_cancel(o->ev); /* the thread's waiting step, if it waits: it steps again, withdrawing */
    pthread_mutex_lock(&o->mu);
    wait_done(o, sl_clock_ms() + 20);
  }
  if (!o->done)
    rc = sl_client_fail(SUBLET_EBUSY, "release offer %llu has been taken: it comes back once "
                        "its taker gives it back (wait for it)", (unsigned long long)o->id);
  pthread_mutex_unlock(&o->mu);
  return rc;
}

SUBLET_EXPORT void sublet_release_offer_free(sublet_release_offer *o) {
  if (o == NULL)
    return;
  if (sublet_release_offer_withdraw(o) != 0)
    sublet_release_offer_wait(o, -1, NULL, NULL);
  pthread_join(o->thread, NULL);
  offer_destroy(o);
}
