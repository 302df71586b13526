/* utf8.h - what is UTF-8: the daemon refuses loan names that are not, and the status printer
 * replaces what is not (a name from an older daemon) rather than fail. */
#ifndef SL_UTF8_H
#define SL_UTF8_H

#include <stddef.h>
#include <stdint.h>

/* The length of the UTF-8 sequence at s (n > 0 bytes left), or 0 when it is not one: a stray
 * continuation byte, a truncated sequence, an overlong form, a surrogate, above U+10FFFF. */
size_t sl_utf8_sequence(const uint8_t *s, size_t n);

/* Is the character at s (a sequence of len bytes) a control character: C0, DEL or C1? A
 * terminal acts on them (ESC begins a sequence, C1's CSI too), and a log line ends at one. */
int sl_utf8_is_control(const uint8_t *s, size_t len);

/* Text another process wrote (n bytes, not trusted) as printable UTF-8 in out (size >= 4):
 * each control character and each byte that is not UTF-8 becomes '?', so an escape sequence
 * reaches no terminal or log whole; what does not fit in size - 1 bytes is cut at a character
 * and "..." ends it. Returns strlen(out). */
size_t sl_utf8_printable(char *out, size_t size, const uint8_t *in, size_t n);

#endif
