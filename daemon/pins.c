/* pins.c - the loans' save area pinned ahead of their saves, off the event loop.
 *
 * Pinning host memory costs a fraction of a second per GiB (prefaulting it, then registering
 * it with the driver): paid by a loan's first save, it made the first cycle of a 64 GiB loan
 * 17 x a later one. A Lend says the most any save of its loan can write: its kept bytes. So
 * from the Lend on, the owner's save area is pinned up to them in the background, a piece at
 * a time, while the loan is offered and the borrower starts; a save that comes first pins
 * beside it (pool.c), waiting for the piece in progress at most, never for the whole.
 *
 * What is pinned when, and released when (docs/internals.md, "The save area"): up to the kept
 * bytes of a lend (never past the host's memory), from the Lend on; kept between loans of the
 * same user, so later loans find it pinned (a restarted process too); released when a loan of
 * another user's region takes the save area, when the user has had no region for --pin-keep
 * seconds (the area of a daemon started with --pin stays: that pin was asked for), or at
 * exit (an on-demand daemon's --idle-exit included). Nothing is pinned when a region is made:
 * its keep, and so what a loan of it saves, is not known then. An owner that knows it before
 * its first Lend says so (PinAhead, sl_pins_request): the same pin starts then, for at most
 * its user's regions' bytes, since a first save cannot make host memory faster than the
 * kernel makes pages (about 5 GB/s on the H200's host, pinned or not). For its releases
 * (PinAhead.release: a torch_memory_saver tag with a CPU backup) the pin goes into a spare
 * area of the user's, which its next release takes (pool.c: sl_pool_spare_of).
 *
 * One pin at a time, on libuv's thread pool beside the copies and the host work. It holds the
 * area (sl_pool_area_ref) until its done callback, and stops after the piece in progress
 * once the area is replaced or detached, or the daemon stops.
 *
 * Floor 6 (daemon.h's floors).
 */
#include <stdlib.h>

#include "clock.h"
#include "daemon.h"
#include "grow.h"
#include "log.h"

struct sl_pinner {
  uv_work_t work;
  struct sl_daemon *d;
  struct sl_pool_area *area; /* held until pin_after */
  int rc;
  struct sl_err err;
  double started;
  uint64_t from;             /* bytes it held pinned when the pin began */
};

static void pin_start(struct sl_daemon *d);

static void pin_run(uv_work_t *w) {
  struct sl_pinner *pn = w->data;
  int rc;

  while ((rc = sl_pool_pin_step(pn->d->pool, pn->area, &pn->err)) == 1)
    ;
  pn->rc = rc;
}

static void pin_log(const struct sl_pinner *pn) {
  uint64_t target, done;
  char a[16], b[16];

  sl_pool_pin_progress(pn->area, &target, &done);
  if (pn->rc != 0)
    sl_warn("pinning the save area ahead stopped at %s (a save pins what it lacks itself): %s",
            sl_format_size(a, done), pn->err.msg);
  else
    sl_info("pinned %s of the save area ahead in %.2f s: %s pinned",
            sl_format_size(a, done - pn->from), sl_clock_now() - pn->started,
            sl_format_size(b, done));
}

static void pin_after(uv_work_t *w, int status) {
  struct sl_pinner *pn = w->data;
  struct sl_daemon *d = pn->d;

  (void)status; /* never cancelled: the loop stops only once no pin runs */
  pin_log(pn);
  if (pn->rc != 0)
    sl_pool_pin_stop(pn->area); /* no retry: the next save says why, if it still fails */
  sl_pool_area_put(d->pool, pn->area);
  d->pinner = NULL;
  free(pn);
  pin_start(d); /* a new area's goal, set while this one ran */
  sl_jobs_maybe_stop(d);
}

/* Starts pinning an area toward its goal (the loans' current one first, then a spare pinned
 * for a release), unless a pin runs (it will come back here) or nothing is left to pin. */
static void pin_start(struct sl_daemon *d) {
  struct sl_pool_area *a = sl_pool_area_to_pin(d->pool);
  struct sl_pinner *pn;
  uint64_t target;

  if (d->pinner != NULL || d->stopping || a == NULL)
    return;
  if ((pn = calloc(1, sizeof(*pn))) == NULL)
    return; /* the saves pin what they need */
  pn->d = d;
  pn->area = sl_pool_area_ref(a);
  pn->started = sl_clock_now();
  sl_pool_pin_progress(pn->area, &target, &pn->from);
  pn->work.data = pn;
  d->pinner = pn;
  uv_queue_work(d->loop, &pn->work, pin_run, pin_after);
}

void sl_pins_ahead(struct sl_daemon *d, uint64_t bytes) {
  uint64_t target, done;
  char a[16], b[16];

  if (!sl_pool_pin_ahead(d->pool, NULL, bytes))
    return;
  sl_pool_pin_progress(sl_pool_host_area(d->pool), &target, &done);
  sl_info("pinning the save area ahead to %s (kept bytes to come; %s pinned)",
          sl_format_size(a, target), sl_format_size(b, done));
  pin_start(d);
}

/* The bytes of uid's regions together: what its loans could ever save. */
static uint64_t regions_bytes(struct sl_daemon *d, uid_t uid) {
  uint64_t page = sl_device_info(d->dev)->page_size, after = 0, total = 0;
  struct sl_region_info ri;

  for (; sl_books_region_next(d->books, after, &ri) == 0; after = ri.id)
    if (ri.owner.uid == uid)
      total += ri.npages * page;
  return total;
}

/* For uid's next release: its spare, pinned toward bytes. */
static int pin_spare(struct sl_daemon *d, uid_t uid, uint64_t bytes, struct sl_err *err) {
  struct sl_pool_area *a;
  uint64_t target, done;
  char s[16], t[16];
  int rc;

  /* A live release's area comes back, pinned, as the spare the next one takes: that is the
   * one to pin, not a second area beside it. */
  if (bytes == 0 || sl_releases_of_user(d, uid) > 0)
    return 0;
  if ((rc = sl_pool_spare_of(d->pool, uid, &a, err)) != 0 || !sl_pool_pin_ahead(d->pool, a, bytes))
    return rc;
  sl_pool_pin_progress(a, &target, &done);
  sl_info("pinning a save area for uid %u's next release ahead to %s (%s pinned)",
          (unsigned)uid, sl_format_size(s, target), sl_format_size(t, done));
  pin_start(d);
  return 0;
}

int sl_pins_request(struct sl_daemon *d, uid_t uid, uint64_t bytes, int release,
                    struct sl_err *err) {
  uint64_t most = regions_bytes(d, uid);
  uid_t holder;
  int fd;

  bytes = sl_min_u64(bytes, most);
  if (most == 0)
    return sl_err_set(err, SUBLET_ENOENT, "you have no region on this device: pin ahead once "
                      "the memory you will lend is made");
  if (release)
    return pin_spare(d, uid, bytes, err);
  if (sl_pool_host_owner(d->pool, &holder) == 0 && holder != uid)
    return sl_err_set(err, SUBLET_EBUSY, "the loans' save area is another user's now: your "
                      "Lend takes it and pins it for you when your loan comes");
  if (sl_pool_host_claim(d->pool, uid, &fd, err) != 0) /* fd: the area's, not ours */
    return err->code;
  sl_pins_ahead(d, bytes);
  return 0;
}

int sl_pins_progress(const struct sl_daemon *d, uint64_t *target, uint64_t *done) {
  return d->pinner != NULL && sl_pool_pin_progress(d->pinner->area, target, done);
}

/* ------------------------------------------------------------------ letting go */

/* A user of the loans' save area or of a spare who has no region left (0), else -1. */
static int owner_gone(struct sl_daemon *d, uid_t *uid) {
  uid_t users[SL_POOL_AREA_USERS_MAX];
  size_t n = sl_pool_area_users(d->pool, d->cfg.pin_bytes == 0, users); /* --pin's: asked for */

  for (size_t i = 0; i < n; i++) {
    if (regions_bytes(d, users[i]) == 0) {
      *uid = users[i];
      return 0;
    }
  }
  return -1;
}

/* uid's loans' area (unless --pin's) and its spares go. */
static void let_go(struct sl_daemon *d, uid_t uid) {
  uint64_t before = sl_pool_host_bytes(d->pool);
  uid_t owner;

  if (d->cfg.pin_bytes == 0 && sl_pool_host_owner(d->pool, &owner) == 0 && owner == uid)
    sl_pool_host_release(d->pool);
  sl_pool_spares_drop(d->pool, uid);
  sl_info("uid %u has had no region for %g s (--pin-keep): its save areas (%s pinned) are "
          "released", (unsigned)uid, d->cfg.pin_keep_seconds,
          sl_format_size((char[16]){0}, before - sl_pool_host_bytes(d->pool)));
}

static void on_keep_over(uv_timer_t *t) {
  struct sl_daemon *d = t->data;
  uid_t uid;

  while (owner_gone(d, &uid) == 0) /* none: a region came back meanwhile */
    let_go(d, uid);
}

void sl_pins_regions_changed(struct sl_daemon *d) {
  uid_t uid;

  if (d->stopping || owner_gone(d, &uid) != 0)
    return;
  uv_update_time(d->loop); /* this turn of the loop may have been long (freeing the region) */
  uv_timer_start(&d->pin_keep_timer, on_keep_over, (uint64_t)(d->cfg.pin_keep_seconds * 1e3), 0);
}

void sl_pins_init(struct sl_daemon *d) {
  uv_timer_init(d->loop, &d->pin_keep_timer);
  d->pin_keep_timer.data = d;
}

void sl_pins_stop(struct sl_daemon *d) {
  if (d->pinner != NULL)
    sl_pool_pin_stop(d->pinner->area);
  if (d->pin_keep_timer.loop != NULL && /* started: sl_pins_init ran */
      !uv_is_closing((uv_handle_t *)&d->pin_keep_timer))
    uv_close((uv_handle_t *)&d->pin_keep_timer, NULL);
}
