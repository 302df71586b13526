/* bench_map.c - what mapping memory costs on this device, per GiB, through the same device
 * layer the client library uses: the first loan of a window pays it, later loans must not.
 *
 *   sublet_bench_map [cuda|memfd] [GiB] [threads]
 *   sublet_bench_map --floor [--json] [--pages N] [cuda|memfd] [GiB]
 *
 * For `pages` handles of one page each (a region's pages, as the window maps them) and for one
 * handle of the same size (a fresh chunk), it times create, reserve, map, one access call over
 * the whole span, unmap (page by page, then in one call over all the mappings) and release;
 * then maps, grants access and unmaps the pages from `threads` threads at once, each its own
 * share, to see whether the driver does that work in parallel.
 *
 * --floor is the driver's floor beside sublet.empty and a release (bench/bench_empty.py runs
 * it in the same run): in this one process, N handles of one page (--pages, or GiB's worth)
 * created, each exported as a POSIX fd and imported back (the fd closed), the imports mapped
 * side by side and one access call over the span (what a region costs, daemon and client
 * together, less the socket); then unmapped and released (a region freed, or a release), and
 * created, mapped and given access again (a resume), each phase timed. */
#include <pthread.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "device.h"

struct timing {
  double create, map, access, unmap, release;
};

static int whole_unmap; /* unmap every mapping of the span in one call, not one per handle */

static int fail(const char *what, const struct sl_err *err) {
  fprintf(stderr, "sublet_bench_map: %s: %s\n", what, err->msg);
  return 1;
}

/* Maps n handles of `each` bytes side by side in one reservation and times every step. */
static int run(struct sl_device *d, uint64_t n, uint64_t each, struct timing *t) {
  sl_handle *h = calloc(n, sizeof(*h));
  struct sl_err err = {0};
  void *base = NULL;
  double t0;
  int rc = 1;

  if (h == NULL)
    return 1;
  t0 = now();
  for (uint64_t i = 0; i < n; i++)
    if (sl_device_create(d, each, &h[i], &err) != 0)
      goto out;
  t->create = now() - t0;
  if (sl_device_reserve(d, n * each, &base, &err) != 0)
    goto out;
  t0 = now();
  for (uint64_t i = 0; i < n; i++)
    if (sl_device_map(d, (char *)base + i * each, each, h[i], &err) != 0)
      goto out;
  t->map = now() - t0;
  t0 = now();
  if (sl_device_set_access(d, base, n * each, &err) != 0)
    goto out;
  t->access = now() - t0;
  t0 = now();
  if (whole_unmap)
    rc = sl_device_unmap_idle(d, base, n * each) == 0 ? 0 : 2;
  else
    for (uint64_t i = 0; i < n; i++)
      sl_device_unmap_idle(d, (char *)base + i * each, each);
  t->unmap = now() - t0;
  if (rc == 2) { /* refused: the mappings are still there */
    fprintf(stderr, "sublet_bench_map: one unmap over %" PRIu64 " mappings is refused\n", n);
    for (uint64_t i = 0; i < n; i++)
      sl_device_unmap_idle(d, (char *)base + i * each, each);
  }
  rc = 0;
out:
  if (rc != 0)
    fail("mapping", &err);
  t0 = now();
  for (uint64_t i = 0; i < n; i++)
    if (h[i] != 0)
      sl_device_release(d, h[i]);
  t->release = now() - t0;
  if (base != NULL)
    sl_device_unreserve(d, base, n * each);
  free(h);
  return rc;
}

struct share {
  struct sl_device *d;
  char *base;
  const sl_handle *h;
  uint64_t first, n, each;
  int rc;
};

static void *map_share(void *arg) {
  struct share *s = arg;
  struct sl_err err = {0};

  for (uint64_t i = s->first; i < s->first + s->n && s->rc == 0; i++)
    s->rc = sl_device_map(s->d, s->base + i * s->each, s->each, s->h[i], &err);
  if (s->rc == 0)
    s->rc = sl_device_set_access(s->d, s->base + s->first * s->each, s->n * s->each, &err);
  return NULL;
}

static void *unmap_share(void *arg) {
  struct share *s = arg;

  for (uint64_t i = s->first; i < s->first + s->n; i++)
    sl_device_unmap_idle(s->d, s->base + i * s->each, s->each);
  return NULL;
}

/* Runs fn over n pages split among t threads; returns the seconds, or -1 on a failure. */
static double in_threads(void *(*fn)(void *), struct share *s, int t) {
  pthread_t tid[64];
  double t0 = now();
  int rc = 0;

  for (int i = 0; i < t; i++)
    pthread_create(&tid[i], NULL, fn, &s[i]);
  for (int i = 0; i < t; i++) {
    pthread_join(tid[i], NULL);
    rc |= s[i].rc;
  }
  return rc != 0 ? -1 : now() - t0;
}

static int run_threads(struct sl_device *d, uint64_t n, uint64_t each, int t, double gib) {
  sl_handle *h = calloc(n, sizeof(*h));
  struct share s[64];
  struct sl_err err = {0};
  void *base = NULL;
  double map_s = -1, unmap_s = -1;

  for (uint64_t i = 0; h != NULL && i < n; i++)
    if (sl_device_create(d, each, &h[i], &err) != 0)
      return fail("creating pages", &err);
  if (h == NULL || sl_device_reserve(d, n * each, &base, &err) != 0)
    return fail("reserving", &err);
  for (int i = 0; i < t; i++)
    s[i] = (struct share){d, base, h, n * i / t, n * (i + 1) / t - n * i / t, each, 0};
  map_s = in_threads(map_share, s, t);
  unmap_s = in_threads(unmap_share, s, t);
  printf("%2d threads: map + access %.4f  unmap %.4f  (s per GiB)%s\n", t, map_s / gib,
         unmap_s / gib, map_s < 0 ? "  (a map failed)" : "");
  for (uint64_t i = 0; i < n; i++)
    sl_device_release(d, h[i]);
  sl_device_unreserve(d, base, n * each);
  free(h);
  return 0;
}

static void print(const char *label, const struct timing *t, double gib) {
  printf("%-28s create %.4f  map %.4f  access %.4f  unmap %.4f  release %.4f  (s per GiB)\n",
         label, t->create / gib, t->map / gib, t->access / gib, t->unmap / gib,
         t->release / gib);
}


/* The driver's floor, phase by phase (seconds); see the file's comment. */
struct floor {
  double create, export_fd, import_fd, map, access, unmap, release;
  double create2, map2, access2;
};

/* Exports every handle as an fd and imports it back, as subletd and its client do between
 * them: a message's worth (253 fds) at a time, so that the open-files limit (20000 on the
 * H200 machine) never holds more; imp[i] is the import, each fd closed once imported. */
static int export_import(struct sl_device *d, const sl_handle *h, sl_handle *imp, int *fds,
                         uint64_t n, struct floor *f, struct sl_err *err) {
  for (uint64_t at = 0; at < n; at += 253) {
    uint64_t end = n - at < 253 ? n : at + 253;
    double t0 = now();
    int rc = 0;

    for (uint64_t i = at; i < end; i++)
      if (sl_device_export(d, h[i], &fds[i], err) != 0)
        return -1;
    f->export_fd += now() - t0;
    t0 = now();
    for (uint64_t i = at; i < end; i++) {
      if (rc == 0)
        rc = sl_device_import(d, fds[i], &imp[i], err);
      close(fds[i]);
      fds[i] = -1;
    }
    f->import_fd += now() - t0;
    if (rc != 0)
      return -1;
  }
  return 0;
}

/* Creates n handles of `each` bytes into h; returns the seconds, or -1. */
static double create_all(struct sl_device *d, sl_handle *h, uint64_t n, uint64_t each,
                         struct sl_err *err) {
  double t0 = now();

  for (uint64_t i = 0; i < n; i++)
    if (sl_device_create(d, each, &h[i], err) != 0)
      return -1;
  return now() - t0;
}

/* Maps the n handles h side by side at base, then one access call over the span (the
 * seconds of each go to *map and *access). */
static int map_all(struct sl_device *d, char *base, const sl_handle *h, uint64_t n,
                   uint64_t each, double *map, double *access, struct sl_err *err) {
  double t0 = now();

  for (uint64_t i = 0; i < n; i++)
    if (sl_device_map(d, base + i * each, each, h[i], err) != 0)
      return -1;
  *map = now() - t0;
  t0 = now();
  if (sl_device_set_access(d, base, n * each, err) != 0)
    return -1;
  *access = now() - t0;
  return 0;
}

/* Unmaps the n pages at base and releases every handle of h and imp (imp may be NULL). */
static void unmap_release(struct sl_device *d, char *base, sl_handle *h, sl_handle *imp,
                          uint64_t n, struct floor *f) {
  double t0 = now();

  sl_device_unmap_pages(d, base, n);
  f->unmap = now() - t0;
  t0 = now();
  for (uint64_t i = 0; i < n; i++) {
    if (imp != NULL && imp[i] != 0)
      sl_device_release(d, imp[i]);
    if (h[i] != 0)
      sl_device_release(d, h[i]);
    h[i] = 0;
  }
  f->release = now() - t0;
}

/* The floor's phases in order: a region made (create, export, import, map, access), freed
 * (unmap, release) and made again without the fds (a resume: create, map, access). */
static int run_floor(struct sl_device *d, uint64_t n, uint64_t each, struct floor *f) {
  sl_handle *h = calloc(n, sizeof(*h)), *imp = calloc(n, sizeof(*imp));
  int *fds = malloc(n * sizeof(*fds));
  struct sl_err err = {0};
  struct floor cleanup = {0};
  void *base = NULL;
  int rc = -1;

  if (h == NULL || imp == NULL || fds == NULL ||
      sl_device_reserve(d, n * each, &base, &err) != 0)
    goto out;
  if ((f->create = create_all(d, h, n, each, &err)) < 0 ||
      export_import(d, h, imp, fds, n, f, &err) != 0 ||
      map_all(d, base, imp, n, each, &f->map, &f->access, &err) != 0 ||
      sl_device_synchronize(d, &err) != 0)
    goto out;
  unmap_release(d, base, h, imp, n, f);
  memset(imp, 0, n * sizeof(*imp));
  if ((f->create2 = create_all(d, h, n, each, &err)) < 0 ||
      map_all(d, base, h, n, each, &f->map2, &f->access2, &err) != 0)
    goto out;
  rc = 0;
out:
  if (rc != 0)
    fail("the floor", &err);
  if (base != NULL) {
    unmap_release(d, base, h, imp, n, &cleanup); /* what was not mapped is skipped */
    sl_device_unreserve(d, base, n * each);
  }
  free(h);
  free(imp);
  free(fds);
  return rc;
}

static void print_floor(const struct floor *f, uint64_t n, uint64_t each, int json) {
  const char *names[] = {"create", "export", "import", "map", "access", "unmap", "release",
                         "create_again", "map_again", "access_again"};
  const double v[] = {f->create, f->export_fd, f->import_fd, f->map, f->access, f->unmap,
                      f->release, f->create2, f->map2, f->access2};
  double gib = (double)(n * each) / (1 << 30);

  if (json) { /* one line for bench_empty.py: seconds per phase */
    printf("{\"handles\": %" PRIu64 ", \"handle_bytes\": %" PRIu64, n, each);
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
      printf(", \"%s_s\": %.6f", names[i], v[i]);
    printf("}\n");
    return;
  }
  printf("driver floor, %" PRIu64 " handles of %" PRIu64 " KiB (%.2f GiB), in one process:\n",
         n, each >> 10, gib);
  for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++)
    printf("  %-13s %9.4f s  %8.4f s per GiB\n", names[i], v[i], v[i] / gib);
}

/* --floor [--json] [--pages N] [backend] [GiB] */
static int floor_main(int argc, char **argv) {
  struct sl_device_params p = {.backend = "cuda"};
  struct sl_device *d = NULL;
  struct sl_err err = {0};
  struct floor f = {0};
  double gib = 4.0;
  uint64_t pages = 0, ps;
  int json = 0, rc;

  for (int i = 2; i < argc; i++) {
    if (strcmp(argv[i], "--json") == 0)
      json = 1;
    else if (strcmp(argv[i], "--pages") == 0 && i + 1 < argc)
      pages = strtoull(argv[++i], NULL, 10);
    else if (strcmp(argv[i], "cuda") == 0 || strcmp(argv[i], "memfd") == 0)
      p.backend = argv[i];
    else if ((gib = atof(argv[i])) <= 0) {
      fprintf(stderr, "usage: sublet_bench_map --floor [--json] [--pages N] [cuda|memfd] "
                      "[GiB, default 4]\n");
      return 2;
    }
  }
  if (sl_device_open(&p, &d, &err) != 0)
    return fail("opening the device", &err);
  ps = sl_device_info(d)->page_size;
  if (pages == 0)
    pages = (uint64_t)(gib * (1 << 30)) / ps;
  rc = pages == 0 ? 2 : run_floor(d, pages, ps, &f);
  if (rc == 0)
    print_floor(&f, pages, ps, json);
  sl_device_close(d);
  return rc == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  struct sl_device_params p = {.backend = argc > 1 ? argv[1] : "cuda"};
  double gib = argc > 2 ? atof(argv[2]) : 4.0;
  int threads = argc > 3 ? atoi(argv[3]) : 8;
  struct sl_device *d = NULL;
  struct sl_err err = {0};
  struct timing pages = {0}, one = {0};
  uint64_t ps, n;

  if (argc > 1 && strcmp(argv[1], "--floor") == 0)
    return floor_main(argc, argv);
  if (gib <= 0 || threads < 1 || threads > 64 || (argc > 1 && strcmp(argv[1], "--help") == 0)) {
    fprintf(stderr, "usage: sublet_bench_map [cuda|memfd] [GiB, default 4] [threads, 8]\n"
                    "       sublet_bench_map --floor [--json] [--pages N] [cuda|memfd] [GiB]\n");
    return 2;
  }
  if (sl_device_open(&p, &d, &err) != 0)
    return fail("opening the device", &err);
  ps = sl_device_info(d)->page_size;
  n = (uint64_t)(gib * (1 << 30)) / ps;
  gib = (double)(n * ps) / (1 << 30);
  printf("%s, %.2f GiB in %" PRIu64 " pages of %" PRIu64 " KiB\n", sl_device_info(d)->name, gib,
         n, ps >> 10);
  if (run(d, n, ps, &pages) != 0 || run(d, 1, n * ps, &one) != 0)
    return 1;
  print("one handle per page:", &pages, gib);
  print("one handle for all:", &one, gib);
  whole_unmap = 1;
  if (run(d, n, ps, &pages) != 0)
    return 1;
  print("per page, one unmap call:", &pages, gib);
  for (int t = 1; t <= threads; t *= 2)
    if (run_threads(d, n, ps, t, gib) != 0)
      return 1;
  sl_device_close(d);
  return 0;
}
