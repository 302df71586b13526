/* books_space.c - the books of subletd's address space: what each region reserves of the
 * daemon's own mapping, and the bound on what one user's regions reserve (issue 41; the
 * contract is books.h).
 *
 * Every region's pages are mapped in the daemon too (pool.h), in a reservation of its own.
 * A growable region once reserved the device's whole memory up front, with no bound per user:
 * 927 one-page growable regions of one client took a 141 GiB device's daemon's address space,
 * and every user's growable RegionCreate failed. Now a region reserves what it holds, a
 * growable one room that doubles as it grows (the pool moves its mapping), and a user's
 * regions together reserve at most SL_USER_SPACE_DEVICES times the device.
 *
 * Floor 1 (books_impl.h).
 */
#include "books_impl.h"

#include <inttypes.h>

uint64_t sl_books_user_space_limit(const struct sl_books *b) {
  uint64_t n = b->cfg.device_pages;

  return n > UINT64_MAX / SL_USER_SPACE_DEVICES ? UINT64_MAX : n * SL_USER_SPACE_DEVICES;
}

/* Is h the first holder entry of its region (a region held by several counts once)? */
static int held_first(const struct sl_books *b, size_t h) {
  for (size_t i = 0; i < h; i++)
    if (b->held[i].region_id == b->held[h].region_id)
      return 0;
  return 1;
}

uint64_t sl_books_user_space(const struct sl_books *b, uid_t uid) {
  uint64_t pages = 0;

  for (size_t i = 0; i < b->nregions; i++)
    if (b->regions[i].owner.uid == uid)
      pages += b->regions[i].space;
  for (size_t i = 0; i < b->nheld; i++) /* gone, its pages still held by a keeper */
    if (b->held[i].owner.uid == uid && held_first(b, i))
      pages += b->held[i].space;
  return pages;
}

int sl_books_space_check(const struct sl_books *b, uid_t uid, uint64_t more,
                         struct sl_err *err) {
  uint64_t limit = sl_books_user_space_limit(b), has, ps = b->cfg.page_size;
  char h[16], m[16], l[16];

  if (limit == 0 || more == 0)
    return 0;
  has = sl_books_user_space(b, uid);
  if (more <= limit && has <= limit - more)
    return 0;
  return sl_err_set(err, SUBLET_ENOMEM,
                    "user %u's regions reserve %s of subletd's address space, and %s more would "
                    "pass the %s one user may reserve (%d times the device's memory): release "
                    "the regions this user no longer needs (pages a release gave back still "
                    "hold their place), then try again",
                    (unsigned)uid, sl_format_size(h, has * ps),
                    sl_format_size(m, more > UINT64_MAX / ps ? UINT64_MAX : more * ps),
                    sl_format_size(l, limit > UINT64_MAX / ps ? UINT64_MAX : limit * ps),
                    SL_USER_SPACE_DEVICES);
}

/* What uid's bound leaves for region r, its own reservation included. */
static uint64_t room_of(const struct sl_books *b, const struct sl_region *r) {
  uint64_t limit = sl_books_user_space_limit(b), others;

  if (limit == 0)
    return UINT64_MAX;
  others = sl_books_user_space(b, r->owner.uid) - r->space;
  return others < limit ? limit - others : 0;
}

uint64_t sl_books_grow_space(const struct sl_books *b, uint64_t region_id, uint64_t npages) {
  const struct sl_region *r = sl_books_find_region(b, region_id);
  uint64_t want;

  if (r == NULL)
    return npages;
  if (npages <= r->space)
    return r->space;
  want = r->space > UINT64_MAX / 2 ? UINT64_MAX : 2 * r->space;
  if (b->cfg.device_pages != 0)
    want = sl_min_u64(want, b->cfg.device_pages);
  return sl_max_u64(sl_min_u64(want, room_of(b, r)), npages);
}

int sl_books_region_space(struct sl_books *b, uint64_t region_id, uint64_t space) {
  struct sl_region *r = sl_books_find_region(b, region_id);

  if (r == NULL)
    return SUBLET_ENOENT;
  r->space = sl_max_u64(space, r->npages);
  return 0;
}
