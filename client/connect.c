/* connect.c - libsublet: making a client and tearing it down, floor by floor from the top
 * (torch.c, the connection, borrow.c's windows, pool.c's arena, region.c's mappings,
 * client.c).
 * Floor 7 (client.h's floors). */
#include "client.h"

SUBLET_EXPORT int sublet_connect(const char *path, sublet_client **out) {
  return sl_client_open(path, out);
}

SUBLET_EXPORT void sublet_disconnect(sublet_client *c) {
  if (c == NULL)
    return;
  sl_watch_stop(c);
  sl_torch_forget(c);
  /* The socket closes before anything is unmapped: the daemon settles the books whatever state
   * this client leaves (regions freed; a loan it borrows ends once this process has exited). */
  sl_client_hang_up(c);
  sl_borrow_forget(c);
  sl_pool_forget(c);
  sl_region_forget_all(c);
  sl_client_free(c);
}
