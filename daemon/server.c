/* server.c - the listening socket, the pid file, signals and the parent watch of subletd's
 * event loop.
 *
 * Floor 10 (daemon.h's floors).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"

static const char *file_kind(mode_t mode) {
  return S_ISDIR(mode)   ? "a directory"
         : S_ISREG(mode) ? "a regular file"
         : S_ISLNK(mode) ? "a symbolic link" /* not followed: its target is not ours either */
                         : "not a socket";
}

/* 0 when a daemon answers at addr, else connect's errno. */
static int knock(const struct sockaddr_un *addr) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int rc;

  if (fd < 0)
    return errno;
  rc = connect(fd, (const struct sockaddr *)addr, sizeof(*addr)) == 0 ? 0 : errno;
  close(fd);
  return rc;
}

/* What is at the socket path decides whether we may take it: nothing, or a socket that nobody
 * answers (ECONNREFUSED: its daemon is gone) is ours to replace. Anything else stays: a typo'd
 * --socket run as root must not delete a file, and a live daemon must not lose its socket.
 * Refusals are SUBLET_EBUSY, which main.c turns into its own exit status. */
static int check_socket_path(const struct sockaddr_un *addr, struct sl_err *err) {
  const char *path = addr->sun_path;
  struct stat st;
  int rc;

  if (lstat(path, &st) != 0)
    return errno == ENOENT ? 0 : sl_err_set(err, SUBLET_EBUSY, "cannot look at %s: %s; choose "
                                            "another path with --socket", path, strerror(errno));
  if (!S_ISSOCK(st.st_mode))
    return sl_err_set(err, SUBLET_EBUSY, "%s is %s: subletd replaces only a stale socket, so "
                      "it stays; remove it yourself, or choose another path with --socket",
                      path, file_kind(st.st_mode));
  rc = knock(addr);
  if (rc == ECONNREFUSED) /* nobody listens: the socket of a daemon that is gone */
    return unlink(path) == 0 || errno == ENOENT ? 0 : sl_err_set(err, SUBLET_EBUSY,
        "cannot remove the stale socket %s: %s; remove it yourself", path, strerror(errno));
  if (rc == 0 || rc == EAGAIN) /* EAGAIN: a daemon whose backlog is full is alive too */
    return sl_err_set(err, SUBLET_EBUSY, "another subletd is serving %s: stop it first, or "
                      "give this one another path with --socket", path);
  return sl_err_set(err, SUBLET_EBUSY, "cannot tell whether a daemon serves %s (%s), so it "
                    "stays; remove it yourself if it is stale, or choose another path with "
                    "--socket", path, strerror(rc));
}

static int bind_socket(const char *path, struct sl_err *err) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd;

  if (strlen(path) >= sizeof(addr.sun_path))
    return sl_err_set(err, SUBLET_EINVAL, "socket path %s is too long (%zu bytes at most)",
                      path, sizeof(addr.sun_path) - 1);
  strcpy(addr.sun_path, path);
  if ((fd = check_socket_path(&addr, err)) != 0)
    return fd;
  fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0)
    return sl_err_set(err, SUBLET_EIO, "socket: %s", strerror(errno));
  /* Owner and group only: the socket's mode and group keep other users out. */
  if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 || chmod(path, 0660) != 0 ||
      listen(fd, 128) != 0) {
    int e = errno;
    close(fd);
    return sl_err_set(err, SUBLET_EIO, "cannot listen on %s: %s (does its directory exist and is it "
                      "writable? set --socket or $SUBLET_SOCKET)", path, strerror(e));
  }
  return fd;
}

static void on_listener(uv_poll_t *h, int status, int events);

static void on_accept_retry(uv_timer_t *t) {
  struct sl_daemon *d = t->data;

  if (!d->stopping)
    uv_poll_start(&d->listener, UV_READABLE, on_listener);
}

static void on_listener(uv_poll_t *h, int status, int events) {
  struct sl_daemon *d = h->data;

  if (sl_conn_accept(d) != 0) {
    /* Accepting fails (out of fds with no spare left, say) and polling again at once would
     * spin: pause for a moment; connections that end meanwhile give fds back. */
    sl_warn("not accepting for 100 ms");
    uv_poll_stop(&d->listener);
    uv_timer_start(&d->accept_retry, on_accept_retry, 100, 0);
  }
}

/* SIGHUP (a closed terminal, `systemctl reload`, a log rotator's habit) must not kill the
 * daemon and lose every loan: there is no configuration to reread, so it is only logged. */
static void on_sighup(uv_signal_t *h, int signum) {
  sl_info("SIGHUP received: ignored (there is nothing to reload; SIGTERM stops subletd)");
}

static void on_signal(uv_signal_t *h, int signum) {
  struct sl_daemon *d = h->data;

  sl_info("%s received: shutting down", signum == SIGTERM ? "SIGTERM" : "SIGINT");
  sl_server_stop(d);
}

static void on_parent_exit(uv_poll_t *h, int status, int events) {
  struct sl_daemon *d = h->data;

  sl_info("parent process %d exited: shutting down", (int)d->cfg.parent_pid);
  sl_server_stop(d);
}

static int watch_parent(struct sl_daemon *d, struct sl_err *err) {
  d->parent_pidfd = (int)syscall(SYS_pidfd_open, d->cfg.parent_pid, 0);
  if (d->parent_pidfd < 0)
    return sl_err_set(err, SUBLET_EINVAL, "--parent-pid %d: %s", (int)d->cfg.parent_pid,
                      strerror(errno));
  uv_poll_init(d->loop, &d->parent_watch, d->parent_pidfd);
  d->parent_watch.data = d;
  uv_poll_start(&d->parent_watch, UV_READABLE, on_parent_exit);
  return 0;
}

/* One sd_notify(3) datagram to $NOTIFY_SOCKET; failures are ignored, as sd_notify's are. */
void sl_server_notify(const char *msg) {
  const char *path = getenv("NOTIFY_SOCKET");
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd;

  if (path == NULL || path[0] == '\0' || strlen(path) >= sizeof(addr.sun_path))
    return;
  strcpy(addr.sun_path, path);
  if (addr.sun_path[0] == '@')
    addr.sun_path[0] = '\0'; /* abstract namespace */
  fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return;
  /* The address's length is the name's: an abstract name is not padded with zeros. */
  sendto(fd, msg, strlen(msg), 0, (struct sockaddr *)&addr,
         (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path)));
  close(fd);
}

/* The pid file appears whole (written beside it, then renamed over it: a symlink at the path is
 * replaced, never followed), and only once we hold the socket, so that a start refused because
 * another daemon serves the path leaves that daemon's pid file alone; and before the loop runs,
 * so that a client answered by us finds it. Its inode tells at exit whether it is still ours
 * (sl_server_unlink_pid). */
static int write_pid_file(struct sl_daemon *d, struct sl_err *err) {
  const char *path = d->cfg.pid_path;
  char tmp[PATH_MAX], line[24];
  int fd, n, e = 0;

  if (snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid()) >= (int)sizeof(tmp))
    return sl_err_set(err, SUBLET_EINVAL, "--pid-file %s: the path is too long", path);
  n = snprintf(line, sizeof(line), "%d\n", (int)getpid());
  errno = 0;
  fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, line, (size_t)n) != n || fstat(fd, &d->pid_stat) != 0 ||
      rename(tmp, path) != 0)
    e = errno != 0 ? errno : EIO; /* a short write sets no errno */
  if (fd >= 0)
    close(fd);
  if (e == 0)
    return 0;
  unlink(tmp);
  memset(&d->pid_stat, 0, sizeof(d->pid_stat));
  return sl_err_set(err, SUBLET_EIO, "cannot write the pid file %s: %s (does its directory "
                    "exist and is it writable? or leave out --pid-file)", path, strerror(e));
}

/* Before the socket exists: a SIGTERM sent as soon as it appears (a supervisor, a test) must
 * find the handler, not the default action that kills without settling anything. */
static void start_signals(struct sl_daemon *d) {
  uv_signal_init(d->loop, &d->sigterm);
  uv_signal_init(d->loop, &d->sigint);
  uv_signal_init(d->loop, &d->sighup);
  d->sigterm.data = d->sigint.data = d->sighup.data = d;
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);
  uv_signal_start(&d->sigint, on_signal, SIGINT);
  uv_signal_start(&d->sighup, on_sighup, SIGHUP);
}

int sl_server_start(struct sl_daemon *d, struct sl_err *err) {
  int rc;

  d->started = sl_clock_now();
  d->parent_pidfd = -1;
  start_signals(d);
  d->listen_fd = d->cfg.listen_fd >= 0 ? d->cfg.listen_fd : bind_socket(d->cfg.socket_path, err);
  if (d->listen_fd < 0)
    return d->listen_fd;
  if (d->cfg.listen_fd < 0 && stat(d->cfg.socket_path, &d->socket_stat) != 0)
    memset(&d->socket_stat, 0, sizeof(d->socket_stat));
  if (d->cfg.pid_path != NULL && (rc = write_pid_file(d, err)) != 0)
    return rc;
  fcntl(d->listen_fd, F_SETFL, fcntl(d->listen_fd, F_GETFL) | O_NONBLOCK);
  rc = sl_transports_init(&d->transports, d->loop, &d->cfg.limits, &sl_conn_transport_ops);
  if (rc != 0)
    return sl_err_set(err, rc, "out of host memory");
  d->conn_ops = &sl_handlers;
  uv_poll_init(d->loop, &d->listener, d->listen_fd);
  d->listener.data = d;
  uv_poll_start(&d->listener, UV_READABLE, on_listener);
  uv_timer_init(d->loop, &d->accept_retry);
  d->accept_retry.data = d;
  if (d->cfg.parent_pid > 0 && (rc = watch_parent(d, err)) != 0)
    return rc;
  sl_idle_start(d, sl_server_stop);
  sl_pins_init(d);
  if (d->cfg.notify)
    sl_server_notify("READY=1\nSTATUS=serving");
  return 0;
}

/* Only our own files go: a daemon leaving (--idle-exit) while a new one starts at the same path
 * must not unlink the newcomer's socket or pid file. ours: what we made (st_ino 0: nothing). */
static void unlink_if_ours(const char *path, const struct stat *ours) {
  struct stat st;

  if (path == NULL || ours->st_ino == 0)
    return;
  if (lstat(path, &st) == 0 && st.st_ino == ours->st_ino && st.st_dev == ours->st_dev)
    unlink(path);
}

void sl_server_unlink_socket(struct sl_daemon *d) {
  if (d->cfg.listen_fd < 0)
    unlink_if_ours(d->cfg.socket_path, &d->socket_stat);
}

void sl_server_unlink_pid(struct sl_daemon *d) {
  unlink_if_ours(d->cfg.pid_path, &d->pid_stat);
}

static void close_handle(uv_handle_t *h) {
  if (!uv_is_closing(h))
    uv_close(h, NULL);
}

/* Borrowers go first: their loans end (kept bytes restored) while the owners are still
 * there; an owner closed first would leave its loan nobody to restore for. */
static void close_borrowers(struct sl_daemon *d) {
  struct sl_conn *c = d->conns, *next;

  for (; c != NULL; c = next) {
    next = c->next;
    if (c->client_id != 0 && sl_books_client_loan(d->books, c->client_id) != 0)
      sl_conn_close_now(c);
  }
}

/* Closes every connection, settling the books: a loan whose borrower is gone or returns is
 * restored here; one still borrowed is left to its owner's library, which restores it from the
 * save area once the borrower has let go (endings.c). Then the loop's handles, so that uv_run
 * returns once the copies under way are done: the bound on a stop is those copies at the host
 * link's speed (all of a 140 GiB GPU in under 3 s at 55 GB/s). */
void sl_server_stop(struct sl_daemon *d) {
  if (d->stopping)
    return;
  d->stopping = 1;
  close_borrowers(d);
  while (d->conns != NULL)
    sl_conn_close_now(d->conns);
  sl_endings_shutdown(d);
  sl_transports_destroy(&d->transports);
  close_handle((uv_handle_t *)&d->listener);
  close_handle((uv_handle_t *)&d->accept_retry);
  close_handle((uv_handle_t *)&d->sigterm);
  close_handle((uv_handle_t *)&d->sigint);
  close_handle((uv_handle_t *)&d->sighup);
  sl_idle_stop(d);
  sl_pins_stop(d);
  if (d->parent_pidfd >= 0)
    close_handle((uv_handle_t *)&d->parent_watch);
  if (sl_jobs_idle(d))
    uv_stop(d->loop); /* else once the restores queued by the closes are done (jobs.c) */
}
