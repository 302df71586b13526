/* error.c - typed errors and their messages. Floor 1 (floors.h). */
#include "error.h"

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
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

int sl_err_known(int code) {
#define SL_ERR_KNOWN(name, value, text) \
  case SUBLET_##name:                   \
    return 1;
  switch (code) {
    SUBLET_ERRNO_MAP(SL_ERR_KNOWN)
    default:
      return 0;
  }
#undef SL_ERR_KNOWN
}

int sl_parse_size(const char *s, uint64_t *out) {
  static const char units[] = "KMGT";
  const char *unit;
  char *end;
  unsigned long long v;
  int shift = 0;

  errno = 0;
  if (s == NULL || *s < '0' || *s > '9') /* no sign, no space: strtoull would take them */
    return -1;
  v = strtoull(s, &end, 10);
  if (errno != 0)
    return -1;
  if (*end != '\0' && (unit = strchr(units, toupper((unsigned char)*end))) != NULL) {
    shift = 10 * (int)(unit - units + 1);
    end++;
    if (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0)
      end += strlen(end);
  }
  if (*end != '\0' || (shift > 0 && v > (UINT64_MAX >> shift)))
    return -1;
  *out = (uint64_t)v << shift;
  return 0;
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
