/* lend_lists.c - a Lend's keep and pinned lists, taken over from the request for a draft off
 * the loop (daemon.h's struct sl_lend_lists): lends.c's Lend and releases.c's release share
 * them. Floor 3 (daemon.h's floors): calls daemon.c, the books and common/'s keepwire.c.
 */
#include <stdlib.h>
#include <unistd.h>

#include "daemon.h"
#include "keepwire.h"

void sl_lend_lists_take(struct sl_lend_lists *l, Sublet__Lend *m, int *keep_fd) {
  *l = (struct sl_lend_lists){.keep_fd = *keep_fd, .keep_all = m->keep_all,
                              .pinned = m->pinned, .npinned = m->n_pinned / 2};
  *keep_fd = -1;
  m->pinned = NULL;
  m->n_pinned = 0;
  if (l->keep_fd >= 0) { /* read in the job (sl_keepwire_read) */
    l->nkeep = m->keep_fd_ranges;
  } else {
    l->keep = m->keep;
    l->nkeep = m->n_keep / 2;
    m->keep = NULL;
    m->n_keep = 0;
  }
}

int sl_lend_lists_read(struct sl_lend_lists *l, struct sl_err *err) {
  if (l->keep_fd >= 0 && l->keep == NULL)
    return sl_keepwire_read(l->keep_fd, l->nkeep, &l->keep, err);
  return 0;
}

int sl_lend_lists_draft(struct sl_lend_lists *l, const struct sl_books_config *cfg,
                        uint64_t npages, struct sl_loan **draft, struct sl_err *err) {
  int rc = sl_lend_lists_read(l, err);

  if (rc != 0)
    return rc;
  return sl_books_draft(cfg, npages, (const struct sublet_range *)l->keep, l->nkeep,
                        l->keep_all, l->pinned, l->npinned, draft, err);
}

void sl_lend_lists_clear(struct sl_lend_lists *l) {
  if (l->keep_fd >= 0)
    close(l->keep_fd);
  free(l->keep);
  free(l->pinned);
  *l = (struct sl_lend_lists){.keep_fd = -1};
}

int sl_lend_lists_timeout(const Sublet__Lend *m) {
  return m->has_timeout_ms ? m->timeout_ms : 0;
}

int sl_lend_lists_check(Sublet__Lend *m, int keep_fd, char name[SL_LOAN_NAME_SIZE],
                        struct sl_err *err) {
  int rc;

  if ((rc = sl_daemon_loan_name(err, "a loan name", m->has_name, m->name, name)) != 0)
    return rc;
  if ((rc = sl_keepwire_decode(m, keep_fd, err)) != 0)
    return rc;
  if (m->n_pinned % 2 != 0)
    return sl_err_set(err, SUBLET_EINVAL, "Lend.pinned holds (first page, count) pairs: "
                      "an even count, not %zu", m->n_pinned);
  if (sl_lend_lists_timeout(m) < -1)
    return sl_err_set(err, SUBLET_EINVAL, "Lend.timeout_ms is 0 (at once), -1 (forever) "
                      "or milliseconds above 0, not %d", sl_lend_lists_timeout(m));
  return 0;
}
