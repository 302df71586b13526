"""sublet's vLLM allocator (sublet.compat.vllm.SubletAllocator) on a GPU: real tensors made by
torch ops inside use_memory_pool(tag), in the order and contexts vLLM 0.33.0's Worker uses
(test_compat_vllm_memfd.py cites the lines), through vLLM's sleep and wake sequence, then
through each tested vLLM's own order (vllm_orders.py; vLLM is not installed on the GPU
machine). Checks
that sleep gives the device memory back (torch.cuda.mem_get_info), that another allocation can
take it meanwhile, and that every kept bit comes back. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_compat_vllm.py -m gpu -s
"""

from __future__ import annotations

import gc
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from sublet import _pool as sublet_pool
from sublet.compat import vllm as sv

from test_gpu import cuda_daemon, random_fill  # noqa: F401 (fixture)
from gpu_memory import free_now
from vllm_orders import ORDERS

MiB = 1024 ** 2
pytestmark = [pytest.mark.gpu, pytest.mark.daemon, pytest.mark.usefixtures("cuda_daemon")]
LEVEL_OFFLOAD = {1: ("weights", "runtime", "cudagraph"), 2: ("runtime", "cudagraph")}
LAYERS, BLOCKS, PAGE_ELEMS = 8, 1024, 16 * 8 * 128   # a layer's block: 32 KiB of bf16


def cpu_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, on the host (so that they take no device memory)."""
    return t.detach().contiguous().view(torch.uint8).cpu()


def same_bits(t: torch.Tensor, before: torch.Tensor) -> bool:
    return torch.equal(cpu_bits(t), before)


class Engine:
    """A vLLM worker's allocations, by torch ops inside the allocator's contexts."""

    def __init__(self, alloc: sv.SubletAllocator):
        with alloc.use_memory_pool(tag="weights"):                     # gpu_worker.py:596
            self.model = torch.nn.Sequential(*[
                torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16, device="cuda")
                for _ in range(16)])                                     # 16 x 8 MiB
            for i, p in enumerate(self.model.parameters()):
                random_fill(p.data, i)
                p.data.view(torch.int16).bitwise_and_(0x3CFF)            # finite, small values
        with alloc.use_memory_pool(tag="workspace"):                   # gpu_worker.py:563
            self.workspace = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        kv_ctx = alloc.use_memory_pool(tag="kv_cache")
        with alloc.use_memory_pool(tag="runtime"):                     # gpu_worker.py:904-906
            self.runtime = random_fill(torch.empty(32 * MiB, dtype=torch.uint8, device="cuda"), 7)
            with kv_ctx:
                self.kv_buffer = torch.zeros(LAYERS * BLOCKS * PAGE_ELEMS, dtype=torch.bfloat16,
                                             device="cuda")              # 256 MiB
            random_fill(self.kv_buffer, 9)
        self.kv_caches = [self.kv_buffer.as_strided(
            (BLOCKS, 16, 8, 128), (LAYERS * PAGE_ELEMS, 8 * 128, 128, 1), layer * PAGE_ELEMS)
            for layer in range(LAYERS)]
        self.x = torch.ones(4, 2048, dtype=torch.bfloat16, device="cuda")  # not in a pool

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return cpu_bits(self.model(self.x))

    def weight_bits(self) -> list[torch.Tensor]:
        return [cpu_bits(p) for p in self.model.parameters()]

    def weights_same(self, before: list[torch.Tensor]) -> bool:
        return all(same_bits(p, b) for p, b in zip(self.model.parameters(), before))


@pytest.fixture
def alloc():
    a = sv.SubletAllocator()
    yield a
    a.wake_up(None)
    gc.collect()
    for pool in list(sublet_pool._pools.values()):   # the device back for the other tests
        pool.empty_cache()
    torch.cuda.empty_cache()


@pytest.fixture
def engine(alloc):
    e = Engine(alloc)
    yield e
    del e.model, e.workspace, e.runtime, e.kv_buffer, e.kv_caches
    gc.collect()


def test_level1_frees_the_device_and_wakes_bit_identical(alloc, engine):
    out, weights, runtime = engine.forward(), engine.weight_bits(), cpu_bits(engine.runtime)
    used = alloc.get_current_usage()
    free0 = free_now()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    freed = free_now() - free0
    print(f"\nsleep freed {freed / MiB:.0f} MiB of {used / MiB:.0f} MiB in the pools")
    assert freed >= 0.95 * used
    # Anyone may allocate it now: a plain PyTorch tensor of most of what was freed.
    other = torch.empty(int(0.9 * freed), dtype=torch.uint8, device="cuda").fill_(1)
    del other
    torch.cuda.empty_cache()

    alloc.wake_up(["weights"])
    assert engine.weights_same(weights) and same_bits(engine.runtime, runtime)
    assert torch.equal(engine.forward(), out)
    assert alloc.is_asleep("kv_cache")
    alloc.wake_up(["kv_cache"])
    engine.kv_buffer.fill_(0)                                  # mapped again, writable
    assert int(engine.kv_buffer.view(torch.int16).abs().sum()) == 0
    assert free_now() < free0 + 0.05 * used                    # the memory is the pools' again


def test_level2_drops_weights_keeps_runtime(alloc, engine):
    runtime = cpu_bits(engine.runtime)
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[2])
    assert alloc.stats["weights"].copied_bytes == 0
    alloc.wake_up(["weights"])
    assert same_bits(engine.runtime, runtime)
    for p in engine.model.parameters():                       # RL: new weights are written
        p.data.fill_(0)
    assert int(engine.forward().view(torch.int16).abs().sum()) == 0
    alloc.wake_up(["kv_cache"])


def test_kept_kv_blocks_stay_on_the_device(alloc, engine):
    live = np.random.default_rng(3).choice(BLOCKS, size=100, replace=False)
    kept = [cpu_bits(view[b]) for view in engine.kv_caches for b in live]
    weights = engine.weight_bits()
    keep = sv.kv_blocks_keep(engine.kv_caches, live, num_blocks=BLOCKS)
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1], keep={"kv_cache": keep})
    stats = alloc.stats["kv_cache"]
    print(f"\nkv_cache: kept {stats.kept_bytes / MiB:.1f} MiB, moved {stats.moved_bytes / MiB:.1f}"
          f" MiB on the device, {stats.copied_bytes} bytes to the host")
    assert stats.copied_bytes == 0
    alloc.wake_up(["weights"])
    alloc.wake_up(["kv_cache"])
    now = [cpu_bits(view[b]) for view in engine.kv_caches for b in live]
    assert all(torch.equal(a, b) for a, b in zip(now, kept))
    assert engine.weights_same(weights)


def test_a_graph_in_the_cudagraph_pool_sleeps_and_replays(alloc):
    """cudagraph_pool(): the graph's memory is tag "cudagraph", offloaded by every sleep
    level; after the wake the graph replays at the same addresses."""
    static_in = torch.zeros(8 * MiB, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static_in * 2 + 1                                      # warm up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with alloc.cudagraph_pool() as pool_id:
        with torch.cuda.graph(graph, pool=pool_id):
            static_out = static_in * 2 + 1
    assert alloc.tag_usage("cudagraph") >= static_out.numel() * 4
    static_in.copy_(torch.arange(static_in.numel(), device="cuda", dtype=torch.float32))
    graph.replay()
    out = cpu_bits(static_out)
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[2])
    alloc.wake_up(None)
    assert same_bits(static_out, out)                          # offloaded and back
    static_in.mul_(3)
    graph.replay()
    assert torch.equal(cpu_bits(static_out), cpu_bits(static_in * 2 + 1))
    del graph, static_out


# --------------------------------------------------------------------------- each vLLM's order

def _one_version_per_order() -> list[str]:
    first: dict[int, str] = {}
    for version, order in ORDERS.items():
        first.setdefault(id(order), version)
    return sorted(first.values())


class Model(torch.nn.Module):
    """Large parameters (each its own segment) beside small ones and buffers that share
    PyTorch's small segments: a level-2 sleep of vLLM 0.34 drops the first and keeps the
    second, block by block within one segment."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(2048, 2048, bias=False, dtype=torch.bfloat16, device="cuda")
            for _ in range(8))                                           # 8 x 8 MiB
        self.norms = torch.nn.ModuleList(
            torch.nn.LayerNorm(2048, dtype=torch.bfloat16, device="cuda") for _ in range(8))
        self.register_buffer("cos_sin", torch.empty(4096, 128, device="cuda"))   # 2 MiB
        self.register_buffer("scale", torch.empty(300, device="cuda"))
        for i, t in enumerate([*self.parameters(), *self.buffers()]):
            random_fill(t.data, 100 + i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm in zip(self.layers, self.norms):
            x = norm(layer(x))
        return x


@pytest.mark.parametrize("version", _one_version_per_order())
def test_each_vllms_sleep_order_keeps_what_it_promises(alloc, version):
    """The allocator calls of each tested vLLM's Worker (vllm_orders.py, checked against the
    real Workers on the CPU by test_compat_vllm_versions.py), on torch-made tensors: three
    cycles of TRL's and verl's order (sleep(2), wake_up(["weights"]), load, wake_up(["kv_cache"])),
    then OpenRLHF's (sleep(1), wake weights then kv, again, and a wake of awake weights)."""
    order = ORDERS[version]
    alloc.deferrable_tags = order.deferrable
    with alloc.use_memory_pool(tag="weights"):
        model = Model()
    has_runtime = "runtime" in order.offload[1]                 # the tag exists (0.32 on)
    with alloc.use_memory_pool(tag="runtime") if has_runtime else nullcontext():
        runtime = random_fill(torch.empty(16 * MiB, dtype=torch.uint8, device="cuda"), 7) \
            if has_runtime else torch.zeros(1, device="cuda")
        with alloc.use_memory_pool(tag="kv_cache"):
            kv = torch.zeros(64 * MiB, dtype=torch.uint8, device="cuda")
    preserve = {"norms.0.weight"} if order.preserves else set()
    kept_names = {n for n, _ in model.named_buffers()} | preserve
    x = torch.ones(4, 2048, dtype=torch.bfloat16, device="cuda")
    for cycle in range(3):
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        before = {n: cpu_bits(t) for n, t in tensors.items()}
        runtime_bits = cpu_bits(runtime)
        saved = {n: tensors[n].detach().cpu().clone() for n in kept_names} \
            if order.worker_saves_buffers else {}
        drop = {p.untyped_storage().data_ptr() for n, p in model.named_parameters()
                if n not in preserve} if order.discardable else set()
        gc.collect()
        torch.cuda.empty_cache()                                # PyTorch's cache: not ours
        free0 = free_now()
        alloc.sleep(order.offload[2], drop)
        freed = free_now() - free0
        weights = alloc.stats["weights"]
        kept = sum(tensors[n].nbytes for n in kept_names)
        print(f"\nvLLM {version} cycle {cycle}: sleep(2) freed {freed / MiB:.1f} MiB; weights "
              f"to the host {weights.copied_bytes / MiB:.2f} MiB (buffers and preserved: "
              f"{kept / MiB:.2f} MiB)")
        assert freed >= sum(p.nbytes for p in model.layers.parameters()) + kv.nbytes
        alloc.wake_up(["weights"])
        assert alloc.is_asleep("kv_cache") and not alloc.is_asleep("weights")
        for n, t in saved.items():                              # the Worker's own restore
            tensors[n].data.copy_(t)
        assert [n for n in kept_names if not same_bits(tensors[n], before[n])] == []
        assert same_bits(runtime, runtime_bits)
        if order.discardable:
            assert weights.copied_bytes <= kept + 2 * MiB       # block by block, not segments
        for i, (n, p) in enumerate(model.named_parameters()):   # the weight update
            if n not in preserve:
                random_fill(p.data, 1000 * cycle + i)
        alloc.wake_up(["kv_cache"])
        kv.fill_(cycle)
        model(x)                                                # every page mapped again
        torch.cuda.synchronize()
    everything = {n: cpu_bits(t) for n, t in
                  {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()}
    for _ in range(2):                                          # OpenRLHF: level 1
        alloc.sleep(order.offload[1], set())
        alloc.wake_up(["weights"])
        alloc.wake_up(["kv_cache"])
    alloc.wake_up(["weights"])                                  # awake already: nothing to do
    now = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert [n for n, t in now.items() if not same_bits(t, everything[n])] == []
    del model, runtime, kv, x, now, tensors
    gc.collect()
