/* test_journal.c - the loan journal (common/journal.c) against a hostile reader: its memfd is
 * sealed so that no fd of it writes or shrinks, it still grows past its first size, and the
 * daemon's side never steers by what the shared header says (issue 25, item 1). The header is
 * scribbled here through the daemon's own mapping, standing in for any write that got there. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "journal.h"
#include "seal.h"

static struct sl_err err;

static struct sl_journal_entry entry(uint64_t i) {
  return (struct sl_journal_entry){SL_JOURNAL_SAVE, 0, i * 4096, i * 8192, 4096};
}

/* No fd of it, however opened, writes, maps writable or shrinks it. */
static void test_sealed(void) {
  struct sl_journal *j = NULL;
  char path[64];
  int rw;

  CHECK(sl_journal_create(7, 3, 4, &j, &err) == 0);
  if (j == NULL)
    return;
  CHECK(sl_seal_is_read_only(j->fd));
  snprintf(path, sizeof(path), "/proc/self/fd/%d", j->fd);
  rw = open(path, O_RDWR | O_CLOEXEC);
  CHECK(rw >= 0 || errno == EACCES);
  if (rw >= 0) {
    CHECK(pwrite(rw, "x", 1, 0) == -1 && errno == EPERM);
    CHECK(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0) == MAP_FAILED &&
          errno == EPERM);
    CHECK(ftruncate(rw, 0) == -1 && errno == EPERM);
    close(rw);
  }
  sl_journal_free(j);
}

/* Grows from 4 entries to 5000 after the seal: the daemon's mapping, not a new one. */
static void test_grows_sealed(void) {
  struct sl_journal *j = NULL;
  struct sl_journal_view v;

  CHECK(sl_journal_create(7, 3, 4, &j, &err) == 0);
  if (j == NULL)
    return;
  for (uint64_t i = 0; i < 5000; i++) {
    struct sl_journal_entry e = entry(i);
    if (sl_journal_append(j, &e, 1, &err) != 0)
      break;
  }
  CHECK_EQ(j->committed, 5000);
  CHECK(sl_journal_open(j->fd, 7, &v, &err) == 0);
  CHECK_EQ(v.committed, 5000);
  CHECK(v.e != NULL && v.e[4999].src == 4999 * 4096 && v.e[4999].dst == 4999 * 8192);
  sl_journal_close(&v);
  sl_journal_free(j);
}

/* The shared counts say anything; the daemon appends after its own, grows by its own capacity,
 * and puts the true counts back. */
static void test_ignores_shared_counts(void) {
  struct sl_journal_entry e[3] = {entry(0), entry(1), entry(2)};
  struct sl_journal *j = NULL;
  struct sl_journal_view v;

  CHECK(sl_journal_create(9, 1, 2, &j, &err) == 0);
  if (j == NULL)
    return;
  CHECK(sl_journal_append(j, e, 1, &err) == 0);
  j->h->committed = UINT64_MAX - 1; /* appending there wrote far outside the mapping */
  j->h->capacity = UINT64_MAX;      /* and no growth was seen to be needed */
  CHECK(sl_journal_append(j, &e[1], 2, &err) == 0); /* past the 2 entries made: grows */
  CHECK_EQ(j->committed, 3);
  CHECK_EQ(j->h->committed, 3);
  CHECK(j->h->capacity == j->capacity && j->capacity >= 3);
  j->h->committed = UINT64_MAX; /* the end marks only the entries there are */
  sl_journal_end(j);
  CHECK(sl_journal_open(j->fd, 9, &v, &err) != 0); /* the header lies: the owner refuses it */
  j->h->committed = 3;
  CHECK(sl_journal_open(j->fd, 9, &v, &err) == 0);
  CHECK(v.committed == 3 && v.e[2].src == 2 * 4096 && v.e[2].done == 1 && v.h->ended == 1);
  sl_journal_close(&v);
  sl_journal_free(j);
}

/* Who owns and who borrowed, and the pages granted, reach the owner's view as written. */
static void test_owner_and_grants(void) {
  struct sl_journal_entry e[2] = {entry(0), {SL_JOURNAL_GRANT, 0, 4 * 4096, 0, 3 * 4096}};
  struct sl_journal *j = NULL;
  struct sl_journal_view v;

  CHECK(sl_journal_create(11, 2, 4, &j, &err) == 0);
  if (j == NULL)
    return;
  sl_journal_set_owner(j, 1000);
  sl_journal_set_borrower(j, 4321, 3000);
  CHECK(sl_journal_append(j, e, 2, &err) == 0);
  CHECK(sl_journal_open(j->fd, 11, &v, &err) == 0);
  CHECK(v.h->version == SL_JOURNAL_VERSION && v.h->owner_uid == 1000 &&
        v.h->borrower_uid == 3000 && v.h->borrower_pid == 4321 && v.h->ended == 0);
  CHECK(v.committed == 2 && v.e[1].kind == SL_JOURNAL_GRANT && v.e[1].src == 4 * 4096 &&
        v.e[1].len == 3 * 4096);
  sl_journal_close(&v);
  sl_journal_free(j);
}

/* Entries written in place reach the owner only once committed, and only those committed;
 * room that needs growth grows the file first. */
static void test_reserve_in_place(void) {
  struct sl_journal *j = NULL;
  struct sl_journal_entry *room;
  struct sl_journal_view v;

  CHECK(sl_journal_create(12, 3, 2, &j, &err) == 0);
  if (j == NULL)
    return;
  CHECK(sl_journal_append(j, (struct sl_journal_entry[]){entry(0)}, 1, &err) == 0);
  room = sl_journal_reserve(j, 100, &err); /* past the 2 made: grows */
  CHECK(room != NULL && j->capacity >= 101);
  if (room == NULL)
    return;
  for (uint64_t i = 0; i < 100; i++)
    room[i] = entry(i + 1);
  CHECK(sl_journal_open(j->fd, 12, &v, &err) == 0);
  CHECK_EQ(v.committed, 1); /* written, not committed: not there */
  sl_journal_close(&v);
  sl_journal_commit(j, 60); /* the first 60 of the 100 */
  CHECK(sl_journal_open(j->fd, 12, &v, &err) == 0);
  CHECK_EQ(v.committed, 61);
  CHECK(v.e[60].src == 60 * 4096 && v.e[60].dst == 60 * 8192);
  sl_journal_close(&v);
  CHECK(sl_journal_append(j, (struct sl_journal_entry[]){entry(7)}, 1, &err) == 0);
  CHECK_EQ(j->committed, 62); /* the next append follows the committed ones */
  CHECK_EQ(j->e[61].src, 7 * 4096);
  sl_journal_free(j);
}

int main(void) {
  test_sealed();
  test_grows_sealed();
  test_ignores_shared_counts();
  test_owner_and_grants();
  test_reserve_in_place();
  return check_report("test_journal");
}
