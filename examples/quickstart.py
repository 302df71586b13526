"""Lend a tensor's memory to other PyTorch work and check that the kept half comes back.

    python3 examples/quickstart.py [GiB]      (default 4 GiB on a GPU, 0.5 GiB without one)

The cache is a table of 1 MiB blocks, and every other block is kept (the live ones), so each
2 MiB page holds kept and unkept bytes.

On a machine with no CUDA GPU it runs all the same, on the memfd backend (host memory in place
of the GPU's) with CPU tensors. PyTorch's allocator hook exists for CUDA only, so there the
work allocates from the loan itself (Loan.empty) instead of through torch.empty, and it takes
more than the device has free: all of the free memory and three quarters of the cache's size.
The loan must then take pages that hold kept bytes: it first moves the kept bytes of some pages
into the unkept halves of others (on the device), then copies what still does not fit to the
host. On a GPU the work is as large as the cache; where the GPU has that much free, the work
takes free memory and nothing moves.
"""
import sys

import torch

import sublet

BLOCK = 2**20  # bytes in a block of the cache


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def main() -> None:
    gpu = torch.cuda.is_available()
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else (4 if gpu else 0.5)
    if not gpu:
        print("quickstart: no CUDA GPU here: running on sublet's memfd backend (host memory) "
              "with CPU tensors")
    cache = sublet.empty(max(2, int(gib * 2**30) // BLOCK), BLOCK, dtype=torch.uint8,
                         device=None if gpu else "cpu")
    cache.random_(0, 256)
    kept = cache[1::2].clone()                        # what must come back: every other block
    if gpu:
        work_bytes = cache.numel()
    else:  # more than the device has free: the loan must take pages that hold kept bytes
        work_bytes = sublet.info("cpu").free_bytes + cache.numel() * 3 // 4

    with sublet.lend(cache, keep=cache[1::2]) as loan:
        # Any PyTorch work: here, one tensor, overwritten.
        if gpu:
            work = torch.empty(work_bytes, dtype=torch.uint8, device=cache.device)
        else:
            work = loan.empty(work_bytes, dtype=torch.uint8)
        work.fill_(7)
        del work

    stats = loan.stats
    print(f"lent a {mib(cache.numel())} cache keeping every other block; the work took "
          f"{mib(work_bytes)}: {mib(stats.served_fresh_bytes)} of free memory, "
          f"{mib(stats.served_unkept_bytes)} of unkept pages, "
          f"{mib(stats.served_kept_bytes)} of pages that held kept bytes")
    print(f"moved on the device: {mib(loan.moved_bytes)} of kept bytes (and back)")
    print(f"copied to the host and back: {mib(loan.copied_bytes)} of kept bytes")
    # uint8: equal values are equal bits
    print(f"data intact: {torch.equal(cache[1::2], kept)}")


if __name__ == "__main__":
    main()
