/* status_json.c - the daemon's Status as JSON, for `sublet status` and monitoring.
 *
 * JSON rather than a C struct: the Status message has lists (regions) and grows with the
 * protocol, and its consumers (the Python CLI, scripts) parse JSON anyway. jansson writes it
 * (quoting, escaping, numbers); this file says which field goes where, and turns each value
 * into one that JSON holds, whatever the message says: text that is not UTF-8 (the daemon
 * refuses such names, an older one may not) gets U+FFFD for each bad byte, a count above
 * jansson's integers (2^63 - 1) becomes a real, a time that is not finite, or that would print
 * as one (next to DBL_MAX: see real_json), is null. Every number reads back (issue 25).
 * Floor 1 (client.h's floors).
 */
#include "status_json.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "utf8.h"

/* The significant digits reals print with (sl_status_json). */
#define REAL_DIGITS 15

/* A real as jansson will print it, or null when that text would not read back: a double near
 * DBL_MAX rounds at 15 digits past it (1.79769313486232e308), which a parser takes for an
 * overflow (jansson refuses it: its fuzzer found one). */
static json_t *real_json(double v) {
  char text[40];

  if (!isfinite(v))
    return json_null();
  snprintf(text, sizeof(text), "%.*g", REAL_DIGITS, v);
  return isfinite(strtod(text, NULL)) ? json_real(v) : json_null();
}

static json_t *count_json(uint64_t v) {
  return v <= INT64_MAX ? json_integer((json_int_t)v) : real_json((double)v); /* < 1.9e19 */
}

/* Seconds to 10^-places, rounded as printf rounds them: the values sublet has always printed
 * (JSON_REAL_PRECISION(15) then prints them as those decimals, exactly below 10^(15 - places)
 * seconds). */
static json_t *seconds_json(double s, int places) {
  char text[40];

  if (!isfinite(s))
    return json_null();
  if (fabs(s) < 1e15) { /* beyond, a double holds no fraction of a second to round */
    snprintf(text, sizeof(text), "%.*f", places, s);
    s = strtod(text, NULL);
  }
  return real_json(s);
}

static json_t *text_json(const char *s) {
  const uint8_t *in = (const uint8_t *)(s != NULL ? s : "");
  size_t n = strlen((const char *)in), len, o = 0;
  char *out = malloc(3 * n + 1); /* each bad byte takes the 3 bytes of U+FFFD */
  json_t *v;

  if (out == NULL)
    return NULL;
  for (size_t i = 0; i < n; i += len) {
    len = sl_utf8_sequence(in + i, n - i);
    if (len > 0) {
      memcpy(out + o, in + i, len);
      o += len;
    } else {
      memcpy(out + o, "\xef\xbf\xbd", 3); /* U+FFFD, the replacement character */
      o += 3;
      len = 1;
    }
  }
  v = json_stringn_nocheck(out, o);
  free(out);
  return v;
}

/* Short of 16 bytes (only from a broken message), the rest is zeros. */
static json_t *uuid_json(const ProtobufCBinaryData *u) {
  uint8_t uuid[16] = {0};
  char text[SL_DEVICE_UUID_TEXT];

  if (u->len > 0)
    memcpy(uuid, u->data, u->len < 16 ? u->len : 16);
  return json_string(sl_device_uuid_text(text, uuid));
}

/* "o" takes each part, NULL included (out of memory): json_pack then fails and frees them. */
static json_t *region_json(const void *item, uint64_t page_size) {
  const Sublet__RegionStatus *r = item;

  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o}", "id", count_json(r->region),
                   "owner_pid", count_json(r->owner_pid), "owner_uid", count_json(r->owner_uid),
                   "pages", count_json(r->pages), "bytes", count_json(r->pages * page_size),
                   "loan", count_json(r->has_loan ? r->loan : 0),
                   "released_bytes", count_json(r->released_pages * page_size));
}

/* A live release: its pages given back to the driver until resumed (ReleaseStatus); a
 * release by need's need, the free bytes counted for it and the needs after the first that
 * changed it (null for a release by tag; the need and the free bytes: the latest's). */
static json_t *release_json(const void *item, uint64_t page_size) {
  const Sublet__ReleaseStatus *r = item;

  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}",
                   "id", count_json(r->release),
                   "region", count_json(r->region), "state", text_json(r->state),
                   "released_bytes", count_json(r->released_pages * page_size),
                   "stayed_bytes", count_json(r->stayed_pages * page_size),
                   "kept_bytes", count_json(r->kept_bytes),
                   "copied_out_bytes", count_json(r->copied_out_bytes),
                   "moved_bytes", count_json(r->moved_bytes),
                   "need_bytes", r->has_need_bytes ? count_json(r->need_bytes) : json_null(),
                   "free_bytes", r->has_free_bytes ? count_json(r->free_bytes) : json_null(),
                   "need_increments",
                   r->has_need_increments ? count_json(r->need_increments) : json_null());
}

/* A release offer a scheduler may take, or took (ReleaseOfferStatus); taken by need: the
 * taker's need in all (null otherwise). */
static json_t *release_offer_json(const void *item, uint64_t page_size) {
  const Sublet__ReleaseOfferStatus *r = item;

  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}",
                   "id", count_json(r->offer), "state", text_json(r->state),
                   "name", text_json(r->name), "region", count_json(r->region),
                   "owner_pid", count_json(r->owner_pid), "owner_uid", count_json(r->owner_uid),
                   "taker_pid", count_json(r->has_taker_pid ? r->taker_pid : 0),
                   "taker_uid", count_json(r->has_taker_uid ? r->taker_uid : 0),
                   "released_bytes", count_json(r->released_pages * page_size),
                   "kept_bytes", count_json(r->kept_bytes),
                   "copied_out_bytes", count_json(r->copied_out_bytes),
                   "trouble", text_json(r->trouble),
                   "need_bytes", r->has_need_bytes ? count_json(r->need_bytes) : json_null());
}

/* A list of the message's items, each made by item_json. */
static json_t *list_json(void *const *items, size_t n,
                         json_t *(*item_json)(const void *item, uint64_t page_size),
                         uint64_t page_size) {
  json_t *list = json_array();

  for (size_t i = 0; list != NULL && i < n; i++) {
    if (json_array_append_new(list, item_json(items[i], page_size)) != 0) {
      json_decref(list);
      return NULL;
    }
  }
  return list;
}

/* A gone region's pages that a client that kept its window still holds (HeldStatus). */
static json_t *held_json(const void *item, uint64_t page_size) {
  const Sublet__HeldStatus *h = item;

  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o}", "region", count_json(h->region),
                   "pages", count_json(h->pages), "bytes", count_json(h->pages * page_size),
                   "owner_uid", count_json(h->owner_uid),
                   "holder_pid", count_json(h->holder_pid),
                   "holder_uid", count_json(h->holder_uid));
}

static json_t *loan_stats_json(const Sublet__LoanStats *s) {
  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}",
                   "copied_out_bytes", count_json(s->copied_out_bytes),
                   "copied_in_bytes", count_json(s->copied_in_bytes),
                   "served_unkept_bytes", count_json(s->served_unkept_bytes),
                   "served_fresh_bytes", count_json(s->served_fresh_bytes),
                   "served_kept_bytes", count_json(s->served_kept_bytes),
                   "peak_bytes", count_json(s->peak_bytes),
                   "allocations", count_json(s->allocations),
                   "copy_out_seconds", seconds_json(s->copy_out_seconds, 6),
                   "moved_bytes", count_json(s->moved_bytes));
}

/* The loan's own fields, then its stats' in the same object. */
static json_t *loan_json(const Sublet__LoanStatus *l, uint64_t page_size) {
  json_t *loan;

  if (l == NULL)
    return json_null();
  loan = json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:b}",
                   "id", count_json(l->loan), "region", count_json(l->region),
                   "state", text_json(l->state), "name", text_json(l->name),
                   "borrower_pid", count_json(l->has_borrower_pid ? l->borrower_pid : 0),
                   "borrower_uid", count_json(l->has_borrower_uid ? l->borrower_uid : 0),
                   "unkept_pages", count_json(l->unkept_pages),
                   "fresh_pages", count_json(l->fresh_pages),
                   "kept_pages", count_json(l->kept_pages),
                   "pinned_pages", count_json(l->pinned_pages), "page_size", count_json(page_size),
                   "live_bytes", count_json(l->live_bytes), "local", (int)l->local);
  if (loan != NULL && json_object_update_new(loan, loan_stats_json(l->stats)) != 0) {
    json_decref(loan);
    return NULL;
  }
  return loan;
}

/* A borrower that may still hold old pages of other users' regions (counted until it goes). */
static json_t *retained_json(const void *item, uint64_t page_size) {
  const Sublet__RetainedStatus *r = item;

  (void)page_size;
  return json_pack("{s:o, s:o, s:o}", "pid", count_json(r->pid), "uid", count_json(r->uid),
                   "bytes", count_json(r->bytes));
}

static json_t *totals_json(const Sublet__Status *st) {
  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o}",
                   "loans_ended", count_json(st->loans_ended),
                   "borrowers_died", count_json(st->borrowers_died),
                   "copied_out_bytes", count_json(st->copied_out_bytes),
                   "copied_in_bytes", count_json(st->copied_in_bytes),
                   "served_unkept_bytes", count_json(st->served_unkept_bytes),
                   "served_fresh_bytes", count_json(st->served_fresh_bytes),
                   "served_kept_bytes", count_json(st->served_kept_bytes),
                   "replaced_bytes", count_json(st->replaced_bytes));
}

static json_t *status_fields(const Sublet__Status *st) {
  return json_pack("{s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, s:o, "
                   "s:o, s:o, s:o, s:o}",
                   "daemon_version", text_json(st->daemon_version),
                   "uptime_seconds", seconds_json(st->uptime_seconds, 3),
                   "backend", text_json(st->backend), "device_uuid", uuid_json(&st->device_uuid),
                   "device_name", text_json(st->device_name),
                   "device_ordinal", count_json(st->device_ordinal),
                   "page_size", count_json(st->page_size),
                   "total_bytes", count_json(st->total_bytes),
                   "free_bytes", count_json(st->free_bytes),
                   "host_bytes", count_json(st->host_bytes), "clients", count_json(st->clients),
                   "lends_waiting", count_json(st->lends_waiting),
                   "regions", list_json((void *const *)st->regions, st->n_regions, region_json,
                                        st->page_size),
                   "held", list_json((void *const *)st->held, st->n_held, held_json,
                                     st->page_size),
                   "loan", loan_json(st->loan, st->page_size),
                   "releases", list_json((void *const *)st->releases, st->n_releases,
                                         release_json, st->page_size),
                   "retained", list_json((void *const *)st->retained, st->n_retained,
                                         retained_json, st->page_size),
                   "totals", totals_json(st));
}

/* The pin ahead of the save area in progress, or null. */
static json_t *pin_json(const Sublet__Status *st) {
  if (!st->has_pin_target_bytes)
    return json_null();
  return json_pack("{s:o, s:o}", "target_bytes", count_json(st->pin_target_bytes),
                   "done_bytes", count_json(st->pin_done_bytes));
}

/* The fields, then the release offers, the pin and the Borrows waiting (beside them: json_pack
 * takes so many at most). */
static json_t *status_object(const Sublet__Status *st) {
  json_t *obj = status_fields(st);
  json_t *offers = list_json((void *const *)st->release_offers, st->n_release_offers,
                             release_offer_json, st->page_size);
  json_t *pin = pin_json(st);

  if (obj == NULL || offers == NULL || pin == NULL) {
    json_decref(obj);
    json_decref(offers);
    json_decref(pin);
    return NULL;
  }
  /* set_new takes its value even when it fails: each is called */
  int bad = json_object_set_new(obj, "release_offers", offers) != 0;
  bad |= json_object_set_new(obj, "pin", pin) != 0;
  bad |= json_object_set_new(obj, "borrows_waiting", count_json(st->borrows_waiting)) != 0;
  if (bad) {
    json_decref(obj);
    return NULL;
  }
  return obj;
}

/* 15 digits: the rounded seconds print as the decimals they are (12.345, not 12.3450000001).
 * The text goes into a buffer of ours, not json_dumps's: jansson's allocator is the process's
 * (json_set_alloc_funcs), and the caller frees the text with free(). */
char *sl_status_json(const Sublet__Status *st) {
  const size_t flags = JSON_REAL_PRECISION(REAL_DIGITS);
  json_t *obj = status_object(st);
  size_t len = obj != NULL ? json_dumpb(obj, NULL, 0, flags) : 0;
  char *text = len > 0 ? malloc(len + 1) : NULL;

  if (text != NULL && json_dumpb(obj, text, len, flags) == len) {
    text[len] = '\0';
  } else {
    free(text);
    text = NULL;
  }
  json_decref(obj);
  return text;
}
