"""Sizes as people read them: the one formatter of `sublet status` and of the reprs of loans,
offers, releases and their stats, and the one parser of sizes people write (the drop-ins'
$SUBLET_RELEASE_NEED). Pure Python, no torch: `sublet status` imports it."""

from __future__ import annotations

import re


def human(n: float) -> str:
    """1.50 GiB, 512 B: sizes as people read them."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_need(need: int | None) -> None:
    """A taker's need (sublet.release(need=), Release.need, sublet.take(need=), Taken.need):
    an int of bytes >= 0, or None (release everything)."""
    if need is not None and (isinstance(need, bool) or not isinstance(need, int) or need < 0):
        raise ValueError(f"need is the bytes of device memory the taker needs (an int >= 0), "
                         f"or None to release everything; not {need!r}")



_UNITS = {"": 1, "b": 1,
          "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'24GiB', '24 GiB', '1.5g', '512MiB', '24000000000', '24GB': a size in bytes. K, M, G
    and T and their KiB... spellings are powers of 1024 (as subletd's SUBLET_MEMFD_TOTAL=64M);
    KB, MB, GB and TB powers of 1000; units in any case; a fraction rounds down to a byte.
    ValueError naming the accepted forms otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size: write bytes (24000000000) or a number and a "
                         f"unit (24GiB, 1.5GiB, 512MiB, 24G; KB, MB, GB, TB: powers of 1000)")
    number = m.group(1)
    if number.isdigit():
        return int(number) * _UNITS[unit]
    whole, _, frac = number.partition(".")
    scale = 10 ** len(frac)
    return (int(whole or 0) * scale + int(frac or 0)) * _UNITS[unit] // scale
