/* transport.h - the daemon's side of client connections, below the protocol: frames in,
 * frames out, and the bounds that keep one client from taking the daemon from the others.
 *
 * Nothing here blocks the loop. Each connection has an output queue, written when the socket
 * is writable (uv_poll on UV_WRITABLE). What a client may cost is capped, and a client over a
 * cap is the one cut off, never another:
 *   - queued output: over tx_high its requests are no longer read (it waits for its replies
 *     like everyone); over tx_max, or with output pending and nothing taken for stall_ms, it
 *     is cut off;
 *   - fds sent and not yet taken: a frame with fds waits while more than fds_in_flight of
 *     this connection's, fds_per_user of its uid's connections', or half the daemon's
 *     open-files limit in all are still in their sockets (the kernel's limit on fds in
 *     flight is the daemon user's, shared by all connections: ETOOMANYREFS must not reach the
 *     others); a connection cut off while its client still holds fds unread stays counted
 *     (its socket open, shut down) until the client takes them or closes; a frame that meets
 *     ETOOMANYREFS all the same waits stall_ms at most, then the client is told and cut off;
 *   - a frame begun must be complete within frame_ms;
 *   - connections, overall and per uid, the last eighth of the overall ones kept for users
 *     with fewer than 4; receive buffers per uid (over the cap, the connection of that uid
 *     holding the largest buffer is cut off, not whichever read last).
 * Closing is deferred to the loop: sl_transport_close() from anywhere (another connection's
 * handler included) only marks the connection; its closed callback runs later, from the loop.
 *
 * Who holds what of the per-uid and shared bounds, and whether a connection is admitted, is
 * counted by users.c, below this file.
 *
 * The layer above (conn.c) gives its callbacks at creation: this file calls nothing above it.
 */
#ifndef SL_TRANSPORT_H
#define SL_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <uv.h>

#include "error.h"
#include "users.h"
#include "wire.h"

struct sl_transport;

struct sl_transport_limits {
  size_t tx_high;           /* queued output bytes over which requests are not read */
  size_t tx_max;            /* queued output bytes over which the client is cut off */
  unsigned stall_ms;        /* output pending, nothing taken this long: cut off */
  unsigned frame_ms;        /* a partial frame older than this: cut off */
  struct sl_users_limits users; /* connections, receive buffers and fds, per uid and in all */
};

#define SL_TRANSPORT_LIMITS_DEFAULT                                                          \
  {.tx_high = 64u << 10, .tx_max = 2 * (SL_WIRE_HEADER + SL_WIRE_MAX_PAYLOAD),               \
   .stall_ms = 2000, .frame_ms = 2000, .users = SL_USERS_LIMITS_DEFAULT}

struct sl_transport_ops {
  /* A whole frame: payload valid during the call, the h->nfds fds are the callee's. */
  void (*frame)(struct sl_transport *t, const struct sl_frame_header *h,
                const uint8_t *payload, int *fds);
  /* The connection is gone (why says how); called once, from the loop. t is freed after. */
  void (*closed)(struct sl_transport *t, const char *why);
  /* Packs the frame that tells a client why it is cut off (a protocol-level error): a malloc'ed
   * payload of *len bytes, or NULL. */
  uint8_t *(*pack_error)(int code, const char *msg, size_t *len);
};

/* All connections of one daemon: their loop, limits and per-uid counts. */
struct sl_transports {
  uv_loop_t *loop;
  struct sl_transport_limits lim; /* lim.users as given; users.lim is the one in force */
  const struct sl_transport_ops *ops;
  struct sl_users users;    /* the connections' counts, per uid and in all */
  int spare_fd;             /* kept open to accept (and refuse) when the fd table is full */
  uint64_t cut_off;         /* connections cut off for exceeding a bound, since start */
};

int sl_transports_init(struct sl_transports *s, uv_loop_t *loop,
                       const struct sl_transport_limits *lim,
                       const struct sl_transport_ops *ops);
/* Closes nothing: the connections are closed first, each with sl_transport_close_now. */
void sl_transports_destroy(struct sl_transports *s);

/* Accepts one pending connection: 0 and *out, -EAGAIN when none is pending, or another
 * negative code (err says why) when one was refused: over a cap (answered with an Error frame
 * that says which, then closed), or the fd table full (a spare fd is given up to accept and
 * refuse it, so that the listening socket does not stay readable for ever); go on accepting.
 * SUBLET_EIO: accept failed otherwise (err names the errno): stop accepting for a moment. */
int sl_transports_accept(struct sl_transports *s, int listen_fd, struct sl_transport **out,
                         struct sl_err *err);

void *sl_transport_data(const struct sl_transport *t);
void sl_transport_set_data(struct sl_transport *t, void *data);
/* The peer's pid, uid and gid from SO_PEERCRED, read when the connection was accepted. */
const struct ucred *sl_transport_peer(const struct sl_transport *t);
/* Whether the peer was in group gid when it connected: its primary group, or one of its
 * supplementary groups (SO_PEERGROUPS; getgrouplist of its uid where that is missing). */
int sl_transport_peer_in_group(const struct sl_transport *t, gid_t gid);

/* Queues a frame. payload (malloc'ed) and fds become the transport's, whatever the result:
 * freed and closed once written, or when the connection goes. SUBLET_EPIPE on a closing
 * connection (the frame is dropped); a queue over tx_max cuts the connection off. */
int sl_transport_send(struct sl_transport *t, uint16_t kind, uint8_t *payload, size_t len,
                      int *fds, size_t nfds);
/* Closes the connection from the loop, later: queued output still gets one last try. Reading
 * stops now. why (copied) is logged and given to the closed callback. Idempotent. */
void sl_transport_close(struct sl_transport *t, const char *why);
/* The same at once: for shutdown, outside every connection's callbacks. */
void sl_transport_close_now(struct sl_transport *t, const char *why);
/* Pauses reading the connection's requests (on), or resumes it (off: the frames buffered
 * meanwhile are handed out on the next turn of the loop, never inside the caller). */
void sl_transport_pause(struct sl_transport *t, int on);

#endif
