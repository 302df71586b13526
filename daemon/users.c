/* users.c - per-uid admission and accounting of the daemon's shared bounds: connections,
 * receive buffers, fds in flight (users.h). Counts only: no socket is read or written here.
 *
 * Floor 1 (daemon.h's floors).
 */
#include "users.h"

#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

/* Supplementary groups read for --allow-group; a peer in more (the kernel allows 65536) is
 * judged by its first ones. */
#define NGROUPS_MAX_READ 1024
/* A user with fewer connections than this may take the last ones kept (reserve_of). */
#define RESERVE_FEW 4

/* The kernel refuses fds in flight (ETOOMANYREFS) once the daemon's user has more than its
 * open-files limit in flight, over all its processes (a daemon per GPU, the same user): this
 * daemon takes half, and one uid at most a quarter of that (never less than one frame's). */
static void fds_budget_init(struct sl_users *u) {
  struct rlimit rl;
  rlim_t half = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? rl.rlim_cur / 2 : 512;
  unsigned quarter;

  u->fds_budget = half > SL_WIRE_MAX_FDS ? (half < UINT32_MAX ? (unsigned)half : UINT32_MAX)
                                         : SL_WIRE_MAX_FDS;
  quarter = u->fds_budget / 4 > SL_WIRE_MAX_FDS ? u->fds_budget / 4 : SL_WIRE_MAX_FDS;
  if (u->lim.fds_per_user > quarter)
    u->lim.fds_per_user = quarter;
}

void sl_users_init(struct sl_users *u, const struct sl_users_limits *lim,
                   sl_users_taken_fn taken) {
  memset(u, 0, sizeof(*u));
  u->lim = *lim;
  u->taken = taken;
  fds_budget_init(u);
}

/* ------------------------------------------------------------------ admission */

static struct sl_users_uid *uid_of(const struct sl_users *u, uid_t uid) {
  for (struct sl_users_uid *x = u->list; x != NULL; x = x->next)
    if (x->uid == uid)
      return x;
  return NULL;
}

/* The last connections of --max-connections (an eighth) are kept for users with fewer than
 * RESERVE_FEW: one user, or a few, cannot take them all from the others. */
static unsigned reserve_of(const struct sl_users_limits *lim) {
  return lim->conns >= 2 ? (lim->conns + 7) / 8 : 0;
}

int sl_users_admit(const struct sl_users *u, uid_t uid, struct sl_err *err) {
  struct sl_users_uid *x = uid_of(u, uid);
  unsigned held = x != NULL ? x->conns : 0, reserve = reserve_of(&u->lim);

  if (u->nconns >= u->lim.conns)
    return sl_err_set(err, SUBLET_EBUSY, "subletd serves %u connections, its limit: try again "
                      "later (its administrator may raise --max-connections)", u->nconns);
  if (u->nconns >= u->lim.conns - reserve && held >= RESERVE_FEW)
    return sl_err_set(err, SUBLET_EBUSY, "subletd serves %u connections; the last %u of its "
                      "limit are kept for users with fewer than %d and uid %u has %u: close "
                      "some (or its administrator may raise --max-connections)", u->nconns,
                      reserve, RESERVE_FEW, (unsigned)uid, held);
  if (x != NULL && x->conns >= u->lim.conns_per_user)
    return sl_err_set(err, SUBLET_EBUSY, "uid %u has %u connections to subletd, the limit per "
                      "user: close some (or raise --max-user-connections)", (unsigned)uid,
                      x->conns);
  return 0;
}

int sl_users_join(struct sl_users *u, struct sl_users_conn *c, uid_t uid) {
  struct sl_users_uid *x = uid_of(u, uid);

  if (x == NULL) {
    if ((x = calloc(1, sizeof(*x))) == NULL)
      return -1;
    x->uid = uid;
    x->next = u->list;
    u->list = x;
  }
  x->conns++;
  c->uid = x;
  c->next = x->list;
  x->list = c;
  u->nconns++;
  return 0;
}

/* c leaves its uid's connections; the uid goes with its last one. */
static void uid_drop(struct sl_users *u, struct sl_users_conn *c) {
  struct sl_users_uid *x = c->uid, **link = &u->list;
  struct sl_users_conn **cl = &x->list;

  while (*cl != c)
    cl = &(*cl)->next;
  *cl = c->next;
  if (--x->conns > 0)
    return;
  while (*link != x)
    link = &(*link)->next;
  *link = x->next;
  free(x);
}

void sl_users_leave(struct sl_users *u, struct sl_users_conn *c) {
  u->fds_in_flight -= c->fds_in_flight;
  c->uid->fds_in_flight -= c->fds_in_flight;
  c->fds_in_flight = 0;
  uid_drop(u, c);
  u->nconns--;
}

/* ------------------------------------------------------------------ fds in flight */

void sl_users_fds_sent(struct sl_users *u, struct sl_users_conn *c, unsigned n) {
  c->fds_in_flight += n;
  c->uid->fds_in_flight += n;
  u->fds_in_flight += n;
}

void sl_users_fds_refresh(struct sl_users *u, struct sl_users_conn *c) {
  if (c->fds_in_flight == 0 || !u->taken(c))
    return;
  c->uid->fds_in_flight -= c->fds_in_flight;
  u->fds_in_flight -= c->fds_in_flight;
  c->fds_in_flight = 0;
}

static void fds_refresh_uid(struct sl_users *u, struct sl_users_uid *x) {
  for (struct sl_users_conn *c = x->list; c != NULL; c = c->next)
    sl_users_fds_refresh(u, c);
}

/* Every holder, once a loop tick at most (a waiting frame retries every few ms). */
static void fds_refresh_all(struct sl_users *u, uint64_t now) {
  if (u->fds_scanned == now)
    return;
  u->fds_scanned = now;
  for (struct sl_users_uid *x = u->list; x != NULL; x = x->next)
    if (x->fds_in_flight > 0)
      fds_refresh_uid(u, x);
}

static enum sl_users_fds fds_over(const struct sl_users *u, const struct sl_users_conn *c,
                                  size_t n) {
  if (c->fds_in_flight > 0 && c->fds_in_flight + n > u->lim.fds_in_flight)
    return SL_USERS_FDS_CONN;
  if (c->uid->fds_in_flight > 0 && c->uid->fds_in_flight + n > u->lim.fds_per_user)
    return SL_USERS_FDS_USER;
  if (u->fds_in_flight > 0 && u->fds_in_flight + n > u->fds_budget)
    return SL_USERS_FDS_ALL;
  return SL_USERS_FDS_GO;
}

enum sl_users_fds sl_users_fds_may_go(struct sl_users *u, struct sl_users_conn *c, size_t n,
                                      uint64_t now) {
  enum sl_users_fds w = fds_over(u, c, n);

  if (w == SL_USERS_FDS_CONN)
    sl_users_fds_refresh(u, c);
  else if (w == SL_USERS_FDS_USER)
    fds_refresh_uid(u, c->uid);
  else if (w == SL_USERS_FDS_ALL)
    fds_refresh_all(u, now);
  return w == SL_USERS_FDS_GO ? w : fds_over(u, c, n);
}

/* ------------------------------------------------------------------ receive buffers */

void sl_users_rx_set(struct sl_users_conn *c, size_t bytes) {
  c->uid->rx_bytes = c->uid->rx_bytes - c->rx_charged + bytes;
  c->rx_charged = bytes;
}

/* Over the cap, the uid's connection that holds the most is the one to go, not c: the one
 * that read last is often a small one. A connection closing holds nothing (set to 0). */
struct sl_users_conn *sl_users_rx_over(const struct sl_users *u, const struct sl_users_conn *c) {
  struct sl_users_conn *best = NULL;

  if (c->uid->rx_bytes <= u->lim.rx_per_user)
    return NULL;
  for (struct sl_users_conn *x = c->uid->list; x != NULL; x = x->next)
    if (x->rx_charged > 0 && (best == NULL || x->rx_charged > best->rx_charged))
      best = x;
  return best;
}

/* ------------------------------------------------------------------ groups */

/* The peer's supplementary groups; returns their count (0 when none can be read). */
static size_t peer_groups(int fd, const struct ucred *peer, gid_t *groups, size_t max) {
  socklen_t len = (socklen_t)(max * sizeof(gid_t));
  struct passwd *pw;
  int n = (int)max;

  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) == 0)
    return len / sizeof(gid_t);
  if (errno != ENOPROTOOPT || (pw = getpwuid(peer->uid)) == NULL ||
      getgrouplist(pw->pw_name, peer->gid, groups, &n) < 0)
    return 0;
  return (size_t)n;
}

int sl_users_peer_in_group(int fd, const struct ucred *peer, gid_t gid) {
  gid_t groups[NGROUPS_MAX_READ];
  size_t n;

  if (peer->gid == gid)
    return 1;
  n = peer_groups(fd, peer, groups, NGROUPS_MAX_READ);
  for (size_t i = 0; i < n; i++)
    if (groups[i] == gid)
      return 1;
  return 0;
}
