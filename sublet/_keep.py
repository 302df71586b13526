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
import operator
from collections import defaultdict
from collections.abc import Iterable
from typing import Union

import numpy as np
import torch

from . import _lib

Keep = Union[None, torch.Tensor, np.ndarray, "Blocks", "Spans",
             Iterable[Union[torch.Tensor, "Blocks"]], Iterable[int]]

# Past this many runs in one layout group, inner dimensions are folded into wider runs that also
# cover the gaps between them (a superset of the kept bytes: still correct, since restoring bytes
# the borrower may have used is harmless, only more is copied). It bounds memory and time for
# views such as cache[:, ::2] whose exact byte set would be billions of one-byte ranges.
MAX_RUNS_PER_GROUP = 1 << 22

_Layout = tuple[tuple[int, ...], tuple[int, ...], int]


def keep_ranges(keep: Keep, storage_ptr: int, region_size: int,
                tensor: torch.Tensor | None = None) -> np.ndarray:
    """The kept byte ranges, relative to the region start, sorted and merged.

    keep: one view or an iterable of views of the lent tensor, a Blocks (sublet.blocks), a
    list mixing views and Blocks (the union of their bytes), or (with tensor given) indices
    along its dim 0 or a boolean mask over its dim 0 (not None: the caller treats that as "keep
    everything"). storage_ptr: the region's first byte (the data pointer of the lent tensor's
    untyped storage, or the region's address for a pool). Raises TypeError/ValueError naming
    the fix.
    """
    if isinstance(keep, (Blocks, Spans)):
        return keep.ranges(storage_ptr, region_size)
    rows = _as_rows(keep, storage_ptr, tensor)
    if rows is not None:
        return _row_ranges(tensor, rows, storage_ptr, region_size)
    views = _as_view_list(keep)
    if len(views) == 1 and not isinstance(views[0], Blocks):
        return _one_view_ranges(views[0], storage_ptr, region_size)
    one = _one_layout(views)
    if one is not None:  # the usual long list: one block per view, all of one layout
        layout, ptrs = one
        groups = {} if 0 in layout[0] else {
            layout: _offsets_in_region(ptrs, storage_ptr, region_size)}
        blocks: list[Blocks] = []
    else:
        groups, blocks = _group_by_layout(views, storage_ptr, region_size)
    merged = [_layout_ranges(shape, strides, itemsize, offsets)
              for (shape, strides, itemsize), offsets in groups.items()]
    merged += [b.ranges(storage_ptr, region_size) for b in blocks]
    merged = [m for m in merged if len(m)]
    if not merged:
        return np.empty((0, 2), dtype=np.uint64)
    ranges = merged[0] if len(merged) == 1 else merge_ranges(
        *np.concatenate(merged).astype(np.int64).T)
    return _within_region(ranges, region_size)


def _layout_ranges(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                   offsets: np.ndarray) -> np.ndarray:
    """The merged ranges of views of one layout at offsets (any order, repeats allowed)."""
    rel, run = _run_layout(shape, strides, itemsize, len(offsets))
    ranges = _grid_ranges(offsets, rel, run)
    if ranges is not None:
        return ranges
    starts = (offsets[:, None] + rel[None, :]).ravel()
    # One layout: all runs have one length, so sorting the starts alone sorts the ranges.
    return merge_ranges(np.sort(starts), np.full(len(starts), run, np.int64), presorted=True)


def _grid_ranges(offsets: np.ndarray, rel: np.ndarray, run: int) -> np.ndarray | None:
    """When the views are rows of one table (their offsets a multiple of the run apart, as
    cache[:, b] for blocks b are) and each of the table's copies at rel lies apart from the
    others (the K and V halves): the ranges from sublet_blocks_ranges, in one C pass. Else
    None."""
    if len(offsets) < 2 or run <= 0:
        return None
    if not bool((offsets[1:] > offsets[:-1]).all()):
        offsets = np.unique(offsets)
    first = int(offsets[0])
    rows = offsets - first
    if bool((rows % run).any()):
        return None
    rows //= run
    return _tables_ranges(rows, int(rows[-1]) + 1, first + rel, run)


def _tables_ranges(rows: np.ndarray, nrows: int, bases: np.ndarray, row_bytes: int
                   ) -> np.ndarray | None:
    """Ranges of rows (int64, ascending, unique) of the tables at bases, each row row_bytes,
    through sublet_blocks_ranges; None when one table's rows reach into another's."""
    bases = np.unique(bases)
    span_lo, span_hi = int(rows[0]) * row_bytes, (int(rows[-1]) + 1) * row_bytes
    if len(bases) > 1 and bool((bases[1:] + span_lo < bases[:-1] + span_hi).any()):
        return None
    if int(bases[0]) < 0:
        raise ValueError("keep rows reach before the start of the lent memory")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    bases = np.ascontiguousarray(bases, dtype=np.uint64)
    n = _lib.blocks_ranges_count(rows.ctypes.data, len(rows), nrows, bases.ctypes.data,
                                 len(bases), row_bytes)
    out = np.empty((n, 2), dtype=np.uint64)
    _lib.blocks_ranges(rows.ctypes.data, len(rows), nrows, bases.ctypes.data, len(bases),
                       row_bytes, out.ctypes.data, n)
    return out


class Blocks:
    """keep= for memory pools: the same rows (KV blocks) of many tensors of one layout.

    sublet.blocks(tensors, ids, dim) keeps, of every tensor t in tensors, t's rows `ids` along
    dimension `dim`: t.index_select(dim, ids)'s bytes, for every index of the dimensions
    before dim. A row is the contiguous bytes of the dimensions after dim, so that the rows of
    one tensor tile memory (stride(dim) * itemsize is the size of a row). vLLM's FlashAttention
    layout (2, num_blocks, block_size, heads, head_dim) keeps cache[:, ids] with dim=1,
    (num_blocks, 2, ...) keeps cache[ids] with dim=0, HF StaticCache's (batch, heads, max_len,
    head_dim) keeps tokens with dim=2.

    ids: integer ids (a tensor, array or list; any order, repeats allowed, negative ones count
    from the end) or a bool mask over dim. They become ranges in one C pass over the id list
    (the runs of consecutive ids), copied to every tensor and outer index.
    """

    __slots__ = ("tensors", "dim", "rows", "_nrows", "_row_bytes", "_rel", "_extent")

    def __init__(self, tensors: torch.Tensor | Iterable[torch.Tensor], ids, dim: int = 0):
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if not tensors:
            raise ValueError("sublet.blocks needs at least one tensor")
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"sublet.blocks: tensors[{i}] is a {type(t).__name__}, not a "
                                f"tensor: pass a tensor or a list of tensors")
        first = tensors[0]
        shape, strides, dtype = tuple(first.shape), first.stride(), first.dtype
        for i, t in enumerate(tensors[1:], 1):
            if tuple(t.shape) != shape or t.stride() != strides or t.dtype != dtype:
                raise ValueError(
                    f"sublet.blocks: tensors[{i}] is {_describe(t)}, tensors[0] {_describe(first)}:"
                    f" the tensors of one sublet.blocks share shape, strides and dtype; pass a "
                    f"list of sublet.blocks, one per kind of tensor")
        ndim = len(shape)
        if ndim == 0:
            raise TypeError("sublet.blocks: the tensors have no dimensions, hence no rows")
        if not -ndim <= dim < ndim:
            raise IndexError(f"sublet.blocks: dim {dim} is out of range for tensors of {ndim} "
                             f"dimensions")
        dim %= ndim
        itemsize = first.element_size()
        row_bytes = _prod(shape[dim + 1:]) * itemsize
        step = strides[dim] * itemsize if shape[dim] > 1 else row_bytes
        if not _is_dense(shape[dim + 1:], strides[dim + 1:], itemsize, step):
            raise ValueError(
                f"sublet.blocks: the rows along dim {dim} of {_describe(first)} are not "
                f"contiguous blocks of memory (stride({dim}) * itemsize = {step} bytes, a row "
                f"of the dims after it is {row_bytes} bytes, with no gaps): "
                f"pass the tensors as allocated (not transposed or sliced inside a row), a dim "
                f"whose trailing dimensions are contiguous, or views (keep=[t[:, b] ...])")
        self.tensors, self.dim = tensors, dim
        self._nrows, self._row_bytes = shape[dim], row_bytes
        self.rows = _ids_rows(ids, shape[dim], dim)
        # Byte offsets of the tables (one per index of the dimensions before dim) in a tensor.
        rel = np.zeros(1, dtype=np.int64)
        for n, st in zip(shape[:dim], strides[:dim]):
            if n > 1:
                rel = (rel[:, None] + np.arange(n, dtype=np.int64) * (st * itemsize)).ravel()
        self._rel = rel
        # The bytes a tensor spans from its first element: to check that it lies in the region.
        self._extent = 0 if 0 in shape else itemsize + sum(
            (n - 1) * st * itemsize for n, st in zip(shape, strides))

    def __repr__(self) -> str:
        t = self.tensors[0]
        ids = self.rows.tolist() if len(self.rows) <= 6 else (
            self.rows[:3].tolist() + ["..."] + self.rows[-2:].tolist())
        ids = "[" + ", ".join(str(i) for i in ids) + "]"
        tensors = (f"{len(self.tensors)} tensors" if len(self.tensors) > 1 else "1 tensor")
        return (f"sublet.blocks({tensors} of shape {tuple(t.shape)} {str(t.dtype)[6:]}, "
                f"{len(self.rows)} of {self._nrows} rows along dim {self.dim}: {ids})")

    def ranges(self, storage_ptr: int, region_size: int) -> np.ndarray:
        """The kept byte ranges, relative to the region at storage_ptr, sorted and merged."""
        if len(self.rows) == 0 or self._extent == 0:
            return np.empty((0, 2), dtype=np.uint64)
        starts = np.array([t.data_ptr() for t in self.tensors], dtype=np.int64) - storage_ptr
        outside = np.flatnonzero((starts < 0) | (starts + self._extent > region_size))
        if len(outside):
            raise ValueError(
                f"sublet.blocks: tensors[{outside[0]}] is not in the lent memory (it has other "
                f"memory): pass tensors that lie in the region you lend, such as the "
                f"tensors of its pool or views of the lent tensor")
        bases = (starts[:, None] + self._rel[None, :]).ravel()
        ranges = _tables_ranges(self.rows, self._nrows, bases, self._row_bytes)
        if ranges is None:  # the tables overlap (strides that interleave them): merge them
            rows = np.unique(bases)[:, None] + self.rows[None, :] * self._row_bytes
            ranges = merge_ranges(rows.ravel(), np.full(rows.size, self._row_bytes, np.int64))
        return ranges


class Spans:
    """keep= as device addresses: (n, 2) (address, length) byte ranges of the region, in any
    order, overlaps allowed. What an allocator knows of its memory without tensors to name it
    by (sublet.compat.vllm keeps a pool's live blocks so: PyTorch's snapshot gives addresses)."""

    __slots__ = ("spans",)

    def __init__(self, spans) -> None:
        self.spans = np.asarray(spans, dtype=np.int64).reshape(-1, 2)

    def __repr__(self) -> str:
        return f"<sublet keep of {len(self.spans)} spans, {int(self.spans[:, 1].sum())} bytes>"

    def ranges(self, storage_ptr: int, region_size: int) -> np.ndarray:
        """The spans relative to the region at storage_ptr, sorted and merged."""
        starts, lengths = self.spans[:, 0] - storage_ptr, self.spans[:, 1]
        outside = np.flatnonzero((starts < 0) | (starts + lengths > region_size))
        if len(outside):
            addr, n = (int(v) for v in self.spans[outside[0]])
            raise ValueError(f"keep names bytes [{addr:#x}, {addr + n:#x}), outside the lent "
                             f"region: keep only memory of what is lent")
        return merge_ranges(starts, lengths)


def blocks(tensors: torch.Tensor | Iterable[torch.Tensor], ids, dim: int = 0) -> Blocks:
    """keep= for the same blocks of many tensors (a memory pool: one KV cache per layer).

    Keeps, of every tensor in tensors (one tensor or a list, all of one shape, strides and
    dtype), the rows ids along dim (each row the contiguous bytes of the dimensions after dim),
    for every index of the dimensions before it: sublet.blocks(layers, live, dim=1) for vLLM's
    (2, num_blocks, block_size, heads, head_dim) caches keeps every layer's cache[:, live].
    ids: integer ids (tensor, array or list, any order, repeats allowed, negative from the end)
    or a bool mask over dim. Combine several in a list, with views too: keep=[blocks(...),
    cache[0]]."""
    return Blocks(tensors, ids, dim)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} strides {t.stride()} {str(t.dtype)[6:]}"


def _ids_rows(ids, nrows: int, dim: int) -> np.ndarray:
    """Block ids (or a bool mask) as sorted unique row indices below nrows."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.uint8:
            raise TypeError("sublet.blocks: ids as a uint8 tensor are ambiguous: pass a bool "
                            "mask, or the ids as int64 (torch.tensor([...]))")
        ids = ids.detach().cpu().numpy()
    elif isinstance(ids, (int, np.integer)) and not isinstance(ids, bool):
        ids = np.array([ids])
    else:
        ids = np.asarray(ids)
        if ids.size == 0:
            ids = ids.astype(np.int64)
    if ids.ndim > 1:
        raise TypeError(f"sublet.blocks: ids are one dimension (block ids, or a mask over dim "
                        f"{dim}), not shape {tuple(ids.shape)}")
    if ids.dtype == np.bool_:
        return _mask_rows(ids, nrows, f"row along dim {dim} of the tensors")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"sublet.blocks: ids must be integers or a bool mask, not {ids.dtype}")
    rows = _index_rows(ids, nrows, "block id", f"rows along dim {dim} of the tensors")
    return np.ascontiguousarray(rows, dtype=np.int64)


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
    them unless strides overlap, which one comparison tells (a fraction of the general path's
    time a loan: docs/benchmarks.md)."""
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
        held = keep.untyped_storage().data_ptr()  # a view shares the lent tensor's storage,
        if tensor is None or held in (storage_ptr, tensor.untyped_storage().data_ptr()):
            return None                            # which lies anywhere in a pool's arena
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


def _mask_rows(mask: np.ndarray, nrows: int, rows_of: str = "row of the lent tensor"
               ) -> np.ndarray:
    if mask.ndim != 1 or len(mask) != nrows:
        raise ValueError(f"a keep mask has one bool per {rows_of} ({nrows}), "
                         f"not shape {mask.shape}")
    return np.flatnonzero(mask)


def _index_rows(index: np.ndarray, nrows: int, name: str = "keep index",
                rows_of: str = "rows of the lent tensor") -> np.ndarray:
    index = index.reshape(-1)
    if len(index) == 0:
        return index.astype(np.int64)
    lo, hi = int(index.min()), int(index.max())  # before int64, where a uint64 would wrap
    if lo < -nrows or hi >= nrows:
        raise IndexError(f"{name} {lo if lo < -nrows else hi} is out of range for the "
                         f"{nrows} {rows_of}")
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


def _group_by_layout(views: list, storage_ptr: int, region_size: int
                     ) -> tuple[dict[_Layout, np.ndarray], list[Blocks]]:
    """Byte offsets of the views in the region, grouped by layout; checks each view. The
    Blocks among them come back apart.

    The loop reads three attributes and the data pointer per view and nothing else (no
    storage object per view), yet a KV cache's hundreds of thousands of views take it a large
    part of a second (docs/benchmarks.md), which is why a list of views of one layout takes
    _one_layout's way instead.
    """
    groups: dict[_Layout, list[int]] = defaultdict(list)
    blocks: list[Blocks] = []
    # The loop makes a tuple per view; with 1e5 tensors alive, the collector would otherwise
    # scan them all several times over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i, v in enumerate(views):
            try:
                groups[(v.shape, v.stride(), v.element_size())].append(v.data_ptr())
            except AttributeError:
                if not isinstance(v, Blocks):
                    raise _not_a_view(i, v)
                blocks.append(v)
    finally:
        if gc_was_enabled:
            gc.enable()
    # Empty views keep nothing (and their data pointer may be 0).
    return {layout: _offsets_in_region(ptrs, storage_ptr, region_size)
            for layout, ptrs in groups.items() if 0 not in layout[0]}, blocks


# Below this many views the loop of _group_by_layout is as quick as checking them in bulk.
_BULK_VIEWS = 32

try:  # a C++ loop over a list of tensors comparing their sizes and strides with expected ones
    from torch._C._dynamo.guards import assert_size_stride_grouped as _same_sizes_strides
except ImportError:  # older PyTorch: every list of views takes the loop
    _same_sizes_strides = None
_bulk_checked = False


def _bulk_check_works() -> bool:
    """Does _same_sizes_strides refuse what _one_layout counts on it to refuse (other sizes,
    strides of a dimension longer than 1, dimension counts)? Asked once, of this PyTorch."""
    global _same_sizes_strides, _bulk_checked
    if not _bulk_checked and _same_sizes_strides is not None:
        t = torch.zeros(3, 4)
        ok = [t[:, :2]] * 2, [(3, 2)] * 2, [(4, 1)] * 2
        refused = ([t[:, :2], t[:, 1:]], [t[:, :2], t[:, ::2]], [t[:, :2], t[0]],
                   [t[:, :2], t[:2, :2]], [t[:, :2], t.t()[:2]])
        try:
            _same_sizes_strides(*ok)
            for views in refused:
                try:
                    _same_sizes_strides(views, ok[1], ok[2])
                except (AssertionError, RuntimeError, TypeError, ValueError):
                    continue
                _same_sizes_strides = None
                break
        except Exception:  # noqa: BLE001 - any surprise: the loop, which reads every view
            _same_sizes_strides = None
        _bulk_checked = True
    return _same_sizes_strides is not None


def _one_layout(views: list) -> tuple[_Layout, np.ndarray] | None:
    """(layout, data pointers) when every view is a tensor of the first one's layout (shape,
    strides, item size), else None (then the loop of _group_by_layout sorts them out).

    Reading shape, stride() and element_size() of each view in a Python loop costs
    microseconds a view (torch.Size alone most of one); here each view pays for two attributes
    read by map() in C (nbytes, data_ptr) and one C++ pass compares every view's sizes and
    strides with the first's, tens of nanoseconds each (the figures: docs/benchmarks.md).
    Every view is checked: a view of another shape, strides (of a dimension longer than 1, the
    only ones that place bytes) or item size anywhere in the list, or something that is not a
    tensor, sends the whole list to the loop. The C++ pass lets any empty tensor through:
    nbytes, equal to the first view's (not empty), refuses those and other item sizes.
    """
    n = len(views)
    if n < _BULK_VIEWS or not _bulk_check_works():
        return None
    first = views[0]
    if not isinstance(first, torch.Tensor):
        return None
    shape, strides, nbytes = tuple(first.shape), first.stride(), first.nbytes
    if nbytes == 0:
        return None
    try:
        if operator.countOf(map(torch.Tensor.nbytes.__get__, views), nbytes) != n:
            return None
        _same_sizes_strides(views, [shape] * n, [strides] * n)
        ptrs = np.fromiter(map(torch.Tensor.data_ptr, views), np.int64, n)
    except (TypeError, AssertionError, RuntimeError, ValueError):
        return None
    return (first.shape, strides, first.element_size()), ptrs


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
    rel, run = _run_layout(shape, strides, itemsize, len(byte_offsets))
    return (byte_offsets[:, None] + rel[None, :]).ravel(), run


def _run_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                nviews: int) -> tuple[np.ndarray, int]:
    """One layout (no dimension of size 0) as runs: their starts relative to a view's first
    byte (outermost dimension first) and their common length."""
    # Size-1 and stride-0 (broadcast) dimensions add no bytes; order the rest outermost first.
    dims = sorted(((n, s * itemsize) for n, s in zip(shape, strides) if n > 1 and s != 0),
                  key=lambda d: d[1], reverse=True)
    run = itemsize
    # Fold inner dimensions whose elements tile the run exactly: they extend it.
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    # Too many runs: widen the innermost enumerated dimension into one covering run.
    while dims and nviews * _prod(n for n, _ in dims) > MAX_RUNS_PER_GROUP:
        n, step = dims.pop()
        run += (n - 1) * step
    rel = np.zeros(1, dtype=np.int64)
    for n, step in dims:
        rel = (rel[:, None] + np.arange(n, dtype=np.int64) * step).ravel()
    return rel, run


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


def subtract_ranges(ranges: np.ndarray, gone: np.ndarray) -> np.ndarray:
    """The bytes of `ranges` outside every range of `gone`, both (n, 2) (start, length) in any
    order: sorted, merged, (n, 2) int64."""
    kept = merge_ranges(*ranges.astype(np.int64).T).astype(np.int64)
    cut = merge_ranges(*gone.astype(np.int64).T).astype(np.int64) if len(gone) else gone
    out: list[tuple[int, int]] = []
    j = 0
    for start, length in kept.tolist():
        end = start + length
        while j < len(cut) and cut[j, 0] + cut[j, 1] <= start:
            j += 1
        k = j
        while k < len(cut) and cut[k, 0] < end:
            if cut[k, 0] > start:
                out.append((start, int(cut[k, 0]) - start))
            start = max(start, int(cut[k, 0] + cut[k, 1]))
            k += 1
        if start < end:
            out.append((start, end - start))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


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
