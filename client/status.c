/* status.c - sublet_status_json: asks the daemon for its Status and gives it as JSON text
 * (status_json.c writes it).
 * Floor 2 (client.h's floors). */
#include <stdlib.h>

#include "client.h"
#include "status_json.h"

SUBLET_EXPORT int sublet_status_json(sublet_client *c, char **json) {
  Sublet__Reply *rep;
  int rc;

  pthread_mutex_lock(&c->lock);
  rc = sl_client_status(c, &rep);
  pthread_mutex_unlock(&c->lock);
  if (rc == 0 && (*json = sl_status_json(rep->status)) == NULL)
    rc = sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  return rc;
}

SUBLET_EXPORT void sublet_string_free(char *s) {
  free(s); /* status_json.c's text is malloc'ed */
}
