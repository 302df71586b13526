/* test_older.c - libsublet against a subletd older than itself. Each capability the library
 * asks of the daemon (a flag of Welcome) absent, the call that needs it fails with
 * SUBLET_ENOTSUP and a message naming the update, before anything is sent: nothing released,
 * every page still mapped, each byte where it was; what the older daemon can do still works,
 * every kept byte back. The daemon is real (memfd backend, --check on); a proxy between it and
 * the library takes the flag out of each Welcome (proxy.h). The same proxy taking nothing out
 * shows the calls succeed through it: the refusals are the flags', not the proxy's.
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

/* A client of the daemon through a proxy that applies edit (NULL: none), and a region of it
 * filled with the pattern. */
static int open_through(struct sl_test_proxy *p, void (*edit)(Sublet__Welcome *),
                        sublet_client **c, sublet_region **r) {
  char path[108];
  int rc;

  snprintf(path, sizeof(path), "%s/older.sock", daemon_.dir);
  if (sl_test_proxy_start(p, path, daemon_.socket, edit) != 0)
    return SUBLET_EIO;
  if ((rc = sublet_connect(p->socket, c)) != 0)
    return rc;
  if ((rc = sublet_region_create(*c, REGION, r)) != 0)
    return rc;
  for (uint64_t i = 0; i < REGION; i++)
    ((uint8_t *)sublet_region_addr(*r))[i] = pattern(i);
  return 0;
}

static void close_through(struct sl_test_proxy *p, sublet_client *c, sublet_region *r) {
  sublet_region_release(r);
  sublet_disconnect(c);
  sl_test_proxy_stop(p);
}

/* Every byte kept; the taker needs the free bytes and 4 pages more: 4 pages released. */
static int release_by_need(sublet_region *r, uint64_t *rel, struct sublet_release_stats *st) {
  return sublet_release_need(r, NULL, 0, NULL, 0, 1, SUBLET_STAY_ANY, FREE + 4 * PAGE, rel, st);
}

static void test_release_by_need(void) {
  struct sl_test_proxy p;
  struct sublet_release_stats st;
  sublet_client *c;
  sublet_region *r, *taker;
  uint64_t rel;

  CHECK_RC(open_through(&p, NULL, &c, &r), 0);
  CHECK_RC(release_by_need(r, &rel, &st), 0);
  CHECK(st.released_pages == 4 && st.copied_out_bytes == 4 * PAGE);
  CHECK_RC(sublet_region_create(c, FREE + 4 * PAGE, &taker), 0); /* the taker takes its need */
  CHECK_RC(sublet_release_more(r, rel, FREE + 6 * PAGE, &st), 0); /* ... then needs 2 more */
  CHECK(st.released_pages == 6 && st.copied_out_bytes == 6 * PAGE);
  CHECK_RC(sublet_region_release(taker), 0);
  CHECK_RC(sublet_resume(r, rel, 0, &st), 0);
  CHECK(intact(sublet_region_addr(r)));
  close_through(&p, c, r);
}

static void test_release_by_need_refused(void) {
  struct sl_test_proxy p;
  struct sublet_release_stats st;
  sublet_client *c;
  sublet_region *r;
  uint64_t rel;

  CHECK_RC(open_through(&p, without_release_need, &c, &r), 0);
  CHECK_RC(release_by_need(r, &rel, &st), SUBLET_ENOTSUP);
  CHECK(strstr(sublet_last_error(), "update subletd") != NULL);
  CHECK(intact(sublet_region_addr(r))); /* nothing released: every page mapped, as it was */
  CHECK_RC(sublet_release(r, NULL, 0, NULL, 0, 1, 0, &rel, &st), 0); /* the older way works */
  CHECK(st.released_pages == PAGES && st.copied_out_bytes == REGION);
  CHECK_RC(sublet_resume(r, rel, 0, &st), 0);
  CHECK(intact(sublet_region_addr(r)));
  close_through(&p, c, r);
}

static void test_more_of_a_release_refused(void) {
  struct sl_test_proxy p;
  struct sublet_release_stats st;
  sublet_client *c;
  sublet_region *r;
  uint64_t rel;

  CHECK_RC(open_through(&p, without_release_more, &c, &r), 0);
  CHECK_RC(release_by_need(r, &rel, &st), 0);
  CHECK(st.released_pages == 4);
  CHECK_RC(sublet_release_more(r, rel, FREE + 6 * PAGE, &st), SUBLET_ENOTSUP);
  CHECK(strstr(sublet_last_error(), "update subletd") != NULL);
  CHECK_RC(sublet_resume(r, rel, 0, &st), 0); /* the release as it was: 4 pages */
  CHECK(st.released_pages == 4 && st.copied_in_bytes == 4 * PAGE);
  CHECK(intact(sublet_region_addr(r)));
  close_through(&p, c, r);
}

static void test_pin_ahead(void) {
  struct sl_test_proxy p, older;
  sublet_client *c, *c2;
  sublet_region *r, *r2;

  CHECK_RC(open_through(&p, NULL, &c, &r), 0);
  CHECK_RC(sublet_pin_ahead(c, PAGE, 0), 0);
  close_through(&p, c, r);
  CHECK_RC(open_through(&older, without_pin_ahead, &c2, &r2), 0);
  CHECK_RC(sublet_pin_ahead(c2, PAGE, 0), SUBLET_ENOTSUP);
  CHECK(strstr(sublet_last_error(), "update it") != NULL);
  close_through(&older, c2, r2);
}

int main(void) {
  if (sl_test_daemon_start(&daemon_, PAGE, TOTAL) != 0)
    return 1;
  sl_test_run("through the proxy, a release by need and more of it", test_release_by_need);
  sl_test_run("without release_need: refused, a release of all works", test_release_by_need_refused);
  sl_test_run("without release_more: refused, the release resumes as it was",
              test_more_of_a_release_refused);
  sl_test_run("without pin_ahead: refused", test_pin_ahead);
  if (sl_test_daemon_stop(&daemon_) != 0)
    sl_test_failed++;
  return sl_test_summary("older");
}
