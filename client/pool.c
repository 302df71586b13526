/* pool.c - libsublet: pools, a process's memory sub-allocated by tag from one growable region.
 *
 * Engines and trainers make the memory worth lending as many tensors (a KV cache tensor per
 * layer, an optimizer's state per parameter). Inside `sublet.pool(tag)` every segment PyTorch's
 * allocator asks for comes here (torch.c) and is carved out of the client's arena: one growable
 * region, whose pages every tag shares. One region for all tags, because a loan lends one
 * region (one Lend, one window): lending tag "kv" keeps the pages of tag "weights" whole, and
 * lending both is one loan. A segment is a run of whole pages, first fit; when no gap holds it
 * the region grows by what its free tail lacks, so many small tensors cost no region each at
 * the driver and nothing is taken ahead of need. Freed segments leave free pages inside the
 * region: later segments reuse them, and a loan of any tag lends them as unkept; an arena
 * left with no segment gives its region back. After a grouped resume (release.c) a page
 * group never holds pages of two tags: a segment does not take part of one another tag holds,
 * and a tag's pages reach over the free rest of its groups, so its release gives them back.
 *
 * Loans of the arena: the pages a loan lends (a tag's, the free ones) and those it pins (the
 * other tags') are decided from the segments, so no segment may be made between that decision
 * and the loan's end, or a tensor of another tag could land in a free page the loan lends.
 * sublet_pool_hold() switches the refusal of allocations on (SUBLET_EBUSY) under pool_lock
 * before the caller reads the segments it plans with, and the Lend of the arena's region is
 * refused without it (lend.c); sublet_pool_unhold() after the loan is reclaimed. The layout
 * id, bumped under pool_lock at every segment made, tells a plan made before the hold whether
 * it still holds (nothing was allocated since).
 *
 * Releases of the arena (release.c) are made under the same hold: the pages a release gives
 * to the driver are a tag's, read from the segments, and a segment made between that reading
 * and subletd's answer could be another tag's tensor in a page the tag's freed tensor left:
 * given away with it. sublet_release refuses an arena without the hold; the caller unholds
 * once the release is made (a release offer: once the offer has ended, since it is made when
 * taken). While a release is live, segments are made again, but never in a page of its set
 * (sl_release_set_in): a released page has no memory behind its address until the resume,
 * and a page that stayed holds kept bytes moved into its unkept bytes, even once the tensor
 * that had it is freed.
 *
 * Lock order, for every pool and loan of a process: pool_lock, then the client's lock
 * (c->lock: region growth, the lent check, every request), then c->send_lock; never the
 * reverse. (The Python package takes sublet._pool._lock before any of them.)
 * Floor 5 (client.h's floors).
 */
#include "client.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

struct pool_seg {
  uint64_t first, npages; /* region pages [first, first + npages) */
  uint32_t tag;
};

struct sl_arena {
  sublet_region *region; /* NULL until the first segment */
  struct pool_seg *segs; /* ascending first, disjoint */
  size_t nsegs, cap;
  int held;              /* sublet_pool_hold: a loan of the region is being made or runs */
  uint64_t layout;       /* bumped at every segment made (the region grows only then) */
};

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t pages_for(const sublet_client *c, uint64_t size) {
  return size / c->info.page_size + (size % c->info.page_size != 0);
}

/* The first page of [from, to) that a release gave back to the driver (it has no handle
 * until the resume) or that a live release holds (a stayed page: kept bytes may have moved
 * into it), or to: a segment must not get one. The caller holds the client's lock (a release
 * or a resume changes both). */
static uint64_t released_in(const struct sl_arena *a, uint64_t from, uint64_t to) {
  const sublet_region *r = a->region;
  uint64_t end = r == NULL ? from : to < r->npages ? to : r->npages;

  for (uint64_t p = from; p < end; p++)
    if (r->handles[p] == 0)
      return p;
  return r == NULL || r->releases == NULL ? to : sl_release_set_in(r, from, to);
}

/* Does a segment of a tag other than tag hold a page of [from, to)? */
static int other_tag_in(const struct sl_arena *a, uint64_t from, uint64_t to, uint32_t tag) {
  for (size_t i = 0; i < a->nsegs && a->segs[i].first < to; i++)
    if (a->segs[i].first + a->segs[i].npages > from && a->segs[i].tag != tag)
      return 1;
  return 0;
}

/* Page p's group (a resume's, client.h): its first page, and the page after it. Regions
 * without groups have a group per page. */
static uint64_t group_head(const sublet_region *r, uint64_t p) {
  while (r->span != NULL && p > 0 && r->span[p] == 0)
    p--;
  return p;
}

static uint64_t group_end(const sublet_region *r, uint64_t p) {
  uint64_t head = group_head(r, p);

  return head + (r->span != NULL ? r->span[head] : 1);
}

/* The end of page p's group if the group reaches outside [from, to) and another tag's
 * segment holds a page of it, else 0. */
static uint64_t shared_group_end(const struct sl_arena *a, uint64_t p, uint64_t from,
                                 uint64_t to, uint32_t tag) {
  uint64_t head = group_head(a->region, p), end = group_end(a->region, p);

  return (head < from || end > to) && other_tag_in(a, head, end, tag) ? end : 0;
}

/* Can tag's segment have pages [from, to)? If not, *next is the first page a fit may start
 * at. Not a released page; nor part of a page group whose other part another tag holds: a
 * group goes to the driver whole or not at all, so a release of either tag would give none
 * of it back (only the groups the range cuts, at its ends, can reach outside it). */
static int fits(const struct sl_arena *a, uint64_t from, uint64_t to, uint32_t tag,
                uint64_t *next) {
  const sublet_region *r = a->region;
  uint64_t hole = released_in(a, from, to), last, end = 0;

  if (hole < to) {
    *next = hole + 1;
    return 0;
  }
  if (r == NULL || r->span == NULL || from >= r->npages)
    return 1;
  last = (to < r->npages ? to : r->npages) - 1;
  if ((end = shared_group_end(a, last, from, to, tag)) == 0)
    end = shared_group_end(a, from, from, to, tag);
  *next = end;
  return end == 0;
}

/* The first gap of at least npages live pages below the region's end that tag may have, or
 * the free tail (the region then grows to fit) when none is; *at is the segment it goes
 * before. */
static uint64_t first_fit(const struct sl_arena *a, uint64_t npages, uint32_t tag, size_t *at) {
  uint64_t start = 0, next;

  for (size_t i = 0; i <= a->nsegs; i++) {
    uint64_t end = i < a->nsegs ? a->segs[i].first : UINT64_MAX;
    while (start <= end && end - start >= npages) { /* a group's end may pass the gap's */
      if (fits(a, start, start + npages, tag, &next)) {
        *at = i;
        return start;
      }
      start = next;
    }
    if (i < a->nsegs)
      start = a->segs[i].first + a->segs[i].npages;
  }
  *at = a->nsegs; /* not reached: the tail is endless */
  return start;
}

/* Is the arena's region lent (a loan of it is in progress, or not yet reclaimed)? Then no
 * page of it is this process's to hand out. */
static int arena_lent(sublet_client *c, const struct sl_arena *a) {
  int lent;

  if (a->region == NULL)
    return 0;
  pthread_mutex_lock(&c->lock);
  lent = a->region->rescue != NULL;
  pthread_mutex_unlock(&c->lock);
  return lent;
}

/* Makes the region hold pages [0, end): created at the first segment, grown after. */
static int arena_reach(sublet_client *c, struct sl_arena *a, uint64_t end) {
  uint64_t bytes = end * c->info.page_size;
  int rc;

  if (a->region == NULL) {
    if ((rc = sublet_region_create_growable(c, bytes, &a->region)) == 0)
      a->region->torch_blocks = 1;
    return rc;
  }
  if (end <= a->region->npages)
    return 0;
  return sublet_region_grow(a->region, bytes);
}

static int arena_insert(struct sl_arena *a, size_t at, struct pool_seg seg) {
  if (a->nsegs == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 16;
    struct pool_seg *segs = realloc(a->segs, cap * sizeof(*segs));
    if (segs == NULL)
      return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory for a pool's segments");
    a->segs = segs;
    a->cap = cap;
  }
  memmove(&a->segs[at + 1], &a->segs[at], (a->nsegs - at) * sizeof(*a->segs));
  a->segs[at] = seg;
  a->nsegs++;
  return 0;
}

static int arena_get(sublet_client *c, struct sl_arena **out) {
  if (c->arena == NULL && (c->arena = calloc(1, sizeof(*c->arena))) == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  *out = c->arena;
  return 0;
}

/* An arena that holds no segment gives its region back (the device memory goes back to the
 * driver), unless it is held or lent: then the next segment after the loan finds it. */
static void arena_settle(sublet_client *c, struct sl_arena *a) {
  if (a->nsegs > 0 || a->region == NULL || a->held || arena_lent(c, a))
    return;
  if (sublet_region_release(a->region) == 0)
    a->region = NULL;
}

/* Does growing the arena to pages [0, end) leave c's margin free on the device? The device's
 * free memory is the daemon's figure, asked afresh (only when there is a margin and the arena
 * grows). */
static int check_margin(sublet_client *c, const struct sl_arena *a, uint64_t end) {
  uint64_t have = a->region != NULL ? a->region->npages : 0, grow;
  struct sublet_info info;
  char g[16], m[16], f[16];
  int rc;

  if (c->pool_margin == 0 || end <= have)
    return 0;
  if ((rc = sublet_get_info(c, &info)) != 0)
    return rc;
  grow = (end - have) * c->info.page_size;
  if (c->pool_margin <= info.free_bytes && grow <= info.free_bytes - c->pool_margin)
    return 0;
  return sl_client_fail(SUBLET_ENOMEM, "out of memory under the margin: a pool allocation "
                        "needs %s more device memory, which would leave less than the margin "
                        "of %s free (%s free); free some, or lower the margin "
                        "(memory_margin_bytes, sublet_pool_set_margin)",
                        sl_format_size(g, grow), sl_format_size(m, c->pool_margin),
                        sl_format_size(f, info.free_bytes));
}

static int pool_alloc_locked(sublet_client *c, uint32_t tag, uint64_t size, void **ptr) {
  struct sl_arena *a = NULL;
  uint64_t npages = pages_for(c, size), first;
  size_t at;
  int rc;

  if ((rc = arena_get(c, &a)) != 0)
    return rc;
  /* Held: the loan's pages were decided from the segments as they are; any page this would
   * take (a free one, or one the region grows by) is lent. Refused, never waited for: the
   * caller may be PyTorch's allocator, whose lock the borrower's own allocations need. */
  if (a->held || arena_lent(c, a))
    return sl_client_fail(SUBLET_EBUSY, "the pools' memory on this device (region %llu) is "
                          "being lent or released, or is lent: no pool allocation of any tag "
                          "is served until the loan has ended or the release is made (its "
                          "page could be one the loan lends or the release gives away); "
                          "allocate again once the loan is back or the release is made",
                          a->region != NULL ? (unsigned long long)a->region->id : 0ULL);
  /* The fit reads the region's handles and releases, which a release or a resume of another
   * thread changes under the client's lock (taken after pool_lock, as everywhere). */
  pthread_mutex_lock(&c->lock);
  first = first_fit(a, npages, tag, &at);
  pthread_mutex_unlock(&c->lock);
  if (npages > UINT64_MAX / c->info.page_size - first) /* its end in bytes would wrap */
    return sl_client_fail(SUBLET_ENOMEM, "a pool allocation of %llu bytes is past any "
                          "device's memory", (unsigned long long)size);
  if ((rc = check_margin(c, a, first + npages)) != 0 ||
      (rc = arena_reach(c, a, first + npages)) != 0)
    return rc;
  a->layout++; /* a page is taken, or the region grew */
  if ((rc = arena_insert(a, at, (struct pool_seg){first, npages, tag})) != 0) {
    arena_settle(c, a); /* a region made for this segment alone goes back */
    return rc;
  }
  *ptr = (char *)a->region->base + first * c->info.page_size;
  return 0;
}

SUBLET_EXPORT int sublet_pool_alloc(sublet_client *c, uint32_t tag, uint64_t size, void **ptr) {
  int rc;

  *ptr = NULL;
  if (tag == 0 || size == 0)
    return sl_client_fail(SUBLET_EINVAL, "a pool allocation needs a tag (not 0) and a size "
                          "(not 0): got tag %u, %llu bytes", tag, (unsigned long long)size);
  pthread_mutex_lock(&pool_lock);
  rc = pool_alloc_locked(c, tag, size, ptr);
  pthread_mutex_unlock(&pool_lock);
  return rc;
}

/* The segment that starts at ptr, or -1. */
static ssize_t seg_at(const sublet_client *c, const void *ptr) {
  const struct sl_arena *a = c->arena;
  uint64_t off, page;
  size_t lo = 0, hi;

  if (a == NULL || a->region == NULL || (const char *)ptr < (const char *)a->region->base)
    return -1;
  off = (uint64_t)((const char *)ptr - (const char *)a->region->base);
  page = off / c->info.page_size;
  if (off % c->info.page_size != 0 || page >= a->region->npages)
    return -1;
  for (hi = a->nsegs; lo < hi;) {
    size_t mid = lo + (hi - lo) / 2;
    if (a->segs[mid].first < page)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < a->nsegs && a->segs[lo].first == page ? (ssize_t)lo : -1;
}

SUBLET_EXPORT int sublet_pool_set_margin(sublet_client *c, uint64_t bytes) {
  pthread_mutex_lock(&pool_lock);
  c->pool_margin = bytes;
  pthread_mutex_unlock(&pool_lock);
  return 0;
}

SUBLET_EXPORT int sublet_pool_free(sublet_client *c, void *ptr) {
  ssize_t i;

  pthread_mutex_lock(&pool_lock);
  i = seg_at(c, ptr);
  if (i >= 0) { /* its pages stay in the region, free: the next segment or loan takes them */
    struct sl_arena *a = c->arena;
    memmove(&a->segs[i], &a->segs[i + 1], (a->nsegs - (size_t)i - 1) * sizeof(*a->segs));
    a->nsegs--;
    arena_settle(c, a);
  }
  pthread_mutex_unlock(&pool_lock);
  return i >= 0 ? 0 : sl_client_fail(SUBLET_ENOENT, "%p is no sublet pool allocation", ptr);
}

SUBLET_EXPORT int sublet_pool_owns(sublet_client *c, const void *ptr) {
  int owns;

  pthread_mutex_lock(&pool_lock);
  owns = seg_at(c, ptr) >= 0;
  pthread_mutex_unlock(&pool_lock);
  return owns;
}

/* The region's own mark (lend.c refuses a Lend of an arena without it), set with the
 * arena's: a region made while held cannot be (no segment is made then). */
static void mark_held(struct sl_arena *a, int held) {
  a->held = held;
  if (a->region != NULL)
    atomic_store(&a->region->pool_held, held);
}

SUBLET_EXPORT int sublet_pool_hold(sublet_client *c, uint64_t *layout) {
  struct sl_arena *a = NULL;
  int rc;

  pthread_mutex_lock(&pool_lock);
  if ((rc = arena_get(c, &a)) == 0 && a->held)
    rc = sl_client_fail(SUBLET_EBUSY, "the pools of this client are held for a loan already "
                        "(or a release being made or offered): one loan or release of the "
                        "arena is made at a time");
  if (rc == 0) {
    mark_held(a, 1);
    if (layout != NULL)
      *layout = a->layout;
  }
  pthread_mutex_unlock(&pool_lock);
  return rc;
}

SUBLET_EXPORT int sublet_pool_unhold(sublet_client *c) {
  pthread_mutex_lock(&pool_lock);
  if (c->arena != NULL && c->arena->held) {
    mark_held(c->arena, 0);
    arena_settle(c, c->arena); /* emptied during the loan: its region goes now */
  }
  pthread_mutex_unlock(&pool_lock);
  return 0;
}

SUBLET_EXPORT uint64_t sublet_pool_layout(sublet_client *c) {
  uint64_t layout;

  pthread_mutex_lock(&pool_lock);
  layout = c->arena != NULL ? c->arena->layout : 0;
  pthread_mutex_unlock(&pool_lock);
  return layout;
}

SUBLET_EXPORT sublet_region *sublet_pool_region(sublet_client *c) {
  sublet_region *r;

  pthread_mutex_lock(&pool_lock);
  r = c->arena != NULL ? c->arena->region : NULL;
  pthread_mutex_unlock(&pool_lock);
  return r;
}

/* A tag's pages [*first, *end) widened to the whole page groups they cut, where the rest of
 * those groups is no other tag's (first_fit keeps it so; a group made before it kept
 * nothing so is left cut): then the tag's release gives its groups back whole. */
static void widen_to_groups(const struct sl_arena *a, uint32_t tag, uint64_t *first,
                            uint64_t *end) {
  const sublet_region *r = a->region;
  uint64_t head, stop;

  if (r == NULL || r->span == NULL || *end > r->npages)
    return;
  head = group_head(r, *first);
  stop = group_end(r, *end - 1);
  if (head < *first && !other_tag_in(a, head, *first, tag))
    *first = head;
  if (stop > *end && !other_tag_in(a, *end, stop, tag))
    *end = stop;
}

/* The pages of tag (0: every tag's), as byte ranges, ascending and disjoint: each segment
 * widened to its whole groups (widen_to_groups), two in one group then merged. */
SUBLET_EXPORT int sublet_pool_segments(sublet_client *c, uint32_t tag, struct sublet_range *out,
                                       size_t n, size_t *count) {
  const struct sl_arena *a;
  uint64_t ps = c->info.page_size, first, end;
  size_t m = 0;

  pthread_mutex_lock(&pool_lock);
  a = c->arena;
  for (size_t i = 0; a != NULL && i < a->nsegs; i++) {
    if (tag != 0 && a->segs[i].tag != tag)
      continue;
    first = a->segs[i].first;
    end = first + a->segs[i].npages;
    if (tag != 0)
      widen_to_groups(a, tag, &first, &end);
    if (m > 0 && m <= n && out[m - 1].offset + out[m - 1].length > first * ps) {
      uint64_t last_end = out[m - 1].offset + out[m - 1].length; /* one group: merged */
      out[m - 1].length = (end * ps > last_end ? end * ps : last_end) - out[m - 1].offset;
      continue;
    }
    if (m < n)
      out[m] = (struct sublet_range){first * ps, (end - first) * ps};
    m++;
  }
  pthread_mutex_unlock(&pool_lock);
  *count = m;
  return 0;
}

void sl_pool_forget(sublet_client *c) {
  /* The region itself goes with the client's other regions (sl_region_forget_all). Under
   * pool_lock: a pool free that another thread began before sl_torch_forget finishes first. */
  pthread_mutex_lock(&pool_lock);
  if (c->arena != NULL)
    free(c->arena->segs);
  free(c->arena);
  c->arena = NULL;
  pthread_mutex_unlock(&pool_lock);
}
