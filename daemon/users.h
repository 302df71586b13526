/* users.h - who holds what of the daemon's shared bounds, per uid and in all: connections
 * (and whether one more is admitted), receive buffer bytes, and fds sent and not yet taken.
 * Also whether a peer is in a group (--allow-group).
 *
 * Accounting only: transport.c moves the bytes, and tells this file what each connection
 * holds; this file answers which bound is crossed and which connection holds the most. It
 * touches no socket and calls nothing above it: whether a client has taken the fds sent on a
 * connection is asked through the callback given at init (sl_users_init). Each connection
 * carries its part (struct sl_users_conn) inside it. Cutting a client off, and what it is
 * told, are transport.c's; transport.h says what each bound is for.
 */
#ifndef SL_USERS_H
#define SL_USERS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#include "error.h"
#include "wire.h"

struct sl_users_limits {
  unsigned fds_in_flight;   /* fds of one connection sent and not yet taken */
  unsigned fds_per_user;    /* of one uid's connections (at most a quarter of the budget) */
  unsigned conns;           /* connections at once, all users */
  unsigned conns_per_user;  /* connections at once, one uid (root's too) */
  size_t rx_per_user;       /* receive buffer bytes of one uid's connections */
};

#define SL_USERS_LIMITS_DEFAULT                                                              \
  {.fds_in_flight = SL_WIRE_MAX_FDS, .fds_per_user = 4 * SL_WIRE_MAX_FDS, .conns = 1024,     \
   .conns_per_user = 128, .rx_per_user = 4 * (SL_WIRE_HEADER + SL_WIRE_MAX_PAYLOAD)}

/* Which bound more fds of a connection would cross: none (GO), the connection's, its uid's, or
 * the daemon's budget. */
enum sl_users_fds { SL_USERS_FDS_GO, SL_USERS_FDS_CONN, SL_USERS_FDS_USER, SL_USERS_FDS_ALL };

struct sl_users_uid;

/* One connection's part in its uid's counts, inside the connection. */
struct sl_users_conn {
  struct sl_users_uid *uid;
  struct sl_users_conn *next;  /* the uid's connections */
  size_t rx_charged;           /* its receive buffer as counted in uid->rx_bytes */
  unsigned fds_in_flight;      /* sent since the client was last seen to take them all */
};

/* One uid with connections; it goes with its last one. */
struct sl_users_uid {
  struct sl_users_uid *next;
  uid_t uid;
  unsigned conns;              /* lingering ones too */
  size_t rx_bytes;
  unsigned fds_in_flight;      /* of all its connections */
  struct sl_users_conn *list;  /* its connections */
};

/* Whether the client has taken every fd sent on c (its socket empty): the transport's to say. */
typedef int (*sl_users_taken_fn)(struct sl_users_conn *c);

struct sl_users {
  struct sl_users_limits lim;  /* as given, fds_per_user at most a quarter of fds_budget */
  sl_users_taken_fn taken;
  struct sl_users_uid *list;   /* uids with connections */
  unsigned nconns;
  unsigned fds_in_flight;      /* sent by all connections, not yet taken */
  unsigned fds_budget;         /* the most of them: half the open-files limit */
  uint64_t fds_scanned;        /* loop ms when every holder was last asked */
};

void sl_users_init(struct sl_users *u, const struct sl_users_limits *lim,
                   sl_users_taken_fn taken);

/* May a connection of uid be accepted? 0, or SUBLET_EBUSY with err saying which cap. */
int sl_users_admit(const struct sl_users *u, uid_t uid, struct sl_err *err);
/* c counts for uid from now on: 0, or -1 when out of host memory. */
int sl_users_join(struct sl_users *u, struct sl_users_conn *c, uid_t uid);
/* c is gone for good: its fds no longer count, nor it for its uid. */
void sl_users_leave(struct sl_users *u, struct sl_users_conn *c);

void sl_users_fds_sent(struct sl_users *u, struct sl_users_conn *c, unsigned n);
/* Asks whether c's client took its fds; if so they no longer count. */
void sl_users_fds_refresh(struct sl_users *u, struct sl_users_conn *c);
/* The bound n more fds of c would cross (GO: none), after asking the holders at that level
 * whether they took theirs (all of them once a loop tick at most: now is the loop's ms). A
 * frame goes whatever its size when nothing is in flight at a level, so is never held for
 * ever. */
enum sl_users_fds sl_users_fds_may_go(struct sl_users *u, struct sl_users_conn *c, size_t n,
                                      uint64_t now);

/* c's receive buffer is now bytes (0 once it reads nothing more). */
void sl_users_rx_set(struct sl_users_conn *c, size_t bytes);
/* While c's uid is over its receive buffer cap: the uid's connection holding the most (the
 * one to cut off, which then counts 0); NULL once under. */
struct sl_users_conn *sl_users_rx_over(const struct sl_users *u, const struct sl_users_conn *c);

/* Whether the peer on fd (its credentials, from SO_PEERCRED) is in group gid: its primary
 * group, or one of its supplementary groups (SO_PEERGROUPS; getgrouplist of its uid where that
 * is missing). */
int sl_users_peer_in_group(int fd, const struct ucred *peer, gid_t gid);

#endif
