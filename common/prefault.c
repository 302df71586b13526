/* prefault.c - host memory's pages made by several threads at once (prefault.h).
 * Floor 1 (floors.h). */
#include "prefault.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#define PREFAULT_PART_MIN (64ull << 20) /* below this a thread costs more than it saves */
#define PREFAULT_ALIGN (2ull << 20)     /* parts begin on huge-page boundaries */

struct part {
  char *mem;
  uint64_t size;
};

static void *make_part(void *arg) {
  const struct part *p = arg;
  uint64_t step = (uint64_t)sysconf(_SC_PAGESIZE);

#ifdef MADV_POPULATE_WRITE
  if (madvise(p->mem, p->size, MADV_POPULATE_WRITE) == 0)
    return NULL;
#endif
  for (uint64_t off = 0; off < p->size; off += step) /* a kernel older than 5.14 */
    ((volatile char *)p->mem)[off] = 0;
  return NULL;
}

/* How many threads a range of size bytes is worth. */
static unsigned thread_count(uint64_t size) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  uint64_t n = size / PREFAULT_PART_MIN;

  if (cpus > 0 && n > (uint64_t)cpus)
    n = (uint64_t)cpus;
  if (n > SL_PREFAULT_THREADS)
    n = SL_PREFAULT_THREADS;
  return n < 1 ? 1 : (unsigned)n;
}

void sl_prefault(void *mem, uint64_t size) {
  struct part parts[SL_PREFAULT_THREADS];
  pthread_t threads[SL_PREFAULT_THREADS];
  int started[SL_PREFAULT_THREADS] = {0};
  unsigned n = thread_count(size);
  uint64_t share = (size / n + PREFAULT_ALIGN - 1) / PREFAULT_ALIGN * PREFAULT_ALIGN, at = 0;

  madvise(mem, size, MADV_HUGEPAGE);
  for (unsigned i = 0; i < n; i++) {
    uint64_t len = size - at < share ? size - at : share;
    parts[i] = (struct part){(char *)mem + at, len};
    at += len;
  }
  for (unsigned i = 1; i < n; i++) /* part 0 is the caller's */
    started[i] = parts[i].size > 0 && pthread_create(&threads[i], NULL, make_part, &parts[i]) == 0;
  make_part(&parts[0]);
  for (unsigned i = 1; i < n; i++) {
    if (started[i])
      pthread_join(threads[i], NULL);
    else if (parts[i].size > 0)
      make_part(&parts[i]);
  }
}
