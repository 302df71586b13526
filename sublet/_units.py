"""Sizes as people read them: the one formatter of `sublet status` and of the reprs of loans,
offers, releases and their stats. Pure Python, no torch: `sublet status` imports it."""

from __future__ import annotations


def human(n: float) -> str:
    """1.50 GiB, 512 B: sizes as people read them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
