/* rescue.c - libsublet: the owner puts its kept bytes back itself when subletd dies mid-loan.
 *
 * At Lend the daemon gives the owner three fds (daemon/rescue.c): the loan's journal and the
 * host save area (both read-only) and the read end of the loan's release pipe. When the owner
 * finds its connection gone while it waits for the loan to end, it
 *   1. makes sure the borrower no longer touches pages that will hold the owner's bytes:
 *      - a borrower of the owner's user: waits until it has let go: its library writes a byte
 *        to the pipe once it has stopped and unmapped (watch.c); end-of-file instead means it
 *        went without saying (or nobody borrowed): then its process must have fully exited
 *        (a pidfd), since GPU work may run until then;
 *      - a borrower of another user may keep its fds (or a forked child's mappings) for good,
 *        so waiting proves nothing: every page it was granted (the journal's GRANT entries)
 *        gets fresh memory of this process's own, mapped at the same address, and the old
 *        pages go from this process (docs/design/isolation.md), unless a Reclaim whose end
 *        waited for fresh pages let go of them already (sl_rescue_let_go_granted). It never
 *        had the others. No wait, unless the device lacks the memory: then once for it to
 *        let go (its memory comes back), up to the timeout;
 *   2. undoes, last first, every committed entry of the journal that the daemon did not put
 *      back: saved bytes come from the save area, moved ones move back, through its own
 *      mapping of the region (it holds handles to all its pages);
 *   3. reports SUBLET_EDAEMONDIED with what it restored.
 * A journal marked ended needs none of it: the daemon had put everything back, into pages no
 * borrower of another user was granted, before it died (the owner had not asked yet).
 * The fds are the region's (owned by struct sl_rescue) until the loan ends either way.
 * Floor 3 (client.h's floors).
 */
#include "client.h"

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "clock.h"
#include "journal.h"

struct sl_rescue {
  uint64_t loan_id;
  int journal_fd, area_fd, release_fd; /* owned */
  int released;                        /* the borrower let go: step 1 is done */
  int dropped;                         /* the granted pages' old memory is let go of */
};

int sl_rescue_new(uint64_t loan_id, const int fds[3], struct sl_rescue **out) {
  struct sl_rescue *r = calloc(1, sizeof(*r));

  if (r == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  r->loan_id = loan_id;
  r->journal_fd = fds[0];
  r->area_fd = fds[1];
  r->release_fd = fds[2];
  *out = r;
  return 0;
}

void sl_rescue_free(struct sl_rescue *r) {
  if (r == NULL)
    return;
  close(r->journal_fd);
  close(r->area_fd);
  close(r->release_fd);
  free(r);
}

uint64_t sl_rescue_loan(const struct sl_rescue *r) {
  return r->loan_id;
}

/* Waits for fd to become readable; 1 when it did, 0 at the timeout. */
static int readable(int fd, int timeout_ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  int n;

  while ((n = poll(&p, 1, timeout_ms)) < 0 && errno == EINTR)
    ;
  return n > 0;
}

/* The borrower's process has fully exited (or cannot be watched: it is gone already). */
static int borrower_exited(pid_t pid, int timeout_ms) {
  int pidfd = (int)syscall(SYS_pidfd_open, pid, 0), gone;

  if (pidfd < 0)
    return errno == ESRCH || errno == EINVAL; /* no such process any more */
  gone = readable(pidfd, timeout_ms);
  close(pidfd);
  return gone;
}

/* Step 1: 0 once the borrower let go, SUBLET_ETIMEDOUT if it has not within timeout_ms. */
static int wait_released(struct sl_rescue *r, const struct sl_journal_header *h,
                         int timeout_ms) {
  pid_t pid = __atomic_load_n(&h->borrower_pid, __ATOMIC_ACQUIRE);
  int64_t t0 = sl_clock_ms();
  char byte;
  ssize_t n = 0;

  if (r->released || pid == 0)
    return 0; /* nobody borrowed: nothing was lent out */
  if (!readable(r->release_fd, timeout_ms))
    n = -1;
  else
    n = read(r->release_fd, &byte, 1);
  if (n == 1 && (h->borrower_uid == getuid() || h->borrower_uid == 0))
    return r->released = 1, 0;
  if (n >= 0 && pid != getpid() && borrower_exited(pid, sl_clock_left_ms(t0, timeout_ms)))
    return r->released = 1, 0;
  return sl_client_fail(SUBLET_ETIMEDOUT, "subletd died during loan %llu and its borrower "
                        "(pid %d) has not let go of the loan's pages yet; the kept bytes are "
                        "safe in the save area: reclaim again to wait longer",
                        (unsigned long long)r->loan_id, (int)pid);
}

/* Was the loan borrowed by another user than its owner (who may keep its fds for good)? */
static int other_user(const struct sl_journal_header *h) {
  return __atomic_load_n(&h->borrower_pid, __ATOMIC_ACQUIRE) != 0 &&
         h->borrower_uid != h->owner_uid;
}

/* The GRANT entries' pages (those in the region: the rest fails in step 2), each run once. */
static void granted_run(const struct sublet_region *reg, const struct sl_journal_entry *e,
                        uint64_t *first, uint64_t *count) {
  uint64_t size = reg->npages * reg->page_size;

  *first = *count = 0;
  if (e->kind != SL_JOURNAL_GRANT || e->src % reg->page_size != 0 || e->src > size ||
      e->len > size - e->src)
    return;
  *first = e->src / reg->page_size;
  *count = e->len / reg->page_size;
}

/* This process lets go of the granted pages' old memory (unmapped, handles released), once
 * per loan: the borrower may reach it, and holding it would keep its memory from the device.
 * The rescue's step 1 and a Reclaim whose end waits for fresh pages (sl_rescue_let_go_granted)
 * both come here; r->dropped tells each that the other did it (the holes it left are what
 * make_granted and the Reclaim's remap fill). Returns 1 when it let go now. */
static int drop_granted(struct sublet_region *reg, struct sl_rescue *r,
                        const struct sl_journal_view *v) {
  if (r->dropped)
    return 0;
  sl_device_synchronize(reg->client->dev, NULL);
  for (uint64_t i = 0, first, count; i < v->committed; i++) {
    granted_run(reg, &v->e[i], &first, &count);
    if (count > 0)
      sl_pages_let_go(reg->client, reg, first, count);
  }
  r->dropped = 1;
  return 1;
}

/* The owner is paused for the whole loan (its tensors are the borrower's to overwrite, and
 * its kept bytes are not in granted pages: they were moved or saved before the grant), so
 * nothing of its own reads the granted pages' addresses until the Reclaim has mapped fresh
 * pages there: leaving holes meanwhile costs it nothing. */
int sl_rescue_let_go_granted(struct sublet_region *reg) {
  struct sl_rescue *r = reg->rescue;
  struct sl_journal_view v;
  struct sl_err err = {0};
  int rc;

  if (r == NULL || r->dropped)
    return 0;
  if ((rc = sl_journal_open(r->journal_fd, r->loan_id, &v, &err)) != 0)
    return sl_client_fail_err(&err);
  rc = other_user(v.h) ? drop_granted(reg, r, &v) : 0; /* only those pages are replaced */
  sl_journal_close(&v);
  return rc;
}

/* Fresh memory of this process's own for the granted pages that have none, mapped where the
 * old ones were (the tensor's addresses stay). */
static int make_granted(struct sublet_region *reg, const struct sl_journal_view *v,
                        struct sl_err *err) {
  struct sl_device *dev = reg->client->dev;
  uint64_t ps = reg->page_size;
  int rc = 0;

  for (uint64_t i = 0, first, count; rc == 0 && i < v->committed; i++) {
    granted_run(reg, &v->e[i], &first, &count);
    for (uint64_t p = first; rc == 0 && p < first + count; p++) {
      if (reg->handles[p] != 0)
        continue; /* made already (an earlier try, or an entry twice) */
      if ((rc = sl_device_create(dev, ps, &reg->handles[p], err)) != 0)
        break;
      if ((rc = sl_device_map(dev, (char *)reg->base + p * ps, ps, reg->handles[p], err)) != 0) {
        sl_device_release(dev, reg->handles[p]);
        reg->handles[p] = 0;
      }
    }
    if (rc == 0 && count > 0)
      rc = sl_device_set_access(dev, (char *)reg->base + first * ps, count * ps, err);
  }
  return rc;
}

/* Step 1 for a borrower of another user: its granted pages made anew here. Lacking the memory,
 * waits once for the borrower to let go (up to timeout_ms) and tries again. */
static int fresh_granted(struct sublet_region *reg, struct sl_rescue *r,
                         const struct sl_journal_view *v, int timeout_ms) {
  struct sl_err err = {0};
  int rc;

  drop_granted(reg, r, v);
  rc = make_granted(reg, v, &err);
  if (rc != 0 && wait_released(r, v->h, timeout_ms) == 0) {
    memset(&err, 0, sizeof(err));
    rc = make_granted(reg, v, &err);
  }
  if (rc != 0)
    return sl_client_fail(err.code != 0 ? err.code : rc, "subletd died during loan %llu to "
                          "another user, and this process cannot make fresh pages in place of "
                          "those it was granted (%s); the kept bytes are safe in the save area: "
                          "free device memory and reclaim again", (unsigned long long)r->loan_id,
                          err.msg);
  return 0;
}

/* An entry points inside the region (src; dst too for a MOVE) and the save area (a SAVE); a
 * GRANT names whole pages of the region. */
static int entry_valid(const struct sl_journal_entry *e, uint64_t region, uint64_t area,
                       uint64_t page_size) {
  uint64_t dst_end = e->kind == SL_JOURNAL_SAVE ? area : region;

  if (e->kind == SL_JOURNAL_GRANT)
    return e->src % page_size == 0 && e->len % page_size == 0 && e->src <= region &&
           e->len <= region - e->src;
  return (e->kind == SL_JOURNAL_SAVE || e->kind == SL_JOURNAL_MOVE) && e->src <= region &&
         e->len <= region - e->src && e->dst <= dst_end && e->len <= dst_end - e->dst;
}

/* Undoing the journal, one run of entries of one kind at a time, last entry first. */
struct undo {
  struct sl_device *dev;
  uint64_t page_size;
  void *region, *area;
  struct sl_copy *copies;  /* a run of SAVEs: from the save area back into the region */
  struct sl_move *moves;   /* a run of MOVEs: back from where they went */
  size_t ncopies, nmoves;
  struct sl_err err;
};

static int undo_flush(struct undo *u) {
  int rc = 0;

  if (u->ncopies > 0)
    rc = sl_device_copy(u->dev, SL_COPY_TO_DEVICE, u->region, u->area, u->copies, u->ncopies,
                        &u->err);
  if (rc == 0 && u->nmoves > 0)
    rc = sl_device_move(u->dev, u->region, u->moves, u->nmoves, &u->err);
  u->ncopies = u->nmoves = 0;
  return rc;
}

static int undo_entry(struct undo *u, const struct sl_journal_entry *e) {
  int rc = 0;

  if ((e->kind == SL_JOURNAL_SAVE && u->nmoves > 0) ||
      (e->kind == SL_JOURNAL_MOVE && u->ncopies > 0))
    rc = undo_flush(u); /* the kind changes: what came later is undone first */
  if (e->kind == SL_JOURNAL_SAVE)
    u->copies[u->ncopies++] = (struct sl_copy){e->src, e->dst, e->len};
  else
    u->moves[u->nmoves++] = (struct sl_move){e->dst, e->src, e->len};
  return rc;
}

/* Step 2: every committed entry the daemon did not put back, last first. */
static int undo_all(struct undo *u, const struct sl_journal_view *v, uint64_t region_size,
                    uint64_t area_size, struct sublet_loan_stats *st) {
  int rc = 0;

  for (uint64_t i = v->committed; i-- > 0 && rc == 0;) {
    const struct sl_journal_entry *e = &v->e[i];
    if (!entry_valid(e, region_size, area_size, u->page_size))
      return sl_client_fail(SUBLET_EPROTO, "entry %llu of loan %llu's journal is not one this "
                            "library can undo (kind %u)", (unsigned long long)i,
                            (unsigned long long)v->h->loan_id, e->kind);
    if (e->kind == SL_JOURNAL_GRANT)
      continue; /* step 1's: nothing to undo */
    if (e->kind == SL_JOURNAL_SAVE)
      st->copied_out_bytes += e->len;
    else
      st->moved_bytes += e->len;
    if (__atomic_load_n(&e->done, __ATOMIC_ACQUIRE))
      continue;
    if (e->kind == SL_JOURNAL_SAVE)
      st->copied_in_bytes += e->len;
    rc = undo_entry(u, e);
  }
  if (rc == 0)
    rc = undo_flush(u);
  if (rc == 0)
    rc = sl_device_synchronize(u->dev, &u->err);
  return rc != 0 && u->err.code != 0 ? sl_client_fail_err(&u->err) : rc;
}

static int restore(struct sublet_region *reg, struct sl_rescue *r,
                   const struct sl_journal_view *v, struct sublet_loan_stats *st) {
  struct undo u = {.dev = reg->client->dev, .page_size = reg->page_size, .region = reg->base};
  uint64_t area_size;
  struct stat sa;
  int rc;

  if (fstat(r->area_fd, &sa) != 0)
    return sl_client_fail(SUBLET_EIO, "the save area of loan %llu: %s",
                          (unsigned long long)r->loan_id, strerror(errno));
  area_size = (uint64_t)sa.st_size;
  u.copies = calloc(v->committed + 1, sizeof(*u.copies));
  u.moves = calloc(v->committed + 1, sizeof(*u.moves));
  rc = u.copies == NULL || u.moves == NULL ? sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory")
                                           : 0;
  if (rc == 0 && area_size > 0 &&
      (rc = sl_device_host_map(u.dev, r->area_fd, 0, area_size, 0, &u.area, &u.err)) != 0)
    rc = sl_client_fail_err(&u.err);
  if (rc == 0)
    rc = undo_all(&u, v, reg->npages * reg->page_size, area_size, st);
  if (u.area != NULL)
    sl_device_host_free(u.dev, u.area, area_size);
  free(u.copies);
  free(u.moves);
  return rc;
}

/* The journal says the daemon had ended the loan: nothing to wait for or undo. */
static int ended_before(const struct sl_rescue *r, const struct sl_journal_view *v,
                        struct sublet_loan_stats *stats) {
  struct sublet_loan_stats st = {.loan_id = r->loan_id, .daemon_died = 1};
  char a[16];

  for (uint64_t i = 0; i < v->committed; i++) {
    if (v->e[i].kind == SL_JOURNAL_SAVE)
      st.copied_out_bytes += v->e[i].len;
    else if (v->e[i].kind == SL_JOURNAL_MOVE)
      st.moved_bytes += v->e[i].len;
  }
  st.copied_in_bytes = st.copied_out_bytes; /* by the daemon, before it died */
  if (stats != NULL)
    *stats = st;
  return sl_client_fail(SUBLET_EDAEMONDIED, "subletd died after loan %llu had ended, before "
                        "this process heard: it had put every kept byte back (%s saved and "
                        "restored); nothing to restore here. The tensor is intact; a restarted "
                        "subletd serves new work", (unsigned long long)r->loan_id,
                        sl_format_size(a, st.copied_out_bytes));
}

int sl_rescue_run(struct sublet_region *reg, int timeout_ms, struct sublet_loan_stats *stats) {
  struct sl_rescue *r = reg->rescue;
  struct sublet_loan_stats st = {.loan_id = r->loan_id, .daemon_died = 1};
  struct sl_journal_view v;
  struct sl_err err = {0};
  char a[16], b[16];
  int rc = sl_journal_open(r->journal_fd, r->loan_id, &v, &err);

  if (rc != 0)
    return sl_client_fail_err(&err);
  if (__atomic_load_n(&v.h->ended, __ATOMIC_ACQUIRE)) {
    rc = ended_before(r, &v, stats);
    sl_journal_close(&v);
    return rc;
  }
  rc = other_user(v.h) ? fresh_granted(reg, r, &v, timeout_ms)
                       : wait_released(r, v.h, timeout_ms);
  if (rc == 0)
    rc = restore(reg, r, &v, &st);
  sl_journal_close(&v);
  if (rc != 0)
    return rc;
  if (stats != NULL)
    *stats = st;
  return sl_client_fail(SUBLET_EDAEMONDIED, "subletd died during loan %llu; kept data restored "
                        "from the save area: %s (of %s saved) copied back by this process. The "
                        "tensor is intact; a restarted subletd serves new work",
                        (unsigned long long)r->loan_id, sl_format_size(a, st.copied_in_bytes),
                        sl_format_size(b, st.copied_out_bytes));
}
