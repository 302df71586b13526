"""sublet's torch_memory_saver in preload mode: the implementation over sublet's preload
library (preload/tms.h), when this process runs with it in LD_PRELOAD.

The library is torch_memory_saver's C interface on sublet pools: it takes PyTorch's
cudaMalloc/cudaFree, and with TMS_INIT_ENABLE=1 the process's allocations from its start are
region allocations (slime's trainer), paused by pause(). So this side is the original's
preload mode: a region sets the calling thread's config in the library (regions are per
thread, as the original's) around a MemPool of PyTorch's own allocator, whose segments come
through cudaMalloc; pause and resume are the library's; get_cpu_backup reads the library's host
copy. Without CUDA (sublet's memfd backend, in tests) a region sets only the config, and
allocations are the caller's own cudaMalloc calls.

What differs from _impl.py's (the pools of hook_mode "torch", and of preload mode without the
library): pause(keep=..., stay=...) is refused (it needs sublet's pools: hook_mode = "torch");
a tag is one pool whatever its backup flag, as the original's.
"""

from __future__ import annotations

import ctypes
import os
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Optional

import torch

from . import _env

SUBLET_SYMBOL = "tms_sublet_version"

_PROTOTYPES: dict[str, tuple[Any, list[Any]]] = {
    "tms_set_interesting_region": (None, [ctypes.c_bool]),
    "tms_get_interesting_region": (ctypes.c_bool, []),
    "tms_set_current_tag": (None, [ctypes.c_char_p]),
    "tms_get_current_tag": (ctypes.c_char_p, []),
    "tms_set_enable_cpu_backup": (None, [ctypes.c_bool]),
    "tms_get_enable_cpu_backup": (ctypes.c_bool, []),
    "tms_set_cpu_backup_backend": (None, [ctypes.c_char_p]),
    "tms_get_cpu_backup_backend": (ctypes.c_char_p, []),
    "tms_set_enable_disk_backup": (None, [ctypes.c_bool]),
    "tms_get_enable_disk_backup": (ctypes.c_bool, []),
    "tms_set_disk_backup_dir": (None, [ctypes.c_char_p]),
    "set_memory_margin_bytes": (None, [ctypes.c_uint64]),
    "tms_set_retain_cpu_backup": (None, [ctypes.c_bool]),
    "tms_get_retain_cpu_backup": (ctypes.c_bool, []),
    "tms_pause": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_resume": (ctypes.c_int, [ctypes.c_char_p]),
    "tms_get_cpu_backup_pointer": (ctypes.POINTER(ctypes.c_uint8),
                                   [ctypes.POINTER(ctypes.c_uint8), ctypes.c_uint64]),
    "tms_sublet_last_error": (ctypes.c_char_p, []),
    "tms_sublet_version": (ctypes.c_char_p, []),
    "tms_sublet_pause_need": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_uint64]),
}


class OriginalLibraryError(RuntimeError):
    """torch_memory_saver's own preload library is in this process beside sublet's drop-in."""


def loaded() -> Optional[ctypes.CDLL]:
    """sublet's preload library when this process runs with it (its symbols are global),
    with every prototype declared; None when it does not. The original's library in its place
    is refused: its allocations would be paused by nothing here."""
    process = ctypes.CDLL(None)
    if hasattr(process, SUBLET_SYMBOL):
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(process, name)
            fn.restype, fn.argtypes = restype, argtypes
        return process
    if hasattr(process, "tms_pause"):
        raise OriginalLibraryError(
            f"torch_memory_saver's own preload library is loaded in this process (LD_PRELOAD="
            f"{os.environ.get('LD_PRELOAD', '')!r}) with sublet's drop-in installed as "
            f"torch_memory_saver: point LD_PRELOAD at sublet's library (torch_memory_saver."
            f"hooks.mode_preload.configure_subprocess() does), or uninstall sublet's drop-in")
    return None


def _text(value: Optional[str]) -> Optional[bytes]:
    return value.encode("utf-8") if value else None


class PreloadWrapper:
    """The original's BinaryWrapper over the loaded library: `.cdll` is the library itself."""

    def __init__(self, cdll: ctypes.CDLL):
        self.cdll = cdll

    def set_config(self, *, tag: str, interesting_region: bool, enable_cpu_backup: bool,
                   cpu_backup_backend: Optional[str] = None, enable_disk_backup: bool = False):
        self.cdll.tms_set_current_tag(tag.encode("utf-8"))
        self.cdll.tms_set_interesting_region(interesting_region)
        self.cdll.tms_set_enable_cpu_backup(enable_cpu_backup)
        if cpu_backup_backend:
            self.cdll.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8"))
        self.cdll.tms_set_enable_disk_backup(enable_disk_backup)


class PreloadImpl:
    """The implementation in preload mode with sublet's library (the module's text)."""

    def __init__(self, cdll: ctypes.CDLL, hook_mode: str = "preload"):
        self._hook_mode = hook_mode
        self._binary_wrapper = PreloadWrapper(cdll)
        self._cdll = cdll
        self._mem_pools: dict[tuple, Any] = defaultdict(torch.cuda.MemPool)
        self.disk_backup_dir = os.environ.get("TMS_DISK_BACKUP_DIR", "/tmp")

    def start_init_region(self) -> None:
        """Nothing: the library's thread config starts from $TMS_INIT_ENABLE* itself."""
        if _env.env_bool("TMS_INIT_ENABLE_DISK_BACKUP"):
            raise NotImplementedError(_env.NO_DISK_BACKUP)

    # ------------------------------------------------------------ regions
    @contextmanager
    def region(self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool,
               cpu_backup_backend: Optional[str]):
        if enable_disk_backup:
            raise NotImplementedError(_env.NO_DISK_BACKUP)
        backend = (cpu_backup_backend or self._backend()) if enable_cpu_backup else ""
        with self._pool((tag, enable_cpu_backup, False, backend)):
            with self._with_region_config(tag=tag, enable_cpu_backup=enable_cpu_backup,
                                          cpu_backup_backend=cpu_backup_backend):
                yield

    @contextmanager
    def cuda_graph(self, cuda_graph, pool, stream, capture_error_mode, tag: str,
                   enable_cpu_backup: bool, cpu_backup_backend: Optional[str]):
        with torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                              capture_error_mode=capture_error_mode):
            with self._with_region_config(tag=tag, enable_cpu_backup=enable_cpu_backup,
                                          cpu_backup_backend=cpu_backup_backend):
                yield

    @contextmanager
    def disable(self, dispose_mem_pool_after_use: bool = True):
        """Allocations in the block are the CUDA runtime's, in a MemPool freed at the end."""
        if not self._cdll.tms_get_interesting_region():
            raise RuntimeError("disable() is for inside a region (or with TMS_INIT_ENABLE=1): "
                               "outside one, allocations are not torch_memory_saver's already")
        self._cdll.tms_set_interesting_region(False)
        try:
            if torch.cuda.is_available():
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    yield
                del pool
            else:
                yield
        finally:
            self._cdll.tms_set_interesting_region(True)

    def _backend(self) -> str:
        return self._cdll.tms_get_cpu_backup_backend().decode("utf-8")

    @contextmanager
    def _pool(self, key: tuple):
        """The region's MemPool (PyTorch's allocator, so its segments come through the
        library's cudaMalloc), one per (tag, cpu backup, disk backup, backend, device): the
        original's `_mem_pools` and its keys, which code reaches into (its cpu_backup
        example pops one to free a tag's memory)."""
        if not torch.cuda.is_available():
            yield
            return
        with torch.cuda.use_mem_pool(self._mem_pools[(*key, torch.cuda.current_device())]):
            yield

    @contextmanager
    def _with_region_config(self, tag: str, enable_cpu_backup: bool,
                            cpu_backup_backend: Optional[str], enable_disk_backup: bool = False):
        """The calling thread's config in the library for the block, then what it was (the
        original's name and keywords)."""
        if enable_disk_backup:
            raise NotImplementedError(_env.NO_DISK_BACKUP)
        cdll = self._cdll
        saved = dict(tag=cdll.tms_get_current_tag().decode("utf-8"),
                     interesting_region=cdll.tms_get_interesting_region(),
                     enable_cpu_backup=cdll.tms_get_enable_cpu_backup(),
                     cpu_backup_backend=self._backend(),
                     enable_disk_backup=cdll.tms_get_enable_disk_backup())
        self._binary_wrapper.set_config(tag=tag, interesting_region=True,
                                        enable_cpu_backup=enable_cpu_backup,
                                        cpu_backup_backend=cpu_backup_backend)
        try:
            yield
        finally:
            self._binary_wrapper.set_config(**saved)

    # ------------------------------------------------------------ pause, resume
    def pause(self, tag: Optional[str], keep=None, stay: Optional[int] = None,
              need: Optional[int] = None) -> None:
        """need: each tag released by need (the library's tms_sublet_pause_need): only the
        pages the need takes beyond the free memory, or all of a tag that cannot give that
        much; the backups are this library's host copies, as without need."""
        if keep is not None or stay is not None:
            raise NotImplementedError(
                "pause(keep=..., stay=...) takes sublet pools: with sublet's preload library "
                "regions are the original's; set torch_memory_saver.hook_mode = 'torch' "
                "before the first region to pause with keep=")
        if need is None:
            self._check("pause", tag, self._cdll.tms_pause(_text(tag)))
        else:
            self._check("pause", tag, self._cdll.tms_sublet_pause_need(_text(tag), need))

    def resume(self, tag: Optional[str]) -> None:
        self._check("resume", tag, self._cdll.tms_resume(_text(tag)))

    def _check(self, what: str, tag: Optional[str], rc: int) -> None:
        if rc != 0:
            message = self._cdll.tms_sublet_last_error().decode("utf-8", "replace")
            raise RuntimeError(f"torch_memory_saver.{what}({tag!r}): {message} (CUDA error "
                               f"{rc}; torch_memory_saver would exit(1) here)")

    # ------------------------------------------------------------ host copies, settings
    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False):
        if not x.is_contiguous():
            raise ValueError(f"get_cpu_backup needs a contiguous tensor (shape "
                             f"{tuple(x.shape)}, strides {x.stride()})")
        nbytes = x.nbytes
        gpu = ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        host = self._cdll.tms_get_cpu_backup_pointer(gpu, nbytes)
        if not host:
            return None
        import numpy as np
        found = torch.from_numpy(np.ctypeslib.as_array(host, shape=(nbytes,)))
        found = found.view(x.dtype).view(x.shape)
        return found if zero_copy else found.clone()

    def set_memory_margin_bytes(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
            raise ValueError(f"memory_margin_bytes is a byte count (an int >= 0), not "
                             f"{value!r}")
        self._cdll.set_memory_margin_bytes(value)

    @property
    def retain_cpu_backup(self) -> bool:
        return bool(self._cdll.tms_get_retain_cpu_backup())

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._cdll.tms_set_retain_cpu_backup(bool(value))

    def set_disk_backup_dir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.disk_backup_dir = path
