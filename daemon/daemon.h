/* daemon.h - subletd's state shared by its modules: server.c (socket, signals), transport.c
 * (connections below the protocol: frames, output queues, deadlines), users.c (per-uid
 * admission and the counts of the bounds shared by connections), conn.c (one client's
 * conversation on its transport), handlers.c (requests; lends.c, allocs.c, regions.c and
 * releases.c the larger ones; release_offers.c release offers), waiters.c (requests answered
 * later), endings.c (how loans end, what a client leaves), retire.c (a region leaves, its
 * keepers told), status.c (the Status reply), idle.c (--idle-exit), jobs.c (copies off the
 * loop).
 *
 * The files stand on floors, lowest first: a file calls functions of files on lower floors
 * only, never of a file on its own floor or above; a lower file reaches an upper one only
 * through a callback it was given (struct sl_conn_ops, struct sl_transport_ops, users.h's
 * taken, a waiter's timed_out, sl_rescue_prune's ending, sl_idle_start's leave; server.c
 * takes handlers.c's sl_handlers table). Each file's opening comment names its floor.
 * tests/check-floors reads the floor lines below and checks them against nm of the built
 * objects (ctest: check_floors_daemon); a new file takes the floor above the highest one it
 * calls. The books (daemon/books/) are a library below them all.
 *
 *   floor 1: decode.c log.c pool.c users.c      bounded decoding; the log; the memory;
 *            per-uid admission and accounting
 *   floor 2: daemon.c pool_transfer.c rescue.c transport.c   the request layer's shared
 *            helpers; the pool's copies; an owner's rescue; a connection's bytes and fds
 *   floor 3: jobs.c lend_lists.c                 work off the loop; a Lend's lists
 *   floor 4: conn.c idle.c                       one client's frames; --idle-exit
 *   floor 5: allocs.c releases.c waiters.c       Alloc; releases and Resume; requests
 *            answered later
 *   floor 6: pins.c release_offers.c             the save area pinned ahead; release offers
 *   floor 7: retire.c status.c                   a region gone, its keepers told; Status
 *   floor 8: endings.c lends.c regions.c         loan ends and dead clients; Lend and Borrow;
 *            the region requests
 *   floor 9: handlers.c                          the dispatch table and the small requests
 *   floor 10: server.c                           the socket, signals, the parent watch
 *   floor 11: main.c                             the command line
 *
 * One daemon serves one device: a libuv loop, a listening Unix socket, the connections, the
 * books (daemon/books/books.h: who holds what) and the pool (daemon/pool.h: the memory itself).
 * Everything runs on the loop's thread, except the copies of jobs.c, which touch only their
 * transfer and the device.
 */
#ifndef SL_DAEMON_H
#define SL_DAEMON_H

#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <uv.h>

#include "books.h"
#include "device.h"
#include "pool.h"
#include "sublet.pb-c.h"
#include "transport.h"
#include "wire.h"

struct sl_daemon_config {
  int device;               /* --device N, or the number of the device named by UUID */
  uint8_t uuid[16];         /* --device GPU-...: the device's UUID, when by_uuid */
  int by_uuid;
  const char *socket_path;  /* --socket */
  const char *pid_path;     /* --pid-file: written once serving, removed on a clean exit */
  const char *backend;      /* --backend */
  uint64_t reserve_bytes;   /* --reserve: free device memory no loan takes */
  uint64_t pin_bytes;       /* --pin: host memory pinned ahead of need */
  double pin_keep_seconds;  /* --pin-keep: a save area outlives its user's last region so long */
  gid_t allow_gid;          /* --allow-group */
  pid_t parent_pid;         /* --parent-pid: exit when it does (a private daemon) */
  double idle_exit_seconds; /* --idle-exit: leave after this long serving nobody; 0: never */
  int listen_fd;            /* socket activation: an inherited listening fd, or -1 */
  int notify;               /* tell systemd READY=1 */
  int check_books;          /* --check: verify the books' invariants after every request */
  struct sl_transport_limits limits; /* --max-connections, --max-user-connections */
};

struct sl_conn;
struct sl_waiter;
struct sl_job;
struct sl_job_user;
struct sl_rescue;
struct sl_pinner;
struct sl_req;

/* What the request layer does with a connection's requests and its end (handlers.c gives
 * them, through server.c, to conn.c). */
struct sl_conn_ops {
  /* One request; every request gets exactly one reply, now or (Borrow, Reclaim) later. */
  void (*request)(struct sl_conn *c, const Sublet__Request *req, const int *fds, size_t nfds);
  /* The connection is gone: cancel its waits and settle its part in the books. */
  void (*gone)(struct sl_conn *c);
};

struct sl_daemon {
  struct sl_daemon_config cfg;
  uv_loop_t *loop;
  struct sl_device *dev;
  struct sl_books *books;
  struct sl_pool *pool;
  int listen_fd;
  struct stat socket_stat;  /* the socket file we bound (st_ino 0: none) */
  struct stat pid_stat;     /* the pid file we wrote (st_ino 0: none) */
  uv_poll_t listener;
  struct sl_transports transports;
  const struct sl_conn_ops *conn_ops;
  uv_timer_t accept_retry;  /* accepting paused while out of fds */
  uv_signal_t sigterm, sigint, sighup;
  int parent_pidfd;
  uv_poll_t parent_watch;
  uv_timer_t idle_timer;    /* --idle-exit (idle.c) */
  double idle_since;
  void (*idle_exit)(struct sl_daemon *d); /* how to leave (server.c's sl_server_stop) */
  struct sl_conn *conns;
  struct sl_waiter *waiters;
  struct sl_drain *drains;
  struct sl_stalled *stalled;      /* loan ends waiting for fresh pages' memory (endings.c) */
  struct sl_job *jobs, *jobs_tail; /* copies in submission order; the first one runs */
  struct sl_job_user *job_users;   /* host work queued per uid, in turn order (jobs.c) */
  struct sl_job *host_running;     /* the host job running now, beside the copies */
  struct sl_pinner *pinner;        /* the pin ahead running now, beside both (pins.c) */
  uv_timer_t pin_keep_timer;       /* --pin-keep (pins.c) */
  struct sl_rescue *rescues;       /* per loan whose owner can restore itself (rescue.c) */
  struct sl_live_release *releases; /* live releases' save areas (releases.c) */
  struct sl_release_offer *release_offers; /* release offers, oldest first (release_offers.c) */
  uint64_t release_offers_made;    /* the last offer's id */
  uint64_t building_bytes;  /* of regions whose pages a job is creating: not free any more */
  double started;           /* CLOCK_MONOTONIC seconds */
  uint64_t conns_total;
  int stopping;
};

/* A client's conversation. Its transport is its own; freed when the transport closes. */
struct sl_conn {
  struct sl_daemon *d;
  struct sl_transport *t;
  struct sl_peer peer;
  uint64_t client_id;       /* 0 until Hello */
  char name[64];
  int pidfd;                /* the peer process, to know when it has really exited */
  struct sl_ended *ended;   /* loans of this owner that ended before it asked (Reclaim) */
  int waiting;              /* a Borrow, Reclaim or Lend of this conn awaits its reply */
  struct sl_job *job;       /* its request waits for this copy: reading paused until done */
  int closed;               /* closing: what is sent now is dropped */
  struct sl_conn *next;
};

/* SL_WAIT_TAKE, SL_WAIT_TAKE_WAIT, SL_WAIT_OFFER_STEP: release offers' (release_offers.c),
 * loan_id the offer's id (0 for a Take), name a Take's name. */
enum sl_waiter_kind { SL_WAIT_RECLAIM, SL_WAIT_BORROW, SL_WAIT_LEND, SL_WAIT_TAKE,
                      SL_WAIT_TAKE_WAIT, SL_WAIT_OFFER_STEP };

/* What a waiting Lend lends when its turn comes (lends.c fills it in). */
struct sl_lend_wait {
  uint64_t region;
  int rescue, local;
  int timeout_ms;           /* as asked: 0 answers at once, EBUSY when it cannot be served */
  struct sl_loan *draft;    /* the books' draft of the loan (the waiter's); NULL while drafted */
  struct sl_waiter **drafter; /* the drafting job's pointer to this waiter: cleared if it goes */
  /* Lends it (the device is free and this is the oldest Lend) and answers, success or not. */
  void (*serve)(struct sl_waiter *w);
};

/* A request answered later (waiters.c). */
struct sl_waiter {
  struct sl_daemon *d;
  struct sl_conn *conn;
  enum sl_waiter_kind kind;
  uint64_t req_id;
  uint64_t loan_id;
  struct sl_lend_wait lend; /* SL_WAIT_LEND */
  uint8_t token[SUBLET_TOKEN_SIZE];
  int has_token;
  int rescue;               /* Borrow.rescue */
  uint64_t known_layout;    /* Borrow's or Lend's: the layout id of the client's window */
  char name[SL_LOAN_NAME_SIZE];
  int has_need;             /* SL_WAIT_TAKE: Take.need_bytes, */
  uint64_t need_bytes;      /* ... the taker's need */
  /* The text of its timeout, given by the file that parked it (NULL: waiters.c's own). */
  void (*timed_out)(const struct sl_waiter *w, struct sl_err *err);
  uv_timer_t timer;
  struct sl_waiter *next;
};

/* A loan's end its owner has not asked about yet (it asks with Reclaim). */
struct sl_ended {
  struct sublet_loan_stats stats;
  uint64_t *replaced;       /* the region pages that are new (ascending), owned */
  size_t nreplaced;
  struct sl_ended *next;
};

/* Loans whose borrower died: finished once its process has exited. */
struct sl_drain {
  struct sl_daemon *d;
  int pidfd;
  uv_poll_t poll;
  uv_timer_t timer;         /* fallback when pidfd_open is not available */
  pid_t pid;
  uint64_t *loans;
  size_t nloans;
  struct sl_drain *next;
};

/* A copy off the loop (jobs.c). The submitter fills transfer (owned by the job: freed before
 * done runs; NULL for a job that only keeps its place in the order) or run (host work that
 * touches only the job, such as sorting a long keep list), done, and conn when a
 * request of that connection waits for it (then the connection reads nothing more until done;
 * conn is NULL in done if it closed meanwhile). done runs on the loop with rc and err set, and
 * owns the job from then on. */
struct sl_job {
  uv_work_t work;
  struct sl_daemon *d;
  struct sl_pool_transfer *transfer;
  void (*run)(struct sl_job *j); /* or, instead, this work of the host's (NULL: none) */
  void (*done)(struct sl_job *j);
  struct sl_conn *conn;
  int rc;
  struct sl_err err;
  double seconds;       /* copying to or from the host */
  double move_seconds;  /* moving on the device */
  double submitted_at, ran_at; /* sl_clock_now(), for the debug log */
  int started;
  int host;             /* submitted with sl_jobs_submit_host: queued by uid */
  uid_t uid;
  size_t held;          /* host memory the job holds for uid (sl_jobs_held) */
  struct sl_job *next;
};

void sl_jobs_submit(struct sl_daemon *d, struct sl_job *j);
/* Host work that touches only the job (run; no transfer), which need not keep its place among
 * the copies: decoding a large request, drafting a long keep list. Queued per uid, served one
 * job per user in turn, one at a time, beside the copies: one user's many such jobs delay
 * another user's by one job at most. held (bytes of host memory) counts against uid until
 * done runs; over SL_JOBS_HELD_PER_USER in all the job is refused: SUBLET_EBUSY (err says
 * why), and it stays the caller's. */
#define SL_JOBS_HELD_PER_USER (256ull << 20)
int sl_jobs_submit_host(struct sl_daemon *d, struct sl_job *j, uid_t uid, size_t held,
                        struct sl_err *err);
/* Bytes held by uid's host jobs, queued or running. */
size_t sl_jobs_held(const struct sl_daemon *d, uid_t uid);
/* No job of either lane, and no pin ahead (pins.c), runs or waits. */
int sl_jobs_idle(const struct sl_daemon *d);
/* The loop stops once shutdown has begun and sl_jobs_idle: for each lane's (and the pin's)
 * last callback. */
void sl_jobs_maybe_stop(struct sl_daemon *d);
/* May a copy of bytes run on the loop now? Nothing queued (it would overtake), and small. */
#define SL_JOB_INLINE_BYTES (1ull << 20)
int sl_jobs_inline(const struct sl_daemon *d, uint64_t bytes);

int sl_server_start(struct sl_daemon *d, struct sl_err *err);
void sl_server_stop(struct sl_daemon *d);
/* Removes the socket file at exit, if it is still the one this daemon bound. */
void sl_server_unlink_socket(struct sl_daemon *d);
/* Removes the --pid-file, if it is still the one this daemon wrote. */
void sl_server_unlink_pid(struct sl_daemon *d);
/* One sd_notify(3) message (READY=1, EXTEND_TIMEOUT_USEC=...) to $NOTIFY_SOCKET, if set. */
void sl_server_notify(const char *msg);
/* The save area pinned ahead (pins.c). ahead: a Lend of bytes kept was lent (the area
 * claimed for its user): the area is pinned up to them in the background. progress: 1 while
 * a pin ahead runs, with its goal and what is pinned (bytes). regions_changed: a region went;
 * once the area's user has had none for --pin-keep, the area is released. init at start;
 * stop at shutdown (the pin ends after its piece in progress). */
void sl_pins_ahead(struct sl_daemon *d, uint64_t bytes);
size_t sl_releases_of_user(struct sl_daemon *d, uid_t uid);
int sl_pins_request(struct sl_daemon *d, uid_t uid, uint64_t bytes, int release,
                    struct sl_err *err);
int sl_pins_progress(const struct sl_daemon *d, uint64_t *target, uint64_t *done);
void sl_pins_regions_changed(struct sl_daemon *d);
void sl_pins_init(struct sl_daemon *d);
void sl_pins_stop(struct sl_daemon *d);
/* --idle-exit (idle.c): watch for idleness from the start, leaving through leave (server.c's
 * stop, given from above); stop watching at shutdown. */
void sl_idle_start(struct sl_daemon *d, void (*leave)(struct sl_daemon *d));
void sl_idle_stop(struct sl_daemon *d);

extern const struct sl_transport_ops sl_conn_transport_ops;
/* Accepts the pending connections; SUBLET_EIO when accepting must pause (err logged). */
int sl_conn_accept(struct sl_daemon *d);
/* Closes the connection from the loop, later (never inside the caller). */
void sl_conn_close(struct sl_conn *c);
/* Reads and dispatches again after the copy its request waited for (c->job) is done. */
void sl_conn_resume(struct sl_conn *c);
/* At once: for shutdown only, outside every connection's callbacks. */
void sl_conn_close_now(struct sl_conn *c);
/* Queues a reply (never blocks); fds stay the caller's (the queue holds copies). */
int sl_conn_send(struct sl_conn *c, Sublet__Reply *rep, const int *fds, size_t nfds);
int sl_conn_send_error(struct sl_conn *c, uint64_t id, const struct sl_err *err);
/* The same, saying (Error.awaits_fresh_pages, when not 0) that a loan's end waits for device
 * memory for that many fresh pages: the owner's library then lets go of the old ones. */
int sl_conn_send_error_fresh(struct sl_conn *c, uint64_t id, const struct sl_err *err,
                             uint64_t awaits_fresh_pages);
void sl_conn_send_ok(struct sl_conn *c, uint64_t id);
/* A loan's stats, as Returned (returned != 0) or Reclaimed, this one with the region pages
 * that are new (replaced[0..n), ascending; the caller's). */
void sl_conn_send_stats(struct sl_conn *c, uint64_t id, int returned,
                        const struct sublet_loan_stats *s, const uint64_t *replaced, size_t n);

/* Waiters: park one (timeout_ms < 0: no timer), answer-and-free one, drop a conn's. */
struct sl_waiter *sl_waiters_park(struct sl_conn *c, enum sl_waiter_kind kind, uint64_t req_id,
                                  int timeout_ms);
void sl_waiters_done(struct sl_waiter *w);
void sl_waiters_cancel(struct sl_conn *c);
/* Cancel: the conn's waiter of that request answers ECANCELED; returns 1 if there was one. */
int sl_waiters_cancel_request(struct sl_conn *c, uint64_t req_id);
/* The device may have become free: Lends waiting for it are served, oldest first among the
 * drafted ones (one whose keep list is still being drafted is not in the line yet, and holds
 * nobody back). */
void sl_waiters_device_free(struct sl_daemon *d);
/* Is w the oldest drafted Lend? How many Lends wait (drafted or not)? How many requests of a
 * kind wait (everyone's)? */
int sl_waiters_lend_first(const struct sl_waiter *w);
size_t sl_waiters_lends(const struct sl_daemon *d);
size_t sl_waiters_count(const struct sl_daemon *d, enum sl_waiter_kind kind);
/* Tells the owner that a loan ended, and which of its region's pages are new (replaced, the
 * caller's): its waiting Reclaim (returns 1), else its next one (0). */
int sl_waiters_loan_ended(struct sl_daemon *d, const struct sublet_loan_stats *s,
                          uint64_t owner_client, const uint64_t *replaced, size_t n);
/* The owner's waiting Reclaims of the loan are answered with err: its end waits for device
 * memory for fresh_pages fresh pages (endings.c), and a later Reclaim may wait again. */
void sl_waiters_reclaim_failed(struct sl_daemon *d, uint64_t owner_client, uint64_t loan_id,
                               const struct sl_err *err, uint64_t fresh_pages);
/* Takes an ended loan off the conn's list (NULL if not there); sl_waiters_ended_free() frees it. */
struct sl_ended *sl_waiters_ended_take(struct sl_conn *c, uint64_t loan);
void sl_waiters_ended_free(struct sl_ended *e);

/* Carries out a loan's end on the device (endings.c): the kept bytes are copied back off the
 * loop, then fresh memory is released and the owner told; last, answer (may be NULL) gets the
 * final stats, with c (the connection whose request ended the loan, or NULL; NULL too if it
 * closed meanwhile), and owns arg. Takes over end's arrays. */
typedef void (*sl_endings_answer_fn)(struct sl_conn *c, void *arg,
                                     const struct sublet_loan_stats *s);
void sl_endings_start(struct sl_daemon *d, struct sl_loan_end *end, struct sl_conn *c,
                      sl_endings_answer_fn answer, void *arg);
/* Has the books' loan ended, with its kept bytes still on their way back (to this owner;
 * owner_client 0: to anyone)? */
int sl_endings_pending(const struct sl_daemon *d, uint64_t loan_id, uint64_t owner_client);
/* A Reclaim of no wait, of a loan whose end is stalled: answered at once (1), with why. */
int sl_endings_stalled_answer(struct sl_daemon *d, struct sl_conn *c, uint64_t req_id,
                              uint64_t loan_id);

/* What lets a loan's owner restore its kept bytes itself if the daemon dies (rescue.c). At
 * Lend: a journal, the owner's save area and a release pipe; fds[3] (journal, save area, the
 * pipe's read end) are the caller's to send and close. At Borrow: the borrower goes in the
 * journal, and the pipe's write end is returned (the caller's to send and close; -1 if the
 * owner did not ask). emptied: entries for the moves, then the saves, of kept pages emptied
 * for a grant (in the order they ran), before their pages are lent. end:
 * everything is back (restored) or the loan is gone; prune: drops the loans that ended
 * without a restore (withdrawn, or the owner left), keeping those whose end is under way
 * (ending: endings.c's sl_endings_pending, given by the caller above it). */
int sl_rescue_lend(struct sl_daemon *d, uint64_t loan_id, const struct sl_loan_info *li,
                   uid_t owner_uid, int fds[3], struct sl_err *err);
int sl_rescue_borrow(struct sl_daemon *d, uint64_t loan_id, const struct sl_peer *borrower);
/* Can this loan's owner restore it without the daemon? */
int sl_rescue_has(const struct sl_daemon *d, uint64_t loan_id);
/* A read-only fd of the same file (an owner must not write what it only reads); where /proc
 * is not mounted, a copy of fd itself. The caller owns it. */
int sl_rescue_read_only_fd(int fd);
/* Journals what grant g emptied (its moves and saves) and the region pages it hands out for
 * the first time, before the borrower may touch them: written (the owner reads none of it
 * yet; *n entries), then committed once the kept bytes are where the entries say. Nothing
 * else may write the loan's journal in between. */
int sl_rescue_emptied_write(struct sl_daemon *d, const struct sl_grant *g, size_t *n,
                            struct sl_err *err);
void sl_rescue_emptied_commit(struct sl_daemon *d, uint64_t loan_id, size_t n);
void sl_rescue_end(struct sl_daemon *d, uint64_t loan_id, int restored);
typedef int (*sl_rescue_ending_fn)(const struct sl_daemon *d, uint64_t loan_id,
                                   uint64_t owner_client);
void sl_rescue_prune(struct sl_daemon *d, sl_rescue_ending_fn ending);
void sl_rescue_free_all(struct sl_daemon *d);
int sl_status_reply(struct sl_req *x, const Sublet__Request *r);
/* The device's loan as a message to c names it: "loan N" where status shows it to c, else as
 * another user's (a refusal says no more than status). */
const char *sl_status_loan_text(const struct sl_conn *c, uint64_t loan, char buf[48]);
/* A region has left the books (released, or gone with its owner), or its last holder let go
 * (retire.c): the clients that still hold its pages hear RegionGone; with none, its pages are
 * released. */
void sl_retire_region(struct sl_daemon *d, uint64_t region_id);
/* The same for answer's request req_id, answered Ok once the pages are released (or at once
 * when they stay for their holders). */
void sl_retire_region_for(struct sl_daemon *d, uint64_t region_id, struct sl_conn *answer,
                          uint64_t req_id);

/* releases.c: Lend.release (takes the Lend's keep and pinned lists, and x->keep_fd), Resume,
 * ResumeEnd; the areas of releases that left the books go back; what live releases hold pinned. */
int sl_releases_lend(struct sl_req *x, const Sublet__Request *r);
int sl_releases_resume(struct sl_req *x, const Sublet__Request *r);
int sl_releases_resume_end(struct sl_req *x, const Sublet__Request *r);
/* ReleaseMore: more of a live release by need (issue 42), answered Released once its device
 * work is done (at once when there is none). */
int sl_releases_more(struct sl_req *x, const Sublet__Request *r);
void sl_releases_prune(struct sl_daemon *d);
uint64_t sl_releases_host_bytes(const struct sl_daemon *d);
/* release_offers.c: release offers, a release that a scheduler starts and ends (ReleaseOffer,
 * OfferStep, Take, TakeWait, GiveBack); 0 when answered (now, or later through a waiter),
 * else an error in x->err. gone: a connection went (an owner's or a taker's); status: the
 * offers c may see, into st (the arrays are the caller's to free with
 * sl_release_offers_status_free). */
int sl_release_offers_offer(struct sl_req *x, const Sublet__Request *r);
int sl_release_offers_step(struct sl_req *x, const Sublet__Request *r);
int sl_release_offers_take(struct sl_req *x, const Sublet__Request *r);
int sl_release_offers_take_wait(struct sl_req *x, const Sublet__Request *r);
int sl_release_offers_give_back(struct sl_req *x, const Sublet__Request *r);
int sl_release_offers_take_more(struct sl_req *x, const Sublet__Request *r);
void sl_release_offers_gone(struct sl_conn *c);
int sl_release_offers_status(struct sl_conn *c, Sublet__Status *st);
void sl_release_offers_status_free(Sublet__Status *st);
/* One request being handled (handlers.c, and the files it dispatches to): its connection,
 * its id, the error to answer with. */
struct sl_req {
  struct sl_conn *c;
  struct sl_daemon *d;
  uint64_t id;
  struct sl_err err;
  int keep_fd; /* a Lend's keep memfd: the request's until a Lend takes it (-1: none) */
};
/* Every request's handler (handlers.c's table, indexed by the request's body case, holds one
 * per request): r is the request, x what the handler answers through; 0 when answered (now,
 * or later through a waiter or a job), else an error in x->err for handlers.c to send. */
typedef int (*sl_handlers_fn)(struct sl_req *x, const Sublet__Request *r);
/* daemon.c: a request's loan or offer name (LoanName in sublet.proto: UTF-8 of 1 to 63 bytes
 * without control characters) into out, "" when absent (has not set); what names it in the
 * refusal. */
int sl_daemon_loan_name(struct sl_err *err, const char *what, protobuf_c_boolean has,
                        ProtobufCBinaryData name, char out[SL_LOAN_NAME_SIZE]);
/* lends.c: Lend and Borrow; 0 when answered (now, or later through a waiter), else an error
 * in x->err for the caller to send. A Lend may take x->keep_fd. */
int sl_lends_lend(struct sl_req *x, const Sublet__Request *r);
int sl_lends_borrow(struct sl_req *x, const Sublet__Request *r);
/* Called when an offer appears: wakes borrowers waiting for one. */
void sl_lends_offer_posted(struct sl_daemon *d);
/* allocs.c: Alloc, the same way (answered later when kept bytes are saved off the loop). */
int sl_allocs_alloc(struct sl_req *x, const Sublet__Request *r);
/* lend_lists.c: a Lend's keep and pinned lists, taken over for a draft off the loop: the Lend's
 * own arrays (protobuf-c malloc'd them), or (keep_fd_ranges) the keep memfd, which the draft
 * reads into the daemon's own buffer (the client could change it meanwhile). take: on the
 * loop (*keep_fd is taken, -1 after); draft: any thread, the lists stay the owner's; clear
 * frees them. */
struct sl_lend_lists {
  uint64_t *keep;      /* (offset, length) pairs */
  size_t nkeep;        /* pairs */
  int keep_fd;         /* owned, or -1 */
  int keep_all;
  uint64_t *pinned;    /* (first, count) pairs */
  size_t npinned;
};
void sl_lend_lists_take(struct sl_lend_lists *l, Sublet__Lend *m, int *keep_fd);
/* The host memory the lists take (a memfd's once read), for sl_jobs_submit_host. */
static inline size_t sl_lend_lists_bytes(const struct sl_lend_lists *l) {
  return (l->nkeep + l->npinned) * 2 * sizeof(uint64_t);
}
/* The keep memfd's ranges read into keep, once (sl_lend_lists_draft reads them if not yet). */
int sl_lend_lists_read(struct sl_lend_lists *l, struct sl_err *err);
int sl_lend_lists_draft(struct sl_lend_lists *l, const struct sl_books_config *cfg,
                        uint64_t npages, struct sl_loan **draft, struct sl_err *err);
void sl_lend_lists_clear(struct sl_lend_lists *l);
/* A Lend's checks, a release's as well as a loan's: its name (into name), its keep list, its
 * pinned pairs, its timeout (sl_lend_lists_timeout: as asked, 0 when not set). */
int sl_lend_lists_check(Sublet__Lend *m, int keep_fd, char name[SL_LOAN_NAME_SIZE],
                        struct sl_err *err);
int sl_lend_lists_timeout(const Sublet__Lend *m);
/* daemon.c: pages of free device memory, less those of regions being made (and, keep_reserve,
 * the --reserve left to others: loans take fresh memory within it, a resume takes back the
 * owner's own pages and does not). */
uint64_t sl_daemon_free_pages(const struct sl_daemon *d, int keep_reserve);
/* --check: the books checked after a step, abort if broken. */
void sl_daemon_check_books(struct sl_daemon *d, uint64_t req_id);

/* Region requests (regions.c), for handlers.c's table: 0 when answered (now, or later by a
 * job with the connection paused), else an error in x->err for the caller to send. */
int sl_regions_create(struct sl_req *x, const Sublet__Request *r);
int sl_regions_grow(struct sl_req *x, const Sublet__Request *r);
int sl_regions_pages_get(struct sl_req *x, const Sublet__Request *r);
int sl_regions_release(struct sl_req *x, const Sublet__Request *r);
int sl_regions_dropped(struct sl_req *x, const Sublet__Request *r);

/* The request layer's side of a connection (handlers.c): requests and the connection's end. */
extern const struct sl_conn_ops sl_handlers;
void sl_handlers_request(struct sl_conn *c, const Sublet__Request *req, const int *fds,
                         size_t nfds);
/* A connection went away: cancel its waits and settle its part in the books (endings.c). */
void sl_endings_disconnect(struct sl_conn *c);
/* Ends what still waits for a dead borrower's exit: the daemon is going away. */
void sl_endings_shutdown(struct sl_daemon *d);

#endif
