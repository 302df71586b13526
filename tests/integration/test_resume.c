/* test_resume.c - the early resume by hand (daemon/releases.c; PROTOCOL.md, Releases): Resume
 * with early set is answered once the pages are made, the release is "restoring" until its
 * owner's ResumeEnd, and what a careless or hostile client sends around that gets a typed
 * error. Against a real subletd on the memfd backend, --check on (the books are checked after
 * every request, and a stop after a leak would not be clean).
 *
 * libsublet takes the early path on every grouped resume, so the release tests (here, in
 * Python and on the GPU) check its bytes; this file checks the protocol around it.
 */
#include <unistd.h>

#include "harness.h"
#include "raw.h"
#include "sublet.h"

#define PAGE (64u * 1024)
#define PAGES 8

static Sublet__Reply *ask(int fd, struct sl_wire_rx *rx, Sublet__Request *req) {
  return sl_raw_send(fd, req, NULL, 0) == 0 ? sl_raw_reply(fd, rx, 5000) : NULL;
}

static int code_of(Sublet__Reply *rep) {
  return rep == NULL ? 1 : rep->body_case == SUBLET__REPLY__BODY_ERROR ? rep->error->code : 0;
}

/* Releases every page of region, every byte kept (all of it saved): the release's id, or 0. */
static uint64_t release_all(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t region) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Lend m = SUBLET__LEND__INIT;
  Sublet__Reply *rep;
  uint64_t rel = 0;

  m.region = region;
  m.has_keep_all = m.keep_all = 1;
  m.has_release = m.release = 1;
  m.has_stay_pages = 1;
  m.stay_pages = 0;
  req.id = id;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &m;
  rep = ask(fd, rx, &req);
  if (rep != NULL && rep->body_case == SUBLET__REPLY__BODY_RELEASED &&
      rep->released->released_pages == PAGES)
    rel = rep->released->release;
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rel;
}

static Sublet__Reply *resume(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t rel,
                             int early) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Resume m = SUBLET__RESUME__INIT;

  m.release = rel;
  m.has_groups = m.groups = 1;
  m.has_early = 1;
  m.early = early;
  req.id = id;
  req.body_case = SUBLET__REQUEST__BODY_RESUME;
  req.resume = &m;
  return ask(fd, rx, &req);
}

/* Sends ResumeEnd of release rel: 0, or a negative code. */
static int send_end(int fd, uint64_t id, uint64_t rel) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__ResumeEnd m = SUBLET__RESUME_END__INIT;

  m.release = rel;
  req.id = id;
  req.body_case = SUBLET__REQUEST__BODY_RESUME_END;
  req.resume_end = &m;
  return sl_raw_send(fd, &req, NULL, 0);
}

static Sublet__Reply *resume_end(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t rel) {
  return send_end(fd, id, rel) == 0 ? sl_raw_reply(fd, rx, 5000) : NULL;
}

/* The error code of a ResumeEnd (0: answered Resumed). */
static int end_code(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t rel) {
  Sublet__Reply *rep = resume_end(fd, rx, id, rel);
  int code = code_of(rep);

  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return code;
}

/* The early Resumed names the pages and nothing of the copies; the restoring release refuses
 * a second Resume and another client's end; the end carries the copies; then it is over. */
static void test_early_resume_by_hand(void) {
  struct sl_test_daemon d;
  struct sl_wire_rx rx, rx2;
  Sublet__Reply *rep;
  uint64_t region, rel;
  int a, b;

  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  a = sl_raw_open(d.socket, &rx);
  b = sl_raw_open(d.socket, &rx2);
  CHECK(a >= 0 && b >= 0);
  CHECK((region = sl_raw_region(a, &rx, 2, PAGES * PAGE)) != 0);
  CHECK((rel = release_all(a, &rx, 3, region)) != 0);
  CHECK(end_code(a, &rx, 4, rel) == SUBLET_EBUSY);   /* released, not restoring */
  CHECK(end_code(a, &rx, 5, 77) == SUBLET_ENOENT);   /* no such release */

  rep = resume(a, &rx, 6, rel, 1);
  CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_RESUMED);
  CHECK(rep->resumed->n_groups >= 2 && !rep->resumed->has_copied_in_bytes &&
        !rep->resumed->has_restored);
  sublet__reply__free_unpacked(rep, NULL);
  rep = resume(a, &rx, 7, rel, 1);
  CHECK(code_of(rep) == SUBLET_EBUSY);               /* restoring already */
  sublet__reply__free_unpacked(rep, NULL);
  CHECK(end_code(b, &rx2, 2, rel) == SUBLET_EPERM);  /* not b's release */

  rep = resume_end(a, &rx, 8, rel);
  CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_RESUMED);
  CHECK(rep->resumed->has_restored && rep->resumed->restored &&
        rep->resumed->copied_in_bytes == PAGES * PAGE);
  sublet__reply__free_unpacked(rep, NULL);
  CHECK(end_code(a, &rx, 9, rel) == SUBLET_ENOENT);  /* over */

  rep = resume(a, &rx, 11, release_all(a, &rx, 10, region), 0); /* not early: one answer */
  CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_RESUMED &&
        rep->resumed->restored && rep->resumed->copied_in_bytes == PAGES * PAGE);
  sublet__reply__free_unpacked(rep, NULL);
  close(a);
  close(b);
  sl_wire_rx_destroy(&rx);
  sl_wire_rx_destroy(&rx2);
  CHECK(sl_test_daemon_stop(&d) == 0);
}

static uint64_t free_bytes(const char *socket) {
  sublet_client *c = NULL;
  struct sublet_info info = {0};

  if (sublet_connect(socket, &c) == 0)
    sublet_get_info(c, &info);
  if (c != NULL)
    sublet_disconnect(c);
  return info.free_bytes;
}

/* An owner that goes between the early Resumed and its end, or after asking for it: its
 * region, release and save area go with it, and every page comes back to the device. */
static void test_owner_gone_while_restoring(void) {
  struct sl_test_daemon d;
  struct sl_wire_rx rx;
  Sublet__Reply *rep;
  uint64_t region, rel, total;

  CHECK(sl_test_daemon_start(&d, PAGE, 64 * PAGE) == 0);
  total = free_bytes(d.socket);
  for (int ask_end = 0; ask_end < 2; ask_end++) {
    int a = sl_raw_open(d.socket, &rx);
    CHECK(a >= 0);
    CHECK((region = sl_raw_region(a, &rx, 2, PAGES * PAGE)) != 0);
    CHECK((rel = release_all(a, &rx, 3, region)) != 0);
    rep = resume(a, &rx, 4, rel, 1);
    CHECK(rep != NULL && rep->body_case == SUBLET__REPLY__BODY_RESUMED);
    sublet__reply__free_unpacked(rep, NULL);
    if (ask_end) /* sent, its answer never read */
      CHECK(send_end(a, 5, rel) == 0);
    close(a);
    sl_wire_rx_destroy(&rx);
    CHECK_UNTIL(free_bytes(d.socket) == total); /* back once the daemon has seen a go */
  }
  CHECK(sl_test_daemon_stop(&d) == 0);
}

int main(void) {
  sl_test_run("early resume by hand", test_early_resume_by_hand);
  sl_test_run("owner gone while restoring", test_owner_gone_while_restoring);
  return sl_test_summary("test_resume");
}
