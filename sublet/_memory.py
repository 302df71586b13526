"""Tensors over sublet memory: regions from subletd (sublet.empty) and loan allocations.

A region is mapped at one address in this process; it becomes a tensor without a copy: on CUDA
through an object exposing ``__cuda_array_interface__``, on the memfd backend (no GPU: tests,
CI) as a CPU tensor over the mapped host memory. The tensor keeps that object alive, and the
object keeps the Region alive; when the last tensor over it dies, the region is released.

A registry maps each region's address (its tensors' storage data_ptr) to the Region, so that
lend() can tell sublet's tensors from others and views of one tensor from views of another.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from . import _lib
from ._client import Client, client_for
from ._daemon import requested_backend

_registry: dict[int, weakref.ref["Region"]] = {}
_registry_lock = threading.Lock()


class Region:
    """One region of subletd owned by this process: the memory of one sublet.empty() tensor."""

    def __init__(self, client: Client, device: torch.device, nbytes: int):
        self.client = client
        self.device = device
        self.handle = handle = client.region_create(nbytes)
        self.addr, self.size, self.id = handle.addr, handle.size, handle.id  # size: whole pages
        self.nbytes = nbytes  # the tensor's; the last page's tail past it is nobody's
        self.lent = False  # one loan of a region at a time; set by the lending side
        with _registry_lock:
            _registry[self.addr] = weakref.ref(self)
        # At interpreter exit the daemon goes too (or sees us leave): no release then.
        weakref.finalize(self, _release, handle, self.addr).atexit = False


def _release(handle: _lib.RegionHandle, addr: int) -> None:
    with _registry_lock:
        _registry.pop(addr, None)
    try:
        _lib.Client.region_release(handle)
    except _lib.DaemonUnavailableError:
        pass  # the daemon went, and the region with it


def region_of(tensor: torch.Tensor) -> Region:
    """The Region under a tensor made by sublet.empty() (or a view of one)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"sublet lends a torch.Tensor made by sublet.empty(), not a "
                        f"{type(tensor).__name__}")
    ref = _registry.get(tensor.untyped_storage().data_ptr())
    region = ref() if ref is not None else None
    if region is None:
        raise ValueError(
            "this tensor's memory was not made by sublet: only tensors from sublet.empty() can "
            "be lent. Allocate the tensor you want to lend with sublet.empty(*size, dtype=...)")
    return region


# --------------------------------------------------------------------------- wrapping

class _CudaMemory:
    """Device memory for torch.as_tensor(): a uint8 vector, zero-copy. Holds `owner` alive."""

    def __init__(self, addr: int, nbytes: int, owner: object):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2,
            "strides": None}


def wrap(addr: int, nbytes: int, device: torch.device, owner: object,
         size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `size` and `dtype` over nbytes at addr; `owner` lives as long as it does."""
    if device.type == "cuda":
        raw = torch.as_tensor(_CudaMemory(addr, nbytes, owner), device=device)
    else:
        buffer = _lib.host_bytes(addr, nbytes)
        buffer.owner = owner  # torch.frombuffer keeps the buffer, the buffer keeps the owner
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(dtype).view(tuple(size))


# --------------------------------------------------------------------------- arguments

def parse_size(size: tuple) -> tuple[int, ...]:
    """torch-style sizes: empty(2, 3) or empty((2, 3)) or empty(torch.Size([2, 3]))."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(n, int) and n >= 0 for n in size):
        raise TypeError(f"sizes must be non-negative ints, got {size!r}")
    return tuple(size)


def nbytes_of(size: tuple[int, ...], dtype: torch.dtype) -> int:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.uint8, got {dtype!r}")
    numel = 1
    for n in size:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        raise ValueError(f"a sublet tensor needs at least one byte; size {size} of {dtype} "
                         f"has none")
    return nbytes


def resolve_device(device: torch.device | str | int | None) -> tuple[torch.device, Client]:
    """The tensor's device and the daemon connection that serves it."""
    backend = requested_backend()
    device = _as_device(device, backend)
    if device.type == "cuda" and backend != "cuda":
        raise ValueError(f"device {device} needs the cuda backend, but SUBLET_BACKEND="
                         f"{backend} (or CUDA is unavailable)")
    if device.type == "cpu" and backend != "memfd":
        raise ValueError("sublet lends GPU memory: device='cpu' works only with the memfd test "
                         "backend (set SUBLET_BACKEND=memfd)")
    client = client_for(backend, device.index if device.type == "cuda" else 0)
    if client.info.backend != backend:
        raise ValueError(f"the subletd reached runs the {client.info.backend} backend, but "
                         f"{backend} is wanted: point $SUBLET_SOCKET at a {backend} daemon, "
                         f"or set SUBLET_BACKEND={client.info.backend}")
    return device, client


def _as_device(device: torch.device | str | int | None, backend: str) -> torch.device:
    if device is None:
        return (torch.device("cuda", torch.cuda.current_device()) if backend == "cuda"
                else torch.device("cpu"))
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"sublet works on CUDA devices, not {device}")
    return device


# --------------------------------------------------------------------------- sublet.empty

def empty(*size, dtype: torch.dtype | None = None,
          device: torch.device | str | int | None = None) -> torch.Tensor:
    """A tensor whose memory is a region from subletd, ready to be lent with sublet.lend().
    dtype: torch.get_default_dtype() when None, as for torch.empty.

    Like torch.empty: the contents are undefined. device: a CUDA device (default: the current
    one); 'cpu' only with the memfd test backend. Freeing the tensor (and all its views)
    releases the region.
    """
    shape = parse_size(size)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    nbytes = nbytes_of(shape, dtype)
    device, client = resolve_device(device)
    try:
        region = Region(client, device, nbytes)
    except _lib.SubletOutOfMemoryError:
        if device.type != "cuda":
            raise
        # As PyTorch does on running out: what its allocator caches unused may make the room.
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        region = Region(client, device, nbytes)
    return wrap(region.addr, nbytes, device, region, shape, dtype)

