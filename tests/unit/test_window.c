/* test_window.c - the borrower's window (client/window.c) on the memfd device: what an
 * allocation that will reach the kept zone maps ahead while its grant is awaited
 * (sl_window_premap), and that the grant then finds it mapped. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "window.h"

#define PAGE (64u << 10)
#define UNKEPT 8u
#define FRESH 4u
#define KEPT 300u /* more than one run of premapping (256 pages) */
#define REGION (UNKEPT + KEPT)

static struct sl_device *dev;
static sl_handle pages[REGION];
static void *region; /* the owner's mapping of them, to write what the window must show */

static void setup(void) {
  struct sl_device_params p = {.backend = "memfd", .page_size = PAGE,
                               .total_bytes = 2ull * REGION * PAGE};
  struct sl_err err = {0};

  CHECK(sl_device_open(&p, &dev, &err) == 0);
  CHECK(sl_device_reserve(dev, (uint64_t)REGION * PAGE, &region, &err) == 0);
  for (unsigned i = 0; i < REGION; i++) {
    CHECK(sl_device_create(dev, PAGE, &pages[i], &err) == 0);
    CHECK(sl_device_map(dev, (char *)region + (uint64_t)i * PAGE, PAGE, pages[i], &err) == 0);
    memset((char *)region + (uint64_t)i * PAGE, (int)(i % 251) + 1, PAGE);
  }
}

/* A window of another process's region (U, F, K zones; unkept pages first in the layout),
 * holding handles of the region's pages from `from` on. */
static struct sl_window *window_new(unsigned from) {
  uint64_t layout[REGION];
  struct sl_window *w = NULL;
  struct sl_err err = {0};

  for (unsigned i = 0; i < REGION; i++)
    layout[i] = i;
  CHECK(sl_window_new(dev, PAGE, 1, REGION, UNKEPT, FRESH, KEPT, layout, NULL, 0, &w, &err) == 0);
  for (unsigned i = from; w != NULL && i < REGION; i++) {
    sl_handle h = 0;
    int fd = -1;
    CHECK(sl_device_export(dev, pages[i], &fd, &err) == 0);
    CHECK(sl_device_import(dev, fd, &h, &err) == 0);
    close(fd);
    w->handles[i] = h;
  }
  return w;
}

static int never(void *arg) {
  (void)arg;
  return 0;
}

static int after_one_run(void *arg) {
  return (*(int *)arg)++ > 0;
}

/* Does kept position p show region page `page`? */
static int shows(const struct sl_window *w, uint64_t p, unsigned page) {
  const unsigned char *at = (const unsigned char *)w->base + p * PAGE;

  return at[0] == (unsigned char)(page % 251 + 1) && at[PAGE - 1] == at[0];
}

static void test_fits_in_unkept_and_fresh(void) {
  struct sl_window *w = window_new(0);

  sl_window_premap(w, UNKEPT + FRESH, never, NULL);
  CHECK_EQ(w->mapped_pages, 0); /* its grant comes at once: nothing to do meanwhile */
  sl_window_free(w);
}

static void test_maps_what_passes_them(void) {
  struct sl_window *w = window_new(0);
  struct sl_err err = {0};
  uint64_t k0 = UNKEPT + FRESH;

  sl_window_premap(w, UNKEPT + FRESH + 20, never, NULL);
  CHECK_EQ(w->mapped_pages, 20);
  CHECK(shows(w, k0, UNKEPT) && shows(w, k0 + 19, UNKEPT + 19));
  CHECK(w->mapped[k0 + 20] < 0);
  /* The grant of those 20 kept positions maps nothing more. */
  CHECK(sl_window_map_run(w, k0, 20, &err) == 0);
  CHECK_EQ(w->mapped_pages, 20);
  sl_window_free(w);
}

static void test_held_pages_count(void) {
  struct sl_window *w = window_new(0);

  /* 10 pages held already: an allocation of 5 does not fit in the 2 positions left. */
  CHECK(sl_window_alloc_add(w, (char *)w->base, 10ull * PAGE, 1) == 0);
  sl_window_premap(w, 5, never, NULL);
  CHECK_EQ(w->mapped_pages, 3);
  CHECK(shows(w, UNKEPT + FRESH + 2, UNKEPT + 2));
  sl_window_free(w);
}

static void test_stops_when_the_reply_is_here(void) {
  struct sl_window *w = window_new(0);
  int asked = 0;

  sl_window_premap(w, UNKEPT + FRESH + KEPT, after_one_run, &asked);
  CHECK_EQ(w->mapped_pages, 256); /* one run, then the reply was there */
  sl_window_premap(w, UNKEPT + FRESH + KEPT, never, NULL);
  CHECK_EQ(w->mapped_pages, KEPT); /* the next call maps the rest, nothing twice */
  CHECK(shows(w, UNKEPT + FRESH + KEPT - 1, REGION - 1));
  sl_window_free(w);
}

static void test_skips_pages_without_a_handle(void) {
  struct sl_window *w = window_new(UNKEPT + 5); /* kept pages 0..4 not imported here */
  struct sl_err err = {0};

  sl_window_premap(w, UNKEPT + FRESH + 10, never, NULL);
  CHECK_EQ(w->mapped_pages, 5);
  CHECK(w->mapped[UNKEPT + FRESH] < 0 && shows(w, UNKEPT + FRESH + 5, UNKEPT + 5));
  /* What was left is the grant's to map, which says why it cannot. */
  CHECK(sl_window_map_run(w, UNKEPT + FRESH, 10, &err) == SUBLET_EPROTO);
  sl_window_free(w);
}

int main(void) {
  setup();
  test_fits_in_unkept_and_fresh();
  test_maps_what_passes_them();
  test_held_pages_count();
  test_stops_when_the_reply_is_here();
  test_skips_pages_without_a_handle();
  return check_report("test_window");
}
