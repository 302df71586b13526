"""sublet's drop-in for torch_memory_saver 0.0.10: the same names, layout and behaviour, on
sublet pools and releases (docs/compat-torch-memory-saver.md).

    from sublet.compat.torch_memory_saver import torch_memory_saver   # the singleton
    with torch_memory_saver.region("kv_cache"):       # allocations: sublet pool "kv_cache"
        kv = torch.empty(...)
    torch_memory_saver.pause("kv_cache")              # the memory is the driver's now
    torch_memory_saver.resume("kv_cache")             # same addresses; CUDA graphs still valid

The modules are the original's: entrypoint (the facade), utils, testing_utils, hooks (base,
mode_preload, mode_torch) and binary_wrapper, the last two Python-level stand-ins (each says
what it does not do); the implementation is in _impl.py, _host.py and _env.py.
`python -m sublet.compat install torch_memory_saver` makes `import torch_memory_saver` give
this package (alias_as below), under a distribution pip sees (sublet/compat/__main__.py).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

from .entrypoint import TorchMemorySaver
from .hooks.mode_preload import configure_subprocess

# Global singleton
torch_memory_saver = TorchMemorySaver()

__all__ = ["TorchMemorySaver", "configure_subprocess", "torch_memory_saver"]


def alias_as(name: str) -> None:
    """Makes `import name` and `import name.<submodule>` give this package and its modules
    (the same objects: one singleton, and a patch of one is a patch of the other), as the
    installed torch_memory_saver/__init__.py asks."""
    package = sys.modules[__name__]
    sys.modules[name] = package
    for info in pkgutil.walk_packages(package.__path__, prefix=__name__ + "."):
        module = importlib.import_module(info.name)
        sys.modules[name + info.name[len(__name__):]] = module
