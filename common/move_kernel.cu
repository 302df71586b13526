/* move_kernel.cu - the GPU kernel of sublet's moves (daemon/plan.h: compaction), one CUDA module.
 *
 * common/gen-move-kernel compiles this file to PTX for a baseline architecture (which the
 * driver JIT-compiles for the GPU at hand) and embeds it in common/move_kernel_ptx.c, which is
 * committed: building sublet needs no CUDA toolkit, only changing this file does. device_cuda.c
 * loads the module once per device (cuModuleLoadData) and finds the kernel by name. The kernel
 * is extern "C", so that its name is plain.
 */
typedef unsigned long long u64;

#define UNROLL 4 /* 16-byte loads in flight per thread */

/* ---- moves: many (src, dst, len) pieces in one launch */

#define MOVE_TILE (64ull << 10) /* bytes of one piece a block copies at a time */

/* The first move whose tiles reach past tile t. */
__device__ __forceinline__ u64 move_of_tile(const u64 *__restrict__ tile_end, u64 n, u64 t) {
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
 * not matter. Each move is cut in tiles of MOVE_TILE bytes; tile_end[i] counts the tiles of
 * moves 0..i; the blocks take the tiles in turn. n >= 1. */
extern "C" __global__ void sl_move_ranges(const u64 *__restrict__ moves,
                                          const u64 *__restrict__ tile_end, u64 n) {
  u64 ntiles = tile_end[n - 1];

  for (u64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
    u64 m = move_of_tile(tile_end, n, t), first = m > 0 ? tile_end[m - 1] : 0;
    u64 off = (t - first) * MOVE_TILE, len = moves[3 * m + 2];
    u64 take = len - off < MOVE_TILE ? len - off : MOVE_TILE;
    block_copy((unsigned char *)(moves[3 * m + 1] + off),
               (const unsigned char *)(moves[3 * m] + off), take);
  }
}
