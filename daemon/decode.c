/* decode.c - requests decoded within a bound of the daemon's memory (decode.h says why): a
 * counting allocator under protobuf-c, and the id of a request read without decoding it.
 *
 * Floor 1 (daemon.h's floors).
 */
#include "decode.h"

#include <stdlib.h>

/* What a request's decoding has taken so far. Counted as handed out, frees not subtracted:
 * the bound is on all the work a message can cause, replaced fields included. */
struct budget {
  size_t used, limit;
  int over;
};

/* malloc's own cost of a chunk, counted beside its size. */
#define CHUNK_OVERHEAD 16

static void *budget_alloc(void *data, size_t size) {
  struct budget *b = data;

  if (size > b->limit || b->used + CHUNK_OVERHEAD + size > b->limit) {
    b->over = 1;
    return NULL;
  }
  b->used += CHUNK_OVERHEAD + size;
  return malloc(size);
}

/* The decoded message is freed with free() (free_unpacked with the default allocator, or the
 * keep list taken over by a draft): what is allocated here is plain malloc's. */
static void budget_free(void *data, void *p) {
  (void)data;
  free(p);
}

size_t sl_decode_limit(size_t len) {
  size_t limit = ((size_t)256 << 10) + 4 * len;

  return limit < SL_DECODE_MAX_BYTES ? limit : SL_DECODE_MAX_BYTES;
}

Sublet__Request *sl_decode_request(const uint8_t *payload, size_t len, size_t limit,
                                   struct sl_err *err) {
  struct budget b = {.limit = limit};
  ProtobufCAllocator a = {.alloc = budget_alloc, .free = budget_free, .allocator_data = &b};
  Sublet__Request *m = sublet__request__unpack(&a, len, payload);
  char lim[32], got[32];

  if (m != NULL)
    return m;
  if (b.over)
    sl_err_set(err, SUBLET_E2BIG, "a request of %s would take more than %s of subletd's "
               "memory decoded (its limit for a request this size): send long keep lists as "
               "Lend.keep_ranges or in a memfd (Lend.keep_fd_ranges), as libsublet does",
               sl_format_size(got, len), sl_format_size(lim, limit));
  else
    sl_err_set(err, SUBLET_EPROTO, "malformed request: not a sublet.Request message");
  return NULL;
}

/* ------------------------------------------------------------------ the id, undecoded */

/* Fields looked at for the id: a client puts it first; one that hides it further gets 0. */
#define ID_FIELDS 16

/* A varint at *p (advanced), or -1 when the payload ends inside it or it is too long. */
static int varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  *v = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    uint8_t byte = *(*p)++;
    *v |= (uint64_t)(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0)
      return 0;
  }
  return -1;
}

/* Steps over one field's value of the given wire type; -1 when it does not fit. */
static int skip_value(const uint8_t **p, const uint8_t *end, unsigned type) {
  uint64_t n;
  size_t size = type == 1 ? 8 : type == 5 ? 4 : 0;

  if (type == 0)
    return varint(p, end, &n);
  if (type == 2 && varint(p, end, &n) == 0)
    size = n <= (uint64_t)(end - *p) ? (size_t)n : SIZE_MAX;
  else if (type != 1 && type != 5)
    return -1;
  if (size > (size_t)(end - *p))
    return -1;
  *p += size;
  return 0;
}

uint64_t sl_decode_request_id(const uint8_t *payload, size_t len) {
  const uint8_t *p = payload, *end = payload + len;
  uint64_t key, id = 0;

  for (int i = 0; i < ID_FIELDS && p < end; i++) {
    if (varint(&p, end, &key) != 0)
      return 0;
    if (key == (1u << 3 | 0)) /* Request.id = 1, a varint */
      return varint(&p, end, &id) == 0 ? id : 0;
    if (skip_value(&p, end, (unsigned)(key & 7)) != 0)
      return 0;
  }
  return 0;
}
