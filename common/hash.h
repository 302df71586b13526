/* hash.h - the checksum that `verify` compares: one 64-bit sum per byte range of a region.
 * One definition for the CPU (device_memfd.c) and the GPU (kernels.cu, which includes this
 * file), so that both backends compute the same value for the same bytes.
 *
 * The range's bytes are read as the little-endian 64-bit words of the region that they touch
 * (word q covers region bytes [8q, 8q+8); bytes of a word outside the range read as zero).
 * Each word is mixed with its position q (murmur3's 64-bit finalizer, a bijection, applied to
 * word ^ key(q)) and the mixed words are added. So a change to any one word always changes the
 * sum, words that swap places change it, and the sum does not depend on how the work is split:
 * a GPU adds the words of one range in any order, from any number of threads.
 */
#ifndef SL_HASH_H
#define SL_HASH_H

#ifdef __CUDACC__
#define SL_HASH_FN __device__ __forceinline__
typedef unsigned long long sl_hash_u64;
#else
#include <stdint.h>
#define SL_HASH_FN static inline
typedef uint64_t sl_hash_u64;
#endif

/* The GPU splits ranges into tiles of this many bytes, aligned to it in the region. */
#define SL_HASH_TILE 65536ull

/* The key of word q: linear in q, so that the next word's key is one addition away. */
#define SL_HASH_KEY_STEP 0x9E3779B97F4A7C15ull

SL_HASH_FN sl_hash_u64 sl_hash_key(sl_hash_u64 q) {
  return q * SL_HASH_KEY_STEP + 0xD1B54A32D192ED03ull;
}

SL_HASH_FN sl_hash_u64 sl_hash_mix(sl_hash_u64 word, sl_hash_u64 key) {
  sl_hash_u64 x = word ^ key;
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}

/* Word q of the region (its value w) as part of range [begin, end): masked to the range's
 * bytes and mixed, or 0 when it has none of them. */
SL_HASH_FN sl_hash_u64 sl_hash_word(sl_hash_u64 w, sl_hash_u64 q, sl_hash_u64 begin,
                                    sl_hash_u64 end) {
  sl_hash_u64 at = q * 8, lo, hi;

  if (at >= begin && at + 8 <= end)
    return sl_hash_mix(w, sl_hash_key(q));
  if (end <= begin || end <= at || begin >= at + 8)
    return 0;
  lo = begin > at ? begin - at : 0;
  hi = end < at + 8 ? end - at : 8;
  w &= (hi - lo == 8 ? ~0ull : ((1ull << (8 * (hi - lo))) - 1)) << (8 * lo);
  return sl_hash_mix(w, sl_hash_key(q));
}

#endif
