"""sublet's vLLM plug-in against the real vLLM 0.33.0, on the CPU: the entry point that
pyproject.toml declares is found by vllm.plugins.load_general_plugins(), it registers the
"sublet" sleep-mode backend with vLLM's SleepModeBackendFactory, the backend suspends with
the offload tags vLLM's CuMemBackend uses, and SubletWorker is a vLLM Worker overriding the
method vLLM calls.

CI does not install vLLM (4.6 GB, and it pins its own torch): this module skips there. Run it
in a venv of its own:
    python3 -m venv /work/vllm-venv && /work/vllm-venv/bin/pip install vllm==0.33.0 pytest
    PYTHONPATH=$PWD /work/vllm-venv/bin/python -m pytest tests/python/test_compat_vllm_plugin.py
"""

from __future__ import annotations

import inspect
import sys
import tomllib
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest

smb = pytest.importorskip("vllm.device_allocator.sleep_mode_backend",
                          reason="needs vLLM (pip install vllm==0.33.0; CI has none)")

import vllm.device_allocator  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.v1.worker.gpu_worker import Worker  # noqa: E402

from sublet.compat import vllm as sv  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
Factory = smb.SleepModeBackendFactory


@pytest.fixture
def registry(monkeypatch):
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


def test_register_twice_is_harmless(registry):
    """vLLM loads plugins in each process, maybe twice (its docstring): no duplicate error."""
    registry.pop("sublet", None)
    sv.register()
    sv.register()
    assert Factory.get_backend_class("sublet") is sv.SubletBackend


def test_create_backend_makes_ours(registry):
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

    def sleep(self, offload_tags=None, keep=None):
        self.calls.append(("sleep", offload_tags))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def discard(self, tags):
        self.calls.append(("discard", tags))


def _drive(backend):
    backend.suspend(1)
    backend.resume(["weights"])
    backend.resume(["kv_cache"])
    backend.suspend(2)
    backend.resume(None)
    backend.discard(("kv_cache",))


@pytest.mark.parametrize("level", [1, 2])
def test_suspend_offloads_what_cumem_backend_offloads(monkeypatch, level):
    """The same allocator calls as vLLM's own CuMemBackend (sleep_mode_backend.py:127-152),
    run here with its allocator replaced by a recorder."""
    theirs, ours = _Recorder(), _Recorder()
    monkeypatch.setattr(vllm.device_allocator, "get_mem_allocator_instance", lambda: theirs)
    monkeypatch.setattr(sv.SubletAllocator, "instance", ours)
    _drive(smb.CuMemBackend())
    _drive(sv.SubletBackend())
    assert ours.calls == theirs.calls
    assert ("sleep", ("weights", "runtime", "cudagraph")) in ours.calls
    assert ("sleep", ("runtime", "cudagraph")) in ours.calls


def test_backend_states_follow_cumem(monkeypatch):
    monkeypatch.setattr(sv.SubletAllocator, "instance", _Recorder())
    backend = sv.SubletBackend()
    backend.suspend(1)
    assert backend.state() == "SUSPENDED"
    backend.resume(["weights"])
    assert backend.state() == "RUNNING"
    backend.discard(("kv_cache",))
    assert backend.state() == "SUSPENDED"


def test_keep_on_next_suspend_reaches_the_allocator_once(monkeypatch):
    seen = []
    alloc = SimpleNamespace(sleep=lambda offload_tags, keep: seen.append(keep))
    monkeypatch.setattr(sv.SubletAllocator, "instance", alloc)
    backend = sv.SubletBackend()
    backend.keep_on_next_suspend({"kv_cache": ["views"]})
    backend.suspend(1)
    backend.suspend(1)
    assert seen == [{"kv_cache": ["views"]}, {}]


def test_deferrable_tags_are_vllms():
    assert sv.DEFERRABLE_TAGS == vllm.device_allocator.DEFERRABLE_TAGS


def test_allocator_has_the_mem_allocator_protocol():
    """Every method of vLLM's MemAllocator protocol (device_allocator/__init__.py:28-37),
    taking what vLLM passes; plus CuMemAllocator's cudagraph_pool and get_instance."""
    protocol = vllm.device_allocator.MemAllocator
    for name in ("use_memory_pool", "sleep", "discard", "wake_up", "get_current_usage"):
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


def test_vllms_allocator_lookups_give_sublets(monkeypatch):
    """So that LoRA's use_memory_pool(tag="runtime") (lora_model_runner_mixin.py:60) goes to
    sublet's pools too."""
    from sublet.compat.vllm_classes import _ALLOCATOR_LOOKUPS, route_allocator_lookups
    import vllm.v1.worker.lora_model_runner_mixin as lora
    for name in _ALLOCATOR_LOOKUPS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_mem_allocator_instance"):
            monkeypatch.setattr(module, "get_mem_allocator_instance",
                                module.get_mem_allocator_instance)   # restored after
    route_allocator_lookups()
    assert vllm.device_allocator.get_mem_allocator_instance() is \
        sv.SubletAllocator.get_instance()
    assert lora.get_mem_allocator_instance == sv.SubletAllocator.get_instance
