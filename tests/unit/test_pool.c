/* test_pool.c - the pool's transfers on the memfd backend, white box (pool_impl.h): a release
 * saves a region's bytes and lets go of its pages, a resume makes them again as groups and
 * copies the bytes back, and a resume whose making fails part way (the device's create refused
 * after N calls) copies nothing, keeps no fresh handle and can be run again. Bytes are
 * compared after every resume. A region made but not yet mapped in the daemon exports its
 * pages and refuses transfers until mapped. A growth past a region's reservation moves the
 * daemon's mapping (issue 41): every byte where it was, a released page still a hole, and a
 * failed growth leaves the region as it was.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "daemon/pool_impl.h"

#define PAGES 64u
#define GROUP 4u /* pages per group: 16 groups */

static struct sl_device_ops faulty;
static int creates_left = -1; /* -1: no limit */
static int reserve_fails;     /* the device refuses the next reserve */

static int faulty_create(struct sl_device *d, uint64_t size, sl_handle *out, struct sl_err *err) {
  if (creates_left == 0)
    return sl_err_set(err, SUBLET_ENOMEM, "test: the device refuses this create");
  if (creates_left > 0)
    creates_left--;
  return sl_device_memfd_ops.create(d, size, out, err);
}

static int faulty_reserve(struct sl_device *d, uint64_t size, void **addr, struct sl_err *err) {
  if (reserve_fails) {
    reserve_fails = 0;
    return sl_err_set(err, SUBLET_ENOMEM, "test: the device refuses this reserve");
  }
  return sl_device_memfd_ops.reserve(d, size, addr, err);
}

static uint8_t pattern(uint64_t i) {
  return (uint8_t)(i * 2654435761u >> 24);
}

static void fill(struct sl_pool_region *r, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; i++)
    ((uint8_t *)r->base)[i] = pattern(i);
}

static int intact(const struct sl_pool_region *r, uint64_t bytes) {
  for (uint64_t i = 0; i < bytes; i++)
    if (((const uint8_t *)r->base)[i] != pattern(i))
      return 0;
  return 1;
}

/* Saves every byte to the area and lets go of every page: a release with stay=0. */
static void release_all(struct sl_pool *p, struct sl_pool_region *r, uint64_t bytes,
                        const uint64_t *pages) {
  struct sl_copy all = {0, 0, bytes};
  struct sl_pool_transfer *t = NULL;
  struct sl_err err = {0};
  double c, m;

  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, r->id, &all, 1, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), 0);
  CHECK_EQ(sl_pool_transfer_drop(t, pages, PAGES, &err), 0);
  sl_pool_transfer_free(t);
  for (uint64_t i = 0; i < PAGES; i++)
    CHECK_EQ(r->pages[i], 0);
}

/* Makes the pages again as groups of GROUP and copies the bytes back; the run's code. */
static int resume_all(struct sl_pool *p, struct sl_pool_region *r, uint64_t bytes,
                      size_t *made, struct sl_err *err) {
  struct sl_copy all = {0, 0, bytes};
  uint64_t groups[2 * (PAGES / GROUP)];
  struct sl_pool_transfer *t = NULL;
  double c, m;
  int rc;

  for (uint64_t g = 0; g < PAGES / GROUP; g++) {
    groups[2 * g] = g * GROUP;
    groups[2 * g + 1] = GROUP;
  }
  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_DEVICE, r->id, &all, 1, NULL, 0, &t, err), 0);
  CHECK_EQ(sl_pool_transfer_make_groups(t, groups, PAGES / GROUP, made, err), 0);
  rc = sl_pool_transfer_run(t, &c, &m, err);
  sl_pool_transfer_free(t); /* the pool's table takes the new handles, or lets them go */
  return rc;
}

/* Are pages [0, npages) of r as fill wrote them, but for page hole (released: unmapped)? */
static int intact_but(const struct sl_pool_region *r, uint64_t npages, uint64_t ps,
                      uint64_t hole) {
  for (uint64_t i = 0; i < npages * ps; i++)
    if (i / ps != hole && ((const uint8_t *)r->base)[i] != pattern(i))
      return 0;
  return 1;
}

/* Grows r to npages with room for cap (hold, grow, grown as regions.c does); the grow's code,
 * *cap_now what the pool reserves after. */
static int grow(struct sl_pool *p, struct sl_pool_region *r, uint64_t npages, uint64_t cap,
                uint64_t *cap_now, struct sl_err *err) {
  struct sl_pool_region *h = sl_pool_region_hold(p, r->id);
  int rc = sl_pool_region_grow(p, h, npages, cap, err);

  *cap_now = sl_pool_region_grown(p, h, npages, rc == 0);
  return rc;
}

/* A region of 8 pages, page 3 released, grows past its reservation of 8 pages: its mapping
 * moves to one of 64 (then 128), its bytes and hole with it; a refused reserve and a refused
 * create leave it as it was (but for a move that was done). */
static void test_growth_moves_the_mapping(struct sl_pool *p) {
  struct sl_pool_region *r = NULL;
  struct sl_pool_transfer *t = NULL;
  uint64_t ps = p->page_size, hole = 3, cap = 0;
  struct sl_err err = {0};
  void *old_base;

  check_note = err.msg;
  CHECK_EQ(sl_pool_region_make(p, 9, 8, 8, &r, &err), 0);
  CHECK_EQ(sl_pool_region_map(p, r, &err), 0);
  sl_pool_region_add(p, r);
  fill(r, 8 * ps);
  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, 9, NULL, 0, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_drop(t, &hole, 1, &err), 0);
  sl_pool_transfer_free(t);
  old_base = r->base;

  reserve_fails = 1; /* no room for the move: nothing changes */
  CHECK_EQ(grow(p, r, 16, 64, &cap, &err), SUBLET_ENOMEM);
  CHECK_EQ(cap, 8);
  CHECK(r->base == old_base && r->npages == 8 && intact_but(r, 8, ps, hole));

  CHECK_EQ(grow(p, r, 16, 64, &cap, &err), 0); /* moved, then grown */
  CHECK_EQ(cap, 64);
  CHECK(r->base != old_base && r->npages == 16 && r->moved == NULL);
  CHECK(intact_but(r, 8, ps, hole));
  CHECK_EQ(r->pages[hole], 0);
  memset((uint8_t *)r->base + 8 * ps, 0x5A, 8 * ps); /* the new pages are mapped */

  creates_left = 2; /* moved, but the new pages cannot all be made: the move stays */
  CHECK_EQ(grow(p, r, 80, 128, &cap, &err), SUBLET_ENOMEM);
  creates_left = -1;
  CHECK_EQ(cap, 128);
  CHECK(r->npages == 16 && intact_but(r, 8, ps, hole));
  CHECK_EQ(((uint8_t *)r->base)[16 * ps - 1], 0x5A);
  CHECK_EQ(grow(p, r, 20, 128, &cap, &err), 0); /* within the room: nothing moves */
  CHECK_EQ(cap, 128);
  CHECK(intact_but(r, 8, ps, hole));
  sl_pool_region_free(p, sl_pool_region_take(p, 9));
}

/* A transfer run between a move and the loop's taking it over (jobs.c never lets one) is
 * refused, not let loose on the old, unmapped base (before: a fault, on memfd SIGSEGV); the
 * one run after it copies every byte from the new mapping. */
static void test_transfer_during_a_move(struct sl_pool *p) {
  struct sl_pool_region *r = NULL, *h;
  struct sl_pool_transfer *t = NULL;
  uint64_t ps = p->page_size;
  struct sl_copy all = {0, 0, 4 * ps};
  struct sl_err err = {0};
  double c, m;

  check_note = err.msg;
  CHECK_EQ(sl_pool_region_make(p, 10, 4, 4, &r, &err), 0);
  CHECK_EQ(sl_pool_region_map(p, r, &err), 0);
  sl_pool_region_add(p, r);
  fill(r, 4 * ps);
  CHECK_EQ(sl_pool_host_reserve(p, 4 * ps, &err), 0);
  h = sl_pool_region_hold(p, 10);
  CHECK_EQ(sl_pool_region_grow(p, h, 5, 8, &err), 0);
  CHECK(h->moved != NULL);
  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, 10, &all, 1, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), SUBLET_EIO);
  CHECK_MSG(err, "moving");
  sl_pool_transfer_free(t);
  sl_pool_region_grown(p, h, 5, 1);
  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, 10, &all, 1, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), 0);
  sl_pool_transfer_free(t);
  CHECK(memcmp(sl_pool_host_area(p)->window, r->base, 4 * ps) == 0 && intact(r, 4 * ps));
  sl_pool_region_free(p, sl_pool_region_take(p, 10));
}

/* A loan's end that gives the pages a borrower of another user was granted fresh pages: the
 * pool lets go of the old pages before it makes the fresh ones (issue 41), so their memory is
 * the device's again; when the fresh ones cannot all be made anyway, nothing is copied, no
 * fresh page is kept, the old ones stay gone (holes), and a later run makes them all and
 * copies every byte back. Before: the old pages stayed until the fresh ones were made, and a
 * device that could not hold both never had the room. */
static void test_fresh_end_frees_the_old_pages(struct sl_pool *p) {
  struct sl_pool_region *r = NULL;
  struct sl_pool_transfer *t = NULL;
  uint64_t ps = p->page_size, old[4] = {0, 1, 2, 3}, before, after;
  struct sl_copy all = {0, 0, 4 * ps};
  struct sl_err err = {0};
  size_t replaced = 0;
  double c, m;

  check_note = err.msg;
  CHECK_EQ(sl_pool_region_make(p, 11, 4, 4, &r, &err), 0);
  CHECK_EQ(sl_pool_region_map(p, r, &err), 0);
  sl_pool_region_add(p, r);
  fill(r, 4 * ps);
  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, 11, &all, 1, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), 0); /* the kept bytes, saved */
  sl_pool_transfer_free(t);
  memset(r->base, 0xB0, 4 * ps); /* the borrower's */
  CHECK_EQ(sl_device_free_bytes(p->dev, &before, &err), 0);

  creates_left = 2;
  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_DEVICE, 11, &all, 1, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_replace(t, old, 4, &replaced, &err), 0);
  CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), SUBLET_ENOMEM);
  sl_pool_transfer_free(t);
  creates_left = -1;
  CHECK_EQ(replaced, 0);
  CHECK_EQ(sl_device_free_bytes(p->dev, &after, &err), 0);
  CHECK_EQ(after, before + 4 * ps); /* the old pages' memory is back, no fresh page kept */
  for (int i = 0; i < 4; i++)
    CHECK_EQ(r->pages[i], 0);

  CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_DEVICE, 11, &all, 1, NULL, 0, &t, &err), 0);
  CHECK_EQ(sl_pool_transfer_replace(t, old, 4, &replaced, &err), 0);
  CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), 0);
  sl_pool_transfer_free(t);
  CHECK_EQ(replaced, 4);
  CHECK(intact(r, 4 * ps));
  CHECK_EQ(sl_device_free_bytes(p->dev, &after, &err), 0);
  CHECK_EQ(after, before); /* four fresh pages in place of four old ones */
  sl_pool_region_free(p, sl_pool_region_take(p, 11));
}

int main(void) {
  struct sl_device_params params = {.backend = "memfd", .total_bytes = 1ull << 30};
  struct sl_pool_region *r = NULL;
  struct sl_device *dev = NULL;
  struct sl_pool *p = NULL;
  struct sl_err err = {0};
  uint64_t pages[PAGES], bytes;
  size_t made = 0;

  check_note = err.msg;
  CHECK_EQ(sl_device_open(&params, &dev, &err), 0);
  faulty = *dev->ops;
  faulty.create = faulty_create;
  faulty.reserve = faulty_reserve;
  dev->ops = &faulty;
  CHECK_EQ(sl_pool_new(dev, &p), 0);
  CHECK_EQ(sl_pool_region_make(p, 7, PAGES, PAGES, &r, &err), 0);
  CHECK_EQ(sl_pool_region_map(p, r, &err), 0);
  sl_pool_region_add(p, r);
  bytes = PAGES * p->page_size;
  for (uint64_t i = 0; i < PAGES; i++)
    pages[i] = i;
  fill(r, bytes);

  /* released, made again while copying: every byte back, the groups in the table */
  release_all(p, r, bytes, pages);
  CHECK_EQ(resume_all(p, r, bytes, &made, &err), 0);
  CHECK_EQ(made, PAGES);
  CHECK(intact(r, bytes));
  CHECK_EQ(r->span[0], GROUP);
  CHECK(r->pages[GROUP] != 0);

  /* the device refuses the 6th group: ENOMEM, no page made, nothing kept of the attempt */
  release_all(p, r, bytes, pages);
  creates_left = 5;
  CHECK_EQ(resume_all(p, r, bytes, &made, &err), SUBLET_ENOMEM);
  CHECK_MSG(err, "make");
  CHECK_EQ(made, 0);
  for (uint64_t i = 0; i < PAGES; i++)
    CHECK_EQ(r->pages[i], 0);

  /* ... and the same resume runs again once the memory is there */
  creates_left = -1;
  memset(&err, 0, sizeof(err));
  CHECK_EQ(resume_all(p, r, bytes, &made, &err), 0);
  CHECK_EQ(made, PAGES);
  CHECK(intact(r, bytes));

  /* a region made, not mapped in the daemon yet: exported as it is, but no transfer runs on
   * it (the daemon maps it in a job that every transfer follows; one after a failed map) */
  {
    struct sl_pool_region *u = NULL;
    struct sl_pool_transfer *t = NULL;
    struct sl_copy one = {0, 0, 4096};
    int fd = -1;
    double c, m;

    CHECK_EQ(sl_pool_region_make(p, 8, 4, 4, &u, &err), 0);
    sl_pool_region_add(p, u);
    CHECK_EQ(sl_pool_export_pages(p, 8, 0, 1, &fd, &err), 0);
    CHECK(fd >= 0);
    close(fd);
    CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, 8, &one, 1, NULL, 0, &t, &err), 0);
    CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), SUBLET_EIO);
    CHECK_MSG(err, "not mapped in subletd");
    sl_pool_transfer_free(t);
    CHECK_EQ(sl_pool_region_map(p, u, &err), 0);
    CHECK_EQ(sl_pool_transfer_new(p, SL_COPY_TO_HOST, 8, &one, 1, NULL, 0, &t, &err), 0);
    CHECK_EQ(sl_pool_transfer_run(t, &c, &m, &err), 0);
    sl_pool_transfer_free(t);
  }

  test_growth_moves_the_mapping(p);
  test_transfer_during_a_move(p);
  test_fresh_end_frees_the_old_pages(p);
  sl_pool_free(p);
  sl_device_close(dev);
  return check_report("test_pool");
}
