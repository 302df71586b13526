/* seal.h - shared memory that subletd hands out but no client can change (issue 25).
 *
 * The journal and the host save area go to clients "read-only", and every client holds the
 * memfds of its pages. An fd's access mode is not enough: anyone holding one can reopen the
 * file through /proc/self/fd/N with O_RDWR (a memfd's mode is 0777 at birth), then write it,
 * map it writable or truncate it, and a truncated file gives the daemon SIGBUS the next time it
 * touches its own mapping. Seals belong to the file, not the fd, so they hold whatever fd a
 * client makes:
 *   read-only (the journal, the save area): F_SEAL_FUTURE_WRITE (no write(), no new writable
 *     mapping; the daemon's own writable mappings, made before, stay valid and may grow with
 *     mremap) and F_SEAL_SHRINK (growing stays possible, so both may grow as the loan needs);
 *     the mode 0400 besides, so that another user cannot even reopen it writable.
 *   fixed size (a memfd device page): F_SEAL_SHRINK and F_SEAL_GROW.
 * Every function returns 0 (or an fd) or a negative errno.
 */
#ifndef SL_SEAL_H
#define SL_SEAL_H

#include <stdint.h>

/* A memfd that can take seals (close-on-exec); the caller owns it. */
int sl_seal_memfd(const char *name);
/* Seals fd read-only as above; make the writable mappings the daemon needs first. */
int sl_seal_read_only(int fd);
int sl_seal_fixed_size(int fd);
/* 1 when fd is sealed read-only (no write can be made through any fd of it), else 0. */
int sl_seal_is_read_only(int fd);
/* Grows fd's file to at least size: never truncates, so that a file a client has grown (the
 * seals let it) is no error, and a sealed one is never asked to shrink. */
int sl_seal_grow_to(int fd, uint64_t size);

#endif
