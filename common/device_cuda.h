/* device_cuda.h - the cuda backend's insides, shared by its two files: device_cuda.c (the
 * driver, the device, handles, address space, host memory) and device_cuda_copy.c (copies,
 * moves and checksums: the copy engines and kernels.cu's module). Nothing else includes it.
 *
 * No CUDA header is included: the few types and values used are declared here, checked
 * against cuda.h of CUDA 13.0 (layouts and values have been stable since their introduction).
 */
#ifndef SL_DEVICE_CUDA_H
#define SL_DEVICE_CUDA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "device.h"

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
  CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91,
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
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02
#define CU_MEMHOSTREGISTER_READ_ONLY 0x08
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_GET_PROC_ADDRESS_DEFAULT 0

/* --- entry points, with their signatures at API version 12000 (cudaTypedefs.h's PFN_*) */

#define SL_CUDA_API_VERSION 12000
/* What the driver keeps back from an allocation of all its free bytes (page tables, its own
 * bookkeeping): a release by need leaves this much free beyond the need. An estimate with a
 * margin, checked by test_gpu_release_need.py (a cudaMalloc and a PyTorch taker each get
 * their need): a need counted against every free byte fell short. */
#define SL_CUDA_ALLOC_HEADROOM (256ull << 20)

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

/* The driver's entry points, resolved once per process (device_cuda.c). */
extern struct cuda_driver cuda_drv;

/* How many pieces go into one cuMemcpyBatchAsync call: bounds the scratch arrays (96 KiB). */
#define BATCH_PIECES 4096

/* The kernels of kernels.cu, by the names they have in its module. */
enum cuda_kernel { KERNEL_MOVE_RANGES, KERNEL_HASH_RANGES, N_KERNELS };

struct cuda_device {
  struct sl_device base;
  CUdevice dev;
  CUcontext ctx;     /* the primary context, retained */
  CUstream stream;   /* for copies; owned */
  CUmemAllocationProp prop;
  int use_batch;     /* cleared if the driver refuses batches on this device */
  int sm_copies;     /* pinned host memory is read by kernels at its own address (copies into
                        new pages); 0 with SUBLET_CUDA_NO_SM_COPY=1 */
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

/* device_cuda.c: errors as sl_err, and the device's context made current around a call. */
int cuda_fail(CUresult r, struct sl_err *err, const char *call, const char *advice);
int cuda_check(CUresult r, struct sl_err *err, const char *call, const char *advice);
int cuda_enter(struct cuda_device *d, struct sl_err *err);
void cuda_leave(void);

/* device_cuda_copy.c: the ops of copies, moves and checksums; the kernels' module compiled
 * at open (load_kernels) and let go of at close. */
int cuda_copy(struct sl_device *dev, enum sl_copy_dir dir, void *dev_base, void *host_base,
              const struct sl_copy *copies, size_t n, struct sl_err *err);
int cuda_move(struct sl_device *dev, void *base, const struct sl_move *moves, size_t n,
              struct sl_err *err);
int cuda_hash(struct sl_device *dev, const void *base, const struct sublet_range *ranges,
              size_t n, uint64_t *out, struct sl_err *err);
void cuda_kernels_preload(struct cuda_device *d);
void cuda_kernels_close(struct cuda_device *d);

#endif
