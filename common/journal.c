/* journal.c - the journal of a loan's saved kept bytes (the contract is journal.h).
 * Floor 2 (floors.h). */
#include "journal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "seal.h"
#include "sublet.h"

static size_t journal_size(uint64_t capacity) {
  return sizeof(struct sl_journal_header) + capacity * sizeof(struct sl_journal_entry);
}

/* Why a journal could not be made or grown, with the fix where there is one. */
static const char *why(int rc) {
  return rc == -EINVAL ? "memfd seals refused (sealing read-only needs Linux 5.1 or later)"
         : rc == -EMFILE ? "too many open files (raise the open-files limit)"
                         : strerror(-rc);
}

static void write_header(struct sl_journal *j, uint64_t region_id) {
  j->e = (struct sl_journal_entry *)(j->h + 1);
  j->h->magic = SL_JOURNAL_MAGIC;
  j->h->version = SL_JOURNAL_VERSION;
  j->h->loan_id = j->loan_id;
  j->h->region_id = region_id;
  j->h->capacity = j->capacity;
}

int sl_journal_create(uint64_t loan_id, uint64_t region_id, uint64_t capacity,
                      struct sl_journal **out, struct sl_err *err) {
  struct sl_journal *j = calloc(1, sizeof(*j));
  void *mem = MAP_FAILED;
  int rc;

  if (j == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a journal");
  j->size = journal_size(capacity);
  j->loan_id = loan_id;
  j->capacity = capacity;
  if ((rc = j->fd = sl_seal_memfd("sublet-journal")) < 0 ||
      (rc = sl_seal_grow_to(j->fd, j->size)) != 0)
    goto fail;
  mem = mmap(NULL, j->size, PROT_READ | PROT_WRITE, MAP_SHARED, j->fd, 0);
  if (mem == MAP_FAILED) {
    rc = -errno;
    goto fail;
  }
  if ((rc = sl_seal_read_only(j->fd)) != 0) /* after the daemon's mapping: the last writable */
    goto fail;
  j->h = mem;
  write_header(j, region_id);
  *out = j;
  return 0;
fail:
  if (mem != MAP_FAILED)
    munmap(mem, j->size);
  if (j->fd >= 0)
    close(j->fd);
  free(j);
  return sl_err_set(err, SUBLET_ENOMEM, "cannot make a journal of %zu bytes: %s",
                    journal_size(capacity), why(rc));
}

void sl_journal_free(struct sl_journal *j) {
  if (j == NULL)
    return;
  munmap(j->h, j->size);
  close(j->fd);
  free(j);
}

void sl_journal_set_owner(struct sl_journal *j, uid_t uid) {
  j->h->owner_uid = (uint32_t)uid;
}

void sl_journal_set_borrower(struct sl_journal *j, pid_t pid, uid_t uid) {
  j->h->borrower_uid = (uint32_t)uid;
  __atomic_store_n(&j->h->borrower_pid, (int32_t)pid, __ATOMIC_RELEASE);
}

/* Room for need entries: the file grows first, then the mapping, then the header says so.
 * The file is sealed read-only: the daemon's own mapping is the only writable one, so it grows
 * by mremap (a new writable mmap would be refused). */
static int grow(struct sl_journal *j, uint64_t need, struct sl_err *err) {
  uint64_t cap = j->capacity > 0 ? j->capacity : 1024;
  void *mem = MAP_FAILED;
  size_t size;
  int rc;

  while (cap < need)
    cap *= 2;
  size = journal_size(cap);
  rc = sl_seal_grow_to(j->fd, size);
  if (rc == 0 && (mem = mremap(j->h, j->size, size, MREMAP_MAYMOVE)) == MAP_FAILED)
    rc = -errno;
  if (rc != 0)
    return sl_err_set(err, SUBLET_ENOMEM, "loan %llu: cannot grow its journal to %llu entries: "
                      "%s", (unsigned long long)j->loan_id, (unsigned long long)cap, why(rc));
  j->h = mem;
  j->e = (struct sl_journal_entry *)(j->h + 1);
  j->size = size;
  j->capacity = cap;
  __atomic_store_n(&j->h->capacity, cap, __ATOMIC_RELEASE);
  return 0;
}

/* The counts are the daemon's own (j->committed, j->capacity): what a client may have left in
 * the header is never read. */
struct sl_journal_entry *sl_journal_reserve(struct sl_journal *j, size_t n, struct sl_err *err) {
  uint64_t at = j->committed;

  if (n > j->capacity - at && grow(j, at + n, err) != 0)
    return NULL;
  return &j->e[at];
}

void sl_journal_commit(struct sl_journal *j, size_t m) {
  j->committed += m;
  __atomic_store_n(&j->h->committed, j->committed, __ATOMIC_RELEASE); /* the commit */
}

int sl_journal_append(struct sl_journal *j, const struct sl_journal_entry *e, size_t n,
                      struct sl_err *err) {
  struct sl_journal_entry *room = sl_journal_reserve(j, n, err);

  if (room == NULL)
    return SUBLET_ENOMEM; /* grow() says why */
  memcpy(room, e, n * sizeof(*e));
  sl_journal_commit(j, n);
  return 0;
}

void sl_journal_end(struct sl_journal *j) {
  for (uint64_t i = 0; i < j->committed; i++)
    __atomic_store_n(&j->e[i].done, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&j->h->ended, 1, __ATOMIC_RELEASE);
}

int sl_journal_open(int fd, uint64_t loan_id, struct sl_journal_view *v, struct sl_err *err) {
  struct stat st;
  const struct sl_journal_header *h;
  void *mem;

  memset(v, 0, sizeof(*v));
  if (fstat(fd, &st) != 0 || (size_t)st.st_size < sizeof(*h))
    return sl_err_set(err, SUBLET_EPROTO, "a loan's journal is missing or too small");
  mem = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  if (mem == MAP_FAILED)
    return sl_err_set(err, SUBLET_EIO, "cannot map the loan's journal: %s", strerror(errno));
  h = mem;
  v->h = h;
  v->size = (size_t)st.st_size;
  v->e = (const struct sl_journal_entry *)(h + 1);
  v->committed = __atomic_load_n(&h->committed, __ATOMIC_ACQUIRE);
  if (h->magic != SL_JOURNAL_MAGIC || h->version != SL_JOURNAL_VERSION ||
      h->loan_id != loan_id || journal_size(h->capacity) > v->size ||
      v->committed > h->capacity) {
    sl_journal_close(v);
    return sl_err_set(err, SUBLET_EPROTO, "the journal of loan %llu is not one this library "
                      "reads (another version of subletd?)", (unsigned long long)loan_id);
  }
  return 0;
}

void sl_journal_close(struct sl_journal_view *v) {
  if (v->h != NULL)
    munmap((void *)v->h, v->size);
  memset(v, 0, sizeof(*v));
}
