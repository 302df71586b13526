/* proxy.c - a subletd as an older one looks to libsublet (proxy.h). One process, one poll loop
 * over the listening socket and each (client, daemon) pair of sockets; blocking sends, which
 * a test's few small frames never fill. */
#include "proxy.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "harness.h"
#include "msg.h"
#include "raw.h"
#include "wire.h"

#define PAIRS 8

/* One client's connection and the proxy's own to the daemon: fd[0] the client's, fd[1] the
 * daemon's; rx[i] reads fd[i]. Both owned by the pair; -1 when unused. */
struct pair {
  int fd[2];
  struct sl_wire_rx rx[2];
};

static void (*welcome_edit)(Sublet__Welcome *w);

static void pair_close(struct pair *p) {
  for (int i = 0; i < 2; i++) {
    if (p->fd[i] >= 0) {
      close(p->fd[i]);
      sl_wire_rx_destroy(&p->rx[i]);
    }
    p->fd[i] = -1;
  }
}

/* A reply frame's payload as the client gets it: a Welcome edited, else as it came. *buf: a
 * buffer to free (NULL when the payload is the frame's). */
static int edited(const uint8_t *payload, size_t len, uint8_t **buf, size_t *out) {
  Sublet__Reply *rep = sl_msg_unpack_reply(payload, len, NULL);
  int rc = 0;

  *buf = NULL;
  *out = len;
  if (rep != NULL && rep->body_case == SUBLET__REPLY__BODY_WELCOME && welcome_edit != NULL) {
    welcome_edit(rep->welcome);
    rc = sl_msg_pack(&rep->base, buf, out, NULL);
  }
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

/* Passes on every whole frame read from side `from` of p: 0, or -1 (the pair is done). */
static int forward(struct pair *p, int from) {
  struct sl_frame_header h;
  const uint8_t *payload;
  int fds[SL_WIRE_MAX_FDS], got, rc = 0;

  if (sl_wire_rx_read(&p->rx[from], p->fd[from], NULL) <= 0)
    return -1;
  while (rc == 0 && (got = sl_wire_rx_next(&p->rx[from], &h, &payload, fds, NULL)) == 1) {
    uint8_t *buf = NULL;
    size_t len = h.length;

    if (from == 1 && edited(payload, h.length, &buf, &len) != 0)
      rc = -1;
    else if (sl_wire_send(p->fd[!from], h.kind, buf != NULL ? buf : payload, len, fds, h.nfds,
                          5000, NULL) != 0)
      rc = -1;
    free(buf);
    sl_wire_close_fds(fds, h.nfds);
  }
  return rc != 0 || got < 0 ? -1 : 0;
}

static void accept_one(int listener, struct pair *pairs, const char *daemon_socket) {
  int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);

  for (int i = 0; fd >= 0 && i < PAIRS; i++) {
    if (pairs[i].fd[0] >= 0)
      continue;
    pairs[i].fd[0] = fd;
    pairs[i].fd[1] = sl_raw_connect(daemon_socket);
    sl_wire_rx_init(&pairs[i].rx[0]);
    sl_wire_rx_init(&pairs[i].rx[1]);
    if (pairs[i].fd[1] < 0)
      pair_close(&pairs[i]);
    return;
  }
  if (fd >= 0)
    close(fd); /* more clients than a test makes */
}

static void serve(int listener, const char *daemon_socket) {
  struct pair pairs[PAIRS];
  struct pollfd pfd[1 + 2 * PAIRS];

  for (int i = 0; i < PAIRS; i++)
    pairs[i].fd[0] = pairs[i].fd[1] = -1;
  for (;;) {
    pfd[0] = (struct pollfd){.fd = listener, .events = POLLIN};
    for (int i = 0; i < 2 * PAIRS; i++)
      pfd[1 + i] = (struct pollfd){.fd = pairs[i / 2].fd[i % 2], .events = POLLIN};
    if (poll(pfd, 1 + 2 * PAIRS, -1) < 0) {
      if (errno != EINTR)
        _exit(1);
      continue;
    }
    if (pfd[0].revents & POLLIN)
      accept_one(listener, pairs, daemon_socket);
    for (int i = 0; i < 2 * PAIRS; i++)
      if (pfd[1 + i].revents != 0 && pairs[i / 2].fd[i % 2] >= 0 &&
          forward(&pairs[i / 2], i % 2) != 0)
        pair_close(&pairs[i / 2]);
  }
}

static int listen_at(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
  unlink(path);
  if (fd >= 0 && (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(fd, 8) != 0)) {
    close(fd);
    fd = -1;
  }
  return fd;
}

int sl_proxy_start(struct sl_proxy *p, const char *socket, const char *daemon_socket,
                        void (*edit)(Sublet__Welcome *w)) {
  int listener = listen_at(socket);

  p->pid = 0;
  if (listener < 0)
    return -1;
  snprintf(p->socket, sizeof(p->socket), "%s", socket);
  p->pid = sl_test_child();
  if (p->pid == 0) {
    welcome_edit = edit;
    serve(listener, daemon_socket);
    _exit(0);
  }
  close(listener); /* the child's now; it listens already, so a connect waits in its queue */
  return p->pid > 0 ? 0 : -1;
}

void sl_proxy_stop(struct sl_proxy *p) {
  if (p->pid <= 0)
    return; /* never started: no pid to kill (0 or -1 would be a group, or everyone) */
  sl_test_reap(p->pid);
  p->pid = 0;
  unlink(p->socket);
}
