#!/usr/bin/env python3
"""How long keep= takes to become byte ranges: sublet_blocks_ranges, sublet.blocks and long
lists of views, each figure beside a reference measured in the same run. No daemon, no GPU:
CPU tensors have the same attributes, and the ranges are pure arithmetic.

    SUBLET_LIB=$PWD/build/libsublet.so python3 bench/bench_keep.py [--quick]

1. sublet_blocks_ranges for 64 tables (bases) x 200,000 live rows (a random 200k of 600k,
   sorted), on one core and on all this process may use, beside a numpy copy of the bytes it
   writes (the memory bandwidth it is bound by), into fresh memory and into memory touched
   before (fresh memory pays a page fault per 4 KiB: so does a fresh output array).
2. The same through sublet.blocks(layers, live, dim=1) and keep_ranges, from Python objects.
3. What each tensor attribute costs per view, then a keep of 200,000 views, before (the code
   of git HEAD, when it has no bulk path) and now: [cache[:, b] for b in live] of one
   (2, N, 16, 8, 64) bfloat16 cache, and [layer[b] for layer in layers for b in live] of 64
   (N, 2, 16, 8, 64) layer tensors of one region. Rows are 16 to 64 KiB here, not the 256 KiB
   of head_dim 128, so that the untouched address space fits this machine; the work depends
   on the number of views and ranges, not their size.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import operator
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sublet import _keep, _lib  # noqa: E402


def best(fn, reps: int) -> float:
    """The fastest of reps runs of fn, in seconds."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f} ms"


def head_keep_module():
    """sublet/_keep.py as committed (git HEAD), loaded beside the current one: the 'before'."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        src = subprocess.run(["git", "-C", root, "show", "HEAD:sublet/_keep.py"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = os.path.join(tempfile.mkdtemp(), "_keep_head.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("sublet._keep_head", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_c(reps: int, nbases: int, nlive: int, nrows: int) -> None:
    print(f"== sublet_blocks_ranges: {nbases} bases x {nlive:,} live rows of {nrows:,} "
          f"(random, sorted), 64 KiB rows")
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(nrows, nlive, replace=False)).astype(np.int64)
    row_bytes = 65536
    bases = (np.arange(nbases, dtype=np.uint64) * np.uint64(nrows * row_bytes))
    n = _lib.blocks_ranges_count(rows.ctypes.data, len(rows), nrows, bases.ctypes.data,
                                 nbases, row_bytes)
    out = np.empty((n, 2), dtype=np.uint64)
    nbytes = out.nbytes
    print(f"   {n:,} ranges, {nbytes / 2**20:.1f} MiB written; {os.cpu_count()} CPUs, "
          f"{len(os.sched_getaffinity(0))} usable")

    def call(dst):
        return _lib.blocks_ranges(rows.ctypes.data, len(rows), nrows, bases.ctypes.data,
                                  nbases, row_bytes, dst.ctypes.data, n)

    def fresh():
        call(np.empty((n, 2), dtype=np.uint64))

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst[:] = 0
    count = best(lambda: _lib.blocks_ranges_count(rows.ctypes.data, len(rows), nrows,
                                                  bases.ctypes.data, nbases, row_bytes), reps)
    cpus = os.sched_getaffinity(0)
    for label, affinity in (("1 core", {min(cpus)}), (f"{len(cpus)} cores", cpus)):
        os.sched_setaffinity(0, affinity)
        try:
            warm = best(lambda: call(out), reps)
            cold = best(fresh, reps)
            copy_warm = best(lambda: np.copyto(dst, src), reps)
            copy_cold = best(lambda: np.copyto(np.empty(nbytes, np.uint8), src), reps)
        finally:
            os.sched_setaffinity(0, cpus)
        print(f"   {label:8s}: into touched memory {ms(warm)} ({nbytes / warm / 1e9:5.1f} GB/s)"
              f"   numpy copy of {nbytes / 2**20:.0f} MiB {ms(copy_warm)}"
              f" ({nbytes / copy_warm / 1e9:5.1f} GB/s)")
        print(f"   {'':8s}  into a fresh array   {ms(cold)} ({nbytes / cold / 1e9:5.1f} GB/s)"
              f"   numpy copy into fresh     {ms(copy_cold)}"
              f" ({nbytes / copy_cold / 1e9:5.1f} GB/s)")
    print(f"   counting the ranges first (cap 0):  {ms(count)}")


def bench_blocks(reps: int, nlayers: int, nlive: int, nrows: int) -> None:
    print(f"== sublet.blocks(layers, live, dim=1): {nlayers} tensors (2, {nrows:,}, 16) uint8 "
          f"in one region, {nlive:,} live ids")
    region = torch.empty(nlayers * 2 * nrows * 16, dtype=torch.uint8)
    layers = list(region.view(nlayers, 2, nrows, 16).unbind(0))
    live = torch.from_numpy(np.sort(np.random.default_rng(1).choice(nrows, nlive,
                                                                    replace=False)))
    ptr, size = region.data_ptr(), region.nbytes
    make = best(lambda: _keep.blocks(layers, live, dim=1), reps)
    keep = _keep.blocks(layers, live, dim=1)
    ranges = best(lambda: _keep.keep_ranges(keep, ptr, size), reps)
    shuffled = live[torch.randperm(len(live))]
    make_unsorted = best(lambda: _keep.blocks(layers, shuffled, dim=1), reps)
    n = len(_keep.keep_ranges(keep, ptr, size))
    print(f"   blocks() {ms(make)} (ids shuffled: {ms(make_unsorted)}), keep_ranges "
          f"{ms(ranges)}: {n:,} ranges ({n * 16 / 2**20:.0f} MiB), total {ms(make + ranges)}")
    print(f"   {keep!r}")


def attribute_costs(views: list[torch.Tensor], reps: int) -> None:
    T = torch.Tensor
    n = len(views)
    print(f"   per view, read by map() over {n:,} views (ns):")
    costs = {
        "shape (v.shape in a comprehension)": lambda: [v.shape for v in views],
        "stride()": lambda: list(map(T.stride, views)),
        "element_size()": lambda: list(map(T.element_size, views)),
        "nbytes": lambda: list(map(T.nbytes.__get__, views)),
        "data_ptr()": lambda: list(map(T.data_ptr, views)),
        "storage_offset()": lambda: list(map(T.storage_offset, views)),
        "dtype": lambda: list(map(T.dtype.__get__, views)),
        "the loop of shape, stride(), element_size(), data_ptr()":
            lambda: [(v.shape, v.stride(), v.element_size(), v.data_ptr()) for v in views],
    }
    if _keep._same_sizes_strides is not None:
        v0 = views[0]
        shape, strides, nbytes = tuple(v0.shape), v0.stride(), v0.nbytes
        costs["assert_size_stride_grouped (C++, all views)"] = \
            lambda: _keep._same_sizes_strides(views, [shape] * n, [strides] * n)
        costs["countOf(map(nbytes))"] = \
            lambda: operator.countOf(map(T.nbytes.__get__, views), nbytes)
        costs["fromiter(map(data_ptr))"] = \
            lambda: np.fromiter(map(T.data_ptr, views), np.int64, n)
        costs["_one_layout (the three above)"] = lambda: _keep._one_layout(views)
    gc.disable()  # as _group_by_layout does: the loop makes a tuple per view
    try:
        for name, fn in costs.items():
            print(f"      {name:55s} {best(fn, reps) / n * 1e9:7.1f}")
    finally:
        gc.enable()


def bench_views(reps: int, nviews: int, nrows: int, nlayers: int) -> None:
    head = head_keep_module()
    if head is not None and not hasattr(head, "_one_layout"):
        print("   'before': sublet/_keep.py of git HEAD")
    else:
        head = None
    live = np.sort(np.random.default_rng(2).choice(nrows, nviews, replace=False)).tolist()
    cache = torch.empty(2, nrows, 16, 8, 64, dtype=torch.bfloat16)
    views = [cache[:, b] for b in live]
    print(f"== {nviews:,} views cache[:, b] of a {tuple(cache.shape)} bfloat16 cache")
    attribute_costs(views, reps)
    cases = [("[cache[:, b] for b in live]", views, cache.data_ptr(), cache.nbytes)]

    per_layer = nviews // nlayers
    nblocks = nrows // nlayers * 2
    region = torch.empty(nlayers * nblocks * 2 * 16 * 8 * 64, dtype=torch.bfloat16)
    layers = list(region.view(nlayers, nblocks, 2, 16, 8, 64).unbind(0))
    live_l = np.sort(np.random.default_rng(3).choice(nblocks, per_layer, replace=False)).tolist()
    cases.append((f"[layer[b] for layer in {nlayers} layers for b in {per_layer:,} live]",
                  [layer[b] for layer in layers for b in live_l], region.data_ptr(),
                  region.nbytes))
    mixed = list(views)
    mixed[len(mixed) // 2] = cache[:, 0, :8]
    cases.append(("the first list, one view of another shape in the middle", mixed,
                  cache.data_ptr(), cache.nbytes))
    for name, keep, ptr, size in cases:
        print(f"   {name} ({len(keep):,} views):")
        now = best(lambda: _keep.keep_ranges(keep, ptr, size), reps)
        got = _keep.keep_ranges(keep, ptr, size)
        line = f"      now {ms(now)} ({now / len(keep) * 1e9:.0f} ns a view), {len(got):,} ranges"
        if head is not None:
            before = best(lambda: head.keep_ranges(keep, ptr, size), max(1, reps // 2))
            assert head.keep_ranges(keep, ptr, size).tolist() == got.tolist()
            line += f"; before {ms(before)} ({before / now:.0f}x), same ranges"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    reps = 3 if args.quick else 7
    print(f"torch {torch.__version__}, numpy {np.__version__}, {_lib.lib()._name}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    bench_c(reps, 64, 200_000, 600_000)
    bench_blocks(reps, 64, 200_000, 600_000)
    bench_views(reps, 200_000, 300_000, 64)


if __name__ == "__main__":
    main()
