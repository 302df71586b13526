"""sublet under the real vLLM of one tested version (sublet.compat.vllm_versions.TESTED), on
the memfd backend: vLLM's own Worker.sleep / wake_up / discard and its "cumem" backend, with
the allocator lookup routed to sublet's by the switch, driven in the frameworks' orders, every
kept bit compared after every wake, three cycles each.

Skips without vLLM. tests/vllm-env installs each tested vLLM; tests/run-vllm runs this module
(and test_compat_vllm_plugin.py) once per version, as CI does:
    tests/vllm-env && tests/run-vllm            # every tested version
    tests/run-vllm 0.34.0                       # one
"""

from __future__ import annotations

import gc
import os
import sys

import numpy as np
import pytest
import torch

if os.environ.get("SUBLET_VLLM_REQUIRED"):   # tests/run-vllm: fail, never skip
    import vllm.v1.worker.gpu_worker  # noqa: F401
else:
    pytest.importorskip("vllm.v1.worker.gpu_worker", reason="needs vLLM (tests/vllm-env)")

import vllm  # noqa: E402
import vllm.device_allocator  # noqa: E402

from sublet.compat import vllm as sv  # noqa: E402
from sublet.compat import vllm_switch, vllm_versions  # noqa: E402

from conftest import memfd_free_bytes  # noqa: E402
from pool_helpers import bits  # noqa: E402
from vllm_orders import ORDERS  # noqa: E402
from vllm_worker import Engine, Model, keep_lookups  # noqa: E402

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]

VERSION = vllm_versions.installed()
ORDER = ORDERS.get(VERSION)
PRESERVED = "embed.weight"   # --sleep-preserve-parameter-names (0.31 on)
RUNTIME = ORDER is not None and "runtime" in ORDER.offload[1]   # the tag exists (0.32 on)


@pytest.fixture
def unrouted(monkeypatch):
    keep_lookups(monkeypatch)


@pytest.fixture
def alloc(unrouted, monkeypatch):
    """sublet's allocator on the memfd daemon as the process's, vLLM's lookup routed to it by
    the switch, and torch's device calls vLLM's Worker makes answered by the memfd daemon."""
    a = sv.SubletAllocator(device="cpu")
    monkeypatch.setattr(sv.SubletAllocator, "instance", a)
    monkeypatch.setenv(vllm_switch.ENV, "1")
    vllm_switch.plug_in()
    total = 64 * 1024 * 1024
    info = lambda *args: (memfd_free_bytes(), total)   # noqa: E731
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None, raising=False)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", info, raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", info)
    yield a
    a.wake_up(None)
    gc.collect()


@pytest.fixture
def calls(alloc, monkeypatch):
    """The allocator calls vLLM makes, recorded: (method, tags, discardable addresses)."""
    seen: list[tuple] = []
    sleep, wake = alloc.sleep, alloc.wake_up

    def record_sleep(offload_tags=None, discardable=(), keep=None):
        seen.append(("sleep", tuple(offload_tags), frozenset(discardable)))
        sleep(offload_tags, discardable, keep)

    def record_wake(tags=None):
        seen.append(("wake_up", None if tags is None else tuple(tags), frozenset()))
        wake(tags)

    monkeypatch.setattr(alloc, "sleep", record_sleep)
    monkeypatch.setattr(alloc, "wake_up", record_wake)
    return seen


def test_the_installed_vllm_is_tested_and_its_order_known():
    assert vllm_versions.check() == VERSION
    assert ORDER is not None, f"vllm_orders.ORDERS has no entry for {VERSION}"


def test_the_switch_routes_every_lookup_to_sublet(alloc):
    assert vllm_switch.routed()
    assert vllm.device_allocator.get_mem_allocator_instance() is alloc
    gpu_worker = sys.modules["vllm.v1.worker.gpu_worker"]
    assert gpu_worker.get_mem_allocator_instance() is alloc
    assert alloc.deferrable_tags == ORDER.deferrable
    cumem = vllm_switch.cumem_class()
    if cumem is not None:   # where vLLM's cumem module loads (a CUDA runtime)
        assert cumem.get_instance() is alloc


def test_off_the_switch_leaves_vllm_alone(unrouted, monkeypatch):
    monkeypatch.setenv(vllm_switch.ENV, "0")
    vllm_switch.plug_in()
    assert not vllm_switch.routed()


def test_an_untested_vllm_is_refused_before_anything_is_routed(unrouted, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.setenv(vllm_switch.ENV, "1")
    with pytest.raises(vllm_versions.UntestedVLLMError, match=r"0\.34\.0.*not with .*0\.35\.0"):
        vllm_switch.plug_in()
    assert not vllm_switch.routed()
    monkeypatch.setenv(vllm_versions.ALLOW_ENV, "1")   # asked for: runs, with a warning
    vllm_switch.plug_in()
    assert vllm_switch.routed()


# --------------------------------------------------------------------------- the orders

def same(before: dict[str, np.ndarray], engine: Engine, names) -> list[str]:
    """The names among `names` whose bits differ from `before` (none: all came back); reads
    only those (a tag asleep is unmapped)."""
    return [n for n in names if not np.array_equal(bits(engine.tensor(n)), before[n])]


WEIGHTS = Model.PARAMS + Model.BUFFERS


def kept_runtime(level: int) -> tuple[str, ...]:
    """("runtime",) where the vLLM has that tag (0.32 on) and offloads it at that level."""
    return ("runtime",) if "runtime" in ORDER.offload[level] else ()


def test_level1_then_wake_all_keeps_every_bit(alloc, calls):
    """vLLM's own pattern (LLM.sleep(level=1), LLM.wake_up()), three cycles."""
    engine = Engine(alloc, RUNTIME)
    before = engine.snapshot()
    for _ in range(3):
        engine.worker.sleep(1)
        assert alloc.is_asleep("weights") and alloc.is_asleep("kv_cache")
        engine.worker.wake_up(None)
        assert same(before, engine, (*WEIGHTS, *kept_runtime(1))) == []
    assert calls[0] == ("sleep", ORDER.offload[1], frozenset())
    engine.free()


@pytest.mark.parametrize("preserve", [(), (PRESERVED,)], ids=["plain", "preserved"])
def test_trl_order_keeps_buffers_and_preserved_parameters(alloc, calls, preserve):
    """TRL (trl/generation/vllm_generation.py): sleep(level=2), wake_up(["weights"]), load the
    weights, wake_up(["kv_cache"]); three cycles, the weights new every time."""
    if preserve and not ORDER.preserves:
        pytest.skip(f"vLLM {VERSION} has no --sleep-preserve-parameter-names")
    if preserve and ORDER.worker_saves_buffers:
        pytest.skip(f"vLLM {VERSION}'s Worker saves the preserved parameters itself, with "
                    f".to('cpu'): the tensor itself on the memfd backend, not a copy "
                    f"(test_gpu_compat_vllm.py replays it on a GPU)")
    engine = Engine(alloc, RUNTIME, preserve=preserve)
    for cycle in range(3):
        before = engine.snapshot()
        engine.worker.sleep(2)
        engine.worker.wake_up(["weights"])
        assert alloc.is_asleep("kv_cache")
        assert same(before, engine, (*Model.BUFFERS, *preserve, *kept_runtime(2))) == []
        engine.load_weights(seed=100 * cycle)
        engine.worker.wake_up(["kv_cache"])
        assert not alloc.is_asleep("weights") and not alloc.is_asleep("kv_cache")
    params = {p.untyped_storage().data_ptr() for n, p in engine.model.named_parameters()
              if n not in preserve}
    assert calls[0] == ("sleep", ORDER.offload[2],
                        frozenset(params) if ORDER.discardable else frozenset())
    if not ORDER.worker_saves_buffers:   # 0.34: sublet keeps them, and only they cross
        kept = sum(t.nbytes for n, t in engine.model.tensors().items()
                   if n in Model.BUFFERS or n in preserve)
        assert alloc.stats["weights"].copied_bytes == kept
    engine.free()


def test_level2_then_wake_all_frees_the_weights(alloc):
    """verl's and OpenRLHF's wake (wake_up() after the weight sync) after a level-2 sleep:
    the weights' memory went back to the driver, the buffers come back."""
    engine = Engine(alloc, RUNTIME)
    before = engine.snapshot()
    free0 = memfd_free_bytes()
    engine.worker.sleep(2)
    params = sum(p.nbytes for p in engine.model.parameters())
    assert memfd_free_bytes() - free0 >= params + engine.kv.nbytes
    engine.worker.wake_up(None)
    assert same(before, engine, (*Model.BUFFERS, *kept_runtime(2))) == []
    engine.free()


def test_openrlhf_order_keeps_the_weights_through_level1(alloc):
    """OpenRLHF 0.11.2 (trainer/ray/vllm_engine.py): sleep(1) after creation; per generation
    wake_up(["weights"]), wake_up(["kv_cache"]), generate, sleep(1); after training
    wake_up(["weights"]) and the weights loaded, so the next generation's wake_up(["weights"])
    finds them awake."""
    engine = Engine(alloc, RUNTIME)
    loaded = {n: bits(engine.tensor(n)) for n in WEIGHTS}
    engine.worker.sleep(1)
    for cycle in range(3):
        before = loaded
        engine.worker.wake_up(["weights"])
        engine.worker.wake_up(["kv_cache"])
        assert same(before, engine, WEIGHTS) == []
        engine.worker.sleep(1)
        engine.worker.wake_up(["weights"])                    # after training: the update
        engine.load_weights(seed=50 * cycle)
        loaded = {n: bits(engine.tensor(n)) for n in WEIGHTS}
    engine.worker.wake_up(["weights"])
    engine.worker.wake_up(["kv_cache"])
    assert same(loaded, engine, WEIGHTS) == []
    engine.free()


def test_discard_kv_leaves_the_rest_awake(alloc):
    """LLM.release_kv_cache_memory / Worker.discard(("kv_cache",)), where the Worker has it."""
    engine = Engine(alloc, RUNTIME)
    if not hasattr(engine.worker, "discard"):
        pytest.skip(f"vLLM {VERSION}'s Worker has no discard")
    before = engine.snapshot()
    engine.worker.discard(("kv_cache",))
    assert alloc.is_asleep("kv_cache") and not alloc.is_asleep("weights")
    assert same(before, engine, (*WEIGHTS, *kept_runtime(1))) == []
    engine.worker.wake_up(["kv_cache"])
    engine.free()


def test_kept_kv_blocks_survive_the_sleep_on_the_device(alloc):
    """sublet's extension through vLLM's own sleep: keep_kv_blocks on the worker, then
    Worker.sleep(1): the blocks stay on the device (nothing to the host) and come back."""
    engine = Engine(alloc, RUNTIME)
    live = [3, 4, 5, 40]
    kept = [bits(engine.kv[b]) for b in live]
    sv.keep_kv_blocks(engine.worker, live)
    engine.worker.sleep(1)
    assert alloc.stats["kv_cache"].copied_bytes == 0
    assert alloc.stats["kv_cache"].kept_bytes == len(live) * engine.kv[0].nbytes
    engine.worker.wake_up(["weights"])
    engine.worker.wake_up(["kv_cache"])
    assert all(np.array_equal(bits(engine.kv[b]), k) for b, k in zip(live, kept))
    engine.free()

