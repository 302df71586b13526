"""An owner of one GPU's KV cache that offers it to another job (examples/multi_gpu).

    python3 owner.py NAME GIB [--device N] [--live 0.3] [--seed S]

Makes a paged cache of 64 KiB blocks (GIB GiB), fills it with random bytes, offers it with a
random 30% of its blocks kept (keep as indices: one integer per live block), waits for the
borrower to give it back, and checks every kept byte bitwise. Prints one JSON line for
scripts: {"name", "device_uuid", "kept_bytes", "copied_bytes", "borrower_died", "intact"}.
Exit 0 when the kept bytes came back intact (also when the borrower died), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import sublet

BLOCK = 64 * 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name")
    ap.add_argument("gib", type=int)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--live", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()

    device = torch.device("cuda", args.device)
    blocks = args.gib * 1024 ** 3 // BLOCK
    cache = sublet.empty(blocks, BLOCK, dtype=torch.uint8, device=device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    cache.view(-1).copy_(torch.randint(0, 256, (cache.numel(),), dtype=torch.uint8,
                                       device=device, generator=g))
    live = torch.randperm(blocks, generator=torch.Generator().manual_seed(args.seed))
    live = live[: int(blocks * args.live)].sort().values.to(device)
    before = cache.index_select(0, live).cpu()  # the kept bytes, on the host
    died = False
    with sublet.offer(cache, keep=live, name=args.name) as offer:
        print(f"offered {args.name}", flush=True)
        try:
            stats = offer.wait(timeout=args.timeout)
        except sublet.BorrowerDiedError as e:
            stats, died = e.stats, True
    intact = torch.equal(cache.index_select(0, live).cpu(), before)  # uint8: bits
    print(json.dumps({
        "name": args.name, "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
        "kept_bytes": int(live.numel()) * BLOCK, "copied_bytes": stats.copied_out_bytes,
        "borrower_died": died, "intact": intact}), flush=True)
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
