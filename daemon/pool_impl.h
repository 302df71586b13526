/* pool_impl.h - the pool's tables, shared by its two files: pool.c (pages, chunks, the save
 * area) and pool_transfer.c (copies and moves between them). Nothing outside daemon/pool*.c
 * includes it; the rest of the daemon sees pool.h.
 */
#ifndef SUBLET_DAEMON_POOL_IMPL_H
#define SUBLET_DAEMON_POOL_IMPL_H

#include "pool.h"

#include <pthread.h>

/* The save area grows in pieces of this size, so that it never has to move (saved bytes stay
 * where they are) and pinning is paid once per piece, not per loan. */
#define SL_HOST_PIECE (256ull << 20)

/* Threads. A region is shared by the loop and the copy lane's one running job (jobs.c). The
 * lane starts a job only once the job before it has had its done on the loop, and a transfer
 * runs on the loop (sl_jobs_inline) only while no job is in the line: so the loop's writes
 * below never overlap a job's reads, and a job sees the table as the loop left it.
 *   id: fixed at make.  npages: the loop's (grown, when the books take a growth).
 *   base, cap_pages, the pages and span arrays (the pointers): changed only by the loop
 *     (moved_take, in a growth's done) or while nothing else holds the region (make, free);
 *     read by the running job. A growth's job never changes them: it leaves its new table
 *     in moved, which the loop takes over before any later job runs, so no transfer can see
 *     the old base after the growth unmapped it (sl_pool_transfer_run refuses one that
 *     would, as a broken invariant, rather than touch an unmapped address).
 *   pages[i], span[i]: written by the running job on pages no one else reads then (a growth's
 *     new pages, a release's dropped ones) and by the loop when a transfer is freed
 *     (settle_replace); the loop reads the region's pages any time (PagesGet).
 *   busy, doomed, next: the loop's.  unmapped: the map job's, read by later jobs.
 *   moved: set by the growth's job, taken (cleared) by the loop in its done. */
struct sl_pool_region {
  uint64_t id;
  uint64_t npages;
  uint64_t cap_pages; /* address space reserved at base, and room in pages: what the books
                         reserved for it (npages, and for a growable region room to grow, which
                         doubles as it grows: issue 41) */
  sl_handle *pages;
  uint32_t *span; /* pages[p] backs span[p] pages (a page group, books.h; 0 inside one, and
                     1 for a released page, which has no handle) */
  void *base;   /* the daemon's own mapping of all pages, contiguous */
  int busy;     /* transfers that hold it: destroying waits for the last */
  int unmapped; /* made, not mapped in the daemon yet (sl_pool_region_make): no transfer */
  int doomed;   /* destroyed while busy: goes when the last transfer is freed */
  struct sl_pool_region *moved; /* a growth past cap_pages (its job): the region's table in a
                                   larger reservation (pages, span, base, cap_pages), its pages
                                   mapped there and no longer at base; the loop takes it over
                                   (sl_pool_region_grown) before any later job runs */
  struct sl_pool_region *next;
};

/* The host save area: a memfd pinned in pieces of SL_HOST_PIECE bytes. Its clients get it
 * sealed read-only (common/seal.h), so the daemon's one writable mapping, the window, is made
 * before the seal, over all the area may ever hold: a piece is pinned in it as the file grows
 * (a new writable mapping would be refused), and no client can shrink the file under it. */
struct sl_pool_area {
  int fd;         /* owned; sealed read-only */
  uid_t uid;      /* whose kept bytes it holds; (uid_t)-1: nobody's yet */
  char *window;   /* MAP_SHARED of window_bytes, from offset 0; or NULL */
  uint64_t window_bytes;
  /* A running transfer and the pin ahead (sl_pool_pin_step) grow the area on two threads,
   * one piece at a time: whoever sets growing (under grow_lock) pins the next piece, the
   * lock released meanwhile; the other waits on grown for it, and goes on as soon as the
   * pieces it needs are there (a save never waits for more), or pins the next one itself
   * once nobody does. nhost only grows, stored after its piece is pinned: read without the
   * lock (atomically) it says what is usable now. */
  pthread_mutex_t grow_lock;
  pthread_cond_t grown;
  int growing;    /* a thread pins the next piece now (under grow_lock) */
  void **host;    /* the pinned pieces: window + i * SL_HOST_PIECE (the grower's) */
  size_t nhost;
  size_t host_cap; /* host's room */
  size_t pin_target; /* pieces the pin ahead grows it to (atomic; 0: none, or stopped) */
  int busy;       /* transfers (and the pin ahead) that use it */
  int doomed;     /* replaced while busy: freed when the last transfer is */
};

/* Why a transfer makes pages before it copies (it copies nothing unless it made them all). */
enum must_replace {
  MUST_NONE = 0,
  MUST_RESUME = 1, /* a release's resume: the pages were given back to the driver */
  MUST_FRESH = 2,  /* a loan's end: the pages a borrower of another user was granted */
};

struct sl_pool_transfer {
  struct sl_pool *pool;
  struct sl_pool_region *region;
  struct sl_pool_area *area;
  enum sl_copy_dir dir;
  struct sl_copy *copies; /* as given */
  size_t ncopies;
  struct sl_move *moves;  /* inside the region */
  size_t nmoves;
  struct sl_copy *pieces; /* the copies split where they cross host pieces: npieces */
  size_t npieces;
  uint64_t *replace;      /* region pages to give new pages first (sl_pool_transfer_replace) */
  uint32_t *rspan;        /* the pages each new handle backs (a group's): NULL, one each */
  sl_handle *fresh;       /* their new handles: created by the run */
  size_t nreplace, nfresh, nreplaced;
  size_t *replaced;       /* the caller's: nreplaced once the run is done */
  enum must_replace must; /* no copy runs unless every page was made: whose pages they are */
};

struct pool_chunk {
  uint64_t id;
  uint64_t npages;
  sl_handle handle;
  struct pool_chunk *next;
};

/* Save areas that releases gave back, kept (pinned) for the next release of their user. */
#define SL_POOL_SPARES 4

struct sl_pool {
  struct sl_device *dev;
  uint64_t page_size;
  struct sl_pool_region *regions;
  struct pool_chunk *chunks;
  struct sl_pool_area *area;  /* the current save area; NULL until first needed */
  struct sl_pool_area *spares[SL_POOL_SPARES]; /* releases' areas between releases */
};

/* pool.c's, for pool_transfer.c. */
struct sl_pool_region *sl_pool_find_region(const struct sl_pool *p, uint64_t id);
int sl_pool_area_reserve(struct sl_device *dev, struct sl_pool_area *a, uint64_t bytes,
                        struct sl_err *err);
uint64_t sl_pool_area_ready(const struct sl_pool_area *a);
void sl_pool_unmap_range(struct sl_pool *p, struct sl_pool_region *r, uint64_t from, uint64_t to);
void sl_pool_region_unmap_release(struct sl_pool *p, struct sl_pool_region *r);
int sl_pool_area_new(uid_t uid, struct sl_pool_area **out, struct sl_err *err);
void sl_pool_area_free(struct sl_device *dev, struct sl_pool_area *a);

#endif
