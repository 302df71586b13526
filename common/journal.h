/* journal.h - the journal of a loan's saved kept bytes, in memory that outlives subletd.
 *
 * While a loan runs, the daemon moves some of the owner's kept bytes away from their pages:
 * to the host save area (a memfd) before handing the pages out, and (issue 10) to other places
 * on the device. If the daemon dies, the owner's library must put them back itself. The journal
 * says what went where: a memfd of its own, made by the daemon at Lend and shared with the
 * owner's client, which maps it read-only. The daemon writes, the owner reads (after the
 * daemon is gone, so there is no concurrent access to guard against beyond ordering).
 *
 * The daemon never reads the shared memory back: whoever holds the fd is a client, and a client
 * that could change a count there would steer the daemon's writes (issue 25). Its counts live
 * in struct sl_journal; the memfd is sealed read-only (seal.h) after the daemon has mapped it,
 * so no client can write or shrink it, and it grows by ftruncate and mremap of that mapping.
 *
 * Consistent at every instant, whenever the daemon dies:
 *   1. the bytes reach their new place (the copy has completed),
 *   2. the entries describing them are written after the committed ones,
 *   3. committed is advanced past them (a release store): they exist from then on.
 * A page is handed to a borrower only after its entries are committed, so anything a borrower
 * may have overwritten is in the journal. Once the daemon has put bytes back it marks their
 * entries done; the owner undoes the committed entries that are not done, last first (so that
 * a later move of bytes that an earlier one placed is undone before it), which is harmless to
 * repeat.
 *
 * The layout is this machine's (native byte order, these structs): daemon and owner run on one
 * host. The version field changes with any change to it.
 */
#ifndef SL_JOURNAL_H
#define SL_JOURNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "error.h"

#define SL_JOURNAL_MAGIC 0x4c4e524aU /* "JRNL" */
#define SL_JOURNAL_VERSION 2 /* 2: GRANT entries and owner_uid */

enum sl_journal_kind {
  SL_JOURNAL_SAVE = 1, /* region bytes [src, src+len) are in the save area at dst */
  SL_JOURNAL_MOVE = 2, /* region bytes [src, src+len) are in the region at dst (on the device) */
  SL_JOURNAL_GRANT = 3, /* region bytes [src, src+len) (whole pages) were granted to the
                           borrower: it may hold fds of them for good. Written with (never
                           before) the SAVE and MOVE entries that emptied their kept bytes, so
                           that an owner may give those pages fresh memory and lose nothing
                           (docs/design/isolation.md); dst is 0, nothing to undo */
};

struct sl_journal_entry {
  uint32_t kind;       /* enum sl_journal_kind */
  uint32_t done;       /* put back by the daemon: nothing to undo */
  uint64_t src;        /* where the kept bytes belong: a byte offset in the region */
  uint64_t dst;        /* where they are now: an offset in the save area, or in the region */
  uint64_t len;
};

struct sl_journal_header {
  uint32_t magic, version;
  uint64_t loan_id, region_id;
  uint64_t capacity;      /* entries that fit after the header; grows (the file first) */
  uint64_t committed;     /* entries [0, committed) are valid: advanced last */
  int32_t borrower_pid;   /* set before the borrower gets the loan; 0: not borrowed */
  uint32_t borrower_uid;
  uint32_t ended;         /* the daemon put everything back, into pages no borrower of
                             another user was granted: the owner has nothing to undo or wait
                             for */
  uint32_t owner_uid;     /* the region's owner, as the daemon saw it (SO_PEERCRED): a
                             borrower of another uid may still reach its GRANT pages */
};

/* The daemon's side: a journal memfd of room for capacity entries, mapped read-write. What
 * the daemon knows it keeps here, never in h: it only writes there. */
struct sl_journal {
  int fd;                          /* owned; sealed read-only */
  size_t size;                     /* of the mapping */
  uint64_t loan_id, capacity, committed;
  struct sl_journal_header *h;     /* the mapping: written, never read */
  struct sl_journal_entry *e;
};

int sl_journal_create(uint64_t loan_id, uint64_t region_id, uint64_t capacity,
                      struct sl_journal **out, struct sl_err *err);
void sl_journal_free(struct sl_journal *j);
void sl_journal_set_owner(struct sl_journal *j, uid_t uid);
void sl_journal_set_borrower(struct sl_journal *j, pid_t pid, uid_t uid);
/* Appends n entries and commits them, growing the journal as needed; on failure nothing is
 * committed. */
int sl_journal_append(struct sl_journal *j, const struct sl_journal_entry *e, size_t n,
                      struct sl_err *err);
/* The same in place, for long lists (no copy of them made first): room for n entries after
 * the committed ones, grown as needed (NULL, with err, when it cannot be), which the caller
 * writes; then sl_journal_commit() commits the first m <= n of them. Until then the owner
 * reads none of them. */
struct sl_journal_entry *sl_journal_reserve(struct sl_journal *j, size_t n, struct sl_err *err);
void sl_journal_commit(struct sl_journal *j, size_t m);
/* Everything is back: every entry done, the loan ended. */
void sl_journal_end(struct sl_journal *j);

/* The owner's side: maps a journal fd read-only and checks it is the loan's. */
struct sl_journal_view {
  const struct sl_journal_header *h;
  const struct sl_journal_entry *e;
  uint64_t committed;              /* read once, with acquire */
  size_t size;
};

int sl_journal_open(int fd, uint64_t loan_id, struct sl_journal_view *v, struct sl_err *err);
void sl_journal_close(struct sl_journal_view *v);

#endif
