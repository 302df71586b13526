/* decode.h - requests decoded within a bound of the daemon's memory.
 *
 * protobuf-c allocates what a message says it holds: 32 MiB of packed one-byte varints become
 * 268 MB of uint64s, and millions of tiny unknown fields cost more still. Every request is
 * decoded through an allocator that counts what it hands out and refuses past the request's
 * limit, so that the bound is exact whatever the message holds; the refusal says so (E2BIG),
 * with the request's id where the frame names one.
 */
#ifndef SL_DECODE_H
#define SL_DECODE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "sublet.pb-c.h"

/* The most host memory one request may take decoded: above any keep list a client sends in
 * varints (32 MiB of them, sorted ranges, decode to about 100 MiB), a half of a hostile one. */
#define SL_DECODE_MAX_BYTES (128ull << 20)

/* The limit for a payload of len bytes: 256 KiB, and 4 bytes for each byte of payload, up to
 * SL_DECODE_MAX_BYTES. A sorted keep list's varints take 4 bytes or more a pair once past its
 * first 16 KiB of offsets, so no keep list comes near it; one-byte varints (8 bytes each
 * decoded) and floods of tiny unknown fields (about 60 bytes each) go past it. */
size_t sl_decode_limit(size_t len);

/* Decodes a Request taking at most limit bytes of memory (freed with
 * sublet__request__free_unpacked(m, NULL)); NULL with err: SUBLET_E2BIG past the limit,
 * SUBLET_EPROTO when the payload is no Request. */
Sublet__Request *sl_decode_request(const uint8_t *payload, size_t len, size_t limit,
                                   struct sl_err *err);

/* The request's id, read from its first fields without decoding it; 0 when not among them. */
uint64_t sl_decode_request_id(const uint8_t *payload, size_t len);

#endif
