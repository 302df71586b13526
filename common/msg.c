/* msg.c - packing protocol messages into frames and unpacking them. Floor 3 (floors.h). */
#include "msg.h"

#include <stdlib.h>

#include "wire.h"

int sl_msg_pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len, struct sl_err *err) {
  *len = protobuf_c_message_get_packed_size(m);
  *buf = NULL;
  if (*len > SL_WIRE_MAX_PAYLOAD)
    return sl_err_set(err, SUBLET_E2BIG,
                      "message of %zu bytes exceeds the protocol's %u-byte limit; "
                      "split the request (e.g. fewer kept ranges: merge neighbouring views)",
                      *len, SL_WIRE_MAX_PAYLOAD);
  *buf = malloc(*len ? *len : 1);
  if (*buf == NULL)
    return sl_err_set(err, SUBLET_ENOHOSTMEM, "out of host memory packing a message");
  protobuf_c_message_pack(m, *buf);
  return 0;
}

int sl_msg_send_request(int sock, const Sublet__Request *req, const int *fds, size_t nfds,
                        int timeout_ms, struct sl_err *err) {
  uint8_t *buf;
  size_t len;
  int rc = sl_msg_pack(&req->base, &buf, &len, err);

  if (rc == 0)
    rc = sl_wire_send(sock, SL_WIRE_REQUEST, buf, len, fds, nfds, timeout_ms, err);
  free(buf);
  return rc;
}
Sublet__Request *sl_msg_unpack_request(const uint8_t *payload, size_t len, struct sl_err *err) {
  Sublet__Request *m = sublet__request__unpack(NULL, len, payload);

  if (m == NULL)
    sl_err_set(err, SUBLET_EPROTO, "malformed request: not a sublet.Request message");
  return m;
}

Sublet__Reply *sl_msg_unpack_reply(const uint8_t *payload, size_t len, struct sl_err *err) {
  Sublet__Reply *m = sublet__reply__unpack(NULL, len, payload);

  if (m == NULL)
    sl_err_set(err, SUBLET_EPROTO, "malformed reply from subletd: not a sublet.Reply message");
  return m;
}

void sl_msg_stats_to_proto(const struct sublet_loan_stats *s, Sublet__LoanStats *m) {
  sublet__loan_stats__init(m);
  m->loan = s->loan_id;
  m->has_copied_out_bytes = m->has_copied_in_bytes = 1;
  m->copied_out_bytes = s->copied_out_bytes;
  m->copied_in_bytes = s->copied_in_bytes;
  m->has_served_unkept_bytes = m->has_served_fresh_bytes = m->has_served_kept_bytes = 1;
  m->served_unkept_bytes = s->served_unkept_bytes;
  m->served_fresh_bytes = s->served_fresh_bytes;
  m->served_kept_bytes = s->served_kept_bytes;
  m->has_peak_bytes = m->has_allocations = 1;
  m->peak_bytes = s->peak_bytes;
  m->allocations = s->allocations;
  m->has_copy_out_seconds = m->has_copy_in_seconds = 1;
  m->copy_out_seconds = s->copy_out_seconds;
  m->copy_in_seconds = s->copy_in_seconds;
  m->has_borrower_died = m->has_owner_gone = 1;
  m->borrower_died = s->borrower_died != 0;
  m->owner_gone = s->owner_gone != 0;
  m->has_moved_bytes = m->has_move_seconds = 1;
  m->moved_bytes = s->moved_bytes;
  m->move_seconds = s->move_seconds;
  m->has_replaced_pages = 1;
  m->replaced_pages = s->replaced_pages;
}

void sl_msg_stats_from_proto(const Sublet__LoanStats *m, struct sublet_loan_stats *s) {
  s->loan_id = m->loan;
  s->copied_out_bytes = m->copied_out_bytes;
  s->copied_in_bytes = m->copied_in_bytes;
  s->served_unkept_bytes = m->served_unkept_bytes;
  s->served_fresh_bytes = m->served_fresh_bytes;
  s->served_kept_bytes = m->served_kept_bytes;
  s->peak_bytes = m->peak_bytes;
  s->allocations = m->allocations;
  s->copy_out_seconds = m->copy_out_seconds;
  s->copy_in_seconds = m->copy_in_seconds;
  s->borrower_died = m->borrower_died;
  s->owner_gone = m->owner_gone;
  s->moved_bytes = m->moved_bytes;
  s->move_seconds = m->move_seconds;
  s->replaced_pages = m->replaced_pages;
}
