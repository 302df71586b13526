"""Lend a tensor's memory to other PyTorch work and check that the kept half comes back.

    python3 examples/quickstart.py [GiB]      (default 4 GiB on a GPU, 0.5 GiB without one)

On a machine with no CUDA GPU it runs all the same, on the memfd backend (host memory in place
of the GPU's) with CPU tensors. PyTorch's allocator hook exists for CUDA only, so there the
work allocates from the loan itself (Loan.empty) instead of through torch.empty.
"""
import sys

import torch

import sublet


def main() -> None:
    gpu = torch.cuda.is_available()
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else (4 if gpu else 0.5)
    if not gpu:
        print("quickstart: no CUDA GPU here: running on sublet's memfd backend (host memory) "
              "with CPU tensors")
    rows = 8
    cache = sublet.empty(rows, int(gib * 1024**3) // rows, dtype=torch.uint8,
                         device=None if gpu else "cpu")
    cache.random_(0, 256)
    kept = cache[1::2].clone()                        # what must come back: every other row

    with sublet.lend(cache, keep=cache[1::2]) as loan:
        # Any PyTorch work: here, a tensor as large as the whole cache, overwritten.
        if gpu:
            work = torch.empty(cache.numel(), dtype=torch.uint8, device=cache.device)
        else:
            work = loan.empty(cache.numel(), dtype=torch.uint8)
        work.fill_(7)
        del work

    print(f"copied to the host and back: {loan.copied_bytes / 1024**3:.2f} GiB "
          f"of {cache.numel() / 1024**3:.2f} GiB")
    print(f"data intact: {torch.equal(cache[1::2], kept)}")


if __name__ == "__main__":
    main()
