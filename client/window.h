/* window.h - a borrower's address window: the loan's pages mapped in lending order.
 *
 * The daemon hands out each allocation as a contiguous run of window positions (books.h), so
 * every allocation is contiguous here with no per-allocation mapping: a position is mapped
 * the first time it is granted and stays mapped. The window is kept from one loan of a region
 * to the next (in the owner's process; in another when the daemon says keep_window) and only
 * positions whose page changed are remapped, so mapping is paid once; in another process the
 * imported handles stay too, even when the window itself cannot (its zones changed size).
 * Fresh chunks are mapped when granted and dropped when the loan ends.
 *
 * Served in place: in the owner's process, a loan whose kept zone is every page of the region
 * in order (it keeps bytes of every page: a paged KV cache's scattered live blocks) needs no
 * window of its own. Its kept zone is the region's own mapping and its fresh zone the address
 * space the region reserved right below it (region.c), so nothing but fresh chunks is ever
 * mapped, at the first loan as at the next. Likewise a loan whose unkept zone is the region's
 * tail (a tensor that keeps its head): that is the region's own mapping, and its fresh and
 * kept zones follow in the address space reserved above the region, where only fresh chunks
 * and the kept pages the borrower reaches get mapped.
 */
#ifndef SL_WINDOW_H
#define SL_WINDOW_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

struct sl_window_alloc {
  void *ptr;
  uint64_t size;
  uint64_t id;
};

struct sl_window_chunk {
  uint64_t pos, npages;
  sl_handle handle;
};

struct sl_window {
  struct sl_device *dev;
  uint64_t page_size;
  uint64_t region_id, region_pages;
  uint64_t unkept, fresh, kept;   /* U, F, K */
  uint64_t *layout;               /* U + K region page indices */
  void *base;                     /* U + F + K pages reserved, or aliased */
  void *reserved;                 /* the window's own reservation (NULL: aliased) ... */
  uint64_t reserved_pages;        /* ... of room + K pages, or U + F + K when U > 0 */
  uint64_t room;                  /* with U = 0, the most pages its fresh zone may grow to
                                     below the kept zone, which stays where it is */
  uint64_t own_from, own_to;      /* positions [from, to) are the region's own mapping (none:
                                     base is the window's own reservation) */
  void *region_base;              /* the region's own mapping in this process, or NULL */
  int64_t *mapped;                /* per position: region page mapped there, or -1 */
  sl_handle *handles;             /* per region page: a handle this process holds, or 0 */
  int owns_handles;               /* imported for this window (another process's region) */
  int keep;                       /* kept after the loan for the region's next (Borrowed) */
  uint64_t pages_version;         /* of the region's pages it maps (Borrowed.pages_version) */
  uint64_t layout_id;             /* Borrowed.layout_id of its layout, 0: none known */
  struct sl_window_chunk *chunks;
  size_t nchunks, chunkcap;
  struct sl_window_alloc *allocs;
  size_t nallocs, alloccap;
  double map_seconds;
  uint64_t mapped_pages;          /* region pages mapped since the loan began */
};

/* The region this process owns, for a loan of it in the owner's process. */
struct sl_window_own {
  sl_handle *handles;             /* the region's (borrowed, not freed) */
  void *base;                     /* its mapping */
  uint64_t lead_pages;            /* address space reserved below base */
  uint64_t trail_pages;           /* ... and above its last page */
  int in_place;                   /* may the window hand out base's addresses (lie over base
                                     and its reservation, or serve runs of it directly)? */
};

/* A window for a loan's layout. own: the region when this process owns it, else NULL (the
 * window imports the handles it needs, and owns them). room: with no unkept zone (a loan in
 * order: books.h), the pages of address space its fresh zone may grow to (the device's), so
 * that a later loan with another fresh zone keeps the kept zone's mappings. */
int sl_window_new(struct sl_device *dev, uint64_t page_size, uint64_t region_id,
                  uint64_t region_pages, uint64_t unkept, uint64_t fresh, uint64_t kept,
                  const uint64_t *layout, const struct sl_window_own *own, uint64_t room,
                  struct sl_window **out, struct sl_err *err);
/* Can w serve this loan's layout (same region and zone sizes, or with no unkept zone another
 * fresh zone that fits its room)? Then adopt its layout. */
int sl_window_adopt(struct sl_window *w, uint64_t region_id, uint64_t unkept, uint64_t fresh,
                    uint64_t kept, const uint64_t *layout);
/* The region page at a window position, or -1 for a fresh position. */
int64_t sl_window_page_at(const struct sl_window *w, uint64_t pos);
/* Where positions [pos, pos+n) already lie contiguous in this process: inside the region's
 * own mapping, when they are consecutive pages of a region this process owns (the unkept
 * tail of a tensor that keeps its head, say). NULL otherwise: they go in the window. */
void *sl_window_direct(const struct sl_window *w, uint64_t pos, uint64_t n);
/* Maps positions [pos, pos+n) that are not mapped to their page yet (fresh positions must be
 * mapped already by sl_window_add_chunk); every page needs a handle in w->handles. */
int sl_window_map_run(struct sl_window *w, uint64_t pos, uint64_t n, struct sl_err *err);
/* Maps ahead, while an allocation of npages pages is awaited, the kept-zone positions it may
 * reach: none when the unkept and fresh zones' free positions can hold it (its grant comes at
 * once), else as many as it would take past them, from the kept zone's start, skipping those
 * mapped already or whose handle this process lacks. The grant of such an allocation waits
 * for subletd to save or move the kept bytes out of its pages, which takes about as long as
 * mapping them does (docs/benchmarks.md): the mapping goes in that wait instead of after it.
 * stop(arg) is asked between runs of pages and ends it (the grant is here). Nothing touches
 * the memory; a failure maps nothing and is left for sl_window_map_run to meet and report. */
void sl_window_premap(struct sl_window *w, uint64_t npages, int (*stop)(void *), void *arg);
/* Maps a fresh chunk (imported handle, now owned by w) at its positions. */
int sl_window_add_chunk(struct sl_window *w, uint64_t pos, uint64_t npages, sl_handle h,
                        struct sl_err *err);
/* Moves from's imported region handles to w (same region, both owning their handles): they
 * need not be imported again. */
void sl_window_take_handles(struct sl_window *w, struct sl_window *from);
/* Unmaps and releases every fresh chunk: the loan's free memory goes back to the device. */
void sl_window_drop_chunks(struct sl_window *w);
void sl_window_free(struct sl_window *w);

int sl_window_alloc_add(struct sl_window *w, void *ptr, uint64_t size, uint64_t id);
/* Removes the allocation at ptr; returns 1 and fills *a if found. */
int sl_window_alloc_take(struct sl_window *w, void *ptr, struct sl_window_alloc *a);

#endif
