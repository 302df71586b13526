/* tms_saver.c - the preload library's allocations: region allocations of each tag as segments
 * of a sublet pool (one pool tag per torch_memory_saver tag, on each device's client), paused
 * by releasing the tag's pages and resumed at the same addresses.
 *
 * As torch_memory_saver: a cpu-backup allocation's bytes are copied to this process's host
 * memory at pause (mmap'd, or pinned) and back at resume, the others' are lost; pausing a
 * paused tag or resuming an active one that holds memory is an error, a tag holding nothing
 * pauses and resumes as a no-op; "" or NULL means every tag. Errors return a nonzero code with
 * the message in tms_last_error() (the original exits the process).
 *
 * Locking: saver_lock guards the records and tags; it is taken before tms_daemon.c's lock and
 * libsublet's, never after them.
 */
#include "tms.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

struct tms_alloc {
  uint8_t *ptr;
  uint64_t size;
  int device;
  uint32_t tag;      /* tms_tag index + 1: the pool tag */
  int cpu_backup;
  enum tms_backend backend;
  uint8_t *host;     /* the backup: while paused, or kept (retain) */
};

struct tms_tag {
  char *name;
  unsigned char paused[TMS_MAX_DEVICES];
  uint64_t release[TMS_MAX_DEVICES];
};

static pthread_mutex_t saver_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tms_alloc *allocs;
static size_t nallocs, cap_allocs;
static struct tms_tag *tags;
static size_t ntags;
static uint64_t margin;
static int retain = -1; /* -1: $TMS_RETAIN_CPU_BACKUP, read at first use */
static __thread char last_error[512];

void tms_fail(const char *fmt, ...) {
  va_list ap;

  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
}

const char *tms_last_error(void) {
  return last_error;
}

static int fail_sublet(const char *what, int rc) {
  tms_fail("%s: %s", what, sublet_last_error()[0] ? sublet_last_error() : sublet_strerror(rc));
  return rc < 0 ? -rc : rc;
}

/* torch_memory_saver's reading of a flag: 1, true, TRUE, yes or YES. */
int tms_env_bool(const char *name) {
  static const char *const yes[] = {"1", "true", "TRUE", "yes", "YES"};
  const char *v = getenv(name);

  for (size_t i = 0; v != NULL && i < sizeof yes / sizeof yes[0]; i++)
    if (strcmp(v, yes[i]) == 0)
      return 1;
  return 0;
}

/* ------------------------------------------------------------------ tags and records */

static uint32_t tag_id(const char *name, int create) {
  struct tms_tag *grown;

  for (size_t i = 0; i < ntags; i++)
    if (strcmp(tags[i].name, name) == 0)
      return (uint32_t)i + 1;
  if (!create || (grown = realloc(tags, (ntags + 1) * sizeof *tags)) == NULL)
    return 0;
  tags = grown;
  memset(&tags[ntags], 0, sizeof *tags);
  if ((tags[ntags].name = strdup(name)) == NULL)
    return 0;
  return (uint32_t)++ntags;
}

static int record(const struct tms_alloc *a) {
  if (nallocs == cap_allocs) {
    size_t cap = cap_allocs ? 2 * cap_allocs : 64;
    struct tms_alloc *grown = realloc(allocs, cap * sizeof *allocs);
    if (grown == NULL)
      return -1;
    allocs = grown;
    cap_allocs = cap;
  }
  allocs[nallocs++] = *a;
  return 0;
}

static struct tms_alloc *record_at(const uint8_t *p) {
  for (size_t i = 0; i < nallocs; i++)
    if (p >= allocs[i].ptr && p < allocs[i].ptr + allocs[i].size)
      return &allocs[i];
  return NULL;
}

static void host_free(struct tms_alloc *a) {
  if (a->host == NULL)
    return;
  if (a->backend == TMS_BACKEND_PINNED)
    tms_cuda_host_free(a->host);
  else
    munmap(a->host, a->size);
  a->host = NULL;
}

/* Pinned where the runtime can, else mmap'd (the original's two backends). */
static int host_get(struct tms_alloc *a) {
  void *p;

  if (a->host != NULL)
    return 0;
  if (a->backend == TMS_BACKEND_PINNED && !tms_daemon_on_host(a->device) &&
      (a->host = tms_cuda_host_alloc(a->size)) != NULL)
    return 0;
  a->backend = TMS_BACKEND_MMAP;
  p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    tms_fail("no host memory for the cpu backup of %llu bytes", (unsigned long long)a->size);
    return TMS_CUDA_OUT_OF_MEMORY;
  }
  a->host = p;
  return 0;
}

/* ------------------------------------------------------------------ allocate, free */

int tms_saver_malloc(void **ptr, int device, size_t size, const struct tms_alloc_config *cfg) {
  struct tms_alloc a = {.size = size, .device = device, .cpu_backup = cfg->cpu_backup,
                        .backend = cfg->backend};
  sublet_client *c;
  int rc = TMS_CUDA_OUT_OF_MEMORY;

  pthread_mutex_lock(&saver_lock);
  if ((c = tms_daemon_client(device)) == NULL)
    goto out;
  if ((a.tag = tag_id(cfg->tag, 1)) == 0) {
    tms_fail("no memory for tag %s", cfg->tag);
    goto out;
  }
  if (margin != 0)
    sublet_pool_set_margin(c, margin);
  if (sublet_pool_alloc(c, a.tag, size, (void **)&a.ptr) != 0) {
    fail_sublet("region allocation", SUBLET_ENOMEM);
    goto out;
  }
  if (record(&a) != 0) {
    sublet_pool_free(c, a.ptr);
    tms_fail("no memory to record an allocation");
    goto out;
  }
  *ptr = a.ptr;
  rc = TMS_CUDA_SUCCESS;
out:
  pthread_mutex_unlock(&saver_lock);
  return rc;
}

int tms_saver_free(void *ptr, int *rc) {
  struct tms_alloc *a;
  sublet_client *c;

  pthread_mutex_lock(&saver_lock);
  a = record_at(ptr);
  if (a == NULL || a->ptr != ptr) {
    pthread_mutex_unlock(&saver_lock);
    return 0;
  }
  c = tms_daemon_connected(a->device);
  *rc = c != NULL && sublet_pool_free(c, ptr) == 0 ? TMS_CUDA_SUCCESS : TMS_CUDA_INVALID_VALUE;
  host_free(a);
  *a = allocs[--nallocs];
  pthread_mutex_unlock(&saver_lock);
  return 1;
}

/* ------------------------------------------------------------------ pause, resume */

static int holds(uint32_t tag, int device) {
  for (size_t i = 0; i < nallocs; i++)
    if (allocs[i].tag == tag && (device < 0 || allocs[i].device == device))
      return 1;
  return 0;
}

static int copy_backups(uint32_t tag, int device, int to_device) {
  int rc;

  for (size_t i = 0; i < nallocs; i++) {
    struct tms_alloc *a = &allocs[i];
    if (a->tag != tag || a->device != device || !a->cpu_backup)
      continue;
    if (!to_device && (rc = host_get(a)) != 0)
      return rc;
    if (a->host == NULL)
      continue; /* made while paused: nothing was saved */
    if (tms_daemon_on_host(device))
      memcpy(to_device ? a->ptr : a->host, to_device ? a->host : a->ptr, a->size);
    else if ((rc = to_device ? tms_cuda_copy(a->ptr, a->host, a->size, 1)
                             : tms_cuda_copy(a->host, a->ptr, a->size, 0)) != 0)
      goto failed;
    if (to_device && !tms_saver_retain())
      host_free(a);
  }
  return 0;
failed:
  tms_fail("cpu backup copy failed (CUDA error %d)", rc);
  return rc;
}


/* By need (issue 42): subletd releases only the pages the need takes beyond the free memory;
 * a tag that cannot give that much alone (SUBLET_ENEED, nothing moved) is released whole, and
 * the next tag goes on by the same need. The backups were copied to the host above, so the
 * release keeps nothing either way. */
static int release_pages(sublet_client *c, const struct sublet_range *pages, size_t n,
                         uint64_t need, uint64_t *release_id) {
  int rc = SUBLET_ENEED;

  if (need != SUBLET_NEED_ALL)
    rc = sublet_release_need(sublet_pool_region(c), pages, n, NULL, 0, 0, SUBLET_STAY_ANY, need,
                             release_id, NULL);
  if (rc == SUBLET_ENEED)
    rc = sublet_release(sublet_pool_region(c), pages, n, NULL, 0, 0, 0, release_id, NULL);
  return rc;
}

static int release_tag(uint32_t tag, int device, uint64_t need) {
  sublet_client *c = tms_daemon_connected(device);
  struct sublet_range *pages = NULL;
  size_t n = 0, m = 0;
  int rc;

  if (!tms_daemon_on_host(device) && (rc = tms_cuda_synchronize()) != 0) {
    tms_fail("pause: cudaDeviceSynchronize failed (CUDA error %d)", rc);
    return rc;
  }
  if ((rc = copy_backups(tag, device, 0)) != 0)
    return rc;
  /* The tag's pages are read under the pools' hold (pool.c, "Releases"): no allocation, of
   * another thread or tag, takes a page between their reading and the release's end, where a
   * page the tag freed just before would be given to the driver under a new tensor. */
  if ((rc = sublet_pool_hold(c, NULL)) != 0)
    return fail_sublet("pause", rc);
  sublet_pool_segments(c, tag, NULL, 0, &n);
  if (n > 0 && (pages = calloc(n, sizeof *pages)) == NULL) {
    sublet_pool_unhold(c);
    return TMS_CUDA_OUT_OF_MEMORY;
  }
  if (n > 0) {
    sublet_pool_segments(c, tag, pages, n, &m);
    rc = release_pages(c, pages, m < n ? m : n, need, &tags[tag - 1].release[device]);
  }
  sublet_pool_unhold(c);
  free(pages);
  if (n == 0)
    return 0;
  if (rc != 0)
    return fail_sublet("pause", rc);
  tags[tag - 1].paused[device] = 1;
  return 0;
}

static int resume_tag(uint32_t tag, int device) {
  struct tms_tag *t = &tags[tag - 1];
  int rc = sublet_resume(sublet_pool_region(tms_daemon_connected(device)), t->release[device],
                         0, NULL);

  if (rc != 0)
    return fail_sublet("resume (free device memory, then resume again)", rc);
  t->paused[device] = 0;
  return copy_backups(tag, device, 1);
}

static int paused_anywhere(uint32_t tag) {
  for (int d = 0; d < TMS_MAX_DEVICES; d++)
    if (tags[tag - 1].paused[d])
      return 1;
  return 0;
}

/* The tags pause or resume(tag) acts on, into out (ntags of room): a tag holding nothing is
 * left out (a no-op, as the original). */
static int select_tags(const char *tag, int pausing, uint32_t *out, size_t *n) {
  uint32_t only = tag != NULL && tag[0] != '\0' ? tag_id(tag, 0) : 0;

  *n = 0;
  if (tag != NULL && tag[0] != '\0' && only == 0)
    return 0;
  for (uint32_t t = 1; t <= ntags; t++) {
    if ((only != 0 && t != only) || !holds(t, -1))
      continue;
    if (paused_anywhere(t) == pausing) {
      tms_fail("%s %s: tag %s is %s", pausing ? "pause" : "resume",
               only ? tags[t - 1].name : "(every tag)", tags[t - 1].name,
               pausing ? "paused already: resume it first" : "not paused: pause it first");
      return TMS_CUDA_INVALID_VALUE;
    }
    out[(*n)++] = t;
  }
  return 0;
}

static int each_device(uint32_t tag, int pausing, uint64_t need) {
  for (int d = 0; d < TMS_MAX_DEVICES; d++) {
    int rc;
    if (tms_daemon_connected(d) == NULL || tags[tag - 1].paused[d] != !pausing)
      continue;
    if (pausing && !holds(tag, d))
      continue;
    if ((rc = pausing ? release_tag(tag, d, need) : resume_tag(tag, d)) != 0)
      return rc;
  }
  return 0;
}

/* All or nothing: a pause that fails resumes what it paused. need: a pause's (SUBLET_NEED_ALL:
 * none), the same for each tag: subletd counts the free memory at each. */
static int pause_or_resume(const char *tag, int pausing, uint64_t need) {
  uint32_t *chosen;
  size_t n, done;
  int rc;

  pthread_mutex_lock(&saver_lock);
  chosen = calloc(ntags + 1, sizeof *chosen);
  rc = chosen == NULL ? TMS_CUDA_OUT_OF_MEMORY : select_tags(tag, pausing, chosen, &n);
  for (done = 0; rc == 0 && done < n; done++)
    rc = each_device(chosen[done], pausing, need);
  if (rc != 0 && pausing)
    for (size_t i = 0; i < done; i++)
      each_device(chosen[i], 0, SUBLET_NEED_ALL);
  free(chosen);
  pthread_mutex_unlock(&saver_lock);
  return rc;
}

int tms_saver_pause(const char *tag) {
  return tms_saver_pause_need(tag, SUBLET_NEED_ALL);
}

int tms_saver_pause_need(const char *tag, uint64_t need) {
  return pause_or_resume(tag, 1, need);
}

int tms_saver_resume(const char *tag) {
  return pause_or_resume(tag, 0, SUBLET_NEED_ALL);
}

/* ------------------------------------------------------------------ settings, backups */

uint8_t *tms_saver_backup_pointer(const uint8_t *ptr, uint64_t size) {
  struct tms_alloc *a;
  uint8_t *host = NULL;

  pthread_mutex_lock(&saver_lock);
  a = record_at(ptr);
  if (a != NULL && a->host != NULL && (uint64_t)(ptr - a->ptr) + size <= a->size)
    host = a->host + (ptr - a->ptr);
  pthread_mutex_unlock(&saver_lock);
  return host;
}

void tms_saver_set_margin(uint64_t bytes) {
  pthread_mutex_lock(&saver_lock);
  margin = bytes;
  for (int d = 0; d < TMS_MAX_DEVICES; d++)
    if (tms_daemon_connected(d) != NULL)
      sublet_pool_set_margin(tms_daemon_connected(d), bytes);
  pthread_mutex_unlock(&saver_lock);
}

void tms_saver_set_retain(int value) {
  retain = value != 0;
}

int tms_saver_retain(void) {
  if (retain < 0) {
    retain = tms_env_bool("TMS_RETAIN_CPU_BACKUP");
  }
  return retain;
}
