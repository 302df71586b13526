/* books_fixtures.c - the books' unit tests' shared fixtures (the contract is books_fixtures.h). */
#define SL_CHECK_SHARED /* the checks count into the test's tally */
#include "books_fixtures.h"

#include <string.h>

#include "check.h"
#include "grow.h"

const uint8_t TOKEN[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
const uint8_t WRONG[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 17};

gid_t allow_gid = (gid_t)-1;

uint64_t client(struct sl_books *b, uid_t uid, gid_t gid) {
  struct sl_peer peer = {.pid = 100 + (pid_t)uid, .uid = uid, .gid = gid,
                         .trusted = uid == 0 || (allow_gid != (gid_t)-1 && gid == allow_gid)};
  uint64_t id = 0;

  CHECK_EQ(sl_books_client_add(b, &peer, &id), 0);
  return id;
}

struct sl_loan_info info(const struct sl_books *b, uint64_t loan) {
  struct sl_loan_info li;

  memset(&li, 0, sizeof(li));
  CHECK_EQ(sl_books_loan_info(b, loan, &li), 0);
  return li;
}

int release(struct sl_books *b, uint64_t owner, uint64_t rid, const struct sublet_range *keep,
            size_t n, const uint64_t *pinned, size_t npinned, uint64_t stay,
            const struct sl_release_need *need, struct sl_release_work *w, struct sl_err *err) {
  struct sl_region_info ri;
  struct sl_loan *draft = NULL;
  uint64_t npages = 1, ps = sl_books_cfg(b)->page_size;
  int rc;

  if (sl_books_region_info(b, rid, &ri) == 0) {
    npages = ri.npages;
  } else { /* a region not there: a draft as large as the keep and the pins reach, so that the
            * begin is what refuses it */
    for (size_t i = 0; i < n; i++)
      npages = sl_max_u64(npages, (keep[i].offset + keep[i].length + ps - 1) / ps);
    for (size_t i = 0; i + 1 < 2 * npinned; i += 2)
      npages = sl_max_u64(npages, pinned[i] + pinned[i + 1]);
  }
  rc = sl_books_draft(sl_books_cfg(b), npages, keep, n, 0, pinned, npinned, &draft, err);
  if (rc == 0 && (rc = sl_books_release_begin(b, owner, rid, draft, stay, need, w, err)) != 0)
    sl_books_draft_free(draft);
  return rc;
}
