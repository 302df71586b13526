/* floors.h - the floors of common/, the code subletd and libsublet both link (sl_common),
 * lowest first: a file calls functions of files on lower floors only, never of one on its own
 * floor or above (a backend's ops are reached through device.c's table, not by name). Each
 * file's opening comment names its floor; tests/check-floors checks them against nm of the
 * built objects (ctest: check_floors_common). The cuda backend's two files are one unit: the
 * backend calls its transfers and they call back for its context.
 *
 *   floor 1: clock.c error.c kernels_ptx.c prefault.c seal.c utf8.c   the clock; typed errors;
 *            the kernels' PTX; host pages made ahead; sealed memfds; UTF-8
 *   floor 2: device.c journal.c keepwire.c wire.c   the device API's checks and dispatch; a
 *            loan's journal; the keep list on the wire; frames and fds over a socket
 *   floor 3: device_cuda.c+device_cuda_copy.c device_memfd.c msg.c   the backends; protocol
 *            messages in frames
 *
 * Nothing includes this header: it holds the floors, as daemon.h and client.h do theirs.
 */
#ifndef SL_FLOORS_H
#define SL_FLOORS_H
#endif
