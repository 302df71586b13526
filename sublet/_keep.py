"""Turn ``keep`` (views of a lent tensor) into sorted, merged byte ranges of its region.

A KV cache may keep hundreds of thousands of scattered blocks, so the work per view is kept to
reading four attributes in one Python loop; everything else is vectorised with numpy:

1. group the views by layout (shape, strides, item size): views of one layout differ only by
   their storage offset;
2. per group, reduce the layout to *runs*: the innermost dimensions that tile contiguous bytes
   fold into one run length, the others are enumerated for all views at once by broadcasting;
3. merge all runs with one sort and a cumulative maximum of their ends.

The ranges are a numpy (n, 2) uint64 array: one row per range, (offset, length), which is the
memory layout of an array of ``struct sublet_range``, so it is handed to C without copying.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Iterable
from typing import Union

import numpy as np
import torch

Keep = Union[None, torch.Tensor, Iterable[torch.Tensor]]

# Past this many runs in one layout group, inner dimensions are folded into wider runs that also
# cover the gaps between them (a superset of the kept bytes: still correct, since restoring bytes
# the borrower may have used is harmless, only more is copied). It bounds memory and time for
# views such as cache[:, ::2] whose exact byte set would be billions of one-byte ranges.
MAX_RUNS_PER_GROUP = 1 << 22

_Layout = tuple[tuple[int, ...], tuple[int, ...], int]


def keep_ranges(keep: Keep, storage_ptr: int, region_size: int) -> np.ndarray:
    """The kept byte ranges, relative to the region start, sorted and merged.

    keep: one view or an iterable of views of the lent tensor (not None: the caller treats that
    as "keep everything"). storage_ptr: the data pointer of the lent tensor's untyped storage,
    which is the region's first byte. Raises TypeError/ValueError naming the fix.
    """
    views = _as_view_list(keep)
    groups = _group_by_layout(views, storage_ptr, region_size)
    merged = []
    for (shape, strides, itemsize), offsets in groups.items():
        starts, run = _runs(shape, strides, itemsize, offsets)
        # One layout: all runs have one length, so sorting the starts alone sorts the ranges.
        merged.append(merge_ranges(np.sort(starts), np.full(len(starts), run, np.int64),
                                   presorted=True))
    if not merged:
        return np.empty((0, 2), dtype=np.uint64)
    ranges = merged[0] if len(merged) == 1 else merge_ranges(
        *np.concatenate(merged).astype(np.int64).T)
    if len(ranges) and int(ranges[-1, 0] + ranges[-1, 1]) > region_size:
        raise ValueError("a keep view reaches past the end of the lent tensor's memory")
    return ranges


def _as_view_list(keep: Keep) -> list[torch.Tensor]:
    if isinstance(keep, torch.Tensor):
        return [keep]
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
        raise TypeError(
            f"keep must be a view of the lent tensor, a list of such views, [] or None; "
            f"got {type(keep).__name__}")
    return keep if isinstance(keep, list) else list(keep)


def _group_by_layout(views: list[torch.Tensor], storage_ptr: int,
                     region_size: int) -> dict[_Layout, np.ndarray]:
    """Byte offsets of the views in the region, grouped by layout; checks each view.

    The loop reads three attributes and the data pointer per view and nothing else (no
    storage object per view): with 300,000 views it is most of the time this module takes.
    """
    groups: dict[_Layout, list[int]] = defaultdict(list)
    # The loop makes a tuple per view; with 1e5 tensors alive, the collector would otherwise
    # scan them all several times over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i, v in enumerate(views):
            try:
                groups[(v.shape, v.stride(), v.element_size())].append(v.data_ptr())
            except AttributeError:
                raise TypeError(f"keep[{i}] is a {type(v).__name__}, not a view of the lent "
                                f"tensor: pass slices of it, such as cache[3] or cache[:, 2:5]")
    finally:
        if gc_was_enabled:
            gc.enable()
    # Empty views keep nothing (and their data pointer may be 0).
    return {layout: _offsets_in_region(ptrs, storage_ptr, region_size)
            for layout, ptrs in groups.items() if 0 not in layout[0]}


def _offsets_in_region(ptrs: list[int], storage_ptr: int, region_size: int) -> np.ndarray:
    """Data pointers as offsets from the region's start; a view elsewhere is an error."""
    offsets = np.asarray(ptrs, dtype=np.int64) - np.int64(storage_ptr)
    outside = (offsets < 0) | (offsets > region_size)  # an empty view may sit at the end
    if outside.any():
        raise ValueError(
            "a keep view is not a view of the lent tensor (it has other memory): pass views "
            "made by slicing the tensor you lend, such as cache[1::2]")
    return offsets


def _runs(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
          byte_offsets: np.ndarray) -> tuple[np.ndarray, int]:
    """Starts of the contiguous byte runs of every view of one layout, and their length."""
    if any(n == 0 for n in shape):
        return np.empty(0, np.int64), 0
    # Size-1 and stride-0 (broadcast) dimensions add no bytes; order the rest outermost first.
    dims = sorted(((n, s * itemsize) for n, s in zip(shape, strides) if n > 1 and s != 0),
                  key=lambda d: d[1], reverse=True)
    run = itemsize
    # Fold inner dimensions whose elements tile the run exactly: they extend it.
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    # Too many runs: widen the innermost enumerated dimension into one covering run.
    while dims and len(byte_offsets) * _prod(n for n, _ in dims) > MAX_RUNS_PER_GROUP:
        n, step = dims.pop()
        run += (n - 1) * step
    rel = np.zeros(1, dtype=np.int64)
    for n, step in dims:
        rel = (rel[:, None] + np.arange(n, dtype=np.int64) * step).ravel()
    return (byte_offsets[:, None] + rel[None, :]).ravel(), run


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def merge_ranges(starts: np.ndarray, lengths: np.ndarray, presorted: bool = False
                 ) -> np.ndarray:
    """Sorted union of [start, start + length) ranges; touching ranges merge. (n, 2) uint64.
    presorted: the starts are already ascending."""
    nonempty = lengths > 0
    starts, ends = starts[nonempty], starts[nonempty] + lengths[nonempty]
    if len(starts) == 0:
        return np.empty((0, 2), dtype=np.uint64)
    if not presorted:
        order = np.argsort(starts)
        starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    first = np.empty(len(starts), dtype=bool)
    first[0] = True
    np.greater(starts[1:], reach[:-1], out=first[1:])  # a gap before it: a new range begins
    begin = np.flatnonzero(first)
    last = np.append(begin[1:] - 1, len(starts) - 1)
    out = np.empty((len(begin), 2), dtype=np.uint64)
    out[:, 0] = starts[begin]
    out[:, 1] = reach[last] - starts[begin]
    return out


def kept_bytes_in_pages(ranges: np.ndarray, page_size: int, pages: Iterable[int] | None = None
                        ) -> int:
    """Kept bytes that lie in the given pages (all pages when None): what lending those pages
    copies to the host and back, since only kept bytes are copied, not whole pages."""
    if len(ranges) == 0:
        return 0
    starts = ranges[:, 0].astype(np.int64)
    ends = starts + ranges[:, 1].astype(np.int64)
    if pages is None:
        return int((ends - starts).sum())
    total = 0
    for p in sorted(set(pages)):
        lo, hi = p * page_size, (p + 1) * page_size
        total += int(np.clip(np.minimum(ends, hi) - np.maximum(starts, lo), 0, None).sum())
    return total


def kept_pages(ranges: np.ndarray, page_size: int) -> np.ndarray:
    """Indices of the pages holding any kept byte, ascending."""
    if len(ranges) == 0:
        return np.empty(0, dtype=np.int64)
    first = ranges[:, 0].astype(np.int64) // page_size
    last = (ranges[:, 0] + ranges[:, 1] - 1).astype(np.int64) // page_size
    counts = last - first + 1
    rel = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.unique(np.repeat(first, counts) + rel)
