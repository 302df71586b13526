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

/* Packs and sends one message; fds (may be NULL) ride with it and stay the caller's. */
int sl_msg_send_request(int sock, const Sublet__Request *req, const int *fds, size_t nfds,
                        struct sl_err *err);
int sl_msg_send_reply(int sock, const Sublet__Reply *rep, const int *fds, size_t nfds,
                      struct sl_err *err);

/* Unpacked messages are freed with sublet__request__free_unpacked(m, NULL) (resp. reply). */
Sublet__Request *sl_msg_unpack_request(const uint8_t *payload, size_t len, struct sl_err *err);
Sublet__Reply *sl_msg_unpack_reply(const uint8_t *payload, size_t len, struct sl_err *err);

/* Converts between struct sublet_loan_stats and the LoanStats message (no allocation: the
 * message's fields point nowhere outside it). */
void sl_msg_stats_to_proto(const struct sublet_loan_stats *s, Sublet__LoanStats *m);
void sl_msg_stats_from_proto(const Sublet__LoanStats *m, struct sublet_loan_stats *s);

#endif
