/* pool.h - the daemon's physical memory: region pages, fresh chunks and the host save area.
 *
 * The books say what happens; the pool does it on the device. Every region's pages are also
 * mapped in the daemon's own address space, contiguously, so that it can save and restore kept
 * bytes itself whatever its clients do (or whether they still live). The host save area is kept
 * between loans: pinning host memory is the most expensive step of a first offload.
 */
#ifndef SL_POOL_H
#define SL_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "device.h"

struct sl_pool;

int sl_pool_new(struct sl_device *dev, struct sl_pool **out);
/* Releases everything the pool still holds. */
void sl_pool_free(struct sl_pool *p);

int sl_pool_region_create(struct sl_pool *p, uint64_t region_id, uint64_t npages,
                          struct sl_err *err);
void sl_pool_region_destroy(struct sl_pool *p, uint64_t region_id);
/* Exports pages [first, first+count) as new fds into fds[]; the caller closes them. */
int sl_pool_export_pages(struct sl_pool *p, uint64_t region_id, uint64_t first, uint32_t count,
                         int *fds, struct sl_err *err);

/* A fresh chunk of npages, exported as *fd (the caller closes it once sent). */
int sl_pool_chunk_create(struct sl_pool *p, uint64_t chunk_id, uint64_t npages, int *fd,
                         struct sl_err *err);
void sl_pool_chunk_release(struct sl_pool *p, uint64_t chunk_id);
uint64_t sl_pool_chunk_pages(const struct sl_pool *p);

/* Copies kept bytes of a region to the host save area (save) or back (restore). Copies are
 * struct sl_copy with dev_off a region offset and host_off an offset into the save area;
 * *seconds (may be NULL) gets the time spent. */
int sl_pool_save(struct sl_pool *p, uint64_t region_id, const struct sl_copy *c, size_t n,
                 double *seconds, struct sl_err *err);
int sl_pool_restore(struct sl_pool *p, uint64_t region_id, const struct sl_copy *c, size_t n,
                    double *seconds, struct sl_err *err);
/* Moves kept bytes inside a region, device to device (struct sl_move, region offsets). */
int sl_pool_move(struct sl_pool *p, uint64_t region_id, const struct sl_move *m, size_t n,
                 double *seconds, struct sl_err *err);
/* Makes sure the save area holds at least bytes (pinning ahead of need). */
int sl_pool_host_reserve(struct sl_pool *p, uint64_t bytes, struct sl_err *err);
uint64_t sl_pool_host_bytes(const struct sl_pool *p);

#endif
