"""torch_memory_saver.hooks.mode_preload on sublet: HookUtilModePreload and
configure_subprocess(), a Python-level stand-in for the original's preload mode.

What it does: configure_subprocess() prepends sublet's preload library (preload/tms.h) to
LD_PRELOAD for the block, as the original; a child started in it has its cudaMalloc taken
from its start (TMS_INIT_ENABLE=1 captures everything), and its regions are the library's.
HookUtilModePreload reads LD_PRELOAD as the original does. Where no library is found (a sublet
built without it), configure_subprocess() leaves LD_PRELOAD as it is, and the children's
regions are sublet pools (_impl.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from ..utils import PRELOAD_STEM, LibraryMissingError, change_env, get_binary_path_from_package
from .base import HookUtilBase

logger = logging.getLogger(__name__)


class HookUtilModePreload(HookUtilBase):
    def get_path_binary(self) -> str:
        """The one LD_PRELOAD entry naming torch_memory_saver, as the original asks for."""
        preload = os.environ.get("LD_PRELOAD", "")
        found = [p for p in preload.split(":") if "torch_memory_saver" in p]
        if len(found) != 1:
            raise RuntimeError(f"TorchMemorySaver observes invalid LD_PRELOAD "
                               f"({preload!r}, process {os.getpid()}): one torch_memory_saver "
                               f"library is needed there (configure_subprocess() puts sublet's)")
        return found[0]


@contextmanager
def configure_subprocess() -> Iterator[None]:
    """For processes started in the block: the preload library first in LD_PRELOAD, where
    one is found; with none, LD_PRELOAD is left as it is."""
    try:
        library = str(get_binary_path_from_package(PRELOAD_STEM))
    except LibraryMissingError as exc:
        logger.debug("configure_subprocess: LD_PRELOAD unchanged (%s)", exc)
        library = ""
    if not library:
        yield
        return
    current = os.environ.get("LD_PRELOAD", "")
    with change_env("LD_PRELOAD", f"{library}:{current}" if current else library):
        yield
