"""`python -m sublet.compat install|uninstall|check torch_memory_saver`: the drop-in as a
distribution pip sees (its .dist-info, RECORD, version), its removal by pip or by sublet.compat
leaving nothing behind, the refusal over the real package and --force (pip itself uninstalls
the real one), and what a later `pip install torch_memory_saver` does over it. Offline: the
"real" packages are made here (a .dist-info with a RECORD, or a wheel for pip to install).
No GPU, no daemon; the pip tests make a venv (a few seconds).
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from sublet.compat import _install_tms
from sublet.compat.__main__ import MARKER, main as compat_main

from conftest import CHILD_ENV, REPO

NAME = "torch_memory_saver"
SGLANG_NEEDS = SpecifierSet(">=0.0.9.post1")   # sglang 0.5.23's Requires-Dist


def child(code: str, path: Path | None = None, python: str = sys.executable,
          args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, **CHILD_ENV}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), env.get("PYTHONPATH")]))
    command = [python, *args] if args else [python, "-c", code]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                          cwd=path or REPO)


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def fake_real(target: Path, version: str = "0.0.10") -> None:
    """A torch_memory_saver as pip leaves it: the package, a library beside it, a .dist-info
    whose RECORD lists them (INSTALLER pip)."""
    files = {f"{NAME}/__init__.py": "REAL = True\n", f"{NAME}/utils.py": "\n",
             f"{NAME}_hook_mode_preload_cu12.abi3.so": "not a library\n"}
    info = f"{NAME}-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n"
    files[f"{info}/INSTALLER"] = "pip\n"
    rows = []
    for relative, text in files.items():
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_text(text)
        rows.append(f"{relative},sha256={digest(text.encode())},{len(text)}")
    (target / info / "RECORD").write_text("\n".join(rows + [f"{info}/RECORD,,"]) + "\n")


def test_version_meets_sglangs_requirement_and_says_sublet():
    version = Version(_install_tms.version())
    assert version in SGLANG_NEEDS and version.public == "0.0.10"
    assert version.local.startswith("sublet")
    assert version not in SpecifierSet("==0.0.8")     # sglang[all]'s pin: see the docs


def test_install_writes_a_distribution_whose_record_lists_every_file(tmp_path):
    assert compat_main(["install", NAME, "--target", str(tmp_path)]) == 0
    assert MARKER in (tmp_path / NAME / "__init__.py").read_text()
    (dist_info,) = tmp_path.glob(f"{NAME}-*.dist-info")
    assert (dist_info / "INSTALLER").read_text() == "sublet\n"
    rows = [line.rsplit(",", 2) for line in (dist_info / "RECORD").read_text().splitlines()]
    assert {row[0] for row in rows} == files_under(tmp_path)
    for path, hashed, size in rows:
        data = (tmp_path / path).read_bytes()
        if path.endswith("RECORD"):
            assert (hashed, size) == ("", "")
        else:
            assert (hashed, int(size)) == (f"sha256={digest(data)}", len(data)), path


def test_installed_it_imports_as_the_original_and_metadata_answers(tmp_path):
    compat_main(["install", NAME, "--target", str(tmp_path)])
    out = child(f"""
import importlib.metadata, torch_memory_saver as t
from packaging.specifiers import SpecifierSet
from torch_memory_saver import torch_memory_saver as s, configure_subprocess
import torch_memory_saver.hooks.mode_preload as mp, torch_memory_saver.entrypoint as e
from torch_memory_saver.utils import get_binary_path_from_package, _detect_cuda_major
from torch_memory_saver.testing_utils import get_and_print_gpu_memory
from torch_memory_saver.binary_wrapper import BinaryWrapper
from sublet.compat import torch_memory_saver as ours
assert t is ours and s is ours.torch_memory_saver and e.TorchMemorySaver is ours.TorchMemorySaver
assert mp.configure_subprocess is configure_subprocess is ours.configure_subprocess
assert mp.HookUtilModePreload is ours.hooks.mode_preload.HookUtilModePreload
v = importlib.metadata.version("{NAME}")
assert v in SpecifierSet(">=0.0.9.post1"), v
print(v)""", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _install_tms.version()


def test_uninstall_removes_exactly_what_install_wrote(tmp_path):
    (tmp_path / "other.py").write_text("")
    compat_main(["install", NAME, "--target", str(tmp_path)])
    assert child(f"import {NAME}", tmp_path).returncode == 0   # leaves __pycache__
    assert compat_main(["uninstall", NAME, "--target", str(tmp_path)]) == 0
    assert files_under(tmp_path) == {"other.py"}
    assert {p.name for p in tmp_path.iterdir()} == {"other.py"}
    with pytest.raises(SystemExit, match="nothing to uninstall"):
        compat_main(["uninstall", NAME, "--target", str(tmp_path)])


def test_install_again_replaces_its_own(tmp_path):
    compat_main(["install", NAME, "--target", str(tmp_path)])
    before = files_under(tmp_path)
    assert compat_main(["install", NAME, "--target", str(tmp_path)]) == 0
    assert files_under(tmp_path) == before


def test_install_refuses_over_the_real_package_saying_what_to_do(tmp_path):
    fake_real(tmp_path)
    before = files_under(tmp_path)
    with pytest.raises(SystemExit) as refused:
        compat_main(["install", NAME, "--target", str(tmp_path)])
    message = str(refused.value)
    assert "the real torch_memory_saver 0.0.10 is installed" in message
    assert "-m pip uninstall torch_memory_saver" in message and "--force" in message
    assert files_under(tmp_path) == before
    with pytest.raises(SystemExit, match="is the real one"):
        compat_main(["uninstall", NAME, "--target", str(tmp_path)])


def test_force_in_a_target_dir_uninstalls_the_real_one_by_its_record(tmp_path):
    """No pip manages a --target directory: its RECORD is followed, as pip would."""
    fake_real(tmp_path)
    assert compat_main(["install", NAME, "--target", str(tmp_path), "--force"]) == 0
    assert not list(tmp_path.glob("*.so")) and not (tmp_path / NAME / "utils.py").exists()
    (dist_info,) = tmp_path.glob(f"{NAME}-*.dist-info")
    assert "+sublet" in dist_info.name
    compat_main(["uninstall", NAME, "--target", str(tmp_path)])
    assert files_under(tmp_path) == set()


def test_a_package_no_distribution_owns_is_refused(tmp_path):
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "__init__.py").write_text("")
    with pytest.raises(SystemExit, match="no distribution owns"):
        compat_main(["install", NAME, "--target", str(tmp_path), "--force"])


def test_check_says_what_holds_the_name(tmp_path, capsys):
    def check() -> tuple[int, str]:
        rc = compat_main(["check", NAME, "--target", str(tmp_path)])
        return rc, capsys.readouterr().out
    rc, out = check()
    assert rc == 1 and "not installed" in out
    compat_main(["install", NAME, "--target", str(tmp_path)])
    capsys.readouterr()
    rc, out = check()
    assert rc == 0 and f"sublet's drop-in {_install_tms.version()}" in out
    fake_real(tmp_path, "0.0.8")           # pip install --target over it: both registered
    rc, out = check()
    assert rc == 1 and "written over" in out and "--force" in out
    with pytest.raises(SystemExit, match="written over"):
        compat_main(["install", NAME, "--target", str(tmp_path)])
    assert compat_main(["install", NAME, "--target", str(tmp_path), "--force"]) == 0
    capsys.readouterr()
    assert check()[0] == 0


def test_list_names_the_drop_in_and_its_state():
    out = child("", args=("-m", "sublet.compat", "list"))
    assert out.returncode == 0, out.stderr
    assert "torch_memory_saver: sublet.compat.torch_memory_saver (" in out.stdout


# --------------------------------------------------------------------------- pip itself

@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv with pip of its own, seeing what this process imports (torch, sublet: a .pth of
    this sys.path) below its own site-packages, wherever this Python is a venv itself."""
    where = tmp_path_factory.mktemp("venv")
    made = subprocess.run([sys.executable, "-m", "venv", str(where)], capture_output=True,
                          text=True, timeout=300)
    if made.returncode != 0:
        pytest.skip(f"no venv with pip here: {made.stderr.strip()[-300:]}")
    outer = [p for p in sys.path if p and Path(p).is_dir()]
    (venv_site(where) / "outer.pth").write_text("\n".join(outer) + "\n")
    return where


def venv_site(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


def run_in(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return child("", python=str(venv / "bin" / "python"), args=args)


def fake_wheel(where: Path, version: str) -> Path:
    """A torch_memory_saver wheel of that version, for pip to install offline."""
    wheel = where / f"{NAME}-{version}-py3-none-any.whl"
    info = f"{NAME}-{version}.dist-info"
    files = {f"{NAME}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    rows = [f"{p},sha256={digest(t.encode())},{len(t.encode())}" for p, t in files.items()]
    files[f"{info}/RECORD"] = "\n".join(rows + [f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def test_pip_sees_the_drop_in_and_pip_uninstall_removes_exactly_it(venv):
    site = venv_site(venv)
    before = files_under(site)
    out = run_in(venv, "-m", "sublet.compat", "install", NAME)
    assert out.returncode == 0, out.stderr
    listed = run_in(venv, "-m", "pip", "list", "--path", str(site), "--format", "freeze")
    assert f"{NAME}=={_install_tms.version()}" in listed.stdout, listed.stdout + listed.stderr
    assert run_in(venv, "-c", f"import {NAME}").returncode == 0   # leaves __pycache__
    gone = run_in(venv, "-m", "pip", "uninstall", "-y", NAME)
    assert gone.returncode == 0 and "Successfully uninstalled" in gone.stdout, gone.stderr
    assert files_under(site) == before


def test_force_uninstalls_the_real_one_through_pip(venv):
    site = venv_site(venv)
    before = files_under(site)
    fake_real(site)
    refused = run_in(venv, "-m", "sublet.compat", "install", NAME)
    assert refused.returncode != 0 and "--force" in refused.stderr
    out = run_in(venv, "-m", "sublet.compat", "install", NAME, "--force")
    assert out.returncode == 0, out.stderr
    assert "the real torch_memory_saver 0.0.10 uninstalled" in out.stdout
    assert not (site / f"{NAME}_hook_mode_preload_cu12.abi3.so").exists()
    assert run_in(venv, "-m", "sublet.compat", "check", NAME).returncode == 0
    # pip uninstall after --force: it removes sublet's drop-in, and nothing of the real one is
    # left behind anywhere (no copy set aside, such as an old *.sublet-saved, to strand).
    gone = run_in(venv, "-m", "pip", "uninstall", "-y", NAME)
    assert gone.returncode == 0 and "Successfully uninstalled" in gone.stdout, gone.stderr
    assert files_under(site) == before
    assert not list(venv.rglob("*sublet-saved*"))
    listed = run_in(venv, "-m", "pip", "list", "--path", str(site), "--format", "freeze")
    assert f"{NAME}==" not in listed.stdout


def test_pip_install_over_the_drop_in(venv, tmp_path):
    """What the docs say: an unpinned `pip install torch_memory_saver` keeps the drop-in
    (its version meets it); a pin it does not meet (sglang[all]'s ==0.0.8) makes pip replace
    it, cleanly (its RECORD), and check says so."""
    fake_wheel(tmp_path, "0.0.8")
    assert run_in(venv, "-m", "sublet.compat", "install", NAME).returncode == 0
    pip = ("-m", "pip", "install", "--no-index", "--find-links", str(tmp_path))
    kept = run_in(venv, *pip, NAME)
    assert kept.returncode == 0 and "already satisfied" in kept.stdout, kept.stderr
    assert run_in(venv, "-m", "sublet.compat", "check", NAME).returncode == 0
    replaced = run_in(venv, *pip, f"{NAME}==0.0.8")
    assert replaced.returncode == 0, replaced.stderr
    # pip says so (docs/compat-torch-memory-saver.md quotes it)
    assert f"Successfully uninstalled {NAME}-{_install_tms.version()}" in replaced.stdout
    check = run_in(venv, "-m", "sublet.compat", "check", NAME)
    assert check.returncode == 1 and "the real torch_memory_saver 0.0.8" in check.stdout
    assert not (venv_site(venv) / NAME / "__init__.py").read_text().count(MARKER)
    assert run_in(venv, "-m", "sublet.compat", "install", NAME, "--force").returncode == 0
    assert run_in(venv, "-m", "sublet.compat", "check", NAME).returncode == 0
    assert run_in(venv, "-m", "pip", "uninstall", "-y", NAME).returncode == 0


def test_pip_install_ignore_installed_over_the_drop_in_is_detected(venv, tmp_path):
    """pip cannot be kept from writing over the drop-in's files (--ignore-installed installs
    without uninstalling, saying nothing of it): check detects it and says what to do, and
    install --force clears both distributions and puts sublet's back."""
    fake_wheel(tmp_path, "0.0.8")
    assert run_in(venv, "-m", "sublet.compat", "install", NAME).returncode == 0
    over = run_in(venv, "-m", "pip", "install", "--no-index", "--find-links", str(tmp_path),
                  "--ignore-installed", NAME)
    assert over.returncode == 0, over.stderr
    check = run_in(venv, "-m", "sublet.compat", "check", NAME)
    assert check.returncode == 1 and "was written over by another install" in check.stdout
    assert run_in(venv, "-m", "sublet.compat", "install", NAME, "--force").returncode == 0
    assert run_in(venv, "-m", "sublet.compat", "check", NAME).returncode == 0
    assert run_in(venv, "-m", "pip", "uninstall", "-y", NAME).returncode == 0
