/* status.c - the daemon's Status as JSON, for `sublet status` and monitoring.
 *
 * JSON rather than a C struct: the Status message has lists (regions) and grows with the
 * protocol, and its consumers (the Python CLI, scripts) parse JSON anyway.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "msg.h"

struct json {
  char *buf;
  size_t len, cap;
  int failed;
};

static void put(struct json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void put(struct json *j, const char *fmt, ...) {
  va_list ap;
  int n;

  for (;;) {
    va_start(ap, fmt);
    n = vsnprintf(j->buf + j->len, j->cap - j->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      j->failed = 1;
      return;
    }
    if ((size_t)n < j->cap - j->len)
      break;
    char *grown = realloc(j->buf, 2 * j->cap + (size_t)n);
    if (grown == NULL) {
      j->failed = 1;
      return;
    }
    j->buf = grown;
    j->cap = 2 * j->cap + (size_t)n;
  }
  j->len += (size_t)n;
}

/* Strings from the daemon are names and versions; escape what JSON requires anyway. */
static void put_string(struct json *j, const char *key, const char *s) {
  put(j, "\"%s\": \"", key);
  for (; s != NULL && *s; s++) {
    if (*s == '"' || *s == '\\')
      put(j, "\\%c", *s);
    else if ((unsigned char)*s < 0x20)
      put(j, "\\u%04x", (unsigned char)*s);
    else
      put(j, "%c", *s);
  }
  put(j, "\"");
}

static void put_uuid(struct json *j, const ProtobufCBinaryData *u) {
  put(j, "\"device_uuid\": \"GPU-");
  for (size_t i = 0; i < u->len && i < 16; i++)
    put(j, "%02x%s", u->data[i], (i == 3 || i == 5 || i == 7 || i == 9) ? "-" : "");
  put(j, "\"");
}

static void put_stats(struct json *j, const Sublet__LoanStats *s) {
  put(j, "\"copied_out_bytes\": %llu, \"copied_in_bytes\": %llu, "
         "\"served_unkept_bytes\": %llu, \"served_fresh_bytes\": %llu, "
         "\"served_kept_bytes\": %llu, \"peak_bytes\": %llu, \"allocations\": %llu, "
         "\"copy_out_seconds\": %.6f, \"moved_bytes\": %llu",
      (unsigned long long)s->copied_out_bytes, (unsigned long long)s->copied_in_bytes,
      (unsigned long long)s->served_unkept_bytes, (unsigned long long)s->served_fresh_bytes,
      (unsigned long long)s->served_kept_bytes, (unsigned long long)s->peak_bytes,
      (unsigned long long)s->allocations, s->copy_out_seconds,
      (unsigned long long)s->moved_bytes);
}

static void put_regions(struct json *j, const Sublet__Status *st) {
  put(j, "\"regions\": [");
  for (size_t i = 0; i < st->n_regions; i++) {
    const Sublet__RegionStatus *r = st->regions[i];
    put(j, "%s{\"id\": %llu, \"owner_pid\": %u, \"owner_uid\": %u, \"pages\": %llu, "
           "\"bytes\": %llu, \"loan\": %llu}",
        i ? ", " : "", (unsigned long long)r->region, r->owner_pid, r->owner_uid,
        (unsigned long long)r->pages, (unsigned long long)(r->pages * st->page_size),
        (unsigned long long)(r->has_loan ? r->loan : 0));
  }
  put(j, "]");
}

static void put_loan(struct json *j, const Sublet__LoanStatus *l, uint64_t page_size) {
  put(j, "\"loan\": {\"id\": %llu, \"region\": %llu, ", (unsigned long long)l->loan,
      (unsigned long long)l->region);
  put_string(j, "state", l->state);
  put(j, ", ");
  put_string(j, "name", l->name ? l->name : "");
  put(j, ", \"borrower_pid\": %u, \"borrower_uid\": %u, \"unkept_pages\": %llu, "
         "\"fresh_pages\": %llu, \"kept_pages\": %llu, \"page_size\": %llu, "
         "\"live_bytes\": %llu, \"local\": %s, ",
      l->has_borrower_pid ? l->borrower_pid : 0, l->has_borrower_uid ? l->borrower_uid : 0,
      (unsigned long long)l->unkept_pages, (unsigned long long)l->fresh_pages,
      (unsigned long long)l->kept_pages, (unsigned long long)page_size,
      (unsigned long long)l->live_bytes, l->local ? "true" : "false");
  put_stats(j, l->stats);
  put(j, "}");
}

static void put_status(struct json *j, const Sublet__Status *st) {
  put(j, "{");
  put_string(j, "daemon_version", st->daemon_version);
  put(j, ", \"uptime_seconds\": %.3f, ", st->uptime_seconds);
  put_string(j, "backend", st->backend);
  put(j, ", ");
  put_uuid(j, &st->device_uuid);
  put(j, ", ");
  put_string(j, "device_name", st->device_name);
  put(j, ", \"device_ordinal\": %u, \"page_size\": %llu, \"total_bytes\": %llu, "
         "\"free_bytes\": %llu, \"host_bytes\": %llu, \"clients\": %llu, ",
      st->device_ordinal, (unsigned long long)st->page_size,
      (unsigned long long)st->total_bytes, (unsigned long long)st->free_bytes,
      (unsigned long long)st->host_bytes, (unsigned long long)st->clients);
  put_regions(j, st);
  put(j, ", ");
  if (st->loan != NULL)
    put_loan(j, st->loan, st->page_size);
  else
    put(j, "\"loan\": null");
  put(j, ", \"totals\": {\"loans_ended\": %llu, \"borrowers_died\": %llu, "
         "\"copied_out_bytes\": %llu, \"copied_in_bytes\": %llu, "
         "\"served_unkept_bytes\": %llu, \"served_fresh_bytes\": %llu, "
         "\"served_kept_bytes\": %llu}}",
      (unsigned long long)st->loans_ended, (unsigned long long)st->borrowers_died,
      (unsigned long long)st->copied_out_bytes, (unsigned long long)st->copied_in_bytes,
      (unsigned long long)st->served_unkept_bytes, (unsigned long long)st->served_fresh_bytes,
      (unsigned long long)st->served_kept_bytes);
}

SUBLET_EXPORT int sublet_status_json(sublet_client *c, char **json) {
  struct json j = {.buf = malloc(4096), .cap = 4096};
  Sublet__Reply *rep;
  int rc;

  if (j.buf == NULL)
    return sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  pthread_mutex_lock(&c->lock);
  rc = sl_client_status(c, &rep);
  pthread_mutex_unlock(&c->lock);
  if (rc == 0)
    put_status(&j, rep->status);
  if (rc == 0 && j.failed)
    rc = sl_client_fail(SUBLET_ENOHOSTMEM, "out of host memory");
  if (rep != NULL)
    sublet__reply__free_unpacked(rep, NULL);
  if (rc != 0) {
    free(j.buf);
    return rc;
  }
  *json = j.buf;
  return 0;
}

SUBLET_EXPORT void sublet_string_free(char *s) {
  free(s);
}
