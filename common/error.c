/* error.c - typed errors and their messages. */
#include "error.h"

#include <stdio.h>
#include <string.h>

int sl_err_set(struct sl_err *err, int code, const char *fmt, ...) {
  if (err != NULL) {
    va_list ap;
    err->code = code;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
    va_end(ap);
  }
  return code;
}

void sl_err_clear(struct sl_err *err) {
  if (err != NULL) {
    err->code = 0;
    err->msg[0] = '\0';
  }
}

const char *sl_strerror(int code) {
#define SL_ERR_CASE(name, value, text) \
  case SUBLET_##name:                  \
    return text;
  switch (code) {
    SUBLET_ERRNO_MAP(SL_ERR_CASE)
    case 0:
      return "success";
    default:
      return "unknown error";
  }
#undef SL_ERR_CASE
}

const char *sl_format_size(char *buf, unsigned long long bytes) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  if (u == 0)
    snprintf(buf, 16, "%llu B", bytes);
  else
    snprintf(buf, 16, "%.*f %s", v < 10 ? 2 : 1, v, units[u]);
  return buf;
}
