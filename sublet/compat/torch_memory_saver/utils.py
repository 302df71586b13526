"""torch_memory_saver.utils on sublet: the original's helpers, same names and behaviour
(is_xpu, _detect_cuda_major, get_binary_path_from_package, change_env).

get_binary_path_from_package looks where the original does, beside this package: its own
directory, then the one above (sublet/compat/, where sublet's wheel installs its preload
library, preload/tms.h). sublet has no torch-mode library (its torch mode is sublet pools): for
that name it raises LibraryMissingError.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

_SUPPORTED_CUDA_MAJORS = (13, 12)
PRELOAD_STEM = "torch_memory_saver_hook_mode_preload"


class LibraryMissingError(RuntimeError):
    """No hook library of that name beside the package."""


def is_xpu() -> bool:
    """False: sublet runs on CUDA devices (and its memfd backend), never on Intel XPU."""
    return False


def _is_rocm_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(getattr(torch.version, "hip", None))


def _detect_cuda_major() -> int:
    """The CUDA major version the process uses: torch's, else the first libcudart.so.N of
    13, 12 that loads; RuntimeError if neither says."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if cuda:
        try:
            return int(str(cuda).split(".", 1)[0])
        except ValueError:
            logger.warning("torch.version.cuda=%r is not a version: probing libcudart", cuda)
    for major in _SUPPORTED_CUDA_MAJORS:
        try:
            ctypes.CDLL(f"libcudart.so.{major}")
            return major
        except OSError as exc:
            logger.debug("libcudart.so.%s does not load: %s", major, exc)
    raise RuntimeError("torch_memory_saver: cannot tell the CUDA runtime's version: neither "
                       "torch.version.cuda nor libcudart.so.{13,12} says; install a CUDA "
                       "build of torch")


def get_binary_path_from_package(stem: str) -> Path:
    """The one library `stem` of the process's GPU runtime beside the package, as the
    original: `stem_cuN.*.so` (CUDA N) or `stem.*.so` (ROCm), in this directory or the one
    above. sublet's preload library, which serves every CUDA version, is `stem.*.so` there
    (sublet/compat/ of an installed sublet), or the build's (sublet._lib.find_native)."""
    package_dir = Path(__file__).parent
    dirs = (package_dir, package_dir.parent)
    pattern = f"{stem}.*.so" if _is_rocm_torch() else f"{stem}_cu{_detect_cuda_major()}.*.so"
    found = [p for d in dirs for p in sorted(d.glob(pattern))]
    if not found and stem == PRELOAD_STEM:
        found = [p for d in dirs for p in sorted(d.glob(f"{stem}.*.so"))] or _built_preload()
    if len(found) == 1:
        return found[0]
    if not found:
        raise LibraryMissingError(
            f"no {pattern} beside {package_dir}: sublet has no library {stem} (its torch mode "
            f"is sublet pools, routed without one)" if stem != PRELOAD_STEM else
            f"no {stem}.abi3.so beside {package_dir}: install sublet with pip, build it "
            f"(cmake --build build), or set $SUBLET_TMS_PRELOAD to its path")
    raise RuntimeError(f"torch_memory_saver: {len(found)} libraries match {pattern!r} "
                       f"({[str(p) for p in found]}): remove all but one")


def _built_preload() -> list[Path]:
    """sublet's preload library of a source tree's build (or $SUBLET_TMS_PRELOAD)."""
    from sublet import _lib
    try:
        return [_lib.find_native(f"{PRELOAD_STEM}.abi3.so", "SUBLET_TMS_PRELOAD")]
    except FileNotFoundError:
        return []


@contextmanager
def change_env(key: str, value: str) -> Iterator[None]:
    """Sets os.environ[key] for the block, then puts back what was there (or removes it); as
    the original, the block must leave the value it was given."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        assert os.environ[key] == value, f"${key} changed inside change_env({key!r})"
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
