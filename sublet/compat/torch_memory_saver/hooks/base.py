"""torch_memory_saver.hooks.base on sublet: HookMode and HookUtilBase, as the original.

HOOK_MODES adds "gms", which NVIDIA Dynamo's GPU memory service sets before it plugs its own
implementation in (the facade stores it; sublet routes the same way in every mode).
"""

from __future__ import annotations

from abc import ABC
from typing import Literal

HookMode = Literal["preload", "torch"]
HOOK_MODES = ("preload", "torch", "gms")


class HookUtilBase(ABC):
    @staticmethod
    def create(hook_mode: HookMode) -> "HookUtilBase":
        from .mode_preload import HookUtilModePreload
        from .mode_torch import HookUtilModeTorch
        makers: dict[str, type[HookUtilBase]] = {"preload": HookUtilModePreload,
                                                 "torch": HookUtilModeTorch}
        if hook_mode not in makers:
            raise ValueError(f"hook_mode is one of {sorted(makers)}, not {hook_mode!r}")
        return makers[hook_mode]()

    def get_path_binary(self):
        raise NotImplementedError

    def get_allocator(self):
        return None
