"""The switch that puts sublet's allocator under vLLM's sleep mode, with no flag and no code of
the framework changed: vLLM's own sleep and wake (its Worker, its "cumem" backend) then drive
sublet's pools instead of its CuMemAllocator.

Every vLLM from 0.24 on reaches its sleep allocator through one function,
vllm.device_allocator.get_mem_allocator_instance() (Worker.sleep/wake_up/
_maybe_get_memory_pool_context, CuMemBackend, the graph pool, LoRA), which returns
CuMemAllocator.get_instance(). route_allocator() points both at SubletAllocator.get_instance(),
in the process that calls it, before the worker allocates: vLLM runs its general plug-ins
(sublet's register()) in every process it starts, before it builds the worker
(v1/worker/worker_base.py, init_worker).

On, in this order: SUBLET_VLLM=1 in the environment; else SUBLET_VLLM=0 turns it off; else on
where `python -m sublet.compat install vllm` has installed the switch, a distribution of no code
named sublet-vllm-switch that pip lists and `pip uninstall sublet-vllm-switch` removes. On, an
untested vLLM is refused (vllm_versions.check).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from . import vllm_versions

logger = logging.getLogger(__name__)

ENV = "SUBLET_VLLM"
DIST = "sublet-vllm-switch"
_DIST_DIR = "sublet_vllm_switch-1.dist-info"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def wanted() -> bool:
    """Whether sublet should take vLLM's sleep mode in this process (see the module's text)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: set it to 1 (sublet takes vLLM's sleep "
                         f"mode) or 0 (vLLM's own), or leave it unset (the installed switch "
                         f"decides)")
    return installed()


def installed() -> bool:
    """Whether the switch (the sublet-vllm-switch distribution) is installed."""
    try:
        importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# ------------------------------------------------------------------------- in a vLLM process

def plug_in() -> None:
    """What sublet's vllm.general_plugins entry point does in each vLLM process: registers
    the "sublet" backend (vLLM 0.25 on) and, if the switch is on, checks the vLLM and routes
    its allocator to sublet's."""
    register_backend()
    if not wanted():
        return
    version = vllm_versions.check()
    route_allocator()
    logger.info("sublet: vLLM %s's sleep mode runs on sublet (%s)", version, _why_on())


def register_backend() -> None:
    """Registers the "sublet" sleep-mode backend with vLLM, once, where vLLM has backends."""
    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    except ImportError:
        return   # before 0.25: no backends; the switch alone does it
    if "sublet" not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend("sublet", "sublet.compat.vllm",
                                                 "SubletBackend")


def route_allocator() -> None:
    """Points vLLM's sleep-allocator lookups at sublet's allocator in this process: the
    function every vLLM module calls (and the copies of it that modules imported already),
    and CuMemAllocator.get_instance where CuMemAllocator imports. Idempotent."""
    import vllm.device_allocator as lookup_home

    from .vllm import SubletAllocator
    ours = SubletAllocator.get_instance
    for name, module in list(sys.modules.items()):
        found = getattr(module, "get_mem_allocator_instance", None) \
            if name == "vllm" or name.startswith("vllm.") else None
        if found is not None and (module is lookup_home or _is_vllms_lookup(found)):
            module.get_mem_allocator_instance = ours
    cumem = cumem_class()
    if cumem is not None:
        cumem.get_instance = staticmethod(ours)
    SubletAllocator.get_instance().deferrable_tags = getattr(
        lookup_home, "DEFERRABLE_TAGS", None)


def _is_vllms_lookup(function: Any) -> bool:
    return getattr(function, "__module__", None) == "vllm.device_allocator" and \
        getattr(function, "__name__", None) == "get_mem_allocator_instance"


def routed() -> bool:
    """Whether vLLM's allocator lookup gives sublet's in this process."""
    import vllm.device_allocator as lookup_home

    from .vllm import SubletAllocator
    return lookup_home.get_mem_allocator_instance == SubletAllocator.get_instance


def cumem_class() -> Any:
    """vLLM's CuMemAllocator, or None where its module cannot load (no CUDA runtime: a CPU
    process; nothing there calls it)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except (ImportError, OSError) as exc:
        logger.debug("sublet: vLLM's cumem module does not load here (%s)", exc)
        return None
    return CuMemAllocator


def _why_on() -> str:
    return f"{ENV}={os.environ[ENV]}" if os.environ.get(ENV) else f"{DIST} is installed"


# ------------------------------------------------------------------------- the install step

def install(target: Path) -> str:
    """Installs the switch into site-packages `target` (refused where the vLLM there is not
    one sublet was tested with; none at all is fine: it is checked again at start)."""
    version = vllm_versions.installed()
    if version is not None:
        vllm_versions.check(version, what="python -m sublet.compat install vllm")
    record = target / _DIST_DIR
    record.mkdir(parents=True, exist_ok=True)
    files = {
        "METADATA": (f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 1\nSummary: Puts sublet's "
                     f"allocator under vLLM's sleep mode (python -m sublet.compat install "
                     f"vllm)\nRequires-Dist: sublet\n"),
        "INSTALLER": "sublet\n",
    }
    for name, text in files.items():
        (record / name).write_text(text)
    rows = [f"{_DIST_DIR}/{name},," for name in (*files, "RECORD")]
    (record / "RECORD").write_text("\n".join(rows) + "\n")
    found = f" (vLLM {version})" if version else " (no vLLM here yet: checked at its start)"
    return (f"installed {record}{found}: vLLM's sleep mode runs on sublet in this "
            f"environment; undo with `python -m sublet.compat uninstall vllm` or `pip "
            f"uninstall {DIST}`; {ENV}=0 turns it off for one run")


def uninstall(target: Path) -> str:
    record = target / _DIST_DIR
    if not record.is_dir():
        raise SystemExit(f"the vLLM switch is not installed in {target}: nothing to uninstall")
    shutil.rmtree(record)
    return f"removed {record}: vLLM's sleep mode is vLLM's own again"
