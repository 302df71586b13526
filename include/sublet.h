/* sublet.h - the one public header of libsublet, the sublet client library.
 *
 * A process talks to subletd, the per-GPU daemon that owns the memory, through this API:
 * it creates regions (the memory of one tensor), lends them with a set of kept byte ranges,
 * borrows loans (its own or another process's), allocates from a loan, and returns it.
 *
 * Conventions (libuv's): functions return 0 or a negative SUBLET_E* code; the message that
 * goes with the last error of the calling thread is sublet_last_error(). Objects are made by
 * x_new/x_create functions and freed by the matching x_free/x_release. No function here calls
 * back into the caller. A client is safe to use from several threads (calls are serialised).
 */
#ifndef SUBLET_H
#define SUBLET_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef SUBLET_EXPORT /* a build that hides the API defines it empty (preload/tms.h) */
#if defined(__GNUC__)
#define SUBLET_EXPORT __attribute__((visibility("default")))
#else
#define SUBLET_EXPORT
#endif
#endif

#define SUBLET_PROTOCOL_VERSION 1
/* A loan's token: random bytes that let a borrower in another process take the loan. */
#define SUBLET_TOKEN_SIZE 16

/* Error codes: negative errno where one fits, sublet's own beyond errno's range. They are the
 * codes of the protocol's Error message too. */
#define SUBLET_ERRNO_MAP(X)                                                                    \
  X(EINVAL, -22, "invalid argument")                                                           \
  X(ENOENT, -2, "no such region, loan or allocation")                                          \
  X(EPERM, -1, "not permitted")                                                                \
  X(EBUSY, -16, "busy")                                                                        \
  X(ENOMEM, -12, "out of device memory")                                                       \
  X(ETIMEDOUT, -110, "timed out")                                                              \
  X(ECANCELED, -125, "canceled")                                                               \
  X(ECONNREFUSED, -111, "cannot reach subletd")                                                \
  X(EACCES, -13, "permission denied on subletd's socket")                                      \
  X(EPIPE, -32, "connection to subletd lost")                                                  \
  X(EIO, -5, "I/O error")                                                                      \
  X(E2BIG, -7, "request too large")                                                            \
  X(EPROTO, -71, "protocol error")                                                             \
  X(ELEAK, -4001, "allocations still alive at the end of the loan")                            \
  X(EVERSION, -4002, "protocol version mismatch")                                              \
  X(EDEVICE, -4003, "device error")                                                            \
  X(EOWNERGONE, -4004, "the owner of the lent region has gone")                                \
  X(EBORROWERDIED, -4005, "the borrower died during the loan")                                 \
  X(ENOOFFER, -4006, "no loan is on offer")                                                    \
  X(EDAEMONDIED, -4007, "subletd died during the loan")                                        \
  X(ENOHOSTMEM, -4008, "out of host memory")                                                   \
  X(ENEED, -4009, "the need exceeds the free memory and all the release can give")             \
  X(ENOTSUP, -95, "not supported")

#define SUBLET_DEFINE_ERR(name, value, text) SUBLET_##name = (value),
enum sublet_error { SUBLET_ERRNO_MAP(SUBLET_DEFINE_ERR) };
#undef SUBLET_DEFINE_ERR

typedef struct sublet_client sublet_client;
typedef struct sublet_region sublet_region;

struct sublet_info {
  char daemon_version[32];
  char backend[16];       /* "cuda" or "memfd" */
  char device_name[96];
  uint8_t device_uuid[16];
  uint32_t device_ordinal; /* the daemon's numbering: it differs from the caller's CUDA_VISIBLE_DEVICES */
  uint64_t page_size;
  uint64_t total_bytes;
  uint64_t free_bytes;
  uint64_t client_id;
};

/* A byte range of a region: what the owner keeps through a loan. */
struct sublet_range {
  uint64_t offset;
  uint64_t length;
};

/* Where a loan's memory came from and what crossed the host link. Bytes are exact. */
struct sublet_loan_stats {
  uint64_t loan_id;
  uint64_t copied_out_bytes;   /* kept bytes saved to host memory */
  uint64_t copied_in_bytes;    /* kept bytes restored (equal to copied_out once the loan ended) */
  uint64_t served_unkept_bytes;
  uint64_t served_fresh_bytes;
  uint64_t served_kept_bytes;
  uint64_t peak_bytes;         /* the most the borrower held at once */
  uint64_t allocations;
  double map_seconds;          /* client side: importing and mapping pages */
  double copy_out_seconds;     /* daemon side */
  double copy_in_seconds;      /* daemon side */
  int borrower_died;           /* set on the owner's side when the borrower died mid-loan */
  int owner_gone;
  uint64_t moved_bytes;        /* kept bytes moved on the device into unkept bytes of kept
                                  pages the borrower did not use (and moved back) */
  double move_seconds;         /* daemon side, both ways */
  int daemon_died;             /* subletd died: the owner's library restored the kept bytes */
  uint64_t replaced_pages;     /* pages the borrower (another user) was granted, replaced by
                                  fresh ones at the end: the owner's mapping has them now, at
                                  the same addresses; 0 for a borrower of the owner's user */
  uint64_t mapped_pages;       /* client side: region pages this loan mapped (fresh chunks are
                                  not counted); 0 where the window was kept or in place */
};

/* An allocation still alive when the borrower tried to return the loan. */
struct sublet_leak {
  uint64_t alloc_id;
  uint64_t size;
  void *ptr;
};

SUBLET_EXPORT const char *sublet_version(void);
SUBLET_EXPORT const char *sublet_strerror(int code);
/* The message of the calling thread's last failed call: says what went wrong and what to do. */
SUBLET_EXPORT const char *sublet_last_error(void);

/* Connects to subletd. path NULL: $SUBLET_SOCKET, else /run/sublet/gpu0.sock. */
SUBLET_EXPORT int sublet_connect(const char *path, sublet_client **out);
SUBLET_EXPORT void sublet_disconnect(sublet_client *c);
/* 1 while the connection is up; 0 once subletd died or closed it: connect anew for new work
 * (the old client's regions stay mapped until released; release still works). */
SUBLET_EXPORT int sublet_connected(const sublet_client *c);
SUBLET_EXPORT int sublet_get_info(sublet_client *c, struct sublet_info *info);
/* How long subletd may take to answer a call (past the wait that sublet_reclaim and
 * sublet_borrow ask for): default 30 s, or $SUBLET_TIMEOUT seconds; -1: no deadline. A call
 * past it fails with SUBLET_ETIMEDOUT ("subletd did not answer") and the connection is lost
 * (a late reply would answer the next call): connect again. Connecting gives up after 10 s. */
SUBLET_EXPORT int sublet_set_timeout(sublet_client *c, int timeout_ms);

/* Gives up the call that waits for subletd in another thread (sublet_lend_wait,
 * sublet_lend_local_wait, sublet_borrow, sublet_reclaim): it returns SUBLET_ECANCELED at once
 * (nothing lent, nothing borrowed), or its own result if that came first. Returns 0 (also when
 * nothing waits), SUBLET_ENOTSUP from a subletd too old to cancel. Any thread may call it, at
 * any time; not a signal handler. */
SUBLET_EXPORT int sublet_cancel(sublet_client *c);

/* Pins host memory for the saves of this user's loans ahead of the first Lend, in the
 * background, toward `bytes` (at most the bytes of the user's regions together): a loan's
 * first save then finds it made, where otherwise it waits for the kernel to make host pages
 * (slower than the link: docs/benchmarks.md). Returns once the pin is under way (`sublet
 * status` shows it); SUBLET_ENOENT if the user has no region on the device, SUBLET_EBUSY
 * while the loans' save area is another user's, SUBLET_ENOTSUP from a subletd too old for
 * it. What is pinned stays for later loans, and goes when the user has had no region for
 * subletd's --pin-keep. flags SUBLET_PIN_RELEASE: for the user's releases instead
 * (sublet_release): a save area that the next release takes, and gives back pinned for the
 * one after. */
#define SUBLET_PIN_RELEASE 1u
SUBLET_EXPORT int sublet_pin_ahead(sublet_client *c, uint64_t bytes, unsigned flags);

/* Regions: the memory of one tensor, size rounded up to whole pages, mapped contiguously in
 * this process at sublet_region_addr(). */
SUBLET_EXPORT int sublet_region_create(sublet_client *c, uint64_t size, sublet_region **out);
SUBLET_EXPORT void *sublet_region_addr(const sublet_region *r);
SUBLET_EXPORT uint64_t sublet_region_size(const sublet_region *r);
SUBLET_EXPORT uint64_t sublet_region_id(const sublet_region *r);
SUBLET_EXPORT int sublet_region_release(sublet_region *r);
/* A region that may grow: sublet_region_grow() makes it size bytes in all (rounded up to
 * pages; more than it has, at most the device's total). Its address and its bytes stay; the
 * new pages follow the old ones. Not while it is lent (SUBLET_EBUSY: reclaim first);
 * SUBLET_EINVAL for a region made by sublet_region_create() or a size not above its own,
 * SUBLET_ENOMEM past the device's memory, SUBLET_ENOTSUP from a subletd that cannot grow
 * regions. */
SUBLET_EXPORT int sublet_region_create_growable(sublet_client *c, uint64_t size,
                                                sublet_region **out);
SUBLET_EXPORT int sublet_region_grow(sublet_region *r, uint64_t size);

/* A 64-bit checksum of each range of the region into sums[i], computed on the device (one GPU
 * kernel for all ranges, at memory bandwidth). It depends on every bit of the range and on
 * where each byte lies in the region, not on the values as numbers: a change of one 8-byte
 * word always changes it, and more changes leave it the same only by a 64-bit coincidence.
 * verify takes them before a loan and compares them after it. Ranges must lie in the region;
 * the device's queued work is waited for first. */
SUBLET_EXPORT int sublet_region_checksum(sublet_region *r, const struct sublet_range *ranges,
                                         size_t n, uint64_t *sums);

/* Keep as rows of a table whose row r lies at base + r * row_bytes (rows tile memory): the
 * byte ranges of rows[0..n), a run of consecutive rows one range, into out (room for n);
 * *nout gets their count. rows ascend, without repeats, each below nrows (else SUBLET_EINVAL
 * naming the first that does not). One pass, no daemon: for a block table's live list. */
SUBLET_EXPORT int sublet_rows_ranges(const int64_t *rows, size_t n, uint64_t nrows,
                                     uint64_t base, uint64_t row_bytes,
                                     struct sublet_range *out, size_t *nout);
/* The same rows of many tables of one shape (a pool: one KV cache tensor per layer, its K and
 * V halves), table i's row r at bases[i] + r * row_bytes: their ranges, sorted and merged as a
 * Lend wants them (ascending, disjoint, not touching; a table's last range and the next one's
 * first are one range when they touch), into out (room for cap); *nout gets their count.
 * bases in any order (sorted here; a repeat adds nothing), and the rows of one table must
 * not overlap another's (else SUBLET_EINVAL). rows as for sublet_rows_ranges. With cap too
 * small: SUBLET_E2BIG and *nout says how many ranges it takes (cap 0 asks). At most n * nbases
 * ranges; a large output is written by several threads. */
SUBLET_EXPORT int sublet_blocks_ranges(const int64_t *rows, size_t n, uint64_t nrows,
                                       const uint64_t *bases, size_t nbases, uint64_t row_bytes,
                                       struct sublet_range *out, size_t cap, size_t *nout);

/* Lending, owner's side. keep: sorted or not, overlapping or not; n == 0 with keep_all == 0
 * keeps nothing. Offers the loan; on success *loan_id and token identify it. */
SUBLET_EXPORT int sublet_lend(sublet_region *r, const struct sublet_range *keep, size_t n,
                              int keep_all, const char *name, uint64_t *loan_id,
                              uint8_t token[SUBLET_TOKEN_SIZE]);
/* Lends the region to its own client in one step: the client borrows the loan at once (as
 * sublet_borrow() would: sublet_alloc() serves from it), and it is never on offer, so no other
 * process can take it or sees it but in the daemon's status. End it with sublet_return(), then
 * sublet_reclaim(). SUBLET_EBUSY while the client borrows another loan. */
SUBLET_EXPORT int sublet_lend_local(sublet_region *r, const struct sublet_range *keep, size_t n,
                                    int keep_all, uint64_t *loan_id);
/* sublet_lend and sublet_lend_local that wait their turn: while another loan runs on the
 * device (one at a time), the call waits up to timeout_ms (< 0: forever) for it to end, owners
 * being served in the order they asked; past it, SUBLET_ETIMEDOUT and nothing is lent. With
 * timeout_ms 0 (sublet_lend, sublet_lend_local) it fails at once with SUBLET_EBUSY. The
 * client's other calls wait meanwhile (its lock is held). */
SUBLET_EXPORT int sublet_lend_wait(sublet_region *r, const struct sublet_range *keep, size_t n,
                                   int keep_all, const char *name, int timeout_ms,
                                   uint64_t *loan_id, uint8_t token[SUBLET_TOKEN_SIZE]);
SUBLET_EXPORT int sublet_lend_local_wait(sublet_region *r, const struct sublet_range *keep,
                                         size_t n, int keep_all, int timeout_ms,
                                         uint64_t *loan_id);
/* Any of the above (local: sublet_lend_local_wait's loan, name and token unused then), with
 * pinned pages: byte ranges of the region, whole pages (offset and length multiples of the
 * page size, else SUBLET_EINVAL), in any order. The loan never touches them: not lent, not in
 * the borrower's window, never saved, moved into or restored, so the owner may read and write
 * them all through the loan (a pool's other tags). keep may not name a byte of a pinned page
 * (SUBLET_EINVAL); keep_all keeps every byte of the other pages. SUBLET_ENOTSUP from a subletd
 * that cannot pin. npinned 0 is the plain call. */
SUBLET_EXPORT int sublet_lend_pinned(sublet_region *r, const struct sublet_range *keep,
                                     size_t n, int keep_all, const struct sublet_range *pinned,
                                     size_t npinned, int local, const char *name,
                                     int timeout_ms, uint64_t *loan_id,
                                     uint8_t token[SUBLET_TOKEN_SIZE]);
/* Waits until the loan ends (timeout_ms < 0: forever), then the region is the owner's again and
 * its kept bytes are back. After a loan to another user, the pages that borrower was granted
 * are fresh ones, mapped here at the same addresses (stats->replaced_pages); use the region only
 * after this call. If subletd dies meanwhile, the library restores them itself from the
 * host save area once the borrower has let go, and returns SUBLET_EDAEMONDIED with stats
 * (copied_in_bytes: what it restored; daemon_died set); SUBLET_ETIMEDOUT if the borrower has
 * not let go within timeout_ms (call again). SUBLET_ENOMEM: the loan was another user's and the
 * device lacks the memory for the fresh pages of its end (the kept bytes wait, safe; call
 * again once memory is free). Told so, the library first lets go of this process's mapping of
 * the pages that borrower was granted (their memory may be what the end waits for) and asks
 * once more within timeout_ms; those addresses stay unmapped until a call succeeds. */
SUBLET_EXPORT int sublet_reclaim(sublet_client *c, uint64_t loan_id, int timeout_ms,
                                 struct sublet_loan_stats *stats);
/* Withdraws an offer nobody has borrowed yet. */
SUBLET_EXPORT int sublet_withdraw(sublet_client *c, uint64_t loan_id);

/* Borrowing. By id and token (token NULL: only the owner's own client may borrow), or by
 * name (loan_id 0); name NULL and loan_id 0: the next offer on this device. */
SUBLET_EXPORT int sublet_borrow(sublet_client *c, uint64_t loan_id,
                                const uint8_t token[SUBLET_TOKEN_SIZE], const char *name,
                                int timeout_ms);
SUBLET_EXPORT int sublet_alloc(sublet_client *c, uint64_t size, void **ptr);
SUBLET_EXPORT int sublet_free(sublet_client *c, void *ptr);
/* Ends the borrowing. With live allocations: SUBLET_ELEAK and the loan goes on (force == 0),
 * or the loan ends anyway and the allocations are forfeit (force != 0; still SUBLET_ELEAK).
 * leaks/nleaks (may be NULL/0) receive the live allocations, *nleaks_out their count. */
SUBLET_EXPORT int sublet_return(sublet_client *c, int force, struct sublet_loan_stats *stats,
                                struct sublet_leak *leaks, size_t nleaks, size_t *nleaks_out);
SUBLET_EXPORT int sublet_loan_stats(sublet_client *c, struct sublet_loan_stats *stats);

/* The daemon's status (device, regions, the loan in progress, totals since start) as a JSON
 * object in *json, freed with sublet_string_free(). */
SUBLET_EXPORT int sublet_status_json(sublet_client *c, char **json);
SUBLET_EXPORT void sublet_string_free(char *s);

/* Pools: memory sub-allocated by tag (any number but 0, the caller's names) from one growable
 * region of the client, its arena, so that many tensors cost no region each and one loan of
 * that region lends any set of tags (the pages of the others kept). An allocation is whole
 * pages, first fit; the region grows when no gap holds it (made at the first). From
 * sublet_pool_hold() to sublet_pool_unhold(), and while the arena is lent, allocating fails at
 * once with SUBLET_EBUSY (of every tag: a new page could be a free one the loan lends; it
 * never waits, since PyTorch's allocator calls it with its lock held). A free leaves its pages
 * free in the region: the next allocation, or a loan, takes them; the last free releases the
 * region.
 *
 * Lock order for the pools and loans of a process: the pools' lock (these calls), then the
 * client's (every request), never the reverse; no call here takes the pools' lock while it
 * holds the client's. */
SUBLET_EXPORT int sublet_pool_alloc(sublet_client *c, uint32_t tag, uint64_t size, void **ptr);
SUBLET_EXPORT int sublet_pool_free(sublet_client *c, void *ptr);
/* A margin for the pools' growth: a pool allocation that needs new device memory (the arena
 * grows) fails with SUBLET_ENOMEM when margin + the growth exceed the device's free memory
 * (as subletd counts it: cuMemGetInfo's free, or the memfd backend's); 0 (the default) checks
 * nothing. torch_memory_saver's memory_margin_bytes, for every pool of c. */
SUBLET_EXPORT int sublet_pool_set_margin(sublet_client *c, uint64_t bytes);
/* 1 when ptr is the start of a live pool allocation of c, else 0. */
SUBLET_EXPORT int sublet_pool_owns(sublet_client *c, const void *ptr);
/* The arena (lend it under sublet_pool_hold()), or NULL before the first pool allocation. */
SUBLET_EXPORT sublet_region *sublet_pool_region(sublet_client *c);
/* Lending the arena: which pages a loan lends (a tag's, the free ones) and which it pins (the
 * other tags') is decided from the segments, and no allocation may take a page between that
 * decision and the loan's end. sublet_pool_hold() switches the refusal of pool allocations on
 * (SUBLET_EBUSY, above) atomically with reading the layout: read the segments and the
 * arena's size for the loan after it, lend, and call sublet_pool_unhold() once the loan is
 * reclaimed or the Lend failed. A Lend of the arena's region without the hold fails with
 * SUBLET_EINVAL. *layout (may be NULL): the arena's layout id, which changes whenever an
 * allocation takes pages (sublet_pool_layout() reads it without holding): a plan made from
 * segments read while the id was the one the hold returns is still the arena's. SUBLET_EBUSY
 * when held already (one loan or release of the arena made at a time). Frees go on while held.
 * Releases of the arena likewise: sublet_release() and sublet_offer_release() of its region
 * fail with SUBLET_EINVAL outside the hold; hold, read sublet_pool_segments(), release, and
 * unhold once the release is made (an offer: once it has ended). While a release is live, pool
 * allocations are served again, never from a page of its set (released, or stayed with kept
 * bytes moved into it) until its resume. */
SUBLET_EXPORT int sublet_pool_hold(sublet_client *c, uint64_t *layout);
SUBLET_EXPORT int sublet_pool_unhold(sublet_client *c);
SUBLET_EXPORT uint64_t sublet_pool_layout(sublet_client *c);
/* The live allocations of tag (0: of every tag) as byte ranges of the arena, ascending and
 * disjoint: the first n into out, their count into *count (a bound when it exceeds n: call
 * again with room for it). A tag's ranges reach over the free pages of the page groups they
 * cut (a resume's, sublet_resume()), so that its release gives them back whole; no group
 * holds pages of two tags (pool allocations never make one). */
SUBLET_EXPORT int sublet_pool_segments(sublet_client *c, uint32_t tag, struct sublet_range *out,
                                       size_t n, size_t *count);

/* Releases: pages of a region given back to the device's driver, for anyone to allocate (a
 * process that knows nothing of sublet, NCCL), until sublet_resume() makes them again at the
 * same addresses (docs/design/release.md). pages: byte ranges of whole pages of the region,
 * in any order (NULL/0: all of it); keep: byte ranges within them, as for sublet_lend. The
 * kept bytes of released pages move, on the device, into unkept bytes of the kept pages that
 * stay (at most stay_pages of those, SUBLET_STAY_ANY: as many as the kept bytes need, so that
 * nothing goes to the host); what they cannot hold is saved to host memory. Returns once the
 * memory is the driver's: this process holds no handle of the released pages, and touching
 * them is a GPU fault until the resume. Several releases of a region may be live, on disjoint
 * pages (SUBLET_EBUSY otherwise); a region with one cannot be lent (SUBLET_EBUSY).
 * SUBLET_ENOTSUP from a subletd that cannot release. SUBLET_EDAEMONDIED when subletd went
 * before it answered: nothing was released, every page is still this process's, mapped, each
 * kept byte where it was (subletd only copies kept bytes over unkept ones, or to
 * the host, before it answers). */
#define SUBLET_STAY_ANY UINT64_MAX

struct sublet_release_stats {
  uint64_t release_id;
  uint64_t released_pages;   /* given back to the driver */
  uint64_t stayed_pages;     /* kept pages that stayed, holding the kept bytes */
  uint64_t kept_bytes;
  uint64_t moved_bytes;      /* kept bytes moved on the device (and back at the resume) */
  uint64_t copied_out_bytes; /* kept bytes saved to the host */
  uint64_t copied_in_bytes;  /* restored (copied_out_bytes once resumed) */
  double seconds;            /* the call, end to end */
  double move_seconds, copy_seconds; /* daemon side */
  double map_seconds;        /* client side: unmapping (release), mapping (resume) */
  int daemon_died;           /* the resume was done by this library: subletd had died */
  uint64_t allocations;      /* resume: the allocations the released pages came back as (one
                                per page group, or per page) */
  uint64_t held_pages;       /* of stayed_pages, those that stayed only because they share an
                                allocation (a page group) with a page that stays */
};

SUBLET_EXPORT int sublet_release(sublet_region *r, const struct sublet_range *pages,
                                 size_t npages, const struct sublet_range *keep, size_t nkeep,
                                 int keep_all, uint64_t stay_pages, uint64_t *release_id,
                                 struct sublet_release_stats *stats);
/* A release by need (issue 42; PROTOCOL.md, "Releases by need"): the taker needs need_bytes
 * of device memory. subletd counts the device's free bytes first and releases only the pages
 * of the set the rest of the need takes (at least those beyond stay_pages; whole page groups),
 * the cheapest to give (few kept bytes in few runs: docs/design/release.md); their kept
 * bytes move into holes of the pages that
 * stay, and only what those cannot hold goes to the host. SUBLET_ENEED, nothing moved, when
 * the need exceeds the free bytes and every page the release could give (the message gives
 * the figures); SUBLET_ENOTSUP from a subletd that cannot (nothing sent). need_bytes
 * SUBLET_NEED_ALL: sublet_release(). */
#define SUBLET_NEED_ALL UINT64_MAX
SUBLET_EXPORT int sublet_release_need(sublet_region *r, const struct sublet_range *pages,
                                      size_t npages, const struct sublet_range *keep,
                                      size_t nkeep, int keep_all, uint64_t stay_pages,
                                      uint64_t need_bytes, uint64_t *release_id,
                                      struct sublet_release_stats *stats);
/* More of a live release made by need (issue 42; PROTOCOL.md, "Releases by need"): the
 * taker now needs need_bytes in all (not in addition). A need not above the release's is
 * nothing to do (0, stats as they were). Else subletd counts the device's free bytes again
 * and releases only the pages the increase takes beyond them, of the pages that stayed, the
 * cheapest to give (their kept bytes and those moved into them, in few runs); their bytes move
 * into holes of the pages that still stay, only the rest goes to the host; nothing released before
 * is resumed. stats: the release's in all (released_pages, stayed_pages, moved_bytes: every
 * step's moves, copied_out_bytes). SUBLET_ENEED, nothing moved and the release as it was, when
 * the pages that stay cannot give it (the message gives the figures); SUBLET_EINVAL for a
 * release not made by need; SUBLET_ENOTSUP from a subletd that cannot (nothing sent);
 * SUBLET_EDAEMONDIED when subletd went before it answered (nothing more released: the resume
 * puts every kept byte back by itself). sublet_resume() then ends all of it at once. */
SUBLET_EXPORT int sublet_release_more(sublet_region *r, uint64_t release_id,
                                      uint64_t need_bytes, struct sublet_release_stats *stats);
/* Makes the released pages again at their addresses and puts the kept bytes back. All or
 * none: SUBLET_ENOMEM while the device lacks the memory (whoever took it must free it; the
 * release goes on: call again). If subletd has died, this library does it itself (the save
 * area and the plan came with the release) and returns SUBLET_EDAEMONDIED with the stats.
 * Each run of released pages comes back as a few allocations of up to 128 pages (a page
 * group: a 64 GiB run costs 256 imports, not 32,768), which can be released again but not
 * lent: flags SUBLET_RESUME_PAGES makes a page each instead (a region with no group left can
 * be lent again). */
#define SUBLET_RESUME_PAGES 1
SUBLET_EXPORT int sublet_resume(sublet_region *r, uint64_t release_id, int flags,
                                struct sublet_release_stats *stats);

/* Release offers: a release that a scheduler in another process starts and ends
 * (docs/design/release.md, "Release offers"). The owner offers; a background thread of this
 * library, on a connection of its own, waits for a taker; when one takes the offer
 * (sublet_take), that thread releases the pages as sublet_release() would (pages, keep,
 * keep_all, stay_pages as there: the lists are copied), and when the taker gives it back (or
 * goes), resumes them as sublet_resume() would (page groups), then the offer is over. The
 * owner must not touch the region's released pages, nor free the region or its client, until
 * it is over (sublet_release_offer_wait): its owner is paused. name: LoanName, unique among
 * live release offers (SUBLET_EBUSY), or NULL. SUBLET_ENOTSUP from a subletd that cannot. */
typedef struct sublet_release_offer sublet_release_offer;

/* Where a release offer is (the protocol's OfferPhase). */
enum sublet_offer_state {
  SUBLET_OFFER_OFFERED = 1,   /* no taker yet */
  SUBLET_OFFER_TAKEN = 2,     /* taken: the owner releases */
  SUBLET_OFFER_RELEASED = 3,  /* the memory is the driver's */
  SUBLET_OFFER_RETURNING = 4, /* given back: the owner resumes */
  SUBLET_OFFER_ENDED = 5,     /* over: resumed, withdrawn, or failed */
  SUBLET_OFFER_MORE = 6       /* the taker needs more (sublet_take_more): the owner releases more */
};

SUBLET_EXPORT int sublet_offer_release(sublet_region *r, const struct sublet_range *pages,
                                       size_t npages, const struct sublet_range *keep,
                                       size_t nkeep, int keep_all, uint64_t stay_pages,
                                       const char *name, sublet_release_offer **out);
SUBLET_EXPORT uint64_t sublet_release_offer_id(const sublet_release_offer *o);
SUBLET_EXPORT int sublet_release_offer_state(sublet_release_offer *o);
/* Waits until the offer is over (timeout_ms < 0: forever; SUBLET_ETIMEDOUT: not yet, call
 * again). 0: released and resumed, the kept bytes back (*released, *resumed: the stats of
 * each; either may be NULL). SUBLET_EBORROWERDIED: the taker went without giving it back, and
 * it was resumed all the same (stats as for 0). SUBLET_EDAEMONDIED: subletd died; if the pages
 * were released, this library resumed them itself (resumed->daemon_died), else nothing was
 * released. SUBLET_ECANCELED: withdrawn. Any other code: the release or the resume failed
 * (nothing released, or see the message). */
SUBLET_EXPORT int sublet_release_offer_wait(sublet_release_offer *o, int timeout_ms,
                                            struct sublet_release_stats *released,
                                            struct sublet_release_stats *resumed);
/* Ends an offer nobody has taken: 0 (also when it is over already), SUBLET_EBUSY when it has
 * been taken (it comes back once given back: wait for it). */
SUBLET_EXPORT int sublet_release_offer_withdraw(sublet_release_offer *o);
/* Withdraws the offer, or waits until it is over, then frees it (NULL: nothing). */
SUBLET_EXPORT void sublet_release_offer_free(sublet_release_offer *o);

/* The scheduler's side. sublet_take takes a release offer by name (NULL: the oldest one this
 * user may take: the owner's user, root, or subletd --allow-group), waiting up to timeout_ms
 * (0: at once; < 0: forever) for one to be on offer (SUBLET_ENOOFFER, or SUBLET_EBUSY when the
 * one of that name is taken, at once; SUBLET_ETIMEDOUT after a wait); *offer_id names it. It
 * returns once taken, before the owner has released: sublet_take_wait waits for that
 * (*state SUBLET_OFFER_RELEASED, *stats the release's), and after sublet_give_back for the
 * resume (*state SUBLET_OFFER_ENDED, *stats the resume's); SUBLET_ETIMEDOUT changes nothing.
 * SUBLET_EOWNERGONE: the owner went (its memory went back to the driver with it); another
 * code: the owner's release or resume failed (the offer is over). */
SUBLET_EXPORT int sublet_take(sublet_client *c, const char *name, int timeout_ms,
                              uint64_t *offer_id);
SUBLET_EXPORT int sublet_take_wait(sublet_client *c, uint64_t offer_id, int timeout_ms,
                                   int *state, struct sublet_release_stats *stats);
SUBLET_EXPORT int sublet_give_back(sublet_client *c, uint64_t offer_id);
/* By need (issue 42; docs/design/release.md, "Release offers by need"). sublet_take_need takes
 * as sublet_take, and the owner's library releases only what need_bytes takes beyond the
 * device's free bytes (as sublet_release_need, with the offer's keep and stay). SUBLET_ENEED
 * from sublet_take_wait, the message giving the figures, when the offer cannot give it: nothing
 * was released and the offer is on offer again (this client no longer holds it). SUBLET_ENOTSUP
 * without sending anything from a subletd older than this (update subletd), and from subletd
 * when the offer's owner runs a libsublet older than this (update the owner's sublet; the
 * offer stays on offer). sublet_take_more: the taker now needs need_bytes in all (not in
 * addition); *state SUBLET_OFFER_RELEASED when that is not above its need (nothing to do), else
 * SUBLET_OFFER_MORE: the owner's library releases more of it (sublet_release_more, nothing
 * resumed) and sublet_take_wait returns once it has (*state SUBLET_OFFER_RELEASED, *stats the
 * release's in all) or with its error (SUBLET_ENEED with the figures, or another; the offer is
 * as it was and still held). SUBLET_EINVAL for an offer taken without a need, SUBLET_EBUSY
 * while it is not released (or more is being released, or it was given back). Giving back
 * resumes everything at once. */
SUBLET_EXPORT int sublet_take_need(sublet_client *c, const char *name, uint64_t need_bytes,
                                   int timeout_ms, uint64_t *offer_id);
SUBLET_EXPORT int sublet_take_more(sublet_client *c, uint64_t offer_id, uint64_t need_bytes,
                                   int *state);

/* The pair PyTorch's CUDAPluggableAllocator loads. sublet_torch_bind() routes them for a CUDA
 * device index of this process to a client that is borrowing; NULL unbinds. With no loan
 * bound, sublet_torch_bind_pool() routes allocations to the client's pool of that tag (c NULL
 * or tag 0: none); frees of pool allocations reach the pool whatever is bound. They never call
 * Python; on failure alloc returns NULL and sublet_last_error() says why. */
SUBLET_EXPORT int sublet_torch_bind(int device, sublet_client *c);
SUBLET_EXPORT int sublet_torch_bind_pool(int device, sublet_client *c, uint32_t tag);
SUBLET_EXPORT void *sublet_torch_alloc(ssize_t size, int device, void *stream);
SUBLET_EXPORT void sublet_torch_free(void *ptr, ssize_t size, int device, void *stream);

#ifdef __cplusplus
}
#endif
#endif
