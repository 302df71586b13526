/* consumer.c - a C user of the installed libsublet: connects to the daemon at argv[1] and
 * prints what it says about itself. Built by tests/check-install with pkg-config and with
 * CMake's find_package, against the installed tree only. */
#include <stdio.h>
#include <sublet.h>

int main(int argc, char **argv) {
  struct sublet_info info;
  sublet_client *c;
  int rc;

  if (argc != 2) {
    fprintf(stderr, "usage: consumer SOCKET\n");
    return 2;
  }
  if ((rc = sublet_connect(argv[1], &c)) != 0 || (rc = sublet_get_info(c, &info)) != 0) {
    fprintf(stderr, "consumer: %s\n", sublet_last_error());
    return 1;
  }
  printf("libsublet %s, subletd %s, %s backend\n", sublet_version(), info.daemon_version,
         info.backend);
  sublet_disconnect(c);
  return 0;
}
