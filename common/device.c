/* device.c - the public sl_device_* functions: pick a backend by name, check the arguments
 * every backend would otherwise check alike, and dispatch through the backend's ops table.
 *
 * Backends may rely on what is checked here: sizes of create/map/unmap are non-zero whole
 * pages, handles are non-zero, reservations are whole pages (rounded up here, identically for
 * reserve and unreserve, so that the two always agree).
 *
 * Floor 2 (floors.h).
 */
#include "device.h"

#include <stdio.h>
#include <string.h>

static const struct sl_device_ops *const backends[] = {
    &sl_device_cuda_ops,
    &sl_device_memfd_ops,
};

#define N_BACKENDS (sizeof(backends) / sizeof(backends[0]))

static const struct sl_device_ops *find_backend(const char *name) {
  size_t i;
  for (i = 0; i < N_BACKENDS; i++)
    if (name != NULL && strcmp(backends[i]->name, name) == 0)
      return backends[i];
  return NULL;
}

int sl_device_open(const struct sl_device_params *p, struct sl_device **out, struct sl_err *err) {
  const struct sl_device_ops *ops = find_backend(p->backend);
  int rc;

  *out = NULL;
  if (ops == NULL)
    return sl_err_set(err, SUBLET_EINVAL,
                      "unknown device backend \"%s\": the backends are \"cuda\" (a GPU) and "
                      "\"memfd\" (host memory, for machines without one)",
                      p->backend != NULL ? p->backend : "(none)");
  rc = ops->open(p, out, err);
  if (rc == 0)
    (*out)->ops = ops;
  return rc;
}

void sl_device_close(struct sl_device *d) {
  if (d != NULL)
    d->ops->close(d);
}

const struct sl_device_info *sl_device_info(const struct sl_device *d) {
  return &d->info;
}

const char *sl_device_uuid_text(char buf[SL_DEVICE_UUID_TEXT], const uint8_t uuid[16]) {
  const uint8_t *u = uuid;

  snprintf(buf, SL_DEVICE_UUID_TEXT,
           "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
           u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
           u[14], u[15]);
  return buf;
}

int sl_device_free_bytes(struct sl_device *d, uint64_t *free_bytes, struct sl_err *err) {
  return d->ops->free_bytes(d, free_bytes, err);
}

static int is_whole_pages(const struct sl_device *d, uint64_t size) {
  return size != 0 && size % d->info.page_size == 0;
}

static uint64_t round_up_to_page(const struct sl_device *d, uint64_t size) {
  uint64_t page = d->info.page_size;
  return (size + page - 1) / page * page;
}

static int bad_size(const struct sl_device *d, uint64_t size, const char *what,
                    struct sl_err *err) {
  char page[16];
  return sl_err_set(err, SUBLET_EINVAL, "%s of %llu bytes: not a whole number of %s pages",
                    what, (unsigned long long)size, sl_format_size(page, d->info.page_size));
}

int sl_device_create(struct sl_device *d, uint64_t size, sl_handle *out, struct sl_err *err) {
  if (!is_whole_pages(d, size))
    return bad_size(d, size, "create", err);
  return d->ops->create(d, size, out, err);
}

int sl_device_release(struct sl_device *d, sl_handle h) {
  if (h == 0)
    return SUBLET_EINVAL;
  return d->ops->release(d, h);
}

int sl_device_export(struct sl_device *d, sl_handle h, int *fd, struct sl_err *err) {
  *fd = -1;
  if (h == 0)
    return sl_err_set(err, SUBLET_EINVAL, "export: handle 0 is never valid");
  return d->ops->export_fd(d, h, fd, err);
}

int sl_device_import(struct sl_device *d, int fd, sl_handle *out, struct sl_err *err) {
  *out = 0;
  if (fd < 0)
    return sl_err_set(err, SUBLET_EINVAL, "import: fd %d is not a file descriptor", fd);
  return d->ops->import_fd(d, fd, out, err);
}

int sl_device_reserve(struct sl_device *d, uint64_t size, void **addr, struct sl_err *err) {
  *addr = NULL;
  if (size == 0)
    return bad_size(d, size, "reserve", err);
  return d->ops->reserve(d, round_up_to_page(d, size), addr, err);
}

int sl_device_unreserve(struct sl_device *d, void *addr, uint64_t size) {
  if (addr == NULL || size == 0)
    return SUBLET_EINVAL;
  return d->ops->unreserve(d, addr, round_up_to_page(d, size));
}

int sl_device_map(struct sl_device *d, void *addr, uint64_t size, sl_handle h,
                  struct sl_err *err) {
  if (!is_whole_pages(d, size))
    return bad_size(d, size, "map", err);
  if (h == 0 || addr == NULL)
    return sl_err_set(err, SUBLET_EINVAL, "map: null address or handle");
  return d->ops->map(d, addr, size, h, err);
}

int sl_device_set_access(struct sl_device *d, void *addr, uint64_t size, struct sl_err *err) {
  if (size == 0)
    return 0;
  return d->ops->set_access(d, addr, size, err);
}

int sl_device_unmap(struct sl_device *d, void *addr, uint64_t size) {
  if (!is_whole_pages(d, size) || addr == NULL)
    return SUBLET_EINVAL;
  return d->ops->unmap(d, addr, size);
}

int sl_device_unmap_idle(struct sl_device *d, void *addr, uint64_t size) {
  if (!is_whole_pages(d, size) || addr == NULL)
    return SUBLET_EINVAL;
  return d->ops->unmap_idle(d, addr, size);
}

/* Per page, one call over adjacent mappings costs what a call per mapping does: the driver's
 * work is per page (the figure, from sublet_bench_map: docs/benchmarks.md). One call is fewer
 * trips into the driver all the same. */
void sl_device_unmap_pages(struct sl_device *d, void *addr, uint64_t npages) {
  uint64_t ps = d->info.page_size;

  if (npages == 0 || sl_device_unmap_idle(d, addr, npages * ps) == 0)
    return;
  for (uint64_t i = 0; i < npages; i++)
    sl_device_unmap_idle(d, (char *)addr + i * ps, ps);
}

int sl_device_synchronize(struct sl_device *d, struct sl_err *err) {
  return d->ops->synchronize(d, err);
}

int sl_device_host_alloc(struct sl_device *d, uint64_t size, void **p, struct sl_err *err) {
  *p = NULL;
  if (size == 0)
    return sl_err_set(err, SUBLET_EINVAL, "host_alloc: size 0");
  return d->ops->host_alloc(d, size, p, err);
}

int sl_device_host_map(struct sl_device *d, int fd, uint64_t offset, uint64_t size, int writable,
                       void **p, struct sl_err *err) {
  *p = NULL;
  if (size == 0)
    return sl_err_set(err, SUBLET_EINVAL, "host_map: size 0");
  return d->ops->host_map(d, fd, offset, size, writable, p, err);
}

void sl_device_host_free(struct sl_device *d, void *p, uint64_t size) {
  if (p != NULL)
    d->ops->host_free(d, p, size);
}

int sl_device_host_pin(struct sl_device *d, void *p, uint64_t size, struct sl_err *err) {
  if (p == NULL || size == 0)
    return sl_err_set(err, SUBLET_EINVAL, "host_pin: nothing to pin");
  return d->ops->host_pin(d, p, size, err);
}

void sl_device_host_unpin(struct sl_device *d, void *p, uint64_t size) {
  if (p != NULL)
    d->ops->host_unpin(d, p, size);
}

int sl_device_copy(struct sl_device *d, enum sl_copy_dir dir, void *dev_base, void *host_base,
                   const struct sl_copy *copies, size_t n, struct sl_err *err) {
  if (n == 0)
    return 0;
  if (dir != SL_COPY_TO_HOST && dir != SL_COPY_TO_DEVICE && dir != SL_COPY_TO_NEW_PAGES)
    return sl_err_set(err, SUBLET_EINVAL, "copy: direction %d is neither to host nor to device",
                      (int)dir);
  return d->ops->copy(d, dir, dev_base, host_base, copies, n, err);
}

int sl_device_move(struct sl_device *d, void *base, const struct sl_move *moves, size_t n,
                   struct sl_err *err) {
  if (n == 0)
    return 0;
  if (base == NULL || moves == NULL)
    return sl_err_set(err, SUBLET_EINVAL, "move: no device memory or no moves given");
  return d->ops->move(d, base, moves, n, err);
}

int sl_device_hash(struct sl_device *d, const void *base, const struct sublet_range *ranges,
                   size_t n, uint64_t *out, struct sl_err *err) {
  if (n == 0)
    return 0;
  if (base == NULL || ((uintptr_t)base & 15) != 0)
    return sl_err_set(err, SUBLET_EINVAL, "hash: base %p is not a 16-byte aligned mapping",
                      base);
  return d->ops->hash(d, base, ranges, n, out, err);
}
