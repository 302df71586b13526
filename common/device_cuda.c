/* device_cuda.c - the cuda backend: CUDA virtual memory management through the driver API.
 *
 * libcuda.so.1 is loaded at run time and every entry point is resolved through
 * cuGetProcAddress at a fixed API version, so that nothing needs a GPU or a CUDA toolkit to
 * build and the signatures in device_cuda.h stay those of that version whatever the driver's.
 *
 * Handles are cuMemCreate allocations that can be exported as POSIX file descriptors. The
 * device retains the GPU's primary context (the one PyTorch uses) and pushes it around every
 * call, so that any thread may call and the caller's current context is left as it was.
 * This file opens the device and holds its handles, address space and pinned host memory;
 * device_cuda_copy.c runs the transfers between them.
 *
 * Floor 3 (floors.h).
 */
#include "device_cuda.h"
#include "prefault.h" /* pinning touched memory costs a tenth of cuMemHostAlloc */

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static const struct {
  const char *name;
  size_t offset;
} cuda_symbols[] = {SL_CUDA_CALLS(SL_CUDA_SYMBOL)};

struct cuda_driver cuda_drv;
static struct sl_err load_error;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

/* --- errors */

int cuda_fail(CUresult r, struct sl_err *err, const char *call, const char *advice) {
  const char *name = NULL, *text = NULL;

  if (cuda_drv.cuGetErrorName != NULL)
    cuda_drv.cuGetErrorName(r, &name);
  if (cuda_drv.cuGetErrorString != NULL)
    cuda_drv.cuGetErrorString(r, &text);
  return sl_err_set(err, r == CUDA_ERROR_OUT_OF_MEMORY ? SUBLET_ENOMEM : SUBLET_EDEVICE,
                    "%s failed: %s (%s = %d); %s", call, text != NULL ? text : "unknown error",
                    name != NULL ? name : "CUresult", (int)r, advice);
}

int cuda_check(CUresult r, struct sl_err *err, const char *call, const char *advice) {
  return r == CUDA_SUCCESS ? 0 : cuda_fail(r, err, call, advice);
}

/* --- loading the driver */

static const char no_driver_advice[] =
    "install the NVIDIA driver, or use --backend memfd to run without a GPU";

static int open_libcuda(void **lib, struct sl_err *err) {
  const char *why;

  *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (*lib != NULL)
    return 0;
  why = dlerror();
  return sl_err_set(err, SUBLET_ENOTSUP,
                    "the cuda backend needs the NVIDIA driver (libcuda.so.1): %s; %s",
                    why != NULL ? why : "not found", no_driver_advice);
}

/* symbol at the given API version, through cuGetProcAddress (12.0's variant also says why a
 * symbol is missing; 11.3's does not). */
static int resolve(const char *symbol, int version, void **fn) {
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
  CUresult r;

  *fn = NULL;
  if (cuda_drv.get_proc_v2 != NULL)
    r = cuda_drv.get_proc_v2(symbol, fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  else
    r = cuda_drv.get_proc_v1(symbol, fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
  return r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && *fn != NULL ? 0 : -1;
}

static int find_get_proc(void *lib, struct sl_err *err) {
  *(void **)&cuda_drv.get_proc_v2 = dlsym(lib, "cuGetProcAddress_v2");
  *(void **)&cuda_drv.get_proc_v1 = dlsym(lib, "cuGetProcAddress");
  if (cuda_drv.get_proc_v2 != NULL || cuda_drv.get_proc_v1 != NULL)
    return 0;
  return sl_err_set(err, SUBLET_ENOTSUP,
                    "the NVIDIA driver is too old (no cuGetProcAddress): sublet needs a driver "
                    "for CUDA 12.0 or newer (R525+); update it, or use --backend memfd");
}

static int resolve_calls(struct sl_err *err) {
  size_t i;

  for (i = 0; i < sizeof(cuda_symbols) / sizeof(cuda_symbols[0]); i++) {
    void **slot = (void **)((char *)&cuda_drv + cuda_symbols[i].offset);
    if (resolve(cuda_symbols[i].name, SL_CUDA_API_VERSION, slot) != 0)
      return sl_err_set(err, SUBLET_ENOTSUP,
                        "the NVIDIA driver (CUDA %d.%d) lacks %s: sublet needs a driver for "
                        "CUDA 12.0 or newer (R525+); update the driver, or use --backend memfd",
                        cuda_drv.version / 1000, cuda_drv.version % 1000 / 10,
                        cuda_symbols[i].name);
  }
  return 0;
}

/* The newest cuMemcpyBatchAsync the driver has; SUBLET_CUDA_NO_BATCH=1 forces the per-piece
 * fallback (to compare the two, or to work around a driver bug). */
static void resolve_memcpy_batch(void) {
  static const int versions[] = {13000, 12080};
  const char *off = getenv("SUBLET_CUDA_NO_BATCH");
  size_t i;

  if (off != NULL && strcmp(off, "1") == 0)
    return;
  for (i = 0; i < 2; i++) {
    if (cuda_drv.version >= versions[i] &&
        resolve("cuMemcpyBatchAsync", versions[i], &cuda_drv.memcpy_batch) == 0) {
      cuda_drv.batch_version = versions[i];
      return;
    }
  }
}

static int load_driver(struct sl_err *err) {
  CUresult (*driver_version)(int *version);
  void *lib;
  int rc = open_libcuda(&lib, err);

  if (rc != 0)
    return rc;
  *(void **)&driver_version = dlsym(lib, "cuDriverGetVersion");
  if (driver_version == NULL || driver_version(&cuda_drv.version) != CUDA_SUCCESS)
    return sl_err_set(err, SUBLET_ENOTSUP, "libcuda.so.1 has no working cuDriverGetVersion; %s",
                      no_driver_advice);
  rc = find_get_proc(lib, err);
  if (rc == 0)
    rc = resolve_calls(err);
  if (rc == 0)
    resolve_memcpy_batch();
  return rc;
}

static void load_driver_once(void) {
  load_error.code = load_driver(&load_error);
}

/* --- the calling thread's context */

/* Makes the device's context current for one call; cuda_leave restores the caller's. */
int cuda_enter(struct cuda_device *d, struct sl_err *err) {
  return cuda_check(cuda_drv.cuCtxPushCurrent(d->ctx), err, "cuCtxPushCurrent",
                    "the GPU's context is unusable; restart the process");
}

void cuda_leave(void) {
  CUcontext popped;
  cuda_drv.cuCtxPopCurrent(&popped);
}

/* --- opening: find the GPU, check it can do what sublet needs, set up context and stream */

static int find_by_uuid(const uint8_t *uuid, CUdevice *dev, struct sl_err *err) {
  int count = 0, i;
  char wanted[SL_DEVICE_UUID_TEXT];
  CUuuid u;

  if (cuda_drv.cuDeviceGetCount(&count) != CUDA_SUCCESS)
    count = 0;
  for (i = 0; i < count; i++) {
    if (cuda_drv.cuDeviceGet(dev, i) == CUDA_SUCCESS &&
        cuda_drv.cuDeviceGetUuid(&u, *dev) == CUDA_SUCCESS &&
        memcmp(u.bytes, uuid, 16) == 0)
      return 0;
  }
  return sl_err_set(err, SUBLET_EINVAL,
                    "no GPU with UUID %s among the %d visible; check CUDA_VISIBLE_DEVICES and "
                    "nvidia-smi -L", sl_device_uuid_text(wanted, uuid), count);
}

static int find_by_ordinal(int ordinal, CUdevice *dev, struct sl_err *err) {
  int count = 0;

  if (cuda_drv.cuDeviceGetCount(&count) != CUDA_SUCCESS)
    count = 0;
  if (ordinal < 0 || ordinal >= count)
    return sl_err_set(err, SUBLET_EINVAL,
                      "no GPU number %d: %d visible; check --device and CUDA_VISIBLE_DEVICES",
                      ordinal, count);
  return cuda_check(cuda_drv.cuDeviceGet(dev, ordinal), err, "cuDeviceGet", "check --device");
}

static int find_device(const struct sl_device_params *p, CUdevice *dev, struct sl_err *err) {
  CUresult r = cuda_drv.cuInit(0);

  if (r == CUDA_ERROR_NO_DEVICE)
    return sl_err_set(err, SUBLET_ENOTSUP,
                      "no NVIDIA GPU is visible (cuInit: no CUDA-capable device); check "
                      "CUDA_VISIBLE_DEVICES, or use --backend memfd to run without a GPU");
  if (r != CUDA_SUCCESS)
    return cuda_fail(r, err, "cuInit", "check that the NVIDIA driver works (nvidia-smi)");
  return p->uuid != NULL ? find_by_uuid(p->uuid, dev, err) : find_by_ordinal(p->ordinal, dev, err);
}

static int check_vmm_support(struct cuda_device *d, struct sl_err *err) {
  int vmm = 0, posix_fd = 0;

  cuda_drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                d->dev);
  cuda_drv.cuDeviceGetAttribute(&posix_fd,
                                CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                d->dev);
  if (vmm && posix_fd)
    return 0;
  return sl_err_set(err, SUBLET_ENOTSUP,
                    "device %d (%s) does not support virtual memory management with POSIX file "
                    "descriptor handles; sublet needs it (a Linux driver for CUDA >= 11.x, not "
                    "WSL, not a vGPU profile without it; this driver is CUDA %d.%d)",
                    d->base.info.ordinal, d->base.info.name, cuda_drv.version / 1000,
                    cuda_drv.version % 1000 / 10);
}

/* Whether kernels may read pinned host memory at its host address (device_cuda_copy.c's
 * copies into new pages); SUBLET_CUDA_NO_SM_COPY=1 leaves every copy to the copy engines (to
 * compare the two, or to work around a driver bug). */
static void describe_host_access(struct cuda_device *d) {
  const char *off = getenv("SUBLET_CUDA_NO_SM_COPY");
  int same = 0;

  cuda_drv.cuDeviceGetAttribute(&same, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
                                d->dev);
  d->sm_copies = same == 1 && !(off != NULL && strcmp(off, "1") == 0);
}

static int describe_device(struct cuda_device *d, struct sl_err *err) {
  struct sl_device_info *info = &d->base.info;
  size_t total = 0;
  CUuuid uuid;
  CUresult r;

  snprintf(info->backend, sizeof(info->backend), "cuda");
  info->ordinal = d->dev;
  r = cuda_drv.cuDeviceGetName(info->name, (int)sizeof(info->name), d->dev);
  if (r == CUDA_SUCCESS)
    r = cuda_drv.cuDeviceGetUuid(&uuid, d->dev);
  if (r == CUDA_SUCCESS)
    r = cuda_drv.cuDeviceTotalMem(&total, d->dev);
  if (r != CUDA_SUCCESS)
    return cuda_fail(r, err, "describing the GPU", "check nvidia-smi");
  memcpy(info->uuid, uuid.bytes, sizeof(info->uuid));
  info->total_bytes = total;
  describe_host_access(d);
  return 0;
}

/* Pinned device memory that can be exported as a file descriptor, and its granularity. */
static int setup_allocations(struct cuda_device *d, struct sl_err *err) {
  size_t granularity = 0;
  int rc;

  memset(&d->prop, 0, sizeof(d->prop));
  d->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  d->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  d->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d->prop.location.id = d->dev;
  rc = cuda_check(cuda_drv.cuMemGetAllocationGranularity(&granularity, &d->prop,
                                                         CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                  err, "cuMemGetAllocationGranularity", "check the driver");
  d->base.info.page_size = granularity;
  d->base.info.alloc_headroom = SL_CUDA_ALLOC_HEADROOM;
  return rc;
}

static int setup_context(struct cuda_device *d, struct sl_err *err) {
  int rc = cuda_check(cuda_drv.cuDevicePrimaryCtxRetain(&d->ctx, d->dev), err,
                      "cuDevicePrimaryCtxRetain", "is the GPU in exclusive-process mode?");
  if (rc != 0)
    return rc;
  rc = cuda_enter(d, err);
  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuStreamCreate(&d->stream, CU_STREAM_NON_BLOCKING), err,
                  "cuStreamCreate", "the GPU may be out of memory");
  if (rc == 0)
    rc = cuda_check(cuda_drv.cuStreamCreate(&d->stream2, CU_STREAM_NON_BLOCKING), err,
                    "cuStreamCreate", "the GPU may be out of memory");
  cuda_leave();
  return rc;
}

static void cuda_close(struct sl_device *dev) {
  struct cuda_device *d = to_cuda(dev);

  if (d->stream != NULL && cuda_enter(d, NULL) == 0) {
    cuda_drv.cuStreamSynchronize(d->stream);
    cuda_drv.cuStreamDestroy(d->stream);
    if (d->stream2 != NULL) {
      cuda_drv.cuStreamSynchronize(d->stream2);
      cuda_drv.cuStreamDestroy(d->stream2);
    }
    cuda_kernels_close(d);
    cuda_leave();
  }
  pthread_mutex_destroy(&d->kernels_lock);
  pthread_mutex_destroy(&d->args_lock);
  free(d->args);
  if (d->ctx != NULL)
    cuda_drv.cuDevicePrimaryCtxRelease(d->dev);
  free(d);
}

static int cuda_open(const struct sl_device_params *p, struct sl_device **out,
                     struct sl_err *err) {
  struct cuda_device *d;
  int rc;

  pthread_once(&load_once, load_driver_once);
  if (load_error.code != 0)
    return sl_err_set(err, load_error.code, "%s", load_error.msg);
  d = calloc(1, sizeof(*d));
  if (d == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "cuda backend: out of host memory");
  d->use_batch = cuda_drv.batch_version != 0;
  pthread_mutex_init(&d->kernels_lock, NULL);
  pthread_mutex_init(&d->args_lock, NULL);
  rc = find_device(p, &d->dev, err);
  if (rc == 0)
    rc = describe_device(d, err);
  if (rc == 0)
    rc = check_vmm_support(d, err);
  if (rc == 0)
    rc = setup_context(d, err);
  if (rc == 0)
    rc = setup_allocations(d, err);
  if (rc != 0) {
    cuda_close(&d->base);
    return rc;
  }
  if (p->load_kernels)
    cuda_kernels_preload(d);
  *out = &d->base;
  return 0;
}

static int cuda_free_bytes(struct sl_device *dev, uint64_t *free_bytes, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  size_t free_now = 0, total = 0;
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemGetInfo(&free_now, &total), err, "cuMemGetInfo",
                  "check nvidia-smi");
  cuda_leave();
  *free_bytes = free_now;
  return rc;
}

/* --- handles */

static int cuda_create(struct sl_device *dev, uint64_t size, sl_handle *out,
                       struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  CUmemGenericAllocationHandle h = 0;
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemCreate(&h, size, &d->prop, 0), err, "cuMemCreate",
                  "free GPU memory (other processes: nvidia-smi) or ask for less");
  cuda_leave();
  *out = rc == 0 ? h : 0;
  return rc;
}

static int cuda_release(struct sl_device *dev, sl_handle h) {
  struct cuda_device *d = to_cuda(dev);
  int rc = cuda_enter(d, NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemRelease(h), NULL, "cuMemRelease", "");
  cuda_leave();
  return rc;
}

static int cuda_export(struct sl_device *dev, sl_handle h, int *fd, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemExportToShareableHandle(
                      fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                  err, "cuMemExportToShareableHandle", "check the open-files limit (ulimit -n)");
  cuda_leave();
  if (rc != 0)
    *fd = -1;
  else
    fcntl(*fd, F_SETFD, FD_CLOEXEC); /* the caller owns it; no child should inherit a page */
  return rc;
}

/* The driver takes the fd by value in a void *, and does not take it over. */
static int cuda_import(struct sl_device *dev, int fd, sl_handle *out, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  CUmemGenericAllocationHandle h = 0;
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                  err, "cuMemImportFromShareableHandle",
                  "the fd must come from a cuda daemon on this same GPU");
  cuda_leave();
  *out = rc == 0 ? h : 0;
  return rc;
}

/* --- address space */

static int cuda_reserve(struct sl_device *dev, uint64_t size, void **addr, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  CUdeviceptr ptr = 0;
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemAddressReserve(&ptr, size, dev->info.page_size, 0, 0), err,
                  "cuMemAddressReserve", "the process's GPU address space is exhausted");
  cuda_leave();
  *addr = (void *)(uintptr_t)ptr;
  return rc;
}

static int cuda_unreserve(struct sl_device *dev, void *addr, uint64_t size) {
  int rc = cuda_enter(to_cuda(dev), NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemAddressFree(devptr(addr), size), NULL, "cuMemAddressFree", "");
  cuda_leave();
  return rc;
}

static int cuda_map(struct sl_device *dev, void *addr, uint64_t size, sl_handle h,
                    struct sl_err *err) {
  int rc = cuda_enter(to_cuda(dev), err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemMap(devptr(addr), size, 0, h, 0), err, "cuMemMap",
                  "the range must lie in a reservation, unmapped, and the size match the handle");
  cuda_leave();
  return rc;
}

static int cuda_set_access(struct sl_device *dev, void *addr, uint64_t size,
                           struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  CUmemAccessDesc access;
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = d->dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  rc = cuda_check(cuda_drv.cuMemSetAccess(devptr(addr), size, &access, 1), err, "cuMemSetAccess",
                  "every page of the range must be mapped");
  cuda_leave();
  return rc;
}

/* Waits for the whole context first: a kernel still reading the range would fault. */
static int cuda_unmap(struct sl_device *dev, void *addr, uint64_t size) {
  int rc = cuda_enter(to_cuda(dev), NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuCtxSynchronize(), NULL, "cuCtxSynchronize", "");
  if (rc == 0)
    rc = cuda_check(cuda_drv.cuMemUnmap(devptr(addr), size), NULL, "cuMemUnmap", "");
  cuda_leave();
  return rc;
}

static int cuda_unmap_idle(struct sl_device *dev, void *addr, uint64_t size) {
  int rc = cuda_enter(to_cuda(dev), NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuMemUnmap(devptr(addr), size), NULL, "cuMemUnmap", "");
  cuda_leave();
  return rc;
}

static int cuda_synchronize(struct sl_device *dev, struct sl_err *err) {
  int rc = cuda_enter(to_cuda(dev), err);

  if (rc != 0)
    return rc;
  rc = cuda_check(cuda_drv.cuCtxSynchronize(), err, "cuCtxSynchronize",
                  "a kernel failed earlier; the context is lost: restart the process");
  cuda_leave();
  return rc;
}

/* --- pinned host memory */

/* Every context may copy to and from it, and kernels may read it (copy_by_sms). */
#define HOST_REGISTER (CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP)

static int host_register(struct cuda_device *d, void *mem, uint64_t size, unsigned flags,
                         struct sl_err *err) {
  int rc = cuda_enter(d, err);

  if (rc == 0) {
    rc = cuda_check(cuda_drv.cuMemHostRegister(mem, size, HOST_REGISTER | flags), err,
                    "cuMemHostRegister", "raise the locked-memory limit (ulimit -l)");
    cuda_leave();
  }
  return rc;
}

static int cuda_host_alloc(struct sl_device *dev, uint64_t size, void **p, struct sl_err *err) {
  void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  int rc;

  if (mem == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "cannot map %llu bytes of host memory: %s",
                      (unsigned long long)size, strerror(errno));
  sl_prefault(mem, size);
  rc = host_register(to_cuda(dev), mem, size, 0, err);
  if (rc != 0) {
    munmap(mem, size);
    return rc;
  }
  *p = mem;
  return 0;
}

/* Read-only: pinned read-only where the GPU allows it, else a private copy-on-write mapping
 * (its pages are copies, made once). */
static int host_map_read_only(struct cuda_device *d, int fd, uint64_t offset, uint64_t size,
                              void **p, struct sl_err *err) {
  void *mem = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, (off_t)offset);
  int rc;

  if (mem != MAP_FAILED) {
#ifdef MADV_POPULATE_READ
    madvise(mem, size, MADV_POPULATE_READ);
#endif
    if (host_register(d, mem, size, CU_MEMHOSTREGISTER_READ_ONLY, NULL) == 0) {
      *p = mem;
      return 0;
    }
    munmap(mem, size);
  }
  mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, (off_t)offset);
  if (mem == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOMEM, "cannot map %llu bytes of a host file: %s",
                      (unsigned long long)size, strerror(errno));
  sl_prefault(mem, size);
  rc = host_register(d, mem, size, 0, err);
  if (rc != 0) {
    munmap(mem, size);
    return rc;
  }
  *p = mem;
  return 0;
}

/* Pins a writable mapping the caller made: the memfd's pages are made here, once. */
static int cuda_host_pin(struct sl_device *dev, void *p, uint64_t size, struct sl_err *err) {
  int rc;

  sl_prefault(p, size);
  rc = host_register(to_cuda(dev), p, size, 0, err);
  if (rc == SUBLET_ENOMEM && err != NULL)
    err->code = SUBLET_ENOHOSTMEM; /* pinning failed: host memory, not the device's */
  return rc == SUBLET_ENOMEM ? SUBLET_ENOHOSTMEM : rc;
}

static void cuda_host_unpin(struct sl_device *dev, void *p, uint64_t size) {
  if (cuda_enter(to_cuda(dev), NULL) == 0) {
    cuda_drv.cuMemHostUnregister(p);
    cuda_leave();
  }
}

static int cuda_host_map(struct sl_device *dev, int fd, uint64_t offset, uint64_t size,
                         int writable, void **p, struct sl_err *err) {
  void *mem;
  int rc;

  if (!writable)
    return host_map_read_only(to_cuda(dev), fd, offset, size, p, err);
  mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)offset);
  if (mem == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOMEM, "cannot map %llu bytes of a host file: %s",
                      (unsigned long long)size, strerror(errno));
  rc = cuda_host_pin(dev, mem, size, err);
  if (rc != 0) {
    munmap(mem, size);
    return rc;
  }
  *p = mem;
  return 0;
}

static void cuda_host_free(struct sl_device *dev, void *p, uint64_t size) {
  cuda_host_unpin(dev, p, size);
  munmap(p, size);
}

const struct sl_device_ops sl_device_cuda_ops = {
    .name = "cuda",
    .open = cuda_open,
    .close = cuda_close,
    .free_bytes = cuda_free_bytes,
    .create = cuda_create,
    .release = cuda_release,
    .export_fd = cuda_export,
    .import_fd = cuda_import,
    .reserve = cuda_reserve,
    .unreserve = cuda_unreserve,
    .map = cuda_map,
    .set_access = cuda_set_access,
    .unmap = cuda_unmap,
    .unmap_idle = cuda_unmap_idle,
    .synchronize = cuda_synchronize,
    .host_alloc = cuda_host_alloc,
    .host_map = cuda_host_map,
    .host_free = cuda_host_free,
    .host_pin = cuda_host_pin,
    .host_unpin = cuda_host_unpin,
    .copy = cuda_copy,
    .move = cuda_move,
    .hash = cuda_hash,
};
