/* main.c - subletd's command line: options, the device, the books, the loop.
 *
 * Floor 11 (daemon.h's floors).
 */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "clock.h"
#include "daemon.h"
#include "log.h"

#define EXIT_USAGE 2
/* The socket path holds something subletd will not remove (a file, a live daemon's socket):
 * its own status, so that a supervisor or script can tell "pick another path" from a fault. */
#define EXIT_SOCKET_TAKEN 3

static void usage(FILE *out) {
  fprintf(out,
          "Usage: subletd [OPTION]...\n"
          "Lend a GPU's memory between PyTorch processes: the per-device sublet daemon.\n"
          "\n"
          "  -d, --device N|UUID    the GPU to serve: a CUDA device number (default 0)\n"
          "                         or a UUID as nvidia-smi -L prints it (GPU-xxxxxxxx-...)\n"
          "  -s, --socket PATH      listen on PATH (default $SUBLET_SOCKET, else\n"
          "                         /run/sublet/gpuN.sock); systemd socket activation\n"
          "                         is used when LISTEN_FDS is set\n"
          "  -b, --backend NAME     cuda (default) or memfd (host memory; no GPU needed)\n"
          "  -r, --reserve SIZE     free device memory no loan may take (default 1G on\n"
          "                         cuda, 0 on memfd); SIZE takes K, M, G suffixes\n"
          "  -g, --allow-group GRP  members of GRP may borrow other users' loans\n"
          "  -p, --pin SIZE         pin SIZE of host memory for saved kept bytes at start,\n"
          "                         so that no loan pays for pinning (default 0: each\n"
          "                         Lend pins up to its kept bytes in the background,\n"
          "                         then they are kept)\n"
          "      --pin-keep SECONDS\n"
          "                         release a user's pinned save area once the user has\n"
          "                         had no region for SECONDS (default 600; not with --pin)\n"
          "      --max-connections N       clients connected at once (default 1024)\n"
          "      --max-user-connections N  of them from one user (default 128)\n"
          "      --pid-file PATH    write subletd's pid to PATH once it serves; removed\n"
          "                         when it exits cleanly (SIGTERM, SIGINT, --idle-exit)\n"
          "      --parent-pid PID   exit when process PID exits (a private daemon)\n"
          "      --idle-exit SECONDS\n"
          "                         exit once no client, region or loan has been there\n"
          "                         for SECONDS (a user's daemon started on demand: the\n"
          "                         Python package starts it with 600); default: never\n"
          "  -l, --log-level LEVEL  error, warn, info (default) or debug\n"
          "      --check            verify the books after every request (for tests)\n"
          "  -h, --help             show this help and exit\n"
          "  -V, --version          show the version and exit\n"
          "\n"
          "SIGTERM and SIGINT shut down cleanly (loans end, kept bytes restored); SIGHUP\n"
          "is logged and ignored.\n"
          "\n"
          "Exit status: 0 after a clean shutdown, 1 on a runtime error, 2 on a usage error,\n"
          "3 when the socket path holds something other than a stale socket (left as it is).\n");
}

static int hex_digit(char c) {
  if (c >= '0' && c <= '9')
    return c - '0';
  c = (char)(c | 0x20);
  return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* A GPU UUID as nvidia-smi -L prints it: "GPU-" then 32 hex digits, dashes anywhere. */
static int parse_uuid(const char *s, uint8_t uuid[16]) {
  int n = 0, hi, lo;

  if (strncmp(s, "GPU-", 4) != 0)
    return -1;
  for (s += 4; *s != '\0'; s++) {
    if (*s == '-')
      continue;
    if (n == 16 || (hi = hex_digit(s[0])) < 0 || (lo = hex_digit(s[1])) < 0)
      return -1;
    uuid[n++] = (uint8_t)(hi << 4 | lo);
    s++;
  }
  return n == 16 ? 0 : -1;
}

static int parse_device(const char *s, struct sl_daemon_config *cfg) {
  char *end;

  if (parse_uuid(s, cfg->uuid) == 0) {
    cfg->by_uuid = 1;
    return 0;
  }
  cfg->device = (int)strtol(s, &end, 10);
  return end != s && *end == '\0' && cfg->device >= 0 ? 0 : -1;
}

static int parse_group(const char *name, gid_t *gid) {
  struct group *g = getgrnam(name);
  char *end;

  if (g != NULL) {
    *gid = g->gr_gid;
    return 0;
  }
  *gid = (gid_t)strtoul(name, &end, 10);
  return end != name && *end == '\0' ? 0 : -1;
}

static int parse_count(const char *s, unsigned *out) {
  char *end;
  unsigned long v;

  errno = 0;
  v = strtoul(s, &end, 10);
  if (end == s || *end != '\0' || s[0] == '-' || errno != 0 || v == 0 || v > 1u << 20)
    return -1;
  *out = (unsigned)v;
  return 0;
}

static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "subletd: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nTry 'subletd --help' for more information.\n");
  return EXIT_USAGE;
}

/* Returns -1 to go on, or an exit status. */
static int parse_args(int argc, char **argv, struct sl_daemon_config *cfg, int *reserve_set) {
  static const struct option opts[] = {
      {"device", required_argument, NULL, 'd'},  {"socket", required_argument, NULL, 's'},
      {"backend", required_argument, NULL, 'b'}, {"reserve", required_argument, NULL, 'r'},
      {"allow-group", required_argument, NULL, 'g'}, {"pin", required_argument, NULL, 'p'},
      {"parent-pid", required_argument, NULL, 'P'}, {"pid-file", required_argument, NULL, 'F'},
      {"idle-exit", required_argument, NULL, 'I'}, {"pin-keep", required_argument, NULL, 'K'},
      {"max-connections", required_argument, NULL, 'M'},
      {"max-user-connections", required_argument, NULL, 'N'},
      {"log-level", required_argument, NULL, 'l'}, {"check", no_argument, NULL, 'C'},
      {"help", no_argument, NULL, 'h'},          {"version", no_argument, NULL, 'V'},
      {NULL, 0, NULL, 0}};
  int opt, level;
  char *end;

  while ((opt = getopt_long(argc, argv, "d:s:b:r:g:p:l:hV", opts, NULL)) != -1) {
    switch (opt) {
      case 'd':
        if (parse_device(optarg, cfg) != 0)
          return usage_error("--device takes a device number or a GPU UUID (GPU-xxxxxxxx-...), "
                             "not '%s'", optarg);
        break;
      case 's': cfg->socket_path = optarg; break;
      case 'F': cfg->pid_path = optarg; break;
      case 'b':
        if (strcmp(optarg, "cuda") != 0 && strcmp(optarg, "memfd") != 0)
          return usage_error("--backend is cuda or memfd, not '%s'", optarg);
        cfg->backend = optarg;
        break;
      case 'r':
        if (sl_parse_size(optarg, &cfg->reserve_bytes) != 0)
          return usage_error("--reserve takes a size such as 512M or 2G, not '%s'", optarg);
        *reserve_set = 1;
        break;
      case 'p':
        if (sl_parse_size(optarg, &cfg->pin_bytes) != 0)
          return usage_error("--pin takes a size such as 16G, not '%s'", optarg);
        break;
      case 'g':
        if (parse_group(optarg, &cfg->allow_gid) != 0)
          return usage_error("--allow-group: no group '%s'", optarg);
        break;
      case 'P': cfg->parent_pid = (pid_t)atoi(optarg); break;
      case 'I':
        cfg->idle_exit_seconds = strtod(optarg, &end);
        if (end == optarg || *end != '\0' || !(cfg->idle_exit_seconds > 0))
          return usage_error("--idle-exit takes a number of seconds above 0, not '%s'", optarg);
        break;
      case 'K':
        cfg->pin_keep_seconds = strtod(optarg, &end);
        if (end == optarg || *end != '\0' || !(cfg->pin_keep_seconds >= 0))
          return usage_error("--pin-keep takes a number of seconds from 0, not '%s'", optarg);
        break;
      case 'M':
        if (parse_count(optarg, &cfg->limits.users.conns) != 0)
          return usage_error("--max-connections takes a count from 1, not '%s'", optarg);
        break;
      case 'N':
        if (parse_count(optarg, &cfg->limits.users.conns_per_user) != 0)
          return usage_error("--max-user-connections takes a count from 1, not '%s'", optarg);
        break;
      case 'l':
        if ((level = sl_log_parse_level(optarg)) < 0)
          return usage_error("--log-level is error, warn, info or debug, not '%s'", optarg);
        sl_log_set_level((enum sl_log_level)level);
        break;
      case 'C': cfg->check_books = 1; break;
      case 'h': usage(stdout); return 0;
      case 'V': printf("subletd %s (protocol %d)\n", SUBLET_VERSION_STRING,
                       SUBLET_PROTOCOL_VERSION); return 0;
      default: fprintf(stderr, "Try 'subletd --help' for more information.\n");
               return EXIT_USAGE;
    }
  }
  if (optind < argc)
    return usage_error("unexpected argument '%s'", argv[optind]);
  return -1;
}

/* systemd socket activation: one listening socket at fd 3. */
static int activated_socket(void) {
  const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");

  if (pid == NULL || fds == NULL || atoi(pid) != getpid() || atoi(fds) < 1)
    return -1;
  return 3;
}

static void default_socket(struct sl_daemon_config *cfg, char *buf, size_t n) {
  const char *env = getenv("SUBLET_SOCKET");

  if (cfg->socket_path != NULL)
    return;
  if (env != NULL && env[0] != '\0') {
    cfg->socket_path = env;
    return;
  }
  snprintf(buf, n, "/run/sublet/gpu%d.sock", cfg->device);
  cfg->socket_path = buf;
}

/* --pin runs before READY=1 (the socket is made after it, and loans must not race the pin or
 * pay for it), and pinning takes seconds per 10 GiB: under systemd's start timeout (90 s by
 * default) a large pin would fail the start. So it pins PIN_STEP at a time and, before each,
 * asks systemd for PIN_STEP_TIMEOUT_USEC more (EXTEND_TIMEOUT_USEC counts from when it is
 * received): a step that slow would be a pin of under 5 MiB/s. */
#define PIN_STEP (256ull << 20)
#define PIN_STEP_TIMEOUT_USEC (60ull * 1000 * 1000)

static int open_device(struct sl_daemon *d, struct sl_err *err) {
  struct sl_device_params p = {.backend = d->cfg.backend, .ordinal = d->cfg.device,
                               .uuid = d->cfg.by_uuid ? d->cfg.uuid : NULL,
                               .load_kernels = 1};
  struct sl_books_config bc = {0};
  char a[16], b[16];
  int rc = sl_device_open(&p, &d->dev, err);

  if (rc != 0)
    return rc;
  d->cfg.device = sl_device_info(d->dev)->ordinal; /* the number of a device named by UUID */
  bc.page_size = sl_device_info(d->dev)->page_size;
  bc.device_pages = sl_device_info(d->dev)->total_bytes / bc.page_size;
  bc.fresh_give = d->cfg.reserve_bytes / 2 / bc.page_size;
  rc = sl_books_new(&bc, &d->books);
  if (rc == 0)
    rc = sl_pool_new(d->dev, &d->pool);
  if (rc != 0)
    return sl_err_set(err, rc, "out of host memory");
  if (d->cfg.pin_bytes > 0) {
    double t0 = sl_clock_now();
    sl_info("pinning %s of host memory (--pin)", sl_format_size(a, d->cfg.pin_bytes));
    /* A step at a time, each announced to systemd first (PIN_STEP). */
    for (uint64_t done = 0; done < d->cfg.pin_bytes;) {
      char msg[96];
      done = d->cfg.pin_bytes - done > PIN_STEP ? done + PIN_STEP : d->cfg.pin_bytes;
      snprintf(msg, sizeof(msg), "EXTEND_TIMEOUT_USEC=%llu\nSTATUS=pinning host memory (--pin)",
               (unsigned long long)PIN_STEP_TIMEOUT_USEC);
      if (d->cfg.notify)
        sl_server_notify(msg);
      rc = sl_pool_host_reserve(d->pool, done, err);
      if (rc != 0)
        return rc;
    }
    sl_info("pinned %s of host memory in %.1f s", sl_format_size(a, d->cfg.pin_bytes),
            sl_clock_now() - t0);
  }
  sl_info("device %d: %s (%s backend), %s, pages of %s", d->cfg.device,
          sl_device_info(d->dev)->name, d->cfg.backend,
          sl_format_size(a, sl_device_info(d->dev)->total_bytes),
          sl_format_size(b, sl_device_info(d->dev)->page_size));
  return 0;
}

static void cleanup(struct sl_daemon *d) {
  if (d->loop != NULL)
    uv_run(d->loop, UV_RUN_NOWAIT); /* let the close callbacks run */
  sl_rescue_free_all(d);
  sl_pool_free(d->pool);
  sl_books_free(d->books);
  if (d->dev != NULL)
    sl_device_close(d->dev);
  sl_server_unlink_socket(d);
  sl_server_unlink_pid(d);
}

int main(int argc, char **argv) {
  struct sl_daemon d = {0};
  struct sl_err err = {0};
  char path[108];
  int reserve_set = 0, rc;

  d.cfg.backend = "cuda";
  d.cfg.pin_keep_seconds = 600;
  d.cfg.allow_gid = (gid_t)-1;
  d.cfg.limits = (struct sl_transport_limits)SL_TRANSPORT_LIMITS_DEFAULT;
  rc = parse_args(argc, argv, &d.cfg, &reserve_set);
  if (rc >= 0)
    return rc;
  if (!reserve_set && strcmp(d.cfg.backend, "cuda") == 0)
    d.cfg.reserve_bytes = 1ull << 30;
  d.cfg.listen_fd = activated_socket();
  d.cfg.notify = getenv("NOTIFY_SOCKET") != NULL;
  d.loop = uv_default_loop();
  /* Until the loop's handler takes over (sl_server_start), SIGHUP is ignored: pinning host
   * memory (--pin) can take tens of seconds, and a closed terminal must not kill us then. */
  signal(SIGHUP, SIG_IGN);
  rc = open_device(&d, &err);
  default_socket(&d.cfg, path, sizeof(path));
  if (rc == 0 && (rc = sl_server_start(&d, &err)) == SUBLET_EBUSY)
    rc = EXIT_SOCKET_TAKEN; /* only the socket path's check says busy (server.c) */
  else if (rc != 0)
    rc = 1;
  if (rc != 0) {
    sl_error("%s", err.msg);
    cleanup(&d);
    return rc;
  }
  sl_info("subletd %s serving device %d on %s", SUBLET_VERSION_STRING, d.cfg.device,
          d.cfg.listen_fd >= 0 ? "a socket from systemd" : d.cfg.socket_path);
  uv_run(d.loop, UV_RUN_DEFAULT);
  cleanup(&d);
  sl_info("stopped");
  return 0;
}
