"""What subletd does with what it finds at its socket path, and what a user who may not open a
daemon's socket is told (issue 24, items 1 and 2).

subletd replaces only a stale socket (nobody answers): a regular file or a directory at the
path stays, and so does a live daemon's socket ("another subletd is serving PATH"), each with
exit status 3. A user outside the socket's group (a real other user, nobody) is told
"permission denied on PATH: ask to be added to group G", by the C library, `sublet status`
(exit 5) and Python (DaemonPermissionError), and the on-demand start does not take the denied
socket for stale: no daemon of theirs starts beside it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CHILD_ENV
from test_daemon_cli import start

pytestmark = pytest.mark.daemon

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
EXIT_SOCKET_TAKEN = 3


def run_subletd(native, sock: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(native.subletd), "--backend", "memfd", "--socket", str(sock)],
                          capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M"))


def answers(path: Path) -> bool:
    from sublet import _lib
    try:
        _lib.Client.open(str(path)).close()
        return True
    except _lib.DaemonUnavailableError:
        return False


def wait_answering(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while not answers(path):
        assert proc.poll() is None, "subletd exited"
        assert time.monotonic() < deadline, f"nobody answered on {path} within 10 s"
        time.sleep(0.01)


def open_dir() -> Path:
    """A directory that everyone may enter (pytest's tmp_path is under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="sl-"))
    os.chmod(path, 0o755)
    return path


def test_a_regular_file_at_the_socket_path_survives(native, tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    r = run_subletd(native, victim)
    assert r.returncode == EXIT_SOCKET_TAKEN, r.stderr
    assert victim.read_text() == "precious\n"
    assert f"{victim} is a regular file" in r.stderr and "--socket" in r.stderr


def test_a_directory_at_the_socket_path_survives(native, tmp_path):
    (tmp_path / "d").mkdir()
    r = run_subletd(native, tmp_path / "d")
    assert r.returncode == EXIT_SOCKET_TAKEN, r.stderr
    assert (tmp_path / "d").is_dir() and "is a directory" in r.stderr


def test_a_live_daemons_socket_is_not_stolen(native, tmp_path):
    first = start(native, tmp_path)
    sock = tmp_path / "d.sock"
    try:
        assert answers(sock)
        inode = sock.stat().st_ino
        r = run_subletd(native, sock)
        assert r.returncode == EXIT_SOCKET_TAKEN, r.stderr
        assert f"another subletd is serving {sock}" in r.stderr
        assert sock.stat().st_ino == inode and answers(sock)
    finally:
        first.terminate()
        first.wait(timeout=10)


def test_a_stale_socket_is_replaced(native, tmp_path):
    sock = tmp_path / "d.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # bound, never listening, then closed: what a killed daemon leaves
    stale.close()
    assert not answers(sock)
    proc = start(native, tmp_path)  # waits for the path, which exists already
    try:
        wait_answering(sock, proc)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0


# --------------------------------------------------------------------------- another user


@pytest.fixture
def root_only_daemon(native):
    """A daemon of root's whose socket (0660, group root) nobody may open; its directory is
    open to all, so that the socket's mode alone keeps them out, as with /run/sublet."""
    directory = open_dir()
    proc = start(native, directory)
    sock = directory / "d.sock"
    wait_answering(sock, proc)
    yield sock
    proc.terminate()
    proc.wait(timeout=10)


def as_nobody(fn, *args) -> object:
    """fn(*args) run in a forked child that is the user nobody; its JSON-able result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(fn(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    return json.loads(out)


def open_denied(path: str) -> list:
    from sublet import _lib
    try:
        _lib.Client.open(path).close()
        return ["opened"]
    except _lib.SubletError as e:
        return [type(e).__name__, e.code_name, str(e),
                isinstance(e, _lib.DaemonUnavailableError)]


def test_the_library_says_permission_denied_and_names_the_group(root_only_daemon):
    kind, code, message, unavailable = as_nobody(open_denied, str(root_only_daemon))
    assert (kind, code, unavailable) == ("DaemonPermissionError", "EACCES", True)
    assert f"permission denied on {root_only_daemon}: ask to be added to group root" in message
    assert "start it" not in message and "SUBLET_SOCKET" not in message


def test_via_sublet_socket_the_fix_names_unsetting_it(root_only_daemon, monkeypatch):
    monkeypatch.setenv("SUBLET_SOCKET", str(root_only_daemon))
    _, code, message, _ = as_nobody(open_denied, str(root_only_daemon))
    assert code == "EACCES" and "unset SUBLET_SOCKET" in message


def test_sublet_status_says_permission_denied(root_only_daemon, native):
    home = Path(tempfile.mkdtemp(prefix="sl-"))
    os.chown(home, NOBODY, NOBODY)
    r = subprocess.run([*AS_NOBODY, sys.executable, "-m", "sublet", "status", "--socket",
                        str(root_only_daemon)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, **CHILD_ENV, HOME=str(home),
                                SUBLET_LIB=str(native.libsublet), XDG_RUNTIME_DIR=str(home)))
    assert r.returncode == 5, r.stderr
    assert f"permission denied on {root_only_daemon}: ask to be added to group root" in r.stderr
    assert "start it" not in r.stderr


def connect_beside(system_dir: str, runtime_dir: str) -> list:
    """As the user: sublet's connect for GPU 0 while a system daemon of that GPU (the memfd
    backend's UUID stands for it) refuses us. What it raised, and whether a daemon started."""
    from sublet import _daemon, _lib
    os.environ.update(XDG_RUNTIME_DIR=runtime_dir, HOME=runtime_dir)
    os.environ.pop("SUBLET_SOCKET", None)
    _daemon.SYSTEM_SOCKET_DIR = Path(system_dir)
    _daemon._cuda_uuid = lambda device: _daemon.device_uuid(device, "memfd")
    started = []
    _daemon._start = lambda *a: started.append(a) or _lib.Client.open("/nonexistent")
    try:
        _daemon.connect(0, "cuda").close()
        raised = ["nothing", ""]
    except _lib.SubletError as e:
        raised = [type(e).__name__, str(e)]
    return raised + [len(started)]


def test_no_daemon_starts_beside_a_denied_system_daemon(native):
    system = open_dir()
    proc = subprocess.Popen([str(native.subletd), "--backend", "memfd", "--socket",
                             str(system / "gpu0.sock")], stderr=subprocess.DEVNULL,
                            env=dict(os.environ, SUBLET_MEMFD_TOTAL="64M"))
    runtime = Path(tempfile.mkdtemp(prefix="sl-"))
    os.chown(runtime, NOBODY, NOBODY)
    try:
        wait_answering(system / "gpu0.sock", proc)
        kind, message, started = as_nobody(connect_beside, str(system), str(runtime))
        assert (kind, started) == ("DaemonPermissionError", 0), message
        assert f"permission denied on {system / 'gpu0.sock'}" in message
        assert "starts no daemon of yours" in message
        assert not list(runtime.glob("sublet/*.sock"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
