/* watch.c - libsublet: a borrower hears subletd between its calls.
 *
 * From a client's first loan on, a thread watches its socket. For the daemon's end (POLLRDHUP:
 * it died, or closed the connection): then nobody will restore the owner's kept bytes but the
 * owner's library, which must know that this process no longer writes them: the watcher waits
 * for the device (the process's queued work), unmaps and releases every window (allocations
 * made from the loan are gone: the next access faults, as after any lost mapping), then, mid-
 * loan, writes one byte to the loan's release pipe and closes it (rescue.c reads it). The
 * client's calls fail with SUBLET_EPIPE from then on. And, while no loan is borrowed, for
 * notices (PROTOCOL.md, Notices): a region whose window this process kept has gone, so its
 * pages are let go of at once (borrow.c), not at the next borrow or at exit; during a loan the
 * thread wakes only for the daemon's end (the loan's requests read the notices on the way) or
 * when woken. The release fd is the watch's: closed when the loan ends normally, so that a
 * normal Return leaves the owner nothing to read.
 *
 * The watch sits below borrow.c: what it does to the windows, it does through the callbacks
 * borrow.c starts it with (struct sl_watch_ops).
 * Floor 2 (client.h's floors).
 */
#include "client.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>

struct sl_watch {
  sublet_client *c;
  const struct sl_watch_ops *ops;
  pthread_t thread;
  int wake_fd;    /* an eventfd: written to make the thread look again; owned */
  int release_fd; /* the loan's release pipe's write end, or -1; owned; under c->lock */
  int stopping;   /* under c->lock */
};

static void close_release(struct sl_watch *w) {
  if (w->release_fd >= 0)
    close(w->release_fd);
  w->release_fd = -1;
}

/* The daemon is gone: let go of every window; mid-loan, say so on the release pipe. */
static void let_go(struct sl_watch *w) {
  sublet_client *c = w->c;
  ssize_t n;

  pthread_mutex_lock(&c->lock);
  if (c->dev != NULL)
    sl_device_synchronize(c->dev, NULL);
  w->ops->forget(c);
  c->lost = c->loan_id != 0;
  c->loan_id = 0;
  while (w->release_fd >= 0 && (n = write(w->release_fd, "R", 1)) < 0 && errno == EINTR)
    ;
  close_release(w);
  pthread_mutex_unlock(&c->lock);
}

/* Under the lock: reads the notices that came (readable, while idle) and lets go of the regions
 * they name. Returns whether the client is idle (no loan), or -1 when the watch stops. */
static int look(struct sl_watch *w, int readable) {
  sublet_client *c = w->c;
  int idle;

  pthread_mutex_lock(&c->lock);
  idle = w->stopping ? -1 : c->loan_id == 0;
  if (idle == 1 && readable)
    sl_client_read_notices(c); /* a failure breaks the connection: the next poll sees it */
  if (idle >= 0)
    w->ops->let_go_gone(c);
  pthread_mutex_unlock(&c->lock);
  return idle;
}

static void *watch(void *arg) {
  struct sl_watch *w = arg;
  sigset_t pipe_signal;
  uint64_t count;
  int idle, readable = 0;
  struct pollfd p[2] = {{.fd = w->c->sock}, {.fd = w->wake_fd, .events = POLLIN}};

  /* The owner may have stopped reading: a write then fails with EPIPE, not kills us. */
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, NULL);
  while ((idle = look(w, readable)) >= 0) {
    p[0].events = POLLRDHUP | (idle ? POLLIN : 0);
    if (poll(p, 2, -1) < 0)
      continue; /* EINTR */
    if (p[1].revents != 0 && read(w->wake_fd, &count, sizeof(count)) < 0)
      continue;
    if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) {
      let_go(w);
      return NULL;
    }
    readable = (p[0].revents & POLLIN) != 0;
  }
  return NULL;
}

static int start(sublet_client *c, int release_fd, const struct sl_watch_ops *ops) {
  struct sl_watch *w = calloc(1, sizeof(*w));

  if (w == NULL || (w->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) {
    free(w);
    if (release_fd >= 0)
      close(release_fd);
    return sl_client_fail(SUBLET_ENOMEM, "cannot watch the connection: out of resources");
  }
  w->c = c;
  w->ops = ops;
  w->release_fd = release_fd;
  if (pthread_create(&w->thread, NULL, watch, w) != 0) {
    close(w->wake_fd);
    close_release(w);
    free(w);
    return sl_client_fail(SUBLET_ENOMEM, "cannot start the connection's watcher thread");
  }
  c->watch = w;
  c->wake_fd = w->wake_fd;
  return 0;
}

int sl_watch_start(sublet_client *c, int release_fd, const struct sl_watch_ops *ops) {
  if (c->watch == NULL)
    return start(c, release_fd, ops);
  close_release(c->watch);
  c->watch->release_fd = release_fd;
  sl_client_wake(c); /* a loan now: the thread stops reading the socket */
  return 0;
}

void sl_watch_loan_over(sublet_client *c) {
  if (c->watch == NULL)
    return;
  close_release(c->watch);
  sl_client_wake(c); /* idle now: the thread hears notices */
}

/* Takes the watch off the client (c->lock held): from now on a borrow starts another. */
static struct sl_watch *detach(sublet_client *c) {
  struct sl_watch *w = c->watch;

  if (w != NULL)
    w->stopping = 1;
  c->watch = NULL;
  c->wake_fd = -1;
  return w;
}

static void stop(struct sl_watch *w) {
  uint64_t one = 1;

  if (w == NULL)
    return;
  if (write(w->wake_fd, &one, sizeof(one)) != sizeof(one))
    return; /* cannot happen with an eventfd; the thread is left running rather than joined */
  pthread_join(w->thread, NULL);
  close(w->wake_fd);
  close_release(w);
  free(w);
}

void sl_watch_stop(sublet_client *c) {
  struct sl_watch *w;

  pthread_mutex_lock(&c->lock);
  w = detach(c);
  pthread_mutex_unlock(&c->lock);
  stop(w);
}

void sl_watch_settle(sublet_client *c) {
  struct sl_watch *w = NULL;

  pthread_mutex_lock(&c->lock);
  if (c->watch != NULL && c->loan_id == 0 && !c->watch->ops->keeps(c))
    w = detach(c);
  pthread_mutex_unlock(&c->lock);
  stop(w);
}
