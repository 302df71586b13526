"""sublet.compat.torch_memory_saver's shape against the real torch_memory_saver 0.0.10 (its
modules, their public names, and the signatures of what code calls), and the parts of its
facade that need no daemon (hook_mode, _ensure_initialized and a Dynamo-style plug-in, env
parsing, pool names, configure_subprocess and the hooks' stand-ins). No GPU, no daemon. The
installer: test_compat_tms_install.py; the C library's stand-in: test_compat_tms_memfd.py.

The real package is compared when it is importable (CI installs it from PyPI; here
`pip install --no-deps --target DIR torch_memory_saver==0.0.10` and TMS_REAL_PATH=DIR also
works); those tests skip, saying so, when it is not.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types

import pytest

from sublet.compat import torch_memory_saver as ours
from sublet.compat.torch_memory_saver import _env, entrypoint, utils


def real_tms():
    """The real torch_memory_saver module, or skip. Imported from $TMS_REAL_PATH when set;
    a sublet shim found under the name does not count."""
    path = os.environ.get("TMS_REAL_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        module = importlib.import_module("torch_memory_saver")
    except Exception as exc:  # noqa: BLE001 (any failure to import means: not here)
        pytest.skip(f"the real torch_memory_saver is not importable ({exc}): pip install "
                    f"torch_memory_saver==0.0.10 (or set TMS_REAL_PATH to a --target dir)")
    if module is ours:
        pytest.skip("`import torch_memory_saver` gives sublet's shim here, not the real one")
    return module


def _public(cls) -> dict[str, object]:
    return {name: inspect.getattr_static(cls, name) for name in dir(cls)
            if not name.startswith("_")}


def test_module_exposes_the_real_public_names():
    real = real_tms()
    for name in ("TorchMemorySaver", "configure_subprocess", "torch_memory_saver"):
        assert hasattr(real, name) and hasattr(ours, name), name
    assert isinstance(ours.torch_memory_saver, ours.TorchMemorySaver)
    assert ours.entrypoint.TorchMemorySaver is ours.TorchMemorySaver
    assert real.entrypoint.TorchMemorySaver is real.TorchMemorySaver


def test_every_public_member_of_the_real_facade_exists_with_its_kind():
    real = real_tms()
    real_members, our_members = _public(real.TorchMemorySaver), _public(ours.TorchMemorySaver)
    missing = sorted(set(real_members) - set(our_members))
    assert not missing, f"missing from sublet's TorchMemorySaver: {missing}"
    for name, member in real_members.items():
        assert type(our_members[name]) is type(member), name  # property stays property
        if isinstance(member, property):
            assert (our_members[name].fset is None) == (member.fset is None), name


def _check_signature(name: str, real_fn, our_fn) -> None:
    """Every parameter of the real one exists in ours, of the same kind and default; any
    parameter sublet adds is keyword-only with a default (a call that works there works
    here)."""
    real_sig, our_sig = inspect.signature(real_fn), inspect.signature(our_fn)
    for p in real_sig.parameters.values():
        q = our_sig.parameters.get(p.name)
        assert q is not None, f"{name}: parameter {p.name} missing"
        assert (q.kind, q.default) == (p.kind, p.default), f"{name}({p.name}): {q} vs {p}"
    assert list(our_sig.parameters)[:len(real_sig.parameters)] == list(real_sig.parameters), name
    for q in list(our_sig.parameters.values())[len(real_sig.parameters):]:
        assert q.kind is inspect.Parameter.KEYWORD_ONLY and q.default is not q.empty, \
            f"{name}: sublet's extra parameter {q} must be keyword-only with a default"


def test_signatures_match_the_real_ones():
    real = real_tms()
    for name, member in _public(real.TorchMemorySaver).items():
        if inspect.isfunction(member):
            _check_signature(name, member, getattr(ours.TorchMemorySaver, name))
        elif isinstance(member, property) and member.fset is not None:
            _check_signature(f"{name}.setter", member.fset,
                             inspect.getattr_static(ours.TorchMemorySaver, name).fset)
    _check_signature("configure_subprocess", real.configure_subprocess,
                     ours.configure_subprocess)
    _check_signature("__init__", real.TorchMemorySaver.__init__, ours.TorchMemorySaver.__init__)


def test_the_impl_methods_that_the_facade_calls_take_the_same_keywords():
    """Plug-ins replace _impl (Dynamo's GMS does): the facade calls it as the original."""
    real = real_tms()
    for name in ("region", "cuda_graph", "pause", "resume", "get_cpu_backup"):
        real_params = list(inspect.signature(getattr(real.entrypoint._TorchMemorySaverImpl,
                                                     name)).parameters)
        our_params = list(inspect.signature(getattr(ours.entrypoint._TorchMemorySaverImpl,
                                                    name)).parameters)
        assert our_params[:len(real_params)] == real_params, name


# The original's modules (0.0.10's wheel), each of which sublet's package has.
MODULES = ("entrypoint", "utils", "testing_utils", "binary_wrapper", "hooks", "hooks.base",
           "hooks.mode_preload", "hooks.mode_torch")


# Private names of theirs that code outside the package uses (Dynamo, the original's tests).
USED = ("_TorchMemorySaverImpl", "_TAG_DEFAULT", "_sanity_checks", "_detect_cuda_major",
        "_is_rocm_torch")


def test_the_package_has_the_originals_modules_and_their_names():
    """Every module of the real package is in ours, with every public name the real one
    defines (its own, not the ones it imported; and the private ones in USED), and the same
    kind of object."""
    real = real_tms()
    for name in MODULES:
        theirs = importlib.import_module(f"{real.__name__}.{name}")
        mine = importlib.import_module(f"{ours.__name__}.{name}")
        own = [n for n, v in vars(theirs).items() if (not n.startswith("_") or n in USED)
               and not isinstance(v, types.ModuleType)
               and getattr(v, "__module__", theirs.__name__) == theirs.__name__]
        missing = [n for n in own if not hasattr(mine, n)]
        assert not missing, f"{name}: missing {missing}"
        for n in own:
            assert callable(getattr(mine, n)) == callable(getattr(theirs, n)), f"{name}.{n}"


def test_the_modules_import_by_themselves_in_a_fresh_process():
    import subprocess
    from conftest import CHILD_ENV
    code = "; ".join(f"import {ours.__name__}.{m}" for m in MODULES)
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **CHILD_ENV},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------- the facade alone

def test_lazy_init_and_hook_mode_as_the_original():
    tms = ours.TorchMemorySaver()
    assert tms._impl is None and tms._impl_ctor_kwargs == {}
    tms.hook_mode = "torch"                        # stored; sublet routes alike
    with pytest.raises(AttributeError):
        tms.hook_mode
    with pytest.raises(ValueError, match="preload"):
        tms.hook_mode = "cuda"
    assert tms.enabled is True
    assert tms._ensure_initialized() is None       # as the original
    assert tms._impl is not None and not hasattr(tms, "_impl_ctor_kwargs")
    assert tms._impl._hook_mode == "torch"
    with pytest.raises(AttributeError, match="before the first use"):
        tms.hook_mode = "preload"


def test_a_dynamo_style_plug_in_wraps_ensure_initialized_and_replaces_impl(monkeypatch):
    """NVIDIA Dynamo's GPU memory service sets hook_mode = "gms", wraps
    _ensure_initialized (its wrapper returns None) and puts its own _impl in: the facade
    calls whatever self._impl is after it."""
    calls = []

    class TheirImpl:
        def pause(self, tag):
            calls.append(("pause", tag))

        def resume(self, tag):
            calls.append(("resume", tag))

    original = entrypoint.TorchMemorySaver._ensure_initialized

    def wrapped(self):
        if self._impl is None and self._impl_ctor_kwargs.get("hook_mode") == "gms":
            self._impl = TheirImpl()
            del self._impl_ctor_kwargs
            return None
        original(self)
        return None

    monkeypatch.setattr(entrypoint.TorchMemorySaver, "_ensure_initialized", wrapped)
    tms = ours.TorchMemorySaver()
    tms.hook_mode = "gms"
    tms.pause("kv_cache")
    tms.resume()
    assert calls == [("pause", "kv_cache"), ("resume", None)]
    plain = ours.TorchMemorySaver()                # the wrapper calling through: ours
    plain.pause("nothing-here")
    assert isinstance(plain._impl, entrypoint._TorchMemorySaverImpl)


def test_memory_margin_and_retain_cpu_backup(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "yes")
    tms = ours.TorchMemorySaver()
    tms._impl_ctor_kwargs["device"] = "cpu"
    assert tms.retain_cpu_backup is True
    tms.retain_cpu_backup = False
    assert tms.retain_cpu_backup is False
    with pytest.raises(NotImplementedError):
        tms.memory_margin_bytes
    for bad in (-1, 1.5, True, 1 << 64):
        with pytest.raises(ValueError, match="byte count"):
            tms.memory_margin_bytes = bad


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "maybe")
    with pytest.raises(ValueError, match="TMS_RETAIN_CPU_BACKUP"):
        ours.TorchMemorySaver()._ensure_initialized()
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP")
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "tmpfs")
    with pytest.raises(ValueError, match="TMS_INIT_CPU_BACKUP_BACKEND"):
        ours.TorchMemorySaver()._ensure_initialized()
    monkeypatch.delenv("TMS_INIT_CPU_BACKUP_BACKEND")
    monkeypatch.setenv("SUBLET_TMS_BACKUP", "disk")
    with pytest.raises(ValueError, match="SUBLET_TMS_BACKUP.*'process'"):
        ours.TorchMemorySaver()._ensure_initialized()


def test_backup_arguments_are_checked_as_the_original(monkeypatch):
    tms = ours.TorchMemorySaver()
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with tms.region(cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError, match="mutually exclusive"):
        with tms.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(NotImplementedError, match="no disk backup: use .*enable_cpu_backup"):
        with tms.region(enable_disk_backup=True):
            pass
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: True)   # the original's test does so
    with pytest.raises(ValueError, match="not supported on XPU"):
        with tms.region(enable_cpu_backup=True, cpu_backup_backend="pinned"):
            pass


def test_set_disk_backup_dir_creates_it(tmp_path):
    tms = ours.TorchMemorySaver()
    tms.set_disk_backup_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


def test_pool_names_of_tags_never_collide():
    """region("x+backup") and region("x", enable_cpu_backup=True) were one sublet pool."""
    names = {}
    for tag in ("x", "x+backup", "x+graph", "x+graph+backup", "x+", "+", "++", "a+b"):
        for backup in (False, True):
            for graph in (False, True):
                name = _env.pool_name(tag, backup, graph)
                assert name not in names, f"{(tag, backup, graph)} and {names[name]}: {name}"
                names[name] = (tag, backup, graph)
    assert _env.pool_name("kv_cache", False, False) == "kv_cache"
    assert _env.pool_name("weights", True, False) == "weights+backup"


# --------------------------------------------------------------------- the hooks' stand-ins

def test_configure_subprocess_without_a_preload_library_changes_nothing(monkeypatch, tmp_path):
    """A sublet built without its preload library (none beside the package, none built)."""
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    monkeypatch.setenv("SUBLET_TMS_PRELOAD", str(tmp_path / "missing.so"))
    monkeypatch.setattr(utils, "__file__", str(tmp_path / "torch_memory_saver" / "utils.py"))
    with pytest.raises(utils.LibraryMissingError, match="SUBLET_TMS_PRELOAD"):
        utils.get_binary_path_from_package("torch_memory_saver_hook_mode_preload")
    before = dict(os.environ)
    with ours.configure_subprocess():
        assert dict(os.environ) == before
    assert dict(os.environ) == before


def test_configure_subprocess_prepends_a_preload_library_found_beside_the_package(
        monkeypatch, tmp_path):
    """As the original, wherever a library is found."""
    package = tmp_path / "torch_memory_saver"
    package.mkdir()
    major = utils._detect_cuda_major() if torch_cuda_known() else 12
    library = tmp_path / f"torch_memory_saver_hook_mode_preload_cu{major}.abi3.so"
    library.touch()
    monkeypatch.setattr(utils, "__file__", str(package / "utils.py"))
    monkeypatch.setattr(utils, "_detect_cuda_major", lambda: major)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with ours.configure_subprocess():
        assert os.environ["LD_PRELOAD"] == str(library)
    assert "LD_PRELOAD" not in os.environ


def torch_cuda_known() -> bool:
    import torch
    return bool(torch.version.cuda)


def test_the_hook_utils_say_what_they_are():
    from sublet.compat.torch_memory_saver.hooks import base, mode_preload, mode_torch
    assert isinstance(base.HookUtilBase.create("torch"), mode_torch.HookUtilModeTorch)
    assert base.HookUtilBase.create("torch").get_allocator() is None
    with pytest.raises(RuntimeError, match="invalid LD_PRELOAD"):
        mode_preload.HookUtilModePreload().get_path_binary()
