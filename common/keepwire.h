/* keepwire.h - a Lend's keep list on the wire: its three forms, their limits, the client's
 * encoder and subletd's decoder, in one place so that both sides agree on every bound.
 *
 * The forms (PROTOCOL.md, Lend): keep, varint (offset, length) pairs, which any subletd reads;
 * keep_ranges, the pairs as 16 little-endian bytes a range (Welcome.keep_ranges), a copy to
 * take rather than varints to decode; keep_fd_ranges, a count of such ranges at the start of
 * a memfd sent with the frame (Welcome.keep_fd), for long lists that would cost the socket
 * milliseconds. The sender picks one; the receiver refuses a Lend that mixes them.
 */
#ifndef SL_KEEPWIRE_H
#define SL_KEEPWIRE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "sublet.pb-c.h"
#include "wire.h"

/* One range in keep_ranges and in the memfd: offset, then length, each a little-endian u64. */
#define SL_KEEPWIRE_RANGE_BYTES 16
/* Keep lists of more ranges than this are long: the client library sends one in a memfd when
 * subletd reads them so (through the socket, a long list holds the Lend milliseconds on the
 * loop: docs/benchmarks.md), and subletd drafts its loan off the loop. */
#define SL_KEEPWIRE_SHORT_RANGES 65536
/* The most ranges a keep memfd may hold (Lend.keep_fd_ranges, PROTOCOL.md): 64 MiB, what
 * subletd reads of it into its own memory. Longer lists go through the socket, within the
 * frame limit. A 141 GiB GPU of 64 KiB blocks, every other one kept, is 1.1 million ranges. */
#define SL_KEEPWIRE_FD_MAX_RANGES (1ull << 22)
/* The most ranges sent as keep_ranges: half a frame. Past it varints go instead, which take a
 * third of the room. */
#define SL_KEEPWIRE_BYTES_MAX_RANGES (SL_WIRE_MAX_PAYLOAD / 2 / SL_KEEPWIRE_RANGE_BYTES)

enum sl_keepwire_form {
  SL_KEEPWIRE_NONE,    /* nothing kept, or keep_all */
  SL_KEEPWIRE_VARINTS, /* Lend.keep */
  SL_KEEPWIRE_BYTES,   /* Lend.keep_ranges */
  SL_KEEPWIRE_FD,      /* Lend.keep_fd_ranges and a memfd */
};

/* A sender's side: what its subletd reads (Welcome) and the memfd it reuses from Lend to Lend
 * (its pages are there already). */
struct sl_keepwire_tx {
  int bytes_ok;    /* Welcome.keep_ranges */
  int fd_ok;       /* Welcome.keep_fd */
  int fd;          /* the keep memfd, made at the first long list; owned, -1: none */
  size_t fd_bytes; /* its size */
};

void sl_keepwire_tx_init(struct sl_keepwire_tx *tx);
void sl_keepwire_tx_destroy(struct sl_keepwire_tx *tx);

/* The form n ranges go in, by what the receiver reads and how long the list is. */
enum sl_keepwire_form sl_keepwire_form(size_t n, int keep_all, int bytes_ok, int fd_ok);

/* Sets m's keep fields (keep_all too) to keep[0..n) in the best form tx's subletd reads.
 * m points into keep: send it before keep changes. *fd: the memfd to send with the frame
 * (tx's, which stays tx's), or -1. A memfd that cannot be made or written (no memory, no fd
 * left) sends the list through the socket instead. */
void sl_keepwire_encode(struct sl_keepwire_tx *tx, Sublet__Lend *m,
                        const struct sublet_range *keep, size_t n, int keep_all, int *fd);

/* Checks a received Lend's keep fields and the fd that came with it (-1: none) and leaves one
 * form: the pairs in m->keep (keep_ranges taken over, no copy), or keep_fd_ranges with fd.
 * Returns 0, or SUBLET_EINVAL / SUBLET_EPROTO with err saying what was wrong. */
int sl_keepwire_decode(Sublet__Lend *m, int fd, struct sl_err *err);

/* Whether a decoded Lend's list is long: its draft then runs off subletd's loop. */
int sl_keepwire_is_long(const Sublet__Lend *m, int fd);

/* Reads n ranges from the start of a keep memfd into *out (malloc'd, 2n host-order u64):
 * the sender could change the memfd meanwhile, and the reader must check what it uses. */
int sl_keepwire_read(int fd, size_t n, uint64_t **out, struct sl_err *err);

#endif
