/* kernels.cu - sublet's GPU kernels, one CUDA module: moves inside device memory
 * (compaction) and verify's checksums.
 *
 * common/gen-kernels compiles this file to PTX for a baseline architecture (which the driver
 * JIT-compiles for the GPU at hand) and embeds it in common/kernels_ptx.c, which is committed:
 * building sublet needs no CUDA toolkit, only changing this file does. device_cuda.c loads the
 * module once per device (cuModuleLoadData) and finds each kernel by name (its kernel_names
 * table). Kernels are extern "C", so that their names are plain.
 */
#include "hash.h"
#include "kernels.h"

#define WARP 32
#define UNROLL 4 /* 16-byte loads in flight per thread */

typedef unsigned long long u64;

/* The first piece whose tiles reach past tile t; tile_end[i] counts the tiles of pieces 0..i. */
__device__ __forceinline__ u64 piece_of_tile(const u64 *__restrict__ tile_end, u64 n, u64 t) {
  u64 lo = 0, hi = n - 1;

  while (lo < hi) {
    u64 mid = lo + (hi - lo) / 2;
    if (tile_end[mid] > t)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

/* ---- moves (daemon/books/plan.h: compaction): many (src, dst, len) pieces in one launch */

/* One block copies len bytes from src to dst: 16-byte words, UNROLL of them in flight per
 * thread, where src and dst agree modulo 16 (kept ranges of whole elements do), single bytes
 * at the edges, and everywhere when they do not agree. */
__device__ __forceinline__ void block_copy(unsigned char *dst, const unsigned char *src,
                                           u64 len) {
  u64 head = len, words = 0;

  if ((((u64)src ^ (u64)dst) & 15) == 0) {
    head = (16 - ((u64)src & 15)) & 15;
    head = head < len ? head : len;
    words = (len - head) / 16;
  }
  for (u64 i = threadIdx.x; i < head; i += blockDim.x)
    dst[i] = src[i];
  const uint4 *s = (const uint4 *)(src + head);
  uint4 *d = (uint4 *)(dst + head);
  u64 step = (u64)blockDim.x * UNROLL, i = threadIdx.x;
  for (; i + (UNROLL - 1) * blockDim.x < words; i += step) {
    uint4 v[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; j++)
      v[j] = s[i + j * blockDim.x];
#pragma unroll
    for (int j = 0; j < UNROLL; j++)
      d[i + j * blockDim.x] = v[j];
  }
  for (; i < words; i += blockDim.x)
    d[i] = s[i];
  for (u64 b = head + words * 16 + threadIdx.x; b < len; b += blockDim.x)
    dst[b] = src[b];
}

/* Copies moves[3i + 2] bytes from address moves[3i] to address moves[3i + 1], for every i, in
 * one launch. No two moves overlap, in source or destination (plan.h), so their order does
 * not matter. Each move is cut in tiles of SL_MOVE_TILE bytes; tile_end[i] counts the tiles of
 * moves 0..i. Each block takes an equal run of consecutive tiles: it finds the move of its
 * first tile once and walks on from there (a search per tile, 18 dependent loads for 200,000
 * moves, cost as much as copying the tile). n >= 1. */
extern "C" __global__ void sl_move_ranges(const u64 *__restrict__ moves,
                                          const u64 *__restrict__ tile_end, u64 n) {
  u64 ntiles = tile_end[n - 1];
  u64 t = ntiles * blockIdx.x / gridDim.x, t_stop = ntiles * (blockIdx.x + 1) / gridDim.x;
  u64 m = t < t_stop ? piece_of_tile(tile_end, n, t) : n;

  for (; t < t_stop; t++) {
    while (tile_end[m] <= t) /* moves of no bytes have no tiles */
      m++;
    u64 first = m > 0 ? tile_end[m - 1] : 0;
    u64 off = (t - first) * SL_MOVE_TILE, len = moves[3 * m + 2];
    u64 take = len - off < SL_MOVE_TILE ? len - off : SL_MOVE_TILE;
    block_copy((unsigned char *)(moves[3 * m + 1] + off),
               (const unsigned char *)(moves[3 * m] + off), take);
  }
}

/* ---- verify's checksums */

__device__ __forceinline__ u64 warp_sum(u64 v) {
  for (int s = WARP / 2; s > 0; s /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, s);
  return v;
}

/* One lane's part of the hash.h sum of region bytes [a, b): the lanes of a warp take
 * consecutive 16-byte chunks (coalesced), UNROLL of them at a time. */
__device__ __forceinline__ u64 lane_sum(const unsigned char *__restrict__ base, u64 a, u64 b,
                                        int lane) {
  u64 acc = 0;

  for (u64 c = (a & ~15ull) + 16ull * lane; c < b; c += 16ull * WARP * UNROLL) {
    ulonglong2 v[UNROLL];
#pragma unroll
    for (int j = 0; j < UNROLL; j++) {
      u64 at = c + 16ull * WARP * j;
      v[j] = at < b ? __ldg((const ulonglong2 *)(base + at)) : make_ulonglong2(0, 0);
    }
#pragma unroll
    for (int j = 0; j < UNROLL; j++) {
      u64 at = c + 16ull * WARP * j, key = sl_hash_key(at / 8);
      if (at >= a && at + 16 <= b) /* inside the range: no masks */
        acc += sl_hash_mix(v[j].x, key) + sl_hash_mix(v[j].y, key + SL_HASH_KEY_STEP);
      else if (at < b)
        acc += sl_hash_word(v[j].x, at / 8, a, b) + sl_hash_word(v[j].y, at / 8 + 1, a, b);
    }
  }
  return acc;
}

/* verify's checksums (hash.h), all ranges in one launch: out[i] += the sum of range i, whose
 * offset and length in the region at base are ranges[2i], ranges[2i+1]. Each range is cut in
 * tiles of SL_HASH_TILE bytes aligned in the region; tile_end[i] counts the tiles of ranges
 * 0..i. Every warp takes an equal share of the tiles, in order, and adds to out only where its
 * share moves from one range to the next: 300,000 small ranges and a few huge ones both run at
 * memory bandwidth. out is zeroed by the caller; n >= 1. */
extern "C" __global__ void sl_hash_ranges(const unsigned char *__restrict__ base,
                                          const u64 *__restrict__ ranges,
                                          const u64 *__restrict__ tile_end, u64 n,
                                          u64 *__restrict__ out) {
  u64 ntiles = tile_end[n - 1];
  u64 nwarps = (u64)gridDim.x * blockDim.x / WARP;
  u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / WARP;
  u64 t = ntiles * warp / nwarps, t_stop = ntiles * (warp + 1) / nwarps;
  int lane = threadIdx.x % WARP;
  u64 r = t < t_stop ? piece_of_tile(tile_end, n, t) : n;

  for (; t < t_stop; r++) {
    u64 first = r > 0 ? tile_end[r - 1] : 0, stop = min(t_stop, tile_end[r]);
    u64 off = ranges[2 * r], end = off + ranges[2 * r + 1];
    u64 aligned = off & ~(SL_HASH_TILE - 1);
    u64 a = max(off, aligned + (t - first) * SL_HASH_TILE);
    u64 b = min(end, aligned + (stop - first) * SL_HASH_TILE);
    u64 sum;

    if (stop <= t)
      continue; /* a range of no bytes: no tiles */
    sum = warp_sum(lane_sum(base, a, b, lane));
    if (lane == 0 && sum != 0)
      atomicAdd(&out[r], sum);
    t = stop;
  }
}
