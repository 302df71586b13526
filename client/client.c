/* client.c - libsublet: the conversation with subletd, regions, lending and borrowing. */
#include "client.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "msg.h"

static __thread struct sl_err last_error;

int sl_client_fail(int code, const char *fmt, ...) {
  va_list ap;

  last_error.code = code;
  va_start(ap, fmt);
  vsnprintf(last_error.msg, sizeof(last_error.msg), fmt, ap);
  va_end(ap);
  return code;
}

int sl_client_fail_err(const struct sl_err *err) {
  last_error = *err;
  if (last_error.code == 0)
    last_error.code = SUBLET_EIO;
  return last_error.code;
}

SUBLET_EXPORT const char *sublet_version(void) {
  return SUBLET_VERSION_STRING;
}

SUBLET_EXPORT const char *sublet_strerror(int code) {
  return sl_strerror(code);
}

SUBLET_EXPORT const char *sublet_last_error(void) {
  return last_error.msg;
}

/* ------------------------------------------------------------------ requests */

/* Sends req and waits for its reply; an Error reply becomes its code (and the thread's last
 * error), with the reply still returned in *out for callers that read its details. */
int sl_client_call(sublet_client *c, Sublet__Request *req, Sublet__Reply **out, int *fds,
                   size_t *nfds, int timeout_ms) {
  struct sl_frame_header h;
  const uint8_t *payload;
  struct sl_err err = {0};
  int rxfds[SL_WIRE_MAX_FDS];
  Sublet__Reply *rep;
  int rc;

  req->id = ++c->next_id;
  rc = sl_msg_send_request(c->sock, req, NULL, 0, &err);
  if (rc == 0)
    rc = sl_wire_recv(&c->rx, c->sock, &h, &payload, rxfds, timeout_ms, &err);
  if (rc != 0)
    return sl_client_fail_err(&err);
  if (h.version != SUBLET_PROTOCOL_VERSION) {
    sl_wire_close_fds(rxfds, h.nfds);
    return sl_client_fail(SUBLET_EVERSION, "subletd speaks protocol %u, this library %d: "
                          "install matching versions of sublet and subletd", h.version,
                          SUBLET_PROTOCOL_VERSION);
  }
  rep = h.kind == SL_WIRE_REPLY ? sl_msg_unpack_reply(payload, h.length, &err) : NULL;
  if (rep == NULL || rep->id != req->id || (nfds == NULL && h.nfds > 0) ||
      (nfds != NULL && h.nfds > *nfds)) {
    sl_wire_close_fds(rxfds, h.nfds);
    if (rep != NULL)
      sublet__reply__free_unpacked(rep, NULL);
    return sl_client_fail(SUBLET_EPROTO, "subletd sent an unexpected reply");
  }
  if (nfds != NULL) {
    memcpy(fds, rxfds, h.nfds * sizeof(int));
    *nfds = h.nfds;
  }
  *out = rep;
  if (rep->body_case == SUBLET__REPLY__BODY_ERROR)
    return sl_client_fail(rep->error->code, "%s", rep->error->message);
  return 0;
}

/* A call whose reply carries nothing but success. */
static int call_simple(sublet_client *c, Sublet__Request *req) {
  Sublet__Reply *rep = NULL;
  int rc = sl_client_call(c, req, &rep, NULL, NULL, -1);

  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* ------------------------------------------------------------------ connecting */

static int connect_socket(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd;

  if (strlen(path) >= sizeof(addr.sun_path))
    return sl_client_fail(SUBLET_EINVAL, "socket path %s is too long", path);
  strcpy(addr.sun_path, path);
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return sl_client_fail(-errno, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
    int e = errno;
    close(fd);
    return sl_client_fail(SUBLET_ECONNREFUSED,
                          "cannot reach subletd at %s (%s): start it (subletd --device N, or "
                          "systemctl start subletd@N.socket) or set $SUBLET_SOCKET",
                          path, strerror(e));
  }
  return fd;
}

static void welcome_to_info(const Sublet__Welcome *w, struct sublet_info *info) {
  snprintf(info->daemon_version, sizeof(info->daemon_version), "%s", w->daemon_version);
  snprintf(info->backend, sizeof(info->backend), "%s", w->backend);
  snprintf(info->device_name, sizeof(info->device_name), "%s", w->device_name);
  memcpy(info->device_uuid, w->device_uuid.data,
         w->device_uuid.len < 16 ? w->device_uuid.len : 16);
  info->device_ordinal = w->device_ordinal;
  info->page_size = w->page_size;
  info->total_bytes = w->total_bytes;
  info->free_bytes = w->free_bytes;
  info->client_id = w->client_id;
}

static int hello(sublet_client *c) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello h = SUBLET__HELLO__INIT;
  Sublet__Reply *rep = NULL;
  char name[64];
  int rc;

  snprintf(name, sizeof(name), "libsublet %s pid %d", SUBLET_VERSION_STRING, (int)getpid());
  h.protocol = SUBLET_PROTOCOL_VERSION;
  h.client_name = name;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &h;
  rc = sl_client_call(c, &req, &rep, NULL, NULL, 30000);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_WELCOME)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered Hello with something else");
  if (rc == 0)
    welcome_to_info(rep->welcome, &c->info);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_connect(const char *path, sublet_client **out) {
  const char *env = getenv("SUBLET_SOCKET");
  sublet_client *c;
  int rc;

  if (path == NULL)
    path = env != NULL && env[0] != '\0' ? env : "/run/sublet/gpu0.sock";
  c = calloc(1, sizeof(*c));
  if (c == NULL)
    return sl_client_fail(SUBLET_ENOMEM, "out of host memory");
  c->sock = connect_socket(path);
  if (c->sock < 0) {
    rc = c->sock;
    free(c);
    return rc;
  }
  pthread_mutex_init(&c->lock, NULL);
  sl_wire_rx_init(&c->rx);
  rc = hello(c);
  if (rc != 0) {
    sublet_disconnect(c);
    return rc;
  }
  *out = c;
  return 0;
}

static void release_region_local(struct sublet_region *r);

SUBLET_EXPORT void sublet_disconnect(sublet_client *c) {
  if (c == NULL)
    return;
  if (c->dev != NULL)
    sl_device_synchronize(c->dev, NULL);
  sl_torch_forget(c);
  /* Closing the socket first: the daemon settles the books (loans end, kept bytes come back)
   * whatever state this client leaves. */
  close(c->sock);
  sl_window_free(c->win);
  for (size_t i = 0; i < c->nforfeit; i++)
    sl_window_free(c->forfeit[i]);
  free(c->forfeit);
  while (c->regions != NULL) {
    struct sublet_region *r = c->regions;
    c->regions = r->next;
    release_region_local(r);
  }
  if (c->dev != NULL)
    sl_device_close(c->dev);
  sl_wire_rx_destroy(&c->rx);
  pthread_mutex_destroy(&c->lock);
  free(c);
}

int sl_client_status(sublet_client *c, Sublet__Reply **rep) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__StatsGet m = SUBLET__STATS_GET__INIT;
  int rc;

  *rep = NULL;
  req.body_case = SUBLET__REQUEST__BODY_STATS_GET;
  req.stats_get = &m;
  rc = sl_client_call(c, &req, rep, NULL, NULL, 10000);
  if (rc == 0 && (*rep)->body_case != SUBLET__REPLY__BODY_STATUS)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered StatsGet with something else");
  return rc;
}

/* Free memory changes: it is asked afresh; the rest is what Welcome said. */
SUBLET_EXPORT int sublet_get_info(sublet_client *c, struct sublet_info *info) {
  Sublet__Reply *rep;
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = sl_client_status(c, &rep);
  if (rc == 0)
    c->info.free_bytes = rep->status->free_bytes;
  *info = c->info;
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

static int ensure_device(sublet_client *c) {
  struct sl_device_params p = {.backend = c->info.backend,
                               .ordinal = (int)c->info.device_ordinal,
                               .uuid = c->info.device_uuid,
                               .page_size = c->info.page_size,
                               .total_bytes = c->info.total_bytes};
  struct sl_err err = {0};

  if (c->dev != NULL)
    return 0;
  if (sl_device_open(&p, &c->dev, &err) != 0)
    return sl_client_fail_err(&err);
  if (sl_device_info(c->dev)->page_size != c->info.page_size)
    return sl_client_fail(SUBLET_EDEVICE, "page size mismatch between subletd and this process");
  return 0;
}

/* ------------------------------------------------------------------ regions */

/* Imports pages [first, first+count) of a region into handles[first..]. */
static int fetch_pages(sublet_client *c, uint64_t region, uint64_t first, uint64_t count,
                       sl_handle *handles) {
  while (count > 0) {
    uint32_t n = count < SL_WIRE_MAX_FDS ? (uint32_t)count : SL_WIRE_MAX_FDS;
    Sublet__Request req = SUBLET__REQUEST__INIT;
    Sublet__PagesGet pg = SUBLET__PAGES_GET__INIT;
    Sublet__Reply *rep = NULL;
    struct sl_err err = {0};
    int fds[SL_WIRE_MAX_FDS];
    size_t nfds = SL_WIRE_MAX_FDS;
    int rc;

    pg.region = region;
    pg.first = first;
    pg.count = n;
    req.body_case = SUBLET__REQUEST__BODY_PAGES_GET;
    req.pages_get = &pg;
    rc = sl_client_call(c, &req, &rep, fds, &nfds, -1);
    if (rep != NULL)
      sublet__reply__free_unpacked(rep, NULL);
    if (rc == 0 && nfds != n)
      rc = sl_client_fail(SUBLET_EPROTO, "subletd sent %zu fds for %u pages", nfds, n);
    for (size_t i = 0; i < nfds; i++) {
      /* Import, then close at once: never hold one fd per page. */
      if (rc == 0 && sl_device_import(c->dev, fds[i], &handles[first + i], &err) != 0)
        rc = sl_client_fail_err(&err);
      close(fds[i]);
    }
    if (rc != 0)
      return rc;
    first += n;
    count -= n;
  }
  return 0;
}

static void release_region_local(struct sublet_region *r) {
  struct sl_device *dev = r->client->dev;

  if (r->base != NULL) {
    sl_device_synchronize(dev, NULL);
    for (uint64_t i = 0; i < r->npages; i++)
      if (r->handles[i] != 0)
        sl_device_unmap_idle(dev, (char *)r->base + i * r->page_size, r->page_size);
    sl_device_unreserve(dev, r->base, r->npages * r->page_size);
  }
  for (uint64_t i = 0; r->handles != NULL && i < r->npages; i++)
    if (r->handles[i] != 0)
      sl_device_release(dev, r->handles[i]);
  free(r->handles);
  free(r);
}

/* Maps every page of the region at r->base, in order. */
static int map_region(sublet_client *c, struct sublet_region *r) {
  struct sl_err err = {0};
  uint64_t ps = r->page_size;
  int rc = sl_device_reserve(c->dev, r->npages * ps, &r->base, &err);

  /* On failure release_region_local() unmaps all pages: unmapping one never mapped is a
   * harmless error. */
  for (uint64_t i = 0; rc == 0 && i < r->npages; i++)
    rc = sl_device_map(c->dev, (char *)r->base + i * ps, ps, r->handles[i], &err);
  if (rc == 0)
    rc = sl_device_set_access(c->dev, r->base, r->npages * ps, &err);
  return rc != 0 ? sl_client_fail_err(&err) : 0;
}

static int region_create_request(sublet_client *c, uint64_t size, struct sublet_region *r) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionCreate rc_msg = SUBLET__REGION_CREATE__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  rc_msg.size = size;
  req.body_case = SUBLET__REQUEST__BODY_REGION_CREATE;
  req.region_create = &rc_msg;
  rc = sl_client_call(c, &req, &rep, NULL, NULL, -1);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_REGION_CREATED)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered RegionCreate with something else");
  if (rc == 0) {
    r->id = rep->region_created->region;
    r->npages = rep->region_created->pages;
    r->page_size = rep->region_created->page_size;
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

static int region_release_request(sublet_client *c, uint64_t id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionRelease m = SUBLET__REGION_RELEASE__INIT;

  m.region = id;
  req.body_case = SUBLET__REQUEST__BODY_REGION_RELEASE;
  req.region_release = &m;
  return call_simple(c, &req);
}

SUBLET_EXPORT int sublet_region_create(sublet_client *c, uint64_t size, sublet_region **out) {
  struct sublet_region *r = calloc(1, sizeof(*r));
  int rc;

  if (r == NULL)
    return sl_client_fail(SUBLET_ENOMEM, "out of host memory");
  r->client = c;
  pthread_mutex_lock(&c->lock);
  rc = ensure_device(c);
  if (rc == 0)
    rc = region_create_request(c, size, r);
  if (rc == 0 && (r->handles = calloc(r->npages, sizeof(sl_handle))) == NULL)
    rc = sl_client_fail(SUBLET_ENOMEM, "out of host memory");
  if (rc == 0)
    rc = fetch_pages(c, r->id, 0, r->npages, r->handles);
  if (rc == 0)
    rc = map_region(c, r);
  if (rc == 0) {
    r->next = c->regions;
    c->regions = r;
    *out = r;
  } else if (r->id != 0) {
    struct sl_err saved = last_error; /* the first failure is the one to report */
    release_region_local(r);
    region_release_request(c, r->id);
    last_error = saved;
  } else {
    free(r);
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}

SUBLET_EXPORT void *sublet_region_addr(const sublet_region *r) {
  return r->base;
}

SUBLET_EXPORT uint64_t sublet_region_size(const sublet_region *r) {
  return r->npages * r->page_size;
}

SUBLET_EXPORT uint64_t sublet_region_id(const sublet_region *r) {
  return r->id;
}

SUBLET_EXPORT int sublet_region_release(sublet_region *r) {
  sublet_client *c = r->client;
  struct sublet_region **link;
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = region_release_request(c, r->id);
  if (rc == 0) {
    /* The window borrows this region's handles: it goes first. */
    if (c->win != NULL && c->win->region_id == r->id && !c->win->owns_handles) {
      sl_window_free(c->win);
      c->win = NULL;
    }
    sl_device_synchronize(c->dev, NULL);
    for (link = &c->regions; *link != r; link = &(*link)->next)
      ;
    *link = r->next;
    release_region_local(r);
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}

static struct sublet_region *find_region(sublet_client *c, uint64_t id) {
  for (struct sublet_region *r = c->regions; r != NULL; r = r->next)
    if (r->id == id)
      return r;
  return NULL;
}

/* ------------------------------------------------------------------ lending */

SUBLET_EXPORT int sublet_lend(sublet_region *r, const struct sublet_range *keep, size_t n,
                              int keep_all, const char *name, uint64_t *loan_id,
                              uint8_t token[16]) {
  sublet_client *c = r->client;
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  m.region = r->id;
  m.keep = (uint64_t *)keep; /* struct sublet_range is two uint64_t: the pairs' layout */
  m.n_keep = keep_all ? 0 : 2 * n;
  m.has_keep_all = 1;
  m.keep_all = keep_all != 0;
  m.name = (char *)name;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  pthread_mutex_lock(&c->lock);
  /* The owner's last writes must be in memory before anyone saves or overwrites them. */
  sl_device_synchronize(c->dev, NULL);
  rc = sl_client_call(c, &req, &rep, NULL, NULL, -1);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_LENT)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered Lend with something else");
  if (rc == 0) {
    *loan_id = rep->lent->loan;
    if (token != NULL)
      memcpy(token, rep->lent->token.data, 16);
  }
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_reclaim(sublet_client *c, uint64_t loan_id, int timeout_ms,
                                 struct sublet_loan_stats *stats) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Reclaim m = SUBLET__RECLAIM__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  m.loan = loan_id;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms;
  req.body_case = SUBLET__REQUEST__BODY_RECLAIM;
  req.reclaim = &m;
  pthread_mutex_lock(&c->lock);
  /* The daemon answers at the timeout; the socket wait only guards against a lost daemon. */
  rc = sl_client_call(c, &req, &rep, NULL, NULL, -1);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_RECLAIMED)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered Reclaim with something else");
  if (rc == 0 && stats != NULL)
    sl_msg_stats_from_proto(rep->reclaimed, stats);
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT int sublet_withdraw(sublet_client *c, uint64_t loan_id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Withdraw m = SUBLET__WITHDRAW__INIT;
  int rc;

  m.loan = loan_id;
  req.body_case = SUBLET__REQUEST__BODY_WITHDRAW;
  req.withdraw = &m;
  pthread_mutex_lock(&c->lock);
  rc = call_simple(c, &req);
  pthread_mutex_unlock(&c->lock);
  return rc;
}

/* ------------------------------------------------------------------ borrowing */

/* Sets up c->win for the loan: the last window when it fits (mapping paid once), else anew. */
static int setup_window(sublet_client *c, const Sublet__Borrowed *b) {
  struct sublet_region *own = b->own_region ? find_region(c, b->region) : NULL;
  struct sl_window *w = c->win;
  struct sl_err err = {0};

  if (b->n_layout != b->unkept_pages + b->kept_pages)
    return sl_client_fail(SUBLET_EPROTO, "subletd sent a layout of the wrong length");
  if (w != NULL && sl_window_adopt(w, b->region, b->unkept_pages, b->fresh_pages,
                                   b->kept_pages, b->layout))
    return 0;
  sl_window_free(w);
  c->win = NULL;
  if (sl_window_new(c->dev, b->page_size, b->region, b->region_pages, b->unkept_pages,
                    b->fresh_pages, b->kept_pages, b->layout,
                    own != NULL ? own->handles : NULL, &c->win, &err) != 0)
    return sl_client_fail_err(&err);
  c->win->region_base = own != NULL ? own->base : NULL;
  return 0;
}

SUBLET_EXPORT int sublet_borrow(sublet_client *c, uint64_t loan_id, const uint8_t token[16],
                                const char *name, int timeout_ms) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Borrow m = SUBLET__BORROW__INIT;
  Sublet__Reply *rep = NULL;
  int rc;

  m.has_loan = loan_id != 0;
  m.loan = loan_id;
  m.has_token = token != NULL;
  m.token.data = (uint8_t *)token;
  m.token.len = token != NULL ? 16 : 0;
  m.name = (char *)name;
  m.has_timeout_ms = 1;
  m.timeout_ms = timeout_ms;
  req.body_case = SUBLET__REQUEST__BODY_BORROW;
  req.borrow = &m;
  pthread_mutex_lock(&c->lock);
  rc = ensure_device(c);
  if (rc == 0 && c->loan_id != 0)
    rc = sl_client_fail(SUBLET_EBUSY, "this client already borrows loan %llu: return it first",
                        (unsigned long long)c->loan_id);
  if (rc == 0)
    rc = sl_client_call(c, &req, &rep, NULL, NULL, -1);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_BORROWED)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered Borrow with something else");
  if (rc == 0)
    rc = setup_window(c, rep->borrowed);
  if (rc == 0)
    c->loan_id = rep->borrowed->loan;
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

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
    int rc = fetch_pages(c, w->region_id, (uint64_t)first, len, w->handles);
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
    return last_error.code;
  if (sl_window_map_run(w, a->pos, a->pages, &err) != 0)
    return sl_client_fail_err(&err);
  return 0;
}

static int free_request(sublet_client *c, uint64_t alloc_id) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Free m = SUBLET__FREE__INIT;

  m.alloc = alloc_id;
  req.body_case = SUBLET__REQUEST__BODY_FREE;
  req.free = &m;
  return call_simple(c, &req);
}

static int alloc_locked(sublet_client *c, uint64_t size, void **ptr) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Alloc m = SUBLET__ALLOC__INIT;
  Sublet__Reply *rep = NULL;
  int fds[1];
  size_t nfds = 1;
  int rc;

  if (c->loan_id == 0)
    return sl_client_fail(SUBLET_ENOENT, "no loan is being borrowed: borrow one first");
  m.size = size;
  req.body_case = SUBLET__REQUEST__BODY_ALLOC;
  req.alloc = &m;
  rc = sl_client_call(c, &req, &rep, fds, &nfds, -1);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_ALLOCATED)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered Alloc with something else");
  if (rc == 0) {
    const Sublet__Allocated *a = rep->allocated;
    /* In the owner's process a run of consecutive region pages needs no mapping at all. */
    *ptr = nfds == 0 ? sl_window_direct(c->win, a->pos, a->pages) : NULL;
    if (*ptr == NULL) {
      rc = map_grant(c, a, fds, nfds);
      *ptr = (char *)c->win->base + a->pos * c->win->page_size;
    }
    if (rc == 0 && sl_window_alloc_add(c->win, *ptr, size, rep->allocated->alloc) != 0)
      rc = sl_client_fail(SUBLET_ENOMEM, "out of host memory");
    if (rc != 0) {
      struct sl_err saved = last_error;
      free_request(c, rep->allocated->alloc);
      last_error = saved;
    }
  }
  sl_wire_close_fds(fds, rep != NULL ? nfds : 0); /* imported by now: ours to close */
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
    rc = free_request(c, a.id);
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

/* The loan is over for this client: fresh memory goes back; a window on another process's
 * region goes too (its owner may free the region); one with forfeit allocations is kept
 * until they are freed. */
static void end_borrowing(sublet_client *c, int forfeit) {
  struct sl_window *w = c->win;
  struct sl_window **fw;

  c->loan_id = 0;
  if (forfeit && w->nallocs > 0 &&
      (fw = realloc(c->forfeit, (c->nforfeit + 1) * sizeof(*fw))) != NULL) {
    c->forfeit = fw;
    c->forfeit[c->nforfeit++] = w;
    c->win = NULL;
    return;
  }
  w->nallocs = 0;
  sl_window_drop_chunks(w);
  if (w->owns_handles) {
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
  int rc;

  if (c->loan_id == 0)
    return sl_client_fail(SUBLET_ENOENT, "no loan is being borrowed");
  /* The borrower's GPU work must be finished before its pages change hands. */
  sl_device_synchronize(c->dev, NULL);
  m.has_force = 1;
  m.force = force != 0;
  req.body_case = SUBLET__REQUEST__BODY_RETURN;
  req.return_ = &m;
  rc = sl_client_call(c, &req, &rep, NULL, NULL, -1);
  if (rc == 0 && rep->body_case != SUBLET__REPLY__BODY_RETURNED)
    rc = sl_client_fail(SUBLET_EPROTO, "subletd answered Return with something else");
  if (rc == 0 && stats != NULL)
    sl_msg_stats_from_proto(rep->returned, stats);
  if (rc == SUBLET_ELEAK && rep != NULL) {
    leaks_from_reply(rep->error, c->win, leaks, nleaks, nleaks_out);
    if (stats != NULL && rep->error->stats != NULL)
      sl_msg_stats_from_proto(rep->error->stats, stats);
  }
  if (rc == 0 || (rc == SUBLET_ELEAK && force)) {
    c->win->map_seconds = 0;
    end_borrowing(c, rc != 0);
  }
  if (stats != NULL)
    stats->map_seconds = map_seconds;
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
  return rc;
}

SUBLET_EXPORT int sublet_loan_stats(sublet_client *c, struct sublet_loan_stats *stats) {
  Sublet__Reply *rep;
  int rc;

  memset(stats, 0, sizeof(*stats));
  pthread_mutex_lock(&c->lock);
  rc = sl_client_status(c, &rep);
  if (rc == 0 && rep->status->loan != NULL)
    sl_msg_stats_from_proto(rep->status->loan->stats, stats);
  if (c->win != NULL)
    stats->map_seconds = c->win->map_seconds;
  pthread_mutex_unlock(&c->lock);
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}
