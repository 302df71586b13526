"""sublet.compat.torch_memory_saver's shape against the real torch_memory_saver 0.0.10 (its
public names and the signatures of what code calls), the parts of its facade that need no
daemon (hook_mode, memory_margin_bytes, env parsing), and `python -m sublet.compat install`
into a temporary directory. No GPU, no daemon.

The real package is compared when it is importable (CI installs it from PyPI; here
`pip install --no-deps --target DIR torch_memory_saver==0.0.10` and TMS_REAL_PATH=DIR also
works); those tests skip, saying so, when it is not.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sublet.compat import torch_memory_saver as ours
from sublet.compat.__main__ import MARKER, main as compat_main

from conftest import CHILD_ENV, REPO


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
        our_params = list(inspect.signature(getattr(ours._TorchMemorySaverImpl,
                                                    name)).parameters)
        assert our_params[:len(real_params)] == real_params, name


# --------------------------------------------------------------------- the facade alone

def test_lazy_init_and_hook_mode_as_the_original():
    tms = ours.TorchMemorySaver()
    assert tms._impl is None and tms._impl_ctor_kwargs == {}
    tms.hook_mode = "torch"                        # accepted, ignored
    with pytest.raises(AttributeError):
        tms.hook_mode
    with pytest.raises(ValueError, match="preload"):
        tms.hook_mode = "gms"
    assert tms.enabled is True
    tms._ensure_initialized()
    assert tms._impl is not None and not hasattr(tms, "_impl_ctor_kwargs")
    with pytest.raises(AttributeError, match="before the first use"):
        tms.hook_mode = "preload"


def test_memory_margin_and_retain_cpu_backup(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "yes")
    tms = ours.TorchMemorySaver()
    assert tms.retain_cpu_backup is True
    tms.retain_cpu_backup = False
    assert tms.retain_cpu_backup is False
    with pytest.raises(NotImplementedError):
        tms.memory_margin_bytes
    with pytest.warns(RuntimeWarning, match="not enforced"):
        ours._warned.discard("margin")
        tms.memory_margin_bytes = 1 << 20
    assert tms._impl.memory_margin_bytes == 1 << 20


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "maybe")
    with pytest.raises(ValueError, match="TMS_RETAIN_CPU_BACKUP"):
        ours.TorchMemorySaver()._ensure_initialized()
    monkeypatch.delenv("TMS_RETAIN_CPU_BACKUP")
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "tmpfs")
    with pytest.raises(ValueError, match="TMS_INIT_CPU_BACKUP_BACKEND"):
        ours.TorchMemorySaver()._ensure_initialized()


def test_backup_arguments_are_checked_as_the_original():
    tms = ours.TorchMemorySaver()
    with pytest.raises(ValueError, match="requires enable_cpu_backup"):
        with tms.region(cpu_backup_backend="mmap"):
            pass
    with pytest.raises(ValueError, match="mutually exclusive"):
        with tms.region(enable_cpu_backup=True, enable_disk_backup=True):
            pass
    with pytest.raises(NotImplementedError, match="no disk backup"):
        with tms.region(enable_disk_backup=True):
            pass


def test_set_disk_backup_dir_creates_it(tmp_path):
    tms = ours.TorchMemorySaver()
    tms.set_disk_backup_dir(str(tmp_path / "a" / "b"))
    assert (tmp_path / "a" / "b").is_dir()


def test_configure_subprocess_changes_nothing():
    before = dict(os.environ)
    with ours.configure_subprocess():
        assert dict(os.environ) == before
    assert dict(os.environ) == before


# --------------------------------------------------------------------- the installer

def _run_python(code: str, path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, cwd=path)


def test_install_makes_import_torch_memory_saver_give_sublets(tmp_path, capsys):
    assert compat_main(["install", "torch_memory_saver", "--target", str(tmp_path)]) == 0
    assert MARKER in (tmp_path / "torch_memory_saver" / "__init__.py").read_text()
    out = _run_python(
        "import torch_memory_saver as t\n"
        "from torch_memory_saver import torch_memory_saver as s\n"
        "from torch_memory_saver.testing_utils import get_and_print_gpu_memory\n"
        "import torch_memory_saver.entrypoint as e\n"
        "from sublet.compat import torch_memory_saver as ours\n"
        "assert t is ours and s is ours.torch_memory_saver\n"
        "assert e.TorchMemorySaver is ours.TorchMemorySaver\n"
        "print('ok')", tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert compat_main(["install", "torch_memory_saver", "--target", str(tmp_path)]) == 0
    assert compat_main(["uninstall", "torch_memory_saver", "--target", str(tmp_path)]) == 0
    assert not (tmp_path / "torch_memory_saver").exists()
    with pytest.raises(SystemExit, match="nothing to uninstall"):
        compat_main(["uninstall", "torch_memory_saver", "--target", str(tmp_path)])


def test_install_refuses_over_the_real_package_unless_forced(tmp_path):
    real = tmp_path / "torch_memory_saver"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    with pytest.raises(SystemExit, match="the real torch_memory_saver is installed"):
        compat_main(["install", "torch_memory_saver", "--target", str(tmp_path)])
    assert (real / "__init__.py").read_text() == "REAL = True\n"
    assert compat_main(["install", "torch_memory_saver", "--target", str(tmp_path),
                        "--force"]) == 0
    assert MARKER in (real / "__init__.py").read_text()
    assert (tmp_path / "torch_memory_saver.sublet-saved" / "__init__.py").is_file()
    assert compat_main(["uninstall", "torch_memory_saver", "--target", str(tmp_path)]) == 0
    assert (real / "__init__.py").read_text() == "REAL = True\n"


def test_install_refuses_unknown_names(tmp_path):
    with pytest.raises(SystemExit, match="no drop-in named"):
        compat_main(["install", "numpy", "--target", str(tmp_path)])


def test_cli_as_a_module(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sublet.compat", "list"], capture_output=True,
                         text=True, env={**os.environ, **CHILD_ENV}, cwd=REPO, timeout=120)
    assert out.returncode == 0 and "torch_memory_saver: sublet.compat.torch_memory_saver" \
        in out.stdout, out.stderr
