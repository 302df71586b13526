/* client.h - libsublet's internals shared by client.c and torch.c. */
#ifndef SL_CLIENT_H
#define SL_CLIENT_H

#include <pthread.h>

#include "device.h"
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
  void *base;          /* all pages mapped contiguously: the tensor's memory */
  struct sublet_region *next;
};

struct sublet_client {
  int sock;             /* owned */
  pthread_mutex_t lock; /* serialises requests: PyTorch calls the hooks from any thread */
  struct sl_wire_rx rx;
  uint64_t next_id;
  struct sublet_info info;
  struct sl_device *dev; /* opened at the first region or borrow */
  struct sublet_region *regions;
  struct sl_window *win;  /* the current or last loan's window */
  struct sl_window **forfeit; /* windows of loans ended with live allocations */
  size_t nforfeit;
  uint64_t loan_id;       /* the loan being borrowed, 0 if none */
};

/* The calling thread's last error (its message is sublet_last_error()). */
struct sl_err *sl_client_last_error(void);
/* Records the calling thread's last error; returns code. */
int sl_client_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int sl_client_fail_err(const struct sl_err *err);
/* Sends req and waits for its reply (the caller holds c->lock); an Error reply becomes its
 * code, with the reply still in *out (freed by the caller) for its details. fds/nfds (may be
 * NULL) receive the reply's fds: *nfds is the capacity in and the count out. */
int sl_client_call(sublet_client *c, Sublet__Request *req, Sublet__Reply **out, int *fds,
                   size_t *nfds, int timeout_ms);

/* A request whose reply carries nothing but success (the caller holds c->lock). */
int sl_client_call_simple(sublet_client *c, Sublet__Request *req);
/* Opens this process's side of the daemon's device, once. */
int sl_client_ensure_device(sublet_client *c);
/* Imports pages [first, first+count) of a region into handles[first..] (fds closed at once). */
int sl_client_fetch_pages(sublet_client *c, uint64_t region, uint64_t first, uint64_t count,
                          sl_handle *handles);
struct sublet_region *sl_client_find_region(sublet_client *c, uint64_t id);
/* Unmaps and releases this process's side of a region (not the daemon's). */
void sl_region_release_local(struct sublet_region *r);
/* Asks the daemon for its Status (the caller holds c->lock and frees *rep, set even on
 * failure when a reply came). */
int sl_client_status(sublet_client *c, Sublet__Reply **rep);
/* Drops every reference torch.c keeps to c: it is being freed. */
void sl_torch_forget(sublet_client *c);

#endif
