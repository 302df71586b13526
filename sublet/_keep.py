"""Turn ``keep`` (views of a lent tensor, or indices / a mask of its rows) into sorted, merged
byte ranges of its region.

Indices along dim 0 (an integer tensor or array) and boolean masks over dim 0 are the fast
form: they become ranges with no Python loop at all (mark the rows, find the runs of
consecutive rows with one diff, and, for contiguous rows, one range per run).

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

from . import _lib

Keep = Union[None, torch.Tensor, np.ndarray, Iterable[torch.Tensor], Iterable[int]]

# Past this many runs in one layout group, inner dimensions are folded into wider runs that also
# cover the gaps between them (a superset of the kept bytes: still correct, since restoring bytes
# the borrower may have used is harmless, only more is copied). It bounds memory and time for
# views such as cache[:, ::2] whose exact byte set would be billions of one-byte ranges.
MAX_RUNS_PER_GROUP = 1 << 22

_Layout = tuple[tuple[int, ...], tuple[int, ...], int]


def keep_ranges(keep: Keep, storage_ptr: int, region_size: int,
                tensor: torch.Tensor | None = None) -> np.ndarray:
    """The kept byte ranges, relative to the region start, sorted and merged.

    keep: one view or an iterable of views of the lent tensor, or (with tensor given) indices
    along its dim 0 or a boolean mask over its dim 0 (not None: the caller treats that as "keep
    everything"). storage_ptr: the data pointer of the lent tensor's untyped storage, which is
    the region's first byte. Raises TypeError/ValueError naming the fix.
    """
    rows = _as_rows(keep, storage_ptr, tensor)
    if rows is not None:
        return _row_ranges(tensor, rows, storage_ptr, region_size)
    views = _as_view_list(keep)
    if len(views) == 1:
        return _one_view_ranges(views[0], storage_ptr, region_size)
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
    return _within_region(ranges, region_size)


def _within_region(ranges: np.ndarray, region_size: int) -> np.ndarray:
    """ranges (sorted) as they are, unless they reach past the region."""
    if len(ranges) and int(ranges[-1, 0] + ranges[-1, 1]) > region_size:
        raise ValueError("a keep view reaches past the end of the lent tensor's memory")
    return ranges


def _not_a_view(i: int, v: object) -> TypeError:
    return TypeError(f"keep[{i}] is a {type(v).__name__}, not a view of the lent tensor: pass "
                     f"slices of it, such as cache[3] or cache[:, 2:5]")


def _one_view_ranges(view: torch.Tensor, storage_ptr: int, region_size: int) -> np.ndarray:
    """The ranges of one view (a slice, rows with a step: the usual keep of a loan), without
    the grouping, sorting and merging that many views need: its runs ascend with gaps between
    them unless strides overlap, which one comparison tells (0.3 ms a loan on the H200's host
    for the general path, a few microseconds here)."""
    try:
        shape, strides, itemsize = tuple(view.shape), view.stride(), view.element_size()
        ptr = view.data_ptr()
    except AttributeError:
        raise _not_a_view(0, view) from None
    if 0 in shape:
        return np.empty((0, 2), dtype=np.uint64)
    starts, run = _runs(shape, strides, itemsize, _offsets_in_region([ptr], storage_ptr,
                                                                     region_size))
    if len(starts) > 1 and not bool((starts[1:] - starts[:-1] > run).all()):
        ranges = merge_ranges(np.sort(starts), np.full(len(starts), run, np.int64),
                              presorted=True)
    else:
        ranges = np.empty((len(starts), 2), dtype=np.uint64)
        ranges[:, 0], ranges[:, 1] = starts, run
    return _within_region(ranges, region_size)


def _as_rows(keep: Keep, storage_ptr: int, tensor: torch.Tensor | None) -> np.ndarray | None:
    """keep as sorted unique row indices of tensor when it is indices or a mask, else None
    (views). A tensor over the lent memory is a view, whatever its dtype."""
    if isinstance(keep, torch.Tensor):
        if tensor is None or keep.untyped_storage().data_ptr() == storage_ptr:
            return None
        if keep.dtype.is_floating_point or keep.dtype.is_complex:
            return None  # not indices: _group_by_layout names the fix for a foreign view
        if keep.dtype == torch.uint8:  # PyTorch indexes with a uint8 tensor as a mask
            raise TypeError("keep as a uint8 tensor is ambiguous: pass a bool mask over the "
                            "rows, or row indices as int64 (torch.tensor([...]))")
        keep = keep.detach().cpu().numpy()
    elif isinstance(keep, (list, tuple, range)) and len(keep) > 0 and \
            isinstance(keep[0], (int, np.integer)):  # row indices (or bools: a mask) as a list
        keep = np.asarray(keep)
    elif not isinstance(keep, np.ndarray):
        return None
    if tensor is None or tensor.dim() == 0:
        raise TypeError("keep as indices or a mask needs a tensor with rows (dim 0) to lend")
    if keep.ndim > 1:  # cache[[0, 5]] of an integer cache is a copy of rows, not indices
        raise TypeError(f"keep as indices or a mask is one dimension (rows of the lent tensor), "
                        f"not shape {tuple(keep.shape)}: pass torch.tensor([...]) of row "
                        f"indices, or views of the lent tensor such as cache[3] (cache[[0, 5]] "
                        f"copies the rows)")
    if keep.dtype == np.bool_:
        return _mask_rows(keep, tensor.shape[0])
    if not np.issubdtype(keep.dtype, np.integer):
        raise TypeError(f"keep as an array must hold integer indices of rows or a boolean "
                        f"mask, not {keep.dtype}")
    return _index_rows(keep, tensor.shape[0])


def _mask_rows(mask: np.ndarray, nrows: int) -> np.ndarray:
    if mask.ndim != 1 or len(mask) != nrows:
        raise ValueError(f"a keep mask has one bool per row of the lent tensor ({nrows}), "
                         f"not shape {mask.shape}")
    return np.flatnonzero(mask)


def _index_rows(index: np.ndarray, nrows: int) -> np.ndarray:
    index = index.reshape(-1)
    if len(index) == 0:
        return index.astype(np.int64)
    lo, hi = int(index.min()), int(index.max())  # before int64, where a uint64 would wrap
    if lo < -nrows or hi >= nrows:
        raise IndexError(f"keep index {lo if lo < -nrows else hi} is out of range for the "
                         f"{nrows} rows of the lent tensor")
    index = index.astype(np.int64, copy=False)
    if lo < 0:
        index = np.where(index < 0, index + nrows, index)
    elif len(index) < 2 or bool((index[1:] > index[:-1]).all()):
        return index  # sorted and unique already, as a block table's live list usually is
    if len(index) * 16 < nrows:  # few rows of many: sorting beats a mask of every row
        return np.unique(index)
    marks = np.zeros(nrows, dtype=bool)
    marks[index] = True
    return np.flatnonzero(marks)


def _row_ranges(tensor: torch.Tensor, rows: np.ndarray, storage_ptr: int,
                region_size: int) -> np.ndarray:
    """Ranges of tensor[rows] (rows sorted, unique), neighbours coalesced."""
    itemsize = tensor.element_size()
    row_step = tensor.stride(0) * itemsize
    base = tensor.data_ptr() - storage_ptr
    if len(rows) == 0 or tensor.numel() == 0:
        return np.empty((0, 2), dtype=np.uint64)
    shape, strides = tuple(tensor.shape[1:]), tuple(tensor.stride()[1:])
    if row_step > 0 and base >= 0 and _is_dense(shape, strides, itemsize, row_step):
        # Rows tile memory: a run of consecutive rows is one range (one pass in libsublet).
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        out = np.empty((len(rows), 2), dtype=np.uint64)
        n = _lib.rows_ranges(rows.ctypes.data, len(rows), tensor.shape[0], base, row_step,
                             out.ctypes.data)
        out = out[:n]
    else:
        starts, run = _runs(shape, strides, itemsize, base + rows * row_step)
        out = merge_ranges(starts, np.full(len(starts), run, np.int64))
    if len(out) and (int(out[0, 0]) < 0 or int(out[-1, 0] + out[-1, 1]) > region_size):
        raise ValueError("keep rows reach outside the lent tensor's memory")
    return out


def _is_dense(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
              row_step: int) -> bool:
    """Is one row (shape, strides) a contiguous block of exactly row_step bytes?"""
    expected = itemsize
    for n, s in reversed(list(zip(shape, strides))):
        if n != 1 and s * itemsize != expected:
            return False
        expected *= n
    return expected == row_step


def _as_view_list(keep: Keep) -> list[torch.Tensor]:
    if isinstance(keep, torch.Tensor):
        return [keep]
    if isinstance(keep, (str, bytes)) or not isinstance(keep, Iterable):
        raise TypeError(
            f"keep must be a view of the lent tensor, a list of such views, row indices or a "
            f"bool mask over its rows (a tensor, array or list), [] or None; got "
            f"{type(keep).__name__}")
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
                raise _not_a_view(i, v)
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


def outside_ranges(tensor: torch.Tensor, storage_ptr: int, storage_bytes: int) -> np.ndarray:
    """The bytes of the lent tensor's storage that are not the tensor's, as ranges: they are
    kept, since a loan of a view lends that view only (lending cache[8:] lends rows 8 on, and
    rows 0 to 7 stay the owner's). The tensor's bytes must be one block (any order of its
    dimensions): a view with gaps, such as cache[:, :4], is refused, naming the fix."""
    if tensor.numel() == 0:
        return np.array([[0, storage_bytes]], dtype=np.uint64)
    dims = sorted((step, n) for n, step in zip(tensor.shape, tensor.stride()) if n > 1)
    expected = 1
    for step, n in dims:
        if step != expected:
            raise ValueError(
                f"a lent tensor's bytes must be one block of its memory: a tensor from "
                f"sublet.empty(), a slice of it along a dimension whose elements are whole rows "
                f"(cache[8:]), or a permutation of those; shape {tuple(tensor.shape)} with "
                f"strides {tensor.stride()} has gaps. Lend the whole tensor and choose what "
                f"survives with keep=")
        expected *= n
    start = tensor.data_ptr() - storage_ptr
    end = start + tensor.numel() * tensor.element_size()
    out = [(0, start)] if start > 0 else []
    if end < storage_bytes:
        out.append((end, storage_bytes - end))
    return np.array(out, dtype=np.uint64).reshape(-1, 2)


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
