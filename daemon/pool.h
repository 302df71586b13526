/* pool.h - the daemon's physical memory: region pages, fresh chunks and the host save area.
 *
 * The books say what happens; the pool does it on the device. Every region's pages are also
 * mapped in the daemon's own address space, contiguously, so that it can save and restore kept
 * bytes itself whatever its clients do (or whether they still live). The host save area is kept
 * between loans: pinning host memory is the most expensive step of a first offload.
 */
#ifndef SL_POOL_H
#define SL_POOL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "device.h"

struct sl_pool;

int sl_pool_new(struct sl_device *dev, struct sl_pool **out);
/* Releases everything the pool still holds. */
void sl_pool_free(struct sl_pool *p);

/* A region in halves, so that the slow one (creating and mapping, or unmapping and releasing,
 * every page: 2 s for 64 GiB on an H200) can run off the event loop: make, map and free touch
 * only the region and the device (any thread); add and take, the pool's list (the loop). take
 * returns NULL for a region it does not have, or one a transfer still holds (freed with it). */
struct sl_pool_region;
/* A region's pages, in two steps. make (any thread) creates them, which may be exported at
 * once; cap_pages: the pages of address space reserved now in the daemon's mapping (npages or
 * less: just them). map (any thread, the region held)
 * maps them in the daemon's mapping, which every transfer needs (one of a region not mapped
 * yet, or whose map failed, is refused). The map of 32,768 pages takes most of a second on an
 * H200 (mostly cuMemSetAccess): made then mapped, a new region's pages go to its owner while
 * the daemon maps them. */
int sl_pool_region_make(struct sl_pool *p, uint64_t region_id, uint64_t npages,
                        uint64_t cap_pages, struct sl_pool_region **out, struct sl_err *err);
int sl_pool_region_map(struct sl_pool *p, struct sl_pool_region *r, struct sl_err *err);
/* Growing a region in the same halves. hold (the loop): the region is kept from being freed
 * until grown (NULL: not in the pool). grow (any thread, with the region held, no transfer
 * running): pages [its npages, npages) are created and mapped after the others. Past its
 * reservation, the daemon's mapping first moves to a new one of cap_pages (its pages mapped
 * there, nothing copied; the owner's addresses are the owner's, and stay), so that a growable
 * region reserves what it holds, not the device (issue 41). Nothing else of the region is
 * touched, and on failure nothing is left but such a move. grown (the loop): the move is
 * taken over, the new pages become the region's (keep) or are undone; the hold ends (a region
 * taken meanwhile is freed now, with them). It returns the pages reserved for the region now
 * (its cap_pages: the books count them, sl_books_region_space). */
struct sl_pool_region *sl_pool_region_hold(struct sl_pool *p, uint64_t region_id);
/* Ends a hold that grew nothing (a map's). */
void sl_pool_region_put(struct sl_pool *p, struct sl_pool_region *r);
int sl_pool_region_grow(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages,
                        uint64_t cap_pages, struct sl_err *err);
uint64_t sl_pool_region_grown(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages,
                              int keep);
void sl_pool_region_add(struct sl_pool *p, struct sl_pool_region *r);
struct sl_pool_region *sl_pool_region_take(struct sl_pool *p, uint64_t region_id);
void sl_pool_region_free(struct sl_pool *p, struct sl_pool_region *r);
uint64_t sl_pool_region_bytes(const struct sl_pool *p, const struct sl_pool_region *r);
/* Exports pages [first, first+count) as new fds into fds[]; the caller closes them. */
int sl_pool_export_pages(struct sl_pool *p, uint64_t region_id, uint64_t first, uint32_t count,
                         int *fds, struct sl_err *err);
/* The same a handle each: fds[i] (the caller closes them) backs spans[i] pages; *n of them, at
 * most SL_WIRE_MAX_FDS (E2BIG past it). [first, first+count) is whole groups (the books'). */
int sl_pool_export_groups(struct sl_pool *p, uint64_t region_id, uint64_t first, uint64_t count,
                          int *fds, uint32_t *spans, size_t *n, struct sl_err *err);

/* A fresh chunk of npages, exported as *fd (the caller closes it once sent). */
int sl_pool_chunk_create(struct sl_pool *p, uint64_t chunk_id, uint64_t npages, int *fd,
                         struct sl_err *err);
void sl_pool_chunk_release(struct sl_pool *p, uint64_t chunk_id);

/* The device work of one step of a loan, on one region: moves inside it (struct sl_move, region
 * offsets) and copies between it and the host save area (struct sl_copy, dev_off a region
 * offset, host_off a save-area offset; SL_COPY_TO_HOST saves, SL_COPY_TO_DEVICE restores). A
 * save moves first, then copies; a restore copies first (that brings back the bytes that were
 * moved into pages lent later), then moves back. Prepared on the event loop, run on any thread.
 * The transfer holds the region and the save area: destroying (or replacing) them meanwhile
 * waits until it is freed. Run grows the area as needed and touches nothing but the transfer,
 * its area and the device, so the loop may go on using the pool; one run at a time. */
struct sl_pool_transfer;

int sl_pool_transfer_new(struct sl_pool *p, enum sl_copy_dir dir, uint64_t region_id,
                         const struct sl_copy *c, size_t n, const struct sl_move *m,
                         size_t nm, struct sl_pool_transfer **out, struct sl_err *err);
/* A restore's transfer can first give region pages pages[0..n) (ascending) new pages: created,
 * mapped in the daemon's own mapping where the old ones were, the old ones released (their
 * memory lives on for whoever else holds them; nothing is copied from them). All or none, and
 * before any copy: the run writes to *replaced (the caller's, read after the run) the pages
 * made, and when it could not make them all it copies nothing and fails with SUBLET_ENOMEM,
 * the old pages staying and holding nothing restored (a loan's end to another user: its
 * borrower may still reach them, docs/design/isolation.md). The pool's table of handles
 * changes when the transfer is freed, on the loop. */
int sl_pool_transfer_replace(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                             size_t *replaced, struct sl_err *err);
/* The same for a release's resume (the pages were given back to the driver; its error says
 * the release goes on). */
int sl_pool_transfer_replace_all(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                                 size_t *replaced, struct sl_err *err);
/* The same, for a resume that makes groups (books.h, "Page groups"): groups holds n (first,
 * count) pairs of released pages, each made as one handle of count pages and mapped as one;
 * *replaced counts pages. */
int sl_pool_transfer_make_groups(struct sl_pool_transfer *t, const uint64_t *groups, size_t n,
                                 size_t *replaced, struct sl_err *err);
/* A release: after the run (any thread, the transfer held), the daemon lets go of region
 * pages pages[0..n): unmapped from its mapping (the device waited for first), handles
 * released. Their memory goes back to the driver once no client maps them either. */
int sl_pool_transfer_drop(struct sl_pool_transfer *t, const uint64_t *pages, size_t n,
                          struct sl_err *err);
/* *copy_seconds and *move_seconds get the time each part took. */
int sl_pool_transfer_run(struct sl_pool_transfer *t, double *copy_seconds, double *move_seconds,
                         struct sl_err *err);
/* On the loop, after the run. */
void sl_pool_transfer_free(struct sl_pool_transfer *t);
/* A transfer with its own save area (a release's), not the loans' current one. */
struct sl_pool_area;
int sl_pool_transfer_new_in(struct sl_pool *p, struct sl_pool_area *area, enum sl_copy_dir dir,
                            uint64_t region_id, const struct sl_copy *c, size_t n,
                            const struct sl_move *m, size_t nm, struct sl_pool_transfer **out,
                            struct sl_err *err);
/* A release's save area: a spare that an earlier release of uid gave back (pinned already:
 * pinning is the slow part of a first save), or a new one; *fd its memfd (the area's: send
 * it, do not close it). give: the release is over, the area a spare (at most a few are kept,
 * the largest; the others go). bytes: what it holds pinned. */
int sl_pool_area_take(struct sl_pool *p, uid_t uid, struct sl_pool_area **out, int *fd,
                      struct sl_err *err);
void sl_pool_area_give(struct sl_pool *p, struct sl_pool_area *a);
/* The area goes, never a spare (another process may still read its memfd). */
void sl_pool_area_drop(struct sl_pool *p, struct sl_pool_area *a);
/* Whose kept bytes it holds ((uid_t)-1: nobody's yet). */
uid_t sl_pool_area_uid(const struct sl_pool_area *a);
/* The users of the loans' area (loans: 1; 0 leaves it out) and of the spares, into uids
 * (room for 1 + SL_POOL_SPARES), repeats and all; how many. spares_drop: uid's spares go. */
#define SL_POOL_AREA_USERS_MAX 5
size_t sl_pool_area_users(const struct sl_pool *p, int loans, uid_t *uids);
void sl_pool_spares_drop(struct sl_pool *p, uid_t uid);
uint64_t sl_pool_area_bytes(const struct sl_pool_area *a);
/* The loans' current save area (NULL: none yet), held: it outlives the transfers that use it
 * and a claim of another user that replaces it, until sl_pool_area_put. detach makes it the
 * holder's alone (a loan's end waiting for fresh pages keeps its saved bytes there): the next
 * loan claims a new one, and the last put frees it. ref: any area held so (a spare). */
struct sl_pool_area *sl_pool_area_hold(struct sl_pool *p);
struct sl_pool_area *sl_pool_area_ref(struct sl_pool_area *a);
void sl_pool_area_detach(struct sl_pool *p, struct sl_pool_area *a);
void sl_pool_area_put(struct sl_pool *p, struct sl_pool_area *a);
/* The save area for a loan of uid's region: the current one if it is uid's (or nobody's
 * yet), else a new one. *fd is its memfd, the pool's: the caller may send it, not close it. */
int sl_pool_host_claim(struct sl_pool *p, uid_t uid, int *fd, struct sl_err *err);
/* Makes sure the save area holds at least bytes (pinning ahead of need). */
int sl_pool_host_reserve(struct sl_pool *p, uint64_t bytes, struct sl_err *err);
/* Pinned by the loans' area and the spares (not by live releases' areas). */
uint64_t sl_pool_host_bytes(const struct sl_pool *p);

/* Pinning ahead (daemon/pins.c runs it). pin_ahead (the loop): area a (NULL: the loans'
 * current one) is to hold bytes (capped at the host's memory, in whole pieces; the goal only
 * rises, until the area goes); 1 if that needs pinning, else 0. area_to_pin: the loans' area
 * if it is below its goal, else such a spare, else NULL. spare_of: the spare that uid's next
 * release takes (sl_pool_area_take), made if uid has none, to pin ahead for it. pin_step (any
 * thread, the area held with sl_pool_area_hold or _ref): pins one more piece toward the goal; 1 while more remain, 0 once there
 * (or stopped), or an error. A save running meanwhile shares the pinning, a piece at a time:
 * it waits at most for one piece, never for the goal. pin_stop: the goal drops to what is
 * pinned (an area replaced, detached or freed stops by itself). pin_progress: the goal and
 * what is pinned so far (bytes); 1 while the goal is not reached. */
int sl_pool_pin_ahead(struct sl_pool *p, struct sl_pool_area *a, uint64_t bytes);
struct sl_pool_area *sl_pool_area_to_pin(struct sl_pool *p);
int sl_pool_spare_of(struct sl_pool *p, uid_t uid, struct sl_pool_area **out,
                     struct sl_err *err);
int sl_pool_pin_step(struct sl_pool *p, struct sl_pool_area *a, struct sl_err *err);
void sl_pool_pin_stop(struct sl_pool_area *a);
int sl_pool_pin_progress(const struct sl_pool_area *a, uint64_t *target, uint64_t *done);
/* The loans' current area (NULL: none), to look at; its user (0), or -1 when there is none
 * or it is nobody's yet; release: it goes (once no transfer uses it), the next loan claims a
 * new one. */
const struct sl_pool_area *sl_pool_host_area(const struct sl_pool *p);
int sl_pool_host_owner(const struct sl_pool *p, uid_t *uid);
void sl_pool_host_release(struct sl_pool *p);

#endif
