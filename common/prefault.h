/* prefault.h - host memory's pages made before it is pinned, by several threads at once.
 *
 * Pinning touched memory costs a tenth of what cuMemHostAlloc does, but touching is the slow
 * part for shared memory: a memfd's pages are made, zeroed and filed one by one, about 1.6 GB/s
 * from one thread (a 64 GiB save area took 34 to 42 s to make at a release's first save on an
 * H200's host). Threads making disjoint parts of it scale with the cores.
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
