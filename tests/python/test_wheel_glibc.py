"""The installed wheel runs on the glibc it claims (tests/wheel installs it and runs this).

manylinux_2_28 is the floor PyTorch ships (RHEL 8, Ubuntu 20.04): every ELF file the wheel
carries (subletd, libsublet.so, and the libraries auditwheel copied in) must ask for no glibc
symbol version above 2.28, read with objdump -T from the installed files, and the wheel's tag
must say so. The `subletd` console script runs the bundled daemon by name.

Outside tests/wheel (SUBLET_TEST_INSTALLED unset) the files checked are a checkout's build,
made with the system's compiler for the system's glibc: those tests skip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from conftest import INSTALLED

FLOOR = (2, 28)
installed_only = pytest.mark.skipif(not INSTALLED, reason="checks the installed wheel: "
                                    "tests/wheel runs it (SUBLET_TEST_INSTALLED=1)")


def glibc_versions(path: Path) -> dict[tuple[int, int], set[str]]:
    """The GLIBC_x.y versions the dynamic symbols of an ELF file ask for, with the symbols."""
    out = subprocess.run(["objdump", "-T", str(path)], capture_output=True, text=True,
                         check=True).stdout
    found: dict[tuple[int, int], set[str]] = {}
    for line in out.splitlines():
        m = re.search(r"\bGLIBC_(\d+)\.(\d+)(?:\.\d+)?\)?\s+(\S+)$", line)
        if m and "*UND*" in line:
            found.setdefault((int(m.group(1)), int(m.group(2))), set()).add(m.group(3))
    return found


def elf_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]


def wheel_files() -> list[Path]:
    """The installed package's ELF files and those of its sublet.libs (auditwheel's)."""
    import sublet
    package = Path(sublet.__file__).parent
    return elf_files(package) + elf_files(package.parent / "sublet.libs")


def test_glibc_versions_are_read_from_a_real_binary():
    # The reader itself, on this machine's Python: it finds the versions it asks for.
    versions = glibc_versions(Path(os.path.realpath(sys.executable)))
    assert versions and min(versions) >= (2, 2)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
@installed_only
def test_every_binary_of_the_wheel_needs_glibc_2_28_at_most():
    files = wheel_files()
    names = {p.name for p in files}
    assert {"subletd", "libsublet.so"} <= names, names
    assert any(n.startswith("libuv") for n in names), names  # copied in by auditwheel
    too_new = {}
    for path in files:
        for version, symbols in glibc_versions(path).items():
            if version > FLOOR:
                too_new[f"{path.name}: GLIBC_{version[0]}.{version[1]}"] = sorted(symbols)
    assert too_new == {}, f"symbols newer than glibc {FLOOR[0]}.{FLOOR[1]}: {too_new}"


@installed_only
def test_the_wheel_is_tagged_manylinux_2_28():
    wheel = metadata.distribution("sublet").read_text("WHEEL") or ""
    tags = re.findall(r"^Tag: (\S+)$", wheel, re.M)
    assert tags == ["py3-none-manylinux_2_28_x86_64"], wheel


@installed_only
def test_subletd_runs_by_name():
    """The console script beside the venv's python runs the bundled daemon."""
    script = Path(sys.executable).parent / "subletd"
    assert script.is_file(), f"no subletd command in {script.parent}"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("subletd "), out
    import sublet
    assert sublet.__version__ in out.stdout


def test_subletd_module_runs_the_package_daemon(native):
    """python -m sublet._subletd (what the console script calls) from a checkout runs the
    build's daemon; from the wheel, the bundled one."""
    from sublet import _subletd
    try:
        _subletd.binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    env = dict(os.environ, SUBLETD="/nonexistent/subletd")  # never $SUBLETD: it may be us
    from conftest import CHILD_ENV
    env.update(CHILD_ENV)
    out = subprocess.run([sys.executable, "-m", "sublet._subletd", "--help"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--pin" in out.stdout, out
