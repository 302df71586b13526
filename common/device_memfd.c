/* device_memfd.c - the memfd backend: a device made of host memory, for machines without a GPU.
 *
 * A handle is a memfd (handle = fd + 1); the device that created or imported it owns the fd and
 * closes it on release. Reservations are PROT_NONE anonymous mappings; mapping a handle replaces
 * part of one with a MAP_SHARED mapping of the memfd, unmapping puts PROT_NONE back. Two
 * processes (or two addresses) that map one handle see the same bytes, as with CUDA.
 *
 * "Device memory" is the bytes of the memfds this device created, counted against a total, so
 * that running out behaves as on a GPU. Imported handles are not counted: their creator counts
 * them.
 *
 * Copies are memcpy. $SUBLET_MEMFD_LINK (bytes per second, as "2G") makes them take as long as
 * they would over a host link of that speed, in steps of a MiB: tests use it to watch the
 * daemon serve others during a long copy, and to kill it in the middle of one.
 * $SUBLET_MEMFD_PIN (bytes per second) does the same for pinning host memory (host_map), which
 * takes seconds per 10 GiB on a GPU machine: tests use it to signal subletd while --pin runs.
 * $SUBLET_MEMFD_CREATE (bytes per second) paces creating handles likewise (a large region's
 * take seconds on a GPU): tests use it to watch the daemon serve others meanwhile.
 * $SUBLET_MEMFD_MAPPED=1 keeps a handle this device created counted after its release for as
 * long as any process still maps it, as a GPU's memory lives until every process has let go
 * (by default the bytes are free at the release). The kernel says whether one does: adding
 * F_SEAL_WRITE to a memfd fails with EBUSY while a writable shared mapping of it exists (every
 * mapping here is one). Tests use it to show what the owner's own mapping costs on CUDA. A
 * process that holds only an fd, unmapped, is not seen.
 *
 * Floor 3 (floors.h).
 */
#include "device.h"
#include "hash.h"
#include "prefault.h"
#include "seal.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define DEFAULT_PAGE_SIZE (2ull << 20)
#define DEFAULT_TOTAL (1ull << 30)

/* What this device knows of one fd it owns (a handle it created or imported). */
struct owned_fd {
  uint64_t counted; /* bytes counted against the total: the size if created here, else 0 */
  int live;
  int lingers; /* released, still counted: a process maps it ($SUBLET_MEMFD_MAPPED) */
};

struct memfd_device {
  struct sl_device base;
  pthread_mutex_t lock; /* guards the books below: the client calls from many threads */
  uint64_t created_bytes;
  uint64_t link_bps; /* $SUBLET_MEMFD_LINK: copies paced to it; 0: as fast as memcpy */
  uint64_t pin_bps;  /* $SUBLET_MEMFD_PIN: host_map paced to it; 0: at once */
  uint64_t create_bps; /* $SUBLET_MEMFD_CREATE: create paced to it; 0: at once */
  int count_mapped;    /* $SUBLET_MEMFD_MAPPED: released handles count while mapped */
  size_t nlinger;      /* owned[] entries that linger */
  /* owned[fd], indexed by fd because fds are small dense integers (bounded by the open-files
   * limit). It lets release/map/export refuse fds the device does not own. */
  struct owned_fd *owned;
  size_t owned_cap;
};

static struct memfd_device *to_memfd(struct sl_device *d) {
  return (struct memfd_device *)d;
}

static int handle_fd(sl_handle h) {
  return h == 0 || h - 1 > (sl_handle)INT32_MAX ? -1 : (int)(h - 1);
}

/* --- sizes from the environment: "2M", "512K", "4G", "1048576" */

static int size_setting(uint64_t given, const char *env, uint64_t fallback, uint64_t *out,
                        struct sl_err *err) {
  const char *s = getenv(env);
  if (given != 0) {
    *out = given;
    return 0;
  }
  if (s == NULL || *s == '\0') {
    *out = fallback;
    return 0;
  }
  if (sl_parse_size(s, out) != 0 || *out == 0)
    return sl_err_set(err, SUBLET_EINVAL, "%s=\"%s\" is not a size: write it as 2M, 512K or 1G",
                      env, s);
  return 0;
}

static int check_page_size(uint64_t page, struct sl_err *err) {
  uint64_t system_page = (uint64_t)sysconf(_SC_PAGESIZE);
  if ((page & (page - 1)) != 0 || page % system_page != 0)
    return sl_err_set(err, SUBLET_EINVAL,
                      "memfd page size %llu must be a power of two and a multiple of the system "
                      "page size (%llu); set SUBLET_MEMFD_PAGE_SIZE to e.g. 2M",
                      (unsigned long long)page, (unsigned long long)system_page);
  return 0;
}

static void fill_info(struct sl_device_info *info, int ordinal, uint64_t page, uint64_t total) {
  static const char tag[12] = "sublet-memfd"; /* a fixed UUID: tag, then the ordinal */
  uint32_t ord = (uint32_t)ordinal;
  int i;

  snprintf(info->backend, sizeof(info->backend), "memfd");
  snprintf(info->name, sizeof(info->name), "memfd (host memory)");
  memcpy(info->uuid, tag, sizeof(tag));
  for (i = 0; i < 4; i++)
    info->uuid[12 + i] = (uint8_t)(ord >> (24 - 8 * i));
  info->ordinal = ordinal;
  info->page_size = page;
  info->total_bytes = total;
}

static int memfd_open(const struct sl_device_params *p, struct sl_device **out,
                      struct sl_err *err) {
  struct memfd_device *d;
  uint64_t page, total, link, pin, create;
  int rc;

  rc = size_setting(p->page_size, "SUBLET_MEMFD_PAGE_SIZE", DEFAULT_PAGE_SIZE, &page, err);
  if (rc == 0)
    rc = size_setting(p->total_bytes, "SUBLET_MEMFD_TOTAL", DEFAULT_TOTAL, &total, err);
  if (rc == 0)
    rc = check_page_size(page, err);
  if (rc == 0)
    rc = size_setting(0, "SUBLET_MEMFD_LINK", UINT64_MAX, &link, err);
  if (rc == 0)
    rc = size_setting(0, "SUBLET_MEMFD_PIN", UINT64_MAX, &pin, err);
  if (rc == 0)
    rc = size_setting(0, "SUBLET_MEMFD_CREATE", UINT64_MAX, &create, err);
  if (rc != 0)
    return rc;
  d = calloc(1, sizeof(*d));
  if (d == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "memfd backend: out of host memory");
  d->link_bps = link == UINT64_MAX ? 0 : link;
  d->pin_bps = pin == UINT64_MAX ? 0 : pin;
  d->create_bps = create == UINT64_MAX ? 0 : create;
  d->count_mapped = getenv("SUBLET_MEMFD_MAPPED") != NULL &&
                    strcmp(getenv("SUBLET_MEMFD_MAPPED"), "1") == 0;
  pthread_mutex_init(&d->lock, NULL);
  fill_info(&d->base.info, p->ordinal, page, total);
  *out = &d->base;
  return 0;
}

/* Closes the fds of the handles the caller did not release: the device owns them. Mappings of
 * them stay valid, as a CUDA mapping outlives its handle's release. */
static void memfd_close(struct sl_device *dev) {
  struct memfd_device *d = to_memfd(dev);
  size_t fd;

  for (fd = 0; fd < d->owned_cap; fd++)
    if (d->owned[fd].live || d->owned[fd].lingers)
      close((int)fd);
  pthread_mutex_destroy(&d->lock);
  free(d->owned);
  free(d);
}

static void sweep_lingering(struct memfd_device *d);

static int memfd_free_bytes(struct sl_device *dev, uint64_t *free_bytes, struct sl_err *err) {
  struct memfd_device *d = to_memfd(dev);
  pthread_mutex_lock(&d->lock);
  sweep_lingering(d);
  *free_bytes = d->base.info.total_bytes - d->created_bytes;
  pthread_mutex_unlock(&d->lock);
  return 0;
}

/* --- the books of created handles (called with d->lock held) */

/* Does a process map the memfd (writable and shared, as every mapping of a page is)? The
 * seal is refused while one does; once added it is harmless: the handle is released. */
static int mapped_somewhere(int fd) {
  return fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE) != 0 && errno == EBUSY;
}

/* Released handles that no process maps any more are uncounted and closed. */
static void sweep_lingering(struct memfd_device *d) {
  for (size_t fd = 0; d->nlinger > 0 && fd < d->owned_cap; fd++) {
    if (!d->owned[fd].lingers || mapped_somewhere((int)fd))
      continue;
    d->created_bytes -= d->owned[fd].counted;
    d->owned[fd] = (struct owned_fd){0};
    d->nlinger--;
    close((int)fd);
  }
}

static int count_created(struct memfd_device *d, uint64_t size, struct sl_err *err) {
  uint64_t total = d->base.info.total_bytes;
  uint64_t free_bytes;
  char asked[16], left[16], all[16];

  sweep_lingering(d);
  free_bytes = total - d->created_bytes;

  if (size > free_bytes)
    return sl_err_set(err, SUBLET_ENOMEM, "out of device memory: asked %s, %s free of %s",
                      sl_format_size(asked, size), sl_format_size(left, free_bytes),
                      sl_format_size(all, total));
  d->created_bytes += size;
  return 0;
}

static int grow_owned(struct memfd_device *d, int fd) {
  size_t cap = d->owned_cap;
  struct owned_fd *grown;

  while ((size_t)fd >= cap)
    cap = cap == 0 ? 1024 : cap * 2;
  grown = realloc(d->owned, cap * sizeof(*grown));
  if (grown == NULL)
    return SUBLET_ENOHOSTMEM;
  memset(grown + d->owned_cap, 0, (cap - d->owned_cap) * sizeof(*grown));
  d->owned = grown;
  d->owned_cap = cap;
  return 0;
}

static int remember_fd(struct memfd_device *d, int fd, uint64_t counted) {
  if ((size_t)fd >= d->owned_cap && grow_owned(d, fd) != 0)
    return SUBLET_ENOHOSTMEM;
  d->owned[fd].counted = counted;
  d->owned[fd].live = 1;
  return 0;
}

static int owns_fd(const struct memfd_device *d, int fd) {
  return fd >= 0 && (size_t)fd < d->owned_cap && d->owned[fd].live;
}

/* Uncounts fd if this device created it; imported handles were never counted. */
static void forget_fd(struct memfd_device *d, int fd) {
  d->created_bytes -= d->owned[fd].counted;
  d->owned[fd].counted = 0;
  d->owned[fd].live = 0;
}

/* The fd behind h, or -1 if h is not a handle this device holds. */
static int owned_handle_fd(struct memfd_device *d, sl_handle h) {
  int fd = handle_fd(h);
  int owned;

  pthread_mutex_lock(&d->lock);
  owned = owns_fd(d, fd);
  pthread_mutex_unlock(&d->lock);
  return owned ? fd : -1;
}

/* --- handles */

/* A page: sealed to its size at once, so that a client holding its fd (every client that maps
 * it does) cannot truncate it under the daemon's mapping, which would then SIGBUS (issue 25). */
static int new_memfd(uint64_t size, int *fd, struct sl_err *err) {
  int rc = 0;

  *fd = sl_seal_memfd("sublet-page");
  if (*fd < 0)
    return sl_err_set(err, SUBLET_EDEVICE, "memfd_create: %s (check the open-files limit)",
                      strerror(-*fd));
  if (ftruncate(*fd, (off_t)size) != 0)
    rc = sl_err_set(err, SUBLET_ENOMEM, "ftruncate of a memfd to %llu bytes: %s",
                    (unsigned long long)size, strerror(errno));
  else if ((rc = sl_seal_fixed_size(*fd)) != 0)
    rc = sl_err_set(err, SUBLET_EDEVICE, "sealing a memfd page to its size: %s", strerror(-rc));
  if (rc != 0) {
    close(*fd);
    *fd = -1;
  }
  return rc;
}

static double now_seconds(void);
static void pace(uint64_t bps, double t0, uint64_t done);

static int memfd_create_handle(struct sl_device *dev, uint64_t size, sl_handle *out,
                               struct sl_err *err) {
  struct memfd_device *d = to_memfd(dev);
  int fd = -1;
  int rc;

  *out = 0;
  if (d->create_bps > 0)
    pace(d->create_bps, now_seconds(), size);
  pthread_mutex_lock(&d->lock);
  rc = count_created(d, size, err);
  if (rc != 0)
    goto unlock;
  rc = new_memfd(size, &fd, err);
  if (rc != 0)
    goto uncount;
  if (remember_fd(d, fd, size) != 0) {
    rc = sl_err_set(err, SUBLET_ENOHOSTMEM, "memfd backend: out of host memory for its books");
    close(fd);
    goto uncount;
  }
  *out = (sl_handle)fd + 1; /* the device owns fd until release */
  goto unlock;
uncount:
  d->created_bytes -= size;
unlock:
  pthread_mutex_unlock(&d->lock);
  return rc;
}

/* With $SUBLET_MEMFD_MAPPED a created handle that a process still maps lingers: its fd stays
 * open here (so its number is not reused) and its bytes counted until a sweep finds it
 * unmapped everywhere. */
static int memfd_release(struct sl_device *dev, sl_handle h) {
  struct memfd_device *d = to_memfd(dev);
  int fd = handle_fd(h);
  int owned, linger;

  pthread_mutex_lock(&d->lock);
  owned = owns_fd(d, fd);
  linger = owned && d->count_mapped && d->owned[fd].counted > 0 && mapped_somewhere(fd);
  if (linger) {
    d->owned[fd].live = 0;
    d->owned[fd].lingers = 1;
    d->nlinger++;
  } else if (owned) {
    forget_fd(d, fd);
  }
  pthread_mutex_unlock(&d->lock);
  if (!owned)
    return SUBLET_EINVAL; /* never close an fd the device does not own */
  if (!linger)
    close(fd);
  return 0;
}

static int memfd_export(struct sl_device *dev, sl_handle h, int *fd, struct sl_err *err) {
  int own = owned_handle_fd(to_memfd(dev), h);

  if (own < 0)
    return sl_err_set(err, SUBLET_EINVAL, "export: %llu is not a handle of this device",
                      (unsigned long long)h);
  *fd = fcntl(own, F_DUPFD_CLOEXEC, 0); /* the caller owns the copy */
  if (*fd < 0)
    return sl_err_set(err, SUBLET_EDEVICE, "export of handle %llu: %s (check the open-files "
                      "limit)", (unsigned long long)h, strerror(errno));
  return 0;
}

/* Rejects what could not have come from a memfd device with the same page size. */
static int check_importable(struct sl_device *dev, int fd, struct sl_err *err) {
  uint64_t page = dev->info.page_size;
  struct stat st;

  if (fstat(fd, &st) != 0)
    return sl_err_set(err, SUBLET_EINVAL, "import: fd %d: %s", fd, strerror(errno));
  if (!S_ISREG(st.st_mode) || st.st_size <= 0 || (uint64_t)st.st_size % page != 0)
    return sl_err_set(err, SUBLET_EINVAL,
                      "import: fd %d is not a memfd device page (a file of whole %llu-byte "
                      "pages); it was sent by a daemon with another backend or page size?",
                      fd, (unsigned long long)page);
  return 0;
}

static int memfd_import(struct sl_device *dev, int fd, sl_handle *out, struct sl_err *err) {
  struct memfd_device *d = to_memfd(dev);
  int own;
  int rc = check_importable(dev, fd, err);

  if (rc != 0)
    return rc;
  own = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* the device owns the copy; fd stays the caller's */
  if (own < 0)
    return sl_err_set(err, SUBLET_EDEVICE, "import: dup of fd %d: %s (check the open-files "
                      "limit)", fd, strerror(errno));
  pthread_mutex_lock(&d->lock);
  rc = remember_fd(d, own, 0);
  pthread_mutex_unlock(&d->lock);
  if (rc != 0) {
    close(own);
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "memfd backend: out of host memory for its books");
  }
  *out = (sl_handle)own + 1;
  return 0;
}

/* --- address space */

static void *map_none(void *addr, uint64_t size, int flags) {
  return mmap(addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | flags, -1, 0);
}

/* Aligned to the page size, as cuMemAddressReserve aligns: over-reserve, trim both ends. */
static int memfd_reserve(struct sl_device *dev, uint64_t size, void **addr, struct sl_err *err) {
  uint64_t page = dev->info.page_size;
  char *raw = map_none(NULL, size + page, 0);
  char *aligned;

  if (raw == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOMEM, "reserve of %llu bytes of address space: %s",
                      (unsigned long long)size, strerror(errno));
  aligned = (char *)(((uintptr_t)raw + page - 1) & ~(uintptr_t)(page - 1));
  if (aligned > raw)
    munmap(raw, (size_t)(aligned - raw));
  if (raw + size + page > aligned + size)
    munmap(aligned + size, (size_t)(raw + size + page - (aligned + size)));
  *addr = aligned;
  return 0;
}

static int memfd_unreserve(struct sl_device *dev, void *addr, uint64_t size) {
  return munmap(addr, size) == 0 ? 0 : SUBLET_EINVAL;
}

static int memfd_map(struct sl_device *dev, void *addr, uint64_t size, sl_handle h,
                     struct sl_err *err) {
  int fd = owned_handle_fd(to_memfd(dev), h);
  struct stat st;

  if (fd < 0 || fstat(fd, &st) != 0)
    return sl_err_set(err, SUBLET_EINVAL, "map: %llu is not a handle of this device",
                      (unsigned long long)h);
  if ((uint64_t)st.st_size != size)
    return sl_err_set(err, SUBLET_EINVAL, "map: handle %llu has %llu bytes, not %llu",
                      (unsigned long long)h, (unsigned long long)st.st_size,
                      (unsigned long long)size);
  if (mmap(addr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED)
    return sl_err_set(err, SUBLET_EDEVICE, "map: mmap of handle %llu: %s",
                      (unsigned long long)h, strerror(errno));
  return 0;
}

/* Mappings are read-write from the start, so access is only checked the way a GPU's driver
 * checks it: every page of the range must be mapped (cuMemSetAccess refuses a range with a
 * hole, and code that would pass one here fails on a GPU). A page of the reservation is
 * PROT_NONE: reading a byte of it through process_vm_readv fails with EFAULT, not a fault. */
static int memfd_set_access(struct sl_device *dev, void *addr, uint64_t size,
                            struct sl_err *err) {
  uint64_t page = dev->info.page_size;
  char byte;

  for (uint64_t off = 0; off < size; off += page) {
    struct iovec local = {&byte, 1}, remote = {(char *)addr + off, 1};
    if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != 1 && errno == EFAULT)
      return sl_err_set(err, SUBLET_EDEVICE, "set_access: page at offset %llu of the range is "
                        "not mapped (a GPU's driver refuses such a range)",
                        (unsigned long long)off);
  }
  return 0;
}

/* Puts the reservation back rather than munmap: the range must stay ours for the next map. */
static int memfd_unmap(struct sl_device *dev, void *addr, uint64_t size) {
  return map_none(addr, size, MAP_FIXED) == MAP_FAILED ? SUBLET_EINVAL : 0;
}

static int memfd_synchronize(struct sl_device *dev, struct sl_err *err) {
  return 0; /* copies are synchronous memcpy */
}

/* --- host memory and copies */

static int memfd_host_alloc(struct sl_device *dev, uint64_t size, void **p, struct sl_err *err) {
  void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "host_alloc of %llu bytes: %s",
                      (unsigned long long)size, strerror(errno));
  *p = mem;
  return 0;
}

static void memfd_host_free(struct sl_device *dev, void *p, uint64_t size) {
  munmap(p, size);
}

static double now_seconds(void) {
  struct timespec ts;

  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Waits until done bytes would have crossed a link of bps bytes per second since t0. */
static void pace(uint64_t bps, double t0, uint64_t done) {
  double late;

  while ((late = t0 + (double)done / (double)bps - now_seconds()) > 0) /* a signal cuts a sleep */
    usleep((useconds_t)(late < 0.5 ? late * 1e6 : 5e5));
}

/* Nothing to pin on the host, but pinning takes time on a GPU (the kernel faults in and
 * locks every page): with $SUBLET_MEMFD_PIN it takes as long here, and the pages are made
 * then, as pinning makes them (a first copy into pages not made yet is slow: tests of pinning
 * ahead see the difference). Without it nothing is made ahead: tests' areas cost no memory. */
static int memfd_host_pin(struct sl_device *dev, void *p, uint64_t size, struct sl_err *err) {
  double t0 = now_seconds();

  if (to_memfd(dev)->pin_bps > 0) {
    sl_prefault(p, size);
    pace(to_memfd(dev)->pin_bps, t0, size);
  }
  return 0;
}

/* A writable mapping (a save area's) is pinned, as on a GPU. */
static int memfd_host_map(struct sl_device *dev, int fd, uint64_t offset, uint64_t size,
                          int writable, void **p, struct sl_err *err) {
  void *mem = mmap(NULL, size, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd,
                   (off_t)offset);
  if (mem == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOMEM, "host_map of %llu bytes: %s",
                      (unsigned long long)size, strerror(errno));
  if (writable)
    memfd_host_pin(dev, mem, size, err);
  *p = mem;
  return 0;
}

static void memfd_host_unpin(struct sl_device *dev, void *p, uint64_t size) {
}

static int memfd_copy(struct sl_device *dev, enum sl_copy_dir dir, void *dev_base,
                      void *host_base, const struct sl_copy *copies, size_t n,
                      struct sl_err *err) {
  const uint64_t step = 1ull << 20, bps = to_memfd(dev)->link_bps;
  char *dev_mem = dev_base, *host_mem = host_base;
  double t0 = now_seconds();
  uint64_t done = 0;

  for (size_t i = 0; i < n; i++) {
    for (uint64_t off = 0; off < copies[i].len; off += step) {
      uint64_t len = copies[i].len - off < step ? copies[i].len - off : step;
      char *on_dev = dev_mem + copies[i].dev_off + off;
      char *on_host = host_mem + copies[i].host_off + off;
      memcpy(dir == SL_COPY_TO_HOST ? on_host : on_dev,
             dir == SL_COPY_TO_HOST ? on_dev : on_host, len);
      done += len;
      if (bps != 0)
        pace(bps, t0, done);
    }
  }
  return 0;
}

static int memfd_move(struct sl_device *dev, void *base, const struct sl_move *moves, size_t n,
                      struct sl_err *err) {
  char *mem = base;

  (void)dev;
  (void)err;
  for (size_t i = 0; i < n; i++)
    memcpy(mem + moves[i].dst_off, mem + moves[i].src_off, moves[i].len);
  return 0;
}

/* The hash.h sum of one range, word by word (the device is host memory). */
static uint64_t hash_range(const unsigned char *base, uint64_t begin, uint64_t end) {
  uint64_t sum = 0, w;

  for (uint64_t q = begin / 8; q * 8 < end; q++) {
    memcpy(&w, base + q * 8, sizeof(w)); /* little-endian, as on the GPU */
    sum += sl_hash_word(w, q, begin, end);
  }
  return sum;
}

static int memfd_hash(struct sl_device *dev, const void *base, const struct sublet_range *ranges,
                      size_t n, uint64_t *out, struct sl_err *err) {
  for (size_t i = 0; i < n; i++)
    out[i] = hash_range(base, ranges[i].offset, ranges[i].offset + ranges[i].length);
  return 0;
}

const struct sl_device_ops sl_device_memfd_ops = {
    .name = "memfd",
    .open = memfd_open,
    .close = memfd_close,
    .free_bytes = memfd_free_bytes,
    .create = memfd_create_handle,
    .release = memfd_release,
    .export_fd = memfd_export,
    .import_fd = memfd_import,
    .reserve = memfd_reserve,
    .unreserve = memfd_unreserve,
    .map = memfd_map,
    .set_access = memfd_set_access,
    .unmap = memfd_unmap,
    .unmap_idle = memfd_unmap,
    .synchronize = memfd_synchronize,
    .host_alloc = memfd_host_alloc,
    .host_map = memfd_host_map,
    .host_free = memfd_host_free,
    .host_pin = memfd_host_pin,
    .host_unpin = memfd_host_unpin,
    .copy = memfd_copy,
    .move = memfd_move,
    .hash = memfd_hash,
};
