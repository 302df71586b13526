/* torch.c - the allocate/free pair that PyTorch's CUDAPluggableAllocator loads.
 *
 * PyTorch calls these on any thread, with its allocator lock held, for whole segments (2 MiB,
 * 20 MiB or multiples of 2 MiB). They must never call Python: on failure alloc returns NULL
 * and sublet_last_error() (thread-local) tells the Python side why. PyTorch does not
 * synchronise before free; the pages stay mapped in the window until the loan ends, and the
 * loan's end synchronises before anything is unmapped.
 */
#include <stdatomic.h>

#include "client.h"

#define SL_TORCH_MAX_DEVICES 64

/* bound: the client that serves allocations now. last: the one that served the last loan,
 * which frees still reach after the loan ended (a leaked tensor dying late: its forfeit
 * allocation is forgotten and, with the last of them, its window unmapped). */
static _Atomic(sublet_client *) bound[SL_TORCH_MAX_DEVICES];
static _Atomic(sublet_client *) last[SL_TORCH_MAX_DEVICES];

SUBLET_EXPORT int sublet_torch_bind(int device, sublet_client *c) {
  if (device < 0 || device >= SL_TORCH_MAX_DEVICES)
    return sl_client_fail(SUBLET_EINVAL, "device %d out of range (0 to %d)", device,
                          SL_TORCH_MAX_DEVICES - 1);
  atomic_store(&bound[device], c);
  if (c != NULL)
    atomic_store(&last[device], c);
  return 0;
}

void sl_torch_forget(sublet_client *c) {
  for (int i = 0; i < SL_TORCH_MAX_DEVICES; i++) {
    sublet_client *expected = c;
    atomic_compare_exchange_strong(&bound[i], &expected, NULL);
    expected = c;
    atomic_compare_exchange_strong(&last[i], &expected, NULL);
  }
}

static sublet_client *client_for(int device) {
  if (device < 0 || device >= SL_TORCH_MAX_DEVICES)
    return NULL;
  return atomic_load(&bound[device]);
}

SUBLET_EXPORT void *sublet_torch_alloc(ssize_t size, int device, void *stream) {
  sublet_client *c = client_for(device);
  void *ptr = NULL;

  if (c == NULL) {
    sl_client_fail(SUBLET_ENOENT, "no sublet loan is bound to CUDA device %d", device);
    return NULL;
  }
  if (size <= 0) {
    sl_client_fail(SUBLET_EINVAL, "allocation of %zd bytes", size);
    return NULL;
  }
  return sublet_alloc(c, (uint64_t)size, &ptr) == 0 ? ptr : NULL;
}

SUBLET_EXPORT void sublet_torch_free(void *ptr, ssize_t size, int device, void *stream) {
  sublet_client *c = client_for(device);

  if (c == NULL && device >= 0 && device < SL_TORCH_MAX_DEVICES)
    c = atomic_load(&last[device]);
  if (c != NULL && ptr != NULL)
    sublet_free(c, ptr);
}
