/* utf8.h - what is UTF-8: the daemon refuses loan names that are not, and the status printer
 * replaces what is not (a name from an older daemon) rather than fail. */
#ifndef SL_UTF8_H
#define SL_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* The length of the UTF-8 sequence at s (n > 0 bytes left), or 0 when it is not one: a stray
 * continuation byte, a truncated sequence, an overlong form, a surrogate, above U+10FFFF. */
size_t sl_utf8_sequence(const uint8_t *s, size_t n);

#endif
