/* keep.c - libsublet: kept rows of a table as the byte ranges a Lend carries.
 *
 * A paged KV cache keeps hundreds of thousands of live blocks, listed by index. Turning the
 * index list into ranges is one pass here, where numpy took five and milliseconds a loan (the
 * figure: docs/benchmarks.md). No daemon, no device: pure arithmetic over the caller's arrays.
 *
 * A memory pool holds many such tables (one KV cache tensor per layer, its K and V halves)
 * whose live rows are the same block ids: sublet_blocks_ranges finds the runs of the id list
 * once, at the lowest table, and the other tables' ranges are that template shifted, a
 * streaming copy at memory speed, split between threads when it is large.
 * Floor 2 (client.h's floors).
 */
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* nrows rows of row_bytes from offset base must be addressable in 64 bits. */
static int check_table(uint64_t nrows, uint64_t base, uint64_t row_bytes) {
  if (row_bytes == 0 || nrows > (UINT64_MAX - base) / row_bytes)
    return sl_client_fail(SUBLET_EINVAL, "%llu rows of %llu bytes from offset %llu do not fit "
                          "in 64 bits", (unsigned long long)nrows,
                          (unsigned long long)row_bytes, (unsigned long long)base);
  return 0;
}

/* The ranges of rows[0..n) (n > 0) of the table at base into out, a run of consecutive rows
 * one range; their count. *bad is set when the rows break the rules (then out holds rubbish,
 * but nothing past the count of runs the rows would have made, at most n, was written).
 * The run being read stays in registers and is written to its slot at every row: no branch
 * on where runs begin (random in a KV cache's live list), no load from out. */
static size_t rows_to_runs(const int64_t *rows, size_t n, uint64_t nrows, uint64_t base,
                           uint64_t row_bytes, struct sublet_range *out, int *bad) {
  uint64_t start, prev, broken;
  size_t m = 0;

  start = prev = (uint64_t)rows[0];
  broken = prev >= nrows;
  out[0] = (struct sublet_range){base + start * row_bytes, row_bytes};
  for (size_t i = 1; i < n; i++) {
    uint64_t r = (uint64_t)rows[i], begins = r != prev + 1;
    broken |= (r >= nrows) | (r <= prev);
    m += begins;
    start = begins ? r : start;
    out[m] = (struct sublet_range){base + start * row_bytes, (r - start + 1) * row_bytes};
    prev = r;
  }
  *bad = broken != 0;
  return m + 1;
}

/* How many runs rows[0..n) (n > 0) make, without writing them; *bad as above. */
static size_t count_runs(const int64_t *rows, size_t n, uint64_t nrows, int *bad) {
  uint64_t prev = (uint64_t)rows[0], broken = prev >= nrows;
  size_t m = 1;

  for (size_t i = 1; i < n; i++) {
    uint64_t r = (uint64_t)rows[i];
    broken |= (r >= nrows) | (r <= prev);
    m += r != prev + 1;
    prev = r;
  }
  *bad = broken != 0;
  return m;
}

SUBLET_EXPORT int sublet_rows_ranges(const int64_t *rows, size_t n, uint64_t nrows,
                                     uint64_t base, uint64_t row_bytes,
                                     struct sublet_range *out, size_t *nout) {
  size_t m;
  int rc, bad;

  *nout = 0;
  if (n == 0)
    return 0;
  if ((rc = check_table(nrows, base, row_bytes)) < 0)
    return rc;
  m = rows_to_runs(rows, n, nrows, base, row_bytes, out, &bad);
  if (bad)
    return bad_row(rows, n, nrows);
  *nout = m;
  return 0;
}

/* ------------------------------------------------------------------------ many tables */

/* Past this many bytes of output, the copies of the template are split between threads. */
#define BLOCKS_THREADED_BYTES (8u << 20)
#define BLOCKS_MAX_THREADS 8

struct blocks_copy {
  struct sublet_range *out;    /* out[0..m): the template, the ranges at bases[0] */
  size_t m;
  const uint64_t *bases;       /* ascending, unique */
  const size_t *pos;           /* where table j's ranges go; skip[j]: its first is merged */
  const unsigned char *skip;
  size_t first, last;          /* the tables [first, last) that this copy writes, first >= 1 */
};

static void *blocks_copy_run(void *arg) {
  const struct blocks_copy *c = arg;
  const struct sublet_range *t = c->out;

  for (size_t j = c->first; j < c->last; j++) {
    uint64_t delta = c->bases[j] - c->bases[0];
    struct sublet_range *dst = c->out + c->pos[j] - c->skip[j];
    for (size_t k = c->skip[j]; k < c->m; k++)
      dst[k] = (struct sublet_range){t[k].offset + delta, t[k].length};
  }
  return NULL;
}

/* The CPUs this thread may run on (taskset, cgroup cpusets), not all of the machine's. */
static size_t usable_cpus(void) {
  cpu_set_t set;
  long n;

  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
    return (size_t)CPU_COUNT(&set);
  n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 1 ? (size_t)n : 1;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Copies the template to tables 1..nb-1: on this thread, or on up to BLOCKS_MAX_THREADS when
 * the output is large (a thread that cannot start leaves its share to this one). */
static void blocks_copy_all(struct blocks_copy *whole, size_t nb, size_t total) {
  struct blocks_copy part[BLOCKS_MAX_THREADS];
  pthread_t tid[BLOCKS_MAX_THREADS];
  int started[BLOCKS_MAX_THREADS] = {0};
  size_t nt = usable_cpus(), tables = nb - 1;

  if (nt > BLOCKS_MAX_THREADS)
    nt = BLOCKS_MAX_THREADS;
  if (nt > tables)
    nt = tables;
  if (nt <= 1 || total * sizeof(struct sublet_range) < BLOCKS_THREADED_BYTES) {
    whole->first = 1, whole->last = nb;
    blocks_copy_run(whole);
    return;
  }
  for (size_t i = 0; i < nt; i++) {
    part[i] = *whole;
    part[i].first = 1 + tables * i / nt;
    part[i].last = 1 + tables * (i + 1) / nt;
  }
  for (size_t i = 1; i < nt; i++)
    started[i] = pthread_create(&tid[i], NULL, blocks_copy_run, &part[i]) == 0;
  blocks_copy_run(&part[0]);
  for (size_t i = 1; i < nt; i++) {
    if (started[i])
      pthread_join(tid[i], NULL);
    else
      blocks_copy_run(&part[i]);
  }
}

SUBLET_EXPORT int sublet_blocks_ranges(const int64_t *rows, size_t n, uint64_t nrows,
                                       const uint64_t *bases, size_t nbases, uint64_t row_bytes,
                                       struct sublet_range *out, size_t cap, size_t *nout) {
  uint64_t *sorted = NULL, first_rel, end_rel, first_len;
  const uint64_t *b = bases;
  unsigned char *skip;
  size_t m, nb, total, *pos;
  int rc, bad;
  void *scratch;

  *nout = 0;
  if (n == 0 || nbases == 0)
    return 0;
  m = count_runs(rows, n, nrows, &bad);
  if (bad)
    return bad_row(rows, n, nrows);
  /* Tables in ascending order, each once (a repeated base adds nothing). */
  nb = nbases;
  for (size_t j = 1; j < nbases; j++)
    if (bases[j] <= bases[j - 1]) {
      if ((sorted = malloc(nbases * sizeof(*sorted))) == NULL)
        return sl_client_fail(SUBLET_ENOHOSTMEM, "no host memory to sort %zu bases", nbases);
      memcpy(sorted, bases, nbases * sizeof(*sorted));
      qsort(sorted, nbases, sizeof(*sorted), cmp_u64);
      nb = 1;
      for (size_t i = 1; i < nbases; i++)
        if (sorted[i] != sorted[nb - 1])
          sorted[nb++] = sorted[i];
      b = sorted;
      break;
    }
  if ((rc = check_table(nrows, b[nb - 1], row_bytes)) < 0)
    goto done;
  if ((scratch = malloc(nb * (sizeof(*pos) + 1))) == NULL) {
    rc = sl_client_fail(SUBLET_ENOHOSTMEM, "no host memory for %zu bases", nb);
    goto done;
  }
  pos = scratch, skip = (unsigned char *)(pos + nb);
  /* Where each table's ranges go. Its first range merges into the ranges before it when they
   * touch; they must not overlap (rows of one table lying in another's). */
  first_rel = (uint64_t)rows[0] * row_bytes;
  end_rel = ((uint64_t)rows[n - 1] + 1) * row_bytes;
  pos[0] = 0, skip[0] = 0, total = m;
  for (size_t j = 1; j < nb; j++) {
    uint64_t prev_end = b[j - 1] + end_rel, start = b[j] + first_rel;
    if (prev_end > start) {
      rc = sl_client_fail(SUBLET_EINVAL, "the rows at base %llu overlap those at base %llu "
                          "(bases %llu bytes apart, rows spanning %llu bytes): tables must "
                          "not overlap", (unsigned long long)b[j - 1], (unsigned long long)b[j],
                          (unsigned long long)(b[j] - b[j - 1]),
                          (unsigned long long)(end_rel - first_rel));
      goto free_scratch;
    }
    skip[j] = prev_end == start;
    pos[j] = total;
    total += m - skip[j];
  }
  if (total > cap) {
    *nout = total;
    rc = sl_client_fail(SUBLET_E2BIG, "%zu ranges need room for %zu, not %zu", total, total,
                        cap);
    goto free_scratch;
  }
  rows_to_runs(rows, n, nrows, b[0], row_bytes, out, &bad);
  first_len = out[0].length;
  if (nb > 1) {
    struct blocks_copy whole = {out, m, b, pos, skip, 1, nb};
    blocks_copy_all(&whole, nb, total);
  }
  /* A table whose first range touched the ranges before it: they are one range. */
  for (size_t j = 1; j < nb; j++)
    if (skip[j])
      out[pos[j] - 1].length += first_len;
  *nout = total;
  rc = 0;
free_scratch:
  free(scratch);
done:
  free(sorted);
  return rc;
}
