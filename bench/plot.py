#!/usr/bin/env python3
"""The chart of bench/benchmark.py's results, regenerated from its JSON.

For every job (a fill of 25, 75, 100% of S, a transformer training step): one bar of seconds per
later cycle for copy-all, for torch_memory_saver and for sublet per keep pattern, labelled with
its ratio to the physical limit, which a black tick marks (the job alone, plus the bytes that
cannot stay on the GPU at the measured pinned link speed, plus sublet's on-GPU moves at the
measured device-to-device speed); a diamond marks the first cycle.
One panel per tensor size S (a host-capped S and, with --uncapped-sublet, the uncapped one).
The y axis is logarithmic: first cycles that pin host memory take tens of seconds, lent ones
tenths. Output is SVG, written reproducibly (no date, fixed ids) so that the committed chart
changes only when the numbers do.

    python3 bench/plot.py                                   # bench/results.json -> assets/
    python3 bench/plot.py --json results.json --out chart.svg
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GiB = 1 << 30
PATTERNS = ("rows", "blocks", "slice")
BARS = (  # (method, pattern, colour, legend)
    ("copy-all", "any", "#c44e52", "copy-all: everything to pinned host memory and back"),
    ("tms", "any", "#dd8452", "torch_memory_saver at its best (kept bytes split off, CPU "
                              "backup kept)"),
    ("sublet", "rows", "#4c72b0", "sublet, rows of 1 GiB"),
    ("sublet", "blocks", "#55a868", "sublet, 64 KiB blocks (a paged KV cache)"),
    ("sublet", "slice", "#8172b3", "sublet, one slice"),
)
BAR_WIDTH = 0.16


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.0f} GiB" if nbytes % GiB == 0 else f"{nbytes / GiB:.1f} GiB"


def find(results: list[dict[str, Any]], method: str, pattern: str, job: tuple[str, float],
         size: int) -> dict[str, Any] | None:
    """The result of one case (copy-all and tms stand for every pattern)."""
    for r in results:
        if (r["method"] == method and r["size_bytes"] == size
                and (r.get("job", "fill"), r["fraction"]) == job
                and (method != "sublet" or r["pattern"] == pattern)
                and not r.get("error") and r.get("later")):
            return r
    return None


def job_label(job: tuple[str, float]) -> str:
    kind, fraction = job
    return f"training step\n(~{fraction * 100:g}% of S)" if kind == "train" else \
        f"job {fraction * 100:g}% of S"


def draw_panel(ax: Any, results: list[dict[str, Any]], size: int, title: str) -> None:
    """Per job, one bar per method (sublet: per keep pattern) of the later cycles, labelled
    with seconds and the ratio to the physical limit (the black tick); a diamond marks the
    first cycle."""
    at_size = [r for r in results if r["size_bytes"] == size and not r.get("error")]
    jobs = sorted({(r.get("job", "fill"), r["fraction"]) for r in at_size})
    values = [s["seconds"] for r in at_size for s in (r.get("first"), r.get("later")) if s]
    values += [r["later"]["limit_s"] for r in at_size if r.get("later")]
    floor = 10 ** math.floor(math.log10(min(values) / 2)) if values else 1e-3
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 8 if values else 10)  # room above for the labels
    for g, job in enumerate(jobs):
        for b, (method, pattern, colour, _) in enumerate(BARS):
            r = find(at_size, method, pattern, job, size)
            if r is None:
                continue
            later, x = r["later"], g + (b - (len(BARS) - 1) / 2) * BAR_WIDTH
            ax.bar(x, later["seconds"] - floor, BAR_WIDTH * 0.92, bottom=floor, color=colour)
            ax.hlines(later["limit_s"], x - BAR_WIDTH * 0.45, x + BAR_WIDTH * 0.45,
                      colors="black", linewidth=2)
            if r.get("first"):
                ax.plot(x, r["first"]["seconds"], marker="D", markersize=3.5,
                        markerfacecolor="white", markeredgecolor=colour)
            ax.annotate(f"{later['seconds']:.3g} s, {later['ratio']:.2g}x", (x, later["seconds"]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=6.5,
                        rotation=90, va="bottom")
    for boundary in range(1, len(jobs)):
        ax.axvline(boundary - 0.5, color="grey", linewidth=0.6, alpha=0.5)
    ax.set_xticks(range(len(jobs)))
    ax.set_xticklabels([job_label(j) for j in jobs], fontsize=9)
    ax.set_ylabel("seconds per later cycle (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.25)
    ax.set_axisbelow(True)


def panel_title(doc: dict[str, Any], size: int) -> str:
    at_size = [r for r in doc["results"] if r["size_bytes"] == size]
    first = at_size[0]
    note = next((r["size_note"] for r in at_size if r.get("size_note")), "")
    copy_all = any(r["method"] == "copy-all" and not r.get("error") for r in at_size)
    text = (f"S = {gib(size)}, F = {gib(first['free_bytes'])} free beside it, "
            f"{first['kept_fraction'] * 100:g}% kept")
    if note:
        text += f" ({note})"
    if not copy_all:
        text += "\ncopy-all not run at this size"
    return text


def render(doc: dict[str, Any], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt.rcParams["svg.hashsalt"] = "sublet-benchmark"  # stable ids: reproducible SVG
    sizes = sorted({r["size_bytes"] for r in doc["results"] if not r.get("error")})
    if not sizes:
        raise SystemExit("no successful results to plot")
    fig, axes = plt.subplots(len(sizes), 1, figsize=(12, 4.6 * len(sizes)), squeeze=False)
    for ax, size in zip(axes[:, 0], sizes):
        draw_panel(ax, doc["results"], size, panel_title(doc, size))
    machine = doc.get("machine", {})
    fig.suptitle(f"sublet vs copy-all and torch_memory_saver on {machine.get('gpu', 'a GPU')} (torch "
                 f"{machine.get('torch', '?')}): make room, run the job, get the data back",
                 fontsize=11)
    handles = [Patch(color=colour, label=label) for _, _, colour, label in BARS]
    handles.append(Line2D([], [], color="black", linewidth=2,
                          label="physical limit (label: later cycle, x limit)"))
    handles.append(Line2D([], [], color="grey", marker="D", linestyle="", markersize=4,
                          markerfacecolor="white", label="first cycle (fresh process)"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.14 if len(sizes) == 1 else 0.08, 1, 0.96))
    out.parent.mkdir(parents=True, exist_ok=True)
    fmt = out.suffix.lstrip(".") or "svg"
    fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Draw bench/benchmark.py's JSON as an SVG bar chart (needs matplotlib).")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results.json",
                        help="results of bench/benchmark.py (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=REPO / "assets" / "benchmark-h200.svg",
                        help="the SVG to write (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("plot.py needs matplotlib: python3 -m pip install matplotlib")
    render(json.loads(args.json.read_text()), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
