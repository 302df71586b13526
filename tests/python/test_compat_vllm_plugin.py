"""sublet's vLLM plug-in against the real vLLM of one tested version, on the CPU: the entry
point that pyproject.toml declares is found by vllm.plugins.load_general_plugins(), it
registers the "sublet" sleep-mode backend with vLLM's SleepModeBackendFactory (0.25 on), the
backend makes the allocator calls vLLM's CuMemBackend makes, and SubletWorker is a vLLM Worker
overriding the method vLLM calls.

Skips without vLLM; tests/run-vllm runs it once per tested version (tests/vllm-env installs
them), as CI does.
"""

from __future__ import annotations

import inspect
import os
import sys
import tomllib
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

if os.environ.get("SUBLET_VLLM_REQUIRED"):   # tests/run-vllm: fail, never skip
    import vllm.v1.worker.gpu_worker  # noqa: F401
else:
    pytest.importorskip("vllm.v1.worker.gpu_worker", reason="needs vLLM (tests/vllm-env)")

import vllm.device_allocator  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from sublet.compat import vllm as sv  # noqa: E402
from sublet.compat import vllm_switch  # noqa: E402

from vllm_worker import keep_lookups  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
try:   # vLLM 0.25 on
    import vllm.device_allocator.sleep_mode_backend as smb
    Factory = smb.SleepModeBackendFactory
except ImportError:
    smb = Factory = None
needs_backends = pytest.mark.skipif(smb is None, reason="this vLLM has no sleep-mode backends")


@pytest.fixture(autouse=True)
def unrouted(monkeypatch):
    keep_lookups(monkeypatch)


@pytest.fixture
def registry(monkeypatch):
    if Factory is None:
        pytest.skip("this vLLM has no sleep-mode backends")
    """vLLM's backend registry as it was, restored after the test."""
    monkeypatch.setattr(Factory, "_registry", dict(Factory._registry))
    return Factory._registry


@pytest.fixture
def checkout_entry_points(tmp_path, monkeypatch):
    """The checkout's pyproject.toml entry points, as an installed distribution's metadata
    (a .dist-info on sys.path): what `pip install .` gives importlib.metadata."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dist = tmp_path / "sublet_checkout-0.0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sublet-checkout\n"
                                   "Version: 0.0.0\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)     # every plugin loads
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    return project["entry-points"]


def test_pyproject_declares_the_general_plugin():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "sublet": "sublet.compat.vllm:register"}
    assert vllm.plugins.DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"


def test_load_general_plugins_finds_the_entry_point_and_registers(checkout_entry_points,
                                                                  registry):
    registry.pop("sublet", None)
    found = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    assert found["sublet"] is sv.register
    vllm.plugins.load_general_plugins()
    assert "sublet" in registry
    assert Factory.get_backend_class("sublet") is sv.SubletBackend
    assert not vllm_switch.routed()   # the switch is off: vLLM's sleep stays vLLM's


def test_load_general_plugins_with_the_switch_routes_the_allocator(checkout_entry_points,
                                                                   monkeypatch):
    monkeypatch.setenv(vllm_switch.ENV, "1")
    vllm.plugins.load_general_plugins()
    assert vllm.device_allocator.get_mem_allocator_instance() is \
        sv.SubletAllocator.get_instance()


def test_register_twice_is_harmless(registry):
    """vLLM loads plugins in each process, maybe twice (its docstring): no duplicate error."""
    registry.pop("sublet", None)
    sv.register()
    sv.register()
    assert Factory.get_backend_class("sublet") is sv.SubletBackend


def test_create_backend_makes_ours(registry, monkeypatch):
    monkeypatch.setattr(sv.SubletAllocator, "instance", _Recorder())
    sv.register()
    backend = Factory.create_backend(SimpleNamespace(sleep_mode_backend="sublet"))
    assert isinstance(backend, sv.SubletBackend)
    assert isinstance(backend, smb.SleepModeBackend)
    assert backend.state() == "RUNNING"
    assert sv.SubletBackend.is_supported() and sv.SubletBackend.preserves_communicators()


class _Recorder:
    """Stands in for an allocator: records the calls a backend makes."""

    def __init__(self):
        self.calls = []

    def sleep(self, offload_tags=None, discardable=(), keep=None):
        self.calls.append(("sleep", offload_tags, set(discardable)))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def discard(self, tags):
        self.calls.append(("discard", tags))


def _drive(backend):
    """What a Worker asks of its backend, in the installed vLLM's terms: suspend(level) up to
    0.33, suspend(discardable) in 0.34 (a level-1 sleep, then a level-2 one)."""
    takes = list(inspect.signature(smb.SleepModeBackend.suspend).parameters)[1]
    backend.suspend(1 if takes == "level" else set())
    backend.resume(["weights"])
    backend.resume(["kv_cache"])
    backend.suspend(2 if takes == "level" else {0x7000, 0x9000})
    backend.resume(None)
    if hasattr(smb.CuMemBackend, "discard"):
        backend.discard(("kv_cache",))


@needs_backends
def test_suspend_makes_the_calls_cumem_backend_makes(monkeypatch):
    """The same allocator calls as vLLM's own CuMemBackend, each with its allocator replaced by
    a recorder: 0.34's discardable reaches sublet's allocator, where 0.33's level did."""
    theirs, ours = _Recorder(), _Recorder()
    monkeypatch.setattr(vllm.device_allocator, "get_mem_allocator_instance", lambda: theirs)
    _drive(smb.CuMemBackend())
    monkeypatch.setattr(sv.SubletAllocator, "instance", ours)
    _drive(sv.SubletBackend())
    assert ours.calls == theirs.calls
    assert ours.calls[0][0] == "sleep" and "weights" in ours.calls[0][1]


@needs_backends
def test_backend_states_follow_cumem(monkeypatch):
    monkeypatch.setattr(sv.SubletAllocator, "instance", _Recorder())
    backend = sv.SubletBackend()
    backend.suspend()
    assert backend.state() == "SUSPENDED"
    backend.resume(["weights"])
    assert backend.state() == "RUNNING"


@needs_backends
def test_keep_on_next_suspend_reaches_the_allocator(monkeypatch):
    seen = []
    alloc = SimpleNamespace(keep_on_next_sleep=seen.append)
    monkeypatch.setattr(sv.SubletAllocator, "instance", alloc)
    sv.SubletBackend().keep_on_next_suspend({"kv_cache": ["views"]})
    assert seen == [{"kv_cache": ["views"]}]


def test_deferrable_tags_are_vllms():
    """sublet's default is vLLM's (0.32 on); the switch takes the installed vLLM's, none
    before 0.32 (a wake wakes the tags it names only)."""
    theirs = getattr(vllm.device_allocator, "DEFERRABLE_TAGS", None)
    assert theirs is None or sv.DEFERRABLE_TAGS == theirs


def test_allocator_has_the_mem_allocator_protocol():
    """Every method of vLLM's MemAllocator protocol (device_allocator/__init__.py:28-37),
    taking what vLLM passes; plus CuMemAllocator's cudagraph_pool and get_instance."""
    protocol = vllm.device_allocator.MemAllocator
    for name in ("use_memory_pool", "sleep", "discard", "wake_up", "get_current_usage"):
        if not hasattr(protocol, name):
            continue   # discard came in 0.28
        theirs = list(inspect.signature(getattr(protocol, name)).parameters)
        ours = list(inspect.signature(getattr(sv.SubletAllocator, name)).parameters)
        assert ours[:len(theirs)] == theirs, name
    assert callable(sv.SubletAllocator.cudagraph_pool)
    assert sv.SubletAllocator.get_instance() is sv.SubletAllocator.get_instance()


def test_worker_is_a_vllm_worker_overriding_the_pool_context():
    assert issubclass(sv.SubletWorker, Worker)
    ours = sv.SubletWorker._maybe_get_memory_pool_context
    assert ours is not Worker._maybe_get_memory_pool_context
    def shape(f):  # names, kinds and defaults (annotations are strings on our side)
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]
    assert shape(ours) == shape(Worker._maybe_get_memory_pool_context) == [
        ("self", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
        ("tag", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty)]


def test_worker_cls_resolves_by_vllms_qualname():
    """--worker-cls takes a dotted name (utils/import_utils.py:119-123 rsplits on '.')."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    assert resolve_obj_by_qualname("sublet.compat.vllm.SubletWorker") is sv.SubletWorker


def _fake_worker(sleep_mode: bool):
    config = SimpleNamespace(enable_sleep_mode=sleep_mode, enable_cumem_allocator=sleep_mode)
    return SimpleNamespace(vllm_config=SimpleNamespace(model_config=config))


def test_pool_context_is_nothing_without_sleep_mode():
    ctx = sv.SubletWorker._maybe_get_memory_pool_context(_fake_worker(False), "weights")
    assert isinstance(ctx, nullcontext)


def test_pool_context_is_the_allocators_with_sleep_mode(monkeypatch):
    used = []
    alloc = SimpleNamespace(tag_usage=lambda tag: 0,
                            use_memory_pool=lambda tag: used.append(tag) or nullcontext())
    monkeypatch.setattr(sv.SubletAllocator, "instance", alloc)
    for tag in ("weights", "kv_cache", "runtime", "workspace"):
        sv.SubletWorker._maybe_get_memory_pool_context(_fake_worker(True), tag=tag)
    assert used == ["weights", "kv_cache", "runtime", "workspace"]


def test_worker_selects_the_sublet_backend():
    from sublet.compat.vllm_classes import use_sublet_backend
    config = SimpleNamespace(sleep_mode_backend="cumem")
    use_sublet_backend(config)
    assert config.sleep_mode_backend == "sublet"
