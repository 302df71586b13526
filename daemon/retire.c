/* retire.c - a region leaves: the clients that kept a window of it hear so (RegionGone), and
 * its pages are released once none of them holds them any more (books.h, kept windows).
 *
 * Until then the pool keeps the region's pages too, so that the device memory they take stays
 * counted (free memory, Status.held) on every backend: on a GPU the pages a borrower imported
 * stay allocated while it holds them whatever the daemon does.
 */
#include "daemon.h"
#include "log.h"

static void send_gone(struct sl_conn *c, uint64_t region_id) {
  Sublet__Reply rep = SUBLET__REPLY__INIT;
  Sublet__RegionGone g = SUBLET__REGION_GONE__INIT;

  g.region = region_id;
  rep.id = 0; /* a notice, never an answer (PROTOCOL.md, Notices) */
  rep.body_case = SUBLET__REPLY__BODY_REGION_GONE;
  rep.region_gone = &g;
  sl_conn_send(c, &rep, NULL, 0);
}

void sl_retire_region(struct sl_daemon *d, uint64_t region_id) {
  size_t told = 0;

  if (sl_books_kept_holders(d->books, region_id) == 0) {
    sl_pool_region_destroy(d->pool, region_id);
    return;
  }
  for (struct sl_conn *c = d->conns; c != NULL; c = c->next) {
    if (c->client_id == 0 || !sl_books_kept_holds(d->books, c->client_id, region_id))
      continue;
    send_gone(c, region_id);
    told++;
  }
  sl_info("region %llu gone: its pages go once %zu client(s) that kept its window let go",
          (unsigned long long)region_id, told);
}
