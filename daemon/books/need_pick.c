/* need_pick.c - which pages a release by need gives back (books.h, sl_release_need; used by
 * books_release.c for a release's first need and for each increment). Plain C, no I/O.
 *
 * Any choice of R pages sends the same bytes to the host, max(0, K - (n - R) x page): the
 * holes of the pages that stay take the rest of the released pages' kept bytes. What differs
 * is the bytes moved on the GPU (the released pages' kept bytes) and the runs of released
 * pages: each run is made again as its own allocations at the resume, and a run costs what
 * NEED_RUN_BYTES moved would (docs/benchmarks.md, "Releases by need": 30 %-kept blocks at
 * 64 GiB, the fewest-kept pages released as 5,240 runs, made again in 7.7 s).
 * So two candidates are costed, moved bytes + NEED_HOST_WEIGHT x host bytes + the runs, and
 * the cheaper taken: the units with the fewest kept bytes per page (few bytes moved, maybe
 * many runs), and the consecutive units holding the need with the fewest kept bytes (one run
 * unless pinned pages cut it; whole groups, so the host figure favours the window that
 * overshoots least).
 *
 * Floor 1 (books_impl.h).
 */
#include <stdlib.h>
#include <string.h>

#include "books_impl.h"

/* A run of released pages, made again at the resume, costs about 1.5 ms on an H100
 * (docs/benchmarks.md): what moving 1 GiB there and back costs at the GPU's 1.5 TB/s. */
#define NEED_RUN_BYTES (1ull << 30)
/* A byte over the host link (about 55 GB/s pinned) costs what 27 moved on the GPU do. */
#define NEED_HOST_WEIGHT 27u

struct need_set {
  uint64_t pages, kept, runs;
};

uint64_t sl_need_pick_cost(const struct sl_need_choice *c, uint64_t pages, uint64_t kept,
                           uint64_t runs) {
  uint64_t stays = (c->npages - pages) * c->page_size;
  uint64_t host = c->kept_all > stays ? c->kept_all - stays : 0;

  return kept + NEED_HOST_WEIGHT * host + NEED_RUN_BYTES * runs;
}

/* Fewest kept bytes per page first (a unit with none costs nothing), then ascending. */
static int unit_cmp(const void *a, const void *b) {
  const struct sl_need_unit *x = *(const struct sl_need_unit *const *)a;
  const struct sl_need_unit *y = *(const struct sl_need_unit *const *)b;
  uint64_t l = x->kept * y->size, r = y->kept * x->size;

  if (l != r)
    return l < r ? -1 : 1;
  return x->first < y->first ? -1 : x->first > y->first;
}

/* The units with the fewest kept bytes per page until count pages, marked in took[]. */
static int fewest_kept(const struct sl_need_choice *c, uint8_t *took, struct need_set *set) {
  const struct sl_need_unit **order = malloc((c->nunits + 1) * sizeof(*order));

  if (order == NULL)
    return -1;
  for (size_t i = 0; i < c->nunits; i++)
    order[i] = &c->units[i];
  qsort(order, c->nunits, sizeof(*order), unit_cmp);
  *set = (struct need_set){0};
  for (size_t i = 0; i < c->nunits && set->pages < c->count; i++) {
    took[order[i] - c->units] = 1;
    set->pages += order[i]->size;
    set->kept += order[i]->kept;
  }
  for (size_t i = 0; i < c->nunits; i++)
    set->runs += took[i] && (i == 0 || !took[i - 1] || !c->units[i].joins);
  free(order);
  return 0;
}

/* The consecutive units [*lo, *hi) holding count pages at least that cost least. */
static uint64_t best_window(const struct sl_need_choice *c, size_t *lo, size_t *hi) {
  const struct sl_need_unit *u = c->units;
  uint64_t pages = 0, kept = 0, gaps = 0, best = UINT64_MAX;

  for (size_t i = 0, j = 0; i < c->nunits; i++) {
    for (; j < c->nunits && pages < c->count; j++) {
      pages += u[j].size;
      kept += u[j].kept;
      gaps += j > i && !u[j].joins;
    }
    if (pages < c->count)
      break;
    uint64_t cost = sl_need_pick_cost(c, pages, kept, 1 + gaps);
    if (cost < best) {
      best = cost;
      *lo = i;
      *hi = j;
    }
    pages -= u[i].size;
    kept -= u[i].kept;
    gaps -= i + 1 < j && !u[i + 1].joins;
  }
  return best;
}

int sl_need_pick(const struct sl_need_choice *c, uint8_t *released) {
  uint8_t *took = calloc(c->nunits + 1, 1);
  struct need_set few;
  size_t lo = 0, hi = 0;

  if (took == NULL || fewest_kept(c, took, &few) != 0) {
    free(took);
    return SUBLET_ENOHOSTMEM;
  }
  if (best_window(c, &lo, &hi) < sl_need_pick_cost(c, few.pages, few.kept, few.runs)) {
    memset(took, 0, c->nunits);
    memset(took + lo, 1, hi - lo);
  }
  for (size_t i = 0; i < c->nunits; i++)
    if (took[i])
      memset(released + c->units[i].first, 1, c->units[i].size);
  free(took);
  return 0;
}
