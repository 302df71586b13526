/* torch.c - the allocate/free pair that PyTorch's CUDAPluggableAllocator loads.
 *
 * A device's allocations go to the loan its client borrows (sublet_torch_bind) or, with no
 * loan bound, to the pool tag bound (sublet_torch_bind_pool: pool.c's arena). The Python side
 * never binds both at once: a loan does not start inside a pool, nor a pool inside a loan.
 *
 * PyTorch calls these on any thread, with its allocator lock held, for whole segments (2 MiB,
 * 20 MiB or multiples of 2 MiB). They must never call Python: on failure alloc returns NULL
 * and sublet_last_error() (thread-local) tells the Python side why. PyTorch does not
 * synchronise before free; the pages stay mapped in the window until the loan ends, and the
 * loan's end synchronises before anything is unmapped.
 * Floor 6 (client.h's floors).
 */
#include <stdatomic.h>

#include "client.h"

#define SL_TORCH_MAX_DEVICES 64

/* bound: the client that serves allocations now. last: the one that served the last loan,
 * which frees still reach after the loan ended (a leaked tensor dying late: its forfeit
 * allocation is forgotten and, with the last of them, its window unmapped). */
static _Atomic(sublet_client *) bound[SL_TORCH_MAX_DEVICES];
static _Atomic(sublet_client *) last[SL_TORCH_MAX_DEVICES];
/* The client whose arena serves the device's pools (kept after the pool is left: its segments
 * are freed later), and the tag bound now (0: none). */
static _Atomic(sublet_client *) pooler[SL_TORCH_MAX_DEVICES];
static _Atomic(uint32_t) pool_tag[SL_TORCH_MAX_DEVICES];

static int check_device(int device) {
  if (device < 0 || device >= SL_TORCH_MAX_DEVICES)
    return sl_client_fail(SUBLET_EINVAL, "device %d out of range (0 to %d)", device,
                          SL_TORCH_MAX_DEVICES - 1);
  return 0;
}

SUBLET_EXPORT int sublet_torch_bind(int device, sublet_client *c) {
  int rc = check_device(device);

  if (rc != 0)
    return rc;
  atomic_store(&bound[device], c);
  if (c != NULL)
    atomic_store(&last[device], c);
  return 0;
}

SUBLET_EXPORT int sublet_torch_bind_pool(int device, sublet_client *c, uint32_t tag) {
  int rc = check_device(device);

  if (rc != 0)
    return rc;
  if (c != NULL)
    atomic_store(&pooler[device], c);
  atomic_store(&pool_tag[device], c != NULL ? tag : 0);
  return 0;
}

void sl_torch_forget(sublet_client *c) {
  for (int i = 0; i < SL_TORCH_MAX_DEVICES; i++) {
    sublet_client *expected = c;
    atomic_compare_exchange_strong(&bound[i], &expected, NULL);
    expected = c;
    atomic_compare_exchange_strong(&last[i], &expected, NULL);
    expected = c;
    if (atomic_compare_exchange_strong(&pooler[i], &expected, NULL))
      atomic_store(&pool_tag[i], 0);
  }
}

static sublet_client *client_for(int device) {
  if (device < 0 || device >= SL_TORCH_MAX_DEVICES)
    return NULL;
  return atomic_load(&bound[device]);
}

SUBLET_EXPORT void *sublet_torch_alloc(ssize_t size, int device, void *stream) {
  sublet_client *c = client_for(device), *p = NULL;
  uint32_t tag = 0;
  void *ptr = NULL;

  if (c == NULL && device >= 0 && device < SL_TORCH_MAX_DEVICES) {
    tag = atomic_load(&pool_tag[device]);
    p = tag != 0 ? atomic_load(&pooler[device]) : NULL;
  }
  if (c == NULL && p == NULL) {
    sl_client_fail(SUBLET_ENOENT, "no sublet loan or pool is bound to CUDA device %d", device);
    return NULL;
  }
  if (size <= 0) {
    sl_client_fail(SUBLET_EINVAL, "allocation of %zd bytes", size);
    return NULL;
  }
  if (c == NULL)
    return sublet_pool_alloc(p, tag, (uint64_t)size, &ptr) == 0 ? ptr : NULL;
  return sublet_alloc(c, (uint64_t)size, &ptr) == 0 ? ptr : NULL;
}

/* A loan's allocation first (during a loan, or a leak dying after it): a loan served in place
 * hands out addresses of the arena's own pages, where a pool segment may start too. */
SUBLET_EXPORT void sublet_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  sublet_client *c = client_for(device), *p;

  if (ptr == NULL || device < 0 || device >= SL_TORCH_MAX_DEVICES)
    return;
  if (c == NULL)
    c = atomic_load(&last[device]);
  if (c != NULL && sublet_free(c, ptr) == 0)
    return;
  p = atomic_load(&pooler[device]);
  if (p != NULL)
    sublet_pool_free(p, ptr);
}
