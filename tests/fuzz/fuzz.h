/* fuzz.h - what a fuzz target defines: the libFuzzer entry point, and valid inputs to start
 * from. replay.c (the driver when built without libFuzzer) mutates the valid inputs and
 * writes them out as the corpus seeds (--write-seeds DIR).
 */
#ifndef SL_FUZZ_H
#define SL_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Writes valid input number i into buf (cap bytes); returns its size, 0 past the last one. */
size_t sl_fuzz_seed(unsigned i, uint8_t *buf, size_t cap);

#endif
