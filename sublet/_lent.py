"""What a loan lends: a tensor from sublet.empty(), tensors and tags of sublet pools, or a list
of those, as one region and the byte ranges of it that are lent.

One loan lends one region (one Lend, one window). Every byte of the region that is not lent
is kept: lending a view (cache[8:]) keeps the rest of its tensor's memory. Lending tag "kv" of
the arena pins the pages that hold no lent byte (the other tags', which the owner goes on using
during the loan: the loan never touches them) and keeps the other tags' bytes in pages shared
with lent bytes. `keep` speaks only of what is lent; the Lend's keep list is then `keep` plus
everything not lent and not pinned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Union

import numpy as np
import torch

from . import _keep, _pool
from ._memory import Region, region_of

Lendable = Union[str, "_pool.Pool", torch.Tensor, Iterable[Union[str, "_pool.Pool", torch.Tensor]]]


@dataclass
class Lent:
    region: Region | _pool.Arena
    spans: np.ndarray              # the lent byte ranges of the region: (n, 2) uint64, merged
    tensor: torch.Tensor | None    # the one tensor lent, when it is one (keep as its rows)
    what: str                      # for messages
    # An arena's pages holding no lent byte, as (n, 2) uint64 byte ranges: pinned in the Lend,
    # so that the loan never saves, moves into or restores them while the owner uses them.
    pinned: np.ndarray | None = None

    @property
    def device(self) -> torch.device:
        return self.region.device


def resolve(what: Lendable, free: bool = True) -> Lent:
    """The region and the lent ranges of `what`; raises TypeError/ValueError naming the fix.
    free: the region's bytes that no tensor holds (an arena's free pages) are lent too; a
    release leaves them out, so that releases of two tags never share a page."""
    parts = [what] if isinstance(what, (str, _pool.Pool, torch.Tensor)) else _as_list(what)
    if not parts:
        raise ValueError("nothing to lend: pass a tensor, a pool tag or a list of them")
    resolved = [_resolve_one(p) for p in parts]
    region = resolved[0][0]
    for other, _, described in resolved[1:]:
        if other is not region:
            raise ValueError(
                f"one loan lends one region, and {described} is not in the memory of "
                f"{resolved[0][2]}: lend tensors of one sublet.empty() tensor, or tensors and "
                f"tags of the sublet pools of one device (allocate them inside sublet.pool())")
    extra = [_unowned(region)] if free else []
    spans = np.concatenate([r[1] for r in resolved] + extra).astype(np.int64)
    merged = _keep.merge_ranges(spans[:, 0], spans[:, 1])
    tensor = parts[0] if len(parts) == 1 and isinstance(parts[0], torch.Tensor) else None
    pinned = (_idle_pages(merged, region.size, region.client.info.page_size)
              if isinstance(region, _pool.Arena) or not free else None)
    return Lent(region, merged, tensor, ", ".join(r[2] for r in resolved), pinned)


def touched_pages(lent: Lent) -> np.ndarray:
    """The whole pages holding a lent byte, as (n, 2) uint64 byte ranges: the complement of
    the pinned pages (all of the region when none is pinned)."""
    return np.ascontiguousarray(_complement(_pinned_of(lent), lent.region.size), np.uint64)


def _idle_pages(spans: np.ndarray, size: int, page: int) -> np.ndarray:
    """The whole pages of [0, size) that no span touches, as ascending (offset, length) byte
    ranges. Spans are merged, so the gaps are apart and so are their whole pages."""
    gaps = _complement(spans.astype(np.int64), size)
    first = -(-gaps[:, 0] // page)
    end = (gaps[:, 0] + gaps[:, 1]) // page
    whole = end > first
    return np.ascontiguousarray(
        np.stack([first[whole] * page, (end - first)[whole] * page], axis=1), np.uint64)


def _unowned(region: Region | _pool.Arena) -> np.ndarray:
    """The region's bytes that no tensor holds, lent with whatever is lent: the arena's free
    pages, the last page's tail past a sublet.empty() tensor."""
    if isinstance(region, _pool.Arena):
        return _complement(region.segments().astype(np.int64), region.size)
    return np.array([[region.nbytes, region.size - region.nbytes]], np.int64)


def _as_list(what: object) -> list:
    if isinstance(what, (bytes, bytearray)) or not isinstance(what, Iterable):
        raise TypeError(f"sublet lends a torch.Tensor (from sublet.empty() or a sublet pool), "
                        f"a pool tag or a list of them, not a {type(what).__name__}")
    return list(what)


def _resolve_one(part: object) -> tuple[Region | _pool.Arena, np.ndarray, str]:
    if isinstance(part, (str, _pool.Pool)):
        return _resolve_tag(part)
    if not isinstance(part, torch.Tensor):
        raise TypeError(f"sublet lends a torch.Tensor (from sublet.empty() or a sublet pool) "
                        f"or a pool tag, not a {type(part).__name__}")
    arena = _pool.arena_of(part)
    region = arena if arena is not None else region_of(part)  # region_of names the fix
    start = part.data_ptr() - region.addr
    nbytes = block_bytes(part)
    return region, np.array([[start, nbytes]], np.int64), f"a tensor of shape {tuple(part.shape)}"


def _resolve_tag(part: str | _pool.Pool) -> tuple[_pool.Arena, np.ndarray, str]:
    pool = part if isinstance(part, _pool.Pool) else _pool_of_tag(part)
    segments = pool.segments().astype(np.int64)
    if len(segments) == 0:
        raise ValueError(f"sublet pool {pool.tag!r} on {pool.device} holds nothing: allocate "
                         f"its tensors inside `with sublet.pool({pool.tag!r})` (or with "
                         f"Pool.empty()) before lending")
    return pool.arena, segments, f"pool {pool.tag!r}"


def _pool_of_tag(tag: str) -> _pool.Pool:
    pools = _pool.pools_of(tag)
    if len(pools) > 1:  # the current device's, as PyTorch's default device rule goes
        current = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else None
        pools = [p for p in pools if p.device == current] or pools
    if len(pools) != 1:
        where = "on any device" if not pools else f"on {len(pools)} devices"
        raise ValueError(f"no single sublet pool has tag {tag!r} {where}: make it with "
                         f"`with sublet.pool({tag!r}): ...` (or pass the Pool itself)")
    return pools[0]


def block_bytes(tensor: torch.Tensor) -> int:
    """The bytes of a lent tensor, which must be one block of memory (any order of its
    dimensions): a view with gaps, such as cache[:, :4], is refused, naming the fix."""
    dims = sorted((step, n) for n, step in zip(tensor.shape, tensor.stride()) if n > 1)
    expected = 1
    for step, n in dims:
        if step != expected:
            raise ValueError(
                f"a lent tensor's bytes must be one block of its memory: a whole tensor, a "
                f"slice of it along a dimension whose elements are whole rows (cache[8:]), or a "
                f"permutation of those; shape {tuple(tensor.shape)} with strides "
                f"{tensor.stride()} has gaps. Lend the whole tensor and choose what survives "
                f"with keep=")
        expected *= n
    return tensor.numel() * tensor.element_size()


def keep_ranges(lent: Lent, keep: _keep.Keep) -> np.ndarray | None:
    """The Lend's keep list: `keep` (which must lie in what is lent) and every byte of the
    region that is neither lent nor pinned; None keeps the whole region (but pinned pages,
    which are not kept but left alone: the list is then every other page)."""
    region_size = lent.region.size
    pinned = _pinned_of(lent)
    if keep is None:
        return None if not len(pinned) else \
            np.ascontiguousarray(_complement(pinned, region_size), np.uint64)
    ranges = _keep.keep_ranges(keep, lent.region.addr, region_size, lent.tensor)
    _check_inside(ranges, lent)
    taken = np.concatenate([lent.spans.astype(np.int64), pinned])  # disjoint: not lent
    taken = taken[np.argsort(taken[:, 0], kind="stable")]
    outside = _complement(taken, region_size)
    if len(outside):
        both = np.concatenate([ranges.astype(np.int64), outside])
        ranges = _keep.merge_ranges(both[:, 0], both[:, 1])
    return np.ascontiguousarray(ranges, np.uint64)


def _pinned_of(lent: Lent) -> np.ndarray:
    """lent.pinned as (n, 2) int64 ranges (none for a region that is not an arena)."""
    if lent.pinned is None:
        return np.zeros((0, 2), np.int64)
    return lent.pinned.astype(np.int64).reshape(-1, 2)


def _complement(spans: np.ndarray, size: int) -> np.ndarray:
    """The bytes of [0, size) outside the merged spans, as (n, 2) int64 ranges."""
    starts = np.concatenate([[0], spans[:, 0] + spans[:, 1]]).astype(np.int64)
    ends = np.concatenate([spans[:, 0], [size]]).astype(np.int64)
    gaps = ends > starts
    return np.stack([starts[gaps], (ends - starts)[gaps]], axis=1)


def _check_inside(ranges: np.ndarray, lent: Lent) -> None:
    """Every kept range lies in a lent span (keep cannot name memory the loan does not lend)."""
    if len(ranges) == 0:
        return
    if len(lent.spans) == 1:  # one tensor lent: the ranges are sorted, so their ends decide
        lo, n = (int(x) for x in lent.spans[0])
        if int(ranges[0, 0]) >= lo and int(ranges[-1, 0] + ranges[-1, 1]) <= lo + n:
            return  # (checking them one by one cost a loan milliseconds: docs/benchmarks.md)
    starts = ranges[:, 0].astype(np.int64)
    ends = starts + ranges[:, 1].astype(np.int64)
    span_starts = lent.spans[:, 0].astype(np.int64)
    span_ends = span_starts + lent.spans[:, 1].astype(np.int64)
    i = np.searchsorted(span_starts, starts, side="right") - 1
    inside = (i >= 0) & (ends <= span_ends[np.maximum(i, 0)])
    if not inside.all():
        bad = int(np.flatnonzero(~inside)[0])
        raise ValueError(
            f"keep names bytes [{int(starts[bad])}, {int(ends[bad])}) of the region, which "
            f"{lent.what} does not lend: keep views, blocks or rows of the lent tensors only "
            f"(what is not lent is kept anyway); lend that tensor too if it is to be lent")
