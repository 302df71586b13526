"""Routing a borrower's PyTorch allocations into a loan (see DESIGN.md, "Routing a borrower's
PyTorch allocations").

One ``CUDAPluggableAllocator`` over libsublet's C pair (``sublet_torch_alloc`` /
``sublet_torch_free``) lives for the whole process. Each loan gets a fresh ``MemPool`` on its
device; ``_cuda_beginAllocateToPool`` sends every allocation on that device, from any thread or
stream, into the pool, whose segments the C pair carves out of the loan. The hooks are C and
never call Python; this module only starts and ends the routing and finds leaks.

Not routed (PyTorch keeps these in its own pools): CUDA graph capture pools and
torch.compile's reduce-overhead graphs, symmetric memory, NCCL's internal buffers, and user
MemPools nested inside the loan. On 2.8/2.9 a graph captured inside the loan would take its
memory from the loan's pool: do not capture graphs inside a loan.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from dataclasses import dataclass, field
from typing import Mapping

import torch

SUPPORTED_TORCH = ((2, 8), (2, 15))  # inclusive
SKIP_CHECK_ENV = "SUBLET_SKIP_TORCH_CHECK"
_ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


# --------------------------------------------------------------------------- checks

def parse_torch_version(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.11.0+cu130' or '2.9.0a0+git1'."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise RuntimeError(f"cannot read the torch version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch_version(version: str | None = None,
                        environ: Mapping[str, str] = os.environ) -> None:
    """Refuses torch versions whose allocator internals sublet has not been checked against."""
    if environ.get(SKIP_CHECK_ENV) == "1":
        return
    version = torch.__version__ if version is None else version
    lo, hi = SUPPORTED_TORCH
    if not lo <= parse_torch_version(version) <= hi:
        raise RuntimeError(
            f"sublet supports torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, not {version}: it relies "
            f"on allocator internals (MemPool, _cuda_beginAllocateToPool) that change between "
            f"versions. Install a supported torch, or set {SKIP_CHECK_ENV}=1 to try anyway.")


def alloc_conf_options(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The allocator options from PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF (later wins)."""
    options: dict[str, str] = {}
    for name in _ALLOC_CONF_ENVS:
        for item in environ.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip():
                options[key.strip()] = value.strip()
    return options


_ASYNC_BACKEND_REFUSED = (
    "sublet cannot lend with PyTorch's cudaMallocAsync allocator backend: it routes a "
    "borrower's allocations through a torch.cuda.MemPool, which that backend does not support. "
    "Remove backend:cudaMallocAsync from PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF (the "
    "default backend, native, works).")


def check_alloc_conf(environ: Mapping[str, str] = os.environ) -> None:
    """Refuses the cudaMallocAsync backend, with which no MemPool (so no routing) can exist."""
    if alloc_conf_options(environ).get("backend") == "cudaMallocAsync":
        raise RuntimeError(_ASYNC_BACKEND_REFUSED)


def check_routing_possible(device: int) -> None:
    """Everything that must hold before a loan's routing starts on a CUDA device."""
    check_torch_version()
    check_alloc_conf()
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":  # set by other means
        raise RuntimeError(_ASYNC_BACKEND_REFUSED)
    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cannot start a loan during CUDA graph capture: end the capture "
                               "first (graph pools are not routed into loans)")


# --------------------------------------------------------------------------- the allocator

_allocator: torch.cuda.memory.CUDAPluggableAllocator | None = None


def pluggable_allocator(library_path: str) -> torch.cuda.memory.CUDAPluggableAllocator:
    """The process's one CUDAPluggableAllocator over libsublet's C pair, kept alive forever:
    on 2.10 and older a MemPool holds only a raw pointer to it."""
    global _allocator
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            library_path, "sublet_torch_alloc", "sublet_torch_free")
    return _allocator


def release_cached(device: int) -> None:
    """Hands the blocks PyTorch's own allocator caches but does not use back to the device,
    before the daemon measures the free memory a loan may use: they are then the loan's (a
    borrower's allocations all go to the loan's pool anyway). It also keeps the loan's fresh
    zone the same size from one loan to the next, so that the borrower's window, laid out by
    zone sizes, is kept and nothing is mapped again (a few hundred MiB that a checksum cached
    between two loans cost a remap of the whole window: docs/benchmarks.md)."""
    with torch.cuda.device(device):
        torch.cuda.empty_cache()


def prepare_routing(device: int) -> None:
    """What a process does before it borrows on a CUDA device (lends to itself, or takes an
    offer): refuse what cannot be routed, make the memory PyTorch creates once (cuBLAS
    workspaces) outside the loan, then give back what PyTorch caches. All before the daemon
    measures free memory: memory taken after that would shrink the next loan's fresh zone."""
    check_routing_possible(device)
    warm_up_cublas(device)
    release_cached(device)


_warm: set[tuple[int, int]] = set()  # (device, stream) whose workspaces exist


def warm_up_cublas(device: int) -> None:
    """Creates the cuBLAS(Lt) workspaces of the current stream before the loan: made inside
    it, they would stay alive in the loan's pool and look like a leak. Once per stream, until
    a loan's leak check clears them."""
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    if key in _warm:
        return
    _warm.add(key)
    with torch.cuda.device(device):
        a = torch.ones(8, 8, device=device)
        (a @ a).sum()
        b = a.to(torch.bfloat16)
        torch.nn.functional.linear(b, b, b[0]).sum()
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- leaks

@dataclass
class LeakedBlock:
    """A PyTorch allocation still alive at the end of a loan."""
    size: int
    address: int
    frames: list[str] = field(default_factory=list)  # when memory history is recorded

    def describe(self) -> str:
        where = ("\n      " + "\n      ".join(self.frames[:8])) if self.frames else \
            " (torch.cuda.memory._record_memory_history() records where it was allocated)"
        return f"{self.size} bytes at {self.address:#x}{where}"


def _pool_segments(pool: torch.cuda.MemPool) -> list[dict]:
    try:
        return pool.snapshot()
    except (AttributeError, TypeError):  # versions without MemPool.snapshot
        return [s for s in torch.cuda.memory_snapshot()
                if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)]


def _format_frames(frames: list[dict]) -> list[str]:
    """Where a block was allocated, innermost first: the Python frames when there are any
    (the C++ ones are mostly PyTorch's own dispatch)."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    return [f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"
            for f in (python or frames)]


def live_blocks(pool: torch.cuda.MemPool, device: int) -> list[LeakedBlock]:
    """The pool's allocated blocks; blocks pending free (record_stream) are not leaks."""
    return [LeakedBlock(b["size"], b["address"], _format_frames(b.get("frames", [])))
            for seg in _pool_segments(pool) if seg.get("device", device) == device
            for b in seg["blocks"] if b["state"] == "active_allocated"]


# --------------------------------------------------------------------------- routing

class PoolRouter:
    """Routes all PyTorch allocations on one CUDA device into a fresh MemPool for one loan."""

    def __init__(self, device: int, library_path: str):
        self.device = device
        self._allocator = pluggable_allocator(library_path)
        self._pool: torch.cuda.MemPool | None = None
        self._fallback: contextlib.ExitStack | None = None
        self._settings_to_restore: str | None = None

    def begin(self) -> None:
        """Starts routing; prepare_routing(device) must have run before the borrow."""
        self._avoid_expandable_segments()
        self._pool = torch.cuda.MemPool(self._allocator._allocator)
        if hasattr(torch._C, "_cuda_beginAllocateToPool"):
            torch._C._cuda_beginAllocateToPool(self.device, self._pool.id)
        else:  # routes only this thread; keep backward on it at least
            self._fallback = contextlib.ExitStack()
            self._fallback.enter_context(torch.autograd.set_multithreading_enabled(False))
            self._fallback.enter_context(torch.cuda.use_mem_pool(self._pool, self.device))

    def end(self) -> list[LeakedBlock]:
        """Stops routing and frees the pool; returns what the borrower left alive."""
        assert self._pool is not None, "end() without begin()"
        pool, self._pool = self._pool, None
        self._stop_routing(pool)
        torch.cuda.synchronize(self.device)
        self._flush_deferred_frees()
        leaks = self._leaks(pool)
        self._restore_settings()
        # Deleting the pool frees its cached segments through sublet_torch_free (empty_cache()
        # does not); segments of leaked blocks stay until those tensors die.
        del pool
        return leaks

    def _stop_routing(self, pool: torch.cuda.MemPool) -> None:
        if self._fallback is not None:
            self._fallback.close()  # use_mem_pool ends and releases the pool itself
            self._fallback = None
        else:
            torch._C._cuda_endAllocateToPool(self.device, pool.id)
            torch._C._cuda_releasePool(self.device, pool.id)

    def _flush_deferred_frees(self) -> None:
        # Frees deferred by record_stream wait on events the allocator processes at its next
        # allocation; after synchronize() they are all done. This one lands outside the pool.
        torch.empty(1, device=self.device)

    def _leaks(self, pool: torch.cuda.MemPool) -> list[LeakedBlock]:
        """What the borrower left alive in the pool. Before blaming it, this drops what is
        alive through no doing of its own: tensors held only by reference cycles (the GC has
        not run yet), and cuBLAS workspaces made in the loan (a matmul on a new stream or
        thread creates one, and PyTorch keeps it on purpose)."""
        for clear in (gc.collect, torch._C._cuda_clearCublasWorkspaces):
            if self._pool_is_empty(pool):
                return []
            clear()
            _warm.clear()  # after either: the workspaces may be gone
            torch.cuda.synchronize(self.device)
            self._flush_deferred_frees()
        if self._pool_is_empty(pool):
            return []
        return live_blocks(pool, self.device)

    def _pool_is_empty(self, pool: torch.cuda.MemPool) -> bool:
        return torch._C._cuda_checkPoolLiveAllocations(self.device, pool.id, set())

    def _avoid_expandable_segments(self) -> None:
        """On 2.8-2.10, pools with a custom allocator and expandable segments interact badly:
        turn expandable segments off for the loan."""
        if parse_torch_version(torch.__version__) >= (2, 11):
            return
        if alloc_conf_options().get("expandable_segments", "").lower() == "true":
            torch.cuda.memory._set_allocator_settings("expandable_segments:False")
            self._settings_to_restore = "expandable_segments:True"

    def _restore_settings(self) -> None:
        if self._settings_to_restore:
            torch.cuda.memory._set_allocator_settings(self._settings_to_restore)
            self._settings_to_restore = None
