/* proxy.h - a subletd as an older one looks to libsublet: a process between the clients and a
 * real subletd that passes every frame and its fds on, and edits each Welcome on its way to a
 * client (a capability taken out, as a daemon older than the library would leave it).
 *
 * Not byte for byte: each frame goes on stamped with this build's protocol version, and the
 * daemon sees the proxy's pid (SO_PEERCRED) for every client behind it, so what the daemon
 * does by a peer's pid (a borrower's exit, an offer's owner) is not for tests through it. */
#ifndef SL_TEST_PROXY_H
#define SL_TEST_PROXY_H

#include <sys/types.h>

#include "sublet.pb-c.h"

struct sl_proxy {
  pid_t pid;
  char socket[108];
};

/* Starts the proxy (a child that dies with this process) listening at socket, forwarding to
 * the daemon at daemon_socket, edit applied to each Welcome (NULL: none); waits until it
 * listens. 0, or -1. */
int sl_proxy_start(struct sl_proxy *p, const char *socket, const char *daemon_socket,
                        void (*edit)(Sublet__Welcome *w));
/* Kills and reaps it (its connections close: the daemon sees its clients go); nothing for a
 * proxy that did not start. */
void sl_proxy_stop(struct sl_proxy *p);

#endif
