/* raw.c - clients that speak the protocol by hand (raw.h). */
#include "raw.h"

#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "msg.h"

int sl_raw_connect(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path);
  if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
    if (fd >= 0)
      close(fd);
    return -1;
  }
  return fd;
}

int sl_raw_send(int fd, const Sublet__Request *req, const int *fds, size_t nfds) {
  return sl_msg_send_request(fd, req, fds, nfds, 5000, NULL);
}

Sublet__Reply *sl_raw_reply(int fd, struct sl_wire_rx *rx, int timeout_ms) {
  struct sl_frame_header h;
  const uint8_t *payload;
  int fds[SL_WIRE_MAX_FDS];

  if (sl_wire_recv(rx, fd, &h, &payload, fds, timeout_ms, NULL) != 0)
    return NULL;
  sl_wire_close_fds(fds, h.nfds);
  return sl_msg_unpack_reply(payload, h.length, NULL);
}

int sl_raw_hello(int fd, struct sl_wire_rx *rx) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__Hello hello = SUBLET__HELLO__INIT;
  Sublet__Reply *rep;
  int ok;

  hello.protocol = SUBLET_PROTOCOL_VERSION;
  req.id = 1;
  req.body_case = SUBLET__REQUEST__BODY_HELLO;
  req.hello = &hello;
  if (sl_raw_send(fd, &req, NULL, 0) != 0 || (rep = sl_raw_reply(fd, rx, 5000)) == NULL)
    return -1;
  ok = rep->body_case == SUBLET__REPLY__BODY_WELCOME;
  sublet__reply__free_unpacked(rep, NULL);
  return ok ? 0 : -1;
}

int sl_raw_open(const char *path, struct sl_wire_rx *rx) {
  int fd = sl_raw_connect(path);

  sl_wire_rx_init(rx);
  if (fd >= 0 && sl_raw_hello(fd, rx) != 0) {
    close(fd);
    fd = -1;
  }
  return fd;
}

uint64_t sl_raw_region(int fd, struct sl_wire_rx *rx, uint64_t id, uint64_t size) {
  Sublet__Request req = SUBLET__REQUEST__INIT;
  Sublet__RegionCreate rc = SUBLET__REGION_CREATE__INIT;
  Sublet__Reply *rep;
  uint64_t region = 0;

  rc.size = size;
  req.id = id;
  req.body_case = SUBLET__REQUEST__BODY_REGION_CREATE;
  req.region_create = &rc;
  if (sl_raw_send(fd, &req, NULL, 0) != 0 || (rep = sl_raw_reply(fd, rx, 5000)) == NULL)
    return 0;
  if (rep->body_case == SUBLET__REPLY__BODY_REGION_CREATED)
    region = rep->region_created->region;
  sublet__reply__free_unpacked(rep, NULL);
  return region;
}

int sl_raw_become(uid_t uid) {
  if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
    return -1;
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* a change of credentials cleared it */
  return 0;
}
