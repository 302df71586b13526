/* tms_cuda.c - the CUDA calls of the preload library, found at run time: the runtime's as the
 * next definition after this library (RTLD_NEXT: the libcudart PyTorch loaded), the driver's
 * from libcuda.so.1. This library links neither: it loads where no CUDA is (sublet's memfd
 * backend, where device memory is host memory: a copy is a memcpy there).
 */
#include "tms.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#define TMS_MEMCPY_H2D 1
#define TMS_MEMCPY_D2H 2

struct runtime {
  int (*malloc_)(void **, size_t);
  int (*free_)(void *);
  int (*get_device)(int *);
  int (*synchronize)(void);
  int (*memcpy_)(void *, const void *, size_t, int);
  int (*host_alloc)(void **, size_t, unsigned);
  int (*host_free)(void *);
  int (*cu_init)(unsigned);
  int (*cu_device_get)(int *, int);
  int (*cu_uuid)(uint8_t *, int);
};

static struct runtime rt;
static pthread_once_t rt_once = PTHREAD_ONCE_INIT;

static void *next_symbol(const char *name) {
  return dlsym(RTLD_NEXT, name);
}

static void load_driver(void) {
  void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

  if (cuda == NULL)
    return;
  rt.cu_init = (int (*)(unsigned))dlsym(cuda, "cuInit");
  rt.cu_device_get = (int (*)(int *, int))dlsym(cuda, "cuDeviceGet");
  rt.cu_uuid = (int (*)(uint8_t *, int))dlsym(cuda, "cuDeviceGetUuid_v2");
  if (rt.cu_uuid == NULL)
    rt.cu_uuid = (int (*)(uint8_t *, int))dlsym(cuda, "cuDeviceGetUuid");
}

static void load(void) {
  rt.malloc_ = (int (*)(void **, size_t))next_symbol("cudaMalloc");
  rt.free_ = (int (*)(void *))next_symbol("cudaFree");
  rt.get_device = (int (*)(int *))next_symbol("cudaGetDevice");
  rt.synchronize = (int (*)(void))next_symbol("cudaDeviceSynchronize");
  rt.memcpy_ = (int (*)(void *, const void *, size_t, int))next_symbol("cudaMemcpy");
  rt.host_alloc = (int (*)(void **, size_t, unsigned))next_symbol("cudaHostAlloc");
  rt.host_free = (int (*)(void *))next_symbol("cudaFreeHost");
  load_driver();
}

static const struct runtime *runtime(void) {
  pthread_once(&rt_once, load);
  return &rt;
}

int tms_cuda_malloc(void **ptr, size_t size) {
  if (runtime()->malloc_ == NULL) {
    tms_fail("no CUDA runtime in this process to allocate %zu bytes outside a region", size);
    return TMS_CUDA_NOT_INITIALIZED;
  }
  return rt.malloc_(ptr, size);
}

int tms_cuda_free(void *ptr) {
  if (runtime()->free_ == NULL)
    return ptr == NULL ? TMS_CUDA_SUCCESS : TMS_CUDA_INVALID_VALUE;
  return rt.free_(ptr);
}

int tms_cuda_device(void) {
  int device = 0;

  if (runtime()->get_device != NULL && rt.get_device(&device) != 0)
    return 0;
  return device;
}

int tms_cuda_synchronize(void) {
  return runtime()->synchronize != NULL ? rt.synchronize() : TMS_CUDA_SUCCESS;
}

int tms_cuda_copy(void *dst, const void *src, size_t size, int to_device) {
  if (runtime()->memcpy_ == NULL) {
    memcpy(dst, src, size);
    return TMS_CUDA_SUCCESS;
  }
  return rt.memcpy_(dst, src, size, to_device ? TMS_MEMCPY_H2D : TMS_MEMCPY_D2H);
}

void *tms_cuda_host_alloc(size_t size) {
  void *p = NULL;

  if (runtime()->host_alloc == NULL || rt.host_alloc(&p, size, 0) != 0)
    return NULL;
  return p;
}

void tms_cuda_host_free(void *p) {
  if (runtime()->host_free != NULL)
    rt.host_free(p);
}

int tms_cuda_uuid(int device, uint8_t uuid[16]) {
  int dev;

  if (runtime()->cu_uuid == NULL || rt.cu_init(0) != 0 || rt.cu_device_get(&dev, device) != 0)
    return -1;
  return rt.cu_uuid(uuid, dev) == 0 ? 0 : -1;
}
