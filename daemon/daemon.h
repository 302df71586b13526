/* daemon.h - subletd's state shared by its I/O modules (server, conn, handlers).
 *
 * One daemon serves one device: a libuv loop, a listening Unix socket, the connections, the
 * books (daemon/books.h: who holds what) and the pool (daemon/pool.h: the memory itself).
 * Everything runs on the loop's thread.
 */
#ifndef SL_DAEMON_H
#define SL_DAEMON_H

#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "books.h"
#include "device.h"
#include "pool.h"
#include "sublet.pb-c.h"
#include "wire.h"

struct sl_daemon_config {
  int device;               /* --device N */
  const char *socket_path;  /* --socket */
  const char *backend;      /* --backend */
  uint64_t reserve_bytes;   /* --reserve: free device memory no loan takes */
  uint64_t pin_bytes;       /* --pin: host memory pinned ahead of need */
  gid_t allow_gid;          /* --allow-group */
  pid_t parent_pid;         /* --parent-pid: exit when it does (a private daemon) */
  int listen_fd;            /* socket activation: an inherited listening fd, or -1 */
  int notify;               /* tell systemd READY=1 */
  int check_books;          /* --check: verify the books' invariants after every request */
};

struct sl_conn;
struct sl_waiter;

struct sl_daemon {
  struct sl_daemon_config cfg;
  uv_loop_t *loop;
  struct sl_device *dev;
  struct sl_books *books;
  struct sl_pool *pool;
  int listen_fd;
  uv_poll_t listener;
  uv_signal_t sigterm, sigint;
  int parent_pidfd;
  uv_poll_t parent_watch;
  struct sl_conn *conns;
  struct sl_waiter *waiters;
  struct sl_drain *drains;
  double copy_out_seconds;  /* of the loan in progress (the books count bytes, not time) */
  double started;           /* CLOCK_MONOTONIC seconds */
  uint64_t conns_total;
  int stopping;
};

/* A client connection. The conn owns fd and every fd queued in rx. */
struct sl_conn {
  struct sl_daemon *d;
  int fd;
  uv_poll_t poll;
  struct sl_wire_rx rx;
  struct sl_peer peer;
  uint64_t client_id;       /* 0 until Hello */
  char name[64];
  int pidfd;                /* the peer process, to know when it has really exited */
  struct sl_ended *ended;   /* loans of this owner that ended before it asked (Reclaim) */
  int waiting;              /* a Borrow or Reclaim of this conn awaits its reply */
  int closed;
  struct sl_conn *next;
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

int sl_server_start(struct sl_daemon *d, struct sl_err *err);
void sl_server_stop(struct sl_daemon *d);
double sl_now(void);

void sl_conn_accept(struct sl_daemon *d, int fd);
void sl_conn_close(struct sl_conn *c);
/* Sends a reply; a client that cannot take it is disconnected. fds stay the caller's. */
int sl_conn_send(struct sl_conn *c, Sublet__Reply *rep, const int *fds, size_t nfds);
int sl_conn_send_error(struct sl_conn *c, uint64_t id, const struct sl_err *err);

/* Handles one request; every request gets exactly one reply, now or (Borrow, Reclaim) later. */
void sl_handle_request(struct sl_conn *c, const Sublet__Request *req, const int *fds,
                       size_t nfds);
/* A connection went away: cancel its waits and settle its part in the books. */
void sl_handle_disconnect(struct sl_conn *c);
/* Ends what still waits for a dead borrower's exit: the daemon is going away. */
void sl_handle_shutdown(struct sl_daemon *d);
/* Called when an offer appears: wakes borrowers waiting for one. */
void sl_handle_offer_posted(struct sl_daemon *d);

#endif
