/* grow.h - the daemon's array helpers (books, plans, checks, the pool): the one growth rule,
 * copies, and the min and max their arithmetic takes. */
#ifndef SL_GROW_H
#define SL_GROW_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t sl_min_u64(uint64_t a, uint64_t b) {
  return a < b ? a : b;
}

static inline uint64_t sl_max_u64(uint64_t a, uint64_t b) {
  return a > b ? a : b;
}

/* Returns p grown to hold at least want elements of elem bytes (capacity doubles from 8), or
 * NULL with p untouched. *cap is updated on success. */
static inline void *sl_grow(void *p, size_t *cap, size_t want, size_t elem) {
  size_t ncap = *cap ? *cap : 8;
  void *np;

  if (want <= *cap)
    return p;
  while (ncap < want)
    ncap *= 2;
  np = realloc(p, ncap * elem);
  if (np != NULL)
    *cap = ncap;
  return np;
}

/* A malloc'd copy of n elements of size bytes; NULL when n is 0 or memory ran out. */
static inline void *sl_dup(const void *v, size_t n, size_t size) {
  void *d = n > 0 ? malloc(n * size) : NULL;

  if (d != NULL)
    memcpy(d, v, n * size);
  return d;
}

#endif
