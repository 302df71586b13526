/* fuzz.h - what a fuzz target defines: the libFuzzer entry point, and valid inputs to start
 * from. replay.c (the driver when built without libFuzzer) mutates the valid inputs and
 * writes them out as the corpus seeds (--write-seeds DIR).
 */
#ifndef SL_FUZZ_H
#define SL_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Writes valid input number i into buf (cap bytes); returns its size, 0 past the last one. */
size_t sl_fuzz_seed(unsigned i, uint8_t *buf, size_t cap);

/* A valid input made in code: writes it (1 KiB at most) into buf and returns its size. */
typedef size_t (*sl_fuzz_seed_fn)(uint8_t *buf);

/* sl_fuzz_seed for a target whose valid inputs are made by the n functions seeds[]. */
static inline size_t sl_fuzz_seed_made(const sl_fuzz_seed_fn *seeds, unsigned n, unsigned i,
                                       uint8_t *buf, size_t cap) {
  uint8_t tmp[1024];
  size_t len;

  if (i >= n)
    return 0;
  len = seeds[i](tmp);
  if (len > cap)
    return 0;
  memcpy(buf, tmp, len);
  return len;
}

#endif
