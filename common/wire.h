/* wire.h - frames over a Unix stream socket, with file descriptors beside them.
 *
 * A frame is a 16-byte header followed by a protobuf-c payload (proto/sublet.proto):
 *
 *   offset 0  u32  magic    0x534c4254, little-endian (bytes 54 42 4c 53 on the wire)
 *          4  u16  version  SUBLET_PROTOCOL_VERSION
 *          6  u16  kind     1 = request (client to daemon), 2 = reply (daemon to client)
 *          8  u32  length   payload bytes, at most SL_WIRE_MAX_PAYLOAD
 *         12  u32  nfds     fds sent with this frame, at most SL_WIRE_MAX_FDS
 *
 * A frame's fds travel with SCM_RIGHTS in the same sendmsg as its first byte. The receiver
 * queues the fds it receives (always with MSG_CMSG_CLOEXEC) and hands each frame the next
 * nfds of them; fewer queued than the header says, more left over once the stream is between
 * frames, MSG_CTRUNC, or a header out of bounds are protocol errors, after which the
 * connection is closed. proto/PROTOCOL.md is the spec.
 */
#ifndef SL_WIRE_H
#define SL_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define SL_WIRE_MAGIC 0x534c4254u
#define SL_WIRE_HEADER 16
#define SL_WIRE_MAX_PAYLOAD (32u << 20)
#define SL_WIRE_MAX_FDS 253
#define SL_WIRE_REQUEST 1
#define SL_WIRE_REPLY 2

struct sl_frame_header {
  uint32_t magic;
  uint16_t version;
  uint16_t kind;
  uint32_t length;
  uint32_t nfds;
};

void sl_wire_header_encode(const struct sl_frame_header *h, uint8_t out[SL_WIRE_HEADER]);
/* Decodes and checks bounds (magic, kind, length, nfds); a version other than ours is left to
 * the caller, which answers it with a typed error. */
int sl_wire_header_decode(const uint8_t in[SL_WIRE_HEADER], struct sl_frame_header *h,
                          struct sl_err *err);

/* A frame on its way out, written by as many sendmsg calls as the socket needs; its fds ride
 * the call that writes its first byte. Payload and fds stay the caller's until it is done. */
struct sl_wire_out {
  uint8_t head[SL_WIRE_HEADER];
  const uint8_t *payload;
  size_t len;
  size_t done;               /* bytes of header + payload written */
  const int *fds;
  size_t nfds;
};

/* sl_wire_out_write's results besides errors. */
#define SL_WIRE_OUT_DONE 1   /* the whole frame is written */
#define SL_WIRE_OUT_AGAIN 0  /* the socket is full: wait until it is writable */
#define SL_WIRE_OUT_REFS 2   /* the kernel's limit on fds in flight (ETOOMANYREFS) is reached:
                                nothing was written; try again once peers have taken theirs */

/* Checks the bounds (E2BIG, EINVAL) and prepares the header. */
int sl_wire_out_init(struct sl_wire_out *o, uint16_t kind, const void *payload, size_t len,
                     const int *fds, size_t nfds, struct sl_err *err);
/* One non-blocking step: writes what the socket takes. Returns SL_WIRE_OUT_*, or SUBLET_EPIPE
 * (the peer is gone) / SUBLET_EIO. Never waits. */
int sl_wire_out_write(struct sl_wire_out *o, int sock, struct sl_err *err);

/* One frame, sent whole, blocking: waits (poll) while the socket is full, for at most
 * timeout_ms in all (< 0: no limit), then SUBLET_ETIMEDOUT. The fds stay the caller's. For
 * clients; the daemon never blocks (daemon/transport.c queues). */
int sl_wire_send(int sock, uint16_t kind, const void *payload, size_t len, const int *fds,
                 size_t nfds, int timeout_ms, struct sl_err *err);

/* Incremental receiver, for non-blocking sockets (the daemon) and blocking ones (clients). */
struct sl_wire_rx {
  uint8_t *buf;      /* bytes received and not yet consumed */
  size_t len, cap;
  size_t off;        /* bytes at the front of buf already handed out in frames: dropped at the
                        next read, so that a payload stays valid until then */
  int *fds;          /* fds received and not yet handed to a frame; the receiver owns them */
  size_t nfds, fdcap;
};

void sl_wire_rx_init(struct sl_wire_rx *rx);
/* Closes queued fds, frees buffers. */
void sl_wire_rx_destroy(struct sl_wire_rx *rx);
/* One recvmsg into the buffer. Returns bytes read (> 0), 0 at EOF, -EAGAIN when nothing is
 * there (non-blocking), or a negative SUBLET_E* code. Take the buffered frames with
 * sl_wire_rx_next (until it returns 0) between reads: the buffer holds at most one frame of
 * the largest size. */
int sl_wire_rx_read(struct sl_wire_rx *rx, int sock, struct sl_err *err);
/* Takes the next complete frame out of the buffer, if any: returns 1 and sets *h, *payload
 * (valid until the next rx call) and fds (owned by the caller now, h->nfds of them, at most
 * SL_WIRE_MAX_FDS); 0 when no whole frame is buffered yet; a negative code on a protocol
 * error. */
int sl_wire_rx_next(struct sl_wire_rx *rx, struct sl_frame_header *h, const uint8_t **payload,
                    int *fds, struct sl_err *err);
/* Gives back a buffer grown past 1 MiB by a large frame once every frame in it has been handed
 * out (their payloads are invalid after). For a receiver that holds many connections: what
 * one large request took is not held until that connection reads again. */
void sl_wire_rx_trim(struct sl_wire_rx *rx);
/* Blocking convenience for clients: reads until one whole frame is there. Returns 0 with the
 * frame as sl_wire_rx_next gives it; SUBLET_ETIMEDOUT after timeout_ms (< 0: no limit);
 * SUBLET_EPIPE at EOF. */
int sl_wire_recv(struct sl_wire_rx *rx, int sock, struct sl_frame_header *h,
                 const uint8_t **payload, int *fds, int timeout_ms, struct sl_err *err);

/* Closes n fds (those of a frame the caller will not use); skips and leaves -1 in each. */
void sl_wire_close_fds(int *fds, size_t n);

#endif
