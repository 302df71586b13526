/* watch.c - libsublet: a borrower that loses subletd stops touching the loan's pages.
 *
 * While a client borrows, a thread watches its socket for the daemon's end (POLLRDHUP: it
 * died, or closed the connection). Then nobody will restore the owner's kept bytes but the
 * owner's library, which must know that this process no longer writes them: the watcher waits
 * for the device (the process's queued work), unmaps and releases every window of the loan
 * (allocations made from it are gone: the next access faults, as after any lost mapping),
 * then writes one byte to the loan's release pipe and closes it (rescue.c reads it). The
 * client's calls fail with SUBLET_EPIPE from then on. The release fd is the watch's: closed
 * when the watch stops, so that a normal Return leaves the owner nothing to read.
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
  pthread_t thread;
  int stop_fd;    /* an eventfd: written to stop the thread; owned */
  int release_fd; /* the loan's release pipe's write end, or -1; owned */
};

/* The daemon is gone mid-loan: let go of the loan's pages, then say so. */
static void let_go(struct sl_watch *w) {
  sublet_client *c = w->c;

  pthread_mutex_lock(&c->lock);
  if (c->dev != NULL)
    sl_device_synchronize(c->dev, NULL);
  sl_borrow_forget(c);
  c->loan_id = 0;
  c->lost = 1;
  pthread_mutex_unlock(&c->lock);
  if (w->release_fd >= 0) {
    ssize_t n;
    while ((n = write(w->release_fd, "R", 1)) < 0 && errno == EINTR)
      ;
    close(w->release_fd);
    w->release_fd = -1;
  }
}

static void *watch(void *arg) {
  struct sl_watch *w = arg;
  sigset_t pipe_signal;
  struct pollfd p[2] = {{.fd = w->c->sock, .events = POLLRDHUP},
                        {.fd = w->stop_fd, .events = POLLIN}};

  /* The owner may have stopped reading: a write then fails with EPIPE, not kills us. */
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, NULL);
  for (;;) {
    if (poll(p, 2, -1) < 0 && errno == EINTR)
      continue;
    if (p[1].revents != 0)
      return NULL; /* stopped: the loan ended normally, or the client goes */
    if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) {
      let_go(w);
      return NULL;
    }
  }
}

int sl_watch_start(sublet_client *c, int release_fd) {
  struct sl_watch *w = calloc(1, sizeof(*w));

  if (w == NULL || (w->stop_fd = eventfd(0, EFD_CLOEXEC)) < 0) {
    free(w);
    if (release_fd >= 0)
      close(release_fd);
    return sl_client_fail(SUBLET_ENOMEM, "cannot watch the connection: out of resources");
  }
  w->c = c;
  w->release_fd = release_fd;
  if (pthread_create(&w->thread, NULL, watch, w) != 0) {
    close(w->stop_fd);
    if (release_fd >= 0)
      close(release_fd);
    free(w);
    return sl_client_fail(SUBLET_ENOMEM, "cannot start the connection's watcher thread");
  }
  c->watch = w;
  return 0;
}

void sl_watch_stop(sublet_client *c) {
  struct sl_watch *w = c->watch;
  uint64_t one = 1;

  if (w == NULL)
    return;
  c->watch = NULL;
  if (write(w->stop_fd, &one, sizeof(one)) != sizeof(one))
    return; /* cannot happen with an eventfd; the thread is left running rather than joined */
  pthread_join(w->thread, NULL);
  close(w->stop_fd);
  if (w->release_fd >= 0)
    close(w->release_fd);
  free(w);
}
