"""What subletd does with what it finds at its paths, and what a user who may not open a
daemon's socket is told (issue 24, items 1 and 2; issue 25, item 13).

subletd replaces only a stale socket (nobody answers): a regular file or a directory at the
path stays, and so does a live daemon's socket ("another subletd is serving PATH"), each with
exit status 3. A user outside the socket's group (a real other user, nobody) is told
"permission denied on PATH: ask to be added to group G", by the C library, `sublet status`
(exit 5) and Python (DaemonPermissionError), and the on-demand start does not take the denied
socket for stale: no daemon of theirs starts beside it. The same holds for one user whose own
daemon's socket or directory a chmod shut them out of (told to chmod it back): that is the
case a test run by one user makes for real, as that user when not root, else as nobody.

--pid-file is written once the daemon holds its socket and removed on every clean exit
(SIGTERM, an idle exit); a start refused at the socket leaves the live daemon's file alone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import CHILD_ENV
from test_daemon_cli import start
from test_user_daemon import subletd_pids

pytestmark = pytest.mark.daemon

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
EXIT_SOCKET_TAKEN = 3
ROOT = os.geteuid() == 0
# The other-user tests become nobody, which only root can do; the one-user tests below run as
# any user (as nobody under root, whom no mode keeps out).
needs_root = pytest.mark.skipif(not ROOT, reason="runs as the real user nobody: needs root "
                                "(the chmod tests cover one user)")


def run_subletd(native, sock: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(native.subletd), "--backend", "memfd", "--socket", str(sock),
                           *args], capture_output=True, text=True, timeout=30,
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


def test_a_killed_daemons_socket_is_replaced(native, tmp_path):
    first = start(native, tmp_path)
    sock = tmp_path / "d.sock"
    wait_answering(sock, first)
    first.kill()  # SIGKILL: no cleanup, the socket file stays, nobody listens on it
    first.wait(timeout=10)
    assert sock.exists() and not answers(sock)
    second = start(native, tmp_path)
    try:
        wait_answering(sock, second)
    finally:
        second.terminate()
        second.wait(timeout=10)
    assert second.returncode == 0


# --------------------------------------------------------------------------- the pid file


def pid_daemon(native, tmp_path, *args: str) -> tuple[subprocess.Popen, Path]:
    proc = start(native, tmp_path, "--pid-file", str(tmp_path / "d.pid"), *args)
    wait_answering(tmp_path / "d.sock", proc)
    return proc, tmp_path / "d.pid"


def test_the_pid_file_goes_at_sigterm(native, tmp_path):
    proc, pid_file = pid_daemon(native, tmp_path)
    assert pid_file.read_text() == f"{proc.pid}\n"
    proc.terminate()
    proc.wait(timeout=10)
    assert proc.returncode == 0
    assert not pid_file.exists() and not (tmp_path / "d.sock").exists()


def test_the_pid_file_goes_at_an_idle_exit(native, tmp_path):
    proc, pid_file = pid_daemon(native, tmp_path, "--idle-exit", "0.2")
    assert pid_file.read_text() == f"{proc.pid}\n"
    assert proc.wait(timeout=10) == 0
    assert not pid_file.exists()


def test_a_refused_start_leaves_the_live_daemons_pid_file(native, tmp_path):
    proc, pid_file = pid_daemon(native, tmp_path)
    try:
        r = run_subletd(native, tmp_path / "d.sock", "--pid-file", str(pid_file))
        assert r.returncode == EXIT_SOCKET_TAKEN, r.stderr
        assert pid_file.read_text() == f"{proc.pid}\n"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert not pid_file.exists()


def test_a_killed_daemons_pid_file_is_replaced(native, tmp_path):
    first, pid_file = pid_daemon(native, tmp_path)
    first.kill()
    first.wait(timeout=10)
    assert pid_file.read_text() == f"{first.pid}\n"  # SIGKILL: nothing runs to remove it
    second, _ = pid_daemon(native, tmp_path)
    try:
        assert pid_file.read_text() == f"{second.pid}\n"
    finally:
        second.terminate()
        second.wait(timeout=10)
    assert not pid_file.exists()


def test_an_unwritable_pid_file_fails_the_start_and_says_why(native, tmp_path):
    r = run_subletd(native, tmp_path / "d.sock", "--pid-file", str(tmp_path / "no" / "d.pid"))
    assert r.returncode == 1
    assert f"cannot write the pid file {tmp_path / 'no' / 'd.pid'}" in r.stderr, r.stderr
    assert not (tmp_path / "d.sock").exists()  # the socket it had bound goes with it


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
    return in_child(fn, *args, uid=NOBODY)


def in_child(fn, *args, uid: int | None) -> object:
    """fn(*args) run in a forked child, as uid when given; its JSON-able result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
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


@needs_root
def test_the_library_says_permission_denied_and_names_the_group(root_only_daemon):
    kind, code, message, unavailable = as_nobody(open_denied, str(root_only_daemon))
    assert (kind, code, unavailable) == ("DaemonPermissionError", "EACCES", True)
    assert f"permission denied on {root_only_daemon}: ask to be added to group root" in message
    assert "start it" not in message and "SUBLET_SOCKET" not in message


@needs_root
def test_via_sublet_socket_the_fix_names_unsetting_it(root_only_daemon, monkeypatch):
    monkeypatch.setenv("SUBLET_SOCKET", str(root_only_daemon))
    _, code, message, _ = as_nobody(open_denied, str(root_only_daemon))
    assert code == "EACCES" and "unset SUBLET_SOCKET" in message


@needs_root
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


@needs_root
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


# --------------------------------------------------------------------------- one user, chmod


def one_user_dir() -> tuple[Path, int | None]:
    """A runtime directory of the user the chmod tests run as, and that user's uid to become
    (None: this one). Root passes every mode check, so under root they run as nobody."""
    path = Path(tempfile.mkdtemp(prefix="sl-"))  # short: socket paths are 107 bytes at most
    if not ROOT:
        return path, None
    os.chown(path, NOBODY, NOBODY)
    return path, NOBODY


def shut_out_of_own_daemon(runtime_dir: str, what: str) -> list:
    """As the user: their own memfd daemon is started on demand, then a chmod 000 of its socket
    (what='socket') or of its directory ('directory') shuts them out, and they connect again
    the ways sublet offers. What each raised (type and message), then the first daemon's pid."""
    from sublet import _daemon, _lib
    os.environ.update(XDG_RUNTIME_DIR=runtime_dir, HOME=runtime_dir, SUBLET_IDLE_EXIT="60")
    os.environ.pop("SUBLET_SOCKET", None)
    first = _daemon.connect(0, "memfd")
    sock = Path(first.path)
    pid = int(sock.with_suffix(".pid").read_text())
    first.close()
    target = sock if what == "socket" else sock.parent
    mode = target.stat().st_mode
    os.chmod(target, 0)
    try:
        on_demand = attempt(lambda: _daemon.connect(0, "memfd").close())
        os.environ["SUBLET_SOCKET"] = str(sock)
        via_env = attempt(lambda: _daemon.connect(0, "memfd").close())
    finally:
        os.chmod(target, mode)
    return on_demand + via_env + [pid]


def attempt(fn) -> list:
    try:
        fn()
        return ["nothing", ""]
    except (OSError, Exception) as e:  # what a user would see, whatever it is
        return [type(e).__name__, str(e)]


@pytest.mark.parametrize("what", ["socket", "directory"])
def test_a_chmod_shut_out_of_ones_own_daemon_starts_no_second(native, what):
    runtime, uid = one_user_dir()
    try:
        kind, message, env_kind, env_message, pid = in_child(
            shut_out_of_own_daemon, str(runtime), what, uid=uid)
        serving = subletd_pids(runtime)
        assert serving == [pid], f"daemons serving {runtime}: {serving} (the first: {pid})"
        sock = next((runtime / "sublet").glob("*.sock"))
        assert (kind, env_kind) == ("DaemonPermissionError",) * 2, (message, env_message)
        assert "start it" not in message and "stale" not in message
        if what == "socket":
            assert f"permission denied on {sock}: the socket is yours, but its mode 0000 " \
                   f"shuts you out; chmod u+rw {sock}" in message
        else:
            assert f"permission denied on {sock}: its directory {sock.parent} is yours, but " \
                   f"its mode 0000 shuts you out; chmod u+rwx {sock.parent}" in message
        assert "unset SUBLET_SOCKET" in env_message and "unset" not in message
        from sublet import _lib
        _lib.Client.open(str(sock)).close()  # the mode back, the first daemon serves again
    finally:
        for daemon in subletd_pids(runtime):
            os.kill(daemon, signal.SIGTERM)
