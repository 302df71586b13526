/* fuzz_status.c - fuzzes the status printer (client/status_json.c) with any Status message a
 * daemon could send: the input is a Status's encoding; one that unpacks must print as JSON
 * that jansson parses back (valid JSON, valid UTF-8), with every region and the loan in it.
 */
#include "fuzz.h"

#include <float.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status_json.h"

static void fail(const char *what, const char *text) {
  fprintf(stderr, "fuzz_status: %s: %s\n", what, text != NULL ? text : "(none)");
  abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  Sublet__Status *st = sublet__status__unpack(NULL, size, data);
  json_error_t e;
  json_t *parsed;
  char *text;

  if (st == NULL)
    return 0;
  text = sl_status_json(st);
  if (text == NULL)
    fail("no JSON", NULL);
  parsed = json_loads(text, 0, &e);
  if (parsed == NULL)
    fail(e.text, text);
  if (json_array_size(json_object_get(parsed, "regions")) != st->n_regions)
    fail("regions missing", text);
  if (json_is_null(json_object_get(parsed, "loan")) != (st->loan == NULL))
    fail("the loan wrong", text);
  json_decref(parsed);
  free(text);
  sublet__status__free_unpacked(st, NULL);
  return 0;
}

/* ------------------------------------------------------------------ seeds */

static size_t seed_idle(uint8_t *buf) {
  static uint8_t uuid[16] = {0x5a, 0x1e};
  Sublet__Status st = SUBLET__STATUS__INIT;

  st.daemon_version = "0.1.0";
  st.uptime_seconds = 12.5;
  st.backend = "memfd";
  st.device_uuid = (ProtobufCBinaryData){sizeof(uuid), uuid};
  st.device_name = "memfd";
  st.page_size = 2 << 20;
  st.total_bytes = 1 << 30;
  st.free_bytes = 1 << 30;
  return sublet__status__pack(&st, buf);
}

/* Two regions, a loan with a name that is not UTF-8 and odd characters, counts past 2^63. */
static size_t seed_odd_loan(uint8_t *buf) {
  static uint8_t uuid[16] = {0xff, 0xee, 0xdd};
  Sublet__RegionStatus r1 = SUBLET__REGION_STATUS__INIT, r2 = SUBLET__REGION_STATUS__INIT;
  Sublet__RegionStatus *regions[2] = {&r1, &r2};
  Sublet__LoanStats stats = SUBLET__LOAN_STATS__INIT;
  Sublet__LoanStatus loan = SUBLET__LOAN_STATUS__INIT;
  Sublet__Status st = SUBLET__STATUS__INIT;

  r1.region = 1;
  r1.owner_uid = UINT32_MAX;
  r1.pages = 3;
  r1.has_loan = 1;
  r1.loan = 9;
  r2.region = 2;
  r2.pages = UINT64_MAX;
  loan.loan = 9;
  loan.region = 1;
  loan.state = "active\n\"";
  loan.name = "kv\xff\xe2\x82\\\x01-\xf0\x9f\x99\x82";
  stats.has_copy_out_seconds = 1;
  stats.copy_out_seconds = 1e300;
  loan.stats = &stats;
  st.daemon_version = "0.1.0";
  st.uptime_seconds = -0.0;
  st.backend = "cuda";
  st.device_uuid = (ProtobufCBinaryData){sizeof(uuid), uuid};
  st.device_name = "NVIDIA H200 \xc0\xaf";
  st.page_size = 2 << 20;
  st.total_bytes = UINT64_MAX;
  st.n_regions = 2;
  st.regions = regions;
  st.loan = &loan;
  return sublet__status__pack(&st, buf);
}

/* Times next to DBL_MAX: 15 digits round them past it, a number no parser reads back (what
 * this target found, issue 25: they print as null now). */
static size_t seed_near_dbl_max(uint8_t *buf) {
  Sublet__LoanStats stats = SUBLET__LOAN_STATS__INIT;
  Sublet__LoanStatus loan = SUBLET__LOAN_STATUS__INIT;
  Sublet__Status st = SUBLET__STATUS__INIT;

  stats.has_copy_out_seconds = 1;
  stats.copy_out_seconds = -DBL_MAX;
  loan.loan = 3;
  loan.stats = &stats;
  st.daemon_version = "0.1.0";
  st.uptime_seconds = DBL_MAX;
  st.backend = "memfd";
  st.loan = &loan;
  return sublet__status__pack(&st, buf);
}

size_t sl_fuzz_seed(unsigned i, uint8_t *buf, size_t cap) {
  static const sl_fuzz_seed_fn seeds[] = {seed_idle, seed_odd_loan, seed_near_dbl_max};

  return sl_fuzz_seed_made(seeds, sizeof(seeds) / sizeof(seeds[0]), i, buf, cap);
}
