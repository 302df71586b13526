/* test_status_json.c - the status printer (client/status_json.c): the exact text of
 * `sublet status --json` for a daemon's Status, and valid JSON whatever the message holds
 * (text that is not UTF-8, quotes and control characters, counts and times that JSON's
 * integers cannot hold), and NULL without a leak when memory runs out. Each output is also
 * parsed back with jansson, which refuses invalid JSON and invalid UTF-8.
 */
#include <float.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "status_json.h"

#define CHECK_TEXT(got, want)                                                       \
  do {                                                                              \
    CHECK((got) != NULL && strcmp((got), (want)) == 0);                             \
    if ((got) == NULL || strcmp((got), (want)) != 0)                                \
      fprintf(stderr, "  got:  %s\n  want: %s\n", (got) ? (got) : "(null)", (want)); \
  } while (0)

/* A daemon with one idle region and nothing else: every field at a plain value. */
struct fixture {
  Sublet__Status st;
  Sublet__RegionStatus region, *regions[2];
  Sublet__LoanStatus loan;
  Sublet__LoanStats stats;
};

static uint8_t uuid[16] = {0x5a, 0x1e, 0x7b, 0x00, 0x12, 0x34, 0x56, 0x78,
                           0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67};

static void fixture_init(struct fixture *f) {
  *f = (struct fixture){.st = SUBLET__STATUS__INIT, .region = SUBLET__REGION_STATUS__INIT,
                        .loan = SUBLET__LOAN_STATUS__INIT, .stats = SUBLET__LOAN_STATS__INIT};
  f->st.daemon_version = "0.1.0";
  f->st.uptime_seconds = 12.3456;
  f->st.backend = "memfd";
  f->st.device_uuid = (ProtobufCBinaryData){sizeof(uuid), uuid};
  f->st.device_name = "memfd";
  f->st.page_size = 2 << 20;
  f->st.total_bytes = 1 << 30;
  f->st.free_bytes = 1 << 29;
  f->st.clients = 2;
  f->st.has_borrows_waiting = 1;
  f->st.borrows_waiting = 1; /* a borrower waiting for an offer */
  f->region.region = 1;
  f->region.owner_pid = 4242;
  f->region.owner_uid = 1000;
  f->region.pages = 3;
  f->regions[0] = &f->region;
  f->st.regions = f->regions;
  f->st.n_regions = 1;
  f->st.loans_ended = 7;
  f->st.borrowers_died = 1;
  f->st.copied_out_bytes = 4096;
  f->st.copied_in_bytes = 4096;
  f->loan.stats = &f->stats;
}

/* The fixture with a loan in progress, every field of it set. */
static void fixture_lend(struct fixture *f) {
  f->region.has_loan = 1;
  f->region.loan = 9;
  f->loan.loan = 9;
  f->loan.region = 1;
  f->loan.state = "active";
  f->loan.name = "kv-cache";
  f->loan.has_borrower_pid = f->loan.has_borrower_uid = 1;
  f->loan.borrower_pid = 4343;
  f->loan.borrower_uid = 1001;
  f->loan.unkept_pages = 2;
  f->loan.kept_pages = 1;
  f->loan.live_bytes = 1 << 20;
  f->loan.has_local = f->loan.local = 1;
  f->stats.copied_out_bytes = 2 << 20;
  f->stats.peak_bytes = 4 << 20;
  f->stats.allocations = 5;
  f->stats.copy_out_seconds = 0.0012344;
  f->st.loan = &f->loan;
}

/* The printed text, NULL if it is not valid JSON (jansson refuses invalid UTF-8 too). */
static char *print_checked(const Sublet__Status *st, json_t **parsed) {
  char *text = sl_status_json(st);
  json_error_t e;

  *parsed = text != NULL ? json_loads(text, 0, &e) : NULL;
  if (text != NULL && *parsed == NULL) {
    fprintf(stderr, "  not JSON (%s): %s\n", e.text, text);
    free(text);
    return NULL;
  }
  return text;
}

static const char *loan_string(json_t *parsed, const char *key) {
  return json_string_value(json_object_get(json_object_get(parsed, "loan"), key));
}

/* ------------------------------------------------------------------ the text */

static void test_idle_daemon(void) {
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  text = print_checked(&f.st, &parsed);
  CHECK_TEXT(text, "{\"daemon_version\": \"0.1.0\", \"uptime_seconds\": 12.346, "
      "\"backend\": \"memfd\", \"device_uuid\": \"GPU-5a1e7b00-1234-5678-9abc-def001234567\", "
      "\"device_name\": \"memfd\", \"device_ordinal\": 0, \"page_size\": 2097152, "
      "\"total_bytes\": 1073741824, \"free_bytes\": 536870912, \"host_bytes\": 0, "
      "\"clients\": 2, \"lends_waiting\": 0, \"regions\": [{\"id\": 1, \"owner_pid\": 4242, "
      "\"owner_uid\": 1000, \"pages\": 3, \"bytes\": 6291456, \"loan\": 0, "
      "\"released_bytes\": 0}], \"held\": [], \"loan\": null, \"releases\": [], "
      "\"retained\": [], \"totals\": {\"loans_ended\": 7, \"borrowers_died\": 1, "
      "\"copied_out_bytes\": 4096, "
      "\"copied_in_bytes\": 4096, \"served_unkept_bytes\": 0, \"served_fresh_bytes\": 0, "
      "\"served_kept_bytes\": 0, \"replaced_bytes\": 0}, \"release_offers\": [], \"pin\": null, "
      "\"borrows_waiting\": 1}");
  free(text);
  json_decref(parsed);
}

/* Old pages a borrower of another user may still hold, after fresh pages replaced them. */
static void test_retained(void) {
  Sublet__RetainedStatus held = SUBLET__RETAINED_STATUS__INIT, *list[1] = {&held};
  struct fixture f;
  json_t *parsed, *r;
  char *text;

  fixture_init(&f);
  held.pid = 4343;
  held.uid = 3000;
  held.bytes = 6 << 20;
  f.st.retained = list;
  f.st.n_retained = 1;
  f.st.replaced_bytes = 8 << 20;
  text = print_checked(&f.st, &parsed);
  r = json_array_get(json_object_get(parsed, "retained"), 0);
  CHECK(json_integer_value(json_object_get(r, "pid")) == 4343);
  CHECK(json_integer_value(json_object_get(r, "uid")) == 3000);
  CHECK(json_integer_value(json_object_get(r, "bytes")) == 6 << 20);
  CHECK(json_integer_value(json_object_get(json_object_get(parsed, "totals"),
                                           "replaced_bytes")) == 8 << 20);
  free(text);
  json_decref(parsed);
}

static void test_loan_in_progress(void) {
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  fixture_lend(&f);
  text = print_checked(&f.st, &parsed);
  CHECK(text != NULL && strstr(text, "\"loan\": {\"id\": 9, \"region\": 1, "
      "\"state\": \"active\", \"name\": \"kv-cache\", \"borrower_pid\": 4343, "
      "\"borrower_uid\": 1001, \"unkept_pages\": 2, \"fresh_pages\": 0, \"kept_pages\": 1, "
      "\"pinned_pages\": 0, \"page_size\": 2097152, \"live_bytes\": 1048576, \"local\": true, "
      "\"copied_out_bytes\": 2097152, \"copied_in_bytes\": 0, \"served_unkept_bytes\": 0, "
      "\"served_fresh_bytes\": 0, \"served_kept_bytes\": 0, \"peak_bytes\": 4194304, "
      "\"allocations\": 5, \"copy_out_seconds\": 0.001234, \"moved_bytes\": 0}, ") != NULL);
  CHECK(text != NULL && strstr(text, "\"bytes\": 6291456, \"loan\": 9, \"released_bytes\": 0}") != NULL);
  free(text);
  json_decref(parsed);
}

/* A released region a borrower still holds: by whom, how much. */
static void test_held_region(void) {
  Sublet__HeldStatus h = SUBLET__HELD_STATUS__INIT, *list[1] = {&h};
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  h.region = 5;
  h.pages = 3;
  h.owner_uid = 1000;
  h.holder_pid = 4343;
  h.holder_uid = 1000;
  f.st.held = list;
  f.st.n_held = 1;
  text = print_checked(&f.st, &parsed);
  CHECK(text != NULL && strstr(text, "\"held\": [{\"region\": 5, \"pages\": 3, "
      "\"bytes\": 6291456, \"owner_uid\": 1000, \"holder_pid\": 4343, "
      "\"holder_uid\": 1000}], ") != NULL);
  free(text);
  json_decref(parsed);
}

/* A loan without a name, borrower or local flag: "", 0 and false, as the Python side reads. */
static void test_loan_unset_fields(void) {
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  fixture_lend(&f);
  f.loan.name = NULL;
  f.loan.has_borrower_pid = f.loan.has_borrower_uid = 0;
  f.loan.local = 0;
  text = print_checked(&f.st, &parsed);
  CHECK(text != NULL && strstr(text, "\"name\": \"\", \"borrower_pid\": 0, "
                                     "\"borrower_uid\": 0, ") != NULL);
  CHECK(text != NULL && strstr(text, "\"local\": false, ") != NULL);
  free(text);
  json_decref(parsed);
}

/* ------------------------------------------------------------------ whatever the message holds */

/* Each byte that starts no UTF-8 sequence is one U+FFFD; the valid text around it stays. */
static void test_text_that_is_not_utf8(void) {
  static const struct {
    const char *in, *out;
  } cases[] = {
    {"kv\xff\xfe", "kv\xef\xbf\xbd\xef\xbf\xbd"},
    {"\xc0\xaf", "\xef\xbf\xbd\xef\xbf\xbd"},                     /* overlong '/' */
    {"a\xed\xa0\x80z", "a\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbdz"}, /* a surrogate */
    {"kv\xe2\x82", "kv\xef\xbf\xbd\xef\xbf\xbd"},                 /* cut short */
    {"\xf4\x90\x80\x80", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd"}, /* > U+10FFFF */
    {"kv-\xc3\xbc-\xe6\x97\xa5-\xf0\x9f\x99\x82", "kv-\xc3\xbc-\xe6\x97\xa5-\xf0\x9f\x99\x82"},
  };
  struct fixture f;
  json_t *parsed;
  char *text;

  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    fixture_init(&f);
    fixture_lend(&f);
    f.loan.name = (char *)cases[i].in;
    f.st.device_name = (char *)cases[i].in;
    text = print_checked(&f.st, &parsed);
    CHECK(text != NULL);
    CHECK(loan_string(parsed, "name") != NULL &&
          strcmp(loan_string(parsed, "name"), cases[i].out) == 0);
    CHECK(strcmp(json_string_value(json_object_get(parsed, "device_name")), cases[i].out) == 0);
    free(text);
    json_decref(parsed);
  }
}

/* Quotes, backslashes and control characters are escaped, and read back as they were. */
static void test_odd_characters(void) {
  static const char odd[] = "a\"b\\c/d\n\t\r\b\f\x01\x1f\x7f end";
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  fixture_lend(&f);
  f.loan.name = (char *)odd;
  f.loan.state = "{\"injected\": 1}";
  text = print_checked(&f.st, &parsed);
  CHECK(text != NULL && strstr(text, "\"name\": \"a\\\"b\\\\c/d\\n\\t\\r\\b\\f\\u0001\\u001F"
                                     "\x7f end\"") != NULL);
  CHECK(loan_string(parsed, "name") != NULL && strcmp(loan_string(parsed, "name"), odd) == 0);
  CHECK(loan_string(parsed, "state") != NULL &&
        strcmp(loan_string(parsed, "state"), "{\"injected\": 1}") == 0);
  free(text);
  json_decref(parsed);
}

/* Unsigned 32-bit ids print unsigned; 64-bit counts past 2^63 - 1 as reals (15 digits, not
 * negative); a time that is not finite as null; a uuid too short padded with zeros. */
static void test_numbers_at_their_limits(void) {
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  fixture_lend(&f);
  f.region.owner_uid = UINT32_MAX;
  f.st.total_bytes = INT64_MAX;
  f.st.free_bytes = UINT64_MAX;
  f.st.uptime_seconds = NAN;
  f.stats.copy_out_seconds = -INFINITY;
  f.st.device_uuid.len = 2;
  text = print_checked(&f.st, &parsed);
  CHECK(text != NULL && strstr(text, "\"owner_uid\": 4294967295,") != NULL);
  CHECK(text != NULL && strstr(text, "\"total_bytes\": 9223372036854775807,") != NULL);
  CHECK(json_is_real(json_object_get(parsed, "free_bytes")) &&
        json_real_value(json_object_get(parsed, "free_bytes")) > 1.8e19);
  CHECK(json_is_null(json_object_get(parsed, "uptime_seconds")));
  CHECK(json_is_null(json_object_get(json_object_get(parsed, "loan"), "copy_out_seconds")));
  CHECK(text != NULL &&
        strstr(text, "\"device_uuid\": \"GPU-5a1e0000-0000-0000-0000-000000000000\",") != NULL);
  free(text);
  json_decref(parsed);
}

/* Seconds keep the precision they always had: uptime to the millisecond, copies to the
 * microsecond, printed as those decimals; a whole number of seconds is still a real. */
static void test_seconds(void) {
  struct fixture f;
  json_t *parsed;
  char *text;

  fixture_init(&f);
  fixture_lend(&f);
  f.st.uptime_seconds = 86400.0 * 365 * 30 + 0.0004;
  f.stats.copy_out_seconds = 3;
  text = print_checked(&f.st, &parsed);
  CHECK(text != NULL && strstr(text, "\"uptime_seconds\": 946080000.0,") != NULL);
  CHECK(text != NULL && strstr(text, "\"copy_out_seconds\": 3.0,") != NULL);
  free(text);
  json_decref(parsed);
}

/* Times next to DBL_MAX print, at 15 digits, as 1.79769313486232e308: past DBL_MAX, which
 * jansson refuses to read back (real number overflow; found by fuzz_status). They are null;
 * a time a little smaller stays a number (issue 25, item 14). */
static void test_reals_that_read_back(void) {
  const double below = nextafter(DBL_MAX, 0);
  const double near_max[] = {DBL_MAX, -DBL_MAX, below, -nextafter(below, 0)};
  struct fixture f;
  json_t *parsed;
  char *text;

  for (size_t i = 0; i < sizeof(near_max) / sizeof(near_max[0]); i++) {
    fixture_init(&f);
    fixture_lend(&f);
    f.st.uptime_seconds = near_max[i];
    f.stats.copy_out_seconds = near_max[i];
    text = print_checked(&f.st, &parsed);
    CHECK(text != NULL);
    CHECK(json_is_null(json_object_get(parsed, "uptime_seconds")));
    CHECK(json_is_null(json_object_get(json_object_get(parsed, "loan"), "copy_out_seconds")));
    free(text);
    json_decref(parsed);
  }
  fixture_init(&f);
  f.st.uptime_seconds = -1.7976931348623e308;
  text = print_checked(&f.st, &parsed);
  CHECK(json_real_value(json_object_get(parsed, "uptime_seconds")) == -1.7976931348623e308);
  free(text);
  json_decref(parsed);
}

/* ------------------------------------------------------------------ out of memory */

static long allocations_left;

static void *failing_malloc(size_t size) {
  return allocations_left-- > 0 ? malloc(size) : NULL;
}

/* jansson's allocator failing at each of its allocations in turn: NULL, and nothing leaked
 * (ASan's leak check in tests/run --sanitize); once enough succeed, the same text as ever,
 * freed with free() although jansson allocated with another allocator. */
static void test_out_of_memory(void) {
  struct fixture f;
  char *want, *got = NULL;
  long n;

  fixture_init(&f);
  fixture_lend(&f);
  want = sl_status_json(&f.st);
  json_set_alloc_funcs(failing_malloc, free);
  for (n = 0; got == NULL && n < 100000; n++) {
    allocations_left = n;
    got = sl_status_json(&f.st);
  }
  json_set_alloc_funcs(malloc, free);
  CHECK(n > 10); /* it failed many times before it succeeded */
  CHECK_TEXT(got, want);
  free(got);
  free(want);
}

int main(void) {
  test_idle_daemon();
  test_retained();
  test_loan_in_progress();
  test_held_region();
  test_loan_unset_fields();
  test_text_that_is_not_utf8();
  test_odd_characters();
  test_numbers_at_their_limits();
  test_seconds();
  test_reals_that_read_back();
  test_out_of_memory();
  return check_report("status_json");
}
