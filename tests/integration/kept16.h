/* kept16.h - what test_fresh.c and test_isolate.c share: a pattern written over a region of
 * NPAGES pages of PAGE bytes (both defined before this is included), the ranges kept of it,
 * the count of kept bytes that no longer hold the pattern, and the one-byte messages between
 * the test, its borrower and the borrower's keeper child, and the borrower's exit. */
#ifndef SL_TEST_KEPT16_H
#define SL_TEST_KEPT16_H

#include <stdint.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sublet.h"

static uint8_t pattern(uint64_t i) {
  return (uint8_t)((i * 2654435761u) >> 11);
}

/* Kept: the first 5000 bytes of each even page, and all of page 9; the rest is unkept. */
static size_t keep_ranges(struct sublet_range *k) {
  size_t n = 0;

  for (uint64_t p = 0; p < NPAGES; p += 2)
    k[n++] = (struct sublet_range){p * PAGE, 5000};
  k[n++] = (struct sublet_range){9ull * PAGE, PAGE};
  return n;
}

/* Bytes of the kept ranges that differ from the pattern. */
static uint64_t kept_changed(const uint8_t *base) {
  struct sublet_range k[NPAGES];
  size_t n = keep_ranges(k);
  uint64_t changed = 0;

  for (size_t i = 0; i < n; i++)
    for (uint64_t x = k[i].offset; x < k[i].offset + k[i].length; x++)
      changed += base[x] != pattern(x);
  return changed;
}

static int say(int fd, char c) {
  return write(fd, &c, 1) == 1 ? 0 : -1;
}

static int hear(int fd, char want) {
  char c = 0;
  return read(fd, &c, 1) == 1 && c == want ? 0 : -1;
}

struct pipes {
  int to_borrower[2], from_borrower[2], to_keeper[2], from_keeper[2];
};

/* Waits for the borrower; 0 if it did all it should. */
static int borrower_exit(pid_t pid) {
  int status;

  if (waitpid(pid, &status, 0) != pid)
    return -1;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fprintf(stderr, "  the borrower failed at step %d\n",
            WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

#endif
