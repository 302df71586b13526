/* proxy.h - a subletd as an older one looks to libsublet: a process between the clients and a
 * real subletd that passes every frame and its fds on, and edits each Welcome on its way to a
 * client (a capability taken out, as a daemon older than the library would leave it). */
#ifndef SL_TEST_PROXY_H
#define SL_TEST_PROXY_H

#include <sys/types.h>

#include "sublet.pb-c.h"

struct sl_test_proxy {
  pid_t pid;
  char socket[108];
};

/* Starts the proxy (a child that dies with this process) listening at socket, forwarding to
 * the daemon at daemon_socket, edit applied to each Welcome (NULL: none); waits until it
 * listens. 0, or -1. */
int sl_test_proxy_start(struct sl_test_proxy *p, const char *socket, const char *daemon_socket,
                        void (*edit)(Sublet__Welcome *w));
/* Kills and reaps it (its connections close: the daemon sees its clients go). */
void sl_test_proxy_stop(struct sl_test_proxy *p);

#endif
