/* journal.c - the journal of a loan's saved kept bytes (the contract is journal.h). */
#include "journal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sublet.h"

static size_t journal_size(uint64_t capacity) {
  return sizeof(struct sl_journal_header) + capacity * sizeof(struct sl_journal_entry);
}

int sl_journal_create(uint64_t loan_id, uint64_t region_id, uint64_t capacity,
                      struct sl_journal **out, struct sl_err *err) {
  struct sl_journal *j = calloc(1, sizeof(*j));
  void *mem = MAP_FAILED;

  if (j == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory for a journal");
  j->size = journal_size(capacity);
  j->fd = memfd_create("sublet-journal", MFD_CLOEXEC);
  if (j->fd >= 0 && ftruncate(j->fd, (off_t)j->size) == 0)
    mem = mmap(NULL, j->size, PROT_READ | PROT_WRITE, MAP_SHARED, j->fd, 0);
  if (mem == MAP_FAILED) {
    int e = errno;
    if (j->fd >= 0)
      close(j->fd);
    free(j);
    return sl_err_set(err, SUBLET_ENOMEM, "cannot make a journal of %zu bytes: %s",
                      journal_size(capacity), strerror(e));
  }
  j->h = mem;
  j->e = (struct sl_journal_entry *)(j->h + 1);
  j->h->magic = SL_JOURNAL_MAGIC;
  j->h->version = SL_JOURNAL_VERSION;
  j->h->loan_id = loan_id;
  j->h->region_id = region_id;
  j->h->capacity = capacity;
  *out = j;
  return 0;
}

void sl_journal_free(struct sl_journal *j) {
  if (j == NULL)
    return;
  munmap(j->h, j->size);
  close(j->fd);
  free(j);
}

void sl_journal_set_borrower(struct sl_journal *j, pid_t pid, uid_t uid) {
  j->h->borrower_uid = (uint32_t)uid;
  __atomic_store_n(&j->h->borrower_pid, (int32_t)pid, __ATOMIC_RELEASE);
}

/* Room for need entries: the file grows first, then the mapping, then the header says so. */
static int grow(struct sl_journal *j, uint64_t need, struct sl_err *err) {
  uint64_t cap = j->h->capacity > 0 ? j->h->capacity : 1024;
  size_t size;
  void *mem;

  while (cap < need)
    cap *= 2;
  size = journal_size(cap);
  if (ftruncate(j->fd, (off_t)size) != 0 ||
      (mem = mremap(j->h, j->size, size, MREMAP_MAYMOVE)) == MAP_FAILED)
    return sl_err_set(err, SUBLET_ENOMEM, "loan %llu: cannot grow its journal to %llu entries: "
                      "%s", (unsigned long long)j->h->loan_id, (unsigned long long)cap,
                      strerror(errno));
  j->h = mem;
  j->e = (struct sl_journal_entry *)(j->h + 1);
  j->size = size;
  __atomic_store_n(&j->h->capacity, cap, __ATOMIC_RELEASE);
  return 0;
}

int sl_journal_append(struct sl_journal *j, const struct sl_journal_entry *e, size_t n,
                      struct sl_err *err) {
  uint64_t at = j->h->committed;
  int rc;

  if (n > j->h->capacity - at && (rc = grow(j, at + n, err)) != 0)
    return rc;
  memcpy(&j->e[at], e, n * sizeof(*e));
  __atomic_store_n(&j->h->committed, at + n, __ATOMIC_RELEASE); /* the commit */
  return 0;
}

void sl_journal_end(struct sl_journal *j) {
  for (uint64_t i = 0; i < j->h->committed; i++)
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
