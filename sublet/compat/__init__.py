"""Drop-ins for other libraries' APIs, built on sublet: code written for them runs unchanged.

    from sublet.compat import torch_memory_saver   # what `import torch_memory_saver` gives
    torch_memory_saver.torch_memory_saver.pause("kv_cache")

`python -m sublet.compat install torch_memory_saver` makes `import torch_memory_saver` itself
give sublet's package, under a distribution pip sees (see __main__.py). Each drop-in is a
submodule or subpackage, imported on first use so that `import sublet.compat` costs nothing
(torch is imported by the drop-in, not here).
"""

from __future__ import annotations

import importlib

# The drop-ins: the name code imports them by -> sublet's module that stands in for it.
# __main__.py installs any of these under its own name.
DROP_INS: dict[str, str] = {
    "torch_memory_saver": "sublet.compat.torch_memory_saver",
}


def __getattr__(name: str):
    if name in DROP_INS:
        return importlib.import_module(DROP_INS[name])
    raise AttributeError(f"module 'sublet.compat' has no attribute {name!r}")
