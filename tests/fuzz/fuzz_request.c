/* fuzz_request.c - fuzzes the decoding of the protocol's messages (proto/sublet.proto) as the
 * daemon and the client do it: the input is a frame's payload, unpacked as a Request and as a
 * Reply. A message that parses is walked field by field (only the oneof member that is set),
 * packed again, then freed. A Lend's keep list is decoded too, as subletd decodes it
 * (common/keepwire.c), before the walk: what the decoder leaves must still be a message.
 */
#include "fuzz.h"

#include <stdlib.h>
#include <string.h>

#include "keepwire.h"
#include "sublet.pb-c.h"

static uint64_t walk_message(const ProtobufCMessage *m, int depth);

static size_t scalar_size(ProtobufCType type) {
  switch (type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
      return 8;
    case PROTOBUF_C_TYPE_BOOL:
      return sizeof(protobuf_c_boolean);
    default:
      return 4;
  }
}

static size_t element_size(ProtobufCType type) {
  if (type == PROTOBUF_C_TYPE_STRING || type == PROTOBUF_C_TYPE_MESSAGE)
    return sizeof(void *);
  if (type == PROTOBUF_C_TYPE_BYTES)
    return sizeof(ProtobufCBinaryData);
  return scalar_size(type);
}

/* Reads one value wholly, so that the sanitizers see any byte that is not the message's. */
static uint64_t walk_value(const ProtobufCFieldDescriptor *f, const void *p, int depth) {
  const uint8_t *bytes = p;
  size_t len = scalar_size(f->type);
  uint64_t sum = 0;

  if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
    const ProtobufCMessage *sub = *(ProtobufCMessage *const *)p;
    return sub != NULL ? walk_message(sub, depth + 1) : 0;
  }
  if (f->type == PROTOBUF_C_TYPE_STRING) {
    bytes = *(const uint8_t *const *)p;
    len = bytes != NULL ? strlen((const char *)bytes) : 0;
  } else if (f->type == PROTOBUF_C_TYPE_BYTES) {
    bytes = ((const ProtobufCBinaryData *)p)->data;
    len = ((const ProtobufCBinaryData *)p)->len;
  }
  for (size_t i = 0; i < len; i++)
    sum += bytes[i];
  return sum;
}

static uint64_t walk_field(const ProtobufCMessage *m, const ProtobufCFieldDescriptor *f,
                           int depth) {
  const uint8_t *base = (const uint8_t *)m;
  uint64_t sum = 0;

  /* A oneof's members share storage: only the one its case names may be read. */
  if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
      *(const uint32_t *)(base + f->quantifier_offset) != f->id)
    return 0;
  if (f->label != PROTOBUF_C_LABEL_REPEATED)
    return walk_value(f, base + f->offset, depth);
  size_t n = *(const size_t *)(base + f->quantifier_offset);
  const uint8_t *array = *(const uint8_t *const *)(base + f->offset);
  for (size_t i = 0; i < n; i++)
    sum += walk_value(f, array + i * element_size(f->type), depth);
  return sum;
}

static uint64_t walk_message(const ProtobufCMessage *m, int depth) {
  uint64_t sum = 0;

  if (depth > 16)
    abort(); /* sublet's messages nest three deep at most */
  for (unsigned i = 0; i < m->descriptor->n_fields; i++)
    sum += walk_field(m, &m->descriptor->fields[i], depth);
  return sum;
}

/* What is decoded must encode to the size it announces. (Decoding the result again is not
 * checked: protobuf-c 1.4 accepts field number 0 written as a long varint, keeps it as an
 * unknown field and writes it back in the short form, which it then rejects. Harmless here:
 * unknown fields are ignored.) */
static void repack(const ProtobufCMessage *m) {
  size_t size = protobuf_c_message_get_packed_size(m);
  uint8_t *buf = malloc(size + 1);

  if (protobuf_c_message_pack(m, buf) != size)
    abort();
  free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  volatile uint64_t sink = 0;
  Sublet__Request *req = sublet__request__unpack(NULL, size, data);
  Sublet__Reply *rep = sublet__reply__unpack(NULL, size, data);

  if (req != NULL && req->body_case == SUBLET__REQUEST__BODY_LEND)
    sink += (uint64_t)sl_keepwire_decode(req->lend, -1, NULL);
  if (req != NULL) {
    sink += walk_message(&req->base, 0);
    repack(&req->base);
    sublet__request__free_unpacked(req, NULL);
  }
  if (rep != NULL) {
    sink += walk_message(&rep->base, 0);
    repack(&rep->base);
    sublet__reply__free_unpacked(rep, NULL);
  }
  (void)sink;
  return 0;
}

/* ------------------------------------------------------------------ seeds */

/* A Lend of region 3 keeping four ranges, packed as varints (a named offer) or as the 16-byte
 * pairs of keep_ranges (a local lend). */
static size_t lend_seed(uint8_t *buf, int as_bytes) {
  static uint64_t keep[] = {0, 4096, 1 << 21, 65536};
  Sublet__Lend lend = SUBLET__LEND__INIT;
  Sublet__Request req = SUBLET__REQUEST__INIT;

  lend.region = 3;
  if (as_bytes) {
    lend.has_keep_ranges = 1;
    lend.keep_ranges = (ProtobufCBinaryData){sizeof(keep), (uint8_t *)keep};
    lend.has_local = lend.local = 1;
  } else {
    lend.n_keep = 4;
    lend.keep = keep;
    lend.has_name = 1;
    lend.name.data = (uint8_t *)"kv-cache";
    lend.name.len = 8;
  }
  req.id = 7;
  req.body_case = SUBLET__REQUEST__BODY_LEND;
  req.lend = &lend;
  return sublet__request__pack(&req, buf);
}

static size_t seed_lend(uint8_t *buf) {
  return lend_seed(buf, 0);
}

static size_t seed_lend_ranges(uint8_t *buf) {
  return lend_seed(buf, 1);
}

static size_t seed_borrow(uint8_t *buf) {
  static uint8_t token[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  Sublet__Borrow borrow = SUBLET__BORROW__INIT;
  Sublet__Request req = SUBLET__REQUEST__INIT;

  borrow.has_loan = 1;
  borrow.loan = 9;
  borrow.has_token = 1;
  borrow.token = (ProtobufCBinaryData){sizeof(token), token};
  borrow.has_timeout_ms = 1;
  borrow.timeout_ms = -1;
  req.id = 8;
  req.body_case = SUBLET__REQUEST__BODY_BORROW;
  req.borrow = &borrow;
  return sublet__request__pack(&req, buf);
}

static size_t seed_error(uint8_t *buf) {
  Sublet__Leak leak = SUBLET__LEAK__INIT, *leaks[2] = {&leak, &leak};
  Sublet__LoanStats stats = SUBLET__LOAN_STATS__INIT;
  Sublet__Error error = SUBLET__ERROR__INIT;
  Sublet__Reply rep = SUBLET__REPLY__INIT;

  leak.alloc = 4;
  leak.size = 1 << 21;
  stats.loan = 9;
  stats.has_copied_out_bytes = 1;
  stats.copied_out_bytes = 12345;
  error.code = -4001;
  error.message = "2 allocations still alive at the end of the loan";
  error.n_leaks = 2;
  error.leaks = leaks;
  error.stats = &stats;
  rep.id = 11;
  rep.body_case = SUBLET__REPLY__BODY_ERROR;
  rep.error = &error;
  return sublet__reply__pack(&rep, buf);
}

static size_t seed_status(uint8_t *buf) {
  static uint8_t uuid[16] = {0xaa, 0xbb};
  Sublet__RegionStatus region = SUBLET__REGION_STATUS__INIT, *regions[1] = {&region};
  Sublet__LoanStats stats = SUBLET__LOAN_STATS__INIT;
  Sublet__LoanStatus loan = SUBLET__LOAN_STATUS__INIT;
  Sublet__Status status = SUBLET__STATUS__INIT;
  Sublet__Reply rep = SUBLET__REPLY__INIT;

  region.region = 3;
  region.pages = 512;
  loan.loan = 9;
  loan.state = "active";
  loan.stats = &stats;
  status.daemon_version = "0.1.0";
  status.backend = "memfd";
  status.device_uuid = (ProtobufCBinaryData){sizeof(uuid), uuid};
  status.device_name = "memfd";
  status.n_regions = 1;
  status.regions = regions;
  status.loan = &loan;
  rep.id = 12;
  rep.body_case = SUBLET__REPLY__BODY_STATUS;
  rep.status = &status;
  return sublet__reply__pack(&rep, buf);
}

static size_t seed_borrowed(uint8_t *buf) {
  static uint64_t layout[] = {0, 2, 4, 6, 1, 3};
  Sublet__Borrowed borrowed = SUBLET__BORROWED__INIT;
  Sublet__Reply rep = SUBLET__REPLY__INIT;

  borrowed.loan = 9;
  borrowed.region = 3;
  borrowed.region_pages = 6;
  borrowed.page_size = 1 << 21;
  borrowed.unkept_pages = 4;
  borrowed.kept_pages = 2;
  borrowed.n_layout = 6;
  borrowed.layout = layout;
  rep.id = 13;
  rep.body_case = SUBLET__REPLY__BODY_BORROWED;
  rep.borrowed = &borrowed;
  return sublet__reply__pack(&rep, buf);
}

size_t sl_fuzz_seed(unsigned i, uint8_t *buf, size_t cap) {
  static const sl_fuzz_seed_fn seeds[] = {seed_lend, seed_lend_ranges, seed_borrow, seed_error, seed_status,
                                          seed_borrowed};

  return sl_fuzz_seed_made(seeds, sizeof(seeds) / sizeof(seeds[0]), i, buf, cap);
}
