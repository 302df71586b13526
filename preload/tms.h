/* tms.h - the preload library's internals: torch_memory_saver's C interface on sublet pools.
 *
 * LD_PRELOAD puts this library before the CUDA runtime, so PyTorch's cudaMalloc and cudaFree
 * reach it first (as they reach torch_memory_saver's own preload library, whose names and
 * symbols it has). Floors, each calling only the ones below it:
 *   tms_hooks.c   cudaMalloc/cudaFree, the calling thread's region config, the tms_* calls
 *   tms_saver.c   the allocations by tag, pause and resume, the host backups
 *   tms_daemon.c  a sublet client per CUDA device: which subletd serves it
 *   tms_start.c   starting this user's subletd where none serves the device
 *   tms_cuda.c    the CUDA runtime and driver calls, found at run time (none without CUDA)
 * and under them libsublet's client, built into this library with its symbols hidden, so that
 * a libsublet.so the process also loads (sublet's Python package does) is not interposed.
 */
#ifndef SL_TMS_H
#define SL_TMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sublet.h"

#define TMS_EXPORT __attribute__((visibility("default")))
#define TMS_MAX_DEVICES 64

/* cudaError_t values this library returns (driver_types.h). */
enum {
  TMS_CUDA_SUCCESS = 0,
  TMS_CUDA_INVALID_VALUE = 1,
  TMS_CUDA_OUT_OF_MEMORY = 2,
  TMS_CUDA_NOT_INITIALIZED = 3,
};

enum tms_backend { TMS_BACKEND_MMAP = 0, TMS_BACKEND_PINNED = 1 };

/* What a region says about the allocations made in it (tms_hooks.c's thread config). */
struct tms_alloc_config {
  const char *tag;
  int cpu_backup;
  enum tms_backend backend;
};

/* tms_hooks.c: what the library exports, torch_memory_saver's symbols (csrc/entrypoint.cpp of
 * 0.0.10, same signatures) and sublet's three. */
TMS_EXPORT int cudaMalloc(void **ptr, size_t size);
TMS_EXPORT int cudaFree(void *ptr);
TMS_EXPORT void tms_set_interesting_region(bool value);
TMS_EXPORT bool tms_get_interesting_region(void);
TMS_EXPORT void tms_set_current_tag(const char *tag);
TMS_EXPORT const char *tms_get_current_tag(void);
TMS_EXPORT bool tms_get_enable_cpu_backup(void);
TMS_EXPORT void tms_set_enable_cpu_backup(bool value);
TMS_EXPORT const char *tms_get_cpu_backup_backend(void);
TMS_EXPORT void tms_set_cpu_backup_backend(const char *backend);
TMS_EXPORT bool tms_get_enable_disk_backup(void);
TMS_EXPORT void tms_set_enable_disk_backup(bool value);
TMS_EXPORT void tms_set_disk_backup_dir(const char *dir);
TMS_EXPORT void set_memory_margin_bytes(uint64_t value);
TMS_EXPORT void tms_set_retain_cpu_backup(bool value);
TMS_EXPORT bool tms_get_retain_cpu_backup(void);
TMS_EXPORT int tms_pause(const char *tag);
TMS_EXPORT int tms_resume(const char *tag);
TMS_EXPORT uint8_t *tms_get_cpu_backup_pointer(const uint8_t *gpu_ptr, uint64_t size);
TMS_EXPORT const char *tms_sublet_last_error(void);
TMS_EXPORT const char *tms_sublet_version(void);
/* sublet's tms_pause by need (issue 42): each tag releases only the pages the need takes beyond
 * the device's free memory, or all of it when it cannot give that much. */
TMS_EXPORT int tms_sublet_pause_need(const char *tag, uint64_t need);

/* tms_saver.c */
int tms_saver_malloc(void **ptr, int device, size_t size, const struct tms_alloc_config *cfg);
/* 1: ptr was one of ours and is freed (*rc its cudaError_t); 0: not ours. */
int tms_saver_free(void *ptr, int *rc);
int tms_saver_pause(const char *tag);
int tms_saver_pause_need(const char *tag, uint64_t need);
int tms_saver_resume(const char *tag);
uint8_t *tms_saver_backup_pointer(const uint8_t *ptr, uint64_t size);
void tms_saver_set_margin(uint64_t bytes);
void tms_saver_set_retain(int retain);
int tms_saver_retain(void);
int tms_env_bool(const char *name);
/* The message of the calling thread's last failure, for tms_sublet_last_error. */
void tms_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *tms_last_error(void);

/* tms_daemon.c: the client serving CUDA device `device` of this process, connected on first
 * use; NULL with tms_fail() said why. tms_daemon_each calls fn for every connected one. */
sublet_client *tms_daemon_client(int device);
sublet_client *tms_daemon_connected(int device);
/* 1 where the device's daemon runs sublet's memfd backend (tests): its memory is host memory,
 * copied with memcpy, and the CUDA runtime has no part in it. */
int tms_daemon_on_host(int device);

/* tms_start.c: this user's daemon for the device, started (under the lock of dir/name) unless
 * it answers already; NULL with tms_fail() said why. */
sublet_client *tms_start_user_daemon(int device, const char *dir, const char *name);

/* tms_cuda.c: the process's CUDA runtime, the next library after this one (NULL-safe: without
 * CUDA, as on sublet's memfd backend in tests, each says so). */
int tms_cuda_malloc(void **ptr, size_t size);
int tms_cuda_free(void *ptr);
int tms_cuda_device(void);          /* the calling thread's current device (0 without CUDA) */
int tms_cuda_synchronize(void);
int tms_cuda_copy(void *dst, const void *src, size_t size, int to_device);
void *tms_cuda_host_alloc(size_t size); /* pinned; NULL without CUDA */
void tms_cuda_host_free(void *p);
int tms_cuda_uuid(int device, uint8_t uuid[16]); /* 0, or -1 without CUDA */

#endif
