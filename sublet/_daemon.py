"""Finding subletd for a device, or starting a private one for this process.

Order: $SUBLET_SOCKET when set (used as is); else a system daemon under /run/sublet/ serving
this GPU (cuda backend only); else a private subletd, started once per device for this process
and stopped at interpreter exit. The private daemon also watches our pid (--parent-pid), so it
goes away even when we are killed.

A system daemon's socket is named by the daemon's device number (gpuN.sock), which is not ours
when CUDA_VISIBLE_DEVICES differs: the daemon's GPU UUID decides, gpuN.sock being tried first.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import _lib
from ._lib import DaemonUnavailableError

SYSTEM_SOCKET_DIR = Path("/run/sublet")
START_TIMEOUT_S = float(os.environ.get("SUBLET_DAEMON_START_TIMEOUT", "30"))


def requested_backend() -> str:
    """'memfd' when $SUBLET_BACKEND says so or there is no usable GPU, else 'cuda'."""
    backend = os.environ.get("SUBLET_BACKEND")
    if backend:
        if backend not in ("cuda", "memfd"):
            raise ValueError(f"SUBLET_BACKEND={backend!r}: use 'cuda' or 'memfd'")
        return backend
    import torch
    return "cuda" if torch.cuda.is_available() else "memfd"


def connect(device: int, backend: str) -> ctypes.c_void_p:
    """A connected sublet_client for the daemon of this device index."""
    explicit = os.environ.get("SUBLET_SOCKET")
    if explicit:
        return _connect(explicit)
    if backend == "cuda":
        client = _system_daemon(device)
        if client is not None:
            return client
    return _connect(_private_daemon(device, backend).socket)


def _system_daemon(device: int) -> ctypes.c_void_p | None:
    """A connection to the system daemon serving this process's CUDA device `device`."""
    ours = SYSTEM_SOCKET_DIR / f"gpu{device}.sock"
    uuid = _cuda_uuid(device)
    # Without our GPU's UUID only gpuN.sock can be trusted to be it.
    others = sorted(SYSTEM_SOCKET_DIR.glob("gpu*.sock")) if uuid is not None else []
    for path in [ours] + [p for p in others if p != ours]:
        if not path.exists():
            continue
        try:
            client = _connect(str(path))
        except DaemonUnavailableError:
            continue  # a stale socket
        if uuid is None or _daemon_uuid(client) == uuid:
            return client
        _lib.lib().sublet_disconnect(client)
    return None


def _cuda_uuid(device: int) -> bytes | None:
    """The 16-byte UUID of this process's CUDA device, or None when torch cannot say."""
    try:
        import torch
        return bytes(torch.cuda.get_device_properties(device).uuid.bytes)
    except (AttributeError, RuntimeError, TypeError, ValueError, AssertionError):
        return None


def _daemon_uuid(client: ctypes.c_void_p) -> bytes:
    info = _lib.Info()
    _lib.check(_lib.lib().sublet_get_info(client, ctypes.byref(info)))
    return bytes(info.device_uuid)


def _connect(path: str) -> ctypes.c_void_p:
    client = ctypes.c_void_p()
    _lib.check(_lib.lib().sublet_connect(path.encode(), ctypes.byref(client)))
    return client


# --------------------------------------------------------------------------- private daemons

@dataclass
class PrivateDaemon:
    process: subprocess.Popen
    socket: str
    workdir: str
    creator_pid: int

    def stderr_tail(self, limit: int = 4000) -> str:
        try:
            return Path(self.workdir, "subletd.log").read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not gone within 5 s; removes its directory."""
        if os.getpid() != self.creator_pid:
            return  # a forked child: the daemon is its parent's
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


_private: dict[tuple[str, int], PrivateDaemon] = {}
_private_lock = threading.Lock()


def _private_daemon(device: int, backend: str) -> PrivateDaemon:
    with _private_lock:
        key = (backend, device)
        daemon = _private.get(key)
        if daemon is None or daemon.process.poll() is not None:
            daemon = _private[key] = _start(device, backend)
        return daemon


def _start(device: int, backend: str) -> PrivateDaemon:
    binary = _lib.find_native("subletd", "SUBLETD")
    workdir = tempfile.mkdtemp(prefix="sublet-")
    socket = os.path.join(workdir, f"gpu{device}.sock")
    argv = [str(binary), "--device", str(device), "--socket", socket, "--backend", backend,
            "--parent-pid", str(os.getpid())]
    with open(os.path.join(workdir, "subletd.log"), "wb") as log:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                   start_new_session=True)  # Ctrl-C is ours, not the daemon's
    daemon = PrivateDaemon(process, socket, workdir, os.getpid())
    if not _private:
        atexit.register(_stop_all)
    _wait_until_answering(daemon, " ".join(argv))
    return daemon


def _wait_until_answering(daemon: PrivateDaemon, command: str) -> None:
    """Waits for the socket to accept a connection (it exists a moment before it listens)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if daemon.process.poll() is not None:
            daemon.stop()
            raise DaemonUnavailableError(
                f"the private subletd exited with status {daemon.process.returncode} at start "
                f"({command}). Its output:\n{daemon.stderr_tail()}")
        if os.path.exists(daemon.socket):
            try:
                _lib.lib().sublet_disconnect(_connect(daemon.socket))
                return
            except DaemonUnavailableError:
                pass
        if time.monotonic() > deadline:
            tail = daemon.stderr_tail()
            daemon.stop()
            raise DaemonUnavailableError(
                f"the private subletd did not answer on {daemon.socket} within "
                f"{START_TIMEOUT_S:.0f} s ({command}; $SUBLET_DAEMON_START_TIMEOUT sets the "
                f"limit). Its output:\n{tail}")
        time.sleep(0.01)


def _stop_all() -> None:
    with _private_lock:
        for daemon in _private.values():
            daemon.stop()
        _private.clear()


def _forget_after_fork() -> None:
    # The child must neither stop its parent's daemons nor use its parent's connections.
    _private.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
