"""sublet's vLLM allocator (sublet.compat.vllm.SubletAllocator) driven through the calls vLLM
0.33.0 makes, on the memfd backend (no GPU, no vLLM): every kept bit checked after every wake.

The sequence, read from the vllm-0.33.0 wheel (paths relative to site-packages/vllm/):
- Worker.load_model (v1/worker/gpu_worker.py:594-596): the weights are made inside
  _maybe_get_memory_pool_context(tag="weights"), i.e. use_memory_pool(tag="weights")
  (gpu_worker.py:412-417).
- init_workspace_manager(alloc_context=... "workspace") (gpu_worker.py:558-563).
- Worker.initialize_from_config (gpu_worker.py:898-910): kv_ctx = use_memory_pool("kv_cache"),
  then `with use_memory_pool("runtime"): initialize_kv_cache(..., kv_ctx)`, which allocates
  the KV buffer inside kv_ctx (v1/worker/gpu_model_runner.py:6933-6940): "kv_cache" nested in
  "runtime". The buffer is one allocation viewed per layer as [B, H, N, C], block b of layer l
  at l * layer_stride + b * block_stride (v1/worker/utils.py:570-596,
  v1/kv_cache_interface.py:418-474).
- LLM.sleep(level) (entrypoints/llm.py:839) -> EngineCore.sleep (v1/engine/core.py:993) ->
  Executor.sleep (v1/executor/abstract.py:400-407) -> Worker.sleep (gpu_worker.py:301-320)
  -> backend.suspend(level) -> allocator.sleep(offload_tags=("weights", "runtime",
  "cudagraph")) at level 1, ("runtime", "cudagraph") at level 2
  (device_allocator/sleep_mode_backend.py:127-137).
- LLM.wake_up(["weights"]) then LLM.wake_up(["kv_cache"]) (llm.py:872 -> core.py:1031-1045 ->
  abstract.py:412-435 -> gpu_worker.py:341-342 -> sleep_mode_backend.py:139-145):
  allocator.wake_up(["weights"]), which also wakes every non-deferrable tag
  (device_allocator/__init__.py:17, cumem.py:345-351), then allocator.wake_up(["kv_cache"]).
- LLM.release_kv_cache_memory (core.py:1076): allocator.discard(("kv_cache",))
  (gpu_worker.py:369-372, sleep_mode_backend.py:147-152, cumem.py:300-317).

CPU tensors are not routed: inside each use_memory_pool the test allocates with
SubletAllocator.empty() (the current tag's pool), what a torch op gets there on CUDA.
"""

from __future__ import annotations

import gc
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import sublet
from sublet.compat import vllm as sv

from conftest import PAGE, memfd_free_bytes as free_bytes
from pool_helpers import bits, random_bytes

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

# vLLM 0.33.0's offload tags per sleep level (sleep_mode_backend.py:134-136).
LEVEL_OFFLOAD = {1: ("weights", "runtime", "cudagraph"), 2: ("runtime", "cudagraph")}
LAYERS, BLOCKS, HEADS, TOKENS, DIM = 4, 256, 2, 16, 64   # a layer's block: 4 KiB of bf16


class Engine:
    """What a vLLM worker allocates, in vLLM's order and contexts, with random bytes."""

    def __init__(self, alloc: sv.SubletAllocator, seed: int = 0):
        self.alloc = alloc
        with alloc.use_memory_pool(tag="weights"):                     # gpu_worker.py:596
            self.weights = [random_bytes(alloc.empty(64, 1024, dtype=torch.bfloat16), seed + i)
                            for i in range(8)]                           # 8 x 128 KiB
        with alloc.use_memory_pool(tag="workspace"):                   # gpu_worker.py:563
            self.workspace = random_bytes(alloc.empty(4 * PAGE, dtype=torch.uint8), seed + 20)
        kv_ctx = alloc.use_memory_pool(tag="kv_cache")                 # gpu_worker.py:898
        with alloc.use_memory_pool(tag="runtime"):                     # gpu_worker.py:904-906
            self.runtime = random_bytes(alloc.empty(3 * PAGE, dtype=torch.uint8), seed + 30)
            with kv_ctx:                                               # gpu_model_runner.py:6934
                assert alloc.current_tag == "kv_cache"
                self.kv_buffer = random_bytes(
                    alloc.empty(LAYERS * BLOCKS * HEADS * TOKENS * DIM, dtype=torch.bfloat16),
                    seed + 40)
            assert alloc.current_tag == "runtime"                      # the outer is back
        assert alloc.current_tag == "default"
        self.kv_caches = kv_views(self.kv_buffer)

    def snapshot(self) -> dict[str, list[np.ndarray]]:
        return {"weights": [bits(w) for w in self.weights], "runtime": [bits(self.runtime)],
                "kv_cache": [bits(self.kv_buffer)]}

    def tensors(self, tag: str) -> list[torch.Tensor]:
        return self.weights if tag == "weights" else [getattr(self, {
            "runtime": "runtime", "kv_cache": "kv_buffer", "workspace": "workspace"}[tag])]

    def same_bits(self, tag: str, before: dict[str, list[np.ndarray]]) -> bool:
        return all(np.array_equal(bits(t), b) for t, b in zip(self.tensors(tag), before[tag]))

    def writable(self, tag: str, seed: int) -> bool:
        """Writes noise into the tag's tensors and reads it back: the memory is mapped."""
        for t in self.tensors(tag):
            noise = random_bytes(torch.empty_like(t), seed)
            t.copy_(noise)
            if not np.array_equal(bits(t), bits(noise)):
                return False
        return True


def kv_views(buffer: torch.Tensor) -> list[torch.Tensor]:
    """[B, H, N, C] per layer over one buffer, the layers of a block side by side (vLLM's
    create_kv_cache_views with layer_stride = one layer's block, block_stride = all of them)."""
    page = HEADS * TOKENS * DIM
    return [buffer.as_strided((BLOCKS, HEADS, TOKENS, DIM), (LAYERS * page, TOKENS * DIM, DIM, 1),
                              buffer.storage_offset() + layer * page) for layer in range(LAYERS)]


@pytest.fixture
def alloc():
    """A fresh allocator on the memfd daemon; at the end everything awake and freed."""
    a = sv.SubletAllocator(device="cpu")
    yield a
    a.wake_up(None)
    gc.collect()


@pytest.fixture
def engine(alloc):
    e = Engine(alloc)
    yield e
    del e.weights, e.workspace, e.runtime, e.kv_buffer, e.kv_caches
    gc.collect()


# --------------------------------------------------------------------------- level 1

def test_level1_sleep_then_wake_weights_then_kv(alloc, engine):
    before = engine.snapshot()
    used = alloc.get_current_usage()
    assert used >= sum(t.numel() * t.element_size()
                       for tag in ("weights", "runtime", "kv_cache", "workspace")
                       for t in engine.tensors(tag))
    free0 = free_bytes()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    assert free_bytes() - free0 >= used, "sleep gives every page of every tag back"
    assert all(alloc.is_asleep(t) for t in ("weights", "runtime", "kv_cache", "workspace"))
    assert alloc.get_current_usage() == used             # addresses stay reserved (cumem too)
    assert alloc.stats["kv_cache"].copied_bytes == 0      # dropped: nothing to the host
    assert alloc.stats["weights"].copied_bytes >= sum(w.numel() * 2 for w in engine.weights)

    alloc.wake_up(["weights"])                            # llm.wake_up(tags=["weights"])
    assert not alloc.is_asleep("weights")
    assert not alloc.is_asleep("runtime") and not alloc.is_asleep("workspace")  # not deferrable
    assert alloc.is_asleep("kv_cache")                    # deferred
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)
    assert engine.writable("workspace", seed=1)           # fresh memory, contents undefined

    alloc.wake_up(["kv_cache"])                           # llm.wake_up(tags=["kv_cache"])
    assert not alloc.is_asleep("kv_cache")
    assert engine.writable("kv_cache", seed=2)
    assert engine.same_bits("weights", before)


def test_sleep_again_and_again_keeps_the_bits(alloc, engine):
    """Three rounds of vLLM's level-1 cycle: each wake gives the same weights back."""
    before = engine.snapshot()
    for round_ in range(3):
        alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
        alloc.wake_up(["weights"])
        alloc.wake_up(["kv_cache"])
        assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)
        assert engine.writable("kv_cache", seed=round_)


# --------------------------------------------------------------------------- level 2

def test_level2_drops_the_weights_and_keeps_runtime(alloc, engine):
    before = engine.snapshot()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[2])
    assert alloc.stats["weights"].copied_bytes == 0
    assert alloc.stats["runtime"].copied_bytes >= engine.runtime.numel()
    alloc.wake_up(["weights"])
    assert engine.same_bits("runtime", before)
    assert alloc.is_asleep("kv_cache")
    # The RL flow: new weights are written now (collective_rpc weight sync), then the KV.
    assert engine.writable("weights", seed=3)
    alloc.wake_up(["kv_cache"])
    assert engine.writable("kv_cache", seed=4)


# --------------------------------------------------------------------------- vLLM 0.34

# vLLM 0.34.0's CuMemBackend.suspend(discardable) always offloads these
# (device_allocator/sleep_mode_backend.py:126-132); Worker.sleep passes set() at level 1 and,
# at level 2, the storage address of every parameter --sleep-preserve-parameter-names does not
# name (v1/worker/gpu_worker.py:297-337), and no longer saves the buffers itself.
OFFLOAD_034 = ("weights", "runtime", "cudagraph")
PARAMS = 6   # Engine.weights[:6] stand for parameters, [6:] for buffers (rotary tables...)


def discardable(engine: Engine, preserved: set[int]) -> set[int]:
    return {engine.weights[i].untyped_storage().data_ptr() for i in range(PARAMS)
            if i not in preserved}


def test_034_level1_keeps_every_weight_bit(alloc, engine):
    before = engine.snapshot()
    alloc.sleep(OFFLOAD_034, set())
    assert alloc.stats["weights"].copied_bytes == sum(w.nbytes for w in engine.weights)
    alloc.wake_up(["weights"])
    alloc.wake_up(["kv_cache"])
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)


@pytest.mark.parametrize("preserved", [set(), {1}, {0, 5}])
def test_034_level2_keeps_buffers_and_preserved_parameters(alloc, engine, preserved):
    """Three cycles of TRL's order (sleep(level=2), wake_up(["weights"]), load the weights,
    wake_up(["kv_cache"])): the buffers and the preserved parameters come back bit for bit,
    only they cross the host link, and the parameters rewritten are writable."""
    kept = [i for i in range(len(engine.weights)) if i >= PARAMS or i in preserved]
    for cycle in range(3):
        before = [bits(engine.weights[i]) for i in kept]
        runtime = bits(engine.runtime)
        alloc.sleep(OFFLOAD_034, discardable(engine, preserved))
        assert alloc.stats["weights"].copied_bytes == sum(engine.weights[i].nbytes
                                                          for i in kept)
        alloc.wake_up(["weights"])
        assert [np.array_equal(bits(engine.weights[i]), b) for i, b in zip(kept, before)] == \
            [True] * len(kept)
        assert np.array_equal(bits(engine.runtime), runtime)
        for i in set(range(PARAMS)) - preserved:                 # the weight update
            random_bytes(engine.weights[i], 100 * cycle + i)
        alloc.wake_up(["kv_cache"])
        assert engine.writable("kv_cache", seed=cycle)


def test_034_discardable_outside_the_pools_is_ignored(alloc, engine):
    """An address no pool tensor starts at (a parameter vLLM keeps elsewhere, a view's
    offset) drops nothing."""
    before = engine.snapshot()
    stray = torch.empty(16)
    inside = engine.weights[0].data_ptr() + 64
    alloc.sleep(OFFLOAD_034, {stray.data_ptr(), inside})
    alloc.wake_up(None)
    assert engine.same_bits("weights", before)


# --------------------------------------------------------------------------- keep (sublet)

def test_kept_kv_blocks_come_back_and_stay_on_the_device(alloc, engine):
    """sublet's extension: the prefix cache's live blocks survive the sleep, on the device
    (stay=None: compacted into as few pages of the tag as hold them: nothing to the host)."""
    live = np.random.default_rng(7).choice(BLOCKS, size=12, replace=False)
    kept = [bits(view[b]) for view in engine.kv_caches for b in live]
    before = engine.snapshot()
    keep = sv.kv_blocks_keep(engine.kv_caches, live, num_blocks=BLOCKS)
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1], keep={"kv_cache": keep})
    stats = alloc.stats["kv_cache"]
    assert stats.copied_bytes == 0
    assert stats.kept_bytes == len(live) * LAYERS * HEADS * TOKENS * DIM * 2
    alloc.wake_up(["weights"])
    alloc.wake_up(["kv_cache"])
    after = [bits(view[b]) for view in engine.kv_caches for b in live]
    assert all(np.array_equal(a, b) for a, b in zip(after, kept))
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)


def test_keep_kv_blocks_on_a_worker_keeps_them_through_its_next_sleep(alloc, engine,
                                                                      monkeypatch):
    """keep_kv_blocks(worker, ids), what llm.collective_rpc(keep_kv_blocks, ...) runs on
    each worker: its model runner's KV views, kept by the next sleep only."""
    monkeypatch.setattr(sv.SubletAllocator, "instance", alloc)
    runner = SimpleNamespace(kv_caches=engine.kv_caches,
                             kv_cache_config=SimpleNamespace(num_blocks=BLOCKS))
    sv.keep_kv_blocks(SimpleNamespace(model_runner=runner), [5, 6, 200])
    kept = [bits(view[b]) for view in engine.kv_caches for b in (5, 6, 200)]
    alloc.sleep(LEVEL_OFFLOAD[1])
    assert alloc.stats["kv_cache"].kept_bytes == 3 * LAYERS * HEADS * TOKENS * DIM * 2
    alloc.wake_up(None)
    now = [bits(view[b]) for view in engine.kv_caches for b in (5, 6, 200)]
    assert all(np.array_equal(a, b) for a, b in zip(now, kept))
    alloc.sleep(LEVEL_OFFLOAD[1])                         # the next one keeps nothing
    assert alloc.stats["kv_cache"].kept_bytes == 0
    alloc.wake_up(None)


def test_keep_kv_blocks_refuses_vllm_034s_extensible_kv_cache():
    """vLLM 0.34's extensible KV cache is vLLM's own memory, released at every sleep: a keep
    there would be a silent no-op, so it is refused, naming the flag that turns it off."""
    runner = SimpleNamespace(extensible_kv_cache=object())
    with pytest.raises(RuntimeError, match="--no-enable-extensible-kv-cache"):
        sv.keep_kv_blocks(SimpleNamespace(model_runner=runner), [1])


def test_kv_blocks_keep_maps_manager_blocks_to_kernel_blocks():
    """A manager block split into r kernel blocks (kv_cache_interface.py:437-456) keeps its
    r kernel blocks; runs of consecutive blocks become one view each."""
    cache = torch.zeros(8, 2, 3)                     # 4 manager blocks x 2 kernel blocks
    views = sv.kv_blocks_keep([cache], [3, 1, 2], num_blocks=4)
    assert [(v.storage_offset() // 6, v.shape[0]) for v in views] == [(2, 6)]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        sv.kv_blocks_keep([cache], [4], num_blocks=4)
    with pytest.raises(ValueError, match="keep= views"):
        sv.kv_blocks_keep([torch.zeros(7, 2)], [0], num_blocks=4)


# --------------------------------------------------------------------------- discard, misc

def test_discard_kv_then_wake_it(alloc, engine):
    """LLM.release_kv_cache_memory (core.py:1076) -> discard(("kv_cache",)): the other tags
    are untouched and the KV comes back as fresh memory."""
    before = engine.snapshot()
    free0 = free_bytes()
    alloc.discard(("kv_cache",))
    assert free_bytes() - free0 >= engine.kv_buffer.numel() * 2
    assert alloc.is_asleep("kv_cache") and not alloc.is_asleep("weights")
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)
    alloc.wake_up(["kv_cache"])
    assert engine.writable("kv_cache", seed=5)


def test_a_second_sleep_keeps_the_first_policy(alloc, engine):
    """As cumem.py:256-262: tags asleep stay as they sleep (a warning), no error."""
    before = engine.snapshot()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[2])        # would drop the weights: kept offloaded
    alloc.wake_up(None)
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)


def test_allocating_in_a_sleeping_tag_is_refused(alloc, engine):
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    with pytest.raises(RuntimeError, match=r"wake_up\(\['kv_cache'\]\)"):
        with alloc.use_memory_pool("kv_cache"):
            pass
    alloc.wake_up(None)
    with alloc.use_memory_pool("kv_cache"):
        extra = alloc.empty(PAGE, dtype=torch.uint8)
    del extra


def test_wake_without_memory_raises_and_can_be_called_again(alloc, engine):
    """Out of device memory at wake: SubletOutOfMemoryError, the tags still asleep; once the
    memory is freed the same wake_up brings every bit back."""
    before = engine.snapshot()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    hogs = []
    while True:
        try:
            hogs.append(sublet.empty(PAGE, dtype=torch.uint8, device="cpu"))
        except sublet.SubletOutOfMemoryError:
            break
    with pytest.raises(sublet.SubletOutOfMemoryError, match="wake_up again"):
        alloc.wake_up(["weights"])
    assert alloc.is_asleep("weights")
    del hogs
    gc.collect()
    alloc.wake_up(["weights"])
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)


def test_tensors_freed_while_asleep(alloc, engine):
    """Freeing while asleep is legal (cumem.py:204-218): the KV freed during the sleep, the
    wake brings the rest back; then every tensor freed during a sleep, and the wake is
    still fine (nothing is left to bring back)."""
    before = engine.snapshot()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    engine.kv_buffer = engine.kv_caches = None        # the KV's tensors die asleep
    gc.collect()
    alloc.wake_up(None)
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    engine.weights = engine.workspace = engine.runtime = None   # and then all of them
    gc.collect()
    assert alloc.get_current_usage() == 0
    alloc.wake_up(None)
    assert not any(alloc.is_asleep(t) for t in alloc.tags)


def test_a_tag_that_holds_nothing_sleeps_as_nothing(alloc):
    with alloc.use_memory_pool("weights"):
        pass
    assert alloc.get_current_usage() == 0
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    assert not alloc.is_asleep("weights")
    alloc.wake_up(["weights"])


def test_keep_for_an_unknown_tag_is_refused(alloc, engine):
    with pytest.raises(ValueError, match="holds no memory"):
        alloc.sleep(offload_tags=LEVEL_OFFLOAD[1], keep={"no-such-tag": []})
    assert not alloc.is_asleep("weights")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_allocator_imports_and_the_classes_say_why():
    assert sv.SubletAllocator and sv.register
    with pytest.raises(ImportError, match="pip install vllm"):
        sv.SubletWorker


# --------------------------------------------------------------------------- need= (issue 42)

def released_pages(alloc: sv.SubletAllocator) -> dict[str, int]:
    return {tag: s.released_bytes // PAGE for tag, s in alloc.stats.items()}


def test_sleep_by_need_releases_the_dropped_tags_first_and_only_what_it_takes(alloc, engine):
    """sleep(offload_tags, need=N) at level 1: the tags that keep nothing go first, each by
    need (workspace, 4 pages, cannot give 10: released whole, as without need; the KV cache
    then gives the other 6), and the offloaded tags, the need met, give nothing: no weight
    byte crosses the host link. The same sleep without need releases every page."""
    before = engine.snapshot()
    gc.collect()
    free0 = free_bytes()
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1], need=free0 + 10 * PAGE)
    got = released_pages(alloc)
    assert (got["workspace"], got["kv_cache"]) == (4, 6)
    assert got["weights"] == got["runtime"] == 0 and free_bytes() == free0 + 10 * PAGE
    assert alloc.stats["workspace"].need_bytes is None
    assert alloc.stats["kv_cache"].need_bytes == free0 + 10 * PAGE
    assert sum(s.copied_bytes for s in alloc.stats.values()) == 0
    assert all(alloc.is_asleep(t) for t in ("weights", "runtime", "kv_cache", "workspace"))
    alloc.wake_up(["weights"])
    alloc.wake_up(["kv_cache"])
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])            # without need: everything
    assert sum(released_pages(alloc).values()) > 80 and alloc.stats["kv_cache"].need_bytes is None
    alloc.wake_up(None)
    assert engine.same_bits("weights", before)


def test_sleep_need_from_the_environment_reaches_the_offloaded_tags(alloc, engine, monkeypatch):
    """$SUBLET_RELEASE_NEED, read at vLLM's own sleep call (no argument): the dropped tags go
    whole, then 2 pages of the offloaded ones, their live bytes only those 2 pages' to the
    host; every offloaded bit back at the wake."""
    before = engine.snapshot()
    gc.collect()
    free0 = free_bytes()
    dropped = sum(alloc.tag_usage(t) for t in ("workspace", "kv_cache")) // PAGE
    need = free0 + (dropped + 2) * PAGE
    monkeypatch.setenv("SUBLET_RELEASE_NEED", str(need))
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    got = released_pages(alloc)
    assert got["weights"] + got["runtime"] == 2 and sum(got.values()) == dropped + 2
    assert sum(s.copied_bytes for s in alloc.stats.values()) == 2 * PAGE
    alloc.wake_up(None)
    assert engine.same_bits("weights", before) and engine.same_bits("runtime", before)


def test_sleep_need_for_a_sleep_vllm_makes_and_a_malformed_value(alloc, engine, monkeypatch):
    """sleep_need (llm.collective_rpc's route) sets the next sleep's need, over the
    environment's; a malformed $SUBLET_RELEASE_NEED is refused naming the fix, nothing
    asleep."""
    monkeypatch.setenv("SUBLET_RELEASE_NEED", "lots")
    with pytest.raises(ValueError, match=r"\$SUBLET_RELEASE_NEED='lots'.*24GiB.*unset it"):
        alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])
    assert not any(alloc.is_asleep(t) for t in alloc.tags)
    with pytest.raises(ValueError, match="need="):
        sv.sleep_need(None, -1)
    gc.collect()
    sv.SubletAllocator.instance, saved = alloc, sv.SubletAllocator.instance
    try:
        sv.sleep_need(None, f"{(free_bytes() + 3 * PAGE) // 1024}KiB")
    finally:
        sv.SubletAllocator.instance = saved
    alloc.sleep(offload_tags=LEVEL_OFFLOAD[1])            # the environment's is not read
    assert sum(released_pages(alloc).values()) == 3
    alloc.wake_up(None)
