/* grow.h - the one growth rule of the daemon's arrays (books, plans, checks). */
#ifndef SL_GROW_H
#define SL_GROW_H

#include <stdlib.h>

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

#endif
