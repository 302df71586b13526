/* device_cuda_copy.c - the cuda backend's transfers: copies between device and host memory
 * (batched on the copy engines, or staged through the device for many small pieces), moves
 * inside device memory and verify's checksums (kernels.cu's module, one launch over all the
 * pieces: SMs copy device to device far faster than copy engines do).
 *
 * Floor 3 (floors.h).
 */
#include "device_cuda.h"
#include "hash.h"
#include "kernels.h"

#include <stdlib.h>
#include <string.h>

static const char *const kernel_names[N_KERNELS] = {"sl_move_ranges", "sl_hash_ranges"};

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
  if (cuda_drv.batch_version >= 13000)
    return ((memcpy_batch_v13000_fn)cuda_drv.memcpy_batch)(b->dsts, b->srcs, b->sizes, n, &attrs,
                                                           &attr_idx, 1, stream);
  return ((memcpy_batch_v12080_fn)cuda_drv.memcpy_batch)(b->dsts, b->srcs, b->sizes, n, &attrs,
                                                         &attr_idx, 1, &fail_idx, stream);
}

static CUresult enqueue_one(struct cuda_device *d, enum sl_copy_dir dir, CUdeviceptr dst,
                            CUdeviceptr src, size_t len) {
  if (dir == SL_COPY_TO_HOST)
    return cuda_drv.cuMemcpyDtoHAsync((void *)(uintptr_t)dst, src, len, d->stream);
  return cuda_drv.cuMemcpyHtoDAsync(dst, (const void *)(uintptr_t)src, len, d->stream);
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
  synced = cuda_drv.cuStreamSynchronize(d->stream);
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
    r = cuda_drv.cuMemcpyDtoDAsync(b->dsts[i], b->srcs[i], b->sizes[i], d->stream);
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
  synced = cuda_drv.cuStreamSynchronize(d->stream); /* queued moves run on after a failure */
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
  CUresult r = cuda_drv.cuModuleLoadData(&d->module, sl_kernels_ptx);

  for (int i = 0; r == CUDA_SUCCESS && i < N_KERNELS; i++)
    r = cuda_drv.cuModuleGetFunction(&d->kernels[i], d->module, kernel_names[i]);
  if (r != CUDA_SUCCESS) {
    if (d->module != NULL)
      cuda_drv.cuModuleUnload(d->module);
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

/* Lets go of the launch arguments' pinning and of the module (device_cuda.c's close frees
 * the arguments' memory). The context is current. */
void cuda_kernels_close(struct cuda_device *d) {
  if (d->args != NULL)
    cuda_drv.cuMemHostUnregister(d->args);
  if (d->module != NULL)
    cuda_drv.cuModuleUnload(d->module);
}

/* Blocks for a launch that keeps the whole GPU busy (per_sm blocks on each multiprocessor),
 * fewer when there is less work. */
static unsigned int grid_blocks(struct cuda_device *d, uint64_t work, unsigned int per_sm) {
  int sms = 0;
  uint64_t full;

  cuda_drv.cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, d->dev);
  full = (uint64_t)(sms > 0 ? sms : 1) * per_sm;
  return (unsigned int)(work < full ? (work > 0 ? work : 1) : full);
}

/* --- moves inside device memory: kernels.cu's sl_move_ranges */

#define MOVE_THREADS 256
#define MOVE_BLOCKS_PER_SM 8
#define MOVE_PIECES ((size_t)1 << 20) /* per launch: bounds the GPU scratch to 32 MiB */
#define ARGS_BYTES_PER_MOVE 32        /* (src, dst, len) and the running count of tiles */

/* Pinned host memory of at least `bytes` for launch arguments, kept from one transfer to the
 * next (its caller holds args_lock): a launch of many moves carries megabytes of them, which a
 * copy from pageable memory takes milliseconds to cross (docs/benchmarks.md). NULL where it
 * cannot be had: pageable memory of the caller's then. The context is current. */
static uint64_t *pinned_args(struct cuda_device *d, size_t bytes) {
  size_t want = (size_t)1 << 20;
  void *p = NULL;

  if (d->args != NULL && d->args_bytes >= bytes)
    return d->args;
  while (want < bytes)
    want *= 2;
  if (d->args != NULL) {
    cuda_drv.cuMemHostUnregister(d->args);
    free(d->args);
    d->args = NULL;
    d->args_bytes = 0;
  }
  if (posix_memalign(&p, 4096, want) != 0)
    return NULL;
  memset(p, 0, want); /* pinning touched memory is ten times cheaper */
  if (cuda_drv.cuMemHostRegister(p, want, CU_MEMHOSTREGISTER_PORTABLE) != CUDA_SUCCESS) {
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

/* Compiles the module now rather than at the first move (the driver JIT-compiles the PTX,
 * which the first loan that moves kept bytes paid: docs/benchmarks.md), and pins the launch
 * arguments of a whole launch (32 MiB, a few ms): grown at a first move of many pieces, they
 * were registered while the borrower filled the GPU. A failure is remembered as at first use;
 * arguments that cannot be pinned now are tried again then. */
void cuda_kernels_preload(struct cuda_device *d) {
  if (cuda_enter(d, NULL) != 0)
    return;
  if (kernel(d, KERNEL_MOVE_RANGES) != NULL) {
    pthread_mutex_lock(&d->args_lock);
    (void)pinned_args(d, MOVE_PIECES * ARGS_BYTES_PER_MOVE);
    pthread_mutex_unlock(&d->args_lock);
  }
  cuda_leave();
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
  r = cuda_drv.cuMemcpyHtoDAsync(mem, host, ARGS_BYTES_PER_MOVE * n, s);
  if (r == CUDA_SUCCESS)
    r = cuda_drv.cuLaunchKernel(fn, grid_blocks(d, tiles, MOVE_BLOCKS_PER_SM), 1, 1, MOVE_THREADS,
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
    synced = cuda_drv.cuStreamSynchronize(d->stream);
  }
  return r != CUDA_SUCCESS || synced != CUDA_SUCCESS ? moves_failed(r, synced, err) : 0;
}

/* Moves run as one kernel launch (per million pieces): device to device at SM speed. Without
 * the kernel or its arguments' memory they run as batched copies where fallback is set, else
 * the caller hears COPY_ELSEWHERE (copy_by_sms: its sources are host memory, for the copy
 * engines' host-to-device path then, not for device-to-device copies). */
#define COPY_ELSEWHERE 1

static int moves_run(struct cuda_device *d, void *base, const struct sl_move *moves, size_t n,
                     int fallback, struct sl_err *err) {
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
  if (host == NULL && !fallback)
    rc = COPY_ELSEWHERE;
  else if (host == NULL)
    rc = sl_err_set(err, SUBLET_ENOHOSTMEM, "move: out of host memory for %zu pieces", n);
  else if (fn == NULL || cuda_drv.cuMemAlloc(&mem, chunk * ARGS_BYTES_PER_MOVE) != CUDA_SUCCESS)
    rc = fallback ? move_by_copies(d, base, moves, n, err) : COPY_ELSEWHERE;
  else
    rc = move_launches(d, fn, devptr(base), moves, n, host, mem, err);
  if (mem != 0)
    cuda_drv.cuMemFree(mem);
  pthread_mutex_unlock(&d->args_lock);
  cuda_leave();
  free(own);
  return rc;
}

int cuda_move(struct sl_device *dev, void *base, const struct sl_move *moves, size_t n,
              struct sl_err *err) {
  return moves_run(to_cuda(dev), base, moves, n, 1, err);
}

/* --- copies of many small pieces through a staging buffer on the device */

#define STAGE_BYTES (32ull << 20)   /* a slot's gather, then one copy over the link */
#define STAGE_SLOTS 2               /* one gathers while the other crosses the link */
#define STAGE_MIN_PIECES 64         /* fewer pieces: batched copies do as well */
#define STAGE_MAX_AVERAGE (1ull << 20) /* ... and so do long ones */
#define STAGE_UNAVAILABLE 1         /* no staging: use batched copies */

/* Scattered on the device but one run in host memory (saves and restores are), and many
 * small pieces: then a gather (or scatter) on the device and one long copy over the link beat
 * a batch of small copies, which the copy engines carry below the link's speed
 * (docs/benchmarks.md). */
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
  CUresult r = s->busy ? cuda_drv.cuStreamSynchronize(s->stream) : CUDA_SUCCESS;
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
    r = cuda_drv.cuMemcpyHtoDAsync(s->stage, host, bytes, s->stream); /* before the scatter */
  if (r == CUDA_SUCCESS)
    r = queue_moves(run->d, run->fn, s->stream, 0, s->mv, k, s->host_args, s->args);
  if (r == CUDA_SUCCESS && run->dir == SL_COPY_TO_HOST)
    r = cuda_drv.cuMemcpyDtoHAsync(host, s->stage, bytes, s->stream);
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

  if (host == NULL || cuda_drv.cuMemAlloc(mem, STAGE_SLOTS * (STAGE_BYTES + args)) != CUDA_SUCCESS)
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
    cuda_drv.cuMemFree(mem);
  pthread_mutex_unlock(&d->args_lock);
  cuda_leave();
  for (int k = 0; k < STAGE_SLOTS; k++)
    free(run.slot[k].mv);
  free(own);
  return rc;
}

/* --- copies into pages just made: SMs read the pinned host memory */

/* Into pages just made, a copy engine shares the link with the driver clearing memory freed
 * just before, and runs well below the speed it has into the same pages a moment later, while
 * SMs reading the pinned host memory run at one speed both times (the figures:
 * docs/benchmarks.md). A resume's copies back therefore run as moves (sl_move_ranges) whose
 * sources are host addresses, which kernels may read there (sm_copies; the save area is
 * registered DEVICEMAP). A piece whose ends disagree modulo 16 would cross the link a byte at
 * a time: then, or without the kernel, the copy engines take the call (COPY_ELSEWHERE). */

static int copy_by_sms(struct cuda_device *d, char *dev_mem, char *host_mem,
                       const struct sl_copy *c, size_t n, struct sl_err *err) {
  struct sl_move *m;
  int rc;

  for (size_t i = 0; i < n; i++)
    if ((((uintptr_t)dev_mem + c[i].dev_off) ^ ((uintptr_t)host_mem + c[i].host_off)) & 15)
      return COPY_ELSEWHERE;
  if ((m = malloc(n * sizeof(*m))) == NULL)
    return COPY_ELSEWHERE;
  for (size_t i = 0; i < n; i++)
    m[i] = (struct sl_move){(uintptr_t)host_mem + c[i].host_off,
                            (uintptr_t)dev_mem + c[i].dev_off, c[i].len};
  rc = moves_run(d, NULL, m, n, 0, err); /* absolute addresses: a base of 0 */
  free(m);
  return rc;
}

int cuda_copy(struct sl_device *dev, enum sl_copy_dir dir, void *dev_base, void *host_base,
              const struct sl_copy *copies, size_t n, struct sl_err *err) {
  struct cuda_device *d = to_cuda(dev);
  int rc = COPY_ELSEWHERE;

  if (dir == SL_COPY_TO_NEW_PAGES && d->sm_copies)
    rc = copy_by_sms(d, dev_base, host_base, copies, n, err);
  if (rc != COPY_ELSEWHERE)
    return rc;
  if (dir == SL_COPY_TO_NEW_PAGES)
    dir = SL_COPY_TO_DEVICE;
  rc = stage_worth(copies, n) ? copy_staged(d, dir, dev_base, host_base, copies, n, err)
                              : STAGE_UNAVAILABLE;
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
  CUresult r = cuda_drv.cuMemcpyHtoDAsync(dev_ranges, ranges, 16 * n, d->stream);
  int rc;

  if (r == CUDA_SUCCESS)
    r = cuda_drv.cuMemcpyHtoDAsync(dev_tile_end, tile_end, 8 * n, d->stream);
  if (r == CUDA_SUCCESS)
    r = cuda_drv.cuMemsetD8Async(dev_out, 0, 8 * n, d->stream);
  rc = cuda_check(r, err, "copying verify's ranges to the GPU", "check nvidia-smi");
  if (rc == 0 && tile_end[n - 1] > 0)
    rc = cuda_check(cuda_drv.cuLaunchKernel(fn, blocks, 1, 1, HASH_THREADS, 1, 1, 0, d->stream,
                                            args, NULL),
                    err, "sl_hash_ranges", "the GPU may be out of resources");
  if (rc == 0)
    rc = cuda_check(cuda_drv.cuMemcpyDtoHAsync(out, dev_out, 8 * n, d->stream), err,
                    "cuMemcpyDtoHAsync", "check nvidia-smi");
  /* Waits even after a failure: the copies read our arrays. */
  r = cuda_drv.cuStreamSynchronize(d->stream);
  return rc != 0 ? rc : cuda_check(r, err, "sl_hash_ranges",
                                   "the ranges must lie in mapped device memory");
}

int cuda_hash(struct sl_device *dev, const void *base, const struct sublet_range *ranges,
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
  rc = cuda_check(cuda_drv.cuCtxSynchronize(), err, "cuCtxSynchronize",
                  "a kernel failed earlier; the context is lost: restart the process");
  if (rc == 0 && (fn = kernel(d, KERNEL_HASH_RANGES)) == NULL)
    rc = sl_err_set(err, SUBLET_EDEVICE, "the driver could not load sublet's kernels (PTX for "
                    "compute_80, ISA 8.0): update the NVIDIA driver");
  if (rc == 0)
    rc = cuda_check(cuda_drv.cuMemAlloc(&mem, 32 * n), err, "cuMemAlloc",
                    "verify needs 32 bytes of GPU memory per kept range: free some");
  if (rc == 0)
    rc = hash_on_stream(d, fn, devptr(base), ranges, tile_end, n, mem, out, err);
  if (mem != 0)
    cuda_drv.cuMemFree(mem);
  cuda_leave();
cleanup:
  free(tile_end);
  return rc;
}
