"""Pools: the tensors engines and trainers make, in sublet memory, by tag.

    with sublet.pool("kv"):            # every CUDA allocation of the process on the device
        engine = build_engine()         # (any thread, any stream) is sublet memory of tag "kv"
    with sublet.lend("kv", keep=sublet.blocks(engine.caches, live, dim=1)):
        train_step()

The tensors are ordinary PyTorch tensors: PyTorch's caching allocator carves them out of the
segments it asks a ``torch.cuda.MemPool`` for, and that pool's allocator is libsublet's, which
takes the segments from the process's arena on the device: one growable region of subletd,
shared by every tag (a loan lends one region, so lending a tag keeps the other tags' pages
whole, and lending several tags is one loan). As with PyTorch's own pools, freeing a tensor
returns its block to the pool, where later allocations inside the context reuse it.

Like a loan, the context routes the whole process: every thread and stream (through
``_cuda_beginAllocateToPool``). A CUDA graph captured inside takes its memory from its own
graph pool, as PyTorch gives it (torch 2.11, on an H200): not sublet memory. Pools do not nest
(one tag at a time per device; entering the same tag again is fine), a loan does not start
inside one, and no pool is entered inside a loan. On the memfd backend (no GPU: tests) nothing
routes CPU allocations; ``Pool.empty()`` allocates from the pool directly, on either backend.

While the pools of a device are lent (from the `with` of sublet.lend(tag) to its end, from
the sublet.offer(tag) call until it is back or withdrawn) no pool allocation of any tag is
served: a new page could be a free one the loan lends. ``Pool.empty()`` raises BusyError at
once; inside ``with sublet.pool(tag)`` (entered during an offer, which only a tag whose every
page the loan pins may be), PyTorch goes on serving the tag's cached blocks (its own pages,
pinned) and raises torch.OutOfMemoryError when it asks libsublet for a new segment. Nothing
waits, and no tensor is placed in a page the loan lends. The pages a loan lends and pins are
read once libsublet refuses allocations: a tensor made after sublet.lend() returned and before
its `with` is the owner's, pinned like any other.

Floor: above _keep, _lib, _errors, _client, _memory, _torch and _units, the modules of sublet
it imports; below _lent, _release and _loan, which it never imports: the loans borrowed are
kept here (loans) for _loan to fill in (tests/python/test_import_floors.py keeps it so).
"""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from . import _errors, _keep, _lib
from ._client import Client
from ._memory import as_dtype, nbytes_of, parse_size, resolve_device, wrap
from ._units import human

# The one lock of the process's pools and loans, on the Python side: the pools, the pool
# entered on each device, the loans borrowed (loans) and the arenas lent are read and
# changed under it, so that a pool entered and a loan started are never decided apart. Taken
# before libsublet's locks (its pools' lock, then the client's), never while one is held
# (libsublet never calls Python).
_lock = threading.RLock()
# Loans this process borrows (_loan's Loan objects), by device: one per device at a time; under
# _lock, from before the Lend or Borrow goes out (no pool is entered on the device from then
# on) to the end. Kept here, below _loan, so that a pool reads them without importing it.
loans: dict[torch.device, object] = {}
_pools: dict[tuple[str, torch.device], "Pool"] = {}
_tag_ids: dict[str, int] = {}
_entered: dict[torch.device, "Pool"] = {}  # the pool routing each device now
_arenas: dict[torch.device, "Arena"] = {}


class Arena:
    """The process's pool memory on one device, as lending sees a region: one growable region
    of subletd that libsublet sub-allocates by tag. Its size grows with the pools."""

    def __init__(self, client: Client, device: torch.device):
        self.client, self.device = client, device
        self.lent = False  # one loan of a region at a time; set by the lending side
        # While lent: the pages the loan pins, (n, 2) uint64 byte ranges (None: not decided).
        self.pinned: np.ndarray | None = None

    def hold(self) -> int:
        """Switches on libsublet's refusal of every pool allocation of the client (BusyError)
        for a loan of the arena, before the loan reads which pages it lends and pins; returns
        the arena's layout id. Called by the lending side under _lock; let_go() ends it."""
        layout = self.client.pool_hold()
        self.pinned = None
        return layout

    def let_go(self) -> None:
        """The loan is over: pool allocations are served again."""
        self.pinned = None
        try:
            self.client.pool_unhold()
        except _errors.SubletError:
            pass  # the library is gone with the client: nothing is held

    def spares(self, tag: int) -> bool:
        """Does the loan of the arena pin every page of tag (it lends and keeps none of them)?
        Then the tag's memory is the owner's all through the loan. False while not decided."""
        if self.pinned is None:
            return False
        segs = self.segments(tag).astype(np.int64)
        if not len(segs):
            return True
        return not len(_keep.subtract_ranges(segs, self.pinned.astype(np.int64)))

    @property
    def handle(self) -> _lib.RegionHandle:
        handle = self.client.pool_region()
        if handle is None:
            raise ValueError(f"no sublet pool holds memory on {self.device}: allocate inside "
                             f"`with sublet.pool(tag)` (or with Pool.empty()) before lending "
                             f"it")
        return handle

    @property
    def addr(self) -> int:
        return self.handle.addr

    @property
    def size(self) -> int:
        return self.handle.size

    @property
    def id(self) -> int:
        return self.handle.id

    def holds(self, ptr: int) -> bool:
        handle = self.client.pool_region()
        return handle is not None and handle.addr <= ptr < handle.addr + handle.size

    def segments(self, tag: int = 0) -> np.ndarray:
        """The live segments of tag (0: every tag) as (offset, length) ranges, ascending."""
        return self.client.pool_segments(tag)

    def __repr__(self) -> str:
        handle = self.client.pool_region()
        held = f"{human(handle.size)}, region {handle.id}" if handle else "empty"
        return f"<sublet arena on {self.device}: {held}{', lent' if self.lent else ''}>"


def arena_for(client: Client, device: torch.device) -> Arena:
    with _lock:
        arena = _arenas.get(device)
        if arena is None or arena.client is not client:  # a daemon restarted: a new arena
            arena = _arenas[device] = Arena(client, device)
        return arena


def arena_of(tensor: torch.Tensor) -> Arena | None:
    """The arena holding the tensor's memory, or None."""
    ptr = tensor.untyped_storage().data_ptr()
    arena = _arenas.get(tensor.device)
    return arena if arena is not None and arena.holds(ptr) else None


def entered(device: torch.device) -> "Pool | None":
    return _entered.get(device)


class Pool:
    """Sublet memory of one tag on one device (sublet.pool): a context manager that routes the
    process's CUDA allocations there, and a name that sublet.lend() and sublet.offer() take."""

    def __init__(self, tag: str, device: torch.device, client: Client):
        self.tag, self.device = tag, device
        self._client = client
        self._arena = arena_for(client, device)
        with _lock:
            self._tag_id = _tag_ids.setdefault(tag, len(_tag_ids) + 1)
        self._mempool: torch.cuda.MemPool | None = None
        self._depth = 0
        self._direct: dict[int, int] = {}   # Pool.empty's live tensors: address -> bytes

    @property
    def arena(self) -> Arena:
        return self._arena

    @property
    def tag_id(self) -> int:
        return self._tag_id

    def segments(self) -> np.ndarray:
        """The tag's live segments as (offset, length) byte ranges of the arena."""
        return self._arena.segments(self._tag_id)

    def live_blocks(self, drop: frozenset[int] = frozenset()) -> np.ndarray:
        """The tag's memory less what is known to hold nothing worth keeping, as (n, 2) int64
        (address, length) spans: less the blocks PyTorch's caching allocator holds free in its
        segments (the pool's MemPool snapshot), and less the tensors whose storage starts at
        an address in `drop` where their extent is known (a block of that snapshot, or a
        Pool.empty tensor). Whatever is not known so is kept."""
        segs = self.segments()
        if not len(segs):
            return np.empty((0, 2), dtype=np.int64)
        spans = segs.astype(np.int64)
        spans[:, 0] += self._arena.addr
        gone = [(a, n) for a, n in self._direct.items() if a in drop]
        for addr, size, free in self._carved_blocks():
            if free or addr in drop:
                gone.append((addr, size))
        return _keep.subtract_ranges(spans, np.array(gone, dtype=np.int64).reshape(-1, 2))

    def _carved_blocks(self) -> list[tuple[int, int, bool]]:
        """(address, size, free) of every block PyTorch carved of the pool's segments, from its
        MemPool's snapshot; none where there is none or the snapshot cannot be read."""
        if self._mempool is None:
            return []
        try:
            try:
                segments = self._mempool.snapshot(include_traces=False)
            except TypeError:   # torch before 2.10: no include_traces
                segments = self._mempool.snapshot()
        except (AttributeError, RuntimeError):
            return []
        blocks = []
        for seg in segments:
            addr = seg["address"]
            for block in seg["blocks"]:
                addr = block.get("address", addr)
                blocks.append((addr, block["size"], block["state"] == "inactive"))
                addr += block["size"]
        return blocks

    @property
    def nbytes(self) -> int:
        """Bytes the tag holds now (whole segments, cached blocks in them included, and the
        free pages of the page groups a resume made of them)."""
        return int(self.segments()[:, 1].sum())

    def empty(self, *size, dtype: torch.dtype | type | None = None) -> torch.Tensor:
        """A tensor allocated from the pool directly (whole pages), on any backend; its memory
        goes back to the pool when the tensor dies. dtype: as for torch.empty (None:
        torch.get_default_dtype()). While the device's pools are being lent or lent, BusyError
        at once (any tag: see the module's docstring); allocate again once the loan is back."""
        shape = parse_size(size)
        dtype = as_dtype(dtype)
        nbytes = nbytes_of(shape, dtype)
        ptr = _retry_after_empty_cache(
            lambda: self._client.pool_alloc(self._tag_id, nbytes), self.device)
        self._direct[ptr] = nbytes
        return wrap(ptr, nbytes, self.device, _Segment(self._client, ptr, self._direct),
                    shape, dtype)

    # ---------------------------------------------------------------- routing
    def __enter__(self) -> "Pool":
        if self.device.type != "cuda":
            raise RuntimeError(
                f"sublet.pool() routes CUDA allocations, and {self.device} is not a CUDA "
                f"device (no allocator hook exists for CPU tensors): allocate with "
                f"pool.empty(...) instead")
        with _lock:
            self._check_can_enter()
            if self._depth == 0:
                self._begin()
                _entered[self.device] = self
            self._depth += 1
        return self

    @contextmanager
    def capturing(self) -> Iterator[tuple[int, int]]:
        """For torch.cuda.graph(g, pool=...): yields the id of this pool's MemPool, whose new
        segments come from this tag until the block ends. PyTorch routes the capture to that
        MemPool itself: entering the pool as well would record to it twice ("already
        recording"). The pool entered around the block, if any, is bound again after it."""
        from ._torch import check_routing_possible, pluggable_allocator
        check_routing_possible(self.device.index)
        with _lock:
            self._check_not_lent()
        if self._mempool is None:
            self._mempool = _keep_alive(torch.cuda.MemPool(
                pluggable_allocator(_lib.library_path())._allocator))
        self._client.torch_bind_pool(self.device.index, self._tag_id)
        try:
            yield self._mempool.id
        finally:
            outer = _entered.get(self.device)
            self._client.torch_bind_pool(self.device.index, outer._tag_id if outer else 0)

    def _check_can_enter(self) -> None:
        if self.device in loans:
            raise RuntimeError(f"a loan is active on {self.device}: no pool is entered inside "
                               f"a loan (its allocations belong to the loan); enter "
                               f"sublet.pool({self.tag!r}) before or after it")
        self._check_not_lent()
        other = _entered.get(self.device)
        if other is not None and other is not self:
            raise RuntimeError(f"sublet.pool({other.tag!r}) is entered on {self.device}: pools "
                               f"do not nest; leave it before entering "
                               f"sublet.pool({self.tag!r})")

    def _check_not_lent(self) -> None:
        """While the pools are being lent or lent (an offer), a pool is entered only if the
        loan pins every page of its tag: inside, PyTorch serves the pool's cached blocks, and
        one in a page the loan lends or keeps would be the borrower's memory too. (New
        segments are refused, any tag's: libsublet holds the arena.) The caller holds _lock."""
        if self._arena.lent and not self._arena.spares(self._tag_id):
            raise _errors.BusyError(
                f"the pools on {self.device} are being lent or are lent, and the loan lends or "
                f"keeps pages of tag {self.tag!r}: its cached blocks are the borrower's until "
                f"the loan is back; enter sublet.pool({self.tag!r}) after it",
                _errors.ERROR_CODES["EBUSY"])

    def _begin(self) -> None:
        from ._torch import check_routing_possible, pluggable_allocator
        check_routing_possible(self.device.index)
        if self._mempool is None:
            self._mempool = _keep_alive(torch.cuda.MemPool(
                pluggable_allocator(_lib.library_path())._allocator))
        self._client.torch_bind_pool(self.device.index, self._tag_id)
        torch._C._cuda_beginAllocateToPool(self.device.index, self._mempool.id)

    def __exit__(self, exc_type, exc, tb) -> None:
        with _lock:
            self._depth -= 1
            if self._depth > 0:
                return
            del _entered[self.device]
            torch._C._cuda_endAllocateToPool(self.device.index, self._mempool.id)
            # begin took a reference to the pool, as use_mem_pool's does: given back here, the
            # MemPool object's own keeps it until empty_cache() drops that.
            torch._C._cuda_releasePool(self.device.index, self._mempool.id)
            self._client.torch_bind_pool(self.device.index, 0)

    def empty_cache(self) -> None:
        """Gives the pool's segments back once no tensor of it lives (as torch.cuda.empty_cache()
        does for PyTorch's own cache, which leaves pools alone); the arena's region goes back
        to the driver once no tag holds any. While tensors of it live, nothing is given back
        (PyTorch frees a pool's segments only with the pool). Not while entered."""
        gc.collect()
        with _lock:
            if self._depth:
                raise RuntimeError(f"sublet.pool({self.tag!r}) is entered: leave it before "
                                   f"emptying its cache")
            mempool = self._mempool
            if mempool is None or not torch._C._cuda_checkPoolLiveAllocations(
                    self.device.index, mempool.id, set()):
                return  # tensors of it live: see _keep_alive
            self._mempool = None  # the next entry makes a new one
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(mempool))
        del mempool  # PyTorch frees its segments (sublet_torch_free)
        torch.cuda.empty_cache()

    def __repr__(self) -> str:
        return (f"<sublet.Pool {self.tag!r} on {self.device}: {human(self.nbytes)}"
                f"{', entered' if self._depth else ''}>")


def _keep_alive(mempool: torch.cuda.MemPool) -> torch.cuda.MemPool:
    """A reference nobody holds keeps the MemPool until empty_cache() finds it empty, or for
    the process's life: destroying a pool under live tensors of it (at the interpreter's exit,
    the registry goes in any order) is nothing PyTorch documents as safe. (The aborts first
    blamed on it, on the H200, were two live blocks at one address: see borrow.c.)"""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(mempool))
    return mempool


class _Segment:
    """Owner of one Pool.empty() allocation: its death hands the pages back to the pool."""

    def __init__(self, client: Client, ptr: int, direct: dict[int, int]):
        weakref.finalize(self, _free_segment, client, ptr, direct).atexit = False


def _free_segment(client: Client, ptr: int, direct: dict[int, int]) -> None:
    direct.pop(ptr, None)
    try:
        client.pool_free(ptr)
    except _errors.SubletError:
        pass  # the client went, and the arena with it


def _retry_after_empty_cache(call, device: torch.device) -> int:
    try:
        return call()
    except _errors.SubletOutOfMemoryError:
        if device.type != "cuda":
            raise
        with torch.cuda.device(device):
            torch.cuda.empty_cache()  # as PyTorch does on running out
        return call()


def pool(tag: str = "default", device: torch.device | str | int | None = None) -> Pool:
    """The sublet pool of `tag` on `device` (default: the current CUDA device): the same object
    for the same tag and device. `with sublet.pool("kv"):` makes every CUDA allocation of the
    process on the device sublet memory of that tag; sublet.lend("kv") lends it."""
    if not isinstance(tag, str) or not tag:
        raise TypeError(f"a pool's tag is a non-empty str, not {tag!r}")
    device, client = resolve_device(device)
    with _lock:
        found = _pools.get((tag, device))
        if found is None or found._client is not client:  # none yet, or its daemon restarted
            found = _pools[(tag, device)] = Pool(tag, device, client)
        return found


def pools_of(tag: str) -> list[Pool]:
    """The pools of this process with that tag, on any device."""
    with _lock:
        return [p for (t, _), p in _pools.items() if t == tag]
