/* books_fixtures.h - what the books' unit tests share (test_books.c, test_books_release.c,
 * test_books_need.c and the reference model, books_model.c): a client as the daemon adds one,
 * a loan's info, a release planned from a keep list, the tokens. Checked with check.h, whose
 * tally they share (books_fixtures.c counts into the test's own).
 */
#ifndef SL_TEST_BOOKS_FIXTURES_H
#define SL_TEST_BOOKS_FIXTURES_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "books.h"

/* A loan's token, and one that differs from it in the last byte. */
extern const uint8_t TOKEN[16], WRONG[16];

/* The daemon's --allow-group: the daemon marks the peers in it (and root) as trusted.
 * (gid_t)-1: none. */
extern gid_t allow_gid;

/* A client of uid and gid, trusted as the daemon would mark it (root, or allow_gid's). */
uint64_t client(struct sl_books *b, uid_t uid, gid_t gid);

/* The loan's info (checked to be there). */
struct sl_loan_info info(const struct sl_books *b, uint64_t loan);

/* Releases region rid's pages outside `pinned` ((first, count) pairs), keeping keep[0..n),
 * by `need` when not NULL: the draft as the daemon makes it, then the release's begin. */
int release(struct sl_books *b, uint64_t owner, uint64_t rid, const struct sublet_range *keep,
            size_t n, const uint64_t *pinned, size_t npinned, uint64_t stay,
            const struct sl_release_need *need, struct sl_release_work *w, struct sl_err *err);

#endif
