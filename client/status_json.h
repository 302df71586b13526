/* status_json.h - the daemon's Status message as JSON text: pure, no I/O (status.c asks the
 * daemon; tests and tests/fuzz/fuzz_status.c feed it any message). */
#ifndef SL_STATUS_JSON_H
#define SL_STATUS_JSON_H

#include "sublet.pb-c.h"

/* The JSON object of `sublet status` (README.md lists its fields), malloc'ed (the caller
 * frees it), or NULL when out of host memory. Whatever st holds, the text is valid JSON. */
char *sl_status_json(const Sublet__Status *st);

#endif
