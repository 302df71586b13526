/* keep.c - libsublet: kept rows of a table as the byte ranges a Lend carries.
 *
 * A paged KV cache keeps hundreds of thousands of live blocks, listed by index. Turning the
 * index list into ranges is one pass here; in numpy it was five passes and 2.5 to 4 ms for
 * 300,000 blocks, per loan. No daemon, no device: pure arithmetic over the caller's arrays.
 */
#include "client.h"

/* The first row that breaks the rules (ascending, no repeats, below nrows): the error. */
static int bad_row(const int64_t *rows, size_t n, uint64_t nrows) {
  for (size_t i = 0; i < n; i++) {
    int64_t r = rows[i];
    int outside = r < 0 || (uint64_t)r >= nrows;
    if (outside || (i > 0 && r <= rows[i - 1]))
      return sl_client_fail(SUBLET_EINVAL, "row %lld (index %zu) is %s: rows must ascend, "
                            "without repeats, from 0 to %llu", (long long)r, i,
                            outside ? "out of range" : "out of order",
                            (unsigned long long)(nrows - 1));
  }
  return sl_client_fail(SUBLET_EINVAL, "invalid rows"); /* not reached */
}

SUBLET_EXPORT int sublet_rows_ranges(const int64_t *rows, size_t n, uint64_t nrows,
                                     uint64_t base, uint64_t row_bytes,
                                     struct sublet_range *out, size_t *nout) {
  uint64_t bad, start, prev;
  size_t m = 0;

  *nout = 0;
  if (n == 0)
    return 0;
  if (row_bytes == 0 || nrows > (UINT64_MAX - base) / row_bytes)
    return sl_client_fail(SUBLET_EINVAL, "%llu rows of %llu bytes from offset %llu do not fit "
                          "in 64 bits", (unsigned long long)nrows,
                          (unsigned long long)row_bytes, (unsigned long long)base);
  /* The run being read stays in registers and is written to its slot at every row: no
   * branch on where runs begin (random in a KV cache's live list), no load from out. The
   * rules are checked as it goes and reported after. */
  start = prev = (uint64_t)rows[0];
  bad = prev >= nrows;
  out[0] = (struct sublet_range){base + start * row_bytes, row_bytes};
  for (size_t i = 1; i < n; i++) {
    uint64_t r = (uint64_t)rows[i], begins = r != prev + 1;
    bad |= (r >= nrows) | (r <= prev);
    m += begins;
    start = begins ? r : start;
    out[m] = (struct sublet_range){base + start * row_bytes, (r - start + 1) * row_bytes};
    prev = r;
  }
  m++;
  if (bad)
    return bad_row(rows, n, nrows);
  *nout = m;
  return 0;
}
