#!/usr/bin/env python3
"""The daemon itself, on the GPU (issue 4's second, smaller benchmark).

  region creation     seconds per GiB of sublet.empty (the daemon creates and exports the
                      pages, the client imports and maps them), and of releasing it
  first-loan mapping  seconds per GiB mapped, from the loan's stats (map_seconds), for a loan
                      that allocates the whole unkept part (keep=[]): with the borrower in the
                      owner's process (sublet.lend), and in another process (sublet.offer in
                      this one, sublet.borrow in a fresh one); plus the next loan, whose
                      mappings should already be there
  alloc/free          the round trip of sublet_alloc + sublet_free of 2 MiB through the
                      daemon, called through ctypes on the package's client (p50, p99). A
                      torch.empty + del inside a loan would mostly time PyTorch's cache.
  restore             seconds per GiB of copying kept bytes back (copy_in_seconds /
                      copied_in_bytes of the stats), and of saving them, for a loan that keeps
                      everything and a borrower that must use the kept pages (a ballast leaves
                      only --free-left of free GPU memory)

The round trip with 1, 8 and 64 concurrent clients is build/sublet_bench_rtt's job (C; run it
against a daemon's socket: `build/sublet_bench_rtt SOCKET [ITERATIONS]`); not repeated here.

The run uses one subletd started for it (pinning --daemon-pin of host memory ahead), or the
one $SUBLET_SOCKET names. Table on stdout, JSON with --json, progress on stderr.

    python3 bench/bench_daemon.py                 # 16 GiB regions, about a minute on an H200
    python3 bench/bench_daemon.py --size 4 --reps 2
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark as bench  # noqa: E402  (this directory's helpers; nothing GPU at import)

SCRIPT = Path(__file__).resolve()
GiB, MiB = bench.GiB, bench.MiB
TARGET_MAP_S_PER_GIB = 0.03  # first-loan mapping, borrower in the owner's process


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def per_gib(seconds: float, nbytes: float) -> float | None:
    return seconds / (nbytes / GiB) if nbytes else None


def loan_summary(stats: Any, wall_s: float) -> dict[str, Any]:
    """A loan's stats, plus the bytes it mapped and the mapping time per GiB."""
    st = stats if isinstance(stats, dict) else asdict(stats)
    mapped = st["served_unkept_bytes"] + st["served_fresh_bytes"] + st["served_kept_bytes"]
    return {"wall_s": wall_s, "mapped_bytes": mapped,
            "map_s_per_gib": per_gib(st["map_seconds"], mapped), "stats": st}


# --------------------------------------------------------------------------- measurements

def region_creation(size: int, reps: int) -> dict[str, Any]:
    import torch
    import sublet
    warm = sublet.empty(2 * MiB, dtype=torch.uint8)  # connects to the daemon
    del warm
    gc.collect()
    create, release = [], []
    for _ in range(reps):
        t0 = bench.now()
        tensor = sublet.empty(size, dtype=torch.uint8)
        bench.sync()
        t1 = bench.now()
        del tensor
        gc.collect()
        release.append(bench.now() - t1)
        create.append(t1 - t0)
    return {"bytes": size, "create_s": create, "release_s": release,
            "create_s_per_gib": per_gib(median(create), size),
            "release_s_per_gib": per_gib(median(release), size)}


def _lend_and_fill(tensor: Any, keep: Any, nbytes: int, touch: bool) -> dict[str, Any]:
    """One loan of `tensor` whose borrower allocates nbytes from it (Loan.empty)."""
    import torch
    import sublet
    t0 = bench.now()
    with sublet.lend(tensor, keep=keep) as loan:
        x = loan.empty(nbytes, dtype=torch.uint8)
        if touch:
            x.zero_()
            bench.sync()
        del x
    return loan_summary(loan.stats, bench.now() - t0)


def mapping_local(size: int, reps: int) -> dict[str, Any]:
    """First and next loan of a fresh region, keep=[], borrower in this process."""
    import torch
    import sublet
    first, following = [], []
    for _ in range(reps):
        tensor = sublet.empty(size, dtype=torch.uint8)
        first.append(_lend_and_fill(tensor, [], size, touch=False))
        following.append(_lend_and_fill(tensor, [], size, touch=False))
        del tensor
        gc.collect()
    return {"bytes": size, "first": first, "next": following,
            "first_map_s_per_gib": median([r["map_s_per_gib"] for r in first]),
            "next_map_s_per_gib": median([r["map_s_per_gib"] for r in following])}


def mapping_remote(size: int, reps: int) -> dict[str, Any]:
    """First loan of a fresh region, keep=[], borrowed by a fresh process."""
    import torch
    import sublet
    if not (hasattr(sublet, "offer") and hasattr(sublet, "borrow")):
        return {"skipped": "this sublet package has no sublet.offer / sublet.borrow"}
    runs = []
    for rep in range(reps):
        tensor = sublet.empty(size, dtype=torch.uint8)
        name = f"bench-daemon-{os.getpid()}-{rep}"
        offer = sublet.offer(tensor, keep=[], name=name)
        try:
            child = bench.run_script([str(SCRIPT), "--child-borrow", name, str(size)], {},
                                     timeout=600)
            offer.wait(timeout=120)
        except (bench.ChildFailed, sublet.SubletError) as e:
            return {"skipped": f"the borrowing process failed: {e}"}
        finally:
            with contextlib.suppress(sublet.SubletError):
                offer.close()
        runs.append({**loan_summary(child["stats"], child["wall_s"]),
                     "borrow_s": child["borrow_s"]})
        del tensor, offer  # the offer holds the tensor: both go, so the region is released
        gc.collect()
    return {"bytes": size, "runs": runs,
            "first_map_s_per_gib": median([r["map_s_per_gib"] for r in runs])}


def child_borrow(name: str, nbytes: int) -> int:
    """The other process: borrows the named loan and allocates nbytes from it."""
    bench.init_cuda()
    import torch
    import sublet
    bench._log_prefix = "borrower"
    t0 = bench.now()
    with sublet.borrow(name=name, timeout=120) as loan:
        t1 = bench.now()
        x = loan.empty(nbytes, dtype=torch.uint8)
        del x
    bench.emit_result({"stats": asdict(loan.stats), "borrow_s": t1 - t0,
                       "wall_s": bench.now() - t0})
    return 0


def _client_handle(loan: Any) -> ctypes.c_void_p:
    """The sublet_client * the loan borrows with (the package's one connection per device)."""
    client = getattr(loan, "_client", None)
    if client is None:
        from sublet import _client, _daemon
        import torch
        client = _client.client_for(_daemon.requested_backend(), torch.cuda.current_device())
    return client.handle


def alloc_free_round_trip(iterations: int, warmup: int = 200) -> dict[str, Any]:
    """sublet_alloc + sublet_free of 2 MiB inside a loan, through ctypes (C calls only)."""
    import torch
    import sublet
    from sublet import _lib
    lib, ptr, nbytes = _lib.lib(), ctypes.c_void_p(), 2 * MiB
    tensor = sublet.empty(64 * MiB, dtype=torch.uint8)
    times_ns = []
    with sublet.lend(tensor, keep=[]) as loan:
        handle = _client_handle(loan)
        for i in range(warmup + iterations):  # the warm-up maps the pages once
            t0 = time.perf_counter_ns()
            rc = lib.sublet_alloc(handle, nbytes, ctypes.byref(ptr))
            if rc == 0:
                rc = lib.sublet_free(handle, ptr)
            t1 = time.perf_counter_ns()
            _lib.check(rc)
            if i >= warmup:
                times_ns.append(t1 - t0)
    times_us = sorted(t / 1000 for t in times_ns)
    return {"bytes": nbytes, "iterations": iterations,
            "p50_us": times_us[len(times_us) // 2],
            "p99_us": times_us[min(len(times_us) - 1, int(len(times_us) * 0.99))],
            "mean_us": statistics.fmean(times_us), "max_us": times_us[-1]}


def restore(size: int, free_left: int, reps: int) -> dict[str, Any]:
    """Loans that keep everything, with a borrower that fills the whole region's size: with
    only free_left of free GPU memory it must take kept pages, whose bytes are saved and then
    restored."""
    import torch
    import sublet
    tensor = sublet.empty(size, dtype=torch.uint8)
    bench.fill_random(tensor)
    before = bench.wrapping_sum(tensor)
    ballast, free_measured = bench.make_ballast(free_left)
    loans = [_lend_and_fill(tensor, None, size, touch=True) for _ in range(reps)]
    del ballast
    torch.cuda.empty_cache()
    for loan in loans:
        st = loan["stats"]
        loan["copy_out_s_per_gib"] = per_gib(st["copy_out_seconds"], st["copied_out_bytes"])
        loan["copy_in_s_per_gib"] = per_gib(st["copy_in_seconds"], st["copied_in_bytes"])
    later = loans[1:] or loans
    return {"bytes": size, "free_bytes_measured": free_measured, "loans": loans,
            "kept_intact": bench.wrapping_sum(tensor) == before,
            "first_copy_in_s_per_gib": loans[0]["copy_in_s_per_gib"],
            "copy_in_s_per_gib": median([x["copy_in_s_per_gib"] for x in later
                                         if x["copy_in_s_per_gib"] is not None]),
            "copy_out_s_per_gib": median([x["copy_out_s_per_gib"] for x in later
                                          if x["copy_out_s_per_gib"] is not None])}


# --------------------------------------------------------------------------- report

def _s_per_gib(value: float | None, rate: bool = False) -> str:
    """'0.0123 s/GiB', with the matching GB/s for copies (rate)."""
    if value is None or value != value:  # None or NaN
        return "-"
    if rate and value > 0:
        return f"{value:.4f} s/GiB ({GiB / value / 1e9:.1f} GB/s)"
    return f"{value:.4f} s/GiB"


def report_lines(results: dict[str, Any]) -> list[str]:
    r = results
    size = bench.gib(r["region"]["bytes"])
    rows = [("region creation (sublet.empty)",
             f"{_s_per_gib(r['region']['create_s_per_gib'])}; release "
             f"{_s_per_gib(r['region']['release_s_per_gib'])}; {size}")]
    local = r["map_local"]
    rows.append(("first-loan mapping, owner's process",
                 f"{_s_per_gib(local['first_map_s_per_gib'])}; next loan "
                 f"{_s_per_gib(local['next_map_s_per_gib'])}"))
    remote = r["map_remote"]
    rows.append(("first-loan mapping, another process",
                 f"skipped: {remote['skipped']}" if "skipped" in remote else
                 _s_per_gib(remote["first_map_s_per_gib"])))
    rtt = r["rtt"]
    rows.append(("alloc/free round trip, 2 MiB",
                 f"p50 {rtt['p50_us']:.1f} us, p99 {rtt['p99_us']:.1f} us "
                 f"({rtt['iterations']} pairs, max {rtt['max_us']:.0f} us)"))
    rs = r["restore"]
    copied = rs["loans"][0]["stats"]["copied_in_bytes"]
    rows.append(("restore (copy in) per GiB",
                 f"{_s_per_gib(rs['copy_in_s_per_gib'], True)}; first loan "
                 f"{_s_per_gib(rs['first_copy_in_s_per_gib'], True)}; {bench.gib(copied)} "
                 f"copied, "
                 f"kept data intact: {rs['kept_intact']}"))
    rows.append(("save (copy out) per GiB", _s_per_gib(rs["copy_out_s_per_gib"], True)))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    first = local["first_map_s_per_gib"]
    met = first is not None and first == first and first <= TARGET_MAP_S_PER_GIB
    lines += ["", f"target: first-loan mapping in the owner's process <= "
                  f"{TARGET_MAP_S_PER_GIB} s/GiB: {'met' if met else 'NOT MET'} "
                  f"({_s_per_gib(first)})",
              "the round trip with 1, 8 and 64 concurrent clients: build/sublet_bench_rtt "
              "SOCKET [ITERATIONS] (C) against a running subletd"]
    return lines


# --------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Benchmark subletd on the GPU: region creation, first-loan mapping, the "
                    "alloc/free round trip, restore speed.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", type=float, default=16.0, metavar="GiB",
                        help="region size for creation, mapping and restore")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    parser.add_argument("--rtt-iterations", type=int, default=2000,
                        help="timed alloc/free pairs")
    parser.add_argument("--free-left", type=float, default=2.0, metavar="GiB",
                        help="free GPU memory left beside the region for the restore test")
    parser.add_argument("--daemon-pin", type=float, default=None, metavar="GiB",
                        help="host memory the subletd started here pins ahead (default: "
                             "--size, so that restores do not pay for pinning)")
    parser.add_argument("--json", type=Path,
                        default=bench.REPO / "bench" / "daemon-results.json",
                        help="where to write the results")
    parser.add_argument("--child-borrow", nargs=2, metavar=("NAME", "BYTES"),
                        help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> int:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit(bench.NO_GPU.replace("benchmark.py", "bench_daemon.py"))
    size = int(args.size * GiB) // (2 * MiB) * (2 * MiB)
    pin = int((args.daemon_pin if args.daemon_pin is not None else args.size) * GiB)
    with bench.daemon_for_run("shared", pin) as daemon:
        os.environ.update(daemon.env)  # this process and its borrower use it
        bench.init_cuda()
        results: dict[str, Any] = {"schema": "sublet-bench-daemon/1",
                                   "machine": bench.machine_info(),
                                   "daemon": daemon.describe()}
        steps = [("region", "region creation", lambda: region_creation(size, args.reps)),
                 ("map_local", "first-loan mapping, owner's process",
                  lambda: mapping_local(size, args.reps)),
                 ("map_remote", "first-loan mapping, another process",
                  lambda: mapping_remote(size, args.reps)),
                 ("rtt", "alloc/free round trip", lambda: alloc_free_round_trip(
                     args.rtt_iterations)),
                 ("restore", "restore", lambda: restore(size, int(args.free_left * GiB),
                                                        args.reps))]
        for key, what, measure in steps:
            with bench.step(what):
                results[key] = measure()
    results["daemon"] = daemon.describe()  # now with its log
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    machine = results["machine"]
    print(f"subletd on {machine['gpu']} (driver {machine['driver']}), torch "
          f"{machine['torch']}; daemon {results['daemon']['mode']}, "
          f"{bench.gib(results['daemon']['pin_bytes'])} pinned ahead")
    for line in report_lines(results):
        print(line)
    bench.log(f"results in {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child_borrow:
        name, nbytes = args.child_borrow
        return child_borrow(name, int(nbytes))
    bench._log_prefix = "bench_daemon"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
