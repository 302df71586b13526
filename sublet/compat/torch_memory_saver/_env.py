"""The small shared facts of sublet's torch_memory_saver: its environment variables (spelled as
the original accepts them), its one-time warnings, and the sublet pool name of each (tag, cpu
backup, graph) triple.
"""

from __future__ import annotations

import os
import warnings

TAG_DEFAULT = "default"
BACKENDS = ("mmap", "pinned")   # cpu_backup_backend's values; the original's default: pinned
DEFAULT_BACKEND = "pinned"

# Where a paused CPU-backup tag's bytes are kept (SUBLET_TMS_BACKUP):
#   process: host buffers of this process, as the original: get_cpu_backup() reads them
#            while the tag is paused (the default);
#   daemon:  subletd's host memory, pinned ahead at each backup region's end: a faster pause
#            (no host memory made on its path), but get_cpu_backup() is None while paused.
NO_DISK_BACKUP = ("sublet's torch_memory_saver has no disk backup: use "
                  "region(enable_cpu_backup=True) (TMS_INIT_ENABLE_CPU_BACKUP=1), whose bytes "
                  "are kept on the host while paused")
BACKUP_ENV = "SUBLET_TMS_BACKUP"
BACKUP_PLACES = ("process", "daemon")

_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")


def env_bool(name: str, default: bool = False) -> bool:
    """A boolean environment variable, spelled as torch_memory_saver accepts them."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"${name}={value!r} is not a boolean: set it to one of "
                     f"{', '.join(_TRUE + _FALSE)}")


def env_backend() -> str:
    """$TMS_INIT_CPU_BACKUP_BACKEND: the cpu_backup_backend of regions that name none."""
    value = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND", "") or DEFAULT_BACKEND
    if value not in BACKENDS:
        raise ValueError(f"$TMS_INIT_CPU_BACKUP_BACKEND={value!r}: set it to 'mmap' or "
                         f"'pinned'")
    return value


def backup_place() -> str:
    """$SUBLET_TMS_BACKUP: where paused CPU-backup bytes are kept (BACKUP_PLACES)."""
    value = os.environ.get(BACKUP_ENV, "") or "process"
    if value not in BACKUP_PLACES:
        raise ValueError(f"${BACKUP_ENV}={value!r}: set it to 'process' (this process keeps "
                         f"the host copy, as torch_memory_saver) or 'daemon' (subletd keeps "
                         f"it: faster pauses, no get_cpu_backup while paused)")
    return value


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


GRAPH_SUFFIX = "+graph"    # the pool of a tag's cuda_graph() captures
BACKUP_SUFFIX = "+backup"  # ... of its enable_cpu_backup=True allocations


def pool_name(tag: str, enable_cpu_backup: bool, graph: bool) -> str:
    """The sublet pool of a (tag, backup, graph) triple: the tag itself for plain regions (so
    sublet.lend("kv_cache") takes them), with "+graph" and "+backup" after it. A "+" of the
    tag itself is doubled, so that no two triples share a name: region("x+backup") is pool
    "x++backup", region("x", enable_cpu_backup=True) pool "x+backup"."""
    return (tag.replace("+", "++") + (GRAPH_SUFFIX if graph else "")
            + (BACKUP_SUFFIX if enable_cpu_backup else ""))
