"""The vLLM subclasses of sublet's sleep mode: SubletBackend (a SleepModeBackend) and
SubletWorker (a GPU Worker). Importing this module imports vLLM; sublet.compat.vllm imports it
on first access to either name, so that the rest of that module works without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.v1.worker.gpu_worker import Worker

from . import vllm_switch, vllm_versions
from .vllm import BACKEND_NAME, SubletAllocator, keep_kv_blocks, sleep_need

try:   # vLLM 0.25 on; before, the switch alone (no backends)
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend
except ImportError:
    CuMemBackend = None

logger = logging.getLogger(__name__)


class SubletBackend(CuMemBackend or object):   # type: ignore[misc]
    """The "sublet" sleep-mode backend (--sleep-mode-backend sublet, vLLM 0.33 on; 0.25 on
    through SubletWorker): vLLM's own CuMemBackend of the installed version, whose suspend
    (level, or 0.34's discardable) and resume reach sublet's allocator through the lookup the
    switch routes. Made in the worker, on its first sleep: an untested vLLM is refused, and
    so is one whose weights are in CuMemAllocator already (the lookup was routed too late)."""

    def __init__(self) -> None:
        vllm_versions.check(what="the sublet sleep-mode backend")
        if CuMemBackend is None:
            raise RuntimeError("this vLLM has no sleep-mode backends (they came in 0.25): "
                               "switch sublet on instead (python -m sublet.compat install "
                               "vllm, or SUBLET_VLLM=1)")
        if not vllm_switch.routed():
            _refuse_if_cumem_holds_memory()
            vllm_switch.route_allocator()
        super().__init__()

    @property
    def allocator(self) -> SubletAllocator:
        return SubletAllocator.get_instance()

    def keep_on_next_suspend(self, keep: Mapping[str, Any]) -> None:
        """What the next suspend keeps of each tag named (tag -> keep, as sublet.release), on
        the GPU where it fits."""
        self.allocator.keep_on_next_sleep(keep)

    def need_on_next_suspend(self, need: int | str | None) -> None:
        """The need of the next suspend (bytes a taker needs: only those beyond the free
        memory are released), as SubletAllocator.sleep(need=...) takes it."""
        self.allocator.need_on_next_sleep(need)

    @classmethod
    def preserves_communicators(cls) -> bool:
        # As cumem: NCCL's buffers are not in the pools, so communicators survive.
        return True


def _refuse_if_cumem_holds_memory() -> None:
    cumem = vllm_switch.cumem_class()
    held = cumem is not None and cumem.instance is not None and \
        cumem.instance.get_current_usage() > 0
    if held:
        raise RuntimeError(
            "sublet: the engine allocated in vLLM's CuMemAllocator before the sublet backend "
            "was made, so a sleep would free none of it: switch sublet on before vLLM starts "
            "(python -m sublet.compat install vllm, or SUBLET_VLLM=1), or pass --worker-cls "
            "sublet.compat.vllm.SubletWorker with --sleep-mode-backend sublet")


class SubletWorker(Worker):
    """vLLM's GPU Worker with its allocations in sublet pools (--worker-cls
    sublet.compat.vllm.SubletWorker), as Dynamo's GMSV1Worker routes them to its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_versions.check(what="sublet.compat.vllm.SubletWorker")
        super().__init__(*args, **kwargs)
        vllm_switch.register_backend()   # in case this process loaded no plugins
        use_sublet_backend(self.vllm_config.model_config)
        vllm_switch.route_allocator()

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        """vLLM's (gpu_worker.py:396-417) with sublet's allocator: a pool when sleep mode (or
        the cumem allocator, which it turns on) is on, else nothing."""
        config = self.vllm_config.model_config
        if not (config.enable_sleep_mode or config.enable_cumem_allocator):
            return nullcontext()
        allocator = SubletAllocator.get_instance()
        if tag == "weights" and allocator.tag_usage("weights"):
            raise RuntimeError("sublet: the weights pool holds memory already: one vLLM "
                               "engine per process uses sublet's sleep mode")
        return allocator.use_memory_pool(tag=tag)

    def sublet_keep_kv_blocks(self, block_ids: Any) -> None:
        """sublet.compat.vllm.keep_kv_blocks on this worker: call it on every worker before
        sleeping, with llm.collective_rpc("sublet_keep_kv_blocks", args=(ids,))."""
        keep_kv_blocks(self, block_ids)

    def sublet_sleep_need(self, need: Any) -> None:
        """sublet.compat.vllm.sleep_need on this worker: the next sleep releases only what a
        taker needing `need` bytes lacks; llm.collective_rpc("sublet_sleep_need",
        args=(need,)) on every worker before sleeping."""
        sleep_need(self, need)


def use_sublet_backend(model_config: Any) -> None:
    """Selects the "sublet" sleep-mode backend where the default one is selected: with
    sublet's worker, cumem's would sleep nothing (no memory is in its pools)."""
    backend = getattr(model_config, "sleep_mode_backend", None)
    if backend is None:
        return   # before 0.25.1: no backends, the routed allocator is all there is
    if backend == "cumem":
        logger.info("sublet: SubletWorker selects the %r sleep-mode backend", BACKEND_NAME)
        model_config.sleep_mode_backend = BACKEND_NAME
    elif backend != BACKEND_NAME:
        logger.warning("sublet: sleep-mode backend %r with SubletWorker: its sleep does not "
                       "free sublet's pools; use --sleep-mode-backend %s", backend,
                       BACKEND_NAME)
