/* raw.h - clients that speak the protocol by hand, for tests of what a hostile or careless
 * client can do that libsublet never would: frames it builds, replies it does not read. */
#ifndef SL_TEST_RAW_H
#define SL_TEST_RAW_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "sublet.pb-c.h"
#include "wire.h"

/* A connected socket to the daemon, or -1. */
int sl_raw_connect(const char *path);
/* Sends Hello (id 1) and reads Welcome: 0, or -1. */
int sl_raw_hello(int fd, struct sl_wire_rx *rx);
/* Connects and says Hello, rx initialised (destroy it whatever the result): the fd, or -1. */
int sl_raw_open(const char *path, struct sl_wire_rx *rx);
/* Sends req with fds (they stay the caller's); 0 or a negative code. */
int sl_raw_send(int fd, const Sublet__Request *req, const int *fds, size_t nfds);
/* Reads one reply within timeout_ms, closing its fds; the reply (freed by the caller) or NULL. */
Sublet__Reply *sl_raw_reply(int fd, struct sl_wire_rx *rx, int timeout_ms);
/* Sends RegionCreate of size bytes and reads its reply: the region's id, or 0. */
uint64_t sl_raw_region(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t size);
/* In a child: becomes uid (its primary group the same number, no supplementary ones) and
 * dies with its parent still: 0 or -1. */
int sl_raw_become(uid_t uid);

#endif
