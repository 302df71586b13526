"""The first run on a new machine: the README's quickstart runs with or without a GPU (without
one, on the memfd backend with CPU tensors, and it says so), and when the user's daemon that
sublet starts on demand cannot start, its own words reach the exception; a build that lacks
libuv or jansson says which package to install."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import CHILD_ENV, REPO, stop_user_daemons

pytestmark = pytest.mark.daemon


def run_python(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("SUBLET_SOCKET", "SUBLET_BACKEND", "SUBLET_MEMFD_TOTAL")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=dict(environ, **CHILD_ENV, **env))


@pytest.fixture
def runtime_dir():
    """A runtime directory of its own: the user's daemon that the child starts there is not
    the test session's (which other tests expect as they made it), and is stopped at the end."""
    path = Path(tempfile.mkdtemp(prefix="sl-"))  # short: a socket path has 107 bytes at most
    yield str(path)
    stop_user_daemons(path / "sublet")
    shutil.rmtree(path, ignore_errors=True)


def mib_after(label: str, out: str) -> float:
    """The MiB an example printed after label ("moved on the device: 64.0 MiB")."""
    match = re.search(re.escape(label) + r" ([0-9.]+) MiB", out)
    assert match, (label, out)
    return float(match.group(1))


def test_quickstart_runs_on_this_machine(native, tmp_path, runtime_dir):
    import torch
    # The daemon it starts (memfd without a GPU) has 512 MiB: the work takes its free 256 MiB
    # and 192 MiB of the cache's pages, which hold kept bytes.
    r = run_python([str(REPO / "examples" / "quickstart.py"), "0.25"], tmp_path,
                   XDG_RUNTIME_DIR=runtime_dir, SUBLET_MEMFD_TOTAL="512M")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("data intact: True")
    moved = mib_after("moved on the device:", r.stdout)
    copied = mib_after("copied to the host and back:", r.stdout)
    if not torch.cuda.is_available():
        assert "no CUDA GPU here: running on sublet's memfd backend" in r.stdout
        # The loan reached kept pages: some kept bytes moved, some went to the host, and the
        # kept blocks compared equal (uint8: bit for bit) all the same.
        assert moved > 0 and copied > 0, r.stdout
        served_kept = re.search(r"([0-9.]+) MiB of pages that held kept bytes", r.stdout)
        assert served_kept and float(served_kept.group(1)) == 192, r.stdout


def test_import_sublet_loads_no_torch_and_sublet_empty_loads_what_lending_needs(tmp_path):
    # `sublet status` imports sublet without paying for torch; a process that makes sublet
    # memory lends it, and its first loan must not pay for importing the loan modules.
    r = run_python(["-c", "import sys, sublet; print('torch' in sys.modules); sublet.empty; "
                    "print(all(f'sublet.{m}' in sys.modules for m in "
                    "('_loan', '_keep', '_wait', '_torch')))"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True"]


def test_own_daemon_start_error_reaches_the_exception(native, tmp_path, runtime_dir):
    r = run_python(["-c", "import sublet; sublet.empty(4, device='cpu')"], tmp_path,
                   SUBLET_BACKEND="memfd", SUBLET_MEMFD_TOTAL="lots", XDG_RUNTIME_DIR=runtime_dir)
    assert r.returncode != 0
    assert "DaemonUnavailableError" in r.stderr
    # subletd's own message, read before its output was cleaned up.
    assert 'SUBLET_MEMFD_TOTAL="lots" is not a size: write it as 2M, 512K or 1G' in r.stderr


def configure_with_only(tmp_path, modules: list[str]) -> str:
    """CMake's error when pkg-config finds only these modules: its message, unwrapped."""
    if shutil.which("cmake") is None or shutil.which("pkg-config") is None:
        pytest.skip("cmake or pkg-config is not installed")
    pcdir = tmp_path / "pc-files"
    pcdir.mkdir()
    for module in modules:
        found = subprocess.run(["pkg-config", "--variable=pcfiledir", module],
                               capture_output=True, text=True).stdout.strip()
        (pcdir / f"{module}.pc").symlink_to(Path(found) / f"{module}.pc")
    r = subprocess.run(["cmake", "-S", str(REPO), "-B", str(tmp_path / "build")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PKG_CONFIG_LIBDIR=str(pcdir), PKG_CONFIG_PATH=""))
    assert r.returncode != 0
    return " ".join(r.stderr.split())  # CMake wraps its messages


def test_a_build_without_libuv_names_the_package(tmp_path):
    message = configure_with_only(tmp_path, [])
    assert "libuv not found" in message and "apt-get install libuv1-dev" in message


def test_a_build_without_jansson_names_the_package(tmp_path):
    message = configure_with_only(tmp_path, ["libuv", "libprotobuf-c"])
    assert "jansson not found" in message and "apt-get install libjansson-dev" in message
