#!/usr/bin/env python3
"""The cost of verify on one CUDA GPU, beside the memory-bandwidth limit.

verify (sublet.lend(..., verify=True), SUBLET_VERIFY=1) takes a 64-bit checksum of every kept
range before a loan and again after it: one kernel over all ranges (sublet_region_checksum),
so its cost is the kept bytes read once at memory bandwidth, twice per loan. For keep sets of
one tensor made with sublet.empty (default 40 GiB: 655,360 blocks of 64 KiB, a paged KV
cache), this prints the time of one checksum pass (median of --reps, after one warm-up that
also JIT-compiles the kernel), the bytes it read, and the limit: the same bytes at the read
bandwidth measured here (a torch int64 sum over the same tensor) and at the GPU's nominal
bandwidth (--peak). The keep sets:

  blocks-30    30% of the 64 KiB blocks at random (12 GiB of 40), adjacent blocks merged
  blocks-alt   every other 64 KiB block: ~300,000 separate ranges (20 GiB of 40)
  small-4k     300,000 scattered 4 KiB pieces (1.2 GB): the per-range cost
  slice        one slice of 30%
  all          the whole tensor

    python3 bench/bench_verify.py             # about a minute on an H200
    python3 bench/bench_verify.py --size 8    # a smaller tensor
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GiB = 1 << 30
BLOCK = 64 << 10
NO_GPU = "bench_verify.py needs a CUDA GPU (torch.cuda.is_available() is False here)"


def keep_sets(nblocks: int, seed: int) -> dict[str, np.ndarray]:
    """(n, 2) uint64 byte ranges of each keep set, sorted and merged as sublet.lend makes them."""
    from sublet._keep import merge_ranges
    rng = np.random.default_rng(seed)
    size = nblocks * BLOCK

    def blocks(indices: np.ndarray, length: int = BLOCK) -> np.ndarray:
        starts = np.sort(indices).astype(np.int64) * BLOCK
        return merge_ranges(starts, np.full(len(starts), length, np.int64), presorted=True)

    picked = rng.choice(nblocks, int(nblocks * 0.3), replace=False)
    pieces = rng.choice(nblocks, min(300_000, nblocks), replace=False)
    return {
        "blocks-30": blocks(picked),
        "blocks-alt": blocks(np.arange(0, nblocks, 2)),
        "small-4k": blocks(pieces, 4096),
        "slice": np.array([[0, size * 3 // 10 // BLOCK * BLOCK]], np.uint64),
        "all": np.array([[0, size]], np.uint64),
    }


def timed(fn, reps: int) -> float:
    import torch
    fn()  # warm-up: the first call loads the module (JIT)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(cache, reps: int) -> float:
    """Bytes per second a torch int64 sum reads the tensor at: the bandwidth here."""
    import torch
    words = cache.view(-1).view(torch.int64)
    seconds = timed(lambda: (words.sum(), torch.cuda.synchronize()), reps)
    return words.numel() * 8 / seconds


def check_detects_a_change(cache, region, ranges: np.ndarray) -> bool:
    """One flipped bit in the middle of a kept range changes that range's checksum only."""
    before, after = np.empty(len(ranges), np.uint64), np.empty(len(ranges), np.uint64)
    i = len(ranges) // 2
    at = int(ranges[i, 0] + ranges[i, 1] // 2)
    flat = cache.view(-1)
    region.client.checksum(region.handle, ranges, before)
    flat[at] ^= 4
    region.client.checksum(region.handle, ranges, after)
    flat[at] ^= 4
    return list(np.flatnonzero(before != after)) == [i]


def run(args: argparse.Namespace) -> int:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    import sublet
    from sublet._memory import region_of
    nblocks = int(args.size * GiB) // BLOCK
    cache = sublet.empty(nblocks, BLOCK, dtype=torch.uint8, device="cuda:0")
    cache.view(-1).view(torch.int64).random_()
    region = region_of(cache)
    measured = read_bandwidth(cache, args.reps)
    name = torch.cuda.get_device_name(0)
    print(f"verify on {name}: a {args.size:g} GiB tensor of {nblocks:,} blocks of 64 KiB; read "
          f"bandwidth measured {measured / 1e12:.2f} TB/s (torch int64 sum), nominal "
          f"{args.peak:.2f} TB/s")
    results = {"gpu": name, "size_bytes": nblocks * BLOCK, "read_bandwidth": measured,
               "peak_bandwidth": args.peak * 1e12, "cases": []}
    for case, ranges in keep_sets(nblocks, args.seed).items():
        nbytes = int(ranges[:, 1].sum())
        sums = np.empty(len(ranges), np.uint64)
        seconds = timed(lambda: region.client.checksum(region.handle, ranges, sums), args.reps)
        ok = check_detects_a_change(cache, region, ranges)
        at_measured, at_peak = nbytes / measured, nbytes / (args.peak * 1e12)
        print(f"  {case:<11} {nbytes / GiB:7.2f} GiB in {len(ranges):>7,} ranges: "
              f"{seconds * 1e3:7.2f} ms per checksum ({nbytes / seconds / 1e12:.2f} TB/s), "
              f"{2 * seconds * 1e3:7.2f} ms per loan; limit {at_measured * 1e3:6.2f} ms "
              f"measured, {at_peak * 1e3:6.2f} ms nominal; a flipped bit "
              f"{'found' if ok else 'NOT FOUND'}")
        results["cases"].append({"case": case, "ranges": len(ranges), "bytes": nbytes,
                                 "seconds": seconds, "limit_measured_s": at_measured,
                                 "limit_nominal_s": at_peak, "detects_a_flip": ok})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(c["detects_a_flip"] for c in results["cases"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The cost of verify (checksums of kept ranges) on a GPU, beside the "
                    "memory-bandwidth limit.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", type=float, default=40.0, metavar="GiB",
                        help="the tensor, in 64 KiB blocks")
    parser.add_argument("--reps", type=int, default=5, help="timed checksum passes per case")
    parser.add_argument("--peak", type=float, default=4.8, metavar="TB/s",
                        help="the GPU's nominal memory bandwidth (H200: 4.8)")
    parser.add_argument("--seed", type=int, default=0, help="of the random keep sets")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
