/* borrow.c - libsublet: the borrower's side: borrowing a loan, allocating from it and
 * returning it; the regions RegionGone named let go of; the windows' side of the watch thread
 * (watch_ops). A local lend (lend.c) borrows through sl_borrow_take.
 * Floor 5 (client.h's floors). */
#include "client.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "msg.h"

/* ------------------------------------------------------------------ borrowing */

uint64_t sl_borrow_known_layout(const sublet_client *c) {
  return c->win != NULL ? c->win->layout_id : 0;
}

/* The loan's layout: Borrowed's, or, left out, the last window's, which the id names. */
static const uint64_t *layout_of(const sublet_client *c, const Sublet__Borrowed *b) {
  const struct sl_window *last = c->win;

  if (b->n_layout > 0)
    return b->n_layout == b->unkept_pages + b->kept_pages ? b->layout : NULL;
  if (last == NULL || b->layout_id == 0 || last->layout_id != b->layout_id ||
      last->pages_version != b->pages_version ||
      last->unkept + last->kept != b->unkept_pages + b->kept_pages)
    return NULL;
  return last->layout;
}

/* Does a forfeit window of region (a loan that ended with allocations alive) hold on? If it
 * was served in place, its leaked allocations have addresses of the region's own mapping:
 * a new window there would hand them out again, and a free by address could not tell the
 * two apart (nor could the fresh zone be mapped where the forfeit's still is). */
static int region_has_forfeit(const sublet_client *c, uint64_t region) {
  for (size_t i = 0; i < c->nforfeit; i++)
    if (c->forfeit[i]->region_id == region)
      return 1;
  return 0;
}

/* Sets up c->win for the loan: the last window when it fits (mapping paid once), else anew,
 * with the last one's imported handles when they are of the same region. A window in the
 * owner's process is served in place when its layout allows, no forfeit window of the
 * region holds on and PyTorch's blocks do not live at its addresses (a pool's arena); else it
 * is gathered at addresses of its own. */
static int setup_window(sublet_client *c, const Sublet__Borrowed *b) {
  struct sublet_region *own = b->own_region ? sl_region_find(c, b->region) : NULL;
  const uint64_t *layout = layout_of(c, b);
  struct sl_window_own mine = {0};
  struct sl_window *last = c->win;
  struct sl_err err = {0};
  int rc;

  if (layout == NULL)
    return sl_client_fail(SUBLET_EPROTO, "subletd sent a layout of the wrong length, or left "
                          "out one this client does not have");
  if (last != NULL && last->pages_version != b->pages_version) {
    sl_window_free(last); /* the region's pages were replaced since: its handles are stale */
    c->win = last = NULL;
  }
  if (last != NULL && sl_window_adopt(last, b->region, b->unkept_pages, b->fresh_pages,
                                      b->kept_pages, layout)) {
    last->keep = own != NULL || b->keep_window;
    last->layout_id = b->layout_id;
    return 0;
  }
  c->win = NULL;
  if (own != NULL)
    mine = (struct sl_window_own){own->handles, own->base, own->lead_pages, own->trail_pages,
                                  !region_has_forfeit(c, b->region) && !own->torch_blocks};
  rc = sl_window_new(c->dev, b->page_size, b->region, b->region_pages, b->unkept_pages,
                     b->fresh_pages, b->kept_pages, layout, own != NULL ? &mine : NULL,
                     c->info.total_bytes / b->page_size, &c->win, &err);
  if (rc == 0 && last != NULL && b->keep_window)
    sl_window_take_handles(c->win, last);
  sl_window_free(last); /* another region's: it may be gone */
  if (rc != 0)
    return sl_client_fail_err(&err);
  c->win->keep = own != NULL || b->keep_window;
  c->win->pages_version = b->pages_version;
  c->win->layout_id = b->layout_id;
  return 0;
}

/* The daemon lent, but this process cannot take the loan (no window): it goes straight back,
 * so that the owner is not left waiting for a borrower that holds nothing. */
static void give_back(sublet_client *c) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Return m = SUBLET__RETURN__INIT;

  m.has_force = 1;
  m.force = 1;
  req.body_case = SUBLET__REQUEST__BODY_RETURN;
  req.return_ = &m;
  sl_client_undo(c, &req, SUBLET__REPLY__BODY_RETURNED);
}

int sl_borrow_check_idle(sublet_client *c) {
  if (c->loan_id == 0)
    return 0;
  return sl_client_fail(SUBLET_EBUSY, "this client already borrows loan %llu: return it first",
                        (unsigned long long)c->loan_id);
}

/* What the watch thread does to this file's windows: watch.c sits below it, and calls up only
 * through these. */
static const struct sl_watch_ops watch_ops = {
    .forget = sl_borrow_forget, .let_go_gone = sl_borrow_let_go_gone, .keeps = sl_borrow_keeps};

int sl_borrow_take(sublet_client *c, const Sublet__Borrowed *b, int release_fd) {
  int rc = setup_window(c, b);

  if (rc != 0)
    give_back(c);
  if (rc == 0 && (rc = sl_watch_start(c, release_fd, &watch_ops)) != 0)
    give_back(c); /* the watch took release_fd over */
  else if (rc != 0 && release_fd >= 0)
    close(release_fd);
  if (rc == 0)
    c->loan_id = b->loan;
  return rc;
}

SUBLET_EXPORT int sublet_borrow(sublet_client *c, uint64_t loan_id,
                                const uint8_t token[SUBLET_TOKEN_SIZE], const char *name,
                                int timeout_ms) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Borrow m = SUBLET__BORROW__INIT;
  Sublet__Reply *rep = NULL;
  int release_fd = -1;
  size_t nfds = 1;
  int rc;

  m.has_loan = loan_id != 0;
  m.loan = loan_id;
  m.has_token = token != NULL;
  m.token.data = (uint8_t *)token;
  m.token.len = token != NULL ? SUBLET_TOKEN_SIZE : 0;
  m.has_name = name != NULL;
  m.name.data = (uint8_t *)name;
  m.name.len = name != NULL ? strlen(name) : 0;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms;
  m.has_rescue = m.rescue = 1; /* the release pipe, for the owner if the daemon dies */
  req.body_case = SUBLET__REQUEST__BODY_BORROW;
  req.borrow = &m;
  pthread_mutex_lock(&c->lock);
  m.known_layout = sl_borrow_known_layout(c);
  m.has_known_layout = m.known_layout != 0;
  rc = sl_client_ensure_device(c);
  if (rc == 0)
    rc = sl_borrow_check_idle(c);
  if (rc == 0)
    rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_BORROWED, &rep, &release_fd, &nfds,
                        timeout_ms);
  if (rc == 0 && nfds == 0)
    release_fd = -1; /* the owner did not ask for one */
  if (rc == 0)
    rc = sl_borrow_take(c, rep->borrowed, release_fd);
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* ------------------------------------------------------------------ allocating */

/* Imports the handles of the region pages at positions [pos, pos+n) that this process lacks
 * (a borrower in another process than the owner), in runs of consecutive pages. */
static int fetch_run_handles(sublet_client *c, struct sl_window *w, uint64_t pos, uint64_t n) {
  uint64_t p = pos;

  while (p < pos + n) {
    int64_t first = sl_window_page_at(w, p);
    uint64_t len = 1;
    if (first < 0 || w->handles[first] != 0) {
      p++;
      continue;
    }
    while (p + len < pos + n && len < SL_WIRE_MAX_FDS &&
           sl_window_page_at(w, p + len) == first + (int64_t)len &&
           w->handles[first + len] == 0)
      len++;
    int rc = sl_pages_fetch(c, w->region_id, (uint64_t)first, len, w->handles);
    if (rc != 0)
      return rc;
    p += len;
  }
  return 0;
}

/* Maps what an Allocated reply grants: the fresh chunk it carries, then the region pages. */
static int map_grant(sublet_client *c, const Sublet__Allocated *a, const int *fds, size_t nfds) {
  struct sl_window *w = c->win;
  struct sl_err err = {0};
  sl_handle h = 0;

  if ((a->fresh_pages > 0) != (nfds == 1))
    return sl_client_fail(SUBLET_EPROTO, "Allocated carried %zu fds for %llu fresh pages",
                          nfds, (unsigned long long)a->fresh_pages);
  if (nfds == 1) {
    if (sl_device_import(c->dev, fds[0], &h, &err) != 0 ||
        sl_window_add_chunk(w, a->fresh_pos, a->fresh_pages, h, &err) != 0)
      return sl_client_fail_err(&err);
  }
  if (w->owns_handles && fetch_run_handles(c, w, a->pos, a->pages) != 0)
    return sl_client_last_error()->code;
  if (sl_window_map_run(w, a->pos, a->pages, &err) != 0)
    return sl_client_fail_err(&err);
  return 0;
}

/* Frees an allocation in the daemon's books; undo: after a failed step (sl_client_undo). */
static int free_request(sublet_client *c, uint64_t alloc_id, int undo) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Free m = SUBLET__FREE__INIT;

  m.alloc = alloc_id;
  req.body_case = SUBLET__REQUEST__BODY_FREE;
  req.free = &m;
  return sl_client_ok(c, &req, undo);
}

/* The kept-zone mapping an allocation may need, done while subletd clears its pages. */
struct premap {
  sublet_client *c;
  uint64_t npages;
};

static int reply_here(void *arg) {
  return sl_client_readable(arg);
}

static void premap_run(void *arg) {
  const struct premap *pm = arg;

  if (pm->c->win != NULL)
    sl_window_premap(pm->c->win, pm->npages, reply_here, pm->c);
}

static int alloc_locked(sublet_client *c, uint64_t size, void **ptr) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Alloc m = SUBLET__ALLOC__INIT;
  Sublet__Reply *rep = NULL;
  struct premap pm;
  struct sl_meanwhile mw = {premap_run, &pm};
  int fds[1];
  size_t nfds = 1;
  int rc;

  if (c->lost)
    return sl_client_fail(SUBLET_EPIPE, "subletd went away during the loan: this process "
                          "let go of the loan's memory (tensors allocated from it are gone); "
                          "a restarted subletd serves new loans on a new connection");
  if (c->loan_id == 0)
    return sl_client_fail(SUBLET_ENOENT, "no loan is being borrowed: borrow one first");
  m.size = size;
  req.body_case = SUBLET__REQUEST__BODY_ALLOC;
  req.alloc = &m;
  pm = (struct premap){c, c->win != NULL ? (size + c->win->page_size - 1) / c->win->page_size : 0};
  rc = sl_client_call_meanwhile(c, &req, SUBLET__REPLY__BODY_ALLOCATED, &rep, fds, &nfds, &mw);
  if (rc == 0) {
    const Sublet__Allocated *a = rep->allocated;
    /* In the owner's process a run of consecutive region pages needs no mapping at all. */
    *ptr = nfds == 0 ? sl_window_direct(c->win, a->pos, a->pages) : NULL;
    if (*ptr == NULL) {
      rc = map_grant(c, a, fds, nfds);
      *ptr = (char *)c->win->base + a->pos * c->win->page_size;
    }
    if (rc == 0 && sl_window_alloc_add(c->win, *ptr, size, rep->allocated->alloc) != 0)
      rc = sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
    if (rc != 0)
      free_request(c, rep->allocated->alloc, 1);
  }
  sl_wire_close_fds(fds, nfds); /* imported by now: ours to close */
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_alloc(sublet_client *c, uint64_t size, void **ptr) {
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = alloc_locked(c, size, ptr);
  pthread_mutex_unlock(&c->lock);
  return rc;
}

/* An allocation of a loan that ended with it alive: forget it, and its window once empty. */
static int free_forfeit(sublet_client *c, void *ptr) {
  struct sl_window_alloc a;

  for (size_t i = 0; i < c->nforfeit; i++) {
    struct sl_window *w = c->forfeit[i];
    if (!sl_window_alloc_take(w, ptr, &a))
      continue;
    if (w->nallocs == 0) {
      sl_device_synchronize(c->dev, NULL);
      sl_window_free(w);
      c->forfeit[i] = c->forfeit[--c->nforfeit];
      sl_client_wake(c); /* its region may be gone: now nothing of it is left */
    }
    return 0;
  }
  return sl_client_fail(SUBLET_ENOENT, "%p was not allocated by sublet", ptr);
}

SUBLET_EXPORT int sublet_free(sublet_client *c, void *ptr) {
  struct sl_window_alloc a;
  int rc;

  pthread_mutex_lock(&c->lock);
  if (c->win != NULL && c->loan_id != 0 && sl_window_alloc_take(c->win, ptr, &a))
    rc = free_request(c, a.id, 0);
  else
    rc = free_forfeit(c, ptr);
  pthread_mutex_unlock(&c->lock);
  return rc;
}

static void leaks_from_reply(const Sublet__Error *e, const struct sl_window *w,
                             struct sublet_leak *leaks, size_t n, size_t *nleaks_out) {
  for (size_t i = 0; i < e->n_leaks && i < n; i++) {
    leaks[i].alloc_id = e->leaks[i]->alloc;
    leaks[i].size = e->leaks[i]->size;
    leaks[i].ptr = NULL;
    for (size_t j = 0; w != NULL && j < w->nallocs; j++)
      if (w->allocs[j].id == leaks[i].alloc_id)
        leaks[i].ptr = w->allocs[j].ptr;
  }
  if (nleaks_out != NULL)
    *nleaks_out = e->n_leaks;
}

/* The loan is over for this client: fresh memory goes back; the window stays for the region's
 * next loan when the daemon said so (keep_window) and the region lives; one with forfeit
 * allocations is kept until they are freed. */
static void end_borrowing(sublet_client *c, int forfeit, int region_gone) {
  struct sl_window *w = c->win;
  struct sl_window **fw;

  c->loan_id = 0;
  sl_watch_loan_over(c);
  if (forfeit && w->nallocs > 0 &&
      (fw = realloc(c->forfeit, (c->nforfeit + 1) * sizeof(*fw))) != NULL) {
    c->forfeit = fw;
    c->forfeit[c->nforfeit++] = w;
    c->win = NULL;
    return;
  }
  w->nallocs = 0;
  sl_window_drop_chunks(w);
  if (w->owns_handles && (!w->keep || region_gone)) {
    sl_window_free(w);
    c->win = NULL;
  }
}

static int return_locked(sublet_client *c, int force, struct sublet_loan_stats *stats,
                         struct sublet_leak *leaks, size_t nleaks, size_t *nleaks_out) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Return m = SUBLET__RETURN__INIT;
  Sublet__Reply *rep = NULL;
  double map_seconds = c->win != NULL ? c->win->map_seconds : 0;
  uint64_t mapped_pages = c->win != NULL ? c->win->mapped_pages : 0;
  int rc;

  if (c->lost)
    return sl_client_fail(SUBLET_EPIPE, "subletd went away during the loan; this process let "
                          "go of the loan's memory, and the owner restores its kept bytes");
  if (c->loan_id == 0)
    return sl_client_fail(SUBLET_ENOENT, "no loan is being borrowed");
  /* The borrower's GPU work must be finished before its pages change hands. */
  sl_device_synchronize(c->dev, NULL);
  m.has_force = 1;
  m.force = force != 0;
  req.body_case = SUBLET__REQUEST__BODY_RETURN;
  req.return_ = &m;
  rc = sl_client_call(c, &req, SUBLET__REPLY__BODY_RETURNED, &rep, NULL, NULL, 0);
  if (rc == 0 && stats != NULL)
    sl_msg_stats_from_proto(rep->returned, stats);
  if (rc == SUBLET_ELEAK && rep != NULL) {
    leaks_from_reply(rep->error, c->win, leaks, nleaks, nleaks_out);
    if (stats != NULL && rep->error->stats != NULL)
      sl_msg_stats_from_proto(rep->error->stats, stats);
  }
  if (rc == 0 || (rc == SUBLET_ELEAK && force)) {
    const Sublet__LoanStats *s = rc == 0 ? rep->returned : rep->error->stats;
    c->win->map_seconds = 0;
    c->win->mapped_pages = 0;
    end_borrowing(c, rc != 0, s == NULL || s->owner_gone);
  }
  if (stats != NULL) {
    stats->map_seconds = map_seconds;
    stats->mapped_pages = mapped_pages;
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_return(sublet_client *c, int force, struct sublet_loan_stats *stats,
                                struct sublet_leak *leaks, size_t nleaks, size_t *nleaks_out) {
  int rc;

  if (nleaks_out != NULL)
    *nleaks_out = 0;
  pthread_mutex_lock(&c->lock);
  rc = return_locked(c, force, stats, leaks, nleaks, nleaks_out);
  pthread_mutex_unlock(&c->lock);
  sl_watch_settle(c); /* unlocked: the watcher may be waiting for the lock */
  return rc;
}

void sl_borrow_forget(sublet_client *c) {
  sl_window_free(c->win);
  c->win = NULL;
  for (size_t i = 0; i < c->nforfeit; i++)
    sl_window_free(c->forfeit[i]);
  free(c->forfeit);
  c->forfeit = NULL;
  c->nforfeit = 0;
  c->ngone = 0; /* nothing is held now, and nobody to tell */
}

/* ------------------------------------------------------------------ a region gone */

static int kept(const struct sl_window *w) {
  return w != NULL && w->owns_handles && w->keep;
}

int sl_borrow_keeps(const sublet_client *c) {
  int any = kept(c->win) || c->ngone > 0;

  for (size_t i = 0; i < c->nforfeit && !any; i++)
    any = kept(c->forfeit[i]);
  return any;
}

/* Lets go of the region's kept window unless a loan of it is borrowed now; returns whether
 * nothing of it is left (a forfeit window of it goes only with its last allocation). */
static int let_go_region(sublet_client *c, uint64_t region) {
  if ((c->win != NULL && c->win->region_id == region && c->loan_id != 0) ||
      region_has_forfeit(c, region))
    return 0;
  if (c->win != NULL && c->win->region_id == region) {
    sl_window_free(c->win); /* waits for the device first: nothing touches it then */
    c->win = NULL;
  }
  return 1;
}

static void say_dropped(sublet_client *c, uint64_t region) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Dropped m = SUBLET__DROPPED__INIT;

  m.region = region;
  req.body_case = SUBLET__REQUEST__BODY_DROPPED;
  req.dropped = &m;
  sl_client_undo(c, &req, SUBLET__REPLY__BODY_OK); /* ENOENT too: the daemon forgot it */
}

void sl_borrow_let_go_gone(sublet_client *c) {
  size_t i = 0;

  while (i < c->ngone) {
    uint64_t region = c->gone[i];
    if (!let_go_region(c, region)) {
      i++;
      continue;
    }
    c->gone[i] = c->gone[--c->ngone];
    say_dropped(c, region); /* may note more notices: they go in c->gone */
  }
}

SUBLET_EXPORT int sublet_loan_stats(sublet_client *c, struct sublet_loan_stats *stats) {
  Sublet__Reply *rep;
  int rc;

  memset(stats, 0, sizeof(*stats));
  pthread_mutex_lock(&c->lock);
  rc = sl_client_status(c, &rep);
  if (rc == 0 && rep->status->loan != NULL)
    sl_msg_stats_from_proto(rep->status->loan->stats, stats);
  if (c->win != NULL) {
    stats->map_seconds = c->win->map_seconds;
    stats->mapped_pages = c->win->mapped_pages;
  }
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}
