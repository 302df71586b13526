/* daemon.c - the helpers the request layer shares, below every file that handles a request:
 * the pages of device memory free for a loan, the --check of the books after a step, and the
 * check of a request's loan or offer name. Floor 2 (daemon.h's floors): calls only the
 * books, the device and log.c.
 */
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include "log.h"
#include "utf8.h"

uint64_t sl_daemon_free_pages(const struct sl_daemon *d, int keep_reserve) {
  uint64_t ps = sl_device_info(d->dev)->page_size, free_bytes = 0;
  uint64_t taken = d->building_bytes + (keep_reserve ? d->cfg.reserve_bytes : 0);

  if (sl_device_free_bytes(d->dev, &free_bytes, NULL) != 0 || free_bytes <= taken)
    return 0;
  return (free_bytes - taken) / ps;
}

void sl_daemon_check_books(struct sl_daemon *d, uint64_t req_id) {
  char why[256];

  if (d->cfg.check_books && sl_books_check(d->books, why, sizeof(why)) != 0) {
    sl_error("books inconsistent after request %llu: %s", (unsigned long long)req_id, why);
    abort(); /* --check is for tests: fail loudly */
  }
}

int sl_daemon_loan_name(struct sl_err *err, const char *what, protobuf_c_boolean has,
                        ProtobufCBinaryData name, char out[SL_LOAN_NAME_SIZE]) {
  size_t len;

  out[0] = '\0';
  if (!has)
    return 0;
  if (name.len == 0 || name.len >= SL_LOAN_NAME_SIZE)
    return sl_err_set(err, SUBLET_EINVAL, "%s is 1 to %d bytes, not %zu: leave the name out "
                      "for none, or use another", what, SL_LOAN_NAME_SIZE - 1, name.len);
  for (size_t i = 0; i < name.len; i += len) {
    len = sl_utf8_sequence(name.data + i, name.len - i);
    /* Names go into status and the log: a control character (an escape) must not */
    if (len == 0 || sl_utf8_is_control(name.data + i, len))
      return sl_err_set(err, SUBLET_EINVAL, "%s is UTF-8 text of 1 to %d bytes without "
                        "control characters (C0, DEL, C1: NUL and ESC among them); byte %zu of "
                        "this one (0x%02x) is not: use another name", what,
                        SL_LOAN_NAME_SIZE - 1, i, name.data[i]);
  }
  memcpy(out, name.data, name.len);
  out[name.len] = '\0';
  return 0;
}
