"""torch_memory_saver.entrypoint on sublet: TorchMemorySaver, the original's facade, over
_TorchMemorySaverImpl (_impl.py: sublet pools), or in preload mode with sublet's preload
library in the process, over _preload.PreloadImpl (the library's regions, per thread). Every call makes the implementation on first use with
_ensure_initialized(), which returns None, and then uses self._impl, as the original: a
plug-in may wrap _ensure_initialized or replace _impl (NVIDIA Dynamo's GPU memory service
does both, with hook_mode = "gms").

sublet adds pause(tag, keep=..., stay=..., need=...): keep is what sublet.release takes (views
of the tag's tensors, sublet.blocks(...)); those bytes come back, staying on the GPU where they
fit unless stay= (bytes) says otherwise. need (or $SUBLET_RELEASE_NEED, for frameworks that
call pause themselves: compat/_need.py) releases only what a taker needs beyond the free memory.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Literal, Optional

import torch

from . import _preload
from ._env import TAG_DEFAULT as _TAG_DEFAULT
from ._impl import _TorchMemorySaverImpl
from .binary_wrapper import BinaryWrapper
from .hooks.base import HOOK_MODES, HookMode, HookUtilBase
from .utils import is_xpu

__all__ = ["TorchMemorySaver", "_TorchMemorySaverImpl", "CpuBackupBackend", "_TAG_DEFAULT",
           "BinaryWrapper", "HookUtilBase", "HookMode", "is_xpu", "_sanity_checks"]

CpuBackupBackend = Literal["mmap", "pinned"]


class TorchMemorySaver:
    """torch_memory_saver's facade: the implementation is made at the first call
    (_ensure_initialized), so hook_mode can be set before it, as in the original."""

    def __init__(self):
        self._impl_ctor_kwargs: dict[str, Any] = {}
        self._impl: Optional[_TorchMemorySaverImpl] = None

    @contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """Allocations inside go to sublet pool `tag` (`tag + "+backup"` with
        enable_cpu_backup: pause() then keeps all of their bytes on the host). Nests: the
        inner region's tag and flags win until it ends. enable_disk_backup is refused
        (NotImplementedError: use enable_cpu_backup)."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._initialized()
        if enable_cpu_backup and enable_disk_backup:
            raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
        with impl.region(tag=tag, enable_cpu_backup=enable_cpu_backup,
                         enable_disk_backup=enable_disk_backup,
                         cpu_backup_backend=cpu_backup_backend):
            yield

    @contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[CpuBackupBackend] = None):
        """As torch.cuda.graph(...), but the graph's memory is pauseable under `tag`: it is
        captured into the tag's graph pool, sublet pool `tag + "+graph"` (whose MemPool
        replaces `pool`: the graphs of one tag share it, as graphs given one pool share
        theirs)."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._initialized()
        with impl.cuda_graph(cuda_graph=cuda_graph, pool=pool, stream=stream,
                             capture_error_mode=capture_error_mode, tag=tag,
                             enable_cpu_backup=enable_cpu_backup,
                             cpu_backup_backend=cpu_backup_backend):
            yield

    @contextmanager
    def disable(self):
        """Inside a region (or TMS_INIT_ENABLE=1): allocations in the block are ordinary
        PyTorch memory, in a MemPool of their own freed at the end."""
        impl = self._initialized()
        with impl.disable():
            yield

    def pause(self, tag: Optional[str] = None, *, keep=None, stay: Optional[int] = None,
              need=None):
        """Gives the memory of `tag` (None: of every tag not paused) back to the driver.
        Without keep: the enable_cpu_backup tensors' bytes go to the host, the others' are
        lost. sublet adds keep= (views of the tag's tensors, sublet.blocks(...)): those bytes
        come back, staying on the GPU where they fit unless stay= (bytes) says otherwise; and
        need= (bytes, or a size such as "24GiB"; default: $SUBLET_RELEASE_NEED, read now): the
        device memory a taker needs; only the pages that takes beyond the free memory are
        released, the cheapest to give (few kept bytes in few runs; a tag that cannot give
        that much is released whole, and the next pause goes on by the same need)."""
        from .. import _need
        need = _need.need_for_call(need)
        impl = self._initialized()
        if keep is None and stay is None and need is None:
            impl.pause(tag=tag)  # the original's call: a plugged-in _impl keeps working
        elif need is None:
            impl.pause(tag=tag, keep=keep, stay=stay)
        else:
            impl.pause(tag=tag, keep=keep, stay=stay, need=need)

    def resume(self, tag: Optional[str] = None):
        """Maps fresh memory at the same addresses and restores what pause() kept."""
        self._initialized().resume(tag=tag)

    @property
    def enabled(self):  # for compatibility, as the original
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set (as in torch_memory_saver)")

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode):
        """Stored for the implementation; sublet routes the same way in every mode."""
        if hook_mode not in HOOK_MODES:
            raise ValueError(f"hook_mode is one of {', '.join(HOOK_MODES)}, not {hook_mode!r}")
        if not hasattr(self, "_impl_ctor_kwargs"):
            raise AttributeError("hook_mode must be set before the first use of "
                                 "torch_memory_saver (as in the original)")
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        """Region allocations needing new device memory fail with out-of-memory while fewer
        than `value` bytes would stay free (0: no check)."""
        self._initialized().set_memory_margin_bytes(value)

    @property
    def retain_cpu_backup(self) -> bool:
        return self._initialized().retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        self._initialized().retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        """The host copy of x (a contiguous tensor made in a region with enable_cpu_backup)
        while its tag is paused, or kept by retain_cpu_backup; else None."""
        return self._initialized().get_cpu_backup(x, zero_copy=zero_copy)

    def set_disk_backup_dir(self, path: str):
        """Creates the directory and records it; disk backup itself is refused: a region
        with enable_disk_backup=True raises NotImplementedError naming cpu backup."""
        self._initialized().set_disk_backup_dir(path)

    def _validate_cpu_backup_backend(self, enable_cpu_backup: bool,
                                     cpu_backup_backend: Optional[CpuBackupBackend]) -> None:
        """As the original: a backend needs cpu backup, and none is taken on XPU; mmap not on
        ROCm."""
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
        if is_xpu():
            raise ValueError("cpu_backup_backend is not supported on XPU; host shadows use "
                             "malloc")
        if cpu_backup_backend == "mmap" and torch.version.hip:
            raise ValueError("cpu_backup_backend='mmap' is not supported on ROCm")
        if cpu_backup_backend not in ("mmap", "pinned"):
            raise ValueError(f"cpu_backup_backend is 'mmap' or 'pinned', not "
                             f"{cpu_backup_backend!r}")

    def _ensure_initialized(self) -> None:
        """Makes the implementation on first use; returns None, as the original."""
        if self._impl is not None:
            return
        kwargs = self._impl_ctor_kwargs
        library = _preload.loaded() if kwargs.get("hook_mode", "preload") == "preload" else None
        _sanity_checks(preload=library is not None)
        if library is not None:
            self._impl = _preload.PreloadImpl(library, **kwargs)
        else:
            self._impl = _TorchMemorySaverImpl(**kwargs)
        del self._impl_ctor_kwargs
        self._impl.start_init_region()

    def _initialized(self) -> _TorchMemorySaverImpl:
        """self._impl after _ensure_initialized() (whoever wraps or replaces it)."""
        self._ensure_initialized()
        if self._impl is None:
            raise RuntimeError("TorchMemorySaver._ensure_initialized() left no _impl: a "
                               "plug-in that wraps it must set self._impl")
        return self._impl


def _sanity_checks(preload: bool = False) -> None:
    """As the original, under the preload library: expandable segments in
    PYTORCH_CUDA_ALLOC_CONF are refused, since PyTorch then maps its memory itself and
    cudaMalloc, which the library takes, is never called (nothing would pause). sublet's
    pools take their segments from their own MemPools, and check nothing."""
    if preload and "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        raise RuntimeError("torch_memory_saver (sublet's preload library): "
                           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True bypasses "
                           "cudaMalloc, so nothing would be paused: unset it, or set "
                           "torch_memory_saver.hook_mode = 'torch' before the first use")
