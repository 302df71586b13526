/* release.c - libsublet: releases, a region's pages given back to the device's driver until a
 * resume (docs/design/release.md; subletd's side is daemon/releases.c).
 *
 * The daemon moves and saves the kept bytes and lets go of its own handles; then this library
 * unmaps the released pages and releases its handles, and only then is the memory the
 * driver's. The reply carries the release's save area (an fd, read-only) and its plan, kept
 * here until the resume: if subletd dies meanwhile, the resume is done by this library alone
 * (pages made by this process, the saved bytes copied back, the moves undone).
 * Floor 3 (client.h's floors).
 */
#include "client.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clock.h"
#include "msg.h"

#define SL_SWAP_PTR(a, b) do { void *t_ = (a); (a) = (b); (b) = t_; } while (0)

/* A live release, as its owner's library keeps it. */
struct sl_release_rec {
  uint64_t id;
  int area_fd;              /* the save area, read-only; owned */
  struct sl_copy *saves;    /* (region offset, area offset, length) */
  size_t nsaves;
  struct sl_move *moves;    /* (source, destination, length), region offsets */
  size_t nmoves;
  uint64_t *runs;           /* the released pages: (first, count) pairs */
  size_t nruns;             /* uint64s */
  uint64_t *set;            /* the pages asked for, released or stayed: (first, count) pairs;
                               no pool segment takes one until the resume (sl_release_set_in) */
  size_t nset;              /* pairs */
  struct sublet_release_stats stats;
  struct sl_release_rec *next;
};

static void rec_free(struct sl_release_rec *rec) {
  if (rec == NULL)
    return;
  if (rec->area_fd >= 0)
    close(rec->area_fd);
  free(rec->saves);
  free(rec->moves);
  free(rec->runs);
  free(rec->set);
  free(rec);
}

void sl_release_forget(struct sublet_region *r) {
  while (r->releases != NULL) {
    struct sl_release_rec *next = r->releases->next;
    rec_free(r->releases);
    r->releases = next;
  }
}

static struct sl_release_rec **rec_link(struct sublet_region *r, uint64_t id) {
  struct sl_release_rec **link = &r->releases;

  while (*link != NULL && (*link)->id != id)
    link = &(*link)->next;
  return link;
}

/* ---- releasing ---------------------------------------------------------------------------- */

/* How long subletd may work on a release or a resume of r before the call's own deadline
 * starts: its first save pins host memory and copies, and its resume makes every page again;
 * 2 s per GiB of the region covers both with room (what the pin takes: docs/benchmarks.md). */
static int work_ms(const struct sublet_region *r) {
  uint64_t gib = (r->npages * r->page_size) >> 30;

  return gib > 1000000 ? -1 : (int)(2000 * (gib + 1));
}

/* The complement of the released pages' pairs: the pinned pages of the Lend. */
static int complement(const struct sublet_region *r, const uint64_t *pairs, size_t n,
                      uint64_t **out, size_t *nout) {
  uint64_t *v = malloc((2 * n + 2) * sizeof(*v)), at = 0;
  size_t m = 0;

  if (v == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  for (size_t i = 0; i < n; i++) {
    if (pairs[2 * i] > at) {
      v[2 * m] = at;
      v[2 * m++ + 1] = pairs[2 * i] - at;
    }
    at = pairs[2 * i] + pairs[2 * i + 1];
  }
  if (at < r->npages) {
    v[2 * m] = at;
    v[2 * m++ + 1] = r->npages - at;
  }
  *out = v;
  *nout = m;
  return 0;
}

/* The pinned pairs for the released byte ranges (NULL/0: none pinned). */
static int pinned_for(const struct sublet_region *r, const struct sublet_range *pages, size_t n,
                      uint64_t **pinned, size_t *npinned) {
  uint64_t *pairs;
  size_t npairs;
  int rc;

  *pinned = NULL;
  *npinned = 0;
  if (pages == NULL || n == 0)
    return 0;
  if ((rc = sl_pages_pairs(r, pages, n, &pairs, &npairs)) != 0)
    return rc;
  if (npairs == 0)
    rc = sl_client_fail(SUBLET_EINVAL, "the pages to release hold no page: give ranges of "
                        "whole pages of region %llu", (unsigned long long)r->id);
  else
    rc = complement(r, pairs, npairs, pinned, npinned);
  free(pairs);
  return rc;
}

/* The release's set (the pages not pinned; all of the region's when none is) into rec, before
 * the request. Of a pool arena only under sublet_pool_hold(): its set was read from the
 * segments, and a segment made between that and the Released (a tag's tensor freed, another
 * tag's made in its page) would be given to the driver with it (pool.c, "Releases"). */
static int take_set(const struct sublet_region *r, const uint64_t *pinned, size_t npinned,
                    struct sl_release_rec *rec) {
  static const uint64_t none[2] = {0, 0};

  if (r->torch_blocks && !atomic_load(&r->pool_held))
    return sl_client_fail(SUBLET_EINVAL, "region %llu is a pool arena: release it under "
                          "sublet_pool_hold(), reading its segments after that call, and "
                          "sublet_pool_unhold() once the release is made (or offered, once the "
                          "offer has ended)", (unsigned long long)r->id);
  if (npinned == 0) { /* the whole region */
    pinned = none;
    npinned = 1;
  }
  return complement(r, pinned, npinned, &rec->set, &rec->nset);
}

uint64_t sl_release_set_in(const struct sublet_region *r, uint64_t from, uint64_t to) {
  uint64_t first = to;

  for (const struct sl_release_rec *rec = r->releases; rec != NULL; rec = rec->next)
    for (size_t i = 0; i < rec->nset; i++) {
      uint64_t at = rec->set[2 * i], end = at + rec->set[2 * i + 1];
      if (at >= first)
        break; /* ascending: nothing nearer */
      if (end > from)
        first = at > from ? at : from;
    }
  return first;
}

/* The plan and the runs of a Released, checked against the region and taken into rec. */
static int rec_fill(const struct sublet_region *r, const Sublet__ReleaseStats *m,
                    struct sl_release_rec *rec) {
  uint64_t size = r->npages * r->page_size;

  if (m->n_moves % 3 || m->n_saves % 3 || m->n_released % 2)
    return sl_client_fail(SUBLET_EPROTO, "subletd sent a malformed Released");
  for (size_t i = 0; i < m->n_released; i += 2)
    if (m->released[i] >= r->npages || m->released[i + 1] > r->npages - m->released[i])
      return sl_client_fail(SUBLET_EPROTO, "subletd released pages outside region %llu",
                            (unsigned long long)r->id);
  for (size_t i = 0; i < m->n_saves; i += 3)
    if (m->saves[i] > size || m->saves[i + 2] > size - m->saves[i])
      return sl_client_fail(SUBLET_EPROTO, "subletd saved bytes outside region %llu",
                            (unsigned long long)r->id);
  rec->saves = malloc((m->n_saves + 1) * sizeof(uint64_t));
  rec->moves = malloc((m->n_moves + 1) * sizeof(uint64_t));
  rec->runs = malloc((m->n_released + 1) * sizeof(uint64_t));
  if (rec->saves == NULL || rec->moves == NULL || rec->runs == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  if (m->n_saves > 0) /* an empty list may be NULL, which memcpy must not get */
    memcpy(rec->saves, m->saves, m->n_saves * sizeof(uint64_t));
  if (m->n_moves > 0)
    memcpy(rec->moves, m->moves, m->n_moves * sizeof(uint64_t));
  if (m->n_released > 0)
    memcpy(rec->runs, m->released, m->n_released * sizeof(uint64_t));
  rec->nsaves = m->n_saves / 3;
  rec->nmoves = m->n_moves / 3;
  rec->nruns = m->n_released;
  return 0;
}

void sl_release_stats_from(const Sublet__ReleaseStats *m, struct sublet_release_stats *s) {
  s->release_id = m->release;
  s->released_pages = m->released_pages;
  s->stayed_pages = m->stayed_pages;
  s->held_pages = m->held_pages;
  s->kept_bytes = m->kept_bytes;
  s->moved_bytes = m->moved_bytes;
  s->copied_out_bytes = m->copied_out_bytes;
  s->copied_in_bytes = m->copied_in_bytes;
  s->move_seconds = m->move_seconds;
  s->copy_seconds = m->has_copy_in_seconds ? m->copy_in_seconds : m->copy_out_seconds;
}

/* This process lets go of the released pages: then nothing holds them. */
static void unmap_runs(sublet_client *c, struct sublet_region *r, const uint64_t *runs,
                       size_t n) {
  sl_pages_drop_window(c, r); /* a local loan's window maps these very handles */
  sl_device_synchronize(c->dev, NULL);
  for (size_t i = 0; i + 1 < n; i += 2)
    sl_pages_let_go(c, r, runs[i], runs[i + 1]);
}

/* ---- a release that keeps nothing: this process unmaps beside subletd ---------------------
 *
 * The driver serves two processes' unmaps partly at once: both at once end sooner than one
 * after the other (the figures: docs/benchmarks.md). With no kept byte to lose, this process
 * unmaps the set it releases while subletd lets go of its own mapping, instead of after it.
 * Its handles stay until Released: a release that fails has its pages mapped again, intact,
 * as does any page subletd held back (a page group not wholly in the set). */
struct early_unmap {
  sublet_client *c;
  struct sublet_region *r;
  const uint64_t *pinned; /* (first, count) pairs, ascending: the pages not in the set */
  size_t npinned;
  uint8_t *unmapped;      /* r->npages marks, of sl_pages_unmap; NULL: nothing unmapped */
};

static int borrowing(const struct sublet_region *r) {
  const sublet_client *c = r->client;

  return c->loan_id != 0 && c->win != NULL && c->win->region_id == r->id;
}

static void unmap_meanwhile(void *arg) {
  struct early_unmap *eu = arg;
  uint64_t *set;
  size_t n;

  sl_pages_drop_window(eu->c, eu->r); /* a local loan's window maps these very handles */
  if (complement(eu->r, eu->pinned, eu->npinned, &set, &n) != 0)
    return; /* out of host memory: unmapped after the reply, as a release that keeps bytes */
  for (size_t i = 0; i < n; i++)
    sl_pages_unmap(eu->c, eu->r, set[2 * i], set[2 * i + 1], eu->unmapped);
  free(set);
}

/* After the reply: the released runs let go of their handles; what else was unmapped (all
 * of it, when the release failed) is mapped again. */
static int early_unmap_end(struct early_unmap *eu, const uint64_t *runs, size_t n) {
  int rc;

  for (size_t i = 0; i + 1 < n; i += 2) {
    sl_pages_unmap(eu->c, eu->r, runs[i], runs[i + 1], eu->unmapped); /* what is still mapped */
    sl_pages_drop_handles(eu->c, eu->r, runs[i], runs[i + 1]);
    memset(eu->unmapped + runs[i], 0, runs[i + 1]);
  }
  rc = sl_pages_map_again(eu->c, eu->r, eu->unmapped);
  free(eu->unmapped);
  eu->unmapped = NULL;
  return rc;
}

/* This process's side once subletd has answered the release (rc): the released runs let go
 * of, or, after an early unmap, what it unmapped put right. Returns the release's outcome, or
 * a page that failed to map again: held back by a live release (it has a hole), or of a
 * failed one (its error then, not the release's: the tensor is not whole). */
static int let_go(struct early_unmap *eu, struct sl_release_rec *rec, int rc) {
  struct sl_err why = *sl_client_last_error();
  int again;

  if (eu->unmapped == NULL) {
    if (rc == 0)
      unmap_runs(eu->c, eu->r, rec->runs, rec->nruns);
    return rc;
  }
  again = early_unmap_end(eu, rc == 0 ? rec->runs : NULL, rc == 0 ? rec->nruns : 0);
  if (rc != 0 && again == 0)
    *sl_client_last_error() = why; /* the release's error, not the mapping's */
  return again != 0 ? again : rc;
}

/* The connection went before Released came (subletd died, or closed it): nothing was released
 * here. This process let go of no page (its handles and mapping hold them all; an early unmap
 * was mapped again), and subletd's work only copies kept bytes into unkept ones (moves) or out
 * to the save area (saves): each kept byte is where it was. The caller must hear that, not only
 * that the connection closed, or it takes the tensor for lost. */
static int died_before_released(const struct sublet_region *r) {
  char why[200];

  snprintf(why, sizeof(why), "%s", sublet_last_error());
  return sl_client_fail(SUBLET_EDAEMONDIED, "subletd went before it answered the release of "
                        "region %llu (%s): nothing was released, the tensor is intact (this "
                        "process still maps every page, each kept byte where it was). Its "
                        "memory is this process's own now: once subletd runs again, make a new "
                        "tensor and copy into it to release it", (unsigned long long)r->id, why);
}

/* The request's release by need (SUBLET_NEED_ALL: none), refused unless subletd knows it: an
 * older one would release every page. */
static int set_need(const sublet_client *c, Sublet__Lend *m, uint64_t need) {
  if (need == SUBLET_NEED_ALL)
    return 0;
  if (!c->release_need_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot release by need (it is older "
                          "than this library): update subletd, or release without a need");
  m->has_need_bytes = 1;
  m->need_bytes = need;
  return 0;
}

static int release_request(struct sublet_region *r, const struct sublet_range *keep, size_t n,
                           int keep_all, const uint64_t *pinned, size_t npinned, uint64_t stay,
                           uint64_t need, struct early_unmap *eu, Sublet__Reply **rep, int *fd) {
  sublet_client *c = r->client;
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;
  size_t nfds = 1;
  int keep_fd;

  if (!c->release_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot release pages (it is older "
                          "than this library): update subletd");
  if (set_need(c, &m, need) != 0)
    return SUBLET_ENOTSUP;
  m.region = r->id;
  sl_keepwire_encode(&c->keep, &m, keep, n, keep_all, &keep_fd);
  m.pinned = (uint64_t *)pinned;
  m.n_pinned = 2 * npinned;
  m.has_release = m.release = 1;
  m.has_stay_pages = stay != SUBLET_STAY_ANY;
  m.stay_pages = stay;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  /* The owner's last writes must be in memory before subletd moves or saves them. */
  sl_device_synchronize(c->dev, NULL);
  *fd = -1;
  struct sl_meanwhile mw = {unmap_meanwhile, eu};
  int rc = sl_client_call_fd_meanwhile(c, &req, keep_fd, SUBLET__REPLY__BODY_RELEASED, rep, fd,
                                       &nfds, work_ms(r), eu->unmapped != NULL ? &mw : NULL);
  if (rc == 0 && nfds != 1) {
    sl_wire_close_fds(fd, nfds);
    *fd = -1;
    return sl_client_fail(SUBLET_EPROTO, "subletd answered a release with %zu fds, not 1",
                          nfds);
  }
  return rc;
}

static int release_locked(struct sublet_region *r, const struct sublet_range *keep, size_t n,
                          int keep_all, const uint64_t *pinned, size_t npinned, uint64_t stay,
                          uint64_t need, struct sl_release_rec *rec, int *live) {
  Sublet__Reply *rep = NULL;
  struct early_unmap eu = {r->client, r, pinned, npinned, NULL};
  double t0;
  int rc;

  /* Nothing kept: nothing to lose by unmapping at once; unless a loan of r is borrowed here,
   * whose window maps the pages (subletd refuses the release then), or the release is by
   * need (subletd chooses the pages: most of them may stay, to be mapped again). */
  if (n == 0 && !keep_all && !borrowing(r) && need == SUBLET_NEED_ALL)
    eu.unmapped = calloc(r->npages, 1);
  rc = release_request(r, keep, n, keep_all, pinned, npinned, stay, need, &eu, &rep,
                       &rec->area_fd);
  if (rc == 0) {
    rec->id = rep->released->release;
    sl_release_stats_from(rep->released, &rec->stats);
    rc = rec_fill(r, rep->released, rec);
  }
  *live = rc == 0;
  t0 = sl_clock_now();
  rc = let_go(&eu, rec, rc);
  if (rc == SUBLET_EPIPE && sl_client_gone(r->client))
    rc = died_before_released(r);
  rec->stats.map_seconds = sl_clock_now() - t0;
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_release(sublet_region *r, const struct sublet_range *pages,
                                 size_t npages, const struct sublet_range *keep, size_t nkeep,
                                 int keep_all, uint64_t stay_pages, uint64_t *release_id,
                                 struct sublet_release_stats *stats) {
  return sublet_release_need(r, pages, npages, keep, nkeep, keep_all, stay_pages,
                             SUBLET_NEED_ALL, release_id, stats);
}

SUBLET_EXPORT int sublet_release_need(sublet_region *r, const struct sublet_range *pages,
                                      size_t npages, const struct sublet_range *keep,
                                      size_t nkeep, int keep_all, uint64_t stay_pages,
                                      uint64_t need_bytes, uint64_t *release_id,
                                      struct sublet_release_stats *stats) {
  sublet_client *c = r->client;
  struct sl_release_rec *rec = calloc(1, sizeof(*rec));
  uint64_t *pinned = NULL;
  size_t npinned = 0;
  double t0 = sl_clock_now();
  int rc, live = 0;

  if (rec == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  rec->area_fd = -1;
  rc = pinned_for(r, pages, npages, &pinned, &npinned);
  if (rc == 0)
    rc = take_set(r, pinned, npinned, rec);
  pthread_mutex_lock(&c->lock);
  if (rc == 0)
    rc = release_locked(r, keep, nkeep, keep_all, pinned, npinned, stay_pages, need_bytes, rec,
                        &live);
  if (live) { /* recorded even when a page it held back failed to map again: it resumes */
    rec->stats.seconds = sl_clock_now() - t0;
    rec->next = r->releases;
    r->releases = rec;
    if (release_id != NULL)
      *release_id = rec->id;
    if (stats != NULL)
      *stats = rec->stats;
  }
  pthread_mutex_unlock(&c->lock);
  free(pinned);
  if (!live)
    rec_free(rec);
  return rc;
}

/* ---- more by need ------------------------------------------------------------------------ */

/* An increment's Released into rec: the release's whole plan now (it replaces rec's), its
 * new runs after rec's, its area's fd (the same area) in place of rec's. */
static int rec_more(const struct sublet_region *r, const Sublet__ReleaseStats *m, int fd,
                    struct sl_release_rec *rec) {
  struct sl_release_rec got = {.area_fd = -1};
  uint64_t *runs;
  int rc = rec_fill(r, m, &got);

  runs = rc == 0 ? realloc(rec->runs, (rec->nruns + got.nruns + 1) * sizeof(*runs)) : NULL;
  if (rc == 0 && runs == NULL)
    rc = sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  if (rc == 0) {
    if (got.nruns > 0)
      memcpy(runs + rec->nruns, got.runs, got.nruns * sizeof(*runs));
    rec->runs = runs;
    rec->nruns += got.nruns;
    SL_SWAP_PTR(rec->saves, got.saves);
    SL_SWAP_PTR(rec->moves, got.moves);
    rec->nsaves = got.nsaves;
    rec->nmoves = got.nmoves;
    close(rec->area_fd);
    rec->area_fd = fd;
    sl_release_stats_from(m, &rec->stats);
  }
  free(got.runs);
  free(got.saves);
  free(got.moves);
  return rc;
}

/* The connection went before the increment's answer: nothing more was released here (this
 * process unmapped nothing of it; subletd's work only copied), and the release resumes as
 * any when subletd is gone. */
static int died_before_more(const struct sublet_region *r, uint64_t id) {
  return sl_client_fail(SUBLET_EDAEMONDIED, "subletd went before it answered more of release "
                        "%llu of region %llu: nothing more was released; resume it (this "
                        "library puts every kept byte back by itself)", (unsigned long long)id,
                        (unsigned long long)r->id);
}

static int more_locked(struct sublet_region *r, struct sl_release_rec *rec, uint64_t need) {
  sublet_client *c = r->client;
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__ReleaseMore m = SUBLET__RELEASE_MORE__INIT;
  Sublet__Reply *rep = NULL;
  size_t nfds = 1, before = rec->nruns;
  int fd = -1, rc;

  if (!c->release_more_ok)
    return sl_client_fail(SUBLET_ENOTSUP, "this subletd cannot release more of a release by "
                          "need (it is older than this library): update subletd");
  m.release = rec->id;
  m.need_bytes = need;
  req.body_case = SUBLET__REQUEST__BODY_RELEASE_MORE;
  req.release_more = &m;
  sl_device_synchronize(c->dev, NULL); /* the owner's last writes, before subletd moves them */
  rc = sl_client_call_fd_meanwhile(c, &req, -1, SUBLET__REPLY__BODY_RELEASED, &rep, &fd, &nfds,
                                   work_ms(r), NULL);
  if (rc == 0 && nfds != 1) {
    sl_wire_close_fds(&fd, nfds);
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered more of a release with %zu fds, not 1",
                        nfds);
  } else if (rc == 0 && (rc = rec_more(r, rep->released, fd, rec)) != 0) {
    close(fd);
  }
  if (rc == 0)
    unmap_runs(c, r, rec->runs + before, rec->nruns - before);
  if (rc == SUBLET_EPIPE && sl_client_gone(c))
    rc = died_before_more(r, rec->id);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_release_more(sublet_region *r, uint64_t release_id,
                                      uint64_t need_bytes, struct sublet_release_stats *stats) {
  sublet_client *c = r->client;
  struct sl_release_rec *rec;
  double t0 = sl_clock_now();
  int rc;

  pthread_mutex_lock(&c->lock);
  rec = *rec_link(r, release_id);
  if (rec == NULL)
    rc = sl_client_fail(SUBLET_ENOENT, "region %llu has no live release %llu (resumed "
                        "already?)", (unsigned long long)r->id, (unsigned long long)release_id);
  else if (sl_client_gone(c))
    rc = died_before_more(r, release_id);
  else
    rc = more_locked(r, rec, need_bytes);
  if (rec != NULL && rc == 0)
    rec->stats.seconds = sl_clock_now() - t0;
  if (rec != NULL && stats != NULL)
    *stats = rec->stats;
  pthread_mutex_unlock(&c->lock);
  return rc;
}

/* ---- resuming ----------------------------------------------------------------------------- */

/* Without subletd: this process makes the released pages and maps them where they were. */
static int make_pages(sublet_client *c, struct sublet_region *r, const uint64_t *runs,
                      size_t n, struct sl_err *err) {
  uint64_t ps = r->page_size;
  int rc = 0;

  for (size_t i = 0; rc == 0 && i + 1 < n; i += 2) {
    for (uint64_t p = runs[i]; rc == 0 && p < runs[i] + runs[i + 1]; p++) {
      if (r->handles[p] == 0 && (rc = sl_device_create(c->dev, ps, &r->handles[p], err)) == 0)
        rc = sl_device_map(c->dev, (char *)r->base + p * ps, ps, r->handles[p], err);
    }
    if (rc == 0)
      rc = sl_device_set_access(c->dev, (char *)r->base + runs[i] * ps, runs[i + 1] * ps, err);
  }
  return rc;
}

/* ... then copies the saved bytes back from the area and undoes the moves. */
static int put_back(sublet_client *c, struct sublet_region *r, struct sl_release_rec *rec,
                    struct sl_err *err) {
  struct stat st;
  void *area = NULL;
  int rc = 0;

  if (fstat(rec->area_fd, &st) != 0)
    return sl_err_set(err, SUBLET_EIO, "the save area of release %llu cannot be read",
                      (unsigned long long)rec->id);
  if (rec->nsaves > 0 && (rc = sl_device_host_map(c->dev, rec->area_fd, 0, (uint64_t)st.st_size,
                                                  0, &area, err)) != 0)
    return rc;
  for (size_t i = 0; i < rec->nsaves; i++) /* the area may be shorter than the plan says */
    if (rec->saves[i].host_off > (uint64_t)st.st_size ||
        rec->saves[i].len > (uint64_t)st.st_size - rec->saves[i].host_off)
      rc = sl_err_set(err, SUBLET_EPROTO, "the save area is shorter than its saves");
  if (rc == 0 && rec->nsaves > 0)
    rc = sl_device_copy(c->dev, SL_COPY_TO_DEVICE, r->base, area, rec->saves, rec->nsaves, err);
  for (size_t i = 0; i < rec->nmoves; i++) { /* backwards: destination to source */
    uint64_t t = rec->moves[i].src_off;
    rec->moves[i].src_off = rec->moves[i].dst_off;
    rec->moves[i].dst_off = t;
  }
  if (rc == 0 && rec->nmoves > 0)
    rc = sl_device_move(c->dev, r->base, rec->moves, rec->nmoves, err);
  if (rc == 0)
    rc = sl_device_synchronize(c->dev, err);
  if (area != NULL)
    sl_device_host_free(c->dev, area, (uint64_t)st.st_size);
  return rc;
}

static int resume_alone(sublet_client *c, struct sublet_region *r, struct sl_release_rec *rec) {
  struct sl_err err = {0};
  int rc = make_pages(c, r, rec->runs, rec->nruns, &err);

  if (rc == 0)
    rc = put_back(c, r, rec, &err);
  if (rc != 0)
    return sl_client_fail(err.code ? err.code : rc, "subletd died while region %llu was "
                          "released, and putting it back here failed: %s",
                          (unsigned long long)r->id, err.msg);
  rec->stats.copied_in_bytes = rec->stats.copied_out_bytes;
  rec->stats.daemon_died = 1;
  rec->stats.allocations = rec->stats.released_pages;
  return sl_client_fail(SUBLET_EDAEMONDIED, "subletd died while region %llu was released; "
                        "this process made its pages again and put the kept bytes back: the "
                        "tensor is intact (its memory is this process's own now)",
                        (unsigned long long)r->id);
}

/* A Resumed's figures into rec's stats (the release's copied_out_bytes stay). */
static void resumed_stats(struct sl_release_rec *rec, const Sublet__ReleaseStats *m) {
  uint64_t out = rec->stats.copied_out_bytes;

  sl_release_stats_from(m, &rec->stats);
  rec->stats.copied_out_bytes = out;
}

/* After an early Resumed, once this process has mapped the pages (map_rc: how that went):
 * the end, when subletd has put the kept bytes back. If its copies failed, this library puts
 * them back itself from the save area (subletd no longer uses it). */
static int resume_end(sublet_client *c, struct sublet_region *r, struct sl_release_rec *rec,
                      int map_rc) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__ResumeEnd m = SUBLET__RESUME_END__INIT;
  Sublet__Reply *rep = NULL;
  struct sl_err err = {0};
  int rc;

  m.release = rec->id;
  req.body_case = SUBLET__REQUEST__BODY_RESUME_END;
  req.resume_end = &m;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_RESUMED, &rep, NULL, NULL, work_ms(r));
  if (rc == 0)
    resumed_stats(rec, rep->resumed);
  if (rc == 0 && !rep->resumed->restored && map_rc == 0 &&
      put_back(c, r, rec, &err) != 0)
    rc = sl_client_fail(err.code, "subletd could not put release %llu's kept bytes back, and "
                        "neither could this process: %s", (unsigned long long)rec->id, err.msg);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return map_rc != 0 ? map_rc : rc;
}

static int resume_request(sublet_client *c, struct sublet_region *r, int flags,
                          struct sl_release_rec *rec) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Resume m = SUBLET__RESUME__INIT;
  Sublet__Reply *rep = NULL;
  double t0;
  int rc;

  m.release = rec->id;
  m.has_groups = 1;
  m.groups = !(flags & SUBLET_RESUME_PAGES);
  /* Early: the pages are mapped here while subletd copies into them (their mapping costs a
   * small part of the copy's time: docs/benchmarks.md). */
  m.has_early = 1;
  m.early = c->early_resume_ok && m.groups;
  req.body_case = SUBLET__REQUEST__BODY_RESUME;
  req.resume = &m;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_RESUMED, &rep, NULL, NULL, work_ms(r));
  if (rc == 0) {
    resumed_stats(rec, rep->resumed);
    t0 = sl_clock_now();
    rec->stats.allocations = rep->resumed->n_groups > 0 ? rep->resumed->n_groups / 2
                                                        : rec->stats.released_pages;
    if (rep->resumed->n_groups % 2 != 0)
      rc = sl_client_fail(SUBLET_EPROTO, "subletd sent a malformed Resumed");
    else if (rep->resumed->n_groups > 0)
      rc = sl_pages_map_groups(c, r, rep->resumed->groups, rep->resumed->n_groups / 2);
    else
      rc = sl_pages_remap(c, r, rep->resumed->released, rep->resumed->n_released);
    rec->stats.map_seconds = sl_clock_now() - t0;
    if (m.early) /* after every early Resumed, as PROTOCOL.md says: else it stays restoring */
      rc = resume_end(c, r, rec, rc);
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_resume(sublet_region *r, uint64_t release_id, int flags,
                                struct sublet_release_stats *stats) {
  sublet_client *c = r->client;
  struct sl_release_rec **link, *rec;
  double t0 = sl_clock_now();
  int rc;

  pthread_mutex_lock(&c->lock);
  link = rec_link(r, release_id);
  if ((rec = *link) == NULL) {
    pthread_mutex_unlock(&c->lock);
    return sl_client_fail(SUBLET_ENOENT, "region %llu has no live release %llu (resumed "
                          "already?)", (unsigned long long)r->id,
                          (unsigned long long)release_id);
  }
  rc = sl_client_gone(c) ? SUBLET_EPIPE : resume_request(c, r, flags, rec);
  if (rc != 0 && sl_client_gone(c))
    rc = resume_alone(c, r, rec);
  rec->stats.seconds = sl_clock_now() - t0;
  if (stats != NULL)
    *stats = rec->stats;
  if (rc == 0 || rc == SUBLET_EDAEMONDIED) {
    *link = rec->next;
    rec_free(rec);
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}
