/* books_model.h - the books' reference model (books_model.c): a long random sequence of
 * clients, regions, loans, borrows, allocations, frees and ends, each step done on the books
 * and on a model that keeps everything per byte and per position (slow and obviously right),
 * the two compared after every step, and sl_books_check() with them. test_books.c runs it.
 */
#ifndef SL_TEST_BOOKS_MODEL_H
#define SL_TEST_BOOKS_MODEL_H

#include <stdint.h>

/* One run: `steps` random steps from `seed`, on books of page_size bytes, moving kept bytes on
 * the device when `compact`. Failures count into check.h's tally (five end the run), each
 * printed with the seed and the step. */
void books_model_run(uint64_t seed, uint64_t page_size, int steps, int compact);

#endif
