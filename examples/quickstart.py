"""Lend a tensor's memory to other PyTorch work and check that the kept half comes back.

    python3 examples/quickstart.py [GiB]      (default 4 GiB; needs a CUDA GPU)
"""
import sys

import torch

import sublet


def main() -> None:
    gib = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    if not torch.cuda.is_available():
        sys.exit("quickstart: needs a CUDA GPU (the tests run without one: tests/run)")
    cache = sublet.empty(gib * 2, 512 * 1024**2, dtype=torch.uint8)  # rows of 512 MiB
    cache.random_(0, 256)
    kept = cache[1::2].clone()                        # what must come back: every other row

    with sublet.lend(cache, keep=cache[1::2]) as loan:
        # Any PyTorch work: here, a tensor as large as the whole cache, overwritten.
        work = torch.empty(cache.numel(), dtype=torch.uint8, device=cache.device)
        work.fill_(7)
        del work

    print(f"copied to the host and back: {loan.copied_bytes / 1024**3:.2f} GiB "
          f"of {cache.numel() / 1024**3:.0f} GiB")
    print(f"data intact: {torch.equal(cache[1::2], kept)}")


if __name__ == "__main__":
    main()
