/* prefault.h - host memory's pages made before it is pinned, by several threads at once.
 *
 * Pinning touched memory costs a fraction of what cuMemHostAlloc does, but touching is the
 * slow part for shared memory: a memfd's pages are made, zeroed and filed one by one, tens of
 * seconds for a large save area from one thread (docs/benchmarks.md). Threads making disjoint
 * parts of it scale with the cores.
 */
#ifndef SL_PREFAULT_H
#define SL_PREFAULT_H

#include <stdint.h>

/* The most threads one call uses (the caller's among them). */
#define SL_PREFAULT_THREADS 8

/* Makes every page of [mem, mem + size) (a writable mapping, page aligned) resident, asking
 * for huge pages where the kernel gives them: with up to SL_PREFAULT_THREADS threads for large
 * ranges, one below 64 MiB. Never fails: a part whose thread cannot start is made by the
 * caller's thread. */
void sl_prefault(void *mem, uint64_t size);

#endif
