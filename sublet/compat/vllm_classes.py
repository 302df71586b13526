"""The vLLM subclasses of sublet's sleep mode: SubletBackend (a SleepModeBackend) and
SubletWorker (a GPU Worker). Importing this module imports vLLM; sublet.compat.vllm imports it
on first access to either name, so that the rest of that module works without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend
from vllm.v1.worker.gpu_worker import Worker

from .vllm import BACKEND_NAME, SubletAllocator, kv_blocks_keep, register

logger = logging.getLogger(__name__)

# Modules of vLLM 0.33.0 that look the sleep allocator up by this name at call time; the
# worker points them at sublet's allocator, so that what vLLM allocates past the worker's own
# contexts (LoRA's state: lora_model_runner_mixin.py:60) is sublet memory too.
_ALLOCATOR_LOOKUPS = ("vllm.device_allocator", "vllm.v1.worker.lora_model_runner_mixin",
                      "vllm.v1.worker.gpu_worker", "vllm.compilation.cudagraph_pool")


class SubletBackend(SleepModeBackend):
    """The "sublet" sleep-mode backend: CuMemBackend (sleep_mode_backend.py:116-157) on
    SubletAllocator. suspend(level) offloads "runtime" and "cudagraph", and "weights" at level
    1, to the host and drops the rest, as vLLM's; a keep set by keep_on_next_suspend() (or
    suspend(level, keep=...)) keeps those bytes of their tags on the GPU where they fit."""

    def __init__(self) -> None:
        super().__init__()
        self._next_keep: dict[str, Any] = {}

    @property
    def allocator(self) -> SubletAllocator:
        return SubletAllocator.get_instance()

    def keep_on_next_suspend(self, keep: Mapping[str, Any]) -> None:
        """What the next suspend keeps of each tag named (tag -> keep, as sublet.release)."""
        self._next_keep = dict(keep)

    def suspend(self, level: int = 1, keep: Mapping[str, Any] | None = None) -> None:
        offload_tags: tuple[str, ...] = ("runtime", "cudagraph")
        if level == 1:
            offload_tags = ("weights", *offload_tags)
        keep = dict(self._next_keep if keep is None else keep)
        self._next_keep = {}
        self._state = "SUSPENDED"
        self.allocator.sleep(offload_tags=offload_tags, keep=keep)

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        self.allocator.wake_up(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        self.allocator.discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        # As cumem: NCCL's buffers are not in the pools, so communicators survive.
        return True


class SubletWorker(Worker):
    """vLLM's GPU Worker with its allocations in sublet pools (--worker-cls
    sublet.compat.vllm.SubletWorker), as Dynamo's GMSV1Worker routes them to its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        register()   # in case this process loaded no plugins (VLLM_PLUGINS excludes ours)
        use_sublet_backend(self.vllm_config.model_config)
        route_allocator_lookups()

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
        """Keeps these KV cache blocks (the prefix cache's live ones) through the next sleep,
        on the GPU where they fit: call it on every worker before sleeping, with
        llm.collective_rpc("sublet_keep_kv_blocks", args=(ids,)). A sleep of level >= 1
        still clears vLLM's prefix cache (core.py:1009): the kept blocks serve a caller that
        reads them itself, or a scheduler told to keep its cache."""
        caches = [t for t in self.model_runner.kv_caches if t is not None]
        num_blocks = self.model_runner.kv_cache_config.num_blocks
        self.sleep_mode_backend.keep_on_next_suspend(
            {"kv_cache": kv_blocks_keep(caches, block_ids, num_blocks)})


def use_sublet_backend(model_config: Any) -> None:
    """Selects the "sublet" sleep-mode backend where the default one is selected: with
    sublet's worker, cumem's would sleep nothing (no memory is in its pools)."""
    if model_config.sleep_mode_backend == "cumem":
        logger.info("sublet: SubletWorker selects the %r sleep-mode backend", BACKEND_NAME)
        model_config.sleep_mode_backend = BACKEND_NAME
    elif model_config.sleep_mode_backend != BACKEND_NAME:
        logger.warning("sublet: sleep-mode backend %r with SubletWorker: its sleep does not "
                       "free sublet's pools; use --sleep-mode-backend %s",
                       model_config.sleep_mode_backend, BACKEND_NAME)


def route_allocator_lookups() -> None:
    """Points vLLM's get_mem_allocator_instance() lookups at sublet's allocator in this
    process (the worker's): what any vLLM code puts in a pool is then sublet memory. The
    modules that imported the name already are patched; those imported later take it from
    vllm.device_allocator, patched first."""
    import sys

    for name in _ALLOCATOR_LOOKUPS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_mem_allocator_instance"):
            module.get_mem_allocator_instance = SubletAllocator.get_instance
