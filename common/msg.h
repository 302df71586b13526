/* msg.h - the protocol's messages (proto/sublet.proto) packed into frames and back.
 *
 * Thin glue between protobuf-c and wire.h, shared by subletd and the client library so that
 * both sides pack, bound and unpack messages the same way.
 */
#ifndef SL_MSG_H
#define SL_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "sublet.pb-c.h"

/* Packs a message into a new buffer (*buf, freed by the caller), within the frame limit. */
int sl_msg_pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len, struct sl_err *err);
/* Packs and sends a request with fds[0..nfds) (only a Lend's keep memfd: PROTOCOL.md; they
 * stay the caller's), blocking for at most timeout_ms (< 0: no limit). */
int sl_msg_send_request(int sock, const Sublet__Request *req, const int *fds, size_t nfds,
                        int timeout_ms, struct sl_err *err);

/* Unpacked messages are freed with sublet__request__free_unpacked(m, NULL) (resp. reply). */
Sublet__Request *sl_msg_unpack_request(const uint8_t *payload, size_t len, struct sl_err *err);
Sublet__Reply *sl_msg_unpack_reply(const uint8_t *payload, size_t len, struct sl_err *err);

/* Converts between struct sublet_loan_stats and the LoanStats message (no allocation: the
 * message's fields point nowhere outside it). */
void sl_msg_stats_to_proto(const struct sublet_loan_stats *s, Sublet__LoanStats *m);
void sl_msg_stats_from_proto(const Sublet__LoanStats *m, struct sublet_loan_stats *s);

#endif
