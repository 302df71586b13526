"""Helpers of the GPU tests of releases (test_gpu_release.py, test_gpu_compat_tms.py,
test_gpu_compat_vllm.py): the device's free memory, and a plain PyTorch consumer that takes
the memory a release gave back and writes over it, so that resumed pages are never the old
ones by luck of an untouched driver."""

from __future__ import annotations

import torch

MiB = 1024 ** 2


def free_now() -> int:
    """Free device memory once queued work is done (torch.cuda.mem_get_info)."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def scribble(nbytes: int) -> int:
    """Takes nbytes (less 256 MiB, in whole 2 MiB pages) of free memory outside sublet, writes
    0xEE over it and gives it back; returns the bytes written."""
    n = max(0, nbytes - 256 * MiB) // (2 * MiB) * (2 * MiB)
    if n:
        junk = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xEE)
        torch.cuda.synchronize()
        del junk
    torch.cuda.empty_cache()
    return n
