"""A vLLM GPU Worker of the installed vLLM whose model and caches are sublet pool memory on the
memfd backend: the real class (its sleep, wake_up and discard, its backend lookup), with only
what its __init__ would build from a real engine stood in for (the model runner, the config).
Used by test_compat_vllm_versions.py, with one vLLM of vllm_versions.TESTED on the path.

The tensors are made in vLLM's tags and order (gpu_worker.py: load_model in "weights", the
KV cache inside "kv_cache" nested in "runtime"), with SubletAllocator.empty(): the memfd
backend routes no CPU allocation, so this is what a torch op there gets on CUDA.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from sublet.compat import vllm as sv
from sublet.compat import vllm_switch, vllm_versions

from pool_helpers import bits, random_bytes

KV_BLOCKS, KV_BLOCK_BYTES = 64, 4096


def keep_lookups(monkeypatch) -> None:
    """vLLM's allocator lookups as they are now, restored after the test (the switch, the
    backend and the worker patch them), and the switch's environment left to the test."""
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and hasattr(module, "get_mem_allocator_instance"):
            monkeypatch.setattr(module, "get_mem_allocator_instance",
                                module.get_mem_allocator_instance)
    cumem = vllm_switch.cumem_class()
    if cumem is not None:
        monkeypatch.setattr(cumem, "get_instance", cumem.__dict__["get_instance"])
    monkeypatch.delenv(vllm_switch.ENV, raising=False)
    monkeypatch.delenv(vllm_versions.ALLOW_ENV, raising=False)


class Model(nn.Module):
    """Four parameters and two buffers (a rotary table, a scale), all sublet memory."""

    PARAMS = ("embed.weight", "layers.0.weight", "layers.1.weight", "lm_head.weight")
    BUFFERS = ("rotary.cos_sin", "scale")

    def __init__(self, alloc: sv.SubletAllocator, seed: int):
        super().__init__()
        for i, name in enumerate(self.PARAMS):
            owner, leaf = self._owner(name)
            t = random_bytes(alloc.empty(128, 512, dtype=torch.bfloat16), seed + i)
            owner.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
        for i, name in enumerate(self.BUFFERS):
            owner, leaf = self._owner(name)
            owner.register_buffer(leaf, random_bytes(alloc.empty(256, 64), seed + 10 + i))

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        module: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        return module, leaf

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**dict(self.named_parameters()), **dict(self.named_buffers())}


class Engine:
    """One worker's memory and the Worker of the installed vLLM over it."""

    def __init__(self, alloc: sv.SubletAllocator, runtime: bool, preserve: tuple[str, ...] = (),
                 seed: int = 0):
        """runtime: the vLLM has a "runtime" tag (0.32 on), the KV cache made inside it."""
        from vllm.v1.worker.gpu_worker import Worker

        with alloc.use_memory_pool(tag="weights"):
            self.model = Model(alloc, seed)
        kv_ctx = alloc.use_memory_pool(tag="kv_cache")
        with alloc.use_memory_pool(tag="runtime") if runtime else nullcontext():
            self.others = {"runtime": random_bytes(
                alloc.empty(3 * 65536, dtype=torch.uint8), seed + 30)} if runtime else {}
            with kv_ctx:
                self.kv = random_bytes(alloc.empty(KV_BLOCKS, KV_BLOCK_BYTES,
                                                   dtype=torch.uint8), seed + 40)
        self.others["kv"] = self.kv
        # Its __init__ needs an engine: what it sets for sleep and wake (read from each
        # tested version's Worker.__init__) is stood in for.
        self.worker = Worker.__new__(Worker)
        config = SimpleNamespace(
            sleep_preserve_parameter_names=list(preserve), enable_nccl_comm_suspend=False,
            sleep_mode_backend="cumem", enable_sleep_mode=True, enable_cumem_allocator=True)
        runner = SimpleNamespace(
            model=self.model, get_draft_model=lambda: None, post_kv_cache_wake_up=lambda: None,
            kv_caches=[self.kv], kv_cache_config=SimpleNamespace(num_blocks=KV_BLOCKS))
        for name, value in (("vllm_config", SimpleNamespace(model_config=config)),
                            ("model_config", config), ("model_runner", runner),
                            ("_sleep_saved_buffers", {}), ("_sleep_saved_draft_buffers", {}),
                            ("_sleep_saved_parameters", {}), ("_sleep_mode_backend", None),
                            ("_sleep_rebuild_draft_metadata_buffers", False)):   # 0.26.0
            setattr(self.worker, name, value)

    def tensor(self, name: str) -> torch.Tensor:
        return self.others[name] if name in self.others else self.model.tensors()[name]

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every tensor's bits (every tag awake)."""
        return {name: bits(t) for name, t in {**self.model.tensors(), **self.others}.items()}

    def load_weights(self, seed: int) -> None:
        """The RL weight update: every parameter written anew (new bits)."""
        for i, p in enumerate(self.model.parameters()):
            random_bytes(p.data, seed + i)

    def free(self) -> None:
        del self.model, self.others, self.kv, self.worker
