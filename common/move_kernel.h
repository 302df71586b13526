/* move_kernel.h - the kernel of move_kernel.cu as embedded PTX (move_kernel_ptx.c, generated
 * by common/gen-move-kernel), for device_cuda.c to load with cuModuleLoadData. */
#ifndef SL_MOVE_KERNEL_H
#define SL_MOVE_KERNEL_H

extern const char sl_move_kernel_ptx[];

#endif
