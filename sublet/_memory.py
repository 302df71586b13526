"""Tensors over sublet memory: regions from subletd (sublet.empty) and loan allocations.

A region is mapped at one address in this process; it becomes a tensor without a copy: on CUDA
through an object exposing ``__cuda_array_interface__``, on the memfd backend (no GPU: tests,
CI) as a CPU tensor over the mapped host memory. The tensor keeps that object alive, and the
object keeps the Region alive; when the last tensor over it dies, the region is released.

A registry maps each region's address (its tensors' storage data_ptr) to the Region, so that
lend() can tell sublet's tensors from others and views of one tensor from views of another.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence

import torch

from . import _lib
from ._client import Client, client_for
from ._daemon import requested_backend

# A PyTorch user catches running out as torch.OutOfMemoryError (torch.cuda.OutOfMemoryError
# before torch 2.3): sublet's error joins it here, where torch is loaded, since every module
# that can run out (regions, pools, loans, releases) imports this one first.
_lib.join_torch_out_of_memory(getattr(torch, "OutOfMemoryError", None)
                              or torch.cuda.OutOfMemoryError)

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

def parse_size(size: tuple, keyword: Sequence[int] | None = None) -> tuple[int, ...]:
    """torch-style sizes: empty(2, 3) or empty((2, 3)) or empty(torch.Size([2, 3])), or as
    torch.empty's keyword, empty(size=(2, 3)) (`keyword`)."""
    if keyword is not None:
        if size:
            raise TypeError(f"the size is given twice, {size!r} and size={keyword!r}: give it "
                            f"once, positionally or as size=")
        size = (keyword,)
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(n, int) and n >= 0 for n in size):
        raise TypeError(f"sizes must be non-negative ints, got {size!r}")
    return tuple(size)


# What torch.empty takes for a dtype beside a torch.dtype: Python's scalar types.
_PYTHON_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64,
                  complex: torch.complex128}


def as_dtype(dtype: torch.dtype | type | None) -> torch.dtype:
    """The dtype torch.empty would make: torch.get_default_dtype() for None, torch's own for
    Python's bool, int, float and complex."""
    if dtype is None:
        return torch.get_default_dtype()
    if isinstance(dtype, type) and dtype in _PYTHON_DTYPES:
        return _PYTHON_DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.uint8, got {dtype!r}")
    return dtype


def nbytes_of(size: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of that size and dtype (as_dtype's); a tensor of none is refused."""
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
    client = client_for(backend, device.index if device.type == "cuda" else 0)
    if client.info.backend != backend:
        raise ValueError(f"the subletd reached runs the {client.info.backend} backend, but "
                         f"{backend} is wanted: point $SUBLET_SOCKET at a {backend} daemon, "
                         f"or set SUBLET_BACKEND={client.info.backend}")
    return device, client


def _as_device(device: torch.device | str | int | None, backend: str) -> torch.device:
    """torch.empty's device forms (None, "cuda", "cuda:1", "cpu", a torch.device, a CUDA
    index), as sublet names them: "cuda:N" with its index, "cpu" without one. Checked against
    the backend before CUDA is asked anything, so a mismatch says what to change."""
    if device is None:
        return _cuda_device(None) if backend == "cuda" else torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device is a torch.device, a str such as 'cuda:0', or a CUDA device "
                        f"index, not {device!r}")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"sublet works on CUDA devices, not {device}")
    if device.type == "cuda" and backend != "cuda":
        why = ("SUBLET_BACKEND=memfd" if os.environ.get("SUBLET_BACKEND")
               else "no CUDA GPU is usable here: torch.cuda.is_available() is False")
        raise ValueError(f"device {device} needs sublet's cuda backend, but it runs the memfd "
                         f"backend ({why}), whose tensors are CPU tensors: leave device out or "
                         f"pass device='cpu'")
    if device.type == "cpu" and backend != "memfd":
        raise ValueError("sublet lends GPU memory: device='cpu' works only with the memfd test "
                         "backend (set SUBLET_BACKEND=memfd)")
    return _cuda_device(device.index) if device.type == "cuda" else torch.device("cpu")


def _cuda_device(index: int | None) -> torch.device:
    """cuda:index, or the current CUDA device for None; one this process sees, or an error
    saying which it sees (rather than CUDA's own 'invalid device ordinal' later)."""
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("SUBLET_BACKEND=cuda, but this process sees no CUDA device: check the "
                         "driver and CUDA_VISIBLE_DEVICES, or unset SUBLET_BACKEND to run on "
                         "the memfd backend")
    if index is None:
        index = torch.cuda.current_device()
    if not 0 <= index < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(f"device cuda:{index} does not exist: this process sees {count} CUDA "
                         f"device(s){seen}, cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


# --------------------------------------------------------------------------- sublet.empty

def empty(*size, dtype: torch.dtype | type | None = None,
          device: torch.device | str | int | None = None, requires_grad: bool = False,
          **kwargs: Sequence[int]) -> torch.Tensor:
    """A tensor whose memory is a region from subletd, ready to be lent with sublet.lend().

    Takes torch.empty's arguments: the size positionally or as size=(...); dtype
    (torch.get_default_dtype() when None; Python's float is torch.float64 as there); device
    ('cuda', 'cuda:N', a torch.device or an index; default: the current CUDA device; 'cpu'
    only with the memfd test backend); requires_grad. Like torch.empty: the contents are
    undefined. Freeing the tensor (and all its views) releases the region.
    """
    shape = parse_size(size, _size_keyword(kwargs))
    dtype = as_dtype(dtype)
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
    return wrap(region.addr, nbytes, device, region, shape, dtype).requires_grad_(requires_grad)


def _size_keyword(kwargs: dict[str, Sequence[int]]) -> Sequence[int] | None:
    """torch.empty(size=...): a keyword that `*size` cannot also be named."""
    unknown = sorted(set(kwargs) - {"size"})
    if unknown:
        raise TypeError(f"sublet.empty() got unexpected keyword argument(s) {unknown}: it "
                        f"takes the size, dtype, device and requires_grad (no layout, "
                        f"pin_memory or out: its tensors are strided device memory of sublet's)")
    return kwargs.get("size")

