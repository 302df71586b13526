"""The owner's half of the cross-process example: offers a cache's memory as "kv" and waits.

    python3 examples/owner.py [GiB]        then, in another shell:  python3 examples/borrower.py

A server holds a cache it does not need for a while: a table of 1 MiB blocks. It offers the
cache's memory under a name, keeping every other block (the blocks still live: each 2 MiB page
holds kept and unkept bytes), and waits until the borrower has given it back; then it says what
the loan moved on the device and copied to the host, and checks that every kept byte is as it
was. Nothing needs setting up: the first of the two processes starts your own subletd, the
second finds it. On a GPU the cache is 16 GiB by default; without one it runs on the memfd
backend (host memory, 256 MiB), where the borrower takes more than the device has free, so
that kept bytes move or go to the host.
"""
import sys

import torch

import sublet


def main() -> int:
    gpu = torch.cuda.is_available()
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else (16 if gpu else 0.25)
    block = 2**20                               # bytes in a block of the cache
    cache = sublet.empty(max(2, int(gib * 2**30) // block), block, dtype=torch.uint8,
                         device=None if gpu else "cpu")
    cache.random_(0, 256)
    live = cache[1::2]                          # what must come back: every other block
    before = live.cpu().clone()                 # on the host: the GPU's memory is lent

    with sublet.offer(cache, keep=live, name="kv") as offer:
        print(f"offered {gib:g} GiB as 'kv', keeping half; waiting for a borrower", flush=True)
        stats = offer.wait(timeout=600)         # until it comes back

    intact = torch.equal(live.cpu(), before)    # uint8: equal values are equal bits
    print(f"back: {stats.moved_bytes / 2**20:.1f} MiB of kept bytes moved on the device, "
          f"{stats.copied_out_bytes / 2**20:.1f} MiB went to the host and back; "
          f"data intact: {intact}")
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
