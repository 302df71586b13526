/* device_cuda.c - the cuda backend: CUDA virtual memory management through the driver API.
 *
 * libcuda.so.1 is loaded at run time and every entry point is resolved through
 * cuGetProcAddress at a fixed API version, so that nothing needs a GPU or a CUDA toolkit to
 * build and the signatures below stay those of that version whatever the driver's version.
 * No CUDA header is included: the few types and values used are declared here, checked against
 * cuda.h of CUDA 13.0 (layouts and values have been stable since their introduction).
 *
 * Handles are cuMemCreate allocations that can be exported as POSIX file descriptors. The
 * device retains the GPU's primary context (the one PyTorch uses) and pushes it around every
 * call, so that any thread may call and the caller's current context is left as it was.
 * Copies run on one non-blocking stream owned by the device, batched with cuMemcpyBatchAsync
 * where the driver has it. The kernels of kernels.cu (embedded PTX, one module loaded with
 * cuModuleLoadData) run moves inside device memory (SMs copy device to device far faster than
 * copy engines do) and verify's checksums, each as one launch over all its pieces.
 */
#include "device.h"
#include "hash.h"
#include "kernels.h"
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

/* --- driver types and values (as in cuda.h 13.0) */

typedef enum cudaError_enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NO_DEVICE = 100,
  CUDA_ERROR_NOT_SUPPORTED = 801,
} CUresult;

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUuuid_st {
  char bytes[16];
} CUuuid;

typedef enum CUdevice_attribute_enum {
  CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
} CUdevice_attribute;

typedef enum CUmemAllocationHandleType_enum {
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
} CUmemAllocationHandleType;

typedef enum CUmemAccess_flags_enum {
  CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
} CUmemAccess_flags;

typedef enum CUmemLocationType_enum {
  CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
} CUmemLocationType;

typedef enum CUmemAllocationType_enum {
  CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
} CUmemAllocationType;

typedef enum CUmemAllocationGranularity_flags_enum {
  CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
} CUmemAllocationGranularity_flags;

typedef enum CUmemcpySrcAccessOrder_enum {
  CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1,
} CUmemcpySrcAccessOrder;

typedef enum CUdriverProcAddressQueryResult_enum {
  CU_GET_PROC_ADDRESS_SUCCESS = 0,
} CUdriverProcAddressQueryResult;

typedef struct CUmemLocation_st {
  CUmemLocationType type;
  int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
  CUmemAllocationType type;
  CUmemAllocationHandleType requestedHandleTypes;
  CUmemLocation location;
  void *win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
  CUmemLocation location;
  CUmemAccess_flags flags;
} CUmemAccessDesc;

typedef struct CUmemcpyAttributes_st {
  CUmemcpySrcAccessOrder srcAccessOrder;
  CUmemLocation srcLocHint;
  CUmemLocation dstLocHint;
  unsigned int flags;
} CUmemcpyAttributes;

#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_READ_ONLY 0x08
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_GET_PROC_ADDRESS_DEFAULT 0

/* --- entry points, with their signatures at API version 12000 (cudaTypedefs.h's PFN_*) */

#define SL_CUDA_API_VERSION 12000

#define SL_CUDA_CALLS(X)                                                                      \
  X(cuInit, (unsigned int flags))                                                             \
  X(cuDeviceGetCount, (int *count))                                                           \
  X(cuDeviceGet, (CUdevice * dev, int ordinal))                                               \
  X(cuDeviceGetName, (char *name, int len, CUdevice dev))                                     \
  X(cuDeviceGetUuid, (CUuuid * uuid, CUdevice dev))                                           \
  X(cuDeviceGetAttribute, (int *value, CUdevice_attribute attr, CUdevice dev))                \
  X(cuDeviceTotalMem, (size_t * bytes, CUdevice dev))                                         \
  X(cuDevicePrimaryCtxRetain, (CUcontext * ctx, CUdevice dev))                                \
  X(cuDevicePrimaryCtxRelease, (CUdevice dev))                                                \
  X(cuCtxPushCurrent, (CUcontext ctx))                                                        \
  X(cuCtxPopCurrent, (CUcontext * ctx))                                                       \
  X(cuCtxSynchronize, (void))                                                                 \
  X(cuMemGetInfo, (size_t * free_bytes, size_t * total_bytes))                                \
  X(cuMemGetAllocationGranularity, (size_t * granularity, const CUmemAllocationProp *prop,    \
                                    CUmemAllocationGranularity_flags option))                 \
  X(cuMemCreate, (CUmemGenericAllocationHandle * h, size_t size,                              \
                  const CUmemAllocationProp *prop, unsigned long long flags))                 \
  X(cuMemRelease, (CUmemGenericAllocationHandle h))                                           \
  X(cuMemExportToShareableHandle, (void *shareable, CUmemGenericAllocationHandle h,           \
                                   CUmemAllocationHandleType type, unsigned long long flags)) \
  X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle * h, void *os_handle,       \
                                     CUmemAllocationHandleType type))                         \
  X(cuMemAddressReserve, (CUdeviceptr * ptr, size_t size, size_t alignment, CUdeviceptr addr, \
                          unsigned long long flags))                                          \
  X(cuMemAddressFree, (CUdeviceptr ptr, size_t size))                                         \
  X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,   \
               unsigned long long flags))                                                     \
  X(cuMemUnmap, (CUdeviceptr ptr, size_t size))                                               \
  X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)) \
  X(cuMemHostRegister, (void *p, size_t size, unsigned int flags))                            \
  X(cuMemHostUnregister, (void *p))                                                           \
  X(cuStreamCreate, (CUstream * stream, unsigned int flags))                                  \
  X(cuStreamDestroy, (CUstream stream))                                                       \
  X(cuStreamSynchronize, (CUstream stream))                                                   \
  X(cuMemcpyDtoHAsync, (void *dst, CUdeviceptr src, size_t size, CUstream stream))            \
  X(cuMemcpyHtoDAsync, (CUdeviceptr dst, const void *src, size_t size, CUstream stream))      \
  X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream stream))      \
  X(cuMemAlloc, (CUdeviceptr * ptr, size_t size))                                             \
  X(cuMemFree, (CUdeviceptr ptr))                                                             \
  X(cuMemsetD8Async, (CUdeviceptr dst, unsigned char value, size_t n, CUstream stream))       \
  X(cuModuleLoadData, (CUmodule * module, const void *image))                                 \
  X(cuModuleUnload, (CUmodule module))                                                        \
  X(cuModuleGetFunction, (CUfunction * fn, CUmodule module, const char *name))                \
  X(cuLaunchKernel, (CUfunction fn, unsigned int grid_x, unsigned int grid_y,                 \
                     unsigned int grid_z, unsigned int block_x, unsigned int block_y,         \
                     unsigned int block_z, unsigned int shared_bytes, CUstream stream,        \
                     void **params, void **extra))                                            \
  X(cuGetErrorString, (CUresult error, const char **text))                                    \
  X(cuGetErrorName, (CUresult error, const char **name))

/* cuMemcpyBatchAsync came with 12.8; CUDA 13.0 dropped its failIdx argument. cuGetProcAddress
 * hands out the variant of the version asked for, so each is called with its own signature. */
typedef CUresult (*memcpy_batch_v12080_fn)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                           size_t count, CUmemcpyAttributes *attrs,
                                           size_t *attr_idxs, size_t num_attrs,
                                           size_t *fail_idx, CUstream stream);
typedef CUresult (*memcpy_batch_v13000_fn)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                                           size_t count, CUmemcpyAttributes *attrs,
                                           size_t *attr_idxs, size_t num_attrs,
                                           CUstream stream);

typedef CUresult (*get_proc_v12000_fn)(const char *symbol, void **pfn, int version,
                                       cuuint64_t flags,
                                       CUdriverProcAddressQueryResult *status);
typedef CUresult (*get_proc_v11030_fn)(const char *symbol, void **pfn, int version,
                                       cuuint64_t flags);

#define SL_CUDA_MEMBER(name, params) CUresult (*name) params;
#define SL_CUDA_SYMBOL(name, params) {#name, offsetof(struct cuda_driver, name)},

/* The driver, loaded once per process and never unloaded (CUDA does not support unloading). */
struct cuda_driver {
  get_proc_v12000_fn get_proc_v2; /* cuGetProcAddress_v2, CUDA 12.0+ */
  get_proc_v11030_fn get_proc_v1; /* cuGetProcAddress, CUDA 11.3+: used when v2 is missing */
  SL_CUDA_CALLS(SL_CUDA_MEMBER)
  int version; /* cuDriverGetVersion: 13000 for CUDA 13.0 */
  int batch_version; /* 13000, 12080, or 0 without cuMemcpyBatchAsync */
  void *memcpy_batch; /* of the signature batch_version says */
};

static const struct {
  const char *name;
  size_t offset;
} cuda_symbols[] = {SL_CUDA_CALLS(SL_CUDA_SYMBOL)};

static struct cuda_driver drv;
static struct sl_err load_error;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

/* How many pieces go into one cuMemcpyBatchAsync call: bounds the scratch arrays (96 KiB). */
#define BATCH_PIECES 4096

/* The kernels of kernels.cu, by the names they have in its module. */
enum cuda_kernel { KERNEL_MOVE_RANGES, KERNEL_HASH_RANGES, N_KERNELS };
static const char *const kernel_names[N_KERNELS] = {"sl_move_ranges", "sl_hash_ranges"};

struct cuda_device {
  struct sl_device base;
  CUdevice dev;
  CUcontext ctx;     /* the primary context, retained */
  CUstream stream;   /* for copies; owned */
  CUmemAllocationProp prop;
  int use_batch;     /* cleared if the driver refuses batches on this device */
  pthread_mutex_t kernels_lock; /* guards module, kernels and kernels_failed */
  CUmodule module;   /* kernels.cu, loaded at the first launch; owned */
  CUfunction kernels[N_KERNELS];
  int kernels_failed; /* the module could not be loaded (moves then use batched copies) */
  CUstream stream2;  /* staged copies' second slot; owned */
  pthread_mutex_t args_lock; /* one transfer at a time uses args */
  uint64_t *args;    /* pinned launch arguments (pinned_args); owned */
  size_t args_bytes;
};

static struct cuda_device *to_cuda(struct sl_device *d) {
  return (struct cuda_device *)d;
}

static CUdeviceptr devptr(const void *p) {
  return (CUdeviceptr)(uintptr_t)p;
}

/* --- errors */

static int cuda_fail(CUresult r, struct sl_err *err, const char *call, const char *advice) {
  const char *name = NULL, *text = NULL;

  if (drv.cuGetErrorName != NULL)
    drv.cuGetErrorName(r, &name);
  if (drv.cuGetErrorString != NULL)
    drv.cuGetErrorString(r, &text);
  return sl_err_set(err, r == CUDA_ERROR_OUT_OF_MEMORY ? SUBLET_ENOMEM : SUBLET_EDEVICE,
                    "%s failed: %s (%s = %d); %s", call, text != NULL ? text : "unknown error",
                    name != NULL ? name : "CUresult", (int)r, advice);
}

static int cuda_check(CUresult r, struct sl_err *err, const char *call, const char *advice) {
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
  if (drv.get_proc_v2 != NULL)
    r = drv.get_proc_v2(symbol, fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
  else
    r = drv.get_proc_v1(symbol, fn, version, CU_GET_PROC_ADDRESS_DEFAULT);
  return r == CUDA_SUCCESS && status == CU_GET_PROC_ADDRESS_SUCCESS && *fn != NULL ? 0 : -1;
}

static int find_get_proc(void *lib, struct sl_err *err) {
  *(void **)&drv.get_proc_v2 = dlsym(lib, "cuGetProcAddress_v2");
  *(void **)&drv.get_proc_v1 = dlsym(lib, "cuGetProcAddress");
  if (drv.get_proc_v2 != NULL || drv.get_proc_v1 != NULL)
    return 0;
  return sl_err_set(err, SUBLET_ENOTSUP,
                    "the NVIDIA driver is too old (no cuGetProcAddress): sublet needs a driver "
                    "for CUDA 12.0 or newer (R525+); update it, or use --backend memfd");
}

static int resolve_calls(struct sl_err *err) {
  size_t i;

  for (i = 0; i < sizeof(cuda_symbols) / sizeof(cuda_symbols[0]); i++) {
    void **slot = (void **)((char *)&drv + cuda_symbols[i].offset);
    if (resolve(cuda_symbols[i].name, SL_CUDA_API_VERSION, slot) != 0)
      return sl_err_set(err, SUBLET_ENOTSUP,
                        "the NVIDIA driver (CUDA %d.%d) lacks %s: sublet needs a driver for "
                        "CUDA 12.0 or newer (R525+); update the driver, or use --backend memfd",
                        drv.version / 1000, drv.version % 1000 / 10, cuda_symbols[i].name);
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
    if (drv.version >= versions[i] &&
        resolve("cuMemcpyBatchAsync", versions[i], &drv.memcpy_batch) == 0) {
      drv.batch_version = versions[i];
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
  if (driver_version == NULL || driver_version(&drv.version) != CUDA_SUCCESS)
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
static int cuda_enter(struct cuda_device *d, struct sl_err *err) {
  return cuda_check(drv.cuCtxPushCurrent(d->ctx), err, "cuCtxPushCurrent",
                    "the GPU's context is unusable; restart the process");
}

static void cuda_leave(void) {
  CUcontext popped;
  drv.cuCtxPopCurrent(&popped);
}

/* --- opening: find the GPU, check it can do what sublet needs, set up context and stream */

static int find_by_uuid(const uint8_t *uuid, CUdevice *dev, struct sl_err *err) {
  int count = 0, i;
  char wanted[SL_DEVICE_UUID_TEXT];
  CUuuid u;

  if (drv.cuDeviceGetCount(&count) != CUDA_SUCCESS)
    count = 0;
  for (i = 0; i < count; i++) {
    if (drv.cuDeviceGet(dev, i) == CUDA_SUCCESS && drv.cuDeviceGetUuid(&u, *dev) == CUDA_SUCCESS &&
        memcmp(u.bytes, uuid, 16) == 0)
      return 0;
  }
  return sl_err_set(err, SUBLET_EINVAL,
                    "no GPU with UUID %s among the %d visible; check CUDA_VISIBLE_DEVICES and "
                    "nvidia-smi -L", sl_device_uuid_text(wanted, uuid), count);
}

static int find_by_ordinal(int ordinal, CUdevice *dev, struct sl_err *err) {
  int count = 0;

  if (drv.cuDeviceGetCount(&count) != CUDA_SUCCESS)
    count = 0;
  if (ordinal < 0 || ordinal >= count)
    return sl_err_set(err, SUBLET_EINVAL,
                      "no GPU number %d: %d visible; check --device and CUDA_VISIBLE_DEVICES",
                      ordinal, count);
  return cuda_check(drv.cuDeviceGet(dev, ordinal), err, "cuDeviceGet", "check --device");
}

static int find_device(const struct sl_device_params *p, CUdevice *dev, struct sl_err *err) {
  CUresult r = drv.cuInit(0);

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

  drv.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d->dev);
  drv.cuDeviceGetAttribute(&posix_fd,
                           CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, d->dev);
  if (vmm && posix_fd)
    return 0;
  return sl_err_set(err, SUBLET_ENOTSUP,
                    "device %d (%s) does not support virtual memory management with POSIX file "
                    "descriptor handles; sublet needs it (a Linux driver for CUDA >= 11.x, not "
                    "WSL, not a vGPU profile without it; this driver is CUDA %d.%d)",
                    d->base.info.ordinal, d->base.info.name, drv.version / 1000,
                    drv.version % 1000 / 10);
}

static int describe_device(struct cuda_device *d, struct sl_err *err) {
  struct sl_device_info *info = &d->base.info;
  size_t total = 0;
  CUuuid uuid;
  CUresult r;

  snprintf(info->backend, sizeof(info->backend), "cuda");
  info->ordinal = d->dev;
  r = drv.cuDeviceGetName(info->name, (int)sizeof(info->name), d->dev);
  if (r == CUDA_SUCCESS)
    r = drv.cuDeviceGetUuid(&uuid, d->dev);
  if (r == CUDA_SUCCESS)
    r = drv.cuDeviceTotalMem(&total, d->dev);
  if (r != CUDA_SUCCESS)
    return cuda_fail(r, err, "describing the GPU", "check nvidia-smi");
  memcpy(info->uuid, uuid.bytes, sizeof(info->uuid));
  info->total_bytes = total;
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
  rc = cuda_check(drv.cuMemGetAllocationGranularity(&granularity, &d->prop,
                                                    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                  err, "cuMemGetAllocationGranularity", "check the driver");
  d->base.info.page_size = granularity;
  return rc;
}

static int setup_context(struct cuda_device *d, struct sl_err *err) {
  int rc = cuda_check(drv.cuDevicePrimaryCtxRetain(&d->ctx, d->dev), err,
                      "cuDevicePrimaryCtxRetain", "is the GPU in exclusive-process mode?");
  if (rc != 0)
    return rc;
  rc = cuda_enter(d, err);
  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuStreamCreate(&d->stream, CU_STREAM_NON_BLOCKING), err, "cuStreamCreate",
                  "the GPU may be out of memory");
  if (rc == 0)
    rc = cuda_check(drv.cuStreamCreate(&d->stream2, CU_STREAM_NON_BLOCKING), err,
                    "cuStreamCreate", "the GPU may be out of memory");
  cuda_leave();
  return rc;
}

static void cuda_close(struct sl_device *dev) {
  struct cuda_device *d = to_cuda(dev);

  if (d->stream != NULL && cuda_enter(d, NULL) == 0) {
    drv.cuStreamSynchronize(d->stream);
    drv.cuStreamDestroy(d->stream);
    if (d->stream2 != NULL) {
      drv.cuStreamSynchronize(d->stream2);
      drv.cuStreamDestroy(d->stream2);
    }
    if (d->args != NULL)
      drv.cuMemHostUnregister(d->args);
    if (d->module != NULL)
      drv.cuModuleUnload(d->module);
    cuda_leave();
  }
  pthread_mutex_destroy(&d->kernels_lock);
  pthread_mutex_destroy(&d->args_lock);
  free(d->args);
  if (d->ctx != NULL)
    drv.cuDevicePrimaryCtxRelease(d->dev);
  free(d);
}

static void preload_kernels(struct cuda_device *d);

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
  d->use_batch = drv.batch_version != 0;
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
    preload_kernels(d);
  *out = &d->base;
  return 0;
}

static int cuda_free_bytes(struct sl_device *dev, uint64_t *free_bytes, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  size_t free_now = 0, total = 0;
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuMemGetInfo(&free_now, &total), err, "cuMemGetInfo", "check nvidia-smi");
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
  rc = cuda_check(drv.cuMemCreate(&h, size, &d->prop, 0), err, "cuMemCreate",
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
  rc = cuda_check(drv.cuMemRelease(h), NULL, "cuMemRelease", "");
  cuda_leave();
  return rc;
}

static int cuda_export(struct sl_device *dev, sl_handle h, int *fd, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  int rc = cuda_enter(d, err);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuMemExportToShareableHandle(fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                   0),
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
  rc = cuda_check(drv.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
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
  rc = cuda_check(drv.cuMemAddressReserve(&ptr, size, dev->info.page_size, 0, 0), err,
                  "cuMemAddressReserve", "the process's GPU address space is exhausted");
  cuda_leave();
  *addr = (void *)(uintptr_t)ptr;
  return rc;
}

static int cuda_unreserve(struct sl_device *dev, void *addr, uint64_t size) {
  int rc = cuda_enter(to_cuda(dev), NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuMemAddressFree(devptr(addr), size), NULL, "cuMemAddressFree", "");
  cuda_leave();
  return rc;
}

static int cuda_map(struct sl_device *dev, void *addr, uint64_t size, sl_handle h,
                    struct sl_err *err) {
  int rc = cuda_enter(to_cuda(dev), err);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuMemMap(devptr(addr), size, 0, h, 0), err, "cuMemMap",
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
  rc = cuda_check(drv.cuMemSetAccess(devptr(addr), size, &access, 1), err, "cuMemSetAccess",
                  "every page of the range must be mapped");
  cuda_leave();
  return rc;
}

/* Waits for the whole context first: a kernel still reading the range would fault. */
static int cuda_unmap(struct sl_device *dev, void *addr, uint64_t size) {
  int rc = cuda_enter(to_cuda(dev), NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuCtxSynchronize(), NULL, "cuCtxSynchronize", "");
  if (rc == 0)
    rc = cuda_check(drv.cuMemUnmap(devptr(addr), size), NULL, "cuMemUnmap", "");
  cuda_leave();
  return rc;
}

static int cuda_unmap_idle(struct sl_device *dev, void *addr, uint64_t size) {
  int rc = cuda_enter(to_cuda(dev), NULL);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuMemUnmap(devptr(addr), size), NULL, "cuMemUnmap", "");
  cuda_leave();
  return rc;
}

static int cuda_synchronize(struct sl_device *dev, struct sl_err *err) {
  int rc = cuda_enter(to_cuda(dev), err);

  if (rc != 0)
    return rc;
  rc = cuda_check(drv.cuCtxSynchronize(), err, "cuCtxSynchronize",
                  "a kernel failed earlier; the context is lost: restart the process");
  cuda_leave();
  return rc;
}

/* --- pinned host memory */

static int host_register(struct cuda_device *d, void *mem, uint64_t size, unsigned flags,
                         struct sl_err *err) {
  int rc = cuda_enter(d, err);

  if (rc == 0) {
    rc = cuda_check(drv.cuMemHostRegister(mem, size, CU_MEMHOSTREGISTER_PORTABLE | flags), err,
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
    drv.cuMemHostUnregister(p);
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

/* --- copies */

/* Scratch for one cuMemcpyBatchAsync call: the driver reads the arrays during the call only. */
struct batch {
  CUdeviceptr dsts[BATCH_PIECES];
  CUdeviceptr srcs[BATCH_PIECES];
  size_t sizes[BATCH_PIECES];
};

static void piece_ends(enum sl_copy_dir dir, char *dev_mem, char *host_mem,
                       const struct sl_copy *c, CUdeviceptr *dst, CUdeviceptr *src) {
  CUdeviceptr on_dev = devptr(dev_mem + c->dev_off), on_host = devptr(host_mem + c->host_off);
  *dst = dir == SL_COPY_TO_HOST ? on_host : on_dev;
  *src = dir == SL_COPY_TO_HOST ? on_dev : on_host;
}

static CUresult call_memcpy_batch(struct batch *b, size_t n, CUstream stream) {
  CUmemcpyAttributes attrs;
  size_t attr_idx = 0, fail_idx = 0;

  memset(&attrs, 0, sizeof(attrs));
  attrs.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
  if (drv.batch_version >= 13000)
    return ((memcpy_batch_v13000_fn)drv.memcpy_batch)(b->dsts, b->srcs, b->sizes, n, &attrs,
                                                      &attr_idx, 1, stream);
  return ((memcpy_batch_v12080_fn)drv.memcpy_batch)(b->dsts, b->srcs, b->sizes, n, &attrs,
                                                    &attr_idx, 1, &fail_idx, stream);
}

static CUresult enqueue_one(struct cuda_device *d, enum sl_copy_dir dir, CUdeviceptr dst,
                            CUdeviceptr src, size_t len) {
  if (dir == SL_COPY_TO_HOST)
    return drv.cuMemcpyDtoHAsync((void *)(uintptr_t)dst, src, len, d->stream);
  return drv.cuMemcpyHtoDAsync(dst, (const void *)(uintptr_t)src, len, d->stream);
}

static CUresult enqueue_each(struct cuda_device *d, enum sl_copy_dir dir, struct batch *b,
                             size_t n) {
  CUresult r = CUDA_SUCCESS;
  size_t i;

  for (i = 0; i < n && r == CUDA_SUCCESS; i++)
    r = enqueue_one(d, dir, b->dsts[i], b->srcs[i], b->sizes[i]);
  return r;
}

/* Queues up to BATCH_PIECES copies: one batched call, or one call per piece where the driver
 * has no batches or refuses them for these pointers. */
static CUresult enqueue_chunk(struct cuda_device *d, enum sl_copy_dir dir, char *dev_mem,
                              char *host_mem, const struct sl_copy *copies, size_t n,
                              struct batch *b) {
  CUresult r;
  size_t i;

  for (i = 0; i < n; i++) {
    piece_ends(dir, dev_mem, host_mem, &copies[i], &b->dsts[i], &b->srcs[i]);
    b->sizes[i] = copies[i].len;
  }
  if (!d->use_batch)
    return enqueue_each(d, dir, b, n);
  r = call_memcpy_batch(b, n, d->stream);
  if (r != CUDA_ERROR_NOT_SUPPORTED)
    return r;
  d->use_batch = 0;
  return enqueue_each(d, dir, b, n);
}

static int copy_by_batches(struct cuda_device *d, enum sl_copy_dir dir, void *dev_base,
                           void *host_base, const struct sl_copy *copies, size_t n,
                           struct sl_err *err) {
  struct batch *b = malloc(sizeof(*b));
  CUresult r = CUDA_SUCCESS, synced;
  size_t i;
  int rc;

  if (b == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "copy: out of host memory for the batch");
  rc = cuda_enter(d, err);
  if (rc != 0)
    goto cleanup;
  for (i = 0; i < n && r == CUDA_SUCCESS; i += BATCH_PIECES)
    r = enqueue_chunk(d, dir, dev_base, host_base, copies + i,
                      n - i < BATCH_PIECES ? n - i : BATCH_PIECES, b);
  /* Waits even after a failed enqueue: queued copies still read and write the buffers. */
  synced = drv.cuStreamSynchronize(d->stream);
  cuda_leave();
  if (r != CUDA_SUCCESS)
    rc = cuda_fail(r, err, d->use_batch ? "cuMemcpyBatchAsync" : "cuMemcpyAsync",
                   "every piece must lie in mapped device memory and in host_alloc'd memory");
  else
    rc = cuda_check(synced, err, "cuStreamSynchronize",
                    "a copy faulted: the device range was probably not mapped");
cleanup:
  free(b);
  return rc;
}

/* --- moves inside device memory */

static CUresult enqueue_moves(struct cuda_device *d, char *mem, const struct sl_move *m,
                              size_t n, struct batch *b) {
  CUresult r = CUDA_SUCCESS;

  for (size_t i = 0; i < n; i++) {
    b->dsts[i] = devptr(mem + m[i].dst_off);
    b->srcs[i] = devptr(mem + m[i].src_off);
    b->sizes[i] = m[i].len;
  }
  if (d->use_batch) {
    r = call_memcpy_batch(b, n, d->stream);
    if (r != CUDA_ERROR_NOT_SUPPORTED)
      return r;
    d->use_batch = 0;
  }
  for (size_t i = 0; i < n && r == CUDA_SUCCESS; i++)
    r = drv.cuMemcpyDtoDAsync(b->dsts[i], b->srcs[i], b->sizes[i], d->stream);
  return r;
}

/* Batched copies: what moves use where the kernel cannot run (the module did not load, or no
 * GPU memory is left for its arguments). Copy engines are slower than SMs device to device. */
static int move_by_copies(struct cuda_device *d, void *base, const struct sl_move *moves,
                          size_t n, struct sl_err *err) {
  struct batch *b = malloc(sizeof(*b));
  CUresult r = CUDA_SUCCESS, synced;

  if (b == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "move: out of host memory for the batch");
  for (size_t i = 0; i < n && r == CUDA_SUCCESS; i += BATCH_PIECES)
    r = enqueue_moves(d, base, moves + i, n - i < BATCH_PIECES ? n - i : BATCH_PIECES, b);
  synced = drv.cuStreamSynchronize(d->stream); /* queued moves run on after a failure */
  free(b);
  if (r != CUDA_SUCCESS)
    return cuda_fail(r, err, "cuMemcpyBatchAsync (device to device)",
                     "every piece must lie in mapped device memory");
  return cuda_check(synced, err, "cuStreamSynchronize",
                    "a move faulted: the device range was probably not mapped");
}

/* --- kernels.cu's module */

/* Loads the module at the first launch (the driver JIT-compiles its PTX for this GPU then,
 * once; a failure is remembered). The context is current. */
static void load_kernels(struct cuda_device *d) {
  CUresult r = drv.cuModuleLoadData(&d->module, sl_kernels_ptx);

  for (int i = 0; r == CUDA_SUCCESS && i < N_KERNELS; i++)
    r = drv.cuModuleGetFunction(&d->kernels[i], d->module, kernel_names[i]);
  if (r != CUDA_SUCCESS) {
    if (d->module != NULL)
      drv.cuModuleUnload(d->module);
    d->module = NULL;
    d->kernels_failed = 1;
  }
}

/* Kernel k of the module, or NULL when the module cannot be had. */
static CUfunction kernel(struct cuda_device *d, enum cuda_kernel k) {
  CUfunction fn;

  pthread_mutex_lock(&d->kernels_lock);
  if (d->module == NULL && !d->kernels_failed)
    load_kernels(d);
  fn = d->module != NULL ? d->kernels[k] : NULL;
  pthread_mutex_unlock(&d->kernels_lock);
  return fn;
}

/* Compiles the module now rather than at the first move (the driver JIT-compiles the PTX:
 * 0.17 s on an H200, which the first loan that moves kept bytes paid). A failure is remembered
 * as at first use. */
static void preload_kernels(struct cuda_device *d) {
  if (cuda_enter(d, NULL) != 0)
    return;
  (void)kernel(d, KERNEL_MOVE_RANGES);
  cuda_leave();
}

/* Blocks for a launch that keeps the whole GPU busy (per_sm blocks on each multiprocessor),
 * fewer when there is less work. */
static unsigned int grid_blocks(struct cuda_device *d, uint64_t work, unsigned int per_sm) {
  int sms = 0;
  uint64_t full;

  drv.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d->dev);
  full = (uint64_t)(sms > 0 ? sms : 1) * per_sm;
  return (unsigned int)(work < full ? (work > 0 ? work : 1) : full);
}

/* --- moves inside device memory: kernels.cu's sl_move_ranges */

#define MOVE_THREADS 256
#define MOVE_BLOCKS_PER_SM 8
#define MOVE_PIECES ((size_t)1 << 20) /* per launch: bounds the GPU scratch to 32 MiB */
#define ARGS_BYTES_PER_MOVE 32        /* (src, dst, len) and the running count of tiles */

/* Pinned host memory of at least `bytes` for launch arguments, kept from one transfer to the
 * next (its caller holds args_lock): 200,000 moves are 6.4 MB, which a copy from pageable
 * memory carries at about 1.2 GB/s, 5 ms a launch. NULL where it cannot be had: pageable
 * memory of the caller's then. The context is current. */
static uint64_t *pinned_args(struct cuda_device *d, size_t bytes) {
  size_t want = (size_t)1 << 20;
  void *p = NULL;

  if (d->args != NULL && d->args_bytes >= bytes)
    return d->args;
  while (want < bytes)
    want *= 2;
  if (d->args != NULL) {
    drv.cuMemHostUnregister(d->args);
    free(d->args);
    d->args = NULL;
    d->args_bytes = 0;
  }
  if (posix_memalign(&p, 4096, want) != 0)
    return NULL;
  memset(p, 0, want); /* pinning touched memory is ten times cheaper */
  if (drv.cuMemHostRegister(p, want, CU_MEMHOSTREGISTER_PORTABLE) != CUDA_SUCCESS) {
    free(p);
    return NULL;
  }
  d->args = p;
  d->args_bytes = want;
  return p;
}

/* Launch arguments of `bytes`: pinned (pinned_args), else malloc'd into *own, which the
 * caller frees; NULL out of host memory. */
static uint64_t *launch_args(struct cuda_device *d, size_t bytes, uint64_t **own) {
  uint64_t *host = pinned_args(d, bytes);

  *own = NULL;
  if (host == NULL)
    host = *own = malloc(bytes);
  return host;
}

/* Queues one launch over n <= MOVE_PIECES moves on stream s, without waiting: its arguments
 * go from host (ARGS_BYTES_PER_MOVE a move, which must stay untouched until s has run it) to
 * the GPU scratch mem: the (src, dst, len) triples as addresses, then the running count of
 * their tiles. */
static CUresult queue_moves(struct cuda_device *d, CUfunction fn, CUstream s, CUdeviceptr base,
                            const struct sl_move *m, size_t n, uint64_t *host,
                            CUdeviceptr mem) {
  uint64_t *triples = host, *tile_end = host + 3 * n, tiles = 0;
  CUdeviceptr dev_triples = mem, dev_tile_end = mem + 24 * n;
  unsigned long long count = n;
  void *args[] = {&dev_triples, &dev_tile_end, &count};
  CUresult r;

  for (size_t i = 0; i < n; i++) {
    triples[3 * i] = base + m[i].src_off;
    triples[3 * i + 1] = base + m[i].dst_off;
    triples[3 * i + 2] = m[i].len;
    tile_end[i] = tiles += (m[i].len + SL_MOVE_TILE - 1) / SL_MOVE_TILE;
  }
  if (tiles == 0)
    return CUDA_SUCCESS;
  r = drv.cuMemcpyHtoDAsync(mem, host, ARGS_BYTES_PER_MOVE * n, s);
  if (r == CUDA_SUCCESS)
    r = drv.cuLaunchKernel(fn, grid_blocks(d, tiles, MOVE_BLOCKS_PER_SM), 1, 1, MOVE_THREADS,
                           1, 1, 0, s, args, NULL);
  return r;
}

static int moves_failed(CUresult queued, CUresult synced, struct sl_err *err) {
  if (synced != CUDA_SUCCESS && queued == CUDA_SUCCESS)
    return sl_err_set(err, SUBLET_EIO, "sl_move_ranges faulted: the moves must lie in mapped "
                      "device memory");
  return cuda_check(queued, err, "sl_move_ranges", "the GPU may be out of resources");
}

/* The launches, MOVE_PIECES moves at a time; host holds one launch's arguments. */
static int move_launches(struct cuda_device *d, CUfunction fn, CUdeviceptr base,
                         const struct sl_move *moves, size_t n, uint64_t *host,
                         CUdeviceptr mem, struct sl_err *err) {
  CUresult r = CUDA_SUCCESS, synced = CUDA_SUCCESS;

  for (size_t i = 0; r == CUDA_SUCCESS && synced == CUDA_SUCCESS && i < n; i += MOVE_PIECES) {
    r = queue_moves(d, fn, d->stream, base, moves + i, n - i < MOVE_PIECES ? n - i : MOVE_PIECES,
                    host, mem);
    /* Waits even after a failure: the copy reads host, which the next launch rewrites. */
    synced = drv.cuStreamSynchronize(d->stream);
  }
  return r != CUDA_SUCCESS || synced != CUDA_SUCCESS ? moves_failed(r, synced, err) : 0;
}

/* Moves run as one kernel launch (per million pieces): device to device at SM speed. */
static int cuda_move(struct sl_device *dev, void *base, const struct sl_move *moves, size_t n,
                     struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  size_t chunk = n < MOVE_PIECES ? n : MOVE_PIECES;
  uint64_t *own = NULL, *host;
  CUdeviceptr mem = 0;
  CUfunction fn;
  int rc;

  rc = cuda_enter(d, err);
  if (rc != 0)
    return rc;
  pthread_mutex_lock(&d->args_lock);
  fn = kernel(d, KERNEL_MOVE_RANGES);
  host = launch_args(d, chunk * ARGS_BYTES_PER_MOVE, &own);
  if (host == NULL)
    rc = sl_err_set(err, SUBLET_ENOHOSTMEM, "move: out of host memory for %zu pieces", n);
  else if (fn == NULL || drv.cuMemAlloc(&mem, chunk * ARGS_BYTES_PER_MOVE) != CUDA_SUCCESS)
    rc = move_by_copies(d, base, moves, n, err);
  else
    rc = move_launches(d, fn, devptr(base), moves, n, host, mem, err);
  if (mem != 0)
    drv.cuMemFree(mem);
  pthread_mutex_unlock(&d->args_lock);
  cuda_leave();
  free(own);
  return rc;
}

/* --- copies of many small pieces through a staging buffer on the device */

#define STAGE_BYTES (32ull << 20)   /* a slot's gather, then one copy over the link */
#define STAGE_SLOTS 2               /* one gathers while the other crosses the link */
#define STAGE_MIN_PIECES 64         /* fewer pieces: batched copies do as well */
#define STAGE_MAX_AVERAGE (1ull << 20) /* ... and so do long ones */
#define STAGE_UNAVAILABLE 1         /* no staging: use batched copies */

/* Scattered on the device but one run in host memory (saves and restores are), and many
 * small pieces: then a gather (or scatter) on the device and one long copy over the link beat
 * a batch of small copies (about 37 against 54 GB/s for 64 KiB pieces on an H200). */
static int stage_worth(const struct sl_copy *c, size_t n) {
  uint64_t bytes = 0;

  if (n < STAGE_MIN_PIECES)
    return 0;
  for (size_t i = 0; i < n; i++) {
    if (i > 0 && c[i].host_off != c[i - 1].host_off + c[i - 1].len)
      return 0;
    bytes += c[i].len;
  }
  return bytes / n < STAGE_MAX_AVERAGE;
}

/* One slot of the pipeline: its stream, staging buffer and launch arguments. Slot k % 2 takes
 * chunk k: the copy engine carries one chunk over the link while the SMs gather (or scatter)
 * the other, so the link rarely waits (one slot ran at 0.87 of the link for 64 KiB pieces). */
struct stage_slot {
  CUstream stream;
  CUdeviceptr stage, args;
  uint64_t *host_args;
  struct sl_move *mv;
  int busy; /* work queued on stream since the last wait */
};

struct stage_run {
  struct cuda_device *d;
  CUfunction fn;
  enum sl_copy_dir dir;
  char *dev_mem, *host_mem;
  size_t cap; /* moves per chunk */
  struct stage_slot slot[STAGE_SLOTS];
};

/* Waits for what slot s last queued; its buffers are free again. */
static CUresult slot_wait(struct stage_slot *s) {
  CUresult r = s->busy ? drv.cuStreamSynchronize(s->stream) : CUDA_SUCCESS;
  s->busy = 0;
  return r;
}

/* Queues one chunk on slot s: to the host, gather into stage then copy out; to the device,
 * copy in then scatter. s->mv holds k moves with absolute addresses. */
static CUresult slot_queue(struct stage_run *run, struct stage_slot *s, size_t k, char *host,
                           uint64_t bytes) {
  CUresult r = CUDA_SUCCESS;

  s->busy = 1;
  if (run->dir == SL_COPY_TO_DEVICE)
    r = drv.cuMemcpyHtoDAsync(s->stage, host, bytes, s->stream); /* before the scatter */
  if (r == CUDA_SUCCESS)
    r = queue_moves(run->d, run->fn, s->stream, 0, s->mv, k, s->host_args, s->args);
  if (r == CUDA_SUCCESS && run->dir == SL_COPY_TO_HOST)
    r = drv.cuMemcpyDtoHAsync(host, s->stage, bytes, s->stream);
  return r;
}

/* Fills s->mv with the next chunk, from piece *i (*done of its bytes staged already: a piece
 * may straddle two chunks); returns its move count, *bytes and *host_start. */
static size_t chunk_fill(struct stage_run *run, struct stage_slot *s, const struct sl_copy *c,
                         size_t n, size_t *i, uint64_t *done, uint64_t *bytes,
                         uint64_t *host_start) {
  size_t k = 0;

  *bytes = 0;
  *host_start = c[*i].host_off + *done;
  while (*i < n && k < run->cap && *bytes < STAGE_BYTES) {
    uint64_t left = c[*i].len - *done, room = STAGE_BYTES - *bytes;
    uint64_t take = left < room ? left : room;
    uint64_t on_dev = devptr(run->dev_mem + c[*i].dev_off + *done);
    s->mv[k++] = run->dir == SL_COPY_TO_HOST ? (struct sl_move){on_dev, s->stage + *bytes, take}
                                             : (struct sl_move){s->stage + *bytes, on_dev, take};
    *bytes += take;
    *done += take;
    if (*done == c[*i].len) {
      (*i)++;
      *done = 0;
    }
  }
  return k;
}

/* Every chunk through the slots in turn; waits for all of them, failed or not (the host
 * memory stays in use until the streams are done). The context is current. */
static int copy_staged_chunks(struct stage_run *run, const struct sl_copy *c, size_t n,
                              struct sl_err *err) {
  CUresult r = CUDA_SUCCESS, w = CUDA_SUCCESS;
  uint64_t done = 0, bytes, host_start;
  size_t i = 0;

  for (unsigned k = 0; r == CUDA_SUCCESS && w == CUDA_SUCCESS && i < n; k++) {
    struct stage_slot *s = &run->slot[k % STAGE_SLOTS];
    w = slot_wait(s);
    if (w == CUDA_SUCCESS) {
      size_t moves = chunk_fill(run, s, c, n, &i, &done, &bytes, &host_start);
      r = slot_queue(run, s, moves, run->host_mem + host_start, bytes);
    }
  }
  for (int k = 0; k < STAGE_SLOTS; k++) {
    CUresult wk = slot_wait(&run->slot[k]);
    w = w != CUDA_SUCCESS ? w : wk;
  }
  if (r != CUDA_SUCCESS)
    return cuda_fail(r, err, "a staged copy", "host memory must be host_alloc'd and the "
                     "pieces lie in mapped device memory");
  return cuda_check(w, err, "cuStreamSynchronize", "a staged copy faulted: the device range "
                    "was probably not mapped");
}

/* The slots' memory: one device allocation for every stage and argument buffer, pinned
 * arguments (or pageable ones, own) and move arrays. 0 or STAGE_UNAVAILABLE. */
static int stage_setup(struct stage_run *run, CUdeviceptr *mem, uint64_t **own) {
  struct cuda_device *d = run->d;
  size_t args = run->cap * ARGS_BYTES_PER_MOVE;
  uint64_t *host = launch_args(d, STAGE_SLOTS * args, own);

  if (host == NULL || drv.cuMemAlloc(mem, STAGE_SLOTS * (STAGE_BYTES + args)) != CUDA_SUCCESS)
    return STAGE_UNAVAILABLE;
  for (int k = 0; k < STAGE_SLOTS; k++) {
    struct stage_slot *s = &run->slot[k];
    s->stream = k == 0 ? d->stream : d->stream2;
    s->stage = *mem + k * STAGE_BYTES;
    s->args = *mem + STAGE_SLOTS * STAGE_BYTES + k * args;
    s->host_args = host + k * (args / sizeof(*host));
    s->mv = malloc(run->cap * sizeof(*s->mv));
    if (s->mv == NULL)
      return STAGE_UNAVAILABLE;
  }
  return 0;
}

/* Returns STAGE_UNAVAILABLE, without copying anything, where the kernel or the device
 * memory for the staging buffers cannot be had. */
static int copy_staged(struct cuda_device *d, enum sl_copy_dir dir, void *dev_base,
                       void *host_base, const struct sl_copy *c, size_t n,
                       struct sl_err *err) {
  struct stage_run run = {.d = d, .dir = dir, .dev_mem = dev_base, .host_mem = host_base,
                          .cap = n < MOVE_PIECES ? n : MOVE_PIECES};
  uint64_t *own = NULL;
  CUdeviceptr mem = 0;
  int rc = STAGE_UNAVAILABLE;

  if (cuda_enter(d, NULL) != 0)
    return rc;
  pthread_mutex_lock(&d->args_lock);
  run.fn = kernel(d, KERNEL_MOVE_RANGES);
  if (run.fn != NULL && stage_setup(&run, &mem, &own) == 0)
    rc = copy_staged_chunks(&run, c, n, err);
  if (mem != 0)
    drv.cuMemFree(mem);
  pthread_mutex_unlock(&d->args_lock);
  cuda_leave();
  for (int k = 0; k < STAGE_SLOTS; k++)
    free(run.slot[k].mv);
  free(own);
  return rc;
}

static int cuda_copy(struct sl_device *dev, enum sl_copy_dir dir, void *dev_base,
                     void *host_base, const struct sl_copy *copies, size_t n,
                     struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  int rc = STAGE_UNAVAILABLE;

  if (stage_worth(copies, n))
    rc = copy_staged(d, dir, dev_base, host_base, copies, n, err);
  if (rc == STAGE_UNAVAILABLE)
    rc = copy_by_batches(d, dir, dev_base, host_base, copies, n, err);
  return rc;
}

/* --- verify's checksums: kernels.cu's sl_hash_ranges over all ranges in one launch */

#define HASH_THREADS 256 /* 8 warps a block */
#define HASH_BLOCKS_PER_SM 4

static uint64_t hash_tiles(const struct sublet_range *r) {
  if (r->length == 0)
    return 0;
  return (r->offset + r->length - 1) / SL_HASH_TILE - r->offset / SL_HASH_TILE + 1;
}

/* Device scratch of one launch, in one allocation: ranges (16 bytes each), the running count
 * of their tiles (8), the sums (8). */
static int hash_on_stream(struct cuda_device *d, CUfunction fn, CUdeviceptr base,
                          const struct sublet_range *ranges, const uint64_t *tile_end, size_t n,
                          CUdeviceptr mem, uint64_t *out, struct sl_err *err) {
  CUdeviceptr dev_ranges = mem, dev_tile_end = mem + 16 * n, dev_out = mem + 24 * n;
  unsigned long long count = n;
  void *args[] = {&base, &dev_ranges, &dev_tile_end, &count, &dev_out};
  unsigned int blocks = grid_blocks(d, (tile_end[n - 1] + 7) / 8, HASH_BLOCKS_PER_SM);
  CUresult r = drv.cuMemcpyHtoDAsync(dev_ranges, ranges, 16 * n, d->stream);
  int rc;

  if (r == CUDA_SUCCESS)
    r = drv.cuMemcpyHtoDAsync(dev_tile_end, tile_end, 8 * n, d->stream);
  if (r == CUDA_SUCCESS)
    r = drv.cuMemsetD8Async(dev_out, 0, 8 * n, d->stream);
  rc = cuda_check(r, err, "copying verify's ranges to the GPU", "check nvidia-smi");
  if (rc == 0 && tile_end[n - 1] > 0)
    rc = cuda_check(drv.cuLaunchKernel(fn, blocks, 1, 1, HASH_THREADS, 1, 1, 0, d->stream,
                                       args, NULL),
                    err, "sl_hash_ranges", "the GPU may be out of resources");
  if (rc == 0)
    rc = cuda_check(drv.cuMemcpyDtoHAsync(out, dev_out, 8 * n, d->stream), err,
                    "cuMemcpyDtoHAsync", "check nvidia-smi");
  r = drv.cuStreamSynchronize(d->stream); /* even after a failure: the copies read our arrays */
  return rc != 0 ? rc : cuda_check(r, err, "sl_hash_ranges",
                                   "the ranges must lie in mapped device memory");
}

static int cuda_hash(struct sl_device *dev, const void *base, const struct sublet_range *ranges,
                     size_t n, uint64_t *out, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  uint64_t *tile_end = malloc(n * sizeof(*tile_end)), tiles = 0;
  CUdeviceptr mem = 0;
  CUfunction fn;
  int rc;

  if (tile_end == NULL)
    return sl_err_set(err, SUBLET_ENOMEM, "verify: out of host memory for %zu ranges", n);
  for (size_t i = 0; i < n; i++)
    tile_end[i] = tiles += hash_tiles(&ranges[i]);
  rc = cuda_enter(d, err);
  if (rc != 0)
    goto cleanup;
  /* The kernel runs on the device's stream: the owner's writes on its own streams go first. */
  rc = cuda_check(drv.cuCtxSynchronize(), err, "cuCtxSynchronize",
                  "a kernel failed earlier; the context is lost: restart the process");
  if (rc == 0 && (fn = kernel(d, KERNEL_HASH_RANGES)) == NULL)
    rc = sl_err_set(err, SUBLET_EDEVICE, "the driver could not load sublet's kernels (PTX for "
                    "compute_80, ISA 8.0): update the NVIDIA driver");
  if (rc == 0)
    rc = cuda_check(drv.cuMemAlloc(&mem, 32 * n), err, "cuMemAlloc",
                    "verify needs 32 bytes of GPU memory per kept range: free some");
  if (rc == 0)
    rc = hash_on_stream(d, fn, devptr(base), ranges, tile_end, n, mem, out, err);
  if (mem != 0)
    drv.cuMemFree(mem);
  cuda_leave();
cleanup:
  free(tile_end);
  return rc;
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
