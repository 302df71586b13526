"""torch_memory_saver.hooks.mode_torch on sublet: HookUtilModeTorch, a Python-level stand-in.

What it does not do: the original loads its torch-mode library and serves a region's MemPool
from its pluggable allocator; sublet's regions are sublet pools, whose MemPools take libsublet's
allocator themselves, so get_allocator() is None (a MemPool made with it is PyTorch's own,
not pauseable) and get_path_binary() names libsublet, the library that allocates.
"""

from __future__ import annotations

from .base import HookUtilBase


class HookUtilModeTorch(HookUtilBase):
    def get_path_binary(self) -> str:
        from sublet import _lib
        return _lib.library_path()

    def get_allocator(self):
        return None
