"""sublet's vLLM allocator (sublet.compat.vllm.SubletAllocator) on a GPU: real tensors made by
torch ops inside use_memory_pool(tag), in the order and contexts vLLM 0.33.0's Worker uses
(test_compat_vllm_memfd.py cites the lines), through vLLM's sleep and wake sequence. Checks
that sleep gives the device memory back (torch.cuda.mem_get_info), that another allocation can
take it meanwhile, and that every kept bit comes back. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_compat_vllm.py -m gpu -s
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from sublet import _pool as sublet_pool
from sublet.compat import vllm as sv

from test_gpu import cuda_daemon, random_fill  # noqa: F401 (fixture)
from gpu_memory import free_now

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
