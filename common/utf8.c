/* utf8.c - what is UTF-8 (see utf8.h). */
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
