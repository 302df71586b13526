#!/usr/bin/env python3
"""The chart of bench/benchmark.py's results, regenerated from its JSON.

For every (keep pattern, job fraction): four bars of seconds per cycle, copy-all's first cycle
and its later cycles (mean), sublet's first and later cycles, each with its physical limit
marked by a black tick (the job alone plus the copied bytes at the measured pinned link speed).
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
BARS = (  # (method, cycle, colour, legend)
    ("copy-all", "first", "#c44e52", "copy-all, first cycle (pins host memory)"),
    ("copy-all", "later", "#e8a0a2", "copy-all, later cycles (mean)"),
    ("sublet", "first", "#4c72b0", "sublet, first cycle (fresh process)"),
    ("sublet", "later", "#9bb5dc", "sublet, later cycles (mean)"),
)
BAR_WIDTH = 0.2


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.0f} GiB" if nbytes % GiB == 0 else f"{nbytes / GiB:.1f} GiB"


def find(results: list[dict[str, Any]], method: str, pattern: str, fraction: float,
         size: int) -> dict[str, Any] | None:
    """The result of one case; copy-all stands for every pattern (it copies everything)."""
    for r in results:
        if (r["method"] == method and r["size_bytes"] == size
                and abs(r["fraction"] - fraction) < 1e-9
                and (method == "copy-all" or r["pattern"] == pattern)
                and not r.get("error") and r.get("first")):
            return r
    return None


def draw_panel(ax: Any, results: list[dict[str, Any]], size: int, title: str) -> None:
    at_size = [r for r in results if r["size_bytes"] == size and not r.get("error")]
    patterns = [p for p in PATTERNS if any(r["pattern"] == p for r in at_size)]
    fractions = sorted({r["fraction"] for r in at_size})
    groups = [(p, f) for p in patterns for f in fractions]
    # Bars on a log axis need a bottom above zero: a decade under the smallest figure.
    values = [s["seconds"] for r in at_size for s in (r.get("first"), r.get("later")) if s]
    floor = 10 ** math.floor(math.log10(min(values) / 2)) if values else 1e-3
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values) * 4 if values else 10)  # room above for the labels
    for g, (pattern, fraction) in enumerate(groups):
        for b, (method, cycle, colour, _) in enumerate(BARS):
            r = find(at_size, method, pattern, fraction, size)
            summary = r and r.get(cycle)
            if not summary:
                continue
            x = g + (b - (len(BARS) - 1) / 2) * BAR_WIDTH
            ax.bar(x, summary["seconds"] - floor, BAR_WIDTH * 0.92, bottom=floor, color=colour)
            ax.hlines(summary["limit_s"], x - BAR_WIDTH * 0.4, x + BAR_WIDTH * 0.4,
                      colors="black", linewidth=2)
            ax.annotate(f"{summary['seconds']:.3g}", (x, summary["seconds"]),
                        textcoords="offset points", xytext=(0, 2), ha="center", fontsize=6,
                        rotation=90, va="bottom")
    for boundary in range(len(fractions), len(groups), len(fractions)):  # between patterns
        ax.axvline(boundary - 0.5, color="grey", linewidth=0.6, alpha=0.5)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{p}\njob {f * 100:g}%" for p, f in groups], fontsize=8)
    ax.set_ylabel("seconds per cycle (log)")
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
    fig.suptitle(f"sublet vs copy-all on {machine.get('gpu', 'a GPU')} (torch "
                 f"{machine.get('torch', '?')}): make room, run the job, get the data back",
                 fontsize=11)
    handles = [Patch(color=colour, label=label) for _, _, colour, label in BARS]
    handles.append(Line2D([], [], color="black", linewidth=2,
                          label="physical limit: job alone + copied bytes at link speed"))
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07 if len(sizes) == 1 else 0.04, 1, 0.96))
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
