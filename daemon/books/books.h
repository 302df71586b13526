/* books.h - subletd's ledger: clients, regions, loans and allocations. Plain C: no I/O, no
 * device, no clock, so that every path can be unit-tested exhaustively on any machine.
 *
 * The floor: daemon/books/ is the bottom floor of subletd, and calls nothing of the daemon above
 * it. Its files (books.c, books_alloc.c, books_release.c, books_space.c, kept.c, check.c over
 * the family's private books_impl.h; plan.c over plan.h; grow.h's array helpers, which the pool
 * shares) are pure C: they call the C library and common/error.c's sl_err_set and
 * sl_format_size, and include no header of daemon/ (no libuv, no pool, no transport, no
 * handlers). The daemon calls down into the books through books.h (and plan.h); the books never
 * call up. tests/unit/test_books*.c and tests/fuzz/fuzz_books.c drive them alone (sl_books).
 *
 * Vocabulary
 *   page      the unit of lending: info.page_size bytes (2 MiB on an H200), one device handle.
 *   region    the memory of one tensor: npages pages, made by its owner client.
 *   loan      a region lent with a set of kept byte ranges. A page is kept when any kept byte
 *             lies in it. One loan per device at a time. Lend makes it OFFERED; a borrower (the
 *             owner's own client, or another client holding the token) makes it ACTIVE.
 *   pinned    a page of the region the loan never touches (Lend.pinned): the owner keeps using
 *             it during the loan. Not in the window, never granted, moved into, saved or
 *             restored; no kept byte may lie in one. So U + K = npages - pinned pages.
 *   window    the loan's pages in lending order, which is also the order of the borrower's
 *             address window: positions [0, U) are the unkept pages (ascending region index),
 *             [U, U+F) fresh pages from free device memory, [U+F, U+F+K) the kept pages
 *             (ascending). F is fixed when the loan is borrowed.
 *   in order  the window most loans get: no unkept zone, and the kept zone is every page of
 *             the region (less a pinned tail) in the region's own order, whether it holds kept
 *             bytes or not. Its pages are then where the region's own mapping has them, so the
 *             owner's process maps nothing for it, ever, and another process keeps its window
 *             from one loan to the next whatever the keep (window.h). The kept zone is handed
 *             out from its first page up while the plan can move the pages' kept bytes into
 *             holes of pages not reached (GPU moves: about 1.6 TB/s, where mapping a page
 *             costs what moving 30 MiB would), then the fresh zone from its top down, then
 *             the kept zone on, saving to the host what no hole can take. Not in order: a
 *             loan with --no-compact (it moves nothing, so pages without kept bytes must come
 *             first), pinned pages other than a tail, and a keep of the region's head only
 *             (its unkept tail is served in place as it is).
 *   alloc     a contiguous run of window positions: first fit among the positions handed out
 *             already, [lo, hwm), else that span grows by one run at its top (kept pages
 *             reached: moved or saved) or, in order, at its bottom (fresh), whichever saves
 *             fewer bytes to the host, the top on ties. So the positions ever handed out are
 *             always one span: [0, hwm) for a window not in order, [lo, hwm) around the fresh
 *             zone's top for one in order. A run may need one new fresh chunk (one device
 *             handle for all its fresh pages) and may reach kept pages, whose kept bytes are
 *             moved or saved before the allocation is granted.
 *
 * Fresh pages for the owner: a borrower gets fds of the pages it is granted, and an fd cannot be
 * revoked. When the borrower is another user than the owner, the loan's end (sl_loan_end's
 * replace) gives every page it was granted a new page, and the old ones are never the owner's
 * again; a borrower of the owner's own user costs nothing of the kind. The books plan it (the
 * list), the daemon does it, sl_books_pages_replaced() commits it.
 *
 * Two-phase allocation: sl_books_alloc_plan() computes a grant without changing anything; the
 * daemon does the device work it names (create the chunk, move, then save the kept bytes: off
 * the event loop, with the grant held by sl_books_alloc_hold() meanwhile) and then calls
 * sl_books_alloc_commit() if it succeeded; either way it then frees the grant with
 * sl_grant_clear().
 *
 * Functions return 0 or a negative SUBLET_E* code with a message in err (may be NULL).
 * Ids are never reused. Arrays inside plans are owned by the plan; *_clear() frees them.
 */
#ifndef SL_BOOKS_H
#define SL_BOOKS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "device.h" /* struct sl_copy only */
#include "error.h"
#include "sublet.h"

/* A loan's name and its NUL: 1 to 63 bytes of UTF-8 (LoanName in sublet.proto). */
#define SL_LOAN_NAME_SIZE 64

struct sl_books;

enum sl_source { SL_SRC_UNKEPT = 0, SL_SRC_FRESH = 1, SL_SRC_KEPT = 2 };
enum sl_loan_state { SL_LOAN_OFFERED = 1, SL_LOAN_ACTIVE = 2, SL_LOAN_DRAINING = 3 };

struct sl_peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
  int trusted;              /* root, or in the group of --allow-group (as its primary or a
                               supplementary group: the daemon looks when it accepts): may
                               borrow any user's loan and see every user's regions */
};

/* Whether peer may reach what belongs to user uid (see it in status, borrow its loan, take
 * its release offer): its own user's, or anyone's when trusted. The one place this rule is
 * written. */
static inline int sl_peer_reaches(const struct sl_peer *peer, uid_t uid) {
  return peer->trusted || peer->uid == uid;
}

/* A user's regions may reserve this many times the device's memory of subletd's address space
 * (issue 41). A user never holds more than the device at once; a growable region reserves at
 * most twice what it holds (its room doubles as it grows), and the rest is for regions whose
 * pages a release gave back, which keep their place. Without a bound, one user's regions could
 * take the daemon's address space from every other user's. */
#define SL_USER_SPACE_DEVICES 8

struct sl_books_config {
  uint64_t page_size;
  uint64_t device_pages;    /* the device's memory in pages: a growable region's room stops
                               there, and a user's regions may reserve SL_USER_SPACE_DEVICES
                               times it; 0: neither bound */
  int no_compact;           /* save every kept byte of a lent page to the host, move none */
  uint64_t fresh_give;      /* pages a region's fresh zone may stay above the free memory
                               offered at borrow (books.c: steady_fresh) */
};

/* A grant: what one allocation gets, and the device work that must happen before it. */
struct sl_grant {
  uint64_t loan_id;
  uint64_t alloc_id;
  uint64_t size;              /* bytes asked for */
  uint64_t pos, npages;       /* window positions [pos, pos+npages) */
  uint64_t fresh_chunk_id;    /* 0: no new chunk */
  uint64_t fresh_pos, fresh_npages; /* the new chunk backs these window positions */
  struct sl_move *move;       /* kept bytes to move first, device to device, into unkept bytes
                                 of kept pages that stay unlent (region offsets; plan.h) */
  size_t nmove;
  uint64_t move_bytes;
  struct sl_copy *save;       /* then kept bytes to save: dev_off is a region offset, host_off
                                 an offset into the loan's save area; coalesced */
  size_t nsave;
  uint64_t save_bytes;
  uint64_t kept_from, kept_to, sink, sink_off; /* the plan step, for commit */
  uint64_t served[3];         /* bytes of this grant from each source, by enum sl_source */
};

/* How a loan ends, as the device must carry it out. */
struct sl_loan_end {
  uint64_t loan_id;
  uint64_t region_id;
  uint64_t owner_client, borrower_client;
  uid_t borrower_uid;
  struct sl_copy *restore;    /* saved kept bytes to copy back first; empty when the owner is
                                 gone */
  size_t nrestore;
  struct sl_move *unmove;     /* then moved kept bytes to move back (region offsets) */
  size_t nunmove;
  uint64_t *fresh_chunks;     /* chunk ids to release */
  size_t nfresh;
  int free_region;            /* the owner is gone: release the region's pages too */
  uint64_t *replace;          /* the borrower is another user: these region pages (ascending:
                                 every page it was granted) get fresh pages before the restore,
                                 then sl_books_pages_replaced() */
  size_t nreplace;
  struct sublet_loan_stats stats;
};

/* What a client's disconnection leaves to do. */
struct sl_client_gone {
  uint64_t *free_regions;     /* gone: release their pages unless a keeper holds them; with
                                 the gone regions whose last holder this client was */
  size_t nfree_regions;
  uint64_t *draining_loans;   /* the client was their borrower: sl_books_loan_finish() each once
                                 the client's process has fully exited (its GPU work may still
                                 be in flight until then) */
  size_t ndraining;
};

struct sl_region_info {
  uint64_t id;
  uint64_t owner_client;
  struct sl_peer owner;
  uint64_t npages;
  int growable;               /* RegionCreate.growable */
  uint64_t loan_id;           /* 0: not lent */
  uint64_t pages_version;     /* bumped whenever some of its pages were replaced */
  int replacing;              /* its pages are being replaced (the last loan is ending) */
  uint64_t space;             /* pages of subletd's address space reserved for it (npages or
                                 more: a growable region's room; sl_books_region_space) */
};

struct sl_loan_info {
  uint64_t id;
  uint64_t region_id;
  enum sl_loan_state state;
  uint64_t owner_client, borrower_client;
  struct sl_peer borrower;
  char name[SL_LOAN_NAME_SIZE];
  uint64_t unkept_pages, fresh_pages, kept_pages; /* pages without kept bytes, F, pages with
                                 kept bytes (a window in order has them all in its kept zone:
                                 sl_books_loan_layout gives the zones) */
  uint64_t pinned_pages;      /* region pages in no window (Lend.pinned) */
  uint64_t kept_bytes;        /* all kept bytes of the region */
  uint64_t keep_ranges;       /* merged keep ranges */
  uint64_t lo, hwm;           /* window positions [lo, hwm) handed out so far */
  uint64_t live_allocs, live_bytes;
  uint64_t fresh_chunk_pages; /* fresh pages created so far */
  uint64_t layout_id;         /* names the layout (the region pages of positions, U and K) and
                                 the pages behind it: the next loan of the region gets the same
                                 id when its layout is the same and none of the region's pages
                                 was replaced in between, and no other loan ever does. So a
                                 borrower whose window has this id needs no layout sent. */
  int owner_gone;
  struct sublet_loan_stats stats;
};

/* A gone region's pages that a client still holds (kept windows, kept.c). */
struct sl_held_info {
  uint64_t region_id, npages;
  struct sl_peer owner;
  uint64_t holder_client;
  struct sl_peer holder;
};

struct sl_books_totals {
  uint64_t clients, regions, region_pages, loans;
  uint64_t loans_ended, borrowers_died;
  uint64_t copied_out_bytes, copied_in_bytes, moved_bytes;
  uint64_t served_bytes[3];
  uint64_t replaced_pages;    /* region pages replaced at the end of other users' loans */
  uint64_t retained_pages;    /* of those, the ones counted against borrowers still connected */
};

int sl_books_new(const struct sl_books_config *cfg, struct sl_books **out);
void sl_books_free(struct sl_books *b);

/* Clients */
int sl_books_client_add(struct sl_books *b, const struct sl_peer *peer, uint64_t *client_id);
int sl_books_client_remove(struct sl_books *b, uint64_t client_id, struct sl_client_gone *gone);
void sl_client_gone_clear(struct sl_client_gone *gone);

/* Regions */
int sl_books_region_add(struct sl_books *b, uint64_t client_id, uint64_t npages,
                        uint64_t *region_id, struct sl_err *err);
/* The same, growable or not. */
int sl_books_region_new(struct sl_books *b, uint64_t client_id, uint64_t npages, int growable,
                        uint64_t *region_id, struct sl_err *err);
/* A growable region of client_id's gets npages pages in all, more than it has (the daemon
 * checks them against the device first). Only its owner's, never while lent or while its last
 * loan's pages are being replaced, nor past its user's address space (sl_books_grow_space).
 * Its last layout goes: the next loan's layout id is new. may_grow: the same checks, changing
 * nothing (before the device work). */
int sl_books_may_grow(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                      uint64_t npages, struct sl_err *err);
int sl_books_region_grow(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                         uint64_t npages, struct sl_err *err);
/* Address space (books_space.c). A region reserves its pages of subletd's mapping when it is
 * made (new and add refuse past its user's bound: SUBLET_ENOMEM, naming it), and a growable
 * one more as it grows. grow_space: the pages a growth of region_id to npages pages reserves
 * in all: its own if they hold npages, else twice them (a move maps every page again: so a
 * region's moves map at most twice its final pages), at least npages, at most the device and
 * what its user's bound leaves. region_space: what is reserved for it now (set before the
 * device work, so that its user's other requests count it, and after, to what the pool has).
 * user_space: the pages uid's regions reserve (the gone ones whose pages a keeper holds too);
 * user_space_limit: the bound (0: none). */
uint64_t sl_books_grow_space(const struct sl_books *b, uint64_t region_id, uint64_t npages);
int sl_books_region_space(struct sl_books *b, uint64_t region_id, uint64_t space);
uint64_t sl_books_user_space(const struct sl_books *b, uid_t uid);
uint64_t sl_books_user_space_limit(const struct sl_books *b);
/* Only the owner, and only while not lent. */
int sl_books_region_remove(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           struct sl_err *err);
/* May client_id hold handles of this region's pages? Its owner, or the borrower of its loan. */
int sl_books_region_access(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           struct sl_err *err);
/* May client_id have fds of pages [first, first+count)? The owner may; the borrower only of
 * pages it was granted (window positions below hwm): a kept page is saved before it is
 * granted, and an fd, once sent, cannot be taken back. */
int sl_books_pages_granted(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           uint64_t first, uint64_t count, struct sl_err *err);
/* May pages [first, first+count) be sent as asked: with groups, one fd per group, the range
 * whole groups (EINVAL otherwise); without, one fd per page, no group of several pages in it
 * (EBUSY: the library is older than the daemon's groups). */
int sl_books_pages_as_groups(const struct sl_books *b, uint64_t region_id, uint64_t first,
                             uint64_t count, int groups, struct sl_err *err);
int sl_books_region_info(const struct sl_books *b, uint64_t region_id, struct sl_region_info *ri);
/* Iteration in id order: after = 0 gives the first; returns -ENOENT past the last. */
int sl_books_region_next(const struct sl_books *b, uint64_t after, struct sl_region_info *ri);

/* Lending, owner's side. keep: byte ranges within the region, in any order, may overlap; they
 * are sorted and merged. token: SUBLET_TOKEN_SIZE bytes chosen by the caller (random). */
int sl_books_lend(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                  const struct sublet_range *keep, size_t nkeep, int keep_all, const char *name,
                  const uint8_t token[SUBLET_TOKEN_SIZE], uint64_t *loan_id, struct sl_err *err);
/* The same with pinned pages: npinned (first, count) pairs of region pages, ascending,
 * disjoint, within the region, not every page; no kept byte in them (keep_all keeps every
 * byte of the other pages). */
int sl_books_lend_pinned(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                         const struct sublet_range *keep, size_t nkeep, int keep_all,
                         const uint64_t *pinned, size_t npinned, const char *name,
                         const uint8_t token[SUBLET_TOKEN_SIZE], uint64_t *loan_id,
                         struct sl_err *err);
/* The same in steps, so that a long keep list is worked out off the event loop. A draft:
 * the pinned pages and keep list checked, the keep sorted and merged, and the window's
 * layout for a region of npages pages; pure
 * (reads only its arguments: any thread may make one). may_lend: the checks that do not
 * depend on the device being free (the caller owns the region, which is not lent, and borrows
 * nothing), giving its npages. lend_draft: the loan enters the books (it checks everything
 * again) and takes the draft over; on failure the draft stays the caller's. */
struct sl_loan;
int sl_books_draft(const struct sl_books_config *cfg, uint64_t npages,
                   const struct sublet_range *keep, size_t nkeep, int keep_all,
                   const uint64_t *pinned, size_t npinned, struct sl_loan **draft,
                   struct sl_err *err);
void sl_books_draft_free(struct sl_loan *draft);
const struct sl_books_config *sl_books_cfg(const struct sl_books *b);
int sl_books_may_lend(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                      uint64_t *npages, struct sl_err *err);
int sl_books_lend_draft(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                        struct sl_loan *draft, const char *name,
                        const uint8_t token[SUBLET_TOKEN_SIZE], uint64_t *loan_id,
                        struct sl_err *err);
/* Withdraws a loan still OFFERED. */
int sl_books_withdraw(struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                      struct sl_err *err);
/* The loan a Reclaim may wait on: owner's loan that exists. */
int sl_books_loan_owned(const struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                        struct sl_err *err);

/* Borrowing. loan_id 0: by name, or the next offer when name is NULL or "". token NULL: only
 * the owner's own client. fresh_pages: how many pages of free memory the loan may take. */
int sl_books_borrow(struct sl_books *b, uint64_t client_id, uint64_t loan_id,
                    const uint8_t *token, const char *name, uint64_t fresh_pages,
                    uint64_t *borrowed_loan, struct sl_err *err);
/* The window's region pages: pages[0..U) for positions [0, U), pages[U..U+K) for
 * [U+F, U+F+K). The array belongs to the books, valid until the loan ends. */
int sl_books_loan_layout(const struct sl_books *b, uint64_t loan_id, const uint64_t **pages,
                         uint64_t *unkept, uint64_t *fresh, uint64_t *kept);
int sl_books_alloc_plan(const struct sl_books *b, uint64_t client_id, uint64_t size,
                        struct sl_grant *g, struct sl_err *err);
int sl_books_alloc_commit(struct sl_books *b, struct sl_grant *g);
/* While the device saves a grant's kept bytes (off the event loop), its positions are neither
 * lent nor free: hold marks them so, and no other allocation is planned or return accepted
 * (SUBLET_EBUSY) until commit, or release when the save failed or the loan ended meanwhile. */
int sl_books_alloc_hold(struct sl_books *b, const struct sl_grant *g, struct sl_err *err);
void sl_books_alloc_release(struct sl_books *b, const struct sl_grant *g);
void sl_grant_clear(struct sl_grant *g);
int sl_books_free_alloc(struct sl_books *b, uint64_t client_id, uint64_t alloc_id,
                        uint64_t *size, struct sl_err *err);
/* The client's live allocations; returns their count (may exceed n). */
size_t sl_books_leaks(const struct sl_books *b, uint64_t loan_id, struct sublet_leak *out,
                      size_t n);
/* Ends the loan the client borrows. Live allocations: SUBLET_ELEAK and nothing changes, unless
 * force, where they are forfeit and the loan ends all the same (still SUBLET_ELEAK, with end
 * filled). */
int sl_books_return(struct sl_books *b, uint64_t client_id, int force, struct sl_loan_end *end,
                    struct sl_err *err);
/* Ends a DRAINING loan (its borrower died) once its process is gone. */
int sl_books_loan_finish(struct sl_books *b, uint64_t loan_id, struct sl_loan_end *end);
/* The commit of an end's replace: the first `replaced` of end->replace have fresh pages now
 * (all of them, or none when creating them failed). The region's pages_version goes up, the
 * old pages count against the borrower (sl_books_retained) until it disconnects: the
 * daemon cannot see when the last fd of one dies. Call it once per end with nreplace > 0. */
void sl_books_pages_replaced(struct sl_books *b, const struct sl_loan_end *end,
                             size_t replaced);
/* The clients that may still hold old pages of other users' regions: up to n of them in out,
 * in client order; returns how many there are. */
struct sl_retained {
  uint64_t client_id;
  struct sl_peer peer;
  uint64_t pages;
};
size_t sl_books_retained(const struct sl_books *b, struct sl_retained *out, size_t n);
void sl_loan_end_clear(struct sl_loan_end *end);

/* Releases (books_release.c): a region's pages given back to the device's driver until a
 * resume, their kept bytes moved into the kept pages that stay or saved to the host
 * (docs/design/release.md). Several may be live on a region, on disjoint pages; a region with
 * one is not lent (and a lent one is not released). Ids come from the loans' sequence.
 *
 * In steps, as a loan's allocation: may_release checks; release_begin enters the release from
 * a draft (its pinned pages: the region's that it does not release) and gives the device work
 * (moves, then saves, then the daemon lets go of the released pages), state RELEASING;
 * release_done commits it (RELEASED) or, failed, drops it (the pages were never let go of).
 * resume_begin gives the undoing (the released pages made again, the saves copied back, the
 * moves undone), state RESUMING; resume_done ends it, or (failed) it is RELEASED again. An
 * early resume (Resume.early) says when its pages are made, resume_made: state RESTORING, the
 * pages are the region's (its owner may fetch them) while the kept bytes are put back, and
 * resume_done ends it whatever the copies did (the owner holds the pages by then). */
enum sl_release_state {
  SL_REL_RELEASING = 1, SL_REL_RELEASED = 2, SL_REL_RESUMING = 3, SL_REL_RESTORING = 4
};

/* Page groups. A page made by cuMemCreate costs the same to export, import and map as one of
 * 128 pages (0.13 ms to import on an H200), so a resume may make each run of released pages
 * again as a few allocations (a sixteenth of the run each, 16 to SL_GROUP_PAGES pages): a
 * group, whose pages are mapped, exported (PagesGet.groups) and released together. A release then gives back whole groups
 * only: a group with a page that stays stays whole (its other pages are "held", counted with
 * the stayed ones), which costs memory but never a byte. A grouped region is not lent (a
 * borrower maps pages one by one) until a resume without groups has undone them all. */
#define SL_GROUP_PAGES 128

/* The device work of a release's begin or resume. Arrays owned (sl_release_work_clear). */
struct sl_release_work {
  uint64_t release_id, region_id;
  struct sl_move *moves;      /* begin: kept bytes of released pages into holes; resume: back */
  size_t nmoves;
  struct sl_copy *copies;     /* begin: saves; resume: restores (host offsets in its own area) */
  size_t ncopies;
  uint64_t *released;         /* the released region pages, ascending */
  size_t nreleased;
  uint64_t *groups;           /* resume: (first, count) of each group to make (NULL: a page
                                 each) */
  size_t ngroups;             /* pairs */
  uint64_t stayed, kept_bytes, moved_bytes, saved_bytes; /* stayed: held pages too */
  uint64_t held;              /* of those, the pages held with a group that stays */
  int by_need;                /* a release by need (its stayed pages may hold nothing) */
  int done;                   /* an increment the books hold already: no device work */
};

struct sl_release_info {
  uint64_t id, region_id, owner_client;
  struct sl_peer owner;
  enum sl_release_state state;
  uint64_t pages;             /* its pages: released and stayed, and those holding nothing */
  uint64_t released_pages, stayed_pages, kept_bytes, moved_bytes, saved_bytes;
  int by_need;                /* a release by need, with its figures: */
  uint64_t need_bytes, free_bytes;  /* the latest need (in all) and the free bytes it counted */
  uint64_t increments;        /* needs after the first */
};

/* A release by need (Lend.need_bytes, issue 42): the bytes the taker needs, and the device's
 * free bytes at the release's moment. The release gives back only the pages the need takes
 * beyond the free bytes, the cheapest to give (need_pick.c: few kept bytes, few runs); a need
 * beyond the free bytes and every page the release could give is refused (SUBLET_ENEED) before
 * anything moves. */
struct sl_release_need {
  uint64_t need_bytes, free_bytes;
};

/* stay: the most kept pages that may stay (UINT64_MAX: as many as the kept bytes need). */
int sl_books_may_release(const struct sl_books *b, uint64_t client_id, uint64_t region_id,
                         uint64_t *npages, struct sl_err *err);
/* need: NULL releases every page the stay allows (a release by tag). */
int sl_books_release_begin(struct sl_books *b, uint64_t client_id, uint64_t region_id,
                           struct sl_loan *draft, uint64_t stay,
                           const struct sl_release_need *need, struct sl_release_work *w,
                           struct sl_err *err);
void sl_books_release_done(struct sl_books *b, uint64_t release_id, int ok);
/* More of a live release by need (issue 42): need->need_bytes is the taker's need in all, now;
 * need->free_bytes the device's free bytes now. A need not above the release's is nothing to
 * do (w->done). Else the increase beyond the free bytes takes more pages of those that stay,
 * chosen as the first need's were (need_pick.c; the bytes moved into a page counted), whose
 * kept bytes move into holes of the pages that still stay, the rest saved (host offsets after
 * the release's); none needed: w->done, the need noted. SUBLET_ENEED
 * (nothing changes) when the pages that stay cannot give enough. Else the release is
 * RELEASING until sl_books_release_done: ok, it has the pages and the new plan; failed, it is
 * as it was (the work only copied). w: the increment's device work and new pages; its
 * figures the release's in all (moved_bytes: every step's moves). */
int sl_books_release_more(struct sl_books *b, uint64_t client_id, uint64_t release_id,
                          const struct sl_release_need *need, struct sl_release_work *w,
                          struct sl_err *err);
/* A live release's plan as a resume without subletd needs it: where each kept byte of its
 * released pages is (books' arrays, valid until the books change). */
int sl_books_release_plan(const struct sl_books *b, uint64_t release_id,
                          const struct sl_move **moves, size_t *nmoves,
                          const struct sl_copy **saves, size_t *nsaves);
/* groups: make the released pages again as groups (w->groups), not page by page. */
int sl_books_resume_begin(struct sl_books *b, uint64_t client_id, uint64_t release_id,
                          int groups, struct sl_release_work *w, struct sl_err *err);
void sl_books_resume_done(struct sl_books *b, uint64_t release_id, int ok);
/* An early resume's pages are made: its release is RESTORING (0), or ENOENT / EBUSY (not
 * RESUMING). */
int sl_books_resume_made(struct sl_books *b, uint64_t release_id);
void sl_release_work_clear(struct sl_release_work *w);
int sl_books_release_info(const struct sl_books *b, uint64_t release_id,
                          struct sl_release_info *ri);
/* Iteration in id order: after = 0 gives the first; -ENOENT past the last. */
int sl_books_release_next(const struct sl_books *b, uint64_t after, struct sl_release_info *ri);
/* The region's pages that are the driver's now. */
uint64_t sl_books_region_released(const struct sl_books *b, uint64_t region_id);
const char *sl_books_release_state_name(enum sl_release_state s);

/* Kept windows (kept.c). A borrower in another process of the owner's uid keeps its window
 * (imported handles, mappings) after a loan, for the region's next: keep_window. One that
 * hears notices is its keeper then, until it borrows another region or leaves; when the region
 * goes (released, its owner gone) each keeper becomes a holder of its pages, is told, and stays
 * one until it says Dropped or leaves: the region's pages are released when no holder is left.
 */
int sl_books_kept_window(const struct sl_books *b, uint64_t client_id, uint64_t region_id);
void sl_books_client_notices(struct sl_books *b, uint64_t client_id);
/* Does client_id hold pages of the gone region_id (told, or to be told)? How many do? */
int sl_books_kept_holds(const struct sl_books *b, uint64_t client_id, uint64_t region_id);
size_t sl_books_kept_holders(const struct sl_books *b, uint64_t region_id);
/* The client let go of region_id's window: *last is set when it was the gone region's last
 * holder (release its pages now). ENOENT when it kept none. */
int sl_books_kept_drop(struct sl_books *b, uint64_t client_id, uint64_t region_id, int *last,
                       struct sl_err *err);
/* The gone regions still held, by holder: fills out[0..n), returns how many there are. */
size_t sl_books_kept_held(const struct sl_books *b, struct sl_held_info *out, size_t n);

/* Observation */
int sl_books_loan_info(const struct sl_books *b, uint64_t loan_id, struct sl_loan_info *li);
/* The time the daemon's copies for a loan took (the books count bytes; the daemon times its
 * copies), added to the loan's stats (copy_out_seconds, move_seconds), which its info and its
 * end carry. SUBLET_ENOENT, nothing added, when the loan is not in the books. */
int sl_books_loan_time(struct sl_books *b, uint64_t loan_id, double copy_out_seconds,
                       double move_seconds);
/* "offered", "active", "draining" (status, messages). */
const char *sl_books_loan_state_name(enum sl_loan_state s);
/* The loan of this device, if any (there is at most one). */
uint64_t sl_books_current_loan(const struct sl_books *b);
uint64_t sl_books_client_loan(const struct sl_books *b, uint64_t client_id); /* borrowed */
void sl_books_totals(const struct sl_books *b, struct sl_books_totals *t);
/* Checks every invariant: nothing double-granted, granted to the wrong client or leaked.
 * Returns 0, or -EPROTO... with the first broken invariant described in why. */
int sl_books_check(const struct sl_books *b, char *why, size_t n);

#endif
