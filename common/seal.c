/* seal.c - memfds sealed so that no client can write or shrink them (the contract is seal.h).
 * Floor 1 (floors.h). */
#include "seal.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef F_SEAL_FUTURE_WRITE
#define F_SEAL_FUTURE_WRITE 0x0010 /* Linux 5.1; older headers lack it */
#endif

#define READ_ONLY_SEALS (F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE)

int sl_seal_memfd(const char *name) {
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);

  return fd >= 0 ? fd : -errno;
}

static int add_seals(int fd, int seals) {
  return fcntl(fd, F_ADD_SEALS, seals) == 0 ? 0 : -errno;
}

int sl_seal_read_only(int fd) {
  if (fchmod(fd, S_IRUSR) != 0) /* a root daemon's file: other users cannot reopen it at all */
    return -errno;
  return add_seals(fd, READ_ONLY_SEALS);
}

int sl_seal_fixed_size(int fd) {
  return add_seals(fd, F_SEAL_SHRINK | F_SEAL_GROW);
}

int sl_seal_is_read_only(int fd) {
  int seals = fcntl(fd, F_GET_SEALS);

  return seals >= 0 && (seals & READ_ONLY_SEALS) == READ_ONLY_SEALS;
}

int sl_seal_grow_to(int fd, uint64_t size) {
  struct stat st;

  if (fstat(fd, &st) != 0)
    return -errno;
  if ((uint64_t)st.st_size >= size)
    return 0;
  return ftruncate(fd, (off_t)size) == 0 ? 0 : -errno;
}
