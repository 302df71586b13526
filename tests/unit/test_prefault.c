/* test_prefault.c - unit tests of common/prefault.c: every page of the range is made, whatever
 * its size against the threads' shares, in shared memory (a save area's memfd) and private
 * memory alike, and nothing outside the range is touched. */
#include "prefault.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

#define MiB (1ull << 20)

/* Resident pages of [p, p + size), by mincore. */
static uint64_t resident(void *p, uint64_t size) {
  uint64_t ps = (uint64_t)sysconf(_SC_PAGESIZE), n = (size + ps - 1) / ps, count = 0;
  unsigned char *v = malloc(n);

  if (v == NULL || mincore(p, size, v) != 0) {
    free(v);
    return UINT64_MAX;
  }
  for (uint64_t i = 0; i < n; i++)
    count += v[i] & 1;
  free(v);
  return count;
}

/* A mapping of whole + guard bytes (shared: of a memfd); prefaults `whole`, checks that every
 * page of it and none of the guard is resident and reads zero. */
static void check_made(uint64_t whole, int shared) {
  uint64_t ps = (uint64_t)sysconf(_SC_PAGESIZE), guard = 4 * MiB;
  int fd = shared ? memfd_create("test-prefault", 0) : -1;
  char *p;

  if (shared && (fd < 0 || ftruncate(fd, (off_t)(whole + guard)) != 0))
    abort();
  p = mmap(NULL, whole + guard, PROT_READ | PROT_WRITE,
           shared ? MAP_SHARED : MAP_PRIVATE | MAP_ANONYMOUS, fd, 0);
  CHECK(p != MAP_FAILED);
  sl_prefault(p, whole);
  CHECK_EQ(resident(p, whole), whole / ps);
  CHECK_EQ(resident(p + whole, guard), 0);
  CHECK(p[0] == 0 && p[whole / 2] == 0 && p[whole - 1] == 0);
  munmap(p, whole + guard);
  if (fd >= 0)
    close(fd);
}

int main(void) {
  check_made(4096, 1);                /* one page, one thread */
  check_made(64 * MiB, 1);            /* the smallest range worth a second thread */
  check_made(256 * MiB, 1);           /* a save area's piece: shares of 32 MiB */
  check_made(200 * MiB + 4096, 1);    /* shares that do not divide it: the last one shorter */
  check_made(3 * 64 * MiB + 8192, 0); /* private memory, as cuda_host_alloc's */
  return check_report("prefault");
}
