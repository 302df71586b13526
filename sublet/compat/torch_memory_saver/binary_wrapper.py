"""torch_memory_saver.binary_wrapper on sublet: BinaryWrapper, whose `.cdll` is a Python-level
stand-in for the original's C library (`_impl._binary_wrapper.cdll`) where regions are sublet
pools (hook_mode "torch", or no preload library in the process). Under sublet's preload library
`_impl._binary_wrapper.cdll` is the library itself (_preload.py), with every symbol.

What it does: the calls code makes on the original's library that have a meaning for sublet's
regions, on the calling process's current device: the region config getters
(tms_get_current_tag, tms_get_interesting_region, tms_get_enable_cpu_backup,
tms_get_cpu_backup_backend, tms_get_enable_disk_backup), tms_set_interesting_region (False:
allocations are PyTorch's own until set back, as slime does around deep_ep's Buffer),
tms_pause / tms_resume, set_memory_margin_bytes, tms_get/set_retain_cpu_backup and
tms_set_disk_backup_dir. Each is a Python function taking what the C one takes (bytes for
strings), returning what it returns; argtypes and restype may be set on them and are ignored.

The CUDA runtime's symbols, which the original's library re-exports (code calls
cdll.cudaHostGetFlags on a get_cpu_backup() pointer), are the process's own libcudart's, the
one PyTorch loaded: ctypes functions, as the original's.

What it does not do: it is no shared library, so `ctypes.CDLL(None).tms_pause` finds nothing,
and the other setters (tms_set_current_tag, tms_set_enable_cpu_backup, ...: use region()),
tms_get_cpu_backup_pointer (use get_cpu_backup()) and the XPU ones raise AttributeError or
NotImplementedError naming the alternative: the preload library has the real ones.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional


class BinaryWrapper:
    """The original's BinaryWrapper(path_binary) loads its library; sublet's wraps the
    implementation whose regions the stand-in library speaks of."""

    def __init__(self, impl: Any):
        self.cdll = _Cdll(impl)

    def set_config(self, *, tag: str, interesting_region: bool, enable_cpu_backup: bool,
                   cpu_backup_backend: Optional[str] = None, enable_disk_backup: bool = False):
        raise NotImplementedError("sublet's torch_memory_saver sets a region's config with "
                                  "region(tag, enable_cpu_backup=...), not through its library")


def _text(value: Optional[bytes]) -> Optional[str]:
    return None if value is None else value.decode("utf-8")


class _Cdll:
    """The stand-in library: see the module's text for what it has."""

    def __init__(self, impl: Any):
        self._impl = impl
        calls: dict[str, Callable[..., Any]] = {
            "tms_get_interesting_region": lambda: impl.interesting(),
            "tms_set_interesting_region": lambda value: impl.set_interesting(bool(value)),
            "tms_get_current_tag": lambda: impl.config().tag.encode("utf-8"),
            "tms_get_enable_cpu_backup": lambda: impl.config().enable_cpu_backup,
            "tms_get_cpu_backup_backend": lambda: impl.config().backend.encode("utf-8"),
            "tms_get_enable_disk_backup": lambda: False,
            "tms_pause": lambda tag: impl.pause(_text(tag)) or 0,
            "tms_resume": lambda tag: impl.resume(_text(tag)) or 0,
            "set_memory_margin_bytes": lambda value: impl.set_memory_margin_bytes(int(value)),
            "tms_get_retain_cpu_backup": lambda: impl.retain_cpu_backup,
            "tms_set_retain_cpu_backup": lambda value: setattr(impl, "retain_cpu_backup",
                                                               bool(value)),
            "tms_set_disk_backup_dir": lambda path: impl.set_disk_backup_dir(_text(path)),
        }
        for name, call in calls.items():
            setattr(self, name, _function(name, call))
        for name in ("tms_set_current_tag", "tms_set_enable_cpu_backup",
                     "tms_set_cpu_backup_backend", "tms_set_enable_disk_backup"):
            setattr(self, name, _function(name, _use_region(name)))

    def __getattr__(self, name: str):
        if name.startswith("cuda"):
            runtime = _cuda_runtime()
            if runtime is not None:
                return getattr(runtime, name)  # AttributeError of ctypes' own if none
        hint = ("use get_cpu_backup()" if name == "tms_get_cpu_backup_pointer" else
                "run under sublet's preload library (configure_subprocess()), which has it")
        raise AttributeError(f"sublet's torch_memory_saver has no C library, and its Python "
                             f"stand-in has no {name}: {hint}")


def _use_region(name: str) -> Callable[..., Any]:
    def refuse(*args):
        raise NotImplementedError(f"{name}: sublet's torch_memory_saver sets a region's config "
                                  f"with region(tag, enable_cpu_backup=..., "
                                  f"cpu_backup_backend=...), not through its library")
    return refuse


def _function(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function (argtypes / restype may be set on it, as on a ctypes one)."""
    def function(*args):
        return call(*args)
    function.__name__ = name
    return function


def _cuda_runtime() -> Optional[ctypes.CDLL]:
    """The CUDA runtime this process loaded (PyTorch's libcudart), or None: none loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None
