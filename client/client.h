/* client.h - libsublet's internals: the client and region structs, and each file's functions
 * for the files above it.
 *
 * The files stand on floors, lowest first: a file calls functions of files on lower floors
 * only, never of a file on its own floor or above; a lower file reaches an upper one only
 * through a callback it was given (struct sl_watch_ops: watch.c -> borrow.c's windows). Each
 * file's opening comment names its floor. tests/check-floors reads the floor lines below and
 * checks them against nm of the built objects (ctest: check_floors_client); a new file takes
 * the floor above the highest one it calls.
 *
 *   floor 1: client.c window.c status_json.c   the connection, its one request path, errors;
 *            a borrower's address window (the device only); a Status as JSON
 *   floor 2: keep.c status.c watch.c pages.c   keep ranges; sublet_status; the watch thread;
 *            a region's pages mapped, remapped and let go of in the owner's process
 *   floor 3: release.c rescue.c                a region's releases; the owner's rescue when
 *            subletd died mid-loan
 *   floor 4: region.c                          regions created, grown and released (their
 *            releases and rescue go with them)
 *   floor 5: borrow.c pool.c                   the borrower's side; pools (tags' segments of
 *            one growable region)
 *   floor 6: lend.c torch.c                    the owner's lending (a local lend borrows
 *            through borrow.c) and the loan's end; PyTorch's alloc/free pair
 *   floor 7: connect.c                         a client made, and torn down floor by floor
 *   floor 8: release_offer.c                   release offers (each with a connection of its
 *            own, closed through connect.c)
 *   floor 9: take.c                            a scheduler's takes of release offers
 */
#ifndef SL_CLIENT_H
#define SL_CLIENT_H

#include <pthread.h>
#include <stdatomic.h>

#include "device.h"
#include "keepwire.h"
#include "sublet.pb-c.h"
#include "sublet.h"
#include "window.h"
#include "wire.h"

struct sublet_region {
  sublet_client *client;
  uint64_t id;
  uint64_t npages;
  uint64_t page_size;
  sl_handle *handles;  /* imported at creation; this process's references to the pages */
  uint32_t *span;      /* page groups (a resume's, daemon/books/books.h): handles[p] backs span[p]
                          pages; inside a group span 0 and handles[p] the group's (not owned
                          twice). NULL while every page is its own */
  void *base;          /* all pages mapped contiguously: the tensor's memory */
  void *reserved;      /* the address space reserved: lead_pages below base, the pages, then
                          trail_pages */
  uint64_t lead_pages; /* room for a loan's fresh zone right below base (window.c: aliased) */
  uint64_t trail_pages; /* ... and for its fresh and kept zones above the last page */
  uint64_t cap_pages;  /* pages it may grow to: npages, or (growable) the device's memory;
                          handles has room for them all, and trail_pages shrinks as it grows */
  struct sl_rescue *rescue; /* of the loan in progress: restoring without subletd (rescue.c) */
  struct sl_release_rec *releases; /* its live releases (release.c) */
  int torch_blocks;    /* its pages back PyTorch's blocks (a pool's arena: pool.c): a loan's
                          window never hands out their addresses, or PyTorch would see two
                          live blocks at one address (it aborts: "invalid device pointer") */
  atomic_int pool_held; /* an arena's: held for a loan (sublet_pool_hold), without which its
                          Lend is refused (set by pool.c under its lock, read by lend.c) */
  struct sublet_region *next;
};

struct sublet_client {
  int sock;             /* owned */
  pthread_mutex_t lock; /* serialises requests: PyTorch calls the hooks from any thread */
  /* Held while a frame is written: a Cancel from another thread (sublet_cancel) is written
   * while the lock's holder waits for its reply. Guards next_id and waiting_id too. */
  pthread_mutex_t send_lock;
  uint64_t waiting_id;  /* the request sent that waits in subletd (wait_ms != 0), or 0 */
  int can_cancel;       /* Welcome.cancel */
  int grow_ok;          /* Welcome.grow: growable regions */
  int pinned_ok;        /* Welcome.pinned: Lend.pinned */
  int release_ok;       /* Welcome.release: Lend.release, Resume */
  int offer_ok;         /* Welcome.release_offer: release offers (release_offer.c) */
  int early_resume_ok;  /* Welcome.early_resume: Resume.early, ResumeEnd */
  int pin_ahead_ok;     /* Welcome.pin_ahead: PinAhead */
  int release_need_ok;  /* Welcome.release_need: Lend.need_bytes */
  int release_more_ok;  /* Welcome.release_more: ReleaseMore */
  int take_need_ok;     /* Welcome.take_need: Take.need_bytes, TakeMore, ReleaseOffer.by_need */
  struct sl_keepwire_tx keep; /* Welcome.keep_ranges, .keep_fd and the keep memfd (keepwire.h) */
  struct sl_wire_rx rx;
  uint64_t next_id;
  struct sublet_info info;
  struct sl_device *dev; /* opened at the first region or borrow */
  struct sublet_region *regions;
  struct sl_arena *arena; /* pool.c: the tags' segments in one growable region; NULL: none */
  uint64_t pool_margin;   /* pool.c: device bytes an arena growth leaves free (0: no check) */
  struct sl_window *win;  /* the current or last loan's window */
  struct sl_window **forfeit; /* windows of loans ended with live allocations */
  size_t nforfeit;
  uint64_t loan_id;       /* the loan being borrowed, 0 if none */
  struct sl_watch *watch; /* from the first borrow on: hears the daemon between calls */
  int wake_fd;            /* the watch's eventfd, to wake it; -1: none (owned by the watch) */
  uint64_t *gone;         /* regions that RegionGone named, not yet let go of (borrow.c) */
  size_t ngone, capgone;
  int lost;               /* the daemon went mid-loan: the loan's pages were let go */
  int timeout_ms;         /* how long subletd may take to answer (sublet_set_timeout) */
  char path[108];         /* the socket, for messages */
};

/* A call's deadline by default: subletd answers within microseconds, or the time of the copies
 * a request needs (a save of kept bytes takes a small part of this: docs/benchmarks.md); past
 * this it is not answering. $SUBLET_TIMEOUT (seconds) or sublet_set_timeout() change it. */
#define SL_CLIENT_TIMEOUT_MS 30000
/* Connecting gives up after this (a daemon that does not accept: stopped, or its backlog full). */
#define SL_CLIENT_CONNECT_MS 10000

/* ------------------------------------------------------------------ client.c */

/* The calling thread's last error (its message is sublet_last_error()). */
struct sl_err *sl_client_last_error(void);
/* Records the calling thread's last error; returns code. */
int sl_client_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int sl_client_fail_err(const struct sl_err *err);
/* Connects (path NULL: $SUBLET_SOCKET, else the system socket) and says Hello. */
int sl_client_open(const char *path, sublet_client **out);
/* Waits for this process's device work, then closes the socket: the daemon settles the books
 * whatever state the client leaves. */
void sl_client_hang_up(sublet_client *c);
/* Closes the device and frees c; every layer above has let go of it. */
void sl_client_free(sublet_client *c);
/* The one request path (the caller holds c->lock): sends req, waits for its reply and checks
 * that it is `expect`. wait_ms is how long the daemon itself waits before it answers (Reclaim's
 * and Borrow's timeouts; 0 for every other request; < 0: as long as it takes): the call's
 * deadline is that plus c->timeout_ms, and past it the call fails with ETIMEDOUT ("subletd did
 * not answer"), the connection broken (a late reply would answer the next request). An Error reply becomes its code and
 * the thread's last error; anything else unexpected breaks the connection (EPROTO).
 * out (may be NULL: freed here): the reply of a success, or an Error for its details (leaks),
 * NULL otherwise; the caller frees it. fds/nfds (may be NULL): *nfds is the capacity in and
 * the count of fds out, which the caller owns (a failure closes them and gives none). */
int sl_client_call(sublet_client *c, Sublet__Request *req, Sublet__Reply__BodyCase expect,
                   Sublet__Reply **out, int *fds, size_t *nfds, int wait_ms);
/* The same, with fd (not -1) sent along with req: a Lend's keep memfd. fd stays the caller's. */
int sl_client_call_fd(sublet_client *c, Sublet__Request *req, int fd,
                      Sublet__Reply__BodyCase expect, Sublet__Reply **out, int *fds,
                      size_t *nfds, int wait_ms);
/* Work done while a request's reply is awaited: run(arg) is called once req is sent, before
 * its reply is read (a grant that waits for subletd's copies maps meanwhile), and should end
 * soon once sl_client_readable says the reply has come. */
struct sl_meanwhile {
  void (*run)(void *arg);
  void *arg;
};
/* sl_client_call_fd with mw's work in the wait (mw may be NULL). */
int sl_client_call_fd_meanwhile(sublet_client *c, Sublet__Request *req, int fd,
                                Sublet__Reply__BodyCase expect, Sublet__Reply **out, int *fds,
                                size_t *nfds, int wait_ms, const struct sl_meanwhile *mw);
/* sl_client_call (wait_ms 0) with mw's work in the wait. */
int sl_client_call_meanwhile(sublet_client *c, Sublet__Request *req,
                             Sublet__Reply__BodyCase expect, Sublet__Reply **out, int *fds,
                             size_t *nfds, const struct sl_meanwhile *mw);
/* 1 when the connection has something to read (a reply, a notice, its end), else 0. */
int sl_client_readable(const sublet_client *c);
/* Undoes a step that failed by the request req (the caller holds c->lock): its own outcome is
 * not reported (returns 0), the thread's last error stays the one that says why the step
 * failed. */
int sl_client_undo(sublet_client *c, Sublet__Request *req, Sublet__Reply__BodyCase expect);
/* Sends req, which subletd answers with Ok: a step, its outcome returned (sl_client_call), or
 * with undo set the undoing of a step that failed (sl_client_undo). */
int sl_client_ok(sublet_client *c, Sublet__Request *req, int undo);
/* Asks the daemon for its Status (the caller holds c->lock and frees *rep, set even on
 * failure when an Error came). */
int sl_client_status(sublet_client *c, Sublet__Reply **rep);
/* Opens this process's side of the daemon's device, once. */
int sl_client_ensure_device(sublet_client *c);
/* Wakes the watch (c->wake_fd), if any: the client's state changed (c->lock held or not). */
void sl_client_wake(sublet_client *c);
/* Reads the notices that came while no request was in flight, without waiting (the caller
 * holds c->lock and sends no request meanwhile): 0, or the connection is broken (anything but
 * a notice, or its end). */
int sl_client_read_notices(sublet_client *c);
/* Is the connection gone (the daemon died or closed it, or it was shut as broken)? */
int sl_client_gone(const sublet_client *c);

/* ------------------------------------------------------------------ pages.c */

/* Imports pages [first, first+count) of a region into handles[first..] (fds closed at once). */
int sl_pages_fetch(sublet_client *c, uint64_t region, uint64_t first, uint64_t count,
                   sl_handle *handles);
/* Byte ranges of whole pages of r, any order and overlap, as sorted merged (first page,
 * count) pairs in *out (malloc'd, *nout pairs). */
int sl_pages_pairs(const struct sublet_region *r, const struct sublet_range *ranges,
                   size_t n, uint64_t **out, size_t *nout);
/* New pages for runs ((first, count) pairs) of r fetched and mapped at their addresses, in
 * place of the old ones (released, for a release: none). */
int sl_pages_remap(sublet_client *c, struct sublet_region *r, const uint64_t *runs, size_t n);
/* Groups ((first, count) pairs of released pages, a resume's) fetched as one handle each and
 * mapped at their addresses (daemon/books/books.h, "Page groups"). */
int sl_pages_map_groups(sublet_client *c, struct sublet_region *r, const uint64_t *groups,
                        size_t n);
/* Unmaps pages [first, first+count) of r's own mapping (the device idle), whole groups, and
 * releases this process's handles of them: sl_pages_unmap, then sl_pages_drop_handles. */
void sl_pages_let_go(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count);
/* ... the unmapping alone: the handles stay. With unmapped (r->npages marks, or NULL), only
 * the pages not marked yet, and it marks every page whose mapping went. */
void sl_pages_unmap(sublet_client *c, struct sublet_region *r, uint64_t first, uint64_t count,
                    uint8_t *unmapped);
/* ... the handles alone (their pages unmapped already). */
void sl_pages_drop_handles(sublet_client *c, struct sublet_region *r, uint64_t first,
                           uint64_t count);
/* Maps the pages marked in unmapped[] again with the handles this process still holds, and
 * clears the marks: what an unmapping undone leaves intact. */
int sl_pages_map_again(sublet_client *c, struct sublet_region *r, uint8_t *unmapped);
/* The window of a loan of r that maps r's own pages goes (before they change). */
void sl_pages_drop_window(sublet_client *c, const struct sublet_region *r);

/* ------------------------------------------------------------------ region.c */

/* This client's region with that id, or NULL. */
struct sublet_region *sl_region_find(sublet_client *c, uint64_t id);
/* Unmaps and releases this process's side of every region (the daemon's side goes with the
 * connection). */
void sl_region_forget_all(sublet_client *c);

/* ------------------------------------------------------------------ rescue.c */

/* Takes over fds (journal, save area, release pipe's read end: Lent's) for the loan. */
int sl_rescue_new(uint64_t loan_id, const int fds[3], struct sl_rescue **out);
void sl_rescue_free(struct sl_rescue *r);
uint64_t sl_rescue_loan(const struct sl_rescue *r);
/* The daemon is gone: waits (timeout_ms; < 0 forever) until the borrower let go, restores
 * the region's kept bytes from the save area; returns SUBLET_EDAEMONDIED with *stats (may
 * be NULL) when they are back, else the failure (SUBLET_ETIMEDOUT: call it again). The caller
 * does not hold the client's lock (the borrower may be this process, letting go). */
int sl_rescue_run(struct sublet_region *reg, int timeout_ms, struct sublet_loan_stats *stats);
/* The loan's end waits for fresh pages (Error.awaits_fresh_pages): this process lets go of its
 * mapping and handles of the pages a borrower of another user was granted (the journal's
 * GRANT entries), once per loan (the rescue's own letting go is the same). Returns 1 when it
 * let go now, 0 when there was nothing to do, or an error. The caller holds the client's lock
 * and has dropped the region's window. */
int sl_rescue_let_go_granted(struct sublet_region *reg);

/* ------------------------------------------------------------------ release.c */

/* The region goes: its releases' records (fds, plans) too. */
void sl_release_forget(struct sublet_region *r);
/* The first page of [from, to) in the set of a live release of r (released, or stayed and
 * holding kept bytes until the resume), or to: a pool segment takes none (pool.c). The caller
 * holds the client's lock. */
uint64_t sl_release_set_in(const struct sublet_region *r, uint64_t from, uint64_t to);

/* ------------------------------------------------------------------ release_offer.c */

/* A release offer's stats as the daemon relays them (m may be NULL: zeros). */
/* A ReleaseStats's figures into s (release.c); the seconds and allocations it leaves are the
 * caller's. */
void sl_release_stats_from(const Sublet__ReleaseStats *m, struct sublet_release_stats *s);
void sl_offer_stats_from(const Sublet__OfferStats *m, struct sublet_release_stats *s);

/* ------------------------------------------------------------------ watch.c */

/* Watches c's connection from its first loan on (the caller holds c->lock): the daemon's end,
 * and notices while no request is in flight; takes over release_fd (this loan's release
 * pipe's write end, or -1) and closes the last loan's. loan_over (c->lock held): the loan
 * ended normally, its release fd is closed. stop: the client goes; settle: the watch stops if
 * nothing needs it now (no loan, no window of a region that may go: ops->keeps); both never
 * with c->lock held. sl_client_wake makes it look again at the client's state. */
struct sl_watch_ops { /* what the watch does to the borrower's windows (borrow.c's), c->lock held */
  void (*forget)(sublet_client *c);      /* the daemon is gone: every window goes */
  void (*let_go_gone)(sublet_client *c); /* the regions RegionGone named */
  int (*keeps)(const sublet_client *c);  /* a window of a region that may go is kept */
};
int sl_watch_start(sublet_client *c, int release_fd, const struct sl_watch_ops *ops);
void sl_watch_loan_over(sublet_client *c);
void sl_watch_stop(sublet_client *c);
void sl_watch_settle(sublet_client *c);

/* ------------------------------------------------------------------ borrow.c */

/* Unmaps and frees every window of c (the connection is closed: its loans are over). */
void sl_borrow_forget(sublet_client *c);
/* Lets go of the regions that RegionGone named (c->gone), those no loan of this process uses
 * now: unmaps and releases their windows, says Dropped (the caller holds c->lock). */
void sl_borrow_let_go_gone(sublet_client *c);
/* Does this process keep a window of another process's region (which may go: notices)? */
int sl_borrow_keeps(const sublet_client *c);
/* SUBLET_EBUSY when the client borrows a loan already (one at a time). */
int sl_borrow_check_idle(sublet_client *c);
/* Starts borrowing the loan the daemon granted (Borrowed, from Borrow or a local Lend): sets up
 * the window and the watch of release_fd (-1: none; taken over either way), or gives the loan
 * straight back when it cannot (the caller holds c->lock). */
int sl_borrow_take(sublet_client *c, const Sublet__Borrowed *b, int release_fd);
/* Borrow.known_layout: the layout id of the window this client holds (0: none). */
uint64_t sl_borrow_known_layout(const sublet_client *c);

/* ------------------------------------------------------------------ pool.c */

/* Frees the arena's books (its region goes with the others: sl_region_forget_all). */
void sl_pool_forget(sublet_client *c);

/* ------------------------------------------------------------------ torch.c */

/* Drops every reference torch.c keeps to c: it is being freed. */
void sl_torch_forget(sublet_client *c);

#endif
