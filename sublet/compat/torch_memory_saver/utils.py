"""torch_memory_saver.utils on sublet: the original's helpers, same names and behaviour
(is_xpu, _detect_cuda_major, get_binary_path_from_package, change_env).

get_binary_path_from_package looks where the original does, beside this package: its own
directory, then the one above (sublet/compat/, where a sublet build would put the preload
library). sublet ships none of the original's hook libraries yet (issue 40 item 2), so for
their names it raises LibraryMissingError, saying why none is needed: sublet routes a region's
allocations itself.
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


class LibraryMissingError(RuntimeError):
    """No hook library of that name beside the package (sublet has none yet)."""


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
    above."""
    package_dir = Path(__file__).parent
    pattern = f"{stem}.*.so" if _is_rocm_torch() else f"{stem}_cu{_detect_cuda_major()}.*.so"
    found = list(package_dir.glob(pattern)) or list(package_dir.parent.glob(pattern))
    if len(found) == 1:
        return found[0]
    if not found:
        raise LibraryMissingError(
            f"no {pattern} beside {package_dir}: sublet's torch_memory_saver has no hook "
            f"library yet, and needs none to route a region's allocations (sublet pools do); "
            f"LD_PRELOAD capture from process start is not there yet (issue 40 item 2)")
    raise RuntimeError(f"torch_memory_saver: {len(found)} libraries match {pattern!r} "
                       f"({[str(p) for p in found]}): remove all but one")


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
