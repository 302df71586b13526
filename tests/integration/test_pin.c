/* test_pin.c - the save area pinned ahead of a loan's saves (daemon/pins.c). Real daemon
 * (memfd backend), its pinning paced at SUBLET_MEMFD_PIN (a GPU's pace, slowed), real sockets.
 *
 * A Lend starts pinning the owner's save area up to the loan's kept bytes in the background
 * (Status.pin shows the goal and how far it is); nothing is pinned past them; a save that
 * needs only the first piece waits for that piece, not for the whole pin; the area stays
 * between loans and is released once its user has had no region for --pin-keep seconds; a
 * daemon started with --pin keeps its area and pins ahead only past it. An owner that knows
 * its keep before the Lend pins ahead itself (PinAhead): its first save then waits for
 * nothing; that pin is bounded by the user's regions, and refused without one.
 */
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "sublet.h"

#define PAGE (2ull << 20)
#define PIECE (256ull << 20) /* SL_HOST_PIECE: the area is pinned in these */
#define REGION (4 * PIECE)
#define PIN_PACE "512M"      /* bytes per second: a piece in 0.5 s, the region in 2 s */

struct pin_state {
  uint64_t host_bytes;
  int pinning; /* Status.pin is there */
  uint64_t target, done;
};

static uint64_t field(const char *json, const char *name) {
  const char *at = strstr(json, name);

  return at != NULL ? strtoull(at + strlen(name), NULL, 10) : UINT64_MAX;
}

static int pin_state(sublet_client *c, struct pin_state *s) {
  char *json = NULL;
  int rc = sublet_status_json(c, &json);

  if (rc != 0)
    return rc;
  s->host_bytes = field(json, "\"host_bytes\": ");
  s->pinning = strstr(json, "\"pin\": null") == NULL;
  s->target = s->pinning ? field(json, "\"target_bytes\": ") : 0;
  s->done = s->pinning ? field(json, "\"done_bytes\": ") : 0;
  sublet_string_free(json);
  return 0;
}

/* Waits (up to seconds) for no pin to run and want bytes pinned (a Lend's pin may not have
 * begun when its reply comes); its last state in *s. */
static int pin_settled(sublet_client *c, struct pin_state *s, uint64_t want, double seconds) {
  double end = sl_test_now() + seconds;

  while (pin_state(c, s) == 0 && (s->pinning || s->host_bytes < want) && sl_test_now() < end)
    usleep(20000);
  return s->pinning ? -1 : 0;
}

/* A client of the daemon and a region of REGION bytes, filled (NULL: could not). */
static sublet_region *open_region(const struct sl_test_daemon *d, sublet_client **c) {
  sublet_region *r = NULL;

  if (sublet_connect(d->socket, c) != 0 || sublet_region_create(*c, REGION, &r) != 0)
    return NULL;
  memset(sublet_region_addr(r), 0x5A, REGION);
  return r;
}

/* A Lend of r keeping its first keep bytes. */
static int lend_first(sublet_region *r, uint64_t keep, uint64_t *loan,
                      uint8_t token[SUBLET_TOKEN_SIZE]) {
  struct sublet_range k = {0, keep};

  return sublet_lend(r, &k, 1, 0, NULL, loan, token);
}

/* Every byte of r as open_region wrote it (sampled a page of 4 KiB apart). */
static void check_bits(sublet_region *r) {
  for (uint64_t i = 0; i < REGION; i += 4096)
    CHECK(((uint8_t *)sublet_region_addr(r))[i] == 0x5A);
}

/* A borrower of the loan takes 64 MiB of its kept pages (no free memory beside the region):
 * *took is how long that took, its save included; *b and *p (NULL: not had) for end_loan. */
static void save_64m(const struct sl_test_daemon *d, uint64_t loan,
                     const uint8_t token[SUBLET_TOKEN_SIZE], sublet_client **b, void **p,
                     double *took) {
  double t0;

  *p = NULL;
  *took = 0;
  CHECK_RC(sublet_connect(d->socket, b), 0);
  CHECK_RC(sublet_borrow(*b, loan, token, NULL, 0), 0);
  t0 = sl_test_now();
  CHECK_RC(sublet_alloc(*b, 64ull << 20, p), 0);
  *took = sl_test_now() - t0;
}

/* The borrower writes over what it took and returns; the owner reclaims: every kept bit is
 * back. */
static void end_loan(sublet_client *c, sublet_region *r, sublet_client *b, void *p,
                     uint64_t loan) {
  struct sublet_loan_stats st;

  if (p != NULL) {
    memset(p, 0xEE, 64ull << 20);
    CHECK_RC(sublet_free(b, p), 0);
  }
  CHECK_RC(sublet_return(b, 0, NULL, NULL, 0, NULL), 0);
  CHECK_RC(sublet_reclaim(c, loan, -1, &st), 0);
  check_bits(r);
  sublet_disconnect(b);
}

static void test_lend_pins_ahead_up_to_its_kept_bytes(void) {
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c;
  sublet_region *r;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan;

  CHECK(sl_test_daemon_start(&d, PAGE, REGION + PIECE) == 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(lend_first(r, 3 * PIECE - PAGE, &loan, token), 0); /* 3 pieces, the last not full */
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(s.pinning && s.target == 3 * PIECE && s.done < s.target); /* at the Lend, running */
  CHECK(pin_settled(c, &s, 0, 10) == 0);
  CHECK(s.host_bytes == 3 * PIECE); /* the kept bytes, in whole pieces: nothing past them */
  CHECK_RC(sublet_withdraw(c, loan), 0);
  CHECK_RC(lend_first(r, PIECE, &loan, token), 0); /* less kept: nothing more to pin */
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(!s.pinning && s.host_bytes == 3 * PIECE);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* The borrower takes 64 MiB of kept pages (no free memory beside the region): their save
 * needs the first piece only, so it is answered while the pin goes on (a piece takes a
 * quarter of the whole pin here): Status.pin, read after the save, still runs. */
static void test_first_save_waits_for_its_pieces_only(void) {
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c, *b = NULL;
  sublet_region *r;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan;
  void *p;
  double took;

  CHECK(sl_test_daemon_start(&d, PAGE, REGION) == 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(lend_first(r, REGION, &loan, token), 0);
  save_64m(&d, loan, token, &b, &p, &took);
  CHECK_RC(pin_state(c, &s), 0);
  fprintf(stderr, "  first save of 64 MiB: %.3f s; pin %llu of %llu MiB\n", took,
          (unsigned long long)(s.done >> 20), (unsigned long long)(s.target >> 20));
  CHECK(s.pinning && s.done < s.target); /* the save did not wait for the whole pin */
  end_loan(c, r, b, p, loan);
  CHECK(pin_settled(c, &s, REGION, 10) == 0 && s.host_bytes == REGION);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* PinAhead before the first Lend: the pin runs at once; once it is done, the first save of
 * a loan that keeps everything (64 MiB of kept pages taken, no free memory beside the region)
 * pins nothing on its path (no pin runs, and the pinned bytes stay as they were), and every
 * kept bit comes back. */
static void test_pin_ahead_before_the_first_lend(void) {
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c, *b = NULL;
  sublet_region *r;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan;
  void *p;
  double took;

  CHECK(sl_test_daemon_start(&d, PAGE, REGION) == 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(sublet_pin_ahead(c, REGION, 0), 0);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(s.pinning && s.target == REGION);
  CHECK(pin_settled(c, &s, REGION, 10) == 0 && s.host_bytes == REGION);
  CHECK_RC(lend_first(r, REGION, &loan, token), 0); /* all kept, no free memory */
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(!s.pinning); /* the Lend's kept bytes are pinned already */
  save_64m(&d, loan, token, &b, &p, &took);
  fprintf(stderr, "  first save of 64 MiB after a pin ahead: %.3f s\n", took);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(!s.pinning && s.host_bytes == REGION);
  end_loan(c, r, b, p, loan);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(s.host_bytes == REGION);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* A pin ahead reaches no further than the user's regions, and needs one. */
static void test_pin_ahead_is_bounded_by_the_users_regions(void) {
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c, *lone = NULL;
  sublet_region *r;

  CHECK(sl_test_daemon_start(&d, PAGE, 2 * REGION) == 0);
  CHECK_RC(sublet_connect(d.socket, &lone), 0);
  CHECK_RC(sublet_pin_ahead(lone, PIECE, 0), SUBLET_ENOENT);
  CHECK(strstr(sublet_last_error(), "no region") != NULL);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(sublet_pin_ahead(c, 100 * REGION, 0), 0);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(s.pinning && s.target == REGION);
  CHECK(pin_settled(c, &s, REGION, 10) == 0 && s.host_bytes == REGION);
  CHECK_RC(sublet_pin_ahead(lone, PIECE, 0), 0); /* the same user: c's region counts */
  sublet_disconnect(lone);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* A daemon's first release of a region, saving 64 MiB of kept bytes to the host (stay 0),
 * after a PinAhead for releases (pin) or not; *took its seconds. Every bit comes back, and
 * the area is a spare again, pinned. */
static void first_release(int pin, double *took) {
  const struct sublet_range keep = {0, 64ull << 20};
  struct sl_test_daemon d;
  struct pin_state s;
  struct sublet_release_stats st;
  sublet_client *c;
  sublet_region *r;
  uint64_t rel;
  double t0;

  *took = 0;
  CHECK(sl_test_daemon_start(&d, PAGE, REGION) == 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  if (pin) {
    CHECK_RC(sublet_pin_ahead(c, keep.length, SUBLET_PIN_RELEASE), 0);
    CHECK_RC(pin_state(c, &s), 0);
    CHECK(s.pinning && s.target == PIECE);
    CHECK(pin_settled(c, &s, PIECE, 10) == 0 && s.host_bytes == PIECE);
  }
  t0 = sl_test_now();
  CHECK_RC(sublet_release(r, NULL, 0, &keep, 1, 0, 0, &rel, &st), 0);
  *took = sl_test_now() - t0;
  CHECK(st.copied_out_bytes == keep.length);
  CHECK_RC(pin_state(c, &s), 0);
  if (pin) /* it took the spare: nothing pinned beside it, no pin running */
    CHECK(!s.pinning && s.host_bytes == PIECE);
  CHECK_RC(sublet_resume(r, rel, 0, &st), 0);
  for (uint64_t i = 0; i < keep.length; i += 4096)
    CHECK(((uint8_t *)sublet_region_addr(r))[i] == 0x5A);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(!s.pinning && s.host_bytes == PIECE); /* a spare, for the next release */
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* PinAhead for releases: the first release takes the spare pinned for it and pins nothing on
 * its path (first_release checks the pinned bytes it leaves), where without it the release
 * pins a piece first. The time that saves is printed, not asserted: it is a benchmark's
 * figure, and a loaded machine's copies blur it. */
static void test_pin_ahead_for_the_first_release(void) {
  double cold, ahead;

  first_release(0, &cold);
  first_release(1, &ahead);
  fprintf(stderr, "  first release saving 64 MiB: %.3f s, after a pin ahead %.3f s\n", cold,
          ahead);
}

/* --pin-keep: once the user has no region, its areas go (the loans' and the spare pinned for
 * its releases); while one is back, they stay. */
static void test_area_released_after_last_region(void) {
  static const char *const keep[] = {"--pin-keep", "1", NULL};
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c, *watch = NULL;
  sublet_region *r;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan;
  double t0;

  CHECK(sl_test_daemon_start_ex(&d, PAGE, REGION, &(struct sl_test_daemon_opts){.args = keep})
        == 0);
  CHECK_RC(sublet_connect(d.socket, &watch), 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(lend_first(r, PIECE, &loan, token), 0);
  CHECK(pin_settled(watch, &s, PIECE, 10) == 0 && s.host_bytes == PIECE);
  CHECK_RC(sublet_withdraw(c, loan), 0);
  CHECK_RC(sublet_pin_ahead(c, PIECE, SUBLET_PIN_RELEASE), 0); /* and a spare for releases */
  CHECK(pin_settled(watch, &s, 2 * PIECE, 10) == 0 && s.host_bytes == 2 * PIECE);
  usleep(500000);
  CHECK_RC(pin_state(watch, &s), 0);
  CHECK(s.host_bytes == 2 * PIECE); /* a region is left: kept between loans */
  t0 = sl_test_now();
  sublet_disconnect(c);         /* its regions go with it */
  CHECK_RC(pin_state(watch, &s), 0);
  if (sl_test_now() - t0 < 0.8) /* else a slow machine's disconnect took the time */
    CHECK(s.host_bytes == 2 * PIECE); /* not yet: --pin-keep */
  t0 = sl_test_now(); /* --pin-keep's second passes: the areas go (60 s: a hang guard) */
  while (pin_state(watch, &s) == 0 && s.host_bytes != 0 && sl_test_now() - t0 < 60.0)
    usleep(50000);
  CHECK(s.host_bytes == 0);
  sublet_disconnect(watch);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* --pin pins at start and keeps it: a Lend within it pins nothing, one past it the rest. */
static void test_pin_option_still_works(void) {
  static const char *const pin[] = {"--pin", "512M", "--pin-keep", "0", NULL};
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c;
  sublet_region *r;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan;

  CHECK(sl_test_daemon_start_ex(&d, PAGE, REGION, &(struct sl_test_daemon_opts){.args = pin})
        == 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(lend_first(r, PIECE, &loan, token), 0);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(!s.pinning && s.host_bytes == 2 * PIECE);
  CHECK_RC(sublet_withdraw(c, loan), 0);
  CHECK_RC(lend_first(r, 3 * PIECE, &loan, token), 0);
  CHECK(pin_settled(c, &s, 3 * PIECE, 10) == 0 && s.host_bytes == 3 * PIECE);
  sublet_disconnect(c);
  usleep(200000);
  CHECK_RC(sublet_connect(d.socket, &c), 0);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(s.host_bytes == 3 * PIECE); /* --pin's area stays */
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

/* The bytes the daemon's log (fd) last says its pin ahead held pinned ("pinned 768.0 MiB of
 * the save area ahead in 1.50 s: 768.0 MiB pinned"); UINT64_MAX when it says nothing of it. */
static uint64_t pinned_in_log(int fd) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  char text[1 << 16], unit[8], *at, *last = NULL;
  ssize_t n = pread(fd, text, sizeof(text) - 1, 0);
  double v;

  text[n > 0 ? n : 0] = '\0';
  for (at = text; (at = strstr(at, "of the save area ahead in ")) != NULL; at++)
    last = at;
  if (last == NULL || (last = strstr(last, "s: ")) == NULL ||
      sscanf(last + 3, "%lf %7s", &v, unit) != 2)
    return UINT64_MAX;
  for (int u = 0; u < 5; u++, v *= 1024)
    if (strcmp(unit, units[u]) == 0)
      return (uint64_t)v;
  return UINT64_MAX;
}

/* A daemon stopped in the middle of a pin ahead stops after the piece in progress, not at the
 * end of the pin: its log's last word on the pin counts less than the region pinned. */
static void test_stop_during_pin(void) {
  char log[] = "/tmp/sublet-test-pin-log-XXXXXX";
  const char *level = getenv("SUBLET_TEST_LOG");
  struct sl_test_daemon d;
  struct pin_state s;
  sublet_client *c;
  sublet_region *r;
  uint8_t token[SUBLET_TOKEN_SIZE];
  uint64_t loan, pinned;
  int fd = mkstemp(log), err = dup(2), rc;

  CHECK(fd >= 0 && err >= 0);
  unlink(log);
  setenv("SUBLET_TEST_LOG", "info", 1); /* the daemon's log (stderr) into fd: it says the pin */
  dup2(fd, 2);
  rc = sl_test_daemon_start(&d, PAGE, REGION);
  dup2(err, 2);
  close(err);
  if (level != NULL)
    setenv("SUBLET_TEST_LOG", level, 1);
  else
    unsetenv("SUBLET_TEST_LOG");
  CHECK(rc == 0);
  CHECK((r = open_region(&d, &c)) != NULL);
  CHECK_RC(lend_first(r, REGION, &loan, token), 0);
  CHECK_RC(pin_state(c, &s), 0);
  CHECK(s.pinning);
  sublet_disconnect(c);
  CHECK(sl_test_daemon_stop(&d) == 0);
  pinned = pinned_in_log(fd);
  fprintf(stderr, "  stopped with %llu MiB of %llu pinned\n", (unsigned long long)(pinned >> 20),
          (unsigned long long)(REGION >> 20));
  CHECK(pinned < REGION);
  close(fd);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  setenv("SUBLET_MEMFD_PIN", PIN_PACE, 1);
  sl_test_run("a lend pins ahead up to its kept bytes", test_lend_pins_ahead_up_to_its_kept_bytes);
  sl_test_run("the first save waits for its pieces only", test_first_save_waits_for_its_pieces_only);
  sl_test_run("a pin ahead before the first lend", test_pin_ahead_before_the_first_lend);
  sl_test_run("a pin ahead for the first release", test_pin_ahead_for_the_first_release);
  sl_test_run("a pin ahead is bounded by the user's regions",
              test_pin_ahead_is_bounded_by_the_users_regions);
  sl_test_run("the area goes after the last region", test_area_released_after_last_region);
  sl_test_run("--pin still works", test_pin_option_still_works);
  sl_test_run("a stop during a pin", test_stop_during_pin);
  return sl_test_summary("pin");
}
