/* test_older.c - libsublet against a subletd older than itself. Each capability the library
 * asks of the daemon (a flag of Welcome) absent, the call that needs it fails with
 * SUBLET_ENOTSUP and a message naming the update: nothing released, every page still mapped,
 * each byte where it was; what the older daemon can do still works, every kept byte back. The
 * daemon is real (memfd backend, --check on); a proxy between it and the library takes the
 * flag out of each Welcome (proxy.h). The same proxy taking nothing out shows the calls
 * succeed through it: the refusals are the flags', not the proxy's. Each test lets go of what
 * it made whatever it checked, and the next starts once the daemon has freed it all.
 */
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "proxy.h"
#include "sublet.h"

#define PAGE (64u << 10)
#define TOTAL (64 * PAGE)
#define PAGES 16
#define REGION (PAGES * PAGE)
#define FREE (TOTAL - REGION) /* the "device" beside the region (no headroom on memfd) */

static struct sl_test_daemon daemon_;

static uint8_t pattern(uint64_t i) {
  return (uint8_t)((i * 2654435761u) >> 13);
}

static int intact(const uint8_t *p) {
  for (uint64_t i = 0; i < REGION; i++)
    if (p[i] != pattern(i))
      return 0;
  return 1;
}

static void without_release_need(Sublet__Welcome *w) {
  w->has_release_need = w->release_need = 0;
}

static void without_release_more(Sublet__Welcome *w) {
  w->has_release_more = w->release_more = 0;
}

static void without_pin_ahead(Sublet__Welcome *w) {
  w->has_pin_ahead = w->pin_ahead = 0;
}

/* A client of the daemon seen through a proxy applying edit (NULL: none), and a region of it
 * filled with the pattern: what each test's body is given. */
struct older {
  struct sl_proxy proxy;
  sublet_client *c;
  sublet_region *r;
};

static int open_through(struct older *o, void (*edit)(Sublet__Welcome *)) {
  char path[108];
  int rc;

  snprintf(path, sizeof(path), "%s/older.sock", daemon_.dir);
  if (sl_proxy_start(&o->proxy, path, daemon_.socket, edit) != 0)
    return SUBLET_EIO;
  if ((rc = sublet_connect(o->proxy.socket, &o->c)) != 0)
    return rc;
  if ((rc = sublet_region_create(o->c, REGION, &o->r)) != 0)
    return rc;
  for (uint64_t i = 0; i < REGION; i++)
    ((uint8_t *)sublet_region_addr(o->r))[i] = pattern(i);
  return 0;
}

/* Waits until the daemon counts every byte free (it frees a gone client's regions when it
 * reads the close): 1, or 0 if it has not within SL_TEST_UNTIL's time. */
static int all_free(void) {
  sublet_client *c;
  int ok;

  if (sublet_connect(daemon_.socket, &c) != 0)
    return 0;
  SL_TEST_UNTIL(sl_test_free_bytes(c) == TOTAL);
  ok = sl_test_free_bytes(c) == TOTAL;
  sublet_disconnect(c);
  return ok;
}

/* Runs body through a proxy applying edit, then lets go of all of it whatever body checked
 * (a CHECK returns from body): the client goes, the proxy with it, and the daemon frees what
 * was theirs; the next test starts once it has, FREE bytes free beside a new region. */
static void through(void (*edit)(Sublet__Welcome *), void (*body)(struct older *o)) {
  struct older o = {.proxy = {.pid = 0}, .c = NULL};
  int failed = sl_test_failed;

  if (open_through(&o, edit) != 0) {
    fprintf(stderr, "through the proxy: %s\n", sublet_last_error());
    sl_test_failed++;
  } else {
    body(&o);
  }
  if (sl_test_failed == failed && sublet_region_release(o.r) != 0) { /* else the close frees */
    fprintf(stderr, "the region's release: %s\n", sublet_last_error());
    sl_test_failed++;
  }
  if (o.c != NULL)
    sublet_disconnect(o.c);
  sl_proxy_stop(&o.proxy);
  CHECK(all_free());
}

/* Every byte kept; the taker needs the free bytes and 4 pages more: 4 pages released. */
static int release_by_need(sublet_region *r, uint64_t *rel, struct sublet_release_stats *st) {
  return sublet_release_need(r, NULL, 0, NULL, 0, 1, SUBLET_STAY_ANY, FREE + 4 * PAGE, rel, st);
}

static void release_by_need_and_more(struct older *o) {
  struct sublet_release_stats st;
  sublet_region *taker;
  uint64_t rel;

  CHECK_RC(release_by_need(o->r, &rel, &st), 0);
  CHECK(st.released_pages == 4 && st.copied_out_bytes == 4 * PAGE);
  CHECK_RC(sublet_region_create(o->c, FREE + 4 * PAGE, &taker), 0); /* the taker takes it */
  CHECK_RC(sublet_release_more(o->r, rel, FREE + 6 * PAGE, &st), 0); /* ... needs 2 more */
  CHECK(st.released_pages == 6 && st.copied_out_bytes == 6 * PAGE);
  CHECK_RC(sublet_region_release(taker), 0);
  CHECK_RC(sublet_resume(o->r, rel, 0, &st), 0);
  CHECK(intact(sublet_region_addr(o->r)));
}

static void release_by_need_refused(struct older *o) {
  struct sublet_release_stats st;
  uint64_t rel;

  CHECK_RC(release_by_need(o->r, &rel, &st), SUBLET_ENOTSUP);
  CHECK(strstr(sublet_last_error(), "update subletd") != NULL);
  CHECK(intact(sublet_region_addr(o->r))); /* nothing released: every page mapped, as it was */
  CHECK_RC(sublet_release(o->r, NULL, 0, NULL, 0, 1, 0, &rel, &st), 0); /* the older way */
  CHECK(st.released_pages == PAGES && st.copied_out_bytes == REGION);
  CHECK_RC(sublet_resume(o->r, rel, 0, &st), 0);
  CHECK(intact(sublet_region_addr(o->r)));
}

static void more_of_a_release_refused(struct older *o) {
  struct sublet_release_stats st;
  uint64_t rel;

  CHECK_RC(release_by_need(o->r, &rel, &st), 0);
  CHECK(st.released_pages == 4);
  CHECK_RC(sublet_release_more(o->r, rel, FREE + 6 * PAGE, &st), SUBLET_ENOTSUP);
  CHECK(strstr(sublet_last_error(), "update subletd") != NULL);
  CHECK_RC(sublet_resume(o->r, rel, 0, &st), 0); /* the release as it was: 4 pages */
  CHECK(st.released_pages == 4 && st.copied_in_bytes == 4 * PAGE);
  CHECK(intact(sublet_region_addr(o->r)));
}

static void pin_ahead(struct older *o) {
  CHECK_RC(sublet_pin_ahead(o->c, PAGE, 0), 0);
}

static void pin_ahead_refused(struct older *o) {
  CHECK_RC(sublet_pin_ahead(o->c, PAGE, 0), SUBLET_ENOTSUP);
  CHECK(strstr(sublet_last_error(), "update it") != NULL);
}

static void test_through_the_proxy(void) {
  through(NULL, release_by_need_and_more);
  through(NULL, pin_ahead);
}

static void test_without_release_need(void) {
  through(without_release_need, release_by_need_refused);
}

static void test_without_release_more(void) {
  through(without_release_more, more_of_a_release_refused);
}

static void test_without_pin_ahead(void) {
  through(without_pin_ahead, pin_ahead_refused);
}

int main(void) {
  if (sl_test_daemon_start(&daemon_, PAGE, TOTAL) != 0)
    return 1;
  sl_test_run("through the proxy: by need, more, pin", test_through_the_proxy);
  sl_test_run("no release_need: refused, all works", test_without_release_need);
  sl_test_run("no release_more: refused, resumes", test_without_release_more);
  sl_test_run("no pin_ahead: refused", test_without_pin_ahead);
  if (sl_test_daemon_stop(&daemon_) != 0)
    sl_test_failed++;
  return sl_test_summary("older");
}
