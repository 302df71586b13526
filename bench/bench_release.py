#!/usr/bin/env python3
"""Release loans (sublet.release) against torch_memory_saver's pause/resume on the same memory,
on one CUDA GPU (issue 22's benchmark).

The memory is a KV cache of S bytes (default 64 GiB) as 64 per-layer uint8 tensors of
[blocks, 64 KiB]. A fraction of it is kept (--kept, default 0.3 and 1.0), in one of two
patterns, the same blocks in every layer:

  blocks  64 KiB blocks chosen at random (a paged KV cache's live blocks): nearly every 2 MiB
          page holds some, so keeping them on the GPU means compacting them
  rows    rows of 8 MiB (whole pages) evenly spaced: the kept pages hold only kept bytes
  all     (at 100% kept) everything

Contenders, each in a process of its own (its first cycle is the process's first pause):

  tms all      torch_memory_saver 0.0.10, the cache allocated inside
               region("kv", enable_cpu_backup=True): pause copies all S bytes to the host
  tms best     torch_memory_saver at its best: each layer allocated as two tensors, its kept
               blocks (the fraction kept) inside region("kept", enable_cpu_backup=True) and
               the rest inside region("rest") without backup; pause/resume of both. Only an
               engine that knew its live blocks before allocating could split them off like
               this (scattered live blocks change after allocation): a lower bound for tms,
               the same for both patterns; at 100% kept it is "tms all".
               Both tms cases run with hook_mode="torch" and retain_cpu_backup=True (the
               pinned host buffer is made at the first pause and kept: its best case).
  sublet       the cache made by plain torch.empty inside `with sublet.pool("kv")`;
               rel = sublet.release("kv", keep=sublet.blocks(layers, ids), stay=...) then
               rel.resume(); stay=None (as few pages stay as hold the kept bytes: nothing to
               the host) and stay=0 (every kept byte to the host, as tms's backup)

A cycle: pause (release), then a plain torch.empty of the freed memory (less 1 GiB) written and
given back (the memory is really the driver's), then resume; by the pausing process itself
(--taker same, the default: a trainer colocated with the engine) or by a process of its own
(--taker other: a trainer beside the engine, as in slime or verl; the driver then hands the
resume memory another process freed). Timed: pause + resume. After every cycle every kept bit
is digested on the GPU and compared (a change fails the case).

Beside each figure: the bytes that crossed the host link, the bytes moved on the GPU, and the
physical limit: bytes over the link / the pinned link bandwidth (each way) + bytes moved on
the GPU (there and back) / the device-to-device bandwidth, all measured in the same run, plus
the driver's floor for the handles released and made again (cuMemUnmap + cuMemRelease at
pause, cuMemCreate + cuMemMap + cuMemSetAccess at resume, of the same number and size of
handles in one process, through ctypes on libcuda). The task's own minimum for stay=None (the
kept bytes that must move so that the fewest pages stay, the pages holding the most kept bytes
staying) is printed for each keep.

Targets (PASS/MISS): at 30% kept, sublet (stay=None) 5 x faster than tms backing up
everything (later cycles); at 100% kept, sublet (stay=0, which frees everything as tms does)
never slower than tms, first and later cycles; nothing over the host link with stay=None.

By need (--need, issue 42): the taker needs N = 10, 25, 50 and 100 % of S (--need PCTS), with
the device's free memory F as the run finds it. Three contenders, each a process of its own
per keep (100 % all; 30 % as blocks and as rows), running every need in turn:

  tms all      torch_memory_saver pausing everything (as above)
  sublet all   sublet.release("kv", keep=..., stay=0): every page released, every kept byte to
               the host and back
  sublet need  sublet.release("kv", keep=..., need=N): subletd counts F (less the 256 MiB
               the driver keeps back from a taker's allocation, common/device_cuda.h) and
               releases only the pages the rest of the need takes, the cheaper of those
               with the fewest kept bytes and the best run of consecutive ones
               (daemon/books/need_pick.c); their kept bytes move on the device into holes
               of the pages that stay, only what those cannot hold crosses the link

A cycle: pause, the taker allocates N (torch.empty, written, given back), resume; timed:
release + allocation + resume. Beside each figure the physical limit of that need:
bytes over the link each way = max(0, N + slack - F - (S - K)) (what the released pages
cannot give without their kept bytes K), the least bytes moved on the GPU (the kept bytes of
the pages with the fewest, less those), and seconds = link bytes / the link bandwidth each way
+ the moves there and back / the device-to-device bandwidth, measured in the same run. Pages
made again by a resume come back as page groups (release.md), given back whole by a later
release; the choice counts the bytes a group over the need sends to the host. Targets (issue
42): link bytes equal the limit's; later cycles within 1.25 x the limit; the first cycle (at
the largest need) within 1.5 x a later one of that need (both judged at 64 GiB and more); at
100 % kept and a 25 % need, sublet need 3 x faster than tms all. --pin-ahead: each sublet
child pins its kept bytes ahead of its first cycle (timed apart; subletd keeps what is pinned
for later children, whose pin then takes no time); without it the first release pins on its
path.

    python3 bench/bench_release.py                 # S = 64 GiB, kept 30% and 100%
    python3 bench/bench_release.py --quick         # S = 4 GiB, 2 cycles: a smoke run
    python3 bench/bench_release.py --size max --kept 0.3 --json out.json
    python3 bench/bench_release.py --contenders sublet --kept 1.0
    python3 bench/bench_release.py --contenders sublet --kept 1.0 --pin-ahead  # pinned first
    python3 bench/bench_release.py --need          # by need: 10,25,50,100 % of S = 64 GiB
    python3 bench/bench_release.py --need 25 --size 16GiB --kept 1.0 --cycles 1

The parent process never creates a CUDA context: every GPU measurement runs in a child.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[1]
if (REPO / "sublet" / "__init__.py").is_file() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # benchmark this checkout's package

GiB, MiB = 1 << 30, 1 << 20
BLOCK = 64 << 10               # a KV block
LAYERS = 64
PAGE = 2 * MiB                 # the GPU's page (VMM granularity on the H200)
ROW = 8 * MiB                  # a row of the rows pattern: whole pages
HEADROOM = 4 * GiB             # --size max leaves this free: contexts, digests, the daemon's
HOST_SHARE = 0.9               # host copies of S may take 90% of MemAvailable
TAKE_MARGIN = GiB              # the plain allocation between pause and resume leaves this
MARK = "BENCH-RELEASE "
TARGET_SPEEDUP = 5.0           # at 30% kept, x faster than tms backing up everything
CONTENDERS = ("tms-all", "tms-best", "sublet", "sublet-need")
NEEDS = "10,25,50,100"         # --need's default: percent of S
NEED_SLACK = 256 * MiB         # SL_CUDA_ALLOC_HEADROOM: a need of N leaves N + this free
NEED_TARGET_LIMIT = 1.25       # later cycles within this x the limit (issue 42)
NEED_TARGET_SPEEDUP = 3.0      # at 100% kept and a 25% need, x faster than tms all
NEED_TARGET_FIRST = 1.5        # a first cycle within this x a later one of the same need
CHILD_TIMEOUT_S = 1800
DIGEST_CHUNK = 256 * MiB


def log(message: str) -> None:
    print(f"[bench_release] {message}", file=sys.stderr, flush=True)


def now() -> float:
    return time.perf_counter()


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# --------------------------------------------------------------------------- pure planning
# (no torch, no GPU: tests/python/test_bench_release_cli.py checks these on the CPU)

def parse_kept(text: str) -> list[float]:
    """'0.3,1.0' -> [0.3, 1.0]; each in (0, 1]."""
    out = []
    for part in text.split(","):
        f = float(part)
        if not 0 < f <= 1:
            raise argparse.ArgumentTypeError(f"--kept {part}: a fraction in (0, 1]")
        out.append(f)
    return out


def size_bytes(size: str) -> int:
    """--size: GiB as a number ('64'), or with its unit ('64GiB', '16 GiB', '1TiB')."""
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(gib|g|tib|t)?\s*", size, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"--size {size!r}: GiB (64, 64GiB) or 'max'")
    unit = 1024 * GiB if (m.group(2) or "g").lower().startswith("t") else GiB
    return int(float(m.group(1)) * unit)


def plan_size(size: str, free_bytes: int) -> int:
    """The cache's bytes: --size GiB (64, 64GiB), or 'max' (all free memory but HEADROOM),
    rounded down to LAYERS whole rows; SystemExit when it does not fit."""
    unit = LAYERS * ROW
    want = free_bytes - HEADROOM if size == "max" else size_bytes(size)
    want = want // unit * unit
    if want <= 0:
        raise SystemExit(f"--size {size}: nothing fits ({gib(free_bytes)} free)")
    if want > free_bytes - HEADROOM // 2:
        raise SystemExit(f"--size {size}: {gib(want)} does not fit in {gib(free_bytes)} free "
                         f"(use --size max)")
    return want


def block_ids(per_layer: int, fraction: float, seed: int = 7):
    """The kept blocks of a layer: a random `fraction` of them, sorted."""
    import numpy as np
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(per_layer, round(per_layer * fraction), replace=False))


def row_ids(per_layer: int, fraction: float):
    """The blocks of round(fraction x rows) evenly spaced rows of ROW bytes (whole pages)."""
    import numpy as np
    per_row = ROW // BLOCK
    nrows = per_layer // per_row
    rows = np.unique(np.linspace(0, nrows, max(1, round(nrows * fraction)),
                                 endpoint=False).astype(np.int64))
    return (rows[:, None] * per_row + np.arange(per_row)).reshape(-1)


def kept_ids(pattern: str, per_layer: int, fraction: float):
    """Kept block ids of one layer (the same in every layer); None: all of it."""
    if pattern == "all":
        return None
    if pattern == "blocks":
        return block_ids(per_layer, fraction)
    if pattern == "rows":
        return row_ids(per_layer, fraction)
    raise ValueError(f"unknown pattern {pattern!r}")


def must_move(ids, per_layer: int, layers: int = LAYERS) -> int:
    """The fewest kept bytes that must move on the GPU for the fewest pages to stay: T =
    ceil(kept / PAGE) pages stay, the T holding the most kept bytes; the kept bytes of the
    others move into them. Each layer starts on a page (its own segment of whole pages)."""
    import numpy as np
    per_page = PAGE // BLOCK
    if ids is None:
        return 0
    pages = np.bincount(np.asarray(ids) // per_page,
                        minlength=-(-per_layer // per_page)) * BLOCK
    everywhere = np.tile(pages, layers)
    kept = int(everywhere.sum())
    stay = -(-kept // PAGE)
    return kept - int(np.sort(everywhere)[::-1][:stay].sum())


def plan_cases(fractions: list[float], contenders: list[str], size: int, host_bytes: int,
               tms_ok: bool, cycles: int, tms_cycles: int, taker: str = "same",
               pin_ahead: bool = False) -> tuple[list[dict], list[str]]:
    """The child processes to run, tms first (before subletd pins host memory), and notes on
    what is skipped and why."""
    host_cap = int(host_bytes * HOST_SHARE)
    cases, notes = [], []
    base = {"size": size, "per_layer": size // LAYERS // BLOCK, "taker": taker}

    def add(spec: dict, host_needed: int) -> None:
        if host_needed > host_cap:
            notes.append(f"{spec['label']}: skipped, its {gib(host_needed)} of host copies do "
                         f"not fit in 90% of MemAvailable ({gib(host_cap)})")
            return
        cases.append(spec)

    tms = [c for c in contenders if c.startswith("tms")]
    if tms and not tms_ok:
        notes.append("torch_memory_saver: skipped, not importable here (pip install "
                     "torch_memory_saver==0.0.10)")
    elif "tms-all" in tms:
        add({**base, "mode": "tms", "label": "tms all (backup of everything)", "split": None,
             "cycles": tms_cycles, "fraction": 1.0}, size)
    if tms_ok and "tms-best" in tms:
        for f in fractions:
            if f < 1:
                add({**base, "mode": "tms", "label": f"tms best (kept {f:.0%} split off)",
                     "split": f, "cycles": tms_cycles, "fraction": f}, int(size * f))
    if "sublet" in contenders:
        for f in fractions:
            for pattern in (("all",) if f >= 1 else ("blocks", "rows")):
                for stay in ((0,) if f >= 1 else (None, 0)):
                    label = f"sublet {pattern} {f:.0%} stay={stay}"
                    add({**base, "mode": "sublet", "label": label, "pattern": pattern,
                         "fraction": f, "stay": stay, "cycles": cycles,
                         "pin_ahead": pin_ahead and stay == 0},
                        int(size * f) if stay == 0 else 0)
        if any(f >= 1 for f in fractions):
            notes.append("sublet all 100% stay=None: not run (every page holds kept bytes and "
                         "stays: nothing is released)")
    return cases, notes



def parse_need(text: str) -> list[float]:
    """--need '10,25,50,100' (percent of S, '%' allowed) -> [0.1, 0.25, 0.5, 1.0]."""
    out = []
    for part in text.split(","):
        try:
            pct = float(part.strip().removesuffix("%"))
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise argparse.ArgumentTypeError(f"--need {part}: a percent of the cache in (0, 100]")
        out.append(pct / 100)
    return out


def page_kept(ids, per_layer: int, layers: int = LAYERS) -> list[list[int]]:
    """[[kept bytes, pages], ...] of the cache's pages for a keep (ids None: all kept): what
    benchmark.least_displaced takes. Each layer starts on a page."""
    import numpy as np
    per_page = PAGE // BLOCK
    npages = -(-per_layer // per_page)
    if ids is None:
        return [[PAGE, npages * layers]]
    kept = np.bincount(np.asarray(ids) // per_page, minlength=npages) * BLOCK
    values, counts = np.unique(kept, return_counts=True)
    return [[int(v), int(c) * layers] for v, c in zip(values, counts)]


def need_limit(kept_pages: list[list[int]], need: int, free: int, bw: dict) -> dict:
    """The physical limit of a release by need: the least bytes over the link each way,
    max(0, need - free - what the released pages can give without their kept bytes), and the
    least moved on the GPU (benchmark.least_displaced: the pages with the fewest kept bytes
    go, their kept bytes into the holes of those that stay); seconds at the measured speeds."""
    moved, host = bench_module().least_displaced(kept_pages, PAGE, need, free)
    seconds = host / bw["d2h"] + host / bw["h2d"] + 2 * moved / bw["d2d"]
    return {"host_bytes": host, "moved_bytes": moved, "seconds": seconds}


def plan_need_cases(fractions: list[float], contenders: list[str], needs: list[float],
                    size: int, host_bytes: int, tms_ok: bool, cycles: int, tms_cycles: int,
                    taker: str = "same", pin_ahead: bool = False) -> tuple[list[dict], list[str]]:
    """The children of a run by need: tms all once (its pause does not depend on the keep),
    then per keep (100 %: all; less: blocks and rows) sublet all and sublet need, each
    running every need (pin_ahead: each sublet child pins its kept bytes ahead); notes on
    what is skipped and why."""
    host_cap = int(host_bytes * HOST_SHARE)
    base = {"size": size, "per_layer": size // LAYERS // BLOCK, "taker": taker,
            "needs": needs}
    cases, notes = [], []
    if "tms-best" in contenders:
        notes.append("tms best: not run by need (tms all is torch_memory_saver's pause)")
    if "tms-all" in contenders:
        if not tms_ok:
            notes.append("torch_memory_saver: skipped, not importable here (pip install "
                         "torch_memory_saver==0.0.10)")
        elif size > host_cap:
            notes.append(f"tms all: skipped, its {gib(size)} of host copies do not fit in 90% "
                         f"of MemAvailable ({gib(host_cap)})")
        else:
            cases.append({**base, "mode": "tms", "label": "tms all", "split": None,
                          "cycles": tms_cycles, "fraction": 1.0, "pattern": "all"})
    for f in fractions:
        for pattern in (("all",) if f >= 1 else ("blocks", "rows")):
            for contender, stay in (("sublet", 0), ("sublet-need", None)):
                if contender not in contenders:
                    continue
                label = f"sublet {'need' if stay is None else 'all'} {pattern} {f:.0%}"
                if stay == 0 and int(size * f) > host_cap:
                    notes.append(f"{label}: skipped, its {gib(size * f)} of host copies do not "
                                 f"fit in 90% of MemAvailable ({gib(host_cap)})")
                    continue
                cases.append({**base, "mode": "sublet", "label": label, "pattern": pattern,
                              "fraction": f, "stay": stay, "by_need": stay is None,
                              "cycles": cycles, "pin_ahead": pin_ahead})
    return cases, notes


# --------------------------------------------------------------------------- report

def later(r: dict) -> float:
    """The median of a case's later cycles (its first when it ran only one)."""
    seconds = [c["seconds"] for c in r["cycles"]]
    return statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]


def limit_seconds(r: dict, bw: dict) -> float:
    """Bytes over the link each way at the pinned bandwidth, plus the bytes moved on the GPU
    (there and back) at the device-to-device bandwidth, of the case's last cycle."""
    c = r["cycles"][-1]
    return (c["out_bytes"] / bw["d2h"] + c["in_bytes"] / bw["h2d"]
            + 2 * c["moved_bytes"] / bw["d2d"])


def case_lines(r: dict, bw: dict, floor: float | None) -> list[str]:
    """A case's figures, its bytes and limit, its release stats and its keep's minimum."""
    first, rest = r["cycles"][0], r["cycles"][-1]
    limit = limit_seconds(r, bw)
    floor_text = f" + driver floor {floor:.3f} s" if floor is not None else ""
    pinned = (f"      pinned ahead for the release in {r['pin_ahead_s']:.3f} s, before the first "
              f"cycle (sublet.pin_ahead)" if r.get("pin_ahead_s") is not None else None)
    lines = [
        f"  {r['label']:34s} first {first['seconds']:7.3f} s (pause {first['pause_s']:.3f} + "
        f"resume {first['resume_s']:.3f}), later {later(r):7.3f} s (median of "
        f"{max(1, len(r['cycles']) - 1)})",
        f"      link {gib(rest['out_bytes'])} out + {gib(rest['in_bytes'])} in, moved on the GPU "
        f"{gib(rest['moved_bytes'])}, freed {gib(rest['freed_bytes'])}; limit {limit:.3f} s"
        f"{floor_text}: later is {later(r) / max(limit + (floor or 0.0), 1e-9):.1f} x"]
    if pinned:
        lines.append(pinned)
    s = rest.get("stats")
    if s:
        sizes = ", ".join(f"{k.removesuffix('_bytes')} {gib(s[k])}" for k in
                          ("released_bytes", "stayed_bytes", "kept_bytes", "moved_bytes",
                           "copied_bytes", "copied_in_bytes") if k in s)
        phases = ", ".join(f"{k.removesuffix('_seconds')} {s[k]:.4f}" for k in s
                           if k.endswith("_seconds"))
        lines.append(f"      stats: {sizes}; seconds: {phases}")
    if r["mode"] == "sublet" and r["stay"] is None and "must_move_bytes" in r:
        lines.append(f"      keep {r['pattern']}: {gib(r['kept_bytes'])} kept; with the fewest "
                     f"pages staying at least {gib(r['must_move_bytes'])} must move (there and "
                     f"back {2 * r['must_move_bytes'] / bw['d2d']:.3f} s)")
    return lines


def targets(results: list[dict]) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when it could not be judged, the figures)."""
    ok = [r for r in results if not r.get("error")]
    tms_all = next((r for r in ok if r["mode"] == "tms" and r["split"] is None), None)
    out: list[tuple[str, bool | None, str]] = []
    for r in ok:
        if r["mode"] == "sublet" and r["stay"] is None and abs(r["fraction"] - 0.3) < 1e-9:
            name = f"{r['label']}: {TARGET_SPEEDUP:.0f} x faster than tms backing up everything"
            if tms_all is None:
                out.append((name, None, "tms did not run"))
            else:
                x = later(tms_all) / later(r)
                out.append((name, x >= TARGET_SPEEDUP, f"{later(tms_all):.3f} s / "
                            f"{later(r):.3f} s = {x:.1f} x (later cycles)"))
    for r in ok:
        if r["mode"] == "sublet" and r["fraction"] >= 1 and r["stay"] == 0:
            name = f"{r['label']}: never slower than tms (100% kept)"
            if tms_all is None:
                out.append((name, None, "tms did not run"))
                continue
            a, b = r["cycles"][0]["seconds"], tms_all["cycles"][0]["seconds"]
            out.append((name, a <= b and later(r) <= later(tms_all),
                        f"first {a:.3f} s vs {b:.3f} s, later {later(r):.3f} s vs "
                        f"{later(tms_all):.3f} s"))
    stay_none = [r for r in ok if r["mode"] == "sublet" and r["stay"] is None]
    if stay_none:
        crossed = sum(c["out_bytes"] + c["in_bytes"] for r in stay_none for c in r["cycles"])
        out.append(("nothing over the host link when the kept bytes fit in the pages that stay "
                    "(stay=None)", crossed == 0, f"{crossed} bytes over {len(stay_none)} cases"))
    return out


def report(doc: dict) -> int:
    """Prints the table and the targets; returns the exit status (1 when a case failed)."""
    bw, results = doc["bandwidth"], doc["results"]
    floors = doc.get("floors", {})
    print(f"GPU {doc['probe']['gpu']}, torch {doc['probe']['torch']}; S = {gib(doc['size'])}"
          f" in {LAYERS} layers; pinned link {bw['d2h'] / 1e9:.1f} GB/s out, "
          f"{bw['h2d'] / 1e9:.1f} GB/s in; device-to-device {bw['d2d'] / 1e9:.0f} GB/s")
    for note in doc.get("notes", []):
        print(f"note: {note}")
    is_tms_all = [r["mode"] == "tms" and r.get("split") is None for r in results]
    fractions = {r["fraction"] for r, all_ in zip(results, is_tms_all) if not all_}
    for f in sorted(fractions or {1.0}):
        rows = [r for r, all_ in zip(results, is_tms_all) if all_ or r["fraction"] == f]
        print(f"kept {f:.0%}:")
        for r in rows:
            if r.get("error"):
                print(f"  {r['label']:34s} FAILED: {r['error']}")
                continue
            print("\n".join(case_lines(r, bw, floors.get(r["label"]))))
    if doc.get("floor_detail"):
        for label, d in doc["floor_detail"].items():
            print(f"driver floor for {label}: {d['handles']} handles: cuMemCreate "
                  f"{d['create_s']:.3f} s + map {d['map_s']:.3f} s + access "
                  f"{d['access_s']:.3f} s; unmap + release {d['release_s']:.3f} s (beside "
                  f"it, export + import of each: {d.get('export_import_s', 0):.3f} s)")
    print("targets:")
    for name, met, text in targets(results):
        verdict = "PASS" if met else ("MISS" if met is False else "n/a ")
        print(f"  {verdict} {name}: {text}")
    return 1 if any(r.get("error") for r in results) else 0



def median_of(cycles: list[dict], key: str) -> float:
    return statistics.median(c[key] for c in cycles)


def need_rows(doc: dict) -> list[dict]:
    """One row per (keep, need, contender) of a run by need, with its limit: the keep's pages
    (from the pattern, as the child made them), the need asked and the free memory the row's
    last cycle found."""
    bw, rows = doc["bandwidth"], []
    results = [r for r in doc["results"] if not r.get("error")]
    keeps = sorted({(r["fraction"], r["pattern"]) for r in results if r["mode"] == "sublet"},
                   key=lambda k: (k[0], k[1]))
    if not keeps and results:
        keeps = [(1.0, "all")]
    for fraction, pattern in keeps:
        group = [r for r in results if r["mode"] == "tms" or
                 (r["fraction"], r["pattern"]) == (fraction, pattern)]
        per_layer = doc["size"] // LAYERS // BLOCK
        kept_pages = page_kept(kept_ids(pattern, per_layer, fraction), per_layer)
        for r in group:
            for entry in r["needs"]:
                last = entry["cycles"][-1]
                rows.append({"fraction": fraction, "pattern": pattern, "label": r["label"],
                             "need": entry["fraction"], "need_bytes": entry["need_bytes"],
                             "take_bytes": entry["take_bytes"], "free_bytes": last["free_bytes"],
                             "cycles": entry["cycles"], "first": r["first"],
                             "pin_ahead_s": r.get("pin_ahead_s"),
                             "limit": need_limit(kept_pages, entry["need_bytes"],
                                                 last["free_bytes"], bw)})
    return rows


def need_row_line(row: dict, head: dict) -> str:
    """A row, judged against its own limit (its free memory: said where not head's)."""
    c, limit = row["cycles"], row["limit"]
    last = c[-1]
    handoff = median_of(c, "seconds")
    own = ("" if abs(row["free_bytes"] - head["free_bytes"]) < MiB else
           f" ({gib(row['free_bytes'])} free: link {gib(limit['host_bytes'])}, "
           f"{limit['seconds']:.3f} s)")
    return (f"    {row['label']:24s} {median_of(c, 'total_s'):7.3f} s (release "
            f"{median_of(c, 'pause_s'):.3f} + take {median_of(c, 'take_s'):.3f} + resume "
            f"{median_of(c, 'resume_s'):.3f}); link {gib(last['out_bytes'])} out + "
            f"{gib(last['in_bytes'])} in, moved {gib(last['moved_bytes'])}; release + resume "
            f"{handoff / max(limit['seconds'], 1e-9):.1f} x the limit{own}")


def print_need(need: float, same: list[dict]) -> None:
    """One need's rows under a header with the judged row's limit: sublet need's, else
    another sublet row's (tms runs without subletd's context: it finds more free and is
    judged against its own)."""
    head = next((r for r in same if r["label"].startswith("sublet need")),
                next((r for r in same if r["label"].startswith("sublet")), same[0]))
    lim = head["limit"]
    print(f"  need {need:.0%}: {gib(head['take_bytes'])} taken ({gib(head['need_bytes'])} "
          f"asked), {gib(head['free_bytes'])} free; limit: link {gib(lim['host_bytes'])} each "
          f"way, moved {gib(lim['moved_bytes'])}, {lim['seconds']:.3f} s")
    for r in same:
        print(need_row_line(r, head))


def report_need(doc: dict) -> int:
    """The table of a run by need and its targets; returns the exit status (1 when a case
    failed)."""
    bw = doc["bandwidth"]
    print(f"GPU {doc['probe']['gpu']}, torch {doc['probe']['torch']}; S = {gib(doc['size'])}"
          f" in {LAYERS} layers; pinned link {bw['d2h'] / 1e9:.1f} GB/s out, "
          f"{bw['h2d'] / 1e9:.1f} GB/s in; device-to-device {bw['d2d'] / 1e9:.0f} GB/s; "
          f"free {gib(doc['probe']['free_bytes'])} before the cache")
    for note in doc.get("notes", []):
        print(f"note: {note}")
    rows = need_rows(doc)
    for (fraction, pattern) in dict.fromkeys((r["fraction"], r["pattern"]) for r in rows):
        print(f"kept {fraction:.0%} ({pattern}):")
        mine = [r for r in rows if (r["fraction"], r["pattern"]) == (fraction, pattern)]
        for need in dict.fromkeys(r["need"] for r in mine):
            print_need(need, [r for r in mine if r["need"] == need])
        firsts = {r["label"]: r for r in mine}
        print("  first cycles (the largest need): " + ", ".join(
            f"{k} {r['first']['total_s']:.3f} s" + ("" if r["pin_ahead_s"] is None else
                                                   f" (pinned ahead in {r['pin_ahead_s']:.3f} s)")
            for k, r in firsts.items()))
    for r in doc["results"]:
        if r.get("error"):
            print(f"  {r['label']:24s} FAILED: {r['error']}")
    print("targets:")
    for name, met, text in need_targets(rows, doc["size"]):
        verdict = "PASS" if met else ("MISS" if met is False else "n/a ")
        print(f"  {verdict} {name}: {text}")
    return 1 if any(r.get("error") for r in doc["results"]) else 0


def need_limit_targets(rows: list[dict], size: int) -> list[tuple[str, bool | None, str]]:
    """Per sublet need row: link bytes equal the limit's; later cycles within
    NEED_TARGET_LIMIT x the limit's seconds (judged at 64 GiB and more)."""
    out: list[tuple[str, bool | None, str]] = []
    for r in rows:
        if not r["label"].startswith("sublet need"):
            continue
        where = f"{r['label']}, need {r['need']:.0%}"
        host = r["limit"]["host_bytes"]
        got = max(max(c["out_bytes"], c["in_bytes"]) for c in r["cycles"])
        out.append((f"{where}: link bytes = the limit's", got == host,
                    f"{got} vs {host} bytes each way ({(got - host) / MiB:+.0f} MiB)"))
        handoff, limit = median_of(r["cycles"], "seconds"), r["limit"]["seconds"]
        judged = size >= 64 * GiB or None
        out.append((f"{where}: within {NEED_TARGET_LIMIT} x the limit",
                    judged and handoff <= NEED_TARGET_LIMIT * limit,
                    f"{handoff:.3f} s vs {limit:.3f} s" + ("" if judged else
                                                          " (judged at 64 GiB)")))
    return out


def need_first_targets(rows: list[dict], size: int) -> list[tuple[str, bool | None, str]]:
    """Per sublet need case: its first cycle (the process's first release, at the largest
    need) within NEED_TARGET_FIRST x the later cycles of that need (release + resume; judged
    at 64 GiB and more)."""
    out: list[tuple[str, bool | None, str]] = []
    judged = size >= 64 * GiB or None
    for r in rows:
        same = [x["need"] for x in rows if x["label"] == r["label"]]
        if not r["label"].startswith("sublet need") or r["need"] != max(same):
            continue
        first, later_s = r["first"]["seconds"], median_of(r["cycles"], "seconds")
        pinned = "" if r["pin_ahead_s"] is None else ", pinned ahead"
        out.append((f"{r['label']}: first cycle within {NEED_TARGET_FIRST} x a later one",
                    judged and first <= NEED_TARGET_FIRST * later_s,
                    f"{first:.3f} s vs {later_s:.3f} s at need {r['need']:.0%}{pinned}" +
                    ("" if judged else " (judged at 64 GiB)")))
    return out


def need_targets(rows: list[dict], size: int) -> list[tuple[str, bool | None, str]]:
    """Issue 42's: link bytes equal the limit's, later cycles within NEED_TARGET_LIMIT x the
    limit (judged at 64 GiB and more), the first cycle within NEED_TARGET_FIRST x a later one
    of its need (the largest), and at 100 % kept and a 25 % need sublet need
    NEED_TARGET_SPEEDUP x faster than tms all (release + allocation + resume)."""
    out = need_limit_targets(rows, size) + need_first_targets(rows, size)
    for r in rows:
        if r["label"] != "sublet need all 100%" or abs(r["need"] - 0.25) > 1e-9:
            continue
        tms = next((t for t in rows if t["label"] == "tms all" and
                    (t["fraction"], t["pattern"], t["need"]) == (1.0, "all", 0.25)), None)
        name = f"sublet need 100% kept, need 25%: {NEED_TARGET_SPEEDUP:.0f} x faster than tms all"
        if tms is None:
            out.append((name, None, "tms did not run"))
            continue
        a, b = median_of(r["cycles"], "total_s"), median_of(tms["cycles"], "total_s")
        out.append((name, b >= NEED_TARGET_SPEEDUP * a, f"{b:.3f} s / {a:.3f} s = "
                    f"{b / max(a, 1e-9):.1f} x"))
    return out


# --------------------------------------------------------------------------- children: GPU

def free_gpu() -> int:
    import torch
    return torch.cuda.mem_get_info()[0]


def digest(pieces) -> int:
    """Every bit of the kept bytes, on the GPU: the sum of each 8-byte word times an odd weight
    that depends on its position (mod 2**64): a changed bit or swapped words change it."""
    import torch
    total, index = 0, 0
    for piece in pieces:
        words = piece.reshape(-1).view(torch.int64)
        for part in words.split(DIGEST_CHUNK // 8):
            w = torch.arange(index, index + part.numel(), device=part.device,
                             dtype=torch.int64).mul_(2).add_(1).mul_(0x7E3779B97F4A7C15)
            total = (total + int(w.mul_(part).sum().item())) % (1 << 64)
            index += part.numel()
            del w
    return total


def kept_digest(layers, ids) -> int:
    """The digest of the kept blocks of every layer (all of each layer when ids is None)."""
    if ids is None:
        return digest(iter(layers))
    return digest(layer.index_select(0, ids) for layer in layers)


def take_freed(freed: int) -> int:
    """A plain PyTorch allocation of the freed memory less TAKE_MARGIN, written, then given
    back to the driver (empty_cache): the pause really gave it away. Returns its bytes."""
    import torch
    n = (freed - TAKE_MARGIN) // PAGE * PAGE
    if n <= 0:
        return 0
    x = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xA5)
    torch.cuda.synchronize()
    del x
    torch.cuda.empty_cache()
    return n


def take_exact(n: int) -> int:
    """A plain PyTorch allocation of n bytes (down to a page), written, then given back."""
    import torch
    n = n // PAGE * PAGE
    if n > 0:
        x = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(0xA5)
        torch.cuda.synchronize()
        del x
        torch.cuda.empty_cache()
    return max(0, n)


class Taker:
    """Who takes the freed memory between pause and resume: this process (--taker same, a
    trainer colocated with the engine) or a process of its own (--taker other, a trainer
    beside it, as in slime or verl), started before the first cycle, its CUDA context made."""

    def __init__(self, where: str) -> None:
        self.proc = None
        if where == "other":
            argv = [sys.executable, str(SCRIPT), "--child", "taker", "--spec", "{}"]
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
            self.take(-1)

    def take(self, freed: int, exact: int | None = None) -> int:
        """What the pause freed less TAKE_MARGIN, or (by need) exactly `exact` bytes."""
        if self.proc is None:
            return take_freed(freed) if exact is None else take_exact(exact)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{freed}\n" if exact is None else f"={exact}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the taker process died")
        return int(line)

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def child_taker(_: dict) -> dict:
    """--taker other's process: for each line N, take_freed(N) and its bytes; -1 only makes the
    CUDA context."""
    import torch
    torch.empty(1, device="cuda")
    for line in sys.stdin:
        if line.startswith("="):
            sys.stdout.write(f"{take_exact(int(line[1:]))}\n")
            sys.stdout.flush()
            continue
        freed = int(line)
        sys.stdout.write(f"{take_freed(freed) if freed >= 0 else 0}\n")
        sys.stdout.flush()
    return {}


def run_cycles(n: int, pause: Callable[[], Any], resume: Callable[[Any], dict],
               check: Callable[[int], None], label: str, taker: str = "same",
               observe: Callable[[Any], Any] = lambda handle: None,
               take: int | None = None) -> list[dict]:
    """n cycles of pause, a plain allocation of what it freed (by the taker; `take`: exactly
    that many bytes, a need), resume; timed pause + resume (seconds) and pause + allocation +
    resume (total_s). observe(handle) runs after the pause, untimed (reading its stats);
    resume(handle) returns the cycle's bytes (out_bytes, in_bytes, moved_bytes, stats)."""
    import torch
    cycles = []
    takes = Taker(taker)
    for i in range(n):
        torch.cuda.synchronize()
        free0 = free_gpu()
        t0 = now()
        handle = pause()
        torch.cuda.synchronize()
        t1 = now()
        observe(handle)
        freed = free_gpu() - free0
        ta = now()
        taken = takes.take(freed, take)
        t2 = now()
        moved = resume(handle)
        torch.cuda.synchronize()
        t3 = now()
        check(i)
        cycles.append({"pause_s": t1 - t0, "resume_s": t3 - t2, "seconds": (t1 - t0) + (t3 - t2),
                       "take_s": t2 - ta, "total_s": (t1 - t0) + (t2 - ta) + (t3 - t2),
                       "free_bytes": free0, "freed_bytes": freed, "taken_bytes": taken,
                       **moved})
        log(f"{label}: cycle {i}: pause {t1 - t0:.3f} s, resume {t3 - t2:.3f} s, freed "
            f"{gib(freed)}, kept bits intact")
    takes.close()
    return cycles


def need_bytes(fraction: float, size: int) -> int:
    """The bytes the taker allocates for a need of `fraction` of S (whole pages)."""
    return int(size * fraction) // PAGE * PAGE


def run_needs(spec: dict, pause: Callable[[int], Any], resume: Callable[[Any], dict],
              check: Callable[[int], None], observe: Callable[[Any], Any]) -> dict:
    """By need: one first cycle (the process's first pause, at the largest need: it pays for
    what a first pause pays, pinning the save area included, which a later need's cycle would
    otherwise pay), then spec["cycles"] cycles of each need; pause(need) is given N, the taker
    allocates N; the limit counts N + NEED_SLACK, what subletd leaves free for it."""
    label, size, taker = spec["label"], spec["size"], spec["taker"]
    n0 = need_bytes(max(spec["needs"]), size)
    first = run_cycles(1, lambda: pause(n0), resume, check, f"{label} first",
                       taker, observe, take=n0)[0]
    needs = []
    for f in spec["needs"]:
        n = need_bytes(f, size)
        cycles = run_cycles(spec["cycles"], lambda: pause(n), resume, check,
                            f"{label} need {f:.0%}", taker, observe, take=n)
        needs.append({"fraction": f, "take_bytes": n, "need_bytes": n + NEED_SLACK,
                      "cycles": cycles})
    return {"first": first, "needs": needs}


def checker(layers, ids, expected: int, label: str) -> Callable[[int], None]:
    def check(i: int) -> None:
        if kept_digest(layers, ids) != expected:
            raise SystemExit(f"{label}: kept bits changed in cycle {i}")
    return check


def release_figures(rel: Any, released: dict, resumed: dict) -> dict:
    """A release's bytes (from the Release, as it reports them) and each phase's seconds, of
    the release and of its resume (ReleaseStats before and after resume())."""
    out = {"released_bytes": rel.released_bytes, "stayed_bytes": rel.stayed_bytes,
           "kept_bytes": released.get("kept_bytes", 0), "moved_bytes": rel.moved_bytes,
           "copied_bytes": rel.copied_bytes,
           "copied_in_bytes": resumed.get("copied_in_bytes", 0)}
    for prefix, stats in (("release", released), ("resume", resumed)):
        for k, v in stats.items():
            if k.endswith("seconds"):
                out[prefix + ("_" + k if k != "seconds" else "_seconds")] = v
    return out


def child_sublet(spec: dict) -> dict:
    """The cache in pool "kv"; cycles of sublet.release(...) / rel.resume()."""
    import torch
    import sublet
    per_layer, label = spec["per_layer"], spec["label"]
    with sublet.pool("kv"):
        layers = [torch.empty(per_layer, BLOCK, dtype=torch.uint8, device="cuda")
                  for _ in range(LAYERS)]
    for layer in layers:
        layer.random_(0, 256)
    ids_np = kept_ids(spec["pattern"], per_layer, spec["fraction"])
    ids = None if ids_np is None else torch.from_numpy(ids_np).cuda()
    keep = None if ids_np is None else sublet.blocks(layers, torch.from_numpy(ids_np), dim=0)
    expected = kept_digest(layers, ids)
    kept_bytes = LAYERS * (per_layer if ids_np is None else len(ids_np)) * BLOCK
    # --pin-ahead: as an engine that knows its keep once its memory is made (torch_memory_saver's
    # compat, at a CPU-backup region's end)
    pinned_s = bench_module().owner_pins_ahead(kept_bytes, release=True) \
        if spec.get("pin_ahead") else None

    released: dict = {}

    def observe(rel) -> None:
        released.update(dataclasses.asdict(rel.stats))  # the release's, before resume()

    def resume(rel) -> dict:
        rel.resume()
        figures = release_figures(rel, released, dataclasses.asdict(rel.stats))
        return {"out_bytes": figures["copied_bytes"], "in_bytes": figures["copied_in_bytes"],
                "moved_bytes": figures["moved_bytes"], "stats": figures}

    check = checker(layers, ids, expected, label)
    if spec.get("needs"):
        by_need = spec.get("by_need")
        found = run_needs(spec, lambda need: sublet.release(
            "kv", keep=keep, stay=spec["stay"], need=need if by_need else None),
            resume, check, observe)
        return {**found, "kept_bytes": kept_bytes, "pin_ahead_s": pinned_s}
    cycles = run_cycles(1 + spec["cycles"],
                        lambda: sublet.release("kv", keep=keep, stay=spec["stay"]), resume,
                        check, label, spec["taker"], observe)
    return {"cycles": cycles, "kept_bytes": kept_bytes, "pin_ahead_s": pinned_s,
            "must_move_bytes": must_move(ids_np, per_layer),
            "handles": int(cycles[-1]["stats"].get("released_bytes", 0)) // PAGE,
            "handle_bytes": PAGE, "actual_fraction": kept_bytes / spec["size"]}


def child_tms(spec: dict) -> dict:
    """torch_memory_saver (hook_mode torch): everything in one backed-up region, or each
    layer's kept part split off into a backed-up region and the rest in one without."""
    import torch
    from torch_memory_saver import torch_memory_saver as tms
    per_layer, split, label = spec["per_layer"], spec["split"], spec["label"]
    tms.hook_mode = "torch"  # no LD_PRELOAD: PyTorch's pluggable allocator
    if split is None:
        with tms.region(tag="kv", enable_cpu_backup=True):
            kept = [torch.empty(per_layer, BLOCK, dtype=torch.uint8, device="cuda")
                    for _ in range(LAYERS)]
        rest: list = []
    else:
        n_kept = round(per_layer * split)
        with tms.region(tag="kept", enable_cpu_backup=True):
            kept = [torch.empty(n_kept, BLOCK, dtype=torch.uint8, device="cuda")
                    for _ in range(LAYERS)]
        with tms.region(tag="rest"):
            rest = [torch.empty(per_layer - n_kept, BLOCK, dtype=torch.uint8, device="cuda")
                    for _ in range(LAYERS)]
    tms.retain_cpu_backup = True  # pinned once, at the first pause, and kept: its best case
    for t in kept + rest:
        t.random_(0, 256)
    expected = kept_digest(kept, None)
    kept_bytes = sum(t.nbytes for t in kept)

    def resume(_: Any) -> dict:
        tms.resume()
        return {"out_bytes": kept_bytes, "in_bytes": kept_bytes, "moved_bytes": 0}

    check = checker(kept, None, expected, label)
    if spec.get("needs"):
        _NEVER_FREED.extend(kept + rest)
        found = run_needs(spec, lambda need: tms.pause(), resume, check, lambda handle: None)
        return {**found, "kept_bytes": kept_bytes}
    cycles = run_cycles(1 + spec["cycles"], tms.pause, resume, check, label, spec["taker"])
    handles = [[LAYERS, -(-kept[0].nbytes // PAGE) * PAGE]]
    if rest:
        handles.append([LAYERS, -(-rest[0].nbytes // PAGE) * PAGE])
    # Never freed: torch_memory_saver's torch hook aborts on a free outside a region; the
    # child leaves with os._exit.
    _NEVER_FREED.extend(kept + rest)
    return {"cycles": cycles, "kept_bytes": kept_bytes, "handle_sets": handles,
            "actual_fraction": kept_bytes / spec["size"]}


_NEVER_FREED: list = []


def child_probe(_: dict) -> dict:
    """Free memory, host memory, and the bandwidths: pinned link each way, device to device
    (bytes copied per second), best of several 1 GiB copies."""
    import torch
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    src = torch.empty(GiB, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)

    def best(copy: Callable[[], Any], reps: int = 5) -> float:
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = now()
            copy()
            torch.cuda.synchronize()
            times.append(now() - t)
        return GiB / min(times)

    bw = {"d2h": best(lambda: pinned.copy_(src, non_blocking=True)),
          "h2d": best(lambda: dst.copy_(pinned, non_blocking=True)),
          "d2d": best(lambda: dst.copy_(src))}
    return {"free_bytes": free, "total_bytes": total, "host_bytes": mem_available(),
            "bandwidth": bw, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def child_floor(spec: dict) -> dict:
    """The driver's floor per label: for its handle sets [(count, bytes)], cuMemCreate +
    cuMemMap of each handle and one cuMemSetAccess over them (what resume must do), then
    cuMemUnmap + cuMemRelease (what pause must do), in this one process, through ctypes on
    libcuda (no torch; about a microsecond of Python per call). Handles are POSIX-fd
    shareable, as subletd makes them. Beside it, not in the floor: exporting each handle as an
    fd and importing it again (what a daemon and its client in two processes pay on top)."""
    from ctypes import CDLL, byref, c_int, c_size_t, c_uint64, c_void_p
    cu = CDLL("libcuda.so.1")
    for name in ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess",
                 "cuMemUnmap", "cuMemRelease", "cuMemAddressFree",
                 "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle"):
        getattr(cu, name).restype = c_int
    cu.cuMemExportToShareableHandle.argtypes = [c_void_p, c_uint64, c_int, c_uint64]
    cu.cuMemImportFromShareableHandle.argtypes = [c_void_p, c_void_p, c_int]
    cu.cuMemAddressReserve.argtypes = [c_void_p, c_size_t, c_size_t, c_uint64, c_uint64]
    cu.cuMemCreate.argtypes = [c_void_p, c_size_t, c_void_p, c_uint64]
    cu.cuMemMap.argtypes = [c_uint64, c_size_t, c_size_t, c_uint64, c_uint64]
    cu.cuMemSetAccess.argtypes = [c_uint64, c_size_t, c_void_p, c_size_t]
    cu.cuMemUnmap.argtypes = [c_uint64, c_size_t]
    cu.cuMemRelease.argtypes = [c_uint64]
    cu.cuMemAddressFree.argtypes = [c_uint64, c_size_t]

    def ok(result: int, what: str) -> None:
        if result != 0:
            raise SystemExit(f"driver floor: {what} failed (CUresult {result})")

    ok(cu.cuInit(0), "cuInit")
    dev, ctx = c_int(), c_void_p()
    ok(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
    ok(cu.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop, access = _alloc_prop(dev.value), _access_desc(dev.value)
    out = {}
    for label, sets in spec["floors"].items():
        total = {"handles": 0, "create_s": 0.0, "map_s": 0.0, "access_s": 0.0,
                 "release_s": 0.0, "export_import_s": 0.0}
        for count, nbytes in sets:
            one = _floor_once(cu, ok, prop, access, int(count), int(nbytes))
            for k in total:
                total[k] += one[k]
        total["resume_s"] = total["create_s"] + total["map_s"] + total["access_s"]
        total["floor_s"] = total["resume_s"] + total["release_s"]
        out[label] = total
        log(f"driver floor, {label}: {total['handles']} handles, resume side "
            f"{total['resume_s']:.3f} s, pause side {total['release_s']:.3f} s")
    return {"floors": out}


def _alloc_prop(device: int):
    """A CUmemAllocationProp: pinned device memory on `device`, POSIX-fd shareable."""
    import ctypes

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Flags(ctypes.Structure):
        _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable",
                    ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                    ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                    ("allocFlags", Flags)]

    # CU_MEM_ALLOCATION_TYPE_PINNED = 1, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
    # CU_MEM_LOCATION_TYPE_DEVICE = 1
    return Prop(type=1, requestedHandleTypes=1, location=Location(1, device))


def _access_desc(device: int):
    """A CUmemAccessDesc: read-write for `device` (CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3)."""
    import ctypes

    class Location(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Access(ctypes.Structure):
        _fields_ = [("location", Location), ("flags", ctypes.c_int)]

    return Access(Location(1, device), 3)


def _floor_once(cu, ok, prop, access, count: int, nbytes: int) -> dict:
    """count handles of nbytes: create + map each, one access call; then unmap + release."""
    import ctypes
    c_uint64 = ctypes.c_uint64
    size = count * nbytes
    va = c_uint64()
    ok(cu.cuMemAddressReserve(ctypes.addressof(va), size, PAGE, 0, 0), "cuMemAddressReserve")
    handles = (c_uint64 * count)()
    t0 = now()
    for i in range(count):
        ok(cu.cuMemCreate(ctypes.addressof(handles) + 8 * i, nbytes, ctypes.addressof(prop), 0),
           "cuMemCreate")
    t1 = now()
    for i in range(count):
        ok(cu.cuMemMap(va.value + i * nbytes, nbytes, 0, handles[i], 0), "cuMemMap")
    t2 = now()
    ok(cu.cuMemSetAccess(va.value, size, ctypes.addressof(access), 1), "cuMemSetAccess")
    t_access = now()
    shared = _export_import(cu, ok, handles, count)
    t3 = now()
    ok(cu.cuMemUnmap(va.value, size), "cuMemUnmap")
    for i in range(count):
        ok(cu.cuMemRelease(handles[i]), "cuMemRelease")
    t4 = now()
    ok(cu.cuMemAddressFree(va.value, size), "cuMemAddressFree")
    return {"handles": count, "create_s": t1 - t0, "map_s": t2 - t1,
            "access_s": t_access - t2, "release_s": t4 - t3, "export_import_s": shared}


def _export_import(cu, ok, handles, count: int) -> float:
    """Seconds to export every handle as a POSIX fd and import it back (then release the
    imported handle and close the fd), as a daemon and its client do between them."""
    import ctypes
    t0 = now()
    for i in range(count):
        fd, again = ctypes.c_int(-1), ctypes.c_uint64()
        ok(cu.cuMemExportToShareableHandle(ctypes.addressof(fd), handles[i], 1, 0),
           "cuMemExportToShareableHandle")
        ok(cu.cuMemImportFromShareableHandle(ctypes.addressof(again), fd.value, 1),
           "cuMemImportFromShareableHandle")
        ok(cu.cuMemRelease(again.value), "cuMemRelease (imported)")
        os.close(fd.value)
    return now() - t0


def child_main(mode: str, spec: dict) -> None:
    """Runs one child and prints its result as the last stdout line."""
    run = {"probe": child_probe, "sublet": child_sublet, "tms": child_tms,
           "floor": child_floor, "taker": child_taker}[mode]
    result = run(spec)
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    if mode == "tms":
        os._exit(0)  # no teardown: torch_memory_saver's hook aborts on frees outside regions


# --------------------------------------------------------------------------- parent

def run_child(mode: str, spec: dict, env: dict) -> dict:
    """One child of this script; its result, or {'error': ...}. Its stderr (progress) goes to
    ours as it comes."""
    argv = [sys.executable, str(SCRIPT), "--child", mode, "--spec", json.dumps(spec)]
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=env,
                              timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = done.stdout.strip().splitlines()[-3:]
        return {"error": f"exit status {done.returncode}" + (f": {' | '.join(tail)}"
                                                              if tail else "")}
    return json.loads(lines[-1][len(MARK):])


def tms_available() -> tuple[bool, str]:
    """Whether torch_memory_saver can be imported, and its version (without importing it)."""
    if importlib.util.find_spec("torch_memory_saver") is None:
        return False, "not installed"
    from importlib import metadata
    try:
        return True, metadata.version("torch_memory_saver")
    except metadata.PackageNotFoundError:
        return True, "unknown version"


def bench_module():
    """benchmark.py, beside this script."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import benchmark
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return benchmark


def start_daemon(pin_gib: float, log: Path | None = None):
    """One subletd for the sublet children (as a service would be): benchmark.py's, its
    debug log written to `log` when it stops."""
    benchmark = bench_module()
    benchmark.DAEMON_LOG = log.resolve() if log is not None else None
    return benchmark, benchmark.start_daemon(int(pin_gib * GiB))


def floor_specs(results: list[dict]) -> dict[str, list]:
    """The handle sets of each case's pause: sublet's released pages, tms's allocations."""
    out = {}
    for r in results:
        if r.get("error"):
            continue
        if r["mode"] == "sublet" and r.get("handles"):
            out[r["label"]] = [[r["handles"], PAGE]]
        elif r["mode"] == "tms":
            out[r["label"]] = r["handle_sets"]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default=None, help="GiB of cache (64, 64GiB), or 'max': all free "
                                                f"memory but {HEADROOM // GiB} GiB (default 64GiB)")
    p.add_argument("--need", type=parse_need, nargs="?", const=parse_need(NEEDS), default=None,
                   metavar="PCTS", help="by need (issue 42): the taker needs these percents of "
                   f"the cache, comma-separated (--need alone: {NEEDS}); contenders tms all, "
                   "sublet all (stay=0) and sublet need")
    p.add_argument("--kept", type=parse_kept, default=None,
                   help="kept fractions, comma-separated (default 0.3,1.0)")
    p.add_argument("--cycles", type=int, default=None,
                   help="later cycles of sublet (default 4; --quick 1)")
    p.add_argument("--tms-cycles", type=int, default=None,
                   help="later cycles of torch_memory_saver (default 2; --quick 1)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated, of {', '.join(CONTENDERS)} (default all; "
                   f"sublet-need runs with --need only, tms-best without it)")
    p.add_argument("--daemon-pin", type=float, default=0, metavar="GiB",
                   help="host memory subletd pins ahead (default 0: it pins at its first "
                        "save, as the package's own daemon does)")
    p.add_argument("--quick", action="store_true", help="S = 4 GiB, 2 cycles: a smoke run")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the driver's floor (it exports and imports every handle: "
                        "half a minute per case at 64 GiB)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--daemon-log", type=Path, default=None, metavar="FILE",
                   help="run subletd with --log-level debug and write its log here (each "
                        "job's time queued, running and on the loop; each request's)")
    p.add_argument("--taker", choices=("same", "other"), default="same",
                   help="who allocates the freed memory between pause and resume: the "
                        "pausing process (default: a colocated trainer) or another (a "
                        "trainer beside the engine, as in slime or verl)")
    p.add_argument("--pin-ahead", action="store_true",
                   help="sublet's stay=0 cases (with --need, every sublet case) pin their "
                        "save area ahead of the first cycle (sublet.pin_ahead(kept, "
                        "release=True), waited for and timed apart), as an engine that knows "
                        "its keep does; default: the first release pins on its path")
    p.add_argument("--child", choices=("probe", "sublet", "tms", "floor", "taker"),
                   help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p


def main() -> int:
    a = build_parser().parse_args()
    if a.child:
        child_main(a.child, json.loads(a.spec))
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench_release.py needs a CUDA GPU", file=sys.stderr)
        return 2
    size_arg = a.size or ("4" if a.quick else "64")
    if a.need:
        return main_need(a, size_arg)
    cycles = a.cycles if a.cycles is not None else (1 if a.quick else 4)
    tms_cycles = a.tms_cycles if a.tms_cycles is not None else (1 if a.quick else 2)
    contenders = [c for c in a.contenders.split(",") if c]
    if set(contenders) - set(CONTENDERS):
        raise SystemExit(f"--contenders: use {', '.join(CONTENDERS)}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    probe = run_child("probe", {}, env)
    if "error" in probe:
        raise SystemExit(f"the probe failed: {probe['error']}")
    size = plan_size(size_arg, probe["free_bytes"])
    ok_tms, version = tms_available()
    cases, notes = plan_cases(a.kept or [0.3, 1.0], contenders, size, probe["host_bytes"],
                              ok_tms, cycles, tms_cycles, a.taker, a.pin_ahead)
    if a.daemon_pin == 0 and not os.environ.get("SUBLET_SOCKET"):
        notes.append("subletd pins host memory at its first save and keeps it: the first "
                     "stay=0 case's first cycle pays for pinning, a later one only for more")
    if ok_tms and version != "0.0.10":
        notes.append(f"torch_memory_saver {version}, not the 0.0.10 this benchmark is for")
    log(f"S = {gib(size)}, {len(cases)} cases; {'; '.join(notes) or 'nothing skipped'}")
    results = [{**spec, **run_child("tms", spec, env)} for spec in cases
               if spec["mode"] == "tms"]
    sublet_cases = [spec for spec in cases if spec["mode"] == "sublet"]
    if sublet_cases:
        results += run_sublet(sublet_cases, env, a.daemon_pin, a.daemon_log)
    specs = floor_specs(results) if not a.no_floor else {}
    floors = run_child("floor", {"floors": specs}, env) if specs else {}
    if a.no_floor:
        notes.append("driver floor not measured (--no-floor)")
    doc = {"size": size, "probe": probe, "bandwidth": probe["bandwidth"], "notes": notes,
           "results": results, "floor_detail": floors.get("floors", {}),
           "floors": {k: v["floor_s"] for k, v in floors.get("floors", {}).items()}}
    if "error" in floors:
        doc["notes"].append(f"driver floor not measured: {floors['error']}")
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
    return report(doc)


def child_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


def main_need(a: argparse.Namespace, size_arg: str) -> int:
    """A run by need (--need): the probe, tms all, then the sublet children against one
    subletd; the table and the targets."""
    cycles = a.cycles if a.cycles is not None else (1 if a.quick else 2)
    tms_cycles = a.tms_cycles if a.tms_cycles is not None else cycles
    contenders = [c for c in a.contenders.split(",") if c]
    if set(contenders) - set(CONTENDERS):
        raise SystemExit(f"--contenders: use {', '.join(CONTENDERS)}")
    env = child_env()
    probe = run_child("probe", {}, env)
    if "error" in probe:
        raise SystemExit(f"the probe failed: {probe['error']}")
    size = plan_size(size_arg, probe["free_bytes"])
    ok_tms, version = tms_available()
    cases, notes = plan_need_cases(a.kept or [0.3, 1.0], contenders, a.need, size,
                                   probe["host_bytes"], ok_tms, cycles, tms_cycles, a.taker,
                                   a.pin_ahead)
    if ok_tms and version != "0.0.10":
        notes.append(f"torch_memory_saver {version}, not the 0.0.10 this benchmark is for")
    log(f"S = {gib(size)} by need, {len(cases)} cases; {'; '.join(notes) or 'nothing skipped'}")
    results = [{**spec, **run_child("tms", spec, env)} for spec in cases
               if spec["mode"] == "tms"]
    sublet_cases = [spec for spec in cases if spec["mode"] == "sublet"]
    if sublet_cases:
        results += run_sublet(sublet_cases, env, a.daemon_pin, a.daemon_log)
    doc = {"size": size, "probe": probe, "bandwidth": probe["bandwidth"], "notes": notes,
           "results": results, "by_need": True}
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1))
    return report_need(doc)


def run_sublet(cases: list[dict], env: dict, pin_gib: float,
               log: Path | None = None) -> list[dict]:
    """The sublet children, against one subletd started here (or $SUBLET_SOCKET's)."""
    if os.environ.get("SUBLET_SOCKET"):
        return [{**spec, **run_child("sublet", spec, env)} for spec in cases]
    benchmark, daemon = start_daemon(pin_gib, log)
    try:
        child_env = {**env, **daemon.env}
        return [{**spec, **run_child("sublet", spec, child_env)} for spec in cases]
    finally:
        benchmark.stop_daemon(daemon)


if __name__ == "__main__":
    sys.exit(main())
