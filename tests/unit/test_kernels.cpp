/* test_kernels.cpp - the GPU kernels of common/kernels.cu, run on the CPU where no GPU is.
 *
 * A shim gives kernels.cu the CUDA built-ins it uses: each lane of a warp is a thread, and a
 * warp shuffle meets its 32 lanes at a barrier. Grids of a few blocks of two warps run over
 * random ranges (empty, tiny, unaligned, across 64 KiB tiles, nearly the whole buffer): every
 * checksum must equal hash.h's definition computed plainly, and every move must land as
 * memmove would put it. It checks the kernels' work split, masks and edges; the GPU itself runs
 * them in tests/unit/test_device.c (cuda part). A kernel that uses another built-in adds it to
 * the shim.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <thread>
#include <vector>

/* --- the shim */
struct dim3 {
  unsigned x, y, z;
};
struct ulonglong2 {
  unsigned long long x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
static inline ulonglong2 make_ulonglong2(unsigned long long a, unsigned long long b) {
  return {a, b};
}
template <class T> static inline T __ldg(const T *p) {
  return *p;
}
using std::max;
using std::min;

static dim3 gridDim, blockDim, blockIdx;
static thread_local dim3 threadIdx;
static pthread_barrier_t warp_barrier;
static unsigned long long shuffle_slots[32];
static pthread_mutex_t atomic_lock = PTHREAD_MUTEX_INITIALIZER;

static unsigned long long __shfl_xor_sync(unsigned, unsigned long long v, int mask) {
  int lane = threadIdx.x % 32;
  shuffle_slots[lane] = v;
  pthread_barrier_wait(&warp_barrier);
  unsigned long long other = shuffle_slots[lane ^ mask];
  pthread_barrier_wait(&warp_barrier);
  return other;
}

static void atomicAdd(unsigned long long *p, unsigned long long v) {
  pthread_mutex_lock(&atomic_lock);
  *p += v;
  pthread_mutex_unlock(&atomic_lock);
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __CUDACC__
#include "kernels.cu"

/* --- the check */

static uint64_t reference_hash(const uint8_t *p, uint64_t begin, uint64_t end) {
  uint64_t sum = 0, w;

  for (uint64_t q = begin / 8; q * 8 < end; q++) {
    memcpy(&w, p + q * 8, 8);
    sum += sl_hash_word(w, q, begin, end);
  }
  return sum;
}

static uint64_t next(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return *s >> 17;
}

/* Runs the grid one warp at a time, its 32 lanes as threads. */
template <class F> static void run_grid(unsigned blocks, unsigned threads, F kernel) {
  gridDim = {blocks, 1, 1};
  blockDim = {threads, 1, 1};
  for (unsigned b = 0; b < blocks; b++) {
    blockIdx = {b, 0, 0};
    for (unsigned w = 0; w < threads / 32; w++) {
      std::vector<std::thread> lanes;
      pthread_barrier_init(&warp_barrier, NULL, 32);
      for (unsigned l = 0; l < 32; l++)
        lanes.emplace_back([=] {
          threadIdx = {w * 32 + l, 0, 0};
          kernel();
        });
      for (auto &t : lanes)
        t.join();
      pthread_barrier_destroy(&warp_barrier);
    }
  }
}

/* One launch over n random ranges of the buffer; returns the mismatches. */
static int hash_trial(const uint8_t *buf, uint64_t size, unsigned blocks, uint64_t *seed) {
  size_t n = 1 + next(seed) % 150;
  std::vector<unsigned long long> ranges(2 * n), tile_end(n), out(n, 0);
  unsigned long long tiles = 0;
  int bad = 0;

  for (size_t i = 0; i < n; i++) {
    uint64_t len = i % 7 == 0 ? 0 : i % 3 == 0 ? next(seed) % 20 : next(seed) % 200000;
    len = i == 0 && blocks % 2 ? size - 3 : len;
    uint64_t off = next(seed) % (size - len + 1);
    ranges[2 * i] = off;
    ranges[2 * i + 1] = len;
    tiles += len ? (off + len - 1) / SL_HASH_TILE - off / SL_HASH_TILE + 1 : 0;
    tile_end[i] = tiles;
  }
  run_grid(blocks, 64, [&] {
    sl_hash_ranges(buf, ranges.data(), tile_end.data(), n, out.data());
  });
  for (size_t i = 0; i < n; i++) {
    uint64_t want = reference_hash(buf, ranges[2 * i], ranges[2 * i] + ranges[2 * i + 1]);
    if (out[i] != want && bad++ < 5)
      fprintf(stderr, "range %zu (offset %llu, length %llu): %016llx, expected %016llx\n", i,
              ranges[2 * i], ranges[2 * i + 1], out[i], (unsigned long long)want);
  }
  return bad;
}

/* One launch of random non-overlapping moves inside the buffer (any alignment, across tiles);
 * returns 1 when every byte is where memmove would have put it. */
static int move_trial(std::vector<uint8_t> &buf, unsigned blocks, uint64_t *seed) {
  const uint64_t slot = 3 * SL_MOVE_TILE; /* each move reads and writes its own slots */
  size_t n = 1 + next(seed) % (buf.size() / (2 * slot));
  std::vector<unsigned long long> moves(3 * n), tile_end(n);
  std::vector<uint8_t> want(buf);
  unsigned long long tiles = 0;

  for (size_t i = 0; i < n; i++) {
    uint64_t len = next(seed) % (slot - 16), src = 2 * i * slot + next(seed) % 16;
    uint64_t dst = (2 * i + 1) * slot + next(seed) % 16;
    moves[3 * i] = (unsigned long long)(uintptr_t)(buf.data() + src);
    moves[3 * i + 1] = (unsigned long long)(uintptr_t)(buf.data() + dst);
    moves[3 * i + 2] = len;
    memmove(want.data() + dst, want.data() + src, len);
    tiles += (len + SL_MOVE_TILE - 1) / SL_MOVE_TILE;
    tile_end[i] = tiles;
  }
  if (tiles == 0)
    return 1;
  run_grid(blocks, 64, [&] { sl_move_ranges(moves.data(), tile_end.data(), n); });
  return buf == want;
}

int main() {
  const uint64_t size = 4 << 20;
  std::vector<uint8_t> buf(size);
  uint64_t seed = 1;
  int bad = 0, trials = 24;

  for (auto &b : buf)
    b = (uint8_t)next(&seed);
  for (int t = 0; t < trials; t++)
    bad += hash_trial(buf.data(), size, 1 + t % 5, &seed);
  printf("kernels: sl_hash_ranges, %d launches: %s\n", trials, bad ? "MISMATCH" : "ok");
  int moved = 1;
  for (int t = 0; t < 8 && moved; t++)
    moved = move_trial(buf, 1 + t % 4 * 2, &seed); /* 1 to 7 blocks: some without a tile */
  printf("kernels: sl_move_ranges, 8 launches: %s\n", moved ? "ok" : "MISMATCH");
  return bad != 0 || !moved;
}
