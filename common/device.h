/* device.h - the device behind a small interface, shared by subletd and the client library.
 *
 * It mirrors the CUDA driver's virtual memory management: physical allocations (handles),
 * exported as file descriptors and imported in another process, mapped into reserved address
 * ranges, and copies between device memory and (pinned) host memory. Two backends:
 *
 *   cuda   the real one: libcuda.so.1 loaded at run time (dlopen), so nothing needs a GPU or a
 *          CUDA toolkit to build. Handles are cuMemCreate allocations with POSIX-fd handles.
 *   memfd  pages are memfd files, mapping is mmap into reserved address space, copies memcpy.
 *          It lets every machine (CI has no GPU) run daemon and clients end to end for real.
 *
 * All functions return 0 or a negative SUBLET_E* code and fill err (may be NULL) on failure.
 * Sizes given to create/map/unmap are whole multiples of info.page_size.
 */
#ifndef SL_DEVICE_H
#define SL_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

/* A physical allocation. cuda: a CUmemGenericAllocationHandle. memfd: the memfd's fd + 1
 * (so that 0 is never a valid handle). The device that made or imported it owns it. */
typedef uint64_t sl_handle;

/* Where a copy goes. SL_COPY_TO_NEW_PAGES is to device pages just made (a resume's): the cuda
 * backend then reads the host memory with SMs rather than copy engines (device_cuda_copy.c
 * says why); otherwise it is SL_COPY_TO_DEVICE. */
enum sl_copy_dir { SL_COPY_TO_HOST, SL_COPY_TO_DEVICE, SL_COPY_TO_NEW_PAGES };

struct sl_device_params {
  const char *backend;      /* "cuda" or "memfd" */
  int ordinal;              /* cuda: device number, used when uuid is NULL */
  const uint8_t *uuid;      /* cuda: find the device with this UUID (16 bytes), or NULL */
  uint64_t page_size;       /* memfd: 0 = $SUBLET_MEMFD_PAGE_SIZE or 2 MiB; cuda: ignored */
  uint64_t total_bytes;     /* memfd: 0 = $SUBLET_MEMFD_TOTAL or 1 GiB; cuda: ignored */
  int load_kernels;         /* cuda: compile the GPU kernels at open (the daemon's moves),
                               not at their first use */
};

struct sl_device_info {
  char backend[16];
  char name[96];
  uint8_t uuid[16];
  int ordinal;
  uint64_t page_size;   /* the allocation granularity: 2 MiB on an H200 */
  uint64_t total_bytes;
  /* Free bytes a taker cannot have: the driver keeps some back from an allocation of all
   * that is free (cuda: SL_CUDA_ALLOC_HEADROOM; memfd: 0). A release by need counts the free
   * bytes less this. */
  uint64_t alloc_headroom;
};

/* A UUID as nvidia-smi -L and `sublet status` write it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-..."
 * (40 characters); returns buf. */
#define SL_DEVICE_UUID_TEXT 41
const char *sl_device_uuid_text(char buf[SL_DEVICE_UUID_TEXT], const uint8_t uuid[16]);

/* One contiguous piece of a batched copy, as offsets from the two bases. */
struct sl_copy {
  uint64_t dev_off;
  uint64_t host_off;
  uint64_t len;
};

/* One piece of a move inside device memory, as offsets from one base: src and dst never
 * overlap, nor do two pieces of one batch. */
struct sl_move {
  uint64_t src_off;
  uint64_t dst_off;
  uint64_t len;
};

struct sl_device;

int sl_device_open(const struct sl_device_params *p, struct sl_device **out, struct sl_err *err);
void sl_device_close(struct sl_device *d);
const struct sl_device_info *sl_device_info(const struct sl_device *d);
/* Device memory not in use by anyone (cuMemGetInfo's free; memfd: total less what the daemon
 * created). */
int sl_device_free_bytes(struct sl_device *d, uint64_t *free_bytes, struct sl_err *err);

int sl_device_create(struct sl_device *d, uint64_t size, sl_handle *out, struct sl_err *err);
int sl_device_release(struct sl_device *d, sl_handle h);
/* A new fd for h; the caller owns it and closes it once sent. */
int sl_device_export(struct sl_device *d, sl_handle h, int *fd, struct sl_err *err);
/* A handle of this device for the allocation behind fd; fd stays the caller's to close. */
int sl_device_import(struct sl_device *d, int fd, sl_handle *out, struct sl_err *err);

int sl_device_reserve(struct sl_device *d, uint64_t size, void **addr, struct sl_err *err);
int sl_device_unreserve(struct sl_device *d, void *addr, uint64_t size);
/* Maps all of h (size bytes) at addr inside a reservation; access is granted separately, once
 * for a whole range, because per-page access calls cost far more than one over the range. */
int sl_device_map(struct sl_device *d, void *addr, uint64_t size, sl_handle h,
                  struct sl_err *err);
int sl_device_set_access(struct sl_device *d, void *addr, uint64_t size, struct sl_err *err);
/* Unmaps exactly one earlier mapping. Waits for the device to be idle first: touching an
 * unmapped address is a GPU fault, not an error. */
int sl_device_unmap(struct sl_device *d, void *addr, uint64_t size);
/* The same without waiting: for many unmaps after one sl_device_synchronize() (a wait per
 * page costs more than the unmap itself). It may also be tried on a range of adjacent
 * mappings at once; where that fails, unmap them one by one (unmapping what is no longer
 * mapped fails harmlessly). */
int sl_device_unmap_idle(struct sl_device *d, void *addr, uint64_t size);
/* Unmaps npages pages mapped one by one at addr, adjacent (after a synchronize): in one call
 * where the device takes it, else page by page (what was not mapped is skipped). */
void sl_device_unmap_pages(struct sl_device *d, void *addr, uint64_t npages);
/* Waits until all work queued on the device by this process has finished. */
int sl_device_synchronize(struct sl_device *d, struct sl_err *err);

/* Host memory the device copies to and from at full speed (pinned, for cuda). */
int sl_device_host_alloc(struct sl_device *d, uint64_t size, void **p, struct sl_err *err);
/* The same over size bytes of a file (a memfd: memory that outlives this process, shared with
 * another) from offset, a multiple of the system page size; writable 0 maps it read-only
 * (the fd may be read-only then). fd stays the caller's. */
int sl_device_host_map(struct sl_device *d, int fd, uint64_t offset, uint64_t size, int writable,
                       void **p, struct sl_err *err);
/* Frees what host_alloc or host_map gave. */
void sl_device_host_free(struct sl_device *d, void *p, uint64_t size);
/* Pins size bytes at p of a writable shared mapping the caller made itself (and keeps: unpin
 * before unmapping it), for copies at full speed: for a memfd sealed against new writable
 * mappings (common/seal.h), where host_map cannot map it writable any more. */
int sl_device_host_pin(struct sl_device *d, void *p, uint64_t size, struct sl_err *err);
void sl_device_host_unpin(struct sl_device *d, void *p, uint64_t size);

/* Runs n copies between dev_base and host_base in one batch and waits for them. Neighbouring
 * pieces should already be coalesced by the caller; the backend batches the rest. */
int sl_device_copy(struct sl_device *d, enum sl_copy_dir dir, void *dev_base, void *host_base,
                   const struct sl_copy *copies, size_t n, struct sl_err *err);

/* Runs n moves inside the device memory mapped at base (src to dst, device to device) in one
 * batch and waits for them: on cuda at device speed, not over the host link. */
int sl_device_move(struct sl_device *d, void *base, const struct sl_move *moves, size_t n,
                   struct sl_err *err);
/* verify's checksums: out[i] is the hash.h sum of bytes [offset, offset + length) of
 * ranges[i] in the memory mapped at base (a mapping of this device, its first byte aligned to
 * 16), all ranges at once. Waits for the device's queued work first; returns when out is
 * filled. */
int sl_device_hash(struct sl_device *d, const void *base, const struct sublet_range *ranges,
                   size_t n, uint64_t *out, struct sl_err *err);

/* Backend table; device.c dispatches through it. */
struct sl_device_ops {
  const char *name;
  int (*open)(const struct sl_device_params *p, struct sl_device **out, struct sl_err *err);
  void (*close)(struct sl_device *d);
  int (*free_bytes)(struct sl_device *d, uint64_t *free_bytes, struct sl_err *err);
  int (*create)(struct sl_device *d, uint64_t size, sl_handle *out, struct sl_err *err);
  int (*release)(struct sl_device *d, sl_handle h);
  int (*export_fd)(struct sl_device *d, sl_handle h, int *fd, struct sl_err *err);
  int (*import_fd)(struct sl_device *d, int fd, sl_handle *out, struct sl_err *err);
  int (*reserve)(struct sl_device *d, uint64_t size, void **addr, struct sl_err *err);
  int (*unreserve)(struct sl_device *d, void *addr, uint64_t size);
  int (*map)(struct sl_device *d, void *addr, uint64_t size, sl_handle h, struct sl_err *err);
  int (*set_access)(struct sl_device *d, void *addr, uint64_t size, struct sl_err *err);
  int (*unmap)(struct sl_device *d, void *addr, uint64_t size);
  int (*unmap_idle)(struct sl_device *d, void *addr, uint64_t size);
  int (*synchronize)(struct sl_device *d, struct sl_err *err);
  int (*host_alloc)(struct sl_device *d, uint64_t size, void **p, struct sl_err *err);
  int (*host_map)(struct sl_device *d, int fd, uint64_t offset, uint64_t size, int writable,
                  void **p, struct sl_err *err);
  void (*host_free)(struct sl_device *d, void *p, uint64_t size);
  int (*host_pin)(struct sl_device *d, void *p, uint64_t size, struct sl_err *err);
  void (*host_unpin)(struct sl_device *d, void *p, uint64_t size);
  int (*copy)(struct sl_device *d, enum sl_copy_dir dir, void *dev_base, void *host_base,
              const struct sl_copy *copies, size_t n, struct sl_err *err);
  int (*move)(struct sl_device *d, void *base, const struct sl_move *moves, size_t n,
              struct sl_err *err);
  int (*hash)(struct sl_device *d, const void *base, const struct sublet_range *ranges,
              size_t n, uint64_t *out, struct sl_err *err);
};

/* Every backend's struct starts with this. */
struct sl_device {
  const struct sl_device_ops *ops;
  struct sl_device_info info;
};

extern const struct sl_device_ops sl_device_memfd_ops;
extern const struct sl_device_ops sl_device_cuda_ops;

#endif
