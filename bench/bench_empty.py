#!/usr/bin/env python3
"""sublet.empty, its free, and a release with its resume, each beside the driver's floor for
the same number of 2 MiB handles, measured in the same run (issue 23, item 3).

A fresh process (the parent never creates a CUDA context) times, --reps times each:

  empty     sublet.empty(S): subletd creates S / 2 MiB pages, exports them, the client
            imports and maps them
  free      the tensor dropped: the region's pages unmapped and released (client and daemon)
  release   sublet.release(tensor, keep=[]): every page given back to the driver
  resume    Release.resume(): the pages made and mapped again at the same addresses

Then `sublet_bench_map --floor` (bench/bench_map.c, built with the daemon) does the driver's
part of the same in one process, for the same number of handles: cuMemCreate (POSIX-fd
handles), cuMemExportToShareableHandle + cuMemImportFromShareableHandle (the fd closed),
cuMemMap of each and one cuMemSetAccess over the span; cuMemUnmap + cuMemRelease; and
cuMemCreate + cuMemMap + cuMemSetAccess again. Each figure's floor:

  empty     create + export + import + map + access
  free      unmap + release
  release   unmap + release
  resume    create + map + access (again; the export and import are printed beside it)

Figures are medians of --reps; the floor's too. Target: every figure within 1.2 x its floor
(PASS/MISS). The daemon is one started for the run as a user gets it by default (no --pin).

    python3 bench/bench_empty.py                 # S = 16 GiB, 3 repetitions
    python3 bench/bench_empty.py --size 64 --json empty.json
    python3 bench/bench_empty.py --size max      # all free GPU memory but the headroom

With SUBLET_BACKEND=memfd it runs on the memfd backend (device "cpu"; the CPU test's way).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import benchmark as bm  # the main benchmark's helpers: log, sizes, subletd, children

SCRIPT = Path(__file__).resolve()
GiB, MiB = bm.GiB, bm.MiB
HEADROOM = 2 * GiB           # --size max leaves this free: the contexts, the floor's own
TARGET_FLOOR_RATIO = 1.2     # every figure within 1.2 x the driver's floor
SCHEMA = "sublet-bench-empty/1"
# Each figure's floor: the sum of these phases of `sublet_bench_map --floor`.
FLOOR_PHASES = {
    "empty": ("create", "export", "import", "map", "access"),
    "free": ("unmap", "release"),
    "release": ("unmap", "release"),
    "resume": ("create_again", "map_again", "access_again"),
}
FIGURES = tuple(FLOOR_PHASES)


# --------------------------------------------------------------------------- child

def _device() -> str:
    """'cuda' (with its context made), or 'cpu' on the memfd backend."""
    if os.environ.get("SUBLET_BACKEND") == "memfd":
        return "cpu"
    bm.init_cuda()
    return "cuda"


def _sync(device: str) -> None:
    if device == "cuda":
        bm.sync()


def _size_bytes(size_gib: float | str, device: str, page: int) -> int:
    """S in whole pages: --size GiB, or 'max': the daemon's free memory but HEADROOM."""
    import sublet
    if size_gib == "max":
        if device == "cpu":  # the memfd backend: no contexts to leave room for
            size = sublet.info(device).free_bytes
        else:
            size = bm.free_gpu_bytes() - HEADROOM
    else:
        size = int(float(size_gib) * GiB)
    size = size // page * page
    if size < page:
        raise SystemExit(f"--size {size_gib}: no room for a page ({bm.gib(max(size, 0))})")
    return size


def _timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    _sync(device)
    t0 = bm.now()
    out = fn()
    _sync(device)
    return bm.now() - t0, out


def _one_rep(size: int, device: str, groups: bool) -> dict[str, float]:
    """One empty, release, resume and free of S bytes."""
    import torch
    import sublet
    seconds: dict[str, float] = {}
    seconds["empty"], tensor = _timed(
        lambda: sublet.empty(size, dtype=torch.uint8, device=device), device)
    tensor[:: max(1, size // 64)].fill_(1)  # touched, as a tensor in use is
    seconds["release"], rel = _timed(lambda: sublet.release(tensor, keep=[]), device)
    # where a release's time goes: this process letting go of its mappings and handles, the
    # rest being subletd's part and the messages
    seconds["release_client_let_go"] = rel.stats.map_seconds
    seconds["resume"], _ = _timed(lambda: rel.resume(groups=groups), device)

    def drop() -> None:
        nonlocal tensor, rel
        del tensor, rel
        gc.collect()

    seconds["free"], _ = _timed(drop, device)
    return seconds


def child_sublet(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import sublet
    device = _device()
    page = sublet.info(device).page_size
    size = _size_bytes(spec["size_gib"], device, page)
    # The modules and the connection, loaded once as by any process's first region.
    del_me = sublet.empty(page, dtype=torch.uint8, device=device)
    del del_me
    gc.collect()
    reps = []
    for i in range(spec["reps"]):
        reps.append(_one_rep(size, device, spec["groups"]))
        bm.log(f"rep {i}: " + ", ".join(f"{k} {v:.3f} s" for k, v in reps[-1].items()))
    return {"size_bytes": size, "page_bytes": page, "handles": size // page,
            "device": device, "reps": reps}


# --------------------------------------------------------------------------- the floor

def floor_binary() -> Path:
    """sublet_bench_map: $SUBLET_BENCH_MAP, beside $SUBLETD (a build directory), or ./build."""
    from sublet import _lib
    if os.environ.get("SUBLETD") and not os.environ.get("SUBLET_BENCH_MAP"):
        beside = Path(os.environ["SUBLETD"]).parent / "sublet_bench_map"
        if beside.is_file():
            return beside
    return _lib.find_native("sublet_bench_map", "SUBLET_BENCH_MAP")


def run_floor(handles: int, backend: str, reps: int) -> list[dict[str, Any]]:
    """reps runs of `sublet_bench_map --floor` for `handles` pages, each a process of its own."""
    argv = [str(floor_binary()), "--floor", "--json", "--pages", str(handles), backend]
    runs = []
    for i in range(reps):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): "
                             f"{done.stderr.strip()[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        bm.log(f"floor {i}: " + ", ".join(f"{k[:-2]} {v:.3f}" for k, v in runs[-1].items()
                                          if k.endswith("_s")))
    return runs


# --------------------------------------------------------------------------- report

def median_of(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def figures(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per figure: sublet's median, its floor's (the sum of FLOOR_PHASES), the ratio."""
    out = []
    for name in FIGURES:
        sublet_s = median_of(doc["sublet"]["reps"], name)
        floor_s = sum(median_of(doc["floor"], p + "_s") for p in FLOOR_PHASES[name])
        ratio = sublet_s / floor_s if floor_s > 0 else float("inf")
        out.append({"figure": name, "sublet_s": sublet_s, "floor_s": floor_s, "ratio": ratio,
                    "met": ratio <= TARGET_FLOOR_RATIO})
    return out


def report_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["sublet"]
    size_gib = s["size_bytes"] / GiB
    floor = doc["floor"]
    lines = [f"sublet.empty and release beside the driver's floor: S = {bm.gib(s['size_bytes'])}"
             f", {s['handles']} handles of {s['page_bytes'] >> 20} MiB ({s['device']}; "
             f"medians of {len(s['reps'])} runs, floor of {len(floor)}; resume groups "
             f"{'on' if doc['groups'] else 'off'})",
             f"  {'what':<9} {'sublet s':>9} {'s/GiB':>8} {'floor s':>9} {'s/GiB':>8} "
             f"{'x floor':>8}  target {TARGET_FLOOR_RATIO:g}x"]
    for f in doc["figures"]:
        lines.append(f"  {f['figure']:<9} {f['sublet_s']:>9.3f} {f['sublet_s'] / size_gib:>8.4f}"
                     f" {f['floor_s']:>9.3f} {f['floor_s'] / size_gib:>8.4f} "
                     f"{f['ratio']:>7.2f}x  {'PASS' if f['met'] else 'MISS'}")
    lines.append("  the floor per phase (s per GiB): " + ", ".join(
        f"{k[:-2]} {median_of(floor, k) / size_gib:.4f}" for k in floor[0] if k.endswith("_s")))
    met = sum(f["met"] for f in doc["figures"])
    lines.append(f"targets: {met} of {len(doc['figures'])} met")
    return lines


# --------------------------------------------------------------------------- parent

def _size(text: str) -> float | str:
    if text == "max":
        return text
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("--size is GiB > 0, or 'max'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="sublet.empty, its free, a release and its resume, each beside the "
                    "driver's floor (sublet_bench_map --floor) for the same number of 2 MiB "
                    "handles, in the same run; target: within 1.2 x the floor (PASS/MISS). "
                    "About 1 s per GiB of S with 3 reps on an H200 (estimated).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", type=_size, default=16.0, metavar="GiB",
                   help="S in GiB, or 'max': all free GPU memory but 2 GiB")
    p.add_argument("--reps", type=int, default=3,
                   help="runs of each figure and of the floor; medians are printed")
    p.add_argument("--no-groups", action="store_true",
                   help="resume one handle per page (Release.resume(groups=False)) instead of "
                        "page groups, so that it makes as many handles as its floor")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write the results (every run, the floor's phases) here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.child:
        bm.emit_result(child_sublet(json.loads(a.spec)))
        return 0
    if a.reps < 1:
        raise SystemExit("--reps must be at least 1")
    backend = os.environ.get("SUBLET_BACKEND") or "cuda"
    if backend == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit(bm.NO_GPU.replace("benchmark.py", "bench_empty.py"))
    spec = {"size_gib": a.size, "reps": a.reps, "groups": not a.no_groups}
    started = time.time()
    with bm.daemon_for_run("shared", 0) as daemon:  # the default daemon: nothing pinned ahead
        bm.log(f"sublet: {a.reps} runs at --size {a.size} (a fresh process)")
        child = bm.run_script([str(SCRIPT), "--child", "--spec", json.dumps(spec)],
                              daemon.env, timeout=3600)
    bm.log(f"driver floor: {a.reps} runs of {child['handles']} handles")
    doc = {"schema": SCHEMA, "groups": spec["groups"], "backend": backend, "sublet": child,
           "floor": run_floor(child["handles"], backend, a.reps)}
    doc["figures"] = figures(doc)
    doc["elapsed_s"] = time.time() - started
    print("\n".join(report_lines(doc)))
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
