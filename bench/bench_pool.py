#!/usr/bin/env python3
"""A 64-layer cache in a sublet pool against the same bytes as one tensor, on one CUDA GPU
(issue 21's benchmark case).

Two ways to hold the same S bytes of 64 KiB KV blocks with the same 30% of them live:

  tensor  one tensor from sublet.empty, viewed by blocks; keep = the live blocks' row indices
  layers  64 per-layer tensors made by plain torch.empty inside `with sublet.pool("kv")`;
          keep = sublet.blocks(layers, live, dim=0), the live list of one layer for all

Each case runs in a fresh process (its first cycle is then a process's first loan): a ballast
outside sublet leaves F bytes free, then cycles of `with sublet.lend(...): job()`, where the job
fills a torch tensor of a fraction of S with random numbers. The live set is the same in every
cycle (the benchmark's blocks pattern: uniform random, every page holds kept bytes). Printed
per case: the allocation time (beside sublet.empty's for the tensor case and the driver's
floor, libsublet's `sublet_bench_map`, when built), first and later cycles, and the limit:
the job alone plus the kept bytes that cannot stay on the GPU, max(0, kept + job - (S + F)),
over the pinned link each way, all measured in the same run. Target: layers' later cycles
within 1.1 x tensor's. Kept bits are checked after every cycle (a digest on the GPU).

    python3 bench/bench_pool.py                    # S = 32 GiB, F = 8 GiB, job 75%
    python3 bench/bench_pool.py --size 64 --job 0.25 --cycles 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB, MiB, BLOCK, LAYERS = 1 << 30, 1 << 20, 64 << 10, 64
MARK = "BENCH-POOL "
TARGET = 1.1


def log(message: str) -> None:
    print(f"[bench_pool] {message}", file=sys.stderr, flush=True)


def live_blocks(per_layer: int, seed: int = 7):
    import numpy as np
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(per_layer, per_layer * 3 // 10, replace=False))


def digest(t) -> int:
    """A position-weighted sum of the bits of t on the GPU (int64 wraps: any change shows)."""
    import torch
    words = t.contiguous().view(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=t.device, dtype=torch.int64)
    return int((words * weights).sum())


def make(case: str, size: int):
    """The cache of this case, filled with random bytes, and its keep, and the kept views."""
    import torch
    import sublet
    per_layer = size // LAYERS // BLOCK
    live = live_blocks(per_layer)
    ids = torch.from_numpy(live)
    start = time.perf_counter()
    if case == "tensor":
        cache = sublet.empty(LAYERS * per_layer, BLOCK, dtype=torch.uint8)
        torch.cuda.synchronize()
        made = time.perf_counter() - start
        layers = list(cache.view(LAYERS, per_layer, BLOCK))
        rows = torch.cat([ids + layer * per_layer for layer in range(LAYERS)])
        keep = rows
        what = cache
    else:
        with sublet.pool("kv"):
            layers = [torch.empty(per_layer, BLOCK, dtype=torch.uint8, device="cuda")
                      for _ in range(LAYERS)]
        torch.cuda.synchronize()
        made = time.perf_counter() - start
        keep = sublet.blocks(layers, ids, dim=0)
        what = "kv"
    for layer in layers:
        layer.random_(0, 256)
    return what, keep, layers, ids, made


def child(case: str, size: int, free: int, job_share: float, cycles: int) -> dict:
    import torch
    import sublet
    what, keep, layers, ids, made = make(case, size)
    job_bytes = int(size * job_share) // 4 * 4

    def job() -> None:
        x = torch.empty(job_bytes // 4, dtype=torch.float32, device="cuda")
        x.random_()
        torch.cuda.synchronize()
        del x

    def kept_digest() -> int:
        return sum(digest(layer[ids]) for layer in layers)

    torch.cuda.synchronize()
    job_start = time.perf_counter()  # the job alone, on PyTorch memory, before the ballast
    job()
    job_alone = time.perf_counter() - job_start
    torch.cuda.empty_cache()
    ballast = torch.empty(max(0, torch.cuda.mem_get_info()[0] - free - GiB), dtype=torch.uint8,
                          device="cuda")
    expected, times, copied, moved = kept_digest(), [], [], []
    for _ in range(1 + cycles):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with sublet.lend(what, keep=keep) as loan:
            job()
        times.append(time.perf_counter() - start)
        copied.append(loan.stats.copied_out_bytes)
        moved.append(loan.stats.moved_bytes)
        if kept_digest() != expected:
            raise SystemExit(f"{case}: kept bits changed")
    del ballast
    return {"case": case, "alloc_s": made, "job_alone_s": job_alone, "first_s": times[0],
            "later_s": times[1:], "copied_bytes": copied, "moved_bytes": moved,
            "kept_bytes": int(len(ids)) * BLOCK * LAYERS, "job_bytes": job_bytes}


def link_bandwidth() -> float:
    """Pinned host link, device to host, in bytes per second (best of 3 GiB copies)."""
    import torch
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return GiB / best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=float, default=32, help="GiB of cache (default 32)")
    p.add_argument("--free", type=float, default=8, help="GiB free beside it (default 8)")
    p.add_argument("--job", type=float, default=0.75, help="job size as a share of the cache")
    p.add_argument("--cycles", type=int, default=4, help="later cycles per case")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--child", choices=("tensor", "layers"), help=argparse.SUPPRESS)
    a = p.parse_args()
    size, free = int(a.size * GiB) // (LAYERS * 2 * MiB) * LAYERS * 2 * MiB, int(a.free * GiB)
    if a.child:
        print(MARK + json.dumps(child(a.child, size, free, a.job, a.cycles)), flush=True)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench_pool.py needs a CUDA GPU", file=sys.stderr)
        return 2
    bandwidth = link_bandwidth()
    log(f"pinned link {bandwidth / 1e9:.1f} GB/s; S {size / GiB:.1f} GiB, F {a.free} GiB, "
        f"job {a.job:.0%}")
    results = {}
    for case in ("tensor", "layers"):
        out = subprocess.run([sys.executable, str(SCRIPT), "--child", case, "--size",
                              str(a.size), "--free", str(a.free), "--job", str(a.job),
                              "--cycles", str(a.cycles)], capture_output=True, text=True)
        line = [x for x in out.stdout.splitlines() if x.startswith(MARK)]
        if out.returncode != 0 or not line:
            print(out.stderr, file=sys.stderr)
            return 1
        results[case] = r = json.loads(line[-1][len(MARK):])
        host = max(0, r["kept_bytes"] + r["job_bytes"] - (size + free))
        r["limit_s"] = r["job_alone_s"] + 2 * host / bandwidth
        later = statistics.median(r["later_s"])
        print(f"{case:7s} alloc {r['alloc_s']:.3f} s; first {r['first_s']:.3f} s, later "
              f"{later:.3f} s (median of {len(r['later_s'])}); limit {r['limit_s']:.3f} s "
              f"({later / r['limit_s']:.2f} x); to the host {r['copied_bytes'][-1] / GiB:.2f} "
              f"GiB, moved {r['moved_bytes'][-1] / GiB:.2f} GiB")
    ratio = statistics.median(results["layers"]["later_s"]) / \
        statistics.median(results["tensor"]["later_s"])
    alloc = results["layers"]["alloc_s"] / results["tensor"]["alloc_s"]
    print(f"layers / tensor: later cycles {ratio:.2f} x (target {TARGET} x: "
          f"{'met' if ratio <= TARGET else 'missed'}); allocation {alloc:.2f} x (target 1.2 x: "
          f"{'met' if alloc <= 1.2 else 'missed'})")
    if a.json:
        a.json.write_text(json.dumps({"bandwidth": bandwidth, "size": size, "free": free,
                                      "job": a.job, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
