/* test_device.c - the device interface, on both backends.
 *
 * The memfd backend runs everywhere. The cuda backend runs the same checks where a GPU is
 * visible (and prints host<->device bandwidth), and is skipped otherwise. Data is written and
 * read through sl_device_copy so that the same checks hold for GPU memory. Sharing across
 * processes re-executes this binary as a child (`--child ...`) that inherits the exported fd:
 * a forked child must not use CUDA its parent initialised, but an exec'd one may.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "hash.h"
#include "seal.h"

static struct sl_err err; /* the last error: check_note, under each failure */

#define MiB (1ull << 20)

/* --- helpers: pages mapped into a reservation, data through copies */

struct mapped {
  void *addr;
  uint64_t size;
  uint64_t page;
  size_t npages;
  sl_handle *handles;
};

static int map_pages(struct sl_device *d, size_t npages, struct mapped *m) {
  size_t i;
  int rc;

  memset(m, 0, sizeof(*m));
  m->page = sl_device_info(d)->page_size;
  m->npages = npages;
  m->size = npages * m->page;
  m->handles = calloc(npages, sizeof(*m->handles));
  if (m->handles == NULL)
    return SUBLET_ENOMEM;
  rc = sl_device_reserve(d, m->size, &m->addr, &err);
  for (i = 0; rc == 0 && i < npages; i++) {
    rc = sl_device_create(d, m->page, &m->handles[i], &err);
    if (rc == 0)
      rc = sl_device_map(d, (char *)m->addr + i * m->page, m->page, m->handles[i], &err);
  }
  if (rc == 0)
    rc = sl_device_set_access(d, m->addr, m->size, &err);
  return rc;
}

static void unmap_pages(struct sl_device *d, struct mapped *m) {
  size_t i;
  for (i = 0; i < m->npages; i++) {
    sl_device_unmap(d, (char *)m->addr + i * m->page, m->page);
    sl_device_release(d, m->handles[i]);
  }
  sl_device_unreserve(d, m->addr, m->size);
  free(m->handles);
}

/* The byte at offset i of pattern seed: differs from its neighbours and between seeds. */
static uint8_t pattern_byte(uint64_t i, uint32_t seed) {
  return (uint8_t)(((i * 2654435761u) >> 13) ^ (i >> 8) ^ seed);
}

static void fill_pattern(uint8_t *p, uint64_t size, uint32_t seed) {
  uint64_t i;
  for (i = 0; i < size; i++)
    p[i] = pattern_byte(i, seed);
}

static int check_pattern(const uint8_t *p, uint64_t size, uint32_t seed) {
  uint64_t i;
  for (i = 0; i < size; i++)
    if (p[i] != pattern_byte(i, seed))
      return 0;
  return 1;
}

static int write_device(struct sl_device *d, void *addr, uint64_t size, uint32_t seed) {
  struct sl_copy whole = {0, 0, size};
  void *host;
  int rc = sl_device_host_alloc(d, size, &host, &err);

  if (rc != 0)
    return rc;
  fill_pattern(host, size, seed);
  rc = sl_device_copy(d, SL_COPY_TO_DEVICE, addr, host, &whole, 1, &err);
  sl_device_host_free(d, host, size);
  return rc;
}

/* 1 if the device bytes at addr hold the pattern of seed. */
static int device_holds(struct sl_device *d, void *addr, uint64_t size, uint32_t seed) {
  struct sl_copy whole = {0, 0, size};
  void *host;
  int ok;

  if (sl_device_host_alloc(d, size, &host, &err) != 0)
    return 0;
  ok = sl_device_copy(d, SL_COPY_TO_HOST, addr, host, &whole, 1, &err) == 0 &&
       check_pattern(host, size, seed);
  sl_device_host_free(d, host, size);
  return ok;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* --- checks that hold on every backend */

static void test_create_release(struct sl_device *d) {
  uint64_t page = sl_device_info(d)->page_size, before = 0, during = 0, after = 0;
  sl_handle h = 0;

  CHECK(sl_device_free_bytes(d, &before, &err) == 0);
  CHECK(sl_device_create(d, 32 * page, &h, &err) == 0 && h != 0);
  CHECK(sl_device_free_bytes(d, &during, &err) == 0);
  CHECK(before - during >= 16 * page); /* cuda: other processes may move it a little */
  CHECK(sl_device_release(d, h) == 0);
  CHECK(sl_device_free_bytes(d, &after, &err) == 0);
  CHECK(after > during);
  CHECK(sl_device_create(d, page + 1, &h, &err) == SUBLET_EINVAL);
  CHECK(sl_device_create(d, 0, &h, &err) == SUBLET_EINVAL);
}

static void test_out_of_memory(struct sl_device *d) {
  const struct sl_device_info *info = sl_device_info(d);
  uint64_t too_much = (info->total_bytes / info->page_size + 1) * info->page_size;
  sl_handle h = 0;

  sl_err_clear(&err);
  CHECK(sl_device_create(d, too_much, &h, &err) == SUBLET_ENOMEM);
  CHECK(err.code == SUBLET_ENOMEM && err.msg[0] != '\0');
  CHECK(h == 0);
}

static void test_two_mappings_alias(struct sl_device *d) {
  uint64_t page = sl_device_info(d)->page_size;
  void *addr = NULL;
  sl_handle h = 0;
  char *second;

  CHECK(sl_device_reserve(d, 2 * page, &addr, &err) == 0);
  CHECK(((uintptr_t)addr & (page - 1)) == 0);
  second = (char *)addr + page;
  CHECK(sl_device_create(d, page, &h, &err) == 0);
  CHECK(sl_device_map(d, addr, page, h, &err) == 0);
  CHECK(sl_device_map(d, second, page, h, &err) == 0);
  CHECK(sl_device_set_access(d, addr, 2 * page, &err) == 0);
  CHECK(write_device(d, addr, page, 7) == 0);
  CHECK(device_holds(d, second, page, 7));
  CHECK(sl_device_unmap(d, addr, page) == 0);
  CHECK(sl_device_unmap(d, second, page) == 0);
  CHECK(sl_device_release(d, h) == 0);
  CHECK(sl_device_unreserve(d, addr, 2 * page) == 0);
}

/* After unmap the range is still reserved: the same address can be mapped again, and the data
 * lives on in the handle. */
static void test_unmap_keeps_reservation(struct sl_device *d) {
  uint64_t page = sl_device_info(d)->page_size;
  struct mapped m;

  CHECK(map_pages(d, 1, &m) == 0);
  CHECK(write_device(d, m.addr, page, 11) == 0);
  CHECK(sl_device_unmap(d, m.addr, page) == 0);
  CHECK(sl_device_map(d, m.addr, page, m.handles[0], &err) == 0);
  CHECK(sl_device_set_access(d, m.addr, page, &err) == 0);
  CHECK(device_holds(d, m.addr, page, 11));
  unmap_pages(d, &m);
}

/* n pieces of up to 1000 bytes, scattered over the region and written to the host in the
 * reverse order, so that a swapped or misplaced offset shows. */
static struct sl_copy *scattered_pieces(uint64_t region, size_t n) {
  struct sl_copy *c = calloc(n, sizeof(*c));
  uint64_t stride = region / n;
  size_t i;

  for (i = 0; c != NULL && i < n; i++) {
    c[i].dev_off = i * stride + i % 7;
    c[i].host_off = (n - 1 - i) * stride;
    c[i].len = 1 + (i * 37) % (stride < 1000 ? stride - 8 : 1000);
  }
  return c;
}

static int pieces_match(const uint8_t *dev_image, const uint8_t *host, const struct sl_copy *c,
                        size_t n) {
  size_t i;
  for (i = 0; i < n; i++)
    if (memcmp(dev_image + c[i].dev_off, host + c[i].host_off, c[i].len) != 0)
      return 0;
  return 1;
}

static void test_batched_copies(struct sl_device *d) {
  const size_t n = 10000; /* more than one batch of the cuda backend */
  struct sl_copy *c;
  uint8_t *host = NULL, *image = NULL;
  struct mapped m;

  CHECK(map_pages(d, 4, &m) == 0);
  c = scattered_pieces(m.size, n);
  CHECK(sl_device_host_alloc(d, m.size, (void **)&host, &err) == 0);
  CHECK(sl_device_host_alloc(d, m.size, (void **)&image, &err) == 0);
  /* to the host: the device holds pattern 3 */
  CHECK(write_device(d, m.addr, m.size, 3) == 0);
  fill_pattern(image, m.size, 3);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, host, c, n, &err) == 0);
  CHECK(pieces_match(image, host, c, n));
  /* to the device: pieces of pattern 5 land in a device of pattern 3 */
  fill_pattern(host, m.size, 5);
  CHECK(sl_device_copy(d, SL_COPY_TO_DEVICE, m.addr, host, c, n, &err) == 0);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, image, &(struct sl_copy){0, 0, m.size}, 1,
                       &err) == 0);
  CHECK(pieces_match(image, host, c, n));
  CHECK(image[c[0].len] == pattern_byte(c[0].len, 3)); /* between pieces: untouched */
  sl_device_host_free(d, host, m.size);
  sl_device_host_free(d, image, m.size);
  free(c);
  unmap_pages(d, &m);
}

/* Saves and restores as the daemon makes them: scattered on the device, packed one after the
 * other in host memory (cuda gathers these through two staging buffers in turn, 32 MiB each:
 * on cuda the pieces fill about three of them, so each buffer is waited for and used again),
 * odd sizes and offsets included. */
static void test_packed_copies(struct sl_device *d) {
  const size_t n = 5000;
  struct sl_copy *c = calloc(n, sizeof(*c));
  uint8_t *host = NULL, *image = NULL;
  uint64_t host_off = 0, stride;
  int cuda = strcmp(sl_device_info(d)->backend, "cuda") == 0;
  struct mapped m;

  CHECK(map_pages(d, cuda ? 96 : 4, &m) == 0);
  stride = m.size / n;
  for (size_t i = 0; c != NULL && i < n; i++) {
    size_t j = (i * 7919) % n; /* device order shuffled */
    c[i] = (struct sl_copy){j * stride + (i % 3 ? 0 : i % 16), host_off,
                            i % 5 ? stride / 2 : 1 + i % 13};
    host_off += c[i].len;
  }
  CHECK(sl_device_host_alloc(d, m.size, (void **)&host, &err) == 0);
  CHECK(sl_device_host_alloc(d, m.size, (void **)&image, &err) == 0);
  CHECK(write_device(d, m.addr, m.size, 4) == 0);
  fill_pattern(image, m.size, 4);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, host, c, n, &err) == 0);
  CHECK(pieces_match(image, host, c, n));
  fill_pattern(host, m.size, 6);
  CHECK(sl_device_copy(d, SL_COPY_TO_DEVICE, m.addr, host, c, n, &err) == 0);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, image, &(struct sl_copy){0, 0, m.size}, 1,
                       &err) == 0);
  CHECK(pieces_match(image, host, c, n));
  sl_device_host_free(d, host, m.size);
  sl_device_host_free(d, image, m.size);
  free(c);
  unmap_pages(d, &m);
}

/* Copies into pages just made, as a resume makes them: scattered, odd lengths, both ends of
 * each piece agreeing modulo 16 (cuda reads the host memory with SMs then), and in a second
 * call not agreeing (the copy engines take it); the bytes between the pieces stay. */
static void test_copies_into_new_pages(struct sl_device *d) {
  const size_t n = 3000;
  struct sl_copy *c = calloc(n, sizeof(*c));
  uint8_t *host = NULL, *image = NULL;
  uint64_t stride;
  struct mapped m;

  CHECK(c != NULL && map_pages(d, 4, &m) == 0);
  stride = m.size / n;
  CHECK(sl_device_host_alloc(d, m.size, (void **)&host, &err) == 0);
  CHECK(sl_device_host_alloc(d, m.size, (void **)&image, &err) == 0);
  for (int agree = 1; c != NULL && host != NULL && image != NULL && agree >= 0; agree--) {
    for (size_t i = 0; i < n; i++) {
      uint64_t skew = i % 16, len = i % 7 ? stride / 2 + i % 5 : 1 + i % 13;
      c[i] = (struct sl_copy){(i * 7919) % n * stride + skew,
                              i * stride + (agree ? skew : (skew + 1) % 16), len};
    }
    CHECK(write_device(d, m.addr, m.size, 3) == 0);
    fill_pattern(host, m.size, 5 + agree);
    CHECK(sl_device_copy(d, SL_COPY_TO_NEW_PAGES, m.addr, host, c, n, &err) == 0);
    CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, image, &(struct sl_copy){0, 0, m.size}, 1,
                         &err) == 0);
    CHECK(pieces_match(image, host, c, n));
    CHECK(image[c[0].dev_off + c[0].len] == pattern_byte(c[0].dev_off + c[0].len, 3));
  }
  sl_device_host_free(d, host, m.size);
  sl_device_host_free(d, image, m.size);
  free(c);
  unmap_pages(d, &m);
}

/* Moves inside device memory, as compaction makes them: many pieces, odd lengths and
 * alignments, from the first half into the second; the rest stays as it was. */
static void test_batched_moves(struct sl_device *d) {
  const size_t n = 10000;
  struct sl_move *mv = NULL;
  uint8_t *image = NULL, *want = NULL;
  struct mapped m;
  uint64_t half, stride;

  CHECK(map_pages(d, 4, &m) == 0);
  half = m.size / 2;
  stride = half / n;
  mv = calloc(n, sizeof(*mv));
  CHECK(sl_device_host_alloc(d, m.size, (void **)&image, &err) == 0);
  want = malloc(m.size);
  for (size_t i = 0; mv != NULL && i < n; i++) /* sources ascend, destinations descend */
    mv[i] = (struct sl_move){i * stride + i % 5, half + (n - 1 - i) * stride + i % 3,
                             1 + (i * 37) % (stride - 8)};
  CHECK(write_device(d, m.addr, m.size, 9) == 0);
  fill_pattern(want, m.size, 9);
  for (size_t i = 0; mv != NULL && i < n; i++)
    memcpy(want + mv[i].dst_off, want + mv[i].src_off, mv[i].len);
  CHECK(sl_device_move(d, m.addr, mv, n, &err) == 0);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, image, &(struct sl_copy){0, 0, m.size}, 1,
                       &err) == 0);
  CHECK(image != NULL && want != NULL && memcmp(image, want, m.size) == 0);
  CHECK(sl_device_move(d, m.addr, mv, 0, &err) == 0); /* nothing to do */
  sl_device_host_free(d, image, m.size);
  free(want);
  free(mv);
  unmap_pages(d, &m);
}

static void test_bad_arguments(struct sl_device *d) {
  uint64_t page = sl_device_info(d)->page_size;
  sl_handle h = 0;
  int fd = -1, pipe_fds[2];

  CHECK(sl_device_import(d, -1, &h, &err) == SUBLET_EINVAL);
  CHECK(sl_device_export(d, 0, &fd, &err) == SUBLET_EINVAL && fd == -1);
  CHECK(sl_device_map(d, NULL, page, 1, &err) == SUBLET_EINVAL);
  CHECK(pipe(pipe_fds) == 0);
  CHECK(sl_device_import(d, pipe_fds[0], &h, &err) < 0 && h == 0);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

/* --- sharing a handle with another process */

static const char *self_path = "/proc/self/exe";

/* The child: imports the inherited fd, maps it, writes pattern seed through its mapping. */
static int run_child(char **argv) {
  struct sl_device_params p = {.backend = argv[2]};
  int fd = atoi(argv[3]);
  uint64_t size = strtoull(argv[4], NULL, 10);
  uint32_t seed = (uint32_t)atoi(argv[5]);
  struct sl_device *d = NULL;
  sl_handle h = 0;
  void *addr = NULL;
  int rc;

  p.page_size = strtoull(argv[6], NULL, 10);
  p.total_bytes = p.page_size;
  rc = sl_device_open(&p, &d, &err);
  if (rc == 0)
    rc = sl_device_import(d, fd, &h, &err);
  close(fd); /* imported: the handle keeps the memory alive */
  if (rc == 0)
    rc = sl_device_reserve(d, size, &addr, &err);
  if (rc == 0)
    rc = sl_device_map(d, addr, size, h, &err);
  if (rc == 0)
    rc = sl_device_set_access(d, addr, size, &err);
  if (rc == 0)
    rc = write_device(d, addr, size, seed);
  if (rc != 0)
    fprintf(stderr, "child: %s\n", err.msg);
  sl_device_close(d);
  return rc == 0 ? 0 : 1;
}

static pid_t spawn_child(const char *backend, int fd, uint64_t size, uint32_t seed,
                         uint64_t page) {
  char fd_s[16], size_s[24], seed_s[16], page_s[24];
  pid_t pid;

  snprintf(fd_s, sizeof(fd_s), "%d", fd);
  snprintf(size_s, sizeof(size_s), "%llu", (unsigned long long)size);
  snprintf(seed_s, sizeof(seed_s), "%u", seed);
  snprintf(page_s, sizeof(page_s), "%llu", (unsigned long long)page);
  pid = fork();
  if (pid == 0) {
    fcntl(fd, F_SETFD, 0); /* the exported fd is close-on-exec: this one child inherits it */
    execl(self_path, self_path, "--child", backend, fd_s, size_s, seed_s, page_s, (char *)NULL);
    _exit(127);
  }
  return pid;
}

static void test_share_with_child(struct sl_device *d) {
  const struct sl_device_info *info = sl_device_info(d);
  int fd = -1, status = -1;
  struct mapped m;
  pid_t pid;

  CHECK(map_pages(d, 1, &m) == 0);
  CHECK(write_device(d, m.addr, m.size, 1) == 0);
  CHECK(sl_device_export(d, m.handles[0], &fd, &err) == 0 && fd >= 0);
  CHECK((fcntl(fd, F_GETFD) & FD_CLOEXEC) != 0);
  pid = spawn_child(info->backend, fd, m.size, 99, info->page_size);
  close(fd); /* exported fds are the caller's to close once sent */
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(device_holds(d, m.addr, m.size, 99));
  unmap_pages(d, &m);
}

/* Imported handles share the memory and are not counted as memory this device created. */
static void test_import_in_process(struct sl_device *d) {
  uint64_t page = sl_device_info(d)->page_size, before = 0, after = 0;
  sl_handle h = 0, imported = 0;
  void *addr = NULL;
  int fd = -1;

  CHECK(sl_device_create(d, page, &h, &err) == 0);
  CHECK(sl_device_export(d, h, &fd, &err) == 0);
  CHECK(sl_device_free_bytes(d, &before, &err) == 0);
  CHECK(sl_device_import(d, fd, &imported, &err) == 0 && imported != 0);
  close(fd);
  CHECK(sl_device_free_bytes(d, &after, &err) == 0);
  CHECK(!strcmp(sl_device_info(d)->backend, "cuda") || after == before);
  CHECK(sl_device_release(d, h) == 0); /* the imported handle keeps the memory alive */
  CHECK(sl_device_reserve(d, page, &addr, &err) == 0);
  CHECK(sl_device_map(d, addr, page, imported, &err) == 0);
  CHECK(sl_device_set_access(d, addr, page, &err) == 0);
  CHECK(write_device(d, addr, page, 21) == 0 && device_holds(d, addr, page, 21));
  CHECK(sl_device_unmap(d, addr, page) == 0);
  CHECK(sl_device_unreserve(d, addr, page) == 0);
  CHECK(sl_device_release(d, imported) == 0);
}

/* --- verify's checksums */

/* The definition of hash.h, written out plainly: the sum of the range's mixed words. */
static uint64_t reference_hash(const uint8_t *p, uint64_t begin, uint64_t end) {
  uint64_t sum = 0;

  for (uint64_t q = begin / 8; q * 8 < end; q++) {
    uint64_t w = 0;
    for (int b = 0; b < 8; b++)
      if (q * 8 + b >= begin && q * 8 + b < end)
        w |= (uint64_t)p[q * 8 + b] << (8 * b);
    sum += sl_hash_mix(w, sl_hash_key(q));
  }
  return end > begin ? sum : 0;
}

static uint64_t lcg(uint64_t *state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return *state >> 17;
}

/* Ranges of every shape: unaligned, tiny, empty, across tiles, and the whole mapping. */
static struct sublet_range *hash_ranges(uint64_t size, size_t n) {
  struct sublet_range *r = calloc(n, sizeof(*r));
  uint64_t s = 7;

  for (size_t i = 0; r != NULL && i < n; i++) {
    uint64_t len = i % 5 == 0 ? lcg(&s) % 17 : lcg(&s) % (3 * SL_HASH_TILE + 41);
    len = len < size ? len : size;
    r[i].offset = lcg(&s) % (size - len + 1);
    r[i].length = len;
  }
  if (r != NULL && n >= 3) {
    r[0] = (struct sublet_range){0, size};
    r[1] = (struct sublet_range){SL_HASH_TILE - 3, 6}; /* a tile boundary inside a word */
    r[2] = (struct sublet_range){size / 2, 0};
  }
  return r;
}

static int hashes_match(struct sl_device *d, void *addr, const uint8_t *image,
                        const struct sublet_range *r, size_t n) {
  uint64_t *got = calloc(n, sizeof(*got));
  int ok = got != NULL && sl_device_hash(d, addr, r, n, got, &err) == 0;

  for (size_t i = 0; ok && i < n; i++) {
    ok = got[i] == reference_hash(image, r[i].offset, r[i].offset + r[i].length);
    if (!ok)
      fprintf(stderr, "range %zu (offset %llu, length %llu): %016llx, expected %016llx\n", i,
              (unsigned long long)r[i].offset, (unsigned long long)r[i].length,
              (unsigned long long)got[i],
              (unsigned long long)reference_hash(image, r[i].offset, r[i].offset + r[i].length));
  }
  free(got);
  return ok;
}

/* The device computes the definition; one flipped bit or two swapped words change it. */
static void test_hash(struct sl_device *d) {
  const size_t n = 3000;
  struct mapped m;
  uint8_t *image = NULL;
  struct sublet_range *r = NULL;
  struct sl_copy one = {0, 0, 16};
  uint64_t whole = 0, now_ = 0;

  CHECK(map_pages(d, 4, &m) == 0);
  CHECK(sl_device_host_alloc(d, m.size, (void **)&image, &err) == 0); /* copies need it */
  CHECK((r = hash_ranges(m.size, n)) != NULL);
  if (image == NULL || r == NULL)
    goto out;
  fill_pattern(image, m.size, 21);
  CHECK(write_device(d, m.addr, m.size, 21) == 0);
  CHECK(hashes_match(d, m.addr, image, r, n));
  CHECK(sl_device_hash(d, m.addr, r, 1, &whole, &err) == 0);
  one.dev_off = one.host_off = m.size / 3 & ~15ull;
  image[one.dev_off + 5] ^= 0x10; /* one bit */
  CHECK(sl_device_copy(d, SL_COPY_TO_DEVICE, m.addr, image, &one, 1, &err) == 0);
  CHECK(hashes_match(d, m.addr, image, r, n));
  CHECK(sl_device_hash(d, m.addr, r, 1, &now_, &err) == 0 && now_ != whole);
  for (int b = 0; b < 8; b++) { /* two words swap places */
    uint8_t t = image[one.dev_off + b];
    image[one.dev_off + b] = image[one.dev_off + 8 + b];
    image[one.dev_off + 8 + b] = t;
  }
  CHECK(sl_device_copy(d, SL_COPY_TO_DEVICE, m.addr, image, &one, 1, &err) == 0);
  CHECK(hashes_match(d, m.addr, image, r, n));
out:
  sl_device_host_free(d, image, m.size);
  free(r);
  unmap_pages(d, &m);
}

/* What the kernel relies on: the sum splits at any 8-aligned point; a flipped bit or swapped
 * words always show; bytes beside the range do not count. */
static void test_hash_definition(void) {
  uint8_t p[256];
  uint64_t whole, other;

  fill_pattern(p, sizeof(p), 5);
  whole = reference_hash(p, 3, 250);
  CHECK(whole == reference_hash(p, 3, 128) + reference_hash(p, 128, 250));
  p[2] ^= 1;
  p[251] ^= 1;
  CHECK(reference_hash(p, 3, 250) == whole);
  for (int bit = 0; bit < 8; bit++) {
    p[100] ^= (uint8_t)(1 << bit);
    other = reference_hash(p, 3, 250);
    p[100] ^= (uint8_t)(1 << bit);
    CHECK(other != whole);
  }
  for (int b = 0; b < 8; b++) {
    uint8_t t = p[64 + b];
    p[64 + b] = p[72 + b];
    p[72 + b] = t;
  }
  CHECK(reference_hash(p, 3, 250) != whole);
}

/* Host memory pinned in a writable mapping made before its memfd was sealed read-only (how
 * the daemon's save area grows, daemon/pool.c): copies reach it, a read-only fd sees them. */
static void test_host_pin_sealed(struct sl_device *d) {
  const uint64_t size = 4 * MiB;
  struct sl_copy whole = {0, 0, size};
  struct mapped m;
  int fd = sl_seal_memfd("test-pinned");
  char *window = MAP_FAILED, *seen = MAP_FAILED;

  CHECK(fd >= 0);
  if (fd < 0)
    return;
  CHECK(map_pages(d, size / sl_device_info(d)->page_size, &m) == 0);
  window = mmap(NULL, 2 * size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  CHECK(window != MAP_FAILED && sl_seal_read_only(fd) == 0);
  CHECK(mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED);
  CHECK(sl_seal_grow_to(fd, 2 * size) == 0 && sl_seal_grow_to(fd, size) == 0);
  if (window == MAP_FAILED)
    goto cleanup;
  CHECK(write_device(d, m.addr, size, 21) == 0);
  CHECK(sl_device_host_pin(d, window + size, size, &err) == 0);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m.addr, window + size, &whole, 1, &err) == 0);
  seen = mmap(NULL, 2 * size, PROT_READ, MAP_SHARED, fd, 0);
  CHECK(seen != MAP_FAILED && check_pattern((uint8_t *)seen + size, size, 21));
  sl_device_host_unpin(d, window + size, size);
cleanup:
  if (seen != MAP_FAILED)
    munmap(seen, 2 * size);
  if (window != MAP_FAILED)
    munmap(window, 2 * size);
  unmap_pages(d, &m);
  close(fd);
}

static void run_common_checks(struct sl_device *d) {
  test_create_release(d);
  test_out_of_memory(d);
  test_two_mappings_alias(d);
  test_unmap_keeps_reservation(d);
  test_batched_copies(d);
  test_packed_copies(d);
  test_copies_into_new_pages(d);
  test_batched_moves(d);
  test_bad_arguments(d);
  test_import_in_process(d);
  test_share_with_child(d);
  test_hash(d);
  test_host_pin_sealed(d);
}

/* --- memfd only */

static struct sl_device *open_memfd(uint64_t page, uint64_t total) {
  struct sl_device_params p = {.backend = "memfd", .ordinal = 3, .page_size = page,
                               .total_bytes = total};
  struct sl_device *d = NULL;

  CHECK(sl_device_open(&p, &d, &err) == 0);
  return d;
}

static void test_memfd_info(struct sl_device *d) {
  const struct sl_device_info *info = sl_device_info(d);
  CHECK(strcmp(info->backend, "memfd") == 0);
  CHECK(strcmp(info->name, "memfd (host memory)") == 0);
  CHECK(memcmp(info->uuid, "sublet-memfd", 12) == 0 && info->uuid[15] == 3);
  CHECK(info->ordinal == 3 && info->page_size == 2 * MiB && info->total_bytes == 64 * MiB);
}

static void test_memfd_accounting(struct sl_device *d) {
  sl_handle a = 0, b = 0, c = 0;
  uint64_t free_bytes = 0;

  CHECK(sl_device_create(d, 32 * MiB, &a, &err) == 0);
  CHECK(sl_device_create(d, 30 * MiB, &b, &err) == 0);
  CHECK(sl_device_free_bytes(d, &free_bytes, &err) == 0 && free_bytes == 2 * MiB);
  CHECK(sl_device_create(d, 4 * MiB, &c, &err) == SUBLET_ENOMEM);
  CHECK(strstr(err.msg, "asked 4.00 MiB, 2.00 MiB free of 64.0 MiB") != NULL);
  CHECK(sl_device_release(d, a) == 0);
  CHECK(sl_device_release(d, a) == SUBLET_EINVAL); /* released twice */
  CHECK(sl_device_create(d, 4 * MiB, &c, &err) == 0);
  CHECK(sl_device_release(d, b) == 0 && sl_device_release(d, c) == 0);
  CHECK(sl_device_free_bytes(d, &free_bytes, &err) == 0 && free_bytes == 64 * MiB);
  CHECK(sl_device_release(d, (sl_handle)STDERR_FILENO + 1) == SUBLET_EINVAL); /* not ours */
}

/* A mapping is the caller's memory: the CPU sees through it directly, and an unmapped range
 * stays reserved (nothing else can be mapped over it). */
static void test_memfd_direct_access(struct sl_device *d) {
  struct mapped m;
  void *probe;

  CHECK(map_pages(d, 1, &m) == 0);
  memset(m.addr, 0x5a, m.size);
  CHECK(write_device(d, m.addr, 16, 8) == 0 && ((uint8_t *)m.addr)[16] == 0x5a);
  CHECK(sl_device_unmap(d, m.addr, m.size) == 0);
  probe = mmap(m.addr, m.size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  CHECK(probe == MAP_FAILED && errno == EEXIST);
  CHECK(sl_device_map(d, m.addr, m.size, m.handles[0], &err) == 0);
  CHECK(((uint8_t *)m.addr)[16] == 0x5a);
  unmap_pages(d, &m);
}

/* A page's fd as a client gets it (export): neither truncated nor grown under the daemon's
 * mapping, where a shrink gave it SIGBUS (issue 25, item 9). */
static void test_memfd_page_fixed_size(struct sl_device *d) {
  sl_handle h = 0;
  struct stat st;
  int fd = -1;

  CHECK(sl_device_create(d, 2 * MiB, &h, &err) == 0);
  CHECK(sl_device_export(d, h, &fd, &err) == 0);
  errno = 0;
  CHECK(ftruncate(fd, 0) == -1 && errno == EPERM);
  CHECK(ftruncate(fd, 4 * MiB) == -1 && errno == EPERM);
  CHECK(fstat(fd, &st) == 0 && st.st_size == (off_t)(2 * MiB));
  if (fd >= 0)
    close(fd);
  CHECK(sl_device_release(d, h) == 0);
}

static void test_memfd_bad_import(struct sl_device *d) {
  int fd = memfd_create("odd-size", MFD_CLOEXEC);
  void *addr = NULL;
  sl_handle h = 0;

  CHECK(fd >= 0 && ftruncate(fd, 2 * MiB + 100) == 0);
  CHECK(sl_device_import(d, fd, &h, &err) == SUBLET_EINVAL && h == 0);
  CHECK(strstr(err.msg, "not a memfd device page") != NULL);
  CHECK(ftruncate(fd, 4 * MiB) == 0);
  CHECK(sl_device_import(d, fd, &h, &err) == 0);
  CHECK(sl_device_reserve(d, 2 * MiB, &addr, &err) == 0);
  CHECK(sl_device_map(d, addr, 2 * MiB, h, &err) == SUBLET_EINVAL); /* the handle has 4 MiB */
  CHECK(sl_device_unreserve(d, addr, 2 * MiB) == 0);
  CHECK(sl_device_release(d, h) == 0);
  close(fd);
}

static int count_open_fds(void) {
  DIR *dir = opendir("/proc/self/fd");
  int n = 0;

  while (dir != NULL && readdir(dir) != NULL)
    n++;
  if (dir != NULL)
    closedir(dir);
  return n;
}

/* Handles the caller forgot are the device's to close. */
static void test_memfd_close_closes_fds(void) {
  int before = count_open_fds();
  struct sl_device *d = open_memfd(2 * MiB, 64 * MiB);
  sl_handle h = 0;

  CHECK(sl_device_create(d, 2 * MiB, &h, &err) == 0);
  CHECK(count_open_fds() == before + 1);
  sl_device_close(d);
  CHECK(count_open_fds() == before);
}

static uint64_t page_size_from_env(const char *value, int *rc) {
  struct sl_device_params p = {.backend = "memfd"};
  struct sl_device *d = NULL;
  uint64_t page = 0;

  setenv("SUBLET_MEMFD_PAGE_SIZE", value, 1);
  *rc = sl_device_open(&p, &d, &err);
  if (*rc == 0)
    page = sl_device_info(d)->page_size;
  sl_device_close(d);
  unsetenv("SUBLET_MEMFD_PAGE_SIZE");
  return page;
}

static void test_memfd_env(void) {
  struct sl_device_params p = {.backend = "memfd", .page_size = 4 * MiB};
  struct sl_device *d = NULL;
  int rc = 0;

  CHECK(page_size_from_env("64K", &rc) == 65536 && rc == 0);
  CHECK(page_size_from_env("4M", &rc) == 4 * MiB && rc == 0);
  CHECK(page_size_from_env("1MiB", &rc) == MiB && rc == 0);
  CHECK(page_size_from_env("2097152", &rc) == 2 * MiB && rc == 0);
  CHECK(page_size_from_env("1g", &rc) == 1ull << 30 && rc == 0);
  page_size_from_env("3K", &rc);
  CHECK(rc == SUBLET_EINVAL && strstr(err.msg, "power of two") != NULL);
  page_size_from_env("2X", &rc);
  CHECK(rc == SUBLET_EINVAL && strstr(err.msg, "SUBLET_MEMFD_PAGE_SIZE") != NULL);
  page_size_from_env("-2M", &rc);
  CHECK(rc == SUBLET_EINVAL);
  page_size_from_env("99999999999999G", &rc);
  CHECK(rc == SUBLET_EINVAL);
  setenv("SUBLET_MEMFD_TOTAL", "3G", 1);
  setenv("SUBLET_MEMFD_PAGE_SIZE", "1K", 1); /* the params win over the environment */
  CHECK(sl_device_open(&p, &d, &err) == 0);
  CHECK(d != NULL && sl_device_info(d)->total_bytes == 3ull << 30);
  CHECK(d != NULL && sl_device_info(d)->page_size == 4 * MiB);
  sl_device_close(d);
  unsetenv("SUBLET_MEMFD_TOTAL");
  unsetenv("SUBLET_MEMFD_PAGE_SIZE");
}

static void test_unknown_backend(void) {
  struct sl_device_params p = {.backend = "opencl"};
  struct sl_device *d = (struct sl_device *)&p;

  CHECK(sl_device_open(&p, &d, &err) == SUBLET_EINVAL && d == NULL);
  CHECK(strstr(err.msg, "cuda") != NULL && strstr(err.msg, "memfd") != NULL);
}

static void test_memfd(void) {
  struct sl_device *d = open_memfd(2 * MiB, 64 * MiB);

  if (d == NULL)
    return;
  test_memfd_info(d);
  test_memfd_accounting(d);
  test_memfd_direct_access(d);
  test_memfd_bad_import(d);
  test_memfd_page_fixed_size(d);
  run_common_checks(d);
  sl_device_close(d);
  test_memfd_close_closes_fds();
  test_memfd_env();
  test_unknown_backend();
}

/* --- cuda: the same checks and the copy bandwidth, where a GPU is visible */

static double copy_gbps(struct sl_device *d, enum sl_copy_dir dir, void *dev, void *host,
                        const struct sl_copy *c, size_t n, uint64_t bytes) {
  double start = now();
  if (sl_device_copy(d, dir, dev, host, c, n, &err) != 0)
    return 0;
  return bytes / (now() - start) / 1e9;
}

/* 64 KiB pieces over 1 GiB: in order (the caller did not coalesce), and scattered (device
 * offsets shuffled). One 1 GiB piece first: what the link gives. */
static void report_bandwidth(struct sl_device *d, struct mapped *m, void *host) {
  const uint64_t piece = 64 * 1024;
  size_t n = m->size / piece, i;
  struct sl_copy *c = calloc(n, sizeof(*c));
  struct sl_copy whole = {0, 0, m->size};
  const char *layout[] = {"in order", "scattered"};
  int k;

  printf("cuda: 1 GiB as one piece: to host %.1f GB/s, to device %.1f GB/s (by SMs %.1f)\n",
         copy_gbps(d, SL_COPY_TO_HOST, m->addr, host, &whole, 1, m->size),
         copy_gbps(d, SL_COPY_TO_DEVICE, m->addr, host, &whole, 1, m->size),
         copy_gbps(d, SL_COPY_TO_NEW_PAGES, m->addr, host, &whole, 1, m->size));
  for (k = 0; k < 2 && c != NULL; k++) {
    for (i = 0; i < n; i++) {
      size_t j = k == 0 ? i : (i * 7919) % n; /* 7919 is prime: a permutation of 0..n-1 */
      c[i] = (struct sl_copy){j * piece, i * piece, piece};
    }
    copy_gbps(d, SL_COPY_TO_HOST, m->addr, host, c, n, m->size); /* warm up */
    printf("cuda: %zu pieces of 64 KiB, %s: to host %.1f GB/s, to device %.1f GB/s\n", n,
           layout[k], copy_gbps(d, SL_COPY_TO_HOST, m->addr, host, c, n, m->size),
           copy_gbps(d, SL_COPY_TO_DEVICE, m->addr, host, c, n, m->size));
  }
  free(c);
}

/* Device-to-device moves of 64 KiB pieces, scattered, from the first half of 2 GiB to the
 * second: what compaction gets (each byte read once and written once). */
static void report_move_bandwidth(struct sl_device *d) {
  const uint64_t piece = 64 * 1024;
  struct mapped m;
  size_t n, i;
  struct sl_move *mv;
  double start;

  if (map_pages(d, (2ull << 30) / sl_device_info(d)->page_size, &m) != 0)
    return;
  n = m.size / 2 / piece;
  mv = calloc(n, sizeof(*mv));
  for (i = 0; mv != NULL && i < n; i++)
    mv[i] = (struct sl_move){i * piece, m.size / 2 + (i * 7919) % n * piece, piece};
  if (mv != NULL && sl_device_move(d, m.addr, mv, n, &err) == 0) { /* warm up */
    start = now();
    CHECK(sl_device_move(d, m.addr, mv, n, &err) == 0);
    printf("cuda: %zu moves of 64 KiB on the device, scattered: %.0f GB/s moved\n", n,
           (double)(n * piece) / (now() - start) / 1e9);
  }
  free(mv);
  unmap_pages(d, &m);
}

/* Packed copies of odd-sized pieces over 1 GiB: pieces straddle the staging chunks. */
static void test_cuda_staged_chunks(struct sl_device *d, struct mapped *m, uint8_t *host) {
  const uint64_t len = 100003;
  size_t n = m->size / 2 / len, i;
  struct sl_copy *c = calloc(n, sizeof(*c));
  uint8_t *image = malloc(m->size);

  for (i = 0; c != NULL && i < n; i++)
    c[i] = (struct sl_copy){(i * 7919) % n * 2 * len + i % 16, i * len, len};
  CHECK(c != NULL && image != NULL && write_device(d, m->addr, m->size, 7) == 0);
  fill_pattern(image, m->size, 7);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m->addr, host, c, n, &err) == 0);
  CHECK(image != NULL && pieces_match(image, host, c, n));
  fill_pattern(host, m->size, 8);
  CHECK(sl_device_copy(d, SL_COPY_TO_DEVICE, m->addr, host, c, n, &err) == 0);
  CHECK(sl_device_copy(d, SL_COPY_TO_HOST, m->addr, image, &(struct sl_copy){0, 0, m->size},
                       1, &err) == 0);
  CHECK(image != NULL && pieces_match(image, host, c, n));
  free(image);
  free(c);
}

static void test_cuda_bandwidth(struct sl_device *d) {
  const struct sl_device_info *info = sl_device_info(d);
  size_t pages = (1ull << 30) / info->page_size;
  void *host = NULL;
  struct mapped m;
  double start;

  CHECK(map_pages(d, pages, &m) == 0);
  start = now();
  CHECK(sl_device_host_alloc(d, m.size, &host, &err) == 0);
  printf("cuda: host_alloc of 1 GiB (touch + pin): %.3f s\n", now() - start);
  if (host != NULL) {
    test_cuda_staged_chunks(d, &m, host);
    report_bandwidth(d, &m, host);
  }
  sl_device_host_free(d, host, m.size);
  unmap_pages(d, &m);
}

static void test_cuda(void) {
  struct sl_device_params p = {.backend = "cuda"};
  struct sl_device *d = NULL;
  int rc = sl_device_open(&p, &d, &err);

  if (rc == SUBLET_ENOTSUP || (rc == SUBLET_EINVAL && strstr(err.msg, "0 visible") != NULL)) {
    printf("cuda: skipped (no GPU): %s\n", err.msg);
    return;
  }
  CHECK(rc == 0);
  if (rc != 0)
    return;
  printf("cuda: %s, page size %llu, %llu bytes\n", sl_device_info(d)->name,
         (unsigned long long)sl_device_info(d)->page_size,
         (unsigned long long)sl_device_info(d)->total_bytes);
  CHECK(strcmp(sl_device_info(d)->backend, "cuda") == 0);
  run_common_checks(d);
  test_cuda_bandwidth(d);
  report_move_bandwidth(d);
  sl_device_close(d);
}

int main(int argc, char **argv) {
  if (argc == 7 && strcmp(argv[1], "--child") == 0)
    return run_child(argv);
  check_note = err.msg;
  test_hash_definition();
  test_memfd();
  test_cuda();
  return check_report("device");
}
