/* error.h - a typed error with a message that says what to do.
 *
 * Every layer (books, device, wire, daemon, client) reports failure as a negative SUBLET_E*
 * code and, where the caller passed one, fills a struct sl_err with a message for the user.
 * The message travels in the protocol's Error reply unchanged.
 */
#ifndef SL_ERROR_H
#define SL_ERROR_H

#include <stdarg.h>
#include "sublet.h"

struct sl_err {
  int code;
  char msg[512];
};

/* Sets err (if not NULL) and returns code, so that `return sl_err_set(err, ...)` reads well. */
int sl_err_set(struct sl_err *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void sl_err_clear(struct sl_err *err);
const char *sl_strerror(int code);
/* 1 when code is one of SUBLET_ERRNO_MAP's (the protocol's error table), else 0: a code from
 * another process is checked before anyone acts on it. */
int sl_err_known(int code);
/* "1.5 GiB": human-readable sizes for messages and logs; buf of at least 16 bytes. */
const char *sl_format_size(char *buf, unsigned long long bytes);
/* The other way, for options and the environment: "512M", "2G", "16GiB", "1TB", "4096" (K, M,
 * G, T are powers of 1024; an optional B or iB after them). Returns 0, or -1 for anything else:
 * a sign, a fraction, trailing text, or a value past 2^64. */
int sl_parse_size(const char *s, uint64_t *out);

#endif
