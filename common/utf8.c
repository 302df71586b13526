/* utf8.c - what is UTF-8, and text of another process made printable (see utf8.h).
 * Floor 1 (floors.h). */
#include "utf8.h"

size_t sl_utf8_sequence(const uint8_t *s, size_t n) {
  static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000}; /* below: overlong */
  size_t len = s[0] < 0x80 ? 1 : s[0] >= 0xc2 && s[0] < 0xe0 ? 2 : s[0] >= 0xe0 && s[0] < 0xf0
               ? 3 : s[0] >= 0xf0 && s[0] < 0xf5 ? 4 : 0;
  uint32_t cp = len == 1 ? s[0] : s[0] & (0x7f >> len);

  if (len == 0 || len > n)
    return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xc0) != 0x80)
      return 0;
    cp = cp << 6 | (s[i] & 0x3f);
  }
  if (cp < least[len])
    return 0;
  if ((cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
    return 0;
  return len;
}

int sl_utf8_is_control(const uint8_t *s, size_t len) {
  return (len == 1 && (s[0] < 0x20 || s[0] == 0x7f)) || (len == 2 && s[0] == 0xc2 && s[1] < 0xa0);
}

size_t sl_utf8_printable(char *out, size_t size, const uint8_t *in, size_t n) {
  size_t o = 0, fits = 0, i = 0, len;  /* fits: the end of what leaves room for "..." */

  while (i < n) {
    len = sl_utf8_sequence(in + i, n - i);
    if (len == 0 || sl_utf8_is_control(in + i, len)) {
      if (o + 1 > size - 1)
        break;
      out[o++] = '?';
      i += len == 0 ? 1 : len;
    } else {
      if (o + len > size - 1)
        break;
      for (size_t k = 0; k < len; k++)
        out[o++] = (char)in[i++];
    }
    if (o <= size - 4)
      fits = o;
  }
  if (i < n) { /* cut short: say so */
    o = fits;
    out[o++] = '.', out[o++] = '.', out[o++] = '.';
  }
  out[o] = '\0';
  return o;
}
