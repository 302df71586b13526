/* tms_hooks.c - the preload library's entry points: cudaMalloc and cudaFree, which PyTorch's
 * allocator calls for its segments, and torch_memory_saver's C interface (tms_*), with the
 * calling thread's region config.
 *
 * As torch_memory_saver's preload library: each thread has its own config (a region is the
 * calling thread's), whose flags start from $TMS_INIT_ENABLE, $TMS_INIT_ENABLE_CPU_BACKUP and
 * $TMS_INIT_CPU_BACKUP_BACKEND, so that with TMS_INIT_ENABLE=1 every allocation from the
 * process's start is a region's, of tag "default" (slime's trainer: the model and optimizer
 * made before any torch_memory_saver call are paused by pause()). Inside a region cudaMalloc
 * allocates from sublet (tms_saver.c); outside, from the CUDA runtime. cudaFree frees either.
 * Disk backup is refused: an allocation with it on fails, saying to use cpu backup.
 */
#include "tms.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TMS_TAG_MAX 256

struct thread_config {
  int ready;
  bool interesting, cpu_backup, disk_backup;
  enum tms_backend backend;
  char tag[TMS_TAG_MAX];
};

static __thread struct thread_config config;

/* The original's default is pinned. */
static enum tms_backend backend_of(const char *name) {
  return name != NULL && strcmp(name, "mmap") == 0 ? TMS_BACKEND_MMAP : TMS_BACKEND_PINNED;
}

static struct thread_config *cfg(void) {
  if (!config.ready) {
    config.interesting = tms_env_bool("TMS_INIT_ENABLE");
    config.cpu_backup = tms_env_bool("TMS_INIT_ENABLE_CPU_BACKUP");
    config.disk_backup = tms_env_bool("TMS_INIT_ENABLE_DISK_BACKUP");
    config.backend = backend_of(getenv("TMS_INIT_CPU_BACKUP_BACKEND"));
    strcpy(config.tag, "default");
    config.ready = 1;
  }
  return &config;
}

static void report(const char *what) {
  fprintf(stderr, "[torch_memory_saver (sublet)] %s: %s\n", what, tms_last_error());
}

/* ------------------------------------------------------------------ the CUDA runtime's */

TMS_EXPORT int cudaMalloc(void **ptr, size_t size) {
  struct thread_config *c = cfg();
  struct tms_alloc_config a = {c->tag, c->cpu_backup, c->backend};
  int rc;

  if (!c->interesting)
    return tms_cuda_malloc(ptr, size);
  if (ptr == NULL)
    return TMS_CUDA_INVALID_VALUE;
  if (c->disk_backup) {
    tms_fail("disk backup is not supported by sublet's torch_memory_saver: use cpu backup "
             "(region(enable_cpu_backup=True), TMS_INIT_ENABLE_CPU_BACKUP=1)");
    report("cudaMalloc");
    return TMS_CUDA_OUT_OF_MEMORY;
  }
  rc = tms_saver_malloc(ptr, tms_cuda_device(), size, &a);
  if (rc != 0)
    report("cudaMalloc");
  return rc;
}

TMS_EXPORT int cudaFree(void *ptr) {
  int rc;

  if (ptr != NULL && tms_saver_free(ptr, &rc))
    return rc;
  return tms_cuda_free(ptr);
}

/* ------------------------------------------------------------------ torch_memory_saver's */

TMS_EXPORT void tms_set_interesting_region(bool value) {
  cfg()->interesting = value;
}

TMS_EXPORT bool tms_get_interesting_region(void) {
  return cfg()->interesting;
}

TMS_EXPORT void tms_set_current_tag(const char *tag) {
  if (tag == NULL || strlen(tag) >= TMS_TAG_MAX) {
    fprintf(stderr, "[torch_memory_saver (sublet)] tms_set_current_tag: a tag of 0 to %d "
                    "bytes, not %s\n", TMS_TAG_MAX - 1, tag == NULL ? "NULL" : "longer");
    return;
  }
  strcpy(cfg()->tag, tag);
}

TMS_EXPORT const char *tms_get_current_tag(void) {
  return cfg()->tag;
}

TMS_EXPORT bool tms_get_enable_cpu_backup(void) {
  return cfg()->cpu_backup;
}

TMS_EXPORT void tms_set_enable_cpu_backup(bool value) {
  cfg()->cpu_backup = value;
}

TMS_EXPORT const char *tms_get_cpu_backup_backend(void) {
  return cfg()->backend == TMS_BACKEND_PINNED ? "pinned" : "mmap";
}

TMS_EXPORT void tms_set_cpu_backup_backend(const char *backend) {
  cfg()->backend = backend_of(backend);
}

TMS_EXPORT bool tms_get_enable_disk_backup(void) {
  return cfg()->disk_backup;
}

TMS_EXPORT void tms_set_enable_disk_backup(bool value) {
  cfg()->disk_backup = value;
}

TMS_EXPORT void tms_set_disk_backup_dir(const char *dir) {
  (void)dir; /* recorded nowhere: disk backup is refused at allocation */
}

TMS_EXPORT void set_memory_margin_bytes(uint64_t value) {
  tms_saver_set_margin(value);
}

TMS_EXPORT void tms_set_retain_cpu_backup(bool value) {
  tms_saver_set_retain(value);
}

TMS_EXPORT bool tms_get_retain_cpu_backup(void) {
  return tms_saver_retain();
}

TMS_EXPORT int tms_pause(const char *tag) {
  int rc = tms_saver_pause(tag);

  if (rc != 0)
    report("pause");
  return rc;
}

TMS_EXPORT int tms_sublet_pause_need(const char *tag, uint64_t need) {
  int rc = tms_saver_pause_need(tag, need);

  if (rc != 0)
    report("pause");
  return rc;
}

TMS_EXPORT int tms_resume(const char *tag) {
  int rc = tms_saver_resume(tag);

  if (rc != 0)
    report("resume");
  return rc;
}

TMS_EXPORT uint8_t *tms_get_cpu_backup_pointer(const uint8_t *gpu_ptr, uint64_t size) {
  return tms_saver_backup_pointer(gpu_ptr, size);
}

/* sublet's own: the message of the calling thread's last failure, and what this library is
 * (the Python side tells it from the original's by this symbol). */
TMS_EXPORT const char *tms_sublet_last_error(void) {
  return tms_last_error();
}

TMS_EXPORT const char *tms_sublet_version(void) {
  return sublet_version();
}
