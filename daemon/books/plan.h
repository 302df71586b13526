/* plan.h - where a loan's kept bytes go when the borrower reaches kept pages. Plain C: no I/O,
 * no device, part of the books (books.c owns one plan per loan).
 *
 * The borrower takes the kept zone of the window in order, a prefix [0, to) at a time. Before
 * a kept page is handed out, its kept bytes must leave it. They go, cheapest first,
 *
 *   1. device to device, into the unkept bytes ("holes") of kept pages the borrower does not
 *      hold and will reach last: holes are filled from the last kept page downwards, so the
 *      bytes of early pages sit in late pages, and every byte moves once (and back once);
 *   2. to host memory, only what no hole that stays unlent can take: once the holes above the
 *      lent prefix are full, and for pages that hold moved bytes when they are reached (their
 *      own kept bytes and the moved ones, merged: dense pages copy in long pieces).
 *
 * So with B kept bytes in K kept pages of P bytes, the first K - ceil(B / P) kept pages cost
 * no host copy at all, and reaching every page copies exactly B bytes to the host.
 *
 * The plan keeps every move and every save, in order: ending the loan copies the saves back
 * (host to device) first, which also brings moved bytes back into their holes, then runs the
 * moves backwards (destination to source). Moves never overlap one another or any save's
 * device bytes, so each list may run in any order, as one batch.
 *
 * Like the books: sl_plan_reach() computes a step without changing the plan; the daemon does
 * the step's device work (moves first, then saves: a save may read bytes a move just wrote),
 * then sl_plan_commit() records it. Functions return 0 or SUBLET_ENOMEM.
 */
#ifndef SL_PLAN_H
#define SL_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "device.h" /* struct sl_copy, struct sl_move */
#include "sublet.h" /* struct sublet_range */

struct sl_plan {
  uint64_t page_size;
  const struct sublet_range *keep; /* the loan's merged keep ranges (the loan owns them) */
  size_t nkeep;
  const uint64_t *pages;           /* kept zone index -> region page, ascending (the loan's) */
  uint64_t npages;
  int compact;                     /* 0: nothing moves, every kept byte is saved */
  uint64_t reached;                /* kept zone indices [0, reached) have been handed out */
  uint64_t sink, sink_off;         /* the next hole to fill: kept zone index, offset in page;
                                      sink == npages: none filled yet (start at the last) */
  struct sl_move *moves;           /* in order: sink pages descend, offsets ascend in each */
  size_t nmoves, cap_moves;
  uint64_t moved_bytes;
  struct sl_copy *saves;           /* host offsets ascend from 0 without gaps */
  size_t nsaves, cap_saves;
  uint64_t saved_bytes;
};

/* What handing out kept zone indices [from, to) takes. Owns its arrays. */
struct sl_plan_step {
  uint64_t from, to;
  struct sl_move *moves;
  size_t nmoves;
  uint64_t moved_bytes;
  struct sl_copy *saves;           /* host_off continues from the plan's saved_bytes */
  size_t nsaves;
  uint64_t saved_bytes;
  uint64_t sink, sink_off;         /* the cursor after the step */
};

void sl_plan_init(struct sl_plan *p, uint64_t page_size, const struct sublet_range *keep,
                  size_t nkeep, const uint64_t *pages, uint64_t npages, int compact);
void sl_plan_release(struct sl_plan *p);
/* from must be p->reached and to in (from, npages]. */
int sl_plan_reach(const struct sl_plan *p, uint64_t from, uint64_t to, struct sl_plan_step *s);
/* Kept bytes of kept zone index i, for pages visited in ascending order: *k is the first keep
 * range ending after the last page's start (sl_plan_keep_after for the first one, or 0), and
 * is walked forward to page i's. */
uint64_t sl_plan_page_kept(const struct sl_plan *p, uint64_t i, size_t *k);
/* 1 when handing out kept zone indices [from, to) must save bytes to the host whatever the
 * plan did before: their kept bytes outweigh every hole of the pages above them (or nothing
 * moves). 0 says only that the reach may not save. One pass over the pages and keep ranges:
 * cheaper than computing the step with sl_plan_reach to throw it away when it saves. */
int sl_plan_must_save(const struct sl_plan *p, uint64_t from, uint64_t to);
/* Records the step (it must be the plan's current one); on ENOMEM nothing changes. */
int sl_plan_commit(struct sl_plan *p, const struct sl_plan_step *s);
void sl_plan_step_clear(struct sl_plan_step *s);
/* What undoes the plan's committed steps: the saves to copy back (host to device) first, which
 * also brings moved bytes back into their holes, then the moves backwards (destination to
 * source). Arrays malloc'd (NULL when empty), the caller's; SUBLET_ENOHOSTMEM. */
int sl_plan_undo(const struct sl_plan *p, struct sl_copy **restore, size_t *nrestore,
                 struct sl_move **unmove, size_t *nunmove);
/* The first merged keep range ending after region byte off (nkeep: none). */
size_t sl_plan_keep_after(const struct sl_plan *p, uint64_t off);

#endif
